//! `fairledger`: the one binary of the scheduling ledger. `fairledger --help` lists every
//! command; they fall in four groups:
//!
//! - running it: `serve` (the API, the projector, the scheduler and, on the embedded log, the
//!   demo's agents), `agent` (a GPU node's agent), `project` (a projection kept up to date);
//! - the log offline: `log import`/`export`, `replay`, `audit verify`, `token create --offline`;
//! - simulating: `demo`, `sim`, `whatif --at-seq`;
//! - the client of a running server (`client/`): `submit`, `queue`, `jobs`, `status`, `logs`,
//!   `explain`, `cancel`, `alloc`, `nodes`, `settings`, `token`, `whoami`, `events`, `audit`,
//!   `whatif`; and `tls self-signed`, `nats-auth` for setting one up.

mod agentcmd;
mod client;
mod common;
mod demo;
mod logcmd;
mod natsauth;
mod recover;
mod serve;

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

// The server allocates and frees small objects on many threads (requests, events, rows):
// mimalloc's thread-local heaps cut the allocator's share (see BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
use ledger::policy::{self, PolicyConfig};
use ledger::StateConfig;

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
    /// Run the scheduling ledger: HTTP API, projector and scheduler in one process. Without
    /// --nats, on the embedded log in --data with a demo cluster of fake GPUs.
    Serve(serve::ServeArgs),
    /// Run a GPU node's agent: register the node, publish GPU readings, launch the workloads
    /// placed on it and stop the ones preempted (NVML, or --fake-gpus N).
    Agent(agentcmd::AgentArgs),
    /// Run one workload for the agent and record how it ended (used by the agent).
    #[command(hide = true)]
    AgentShim {
        /// The run's directory.
        dir: PathBuf,
        /// The command.
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
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
    /// Replay a workload trace through the scheduler on a virtual clock and report owed versus
    /// delivered GPU-hours, waits and the cluster metrics.
    Sim(SimArgs),
    /// Fold a ledger written as JSON lines (one event per line, in order) and print the audit;
    /// without a file, rebuild the projection of the event log (--nats or --data) from sequence
    /// 0 and print its digest.
    Replay {
        /// The events file.
        events: Option<PathBuf>,
        #[command(flatten)]
        log: common::LogArgs,
        /// Build the replayed projection here instead of in a temporary directory.
        #[arg(long)]
        projection: Option<PathBuf>,
        /// Read the figures at this time (milliseconds) instead of at the last event.
        #[arg(long)]
        at_ms: Option<u64>,
        /// Print the audit as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Keep the sled projection of the event log up to date, exactly once, until SIGINT or
    /// SIGTERM; print its digest on the way out.
    Project {
        #[command(flatten)]
        log: common::LogArgs,
        /// The projection directory (default: DATA/projection).
        #[arg(long)]
        projection: Option<PathBuf>,
        /// Catch up with the log, then stop.
        #[arg(long)]
        once: bool,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Work on the event log itself.
    #[command(subcommand)]
    Log(LogCommand),
    /// Write the NATS users of a deployment (service, node agents, readers) with their
    /// permissions, for ops/nats/secure.conf, and a seed file for each.
    NatsAuth(natsauth::NatsAuthArgs),
    /// Submit a workload to a running server.
    Submit {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        submit: client::SubmitArgs,
    },
    /// Show one workload.
    Status {
        #[command(flatten)]
        client: client::ClientArgs,
        /// Workload id.
        id: String,
    },
    /// Cancel a waiting workload, or ask a running one to stop.
    Cancel {
        #[command(flatten)]
        client: client::ClientArgs,
        /// Workload id.
        id: String,
    },
    /// The pending workloads in policy order, with why each waits (like squeue), printed page
    /// after page however long the queue; or, with --summary, how many wait for how many GPUs
    /// by allocation and by reason.
    Queue {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        which: client::QueueArgs,
    },
    /// Grant, list and revoke principals' tokens (admin).
    Token {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: client::TokenCommand,
    },
    /// Who the token speaks for: name, role, scope.
    Whoami {
        #[command(flatten)]
        client: client::ClientArgs,
    },
    /// The nodes: GPUs free, utilization of the held ones, unhealthy GPUs, drained, labels
    /// (like sinfo); or drain or resume one (admin, operator).
    Nodes {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        which: client::NodesArgs,
        #[command(subcommand)]
        command: Option<client::NodesCommand>,
    },
    /// Who would get what over the next hours if a share, a cap, the policy or the capacity
    /// changed: the live state run forward without and with the changes (nothing is written).
    Whatif {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        what: client::WhatIfArgs,
    },
    /// Workloads in any state, newest first, like sacct: state, exit code, times, elapsed,
    /// GPU-hours and where the output is.
    Jobs {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        filter: client::JobsArgs,
    },
    /// Why a workload waits, who is ahead, and when it may start.
    Explain {
        #[command(flatten)]
        client: client::ClientArgs,
        /// Workload id.
        id: String,
    },
    /// Certificates for `serve --tls-cert/--tls-key`.
    Tls {
        #[command(subcommand)]
        command: TlsCommand,
    },
    /// The ledger's settings (policy, contract, grace, margin, window…), or change them.
    Settings {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: Option<client::SettingsCommand>,
    },
    /// The allocation tree (like sshare), or change it.
    Alloc {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(subcommand)]
        command: Option<client::AllocCommand>,
    },
    /// Entitled, owed and delivered GPU-hours per allocation and period (like sreport);
    /// `audit verify` checks the kept figures against the log.
    #[command(args_conflicts_with_subcommands = true)]
    Audit {
        #[command(subcommand)]
        command: Option<AuditCommand>,
        #[command(flatten)]
        client: client::ClientArgs,
        /// Only this allocation and below.
        #[arg(long, short)]
        allocation: Option<String>,
        /// Start: a date (2026-11-01), an RFC 3339 date-time or ms since the epoch; moved back
        /// to the start of its period (default a week before the end).
        #[arg(long)]
        from: Option<String>,
        /// End, the same forms; moved on to the end of its period (default now).
        #[arg(long)]
        to: Option<String>,
        /// hour, day, week (ISO, from Monday) or month, in UTC.
        #[arg(long, default_value = "day")]
        granularity: String,
    },
    /// What a workload's run wrote (stdout and stderr), from anywhere; --follow prints it as
    /// it comes.
    Logs {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        which: client::LogsArgs,
    },
    /// The ledger's events; --follow tails the live stream.
    Events {
        #[command(flatten)]
        client: client::ClientArgs,
        #[command(flatten)]
        which: client::EventsArgs,
    },
}

/// `fairledger tls …`
#[derive(Subcommand)]
enum TlsCommand {
    /// Make a small CA of your own and a server certificate it signs, for `serve
    /// --tls-cert/--tls-key`; the command-line client, agents and curl trust it with
    /// `--ca-file DIR/ca.pem` (curl: `--cacert`).
    SelfSigned {
        /// Names and addresses the server is reached by (repeat for more).
        #[arg(long = "host", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
        hosts: Vec<String>,
        /// Directory to write ca.pem, cert.pem and key.pem (readable by you only) into.
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
}

/// `fairledger audit …`
#[derive(Subcommand)]
enum AuditCommand {
    /// Refold the log from its first event, apart from the projection, and compare every kept
    /// figure with it; print the rows that differ. Exits 0 only when all agree. Works offline,
    /// on the log and projection a server keeps (stop the server, or copy its data directory).
    Verify(Box<logcmd::VerifyArgs>),
    /// The log's head as the server has folded it, `SEQ:HASH`: write it down, and
    /// `audit verify --head SEQ:HASH` proves later that the history behind it is unchanged.
    Head {
        #[command(flatten)]
        client: client::ClientArgs,
    },
}

#[derive(Subcommand)]
enum LogCommand {
    /// Append a ledger written as JSON lines (e.g. a simulation's events.jsonl) to the log;
    /// importing the same file again appends nothing twice.
    Import {
        /// The events file.
        events: PathBuf,
        #[command(flatten)]
        log: common::LogArgs,
        /// Events per atomic batch (1 to 1000).
        #[arg(long, default_value_t = 500)]
        batch: usize,
    },
    /// Write the log's events as stored, one JSON line each (stdout unless --out): a copy that
    /// `log import` reads, and whose chain of heads is the log's.
    Export {
        #[command(flatten)]
        log: common::LogArgs,
        /// Only events after this sequence.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// The file to write.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct SimArgs {
    /// The scenario: cluster, allocation tree, policy, faults.
    #[arg(long)]
    scenario: PathBuf,
    /// The workload trace.
    #[arg(long)]
    workloads: PathBuf,
    /// Trace format: native (CSV or JSON lines by extension), alibaba-openb, philly, helios or
    /// alibaba-pai2020.
    #[arg(long, default_value = "native")]
    format: String,
    /// Policy, overriding the scenario's.
    #[arg(long)]
    policy: Option<String>,
    /// Run each of these policies on the same input, side by side (e.g. fifo,fairshare).
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// Seed for random faults.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// What a preempted run loses: checkpoint (work since its last checkpoint; a workload
    /// that declares no interval resumes where it stopped) or restart (one that declares no
    /// interval starts again from its beginning).
    #[arg(long, default_value = "checkpoint", value_parser = work_model)]
    work_model: sim::WorkModel,
    /// Stop at this simulated second and report on [0, until]; otherwise run until all finish.
    #[arg(long)]
    until: Option<u64>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Skip and count bad trace rows instead of stopping at the first.
    #[arg(long)]
    skip_bad_rows: bool,
    /// The trace column that becomes the allocation: alibaba-openb qos (default), none or
    /// teams:N; philly and helios vc (default) or user; alibaba-pai2020 gpu_type (default), none
    /// or teams:N.
    #[arg(long)]
    allocation_column: Option<String>,
}

/// `fairledger tls self-signed`: a CA made for the purpose (its key is not kept, so it signs
/// nothing else) and a server certificate for `hosts` it signs, with the server's key.
fn tls_self_signed(hosts: &[String], out: &std::path::Path) -> Result<(), String> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |e: rcgen::Error| format!("cannot make the certificates: {e}");
    let ca_key = KeyPair::generate().map_err(failed)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(failed)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "fairledger self-signed CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(failed)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().map_err(failed)?;
    let mut server = CertificateParams::new(hosts.to_vec()).map_err(|e| format!("--host: {e}"))?;
    server.is_ca = IsCa::ExplicitNoCa;
    server.distinguished_name.push(
        DnType::CommonName,
        hosts.first().map_or("localhost", String::as_str),
    );
    server.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = server.signed_by(&key, &issuer).map_err(failed)?;
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let (ca_file, cert_file, key_file) = (
        out.join("ca.pem"),
        out.join("cert.pem"),
        out.join("key.pem"),
    );
    for f in [&ca_file, &cert_file, &key_file] {
        if f.exists() {
            return Err(format!(
                "{} exists; move the old one away first",
                f.display()
            ));
        }
    }
    let write = |path: &std::path::Path, text: String, mode: u32| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| {
                format!(
                    "cannot write {} ({e}); move the old one away first",
                    path.display()
                )
            })
    };
    write(&key_file, key.serialize_pem(), 0o600)?;
    // The server sends its certificate with the CA's, as a chain.
    write(&cert_file, cert.pem() + &ca_cert.pem(), 0o644)?;
    write(&ca_file, ca_cert.pem(), 0o644)?;
    println!(
        "wrote {}, {} and {} for {}\n  serve:   fairledger serve --tls-cert {} --tls-key {}\n  clients: --api https://{}:8080 --ca-file {} (curl --cacert {})",
        ca_file.display(),
        cert_file.display(),
        key_file.display(),
        hosts.join(", "),
        cert_file.display(),
        key_file.display(),
        hosts.first().map_or("localhost", String::as_str),
        ca_file.display(),
        ca_file.display()
    );
    Ok(())
}

