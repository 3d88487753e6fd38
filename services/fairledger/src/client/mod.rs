//! The command-line client of a running `fairledger serve` (`--api`, default the local one):
//! `submit`, `status`, `cancel`, `explain`, `settings` and `alloc` here; `queue`, `jobs`, `nodes`
//! (`listings`), `logs`, `events`, `token`, `whoami` (`events`), `audit` and `whatif` in modules
//! of their own. Tables for
//! people by default, in the shape squeue, sshare and sreport users know; `--json` for scripts.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::common::{is_local, read_token_file, warn_if_clear};

mod audit;
mod budget;
mod events;
mod listings;
mod logs;
mod whatif;

pub use audit::{audit, audit_head};
pub use events::{events, token_command, whoami, EventsArgs, TokenCommand};
pub use listings::{jobs, nodes, queue, JobsArgs, NodesArgs, QueueArgs};
pub use logs::{logs, LogsArgs};
pub use whatif::{what_if, WhatIfArgs};

/// The API every client command talks to when none is named.
pub const LOCAL_API: &str = "http://127.0.0.1:8080";

/// Where the API is, who is asking, and how to print.
#[derive(clap::Args, Clone, Debug)]
pub struct ClientArgs {
    /// The API's base URL.
    #[arg(long, env = "FAIRLEDGER_API", default_value = LOCAL_API, global = true)]
    pub api: String,
    /// A file holding the token to send (else the FAIRLEDGER_TOKEN variable; else, for a server
    /// on this machine, the first admin's token in DATA/admin.token).
    #[arg(long, env = "FAIRLEDGER_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// The CA certificate (PEM) to check an https API's certificate against (default: the
    /// web's public roots).
    #[arg(long, env = "FAIRLEDGER_CA_FILE", global = true)]
    pub ca_file: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The token to send: `--token-file`, else `FAIRLEDGER_TOKEN`, else, for a server on this
/// machine, the first admin's token that `serve` wrote to `DATA/admin.token` (DATA from
/// `FAIRLEDGER_DATA`, default `fairledger-data`). `None` when there is none.
pub fn token(api: &str, token_file: Option<&Path>) -> Result<Option<String>, String> {
    if let Some(path) = token_file {
        return read_token_file(path).map(Some);
    }
    if let Ok(token) = std::env::var("FAIRLEDGER_TOKEN") {
        let token = token.trim().to_owned();
        if !token.is_empty() {
            return Ok(Some(token));
        }
    }
    if is_local(api) {
        let data = std::env::var_os("FAIRLEDGER_DATA")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("fairledger-data"));
        let path = data.join(api::application::ADMIN_TOKEN_FILE);
        if path.exists() {
            return read_token_file(&path).map(Some);
        }
    }
    Ok(None)
}

/// The server's clock at its latest answer (its `Date` header, to the second), in ms since the
/// epoch; 0 before any. Relative times ("in 42m", how long work has waited) are read against
/// it: the client never reads its own machine's clock, which may be off from the ledger's.
static SERVER_NOW_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The server's clock as of its latest answer; `None` before any answer carried one.
fn server_now_ms() -> Option<u64> {
    Some(SERVER_NOW_MS.load(std::sync::atomic::Ordering::Relaxed)).filter(|&ms| ms > 0)
}

/// A thin HTTP client that turns problem+json answers into one-line errors.
struct Api {
    base: String,
    agent: ureq::Agent,
    authorization: Option<String>,
}

impl Api {
    fn new(args: &ClientArgs) -> Result<Self, String> {
        let token = token(&args.api, args.token_file.as_deref())?;
        warn_if_clear(&args.api, token.is_some());
        Ok(Api {
            base: args.api.trim_end_matches('/').to_owned(),
            agent: agent::http::client(args.ca_file.as_deref(), None)?,
            authorization: token.map(|t| format!("Bearer {t}")),
        })
    }

