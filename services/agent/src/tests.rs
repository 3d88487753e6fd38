//! The agent against an embedded log.

use super::*;
use eventlog::embedded::EmbeddedLog;

/// An agent whose node name the ledger holds with other GPUs stops, saying which and what
/// to do, and writes nothing.
#[tokio::test]
async fn a_node_registered_with_other_gpus_stops_the_agent_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let registered = Envelope::new(
        uuid::Uuid::now_v7(),
        1_000,
        "agent:gpu-1",
        Event::NodeRegistered(NodeRegistered {
            node: "gpu-1".into(),
            gpus: 4,
            model: "H100".into(),
            labels: Default::default(),
        }),
    );
    log.append(Append::event(&registered, None, None))
        .await
        .unwrap();
    let before = log.last_seq().await.unwrap();
    let config = AgentConfig::new("gpu-1", dir.path().join("work"), Vec::new());
    let gpus = gpu::FakeGpus::new(8, "H100", Vec::new()).unwrap();
    let agent = Agent::new(
        log.clone(),
        Telemetry::Local(Arc::new(|_| {})),
        Box::new(gpus),
        config,
    );
    let err = agent.run(std::future::pending()).await.unwrap_err();
    assert!(
        matches!(
            &err,
            AgentError::RegisteredOtherwise {
                registered_gpus: 4,
                gpus: 8,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("pass another --node"), "{err}");
    assert_eq!(log.last_seq().await.unwrap(), before);
}

/// An agent that reads the ledger whole keeps the command and environment of the runs placed
/// on its node only, read from their submissions once placed; another node's stay in the log.
#[tokio::test]
async fn an_agent_keeps_the_commands_of_its_own_runs_only() {
    use ledger::event::{PlacedNode, WorkloadStarted, WorkloadSubmitted};
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open(&dir.path().join("log")).unwrap();
    let ours = uuid::Uuid::now_v7();
    let theirs = uuid::Uuid::now_v7();
    let mut events = Vec::new();
    for node in ["gpu-1", "gpu-2"] {
        events.push(Event::NodeRegistered(NodeRegistered {
            node: node.into(),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        }));
    }
    for (id, node, secret) in [(ours, "gpu-1", "ours"), (theirs, "gpu-2", "theirs")] {
        let mut s = WorkloadSubmitted::new(id, None, 2, 1);
        s.command = vec!["train".into(), secret.into()];
        s.env.insert("TOKEN".into(), secret.into());
        events.push(Event::WorkloadSubmitted(s));
        events.push(Event::WorkloadStarted(WorkloadStarted {
            workload: id,
            placement: vec![PlacedNode {
                node: node.into(),
                gpus: vec![0, 1],
            }],
            protected_until_ms: 10_000,
            borrowed: None,
        }));
    }
    for (i, event) in events.into_iter().enumerate() {
        let envelope = Envelope::new(uuid::Uuid::now_v7(), 1_000 + i as u64, "scheduler", event);
        log.append(Append::event(&envelope, None, None))
            .await
            .unwrap();
    }
    let config = AgentConfig::new("gpu-1", dir.path().join("work"), Vec::new());
    let gpus = gpu::FakeGpus::new(8, "H100", Vec::new()).unwrap();
    let mut agent = Agent::new(
        log.clone(),
        Telemetry::Local(Arc::new(|_| {})),
        Box::new(gpus),
        config,
    );
    for stored in log.read(1, 100).await.unwrap() {
        agent.apply(&stored);
    }
    assert!(
        agent.specs.is_empty(),
        "nothing is read before a placement is acted on"
    );
    let placed = agent.placed_here();
    assert_eq!(placed.keys().map(|k| k.0).collect::<Vec<_>>(), vec![ours]);
    let unknown = agent.fetch_specs(&placed).await;
    assert!(unknown.is_empty(), "{unknown:?}");
    assert_eq!(agent.specs.keys().copied().collect::<Vec<_>>(), vec![ours]);
    let (command, env) = &agent.specs[&ours];
    assert_eq!(command, &vec!["train".to_owned(), "ours".to_owned()]);
    assert_eq!(env["TOKEN"], "ours");
    assert!(
        !format!("{:?}", agent.specs).contains("theirs"),
        "another node's command or environment is held"
    );
}
