//! The order in which one pass considers pending workloads.
//!
//! A *tree ranking* descends the allocation tree: at each level it takes the child with the lowest
//! key among those with pending work left in this pass, down to a leaf, whose queue is ordered by
//! priority then submission. When a policy updates in the pass, a placed workload's GPUs count
//! toward its allocation at once, so one under-served team does not take everything. A *flat
//! ranking* sorts all pending workloads by one key. Unallocated work always comes last.

use std::cmp::Ordering;
use std::collections::btree_set::Range;

use crate::alloc::AllocId;
use crate::event::WorkloadId;
use crate::state::{QueueKey, State, Workload};

use super::Policy;

/// How a policy walks the queue.
#[derive(Clone, Copy, Debug)]
pub enum Ranking {
    /// Descend the allocation tree by [`Policy::allocation_key`].
    Tree,
    /// One global order by (key of the workload's priority, submission), lower first. Built
    /// from the queues' own keys, without looking workloads up.
    Flat(fn(i32) -> i64),
}

/// What the keys are computed from, for one allocation's subtree (or a sum over siblings).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// Delivered GPU-milliseconds in the window.
    pub delivered_w: f64,
    /// Owed GPU-milliseconds in the window.
    pub owed_w: f64,
    /// GPUs held now (plus those placed earlier in this pass).
    pub held: f64,
    /// GPUs owed now.
    pub owed_now: f64,
    /// Weight among siblings.
    pub weight: f64,
}

impl Usage {
    fn add(&mut self, o: &Usage) {
        self.delivered_w += o.delivered_w;
        self.owed_w += o.owed_w;
        self.held += o.held;
        self.owed_now += o.owed_now;
        self.weight += o.weight;
    }
}

/// The ranking state of one pass.
pub struct Rank<'s> {
    state: &'s State,
    now_ms: u64,
    policy: &'s dyn Policy,
    tau_ms: f64,
    mode: Ranking,
    /// How many times the keys changed in this pass.
    version: u64,
    /// Per allocation: subtree usage and key.
    usage: Vec<Usage>,
    key: Vec<f64>,
    /// Per allocation: leaves in its subtree with candidates left this pass.
    left: Vec<u32>,
    /// Per allocation: how many ancestors it has.
    depth: Vec<u32>,
    /// Per leaf: how far the pass has come through its queue (read lazily: a pass that stops
    /// early costs nothing for the workloads it never reaches).
    /// Each holds the next key and the range after it.
    queue: Vec<Option<(Option<&'s QueueKey>, Range<'s, QueueKey>)>>,
    /// Flat order.
    flat: std::vec::IntoIter<WorkloadId>,
    /// Unallocated work, last.
    unallocated: std::collections::btree_set::Iter<'s, QueueKey>,
}

impl<'s> Rank<'s> {
    /// Prepares a pass at `now_ms`.
    pub fn new(state: &'s State, now_ms: u64, policy: &'s dyn Policy, tau_ms: f64) -> Self {
        let n = state.allocations.nodes.len();
        let mut r = Rank {
            state,
            now_ms,
            policy,
            tau_ms,
            mode: policy.ranking(),
            usage: vec![Usage::default(); n],
            key: vec![0.0; n],
            left: vec![0; n],
            depth: vec![0; n],
            version: 0,
            queue: (0..n).map(|_| None).collect(),
            flat: Vec::new().into_iter(),
            unallocated: state.unallocated_queue.iter(),
        };
        let shape = state.window_shape();
        let tree = &state.allocations;
        let owed = state.owed_now();
        // A pass later than the last event extends the current rates to `now_ms`.
        let gap_ms = now_ms.saturating_sub(state.now_ms) as f64;
        // Parents first (children always have higher ids than parents).
        for id in 0..n {
            if let Some(p) = tree.nodes[id].parent {
                r.depth[id] = r.depth[p as usize] + 1;
            }
        }
        // Leaves first, then sums up the tree.
        for id in (0..n).rev() {
            let a = &tree.nodes[id];
            if a.removed {
                continue;
            }
            if a.is_leaf() {
                let sums = a.window.sums(shape, now_ms);
                r.usage[id].delivered_w = sums.delivered_gpu_ms + a.delivering_gpus as f64 * gap_ms;
                r.usage[id].owed_w = sums.owed_gpu_ms + owed[id] * gap_ms;
                r.usage[id].held = a.held_gpus as f64;
            }
            r.usage[id].owed_now = owed[id];
            r.usage[id].weight = f64::from(a.weight);
            if let Some(p) = a.parent {
                let child = r.usage[id];
                let parent = &mut r.usage[p as usize];
                parent.delivered_w += child.delivered_w;
                parent.owed_w += child.owed_w;
                parent.held += child.held;
            }
        }
        match r.mode {
            Ranking::Tree => {
                let mut leaves: Vec<(&AllocId, _)> = state.queues.iter().collect();
                leaves.sort_unstable_by_key(|(id, _)| **id);
                for (&leaf, q) in leaves {
                    let mut rest = q.range::<QueueKey, _>(..);
                    r.queue[leaf as usize] = Some((rest.next(), rest));
                    if !q.is_empty() {
                        for anc in tree.ancestors(leaf) {
                            r.left[anc as usize] += 1;
                        }
                    }
                }
                r.rekey_children_of(None);
            }
            Ranking::Flat(key) => {
                let mut all: Vec<(i64, u64, WorkloadId)> = state
                    .queues
                    .values()
                    .flatten()
                    .map(|&(std::cmp::Reverse(priority), seq, id)| (key(priority), seq, id))
                    .collect();
                all.sort_unstable();
                r.flat = all.into_iter().map(|k| k.2).collect::<Vec<_>>().into_iter();
            }
        }
        r
    }

