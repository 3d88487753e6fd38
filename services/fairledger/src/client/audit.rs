//! `fairledger audit` and `audit head`: the kept figures per allocation and period, and the
//! log's head.

use super::*;

pub fn audit(
    args: &ClientArgs,
    allocation: Option<&str>,
    from: Option<&str>,
    to: Option<&str>,
    granularity: &str,
) -> Result<(), String> {
    if ledger::book::Granularity::parse(granularity).is_none() {
        return Err(format!(
            "--granularity {granularity:?}: use hour, day, week or month"
        ));
    }
    let mut path = format!("/v1/audit/ledger?granularity={granularity}");
    if let Some(a) = allocation {
        ledger::names::path(a).map_err(|r| format!("--allocation: {r}"))?;
        path += &format!("&allocation={a}");
    }
    // Times go as written: the server reads them (a span by its own clock) and names the flag
    // it cannot read.
    for (flag, value) in [("from", from), ("to", to)] {
        if let Some(v) = value {
            path += &format!(
                "&{}",
                form_urlencoded::Serializer::new(String::new())
                    .append_pair(flag, v)
                    .finish()
            );
        }
    }
    let v = Api::new(args)?.call("GET", &path, None)?;
    print(args, &v, |v| {
        let rows = v["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                let mut name = text(&r["allocation"]);
                if r["partial"] == true {
                    name += " (so far)";
                }
                vec![
                    name,
                    period_start(&r["from_ms"], granularity),
                    hours(&r["entitlement_gpu_hours"]),
                    hours(&r["owed_gpu_hours"]),
                    hours(&r["delivered_gpu_hours"]),
                    text(&r["preemptions"]),
                    hours(&r["preemption_costs"]["grace_gpu_hours"]),
                    hours(&r["preemption_costs"]["redone_gpu_hours"]),
                    text(&r["cancels"]),
                    text(&r["contract_violations"]),
                    text(&r["incarnation"]),
                ]
            })
            .collect();
        columns(
            &[
                "ALLOCATION",
                granularity_heading(granularity),
                "ENTITLED_GPU_H",
                "OWED_GPU_H",
                "DELIVERED_GPU_H",
                "PREEMPTIONS",
                "GRACE_GPU_H",
                "REDONE_GPU_H",
                "CANCELS",
                "VIOLATIONS",
                "INCARNATION",
            ],
            rows,
        )
    });
    Ok(())
}

/// `fairledger audit head`: the log's head as `SEQ:HASH`.
pub fn audit_head(args: &ClientArgs) -> Result<(), String> {
    let v = Api::new(args)?.call("GET", "/v1/audit/head", None)?;
    print(args, &v, |v| format!("{}:{}", v["seq"], text(&v["hash"])));
    Ok(())
}

/// The column heading of a period's start.
fn granularity_heading(granularity: &str) -> &'static str {
    match granularity {
        "hour" => "HOUR (UTC)",
        "week" => "WEEK OF",
        "month" => "MONTH",
        _ => "DAY",
    }
}

/// A period's start as people read it: `2026-11-01 08:00` for an hour, `2026-11` for a month,
/// the date otherwise.
fn period_start(ms: &serde_json::Value, granularity: &str) -> String {
    let Some(ms) = ms.as_u64() else {
        return "-".into();
    };
    let t = api::period::format_instant(ms);
    match granularity {
        "hour" => t.get(..16).unwrap_or(&t).replace('T', " "),
        "month" => t.get(..7).unwrap_or(&t).to_owned(),
        _ => t.get(..10).unwrap_or(&t).to_owned(),
    }
}
