//! Placement: which GPUs a workload gets, within one pass.
//!
//! The pass works on a scratch copy of every node's free GPUs, indexed per GPU model by free
//! count, so *best fit* — the node with the fewest free GPUs that still fit — is found without a
//! scan and small jobs pack onto busy nodes, keeping whole nodes free for gangs. A gang (several
//! nodes) is all-or-nothing: every member on a distinct node of one model, preferring nodes that
//! share a topology label (same rack). Nodes *withheld* for the reservation or for a pending
//! preemption leave the index; only backfill that ends before the reservation may use them.

use std::cell::OnceCell;
use std::cmp::Reverse;

use rustc_hash::{FxHashMap, FxHashSet};

use super::bits::Bits;
use crate::cluster::{Cluster, NodeIdx, Tenant};
use crate::event::WorkloadId;
use crate::state::{Part, State, Workload};

/// Cost of a preemption: allocated victims (unallocated ones go first), then the times the
/// victims were preempted before (work never preempted goes first), then GPU-milliseconds of work
/// lost since their checkpoints.
type Cost = (u32, u32, u64);

/// Why no preemption plan was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoPlan {
    /// Some work could be preempted, but not enough on the right nodes.
    NotEnough,
    /// No running work may be preempted for this workload at all.
    NoVictims,
}

/// Per-model index of nodes by free GPU count.
struct FreeIndex {
    /// `buckets[k]`: nodes with exactly `k` free GPUs. Bucket 0 stays empty: every workload
    /// asks for at least one GPU per node, so full nodes are never looked up (on a busy cluster,
    /// most nodes).
    buckets: Vec<Vec<NodeIdx>>,
}

/// The free GPUs of every node as this pass sees them.
pub struct Scratch<'s> {
    cluster: &'s Cluster,
    topology_label: &'s str,
    free: Vec<u64>,
    /// Each node's healthy GPUs, as the ledger has them.
    healthy: &'s [u64],
    /// Withheld nodes, one bit each.
    withheld: Bits,
    /// The withheld nodes, in the order they were withheld.
    withheld_list: Vec<NodeIdx>,
    /// For whom each of `withheld_list` is withheld.
    withheld_for: Vec<WorkloadId>,
    /// Withheld nodes whose free GPUs may be lent (see [`Self::lend_nodes`]), one bit each.
    lendable: Bits,
    model: &'s [u32],
    groups: Vec<FreeIndex>,
    /// Topology group of each node (`u32::MAX` when unlabeled), read when a gang is placed.
    rack: OnceCell<Vec<u32>>,
    /// Free GPUs left in the whole cluster, withheld nodes included.
    free_total: u64,
}

