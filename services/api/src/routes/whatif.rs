//! What-if: the live state forked at its last sequence and run forward with and without changes
//! ([`ledger::whatif`]), off the request threads, a few at a time and within a time limit. The
//! ledger is not written: a what-if only reads.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Query, State};
use axum::http::header;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ledger::identity::Action;
use ledger::whatif::{self, Change, PolicyChange, Question, WhatIfError};
use serde::Deserialize;
use serde_json::{json, Value};

use super::bad_body;
use crate::auth::Caller;
use crate::{problem, App, Problem};

/// The longest horizon.
pub const HORIZON_MAX_S: u64 = 30 * 86_400;
/// The most GPU-seconds a what-if simulates per side: its horizon times the cluster's GPUs
/// (2,000 nodes of 8 GPUs for a day is about 1.4e9).
pub const GPU_SECONDS_MAX: u64 = 1_500_000_000;
/// How long a what-if may take before it is given up with a 503.
pub const TIME_LIMIT: Duration = Duration::from_secs(20);
/// The most changes one what-if tries.
pub const CHANGES_MAX: usize = 100;
/// The most nodes one what-if adds, over all its changes.
pub const ADDED_NODES_MAX: u64 = 10_000;
/// The most resampled arrivals one what-if simulates.
pub const ARRIVALS_MAX: u64 = 1_000_000;
/// Rows of recent history read to learn run times and arrivals.
const HISTORY_ROWS: usize = 50_000;

