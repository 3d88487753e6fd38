//! `fairledger logs ID [-f]`: what a workload's run wrote, read over the API from anywhere;
//! `--follow` prints it as it comes and picks up where it broke off if the connection drops.

use std::io::{Read, Write};

use super::*;

/// Which output `fairledger logs` prints.
#[derive(clap::Args, Clone, Debug)]
pub struct LogsArgs {
    /// Workload id.
    pub id: String,
    /// Keep printing output as it is written, until the run ends (waits for a workload that
    /// has not started yet).
    #[arg(long, short)]
    pub follow: bool,
    /// Which run: 1 for its first start (the latest by default).
    #[arg(long)]
    pub run: Option<u64>,
    /// Which node of a gang (its first by default).
    #[arg(long)]
    pub node: Option<String>,
    /// Only the last this many lines.
    #[arg(long)]
    pub tail: Option<u64>,
}

/// A dropped connection of a followed read is tried again this many times in a row.
const RECONNECTS: u32 = 10;

pub fn logs(args: &ClientArgs, which: &LogsArgs) -> Result<(), String> {
    let api = Api::new(args)?;
    let id = which.id.trim();
    uuid::Uuid::parse_str(id).map_err(|_| {
        format!("{id:?} is not a workload id; `fairledger jobs` lists yours with their ids")
    })?;
    let (mut run, mut node) = (which.run, which.node.clone());
    let mut from: Option<u64> = None;
    let mut failures = 0;
    let stdout = std::io::stdout();
    loop {
        let mut query = Vec::new();
        if let Some(r) = run {
            query.push(("run", r.to_string()));
        }
        if let Some(n) = &node {
            query.push(("node", n.clone()));
        }
        match from {
            Some(f) => query.push(("from", f.to_string())),
            None => {
                if let Some(t) = which.tail {
                    query.push(("tail", t.to_string()));
                }
            }
        }
        if which.follow {
            query.push(("follow", "true".into()));
        }
        let url = format!(
            "{}{}",
            api.base,
            with_query(&format!("/v1/workloads/{id}/logs"), &query)
        );
        let sent = api.request("GET", &url).call();
        let mut response = match sent {
            Ok(r) => r,
            Err(e) if from.is_some() && failures < RECONNECTS => {
                failures += 1;
                eprintln!("fairledger: the connection broke ({e}); reading on");
                std::thread::sleep(std::time::Duration::from_secs(1));
                continue;
            }
            Err(e) => return Err(unreachable(&api.base, &e)),
        };
        if response.status().as_u16() >= 400 {
            let text = response.body_mut().read_to_string().unwrap_or_default();
            let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            return Err(value["detail"]
                .as_str()
                .unwrap_or("the API refused to show the output")
                .to_owned());
        }
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let offset: u64 = header("fairledger-offset").parse().unwrap_or(0);
        if from.is_none() {
            let nodes: Vec<String> = header("fairledger-nodes")
                .split(',')
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect();
            let (r, runs, n) = (
                header("fairledger-run"),
                header("fairledger-runs"),
                header("fairledger-node"),
            );
            if runs != "1" && run.is_none() {
                eprintln!("fairledger: run {r} of {runs} (--run N for another)");
            }
            if nodes.len() > 1 && node.is_none() {
                eprintln!(
                    "fairledger: the gang ran on {}; this is {n}'s output (--node for another)",
                    nodes.join(", ")
                );
            }
            let dropped: u64 = header("fairledger-dropped").parse().unwrap_or(0);
            if dropped > 0 {
                eprintln!(
                    "fairledger: the first {dropped} bytes asked for are no longer kept (output is kept bounded per run)"
                );
            }
            // A reconnect reads on from the same run and node.
            run = r.parse().ok();
            node = Some(n).filter(|n| !n.is_empty());
        }
        let mut body = response.into_body().into_reader();
        let mut read = 0u64;
        let mut buf = vec![0; 64 * 1024];
        let broke = loop {
            match body.read(&mut buf) {
                Ok(0) => break None,
                Ok(n) => {
                    read += n as u64;
                    failures = 0;
                    let mut out = stdout.lock();
                    if out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                        // The reader went away (a closed pipe): nothing more to do.
                        return Ok(());
                    }
                }
                Err(e) => break Some(e),
            }
        };
        match broke {
            None => return Ok(()),
            Some(e) if which.follow && failures < RECONNECTS => {
                failures += 1;
                eprintln!("fairledger: the connection broke ({e}); reading on");
                from = Some(offset + read);
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            Some(e) => return Err(format!("the output broke off: {e}; run the command again")),
        }
    }
}
