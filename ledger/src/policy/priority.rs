//! `priority`: highest workload priority first, then submission; a baseline that ignores
//! allocations.

use super::rank::Ranking;
use super::Policy;

/// Global priority order.
pub struct Priority;

impl Policy for Priority {
    fn name(&self) -> &'static str {
        "priority"
    }

    fn ranking(&self) -> Ranking {
        Ranking::Flat(|priority| -i64::from(priority))
    }
}
