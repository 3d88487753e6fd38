//! Notifications: a workload's events posted to the URL it names, or its submitter's default,
//! signed with the submitter's secret, in order, again after a failure, with the delivery state
//! on the workload; a URL outside the prefixes the ledger allows is refused at submission.
//! Against the demo (`serve` on the embedded log, whose agents run the jobs, and which allows
//! this machine's URLs), with a webhook receiver in the test.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use common::{wait_for, wait_until, Server};
use serde_json::{json, Value};

/// One request the receiver took: its path, headers (lower-case names) and body.
#[derive(Clone, Debug)]
struct Received {
    path: String,
    headers: HashMap<String, String>,
    body: String,
}

/// A webhook receiver on a free port: answers 500 to its first `failures` requests, 200 after.
struct Receiver {
    port: u16,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start(failures: usize) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let got: Arc<Mutex<Vec<Received>>> = Arc::default();
        let kept = got.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                let mut headers = HashMap::new();
                loop {
                    let mut h = String::new();
                    reader.read_line(&mut h).unwrap();
                    let h = h.trim_end();
                    if h.is_empty() {
                        break;
                    }
                    if let Some((k, v)) = h.split_once(':') {
                        headers.insert(k.trim().to_lowercase(), v.trim().to_owned());
                    }
                }
                let len: usize = headers
                    .get("content-length")
                    .and_then(|l| l.parse().ok())
                    .unwrap_or(0);
                let mut body = vec![0; len];
                reader.read_exact(&mut body).unwrap();
                let n = {
                    let mut all = kept.lock().unwrap();
                    all.push(Received {
                        path,
                        headers,
                        body: String::from_utf8(body).unwrap(),
                    });
                    all.len()
                };
                let status = if n <= failures {
                    "500 Internal Server Error"
                } else {
                    "200 OK"
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        Receiver { port, got }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn received(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }
}

/// The signature of `body` under `secret`, as the receiver checks it: HMAC-SHA256, hex.
fn sign(secret: &str, body: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let tag = ring::hmac::sign(&key, body.as_bytes());
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

#[test]
fn a_workloads_events_reach_its_url_signed_in_order_and_again_after_a_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&["--data", tmp.path().join("data").to_str().unwrap()]);
    // The first two posts fail: the receiver is down, then back.
    let receiver = Receiver::start(2);

    // Alice's default URL for her workloads, and her secret, shown once.
    let body = json!({"name": "alice", "role": "submitter", "allocations": ["ai2"],
                      "notify": receiver.url("/alice")});
    let (status, alice) = server.call("POST", "/v1/tokens", Some(&body.to_string()));
    assert_eq!(status, 201, "{alice}");
    let (token, secret) = (
        alice["token"].as_str().unwrap().to_owned(),
        alice["notify_secret"].as_str().unwrap().to_owned(),
    );
    assert_eq!(secret.len(), 64);
    assert_eq!(
        alice["notify"],
        receiver.url(""),
        "only the URL's origin is shown"
    );
    // A URL outside what the ledger allows is refused, at submission and at a grant.
    let submit = |body: Value| {
        server.call_as(
            Some(&token),
            "POST",
            "/v1/workloads",
            Some(&body.to_string()),
        )
    };
    let (status, problem) = submit(json!({"allocation": "ai2/tulu", "gpus_per_node": 1,
        "command": ["true"], "notify": "http://example.org/hook"}));
    assert_eq!(
        (status, problem["field"].as_str()),
        (422, Some("notify")),
        "{problem}"
    );
    let (status, problem) = submit(json!({"allocation": "ai2/tulu", "gpus_per_node": 1,
        "command": ["true"], "notify": "http://127.0.0.1@example.org/"}));
    assert_eq!(
        (status, problem["field"].as_str()),
        (422, Some("notify")),
        "{problem}"
    );
    let body = json!({"name": "bob", "role": "submitter", "allocations": ["ai2"],
                      "notify": "https://example.org/"});
    let (status, problem) = server.call("POST", "/v1/tokens", Some(&body.to_string()));
    assert_eq!(
        (status, problem["field"].as_str()),
        (422, Some("notify")),
        "{problem}"
    );

