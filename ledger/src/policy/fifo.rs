//! `fifo`: first submitted, first considered; a baseline that ignores allocations.

use super::rank::Ranking;
use super::Policy;

/// First in, first out.
pub struct Fifo;

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn ranking(&self) -> Ranking {
        Ranking::Flat(|_| 0)
    }
}
