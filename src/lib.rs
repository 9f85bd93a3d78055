//! devremap: a synthetic `/dev` for containers whose GPUs were remapped by a checkpoint/restore.
//!
//! The core is pure: [`metadata`] parses the checkpoint's device list, [`spec`] reads what an
//! OCI spec puts in `/dev`, [`visible`] reads its `NVIDIA_VISIBLE_DEVICES`, [`pairing`] pairs
//! saved with restored GPUs, [`plan`] builds the remap table and the [`tree`]. I/O sits at the
//! edges: [`host`] looks at the restore host's devices, [`load`] reads the input files.
//! [`lifecycle`] is the daemon's life (serving, reloading, stopping) as a state machine behind
//! small traits. The library only logs through `log` macros; the `devremapd` binary sets a
//! logger up.

pub mod adapter;
pub mod amd;
pub mod atomic;
pub mod checks;
pub mod cuda_map;
pub mod device;
pub mod escape;
pub mod files;
pub mod fuse_wire;
pub mod handover;
pub mod held;
pub mod host;
pub mod keeper;
pub mod lifecycle;
pub mod limits;
pub mod load;
pub mod metadata;
pub mod oci_patch;
pub mod pairing;
pub mod plan;
pub mod record;
pub mod relay;
pub mod render;
pub mod runtime;
pub mod served;
pub mod spec;
pub mod tree;
pub mod visible;

/// An I/O error as a lower-case message without the `(os error N)` suffix.
pub fn io_message(e: &std::io::Error) -> String {
    let text = match e.raw_os_error() {
        Some(code) => {
            let full = std::io::Error::from_raw_os_error(code).to_string();
            full.split(" (os error").next().unwrap_or(&full).to_owned()
        }
        None => e.to_string(),
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => text,
    }
}
