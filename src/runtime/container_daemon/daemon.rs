//! The daemon of one container: `devremapd mount` started on the container's `dev/`, waited
//! for until its mount answers, and stopped at the container's end.
//!
//! A stop is `SIGTERM` (the keeper unmounts, tells its server, waits for it) and a wait for
//! the keeper's exit, `SIGKILL` after [`PATIENCE`]: waiting is what keeps a quick delete and
//! create of one id (`podman restart`) from having the old keeper unmount, by path, the new
//! container's mount. (Killing the keeper and its servers at once instead, and waiting for them,
//! was measured against this in issue 17's benchmark and saved nothing.)

use super::{Container, DaemonError, io_at};
use crate::pidfd::Child;
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a daemon may take to answer, and to stop.
const PATIENCE: Duration = Duration::from_secs(30);
/// How much of the end of a daemon's log is read for its last line: a line is far shorter.
const LOG_TAIL: u64 = 64 << 10;

/// What the library needs done that takes `unsafe`, which it forbids: given by the front end.
pub trait Processes {
    /// Makes `cmd` start its process detached from the front end: in a session of its own (no
    /// terminal's ^C), and holding none of the front end's descriptors (a caller such as
    /// containerd waits for EOF on the runtime's output pipes) but `keep`, which it inherits
    /// under the same number.
    fn detach(&self, cmd: &mut Command, keep: std::os::fd::RawFd);
    /// A descriptor that becomes readable once process `pid` has exited (a pidfd), or `None`
    /// where there is none (before Linux 5.3, or the process is gone).
    fn exit_watch(&self, pid: u32) -> Option<OwnedFd>;
    /// Starts the keeper `launch` describes. By default it is spawned ([`spawn_detached`]); a
    /// front end may instead hand `launch` to a keeper it started ahead of need (the node
    /// daemon's spare, which saves a container's start the keeper's and its server's execs).
    fn launch(&self, launch: Launch) -> io::Result<Child> {
        spawn_detached(self, launch)
    }
}

/// A keeper to start: `program` with `args` (all but `--ready-fd`), its stdout and stderr
/// `log`, and `ready`, the write end of the pipe it says ready on (its `--ready-fd`).
pub struct Launch<'a> {
    pub program: &'a Path,
    pub args: Vec<OsString>,
    pub log: fs::File,
    pub ready: OwnedFd,
}

/// Spawns `launch`'s keeper detached ([`Processes::detach`]), its `--ready-fd` the pipe's
/// number, which it inherits. Once spawned only the keeper holds the pipe's write end (ours is
/// dropped here): its exit is the starter's EOF.
pub fn spawn_detached<P: Processes + ?Sized>(procs: &P, launch: Launch) -> io::Result<Child> {
    let ready = launch.ready.as_raw_fd();
    let mut cmd = Command::new(launch.program);
    cmd.args(&launch.args)
        .arg("--ready-fd")
        .arg(ready.to_string())
        // A keeper tells systemd about itself when it is the service's main process; one
        // started here is not (the node daemon under `devremap.service` is).
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .stdout(launch.log.try_clone()?)
        .stderr(launch.log);
    procs.detach(&mut cmd, ready);
    cmd.spawn().map(Child::Spawned)
}

/// What the daemon is started with.
pub struct DaemonArgs<'a> {
    pub devremapd: &'a Path,
    pub spec: &'a Path,
    pub host_dev: Option<&'a Path>,
    pub host_root: &'a Path,
    pub metadata: Option<&'a Path>,
    /// `--device-map` and `--prefer` from the annotations.
    pub extra: Vec<String>,
    /// The runtime's pid file of the container's init; `None`: the daemon serves until it is
    /// stopped (the NRI plugin stops it at the container's end).
    pub container_pid_file: Option<&'a Path>,
    /// The process that starts the container: until the pid file appears, the daemon stops
    /// when it exits (no one will start the container then).
    pub owner_pid: Option<u32>,
    /// Threads answering the kernel in its server (`--threads`).
    pub threads: u16,
    /// `--rest-after`: seconds its server may be asked nothing before it rests (0: never).
    pub rest_after: u64,
}

impl Container {
    /// Starts `devremapd mount` on `dev/`, detached (its own session, stdio to its log file, no
    /// inherited descriptors but its `--ready-fd`), and waits until its mount answers (it has
    /// written its pid file and says so on the pipe).
    pub fn start_daemon(&self, a: &DaemonArgs, procs: &dyn Processes) -> Result<Child, DaemonError> {
        let log = crate::atomic::create_log(&self.log())?;
        let mut args: Vec<OsString> = vec!["mount".into(), self.dev().into()];
        let mut flag = |name: &str, value: &dyn AsRef<OsStr>| args.extend([name.into(), value.as_ref().to_owned()]);
        flag("--spec", &a.spec);
        flag("--host-root", &a.host_root);
        flag("--pid-file", &self.pid_file());
        flag("--state-file", &self.state_file());
        flag("--threads", &a.threads.to_string());
        if a.rest_after > 0 {
            flag("--rest-after", &a.rest_after.to_string());
        }
        if let Some(dev) = a.host_dev {
            flag("--host-dev", &dev);
        }
        if let Some(pid_file) = a.container_pid_file {
            flag("--container-pid-file", &pid_file);
        }
        if let Some(owner) = a.owner_pid {
            flag("--owner-pid", &owner.to_string());
        }
        if let Some(meta) = a.metadata {
            flag("--metadata", &meta);
        }
        args.extend(a.extra.iter().map(OsString::from));
        // A pipe rather than a watch on the directory: closing an inotify instance waits for an
        // SRCU grace period (1 to 25 ms measured, issue 17's benchmark), before the runtime
        // could start.
        let (ready, ready_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(DaemonError::Pipe)?;
        let launch = Launch { program: a.devremapd, args, log, ready: ready_write };
        let mut child =
            procs.launch(launch).map_err(|source| DaemonError::Spawn { path: a.devremapd.to_owned(), source })?;
        match self.wait_ready(&mut child, &ready) {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Waits until the daemon says on `ready` that its mount answers (after its pid file is
    /// written), woken by the pipe rather than by a timer: the wait costs no more than the
    /// daemon's start (issue 17's benchmark). EOF first: the daemon exited.
    fn wait_ready(&self, child: &mut Child, ready: &OwnedFd) -> Result<(), DaemonError> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DaemonError::NoAnswer { secs: PATIENCE.as_secs(), log: self.last_log_line() });
            }
            let mut fds = [PollFd::new(ready.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX)) {
                Ok(0) | Err(Errno::EINTR) => continue,
                _ => {}
            }
            match nix::unistd::read(ready, &mut [0u8; 1]) {
                Ok(0) => {
                    let status = child.wait().map_err(io_at(&self.dir))?;
                    return Err(DaemonError::Exited { status, log: self.last_log_line() });
                }
                Ok(_) => return Ok(()),
                Err(Errno::EINTR | Errno::EAGAIN) => continue,
                Err(errno) => return Err(DaemonError::Pipe(errno)),
            }
        }
    }

