//! The allocation tree and the hierarchical max-min fair split.
//!
//! An *allocation* is a share of the cluster: a node of a tree addressed by a slash-separated
//! path (`ai2/olmo/pretrain`) with a weight. Its share is its weight over its siblings', and
//! shares multiply down the tree. Workloads are charged to leaves.
//!
//! The *owed* split divides the healthy GPUs, at each level of the tree, by weighted max-min
//! fairness among the children that have demand, never giving a child more than its demand (or
//! its cap); what a capped child leaves is shared among the others. This is the instantaneous
//! entitlement that owed GPU-hours integrate.

use rustc_hash::FxHashMap;

use crate::rejection::Rejection;
use crate::window::{Window, WindowShape};

/// Index of an allocation in the arena; stable for the life of a [`crate::State`].
pub type AllocId = u32;

/// One allocation.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Allocation {
    /// Full path.
    pub path: String,
    /// Parent, `None` at the top level.
    pub parent: Option<AllocId>,
    /// Live children, in creation order.
    pub children: Vec<AllocId>,
    /// Weight among siblings.
    pub weight: u32,
    /// Optional cap on GPUs held by the subtree.
    pub max_gpus: Option<u32>,
    /// Most workloads the subtree may have waiting at once.
    #[serde(default)]
    pub max_pending_workloads: Option<u32>,
    /// Most GPUs the subtree's waiting workloads may ask for at once.
    #[serde(default)]
    pub max_pending_gpus: Option<u64>,
    /// Removed allocations stay in the arena (their history is audited) but take no share.
    pub removed: bool,
    /// GPUs of pending, running and preempting workloads charged here (leaves only).
    pub demand_gpus: u64,
    /// Demand of the subtree before this allocation's cap: `demand_gpus` for a leaf, the sum of
    /// the children's `subtree_demand_gpus` otherwise. Kept up to date on every change.
    pub raw_demand_gpus: u64,
    /// Demand of the subtree as the split sees it: `raw_demand_gpus` capped by `max_gpus`.
    pub subtree_demand_gpus: u64,
    /// GPUs held by its running workloads (leaves only), healthy or not.
    pub held_gpus: u64,
    /// Healthy GPUs held: what is being delivered now (leaves only).
    pub delivering_gpus: u64,
    /// Instantaneous owed GPUs from the last split (every node of the tree).
    pub owed_gpus: f64,
    /// Delivered GPU-milliseconds since the beginning (leaves only).
    pub delivered_gpu_ms: u64,
    /// Owed GPU-milliseconds since the beginning (leaves only).
    pub owed_gpu_ms: f64,
    /// GPU-milliseconds delivered within the owed share: the integral of min(delivering, owed).
    pub within_share_gpu_ms: f64,
    /// Pending, running and stopped workloads charged here.
    pub live_workloads: u32,
    /// Sequence of the `allocation_set` that created this incarnation: a path removed and set
    /// again is a new allocation with a new incarnation.
    pub created_seq: u64,
    /// Preemptions requested of its workloads (for fair share, opportunistically or for failed
    /// hardware; a cancel by the owner is not a preemption).
    pub preemptions: u64,
    /// Running workloads stopped because their owner cancelled them.
    pub cancels: u64,
    /// Stops of its workloads before their contract ended, other than hardware failures.
    pub contract_violations: u64,
    /// Bucketed delivered and owed.
    pub window: Window,
}

impl Allocation {
    /// True when no live child exists: workloads may be charged here.
    pub fn is_leaf(&self) -> bool {
        self.children.is_empty()
    }
}

/// The tree: an arena indexed by [`AllocId`] plus a path index.
#[derive(Clone, Debug, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct AllocationTree {
    /// All allocations ever created, removed ones included.
    pub nodes: Vec<Allocation>,
    /// Live top-level allocations.
    pub roots: Vec<AllocId>,
    /// Sum of the top-level allocations' `subtree_demand_gpus`.
    pub roots_demand_gpus: u64,
    by_path: FxHashMap<String, AllocId>,
    #[serde(skip)]
    buf: SplitBuffers,
}

