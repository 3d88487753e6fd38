//! The command-line client: `submit`, `status`, `cancel`, `queue`, `explain`, `alloc`, `audit`,
//! `events` against a running `fairledger serve` (`--api`, default the local one). Tables for
//! people by default, in the shape squeue, sshare and sreport users know; `--json` for scripts.

use std::io::{BufRead, BufReader};

use serde_json::{json, Value};

/// Where the API is, and how to print.
#[derive(clap::Args, Clone, Debug)]
pub struct ClientArgs {
    /// The API's base URL.
    #[arg(
        long,
        env = "FAIRLEDGER_API",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub api: String,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

/// A thin HTTP client that turns problem+json answers into one-line errors.
struct Api {
    base: String,
    agent: ureq::Agent,
}

impl Api {
    fn new(base: &str) -> Self {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build();
        Api {
            base: base.trim_end_matches('/').to_owned(),
            agent: config.into(),
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
        let url = format!("{}{path}", self.base);
        let sent = match (method, body) {
            ("GET", _) => self.agent.get(&url).call(),
            ("DELETE", _) => self.agent.delete(&url).call(),
            ("POST", Some(b)) => self
                .agent
                .post(&url)
                .header("content-type", "application/json")
                .send(b.to_string()),
            ("PUT", Some(b)) => self
                .agent
                .put(&url)
                .header("content-type", "application/json")
                .send(b.to_string()),
            _ => unreachable!("{method} with {body:?}"),
        };
        let mut response = sent.map_err(|e| {
            format!(
                "cannot reach the API at {} ({e}); start it with `fairledger serve` or pass --api",
                self.base
            )
        })?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("reading the answer of {url}: {e}"))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if status >= 400 {
            let detail = value["detail"]
                .as_str()
                .unwrap_or("the API refused the request");
            return Err(match value["field"].as_str() {
                Some(field) => format!("{detail} (field {field})"),
                None => detail.to_owned(),
            });
        }
        Ok(value)
    }
}

/// What to submit.
#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    /// Leaf allocation to charge (omit for unallocated, always-preemptible work).
    #[arg(long, short)]
    pub allocation: Option<String>,
    /// GPUs on each node.
    #[arg(long, short)]
    pub gpus: u32,
    /// Nodes in the gang.
    #[arg(long, short, default_value_t = 1)]
    pub nodes: u32,
    /// A name.
    #[arg(long)]
    pub name: Option<String>,
    /// Required GPU model.
    #[arg(long)]
    pub model: Option<String>,
    /// Priority within the allocation (higher first).
    #[arg(long, default_value_t = 0)]
    pub priority: i32,
    /// Protection from preemption asked for, in seconds (at most the cluster's cap).
    #[arg(long)]
    pub min_runtime: Option<u64>,
    /// Expected run time in seconds.
    #[arg(long)]
    pub duration: Option<u64>,
    /// Checkpoint interval in seconds.
    #[arg(long)]
    pub checkpoint: Option<u64>,
    /// Wait until it is placed (up to this many seconds).
    #[arg(long)]
    pub wait: Option<u64>,
    /// The command the node agent runs.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// `fairledger alloc …`.
#[derive(clap::Subcommand, Debug)]
pub enum AllocCommand {
    /// The tree with shares, owed and delivered (like sshare).
    List,
    /// Create or change an allocation.
    Set {
        /// Path, e.g. ai2/olmo/pretrain.
        path: String,
        /// Weight among its siblings.
        #[arg(long)]
        weight: u32,
        /// Cap on the GPUs its subtree may hold.
        #[arg(long)]
        max_gpus: Option<u32>,
    },
    /// Remove an allocation with no children and no live workloads.
    Rm {
        /// Path.
        path: String,
    },
}

fn print(args: &ClientArgs, value: &Value, table: impl FnOnce(&Value) -> String) {
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).expect("serializes")
        );
    } else {
        print!("{}", table(value));
    }
}

fn hours(v: &Value) -> String {
    format!("{:.2}", v.as_f64().unwrap_or(0.0))
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Formats rows as left-aligned columns.
fn columns(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out += cell;
            } else {
                out += &format!("{cell:<w$}  ");
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        out += &line(row);
    }
    out
}

pub fn submit(args: &ClientArgs, s: SubmitArgs) -> Result<(), String> {
    let api = Api::new(&args.api);
    let body = json!({
        "allocation": s.allocation, "gpus_per_node": s.gpus, "nodes": s.nodes, "name": s.name,
        "model": s.model, "priority": s.priority, "min_runtime_s": s.min_runtime,
        "duration_estimate_s": s.duration, "checkpoint_s": s.checkpoint, "command": s.command,
    });
    let path = match s.wait {
        Some(t) => format!("/v1/workloads?wait=placed&timeout_s={t}"),
        None => "/v1/workloads".into(),
    };
    let v = api.call("POST", &path, Some(&body))?;
    print(args, &v, |v| {
        let phase = v["workload"]["phase"]
            .as_str()
            .or(v["phase"].as_str())
            .unwrap_or("pending");
        format!("submitted {} ({phase})\n", text(&v["id"]))
    });
    Ok(())
}

