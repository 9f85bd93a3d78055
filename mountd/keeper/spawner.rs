//! Servers are spawned off the keeper's main thread (issue 31: the keeper never waits on a
//! spawn). `Command::spawn` returns only once the child has exec'd (it reads a close-on-exec
//! pipe), so a child stopped between fork and exec (`SIGSTOP`, a frozen cgroup, a debugger)
//! would hold the main thread, and with it signals, hang checks, readiness and the stop. A
//! spawner thread opens the binary (an upgrade's path may be on a stuck filesystem), spawns,
//! and says what came of it ([`Ev::Started`]); the main thread goes on meanwhile, and the state
//! machine gives up on a spawn that has not returned within `--reload-timeout`.
//!
//! Assumptions: a server's `PR_SET_PDEATHSIG` fires when the *thread* that forked it ends, not
//! the process; so each spawn has a thread of its own, which lives until its server has exited
//! (or at once, when the spawn failed). A keeper whose server rested (`--rest-after`) keeps no
//! thread for it, and a stuck spawn holds its own thread, never the next start.
use super::procs::set_up_child;
use super::relaying::seqpacket_pair;
use super::{Ev, KeeperError, spawn_thread};
use crate::signals::Woken;
use devremap::io_message;
use devremap::pidfd::Child as ServerChild;
use devremap::pidfd::{exited, pidfd_open};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

/// The binary a server runs: one kept open, or the file at a path, opened by the spawner.
pub(super) enum Exe {
    Open(Arc<File>),
    Path(PathBuf),
}

/// A server to start.
pub(super) struct Job {
    pub(super) epoch: u64,
    pub(super) exe: Exe,
    /// Its arguments after `serve`.
    pub(super) args: Vec<OsString>,
    /// Its ends of the relay and control sockets, its fds 3 and 4.
    pub(super) sockets: [OwnedFd; 2],
}

/// What came of a spawn: the child and the binary it runs, or why it did not start.
pub(super) type Started = Result<(ServerChild, Arc<File>), String>;

/// Spawns `job` on a thread of its own, which says what came of it on `events`
/// ([`Ev::Started`]) and then lives as long as the server it started.
pub(super) fn submit(events: &Woken<Ev>, job: Job) -> Result<(), KeeperError> {
    let events = events.clone();
    spawn_thread("spawner", move || {
        let epoch = job.epoch;
        let started = spawn(job);
        // Opened before the main thread has the child, so before anything can reap it.
        let server = started.as_ref().ok().map(|(child, _)| pidfd_open(child.id()));
        let _ = events.send(Ev::Started(epoch, started));
        match server {
            Some(Ok(server)) => {
                exited(&server, None);
            }
            // No pidfd to wait on (out of descriptors): this thread stays for the keeper's
            // life, as every spawner thread once did, rather than kill its server.
            Some(Err(_)) => loop {
                std::thread::park();
            },
            None => {}
        }
    })
}

/// Starts server `job.epoch` from `job.exe`, with its sockets as fds 3 and 4.
fn spawn(job: Job) -> Started {
    let exe = match job.exe {
        Exe::Open(exe) => exe,
        Exe::Path(path) => Arc::new(open_high(&path).map_err(|e| format!("{}: {}", path.display(), io_message(&e)))?),
    };
    let mut cmd = server_command(&exe, &job.sockets);
    cmd.arg("serve").args(&job.args).stdin(Stdio::null());
    stop_before_exec(&mut cmd, job.epoch);
    let child = ServerChild::Spawned(cmd.spawn().map_err(|e| io_message(&e))?);
    // The child has its copies (`job.sockets` are dropped here): ours would keep its sockets
    // open after it died, and a write to them would wait for ever instead of failing.
    Ok((child, exe))
}

/// A server run from `exe` (named `devremapd`), with `sockets` as its fds 3 and 4; its
/// arguments are the caller's.
fn server_command(exe: &File, sockets: &[OwnedFd; 2]) -> Command {
    let mut cmd = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()));
    cmd.arg0("devremapd");
    // Only the keeper talks to systemd (the main process); the server tells the keeper.
    cmd.env_remove("NOTIFY_SOCKET");
    set_up_child(&mut cmd, sockets.each_ref().map(AsRawFd::as_raw_fd), exe.as_raw_fd());
    cmd
}

/// Opens the binary at `path` at fd 10 or above: a spawn refuses a binary at 3 or 4, the fds a
/// server's sockets take. A keeper started directly has its event queue's pair there for
/// life; one started as a spare (`devremapd parked`) has its fds laid out otherwise, so a
/// number freed meanwhile (an old server's socket) could be 4 at an upgrade's open.
fn open_high(path: &Path) -> io::Result<File> {
    let file = File::open(path)?;
    Ok(File::from(rustix::io::fcntl_dupfd_cloexec(&file, 10)?))
}

/// A parked server handed its command line ([`ParkedServer::hand`]): what came of it as a
/// spawn's result, with the keeper's ends of its relay and control sockets; or why it was not.
pub(super) type Handed = Result<(Started, [OwnedFd; 2]), String>;

/// A first server started before its keeper knows what it will serve (by a spare keeper of
/// the node daemon, `devremapd parked --spare-server`): it waits for its command line on its
/// parcel socket ([`crate::parked`]). What the keeper keeps: the child, the binary it runs, the
/// keeper's ends of its relay and control sockets, and of its parcel socket.
pub(crate) struct ParkedServer {
    child: ServerChild,
    exe: Arc<File>,
    sockets: [OwnedFd; 2],
    parcel: OwnedFd,
}

