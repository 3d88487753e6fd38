//! Runs' output: agents ship it here (`POST /v1/nodes/{node}/output/{workload}/{run}`, or
//! straight to the `OUTPUT` stream on NATS), and a workload's submitter, operators, admins and
//! auditors read it from anywhere (`GET /v1/workloads/{id}/logs`), while it runs (`follow`) and
//! after it ended.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use eventlog::output::{AnyOutput, Chunk, OutputStore, RunKey, CHUNK_MAX};
use ledger::identity::Action;
use serde::Deserialize;
use serde_json::json;

use crate::auth::Caller;
use crate::routes::{bad_query, parse_id};
use crate::{problem, App, Problem};

/// How often a follower looks for more output.
const FOLLOW_POLL: Duration = Duration::from_millis(250);
/// A followed run that ended in the ledger but whose last chunk never came (its agent went
/// away) is followed this long after its last output.
const FOLLOW_AFTER_END: Duration = Duration::from_secs(10);
/// How long a read of an ended run waits for its last output to arrive.
const SETTLE: Duration = Duration::from_secs(3);
/// The most bytes read from the store at once.
const PAGE: usize = 1 << 20;

fn store(app: &App) -> Result<&AnyOutput, Problem> {
    app.output()
        .ok_or_else(|| Problem::unavailable("this process keeps no output; ask an API process"))
}

fn unavailable(e: eventlog::LogError) -> Problem {
    Problem::unavailable(format!("the output store: {e}"))
}

/// The run a node's agent names: checked, and known to the ledger.
async fn run_key(
    app: &App,
    caller: &Caller,
    node: &str,
    workload: &str,
    run: &str,
) -> Result<RunKey, Problem> {
    crate::routes::nodes::its_agent(app, caller, node).await?;
    let workload = parse_id(workload)?;
    let run: u64 =
        run.parse().ok().filter(|&r| r >= 1).ok_or_else(|| {
            Problem::invalid("run", format!("{run:?} is not a run number (1, 2, …)"))
        })?;
    let row = app.workload_row(workload).await?;
    if run > u64::from(row.starts) {
        return Err(Problem::invalid(
            "run",
            format!(
                "workload {workload} has started {} times; it has no run {run}",
                row.starts
            ),
        ));
    }
    Ok(RunKey {
        workload,
        run,
        node: node.to_owned(),
    })
}

fn shipped_json(s: eventlog::output::Shipped) -> serde_json::Value {
    json!({"next_offset": s.next_offset, "ended": s.ended})
}

/// The query of a shipped chunk.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShipQuery {
    /// Where the chunk's first byte is in the run's output.
    offset: u64,
    /// The run ended and this is the end of its output.
    #[serde(default)]
    end: bool,
}

#[utoipa::path(post, path = "/v1/nodes/{node}/output/{workload}/{run}", tag = "nodes",
    params(
        ("node" = String, Path, description = "the node"),
        ("workload" = String, Path, description = "workload id (UUID)"),
        ("run" = u64, Path, description = "the run: 1 for its first start"),
        ShipQuery,
    ),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "the chunk's bytes, at most 64 KiB"),
    responses(
        (status = 200, description = "kept: where the run's output now stands (`next_offset`, `ended`)", body = serde_json::Value),
        (status = 409, description = "another agent drives the node", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a bad node, workload or run", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn ship(
    State(app): State<App>,
    caller: Caller,
    Path((node, workload, run)): Path<(String, String, String)>,
    query: Result<Query<ShipQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    let key = run_key(&app, &caller, &node, &workload, &run).await?;
    let Query(query) = query.map_err(bad_query)?;
    let data = body.map_err(|_| {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            format!("a chunk of output is at most {CHUNK_MAX} bytes; send it in pieces"),
        )
    })?;
    if data.len() > CHUNK_MAX {
        return Err(Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            format!("a chunk of output is at most {CHUNK_MAX} bytes; send it in pieces"),
        ));
    }
    app.inner
        .leases
        .check(&node, crate::routes::nodes::holder(&headers)?)?;
    let store = store(&app)?;
    let chunk = Chunk {
        offset: query.offset,
        data,
        end: query.end,
        at_ms: app.now_ms(),
    };
    store.append(&key, chunk).await.map_err(unavailable)?;
    let now = store.shipped(&key).await.map_err(unavailable)?;
    Ok(Json(now.map_or(json!({"next_offset": 0, "ended": false}), shipped_json)).into_response())
}

