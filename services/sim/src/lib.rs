//! fairledger's simulator: replays a submission schedule through the ledger's own fold and
//! policy on a virtual clock, and reports who was owed what and who got what.
//!
//! A run reads a [`scenario`] (cluster, allocation tree, policy, faults) and a workload trace
//! ([`trace`]), drives [`ledger::sim::Engine`] — the same fold and `decide` as the live service —
//! and writes into its output directory:
//! - `events.jsonl`: the full ledger, one event a line, in the live service's schema;
//! - `report.json`: the [`report::Report`];
//! - `report.html`: the same for a person, with the GPU timeline ([`html`]).
//!
//! The same inputs and seed give byte-identical `events.jsonl`, and a `report.json` that differs
//! only in `sim.wall_s`. The schedule streams from the trace file, so memory holds what is live.

pub mod html;
pub mod report;
pub mod scenario;
pub mod trace;

pub use ledger::sim::WorkModel;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ledger::sim::Engine;
use ledger::{Envelope, Event, Outcome, State};
use report::{Collector, Report};
use scenario::Prepared;
use trace::{RowError, TraceOptions};

/// Everything that can stop a run, each with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file could not be read or written.
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// The scenario file is not valid TOML of the expected shape.
    #[error("{path}: {message}")]
    Scenario {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// An input is inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// A trace row is bad.
    #[error("{0} (pass --skip-bad-rows to skip such rows and count them)")]
    Row(RowError),
}

/// One run.
#[derive(Clone, Debug)]
pub struct RunSpec {
    /// The scenario, prepared for this run's policy.
    pub scenario: Prepared,
    /// The trace file.
    pub workloads: PathBuf,
    /// How to read it.
    pub trace: TraceOptions,
    /// Seed for random faults.
    pub seed: u64,
    /// What a preempted run loses.
    pub work_model: WorkModel,
    /// Stop at this simulated time; otherwise run until every workload has finished.
    pub until_s: Option<u64>,
    /// Output directory.
    pub out: PathBuf,
}

/// What a run produced besides its files.
#[derive(Debug)]
pub struct RunResult {
    /// The report written.
    pub report: Report,
    /// Rows skipped as bad.
    pub bad_rows: u64,
    /// Rejections by rule (submissions the ledger refused, chiefly).
    pub rejections: std::collections::BTreeMap<String, u64>,
}

/// The bundled example run: the Alibaba GPU cluster trace v2023 (`traces/alibaba2023/`) on the
/// 32-GPU scenario (`scenarios/alibaba-32gpu.toml`) under `policy` (the scenario's if `None`),
/// until every workload has finished, writing into `out`. About 22,000 events; tests and
/// benchmarks of other crates use its ledger as a realistic stream.
pub fn bundled_alibaba(out: &Path, policy: Option<&str>) -> Result<RunSpec, SimError> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scenario = scenario::Scenario::load(&root.join("scenarios/alibaba-32gpu.toml"))?;
    Ok(RunSpec {
        scenario: scenario.prepare(policy)?,
        workloads: root.join("traces/alibaba2023/openb_pod_list_default.csv"),
        trace: TraceOptions {
            format: trace::Format::AlibabaOpenb,
            skip_bad_rows: false,
            allocation_column: None,
        },
        seed: 1,
        work_model: WorkModel::default(),
        until_s: None,
        out: out.to_owned(),
    })
}

/// Reads a ledger written as JSON lines.
pub fn read_ledger(path: &Path) -> Result<Vec<Envelope>, SimError> {
    let text = std::fs::read_to_string(path).map_err(|e| SimError::Io(path.to_owned(), e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                SimError::Invalid(format!(
                    "{}:{}: not a ledger event: {e}",
                    path.display(),
                    i + 1
                ))
            })
        })
        .collect()
}

/// Reads the whole trace once to find bad rows before anything runs, so a bad file stops the
/// run before it starts. Returns the number of bad rows skipped.
pub fn check_trace(spec: &RunSpec) -> Result<u64, SimError> {
    let mut bad = 0;
    for row in trace::open(&spec.workloads, &spec.trace)? {
        match row {
            Ok(w) => {
                if let Some(a) = &w.submitted.allocation {
                    if !spec.scenario.weights.contains_key(a) && !spec.trace.skip_bad_rows {
                        return Err(SimError::Invalid(format!(
                            "{}: workload {:?} is charged to allocation {a:?}, which the scenario does not define; add it under [[allocations]]",
                            spec.workloads.display(),
                            w.submitted.name.as_deref().unwrap_or("?")
                        )));
                    }
                }
            }
            Err(e) if spec.trace.skip_bad_rows => {
                bad += 1;
                if bad <= 5 {
                    eprintln!("skipping {e}");
                }
            }
            Err(e) => return Err(SimError::Row(e)),
        }
    }
    Ok(bad)
}

