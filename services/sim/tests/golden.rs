//! Golden scenarios: each folder under `tests/golden/` holds a `scenario.toml`, a
//! `workloads.csv`, an `expect.toml` of outcomes worked out by hand (its comments say how), and a
//! `report.txt` snapshot of the whole report.
//!
//! The expectations are never rewritten. The snapshot guards everything else against unreviewed
//! change: `UPDATE_GOLDEN=1 cargo test -p sim --test golden` rewrites it; review the diff.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use sim::report::Report;
use sim::scenario::Scenario;
use sim::trace::{Format, TraceOptions};

/// A bound on one figure.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Bound {
    eq: Option<f64>,
    value: Option<f64>,
    tolerance: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
}

impl Bound {
    fn check(&self, what: &str, got: Option<f64>, failures: &mut Vec<String>) {
        let Some(got) = got else {
            failures.push(format!("{what}: no value"));
            return;
        };
        if let Some(eq) = self.eq {
            if got != eq {
                failures.push(format!("{what}: {got}, expected exactly {eq}"));
            }
        }
        if let Some(v) = self.value {
            let tol = self.tolerance.unwrap_or(0.0);
            if (got - v).abs() > tol {
                failures.push(format!("{what}: {got}, expected {v} ± {tol}"));
            }
        }
        if self.min.is_some_and(|m| got < m) || self.max.is_some_and(|m| got > m) {
            failures.push(format!(
                "{what}: {got}, expected within [{:?}, {:?}]",
                self.min, self.max
            ));
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    until_s: Option<u64>,
    #[serde(default)]
    workloads: std::collections::BTreeMap<String, Bound>,
    #[serde(default)]
    metrics: std::collections::BTreeMap<String, Bound>,
    #[serde(default)]
    fragmentation: std::collections::BTreeMap<String, Bound>,
    #[serde(default)]
    allocations: Vec<AllocationExpect>,
}

#[derive(Debug, Deserialize)]
struct AllocationExpect {
    path: String,
    #[serde(flatten)]
    figures: std::collections::BTreeMap<String, Bound>,
}

/// The report as a readable table, rounded so that the snapshot is stable and reviewable.
fn render(r: &Report) -> String {
    let w = &r.workloads;
    let mut out = format!(
        "policy {}\nworkloads submitted {} rejected {} started {} finished {} preemptions {} reclaimed {} defragmented {} borrowed_starts {} contract_violations {}\n",
        r.policy, w.submitted, w.rejected, w.started, w.finished, w.preemptions, w.reclaimed, w.defragmented, w.borrowed_starts, w.contract_violations
    );
    out += &format!(
        "availability {:.4} occupancy {:.4} impact {:.4} delivered_over_owed {:.4}\n",
        r.metrics.availability,
        r.metrics.occupancy,
        r.metrics.impact,
        r.fairness.delivered_over_owed
    );
    out += &format!(
        "stranded_gpu_hours {:.1} idle_while_fitting_gpu_hours {:.1} largest_startable_gang_p50 {} unallocated_gpu_hours {:.1} horizon_s {}\n\n",
        r.fragmentation.stranded_gpu_hours, r.fragmentation.idle_while_fitting_gpu_hours, r.fragmentation.largest_startable_gang_p50, r.unallocated_delivered_gpu_hours, r.sim.horizon_s
    );
    out += &format!(
        "{:<10} {:>6} {:>10} {:>10} {:>8} {:>9} {:>9} {:>9} {:>7}\n",
        "path",
        "weight",
        "owed_h",
        "got_h",
        "started",
        "wait_p50",
        "wait_p90",
        "wait_p99",
        "preempt"
    );
    let s = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    for a in &r.allocations {
        out += &format!(
            "{:<10} {:>6} {:>10.1} {:>10.1} {:>8} {:>9} {:>9} {:>9} {:>7}\n",
            a.path,
            a.weight,
            a.owed_gpu_hours,
            a.delivered_gpu_hours,
            a.started,
            s(a.wait_p50_s),
            s(a.wait_p90_s),
            s(a.wait_p99_s),
            a.preemptions
        );
    }
    out
}

fn run_golden(dir: &Path) -> Vec<String> {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let expect: Expect = toml::from_str(&std::fs::read_to_string(dir.join("expect.toml")).unwrap())
        .unwrap_or_else(|e| panic!("{name}/expect.toml: {e}"));
    let out = tempfile::tempdir().unwrap();
    let spec = sim::RunSpec {
        scenario: Scenario::load(&dir.join("scenario.toml"))
            .unwrap()
            .prepare(None)
            .unwrap(),
        workloads: dir.join("workloads.csv"),
        trace: TraceOptions {
            format: Format::Native,
            skip_bad_rows: false,
            allocation_column: None,
        },
        seed: 0,
        work_model: sim::WorkModel::default(),
        until_s: expect.until_s,
        out: out.path().to_path_buf(),
    };
    let report = sim::run(&spec, |_| {})
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .report;

    let mut failures = Vec::new();
    let json = serde_json::to_value(&report).unwrap();
    let num = |v: &Value| v.as_f64();
    for (field, bound) in &expect.workloads {
        bound.check(
            &format!("{name}: workloads.{field}"),
            json["workloads"].get(field).and_then(num),
            &mut failures,
        );
    }
    for (field, bound) in &expect.metrics {
        bound.check(
            &format!("{name}: metrics.{field}"),
            json["metrics"].get(field).and_then(num),
            &mut failures,
        );
    }
    for (field, bound) in &expect.fragmentation {
        bound.check(
            &format!("{name}: fragmentation.{field}"),
            json["fragmentation"].get(field).and_then(num),
            &mut failures,
        );
    }
    for a in &expect.allocations {
        let got = json["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["path"] == a.path.as_str());
        let Some(got) = got else {
            failures.push(format!(
                "{name}: allocation {} missing from the report",
                a.path
            ));
            continue;
        };
        for (field, bound) in &a.figures {
            bound.check(
                &format!("{name}: {}.{field}", a.path),
                got.get(field).and_then(num),
                &mut failures,
            );
        }
    }

    let snapshot = dir.join("report.txt");
    let text = render(&report);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&snapshot, &text).unwrap();
    } else {
        let old = std::fs::read_to_string(&snapshot).unwrap_or_default();
        if old != text {
            failures.push(format!(
                "{name}: report.txt differs from the run; if the change is intended, rerun with UPDATE_GOLDEN=1 and review the diff\n--- checked in\n{old}\n--- now\n{text}"
            ));
        }
    }
    failures
}

#[test]
fn golden_scenarios_meet_their_hand_worked_expectations() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 6,
        "golden scenarios missing from {}",
        root.display()
    );
    let failures: Vec<String> = dirs.iter().flat_map(|d| run_golden(d)).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
