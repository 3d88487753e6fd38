//! The streams the service makes: what `LEDGER` and `TELEMETRY` are (the ledger kept for ever,
//! republished on its feed; telemetry bounded by age), and creating them, or updating what may
//! change safely in streams made before.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use super::{ConnectError, JetStreamOptions, LEDGER_STREAM, TELEMETRY_STREAM};

pub(super) fn ledger_config(options: &JetStreamOptions) -> stream::Config {
    stream::Config {
        name: LEDGER_STREAM.into(),
        subjects: vec![format!("{}.>", crate::subject::LEDGER_PREFIX)],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        num_replicas: options.replicas,
        duplicate_window: options.duplicate_window,
        allow_atomic_publish: true,
        allow_direct: true,
        deny_delete: true,
        deny_purge: true,
        republish: Some(stream::Republish {
            source: format!("{}.>", crate::subject::LEDGER_PREFIX),
            destination: format!("{}.>", crate::subject::FEED_PREFIX),
            headers_only: false,
        }),
        description: Some("fairledger: every fact that changes the ledger, kept forever".into()),
        ..Default::default()
    }
}

pub(super) fn telemetry_config(options: &JetStreamOptions) -> stream::Config {
    stream::Config {
        name: TELEMETRY_STREAM.into(),
        subjects: vec![format!("{}.>", crate::subject::TELEMETRY_PREFIX)],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        max_age: options.telemetry_max_age,
        num_replicas: options.replicas,
        allow_direct: true,
        description: Some("fairledger: raw GPU heartbeats, bounded by age".into()),
        ..Default::default()
    }
}

/// Creates `want`, or updates the stream of that name where it may be changed safely.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    want: stream::Config,
) -> Result<stream::Stream, ConnectError> {
    let name = want.name.clone();
    let failed = |reason: String| ConnectError::Stream {
        stream: name.clone(),
        reason,
    };
    match js.get_stream(&name).await {
        Ok(mut existing) => {
            let have = existing
                .info()
                .await
                .map_err(|e| failed(e.to_string()))?
                .config
                .clone();
            let incompatible = |reason: String| ConnectError::IncompatibleStream {
                stream: name.clone(),
                reason,
            };
            if have.subjects != want.subjects {
                return Err(incompatible(format!(
                    "subjects are {:?}, fairledger needs {:?}",
                    have.subjects, want.subjects
                )));
            }
            if have.storage != want.storage {
                return Err(incompatible("storage is not file".into()));
            }
            if have.retention != want.retention {
                return Err(incompatible(format!(
                    "retention is {:?}, fairledger needs limits",
                    have.retention
                )));
            }
            if name == LEDGER_STREAM
                && (have.max_age != Duration::ZERO
                    || have.max_messages > 0
                    || have.max_bytes > 0
                    || have.max_messages_per_subject > 0)
            {
                return Err(incompatible(
                    "it has an age, size or count limit, but the ledger must be kept forever"
                        .into(),
                ));
            }
            let differs = have.num_replicas != want.num_replicas
                || have.republish != want.republish
                || have.duplicate_window != want.duplicate_window
                || have.allow_atomic_publish != want.allow_atomic_publish
                || have.allow_direct != want.allow_direct
                || have.max_age != want.max_age
                || have.max_messages_per_subject != want.max_messages_per_subject
                || have.max_bytes != want.max_bytes
                || have.max_message_size != want.max_message_size;
            if differs {
                let mut updated = have.clone();
                updated.num_replicas = want.num_replicas;
                updated.republish = want.republish.clone();
                updated.duplicate_window = want.duplicate_window;
                updated.allow_atomic_publish = want.allow_atomic_publish;
                updated.allow_direct = want.allow_direct;
                updated.max_age = want.max_age;
                updated.max_messages_per_subject = want.max_messages_per_subject;
                updated.max_bytes = want.max_bytes;
                updated.max_message_size = want.max_message_size;
                js.update_stream(&updated)
                    .await
                    .map_err(|e| failed(e.to_string()))?;
            }
            js.get_stream(&name)
                .await
                .map_err(|e| failed(e.to_string()))
        }
        Err(e) => {
            use async_nats::jetstream::context::GetStreamErrorKind;
            use async_nats::jetstream::ErrorCode;
            match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    js.create_stream(want)
                        .await
                        .map_err(|e| failed(e.to_string()))
                }
                _ => Err(failed(e.to_string())),
            }
        }
    }
}
