//! The scheduler as a pure function: [`decide`] reads the state and the time and proposes
//! decisions. The caller turns them into events and folds them; the fold has the last word.
//!
//! One pass walks the pending workloads in the policy's order ([`rank`]), the first
//! [`PolicyConfig::lookahead`] of them (and, beyond, only work with preemptions under way for
//! it). Each that fits is started (best-fit, gangs all-or-nothing, see [`placement`]). The
//! first that does not fit gets the *reservation*: the nodes that free up soonest for it,
//! which later workloads may use if
//! they are expected to end before it starts (backfill) or, one node each and unless it is a
//! gang, as a *borrowed placement*: the GPUs are lent until a grace period before the
//! reservation is due (at once when that is not known), so no GPU idles while work that fits
//! waits, with or without estimates, unless that work's allocation was delivered more than it
//! was owed over the usage window (the nodes drained for an under-served allocation are not
//! its over-served siblings' to fill). From the end of that term the workload that lent them
//! may take them back ([`PreemptionReason::Reclaimed`], no contract violation), when that lets
//! it start (counting the GPUs of work estimated to end before the borrowers have left, which
//! is no victim); no one else takes them on that term: otherwise a borrowed run is an ordinary one,
//! preempted only for fair share past its contract. With [`PolicyConfig::reservations_max`]
//! above one, blocked single-node workloads asking more than one GPU of allocations delivered
//! less than they were owed over the usage window hold further reservations, one node each on
//! a node with the most free GPUs, as many per allocation as twice the GPUs it is owed now
//! beyond those it holds: the nodes drained for whole-node work follow the deficit. The
//! holder of a reservation (the head's or a further one) may preempt post-contract work of
//! allocations ranked above its own by more than the hysteresis margin, choosing victims
//! preempted the fewest times, then those that lose the fewest GPU-hours; work that holds no
//! reservation may take only unallocated work, since the room it made would go to a holder
//! ranked above it (whose reservation moves to the nodes that free up first) and it would
//! preempt again elsewhere.
//!
//! Preemption is a cost someone pays, so it is bounded per workload and in time: each time a
//! workload is preempted, the protection of its next run doubles (up to the contract's cap) and
//! so does the margin by which a beneficiary must rank below it (up to eight times); and an
//! allocation whose work was taken by another's for fair share takes back from it within
//! [`PolicyConfig::reversal_window_ms`] only by twice the margin. Unallocated work, which has no
//! contract, is left alone for one grace period after it starts again once preempted, two after
//! twice, and so on up to the default contract.
//!
//! With [`PolicyConfig::defragment`], the head of the queue or a further
//! reservation's holder first looks to move smaller post-contract work of allocations ranked
//! above it (by any amount) off one node, where other nodes have room for that work to start
//! again at once ([`PreemptionReason::Defragment`]), and only then for victims by fair share.
//! Every workload left waiting gets a [`Blocked`] reason, which is what "why is my job pending"
//! answers.

mod bits;
pub mod fairshare;
pub mod fairtree;
pub mod fifo;
pub mod placement;
pub mod priority;
pub mod rank;
pub mod summary;
mod victims;

use std::ops::Bound;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::cluster::Hold;
use crate::event::{
    Borrowed, Event, PlacedNode, PreemptionReason, PreemptionRequested, WorkloadId, WorkloadStarted,
};
use crate::state::{Phase, State, Workload};
use placement::Scratch;
use rank::{Ranking, Usage};
use victims::{due_lenders, lent_due_nodes, level, may_take_from, Backoff, VictimSearch};

/// A scheduling policy: how pending work is ordered and whether allocations may preempt each
/// other. Adding a policy is one module implementing this trait, its line in [`by_name`] and its
/// name in [`POLICY_NAMES`] (which the settings check names against).
pub trait Policy: Sync {
    /// Name used in configuration.
    fn name(&self) -> &'static str;
    /// How the queue is walked.
    fn ranking(&self) -> Ranking;
    /// For tree rankings: the key of an allocation among its siblings, lower first. `me` and
    /// `siblings` (the sum over its live siblings, itself included) use windowed usage; `tau_ms`
    /// is the default minimum runtime.
    fn allocation_key(&self, _me: &Usage, _siblings: &Usage, _tau_ms: f64) -> f64 {
        0.0
    }
    /// For tree rankings: what [`Policy::allocation_key`] measures, for people.
    fn key_meaning(&self) -> Option<&'static str> {
        None
    }
    /// Whether the order updates as workloads are placed within one pass.
    fn updates_in_pass(&self) -> bool {
        false
    }
    /// Whether an allocation ranked sufficiently above another may lose post-contract work to it.
    fn preempts_for_fair_share(&self) -> bool {
        false
    }
}

/// The policies known by name: `fairshare`, `fairtree`, `fifo`, `priority`.
pub fn by_name(name: &str) -> Option<&'static dyn Policy> {
    match name {
        "fairshare" => Some(&fairshare::FairShare),
        "fairtree" => Some(&fairtree::FairTree),
        "fifo" => Some(&fifo::Fifo),
        "priority" => Some(&priority::Priority),
        _ => None,
    }
}

/// Names accepted by [`by_name`].
pub const POLICY_NAMES: [&str; 4] = ["fairshare", "fairtree", "fifo", "priority"];

