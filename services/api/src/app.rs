//! What the handlers share: the log, the projection and its folds, the policy, readiness, and
//! the heartbeats' health monitor; and how a handler writes (append, wait for the fold, answer the
//! fold's verdict).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use eventlog::{AnyLog, Append, EventLog};
use ledger::policy::PolicyConfig;
use ledger::{Envelope, Event, WorkloadId};
use projector::Projector;
use tokio::sync::{watch, RwLock};
use uuid::Uuid;

use crate::Problem;

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 * 1024;
/// How long a write waits for the projection to fold it.
const FOLD_TIMEOUT: Duration = Duration::from_secs(10);

/// The clock the API reads: the application injects it (the machine's unless a test drives
/// its own), so no handler reads the machine's clock itself; the scheduler reads the same.
pub use scheduler::Clock;

/// What the handlers share.
#[derive(Clone)]
pub struct App {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) clock: Clock,
    pub(crate) log: AnyLog,
    pub(crate) projection: Arc<RwLock<Projector>>,
    pub(crate) applied: watch::Receiver<u64>,
    pub(crate) policy: PolicyConfig,
    pub(crate) ready: AtomicBool,
    pub(crate) health: Arc<std::sync::Mutex<scheduler::HealthMonitor>>,
    /// Decisions the log refuses for good, which the scheduler leaves out.
    pub(crate) stuck: Arc<scheduler::Stuck>,
    /// The histograms `/metrics` shows.
    pub(crate) metrics: crate::metrics::Metrics,
    /// What-ifs running at once: at most half the cores.
    pub(crate) whatifs: Arc<tokio::sync::Semaphore>,
    /// One verification of the kept figures at a time.
    pub(crate) verifying: Arc<tokio::sync::Semaphore>,
    /// Event streams replaying a long stretch of history, a few at a time.
    pub(crate) replays: Arc<tokio::sync::Semaphore>,
    /// Audits of periods, at most half the cores at a time: however many auditors query, the
    /// writers keep the other half.
    pub(crate) audits: Arc<tokio::sync::Semaphore>,
    /// The projection's position when `/readyz` last saw it move, and when: a projection that
    /// stops moving while the log holds more is stalled.
    pub(crate) progress: std::sync::Mutex<(u64, std::time::Instant)>,
    /// How long a write waits for the projection to fold it ([`FOLD_TIMEOUT`]).
    pub(crate) fold_timeout: Duration,
    /// Each principal's turns at costly requests.
    pub(crate) limits: crate::limits::Limiter,
    /// Which agent drives each node.
    pub(crate) leases: crate::leases::NodeLeases,
    /// Where runs' output is kept, once the application opened it.
    pub(crate) output: std::sync::OnceLock<eventlog::output::AnyOutput>,
    /// The key principals' notification secrets derive from.
    pub(crate) notify_key: std::sync::OnceLock<[u8; 32]>,
    /// The notifier, in the process that runs it.
    pub(crate) notifier: std::sync::OnceLock<Arc<crate::notify::Notifier>>,
    /// The queue's last explained plan and summary: the ledger position and time they were
    /// worked out at.
    #[allow(clippy::type_complexity)]
    pub(crate) queue_plan: std::sync::Mutex<
        Option<(
            u64,
            u64,
            Arc<(ledger::policy::Plan, ledger::policy::summary::QueueSummary)>,
        )>,
    >,
}

/// Event streams that may replay more than [`REPLAY_FREE`] past events at once, and at most
/// half the cores; the others wait their turn (live streams never wait).
pub const REPLAYS_AT_ONCE: usize = 4;
/// A stream starting at most this many events behind is live, not a replay.
pub const REPLAY_FREE: u64 = 1_000;

impl App {
    /// The API over `log` and its shared `projection`, whose folds are announced on `applied`.
    pub fn new(
        log: AnyLog,
        projection: Arc<RwLock<Projector>>,
        applied: watch::Receiver<u64>,
        policy: PolicyConfig,
    ) -> Self {
        Self::with_clock(log, projection, applied, policy, Clock::wall())
    }

