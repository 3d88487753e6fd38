//! fairledger's native workload format: CSV with a header, or JSON lines with the same keys.
//!
//! | key | meaning |
//! | --- | --- |
//! | `id` | the workload's name in the trace |
//! | `allocation` | leaf allocation path; empty means unallocated (opportunistic) work |
//! | `submit_s` | submission time, seconds from the start (rows in this order) |
//! | `duration_s` | work, in seconds, if never preempted |
//! | `gpus` | GPUs per node |
//! | `nodes` | nodes in the gang (default 1) |
//! | `priority` | optional, higher first within the allocation |
//! | `min_runtime_s` | optional requested protection |
//! | `model` | optional required GPU model |
//! | `checkpoint_s` | optional checkpoint interval |

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;

use ledger::event::WorkloadSubmitted;
use ledger::sim::SimWorkload;
use serde::Deserialize;

use super::{workload_id, Ordered, RowError, Rows};
use crate::SimError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    id: String,
    #[serde(default)]
    allocation: Option<String>,
    submit_s: f64,
    duration_s: f64,
    gpus: u32,
    #[serde(default)]
    nodes: Option<u32>,
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    min_runtime_s: Option<u64>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    checkpoint_s: Option<u64>,
}

/// Opens a `.csv` or `.jsonl` file.
pub fn open(path: &Path) -> Result<Rows, SimError> {
    let file = std::fs::File::open(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
    let mut order = Ordered {
        file: path.to_path_buf(),
        last_ms: 0,
    };
    let owned = path.to_path_buf();
    let convert = move |line: u64, row: Result<Row, RowError>| -> Result<SimWorkload, RowError> {
        let row = row?;
        let err = |field: &str, message: &str| RowError {
            file: owned.clone(),
            line,
            field: field.into(),
            message: message.into(),
        };
        if !(row.submit_s >= 0.0 && row.submit_s.is_finite()) {
            return Err(err("submit_s", "must be a non-negative number of seconds"));
        }
        if !(row.duration_s > 0.0 && row.duration_s.is_finite()) {
            return Err(err("duration_s", "must be a positive number of seconds"));
        }
        if row.gpus == 0 {
            return Err(err("gpus", "must be at least 1"));
        }
        if row.nodes == Some(0) {
            return Err(err("nodes", "must be at least 1 (or omitted)"));
        }
        let submit_ms = (row.submit_s * 1000.0).round() as u64;
        order.check(line, "submit_s", submit_ms)?;
        Ok(SimWorkload {
            submitted: WorkloadSubmitted {
                workload: workload_id(submit_ms, line),
                allocation: row.allocation.filter(|a| !a.is_empty()),
                gpus_per_node: row.gpus,
                nodes: row.nodes.unwrap_or(1),
                model: row.model.filter(|m| !m.is_empty()),
                priority: row.priority.unwrap_or(0),
                min_runtime_s: row.min_runtime_s,
                duration_estimate_s: None,
                checkpoint_s: row.checkpoint_s,
                name: Some(row.id),
                command: vec![],
                env: BTreeMap::new(),
                idempotency_key: None,
            },
            submit_ms,
            work_ms: ((row.duration_s * 1000.0).round() as u64).max(1),
        })
    };
    let is_jsonl = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "json" | "ndjson")
    );
    if is_jsonl {
        let file_name = path.to_path_buf();
        let lines = std::io::BufReader::new(file)
            .lines()
            .enumerate()
            .filter_map(move |(i, l)| {
                let line = i as u64 + 1;
                let row = match l {
                    Err(e) => Err(RowError {
                        file: file_name.clone(),
                        line,
                        field: "-".into(),
                        message: format!("unreadable: {e}"),
                    }),
                    Ok(l) if l.trim().is_empty() => return None,
                    Ok(l) => serde_json::from_str::<Row>(&l).map_err(|e| RowError {
                        file: file_name.clone(),
                        line,
                        field: field_of(&e.to_string()),
                        message: e.to_string(),
                    }),
                };
                Some((line, row))
            });
        let mut convert = convert;
        Ok(Box::new(lines.map(move |(line, row)| convert(line, row))))
    } else {
        let file_name = path.to_path_buf();
        let mut reader = csv::ReaderBuilder::new()
            .trim(csv::Trim::All)
            .from_reader(file);
        let headers: Vec<String> = reader
            .headers()
            .map_err(|e| SimError::Invalid(format!("{}: no readable header: {e}", path.display())))?
            .iter()
            .map(str::to_string)
            .collect();
        let mut convert = convert;
        Ok(Box::new(reader.into_deserialize::<Row>().enumerate().map(
            move |(i, r)| {
                // Line 1 is the header.
                let line = i as u64 + 2;
                let row = r.map_err(|e| RowError {
                    file: file_name.clone(),
                    line,
                    field: csv_field(&e, &headers),
                    message: e.to_string(),
                });
                convert(line, row)
            },
        )))
    }
}

/// The field a serde message names, if it names one.
fn field_of(message: &str) -> String {
    message
        .split('`')
        .nth(1)
        .map(str::to_string)
        .unwrap_or_else(|| "-".into())
}

fn csv_field(e: &csv::Error, headers: &[String]) -> String {
    match e.kind() {
        csv::ErrorKind::Deserialize { err, .. } => match err.field() {
            Some(i) => headers
                .get(i as usize)
                .cloned()
                .unwrap_or_else(|| format!("column {}", i + 1)),
            None => field_of(&err.to_string()),
        },
        _ => "-".into(),
    }
}
