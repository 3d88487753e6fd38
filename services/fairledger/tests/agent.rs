//! `fairledger agent` as a process with fake GPUs, against `fairledger serve` on a real
//! nats-server: workloads really run as processes with the GPUs they were placed on, are
//! preempted with SIGTERM after their contract, requeued and resumed; a failed GPU stops its
//! workload without a contract violation; an agent killed and restarted re-adopts its runs and
//! never launches one twice; the audit's delivered GPU-hours are the processes' real run times.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{wait_for, wait_for_node, wait_until, Agent, Server, BIN};
use eventlog::testing::NatsServer;
use serde_json::{json, Value};

/// A contract of `min_runtime_s` and a grace of 2 s, two teams of equal weight, no nodes but
/// the agents'. Protection may be asked up to 12 h (the default cap is 8 h): the agents, which
/// fold the log themselves, must follow the log's settings to launch what asks for more.
fn cluster(dir: &Path, min_runtime_s: u64) -> PathBuf {
    let path = dir.join("cluster.toml");
    std::fs::write(
        &path,
        format!(
            "[policy]\nmin_runtime_s = {min_runtime_s}\ngrace_s = 2\nmax_min_runtime_s = 43200\n\n\
             [[allocations]]\npath = \"lab/a\"\nweight = 1\n\n\
             [[allocations]]\npath = \"lab/b\"\nweight = 1\n"
        ),
    )
    .unwrap();
    path
}

/// A workload script: appends `start <ms> <CUDA_VISIBLE_DEVICES> <workload> <allocation>` to
/// `log`, then sleeps `secs`; on SIGTERM appends `term <ms>` and exits 143; otherwise `done
/// <ms>`.
fn script(dir: &Path, log: &Path) -> PathBuf {
    executable(
        &dir.join("job.sh"),
        &format!(
            "#!/bin/sh\n\
             log={}\n\
             echo \"start $(date +%s%3N) $CUDA_VISIBLE_DEVICES $FAIRLEDGER_WORKLOAD_ID $FAIRLEDGER_ALLOCATION\" >> $log\n\
             trap 'echo \"term $(date +%s%3N) $FAIRLEDGER_WORKLOAD_ID\" >> $log; exit 143' TERM\n\
             sleep \"$1\" & wait\n\
             echo \"done $(date +%s%3N) $FAIRLEDGER_WORKLOAD_ID\" >> $log\n",
            log.display()
        ),
    )
}

/// Writes `text` to `path` as an executable script.
fn executable(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).unwrap();
    let mut perms = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(path, perms).unwrap();
    path.to_owned()
}

/// `fairledger serve` on the embedded log in `dir/data` with the cluster of [`cluster`] (a
/// contract of an hour), driving no node itself: agents reach it over HTTP.
fn serve_embedded(dir: &Path) -> Server {
    let config = cluster(dir, 3600);
    Server::start(&[
        "--data",
        dir.join("data").to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ])
}

