//! The fold keeps indexes beside the facts (queues by leaf and by shape, running work by
//! contract end, each node's tenants, counts of work with estimates) so that a scheduling pass
//! reads what it needs without sweeping every workload. [`State::check_indexes`] recomputes each
//! from the facts and says which drifted: the simulation calls it after every event.

use std::collections::{BTreeMap, BTreeSet};

use crate::cluster::{Hold, Tenant};
use crate::state::{Contracts, Phase, QueueKey, State};

impl State {
    /// Recomputes every index the fold keeps from the live workloads and compares: `Err` names
    /// the first that differs. Costs a sweep of the live work; for tests and checks, not for
    /// the hot path.
    pub fn check_indexes(&self) -> Result<(), String> {
        let nodes = self.cluster.nodes.len();
        // Running placements are disjoint and match the nodes' books and tenants.
        let mut used: Vec<u64> = vec![0; nodes];
        let mut tenants: Vec<Vec<Tenant>> = vec![Vec::new(); nodes];
        for id in &self.running {
            let w = self
                .workloads
                .get(id)
                .ok_or_else(|| format!("running {id} is not a live workload"))?;
            if w.phase != Phase::Running || w.placement.len() != w.nodes as usize {
                return Err(format!(
                    "running {id} is {:?} on {:?}",
                    w.phase, w.placement
                ));
            }
            for p in &w.placement {
                if used[p.node as usize] & p.gpus != 0 {
                    return Err(format!("a GPU of node {} is double-booked", p.node));
                }
                if p.gpus.count_ones() != w.gpus_per_node {
                    return Err(format!("{id} holds the wrong number of GPUs"));
                }
                used[p.node as usize] |= p.gpus;
                let node = self.cluster.node(p.node);
                if let Some(g) = (0..node.gpu_count)
                    .find(|&g| p.gpus & (1 << g) != 0 && node.holder(g) != Some(*id))
                {
                    return Err(format!("GPU {g} of {} is not booked to {id}", node.name));
                }
                tenants[p.node as usize].push(Tenant {
                    workload: *id,
                    gpus: p.gpus,
                    hold: Hold {
                        allocation: w.allocation,
                        protected_until_ms: w.protected_until_ms,
                        ends_ms: w
                            .duration_estimate_ms
                            .map(|d| (w.started_at_ms + d).saturating_sub(w.work_done_ms)),
                        grace_until_ms: w.preempting.map(|p| p.grace_until_ms),
                        borrowed: w.borrowed,
                        preemptions: w.preemptions,
                    },
                    started_at_ms: w.started_at_ms,
                    checkpoint_ms: w.checkpoint_ms,
                    total_gpus: w.gpus(),
                });
            }
        }
        for (i, n) in self.cluster.nodes.iter().enumerate() {
            let mut kept = n.tenants.clone();
            kept.sort_unstable_by_key(|t| t.workload);
            tenants[i].sort_unstable_by_key(|t| t.workload);
            if kept != tenants[i] {
                return Err(format!("node {}: tenants drifted", n.name));
            }
            if n.used != used[i] {
                return Err(format!("node {}: books disagree with placements", n.name));
            }
        }
        if self.cluster != self.cluster.recount() {
            return Err("the cluster's totals drifted".into());
        }
        let with_estimate = self
            .running
            .iter()
            .filter(|id| self.workloads[*id].duration_estimate_ms.is_some())
            .count() as u64;
        if self.running_with_estimate != with_estimate {
            return Err(format!(
                "running work with estimates: kept {}, counted {with_estimate}",
                self.running_with_estimate
            ));
        }
        // Running work by contract end, and what is being preempted.
        let mut contracts = Contracts::default();
        let mut preempting = BTreeSet::new();
        for id in &self.running {
            let w = &self.workloads[id];
            match (w.preempting, w.allocation) {
                (Some(_), _) => {
                    preempting.insert(*id);
                }
                (None, Some(a)) => {
                    contracts
                        .allocated
                        .entry(a)
                        .or_default()
                        .insert((w.protected_until_ms, *id));
                }
                (None, None) => {
                    contracts.unallocated.insert(*id);
                }
            }
        }
        if self.contracts != contracts {
            return Err("the index of contracts drifted".into());
        }
        if self.preempting != preempting {
            return Err("the index of preempting work drifted".into());
        }
        let mut lent = BTreeSet::new();
        let mut leaving_nodes: BTreeMap<u32, u32> = BTreeMap::new();
        for id in &self.running {
            let w = &self.workloads[id];
            for p in &w.placement {
                if let Some(b) = w.borrowed {
                    if w.preempting.is_none() {
                        lent.insert((b.reserved_for, b.until_ms, p.node, *id));
                    }
                }
                let holds = u32::from(w.borrowed.is_some()) + u32::from(w.preempting.is_some());
                if holds > 0 {
                    *leaving_nodes.entry(p.node).or_default() += holds;
                }
            }
        }
        if self.lent != lent {
            return Err("the index of borrowed placements by lender and term drifted".into());
        }
        if self.leaving_nodes != leaving_nodes {
            return Err("the index of nodes with work leaving or borrowed drifted".into());
        }
        // Queues: pending work only, counted by shape overall and split by shape per leaf.
        type ByShape = BTreeMap<(u32, u32), BTreeSet<QueueKey>>;
        let mut shapes: BTreeMap<(u32, u32), u32> = BTreeMap::new();
        let mut per_leaf: BTreeMap<u32, ByShape> = BTreeMap::new();
        let mut pending_with_estimate = 0u64;
        let queued = self
            .queues
            .iter()
            .flat_map(|(&leaf, q)| q.iter().map(move |k| (Some(leaf), *k)))
            .chain(self.unallocated_queue.iter().map(|k| (None, *k)));
        for (leaf, key) in queued {
            let w = self
                .workloads
                .get(&key.2)
                .filter(|w| w.phase == Phase::Pending)
                .ok_or_else(|| format!("queued {} is not pending", key.2))?;
            let shape = (w.gpus_per_node, w.nodes);
            *shapes.entry(shape).or_insert(0) += 1;
            pending_with_estimate += u64::from(w.duration_estimate_ms.is_some());
            if let Some(leaf) = leaf {
                per_leaf
                    .entry(leaf)
                    .or_default()
                    .entry(shape)
                    .or_default()
                    .insert(key);
            }
        }
        if self.pending_shapes != shapes {
            return Err("pending shapes drifted".into());
        }
        let kept: BTreeMap<u32, ByShape> = self
            .queue_shapes
            .iter()
            .map(|(&leaf, s)| (leaf, s.clone()))
            .collect();
        if kept != per_leaf {
            return Err("the leaves' queues by shape drifted".into());
        }
        if self.pending_with_estimate != pending_with_estimate {
            return Err(format!(
                "pending work with estimates: kept {}, counted {pending_with_estimate}",
                self.pending_with_estimate
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::event::*;
    use crate::{Envelope, State, StateConfig};
    use uuid::Uuid;

    #[test]
    fn a_drifted_index_is_named() {
        let mut state = State::new(StateConfig::default());
        let events = [
            Event::NodeRegistered(NodeRegistered {
                node: "n".into(),
                gpus: 8,
                model: "H100".into(),
                labels: Default::default(),
            }),
            Event::WorkloadSubmitted(WorkloadSubmitted::new(Uuid::from_u128(1), None, 4, 1)),
        ];
        for (seq, event) in (1..).zip(events) {
            state.apply(
                seq,
                &Envelope::new(Uuid::from_u128(seq.into()), 0, "t", event),
            );
        }
        assert_eq!(state.check_indexes(), Ok(()));
        let mut drifted = state.clone();
        drifted.pending_with_estimate += 1;
        assert!(drifted
            .check_indexes()
            .unwrap_err()
            .contains("pending work with estimates"));
        let mut drifted = state.clone();
        drifted.pending_shapes.clear();
        assert!(drifted
            .check_indexes()
            .unwrap_err()
            .contains("pending shapes"));
    }
}
