//! Adapters for three more public GPU cluster traces, from their published column definitions.
//! Each turns the trace's jobs into workloads; jobs that used no GPU or never ran are left out.
//!
//! - **Philly** (Microsoft; Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for
//!   DNN Training Workloads", USENIX ATC'19; github.com/msr-fiddle/philly-traces):
//!   `cluster_job_log`, one JSON array of jobs with `jobid`, `user`, `vc`, `status`,
//!   `submitted_time` and `attempts` (`start_time`, `end_time`, `detail`: per machine `ip` and its
//!   `gpus`). Nodes = machines of the first attempt, GPUs per node = the most any of them held,
//!   work = the run time of all attempts. Allocation: `vc` (default) or `user`.
//! - **Helios** (SenseTime; Hu et al., "Characterization and Prediction of Deep Learning
//!   Workloads in Large-Scale GPU Datacenters", SC'21; github.com/S-Lab-System-Group/HeliosData):
//!   `cluster_log.csv` with `job_id`, `user`, `vc`, `jobname`, `gpu_num`, `cpu_num`, `node_num`,
//!   `state`, `submit_time`, `start_time`, `end_time`, `duration`, `queue`. GPUs per node =
//!   `gpu_num / node_num` rounded up, work = `duration`. Allocation: `vc` (default) or `user`.
//! - **Alibaba PAI 2020** (Weng et al., "MLaaS in the Wild", NSDI'22;
//!   github.com/alibaba/clusterdata, `cluster-trace-gpu-v2020`): `pai_task_table.csv`, without a
//!   header: `job_name`, `task_name`, `inst_num`, `status`, `start_time`, `end_time`, `plan_cpu`,
//!   `plan_mem`, `plan_gpu` (percent of one GPU), `gpu_type`. One workload per task with GPUs:
//!   `inst_num` nodes of `plan_gpu / 100` GPUs (rounded up), submitted at `start_time` (the task
//!   table has no queueing time), work = `end_time - start_time`. Allocation: `gpu_type`,
//!   `none` or `teams:N` (the task table names no user).
//!
//! Times in Philly and Helios are `YYYY-MM-DD HH:MM:SS` and count from the first submission.

use std::path::Path;

use ledger::event::WorkloadSubmitted;
use ledger::sim::SimWorkload;
use serde::Deserialize;
use time::macros::format_description;
use time::PrimitiveDateTime;

use super::{workload_id, AllocationFrom, Ordered, RowError, Rows};
use crate::SimError;

fn parse_time(s: &str) -> Option<i64> {
    let fmt = format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");
    PrimitiveDateTime::parse(s.trim(), &fmt)
        .ok()
        .map(|t| t.assume_utc().unix_timestamp())
}

fn workload(
    line: u64,
    submit_ms: u64,
    work_ms: u64,
    allocation: Option<String>,
    gpus_per_node: u32,
    nodes: u32,
    name: String,
) -> SimWorkload {
    SimWorkload {
        submitted: WorkloadSubmitted {
            name: Some(name),
            ..WorkloadSubmitted::new(
                workload_id(submit_ms, line),
                allocation,
                gpus_per_node,
                nodes,
            )
        },
        submit_ms,
        work_ms: work_ms.max(1000),
    }
}

fn pick_user_or_vc(column: &str) -> Result<bool, SimError> {
    match column {
        "vc" => Ok(true),
        "user" => Ok(false),
        other => Err(SimError::Invalid(format!(
            "--allocation-column {other:?} is not a column of this trace; use vc or user"
        ))),
    }
}

#[derive(Deserialize)]
struct PhillyJob {
    jobid: String,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    vc: Option<String>,
    submitted_time: Option<String>,
    #[serde(default)]
    attempts: Vec<PhillyAttempt>,
}

#[derive(Deserialize)]
struct PhillyAttempt {
    start_time: Option<String>,
    end_time: Option<String>,
    #[serde(default)]
    detail: Vec<PhillyMachine>,
}

#[derive(Deserialize)]
struct PhillyMachine {
    #[serde(default)]
    gpus: Vec<String>,
}

