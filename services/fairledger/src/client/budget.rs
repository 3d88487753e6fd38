//! `fairledger alloc show PATH`: one allocation's budget as a manager reads it — its share and
//! caps, what it is owed and holds now, owed against delivered over the usage window (what
//! orders its work in the queue) and since the start, what it is owed and has not yet had, and
//! the last week day by day.

use super::*;

pub fn show(args: &ClientArgs, path: &str) -> Result<(), String> {
    let api = Api::new(args)?;
    let tree = api.call("GET", "/v1/allocations", None)?;
    let row = tree["allocations"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["path"] == path)
        .cloned()
        .ok_or_else(|| format!("no allocation {path:?}; `fairledger alloc` lists them"))?;
    // The last 7 days by the server's clock.
    let usage = api.call("GET", "/v1/usage?from=7d", None)?;
    // Day by day: the hours' average GPUs held and owed by the leaves under the path.
    let under = |leaf: &str| leaf == path || leaf.starts_with(&format!("{path}/"));
    let mut days: std::collections::BTreeMap<String, (f64, f64)> = Default::default();
    for hour in usage["hours"].as_array().into_iter().flatten() {
        let span_h = hour["to_ms"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(hour["from_ms"].as_u64().unwrap_or(0)) as f64
            / 3.6e6;
        let sum = |key: &str| -> f64 {
            hour[key]
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(leaf, _)| under(leaf))
                .map(|(_, g)| g.as_f64().unwrap_or(0.0))
                .sum::<f64>()
                * span_h
        };
        let day = date_time(&hour["from_ms"])
            .chars()
            .take(10)
            .collect::<String>();
        let d = days.entry(day).or_default();
        d.0 += sum("owed_gpus");
        d.1 += sum("held_gpus");
    }
    let out = json!({"allocation": row, "key_meaning": tree["key_meaning"], "days": days.iter().map(|(day, (owed, delivered))| json!({
        "day": day, "owed_gpu_hours": owed, "delivered_gpu_hours": delivered,
    })).collect::<Vec<_>>()});
    print(args, &out, |v| {
        budget_text(&v["allocation"], v["key_meaning"].as_str(), &days)
    });
    Ok(())
}

fn budget_text(
    a: &Value,
    key_meaning: Option<&str>,
    days: &std::collections::BTreeMap<String, (f64, f64)>,
) -> String {
    let f = |k: &str| a[k].as_f64().unwrap_or(0.0);
    let limit = |k: &str, what: &str| a[k].as_u64().map(|n| format!("{n} {what}"));
    let limits: Vec<String> = [
        limit("max_gpus", "GPUs held"),
        limit("max_pending_workloads", "workloads waiting"),
        limit("max_pending_gpus", "GPUs waiting"),
    ]
    .into_iter()
    .flatten()
    .collect();
    let mut out = format!(
        "{}: weight {} ({:.1}% of the cluster by weight); {}\n",
        text(&a["path"]),
        text(&a["weight"]),
        100.0 * f("share"),
        if limits.is_empty() {
            "no caps or quotas".to_owned()
        } else {
            format!("at most {}", limits.join(", "))
        },
    );
    out += &format!(
        "now: owed {:.1} GPUs, holds {}, its work asks for {} ({} waiting, for {} GPUs)\n",
        f("owed_gpus_now"),
        text(&a["held_gpus"]),
        text(&a["demand_gpus"]),
        text(&a["pending_workloads"]),
        text(&a["pending_gpus"]),
    );
    let (owed, delivered) = (f("window_owed_gpu_hours"), f("window_delivered_gpu_hours"));
    out += &format!(
        "over the usage window: owed {owed:.2} GPU-h, delivered {delivered:.2} GPU-h{}\n",
        if owed > 0.0 {
            format!(
                " ({:.2} of owed): {}",
                delivered / owed,
                if f("owed_not_delivered_gpu_hours") > 0.0 {
                    format!("{:.2} GPU-h owed and not yet delivered; its work ranks ahead of allocations delivered more of what they are owed, and the gap closes as its work runs", f("owed_not_delivered_gpu_hours"))
                } else {
                    "delivered all it is owed; allocations delivered less rank ahead of it until their work catches up".to_owned()
                }
            )
        } else {
            String::new()
        }
    );
    if let (Some(now), Some(meaning)) = (a["key"].as_f64(), key_meaning) {
        let later = |k: &str| a[k].as_f64().map_or("-".to_owned(), |v| format!("{v:.3}"));
        out += &format!(
            "its key among its siblings: {now:.3} now, {} in an hour, {} in a day if nothing changes ({meaning})\n",
            later("key_in_1h"),
            later("key_in_24h"),
        );
    }
    out += &format!(
        "since the start: owed {:.2} GPU-h, delivered {:.2} GPU-h\n",
        f("owed_gpu_hours"),
        f("delivered_gpu_hours")
    );
    if !days.is_empty() {
        out += "\n";
        out += &columns(
            &[
                "DAY (UTC)",
                "OWED_GPU_H",
                "DELIVERED_GPU_H",
                "DELIVERED/OWED",
            ],
            days.iter()
                .map(|(day, (o, d))| {
                    vec![
                        day.clone(),
                        format!("{o:.2}"),
                        format!("{d:.2}"),
                        if *o > 0.0 {
                            format!("{:.2}", d / o)
                        } else {
                            "-".into()
                        },
                    ]
                })
                .collect(),
        );
    }
    out
}
