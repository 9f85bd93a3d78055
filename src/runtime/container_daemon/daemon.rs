//! The daemon of one container: `devremapd mount` started on the container's `dev/`, waited
//! for until its mount answers, and stopped at the container's end.
//!
//! A stop kills the daemon's keeper and its servers at once (`SIGKILL`) and waits until they
//! have exited: the container is gone by then, so no one needs a graceful unmount, and a killed
//! daemon runs no code of its own afterwards. Waiting for its exit is what lets a quick delete
//! and create of one id (`podman restart`) never have the old keeper unmount, by path, the new
//! container's mount, nor an old server write its state file into the new directory; a
//! graceful stop (`SIGTERM`: unmount, tell the server, wait for it) made that wait several
//! process hand-offs long on every container's end (issue 17's benchmark).

use super::{Container, DaemonError, io_at};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::{Pid, getpgid};
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a daemon may take to answer, and to exit once killed.
const PATIENCE: Duration = Duration::from_secs(30);

/// What the library needs done that takes `unsafe`, which it forbids: given by the front end.
pub trait Processes {
    /// Makes `cmd` start its process detached from the front end: in a session of its own (no
    /// terminal's ^C), and holding none of the front end's descriptors (a caller such as
    /// containerd waits for EOF on the runtime's output pipes).
    fn detach(&self, cmd: &mut Command);
    /// A descriptor that becomes readable once process `pid` has exited (a pidfd), or `None`
    /// where there is none (before Linux 5.3, or the process is gone).
    fn exit_watch(&self, pid: u32) -> Option<OwnedFd>;
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
    /// The runtime's pid file of the container's init.
    pub container_pid_file: &'a Path,
}

