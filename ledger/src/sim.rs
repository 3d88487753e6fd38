//! The simulation engine: the fold and the live scheduler's step ([`schedule::pass`]) driven by a
//! virtual clock.
//!
//! A *simulation* replays a submission schedule whose true run times are known. The engine jumps
//! from one instant to the next — the earliest submission, completion, grace end, contract expiry
//! or fault — writes the events that happen then, folds them, and passes as the live scheduler
//! does: health changes first, then decisions, again and again until a pass has nothing to add.
//! Nothing here is a second implementation of a rule: the fold judges every event, the health
//! monitor decides what heartbeats (and their silence) mean, the policy makes every choice. Event
//! ids are UUIDv7 built from the virtual time and a counter, so the same inputs always give the
//! same ledger.
//!
//! Nodes heartbeat perfectly unless a [`Fault`] says otherwise: a GPU reporting uncorrected ECC
//! errors, or a node whose agent falls silent (crashed or cut off: it neither reports nor hears,
//! and its processes run on). Only nodes a fault touches are fed to the monitor, so a simulation
//! of thousands of healthy nodes costs nothing more.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use uuid::Uuid;

use crate::event::*;
use crate::health::HealthMonitor;
use crate::policy::PolicyConfig;
use crate::schedule;
use crate::state::{Outcome, Phase, State, Workload};

/// One workload of a schedule, with its true run time.
#[derive(Clone, Debug, PartialEq)]
pub struct SimWorkload {
    /// Submission, with every field the live API would send.
    pub submitted: WorkloadSubmitted,
    /// When it is submitted.
    pub submit_ms: u64,
    /// Run time it needs if never preempted.
    pub work_ms: u64,
}

/// A fault injected at a time.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    /// When it strikes.
    pub at_ms: u64,
    /// Node name.
    pub node: String,
    /// What goes wrong.
    pub kind: FaultKind,
    /// When it is repaired, if ever.
    pub repaired_at_ms: Option<u64>,
}

/// What a [`Fault`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The GPU's heartbeats report uncorrected ECC errors.
    Ecc {
        /// GPU index.
        gpu: u32,
    },
    /// The node's agent falls silent: no heartbeats, no reports, and it hears nothing (its
    /// processes run on). After the heartbeat timeout its GPUs go unhealthy and its runs are
    /// preempted; the scheduler reports them lost once their grace is over by a timeout.
    Silent,
}

/// What a preempted run loses, for the simulator to record in its requeue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkModel {
    /// Work since its last checkpoint (`checkpoint_s`); a workload that declares no interval
    /// resumes where it stopped, as the node agent reports it.
    #[default]
    Checkpoint,
    /// As `Checkpoint`, but a workload that declares no interval starts again from its
    /// beginning: every preemption costs it all it had run.
    Restart,
}

impl WorkModel {
    /// Its name: `checkpoint` or `restart`.
    pub fn name(self) -> &'static str {
        match self {
            WorkModel::Checkpoint => "checkpoint",
            WorkModel::Restart => "restart",
        }
    }

    /// The model named `name`.
    pub fn parse(name: &str) -> Option<WorkModel> {
        [WorkModel::Checkpoint, WorkModel::Restart]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// A pass that keeps answering at one instant is cut off after this many: a policy that always
/// finds more to do at the same instant would otherwise hold the clock still for ever. (Each
/// pass folds what the previous one appended, so a settled instant takes two or three.)
pub const PASSES_PER_INSTANT_MAX: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// A run of a workload ends (the `u32` is its start count, to ignore stale timers).
    Finish(WorkloadId, u32),
    /// A preempted workload's grace ends.
    GraceEnds(WorkloadId, u32),
    /// A run's contract ends: from now on it may be preempted.
    ContractEnds(WorkloadId, u32),
    /// Fault number `n` strikes or is repaired.
    Fail(usize),
    Repair(usize),
    /// A heartbeat timeout may have run out: pass.
    Check,
    /// Scheduled event number `n` is written (an operator's drain, a change of shares).
    Write(usize),
}

