//! The subject scheme: which NATS subject each event is published on.
//!
//! ```text
//! fairledger.ledger.allocation.set.<path>            allocation_set
//! fairledger.ledger.allocation.removed.<path>        allocation_removed
//! fairledger.ledger.node.registered.<node>           node_registered
//! fairledger.ledger.node.drained.<node>              node_drained
//! fairledger.ledger.node.resumed.<node>              node_resumed
//! fairledger.ledger.gpu.health_changed.<node>        gpu_health_changed
//! fairledger.ledger.gpu.utilization.<node>           gpu_heartbeat sampled into the ledger for
//!                                                    the utilization metric
//! fairledger.ledger.principal.granted.<name>         principal_granted
//! fairledger.ledger.principal.revoked.<name>         principal_revoked
//! fairledger.ledger.workload.<verb>.<path>           workload_submitted, _cancelled, _started,
//!                                                    _stopped, _finished, _requeued and
//!                                                    preemption_requested (verb
//!                                                    "preemption_requested")
//! fairledger.telemetry.gpu.heartbeat.<node>          gpu_heartbeat, every one (the TELEMETRY
//!                                                    stream; see [`for_telemetry`])
//! fairledger.report.<node>                           a node agent's reports to the service (core
//!                                                    NATS requests, not stored; see
//!                                                    [`for_reports`])
//! ```
//!
//! `<path>` is the allocation path with `/` turned into `.` (`ai2/olmo/pretrain` becomes
//! `ai2.olmo.pretrain`), or `_unallocated` for opportunistic work, so one team's workload
//! events are `fairledger.ledger.workload.*.ai2.olmo.>` (plus `...ai2.olmo` for a leaf named
//! exactly that). Characters a subject token may not hold become `_`; the payload, not the
//! subject, is the record.

use std::collections::HashMap;

use ledger::{Envelope, Event, WorkloadId};

/// Prefix of every ledger subject (the `LEDGER` stream).
pub const LEDGER_PREFIX: &str = "fairledger.ledger";
/// Where the `LEDGER` stream publishes every event again as it stores it
/// (`fairledger.feed.<the rest of its subject>`), with its sequence in the `Nats-Sequence`
/// header: what processes that may not make consumers (agents, readers) follow.
pub const FEED_PREFIX: &str = "fairledger.feed";
/// Prefix of every telemetry subject (the `TELEMETRY` stream).
pub const TELEMETRY_PREFIX: &str = "fairledger.telemetry";
/// Prefix of the subjects on which node agents send their reports to the service, one per
/// node (`fairledger.report.<node>`): core NATS requests, never stored; the service checks them
/// and appends them to the ledger.
pub const REPORTS_PREFIX: &str = "fairledger.report";

/// The subject on which the agent of `node` sends its reports.
pub fn for_reports(node: &str) -> String {
    format!("{REPORTS_PREFIX}.{}", token(node))
}

/// The token standing for "no allocation".
pub const UNALLOCATED: &str = "_unallocated";

/// The telemetry subject of a heartbeat: every heartbeat goes there (the `TELEMETRY` stream);
/// the few sampled into the ledger go to [`for_event`]'s subject.
pub fn for_telemetry(heartbeat: &ledger::event::GpuHeartbeat) -> String {
    format!(
        "{TELEMETRY_PREFIX}.gpu.heartbeat.{}",
        token(&heartbeat.node)
    )
}

/// The ledger subject of `event`; `allocation` is the path of the workload's allocation, which only a
/// submission carries itself, so writers of later workload events pass it in.
pub fn for_event(event: &Event, allocation: Option<&str>) -> String {
    let (category, verb, scope): (&str, &str, String) = match event {
        Event::AllocationSet(e) => ("allocation", "set", path_tokens(Some(&e.path))),
        Event::AllocationRemoved(e) => ("allocation", "removed", path_tokens(Some(&e.path))),
        Event::NodeRegistered(e) => ("node", "registered", token(&e.node)),
        Event::GpuHeartbeat(e) => ("gpu", "utilization", token(&e.node)),
        Event::GpuHealthChanged(e) => ("gpu", "health_changed", token(&e.node)),
        Event::NodeDrained(e) => ("node", "drained", token(&e.node)),
        Event::NodeResumed(e) => ("node", "resumed", token(&e.node)),
        Event::WorkloadSubmitted(e) => (
            "workload",
            "submitted",
            path_tokens(e.allocation.as_deref().or(allocation)),
        ),
        Event::WorkloadCancelled(_) => ("workload", "cancelled", path_tokens(allocation)),
        Event::WorkloadStarted(_) => ("workload", "started", path_tokens(allocation)),
        Event::PreemptionRequested(_) => {
            ("workload", "preemption_requested", path_tokens(allocation))
        }
        Event::WorkloadStopped(_) => ("workload", "stopped", path_tokens(allocation)),
        Event::WorkloadFinished(_) => ("workload", "finished", path_tokens(allocation)),
        Event::WorkloadRequeued(_) => ("workload", "requeued", path_tokens(allocation)),
        Event::PrincipalGranted(e) => ("principal", "granted", token(&e.name)),
        Event::PrincipalRevoked(e) => ("principal", "revoked", token(&e.name)),
        Event::SettingsSet(_) => ("settings", "set", "ledger".to_owned()),
    };
    format!("{LEDGER_PREFIX}.{category}.{verb}.{scope}")
}