pub fn status(args: &ClientArgs, id: &str) -> Result<(), String> {
    let v = Api::new(&args.api).call("GET", &format!("/v1/workloads/{id}"), None)?;
    print(args, &v, |w| {
        let placement: Vec<String> = w["placement"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| format!("{}:{}", text(&p["node"]), text(&p["gpus"])))
            .collect();
        format!(
            "id          {}\nphase       {}\nallocation  {}\ngpus        {} x {}\nplacement   {}\nprotected   {}\nstarts      {}\n",
            text(&w["id"]),
            text(&w["phase"]),
            text(&w["allocation"]),
            text(&w["nodes"]),
            text(&w["gpus_per_node"]),
            if placement.is_empty() { "-".into() } else { placement.join(" ") },
            text(&w["protected_until_ms"]),
            text(&w["starts"]),
        )
    });
    Ok(())
}

pub fn cancel(args: &ClientArgs, id: &str) -> Result<(), String> {
    let v = Api::new(&args.api).call("DELETE", &format!("/v1/workloads/{id}"), None)?;
    print(args, &v, |v| {
        format!(
            "{}: {}\n",
            text(&v["id"]),
            text(&v["action"]).replace('_', " ")
        )
    });
    Ok(())
}

pub fn queue(args: &ClientArgs, allocation: Option<&str>) -> Result<(), String> {
    let path = match allocation {
        Some(a) => format!("/v1/queue?allocation={a}"),
        None => "/v1/queue".into(),
    };
    let v = Api::new(&args.api).call("GET", &path, None)?;
    print(args, &v, |v| {
        let rows = v["pending"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                vec![
                    text(&p["position"]),
                    text(&p["id"]),
                    text(&p["allocation"]),
                    format!("{}x{}", text(&p["nodes"]), text(&p["gpus_per_node"])),
                    text(&p["reason"]["code"]),
                ]
            })
            .collect();
        columns(&["POS", "ID", "ALLOCATION", "GPUS", "REASON"], rows)
    });
    Ok(())
}