/// The engine. Feed it a schedule with [`Engine::submit_all`] and run it with [`Engine::run`].
pub struct Engine {
    /// The ledger.
    pub state: State,
    /// The scheduler's settings.
    pub policy: PolicyConfig,
    seq: u64,
    id_counter: u64,
    timers: BinaryHeap<Reverse<(u64, Timer)>>,
    /// Submissions not yet made, by time then order given.
    submissions: BTreeMap<(u64, u64), SimWorkload>,
    /// A schedule read as the run goes, in submission order, so memory holds only what is live.
    source: Option<std::iter::Peekable<Box<dyn Iterator<Item = SimWorkload>>>>,
    work_ms: BTreeMap<WorkloadId, u64>,
    faults: Vec<Fault>,
    scheduled: Vec<Event>,
    /// The live scheduler's health rules, fed the heartbeats of the nodes faults touch.
    health: HealthMonitor,
    heartbeat_timeout_ms: u64,
    /// GPUs reporting ECC errors, by node, with how many faults under way say so; every node
    /// a fault has touched is a key.
    ecc: BTreeMap<String, BTreeMap<u32, u32>>,
    /// Nodes whose agent is silent: how many silences are under way, and the runs that ended
    /// meanwhile unreported.
    silent: BTreeMap<String, (u32, Vec<(WorkloadId, u32)>)>,
    work_model: WorkModel,
}

impl Engine {
    /// A simulation starting at time 0 on an empty ledger.
    pub fn new(state: State, policy: PolicyConfig) -> Self {
        Engine {
            state,
            policy,
            seq: 0,
            id_counter: 0,
            timers: BinaryHeap::new(),
            submissions: BTreeMap::new(),
            source: None,
            work_ms: BTreeMap::new(),
            faults: Vec::new(),
            scheduled: Vec::new(),
            health: HealthMonitor::new(crate::health::DEFAULT_TIMEOUT_MS),
            heartbeat_timeout_ms: crate::health::DEFAULT_TIMEOUT_MS,
            ecc: BTreeMap::new(),
            silent: BTreeMap::new(),
            work_model: WorkModel::default(),
        }
    }

