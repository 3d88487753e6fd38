//! The simulator end to end: inputs in files, outputs in a directory.

use std::path::{Path, PathBuf};

use sim::report::Report;
use sim::scenario::Scenario;
use sim::trace::{Format, TraceOptions};
use sim::{RunSpec, SimError};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn spec(
    scenario: &Path,
    workloads: &Path,
    format: Format,
    out: &Path,
    until_s: Option<u64>,
) -> RunSpec {
    RunSpec {
        scenario: Scenario::load(scenario).unwrap().prepare(None).unwrap(),
        workloads: workloads.to_path_buf(),
        trace: TraceOptions {
            format,
            skip_bad_rows: false,
            allocation_column: None,
        },
        seed: 7,
        work_model: sim::WorkModel::default(),
        until_s,
        out: out.to_path_buf(),
    }
}

/// The report without the one figure that differs between identical runs.
fn timeless(mut r: Report) -> Report {
    r.sim.wall_s = 0.0;
    r
}

#[test]
fn the_work_model_decides_whether_a_run_without_checkpoints_resumes_or_restarts() {
    // The two teams' trace with no checkpoint interval anywhere.
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("no-checkpoints.csv");
    let text = std::fs::read_to_string(data("two-teams.csv")).unwrap();
    let rows: Vec<String> = text
        .lines()
        .map(|l| {
            let mut cells: Vec<&str> = l.split(',').collect();
            if cells[0] != "id" {
                cells[7] = "";
            }
            cells.join(",")
        })
        .collect();
    std::fs::write(&trace, rows.join("\n") + "\n").unwrap();
    let run = |model: sim::WorkModel| {
        let out = dir.path().join(model.name());
        let mut s = spec(&data("two-teams.toml"), &trace, Format::Native, &out, None);
        s.work_model = model;
        sim::run(&s, |_| {}).unwrap().report
    };
    let delivered = |r: &Report| {
        r.allocations
            .iter()
            .map(|a| a.delivered_gpu_hours)
            .sum::<f64>()
    };
    // Resuming: nothing is redone, and the teams got exactly the 576 GPU-h of their work.
    let resumed = run(sim::WorkModel::Checkpoint);
    assert_eq!(resumed.sim.work_model, sim::WorkModel::Checkpoint);
    assert!(resumed.churn.all.stopped >= 1, "{:?}", resumed.churn);
    assert_eq!(resumed.churn.all.redone_gpu_hours, 0.0);
    assert!(
        (delivered(&resumed) - 576.0).abs() < 1e-6,
        "{}",
        delivered(&resumed)
    );
    // Restarting: every stopped run is redone whole, and the cluster delivered that much more.
    let restarted = run(sim::WorkModel::Restart);
    assert_eq!(restarted.sim.work_model, sim::WorkModel::Restart);
    let c = &restarted.churn.all;
    assert!(c.stopped >= 1 && c.redone_gpu_hours > 0.0, "{c:?}");
    assert!((c.redone_gpu_hours - c.run_gpu_hours).abs() < 0.01, "{c:?}");
    assert!(
        (delivered(&restarted) - 576.0 - c.redone_gpu_hours).abs() < 0.01,
        "{} {c:?}",
        delivered(&restarted)
    );
    assert_eq!(restarted.workloads.finished, 25);
    assert_eq!(restarted.workloads.contract_violations, 0);
}