impl Container {
    /// Starts `devremapd mount` on `dev/`, detached (its own session, stdio to its log file, no
    /// inherited descriptors), and waits until its mount answers (its pid file appears).
    pub fn start_daemon(&self, a: &DaemonArgs, procs: &dyn Processes) -> Result<Child, DaemonError> {
        let log = fs::File::create(self.log()).map_err(io_at(&self.log()))?;
        let log2 = log.try_clone().map_err(io_at(&self.log()))?;
        let mut cmd = Command::new(a.devremapd);
        cmd.arg("mount")
            .arg(self.dev())
            .arg("--spec")
            .arg(a.spec)
            .arg("--host-root")
            .arg(a.host_root)
            .arg("--pid-file")
            .arg(self.pid_file())
            .arg("--state-file")
            .arg(self.dir.join("state.json"))
            .arg("--container-pid-file")
            .arg(a.container_pid_file)
            .arg("--owner-pid")
            .arg(std::process::id().to_string())
            .args(&a.extra)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        if let Some(dev) = a.host_dev {
            cmd.arg("--host-dev").arg(dev);
        }
        if let Some(meta) = a.metadata {
            cmd.arg("--metadata").arg(meta);
        }
        procs.detach(&mut cmd);
        // Watched before the spawn, so that the pid file's arrival cannot be missed.
        let watch_failed = |errno| DaemonError::Watch { path: self.dir.clone(), errno };
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).map_err(watch_failed)?;
        inotify.add_watch(&self.dir, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO).map_err(watch_failed)?;
        let mut child =
            cmd.spawn().map_err(|source| DaemonError::Spawn { path: a.devremapd.to_owned(), source })?;
        match self.wait_ready(&mut child, &inotify, procs) {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Waits until the daemon's pid file appears (its mount answers), woken by the directory's
    /// events and the daemon's exit rather than by a timer: the wait costs no more than the
    /// daemon's start (issue 17's benchmark).
    fn wait_ready(&self, child: &mut Child, inotify: &Inotify, procs: &dyn Processes) -> Result<(), DaemonError> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let exited = procs.exit_watch(child.id());
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.pid_file().exists() {
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(DaemonError::Exited { status, log: self.last_log_line() });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DaemonError::NoAnswer { secs: PATIENCE.as_secs(), log: self.last_log_line() });
            }
            let mut fds = vec![PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
            fds.extend(exited.as_ref().map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN)));
            // Without a pidfd (before Linux 5.3) the child's exit is looked at every 100 ms.
            let _ =
                poll(&mut fds, PollTimeout::try_from(left.min(Duration::from_millis(100))).unwrap_or(PollTimeout::MAX));
            // Drained only to rearm the wakeup: which name appeared is checked above.
            let _ = inotify.read_events();
        }
    }

    fn last_log_line(&self) -> String {
        let text = fs::read_to_string(self.log()).unwrap_or_default();
        text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("(no log)").to_owned()
    }

    /// Stops the daemon (if it still runs) and waits for its exit, detaches whatever is left
    /// mounted on `dev/`, and removes the directory. `child` is the daemon when this process
    /// started it (to reap it).
    pub fn teardown(&self, child: Option<Child>, procs: &dyn Processes) -> Result<(), DaemonError> {
        if let Some(pid) = self.daemon_pid().or(child.as_ref().map(Child::id)) {
            stop(pid, procs);
        }
        if let Some(mut child) = child {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A killed daemon leaves a dead FUSE mount (ENOTCONN) until it is detached. EINVAL
        // when nothing is mounted there.
        let _ = nix::mount::umount2(&self.dev(), nix::mount::MntFlags::MNT_DETACH);
        match fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(DaemonError::Remove { path: self.dir.clone(), source: e }),
            _ => Ok(()),
        }
    }

    /// The daemon's pid, if its pid file names a live process serving this mountpoint.
    fn daemon_pid(&self) -> Option<u32> {
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

/// The children of the keeper `pid` (its servers: it starts them from its main thread).
fn children(pid: u32) -> Vec<u32> {
    let text = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    text.split_whitespace().filter_map(|c| c.parse().ok()).collect()
}

/// The parent of process `pid`, from `/proc/<pid>/stat`.
fn parent_of(pid: u32) -> Option<u32> {
    parent_in_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The parent pid in the text of a `/proc/<pid>/stat`: the second field after the name, which
/// is in parentheses and may hold spaces and `)` itself, so it ends at the last `)`.
fn parent_in_stat(stat: &str) -> Option<u32> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Kills the keeper `pid` and its servers at once and waits (up to [`PATIENCE`]) until each
/// has exited. Each server is watched through a pidfd opened before the kill and kept only if
/// the process is still the keeper's child after it was opened, so a pid reused meanwhile is
/// never waited for; the kill goes to the keeper's process group (it leads one: it was
/// detached), where its servers are, and a server whose keeper dies is killed by the kernel
/// too (`PR_SET_PDEATHSIG`).
fn stop(pid: u32, procs: &dyn Processes) {
    let servers = children(pid).into_iter().filter_map(|c| procs.exit_watch(c).filter(|_| parent_of(c) == Some(pid)));
    let watches: Vec<OwnedFd> = procs.exit_watch(pid).into_iter().chain(servers).collect();
    let keeper = Pid::from_raw(pid as libc::pid_t);
    // The pid was checked to be our daemon's; an error means it has exited already.
    if getpgid(Some(keeper)) == Ok(keeper) {
        let _ = killpg(keeper, Signal::SIGKILL);
    }
    let _ = kill(keeper, Signal::SIGKILL);
    let deadline = Instant::now() + PATIENCE;
    for fd in &watches {
        let left = deadline.saturating_duration_since(Instant::now());
        exited(fd, left);
    }
}

/// Waits up to `timeout` for the pidfd `fd` to become readable (its process has exited).
fn exited(fd: &OwnedFd, timeout: Duration) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    while let Err(nix::errno::Errno::EINTR) = poll(&mut fds, timeout) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's stat line, and one whose name holds `) ` (a process names itself): the
    /// parent is read after the last `)`, never from inside the name.
    #[test]
    fn the_parent_is_read_after_the_name() {
        assert_eq!(parent_in_stat("4242 (devremapd) S 4200 4200 4200 0 -1"), Some(4200));
        assert_eq!(parent_in_stat("4242 (a) S 1 (b) S 7 7 7 0 -1"), Some(7));
        assert_eq!(parent_in_stat("4242 (devremapd"), None);
        assert_eq!(parent_in_stat(""), None);
    }
}
