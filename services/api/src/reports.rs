//! What a node's agent may report, however it reaches the ledger (`POST /v1/nodes/{node}/events`,
//! a request on NATS answered by [`relay`], or from inside the server): its node's registration
//! and the ends of the runs placed on it, stamped with its own actor and no further ahead of the
//! server's clock than the ledger's clock skew tolerance; nothing else. Only the service writes the ledger's subjects.

use std::sync::Arc;

use eventlog::{Append, AppendError, Appended, EventLog, LogError, Stored};
use futures::stream::BoxStream;
use ledger::identity::Action;
use ledger::Envelope;
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
        Err(e) => Err(Problem::not_appended(&e)),
    }
}

/// Checks the reports of `node`'s agent, whose events must name `actor` as theirs, by the
/// ledger's rules for a batch of reports ([`ledger::State::check_reports`]), received at
/// `now_ms`. Answers the appends, each keyed by the agent's own idempotency key.
pub fn check(
    state: &ledger::State,
    node: &str,
    actor: &str,
    reports: &[NodeReport],
    now_ms: u64,
) -> Result<Vec<Append>, Problem> {
    if reports.is_empty() || reports.len() > NODE_EVENTS_MAX {
        return Err(Problem::invalid(
            "events",
            format!("1 to {NODE_EVENTS_MAX} reports"),
        ));
    }
    for (i, report) in reports.iter().enumerate() {
        let key = &report.idempotency_key;
        // It becomes a NATS header: printable ASCII only.
        let printable = key.bytes().all(|b| (b' '..=b'~').contains(&b));
        if key.is_empty() || key.len() > 128 || !printable {
            return Err(Problem::invalid(
                &format!("events[{i}].idempotency_key"),
                "1 to 128 printable ASCII characters",
            ));
        }
    }
    // The ledger's rules for a batch of reports, then its answer as a problem naming the field.
    let envelopes: Vec<&Envelope> = reports.iter().map(|r| &r.envelope).collect();
    if let Err((i, refusal)) = state.check_reports(node, actor, &envelopes, now_ms) {
        use ledger::reports::{BatchRefusal, ReportRefusal};
        let field = format!("events[{i}].envelope");
        let at = |f: String, problem: Problem| Problem {
            field: Some(f),
            ..problem
        };
        return Err(match &refusal {
            BatchRefusal::NotTheSender { .. } => at(
                format!("{field}.actor"),
                Problem::forbidden(refusal.to_string()),
            ),
            BatchRefusal::Ahead { .. } => {
                Problem::invalid(&format!("{field}.occurred_at_ms"), refusal.to_string())
            }
            BatchRefusal::Report(ReportRefusal::NotAReport { .. }) => {
                Problem::invalid(&format!("{field}.type"), refusal.to_string())
            }
            BatchRefusal::Report(ReportRefusal::NotYours { .. }) => {
                at(field, Problem::forbidden(refusal.to_string()))
            }
            BatchRefusal::Report(ReportRefusal::StopNotAsked { .. }) => at(
                format!("{field}.payload.reason"),
                Problem::forbidden(refusal.to_string()),
            ),
            BatchRefusal::Rejected(r) => {
                let problem = Problem::refused(r, &envelopes[i].event);
                let inner = problem.field.clone();
                at(
                    inner.map_or(field.clone(), |f| format!("{field}.payload.{f}")),
                    problem,
                )
            }
            BatchRefusal::AlreadyReported { .. } => at(
                field,
                Problem::new(
                    axum::http::StatusCode::CONFLICT,
                    "already_reported",
                    refusal.to_string(),
                ),
            ),
        });
    }
    Ok(reports
        .iter()
        .map(|report| {
            let env = &report.envelope;
            // Keys are the sender's own: another principal's equal key is another report.
            Append::event(
                env,
                state.allocation_of(&env.event),
                Some(&format!("{actor}/{}", report.idempotency_key)),
            )
        })
        .collect())
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
        crate::auth::authenticate(p.state(), &self.token, self.app.now_ms())
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
            let caller = crate::auth::authenticate(state, &self.token, self.app.now_ms())
                .map_err(refused)?;
            caller
                .allow(&Action::ReportForNode { node: &self.node }, state)
                .map_err(refused)?;
            check(
                state,
                &self.node,
                &caller.actor(),
                &reports,
                self.app.now_ms(),
            )
            .map_err(refused)?
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

/// Answers node agents' reports sent over NATS (`fairledger.report.<node>`) until `stop`: each is
/// checked as `POST /v1/nodes/{node}/events` checks it, as sent by `agent:<node>` (the server
/// lets only that node's agent publish on that subject), and appended. The answer is the HTTP
/// route's body: `{"seqs", "duplicate"}`, or a problem. Processes serving the API share the work
/// through a queue group.
pub async fn relay(
    app: App,
    js: eventlog::JetStreamLog,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    use futures::StreamExt;
    let mut requests = js
        .client()
        .queue_subscribe(
            format!("{}.*", eventlog::subject::REPORTS_PREFIX),
            "fairledger-reports".into(),
        )
        .await
        .map_err(|e| format!("cannot listen for node reports on NATS: {e}"))?;
    // A bound on the reports in flight at once.
    let slots = Arc::new(tokio::sync::Semaphore::new(64));
    let mut stop = std::pin::pin!(stop);
    loop {
        let message = tokio::select! {
            _ = &mut stop => return Ok(()),
            m = requests.next() => match m {
                Some(m) => m,
                None => return Err("the NATS subscription for node reports ended".into()),
            },
        };
        let Some(reply) = message.reply.clone() else {
            continue;
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return Ok(());
        };
        let (app, client) = (app.clone(), js.client().clone());
        tokio::spawn(async move {
            let answer = match answer_report(&app, &message).await {
                Ok(body) => body,
                Err(problem) => serde_json::to_value(&problem).expect("a problem serializes"),
            };
            if let Err(e) = client.publish(reply, answer.to_string().into()).await {
                tracing::warn!(error = %e, "cannot answer a node report");
            }
            drop(permit);
        });
    }
}

async fn answer_report(
    app: &App,
    message: &async_nats::Message,
) -> Result<serde_json::Value, Problem> {
    let node = message
        .subject
        .strip_prefix(eventlog::subject::REPORTS_PREFIX)
        .and_then(|rest| rest.strip_prefix('.'))
        .unwrap_or_default();
    ledger::names::node(node).map_err(|r| Problem::invalid("node", r))?;
    let body: NodeEventsBody =
        serde_json::from_slice(&message.payload).map_err(|e| crate::problem::json_error(&e))?;
    let actor = format!("agent:{node}");
    let appends = {
        let p = app.projection().read().await;
        check(p.state(), node, &actor, &body.events, app.now_ms())?
    };
    append(app, appends).await
}