#[test]
fn two_teams_run_drains_and_writes_a_replayable_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(
        &data("two-teams.toml"),
        &data("two-teams.csv"),
        Format::Native,
        dir.path(),
        None,
    );
    let result = sim::run(&s, |_| {}).unwrap();
    let r = &result.report;
    // Drained: every one of the 25 workloads ran; each team got what it submitted, 12 jobs x
    // 8 GPUs x 3 h = 288 GPU-h, whatever the policy. b gives no checkpoint interval, so nothing
    // of its is lost; a checkpoints every 30 min and redoes what a preemption lost since then.
    assert_eq!(
        (
            r.workloads.submitted,
            r.workloads.started,
            r.workloads.finished
        ),
        (25, 25, 25)
    );
    assert_eq!(r.workloads.contract_violations, 0);
    let by = |p: &str| r.allocations.iter().find(|a| a.path == p).unwrap();
    assert!(
        (by("lab/b").delivered_gpu_hours - 288.0).abs() < 1e-6,
        "{}",
        by("lab/b").delivered_gpu_hours
    );
    let a = by("lab/a").delivered_gpu_hours;
    assert!(
        (288.0..288.0 + 8.0 * 0.5 * r.workloads.preemptions as f64).contains(&a),
        "{a}"
    );
    // Team a squatted both nodes at t=0 with 3 h jobs; b arrived at 1 h and could preempt only
    // after a's 1 h contracts: b's first job waited no longer than that, plus grace.
    let b = r.allocations.iter().find(|a| a.path == "lab/b").unwrap();
    assert!(b.wait_p50_s.is_some());
    assert!(r.workloads.preemptions >= 1);
    assert!(r.unallocated_delivered_gpu_hours > 0.0);

    // What the preemptions cost: every request counted once, by reason; each run they stopped
    // paid its grace period; a's runs redo what they ran since their last checkpoint, less than
    // they would from their start.
    let c = &r.churn;
    assert_eq!(c.all.requests, r.workloads.preemptions);
    assert_eq!(
        c.by_reason.values().map(|x| x.requests).sum::<u64>(),
        c.all.requests
    );
    assert!((1..=c.all.requests).contains(&c.all.stopped), "{c:?}");
    assert!(c.all.grace_gpu_hours > 0.0, "{c:?}");
    assert!(
        c.all.redone_gpu_hours > 0.0 && c.all.redone_gpu_hours < c.all.run_gpu_hours,
        "{c:?}"
    );
    assert!(
        c.workloads_preempted >= 1 && c.per_workload_max >= 1,
        "{c:?}"
    );
    assert_eq!(c.reclaims_for_another, 0);
    // The audit's book, folding the written ledger, finds the same costs.
    let mut state = ledger::State::new(s.scenario.state_config);
    let mut book = ledger::book::Book::new();
    let events = std::fs::read_to_string(dir.path().join("events.jsonl")).unwrap();
    for (i, line) in events.lines().enumerate() {
        let env: ledger::Envelope = serde_json::from_str(line).unwrap();
        book.apply(&mut state, i as u64 + 1, &env);
    }
    let kept = book.costs();
    let h = |ms: u64| ms as f64 / 3_600_000.0;
    assert_eq!(kept.stopped, c.all.stopped);
    assert!(
        (h(kept.grace_gpu_ms) - c.all.grace_gpu_hours).abs() < 1e-6,
        "{kept:?}"
    );
    assert!(
        (h(kept.redone_gpu_ms) - c.all.redone_gpu_hours).abs() < 1e-6,
        "{kept:?}"
    );
    assert!(
        (h(kept.run_gpu_ms) - c.all.run_gpu_hours).abs() < 1e-6,
        "{kept:?}"
    );

    // The files: events.jsonl folds back into the same report; report.json is what was returned.
    let replayed = sim::replay(
        &dir.path().join("events.jsonl"),
        s.scenario.state_config,
        s.scenario.policy.policy,
        None,
        s.seed,
        s.work_model,
    )
    .unwrap()
    .report;
    assert_eq!(timeless(replayed), timeless(r.clone()));
    let written: Report =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
            .unwrap();
    assert_eq!(&written, r);

    // report.html: self-contained, with its four charts, every allocation named, and one more
    // chart per allocation of its waits by GPUs asked (a line for each size it started), on a
    // log axis.
    let html = std::fs::read_to_string(dir.path().join("report.html")).unwrap();
    assert_eq!(html.matches("<svg").count(), 4 + r.allocations.len());
    assert!(html.contains("lab/a") && html.contains("lab/b"));
    assert!(html.contains("What preemptions cost"));
    assert!(html.contains("wait (hours, log scale)"));
    // Legends name what their picture shows: the timeline its idle GPUs and the trace's one
    // unallocated workload (o1); the waits, of allocations only, neither.
    let timeline = &html[html.find("<h2>Every GPU").unwrap()..];
    let timeline_legend = &timeline[..timeline.find("<svg").unwrap()];
    assert!(timeline_legend.contains("idle") && timeline_legend.contains("(unallocated)"));
    let waits = &html[html.find("<h2>Queue waits</h2>").unwrap()..];
    let waits_legend = &waits[..waits.find("<svg").unwrap()];
    assert!(!waits_legend.contains("idle") && !waits_legend.contains("(unallocated)"));
    for a in &r.allocations {
        for size in &a.waits_by_size {
            let label = format!("{} GPU(s)", size.gpus);
            assert!(html.contains(&label), "{}: {label}", a.path);
        }
    }
    assert_self_contained(&html);
}

