//! The keeper's server processes: starting one (its sockets, its spawn on a spawner thread,
//! the relay's reading of its sockets, the plan or the order to load), telling it something, killing and
//! reaping it.

use super::relaying::seqpacket_pair;
use super::spawner::{self, Exe, Job, Started};
use super::{Keeper, KeeperError, spawn_thread};
use crate::signals;
use devremap::io_message;
use devremap::keeper::control::{self, Control};
use devremap::keeper::servers::{Binary, Event};
use devremap::pidfd::Child as ServerChild;
use log::{info, warn};
use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, Shutdown, send, shutdown};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Arc;

/// A server process.
pub(super) struct Proc {
    pub(super) epoch: u64,
    pub(super) child: ServerChild,
    pub(super) socket: Arc<OwnedFd>,
    pub(super) control: Arc<OwnedFd>,
    /// The binary it runs, kept open: the next crash restart runs the same one.
    pub(super) exe: Arc<File>,
}

impl Proc {
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends it a control message without waiting: a server that no longer reads its control
    /// socket (hung, or stopped) must not block the keeper's main thread once the socket is
    /// full. A message that does not fit is logged; the keeper's timers deal with the server.
    pub(super) fn tell(&self, message: &Control) {
        self.write_now(&self.control, &message.encode(), &format_args!("{message:?}"));
    }

    /// Writes `record` (`what`, in the warning) to one of its sockets without waiting, as
    /// [`Proc::tell`] does.
    pub(super) fn write_now(&self, to: &OwnedFd, record: &[u8], what: &dyn std::fmt::Display) {
        // Any other failure is a server that is gone, which its sockets' end tells.
        if send(to.as_raw_fd(), record, MsgFlags::MSG_DONTWAIT) == Err(Errno::EAGAIN) {
            warn!("server pid {}: its socket is full; {what} not sent", self.pid());
        }
    }

    /// Ends its relay and control sockets: it reads EOF and exits, and the relay reads their end.
    pub(super) fn disconnect(&self) {
        let _ = shutdown(self.socket.as_raw_fd(), Shutdown::Both);
        let _ = shutdown(self.control.as_raw_fd(), Shutdown::Both);
    }
}

/// A server whose spawn has not returned: what it is started with, and the keeper's ends of
/// its sockets.
pub(super) struct Pending {
    binary: Binary,
    plan: Option<Vec<u8>>,
    socket: OwnedFd,
    control: OwnedFd,
}

