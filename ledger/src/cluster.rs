//! Nodes and GPUs: health, who holds what, and the fragmentation figures.
//!
//! A *node* is a machine with 1 to 64 GPUs of one model. Each GPU is healthy or not and is held by
//! at most one workload. GPU sets are bit masks, so placing and freeing is a few instructions.
//! *Stranded* GPUs are free healthy GPUs on nodes that also run something: a whole-node gang
//! cannot use them. The *largest startable gang* is the most GPUs one workload could get right now
//! without preemption: whole free nodes of one model, or the free GPUs of one node.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::event::WorkloadId;

/// Index of a node in the cluster; stable for the life of a [`crate::State`].
pub type NodeIdx = u32;

/// The most GPUs a node may have: GPU sets are `u64` masks.
pub const GPUS_PER_NODE_MAX: u32 = 64;

/// One node.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Node {
    /// Unique name.
    pub name: String,
    /// GPU model.
    pub model: String,
    /// Index of the model in [`Cluster::models`].
    pub model_idx: u32,
    /// Topology labels (`rack`, `zone`).
    pub labels: BTreeMap<String, String>,
    /// Number of GPUs.
    pub gpu_count: u32,
    /// Bit i set: GPU i is healthy.
    pub healthy: u64,
    /// Bit i set: GPU i is held by a workload.
    pub used: u64,
    /// The workloads running here, each once, with what a scheduling pass needs to know of them.
    pub tenants: Vec<Tenant>,
    /// Last reported utilization of each GPU, 0 to 100.
    pub utilization_pct: Vec<u8>,
    /// Drained: no new work is placed here (what runs, runs on).
    pub draining: bool,
}

impl Node {
    /// Healthy GPUs not held by anyone.
    pub fn free_mask(&self) -> u64 {
        self.healthy & !self.used
    }

    /// The workload holding GPU `gpu`, if any.
    pub fn holder(&self, gpu: u32) -> Option<WorkloadId> {
        self.tenants
            .iter()
            .find(|t| t.gpus & (1 << gpu) != 0)
            .map(|t| t.workload)
    }

    /// Number of healthy free GPUs.
    pub fn free_count(&self) -> u32 {
        self.free_mask().count_ones()
    }

    /// The GPUs a scheduling pass may give out here: the free ones, none on a drained node.
    pub fn placeable_mask(&self) -> u64 {
        if self.draining {
            0
        } else {
            self.free_mask()
        }
    }

    /// The healthy GPUs a scheduling pass may plan with here (after a preemption, a reservation):
    /// none on a drained node.
    pub fn plannable_mask(&self) -> u64 {
        if self.draining {
            0
        } else {
            self.healthy
        }
    }

    /// The mask with the node's GPUs all set.
    pub fn all_mask(&self) -> u64 {
        mask_of(self.gpu_count)
    }
}

/// When a holder gives its GPUs back, as far as the ledger knows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hold {
    /// The holder's allocation (`None`: unallocated work).
    pub allocation: Option<u32>,
    /// End of the holder's contract.
    pub protected_until_ms: u64,
    /// When the holder ends if its estimate is right: the start of this run plus the estimate,
    /// less the work done in earlier runs.
    pub ends_ms: Option<u64>,
    /// End of the grace period of a preemption under way.
    pub grace_until_ms: Option<u64>,
    /// A borrowed placement ([`crate::event::WorkloadStarted::borrowed`]): the reservation that
    /// lent the GPUs, which alone may take them back, from the end of the term.
    pub borrowed: Option<crate::event::Borrowed>,
    /// Times the holder was preempted (see [`crate::Workload::preemptions`]).
    pub preemptions: u32,
}

/// A workload's part of one node, kept beside the node so that a scheduling pass times and prices
/// the node's GPUs (reservations, victim searches) from the nodes alone, looking no workload up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tenant {
    /// The workload.
    pub workload: WorkloadId,
    /// Its GPUs on this node.
    pub gpus: u64,
    /// When it gives them back.
    pub hold: Hold,
    /// Start of its current run.
    pub started_at_ms: u64,
    /// Its checkpoint interval, if it gave one.
    pub checkpoint_ms: Option<u64>,
    /// GPUs it holds in all, over every node.
    pub total_gpus: u64,
}

