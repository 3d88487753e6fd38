//! The node agent: makes a node's GPUs part of the cluster and makes placements real.
//!
//! - It registers the node (GPU count, model, topology labels) in the ledger, holding the node's
//!   name in a lease on NATS so that two agents never drive one node.
//! - Every heartbeat interval it publishes every GPU's readings (utilization, memory,
//!   temperature, power, ECC errors, faults) on the telemetry stream; the scheduler turns silence
//!   and bad readings into `GpuHealthChanged` ledger events.
//! - It folds the ledger with the same [`ledger::State`] as every other role (the log's settings
//!   included, so it launches what the server placed) and keeps the
//!   node's processes in line with it: a `WorkloadStarted` placing work here launches the
//!   workload's command ([`run`]) with `CUDA_VISIBLE_DEVICES` set to exactly its GPUs; a
//!   `PreemptionRequested` sends SIGTERM to its process group and SIGKILL when the grace period
//!   is over; a run the ledger no longer places here is stopped.
//! - When a process ends it reports `WorkloadFinished` (exit code or signal) or, if it was asked
//!   to stop, `WorkloadStopped` and `WorkloadRequeued`, timestamped when the process really
//!   ended, so delivered GPU-hours end then. The agent of a gang's first node reports its end;
//!   another rank that fails by itself reports the gang lost, so it is requeued.
//! - A restarted agent finds its runs in their directories: it re-adopts those still running,
//!   reports those that ended meanwhile, reports as lost those that vanished, and never launches
//!   a start twice.
//! - Its clock is measured against the NATS server's at every heartbeat; events are timestamped
//!   with the server's time, and a skew is logged.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eventlog::{Append, AppendError, EventLog};
use futures::{FutureExt, StreamExt};
use ledger::event::{Event, NodeRegistered, WorkloadFinished};
use ledger::{Envelope, Phase, State, StateConfig, WorkloadId};
use nix::sys::signal::Signal;
use uuid::Uuid;

pub mod beats;
mod error;
pub mod gpu;
pub mod http;
pub mod nats;
pub mod run;
pub mod ship;
/// The command and environment of workload `id`, read from its submission at `seq` in `log`.
async fn submitted_spec(
    log: &impl EventLog,
    seq: Option<u64>,
    id: WorkloadId,
) -> Result<(Vec<String>, BTreeMap<String, String>), String> {
    let Some(seq) = seq else {
        // Not submitted in what this agent folded: nothing to read, the run gets no command.
        return Ok(Default::default());
    };
    let stored = log.read(seq, 1).await.map_err(|e| e.to_string())?;
    let env = stored
        .first()
        .filter(|s| s.seq == seq)
        .and_then(|s| serde_json::from_slice::<Envelope>(&s.payload).ok());
    match env.map(|e| e.event) {
        Some(Event::WorkloadSubmitted(s)) if s.workload == id => Ok((s.command, s.env)),
        _ => Err(format!("event {seq} is not the submission of {id}")),
    }
}

#[cfg(test)]
mod tests;

pub use error::AgentError;

pub use beats::wall_clock_ms;
use beats::{heartbeats, stored_at, Clock};
pub use gpu::{FakeGpus, Fault, GpuSource, Nvml};

/// Settings of an agent.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The node's name in the cluster.
    pub node: String,
    /// The actor of its events: its principal's (`agent:<name>`; the server refuses reports
    /// claiming another).
    pub actor: String,
    /// Topology labels, e.g. `rack=r1`.
    pub labels: BTreeMap<String, String>,
    /// The model to register, instead of the one derived from the GPUs' names.
    pub model: Option<String>,
    /// How often to publish readings.
    pub heartbeat: Duration,
    /// Where runs keep their directories (`<work_dir>/runs/…`).
    pub work_dir: PathBuf,
    /// The shim program and its leading arguments (the run directory, `--` and the command
    /// follow); see [`run::shim_main`].
    pub shim: Vec<OsString>,
    /// Added to this machine's clock: stands in for a skewed clock in tests.
    pub clock_skew_ms: i64,
    /// How long a run the ledger no longer places here gets between SIGTERM and SIGKILL.
    pub orphan_grace: Duration,
    /// Stop the runs when the agent stops, reporting them lost (they are requeued), instead of
    /// leaving them for the next agent to re-adopt: for agents that live inside a server.
    pub stop_runs_on_exit: bool,
    /// How long after a failed launch the run is launched again (four times longer after
    /// each further failure, up to [`LAUNCH_ATTEMPTS`]).
    pub launch_backoff: Duration,
    /// Run each workload as the Unix user named like its submitter (`user:alice` runs as
    /// `alice`); the agent must run as root.
    pub run_as_submitter: bool,
}

impl AgentConfig {
    /// Defaults for `node`, keeping runs under `work_dir` and launching through `shim`.
    pub fn new(node: &str, work_dir: PathBuf, shim: Vec<OsString>) -> Self {
        AgentConfig {
            node: node.to_owned(),
            actor: format!("agent:{node}"),
            labels: BTreeMap::new(),
            model: None,
            heartbeat: Duration::from_secs(5),
            work_dir,
            shim,
            clock_skew_ms: 0,
            orphan_grace: Duration::from_secs(10),
            stop_runs_on_exit: false,
            launch_backoff: Duration::from_secs(2),
            run_as_submitter: false,
        }
    }
}