/// `fairledger serve` on `nats` with the cluster of [`cluster`] and `extra` flags.
fn serve_on(nats: &NatsServer, dir: &Path, min_runtime_s: u64, extra: &[&str]) -> Server {
    let config = cluster(dir, min_runtime_s);
    let (data, url) = (dir.join("data"), nats.url());
    let mut args = vec![
        "--nats",
        &url,
        "--data",
        data.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn submit(server: &Server, body: Value) -> String {
    common::submit_as(server, None, &body)
}

/// The lines of the jobs' log, split into words.
fn lines(log: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect()
}

/// Real run time of workload `id` from the jobs' log: each `start` to the following `term` or
/// `done`, in milliseconds.
fn ran_ms(log: &Path, id: &str) -> u64 {
    let mut total = 0;
    let mut since = None;
    for l in lines(log) {
        let mine = l.iter().any(|w| w == id);
        match l[0].as_str() {
            "start" if mine => since = Some(l[1].parse::<u64>().unwrap()),
            "term" | "done" if mine => {
                total += l[1].parse::<u64>().unwrap() - since.take().expect("a start first");
            }
            _ => {}
        }
    }
    assert!(since.is_none(), "{id} still running");
    total
}

fn delivered_gpu_hours(server: &Server, path: &str) -> f64 {
    let (_, allocations) = server.call("GET", "/v1/allocations", None);
    allocations["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == path)
        .unwrap()["delivered_gpu_hours"]
        .as_f64()
        .unwrap()
}

fn history(server: &Server, id: &str) -> Vec<Value> {
    let (status, h) = server.call("GET", &format!("/v1/audit/workloads/{id}"), None);
    assert_eq!(status, 200, "{h}");
    h["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].clone())
        .collect()
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_preempted_process_gets_sigterm_is_requeued_resumes_and_the_audit_matches_its_run_time() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 2, &[]);
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    // This machine's clock is a minute behind the server's: the agent must notice and stamp its
    // reports with the server's time, or the ledger would refuse them as too old.
    let agent = Agent::start(
        &nats.url(),
        "gpu-1",
        &tmp.path().join("agent"),
        &["--fake-gpus", "2", "--clock-skew-ms", "-60000"],
    );
    wait_for_node(&server, "gpu-1");
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let job = job.to_str().unwrap();
    // Team a takes the whole node with a long job.
    let a = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 2, "command": [job, "600"]}),
    );
    wait_for(&server, &a, "running");
    wait_until("a's process to start", 20, || !lines(&jobs).is_empty());
    let first = &lines(&jobs)[0];
    assert_eq!(
        (
            first[0].as_str(),
            first[2].as_str(),
            first[3].as_str(),
            first[4].as_str()
        ),
        ("start", "0,1", a.as_str(), "lab/a"),
        "the process sees exactly its GPUs, its id and its allocation"
    );
    // After a's contract, team b (owed half, holding nothing) arrives: a is preempted.
    std::thread::sleep(Duration::from_millis(2500));
    let b = submit(
        &server,
        json!({"allocation": "lab/b", "gpus_per_node": 2, "command": [job, "1"]}),
    );
    wait_for(&server, &b, "finished");
    let row = wait_for(&server, &a, "running");
    assert_eq!(row["starts"], 2, "a resumed after b: {row}");
    wait_until("a's second process", 20, || {
        lines(&jobs)
            .iter()
            .filter(|l| l[0] == "start" && l[3] == a)
            .count()
            == 2
    });
    // a's history: started, preempted (fair share, for b), stopped as preempted, requeued,
    // started again.
    let h = history(&server, &a);
    assert_eq!(
        kinds(&h),
        [
            "workload_submitted",
            "workload_started",
            "preemption_requested",
            "workload_stopped",
            "workload_requeued",
            "workload_started"
        ]
    );
    assert_eq!(h[2]["payload"]["reason"], "fair_share");
    assert_eq!(h[2]["payload"]["beneficiary"], b.as_str());
    assert_eq!(h[3]["payload"]["reason"], "preempted");
    let jobs_lines = lines(&jobs);
    assert!(
        jobs_lines.iter().any(|l| l[0] == "term" && l[2] == a),
        "a got SIGTERM: {jobs_lines:?}"
    );
    // Cancel a while it runs: SIGTERM again, and it ends as cancelled.
    let (status, _) = server.call("DELETE", &format!("/v1/workloads/{a}"), None);
    assert_eq!(status, 202);
    wait_for(&server, &a, "cancelled");
    // Delivered GPU-hours are the processes' real run times (2 GPUs each), within a second.
    for (path, id) in [("lab/a", &a), ("lab/b", &b)] {
        let real = 2.0 * ran_ms(&jobs, id) as f64 / 3.6e6;
        let delivered = delivered_gpu_hours(&server, path);
        assert!(
            (delivered - real).abs() < 2.0 / 3600.0,
            "{path}: delivered {delivered} GPU-hours, its processes ran {real}"
        );
    }
    // The parent shows its subtree's sum.
    let lab = delivered_gpu_hours(&server, "lab");
    let parts = delivered_gpu_hours(&server, "lab/a") + delivered_gpu_hours(&server, "lab/b");
    assert!((lab - parts).abs() < 1e-9, "lab {lab}, its leaves {parts}");
    let (_, metrics) = server.call("GET", "/v1/metrics/cluster", None);
    assert_eq!(metrics["contract_violations"], 0, "{metrics}");
    assert!(metrics["preemptions"].as_u64().unwrap() >= 1, "{metrics}");
    // The fake GPUs read 90 % while they run work; samples of that reach the ledger.
    let utilization = metrics["utilization"].as_f64().unwrap();
    assert!(
        utilization > 0.0 && utilization <= 0.9,
        "mean utilization of allocated GPUs: {metrics}"
    );
    let log = agent.log();
    assert!(log.contains("is off by"), "the skew was reported: {log}");
}

#[test]
fn a_failed_gpu_stops_its_workload_without_a_contract_violation() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    // A long contract: only a hardware failure may stop the workload.
    let server = serve_on(&nats, tmp.path(), 3600, &[]);
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    // GPU 1 fails 8 s after the agent starts.
    let _agent = Agent::start(
        &nats.url(),
        "gpu-1",
        &tmp.path().join("agent"),
        &["--fake-gpus", "2", "--fake-fault", "1@8"],
    );
    wait_for_node(&server, "gpu-1");
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 2, "command": [job.to_str().unwrap(), "600"]}),
    );
    wait_for(&server, &id, "running");
    // The failure: the workload is stopped and requeued, and cannot start again on one GPU.
    wait_until("the workload to be requeued", 40, || {
        kinds(&history(&server, &id)).contains(&"workload_requeued".to_owned())
    });
    let h = history(&server, &id);
    let reasons: Vec<&Value> = h.iter().map(|e| &e["payload"]["reason"]).collect();
    assert!(reasons.contains(&&json!("hardware_failure")), "{h:?}");
    let stopped = h.iter().find(|e| e["type"] == "workload_stopped").unwrap();
    assert_eq!(stopped["payload"]["reason"], "hardware_failure");
    assert!(
        lines(&jobs).iter().any(|l| l[0] == "term"),
        "the process got SIGTERM"
    );
    let (_, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
    assert_eq!(row["phase"], "pending", "{row}");
    let (_, nodes) = server.call("GET", "/v1/nodes", None);
    assert_eq!(nodes["nodes"][0]["healthy_gpus"], 1, "{nodes}");
    let (_, metrics) = server.call("GET", "/v1/metrics/cluster", None);
    assert_eq!(metrics["contract_violations"], 0, "{metrics}");
    assert!(
        metrics["availability"].as_f64().unwrap() < 1.0,
        "the failed GPU left availability: {metrics}"
    );
}

