//! The fault campaign: the service's processes and the log's servers killed while clients submit
//! work. Clients behave as the API asks (a failed submission is retried with its
//! `Idempotency-Key`), and after every fault each acknowledged submission is in the ledger exactly
//! once, the ledger reads back without a gap or a rewind, and service comes back by itself. Times
//! are printed for BENCHMARKS.md, never asserted.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::Server;
use eventlog::testing::{NatsCluster, NatsServer};
use serde_json::Value;

/// Clients submitting at once.
const CLIENTS: usize = 4;
/// Acknowledgements to see before a fault, and again after it.
const ACKS_AROUND_A_FAULT: usize = 150;
/// How long service may take to come back before the test fails.
const BACK_WITHIN: Duration = Duration::from_secs(90);

/// One HTTP call to `addr`; `None` when the server cannot be reached or does not answer within
/// ten seconds (as a client sees a killed server).
fn try_call(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut response = String::new();
    s.read_to_string(&mut response).ok()?;
    let status = response.get(9..12)?.parse().ok()?;
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    Some((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// Where the clients find the service: a restarted `serve` listens on another port.
#[derive(Clone)]
struct Target {
    addr: Arc<Mutex<String>>,
    token: String,
}

impl Target {
    fn of(server: &Server) -> Self {
        Target {
            addr: Arc::new(Mutex::new(server.addr.clone())),
            token: server.token.clone().expect("the first admin's token"),
        }
    }

    fn now_at(&self, server: &Server) {
        *self.addr.lock().unwrap() = server.addr.clone();
    }

    fn call(&self, method: &str, path: &str, headers: &str, body: &str) -> Option<(u16, Value)> {
        let addr = self.addr.lock().unwrap().clone();
        try_call(&addr, &self.token, method, path, headers, body)
    }
}

/// Clients submitting one-GPU workloads until stopped, each retrying a submission with its key
/// until it is acknowledged.
struct Load {
    stop: Arc<AtomicBool>,
    acked: Arc<AtomicUsize>,
    /// When each acknowledgement came.
    times: Arc<Mutex<Vec<Instant>>>,
    clients: Vec<JoinHandle<Vec<(String, String)>>>,
}

impl Load {
    fn start(target: &Target) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicUsize::new(0));
        let times = Arc::new(Mutex::new(Vec::new()));
        let clients = (0..CLIENTS)
            .map(|client| {
                let (stop, acked, target) = (stop.clone(), acked.clone(), target.clone());
                let times = times.clone();
                std::thread::spawn(move || {
                    let mut done = Vec::new();
                    'submissions: for n in 0.. {
                        let key = format!("c{client}-{n}");
                        loop {
                            if stop.load(Ordering::Relaxed) {
                                break 'submissions;
                            }
                            let answer = target.call(
                                "POST",
                                "/v1/workloads",
                                &format!("Idempotency-Key: {key}\r\n"),
                                r#"{"allocation":"team","gpus_per_node":1}"#,
                            );
                            match answer {
                                Some((200 | 202, v)) => {
                                    done.push((key, v["id"].as_str().unwrap().to_owned()));
                                    times.lock().unwrap().push(Instant::now());
                                    acked.fetch_add(1, Ordering::Relaxed);
                                    break;
                                }
                                Some((status, v)) if status < 500 => {
                                    panic!("submission {key} refused with {status}: {v}")
                                }
                                _ => std::thread::sleep(Duration::from_millis(50)),
                            }
                        }
                    }
                    done
                })
            })
            .collect();
        Load {
            stop,
            acked,
            times,
            clients,
        }
    }

    fn acked(&self) -> usize {
        self.acked.load(Ordering::Relaxed)
    }

    /// Waits until `more` submissions beyond `from` are acknowledged; answers how long it took.
    fn wait_for(&self, from: usize, more: usize, what: &str) -> Duration {
        let start = Instant::now();
        while self.acked() < from + more {
            assert!(
                start.elapsed() < BACK_WITHIN,
                "{what}: only {} of {more} submissions acknowledged in {BACK_WITHIN:?}",
                self.acked() - from
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        start.elapsed()
    }

    /// The longest time without an acknowledgement since `since`: the outage clients saw.
    fn longest_gap_since(&self, since: Instant) -> Duration {
        let mut times = self.times.lock().unwrap().clone();
        times.sort();
        let mut last = since;
        let mut longest = Duration::ZERO;
        for t in times.into_iter().filter(|t| *t > since) {
            longest = longest.max(t - last);
            last = t;
        }
        longest
    }

    /// Stops the clients; answers every acknowledged submission as (key, workload id).
    fn finish(self) -> Vec<(String, String)> {
        self.stop.store(true, Ordering::Relaxed);
        self.clients
            .into_iter()
            .flat_map(|c| c.join().expect("a client panicked"))
            .collect()
    }
}

/// A team and a node for the load to submit to.
fn set_up(server: &Server) {
    let (status, v) = server.call("PUT", "/v1/allocations/team", Some(r#"{"weight":1}"#));
    assert_eq!(status, 200, "{v}");
    let (status, v) = server.call(
        "POST",
        "/v1/nodes",
        Some(r#"{"node":"gpu-1","gpus":8,"model":"H100"}"#),
    );
    assert_eq!(status, 201, "{v}");
}

/// Reads the whole ledger page by page, failing on a page that does not go on from the last;
/// answers the idempotency key of every submission in it.
fn submitted_keys(target: &Target) -> Vec<String> {
    let mut keys = Vec::new();
    let mut after = 0u64;
    let deadline = Instant::now() + BACK_WITHIN;
    loop {
        let Some((200, page)) = target.call(
            "GET",
            &format!("/v1/events?after={after}&limit=1000"),
            "",
            "",
        ) else {
            assert!(Instant::now() < deadline, "the ledger could not be read");
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        let events = page["events"].as_array().unwrap();
        if events.is_empty() {
            return keys;
        }
        for e in events {
            let seq = e["seq"].as_u64().unwrap();
            assert_eq!(seq, after + 1, "the page after {after} went on at {seq}");
            after = seq;
            if e["event"]["type"] == "workload_submitted" {
                if let Some(key) = e["event"]["payload"]["idempotency_key"].as_str() {
                    keys.push(key.to_owned());
                }
            }
        }
    }
}

/// Every acknowledged submission is in the ledger exactly once, and readable as its workload.
fn nothing_acknowledged_lost_or_doubled(target: &Target, acked: &[(String, String)]) {
    let mut in_ledger: HashMap<String, usize> = HashMap::new();
    for key in submitted_keys(target) {
        // Keys are kept as `<actor>/<key>`.
        let own = key.rsplit('/').next().unwrap().to_owned();
        *in_ledger.entry(own).or_default() += 1;
    }
    for (key, id) in acked {
        assert_eq!(
            in_ledger.get(key),
            Some(&1),
            "acknowledged submission {key} ({id}) is in the ledger {:?} times",
            in_ledger.get(key)
        );
    }
    let doubled: Vec<_> = in_ledger.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "submitted more than once: {doubled:?}");
    // A sample of the workloads answer as themselves.
    for (_, id) in acked.iter().step_by(37) {
        let (status, row) = target
            .call("GET", &format!("/v1/workloads/{id}"), "", "")
            .expect("the service answers");
        assert_eq!(status, 200, "{row}");
        assert_eq!(row["id"], id.as_str());
    }
}

/// `serve` on the log `args` name is SIGKILLed while clients submit, then started again on the
/// same data: the clients' retries land once each, and nothing acknowledged is lost.
fn serve_killed_under_load(args: &[&str], backend: &str) {
    let mut server = Server::start(args);
    set_up(&server);
    let target = Target::of(&server);
    let load = Load::start(&target);
    load.wait_for(0, ACKS_AROUND_A_FAULT, "before the fault");
    let killed = Instant::now();
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let before = load.acked();
    server = Server::start(args);
    target.now_at(&server);
    let listening = killed.elapsed();
    load.wait_for(before, ACKS_AROUND_A_FAULT, "after serve was killed");
    let outage = load.longest_gap_since(killed);
    let acked = load.finish();
    eprintln!(
        "{backend}: serve SIGKILLed after {before} acknowledged; listening again {listening:.2?} \
         after the kill; no acknowledgement for {outage:.2?}; {} in all",
        acked.len()
    );
    nothing_acknowledged_lost_or_doubled(&target, &acked);
}

#[test]
fn serve_killed_under_load_on_the_embedded_log_loses_nothing_acknowledged() {
    let data = tempfile::tempdir().unwrap();
    serve_killed_under_load(&["--data", data.path().to_str().unwrap()], "embedded");
}

#[test]
fn serve_killed_under_load_on_nats_loses_nothing_acknowledged() {
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    serve_killed_under_load(
        &[
            "--nats",
            &nats.url(),
            "--data",
            data.path().to_str().unwrap(),
        ],
        "nats",
    );
}

/// nats-server SIGKILLed while clients submit and started again on its store: the service comes
/// back by itself, and nothing acknowledged is lost or doubled.
#[test]
fn nats_killed_and_restarted_under_load_loses_nothing_acknowledged() {
    let mut nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let server = common::on_nats(&nats.url(), "all", &data);
    set_up(&server);
    let target = Target::of(&server);
    let load = Load::start(&target);
    load.wait_for(0, ACKS_AROUND_A_FAULT, "before the fault");
    nats.kill();
    std::thread::sleep(Duration::from_millis(500));
    let before = load.acked();
    nats.restart();
    let reachable = Instant::now();
    load.wait_for(before, ACKS_AROUND_A_FAULT, "after nats-server restarted");
    let outage = load.longest_gap_since(reachable);
    let acked = load.finish();
    eprintln!(
        "nats-server SIGKILLed and restarted: no acknowledgement for {outage:.2?} after it was \
         reachable again; {} in all",
        acked.len()
    );
    nothing_acknowledged_lost_or_doubled(&target, &acked);
}

/// Reads the ledger page by page, as a downstream client follows it, until it has read up to
/// the sequence it is told to stop at; keeps every page that does not go on from the one before.
struct Pager {
    until: Arc<std::sync::atomic::AtomicU64>,
    reader: JoinHandle<(usize, Vec<String>)>,
}

impl Pager {
    fn start(target: &Target) -> Pager {
        let until = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
        let (stop_at, target) = (until.clone(), target.clone());
        let reader = std::thread::spawn(move || {
            let (mut after, mut pages, mut wrong) = (0u64, 0usize, Vec::new());
            let deadline = Instant::now() + 4 * BACK_WITHIN;
            while after < stop_at.load(Ordering::Relaxed) {
                assert!(
                    Instant::now() < deadline,
                    "the pager is stuck after {after}"
                );
                let answer = target.call(
                    "GET",
                    &format!("/v1/events?after={after}&limit=500"),
                    "",
                    "",
                );
                let Some((200, page)) = answer else {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                };
                pages += 1;
                for e in page["events"].as_array().unwrap() {
                    let seq = e["seq"].as_u64().unwrap();
                    if seq != after + 1 {
                        wrong.push(format!("after {after} came {seq}"));
                    }
                    after = after.max(seq);
                }
            }
            (pages, wrong)
        });
        Pager { until, reader }
    }

    /// Lets the reader go on to the ledger's last sequence now, then stop; answers the pages it
    /// read and those that did not go on from the last.
    fn finish(self, target: &Target) -> (usize, Vec<String>) {
        let (status, page) = target
            .call("GET", "/v1/events?limit=1", "", "")
            .expect("the service answers");
        assert_eq!(status, 200, "{page}");
        self.until
            .store(page["last_seq"].as_u64().unwrap(), Ordering::Relaxed);
        self.reader.join().expect("the pager panicked")
    }
}

/// The leader of the ledger's stream on a three-node cluster is SIGKILLed while clients submit
/// and a reader pages through the ledger: a new leader takes over, the service goes on by itself,
/// no acknowledged submission is lost or doubled, and no page skips or repeats a sequence.
#[test]
fn the_ledger_leader_killed_under_load_on_a_cluster_loses_nothing_and_pages_stay_contiguous() {
    let mut cluster = NatsCluster::start(3);
    let data = tempfile::tempdir().unwrap();
    let url = cluster.url();
    let args = [
        "--nats",
        &url,
        "--replicas",
        "3",
        "--data",
        data.path().to_str().unwrap(),
    ];
    let server = Server::start(&args);
    set_up(&server);
    let target = Target::of(&server);
    let pager = Pager::start(&target);
    let load = Load::start(&target);
    load.wait_for(0, ACKS_AROUND_A_FAULT, "before the fault");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let leader = runtime
        .block_on(cluster.stream_leader("LEDGER"))
        .expect("the ledger's stream has a leader");
    let before = load.acked();
    let killed = Instant::now();
    cluster.node(leader).kill();
    load.wait_for(
        before,
        ACKS_AROUND_A_FAULT,
        "after the ledger's leader was killed",
    );
    let outage = load.longest_gap_since(killed);
    let new_leader = runtime.block_on(cluster.stream_leader("LEDGER"));
    assert!(
        new_leader.is_some_and(|n| n != leader),
        "another node leads the ledger: {new_leader:?}"
    );
    cluster.node(leader).restart();
    let rejoined = load.acked();
    load.wait_for(
        rejoined,
        ACKS_AROUND_A_FAULT,
        "after the old leader rejoined",
    );
    let acked = load.finish();
    let (pages, wrong) = pager.finish(&target);
    eprintln!(
        "R3 cluster, leader n{} SIGKILLed: no acknowledgement for {outage:.2?}; {} acknowledged \
         in all; {pages} pages read",
        leader + 1,
        acked.len()
    );
    assert!(
        wrong.is_empty(),
        "pages that did not go on from the last: {wrong:?}"
    );
    nothing_acknowledged_lost_or_doubled(&target, &acked);
}

/// The scheduler holding the lease is SIGKILLed: the standby takes the lease when it ages out,
/// says so, and places the work submitted since.
#[test]
fn a_standby_scheduler_takes_over_from_a_killed_lease_holder() {
    let nats = NatsServer::start();
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let start = |role: &str, dir: &tempfile::TempDir| common::on_nats(&nats.url(), role, dir);
    let api = start("api", &dirs[0]);
    set_up(&api);
    let mut schedulers = vec![start("scheduler", &dirs[1]), start("scheduler", &dirs[2])];
    let submit = || {
        let (status, v) = api.call(
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"team","gpus_per_node":1}"#),
        );
        assert_eq!(status, 202, "{v}");
        v["id"].as_str().unwrap().to_owned()
    };
    let first = submit();
    common::wait_for(&api, &first, "running");
    let holds = |s: &Server| {
        s.stderr
            .lock()
            .unwrap()
            .contains("holding the scheduler lease: deciding")
    };
    let holder = schedulers
        .iter()
        .position(holds)
        .expect("one scheduler says it holds the lease");
    assert_eq!(
        schedulers.iter().filter(|s| holds(s)).count(),
        1,
        "one holder at a time"
    );
    let mut dead = schedulers.remove(holder);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    let second = submit();
    common::wait_for(&api, &second, "running");
    let placed = killed.elapsed();
    assert!(
        holds(&schedulers[0]),
        "the standby says it took over: {}",
        schedulers[0].stderr.lock().unwrap()
    );
    eprintln!("lease holder SIGKILLed: work placed by the standby {placed:.2?} later");
}
