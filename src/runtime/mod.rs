//! The pure part of `devremap-runtime`, the OCI runtime wrapper: what its `--help` and
//! `--version` add ([`about`]), its config file ([`config`]), the annotations a spec asks for
//! devremap with ([`annotations`]), runc's command line ([`argv`]), arguments that are not
//! UTF-8 ([`osarg`]), and the spec patch that points a container's `/dev` at a devremap mount
//! ([`oci_patch`], also `devremapd oci-patch`). [`container_daemon`] is the one edge here that
//! does I/O: a container's state directory and its daemon's start and stop, for any front end
//! (the wrapper is one). The binary (`mountd/runtime/`) does the rest of the I/O: it reads the
//! files and runs the real runtime.
pub mod about;
pub mod annotations;
pub mod argv;
pub mod config;
pub mod container_daemon;
pub mod oci_patch;
pub mod osarg;