/// Where heartbeats go.
#[derive(Clone)]
pub enum Telemetry {
    /// The `TELEMETRY` stream, whose timestamps also set the agent's clock.
    JetStream(Box<eventlog::jetstream::JetStreamLog>),
    /// A function in the same process (an embedded server's health monitor).
    Local(Arc<dyn Fn(&Envelope) + Send + Sync>),
    /// A server's HTTP API, whose answers also set the agent's clock.
    Http(http::HttpLog),
}

/// What the agent keeps of one run.
struct Run {
    dir: PathBuf,
    /// The shim, when this agent launched it (so it can be reaped).
    shim: Option<tokio::process::Child>,
    /// SIGTERM was sent; SIGKILL is due then.
    kill_at: Option<Instant>,
    killed: bool,
    /// The end was reported to the ledger.
    reported: bool,
    /// Reports the ledger refused so far: each new attempt has new idempotency keys.
    attempt: u32,
    /// Launches that failed so far (the shim could not be started, or exited without starting
    /// the command).
    failed_launches: u32,
    /// The next launch is due then.
    relaunch_at: Option<Instant>,
    /// The shim this agent launched exited without starting the command, for this reason: a
    /// failed launch, not a lost run.
    unstarted: Option<String>,
}

impl Run {
    /// A run in `dir` not launched yet.
    fn new(dir: PathBuf) -> Run {
        Run {
            dir,
            shim: None,
            kill_at: None,
            killed: false,
            reported: false,
            attempt: 0,
            failed_launches: 0,
            relaunch_at: None,
            unstarted: None,
        }
    }

    /// Whether the run waits to be launched again.
    fn relaunch_pending(&self) -> bool {
        self.relaunch_at.is_some() || self.unstarted.is_some()
    }

    /// Gives up launching the run again (the ledger no longer wants it here).
    fn give_up_launch(&mut self) {
        self.relaunch_at = None;
        self.unstarted = None;
    }

    /// Counts a failed launch of `workload`'s run: the next try is due `backoff` × 4ⁿ⁻¹ later,
    /// and after [`LAUNCH_ATTEMPTS`] the run ends as failed with `reason`.
    fn launch_failed(&mut self, workload: WorkloadId, backoff: Duration, reason: &str) {
        self.failed_launches += 1;
        let failures = self.failed_launches;
        if failures < LAUNCH_ATTEMPTS {
            let wait = backoff * 4u32.pow(failures - 1);
            tracing::warn!(%workload, error = %reason, "cannot launch the run; trying again in {:.1} s", wait.as_secs_f64());
            self.relaunch_at = Some(Instant::now() + wait);
        } else {
            tracing::warn!(%workload, error = %reason, "cannot launch the run after {failures} tries: it fails");
            self.relaunch_at = None;
            let reason = format!("the node could not launch it: {reason}");
            if let Err(e) = run::record_failure(&self.dir, &reason) {
                tracing::error!(%workload, error = %e, "cannot record the failed launch");
            }
        }
    }
}

/// A run whose launch fails this many times, [`AgentConfig::launch_backoff`] and then four
/// times longer apart each time, fails: the workload ends as failed with the reason instead of
/// going back to the queue for ever.
pub const LAUNCH_ATTEMPTS: u32 = 3;

/// A run's end is reported with its real time if the ledger's clock is at most this far past
/// it; later, with the ledger's clock less this (a ledger refuses events much older than its
/// clock).
pub const REPORT_LATE_MAX_MS: u64 = 1_000;

/// The least time between SIGTERM and SIGKILL.
pub const MIN_GRACE: Duration = Duration::from_secs(2);

/// The node agent's loop.
pub struct Agent<L> {
    log: L,
    telemetry: Telemetry,
    /// The GPUs, until the heartbeat task takes them.
    source: Option<Box<dyn GpuSource>>,
    /// The GPUs as discovered.
    gpus: Vec<gpu::GpuInfo>,
    config: AgentConfig,
    state: State,
    /// Shared with the heartbeat task, whose answers correct it.
    clock: Arc<std::sync::Mutex<Clock>>,
    runs: BTreeMap<(WorkloadId, u64), Run>,
    /// The first event of each report sent, by envelope id, and the run it reports: a report
    /// the fold refuses is sent again.
    sent: BTreeMap<Uuid, (WorkloadId, u64)>,
    /// Command and environment of the runs placed here, read once each is placed.
    specs: BTreeMap<WorkloadId, (Vec<String>, BTreeMap<String, String>)>,
    /// Where each live workload's submission stands in the log: an agent that reads the ledger
    /// whole reads the command of a run placed here from there, and keeps no other node's.
    submitted: BTreeMap<WorkloadId, u64>,
    /// Runs found in the run directory that the ledger does not place here.
    orphans: BTreeMap<PathBuf, Run>,
    runs_dir: PathBuf,
    /// Where runs' output is shipped.
    shipping: ship::Shipping,
    /// Where the commands of runs placed here are asked for, when the events leave them out
    /// (an agent over HTTP).
    specs_from: Option<http::HttpLog>,
    /// Says why once the service refuses this agent's credentials.
    refused: Option<tokio::sync::watch::Receiver<Option<String>>>,
    /// Why this agent must stop: the ledger revoked its grant.
    revoked_self: Option<String>,
}