/// Runs one simulation into `spec.out`.
pub fn run(spec: &RunSpec, mut progress: impl FnMut(u64)) -> Result<RunResult, SimError> {
    let bad_rows = check_trace(spec)?;
    std::fs::create_dir_all(&spec.out).map_err(|e| SimError::Io(spec.out.clone(), e))?;
    let events_path = spec.out.join("events.jsonl");
    let mut writer = BufWriter::new(
        File::create(&events_path).map_err(|e| SimError::Io(events_path.clone(), e))?,
    );
    let started = std::time::Instant::now();

    let faults = match (spec.until_s, &spec.scenario.failures) {
        (Some(u), _) => spec.scenario.draw_failures(spec.seed, u * 1000),
        (None, Some(_)) => {
            return Err(SimError::Invalid(
                "[failures] draws random faults over a period: give --until SECONDS".into(),
            ));
        }
        (None, None) => spec.scenario.faults.clone(),
    };
    let rows = trace::open(&spec.workloads, &spec.trace)?.filter_map(Result::ok);
    let mut engine = Engine::new(
        State::new(spec.scenario.state_config),
        spec.scenario.policy.clone(),
    );
    engine.set_heartbeat_timeout(spec.scenario.heartbeat_timeout_ms);
    engine.set_work_model(spec.work_model);
    let mut collector = Collector::default();
    let mut timeline = html::Timeline::new(&spec.scenario, spec.until_s.map(|u| u * 1000));
    let mut io_error: Option<std::io::Error> = None;
    {
        let mut observe = |state: &State, _: u64, env: &Envelope, outcome: &Outcome| {
            collector.observe(state, env, outcome);
            timeline.observe(state, env, outcome);
            if io_error.is_none() {
                let written = serde_json::to_writer(&mut writer, env)
                    .map_err(std::io::Error::other)
                    .and_then(|()| writer.write_all(b"\n"));
                if let Err(e) = written {
                    io_error = Some(e);
                }
            }
            progress(env.occurred_at_ms);
        };
        // The ledger's settings come first, so that whoever folds the ledger folds it by them.
        engine.write(
            0,
            Event::SettingsSet(spec.scenario.settings()),
            &mut observe,
        );
        for event in spec.scenario.setup.clone() {
            engine.write(0, event, &mut observe);
        }
        engine.stream_from(Box::new(rows));
        engine.inject(faults);
        engine.run(spec.until_s.map(|u| u * 1000), &mut observe);
    }
    if let Some(e) = io_error.take() {
        return Err(SimError::Io(events_path, e));
    }
    writer
        .flush()
        .map_err(|e| SimError::Io(events_path.clone(), e))?;
    let rejections = collector.rejections().clone();
    let mut report = collector.finish(
        &engine.state,
        spec.scenario.policy.policy,
        spec.seed,
        started.elapsed().as_secs_f64(),
    );
    report.sim.work_model = spec.work_model;
    write_json(&spec.out.join("report.json"), &report)?;
    html::write_report(&spec.out, timeline, &report)?;
    Ok(RunResult {
        report,
        bad_rows,
        rejections,
    })
}

/// Folds a ledger written as JSON lines (a run's `events.jsonl`, or any other) into a fresh state
/// and builds its report from the events alone, read at `until_ms` if given. Blank lines are
/// skipped; a line that is not an event stops the replay naming the line. `seed` and
/// `work_model` are what the report says produced the ledger (the events record their effects).
pub fn replay(
    events: &Path,
    state_config: ledger::StateConfig,
    policy: &str,
    until_ms: Option<u64>,
    seed: u64,
    work_model: WorkModel,
) -> Result<RunResult, SimError> {
    use std::io::BufRead;
    let file = File::open(events).map_err(|e| SimError::Io(events.to_path_buf(), e))?;
    let mut state = State::new(state_config);
    let mut collector = Collector::default();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| SimError::Io(events.to_path_buf(), e))?;
        if line.trim().is_empty() {
            continue;
        }
        let env: Envelope = serde_json::from_str(&line).map_err(|e| {
            SimError::Invalid(format!(
                "{}:{}: not an event: {e}; each line must be one JSON event (schemas/envelope.json)",
                events.display(),
                i + 1
            ))
        })?;
        let outcome = state.apply(i as u64 + 1, &env);
        collector.observe(&state, &env, &outcome);
    }
    if let Some(t) = until_ms {
        state.advance_to(t);
    }
    let rejections = collector.rejections().clone();
    let mut report = collector.finish(&state, policy, seed, 0.0);
    report.sim.work_model = work_model;
    Ok(RunResult {
        report,
        bad_rows: 0,
        rejections,
    })
}

/// Writes pretty JSON with a final newline.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<(), SimError> {
    let mut text =
        serde_json::to_string_pretty(value).map_err(|e| SimError::Invalid(e.to_string()))?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| SimError::Io(path.to_path_buf(), e))
}
