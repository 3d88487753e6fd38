//! What node agents would report, for fake GPUs: a run ends when its duration estimate is done
//! (exit 0), and a run asked to stop ends when its grace period is over (stopped, then requeued
//! unless its owner cancelled it). Real agents report real process ends instead.

use ledger::event::{
    Event, PreemptionReason, StopReason, WorkloadFinished, WorkloadRequeued, WorkloadStopped,
};
use ledger::{Phase, State};

/// The reports due at `now_ms`.
pub fn reports(state: &State, now_ms: u64) -> Vec<Event> {
    let mut out = Vec::new();
    let mut running: Vec<_> = state
        .running_workloads()
        .filter(|w| w.phase == Phase::Running)
        .collect();
    running.sort_by_key(|w| w.id);
    for w in running {
        if let Some(p) = w.preempting {
            if p.grace_until_ms <= now_ms {
                let reason = match p.reason {
                    PreemptionReason::UserCancelled => StopReason::Cancelled,
                    PreemptionReason::HardwareFailure => StopReason::HardwareFailure,
                    _ => StopReason::Preempted,
                };
                out.push(Event::WorkloadStopped(WorkloadStopped {
                    workload: w.id,
                    reason,
                }));
                if reason != StopReason::Cancelled {
                    let ran_ms = now_ms.saturating_sub(w.started_at_ms);
                    let lost_s = w
                        .checkpoint_ms
                        .filter(|&c| c > 0)
                        .map_or(0, |c| (ran_ms % c) / 1000);
                    out.push(Event::WorkloadRequeued(WorkloadRequeued {
                        workload: w.id,
                        work_lost_s: lost_s,
                    }));
                }
                continue;
            }
        }
        if w.preempting.is_none() && w.remaining_estimate_ms(now_ms) == Some(0) {
            out.push(Event::WorkloadFinished(WorkloadFinished {
                workload: w.id,
                exit_code: Some(0),
                signal: None,
            }));
        }
    }
    out
}