impl<L: EventLog> Agent<L> {
    /// An agent for the node described by `config`, with GPUs from `source`.
    pub fn new(
        log: L,
        telemetry: Telemetry,
        source: Box<dyn GpuSource>,
        config: AgentConfig,
    ) -> Self {
        let runs_dir = config.work_dir.join("runs");
        Agent {
            log,
            telemetry,
            gpus: source.gpus().to_vec(),
            source: Some(source),
            clock: Arc::new(std::sync::Mutex::new(Clock::skewed(config.clock_skew_ms))),
            config,
            state: State::new(StateConfig::default()),
            runs: BTreeMap::new(),
            specs: BTreeMap::new(),
            submitted: BTreeMap::new(),
            sent: BTreeMap::new(),
            orphans: BTreeMap::new(),
            runs_dir,
            shipping: ship::Shipping::Off,
            specs_from: None,
            refused: None,
            revoked_self: None,
        }
    }

    /// Stops, its runs with it, once `refused` says the service no longer takes this agent's
    /// credentials (its token was revoked or expired): the node is cut off, and its work will be
    /// requeued elsewhere, so none of it may go on here.
    pub fn stop_when_refused(
        mut self,
        refused: tokio::sync::watch::Receiver<Option<String>>,
    ) -> Self {
        self.refused = Some(refused);
        self
    }

    /// Asks `api` for the command and environment of each run placed here before launching it:
    /// the events an agent reads over HTTP leave them out, so it never holds another node's.
    pub fn with_specs_from(mut self, api: http::HttpLog) -> Self {
        self.specs_from = Some(api);
        self
    }

    /// Ships the runs' output to `shipping` (see [`ship`]); without it, output stays in the run
    /// directories.
    pub fn with_output(mut self, shipping: ship::Shipping) -> Self {
        self.shipping = shipping;
        self
    }

    /// Registers the node and runs until `stop` resolves. Stopping leaves the workloads
    /// running: the next agent on this node re-adopts them.
    pub async fn run(
        mut self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), AgentError> {
        if self.config.run_as_submitter && !nix::unistd::geteuid().is_root() {
            return Err(AgentError::NeedsRoot);
        }
        std::fs::create_dir_all(&self.runs_dir).map_err(|source| AgentError::RunDirectory {
            path: self.runs_dir.clone(),
            source,
        })?;
        self.measure_clock().await;
        let mut events = self
            .log
            .subscribe(1)
            .await
            .map_err(|e| AgentError::Log(e.to_string()))?;
        // Fold the whole ledger first: a restarted agent reports what ended while it was down
        // before anything newer is stamped, and registers only a node the ledger lacks.
        let end = self
            .log
            .last_seq()
            .await
            .map_err(|e| AgentError::Log(e.to_string()))?;
        self.fold_until(&mut events, end).await?;
        // From the ledger's root of authority on, what it writes counts only if granted.
        let principals = self.state.principals();
        if principals.root().is_some() && principals.by_actor(&self.config.actor).is_none() {
            return Err(AgentError::Ungranted {
                node: self.config.node.clone(),
                revoked: principals.was_revoked(&self.config.node),
            });
        }
        if !self.check_registration(false)? {
            let registered_at = self.register().await?;
            self.fold_until(&mut events, registered_at).await?;
            self.check_registration(true)?;
        }
        self.find_orphans();
        let source = self.source.take().expect("the GPUs are taken once");
        tracing::info!(
            node = %self.config.node,
            gpus = self.gpus.len(),
            source = %source.describe(),
            "agent registered"
        );
        // Heartbeats go on in a task of their own, whatever the loop below waits for.
        let (busy_tx, busy_rx) = tokio::sync::watch::channel(self.busy_gpus());
        let beats = tokio::spawn(heartbeats(
            source,
            self.telemetry.clone(),
            self.config.node.clone(),
            self.config.actor.clone(),
            self.config.heartbeat,
            self.clock.clone(),
            busy_rx,
        ));
        let _stop_beats = AbortOnDrop(beats.abort_handle());
        // Output is shipped by a task of its own too; told to stop, it ships what is left.
        let (stop_shipping, shipping_stopped) = tokio::sync::oneshot::channel::<()>();
        let shipper = ship::Shipper::new(
            self.shipping.clone(),
            self.runs_dir.clone(),
            self.config.node.clone(),
        );
        let mut shipping = tokio::spawn(shipper.run(async move {
            let _ = shipping_stopped.await;
        }));
        let _stop_shipping = AbortOnDrop(shipping.abort_handle());
        let mut stop = std::pin::pin!(stop);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut resubscribe = false;
        let mut refused = self.refused.take();
        loop {
            tokio::select! {
                why = refusal(&mut refused) => {
                    tracing::error!(node = %self.config.node, reason = %why, "the server refused this agent's token: stopping its runs and the agent");
                    self.stop_all().await;
                    let _ = stop_shipping.send(());
                    return Err(AgentError::Refused(why));
                }
                _ = &mut stop => {
                    if self.config.stop_runs_on_exit {
                        self.stop_all().await;
                    }
                    let _ = stop_shipping.send(());
                    let _ = tokio::time::timeout(Duration::from_secs(3), &mut shipping).await;
                    return Ok(());
                }
                item = events.next() => match item {
                    Some(Ok(stored)) => {
                        self.apply(&stored);
                        // Decide on everything already here, not on half a page.
                        loop {
                            match events.next().now_or_never() {
                                Some(Some(Ok(stored))) => self.apply(&stored),
                                Some(_) => {
                                    // Failed or ended: resubscribe at the next tick.
                                    events = futures::stream::pending().boxed();
                                    resubscribe = true;
                                    break;
                                }
                                None => break,
                            }
                        }
                    }
                    other => {
                        if let Some(Err(e)) = other {
                            tracing::warn!(error = %e, "the ledger subscription failed; resubscribing");
                        }
                        // Resubscribed at the next tick; nothing is read from this one again.
                        events = futures::stream::pending().boxed();
                        resubscribe = true;
                        continue;
                    }
                },
                _ = tick.tick() => {
                    if resubscribe {
                        match self.log.subscribe(self.state.last_seq() + 1).await {
                            Ok(s) => {
                                events = s;
                                resubscribe = false;
                            }
                            Err(e) => tracing::warn!(error = %e, "cannot resubscribe to the ledger; retrying"),
                        }
                    }
                }
            }
            // Unless granted again since (a rotated token): stop.
            let granted = |name: &str| self.state.principals().get(name).is_some();
            if let Some(why) = self
                .revoked_self
                .take()
                .filter(|_| !granted(&self.config.node))
            {
                tracing::error!(node = %self.config.node, reason = %why, "this agent's grant was revoked: stopping its runs and the agent");
                self.stop_all().await;
                let _ = stop_shipping.send(());
                return Err(AgentError::Refused(why));
            }
            self.reconcile().await;
            let busy = self.busy_gpus();
            busy_tx.send_if_modified(|b| {
                let changed = *b != busy;
                *b = busy;
                changed
            });
        }
    }

