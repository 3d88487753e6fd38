//! `fairledger serve` as a process, on port 0: on the embedded log with the demo cluster
//! (submit → placed → finished by the fake agents → the allocation's delivered GPU-hours are
//! exactly the run's), across a graceful restart, and on a real nats-server.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use eventlog::testing::NatsServer;
use serde_json::Value;

mod common;

use common::{cli, on_nats, wait_for, Server, BIN};

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

/// A server runs its databases without sled's background thread: the log syncs each
/// acknowledgement itself, and the projection catches up from the log. Killed with SIGKILL
/// mid-stream, it keeps every workload it acknowledged, and its projection, once caught up,
/// is the one a full replay builds.
#[test]
fn a_killed_server_keeps_what_it_acknowledged_and_its_projection_catches_up() {
    let data = tempfile::tempdir().unwrap();
    let data_arg = data.path().to_str().unwrap();
    let server = Server::start(&["--data", data_arg]);
    let mut ids = Vec::new();
    for i in 0..150 {
        let (status, v) = server.call(
            "POST",
            "/v1/workloads",
            Some(&format!(
                r#"{{"allocation":"ai2/tulu","gpus_per_node":1,"duration_estimate_s":{}}}"#,
                1 + i % 3
            )),
        );
        assert!(status == 201 || status == 202, "{status} {v}");
        ids.push(v["id"].as_str().unwrap().to_owned());
    }
    drop(server); // SIGKILL
    let digest = |args: &[&str]| -> Value {
        common::json_of(&[args, &["--json", "--data", data_arg]].concat())
    };
    let caught_up = digest(&["project", "--once"]);
    let full = digest(&["replay"]);
    assert_eq!(caught_up["last_seq"], full["last_seq"]);
    assert_eq!(
        caught_up["digest"], full["digest"],
        "the killed server's projection differs from a full replay"
    );
    let server = Server::start(&["--data", data_arg]);
    for id in &ids {
        let (status, v) = server.call("GET", &format!("/v1/workloads/{id}"), None);
        assert_eq!(status, 200, "acknowledged {id} was lost: {v}");
    }
}

#[test]
fn on_nats_a_submission_is_placed() {
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let server = on_nats(&nats.url(), "all", &data);
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
            "fairledger.ledger.principal.granted.serve",
            "fairledger.ledger.principal.granted.scheduler",
            "fairledger.ledger.settings.set.ledger",
            "fairledger.ledger.principal.granted.admin",
            "fairledger.ledger.allocation.set.team",
            "fairledger.ledger.node.registered.gpu-1",
            "fairledger.ledger.workload.submitted.team",
            "fairledger.ledger.workload.started.team",
        ]
    );
}

