//! The server's FUSE session on the keeper's relay socket: each request read whole (one
//! `SOCK_SEQPACKET` record), answered by the [`Adapter`], the reply written back. This is the
//! I/O edge; what is answered is decided in the library's adapter, from bytes to bytes.
//!
//! Threads (issue 31): the thread that runs the session answers on it, and `--threads N` adds
//! N - 1 more (`fuse-1` ...) reading the same socket, each record going to one of them. fuser
//! 0.18's `Session::run`, which this replaces, answered only on threads of its own and kept
//! the caller waiting for them: a thread in every container that did nothing.
//!
//! Assumptions: the socket is blocking; the keeper relays one kernel request per record and
//! reads one reply per record; it ends the session by closing the socket (or the lifecycle by
//! shutting its reading side), which every thread reads as an end of file.

use devremap::served::adapter::{Adapter, Handshake};
use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, Shutdown, recv, send, shutdown};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// A request's buffer. The kernel sends this file system no WRITE (it has no regular file), so
/// its largest request is a SETXATTR's 64 KiB value with its name; a longer record is cut to
/// this and answered EIO. Pages not written are never touched.
const REQUEST_BUFFER: usize = 1 << 20;

/// A session past its INIT.
pub struct Session {
    fuse: Arc<OwnedFd>,
    adapter: Arc<Adapter>,
    threads: u16,
}

/// Reads the INIT (the kernel's, or the keeper's replay of it) and answers it; a kernel of a
/// newer major version is answered with ours and sends INIT again.
pub fn handshake(fuse: OwnedFd, mut adapter: Adapter, threads: u16) -> io::Result<Session> {
    let page_size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096) as u32;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = receive(&fuse, &mut buf)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::NotConnected, "the keeper closed the relay before INIT"));
        }
        match adapter.handshake(&buf[..n], page_size) {
            Handshake::Agreed(reply) => {
                answer(&fuse, &reply);
                break;
            }
            Handshake::Again(reply) => answer(&fuse, &reply),
            Handshake::Refused(reply, e) => {
                reply.iter().for_each(|r| answer(&fuse, r));
                return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
            }
        }
    }
    Ok(Session { fuse: Arc::new(fuse), adapter: Arc::new(adapter), threads })
}

impl Session {
    /// Answers requests until the socket ends, on this thread and `threads - 1` more; the
    /// first error of any.
    pub fn run(self) -> io::Result<()> {
        let mut others = Vec::new();
        for i in 1..self.threads {
            let (fuse, adapter) = (self.fuse.clone(), self.adapter.clone());
            let spawned = std::thread::Builder::new().name(format!("fuse-{i}")).spawn(move || serve(&fuse, &adapter));
            match spawned {
                Ok(thread) => others.push(thread),
                Err(e) => log::warn!("cannot start FUSE thread fuse-{i} ({e}); answering on fewer"),
            }
        }
        let mut ended = serve(&self.fuse, &self.adapter);
        for thread in others {
            let result = thread.join().unwrap_or_else(|_| Err(io::Error::other("a FUSE thread panicked")));
            ended = ended.and(result);
        }
        ended
    }
}

/// One thread's loop: read a request, write its reply, until the end of the socket. DESTROY
/// (the kernel's last word) is answered and ends every thread's loop.
fn serve(fuse: &OwnedFd, adapter: &Adapter) -> io::Result<()> {
    let mut buf = vec![0u8; REQUEST_BUFFER];
    loop {
        let n = receive(fuse, &mut buf)?;
        if n == 0 {
            return Ok(());
        }
        let msg = &buf[..n];
        if let Some(reply) = adapter.answer(msg) {
            answer(fuse, &reply);
        }
        if devremap::fuse::Request::parse(msg).is_ok_and(|r| r.opcode == devremap::fuse::abi::DESTROY) {
            let _ = shutdown(fuse.as_raw_fd(), Shutdown::Read);
            return Ok(());
        }
    }
}

/// One record; 0 at the end of the socket (the keeper closed it, or its reading side was shut).
fn receive(fuse: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match recv(fuse.as_raw_fd(), buf, MsgFlags::empty()) {
            Ok(n) => return Ok(n),
            Err(Errno::EINTR | Errno::EAGAIN) => continue,
            Err(Errno::ECONNRESET | Errno::ENODEV) => return Ok(0),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Writes a reply; a keeper that is gone is noticed at the next read.
fn answer(fuse: &OwnedFd, reply: &[u8]) {
    if let Err(e) = send(fuse.as_raw_fd(), reply, MsgFlags::MSG_NOSIGNAL) {
        log::debug!("a FUSE reply was not sent: {e}");
    }
}