    /// [`App::new`] reading `clock` for the time.
    pub fn with_clock(
        log: AnyLog,
        projection: Arc<RwLock<Projector>>,
        applied: watch::Receiver<u64>,
        policy: PolicyConfig,
        clock: Clock,
    ) -> Self {
        App {
            inner: Arc::new(Inner {
                clock,
                log,
                projection,
                applied,
                policy,
                ready: AtomicBool::new(false),
                health: Arc::new(std::sync::Mutex::new(scheduler::HealthMonitor::new(
                    ledger::health::DEFAULT_TIMEOUT_MS,
                ))),
                stuck: Default::default(),
                metrics: Default::default(),
                whatifs: Arc::new(tokio::sync::Semaphore::new(
                    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
                )),
                verifying: Arc::new(tokio::sync::Semaphore::new(1)),
                replays: Arc::new(tokio::sync::Semaphore::new(REPLAYS_AT_ONCE.min(
                    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
                ))),
                audits: Arc::new(tokio::sync::Semaphore::new(
                    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1)),
                )),
                queue_plan: Default::default(),
                progress: std::sync::Mutex::new((0, std::time::Instant::now())),
                fold_timeout: FOLD_TIMEOUT,
                limits: Default::default(),
                leases: Default::default(),
                output: Default::default(),
                notify_key: Default::default(),
                notifier: Default::default(),
            }),
        }
    }

    /// Holds `node` for an agent inside this process (`holder` names it) for as long as the
    /// process runs: an agent from outside is refused it.
    pub fn drive_node_here(&self, node: &str, holder: &str) -> Result<(), String> {
        self.inner
            .leases
            .claim(node, holder, true)
            .map_err(|p| p.detail)
    }

    /// The application's clock.
    pub fn clock(&self) -> &Clock {
        &self.inner.clock
    }

    /// The time by the application's clock, milliseconds since the epoch.
    pub fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    /// Keeps runs' output in `store` (set once).
    pub fn set_output(&self, store: eventlog::output::AnyOutput) {
        let _ = self.inner.output.set(store);
    }

    /// Where runs' output is kept: for agents inside this process.
    pub fn output(&self) -> Option<&eventlog::output::AnyOutput> {
        self.inner.output.get()
    }

    /// The notifier, where this process runs it.
    pub fn notifier(&self) -> Option<&Arc<crate::notify::Notifier>> {
        self.inner.notifier.get()
    }

    /// Sets how long a node may stay silent before its GPUs go unhealthy.
    pub fn set_heartbeat_timeout(&self, timeout_ms: u64) {
        self.inner
            .health
            .lock()
            .expect("the health monitor is never poisoned")
            .set_timeout(timeout_ms);
    }

    /// The heartbeats the API has received, for the scheduler to turn into health changes.
    pub fn health(&self) -> Arc<std::sync::Mutex<scheduler::HealthMonitor>> {
        self.inner.health.clone()
    }

    /// The projection the handlers read.
    pub fn projection(&self) -> &Arc<RwLock<Projector>> {
        &self.inner.projection
    }

    /// The event log.
    pub fn log(&self) -> &AnyLog {
        &self.inner.log
    }

    /// Waits for a turn to compute an audit of a period (see `Inner::audits`).
    pub(crate) async fn audit_turn(&self) -> tokio::sync::OwnedSemaphorePermit {
        self.inner
            .audits
            .clone()
            .acquire_owned()
            .await
            .expect("the audit turns are never closed")
    }

    /// The projection's row of workload `id`, or a 404 saying there is none.
    pub(crate) async fn workload_row(&self, id: Uuid) -> Result<projector::WorkloadRow, Problem> {
        self.inner
            .projection
            .read()
            .await
            .workload(id)
            .map_err(|e| Problem::unavailable(e.to_string()))?
            .ok_or_else(|| Problem::not_found(format!("no workload {id}")))
    }

    /// The events at `seqs` (in that order), read back from the log; a sequence the log lacks,
    /// or whose event does not decode, is left out.
    pub(crate) async fn events_at(&self, seqs: &[u64]) -> Result<Vec<(u64, Envelope)>, Problem> {
        let mut out = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            let stored = self
                .inner
                .log
                .read(seq, 1)
                .await
                .map_err(|e| Problem::unavailable(e.to_string()))?;
            if let Some(env) = stored
                .into_iter()
                .find(|e| e.seq == seq)
                .and_then(|e| projector::decode(&e.payload).ok())
            {
                out.push((seq, env));
            }
        }
        Ok(out)
    }

    /// Marks the projection as caught up with the log (`/readyz` answers 200 from now on).
    pub fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
    }

    /// Waits until the projection has folded `seq`; false on timeout.
    pub async fn folded(&self, seq: u64) -> bool {
        let mut applied = self.inner.applied.clone();
        let wait = async {
            while *applied.borrow_and_update() < seq {
                if applied.changed().await.is_err() {
                    return false;
                }
            }
            true
        };
        tokio::time::timeout(self.inner.fold_timeout, wait)
            .await
            .unwrap_or(false)
    }

    /// Appends one event about `allocation` keyed by `key`, written by `actor`, unless the fold
    /// would refuse it now ([`ledger::State::check`]: 422 naming the field, or 409 naming the
    /// rule, and nothing written); waits for the fold, and turns a rejection by the fold (the
    /// state moved in between) into a 409 naming the rule. Answers its sequence.
    pub async fn write(
        &self,
        event: Event,
        allocation: Option<&str>,
        key: Option<&str>,
        actor: &str,
    ) -> Result<u64, Problem> {
        match self.write_durable(event, allocation, key, actor).await? {
            Written::Folded(seq) => Ok(seq),
            Written::Durable(seq) => Err(not_folded(seq)),
            Written::Duplicate(original) => Err(duplicate(original)),
        }
    }

    /// [`App::write`], fenced by `fence` when given: `Err(None)` means the log moved on and
    /// the caller should decide again.
    pub(crate) async fn write_expecting(
        &self,
        event: Event,
        allocation: Option<&str>,
        key: Option<&str>,
        actor: &str,
        fence: Option<eventlog::Expect>,
    ) -> Result<u64, Option<Problem>> {
        match self
            .append_checked(event, allocation, key, actor, fence)
            .await?
        {
            Written::Folded(seq) => Ok(seq),
            Written::Durable(seq) => Err(Some(not_folded(seq))),
            Written::Duplicate(original) => Err(Some(duplicate(original))),
        }
    }

    /// [`App::write`], answering an event that is durable but not folded within the wait as
    /// [`Written::Durable`] rather than as a failure: for a submission, which its client must
    /// not take for lost (a retry with its idempotency key finds it).
    pub(crate) async fn write_durable(
        &self,
        event: Event,
        allocation: Option<&str>,
        key: Option<&str>,
        actor: &str,
    ) -> Result<Written, Problem> {
        self.append_checked(event, allocation, key, actor, None)
            .await
            .map_err(|e| e.unwrap_or_else(|| unreachable!("no expectation, no conflict")))
    }

    async fn append_checked(
        &self,
        event: Event,
        allocation: Option<&str>,
        key: Option<&str>,
        actor: &str,
        fence: Option<eventlog::Expect>,
    ) -> Result<Written, Option<Problem>> {
        let env = Envelope::new(Uuid::now_v7(), self.now_ms(), actor, event);
        {
            let p = self.inner.projection.read().await;
            let state = p.state();
            // A key the ledger already holds is that submission again: nothing is appended.
            if let Some(original) = key.and_then(|k| state.idempotent(k)) {
                return Ok(Written::Duplicate(original));
            }
            // Refused means nothing written: what the fold would reject now is not appended.
            state
                .check(&env)
                .map_err(|r| Some(Problem::refused(&r, &env.event)))?;
        }
        let mut append = Append::event(&env, allocation, key);
        let fenced = fence.is_some();
        if let Some(fence) = fence {
            append = append.expecting(fence);
        }
        let ack = match self.inner.log.append(append).await {
            Ok(ack) => ack,
            Err(eventlog::AppendError::Conflict { .. }) if fenced => return Err(None),
            Err(e) => return Err(Some(Problem::not_appended(&e))),
        };
        if !self.folded(ack.seq).await {
            tracing::warn!(
                seq = ack.seq,
                "an event is durable but the projection has not folded it within {:?}",
                self.inner.fold_timeout
            );
            return Ok(Written::Durable(ack.seq));
        }
        let p = self.inner.projection.read().await;
        let rejection = p
            .rejection(ack.seq)
            .map_err(|e| Some(Problem::unavailable(e.to_string())))?;
        match rejection {
            // Refused by the fold after the check above (what landed in between changed the
            // verdict): answered as the same rule is before the fold.
            Some(r) => Err(Some(Problem::of_rule(
                &r.code,
                r.message,
                r.field.as_deref(),
            ))),
            None => {
                // A retry whose first attempt landed after the check above: the log (within its
                // duplicate window) or the fold (after it) took it as that submission again.
                let original = key
                    .and_then(|k| p.state().idempotent(k))
                    .filter(|&original| Some(original) != env.event.workload());
                Ok(original.map_or(Written::Folded(ack.seq), Written::Duplicate))
            }
        }
    }
}

