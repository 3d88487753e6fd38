//! Authority in the fold: whether an event's actor may write it, by the grants folded before it.
//!
//! Who may do what is one table, [`crate::identity::Role::may`] and [`Principal::allows`], and
//! the API asks it of a request as the fold asks it of the event the request writes: an event
//! is mapped to the [`Action`] it takes, and its actor — the live principal that acts as the
//! envelope's `actor` — must be allowed that action with the allocation tree as it stands. An
//! agent is held to what a node may report ([`State::node_may_report`]) and to its own node's
//! heartbeats. So a revocation takes effect at its position in the log, in every fold alike, and
//! an event written by hand into the log under a name nobody granted changes nothing.
//!
//! Authority starts at the log's *root*: the first grant of the role `service`
//! ([`crate::identity::Principals::root`]), which its holder writes for itself (`serve` does
//! when it first opens a log). Events before it — logs written before schema 5, simulations —
//! are folded as their writers' claims, as they always were; from it on:
//!
//! - an actor that no live principal acts as (never granted, or revoked) writes nothing;
//! - nor one whose token had expired when the event occurred;
//! - the role `service` (the scheduler's placements and preemptions included) is granted and
//!   revoked only by the service;
//! - everyone else is held to their role and scope.

use crate::event::{Envelope, Event, PreemptionReason};
use crate::identity::{Action, ActionKind, Principal, Role};
use crate::rejection::Rejection;
use crate::state::State;

impl State {
    /// Whether `env`'s actor may write it, by the grants folded so far (see the module). `Ok`
    /// before the log's root; the fold and [`State::check`] both ask it before anything else
    /// about the event.
    pub fn authorize(&self, env: &Envelope) -> Result<(), Rejection> {
        if self.principals.root().is_none() {
            return Ok(());
        }
        let refuse = |reason: String| Rejection::Unauthorized {
            actor: env.actor.clone(),
            kind: env.event.kind(),
            reason,
        };
        let Some(p) = self.principals.by_actor(&env.actor) else {
            return Err(refuse(if self.was_revoked_actor(&env.actor) {
                "its grant was revoked before this event".to_owned()
            } else {
                "no principal of that name is granted in this log; an admin grants one (`fairledger token create`)".to_owned()
            }));
        };
        if p.expired_at(env.occurred_at_ms) {
            return Err(refuse(format!(
                "its token expired at {} ms since the epoch, before this event",
                p.expires_at_ms.unwrap_or_default()
            )));
        }
        if p.role == Role::Service {
            return Ok(());
        }
        self.allowed(p, &env.event).map_err(refuse)
    }

    /// Whether `actor` (no live principal acts as it) names a principal that was revoked.
    fn was_revoked_actor(&self, actor: &str) -> bool {
        let name = actor.split_once(':').map_or(actor, |(_, n)| n);
        self.principals.was_revoked(name)
    }

    /// Whether `p`, not the service, may write `event`: `Err` says what it would need.
    fn allowed(&self, p: &Principal, event: &Event) -> Result<(), String> {
        let service_only = || {
            Err(format!(
                "the role service is granted and revoked by the service alone; {:?} is {}",
                p.name, p.role
            ))
        };
        match event {
            Event::PrincipalGranted(g) if g.role == Role::Service => return service_only(),
            Event::PrincipalRevoked(r)
                if self
                    .principals
                    .get(&r.name)
                    .is_some_and(|t| t.role == Role::Service) =>
            {
                return service_only()
            }
            _ => {}
        }
        if p.role == Role::Agent {
            return self.agent_may(p, event);
        }
        // The allocation a workload is charged to, when the workload is known: a scope to check.
        let charged = |id| self.workloads.get(&id).map(|w| self.allocation_path(w));
        let action = match event {
            Event::AllocationSet(_) | Event::AllocationRemoved(_) => Action::SetAllocations,
            Event::NodeRegistered(e) => Action::RegisterNode { node: &e.node },
            Event::GpuHeartbeat(e) => Action::ReportForNode { node: &e.node },
            Event::GpuHealthChanged(e) => Action::ReportForNode { node: &e.node },
            Event::NodeDrained(_) | Event::NodeResumed(_) => Action::DrainNode,
            Event::WorkloadSubmitted(e) => Action::Submit {
                allocation: e.allocation.as_deref(),
            },
            Event::WorkloadCancelled(e) => match charged(e.workload) {
                Some(allocation) => Action::Cancel { allocation },
                None => return p.may(ActionKind::Cancel).map_err(|d| d.0),
            },
            Event::PreemptionRequested(e) if e.reason == PreemptionReason::UserCancelled => {
                match charged(e.workload) {
                    Some(allocation) => Action::Cancel { allocation },
                    None => return p.may(ActionKind::Cancel).map_err(|d| d.0),
                }
            }
            Event::WorkloadStarted(_) | Event::PreemptionRequested(_) => Action::Schedule,
            // The ends of runs are their nodes' to report.
            Event::WorkloadStopped(_) | Event::WorkloadFinished(_) | Event::WorkloadRequeued(_) => {
                return p.may(ActionKind::ReportForNode).map_err(|d| d.0)
            }
            Event::PrincipalGranted(_) | Event::PrincipalRevoked(_) => Action::ManageTokens,
            Event::SettingsSet(_) => Action::SetSettings,
        };
        p.allows(&action, &self.allocations).map_err(|d| d.0)
    }

    /// What an agent may write: its node's registration, heartbeats and health, and the ends of
    /// the runs placed on it.
    fn agent_may(&self, p: &Principal, event: &Event) -> Result<(), String> {
        let node = p.node.as_deref().unwrap_or_default();
        let own = |named: &str| {
            if named == node {
                Ok(())
            } else {
                Err(format!(
                    "this needs the agent of node {named:?}; {:?} is the agent of node {node:?}",
                    p.name
                ))
            }
        };
        match event {
            Event::GpuHeartbeat(e) => own(&e.node),
            Event::GpuHealthChanged(e) => own(&e.node),
            Event::NodeRegistered(_)
            | Event::WorkloadStopped(_)
            | Event::WorkloadFinished(_)
            | Event::WorkloadRequeued(_) => {
                self.node_may_report(node, event).map_err(|r| r.to_string())
            }
            other => p.may(kind_of(other)).map_err(|d| d.0),
        }
    }
}

/// The kind of action an event takes, for events an agent may never write (so the message names
/// the roles that may).
fn kind_of(event: &Event) -> ActionKind {
    match event {
        Event::AllocationSet(_) | Event::AllocationRemoved(_) => ActionKind::SetAllocations,
        Event::NodeDrained(_) | Event::NodeResumed(_) => ActionKind::DrainNode,
        Event::WorkloadSubmitted(_) => ActionKind::Submit,
        Event::WorkloadCancelled(_) => ActionKind::Cancel,
        Event::PreemptionRequested(e) if e.reason == PreemptionReason::UserCancelled => {
            ActionKind::Cancel
        }
        Event::WorkloadStarted(_) | Event::PreemptionRequested(_) => ActionKind::Schedule,
        Event::PrincipalGranted(_) | Event::PrincipalRevoked(_) => ActionKind::ManageTokens,
        Event::SettingsSet(_) => ActionKind::SetSettings,
        Event::NodeRegistered(_) => ActionKind::RegisterNode,
        Event::GpuHeartbeat(_)
        | Event::GpuHealthChanged(_)
        | Event::WorkloadStopped(_)
        | Event::WorkloadFinished(_)
        | Event::WorkloadRequeued(_) => ActionKind::ReportForNode,
    }
}