    /// A request of `method` to `url`, with the token when there is one.
    fn request(
        &self,
        method: &str,
        url: &str,
    ) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let builder = match method {
            "GET" => self.agent.get(url),
            _ => self.agent.delete(url),
        };
        match &self.authorization {
            Some(a) => builder.header("authorization", a),
            None => builder,
        }
    }

    fn request_with_body(
        &self,
        method: &str,
        url: &str,
    ) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        let builder = match method {
            "POST" => self.agent.post(url),
            _ => self.agent.put(url),
        };
        let builder = builder.header("content-type", "application/json");
        match &self.authorization {
            Some(a) => builder.header("authorization", a),
            None => builder,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let sent = match (method, body) {
            ("GET" | "DELETE", None) => self.request(method, &url).call(),
            ("POST" | "PUT", Some(b)) => self.request_with_body(method, &url).send(b.to_string()),
            _ => unreachable!("{method} with {body:?}"),
        };
        let mut response = sent.map_err(|e| unreachable(&self.base, &e))?;
        let date = (response.headers().get("date"))
            .and_then(|d| httpdate::parse_http_date(d.to_str().ok()?).ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        if let Some(since_epoch) = date {
            let ms = u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX);
            SERVER_NOW_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
        }
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("reading the answer of {url}: {e}"))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if status >= 400 {
            let detail = value["detail"]
                .as_str()
                .unwrap_or("the API refused the request");
            if status == 401 && self.authorization.is_none() {
                return Err(format!(
                    "{detail}; set FAIRLEDGER_TOKEN or pass --token-file (a local server's first admin token is in fairledger-data/admin.token)"
                ));
            }
            return Err(match value["field"].as_str() {
                Some(field) => format!("{detail} (field {field})"),
                None => detail.to_owned(),
            });
        }
        Ok(value)
    }
}

/// What to submit.
#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    /// Leaf allocation to charge (omit for unallocated, always-preemptible work).
    #[arg(long, short)]
    pub allocation: Option<String>,
    /// GPUs on each node.
    #[arg(long, short)]
    pub gpus: u32,
    /// Nodes in the gang.
    #[arg(long, short, default_value_t = 1)]
    pub nodes: u32,
    /// A name.
    #[arg(long)]
    pub name: Option<String>,
    /// Required GPU model.
    #[arg(long)]
    pub model: Option<String>,
    /// Priority within the allocation (higher first).
    #[arg(long, default_value_t = 0)]
    pub priority: i32,
    /// Protection from preemption asked for (at most the cluster's cap): seconds, a span such
    /// as `1h30m`, or `D-HH:MM:SS` as Slurm writes it.
    #[arg(long, value_parser = seconds)]
    pub min_runtime: Option<u64>,
    /// Expected run time (same forms).
    #[arg(long, visible_alias = "time", value_parser = seconds)]
    pub duration: Option<u64>,
    /// Checkpoint interval (same forms).
    #[arg(long, value_parser = seconds)]
    pub checkpoint: Option<u64>,
    /// Wait until it is placed, up to this long (same forms); fails (exit status 1) if it is
    /// not.
    #[arg(long, value_parser = seconds)]
    pub wait: Option<u64>,
    /// Submit nothing: say whether it would be accepted, and where and when it would start,
    /// or where it would wait and why, and whom the policy would preempt for it (Slurm's
    /// `sbatch --test-only`).
    #[arg(long, conflicts_with = "wait")]
    pub test_only: bool,
    /// Post its events (started, preemption requested, stopped, requeued, finished,
    /// cancelled) to this URL, signed with your notification secret (like sbatch
    /// --mail-type=ALL).
    #[arg(long)]
    pub notify: Option<String>,
    /// The command the node agent runs.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// `fairledger alloc …`.
#[derive(clap::Subcommand, Debug)]
pub enum AllocCommand {
    /// The tree with shares, owed and delivered (like sshare).
    List,
    /// One allocation's budget: share, caps and quotas, owed and held now, owed against
    /// delivered over the usage window and since the start, and the last week day by day.
    Show {
        /// Path, e.g. ai2/olmo/pretrain.
        path: String,
    },
    /// Create or change an allocation.
    Set {
        /// Path, e.g. ai2/olmo/pretrain.
        path: String,
        /// Weight among its siblings.
        #[arg(long)]
        weight: u32,
        /// Cap on the GPUs its subtree may hold.
        #[arg(long)]
        max_gpus: Option<u32>,
        /// Most workloads its subtree may have waiting at once (more are refused, 429).
        #[arg(long)]
        max_pending: Option<u32>,
        /// Most GPUs its subtree's waiting workloads may ask for at once.
        #[arg(long)]
        max_pending_gpus: Option<u64>,
        /// Change nothing: show who would get what over the next 24 hours with the change,
        /// side by side with what happens without it (a what-if, which admins, auditors and
        /// submitters for their own allocations may ask).
        #[arg(long)]
        preview: bool,
    },
    /// Remove an allocation with no children and no live workloads.
    Rm {
        /// Path.
        path: String,
    },
}

