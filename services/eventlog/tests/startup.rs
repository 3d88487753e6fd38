//! Start-up checks of the JetStream log: each refusal names the cause and what to do.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::time::Duration;

use async_nats::jetstream;
use eventlog::access::{self, NatsRole, NatsUser};
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
    // A ledger stream made before the feed existed gets it at the next start.
    let mut before = info.config.clone();
    before.republish = None;
    again.context().update_stream(&before).await.unwrap();
    let third = JetStreamLog::connect(&server.url(), quick()).await.unwrap();
    let info = third
        .context()
        .get_stream("LEDGER")
        .await
        .unwrap()
        .get_info()
        .await
        .unwrap();
    let feed = info.config.republish.expect("the feed is back");
    assert_eq!(
        (feed.source.as_str(), feed.destination.as_str()),
        ("fairledger.ledger.>", "fairledger.feed.>")
    );
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
    // Checked as they are, beside the users.conf that `fairledger nats-auth` writes (secure.conf
    // includes it beside itself; the cluster's nodes from the volume mounted at auth/).
    let copies = secure_conf(&[]);
    let users = copies.path().join("users.conf");
    std::fs::create_dir_all(copies.path().join("auth")).unwrap();
    std::fs::copy(&users, copies.path().join("auth/users.conf")).unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(&ops).unwrap() {
        let shipped = entry.unwrap().path();
        if shipped.extension().is_some_and(|e| e == "conf") {
            let path = copies.path().join(shipped.file_name().unwrap());
            std::fs::copy(&shipped, &path).unwrap();
            let out = std::process::Command::new(eventlog::testing::server_binary())
                .arg("-c")
                .arg(&path)
                .arg("-t")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {}",
                shipped.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 6, "single, strict, secure and three cluster nodes");
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

/// The shipped `ops/nats/secure.conf`, copied into a directory of its own beside a `users.conf`
/// holding a service user and `others`; answers the directory (seeds in `<name>.nk`).
fn secure_conf(others: &[(&str, NatsRole)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let ops = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/nats");
    std::fs::copy(ops.join("secure.conf"), dir.path().join("secure.conf")).unwrap();
    let mut users = Vec::new();
    for (name, role) in [("fairledger", NatsRole::Service)]
        .into_iter()
        .chain(others.iter().cloned())
    {
        let (seed, nkey) = access::new_user_nkey().unwrap();
        std::fs::write(dir.path().join(format!("{name}.nk")), seed).unwrap();
        users.push(NatsUser {
            name: name.into(),
            role,
            nkey,
        });
    }
    std::fs::write(dir.path().join("users.conf"), access::users_conf(&users)).unwrap();
    dir
}

/// Options for the user whose seed is `<dir>/<name>.nk`; `manage` for the service.
fn as_user(dir: &std::path::Path, name: &str, manage: bool) -> JetStreamOptions {
    JetStreamOptions {
        manage_streams: manage,
        ack_timeout: Duration::from_secs(1),
        auth: eventlog::NatsAuth {
            nkey: Some(dir.join(format!("{name}.nk"))),
            inbox_prefix: (!manage).then(|| access::inbox_prefix(name)),
            ..Default::default()
        },
        ..quick()
    }
}

/// What the server said to a raw client of `name` that published to each of `subjects`.
async fn violations(
    server: &NatsServer,
    dir: &std::path::Path,
    name: &str,
    subjects: &[&str],
) -> Vec<String> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seed = std::fs::read_to_string(dir.join(format!("{name}.nk"))).unwrap();
    let kept = seen.clone();
    let client = async_nats::ConnectOptions::with_nkey(seed)
        .custom_inbox_prefix(access::inbox_prefix(name))
        .event_callback(move |event| {
            let kept = kept.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    kept.lock().unwrap().push(e.to_string());
                }
            }
        })
        .connect(server.url())
        .await
        .unwrap();
    for subject in subjects {
        client
            .publish(subject.to_string(), "{}".into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while seen.lock().unwrap().len() < subjects.len() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = seen.lock().unwrap().clone();
    seen
}

/// access: with the shipped secure configuration, only the service writes the ledger; an agent
/// reads it, publishes its own node's telemetry and holds its own lease only; a reader reads it
/// through consumers and publishes nothing; a client without credentials is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_permissions_keep_each_role_to_its_subjects() {
    let dir = secure_conf(&[
        (
            "gpu-1",
            NatsRole::Agent {
                node: "gpu-1".into(),
            },
        ),
        ("billing", NatsRole::Reader),
    ]);
    let d = dir.path();
    let server = NatsServer::start_with(ServerOptions {
        config: Some(d.join("secure.conf")),
        ..Default::default()
    });
    let err = JetStreamLog::connect(&server.url(), quick())
        .await
        .err()
        .unwrap();
    assert!(matches!(err, ConnectError::Refused { .. }), "{err:?}");
    assert!(err.to_string().contains("--nats-nkey"), "{err}");

    // The service creates the streams and the agents' bucket, and writes.
    let service = JetStreamLog::connect(&server.url(), as_user(d, "fairledger", true))
        .await
        .unwrap();
    eventlog::lease::ensure_bucket(
        service.context(),
        eventlog::lease::AGENTS_BUCKET,
        eventlog::lease::AGENTS_TTL,
        1,
    )
    .await
    .unwrap();
    let event = |e: ledger::Event| {
        let env = ledger::Envelope::new(uuid::Uuid::now_v7(), 1, "user:admin", e);
        Append::event(&env, None, None)
    };
    let set = || {
        event(ledger::Event::AllocationSet(ledger::event::AllocationSet {
            path: "team".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }))
    };
    service.append(set()).await.unwrap();
    let started = || {
        event(ledger::Event::WorkloadStarted(
            ledger::event::WorkloadStarted {
                workload: uuid::Uuid::from_u128(1),
                placement: vec![],
                protected_until_ms: 0,
                borrowed: None,
            },
        ))
    };

    // The agent of gpu-1: reads the ledger, publishes its own heartbeats, holds its own key.
    let agent = JetStreamLog::connect(&server.url(), as_user(d, "gpu-1", false))
        .await
        .unwrap();
    assert_eq!(agent.read(1, 10).await.unwrap().len(), 1);
    let hb = |node: &str| ledger::event::GpuHeartbeat {
        node: node.into(),
        readings: vec![],
    };
    let subject = eventlog::subject::for_telemetry(&hb("gpu-1"));
    agent
        .publish_telemetry(subject, "{}".into())
        .await
        .expect("its own node's heartbeat");
    let lease = |key: &str| {
        let key = key.to_owned();
        let agent = agent.clone();
        async move {
            let mut lease = eventlog::lease::Lease::open(
                agent.context(),
                eventlog::lease::AGENTS_BUCKET,
                &key,
                "agent",
                eventlog::lease::AGENTS_TTL,
                1,
            )
            .await
            .unwrap();
            lease.hold().await
        }
    };
    assert!(lease("gpu-1").await, "its own node's lease");
    assert!(!lease("gpu-2").await, "another node's lease");
    // Its runs' output: its own node's only, and where its own stands.
    {
        use eventlog::output::{Chunk, OutputLimits, OutputStore, RunKey};
        service.output(&OutputLimits::default()).await.unwrap();
        let output = agent.output(&OutputLimits::default()).await.unwrap();
        let run = |node: &str| RunKey {
            workload: uuid::Uuid::from_u128(1),
            run: 1,
            node: node.into(),
        };
        let chunk = Chunk {
            offset: 0,
            data: "hello\n".into(),
            end: false,
            at_ms: 1,
        };
        output.append(&run("gpu-1"), chunk.clone()).await.unwrap();
        assert_eq!(
            output
                .shipped(&run("gpu-1"))
                .await
                .unwrap()
                .unwrap()
                .next_offset,
            6
        );
        assert!(output.append(&run("gpu-2"), chunk).await.is_err());
        assert!(output.shipped(&run("gpu-2")).await.is_err());
    }
    // It may not write the ledger, nor speak for another node.
    assert!(agent.append(started()).await.is_err());
    assert!(agent.append(set()).await.is_err());
    let other = eventlog::subject::for_telemetry(&hb("gpu-2"));
    assert!(agent.publish_telemetry(other, "{}".into()).await.is_err());
    let said = violations(
        &server,
        d,
        "gpu-1",
        &[
            "fairledger.ledger.workload.started.team",
            "fairledger.ledger.allocation.set.team",
            "fairledger.report.gpu-2",
        ],
    )
    .await;
    assert_eq!(said.len(), 3, "{said:?}");
    assert!(
        said.iter().all(|s| s.contains("Permissions Violation")),
        "{said:?}"
    );

    // A reader: reads by direct gets and follows the feed, publishes nothing.
    let reader = JetStreamLog::connect(&server.url(), as_user(d, "billing", false))
        .await
        .unwrap();
    assert_eq!(reader.read(1, 10).await.unwrap().len(), 1);
    let mut tail = reader.subscribe(1).await.unwrap();
    use futures::StreamExt;
    assert_eq!(tail.next().await.unwrap().unwrap().seq, 1);
    assert!(reader.append(set()).await.is_err());
    let said = violations(
        &server,
        d,
        "billing",
        &[
            "fairledger.ledger.allocation.set.team",
            "fairledger.telemetry.gpu.heartbeat.x",
        ],
    )
    .await;
    assert_eq!(said.len(), 2, "{said:?}");
    assert!(
        said.iter().all(|s| s.contains("Permissions Violation")),
        "{said:?}"
    );

    // Nothing but the service's one event reached the ledger.
    assert_eq!(service.last_seq().await.unwrap(), 1);
}

