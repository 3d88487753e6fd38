//! The chain of heads: the server's head, the audit rows' heads, an export's head recomputed by
//! an independent implementation (schemas/chain_head.py), and `audit verify --head` on exact
//! and altered copies of the log, embedded and on JetStream.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use eventlog::testing::NatsServer;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The head after `at` of the events in `file`, as the Python script computes it.
fn python_head(file: &Path, at: u64) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../schemas/chain_head.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--at", &at.to_string()])
        .arg(file)
        .output()
        .expect("python3 runs the independent implementation");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

fn import(events: &Path, log: &[&str]) {
    let mut args = vec!["log", "import"];
    args.extend_from_slice(log);
    args.push(events.to_str().unwrap());
    let (ok, out, err) = run(&args);
    assert!(ok, "{out}{err}");
}

fn verify_head(log: &[&str], head: &str) -> (bool, String, String) {
    let mut args = vec!["audit", "verify"];
    args.extend_from_slice(log);
    args.extend_from_slice(&["--head", head]);
    run(&args)
}

#[test]
fn an_auditor_holding_a_head_proves_the_history_behind_it_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let data_arg = data.to_str().unwrap();
    let server = Server::start(&["--data", data_arg]);
    // Some history: a workload run to its end, a name in another script.
    let (status, placed) = server.call(
        "POST",
        "/v1/workloads?wait=placed&timeout_s=20",
        Some(r#"{"allocation":"ai2/tulu","gpus_per_node":2,"duration_estimate_s":1,"name":"ünïcode-☃"}"#),
    );
    assert_eq!(status, 200, "{placed}");
    wait_for(&server, placed["id"].as_str().unwrap(), "finished");
    // A number beyond what a double holds exactly, which RFC 8785 writes as ECMAScript does.
    let (status, big) = server.call(
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"ai2/tulu","gpus_per_node":8,"nodes":4,"duration_estimate_s":18446744073709551615}"#),
    );
    assert_eq!(status, 202, "{big}");
    let (status, head) = server.call("GET", "/v1/audit/head", None);
    assert_eq!(status, 200, "{head}");
    let seq = head["seq"].as_u64().unwrap();
    let hash = head["hash"].as_str().unwrap().to_owned();
    assert!(seq >= 4, "{head}");
    assert_eq!(hash.len(), 64);
    // The same from the command line.
    let token = server.token_file();
    let api = format!("http://{}", server.addr);
    let (ok, printed, err) = run(&["audit", "head", "--api", &api, "--token-file", &token]);
    assert!(ok, "{err}");
    let printed_seq: u64 = printed.trim().split(':').next().unwrap().parse().unwrap();
    assert!(printed_seq >= seq, "{printed}");
    // Each audit row carries the head as its period closed, or as read while it is open.
    let (status, audit) = server.call("GET", "/v1/audit/ledger?granularity=month", None);
    assert_eq!(status, 200, "{audit}");
    let row = &audit["rows"][0];
    assert!(row["head_seq"].as_u64().unwrap() >= seq, "{audit}");
    assert_eq!(row["head_hash"].as_str().unwrap().len(), 64, "{audit}");
    server.stop();

    // An export, chained by an implementation that shares no code with the server.
    let export = dir.path().join("events.jsonl");
    let (ok, _, err) = run(&[
        "log",
        "export",
        "--data",
        data_arg,
        "--out",
        export.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(python_head(&export, seq), format!("{seq}:{hash}"));
    let at_row = row["head_seq"].as_u64().unwrap();
    assert_eq!(
        python_head(&export, at_row),
        format!("{at_row}:{}", row["head_hash"].as_str().unwrap())
    );

    // The log itself passes; a head it does not have fails, saying so.
    let held = format!("{seq}:{hash}");
    let (ok, out, err) = verify_head(&["--data", data_arg], &held);
    assert!(ok, "{out}{err}");
    assert!(out.contains("unchanged"), "{out}");
    let wrong = format!("{seq}:{}", "0".repeat(64));
    let (ok, _, err) = verify_head(&["--data", data_arg], &wrong);
    assert!(!ok && err.contains("differs"), "{err}");
    let (ok, _, err) = verify_head(&["--data", data_arg], "12:beef");
    assert!(!ok && err.contains("--head"), "{err}");

    // An exact copy passes, on the embedded log and on JetStream.
    let copy = dir.path().join("copy");
    let copy_arg = copy.to_str().unwrap();
    import(&export, &["--data", copy_arg]);
    let (ok, out, err) = verify_head(&["--data", copy_arg], &held);
    assert!(ok, "{out}{err}");
    let nats = NatsServer::start();
    let nats_data = dir.path().join("nats-data");
    let url = nats.url();
    let on_nats = [
        "--nats",
        url.as_str(),
        "--data",
        nats_data.to_str().unwrap(),
    ];
    import(&export, &on_nats);
    let (ok, out, err) = verify_head(&on_nats, &held);
    assert!(ok, "{out}{err}");

    // A copy with one event altered (the workload's name) fails at and after it, not before.
    let text = std::fs::read_to_string(&export).unwrap();
    let altered_at = text
        .lines()
        .position(|l| l.contains("ünïcode-☃"))
        .expect("the submission is in the export") as u64
        + 1;
    let altered = dir.path().join("altered.jsonl");
    std::fs::write(&altered, text.replace("ünïcode-☃", "unicode-x")).unwrap();
    let forged = dir.path().join("forged");
    let forged_arg = forged.to_str().unwrap();
    import(&altered, &["--data", forged_arg]);
    let (ok, _, err) = verify_head(&["--data", forged_arg], &held);
    assert!(!ok && err.contains("differs"), "{err}");
    let before = python_head(&export, altered_at - 1);
    let (ok, out, err) = verify_head(&["--data", forged_arg], &before);
    assert!(
        ok,
        "the history before the altered event is unchanged: {out}{err}"
    );
}