/// A write durable at `seq` that the projection has not folded in time, as the 503 that says so.
fn not_folded(seq: u64) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "durable-not-folded",
        format!(
            "the change is durable (event {seq}) but not yet folded: it takes effect when the \
             projection catches up (see /readyz); read it back shortly"
        ),
    )
}

/// A write whose key the ledger already holds, for a caller that wanted a new sequence.
fn duplicate(original: Uuid) -> Problem {
    Problem::new(
        StatusCode::CONFLICT,
        "duplicate",
        format!("this key was used already, by {original}: nothing was written"),
    )
}

/// An event appended to the log, or found there already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Written {
    /// Durable and folded at this sequence: what it does is in every read from now on.
    Folded(u64),
    /// Durable at this sequence, but the projection did not fold it in time: it takes effect
    /// when the projection catches up.
    Durable(u64),
    /// Not written again: its key is the submission of this workload's, which the ledger holds
    /// (decided here once for the whole path: before appending, or by the log or the fold when a
    /// first attempt landed meanwhile).
    Duplicate(WorkloadId),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write the projection does not fold in time is durable, and said to be: a submission
    /// answers it as accepted, not as a failure (its client must not submit it again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_the_projection_does_not_fold_in_time_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let log = AnyLog::Embedded(eventlog::EmbeddedLog::open(&dir.path().join("log")).unwrap());
        let projector = Projector::open(&dir.path().join("projection"), Default::default(), &log)
            .await
            .unwrap();
        // No projector folds: the applied position never moves.
        let (_applied_tx, applied) = watch::channel(0);
        let mut app = App::new(
            log.clone(),
            Arc::new(RwLock::new(projector)),
            applied,
            PolicyConfig::default(),
        );
        Arc::get_mut(&mut app.inner).unwrap().fold_timeout = Duration::from_millis(50);
        let set = Event::AllocationSet(ledger::event::AllocationSet {
            path: "team".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        });
        let written = app
            .write_durable(set.clone(), None, None, "user:admin")
            .await;
        assert_eq!(written, Ok(Written::Durable(1)));
        assert_eq!(log.last_seq().await.unwrap(), 1, "it is in the log");
        // Any other write says so, as a 503 naming it durable.
        let problem = app.write(set, None, None, "user:admin").await.unwrap_err();
        assert_eq!(problem.status, 503);
        assert!(
            problem.kind.ends_with("durable-not-folded") && problem.detail.contains("event 2"),
            "{problem:?}"
        );
    }
}
