//! The application: the projection of the log, the projector and scheduler tasks, the health
//! monitor and the HTTP listener, put together once for `fairledger serve` and for the tests
//! (zero-to-production's `Application::build`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use eventlog::AnyLog;
use ledger::event::{Event, PrincipalGranted, Role};
use ledger::policy::PolicyConfig;
use ledger::StateConfig;
use projector::Projector;
use scheduler::SchedulerConfig;
use tokio::sync::{watch, RwLock};

use crate::App;

/// Why an application could not be built: each step of [`Application::build`] that can fail,
/// with what to do.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The certificate or key for HTTPS.
    #[error("{0}")]
    Tls(String),
    /// The projection could not be opened, rebuilt or caught up.
    #[error(transparent)]
    Projection(#[from] projector::ProjectionError),
    /// The listener could not bind.
    #[error("cannot listen on {listen}: {source}; pass another --listen")]
    Listen {
        /// The address asked for.
        listen: String,
        /// Why.
        source: std::io::Error,
    },
    /// The log, or a store beside it (output, heartbeats, leases), could not be opened.
    #[error("{0}")]
    Log(String),
    /// The settings given and the log's do not agree, or could not be written.
    #[error("{0}")]
    Settings(String),
    /// The service's own principals or the first admin could not be granted.
    #[error("{0}")]
    Grants(String),
    /// A secret (the notification key, a token file) could not be made, read or written.
    #[error("{0}")]
    Secret(String),
}

/// What a process serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serving {
    /// The API, the projector and the scheduler.
    All,
    /// The API and the projector (several may share one NATS).
    Api,
    /// The projector and the scheduler; HTTP answers health, readiness and metrics only.
    Scheduler,
}

impl Serving {
    /// Whether it answers the API (and serves the dashboard).
    pub fn api(self) -> bool {
        self != Serving::Scheduler
    }

    /// Whether it schedules.
    pub fn scheduler(self) -> bool {
        self != Serving::Api
    }
}

/// The settings of an [`Application`].
#[derive(Clone, Debug)]
pub struct Settings {
    /// Address to listen on (port 0 picks a free one).
    pub listen: String,
    /// What this process serves.
    pub serving: Serving,
    /// The data directory: the projection, and the first admin's token.
    pub data: PathBuf,
    /// The fold's settings.
    pub state_config: StateConfig,
    /// The policy and the contract.
    pub policy: PolicyConfig,
    /// A node silent this long has its GPUs marked unhealthy.
    pub heartbeat_timeout_ms: u64,
    /// The least time between two checkpoints of the projection.
    pub checkpoint_gap: Duration,
    /// How often the scheduler decides when no event arrives.
    pub scheduler_tick: Duration,
    /// Replicas of the scheduler's lease bucket on JetStream: 1, or 3 in a cluster.
    pub replicas: usize,
    /// Serve HTTPS with this certificate chain and private key (PEM files).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// What a connection may hold.
    pub limits: crate::conn::Limits,
    /// The ledger's settings this process was started with, to agree with the log's before
    /// the scheduler starts; `None` leaves the log's as they are.
    pub ledger_settings: Option<LedgerSettings>,
    /// How much of runs' output is kept.
    pub output: eventlog::output::OutputLimits,
    /// The clock the API reads (the machine's by default; a test's own to drive time).
    pub clock: crate::app::Clock,
    /// The key principals' notification secrets derive from (`DATA/notify.key` by default;
    /// every process of one ledger needs the same).
    pub notify_key_file: Option<PathBuf>,
}

/// The ledger's settings a process was started with (see [`Settings::ledger_settings`]).
#[derive(Clone, Debug)]
pub struct LedgerSettings {
    /// What a log without settings gets.
    pub defaults: ledger::settings::Settings,
    /// The settings given explicitly (every one, with a configuration file), by name: each
    /// must be the log's, or the process refuses to start.
    pub given: serde_json::Map<String, serde_json::Value>,
    /// Append the given settings when they differ from the log's, instead of refusing.
    pub change: bool,
}

