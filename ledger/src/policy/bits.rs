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
}

#[cfg(test)]
mod tests {
    use super::Bits;

    #[test]
    fn bits_are_set_alone() {
        let mut a = Bits::new(130);
        a.set(0);
        a.set(129);
        assert!(a.get(0) && a.get(129) && !a.get(1) && !a.get(64));
    }
}
