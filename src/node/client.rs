//! A client of the node daemon: one request on a connection of its own, and the answer. The
//! one I/O edge of this folder (as `runtime::container_daemon` is of the wrapper's): used by
//! `devremap-runtime` and `devremapd ctl`.

use super::protocol::{self, Answer, MAX_ANSWER, ProtocolError, Request};
use crate::io_message;
use std::io::{self, BufRead, BufReader, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a request got no answer, or a refusal; every message names the socket.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens there: the caller may start a daemon.
    #[error("{}: no node daemon answers ({})", socket.display(), io_message(source))]
    NoDaemon { socket: PathBuf, source: io::Error },
    #[error("{}: {}", socket.display(), io_message(source))]
    Io { socket: PathBuf, source: io::Error },
    /// The daemon ended the connection before answering (it was going away): the caller may
    /// ask again.
    #[error("{}: the node daemon closed the connection without an answer", socket.display())]
    NoAnswer { socket: PathBuf },
    #[error("{}: the node daemon's answer: {source}", socket.display())]
    Protocol { socket: PathBuf, source: ProtocolError },
    /// The daemon took the connection and did not answer in time: stopped (`SIGSTOP`, a
    /// debugger), or stuck. What it did with the request is not known.
    #[error("{}: the node daemon did not answer within {} s (stopped, or stuck?)", socket.display(), timeout.as_secs_f64())]
    Timeout { socket: PathBuf, timeout: Duration },
    #[error(transparent)]
    Unsendable(ProtocolError),
    /// The daemon's own refusal, in its words.
    #[error("{why}")]
    Refused { why: String },
}

impl ClientError {
    /// Whether no daemon took the request: asking again (after starting one) is safe.
    pub fn untaken(&self) -> bool {
        matches!(self, ClientError::NoDaemon { .. } | ClientError::NoAnswer { .. })
    }

    /// Whether the daemon had no place for the request ([`protocol::BUSY`]), or was asked to
    /// make way while it sets a container up ([`protocol::SETTING_UP`]): it did nothing, and
    /// asking again later is safe (found from outside: a service started beside a wrapper's
    /// daemon with a start under way took the second for a refusal and exited, `another node
    /// daemon serves it`).
    pub fn busy(&self) -> bool {
        matches!(self, ClientError::Refused { why } if why == protocol::BUSY || why == protocol::SETTING_UP)
    }
}

/// Sends `request` to the daemon at `socket` and returns its answer's data; waits at most
/// `timeout` for each read or write.
pub fn ask(socket: &Path, request: &Request, timeout: Duration) -> Result<serde_json::Value, ClientError> {
    ask_passing(socket, request, None, timeout)
}

/// [`ask`], handing the daemon a copy of descriptor `pass` with the request (`SCM_RIGHTS`).
pub fn ask_passing(
    socket: &Path,
    request: &Request,
    pass: Option<BorrowedFd>,
    timeout: Duration,
) -> Result<serde_json::Value, ClientError> {
    // A descriptor the daemon should not have sent is closed here.
    exchange(socket, request, pass, timeout).map(|(data, _)| data)
}

/// [`ask`], with the descriptor the daemon handed over with its answer, if any (`attach`).
pub fn ask_receiving(
    socket: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<(serde_json::Value, Option<OwnedFd>), ClientError> {
    exchange(socket, request, None, timeout)
}

/// One request, with `pass` if given, and the answer's data with the descriptor that came with
/// it.
fn exchange(
    socket: &Path,
    request: &Request,
    pass: Option<BorrowedFd>,
    timeout: Duration,
) -> Result<(serde_json::Value, Option<OwnedFd>), ClientError> {
    // A read or write that timed out says so (found from outside: a stopped daemon left a
    // start waiting its minute, then said "resource temporarily unavailable").
    let io = |source: io::Error| match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ClientError::Timeout { socket: socket.to_owned(), timeout }
        }
        _ => ClientError::Io { socket: socket.to_owned(), source },
    };
    let line = protocol::request_line(request).map_err(ClientError::Unsendable)?;
    let stream = UnixStream::connect(socket).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            ClientError::NoDaemon { socket: socket.to_owned(), source }
        }
        _ => io(source),
    })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    match send(&stream, line.as_bytes(), pass) {
        // The daemon answered before it read (too busy to) and closed, or was going away: its
        // answer, if it wrote one, is still there to read; if not, there is none.
        Err(e) if matches!(e.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) => {}
        sent => sent.map_err(io)?,
    }
    let (mut line, received) = match receive(&stream) {
        Ok((first, _)) if first.is_empty() => return Err(ClientError::NoAnswer { socket: socket.to_owned() }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
            return Err(ClientError::NoAnswer { socket: socket.to_owned() });
        }
        Err(e) => return Err(io(e)),
        Ok(first) => first,
    };
    if !line.contains(&b'\n') {
        let mut reader = BufReader::new((&stream).take((MAX_ANSWER + 1).saturating_sub(line.len()) as u64));
        match reader.read_until(b'\n', &mut line) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(ClientError::NoAnswer { socket: socket.to_owned() });
            }
            Err(e) => return Err(io(e)),
            Ok(_) => {}
        }
    }
    let answer: Answer = protocol::parse_answer(line.strip_suffix(b"\n").unwrap_or(&line))
        .map_err(|source| ClientError::Protocol { socket: socket.to_owned(), source })?;
    match answer.error {
        Some(why) => Err(ClientError::Refused { why }),
        None => Ok((answer.data, received)),
    }
}