    fn children(&self, parent: Option<AllocId>) -> &[AllocId] {
        match parent {
            Some(p) => &self.state.allocations.node(p).children,
            None => &self.state.allocations.roots,
        }
    }

    /// Recomputes the keys of `parent`'s children (all of them: keys may depend on sibling sums),
    /// then recursively below.
    fn rekey_children_of(&mut self, parent: Option<AllocId>) {
        let kids = self.children(parent).to_vec();
        self.rekey_level(&kids);
        for &k in &kids {
            if !self.state.allocations.node(k).is_leaf() {
                self.rekey_children_of(Some(k));
            }
        }
    }

    fn rekey_level(&mut self, kids: &[AllocId]) {
        let mut sum = Usage::default();
        for &k in kids {
            sum.add(&self.usage[k as usize]);
        }
        for &k in kids {
            self.key[k as usize] =
                self.policy
                    .allocation_key(&self.usage[k as usize], &sum, self.tau_ms);
        }
    }

    /// The next workload to consider, or `None` when the pass is over.
    pub fn next_candidate(&mut self) -> Option<WorkloadId> {
        if matches!(self.mode, Ranking::Tree) {
            let mut level: Option<AllocId> = None;
            loop {
                let best = self
                    .children(level)
                    .iter()
                    .copied()
                    .filter(|&c| self.left[c as usize] > 0)
                    .min_by(|&a, &b| {
                        self.key[a as usize]
                            .partial_cmp(&self.key[b as usize])
                            .unwrap_or(Ordering::Equal)
                            .then(a.cmp(&b))
                    });
                let Some(best) = best else { break };
                if self.state.allocations.node(best).is_leaf() {
                    let next = self.queue[best as usize].as_mut().and_then(|(head, rest)| {
                        let this = head.take()?;
                        *head = rest.next();
                        Some((this.2, head.is_none()))
                    });
                    if next.is_none_or(|(_, last)| last) {
                        self.retire(best);
                    }
                    return next.map(|(id, _)| id);
                }
                level = Some(best);
            }
        }
        self.flat
            .next()
            .or_else(|| self.unallocated.next().map(|k| k.2))
    }

    /// A leaf has no candidates left.
    fn retire(&mut self, leaf: AllocId) {
        if self.left[leaf as usize] == 0 {
            return;
        }
        for anc in self.state.allocations.ancestors(leaf) {
            self.left[anc as usize] -= 1;
        }
    }

    /// Leaves the rest of `leaf`'s queue out of this pass (a tree ranking only: a flat one
    /// interleaves the leaves, and goes on).
    pub fn skip_rest_of(&mut self, leaf: AllocId) {
        if matches!(self.mode, Ranking::Tree) {
            self.retire(leaf);
        }
    }

