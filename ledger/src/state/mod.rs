//! The state folded from the events, and the fold itself.
//!
//! [`State::apply`] takes the next event of the log with its sequence and either applies it whole
//! or rejects it whole with a [`Rejection`]: the fold is total and deterministic, so every replica
//! that folds the same log reaches the same state. Before an event takes effect the state's clock
//! advances to the event's time and every accumulator (owed, delivered, the metrics) integrates
//! the rates that held since the previous event exactly: between events nothing changes.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::alloc::{AllocId, AllocationTree};
use crate::cluster::{mask_of, Cluster, Hold, NodeIdx, Tenant, GPUS_PER_NODE_MAX};
use crate::event::*;
use crate::metrics::Counters;
use crate::rejection::Rejection;
use crate::window::WindowShape;

mod runs;
mod workloads;

/// A hash map for what grows with the number of workloads (live workloads, recently ended ones,
/// idempotency keys): once full it moves a few entries to its doubled table at each insert,
/// where a standard map would move them all in one insert. At a million live workloads that
/// one insert held the fold, and every acknowledgement waiting on it, for hundreds of
/// milliseconds. Iteration order is a function of the inserts and removals, as with
/// [`FxHashMap`]; nothing in the fold depends on it.
pub type SteppedMap<K, V> = griddle::HashMap<K, V, rustc_hash::FxBuildHasher>;

/// Settings of the fold that are fixed for a deployment.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StateConfig {
    /// Usage lookback for the fair-share ranking.
    pub window_ms: u64,
    /// Buckets the window is kept in.
    pub window_buckets: u32,
    /// The most protection a workload may ask for.
    pub min_runtime_cap_ms: u64,
    /// How far an event's time may lie behind the ledger's before it is rejected; events within
    /// the tolerance take effect at the ledger's time.
    pub clock_skew_tolerance_ms: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            window_ms: 7 * 24 * 3_600_000,
            window_buckets: 168,
            min_runtime_cap_ms: 8 * 3_600_000,
            clock_skew_tolerance_ms: 5_000,
        }
    }
}

/// What a state lends out instead of holding: the workloads that ended and the idempotency keys
/// used. A projection that keeps both in rows of its own lends them back through this, so the
/// state's memory is bounded by live work ([`State::archive_in`]); without one the state holds
/// them all. An archive answers as of a sequence: what it learned after that does not exist
/// yet for the state asking, which may be refolding from an older checkpoint.
pub trait Archive: Send + Sync {
    /// The phase workload `id` ended in, if it ended at or before sequence `as_of`.
    fn ended(&self, id: WorkloadId, as_of: u64) -> Option<Phase>;
    /// The workload the first submission with idempotency key `key` created, if that
    /// submission is at or before sequence `as_of`.
    fn idempotent(&self, key: &str, as_of: u64) -> Option<WorkloadId>;
}

/// The archive a state lends to, if any. Where the ended workloads are kept does not change
/// what the state is, so any two compare equal.
#[derive(Clone, Default)]
struct Lent(Option<std::sync::Arc<dyn Archive>>);

impl PartialEq for Lent {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "archive" } else { "none" })
    }
}

/// Where a workload is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Phase {
    /// Waiting in the queue.
    Pending,
    /// Holding GPUs.
    Running,
    /// Stopped without finishing, waiting to be requeued.
    Stopped,
    /// Ended by itself (terminal).
    Finished,
    /// Withdrawn (terminal).
    Cancelled,
}

impl Phase {
    /// Lower-case name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Pending => "pending",
            Phase::Running => "running",
            Phase::Stopped => "stopped",
            Phase::Finished => "finished",
            Phase::Cancelled => "cancelled",
        }
    }

    /// The phase [`Phase::name`] names.
    pub fn of_name(name: &str) -> Option<Phase> {
        [
            Phase::Pending,
            Phase::Running,
            Phase::Stopped,
            Phase::Finished,
            Phase::Cancelled,
        ]
        .into_iter()
        .find(|p| p.name() == name)
    }
}

/// GPUs of one node held by a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Part {
    /// The node.
    pub node: NodeIdx,
    /// The GPUs, as a mask.
    pub gpus: u64,
}

/// A preemption in progress.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Preempting {
    /// When it was asked.
    pub requested_at_ms: u64,
    /// The GPUs are taken at this time.
    pub grace_until_ms: u64,
    /// Why.
    pub reason: PreemptionReason,
    /// For whom.
    pub beneficiary: Option<WorkloadId>,
}

