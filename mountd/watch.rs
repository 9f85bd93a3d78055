//! The daemon's watchdog: stop serving when the container it serves is gone, so that no daemon
//! outlives its container, also when whatever started it was killed mid-way.
//!
//! Two flags. `--container-pid-file PATH` names the runtime's pid file of the container's init
//! (`runc create --pid-file`): once it appears, the daemon stops when that process exits.
//! `--owner-pid PID` names the process that started the daemon (`devremap-runtime`): until
//! the pid file appears, the daemon stops when that process exits, since then no one will
//! start the container. Processes are watched through pidfds ([`crate::pidfd`]); the pid file
//! is looked at every 100 ms until it appears. The watch runs on the thread that reads the
//! keeper's signals ([`crate::signals::Thread::then`]), which it goes on reading meanwhile.
//!
//! A pid file that is already there when the daemon starts is a previous run's: runc never
//! removes its `--pid-file`, and Podman passes the same path to every start of a container
//! (issue 17.1). It names a process that is gone, or worse an unrelated one that reused the
//! pid. So the file counts only once it is no longer the file found at the start: another
//! inode (runc writes it to a temporary name and renames it over) or another modification
//! time. No clock is compared: a file system's coarse timestamps cannot make a new file look old.

use devremap::inputs::files::read_pid;
use log::info;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const PID_FILE_POLL: Duration = Duration::from_millis(100);

use crate::signals::{Reader, Thread, Waited};
use devremap::pidfd::{exited, pidfd_open};
use std::os::fd::{AsFd, OwnedFd};

/// Which file a path names: device, inode and modification time.
type FileIdentity = (u64, u64, i64, i64);

fn identity(path: &Path) -> Option<FileIdentity> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.mtime(), m.mtime_nsec()))
}

/// The pid in `path`, unless the file there is still `stale`, the one found at the start.
fn fresh_pid(path: &Path, stale: Option<FileIdentity>) -> Option<u32> {
    let now = identity(path)?;
    if stale == Some(now) {
        return None;
    }
    read_pid(path)
}

/// Starts the watchdog on the signal thread `signals`; `stop(reason)` is called once, when the
/// daemon must stop. Called before the daemon reports ready, so before its caller starts the
/// container.
pub fn spawn(
    signals: &Thread,
    owner: Option<u32>,
    pid_file: Option<PathBuf>,
    stop: impl FnOnce(String) + Send + 'static,
) {
    if owner.is_none() && pid_file.is_none() {
        return;
    }
    let stale = pid_file.as_deref().and_then(identity);
    if let (Some(path), Some(_)) = (&pid_file, stale) {
        info!("{}: left by an earlier run; waiting for the runtime to write it again", path.display());
    }
    signals.then(move |reader| stop(watch(owner, pid_file.as_deref(), stale, reader)));
}

/// Whether the process behind `fd` exits within `timeout` (`None`: forever), the signals
/// handled meanwhile; waited for without them where they can no longer be read.
fn exits(reader: &Reader, fd: &OwnedFd, timeout: Option<Duration>) -> bool {
    match reader.wait_for(Some(fd.as_fd()), timeout) {
        Waited::Ready => true,
        Waited::TimedOut => false,
        Waited::Gone => exited(fd, timeout),
    }
}

fn watch(owner: Option<u32>, pid_file: Option<&Path>, stale: Option<FileIdentity>, reader: &Reader) -> String {
    let read = || pid_file.and_then(|p| fresh_pid(p, stale));
    // An owner already gone (or one we may not watch) is as good as gone.
    let mut owner = owner.map(|pid| (pid, pidfd_open(pid).ok()));
    loop {
        if let Some(pid) = read() {
            info!("watching container process {pid}");
            return match pidfd_open(pid) {
                Ok(fd) => {
                    exits(reader, &fd, None);
                    format!("container process {pid} exited")
                }
                Err(_) => format!("container process {pid} is gone"),
            };
        }
        match &owner {
            Some((pid, fd)) => {
                let gone = fd.as_ref().is_none_or(|fd| exits(reader, fd, Some(PID_FILE_POLL)));
                if gone {
                    // It may have exited right after the runtime wrote the pid file.
                    if read().is_some() {
                        owner = None;
                        continue;
                    }
                    return format!("process {pid} that started us exited before the container started");
                }
            }
            None => {
                if reader.wait_for(None, Some(PID_FILE_POLL)) == Waited::Gone {
                    std::thread::sleep(PID_FILE_POLL);
                }
            }
        }
    }
}
