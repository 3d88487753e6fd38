//! `fairledger serve` as a process, on port 0: on the embedded log with the demo cluster
//! (submit → placed → finished by the fake agents → the allocation's delivered GPU-hours are
//! exactly the run's), across a graceful restart, and on a real nats-server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use eventlog::testing::NatsServer;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_fairledger");

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("serve exited before listening")
                .unwrap();
            if let Some(addr) = line.strip_prefix("listening on http://") {
                break addr.to_owned();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        let body = body.unwrap_or("");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut response = String::new();
        s.read_to_string(&mut response).unwrap();
        let status: u16 = response[9..12].parse().unwrap();
        let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    fn stop(mut self) -> std::process::ExitStatus {
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
    }
}

fn wait_for(server: &Server, id: &str, phase: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
        assert_eq!(status, 200, "{row}");
        if row["phase"] == phase {
            return row;
        }
        assert!(
            Instant::now() < deadline,
            "{id} never became {phase}: {row}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn embedded_submit_run_finish_and_audit_across_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let data_arg = data.path().to_str().unwrap();
    let server = Server::start(&["--data", data_arg]);
    let (status, placed) = server.call(
        "POST",
        "/v1/workloads?wait=placed&timeout_s=20",
        Some(r#"{"allocation":"ai2/tulu","gpus_per_node":4,"duration_estimate_s":1}"#),
    );
    assert_eq!(status, 200, "{placed}");
    assert_eq!(placed["workload"]["phase"], "running");
    let id = placed["id"].as_str().unwrap().to_owned();
    let row = wait_for(&server, &id, "finished");
    let ran_ms = row["ended_at_ms"].as_u64().unwrap() - row["started_at_ms"].as_u64().unwrap();
    assert!(ran_ms >= 1000, "it ran {ran_ms} ms");
    let (_, allocations) = server.call("GET", "/v1/allocations", None);
    let tulu = allocations["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "ai2/tulu")
        .unwrap()
        .clone();
    let delivered = tulu["delivered_gpu_hours"].as_f64().unwrap();
    let expected = 4.0 * ran_ms as f64 / 3.6e6;
    assert!(
        (delivered - expected).abs() < 1e-12,
        "delivered {delivered} GPU-hours, the run was {expected}"
    );
    // The audit re-derives the same figure from the ledger, for the period around the run.
    let started = row["started_at_ms"].as_u64().unwrap();
    let ended = row["ended_at_ms"].as_u64().unwrap();
    let period = format!(
        "/v1/audit/ledger?allocation=ai2/tulu&granularity=hour&from={}&to={}",
        started - 1000,
        ended + 1000
    );
    let (status, audit) = server.call("GET", &period, None);
    assert_eq!(status, 200, "{audit}");
    let rows = audit["rows"].as_array().unwrap();
    assert!(rows.iter().all(|r| r["allocation"] == "ai2/tulu"));
    let audited: f64 = rows
        .iter()
        .map(|r| r["delivered_gpu_hours"].as_f64().unwrap())
        .sum();
    assert!(
        (audited - expected).abs() < 1e-12,
        "audited {audited}, the run was {expected}"
    );
    assert!(server.stop().success(), "a graceful shutdown exits 0");

    // Restarted on the same data: the same answers, no second demo cluster.
    let server = Server::start(&["--data", data_arg]);
    let again = wait_for(&server, &id, "finished");
    assert_eq!(again, row);
    let (_, events) = server.call("GET", "/v1/events?limit=1000", None);
    let registered = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"]["type"] == "node_registered")
        .count();
    assert_eq!(registered, 4);
}

#[test]
fn on_nats_a_submission_is_placed() {
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(&[
        "--nats",
        &nats.url(),
        "--data",
        data.path().to_str().unwrap(),
    ]);
    let (status, _) = server.call("PUT", "/v1/allocations/team", Some(r#"{"weight":1}"#));
    assert_eq!(status, 200);
    // No nodes yet: a submission has nowhere to go and says so.
    let (status, problem) = server.call(
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"team","gpus_per_node":1}"#),
    );
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "gpus_per_node");
    let (status, _) = server.call(
        "POST",
        "/v1/nodes",
        Some(r#"{"node":"gpu-1","gpus":8,"model":"H100","labels":{"rack":"r1"}}"#),
    );
    assert_eq!(status, 201);
    let (status, placed) = server.call(
        "POST",
        "/v1/workloads?wait=placed&timeout_s=20",
        Some(r#"{"allocation":"team","gpus_per_node":8}"#),
    );
    assert_eq!(status, 200, "{placed}");
    assert_eq!(placed["workload"]["placement"][0]["node"], "gpu-1");
    assert!(server.stop().success());
    // Everything went through JetStream, on the team's subjects.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let subjects: Vec<String> = rt.block_on(async {
        use eventlog::EventLog;
        let log = eventlog::JetStreamLog::connect(&nats.url(), Default::default())
            .await
            .unwrap();
        log.read(1, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.subject)
            .collect()
    });
    assert_eq!(
        subjects,
        vec![
            "fairledger.ledger.allocation.set.team",
            "fairledger.ledger.node.registered.gpu-1",
            "fairledger.ledger.workload.submitted.team",
            "fairledger.ledger.workload.started.team",
        ]
    );
}