#[test]
fn a_restarted_agent_re_adopts_its_runs_and_never_launches_one_twice() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 3600, &[]);
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    let work = tmp.path().join("agent");
    let agent = Agent::start(&nats.url(), "gpu-1", &work, &["--fake-gpus", "2"]);
    wait_for_node(&server, "gpu-1");
    // A second agent for the same node is refused with the reason.
    let out = Command::new(BIN)
        .args([
            "agent",
            "--nats",
            &nats.url(),
            "--node",
            "gpu-1",
            "--fake-gpus",
            "2",
        ])
        .arg("--work-dir")
        .arg(tmp.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("driven by another agent"), "{err}");

    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let job = job.to_str().unwrap();
    let long = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": [job, "600"]}),
    );
    let short = submit(
        &server,
        json!({"allocation": "lab/b", "gpus_per_node": 1, "command": [job, "3"]}),
    );
    wait_until("both processes", 20, || lines(&jobs).len() >= 2);
    // The agent dies; its workloads do not. The short one ends while it is down.
    agent.kill9();
    std::thread::sleep(Duration::from_secs(4));
    assert!(lines(&jobs).iter().any(|l| l[0] == "done" && l[2] == short));
    let agent = Agent::start(&nats.url(), "gpu-1", &work, &["--fake-gpus", "2"]);
    // The end that happened while it was down is reported, with its real time.
    let row = wait_for(&server, &short, "finished");
    let h = history(&server, &short);
    assert_eq!(h.last().unwrap()["payload"]["exit_code"], 0);
    let real = ran_ms(&jobs, &short) as f64 / 3.6e6;
    let delivered = delivered_gpu_hours(&server, "lab/b");
    assert!(
        (delivered - real).abs() < 1.0 / 3600.0,
        "delivered {delivered} GPU-hours for a process that ran {real}: {row}"
    );
    // The long one was re-adopted, not launched again; cancelling it stops the adopted process.
    let (status, _) = server.call("DELETE", &format!("/v1/workloads/{long}"), None);
    assert_eq!(status, 202);
    wait_for(&server, &long, "cancelled");
    let starts = lines(&jobs).iter().filter(|l| l[0] == "start").count();
    assert_eq!(starts, 2, "each workload launched once: {:?}", lines(&jobs));
    assert!(lines(&jobs).iter().any(|l| l[0] == "term" && l[2] == long));
    // A command that does not exist: the workload finishes with 127, and the agent goes on.
    let missing = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": ["/no/such/program"]}),
    );
    wait_for(&server, &missing, "finished");
    let h = history(&server, &missing);
    assert_eq!(h.last().unwrap()["payload"]["exit_code"], 127);
    let after = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": [job, "0"]}),
    );
    wait_for(&server, &after, "finished");
    let log = agent.log();
    assert!(log.contains("re-adopting"), "{log}");
}

