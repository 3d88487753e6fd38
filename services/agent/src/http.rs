//! For agents that speak HTTP to a `fairledger serve` rather than NATS: the ledger as the API
//! shows it ([`HttpLog`]: `GET /v1/events` to read and follow, `POST /v1/nodes/{node}/events`
//! for the node's own reports) and heartbeats through `POST /v1/nodes/{node}/heartbeat`.

use std::time::Duration;

use bytes::Bytes;
use eventlog::{Append, AppendError, Appended, EventLog, LogError, Stored};
use futures::stream::BoxStream;
use serde_json::{json, Value};

/// How often a follower asks for new events.
const POLL: Duration = Duration::from_millis(250);

/// The API of one server, for one node.
#[derive(Clone)]
pub struct HttpLog {
    base: String,
    node: String,
    agent: ureq::Agent,
    /// `Bearer <token>`: the node's agent token.
    authorization: std::sync::Arc<str>,
    /// How this agent names itself to the API (host:pid:id): the node is its while it reports.
    holder: std::sync::Arc<str>,
    /// Set when the API refused the token (revoked, expired): why.
    refused: std::sync::Arc<tokio::sync::watch::Sender<Option<String>>>,
}

/// An HTTP client that answers every status as it is (problems are read, not raised), with
/// `timeout` for a whole call; an `https` server's certificate is checked against the CA
/// certificates (PEM) in `ca_file` when given, else against the web's public roots.
pub fn client(
    ca_file: Option<&std::path::Path>,
    timeout: Option<Duration>,
) -> Result<ureq::Agent, String> {
    let mut config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(timeout);
    if let Some(path) = ca_file {
        let pem = std::fs::read(path)
            .map_err(|e| format!("cannot read the CA file {}: {e}", path.display()))?;
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if certs.is_empty() {
            return Err(format!(
                "the CA file {} holds no PEM certificate",
                path.display()
            ));
        }
        let tls = ureq::tls::TlsConfig::builder()
            .root_certs(ureq::tls::RootCerts::new_with_certs(&certs))
            .build();
        config = config.tls_config(tls);
    }
    Ok(config.build().into())
}

/// What a call sends.
enum Sent {
    /// Nothing: a GET.
    Nothing,
    /// A JSON body, POSTed.
    Json(Value),
    /// Raw bytes, POSTed.
    Raw(Bytes),
}

/// What a call answered: the status and the JSON body.
type Answer = (u16, Value);

