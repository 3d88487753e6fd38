//! The queue at a glance: how many workloads wait and for how many GPUs, by allocation and by
//! reason, with the head of each allocation's queue. What a listing of a hundred thousand
//! waiting workloads answers first, so that nobody needs to read them all to know where they
//! stand.

use std::collections::HashMap;

use super::{Blocked, Pending};
use crate::event::WorkloadId;
use crate::state::State;

/// The queue at a glance.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueSummary {
    /// Workloads waiting.
    pub pending: u64,
    /// GPUs they ask for, all together.
    pub gpus: u64,
    /// By allocation, in the order their heads are served (unallocated work under `None`).
    pub by_allocation: Vec<AllocationQueue>,
    /// By reason, in [`Blocked::CODES`] order, only reasons that some workload has.
    pub by_reason: Vec<ReasonCount>,
}

/// One allocation's queue.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocationQueue {
    /// Its path; `None` for unallocated work.
    pub allocation: Option<String>,
    /// Workloads waiting in it.
    pub pending: u64,
    /// GPUs they ask for.
    pub gpus: u64,
    /// Its first workload in the policy's order.
    pub head: WorkloadId,
    /// The head's position in the whole queue (1-based).
    pub head_position: u32,
    /// Why the head waits.
    pub head_reason: &'static str,
}

/// The workloads waiting for one reason.
#[derive(Clone, Debug, PartialEq)]
pub struct ReasonCount {
    /// The reason's code ([`Blocked::code`]).
    pub code: &'static str,
    /// Workloads waiting for it.
    pub pending: u64,
    /// GPUs they ask for.
    pub gpus: u64,
}

impl QueueSummary {
    /// The summary of `pending` (a plan's explained queue, in its order, or any part of it),
    /// reading each workload's allocation and size from `state`. Entries whose workload the
    /// state does not know are skipped.
    pub fn of<'a>(state: &State, pending: impl IntoIterator<Item = &'a Pending>) -> QueueSummary {
        let mut summary = QueueSummary::default();
        let mut allocations: HashMap<Option<&str>, usize> = HashMap::new();
        let mut reasons = [(0u64, 0u64); Blocked::CODES.len()];
        for p in pending {
            let Some(w) = state.workloads().get(&p.workload) else {
                continue;
            };
            let gpus = w.gpus();
            summary.pending += 1;
            summary.gpus += gpus;
            let path = state.allocation_path(w);
            let i = *allocations.entry(path).or_insert_with(|| {
                summary.by_allocation.push(AllocationQueue {
                    allocation: path.map(str::to_owned),
                    pending: 0,
                    gpus: 0,
                    head: p.workload,
                    head_position: p.position,
                    head_reason: p.reason.code(),
                });
                summary.by_allocation.len() - 1
            });
            let a = &mut summary.by_allocation[i];
            a.pending += 1;
            a.gpus += gpus;
            let r = Blocked::CODES
                .iter()
                .position(|c| *c == p.reason.code())
                .expect("every code is listed");
            reasons[r].0 += 1;
            reasons[r].1 += gpus;
        }
        summary.by_reason = Blocked::CODES
            .iter()
            .zip(reasons)
            .filter(|(_, (n, _))| *n > 0)
            .map(|(code, (pending, gpus))| ReasonCount {
                code,
                pending,
                gpus,
            })
            .collect();
        summary
    }
}
