//! What a node's agent may report: its own registration, and the ends of the runs placed on it.
//! An agent does not decide why work stops: it may say a run was lost (its process vanished) at
//! any time, and otherwise only that it stopped as the preemption under way asked. So an agent
//! cannot charge a contract violation, end another node's work, or end work as cancelled that
//! nobody cancelled. The API applies this to every report before the fold's own rules.

use crate::event::{Event, PreemptionReason, StopReason, WorkloadStopped};
use crate::state::{Phase, State};

/// Why an agent may not report an event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReportRefusal {
    /// Not something an agent reports at all.
    #[error("an agent reports node_registered, workload_finished, workload_stopped and workload_requeued, not {kind}")]
    NotAReport {
        /// The event's kind.
        kind: &'static str,
    },
    /// Another node's registration, or a workload not running (nor stopped) on this node.
    #[error("this {kind} is not node {node:?}'s to report: it names another node, or a workload not running there")]
    NotYours {
        /// The event's kind.
        kind: &'static str,
        /// The reporting node.
        node: String,
    },
    /// A stop for a reason the run's state does not allow.
    #[error("a run stops {reason:?} only when asked to: workload {workload} is {asked}")]
    StopNotAsked {
        /// The reason reported.
        reason: StopReason,
        /// The workload.
        workload: uuid::Uuid,
        /// What is under way for it.
        asked: String,
    },
}

impl State {
    /// Whether the agent of `node` may report `event` now (see the module's rules). A stop and
    /// its requeue, reported together, are both judged against the run before either folds.
    pub fn node_may_report(&self, node: &str, event: &Event) -> Result<(), ReportRefusal> {
        let here = self.cluster.get(node);
        // A run of this node's: running here, or stopped here (for its requeue).
        let ours = |id| {
            self.workloads.get(&id).is_some_and(|w| match w.phase {
                Phase::Running => w.placement.iter().any(|p| Some(p.node) == here),
                Phase::Stopped => w.stopped_on.iter().any(|&n| Some(n) == here),
                _ => false,
            })
        };
        let ok = match event {
            Event::NodeRegistered(e) => e.node == node,
            Event::WorkloadFinished(e) => ours(e.workload),
            Event::WorkloadRequeued(e) => ours(e.workload),
            Event::WorkloadStopped(e) => {
                if ours(e.workload) {
                    return self.stop_reason_fits(e);
                }
                false
            }
            other => return Err(ReportRefusal::NotAReport { kind: other.kind() }),
        };
        if ok {
            Ok(())
        } else {
            Err(ReportRefusal::NotYours {
                kind: event.kind(),
                node: node.to_owned(),
            })
        }
    }

    /// A run stops lost any time; otherwise only as the preemption under way asked: a cancel
    /// ends as cancelled, any other preemption as preempted or, its GPUs failing, as a hardware
    /// failure.
    fn stop_reason_fits(&self, e: &WorkloadStopped) -> Result<(), ReportRefusal> {
        let asked = self
            .workloads
            .get(&e.workload)
            .and_then(|w| w.preempting)
            .map(|p| p.reason);
        let fits = match (e.reason, asked) {
            (StopReason::Lost, _) => true,
            (StopReason::Cancelled, Some(PreemptionReason::UserCancelled)) => true,
            (StopReason::Preempted | StopReason::HardwareFailure, Some(r)) => {
                r != PreemptionReason::UserCancelled
            }
            _ => false,
        };
        if fits {
            return Ok(());
        }
        Err(ReportRefusal::StopNotAsked {
            reason: e.reason,
            workload: e.workload,
            asked: match asked {
                None => "not being preempted".to_owned(),
                Some(r) => format!("being preempted for {r:?}"),
            },
        })
    }
}