#[utoipa::path(get, path = "/v1/nodes/{node}/output/{workload}/{run}", tag = "nodes",
    params(
        ("node" = String, Path, description = "the node"),
        ("workload" = String, Path, description = "workload id (UUID)"),
        ("run" = u64, Path, description = "the run: 1 for its first start"),
    ),
    responses(
        (status = 200, description = "where the run's shipped output stands (`next_offset`, `ended`)", body = serde_json::Value),
        (status = 404, description = "nothing shipped of it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn shipped(
    State(app): State<App>,
    caller: Caller,
    Path((node, workload, run)): Path<(String, String, String)>,
) -> Result<Response, Problem> {
    let key = run_key(&app, &caller, &node, &workload, &run).await?;
    match store(&app)?.shipped(&key).await.map_err(unavailable)? {
        Some(s) => Ok(Json(shipped_json(s)).into_response()),
        None => Err(Problem::not_found(format!(
            "nothing of run {} of workload {} was shipped from node {node}",
            key.run, key.workload
        ))),
    }
}

/// The query of `GET /v1/workloads/{id}/logs`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(crate) struct LogsQuery {
    /// Which run (1 for its first start); the latest by default.
    run: Option<u64>,
    /// Which node of a gang; its first by default.
    node: Option<String>,
    /// Only the last this many lines (then what follows, with `follow`).
    tail: Option<u64>,
    /// From this byte of the run's output on (to resume a read that broke off).
    from: Option<u64>,
    /// Keep the answer open and send output as it comes, until the run's output ends.
    #[serde(default)]
    follow: bool,
}

