//! What NVIDIA's driver says of one GPU ([`GpuInfo`]), as its `read_host_facts` reads it from
//! the driver's information file and sysfs.
//!
//! Pure data, a leaf: the host facts of every family hold it.

/// What the driver says of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuInfo {
    pub minor: Option<u32>,
    /// A well-formed `GPU-` UUID; `None` when the driver gave none or a placeholder.
    pub uuid: Option<String>,
    /// The PCI bus location (`Bus Location`, else the directory's name).
    pub bus: Option<String>,
    pub pci: Option<(u32, u32)>,
    /// `GPU Excluded: Yes` (`Blacklisted: Yes` before driver 450): not usable, not enumerated.
    pub excluded: bool,
    /// The `Model:` line (`NVIDIA H100 80GB HBM3`); `None` when absent or no fact
    /// ([`fact_fault`]).
    pub model: Option<String>,
}
