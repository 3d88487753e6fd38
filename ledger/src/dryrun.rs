//! A submission tried without submitting it, as `sbatch --test-only` does: the fold's verdict
//! on it now, then the policy's plan for it on a copy of the state with it folded in — whether
//! the next scheduling pass would start it and where, or where it would wait, why, until when,
//! and whom the policy would preempt for it.

use uuid::Uuid;

use crate::event::{
    Borrowed, Envelope, Event, PlacedNode, PreemptionReason, WorkloadId, WorkloadSubmitted,
};
use crate::policy::{decide, Blocked, Decision, Estimate, PolicyConfig};
use crate::rejection::Rejection;
use crate::state::{Outcome, State};

/// What a submission would meet now.
#[derive(Clone, Debug, PartialEq)]
pub enum DryRun {
    /// The fold would refuse it, for this reason, as it would the real one.
    Refused(Rejection),
    /// Its idempotency key was used before: the workload it made stands, and nothing new would.
    Duplicate(WorkloadId),
    /// The next scheduling pass would start it.
    Starts {
        /// Where.
        placement: Vec<PlacedNode>,
        /// The end of its contract.
        protected_until_ms: u64,
        /// Lent GPUs, and until when, for a borrowed placement.
        borrowed: Option<Borrowed>,
    },
    /// It would wait.
    Waits {
        /// Its position in the queue (1-based).
        position: u32,
        /// Workloads in the queue, itself included.
        of: u32,
        /// Why.
        reason: Blocked,
        /// Its allocation's key in the ranking, as `explain` gives it.
        key: Option<f64>,
        /// When it may start, as far as the plan can tell.
        estimate: Option<Estimate>,
        /// The running workloads the policy would preempt for it, and why.
        preempting: Vec<(WorkloadId, PreemptionReason)>,
    },
}

/// What `submitted`, sent by `actor` at `at_ms` in an envelope with id `envelope_id`, would meet
/// in `state` under the policy `base` (the log's settings in force over it), at the later of
/// `at_ms` and the state's clock. Nothing of `state` changes.
pub fn dry_run(
    state: &State,
    envelope_id: Uuid,
    at_ms: u64,
    actor: &str,
    submitted: WorkloadSubmitted,
    base: &PolicyConfig,
) -> DryRun {
    let id = submitted.workload;
    let env = Envelope::new(
        envelope_id,
        at_ms,
        actor,
        Event::WorkloadSubmitted(submitted),
    );
    if let Err(rejection) = state.check(&env) {
        return DryRun::Refused(rejection);
    }
    let mut fork = state.clone();
    match fork.apply(state.last_seq() + 1, &env) {
        Outcome::Applied => {}
        Outcome::Duplicate { original } => return DryRun::Duplicate(original),
        Outcome::Rejected(rejection) => return DryRun::Refused(rejection),
    }
    let config = PolicyConfig {
        explain: true,
        ..fork.policy_config(base)
    };
    let plan = decide(&fork, fork.now_ms(), &config);
    let started = plan.decisions.iter().find_map(|d| match d {
        Decision::Start {
            workload,
            placement,
            protected_until_ms,
            borrowed,
        } if *workload == id => Some(DryRun::Starts {
            placement: placement.clone(),
            protected_until_ms: *protected_until_ms,
            borrowed: *borrowed,
        }),
        _ => None,
    });
    if let Some(starts) = started {
        return starts;
    }
    let mine = plan
        .pending
        .iter()
        .find(|p| p.workload == id)
        .expect("an explained plan lists every pending workload it does not start");
    let preempting = plan
        .decisions
        .iter()
        .filter_map(|d| match d {
            Decision::Preempt {
                workload,
                reason,
                beneficiary: Some(b),
                ..
            } if *b == id => Some((*workload, *reason)),
            _ => None,
        })
        .collect();
    DryRun::Waits {
        position: mine.position,
        of: plan.pending.len() as u32,
        reason: mine.reason.clone(),
        key: mine.key,
        estimate: plan.estimate(mine),
        preempting,
    }
}