/// `--work-model`: checkpoint or restart.
fn work_model(name: &str) -> Result<sim::WorkModel, String> {
    sim::WorkModel::parse(name).ok_or_else(|| format!("{name:?}: use checkpoint or restart"))
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    // Commands that print for a person or a pipe end quietly when the reader goes away
    // (`fairledger events --json | head`), as other command-line tools do. The long-running
    // services keep Rust's default (a closed pipe is an error to handle, never a death).
    if !matches!(
        cli.command,
        Command::Serve(_) | Command::Agent(_) | Command::AgentShim { .. } | Command::Project { .. }
    ) {
        die_quietly_on_closed_pipe();
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            // A message may quote a name from someone else: shown escaped, line by line.
            let safe: Vec<_> = message.lines().map(ledger::names::terminal_safe).collect();
            eprintln!("fairledger: {}", safe.join("\n"));
            ExitCode::FAILURE
        }
    }
}

/// Restores the default action of SIGPIPE (Rust ignores it, so printing to a closed pipe
/// panics instead).
fn die_quietly_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default touches no Rust state; done before
    // any other thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// For a long-running server: no transparent huge pages. Its memory comes and goes in small
/// pieces, and with huge pages every partly used 2 MiB counts as resident and each fresh one is
/// zeroed whole in a page fault, on the path that acknowledges a submission. Bulk commands
/// (import, rebuild, verify) keep them: they run faster with them.
fn without_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and touches no memory of this process.
    unsafe {
        // Refused only by kernels without the call (before 3.15): then nothing changes.
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
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
            let mut collector = sim::report::Collector::default();
            let state = demo::run(cfg, hours, seed, |state, env, outcome| {
                collector.observe(state, env, outcome);
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
            let report = collector.finish(&state, name, seed, 0.0);
            print_report(&report, &format!("demo, seed {seed}"), json);
            Ok(())
        }
        Command::Sim(args) => simulate(args),
        Command::Serve(args) => {
            without_huge_pages();
            serve::serve(args)
        }
        Command::NatsAuth(args) => natsauth::nats_auth(args),
        Command::Agent(args) => {
            without_huge_pages();
            agentcmd::agent(args)
        }
        Command::AgentShim { dir, command } => {
            std::process::exit(agent::run::shim_main(&dir, &command))
        }
        Command::Submit { client, submit } => client::submit(&client, submit),
        Command::Status { client, id } => client::status(&client, &id),
        Command::Cancel { client, id } => client::cancel(&client, &id),
        Command::Queue { client, which } => client::queue(&client, &which),
        Command::Token { client, command } => client::token_command(&client, command),
        Command::Whoami { client } => client::whoami(&client),
        Command::Explain { client, id } => client::explain(&client, &id),
        Command::Jobs { client, filter } => client::jobs(&client, &filter),
        Command::Whatif { client, what } => client::what_if(&client, &what),
        Command::Nodes {
            client,
            which,
            command,
        } => client::nodes(&client, &which, command),
        Command::Alloc { client, command } => {
            client::alloc(&client, command.unwrap_or(client::AllocCommand::List))
        }
        Command::Tls {
            command: TlsCommand::SelfSigned { hosts, out },
        } => tls_self_signed(&hosts, &out),
        Command::Settings { client, command } => {
            client::settings(&client, command.unwrap_or(client::SettingsCommand::Show))
        }
        Command::Audit {
            command: Some(AuditCommand::Verify(args)),
            ..
        } => logcmd::verify(&args),
        Command::Audit {
            command: Some(AuditCommand::Head { client }),
            ..
        } => client::audit_head(&client),
        Command::Audit {
            command: None,
            client,
            allocation,
            from,
            to,
            granularity,
        } => client::audit(
            &client,
            allocation.as_deref(),
            from.as_deref(),
            to.as_deref(),
            &granularity,
        ),
        Command::Events { client, which } => client::events(&client, &which),
        Command::Logs { client, which } => client::logs(&client, &which),
        Command::Replay {
            events: None,
            log,
            projection,
            json,
            ..
        } => logcmd::replay(&log, projection.as_deref(), json),
        Command::Project {
            log,
            projection,
            once,
            json,
        } => logcmd::project(&log, projection.as_deref(), once, json),
        Command::Log(LogCommand::Import { events, log, batch }) => {
            logcmd::import(&log, &events, batch)
        }
        Command::Log(LogCommand::Export { log, after, out }) => {
            logcmd::export(&log, after, out.as_deref())
        }
        Command::Replay {
            events: Some(events),
            at_ms,
            json,
            ..
        } => {
            // Any ledger: the default fold settings, and no policy to name.
            let result = sim::replay(
                &events,
                StateConfig::default(),
                "-",
                at_ms,
                0,
                sim::WorkModel::default(),
            )
            .map_err(|e| e.to_string())?;
            for (rule, n) in &result.rejections {
                eprintln!("{n} events rejected by the ledger: {rule}");
            }
            print_report(&result.report, &events.display().to_string(), json);
            Ok(())
        }
    }
}

