//! The wrapper's one error type: every way a command can fail, each with the message it prints
//! (`devremap-runtime: error: <message>`, exit status 1).

use devremap::inputs::load::LoadError;
use devremap::io_message;
use devremap::runtime::container_daemon::DaemonError;
use nix::errno::Errno;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The runtime could not be started, or this process could not be replaced by it.
    #[error("cannot run {}: {}", runtime.display(), io_message(source))]
    CannotRun { runtime: PathBuf, source: io::Error },
    #[error("waiting for {}: {}", runtime.display(), io_message(source))]
    Waiting { runtime: PathBuf, source: io::Error },
    #[error("cannot handle signals: {0}")]
    Signals(io::Error),
    #[error("cannot make a pipe for the container's stdin: {}", .0.desc())]
    Pipe(Errno),
    #[error("cannot find our own executable: {}", io_message(.0))]
    OwnExe(io::Error),
    /// A file (the config, a spec, an image directory) or a path, then what is wrong with it.
    #[error("{at}: {what}")]
    At { at: String, what: String },
    #[error("{}: a path the wrapper cannot pass on", .0.display())]
    NotPassable(PathBuf),
    #[error(transparent)]
    BadId(#[from] devremap::runtime::argv::BadId),
    /// A container id that is not ours to set up, or a checkpoint of one the runtime lost.
    #[error("container {id}: {what}")]
    Container { id: String, what: String },
    #[error(transparent)]
    Daemon(#[from] DaemonError),
    /// The node daemon refused the container, or could not be asked (its words).
    #[error("{0}")]
    Node(String),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Write(#[from] devremap::atomic::WriteError),
    /// A checkpoint's record refused (a GPU it would record without its identity).
    #[error(transparent)]
    Record(#[from] devremap::decision::record::RecordError),
    /// A start that failed and was undone, with what could not be undone (each its own error).
    #[error("{why}{}", cleanup.iter().map(|e| format!("; and {e}")).collect::<String>())]
    Undone { why: Box<Failure>, cleanup: Vec<DaemonError> },
}

impl Failure {
    /// What is wrong with file or path `at` (anything that prints).
    pub fn at(at: impl std::fmt::Display, what: impl std::fmt::Display) -> Failure {
        Failure::At { at: at.to_string(), what: what.to_string() }
    }
}
