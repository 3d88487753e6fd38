//! Runs' output from anywhere: a job's stdout and stderr shipped by its node's agent and read
//! over the API and with `fairledger logs` — after the run ended, followed while it runs,
//! across an agent's restart — with the embedded log (an agent over HTTP) and on NATS (an agent
//! on NATS); and only by those who may.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{submit_as, wait_for, wait_for_node, Agent, Server, BIN};
use eventlog::testing::NatsServer;
use serde_json::json;

fn cluster(dir: &Path) -> String {
    let path = dir.join("cluster.toml");
    std::fs::write(
        &path,
        "[policy]\nmin_runtime_s = 3600\n\n[[allocations]]\npath = \"lab/a\"\nweight = 1\n",
    )
    .unwrap();
    path.to_str().unwrap().to_owned()
}

/// A job that prints `tick 1` to `tick N` a `gap` apart (odd ones on stderr), then `done`.
fn ticks(n: u32, gap: f64) -> serde_json::Value {
    json!(["sh", "-c", format!(
        "i=1; while [ $i -le {n} ]; do if [ $((i % 2)) -eq 1 ]; then echo tick $i >&2; else echo tick $i; fi; i=$((i+1)); sleep {gap}; done; echo done"
    )])
}

fn expected(n: u32) -> String {
    (1..=n).map(|i| format!("tick {i}\n")).collect::<String>() + "done\n"
}