#[test]
fn an_agent_on_http_runs_and_reports_workloads_and_may_report_only_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    // The embedded log this time: the agent reaches the server through its HTTP API only.
    let server = serve_embedded(tmp.path());
    let api = format!("http://{}", server.addr);
    let token = server.grant("gpu-h", "agent", &[], Some("gpu-h"));
    // A minute slow: the agent sets its clock by the server's before it registers. Its token
    // comes from the environment, which its workloads must not see.
    let agent = Agent::start_with_env(
        &["--api", &api],
        "gpu-h",
        &tmp.path().join("agent"),
        &["--fake-gpus", "2", "--clock-skew-ms", "-60000"],
        &[("FAIRLEDGER_TOKEN", &token)],
    );
    wait_for_node(&server, "gpu-h");
    // One agent per node: a second for gpu-h is refused, naming the first, and does not start.
    let second = Command::new(BIN)
        .env("FAIRLEDGER_TOKEN", &token)
        .args([
            "agent",
            "--api",
            &api,
            "--node",
            "gpu-h",
            "--fake-gpus",
            "2",
        ])
        .arg("--work-dir")
        .arg(tmp.path().join("second"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && said.contains("is driven by another agent"),
        "{said}"
    );
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 2, "command": [job.to_str().unwrap(), "1"]}),
    );
    let row = wait_for(&server, &id, "finished");
    let h = history(&server, &id);
    assert_eq!(h.last().unwrap()["payload"]["exit_code"], 0, "{row}");
    // Its row says how it ended and where its output is, as the agent laid it out.
    assert_eq!(
        (row["state"].as_str(), row["ran_on"][0].as_str()),
        (Some("CD"), Some("gpu-h")),
        "{row}"
    );
    assert!(row["elapsed_ms"].as_u64().unwrap() >= 1_000, "{row}");
    let output = tmp
        .path()
        .join("agent")
        .join(row["output_log"].as_str().unwrap());
    assert!(output.is_file(), "no {}: {row}", output.display());
    let seen = tmp.path().join("env.txt");
    // 10 h of protection, within the log's cap and over the default one.
    let dump = submit(
        &server,
        json!({"allocation": "lab/b", "gpus_per_node": 1, "min_runtime_s": 36000,
               "command": ["sh", "-c", format!("env > {}", seen.display())]}),
    );
    wait_for(&server, &dump, "finished");
    let env = std::fs::read_to_string(&seen).unwrap();
    assert!(env.contains("FAIRLEDGER_WORKLOAD_ID="), "{env}");
    assert!(
        !env.contains(&token) && !env.contains("FAIRLEDGER_TOKEN"),
        "the agent's token reached a workload"
    );
    let first = &lines(&jobs)[0];
    assert_eq!((first[2].as_str(), first[3].as_str()), ("0,1", id.as_str()));
    let real = 2.0 * ran_ms(&jobs, &id) as f64 / 3.6e6;
    let delivered = delivered_gpu_hours(&server, "lab/a");
    assert!(
        (delivered - real).abs() < 2.0 / 3600.0,
        "delivered {delivered} GPU-hours, the process ran {real}"
    );
    // For a period, the same figure refolded from the ledger; a reversed period is refused.
    let (status, period) = server.call("GET", "/v1/allocations?from=0", None);
    assert_eq!(status, 200, "{period}");
    let a = period["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "lab/a")
        .unwrap();
    let in_period = a["period_delivered_gpu_hours"].as_f64().unwrap();
    assert!(
        (in_period - delivered).abs() < 1e-9,
        "{in_period} vs {delivered}"
    );
    let (status, problem) = server.call("GET", "/v1/allocations?from=5&to=5", None);
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "to");
    // Heartbeats arrive over HTTP: the node is watched and healthy.
    let (_, nodes) = server.call("GET", "/v1/nodes", None);
    assert_eq!(nodes["nodes"][0]["healthy_gpus"], 2, "{nodes}");
    let out = Command::new(BIN)
        .args(["nodes", "--api", &api, "--token-file", &server.token_file()])
        .output()
        .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        row,
        ["gpu-h", "H100", "2", "2", "idle", "-", "-", "-"],
        "{table}"
    );
    // A node may report only its own runs: another node's (or a finished) workload is refused,
    // and nothing is appended.
    let (_, before) = server.call("GET", "/v1/events?limit=1", None);
    let report = json!({"events": [{
        "idempotency_key": "forged",
        "envelope": {
            "id": "01a23880-0000-7000-8000-000000000001",
            "schema_version": ledger::event::SCHEMA_VERSION,
            "occurred_at_ms": 1,
            "actor": "agent:gpu-h",
            "type": "workload_finished",
            "payload": {"workload": id, "exit_code": 0}
        }
    }]});
    let report_as_agent = |body: &Value| {
        server.call_as(
            Some(&token),
            "POST",
            "/v1/nodes/gpu-h/events",
            Some(&body.to_string()),
        )
    };
    let (status, problem) = report_as_agent(&report);
    assert_eq!(status, 403, "{problem}");
    assert_eq!(problem["field"], "events[0].envelope");
    // So is an event stamped far ahead of the server's clock.
    let ahead = json!({"events": [{
        "idempotency_key": "future",
        "envelope": {
            "id": "01a23880-0000-7000-8000-000000000002",
            "schema_version": ledger::event::SCHEMA_VERSION,
            "occurred_at_ms": before["now_ms"].as_u64().unwrap() + 3_600_000,
            "actor": "agent:gpu-h",
            "type": "node_registered",
            "payload": {"node": "gpu-h", "gpus": 2, "model": "H100"}
        }
    }]});
    let (status, problem) = report_as_agent(&ahead);
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "events[0].envelope.occurred_at_ms");
    let (_, after) = server.call("GET", "/v1/events?limit=1", None);
    assert_eq!(
        before["last_seq"], after["last_seq"],
        "the log did not move"
    );
    assert!(agent.log().contains("is off by"), "{}", agent.log());
    // Its token revoked, the agent stops its runs and itself: the node is cut off, and what
    // ran there will run elsewhere, not twice.
    let long = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": [job.to_str().unwrap(), "600"]}),
    );
    wait_until("the long process", 30, || {
        lines(&jobs).iter().any(|l| l[0] == "start" && l[3] == long)
    });
    let (status, answer) = server.call("DELETE", "/v1/tokens/gpu-h", None);
    assert_eq!(status, 200, "{answer}");
    let mut agent = agent;
    wait_until("the agent to stop", 30, || {
        agent.child.try_wait().unwrap().is_some()
    });
    assert!(!agent.child.wait().unwrap().success());
    assert!(
        agent.log().contains("refused this agent's token"),
        "{}",
        agent.log()
    );
    assert!(
        lines(&jobs).iter().any(|l| l[0] == "term" && l[2] == long),
        "its run was stopped: {:?}",
        lines(&jobs)
    );
}