pub fn nodes(args: &ClientArgs) -> Result<(), String> {
    let v = Api::new(&args.api).call("GET", "/v1/nodes", None)?;
    print(args, &v, |v| {
        let rows = v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| {
                let gpus = n["gpu"].as_array().cloned().unwrap_or_default();
                let held: Vec<&Value> = gpus.iter().filter(|g| !g["workload"].is_null()).collect();
                let util = if held.is_empty() {
                    "-".to_owned()
                } else {
                    let sum: u64 = held
                        .iter()
                        .filter_map(|g| g["utilization_pct"].as_u64())
                        .sum();
                    format!("{}%", sum / held.len() as u64)
                };
                let down: Vec<String> = gpus
                    .iter()
                    .filter(|g| g["healthy"] == false)
                    .map(|g| text(&g["gpu"]))
                    .collect();
                let labels = n["labels"]
                    .as_object()
                    .map(|l| {
                        l.iter()
                            .map(|(k, v)| format!("{k}={}", text(v)))
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default();
                vec![
                    text(&n["node"]),
                    text(&n["model"]),
                    text(&n["gpus"]),
                    text(&n["free_gpus"]),
                    util,
                    if down.is_empty() {
                        "-".into()
                    } else {
                        down.join(",")
                    },
                    if labels.is_empty() {
                        "-".into()
                    } else {
                        labels
                    },
                ]
            })
            .collect();
        columns(
            &[
                "NODE",
                "MODEL",
                "GPUS",
                "FREE",
                "UTIL",
                "UNHEALTHY",
                "LABELS",
            ],
            rows,
        )
    });
    Ok(())
}

pub fn explain(args: &ClientArgs, id: &str) -> Result<(), String> {
    let v = Api::new(&args.api).call("GET", &format!("/v1/workloads/{id}/explain"), None)?;
    print(args, &v, |v| {
        if v["phase"] != "pending" {
            return format!(
                "{} is {}: {}\n",
                text(&v["id"]),
                text(&v["phase"]),
                text(&v["detail"])
            );
        }
        let mut out = format!(
            "{} is {} of {} in the queue: {}\n",
            text(&v["id"]),
            text(&v["position"]),
            text(&v["of"]),
            text(&v["reason"]["detail"])
        );
        if let Some(e) = v["estimate"].as_object() {
            let at = e
                .get("start_at_ms")
                .or(e.get("not_before_ms"))
                .map(text)
                .unwrap_or_default();
            out += &format!(
                "estimated start (ms since the epoch): {at}; {}\n",
                e.get("how").map(text).unwrap_or_default()
            );
        }
        for a in v["ahead"].as_array().into_iter().flatten() {
            out += &format!(
                "  ahead: {} ({}, {} GPUs)\n",
                text(&a["id"]),
                text(&a["allocation"]),
                text(&a["gpus"])
            );
        }
        out
    });
    Ok(())
}

pub fn alloc(args: &ClientArgs, command: AllocCommand) -> Result<(), String> {
    let api = Api::new(&args.api);
    match command {
        AllocCommand::List => {
            let v = api.call("GET", "/v1/allocations", None)?;
            print(args, &v, |v| {
                let rows = v["allocations"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| {
                        vec![
                            text(&a["path"]),
                            text(&a["weight"]),
                            format!("{:.1}", a["owed_gpus_now"].as_f64().unwrap_or(0.0)),
                            text(&a["held_gpus"]),
                            text(&a["demand_gpus"]),
                            hours(&a["owed_gpu_hours"]),
                            hours(&a["delivered_gpu_hours"]),
                        ]
                    })
                    .collect();
                columns(
                    &[
                        "PATH",
                        "WEIGHT",
                        "OWED_NOW",
                        "HELD",
                        "DEMAND",
                        "OWED_GPU_H",
                        "DELIVERED_GPU_H",
                    ],
                    rows,
                )
            });
        }
        AllocCommand::Set {
            path,
            weight,
            max_gpus,
        } => {
            let v = api.call(
                "PUT",
                &format!("/v1/allocations/{path}"),
                Some(&json!({"weight": weight, "max_gpus": max_gpus})),
            )?;
            print(args, &v, |v| {
                format!("set {} (sequence {})\n", text(&v["path"]), text(&v["seq"]))
            });
        }
        AllocCommand::Rm { path } => {
            let v = api.call("DELETE", &format!("/v1/allocations/{path}"), None)?;
            print(args, &v, |v| format!("removed {}\n", text(&v["path"])));
        }
    }
    Ok(())
}

pub fn audit(
    args: &ClientArgs,
    allocation: Option<&str>,
    from: Option<u64>,
    to: Option<u64>,
    granularity: &str,
) -> Result<(), String> {
    let mut path = format!("/v1/audit/ledger?granularity={granularity}");
    if let Some(a) = allocation {
        path += &format!("&allocation={a}");
    }
    if let Some(f) = from {
        path += &format!("&from={f}");
    }
    if let Some(t) = to {
        path += &format!("&to={t}");
    }
    let v = Api::new(&args.api).call("GET", &path, None)?;
    print(args, &v, |v| {
        let rows = v["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                vec![
                    text(&r["allocation"]),
                    text(&r["from_ms"]),
                    hours(&r["entitlement_gpu_hours"]),
                    hours(&r["owed_gpu_hours"]),
                    hours(&r["delivered_gpu_hours"]),
                    text(&r["preemptions"]),
                    text(&r["contract_violations"]),
                ]
            })
            .collect();
        columns(
            &[
                "ALLOCATION",
                "FROM_MS",
                "ENTITLED_GPU_H",
                "OWED_GPU_H",
                "DELIVERED_GPU_H",
                "PREEMPTIONS",
                "VIOLATIONS",
            ],
            rows,
        )
    });
    Ok(())
}

pub fn events(args: &ClientArgs, after: u64, limit: usize, follow: bool) -> Result<(), String> {
    let api = Api::new(&args.api);
    if !follow {
        let v = api.call(
            "GET",
            &format!("/v1/events?after={after}&limit={limit}"),
            None,
        )?;
        print(args, &v, |v| {
            let rows = v["events"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    vec![
                        text(&e["seq"]),
                        text(&e["event"]["type"]),
                        text(&e["subject"]),
                    ]
                })
                .collect();
            columns(&["SEQ", "TYPE", "SUBJECT"], rows)
        });
        return Ok(());
    }
    let url = format!("{}/v1/events/stream?after={after}", api.base);
    let response = api.agent.get(&url).call().map_err(|e| {
        format!(
            "cannot reach the API at {} ({e}); start it with `fairledger serve` or pass --api",
            api.base
        )
    })?;
    let reader = BufReader::new(response.into_body().into_reader());
    let (mut id, mut kind) = (String::new(), String::new());
    for line in reader.lines() {
        let line = line.map_err(|e| format!("the event stream broke: {e}"))?;
        if let Some(v) = line.strip_prefix("id:") {
            id = v.trim().to_owned();
        } else if let Some(v) = line.strip_prefix("event:") {
            kind = v.trim().to_owned();
        } else if let Some(data) = line.strip_prefix("data:") {
            if args.json {
                println!("{}", data.trim());
            } else {
                println!("{id}  {kind}");
            }
        }
    }
    Ok(())
}