/// `fairledger settings …`
#[derive(clap::Subcommand)]
pub enum SettingsCommand {
    /// The settings in force, and the event that set them.
    Show,
    /// Change settings (admin): NAME=VALUE for each, the others kept as they are. Written to
    /// the log, folded by everyone from its position on.
    Set {
        /// For example margin=0.1 grace_s=600 policy=fairtree.
        #[arg(required = true, value_name = "NAME=VALUE")]
        assignments: Vec<String>,
    },
}

fn print(args: &ClientArgs, value: &Value, table: impl FnOnce(&Value) -> String) {
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).expect("serializes")
        );
    } else {
        // Names and messages come from others: what could move the cursor or clear the
        // screen is shown escaped.
        for line in table(value).lines() {
            println!("{}", ledger::names::terminal_safe(line));
        }
    }
}

fn hours(v: &Value) -> String {
    format!("{:.2}", v.as_f64().unwrap_or(0.0))
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => ledger::names::terminal_safe(s).into_owned(),
        other => other.to_string(),
    }
}

/// Formats rows as left-aligned columns.
fn columns(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out += cell;
            } else {
                out += &format!("{cell:<w$}  ");
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        out += &line(row);
    }
    out
}

/// Why the API at `base` could not be asked, and what to do about it: the cause named, not a
/// guess (advice to start a server that is running and answering something else misleads).
fn unreachable(base: &str, e: &ureq::Error) -> String {
    use ureq::Error as E;
    let why = match e {
        E::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            "nothing listens there (connection refused); start it with `fairledger serve`, or \
             pass --api with its address"
                .to_owned()
        }
        E::ConnectionFailed => "the connection failed; start it with `fairledger serve`, or \
             pass --api with its address"
            .to_owned(),
        E::HostNotFound => "its host name is not known; check the host in --api".to_owned(),
        // rustls reports a failed handshake as invalid data.
        E::Io(io)
            if base.starts_with("https://") && io.kind() == std::io::ErrorKind::InvalidData =>
        {
            tls_failed(e)
        }
        E::Io(io) => format!("{io}; check the host and port in --api"),
        E::BadUri(_) | E::Http(_) => {
            format!("it is not a usable URL ({e}); pass --api like http://127.0.0.1:8080")
        }
        E::Timeout(_) => format!("it did not answer in time ({e}); check the address in --api"),
        E::Tls(_) | E::Rustls(_) | E::Pem(_) | E::TlsRequired => tls_failed(e),
        E::Protocol(_) => format!(
            "what answers there does not speak HTTP as expected ({e}); use https:// only for a \
             server with TLS, and check the port"
        ),
        _ => e.to_string(),
    };
    format!("cannot reach the API at {base}: {why}")
}

fn tls_failed(e: &ureq::Error) -> String {
    let what = e.to_string();
    if what.contains("CaUsedAsEndEntity") {
        // openssl's usual self-signed recipe marks the certificate a CA, which browsers and
        // curl forgive and rustls does not.
        return format!(
            "TLS failed ({what}): the server's certificate is marked as a CA (CA:TRUE, as `openssl req -x509` makes it); make a CA and a certificate it signs with `fairledger tls self-signed --host NAME`, or add -addext basicConstraints=critical,CA:FALSE to openssl"
        );
    }
    format!(
        "TLS failed ({what}); use http:// for a server without TLS, and pass --ca-file for one \
         whose certificate a private CA signed"
    )
}

