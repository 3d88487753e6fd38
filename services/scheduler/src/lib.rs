//! The scheduler: runs the policy's `decide` on the projection's state whenever events arrive
//! (and on a timer, as contracts expire and grace periods end), and appends the decisions as one
//! atomic batch fenced by the last placement the state has folded ([`Fence::Starts`]). If any
//! placement was appended in between, the log answers `Conflict`, and the scheduler waits for
//! the projection to catch up and decides again — so two schedulers can never both place from
//! stale state. Submissions arriving meanwhile do not stop the decisions from landing, so a
//! steady stream of them cannot starve the scheduler; anything else that arrives meanwhile and
//! makes a decision invalid (a cancel, a GPU failing) gets that decision rejected by the fold.

use std::time::Duration;

use eventlog::{Append, AppendError, EventLog, Expect};
use ledger::policy::PolicyConfig;
use ledger::{Envelope, Event, State};
use projector::Projector;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::sync::{watch, RwLock};
use uuid::Uuid;

pub use ledger::health::{self, HealthMonitor};

/// The actor of the scheduler's decisions: a principal of the role `service` that `serve`
/// grants in the log when it first opens it.
pub const ACTOR: &str = "scheduler";

/// The key-value bucket of the scheduler's lease (see [`eventlog::lease`]), and its key.
pub const LEASE_BUCKET: &str = "fairledger_scheduler";
/// The key of the scheduler's lease.
pub const LEASE_KEY: &str = "leader";

/// Settings of the loop.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// The policy and the contract.
    pub policy: PolicyConfig,
    /// Decide at least this often, even when no event arrives.
    pub tick: Duration,
    /// Heartbeats, turned into GPU health changes.
    pub health: Option<std::sync::Arc<std::sync::Mutex<HealthMonitor>>>,
    /// Decisions the log refuses, left out so that the rest go on.
    pub stuck: std::sync::Arc<Stuck>,
    /// How long passes take and how long started work waited.
    pub metrics: SchedulerMetrics,
    /// The clock passes and heartbeats are read by (the machine's unless a test drives time).
    pub clock: Clock,
}

/// A clock in milliseconds since the epoch. The application injects one into the API and the
/// scheduler (the machine's, [`Clock::wall`], unless a test drives its own), so no handler or
/// pass reads the machine's clock itself.
#[derive(Clone)]
pub struct Clock(std::sync::Arc<dyn Fn() -> u64 + Send + Sync>);

impl Clock {
    /// A clock that reads `now`.
    pub fn new(now: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        Clock(std::sync::Arc::new(now))
    }

    /// The machine's clock.
    pub fn wall() -> Self {
        Clock::new(wall_clock_ms)
    }

    /// The time now, milliseconds since the epoch.
    pub fn now_ms(&self) -> u64 {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::wall()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Clock({} ms)", self.now_ms())
    }
}

/// What the loop measures, for `/metrics`: clones share their figures.
#[derive(Clone, Debug)]
pub struct SchedulerMetrics {
    /// Seconds each pass spent deciding (the policy on the folded state).
    pub pass_seconds: Histogram,
    /// Seconds from submission to first start of the workloads the loop started, by allocation
    /// (`-` for unallocated work).
    pub queue_wait_seconds: Family<Vec<(String, String)>, Histogram>,
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        SchedulerMetrics {
            // 100 µs to about 3 s.
            pass_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 16)),
            // A second to about 12 days.
            queue_wait_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(1.0, 3.0, 14))
            }),
        }
    }
}

impl SchedulerMetrics {
    /// Adds the figures to `registry`; those labelled by allocation only `by_allocation`.
    pub fn register(&self, registry: &mut Registry, by_allocation: bool) {
        registry.register(
            "fairledger_scheduler_pass_duration_seconds",
            "Time each scheduling pass spent deciding.",
            self.pass_seconds.clone(),
        );
        if !by_allocation {
            return;
        }
        registry.register(
            "fairledger_queue_wait_seconds",
            "Time from submission to first start of the workloads started, by allocation.",
            self.queue_wait_seconds.clone(),
        );
    }

