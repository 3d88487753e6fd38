//! The ledger's append-only log: one [`EventLog`] trait and two backends behind it.
//!
//! - [`jetstream::JetStreamLog`]: production, on NATS JetStream (streams `LEDGER` and
//!   `TELEMETRY`).
//! - [`embedded::EmbeddedLog`]: the default when no NATS URL is given, an append-only log in
//!   sled with the same semantics.
//!
//! Both give every event a monotonically increasing sequence, deduplicate appends by an
//! idempotency key, check an expected last (subject) sequence so a stale writer gets a typed
//! [`AppendError::Conflict`], acknowledge an append only once it is durable, and serve tail
//! subscriptions from any sequence. The same conformance suite (`tests/conformance.rs`) runs
//! against both.
//!
//! Beside the ledger, each backend keeps runs' output ([`output`]: a tree of the embedded
//! database, or the `OUTPUT` stream), which is not the ledger: bounded, and never folded.

use std::future::Future;

use bytes::Bytes;
use futures::stream::BoxStream;

pub mod access;
pub mod embedded;
pub mod jetstream;
pub mod lease;
pub mod output;
pub mod subject;
#[cfg(feature = "testing")]
pub mod testing;

pub use embedded::EmbeddedLog;
pub use jetstream::{JetStreamLog, JetStreamOptions, NatsAuth};

/// One event to append.
#[derive(Clone, Debug, PartialEq)]
pub struct Append {
    /// Where it goes; see [`subject`].
    pub subject: String,
    /// The encoded event (JSON of a `ledger::Envelope`).
    pub payload: Bytes,
    /// Idempotency key: a second append with the same key is answered with the first one's
    /// sequence and `duplicate: true` (JetStream `Nats-Msg-Id`).
    pub msg_id: Option<String>,
    /// The condition the log must meet for the append to happen.
    pub expect: Expect,
}

impl Append {
    /// An unconditional append of `payload` to `subject`.
    pub fn new(subject: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Append {
            subject: subject.into(),
            payload: payload.into(),
            msg_id: None,
            expect: Expect::Any,
        }
    }

    /// An append of a ledger event on its subject (see [`subject::for_event`]), keyed by
    /// `idempotency_key` or else by the event's id, so a retry of the same envelope is a
    /// no-op.
    pub fn event(
        envelope: &ledger::Envelope,
        allocation: Option<&str>,
        idempotency_key: Option<&str>,
    ) -> Self {
        let payload = serde_json::to_vec(envelope).expect("an envelope always serializes");
        Append {
            subject: subject::for_event(&envelope.event, allocation),
            payload: payload.into(),
            msg_id: Some(
                idempotency_key
                    .map(str::to_owned)
                    .unwrap_or_else(|| envelope.id.to_string()),
            ),
            expect: Expect::Any,
        }
    }

    /// Sets the idempotency key.
    pub fn with_msg_id(mut self, id: impl Into<String>) -> Self {
        self.msg_id = Some(id.into());
        self
    }

    /// Sets the condition.
    pub fn expecting(mut self, expect: Expect) -> Self {
        self.expect = expect;
        self
    }
}

/// Optimistic concurrency: what the log must look like for an append to happen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// No condition.
    Any,
    /// The log's last sequence (0 when empty) is exactly this.
    LastSequence(u64),
    /// The last sequence of any event whose subject matches `filter` (NATS wildcards `*` and
    /// `>` allowed; 0 when none) is exactly `seq`.
    LastSubjectSequence {
        /// Subject or wildcard filter.
        filter: String,
        /// The expected sequence.
        seq: u64,
    },
}

/// The answer to a durable append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Appended {
    /// The event's sequence in the log.
    pub seq: u64,
    /// The idempotency key was seen before: nothing was written and `seq` is the original's.
    pub duplicate: bool,
}

/// An event read back from the log.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    /// Its sequence.
    pub seq: u64,
    /// Its subject.
    pub subject: String,
    /// Its idempotency key, if it had one.
    pub msg_id: Option<String>,
    /// The encoded event.
    pub payload: Bytes,
}

/// Why an append did not happen. Every variant but [`AppendError::Unacknowledged`] means the
/// event was certainly not written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AppendError {
    /// The expected sequence did not match: someone else wrote first. Re-read and decide
    /// again.
    #[error(
        "conflict: expected last sequence {expected}, the log is at {actual}; re-read and retry"
    )]
    Conflict {
        /// What the writer expected.
        expected: u64,
        /// What the log holds (0 when the backend does not say).
        actual: u64,
    },
    /// No acknowledgement came back (connection lost, timeout, server restarting): the event
    /// may or may not be in the log. Retry with the same idempotency key; it will not be
    /// written twice.
    #[error("append not acknowledged ({0}); retry with the same idempotency key")]
    Unacknowledged(String),
    /// An event of this atomic batch carries an idempotency key the log already holds (or
    /// two of its events share one): nothing was written. If this is the retry of a batch
    /// whose answer was lost, the first attempt went through.
    #[error("atomic batch refused: idempotency key {0:?} was already appended")]
    DuplicateBatch(String),
    /// The log refused the append (bad subject, too large, batch too big, ...).
    #[error("append refused: {0}")]
    Refused(String),
    /// The log cannot write at all (disk full, storage failure, closed).
    #[error("event log unavailable: {0}")]
    Unavailable(String),
}

