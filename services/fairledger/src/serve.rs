//! `fairledger serve`: the API, the projector and the scheduler in one process.

use eventlog::{Append, EventLog};
use ledger::settings::Settings;
use ledger::Envelope;

use crate::common::{runtime, settings, shutdown_signal, LogArgs};

/// The least time between two checkpoints of the projection: each pauses the fold while it
/// serializes the state, so under a heavy stream they are spaced out (a restart refolds at most
/// this long's events on top of the last one).
const CHECKPOINT_GAP: std::time::Duration = std::time::Duration::from_secs(60);

/// The most nodes an embedded server drives with agents of its own (each folds the ledger).
const IN_PROCESS_AGENTS_MAX: usize = 64;

/// Where the demo's workloads may post their notifications: this machine.
const DEMO_NOTIFY_URLS: [&str; 3] = ["http://127.0.0.1", "http://localhost", "http://[::1]"];

/// Settings of `serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub log: LogArgs,
    /// Address to listen on (port 0 picks a free one; the address is printed).
    #[arg(long, env = "FAIRLEDGER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Scheduling policy: fairshare, fairtree, fifo or priority (default: the config's, else
    /// fairshare).
    #[arg(long, env = "FAIRLEDGER_POLICY")]
    pub policy: Option<String>,
    /// The cluster: a scenario file as `fairledger sim` reads it (`[policy]` settings, `[[nodes]]`,
    /// `[[allocations]]`; see ops/cluster.toml). Its nodes and allocations are written to an empty
    /// log instead of the demo cluster.
    #[arg(long, env = "FAIRLEDGER_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// Do not write the demo cluster (or the config's nodes and allocations) to an empty log.
    #[arg(long)]
    pub no_demo: bool,
    /// What this process runs: all (API, projector, scheduler), api (API and projector; several
    /// may share one NATS), or scheduler (projector and scheduler; its HTTP listener answers
    /// health, readiness and metrics). Schedulers fence every decision by the sequence it was
    /// made on, so even two of them never place from stale state.
    #[arg(long, env = "FAIRLEDGER_ROLE", default_value = "all", value_parser = ["all", "api", "scheduler"])]
    pub role: String,
    /// On the embedded log, do not drive the demo's (or the config's) nodes with agents inside
    /// this process: `fairledger agent --api` processes drive them.
    #[arg(long)]
    pub no_agents: bool,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "FAIRLEDGER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "FAIRLEDGER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Run the workloads of this server's own agents as the Unix users named like their
    /// submitters (or their grants' unix_user), never as root; the server must run as root.
    #[arg(long, env = "FAIRLEDGER_RUN_AS_SUBMITTER")]
    pub run_as_submitter: bool,
    /// The key principals' notification secrets derive from (64 hex digits; made when
    /// missing). Default DATA/notify.key; every process of one ledger needs the same.
    #[arg(long, env = "FAIRLEDGER_NOTIFY_KEY_FILE")]
    pub notify_key_file: Option<std::path::PathBuf>,
    /// A node whose agent has not sent a heartbeat for this long has its GPUs marked unhealthy
    /// (its workloads are requeued as hardware failures). Default: --config's `[policy]
    /// heartbeat_timeout_s`, else 30.
    #[arg(long, env = "FAIRLEDGER_HEARTBEAT_TIMEOUT_S")]
    pub heartbeat_timeout_s: Option<f64>,
    /// Page cache of each sled database (the embedded log and the projection), in MiB: what
    /// the server keeps of its history in memory beyond its live work.
    #[arg(long, env = "FAIRLEDGER_CACHE_MB", default_value_t = SERVE_CACHE_MB)]
    pub cache_mb: u64,
    /// Let sled compact the embedded log's and the projection's files in the background: less
    /// disk, but the pages it reads back stay in memory (after an import or a rebuild, tens of
    /// megabytes a minute for many minutes). Off by default.
    #[arg(long, env = "FAIRLEDGER_BACKGROUND_COMPACTION")]
    pub background_compaction: bool,
    /// Connections open at once (lowered to what the file-descriptor limit allows); each must
    /// send its request headers within --header-timeout-s, which also closes idle ones.
    #[arg(long, env = "FAIRLEDGER_MAX_CONNECTIONS", default_value_t = api::conn::Limits::default().max_connections)]
    pub max_connections: usize,
    /// Seconds a connection may take to send a request's headers, or stay idle between requests.
    #[arg(long, env = "FAIRLEDGER_HEADER_TIMEOUT_S", default_value_t = api::conn::Limits::default().header_timeout.as_secs_f64())]
    pub header_timeout_s: f64,
    /// When --config, --policy or --heartbeat-timeout-s differ from the settings the log
    /// holds, append them as the log's settings from now on, instead of refusing to start.
    #[arg(long)]
    pub change_settings: bool,
}

