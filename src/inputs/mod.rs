//! The input edge: reading what the command line names, safely and within bounds, into values
//! the decision takes. [`files`] opens input files (regular files only), [`limits`] holds the
//! bounds every input is held to, [`metadata`] parses the checkpoint's device list (each
//! family's items in its folder: `family::amd::metadata`), [`spec`]
//! reduces an OCI spec to what shapes `/dev`, [`host`] reads the restore host's device
//! directory and driver files (for every [`crate::family`]), [`pci`] parses PCI bus ids, and
//! [`load`] reads them all and builds the plan. The parsers are pure; `files`, `host` and `load`
//! do the I/O.

pub mod files;
pub mod host;
pub mod limits;
pub mod load;
pub mod metadata;
pub(crate) mod metadata_items;
pub mod pci;
pub mod spec;