impl AllocationTree {
    /// Figures of every allocation, by id: a leaf's from `leaf`, a parent's the sums of its
    /// subtree's leaves (as every figure of the tree reads: leaves account, parents add up).
    pub fn roll_up<const N: usize>(
        &self,
        mut leaf: impl FnMut(AllocId, &Allocation) -> [f64; N],
    ) -> Vec<[f64; N]> {
        let mut sums: Vec<[f64; N]> = (self.nodes.iter().enumerate())
            .map(|(id, a)| {
                if a.is_leaf() {
                    leaf(id as AllocId, a)
                } else {
                    [0.0; N]
                }
            })
            .collect();
        // A child is created after its parent, so its id is larger: children first.
        for id in (0..self.nodes.len()).rev() {
            if let Some(p) = self.nodes[id].parent {
                let child = sums[id];
                for (total, v) in sums[p as usize].iter_mut().zip(child) {
                    *total += v;
                }
            }
        }
        sums
    }

    /// The live allocation at `path`.
    pub fn get(&self, path: &str) -> Option<AllocId> {
        self.by_path
            .get(path)
            .copied()
            .filter(|&id| !self.nodes[id as usize].removed)
    }

    /// The allocation with id `id`.
    pub fn node(&self, id: AllocId) -> &Allocation {
        &self.nodes[id as usize]
    }

    pub(crate) fn node_mut(&mut self, id: AllocId) -> &mut Allocation {
        &mut self.nodes[id as usize]
    }

    /// Checks that `set`, from an event of `schema_version`, can be applied, without changing
    /// anything. A live allocation can always be reweighted, whatever rules its name was
    /// created under.
    pub(crate) fn check_set(
        &self,
        schema_version: u16,
        path: &str,
        weight: u32,
    ) -> Result<(), Rejection> {
        if self.get(path).is_none() {
            crate::names::path_as_of(schema_version, path)?;
        }
        if weight == 0 {
            return Err(Rejection::MustBePositive { field: "weight" });
        }
        // A new child must not turn a leaf holding workloads into an interior node.
        let mut prefix_end = path.rfind('/');
        while let Some(end) = prefix_end {
            let parent = &path[..end];
            if let Some(id) = self.get(parent) {
                let a = self.node(id);
                if a.is_leaf() && a.live_workloads > 0 && self.get(path).is_none() {
                    return Err(Rejection::AllocationInUse {
                        path: parent.to_string(),
                        workloads: a.live_workloads,
                    });
                }
                break;
            }
            prefix_end = parent.rfind('/');
        }
        Ok(())
    }

    /// Creates or updates `path`, creating missing parents with weight 1. Call `check_set` first.
    pub(crate) fn set(
        &mut self,
        shape: WindowShape,
        seq: u64,
        path: &str,
        weight: u32,
        max_gpus: Option<u32>,
        max_pending: (Option<u32>, Option<u64>),
    ) {
        let id = self.ensure(shape, seq, path);
        let a = self.node_mut(id);
        a.weight = weight;
        a.max_gpus = max_gpus;
        (a.max_pending_workloads, a.max_pending_gpus) = max_pending;
        self.recompute_demands();
    }

    /// Recomputes every subtree demand from the leaves' demands (after the shape of the tree or a
    /// cap changed).
    pub(crate) fn recompute_demands(&mut self) {
        // Children always have higher ids than their parents: one pass from the end suffices.
        for a in self.nodes.iter_mut() {
            if !a.is_leaf() {
                a.raw_demand_gpus = 0;
            }
        }
        self.roots_demand_gpus = 0;
        for id in (0..self.nodes.len()).rev() {
            let a = &mut self.nodes[id];
            if a.removed {
                continue;
            }
            if a.is_leaf() {
                a.raw_demand_gpus = a.demand_gpus;
            }
            a.subtree_demand_gpus = capped(a.raw_demand_gpus, a.max_gpus);
            let (d, parent) = (a.subtree_demand_gpus, a.parent);
            match parent {
                Some(p) => self.nodes[p as usize].raw_demand_gpus += d,
                None => self.roots_demand_gpus += d,
            }
        }
    }

