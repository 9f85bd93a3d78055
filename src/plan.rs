//! From gathered inputs to the remap table and the `/dev` tree: the whole decision, pure.
//!
//! Order of construction, each step able to replace a device placed by an earlier one: runc's
//! default nodes; a directory for every spec mount under `/dev`; the spec's devices; the host's
//! pass-through NVIDIA nodes; every restored GPU under its native name; every saved GPU under
//! its checkpoint name, unless that name is another restored GPU's native name and natives are
//! preferred. Nothing else enters the tree.

use crate::device::{Access, DevKind, Rdev, RestoredGpu, gpu_name};
use crate::host::{DevDirScan, HostFacts};
use crate::metadata::{DeviceId, Metadata};
use crate::pairing::{self, MapPair, PairingError};
use crate::spec::SpecView;
use crate::tree::{Node, Tree, TreeBuilder, TreeError};
use serde_json::Value;
use std::collections::BTreeMap;
use thiserror::Error;

/// Which name wins when a checkpoint name is another restored GPU's native name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Prefer {
    /// The driver's view stays consistent: `nvidiaN` is host GPU N.
    #[default]
    Native,
    /// The restore's view: `nvidiaN` is what saved GPU N now is.
    Checkpoint,
}

/// Everything the plan is made from, already read.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    pub metadata: Option<Metadata>,
    pub spec: Option<SpecView>,
    /// The host device directory's GPU and pass-through nodes, when one was scanned.
    pub dev_dir: Option<DevDirScan>,
    pub host: HostFacts,
    pub device_map: Vec<MapPair>,
    pub prefer: Prefer,
}

/// One saved GPU and where its checkpoint name leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemapEntry {
    pub old: DeviceId,
    pub new: RestoredGpu,
    pub explicit: bool,
    /// False when the checkpoint name lost a collision and is not in the tree as this GPU.
    pub served: bool,
}

impl RemapEntry {
    /// The checkpoint name, `nvidia<saved minor>`.
    pub fn name(&self) -> String {
        gpu_name(self.old.minor)
    }
}

/// The result: what `plan` prints and what the daemon serves.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub remap: Vec<RemapEntry>,
    pub restored: Vec<RestoredGpu>,
    pub tree: Tree,
    pub warnings: Vec<String>,
    pub tpus: Vec<Value>,
}

/// Why no plan could be made from inputs that each parsed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PlanError {
    #[error(transparent)]
    Pairing(#[from] PairingError),
    #[error("spec device {0}")]
    SpecDevice(TreeError),
    #[error("spec mount {0}")]
    SpecMount(TreeError),
}

/// runc's default device nodes.
const DEFAULT_DEVICES: &[(&str, u32, u32)] =
    &[("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];
/// runc's default symlinks.
const DEFAULT_LINKS: &[(&str, &str)] = &[
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
];

/// The restored GPUs: the spec's 195:N devices and the device directory's `nvidiaN` nodes
/// (whose stat'd number wins), with what the driver says of them, sorted by minor.
pub fn restored_gpus(inputs: &Inputs) -> Vec<RestoredGpu> {
    let mut by_minor: BTreeMap<u32, (Rdev, Access)> = BTreeMap::new();
    for dev in inputs.spec.iter().flat_map(|s| &s.devices) {
        if let Some(minor) = dev.gpu_minor() {
            by_minor.insert(minor, (dev.rdev, dev.access));
        }
    }
    for (minor, node) in inputs.dev_dir.iter().flat_map(|d| &d.gpus) {
        by_minor.insert(*minor, (node.rdev, node.access));
    }
    by_minor
        .into_iter()
        .map(|(minor, (rdev, access))| {
            let info = inputs.host.gpu_info.iter().find(|i| i.minor == Some(minor));
            RestoredGpu {
                minor,
                rdev,
                access,
                uuid: info.and_then(|i| i.uuid.clone()),
                bus: info.and_then(|i| i.bus.clone()),
                pci: info.and_then(|i| i.pci),
            }
        })
        .collect()
}

/// Computes the remap table and the tree.
pub fn build(inputs: &Inputs) -> Result<Plan, PlanError> {
    let restored = restored_gpus(inputs);
    let saved = inputs.metadata.as_ref().map(|m| m.gpus.as_slice()).unwrap_or_default();
    let pairing = pairing::pair(saved, &restored, &inputs.device_map)?;
    let mut warnings = pairing.warnings;

    let mut b = TreeBuilder::default();
    for &(name, major, minor) in DEFAULT_DEVICES {
        b.insert(name, Node::device(DevKind::Char, Rdev::new(major, minor), Access::DEVICE_DEFAULT))
            .expect("defaults fit an empty tree");
    }
    for &(name, target) in DEFAULT_LINKS {
        b.insert(name, Node::symlink(target)).expect("defaults fit an empty tree");
    }
    if inputs.host.has_kcore {
        b.insert("core", Node::symlink("/proc/kcore")).expect("defaults fit an empty tree");
    }
    if let Some(spec) = &inputs.spec {
        for dir in &spec.dev_mounts {
            b.mkdir_all(dir).map_err(PlanError::SpecMount)?;
        }
        for dev in &spec.devices {
            match &dev.rel_path {
                Some(rel) => b.insert(rel, Node::device(dev.kind, dev.rdev, dev.access)).map_err(PlanError::SpecDevice)?,
                None => warnings.push(format!("spec device {} is outside /dev; not served", dev.path)),
            }
        }
    }
    for node in inputs.dev_dir.iter().flat_map(|d| &d.passthrough) {
        b.insert(&node.rel_path, Node::device(DevKind::Char, node.rdev, node.access))
            .map_err(PlanError::SpecDevice)?;
    }
    for gpu in &restored {
        b.insert(&gpu.name(), Node::device(DevKind::Char, gpu.rdev, gpu.access)).map_err(PlanError::SpecDevice)?;
    }

    let mut remap = Vec::with_capacity(pairing.pairs.len());
    for p in pairing.pairs {
        let name = gpu_name(p.old.minor);
        let node = Node::device(DevKind::Char, p.new.rdev, p.new.access);
        let holder = restored.iter().find(|g| g.minor == p.old.minor && g.minor != p.new.minor);
        let served = match (holder, inputs.prefer) {
            (Some(_), Prefer::Native) => {
                warnings.push(format!(
                    "{name}: checkpoint name of saved GPU {} (now {}) collides with host GPU {name}; \
                     serving the host GPU (--prefer checkpoint serves the saved one)",
                    p.old.minor,
                    p.new.name()
                ));
                false
            }
            (Some(_), Prefer::Checkpoint) => {
                warnings.push(format!(
                    "{name}: checkpoint name of saved GPU {} (now {}) collides with host GPU {name}; \
                     serving the saved one, so host GPU {name} has no name of its own",
                    p.old.minor,
                    p.new.name()
                ));
                true
            }
            (None, _) => true,
        };
        if served {
            b.insert(&name, node).map_err(PlanError::SpecDevice)?;
        }
        remap.push(RemapEntry { old: p.old, new: p.new, explicit: p.explicit, served });
    }

    let tpus = inputs.metadata.as_ref().map(|m| m.tpus.clone()).unwrap_or_default();
    Ok(Plan { remap, restored, tree: b.build(), warnings, tpus })
}
