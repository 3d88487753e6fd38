//! Plumbing every command shares: where the log is and how to reach it, the runtime, signals,
//! the cluster's settings from a config file, token files. Commands depend on this module, not
//! on each other's.

use std::path::{Path, PathBuf};

use eventlog::{AnyLog, EmbeddedLog, JetStreamLog, JetStreamOptions, NatsAuth};
use ledger::policy::{self, PolicyConfig};
use ledger::StateConfig;

/// Where the event log is.
#[derive(clap::Args, Clone, Debug)]
pub struct LogArgs {
    /// NATS server with JetStream (2.12 or newer); without it the embedded log in --data is used.
    #[arg(long, env = "FAIRLEDGER_NATS")]
    pub nats: Option<String>,
    /// Data directory of the embedded log (and of projections by default).
    #[arg(long, env = "FAIRLEDGER_DATA", default_value = "fairledger-data")]
    pub data: PathBuf,
    /// Replicas of the JetStream streams: 1, or 3 in a cluster.
    #[arg(long, env = "FAIRLEDGER_REPLICAS", default_value_t = 1)]
    pub replicas: usize,
    /// Gather concurrent appends into atomic batches (use with a server that fsyncs always).
    #[arg(long, env = "FAIRLEDGER_GROUP_COMMIT")]
    pub group_commit: bool,
    /// Seconds to keep trying a NATS server that is not up yet, or a cluster still forming,
    /// before giving up.
    #[arg(long, env = "FAIRLEDGER_NATS_WAIT_S", default_value_t = 30)]
    pub nats_wait_s: u64,
    #[command(flatten)]
    pub credentials: NatsArgs,
}

/// Who this process is to NATS, and how the connection is secured.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct NatsArgs {
    /// A NATS credentials file (user JWT and nkey seed, as `nsc` writes them).
    #[arg(long, env = "FAIRLEDGER_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// A file holding this process's NATS nkey seed (`fairledger nats-auth` writes them).
    #[arg(long, env = "FAIRLEDGER_NATS_NKEY")]
    pub nats_nkey: Option<PathBuf>,
    /// A NATS user name; its password comes from FAIRLEDGER_NATS_PASSWORD.
    #[arg(long, env = "FAIRLEDGER_NATS_USER")]
    pub nats_user: Option<String>,
    /// The CA certificate (PEM) to verify the NATS server's TLS certificate; TLS is required
    /// with it.
    #[arg(long, env = "FAIRLEDGER_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// A client certificate (PEM), for NATS servers that verify their clients.
    #[arg(long, env = "FAIRLEDGER_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "FAIRLEDGER_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// The NATS settings these arguments name; replies arrive under `inbox_prefix` when given.
    pub fn auth(&self, inbox_prefix: Option<String>) -> Result<NatsAuth, String> {
        let user = match &self.nats_user {
            None => None,
            Some(user) => {
                let password = std::env::var("FAIRLEDGER_NATS_PASSWORD").map_err(|_| {
                    format!("--nats-user {user} needs its password in FAIRLEDGER_NATS_PASSWORD")
                })?;
                Some((user.clone(), password))
            }
        };
        Ok(NatsAuth {
            creds: self.nats_creds.clone(),
            nkey: self.nats_nkey.clone(),
            user,
            tls_ca: self.nats_tls_ca.clone(),
            tls_client: self.nats_tls_cert.clone().zip(self.nats_tls_key.clone()),
            inbox_prefix,
        })
    }
}

