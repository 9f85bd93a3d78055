//! AMD GPUs: the KFD topology and the pairing CRIU's amdgpu plugin makes.
//!
//! Not yet a [`Family`](super::Family) in [`FAMILIES`](super::FAMILIES): discovery, record and
//! the tree are still to come (issue 22, phase B); these are the pure parts they stand on.
//!
//! A ROCm process holds `/dev/kfd` and one `/dev/dri/renderD<N>` per GPU. CRIU's amdgpu plugin
//! restores it onto GPUs it chooses itself from the restore host's KFD topology, and opens
//! `/dev/dri/renderD<minor of that GPU>` in the container; the process's own paths name the
//! checkpoint host's minors. [`topology`] parses the topology files (pure), [`read`] reads them
//! under a host root (the edge), [`plugin`] makes the plugin's choice (pure), and [`pairing`]
//! pairs saved with restored GPUs for the tree, with `--device-map` and warnings (pure).

pub mod pairing;
pub mod plugin;
pub mod read;
pub mod topology;