/// No script, stylesheet, image or font is fetched: the SVG namespace is the only URL.
fn assert_self_contained(html: &str) {
    let urls = html.matches("http://").count() + html.matches("https://").count();
    let namespaces = html.matches("http://www.w3.org/2000/svg").count();
    assert_eq!(urls, namespaces, "the page refers to the network");
    assert!(!html.contains("<script") && !html.contains("<link") && !html.contains("<img"));
}

#[test]
fn compare_html_puts_policies_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let mut reports = Vec::new();
    for policy in ["fifo", "fairshare"] {
        let mut s = spec(
            &data("two-teams.toml"),
            &data("two-teams.csv"),
            Format::Native,
            &dir.path().join(policy),
            Some(20_000),
        );
        s.scenario = Scenario::load(&data("two-teams.toml"))
            .unwrap()
            .prepare(Some(policy))
            .unwrap();
        reports.push(sim::run(&s, |_| {}).unwrap().report);
    }
    sim::html::write_compare(dir.path(), &reports).unwrap();
    let html = std::fs::read_to_string(dir.path().join("compare.html")).unwrap();
    assert!(html.contains("fifo/report.html") && html.contains("fairshare/report.html"));
    // Delivered over owed, and waits, per allocation and policy; the policies in colours of
    // their own, none of which an allocation has.
    assert_eq!(html.matches("<svg").count(), 2);
    assert!(html.contains("Queue waits per allocation") && html.contains("<th>p90</th>"));
    let report = std::fs::read_to_string(dir.path().join("fairshare/report.html")).unwrap();
    let swatches = |page: &str| -> Vec<String> {
        page.split("<i style=\"background:")
            .skip(1)
            .map(|s| s[..7].to_owned())
            .collect()
    };
    let policy_colours = swatches(&html[..html.find("<svg").unwrap()]);
    assert_eq!(policy_colours.len(), 2, "{html}");
    for c in swatches(&report) {
        assert!(
            !policy_colours.contains(&c),
            "{c} is both a policy's and an allocation's"
        );
    }
    assert_self_contained(&html);
}

#[test]
fn the_same_inputs_give_identical_bytes() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = sim::run(
        &spec(
            &data("two-teams.toml"),
            &data("two-teams.csv"),
            Format::Native,
            d1.path(),
            Some(20_000),
        ),
        |_| {},
    )
    .unwrap();
    let r2 = sim::run(
        &spec(
            &data("two-teams.toml"),
            &data("two-teams.csv"),
            Format::Native,
            d2.path(),
            Some(20_000),
        ),
        |_| {},
    )
    .unwrap();
    let events = |d: &Path| std::fs::read(d.join("events.jsonl")).unwrap();
    assert!(!events(d1.path()).is_empty());
    assert_eq!(events(d1.path()), events(d2.path()));
    assert_eq!(timeless(r1.report), timeless(r2.report));
}

#[test]
fn csv_and_json_lines_are_the_same_trace() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let csv = sim::run(
        &spec(
            &data("two-teams.toml"),
            &data("two-teams.csv"),
            Format::Native,
            d1.path(),
            None,
        ),
        |_| {},
    )
    .unwrap();
    let jsonl = sim::run(
        &spec(
            &data("two-teams.toml"),
            &data("two-teams.jsonl"),
            Format::Native,
            d2.path(),
            None,
        ),
        |_| {},
    )
    .unwrap();
    assert_eq!(timeless(csv.report), timeless(jsonl.report));
}