    /// Records how long each workload that started for the first time had waited.
    fn record_waits(&self, waits: Vec<(String, f64)>) {
        for (allocation, seconds) in waits {
            self.queue_wait_seconds
                .get_or_create(&vec![("allocation".to_owned(), allocation)])
                .observe(seconds);
        }
    }
}

/// The first starts among `events`, decided at `now_ms` on `state`: each one's allocation and
/// seconds since its submission.
fn first_start_waits(state: &State, events: &[Event], now_ms: u64) -> Vec<(String, f64)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::WorkloadStarted(s) => state.workloads().get(&s.workload),
            _ => None,
        })
        .filter(|w| w.starts == 0)
        .map(|w| {
            (
                state.allocation_path(w).unwrap_or("-").to_owned(),
                now_ms.saturating_sub(w.submitted_at_ms) as f64 / 1000.0,
            )
        })
        .collect()
}

/// Decisions the log would refuse for good (a subject no NATS server takes, for a node whose
/// name was registered before names were checked): each is left out of every pass, so the
/// others still land, logged once, and shown to operators (`/readyz`, `/metrics`).
#[derive(Debug, Default)]
pub struct Stuck {
    /// Why, and when last left out, by the refused event's subject.
    refused: std::sync::Mutex<std::collections::BTreeMap<String, (String, u64)>>,
    /// Decisions left out, counting every pass.
    total: std::sync::atomic::AtomicU64,
}

impl Stuck {
    /// A decision left out within this long is stuck; one no longer decided since is not.
    pub const RECENT_MS: u64 = 60_000;

    /// The decisions stuck as of `now_ms`: subject (printable) and why.
    pub fn list(&self, now_ms: u64) -> Vec<(String, String)> {
        let refused = self.refused.lock().expect("never poisoned");
        refused
            .iter()
            .filter(|(_, (_, at))| at + Self::RECENT_MS > now_ms)
            .map(|(s, (why, _))| (s.escape_debug().to_string(), why.clone()))
            .collect()
    }

    /// Decisions left out so far, counting each pass.
    pub fn total(&self) -> u64 {
        self.total.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Leaves out of `events` those the log would refuse at `now_ms`, recording them.
    fn leave_out(&self, state: &State, events: Vec<Event>, now_ms: u64) -> Vec<Event> {
        let mut kept = Vec::with_capacity(events.len());
        for event in events {
            let subject = eventlog::subject::for_event(&event, state.allocation_of(&event));
            let Err(why) = eventlog::check_subject(&subject) else {
                kept.push(event);
                continue;
            };
            self.total
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut refused = self.refused.lock().expect("never poisoned");
            refused.retain(|_, (_, at)| *at + Self::RECENT_MS > now_ms);
            if !refused.contains_key(&subject) {
                tracing::error!(subject = %subject.escape_debug(), "the log refuses this decision for good; scheduling everything else: {why}");
            }
            refused.insert(subject, (why.to_string(), now_ms));
        }
        kept
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: PolicyConfig::default(),
            tick: Duration::from_secs(1),
            health: None,
            stuck: Default::default(),
            metrics: Default::default(),
            clock: Clock::wall(),
        }
    }
}

/// The events one pass wants appended at `now_ms` ([`ledger::schedule::pass`]), watching
/// every registered node's heartbeats and leaving out what the log refuses for good.
pub fn pass(state: &State, now_ms: u64, config: &SchedulerConfig) -> Vec<Event> {
    let stuck = &config.stuck;
    let mut admit = |events| stuck.leave_out(state, events, now_ms);
    let mut monitor = config
        .health
        .as_ref()
        .map(|h| h.lock().expect("the health monitor is never poisoned"));
    if let Some(monitor) = monitor.as_deref_mut() {
        if state.settings_seq() > 0 {
            monitor.set_timeout(state.settings().heartbeat_timeout_ms());
        }
        // Every node the ledger holds has an agent that should be heard from.
        monitor.watch_registered(state, now_ms);
    }
    // The log's settings, over the configuration the loop was started with.
    ledger::schedule::pass(
        state,
        now_ms,
        &state.policy_config(&config.policy),
        monitor.as_deref_mut(),
        &mut admit,
        eventlog::MAX_BATCH,
    )
}

