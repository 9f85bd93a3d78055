//! The node daemon's pure part (`devremapd node`, issue 31): one daemon per host that every
//! container's `/dev` goes through. [`protocol`] is what a client (`devremap-runtime`,
//! `devremapd ctl`) and the daemon say to each other over its socket, each side checking the
//! other's version; [`registry`] is the daemon's table of containers, the decisions of which
//! (who is served, what an exit or a restart leaves to tear down) are made without I/O and
//! unit-tested without root; [`client`] asks the daemon. The socket, the processes and the
//! files are the binary's (`mountd/node/`).
//!
//! Assumptions: the socket is reachable by root alone (its directory is root's, mode 0700, and
//! the daemon checks each peer's credentials), so a request is the operator's, as a flag is;
//! still, a request names only its own container (an id of runc's kind, whose directory is
//! `<state_dir>/<id>/`), and every input it names is read by the container's daemon under the
//! limits every input has.

pub mod client;
pub mod protocol;
pub mod registry;
pub mod reload;
pub mod sweep;

/// The node daemon's log in its state dir where a wrapper started it (its stderr; under a
/// service manager, the journal): each daemon a wrapper starts appends to it, moved to
/// `node.log.1` at a start once over [`NODE_LOG_KEPT`], and the running daemon trims it to
/// that size as it trims its containers' logs (found from outside: a daemon reloaded 20,000
/// times grew it to 1.5 MB on `/run`, which is memory).
pub const NODE_LOG: &str = "node.log";

/// The size `node.log` is kept at, about.
pub const NODE_LOG_KEPT: u64 = 1 << 20;

/// The node daemon's own files in its state dir, beside its containers' directories.
pub const OWN_FILES: [&str; 5] = ["node.lock", "node.pid", "node.sock", NODE_LOG, "node.log.1"];

/// A container id that names one of the node daemon's [`OWN_FILES`]: its directory would take
/// that name (found from outside: a container `node.log.1` made it a directory, and `node.log`
/// could no longer be moved aside).
#[derive(Debug, thiserror::Error)]
#[error("container {0}: its id is the name of one of the node daemon's own files in its state dir ({files})", files = OWN_FILES.join(", "))]
pub struct OwnFileId(pub String);

/// Refuses container id `id` where it names one of the node daemon's [`OWN_FILES`].
pub fn check_not_own_file(id: &str) -> Result<(), OwnFileId> {
    if OWN_FILES.contains(&id) { Err(OwnFileId(id.to_owned())) } else { Ok(()) }
}
