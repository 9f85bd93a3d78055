//! The daemon's watchdog: stop serving when the container it serves is gone, so that no daemon
//! outlives its container, also when whatever started it was killed mid-way.
//!
//! Two flags. `--container-pid-file PATH` names the runtime's pid file of the container's init
//! (`runc create --pid-file`): once it appears, the daemon stops when that process exits.
//! `--owner-pid PID` names the process that started the daemon (`devremap-runtime`): until
//! the pid file appears, the daemon stops when that process exits, since then no one will
//! start the container. Processes are watched through pidfds ([`crate::pidfd`]); the pid file
//! is looked at every 100 ms until it appears, by a thread that ends then; a process is waited
//! for on the thread that reads the keeper's signals ([`crate::signals::Thread::then`]).
//!
//! A pid file that is already there when the daemon starts is a previous run's: runc never
//! removes its `--pid-file`, and Podman passes the same path to every start of a container
//! (issue 17.1). It names a process that is gone, or worse an unrelated one that reused the
//! pid. So the file counts only once it is no longer the file found at the start: another
//! inode (runc writes it to a temporary name and renames it over) or another modification
//! time. No clock is compared: a file system's coarse timestamps cannot make a new file look old.

use devremap::inputs::files::read_pid;
use log::{info, warn};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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

/// What the watch of the pid file found.
enum Found {
    /// The daemon must stop, for this reason.
    Stop(String),
    /// The container's process, its pid and pidfd: the daemon stops when it exits.
    Process(u32, OwnedFd),
}

/// Starts the watchdog; `stop(reason)` is called once, when the daemon must stop. Called
/// before the daemon reports ready, so before its caller starts the container.
///
/// A process is waited for on the signal thread `signals` (a poll of its pidfd beside the
/// signals): the owner alone, or the container's process, for the container's life. The pid
/// file is read on a thread of its own, which ends once the file names the process: it may be
/// on a file system whose reads hang (a stopped FUSE daemon's), which must not keep the signals
/// from being read (found from outside).
pub fn spawn(
    signals: &Arc<Thread>,
    owner: Option<u32>,
    pid_file: Option<PathBuf>,
    stop: impl FnOnce(String) + Send + 'static,
) {
    let Some(path) = pid_file else {
        let Some(pid) = owner else { return };
        // An owner already gone (or one we may not watch) is as good as gone.
        let fd = pidfd_open(pid).ok();
        signals.then(move |reader| {
            if let Some(fd) = fd {
                exits(reader, &fd, None);
            }
            stop(format!("process {pid} that started us exited before the container started"));
        });
        return;
    };
    let stale = identity(&path);
    if stale.is_some() {
        info!("{}: left by an earlier run; waiting for the runtime to write it again", path.display());
    }
    let signals = signals.clone();
    let watching = std::thread::Builder::new().name("watch".into()).spawn(move || match find(owner, &path, stale) {
        Found::Stop(why) => stop(why),
        Found::Process(pid, fd) => signals.then(move |reader| {
            exits(reader, &fd, None);
            stop(format!("container process {pid} exited"));
        }),
    });
    if let Err(e) = watching {
        warn!(
            "cannot start the watch of the container ({e}): its exit will not stop this daemon; stop it with SIGTERM"
        );
    }
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

/// Reads the pid file every [`PID_FILE_POLL`] until it names the container's process, or the
/// owner exits first.
fn find(owner: Option<u32>, pid_file: &Path, stale: Option<FileIdentity>) -> Found {
    let read = || fresh_pid(pid_file, stale);
    // An owner already gone (or one we may not watch) is as good as gone.
    let mut owner = owner.map(|pid| (pid, pidfd_open(pid).ok()));
    loop {
        if let Some(pid) = read() {
            info!("watching container process {pid}");
            return match pidfd_open(pid) {
                Ok(fd) => Found::Process(pid, fd),
                Err(_) => Found::Stop(format!("container process {pid} is gone")),
            };
        }
        match &owner {
            Some((pid, fd)) => {
                let gone = fd.as_ref().is_none_or(|fd| exited(fd, Some(PID_FILE_POLL)));
                if gone {
                    // It may have exited right after the runtime wrote the pid file.
                    if read().is_some() {
                        owner = None;
                        continue;
                    }
                    return Found::Stop(format!("process {pid} that started us exited before the container started"));
                }
            }
            None => std::thread::sleep(PID_FILE_POLL),
        }
    }
}