#[test]
fn a_dead_agents_node_goes_unhealthy_its_work_is_requeued_and_its_orphan_is_stopped_on_return() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 3600, &["--heartbeat-timeout-s", "2"]);
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    let work = tmp.path().join("agent");
    let agent = Agent::start(&nats.url(), "gpu-1", &work, &["--fake-gpus", "2"]);
    wait_for_node(&server, "gpu-1");
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 2, "command": [job.to_str().unwrap(), "600"]}),
    );
    wait_for(&server, &id, "running");
    wait_until("the process", 20, || !lines(&jobs).is_empty());
    // The agent dies. Its node falls silent: the GPUs go unhealthy, and with nobody to report
    // the run's end, the scheduler does, as a hardware failure.
    agent.kill9();
    wait_until("the workload to be requeued", 40, || {
        kinds(&history(&server, &id)).contains(&"workload_requeued".to_owned())
    });
    let h = history(&server, &id);
    let stopped = h.iter().find(|e| e["type"] == "workload_stopped").unwrap();
    assert_eq!(stopped["payload"]["reason"], "hardware_failure", "{h:?}");
    let (_, nodes) = server.call("GET", "/v1/nodes", None);
    assert_eq!(nodes["nodes"][0]["healthy_gpus"], 0, "{nodes}");
    // The process outlived its agent.
    assert!(!lines(&jobs).iter().any(|l| l[0] == "term"));
    // The agent returns: the node heals, the workload starts again, and the process of its old
    // run, which the ledger no longer places there, is stopped.
    let _agent = Agent::start(&nats.url(), "gpu-1", &work, &["--fake-gpus", "2"]);
    wait_until("the workload to start again", 40, || {
        let (_, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
        row["phase"] == "running" && row["starts"] == 2
    });
    wait_until(
        "the orphan to be stopped and the new run to start",
        30,
        || {
            let l = lines(&jobs);
            l.iter().any(|l| l[0] == "term") && l.iter().filter(|l| l[0] == "start").count() == 2
        },
    );
    let (_, metrics) = server.call("GET", "/v1/metrics/cluster", None);
    assert_eq!(metrics["contract_violations"], 0, "{metrics}");
    assert!(metrics["availability"].as_f64().unwrap() < 1.0, "{metrics}");
}

#[test]
fn a_gang_runs_on_two_nodes_and_a_failed_rank_requeues_it() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 3600, &[]);
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    server.grant("gpu-2", "agent", &[], Some("gpu-2"));
    let _a = Agent::start(
        &nats.url(),
        "gpu-1",
        &tmp.path().join("a1"),
        &["--fake-gpus", "1"],
    );
    let _b = Agent::start(
        &nats.url(),
        "gpu-2",
        &tmp.path().join("a2"),
        &["--fake-gpus", "1"],
    );
    wait_for_node(&server, "gpu-1");
    wait_for_node(&server, "gpu-2");
    // Rank 1 fails once, a second into its first run; rank 0 runs on.
    let log = tmp.path().join("gang.log");
    let mark = tmp.path().join("failed-once");
    let job = executable(
        &tmp.path().join("gang.sh"),
        &format!(
            "#!/bin/sh\n\
             echo \"start $FAIRLEDGER_NODE_RANK $FAIRLEDGER_NODES\" >> {log}\n\
             if [ \"$FAIRLEDGER_NODE_RANK\" = 1 ] && [ ! -e {mark} ]; then touch {mark}; sleep 1; exit 3; fi\n\
             trap 'echo \"term $FAIRLEDGER_NODE_RANK\" >> {log}; exit 143' TERM\n\
             sleep 600 & wait\n",
            log = log.display(),
            mark = mark.display()
        ),
    );
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "nodes": 2, "command": [job.to_str().unwrap()]}),
    );
    wait_until("the gang to start again", 40, || {
        let (_, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
        row["phase"] == "running" && row["starts"] == 2
    });
    let h = history(&server, &id);
    let stopped = h.iter().find(|e| e["type"] == "workload_stopped").unwrap();
    assert_eq!(stopped["payload"]["reason"], "lost", "{h:?}");
    assert!(kinds(&h).contains(&"workload_requeued".to_owned()));
    // Both ranks ran twice, knowing the gang's nodes; rank 0's first run was stopped.
    wait_until(
        "both ranks of the second run and the first rank 0 stopped",
        30,
        || {
            let l = lines(&log);
            l.iter().filter(|l| l[0] == "start").count() == 4
                && l.iter().any(|l| l[0] == "term" && l[1] == "0")
        },
    );
    let l = lines(&log);
    assert!(
        l.iter()
            .filter(|l| l[0] == "start")
            .all(|l| l[2] == "gpu-1,gpu-2" || l[2] == "gpu-2,gpu-1"),
        "{l:?}"
    );
    let (_, metrics) = server.call("GET", "/v1/metrics/cluster", None);
    assert_eq!(metrics["contract_violations"], 0, "{metrics}");
}

