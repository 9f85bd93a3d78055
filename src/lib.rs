//! devremap: a synthetic `/dev` for containers whose GPUs were remapped by a checkpoint/restore.
//!
//! The folders follow the data. [`inputs`] reads the command line's files and the restore host
//! into values; [`family`] holds what each device family (NVIDIA, AMD) brings: its names, numbers,
//! host scan and driver files; [`decision`] is the pure core, from those values to the remap
//! table, the `/dev` tree and what is shown of them; [`served`] answers the kernel with a tree
//! and lives through reloads; [`keeper`] is the protocol of the process that holds `/dev/fuse`
//! across server crashes and upgrades; [`runtime`] is the OCI runtime wrapper's pure part.
//! [`device`] is the vocabulary every layer shares, [`fuse`] the FUSE wire both halves speak, [`atomic`] the one way files are written,
//! [`pidfd`] the one way a process is waited for without a pid race, [`report`] the one way a
//! `devremapd` command fails; [`install`] edits the configs an install on a node adds devremap to.
//! [`node`] is the node daemon's protocol and table, [`nri`] containerd's NRI plugin protocol and
//! the decision it serves with.
//! The library only logs through `log` macros; the binaries set a logger up.

#![forbid(unsafe_code)]

pub mod atomic;
pub mod decision;
pub mod device;
pub mod failpoint;
pub mod family;
pub mod fuse;
pub mod inputs;
pub mod install;
pub mod keeper;
pub mod node;
pub mod nri;
pub mod pidfd;
pub mod procfs;
pub mod report;
pub mod runtime;
pub mod served;

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
