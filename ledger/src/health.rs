//! GPU health from heartbeats: every node in the ledger is watched from when the scheduler first
//! sees it; a GPU whose node has not reported within the timeout, or that reports uncorrected ECC errors or a fault of
//! its own, becomes unhealthy, and healthy again when good reports resume. The changes are ledger
//! events (`GpuHealthChanged`), so availability is auditable without keeping every heartbeat.
//!
//! The monitor also samples utilization into the ledger (a node's heartbeat is recorded when a
//! GPU's utilization moved by [`UTILIZATION_STEP_PCT`] points, at most once per
//! [`SAMPLE_INTERVAL_MS`]), so the utilization metric is auditable too, and it ends the runs of a
//! silent node whose grace period is over: with no agent to report, the scheduler reports them
//! as the node's agent would have.

use std::collections::BTreeMap;

use crate::event::{Event, GpuHealthChanged, GpuHeartbeat};
use crate::{Rejection, State};

/// The silence after which a node's GPUs go unhealthy, unless set otherwise.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;

/// Utilization moves smaller than this are not sampled into the ledger.
pub const UTILIZATION_STEP_PCT: u8 = 10;
/// A node's utilization is sampled into the ledger at most this often.
pub const SAMPLE_INTERVAL_MS: u64 = 60_000;

/// What the monitor knows of one node.
#[derive(Clone, Debug, Default)]
struct Seen {
    at_ms: u64,
    /// GPUs reporting a reason to be unhealthy, with the reason.
    bad: BTreeMap<u32, String>,
    /// Utilization as last reported.
    utilization: BTreeMap<u32, u8>,
    /// When utilization was last sampled into the ledger.
    sampled_at_ms: Option<u64>,
    /// The last heartbeat's sending and reading times.
    last: Option<(u64, u64)>,
    /// Heartbeats in a row read as they were sent (not in a burst) that were behind.
    behind: u8,
}

/// Heartbeats in a row that must look behind, each read in step with its sending, before a
/// clock is said to be behind: a reader that was held up (a paused process, a full buffer)
/// reads old heartbeats late, which looks like a clock behind but is not.
pub const BEHIND_CONFIRMATIONS: u8 = 3;

/// Why a heartbeat was not taken whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeartbeatProblem {
    /// The node is not registered: the heartbeat was ignored.
    UnknownNode(String),
    /// Readings for GPUs the node does not have were ignored.
    UnknownGpus {
        /// The node.
        node: String,
        /// The GPUs it does not have.
        gpus: Vec<u32>,
    },
    /// The sender's clock is off from the receiver's by this much (positive: ahead).
    ClockSkew {
        /// The node.
        node: String,
        /// Sender's clock minus receiver's.
        skew_ms: i64,
    },
}

impl HeartbeatProblem {
    /// Whether `other` is the same problem measured again: a node's clock skew is measured
    /// anew with every heartbeat, so two skews of one node are one problem, told once.
    pub fn same_as(&self, other: &HeartbeatProblem) -> bool {
        match (self, other) {
            (
                HeartbeatProblem::ClockSkew { node: a, .. },
                HeartbeatProblem::ClockSkew { node: b, .. },
            ) => a == b,
            _ => self == other,
        }
    }
}

impl std::fmt::Display for HeartbeatProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeartbeatProblem::UnknownNode(node) => write!(
                f,
                "heartbeat from node {node:?}, which is not registered: ignored; start its agent, which registers it"
            ),
            HeartbeatProblem::UnknownGpus { node, gpus } => write!(
                f,
                "node {node:?} reported GPUs {gpus:?} it was not registered with: those readings were ignored; re-register the node under a new name if its GPUs changed"
            ),
            HeartbeatProblem::ClockSkew { node, skew_ms } => write!(
                f,
                "the clock of node {node:?} is off by {:.1} s from this server's; fix its time synchronisation (NTP)",
                *skew_ms as f64 / 1000.0
            ),
        }
    }
}

/// Heartbeats received, and the health they imply.
#[derive(Clone, Debug)]
pub struct HealthMonitor {
    timeout_ms: u64,
    nodes: BTreeMap<String, Seen>,
}

/// A heartbeat's clock may differ from the receiver's by this much before it is reported.
pub const CLOCK_SKEW_WARN_MS: u64 = 2_000;

