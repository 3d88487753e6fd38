//! The Alibaba GPU cluster trace v2023 (Weng et al., "Beware of Fragmentation: Scheduling
//! GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC'23), from
//! github.com/alibaba/clusterdata, folder `cluster-trace-gpu-v2023/csv/`.
//!
//! `openb_pod_list_*.csv` has one row per pod: `name`, `cpu_milli`, `memory_mib`, `num_gpu`,
//! `gpu_milli`, `gpu_spec`, `qos`, `pod_phase`, `creation_time`, `deletion_time`,
//! `scheduled_time` (times in seconds from the trace start). The adapter reads:
//! - submission = `creation_time`; work = `deletion_time - scheduled_time`;
//! - GPUs = `num_gpu` on one node; a pod sharing a fraction of one GPU (`gpu_milli` < 1000) is
//!   given a whole GPU, since the ledger places whole GPUs (this overstates its load);
//! - `gpu_spec`, when it names exactly one model, becomes the model constraint;
//! - the allocation: `--allocation-column qos` (the trace has no user or team column), `none`
//!   (all unallocated), or `teams:N` (rows dealt round-robin to `team-0` … `team-N-1`, for
//!   fairness experiments on a trace that has no teams).
//!
//! Pods without GPUs, and pods never scheduled (no `scheduled_time`, so no run time), are not
//! GPU work the trace can replay and are left out.
//!
//! `openb_node_list_*.csv` (`sn`, `cpu_milli`, `memory_mib`, `gpu`, `model`) can serve as the
//! cluster through `nodes_file` in the scenario; nodes without GPUs are left out.

use std::path::Path;

use ledger::event::WorkloadSubmitted;
use ledger::sim::SimWorkload;
use serde::Deserialize;

use super::{workload_id, AllocationFrom, Ordered, RowError, Rows};
use crate::SimError;

#[derive(Debug, Deserialize)]
struct Pod {
    name: String,
    num_gpu: u32,
    #[serde(default)]
    gpu_spec: String,
    #[serde(default)]
    qos: String,
    creation_time: u64,
    deletion_time: u64,
    scheduled_time: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct NodeRow {
    sn: String,
    gpu: u32,
    model: String,
}

/// Opens a pod list.
pub fn open(path: &Path, allocation_column: &str) -> Result<Rows, SimError> {
    let mut from = AllocationFrom::parse(allocation_column, "qos")?;
    let (reader, headers) = super::open_csv(path, false)?;
    let file_name = path.to_path_buf();
    let mut order = Ordered::new(path);
    let rows = reader
        .into_deserialize::<Pod>()
        .enumerate()
        .filter_map(move |(i, r)| {
            let line = i as u64 + 2;
            let err =
                |field: &str, message: String| RowError::new(&file_name, line, field, message);
            let pod = match r {
                Ok(p) => p,
                Err(e) => {
                    return Some(Err(err(&super::csv_field(&e, &headers), e.to_string())));
                }
            };
            if pod.num_gpu == 0 {
                return None;
            }
            let scheduled = pod.scheduled_time?;
            if pod.deletion_time < scheduled {
                return Some(Err(err(
                    "deletion_time",
                    format!("{} is before scheduled_time {scheduled}", pod.deletion_time),
                )));
            }
            let submit_ms = pod.creation_time * 1000;
            if let Err(e) = order.check(line, "creation_time", submit_ms) {
                return Some(Err(e));
            }
            if matches!(from, AllocationFrom::Column) && pod.qos.is_empty() {
                return Some(Err(err(
                    "qos",
                    "is empty; choose --allocation-column none".into(),
                )));
            }
            let allocation = from.next(Some(&pod.qos));
            let models: Vec<&str> = pod.gpu_spec.split('|').filter(|m| !m.is_empty()).collect();
            Some(Ok(SimWorkload {
                submitted: WorkloadSubmitted {
                    model: (models.len() == 1).then(|| models[0].to_string()),
                    name: Some(pod.name),
                    ..WorkloadSubmitted::new(
                        workload_id(submit_ms, line),
                        allocation,
                        pod.num_gpu,
                        1,
                    )
                },
                submit_ms,
                work_ms: ((pod.deletion_time - scheduled) * 1000).max(1000),
            }))
        });
    Ok(Box::new(rows))
}

/// Reads a node list: `(name, gpus, model)` of every node with GPUs.
pub fn read_nodes(path: &Path) -> Result<Vec<(String, u32, String)>, SimError> {
    let file = std::fs::File::open(path).map_err(|e| SimError::Io(path.to_path_buf(), e))?;
    let mut nodes = Vec::new();
    for (i, r) in csv::Reader::from_reader(file)
        .into_deserialize::<NodeRow>()
        .enumerate()
    {
        let n = r.map_err(|e| SimError::Invalid(format!("{}:{}: {e}", path.display(), i + 2)))?;
        if n.gpu > 64 {
            return Err(SimError::Invalid(format!(
                "{}:{}: field \"gpu\": {} GPUs on one node; at most 64",
                path.display(),
                i + 2,
                n.gpu
            )));
        }
        if n.gpu > 0 {
            nodes.push((n.sn, n.gpu, n.model));
        }
    }
    Ok(nodes)
}
