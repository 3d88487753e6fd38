//! Trace adapters: each turns a published workload trace into the simulator's workloads, in
//! submission order.
//!
//! - [`native`]: fairledger's own CSV or JSON lines (`id`, `allocation`, `submit_s`, `duration_s`,
//!   `gpus`, `nodes`, and optional `priority`, `min_runtime_s`, `model`, `checkpoint_s`).
//! - [`alibaba`]: the Alibaba GPU cluster trace v2023 (`openb_pod_list_*.csv`), with a column
//!   chosen as the allocation.
//! - [`public`]: Microsoft Philly, SenseTime Helios and Alibaba PAI 2020.
//!
//! A bad row is an error naming the file, the line and the field; with `skip_bad_rows` it is
//! counted and skipped instead.

pub mod alibaba;
pub mod native;
pub mod public;

use std::path::{Path, PathBuf};

use ledger::sim::SimWorkload;

use crate::SimError;

/// The trace formats understood.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// fairledger's CSV or JSON lines, by file extension.
    Native,
    /// Alibaba GPU cluster trace v2023 pod list.
    AlibabaOpenb,
    /// Microsoft Philly `cluster_job_log`.
    Philly,
    /// SenseTime Helios `cluster_log.csv`.
    Helios,
    /// Alibaba PAI 2020 `pai_task_table.csv`.
    AlibabaPai2020,
}

impl Format {
    /// Names accepted on the command line.
    pub const NAMES: [&'static str; 5] = [
        "native",
        "alibaba-openb",
        "philly",
        "helios",
        "alibaba-pai2020",
    ];

    /// Parses a command-line name.
    pub fn parse(name: &str) -> Result<Format, SimError> {
        match name {
            "native" => Ok(Format::Native),
            "alibaba-openb" => Ok(Format::AlibabaOpenb),
            "philly" => Ok(Format::Philly),
            "helios" => Ok(Format::Helios),
            "alibaba-pai2020" => Ok(Format::AlibabaPai2020),
            _ => Err(SimError::Invalid(format!(
                "--format {name:?} is unknown; use one of {}",
                Format::NAMES.join(", ")
            ))),
        }
    }
}

/// How to read a trace.
#[derive(Clone, Debug)]
pub struct TraceOptions {
    /// Which format.
    pub format: Format,
    /// Skip and count bad rows instead of stopping at the first.
    pub skip_bad_rows: bool,
    /// Which column becomes the allocation; each format has its default (Alibaba 2023 `qos`,
    /// Philly and Helios `vc`, PAI `gpu_type`). `none` makes all work unallocated where offered.
    pub allocation_column: Option<String>,
}