pub fn submit(args: &ClientArgs, s: SubmitArgs) -> Result<(), String> {
    let api = Api::new(args)?;
    let body = json!({
        "allocation": s.allocation, "gpus_per_node": s.gpus, "nodes": s.nodes, "name": s.name,
        "model": s.model, "priority": s.priority, "min_runtime_s": s.min_runtime,
        "duration_estimate_s": s.duration, "checkpoint_s": s.checkpoint, "command": s.command,
        "notify": s.notify,
    });
    if s.test_only {
        let v = api.call("POST", "/v1/workloads?dry_run=true", Some(&body))?;
        print(args, &v, dry_run_text);
        return Ok(());
    }
    let path = match s.wait {
        Some(t) => format!("/v1/workloads?wait=placed&timeout_s={t}"),
        None => "/v1/workloads".into(),
    };
    let v = api.call("POST", &path, Some(&body))?;
    let phase = v["workload"]["phase"]
        .as_str()
        .or(v["phase"].as_str())
        .unwrap_or("pending");
    print(args, &v, |v| {
        format!("submitted {} ({phase})\n", text(&v["id"]))
    });
    match s.wait {
        // Submitted, but not what the caller waited for: a script must be able to tell.
        Some(t) if phase == "pending" => {
            let id = text(&v["id"]);
            Err(format!(
                "workload {id} was not placed within {t} s; it stays queued (`fairledger explain {id}` says why)"
            ))
        }
        _ => Ok(()),
    }
}

/// What `submit --test-only` says of a dry run's answer.
fn dry_run_text(v: &Value) -> String {
    if v["duplicate"] == true {
        return format!(
            "nothing would be submitted: this idempotency key made {} before\n",
            text(&v["id"])
        );
    }
    let mut out = String::new();
    if v["would"] == "start" {
        let on: Vec<String> = v["placement"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                let gpus: Vec<String> = p["gpus"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(text)
                    .collect();
                format!("{}:{}", text(&p["node"]), gpus.join(","))
            })
            .collect();
        out += &format!("would start now on {}", on.join(" "));
        if let Some(until) = v["borrowed"]["until_ms"].as_u64() {
            out += &format!(", on GPUs lent until {}", when(&Value::from(until)));
        }
        out += &format!(
            "; protected from preemption until {}\n",
            when(&v["protected_until_ms"])
        );
    } else {
        out += &format!(
            "would wait: {} of {} in the queue, {}: {}\n",
            text(&v["position"]),
            text(&v["of"]),
            text(&v["reason"]["code"]).replace('_', " "),
            text(&v["reason"]["detail"]),
        );
        let e = &v["estimate"];
        match (e["start_at_ms"].as_u64(), e["not_before_ms"].as_u64()) {
            (Some(at), _) => {
                out += &format!("estimated start {}: {}\n", when(&Value::from(at)), text(&e["how"]))
            }
            (_, Some(at)) => {
                out += &format!("not before {}: {}\n", when(&Value::from(at)), text(&e["how"]))
            }
            _ => out += "no start in sight: no running work it waits for has an estimate or a contract ending; a duration estimate lets work borrow idle GPUs\n",
        }
    }
    out += &alternatives_text(&v["alternatives"])
        .replace(" (submitted again so, in place of this one)", "");
    let preempts = v["preempts"].as_array().cloned().unwrap_or_default();
    if !preempts.is_empty() {
        out += &format!(
            "{} running workload(s) would be preempted for it:\n",
            preempts.len()
        );
        out += &columns(
            &["ID", "ALLOCATION", "GPUS", "REASON"],
            preempts
                .iter()
                .map(|p| {
                    vec![
                        text(&p["id"]),
                        text(&p["allocation"]),
                        text(&p["gpus"]),
                        text(&p["reason"]),
                    ]
                })
                .collect(),
        );
    }
    out + "nothing was submitted (--test-only)\n"
}