/// A live workload.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    /// Its id.
    pub id: WorkloadId,
    /// The leaf charged, `None` for unallocated work.
    pub allocation: Option<AllocId>,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Nodes in the gang.
    pub nodes: u32,
    /// Required model, as an index into the cluster's models.
    pub model: Option<u32>,
    /// Order within the allocation, higher first.
    pub priority: i32,
    /// Protection asked for, if less than the default.
    pub min_runtime_ms: Option<u64>,
    /// Expected total run time.
    pub duration_estimate_ms: Option<u64>,
    /// It had an estimate and outlasted it: the estimate is relied on no more (a placeholder
    /// without a command has then done what it asked for).
    pub estimate_outlasted: bool,
    /// Checkpoint interval.
    pub checkpoint_ms: Option<u64>,
    /// Submission time.
    pub submitted_at_ms: u64,
    /// Sequence of the submission: the tie-break of every queue order.
    pub submit_seq: u64,
    /// Phase.
    pub phase: Phase,
    /// GPUs held while running.
    pub placement: Vec<Part>,
    /// Start of the current run.
    pub started_at_ms: u64,
    /// End of the current run's protection.
    pub protected_until_ms: u64,
    /// A preemption in progress.
    pub preempting: Option<Preempting>,
    /// While running on GPUs lent from a reservation: its terms.
    pub borrowed: Option<Borrowed>,
    /// Run time of completed runs, less work lost at requeues.
    pub work_done_ms: u64,
    /// Runs started.
    pub starts: u32,
    /// Times it was asked to stop for someone else or for its hardware (every preemption
    /// request but its owner's cancel): what the scheduler weighs before preempting it again.
    pub preemptions: u32,
    /// Who submitted it: an index into the state's table of actors ([`State::submitter`] reads it).
    pub submitted_by: u32,
    /// While stopped: the nodes its last run held, whose agents may report its requeue.
    pub stopped_on: Vec<NodeIdx>,
}

impl Workload {
    /// GPUs it needs (and holds while running).
    pub fn gpus(&self) -> u64 {
        u64::from(self.gpus_per_node) * u64::from(self.nodes)
    }

    /// How long a run without a command holds its GPUs from its start, as a placeholder would:
    /// what is left of the estimate; nothing once a run outlasted it (it has done what it asked
    /// for); `None`, for ever, without an estimate.
    pub fn placeholder_ms(&self) -> Option<u64> {
        match self.remaining_estimate_ms(self.started_at_ms) {
            None if self.estimate_outlasted => Some(0),
            left => left,
        }
    }

    /// Work still to do if the estimate is right, as of `now_ms`.
    pub fn remaining_estimate_ms(&self, now_ms: u64) -> Option<u64> {
        let done = self.work_done_ms
            + if self.phase == Phase::Running {
                now_ms.saturating_sub(self.started_at_ms)
            } else {
                0
            };
        self.duration_estimate_ms.map(|d| d.saturating_sub(done))
    }
}

/// The key a leaf's queue is ordered by: priority (higher first), then submission.
pub type QueueKey = (std::cmp::Reverse<i32>, u64, WorkloadId);

/// Running workloads that no preemption is under way for, by the end of their contract, kept by
/// the fold so a scheduling pass reads what it may preempt without sweeping the running work.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Contracts {
    /// Allocated work of each leaf: (protected until, workload).
    pub allocated: std::collections::BTreeMap<AllocId, BTreeSet<(u64, WorkloadId)>>,
    /// Unallocated work, never protected.
    pub unallocated: BTreeSet<WorkloadId>,
}

impl Contracts {
    fn insert(&mut self, w: &Workload) {
        match w.allocation {
            Some(a) => {
                self.allocated
                    .entry(a)
                    .or_default()
                    .insert((w.protected_until_ms, w.id));
            }
            None => {
                self.unallocated.insert(w.id);
            }
        }
    }

    fn remove(&mut self, w: &Workload) {
        match w.allocation {
            Some(a) => {
                if let Some(set) = self.allocated.get_mut(&a) {
                    set.remove(&(w.protected_until_ms, w.id));
                    if set.is_empty() {
                        self.allocated.remove(&a);
                    }
                }
            }
            None => {
                self.unallocated.remove(&w.id);
            }
        }
    }

    /// The allocations (`None`: unallocated) holding work whose contract has ended at `now_ms`,
    /// in order.
    pub fn preemptible_allocations(&self, now_ms: u64) -> Vec<Option<AllocId>> {
        let unallocated = (!self.unallocated.is_empty()).then_some(None);
        unallocated
            .into_iter()
            .chain(
                self.allocated
                    .iter()
                    .filter(|(_, set)| set.first().is_some_and(|&(until, _)| until <= now_ms))
                    .map(|(&a, _)| Some(a)),
            )
            .collect()
    }
}

/// The answer of [`State::apply`].
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The event took effect.
    Applied,
    /// A submission whose idempotency key was already used: the original workload stands.
    Duplicate {
        /// The workload created by the first submission with that key.
        original: WorkloadId,
    },
    /// The event broke a rule and changed nothing but the sequence and clock.
    Rejected(Rejection),
}

