//! One run of a workload on this node, kept in its own directory so that an agent that restarts
//! finds it again:
//!
//! ```text
//! RUNS/<workload>-<run>/          (<run>: 1 for its first start, 2 for the next…)
//!   spec.json    what was launched (command, environment)
//!   shim.pid     the shim (the workload's parent, which outlives the agent): its process id,
//!                start time and the machine's boot id, so a reused process id is not taken
//!                for it
//!   pid          the same of the workload, whose process id is also its process group
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
    /// The Unix user to run it as (the shim, started as root, switches to it); `None`: the
    /// agent's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<String>,
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

/// The directory of a workload's `run`-th start (from 1).
pub fn dir(runs: &Path, workload: uuid::Uuid, run: u64) -> PathBuf {
    runs.join(format!("{workload}-{run}"))
}

/// Claims `dir` for a new run: false if it already exists (launched before).
pub fn claim(dir: &Path) -> std::io::Result<bool> {
    // Readable by this user only: the run's spec and output are its submitter's.
    let created = {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(dir)
    };
    match created {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Launches `spec` in the claimed `dir` through `shim` (a program and its leading arguments;
/// the run directory, `--` and the command follow). The shim gets its own process group, so
/// signals meant for the agent do not reach it, and it outlives the agent. The workload gets the
/// agent's environment without the agent's own settings (`FAIRLEDGER_*`: its token, its NATS
/// password, where its keys are), then its spec's.
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
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("FAIRLEDGER_") {
            cmd.env_remove(name);
        }
    }
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

/// Makes `cmd` run as Unix user `name`: its user and group ids (no supplementary groups), its
/// home as working directory and `HOME`, `USER` and `LOGNAME`. Root is refused.
fn as_user(cmd: &mut std::process::Command, name: &str) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let user = nix::unistd::User::from_name(name)
        .map_err(|e| format!("cannot look up the Unix user {name:?}: {e}"))?
        .ok_or_else(|| {
            format!("no Unix user {name:?} on this node to run its submitter's workload as")
        })?;
    if user.uid.is_root() {
        return Err(format!(
            "the Unix user {name:?} is root; a workload never runs as root"
        ));
    }
    let home = if user.dir.is_dir() {
        user.dir.clone()
    } else {
        std::path::PathBuf::from("/")
    };
    // With the user's groups, as a login gives them (device and project groups): std's `uid`
    // would drop every supplementary group, so the identity is changed in the child instead,
    // groups first, while it may still.
    let c_name = std::ffi::CString::new(name)
        .map_err(|_| format!("the Unix user {name:?} has a NUL byte"))?;
    let groups = nix::unistd::getgrouplist(&c_name, user.gid)
        .map_err(|e| format!("cannot read the groups of the Unix user {name:?}: {e}"))?;
    let (uid, gid) = (user.uid, user.gid);
    cmd.current_dir(&home)
        .env("HOME", &user.dir)
        .env("USER", name)
        .env("LOGNAME", name);
    // SAFETY: between fork and exec the closure makes three system calls and allocates
    // nothing (the group list was read before).
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setgroups(&groups)?;
            nix::unistd::setgid(gid)?;
            nix::unistd::setuid(uid)?;
            Ok(())
        });
    }
    Ok(())
}

/// Records that the run in `dir` failed without running its command, for `reason`: it ends
/// as the shim records a command it cannot start (exit code 127).
pub fn record_failure(dir: &Path, reason: &str) -> std::io::Result<()> {
    if let Ok(mut log) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(dir.join("output.log"))
    {
        let _ = writeln!(log, "fairledger: {reason}");
    }
    let exit = Exit {
        exit_code: Some(127),
        signal: None,
        ended_at_ms: now_ms(),
        error: Some(brief(reason)),
    };
    write_atomic(
        &dir.join("exit.json"),
        &serde_json::to_vec(&exit).expect("exits serialize"),
    )
}

/// The longest reason a run's end carries into the ledger (the output log has all of it).
pub const REASON_MAX: usize = 1024;

