//! The commands that work on the event log itself: `replay` from a log, `project`, `log import`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use eventlog::{AnyLog, EventLog};
use ledger::{Envelope, StateConfig};
use projector::Projector;

use crate::common::{runtime, shutdown_signal, LogArgs};

/// What a projection reached, as printed by `replay` and `project`.
#[derive(serde::Serialize)]
struct Reached {
    last_seq: u64,
    digest: String,
    applied: u64,
    rejected: u64,
    duplicates: u64,
    malformed: u64,
    elapsed_s: f64,
}

impl Reached {
    fn new(last_seq: u64, digest: String, stats: projector::Stats, started: Instant) -> Self {
        Reached {
            last_seq,
            digest,
            applied: stats.applied,
            rejected: stats.rejected,
            duplicates: stats.duplicates,
            malformed: stats.malformed,
            elapsed_s: started.elapsed().as_secs_f64(),
        }
    }
}

fn print_reached(what: &str, r: &Reached, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).expect("serializes"));
    } else {
        println!("{what} to sequence {} in {:.2} s", r.last_seq, r.elapsed_s);
        println!(
            "events: {} applied, {} rejected, {} duplicate, {} malformed",
            r.applied, r.rejected, r.duplicates, r.malformed
        );
        println!("digest: {}", r.digest);
    }
}

/// `fairledger replay --nats|--data`: rebuilds a projection from sequence 0 and prints its
/// digest.
pub fn replay(log_args: &LogArgs, projection: Option<&Path>, json: bool) -> Result<(), String> {
    runtime()?.block_on(async {
        let log = log_args.open().await?;
        let scratch;
        let dir = match projection {
            Some(dir) => {
                if dir.exists() {
                    return Err(format!(
                        "{} exists; replay builds a fresh projection, so name a new directory",
                        dir.display()
                    ));
                }
                dir.to_owned()
            }
            None => {
                scratch =
                    tempfile::tempdir().map_err(|e| format!("no temporary directory: {e}"))?;
                scratch.path().join("projection")
            }
        };
        let started = Instant::now();
        let (digest, stats, last_seq) = projector::replay(&log, &dir, StateConfig::default())
            .await
            .map_err(|e| e.to_string())?;
        let reached = Reached::new(last_seq, digest, stats, started);
        print_reached(&format!("replayed {}", log_args.describe()), &reached, json);
        Ok(())
    })
}

/// `fairledger project`: keeps a projection up to date with the log until SIGINT or SIGTERM
/// (or, with `once`, until it has caught up), then checkpoints and prints its digest.
pub fn project(
    log_args: &LogArgs,
    projection: Option<&Path>,
    once: bool,
    json: bool,
) -> Result<(), String> {
    runtime()?.block_on(async {
        let log = log_args.open().await?;
        let dir = projection
            .map(Path::to_owned)
            .unwrap_or_else(|| log_args.data.join("projection"));
        let started = Instant::now();
        let mut p = Projector::open_or_rebuild(&dir, StateConfig::default(), &log)
            .await
            .map_err(|e| e.to_string())?;
        if once {
            p.catch_up(&log).await.map_err(|e| e.to_string())?;
            p.checkpoint().map_err(|e| e.to_string())?;
        } else {
            eprintln!(
                "projecting {} into {} from sequence {}",
                log_args.describe(),
                dir.display(),
                p.last_seq() + 1
            );
            let shared = tokio::sync::RwLock::new(p);
            let (applied, _) = tokio::sync::watch::channel(0);
            projector::follow(&log, &shared, &applied, shutdown_signal())
                .await
                .map_err(|e| e.to_string())?;
            p = shared.into_inner();
        }
        let (stats, last_seq) = (p.stats(), p.last_seq());
        let digest = p.digest().map_err(|e| e.to_string())?;
        drop(p);
        settle(&dir)?;
        let reached = Reached::new(last_seq, digest, stats, started);
        print_reached(&format!("projected into {}", dir.display()), &reached, json);
        Ok(())
    })
}