    /// Goes on with `leaf`'s queue at `key` (which must not come before where the pass is),
    /// leaving out what lies between (a tree ranking only).
    pub fn skip_to(&mut self, leaf: AllocId, key: &QueueKey) {
        if !matches!(self.mode, Ranking::Tree) || self.left[leaf as usize] == 0 {
            return;
        }
        let Some(q) = self.state.queues.get(&leaf) else {
            return;
        };
        let mut rest = q.range(key..);
        let head = rest.next();
        self.queue[leaf as usize] = Some((head, rest));
        if head.is_none() {
            self.retire(leaf);
        }
    }

    /// Records that `w` was placed in this pass.
    pub fn placed(&mut self, w: &Workload) {
        let Some(leaf) = w.allocation else { return };
        let gpus = w.gpus() as f64;
        for anc in self.state.allocations.ancestors(leaf) {
            self.usage[anc as usize].held += gpus;
        }
        if matches!(self.mode, Ranking::Tree) && self.policy.updates_in_pass() {
            for anc in self.state.allocations.ancestors(leaf) {
                let parent = self.state.allocations.node(anc).parent;
                let kids = self.children(parent).to_vec();
                self.rekey_level(&kids);
            }
            self.version += 1;
        }
    }

    /// Changes whenever the keys change within the pass (what was worked out from them holds
    /// while it stays the same).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The capped allocation that `w` would push over its cap, if any.
    pub fn cap_blocks(&self, w: &Workload) -> Option<(String, u32)> {
        let leaf = w.allocation?;
        self.state.allocations.ancestors(leaf).find_map(|anc| {
            let a = self.state.allocations.node(anc);
            let max = a.max_gpus?;
            (self.usage[anc as usize].held + w.gpus() as f64 > f64::from(max))
                .then(|| (a.path.clone(), max))
        })
    }

    /// The ledger this pass ranks.
    pub fn state(&self) -> &'s State {
        self.state
    }

    /// The time of the pass.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Whether an allocation was delivered less than it was owed over the usage window,
    /// whatever the policy's key.
    pub fn under_served(&self, id: AllocId) -> bool {
        let u = &self.usage[id as usize];
        u.delivered_w < u.owed_w
    }

    /// Whether an allocation was delivered more than it was owed over the usage window.
    pub fn over_served(&self, id: AllocId) -> bool {
        let u = &self.usage[id as usize];
        u.delivered_w > u.owed_w
    }

    /// GPUs an allocation is owed now beyond those it holds (with those placed in this pass).
    pub fn deficit_gpus(&self, id: AllocId) -> f64 {
        let u = &self.usage[id as usize];
        u.owed_now - u.held
    }

    /// The current key of an allocation.
    pub fn key(&self, id: AllocId) -> f64 {
        self.key[id as usize]
    }

    /// Whether allocation `victim` ranks above `beneficiary` by more than `margin`, comparing the
    /// two children of their lowest common ancestor on each side. Never within one leaf, nor
    /// between an allocation and its own ancestor.
    pub fn outranks_by(
        &self,
        state: &State,
        beneficiary: AllocId,
        victim: AllocId,
        margin: f64,
    ) -> bool {
        self.gap(state, beneficiary, victim)
            .is_some_and(|gap| gap > margin)
    }

    /// How far allocation `victim` ranks above `beneficiary` on the key, comparing the two
    /// children of their lowest common ancestor on each side; `None` within one leaf, or
    /// between an allocation and its own ancestor.
    pub fn gap(&self, state: &State, beneficiary: AllocId, victim: AllocId) -> Option<f64> {
        let tree = &state.allocations;
        let depth = |a: AllocId| self.depth[a as usize];
        let (mut b, mut v) = (beneficiary, victim);
        let (mut db, mut dv) = (depth(b), depth(v));
        // Climb to equal depth, then together until the parents agree.
        while db > dv {
            let p = tree.node(b).parent?;
            if p == v {
                return None;
            }
            b = p;
            db -= 1;
        }
        while dv > db {
            let p = tree.node(v).parent?;
            if p == b {
                return None;
            }
            v = p;
            dv -= 1;
        }
        if b == v {
            return None;
        }
        while tree.node(b).parent != tree.node(v).parent {
            match (tree.node(b).parent, tree.node(v).parent) {
                (Some(pb), Some(pv)) => {
                    b = pb;
                    v = pv;
                }
                _ => break,
            }
        }
        Some(self.key(v) - self.key(b))
    }
}