/// Philly's `cluster_job_log`. The log is one JSON array, so it is read whole and sorted.
pub fn philly(path: &Path, allocation_column: &str) -> Result<Rows, SimError> {
    let by_vc = pick_user_or_vc(allocation_column)?;
    let text = std::fs::read_to_string(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
    let jobs: Vec<PhillyJob> = serde_json::from_str(&text).map_err(|e| {
        SimError::Row(RowError {
            file: path.to_path_buf(),
            line: e.line() as u64,
            field: "-".into(),
            message: format!("not a Philly job log: {e}"),
        })
    })?;
    let mut rows: Vec<(i64, usize, SimWorkload)> = Vec::new();
    for (i, job) in jobs.into_iter().enumerate() {
        let Some(submit) = job.submitted_time.as_deref().and_then(parse_time) else {
            continue;
        };
        let Some(first) = job.attempts.first() else {
            continue;
        };
        let nodes = first.detail.iter().filter(|m| !m.gpus.is_empty()).count() as u32;
        let gpus = first
            .detail
            .iter()
            .map(|m| m.gpus.len() as u32)
            .max()
            .unwrap_or(0);
        if nodes == 0 || gpus == 0 {
            continue;
        }
        let work_s: i64 = job
            .attempts
            .iter()
            .filter_map(|a| {
                Some(parse_time(a.end_time.as_deref()?)? - parse_time(a.start_time.as_deref()?)?)
            })
            .filter(|d| *d > 0)
            .sum();
        if work_s <= 0 {
            continue;
        }
        let allocation = if by_vc { job.vc } else { job.user };
        rows.push((
            submit,
            i,
            workload(
                i as u64 + 1,
                0,
                work_s as u64 * 1000,
                allocation,
                gpus,
                nodes,
                job.jobid,
            ),
        ));
    }
    rows.sort_by_key(|r| (r.0, r.1));
    let start = rows.first().map_or(0, |r| r.0);
    Ok(Box::new(rows.into_iter().map(move |(t, i, mut w)| {
        w.submit_ms = ((t - start) * 1000) as u64;
        w.submitted.workload = workload_id(w.submit_ms, i as u64 + 1);
        Ok(w)
    })))
}

#[derive(Deserialize)]
struct HeliosJob {
    job_id: String,
    #[serde(default)]
    user: String,
    #[serde(default)]
    vc: String,
    gpu_num: u32,
    node_num: u32,
    submit_time: String,
    duration: f64,
}

/// Helios's `cluster_log.csv`, in `submit_time` order.
pub fn helios(path: &Path, allocation_column: &str) -> Result<Rows, SimError> {
    let by_vc = pick_user_or_vc(allocation_column)?;
    let (reader, headers) = super::open_csv(path, false)?;
    let file_name = path.to_path_buf();
    let mut order = Ordered::new(path);
    let mut start: Option<i64> = None;
    Ok(Box::new(
        reader
            .into_deserialize::<HeliosJob>()
            .enumerate()
            .filter_map(move |(i, r)| {
                let line = i as u64 + 2;
                let err =
                    |field: &str, message: String| RowError::new(&file_name, line, field, message);
                let job = match r {
                    Ok(j) => j,
                    Err(e) => {
                        return Some(Err(err(&super::csv_field(&e, &headers), e.to_string())));
                    }
                };
                if job.gpu_num == 0 || job.duration.is_nan() || job.duration <= 0.0 {
                    return None;
                }
                let Some(t) = parse_time(&job.submit_time) else {
                    return Some(Err(err(
                        "submit_time",
                        format!("{:?} is not YYYY-MM-DD HH:MM:SS", job.submit_time),
                    )));
                };
                let t0 = *start.get_or_insert(t);
                if t < t0 {
                    return Some(Err(err(
                        "submit_time",
                        "rows must be in submission order; sort the file by submit_time".into(),
                    )));
                }
                let submit_ms = ((t - t0) * 1000) as u64;
                if let Err(e) = order.check(line, "submit_time", submit_ms) {
                    return Some(Err(e));
                }
                let nodes = job.node_num.max(1);
                let allocation =
                    Some(if by_vc { job.vc } else { job.user }).filter(|a| !a.is_empty());
                Some(Ok(workload(
                    line,
                    submit_ms,
                    (job.duration * 1000.0) as u64,
                    allocation,
                    job.gpu_num.div_ceil(nodes),
                    nodes,
                    job.job_id,
                )))
            }),
    ))
}

#[derive(Deserialize)]
struct PaiTask {
    job_name: String,
    task_name: String,
    inst_num: f64,
    _status: String,
    start_time: Option<f64>,
    end_time: Option<f64>,
    _plan_cpu: Option<f64>,
    _plan_mem: Option<f64>,
    plan_gpu: Option<f64>,
    gpu_type: Option<String>,
}

/// PAI 2020's `pai_task_table.csv` (no header), in `start_time` order.
pub fn pai(path: &Path, allocation_column: &str) -> Result<Rows, SimError> {
    let mut from = AllocationFrom::parse(allocation_column, "gpu_type")?;
    let file = std::fs::File::open(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
    let reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(file);
    let names = [
        "job_name",
        "task_name",
        "inst_num",
        "status",
        "start_time",
        "end_time",
        "plan_cpu",
        "plan_mem",
        "plan_gpu",
        "gpu_type",
    ];
    let file_name = path.to_path_buf();
    let mut order = Ordered::new(path);
    let mut start: Option<f64> = None;
    Ok(Box::new(
        reader
            .into_deserialize::<PaiTask>()
            .enumerate()
            .filter_map(move |(i, r)| {
                let line = i as u64 + 1;
                let err =
                    |field: &str, message: String| RowError::new(&file_name, line, field, message);
                let task = match r {
                    Ok(t) => t,
                    Err(e) => {
                        return Some(Err(err(&super::csv_field(&e, &names), e.to_string())));
                    }
                };
                let gpus = task.plan_gpu.filter(|g| *g > 0.0)?;
                let (s, e) = (task.start_time?, task.end_time?);
                if e.is_nan()
                    || s.is_nan()
                    || e <= s
                    || task.inst_num.is_nan()
                    || task.inst_num < 1.0
                {
                    return None;
                }
                let t0 = *start.get_or_insert(s);
                if s < t0 {
                    return Some(Err(err(
                        "start_time",
                        "rows must be in start_time order; sort the file by its fifth column"
                            .into(),
                    )));
                }
                let submit_ms = ((s - t0) * 1000.0) as u64;
                if let Err(e) = order.check(line, "start_time", submit_ms) {
                    return Some(Err(e));
                }
                let allocation = from.next(task.gpu_type.as_deref());
                let per_node = (gpus / 100.0).ceil() as u32;
                Some(Ok(workload(
                    line,
                    submit_ms,
                    ((e - s) * 1000.0) as u64,
                    allocation,
                    per_node,
                    task.inst_num as u32,
                    format!("{}/{}", task.job_name, task.task_name),
                )))
            }),
    ))
}
