//! Helpers shared by the tests that run the `fairledger` binary as a process.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_fairledger");

pub struct Server {
    pub child: Child,
    pub addr: String,
    /// The data directory (`--data`).
    pub data: std::path::PathBuf,
    /// The token its calls send: the first admin's, when this server created it.
    pub token: Option<String>,
    /// Everything it has written to stderr so far.
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let data = args
            .iter()
            .position(|a| *a == "--data")
            .map(|i| std::path::PathBuf::from(args[i + 1]))
            .expect("tests give every server a --data directory of its own");
        let mut child = Command::new(BIN)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let keep = |line: &str| {
            let mut all = stderr.lock().unwrap();
            all.push_str(line);
            all.push('\n');
        };
        let addr = loop {
            let line = lines
                .next()
                .expect("serve exited before listening")
                .unwrap();
            keep(&line);
            if let Some(addr) = line
                .strip_prefix("listening on http://")
                .or_else(|| line.strip_prefix("listening on https://"))
            {
                break addr.to_owned();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        let kept = stderr.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let mut all = kept.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        let token = std::fs::read_to_string(data.join("admin.token"))
            .ok()
            .map(|t| t.trim().to_owned());
        Server {
            child,
            addr,
            data,
            token,
            stderr,
        }
    }

    /// The first admin's token file, for the command-line client.
    pub fn token_file(&self) -> String {
        self.data.join("admin.token").to_str().unwrap().to_owned()
    }

    /// Calls the API with this server's token.
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        self.call_as(self.token.as_deref(), method, path, body)
    }

    /// Calls the API with `token` (`None`: anonymously).
    pub fn call_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> (u16, Value) {
        call_at(&self.addr, token, method, path, body)
    }

    /// Grants `name` a role (scoped by `allocations` or `node`) as the first admin; answers the
    /// token.
    pub fn grant(
        &self,
        name: &str,
        role: &str,
        allocations: &[&str],
        node: Option<&str>,
    ) -> String {
        let body = serde_json::json!({"name": name, "role": role, "allocations": allocations, "node": node});
        let (status, answer) = self.call("POST", "/v1/tokens", Some(&body.to_string()));
        assert_eq!(status, 201, "{answer}");
        answer["token"].as_str().unwrap().to_owned()
    }

    pub fn stop(mut self) -> std::process::ExitStatus {
        // SIGTERM: a graceful shutdown.
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "serve did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The runs of the agents inside it outlive a SIGKILL, as runs outlive their agent.
        kill_runs(&self.data);
    }
}

/// Kills every run found under `root`: the process group of its shim (`shim.pid`) and of its
/// workload (`pid`, the leader of the workload's own group). Runs outlive their agent by design,
/// and must not outlive the test that made them.
pub fn kill_runs(root: &std::path::Path) {
    let mut stack = vec![(root.to_owned(), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() && depth < 5 {
                stack.push((path, depth + 1));
            } else if path
                .file_name()
                .is_some_and(|n| n == "shim.pid" || n == "pid")
            {
                let pid = std::fs::read_to_string(&path).unwrap_or_default();
                if let Some(pid) = pid
                    .split_whitespace()
                    .next()
                    .filter(|p| p.parse::<u32>().is_ok())
                {
                    let _ = Command::new("kill")
                        .args(["-KILL", "--", &format!("-{pid}")])
                        .stderr(Stdio::null())
                        .status();
                }
            }
        }
    }
}

/// Waits for workload `id` to reach `phase`; on a timeout, prints the ledger and fails.
pub fn wait_for(server: &Server, id: &str, phase: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
        assert_eq!(status, 200, "{row}");
        if row["phase"] == phase {
            return row;
        }
        if Instant::now() > deadline {
            let (_, events) = server.call("GET", "/v1/events?limit=1000", None);
            for e in events["events"].as_array().into_iter().flatten() {
                eprintln!("{e}");
            }
            let (_, audit) = server.call("GET", &format!("/v1/audit/workloads/{id}"), None);
            eprintln!("rejected: {}", audit["rejected_seqs"]);
            panic!("{id} never became {phase}: {row}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `serve` in `role` on the nats-server at `url`, with `dir` for its data.
pub fn on_nats(url: &str, role: &str, dir: &tempfile::TempDir) -> Server {
    Server::start(&[
        "--nats",
        url,
        "--role",
        role,
        "--data",
        dir.path().to_str().unwrap(),
    ])
}

/// Runs the binary with `args`, which must succeed, and reads what it printed as JSON.
pub fn json_of<T: serde::de::DeserializeOwned>(args: &[&str]) -> T {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Calls the API at `addr` with `token` (`None`: anonymously), from any thread.
pub fn call_at(
    addr: &str,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.unwrap_or("");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let status: u16 = response[9..12].parse().unwrap();
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// `fairledger agent` as a process, killed with the test, its runs too.
pub struct Agent {
    pub child: Child,
    pub stderr: PathBuf,
    /// Its work directory, whose runs die with the test (none after [`Agent::kill9`], whose
    /// runs must outlive it for the next agent).
    pub work: Option<PathBuf>,
}

impl Agent {
    pub fn start(nats: &str, node: &str, work: &Path, extra: &[&str]) -> Agent {
        Agent::start_with(&["--nats", nats], node, work, extra)
    }

    pub fn start_with(link: &[&str], node: &str, work: &Path, extra: &[&str]) -> Agent {
        Agent::start_with_env(link, node, work, extra, &[])
    }

    pub fn start_with_env(
        link: &[&str],
        node: &str,
        work: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let stderr = work.with_extension(format!("{}.log", std::process::id()));
        let child = Command::new(BIN)
            .envs(env.iter().copied())
            .arg("agent")
            .args(link)
            .args(["--node", node, "--heartbeat-s", "0.5"])
            .arg("--work-dir")
            .arg(work)
            .args(extra)
            .env("FAIRLEDGER_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Agent {
            child,
            stderr,
            work: Some(work.to_owned()),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn kill9(mut self) {
        self.work = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- agent log ---\n{}", self.log());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(work) = &self.work {
            kill_runs(work);
        }
    }
}

/// Submits `body` with `token` (the first admin's when `None`); answers its id.
pub fn submit_as(server: &Server, token: Option<&str>, body: &Value) -> String {
    let token = token.or(server.token.as_deref());
    let (status, answer) = server.call_as(token, "POST", "/v1/workloads", Some(&body.to_string()));
    assert_eq!(status, 202, "{answer}");
    answer["id"].as_str().unwrap().to_owned()
}

/// Waits up to `secs` for `check`, failing the test with `what` after.
pub fn wait_until(what: &str, secs: u64, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for `node` to be registered.
pub fn wait_for_node(server: &Server, node: &str) {
    wait_until(&format!("node {node} to register"), 30, || {
        let (_, nodes) = server.call("GET", "/v1/nodes", None);
        nodes["nodes"]
            .as_array()
            .is_some_and(|n| n.iter().any(|n| n["node"] == node))
    });
}

/// Runs the command-line client against `server` with its token; returns its stdout, or its
/// stderr on failure.
pub fn cli(server: &Server, args: &[&str]) -> Result<String, String> {
    let out = Command::new(BIN)
        .args(args)
        .args(["--api", &format!("http://{}", server.addr)])
        .args(["--token-file", &server.token_file()])
        .output()
        .unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8(out.stderr).unwrap())
    }
}
