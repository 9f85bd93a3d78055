//! The machine's edges: the events the daemon's main loop feeds it, how serving ends, and the
//! two traits through which it acts on the world ([`Notifier`], [`Session`]), with what they
//! are given.

use crate::inputs::load::{LoadError, Loaded};
use crate::keeper::control::Notice;
use std::io;
use std::path::PathBuf;

/// What the daemon's main loop feeds the machine.
#[derive(Debug)]
pub enum Event {
    /// Reload the inputs (`SIGHUP`).
    Reload,
    /// Stop serving; the text names the cause for the log (`the keeper stops the mount`).
    Stop(String),
    /// A reload's inputs, loaded (or refused) by its worker.
    Loaded(u64, Box<Result<Loaded, LoadError>>),
    /// A retired node was let go: the published count is stale.
    Retired,
    /// The FUSE session ended: someone unmounted it, or aborted the connection.
    Ended(io::Result<()>),
    /// Something outside the machine failed (an upgrade the keeper refused): the served tree
    /// stays, and the text is recorded as the last error.
    Refused(String),
    /// The keeper rests this server (nothing was asked of it for a while) and sends it nothing
    /// more: the state says that no server runs, and serving ends (the state file stays).
    Rest,
}

/// Whom a server took over from ([`super::Lifecycle::resumed`]): `from`, its log line's words
/// (`from server pid 12 (it died), 3 requests resent`); the reloads finished since the mount;
/// whether the server before rested.
#[derive(Debug, Clone, Copy)]
pub struct Taken<'a> {
    pub from: &'a str,
    pub reloads: u64,
    pub woken: bool,
}

/// Why serving ended.
#[derive(Debug)]
pub enum End {
    /// A stop was asked for: the caller unmounts.
    Stop,
    /// The session ended under us, with its result.
    Ended(io::Result<()>),
}

/// The kernel's side of the mount: drop cached entries and listings.
pub trait Notifier {
    /// Forgets each entry `(parent, name)`, then what is cached of each node id in `inodes` (a
    /// directory's listing), and returns once the kernel has. Returns the names the kernel
    /// refused for a reason other than "nothing was cached there", with the error. All at once,
    /// so that an implementation can send them together (the server's go through the keeper).
    fn invalidate(&self, entries: &[(u64, String)], inodes: &[u64]) -> Vec<(String, io::Error)>;
}

/// Why the daemon's state could not be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{}: cannot write the state file: {}", path.display(), crate::io_message(source))]
    StateFile { path: PathBuf, source: io::Error },
}

/// The daemon around the FUSE session: everything a transition does outside the machine.
pub trait Session {
    /// Starts loading the inputs on a worker, whose result comes back as `Event::Loaded(id, ..)`.
    fn load(&mut self, id: u64) -> io::Result<()>;
    /// Worker `id`'s result has come back (to be applied, or dropped as abandoned): the worker
    /// has ended or is ending, and what it holds can go.
    fn load_ended(&mut self, id: u64);
    /// Publishes the daemon's state (the state file); the error is one line for the log.
    fn publish(&mut self, status: &Status<'_>) -> Result<(), PublishError>;
    /// Tells the service manager.
    fn notify(&mut self, notice: Notice);
}

/// What [`Session::publish`] publishes.
#[derive(Debug)]
pub struct Status<'a> {
    pub loaded: &'a Loaded,
    pub generation: u64,
    pub last_error: Option<&'a str>,
    /// Reloads this server has finished (applied, refused or abandoned): a reload whose error
    /// is the one before still shows as done.
    pub reloads: u64,
    pub retired_nodes: usize,
    /// This server is ending for a rest: no server runs from now on.
    pub resting: bool,
}
