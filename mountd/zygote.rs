//! `devremapd zygote` (hidden): where the node daemon's spare keepers come from. The node
//! daemon execs it once (again when the binary at its path is replaced, or it died), and it forks
//! each spare keeper on request, never exec'ing: the spares, their servers (forked by each spare
//! in turn, [`crate::keeper::park_server`]) and the zygote then share the binary's relocated
//! pages, which every exec of a position-independent binary writes (about 320 KiB a process)
//! and nothing writes again (issue 31's memory per container). A spare costs a fork instead of
//! an exec and a dynamic link.
//!
//! The spare is forked with `CLONE_PARENT`: its parent is the node daemon, as a spare the node
//! spawned is, which reaps it, sees its exit status and signals it by a pid no one else can
//! reap. It starts a session of its own (as the node's detach gives a spawned spare) and goes on
//! exactly as `devremapd parked --spare-server` does.
//!
//! Protocol, on fd 0 (a `SOCK_SEQPACKET` socket whose other end only the node daemon holds): a
//! request is one message of one byte carrying one descriptor, the new spare's parcel socket
//! (its fd 0). The answer is one message of 8 bytes: the spare's pid and 0, or 0 and the errno
//! of a fork that failed (native byte order). EOF: the node daemon went; the zygote exits.
//!
//! Assumptions: the zygote has one thread for its life (it runs before the log writer starts
//! and never starts it: what it has to say goes to stderr, the node daemon's log), so a fork
//! copies no lock held by another thread. The raw `clone` leaves the child's C library
//! thread descriptor naming the zygote's thread id, as glibc's own `fork` would not; glibc
//! asks the kernel for the caller's id where it signals itself (`raise`, `abort`), and a
//! recursive lock's owner is that id, unique within the child as long as the zygote lives (a
//! spare forks its server with glibc's `fork`, which sets the server's right).

use crate::cli::ParkedArgs;
use devremap::io_message;
use nix::sys::signal::{SigSet, SigmaskHow, pthread_sigmask};
use nix::sys::socket::{MsgFlags, send};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// The request's size, and the answer's.
pub const REQUEST: usize = 1;
pub const ANSWER: usize = 8;

/// Why the zygote stopped.
#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    #[error("zygote: cannot read a request on fd 0: {}", io_message(.0))]
    Receive(io::Error),
    #[error("zygote: a request came without the spare's socket")]
    NoSocket,
    #[error("zygote: cannot answer on fd 0: {}", io_message(.0))]
    Answer(io::Error),
    #[error("zygote: a spare cannot take its socket as fd 0: {}", io_message(.0))]
    Spare(io::Error),
}

/// Forks a spare for each request, until EOF (then exits with status 0). Returns only in a
/// spare, with the arguments it goes on with (`parked --spare-server`), its parcel socket as
/// its fd 0.
pub fn run() -> Result<ParkedArgs, ZygoteError> {
    // Exec'd by the node daemon, whose signals are blocked (`signals::block`), and a mask is
    // inherited across exec: the zygote takes their default actions, as a process an operator
    // can `kill` should; each spare blocks them again in `main`.
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    loop {
        let Some(parcel) = receive()? else { std::process::exit(0) };
        let forked = clone_parent();
        if let Ok(None) = forked {
            return become_spare(parcel).map(|()| ParkedArgs { spare_server: true });
        }
        drop(parcel);
        let (pid, errno) = match forked {
            Ok(pid) => (pid.unwrap_or_default(), 0),
            Err(e) => (0, e.raw_os_error().unwrap_or(libc::EIO) as u32),
        };
        send(0, &answer(pid, errno), MsgFlags::MSG_NOSIGNAL).map_err(|e| ZygoteError::Answer(e.into()))?;
    }
}

/// An answer: a spare's pid, or 0 and a fork's errno, in native byte order (both ends are this
/// binary on this host).
fn answer(pid: u32, errno: u32) -> [u8; ANSWER] {
    let mut answer = [0u8; ANSWER];
    answer[..4].copy_from_slice(&pid.to_ne_bytes());
    answer[4..].copy_from_slice(&errno.to_ne_bytes());
    answer
}

/// An answer read back: `(pid, errno)`, as [`answer`] put them.
pub fn answer_words(answer: &[u8; ANSWER]) -> (u32, u32) {
    let word = |at: usize| u32::from_ne_bytes([answer[at], answer[at + 1], answer[at + 2], answer[at + 3]]);
    (word(0), word(4))
}

/// The next request's parcel socket; `None` at EOF.
fn receive() -> Result<Option<OwnedFd>, ZygoteError> {
    let mut byte = [0u8; REQUEST];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (len, _, mut fds) =
        crate::parked::receive_rights(0, &mut byte, &mut space).map_err(|e| ZygoteError::Receive(e.into()))?;
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    fds.pop().map(Some).ok_or(ZygoteError::NoSocket)
}

/// `clone(CLONE_PARENT)`: `Some(pid)` in the zygote, `None` in the spare.
fn clone_parent() -> io::Result<Option<u32>> {
    let flags = (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: no new stack and no shared memory: the child runs on a copy of this process, as
    // after fork, and this process has one thread (see the module's assumptions).
    match unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) } {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Some(pid as u32)),
    }
}

/// In the spare: a session of its own, and `parcel` as its fd 0 (where the request socket was).
fn become_spare(parcel: OwnedFd) -> Result<(), ZygoteError> {
    // SAFETY: setsid and dup2 on this process's own session and descriptors.
    unsafe {
        libc::setsid();
        if libc::dup2(parcel.as_raw_fd(), 0) < 0 {
            return Err(ZygoteError::Spare(io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer reads back as it was written: a pid, or 0 and an errno (the node daemon's
    /// reading and the zygote's writing are one format, kept here together).
    #[test]
    fn an_answer_reads_back_as_written() {
        assert_eq!(answer_words(&answer(4_000_000, 0)), (4_000_000, 0));
        assert_eq!(answer_words(&answer(0, libc::EAGAIN as u32)), (0, libc::EAGAIN as u32));
    }
}
