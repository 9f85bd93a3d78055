//! The daemon's watchdog: stop serving when the container it serves is gone, so that no daemon
//! outlives its container, also when whatever started it was killed mid-way.
//!
//! Two flags. `--container-pid-file PATH` names the runtime's pid file of the container's init
//! (`runc create --pid-file`): once it appears, the daemon stops when that process exits.
//! `--owner-pid PID` names the process that started the daemon (`devremap-runtime`): until
//! the pid file appears, the daemon stops when that process exits, since then no one will
//! start the container. Processes are watched through pidfds ([`crate::pidfd`]); the pid file
//! is looked at every 100 ms until it appears, by a thread that ends then; a process is waited
//! for by the keeper's main thread, beside its events and signals ([`Watch`]).
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
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

const PID_FILE_POLL: Duration = Duration::from_millis(100);

use devremap::pidfd::pidfd_open;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

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

/// The watchdog, as the keeper's main thread waits with it ([`Watch::fds`], [`Watch::deadline`]):
/// processes are waited for through their pidfds beside the keeper's events and signals (the
/// owner until the pid file names the container's process, then that process for the
/// container's life), so that no thread of its own waits in every container (issue 31). The
/// pid file is looked at by a thread of its own, which ends once the file names the process:
/// it may be on a file system whose reads hang (a stopped FUSE daemon's), which must keep
/// neither the keeper nor the owner's exit waiting (found from outside).
pub struct Watch(State);

enum State {
    /// No pid file: until the owner exits.
    Owner(u32, OwnedFd),
    /// The pid file's thread looks; the owner, if any, is watched meanwhile.
    Finding {
        owner: Option<(u32, OwnedFd)>,
        finder: Finder,
    },
    /// The owner exited first: the pid file's last read, said whether the container was
    /// started, is waited for until `until`.
    LastRead {
        owner: u32,
        until: Instant,
        finder: Finder,
    },
    /// The container's process, for its life.
    Container(u32, OwnedFd),
    /// The daemon must stop at once (the owner was gone before the watch started).
    Now(String),
    Done,
}

/// The pid file's thread, and how it answers.
struct Finder {
    /// Readable once it has answered.
    pinged: UnixStream,
    found: Receiver<Found>,
    /// Tells it the owner exited (dropped: nobody waits for it any more): one last read.
    owner_gone: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Finder {
    /// Its answer, the thread joined: a thread nobody joins leaves its stack's touched pages
    /// in glibc's cache of stacks, 8 KiB of every container's keeper (`benches/node.rs`);
    /// joined, it is unmapped (`glibc.pthread.stack_cache_size=0`,
    /// [`crate::memory::glibc_tunables`]). Called once it has pinged.
    fn answered(self) -> Option<Found> {
        let found = self.found.recv().ok();
        let _ = self.thread.join();
        found
    }
}

impl Watch {
    /// Starts the watchdog (`None`: nothing to watch, or it cannot be: warned of), and the
    /// receiver that hears when the pid file's first look is taken, for [`armed_within`].
    /// Called before the daemon reports ready, so before its caller starts the container.
    pub fn start(owner: Option<u32>, pid_file: Option<PathBuf>) -> Option<(Watch, Option<Receiver<()>>)> {
        // An owner already gone (or one we may not watch) is as good as gone.
        let owner = owner.map(|pid| (pid, pidfd_open(pid).ok()));
        let Some(path) = pid_file else {
            let (pid, fd) = owner?;
            let state = fd.map_or_else(|| State::Now(owner_exited(pid)), |fd| State::Owner(pid, fd));
            return Some((Watch(state), None));
        };
        let (armed_tx, armed) = mpsc::channel();
        let (found_tx, found) = mpsc::channel();
        let (owner_gone, gone) = mpsc::channel();
        let (ping, pinged) = match UnixStream::pair() {
            Ok(pair) => pair,
            Err(e) => return unwatched(&e),
        };
        let owner_pid = owner.as_ref().map(|(pid, _)| *pid);
        let thread = std::thread::Builder::new().name("watch".into()).spawn(move || {
            let stale = identity(&path);
            if stale.is_some() {
                info!("{}: left by an earlier run; waiting for the runtime to write it again", path.display());
            }
            let _ = armed_tx.send(());
            let _ = found_tx.send(find(&path, stale, &gone, owner_pid));
            let _ = (&ping).write(&[1]);
        });
        let thread = match thread {
            Ok(thread) => thread,
            Err(e) => return unwatched(&e),
        };
        let finder = Finder { pinged, found, owner_gone, thread };
        let state = match owner {
            // An owner without a pidfd is gone already.
            Some((pid, None)) => last_read(pid, finder),
            Some((pid, Some(fd))) => State::Finding { owner: Some((pid, fd)), finder },
            None => State::Finding { owner: None, finder },
        };
        Some((Watch(state), Some(armed)))
    }

