//! The pure part of `devremap-runtime`, the OCI runtime wrapper: what its `--help` and
//! `--version` add ([`about`]), its config file ([`config`]), the annotations a spec asks for
//! devremap with ([`annotations`]), runc's command line ([`argv`]), and the bundle's spec as it
//! was before the patch ([`saved_spec`]). The binary (`mountd/runtime/`) does the I/O: it reads
//! the files, starts and stops the daemon, and runs the real runtime.
pub mod about;
pub mod annotations;
pub mod argv;
pub mod config;
pub mod saved_spec;
