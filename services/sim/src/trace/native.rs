//! fairledger's native workload format: CSV with a header, or JSON lines with the same keys.
//!
//! | key | meaning |
//! | --- | --- |
//! | `id` | the workload's name in the trace |
//! | `allocation` | leaf allocation path; empty means unallocated (opportunistic) work |
//! | `submit_s` | submission time, seconds from the start (rows in this order) |
//! | `duration_s` | work, in seconds, if never preempted (the truth the simulation runs by) |
//! | `duration_estimate_s` | optional: the run time the submitter expects, which the scheduler sees (backfill, start estimates) |
//! | `gpus` | GPUs per node |
//! | `nodes` | nodes in the gang (default 1) |
//! | `priority` | optional, higher first within the allocation |
//! | `min_runtime_s` | optional requested protection |
//! | `model` | optional required GPU model |
//! | `checkpoint_s` | optional checkpoint interval |
//! | `count` | optional: this many copies of the row (default 1), named `id#k` |
//! | `every_s` | optional: seconds between the copies' submissions (default 0) |
//!
//! Rows must come in order of `submit_s`; copies of a repeated row are merged into that order.

use std::io::BufRead;
use std::path::Path;

use ledger::event::WorkloadSubmitted;
use ledger::sim::SimWorkload;
use serde::Deserialize;

use super::{csv_field, field_of, workload_id, Ordered, RowError, Rows};
use crate::SimError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    id: String,
    #[serde(default)]
    allocation: Option<String>,
    submit_s: f64,
    duration_s: f64,
    #[serde(default)]
    duration_estimate_s: Option<f64>,
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
    #[serde(default)]
    count: Option<u32>,
    #[serde(default)]
    every_s: Option<f64>,
}

/// A row read: its workload, and how many copies at which spacing.
type Read = Result<(SimWorkload, u32, u64), RowError>;

/// Opens a `.csv` or `.jsonl` file.
pub fn open(path: &Path) -> Result<Rows, SimError> {
    let mut order = Ordered::new(path);
    let owned = path.to_path_buf();
    let convert = move |line: u64, row: Result<Row, RowError>| -> Read {
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
        if row
            .duration_estimate_s
            .is_some_and(|e| !(e > 0.0 && e.is_finite()))
        {
            return Err(err(
                "duration_estimate_s",
                "must be a positive number of seconds (or empty for none)",
            ));
        }
        if row.gpus == 0 {
            return Err(err("gpus", "must be at least 1"));
        }
        if row.nodes == Some(0) {
            return Err(err("nodes", "must be at least 1 (or omitted)"));
        }
        if row.count == Some(0) {
            return Err(err("count", "must be at least 1 (or omitted)"));
        }
        let every_s = row.every_s.unwrap_or(0.0);
        if !(every_s >= 0.0 && every_s.is_finite()) {
            return Err(err("every_s", "must be a non-negative number of seconds"));
        }
        let submit_ms = (row.submit_s * 1000.0).round() as u64;
        order.check(line, "submit_s", submit_ms)?;
        let copies = (row.count.unwrap_or(1), (every_s * 1000.0).round() as u64);
        let w = SimWorkload {
            submitted: WorkloadSubmitted {
                model: row.model.filter(|m| !m.is_empty()),
                priority: row.priority.unwrap_or(0),
                min_runtime_s: row.min_runtime_s,
                checkpoint_s: row.checkpoint_s,
                duration_estimate_s: row.duration_estimate_s.map(|e| (e.round() as u64).max(1)),
                name: Some(row.id),
                ..WorkloadSubmitted::new(
                    workload_id(submit_ms, line),
                    row.allocation.filter(|a| !a.is_empty()),
                    row.gpus,
                    row.nodes.unwrap_or(1),
                )
            },
            submit_ms,
            work_ms: ((row.duration_s * 1000.0).round() as u64).max(1),
        };
        Ok((w, copies.0, copies.1))
    };
    let is_jsonl = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "json" | "ndjson")
    );
    if is_jsonl {
        let file_name = path.to_path_buf();
        let file = std::fs::File::open(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
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
        Ok(Box::new(Expand::new(
            lines.map(move |(line, row)| convert(line, row)),
        )))
    } else {
        let file_name = path.to_path_buf();
        let (reader, headers) = super::open_csv(path, true)?;
        let mut convert = convert;
        Ok(Box::new(Expand::new(
            reader
                .into_deserialize::<Row>()
                .enumerate()
                .map(move |(i, r)| {
                    // Line 1 is the header.
                    let line = i as u64 + 2;
                    let row = r.map_err(|e| RowError {
                        file: file_name.clone(),
                        line,
                        field: csv_field(&e, &headers),
                        message: e.to_string(),
                    });
                    convert(line, row)
                }),
        )))
    }
}

/// Copies of a repeated row still to come.
struct Pending {
    next_ms: u64,
    row: u64,
    copy: u32,
    count: u32,
    every_ms: u64,
    template: SimWorkload,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.next_ms, self.row) == (o.next_ms, o.row)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    /// Reversed, so the heap's top is the earliest copy.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.next_ms, o.row).cmp(&(self.next_ms, self.row))
    }
}

/// Expands repeated rows, merging their copies into submission order. Holds only the rows that
/// still have copies to come.
struct Expand<I: Iterator<Item = Read>> {
    rows: std::iter::Peekable<I>,
    pending: std::collections::BinaryHeap<Pending>,
    row: u64,
}

impl<I: Iterator<Item = Read>> Expand<I> {
    fn new(rows: I) -> Self {
        Expand {
            rows: rows.peekable(),
            pending: std::collections::BinaryHeap::new(),
            row: 0,
        }
    }
}

impl<I: Iterator<Item = Read>> Iterator for Expand<I> {
    type Item = Result<SimWorkload, RowError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let next_row_ms = match self.rows.peek() {
                Some(Ok((w, _, _))) => Some(w.submit_ms),
                Some(Err(_)) => return self.rows.next().map(|r| r.map(|(w, _, _)| w)),
                None => None,
            };
            if let Some(top) = self.pending.peek() {
                if next_row_ms.is_none_or(|t| top.next_ms <= t) {
                    let mut p = self.pending.pop().expect("peeked");
                    let mut w = p.template.clone();
                    w.submit_ms = p.next_ms;
                    w.submitted.workload = workload_id(p.next_ms, p.row << 24 | u64::from(p.copy));
                    w.submitted.name = w.submitted.name.map(|n| format!("{n}#{}", p.copy));
                    p.copy += 1;
                    if p.copy < p.count {
                        p.next_ms += p.every_ms;
                        self.pending.push(p);
                    }
                    return Some(Ok(w));
                }
            }
            let (w, count, every_ms) = self.rows.next()?.expect("errors returned above");
            self.row += 1;
            if count == 1 {
                return Some(Ok(w));
            }
            self.pending.push(Pending {
                next_ms: w.submit_ms,
                row: self.row,
                copy: 0,
                count,
                every_ms,
                template: w,
            });
        }
    }
}
