//! Who may be preempted for whom, within one pass: which allocations' work a beneficiary may
//! take (at the margin, doubled per earlier preemption of the victim and again for a reversal
//! within the window), the searches for victims (fair share, defragmentation, a lender taking
//! back what it lent) and what a pass remembers of them.

use std::ops::Bound;

use rustc_hash::{FxHashMap, FxHashSet};

use super::placement::{self, Scratch};
use super::{rank, Policy, PolicyConfig};
use crate::cluster::{Hold, Tenant};
use crate::event::WorkloadId;
use crate::state::{State, Workload};

/// What a pass knows about preemption: the running work that could be preempted at all (its
/// allocations, and its nodes once a search needs them), the searches left in its budget, the
/// searches that already failed, and the workloads already chosen as victims.
pub(super) struct VictimSearch {
    pub(super) nodes: Option<Vec<u32>>,
    pub(super) allocs: Vec<Option<u32>>,
    pub(super) left: u32,
    pub(super) no_victims: FxHashSet<Option<u32>>,
    pub(super) failed_shapes: FxHashSet<(Option<u32>, u32, u32)>,
    /// Every search that failed: what it might take (see [`takes`]), the model it was held to,
    /// GPUs per node and nodes.
    pub(super) failed: Vec<(Takes, Option<u32>, u32, u32)>,
    /// What each beneficiary allocation may take (see [`takes`]), with the ranking's version it
    /// was worked out at.
    pub(super) takes: FxHashMap<Option<u32>, (u64, Takes)>,
    pub(super) claimed: FxHashSet<WorkloadId>,
    /// Whether this pass has looked for a defragmentation ([`Self::defragment`]).
    pub(super) defragmented: bool,
    /// How long unallocated work preempted before is left alone ([`preemptible`]).
    pub(super) backoff: Backoff,
}

impl VictimSearch {
    /// Which allocations' work `beneficiary` may take now (see [`takes`]), remembered while the
    /// ranking's keys stay the same.
    fn takes_of(
        &mut self,
        state: &State,
        rank: &rank::Rank,
        policy: &dyn Policy,
        cfg: &PolicyConfig,
        beneficiary: Option<u32>,
    ) -> Takes {
        let version = rank.version();
        match self.takes.get(&beneficiary) {
            Some((v, bits)) if *v == version => bits.clone(),
            _ => {
                let mut may_take = may_take_from(state, rank, policy, cfg, beneficiary);
                let bits = takes(state, &mut may_take);
                self.takes.insert(beneficiary, (version, bits.clone()));
                bits
            }
        }
    }

    /// No search may succeed any more in this pass.
    pub(super) fn exhausted(&self) -> bool {
        self.left == 0 || self.allocs.is_empty()
    }

    /// Whether to look for victims for blocked `w`; each call spends one search of the budget.
    /// A search that already failed for `w`'s allocation (for want of any victim) or for its
    /// very shape would fail again and is skipped, as is one for an allocation that may take
    /// work from none of the allocations holding preemptible work. So is one that an earlier
    /// failure covers: within a pass room only shrinks (placements take free GPUs, nodes are
    /// withheld, victims claimed), so a search that may take from no more allocations, on no
    /// more models, for no fewer GPUs per node and no fewer nodes than one that failed, fails
    /// too. In a pass the queue is walked from the most under-served allocation, which may take
    /// from the most, so later searches are often covered.
    pub(super) fn worth_searching(
        &mut self,
        state: &State,
        rank: &rank::Rank,
        policy: &dyn Policy,
        cfg: &PolicyConfig,
        w: &Workload,
        only_unallocated: bool,
    ) -> bool {
        if self.left == 0 || w.allocation.is_none() || self.allocs.is_empty() {
            return false;
        }
        if only_unallocated {
            // Work without an allocation always yields: worth a look wherever some runs.
            if !self.allocs.contains(&None) {
                return false;
            }
            self.left -= 1;
            return true;
        }
        self.left -= 1;
        let mine = self.takes_of(state, rank, policy, cfg, w.allocation);
        if !self.no_victims.contains(&w.allocation)
            && !self.allocs.iter().any(|&va| mine.has(va, 0))
        {
            self.no_victims.insert(w.allocation);
        }
        let shape = (w.allocation, w.gpus_per_node, w.nodes);
        if self.no_victims.contains(&w.allocation) || self.failed_shapes.contains(&shape) {
            return false;
        }
        !self
            .failed
            .iter()
            .any(|(theirs, model, gpus_per_node, nodes)| {
                model.is_none_or(|m| w.model == Some(m))
                    && w.gpus_per_node >= *gpus_per_node
                    && w.nodes >= *nodes
                    && mine.is_subset_of(theirs)
            })
    }

