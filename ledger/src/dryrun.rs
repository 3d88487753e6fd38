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
        Outcome::Applied => plan_for(&fork, id, base),
        Outcome::Duplicate { original } => DryRun::Duplicate(original),
        Outcome::Rejected(rejection) => DryRun::Refused(rejection),
    }
}

/// What the policy's plan on `fork` (which holds workload `id`, pending) says of it.
fn plan_for(fork: &State, id: WorkloadId, base: &PolicyConfig) -> DryRun {
    let config = PolicyConfig {
        explain: true,
        ..fork.policy_config(base)
    };
    let plan = decide(fork, fork.now_ms(), &config);
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

/// A change to a submission, within its submitter's rights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Fewer GPUs on each node.
    GpusPerNode(u32),
    /// Fewer nodes in the gang.
    Nodes(u32),
    /// A shorter protection from preemption.
    MinRuntimeS(u64),
    /// A duration estimate (borrowed placements need one: lent GPUs are given back in time).
    DurationEstimateS(u64),
    /// Another allocation the submitter may use.
    Allocation(String),
}

/// When a workload would start: at once, at (or not before) an estimate, or with no end in
/// sight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// The next scheduling pass starts it.
    Now(u64),
    /// The plan's estimate.
    At(Estimate),
    /// No running work it waits for has an estimate or a contract ending.
    Unknown,
}

impl Start {
    /// When, for ordering: unknown last.
    pub fn at_ms(&self) -> Option<u64> {
        match self {
            Start::Now(t) => Some(*t),
            Start::At(e) => Some(e.at_ms),
            Start::Unknown => None,
        }
    }

    /// Whether it is sooner than `other`: a known time beats none.
    pub fn sooner_than(&self, other: &Start) -> bool {
        match (self.at_ms(), other.at_ms()) {
            (Some(a), Some(b)) => a < b,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// The start of an outlook; `None` for a refusal or a duplicate.
    pub fn of(outlook: &DryRun, now_ms: u64) -> Option<Start> {
        match outlook {
            DryRun::Starts { .. } => Some(Start::Now(now_ms)),
            DryRun::Waits { estimate, .. } => Some(estimate.map_or(Start::Unknown, Start::At)),
            _ => None,
        }
    }
}

/// A change that would start the work sooner, and when.
#[derive(Clone, Debug, PartialEq)]
pub struct Alternative {
    /// The change.
    pub change: Change,
    /// What the changed submission would meet.
    pub outlook: DryRun,
    /// When it would start.
    pub start: Start,
}

/// Waiting workload `w` of `state` as a submission of the same shape (without its command and
/// environment, which planning does not read), under a new id.
pub fn resubmission(
    state: &State,
    w: &crate::state::Workload,
    id: WorkloadId,
) -> WorkloadSubmitted {
    WorkloadSubmitted {
        model: w
            .model
            .and_then(|m| state.cluster().models.get(m as usize))
            .map(|g| g.model.clone()),
        priority: w.priority,
        min_runtime_s: w.min_runtime_ms.map(|ms| ms / 1000),
        duration_estimate_s: w.duration_estimate_ms.map(|ms| ms / 1000),
        checkpoint_s: w.checkpoint_ms.map(|ms| ms / 1000),
        ..WorkloadSubmitted::new(
            id,
            state.allocation_path(w).map(str::to_owned),
            w.gpus_per_node,
            w.nodes,
        )
    }
}

/// The changes to `submitted` that would start it sooner than `start` (its own outlook), best
/// first: fewer GPUs per node or nodes, a shorter protection, a duration estimate where it has
/// none, another of `allocations` (those its submitter may use). Each is tried as a dry run on
/// one copy of `state` without `waiting` (the workload already waiting with this shape, which
/// the change would replace: cancelled there), at `at_ms`, sent by `actor`; only those that
/// would really start sooner are answered. Nothing of `state` changes.
#[allow(clippy::too_many_arguments)]
pub fn alternatives(
    state: &State,
    submitted: &WorkloadSubmitted,
    start: Start,
    waiting: Option<WorkloadId>,
    actor: &str,
    at_ms: u64,
    base: &PolicyConfig,
    allocations: &[String],
) -> Vec<Alternative> {
    let mut changes = Vec::new();
    let halves = |n: u32| {
        let mut out: Vec<u32> = [n / 2, n / 4, 1]
            .into_iter()
            .filter(|&k| k >= 1 && k < n)
            .collect();
        out.dedup();
        out
    };
    changes.extend(
        halves(submitted.gpus_per_node)
            .into_iter()
            .map(Change::GpusPerNode),
    );
    changes.extend(halves(submitted.nodes).into_iter().map(Change::Nodes));
    let protection_s = submitted
        .min_runtime_s
        .unwrap_or(base.min_runtime_ms / 1000);
    if protection_s >= 2 * 600 {
        changes.push(Change::MinRuntimeS(protection_s / 2));
    }
    if submitted.duration_estimate_s.is_none() {
        changes.extend([1_800, 7_200, 28_800].map(Change::DurationEstimateS));
    }
    changes.extend(
        allocations
            .iter()
            .filter(|a| Some(a.as_str()) != submitted.allocation.as_deref())
            .take(8)
            .map(|a| Change::Allocation(a.clone())),
    );
    // One copy for every change: each is folded in, planned, and cancelled again, so that the
    // next meets the same queue.
    let mut fork = state.clone();
    let mut seq = fork.last_seq();
    let mut fold = |fork: &mut State, event: Event| {
        seq += 1;
        let env = Envelope::new(Uuid::from_u128(u128::from(seq)), at_ms, actor, event);
        match fork.check(&env) {
            Ok(()) => fork.apply(seq, &env),
            Err(r) => Outcome::Rejected(r),
        }
    };
    let cancel = |workload| {
        Event::WorkloadCancelled(crate::event::WorkloadCancelled {
            workload,
            reason: None,
        })
    };
    if let Some(id) = waiting {
        fold(&mut fork, cancel(id));
    }
    let mut found = Vec::new();
    for (i, change) in changes.into_iter().enumerate() {
        let mut variant = submitted.clone();
        variant.workload = Uuid::from_u128(u128::MAX - i as u128);
        variant.idempotency_key = None;
        match &change {
            Change::GpusPerNode(g) => variant.gpus_per_node = *g,
            Change::Nodes(n) => variant.nodes = *n,
            Change::MinRuntimeS(s) => variant.min_runtime_s = Some(*s),
            Change::DurationEstimateS(s) => variant.duration_estimate_s = Some(*s),
            Change::Allocation(a) => variant.allocation = Some(a.clone()),
        }
        let id = variant.workload;
        if fold(&mut fork, Event::WorkloadSubmitted(variant)) != Outcome::Applied {
            continue;
        }
        let outlook = plan_for(&fork, id, base);
        fold(&mut fork, cancel(id));
        let Some(when) = Start::of(&outlook, fork.now_ms()) else {
            continue;
        };
        if when.sooner_than(&start) {
            found.push(Alternative {
                change,
                outlook,
                start: when,
            });
        }
    }
    found.sort_by_key(|a| a.start.at_ms().unwrap_or(u64::MAX));
    found
}
