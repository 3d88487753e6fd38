//! What node agents would report, for fake GPUs: a run ends when its duration estimate is done
//! (exit 0), and a run asked to stop ends when its grace period is over, reported as the
//! simulator reports it ([`ledger::State::grace_end_reports`]). Real agents report real process
//! ends instead.

use ledger::event::{Event, WorkloadFinished};
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
                out.extend(state.grace_end_reports(w.id, now_ms));
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