    /// Victims whose preemption makes room for blocked `w`, and the nodes it would use, once
    /// [`Self::worth_searching`] said to look; with `only_unallocated`, among work without an
    /// allocation only.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn find(
        &mut self,
        state: &State,
        scratch: &Scratch,
        rank: &rank::Rank,
        policy: &dyn Policy,
        cfg: &PolicyConfig,
        w: &Workload,
        now_ms: u64,
        only_unallocated: bool,
    ) -> Option<(Vec<u32>, Vec<WorkloadId>)> {
        let mine = self.takes_of(state, rank, policy, cfg, w.allocation);
        let shape = (w.allocation, w.gpus_per_node, w.nodes);
        let backoff = self.backoff;
        let nodes = preemptible_nodes(&mut self.nodes, state, now_ms, backoff);
        // A borrowed run is taken by fair share like any other, past its contract: the borrowing's
        // term is its lender's alone (see `reclaim`).
        let found = scratch.plan_preemption(
            state,
            w,
            now_ms,
            &self.claimed,
            &FxHashSet::default(),
            nodes,
            |t| {
                preemptible(&t.hold, now_ms, backoff)
                    && (!only_unallocated || t.hold.allocation.is_none())
                    && mine.has(t.hold.allocation, t.hold.preemptions)
            },
        );
        match found {
            Ok((nodes, victims)) => {
                self.claimed.extend(victims.iter().copied());
                Some((nodes, victims))
            }
            // What a narrower search did not find, a wider one may: remember only wide ones.
            Err(_) if only_unallocated => None,
            Err(why) => {
                match why {
                    placement::NoPlan::NoVictims => self.no_victims.insert(w.allocation),
                    placement::NoPlan::NotEnough => self.failed_shapes.insert(shape),
                };
                self.failed.push((mine, w.model, w.gpus_per_node, w.nodes));
                None
            }
        }
    }

    /// Defragmentation for blocked single-node `w` of an under-served allocation: victims on one
    /// node whose preemption makes room for it, when the other nodes have free GPUs for each of
    /// them to start again at once. Victims: post-contract single-node work asking fewer GPUs
    /// than `w`, of allocations ranked above `w`'s (by any amount), or unallocated; never
    /// borrowed work. Capacity is not lost, only moved: stranded free GPUs are assembled into a
    /// node. Once a pass.
    pub(super) fn defragment(
        &mut self,
        state: &State,
        scratch: &Scratch,
        rank: &rank::Rank,
        w: &Workload,
        now_ms: u64,
    ) -> Option<(Vec<u32>, Vec<WorkloadId>)> {
        let leaf = w.allocation?;
        if self.defragmented || w.nodes != 1 || w.gpus_per_node < 2 || !rank.under_served(leaf) {
            return None;
        }
        let need = u64::from(w.gpus_per_node);
        if scratch.free_total() < need {
            return None;
        }
        self.defragmented = true;
        let backoff = self.backoff;
        let nodes = preemptible_nodes(&mut self.nodes, state, now_ms, backoff);
        let (nodes, victims) = scratch
            .plan_preemption(
                state,
                w,
                now_ms,
                &self.claimed,
                &FxHashSet::default(),
                nodes,
                |t| {
                    preemptible(&t.hold, now_ms, backoff)
                        && t.hold.borrowed.is_none()
                        && t.total_gpus < need
                        && u64::from(t.gpus.count_ones()) == t.total_gpus
                        && t.hold
                            .allocation
                            .is_none_or(|v| rank.outranks_by(state, leaf, v, 0.0))
                },
            )
            .ok()?;
        let node = *nodes.first()?;
        let mut sizes: Vec<u32> = victims
            .iter()
            .map(|v| state.workloads[v].gpus_per_node)
            .collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        if !scratch.could_rehome(node, &sizes) {
            return None;
        }
        self.claimed.extend(victims.iter().copied());
        Some((nodes, victims))
    }

    /// For blocked `w`, about to hold a reservation: victims that make room for it now on `due`,
    /// the nodes of the placements it lent whose term is over (those borrowers, and the work it
    /// may take anyway), and the nodes it would use (a gang's others with room already). Only
    /// the lender takes lent GPUs back, and only when that lets it start: another workload's
    /// borrowers are not its to take. Outside the budget of searches: once per holder, on the
    /// few nodes it lent.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reclaim(
        &mut self,
        state: &State,
        scratch: &Scratch,
        rank: &rank::Rank,
        policy: &dyn Policy,
        cfg: &PolicyConfig,
        w: &Workload,
        now_ms: u64,
        due: &[u32],
    ) -> Option<(Vec<u32>, Vec<WorkloadId>)> {
        let mine = self.takes_of(state, rank, policy, cfg, w.allocation);
        let backoff = self.backoff;
        // Work on those nodes that ends by its estimate before borrowers taken back now have
        // left: its GPUs count as freed, so the borrowers are taken back on the term, a grace
        // period before the reservation is due, and not only once that work has ended (a grace
        // period late). It is no victim.
        let soon = now_ms.saturating_add(cfg.grace_ms);
        let ending: FxHashSet<WorkloadId> = due
            .iter()
            .flat_map(|&n| &state.cluster.node(n).tenants)
            .filter(|t| {
                t.hold.grace_until_ms.is_none()
                    && t.hold.borrowed.is_none()
                    && t.hold.ends_ms.is_some_and(|end| end <= soon)
            })
            .map(|t| t.workload)
            .collect();
        let may_free = |t: &Tenant| {
            lent_due(&t.hold, w.id, now_ms)
                || ending.contains(&t.workload)
                || preemptible(&t.hold, now_ms, backoff)
                    && mine.has(t.hold.allocation, t.hold.preemptions)
        };
        // Most often nothing can come of it (a gang at the head, borrowers beside protected
        // work): a look at the due nodes' tenants says so before victims are priced.
        if !scratch.may_make_room(state, w, due, may_free) {
            debug_assert!(
                scratch
                    .plan_preemption(state, w, now_ms, &self.claimed, &ending, due, may_free)
                    .is_err(),
                "the bound said no room where victims would make some"
            );
            return None;
        }
        let (nodes, victims) = scratch
            .plan_preemption(state, w, now_ms, &self.claimed, &ending, due, may_free)
            .ok()?;
        self.claimed.extend(victims.iter().copied());
        Some((nodes, victims))
    }
}