/// A mask with the low `n` bits set.
pub fn mask_of(n: u32) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// Per-model bookkeeping kept up to date on every change.
#[derive(Clone, Debug, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct ModelGroup {
    /// Model name.
    pub model: String,
    /// Nodes by GPU count: how many nodes have exactly that many GPUs.
    pub nodes_by_size: BTreeMap<u32, u32>,
    /// `free_hist[k]`: nodes of this model with exactly `k` healthy free GPUs.
    pub free_hist: Vec<u32>,
    /// Healthy free GPUs on nodes of this model that hold no workload.
    pub whole_free_gpus: u64,
}

/// All nodes.
#[derive(Clone, Debug, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Cluster {
    /// Nodes in registration order.
    pub nodes: Vec<Node>,
    /// One group per model, in first-seen order.
    pub models: Vec<ModelGroup>,
    by_name: FxHashMap<String, NodeIdx>,
    /// Each node's GPUs a pass may give out ([`Node::placeable_mask`]) and plan with
    /// ([`Node::plannable_mask`]), and its model, by node index: what a scheduling pass copies to
    /// start from, without visiting every node. A drained node has none.
    pub free_masks: Vec<u64>,
    /// See [`Cluster::free_masks`].
    pub healthy_masks: Vec<u64>,
    /// See [`Cluster::free_masks`].
    pub model_of: Vec<u32>,
    /// GPUs registered.
    pub total_gpus: u64,
    /// Healthy GPUs.
    pub healthy_gpus: u64,
    /// Healthy GPUs held by workloads.
    pub allocated_gpus: u64,
    /// Healthy free GPUs on nodes that hold no workload and are not drained.
    pub whole_free_gpus: u64,
    /// Healthy free GPUs on drained nodes: idle by decision, not by fragmentation.
    pub drained_free_gpus: u64,
    /// Sum of the utilization of healthy held GPUs (percent).
    pub utilization_sum_pct: u64,
}

impl Cluster {
    /// The node named `name`.
    pub fn get(&self, name: &str) -> Option<NodeIdx> {
        self.by_name.get(name).copied()
    }

    /// The node with index `idx`.
    pub fn node(&self, idx: NodeIdx) -> &Node {
        &self.nodes[idx as usize]
    }

    /// The group of `model`.
    pub fn model_idx(&self, model: &str) -> Option<u32> {
        self.models
            .iter()
            .position(|g| g.model == model)
            .map(|i| i as u32)
    }

    /// Free healthy GPUs on nodes that also hold work (and are not drained).
    pub fn stranded_gpus(&self) -> u64 {
        self.healthy_gpus - self.allocated_gpus - self.whole_free_gpus - self.drained_free_gpus
    }

    /// The most GPUs one workload could get now without preemption.
    pub fn largest_startable_gang(&self) -> u64 {
        self.models
            .iter()
            .map(|g| {
                let single = g.free_hist.iter().rposition(|&n| n > 0).unwrap_or(0) as u64;
                single.max(g.whole_free_gpus)
            })
            .max()
            .unwrap_or(0)
    }

    /// The most nodes a gang could span: nodes of `model` (or of the one model that has the most)
    /// with at least `gpus` GPUs installed. A gang runs on nodes of one model.
    pub fn gang_capacity(&self, model: Option<u32>, gpus: u32) -> u32 {
        self.models
            .iter()
            .enumerate()
            .filter(|(i, _)| model.is_none_or(|m| m as usize == *i))
            .map(|(_, g)| g.nodes_by_size.range(gpus..).map(|(_, n)| n).sum::<u32>())
            .max()
            .unwrap_or(0)
    }

    /// The largest node (of `model`, or any).
    pub fn largest_node(&self, model: Option<u32>) -> u32 {
        self.models
            .iter()
            .enumerate()
            .filter(|(i, _)| model.is_none_or(|m| m as usize == *i))
            .filter_map(|(_, g)| g.nodes_by_size.keys().next_back().copied())
            .max()
            .unwrap_or(0)
    }