impl HealthMonitor {
    /// A monitor that marks a node's GPUs unhealthy after `timeout_ms` without a heartbeat.
    pub fn new(timeout_ms: u64) -> Self {
        HealthMonitor {
            timeout_ms,
            nodes: BTreeMap::new(),
        }
    }

    /// Records a heartbeat received at `at_ms`, checked against the ledger's cluster, and says
    /// what was wrong with it. `sent_at_ms` is the sender's clock, for the skew check: a clock
    /// ahead is reported at once, one behind after [`BEHIND_CONFIRMATIONS`] heartbeats in a row
    /// read in step with their sending.
    pub fn heartbeat(
        &mut self,
        state: &State,
        hb: &GpuHeartbeat,
        sent_at_ms: u64,
        at_ms: u64,
    ) -> Vec<HeartbeatProblem> {
        let mut problems = Self::check(state, hb, sent_at_ms, at_ms);
        if state.cluster.get(&hb.node).is_none() {
            return problems;
        }
        let seen = self.nodes.entry(hb.node.clone()).or_default();
        // A clock ahead shows at once (lateness cannot make one look ahead); one behind only
        // after several heartbeats read in step with their sending.
        let in_step = seen.last.is_some_and(|(sent, read)| {
            let (sent_gap, read_gap) =
                (sent_at_ms.saturating_sub(sent), at_ms.saturating_sub(read));
            read_gap * 2 >= sent_gap && read_gap <= sent_gap * 2 + CLOCK_SKEW_WARN_MS
        });
        seen.last = Some((sent_at_ms, at_ms));
        let behind = problems
            .iter()
            .any(|p| matches!(p, HeartbeatProblem::ClockSkew { skew_ms, .. } if *skew_ms < 0));
        seen.behind = if behind && in_step {
            seen.behind.saturating_add(1)
        } else {
            0
        };
        if seen.behind < BEHIND_CONFIRMATIONS {
            problems.retain(
                |p| !matches!(p, HeartbeatProblem::ClockSkew { skew_ms, .. } if *skew_ms < 0),
            );
        }
        seen.at_ms = seen.at_ms.max(at_ms);
        seen.bad.clear();
        // Readings judged as the ledger judges them ([`State::check_heartbeat`]): none of a GPU
        // the node does not have, and no utilization that is not a percentage.
        for r in &hb.readings {
            match state.check_reading(&hb.node, r) {
                Ok(()) => {
                    seen.utilization.insert(r.gpu, r.utilization_pct);
                }
                Err(Rejection::UnknownGpu { .. } | Rejection::UnknownNode { .. }) => continue,
                Err(_) => {}
            }
            if let Some(fault) = &r.fault {
                seen.bad.insert(r.gpu, fault.clone());
            } else if r.ecc_errors_uncorrected > 0 {
                seen.bad.insert(r.gpu, "uncorrected ECC errors".to_owned());
            }
        }
        problems
    }

    /// What is wrong with a heartbeat sent at `sent_at_ms` and received at `at_ms`, against
    /// the ledger's cluster, without recording it.
    pub fn check(
        state: &State,
        hb: &GpuHeartbeat,
        sent_at_ms: u64,
        at_ms: u64,
    ) -> Vec<HeartbeatProblem> {
        let mut problems = Vec::new();
        if state.cluster.get(&hb.node).is_none() {
            problems.push(HeartbeatProblem::UnknownNode(hb.node.clone()));
            return problems;
        }
        let unknown: Vec<u32> = (hb.readings.iter())
            .filter(|r| {
                matches!(
                    state.check_reading(&hb.node, r),
                    Err(Rejection::UnknownGpu { .. })
                )
            })
            .map(|r| r.gpu)
            .collect();
        if !unknown.is_empty() {
            problems.push(HeartbeatProblem::UnknownGpus {
                node: hb.node.clone(),
                gpus: unknown,
            });
        }
        let skew_ms = sent_at_ms as i64 - at_ms as i64;
        if skew_ms.unsigned_abs() > CLOCK_SKEW_WARN_MS {
            problems.push(HeartbeatProblem::ClockSkew {
                node: hb.node.clone(),
                skew_ms,
            });
        }
        problems
    }

    /// Changes the silence allowed before a node's GPUs go unhealthy.
    pub fn set_timeout(&mut self, timeout_ms: u64) {
        self.timeout_ms = timeout_ms;
    }

