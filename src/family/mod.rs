//! Device families: what one kind of GPU (one driver) brings to a container's `/dev`, behind
//! the [`Family`] trait, and the table of families, [`FAMILIES`].
//!
//! A family says which names of the host's device directory are its GPUs and which of its
//! nodes pass through unchanged (NVIDIA: `nvidiaN`, and `nvidiactl`, `nvidia-uvm`,
//! `nvidia-caps/...`), what its driver's files under the host root say of each GPU, and how
//! its GPUs are named and recognised in a spec. [`scan_dev_dir`] and [`read_host_facts`] ask
//! every family in the table, through one open descriptor of the device directory and one host
//! root. [`NVIDIA`] and [`AMD`] are the families.
//!
//! A family is one folder: besides the trait, its step of the plan (its restored GPUs, pairing,
//! side of the checks and names in the tree, behind [`crate::decision::seam::Step`]) and its
//! part of a plan as shown and recorded ([`crate::decision::seam::Shown`]). This module is the
//! wiring: [`decide`] runs every family's step, and [`Parts`] holds every family's part of a
//! plan, in the table's order; `decision::plan` runs them and names no family.
//!
//! Assumption: the families' names do not overlap (no name in a device directory is two
//! families' node), so the order of the table changes nothing but the order of the scan.

pub mod amd;
pub mod nvidia;

use crate::decision::seam::{Inputs, PlanError, Shown, Step};
use crate::inputs::metadata_items::{GPU_KEY, MetadataError, describe, recorded_access};
use serde_json::Value;
use crate::device::{DevKind, Rdev};
use crate::inputs::host::{DevDir, DevDirScan, HostError};
use crate::inputs::limits;
use std::path::Path;

/// One device family's rules. Every method is pure but the two that read the host, which read
/// only through what they are given (an open [`DevDir`], files under the host root).
pub trait Family: Sync {
    /// Adds this family's GPU and pass-through nodes in the device directory to `scan`.
    /// A name that is this family's but wrong (a GPU name with no valid number, a non-char
    /// node under a GPU name) is an error naming it.
    fn scan_dev_dir(&self, dir: &mut DevDir, scan: &mut DevDirScan) -> Result<(), HostError>;
    /// Adds what this family's driver files under `root` say to `facts`. Best effort: what is
    /// missing or unreadable is left out, an oversized file with a warning.
    fn read_host_facts(&self, root: &Path, facts: &mut HostFacts);
    /// The `/dev`-relative name of this family's GPU `minor` (`nvidia3`).
    fn gpu_name(&self, minor: u32) -> String;
    /// The GPU minor a spec's device entry grants, if it is one of this family's GPUs.
    fn gpu_minor_of_device(&self, kind: DevKind, rdev: Rdev) -> Option<u32>;
    /// Whether the family's runtime hook, where a spec asks for it, gives the container this
    /// pass-through node (`rel_path` under `/dev`) though the spec does not list it.
    fn hook_gives(&self, rel_path: &str) -> bool;
}

/// The NVIDIA family.
pub static NVIDIA: &dyn Family = &nvidia::Nvidia;
/// The AMD family.
pub static AMD: &dyn Family = &amd::Amd;

/// Every family, in the order they are asked.
pub static FAMILIES: &[&dyn Family] = &[NVIDIA, AMD];

/// Every family's saved GPUs, as the checkpoint's device list gives them. Serialized with the
/// metadata as its own keys: NVIDIA's `gpus`, AMD's `amd`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    /// NVIDIA's items (those without a `kind`), sorted by minor.
    pub gpus: Vec<nvidia::metadata::DeviceId>,
    /// AMD's items (`"kind": "amdgpu"`), in the list's order.
    #[serde(default)]
    pub amd: Vec<amd::metadata::AmdSaved>,
}