#[utoipa::path(get, path = "/v1/workloads/{id}/logs", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)"), LogsQuery),
    responses(
        (status = 200, description = "the run's output as it was written (`text/plain`, streamed with `follow`). Headers: `fairledger-run` (the run), `fairledger-runs` (how many it had), `fairledger-node`, `fairledger-nodes` (a gang's, comma-separated), `fairledger-offset` (the byte of the output the body starts at), `fairledger-dropped` (bytes before it no longer kept), `fairledger-ended` (the run's last output is in: nothing more will come)", content_type = "text/plain"),
        (status = 403, description = "not the workload's submitter, nor an operator, admin or auditor", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "no such workload, run or node; or it never started", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn logs(
    State(app): State<App>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<LogsQuery>, QueryRejection>,
) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let Query(query) = query.map_err(bad_query)?;
    if let Some(node) = &query.node {
        ledger::names::node(node).map_err(|reason| Problem::invalid("node", reason))?;
    }
    if query.run == Some(0) {
        return Err(Problem::invalid("run", "runs count from 1"));
    }
    let mut row = app.workload_row(id).await?;
    caller.allow(
        &Action::ReadOutput {
            submitter: &row.user,
        },
        app.inner.projection.read().await.state(),
    )?;
    // Followed before it starts: wait for its first start (or its end).
    while query.follow && row.starts == 0 && row.ended_at_ms.is_none() {
        tokio::time::sleep(FOLLOW_POLL * 2).await;
        row = app.workload_row(id).await?;
    }
    if row.starts == 0 {
        return Err(Problem::not_found(format!(
            "workload {id} never started, so it wrote nothing"
        )));
    }
    let store = store(&app)?.clone();
    let run = query.run.unwrap_or(u64::from(row.starts));
    if run > u64::from(row.starts) {
        return Err(Problem::not_found(format!(
            "workload {id} started {} times; it has no run {run}",
            row.starts
        )));
    }
    // A run the ledger has ended may still have output on its way (its agent ships every half
    // second, and reports the end at once): a read without follow waits a little for its last
    // chunk, so that it is whole. An agent that went away never sends it: then what is kept.
    if !query.follow && (row.ended_at_ms.is_some() || run < u64::from(row.starts)) {
        let deadline = Instant::now() + SETTLE;
        while !output_ended(&store, id, run, query.node.as_deref()).await?
            && Instant::now() < deadline
        {
            tokio::time::sleep(FOLLOW_POLL).await;
        }
    }
    let runs = store.runs(id).await.map_err(unavailable)?;
    let mut nodes: Vec<String> = runs
        .iter()
        .filter(|(r, _)| *r == run)
        .map(|(_, n)| n.clone())
        .collect();
    if run == u64::from(row.starts) {
        // The run under way: its nodes in gang order, whether or not they shipped yet.
        let placed: Vec<String> = row.placement.iter().map(|p| p.node.clone()).collect();
        if !placed.is_empty() {
            nodes.retain(|n| !placed.contains(n));
            nodes.splice(0..0, placed);
        }
    }
    let node = match &query.node {
        Some(n) if nodes.contains(n) => n.clone(),
        Some(n) => {
            return Err(Problem::not_found(format!(
                "run {run} of workload {id} did not run on node {n}; it ran on {}",
                if nodes.is_empty() {
                    "no node that shipped output".to_owned()
                } else {
                    nodes.join(", ")
                }
            )))
        }
        None => match nodes.first() {
            Some(n) => n.clone(),
            None => {
                // Ended before any output was shipped.
                let mut response = Body::empty().into_response();
                set_headers(&mut response, run, row.starts, "", &[], 0, 0);
                return Ok(response);
            }
        },
    };
    let key = RunKey {
        workload: id,
        run,
        node: node.clone(),
    };
    // Where the body starts.
    let kept_from = store
        .read(&key, 0, 1)
        .await
        .map_err(unavailable)?
        .chunks
        .first()
        .map_or(0, |c| c.offset);
    let start = match (query.tail, query.from) {
        (Some(_), Some(_)) => {
            return Err(Problem::invalid(
                "tail",
                "give tail or from, not both: tail counts lines back from the end, from a byte to resume at",
            ))
        }
        (Some(lines), None) => tail_start(&store, &key, lines).await?,
        (None, Some(from)) => from,
        (None, None) => 0,
    };
    let dropped = kept_from.saturating_sub(start);
    let start = start.max(kept_from);
    let ended = store
        .shipped(&key)
        .await
        .map_err(unavailable)?
        .is_some_and(|s| s.ended);
    let follow = Follow {
        app: app.clone(),
        store,
        key,
        cursor: 0,
        pos: start,
        follow: query.follow,
        quiet_since: Instant::now(),
        done: false,
    };
    let body = Body::from_stream(futures::stream::unfold(follow, Follow::next));
    let mut response = body.into_response();
    set_headers(
        &mut response,
        run,
        row.starts,
        &node,
        &nodes,
        start,
        dropped,
    );
    response.headers_mut().insert(
        "fairledger-ended",
        HeaderValue::from_static(if ended { "true" } else { "false" }),
    );
    Ok(response)
}

/// Whether the output of run `run` of workload `id` on `node` (else the first node that shipped
/// any) has its last chunk in.
async fn output_ended(
    store: &AnyOutput,
    id: ledger::WorkloadId,
    run: u64,
    node: Option<&str>,
) -> Result<bool, Problem> {
    let runs = store.runs(id).await.map_err(unavailable)?;
    let Some(node) = node
        .map(str::to_owned)
        .or_else(|| runs.iter().find(|(r, _)| *r == run).map(|(_, n)| n.clone()))
    else {
        return Ok(false);
    };
    let key = RunKey {
        workload: id,
        run,
        node,
    };
    Ok(store
        .shipped(&key)
        .await
        .map_err(unavailable)?
        .is_some_and(|s| s.ended))
}

fn set_headers(
    response: &mut Response,
    run: u64,
    runs: u32,
    node: &str,
    nodes: &[String],
    offset: u64,
    dropped: u64,
) {
    let h = response.headers_mut();
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    };
    put("content-type", "text/plain; charset=utf-8".into());
    put("cache-control", "no-store".into());
    put("fairledger-run", run.to_string());
    put("fairledger-runs", runs.to_string());
    put("fairledger-node", node.to_owned());
    put("fairledger-nodes", nodes.join(","));
    put("fairledger-offset", offset.to_string());
    put("fairledger-dropped", dropped.to_string());
}