impl LedgerSettings {
    /// Makes the log's settings and these agree before anything else is decided: a log without
    /// settings gets the defaults; one whose settings differ from those given gets them only
    /// with `change`, else the error names every difference.
    async fn agree(&self, app: &App) -> Result<(), String> {
        let (seq, held) = {
            let p = app.inner.projection.read().await;
            (p.state().settings_seq(), p.state().settings().clone())
        };
        let wanted = if seq == 0 {
            self.defaults.clone()
        } else {
            let mut merged = serde_json::to_value(&held).expect("settings serialize");
            for (name, value) in &self.given {
                merged[name] = value.clone();
            }
            serde_json::from_value(merged).map_err(|e| format!("the settings given: {e}"))?
        };
        let differences = held.differences(&wanted);
        if seq > 0 && differences.is_empty() {
            return Ok(());
        }
        if seq > 0 && !self.change {
            return Err(format!(
                "the log's settings (event {seq}) differ from those given: {}; pass --change-settings to make these the log's from now on, or leave --config/--policy/--heartbeat-timeout-s out to keep the log's",
                differences.join(", ")
            ));
        }
        let at = app
            .write(ledger::Event::SettingsSet(wanted), None, None, SERVE_ACTOR)
            .await
            .map_err(|p| format!("cannot write the settings: {}", p.detail))?;
        if seq > 0 {
            tracing::info!(seq = at, changed = %differences.join(", "), "the log's settings changed");
            eprintln!(
                "the log's settings from event {at} on: {}",
                differences.join(", ")
            );
        }
        Ok(())
    }
}

impl Settings {
    /// Defaults for a process serving everything on `listen` with its data in `data`.
    pub fn new(listen: &str, data: PathBuf) -> Self {
        Settings {
            listen: listen.to_owned(),
            serving: Serving::All,
            data,
            state_config: StateConfig::default(),
            policy: PolicyConfig::default(),
            heartbeat_timeout_ms: ledger::health::DEFAULT_TIMEOUT_MS,
            checkpoint_gap: Duration::from_secs(60),
            scheduler_tick: SchedulerConfig::default().tick,
            replicas: 1,
            tls: None,
            limits: Default::default(),
            ledger_settings: None,
            output: Default::default(),
            notify_key_file: None,
            clock: crate::app::Clock::wall(),
        }
    }
}

/// The name of the first admin, created on a ledger without principals.
pub const FIRST_ADMIN: &str = "admin";

/// The actor of what `serve` itself writes (the settings, the first admin, its agents' grants):
/// the log's root of authority, which it grants itself when it first opens a log.
pub const SERVE_ACTOR: &str = "serve";

/// The grants of the service's own principals that `state` lacks, to write as [`SERVE_ACTOR`]:
/// on a log without a root of authority, `serve`'s own (its root); then the scheduler's. Their
/// tokens are thrown away: the service signs in to nothing, it writes to the log.
pub fn service_grants(state: &ledger::State) -> Result<Vec<Event>, String> {
    let principals = state.principals();
    let mut wanted = Vec::new();
    if principals.root().is_none() {
        wanted.push(SERVE_ACTOR);
    }
    if principals
        .get(scheduler::ACTOR)
        .is_none_or(|p| p.role != Role::Service)
    {
        wanted.push(scheduler::ACTOR);
    }
    wanted.into_iter().map(service_grant).collect()
}

/// The grant of the role `service` to `name`, with a token thrown away.
pub fn service_grant(name: &str) -> Result<Event, String> {
    let (_, token_sha256) = crate::auth::new_token()?;
    Ok(Event::PrincipalGranted(PrincipalGranted {
        name: name.into(),
        role: Role::Service,
        allocations: Vec::new(),
        node: None,
        token_sha256,
        expires_at_ms: None,
        max_pending: None,
        rates: None,
        notify: None,
        unix_user: None,
    }))
}

/// The file in the data directory that holds the first admin's token.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// A built application, listening, with its background tasks running.
pub struct Application {
    app: App,
    listener: tokio::net::TcpListener,
    router: axum::Router,
    stop: StopOnDrop,
    tasks: Vec<tokio::task::JoinHandle<Result<(), String>>>,
    admin_token: Option<PathBuf>,
    tls: Option<axum_server::tls_rustls::RustlsConfig>,
    limits: crate::conn::Limits,
}