/// One `recvmsg` of `stream` into `buf`: the bytes read, and the descriptors sent with them
/// (a peer sends them with its first bytes; both sides of the protocol read them so), each
/// close-on-exec. Room is made for as many as one message can carry (the kernel's
/// `SCM_MAX_FD`): with less, the kernel drops what does not fit, and the reader is given none
/// of them (found from outside, with nix's reader: two leaked with each request that passed
/// three, until no container could start).
pub fn receive_with_fds(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(253))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    loop {
        let mut iov = [io::IoSliceMut::new(buf)];
        match recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
            Ok(msg) => {
                let mut fds = Vec::new();
                for message in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(passed) = message {
                        fds.extend(passed);
                    }
                }
                return Ok((msg.bytes, fds));
            }
        }
    }
}

/// The answer's first part and the first descriptor sent with it; any more are closed.
fn receive(stream: &UnixStream) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut first = vec![0u8; 64 << 10];
    let (len, fds) = receive_with_fds(stream, &mut first)?;
    first.truncate(len);
    Ok((first, fds.into_iter().next()))
}

/// Writes `bytes`, the first part with a copy of `pass` (one `sendmsg`), the rest as it goes:
/// how both sides of the protocol hand a descriptor over.
pub fn send(stream: &UnixStream, bytes: &[u8], pass: Option<BorrowedFd>) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let Some(fd) = pass else { return (&mut &*stream).write_all(bytes) };
    let fds = [fd.as_raw_fd()];
    let sent = loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => break other.map_err(io::Error::from)?,
        }
    };
    (&mut &*stream).write_all(&bytes[sent..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// Bug pinned (issue 31): a daemon too busy to read answers "busy" at once and closes; a
    /// client whose request was still being written got EPIPE and reported no answer, though
    /// the answer was there to read. A request larger than the socket's buffer makes the
    /// client still be writing when the daemon closes.
    #[test]
    fn an_answer_written_before_the_request_was_read_is_read() {
        let dir = tempfile::TempDir::new().unwrap();
        let socket = dir.path().join("node.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let busy = protocol::answer_line(&Answer::refused(protocol::BUSY));
            stream.write_all(busy.as_bytes()).unwrap();
        });
        let request = Request::Status { id: "x".repeat(900 * 1024) };
        let e = ask(&socket, &request, Duration::from_secs(60)).unwrap_err();
        daemon.join().unwrap();
        assert!(e.busy(), "{e}");
    }

    /// Bug (found from outside): a daemon that took the connection and never answered (it was
    /// stopped) made the client say "resource temporarily unavailable" after its wait; it says
    /// that the daemon did not answer, and in how long.
    #[test]
    fn a_daemon_that_does_not_answer_is_said_to_be_silent() {
        let dir = tempfile::TempDir::new().unwrap();
        let socket = dir.path().join("node.sock");
        // Listening, never accepting: the connection is taken by the kernel's backlog.
        let _listener = UnixListener::bind(&socket).unwrap();
        let e = ask(&socket, &Request::List, Duration::from_millis(100)).unwrap_err();
        assert!(matches!(e, ClientError::Timeout { .. }), "{e:?}");
        assert!(
            e.to_string().ends_with("node.sock: the node daemon did not answer within 0.1 s (stopped, or stuck?)"),
            "{e}"
        );
    }

    /// Bug (found from outside): an answer that is not the protocol's read "the node daemon
    /// not a node protocol message", a verb short; it names it as the daemon's answer.
    #[test]
    fn an_answer_that_is_not_the_protocol_is_named_so() {
        let dir = tempfile::TempDir::new().unwrap();
        let socket = dir.path().join("node.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let daemon = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream.write_all(b"garbage\n").unwrap();
        });
        let e = ask(&socket, &Request::List, Duration::from_secs(60)).unwrap_err();
        daemon.join().unwrap();
        let text = e.to_string();
        assert!(text.contains("node.sock: the node daemon's answer: not a node protocol message: "), "{text}");
    }
}