/// The nodes holding work that could be preempted at all, gathered into `cache` the first time
/// a pass needs them.
fn preemptible_nodes<'a>(
    cache: &'a mut Option<Vec<u32>>,
    state: &State,
    now_ms: u64,
    backoff: Backoff,
) -> &'a [u32] {
    cache.get_or_insert_with(|| {
        (0..state.cluster.nodes.len() as u32)
            .filter(|&i| {
                state.cluster.nodes[i as usize]
                    .tenants
                    .iter()
                    .any(|t| preemptible(&t.hold, now_ms, backoff))
            })
            .collect()
    })
}

/// The nodes of the placements `lender`'s reservation lent whose term is over and that are not
/// leaving already.
pub(super) fn lent_due_nodes(state: &State, lender: WorkloadId, now_ms: u64) -> Vec<u32> {
    let mut nodes: Vec<u32> = state
        .lent
        .range((lender, 0, 0, WorkloadId::nil())..=(lender, now_ms, u32::MAX, WorkloadId::max()))
        .map(|&(_, _, node, _)| node)
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// The pending workloads `keep` accepts that lent GPUs whose term is over, not leaving already.
pub(super) fn due_lenders(
    state: &State,
    now_ms: u64,
    mut keep: impl FnMut(&Workload) -> bool,
) -> FxHashSet<WorkloadId> {
    let mut due = FxHashSet::default();
    let mut next = state.lent.first();
    // One look per lender: its first entry has its soonest term.
    while let Some(&(lender, until_ms, _, _)) = next {
        if until_ms <= now_ms
            && state
                .workloads
                .get(&lender)
                .is_some_and(|w| w.phase == crate::state::Phase::Pending && keep(w))
        {
            due.insert(lender);
        }
        let last = (lender, u64::MAX, u32::MAX, WorkloadId::max());
        next = state
            .lent
            .range((Bound::Excluded(last), Bound::Unbounded))
            .next();
    }
    due
}

/// On GPUs `lender`'s reservation lent, whose term is over, and not leaving already.
fn lent_due(h: &Hold, lender: WorkloadId, now_ms: u64) -> bool {
    h.grace_until_ms.is_none()
        && h.borrowed
            .is_some_and(|b| b.reserved_for == lender && b.until_ms <= now_ms)
}

/// How long work preempted before is left alone once it runs again: unallocated work for a
/// while, any work for a usage window past its contract once preempted
/// [`PolicyConfig::max_preemptions`] times.
#[derive(Clone, Copy, Debug)]
pub(super) struct Backoff {
    /// A grace period: after its first preemption, one; then two, four…
    pub(super) grace_ms: u64,
    /// At most this (the default contract).
    pub(super) cap_ms: u64,
    /// Preempted this often, work is left alone for [`Backoff::exempt_ms`] (0: no limit).
    pub(super) max_preemptions: u32,
    /// How long past its contract: the usage window.
    pub(super) exempt_ms: u64,
}

impl Backoff {
    pub(super) fn of(state: &State, cfg: &PolicyConfig) -> Backoff {
        Backoff {
            grace_ms: cfg.grace_ms,
            cap_ms: cfg.min_runtime_ms,
            max_preemptions: cfg.max_preemptions,
            exempt_ms: state.config().window_ms,
        }
    }
}

/// Whether work preempted `preemptions` times is left alone for a usage window past its
/// contract: at the limit (0: none).
pub(super) fn exempt(preemptions: u32, max_preemptions: u32) -> bool {
    max_preemptions > 0 && preemptions >= max_preemptions
}

/// Preemptible at all: not leaving already, and past its contract. Unallocated work has none
/// and yields at once the first time; preempted `n` times, it is left alone for 2ⁿ⁻¹ grace
/// periods after it starts again (up to the default contract): placed back on room made for
/// work that then could not start, it was otherwise taken again every grace period, for as
/// long as that work waited.
fn preemptible(h: &Hold, now_ms: u64, backoff: Backoff) -> bool {
    h.grace_until_ms.is_none() && now_ms >= left_alone_until(h, backoff)
}

/// Until when the holder described by `h` may not be preempted: the end of its contract, or
/// for unallocated work (whose contract ends as it starts) of the time it is left alone.
pub(super) fn left_alone_until(h: &Hold, backoff: Backoff) -> u64 {
    if exempt(h.preemptions, backoff.max_preemptions) {
        return h.protected_until_ms.saturating_add(backoff.exempt_ms);
    }
    match (h.allocation, h.preemptions) {
        (Some(_), _) | (None, 0) => h.protected_until_ms,
        (None, n) => h.protected_until_ms.saturating_add(
            backoff
                .grace_ms
                .saturating_mul(1 << (n - 1).min(16))
                .min(backoff.cap_ms),
        ),
    }
}

/// [`may_preempt_allocation`] for one beneficiary, asked once per victim allocation (the answer
/// is the same for all of its workloads preempted as often).
pub(super) fn may_take_from<'a>(
    state: &'a State,
    rank: &'a rank::Rank,
    policy: &'a dyn Policy,
    cfg: &'a PolicyConfig,
    beneficiary: Option<u32>,
) -> impl FnMut(Option<u32>) -> usize + 'a {
    // Indexed by allocation id plus one, 0 for unallocated work.
    let mut memo: Vec<Option<usize>> = vec![None; state.allocations.nodes.len() + 1];
    move |victim| {
        *memo[victim.map_or(0, |v| v as usize + 1)].get_or_insert_with(|| {
            may_preempt_allocation(state, rank, policy, cfg, beneficiary, victim)
        })
    }
}