/// access: on a NATS secured with the shipped configuration and `fairledger nats-auth`'s users,
/// the service creates what agents may not, an agent's reports reach the ledger through the
/// service (its user may not write the ledger), and one node's key cannot drive another.
#[test]
fn on_a_secured_nats_an_agent_reports_through_the_service_for_its_own_node_only() {
    let tmp = tempfile::tempdir().unwrap();
    let auth = tmp.path().join("nats");
    let made = Command::new(BIN)
        .args([
            "nats-auth",
            "--out",
            auth.to_str().unwrap(),
            "--agent",
            "gpu-1",
        ])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let ops = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/nats/secure.conf");
    std::fs::copy(ops, auth.join("secure.conf")).unwrap();
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(auth.join("gpu-1.nk"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let nats = NatsServer::start_with(eventlog::testing::ServerOptions {
        config: Some(auth.join("secure.conf")),
        ..Default::default()
    });
    let key = |name: &str| auth.join(format!("{name}.nk")).to_str().unwrap().to_owned();
    let server = serve_on(
        &nats,
        tmp.path(),
        3600,
        &["--nats-nkey", &key("fairledger")],
    );
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    let work = tmp.path().join("agent");
    let _agent = Agent::start(
        &nats.url(),
        "gpu-1",
        &work,
        &["--fake-gpus", "2", "--nats-nkey", &key("gpu-1")],
    );
    wait_for_node(&server, "gpu-1");
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    // 10 h of protection, within the log's cap and over the default one.
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 2, "min_runtime_s": 36000,
               "command": [job.to_str().unwrap(), "0"]}),
    );
    wait_for(&server, &id, "finished");
    let h = history(&server, &id);
    assert_eq!(h.last().unwrap()["actor"], "agent:gpu-1", "{h:?}");
    // gpu-1's key does not make an agent of gpu-2.
    let out = Command::new(BIN)
        .args([
            "agent",
            "--nats",
            &nats.url(),
            "--node",
            "gpu-2",
            "--fake-gpus",
            "2",
        ])
        .args(["--nats-nkey", &key("gpu-1")])
        .arg("--work-dir")
        .arg(tmp.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("refused the credentials") && err.contains("--node"),
        "{err}"
    );
    // Without a key, nothing connects.
    let out = Command::new(BIN)
        .args(["project", "--once", "--nats", &nats.url()])
        .arg("--data")
        .arg(tmp.path().join("projector"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused the credentials"));
}

/// A node whose every launch goes through `shim` (one that cannot launch anything) runs one
/// submission: it ends failed with the reason, after [`agent::LAUNCH_ATTEMPTS`] tries.
fn a_failing_launch_through(shim: &str, reason: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_embedded(tmp.path());
    let api = format!("http://{}", server.addr);
    let token = server.grant("gpu-h", "agent", &[], Some("gpu-h"));
    let agent = Agent::start_with_env(
        &["--api", &api],
        "gpu-h",
        &tmp.path().join("agent"),
        &["--fake-gpus", "2", "--launch-backoff-s", "0.2"],
        &[
            ("FAIRLEDGER_TOKEN", &token),
            ("FAIRLEDGER_AGENT_SHIM", shim),
        ],
    );
    wait_for_node(&server, "gpu-h");
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": ["true"]}),
    );
    let row = wait_for(&server, &id, "finished");
    assert_eq!(row["exit_code"], 127, "{row}");
    assert!(row["error"].as_str().is_some(), "{row}");
    let h = history(&server, &id);
    assert_eq!(
        kinds(&h),
        [
            "workload_submitted",
            "workload_started",
            "workload_finished"
        ],
        "launched once, tried a few times on the node, then failed: {h:?}"
    );
    let end = &h[2]["payload"];
    assert_eq!(end["exit_code"], 127, "{end}");
    let error = end["error"].as_str().unwrap();
    assert!(
        error.contains("could not launch") && error.contains(reason),
        "{end}"
    );
    let log = agent.log();
    assert_eq!(
        log.matches("trying again").count() as u32,
        agent::LAUNCH_ATTEMPTS - 1,
        "{log}"
    );
}

#[test]
fn a_run_its_node_cannot_launch_fails_with_the_reason_instead_of_looping() {
    // The launcher is not there: spawning it fails.
    a_failing_launch_through("/nonexistent/fairledger", "No such file");
}

