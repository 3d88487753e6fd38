//! Heartbeats, and the clock they correct: every interval the agent reads its GPUs and sends the
//! readings (to the `TELEMETRY` stream, the API, or the server it lives in); each answer says
//! when the server took them, which measures this machine's clock against the server's, and events
//! are stamped with the corrected time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ledger::event::GpuHeartbeat;
use ledger::{Envelope, Event};
use uuid::Uuid;

use crate::{GpuSource, Telemetry};

/// The time used for events: this machine's clock, corrected by the server's where measured.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Clock {
    /// Added to this machine's clock (a test's pretend skew).
    skew_ms: i64,
    /// Server time minus this machine's (skewed) time, last measured.
    correction_ms: i64,
    warned: bool,
}

impl Clock {
    /// A clock `skew_ms` off this machine's (a test's pretend skew), not yet measured.
    pub(crate) fn skewed(skew_ms: i64) -> Self {
        Clock {
            skew_ms,
            ..Clock::default()
        }
    }

    pub(crate) fn local_ms(&self) -> u64 {
        (wall_clock_ms() as i64 + self.skew_ms).max(0) as u64
    }

    pub(crate) fn now_ms(&self) -> u64 {
        (self.local_ms() as i64 + self.correction_ms).max(0) as u64
    }

    /// Converts a time taken by this machine's clock into server time.
    pub(crate) fn server_time(&self, local_ms: u64) -> u64 {
        (local_ms as i64 + self.skew_ms + self.correction_ms).max(0) as u64
    }

    /// Takes a measurement: the server stamped `server_ms` between `sent_ms` and `acked_ms`
    /// (this machine's skewed clock).
    pub(crate) fn measured(&mut self, node: &str, sent_ms: u64, acked_ms: u64, server_ms: u64) {
        let mid = sent_ms / 2 + acked_ms / 2;
        let correction = server_ms as i64 - mid as i64;
        // Within the round trip the measurement cannot tell: keep the clock as it is.
        let uncertainty = acked_ms.saturating_sub(sent_ms) as i64 / 2 + 50;
        self.correction_ms = if correction.abs() > uncertainty {
            correction
        } else {
            0
        };
        let off = correction.unsigned_abs() > 1_000;
        if off && !self.warned {
            tracing::warn!(
                "the clock of node {node:?} is off by {:.1} s from the server's: events are stamped with the server's time; fix this machine's time synchronisation (NTP)",
                -correction as f64 / 1000.0
            );
        }
        self.warned = off;
    }
}

/// Milliseconds since the Unix epoch by this machine's clock.
pub fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Publishes the GPUs' readings every `interval` (unless a scripted fault silenced them), read
/// off the async threads (NVML may block), and corrects `clock` by the server's answers.
pub(crate) async fn heartbeats(
    mut source: Box<dyn GpuSource>,
    telemetry: Telemetry,
    node: String,
    actor: String,
    interval: Duration,
    clock: Arc<std::sync::Mutex<Clock>>,
    busy: tokio::sync::watch::Receiver<Vec<u32>>,
) {
    let started = Instant::now();
    let now = || *clock.lock().expect("the clock is never poisoned");
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let elapsed = started.elapsed();
        if source.silent(elapsed) {
            continue;
        }
        let gpus = busy.borrow().clone();
        let read = tokio::task::spawn_blocking(move || {
            let readings = source.read(elapsed, &gpus);
            (source, readings)
        })
        .await;
        let readings = match read {
            Ok((back, Ok(readings))) => {
                source = back;
                readings
            }
            Ok((back, Err(e))) => {
                source = back;
                // No heartbeat: the scheduler marks the GPUs unhealthy after its timeout.
                tracing::warn!(error = %e, "cannot read the GPUs; no heartbeat this time");
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "reading the GPUs failed; no more heartbeats");
                return;
            }
        };
        let hb = GpuHeartbeat {
            node: node.clone(),
            readings,
        };
        let subject = eventlog::subject::for_telemetry(&hb);
        let env = Envelope::new(
            Uuid::now_v7(),
            now().now_ms(),
            actor.clone(),
            Event::GpuHeartbeat(hb),
        );
        let sent = now().local_ms();
        let server = match &telemetry {
            Telemetry::Local(f) => {
                f(&env);
                continue;
            }
            Telemetry::Http(api) => {
                let Event::GpuHeartbeat(hb) = &env.event else {
                    unreachable!("a heartbeat")
                };
                match api.heartbeat(&hb.readings, env.occurred_at_ms).await {
                    Ok(server) => server,
                    Err(e) => {
                        tracing::warn!(error = %e, "heartbeat not taken");
                        continue;
                    }
                }
            }
            Telemetry::JetStream(js) => {
                let payload = serde_json::to_vec(&env).expect("envelopes serialize");
                match stored_at(js, subject, payload.into()).await {
                    Ok(server) => server,
                    Err(e) => {
                        tracing::warn!(error = %e, "heartbeat not published");
                        continue;
                    }
                }
            }
        };
        let acked = now().local_ms();
        clock
            .lock()
            .expect("the clock is never poisoned")
            .measured(&node, sent, acked, server);
    }
}

/// Publishes `payload` on the telemetry `subject`; answers the server's clock when it stored it.
pub(crate) async fn stored_at(
    js: &eventlog::jetstream::JetStreamLog,
    subject: String,
    payload: bytes::Bytes,
) -> Result<u64, String> {
    let seq = js
        .publish_telemetry(subject, payload)
        .await
        .map_err(|e| e.to_string())?;
    js.telemetry_stored_at_ms(seq)
        .await
        .map_err(|e| e.to_string())
}