/// access: the attack that stopped the service from NATS, against the shipped configuration.
/// Neither an agent nor a reader may create, list or delete a consumer of the ledger (they
/// follow it on its feed, consumer-free), so none can use up the server's consumers or take
/// the service's away: the service's subscription goes on and its appends are acknowledged,
/// while both follow every event, old and new, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_agent_or_reader_can_touch_the_ledgers_consumers() {
    use futures::StreamExt;
    let dir = secure_conf(&[
        (
            "gpu-1",
            NatsRole::Agent {
                node: "gpu-1".into(),
            },
        ),
        ("billing", NatsRole::Reader),
    ]);
    let d = dir.path();
    let server = NatsServer::start_with(ServerOptions {
        config: Some(d.join("secure.conf")),
        ..Default::default()
    });
    let service = JetStreamLog::connect(&server.url(), as_user(d, "fairledger", true))
        .await
        .unwrap();
    let set = |weight: u32| {
        let env = ledger::Envelope::new(
            uuid::Uuid::now_v7(),
            1,
            "user:admin",
            ledger::Event::AllocationSet(ledger::event::AllocationSet {
                path: "team".into(),
                weight,
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
            }),
        );
        Append::event(&env, None, None)
    };
    for w in 1..=3 {
        service.append(set(w)).await.unwrap();
    }
    let mut services = service.subscribe(1).await.unwrap();
    assert_eq!(services.next().await.unwrap().unwrap().seq, 1);
    let consumers = service.readers_open().await.unwrap();
    assert!(consumers >= 1, "the service's subscription is a consumer");

    // What filled the server's consumers and deleted the service's, as an agent and a reader.
    let attack = [
        "$JS.API.CONSUMER.CREATE.LEDGER",
        "$JS.API.CONSUMER.CREATE.LEDGER.evil",
        "$JS.API.CONSUMER.CREATE.LEDGER.evil.fairledger.ledger.>",
        "$JS.API.CONSUMER.DURABLE.CREATE.LEDGER.evil",
        "$JS.API.CONSUMER.DELETE.LEDGER.anything",
        "$JS.API.CONSUMER.LIST.LEDGER",
        "$JS.API.CONSUMER.NAMES.LEDGER",
        "$JS.API.CONSUMER.MSG.NEXT.LEDGER.anything",
    ];
    for user in ["gpu-1", "billing"] {
        let said = violations(&server, d, user, &attack).await;
        assert_eq!(said.len(), attack.len(), "{user}: {said:?}");
        assert!(
            said.iter().all(|s| s.contains("Permissions Violation")),
            "{user}: {said:?}"
        );
    }
    assert_eq!(service.readers_open().await.unwrap(), consumers);

    // Both follow the ledger without a consumer: what was, then what comes.
    let agent = JetStreamLog::connect(&server.url(), as_user(d, "gpu-1", false))
        .await
        .unwrap();
    let reader = JetStreamLog::connect(&server.url(), as_user(d, "billing", false))
        .await
        .unwrap();
    let mut followers = [
        agent.subscribe(2).await.unwrap(),
        reader.subscribe(1).await.unwrap(),
    ];
    for w in 4..=6 {
        service
            .append(set(w))
            .await
            .expect("the service is acknowledged");
    }
    let wait = Duration::from_secs(30);
    for (follower, from) in followers.iter_mut().zip([2u64, 1]) {
        for seq in from..=6 {
            let e = tokio::time::timeout(wait, follower.next())
                .await
                .expect("the follower keeps up")
                .unwrap()
                .unwrap();
            assert_eq!(e.seq, seq);
            assert!(
                e.subject.starts_with("fairledger.ledger.allocation.set"),
                "{}",
                e.subject
            );
        }
    }
    for seq in 2..=6 {
        let e = tokio::time::timeout(wait, services.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(e.seq, seq, "the service's own subscription goes on");
    }
    assert_eq!(
        service.readers_open().await.unwrap(),
        consumers,
        "no consumer was made"
    );
}

