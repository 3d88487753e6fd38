//! `fairledger agent`: the node agent of one GPU node, on NVML or fake GPUs, against a NATS
//! JetStream ledger or a server's HTTP API; `fairledger agent --discover` lists the GPUs and
//! their readings.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use agent::{AgentConfig, FakeGpus, Fault, GpuSource, Nvml, Telemetry};
use eventlog::jetstream::JetStreamOptions;

use crate::common::{runtime, shutdown_signal};

/// Settings of `agent`.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// NATS server with JetStream, as the servers use.
    #[arg(long, env = "FAIRLEDGER_NATS")]
    pub nats: Option<String>,
    /// Or a server's HTTP API, for nodes that cannot reach NATS (no lease on the node's name
    /// then: run one agent per node).
    #[arg(long, env = "FAIRLEDGER_API", conflicts_with = "nats")]
    pub api: Option<String>,
    /// With --api: a file holding this node's agent token (`fairledger token create --role
    /// agent --node NODE`); else the FAIRLEDGER_TOKEN variable.
    #[arg(long, env = "FAIRLEDGER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// With an https --api: the CA certificate (PEM) to check its certificate against.
    #[arg(long, env = "FAIRLEDGER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// The node's name in the cluster (default: this machine's host name).
    #[arg(long, env = "FAIRLEDGER_NODE")]
    pub node: Option<String>,
    /// Use N fake GPUs instead of NVML (tests, demos, machines without a driver).
    #[arg(long, value_name = "N")]
    pub fake_gpus: Option<u32>,
    /// Model name of the fake GPUs.
    #[arg(long, default_value = "H100")]
    pub fake_model: String,
    /// A scripted fault of the fake GPUs: GPU@SECONDS (that GPU goes unhealthy) or
    /// silent@SECONDS (heartbeats stop). Repeat for more.
    #[arg(long, value_name = "SPEC")]
    pub fake_fault: Vec<Fault>,
    /// Register this model instead of the one derived from the GPUs' names (e.g. H100).
    #[arg(long)]
    pub model: Option<String>,
    /// A topology label, KEY=VALUE (e.g. rack=r1). Repeat for more.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_label)]
    pub label: Vec<(String, String)>,
    /// Seconds between heartbeats.
    #[arg(long, env = "FAIRLEDGER_HEARTBEAT_S", default_value_t = 5.0, value_parser = parse_seconds)]
    pub heartbeat_s: f64,
    /// Seconds before a run whose launch failed is launched again (four times longer after a
    /// second failure; after the third it fails with the reason).
    #[arg(long, env = "FAIRLEDGER_LAUNCH_BACKOFF_S", default_value_t = 2.0, value_parser = parse_seconds)]
    pub launch_backoff_s: f64,
    /// Where runs keep their directories and output logs.
    #[arg(long, env = "FAIRLEDGER_WORK_DIR", default_value = "fairledger-agent")]
    pub work_dir: PathBuf,
    /// Run each workload as the Unix user named like its submitter (the principal `alice`
    /// runs as `alice`, never as root), so a job cannot read the agent's token, keys or run
    /// directories, nor another user's files. The agent must run as root.
    #[arg(long, env = "FAIRLEDGER_RUN_AS_SUBMITTER")]
    pub run_as_submitter: bool,
    /// Seconds to keep trying a NATS server that is not up yet, or a cluster still forming.
    #[arg(long, env = "FAIRLEDGER_NATS_WAIT_S", default_value_t = 30)]
    pub nats_wait_s: u64,
    /// Replicas of the JetStream streams and the lease bucket: 1, or 3 in a cluster.
    #[arg(long, env = "FAIRLEDGER_REPLICAS", default_value_t = 1)]
    pub replicas: usize,
    #[command(flatten)]
    pub credentials: crate::common::NatsArgs,
    /// List the GPUs with their readings and exit.
    #[arg(long)]
    pub discover: bool,
    /// Pretend this machine's clock is off by this many milliseconds (for testing skew).
    #[arg(long, hide = true, default_value_t = 0, allow_hyphen_values = true)]
    pub clock_skew_ms: i64,
}

/// How agents of this binary launch a workload: through `fairledger agent-shim`, or through
/// the program `FAIRLEDGER_AGENT_SHIM` names, given the same arguments (a site's wrapper that
/// sets up the run and then executes `fairledger agent-shim DIR -- COMMAND...`).
pub fn shim() -> Result<Vec<OsString>, String> {
    let program = match std::env::var_os("FAIRLEDGER_AGENT_SHIM") {
        Some(program) => program,
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find this program to launch workloads through: {e}"))?
            .into_os_string(),
    };
    Ok(vec![program, OsString::from("agent-shim")])
}

/// A positive number of seconds, at most a day.
fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!(
            "{s:?}: give a number of seconds above 0 and at most 86400, e.g. 2.5"
        )),
    }
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("label {s:?}: write KEY=VALUE, e.g. rack=r1")),
    }
}