    /// Changes a leaf's demand by `delta` GPUs, keeping subtree demands right. When `split_fresh`,
    /// also tries to keep the owed split right without recomputing it: only the path from the
    /// leaf to the top can change, and level by level (top down) either the path's node stays
    /// short of its demand with an unchanged capacity to share (then max-min gives everyone the
    /// same), or every sibling at that level is satisfied before and after (then only the path's
    /// node changes, to its new demand). Returns whether the stored split is still right; when it
    /// is not, the caller must recompute it.
    pub(crate) fn change_demand(
        &mut self,
        leaf: AllocId,
        delta: i64,
        capacity: f64,
        split_fresh: bool,
    ) -> bool {
        // Bottom-up: the path with each node's demand before and after.
        let mut path: Vec<(AllocId, u64, u64)> = Vec::with_capacity(8);
        let mut id = leaf;
        let mut raw_delta = delta;
        let (old_sum_top, new_sum_top);
        loop {
            let a = &mut self.nodes[id as usize];
            if id == leaf {
                a.demand_gpus = (a.demand_gpus as i64 + delta) as u64;
            }
            let old = a.subtree_demand_gpus;
            a.raw_demand_gpus = (a.raw_demand_gpus as i64 + raw_delta) as u64;
            a.subtree_demand_gpus = capped(a.raw_demand_gpus, a.max_gpus);
            let new = a.subtree_demand_gpus;
            path.push((id, old, new));
            raw_delta = new as i64 - old as i64;
            match a.parent {
                Some(p) => id = p,
                None => {
                    old_sum_top = self.roots_demand_gpus;
                    self.roots_demand_gpus = (self.roots_demand_gpus as i64 + raw_delta) as u64;
                    new_sum_top = self.roots_demand_gpus;
                    break;
                }
            }
        }
        if !split_fresh {
            return false;
        }
        // Top-down: the capacity shared at each level, before and after.
        let (mut cap_old, mut cap_new) = (capacity, capacity);
        let (mut sum_old, mut sum_new) = (old_sum_top, new_sum_top);
        for (i, &(x, d_old, d_new)) in path.iter().enumerate().rev() {
            let owed = self.nodes[x as usize].owed_gpus;
            let unsatisfied = owed < d_old as f64 && owed < d_new as f64;
            let next_owed = if cap_old == cap_new && unsatisfied {
                owed
            } else if sum_old as f64 <= cap_old && sum_new as f64 <= cap_new {
                d_new as f64
            } else {
                return false;
            };
            self.nodes[x as usize].owed_gpus = next_owed;
            cap_old = owed;
            cap_new = next_owed;
            // The next level down shares this node's owed among its children.
            if i > 0 {
                let a = &self.nodes[x as usize];
                let child_old = path[i - 1].1;
                let child_new = path[i - 1].2;
                sum_new = a.raw_demand_gpus;
                sum_old = (sum_new as i64 - child_new as i64 + child_old as i64) as u64;
            }
        }
        true
    }

