//! A client of the node daemon: one request on a connection of its own, and the answer. The
//! one I/O edge of this folder (as `runtime::container_daemon` is of the wrapper's): used by
//! `devremap-runtime` and `devremapd ctl`.

use super::protocol::{self, Answer, MAX_ANSWER, ProtocolError, Request};
use crate::io_message;
use std::io::{self, BufRead, BufReader, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
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
    #[error("{}: the node daemon {source}", socket.display())]
    Protocol { socket: PathBuf, source: ProtocolError },
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
    let io = |source| ClientError::Io { socket: socket.to_owned(), source };
    let line = protocol::request_line(request).map_err(ClientError::Unsendable)?;
    let stream = UnixStream::connect(socket).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            ClientError::NoDaemon { socket: socket.to_owned(), source }
        }
        _ => io(source),
    })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    send(&stream, line.as_bytes(), pass).map_err(|source| match source.kind() {
        // Accepted by a daemon that was going away.
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
            ClientError::NoAnswer { socket: socket.to_owned() }
        }
        _ => io(source),
    })?;
    let mut line = Vec::new();
    let mut reader = BufReader::new(stream.take(MAX_ANSWER as u64 + 1));
    match reader.read_until(b'\n', &mut line) {
        Ok(0) => return Err(ClientError::NoAnswer { socket: socket.to_owned() }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
            return Err(ClientError::NoAnswer { socket: socket.to_owned() });
        }
        Err(e) => return Err(io(e)),
        Ok(_) => {}
    }
    let answer: Answer = protocol::parse_answer(line.strip_suffix(b"\n").unwrap_or(&line))
        .map_err(|source| ClientError::Protocol { socket: socket.to_owned(), source })?;
    match answer.error {
        Some(why) => Err(ClientError::Refused { why }),
        None => Ok(answer.data),
    }
}

/// Writes `bytes`, the first part with a copy of `pass` (one `sendmsg`), the rest as it goes.
fn send(stream: &UnixStream, bytes: &[u8], pass: Option<BorrowedFd>) -> io::Result<()> {
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