/// tls: a server that requires TLS is reached with --nats-tls-ca naming the CA of its
/// certificate, and not without it.
#[tokio::test]
async fn a_tls_server_is_reached_with_its_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    let cert =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_file, cert.cert.pem()).unwrap();
    std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
    let conf = dir.path().join("tls.conf");
    std::fs::write(
        &conf,
        format!(
            "jetstream {{ store_dir: \"./nats-data\" }}\ntls {{\n  cert_file: {:?}\n  key_file: {:?}\n}}\n",
            cert_file, key_file
        ),
    )
    .unwrap();
    let server = NatsServer::start_with(ServerOptions {
        config: Some(conf),
        ..Default::default()
    });
    let url = format!("tls://127.0.0.1:{}", server.port());
    let trusted = JetStreamOptions {
        auth: eventlog::NatsAuth {
            tls_ca: Some(cert_file.clone()),
            ..Default::default()
        },
        ..quick()
    };
    let log = JetStreamLog::connect(&url, trusted).await.unwrap();
    assert_eq!(log.last_seq().await.unwrap(), 0);
    assert!(
        JetStreamLog::connect(&url, quick()).await.is_err(),
        "a certificate no public root signed is refused"
    );
}

/// access: a heartbeat counts only on its own node's subject and as that node's agent, so a
/// message delivered onto another node's subject (another agent's, or a ledger sample replayed
/// there by a consumer) keeps no node alive.
#[tokio::test]
async fn a_heartbeat_counts_only_on_its_nodes_subject_from_its_nodes_agent() {
    use futures::StreamExt;
    let server = NatsServer::start();
    let log = JetStreamLog::connect(&server.url(), quick()).await.unwrap();
    let mut heartbeats = log.heartbeats().await.unwrap();
    let beat = |node: &str, actor: &str| {
        let hb = ledger::event::GpuHeartbeat {
            node: node.into(),
            readings: vec![],
        };
        let env = ledger::Envelope::new(
            uuid::Uuid::now_v7(),
            1,
            actor,
            ledger::Event::GpuHeartbeat(hb),
        );
        serde_json::to_vec(&env).unwrap()
    };
    let on = |node: &str| {
        eventlog::subject::for_telemetry(&ledger::event::GpuHeartbeat {
            node: node.into(),
            readings: vec![],
        })
    };
    for (subject, payload) in [
        (on("gpu-1"), beat("gpu-2", "agent:gpu-2")),
        (on("gpu-1"), beat("gpu-1", "scheduler")),
        (on("gpu-1"), beat("gpu-1", "agent:gpu-1")),
    ] {
        log.publish_telemetry(subject, payload.into())
            .await
            .unwrap();
    }
    let first = tokio::time::timeout(Duration::from_secs(5), heartbeats.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.actor, "agent:gpu-1", "only the third counts");
    let more = tokio::time::timeout(Duration::from_millis(300), heartbeats.next()).await;
    assert!(more.is_err(), "nothing else came through");
}
