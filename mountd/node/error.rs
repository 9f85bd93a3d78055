//! The node daemon's one error type: every way `devremapd node` fails to start, each naming
//! the flag, file or socket at fault (`error: <message>`, exit status 1).

use crate::keeper::KeeperError;
use crate::signals::SignalsError;
use devremap::io_message;
use devremap::report::Failure;
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    ReadyFd(#[from] KeeperError),
    #[error(transparent)]
    Signals(#[from] SignalsError),
    #[error("devremapd node needs root: it mounts every container's /dev")]
    NotRoot,
    #[error(transparent)]
    StateDir(#[from] devremap::runtime::container_daemon::DaemonError),
    #[error("{}: {}", path.display(), io_message(source))]
    Io { path: PathBuf, source: io::Error },
    #[error("state dir {}: another node daemon serves it (its node.lock is held)", state_dir.display())]
    Running { state_dir: PathBuf },
    #[error("{}: a node daemon answers there already", .0.display())]
    SocketAnswers(PathBuf),
    #[error("{}: is {what}, not a socket; refused (give --socket a path of its own)", path.display())]
    NotSocket { path: PathBuf, what: &'static str },
    /// `--pid-file` names the daemon's own lock or socket: writing it would replace that file.
    #[error("--pid-file {}: is the node daemon's {what}; give it a path of its own", path.display())]
    PidFileTaken { path: PathBuf, what: &'static str },
    #[error("cannot find our own binary (the path we were started from), which every container's keeper runs")]
    OwnBinary,
    #[error("cannot start a thread: {}", io_message(.0))]
    Thread(io::Error),
    /// The runtime config the NRI plugin reads (`--config`).
    #[error("--config {0}")]
    Config(String),
}

impl NodeError {
    pub fn at(path: &Path) -> impl FnOnce(io::Error) -> NodeError + '_ {
        move |source| NodeError::Io { path: path.to_owned(), source }
    }
}

impl From<NodeError> for Failure {
    fn from(e: NodeError) -> Failure {
        Failure::Message(e.to_string())
    }
}
