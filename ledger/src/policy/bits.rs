//! A fixed set of bits, one per node or per allocation, for what a pass marks.

/// Bits `0..n`, all clear at first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bits(Vec<u64>);

impl Bits {
    /// `n` clear bits.
    pub fn new(n: usize) -> Self {
        Bits(vec![0; n.div_ceil(64)])
    }

    /// Whether bit `i` is set.
    pub fn get(&self, i: usize) -> bool {
        self.0[i / 64] >> (i % 64) & 1 == 1
    }

    /// Sets bit `i`.
    pub fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }

    /// Whether every bit set here is set in `other` (of the same length) too.
    pub fn is_subset_of(&self, other: &Bits) -> bool {
        self.0.iter().zip(&other.0).all(|(m, t)| m & !t == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::Bits;

    #[test]
    fn bits_are_set_alone_and_compare_as_sets() {
        let mut a = Bits::new(130);
        a.set(0);
        a.set(129);
        assert!(a.get(0) && a.get(129) && !a.get(1) && !a.get(64));
        let mut b = a.clone();
        b.set(64);
        assert!(a.is_subset_of(&b));
        assert!(!b.is_subset_of(&a));
    }
}
