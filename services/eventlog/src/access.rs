//! Who may do what on NATS: a user per fairledger role, and the subjects each may publish and
//! subscribe to, rendered as a nats-server `authorization` block.
//!
//! | role | may |
//! | --- | --- |
//! | service (`serve`, `project`, `log`) | everything: it alone writes the ledger's subjects and creates the streams and buckets |
//! | agent of node N | publish N's heartbeats and clock probes and its runs' output (`fairledger.output.N.>`, and read where its own stands), send N's reports to the service (`fairledger.report.N`), hold N's key in the agents' lease bucket, read `LEDGER` by direct gets and follow its feed (`fairledger.feed.>`) |
//! | reader (a downstream consumer) | read `LEDGER` by direct gets and follow its feed; publish nothing else |
//!
//! Only the service touches consumers: a user who could create them could use up the server's
//! (its `max_consumers`), and one who could delete them could take the service's away. The
//! ledger stream publishes every event again on its feed as it stores it, with its sequence,
//! so a follower needs no consumer: it reads what it missed by direct gets.
//!
//! Users are identified by nkey: the server holds only public keys, each process its own seed.
//! Every user but the service receives replies and deliveries only under an inbox prefix of its
//! own (`_INBOX_<name>`), so no user can read another's answers.

use crate::jetstream::{LEDGER_STREAM, TELEMETRY_STREAM};
use crate::lease::AGENTS_BUCKET;
use crate::output::{OUTPUT_PREFIX, OUTPUT_STREAM};
use crate::subject::{self, REPORTS_PREFIX, TELEMETRY_PREFIX};

/// What a NATS user is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NatsRole {
    /// fairledger's own processes.
    Service,
    /// The agent of one node.
    Agent {
        /// The node.
        node: String,
    },
    /// A downstream consumer of the ledger.
    Reader,
}

/// One user of the generated configuration.
#[derive(Clone, Debug)]
pub struct NatsUser {
    /// A name for people (a comment in the configuration, and the inbox prefix).
    pub name: String,
    /// What it is for.
    pub role: NatsRole,
    /// Its nkey's public key (`U…`).
    pub nkey: String,
}

/// Subjects a user may publish to and subscribe to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permissions {
    /// Publish allow-list.
    pub publish: Vec<String>,
    /// Subscribe allow-list.
    pub subscribe: Vec<String>,
}

/// The inbox prefix of a user other than the service: replies and deliveries to it arrive under
/// `<prefix>.>` only.
pub fn inbox_prefix(name: &str) -> String {
    format!("_INBOX_{}", subject::token(name))
}

/// What reading `LEDGER` takes without a consumer: stream info and direct gets (a page, one
/// event). Following it is subscribing to its feed ([`crate::subject::FEED_PREFIX`]). No user
/// but the service may create, read, list or delete a consumer of any stream: none can use up
/// the server's consumers or take the service's away.
fn ledger_reads() -> Vec<String> {
    let s = LEDGER_STREAM;
    vec![
        "$JS.API.INFO".into(),
        format!("$JS.API.STREAM.INFO.{s}"),
        format!("$JS.API.DIRECT.GET.{s}"),
        format!("$JS.API.DIRECT.GET.{s}.>"),
        format!("$JS.API.STREAM.MSG.GET.{s}"),
    ]
}

/// What following `LEDGER` takes: its feed.
fn ledger_follows() -> String {
    format!("{}.>", crate::subject::FEED_PREFIX)
}