/// Whether lease holder `holder` (`host:pid:…`, as agents write it) was a process of this
/// machine that no longer runs.
fn dead_here(holder: &str) -> bool {
    let mut parts = holder.splitn(3, ':');
    let (Some(host), Some(pid)) = (parts.next(), parts.next()) else {
        return false;
    };
    host == host_name()
        && pid.parse::<u32>().is_ok_and(|pid| {
            pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        })
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "node".to_owned())
}

fn source(args: &AgentArgs) -> Result<Box<dyn GpuSource>, String> {
    match args.fake_gpus {
        Some(n) => Ok(Box::new(FakeGpus::new(
            n,
            &args.fake_model,
            args.fake_fault.clone(),
        )?)),
        None if !args.fake_fault.is_empty() => {
            Err("--fake-fault needs --fake-gpus: real GPUs fail on their own".into())
        }
        None => Nvml::open()
            .map(|n| Box::new(n) as _)
            .map_err(|e| e.to_string()),
    }
}

/// `fairledger agent --discover`: every GPU with its readings.
fn discover(args: &AgentArgs) -> Result<(), String> {
    let mut source = source(args)?;
    let readings = source
        .read(Duration::ZERO, &[])
        .map_err(|e| e.to_string())?;
    println!("{}", source.describe());
    println!(
        "{:>3}  {:<42} {:<24} {:>5} {:>14} {:>6} {:>6} {:>5}  HEALTH",
        "GPU", "UUID", "NAME", "UTIL", "MEMORY MiB", "TEMP", "POWER", "ECC"
    );
    for (g, r) in source.gpus().iter().zip(&readings) {
        let health = match (&r.fault, r.ecc_errors_uncorrected) {
            (Some(f), _) => f.clone(),
            (None, n) if n > 0 => "uncorrected ECC errors".into(),
            _ => "ok".into(),
        };
        println!(
            "{:>3}  {:<42} {:<24} {:>4}% {:>14} {:>5}C {:>5}W {:>5}  {health}",
            g.index,
            g.uuid.as_deref().unwrap_or("-"),
            g.name,
            r.utilization_pct,
            format!("{}/{}", r.memory_used_mib, r.memory_total_mib),
            r.temperature_c,
            r.power_w,
            r.ecc_errors_uncorrected,
        );
    }
    Ok(())
}