/// Settings of the scheduler.
#[derive(Clone, Debug)]
pub struct PolicyConfig {
    /// Policy name, one of [`POLICY_NAMES`].
    pub policy: &'static str,
    /// Default protection of a started workload (the scheduling contract).
    pub min_runtime_ms: u64,
    /// Time a preempted workload gets to checkpoint.
    pub grace_ms: u64,
    /// Hysteresis: a victim's allocation must rank above the beneficiary's by more than this on
    /// the ranking key, compared where their paths split.
    pub margin: f64,
    /// The most blocked workloads per pass that may look for victims, bounding the work of a
    /// pass (each look costs a scan of the cluster).
    pub preemptors_per_pass_max: u32,
    /// The most reservations per pass: the head of the queue's, then further ones for blocked
    /// single-node multi-GPU workloads of allocations delivered less than they were owed over
    /// the usage window, as many per allocation as its deficit now calls for. Several nodes
    /// drain at once for whole-node work instead of one, lending their free GPUs meanwhile to
    /// allocations not over-served, so work of an allocation whose small jobs fill every gap
    /// does not keep them fragmented. Each costs the pass a look at the nodes with the most
    /// free GPUs; 4 by default (on the year's trace, 1 is the fastest).
    pub reservations_max: u32,
    /// Assemble whole nodes for the blocked multi-GPU work of under-served allocations: the head
    /// of the queue or a further reservation's holder may preempt, on one node, post-contract
    /// single-node work asking fewer GPUs from allocations ranked above its own (by any amount,
    /// not only the margin), when other nodes have room for every victim to start again at
    /// once. Free GPUs stranded on several nodes become one node's worth; no capacity is lost
    /// but the victims' work since their last checkpoint. Off by default: each pass looks at
    /// every node with preemptible work once more.
    pub defragment: bool,
    /// Node label whose equal values mean "close" (same rack) for gang placement.
    pub topology_label: String,
    /// Explain every pending workload. Without explanations a pass may stop early, once nothing
    /// is free and nothing more may be preempted, instead of visiting every pending workload.
    pub explain: bool,
    /// Hysteresis in time: for this long after work of allocation `a` preempted work of `b`
    /// for fair share, `b` may take `a`'s work back only if `a` ranks above it by twice the
    /// margin, so two teams near balance do not take turns preempting each other.
    pub reversal_window_ms: u64,
    /// The most pending workloads a pass considers, in the policy's order (Slurm's
    /// `bf_max_job_test`); 0 considers every one. Work further down the queue waits
    /// ([`Blocked::BeyondLookahead`]) even where it would fit: the fragments of nodes draining
    /// for an under-served allocation's whole-node work are not taken by the small jobs of an
    /// over-served sibling ranked far below it. Work with preemptions under way for it is
    /// considered wherever it stands, so the GPUs leaving for it stay held.
    pub lookahead: u32,
    /// The most times the policy preempts one workload within a usage window (Slurm's
    /// `PreemptExemptTime`, counted in restarts); 0 for no limit. Preempted this often (for fair
    /// share, a reclaim, defragmentation or its hardware), a workload is left alone for the
    /// usage window past its contract, and lent no GPUs (a loan is taken back); only its
    /// owner's cancel or a hardware failure stops it meanwhile. Bounded, not for good: a job
    /// that runs for months does not keep its GPUs from fair share for months.
    pub max_preemptions: u32,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            policy: "fairshare",
            min_runtime_ms: 2 * 3_600_000,
            grace_ms: 300_000,
            margin: 0.05,
            preemptors_per_pass_max: 16,
            reservations_max: 4,
            defragment: false,
            topology_label: "rack".to_string(),
            explain: true,
            reversal_window_ms: 24 * 3_600_000,
            lookahead: LOOKAHEAD,
            max_preemptions: MAX_PREEMPTIONS,
        }
    }
}

impl PolicyConfig {
    /// Whether work preempted `preemptions` times is left alone for the usage window past its
    /// contract: preempted as often as the policy preempts one workload
    /// ([`PolicyConfig::max_preemptions`]).
    pub fn left_alone_for_a_window(&self, preemptions: u32) -> bool {
        victims::exempt(preemptions, self.max_preemptions)
    }
}

/// The default [`PolicyConfig::max_preemptions`]: the most a researcher is asked to restart
/// one job in a week; see BENCHMARKS ("A limit on preemptions per workload") for what it costs
/// the split.
pub const MAX_PREEMPTIONS: u32 = 3;

/// The default [`PolicyConfig::lookahead`]. On the three-team benchmark (`ops/bench/churn.sh`,
/// seeds 1–3) the under-served `a/y` got 0.937, 0.925 and 0.918 of owed over the submission
/// period considering every workload, 0.956, 0.957 and 0.935 with 128, with fewer preemptions;
/// 64 and 256 did no better, 16 left GPUs idle; the fifteen teams' runs were the same.
pub const LOOKAHEAD: u32 = 128;

/// What the scheduler proposes.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Start a pending workload on these GPUs.
    Start {
        /// The workload.
        workload: WorkloadId,
        /// One entry per node.
        placement: Vec<PlacedNode>,
        /// End of its contract.
        protected_until_ms: u64,
        /// A borrowed placement: the reservation lending the GPUs, and its term.
        borrowed: Option<Borrowed>,
    },
    /// Ask a running workload to stop within the grace period.
    Preempt {
        /// The victim.
        workload: WorkloadId,
        /// Why.
        reason: PreemptionReason,
        /// For whom.
        beneficiary: Option<WorkloadId>,
        /// Grace period.
        grace_s: u64,
    },
}

impl Decision {
    /// The event that records this decision.
    pub fn to_event(&self) -> Event {
        match self {
            Decision::Start {
                workload,
                placement,
                protected_until_ms,
                borrowed,
            } => Event::WorkloadStarted(WorkloadStarted {
                workload: *workload,
                placement: placement.clone(),
                protected_until_ms: *protected_until_ms,
                borrowed: *borrowed,
            }),
            Decision::Preempt {
                workload,
                reason,
                beneficiary,
                grace_s,
            } => Event::PreemptionRequested(PreemptionRequested {
                workload: *workload,
                reason: *reason,
                beneficiary: *beneficiary,
                grace_s: *grace_s,
            }),
        }
    }
}