    fn ensure(&mut self, shape: WindowShape, seq: u64, path: &str) -> AllocId {
        if let Some(id) = self.get(path) {
            return id;
        }
        let parent = path
            .rfind('/')
            .map(|end| self.ensure(shape, seq, &path[..end]));
        let id = self.nodes.len() as AllocId;
        self.nodes.push(Allocation {
            path: path.to_string(),
            parent,
            children: Vec::new(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
            removed: false,
            demand_gpus: 0,
            raw_demand_gpus: 0,
            subtree_demand_gpus: 0,
            held_gpus: 0,
            delivering_gpus: 0,
            owed_gpus: 0.0,
            delivered_gpu_ms: 0,
            owed_gpu_ms: 0.0,
            within_share_gpu_ms: 0.0,
            live_workloads: 0,
            created_seq: seq,
            preemptions: 0,
            cancels: 0,
            contract_violations: 0,
            window: Window::new(shape),
        });
        match parent {
            Some(p) => self.node_mut(p).children.push(id),
            None => self.roots.push(id),
        }
        self.by_path.insert(path.to_string(), id);
        id
    }

    /// The live allocation at `path`; for a path that names none, why: it is no valid path, or
    /// no allocation has it. Looked up before checked, so an allocation created under older
    /// rules stays reachable.
    pub(crate) fn live(&self, path: &str) -> Result<AllocId, Rejection> {
        if let Some(id) = self.get(path) {
            return Ok(id);
        }
        crate::names::path(path)?;
        Err(Rejection::UnknownAllocation {
            path: path.to_string(),
        })
    }

    /// Checks that `path` can be removed.
    pub(crate) fn check_remove(&self, path: &str) -> Result<AllocId, Rejection> {
        let id = self.live(path)?;
        let a = self.node(id);
        if !a.children.is_empty() {
            return Err(Rejection::AllocationHasChildren {
                path: path.to_string(),
            });
        }
        if a.live_workloads > 0 {
            return Err(Rejection::AllocationInUse {
                path: path.to_string(),
                workloads: a.live_workloads,
            });
        }
        Ok(id)
    }

    /// Removes an allocation checked by `check_remove`.
    pub(crate) fn remove(&mut self, id: AllocId) {
        let parent = self.node(id).parent;
        let siblings = match parent {
            Some(p) => &mut self.nodes[p as usize].children,
            None => &mut self.roots,
        };
        siblings.retain(|&c| c != id);
        let path = std::mem::take(&mut self.nodes[id as usize].path);
        self.by_path.remove(&path);
        let a = self.node_mut(id);
        a.path = path;
        a.removed = true;
        a.owed_gpus = 0.0;
        self.recompute_demands();
    }

    /// Live allocations from `id` up to its top-level ancestor.
    pub fn ancestors(&self, id: AllocId) -> impl Iterator<Item = AllocId> + '_ {
        std::iter::successors(Some(id), move |&a| self.node(a).parent)
    }

    /// GPUs held by the subtree of `id`.
    pub fn held_in_subtree(&self, id: AllocId) -> u64 {
        let a = self.node(id);
        if a.is_leaf() {
            a.held_gpus
        } else {
            a.children.iter().map(|&c| self.held_in_subtree(c)).sum()
        }
    }

    /// Recomputes every allocation's instantaneous owed GPUs from `capacity` healthy GPUs.
    pub(crate) fn split_owed(&mut self, capacity: f64) {
        let mut buf = std::mem::take(&mut self.buf);
        self.split_into(capacity, &mut buf);
        for (a, &o) in self.nodes.iter_mut().zip(&buf.owed) {
            a.owed_gpus = o;
        }
        self.buf = buf;
    }

    /// The owed GPUs of every allocation (indexed by [`AllocId`]) if `capacity` healthy GPUs were
    /// split now among the demands as they stand.
    pub fn owed_split(&self, capacity: f64) -> Vec<f64> {
        let mut buf = SplitBuffers::default();
        self.split_into(capacity, &mut buf);
        buf.owed
    }

    fn split_into(&self, capacity: f64, buf: &mut SplitBuffers) {
        let n = self.nodes.len();
        buf.demand.clear();
        buf.demand.extend(self.nodes.iter().map(|a| {
            if a.removed {
                0.0
            } else {
                a.subtree_demand_gpus as f64
            }
        }));
        buf.owed.clear();
        buf.owed.resize(n, 0.0);
        self.fill(&self.roots, capacity, buf);
    }

    /// Weighted water-filling of `capacity` among `children`, then down each subtree.
    fn fill(&self, children: &[AllocId], capacity: f64, buf: &mut SplitBuffers) {
        buf.open.clear();
        buf.open.extend(
            children
                .iter()
                .copied()
                .filter(|&c| buf.demand[c as usize] > 0.0),
        );
        let mut left = capacity;
        while !buf.open.is_empty() && left > 0.0 {
            let mut weights = 0.0;
            for &c in &buf.open {
                weights += f64::from(self.node(c).weight);
            }
            let per_weight = left / weights;
            // Satisfy every child whose demand fits its share; repeat with the rest.
            let before = buf.open.len();
            let mut kept = 0;
            for i in 0..before {
                let c = buf.open[i];
                let want = buf.demand[c as usize];
                if want <= per_weight * f64::from(self.node(c).weight) {
                    buf.owed[c as usize] = want;
                    left -= want;
                } else {
                    buf.open[kept] = c;
                    kept += 1;
                }
            }
            buf.open.truncate(kept);
            if kept == before {
                for &c in &buf.open {
                    buf.owed[c as usize] = per_weight * f64::from(self.node(c).weight);
                }
                left = 0.0;
            }
        }
        for &c in children {
            let a = self.node(c);
            if !a.is_leaf() && buf.owed[c as usize] > 0.0 {
                self.fill(&a.children, buf.owed[c as usize], buf);
            }
        }
    }
}

