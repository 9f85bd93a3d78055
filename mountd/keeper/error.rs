//! The keeper's one error type: every way `devremapd mount` fails, each with its error line
//! (`error: <message>`, exit status 1), naming the flag, file or mountpoint at fault.

use crate::cli::CliError;
use crate::mountpoint::MountpointError;
use crate::signals::SignalsError;
use devremap::io_message;
use devremap::report::Failure;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("--ready-fd {0}: not a file descriptor")]
    ReadyFdNegative(i32),
    #[error("--ready-fd {0}: not for stdin, stdout or stderr (give the write end of a pipe of its own)")]
    ReadyFdStandard(i32),
    /// Not open, or its flags cannot be read or set.
    #[error("--ready-fd {fd}: {}", io_message(source))]
    ReadyFdUnusable { fd: i32, source: io::Error },
    #[error("--ready-fd {0}: not a pipe (it is the write end of a pipe its starter reads)")]
    ReadyFdNotPipe(i32),
    #[error("--ready-fd {0}: the read end of a pipe (give its write end)")]
    ReadyFdReadEnd(i32),
    #[error(transparent)]
    Signals(#[from] SignalsError),
    /// A pid or state file flag refused.
    #[error(transparent)]
    Files(#[from] CliError),
    #[error(
        "devremapd mount needs root: only root can mount a FUSE filesystem whose device nodes open devices (the \
         `dev` mount option)"
    )]
    NotRoot,
    #[error(transparent)]
    Mountpoint(#[from] MountpointError),
    #[error("cannot open our own binary: {}", io_message(.0))]
    OpenOwnBinary(#[source] io::Error),
    #[error("cannot find our own binary: {}", io_message(.0))]
    FindOwnBinary(#[source] io::Error),
    #[error("cannot start its server ahead (parked): {}", io_message(.0))]
    ParkServer(#[source] io::Error),
    #[error("/dev/fuse: {}", io_message(.0))]
    DevFuse(#[source] io::Error),
    #[error("cannot start the {name} thread: {}", io_message(source))]
    Thread { name: &'static str, source: io::Error },
    /// `m` is the mountpoint as given.
    #[error("{m}: cannot mount: {}", io_message(source))]
    Mount { m: String, source: io::Error },
    #[error("{}: cannot write the pid file: {}", path.display(), io_message(source))]
    PidFile { path: PathBuf, source: io::Error },
    /// Aborted from outside, and a dead mount was left (detached).
    #[error("{0}: the FUSE connection was aborted; detached the dead mount")]
    AbortedDetached(String),
    #[error("{0}: the FUSE connection was aborted")]
    Aborted(String),
    /// The machine's verdict on the start ([`devremap::keeper::servers::Exit::StartFailed`]):
    /// the first server's error line, its exit or hang before it was ready, a protocol it does
    /// not share.
    #[error("{0}")]
    StartFailed(String),
}

impl From<KeeperError> for Failure {
    fn from(e: KeeperError) -> Failure {
        Failure::Message(e.to_string())
    }
}
