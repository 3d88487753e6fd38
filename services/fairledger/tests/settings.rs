//! The ledger's settings live in the log: the server writes them first, its agents fold by
//! them, an admin changes them with an event, and a server started with other settings refuses
//! to fold the log by them unless asked to make them the log's.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// `serve` with `args`, which must refuse to start: what it said.
fn refused(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    err
}

#[test]
fn settings_are_the_logs_and_every_folder_follows_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.toml");
    // A contract cap of 12 h (the default is 8 h).
    std::fs::write(
        &config,
        "[policy]\nmax_min_runtime_s = 43200\n\
         [[nodes]]\ncount = 1\ngpus = 2\nmodel = \"A100\"\n\
         [[allocations]]\npath = \"lab/x\"\nweight = 1\n",
    )
    .unwrap();
    let data = dir.path().join("data");
    let (config_arg, data_arg) = (config.to_str().unwrap(), data.to_str().unwrap());
    let server = Server::start(&["--config", config_arg, "--data", data_arg]);
    let (status, s) = server.call("GET", "/v1/settings", None);
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["source"], "log", "{s}");
    // After the service's own grants (the root `serve`, then `scheduler`), before anything
    // they rule.
    assert_eq!(
        s["seq"], 3,
        "the settings are the log's first event but the service's: {s}"
    );
    assert_eq!(s["settings"]["max_min_runtime_s"], 43200, "{s}");
    // 10 h of protection: over the default cap, within the log's. The node's agent, which
    // folds the log itself, launches it and reports its end.
    let (status, placed) = server.call(
        "POST",
        "/v1/workloads?wait=placed&timeout_s=20",
        Some(r#"{"allocation":"lab/x","gpus_per_node":1,"min_runtime_s":36000,"duration_estimate_s":1}"#),
    );
    assert_eq!(status, 200, "{placed}");
    let id = placed["id"].as_str().unwrap().to_owned();
    wait_for(&server, &id, "finished");

    // An admin changes a setting through the command line: an event, in force from there.
    let token = server.token_file();
    let api = format!("http://{}", server.addr);
    let client = ["--api", api.as_str(), "--token-file", token.as_str()];
    let mut set = vec!["settings", "set", "grace_s=600", "margin=0.1"];
    set.extend_from_slice(&client);
    let (ok, out, err) = run(&set);
    assert!(ok, "{err}");
    assert!(out.contains("grace_s") && out.contains("600"), "{out}");
    let (_, s) = server.call("GET", "/v1/settings", None);
    assert_eq!(s["settings"]["grace_s"], 600, "{s}");
    assert_eq!(s["settings"]["margin"], 0.1, "{s}");
    assert_eq!(
        s["settings"]["max_min_runtime_s"], 43200,
        "the rest kept: {s}"
    );
    let changed_at = s["seq"].as_u64().unwrap();
    assert!(changed_at > 1);
    // Out of bounds: refused naming the setting, nothing written; a viewer may not change them.
    let (status, problem) = server.call("PUT", "/v1/settings", Some(r#"{"margin": 12}"#));
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "margin", "{problem}");
    let (status, problem) = server.call("PUT", "/v1/settings", Some(r#"{"grace": 1}"#));
    assert_eq!(status, 422, "{problem}");
    let viewer = server.grant("eve", "viewer", &[], None);
    let (status, _) = server.call_as(Some(&viewer), "PUT", "/v1/settings", Some("{}"));
    assert_eq!(status, 403);
    let (_, s) = server.call("GET", "/v1/settings", None);
    assert_eq!(s["seq"], changed_at, "{s}");
    let mut bad = vec!["settings", "set", "nonsense=1"];
    bad.extend_from_slice(&client);
    let (ok, _, err) = run(&bad);
    assert!(!ok && err.contains("not a setting"), "{err}");
    server.stop();

    // The config no longer says what the log does (grace 300 against 600): refused, naming it.
    let err = refused(&["--config", config_arg, "--data", data_arg]);
    assert!(
        err.contains("grace_s") && err.contains("--change-settings"),
        "{err}"
    );
    // Without settings of its own, a server folds by the log's, from the checkpoint it left
    // at its stop (settings the log changed are not other settings of its projection's).
    let server = Server::start(&["--data", data_arg]);
    let (_, s) = server.call("GET", "/v1/settings", None);
    assert_eq!(
        (s["seq"].as_u64(), &s["settings"]["grace_s"]),
        (Some(changed_at), &600.into())
    );
    let log = server.stderr.lock().unwrap().clone();
    assert!(!log.contains("rebuilding"), "{log}");
    server.stop();
    // A flag alone is compared alone: the others stay the log's.
    let err = refused(&["--data", data_arg, "--heartbeat-timeout-s", "45"]);
    assert!(
        err.contains("heartbeat_timeout_s") && !err.contains("grace_s"),
        "{err}"
    );
    // Asked to, it makes the config's the log's from now on.
    let server = Server::start(&[
        "--config",
        config_arg,
        "--data",
        data_arg,
        "--change-settings",
    ]);
    let (_, s) = server.call("GET", "/v1/settings", None);
    assert_eq!(s["settings"]["grace_s"], 300, "{s}");
    assert!(s["seq"].as_u64().unwrap() > changed_at, "{s}");
    server.stop();

    // An offline refold (the audit's) folds the log by its own settings and agrees with the
    // server's kept figures.
    std::thread::sleep(Duration::from_millis(100));
    let (ok, out, err) = run(&["audit", "verify", "--data", data_arg]);
    assert!(ok, "{out}{err}");
    // The log is minutes old: every period is still under way, and is verified all the same.
    assert!(
        out.contains("all agree") && !out.contains("compared 0 "),
        "{out}"
    );
    // Authority held from the root `serve` wrote for itself, the log's first event.
    assert!(
        out.contains("authority: from event 1 (the root, \"serve\") on, every event applied was written by a principal holding the authority it needed; 0 refused"),
        "{out}"
    );
}

/// Authority is the log's too: an `allocation_set` written into a served log by hand, under a
/// name nobody granted, is refused by the fold when the server next folds it (and by every
/// refold after), while the same change by the granted admin, imported the same way, applies.
#[test]
fn an_event_imported_under_a_name_nobody_granted_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "[[nodes]]\ncount = 1\ngpus = 2\nmodel = \"A100\"\n\
         [[allocations]]\npath = \"lab/x\"\nweight = 1\n",
    )
    .unwrap();
    let data = dir.path().join("data");
    let (config_arg, data_arg) = (config.to_str().unwrap(), data.to_str().unwrap());
    let server = Server::start(&["--config", config_arg, "--data", data_arg]);
    server.stop();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let forged = |actor: &str, weight: u32| {
        serde_json::json!({
            "id": uuid::Uuid::now_v7(), "schema_version": ledger::event::SCHEMA_VERSION,
            "occurred_at_ms": now, "actor": actor, "type": "allocation_set",
            "payload": {"path": "lab/x", "weight": weight},
        })
        .to_string()
    };
    let file = dir.path().join("forged.jsonl");
    std::fs::write(
        &file,
        format!(
            "{}\n{}\n",
            forged("user:admin", 3),
            forged("user:mallory", 99)
        ),
    )
    .unwrap();
    let (ok, _, err) = run(&["log", "import", "--data", data_arg, file.to_str().unwrap()]);
    assert!(ok, "{err}");
    let server = Server::start(&["--data", data_arg]);
    let (status, all) = server.call("GET", "/v1/allocations", None);
    assert_eq!(status, 200, "{all}");
    let a = all["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "lab/x")
        .unwrap_or_else(|| panic!("{all}"));
    assert_eq!(
        a["weight"], 3,
        "mallory's weight 99 was refused, the admin's 3 applied: {a}"
    );
    server.stop();
    // An offline refold says where authority started and that it refused one event.
    let (ok, out, err) = run(&["audit", "verify", "--data", data_arg]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("1 refused for want of it"), "{out}");
}