impl Keeper<'_> {
    /// Starts server `epoch` from `binary`, with the current plan if `plan`: its sockets are made
    /// here, and it is spawned by a spawner thread ([`super::spawner`]), whose result comes back
    /// as [`Ev::Started`](super::Ev::Started). `Some`: it failed already.
    pub(super) fn start(&mut self, epoch: u64, binary: Binary, plan: bool) -> Option<Event> {
        let plan = if plan { self.plan.clone() } else { None };
        let exe = match binary {
            Binary::Good => Exe::Open(self.good.clone()),
            Binary::Path => Exe::Path(self.exe_path.clone()),
        };
        if binary == Binary::Good
            && let Some(handed) = self.parked.take()
        {
            match handed {
                Ok((started, [socket, control])) => {
                    return self.connected(epoch, started, Pending { binary, plan, socket, control });
                }
                Err(why) => warn!("{why}; starting one"),
            }
        }
        let submitted = (|| {
            let (socket, their_socket) = seqpacket_pair()?;
            let (control, their_control) = seqpacket_pair()?;
            let job = Job { epoch, exe, args: self.serve_args.clone(), sockets: [their_socket, their_control] };
            spawner::submit(&self.link.events, job).map_err(io::Error::other)?;
            io::Result::Ok(Pending { binary, plan, socket, control })
        })();
        match submitted {
            Ok(pending) => {
                self.pending.insert(epoch, pending);
                None
            }
            Err(e) => Some(Event::SpawnFailed { epoch, why: io_message(&e) }),
        }
    }

    /// Server `epoch`'s spawn returned: its sockets are read, and it is told to serve its
    /// plan, or to load the inputs. One given up on meanwhile (its spawn did not return in
    /// time, or the keeper stops) is killed and reaped, and never serves.
    pub(super) fn started(&mut self, epoch: u64, started: Started) -> Option<Event> {
        let Some(pending) = self.pending.remove(&epoch) else {
            if let Ok((mut child, _)) = started {
                warn!("server pid {}: its start returned after it was abandoned; killed it", child.id());
                let _ = child.kill();
                let _ = self.reap_later(child, drop);
            }
            return None;
        };
        self.connected(epoch, started, pending)
    }

    /// Server `epoch`, spawned or handed its command line: what came of its start.
    fn connected(&mut self, epoch: u64, started: Started, pending: Pending) -> Option<Event> {
        let handed_plan = pending.plan.is_some();
        let (binary, path) = (pending.binary, self.exe_path.display().to_string());
        match started.map(|(child, exe)| self.connect(epoch, child, exe, pending)) {
            Ok(proc) => {
                let pid = proc.pid();
                if binary == Binary::Path {
                    info!("upgrade: started {path} as server pid {pid}");
                }
                self.procs.insert(epoch, proc);
                Some(Event::Spawned { epoch, pid, handed_plan })
            }
            Err(why) => Some(Event::SpawnFailed { epoch, why }),
        }
    }

    /// Abandons server `epoch`'s spawn, if it has not returned: our ends of its sockets are
    /// closed (a server that starts after all reads their end), and it is killed if it returns.
    pub(super) fn abandon(&mut self, epoch: u64) {
        self.pending.remove(&epoch);
    }

    /// Has the relay read a spawned server's sockets, and hands it its plan (or the order to
    /// load).
    fn connect(&mut self, epoch: u64, child: ServerChild, exe: Arc<File>, pending: Pending) -> Proc {
        let (socket, control) = (Arc::new(pending.socket), Arc::new(pending.control));
        self.relaying.add_server(&self.link, epoch, socket.clone(), control.clone());
        let proc = Proc { epoch, child, socket, control, exe };
        // What the socket's buffer takes is written here, without waiting; the rest by a thread
        // of its own: a plan larger than the buffer waits for the server to read it, and the main
        // thread must not. Bug (a trace of a container's start): the order to load, a few bytes,
        // went by that thread too, and on a busy CPU the thread's first run came 1.7 ms later,
        // the server waiting for it, and the container's start with it.
        let plan = pending.plan.as_deref();
        let mut what = plan.map_or_else(|| vec![Control::Load.encode()], control::records).into_iter().peekable();
        while let Some(record) = what.peek() {
            match send(proc.control.as_raw_fd(), record, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL) {
                Ok(_) => drop(what.next()),
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => break,
                // The server is gone: its sockets' end says so.
                Err(_) => return proc,
            }
        }
        if what.peek().is_some() {
            let to = proc.control.clone();
            let _ = spawn_thread("hand-plan", move || {
                for record in what {
                    if nix::unistd::write(&*to, &record).is_err() {
                        break;
                    }
                }
            });
        }
        proc
    }

    /// Kills a server and forgets it. It is reaped by a thread of its own: a process killed
    /// while it waits for a FUSE request that a stuck filesystem's daemon has read (an input on
    /// a hung mount) dies only once that request is answered, and the keeper must not wait.
    pub(super) fn kill(&mut self, mut proc: Proc) {
        let _ = proc.child.kill();
        self.forget(proc);
    }

    /// Forgets a server that has ended or is ending, and reaps it on a thread of its own.
    pub(super) fn forget(&mut self, proc: Proc) {
        proc.disconnect();
        let _ = self.reap_later(proc.child, drop);
    }

    /// Reaps `child` on a thread of its own, which hands its status to `then`.
    pub(super) fn reap_later(
        &self,
        mut child: ServerChild,
        then: impl FnOnce(io::Result<ExitStatus>) + Send + 'static,
    ) -> Result<(), KeeperError> {
        let state_file = self.args.state_file.clone();
        spawn_thread("reaper", move || then(reap(&mut child, state_file.as_deref())))
    }

    /// A server replaced or rested, taken from those leaving: `epoch`'s, if it is one.
    pub(super) fn take_leaving(&mut self, epoch: u64) -> Option<Proc> {
        let i = self.leaving.iter().position(|p| p.epoch == epoch)?;
        Some(self.leaving.swap_remove(i))
    }
}

/// Waits for server `child`'s exit and reaps it, removing first what it left of a state file
/// replacement it was killed in (its temporary file): after its exit, so that it writes no
/// more, and before its reaping, while no other process can have its pid, by which the
/// temporary file is named ([`devremap::atomic::remove_left_temporaries`]).
pub(super) fn reap(child: &mut ServerChild, state_file: Option<&Path>) -> io::Result<ExitStatus> {
    devremap::failpoint::wait_at("reap");
    if let Some(path) = state_file {
        let pid = Pid::from_raw(child.id() as libc::pid_t);
        while let Err(Errno::EINTR) = waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {}
        devremap::atomic::remove_left_temporaries(path, child.id());
    }
    child.wait()
}

