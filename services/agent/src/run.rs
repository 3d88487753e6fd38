//! One run of a workload on this node, kept in its own directory so that an agent that restarts
//! finds it again:
//!
//! ```text
//! RUNS/<workload>-<started_at_ms>/
//!   spec.json    what was launched (command, environment)
//!   shim.pid     the shim: the workload's parent, which outlives the agent
//!   pid          the workload's process id, which is also its process group
//!   output.log   the workload's stdout and stderr
//!   exit.json    how it ended (exit code or signal, when), written by the shim
//! ```
//!
//! The directory is created before anything is launched and creating it fails if it exists, so
//! a start is launched at most once, whatever the agent's restarts. The shim ([`shim_main`]) runs
//! the command in its own process group and records its end; the agent signals the group to
//! preempt it.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// What to launch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    /// Program and arguments.
    pub command: Vec<String>,
    /// Environment added to the agent's.
    pub env: BTreeMap<String, String>,
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exit {
    /// Exit code, when it exited.
    pub exit_code: Option<i32>,
    /// Signal, when a signal ended it.
    pub signal: Option<i32>,
    /// When, by this node's clock (milliseconds since the epoch).
    pub ended_at_ms: u64,
    /// Why it could not start, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Where a run stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The workload (or its shim) is alive.
    Running,
    /// It ended and the shim recorded how.
    Ended(Exit),
    /// Neither the shim nor the workload is alive and nothing was recorded.
    Lost,
}

/// The directory of a run.
pub fn dir(runs: &Path, workload: uuid::Uuid, started_at_ms: u64) -> PathBuf {
    runs.join(format!("{workload}-{started_at_ms}"))
}

