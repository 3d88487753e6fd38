//! The four cluster metrics and the fragmentation figures, for any period.
//!
//! The fold keeps running integrals ([`Counters`]) of the quantities the metrics are ratios of.
//! The metrics of a period `[a, b]` are computed from the difference of the counters read at `a`
//! and at `b` ([`Metrics::between`]), so any period costs the same, with no sampling.
//!
//! - *availability* = healthy GPU-hours / installed GPU-hours;
//! - *occupancy* = allocated (held, healthy) GPU-hours / healthy GPU-hours;
//! - *impact* = GPU-hours delivered within the owed share / allocated GPU-hours;
//! - *utilization* = mean reported utilization of allocated GPUs;
//! - *stranded* GPU-hours: free healthy GPUs on nodes that also run work;
//! - *largest startable gang*: the time-weighted distribution of the most GPUs one workload could
//!   have started with, without preemption.

use std::collections::BTreeMap;

use crate::cluster::Cluster;

/// Nearest-rank percentile `p` (0 to 1) of sorted values.
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// Running integrals since the ledger began.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Counters {
    /// Installed GPU-milliseconds.
    pub total_gpu_ms: u64,
    /// Healthy GPU-milliseconds.
    pub healthy_gpu_ms: u64,
    /// Healthy held GPU-milliseconds (allocated and unallocated work).
    pub allocated_gpu_ms: u64,
    /// GPU-milliseconds delivered to allocations within their owed share.
    pub within_share_gpu_ms: f64,
    /// Healthy GPU-milliseconds held by unallocated work.
    pub unallocated_delivered_gpu_ms: u64,
    /// Utilization percent integrated over allocated GPU-milliseconds.
    pub utilization_pct_gpu_ms: u64,
    /// Stranded GPU-milliseconds.
    pub stranded_gpu_ms: u64,
    /// Milliseconds spent with each value of the largest startable gang (GPUs).
    pub largest_gang_ms: BTreeMap<u64, u64>,
    /// Preemptions requested (a cancel by the owner is not one).
    pub preemptions: u64,
    /// Running workloads stopped because their owner cancelled them.
    pub cancels: u64,
    /// Contract violations.
    pub contract_violations: u64,
}

impl Counters {
    /// Adds `dt_ms` of the cluster as it is now.
    pub(crate) fn integrate(&mut self, c: &Cluster, dt_ms: u64) {
        self.total_gpu_ms += c.total_gpus * dt_ms;
        self.healthy_gpu_ms += c.healthy_gpus * dt_ms;
        self.allocated_gpu_ms += c.allocated_gpus * dt_ms;
        self.utilization_pct_gpu_ms += c.utilization_sum_pct * dt_ms;
        self.stranded_gpu_ms += c.stranded_gpus() * dt_ms;
        *self
            .largest_gang_ms
            .entry(c.largest_startable_gang())
            .or_insert(0) += dt_ms;
    }
}

impl Counters {
    /// What accrued from the reading `start` to this one.
    pub fn since(&self, start: &Counters) -> Counters {
        Counters {
            total_gpu_ms: self.total_gpu_ms - start.total_gpu_ms,
            healthy_gpu_ms: self.healthy_gpu_ms - start.healthy_gpu_ms,
            allocated_gpu_ms: self.allocated_gpu_ms - start.allocated_gpu_ms,
            within_share_gpu_ms: self.within_share_gpu_ms - start.within_share_gpu_ms,
            unallocated_delivered_gpu_ms: self.unallocated_delivered_gpu_ms
                - start.unallocated_delivered_gpu_ms,
            utilization_pct_gpu_ms: self.utilization_pct_gpu_ms - start.utilization_pct_gpu_ms,
            stranded_gpu_ms: self.stranded_gpu_ms - start.stranded_gpu_ms,
            largest_gang_ms: self
                .largest_gang_ms
                .iter()
                .map(|(&g, &ms)| (g, ms - start.largest_gang_ms.get(&g).copied().unwrap_or(0)))
                .filter(|&(_, ms)| ms > 0)
                .collect(),
            preemptions: self.preemptions - start.preemptions,
            cancels: self.cancels - start.cancels,
            contract_violations: self.contract_violations - start.contract_violations,
        }
    }