impl Application {
    /// Opens (or rebuilds) the projection of `log` in `DATA/projection`, catches up, starts the
    /// projector and (unless serving the API only) the scheduler, binds the listener, and on a
    /// ledger without principals creates the first admin.
    pub async fn build(settings: Settings, log: AnyLog) -> Result<Application, BuildError> {
        let tls = match &settings.tls {
            None => None,
            Some((cert, key)) => Some(tls_config(cert, key).await.map_err(BuildError::Tls)?),
        };
        let dir = settings.data.join("projection");
        let mut projection = Projector::open_or_rebuild(&dir, settings.state_config, &log)
            .await?
            .checkpoint_at_most_every(settings.checkpoint_gap);
        projection.catch_up(&log).await?;
        let (applied_tx, applied) = watch::channel(projection.last_seq());
        let projection = Arc::new(RwLock::new(projection));
        let app = App::with_clock(
            log.clone(),
            projection.clone(),
            applied.clone(),
            settings.policy.clone(),
            settings.clock.clone(),
        );
        app.set_heartbeat_timeout(settings.heartbeat_timeout_ms);
        app.set_output(match &log {
            AnyLog::Embedded(l) => eventlog::output::AnyOutput::Embedded(
                l.output(settings.output)
                    .map_err(|e| BuildError::Log(e.to_string()))?,
            ),
            AnyLog::JetStream(js) => eventlog::output::AnyOutput::JetStream(
                js.output(&settings.output)
                    .await
                    .map_err(|e| BuildError::Log(e.to_string()))?,
            ),
        });
        app.set_ready();

        let listener = tokio::net::TcpListener::bind(&settings.listen)
            .await
            .map_err(|source| BuildError::Listen {
                listen: settings.listen.clone(),
                source,
            })?;

        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        {
            let (log, projection) = (log.clone(), projection.clone());
            let stop_signal = stopped(stop_rx.clone());
            tasks.push(tokio::spawn(async move {
                projector::follow(&log, &projection, &applied_tx, stop_signal)
                    .await
                    .map_err(|e| e.to_string())
            }));
        }
        // The service's own principals before anything it writes: from the root on, the fold
        // holds every event's actor to the grants.
        grant_service_principals(&app)
            .await
            .map_err(BuildError::Grants)?;
        // The log's settings before any decision is taken by them.
        if let Some(ledger_settings) = &settings.ledger_settings {
            ledger_settings
                .agree(&app)
                .await
                .map_err(BuildError::Settings)?;
        }
        if settings.serving.scheduler() {
            let config = SchedulerConfig {
                policy: settings.policy.clone(),
                tick: settings.scheduler_tick,
                health: Some(app.health()),
                stuck: app.inner.stuck.clone(),
                metrics: app.inner.metrics.scheduler.clone(),
                clock: settings.clock.clone(),
            };
            let lease = match &log {
                AnyLog::JetStream(js) => Some(
                    eventlog::lease::Lease::open(
                        js.context(),
                        scheduler::LEASE_BUCKET,
                        scheduler::LEASE_KEY,
                        &format!("{}:{}", std::process::id(), uuid::Uuid::now_v7()),
                        Duration::from_secs(10),
                        settings.replicas,
                    )
                    .await
                    .map_err(BuildError::Log)?,
                ),
                AnyLog::Embedded(_) => None,
            };
            let (task_log, task_projection) = (log.clone(), projection.clone());
            let stop_signal = stopped(stop_rx.clone());
            tasks.push(tokio::spawn(async move {
                let (log, projection) = (task_log, task_projection);
                scheduler::run(&log, &projection, applied, &config, lease, stop_signal).await;
                Ok(())
            }));
            // Heartbeats published on NATS (by agents, or by API replicas) reach the
            // scheduler's health monitor through the telemetry stream.
            if let AnyLog::JetStream(js) = &log {
                let heartbeats = js
                    .heartbeats()
                    .await
                    .map_err(|e| BuildError::Log(e.to_string()))?;
                let (projection, monitor) = (projection.clone(), app.health());
                let (clock, stop_signal) = (settings.clock.clone(), stopped(stop_rx.clone()));
                tasks.push(tokio::spawn(async move {
                    scheduler::watch_heartbeats(
                        heartbeats,
                        &projection,
                        &monitor,
                        &clock,
                        stop_signal,
                    )
                    .await;
                    Ok(())
                }));
            }
        }
        // Notifications: every process signs with the same key; the scheduler's posts them.
        let key_file = settings
            .notify_key_file
            .clone()
            .unwrap_or_else(|| settings.data.join("notify.key"));
        let key = crate::notify::load_or_make_key(&key_file).map_err(BuildError::Secret)?;
        let _ = app.inner.notify_key.set(key);
        if settings.serving.scheduler() {
            let notifier = crate::notify::Notifier::open(&settings.data.join("notify"), key)
                .map_err(BuildError::Log)?;
            let _ = app.inner.notifier.set(notifier.clone());
            for deliver in [false, true] {
                let (notifier, app) = (notifier.clone(), app.clone());
                let stop_signal = stopped(stop_rx.clone());
                tasks.push(tokio::spawn(async move {
                    if deliver {
                        notifier.deliver(app, stop_signal).await;
                    } else {
                        notifier.follow(app, stop_signal).await;
                    }
                    Ok(())
                }));
            }
        }
        // Node agents on NATS send their reports to a process serving the API.
        if let (AnyLog::JetStream(js), true) = (&log, settings.serving.api()) {
            let (app, js) = (app.clone(), (**js).clone());
            let stop_signal = stopped(stop_rx.clone());
            tasks.push(tokio::spawn(crate::reports::relay(app, js, stop_signal)));
        }
        // Agents may not create the bucket in which they hold their nodes' names.
        if let AnyLog::JetStream(js) = &log {
            eventlog::lease::ensure_bucket(
                js.context(),
                eventlog::lease::AGENTS_BUCKET,
                eventlog::lease::AGENTS_TTL,
                settings.replicas,
            )
            .await
            .map_err(BuildError::Log)?;
        }
        let router = if settings.serving.api() {
            crate::router(app.clone())
        } else {
            crate::health_router(app.clone())
        };
        let body_timeout = settings.limits.body_timeout;
        let router = router.layer(axum::middleware::from_fn(move |request, next| {
            crate::conn::body_within(body_timeout, request, next)
        }));
        let mut application = Application {
            app,
            listener,
            router,
            stop: StopOnDrop(stop),
            tasks,
            admin_token: None,
            tls,
            limits: settings.limits.fitted(),
        };
        if settings.serving.api() {
            application.admin_token = application
                .first_admin(&settings.data)
                .await
                .map_err(BuildError::Grants)?;
        }
        Ok(application)
    }