fn simulate(args: SimArgs) -> Result<(), String> {
    let scenario = sim::scenario::Scenario::load(&args.scenario).map_err(|e| e.to_string())?;
    let trace = sim::trace::TraceOptions {
        format: sim::trace::Format::parse(&args.format).map_err(|e| e.to_string())?,
        skip_bad_rows: args.skip_bad_rows,
        allocation_column: args.allocation_column.clone(),
    };
    let policies: Vec<Option<String>> = if args.compare.is_empty() {
        vec![args.policy.clone()]
    } else {
        args.compare
            .iter()
            .map(|p| Some(p.trim().to_string()))
            .collect()
    };
    let mut reports = Vec::new();
    for policy in &policies {
        let prepared = scenario
            .prepare(policy.as_deref())
            .map_err(|e| e.to_string())?;
        let name = prepared.policy.policy;
        let out = if args.compare.is_empty() {
            args.out.clone()
        } else {
            args.out.join(name)
        };
        let spec = sim::RunSpec {
            scenario: prepared,
            workloads: args.workloads.clone(),
            trace: trace.clone(),
            seed: args.seed,
            work_model: args.work_model,
            until_s: args.until,
            out: out.clone(),
        };
        let result = sim::run(&spec, progress(name, args.until)).map_err(|e| e.to_string())?;
        for (rule, n) in &result.rejections {
            eprintln!("{name}: {n} events rejected by the ledger: {rule}");
        }
        if result.bad_rows > 0 {
            eprintln!("{name}: skipped {} bad rows", result.bad_rows);
        }
        print_report(&result.report, &out.display().to_string(), false);
        reports.push(result.report);
    }
    if !args.compare.is_empty() {
        let path = args.out.join("compare.json");
        sim::write_json(&path, &serde_json::json!({ "policies": reports }))
            .map_err(|e| e.to_string())?;
        sim::html::write_compare(&args.out, &reports).map_err(|e| e.to_string())?;
        println!("comparison: {} and compare.html", path.display());
    }
    Ok(())
}

