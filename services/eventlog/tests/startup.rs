//! Start-up checks of the JetStream log: each refusal names the cause and what to do.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::time::Duration;

use async_nats::jetstream;
use eventlog::jetstream::ConnectError;
use eventlog::testing::{free_port, NatsServer, ServerOptions};
use eventlog::{Append, EventLog, JetStreamLog, JetStreamOptions};

fn quick() -> JetStreamOptions {
    JetStreamOptions {
        connect_timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

#[tokio::test]
async fn an_unreachable_url_says_where_it_looked() {
    let url = format!("nats://127.0.0.1:{}", free_port());
    let err = JetStreamLog::connect(&url, quick()).await.err().unwrap();
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&url) && text.contains("--nats"), "{text}");
}

#[tokio::test]
async fn a_server_without_jetstream_is_refused() {
    let server = NatsServer::start_with(ServerOptions {
        jetstream: false,
        ..Default::default()
    });
    let err = JetStreamLog::connect(&server.url(), quick())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, ConnectError::NoJetStream { .. }), "{err:?}");
    assert!(err.to_string().contains("-js"), "{err}");
}

/// A peer that speaks just enough of the NATS protocol to announce itself as `version`.
fn old_server(version: &'static str) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let info = format!(
                    "INFO {{\"server_id\":\"OLD\",\"server_name\":\"old\",\"version\":\"{version}\",\"proto\":1,\"go\":\"go1.19\",\"host\":\"127.0.0.1\",\"port\":{port},\"headers\":true,\"max_payload\":1048576}}\r\n"
                );
                if stream.write_all(info.as_bytes()).is_err() {
                    return;
                }
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                    if line.starts_with("PING") && stream.write_all(b"PONG\r\n").is_err() {
                        return;
                    }
                    line.clear();
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn a_server_older_than_2_12_is_refused() {
    let port = old_server("2.9.10");
    let url = format!("nats://127.0.0.1:{port}");
    let err = JetStreamLog::connect(&url, quick()).await.err().unwrap();
    assert!(matches!(err, ConnectError::TooOld { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("2.9.10") && text.contains("2.12 or newer"),
        "{text}"
    );
}

#[tokio::test]
async fn a_ledger_stream_with_a_retention_limit_is_not_touched() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "LEDGER".into(),
        subjects: vec!["fairledger.ledger.>".into()],
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .unwrap();
    let err = JetStreamLog::connect(&server.url(), quick())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, ConnectError::IncompatibleStream { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("kept forever"), "{err}");
    let info = js
        .get_stream("LEDGER")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    assert_eq!(
        info.config.max_age,
        Duration::from_secs(3600),
        "left as it was"
    );
}

#[tokio::test]
async fn start_up_is_idempotent_and_updates_what_may_change() {
    let server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), quick()).await.unwrap();
    log.append(Append::new("fairledger.ledger.test.a", "1"))
        .await
        .unwrap();
    let wider = JetStreamOptions {
        duplicate_window: Duration::from_secs(3600),
        ..quick()
    };
    let again = JetStreamLog::connect(&server.url(), wider).await.unwrap();
    assert_eq!(again.last_seq().await.unwrap(), 1, "the stream was kept");
    let info = again
        .context()
        .get_stream("LEDGER")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    assert_eq!(info.config.duplicate_window, Duration::from_secs(3600));
    assert!(info.config.allow_atomic_publish && info.config.deny_delete);
    let telemetry = again
        .context()
        .get_stream("TELEMETRY")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    assert_eq!(telemetry.config.max_age, Duration::from_secs(24 * 3600));
}

#[tokio::test]
async fn a_list_of_servers_is_a_cluster_to_try_in_turn() {
    let server = NatsServer::start();
    let dead = format!("nats://127.0.0.1:{}", free_port());
    let urls = format!("{dead}, {}", server.url());
    let log = JetStreamLog::connect(&urls, quick()).await.unwrap();
    log.append(Append::new("fairledger.ledger.test.a", "1"))
        .await
        .unwrap();
    assert_eq!(log.last_seq().await.unwrap(), 1);
}

#[test]
fn the_shipped_server_configs_are_valid() {
    let ops = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/nats");
    let mut checked = 0;
    for entry in std::fs::read_dir(&ops).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "conf") {
            let out = std::process::Command::new(eventlog::testing::server_binary())
                .arg("-c")
                .arg(&path)
                .arg("-t")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 5, "single, strict and three cluster nodes");
    let strict = std::fs::read_to_string(ops.join("strict.conf")).unwrap();
    assert!(strict.contains("sync_interval: always"));
}

#[tokio::test]
async fn heartbeats_go_to_telemetry_not_to_the_ledger() {
    let server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), quick()).await.unwrap();
    let heartbeat = ledger::event::GpuHeartbeat {
        node: "h100-0".into(),
        readings: Vec::new(),
    };
    let subject = eventlog::subject::for_telemetry(&heartbeat);
    assert_eq!(subject, "fairledger.telemetry.gpu.heartbeat.h100-0");
    assert_eq!(
        eventlog::subject::for_event(&ledger::Event::GpuHeartbeat(heartbeat), None),
        "fairledger.ledger.gpu.utilization.h100-0",
        "a heartbeat sampled into the ledger has a ledger subject"
    );
    let seq = log
        .publish_telemetry(subject.clone(), "{}".into())
        .await
        .unwrap();
    assert_eq!(seq, 1);
    assert_eq!(log.last_seq().await.unwrap(), 0, "the ledger did not move");
    // The ledger refuses telemetry subjects and the reverse.
    assert!(log.append(Append::new(subject, "{}")).await.is_err());
    assert!(log
        .publish_telemetry("fairledger.ledger.x".into(), "{}".into())
        .await
        .is_err());
    let telemetry = log
        .context()
        .get_stream("TELEMETRY")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    assert_eq!(telemetry.state.messages, 1);
}
