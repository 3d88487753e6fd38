//! Windowed usage: GPU-time in fixed time buckets over a sliding lookback.
//!
//! A *window* keeps the last `bucket_count` buckets of `bucket_ms` each, in a ring. Adding an
//! amount spread over an interval splits it exactly across the buckets it covers; a query sums
//! the buckets still inside the lookback, so it costs O(buckets) whatever the number of events.
//! The window seen at time `t` is the buckets whose index lies in `(t/bucket_ms - bucket_count,
//! t/bucket_ms]`: the lookback, rounded out to whole buckets. Sums add the buckets oldest first;
//! the sum of all but the newest is kept as the buckets change, so a query in the newest bucket
//! (a scheduling pass asks every leaf, every pass) costs one addition.

/// Shape of every window in a ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WindowShape {
    /// Width of one bucket.
    pub bucket_ms: u64,
    /// Buckets kept.
    pub bucket_count: u32,
}

impl WindowShape {
    /// Splits `window_ms` into `bucket_count` buckets (at least one millisecond each).
    pub fn new(window_ms: u64, bucket_count: u32) -> Self {
        let bucket_count = bucket_count.max(1);
        WindowShape {
            bucket_ms: (window_ms / u64::from(bucket_count)).max(1),
            bucket_count,
        }
    }

    /// Index of the bucket holding instant `t_ms`.
    pub fn bucket_of(&self, t_ms: u64) -> u64 {
        t_ms / self.bucket_ms
    }
}

/// Delivered and owed GPU-milliseconds of one allocation, bucketed.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Window {
    /// Absolute index of the newest bucket written; older slots hold `newest - k`.
    newest: u64,
    delivered: Vec<f64>,
    owed: Vec<f64>,
    /// The sums of the buckets before the newest that a window ending in the newest bucket
    /// sees, oldest first.
    closed: WindowSums,
}

/// Sums over a window.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WindowSums {
    /// Delivered GPU-milliseconds.
    pub delivered_gpu_ms: f64,
    /// Owed GPU-milliseconds.
    pub owed_gpu_ms: f64,
}

impl Window {
    /// An empty window.
    pub fn new(shape: WindowShape) -> Self {
        let n = shape.bucket_count as usize;
        Window {
            newest: 0,
            delivered: vec![0.0; n],
            owed: vec![0.0; n],
            closed: WindowSums::default(),
        }
    }

    /// Adds constant rates (GPUs) held over `[from_ms, to_ms)`.
    pub fn add(&mut self, shape: WindowShape, from_ms: u64, to_ms: u64, delivered: f64, owed: f64) {
        if to_ms <= from_ms || (delivered == 0.0 && owed == 0.0) {
            return;
        }
        let n = u64::from(shape.bucket_count);
        let last = shape.bucket_of(to_ms - 1);
        // Only the newest `n` buckets of the interval can still be in any window.
        let first = shape.bucket_of(from_ms).max(last.saturating_sub(n - 1));
        self.roll_to(shape, last);
        for b in first..=last {
            let lo = (b * shape.bucket_ms).max(from_ms);
            let hi = ((b + 1) * shape.bucket_ms).min(to_ms);
            let dt = (hi - lo) as f64;
            let slot = (b % n) as usize;
            self.delivered[slot] += delivered * dt;
            self.owed[slot] += owed * dt;
        }
        if first < self.newest {
            self.close(shape);
        }
    }

    /// Adds amounts (GPU-milliseconds) to one bucket: the fast path of [`Window::add`] when an
    /// interval lies inside one bucket. `slot` is `bucket % bucket_count`.
    pub fn add_to_bucket(
        &mut self,
        shape: WindowShape,
        bucket: u64,
        slot: usize,
        delivered_gpu_ms: f64,
        owed_gpu_ms: f64,
    ) {
        self.roll_to(shape, bucket);
        if bucket + u64::from(shape.bucket_count) > self.newest {
            self.delivered[slot] += delivered_gpu_ms;
            self.owed[slot] += owed_gpu_ms;
            if bucket < self.newest {
                self.close(shape);
            }
        }
    }

    /// Makes `bucket` the newest, clearing the slots of buckets that fell out.
    fn roll_to(&mut self, shape: WindowShape, bucket: u64) {
        if bucket <= self.newest {
            return;
        }
        let n = u64::from(shape.bucket_count);
        let cleared = (bucket - self.newest).min(n);
        for k in 0..cleared {
            let slot = ((bucket - k) % n) as usize;
            self.delivered[slot] = 0.0;
            self.owed[slot] = 0.0;
        }
        self.newest = bucket;
        self.close(shape);
    }

    /// Sums the slots of buckets `from..=to` that are still kept, oldest first.
    fn sum_range(&self, shape: WindowShape, from: u64, to: u64) -> WindowSums {
        let n = u64::from(shape.bucket_count);
        let mut sums = WindowSums::default();
        let mut slot = (from % n) as usize;
        for _ in from..=to {
            sums.delivered_gpu_ms += self.delivered[slot];
            sums.owed_gpu_ms += self.owed[slot];
            slot += 1;
            if slot == n as usize {
                slot = 0;
            }
        }
        sums
    }