/// Why a workload is still pending.
#[derive(Clone, Debug, PartialEq)]
pub enum Blocked {
    /// It holds a reservation (the head of the queue, or the first single-node workload of a
    /// further allocation): nodes are drained for it, and it starts when they free up.
    HoldsReservation {
        /// Nodes reserved.
        nodes: u32,
        /// Earliest start known from contracts and estimates; `None` when no holder of those
        /// GPUs has an end in sight.
        start_at_ms: Option<u64>,
    },
    /// Preemptions on its behalf are in progress; it starts when the victims have left.
    WaitingForPreemption {
        /// Workloads being preempted for it.
        victims: u32,
        /// When the last grace period ends.
        until_ms: u64,
    },
    /// It would fit, but on GPUs held for a workload ranked above it: its reservation (work
    /// that may not borrow them: a gang), or workloads leaving for it.
    BehindReservation {
        /// The workload they are held for.
        holder: WorkloadId,
    },
    /// Not enough free GPUs of the right shape.
    NoCapacity {
        /// GPUs needed on each node.
        gpus_per_node: u32,
        /// Nodes needed.
        nodes: u32,
        /// Nodes that could host one member now.
        fitting_nodes: u32,
    },
    /// Its allocation (or an ancestor) is at its GPU cap.
    AllocationCap {
        /// The capped allocation.
        path: String,
        /// Its cap.
        max_gpus: u32,
    },
    /// Further down the queue than a pass looks ([`PolicyConfig::lookahead`]): it moves up as
    /// work ahead of it starts, or as its allocation comes to rank higher.
    BeyondLookahead {
        /// How many pending workloads a pass considers.
        limit: u32,
    },
}

impl Blocked {
    /// The reason's name as listings and filters use it: `holds_reservation`,
    /// `waiting_for_preemption`, `behind_reservation`, `no_capacity`, `allocation_cap` or
    /// `beyond_lookahead`.
    pub fn code(&self) -> &'static str {
        match self {
            Blocked::HoldsReservation { .. } => "holds_reservation",
            Blocked::WaitingForPreemption { .. } => "waiting_for_preemption",
            Blocked::BehindReservation { .. } => "behind_reservation",
            Blocked::NoCapacity { .. } => "no_capacity",
            Blocked::AllocationCap { .. } => "allocation_cap",
            Blocked::BeyondLookahead { .. } => "beyond_lookahead",
        }
    }

    /// Every reason's code, in the order summaries list them (closest to starting first).
    pub const CODES: [&'static str; 6] = [
        "holds_reservation",
        "waiting_for_preemption",
        "behind_reservation",
        "allocation_cap",
        "no_capacity",
        "beyond_lookahead",
    ];
}

/// A pending workload and why it waits.
#[derive(Clone, Debug, PartialEq)]
pub struct Pending {
    /// The workload.
    pub workload: WorkloadId,
    /// 1-based position among the workloads this pass leaves waiting, in its order: the
    /// workloads it starts are not in the queue any more.
    pub position: u32,
    /// Why it waits.
    pub reason: Blocked,
    /// Its allocation's key when it was considered (a tree ranking's, [`Policy::key_meaning`]
    /// says what it is), `None` for unallocated work or a flat ranking.
    pub key: Option<f64>,
}

/// GPUs held for the head of the queue.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    /// The workload they are held for.
    pub workload: WorkloadId,
    /// The nodes.
    pub nodes: Vec<String>,
    /// Earliest start known, if any.
    pub start_at_ms: Option<u64>,
    /// Whether the start is known as it will be if nothing changes: not when it counts on
    /// preempting work, which happens only once the rest of the room is ready too (so a grace
    /// period after it, where that comes later).
    pub exact: bool,
}

impl Reservation {
    fn new(state: &State, workload: WorkloadId, nodes: &[u32], start_at_ms: Option<u64>) -> Self {
        Reservation {
            workload,
            nodes: nodes
                .iter()
                .map(|&n| state.cluster.node(n).name.clone())
                .collect(),
            start_at_ms,
            exact: true,
        }
    }
}

/// The result of one pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Starts and preemptions, in the order they were decided.
    pub decisions: Vec<Decision>,
    /// Pending workloads in order, with reasons (empty unless `explain`).
    pub pending: Vec<Pending>,
    /// The reservations, the head of the queue's first. Without `explain`, only those a
    /// decision of the pass depended on (the first of the explained pass's).
    pub reservations: Vec<Reservation>,
}

impl Plan {
    /// The reservation held for `holder`, if any.
    pub fn reservation_of(&self, holder: WorkloadId) -> Option<&Reservation> {
        self.reservations.iter().find(|r| r.workload == holder)
    }

    /// Explains `w`, left waiting for `reason`, next in the queue.
    fn wait(&mut self, w: &Workload, reason: Blocked, rank: &rank::Rank, policy: &dyn Policy) {
        self.pending.push(Pending {
            workload: w.id,
            position: self.pending.len() as u32 + 1,
            reason,
            key: w
                .allocation
                .filter(|_| matches!(policy.ranking(), Ranking::Tree))
                .map(|a| rank.key(a)),
        });
    }

    /// The start decisions.
    pub fn starts(&self) -> impl Iterator<Item = &Decision> {
        self.decisions
            .iter()
            .filter(|d| matches!(d, Decision::Start { .. }))
    }

    /// The preemption decisions.
    pub fn preemptions(&self) -> impl Iterator<Item = &Decision> {
        self.decisions
            .iter()
            .filter(|d| matches!(d, Decision::Preempt { .. }))
    }

    /// When `pending` (one of this plan's) may start, as far as the plan can tell: the
    /// reservation's start where it holds one, the end of the grace periods of the workloads
    /// leaving for it, else no sooner than the reservation it waits behind (or the head of the
    /// queue's) is due; `None` when no end is in sight (no running work it waits for has an
    /// estimate or a contract ending). Only the head of the queue's is exact: the room that
    /// frees up for any other workload may be taken by one ranked above it that fits there
    /// then, or by the head's reservation, which moves to the nodes that free up first.
    pub fn estimate(&self, pending: &Pending) -> Option<Estimate> {
        let head = self
            .reservations
            .first()
            .is_some_and(|r| r.workload == pending.workload);
        match &pending.reason {
            Blocked::HoldsReservation { start_at_ms, .. } => start_at_ms.map(|at_ms| Estimate {
                at_ms,
                exact: head
                    && self
                        .reservation_of(pending.workload)
                        .is_some_and(|r| r.exact),
                how: "the reserved nodes free up then, by the running workloads' duration estimates",
            }),
            Blocked::WaitingForPreemption { until_ms, .. } => Some(Estimate {
                at_ms: *until_ms,
                exact: head,
                how: "the workloads preempted for it leave when their grace periods end",
            }),
            Blocked::BehindReservation { holder } => self
                .reservation_of(*holder)
                .and_then(|r| r.start_at_ms)
                .map(|at_ms| Estimate {
                    at_ms,
                    exact: false,
                    how: "the nodes it would fit on are drained for a workload ranked above it, which starts then",
                }),
            _ => self
                .reservations
                .first()
                .and_then(|r| r.start_at_ms)
                .map(|at_ms| Estimate {
                    at_ms,
                    exact: false,
                    how: "it waits behind the head of the queue, whose reserved nodes free up then",
                }),
        }
    }
}