pub fn status(args: &ClientArgs, id: &str) -> Result<(), String> {
    let v = Api::new(args)?.call("GET", &format!("/v1/workloads/{id}"), None)?;
    print(args, &v, |w| {
        let placement: Vec<String> = w["placement"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| format!("{}:{}", text(&p["node"]), text(&p["gpus"])))
            .collect();
        let lines = [
            ("id", text(&w["id"])),
            ("name", text(&w["name"])),
            (
                "state",
                format!("{} ({})", text(&w["state"]), text(&w["phase"])),
            ),
            ("allocation", text(&w["allocation"])),
            ("user", text(&w["user"])),
            (
                "gpus",
                format!("{} x {}", text(&w["nodes"]), text(&w["gpus_per_node"])),
            ),
            (
                "placement",
                if placement.is_empty() {
                    "-".into()
                } else {
                    placement.join(" ")
                },
            ),
            ("submitted", when(&w["submitted_at_ms"])),
            ("started", when(&w["started_at_ms"])),
            ("protected", when(&w["protected_until_ms"])),
            ("ended", when(&w["ended_at_ms"])),
            (
                "elapsed",
                match w["preemptions"].as_u64().unwrap_or(0) {
                    0 => format!(
                        "{} in {} run(s)",
                        clock(w["elapsed_ms"].as_u64().unwrap_or(0)),
                        text(&w["starts"])
                    ),
                    n => format!(
                        "{} in {} run(s), preempted {n} time{}",
                        clock(w["elapsed_ms"].as_u64().unwrap_or(0)),
                        text(&w["starts"]),
                        if n == 1 { "" } else { "s" }
                    ),
                },
            ),
            ("gpu-hours", hours(&w["gpu_hours"])),
            (
                "exit",
                match w["error"].as_str() {
                    Some(e) => format!("error: {}", ledger::names::terminal_safe(e)),
                    None => exit(w),
                },
            ),
            (
                "output",
                match output(w).as_str() {
                    "-" => "-".to_owned(),
                    o => format!(
                        "fairledger logs {} (on the node: {o}, under its agent's work directory)",
                        text(&w["id"])
                    ),
                },
            ),
            ("notified", notified(&w["notifications"])),
        ];
        lines
            .iter()
            .map(|(k, v)| format!("{k:<11} {v}\n"))
            .collect()
    });
    Ok(())
}

pub fn cancel(args: &ClientArgs, id: &str) -> Result<(), String> {
    let v = Api::new(args)?.call("DELETE", &format!("/v1/workloads/{id}"), None)?;
    print(args, &v, |v| {
        format!(
            "{}: {}\n",
            text(&v["id"]),
            text(&v["action"]).replace('_', " ")
        )
    });
    Ok(())
}

/// `path` with the query `pairs`, encoded (a `+` in a time's offset stays a `+`).
fn with_query(path: &str, pairs: &[(&str, String)]) -> String {
    if pairs.is_empty() {
        return path.to_owned();
    }
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        query.append_pair(k, v);
    }
    format!("{path}?{}", query.finish())
}

/// How a workload ended: its exit code, the signal that ended it, or `error` when its node
/// could not launch it; "-" while it has not.
fn exit(w: &Value) -> String {
    if let Some(sig) = w["signal"].as_i64() {
        return signal_name(sig);
    }
    if let Some(code) = w["exit_code"].as_i64() {
        return code.to_string();
    }
    if w["error"].is_string() {
        return "error".into();
    }
    "-".into()
}

/// A signal by its name (`SIGKILL`), or its number where this system has no name for it.
fn signal_name(sig: i64) -> String {
    #[cfg(unix)]
    if let Some(s) = i32::try_from(sig)
        .ok()
        .and_then(|n| nix::sys::signal::Signal::try_from(n).ok())
    {
        return s.as_str().to_owned();
    }
    format!("signal {sig}")
}

/// How a workload's notifications stand: where they go, how many were delivered, and the last
/// failure; "-" for a workload without them.
fn notified(n: &Value) -> String {
    if n.is_null() {
        return "-".into();
    }
    let mut s = format!(
        "{} delivered, {} pending to {}",
        n["delivered"],
        n["pending"],
        text(&n["to"])
    );
    if n["given_up"].as_u64().unwrap_or(0) > 0 {
        s += &format!(", {} given up", n["given_up"]);
    }
    if let Some(e) = n["last_error"].as_str() {
        s += &format!(" (last try: {})", ledger::names::terminal_safe(e));
    }
    s
}

/// Where the output of a workload's current or last run is: `node:path` under that node
/// agent's `--work-dir`.
fn output(w: &Value) -> String {
    match (w["ran_on"][0].as_str(), w["output_log"].as_str()) {
        (Some(node), Some(log)) => format!("{}:{}", ledger::names::terminal_safe(node), log),
        _ => "-".into(),
    }
}

/// A time as a table shows it: the UTC date-time to the second; "-" when there is none.
fn date_time(ms: &Value) -> String {
    let Some(ms) = ms.as_u64() else {
        return "-".into();
    };
    let t = api::period::format_instant(ms);
    t.get(..19).unwrap_or(&t).replace('T', " ")
}

