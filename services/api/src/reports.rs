//! What a node's agent may report, however it reaches the ledger (`POST /v1/nodes/{node}/events`,
//! or from inside the server): its node's registration and the ends of the runs placed on it,
//! stamped with its own actor and never ahead of the server's clock; nothing else.

use std::sync::Arc;

use eventlog::{Append, AppendError, Appended, EventLog, LogError, Stored};
use futures::stream::BoxStream;
use ledger::identity::Action;
use ledger::{Envelope, Event, Phase};
use serde::Deserialize;
use serde_json::json;

use crate::{App, Problem};

/// One report of `POST /v1/nodes/{node}/events`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeReport {
    /// Makes a retry harmless: an event whose key was appended before is not appended again.
    pub idempotency_key: String,
    /// The event in its envelope (schemas/envelope.json), stamped by the agent with its own
    /// actor.
    #[schema(value_type = Object)]
    pub envelope: Envelope,
}

/// The body of `POST /v1/nodes/{node}/events`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeEventsBody {
    /// One to 16 reports, appended all or none.
    pub events: Vec<NodeReport>,
}

/// The most reports one call may carry.
const NODE_EVENTS_MAX: usize = 16;

/// Appends a node's checked reports all or none: `{"seqs", "duplicate"}`.
pub async fn append(app: &App, appends: Vec<Append>) -> Result<serde_json::Value, Problem> {
    match app.inner.log.append_batch(appends).await {
        Ok(acks) => {
            let seqs: Vec<u64> = acks.iter().map(|a| a.seq).collect();
            Ok(json!({"seqs": seqs, "duplicate": false}))
        }
        Err(eventlog::AppendError::DuplicateBatch(_)) => Ok(json!({"seqs": [], "duplicate": true})),
        Err(e) => Err(Problem::unavailable(e.to_string())),
    }
}

/// Checks the reports of `node`'s agent, whose events must name `actor` as theirs, against the
/// state: only its registration and the ends of runs placed on it, never stamped ahead of the
/// server's clock. Answers the appends, each keyed by the agent's own idempotency key.
pub fn check(
    state: &ledger::State,
    node: &str,
    actor: &str,
    reports: &[NodeReport],
) -> Result<Vec<Append>, Problem> {
    if reports.is_empty() || reports.len() > NODE_EVENTS_MAX {
        return Err(Problem::invalid(
            "events",
            format!("1 to {NODE_EVENTS_MAX} reports"),
        ));
    }
    let here = state.cluster.get(node);
    let mut appends = Vec::with_capacity(reports.len());
    for (i, report) in reports.iter().enumerate() {
        let field = format!("events[{i}].envelope");
        let env = &report.envelope;
        if env.actor != actor {
            return Err(Problem {
                field: Some(format!("{field}.actor")),
                ..Problem::forbidden(format!(
                    "a report is made by its sender: this one claims {:?}, and its sender is {actor:?}",
                    env.actor
                ))
            });
        }
        let key = &report.idempotency_key;
        if key.is_empty() || key.len() > 128 {
            return Err(Problem::invalid(
                &format!("events[{i}].idempotency_key"),
                "1 to 128 characters",
            ));
        }
        let now = scheduler::wall_clock_ms();
        let ahead = env.occurred_at_ms.saturating_sub(now);
        if ahead > state.config().clock_skew_tolerance_ms {
            return Err(Problem::invalid(
                &format!("{field}.occurred_at_ms"),
                format!(
                    "{:.1} s ahead of the server's clock: fix the node's clock (NTP)",
                    ahead as f64 / 1000.0
                ),
            ));
        }
        let ok = match &env.event {
            Event::NodeRegistered(e) => e.node == node,
            Event::WorkloadFinished(_) | Event::WorkloadStopped(_) | Event::WorkloadRequeued(_) => {
                let id = env.event.workload().expect("about a workload");
                state.workloads.get(&id).is_some_and(|w| {
                    w.phase == Phase::Stopped || w.placement.iter().any(|p| Some(p.node) == here)
                })
            }
            _ => {
                return Err(Problem::invalid(
                    &format!("{field}.type"),
                    "an agent reports node_registered, workload_finished, workload_stopped and workload_requeued",
                ))
            }
        };
        if !ok {
            return Err(Problem {
                field: Some(field),
                ..Problem::forbidden(format!(
                    "this {} is not node {node:?}'s to report: it names another node, or a workload not running there",
                    env.event.kind()
                ))
            });
        }
        let allocation = state.allocation_of(&env.event);
        // Keys are the sender's own: another principal's equal key is another report.
        appends.push(Append::event(
            env,
            allocation,
            Some(&format!("{actor}/{key}")),
        ));
    }
    Ok(appends)
}

/// The ledger as an agent inside the server sees it: reads straight from the log, reports through
/// [`check`] as the principal whose token it holds. An agent in the server is an agent like any
/// other: scoped to its node, its events stamped with its actor, silenced by a revocation.
#[derive(Clone)]
pub struct LocalAgentLog {
    app: App,
    token: Arc<str>,
    node: Arc<str>,
}

impl LocalAgentLog {
    /// The log of `app` for the agent of `node` holding `token`.
    pub fn new(app: App, token: &str, node: &str) -> Self {
        LocalAgentLog {
            app,
            token: token.into(),
            node: node.into(),
        }
    }

    /// The actor its token stands for now.
    pub async fn actor(&self) -> Result<String, String> {
        let p = self.app.projection().read().await;
        crate::auth::authenticate(p.state(), &self.token, scheduler::wall_clock_ms())
            .map(|caller| caller.actor())
            .map_err(|problem| problem.detail)
    }
}

impl EventLog for LocalAgentLog {
    async fn append_batch(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        let mut reports = Vec::with_capacity(appends.len());
        for a in &appends {
            let envelope: Envelope = serde_json::from_slice(&a.payload)
                .map_err(|e| AppendError::Refused(format!("not an event: {e}")))?;
            reports.push(NodeReport {
                idempotency_key: a.msg_id.clone().unwrap_or_else(|| envelope.id.to_string()),
                envelope,
            });
        }
        let checked = {
            let p = self.app.projection().read().await;
            let state = p.state();
            let refused = |problem: Problem| AppendError::Refused(problem.detail);
            let caller = crate::auth::authenticate(state, &self.token, scheduler::wall_clock_ms())
                .map_err(refused)?;
            caller
                .allow(&Action::ReportForNode { node: &self.node }, state)
                .map_err(refused)?;
            check(state, &self.node, &caller.actor(), &reports).map_err(refused)?
        };
        self.app.log().append_batch(checked).await
    }

    async fn last_seq(&self) -> Result<u64, LogError> {
        self.app.log().last_seq().await
    }

    async fn read(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        self.app.log().read(from, max).await
    }

    async fn subscribe(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        self.app.log().subscribe(from).await
    }
}