/// When a waiting workload may start ([`Plan::estimate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// The time.
    pub at_ms: u64,
    /// `true`: it starts then if nothing changes; `false`: not before then.
    pub exact: bool,
    /// How it was derived, in a sentence.
    pub how: &'static str,
}

/// How a running workload is protected from preemption, as the policy and the fold apply it.
#[derive(Clone, Debug, PartialEq)]
pub struct Protection {
    /// Until when the policy leaves it alone for fair share: the end of its contract, or, for
    /// unallocated work preempted before or work preempted as often as the policy preempts one,
    /// later.
    pub left_alone_until_ms: u64,
    /// Whether that is past its contract because it was preempted as often as the policy
    /// preempts one workload ([`PolicyConfig::max_preemptions`]).
    pub at_the_limit: bool,
    /// The same in words, with the exceptions the fold allows.
    pub detail: String,
}

/// How running workload `w` is protected now: the contract the fold holds, the backoff and the
/// limit on preemptions the policy adds, and what may still stop it (its GPUs failing, a cancel,
/// a lender taking back the GPUs it borrowed). `None` for a workload not running.
pub fn protection(state: &State, cfg: &PolicyConfig, w: &crate::Workload) -> Option<Protection> {
    let node = state.cluster.node(w.placement.first()?.node);
    let hold = node.tenants.iter().find(|t| t.workload == w.id)?.hold;
    let backoff = victims::Backoff::of(state, cfg);
    let left_alone_until_ms = victims::left_alone_until(&hold, backoff);
    let at_the_limit = victims::exempt(w.preemptions, cfg.max_preemptions);
    let n = w.preemptions;
    let mut detail = match (at_the_limit, w.allocation) {
        (true, _) => format!(
            "running; preempted {n} time(s) before, as often as the policy preempts one workload (the setting max_preemptions): it is left alone until left_alone_until_ms (the usage window past its contract)"
        ),
        (false, None) if n == 0 => {
            "running as unallocated work: it has no contract, and yields to allocated work at once".to_owned()
        }
        (false, None) => format!(
            "running as unallocated work, preempted {n} time(s) before: it is left alone until left_alone_until_ms, then yields to allocated work"
        ),
        (false, Some(_)) if n == 0 => {
            "running; fair share does not preempt it before protected_until_ms".to_owned()
        }
        (false, Some(_)) => format!(
            "running; preempted {n} time(s) before, so its contract was doubled as often (up to the cap), and fair share takes it only for work ranked below it by the margin doubled as often: fair share does not preempt it before protected_until_ms"
        ),
    };
    if let Some(b) = w.borrowed {
        detail += &format!(
            "; it runs on GPUs lent by workload {}'s reservation, which may take them back from borrowed_until_ms",
            b.reserved_for
        );
    }
    detail += "; a failure of its GPUs or a cancel stops it at any time";
    Some(Protection {
        left_alone_until_ms,
        at_the_limit,
        detail,
    })
}

/// Every allocation's key among its siblings (what orders the queue, lower first) at each of
/// `times_ms`, as it will stand if nothing changes meanwhile: its work runs on at today's rates
/// (the GPUs it holds, the GPUs it is owed) and the usage window slides. `keys[t][a]` is
/// allocation `a`'s at `times_ms[t]`; `None` for a policy without a tree ranking, which has no
/// keys. A key of `f64::MAX` is an allocation that holds GPUs while owed none.
///
/// # Panics
/// If `cfg.policy` names no policy.
pub fn allocation_keys(
    state: &State,
    cfg: &PolicyConfig,
    times_ms: &[u64],
) -> Option<Vec<Vec<f64>>> {
    let policy = by_name(cfg.policy).expect("policy name validated by the caller");
    if !matches!(policy.ranking(), Ranking::Tree) {
        return None;
    }
    let n = state.allocations.nodes.len() as u32;
    Some(
        times_ms
            .iter()
            .map(|&t| {
                let rank = rank::Rank::new(
                    state,
                    t.max(state.now_ms),
                    policy,
                    cfg.min_runtime_ms as f64,
                );
                (0..n).map(|a| rank.key(a)).collect()
            })
            .collect(),
    )
}