/// Everything the ledger knows, folded from the events.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct State {
    /// The configuration this state was made with: what holds until the log sets its own.
    base_config: StateConfig,
    /// The configuration in force.
    config: StateConfig,
    /// The settings in force: the last `settings_set` applied, else the defaults that
    /// `config` was given with.
    settings: crate::settings::Settings,
    /// The sequence of the last `settings_set` applied (0: none, the folder's defaults hold).
    settings_seq: u64,
    shape: WindowShape,
    /// Last applied sequence (0 before the first event).
    pub(crate) last_seq: u64,
    /// The sequence of the last `WorkloadStarted` event folded, applied or rejected (0 before
    /// the first). Schedulers fence their decisions on it: only another placement can make a
    /// placement unsafe, so submissions arriving meanwhile do not stop decisions from landing.
    pub(crate) last_start_seq: u64,
    /// The sequence of the last `SettingsSet` folded, applied or rejected (0 before the first):
    /// what a change of settings is fenced on.
    last_settings_event_seq: u64,
    /// The ledger's clock: the time of the latest event applied.
    pub(crate) now_ms: u64,
    /// The allocation tree.
    pub(crate) allocations: AllocationTree,
    /// Nodes and GPUs.
    pub(crate) cluster: Cluster,
    /// Live workloads (pending, running, stopped).
    pub(crate) workloads: SteppedMap<WorkloadId, Workload>,
    /// Phase of every workload that ended, so late events are rejected with the right reason
    /// (with an archive, only those that ended after `archived_through`).
    pub(crate) ended: SteppedMap<WorkloadId, Phase>,
    /// Idempotency keys seen, with the workload each created (with an archive, only those
    /// used after `archived_through`).
    pub(crate) idempotency: SteppedMap<String, WorkloadId>,
    /// The last sequence whose ended workloads and keys the archive holds.
    archived_through: u64,
    #[serde(skip)]
    archive: Lent,
    /// Pending workloads of each leaf, in queue order.
    pub(crate) queues: FxHashMap<AllocId, BTreeSet<QueueKey>>,
    /// Pending unallocated workloads, in queue order.
    pub(crate) unallocated_queue: BTreeSet<QueueKey>,
    /// How many pending workloads ask for each shape: (GPUs per node, nodes).
    pub(crate) pending_shapes: std::collections::BTreeMap<(u32, u32), u32>,
    /// Each leaf's queue split by shape, for the leaves with pending work.
    pub(crate) queue_shapes:
        FxHashMap<AllocId, std::collections::BTreeMap<(u32, u32), BTreeSet<QueueKey>>>,
    /// Pending workloads with a duration estimate (the only ones that may backfill).
    pub(crate) pending_with_estimate: u64,
    /// Pending workloads of each submitter (by [`Workload::submitted_by`]): what its cap on
    /// waiting work counts.
    #[serde(default)]
    pub(crate) pending_by_actor: FxHashMap<u32, u32>,
    /// GPUs the pending workloads of each leaf ask for: what its quotas count.
    #[serde(default)]
    pub(crate) pending_gpus: FxHashMap<AllocId, u64>,
    /// Running workloads with a duration estimate (whose GPUs have a known return even if no
    /// one may preempt them).
    pub(crate) running_with_estimate: u64,
    /// Running workloads, by id (ordered, so iteration is deterministic).
    pub(crate) running: BTreeSet<WorkloadId>,
    /// Running workloads no preemption is under way for, by the end of their contract.
    pub(crate) contracts: Contracts,
    /// Running workloads with a preemption under way.
    pub(crate) preempting: BTreeSet<WorkloadId>,
    /// Running workloads on borrowed GPUs (see [`Workload::borrowed`]) and not leaving, by the
    /// reservation that lent them, then the borrowing's term, with each node they hold: a
    /// reservation's holder finds its own borrowers whose term is over without looking
    /// workloads up.
    pub(crate) lent: BTreeSet<(WorkloadId, u64, crate::cluster::NodeIdx, WorkloadId)>,
    /// Each node holding work that is leaving or on borrowed GPUs, with how many such holds
    /// (one per workload and reason) it has: what a reservation times first.
    pub(crate) leaving_nodes: std::collections::BTreeMap<crate::cluster::NodeIdx, u32>,
    /// GPUs held by running unallocated workloads (healthy or not).
    pub(crate) unallocated_held_gpus: u64,
    /// Healthy GPUs held by running unallocated workloads.
    pub(crate) unallocated_delivering_gpus: u64,
    /// For each (beneficiary, victim) pair of allocations, when the beneficiary's work last
    /// preempted the victim's for fair share: what hysteresis in time reads.
    pub(crate) fair_share_last: std::collections::BTreeMap<(AllocId, AllocId), u64>,
    /// Accumulators for the cluster metrics.
    pub(crate) counters: Counters,
    /// Rejections by rule code.
    pub(crate) rejections: std::collections::BTreeMap<String, u64>,
    /// The live principals: who may do what.
    pub(crate) principals: crate::identity::Principals,
    /// Every actor that submitted a workload, in order of first submission
    /// ([`Workload::submitted_by`] indexes it).
    pub(crate) actors: Vec<String>,
    actor_ids: FxHashMap<String, u32>,
    owed_stale: bool,
}

impl State {
    /// An empty ledger.
    pub fn new(config: StateConfig) -> Self {
        State {
            shape: WindowShape::new(config.window_ms, config.window_buckets),
            settings: crate::settings::Settings::from_configs(
                &config,
                &crate::policy::PolicyConfig::default(),
                crate::health::DEFAULT_TIMEOUT_MS,
            ),
            settings_seq: 0,
            base_config: config,
            config,
            last_seq: 0,
            last_start_seq: 0,
            last_settings_event_seq: 0,
            now_ms: 0,
            allocations: AllocationTree::default(),
            cluster: Cluster::default(),
            workloads: SteppedMap::default(),
            ended: SteppedMap::default(),
            idempotency: SteppedMap::default(),
            archived_through: 0,
            archive: Lent(None),
            queues: FxHashMap::default(),
            unallocated_queue: BTreeSet::new(),
            pending_shapes: std::collections::BTreeMap::new(),
            queue_shapes: FxHashMap::default(),
            pending_with_estimate: 0,
            pending_by_actor: FxHashMap::default(),
            pending_gpus: FxHashMap::default(),
            running_with_estimate: 0,
            running: BTreeSet::new(),
            contracts: Contracts::default(),
            preempting: BTreeSet::new(),
            lent: BTreeSet::new(),
            leaving_nodes: std::collections::BTreeMap::new(),
            unallocated_held_gpus: 0,
            unallocated_delivering_gpus: 0,
            fair_share_last: std::collections::BTreeMap::new(),
            counters: Counters::default(),
            rejections: std::collections::BTreeMap::new(),
            principals: crate::identity::Principals::default(),
            actors: Vec::new(),
            actor_ids: FxHashMap::default(),
            owed_stale: false,
        }
    }