/// Reads the checkpoint's device list: each item by the family whose `kind` it has (NVIDIA's
/// items have none), then each family's list as a whole (a name given twice is refused).
pub fn read_items(items: &[Value]) -> Result<Saved, MetadataError> {
    let (mut gpus, mut amd) = (Vec::new(), Vec::new());
    for (index, item) in items.iter().enumerate() {
        let Value::Object(obj) = item else {
            return Err(MetadataError::Shape {
                key: GPU_KEY,
                what: format!("item {index}: expected an object, found {}", describe(item)),
            });
        };
        match obj.get("kind") {
            None => gpus.push(nvidia::metadata::item(index, obj)?),
            Some(Value::String(k)) if k == amd::metadata::KIND => {
                amd.push(amd::metadata::item(index, obj, recorded_access(index, obj)?)?);
            }
            Some(other) => return Err(MetadataError::Kind { index, found: describe(other) }),
        }
    }
    Ok(Saved { gpus: nvidia::metadata::list(gpus)?, amd: amd::metadata::list(amd)? })
}

/// Every family's part of a plan, in the table's order. Serialized (the state file's plan, a
/// plan handed to the next server) as the plan's own keys: NVIDIA's `remap` and `restored`,
/// AMD's `amd`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Parts {
    #[serde(flatten)]
    pub nvidia: nvidia::plan::NvidiaPlan,
    /// The AMD render nodes and where the checkpoint's lead.
    #[serde(default)]
    pub amd: amd::plan::AmdPlan,
}

impl Parts {
    /// Every family's part, to be shown.
    pub fn shown(&self) -> [&dyn Shown; 2] {
        [&self.nvidia, &self.amd]
    }
}

/// Every family's step, decided: the families' parts before any node is placed.
pub struct Decided {
    nvidia: nvidia::plan::Decided,
    amd: amd::plan::Decided,
}

impl Decided {
    /// Every family's step, in the table's order.
    pub fn steps(&mut self) -> [&mut dyn Step; 2] {
        [&mut self.nvidia, &mut self.amd]
    }

    /// The families' parts of the plan, once placed.
    pub fn parts(self) -> Parts {
        Parts { nvidia: self.nvidia.plan, amd: self.amd.plan }
    }
}

/// Runs every family's step on `inputs`, in the table's order: the first family's error is the
/// plan's.
pub fn decide(inputs: &Inputs) -> Result<Decided, PlanError> {
    Ok(Decided { nvidia: nvidia::plan::decide(inputs)?, amd: amd::plan::step(inputs)? })
}

/// Facts about the host beyond its GPU nodes: what the families' driver files say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// What NVIDIA's driver says of each GPU.
    pub gpu_info: Vec<nvidia::GpuInfo>,
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
    pub amd: amd::topology::Topology,
    /// Why the KFD topology could not be read, naming the file under the host root; `amd` is
    /// then empty though the host may have AMD GPUs.
    pub amd_unread: Option<String>,
}

/// Lists every family's GPU and pass-through nodes of `dir`.
///
/// The directory is opened once (following `dir` itself if it is a symlink: the caller named
/// it), and its entries are listed and `lstat`ed through that one descriptor, as are the
/// directories under it a family reads (opened without following a symlink). A directory
/// swapped while it is scanned (a symlink flipped to another) cannot mix into the scan: it is
/// all of the directory opened.
pub fn scan_dev_dir(dir: &Path) -> Result<DevDirScan, HostError> {
    let mut top = DevDir::open(dir)?;
    let mut scan = DevDirScan::default();
    for family in FAMILIES {
        family.scan_dev_dir(&mut top, &mut scan)?;
    }
    if scan.gpus.len() + scan.amd.len() + scan.passthrough.len() > limits::MAX_NODES {
        return Err(HostError::TooMany(dir.to_owned()));
    }
    scan.gpus.sort_by_key(|(minor, _)| *minor);
    scan.amd.sort_by_key(|(minor, _)| *minor);
    scan.passthrough.sort_by(|a, b| a.rel_path.cmp(&b.rel_path));
    Ok(scan)
}

/// Reads what every family's driver files under `root` say, and whether `root` has
/// `proc/kcore`.
pub fn read_host_facts(root: &Path) -> HostFacts {
    let mut facts = HostFacts { has_kcore: root.join("proc/kcore").exists(), ..HostFacts::default() };
    for family in FAMILIES {
        family.read_host_facts(root, &mut facts);
    }
    facts
}
