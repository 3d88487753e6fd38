//! `fairtree`: Slurm's Fair Tree ranking, for comparison.
//!
//! At each level, siblings are ordered by *level fairshare* `S / U`: their normalized shares
//! `S = weight / Σ sibling weights` over their normalized usage `U = D / Σ sibling D`, where `D`
//! is windowed delivered GPU-time (Slurm decays usage; a sliding window plays that part here).
//! Higher level fairshare goes first, so the key is `U / S`, lower first. As in Slurm, usage
//! changes only with time: the order does not update within a pass.

use super::rank::{Ranking, Usage};
use super::Policy;

/// Slurm Fair Tree.
pub struct FairTree;

impl Policy for FairTree {
    fn name(&self) -> &'static str {
        "fairtree"
    }

    fn ranking(&self) -> Ranking {
        Ranking::Tree
    }

    fn allocation_key(&self, me: &Usage, siblings: &Usage, _tau_ms: f64) -> f64 {
        if siblings.delivered_w <= 0.0 || me.weight <= 0.0 {
            return 0.0;
        }
        let usage = me.delivered_w / siblings.delivered_w;
        let share = me.weight / siblings.weight;
        usage / share
    }

    fn key_meaning(&self) -> Option<&'static str> {
        Some("share of its siblings' usage in the window over share of their weight (Slurm's Fair Tree); the lower goes first")
    }

    fn preempts_for_fair_share(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fairtree_key_is_usage_share_over_weight_share() {
        // Two siblings, weights 1 and 3; usage 50/50. Shares 0.25 and 0.75:
        // keys 0.5/0.25 = 2 and 0.5/0.75 = 2/3, so the heavier one goes first.
        let a = Usage {
            delivered_w: 10.0,
            weight: 1.0,
            ..Usage::default()
        };
        let b = Usage {
            delivered_w: 10.0,
            weight: 3.0,
            ..Usage::default()
        };
        let sum = Usage {
            delivered_w: 20.0,
            weight: 4.0,
            ..Usage::default()
        };
        assert_eq!(FairTree.allocation_key(&a, &sum, 0.0), 2.0);
        assert!((FairTree.allocation_key(&b, &sum, 0.0) - 2.0 / 3.0).abs() < 1e-12);
    }
}