    /// The sequence of the last event folded, applied or rejected (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The sequence of the last `WorkloadStarted` folded, applied or rejected (0 before the
    /// first). Schedulers fence their decisions on it: only another placement can make a
    /// placement unsafe, so submissions arriving meanwhile do not stop decisions from landing.
    pub fn last_start_seq(&self) -> u64 {
        self.last_start_seq
    }

    /// The sequence of the last `SettingsSet` folded, applied or rejected (0 before the
    /// first). A change of settings made from these is fenced on it, so that two changes made
    /// from the same settings cannot both land, the second undoing the first.
    pub fn last_settings_event_seq(&self) -> u64 {
        self.last_settings_event_seq
    }

    /// The ledger's clock: the time of the latest event folded (never goes back).
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Free healthy GPUs some pending workload could start on now, were nothing reserved: on the
    /// nodes of each model with at least as many free GPUs as the smallest pending shape that
    /// fits there (GPUs per node, and enough such nodes for its gang). After a scheduling pass
    /// these are the GPUs left idle while fitting work waits (held for a reservation or a
    /// preemption under way, or work at its allocation's cap). A model a workload requires is
    /// not told apart.
    pub fn idle_gpus_fitting_pending(&self) -> u64 {
        if self.pending_shapes.is_empty() {
            return 0;
        }
        let mut idle = 0;
        // Per model, nodes and free GPUs on nodes with at least `k` free; the smallest fitting
        // shape (shapes come in order of GPUs per node) tells from which `k` they count.
        // (A node has at most 64 GPUs, so `free_hist` at most 65 entries.)
        for g in &self.cluster.models {
            let (mut nodes_from, mut gpus_from) = ([0u64; 66], [0u64; 66]);
            for (k, &n) in g.free_hist.iter().enumerate().skip(1).rev() {
                nodes_from[k] = nodes_from[k + 1] + u64::from(n);
                gpus_from[k] = gpus_from[k + 1] + k as u64 * u64::from(n);
            }
            idle += self
                .pending_shapes
                .keys()
                .take_while(|&&(k, _)| (k as usize) < g.free_hist.len())
                .find(|&&(k, count)| k > 0 && u64::from(count) <= nodes_from[k as usize])
                .map_or(0, |&(k, _)| gpus_from[k as usize]);
        }
        idle
    }

    /// The allocation tree as it stands, removed allocations kept for their history.
    pub fn allocations(&self) -> &AllocationTree {
        &self.allocations
    }

    /// Nodes and their GPUs, with health, drains and holders.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Live workloads (pending, running, stopped) by id; see [`State::ended_phase`] for the
    /// others.
    pub fn workloads(&self) -> &SteppedMap<WorkloadId, Workload> {
        &self.workloads
    }

    /// The ended workloads the state holds, with the phase each ended in: every one when it
    /// lends to no archive, else those that ended since it last lent them
    /// ([`State::ended_phase`] looks in both).
    pub fn ended(&self) -> &SteppedMap<WorkloadId, Phase> {
        &self.ended
    }

    /// The phase workload `id` ended in, if it ended.
    pub fn ended_phase(&self, id: WorkloadId) -> Option<Phase> {
        self.ended
            .get(&id)
            .copied()
            .or_else(|| self.archive.0.as_ref()?.ended(id, self.archived_through))
    }

    /// The workload the first submission with idempotency key `key` created, if any.
    pub fn idempotent(&self, key: &str) -> Option<WorkloadId> {
        self.idempotency.get(key).copied().or_else(|| {
            self.archive
                .0
                .as_ref()?
                .idempotent(key, self.archived_through)
        })
    }

    /// Lends ended workloads and used idempotency keys to `archive` from now on: after each
    /// [`State::archived`] the state forgets those the archive then holds, and asks it for
    /// them. A state restored from a checkpoint lends to none until told again.
    pub fn archive_in(&mut self, archive: std::sync::Arc<dyn Archive>) {
        self.archive = Lent(Some(archive));
    }

    /// Tells the state that its archive now holds every workload that ended and every key used
    /// up to its last sequence, so it may forget them. Without an archive it keeps them.
    pub fn archived(&mut self) {
        if self.archive.0.is_some() {
            self.archived_through = self.last_seq;
            // Dropped, not cleared: a refold may have grown them large.
            self.ended = SteppedMap::default();
            self.idempotency = SteppedMap::default();
        }
    }

    /// Running workloads, by id (ordered, so iteration is deterministic).
    pub fn running(&self) -> &BTreeSet<WorkloadId> {
        &self.running
    }

    /// Running workloads with a preemption under way, by id.
    pub fn preempting(&self) -> &BTreeSet<WorkloadId> {
        &self.preempting
    }

    /// When work of allocation `beneficiary` last preempted work of allocation `victim` for fair
    /// share, if ever.
    pub fn fair_share_last(&self, beneficiary: AllocId, victim: AllocId) -> Option<u64> {
        self.fair_share_last.get(&(beneficiary, victim)).copied()
    }