/// `fairledger log import FILE`: appends a ledger written as JSON lines (a simulator's
/// `events.jsonl`, an export) to the log, in order, leaving out the events whose ids the log
/// already holds, so that running the import again, however much later, appends nothing twice.
/// (The logs remember idempotency keys only for a duplicate window, so the import asks the log
/// what it holds instead of keying each event.)
pub fn import(log_args: &LogArgs, events: &Path, batch: usize) -> Result<(), String> {
    // Two passes over the file, so that memory does not grow with its length: the first checks
    // every line (nothing is imported from a file with a bad one), the second appends.
    let lines = || -> Result<_, String> {
        let file = std::fs::File::open(events)
            .map_err(|e| format!("cannot read {}: {e}", events.display()))?;
        Ok(std::io::BufRead::lines(std::io::BufReader::new(file)).enumerate())
    };
    let parse = |i: usize, line: std::io::Result<String>| -> Result<Option<Envelope>, String> {
        let line = line.map_err(|e| format!("cannot read {}: {e}", events.display()))?;
        if line.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&line).map(Some).map_err(|e| {
            format!(
                "{}:{}: not a ledger event ({e}); nothing was imported",
                events.display(),
                i + 1
            )
        })
    };
    for (i, line) in lines()? {
        parse(i, line)?;
    }
    let batch = batch.clamp(1, eventlog::MAX_BATCH);
    runtime()?.block_on(async {
        let log = log_args.open().await?;
        let started = Instant::now();
        let held = ids_in(&log).await?;
        let mut router = eventlog::subject::Router::default();
        let (mut written, mut duplicates) = (0u64, 0u64);
        let mut chunk: Vec<eventlog::Append> = Vec::with_capacity(batch);
        let mut lines = lines()?.peekable();
        while lines.peek().is_some() {
            chunk.clear();
            for (i, line) in lines.by_ref() {
                if let Some(env) = parse(i, line)? {
                    // Every event goes past the router, which learns workloads' allocations
                    // from their submissions, held or not.
                    let mut append = router.append(&env, None);
                    if held.contains(&env.id) {
                        duplicates += 1;
                        continue;
                    }
                    append.msg_id = None;
                    chunk.push(append);
                    if chunk.len() == batch {
                        break;
                    }
                }
            }
            if chunk.is_empty() {
                break;
            }
            let appends = std::mem::take(&mut chunk);
            match log.append_batch(appends).await {
                Ok(acks) => written += acks.len() as u64,
                Err(e) => return Err(format!("import stopped after {written} events: {e}; running the import again goes on from there")),
            }
        }
        drop(log);
        if log_args.nats.is_none() {
            settle(&log_args.data.join("log"))?;
        }
        eprintln!(
            "imported {written} events ({duplicates} already present) into {} in {:.2} s",
            log_args.describe(),
            started.elapsed().as_secs_f64()
        );
        Ok(())
    })
}

/// [`eventlog::embedded::settle`], after a bulk write to the sled database in `dir`.
fn settle(dir: &Path) -> Result<(), String> {
    eventlog::embedded::settle(dir).map_err(|e| format!("cannot reopen {}: {e}", dir.display()))
}

/// The ids of the events the log holds (none for a new log: the common import).
async fn ids_in(log: &AnyLog) -> Result<std::collections::HashSet<uuid::Uuid>, String> {
    #[derive(serde::Deserialize)]
    struct Id {
        id: uuid::Uuid,
    }
    let last = log.last_seq().await.map_err(|e| e.to_string())?;
    let mut ids = std::collections::HashSet::with_capacity(last as usize);
    let mut next = 1;
    while next <= last {
        let events = log.read(next, 4096).await.map_err(|e| e.to_string())?;
        let Some(end) = events.last().map(|e| e.seq) else {
            break;
        };
        // An event that does not decode has no id to match: the import cannot hold it.
        ids.extend(
            events
                .iter()
                .filter_map(|e| serde_json::from_slice::<Id>(&e.payload).ok())
                .map(|e| e.id),
        );
        next = end + 1;
    }
    Ok(ids)
}

/// `fairledger audit verify`.
#[derive(clap::Args, Clone, Debug)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub log: LogArgs,
    /// The projection to check (default: DATA/projection, the one `serve` keeps).
    #[arg(long)]
    pub projection: Option<PathBuf>,
    /// Only periods starting at or after this time: a date (2026-11-01), an RFC 3339 date-time
    /// or ms since the epoch.
    #[arg(long)]
    pub from: Option<String>,
    /// Only periods starting before this time.
    #[arg(long)]
    pub to: Option<String>,
    /// Only this allocation and those below it.
    #[arg(long, short)]
    pub allocation: Option<String>,
    /// Instead of the kept figures, check that the log's head at SEQ is HASH (as
    /// `GET /v1/audit/head`, an audit row or `fairledger audit head` gave it): the history up
    /// to SEQ is the one that head was taken from. Needs only the log.
    #[arg(long, value_name = "SEQ:HASH", conflicts_with_all = ["projection", "from", "to", "allocation"])]
    pub head: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `audit verify --head SEQ:HASH`: chains the log from its first event to SEQ and compares.
