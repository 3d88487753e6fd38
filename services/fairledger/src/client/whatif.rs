//! `fairledger whatif`: changes read from the flags, answered by the server or offline from
//! the log.

use super::*;

/// What `fairledger whatif` tries.
#[derive(clap::Args, Clone, Debug)]
pub struct WhatIfArgs {
    /// Set (or create) an allocation: `PATH:weight=W[,max_gpus=N]` (repeat for more).
    #[arg(long = "set", value_name = "PATH:weight=W")]
    pub set: Vec<String>,
    /// Remove an allocation (repeat for more).
    #[arg(long = "remove-allocation", value_name = "PATH")]
    pub remove_allocation: Vec<String>,
    /// Change the policy: `name=fifo,margin=0.2,min_runtime=2h,grace=5m,reservations_max=4,defragment=true`.
    #[arg(long)]
    pub policy: Option<String>,
    /// Add nodes: `count=2,gpus=8,model=H100[,rack=r9]` (other keys are labels).
    #[arg(long = "add-nodes")]
    pub add_nodes: Option<String>,
    /// Drain a node: no new work there (repeat for more).
    #[arg(long = "remove-node", value_name = "NODE")]
    pub remove_node: Vec<String>,
    /// Fail a GPU: `NODE:GPU` (repeat for more).
    #[arg(long = "fail-gpu", value_name = "NODE:GPU")]
    pub fail_gpu: Vec<String>,
    /// How far to look ahead: `48h`, `2d`, `3600`.
    #[arg(long, default_value = "24h", value_parser = seconds)]
    pub horizon: u64,
    /// New submissions meanwhile: `none`, or `recent` (like the last usage window's).
    #[arg(long, default_value = "none")]
    pub arrivals: String,
    /// Seed of the resampled arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Offline, without a server: fold the log up to this sequence (a server's answer names it
    /// as `forked_at_seq`) and answer as the server would have there. The log is --data's (or
    /// --nats'); stop a server on the embedded log first.
    #[arg(long, value_name = "SEQ")]
    pub at_seq: Option<u64>,
    /// With --at-seq: the cluster's settings, as `serve --config` takes them.
    #[arg(long, requires = "at_seq")]
    pub config: Option<PathBuf>,
    /// Also write the comparison as a self-contained page.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    #[command(flatten)]
    pub log: crate::common::LogArgs,
}

/// `k=v,k=v` as pairs; `what` names the flag for the error.
fn pairs(text: &str, what: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .ok_or_else(|| format!("{what}: {p:?} is not key=value"))
        })
        .collect()
}

/// The changes the flags ask for, as the API takes them.
fn changes(w: &WhatIfArgs) -> Result<Vec<Value>, String> {
    let number = |what: &str, v: &str| -> Result<Value, String> {
        v.parse::<u64>()
            .map(Value::from)
            .map_err(|_| format!("{what}: {v:?} is not a whole number"))
    };
    let mut out = Vec::new();
    for s in &w.set {
        let (path, rest) = s
            .split_once(':')
            .ok_or_else(|| format!("--set {s:?}: write PATH:weight=W[,max_gpus=N]"))?;
        let mut change = json!({"allocation": path});
        for (k, v) in pairs(rest, "--set")? {
            match k.as_str() {
                "weight" | "max_gpus" => change[k.as_str()] = number("--set", &v)?,
                other => return Err(format!("--set: {other:?} is not weight or max_gpus")),
            }
        }
        if change.get("weight").is_none() {
            return Err(format!("--set {s:?}: give weight=W"));
        }
        out.push(change);
    }
    for path in &w.remove_allocation {
        out.push(json!({"remove_allocation": path}));
    }
    if let Some(p) = &w.policy {
        let mut policy = json!({});
        for (k, v) in pairs(p, "--policy")? {
            match k.as_str() {
                "name" => policy["name"] = json!(v),
                "margin" => {
                    policy["margin"] = json!(v
                        .parse::<f64>()
                        .map_err(|_| format!("--policy: margin {v:?} is not a number"))?)
                }
                "min_runtime" | "grace" => {
                    policy[format!("{k}_s")] = json!(seconds(&v).map_err(|e| format!("--policy: {e}"))?)
                }
                "reservations_max" => policy[k.as_str()] = number("--policy", &v)?,
                "defragment" => {
                    policy["defragment"] = json!(v.parse::<bool>().map_err(|_| format!(
                        "--policy: defragment {v:?} is not true or false"
                    ))?)
                }
                other => {
                    return Err(format!(
                        "--policy: {other:?} is not name, margin, min_runtime, grace, reservations_max or defragment"
                    ))
                }
            }
        }
        out.push(json!({ "policy": policy }));
    }
    if let Some(n) = &w.add_nodes {
        let mut nodes = json!({"labels": {}});
        for (k, v) in pairs(n, "--add-nodes")? {
            match k.as_str() {
                "count" | "gpus" => nodes[k.as_str()] = number("--add-nodes", &v)?,
                "model" => nodes["model"] = json!(v),
                label => nodes["labels"][label] = json!(v),
            }
        }
        out.push(json!({ "add_nodes": nodes }));
    }
    if !w.remove_node.is_empty() {
        out.push(json!({"remove_nodes": w.remove_node}));
    }
    if !w.fail_gpu.is_empty() {
        let gpus = w
            .fail_gpu
            .iter()
            .map(|g| {
                let (node, gpu) = g
                    .rsplit_once(':')
                    .ok_or_else(|| format!("--fail-gpu {g:?}: write NODE:GPU"))?;
                Ok(json!({"node": node, "gpu": number("--fail-gpu", gpu)?}))
            })
            .collect::<Result<Vec<_>, String>>()?;
        out.push(json!({ "fail_gpus": gpus }));
    }
    Ok(out)
}