/// The byte at which the last `lines` lines of `key`'s kept output start.
async fn tail_start(store: &AnyOutput, key: &RunKey, lines: u64) -> Result<u64, Problem> {
    // Newline positions, the last `lines + 1` of them; the output is bounded per run.
    let mut newlines = std::collections::VecDeque::new();
    let mut first = None;
    let mut end = 0;
    let mut cursor = 0;
    loop {
        let page = store.read(key, cursor, PAGE).await.map_err(unavailable)?;
        if page.chunks.is_empty() {
            break;
        }
        for c in &page.chunks {
            first.get_or_insert(c.offset);
            for (i, b) in c.data.iter().enumerate() {
                if *b == b'\n' {
                    newlines.push_back(c.offset + i as u64);
                    if newlines.len() as u64 > lines + 1 {
                        newlines.pop_front();
                    }
                }
            }
            end = end.max(c.offset + c.data.len() as u64);
        }
        cursor = page.cursor;
    }
    let first = first.unwrap_or(0);
    if lines == 0 {
        return Ok(end);
    }
    // A last line without its newline counts as a line.
    let complete_last = newlines.back().is_some_and(|&n| n + 1 == end);
    let want = if complete_last { lines + 1 } else { lines };
    if (newlines.len() as u64) < want {
        return Ok(first);
    }
    let at = newlines.len() - want as usize;
    Ok(newlines[at] + 1)
}

/// A read of one run's output, following it while it grows when asked.
struct Follow {
    app: App,
    store: AnyOutput,
    key: RunKey,
    cursor: u64,
    /// The next byte to send.
    pos: u64,
    follow: bool,
    /// Since when nothing new came.
    quiet_since: Instant,
    done: bool,
}

impl Follow {
    async fn next(mut self) -> Option<(Result<Bytes, std::io::Error>, Follow)> {
        loop {
            if self.done {
                return None;
            }
            let page = match self.store.read(&self.key, self.cursor, PAGE).await {
                Ok(page) => page,
                Err(e) => return Some((Err(std::io::Error::other(e.to_string())), self.end())),
            };
            if !page.chunks.is_empty() {
                self.cursor = page.cursor;
                let mut out = Vec::new();
                for c in page.chunks {
                    let to = c.offset + c.data.len() as u64;
                    if to > self.pos {
                        let skip = self.pos.saturating_sub(c.offset) as usize;
                        out.extend_from_slice(&c.data[skip..]);
                        self.pos = to;
                    }
                    if c.end {
                        self.done = true;
                    }
                }
                if !out.is_empty() {
                    self.quiet_since = Instant::now();
                    return Some((Ok(Bytes::from(out)), self));
                }
                continue;
            }
            if !self.follow || self.run_over().await {
                return None;
            }
            tokio::time::sleep(FOLLOW_POLL).await;
        }
    }

    fn end(mut self) -> Follow {
        self.done = true;
        self
    }

    /// Whether the run is over in the ledger and nothing came for [`FOLLOW_AFTER_END`]: its
    /// last chunk will not come (its agent went away, or keeps no output).
    async fn run_over(&self) -> bool {
        if self.quiet_since.elapsed() < FOLLOW_AFTER_END {
            return false;
        }
        match self.app.workload_row(self.key.workload).await {
            Ok(row) => {
                u64::from(row.starts) > self.key.run
                    || row.ended_at_ms.is_some()
                    || row.placement.is_empty()
            }
            Err(_) => true,
        }
    }
}