#[test]
fn the_command_line_client_speaks_to_the_server() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(&["--data", data.path().to_str().unwrap()]);
    // Tried first: it would start at once on the four nodes, and nothing is submitted.
    let tried = cli(
        &server,
        &[
            "submit",
            "-a",
            "uw/nlp",
            "-g",
            "8",
            "-n",
            "4",
            "--test-only",
        ],
    )
    .unwrap();
    assert!(
        tried.starts_with("would start now on demo-")
            && tried.matches(":0,1,2,3,4,5,6,7").count() == 4
            && tried.ends_with("nothing was submitted (--test-only)\n"),
        "{tried}"
    );
    let refused = cli(&server, &["submit", "-a", "nope", "-g", "1", "--test-only"]).unwrap_err();
    assert!(refused.contains("(field allocation)"), "{refused}");
    // A 4-node gang takes the whole demo cluster; the next one waits.
    let first = cli(
        &server,
        &[
            "submit", "-a", "uw/nlp", "-g", "8", "-n", "4", "--wait", "20s",
        ],
    )
    .unwrap();
    assert!(
        first.starts_with("submitted ") && first.contains("(running)"),
        "{first}"
    );
    // Times read as dates and durations: the running gang is protected until an hour on.
    let first_id = first.split_whitespace().nth(1).unwrap();
    let status = cli(&server, &["status", first_id]).unwrap();
    let protected = status
        .lines()
        .find(|l| l.starts_with("protected"))
        .unwrap_or_else(|| panic!("{status}"));
    let date = protected.split_whitespace().nth(1).unwrap_or_default();
    assert!(
        date.len() == 10 && date.as_bytes()[4] == b'-' && protected.contains(" UTC (in "),
        "{status}"
    );
    // The next would wait, first in line, until the gang's contract ends (it may preempt it
    // then).
    let last_seq = || server.call("GET", "/v1/events?limit=1", None).1["last_seq"].clone();
    let before = last_seq();
    let tried = cli(
        &server,
        &["submit", "-a", "ai2/tulu", "-g", "8", "--test-only"],
    )
    .unwrap();
    assert!(
        tried.starts_with("would wait: 1 of 1 in the queue, "),
        "{tried}"
    );
    assert_eq!(last_seq(), before, "a dry run writes nothing");
    // Waiting for a placement that does not come within the time fails, and says so; the
    // workload stays queued.
    let second = cli(
        &server,
        &[
            "submit", "-a", "ai2/tulu", "-g", "8", "--name", "sft", "--wait", "1",
        ],
    )
    .unwrap_err();
    assert!(
        second.starts_with("fairledger: workload ")
            && second.contains("not placed within 1 s; it stays queued"),
        "{second}"
    );
    let id = second.split_whitespace().nth(2).unwrap().to_owned();
    let queue = cli(&server, &["queue"]).unwrap();
    let lines: Vec<&str> = queue.lines().collect();
    assert!(
        lines[0].starts_with("POS") && lines[0].contains("REASON"),
        "{queue}"
    );
    assert!(
        lines[1].contains(&id) && lines[1].contains("ai2/tulu"),
        "{queue}"
    );
    // Where the queue stands, without its rows: by allocation with each one's head, by reason.
    let summary = cli(&server, &["queue", "--summary"]).unwrap();
    assert!(
        summary.starts_with("1 waiting for 8 GPUs") && summary.contains(&id),
        "{summary}"
    );
    let tulu = summary
        .lines()
        .find(|l| l.starts_with("ai2/tulu "))
        .unwrap_or_else(|| panic!("{summary}"));
    assert_eq!(tulu.split_whitespace().nth(1), Some("1"), "{summary}");
    let nodes = cli(&server, &["nodes", "--summary"]).unwrap();
    assert!(
        nodes.starts_with("4 nodes, 32 GPUs") && nodes.contains("H100"),
        "{nodes}"
    );
    let why = cli(&server, &["explain", &id]).unwrap();
    assert!(why.contains("is 1 of 1 in the queue"), "{why}");
    assert!(
        why.contains("its allocation's key: 0.000 (fairshare: "),
        "{why}"
    );
    let running = cli(&server, &["explain", first_id]).unwrap();
    assert!(
        running.contains(" is running since ")
            && running.contains("protected from preemption until "),
        "{running}"
    );
    let status = cli(&server, &["status", &id]).unwrap();
    assert!(status.contains("state       PD (pending)"), "{status}");
    // sshare-like: the split owes ai2 its demand of 8 and uw the rest.
    let alloc = cli(&server, &["alloc"]).unwrap();
    let row = |path: &str| {
        alloc
            .lines()
            .find(|l| l.split_whitespace().next() == Some(path))
            .unwrap_or_else(|| panic!("no {path} in\n{alloc}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("ai2/tulu")[4], "8.0", "{alloc}");
    assert_eq!(row("uw/nlp")[4], "24.0", "{alloc}");
    // A tree: children indented under their parents, with their share of the cluster.
    assert!(
        alloc.contains("\n  ai2/tulu ") && alloc.contains("\nuw "),
        "{alloc}"
    );
    assert_eq!(row("uw/nlp")[2], "50.0%", "{alloc}");
    // What if ai2/tulu weighed three times as much: side by side, and nothing written.
    let before = server.call("GET", "/v1/events?limit=1", None).1["last_seq"].clone();
    let whatif = cli(
        &server,
        &["whatif", "--set", "ai2/tulu:weight=3", "--horizon", "2h"],
    )
    .unwrap();
    let tulu = whatif
        .lines()
        .find(|l| l.starts_with("ai2/tulu "))
        .unwrap_or_else(|| panic!("{whatif}"));
    assert!(tulu.contains("1 -> 3"), "{whatif}");
    assert!(
        whatif.contains("over 02:00:00") && whatif.contains("waiting now: "),
        "{whatif}"
    );
    assert_eq!(
        server.call("GET", "/v1/events?limit=1", None).1["last_seq"],
        before
    );
    let page = data.path().join("whatif.html");
    cli(
        &server,
        &[
            "whatif",
            "--set",
            "uw/nlp:weight=1",
            "--html",
            page.to_str().unwrap(),
        ],
    )
    .unwrap();
    let page = std::fs::read_to_string(page).unwrap();
    assert!(
        page.contains("uw/nlp") && page.matches("<svg").count() == 3,
        "{page}"
    );
    // The budget of one allocation: its share, now, over the window, day by day.
    let budget = cli(&server, &["alloc", "show", "uw/nlp"]).unwrap();
    assert!(
        budget.starts_with("uw/nlp: weight 2 (50.0% of the cluster by weight); no caps or quotas")
            && budget.contains("now: owed 24.0 GPUs, holds 32")
            && budget.contains("over the usage window: owed ")
            && budget.contains("its key among its siblings: ")
            && budget
                .contains("in a day if nothing changes (GPU-hours delivered over GPU-hours owed")
            && budget.contains("DAY (UTC)"),
        "{budget}"
    );
    let err = cli(&server, &["alloc", "show", "nope"]).unwrap_err();
    assert!(err.contains("no allocation \"nope\""), "{err}");
    // A weight previewed before it is set: the same comparison, and nothing changed.
    let preview = cli(
        &server,
        &["alloc", "set", "ai2/tulu", "--weight", "3", "--preview"],
    )
    .unwrap();
    let tulu = preview
        .lines()
        .find(|l| l.starts_with("ai2/tulu "))
        .unwrap_or_else(|| panic!("{preview}"));
    assert!(
        tulu.contains("1 -> 3") && preview.contains("nothing was changed (--preview)"),
        "{preview}"
    );
    assert_eq!(
        server.call("GET", "/v1/events?limit=1", None).1["last_seq"],
        before
    );
    let err = cli(&server, &["whatif", "--remove-allocation", "nope"]).unwrap_err();
    assert!(err.contains("(field changes[0])"), "{err}");
    let json = cli(&server, &["queue", "--json"]).unwrap();
    let parsed: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(parsed["pending"][0]["id"], id.as_str());
    // Bad input: one line naming the field, exit status 1.
    let err = cli(&server, &["submit", "-a", "nope", "-g", "1"]).unwrap_err();
    assert!(
        err.starts_with("fairledger: ") && err.contains("(field allocation)"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let cancelled = cli(&server, &["cancel", &id]).unwrap();
    assert!(cancelled.contains("cancelled"), "{cancelled}");
    // sacct-like: every workload, newest first, with its state code and name; filters by
    // state and by how long ago.
    let jobs = cli(&server, &["jobs"]).unwrap();
    let lines: Vec<&str> = jobs.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("ELAPSED"),
        "{jobs}"
    );
    let cells = |line: &str| {
        line.split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(&cells(lines[1])[..2], [id.as_str(), "sft"], "{jobs}");
    assert!(cells(lines[1]).contains(&"CA".to_owned()), "{jobs}");
    assert!(
        lines[2].starts_with(first_id) && cells(lines[2]).contains(&"R".to_owned()),
        "{jobs}"
    );
    assert!(
        lines[2].contains(":runs/") && lines[2].ends_with("/output.log"),
        "{jobs}"
    );
    let cancelled_only = cli(&server, &["jobs", "--state", "cancelled", "--since", "1h"]).unwrap();
    assert_eq!(cancelled_only.lines().count(), 2, "{cancelled_only}");
    let none_yet = cli(&server, &["jobs", "--until", "2h"]).unwrap();
    assert_eq!(
        none_yet.lines().count(),
        1,
        "nothing was submitted 2 h ago: {none_yet}"
    );
    let err = cli(&server, &["jobs", "--since", "last tuesday"]).unwrap_err();
    assert!(err.contains("(field since)"), "{err}");
    let events = cli(&server, &["events", "--after", "8"]).unwrap();
    let last = events.lines().last().unwrap();
    assert!(
        last.contains("workload_cancelled") && last.contains(&id) && last.contains(" ai2/tulu "),
        "{events}"
    );
    let only = cli(
        &server,
        &["events", "--kind", "workload_cancelled", "-a", "ai2"],
    )
    .unwrap();
    assert_eq!(only.lines().count(), 2, "{only}");
    // Every event, page after page: three at a time they are the same as all at once.
    let (_, head) = server.call("GET", "/v1/events?limit=1", None);
    let all = cli(&server, &["events", "-n", "0"]).unwrap();
    assert_eq!(
        all.lines().count() as u64,
        head["last_seq"].as_u64().unwrap() + 1,
        "{all}"
    );
    let seqs = |text: &str| {
        text.lines()
            .skip(1)
            .map(|l| l.split_whitespace().next().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let few: Value =
        serde_json::from_str(&cli(&server, &["events", "-n", "5", "--json"]).unwrap()).unwrap();
    assert_eq!(few["events"].as_array().unwrap().len(), 5, "{few}");
    assert_eq!(seqs(&all)[..5], ["1", "2", "3", "4", "5"]);
    // Followed: the same row, as it comes.
    struct Follow(std::process::Child);
    impl Drop for Follow {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut follow = Follow(
        Command::new(BIN)
            .args(["events", "--follow", "--kind", "workload_cancelled"])
            .args(["--api", &format!("http://{}", server.addr)])
            .args(["--token-file", &server.token_file()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(follow.0.stdout.take().unwrap()));
    assert!(lines.next().unwrap().unwrap().starts_with("SEQ"));
    let row = lines.next().unwrap().unwrap();
    assert!(
        row.contains("workload_cancelled") && row.contains(&id) && row.contains("ai2/tulu"),
        "{row}"
    );
    drop(follow);
    let audit = cli(&server, &["audit", "--granularity", "hour", "-a", "uw"]).unwrap();
    assert!(
        audit.lines().skip(1).all(|l| l.starts_with("uw/nlp")),
        "{audit}"
    );
    // An operator's drain and resume, shown in the node table.
    let drained = cli(
        &server,
        &["nodes", "drain", "demo-3", "--reason", "BIOS update"],
    )
    .unwrap();
    assert_eq!(drained.trim(), "drained demo-3");
    let state_of = |table: &str| {
        table
            .lines()
            .find(|l| l.starts_with("demo-3"))
            .map(|l| l.split_whitespace().nth(4).unwrap_or_default().to_owned())
    };
    let table = cli(&server, &["nodes"]).unwrap();
    // Drained with the gang still on it: draining (sinfo's drng), not drained yet.
    assert_eq!(state_of(&table).as_deref(), Some("drng"), "{table}");
    let err = cli(&server, &["nodes", "drain", "no-such-node"]).unwrap_err();
    assert!(err.contains("not registered"), "{err}");
    cli(&server, &["nodes", "resume", "demo-3"]).unwrap();
    let table = cli(&server, &["nodes"]).unwrap();
    assert_eq!(state_of(&table).as_deref(), Some("alloc"), "{table}");
    // A connection error names its cause: https:// to a server without TLS.
    let tls = Command::new(BIN)
        .args(["queue", "--api", &format!("https://{}", server.addr)])
        .output()
        .unwrap();
    let err = String::from_utf8(tls.stderr).unwrap();
    assert!(
        err.contains("TLS failed") && err.contains("http://"),
        "{err}"
    );
    assert!(server.stop().success());
    let unreachable = Command::new(BIN)
        .args(["queue", "--api", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8(unreachable.stderr).unwrap();
    assert!(
        err.contains("cannot reach the API") && err.contains("fairledger serve"),
        "{err}"
    );
}

/// A downstream service: a plain NATS client subscribed to one team's workload events with a
/// wildcard gets exactly that team's events, each valid against the checked-in schemas.
#[test]
fn a_downstream_subscriber_sees_exactly_one_teams_events() {
    let nats = NatsServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = rt.block_on(async_nats::connect(nats.url())).unwrap();
    let mut team = rt
        .block_on(client.subscribe("fairledger.ledger.workload.*.ai2.olmo.>"))
        .unwrap();
    rt.block_on(client.flush()).unwrap();

    let data = tempfile::tempdir().unwrap();
    let server = on_nats(&nats.url(), "all", &data);
    for path in ["ai2/olmo/pretrain", "ai2/olmo/eval", "uw/nlp"] {
        let (status, _) = server.call(
            "PUT",
            &format!("/v1/allocations/{path}"),
            Some(r#"{"weight":1}"#),
        );
        assert_eq!(status, 200);
    }
    let (status, _) = server.call(
        "POST",
        "/v1/nodes",
        Some(r#"{"node":"g1","gpus":8,"model":"H100"}"#),
    );
    assert_eq!(status, 201);
    let mut olmo = Vec::new();
    for (path, gpus) in [
        ("ai2/olmo/pretrain", 4),
        ("uw/nlp", 2),
        ("ai2/olmo/eval", 2),
        ("uw/nlp", 8),
    ] {
        let (status, v) = server.call(
            "POST",
            "/v1/workloads?wait=placed&timeout_s=2",
            Some(&format!(
                r#"{{"allocation":"{path}","gpus_per_node":{gpus}}}"#
            )),
        );
        assert!(status == 200 || status == 202, "{v}");
        if path.starts_with("ai2/olmo") {
            olmo.push(v["id"].as_str().unwrap().to_owned());
        }
    }
    // The olmo workloads were submitted and started; uw's never show up.
    let schemas = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../schemas");
    let load = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(schemas.join(name)).unwrap()).unwrap()
    };
    let envelope = jsonschema::validator_for(&load("envelope.json")).unwrap();
    let mut got = Vec::new();
    rt.block_on(async {
        use futures::StreamExt;
        while got.len() < 4 {
            let message = tokio::time::timeout(Duration::from_secs(10), team.next())
                .await
                .expect("the team's events within 10 s")
                .unwrap();
            let event: Value = serde_json::from_slice(&message.payload).unwrap();
            assert!(envelope.is_valid(&event), "{event}");
            let kind = event["type"].as_str().unwrap().to_owned();
            let payload = jsonschema::validator_for(&load(&format!("events/{kind}.json"))).unwrap();
            assert!(payload.is_valid(&event["payload"]), "{event}");
            got.push((
                message.subject.to_string(),
                kind,
                event["payload"]["workload"].as_str().unwrap().to_owned(),
            ));
        }
        // Nothing else arrives for the team.
        let more = tokio::time::timeout(Duration::from_millis(300), team.next()).await;
        assert!(more.is_err(), "an extra event: {more:?}");
    });
    let ids: std::collections::BTreeSet<&str> = got.iter().map(|g| g.2.as_str()).collect();
    assert_eq!(ids, olmo.iter().map(String::as_str).collect());
    for (subject, kind, _) in &got {
        assert!(subject.contains(".ai2.olmo."), "{subject}");
        assert!(
            kind == "workload_submitted" || kind == "workload_started",
            "{kind}"
        );
    }
    assert!(server.stop().success());
}

/// One API process and two scheduler processes share a nats-server: work is placed, nothing is
/// placed twice, and no decision is ever rejected, because every decision is fenced by the
/// sequence it was made on.
#[test]
fn an_api_and_two_schedulers_share_one_nats() {
    let nats = NatsServer::start();
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let start = |role: &str, dir: &tempfile::TempDir| on_nats(&nats.url(), role, dir);
    let api = start("api", &dirs[0]);
    let schedulers = [start("scheduler", &dirs[1]), start("scheduler", &dirs[2])];
    let (status, refusal) = schedulers[0].call("GET", "/v1/queue", None);
    assert_eq!(status, 404);
    assert!(refusal["detail"]
        .as_str()
        .unwrap()
        .contains("scheduler only"));
    assert_eq!(
        api.call("PUT", "/v1/allocations/team", Some(r#"{"weight":1}"#))
            .0,
        200
    );
    assert_eq!(
        api.call(
            "POST",
            "/v1/nodes",
            Some(r#"{"node":"g","gpus":8,"model":"H100"}"#)
        )
        .0,
        201
    );
    for _ in 0..12 {
        let (status, v) = api.call(
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"team","gpus_per_node":1}"#),
        );
        assert_eq!(status, 202, "{v}");
    }
    // Eight fit; four wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, queue) = api.call("GET", "/v1/queue", None);
        if queue["pending"].as_array().unwrap().len() == 4 {
            break;
        }
        assert!(Instant::now() < deadline, "never settled: {queue}");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (_, queue) = api.call("GET", "/v1/queue", None);
    assert_eq!(queue["pending"].as_array().unwrap().len(), 4, "{queue}");
    let metrics = |s: &Server| {
        let mut stream = TcpStream::connect(&s.addr).unwrap();
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).unwrap();
        text
    };
    for s in [&api, &schedulers[0], &schedulers[1]] {
        // Each process's projection catches up to the same ledger.
        let deadline = Instant::now() + Duration::from_secs(20);
        let text = loop {
            let text = metrics(s);
            if text.contains("fairledger_gpus{state=\"allocated\"} 8") {
                break text;
            }
            assert!(Instant::now() < deadline, "{text}");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            text.contains("fairledger_projection_events_total{outcome=\"rejected\"} 0"),
            "{text}"
        );
    }
    for s in schedulers {
        assert!(s.stop().success());
    }
    assert!(api.stop().success());
}

#[test]
fn a_config_file_sets_the_cluster_and_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "[policy]\nname = \"fifo\"\nmin_runtime_s = 60\nmax_min_runtime_s = 120\ngrace_s = 5\n\
         [[nodes]]\ncount = 2\ngpus = 4\nmodel = \"A100\"\n\
         [[allocations]]\npath = \"lab/x\"\nweight = 1\n",
    )
    .unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&[
        "--config",
        config.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    let (_, allocations) = server.call("GET", "/v1/allocations", None);
    let paths: Vec<&str> = allocations["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, vec!["lab", "lab/x"]);
    let (status, placed) = server.call(
        "POST",
        "/v1/workloads?wait=placed&timeout_s=20",
        Some(r#"{"allocation":"lab/x","gpus_per_node":4,"model":"A100"}"#),
    );
    assert_eq!(status, 200, "{placed}");
    let w = &placed["workload"];
    let contract = w["protected_until_ms"].as_u64().unwrap() - w["started_at_ms"].as_u64().unwrap();
    assert_eq!(contract, 60_000, "the config's min_runtime_s");
    // The cap on asked-for protection is the config's too.
    let (status, problem) = server.call(
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"lab/x","gpus_per_node":1,"min_runtime_s":121}"#),
    );
    assert_eq!(
        (status, problem["field"].as_str()),
        (422, Some("min_runtime_s"))
    );
    assert!(server.stop().success());

    // A bad config: one line naming the file, nothing started.
    std::fs::write(
        &config,
        "[policy]\nname = \"nope\"\n[[nodes]]\ncount=1\ngpus=8\nmodel=\"H\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--data")
        .arg(dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("cluster.toml") && err.contains("nope"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// The server runs without transparent huge pages (see `without_huge_pages`): the kernel says
/// so for the process.
#[cfg(target_os = "linux")]
#[test]
fn the_server_runs_without_transparent_huge_pages() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(&["--data", data.path().to_str().unwrap()]);
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
    let thp = status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .map(str::trim);
    assert_eq!(thp, Some("0"), "{status}");
}

#[test]
fn the_shipped_example_cluster_loads() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/cluster.toml");
    let prepared = sim::scenario::Scenario::load(&path)
        .unwrap()
        .prepare(None)
        .unwrap();
    assert_eq!(prepared.nodes.len(), 8);
    assert_eq!(prepared.policy.min_runtime_ms, 7_200_000);
    assert!(prepared.weights.contains_key("uw/nlp"));
}

/// Runs the command-line client with `env` set; returns its stdout, or its stderr on failure.
fn cli_env(server: &Server, env: &[(&str, &str)], args: &[&str]) -> Result<String, String> {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .args(["--api", &format!("http://{}", server.addr)])
        .env_remove("FAIRLEDGER_TOKEN")
        .env_remove("FAIRLEDGER_TOKEN_FILE");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8(out.stderr).unwrap())
    }
}

/// identity: the first start makes an admin whose token only its owner can read; the commands
/// on the server's machine find it by themselves; a submitter's token reaches its subtree only
/// and stops at its revocation; and no token shows in the server's output or data but where it
/// is meant to be.
#[test]
fn the_first_admin_grants_tokens_that_work_within_their_scope_until_revoked() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let server = Server::start(&["--data", data.to_str().unwrap()]);
    let token_file = data.join("admin.token");
    let said = server.stderr.lock().unwrap().clone();
    assert!(
        said.contains(&format!(
            "created the first admin token in {}",
            token_file.display()
        )),
        "{said}"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&token_file).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    // Without a token: refused.
    let (status, problem) = server.call_as(
        None,
        "PUT",
        "/v1/allocations/uw/nlp",
        Some(r#"{"weight":100}"#),
    );
    assert_eq!(status, 401, "{problem}");
    // The client on this machine reads the first admin's token from the data directory.
    let data_env = [("FAIRLEDGER_DATA", data.to_str().unwrap())];
    let me = cli_env(&server, &data_env, &["whoami"]).unwrap();
    assert_eq!(me.trim(), "user:admin (admin)");
    let elsewhere =
        cli_env(&server, &[("FAIRLEDGER_DATA", "/nonexistent")], &["queue"]).unwrap_err();
    assert!(elsewhere.contains("FAIRLEDGER_TOKEN"), "{elsewhere}");
    assert_eq!(elsewhere.lines().count(), 1, "{elsewhere}");
    // A submitter of uw/nlp.
    let bot = cli_env(
        &server,
        &data_env,
        &[
            "token",
            "create",
            "--name",
            "nlp-bot",
            "--role",
            "submitter",
            "-a",
            "uw/nlp",
            "--expires",
            "30d",
            "--submissions-per-minute",
            "90",
        ],
    )
    .unwrap()
    .trim()
    .to_owned();
    assert!(bot.starts_with("flt_"), "{bot}");
    let (_, tokens) = server.call("GET", "/v1/tokens", None);
    let granted = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "nlp-bot")
        .unwrap();
    assert_eq!(
        (
            granted["rates"]["submissions_per_minute"].as_u64(),
            granted["rates"]["whatifs_per_minute"].as_u64()
        ),
        (Some(90), Some(20)),
        "the rate given, the others their defaults: {granted}"
    );
    let as_bot = [("FAIRLEDGER_TOKEN", bot.as_str())];
    let submitted = cli_env(
        &server,
        &as_bot,
        &["submit", "-a", "uw/nlp", "-g", "1", "--duration", "600"],
    )
    .unwrap();
    assert!(submitted.starts_with("submitted "), "{submitted}");
    let mine = cli_env(&server, &as_bot, &["queue", "--me", "--json"]).unwrap();
    let refused = cli_env(&server, &as_bot, &["submit", "-a", "ai2/tulu", "-g", "1"]).unwrap_err();
    assert!(refused.contains("scoped to \"uw/nlp\""), "{refused}");
    let refused = cli_env(
        &server,
        &as_bot,
        &["alloc", "set", "uw/nlp", "--weight", "100"],
    )
    .unwrap_err();
    assert!(refused.contains("needs the role admin"), "{refused}");
    let list = cli_env(&server, &data_env, &["token", "list"]).unwrap();
    assert!(
        list.contains("nlp-bot") && list.contains("submitter") && !list.contains(&bot),
        "{list}"
    );
    cli_env(&server, &data_env, &["token", "revoke", "nlp-bot"]).unwrap();
    let after = cli_env(&server, &as_bot, &["queue"]).unwrap_err();
    assert!(after.contains("revoked"), "{after}");
    // Every event of the bot carries it as the actor.
    let (_, events) = server.call("GET", "/v1/events?kind=workload_submitted", None);
    let actors: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"]["actor"].as_str().unwrap())
        .collect();
    assert_eq!(actors, ["user:nlp-bot"], "{events}");
    let queue: Value = serde_json::from_str(&mine).unwrap();
    for w in queue["pending"].as_array().unwrap() {
        assert_eq!(w["user"], "user:nlp-bot");
    }
    // No token in what the server printed, nor in its data but the files meant for them.
    let admin = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_owned();
    let output = server.stderr.clone();
    assert!(server.stop().success());
    let said = output.lock().unwrap().clone();
    let mut secrets = vec![admin, bot];
    let mut stack = vec![data.clone()];
    let mut files = Vec::new();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "token") {
                // The in-process agents' own tokens: keep them out of everything else too.
                secrets.push(std::fs::read_to_string(&path).unwrap().trim().to_owned());
            } else {
                files.push(path);
            }
        }
    }
    assert!(
        secrets.len() > 2,
        "the demo's agents hold tokens of their own"
    );
    for s in &secrets {
        assert!(
            !said.contains(s.as_str()),
            "a token in the server's output:\n{said}"
        );
    }
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        for s in &secrets {
            assert!(
                !bytes.windows(s.len()).any(|w| w == s.as_bytes()),
                "a token in {}",
                path.display()
            );
        }
    }
}

/// Started before its NATS server is up (a cluster still forming, a host booting), serve waits
/// for it instead of exiting.
#[test]
fn serve_waits_for_a_nats_server_that_comes_up_later() {
    let mut nats = NatsServer::start();
    nats.kill();
    let url = nats.url();
    let later = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(2));
        nats.restart();
        nats
    });
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(&["--nats", &url, "--data", data.path().to_str().unwrap()]);
    let _nats = later.join().unwrap();
    let (status, _) = server.call("PUT", "/v1/allocations/team", Some(r#"{"weight":1}"#));
    assert_eq!(status, 200);
    let said = server.stderr.lock().unwrap().clone();
    assert!(
        said.contains("trying again"),
        "it said it was waiting: {said}"
    );
}

/// `/readyz` says when the log is unreachable, and is ready again once it is back.
#[test]
fn readiness_follows_the_log_away_and_back() {
    let mut nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let server = on_nats(&nats.url(), "all", &data);
    let ready = |want: u16, secs: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            let (status, problem) = server.call("GET", "/readyz", None);
            if status == want {
                return problem;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "/readyz stayed {status} ({problem}), not {want}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    ready(200, 30);
    nats.kill();
    let problem = ready(503, 30);
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("log-unreachable"),
        "{problem}"
    );
    nats.restart();
    ready(200, 60);
}

/// identity: grants and revocations are ledger events, so a second API process sharing the NATS
/// log honours a token granted through the first, and refuses it once revoked there.
#[test]
fn a_revocation_reaches_every_api_process_on_nats() {
    let nats = NatsServer::start();
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let start = |role: &str, dir: &tempfile::TempDir| on_nats(&nats.url(), role, dir);
    let first = start("all", &dirs[0]);
    let second = start("api", &dirs[1]);
    assert!(
        first.token.is_some(),
        "the first process made the first admin"
    );
    assert!(second.token.is_none(), "the second found one and made none");
    let viewer = first.grant("watcher", "viewer", &[], None);
    let answer = |status_wanted: u16| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) = second.call_as(Some(&viewer), "GET", "/v1/queue", None);
            if status == status_wanted {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "the second process still answers {status}: {body}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    answer(200);
    let (status, _) = first.call("DELETE", "/v1/tokens/watcher", None);
    assert_eq!(status, 200);
    let refused = answer(401);
    assert!(
        refused["detail"].as_str().unwrap().contains("revoked"),
        "{refused}"
    );
    assert!(second.stop().success());
    assert!(first.stop().success());
}

/// `serve` over https in `dir/data`, with no agents of its own.
fn https_server(dir: &std::path::Path, cert: &std::path::Path, key: &std::path::Path) -> Server {
    let data = dir.join("data");
    Server::start(&[
        "--data",
        data.to_str().unwrap(),
        "--no-agents",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ])
}

/// https: `serve --tls-cert --tls-key` with the certificate `fairledger tls self-signed` makes
/// answers over TLS only; the client trusts it with --ca-file and refuses it without, and an
/// agent over --api reaches it the same way.
#[test]
fn over_https_the_client_and_an_agent_trust_the_servers_certificate() {
    let tmp = tempfile::tempdir().unwrap();
    let (ok, said, err) = run(&["tls", "self-signed", "--out", tmp.path().to_str().unwrap()]);
    assert!(ok && said.contains("--ca-file"), "{said}{err}");
    let (cert_file, key_file) = (tmp.path().join("cert.pem"), tmp.path().join("key.pem"));
    // Clients trust the CA that signed the server's certificate.
    let ca_file = tmp.path().join("ca.pem");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the key is its owner's only");
    // Made again, it refuses to overwrite them.
    let (ok, _, err) = run(&["tls", "self-signed", "--out", tmp.path().to_str().unwrap()]);
    assert!(!ok && err.contains("move the old one away"), "{err}");
    let server = https_server(tmp.path(), &cert_file, &key_file);
    let api = format!("https://{}", server.addr);
    let client = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args([
                "whoami",
                "--api",
                &api,
                "--token-file",
                &server.token_file(),
            ])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, said) = client(&["--ca-file", ca_file.to_str().unwrap()]);
    assert!(ok, "{said}");
    assert_eq!(said.trim(), "user:admin (admin)");
    let (ok, said) = client(&[]);
    assert!(
        !ok,
        "a certificate no public root signed is refused: {said}"
    );
    assert!(
        said.contains("cannot reach the API")
            && said.contains("TLS failed")
            && said.contains("--ca-file"),
        "{said}"
    );
    // Plain HTTP gets no HTTP answer.
    let mut plain = TcpStream::connect(&server.addr).unwrap();
    write!(
        plain,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(
        !answer.starts_with(b"HTTP/1.1 200"),
        "plain HTTP is not served"
    );
    // An agent over https registers its node and sends its heartbeats.
    let token_file = tmp.path().join("agent.token");
    let out = Command::new(BIN)
        .args([
            "token", "create", "--name", "gpu-x", "--role", "agent", "--node", "gpu-x",
        ])
        .args(["--out", token_file.to_str().unwrap()])
        .args(["--api", &api, "--token-file", &server.token_file()])
        .args(["--ca-file", ca_file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut agent = Command::new(BIN)
        .args([
            "agent",
            "--api",
            &api,
            "--node",
            "gpu-x",
            "--fake-gpus",
            "8",
        ])
        .args(["--fake-model", "H100", "--label", "rack=r0"])
        .args(["--ca-file", ca_file.to_str().unwrap()])
        .args(["--token-file", token_file.to_str().unwrap()])
        .arg("--work-dir")
        .arg(tmp.path().join("agent"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let healthy = loop {
        let out = Command::new(BIN)
            .args([
                "nodes",
                "--json",
                "--api",
                &api,
                "--token-file",
                &server.token_file(),
            ])
            .args(["--ca-file", ca_file.to_str().unwrap()])
            .output()
            .unwrap();
        let nodes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let gpus = nodes["nodes"]
            .as_array()
            .and_then(|n| n.iter().find(|n| n["node"] == "gpu-x"))
            .map(|n| n["healthy_gpus"].clone());
        if gpus == Some(Value::from(8)) || Instant::now() > deadline {
            break gpus;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = agent.kill();
    let _ = agent.wait();
    assert_eq!(
        healthy,
        Some(Value::from(8)),
        "the agent registered its node over https"
    );
}

/// Runs the binary with `args`; its exit status, stdout and stderr.
fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// A command that prints, piped into a reader that goes away (`fairledger events --json | head`),
/// ends quietly as other command-line tools do: killed by SIGPIPE, not a panic.
#[cfg(unix)]
#[test]
fn a_printing_command_ends_quietly_when_its_reader_goes_away() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut child = Command::new(BIN)
        .args(["demo", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the demo has run, so its first write finds the pipe closed.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(13),
        "killed by SIGPIPE; status {:?}, stderr {stderr}",
        out.status
    );
}

/// audit verify: the kept figures of a projection built from a simulated day of a two-team
/// cluster agree with a refold of its log; one tampered row is named with both values, and the
/// command fails.
#[test]
fn audit_verify_agrees_with_the_log_and_names_a_tampered_row() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let events = simulate_two_teams(dir.path());
    let data_arg = data.to_str().unwrap();
    let (ok, _, err) = run(&[
        "log",
        "import",
        "--data",
        data_arg,
        events.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let (ok, _, err) = run(&["project", "--once", "--data", data_arg]);
    assert!(ok, "{err}");
    let (ok, out, err) = run(&["audit", "verify", "--data", data_arg]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("all agree"), "{out}");
    // A simulation's log has no root of authority: the audit says so.
    assert!(
        out.contains("authority: this log has no root of authority"),
        "{out}"
    );
    let (ok, out, err) = run(&["audit", "verify", "--data", data_arg, "--json"]);
    assert!(ok, "{err}");
    let found: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(found["agrees"], true);
    assert!(found["authority"]["root"].is_null(), "{found}");
    let compared = found["compared"].as_u64().unwrap();
    assert!(compared > 20, "{found}");

    // Tamper with one kept row: an hour of lab/b gets an extra GPU-hour.
    let tampered = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let log = eventlog::EmbeddedLog::open(&data.join("log")).unwrap();
        let p = projector::Projector::open_existing(&data.join("projection"), &log)
            .await
            .unwrap();
        let kept = p.kept();
        let mut row = kept
            .all()
            .unwrap()
            .into_iter()
            .find_map(|r| match r {
                ledger::book::Row::Allocation(r)
                    if r.path == "lab/b"
                        && r.granularity == ledger::book::Granularity::Hour
                        && r.figures.delivered_gpu_ms > 0 =>
                {
                    Some(r)
                }
                _ => None,
            })
            .expect("lab/b got GPUs in some hour");
        row.figures.delivered_gpu_ms += 3_600_000;
        kept.overwrite(&ledger::book::Row::Allocation(row.clone()))
            .unwrap();
        row
    });
    let (ok, out, err) = run(&["audit", "verify", "--data", data_arg]);
    assert!(
        !ok,
        "a tampered projection must fail the verification:\n{out}"
    );
    let differs: Vec<&str> = out.lines().filter(|l| l.starts_with("differs:")).collect();
    assert_eq!(differs.len(), 1, "{out}");
    assert!(differs[0].contains("lab/b"), "{out}");
    assert!(differs[0].contains("delivered_gpu_hours kept"), "{out}");
    assert!(err.contains("1 kept rows differ"), "{err}");
    // Scoped to the other team, nothing differs.
    let (ok, out, _) = run(&["audit", "verify", "--data", data_arg, "-a", "lab/a"]);
    assert!(ok, "{out}");
    // Scoped to the tampered hour, it is the one row that differs.
    let hour = tampered.from_ms.to_string();
    let next = (tampered.from_ms + 3_600_000).to_string();
    let (ok, out, _) = run(&[
        "audit", "verify", "--data", data_arg, "-a", "lab/b", "--from", &hour, "--to", &next,
        "--json",
    ]);
    assert!(!ok);
    let found: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(found["differences"].as_array().unwrap().len(), 1, "{found}");
    let d = &found["differences"][0];
    let gap = d["kept"]["delivered_gpu_hours"].as_f64().unwrap()
        - d["refold"]["delivered_gpu_hours"].as_f64().unwrap();
    assert!((gap - 1.0).abs() < 1e-9, "{d}");
    // A bad time is one line saying what to write.
    let (ok, _, err) = run(&["audit", "verify", "--data", data_arg, "--from", "soon"]);
    assert!(!ok);
    assert!(err.contains("--from") && err.contains("RFC 3339"), "{err}");
}

/// The config's `[policy] heartbeat_timeout_s` is the server's, unless `--heartbeat-timeout-s`
/// says otherwise: with no agent driving its node, the node's GPUs go unhealthy after the
/// config's second, and stay healthy under the flag's hour.
#[test]
fn the_configs_heartbeat_timeout_holds_unless_the_flag_says_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        "[policy]\nheartbeat_timeout_s = 1\n\
         [[nodes]]\ncount = 1\ngpus = 2\nmodel = \"A100\"\n\
         [[allocations]]\npath = \"lab/x\"\nweight = 1\n",
    )
    .unwrap();
    let start = |data: &str, extra: &[&str]| {
        let data = dir.path().join(data);
        let mut args = vec![
            "--config",
            config.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--no-agents",
        ];
        args.extend_from_slice(extra);
        Server::start(&args)
    };
    let healthy = |server: &Server| {
        let (status, nodes) = server.call("GET", "/v1/nodes", None);
        assert_eq!(status, 200, "{nodes}");
        nodes["nodes"][0]["healthy_gpus"].as_u64().unwrap()
    };
    let configured = start("configured", &[]);
    let flagged = start("flagged", &["--heartbeat-timeout-s", "3600"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while healthy(&configured) != 0 {
        assert!(
            Instant::now() < deadline,
            "the config's 1 s timeout never marked the silent node unhealthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Long past the config's second for the second server too.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(healthy(&flagged), 2, "the flag's hour wins over the config");
}

/// The ledger of the simulator's two-team fixture, written under `dir`: its events.jsonl.
fn simulate_two_teams(dir: &std::path::Path) -> std::path::PathBuf {
    let out = dir.join("sim");
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../sim/tests/data");
    let (ok, _, err) = run(&[
        "sim",
        "--scenario",
        &format!("{fixtures}/two-teams.toml"),
        "--workloads",
        &format!("{fixtures}/two-teams.jsonl"),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    out.join("events.jsonl")
}

/// An import run again appends nothing twice, without relying on the log's duplicate window:
/// it leaves out the events whose ids the log holds, and goes on after those it has.
#[test]
fn an_import_run_again_appends_only_what_the_log_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let events = simulate_two_teams(dir.path());
    let whole = events;
    let events = std::fs::read_to_string(&whole).unwrap();
    let lines: Vec<&str> = events.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() > 50, "{} events", lines.len());
    // The first half, then the whole file: only the second half is appended.
    let half = dir.path().join("half.jsonl");
    std::fs::write(&half, lines[..lines.len() / 2].join("\n")).unwrap();
    let data_arg = data.to_str().unwrap();
    let import = |file: &std::path::Path| {
        let (ok, _, err) = run(&["log", "import", "--data", data_arg, file.to_str().unwrap()]);
        assert!(ok, "{err}");
        err
    };
    let err = import(&half);
    assert!(
        err.contains(&format!(
            "imported {} events (0 already present)",
            lines.len() / 2
        )),
        "{err}"
    );
    let err = import(&whole);
    assert!(
        err.contains(&format!(
            "imported {} events ({} already present)",
            lines.len() - lines.len() / 2,
            lines.len() / 2
        )),
        "{err}"
    );
    let err = import(&whole);
    assert!(
        err.contains(&format!(
            "imported 0 events ({} already present)",
            lines.len()
        )),
        "{err}"
    );
    // The log is the file, in order, once.
    let (ok, out, err) = run(&["project", "--once", "--data", data_arg, "--json"]);
    assert!(ok, "{err}");
    let reached: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(reached["last_seq"], lines.len() as u64, "{reached}");
}

/// The demo's table reads without a calculator: waits as `[D-]HH:MM:SS`, the horizon too.
#[test]
fn the_demo_table_shows_waits_and_the_horizon_as_durations() {
    let out = Command::new(BIN).args(["demo"]).output().unwrap();
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains(", 3-00:00:00 simulated in "), "{table}");
    let header = table.lines().nth(1).unwrap();
    assert!(
        header.contains("WAIT P50") && header.contains("WAIT P90"),
        "{table}"
    );
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip(2)
        .filter(|l| l.trim_start().starts_with(['a', 'u']))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 4, "{table}");
    for row in rows {
        for wait in &row[5..7] {
            let clock = wait.rsplit('-').next().unwrap();
            let parts: Vec<&str> = clock.split(':').collect();
            assert!(
                parts.len() == 3
                    && parts
                        .iter()
                        .all(|p| p.len() == 2 && p.parse::<u8>().is_ok()),
                "{wait} in {table}"
            );
        }
    }
}

/// A what-if answered offline at the server's sequence (`fairledger whatif --at-seq`, no server)
/// is the server's answer, figure for figure: both are the same function of the log's prefix.
#[test]
fn a_what_if_offline_at_the_servers_sequence_is_the_servers_answer() {
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(&["--data", data.path().to_str().unwrap()]);
    for (allocation, gpus, estimate) in [
        ("uw/nlp", 8, 7200),
        ("uw/nlp", 8, 3600),
        ("ai2/tulu", 4, 1800),
        ("ai2/tulu", 8, 5400),
        ("ai2/olmo/eval", 8, 600),
        ("uw/nlp", 8, 3600),
        ("ai2/tulu", 8, 3600),
    ] {
        let body = format!(
            r#"{{"allocation":"{allocation}","gpus_per_node":{gpus},"nodes":2,"duration_estimate_s":{estimate},"command":["sleep","600"]}}"#
        );
        let (status, answer) = server.call("POST", "/v1/workloads", Some(&body));
        assert_eq!(status, 202, "{answer}");
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let question = r#"{"changes":[{"allocation":"ai2/tulu","weight":4},{"fail_gpus":[{"node":"demo-1","gpu":2}]}],"horizon_s":86400,"arrivals":"recent","seed":9}"#;
    let (status, online) = server.call("POST", "/v1/whatif", Some(question));
    assert_eq!(status, 200, "{online}");
    let seq = online["forked_at_seq"].as_u64().unwrap();
    assert!(server.stop().success());
    let out = Command::new(BIN)
        .args(["whatif", "--json", "--at-seq", &seq.to_string()])
        .args(["--data", data.path().to_str().unwrap()])
        .args(["--set", "ai2/tulu:weight=4", "--fail-gpu", "demo-1:2"])
        .args(["--horizon", "1d", "--arrivals", "recent", "--seed", "9"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let offline: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(offline, online);
    // A sequence the log does not hold: one line saying which it does.
    let out = Command::new(BIN)
        .args(["whatif", "--at-seq", "999999"])
        .args(["--data", data.path().to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        !out.status.success() && err.contains("the log holds events 1 to "),
        "{err}"
    );
}

/// The data directory holds submissions' commands and environments and the first admin's
/// token: serve creates it reachable by its owner only, and makes an existing one so.
#[test]
fn the_data_directory_is_reachable_by_its_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let fresh = dir.path().join("fresh");
    let server = Server::start(&["--data", fresh.to_str().unwrap(), "--no-agents"]);
    assert_eq!(mode(&fresh), 0o700);
    server.stop();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = Server::start(&["--data", open.to_str().unwrap(), "--no-agents"]);
    assert_eq!(mode(&open), 0o700);
    let said = server.stderr.lock().unwrap().clone();
    assert!(said.contains("reachable by its owner only"), "{said}");
    server.stop();
}

/// A certificate marked as a CA (as `openssl req -x509` makes one) is refused by rustls even
/// when trusted with --ca-file: the client says why and how to make one that works.
#[test]
fn a_certificate_marked_as_a_ca_is_refused_with_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let mut params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    let (cert_file, key_file) = (tmp.path().join("ca.pem"), tmp.path().join("ca-key.pem"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let server = https_server(tmp.path(), &cert_file, &key_file);
    let api = format!("https://{}", server.addr);
    let token = server.token_file();
    let (ok, _, err) = run(&[
        "whoami",
        "--api",
        &api,
        "--token-file",
        &token,
        "--ca-file",
        cert_file.to_str().unwrap(),
    ]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("marked as a CA") && err.contains("fairledger tls self-signed"),
        "{err}"
    );
}

/// Admins that last: with every admin token lost, an admin is granted offline, straight into
/// the stopped server's log, as an event whose actor says how it came; the server started again
/// takes the token. While the server runs, the offline grant is refused with what to do.
#[test]
fn an_admin_is_granted_offline_when_none_can_sign_in() {
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().to_str().unwrap();
    let offline = |name: &str| {
        Command::new(BIN)
            .args(["token", "create", "--offline", "--data", dir])
            .args(["--name", name, "--role", "admin"])
            .output()
            .unwrap()
    };
    let server = Server::start(&["--data", dir]);
    let refused = offline("rescue");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("stop `fairledger serve` first"),
        "{said}"
    );
    assert!(server.stop().success());
    // Every admin token lost.
    std::fs::remove_file(data.path().join("admin.token")).unwrap();
    let granted = offline("rescue");
    assert!(
        granted.status.success(),
        "{}",
        String::from_utf8_lossy(&granted.stderr)
    );
    let token = String::from_utf8(granted.stdout).unwrap().trim().to_owned();
    assert!(token.len() > 20 && !token.contains(' '), "{token}");
    // The same name again is refused by the ledger's own rule, and nothing is written.
    let again = offline("rescue");
    assert!(
        !again.status.success()
            && String::from_utf8_lossy(&again.stderr).contains("the ledger refuses this grant"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let server = Server::start(&["--data", dir]);
    let (status, me) = server.call_as(Some(&token), "GET", "/v1/whoami", None);
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["role"], "admin", "{me}");
    let (_, events) = server.call_as(
        Some(&token),
        "GET",
        "/v1/events?kind=principal_granted&limit=1000",
        None,
    );
    let recovered: Vec<&Value> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"]["actor"] == "recovery")
        .collect();
    assert_eq!(recovered.len(), 1, "{events}");
    assert_eq!(recovered[0]["event"]["payload"]["name"], "rescue");
    // It acts as any admin: the lost admin is revoked.
    let (status, revoked) = server.call_as(Some(&token), "DELETE", "/v1/tokens/admin", None);
    assert_eq!(status, 200, "{revoked}");
}
