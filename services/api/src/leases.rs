//! One agent per node: the API holds, for each node, which agent drives it (its holder: host,
//! process and a random id, as the agent names itself) and when it was last heard from. A
//! second agent is refused while the first is alive, with the holder named; a holder that falls
//! silent for [`NODE_LEASE_TTL`] loses the node. The agents inside `serve` hold theirs for as
//! long as the process runs. (Over NATS the same rule is the agents' lease bucket.)

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use crate::Problem;

/// How long a node's agent may stay silent before another may take the node.
pub const NODE_LEASE_TTL: Duration = Duration::from_secs(30);

/// The header in which an HTTP agent names itself on every report.
pub const HOLDER_HEADER: &str = "fairledger-agent";

/// An agent's name for itself (`field` of a request), checked: 1 to 200 printable ASCII
/// characters.
pub(crate) fn holder_name<'a>(field: &str, name: &'a str) -> Result<&'a str, Problem> {
    if name.is_empty() || name.len() > 200 || !name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(Problem::invalid(
            field,
            "1 to 200 printable ASCII characters naming the agent (host:pid:id)",
        ));
    }
    Ok(name)
}

struct Held {
    holder: String,
    since: Instant,
    seen: Instant,
    /// Held for as long as this process runs (an agent inside it).
    for_good: bool,
}

/// Which agent drives each node.
#[derive(Default)]
pub(crate) struct NodeLeases {
    held: Mutex<HashMap<String, Held>>,
}

impl NodeLeases {
    /// Gives `node` to `holder`, or renews it: refused (409, naming the holder and what to do)
    /// while another holder is alive.
    pub(crate) fn claim(&self, node: &str, holder: &str, for_good: bool) -> Result<(), Problem> {
        let now = Instant::now();
        let mut held = self.held.lock().expect("never poisoned");
        if let Some(h) = held.get_mut(node) {
            if h.holder == holder {
                h.seen = now;
                return Ok(());
            }
            if h.for_good || now.duration_since(h.seen) < NODE_LEASE_TTL {
                return Err(Problem::new(
                    StatusCode::CONFLICT,
                    "node_driven",
                    format!(
                        "node {node:?} is driven by another agent, {} (for {} s{}); stop it first{}",
                        h.holder,
                        now.duration_since(h.since).as_secs(),
                        if h.for_good {
                            ", inside the server".to_owned()
                        } else {
                            format!(", last heard {} s ago", now.duration_since(h.seen).as_secs())
                        },
                        if h.for_good {
                            " (start `fairledger serve` with --no-agents to drive its nodes from outside)"
                                .to_owned()
                        } else {
                            format!(", or wait {} s after it stops", NODE_LEASE_TTL.as_secs())
                        }
                    ),
                ));
            }
        }
        held.insert(
            node.to_owned(),
            Held {
                holder: holder.to_owned(),
                since: now,
                seen: now,
                for_good,
            },
        );
        Ok(())
    }

    /// Whether a report for `node` from `holder` (`None`: one that does not name itself) may be
    /// taken: refused while another holder drives the node; taken from a named holder, it
    /// renews (or claims) the node.
    pub(crate) fn check(&self, node: &str, holder: Option<&str>) -> Result<(), Problem> {
        match holder {
            Some(h) => self.claim(node, h, false),
            None => {
                let held = self.held.lock().expect("never poisoned");
                match held.get(node) {
                    Some(h) if h.for_good || h.seen.elapsed() < NODE_LEASE_TTL => {
                        Err(Problem::new(
                            StatusCode::CONFLICT,
                            "node_driven",
                            format!(
                                "node {node:?} is driven by agent {}; a report that does not name its agent ({HOLDER_HEADER} header) is not taken",
                                h.holder
                            ),
                        ))
                    }
                    _ => Ok(()),
                }
            }
        }
    }
}