    /// Recomputes [`Window::closed`] after a bucket before the newest changed.
    fn close(&mut self, shape: WindowShape) {
        let oldest = self
            .newest
            .saturating_sub(u64::from(shape.bucket_count) - 1);
        self.closed = if oldest < self.newest {
            self.sum_range(shape, oldest, self.newest - 1)
        } else {
            WindowSums::default()
        };
    }

    /// Sums of the buckets inside the lookback that ends at `now_ms`, oldest first (the order
    /// of the additions is part of the result). One addition when `now_ms` lies in the newest
    /// bucket, O(buckets) otherwise.
    pub fn sums(&self, shape: WindowShape, now_ms: u64) -> WindowSums {
        let n = u64::from(shape.bucket_count);
        let now_b = shape.bucket_of(now_ms);
        if now_b == self.newest {
            let slot = (self.newest % n) as usize;
            return WindowSums {
                delivered_gpu_ms: self.closed.delivered_gpu_ms + self.delivered[slot],
                owed_gpu_ms: self.closed.owed_gpu_ms + self.owed[slot],
            };
        }
        let oldest_kept = now_b
            .saturating_sub(n - 1)
            .max(self.newest.saturating_sub(n - 1));
        if self.newest < oldest_kept {
            return WindowSums::default();
        }
        self.sum_range(shape, oldest_kept, self.newest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_splits_an_interval_exactly_across_buckets() {
        // Buckets of 10 ms, 4 kept. 2 GPUs over [5, 25): 10 GPU-ms in bucket 0, 20 in 1, 10 in 2.
        let shape = WindowShape::new(40, 4);
        let mut w = Window::new(shape);
        w.add(shape, 5, 25, 2.0, 1.0);
        assert_eq!(w.sums(shape, 25).delivered_gpu_ms, 40.0);
        assert_eq!(w.sums(shape, 25).owed_gpu_ms, 20.0);
        // At t=40 (bucket 4) the window is buckets 1..=4: bucket 0's 10 GPU-ms fell out.
        assert_eq!(w.sums(shape, 40).delivered_gpu_ms, 30.0);
        // At t=65 (bucket 6) only buckets 3..=6 count: nothing.
        assert_eq!(w.sums(shape, 65).delivered_gpu_ms, 0.0);
    }

    #[test]
    fn window_forgets_slots_reused_after_a_long_gap() {
        let shape = WindowShape::new(40, 4);
        let mut w = Window::new(shape);
        w.add(shape, 0, 10, 1.0, 0.0); // bucket 0: 10
        w.add(shape, 40, 50, 3.0, 0.0); // bucket 4 reuses slot 0: 30, old 10 cleared
        assert_eq!(w.sums(shape, 45).delivered_gpu_ms, 30.0);
        // A very long interval only keeps its last four buckets (96..=99): 1 GPU x 40 ms.
        w.add(shape, 50, 1_000, 1.0, 0.0);
        assert_eq!(w.sums(shape, 999).delivered_gpu_ms, 40.0);
        // At 1000 bucket 100 opens and bucket 96 leaves the window.
        assert_eq!(w.sums(shape, 1_000).delivered_gpu_ms, 30.0);
    }

    proptest::proptest! {
        /// The kept sum of the closed buckets gives what adding every bucket in the lookback,
        /// oldest first, gives: to the bit.
        #[test]
        fn window_sums_match_a_recount(
            adds in proptest::collection::vec((0u64..200, 0u64..60, 0.0f64..8.0, 0.0f64..8.0, proptest::bool::ANY), 1..40),
            ask in 0u64..60,
        ) {
            let shape = WindowShape::new(40, 4);
            let mut w = Window::new(shape);
            let mut t = 0;
            for (gap, len, d, o, one_bucket) in adds {
                t += gap;
                if one_bucket {
                    let b = shape.bucket_of(t);
                    w.add_to_bucket(shape, b, (b % 4) as usize, d, o);
                } else {
                    w.add(shape, t, t + len, d, o);
                    t += len;
                }
                for now in [t, t + ask] {
                    let now_b = shape.bucket_of(now);
                    let mut recount = WindowSums::default();
                    for b in now_b.saturating_sub(3)..=now_b {
                        if b <= w.newest && b + 4 > w.newest {
                            recount.delivered_gpu_ms += w.delivered[(b % 4) as usize];
                            recount.owed_gpu_ms += w.owed[(b % 4) as usize];
                        }
                    }
                    proptest::prop_assert_eq!(w.sums(shape, now), recount, "at {}", now);
                }
            }
        }
    }

    #[test]
    fn window_one_bucket_fast_path_matches_the_general_add() {
        let shape = WindowShape::new(40, 4);
        let (mut general, mut fast) = (Window::new(shape), Window::new(shape));
        for (from, to) in [(0, 3), (3, 9), (12, 19), (21, 22), (55, 58)] {
            general.add(shape, from, to, 2.0, 0.5);
            let b = shape.bucket_of(from);
            let dt = (to - from) as f64;
            fast.add_to_bucket(shape, b, (b % 4) as usize, 2.0 * dt, 0.5 * dt);
            assert_eq!(general, fast, "after [{from}, {to})");
        }
    }
}