/// Sets the server's descriptors up between fork and exec: the binary's fd kept open, the
/// relay and control sockets as fds 3 and 4, and death with the keeper.
pub(super) fn set_up_child(cmd: &mut Command, fds: [i32; 2], exe_fd: i32) {
    // SAFETY: between fork and exec the closure makes only async-signal-safe calls (fcntl,
    // prctl, dup2, close) on fds it owns in the child. The copies above 10 keep one source from
    // being overwritten by the other's dup2 to 3 or 4; dup2 clears close-on-exec. The binary's
    // fd stays open across exec (an interpreter of a script reads it by that name) and is
    // never 3 or 4 (the event queue's pair, for the keeper's life).
    unsafe {
        cmd.pre_exec(move || {
            if exe_fd == 3 || exe_fd == 4 || libc::fcntl(exe_fd, libc::F_SETFD, 0) < 0 {
                return Err(io::Error::from_raw_os_error(libc::EBADF));
            }
            // A server dies with its keeper, even one stopped (SIGSTOP) that would never read
            // the end of its socket. (The spawner thread that forks it lives as long.)
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                return Err(io::Error::last_os_error());
            }
            let high = fds.map(|fd| libc::fcntl(fd, libc::F_DUPFD, 10));
            for (from, to) in high.into_iter().zip([3, 4]) {
                if from < 0 || libc::dup2(from, to) < 0 {
                    return Err(io::Error::last_os_error());
                }
                libc::close(from);
            }
            Ok(())
        });
    }
}

/// The path the keeper was started by, unresolved: `argv[0]` made absolute, or, for a bare
/// name, the first file of that name on `PATH` (as the shell found it); `None` when that is
/// not the binary we run (`exec -a`). An upgrade opens the file this path names then, so an
/// install that switches a symlink (alternatives, stow, `/opt/x-<version>`) upgrades to the
/// binary the link names now: `current_exe` reads `/proc/self/exe`, where every symlink is
/// already resolved to the old binary.
pub(crate) fn started_as(running: &File) -> Option<PathBuf> {
    let argv0 = PathBuf::from(std::env::args_os().next()?);
    let path = if argv0.as_os_str().as_encoded_bytes().contains(&b'/') {
        std::path::absolute(&argv0).ok()?
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(&argv0)).find(|p| p.is_file())?
    };
    let (named, ours) = (std::fs::metadata(&path).ok()?, running.metadata().ok()?);
    (named.dev() == ours.dev() && named.ino() == ours.ino()).then(|| std::path::absolute(&path).ok()).flatten()
}

/// The path an upgrade opens: [`started_as`], else the link `/proc/self/exe`, without the
/// ` (deleted)` the kernel adds once the file it names was replaced. A package manager renames
/// the new binary over the old one; a daemon started from the old one in that moment found its
/// `argv[0]` naming the new file, took `<path> (deleted)` for its own, and refused every later
/// upgrade, for good (found from outside; a node daemon started then did not start at all).
pub(crate) fn own_path(running: &File) -> io::Result<PathBuf> {
    match started_as(running) {
        Some(path) => Ok(path),
        None => std::env::current_exe().map(without_deleted),
    }
}

/// `link` (what `/proc/self/exe` reads) without the kernel's ` (deleted)`.
fn without_deleted(link: PathBuf) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    match link.as_os_str().as_bytes().strip_suffix(b" (deleted)") {
        Some(path) => PathBuf::from(std::ffi::OsStr::from_bytes(path)),
        None => link,
    }
}

/// A server's exit status in words: `exit status 1`, `signal 9 (SIGKILL)`.
pub(super) fn status_text(status: io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => match s.signal() {
            Some(sig) => format!("signal {sig} ({})", signals::signal_name(sig)),
            None => format!("exit status {}", s.code().unwrap_or(-1)),
        },
        Err(e) => format!("unknown status: {}", io_message(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a replaced binary's link names the path the new binary is at now.
    #[test]
    fn a_replaced_binarys_link_names_its_path() {
        assert_eq!(without_deleted("/usr/bin/devremapd (deleted)".into()), Path::new("/usr/bin/devremapd"));
        assert_eq!(without_deleted("/usr/bin/devremapd".into()), Path::new("/usr/bin/devremapd"));
    }
}