impl<'s> Scratch<'s> {
    /// Reads the cluster.
    pub fn new(state: &'s State, topology_label: &'s str) -> Self {
        // A pass runs after every event: it copies only what it changes (the free GPUs), and
        // keeps a bit per node for what it marks.
        let c = &state.cluster;
        let n = c.nodes.len();
        let mut s = Scratch {
            cluster: c,
            topology_label,
            free: c.free_masks.clone(),
            healthy: &c.healthy_masks,
            withheld: Bits::new(n),
            withheld_list: Vec::new(),
            withheld_for: Vec::new(),
            lendable: Bits::new(n),
            model: &c.model_of,
            // Sized from the cluster's own count of nodes by free GPUs.
            groups: state
                .cluster
                .models
                .iter()
                .map(|m| FreeIndex {
                    buckets: m
                        .free_hist
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| Vec::with_capacity(if k == 0 { 0 } else { n as usize }))
                        .collect(),
                })
                .collect(),
            rack: OnceCell::new(),
            free_total: 0,
        };
        s.free_total = c.healthy_gpus - c.allocated_gpus;
        // Every node with a free GPU into its bucket, in index order (the buckets were sized
        // from the cluster's own counts).
        for (idx, (&free, &model)) in s.free.iter().zip(s.model).enumerate() {
            if free != 0 {
                s.groups[model as usize].buckets[free.count_ones() as usize].push(idx as NodeIdx);
            }
        }
        s
    }

    /// The topology group of each node, numbered in order of first appearance.
    fn racks(&self) -> &[u32] {
        self.rack.get_or_init(|| {
            let mut racks: FxHashMap<&str, u32> = FxHashMap::default();
            self.cluster
                .nodes
                .iter()
                .map(|n| match n.labels.get(self.topology_label) {
                    Some(v) => {
                        let next = racks.len() as u32;
                        *racks.entry(v.as_str()).or_insert(next)
                    }
                    None => u32::MAX,
                })
                .collect()
        })
    }

    fn index(&mut self, node: NodeIdx) {
        let k = self.free[node as usize].count_ones() as usize;
        if k == 0 {
            return; // see `FreeIndex::buckets`
        }
        let g = &mut self.groups[self.model[node as usize] as usize];
        if g.buckets.len() <= k {
            g.buckets.resize_with(k + 1, Vec::new);
        }
        g.buckets[k].push(node);
    }

    fn unindex(&mut self, node: NodeIdx) {
        let k = self.free[node as usize].count_ones() as usize;
        if k == 0 {
            return;
        }
        // A few nodes leave the index in a pass: finding them costs less than keeping every
        // node's position.
        let bucket = &mut self.groups[self.model[node as usize] as usize].buckets[k];
        let at = bucket.iter().position(|&n| n == node).expect("indexed");
        bucket.swap_remove(at);
    }

    /// Whether `nodes` nodes of some one model have `gpus_per_node` free GPUs each: withheld
    /// nodes included if `backfill`, and the nodes a reservation lends for single-node work.
    pub fn could_fit(&self, gpus_per_node: u32, nodes: u32, backfill: bool) -> bool {
        (0..self.groups.len()).any(|g| {
            let withheld = if backfill || nodes == 1 {
                self.withheld_list
                    .iter()
                    .filter(|&&i| {
                        (backfill || self.lendable.get(i as usize))
                            && self.model[i as usize] as usize == g
                            && self.free[i as usize].count_ones() >= gpus_per_node
                    })
                    .count()
            } else {
                0
            };
            self.count_fitting(g, gpus_per_node as usize) + withheld >= nodes as usize
        })
    }

    /// Whether single-node work of `sizes` GPUs (largest first) could start at once on nodes of
    /// `node`'s model other than `node` that are not withheld, each on one node, best fit.
    pub fn could_rehome(&self, node: NodeIdx, sizes: &[u32]) -> bool {
        let g = &self.groups[self.model[node as usize] as usize];
        let mut count: Vec<usize> = g.buckets.iter().map(Vec::len).collect();
        let own = self.free[node as usize].count_ones() as usize;
        if !self.withheld.get(node as usize) && own > 0 {
            count[own] -= 1;
        }
        sizes.iter().all(|&s| {
            let Some(k) = (s as usize..count.len()).find(|&k| count[k] > 0) else {
                return false;
            };
            count[k] -= 1;
            count[k - s as usize] += 1;
            true
        })
    }

    /// Free GPUs of node `n` in this pass.
    pub fn free_on(&self, n: NodeIdx) -> u32 {
        self.free[n as usize].count_ones()
    }

    /// Free GPUs left anywhere in the cluster, withheld nodes included.
    pub fn free_total(&self) -> u64 {
        self.free_total
    }

    /// Takes nodes out of the index, holding their free GPUs for someone.
    pub fn withhold_nodes(&mut self, nodes: &[NodeIdx], holder: WorkloadId) {
        for &n in nodes {
            if !self.withheld.get(n as usize) {
                self.unindex(n);
                self.withheld.set(n as usize);
                self.withheld_list.push(n);
                self.withheld_for.push(holder);
            }
        }
    }

    /// Withholds the nodes of a reservation: their free GPUs wait for its workload, and may be
    /// lent meanwhile ([`Self::place_borrowed`]).
    pub fn lend_nodes(&mut self, nodes: &[NodeIdx], holder: WorkloadId) {
        self.withhold_nodes(nodes, holder);
        for &n in nodes {
            self.lendable.set(n as usize);
        }
    }

    /// Places single-node `w` on the free GPUs of a reservation's node, best fit, or returns
    /// `None`: a borrowed placement, which gives them back when the reservation is due. Returns
    /// the placement and the workload the reservation lending it is for.
    pub fn place_borrowed(&mut self, w: &Workload) -> Option<(Vec<Part>, WorkloadId)> {
        if w.nodes != 1 {
            return None;
        }
        let (_, node, holder) = self
            .withheld_list
            .iter()
            .zip(&self.withheld_for)
            .filter(|&(&i, _)| {
                self.lendable.get(i as usize) && w.model.is_none_or(|m| m == self.model[i as usize])
            })
            .map(|(&i, &holder)| (self.free[i as usize].count_ones(), i, holder))
            .filter(|&(k, _, _)| k >= w.gpus_per_node)
            .min()?;
        let part = Part {
            node,
            gpus: self.pick_gpus(node, w.gpus_per_node),
        };
        self.take(part.node, part.gpus);
        Some((vec![part], holder))
    }

    fn take(&mut self, node: NodeIdx, mask: u64) {
        let indexed = !self.withheld.get(node as usize);
        if indexed {
            self.unindex(node);
        }
        self.free_total -= u64::from((self.free[node as usize] & mask).count_ones());
        self.free[node as usize] &= !mask;
        if indexed {
            self.index(node);
        }
    }

    fn groups_for(&self, w: &Workload) -> impl Iterator<Item = usize> + '_ {
        let only = w.model.map(|m| m as usize);
        (0..self.groups.len()).filter(move |g| only.is_none_or(|m| m == *g))
    }

    /// Lowest `count` free GPUs of a node.
    fn pick_gpus(&self, node: NodeIdx, count: u32) -> u64 {
        let mut free = self.free[node as usize];
        let mut mask = 0u64;
        for _ in 0..count {
            let low = free & free.wrapping_neg();
            mask |= low;
            free &= !low;
        }
        mask
    }

    /// Places `w` now, taking the GPUs from the scratch, or returns `None`. With `withheld_only`,
    /// only withheld nodes are considered (backfill onto a reservation).
    pub fn place(&mut self, w: &Workload, withheld_only: bool) -> Option<Vec<Part>> {
        let nodes = if withheld_only {
            self.choose_withheld(w)?
        } else if w.nodes == 1 {
            vec![self.best_fit_single(w)?]
        } else {
            self.choose_gang(w)?
        };
        let parts: Vec<Part> = nodes
            .into_iter()
            .map(|n| Part {
                node: n,
                gpus: self.pick_gpus(n, w.gpus_per_node),
            })
            .collect();
        for p in &parts {
            self.take(p.node, p.gpus);
        }
        Some(parts)
    }

    fn best_fit_single(&self, w: &Workload) -> Option<NodeIdx> {
        let need = w.gpus_per_node as usize;
        let mut best: Option<(usize, NodeIdx)> = None;
        for g in self.groups_for(w) {
            let buckets = &self.groups[g].buckets;
            if let Some(k) = (need..buckets.len()).find(|&k| !buckets[k].is_empty()) {
                let node = *buckets[k].last().expect("non-empty");
                if best.is_none_or(|(bk, _)| k < bk) {
                    best = Some((k, node));
                }
            }
        }
        best.map(|(_, n)| n)
    }

    /// Nodes of group `g` with at least `need` free GPUs, with their free count.
    fn candidates(&self, g: usize, need: usize) -> Vec<(usize, NodeIdx)> {
        let buckets = &self.groups[g].buckets;
        (need..buckets.len())
            .flat_map(|k| buckets[k].iter().map(move |&n| (k, n)))
            .collect()
    }

    /// Up to `count` nodes that are not withheld, of the model of `beside` (the nodes of a
    /// gang's victims), with room for `w` now: best fit first. A gang waiting for its victims
    /// holds these too, or later work takes them before the victims are gone.
    pub fn room_for(&self, w: &Workload, beside: &[NodeIdx], count: usize) -> Vec<NodeIdx> {
        let Some(&first) = beside.first() else {
            return Vec::new();
        };
        let group = self.model[first as usize] as usize;
        self.candidates(group, w.gpus_per_node as usize)
            .into_iter()
            .map(|(_, n)| n)
            .filter(|n| !beside.contains(n))
            .take(count)
            .collect()
    }

    fn count_fitting(&self, g: usize, need: usize) -> usize {
        let buckets = &self.groups[g].buckets;
        (need.min(buckets.len())..buckets.len())
            .map(|k| buckets[k].len())
            .sum()
    }

    /// A gang: `w.nodes` distinct nodes of one model with `w.gpus_per_node` free each, from as
    /// few racks as possible, best fit within them.
    fn choose_gang(&self, w: &Workload) -> Option<Vec<NodeIdx>> {
        let (need, n) = (w.gpus_per_node as usize, w.nodes as usize);
        let mut best: Option<(usize, Vec<NodeIdx>)> = None;
        for g in self.groups_for(w) {
            if self.count_fitting(g, need) < n {
                continue;
            }
            let chosen = self.by_topology(self.candidates(g, need), n);
            let racks = {
                let rack = self.racks();
                let mut r: Vec<u32> = chosen.iter().map(|&x| rack[x as usize]).collect();
                r.sort_unstable();
                r.dedup();
                r.len()
            };
            if best.as_ref().is_none_or(|(br, _)| racks < *br) {
                best = Some((racks, chosen));
            }
        }
        best.map(|(_, nodes)| nodes)
    }

    /// Picks `n` of the candidates: a rack that holds the whole gang with the least to spare,
    /// otherwise the fullest racks first; best fit inside a rack.
    fn by_topology(&self, mut cands: Vec<(usize, NodeIdx)>, n: usize) -> Vec<NodeIdx> {
        let rack = self.racks();
        let mut per_rack: FxHashMap<u32, usize> = FxHashMap::default();
        for &(_, node) in &cands {
            *per_rack.entry(rack[node as usize]).or_insert(0) += 1;
        }
        let mut racks: Vec<(u32, usize)> = per_rack.into_iter().collect();
        // Racks that fit the gang, smallest first; then the others, largest first.
        racks.sort_unstable_by_key(|&(rack, count)| {
            if count >= n {
                (0, count, rack)
            } else {
                (1, usize::MAX - count, rack)
            }
        });
        let order: FxHashMap<u32, usize> = racks
            .iter()
            .enumerate()
            .map(|(i, &(r, _))| (r, i))
            .collect();
        cands.sort_unstable_by_key(|&(k, node)| (order[&rack[node as usize]], k, node));
        cands.into_iter().take(n).map(|(_, node)| node).collect()
    }

    fn choose_withheld(&self, w: &Workload) -> Option<Vec<NodeIdx>> {
        if w.nodes != 1 {
            return None;
        }
        self.withheld_list
            .iter()
            .filter(|&&i| w.model.is_none_or(|m| m == self.model[i as usize]))
            .map(|&i| (self.free[i as usize].count_ones(), i))
            .filter(|&(k, _)| k >= w.gpus_per_node)
            .min()
            .map(|(_, n)| vec![n])
    }

    /// Whether `w` could be placed now, on nodes not withheld.
    pub fn fits(&self, w: &Workload) -> bool {
        self.groups_for(w)
            .any(|g| self.count_fitting(g, w.gpus_per_node as usize) >= w.nodes as usize)
    }

    /// If `w` would fit were withheld nodes open to it: for whom the first of them with room
    /// for it is withheld.
    pub fn withheld_holder(&self, w: &Workload) -> Option<WorkloadId> {
        self.groups_for(w).find_map(|g| {
            let mut withheld = self
                .withheld_list
                .iter()
                .zip(&self.withheld_for)
                .filter(|(&i, _)| {
                    self.model[i as usize] as usize == g
                        && self.free[i as usize].count_ones() >= w.gpus_per_node
                })
                .map(|(_, &holder)| holder);
            let holder = withheld.next()?;
            let count = 1 + withheld.count();
            (count + self.count_fitting(g, w.gpus_per_node as usize) >= w.nodes as usize)
                .then_some(holder)
        })
    }

    /// Indexed nodes that could host one member of `w` now.
    pub fn fitting_nodes(&self, w: &Workload) -> u32 {
        self.groups_for(w)
            .map(|g| self.count_fitting(g, w.gpus_per_node as usize))
            .sum::<usize>() as u32
    }

    /// Whether node `i` is indexed, of model group `group`, with enough healthy GPUs for one
    /// member of `w`.
    fn eligible(&self, w: &Workload, group: usize, i: NodeIdx) -> bool {
        !self.withheld.get(i as usize)
            && self.model[i as usize] as usize == group
            && self.healthy[i as usize].count_ones() >= w.gpus_per_node
    }

    /// The reservation for `w`: the nodes where it could start soonest, given when the holder of
    /// each held GPU gives it back (`release`, `u64::MAX` for unknown), and that start time if
    /// known. Reads the nodes only: what is known of each holder is kept beside its GPUs.
    ///
    /// With `only_leaving`, the caller knows that no held GPU has a known return unless its
    /// holder is leaving already or borrowed it (no running work has an estimate, and `w` may
    /// preempt none). Then every other full node is ready "never", and only the nodes with free
    /// GPUs, a workload leaving or a borrowed placement are timed; the rest rank by index. On a busy cluster the head of the
    /// queue holds the reservation because it may preempt nothing, so that is most reservations.
    /// With `nearest` the caller asks for those nodes whatever the other returns: a further
    /// reservation drains the nodes nearest to free now, at the cost of one look at each.
    #[allow(clippy::too_many_arguments)]
    pub fn reserve(
        &self,
        state: &State,
        w: &Workload,
        now_ms: u64,
        only_leaving: bool,
        nearest: bool,
        mut release: impl FnMut(&Tenant) -> u64,
    ) -> (Vec<NodeIdx>, Option<u64>) {
        let need = w.gpus_per_node;
        let n = w.nodes as usize;
        // (when, GPUs) per tenant of a node.
        let mut times: Vec<(u64, u32)> = Vec::with_capacity(64);
        // When eligible node `i` is ready for one member of `w`, by (ready at, most free GPUs,
        // index).
        let mut key_of = |i: NodeIdx| {
            let (free, healthy) = (self.free[i as usize], self.healthy[i as usize]);
            let free_count = free.count_ones();
            if free_count >= need {
                return (now_ms, Reverse(free_count), i);
            }
            // Free GPUs are ready now; the others when their holder leaves. GPUs placed earlier
            // in this pass have no holder yet: as far as this pass knows, never.
            let short = need - free_count;
            let nth = match state.cluster.nodes[i as usize].tenants.as_slice() {
                // Most often one workload holds the node.
                [t] if (t.gpus & healthy).count_ones() >= short => release(t),
                [_] | [] => u64::MAX,
                tenants => {
                    times.clear();
                    for t in tenants {
                        let gpus = (t.gpus & healthy).count_ones();
                        if gpus > 0 {
                            times.push((release(t), gpus));
                        }
                    }
                    times.sort_unstable();
                    let mut short = short;
                    times
                        .iter()
                        .find_map(|&(at, gpus)| {
                            if gpus >= short {
                                return Some(at);
                            }
                            short -= gpus;
                            None
                        })
                        .unwrap_or(u64::MAX)
                }
            };
            (nth, Reverse(free_count), i)
        };
        // A further reservation of one node drains a node with the most free GPUs, the soonest
        // of those by when their holders leave: one bucket of the free index is timed, not every
        // node with free GPUs (a pass may hold dozens of such reservations).
        if nearest && n == 1 {
            let mut best: Option<(u64, Reverse<u32>, NodeIdx)> = None;
            for group in self.groups_for(w) {
                let buckets = &self.groups[group].buckets;
                let top = (1..buckets.len())
                    .rev()
                    .find(|&k| buckets[k].iter().any(|&i| self.eligible(w, group, i)));
                for &i in top.map_or(&[][..], |k| &buckets[k][..]) {
                    if self.eligible(w, group, i) {
                        let key = key_of(i);
                        if best.is_none_or(|b| key < b) {
                            best = Some(key);
                        }
                    }
                }
            }
            if let Some((at, _, node)) = best {
                return (vec![node], Some(at).filter(|&t| t != u64::MAX));
            }
            // No free GPU anywhere: the nodes where work is leaving are timed, as below.
        }
        // Keeps the `n` soonest keys, in order.
        let keep = |soonest: &mut Vec<(u64, Reverse<u32>, NodeIdx)>, key| {
            if soonest.len() == n && soonest.last().is_some_and(|last| key >= *last) {
                return false;
            }
            let at = soonest.partition_point(|k| *k < key);
            soonest.insert(at, key);
            soonest.truncate(n);
            true
        };
        // Times those of `nodes` that could host a member into `soonest`; how many could. With
        // `only_leaving`, the nodes where no workload is leaving (sorted) are ready now or never:
        // their tenants need no look.
        let mut sweep = |group: usize,
                         nodes: &mut dyn Iterator<Item = NodeIdx>,
                         soonest: &mut Vec<(u64, Reverse<u32>, NodeIdx)>,
                         only_leaving: Option<&[NodeIdx]>| {
            let mut count = 0usize;
            for i in nodes.filter(|&i| self.eligible(w, group, i)) {
                count += 1;
                let key = match only_leaving {
                    Some(leaving) if leaving.binary_search(&i).is_err() => {
                        let free = self.free[i as usize].count_ones();
                        let at = if free >= need { now_ms } else { u64::MAX };
                        (at, Reverse(free), i)
                    }
                    _ => key_of(i),
                };
                keep(soonest, key);
            }
            count
        };
        // Nodes with a workload leaving or on borrowed GPUs, whatever their group.
        let leaving: Vec<NodeIdx> = if only_leaving || nearest {
            state.leaving_nodes.keys().copied().collect()
        } else {
            Vec::new()
        };
        let mut best: Option<(u64, Vec<NodeIdx>)> = None;
        let mut soonest: Vec<(u64, Reverse<u32>, NodeIdx)> = Vec::with_capacity(n + 1);
        for group in self.groups_for(w) {
            soonest.clear();
            let all = 0..self.free.len() as NodeIdx;
            let count = if only_leaving || nearest {
                // The nodes that may be ready at all: with free GPUs, or a workload leaving.
                let mut timed: Vec<NodeIdx> = self.groups[group]
                    .buckets
                    .iter()
                    .skip(1)
                    .flatten()
                    .chain(&leaving)
                    .copied()
                    .collect();
                timed.sort_unstable();
                timed.dedup();
                let mut count = sweep(
                    group,
                    &mut timed.iter().copied(),
                    &mut soonest,
                    only_leaving.then_some(&leaving[..]),
                );
                // Every other node is full and ready never: (never, no free GPU, index), in
                // index order, so the first that does not make the cut ends the search.
                for i in all.clone() {
                    if !self.eligible(w, group, i) || timed.binary_search(&i).is_ok() {
                        continue;
                    }
                    count += 1;
                    if !keep(&mut soonest, (u64::MAX, Reverse(0), i)) {
                        break; // `n` kept already
                    }
                }
                #[cfg(debug_assertions)]
                if only_leaving {
                    let mut swept = Vec::new();
                    let swept_count = sweep(group, &mut all.clone(), &mut swept, None);
                    assert_eq!(
                        (&swept, swept_count.min(n)),
                        (&soonest, count.min(n)),
                        "the reservation timing only the nodes that may be ready"
                    );
                }
                count
            } else {
                sweep(group, &mut all.clone(), &mut soonest, None)
            };
            if count < n {
                continue;
            }
            // In order, so the last is ready last.
            let start = soonest.last().map_or(u64::MAX, |c| c.0);
            if best.as_ref().is_none_or(|b| start < b.0) {
                best = Some((start, soonest.iter().map(|c| c.2).collect()));
            }
        }
        match best {
            Some((start, nodes)) => (nodes, Some(start).filter(|&t| t != u64::MAX)),
            None => (Vec::new(), None),
        }
    }

    /// Whether preempting the tenants `may_free` accepts on `victim_nodes` could make room for
    /// `w` at all: a cheap bound on [`Self::plan_preemption`] with the same `eligible` or a
    /// looser one (a gang counts the nodes with room already too).
    pub fn may_make_room(
        &self,
        state: &State,
        w: &Workload,
        victim_nodes: &[NodeIdx],
        mut may_free: impl FnMut(&Tenant) -> bool,
    ) -> bool {
        let need = w.gpus_per_node;
        self.groups_for(w).any(|group| {
            let mut count = victim_nodes
                .iter()
                .filter(|&&i| self.eligible(w, group, i))
                .filter(|&&i| {
                    let node = state.cluster.node(i);
                    let freed: u32 = node
                        .tenants
                        .iter()
                        .filter(|t| may_free(t))
                        .map(|t| (t.gpus & node.healthy).count_ones())
                        .sum();
                    self.free[i as usize].count_ones() + freed >= need
                })
                .count();
            if w.nodes > 1 {
                count += self.count_fitting(group, need as usize);
            }
            count >= w.nodes as usize
        })
    }

    /// Victims whose preemption makes room for `w` at least cost, and the nodes it would use.
    /// Only `victim_nodes` (nodes holding work that may be preemptible at all) and nodes with
    /// room to spare are looked at. `eligible` says whether a running workload, seen as a tenant
    /// of a node, may be preempted for `w`. The cost prefers unallocated victims, then the fewest
    /// GPU-milliseconds of work lost since checkpoints. The GPUs of `leaving` (work that gives
    /// them back by itself in time) count as freed at no cost, and `leaving` is no victim.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_preemption(
        &self,
        state: &State,
        w: &Workload,
        now_ms: u64,
        claimed: &FxHashSet<WorkloadId>,
        leaving: &FxHashSet<WorkloadId>,
        victim_nodes: &[NodeIdx],
        mut eligible: impl FnMut(&Tenant) -> bool,
    ) -> Result<(Vec<NodeIdx>, Vec<WorkloadId>), NoPlan> {
        let mut any_eligible = false;
        let need = w.gpus_per_node;
        let mut cost_of = |t: &Tenant| -> Option<Cost> {
            if !leaving.is_empty() && leaving.contains(&t.workload) {
                return Some((0, 0, 0));
            }
            if !eligible(t) || !claimed.is_empty() && claimed.contains(&t.workload) {
                return None;
            }
            let ran = now_ms.saturating_sub(t.started_at_ms);
            let lost = match t.checkpoint_ms {
                Some(c) if c > 0 => ran % c,
                _ => ran,
            };
            Some((
                u32::from(t.hold.allocation.is_some()),
                t.hold.preemptions,
                lost.saturating_mul(t.total_gpus),
            ))
        };
        let mut best: Option<(Cost, Vec<NodeIdx>, Vec<WorkloadId>)> = None;
        // Buffers kept across nodes and groups: a search visits every preemptible node.
        let mut holders: Vec<(Cost, WorkloadId, u32)> = Vec::new();
        let mut chosen: Vec<WorkloadId> = Vec::new();
        // Per node that could host `w`: (cost, node, its victims as a range of `chosen`).
        let mut options: Vec<(Cost, NodeIdx, std::ops::Range<usize>)> = Vec::new();
        for group in self.groups_for(w) {
            options.clear();
            chosen.clear();
            let mut nodes: Vec<NodeIdx> = victim_nodes
                .iter()
                .copied()
                .filter(|&i| self.eligible(w, group, i))
                .collect();
            if w.nodes > 1 {
                // A gang may combine victims' nodes with nodes that have room already.
                nodes.extend(
                    self.candidates(group, need as usize)
                        .into_iter()
                        .map(|(_, n)| n),
                );
                nodes.sort_unstable();
                nodes.dedup();
            }
            for i in nodes {
                let node = state.cluster.node(i);
                let mut have = self.free[i as usize].count_ones();
                if have >= need {
                    options.push(((0, 0, 0), i, 0..0));
                    continue;
                }
                // The holders on this node with the healthy GPUs each would free here.
                holders.clear();
                for t in &node.tenants {
                    let gpus = (t.gpus & node.healthy).count_ones();
                    if gpus == 0 {
                        continue;
                    }
                    if let Some(c) = cost_of(t) {
                        any_eligible = true;
                        holders.push((c, t.workload, gpus));
                    }
                }
                holders.sort_unstable();
                let mut cost = (0u32, 0u32, 0u64);
                let from = chosen.len();
                for &(c, h, gpus) in &holders {
                    if have >= need {
                        break;
                    }
                    have += gpus;
                    cost = (cost.0 + c.0, cost.1 + c.1, cost.2 + c.2);
                    if leaving.is_empty() || !leaving.contains(&h) {
                        chosen.push(h);
                    }
                }
                if have >= need {
                    options.push((cost, i, from..chosen.len()));
                } else {
                    chosen.truncate(from);
                }
            }
            if options.len() < w.nodes as usize {
                continue;
            }
            // The cheapest `nodes` options, in order (each node once, so the keys are distinct).
            let n = w.nodes as usize;
            if options.len() > n {
                options.select_nth_unstable_by_key(n - 1, |o| (o.0, o.1));
                options.truncate(n);
            }
            options.sort_unstable_by_key(|o| (o.0, o.1));
            let mut victims: Vec<WorkloadId> = options
                .iter()
                .flat_map(|o| chosen[o.2.clone()].iter().copied())
                .collect();
            if victims.is_empty() {
                continue; // it fits without preemption: not a case for this plan
            }
            victims.sort_unstable();
            victims.dedup();
            let cost = options.iter().fold((0, 0, 0), |acc, o| {
                (acc.0 + o.0 .0, acc.1 + o.0 .1, acc.2 + o.0 .2)
            });
            if best.as_ref().is_none_or(|b| cost < b.0) {
                best = Some((cost, options.iter().map(|o| o.1).collect(), victims));
            }
        }
        match best {
            Some((_, nodes, victims)) => Ok((nodes, victims)),
            None if any_eligible => Err(NoPlan::NotEnough),
            None => Err(NoPlan::NoVictims),
        }
    }
}
