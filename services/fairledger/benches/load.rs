//! A load generator for `fairledger serve`, end to end over HTTP on loopback.
//!
//! ```sh
//! cargo bench -p fairledger --bench load                  # embedded log
//! FAIRLEDGER_BENCH_NATS=1 cargo bench -p fairledger --bench load   # JetStream (needs nats-server)
//! ```
//!
//! Two phases, each against a fresh server whose cluster is 1,000 nodes × 8 GPUs with no agents
//! (so capacity stays free and nothing ends):
//! 1. throughput: `FAIRLEDGER_BENCH_CLIENTS` (64) closed-loop clients, each on its own
//!    keep-alive connection, submit 1-GPU workloads for `FAIRLEDGER_BENCH_SECONDS` (10) s;
//!    submissions/s and p50/p99 latency of an accepted submission (durable and folded). The
//!    clients are tasks on one thread (hyper's HTTP/1 client), so they take as little of the
//!    machine from the server as a load generator can.
//! 2. submit-to-start: one client submits with `?wait=placed` 500 times while capacity is free;
//!    p50/p99 of the time until the answer shows it running.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_fairledger");

struct Server {
    child: Child,
    base: String,
    /// `Bearer <the first admin's token>`.
    authorization: String,
    _nats: Option<eventlog::testing::NatsServer>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(nats: bool) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "[[nodes]]\ncount = 1000\ngpus = 8\nmodel = \"H100\"\n\n\
         [[allocations]]\npath = \"lab/a\"\nweight = 1\n\n\
         [[allocations]]\npath = \"lab/b\"\nweight = 1\n",
    )
    .unwrap();
    let nats = nats.then(eventlog::testing::NatsServer::start);
    let mut cmd = Command::new(BIN);
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--data")
        .arg(dir.path().join("data"))
        .arg("--no-agents")
        .env("FAIRLEDGER_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(n) = &nats {
        cmd.args(["--nats", &n.url()]);
    }
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let base = loop {
        let line = lines.next().expect("serve exited").unwrap();
        if let Some(addr) = line.strip_prefix("listening on ") {
            break addr.to_owned();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let token = std::fs::read_to_string(dir.path().join("data/admin.token")).unwrap();
    Server {
        child,
        base,
        authorization: format!("Bearer {}", token.trim()),
        _nats: nats,
        _dir: dir,
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `clients` closed-loop clients, each on its own connection, POST `body` to `/v1/workloads`
/// for `seconds` as the first admin: the latencies of the accepted submissions, and how many
/// were not accepted.
fn submit_for(
    server: &Server,
    body: &'static str,
    clients: u64,
    seconds: u64,
) -> (Vec<Duration>, u64) {
    use http_body_util::{BodyExt, Full};
    let addr = server.base.trim_start_matches("http://").to_owned();
    let authorization = server.authorization.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let tasks: Vec<_> = (0..clients)
            .map(|_| {
                let (addr, authorization) = (addr.clone(), authorization.clone());
                tokio::spawn(async move {
                    let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
                    stream.set_nodelay(true).unwrap();
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let (mut sender, connection) =
                        hyper::client::conn::http1::handshake(io).await.unwrap();
                    tokio::spawn(connection);
                    let mut latencies = Vec::new();
                    let mut failed = 0u64;
                    while Instant::now() < deadline {
                        let request = hyper::Request::post("/v1/workloads")
                            .header(hyper::header::HOST, &addr)
                            .header(hyper::header::CONTENT_TYPE, "application/json")
                            .header(hyper::header::AUTHORIZATION, &authorization)
                            .body(Full::new(bytes::Bytes::from_static(body.as_bytes())))
                            .unwrap();
                        let t = Instant::now();
                        let accepted = match sender.send_request(request).await {
                            // Reading the answer to its end keeps the connection usable.
                            Ok(r) => r.status() == 202 && r.into_body().collect().await.is_ok(),
                            Err(_) => false,
                        };
                        if accepted {
                            latencies.push(t.elapsed());
                        } else {
                            failed += 1;
                            sender.ready().await.expect("the connection closed");
                        }
                    }
                    (latencies, failed)
                })
            })
            .collect();
        let mut latencies = Vec::new();
        let mut failed = 0;
        for task in tasks {
            let (l, f) = task.await.unwrap();
            latencies.extend(l);
            failed += f;
        }
        (latencies, failed)
    })
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: run small then.
    let quick = !std::env::args().any(|a| a == "--bench");
    let nats = std::env::var("FAIRLEDGER_BENCH_NATS").is_ok_and(|v| v == "1");
    let clients = env_or("FAIRLEDGER_BENCH_CLIENTS", 64);
    let seconds = env_or("FAIRLEDGER_BENCH_SECONDS", if quick { 1 } else { 10 });
    let backend = if nats {
        "JetStream on loopback"
    } else {
        "embedded log"
    };

    // Phase 1: sustained submissions.
    let server = start(nats);
    let body = r#"{"allocation":"lab/a","gpus_per_node":1,"duration_estimate_s":3600}"#;
    let started = Instant::now();
    let (mut latencies, failed) = submit_for(&server, body, clients, seconds);
    let wall = started.elapsed();
    latencies.sort();
    assert!(!latencies.is_empty(), "no submission succeeded");
    println!(
        "{backend}: {clients} clients for {seconds} s: {} submissions accepted ({failed} failed), {:.0}/s; latency p50 {:.1} ms, p99 {:.1} ms",
        latencies.len(),
        latencies.len() as f64 / wall.as_secs_f64(),
        percentile(&latencies, 0.50).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
    );
    assert_eq!(failed, 0, "submissions were refused");
    drop(server);

    // Phase 2: submit to start, with capacity free.
    let server = start(nats);
    let url = format!("{}/v1/workloads?wait=placed&timeout_s=10", server.base);
    let agent = agent();
    let n = if quick { 20 } else { 500 };
    let mut to_start = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut answer = agent
            .post(&url)
            .header("content-type", "application/json")
            .header("authorization", &server.authorization)
            .send(body)
            .unwrap();
        let text = answer.body_mut().read_to_string().unwrap();
        assert!(text.contains("\"running\""), "not placed: {text}");
        to_start.push(t.elapsed());
    }
    to_start.sort();
    println!(
        "{backend}: submit to start with capacity free, {n} workloads one at a time: p50 {:.1} ms, p99 {:.1} ms",
        percentile(&to_start, 0.50).as_secs_f64() * 1e3,
        percentile(&to_start, 0.99).as_secs_f64() * 1e3,
    );
}
