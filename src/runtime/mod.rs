//! The pure part of `devremap-runtime`, the OCI runtime wrapper: what its `--help` and
//! `--version` add ([`about`]), its config file ([`config`]), the annotations a spec asks for
//! devremap with ([`annotations`]), runc's command line ([`argv`]), arguments that are not
//! UTF-8 ([`osarg`]), and the spec patch that points a container's `/dev` at a devremap mount
//! ([`oci_patch`], also `devremapd oci-patch`). The binary (`mountd/runtime/`) does the I/O: it
//! reads the files, starts and stops the daemon, and runs the real runtime.
pub mod about;
pub mod annotations;
pub mod argv;
pub mod config;
pub mod oci_patch;
pub mod osarg;