/// Prints a report as a table in the shape of sshare/sreport, or as JSON.
fn print_report(r: &sim::report::Report, title: &str, as_json: bool) {
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(r).expect("reports serialise")
        );
        return;
    }
    println!(
        "{title}: policy {}, delivered/owed {:.3}, occupancy {:.3}, impact {:.3}, {} started, {} preemptions, {} contract violations, {} simulated in {:.2} s",
        r.policy,
        r.fairness.delivered_over_owed,
        r.metrics.occupancy,
        r.metrics.impact,
        r.workloads.started,
        r.workloads.preemptions,
        r.workloads.contract_violations,
        client::clock((r.sim.horizon_s * 1000.0) as u64),
        r.sim.wall_s,
    );
    println!(
        "  {:<24} {:>6} {:>12} {:>12} {:>9} {:>12} {:>12} {:>8}",
        "ALLOCATION",
        "WEIGHT",
        "OWED GPU-H",
        "GOT GPU-H",
        "GOT/OWED",
        "WAIT P50",
        "WAIT P90",
        "PREEMPT"
    );
    let wait = |w: Option<f64>| w.map_or("-".into(), |w| client::clock((w * 1000.0) as u64));
    for a in &r.allocations {
        let ratio = if a.owed_gpu_hours > 0.0 {
            format!("{:.3}", a.delivered_gpu_hours / a.owed_gpu_hours)
        } else {
            "-".into()
        };
        println!(
            "  {:<24} {:>6} {:>12.1} {:>12.1} {:>9} {:>12} {:>12} {:>8}",
            a.path,
            a.weight,
            a.owed_gpu_hours,
            a.delivered_gpu_hours,
            ratio,
            wait(a.wait_p50_s),
            wait(a.wait_p90_s),
            a.preemptions
        );
    }
    println!("  (waits as [D-]HH:MM:SS)");
    let c = &r.churn;
    println!(
        "  preemptions: {} workloads preempted, at most {} each (p99 {}, {} more than 3 times); {:.1} GPU-h in grace, {:.1} GPU-h redone ({} model; {:.1} GPU-h if every stopped run restarted from its start)",
        c.workloads_preempted,
        c.per_workload_max,
        c.per_workload_p99,
        c.workloads_more_than_3,
        c.all.grace_gpu_hours,
        c.all.redone_gpu_hours,
        r.sim.work_model.name(),
        c.all.run_gpu_hours,
    );
}