/// `fairledger logs` with `args` as `token`'s holder: (success, stdout, stderr).
fn logs(server: &Server, token_file: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .arg("logs")
        .args([
            "--api",
            &format!("http://{}", server.addr),
            "--token-file",
            token_file,
        ])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The head of the answer to GET `path` with `token`, lower-case.
fn head_of(server: &Server, token: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(&server.addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    .unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let text = String::from_utf8_lossy(&all).to_lowercase();
    text.split("\r\n\r\n").next().unwrap_or("").to_owned()
}

fn token_file(dir: &Path, name: &str, token: &str) -> String {
    let path = dir.join(format!("{name}.token"));
    std::fs::write(&path, token).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Output read after the run, followed while it runs, across a restart of the agent, by whom
/// may read it; with `agent_link` the way the agent reaches the service.
fn output_from_anywhere(server: &Server, dir: &Path, start_agent: &dyn Fn() -> Agent) {
    let alice = server.grant("alice", "submitter", &["lab"], None);
    let bob = server.grant("bob", "submitter", &["lab"], None);
    let viewer = server.grant("vera", "viewer", &[], None);
    let (alice_file, bob_file, viewer_file) = (
        token_file(dir, "alice", &alice),
        token_file(dir, "bob", &bob),
        token_file(dir, "vera", &viewer),
    );
    let mut agent = start_agent();
    wait_for_node(server, "gpu-1");

    // Followed from before it starts: the lines arrive while it runs.
    let body = json!({"allocation": "lab/a", "gpus_per_node": 1, "command": ticks(8, 1.0)});
    let id = submit_as(server, Some(&alice), &body);
    let mut follower = Command::new(BIN)
        .arg("logs")
        .args([
            "--api",
            &format!("http://{}", server.addr),
            "--token-file",
            &alice_file,
        ])
        .args(["-f", &id])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut followed = BufReader::new(follower.stdout.take().unwrap());
    let mut first = String::new();
    followed.read_line(&mut first).unwrap();
    assert_eq!(first, "tick 1\n");
    let (_, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
    assert_eq!(
        row["phase"], "running",
        "the first line came while it ran: {row}"
    );

    // The agent dies and comes back while the job runs: nothing is lost or shipped twice.
    let work = agent.work.clone();
    agent.kill9();
    std::thread::sleep(Duration::from_secs(2));
    let restarted = start_agent();
    assert_eq!(restarted.work, work);
    agent = restarted;
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut followed, &mut rest).unwrap();
    assert!(follower.wait().unwrap().success());
    assert_eq!(first + &rest, expected(8), "followed across the restart");
    wait_for(server, &id, "finished");

    // After the end, whole and its tail, by its submitter, an operator's peers and the admin.
    let (ok, all, err) = logs(server, &alice_file, &[&id]);
    assert!(ok, "{err}");
    assert_eq!(all, expected(8));
    let (ok, tail, err) = logs(server, &alice_file, &["--tail", "2", &id]);
    assert!(ok, "{err}");
    assert_eq!(tail, "tick 8\ndone\n");
    let head = head_of(server, &alice, &format!("/v1/workloads/{id}/logs?tail=0"));
    for h in [
        "fairledger-run: 1",
        "fairledger-node: gpu-1",
        "fairledger-ended: true",
        "fairledger-dropped: 0",
        "content-type: text/plain",
    ] {
        assert!(head.contains(h), "{h} in {head}");
    }
    let (ok, admin, _) = logs(server, &server.token_file(), &["--run", "1", &id]);
    assert!(ok);
    assert_eq!(admin, expected(8));
    // A job that ends as soon as it prints: read right after its end, without following, its
    // output is whole (the agent ships every half second and reports the end at once; the read
    // waits for the last chunk).
    let quick =
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": ["sh", "-c", "echo quick"]});
    let quick = submit_as(server, Some(&alice), &quick);
    wait_for(server, &quick, "finished");
    let (ok, out, err) = logs(server, &alice_file, &[&quick]);
    assert!(ok, "{err}");
    assert_eq!(out, "quick\n");
    // Not another submitter, nor a viewer: output can hold secrets.
    let (ok, _, err) = logs(server, &bob_file, &[&id]);
    assert!(!ok && err.contains("submitter"), "{err}");
    let (ok, _, err) = logs(server, &viewer_file, &[&id]);
    assert!(!ok && err.contains("role"), "{err}");
    // Bad asks are named.
    let (ok, _, err) = logs(server, &alice_file, &["--run", "2", &id]);
    assert!(!ok && err.contains("no run 2"), "{err}");
    let (ok, _, err) = logs(server, &alice_file, &["--node", "gpu-9", &id]);
    assert!(!ok && err.contains("did not run on node gpu-9"), "{err}");
    let (status, problem) = server.call(
        "GET",
        &format!("/v1/workloads/{id}/logs?tail=1&from=3"),
        None,
    );
    assert_eq!((status, problem["field"].as_str()), (422, Some("tail")));
    // A node's agent may ship its own node's output only.
    let (status, problem) = server.call_as(
        Some(&alice),
        "POST",
        &format!("/v1/nodes/gpu-1/output/{id}/1?offset=0"),
        Some("forged"),
    );
    assert_eq!(status, 403, "{problem}");
    drop(agent);
}

#[test]
fn output_from_anywhere_with_the_embedded_log_and_an_agent_over_http() {
    let tmp = tempfile::tempdir().unwrap();
    let config = cluster(tmp.path());
    let server = Server::start(&[
        "--data",
        tmp.path().join("data").to_str().unwrap(),
        "--config",
        &config,
    ]);
    let api = format!("http://{}", server.addr);
    let token = server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    let work = tmp.path().join("agent");
    output_from_anywhere(&server, tmp.path(), &|| {
        Agent::start_with_env(
            &["--api", &api],
            "gpu-1",
            &work,
            &["--fake-gpus", "1"],
            &[("FAIRLEDGER_TOKEN", &token)],
        )
    });
}

#[test]
fn output_from_anywhere_on_nats_with_an_agent_on_nats() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let config = cluster(tmp.path());
    let url = nats.url();
    let server = Server::start(&[
        "--nats",
        &url,
        "--data",
        tmp.path().join("data").to_str().unwrap(),
        "--config",
        &config,
    ]);
    // An agent on NATS writes its own events: the ledger must grant it, as over HTTP.
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    let work = tmp.path().join("agent");
    output_from_anywhere(&server, tmp.path(), &|| {
        Agent::start(&url, "gpu-1", &work, &["--fake-gpus", "1"])
    });
}