/// What a pass's decisions are fenced on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fence {
    /// No placement may have been appended since the state's last one
    /// ([`State::last_start_seq`]).
    #[default]
    Starts,
    /// Nothing at all may have been appended since the state's last event: always exact, but
    /// under a steady stream of submissions it rarely lands. The loop falls back to it when
    /// the starts fence keeps conflicting on a state that has caught up (something on the
    /// starts subjects the state could not fold as a start), and a decision that lands with it
    /// puts the two back in step.
    Log,
}

impl Fence {
    /// The fence of the next pass after `conflicts` conflicts in a row: the starts fence, and
    /// from the second conflict on every other pass the log's.
    pub fn after_conflicts(conflicts: u32) -> Fence {
        if conflicts >= 2 && conflicts.is_multiple_of(2) {
            Fence::Log
        } else {
            Fence::Starts
        }
    }

    /// The condition an append fenced this way on `state` puts to the log (the API's cancels
    /// use the starts fence too).
    pub fn expect(self, state: &State) -> Expect {
        match self {
            Fence::Starts => Expect::LastSubjectSequence {
                filter: eventlog::subject::STARTS.to_owned(),
                seq: state.last_start_seq(),
            },
            Fence::Log => Expect::LastSequence(state.last_seq()),
        }
    }
}

/// The appends of one pass, the first carrying `fence`.
pub fn appends(
    state: &State,
    events: Vec<Event>,
    now_ms: u64,
    actor: &str,
    fence: Fence,
) -> Vec<Append> {
    let mut out = Vec::with_capacity(events.len());
    for (i, event) in events.into_iter().enumerate() {
        let allocation = state.allocation_of(&event).map(str::to_owned);
        let env = Envelope::new(Uuid::now_v7(), now_ms, actor, event);
        let mut append = Append::event(&env, allocation.as_deref(), None);
        if i == 0 {
            append = append.expecting(fence.expect(state));
        }
        out.push(append);
    }
    out
}

/// Milliseconds since the Unix epoch.
pub fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What one pass of the loop did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Passed {
    /// Events appended.
    pub appended: usize,
    /// The fence did not hold (the log had moved on): nothing was appended.
    pub conflict: bool,
    /// The sequence of the last event appended.
    pub last_seq: Option<u64>,
}

/// One pass: decide on the projection's state as of `now_ms` and append the decisions, fenced
/// by `fence`. The projection must have folded every placement in the log for the append to go
/// through (with [`Fence::Log`], every event).
pub async fn step<L: EventLog>(
    log: &L,
    projection: &RwLock<Projector>,
    config: &SchedulerConfig,
    now_ms: u64,
    fence: Fence,
) -> Result<Passed, AppendError> {
    let (appends, waits) = {
        let p = projection.read().await;
        let state = p.state();
        let deciding = std::time::Instant::now();
        let events = pass(state, now_ms, config);
        config
            .metrics
            .pass_seconds
            .observe(deciding.elapsed().as_secs_f64());
        if events.is_empty() {
            return Ok(Passed::default());
        }
        // Recorded once the starts land.
        let waits = first_start_waits(state, &events, now_ms);
        (appends(state, events, now_ms, ACTOR, fence), waits)
    };
    let n = appends.len();
    match log.append_batch(appends).await {
        Ok(acks) => {
            config.metrics.record_waits(waits);
            Ok(Passed {
                appended: n,
                conflict: false,
                last_seq: acks.last().map(|a| a.seq),
            })
        }
        Err(AppendError::Conflict { .. }) => Ok(Passed {
            appended: 0,
            conflict: true,
            last_seq: None,
        }),
        Err(e) => Err(e),
    }
}