    /// A simulation that goes on from a live ledger's `state` (folded up to its last sequence):
    /// its running work keeps its placements and contracts and ends when `work_ms` says a
    /// workload's whole run takes (less what it has done), a preemption under way ends with its
    /// grace, and its pending work waits in the queue it is in. Nodes heartbeat perfectly.
    /// The fork starts at `from_ms` (the ledger's clock, if later). A workload stopped and
    /// not yet requeued is requeued then, as its node's agent would report.
    pub fn fork(
        state: State,
        policy: PolicyConfig,
        from_ms: u64,
        work_ms: impl Fn(&Workload) -> u64,
    ) -> Self {
        let mut engine = Engine::new(state, policy);
        engine.seq = engine.state.last_seq();
        let now = from_ms.max(engine.state.now_ms);
        engine.state.advance_to(now);
        let mut ids: Vec<WorkloadId> = engine.state.workloads.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let w = &engine.state.workloads[&id];
            engine.work_ms.insert(id, work_ms(w));
            if w.phase == Phase::Stopped {
                engine.schedule(
                    now,
                    Event::WorkloadRequeued(WorkloadRequeued {
                        workload: id,
                        work_lost_s: 0,
                    }),
                );
                continue;
            }
            if w.phase != Phase::Running {
                continue;
            }
            let grace = w.preempting.map(|p| (p.grace_until_ms.max(now), w.starts));
            engine.arm(id, now);
            if let Some((at, starts)) = grace {
                engine
                    .timers
                    .push(Reverse((at, Timer::GraceEnds(id, starts))));
            }
        }
        engine
    }

    /// Sets the timers of `id`'s current run as of `now`: its end, when its work left is done,
    /// and the ends of its contract and of any borrowing that come before.
    fn arm(&mut self, id: WorkloadId, now: u64) {
        let w = &self.state.workloads[&id];
        let starts = w.starts;
        // Estimates come from outside: a huge one never ends, it does not wrap.
        let ends_at = w
            .started_at_ms
            .saturating_add(self.work_ms[&id].saturating_sub(w.work_done_ms));
        // Passes when it may be preempted, and when its borrowed GPUs may be taken back.
        let ends: Vec<u64> = std::iter::once(w.protected_until_ms)
            .chain(w.borrowed.map(|b| b.until_ms))
            .filter(|&end| end > now && ends_at > end)
            .collect();
        self.timers
            .push(Reverse((ends_at.max(now), Timer::Finish(id, starts))));
        for end in ends {
            self.timers
                .push(Reverse((end, Timer::ContractEnds(id, starts))));
        }
    }

    /// Decides at `at_ms` even if nothing happens then (as the live scheduler's tick does).
    pub fn wake(&mut self, at_ms: u64) {
        self.timers.push(Reverse((at_ms, Timer::Check)));
    }

    /// The sequence of the last event written.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Like [`Engine::run`], but asks `keep_going` before every instant and stops (answering
    /// false) as soon as it says no, so a caller can bound the run's work.
    pub fn run_while(
        &mut self,
        until_ms: u64,
        mut keep_going: impl FnMut() -> bool,
        mut observe: impl FnMut(&State, u64, &Envelope, &Outcome),
    ) -> bool {
        while let Some(t) = self.next_instant() {
            if t > until_ms {
                break;
            }
            if !keep_going() {
                return false;
            }
            self.step(t, &mut observe);
        }
        self.state.advance_to(until_ms);
        true
    }

    /// Sets what a preempted run loses (checkpoint by default).
    pub fn set_work_model(&mut self, model: WorkModel) {
        self.work_model = model;
    }

    /// Sets the silence after which a node's GPUs go unhealthy (the live server's
    /// `--heartbeat-timeout-s`).
    pub fn set_heartbeat_timeout(&mut self, timeout_ms: u64) {
        self.health.set_timeout(timeout_ms);
        self.heartbeat_timeout_ms = timeout_ms;
    }

    /// A UUIDv7 for virtual time `t_ms`, unique within this engine.
    pub fn next_id(&mut self, t_ms: u64) -> Uuid {
        self.id_counter += 1;
        let mut tail = [0u8; 10];
        tail[2..].copy_from_slice(&self.id_counter.to_be_bytes());
        uuid::Builder::from_unix_timestamp_millis(t_ms, &tail).into_uuid()
    }

    /// Writes one event at `t_ms` and folds it.
    pub fn write(
        &mut self,
        t_ms: u64,
        mut event: Event,
        observe: &mut impl FnMut(&State, u64, &Envelope, &Outcome),
    ) -> Outcome {
        if let (WorkModel::Restart, Event::WorkloadRequeued(r)) = (self.work_model, &mut event) {
            if let Some(w) = self.state.workloads.get(&r.workload) {
                if w.checkpoint_ms.is_none_or(|c| c == 0) {
                    r.work_lost_s = w.work_done_ms.div_ceil(1000);
                }
            }
        }
        // The simulator plays the service and the agents: a fork of a ledger with a root of
        // authority writes as its root, so the fold holds it to what the service may do.
        let actor = self.state.principals.root().unwrap_or("sim").to_owned();
        let env = Envelope::new(self.next_id(t_ms), t_ms, actor, event);
        self.seq += 1;
        let outcome = self.state.apply(self.seq, &env);
        if let (Event::SettingsSet(s), Outcome::Applied) = (&env.event, &outcome) {
            // The log's settings from here on, as the live scheduler follows them.
            self.policy = s.policy_config(&self.policy);
            self.set_heartbeat_timeout(s.heartbeat_timeout_ms());
        }
        observe(&self.state, self.seq, &env, &outcome);
        outcome
    }

    /// Queues a schedule.
    pub fn submit_all(&mut self, workloads: impl IntoIterator<Item = SimWorkload>) {
        for w in workloads {
            let n = self.submissions.len() as u64;
            self.submissions.insert((w.submit_ms, n), w);
        }
    }

    /// Reads the schedule from `source` as the run goes. It must be in submission order; a
    /// workload that comes late is submitted at the engine's present.
    pub fn stream_from(&mut self, source: Box<dyn Iterator<Item = SimWorkload>>) {
        self.source = Some(source.peekable());
    }

    /// Queues GPU faults.
    pub fn inject(&mut self, faults: impl IntoIterator<Item = Fault>) {
        for f in faults {
            let i = self.faults.len();
            self.timers.push(Reverse((f.at_ms, Timer::Fail(i))));
            if let Some(r) = f.repaired_at_ms {
                self.timers.push(Reverse((r, Timer::Repair(i))));
            }
            self.faults.push(f);
        }
    }

    /// Writes `event` at `at_ms` and decides then, as an operator's action would be (draining a
    /// node, changing a share).
    pub fn schedule(&mut self, at_ms: u64, event: Event) {
        self.timers
            .push(Reverse((at_ms, Timer::Write(self.scheduled.len()))));
        self.scheduled.push(event);
    }

    fn next_instant(&mut self) -> Option<u64> {
        let now = self.state.now_ms;
        [
            self.submissions.keys().next().map(|k| k.0),
            self.timers.peek().map(|Reverse((t, _))| *t),
            self.source
                .as_mut()
                .and_then(|s| s.peek())
                .map(|w| w.submit_ms.max(now)),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Runs until nothing is left to happen or the next instant is past `until_ms`; then the
    /// ledger's clock is moved to `until_ms` (when given) so every figure covers `[0, until]`.
    /// `observe` sees every event with its outcome, after it is folded.
    pub fn run(
        &mut self,
        until_ms: Option<u64>,
        mut observe: impl FnMut(&State, u64, &Envelope, &Outcome),
    ) {
        while let Some(t) = self.next_instant() {
            if until_ms.is_some_and(|u| t > u) {
                break;
            }
            self.step(t, &mut observe);
        }
        if let Some(u) = until_ms {
            self.state.advance_to(u);
        }
    }

    /// Everything that happens at instant `t`, then one scheduling pass (repeated while it starts
    /// or preempts with no grace, so the instant settles). An instant where only timers of runs
    /// that are over come due (a finished workload's contract end, the end of a run that was
    /// preempted) is no occasion to decide: nothing happened.
    pub fn step(&mut self, t: u64, observe: &mut impl FnMut(&State, u64, &Envelope, &Outcome)) {
        let mut happened = false;
        while let Some(Reverse((at, timer))) = self.timers.peek().copied() {
            if at != t {
                break;
            }
            self.timers.pop();
            happened |= self.fire(t, timer, observe);
        }
        while let Some(entry) = self.submissions.first_entry() {
            if entry.key().0 != t {
                break;
            }
            let w = entry.remove();
            self.submit(t, w, observe);
            happened = true;
        }
        while let Some(w) = self
            .source
            .as_mut()
            .and_then(|s| s.next_if(|w| w.submit_ms <= t))
        {
            self.submit(t, w, observe);
            happened = true;
        }
        if !happened {
            return;
        }
        for _ in 0..PASSES_PER_INSTANT_MAX {
            self.heartbeats(t);
            let events = schedule::pass(
                &self.state,
                t,
                &self.policy,
                Some(&mut self.health),
                &mut |events| events,
                usize::MAX,
            );
            if events.is_empty() {
                break;
            }
            let mut any_applied = false;
            for event in events {
                let decided = event.clone();
                if self.write(t, event, observe) != Outcome::Applied {
                    continue;
                }
                any_applied = true;
                match decided {
                    Event::WorkloadStarted(WorkloadStarted { workload, .. }) => {
                        self.arm(workload, t)
                    }
                    Event::PreemptionRequested(PreemptionRequested {
                        workload, grace_s, ..
                    }) => {
                        let starts = self.state.workloads[&workload].starts;
                        // With no grace the agent reports the stop at once (the next pass
                        // sees it); else when the grace is over.
                        if grace_s == 0 {
                            self.fire(t, Timer::GraceEnds(workload, starts), observe);
                        } else {
                            self.timers.push(Reverse((
                                t.saturating_add(grace_s.saturating_mul(1000)),
                                Timer::GraceEnds(workload, starts),
                            )));
                        }
                    }
                    _ => {}
                }
            }
            // A pass the fold refused whole would only be refused again.
            if !any_applied {
                break;
            }
        }
    }

    /// Feeds the monitor the heartbeats of the nodes faults have touched, as of `t`: every GPU
    /// of a node that is not silent, with the ECC errors its faults say.
    fn heartbeats(&mut self, t: u64) {
        for (node, bad) in &self.ecc {
            if self.silent.contains_key(node) {
                continue;
            }
            let Some(idx) = self.state.cluster.get(node) else {
                continue;
            };
            let readings = (0..self.state.cluster.node(idx).gpu_count)
                .map(|gpu| GpuReading {
                    gpu,
                    ecc_errors_uncorrected: u64::from(bad.contains_key(&gpu)),
                    ..GpuReading::default()
                })
                .collect();
            let hb = GpuHeartbeat {
                node: node.clone(),
                readings,
            };
            self.health.heartbeat(&self.state, &hb, t, t);
        }
    }

    /// The node whose agent reports `id`'s run: its first.
    fn reporter(&self, id: WorkloadId) -> Option<&str> {
        let w = self.state.workloads.get(&id)?;
        let first = w.placement.first()?;
        Some(self.state.cluster.node(first.node).name.as_str())
    }

    /// Writes a submission; the engine remembers the true work of those the fold accepts.
    fn submit(
        &mut self,
        t: u64,
        w: SimWorkload,
        observe: &mut impl FnMut(&State, u64, &Envelope, &Outcome),
    ) {
        let id = w.submitted.workload;
        if self.write(t, Event::WorkloadSubmitted(w.submitted), observe) == Outcome::Applied {
            self.work_ms.insert(id, w.work_ms);
        }
    }

    fn running_run(&self, id: WorkloadId, starts: u32) -> bool {
        self.state
            .workloads
            .get(&id)
            .is_some_and(|w| w.phase == Phase::Running && w.starts == starts)
    }

    /// Fires a timer; whether it was still relevant (an event was written, or a running
    /// workload's contract ended).
    fn fire(
        &mut self,
        t: u64,
        timer: Timer,
        observe: &mut impl FnMut(&State, u64, &Envelope, &Outcome),
    ) -> bool {
        match timer {
            Timer::Finish(id, starts) => {
                let running = self.running_run(id, starts);
                let reporter = self.reporter(id).map(str::to_owned);
                if let Some(unheard) = reporter
                    .and_then(|n| self.silent.get_mut(&n))
                    .map(|(_, unheard)| unheard)
                    .filter(|_| running)
                {
                    // Its agent is silent: the end is reported when it is heard again.
                    unheard.push((id, starts));
                    return false;
                }
                if running {
                    self.write(
                        t,
                        Event::WorkloadFinished(WorkloadFinished {
                            workload: id,
                            exit_code: Some(0),
                            signal: None,
                            error: None,
                        }),
                        observe,
                    );
                    self.work_ms.remove(&id);
                }
                running
            }
            Timer::GraceEnds(id, starts) => {
                if !self.running_run(id, starts) {
                    return false;
                }
                if self
                    .reporter(id)
                    .is_some_and(|n| self.silent.contains_key(n))
                {
                    // Its agent did not hear the preemption: the scheduler reports the run
                    // lost a timeout after the grace, unless the agent is heard first.
                    let grace_until = self.state.workloads[&id]
                        .preempting
                        .map_or(t, |p| p.grace_until_ms);
                    self.timers.push(Reverse((
                        grace_until.max(t) + self.heartbeat_timeout_ms,
                        Timer::Check,
                    )));
                    return false;
                }
                for event in self.state.grace_end_reports(id, t) {
                    self.write(t, event, observe);
                }
                true
            }
            Timer::ContractEnds(id, starts) => {
                self.running_run(id, starts) && self.state.workloads[&id].preempting.is_none()
            }
            Timer::Fail(i) => {
                let f = self.faults[i].clone();
                self.ecc.entry(f.node.clone()).or_default();
                match f.kind {
                    FaultKind::Ecc { gpu } => {
                        *self.ecc.entry(f.node).or_default().entry(gpu).or_default() += 1;
                    }
                    FaultKind::Silent => {
                        // Last heard now: one more heartbeat, then none.
                        self.heartbeats(t);
                        self.silent.entry(f.node).or_default().0 += 1;
                        self.timers
                            .push(Reverse((t + self.heartbeat_timeout_ms + 1, Timer::Check)));
                    }
                }
                true
            }
            Timer::Repair(i) => {
                let f = self.faults[i].clone();
                match f.kind {
                    FaultKind::Ecc { gpu } => {
                        let bad = self.ecc.entry(f.node).or_default();
                        if let Some(n) = bad.get_mut(&gpu) {
                            *n -= 1;
                            if *n == 0 {
                                bad.remove(&gpu);
                            }
                        }
                    }
                    FaultKind::Silent => {
                        // Silent until its last silence is over.
                        match self.silent.get_mut(&f.node) {
                            Some((n, _)) if *n > 1 => {
                                *n -= 1;
                                return true;
                            }
                            _ => {}
                        }
                        // Heard again: what ended meanwhile is reported, and a preemption
                        // whose grace is over is carried out.
                        let unheard = self.silent.remove(&f.node).unwrap_or_default().1;
                        for (id, starts) in unheard {
                            self.fire(t, Timer::Finish(id, starts), observe);
                        }
                        let due: Vec<(WorkloadId, u32)> = self
                            .state
                            .preempting
                            .iter()
                            .map(|id| &self.state.workloads[id])
                            .filter(|w| {
                                w.preempting.is_some_and(|p| p.grace_until_ms <= t)
                                    && w.placement.first().is_some_and(|p| {
                                        self.state.cluster.node(p.node).name == f.node
                                    })
                            })
                            .map(|w| (w.id, w.starts))
                            .collect();
                        for (id, starts) in due {
                            self.fire(t, Timer::GraceEnds(id, starts), observe);
                        }
                    }
                }
                true
            }
            Timer::Check => true,
            Timer::Write(i) => {
                let event = self.scheduled[i].clone();
                self.write(t, event, observe);
                true
            }
        }
    }
}