/// Runs one scheduling pass at `now_ms`. Pure: the same state, time and config give the same plan.
///
/// # Panics
/// If `cfg.policy` names no policy; validate configuration with [`by_name`] first.
pub fn decide(state: &State, now_ms: u64, cfg: &PolicyConfig) -> Plan {
    let policy = by_name(cfg.policy).expect("policy name validated by the caller");
    let mut plan = Plan::default();
    let grace_s = cfg.grace_ms / 1000;
    let cap_ms = state.config().min_runtime_cap_ms;

    // What the fold keeps about running work, read without sweeping it:
    // - Hardware failure is the contract's one exception: work on failed GPUs stops at once.
    // - Preemptions already under way, by beneficiary.
    // - The allocations holding work any beneficiary could preempt now (unallocated, or past
    //   contract and not already leaving); their nodes are gathered only if a search needs them.
    let failed = on_failed_gpus(state);
    let mut incoming: FxHashMap<WorkloadId, (u32, u64, Vec<u32>)> = FxHashMap::default();
    for id in &state.preempting {
        let w = &state.workloads[id];
        if let Some(b) = w.preempting.and_then(|p| p.beneficiary) {
            let e = incoming.entry(b).or_insert((0, 0, Vec::new()));
            e.0 += 1;
            e.1 = e.1.max(w.preempting.map_or(0, |p| p.grace_until_ms));
            e.2.extend(w.placement.iter().map(|part| part.node));
        }
    }
    for nodes in incoming.values_mut() {
        nodes.2.sort_unstable();
        nodes.2.dedup();
    }
    let leaves_waiting: FxHashSet<u32> = incoming
        .keys()
        .filter_map(|b| state.workloads.get(b).and_then(|w| w.allocation))
        .collect();
    let mut search = VictimSearch {
        left: cfg.preemptors_per_pass_max,
        claimed: failed.iter().copied().collect(),
        nodes: None,
        allocs: state.contracts.preemptible_allocations(now_ms),
        no_victims: FxHashSet::default(),
        failed_shapes: FxHashSet::default(),
        failed: Vec::new(),
        takes: FxHashMap::default(),
        defragmented: false,
        backoff: Backoff::of(state, cfg),
    };
    for id in failed {
        plan.decisions.push(Decision::Preempt {
            workload: id,
            reason: PreemptionReason::HardwareFailure,
            beneficiary: None,
            grace_s: 0,
        });
    }

    let mut scratch = Scratch::new(state, &cfg.topology_label);
    let mut rank = rank::Rank::new(state, now_ms, policy, cfg.min_runtime_ms as f64);
    // Shapes asked by the pending workloads this pass has not visited yet.
    let mut asks = state.pending_shapes.clone();
    // Candidates visited: what the lookahead counts.
    let mut position = 0u32;
    let mut deferred = Deferred {
        holders: Vec::new(),
        policy,
        cfg,
        now_ms,
    };
    // The GPUs reservations and preemptions of this pass are for, by allocation: further
    // reservations for an allocation stop at what its deficit calls for (`may_drain_for`).
    let mut served: FxHashMap<Option<u32>, u64> = FxHashMap::default();
    // The workloads not visited yet that lent GPUs whose term is over and may hold a further
    // reservation (see `VictimSearch::reclaim`): work that drains, of an under-served allocation.
    let mut lenders_due = if cfg.reservations_max > 1 {
        due_lenders(state, now_ms, |w| {
            drains_for((w.gpus_per_node, w.nodes))
                && w.allocation.is_some_and(|a| rank.under_served(a))
        })
    } else {
        FxHashSet::default()
    };

    // The workloads with preemptions under way for them that the pass has not visited yet: the
    // only ones it considers beyond the lookahead.
    let mut beneficiaries_left = incoming
        .keys()
        .filter(|b| {
            state
                .workloads
                .get(b)
                .is_some_and(|w| w.phase == Phase::Pending)
        })
        .count();
    while let Some(id) = rank.next_candidate() {
        position += 1;
        if !lenders_due.is_empty() {
            lenders_due.remove(&id);
        }
        let w = &state.workloads[&id];
        let beneficiary = incoming.contains_key(&id);
        if beneficiary {
            beneficiaries_left = beneficiaries_left.saturating_sub(1);
        }
        if cfg.lookahead > 0 && position > cfg.lookahead && !beneficiary {
            if !cfg.explain {
                // Without explanations, go straight to the beneficiaries left, if any.
                if beneficiaries_left == 0 {
                    break;
                }
                if let Some(leaf) = w.allocation.filter(|l| !leaves_waiting.contains(l)) {
                    rank.skip_rest_of(leaf);
                }
            } else {
                let limit = cfg.lookahead;
                plan.wait(w, Blocked::BeyondLookahead { limit }, &rank, policy);
            }
            continue;
        }
        let shape = (w.gpus_per_node, w.nodes);
        if let Some(n) = asks.get_mut(&shape) {
            *n -= 1;
            if *n == 0 {
                asks.remove(&shape);
            }
        }
        let blocked = rank
            .cap_blocks(w)
            .map(|(path, max_gpus)| Blocked::AllocationCap { path, max_gpus });
        if blocked.is_none() {
            // A reservation not worked out yet is needed once this workload could use its
            // nodes: if it fits anywhere, or might backfill.
            if !deferred.holders.is_empty()
                && (scratch.fits(w) || w.remaining_estimate_ms(now_ms).is_some())
            {
                deferred.settle(&mut plan, &mut scratch, &rank);
            }
            if let Some(parts) = scratch.place(w, false) {
                plan.decisions
                    .push(start(state, w, parts, now_ms, cfg, cap_ms, None));
                rank.placed(w);
                continue;
            }
            // Backfill: reserved GPUs may be lent to work that gives them back in time.
            let backfills = w.remaining_estimate_ms(now_ms).is_some_and(|end| {
                !plan.reservations.is_empty()
                    && plan
                        .reservations
                        .iter()
                        .all(|r| r.start_at_ms.is_none_or(|s| now_ms + end <= s))
            });
            if backfills {
                if let Some(parts) = scratch.place(w, true) {
                    plan.decisions
                        .push(start(state, w, parts, now_ms, cfg, cap_ms, None));
                    rank.placed(w);
                    continue;
                }
            }
            // A borrowed placement: the reservation's free GPUs are lent to work that accepts to
            // give them back a grace period before the reservation is due (at once when that is
            // not known), so no GPU idles while work that fits waits. The holder takes them back
            // then, if it needs them.
            // (Work preempted as often as it may be could not give them back.)
            if w.nodes == 1
                && !victims::exempt(w.preemptions, cfg.max_preemptions)
                && scratch.free_total() >= u64::from(w.gpus_per_node)
                && w.allocation.is_none_or(|a| !rank.over_served(a))
            {
                // Only a single-node holder's reservation lends: a gang's not worked out yet
                // (the head's, most often) may stay so.
                if deferred
                    .holders
                    .iter()
                    .any(|h| state.workloads[h].nodes == 1)
                {
                    deferred.settle(&mut plan, &mut scratch, &rank);
                }
                if let Some((parts, lender)) = scratch.place_borrowed(w) {
                    let r = plan
                        .reservation_of(lender)
                        .expect("only a worked-out reservation lends");
                    // Taken back a grace period before the reservation is due, it has left by
                    // then (and, its GPUs timed from the end of its term plus grace, it does
                    // not push the reservation later).
                    let borrowed = Borrowed {
                        reserved_for: r.workload,
                        until_ms: r
                            .start_at_ms
                            .map_or(now_ms, |s| s.saturating_sub(cfg.grace_ms))
                            .max(now_ms),
                    };
                    plan.decisions.push(start(
                        state,
                        w,
                        parts,
                        now_ms,
                        cfg,
                        cap_ms,
                        Some(borrowed),
                    ));
                    rank.placed(w);
                    continue;
                }
            }
        }

        // The first workload left waiting for capacity holds the reservation; the first blocked
        // single-node workload of each further allocation one as well, while there are fewer
        // than the most a pass may have.
        let head = plan.reservations.is_empty() && deferred.holders.is_empty();
        let further = !head
            && reservations_open(&plan, &deferred, cfg)
            && drains_for((w.gpus_per_node, w.nodes))
            && w.allocation
                .is_some_and(|a| may_drain_for(&served, &rank, a, w.gpus()));
        // Whether the victims found below assemble a node ([`VictimSearch::defragment`]): looked
        // for before fair share's, whose victims would not start again at once.
        let mut defragmenting = false;
        let blocked = match (blocked, incoming.get(&id)) {
            (Some(b), _) => b,
            (None, Some(&(victims, until_ms, ref nodes))) => {
                deferred.settle(&mut plan, &mut scratch, &rank);
                scratch.withhold_nodes(nodes, id);
                // A gang's other nodes had room when its victims were chosen: hold them as
                // well, or work ranked after it takes them while the victims leave, and the
                // gang waits for ever (two workloads preempting each other for it in turn).
                let mut held = nodes.clone();
                // Only a victim's node that will have room once the victims leave counts:
                // another tenant may keep the rest of it.
                let will_have_room = nodes
                    .iter()
                    .filter(|&&n| {
                        let node = state.cluster.node(n);
                        let leaving: u32 = node
                            .tenants
                            .iter()
                            .filter(|t| {
                                state
                                    .workloads
                                    .get(&t.workload)
                                    .and_then(|v| v.preempting)
                                    .and_then(|p| p.beneficiary)
                                    == Some(id)
                            })
                            .map(|t| (t.gpus & node.healthy).count_ones())
                            .sum();
                        scratch.free_on(n) + leaving >= w.gpus_per_node
                    })
                    .count();
                let missing = (w.nodes as usize).saturating_sub(will_have_room);
                if missing > 0 {
                    let more = scratch.room_for(w, nodes, missing);
                    scratch.withhold_nodes(&more, id);
                    held.extend(more);
                }
                if plan.reservations.is_empty() {
                    plan.reservations
                        .push(Reservation::new(state, id, &held, Some(until_ms)));
                }
                *served.entry(w.allocation).or_default() += w.gpus();
                Blocked::WaitingForPreemption { victims, until_ms }
            }
            // A workload about to hold a reservation first takes back the GPUs it lent whose
            // term is over, where that (with the work it may take anyway) lets it start; then,
            // as any other blocked workload, looks among the work it may take.
            (None, None) => match (head || further)
                .then(|| {
                    let due = lent_due_nodes(state, id, now_ms);
                    if due.is_empty() || w.allocation.is_none() {
                        return None;
                    }
                    deferred.settle(&mut plan, &mut scratch, &rank);
                    search.reclaim(state, &scratch, &rank, policy, cfg, w, now_ms, &due)
                })
                .flatten()
                .or_else(|| {
                    ((head || further) && cfg.defragment && policy.preempts_for_fair_share())
                        .then(|| {
                            deferred.settle(&mut plan, &mut scratch, &rank);
                            search.defragment(state, &scratch, &rank, w, now_ms)
                        })
                        .flatten()
                        .inspect(|_| defragmenting = true)
                })
                .or_else(|| {
                    // Allocated work is preempted only for work the pass holds room for: the
                    // head of the queue and the further reservations' holders. Room made for
                    // work ranked below them is theirs to take once it is free (a reservation
                    // moves to the nodes that free up first), and the work it was made for
                    // preempts again elsewhere. Unallocated work yields to anyone.
                    let only_unallocated = !(head || further);
                    search
                        .worth_searching(state, &rank, policy, cfg, w, only_unallocated)
                        .then(|| {
                            deferred.settle(&mut plan, &mut scratch, &rank);
                            search.find(
                                state,
                                &scratch,
                                &rank,
                                policy,
                                cfg,
                                w,
                                now_ms,
                                only_unallocated,
                            )
                        })
                        .flatten()
                }) {
                Some((nodes, victims)) => {
                    let until_ms = now_ms + cfg.grace_ms;
                    for v in &victims {
                        let victim = &state.workloads[v];
                        // Taken back by its lender on the borrowing's term; before the term, or
                        // by anyone else, only fair share may take it, past its contract.
                        let reason = if victim
                            .borrowed
                            .is_some_and(|b| b.reserved_for == id && b.until_ms <= now_ms)
                        {
                            PreemptionReason::Reclaimed
                        } else if defragmenting {
                            PreemptionReason::Defragment
                        } else if victim.allocation.is_none() {
                            PreemptionReason::Opportunistic
                        } else {
                            PreemptionReason::FairShare
                        };
                        plan.decisions.push(Decision::Preempt {
                            workload: *v,
                            reason,
                            beneficiary: Some(id),
                            grace_s,
                        });
                    }
                    scratch.withhold_nodes(&nodes, id);
                    if plan.reservations.is_empty() {
                        plan.reservations
                            .push(Reservation::new(state, id, &nodes, Some(until_ms)));
                    }
                    *served.entry(w.allocation).or_default() += w.gpus();
                    Blocked::WaitingForPreemption {
                        victims: victims.len() as u32,
                        until_ms,
                    }
                }
                None if head || further => {
                    // Without explanations, reservations are worked out only once a decision
                    // depends on them (often none does).
                    deferred.holders.push(id);
                    *served.entry(w.allocation).or_default() += w.gpus();
                    if cfg.explain {
                        deferred.settle(&mut plan, &mut scratch, &rank);
                    }
                    let mine = plan.reservation_of(id);
                    Blocked::HoldsReservation {
                        nodes: mine.map_or(0, |r| r.nodes.len() as u32),
                        start_at_ms: mine.and_then(|r| r.start_at_ms),
                    }
                }
                // Without explanations the reason is thrown away: skip working it out.
                None if !cfg.explain => Blocked::NoCapacity {
                    gpus_per_node: w.gpus_per_node,
                    nodes: w.nodes,
                    fitting_nodes: 0,
                },
                None => match scratch.withheld_holder(w) {
                    Some(holder) => Blocked::BehindReservation { holder },
                    None => Blocked::NoCapacity {
                        gpus_per_node: w.gpus_per_node,
                        nodes: w.nodes,
                        fitting_nodes: scratch.fitting_nodes(w),
                    },
                },
            },
        };
        if cfg.explain {
            plan.wait(w, blocked, &rank, policy);
            continue;
        }
        if plan.reservations.is_empty() && deferred.holders.is_empty() || !search.exhausted() {
            continue;
        }
        // While a further reservation may be taken, a workload not visited yet might hold it,
        // and withholding nodes changes where later work goes.
        let further_open = reservations_open(&plan, &deferred, cfg);
        // The head of the queue holds the reservation and no more preemptions may be looked for:
        // from here on a workload visited either starts or waits, with no effect on the pass
        // unless preemptions are under way for it. Whether a shape (GPUs per node, nodes) fits
        // anywhere, whatever the model (the nodes a reservation lends count for single-node
        // work, which may borrow them, and withheld nodes for any if some pending work has an
        // estimate and so might backfill; a reservation not worked out yet withholds nothing,
        // so this errs on going on):
        let fits = |&(gpus_per_node, nodes): &(u32, u32)| {
            scratch.free_total() > 0
                && scratch.could_fit(gpus_per_node, nodes, state.pending_with_estimate > 0)
        };
        // A workload not visited yet that lent GPUs whose term is over may still take them
        // back as a further reservation's holder, fitting or not.
        let lenders_wait = further_open && !lenders_due.is_empty();
        if !lenders_wait && !asks.keys().any(fits) {
            // No workload not visited yet can start. Without explanations to give, the pass is
            // over.
            break;
        }
        if let Some(leaf) = w.allocation {
            // Nor can the workloads of this one's leaf whose shape fits nowhere: go on at the
            // next that might fit, if any (or might hold a further reservation). Not in a leaf
            // with preemptions under way for one of its workloads, which withholds its victims'
            // nodes when visited.
            if !leaves_waiting.contains(&leaf) {
                let here = State::queue_key(w);
                // (Work that drains asks two GPUs at least.)
                let may_hold = further_open && may_drain_for(&served, &rank, leaf, 2);
                let next = state.queue_shapes.get(&leaf).and_then(|shapes| {
                    shapes
                        .iter()
                        .filter(|&(&shape, _)| fits(&shape) || may_hold && drains_for(shape))
                        .filter_map(|(_, keys)| {
                            keys.range((Bound::Excluded(here), Bound::Unbounded)).next()
                        })
                        .min()
                });
                match next {
                    Some(key) => rank.skip_to(leaf, key),
                    None => rank.skip_rest_of(leaf),
                }
            }
        }
    }
    plan
}