impl HttpLog {
    /// The API at `base` (e.g. `https://10.0.0.1:8080`), for node `node`, whose agent token is
    /// `token`; an `https` API's certificate is checked against `ca_file` when given.
    pub fn new(
        base: &str,
        node: &str,
        token: &str,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, String> {
        let agent = client(ca_file, Some(Duration::from_secs(30)))?;
        Ok(HttpLog {
            base: base.trim_end_matches('/').to_owned(),
            node: node.to_owned(),
            agent,
            authorization: format!("Bearer {}", token.trim()).into(),
            holder: format!("{}:{}:{}", host(), std::process::id(), uuid::Uuid::now_v7()).into(),
            refused: std::sync::Arc::new(tokio::sync::watch::channel(None).0),
        })
    }

    /// Says why, once the API refuses this agent's token (it was revoked, or it expired).
    pub fn refused(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.refused.subscribe()
    }

    /// Notes a 401: the token no longer holds.
    fn check_refused(&self, status: u16, answer: &Value) {
        if status == 401 {
            self.refused.send_replace(Some(problem(answer)));
        }
    }

    /// Names this agent `holder` to the API (by default host, process and a random id): an
    /// agent that keeps its name across restarts gets its node back at once.
    pub fn with_holder(mut self, holder: &str) -> Self {
        self.holder = format!("{}:{holder}", host()).into();
        self
    }

    /// Claims the node for this agent: refused, with the holder named, while another agent
    /// drives it (an external one, or one inside the server).
    pub async fn claim(&self) -> Result<(), String> {
        let path = format!("/v1/nodes/{}/lease", self.node);
        let (status, answer) = self
            .call(path, Some(json!({"holder": &*self.holder})))
            .await?;
        if status >= 400 {
            return Err(problem(&answer));
        }
        Ok(())
    }

    /// GET `path`, or POST `body` to it (JSON), off the async threads.
    async fn call(&self, path: String, body: Option<Value>) -> Result<Answer, String> {
        self.send(path, body.map_or(Sent::Nothing, Sent::Json))
            .await
    }

    /// GET `path` or POST to it what `sent` says, off the async threads; notes a 401.
    async fn send(&self, path: String, sent: Sent) -> Result<Answer, String> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let url = format!("{}{path}", this.base);
            let auth = &*this.authorization;
            let post = || {
                this.agent
                    .post(&url)
                    .header("authorization", auth)
                    .header("fairledger-agent", &*this.holder)
            };
            let answered = match sent {
                Sent::Nothing => this.agent.get(&url).header("authorization", auth).call(),
                Sent::Json(b) => post()
                    .header("content-type", "application/json")
                    .send(b.to_string()),
                Sent::Raw(b) => post()
                    .header("content-type", "application/octet-stream")
                    .send(&b[..]),
            };
            let mut response =
                answered.map_err(|e| format!("cannot reach the API at {} ({e})", this.base))?;
            let status = response.status().as_u16();
            let text = response
                .body_mut()
                .read_to_string()
                .map_err(|e| format!("reading the answer of {url}: {e}"))?;
            let answer = serde_json::from_str(&text).unwrap_or(Value::String(text));
            this.check_refused(status, &answer);
            Ok((status, answer))
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// The actor the token stands for (`agent:<name>`), checked to be the agent of this node.
    pub async fn whoami(&self) -> Result<String, String> {
        let (status, answer) = self.call("/v1/whoami".into(), None).await?;
        if status != 200 {
            return Err(problem(&answer));
        }
        if answer["role"] != "agent" || answer["node"] != self.node.as_str() {
            return Err(format!(
                "the token is {}'s ({} of node {}), not the agent token of node {:?}; make one with `fairledger token create --name {} --role agent`",
                answer["name"], answer["role"], answer["node"], self.node, self.node
            ));
        }
        answer["actor"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("the server does not say who the token is: {answer}"))
    }

    /// The server's clock (milliseconds since the epoch) as it answered.
    pub async fn server_time(&self) -> Result<u64, String> {
        let (status, answer) = self.call("/v1/events?limit=1".into(), None).await?;
        if status != 200 {
            return Err(problem(&answer));
        }
        answer["now_ms"]
            .as_u64()
            .ok_or_else(|| "the server does not say its time".to_owned())
    }

    /// Posts a heartbeat's readings; answers the server's clock when it took them.
    pub async fn heartbeat(
        &self,
        readings: &[ledger::event::GpuReading],
        sent_at_ms: u64,
    ) -> Result<u64, String> {
        let body = json!({"readings": readings, "sent_at_ms": sent_at_ms});
        let path = format!("/v1/nodes/{}/heartbeat", self.node);
        let (status, answer) = self.call(path, Some(body)).await?;
        if status >= 400 {
            return Err(problem(&answer));
        }
        for w in answer["warnings"].as_array().into_iter().flatten() {
            tracing::warn!("the server says: {}", w.as_str().unwrap_or_default());
        }
        answer["at_ms"]
            .as_u64()
            .ok_or_else(|| format!("the heartbeat's answer has no at_ms: {answer}"))
    }
}

impl HttpLog {
    /// Where the output of `key` (a run on this node) stands on the server.
    pub async fn output_shipped(
        &self,
        key: &eventlog::output::RunKey,
    ) -> Result<Option<eventlog::output::Shipped>, String> {
        let (status, answer) = self.call(output_path(key), None).await?;
        match status {
            404 => Ok(None),
            200 => Ok(Some(shipped(&answer)?)),
            _ => Err(problem(&answer)),
        }
    }

    /// Ships `chunk` of the output of `key` (a run on this node).
    pub async fn ship_output(
        &self,
        key: &eventlog::output::RunKey,
        chunk: eventlog::output::Chunk,
    ) -> Result<(), String> {
        // The server stamps the chunk with its own clock.
        let path = format!(
            "{}?offset={}{}",
            output_path(key),
            chunk.offset,
            if chunk.end { "&end=true" } else { "" }
        );
        let (status, answer) = self.send(path, Sent::Raw(chunk.data)).await?;
        if status >= 400 {
            return Err(problem(&answer));
        }
        Ok(())
    }