/// A progress bar on stderr over simulated time (a spinner without `--until`); indicatif draws
/// nothing when stderr is not a terminal, and the bar appears only after a second.
fn progress(policy: &str, until_s: Option<u64>) -> impl FnMut(u64) {
    let bar = match until_s {
        Some(u) => indicatif::ProgressBar::new(u),
        None => indicatif::ProgressBar::new_spinner(),
    };
    let style = match until_s {
        Some(_) => "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} simulated s ({per_sec})",
        None => "{prefix} [{elapsed_precise}] {spinner} {pos} simulated s ({per_sec})",
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(style) {
        bar.set_style(style);
    }
    bar.set_prefix(policy.to_string());
    let started = std::time::Instant::now();
    let mut events = 0u64;
    move |t_ms| {
        events += 1;
        // Updating the bar costs more than folding an event: only every 4,096 events, and not
        // at all in the first second.
        if events.is_multiple_of(4096) && started.elapsed().as_secs() >= 1 {
            bar.set_position(t_ms / 1000);
        }
    }
}

/// Warnings and progress to stderr; `FAIRLEDGER_LOG` = error, warn, info (default) or debug.
fn init_logging() {
    let level = std::env::var("FAIRLEDGER_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing::Level>().ok())
        .unwrap_or(tracing::Level::INFO);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}