/// Whether work of this shape (GPUs per node, nodes) may hold a further reservation: single-node
/// work asking more than one GPU, which fragmentation keeps waiting (one GPU fits in any gap).
fn drains_for((gpus_per_node, nodes): (u32, u32)) -> bool {
    nodes == 1 && gpus_per_node > 1
}

/// GPUs drained for an under-served allocation per GPU it is owed now beyond what it holds: a
/// node takes a while to drain while its other tenants finish, so more are drained than the
/// shortfall of the moment. (On the three-team benchmark, 1 gave `a/y` 0.946 of owed over the
/// submission period, 2 gave 0.962 and 4 gave 0.942: draining idles GPUs too.)
const DRAIN_PER_DEFICIT: f64 = 2.0;

/// Whether allocation `leaf` may hold a further reservation for `gpus`: it was delivered less
/// than it was owed over the window, and either no reservation or preemption of this pass is
/// for it yet, or those there are hold fewer GPUs than [`DRAIN_PER_DEFICIT`] times what it is
/// owed now beyond what it holds: the nodes drained for it follow its deficit.
fn may_drain_for(
    served: &FxHashMap<Option<u32>, u64>,
    rank: &rank::Rank,
    leaf: u32,
    gpus: u64,
) -> bool {
    if !rank.under_served(leaf) {
        return false;
    }
    let held_for = served.get(&Some(leaf)).copied().unwrap_or(0);
    held_for == 0 || (held_for + gpus) as f64 <= DRAIN_PER_DEFICIT * rank.deficit_gpus(leaf)
}

