//! Leases on a real nats-server: one holder at a time, renewals keep it, a holder
//! that stops renewing loses it to another after the time to live, and cannot then renew.

use std::time::Duration;

use eventlog::lease::Lease;
use eventlog::testing::NatsServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_holder_at_a_time_and_a_silent_one_is_replaced() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let ttl = Duration::from_secs(1);
    let mut a = Lease::open(&js, "test", "leader", "a", ttl, 1)
        .await
        .unwrap();
    let mut b = Lease::open(&js, "test", "leader", "b", ttl, 1)
        .await
        .unwrap();
    assert!(a.hold().await, "the first claim takes the free lease");
    assert!(!b.hold().await, "a held lease is not taken");
    // Renewals within the time to live keep it, for longer than the time to live.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(a.hold().await);
        assert!(!b.hold().await);
    }
    assert_eq!(a.holder().await.as_deref(), Some("a"));
    // a falls silent: once its entry ages out, b takes over.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !b.hold().await {
        assert!(tokio::time::Instant::now() < deadline, "b never took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(b.holder().await.as_deref(), Some("b"));
    assert!(!a.hold().await, "a stale holder cannot renew");
    assert!(b.hold().await);
    // Other keys of the bucket are leased independently; bad keys are refused with the reason.
    let mut c = Lease::open(&js, "test", "node-1", "c", ttl, 1)
        .await
        .unwrap();
    assert!(c.hold().await);
    let bad = Lease::open(&js, "test", "node 1", "d", ttl, 1)
        .await
        .err()
        .unwrap();
    assert!(bad.contains("cannot name a lease"), "{bad}");
}

/// A holder whose renewal landed without its answer (its revision lost, as in a failover) keeps
/// its lease instead of being locked out by its own claim until it ages out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_lost_its_revision_keeps_its_lease() {
    let server = NatsServer::start();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let ttl = Duration::from_secs(30);
    let mut a = Lease::open(&js, "test", "leader", "a:1", ttl, 1)
        .await
        .unwrap();
    assert!(a.hold().await);
    // Another handle of the same holder renews: `a`'s revision is now stale, as after an
    // update whose answer was lost.
    let mut same = Lease::open(&js, "test", "leader", "a:1", ttl, 1)
        .await
        .unwrap();
    assert!(same.hold().await, "the holder's own claim is its to renew");
    assert!(
        a.hold().await,
        "a stale revision does not lock the holder out"
    );
    // Nobody else gets it meanwhile.
    let mut b = Lease::open(&js, "test", "leader", "b:1", ttl, 1)
        .await
        .unwrap();
    assert!(!b.hold().await);
    assert_eq!(a.holder().await.as_deref(), Some("a:1"));
}