/// Which side of [`park_server`]'s fork this process is.
pub(crate) enum Parked {
    /// The keeper, with its parked server.
    Keeper(ParkedServer),
    /// The parked server: its parcel socket is its fd 0, its relay and control sockets 3 and 4.
    Server,
}

/// Starts a server parked, by a fork of this process that never execs: the keeper's and the
/// server's memory is then the same pages until either writes them, the binary's relocated
/// pointers (about 400 KiB a process, written by every exec of a position-independent binary)
/// above all, which are never written again. Done on the main thread before the keeper has a
/// mount, so no container waits on it; the main thread lives as long as the keeper, which the
/// server's death signal is tied to.
///
/// Call only while this process has one thread (before the log writer starts): a fork copies
/// the calling thread alone, and a lock another thread held would stay held in the child.
pub(crate) fn park_server() -> Result<Parked, KeeperError> {
    let exe = Arc::new(open_high(Path::new("/proc/self/exe")).map_err(KeeperError::OpenOwnBinary)?);
    let started = (move || {
        let (socket, their_socket) = seqpacket_pair()?;
        let (control, their_control) = seqpacket_pair()?;
        let (parcel, their_parcel) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        let keeper = std::process::id() as libc::pid_t;
        // SAFETY: this process has one thread (the caller's promise), so the child's copy of
        // it holds no lock and may run anything; it goes on as `devremapd parked` would.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                // The keeper's ends and its binary are the keeper's alone.
                drop((socket, control, parcel, exe));
                if let Err(e) = become_parked_server(keeper, [their_parcel, their_socket, their_control]) {
                    let _ = writeln!(std::io::stderr(), "error: parked: cannot take its sockets: {}", io_message(&e));
                    // SAFETY: _exit ends this process only.
                    unsafe { libc::_exit(1) }
                }
                Ok(Parked::Server)
            }
            pid => Ok(Parked::Keeper(ParkedServer {
                child: ServerChild::forked(pid as u32),
                exe,
                sockets: [socket, control],
                parcel,
            })),
        }
    })();
    started.map_err(KeeperError::ParkServer)
}

/// In the forked server: dies with its keeper, and has its descriptors as a spawned one has
/// them: the parcel socket as fd 0, the relay and control sockets as 3 and 4 (`theirs`, in that
/// order). The keeper's own descriptors were closed by the caller; it has no others yet but
/// its standard ones.
fn become_parked_server(keeper: libc::pid_t, theirs: [OwnedFd; 3]) -> io::Result<()> {
    // SAFETY: prctl and getppid on this process alone.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
            return Err(io::Error::last_os_error());
        }
        // The keeper died before the death signal was set: it would never come.
        if libc::getppid() != keeper {
            libc::_exit(0);
        }
    }
    // Copies above 10 first, so that no dup2 below overwrites a source still to be copied.
    let high = theirs.map(|fd| rustix::io::fcntl_dupfd_cloexec(&fd, 10));
    for (fd, to) in high.into_iter().zip([0, 3, 4]) {
        // SAFETY: dup2 onto a standard fd or a server socket's number, which are ours to set;
        // dup2 clears close-on-exec, as a spawn's would. The copy is closed as `fd` goes.
        if unsafe { libc::dup2(fd?.as_raw_fd(), to) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // Only the keeper talks to systemd, as for a spawned server (a spare has no such socket).
    // SAFETY: this process has one thread.
    unsafe { std::env::remove_var("NOTIFY_SOCKET") };
    Ok(())
}

impl ParkedServer {
    /// The binary it runs.
    pub(super) fn exe(&self) -> Arc<File> {
        self.exe.clone()
    }

    /// Hands it its command line (`serve` and `args`) and our stderr as its log: what came of
    /// it as a spawn's result, with the keeper's ends of its sockets. A server that is gone or
    /// stopped meanwhile is killed and reaped, and the caller spawns one.
    ///
    /// Bug (found from outside): a parked server stopped (`SIGSTOP`, a debugger) was handed its
    /// command line, which it never read: the container's mount failed after 30 s.
    pub(super) fn hand(mut self, args: &[OsString]) -> Handed {
        let pid = self.child.id();
        let words: Vec<OsString> = std::iter::once("serve".into()).chain(args.iter().cloned()).collect();
        let sent = if devremap::procfs::runs(pid) {
            crate::parked::Words::encode(&words)
                .and_then(|w| crate::parked::send(self.parcel.as_fd(), &w, &[2]))
                .map_err(|e| format!("did not take its command line: {}", io_message(&e)))
        } else {
            Err("is not used (it is stopped, or gone)".to_owned())
        };
        match sent {
            Ok(()) => Ok((Ok((self.child, self.exe)), self.sockets)),
            Err(why) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(format!("the parked server (pid {pid}) {why}"))
            }
        }
    }
}

/// The test hook `DEVREMAPD_FAILPOINT=stop-before-exec:N`: server epoch N (the first is 1)
/// stops itself (`SIGSTOP`) between fork and exec, once it dies with its keeper: its spawn does
/// not return until it is continued or killed.
#[cfg(feature = "test-hooks")]
fn stop_before_exec(cmd: &mut Command, epoch: u64) {
    let failpoint = std::env::var("DEVREMAPD_FAILPOINT").ok();
    if failpoint.and_then(|f| f.strip_prefix("stop-before-exec:")?.parse().ok()) == Some(epoch) {
        // SAFETY: raise is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::raise(libc::SIGSTOP);
                Ok(())
            });
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
fn stop_before_exec(_: &mut Command, _: u64) {}