#[test]
fn a_shim_that_exits_without_starting_the_command_is_a_failed_launch_not_a_lost_run() {
    // The launcher starts, and exits at once without a trace in the run directory.
    a_failing_launch_through("/bin/false", "before starting the command");
}

#[test]
fn a_gang_rank_its_node_cannot_launch_fails_the_gang_instead_of_requeueing_it() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 3600, &[]);
    server.grant("gpu-1", "agent", &[], Some("gpu-1"));
    server.grant("gpu-2", "agent", &[], Some("gpu-2"));
    let _a = Agent::start(
        &nats.url(),
        "gpu-1",
        &tmp.path().join("a1"),
        &["--fake-gpus", "1", "--launch-backoff-s", "0.2"],
    );
    let _b = Agent::start_with_env(
        &["--nats", &nats.url()],
        "gpu-2",
        &tmp.path().join("a2"),
        &["--fake-gpus", "1", "--launch-backoff-s", "0.2"],
        &[("FAIRLEDGER_AGENT_SHIM", "/nonexistent/fairledger")],
    );
    wait_for_node(&server, "gpu-1");
    wait_for_node(&server, "gpu-2");
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "nodes": 2, "command": ["sleep", "600"]}),
    );
    // Whichever rank gpu-2 holds, the gang ends failed with gpu-2's reason, started once.
    let row = wait_for(&server, &id, "finished");
    assert_eq!(row["exit_code"], 127, "{row}");
    assert!(
        row["error"].as_str().unwrap().contains("could not launch"),
        "{row}"
    );
    let h = history(&server, &id);
    let starts = kinds(&h)
        .iter()
        .filter(|k| *k == "workload_started")
        .count();
    assert_eq!(starts, 1, "{h:?}");
    assert!(
        !kinds(&h).contains(&"workload_requeued".to_owned()),
        "{h:?}"
    );
}

/// The agents inside an embedded `serve` leave their runs running when `serve` is SIGKILLed, as
/// any agent does: `serve` started again on the same data re-adopts them (it does not launch them
/// again), and stops them when asked.
#[test]
fn a_killed_servers_runs_go_on_and_its_restart_re_adopts_them() {
    let tmp = tempfile::tempdir().unwrap();
    let config = cluster(tmp.path(), 3600);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text += "\n[[nodes]]\ncount = 1\ngpus = 2\nmodel = \"H100\"\n";
    std::fs::write(&config, text).unwrap();
    let data = tmp.path().join("data");
    let args = [
        "--data",
        data.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ];
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let mut server = Server::start(&args);
    let long = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": [job, "600"]}),
    );
    wait_until("the process to start", 20, || lines(&jobs).len() == 1);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    // Dropped without killing the runs, which must outlive it (the next server's drop kills
    // them).
    server.data = tmp.path().join("not-the-data");
    drop(server);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(lines(&jobs).len(), 1, "the run went on: {:?}", lines(&jobs));
    let server = Server::start(&args);
    wait_until("the run to be re-adopted", 20, || {
        server.stderr.lock().unwrap().contains("re-adopting")
    });
    assert_eq!(wait_for(&server, &long, "running")["id"], long.as_str());
    let (status, _) = server.call("DELETE", &format!("/v1/workloads/{long}"), None);
    assert_eq!(status, 202);
    wait_for(&server, &long, "cancelled");
    wait_until("the adopted process to get SIGTERM", 20, || {
        lines(&jobs).iter().any(|l| l[0] == "term" && l[2] == long)
    });
    let starts = lines(&jobs).iter().filter(|l| l[0] == "start").count();
    assert_eq!(starts, 1, "launched once: {:?}", lines(&jobs));
}

/// A node the server drives with its own agent is not driven from outside as well: an agent
/// started for it over HTTP (with that node's token) is refused, told why, and does not start.
#[test]
fn an_agent_for_a_node_the_server_drives_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let server = Server::start(&["--data", data.to_str().unwrap()]);
    let token = data.join("agents/demo-1/agent.token");
    // The server's agents start after it listens: its token is there once demo-1's is driven.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !token.is_file() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused = Command::new(BIN)
        .args(["agent", "--api", &format!("http://{}", server.addr)])
        .args(["--node", "demo-1", "--fake-gpus", "8", "--token-file"])
        .arg(&token)
        .arg("--work-dir")
        .arg(tmp.path().join("outside"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success()
            && said.contains("the server's own agent")
            && said.contains("--no-agents"),
        "{said}"
    );
}