    fn last_log_line(&self) -> String {
        self.log_tail().unwrap_or_else(|| "(no log)".to_owned())
    }

    /// The daemon log's last line that is not blank, if any.
    fn log_tail(&self) -> Option<String> {
        use std::io::{Seek, SeekFrom};
        // Its end alone: a log may be large, and one planted in its place (a symlink to
        // /dev/zero) is not read (found from outside: a `delete` read it until the OOM killer
        // ended it).
        let mut file = crate::inputs::files::open_own_regular(&self.log()).ok()?;
        let len = file.metadata().ok()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL))).ok()?;
        let mut tail = Vec::new();
        crate::inputs::files::read_up_to(&mut file, LOG_TAIL, &mut tail).ok()?;
        let text = String::from_utf8_lossy(&tail);
        text.lines().rev().find(|l| !l.trim().is_empty()).map(str::to_owned)
    }

    /// Checks that the container's daemon still serves its mount, before its container is
    /// started on it: a keeper SIGKILLed after `create` leaves a dead FUSE mount, whose `/dev`
    /// answers ENOTCONN. The check is on the process (its pid file names a live process whose
    /// command line names this mountpoint), never a `stat` of the mount, which blocks on a
    /// daemon that is alive but stuck.
    pub fn check_daemon(&self) -> Result<(), DaemonError> {
        match self.daemon_pid() {
            Some(_) => Ok(()),
            None => Err(DaemonError::Gone { pid_file: self.pid_file(), dev: self.dev(), log: self.log_tail() }),
        }
    }

    /// Stops the daemon (if it still runs) and waits for its exit, detaches whatever is left
    /// mounted on `dev/`, and removes the directory. A daemon that is our child (the node
    /// daemon's) is reaped by whoever waits on it. Something other than a directory in the
    /// directory's place (a planted symlink) is refused, never followed, and so is a directory
    /// no front end made ([`Container::check_ours`]); a mount found inside it is refused
    /// before anything is removed ([`super::remove_within_its_mount`]).
    pub fn teardown(&self, procs: &dyn Processes) -> Result<(), DaemonError> {
        self.check_ours()?;
        if let Some(pid) = self.daemon_pid() {
            stop(pid, procs);
        }
        // A daemon that was killed leaves a dead FUSE mount; a live one has unmounted already.
        // EINVAL when nothing is mounted there; a symlink planted as `dev/` is not followed.
        let _ =
            nix::mount::umount2(&self.dev(), nix::mount::MntFlags::MNT_DETACH | nix::mount::MntFlags::UMOUNT_NOFOLLOW);
        match super::remove_within_its_mount(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(DaemonError::Remove { path: self.dir.clone(), source: e })
            }
            _ => Ok(()),
        }
    }

    /// The daemon's pid, if its pid file names a live process serving this mountpoint.
    pub fn daemon_pid(&self) -> Option<u32> {
        let pid = crate::inputs::files::read_pid(&self.pid_file()).filter(|&p| p > 1)?;
        serves(pid, &self.dev()).then_some(pid)
    }
}

/// Whether process `pid`'s command line names `dev` (a `devremapd` of this mountpoint).
fn serves(pid: u32, dev: &Path) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let dev = dev.as_os_str().as_encoded_bytes();
    cmdline.split(|&b| b == 0).any(|arg| arg == dev)
}

/// SIGTERM, then waits for the process to exit (SIGKILL after [`PATIENCE`]), through a pidfd.
fn stop(pid: u32, procs: &dyn Processes) {
    let watch = procs.exit_watch(pid);
    let pid = Pid::from_raw(pid as libc::pid_t);
    // The pid was checked to be our daemon's; an error means it has exited already.
    let _ = kill(pid, Signal::SIGTERM);
    // No pidfd: the process is gone already (or the kernel has none: then no wait, as before).
    if watch.is_some_and(|fd| !exited(&fd, PATIENCE)) {
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// Whether the pidfd `fd` becomes readable (its process exits) within `timeout`.
fn exited(fd: &OwnedFd, timeout: Duration) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    loop {
        match poll(&mut fds, timeout) {
            Err(nix::errno::Errno::EINTR) => continue,
            rc => return rc.is_ok_and(|n| n > 0),
        }
    }
}