    /// This agent's clock now.
    fn clock(&self) -> Clock {
        *self.clock.lock().expect("the clock is never poisoned")
    }

    /// Applies events from `events` until the state reaches `seq`.
    async fn fold_until(
        &mut self,
        events: &mut futures::stream::BoxStream<
            'static,
            Result<eventlog::Stored, eventlog::LogError>,
        >,
        seq: u64,
    ) -> Result<(), AgentError> {
        let mut failures = 0;
        while self.state.last_seq() < seq {
            let why = match events.next().await {
                Some(Ok(stored)) => {
                    self.apply(&stored);
                    continue;
                }
                Some(Err(e)) => e.to_string(),
                None => "the ledger subscription ended".to_owned(),
            };
            // A reader that lost its place: read on from what is folded, a few times.
            failures += 1;
            if failures > 5 {
                return Err(AgentError::Log(why));
            }
            tracing::warn!(error = %why, "reading the ledger again");
            *events = self
                .log
                .subscribe(self.state.last_seq() + 1)
                .await
                .map_err(|e| AgentError::Log(e.to_string()))?;
        }
        Ok(())
    }

    fn apply(&mut self, stored: &eventlog::Stored) {
        match serde_json::from_slice::<Envelope>(&stored.payload) {
            Ok(env) => {
                let outcome = self.state.apply(stored.seq, &env);
                if let Some(key) = self.sent.remove(&env.id) {
                    if let ledger::Outcome::Rejected(r) = &outcome {
                        tracing::warn!(workload = %key.0, reason = %r, "the ledger refused the report of a run's end; reporting again");
                        if let Some(run) = self.runs.get_mut(&key) {
                            run.reported = false;
                            run.attempt += 1;
                        }
                    }
                }
                let applied = outcome == ledger::Outcome::Applied;
                match &env.event {
                    // This agent's own grant revoked: it stops, wherever it reads the ledger.
                    Event::PrincipalRevoked(r)
                        if applied
                            && ledger::identity::actor_of(
                                ledger::identity::Role::Agent,
                                &r.name,
                            ) == self.config.actor =>
                    {
                        self.revoked_self = Some(format!(
                            "its grant {:?} was revoked at event {}",
                            r.name, stored.seq
                        ));
                    }
                    Event::WorkloadSubmitted(s) if applied => {
                        self.submitted.insert(s.workload, stored.seq);
                    }
                    Event::WorkloadFinished(_)
                    | Event::WorkloadCancelled(_)
                    | Event::WorkloadStopped(_)
                        if applied =>
                    {
                        let id = env.event.workload().expect("about a workload");
                        if self
                            .state
                            .workloads()
                            .get(&id)
                            .is_none_or(|w| matches!(w.phase, Phase::Finished | Phase::Cancelled))
                        {
                            self.specs.remove(&id);
                            self.submitted.remove(&id);
                        }
                    }
                    _ => {}
                }
            }
            Err(e) => {
                // The projector records these; the agent only needs to move past them.
                tracing::debug!(seq = stored.seq, error = %e, "undecodable ledger event skipped");
                self.state.skip(stored.seq);
            }
        }
    }

