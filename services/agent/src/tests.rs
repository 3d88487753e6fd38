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
