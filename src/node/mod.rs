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
