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
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
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

/// How long, after the owner exited, the pid file is given to answer its last read: a read that
/// hangs longer (a file system that does not answer) no longer keeps the daemon from stopping.
const LAST_READ_PATIENCE: Duration = Duration::from_secs(1);

/// Starts the watchdog; `stop(reason)` is called once, when the daemon must stop. Called
/// before the daemon reports ready, so before its caller starts the container.
///
/// Processes are waited for on the signal thread `signals` (a poll of their pidfds beside the
/// signals): the owner until the pid file names the container's process, then that process
/// for the container's life. The pid file is looked at by a thread of its own, which ends once
/// the file names the process: it may be on a file system whose reads hang (a stopped FUSE
/// daemon's), which must keep neither the signals nor the owner's exit waiting (found from
/// outside). Its first look (whether a file from an earlier run is there) is taken before the
/// daemon says it is ready: the returned receiver hears when, for [`armed_within`].
pub fn spawn(
    signals: &Arc<Thread>,
    owner: Option<u32>,
    pid_file: Option<PathBuf>,
    stop: impl FnOnce(String) + Send + 'static,
) -> Option<Receiver<()>> {
    // An owner already gone (or one we may not watch) is as good as gone.
    let owner = owner.map(|pid| (pid, pidfd_open(pid).ok()));
    let Some(path) = pid_file else {
        let (pid, fd) = owner?;
        signals.then(move |reader| {
            if let Some(fd) = fd {
                exits(reader, &fd, None);
            }
            stop(owner_exited(pid));
        });
        return None;
    };
    let (armed_tx, armed) = mpsc::channel();
    let (found_tx, found) = mpsc::channel();
    let (owner_gone, gone) = mpsc::channel();
    let (ping, pinged) = match UnixStream::pair() {
        Ok(pair) => pair,
        Err(e) => return unwatched(&e),
    };
    let owner_pid = owner.as_ref().map(|(pid, _)| *pid);
    let watching = std::thread::Builder::new().name("watch".into()).spawn(move || {
        let stale = identity(&path);
        if stale.is_some() {
            info!("{}: left by an earlier run; waiting for the runtime to write it again", path.display());
        }
        let _ = armed_tx.send(());
        let _ = found_tx.send(find(&path, stale, &gone, owner_pid));
        let _ = (&ping).write(&[1]);
    });
    let watching = match watching {
        Ok(watching) => watching,
        Err(e) => return unwatched(&e),
    };
    signals.then(move |reader| {
        let owner_exited_first = match &owner {
            None => {
                reader.wait_for(Some(pinged.as_fd()), None);
                false
            }
            // An owner without a pidfd is gone already.
            Some((_, None)) => true,
            Some((_, Some(fd))) => reader.wait_for_any(&[pinged.as_fd(), fd.as_fd()], None) == Waited::Ready(1),
        };
        // The watch thread, once it has answered, is joined: a thread nobody joins leaves its
        // stack's touched pages in glibc's cache of stacks, 8 KiB of every container's keeper
        // (`benches/node.rs`); joined, it is unmapped (`glibc.pthread.stack_cache_size=0`,
        // [`crate::memory::glibc_tunables`]). One whose read hangs is left to itself.
        let answered = |found: &Receiver<Found>| {
            let found = found.recv().ok();
            let _ = watching.join();
            found
        };
        let found = match owner {
            Some((pid, _)) if owner_exited_first => {
                let _ = owner_gone.send(());
                // The pid file's last read says whether the container was started.
                match reader.wait_for(Some(pinged.as_fd()), Some(LAST_READ_PATIENCE)) {
                    Waited::Ready(_) => answered(&found),
                    _ => Some(Found::Stop(format!("{} (its pid file did not answer)", owner_exited(pid)))),
                }
            }
            _ => answered(&found),
        };
        match found {
            Some(Found::Process(pid, fd)) => {
                exits(reader, &fd, None);
                stop(format!("container process {pid} exited"));
            }
            Some(Found::Stop(why)) => stop(why),
            None => {}
        }
    });
    Some(armed)
}

/// Waits up to `patience` for the watch's first look at the pid file, so that a file the
/// runtime writes once we are ready is never taken for an earlier run's; a look that has not
/// returned by then (a file system that does not answer) is warned of, and readiness goes on.
pub fn armed_within(armed: &Receiver<()>, patience: Duration, pid_file: &Path) {
    if let Err(RecvTimeoutError::Timeout) = armed.recv_timeout(patience) {
        warn!(
            "{}: no answer within {patience:?} (a file system that hangs?): a pid file already there may not be told from the runtime's",
            pid_file.display()
        );
    }
}

/// Says that the container cannot be watched (no socket pair or thread to be had).
fn unwatched(e: &std::io::Error) -> Option<Receiver<()>> {
    warn!("cannot watch the container ({e}): its exit will not stop this daemon; stop it with SIGTERM");
    None
}

fn owner_exited(pid: u32) -> String {
    format!("process {pid} that started us exited before the container started")
}

/// Whether the process behind `fd` exits within `timeout` (`None`: forever), the signals
/// handled meanwhile; waited for without them where they can no longer be read.
fn exits(reader: &Reader, fd: &OwnedFd, timeout: Option<Duration>) -> bool {
    match reader.wait_for(Some(fd.as_fd()), timeout) {
        Waited::Ready(_) => true,
        Waited::TimedOut => false,
        Waited::Gone => exited(fd, timeout),
    }
}

/// Reads the pid file every [`PID_FILE_POLL`] until it names the container's process, or,
/// once `owner_gone` says the owner (`owner`) exited, once more.
fn find(pid_file: &Path, stale: Option<FileIdentity>, owner_gone: &Receiver<()>, owner: Option<u32>) -> Found {
    let mut gone = false;
    loop {
        // Said before this read: the owner may have exited right after the runtime wrote it.
        let last = gone;
        if let Some(pid) = fresh_pid(pid_file, stale) {
            info!("watching container process {pid}");
            return match pidfd_open(pid) {
                Ok(fd) => Found::Process(pid, fd),
                Err(_) => Found::Stop(format!("container process {pid} is gone")),
            };
        }
        if last {
            return Found::Stop(owner.map_or_else(|| "its owner exited".to_owned(), owner_exited));
        }
        // Woken at once when the owner exits (or when nobody waits for the answer any more).
        match owner_gone.recv_timeout(PID_FILE_POLL) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => gone = true,
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}
