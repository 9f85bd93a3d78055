//! Running the real runtime: in place of this process, or as its child with our signals passed
//! on; and the wrapper's lines in the runtime's `--log`.

use crate::error::Failure;
use devremap::runtime::argv::{Global, Line};
use devremap::runtime::config::Config;
use devremap::runtime::osarg;
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use serde_json::Value;
use signal_hook::consts::signal::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Command;

/// One line at `level` (`error`, `warning`) in the runtime's `--log` file when there is one, as
/// runc does, where containerd and Docker look for the reason a runtime failed; on stderr when
/// there is none, and always for an error. A warning kept off stderr then is never taken by a
/// caller for the error of a runtime that failed after it.
pub fn report(global: &Global, level: &str, message: &str) {
    // A path in the message may hold control characters: never a forged line (issue 9.6).
    let message = &*devremap::decision::escape::escape(message);
    if level == "error" || global.log.is_none() {
        eprintln!("devremap-runtime: {level}: {message}");
    }
    log_line(global, level, message);
}

/// One line at `level` in the runtime's `--log` file alone, and nothing without one: a fact
/// about the host that a client would otherwise show on each call (Podman passes no `--log` to
/// `checkpoint`), and that `devremapd record` says where it is asked.
pub fn note(global: &Global, level: &str, message: &str) {
    log_line(global, level, &devremap::decision::escape::escape(message));
}

/// `message` (escaped) as a line of runc's `--log` format, when there is a log.
fn log_line(global: &Global, level: &str, message: &str) {
    let Some(log) = &global.log else { return };
    let line = if global.log_format.as_deref() == Some("json") {
        serde_json::json!({"level": level, "msg": format!("devremap-runtime: {message}")}).to_string()
    } else {
        format!("level={level} msg={:?}", format!("devremap-runtime: {message}"))
    };
    if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(osarg::decode(log)) {
        let _ = std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes());
    }
}

/// The runtime with `args`, each as the caller gave it (see `osarg`).
fn runtime_command(config: &Config, args: &[String]) -> Command {
    let mut c = Command::new(&config.runtime);
    c.args(args.iter().map(|a| osarg::decode(a)));
    c
}

fn cannot_run(config: &Config) -> impl FnOnce(std::io::Error) -> Failure + '_ {
    |source| Failure::CannotRun { runtime: config.runtime.clone(), source }
}

/// Replaces this process with the runtime; returns only the error.
pub fn exec(config: &Config, args: Vec<String>) -> Failure {
    cannot_run(config)(runtime_command(config, &args).exec())
}

/// Replaces this process with the runtime, as [`exec`], giving it the stdin [`run_runtime`]
/// gives it: what a container the wrapper set up starts with.
pub fn exec_container(config: &Config, args: &[String]) -> Failure {
    match stdin_in_place_of_dev_null() {
        Ok(Some(stdin)) => {
            if let Err(e) = nix::unistd::dup2_stdin(&stdin) {
                return Failure::Pipe(e);
            }
        }
        Ok(None) => {}
        Err(e) => return e,
    }
    exec(config, args.to_vec())
}

/// Replaces this process with the runtime given our own arguments, unchanged (some are not
/// UTF-8, and not ours to understand); returns only the error.
pub fn exec_unchanged(config: &Config) -> Failure {
    cannot_run(config)(Command::new(&config.runtime).args(std::env::args_os().skip(1)).exec())
}

/// The read end of an empty pipe whose write end is closed: what a create, run or restore is
/// given as stdin in place of the host's `/dev/null` (see the crate doc). `None` when stdin is
/// anything else.
fn stdin_in_place_of_dev_null() -> Result<Option<std::os::fd::OwnedFd>, Failure> {
    let meta = match std::fs::metadata("/proc/self/fd/0") {
        Ok(m) => m,
        Err(_) => return Ok(None),
    };
    if !(meta.file_type().is_char_device() && meta.rdev() == libc::makedev(1, 3)) {
        return Ok(None);
    }
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(Failure::Pipe)?;
    drop(write);
    Ok(Some(read))
}

/// Runs the runtime to its end, passing on the signals we get, and returns its exit status.
pub fn run_runtime(config: &Config, args: &[String]) -> Result<u8, Failure> {
    let mut command = runtime_command(config, args);
    if let Some(stdin) = stdin_in_place_of_dev_null()? {
        command.stdin(std::process::Stdio::from(stdin));
    }
    let mut child = command.spawn().map_err(cannot_run(config))?;
    let pid = Pid::from_raw(child.id() as libc::pid_t);
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH])
            .map_err(Failure::Signals)?;
    let handle = signals.handle();
    let forwarder = std::thread::spawn(move || {
        for sig in signals.forever().filter_map(|sig| Signal::try_from(sig).ok()) {
            let _ = kill(pid, sig);
        }
    });
    // Wait for the exit without reaping: until the forwarder has stopped, the pid stays our
    // child's (a zombie), so a late signal never reaches a process that reused it.
    let exited = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
    while let Err(Errno::EINTR) = waitid(Id::Pid(pid), exited) {}
    handle.close();
    let _ = forwarder.join();
    let status = child.wait().map_err(|source| Failure::Waiting { runtime: config.runtime.clone(), source })?;
    Ok(status.code().map_or_else(|| 128 + status.signal().unwrap_or(0) as u8, |c| c as u8))
}

/// Whether the runtime knows container `id` (`<runtime> state <id>` succeeds): its state.
pub fn runtime_knows(config: &Config, line: &Line, id: &str) -> Option<Value> {
    let out =
        runtime_command(config, &line.sibling("state", &[id])).stderr(std::process::Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(serde_json::from_slice(&out.stdout).unwrap_or(Value::Null))
}