#[test]
fn until_reports_on_the_period_only() {
    // Stopped at 2 h: both nodes have been busy the whole time (a's 16 GPUs from t=0), so
    // 16 GPUs x 2 h = 32 GPU-h were delivered in all, and the horizon is exactly 7,200 s.
    let dir = tempfile::tempdir().unwrap();
    let r = sim::run(
        &spec(
            &data("two-teams.toml"),
            &data("two-teams.csv"),
            Format::Native,
            dir.path(),
            Some(7_200),
        ),
        |_| {},
    )
    .unwrap()
    .report;
    assert_eq!(r.sim.horizon_s, 7_200.0);
    let delivered: f64 = r
        .allocations
        .iter()
        .map(|a| a.delivered_gpu_hours)
        .sum::<f64>()
        + r.unallocated_delivered_gpu_hours;
    assert!((delivered - 32.0).abs() < 1e-9, "{delivered}");
    assert!(r.workloads.finished < r.workloads.submitted);
}

#[test]
fn a_bad_row_names_the_file_line_and_field_or_is_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = spec(
        &data("two-teams.toml"),
        &data("bad.csv"),
        Format::Native,
        dir.path(),
        None,
    );
    let err = sim::run(&s, |_| {}).unwrap_err();
    let SimError::Row(row) = &err else {
        panic!("expected a row error, got {err}")
    };
    assert_eq!((row.line, row.field.as_str()), (3, "gpus"));
    assert!(err.to_string().contains("bad.csv:3"), "{err}");
    assert!(
        !dir.path().join("events.jsonl").exists(),
        "a bad trace must stop the run before it starts"
    );

    s.trace.skip_bad_rows = true;
    let result = sim::run(&s, |_| {}).unwrap();
    assert_eq!(result.bad_rows, 1);
    assert_eq!(result.report.workloads.submitted, 2);
}

#[test]
fn an_allocation_missing_from_the_scenario_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("w.csv");
    std::fs::write(
        &trace,
        "id,allocation,submit_s,duration_s,gpus\nx,lab/c,0,10,1\n",
    )
    .unwrap();
    let err = sim::run(
        &spec(
            &data("two-teams.toml"),
            &trace,
            Format::Native,
            &dir.path().join("out"),
            None,
        ),
        |_| {},
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("\"lab/c\"") && err.to_string().contains("[[allocations]]"),
        "{err}"
    );
}

#[test]
fn scenario_mistakes_are_reported_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.toml");
    let check = |text: &str, needle: &str| {
        std::fs::write(&path, text).unwrap();
        let err = Scenario::load(&path)
            .and_then(|s| s.prepare(None).map(|_| ()))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    };
    check(
        "[policy]\nname = \"lottery\"\n[[nodes]]\ncount=1\ngpus=8\nmodel=\"H\"\n",
        "fairshare",
    );
    check(
        "[[nodes]]\ncount=1\ngpus=8\nmodel=\"H\"\nspeed=3\n",
        "speed",
    );
    check("[[allocations]]\npath=\"a\"\nweight=1\n", "no nodes");
    check("[policy]\nmin_runtime_s = 9\nmax_min_runtime_s = 5\n[[nodes]]\ncount=1\ngpus=8\nmodel=\"H\"\n", "max_min_runtime_s");
    // The set-up is folded by the ledger's rules: a model it refuses names the node.
    check(
        "[[nodes]]\ncount=1\ngpus=8\nmodel=\"H100\\tSXM\"\n",
        "[[nodes]] node \"H100-SXM-0-0\": model",
    );
    check(
        "[[nodes]]\ncount=1\ngpus=8\nmodel=\"H\"\nlabels={\"rack b\"=\"1\"}\n",
        "labels",
    );
}

#[test]
fn a_model_with_spaces_names_its_nodes_with_dashes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.toml");
    std::fs::write(&path, "[[nodes]]\ncount=2\ngpus=8\nmodel=\"A100 80GB\"\n").unwrap();
    let prepared = Scenario::load(&path).unwrap().prepare(None).unwrap();
    let names: Vec<&str> = prepared.nodes.iter().map(|n| n.0.as_str()).collect();
    assert_eq!(names, ["A100-80GB-0-0", "A100-80GB-0-1"]);
}