/// The permissions of `role` for a user named `name`.
pub fn permissions(role: &NatsRole, name: &str) -> Permissions {
    let inbox = format!("{}.>", inbox_prefix(name));
    match role {
        NatsRole::Service => Permissions {
            publish: vec![">".into()],
            subscribe: vec![">".into()],
        },
        NatsRole::Reader => Permissions {
            publish: ledger_reads(),
            subscribe: vec![inbox, ledger_follows()],
        },
        NatsRole::Agent { node } => {
            let n = subject::token(node);
            let kv = format!("KV_{AGENTS_BUCKET}");
            let mut publish = vec![
                format!("{TELEMETRY_PREFIX}.gpu.heartbeat.{n}"),
                format!("{TELEMETRY_PREFIX}.agent.clock.{n}"),
                format!("{REPORTS_PREFIX}.{n}"),
                format!("{OUTPUT_PREFIX}.{n}.>"),
                format!("$JS.API.DIRECT.GET.{OUTPUT_STREAM}.{OUTPUT_PREFIX}.{n}.>"),
                format!("$JS.API.DIRECT.GET.{TELEMETRY_STREAM}"),
                format!("$JS.API.DIRECT.GET.{TELEMETRY_STREAM}.>"),
                format!("$KV.{AGENTS_BUCKET}.{n}"),
                format!("$JS.API.STREAM.INFO.{kv}"),
                format!("$JS.API.DIRECT.GET.{kv}.$KV.{AGENTS_BUCKET}.{n}"),
                format!("$JS.API.STREAM.MSG.GET.{kv}"),
            ];
            publish.extend(ledger_reads());
            Permissions {
                publish,
                subscribe: vec![inbox, ledger_follows()],
            }
        }
    }
}

/// A nats-server `authorization` block listing `users` with their permissions.
pub fn users_conf(users: &[NatsUser]) -> String {
    let list = |subjects: &[String]| {
        let quoted: Vec<String> = subjects.iter().map(|s| format!("{s:?}")).collect();
        format!("[{}]", quoted.join(", "))
    };
    let mut out = String::from(
        "# The NATS users of fairledger, one per role, written by `fairledger nats-auth`: the\n\
         # server keeps only their public nkeys; each process holds its own seed file.\n\
         authorization {\n  users = [\n",
    );
    for u in users {
        let what = match &u.role {
            NatsRole::Service => "the fairledger service".to_owned(),
            NatsRole::Agent { node } => format!("the agent of node {node}"),
            NatsRole::Reader => "a reader of the ledger".to_owned(),
        };
        let p = permissions(&u.role, &u.name);
        out += &format!(
            "    # {}: {what}\n    {{\n      nkey: {:?}\n      permissions: {{\n        publish: {{ allow: {} }}\n        subscribe: {{ allow: {} }}\n      }}\n    }}\n",
            u.name,
            u.nkey,
            list(&p.publish),
            list(&p.subscribe),
        );
    }
    out += "  ]\n}\n";
    out
}

/// A new user nkey: its seed (`SU…`, the secret) and its public key (`U…`).
pub fn new_user_nkey() -> Result<(String, String), String> {
    let pair = nkeys::KeyPair::new_user();
    let seed = pair
        .seed()
        .map_err(|e| format!("cannot make an nkey: {e}"))?;
    Ok((seed, pair.public_key()))
}

/// The public key of the user nkey `seed`.
pub fn public_key(seed: &str) -> Result<String, String> {
    nkeys::KeyPair::from_seed(seed.trim())
        .map(|pair| pair.public_key())
        .map_err(|e| format!("not an nkey seed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_may_publish_only_its_own_nodes_subjects() {
        let p = permissions(
            &NatsRole::Agent {
                node: "gpu-1".into(),
            },
            "gpu-1",
        );
        assert!(p
            .publish
            .contains(&"fairledger.telemetry.gpu.heartbeat.gpu-1".to_owned()));
        assert!(p.publish.contains(&"fairledger.report.gpu-1".to_owned()));
        assert!(
            !p.publish.iter().any(|s| s.starts_with("fairledger.ledger")),
            "{p:?}"
        );
        assert!(!p.publish.iter().any(|s| s.contains("gpu-2") || s == ">"));
        assert_eq!(p.subscribe, ["_INBOX_gpu-1.>", "fairledger.feed.>"]);
        assert!(
            !p.publish
                .iter()
                .any(|s| s.contains("CONSUMER") || s.starts_with("$JS.ACK")),
            "no consumers: {p:?}"
        );
    }

    #[test]
    fn keys_round_trip_and_the_conf_lists_public_keys_only() {
        let (seed, public) = new_user_nkey().unwrap();
        assert!(seed.starts_with("SU") && public.starts_with('U'));
        assert_eq!(public_key(&seed).unwrap(), public);
        let conf = users_conf(&[NatsUser {
            name: "r".into(),
            role: NatsRole::Reader,
            nkey: public.clone(),
        }]);
        assert!(conf.contains(&public) && !conf.contains(&seed), "{conf}");
    }
}