/// The margin doubles with each time a victim was preempted, up to this many doublings less
/// one: work preempted `LEVELS - 1` times or more is taken only by a beneficiary ranked below
/// it by 2^(`LEVELS` - 1) times the margin.
const LEVELS: usize = 4;

/// The level at which a victim preempted `preemptions` times is weighed.
pub(super) fn level(preemptions: u32) -> usize {
    (preemptions as usize).min(LEVELS - 1)
}

/// What a beneficiary may take: for unallocated work (at 0) and each allocation `a` (at `a +
/// 1`), how many levels of its work: work preempted `j` times may be taken when `j` (at most
/// `LEVELS - 1`) is below it.
#[derive(Clone, Debug)]
pub(super) struct Takes(Vec<u8>);

impl Takes {
    /// Whether work of allocation `victim` preempted `preemptions` times may be taken.
    fn has(&self, victim: Option<u32>, preemptions: u32) -> bool {
        usize::from(self.0[victim.map_or(0, |v| v as usize + 1)]) > level(preemptions)
    }

    /// Whether everything this may take, the other may take too.
    fn is_subset_of(&self, other: &Takes) -> bool {
        self.0.iter().zip(&other.0).all(|(m, t)| m <= t)
    }
}

/// What `may_take` (levels per victim allocation) allows taking.
fn takes(state: &State, may_take: &mut impl FnMut(Option<u32>) -> usize) -> Takes {
    let n = state.allocations.nodes.len() as u32;
    Takes(
        std::iter::once(None)
            .chain((0..n).map(Some))
            .map(|victim| may_take(victim) as u8)
            .collect(),
    )
}