    /// On a ledger without principals but the service's own, grants the first admin and writes its token to
    /// `DATA/admin.token`, readable by its owner only. Of several processes starting at once on
    /// one ledger, the fold lets one grant stand; only that one writes the file.
    async fn first_admin(&self, data: &std::path::Path) -> Result<Option<PathBuf>, String> {
        if !self
            .app
            .projection()
            .read()
            .await
            .state()
            .principals()
            .only_service()
        {
            return Ok(None);
        }
        let (token, token_sha256) = crate::auth::new_token()?;
        let grant = Event::PrincipalGranted(PrincipalGranted {
            name: FIRST_ADMIN.into(),
            role: Role::Admin,
            allocations: Vec::new(),
            node: None,
            token_sha256,
            expires_at_ms: None,
            max_pending: None,
            rates: None,
            notify: None,
            unix_user: None,
        });
        match self.app.write(grant, None, None, SERVE_ACTOR).await {
            Ok(_) => {}
            // Another process granted the first admin meanwhile.
            Err(problem) if problem.status == 409 => return Ok(None),
            Err(problem) => {
                return Err(format!("cannot create the first admin: {}", problem.detail))
            }
        }
        let path = data.join(ADMIN_TOKEN_FILE);
        write_secret(&path, &token)?;
        Ok(Some(path))
    }

    /// Where this start wrote the first admin's token, if it created one.
    pub fn admin_token_file(&self) -> Option<&std::path::Path> {
        self.admin_token.as_deref()
    }

    /// `https` when it serves TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// What the handlers share: the log, the projection, the health monitor.
    pub fn app(&self) -> &App {
        &self.app
    }

