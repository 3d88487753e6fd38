//! For agents on NATS whose user may publish only their own node's subjects: the ledger read
//! through JetStream consumers, and the node's reports sent to the service as requests on
//! `fairledger.report.<node>` ([`RelayLog`]), which checks them as the HTTP API does and appends
//! them. Only the service writes the ledger's subjects.

use std::time::Duration;

use eventlog::{Append, AppendError, Appended, EventLog, JetStreamLog, LogError, Stored};
use futures::stream::BoxStream;

/// How long an agent waits for the service to answer a report.
const REPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The ledger on JetStream, as the agent of one node may use it.
#[derive(Clone)]
pub struct RelayLog {
    js: JetStreamLog,
    subject: String,
}

impl RelayLog {
    /// The ledger of `js` for the agent of `node`.
    pub fn new(js: JetStreamLog, node: &str) -> Self {
        RelayLog {
            subject: eventlog::subject::for_reports(node),
            js,
        }
    }
}

impl EventLog for RelayLog {
    async fn append_batch(&self, appends: Vec<Append>) -> Result<Vec<Appended>, AppendError> {
        let body = crate::http::report_body(&appends)?;
        let request = self
            .js
            .client()
            .request(self.subject.clone(), body.to_string().into());
        let reply = match tokio::time::timeout(REPORT_TIMEOUT, request).await {
            Err(_) => {
                return Err(AppendError::Unacknowledged(
                    "no answer from the service within 10 s".into(),
                ))
            }
            Ok(Err(e)) => {
                use async_nats::client::RequestErrorKind;
                return Err(match e.kind() {
                    RequestErrorKind::NoResponders => AppendError::Unavailable(
                        "no fairledger API process answers node reports on this NATS; start `fairledger serve`".into(),
                    ),
                    _ => AppendError::Unacknowledged(e.to_string()),
                });
            }
            Ok(Ok(reply)) => reply,
        };
        let answer: serde_json::Value = serde_json::from_slice(&reply.payload)
            .map_err(|e| AppendError::Unacknowledged(format!("an answer that is not JSON: {e}")))?;
        // A problem carries its status; a success does not.
        let status = answer["status"].as_u64().unwrap_or(200) as u16;
        crate::http::report_answer(status, &answer, &appends)
    }

    async fn last_seq(&self) -> Result<u64, LogError> {
        self.js.last_seq().await
    }

    async fn read(&self, from: u64, max: usize) -> Result<Vec<Stored>, LogError> {
        self.js.read(from, max).await
    }

    async fn subscribe(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        self.js.subscribe(from).await
    }
}