/// `--run-as-submitter`: a job runs as the Unix user named like its submitter (with that user's
/// groups), never as root, and cannot read what the agent and the server keep; a submitter
/// without a Unix user of that name gets a failed run that says so. An agent not running as
/// root is refused the flag.
#[test]
fn with_run_as_submitter_a_job_runs_as_its_submitters_unix_user() {
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_embedded(tmp.path());
    let api = format!("http://{}", server.addr);
    let token = server.grant("gpu-r", "agent", &[], Some("gpu-r"));
    let work = tmp.path().join("agent");
    let mut agent = Agent::start_with_env(
        &["--api", &api],
        "gpu-r",
        &work,
        &["--fake-gpus", "1", "--run-as-submitter"],
        &[("FAIRLEDGER_TOKEN", &token)],
    );
    let uid = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        wait_until("the agent to refuse", 30, || {
            agent.child.try_wait().unwrap().is_some()
        });
        assert!(
            agent.log().contains("needs the agent to run as root"),
            "{}",
            agent.log()
        );
        return;
    }
    wait_for_node(&server, "gpu-r");
    // `nobody` is a submitter here and a Unix user on every Debian-like system.
    let nobody = server.grant("nobody", "submitter", &["lab"], None);
    let secret = server.data.join("admin.token");
    let probe = format!(
        "id -un; id -u; cat {} >/dev/null 2>&1 && echo read-the-token || echo cannot-read-the-token",
        secret.display()
    );
    // What a job submitted with `token` printed, once it finished.
    let ran = |token: &str, command: Value| {
        let body = json!({"allocation": "lab/a", "gpus_per_node": 1, "command": command});
        let id = common::submit_as(&server, Some(token), &body);
        wait_for(&server, &id, "finished");
        common::cli(&server, &["logs", &id]).unwrap()
    };
    assert_eq!(
        ran(&nobody, json!(["sh", "-c", probe])),
        "nobody\n65534\ncannot-read-the-token\n"
    );
    // A grant may name the Unix user instead: `ci` runs as nobody too.
    let body =
        json!({"name": "ci", "role": "submitter", "allocations": ["lab"], "unix_user": "nobody"});
    let (status, ci) = server.call("POST", "/v1/tokens", Some(&body.to_string()));
    assert_eq!(status, 201, "{ci}");
    assert_eq!(
        ran(ci["token"].as_str().unwrap(), json!(["id", "-un"])),
        "nobody\n"
    );
    // With the groups a login as that user gets, supplementary ones included, and not the
    // agent's (root's).
    let login = Command::new("id").args(["-G", "nobody"]).output().unwrap();
    assert_eq!(
        ran(&nobody, json!(["id", "-G"])),
        String::from_utf8_lossy(&login.stdout)
    );
    // The admin has no Unix user of its name: its run fails, saying why.
    let admin = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": ["true"]}),
    );
    let row = wait_for(&server, &admin, "finished");
    assert!(
        row["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no Unix user \"admin\""),
        "{row}"
    );
}

/// An agent whose grant the ledger revokes stops its runs and itself, on NATS too (where its
/// NATS user, not a token, is what the server checks): it folds the revocation like any event.
#[test]
fn an_agent_on_nats_stops_when_the_ledger_revokes_its_grant() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 3600, &[]);
    server.grant("gpu-v", "agent", &[], Some("gpu-v"));
    let work = tmp.path().join("agent");
    let mut agent = Agent::start(&nats.url(), "gpu-v", &work, &["--fake-gpus", "1"]);
    wait_for_node(&server, "gpu-v");
    let jobs = tmp.path().join("jobs.log");
    let job = script(tmp.path(), &jobs);
    let id = submit(
        &server,
        json!({"allocation": "lab/a", "gpus_per_node": 1, "command": [job.to_str().unwrap(), "600"]}),
    );
    wait_until("the process", 30, || {
        lines(&jobs).iter().any(|l| l[0] == "start" && l[3] == id)
    });
    let (status, answer) = server.call("DELETE", "/v1/tokens/gpu-v", None);
    assert_eq!(status, 200, "{answer}");
    wait_until("the agent to stop", 30, || {
        agent.child.try_wait().unwrap().is_some()
    });
    assert!(agent.log().contains("was revoked"), "{}", agent.log());
    assert!(
        lines(&jobs).iter().any(|l| l[0] == "term" && l[2] == id),
        "{:?}",
        lines(&jobs)
    );
}

/// An agent on NATS writes its events itself, so the ledger must grant it: without a grant it
/// refuses to start and says how to get one, instead of registering a node the fold would
/// refuse; an event written under its name anyway changes nothing.
#[test]
fn an_agent_on_nats_without_a_grant_refuses_to_start_and_says_how_to_get_one() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let server = serve_on(&nats, tmp.path(), 3600, &[]);
    let work = tmp.path().join("agent");
    let mut agent = Agent::start(&nats.url(), "gpu-u", &work, &["--fake-gpus", "1"]);
    wait_until("the agent to stop", 30, || {
        agent.child.try_wait().unwrap().is_some()
    });
    assert!(
        agent
            .log()
            .contains("fairledger token create --name gpu-u --role agent"),
        "{}",
        agent.log()
    );
    // Granted, it starts and registers its node.
    server.grant("gpu-u", "agent", &[], Some("gpu-u"));
    let _agent = Agent::start(&nats.url(), "gpu-u", &work, &["--fake-gpus", "1"]);
    wait_for_node(&server, "gpu-u");
}