/// The server's page cache per sled database, in MiB, unless `--cache-mb` says otherwise. The
/// commands that fold the whole log (`log import`, `project`, `audit verify`) keep sled's own
/// 1 GiB. A server needs little: its live work is in its state, and it reads its history only
/// for audits and ended workloads. On the 10-million-event ledger with 50,000 submissions
/// waiting (background compaction off), 16 MiB left it at 196 MB resident, 32 MiB at
/// 207–209 MB and 128 MiB at 220 MB, taking submissions as fast (see BENCHMARKS.md).
pub const SERVE_CACHE_MB: u64 = 32;

pub fn serve(args: ServeArgs) -> Result<(), String> {
    let (state_config, policy, setup, configured_timeout_ms) =
        settings(args.config.as_deref(), args.policy.as_deref())?;
    if args.max_connections == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    if !(args.header_timeout_s.is_finite()
        && args.header_timeout_s > 0.0
        && args.header_timeout_s < 86_400.0)
    {
        return Err("--header-timeout-s must be a positive number of seconds under a day".into());
    }
    let heartbeat_timeout_ms =
        match args.heartbeat_timeout_s {
            Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => (s * 1000.0) as u64,
            Some(_) => return Err(
                "--heartbeat-timeout-s must be a positive number of seconds, at most a day (86400)"
                    .into(),
            ),
            None => configured_timeout_ms.unwrap_or(ledger::health::DEFAULT_TIMEOUT_MS),
        };
    if args.cache_mb == 0 {
        return Err("--cache-mb must be at least 1 (MiB)".into());
    }
    eventlog::embedded::set_cache_bytes(args.cache_mb * 1024 * 1024);
    eventlog::embedded::set_background_compaction(args.background_compaction);
    let embedded = args.log.nats.is_none();
    // The nodes the embedded server drives itself, with fake GPUs: the demo's or the config's.
    let fake_nodes: Vec<ledger::event::NodeRegistered> = setup
        .iter()
        .filter_map(|e| match e {
            ledger::Event::NodeRegistered(n) => Some(n.clone()),
            _ => None,
        })
        .collect();
    if embedded && !args.no_demo && !args.no_agents && fake_nodes.len() > IN_PROCESS_AGENTS_MAX {
        return Err(format!(
            "the cluster has {} nodes; an embedded server drives at most {IN_PROCESS_AGENTS_MAX} with agents of its own: pass --no-agents and run `fairledger agent --api` per node, or use --nats",
            fake_nodes.len()
        ));
    }
    runtime()?.block_on(async move {
        let log = args.log.open().await?;
        let c = &args.log.credentials;
        if !embedded && c.nats_creds.is_none() && c.nats_nkey.is_none() && c.nats_user.is_none() {
            eprintln!("warning: no NATS credentials: whoever reaches this NATS can write the ledger, whatever the API allows; see `fairledger nats-auth` and ops/nats/secure.conf");
        }
        // The settings this process was started with: the log's first event when it is new.
        let mut wanted = Settings::from_configs(&state_config, &policy, heartbeat_timeout_ms);
        if embedded && args.config.is_none() && !args.no_demo {
            // The demo, on one machine: its workloads may notify whoever listens on it.
            wanted.notify_urls = DEMO_NOTIFY_URLS.iter().map(|u| u.to_string()).collect();
        }
        wanted
            .check()
            .map_err(|r| format!("the settings are invalid: {r}"))?;
        // Those given explicitly must be the log's: every one with --config, else the flags'.
        let all = serde_json::to_value(&wanted).expect("settings serialize");
        let given: serde_json::Map<String, serde_json::Value> = all
            .as_object()
            .expect("settings are an object")
            .iter()
            .filter(|(name, _)| {
                // Where notifications may go is an admin's to change (`settings set`), not a
                // configuration file's.
                name.as_str() != "notify_urls" && args.config.is_some()
                    || (name.as_str() == "policy" && args.policy.is_some())
                    || (name.as_str() == "heartbeat_timeout_s" && args.heartbeat_timeout_s.is_some())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let writes_settings = args.role != "api";
        let write_setup = !args.no_demo && (embedded || args.config.is_some());
        let fresh = log.last_seq().await.map_err(|e| e.to_string())? == 0;
        if fresh && (write_setup || writes_settings) {
            let now = scheduler::wall_clock_ms();
            // The service's own principals come first (the log's root of authority, then the
            // scheduler), then the settings, whoever writes the set-up: it is folded by them.
            let service = api::application::service_grants(&ledger::State::new(Default::default()))?;
            let first = Some(ledger::Event::SettingsSet(wanted.clone()));
            let setup = if write_setup { setup } else { Vec::new() };
            let appends: Vec<Append> = service
                .into_iter()
                .chain(first)
                .chain(setup)
                .map(|e| {
                    Append::event(
                        &Envelope::new(uuid::Uuid::now_v7(), now, api::application::SERVE_ACTOR, e),
                        None,
                        None,
                    )
                })
                .collect();
            for chunk in appends.chunks(eventlog::MAX_BATCH) {
                log.append_batch(chunk.to_vec()).await.map_err(|e| e.to_string())?;
            }
            match &args.config {
                _ if !write_setup => {}
                Some(path) => eprintln!("created the cluster of {}", path.display()),
                None => eprintln!("created the demo cluster: 4 nodes x 8 H100, allocations ai2/olmo/pretrain, ai2/olmo/eval, ai2/tulu, uw/nlp"),
            }
        }
        let serving = match args.role.as_str() {
            "api" => api::Serving::Api,
            "scheduler" => api::Serving::Scheduler,
            _ => api::Serving::All,
        };
        let settings = api::Settings {
            serving,
            state_config,
            policy,
            heartbeat_timeout_ms,
            checkpoint_gap: CHECKPOINT_GAP,
            replicas: args.log.replicas,
            tls: args.tls_cert.clone().zip(args.tls_key.clone()),
            notify_key_file: args.notify_key_file.clone(),
            ledger_settings: writes_settings.then(|| api::LedgerSettings {
                defaults: wanted.clone(),
                given,
                change: args.change_settings,
            }),
            limits: api::conn::Limits {
                max_connections: args.max_connections,
                header_timeout: std::time::Duration::from_secs_f64(args.header_timeout_s),
                ..Default::default()
            },
            ..api::Settings::new(&args.listen, args.log.data.clone())
        };
        let application = api::Application::build(settings, log.clone())
            .await
            .map_err(|e| e.to_string())?;
        if let Some(path) = application.admin_token_file() {
            eprintln!(
                "created the first admin token in {} (readable by you only; the fairledger commands on this machine read it by themselves)",
                path.display()
            );
        }
        eprintln!(
            "listening on {}://{}",
            application.scheme(),
            application.local_addr()
        );
        if serving.api() {
            eprintln!(
                "dashboard: {}://{}/ (sign in with a token, such as the admin's in {})",
                application.scheme(),
                application.local_addr(),
                args.log.data.join("admin.token").display()
            );
        }
        // On the embedded log, the cluster's nodes are driven by agents inside this process,
        // with fake GPUs: workloads run as real processes (`sleep` for the length of their
        // estimate when they name no command), and stop when the server does. Each is the
        // principal of its node's agent token, and reports through the same checks as an
        // agent over HTTP.
        let mut agent_tasks = Vec::new();
        if embedded && serving != api::Serving::Api && !args.no_demo && !args.no_agents {
            let app = application.app().clone();
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Envelope>();
            let heartbeats = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let projection = app.projection().clone();
            let (monitor, clock) = (app.health(), app.clock().clone());
            let stop = application.stopping();
            agent_tasks.push(tokio::spawn(async move {
                scheduler::watch_heartbeats(heartbeats, &projection, &monitor, &clock, stop).await;
                Ok(())
            }));
            let shim = crate::agentcmd::shim()?;
            for node in &fake_nodes {
                // This server drives the node: an agent from outside is refused it.
                app.drive_node_here(
                    &node.node,
                    &format!("the server's own agent (pid {})", std::process::id()),
                )?;
                let dir = args.log.data.join("agents").join(&node.node);
                let token = local_agent_token(&app, &node.node, &dir).await?;
                let log = api::reports::LocalAgentLog::new(app.clone(), &token, &node.node);
                let gpus = agent::FakeGpus::new(node.gpus, &node.model, Vec::new())?;
                let mut config = agent::AgentConfig::new(&node.node, dir, shim.clone());
                config.actor = log.actor().await?;
                config.model = Some(node.model.clone());
                config.labels = node.labels.clone();
                config.stop_runs_on_exit = true;
                config.run_as_submitter = args.run_as_submitter;
                let tx = tx.clone();
                let telemetry = agent::Telemetry::Local(std::sync::Arc::new(move |e: &Envelope| {
                    let _ = tx.send(e.clone());
                }));
                let shipping = app
                    .output()
                    .map_or(agent::ship::Shipping::Off, |o| {
                        agent::ship::Shipping::Store(o.clone())
                    });
                let agent = agent::Agent::new(log, telemetry, Box::new(gpus), config)
                    .with_output(shipping);
                let stop = application.stopping();
                agent_tasks.push(tokio::spawn(async move {
                    agent.run(stop).await.map_err(|e| e.to_string())
                }));
            }
        }
        eprintln!("role: {}", args.role);
        let served = application
            .run_until(async move {
                shutdown_signal().await;
                eprintln!("shutting down");
            })
            .await;
        for task in agent_tasks {
            if let Ok(Err(e)) = task.await {
                eprintln!("a node agent failed: {e}");
            }
        }
        served
    })
}

/// The token of the agent of `node` inside this server, kept in `dir/agent.token` (readable by
/// this user only): the one granted at an earlier start if it is still live, else a new grant.
async fn local_agent_token(
    app: &api::App,
    node: &str,
    dir: &std::path::Path,
) -> Result<String, String> {
    let path = dir.join("agent.token");
    if let Ok(token) = std::fs::read_to_string(&path) {
        let token = token.trim().to_owned();
        let p = app.projection().read().await;
        let live = p
            .state()
            .principals()
            .by_token_sha256(&api::auth::token_sha256(&token))
            .is_some_and(|g| g.node.as_deref() == Some(node));
        if live {
            return Ok(token);
        }
    }
    let (token, token_sha256) = api::auth::new_token()?;
    let grant = ledger::Event::PrincipalGranted(ledger::event::PrincipalGranted {
        name: node.to_owned(),
        role: ledger::event::Role::Agent,
        allocations: Vec::new(),
        node: Some(node.to_owned()),
        token_sha256,
        expires_at_ms: None,
        max_pending: None,
        rates: None,
        notify: None,
        unix_user: None,
    });
    // This node's agent from before (its token file lost): revoked and granted anew. A
    // principal of that name that is not this node's agent is someone else's: refuse.
    let before = app
        .projection()
        .read()
        .await
        .state()
        .principals()
        .get(node)
        .map(|p| p.node.as_deref() == Some(node));
    if before == Some(false) {
        return Err(format!(
            "a principal named {node:?} exists and is not that node's agent: revoke or rename it, or pass --no-agents"
        ));
    }
    if before == Some(true) {
        let revoke = ledger::Event::PrincipalRevoked(ledger::event::PrincipalRevoked {
            name: node.to_owned(),
            reason: Some("the server's own agent lost its token".into()),
        });
        app.write(revoke, None, None, api::application::SERVE_ACTOR)
            .await
            .map_err(|p| {
                format!(
                    "cannot renew the token of node {node}'s agent: {}",
                    p.detail
                )
            })?;
    }
    app.write(grant, None, None, api::application::SERVE_ACTOR)
        .await
        .map_err(|p| format!("cannot grant node {node}'s agent a token: {}", p.detail))?;
    api::application::write_secret(&path, &token)?;
    Ok(token)
}