/// Claims `dir` for a new run: false if it already exists (launched before).
pub fn claim(dir: &Path) -> std::io::Result<bool> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Launches `spec` in the claimed `dir` through `shim` (a program and its leading arguments;
/// the run directory, `--` and the command follow). The shim gets its own process group, so
/// signals meant for the agent do not reach it, and it outlives the agent.
pub fn launch(
    dir: &Path,
    spec: &Spec,
    shim: &[OsString],
) -> std::io::Result<tokio::process::Child> {
    write_atomic(
        &dir.join("spec.json"),
        &serde_json::to_vec_pretty(spec).expect("specs serialize"),
    )?;
    let (program, leading) = shim
        .split_first()
        .ok_or_else(|| std::io::Error::other("no shim program configured"))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(leading)
        .arg(dir)
        .arg("--")
        .args(&spec.command)
        .envs(&spec.env)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(false);
    cmd.spawn()
}

/// Where the run in `dir` stands.
pub fn status(dir: &Path) -> Status {
    if let Some(exit) = read_exit(dir) {
        return Status::Ended(exit);
    }
    let alive = |file: &str| read_pid(dir, file).is_some_and(|p| signal::kill(p, None).is_ok());
    if alive("shim.pid") || alive("pid") {
        Status::Running
    } else if read_exit(dir).is_some() {
        // The shim wrote it between the two looks.
        status(dir)
    } else {
        Status::Lost
    }
}

/// Sends `sig` to the run's process group; false when there is none (not started yet, or gone).
pub fn signal_group(dir: &Path, sig: Signal) -> bool {
    read_pid(dir, "pid").is_some_and(|p| signal::killpg(p, sig).is_ok())
}

fn read_exit(dir: &Path) -> Option<Exit> {
    let bytes = std::fs::read(dir.join("exit.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn read_pid(dir: &Path, file: &str) -> Option<Pid> {
    let text = std::fs::read_to_string(dir.join(file)).ok()?;
    let pid: i32 = text.trim().parse().ok()?;
    (pid > 0).then(|| Pid::from_raw(pid))
}

/// Writes `bytes` to `path` so that a reader sees all of it or nothing.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(tmp, path)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The shim: runs `command` in its own process group with its output in `dir/output.log`,
/// records its process id, waits for it, and records how it ended in `dir/exit.json`. A command
/// that cannot be started ends with exit code 127, as in a shell, and the reason in both files.
/// Returns the shim's own exit code.
pub fn shim_main(dir: &Path, command: &[OsString]) -> i32 {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    if let Err(e) = write_atomic(
        &dir.join("shim.pid"),
        std::process::id().to_string().as_bytes(),
    ) {
        eprintln!("fairledger shim: cannot write to {}: {e}", dir.display());
        return 1;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("output.log"));
    let record = |exit: &Exit| {
        if let Err(e) = write_atomic(
            &dir.join("exit.json"),
            &serde_json::to_vec(exit).expect("exits serialize"),
        ) {
            eprintln!(
                "fairledger shim: cannot record the exit in {}: {e}",
                dir.display()
            );
        }
    };
    let failed = |reason: String| {
        if let Ok(mut log) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(dir.join("output.log"))
        {
            let _ = writeln!(log, "fairledger: {reason}");
        }
        record(&Exit {
            exit_code: Some(127),
            signal: None,
            ended_at_ms: now_ms(),
            error: Some(reason),
        });
        0
    };
    let log = match log {
        Ok(log) => log,
        Err(e) => return failed(format!("cannot open the output log: {e}")),
    };
    let Some((program, args)) = command.split_first() else {
        return failed("no command to run".into());
    };
    let mut cmd = std::process::Command::new(program);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .process_group(0);
    match log.try_clone() {
        Ok(out) => {
            cmd.stdout(out).stderr(log);
        }
        Err(e) => return failed(format!("cannot open the output log: {e}")),
    }
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => return failed(format!("cannot start {}: {e}", program.to_string_lossy())),
    };
    if let Err(e) = write_atomic(&dir.join("pid"), child.id().to_string().as_bytes()) {
        eprintln!("fairledger shim: cannot record the process id: {e}");
    }
    let status = loop {
        match child.wait() {
            Ok(status) => break status,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return failed(format!("lost the process: {e}")),
        }
    };
    record(&Exit {
        exit_code: status.code(),
        signal: status.signal(),
        ended_at_ms: now_ms(),
        error: None,
    });
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_claimed_once() {
        let tmp = tempfile::tempdir().unwrap();
        let d = dir(tmp.path(), uuid::Uuid::from_u128(7), 1_000);
        assert!(claim(&d).unwrap());
        assert!(!claim(&d).unwrap(), "a second claim of one start fails");
        assert_eq!(status(&d), Status::Lost, "nothing ran there");
    }

    #[test]
    fn the_shim_records_exits_signals_and_commands_that_do_not_exist() {
        let tmp = tempfile::tempdir().unwrap();
        let run = |name: &str, command: &[&str]| {
            let d = tmp.path().join(name);
            std::fs::create_dir(&d).unwrap();
            let command: Vec<OsString> = command.iter().map(OsString::from).collect();
            assert_eq!(shim_main(&d, &command), 0);
            match status(&d) {
                Status::Ended(exit) => {
                    (exit, std::fs::read_to_string(d.join("output.log")).unwrap())
                }
                other => panic!("{name}: {other:?}"),
            }
        };
        let (exit, out) = run("ok", &["sh", "-c", "echo hello; echo oops >&2; exit 3"]);
        assert_eq!((exit.exit_code, exit.signal), (Some(3), None));
        assert!(out.contains("hello") && out.contains("oops"), "{out}");
        let (exit, _) = run("killed", &["sh", "-c", "kill -TERM $$"]);
        assert_eq!((exit.exit_code, exit.signal), (None, Some(15)));
        let (exit, out) = run("missing", &["/no/such/program"]);
        assert_eq!(exit.exit_code, Some(127));
        assert!(exit
            .error
            .as_deref()
            .unwrap()
            .contains("cannot start /no/such/program"));
        assert!(out.contains("cannot start"), "{out}");
    }
}