    /// Accumulators of the cluster metrics since the ledger began.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Events rejected so far, by rule code.
    pub fn rejections(&self) -> &std::collections::BTreeMap<String, u64> {
        &self.rejections
    }

    /// The live principals: who may do what.
    pub fn principals(&self) -> &crate::identity::Principals {
        &self.principals
    }

    /// This state with the marks a rejected event leaves, taken from `after`: its sequences and
    /// rejection counts. A rejection changes nothing else but the clock (which the caller
    /// advances where the rule says), so `before.with_rejection_marks_of(&after)` (clock
    /// advanced) equals `after` when every event between them was rejected.
    pub fn with_rejection_marks_of(&self, after: &State) -> State {
        State {
            last_seq: after.last_seq,
            last_start_seq: after.last_start_seq,
            last_settings_event_seq: after.last_settings_event_seq,
            rejections: after.rejections.clone(),
            ..self.clone()
        }
    }

    /// The running workloads, in no particular order: by id lookups when few of the workloads
    /// run, by a sweep of all of them when most do (a sweep is cheaper than lookups).
    pub fn running_workloads(&self) -> Box<dyn Iterator<Item = &Workload> + '_> {
        if self.running.len() * 6 < self.workloads.len() {
            Box::new(self.running.iter().map(|id| &self.workloads[id]))
        } else {
            Box::new(
                self.workloads
                    .values()
                    .filter(|w| w.phase == Phase::Running),
            )
        }
    }

    /// The fold's configuration in force (the log's settings, once it sets them).
    pub fn config(&self) -> &StateConfig {
        &self.config
    }

    /// The configuration this state was made with, whatever the log has set since: what a
    /// fresh state must be made with to fold the same log to the same state.
    pub fn base_config(&self) -> &StateConfig {
        &self.base_config
    }

    /// The settings in force: the last `settings_set` applied, else the defaults this state
    /// was made with.
    pub fn settings(&self) -> &crate::settings::Settings {
        &self.settings
    }

    /// The sequence of the last `settings_set` applied; 0 when the log has none yet, and the
    /// folder's own configuration holds.
    pub fn settings_seq(&self) -> u64 {
        self.settings_seq
    }

    /// The scheduler's configuration as the log sets it: the settings in force over `local`
    /// (only `local` while the log sets none).
    pub fn policy_config(
        &self,
        local: &crate::policy::PolicyConfig,
    ) -> crate::policy::PolicyConfig {
        if self.settings_seq == 0 {
            local.clone()
        } else {
            self.settings.policy_config(local)
        }
    }

    /// Whether `settings` may follow the ones in force (the fold's check of a `settings_set`).
    fn check_settings(&self, settings: &crate::settings::Settings) -> Result<(), Rejection> {
        settings.check()?;
        let shape = WindowShape::new(settings.window_s * 1000, settings.window_buckets);
        if shape != self.shape && !self.allocations.nodes.is_empty() {
            return Err(Rejection::WindowFixed {
                window_s: self.config.window_ms / 1000,
                window_buckets: self.config.window_buckets,
            });
        }
        Ok(())
    }

    fn settings_set(
        &mut self,
        seq: u64,
        settings: &crate::settings::Settings,
    ) -> Result<Outcome, Rejection> {
        self.check_settings(settings)?;
        self.config = settings.state_config();
        self.shape = WindowShape::new(self.config.window_ms, self.config.window_buckets);
        self.settings = settings.clone();
        self.settings_seq = seq;
        Ok(Outcome::Applied)
    }

    /// The shape of the usage windows.
    pub fn window_shape(&self) -> WindowShape {
        self.shape
    }

    /// The rule the fold would apply to `env` if it were the next event, changing nothing:
    /// `Ok` when it would be applied (or answered as a duplicate). Writers call it to refuse a
    /// request before appending it; an event folded in between can still change the verdict,
    /// and then the fold's rejection stands in the ledger. Unlike the fold, which folds every
    /// schema version since [`OLDEST_SCHEMA_VERSION`], it accepts only [`SCHEMA_VERSION`]: what is
    /// written now is written in the current version.
    pub fn check(&self, env: &Envelope) -> Result<(), Rejection> {
        if env.occurred_at_ms + self.config.clock_skew_tolerance_ms < self.now_ms {
            return Err(Rejection::TimeWentBackwards {
                occurred_at_ms: env.occurred_at_ms,
                now_ms: self.now_ms,
                tolerance_ms: self.config.clock_skew_tolerance_ms,
            });
        }
        if env.schema_version != SCHEMA_VERSION {
            return Err(Rejection::UnsupportedSchemaVersion {
                version: env.schema_version,
                supported: SCHEMA_VERSION,
            });
        }
        self.authorize(env)?;
        let now = self.now_ms.max(env.occurred_at_ms);
        match &env.event {
            Event::AllocationSet(e) => {
                self.allocations
                    .check_set(env.schema_version, &e.path, e.weight)
            }
            Event::AllocationRemoved(e) => self.allocations.check_remove(&e.path).map(drop),
            Event::NodeRegistered(e) => self.check_node_registered(env.schema_version, e).map(drop),
            Event::GpuHeartbeat(e) => self.check_heartbeat(e).map_err(|(_, r)| r),
            Event::GpuHealthChanged(e) => self.gpu_of(&e.node, e.gpu).map(drop),
            Event::NodeDrained(e) => self.check_drained(env.schema_version, e).map(drop),
            Event::NodeResumed(e) => self.node_idx(&e.node).map(drop),
            Event::WorkloadSubmitted(e) => self
                .check_submitted(env.schema_version, e, &env.actor)
                .map(drop),
            Event::WorkloadCancelled(e) => self.check_cancelled(e).map(drop),
            Event::WorkloadStarted(e) => self.check_started(e, now).map(drop),
            Event::PreemptionRequested(e) => self.check_preemption(e, now),
            Event::WorkloadStopped(e) => self.expect_phase(e.workload, Phase::Running).map(drop),
            Event::WorkloadFinished(e) => self.expect_phase(e.workload, Phase::Running).map(drop),
            Event::WorkloadRequeued(e) => self.expect_phase(e.workload, Phase::Stopped).map(drop),
            Event::PrincipalGranted(e) => self.check_granted(e, &env.actor),
            Event::SettingsSet(e) => self.check_settings(e),
            Event::PrincipalRevoked(e) => self.principals.check_revoke(env.schema_version, &e.name),
        }
    }

    /// Applies the event at `seq`: all of it, or nothing but a recorded rejection.
    pub fn apply(&mut self, seq: u64, env: &Envelope) -> Outcome {
        if seq <= self.last_seq {
            // Not recorded as applied: the sequence is not ours to advance.
            return self.reject(Rejection::SequenceNotIncreasing {
                seq,
                last: self.last_seq,
            });
        }
        self.last_seq = seq;
        match env.event {
            Event::WorkloadStarted(_) => self.last_start_seq = seq,
            Event::SettingsSet(_) => self.last_settings_event_seq = seq,
            _ => {}
        }
        if env.occurred_at_ms + self.config.clock_skew_tolerance_ms < self.now_ms {
            return self.reject(Rejection::TimeWentBackwards {
                occurred_at_ms: env.occurred_at_ms,
                now_ms: self.now_ms,
                tolerance_ms: self.config.clock_skew_tolerance_ms,
            });
        }
        self.advance_to(env.occurred_at_ms);
        if !(OLDEST_SCHEMA_VERSION..=SCHEMA_VERSION).contains(&env.schema_version) {
            return self.reject(Rejection::UnsupportedSchemaVersion {
                version: env.schema_version,
                supported: SCHEMA_VERSION,
            });
        }
        if let Err(r) = self.authorize(env) {
            return self.reject(r);
        }
        let result = match &env.event {
            Event::AllocationSet(e) => self.allocation_set(seq, env.schema_version, e),
            Event::AllocationRemoved(e) => self.allocation_removed(e),
            Event::NodeRegistered(e) => self.node_registered(env.schema_version, e),
            Event::GpuHeartbeat(e) => self.gpu_heartbeat(env.schema_version, e),
            Event::GpuHealthChanged(e) => self.gpu_health_changed(e),
            Event::NodeDrained(e) => self
                .check_drained(env.schema_version, e)
                .and_then(|_| self.node_draining(&e.node, true)),
            Event::NodeResumed(e) => self.node_draining(&e.node, false),
            Event::WorkloadSubmitted(e) => {
                self.workload_submitted(seq, env.schema_version, e, &env.actor)
            }
            Event::WorkloadCancelled(e) => self.workload_cancelled(e),
            Event::WorkloadStarted(e) => self.workload_started(e),
            Event::PreemptionRequested(e) => self.preemption_requested(e),
            Event::WorkloadStopped(e) => self.workload_stopped(env.schema_version, e),
            Event::WorkloadFinished(e) => self.workload_finished(e),
            Event::WorkloadRequeued(e) => self.workload_requeued(e),
            Event::PrincipalGranted(e) => self.principal_granted(seq, e, &env.actor),
            Event::PrincipalRevoked(e) => self
                .principals
                .revoke(env.schema_version, &e.name)
                .map(|()| Outcome::Applied),
            Event::SettingsSet(e) => self.settings_set(seq, e),
        };
        match result {
            Ok(outcome) => outcome,
            Err(r) => self.reject(r),
        }
    }

    fn reject(&mut self, r: Rejection) -> Outcome {
        *self.rejections.entry(r.code().to_owned()).or_insert(0) += 1;
        Outcome::Rejected(r)
    }

    /// Moves the clock forward to `t_ms`, integrating every rate over the gap. Earlier times are
    /// ignored. Use it to read figures at a time after the last event (the end of a period).
    pub fn advance_to(&mut self, t_ms: u64) {
        if t_ms <= self.now_ms {
            return;
        }
        if self.owed_stale {
            self.allocations
                .split_owed(self.cluster.healthy_gpus as f64);
            self.owed_stale = false;
        }
        let (from, dt) = (self.now_ms, t_ms - self.now_ms);
        self.counters.integrate(&self.cluster, dt);
        self.counters.unallocated_delivered_gpu_ms += self.unallocated_delivering_gpus * dt;
        let dtf = dt as f64;
        let bucket = self.shape.bucket_of(from);
        let one_bucket = bucket == self.shape.bucket_of(t_ms - 1);
        let slot = (bucket % u64::from(self.shape.bucket_count)) as usize;
        for a in self.allocations.nodes.iter_mut() {
            if a.removed || !a.is_leaf() || (a.delivering_gpus == 0 && a.owed_gpus == 0.0) {
                continue;
            }
            let delivering = a.delivering_gpus as f64;
            a.delivered_gpu_ms += a.delivering_gpus * dt;
            a.owed_gpu_ms += a.owed_gpus * dtf;
            let within = delivering.min(a.owed_gpus) * dtf;
            a.within_share_gpu_ms += within;
            self.counters.within_share_gpu_ms += within;
            if one_bucket {
                let (d, o) = (delivering * dtf, a.owed_gpus * dtf);
                a.window.add_to_bucket(self.shape, bucket, slot, d, o);
            } else {
                a.window
                    .add(self.shape, from, t_ms, delivering, a.owed_gpus);
            }
        }
        self.now_ms = t_ms;
    }

    /// Who submitted `w`: the actor of its submission (`user:alice`).
    pub fn submitter(&self, w: &Workload) -> &str {
        self.actors
            .get(w.submitted_by as usize)
            .map_or("", String::as_str)
    }

    /// The path of the allocation workload `w` is charged to; `None` for unallocated work.
    pub fn allocation_path(&self, w: &Workload) -> Option<&str> {
        w.allocation.map(|a| self.allocations.node(a).path.as_str())
    }

    /// The allocation path of the workload `event` is about, for its subject; `None` for
    /// unallocated work, unknown workloads and events about no workload.
    pub fn allocation_of(&self, event: &Event) -> Option<&str> {
        let w = self.workloads.get(&event.workload()?)?;
        self.allocation_path(w)
    }

    /// What a node agent reports when the grace period of running workload `id` ends at
    /// `now_ms`: `WorkloadStopped` (cancelled by its owner, a hardware failure if its GPUs really
    /// failed, preempted otherwise), then, unless cancelled, `WorkloadRequeued` with the work
    /// since its last checkpoint lost. Empty when `id` is not running.
    pub fn grace_end_reports(&self, id: WorkloadId, now_ms: u64) -> Vec<Event> {
        let Some(w) = self
            .workloads
            .get(&id)
            .filter(|w| w.phase == Phase::Running)
        else {
            return Vec::new();
        };
        let hardware = w
            .placement
            .iter()
            .any(|p| p.gpus & !self.cluster.node(p.node).healthy != 0);
        let reason = match w.preempting.map(|p| p.reason) {
            Some(PreemptionReason::UserCancelled) => StopReason::Cancelled,
            Some(PreemptionReason::HardwareFailure) if hardware => StopReason::HardwareFailure,
            _ => StopReason::Preempted,
        };
        let mut out = vec![Event::WorkloadStopped(WorkloadStopped {
            workload: id,
            reason,
        })];
        if reason != StopReason::Cancelled {
            let ran = now_ms.saturating_sub(w.started_at_ms);
            let lost_s = w
                .checkpoint_ms
                .filter(|&c| c > 0)
                .map_or(0, |c| (ran % c) / 1000);
            out.push(Event::WorkloadRequeued(WorkloadRequeued {
                workload: id,
                work_lost_s: lost_s,
            }));
        }
        out
    }

    /// Owed GPUs of every allocation now, indexed by allocation id, even when events since the
    /// last change of time have not yet been folded into the stored split.
    pub fn owed_now(&self) -> Vec<f64> {
        if self.owed_stale {
            self.allocations
                .owed_split(self.cluster.healthy_gpus as f64)
        } else {
            self.allocations.nodes.iter().map(|a| a.owed_gpus).collect()
        }
    }

    // ---- allocations -------------------------------------------------------------------------

    fn allocation_set(
        &mut self,
        seq: u64,
        version: u16,
        e: &AllocationSet,
    ) -> Result<Outcome, Rejection> {
        self.allocations.check_set(version, &e.path, e.weight)?;
        // Quotas are set from schema 4 on (a field an earlier event could not have meant).
        let quotas = if version >= 4 {
            (e.max_pending_workloads, e.max_pending_gpus)
        } else {
            (None, None)
        };
        self.allocations
            .set(self.shape, seq, &e.path, e.weight, e.max_gpus, quotas);
        self.owed_stale = true;
        Ok(Outcome::Applied)
    }

    fn allocation_removed(&mut self, e: &AllocationRemoved) -> Result<Outcome, Rejection> {
        let id = self.allocations.check_remove(&e.path)?;
        self.allocations.remove(id);
        self.queues.remove(&id);
        self.owed_stale = true;
        Ok(Outcome::Applied)
    }

    // ---- nodes and GPUs ----------------------------------------------------------------------

    /// Checks a registration from an event of `version`: `true` when it repeats the node's (an
    /// agent re-registering after a restart). Names are checked from version 2 on.
    fn check_node_registered(&self, version: u16, e: &NodeRegistered) -> Result<bool, Rejection> {
        if version >= 2 {
            crate::names::node(&e.node).map_err(|reason| Rejection::InvalidField {
                field: "node",
                reason,
            })?;
            crate::names::model(&e.model)?;
            crate::names::labels(&e.labels)?;
        }
        if e.gpus == 0 {
            return Err(Rejection::MustBePositive { field: "gpus" });
        }
        if e.gpus > GPUS_PER_NODE_MAX {
            return Err(Rejection::TooManyGpusOnNode {
                gpus: e.gpus,
                max: GPUS_PER_NODE_MAX,
            });
        }
        if let Some(idx) = self.cluster.get(&e.node) {
            let n = self.cluster.node(idx);
            if n.gpu_count == e.gpus && n.model == e.model {
                return Ok(true);
            }
            return Err(Rejection::NodeAlreadyRegistered {
                node: e.node.clone(),
                gpus: n.gpu_count,
                model: n.model.clone(),
            });
        }
        Ok(false)
    }

    fn node_registered(&mut self, version: u16, e: &NodeRegistered) -> Result<Outcome, Rejection> {
        if self.check_node_registered(version, e)? {
            return Ok(Outcome::Applied);
        }
        self.cluster
            .register(&e.node, e.gpus, &e.model, e.labels.clone());
        self.owed_stale = true;
        Ok(Outcome::Applied)
    }

    /// Checks a drain from an event of `version`: the node exists, and from version 2 on its
    /// reason is text fit to show.
    fn check_drained(&self, version: u16, e: &NodeDrained) -> Result<NodeIdx, Rejection> {
        if let (Some(reason), 2..) = (&e.reason, version) {
            crate::names::note("reason", reason, crate::names::REASON_MAX)?;
        }
        self.node_idx(&e.node)
    }

    /// The registered node named `node`.
    fn node_idx(&self, node: &str) -> Result<NodeIdx, Rejection> {
        self.cluster
            .get(node)
            .ok_or_else(|| Rejection::UnknownNode {
                node: node.to_string(),
            })
    }

    fn gpu_of(&self, node: &str, gpu: u32) -> Result<NodeIdx, Rejection> {
        let idx = self.node_idx(node)?;
        if gpu >= self.cluster.node(idx).gpu_count {
            return Err(Rejection::UnknownGpu {
                node: node.to_string(),
                gpu,
            });
        }
        Ok(idx)
    }

    /// The ledger's one judgment of a heartbeat from a node, wherever it arrives (the API, the
    /// health monitor, the fold): the node registered, each reading of one of its own GPUs,
    /// its utilization a percentage. The first reading at fault, with its index.
    pub fn check_heartbeat(&self, e: &GpuHeartbeat) -> Result<(), (usize, Rejection)> {
        self.node_idx(&e.node).map_err(|r| (0, r))?;
        for (i, r) in e.readings.iter().enumerate() {
            self.check_reading(&e.node, r)
                .map_err(|rejection| (i, rejection))?;
        }
        Ok(())
    }

    /// [`State::check_heartbeat`] for one reading from `node`.
    pub fn check_reading(&self, node: &str, r: &crate::event::GpuReading) -> Result<(), Rejection> {
        self.gpu_of(node, r.gpu)?;
        if r.utilization_pct > 100 {
            return Err(Rejection::InvalidField {
                field: "utilization_pct",
                reason: format!("{} is not a percentage: 0 to 100", r.utilization_pct),
            });
        }
        Ok(())
    }

    fn gpu_heartbeat(&mut self, version: u16, e: &GpuHeartbeat) -> Result<Outcome, Rejection> {
        // Before schema version 5 only the GPUs were checked, and a utilization over 100 was
        // folded as 100.
        if version >= 5 {
            self.check_heartbeat(e).map_err(|(_, r)| r)?;
        } else {
            for r in &e.readings {
                self.gpu_of(&e.node, r.gpu)?;
            }
        }
        if e.readings.is_empty() {
            return Ok(Outcome::Applied);
        }
        let idx = self.node_idx(&e.node)?;
        self.cluster.update(idx, |n| {
            for r in &e.readings {
                n.utilization_pct[r.gpu as usize] = r.utilization_pct.min(100);
            }
        });
        Ok(Outcome::Applied)
    }

    fn node_draining(&mut self, node: &str, draining: bool) -> Result<Outcome, Rejection> {
        let idx = self.node_idx(node)?;
        // Draining a drained node, or resuming one that takes work, is a no-op.
        self.cluster.update(idx, |n| n.draining = draining);
        Ok(Outcome::Applied)
    }

    fn gpu_health_changed(&mut self, e: &GpuHealthChanged) -> Result<Outcome, Rejection> {
        let idx = self.gpu_of(&e.node, e.gpu)?;
        let bit = 1u64 << e.gpu;
        let node = self.cluster.node(idx);
        if (node.healthy & bit != 0) == e.healthy {
            return Ok(Outcome::Applied); // already so
        }
        if let Some(holder) = node.holder(e.gpu) {
            let alloc = self.workloads[&holder].allocation;
            self.adjust_delivering(alloc, if e.healthy { 1 } else { -1 });
        }
        self.cluster.update(idx, |n| {
            if e.healthy {
                n.healthy |= bit;
            } else {
                n.healthy &= !bit;
            }
        });
        self.owed_stale = true;
        Ok(Outcome::Applied)
    }

    /// Changes a leaf's demand, keeping the owed split fresh when only the path to the top is
    /// affected, and marking it stale otherwise.
    fn change_demand(&mut self, leaf: AllocId, delta: i64) {
        let capacity = self.cluster.healthy_gpus as f64;
        let fresh = self
            .allocations
            .change_demand(leaf, delta, capacity, !self.owed_stale);
        self.owed_stale = !fresh;
    }

    fn adjust_delivering(&mut self, alloc: Option<AllocId>, delta: i64) {
        let slot = match alloc {
            Some(a) => &mut self.allocations.node_mut(a).delivering_gpus,
            None => &mut self.unallocated_delivering_gpus,
        };
        *slot = (*slot as i64 + delta) as u64;
    }
}