/// A duration a person typed, in whole seconds: seconds (`3600`), a span (`1h30m`, `90s`,
/// `2d 4h`), or Slurm's `[D-]HH:MM:SS` or `MM:SS`.
pub fn seconds(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad =
        || format!("{text:?} is not a duration: give seconds (5400), a span (1h30m) or D-HH:MM:SS");
    if let Ok(s) = t.parse::<u64>() {
        return Ok(s);
    }
    if t.contains(':') {
        let (days, clock) = match t.split_once('-') {
            Some((d, rest)) => (d.parse::<u64>().map_err(|_| bad())?, rest),
            None => (0, t),
        };
        let parts: Vec<u64> = clock
            .split(':')
            .map(|p| p.parse::<u64>().ok().filter(|_| p.len() == 2))
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        let (h, m, s) = match parts[..] {
            [h, m, s] => (h, m, s),
            [m, s] if days == 0 => (0, m, s),
            _ => return Err(bad()),
        };
        if m >= 60 || s >= 60 || (days > 0 && h >= 24) {
            return Err(bad());
        }
        return Ok(days * 86_400 + h * 3_600 + m * 60 + s);
    }
    humantime::parse_duration(t)
        .map(|d| d.as_secs())
        .map_err(|_| bad())
}

/// A duration as Slurm prints it: `HH:MM:SS`, with `D-` in front from a day on.
pub fn clock(ms: u64) -> String {
    sim::html::clock(ms / 1000)
}

