//! The server's FUSE session on the keeper's relay socket: each request read whole (one
//! `SOCK_SEQPACKET` record), answered by the [`Adapter`], the reply written back. This is the
//! I/O edge; what is answered is decided in the library's adapter, from bytes to bytes.
//!
//! Threads (issue 31): with `--threads 1` the server's main thread answers between its other
//! events (its lifecycle's: signals, control messages, reloads), with the [`Answerer`]; with
//! `--threads N`, N threads of their own (`fuse-1` ...) read the same socket, each record going
//! to one of them.
//! fuser 0.18's `Session::run`, which this replaces, answered only on threads of its own and
//! kept the caller waiting for them: a thread in every container that did nothing.
//!
//! Assumptions: the socket is blocking (the main thread reads it with `MSG_DONTWAIT`); the keeper relays one kernel request per record and
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
    /// With one thread, the caller answers, with the [`Answerer`], whenever its own loop finds
    /// a request waiting; with N, N threads of their own answer (`fuse-1` ... `fuse-N`) and the
    /// caller none: a handler that never returns (a bug, or the `lookup-stall` test hook) then
    /// holds one of them, never the caller's other work. Each of those threads that ends calls
    /// `ended` with how (the caller, which then does not read the socket, learns the session's
    /// end from it).
    pub fn start(self, ended: impl Fn(io::Result<()>) + Send + Sync + 'static) -> (Answerer, Others) {
        let ended = Arc::new(ended);
        let mut others = Vec::new();
        let own = if self.threads > 1 { 1..self.threads + 1 } else { 1..1 };
        for i in own {
            let (fuse, adapter, ended) = (self.fuse.clone(), self.adapter.clone(), ended.clone());
            let spawned = std::thread::Builder::new().name(format!("fuse-{i}")).spawn(move || {
                let result = serve(&fuse, &adapter);
                ended(result.as_ref().map(|_| ()).map_err(|e| io::Error::new(e.kind(), e.to_string())));
                result
            });
            match spawned {
                Ok(thread) => others.push(thread),
                Err(e) => log::warn!("cannot start FUSE thread fuse-{i} ({e}); answering on fewer"),
            }
        }
        let answers = others.is_empty();
        (Answerer { fuse: self.fuse, adapter: self.adapter, buf: Vec::new(), answers }, Others(others))
    }
}

/// The threads answering beside the caller's.
pub struct Others(Vec<std::thread::JoinHandle<io::Result<()>>>);

impl Others {
    /// Waits for them to end (the socket's end, or its reading side shut); the first error.
    pub fn join(self) -> io::Result<()> {
        let mut ended = Ok(());
        for thread in self.0 {
            let result = thread.join().unwrap_or_else(|_| Err(io::Error::other("a FUSE thread panicked")));
            ended = ended.and(result);
        }
        ended
    }
}

/// What the thread that runs the server's life answers with, between its other events.
pub struct Answerer {
    fuse: Arc<OwnedFd>,
    adapter: Arc<Adapter>,
    /// Allocated at the first request (untouched pages cost nothing).
    buf: Vec<u8>,
    /// Whether the caller answers at all (one thread).
    answers: bool,
}

impl Answerer {
    /// The socket, to poll; none where threads of their own answer.
    pub fn fd(&self) -> Option<Arc<OwnedFd>> {
        self.answers.then(|| self.fuse.clone())
    }

    /// Answers the request waiting, if one still is (a thread beside may have taken it): true
    /// while the socket is open, false at its end.
    pub fn answer_waiting(&mut self) -> io::Result<bool> {
        if self.buf.is_empty() {
            self.buf = vec![0u8; REQUEST_BUFFER];
        }
        let n = match recv(self.fuse.as_raw_fd(), &mut self.buf, MsgFlags::MSG_DONTWAIT) {
            Ok(n) => n,
            Err(Errno::EINTR | Errno::EAGAIN) => return Ok(true),
            Err(Errno::ECONNRESET | Errno::ENODEV) => 0,
            Err(e) => return Err(e.into()),
        };
        Ok(n > 0 && answered(&self.fuse, &self.adapter, &self.buf[..n]))
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
        if !answered(fuse, adapter, &buf[..n]) {
            return Ok(());
        }
    }
}

/// Answers one request; false after DESTROY (the kernel's last word), which ends every
/// thread's loop.
fn answered(fuse: &OwnedFd, adapter: &Adapter, msg: &[u8]) -> bool {
    if let Some(reply) = adapter.answer(msg) {
        answer(fuse, &reply);
    }
    if devremap::fuse::Request::parse(msg).is_ok_and(|r| r.opcode == devremap::fuse::abi::DESTROY) {
        let _ = shutdown(fuse.as_raw_fd(), Shutdown::Read);
        return false;
    }
    true
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