/// `reason` cut to [`REASON_MAX`] bytes, on a character boundary: a program's name may be long.
fn brief(reason: &str) -> String {
    if reason.len() <= REASON_MAX {
        return reason.to_owned();
    }
    let mut end = REASON_MAX - '…'.len_utf8();
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

/// Where the run in `dir` stands.
pub fn status(dir: &Path) -> Status {
    if let Some(exit) = read_exit(dir) {
        return Status::Ended(exit);
    }
    let alive = |file: &str| read_pid(dir, file).is_some();
    if alive("shim.pid") || alive("pid") {
        Status::Running
    } else if read_exit(dir).is_some() {
        // The shim wrote it between the two looks.
        status(dir)
    } else {
        Status::Lost
    }
}

/// Whether the run in `dir` got as far as starting its command (its shim recorded the
/// process, or how it ended).
pub fn started(dir: &Path) -> bool {
    dir.join("pid").exists() || dir.join("exit.json").exists()
}

/// Sends `sig` to the run's process group; false when there is none (not started yet, ended,
/// or its process id now belongs to another process).
pub fn signal_group(dir: &Path, sig: Signal) -> bool {
    if read_exit(dir).is_some() {
        return false;
    }
    read_pid(dir, "pid").is_some_and(|p| signal::killpg(p, sig).is_ok())
}

fn read_exit(dir: &Path) -> Option<Exit> {
    let bytes = std::fs::read(dir.join("exit.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The process recorded in `dir/file`, if that very process is still alive: the same process
/// id, started at the same time, since the same boot.
fn read_pid(dir: &Path, file: &str) -> Option<Pid> {
    let text = std::fs::read_to_string(dir.join(file)).ok()?;
    let mut words = text.split_whitespace();
    let pid: i32 = words.next()?.parse().ok()?;
    let started: u64 = words.next()?.parse().ok()?;
    let boot = words.next()?;
    if pid <= 0 || boot != boot_id()? || start_ticks(pid)? != started {
        return None;
    }
    Some(Pid::from_raw(pid))
}

/// What identifies process `pid` for as long as it lives: `pid start_ticks boot_id`.
fn identity(pid: u32) -> String {
    let pid = pid as i32;
    format!(
        "{pid} {} {}",
        start_ticks(pid).unwrap_or(0),
        boot_id().unwrap_or_default()
    )
}

/// When process `pid` started, in clock ticks since boot (`/proc/<pid>/stat`, field 22).
fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// This boot of the machine.
fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Writes `bytes` to `path` so that a reader sees all of it or nothing.
/// Writes `bytes` to `path` whole, readable by this user only (a spec holds the workload's
/// environment).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
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
        identity(std::process::id()).as_bytes(),
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
        if let Err(e) = record_failure(dir, &reason) {
            eprintln!(
                "fairledger shim: cannot record the exit in {}: {e}",
                dir.display()
            );
        }
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
    // As its submitter, when the agent says so: the log is opened before, by the shim.
    let run_as = std::fs::read(dir.join("spec.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<Spec>(&b).ok())
        .and_then(|s| s.run_as);
    if let Some(name) = run_as {
        match as_user(&mut cmd, &name) {
            Ok(()) => {}
            Err(reason) => return failed(reason),
        }
    }
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
    if let Err(e) = write_atomic(&dir.join("pid"), identity(child.id()).as_bytes()) {
        eprintln!("fairledger shim: cannot record the process id: {e}");
    }
    let status = loop {
        match child.wait() {
            Ok(status) => break status,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return failed(format!("lost the process: {e}")),
        }
    };
    // The run ends with its leader: what it left behind in its group goes too, before the GPUs
    // are handed on.
    let _ = signal::killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
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
    fn a_long_reason_is_cut_on_a_character_boundary() {
        let long = "é".repeat(REASON_MAX);
        let cut = brief(&long);
        assert!(
            cut.len() <= REASON_MAX && cut.ends_with('…'),
            "{}",
            cut.len()
        );
        assert_eq!(brief("short"), "short");
    }

    #[test]
    fn a_recorded_process_is_trusted_only_while_it_is_that_very_process() {
        let tmp = tempfile::tempdir().unwrap();
        let me = std::process::id();
        std::fs::write(tmp.path().join("pid"), identity(me)).unwrap();
        assert_eq!(read_pid(tmp.path(), "pid"), Some(Pid::from_raw(me as i32)));
        assert_eq!(status(tmp.path()), Status::Running);
        // The same process id with another start time (a reused id) is not the run's.
        let id = identity(me);
        let w: Vec<&str> = id.split_whitespace().collect();
        let ticks: u64 = w[1].parse().unwrap();
        std::fs::write(
            tmp.path().join("pid"),
            format!("{} {} {}", w[0], ticks + 1, w[2]),
        )
        .unwrap();
        assert_eq!(read_pid(tmp.path(), "pid"), None);
        std::fs::write(
            tmp.path().join("pid"),
            format!("{} {} another-boot", w[0], ticks),
        )
        .unwrap();
        assert_eq!(read_pid(tmp.path(), "pid"), None);
        assert_eq!(status(tmp.path()), Status::Lost);
        assert!(
            !signal_group(tmp.path(), Signal::SIGTERM),
            "never signalled"
        );
    }

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