    /// Starts watching, as of `now_ms`, every node the ledger holds that is not watched yet: a
    /// node must send its first heartbeat within the timeout of being seen, so a node whose
    /// agent died while no scheduler was watching still goes unhealthy.
    pub fn watch_registered(&mut self, state: &State, now_ms: u64) {
        if self.nodes.len() == state.cluster.nodes.len() {
            return;
        }
        for n in &state.cluster.nodes {
            self.nodes.entry(n.name.clone()).or_insert_with(|| Seen {
                at_ms: now_ms,
                ..Seen::default()
            });
        }
    }

    /// Whether `node` has been silent past the timeout at `now_ms`: since its last report, or,
    /// for a node watched since registration that never reported, since it was first watched.
    pub fn silent(&self, node: &str, now_ms: u64) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|s| now_ms.saturating_sub(s.at_ms) > self.timeout_ms)
    }

    /// The health changes due at `now_ms`, against what the ledger holds.
    pub fn changes(&self, state: &State, now_ms: u64) -> Vec<Event> {
        let mut out = Vec::new();
        for (name, seen) in &self.nodes {
            let Some(idx) = state.cluster.get(name) else {
                continue;
            };
            let node = state.cluster.node(idx);
            let silent = now_ms.saturating_sub(seen.at_ms) > self.timeout_ms;
            for gpu in 0..node.gpu_count {
                let healthy_now = node.healthy & (1u64 << gpu) != 0;
                let want = !silent && !seen.bad.contains_key(&gpu);
                if want != healthy_now {
                    let reason = if silent {
                        format!(
                            "no heartbeat for {} s",
                            now_ms.saturating_sub(seen.at_ms) / 1000
                        )
                    } else if let Some(reason) = seen.bad.get(&gpu) {
                        reason.clone()
                    } else {
                        "heartbeat healthy".to_owned()
                    };
                    out.push(Event::GpuHealthChanged(GpuHealthChanged {
                        node: name.clone(),
                        gpu,
                        healthy: want,
                        reason,
                    }));
                }
            }
        }
        out
    }

    /// Heartbeats worth recording in the ledger for the utilization metric at `now_ms`: a node's
    /// latest readings when a GPU moved by [`UTILIZATION_STEP_PCT`] points from what the ledger
    /// holds, at most once per [`SAMPLE_INTERVAL_MS`]. Marks them sampled.
    pub fn utilization_samples(&mut self, state: &State, now_ms: u64) -> Vec<Event> {
        let mut out = Vec::new();
        for (name, seen) in &mut self.nodes {
            let Some(idx) = state.cluster.get(name) else {
                continue;
            };
            if seen
                .sampled_at_ms
                .is_some_and(|t| now_ms.saturating_sub(t) < SAMPLE_INTERVAL_MS)
            {
                continue;
            }
            let node = state.cluster.node(idx);
            let moved = seen.utilization.iter().any(|(&gpu, &pct)| {
                node.utilization_pct
                    .get(gpu as usize)
                    .is_some_and(|&have| have.abs_diff(pct) >= UTILIZATION_STEP_PCT)
            });
            if moved {
                seen.sampled_at_ms = Some(now_ms);
                out.push(Event::GpuHeartbeat(GpuHeartbeat {
                    node: name.clone(),
                    readings: seen
                        .utilization
                        .iter()
                        .map(|(&gpu, &utilization_pct)| crate::event::GpuReading {
                            gpu,
                            utilization_pct,
                            ..Default::default()
                        })
                        .collect(),
                }));
            }
        }
        out
    }

    /// For runs asked to stop whose grace period ended at least a timeout ago on a node that has
    /// fallen silent, what its agent would have reported: nobody else will.
    pub fn lost_run_reports(&self, state: &State, now_ms: u64) -> Vec<Event> {
        // The preempting index holds running workloads only, in id order.
        let mut out = Vec::new();
        for w in state.preempting.iter().map(|id| &state.workloads[id]) {
            let Some(p) = w.preempting else { continue };
            if p.grace_until_ms + self.timeout_ms > now_ms {
                continue;
            }
            let first = w
                .placement
                .first()
                .map(|p| &state.cluster.node(p.node).name);
            if first.is_some_and(|n| self.silent(n, now_ms)) {
                out.extend(state.grace_end_reports(w.id, now_ms));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{GpuReading, NodeRegistered};
    use crate::{Envelope, StateConfig};

    #[test]
    fn a_skew_measured_again_is_the_same_problem_and_other_problems_are_not() {
        let skew = |node: &str, skew_ms| HeartbeatProblem::ClockSkew {
            node: node.into(),
            skew_ms,
        };
        assert!(skew("n1", 5_000).same_as(&skew("n1", -7_000)));
        assert!(!skew("n1", 5_000).same_as(&skew("n2", 5_000)));
        let gpus = |gpus: Vec<u32>| HeartbeatProblem::UnknownGpus {
            node: "n1".into(),
            gpus,
        };
        assert!(gpus(vec![9]).same_as(&gpus(vec![9])));
        assert!(!gpus(vec![9]).same_as(&gpus(vec![8, 9])));
        assert!(!HeartbeatProblem::UnknownNode("n1".into()).same_as(&skew("n1", 1)));
    }
    use uuid::Uuid;

    fn reading(gpu: u32, ecc: u64) -> GpuReading {
        GpuReading {
            gpu,
            uuid: None,
            utilization_pct: 50,
            memory_used_mib: 0,
            memory_total_mib: 0,
            temperature_c: 60,
            power_w: 300,
            ecc_errors_uncorrected: ecc,
            fault: None,
        }
    }

    /// A ledger holding node `n` of `gpus` GPUs.
    fn one_node(gpus: u32) -> State {
        let mut state = State::new(StateConfig::default());
        let node = NodeRegistered {
            node: "n".into(),
            gpus,
            model: "H100".into(),
            labels: Default::default(),
        };
        apply(&mut state, vec![Event::NodeRegistered(node)], 0);
        state
    }

    fn apply(state: &mut State, events: Vec<Event>, t: u64) {
        for e in events {
            let seq = state.last_seq + 1;
            state.apply(seq, &Envelope::new(Uuid::from_u64_pair(1, seq), t, "t", e));
        }
    }

    #[test]
    fn silence_and_ecc_errors_make_gpus_unhealthy_and_reports_heal_them() {
        let mut state = one_node(4);
        let mut m = HealthMonitor::new(30_000);
        // Never heard from, and not yet seen: not watched.
        assert!(m.changes(&state, 100_000).is_empty());
        // Seen in the ledger: it has the timeout to send its first heartbeat.
        let mut seen = m.clone();
        seen.watch_registered(&state, 100_000);
        assert!(seen.changes(&state, 100_000 + 30_000).is_empty());
        assert_eq!(seen.changes(&state, 100_000 + 30_001).len(), 4);
        let hb = |ecc_on: Option<u32>| GpuHeartbeat {
            node: "n".into(),
            readings: (0..4)
                .map(|g| reading(g, u64::from(Some(g) == ecc_on)))
                .collect(),
        };
        assert!(m.heartbeat(&state, &hb(Some(2)), 1_000, 1_000).is_empty());
        let changes = m.changes(&state, 2_000);
        assert_eq!(changes.len(), 1);
        let Event::GpuHealthChanged(c) = &changes[0] else {
            panic!()
        };
        assert_eq!(
            (c.gpu, c.healthy, c.reason.as_str()),
            (2, false, "uncorrected ECC errors")
        );
        apply(&mut state, changes, 2_000);
        // Silence past the timeout: the other three go too.
        let silent = m.changes(&state, 31_001 + 1_000);
        assert_eq!(silent.len(), 3);
        assert!(silent.iter().all(|e| matches!(e, Event::GpuHealthChanged(c) if !c.healthy && c.reason.starts_with("no heartbeat"))));
        apply(&mut state, silent, 32_001);
        assert_eq!(state.cluster.healthy_gpus, 0);
        // Good reports again: all four come back.
        m.heartbeat(&state, &hb(None), 40_000, 40_000);
        let healed = m.changes(&state, 40_000);
        assert_eq!(healed.len(), 4);
        apply(&mut state, healed, 40_000);
        assert_eq!(state.cluster.healthy_gpus, 4);
        assert!(
            m.changes(&state, 40_000).is_empty(),
            "nothing more to change"
        );
    }

    #[test]
    fn a_clock_behind_is_told_but_a_reader_that_was_held_up_is_not() {
        let state = one_node(1);
        let hb = GpuHeartbeat {
            node: "n".into(),
            readings: vec![reading(0, 0)],
        };
        let behind = |p: &Vec<HeartbeatProblem>| {
            p.iter()
                .any(|p| matches!(p, HeartbeatProblem::ClockSkew { skew_ms, .. } if *skew_ms < 0))
        };
        // A node 10 s behind, read as it sends: told once three heartbeats in a row, each read
        // in step with its sending, were behind.
        let mut m = HealthMonitor::new(30_000);
        let told: Vec<bool> = (0..5u64)
            .map(|i| behind(&m.heartbeat(&state, &hb, i * 5_000, i * 5_000 + 10_000)))
            .collect();
        assert_eq!(told, [false, false, false, true, true]);
        // A node in time, whose heartbeats of 30 s were read at once after the reader was
        // held up: never told.
        let mut m = HealthMonitor::new(30_000);
        assert!(!behind(&m.heartbeat(&state, &hb, 0, 0)));
        for i in 1..=6u64 {
            let p = m.heartbeat(&state, &hb, i * 5_000, 31_000 + i);
            assert!(!behind(&p), "buffered heartbeat {i}: {p:?}");
        }
        for i in 7..=10u64 {
            let p = m.heartbeat(&state, &hb, i * 5_000, i * 5_000 + 100);
            assert!(!behind(&p), "fresh heartbeat {i}: {p:?}");
        }
    }

    #[test]
    fn faults_unknown_gpus_unknown_nodes_and_skew_are_told_apart() {
        let state = one_node(2);
        let mut m = HealthMonitor::new(30_000);
        let stranger = GpuHeartbeat {
            node: "elsewhere".into(),
            readings: vec![reading(0, 0)],
        };
        assert_eq!(
            m.heartbeat(&state, &stranger, 1_000, 1_000),
            vec![HeartbeatProblem::UnknownNode("elsewhere".into())]
        );
        assert!(
            m.changes(&state, 1_000).is_empty(),
            "an unknown node is not watched"
        );
        let mut faulty = reading(1, 0);
        faulty.fault = Some("pending page retirement".into());
        let hb = GpuHeartbeat {
            node: "n".into(),
            readings: vec![reading(0, 0), faulty, reading(7, 0)],
        };
        let problems = m.heartbeat(&state, &hb, 9_000, 1_000);
        assert_eq!(
            problems,
            vec![
                HeartbeatProblem::UnknownGpus {
                    node: "n".into(),
                    gpus: vec![7]
                },
                HeartbeatProblem::ClockSkew {
                    node: "n".into(),
                    skew_ms: 8_000
                }
            ]
        );
        assert!(problems[1].to_string().contains("off by 8.0 s"));
        let changes = m.changes(&state, 1_000);
        assert_eq!(changes.len(), 1, "{changes:?}");
        let Event::GpuHealthChanged(c) = &changes[0] else {
            panic!()
        };
        assert_eq!(
            (c.gpu, c.healthy, c.reason.as_str()),
            (1, false, "pending page retirement")
        );
    }

    #[test]
    fn utilization_is_sampled_when_it_moves_and_not_more_often_than_the_interval() {
        let mut state = one_node(1);
        let mut m = HealthMonitor::new(30_000);
        let hb = |pct| GpuHeartbeat {
            node: "n".into(),
            readings: vec![GpuReading {
                gpu: 0,
                utilization_pct: pct,
                ..Default::default()
            }],
        };
        m.heartbeat(&state, &hb(5), 1_000, 1_000);
        assert!(
            m.utilization_samples(&state, 1_000).is_empty(),
            "5 points is noise"
        );
        m.heartbeat(&state, &hb(80), 2_000, 2_000);
        let samples = m.utilization_samples(&state, 2_000);
        assert_eq!(samples.len(), 1);
        apply(&mut state, samples, 2_000);
        assert_eq!(state.cluster.node(0).utilization_pct[0], 80);
        m.heartbeat(&state, &hb(10), 3_000, 3_000);
        assert!(
            m.utilization_samples(&state, 3_000).is_empty(),
            "not twice within the interval"
        );
        assert_eq!(
            m.utilization_samples(&state, 2_000 + SAMPLE_INTERVAL_MS)
                .len(),
            1
        );
    }
}