/// For how many levels (see [`Takes`]) work of allocation `beneficiary` may take post-contract
/// work of allocation `victim`: unallocated work always yields, at every level; otherwise the
/// policy must preempt for fair share and the victim's side must rank above by more than the
/// margin doubled once per time the victim was preempted, and once more when the victim's work
/// preempted the beneficiary's within [`PolicyConfig::reversal_window_ms`]. Unallocated work
/// takes nothing.
fn may_preempt_allocation(
    state: &State,
    rank: &rank::Rank,
    policy: &dyn Policy,
    cfg: &PolicyConfig,
    beneficiary: Option<u32>,
    victim: Option<u32>,
) -> usize {
    match (beneficiary, victim) {
        (None, _) => 0,
        (Some(_), None) => LEVELS,
        (Some(b), Some(v)) => {
            if !policy.preempts_for_fair_share() {
                return 0;
            }
            let Some(gap) = rank.gap(state, b, v).filter(|&gap| gap > cfg.margin) else {
                return 0;
            };
            let reverses = state
                .fair_share_last(v, b)
                .is_some_and(|t| rank.now_ms() < t.saturating_add(cfg.reversal_window_ms));
            let margin = if reverses {
                2.0 * cfg.margin
            } else {
                cfg.margin
            };
            (0..LEVELS)
                .take_while(|&j| gap > margin * f64::from(1u32 << j))
                .count()
        }
    }
}