#[test]
fn the_bundled_alibaba_trace_runs_with_its_invariants() {
    // The first 120 days of the real trace (its pods come mostly after day 110) on the 32-GPU
    // scenario.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let until_s = 120 * 86_400;
    let s = spec(
        &root.join("scenarios/alibaba-32gpu.toml"),
        &root.join("traces/alibaba2023/openb_pod_list_default.csv"),
        Format::AlibabaOpenb,
        dir.path(),
        Some(until_s),
    );
    let r = sim::run(&s, |_| {}).unwrap().report;
    assert!(r.workloads.submitted > 100, "{:?}", r.workloads);
    assert_eq!(r.workloads.rejected, 0);
    assert_eq!(r.workloads.contract_violations, 0);
    // Delivered never exceeds capacity: 32 GPUs over the period.
    let delivered: f64 = r.allocations.iter().map(|a| a.delivered_gpu_hours).sum();
    assert!(delivered <= 32.0 * until_s as f64 / 3600.0 + 1e-6);
    assert!(delivered > 0.0);
    // The ledger alone reproduces the report.
    let replayed = sim::replay(
        &dir.path().join("events.jsonl"),
        s.scenario.state_config,
        s.scenario.policy.policy,
        Some(until_s * 1000),
        s.seed,
        s.work_model,
    )
    .unwrap()
    .report;
    assert_eq!(timeless(replayed), timeless(r));
}

fn read(format: Format, file: &str, column: Option<&str>) -> Vec<ledger::sim::SimWorkload> {
    let opts = TraceOptions {
        format,
        skip_bad_rows: false,
        allocation_column: column.map(str::to_string),
    };
    sim::trace::open(&data(file), &opts)
        .unwrap()
        .map(|r| r.unwrap())
        .collect()
}

/// (name, allocation, submit_s, work_s, gpus per node, nodes)
fn shapes(ws: &[ledger::sim::SimWorkload]) -> Vec<(String, Option<String>, u64, u64, u32, u32)> {
    ws.iter()
        .map(|w| {
            let s = &w.submitted;
            (
                s.name.clone().unwrap(),
                s.allocation.clone(),
                w.submit_ms / 1000,
                w.work_ms / 1000,
                s.gpus_per_node,
                s.nodes,
            )
        })
        .collect()
}

#[test]
fn philly_jobs_become_gangs_with_the_work_of_all_attempts() {
    // application_2 was submitted first (05:40:20): 2 machines x 8 GPUs, attempts of 10 and 20
    // minutes. application_1 five seconds later: 4 GPUs for an hour. application_3 never ran.
    let ws = read(Format::Philly, "philly_job_log.json", None);
    assert_eq!(
        shapes(&ws),
        vec![
            ("application_2".into(), Some("vc-b".into()), 0, 1800, 8, 2),
            ("application_1".into(), Some("vc-a".into()), 5, 3600, 4, 1),
        ]
    );
    let by_user = read(Format::Philly, "philly_job_log.json", Some("user"));
    assert_eq!(by_user[0].submitted.allocation.as_deref(), Some("u2"));
}

#[test]
fn helios_jobs_spread_their_gpus_over_their_nodes() {
    // j2 used no GPU and is left out; times count from j1's submission.
    let ws = read(Format::Helios, "helios_cluster_log.csv", None);
    assert_eq!(
        shapes(&ws),
        vec![
            ("j1".into(), Some("vcA".into()), 0, 3600, 8, 2),
            ("j3".into(), Some("vcB".into()), 120, 600, 1, 1)
        ]
    );
}

#[test]
fn pai_tasks_with_gpus_become_workloads() {
    // The ps task has no GPU and job3's task never ran; a half GPU is given a whole one.
    let ws = read(Format::AlibabaPai2020, "pai_task_table.csv", None);
    assert_eq!(
        shapes(&ws),
        vec![
            ("job1/worker".into(), Some("V100".into()), 0, 3600, 1, 2),
            ("job2/tensorflow".into(), Some("T4".into()), 500, 300, 1, 1),
        ]
    );
    let teams = read(
        Format::AlibabaPai2020,
        "pai_task_table.csv",
        Some("teams:2"),
    );
    assert_eq!(teams[1].submitted.allocation.as_deref(), Some("team-1"));
}
