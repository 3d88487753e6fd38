//! GPU health from heartbeats: a node that has reported at least once is watched; a GPU whose
//! node has not reported within the timeout, or that reports uncorrected ECC errors, becomes
//! unhealthy, and healthy again when good reports resume. The changes are ledger events
//! (`GpuHealthChanged`), so availability is auditable without keeping every heartbeat.

use std::collections::{BTreeMap, BTreeSet};

use ledger::event::{Event, GpuHealthChanged, GpuHeartbeat};
use ledger::State;

/// What the monitor knows of one node.
#[derive(Clone, Debug, Default)]
struct Seen {
    at_ms: u64,
    ecc: BTreeSet<u32>,
}

/// Heartbeats received, and the health they imply.
#[derive(Clone, Debug)]
pub struct HealthMonitor {
    timeout_ms: u64,
    nodes: BTreeMap<String, Seen>,
}

impl HealthMonitor {
    /// A monitor that marks a node's GPUs unhealthy after `timeout_ms` without a heartbeat.
    pub fn new(timeout_ms: u64) -> Self {
        HealthMonitor {
            timeout_ms,
            nodes: BTreeMap::new(),
        }
    }

    /// Records a heartbeat received at `at_ms`.
    pub fn heartbeat(&mut self, hb: &GpuHeartbeat, at_ms: u64) {
        let seen = self.nodes.entry(hb.node.clone()).or_default();
        seen.at_ms = seen.at_ms.max(at_ms);
        seen.ecc = hb
            .readings
            .iter()
            .filter(|r| r.ecc_errors_uncorrected > 0)
            .map(|r| r.gpu)
            .collect();
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
                let (want, reason) = if silent {
                    (
                        false,
                        format!(
                            "no heartbeat for {} s",
                            now_ms.saturating_sub(seen.at_ms) / 1000
                        ),
                    )
                } else if seen.ecc.contains(&gpu) {
                    (false, "uncorrected ECC errors".to_owned())
                } else {
                    (true, "heartbeat healthy".to_owned())
                };
                if want != healthy_now {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use ledger::event::{GpuReading, NodeRegistered};
    use ledger::{Envelope, StateConfig};
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
        }
    }

    fn apply(state: &mut State, events: Vec<Event>, t: u64) {
        for e in events {
            let seq = state.last_seq + 1;
            state.apply(seq, &Envelope::new(Uuid::from_u64_pair(1, seq), t, "t", e));
        }
    }

    #[test]
    fn silence_and_ecc_errors_make_gpus_unhealthy_and_reports_heal_them() {
        let mut state = State::new(StateConfig::default());
        let node = NodeRegistered {
            node: "n".into(),
            gpus: 4,
            model: "H100".into(),
            labels: Default::default(),
        };
        apply(&mut state, vec![Event::NodeRegistered(node)], 0);
        let mut m = HealthMonitor::new(30_000);
        // Never heard from: not watched.
        assert!(m.changes(&state, 100_000).is_empty());
        let hb = |ecc_on: Option<u32>| GpuHeartbeat {
            node: "n".into(),
            readings: (0..4)
                .map(|g| reading(g, u64::from(Some(g) == ecc_on)))
                .collect(),
        };
        m.heartbeat(&hb(Some(2)), 1_000);
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
        m.heartbeat(&hb(None), 40_000);
        let healed = m.changes(&state, 40_000);
        assert_eq!(healed.len(), 4);
        apply(&mut state, healed, 40_000);
        assert_eq!(state.cluster.healthy_gpus, 4);
        assert!(
            m.changes(&state, 40_000).is_empty(),
            "nothing more to change"
        );
    }
}
