//! `fairledger queue`, `jobs` and `nodes`: listings that page. A queue of a hundred thousand
//! workloads is read a page at a time and printed as it comes, as squeue does, never held in
//! one answer; `--summary` answers where things stand without reading the rows at all.

use std::io::{self, Write};

use super::*;

/// A listing printed page by page as the API answers it. For people, a table whose columns are
/// as wide as its first page's (a wider cell later widens its own row only); with `--json`, one
/// JSON object written as it comes: the first page's fields, the rows of every page under
/// `key`.
pub(super) struct Listing<'h> {
    json: bool,
    key: &'static str,
    header: &'h [&'h str],
    widths: Option<Vec<usize>>,
    out: io::BufWriter<io::StdoutLock<'static>>,
    rows: usize,
}

impl<'h> Listing<'h> {
    pub(super) fn new(args: &ClientArgs, key: &'static str, header: &'h [&'h str]) -> Self {
        Listing {
            json: args.json,
            key,
            header,
            widths: None,
            out: io::BufWriter::new(io::stdout().lock()),
            rows: 0,
        }
    }

    /// Rows printed so far.
    pub(super) fn printed(&self) -> usize {
        self.rows
    }

    /// Prints one page: `page` is the API's answer, its rows under the listing's key, each
    /// turned into cells by `cells`; at most `room` of them. The cursor fields (`skip`) are not
    /// printed.
    pub(super) fn page(
        &mut self,
        page: &Value,
        room: usize,
        skip: &[&str],
        cells: impl Fn(&Value) -> Vec<String>,
    ) -> io::Result<()> {
        let rows: Vec<&Value> = page[self.key]
            .as_array()
            .into_iter()
            .flatten()
            .take(room)
            .collect();
        if self.json {
            if self.widths.is_none() {
                self.widths = Some(Vec::new());
                write!(self.out, "{{")?;
                for (k, v) in page.as_object().into_iter().flatten() {
                    if k != self.key && !skip.contains(&k.as_str()) {
                        write!(self.out, "{}:{v},", Value::from(k.as_str()))?;
                    }
                }
                write!(self.out, "{}:[", Value::from(self.key))?;
            }
            for row in rows {
                if self.rows > 0 {
                    write!(self.out, ",")?;
                }
                write!(self.out, "\n{row}")?;
                self.rows += 1;
            }
            return self.out.flush();
        }
        let table: Vec<Vec<String>> = rows.into_iter().map(cells).collect();
        let widths = self.widths.get_or_insert_with(|| {
            let mut widths: Vec<usize> = self.header.iter().map(|h| h.len()).collect();
            for row in &table {
                for (w, cell) in widths.iter_mut().zip(row) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            let header: Vec<String> = self.header.iter().map(|h| h.to_string()).collect();
            let _ = writeln!(self.out, "{}", line(&header, &widths));
            widths
        });
        for row in &table {
            writeln!(
                self.out,
                "{}",
                ledger::names::terminal_safe(&line(row, widths))
            )?;
            self.rows += 1;
        }
        self.out.flush()
    }

    /// Ends the listing: closes the JSON object, or prints the header of an empty table and
    /// then `trailer` (a hint) for people.
    pub(super) fn finish(mut self, trailer: Option<&str>) -> io::Result<()> {
        if self.json {
            if self.widths.is_none() {
                write!(self.out, "{{{}:[", Value::from(self.key))?;
            }
            writeln!(self.out, "\n]}}")?;
        } else {
            if self.widths.is_none() {
                writeln!(self.out, "{}", self.header.join("  "))?;
            }
            if let Some(t) = trailer {
                writeln!(self.out, "{t}")?;
            }
        }
        self.out.flush()
    }
}

/// Cells padded to `widths`, the last one as it is.
fn line(cells: &[String], widths: &[usize]) -> String {
    let mut out = String::new();
    for (i, cell) in cells.iter().enumerate() {
        if i + 1 == cells.len() {
            out += cell;
        } else {
            let w = widths.get(i).copied().unwrap_or(0);
            out += &format!("{cell:<w$}  ");
        }
    }
    out.trim_end().to_owned()
}

/// A listing's write error as the command reports it. (A reader that went away, `| head`,
/// ends the process by SIGPIPE before this, as for other command-line tools.)
pub(super) fn written(result: io::Result<()>) -> Result<(), String> {
    result.map_err(|e| format!("writing the listing: {e}"))
}

/// The submitter a listing is narrowed to: `--user`, or with `--me` the caller's own actor.
fn submitter(api: &Api, user: Option<&str>, me: bool) -> Result<Option<String>, String> {
    if me {
        let who = api.call("GET", "/v1/whoami", None)?;
        return Ok(Some(text(&who["actor"])));
    }
    Ok(user.map(str::to_owned))
}

/// Rows asked of the API per page.
const PAGE: usize = 1_000;

/// A cursor as a query parameter takes it: the answer's `next_after` or `next_before`, a
/// number or a name; `None` on the last page.
fn cursor(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Prints the pages of `path` (with `query`) into `listing`, at most `limit` rows, each page
/// asking for what is left (at most [`PAGE`]) after the cursor: the answer's `field`, sent back
/// as `param`. Answers whether rows were left.
#[allow(clippy::too_many_arguments)]
pub(super) fn print_pages(
    api: &Api,
    listing: &mut Listing,
    path: &str,
    query: &[(&str, String)],
    (param, field): (&'static str, &str),
    limit: usize,
    skip: &[&str],
    cells: impl Fn(&Value) -> Vec<String>,
) -> Result<bool, String> {
    let mut at: Option<String> = None;
    while listing.printed() < limit {
        let mut q = query.to_vec();
        q.push(("limit", (limit - listing.printed()).min(PAGE).to_string()));
        if let Some(a) = &at {
            q.push((param, a.clone()));
        }
        let page = api.call("GET", &with_query(path, &q), None)?;
        let room = limit - listing.printed();
        written(listing.page(&page, room, skip, &cells))?;
        at = cursor(&page[field]);
        if at.is_none() {
            return Ok(false);
        }
    }
    Ok(at.is_some())
}

/// The summary `path` answers first, asked for alone (`limit=0`) with `query`, printed by
/// `table` (or as JSON).
fn print_summary(
    args: &ClientArgs,
    api: &Api,
    path: &str,
    query: &[(&str, String)],
    table: impl FnOnce(&Value) -> String,
) -> Result<(), String> {
    let mut q = query.to_vec();
    q.push(("limit", "0".into()));
    let v = api.call("GET", &with_query(path, &q), None)?;
    let summary = json!({"as_of_seq": v["as_of_seq"], "summary": v["summary"]});
    print(args, &summary, |v| table(&v["summary"]));
    Ok(())
}

/// What `fairledger queue` lists.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct QueueArgs {
    /// Only this allocation and below.
    #[arg(long, short)]
    pub allocation: Option<String>,
    /// Only what this principal submitted (`alice` or `user:alice`).
    #[arg(long, short, conflicts_with = "me")]
    pub user: Option<String>,
    /// Only the workloads I submitted.
    #[arg(long)]
    pub me: bool,
    /// Only workloads waiting for these reasons, comma-separated: holds_reservation,
    /// waiting_for_preemption, behind_reservation, allocation_cap, no_capacity,
    /// beyond_lookahead.
    #[arg(long, short)]
    pub reason: Option<String>,
    /// Counts and GPUs by allocation (with the head of each allocation's queue) and by
    /// reason, instead of the workloads.
    #[arg(long, short)]
    pub summary: bool,
    /// At most this many workloads (default: all, printed page after page).
    #[arg(long, short = 'n')]
    pub limit: Option<usize>,
}

pub fn queue(args: &ClientArgs, which: &QueueArgs) -> Result<(), String> {
    let api = Api::new(args)?;
    let mut filters = Vec::new();
    if let Some(a) = &which.allocation {
        filters.push(("allocation", a.clone()));
    }
    if let Some(u) = submitter(&api, which.user.as_deref(), which.me)? {
        filters.push(("user", u));
    }
    if let Some(r) = &which.reason {
        filters.push(("reason", r.clone()));
    }
    if which.summary {
        return print_summary(args, &api, "/v1/queue", &filters, queue_summary);
    }
    let limit = which.limit.unwrap_or(usize::MAX);
    let header = [
        "POS",
        "ID",
        "ALLOCATION",
        "USER",
        "GPUS",
        "WAITING",
        "REASON",
    ];
    let mut listing = Listing::new(args, "pending", &header);
    let more = print_pages(
        &api,
        &mut listing,
        "/v1/queue",
        &filters,
        ("after", "next_after"),
        limit,
        &["next_after"],
        |p| {
            vec![
                text(&p["position"]),
                text(&p["id"]),
                text(&p["allocation"]),
                text(&p["user"]),
                format!("{}x{}", text(&p["nodes"]), text(&p["gpus_per_node"])),
                (p["submitted_at_ms"].as_u64())
                    .zip(super::server_now_ms())
                    .map_or("-".into(), |(t, now)| span(now.saturating_sub(t) / 1000)),
                text(&p["reason"]["code"]),
            ]
        },
    )?;
    let more = more.then_some(
        "(more: raise --limit, narrow with --allocation, --user or --reason, or see --summary)",
    );
    written(listing.finish(more))
}

/// The queue's summary as tables: by allocation, then by reason.
fn queue_summary(s: &Value) -> String {
    let rows = |key: &str, cells: &dyn Fn(&Value) -> Vec<String>| -> Vec<Vec<String>> {
        s[key].as_array().into_iter().flatten().map(cells).collect()
    };
    let mut out = format!(
        "{} waiting for {} GPUs\n\n",
        text(&s["pending"]),
        text(&s["gpus"])
    );
    out += &columns(
        &[
            "ALLOCATION",
            "WAITING",
            "GPUS",
            "HEAD",
            "POS",
            "HEAD'S REASON",
        ],
        rows("by_allocation", &|a| {
            vec![
                a["allocation"]
                    .as_str()
                    .map_or("(unallocated)".into(), |p| text(&Value::from(p))),
                text(&a["pending"]),
                text(&a["gpus"]),
                text(&a["head"]["id"]),
                text(&a["head"]["position"]),
                text(&a["head"]["reason"]),
            ]
        }),
    );
    out += "\n";
    out += &columns(
        &["REASON", "WAITING", "GPUS"],
        rows("by_reason", &|r| {
            vec![text(&r["code"]), text(&r["pending"]), text(&r["gpus"])]
        }),
    );
    out
}

/// What `fairledger jobs` lists.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct JobsArgs {
    /// Only these states, comma-separated: pending, running, stopped, finished, cancelled.
    #[arg(long, short)]
    pub state: Option<String>,
    /// Only this allocation and below.
    #[arg(long, short)]
    pub allocation: Option<String>,
    /// Only what this principal submitted (`alice` or `user:alice`).
    #[arg(long, short, conflicts_with = "me")]
    pub user: Option<String>,
    /// Only what I submitted.
    #[arg(long)]
    pub me: bool,
    /// Only workloads live at this time or ended since: a date, a date-time, or how long ago
    /// (`2h`, `1d 12h`).
    #[arg(long, short = 'S')]
    pub since: Option<String>,
    /// Only workloads submitted before this time (same forms).
    #[arg(long, short = 'E')]
    pub until: Option<String>,
    /// At most this many (0: all, printed page after page).
    #[arg(long, short = 'n', default_value_t = 50)]
    pub limit: usize,
}

pub fn jobs(args: &ClientArgs, filter: &JobsArgs) -> Result<(), String> {
    let api = Api::new(args)?;
    let mut query = Vec::new();
    if let Some(s) = &filter.state {
        query.push(("phase", s.clone()));
    }
    if let Some(a) = &filter.allocation {
        query.push(("allocation", a.clone()));
    }
    if let Some(u) = submitter(&api, filter.user.as_deref(), filter.me)? {
        query.push(("user", u));
    }
    if let Some(t) = &filter.since {
        query.push(("since", t.clone()));
    }
    if let Some(t) = &filter.until {
        query.push(("until", t.clone()));
    }
    let limit = if filter.limit == 0 {
        usize::MAX
    } else {
        filter.limit
    };
    let header = [
        "ID",
        "NAME",
        "ALLOCATION",
        "USER",
        "ST",
        "GPUS",
        "SUBMITTED (UTC)",
        "STARTED",
        "ENDED",
        "ELAPSED",
        "GPU-H",
        "EXIT",
        "OUTPUT",
    ];
    let mut listing = Listing::new(args, "workloads", &header);
    let more = print_pages(
        &api,
        &mut listing,
        "/v1/workloads",
        &query,
        ("before", "next_before"),
        limit,
        &["next_before", "scanned"],
        |w| {
            vec![
                text(&w["id"]),
                text(&w["name"]),
                text(&w["allocation"]),
                text(&w["user"]),
                text(&w["state"]),
                format!("{}x{}", text(&w["nodes"]), text(&w["gpus_per_node"])),
                date_time(&w["submitted_at_ms"]),
                date_time(&w["started_at_ms"]),
                date_time(&w["ended_at_ms"]),
                clock(w["elapsed_ms"].as_u64().unwrap_or(0)),
                hours(&w["gpu_hours"]),
                exit(w),
                output(w),
            ]
        },
    )?;
    let more = more.then_some(
        "(more: raise --limit (0 for all), or narrow with --since, --state, --allocation)",
    );
    written(listing.finish(more))
}

/// What `fairledger nodes` lists.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct NodesArgs {
    /// Only nodes of this GPU model.
    #[arg(long, short)]
    pub model: Option<String>,
    /// Only nodes in these states, comma-separated: idle, mix, alloc, drng, drain, down.
    #[arg(long, short)]
    pub state: Option<String>,
    /// Nodes and GPUs by model and by state, instead of the nodes.
    #[arg(long)]
    pub summary: bool,
}

pub fn nodes(
    args: &ClientArgs,
    which: &NodesArgs,
    command: Option<NodesCommand>,
) -> Result<(), String> {
    let api = Api::new(args)?;
    match command {
        Some(NodesCommand::Drain { node, reason }) => {
            let v = api.call(
                "POST",
                &format!("/v1/nodes/{node}/drain"),
                Some(&json!({ "reason": reason })),
            )?;
            print(args, &v, |v| format!("drained {}\n", text(&v["node"])));
            return Ok(());
        }
        Some(NodesCommand::Resume { node }) => {
            let v = api.call("DELETE", &format!("/v1/nodes/{node}/drain"), None)?;
            print(args, &v, |v| format!("resumed {}\n", text(&v["node"])));
            return Ok(());
        }
        None => {}
    }
    let mut filters = Vec::new();
    if let Some(m) = &which.model {
        filters.push(("model", m.clone()));
    }
    if let Some(s) = &which.state {
        filters.push(("state", s.clone()));
    }
    if which.summary {
        return print_summary(args, &api, "/v1/nodes", &filters, nodes_summary);
    }
    let header = [
        "NODE",
        "MODEL",
        "GPUS",
        "FREE",
        "STATE",
        "UTIL",
        "UNHEALTHY",
        "LABELS",
    ];
    let mut listing = Listing::new(args, "nodes", &header);
    print_pages(
        &api,
        &mut listing,
        "/v1/nodes",
        &filters,
        ("after", "next_after"),
        usize::MAX,
        &["next_after"],
        node_row,
    )?;
    written(listing.finish(None))
}

/// One node as `fairledger nodes` shows it.
fn node_row(n: &Value) -> Vec<String> {
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
        text(&n["state"]),
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
}

/// The cluster's summary as tables: by model, then by state.
fn nodes_summary(s: &Value) -> String {
    let rows = |key: &str, cells: &dyn Fn(&Value) -> Vec<String>| -> Vec<Vec<String>> {
        s[key].as_array().into_iter().flatten().map(cells).collect()
    };
    let mut out = format!("{} nodes, {} GPUs\n\n", text(&s["nodes"]), text(&s["gpus"]));
    out += &columns(
        &["MODEL", "NODES", "GPUS", "HEALTHY", "HELD", "FREE"],
        rows("by_model", &|m| {
            [
                "model",
                "nodes",
                "gpus",
                "healthy_gpus",
                "held_gpus",
                "free_gpus",
            ]
            .iter()
            .map(|k| text(&m[*k]))
            .collect()
        }),
    );
    out += "\n";
    out += &columns(
        &["STATE", "NODES", "GPUS"],
        rows("by_state", &|r| {
            vec![text(&r["state"]), text(&r["nodes"]), text(&r["gpus"])]
        }),
    );
    out
}
