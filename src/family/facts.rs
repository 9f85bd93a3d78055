//! What the families' driver files under the host root say ([`HostFacts`]), filled in by each
//! family's `read_host_facts`.
//!
//! Pure data. Assumption: a field is its family's alone; `warnings` is every family's.

use super::amd::topology::Topology;
use super::nvidia::info::GpuInfo;

/// Facts about the host beyond its GPU nodes: what the families' driver files say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// What NVIDIA's driver says of each GPU.
    pub gpu_info: Vec<GpuInfo>,
    /// The GPU directories (bus ids) under `proc/driver/nvidia/gpus` whose information file
    /// could not be read: GPUs the host has but whose facts are unknown.
    pub unread: Vec<String>,
    /// What a user should hear about the driver's files (an oversized file skipped).
    pub warnings: Vec<String>,
    /// The host has `/proc/kcore`, so runc would add the `core` symlink.
    pub has_kcore: bool,
    /// The driver's version (`570.86.15`), from `proc/driver/nvidia/version`; `None` when the
    /// file is missing or gives none.
    pub driver_version: Option<String>,
    /// The KFD topology (AMD GPUs and CPUs); empty on a host without KFD.
    pub amd: Topology,
    /// Why the KFD topology could not be read, naming the file under the host root; `amd` is
    /// then empty though the host may have AMD GPUs.
    pub amd_unread: Option<String>,
}