    /// Adds a node; the name must be new.
    pub(crate) fn register(
        &mut self,
        name: &str,
        gpus: u32,
        model: &str,
        labels: BTreeMap<String, String>,
    ) {
        let model_idx = match self.model_idx(model) {
            Some(i) => i,
            None => {
                self.models.push(ModelGroup {
                    model: model.to_string(),
                    ..ModelGroup::default()
                });
                (self.models.len() - 1) as u32
            }
        };
        let node = Node {
            name: name.to_string(),
            model: model.to_string(),
            model_idx,
            labels,
            gpu_count: gpus,
            healthy: mask_of(gpus),
            used: 0,
            tenants: Vec::new(),
            utilization_pct: vec![0; gpus as usize],
            draining: false,
        };
        let idx = self.nodes.len() as NodeIdx;
        self.free_masks.push(node.placeable_mask());
        self.healthy_masks.push(node.plannable_mask());
        self.model_of.push(model_idx);
        *self.models[model_idx as usize]
            .nodes_by_size
            .entry(gpus)
            .or_insert(0) += 1;
        self.total_gpus += u64::from(gpus);
        self.nodes.push(node);
        self.by_name.insert(name.to_string(), idx);
        self.count(idx, 1);
    }

    /// Adds (`sign` = 1) or removes (`sign` = -1) a node's contribution to the running totals.
    /// Every change to a node is bracketed by a removal and a re-addition.
    fn count(&mut self, idx: NodeIdx, sign: i64) {
        let n = &self.nodes[idx as usize];
        let healthy = i64::from(n.healthy.count_ones());
        let held_healthy_mask = n.used & n.healthy;
        let allocated = i64::from(held_healthy_mask.count_ones());
        // A drained node's free GPUs start nothing: they count apart.
        let free = n.placeable_mask().count_ones();
        let drained = i64::from(n.free_count() - free);
        let whole = if n.used == 0 { i64::from(free) } else { 0 };
        let util: i64 = (0..n.gpu_count)
            .filter(|&g| held_healthy_mask & (1 << g) != 0)
            .map(|g| i64::from(n.utilization_pct[g as usize]))
            .sum();
        let group = &mut self.models[n.model_idx as usize];
        if group.free_hist.len() <= free as usize {
            group.free_hist.resize(free as usize + 1, 0);
        }
        let slot = &mut group.free_hist[free as usize];
        *slot = (i64::from(*slot) + sign) as u32;
        group.whole_free_gpus = (group.whole_free_gpus as i64 + sign * whole) as u64;
        self.healthy_gpus = (self.healthy_gpus as i64 + sign * healthy) as u64;
        self.allocated_gpus = (self.allocated_gpus as i64 + sign * allocated) as u64;
        self.whole_free_gpus = (self.whole_free_gpus as i64 + sign * whole) as u64;
        self.drained_free_gpus = (self.drained_free_gpus as i64 + sign * drained) as u64;
        self.utilization_sum_pct = (self.utilization_sum_pct as i64 + sign * util) as u64;
    }

    /// Applies `change` to node `idx`, keeping the totals right.
    pub(crate) fn update<R>(&mut self, idx: NodeIdx, change: impl FnOnce(&mut Node) -> R) -> R {
        self.count(idx, -1);
        let n = &mut self.nodes[idx as usize];
        let r = change(n);
        self.free_masks[idx as usize] = n.placeable_mask();
        self.healthy_masks[idx as usize] = n.plannable_mask();
        self.count(idx, 1);
        r
    }

    /// Recounts every total from scratch; for invariant checks.
    pub fn recount(&self) -> Cluster {
        let mut fresh = self.clone();
        fresh.healthy_gpus = 0;
        fresh.allocated_gpus = 0;
        fresh.whole_free_gpus = 0;
        fresh.drained_free_gpus = 0;
        fresh.utilization_sum_pct = 0;
        for g in &mut fresh.models {
            g.whole_free_gpus = 0;
            g.free_hist.iter_mut().for_each(|n| *n = 0);
        }
        for idx in 0..fresh.nodes.len() {
            fresh.count(idx as NodeIdx, 1);
        }
        fresh.free_masks = fresh.nodes.iter().map(Node::placeable_mask).collect();
        fresh.healthy_masks = fresh.nodes.iter().map(Node::plannable_mask).collect();
        fresh.model_of = fresh.nodes.iter().map(|n| n.model_idx).collect();
        fresh
    }
}
