//! Fixtures of the plan's tests, the shared plan's and each family's: saved and restored
//! GPUs, specs, host facts.

use crate::decision::plan::{Inputs, Plan};
use crate::decision::tree::Node;
use crate::device::DevKind;
use crate::device::{Access, Rdev};
use crate::family::facts::HostFacts;
use crate::family::nvidia::GpuInfo;
use crate::family::nvidia::metadata::DeviceId;
use crate::family::nvidia::visible::Visible;
use crate::family::table::NVIDIA;
use crate::family::table::Saved;
use crate::inputs::host::DevDirScan;
use crate::inputs::host::HostNode;
use crate::inputs::metadata::Format;
use crate::inputs::metadata::Metadata;
use crate::inputs::spec::SpecDevice;
use crate::inputs::spec::SpecView;

pub(crate) fn saved(minor: u32) -> DeviceId {
    DeviceId {
        minor,
        pci_vendor_id: 4318,
        pci_device_id: 8896,
        gpu_id: 0,
        device_instance: 0,
        subdevice_instance: 0,
        uuid: format!("GPU-{minor}"),
        ..Default::default()
    }
}

/// Inputs with saved GPUs `old` and a host dev dir whose `nvidiaN` for N in `new` opens 1:N+3.
pub(crate) fn inputs(old: &[u32], new: &[u32]) -> Inputs {
    let gpus = new
        .iter()
        .map(|&n| {
            (n, HostNode { rel_path: NVIDIA.gpu_name(n), rdev: Rdev::new(1, n + 3), access: Access::DEVICE_DEFAULT })
        })
        .collect();
    Inputs {
        metadata: Some(Metadata {
            format: Format::Array,
            saved: Saved { gpus: old.iter().copied().map(saved).collect(), amd: vec![] },
            gpu_key_present: true,
            tpus: vec![],
            warnings: vec![],
        }),
        dev_dir: Some(DevDirScan { gpus, amd: vec![], passthrough: vec![], warnings: vec![] }),
        ..Inputs::default()
    }
}

/// A spec char device at `path` (under `/dev/` when it starts so).
pub(crate) fn spec_dev(path: &str, rdev: Rdev, access: Access) -> SpecDevice {
    SpecDevice {
        rel_path: path.strip_prefix("/dev/").map(str::to_owned),
        path: path.into(),
        kind: DevKind::Char,
        rdev,
        access,
    }
}

pub(crate) fn rdev_at(plan: &Plan, name: &str) -> Option<Rdev> {
    plan.tree.get(name).and_then(Node::rdev)
}

/// The NVIDIA and AMD nodes of `plan`'s tree, by path.
pub(crate) fn gpu_family_nodes(plan: &Plan) -> Vec<&str> {
    let ours = |p: &&str| p.starts_with("nvidia") || p.starts_with("dri") || *p == "kfd";
    plan.tree.iter().map(|(p, _)| p).filter(ours).collect()
}

/// A host device directory with NVIDIA GPUs 0 and 1, the control nodes, a MIG capability,
/// `kfd` and an AMD render node, all at the host's `0666`.
pub(crate) fn full_dev_dir() -> Inputs {
    let mut inp = inputs(&[], &[0, 1]);
    inp.metadata = None;
    inp.host = described(&[(0, "0000:3c:00.0"), (1, "0000:3d:00.0")], (0x10de, 0x2330));
    let dir = inp.dev_dir.as_mut().unwrap();
    let host = Access::DEVICE_DEFAULT;
    for (name, rdev) in [
        ("nvidiactl", Rdev::new(195, 255)),
        ("nvidia-modeset", Rdev::new(195, 254)),
        ("nvidia-uvm", Rdev::new(507, 0)),
        ("nvidia-caps/nvidia-cap1", Rdev::new(508, 1)),
        ("kfd", Rdev::new(235, 0)),
    ] {
        dir.passthrough.push(HostNode { rel_path: name.into(), rdev, access: host });
    }
    dir.amd.push((128, HostNode { rel_path: "dri/renderD128".into(), rdev: Rdev::new(226, 128), access: host }));
    inp
}

/// Host facts for GPUs `minors`, each on a bus in the given order, with PCI ids `pci`.
pub(crate) fn described(buses_by_minor: &[(u32, &str)], pci: (u32, u32)) -> HostFacts {
    let gpu_info = buses_by_minor
        .iter()
        .map(|&(minor, bus)| GpuInfo {
            minor: Some(minor),
            uuid: Some(format!("GPU-0b5e55ed-1111-4222-8333-{minor:012}")),
            bus: Some(bus.to_owned()),
            pci: Some(pci),
            excluded: false,
            model: None,
        })
        .collect();
    HostFacts { gpu_info, ..HostFacts::default() }
}

pub(crate) fn hook(visible: Visible) -> Option<SpecView> {
    Some(SpecView { hook: Some(visible), ..SpecView::default() })
}

pub(crate) fn native_gpus(plan: &Plan) -> Vec<u32> {
    plan.parts.nvidia.restored.iter().map(|g| g.minor).collect()
}