/// Why a read or subscription failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The backend could not be reached or read.
    #[error("event log unavailable: {0}")]
    Unavailable(String),
    /// Stored data could not be decoded.
    #[error("event log corrupt at sequence {seq}: {reason}")]
    Corrupt {
        /// Where.
        seq: u64,
        /// What.
        reason: String,
    },
}

/// The most events one atomic batch may hold (JetStream's limit for atomic publishes).
pub const MAX_BATCH: usize = 1000;

/// An append-only, durable, sequenced event log.
pub trait EventLog: Send + Sync + 'static {
    /// Appends one event; answers once it is durable.
    fn append(&self, append: Append) -> impl Future<Output = Result<Appended, AppendError>> + Send {
        async move {
            let mut acks = self.append_batch(vec![append]).await?;
            Ok(acks.pop().expect("one append, one answer"))
        }
    }

    /// Appends up to [`MAX_BATCH`] events atomically: all of them or none, answered once
    /// durable, in order. Only the first event may expect a [`Expect::LastSequence`]; any
    /// may expect a [`Expect::LastSubjectSequence`], checked against the log as it stood
    /// before the batch, on a filter no earlier event of the batch writes to. A batch holding
    /// an idempotency key the log already knows is refused whole with
    /// [`AppendError::DuplicateBatch`] (as JetStream does).
    fn append_batch(
        &self,
        appends: Vec<Append>,
    ) -> impl Future<Output = Result<Vec<Appended>, AppendError>> + Send;

    /// The last durable sequence (0 when empty).
    fn last_seq(&self) -> impl Future<Output = Result<u64, LogError>> + Send;

    /// Up to `max` events with sequence `>= from`, in order, without waiting for more.
    fn read(
        &self,
        from: u64,
        max: usize,
    ) -> impl Future<Output = Result<Vec<Stored>, LogError>> + Send;

    /// Every event with sequence `>= from`, in order, then the new ones as they are appended.
    fn subscribe(
        &self,
        from: u64,
    ) -> impl Future<Output = Result<BoxStream<'static, Result<Stored, LogError>>, LogError>> + Send;
}

/// Either backend, chosen at run time (`--nats URL` or the embedded default).
#[derive(Clone)]
pub enum AnyLog {
    /// The embedded sled log.
    Embedded(EmbeddedLog),
    /// The JetStream log.
    JetStream(Box<JetStreamLog>),
}

impl EventLog for AnyLog {
    async fn append(&self, append: Append) -> Result<Appended, AppendError> {
        match self {
            AnyLog::Embedded(l) => l.append(append).await,
            AnyLog::JetStream(l) => l.append(append).await,
        }
    }

    async fn append_batch(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        match self {
            AnyLog::Embedded(l) => l.append_batch(appends).await,
            AnyLog::JetStream(l) => l.append_batch(appends).await,
        }
    }

    async fn last_seq(&self) -> Result<u64, LogError> {
        match self {
            AnyLog::Embedded(l) => l.last_seq().await,
            AnyLog::JetStream(l) => l.last_seq().await,
        }
    }

    async fn read(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        match self {
            AnyLog::Embedded(l) => l.read(from, max).await,
            AnyLog::JetStream(l) => l.read(from, max).await,
        }
    }

    async fn subscribe(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        match self {
            AnyLog::Embedded(l) => l.subscribe(from).await,
            AnyLog::JetStream(l) => l.subscribe(from).await,
        }
    }
}

/// Checks that `subject` is a ledger subject a NATS publish accepts: under
/// [`subject::LEDGER_PREFIX`], no empty tokens, no wildcards, no whitespace.
pub fn check_subject(subject: &str) -> Result<(), AppendError> {
    let ledger = subject
        .strip_prefix(subject::LEDGER_PREFIX)
        .is_some_and(|rest| rest.starts_with('.'));
    if !ledger {
        return Err(AppendError::Refused(format!(
            "subject {subject:?} is not under {}.>; build it with eventlog::subject",
            subject::LEDGER_PREFIX
        )));
    }
    let bad = subject
        .split('.')
        .any(|t| t.is_empty() || t == "*" || t == ">" || t.chars().any(|c| c.is_whitespace()));
    if bad || subject.len() > 1024 {
        return Err(AppendError::Refused(format!(
            "subject {subject:?} has an empty token, a wildcard or whitespace"
        )));
    }
    Ok(())
}

/// Whether `subject` matches the NATS `filter` (`*` one token, `>` the rest).
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn wildcards_match_like_nats() {
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.b.c"));
        assert!(subject_matches("a.*", "a.b"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("*.b.>", "x.b.c.d"));
        assert!(!subject_matches("*.b.>", "x.c.c.d"));
    }
}