/// Whether the pass may take one more reservation, counting those not worked out yet.
fn reservations_open(plan: &Plan, deferred: &Deferred, cfg: &PolicyConfig) -> bool {
    plan.reservations.len() + deferred.holders.len() < cfg.reservations_max as usize
}

/// Running work on failed GPUs that is not already leaving, in order.
fn on_failed_gpus(state: &State) -> Vec<WorkloadId> {
    let mut failed = Vec::new();
    if state.cluster.healthy_gpus == state.cluster.total_gpus {
        return failed;
    }
    for n in &state.cluster.nodes {
        for t in &n.tenants {
            if t.gpus & !n.healthy != 0 && !state.preempting.contains(&t.workload) {
                failed.push(t.workload);
            }
        }
    }
    failed.sort_unstable();
    failed.dedup();
    failed
}

/// The reservations not worked out yet: without explanations, a reservation is worked out only
/// once something depends on it.
struct Deferred<'a> {
    /// Their holders, in the order visited.
    holders: Vec<WorkloadId>,
    policy: &'a dyn Policy,
    cfg: &'a PolicyConfig,
    now_ms: u64,
}

impl Deferred<'_> {
    /// Works out the reservations not worked out yet, in order, and withholds their nodes.
    /// Called before anything that depends on them (a placement that could use their nodes, a
    /// backfill, a victim search, a withholding), so the scratch is still as it was when the
    /// holders were visited.
    fn settle(&mut self, plan: &mut Plan, scratch: &mut Scratch, rank: &rank::Rank) {
        for holder in std::mem::take(&mut self.holders) {
            self.reserve(plan, scratch, rank, holder);
        }
    }

    fn reserve(
        &self,
        plan: &mut Plan,
        scratch: &mut Scratch,
        rank: &rank::Rank,
        holder: WorkloadId,
    ) {
        let state = rank.state();
        let (cfg, now_ms) = (self.cfg, self.now_ms);
        let w = &state.workloads[&holder];
        // The nodes where it could start soonest, from when each holder gives its GPUs back.
        let mut may_take = may_take_from(state, rank, self.policy, cfg, w.allocation);
        let backoff = Backoff::of(state, cfg);
        // Whether only the GPUs of workloads already leaving have a known return: no running
        // work has an estimate, and the holder may preempt none of the work running.
        // (Borrowed placements count as leaving: the holder may take back those it lent.)
        let only_leaving = state.running_with_estimate == 0
            && (state.unallocated_held_gpus == 0 || may_take(None) == 0)
            && state
                .allocations
                .nodes
                .iter()
                .enumerate()
                .all(|(a, node)| node.held_gpus == 0 || may_take(Some(a as u32)) == 0);
        // A further reservation (not the first) takes the nodes nearest to free now: it drains
        // them for whole-node work, and looking at them alone keeps a pass with several cheap.
        let further = !plan.reservations.is_empty();
        // When a holder gives its GPUs back, and whether by being preempted for this one: the
        // GPUs it lent come back on the borrowing's term and grace.
        let mut release = |hold: &Hold| {
            let eligible = may_take(hold.allocation) > level(hold.preemptions);
            let (at, by_preemption) = release_ms(cfg, eligible, hold, now_ms, backoff);
            match hold.borrowed.filter(|b| b.reserved_for == holder) {
                Some(b) => (at.min(b.until_ms.max(now_ms) + cfg.grace_ms), false),
                None => (at, by_preemption),
            }
        };
        let (nodes, start_at_ms) = scratch.reserve(state, w, now_ms, only_leaving, further, |t| {
            release(&t.hold).0
        });
        // Whether the start counts on preempting some of the nodes' work by then.
        let by_preemption = start_at_ms.is_some_and(|start| {
            nodes.iter().any(|&n| {
                state.cluster.node(n).tenants.iter().any(|t| {
                    let (at, by_preemption) = release(&t.hold);
                    by_preemption
                        && at <= start
                        && t.hold.ends_ms.is_none_or(|end| end.max(now_ms) > start)
                })
            })
        });
        // A gang's reservation lends nothing: its nodes must all be free at once, and taking
        // borrowers back from several nodes cost more work than the idle GPUs they filled (on
        // the year's trace, a fifth of all workloads restarted, for no more GPU-hours delivered).
        if w.nodes == 1 {
            scratch.lend_nodes(&nodes, holder);
        } else {
            scratch.withhold_nodes(&nodes, holder);
        }
        let mut reservation = Reservation::new(state, holder, &nodes, start_at_ms);
        reservation.exact = !by_preemption;
        plan.reservations.push(reservation);
    }
}