    /// What to launch for `workload`, placed on this node: its command and environment (the
    /// events an agent reads over HTTP leave them out).
    pub async fn run_spec(
        &self,
        workload: uuid::Uuid,
    ) -> Result<(Vec<String>, std::collections::BTreeMap<String, String>), String> {
        let path = format!("/v1/nodes/{}/workloads/{workload}/spec", self.node);
        let (status, answer) = self.call(path, None).await?;
        if status != 200 {
            return Err(problem(&answer));
        }
        serde_json::from_value(json!([answer["command"], answer["env"]]))
            .map_err(|e| format!("the server's answer for workload {workload}'s spec: {e}"))
    }
}

fn output_path(key: &eventlog::output::RunKey) -> String {
    format!("/v1/nodes/{}/output/{}/{}", key.node, key.workload, key.run)
}

fn shipped(answer: &Value) -> Result<eventlog::output::Shipped, String> {
    Ok(eventlog::output::Shipped {
        next_offset: answer["next_offset"]
            .as_u64()
            .ok_or_else(|| format!("the answer has no next_offset: {answer}"))?,
        ended: answer["ended"] == true,
    })
}

/// The body of a node's reports, as `POST /v1/nodes/{node}/events` and the NATS relay take it.
pub(crate) fn report_body(appends: &[Append]) -> Result<Value, AppendError> {
    let mut reports = Vec::with_capacity(appends.len());
    for a in appends {
        let envelope: Value = serde_json::from_slice(&a.payload)
            .map_err(|e| AppendError::Refused(format!("not an event: {e}")))?;
        let key = a.msg_id.clone().unwrap_or_default();
        reports.push(json!({"idempotency_key": key, "envelope": envelope}));
    }
    Ok(json!({"events": reports}))
}

/// What the service's answer to a node's reports means for the appends.
pub(crate) fn report_answer(
    status: u16,
    answer: &Value,
    appends: &[Append],
) -> Result<Vec<Appended>, AppendError> {
    match status {
        200 if answer["duplicate"] == true => Err(AppendError::DuplicateBatch(
            appends[0].msg_id.clone().unwrap_or_default(),
        )),
        200 => Ok(answer["seqs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| Appended {
                seq: s.as_u64().unwrap_or(0),
                duplicate: false,
            })
            .collect()),
        503 => Err(AppendError::Unavailable(problem(answer))),
        _ => Err(AppendError::Refused(problem(answer))),
    }
}

fn problem(answer: &Value) -> String {
    let detail = answer["detail"]
        .as_str()
        .unwrap_or("the API refused the request");
    match answer["field"].as_str() {
        Some(field) => format!("{detail} (field {field})"),
        None => detail.to_owned(),
    }
}

impl EventLog for HttpLog {
    async fn append_batch(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        let body = report_body(&appends)?;
        let path = format!("/v1/nodes/{}/events", self.node);
        let (status, answer) = self
            .call(path, Some(body))
            .await
            .map_err(AppendError::Unacknowledged)?;
        report_answer(status, &answer, &appends)
    }

    async fn last_seq(&self) -> Result<u64, LogError> {
        let (status, answer) = self
            .call("/v1/events?limit=1&after=0".into(), None)
            .await
            .map_err(LogError::Unavailable)?;
        if status != 200 {
            return Err(LogError::Unavailable(problem(&answer)));
        }
        answer["last_seq"].as_u64().ok_or_else(|| {
            LogError::Unavailable("the server does not say its last sequence".into())
        })
    }

    async fn read(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        let path = format!(
            "/v1/events?after={}&limit={}",
            from.saturating_sub(1),
            max.clamp(1, 1000)
        );
        let (status, answer) = self.call(path, None).await.map_err(LogError::Unavailable)?;
        if status != 200 {
            return Err(LogError::Unavailable(problem(&answer)));
        }
        Ok(answer["events"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| Stored {
                seq: e["seq"].as_u64().unwrap_or(0),
                subject: e["subject"].as_str().unwrap_or_default().to_owned(),
                msg_id: None,
                payload: Bytes::from(e["event"].to_string()),
            })
            .collect())
    }

    async fn subscribe(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        use futures::StreamExt;
        // Polls for what follows, a page at a time.
        let this = self.clone();
        let pages = futures::stream::unfold((this, from), |(log, next)| async move {
            loop {
                match log.read(next, 1000).await {
                    Ok(page) if page.is_empty() => tokio::time::sleep(POLL).await,
                    Ok(page) => {
                        let after = page.last().map_or(next, |e| e.seq + 1);
                        let items: Vec<Result<Stored, LogError>> =
                            page.into_iter().map(Ok).collect();
                        return Some((futures::stream::iter(items), (log, after)));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read the ledger from the API; retrying");
                        tokio::time::sleep(POLL * 4).await;
                    }
                }
            }
        });
        Ok(pages.flatten().boxed())
    }
}

/// This machine's name, for naming the agent to the API.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty() && h.is_ascii())
        .unwrap_or_else(|| "host".into())
}