/// `fairledger nodes …`.
#[derive(clap::Subcommand, Debug)]
pub enum NodesCommand {
    /// Drain a node: no new work is placed there; what runs there runs on.
    Drain {
        /// The node.
        node: String,
        /// Why, for the audit.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Resume a drained node: it takes work again.
    Resume {
        /// The node.
        node: String,
    },
}

/// ", preempted N times before" when it was, for a sentence about a workload.
fn preempted_before(v: &Value) -> String {
    match v["preemptions"].as_u64().unwrap_or(0) {
        0 => String::new(),
        1 => ", preempted once before".to_owned(),
        n => format!(", preempted {n} times before"),
    }
}

pub fn explain(args: &ClientArgs, id: &str) -> Result<(), String> {
    let v = Api::new(args)?.call("GET", &format!("/v1/workloads/{id}/explain"), None)?;
    print(args, &v, |v| {
        if v["phase"] == "running" {
            let mut protected = if v["at_the_limit"] == true {
                format!(
                    "as often as the policy preempts one workload: left alone until {}",
                    when(&v["left_alone_until_ms"])
                )
            } else if v["left_alone_until_ms"].is_u64() {
                format!("left alone until {}", when(&v["left_alone_until_ms"]))
            } else {
                format!(
                    "protected from preemption until {}",
                    when(&v["protected_until_ms"])
                )
            };
            if v["borrowed_until_ms"].is_u64() {
                protected += &format!(
                    "; on lent GPUs, which their lender may take back from {}",
                    when(&v["borrowed_until_ms"])
                );
            }
            return format!(
                "{} is running since {}{}, {protected}{}\n",
                text(&v["id"]),
                when(&v["started_at_ms"]),
                preempted_before(v),
                if v["preempting"] == true {
                    "; it is being asked to stop"
                } else {
                    ""
                },
            );
        }
        if v["phase"] != "pending" {
            return format!(
                "{} is {}: {}\n",
                text(&v["id"]),
                text(&v["phase"]),
                text(&v["detail"])
            );
        }
        let mut out = format!(
            "{} is {} of {} in the queue{}: {}\n",
            text(&v["id"]),
            text(&v["position"]),
            text(&v["of"]),
            preempted_before(v),
            text(&v["reason"]["detail"])
        );
        if let Some(e) = v["estimate"].as_object() {
            let at = when(
                e.get("start_at_ms")
                    .or(e.get("not_before_ms"))
                    .unwrap_or(&Value::Null),
            );
            out += &format!(
                "estimated start: {at}; {}\n",
                e.get("how").map(text).unwrap_or_default()
            );
        }
        if let Some(meaning) = v["key_meaning"].as_str() {
            out += &format!(
                "its allocation's key: {} ({}: {meaning})\n",
                key(&v["key"]),
                text(&v["policy"])
            );
        }
        let ahead = v["allocations_ahead"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !ahead.is_empty() {
            out += "ahead of it, by allocation:\n";
            let rows = ahead
                .iter()
                .map(|a| {
                    vec![
                        format!("  {}", text(&a["allocation"])),
                        key(&a["key"]),
                        text(&a["workloads"]),
                        text(&a["gpus"]),
                    ]
                })
                .collect();
            out += &columns(&["  ALLOCATION", "KEY", "WORKLOADS", "GPUS"], rows);
        }
        for a in v["ahead"].as_array().into_iter().flatten() {
            out += &format!(
                "  ahead: {} ({}, {} GPUs)\n",
                text(&a["id"]),
                text(&a["allocation"]),
                text(&a["gpus"])
            );
        }
        out + &alternatives_text(&v["alternatives"])
    });
    Ok(())
}

/// The changes that would start a workload sooner, as a table, best first; nothing when none
/// would.
fn alternatives_text(alternatives: &Value) -> String {
    let rows: Vec<Vec<String>> = alternatives
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| {
            let at = &a["estimated_start_ms"];
            vec![
                format!("  {}", text(&a["what"])),
                match (a["would"].as_str(), a["exact"].as_bool()) {
                    (Some("start"), _) => "now".to_owned(),
                    (_, Some(false)) => format!("not before {}", when(at)),
                    _ => when(at),
                },
            ]
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    "it would start sooner with (submitted again so, in place of this one):\n".to_owned()
        + &columns(&["  CHANGE", "ESTIMATED START"], rows)
}

/// `fairledger settings`: show them, or change some.
pub fn settings(args: &ClientArgs, command: SettingsCommand) -> Result<(), String> {
    let api = Api::new(args)?;
    let now = api.call("GET", "/v1/settings", None)?;
    let v = match command {
        SettingsCommand::Show => now,
        SettingsCommand::Set { assignments } => {
            let mut settings = serde_json::Map::new();
            for a in &assignments {
                let (name, value) = a
                    .split_once('=')
                    .ok_or_else(|| format!("{a:?}: write NAME=VALUE, e.g. grace_s=600"))?;
                if now["settings"].get(name).is_none() {
                    let names: Vec<&str> = now["settings"]
                        .as_object()
                        .map(|m| m.keys().map(String::as_str).collect())
                        .unwrap_or_default();
                    return Err(format!(
                        "{name:?} is not a setting; use one of {}",
                        names.join(", ")
                    ));
                }
                // Text for a setting that is text (a policy's name, a label), a list for one
                // that is a list (comma-separated: `notify_urls=https://a/,https://b/`, or
                // empty for none); numbers and booleans as JSON otherwise.
                let value = match serde_json::from_str::<Value>(value) {
                    Ok(v) if now["settings"][name].is_array() && v.is_array() => v,
                    _ if now["settings"][name].is_array() => Value::Array(
                        value
                            .split(',')
                            .map(str::trim)
                            .filter(|v| !v.is_empty())
                            .map(|v| Value::String(v.to_owned()))
                            .collect(),
                    ),
                    Ok(v)
                        if !now["settings"][name].is_string()
                            && (v.is_number() || v.is_boolean()) =>
                    {
                        v
                    }
                    _ => Value::String(value.to_owned()),
                };
                settings.insert(name.to_owned(), value);
            }
            api.call("PUT", "/v1/settings", Some(&Value::Object(settings)))?
        }
    };
    print(args, &v, |v| {
        let source = match v["seq"].as_u64() {
            Some(seq) => format!("set by event {seq}"),
            None => "the defaults: the log sets none".to_owned(),
        };
        let rows = v["settings"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| vec![k.clone(), text(v)])
            .collect();
        format!("{}\n({source})", columns(&["SETTING", "VALUE"], rows))
    });
    Ok(())
}

pub fn alloc(args: &ClientArgs, command: AllocCommand) -> Result<(), String> {
    let api = Api::new(args)?;
    match command {
        AllocCommand::Show { path } => return budget::show(args, &path),
        AllocCommand::List => {
            let v = api.call("GET", "/v1/allocations", None)?;
            print(args, &v, |v| {
                let rows = v["allocations"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| {
                        let path = text(&a["path"]);
                        let depth = path.matches('/').count();
                        let f = |k: &str| a[k].as_f64().unwrap_or(0.0);
                        let ratio = match f("window_owed_gpu_hours") {
                            o if o > 0.0 => format!("{:.2}", f("window_delivered_gpu_hours") / o),
                            _ => "-".into(),
                        };
                        vec![
                            format!("{}{path}", "  ".repeat(depth)),
                            text(&a["weight"]),
                            format!("{:.1}%", 100.0 * f("share")),
                            text(&a["max_gpus"]),
                            format!("{:.1}", f("owed_gpus_now")),
                            text(&a["held_gpus"]),
                            text(&a["demand_gpus"]),
                            hours(&a["window_owed_gpu_hours"]),
                            hours(&a["window_delivered_gpu_hours"]),
                            ratio,
                            hours(&a["owed_gpu_hours"]),
                            hours(&a["delivered_gpu_hours"]),
                        ]
                    })
                    .collect();
                let mut out = columns(
                    &[
                        "ALLOCATION",
                        "WEIGHT",
                        "SHARE",
                        "MAX_GPUS",
                        "OWED_NOW",
                        "HELD",
                        "DEMAND",
                        "WINDOW_OWED_H",
                        "WINDOW_DELIVERED_H",
                        "DELIVERED/OWED",
                        "OWED_GPU_H",
                        "DELIVERED_GPU_H",
                    ],
                    rows,
                );
                out += "(SHARE: of the cluster, by weight down the tree; OWED_NOW, HELD, DEMAND: GPUs; WINDOW: the usage window; the last two: since the beginning)\n";
                out
            });
        }
        AllocCommand::Set {
            path,
            weight,
            max_gpus,
            preview: true,
            ..
        } => {
            let mut change = json!({"allocation": path, "weight": weight});
            if let Some(cap) = max_gpus {
                change["max_gpus"] = json!(cap);
            }
            whatif::preview(args, vec![change], 24 * 3_600)?;
            if !args.json {
                println!(
                    "nothing was changed (--preview); run it again without --preview to apply"
                );
            }
        }
        AllocCommand::Set {
            path,
            weight,
            max_gpus,
            max_pending,
            max_pending_gpus,
            preview: false,
        } => {
            let v = api.call(
                "PUT",
                &format!("/v1/allocations/{path}"),
                Some(&json!({
                    "weight": weight, "max_gpus": max_gpus,
                    "max_pending_workloads": max_pending, "max_pending_gpus": max_pending_gpus,
                })),
            )?;
            print(args, &v, |v| {
                format!("set {} (sequence {})\n", text(&v["path"]), text(&v["seq"]))
            });
        }
        AllocCommand::Rm { path } => {
            let v = api.call("DELETE", &format!("/v1/allocations/{path}"), None)?;
            print(args, &v, |v| format!("removed {}\n", text(&v["path"])));
        }
    }
    Ok(())
}

/// A ranking key: three decimals, `-` when there is none, `inf` for an allocation that holds
/// GPUs it is owed nothing for.
fn key(v: &Value) -> String {
    match v.as_f64() {
        None => "-".into(),
        Some(k) if k >= f64::MAX / 2.0 => "inf".into(),
        Some(k) => format!("{k:.3}"),
    }
}

/// A time as people read it: the UTC date-time to the second, and how far it is from the
/// server's now ("2026-12-05 19:20:07 UTC (in 42m)"); "-" when there is none.
fn when(ms: &Value) -> String {
    let Some(ms) = ms.as_u64() else {
        return "-".into();
    };
    let day_and_time = date_time(&Value::from(ms));
    let Some(now) = server_now_ms() else {
        return format!("{day_and_time} UTC");
    };
    let relative = if ms >= now {
        format!("in {}", span((ms - now) / 1000))
    } else {
        format!("{} ago", span((now - ms) / 1000))
    };
    format!("{day_and_time} UTC ({relative})")
}

/// A span of seconds in its two largest units: "45s", "42m", "3h 5m", "2d 4h".
fn span(s: u64) -> String {
    let (d, h, m) = (s / 86_400, s / 3_600 % 24, s / 60 % 60);
    match () {
        _ if d > 0 => format!("{d}d {h}h"),
        _ if h > 0 => format!("{h}h {m}m"),
        _ if m > 0 => format!("{m}m"),
        _ => format!("{s}s"),
    }
}
