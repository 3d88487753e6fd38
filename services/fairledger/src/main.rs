//! `fairledger`: the one binary of the scheduling ledger.
//!
//! Today it folds ledgers: `demo` runs the built-in demo cluster through the scheduler with a
//! virtual clock and prints who was owed and who got what; `replay` folds any ledger written as
//! JSON lines and prints the same audit. `serve`, `agent` and `sim` join as their crates land.

mod audit;
mod demo;

use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ledger::policy::{self, PolicyConfig};
use ledger::{Envelope, Outcome, State, StateConfig};

#[derive(Parser)]
#[command(
    name = "fairledger",
    version,
    about = "Event-sourced fair-share scheduling ledger for GPU clusters"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the demo cluster (4 nodes x 8 GPUs, three teams) through the scheduler on a virtual
    /// clock and print owed versus delivered GPU-hours.
    Demo {
        /// Scheduling policy: fairshare, fairtree, fifo or priority.
        #[arg(long, default_value = "fairshare")]
        policy: String,
        /// Simulated hours to report on.
        #[arg(long, default_value_t = 72)]
        hours: u64,
        /// Seed of the demo workload stream.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Also write the ledger as JSON lines to this file.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print the audit as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Fold a ledger written as JSON lines (one event per line, in order) and print the audit.
    Replay {
        /// The events file.
        events: PathBuf,
        /// Read the figures at this time (milliseconds) instead of at the last event.
        #[arg(long)]
        at_ms: Option<u64>,
        /// Print the audit as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("fairledger: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Demo {
            policy,
            hours,
            seed,
            out,
            json,
        } => {
            let Some(_) = policy::by_name(&policy) else {
                return Err(format!(
                    "unknown policy {policy:?}; use one of {}",
                    policy::POLICY_NAMES.join(", ")
                ));
            };
            let name = policy::POLICY_NAMES
                .iter()
                .find(|p| **p == policy)
                .expect("validated");
            let cfg = PolicyConfig {
                policy: name,
                ..PolicyConfig::default()
            };
            let mut writer = match &out {
                Some(path) => Some(BufWriter::new(std::fs::File::create(path).map_err(
                    |e| {
                        format!(
                            "cannot create {}: {e}; check the directory exists and is writable",
                            path.display()
                        )
                    },
                )?)),
                None => None,
            };
            let mut write_error = None;
            let state = demo::run(cfg, hours, seed, |env| {
                if let Some(w) = writer.as_mut() {
                    let line = serde_json::to_string(env).expect("events serialise");
                    if let Err(e) = writeln!(w, "{line}") {
                        write_error.get_or_insert(e);
                    }
                }
            });
            if let Some(w) = writer.as_mut() {
                if let Some(e) = write_error.take().or_else(|| w.flush().err()) {
                    return Err(format!("writing the ledger failed: {e}"));
                }
            }
            audit::print(
                &state,
                &format!("demo, policy {policy}, seed {seed}, {hours} h"),
                json,
            );
            Ok(())
        }
        Command::Replay {
            events,
            at_ms,
            json,
        } => {
            let file = std::fs::File::open(&events)
                .map_err(|e| format!("cannot open {}: {e}", events.display()))?;
            let mut state = State::new(StateConfig::default());
            let mut rejected = 0u64;
            for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
                let line =
                    line.map_err(|e| format!("{}: line {}: {e}", events.display(), i + 1))?;
                if line.trim().is_empty() {
                    continue;
                }
                let env: Envelope = serde_json::from_str(&line)
                    .map_err(|e| format!("{}: line {}: not an event: {e}; each line must be one JSON event (schemas/envelope.json)", events.display(), i + 1))?;
                if let Outcome::Rejected(r) = state.apply(i as u64 + 1, &env) {
                    rejected += 1;
                    eprintln!("line {}: {} rejected: {r}", i + 1, env.event.kind());
                }
            }
            if let Some(t) = at_ms {
                state.advance_to(t);
            }
            audit::print(
                &state,
                &format!("{} ({} rejected)", events.display(), rejected),
                json,
            );
            Ok(())
        }
    }
}