/// Decides whenever the projection applies new events and at least every `config.tick`, until
/// `stop` resolves. After appending, it waits for the projection to fold its own decisions
/// before deciding again.
pub async fn run<L: EventLog>(
    log: &L,
    projection: &RwLock<Projector>,
    mut applied: watch::Receiver<u64>,
    config: &SchedulerConfig,
    mut lease: Option<eventlog::lease::Lease>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    let mut wait_for = 0u64;
    let mut conflicts = 0u32;
    let mut leading = lease.is_none();
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = applied.changed() => {}
            _ = tokio::time::sleep(config.tick) => {}
        }
        // Debounce: let a burst of events land before deciding.
        tokio::time::sleep(Duration::from_millis(5)).await;
        if let Some(lease) = lease.as_mut() {
            let holds = lease.hold().await;
            if holds != leading {
                tracing::info!(
                    "{}",
                    if holds {
                        "holding the scheduler lease: deciding"
                    } else {
                        "lost the scheduler lease: standing by"
                    }
                );
                leading = holds;
            }
            if !holds {
                continue;
            }
        }
        if *applied.borrow() < wait_for {
            continue;
        }
        let fence = Fence::after_conflicts(conflicts);
        match step(log, projection, config, config.clock.now_ms(), fence).await {
            Ok(Passed {
                last_seq: Some(seq),
                ..
            }) => {
                wait_for = seq;
                conflicts = 0;
            }
            Ok(Passed { conflict: true, .. }) => {
                tracing::debug!(
                    ?fence,
                    "the log moved on while deciding; deciding again on fresh state"
                );
                conflicts += 1;
                // Decide again once the projection holds whatever moved the log.
                if let Ok(last) = log.last_seq().await {
                    wait_for = wait_for.max(last);
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "cannot append decisions; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Feeds heartbeats (from the telemetry stream) into `monitor`, each checked against the
/// projection's cluster, until `stop` resolves or the stream ends. A problem with a node's
/// heartbeats (unknown node or GPUs, clock skew) is logged when it first appears, not with every
/// heartbeat.
pub async fn watch_heartbeats(
    heartbeats: impl futures::Stream<Item = Envelope>,
    projection: &RwLock<Projector>,
    monitor: &std::sync::Mutex<HealthMonitor>,
    clock: &Clock,
    stop: impl std::future::Future<Output = ()>,
) {
    use futures::StreamExt;
    let mut heartbeats = std::pin::pin!(heartbeats);
    let mut stop = std::pin::pin!(stop);
    let mut told: std::collections::BTreeMap<String, Vec<ledger::health::HeartbeatProblem>> =
        Default::default();
    loop {
        let env = tokio::select! {
            _ = &mut stop => return,
            env = heartbeats.next() => match env {
                Some(env) => env,
                None => return,
            },
        };
        let Event::GpuHeartbeat(hb) = &env.event else {
            continue;
        };
        let problems = {
            let p = projection.read().await;
            monitor
                .lock()
                .expect("the health monitor is never poisoned")
                .heartbeat(p.state(), hb, env.occurred_at_ms, clock.now_ms())
        };
        let before = told.entry(hb.node.clone()).or_default();
        for problem in &problems {
            if !before.iter().any(|b| b.same_as(problem)) {
                tracing::warn!("{problem}");
            }
        }
        *before = problems;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::event::GpuHealthChanged;
    use ledger::StateConfig;

    fn health(node: &str) -> Event {
        Event::GpuHealthChanged(GpuHealthChanged {
            node: node.into(),
            gpu: 0,
            healthy: false,
            reason: "silent".into(),
        })
    }

    #[test]
    fn a_decision_the_log_refuses_is_left_out_and_shown_until_no_longer_decided() {
        let state = State::new(StateConfig::default());
        let stuck = Stuck::default();
        let long = "n".repeat(1_000);
        let kept = stuck.leave_out(&state, vec![health(&long), health("n1")], 1_000);
        assert_eq!(kept, vec![health("n1")], "the other decision goes on");
        let shown = stuck.list(2_000);
        assert_eq!(shown.len(), 1);
        assert!(
            shown[0].0.contains(&long) && !shown[0].1.is_empty(),
            "{shown:?}"
        );
        stuck.leave_out(&state, vec![health(&long)], 3_000);
        assert_eq!(stuck.total(), 2, "every pass that leaves it out counts");
        assert_eq!(
            stuck.list(3_000 + Stuck::RECENT_MS).len(),
            0,
            "no longer decided"
        );
    }
}