fn verify_head(args: &VerifyArgs, held: &str) -> Result<(), String> {
    let held = ledger::chain::Head::parse(held).map_err(|e| format!("--head: {e}"))?;
    let found = runtime()?.block_on(async {
        let log = args.log.open().await?;
        projector::verify::head_at(&log, held.seq)
            .await
            .map_err(|e| e.to_string())
    })?;
    let agrees = found == Some(held);
    if args.json {
        let out = serde_json::json!({
            "agrees": agrees,
            "seq": held.seq,
            "hash": found.map(|h| h.hex()),
        });
        println!("{out}");
    }
    match found {
        Some(_) if agrees => {
            if !args.json {
                println!(
                    "the log's head at sequence {} is {}: the history behind it is unchanged",
                    held.seq,
                    held.hex()
                );
            }
            Ok(())
        }
        Some(h) => Err(format!(
            "the log's head at sequence {} is {}, not {}: the history up to it differs from the one that head was taken from",
            held.seq,
            h.hex(),
            held.hex()
        )),
        None => Err(format!(
            "the log ends before sequence {}: it is not the history that head was taken from (or not all of it)",
            held.seq
        )),
    }
}

/// Writes every event of the log, from sequence `after + 1`, as it is stored: one JSON line
/// each, to `out` (stdout when `None`). A copy that `log import` and `audit verify --head` read.
pub fn export(log_args: &LogArgs, after: u64, out: Option<&Path>) -> Result<(), String> {
    use std::io::Write;
    let mut sink: Box<dyn Write> = match out {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let failed = |e: std::io::Error| format!("cannot write the export: {e}");
    runtime()?.block_on(async {
        let log = log_args.open().await?;
        let mut next = after + 1;
        loop {
            let events = log.read(next, 10_000).await.map_err(|e| e.to_string())?;
            let Some(last) = events.last().map(|e| e.seq) else {
                break;
            };
            for e in &events {
                if e.payload.contains(&b'\n') {
                    // One line per event: a payload spread over lines is written compact,
                    // which its canonical form (and so the chain) does not notice.
                    let value: serde_json::Value = serde_json::from_slice(&e.payload)
                        .map_err(|err| format!("event {} is not JSON: {err}", e.seq))?;
                    serde_json::to_writer(&mut sink, &value).map_err(|e| failed(e.into()))?;
                } else {
                    sink.write_all(&e.payload).map_err(failed)?;
                }
                sink.write_all(b"\n").map_err(failed)?;
            }
            next = last + 1;
        }
        sink.flush().map_err(failed)
    })
}

/// Refolds the log apart from the projection and compares every kept row; fails when any
/// differs.
pub fn verify(args: &VerifyArgs) -> Result<(), String> {
    if let Some(head) = &args.head {
        return verify_head(args, head);
    }
    // Offline, this command is the application: a span is before its own clock.
    let now = scheduler::wall_clock_ms();
    let instant = |flag: &str, v: &Option<String>| {
        v.as_deref()
            .map(|t| api::period::parse_instant(t, now).map_err(|e| format!("--{flag}: {e}")))
            .transpose()
    };
    let scope = projector::verify::Scope {
        from_ms: instant("from", &args.from)?,
        to_ms: instant("to", &args.to)?,
        allocation: args.allocation.clone(),
    };
    if let Some(a) = &scope.allocation {
        ledger::names::path(a).map_err(|r| format!("--allocation: {r}"))?;
    }
    let started = Instant::now();
    let found = runtime()?.block_on(async {
        let log = args.log.open().await?;
        let dir = args
            .projection
            .clone()
            .unwrap_or_else(|| args.log.data.join("projection"));
        let p = Projector::open_existing(&dir, &log).await.map_err(|e| {
            format!(
                "{e} (is a server running on it? stop it, or verify a copy of its data directory)"
            )
        })?;
        let (kept, config, up_to) = (p.kept(), *p.state().base_config(), p.last_seq());
        let open = projector::verify::open_rows_now(p.book(), p.state());
        projector::verify::verify(&log, &kept, &open, config, up_to, &scope)
            .await
            .map_err(|e| e.to_string())
    })?;
    let differences: Vec<serde_json::Value> = found
        .differences
        .iter()
        .map(api::routes::audit::difference_json)
        .collect();
    if args.json {
        let out = serde_json::json!({
            "agrees": differences.is_empty(),
            "last_seq": found.last_seq,
            "compared": found.compared,
            "differences": differences,
            "authority": api::routes::audit::authority_json(&found),
        });
        println!("{out}");
    } else {
        for d in &differences {
            println!("differs: {}", describe_difference(d));
        }
        println!(
            "compared {} rows (kept, and the periods under way) with a refold of sequences 1 to {} in {:.2} s: {}",
            found.compared,
            found.last_seq,
            started.elapsed().as_secs_f64(),
            if differences.is_empty() {
                "all agree".to_string()
            } else {
                format!("{} differ", differences.len())
            }
        );
    }
    if !args.json {
        println!("{}", api::routes::audit::authority_line(&found));
    }
    if differences.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} kept rows differ from what the log implies; rebuild the projection (delete DATA/projection) and find out who changed it",
            differences.len()
        ))
    }
}