    /// Probes the server's clock before anything is stamped.
    async fn measure_clock(&mut self) {
        let sent = self.clock().local_ms();
        let server = match &self.telemetry {
            Telemetry::Local(_) => return,
            Telemetry::Http(api) => api.server_time().await,
            Telemetry::JetStream(js) => {
                let subject = format!(
                    "{}.agent.clock.{}",
                    eventlog::subject::TELEMETRY_PREFIX,
                    eventlog::subject::token(&self.config.node)
                );
                stored_at(js, subject, "{}".into()).await
            }
        };
        let acked = self.clock().local_ms();
        if let Ok(server) = server {
            self.clock
                .lock()
                .expect("the clock is never poisoned")
                .measured(&self.config.node, sent, acked, server);
        }
    }

    fn envelope(&self, event: Event) -> Envelope {
        Envelope::new(
            Uuid::now_v7(),
            self.clock().now_ms(),
            self.config.actor.clone(),
            event,
        )
    }

    /// The model this node registers as: `--model`, else its first GPU's.
    fn model(&self) -> String {
        self.config
            .model
            .clone()
            .unwrap_or_else(|| gpu::short_model(&self.gpus[0].name))
    }

    async fn register(&mut self) -> Result<u64, AgentError> {
        let model = self.model();
        let gpus = &self.gpus;
        if gpus
            .iter()
            .any(|g| gpu::short_model(&g.name) != gpu::short_model(&gpus[0].name))
        {
            tracing::warn!("this node mixes GPU models; it is registered as {model}");
        }
        let event = Event::NodeRegistered(NodeRegistered {
            node: self.config.node.clone(),
            gpus: gpus.len() as u32,
            model,
            labels: self.config.labels.clone(),
        });
        let env = self.envelope(event);
        let append = Append::event(&env, None, None);
        loop {
            match self.log.append(append.clone()).await {
                Ok(a) => return Ok(a.seq),
                Err(AppendError::Unacknowledged(e)) => {
                    tracing::warn!(error = %e, "registration not acknowledged; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(AgentError::Log(format!("cannot register the node: {e}"))),
            }
        }
    }

    /// Whether the ledger holds this node as this machine is; an error if it holds it with
    /// another shape, or (`must`) does not hold it at all.
    fn check_registration(&self, must: bool) -> Result<bool, AgentError> {
        let gpus = self.gpus.len() as u32;
        let Some(idx) = self.state.cluster().get(&self.config.node) else {
            if !must {
                return Ok(false);
            }
            return Err(AgentError::NotRegistered {
                node: self.config.node.clone(),
            });
        };
        let n = self.state.cluster().node(idx);
        let model = self.model();
        if n.gpu_count != gpus || n.model != model {
            return Err(AgentError::RegisteredOtherwise {
                node: self.config.node.clone(),
                registered_gpus: n.gpu_count,
                registered_model: n.model.to_string(),
                gpus,
                model: model.to_string(),
            });
        }
        Ok(true)
    }

    /// GPUs of this node held by running workloads.
    fn busy_gpus(&self) -> Vec<u32> {
        let Some(idx) = self.state.cluster().get(&self.config.node) else {
            return Vec::new();
        };
        let node = self.state.cluster().node(idx);
        (0..node.gpu_count)
            .filter(|g| node.holder(*g).is_some())
            .collect()
    }

    /// Runs the ledger places on this node: (workload, its start count) → the GPUs here.
    fn placed_here(&self) -> BTreeMap<(WorkloadId, u64), Vec<u32>> {
        let mut out = BTreeMap::new();
        let Some(me) = self.state.cluster().get(&self.config.node) else {
            return out;
        };
        for w in self.state.running_workloads() {
            if w.phase != Phase::Running {
                continue;
            }
            if let Some(p) = w.placement.iter().find(|p| p.node == me) {
                let gpus = (0..64).filter(|g| p.gpus & (1u64 << g) != 0).collect();
                out.insert((w.id, u64::from(w.starts)), gpus);
            }
        }
        out
    }

    /// Reads the command of every run placed here not read yet: asked of the API by an agent
    /// over HTTP (its events leave commands out), read from the submission in the log by one
    /// that reads the ledger whole; answers the workloads whose command is still unknown.
    async fn fetch_specs(
        &mut self,
        placed: &BTreeMap<(WorkloadId, u64), Vec<u32>>,
    ) -> std::collections::BTreeSet<WorkloadId> {
        let mut unknown = std::collections::BTreeSet::new();
        for (id, _) in placed.keys() {
            if self.specs.contains_key(id) {
                continue;
            }
            let spec = match &self.specs_from {
                Some(api) => api.run_spec(*id).await.map_err(|e| e.to_string()),
                None => submitted_spec(&self.log, self.submitted.get(id).copied(), *id).await,
            };
            match spec {
                Ok(spec) => {
                    self.specs.insert(*id, spec);
                }
                Err(e) => {
                    tracing::warn!(workload = %id, error = %e, "cannot read the command of a run placed here; reading it again");
                    unknown.insert(*id);
                }
            }
        }
        unknown
    }

    /// Runs in the run directory that are alive but not placed here: stopped once found.
    fn find_orphans(&mut self) {
        let placed = self.placed_here();
        let Ok(entries) = std::fs::read_dir(&self.runs_dir) else {
            return;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            let ours = placed
                .keys()
                .any(|(id, at)| run::dir(&self.runs_dir, *id, *at) == dir);
            if !ours && run::status(&dir) == run::Status::Running {
                tracing::warn!(dir = %dir.display(), "a run the ledger no longer places here is still alive: stopping it");
                self.orphans.insert(
                    dir.clone(),
                    Run {
                        reported: true,
                        ..Run::new(dir)
                    },
                );
            }
        }
    }

    /// Brings the node's processes in line with the ledger.
    async fn reconcile(&mut self) {
        let placed = self.placed_here();
        let unknown = self.fetch_specs(&placed).await;
        // Launch or adopt what is placed here.
        for (key, gpus) in &placed {
            match self.runs.remove(key) {
                // Its command is still to be asked for: launched at a later tick.
                None if unknown.contains(&key.0) => {}
                None => {
                    let run = self.start(*key, gpus);
                    self.runs.insert(*key, run);
                }
                Some(mut run) => {
                    let preempting = self
                        .state
                        .workloads()
                        .get(&key.0)
                        .is_some_and(|w| w.preempting.is_some());
                    if preempting && run.relaunch_pending() {
                        // Asked to stop before it ran: stopped as asked, nothing to signal.
                        run.give_up_launch();
                        run.kill_at = Some(Instant::now());
                        run.killed = true;
                    }
                    if let Some(reason) = run.unstarted.take() {
                        run.launch_failed(key.0, self.config.launch_backoff, &reason);
                    }
                    if run.relaunch_at.is_some_and(|at| Instant::now() >= at) {
                        self.launch(*key, gpus, &mut run);
                    }
                    self.runs.insert(*key, run);
                }
            }
        }
        // Runs the ledger no longer places here (finished, reported lost, cancelled before the
        // agent saw the start): stop them without reporting.
        let gone: Vec<_> = self
            .runs
            .keys()
            .filter(|k| !placed.contains_key(k))
            .copied()
            .collect();
        for key in gone {
            let mut run = self.runs.remove(&key).expect("listed");
            if run.relaunch_pending() {
                tracing::info!(workload = %key.0, "the ledger no longer places the run here: its launch is given up");
            }
            if orphan_alive(&mut run) {
                self.orphans.insert(run.dir.clone(), run);
            }
        }
        // Preemptions: SIGTERM now, SIGKILL when the grace period is over.
        let now = Instant::now();
        let server_now = self.clock().now_ms();
        for (key, run) in &mut self.runs {
            let Some(p) = self
                .state
                .workloads()
                .get(&key.0)
                .and_then(|w| w.preempting)
            else {
                continue;
            };
            if run.kill_at.is_none() && run::signal_group(&run.dir, Signal::SIGTERM) {
                // Even without a grace period (a failed GPU) the process gets a moment to
                // flush its logs: its GPUs are not handed on before its end is reported.
                let grace = Duration::from_millis(p.grace_until_ms.saturating_sub(server_now))
                    .max(MIN_GRACE);
                run.kill_at = Some(now + grace);
            }
        }
        for run in self.orphans.values_mut() {
            if run.kill_at.is_none() && run::signal_group(&run.dir, Signal::SIGTERM) {
                run.kill_at = Some(now + self.config.orphan_grace);
            }
        }
        for run in self.runs.values_mut().chain(self.orphans.values_mut()) {
            if let Some(at) = run.kill_at {
                if now >= at && !run.killed {
                    run.killed = run::signal_group(&run.dir, Signal::SIGKILL);
                }
            }
        }
        self.orphans.retain(|_, run| orphan_alive(run));
        // Ends: report them.
        let mut ended = Vec::new();
        for (key, run) in &mut self.runs {
            if run.reported {
                continue;
            }
            let status = status_of(run);
            if status == run::Status::Running {
                continue;
            }
            run.reported = true;
            ended.push((*key, status, run.kill_at.is_some()));
        }
        let mut reports = Vec::new();
        for (key, status, signalled) in ended {
            let Some(w) = self.state.workloads().get(&key.0) else {
                continue;
            };
            if !self.state.reports_end(&self.config.node, key.0) {
                // The gang's first node reports its end. Another rank that fails by itself
                // takes the gang down: it reports it lost (requeued) under the same keys, so
                // whichever report comes first stands.
                let failed = match &status {
                    run::Status::Ended(exit) => exit.exit_code != Some(0),
                    run::Status::Lost => true,
                    run::Status::Running => false,
                };
                // A rank this node could not launch fails the gang, as it would on the first
                // node: requeued, it would be placed and fail again.
                let unlaunchable =
                    matches!(&status, run::Status::Ended(exit) if exit.error.is_some());
                if unlaunchable && !signalled && w.preempting.is_none() {
                    reports.push((key, self.end_reports(key.0, status, false)));
                    continue;
                }
                if failed && !signalled && w.preempting.is_none() {
                    tracing::warn!(workload = %key.0, "a rank of the gang failed on this node: the gang is requeued");
                    reports.push((
                        key,
                        (self.clock().now_ms(), ledger::reports::lost(key.0).to_vec()),
                    ));
                }
                continue;
            }
            reports.push((key, self.end_reports(key.0, status, signalled)));
        }
        for (key, (at_ms, events)) in reports {
            self.report(key, at_ms, events).await;
        }
    }

    /// Stops every run (SIGTERM, SIGKILL after [`MIN_GRACE`]) and reports each lost, so it is
    /// requeued.
    async fn stop_all(&mut self) {
        let deadline = Instant::now() + MIN_GRACE;
        // Which runs had ended by themselves before being asked: those finished.
        let asked: BTreeSet<(WorkloadId, u64)> = self
            .runs
            .iter_mut()
            .filter_map(|(k, r)| {
                (!r.reported && status_of(r) == run::Status::Running).then_some(*k)
            })
            .collect();
        for run in self.runs.values_mut().filter(|r| !r.reported) {
            if !run::signal_group(&run.dir, Signal::SIGTERM) {
                // Not started yet: stop its shim before it starts it.
                if let Some(shim) = &mut run.shim {
                    let _ = shim.start_kill();
                }
            }
        }
        loop {
            let mut alive = Vec::new();
            for run in self.runs.values_mut() {
                if !run.reported && status_of(run) == run::Status::Running {
                    alive.push(run);
                }
            }
            if alive.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                for run in alive {
                    run::signal_group(&run.dir, Signal::SIGKILL);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let keys: Vec<_> = self
            .runs
            .iter()
            .filter(|(_, r)| !r.reported)
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            if self.state.reports_end(&self.config.node, key.0) {
                let status = self.runs.get_mut(&key).map_or(run::Status::Lost, status_of);
                let (at, events) = match status {
                    run::Status::Ended(_) if !asked.contains(&key) => {
                        self.end_reports(key.0, status, false)
                    }
                    _ => {
                        tracing::info!(workload = %key.0, "stopped with the agent: requeued");
                        (self.clock().now_ms(), ledger::reports::lost(key.0).to_vec())
                    }
                };
                self.report(key, at, events).await;
            }
        }
    }

    /// Launches a new start, or adopts one launched before (by this agent or an earlier one).
    fn start(&mut self, key: (WorkloadId, u64), gpus: &[u32]) -> Run {
        let dir = run::dir(&self.runs_dir, key.0, key.1);
        let mut new = Run::new(dir.clone());
        match run::claim(&dir) {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(workload = %key.0, dir = %dir.display(), "re-adopting a run launched before");
                return new;
            }
            Err(e) => {
                tracing::warn!(workload = %key.0, error = %e, "cannot create the run directory: the run is lost");
                return new;
            }
        }
        self.launch(key, gpus, &mut new);
        new
    }

    /// Launches the claimed `run`; after a failure, tries again later, and after
    /// [`LAUNCH_ATTEMPTS`] records the run as failed with the reason.
    fn launch(&self, key: (WorkloadId, u64), gpus: &[u32], run: &mut Run) {
        let spec = self.spec(key.0, gpus, &run.dir);
        match run::launch(&run.dir, &spec, &self.config.shim) {
            Ok(child) => {
                tracing::info!(workload = %key.0, gpus = ?gpus, "launched");
                run.shim = Some(child);
                run.relaunch_at = None;
            }
            Err(e) => run.launch_failed(key.0, self.config.launch_backoff, &e.to_string()),
        }
    }

    /// The command and environment of a workload's run here.
    fn spec(&self, id: WorkloadId, gpus: &[u32], dir: &std::path::Path) -> run::Spec {
        let w = &self.state.workloads()[&id];
        let (command, mut env) = self.specs.get(&id).cloned().unwrap_or_default();
        let info = &self.gpus;
        let by_uuid: Option<Vec<String>> = gpus
            .iter()
            .map(|g| info.get(*g as usize).and_then(|i| i.uuid.clone()))
            .collect();
        let indices: Vec<String> = gpus.iter().map(u32::to_string).collect();
        env.insert(
            "CUDA_VISIBLE_DEVICES".into(),
            by_uuid.unwrap_or_else(|| indices.clone()).join(","),
        );
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert("FAIRLEDGER_GPUS".into(), indices.join(","));
        env.insert("FAIRLEDGER_WORKLOAD_ID".into(), id.to_string());
        env.insert(
            "FAIRLEDGER_ALLOCATION".into(),
            self.state.allocation_path(w).unwrap_or("").to_owned(),
        );
        env.insert("FAIRLEDGER_NODE".into(), self.config.node.clone());
        let nodes: Vec<&str> = w
            .placement
            .iter()
            .map(|p| self.state.cluster().node(p.node).name.as_str())
            .collect();
        let rank = nodes
            .iter()
            .position(|n| *n == self.config.node)
            .unwrap_or(0);
        env.insert("FAIRLEDGER_NODES".into(), nodes.join(","));
        env.insert("FAIRLEDGER_NODE_RANK".into(), rank.to_string());
        env.insert("FAIRLEDGER_RUN_DIR".into(), dir.display().to_string());
        let command = if command.is_empty() {
            // Nothing to run: hold the GPUs for what is left of the estimate, as a placeholder
            // would; for ever without one; not at all once a run outlasted it.
            let secs = w.placeholder_ms().map_or("infinity".to_owned(), |ms| {
                format!("{:.3}", ms as f64 / 1000.0)
            });
            vec!["sleep".to_owned(), secs]
        } else {
            command
        };
        let run_as = self.config.run_as_submitter.then(|| {
            self.state
                .principals()
                .unix_user_of(self.state.submitter(w))
                .to_owned()
        });
        run::Spec {
            command,
            env,
            run_as,
        }
    }

    /// What to report for a run that ended (or vanished), and when it ended (server time).
    /// `signalled`: this agent had asked the process to stop.
    fn end_reports(
        &self,
        id: WorkloadId,
        status: run::Status,
        signalled: bool,
    ) -> (u64, Vec<Event>) {
        let w = &self.state.workloads()[&id];
        match status {
            run::Status::Ended(exit) => {
                let at = self.clock().server_time(exit.ended_at_ms);
                // A run that ended by itself before it was asked to stop finished, even if a
                // preemption was already on its way.
                if w.preempting.is_some() && signalled {
                    (at, self.state.grace_end_reports(id, at))
                } else {
                    if let Some(e) = &exit.error {
                        tracing::warn!(workload = %id, "{e}");
                    }
                    let finished = Event::WorkloadFinished(WorkloadFinished {
                        workload: id,
                        exit_code: exit.exit_code,
                        signal: exit.signal,
                        error: exit.error,
                    });
                    (at, vec![finished])
                }
            }
            run::Status::Lost | run::Status::Running if w.preempting.is_some() && signalled => {
                // Stopped before it ran (or it left no record): the preemption stands.
                let at = self.clock().now_ms();
                (at, self.state.grace_end_reports(id, at))
            }
            run::Status::Lost | run::Status::Running => {
                tracing::warn!(workload = %id, "the run vanished without a record of its end: reported lost and requeued");
                (self.clock().now_ms(), ledger::reports::lost(id).to_vec())
            }
        }
    }

    /// Appends the reports of one run's end, stamped `at_ms` (no earlier than the ledger's
    /// clock allows), once: a retry carries the same idempotency keys.
    async fn report(&mut self, key: (WorkloadId, u64), at_ms: u64, events: Vec<Event>) {
        let allocation = self.state.allocation_of(&events[0]).map(str::to_owned);
        let round = self.runs.get(&key).map_or(0, |r| r.attempt);
        for attempt in 0.. {
            // Stamped anew at each try: never earlier than the ledger's clock allows.
            let floor = self
                .state
                .now_ms()
                .max(self.clock().now_ms())
                .saturating_sub(REPORT_LATE_MAX_MS);
            if at_ms < floor && attempt == 0 {
                tracing::warn!(workload = %key.0, "the run ended {} s before it could be reported; reported as ending then", (floor - at_ms) / 1000);
            }
            let stamp = at_ms.max(floor);
            let mut first = None;
            let appends: Vec<Append> = events
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let env =
                        Envelope::new(Uuid::now_v7(), stamp, self.config.actor.clone(), e.clone());
                    first.get_or_insert(env.id);
                    let id = format!("agent-end:{}:{}:{round}:{i}", key.0, key.1);
                    Append::event(&env, allocation.as_deref(), Some(&id))
                })
                .collect();
            let appended = self.log.append_batch(appends).await;
            // Only a report written is folded: the fold's verdict on it is awaited.
            if let (Ok(_), Some(id)) = (&appended, first) {
                self.sent.insert(id, key);
            }
            match appended {
                Ok(_) | Err(AppendError::DuplicateBatch(_)) => return,
                Err(AppendError::Unacknowledged(e)) | Err(AppendError::Unavailable(e))
                    if attempt < 20 =>
                {
                    tracing::warn!(workload = %key.0, error = %e, "report not acknowledged; retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => {
                    tracing::error!(workload = %key.0, error = %e, "cannot report the end of a run; will retry");
                    if let Some(run) = self.runs.get_mut(&key) {
                        run.reported = false;
                    }
                    return;
                }
            }
        }
    }
}

/// Why the service refused this agent's credentials, once it does; never without a watch.
async fn refusal(refused: &mut Option<tokio::sync::watch::Receiver<Option<String>>>) -> String {
    let Some(rx) = refused else {
        return std::future::pending().await;
    };
    loop {
        if let Some(why) = rx.borrow_and_update().clone() {
            return why;
        }
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reaps the shim if this agent launched it and it has exited; one that exited without
/// starting the command leaves the run to be launched again.
fn reap(run: &mut Run) {
    if let Some(child) = &mut run.shim {
        if let Ok(Some(exit)) = child.try_wait() {
            run.shim = None;
            if !run::started(&run.dir) {
                run.unstarted = Some(format!(
                    "the shim exited ({exit}) before starting the command"
                ));
            }
        }
    }
}

/// Whether a run the ledger no longer places here is still alive (it is never launched again).
fn orphan_alive(run: &mut Run) -> bool {
    reap(run);
    run.give_up_launch();
    run.shim.is_some() || run::status(&run.dir) == run::Status::Running
}

/// Where `run` stands: as its directory says, except that a run whose shim this agent
/// launched and is still alive (it may not have written its files yet), or that waits to be
/// launched again, has not been lost.
fn status_of(run: &mut Run) -> run::Status {
    reap(run);
    match run::status(&run.dir) {
        run::Status::Lost if run.shim.is_some() || run.relaunch_pending() => run::Status::Running,
        status => status,
    }
}