/// A row the adapter could not read.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{file}:{line}: field {field:?}: {message}")]
pub struct RowError {
    /// The file.
    pub file: PathBuf,
    /// 1-based line number.
    pub line: u64,
    /// The field at fault.
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

/// Workloads in submission order, or the first bad row.
pub type Rows = Box<dyn Iterator<Item = Result<SimWorkload, RowError>>>;

/// Opens a trace.
pub fn open(path: &Path, opts: &TraceOptions) -> Result<Rows, SimError> {
    let column = |default| opts.allocation_column.as_deref().unwrap_or(default);
    match opts.format {
        Format::Native => native::open(path),
        Format::AlibabaOpenb => alibaba::open(path, column("qos")),
        Format::Philly => public::philly(path, column("vc")),
        Format::Helios => public::helios(path, column("vc")),
        Format::AlibabaPai2020 => public::pai(path, column("gpu_type")),
    }
}

/// A workload id that is the same on every run: a UUIDv7 of the submission time and the row.
pub(crate) fn workload_id(submit_ms: u64, row: u64) -> uuid::Uuid {
    let mut tail = [0u8; 10];
    tail[2..].copy_from_slice(&row.to_be_bytes());
    uuid::Builder::from_unix_timestamp_millis(submit_ms, &tail).into_uuid()
}

impl RowError {
    pub(crate) fn new(file: &Path, line: u64, field: &str, message: impl Into<String>) -> Self {
        RowError {
            file: file.to_path_buf(),
            line,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Opens a CSV file whose first row names the columns; returns the reader and the names.
pub(crate) fn open_csv(
    path: &Path,
    trim: bool,
) -> Result<(csv::Reader<std::fs::File>, Vec<String>), SimError> {
    let file = std::fs::File::open(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
    let trim = if trim {
        csv::Trim::All
    } else {
        csv::Trim::None
    };
    let mut reader = csv::ReaderBuilder::new().trim(trim).from_reader(file);
    let headers = reader
        .headers()
        .map_err(|e| SimError::Invalid(format!("{}: no readable header: {e}", path.display())))?
        .iter()
        .map(str::to_string)
        .collect();
    Ok((reader, headers))
}

/// Checks that rows come in submission order, so the run can stream them.
pub(crate) struct Ordered {
    pub(crate) file: PathBuf,
    pub(crate) last_ms: u64,
}

impl Ordered {
    pub(crate) fn new(file: &Path) -> Self {
        Ordered {
            file: file.to_path_buf(),
            last_ms: 0,
        }
    }

    pub(crate) fn check(&mut self, line: u64, field: &str, submit_ms: u64) -> Result<(), RowError> {
        if submit_ms < self.last_ms {
            return Err(RowError {
                file: self.file.clone(),
                line,
                field: field.into(),
                message: format!("rows must be in submission order, but this one comes {} ms before the previous; sort the file by {field}", self.last_ms - submit_ms),
            });
        }
        self.last_ms = submit_ms;
        Ok(())
    }
}

/// The field a serde message names, if it names one.
pub(crate) fn field_of(message: &str) -> String {
    message
        .split('`')
        .nth(1)
        .map(str::to_string)
        .unwrap_or_else(|| "-".into())
}

/// The name of the column a CSV error is about, or `-`.
pub(crate) fn csv_field<S: AsRef<str>>(e: &csv::Error, headers: &[S]) -> String {
    match e.kind() {
        csv::ErrorKind::Deserialize { err, .. } => match err.field() {
            Some(i) => headers
                .get(i as usize)
                .map(|h| h.as_ref().to_string())
                .unwrap_or_else(|| format!("column {}", i + 1)),
            None => field_of(&err.to_string()),
        },
        _ => "-".into(),
    }
}

/// Where an adapter takes each workload's allocation from: the trace's one allocation column,
/// nowhere (all work unallocated), or `teams:N` (rows dealt round-robin to `team-0` … `team-N-1`,
/// for fairness experiments on a trace without teams).
pub(crate) enum AllocationFrom {
    Column,
    None,
    Teams { n: u64, dealt: u64 },
}

impl AllocationFrom {
    /// Parses `--allocation-column` for a trace whose allocation column is `column`.
    pub(crate) fn parse(arg: &str, column: &str) -> Result<Self, SimError> {
        if arg == column {
            return Ok(AllocationFrom::Column);
        }
        if arg == "none" {
            return Ok(AllocationFrom::None);
        }
        match arg.strip_prefix("teams:").and_then(|n| n.parse::<u64>().ok()).filter(|&n| n > 0) {
            Some(n) => Ok(AllocationFrom::Teams { n, dealt: 0 }),
            None => Err(SimError::Invalid(format!(
                "--allocation-column {arg:?} is unknown for this trace; use {column}, none or teams:N"
            ))),
        }
    }

    /// The allocation of the next row, whose allocation column holds `value`.
    pub(crate) fn next(&mut self, value: Option<&str>) -> Option<String> {
        match self {
            AllocationFrom::Column => value.filter(|v| !v.is_empty()).map(str::to_string),
            AllocationFrom::None => None,
            AllocationFrom::Teams { n, dealt } => {
                *dealt += 1;
                Some(format!("team-{}", (*dealt - 1) % *n))
            }
        }
    }
}