pub fn what_if(args: &ClientArgs, w: &WhatIfArgs) -> Result<(), String> {
    let body = json!({
        "changes": changes(w)?,
        "horizon_s": w.horizon,
        "arrivals": w.arrivals,
        "seed": w.seed,
    });
    let v = match w.at_seq {
        Some(seq) => crate::logcmd::what_if_at(&w.log, w.config.as_deref(), seq, &body)?,
        None => Api::new(args)?.call("POST", "/v1/whatif", Some(&body))?,
    };
    if let Some(path) = &w.html {
        let answer: ledger::whatif::Answer = serde_json::from_value(v.clone())
            .map_err(|e| format!("the answer is not a what-if's: {e}"))?;
        let title = api::routes::whatif::describe(
            body["changes"].as_array().map_or(&[][..], Vec::as_slice),
        );
        let page = sim::html::what_if(&answer, &title).map_err(|e| e.to_string())?;
        std::fs::write(path, page).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        eprintln!("comparison: {}", path.display());
    }
    print_comparison(args, &v);
    Ok(())
}

/// What `changes` would do over the next `horizon_s`, asked of the server and printed side by
/// side with the baseline: the preview of a change before it is made.
pub(super) fn preview(
    args: &ClientArgs,
    changes: Vec<Value>,
    horizon_s: u64,
) -> Result<(), String> {
    let body = json!({"changes": changes, "horizon_s": horizon_s, "arrivals": "none"});
    let v = Api::new(args)?.call("POST", "/v1/whatif", Some(&body))?;
    print_comparison(args, &v);
    Ok(())
}

/// A what-if's answer as a table: each allocation, baseline -> with the changes.
fn print_comparison(args: &ClientArgs, v: &Value) {
    print(args, v, |v| {
        let (b, c) = (&v["baseline"], &v["changed"]);
        let mut out = format!(
            "from event {} at {}, over {}; baseline -> with the changes\n",
            text(&v["forked_at_seq"]),
            date_time(&v["from_ms"]),
            clock((v["horizon_s"].as_f64().unwrap_or(0.0) * 1000.0) as u64),
        );
        let find = |side: &Value, path: &str| -> Value {
            side["allocations"]
                .as_array()
                .and_then(|a| a.iter().find(|x| x["path"] == path).cloned())
                .unwrap_or(Value::Null)
        };
        let mut paths: Vec<String> = Vec::new();
        for side in [b, c] {
            for a in side["allocations"].as_array().into_iter().flatten() {
                let p = text(&a["path"]);
                if !paths.contains(&p) {
                    paths.push(p);
                }
            }
        }
        let both =
            |x: &Value, y: &Value, f: &dyn Fn(&Value) -> String| format!("{} -> {}", f(x), f(y));
        let wait = |v: &Value| {
            v.as_f64()
                .map_or("-".into(), |s| clock((s * 1000.0) as u64))
        };
        let ratio = |v: &Value| v.as_f64().map_or("-".into(), |r| format!("{r:.2}"));
        let rows = paths
            .iter()
            .map(|p| {
                let (x, y) = (find(b, p), find(c, p));
                vec![
                    p.clone(),
                    both(&x["weight"], &y["weight"], &text),
                    both(&x["owed_gpu_hours"], &y["owed_gpu_hours"], &hours),
                    both(&x["delivered_gpu_hours"], &y["delivered_gpu_hours"], &hours),
                    both(&x["delivered_over_owed"], &y["delivered_over_owed"], &ratio),
                    both(&x["wait_p50_s"], &y["wait_p50_s"], &wait),
                    both(&x["wait_p90_s"], &y["wait_p90_s"], &wait),
                    both(&x["preemptions"], &y["preemptions"], &text),
                ]
            })
            .collect();
        out += &columns(
            &[
                "ALLOCATION",
                "WEIGHT",
                "OWED_GPU_H",
                "DELIVERED_GPU_H",
                "DELIVERED/OWED",
                "WAIT_P50",
                "WAIT_P90",
                "PREEMPTIONS",
            ],
            rows,
        );
        let started = |side: &Value| {
            side["pending"].as_array().map_or(0, |p| {
                p.iter().filter(|x| !x["start_at_ms"].is_null()).count()
            })
        };
        let occupancy = |side: &Value| {
            format!(
                "{:.3}",
                side["cluster"]["occupancy"].as_f64().unwrap_or(0.0)
            )
        };
        out += &format!(
            "cluster: occupancy {} -> {}; healthy GPUs {} -> {}; contract violations {} -> {}\n",
            occupancy(b),
            occupancy(c),
            text(&b["cluster"]["healthy_gpus"]),
            text(&c["cluster"]["healthy_gpus"]),
            text(&b["cluster"]["contract_violations"]),
            text(&c["cluster"]["contract_violations"]),
        );
        out += &format!(
            "waiting now: {} of {} start within the horizon -> {}; {} new submissions assumed\n",
            started(b),
            b["pending"].as_array().map_or(0, Vec::len),
            started(c),
            text(&v["assumptions"]["arrivals"]),
        );
        out
    });
}