/// Connects to JetStream at `url`, trying again for up to `wait_s` seconds while the server is
/// not up yet or a cluster is still forming (backing off to 5 s, and saying so); a setting that
/// is wrong fails at once.
pub async fn connect_waiting(
    url: &str,
    options: JetStreamOptions,
    wait_s: u64,
) -> Result<JetStreamLog, String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
    let mut wait = std::time::Duration::from_millis(250);
    loop {
        match JetStreamLog::connect(url, options.clone()).await {
            Ok(log) => return Ok(log),
            Err(e) if e.is_transient() && std::time::Instant::now() < deadline => {
                tracing::warn!(
                    "{e}; trying again in {:.1} s (up to --nats-wait-s {wait_s})",
                    wait.as_secs_f64()
                );
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(std::time::Duration::from_secs(5));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

impl LogArgs {
    /// Opens the log these arguments name.
    pub async fn open(&self) -> Result<AnyLog, String> {
        private_dir(&self.data)?;
        match &self.nats {
            Some(url) => {
                let options = JetStreamOptions {
                    replicas: self.replicas,
                    group_commit: self.group_commit,
                    auth: self.credentials.auth(None)?,
                    ..Default::default()
                };
                connect_waiting(url, options, self.nats_wait_s)
                    .await
                    .map(|log| AnyLog::JetStream(Box::new(log)))
            }
            None => EmbeddedLog::open(&self.data.join("log"))
                .map(AnyLog::Embedded)
                .map_err(|e| e.to_string()),
        }
    }

    /// The log in words.
    pub fn describe(&self) -> String {
        match &self.nats {
            Some(url) => format!("JetStream at {url}"),
            None => format!("the embedded log in {}", self.data.join("log").display()),
        }
    }
}

/// Makes the data directory `dir` (the log, the projection, tokens, runs: submissions'
/// commands and environments) reachable by its owner only, creating it if need be.
fn private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let failed =
        |e: std::io::Error| format!("cannot prepare the data directory {}: {e}", dir.display());
    if !dir.exists() {
        return std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(failed);
    }
    let mode = std::fs::metadata(dir).map_err(failed)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700))
            .map_err(failed)?;
        eprintln!(
            "made {} reachable by its owner only (it was {:o}): it holds submissions' commands and environments",
            dir.display(),
            mode & 0o777
        );
    }
    Ok(())
}

/// A runtime for one command.
pub fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The cluster's settings and set-up events: from the scenario file `config`, else the demo's;
/// `policy` names the policy over the config's. Also the config's heartbeat timeout, if any.
pub fn settings(
    config: Option<&std::path::Path>,
    policy: Option<&str>,
) -> Result<(StateConfig, PolicyConfig, Vec<ledger::Event>, Option<u64>), String> {
    Ok(match config {
        Some(path) => {
            let scenario = sim::scenario::Scenario::load(path).map_err(|e| e.to_string())?;
            let prepared = scenario
                .prepare_cluster(policy, false)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            // A live cluster's writers have clocks of their own: tolerate their skew as the
            // default does (a simulation's events are exact).
            let state_config = StateConfig {
                clock_skew_tolerance_ms: StateConfig::default().clock_skew_tolerance_ms,
                ..prepared.state_config
            };
            (
                state_config,
                prepared.policy,
                prepared.setup,
                Some(prepared.heartbeat_timeout_ms),
            )
        }
        None => {
            let name = policy.unwrap_or("fairshare");
            let name = policy::POLICY_NAMES
                .iter()
                .find(|p| **p == name)
                .ok_or_else(|| {
                    format!(
                        "unknown policy {name:?}; use one of {}",
                        policy::POLICY_NAMES.join(", ")
                    )
                })?;
            let policy = PolicyConfig {
                policy: name,
                ..PolicyConfig::default()
            };
            (StateConfig::default(), policy, crate::demo::cluster(), None)
        }
    })
}

/// Reads a token from `path`: its first line, trimmed.
pub fn read_token_file(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                eprintln!(
                    "warning: the token file {} can be read by others; chmod 600 it",
                    path.display()
                );
            }
        }
    }
    let token = text.lines().next().unwrap_or("").trim().to_owned();
    if token.is_empty() {
        return Err(format!("the token file {} is empty", path.display()));
    }
    Ok(token)
}

/// Warns, once, that a token is about to cross a network in clear.
pub fn warn_if_clear(api: &str, with_token: bool) {
    if with_token && api.starts_with("http://") && !is_local(api) {
        eprintln!(
            "warning: sending a token to {api} over plain HTTP: anyone on the way can read it; serve with --tls-cert and use https://"
        );
    }
}

/// Whether `api` is a server on this machine.
pub fn is_local(api: &str) -> bool {
    let host = api
        .split("://")
        .nth(1)
        .unwrap_or(api)
        .split(['/', '?'])
        .next()
        .unwrap_or("");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    matches!(host, "127.0.0.1" | "localhost" | "[::1]")
}