/// A what-if.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct WhatIfRequest {
    /// The changes, tried together: `{"allocation": PATH, "weight": W, "max_gpus": N}` (set or
    /// create), `{"remove_allocation": PATH}`, `{"policy": {"name", "margin", "min_runtime_s",
    /// "grace_s", "reservations_max", "defragment"}}`, `{"add_nodes": {"count", "gpus", "model", "labels"}}`,
    /// `{"remove_nodes": [NODE]}` (drained), `{"fail_gpus": [{"node", "gpu"}]}`.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    changes: Vec<Value>,
    /// How far to look ahead, in seconds.
    horizon_s: u64,
    /// `none` (default): only the work there is now; `recent`: also new submissions like those
    /// of the last usage window, resampled with `seed`.
    #[serde(default)]
    arrivals: Option<String>,
    /// The seed of the resampled arrivals.
    #[serde(default)]
    seed: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetAllocation {
    allocation: String,
    weight: u32,
    #[serde(default)]
    max_gpus: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveAllocation {
    remove_allocation: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyBody {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    margin: Option<f64>,
    #[serde(default)]
    min_runtime_s: Option<u64>,
    #[serde(default)]
    grace_s: Option<u64>,
    #[serde(default)]
    reservations_max: Option<u32>,
    #[serde(default)]
    defragment: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetPolicy {
    policy: PolicyBody,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodesBody {
    count: u32,
    gpus: u32,
    model: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddNodes {
    add_nodes: NodesBody,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveNodes {
    remove_nodes: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FailedGpu {
    node: String,
    gpu: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FailGpus {
    fail_gpus: Vec<FailedGpu>,
}

/// Change `i` of a request, read by the key that says what it is.
fn change(i: usize, v: &Value) -> Result<Change, Problem> {
    let field = format!("changes[{i}]");
    let read = |e: serde_json::Error| Problem::invalid(&field, e.to_string());
    let Some(object) = v.as_object() else {
        return Err(Problem::invalid(&field, "a change is an object"));
    };
    let has = |k: &str| object.contains_key(k);
    Ok(if has("allocation") {
        let c: SetAllocation = serde_json::from_value(v.clone()).map_err(read)?;
        Change::SetAllocation {
            path: c.allocation,
            weight: c.weight,
            max_gpus: c.max_gpus,
        }
    } else if has("remove_allocation") {
        let c: RemoveAllocation = serde_json::from_value(v.clone()).map_err(read)?;
        Change::RemoveAllocation {
            path: c.remove_allocation,
        }
    } else if has("policy") {
        let c: SetPolicy = serde_json::from_value(v.clone()).map_err(read)?;
        Change::Policy(PolicyChange {
            name: c.policy.name,
            margin: c.policy.margin,
            min_runtime_ms: c.policy.min_runtime_s.map(|s| s.saturating_mul(1000)),
            grace_ms: c.policy.grace_s.map(|s| s.saturating_mul(1000)),
            reservations_max: c.policy.reservations_max,
            defragment: c.policy.defragment,
        })
    } else if has("add_nodes") {
        let c: AddNodes = serde_json::from_value(v.clone()).map_err(read)?;
        if !(1..=10_000).contains(&c.add_nodes.count) {
            return Err(Problem::invalid(
                &field,
                "add_nodes.count must be 1 to 10000",
            ));
        }
        Change::AddNodes {
            count: c.add_nodes.count,
            gpus: c.add_nodes.gpus,
            model: c.add_nodes.model,
            labels: c.add_nodes.labels,
        }
    } else if has("remove_nodes") {
        let c: RemoveNodes = serde_json::from_value(v.clone()).map_err(read)?;
        Change::RemoveNodes(c.remove_nodes)
    } else if has("fail_gpus") {
        let c: FailGpus = serde_json::from_value(v.clone()).map_err(read)?;
        Change::FailGpus(c.fail_gpus.into_iter().map(|g| (g.node, g.gpu)).collect())
    } else {
        return Err(Problem::invalid(
            &field,
            "a change is one of allocation (with weight), remove_allocation, policy, add_nodes, remove_nodes, fail_gpus",
        ));
    })
}

/// The allocation a change touches, for the caller's scope: `None` for the whole cluster.
fn touches(c: &Change) -> Option<&str> {
    match c {
        Change::SetAllocation { path, .. } | Change::RemoveAllocation { path } => Some(path),
        _ => None,
    }
}

#[utoipa::path(post, path = "/v1/whatif", tag = "allocations",
    params(WhatIfQuery),
    request_body = WhatIfRequest,
    responses(
        (status = 200, description = "the same horizon from the live state without and with the changes: per allocation owed and delivered GPU-hours, waits and preemptions; the cluster's occupancy; when each pending workload would start. Nothing is written.", body = serde_json::Value),
        (status = 403, description = "a submitter's change outside its allocations, or to the whole cluster", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a change or the horizon is invalid; `field` names it (`changes[1]`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "it did not finish within the time limit, or too many are running", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn what_if(
    State(app): State<App>,
    caller: Caller,
    query: Result<Query<WhatIfQuery>, axum::extract::rejection::QueryRejection>,
    body: Result<Json<WhatIfRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(super::bad_query)?;
    let html = match query.format.as_deref() {
        None | Some("json") => false,
        Some("html") => true,
        Some(other) => {
            return Err(Problem::invalid(
                "format",
                format!("format={other} is not known; use json or html"),
            ))
        }
    };
    let Json(request) = body.map_err(bad_body)?;
    app.inner
        .limits
        .take(&caller.0, ledger::identity::RateKind::WhatIf)?;
    let title = describe(&request.changes);
    let asked = Asked::read(
        &request.changes,
        request.horizon_s,
        request.arrivals.as_deref(),
        request.seed,
    )?;
    let (state, policy) = {
        let p = app.inner.projection.read().await;
        let state = p.state();
        for c in &asked.changes {
            caller.allow(
                &Action::WhatIf {
                    allocation: touches(c),
                },
                state,
            )?;
        }
        asked.fits(state)?;
        (state.clone(), state.policy_config(&app.inner.policy))
    };
    let mine = app
        .inner
        .limits
        .hold(&caller.0, ledger::identity::RateKind::WhatIf)?;
    let Ok(Ok(turn)) = tokio::time::timeout(
        Duration::from_secs(2),
        app.inner.whatifs.clone().acquire_owned(),
    )
    .await
    else {
        return Err(Problem::unavailable(
            "every what-if slot is busy; try again in a few seconds",
        ));
    };
    let kept = app.inner.projection.read().await.kept();
    let answered = tokio::task::spawn_blocking(move || {
        // The turn is held by the work itself: a client that goes away does not free it while
        // the what-if still runs.
        let _turn = (turn, mine);
        answer(
            &state,
            &policy,
            &kept,
            &asked,
            Some(Instant::now() + TIME_LIMIT),
        )
    })
    .await
    .map_err(|e| Problem::unavailable(e.to_string()))??;
    if !html {
        return Ok((StatusCode::OK, Json(answered.json())).into_response());
    }
    let page = sim::html::what_if(&answered.answer, &title)
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Self-contained: its own style, no script, nothing fetched.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; style-src 'unsafe-inline'",
            ),
        ],
        page,
    )
        .into_response())
}

/// How `POST /v1/whatif` answers.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct WhatIfQuery {
    /// `json` (default), or `html`: a self-contained page comparing both sides.
    format: Option<String>,
}

/// A what-if's answer, with what it assumed.
#[derive(Clone, Debug)]
pub struct Answered {
    /// Both sides.
    pub answer: whatif::Answer,
    /// Run times, arrivals and seed assumed.
    pub assumptions: Value,
}

impl Answered {
    /// As `POST /v1/whatif` answers it.
    pub fn json(&self) -> Value {
        let mut body = serde_json::to_value(&self.answer).expect("answers serialize");
        body["assumptions"] = self.assumptions.clone();
        body
    }
}

/// The changes of a request, as the title of a page: `{"allocation":"ai2","weight":3}; …`.
pub fn describe(changes: &[Value]) -> String {
    if changes.is_empty() {
        return "no change".into();
    }
    changes
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A what-if as asked, read and checked apart from any state.
#[derive(Clone, Debug)]
pub struct Asked {
    changes: Vec<Change>,
    horizon_s: u64,
    resampled: bool,
    seed: u64,
}

impl Asked {
    /// The question of a request's body: its changes (as the API takes them), horizon,
    /// arrivals (`none` or `recent`) and seed; a problem naming the field otherwise.
    pub fn read(
        changes: &[Value],
        horizon_s: u64,
        arrivals: Option<&str>,
        seed: u64,
    ) -> Result<Asked, Problem> {
        if changes.len() > CHANGES_MAX {
            return Err(Problem::invalid(
                "changes",
                format!("at most {CHANGES_MAX} changes at a time"),
            ));
        }
        let changes = changes
            .iter()
            .enumerate()
            .map(|(i, v)| change(i, v))
            .collect::<Result<Vec<_>, _>>()?;
        let added: u64 = changes
            .iter()
            .map(|c| match c {
                Change::AddNodes { count, .. } => u64::from(*count),
                _ => 0,
            })
            .sum();
        if added > ADDED_NODES_MAX {
            return Err(Problem::invalid(
                "changes",
                format!("{added} nodes added in all; at most {ADDED_NODES_MAX}"),
            ));
        }
        let resampled = match arrivals {
            None | Some("none") => false,
            Some("recent") => true,
            Some(other) => {
                return Err(Problem::invalid(
                    "arrivals",
                    format!("{other:?} is not known; use none or recent"),
                ))
            }
        };
        if !(1..=HORIZON_MAX_S).contains(&horizon_s) {
            return Err(Problem::invalid(
                "horizon_s",
                format!("the horizon must be 1 s to {HORIZON_MAX_S} s (30 days)"),
            ));
        }
        Ok(Asked {
            changes,
            horizon_s,
            resampled,
            seed,
        })
    }

    /// Whether its horizon times the cluster's GPUs (with any added) is within the limit.
    pub fn fits(&self, state: &ledger::State) -> Result<(), Problem> {
        let added: u64 = self
            .changes
            .iter()
            .map(|c| match c {
                Change::AddNodes { count, gpus, .. } => u64::from(*count) * u64::from(*gpus),
                _ => 0,
            })
            .sum();
        let gpus = (state.cluster().total_gpus + added).max(1);
        if self.horizon_s.saturating_mul(gpus) > GPU_SECONDS_MAX {
            return Err(Problem::invalid(
                "horizon_s",
                format!(
                    "{} s of {gpus} GPUs is over the limit of {GPU_SECONDS_MAX} GPU-seconds; ask for at most {} s",
                    self.horizon_s,
                    GPU_SECONDS_MAX / gpus
                ),
            ));
        }
        Ok(())
    }
}

/// The answer to `asked` on `state` as `policy` schedules it, with the history in `kept` (the
/// projection's rows) for run times and arrivals, given up at `deadline`. A function of the
/// log's prefix up to the state's sequence: the server and `fairledger whatif --at-seq` give
/// the same.
pub fn answer(
    state: &ledger::State,
    policy: &ledger::policy::PolicyConfig,
    kept: &projector::Kept,
    asked: &Asked,
    deadline: Option<Instant>,
) -> Result<Answered, Problem> {
    // From the ledger's own clock (its last event), so that the same sequence, changes and seed
    // always give the same answer, here or offline.
    let from_ms = state.now_ms();
    let horizon_ms = asked.horizon_s * 1000;
    let window_ms = state.config().window_ms;
    let since_ms = from_ms.saturating_sub(window_ms);
    let history = whatif::History::of(&read_past(kept, state.last_seq(), since_ms)?, since_ms);
    let arrivals = if asked.resampled {
        let covered_ms = history.covered_ms(from_ms, window_ms);
        let expected = history.recent.len() as u64 * horizon_ms / covered_ms.max(1);
        if expected > ARRIVALS_MAX {
            return Err(Problem::invalid(
                "horizon_s",
                format!(
                    "the recent rate of submissions gives about {expected} arrivals over the horizon, more than {ARRIVALS_MAX}; ask for a shorter horizon"
                ),
            ));
        }
        whatif::resample(&history.recent, covered_ms, from_ms, horizon_ms, asked.seed)
    } else {
        Vec::new()
    };
    let question = Question {
        changes: asked.changes.clone(),
        from_ms,
        horizon_ms,
        arrivals,
    };
    let work = history.work_ms(state);
    let answer = whatif::what_if(state, policy, &question, &work, &mut || {
        deadline.is_none_or(|d| Instant::now() < d)
    });
    match answer {
        Ok(answer) => {
            let assumptions = json!({
                "arrivals": question.arrivals.len(),
                "seed": asked.seed,
                "default_run_s": whatif::DEFAULT_RUN_MS / 1000,
                "typical_run_s": history
                    .typical_run_ms
                    .iter()
                    .map(|(k, v)| (k.clone(), json!(v / 1000)))
                    .collect::<serde_json::Map<_, _>>(),
                "how": "running work ends by its duration estimate, else by the typical run of its allocation over the last usage window, else default_run_s; nodes heartbeat perfectly; nothing is written to the ledger",
            });
            Ok(Answered {
                answer,
                assumptions,
            })
        }
        Err(WhatIfError::Refused { field, message }) => Err(Problem::invalid(&field, message)),
        Err(WhatIfError::Stopped) => Err(Problem::unavailable(format!(
            "the what-if did not finish within {} s; ask for a shorter horizon",
            TIME_LIMIT.as_secs()
        ))),
    }
}

/// The submissions from `since_ms` up to sequence `up_to_seq`, newest first, at most
/// [`HISTORY_ROWS`] of them, as the what-if's model reads them ([`whatif::History`]).
fn read_past(
    kept: &projector::Kept,
    up_to_seq: u64,
    since_ms: u64,
) -> Result<Vec<whatif::Past>, Problem> {
    let all = projector::WorkloadFilter::default();
    let mut past = Vec::new();
    let mut before = None;
    'pages: while past.len() < HISTORY_ROWS {
        let page = kept
            .workloads(&all, before, 1_000, 1_000)
            .map_err(|e| Problem::unavailable(e.to_string()))?;
        for row in page.rows {
            // Submissions come newest first: the window is over at the first older one. The
            // limit is counted row by row, so the rows read do not depend on where pages end
            // (which rows submitted after the fork move).
            if row.submitted_at_ms < since_ms || past.len() >= HISTORY_ROWS {
                break 'pages;
            }
            if row.submit_seq > up_to_seq {
                continue;
            }
            // A row last changed after the fork may not be read as it was then: its run time
            // is not counted (its submission is, the same as it ever was).
            let settled = row.last_seq <= up_to_seq;
            past.push(whatif::Past {
                allocation: row.allocation.clone(),
                gpus_per_node: row.gpus_per_node,
                nodes: row.nodes,
                priority: row.priority,
                submitted_at_ms: row.submitted_at_ms,
                finished_run_ms: (settled
                    && row.phase == ledger::Phase::Finished
                    && row.run_ms > 0)
                    .then_some(row.run_ms),
            });
        }
        match page.next {
            Some(next) => before = Some(next),
            None => break,
        }
    }
    Ok(past)
}
