//! What a node's agent may report: its own registration, and the ends of the runs placed on it.
//! An agent does not decide why work stops: it may say a run was lost (its process vanished) at
//! any time, and otherwise only that it stopped as the preemption under way asked. So an agent
//! cannot charge a contract violation, end another node's work, or end work as cancelled that
//! nobody cancelled. [`State::check_reports`] judges a batch of reports by these rules, the
//! sender and its clock, and the fold's own, however the batch reaches the ledger.

use crate::event::{Event, PreemptionReason, StopReason, WorkloadRequeued, WorkloadStopped};
use crate::state::{Phase, State};
use crate::{Envelope, Rejection};

/// Why a batch of an agent's reports is refused: what is wrong with one of them.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BatchRefusal {
    /// Stamped with another actor than its sender's.
    #[error(
        "a report is made by its sender: this one claims {claimed:?}, and its sender is {sender:?}"
    )]
    NotTheSender {
        /// The actor the report names.
        claimed: String,
        /// Its sender.
        sender: String,
    },
    /// Stamped further ahead of the ledger's clock than its skew tolerance.
    #[error("{:.1} s ahead of the server's clock: fix the node's clock (NTP)", *ahead_ms as f64 / 1000.0)]
    Ahead {
        /// How far ahead.
        ahead_ms: u64,
    },
    /// Not the agent's to report ([`State::node_may_report`]).
    #[error(transparent)]
    Report(#[from] ReportRefusal),
    /// What the fold would reject.
    #[error(transparent)]
    Rejected(Rejection),
    /// A second report about a run an earlier report of the batch already ends.
    #[error("events[{earlier}] already reports this run's end: a batch reports a run once (a stop may be followed by its requeue)")]
    AlreadyReported {
        /// The earlier report's index.
        earlier: usize,
    },
}

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

/// What an agent reports of a run it lost (its process vanished, or the agent stops with it):
/// stopped as lost and requeued, in one batch, so the work runs again elsewhere.
pub fn lost(workload: crate::WorkloadId) -> [Event; 2] {
    [
        Event::WorkloadStopped(WorkloadStopped {
            workload,
            reason: StopReason::Lost,
        }),
        Event::WorkloadRequeued(WorkloadRequeued {
            workload,
            work_lost_s: 0,
        }),
    ]
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

    /// Whether the agent of `node` is the one that reports how `workload` ended: a gang's first
    /// node (another rank that fails by itself reports the gang lost instead).
    pub fn reports_end(&self, node: &str, workload: crate::WorkloadId) -> bool {
        let here = self.cluster.get(node);
        here.is_some()
            && self
                .workloads
                .get(&workload)
                .and_then(|w| w.placement.first())
                .map(|p| p.node)
                == here
    }

    /// Judges a batch of reports sent by `sender`, the agent of `node`, received at `now_ms`:
    /// each is stamped with the sender's actor and no further ahead than the skew tolerance,
    /// is the node's to report, and is what the fold would take. The batch is not folded yet:
    /// a report is judged against the ledger as it stands, except a requeue following its run's
    /// stop (judged with the stop); anything else after a report about the same run would be
    /// judged against a run the batch has already ended. The first refusal, with its index.
    pub fn check_reports(
        &self,
        node: &str,
        sender: &str,
        reports: &[&Envelope],
        now_ms: u64,
    ) -> Result<(), (usize, BatchRefusal)> {
        for (i, env) in reports.iter().enumerate() {
            let refuse = |r: BatchRefusal| Err((i, r));
            if env.actor != sender {
                return refuse(BatchRefusal::NotTheSender {
                    claimed: env.actor.clone(),
                    sender: sender.to_owned(),
                });
            }
            let ahead_ms = env.occurred_at_ms.saturating_sub(now_ms);
            if ahead_ms > self.config().clock_skew_tolerance_ms {
                return refuse(BatchRefusal::Ahead { ahead_ms });
            }
            if let Err(r) = self.node_may_report(node, &env.event) {
                return refuse(r.into());
            }
            let run = env.event.workload();
            let earlier = reports[..i]
                .iter()
                .enumerate()
                .filter(|(_, r)| run.is_some() && r.event.workload() == run)
                .map(|(j, r)| (j, &r.event))
                .collect::<Vec<_>>();
            match (&env.event, earlier.as_slice()) {
                (_, []) => {
                    if let Err(r) = self.check(env) {
                        return refuse(BatchRefusal::Rejected(r));
                    }
                }
                (Event::WorkloadRequeued(_), [(_, Event::WorkloadStopped(stop))])
                    if stop.reason != StopReason::Cancelled => {}
                (_, [.., (j, _)]) => return refuse(BatchRefusal::AlreadyReported { earlier: *j }),
            }
        }
        Ok(())
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