    /// What to wait on: readable when [`Watch::ready`] has something to say of it.
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        match &self.0 {
            State::Owner(_, fd) | State::Container(_, fd) => vec![fd.as_fd()],
            State::Finding { owner, finder } => {
                std::iter::once(finder.pinged.as_fd()).chain(owner.iter().map(|(_, fd)| fd.as_fd())).collect()
            }
            State::LastRead { finder, .. } => vec![finder.pinged.as_fd()],
            State::Now(_) | State::Done => Vec::new(),
        }
    }

    /// When [`Watch::timed_out`] is to be called, if ever.
    pub fn deadline(&self) -> Option<Instant> {
        match &self.0 {
            State::LastRead { until, .. } => Some(*until),
            State::Now(_) => Some(Instant::now()),
            _ => None,
        }
    }

    /// `fds()[i]` is readable: why the daemon must stop, if it must.
    pub fn ready(&mut self, i: usize) -> Option<String> {
        match (std::mem::replace(&mut self.0, State::Done), i) {
            (State::Owner(pid, _), _) => Some(owner_exited(pid)),
            (State::Container(pid, _), _) => Some(format!("container process {pid} exited")),
            (State::Finding { finder, .. } | State::LastRead { finder, .. }, 0) => self.found(finder.answered()),
            (State::Finding { owner: Some((pid, _)), finder }, _) => {
                self.0 = last_read(pid, finder);
                None
            }
            (state, _) => {
                self.0 = state;
                None
            }
        }
    }

    /// The deadline passed: why the daemon must stop, if it must.
    pub fn timed_out(&mut self, now: Instant) -> Option<String> {
        match std::mem::replace(&mut self.0, State::Done) {
            State::Now(why) => Some(why),
            // One whose read hangs is left to itself.
            State::LastRead { owner, until, .. } if now >= until => {
                Some(format!("{} (its pid file did not answer)", owner_exited(owner)))
            }
            state => {
                self.0 = state;
                None
            }
        }
    }

    /// What the pid file's thread found.
    fn found(&mut self, found: Option<Found>) -> Option<String> {
        match found? {
            Found::Process(pid, fd) => {
                self.0 = State::Container(pid, fd);
                None
            }
            Found::Stop(why) => Some(why),
        }
    }
}

/// The owner exited before the pid file named the container: the file's last read says
/// whether the container was started, within [`LAST_READ_PATIENCE`].
fn last_read(owner: u32, finder: Finder) -> State {
    let _ = finder.owner_gone.send(());
    State::LastRead { owner, until: Instant::now() + LAST_READ_PATIENCE, finder }
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
fn unwatched<T>(e: &std::io::Error) -> Option<T> {
    warn!("cannot watch the container ({e}): its exit will not stop this daemon; stop it with SIGTERM");
    None
}

fn owner_exited(pid: u32) -> String {
    format!("process {pid} that started us exited before the container started")
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