/// The decision to start `w` on `parts`, on GPUs lent by a reservation if `borrowed`.
fn start(
    state: &State,
    w: &Workload,
    parts: Vec<crate::state::Part>,
    now_ms: u64,
    cfg: &PolicyConfig,
    cap_ms: u64,
    borrowed: Option<Borrowed>,
) -> Decision {
    // Each preemption doubles the next run's protection, up to the cap: a workload that was
    // stopped pays for it less often the more it has paid.
    let protection = if w.allocation.is_none() {
        0
    } else {
        w.min_runtime_ms
            .unwrap_or(cfg.min_runtime_ms)
            .saturating_mul(1 << w.preemptions.min(16))
            .min(cap_ms)
    };
    Decision::Start {
        workload: w.id,
        placement: parts
            .iter()
            .map(|p| PlacedNode {
                node: state.cluster.node(p.node).name.clone(),
                gpus: (0..64).filter(|g| p.gpus & (1u64 << g) != 0).collect(),
            })
            .collect(),
        protected_until_ms: now_ms + protection,
        borrowed,
    }
}

/// When a GPU is expected back from the holder described by `hold`: the end of a preemption's
/// grace, else its estimated end, or the end of its contract (or of the time unallocated work
/// is left alone) plus grace if the beneficiary may preempt it (`eligible`), whichever is
/// sooner; `u64::MAX` if nothing is known. And whether that is by a preemption still to come.
fn release_ms(
    cfg: &PolicyConfig,
    eligible: bool,
    hold: &Hold,
    now_ms: u64,
    backoff: Backoff,
) -> (u64, bool) {
    if let Some(grace_until_ms) = hold.grace_until_ms {
        return (grace_until_ms.max(now_ms), false);
    }
    let ends = hold.ends_ms.map_or(u64::MAX, |e| e.max(now_ms));
    let preempt = if eligible {
        victims::left_alone_until(hold, backoff).max(now_ms) + cfg.grace_ms
    } else {
        u64::MAX
    };
    if preempt < ends {
        (preempt, true)
    } else {
        (ends, false)
    }
}