/// Remembers each live workload's allocation from its submission, so the later events of a
/// ledger written without it (a simulator's, an import) get their subjects.
#[derive(Debug, Default)]
pub struct Router {
    allocations: HashMap<WorkloadId, Option<String>>,
}

impl Router {
    /// The subject of `event`.
    pub fn subject(&mut self, event: &Event) -> String {
        let workload = match event {
            Event::WorkloadSubmitted(e) => {
                self.allocations.insert(e.workload, e.allocation.clone());
                None
            }
            Event::WorkloadCancelled(e) => Some((e.workload, true)),
            Event::WorkloadFinished(e) => Some((e.workload, true)),
            Event::WorkloadStarted(e) => Some((e.workload, false)),
            Event::PreemptionRequested(e) => Some((e.workload, false)),
            Event::WorkloadStopped(e) => Some((e.workload, false)),
            Event::WorkloadRequeued(e) => Some((e.workload, false)),
            _ => None,
        };
        let allocation = workload.and_then(|(id, _)| self.allocations.get(&id).cloned().flatten());
        let subject = for_event(event, allocation.as_deref());
        if let Some((id, true)) = workload {
            self.allocations.remove(&id);
        }
        subject
    }

    /// An append of `envelope` on its subject, keyed by `idempotency_key` or its id.
    pub fn append(&mut self, envelope: &Envelope, idempotency_key: Option<&str>) -> crate::Append {
        let subject = self.subject(&envelope.event);
        let mut append = crate::Append::event(envelope, None, idempotency_key);
        append.subject = subject;
        append
    }
}

/// The subject filter of every placement (`workload_started`), whoever wrote it: the fence of a
/// scheduler's decisions (see `ledger::State::last_start_seq`).
pub const STARTS: &str = "fairledger.ledger.workload.started.>";

/// The subject filter of every change of the ledger's settings (`settings_set`): the fence of
/// a change made from the settings read (see `ledger::State::last_settings_event_seq`).
pub const SETTINGS: &str = "fairledger.ledger.settings.>";

/// The subject filter of every workload event of the allocation at `path` and below.
pub fn workloads_of(path: &str) -> String {
    format!("{LEDGER_PREFIX}.workload.*.{}.>", path_tokens(Some(path)))
}

fn path_tokens(path: Option<&str>) -> String {
    match path {
        None | Some("") => UNALLOCATED.to_owned(),
        Some(p) => p.split('/').map(token).collect::<Vec<_>>().join("."),
    }
}

/// `s` as one subject token: characters other than letters, digits, `_` and `-` become `_`.
pub fn token(s: &str) -> String {
    if s.is_empty() {
        return "_".to_owned();
    }
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::event::*;
    use uuid::Uuid;

    #[test]
    fn workload_events_carry_the_allocation_path() {
        let id = Uuid::from_u128(7);
        let submitted = Event::WorkloadSubmitted(WorkloadSubmitted::new(
            id,
            Some("ai2/olmo/pretrain".into()),
            8,
            1,
        ));
        assert_eq!(
            for_event(&submitted, None),
            "fairledger.ledger.workload.submitted.ai2.olmo.pretrain"
        );
        let cancelled = Event::WorkloadCancelled(WorkloadCancelled {
            workload: id,
            reason: None,
        });
        assert_eq!(
            for_event(&cancelled, Some("ai2/olmo")),
            "fairledger.ledger.workload.cancelled.ai2.olmo"
        );
        assert_eq!(
            for_event(&cancelled, None),
            "fairledger.ledger.workload.cancelled._unallocated"
        );
        let filter = workloads_of("ai2/olmo");
        assert!(crate::subject_matches(
            &filter,
            "fairledger.ledger.workload.submitted.ai2.olmo.pretrain"
        ));
        assert!(!crate::subject_matches(
            &filter,
            "fairledger.ledger.workload.submitted.ai2.tulu.pretrain"
        ));
    }

    #[test]
    fn every_start_and_nothing_else_is_on_the_starts_filter() {
        let id = Uuid::from_u128(7);
        let started = Event::WorkloadStarted(WorkloadStarted {
            workload: id,
            placement: vec![],
            protected_until_ms: 0,
            borrowed: None,
        });
        for path in [None, Some("ai2"), Some("ai2/olmo/pretrain")] {
            assert!(crate::subject_matches(STARTS, &for_event(&started, path)));
        }
        let submitted =
            Event::WorkloadSubmitted(WorkloadSubmitted::new(id, Some("ai2".into()), 8, 1));
        assert!(!crate::subject_matches(
            STARTS,
            &for_event(&submitted, None)
        ));
    }

    #[test]
    fn unsafe_characters_never_reach_a_subject() {
        let e = Event::NodeRegistered(NodeRegistered {
            node: "gpu node.1>*".into(),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        });
        assert_eq!(
            for_event(&e, None),
            "fairledger.ledger.node.registered.gpu_node_1__"
        );
    }
}
