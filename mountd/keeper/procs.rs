//! The keeper's server processes: starting one (its sockets, its reader threads, the plan or
//! the order to load), telling it something, killing and reaping it.

use super::threads::{Readers, read_control, relay_replies, seqpacket_pair};
use super::{Keeper, spawn_thread};
use crate::signals;
use devremap::io_message;
use devremap::keeper::control::{self, Control};
use log::warn;
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
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8};

/// A server process.
pub(super) struct Proc {
    pub(super) epoch: u64,
    pub(super) child: Child,
    pub(super) socket: Arc<OwnedFd>,
    pub(super) control: Arc<OwnedFd>,
    /// The binary it runs, kept open: the next crash restart runs the same one.
    pub(super) exe: Arc<File>,
    /// Its reply thread holds a reply the relay has not counted yet ([`replies_waiting`]).
    pub(super) passing: Arc<AtomicBool>,
}

impl Proc {
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends it a control message without waiting: a server that no longer reads its control
    /// socket (hung, or stopped) must not block the keeper's main thread once the socket is
    /// full. A message that does not fit is logged; the keeper's timers deal with the server.
    pub(super) fn tell(&self, message: &Control) {
        // Any other failure is a server that is gone, which its sockets' end tells.
        if send(self.control.as_raw_fd(), &message.encode(), MsgFlags::MSG_DONTWAIT) == Err(Errno::EAGAIN) {
            warn!("server pid {}: its control socket is full; {message:?} not sent", self.pid());
        }
    }

    /// Ends its relay and control sockets: it reads EOF and exits, and so does our reader.
    pub(super) fn disconnect(&self) {
        let _ = shutdown(self.socket.as_raw_fd(), Shutdown::Both);
        let _ = shutdown(self.control.as_raw_fd(), Shutdown::Both);
    }
}

impl Keeper<'_> {
    /// Starts a server running `exe`, with its relay socket as fd 3 and its control socket as
    /// fd 4, and the threads that read them; tells it to serve `plan`, or to load the inputs.
    pub(super) fn spawn(&mut self, epoch: u64, exe: Arc<File>, plan: Option<&[u8]>) -> io::Result<Proc> {
        let (socket, their_socket) = seqpacket_pair()?;
        let (control, their_control) = seqpacket_pair()?;
        let (fds, exe_fd) = ([their_socket.as_raw_fd(), their_control.as_raw_fd()], exe.as_raw_fd());
        let mut cmd = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()));
        cmd.arg0("devremapd").arg("serve").args(&self.serve_args).stdin(Stdio::null());
        // Only the keeper talks to systemd (the main process); the server tells the keeper.
        cmd.env_remove("NOTIFY_SOCKET");
        set_up_child(&mut cmd, fds, exe_fd);
        let child = cmd.spawn()?;
        // The child has its copies: ours would keep its sockets open after it died, and a
        // write to them would wait for ever instead of failing.
        drop((their_socket, their_control));
        let (socket, control) = (Arc::new(socket), Arc::new(control));
        self.link.shared.lock().sockets.insert(epoch, socket.clone());
        let readers = Arc::new(AtomicU8::new(2));
        let done = || Readers(readers.clone(), epoch, self.link.events.clone());
        let passing = Arc::new(AtomicBool::new(false));
        let (link, reader, replies_done, flag) = (self.link.clone(), socket.clone(), done(), passing.clone());
        let spawned = spawn_thread("replies", move || relay_replies(&link, epoch, &reader, &flag, replies_done))
            .and_then(|()| {
                let (link, control, control_done) = (self.link.clone(), control.clone(), done());
                spawn_thread("control", move || read_control(&link, epoch, &control, control_done))
            });
        let proc = Proc { epoch, child, socket, control, exe, passing };
        if let Err(e) = spawned {
            self.kill(proc);
            return Err(io::Error::other(e));
        }
        // Written by a thread of its own: a plan larger than the socket's buffer waits for the
        // server to read it, and the main thread must not.
        let (what, to) = (plan.map_or_else(|| vec![Control::Load.encode()], control::records), proc.control.clone());
        let _ = spawn_thread("hand-plan", move || {
            for record in what {
                if nix::unistd::write(&*to, &record).is_err() {
                    break;
                }
            }
        });
        Ok(proc)
    }

    /// Kills a server and forgets it. It is reaped by a thread of its own: a process killed
    /// while it waits for a FUSE request that a stuck filesystem's daemon has read (an input on
    /// a hung mount) dies only once that request is answered, and the keeper must not wait.
    pub(super) fn kill(&mut self, mut proc: Proc) {
        let _ = proc.child.kill();
        self.forget(proc);
    }

    /// Forgets a server that has ended or is ending, and reaps it on a thread of its own.
    pub(super) fn forget(&mut self, mut proc: Proc) {
        proc.disconnect();
        self.link.shared.lock().sockets.remove(&proc.epoch);
        let state_file = self.args.state_file.clone();
        let _ = std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || drop(reap(&mut proc.child, state_file.as_deref())));
    }
}

/// Waits for server `child`'s exit and reaps it, removing first what it left of a state file
/// replacement it was killed in (its temporary file): after its exit, so that it writes no
/// more, and before its reaping, while no other process can have its pid, by which the
/// temporary file is named ([`devremap::atomic::remove_left_temporaries`]).
pub(super) fn reap(child: &mut Child, state_file: Option<&Path>) -> io::Result<ExitStatus> {
    if let Some(path) = state_file {
        let pid = Pid::from_raw(child.id() as libc::pid_t);
        while let Err(Errno::EINTR) = waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {}
        devremap::atomic::remove_left_temporaries(path, child.id());
    }
    child.wait()
}

/// Sets the server's descriptors up between fork and exec: the binary's fd kept open, the
/// relay and control sockets as fds 3 and 4, and death with the keeper.
fn set_up_child(cmd: &mut Command, fds: [i32; 2], exe_fd: i32) {
    // SAFETY: between fork and exec the closure makes only async-signal-safe calls (fcntl,
    // prctl, dup2, close) on fds it owns in the child. The copies above 10 keep one source from
    // being overwritten by the other's dup2 to 3 or 4; dup2 clears close-on-exec. The binary's
    // fd stays open across exec (an interpreter of a script reads it by that name) and is
    // never 3 or 4 (the signal thread's, for the keeper's life).
    unsafe {
        cmd.pre_exec(move || {
            if exe_fd == 3 || exe_fd == 4 || libc::fcntl(exe_fd, libc::F_SETFD, 0) < 0 {
                return Err(io::Error::from_raw_os_error(libc::EBADF));
            }
            // A server dies with its keeper, even one stopped (SIGSTOP) that would never read
            // the end of its socket. (The keeper's main thread, which spawns, lives as long.)
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