    // Her workload names no URL: her default gets its start and its end, in that order.
    let (status, answer) = submit(json!({"allocation": "ai2/tulu", "gpus_per_node": 1,
        "command": ["sh", "-c", "sleep 1; exit 3"]}));
    assert_eq!(status, 202, "{answer}");
    let id = answer["id"].as_str().unwrap().to_owned();
    // Another names its own URL.
    let (status, answer) = submit(json!({"allocation": "ai2/tulu", "gpus_per_node": 1,
        "command": ["true"], "notify": receiver.url("/own?k=secret")}));
    assert_eq!(status, 202, "{answer}");
    let own = answer["id"].as_str().unwrap().to_owned();
    wait_for(&server, &id, "finished");
    wait_for(&server, &own, "finished");
    let delivered = |w: &str, path: &str| -> Vec<Received> {
        let got = receiver.received();
        let mut seen = Vec::new();
        for r in got.into_iter().filter(|r| r.path == path) {
            let b: Value = serde_json::from_str(&r.body).unwrap();
            if b["workload"] == w {
                seen.push(r);
            }
        }
        seen
    };
    // Retried after 1 and 2 seconds: at least once each, every repeat the same delivery.
    wait_until("both of its events", 30, || {
        let (_, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
        row["notifications"]["delivered"] == 2 && row["notifications"]["pending"] == 0
    });
    let got = delivered(&id, "/alice");
    let mut kinds: Vec<String> = Vec::new();
    let mut seqs = Vec::new();
    for r in &got {
        assert_eq!(
            r.headers["x-fairledger-signature-256"],
            sign(&secret, &r.body)
        );
        assert_eq!(r.headers["content-type"], "application/json");
        let b: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(r.headers["x-fairledger-event"], b["type"].as_str().unwrap());
        assert_eq!(
            r.headers["x-fairledger-delivery"],
            b["event"]["id"].as_str().unwrap()
        );
        assert_eq!(b["delivery"], b["event"]["id"]);
        let kind = b["type"].as_str().unwrap().to_owned();
        if kinds.last() != Some(&kind) {
            kinds.push(kind);
            seqs.push(b["seq"].as_u64().unwrap());
        }
    }
    assert_eq!(kinds, ["workload_started", "workload_finished"], "{got:?}");
    assert!(seqs[0] < seqs[1]);
    let last: Value = serde_json::from_str(&got.last().unwrap().body).unwrap();
    assert_eq!(last["event"]["payload"]["exit_code"], 3, "{last}");
    // The receiver failed twice: its state says so, and what it delivered.
    let (_, row) = server.call("GET", &format!("/v1/workloads/{id}"), None);
    let n = &row["notifications"];
    assert_eq!(n["to"], receiver.url(""), "{row}");
    let failed = n["failed_attempts"].as_u64().unwrap();
    assert!(failed >= 1, "{row}");
    assert_eq!(
        got.len() as u64,
        2 + failed,
        "each failure was tried again: {got:?}"
    );

    // The workload's own URL, with its query, wins over the default.
    wait_until("the other workload's events", 30, || {
        delivered(&own, "/own?k=secret").len() >= 2
    });
    assert!(delivered(&own, "/alice").is_empty());

    // A viewer's events do not show where a workload's notifications go.
    let viewer = server.grant("vera", "viewer", &[], None);
    let (_, events) = server.call_as(Some(&viewer), "GET", "/v1/events?limit=1000", None);
    let submitted = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"]["payload"]["workload"] == own.as_str())
        .unwrap();
    assert!(
        submitted["event"]["payload"].get("notify").is_none(),
        "{submitted}"
    );

    // An admin changes where notifications may go: this machine no longer, from then on.
    common::cli(
        &server,
        &[
            "settings",
            "set",
            "notify_urls=https://hooks.example.org/,https://ci.example.org/",
        ],
    )
    .unwrap();
    let (_, settings) = server.call("GET", "/v1/settings", None);
    assert_eq!(
        settings["settings"]["notify_urls"],
        json!(["https://hooks.example.org/", "https://ci.example.org/"]),
        "{settings}"
    );
    let (status, problem) = submit(json!({"allocation": "ai2/tulu", "gpus_per_node": 1,
        "command": ["true"], "notify": receiver.url("/late")}));
    assert_eq!(
        (status, problem["field"].as_str()),
        (422, Some("notify")),
        "{problem}"
    );
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("https://hooks.example.org/"),
        "{problem}"
    );
}