pub fn agent(args: AgentArgs) -> Result<(), String> {
    if args.discover {
        return discover(&args);
    }
    if args.nats.is_none() && args.api.is_none() {
        return Err("the agent needs --nats URL (the NATS server the scheduler uses) or --api URL (a server's HTTP API); an embedded `fairledger serve` runs its demo cluster's agents itself".into());
    }
    if !(args.heartbeat_s.is_finite() && args.heartbeat_s > 0.0) {
        return Err("--heartbeat-s must be a positive number of seconds".into());
    }
    let node = args.node.clone().unwrap_or_else(host_name);
    ledger::names::node(&node)
        .map_err(|reason| format!("node name {node:?}: {reason}; pass --node"))?;
    let source = source(&args)?;
    let shim = shim()?;
    let mut config = AgentConfig::new(&node, args.work_dir.clone(), shim);
    config.labels = args.label.iter().cloned().collect::<BTreeMap<_, _>>();
    config.model = args.model.clone();
    config.heartbeat = Duration::from_secs_f64(args.heartbeat_s);
    config.clock_skew_ms = args.clock_skew_ms;
    config.launch_backoff = Duration::from_secs_f64(args.launch_backoff_s);
    config.run_as_submitter = args.run_as_submitter;
    if let Some(api) = args.api.clone() {
        let token = match &args.token_file {
            Some(path) => crate::common::read_token_file(path)?,
            None => std::env::var("FAIRLEDGER_TOKEN")
                .ok()
                .filter(|t| !t.trim().is_empty())
                .ok_or_else(|| {
                    format!("an agent over --api needs this node's agent token: pass --token-file (make one with `fairledger token create --name {node} --role agent --out FILE`) or set FAIRLEDGER_TOKEN")
                })?,
        };
        crate::common::warn_if_clear(&api, true);
        // The work directory is this agent's alone, and names it: restarted on it (after a
        // crash, say), the agent is the same holder and drives its node again at once.
        let (_lock, holder) = work_dir_identity(&args.work_dir)?;
        return runtime()?.block_on(async move {
            let log = agent::http::HttpLog::new(&api, &node, &token, args.ca_file.as_deref())?
                .with_holder(&holder);
            config.actor = log.whoami().await.map_err(|e| format!("{e} (API {api})"))?;
            // One agent per node: another driving it (from outside, or inside the server) is
            // named, and this one does not start.
            log.claim().await.map_err(|e| format!("{e} (API {api})"))?;
            let telemetry = Telemetry::Http(log.clone());
            let shipping = agent::ship::Shipping::Http(log.clone());
            let agent = agent::Agent::new(log.clone(), telemetry, source, config)
                .with_output(shipping)
                .stop_when_refused(log.refused())
                .with_specs_from(log);
            agent
                .run(shutdown_signal())
                .await
                .map_err(|e| format!("{e} (API {api})"))?;
            eprintln!("agent stopped; its workloads keep running and the next agent on this node re-adopts them");
            Ok(())
        });
    }
    let url = args.nats.clone().expect("checked");
    runtime()?.block_on(async move {
        // An agent's NATS user may read the ledger and publish its own node's subjects only:
        // it binds to the streams the service made, and its reports go through the service.
        let options = JetStreamOptions {
            replicas: args.replicas,
            manage_streams: false,
            auth: args
                .credentials
                .auth(Some(eventlog::access::inbox_prefix(&node)))?,
            ..Default::default()
        };
        let js = crate::common::connect_waiting(&url, options, args.nats_wait_s).await?;
        // The node's name is this agent's while it renews the lease: a second agent for the
        // same node is refused until this one has been silent for the lease's lifetime (the
        // bucket's, as whoever created it chose).
        let holder = format!("{}:{}:{}", host_name(), std::process::id(), uuid::Uuid::now_v7());
        let mut lease = eventlog::lease::Lease::open(
            js.context(),
            eventlog::lease::AGENTS_BUCKET,
            &eventlog::subject::token(&node),
            &holder,
            eventlog::lease::AGENTS_TTL,
            args.replicas,
        )
        .await?;
        let ttl = lease.ttl().await?;
        // A holder that crashed (this node's previous agent, say) loses the lease within its
        // lifetime: wait that long before refusing. One that ran on this machine and is gone is
        // known dead at once.
        let deadline = tokio::time::Instant::now() + ttl + Duration::from_secs(1);
        let mut unheld = 0;
        while !lease.hold().await {
            match lease.holder().await {
                Some(other) => {
                    if dead_here(&other) && lease.take_from(&other).await {
                        tracing::info!(previous = %other, "took over from this node's crashed agent");
                        break;
                    }
                }
                // Nobody holds it, yet it cannot be taken: NATS refuses this user the key.
                None => {
                    unheld += 1;
                    if unheld >= 4 {
                        return Err(format!(
                            "cannot claim node {node:?} in the lease bucket {}: this NATS user is not that node's agent (check --nats-nkey and --node), or NATS refuses writes",
                            eventlog::lease::AGENTS_BUCKET
                        ));
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                let other = lease.holder().await.unwrap_or_else(|| "another agent".into());
                return Err(format!(
                    "node {node:?} is driven by another agent ({other}); stop it, or pass another --node"
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let log = agent::nats::RelayLog::new(js.clone(), &node);
        // Renewed by a task of its own, whatever the agent is busy with.
        let (lost_tx, lost) = tokio::sync::oneshot::channel::<String>();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(ttl / 3).await;
                if !lease.hold().await {
                    let _ = lost_tx.send(format!(
                        "lost the lease on node {node:?} to another agent: stopping"
                    ));
                    return;
                }
            }
        });
        let telemetry = Telemetry::JetStream(Box::new(js.clone()));
        // Output goes to the OUTPUT stream the service made; without it, it stays on the node.
        let shipping = match js.output(&Default::default()).await {
            Ok(store) => agent::ship::Shipping::Store(eventlog::output::AnyOutput::JetStream(store)),
            Err(e) => {
                tracing::warn!(error = %e, "runs' output is not shipped");
                agent::ship::Shipping::Off
            }
        };
        let agent = agent::Agent::new(log, telemetry, source, config).with_output(shipping);
        let (tx, rx) = tokio::sync::oneshot::channel::<String>();
        let stop = async move {
            tokio::select! {
                _ = shutdown_signal() => {}
                why = lost => {
                    if let Ok(why) = why {
                        let _ = tx.send(why);
                    }
                }
            }
        };
        agent.run(stop).await.map_err(|e| e.to_string())?;
        match rx.await {
            Ok(why) => Err(why),
            Err(_) => {
                eprintln!("agent stopped; its workloads keep running and the next agent on this node re-adopts them");
                Ok(())
            }
        }
    })
}

/// Locks `dir` for this agent (another agent on it is refused, as two would launch the same
/// runs) and reads the id it keeps there (`agent.id`), made on its first use.
fn work_dir_identity(dir: &std::path::Path) -> Result<(std::fs::File, String), String> {
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(dir).map_err(|e| {
        format!(
            "cannot create the work directory {}: {e}; pass another --work-dir",
            dir.display()
        )
    })?;
    let path = dir.join("agent.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns, for as long as `lock` lives.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(format!(
            "another agent uses the work directory {}: stop it, or pass another --work-dir",
            dir.display()
        ));
    }
    let id_path = dir.join("agent.id");
    let id = match std::fs::read_to_string(&id_path) {
        Ok(id) if !id.trim().is_empty() => id.trim().to_owned(),
        _ => {
            let id = uuid::Uuid::now_v7().to_string();
            std::fs::write(&id_path, &id)
                .map_err(|e| format!("cannot write {}: {e}", id_path.display()))?;
            id
        }
    };
    Ok((lock, id))
}
