//! One scheduling pass: what the scheduler appends at an instant, in what order and in what
//! batches. The live scheduler and the simulator both call [`pass`]; the live one adds IO
//! (fencing, retries after a conflict, leaving out what the log refuses) and starts watching each
//! newly registered node's heartbeats ([`crate::health::HealthMonitor::watch_registered`]), the
//! simulator only a virtual clock.
//!
//! A pass answers, in order of precedence:
//! 1. **GPU health changes** alone, when heartbeats (or their silence) say a GPU's health is not
//!    what the ledger holds: decisions wait until the ledger holds them, so nothing is placed on
//!    a GPU that has just failed.
//! 2. else **the ends of runs on silent nodes** alone: a run asked to stop whose grace period
//!    ended at least a heartbeat timeout ago on a node that has fallen silent is reported as its
//!    agent would have, since nobody else will.
//! 3. else the policy's **decisions** ([`decide`]), then utilization samples.
//!
//! Each answer is cut to `max_batch` events (the log's atomic batch): the rest comes in the next
//! pass. A caller appends what a pass answers, folds it, and passes again until a pass answers
//! nothing, as the live scheduler does whenever the ledger moves.

use crate::event::Event;
use crate::health::HealthMonitor;
use crate::policy::{decide, PolicyConfig};
use crate::State;

/// The events one pass at `now_ms` wants appended, cut to `max_batch`. `health` watches the
/// heartbeats, when the caller has any; `admit` keeps of a batch what the caller's log can take
/// (the live scheduler leaves out decisions the log refuses for good, so the others go on).
pub fn pass(
    state: &State,
    now_ms: u64,
    policy: &PolicyConfig,
    health: Option<&mut HealthMonitor>,
    admit: &mut dyn FnMut(Vec<Event>) -> Vec<Event>,
    max_batch: usize,
) -> Vec<Event> {
    let mut samples = Vec::new();
    if let Some(monitor) = health {
        let mut changes = admit(monitor.changes(state, now_ms));
        if changes.is_empty() {
            changes = admit(monitor.lost_run_reports(state, now_ms));
        }
        if !changes.is_empty() {
            changes.truncate(max_batch);
            return changes;
        }
        samples = monitor.utilization_samples(state, now_ms);
    }
    let plan = decide(state, now_ms, policy);
    let mut events: Vec<Event> = plan.decisions.iter().map(|d| d.to_event()).collect();
    events.extend(samples);
    let mut events = admit(events);
    events.truncate(max_batch);
    events
}
