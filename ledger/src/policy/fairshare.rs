//! `fairshare`, the default: hierarchical ranking by windowed delivered over owed.
//!
//! The key of an allocation is `(D + G·τ) / (O + o·τ)`: its windowed delivered GPU-time `D`
//! and owed GPU-time `O`, each extended by `τ` (the default minimum runtime) at its current
//! rate — `G` GPUs held, `o` GPUs owed now. It reads "the ratio τ from now if nothing changed".
//! Placing a workload adds to `G`, so the order updates within a pass, and an allocation owed
//! nothing yet has key 0 without a special case. Lower keys are more under-served and go first.

use super::rank::{Ranking, Usage};
use super::Policy;

/// The default policy.
pub struct FairShare;

impl Policy for FairShare {
    fn name(&self) -> &'static str {
        "fairshare"
    }

    fn ranking(&self) -> Ranking {
        Ranking::Tree
    }

    fn allocation_key(&self, me: &Usage, _siblings: &Usage, tau_ms: f64) -> f64 {
        let num = me.delivered_w + me.held * tau_ms;
        let den = me.owed_w + me.owed_now * tau_ms;
        if num <= 0.0 {
            0.0
        } else if den <= 0.0 {
            f64::MAX
        } else {
            num / den
        }
    }

    fn key_meaning(&self) -> Option<&'static str> {
        Some("GPU-hours delivered over GPU-hours owed in the usage window, as it would stand one minimum runtime from now; the lower goes first")
    }

    fn updates_in_pass(&self) -> bool {
        true
    }

    fn preempts_for_fair_share(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fairshare_key_is_the_ratio_tau_from_now() {
        let tau = 1000.0;
        // Delivered 3000 GPU-ms of 6000 owed, holding 2 GPUs while owed 4:
        // (3000 + 2·1000) / (6000 + 4·1000) = 0.5.
        let me = Usage {
            delivered_w: 3000.0,
            owed_w: 6000.0,
            held: 2.0,
            owed_now: 4.0,
            weight: 1.0,
        };
        assert_eq!(FairShare.allocation_key(&me, &me, tau), 0.5);
        // A newcomer with nothing delivered ranks first; one with usage but nothing owed, last.
        let newcomer = Usage {
            owed_now: 4.0,
            ..Usage::default()
        };
        assert_eq!(FairShare.allocation_key(&newcomer, &me, tau), 0.0);
        let squatter = Usage {
            held: 1.0,
            ..Usage::default()
        };
        assert_eq!(FairShare.allocation_key(&squatter, &me, tau), f64::MAX);
    }
}