    /// Adds what accrued in a following period.
    pub fn add(&mut self, other: &Counters) {
        self.total_gpu_ms += other.total_gpu_ms;
        self.healthy_gpu_ms += other.healthy_gpu_ms;
        self.allocated_gpu_ms += other.allocated_gpu_ms;
        self.within_share_gpu_ms += other.within_share_gpu_ms;
        self.unallocated_delivered_gpu_ms += other.unallocated_delivered_gpu_ms;
        self.utilization_pct_gpu_ms += other.utilization_pct_gpu_ms;
        self.stranded_gpu_ms += other.stranded_gpu_ms;
        for (&g, &ms) in &other.largest_gang_ms {
            *self.largest_gang_ms.entry(g).or_insert(0) += ms;
        }
        self.preemptions += other.preemptions;
        self.cancels += other.cancels;
        self.contract_violations += other.contract_violations;
    }
}

/// The metrics of one period.
#[derive(Clone, Debug, PartialEq)]
pub struct Metrics {
    /// Healthy / installed.
    pub availability: f64,
    /// Allocated / healthy.
    pub occupancy: f64,
    /// Delivered within owed share / allocated.
    pub impact: f64,
    /// Mean utilization of allocated GPUs, 0 to 1.
    pub utilization: f64,
    /// Stranded GPU-hours.
    pub stranded_gpu_hours: f64,
    /// Median over time of the largest startable gang.
    pub largest_startable_gang_p50: u64,
    /// Preemptions in the period.
    pub preemptions: u64,
    /// Running workloads cancelled by their owners in the period.
    pub cancels: u64,
    /// Contract violations in the period.
    pub contract_violations: u64,
}

const MS_PER_HOUR: f64 = 3_600_000.0;

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

impl Metrics {
    /// Metrics of the period between two readings of the counters (`start` earlier).
    pub fn between(start: &Counters, end: &Counters) -> Metrics {
        let d = |e: u64, s: u64| e.saturating_sub(s) as f64;
        let total = d(end.total_gpu_ms, start.total_gpu_ms);
        let healthy = d(end.healthy_gpu_ms, start.healthy_gpu_ms);
        let allocated = d(end.allocated_gpu_ms, start.allocated_gpu_ms);
        let within = end.within_share_gpu_ms - start.within_share_gpu_ms;
        let util = d(end.utilization_pct_gpu_ms, start.utilization_pct_gpu_ms);
        let mut gang: Vec<(u64, u64)> = end
            .largest_gang_ms
            .iter()
            .map(|(&g, &ms)| (g, ms - start.largest_gang_ms.get(&g).copied().unwrap_or(0)))
            .filter(|&(_, ms)| ms > 0)
            .collect();
        gang.sort_unstable();
        let half = gang.iter().map(|&(_, ms)| ms).sum::<u64>().div_ceil(2);
        let mut seen = 0;
        let p50 = gang
            .iter()
            .find(|&&(_, ms)| {
                seen += ms;
                seen >= half
            })
            .map_or(0, |&(g, _)| g);
        Metrics {
            availability: ratio(healthy, total),
            occupancy: ratio(allocated, healthy),
            impact: ratio(within, allocated),
            utilization: ratio(util / 100.0, allocated),
            stranded_gpu_hours: d(end.stranded_gpu_ms, start.stranded_gpu_ms) / MS_PER_HOUR,
            largest_startable_gang_p50: p50,
            preemptions: end.preemptions - start.preemptions,
            cancels: end.cancels - start.cancels,
            contract_violations: end.contract_violations - start.contract_violations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=10).collect();
        assert_eq!(percentile(&v, 0.5), Some(5));
        assert_eq!(percentile(&v, 0.9), Some(9));
        assert_eq!(percentile(&v, 0.99), Some(10));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