/// One line for a row that differs: which row, and each figure that differs, kept then refold.
fn describe_difference(d: &serde_json::Value) -> String {
    let row = if d["kept"].is_null() {
        &d["refold"]
    } else {
        &d["kept"]
    };
    let what = match row["allocation"].as_str() {
        Some(a) => format!("{a} (incarnation {})", row["incarnation"]),
        None => "cluster".to_string(),
    };
    let when = format!(
        "{} {}",
        row["granularity"].as_str().unwrap_or("?"),
        row["from_ms"]
            .as_u64()
            .map(api::period::format_instant)
            .unwrap_or_default()
    );
    let figures = match (d["kept"].as_object(), d["refold"].as_object()) {
        (Some(k), Some(r)) => k
            .iter()
            .filter(|(name, v)| r.get(*name) != Some(*v))
            .map(|(name, v)| format!("{name} kept {v}, refold {}", r[name]))
            .collect::<Vec<_>>()
            .join("; "),
        (None, _) => "missing from the projection".to_string(),
        (_, None) => "kept, but the log implies no such row".to_string(),
    };
    format!(
        "{what}, {when}: {figures} (events {}..{})",
        row["first_seq"], row["last_seq"]
    )
}

/// A what-if answered offline, as the server would have answered it at sequence `seq`: the log
/// folded up to `seq` into a scratch projection (with the settings of `config`, as `serve`
/// takes them), then the same computation as `POST /v1/whatif` on it. `body` is that request's.
pub fn what_if_at(
    log_args: &LogArgs,
    config: Option<&Path>,
    seq: u64,
    body: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let problem = |p: api::Problem| match &p.field {
        Some(field) => format!("{} (field {field})", p.detail),
        None => p.detail,
    };
    let asked = api::routes::whatif::Asked::read(
        body["changes"].as_array().map_or(&[][..], Vec::as_slice),
        body["horizon_s"].as_u64().unwrap_or(0),
        body["arrivals"].as_str(),
        body["seed"].as_u64().unwrap_or(0),
    )
    .map_err(problem)?;
    let (state_config, policy, _, _) = crate::common::settings(config, None)?;
    runtime()?.block_on(async {
        let log = log_args.open().await?;
        let last = log.last_seq().await.map_err(|e| e.to_string())?;
        if seq == 0 || seq > last {
            return Err(format!(
                "--at-seq {seq}: the log holds events 1 to {last}; name one of them"
            ));
        }
        let scratch = tempfile::tempdir().map_err(|e| e.to_string())?;
        let p = folded_to(&log, &scratch.path().join("projection"), state_config, seq).await?;
        asked.fits(p.state()).map_err(problem)?;
        // The log's settings at that sequence, as the server folded them there.
        let policy = p.state().policy_config(&policy);
        api::routes::whatif::answer(p.state(), &policy, &p.kept(), &asked, None)
            .map(|a| a.json())
            .map_err(problem)
    })
}

/// A projection in `dir` (a scratch one) of `log` folded from its first event to `seq`, with
/// `config` until the log sets its own.
pub async fn folded_to(
    log: &AnyLog,
    dir: &Path,
    config: ledger::StateConfig,
    seq: u64,
) -> Result<projector::Projector, String> {
    let mut p = projector::Projector::open(dir, config, log)
        .await
        .map_err(|e| e.to_string())?;
    while p.last_seq() < seq {
        let want = (seq - p.last_seq()).min(projector::BATCH as u64) as usize;
        let events = log
            .read(p.last_seq() + 1, want)
            .await
            .map_err(|e| e.to_string())?;
        if events.is_empty() {
            return Err(format!("the log has no event after {}", p.last_seq()));
        }
        let upto: Vec<_> = events.into_iter().take_while(|e| e.seq <= seq).collect();
        p.apply(&upto).map_err(|e| e.to_string())?;
    }
    Ok(p)
}
