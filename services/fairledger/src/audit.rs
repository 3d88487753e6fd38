//! The owed-versus-delivered audit of a folded ledger, as a table or JSON.

use ledger::metrics::{Counters, Metrics};
use ledger::State;
use serde_json::json;

const MS_PER_HOUR: f64 = 3_600_000.0;

/// Prints per-leaf owed and delivered GPU-hours and the cluster metrics since the beginning.
pub fn print(state: &State, title: &str, as_json: bool) {
    let m = Metrics::between(&Counters::default(), &state.counters);
    let leaves: Vec<_> = state
        .allocations
        .nodes
        .iter()
        .filter(|a| !a.removed && a.is_leaf())
        .map(|a| {
            (
                a.path.as_str(),
                a.weight,
                a.owed_gpu_ms / MS_PER_HOUR,
                a.delivered_gpu_ms as f64 / MS_PER_HOUR,
                a.preemptions,
            )
        })
        .collect();
    let owed: f64 = leaves.iter().map(|l| l.2).sum();
    let within: f64 = leaves.iter().map(|l| l.2.min(l.3)).sum();
    let fairness = if owed > 0.0 { within / owed } else { 1.0 };
    if as_json {
        let allocations: Vec<_> = leaves
            .iter()
            .map(|l| json!({"path": l.0, "weight": l.1, "owed_gpu_hours": l.2, "delivered_gpu_hours": l.3, "preemptions": l.4}))
            .collect();
        let report = json!({
            "title": title,
            "until_ms": state.now_ms,
            "allocations": allocations,
            "fairness": {"delivered_over_owed": fairness},
            "metrics": {"availability": m.availability, "occupancy": m.occupancy, "impact": m.impact, "utilization": m.utilization},
            "fragmentation": {"stranded_gpu_hours": m.stranded_gpu_hours, "largest_startable_gang_p50": m.largest_startable_gang_p50},
            "preemptions": m.preemptions,
            "contract_violations": m.contract_violations,
        });
        println!("{}", serde_json::to_string_pretty(&report).expect("json"));
        return;
    }
    println!(
        "{title}: {:.1} h of ledger time",
        state.now_ms as f64 / MS_PER_HOUR
    );
    println!(
        "{:<28} {:>6} {:>12} {:>12} {:>9} {:>8}",
        "ALLOCATION", "WEIGHT", "OWED GPU-H", "GOT GPU-H", "GOT/OWED", "PREEMPT"
    );
    for (path, weight, o, d, p) in &leaves {
        let ratio = if *o > 0.0 {
            format!("{:.3}", d / o)
        } else {
            "-".into()
        };
        println!("{path:<28} {weight:>6} {o:>12.1} {d:>12.1} {ratio:>9} {p:>8}");
    }
    println!(
        "delivered within owed / owed: {fairness:.3}   availability {:.3}  occupancy {:.3}  impact {:.3}  stranded {:.1} GPU-h  preemptions {}  contract violations {}",
        m.availability, m.occupancy, m.impact, m.stranded_gpu_hours, m.preemptions, m.contract_violations
    );
}