    /// The router, for calling handlers without a socket.
    pub fn router(&self) -> axum::Router {
        self.router.clone()
    }

    /// Resolves when the application is stopping: for tasks of the caller's (node agents) that
    /// should stop with it.
    pub fn stopping(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        stopped(self.stop.0.subscribe())
    }

    /// Serves until `shutdown` resolves, then stops the background tasks and waits for them
    /// (the projector writes a last checkpoint).
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), String> {
        let handle = axum_server::Handle::new();
        let stopping = handle.clone();
        tokio::spawn(async move {
            shutdown.await;
            stopping.graceful_shutdown(Some(Duration::from_secs(10)));
        });
        let limits = self.limits;
        let scheme = if self.tls.is_some() { "HTTPS" } else { "HTTP" };
        let failed = |e: std::io::Error| format!("the {scheme} server failed: {e}");
        let listener = self.listener.into_std().map_err(failed)?;
        let service = self.router.into_make_service();
        let served = match self.tls {
            None => {
                let mut server = axum_server::from_tcp(listener)
                    .map_err(failed)?
                    .http1_only()
                    .map(|plain| crate::conn::Capped::new(plain, &limits));
                configure(server.http_builder(), &limits);
                server.handle(handle).serve(service).await
            }
            Some(config) => {
                let mut server = axum_server::from_tcp_rustls(listener, config)
                    .map_err(failed)?
                    .http1_only()
                    .map(|tls| crate::conn::Capped::new(tls, &limits));
                configure(server.http_builder(), &limits);
                server.handle(handle).serve(service).await
            }
        }
        .map_err(failed);
        let _ = self.stop.0.send(true);
        let mut failed = None;
        for task in self.tasks {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failed = failed.or(Some(e)),
                Err(e) => failed = failed.or(Some(e.to_string())),
            }
        }
        served?;
        failed.map_or(Ok(()), Err)
    }

    /// Stops the background tasks without serving (tests that call the router directly).
    pub fn stop(&self) {
        let _ = self.stop.0.send(true);
    }
}

/// HTTP/1 only, with the header deadline (which also closes idle keep-alive connections).
fn configure(
    builder: &mut hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    limits: &crate::conn::Limits,
) {
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
}

/// Stops the background tasks when the application is dropped, served or not.
struct StopOnDrop(watch::Sender<bool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

/// The TLS settings of a certificate chain and key in PEM files, with a clear refusal of either.
async fn tls_config(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<axum_server::tls_rustls::RustlsConfig, String> {
    // One process, one provider: ring, as NATS's TLS uses.
    let _ = rustls::crypto::ring::default_provider().install_default();
    axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
        .await
        .map_err(|e| {
            format!(
                "cannot serve HTTPS with --tls-cert {} and --tls-key {}: {e}; give a PEM certificate chain and its PEM private key",
                cert.display(),
                key.display()
            )
        })
}

/// A future that resolves once `rx` says stop.
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Grants the service's own principals that the log lacks ([`service_grants`]). Of several
/// processes starting at once on one log, the fold lets one grant of each stand.
async fn grant_service_principals(app: &App) -> Result<(), String> {
    let grants = service_grants(app.inner.projection.read().await.state())?;
    for grant in grants {
        match app.write(grant, None, None, SERVE_ACTOR).await {
            Ok(_) => {}
            // Another process granted it meanwhile.
            Err(problem) if problem.status == 409 => {}
            Err(problem) => {
                return Err(format!(
                    "cannot grant the service its own principals: {}",
                    problem.detail
                ))
            }
        }
    }
    Ok(())
}

/// Writes `secret` to `path` readable and writable by its owner only (0600), replacing what was
/// there: written to a new file beside it, then renamed over it.
pub fn write_secret(path: &std::path::Path, secret: &str) -> Result<(), String> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(failed)?;
    }
    // A temporary name of this process's own beside it, so a rename replaces it whole.
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut file = options.open(&tmp).map_err(failed)?;
    file.write_all(secret.as_bytes())
        .and_then(|()| file.write_all(b"\n"))
        .and_then(|()| file.sync_all())
        .map_err(failed)?;
    std::fs::rename(&tmp, path).map_err(failed)
}