fn capped(demand: u64, max_gpus: Option<u32>) -> u64 {
    max_gpus.map_or(demand, |m| demand.min(u64::from(m)))
}

/// Reused space for the owed split, so the fold does not allocate on every change of time.
#[derive(Clone, Debug, Default)]
pub(crate) struct SplitBuffers {
    demand: Vec<f64>,
    owed: Vec<f64>,
    open: Vec<AllocId>,
}

impl PartialEq for SplitBuffers {
    /// Scratch space holds no state: any two are equal.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(specs: &[(&str, u32, u64)]) -> AllocationTree {
        let shape = WindowShape::new(1000, 10);
        let mut t = AllocationTree::default();
        for &(path, weight, demand) in specs {
            t.check_set(crate::event::SCHEMA_VERSION, path, weight)
                .unwrap();
            t.set(shape, 1, path, weight, None, (None, None));
            let id = t.get(path).unwrap();
            t.node_mut(id).demand_gpus = demand;
        }
        t.recompute_demands();
        t
    }

    fn owed(t: &AllocationTree, path: &str) -> f64 {
        t.node(t.get(path).unwrap()).owed_gpus
    }

    #[test]
    fn split_is_hierarchical_max_min_capped_by_demand() {
        // 12 GPUs. Top level: org a (weight 1) and org b (weight 1) → 6 each.
        // a has three children with ample demand → 2 each. b has one child asking 4 → b gets 4,
        // and its unused 2 go back to a, which then has 8: 8/3 each for a's children.
        let mut t = tree(&[
            ("a/x", 1, 100),
            ("a/y", 1, 100),
            ("a/z", 1, 100),
            ("b/w", 1, 4),
        ]);
        t.split_owed(12.0);
        assert_eq!(owed(&t, "b"), 4.0);
        assert_eq!(owed(&t, "b/w"), 4.0);
        assert_eq!(owed(&t, "a"), 8.0);
        for leaf in ["a/x", "a/y", "a/z"] {
            assert!((owed(&t, leaf) - 8.0 / 3.0).abs() < 1e-12);
        }
    }

    #[test]
    fn split_follows_weights_and_skips_allocations_without_demand() {
        // 16 GPUs among weights 1:2:1 with ample demand → 4, 8, 4. A fourth sibling with no
        // demand is owed nothing and takes nothing from the others.
        let mut t = tree(&[("p", 1, 50), ("q", 2, 50), ("r", 1, 50), ("idle", 5, 0)]);
        t.split_owed(16.0);
        assert_eq!(
            [
                owed(&t, "p"),
                owed(&t, "q"),
                owed(&t, "r"),
                owed(&t, "idle")
            ],
            [4.0, 8.0, 4.0, 0.0]
        );
    }

    #[test]
    fn split_respects_caps_and_total_demand() {
        // 10 GPUs, demand 3 + 2 = 5 < 10: everyone gets their demand and 5 stay unowed.
        let mut t = tree(&[("p", 1, 3), ("q", 1, 2)]);
        t.split_owed(10.0);
        assert_eq!([owed(&t, "p"), owed(&t, "q")], [3.0, 2.0]);
        // A cap of 1 on q frees its share for p.
        let mut t = tree(&[("p", 1, 30), ("q", 1, 30)]);
        let q = t.get("q").unwrap();
        t.node_mut(q).max_gpus = Some(1);
        t.recompute_demands();
        t.split_owed(10.0);
        assert_eq!([owed(&t, "p"), owed(&t, "q")], [9.0, 1.0]);
    }
}
