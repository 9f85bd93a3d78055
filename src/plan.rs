//! From gathered inputs to the remap table and the `/dev` tree: the whole decision, pure.
//!
//! Order of construction, each step able to replace a device placed by an earlier one: runc's
//! default nodes; the spec's devices; the host's pass-through NVIDIA nodes; every restored GPU
//! under its native name; every saved GPU under its checkpoint name, unless that name is
//! another restored GPU's native name and natives are preferred; last, the mount points of the
//! spec's mounts under `/dev` (a directory, or for a file bind mount whatever node is there or
//! a placeholder) and, for a terminal, the `console` placeholder. Nothing else enters the tree.

use crate::device::{Access, DevKind, Rdev, RestoredGpu, gpu_name};
use crate::host::{DevDirScan, HostFacts};
use crate::metadata::{DeviceId, Metadata};
use crate::pairing::{self, MapPair, PairingError};
use crate::spec::SpecView;
use crate::tree::{Node, NodeKind, Tree, TreeBuilder, TreeError};
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

/// What a file mount point (a file bind mount, the console a terminal gets) is before the
/// runtime mounts over it: a non-directory is needed and the tree has no regular files, so it
/// is `/dev/null`'s device, which opens harmlessly and which every device cgroup allows.
fn placeholder() -> Node {
    Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)
}

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
        for dev in &spec.devices {
            match &dev.rel_path {
                Some(rel) => {
                    b.insert(rel, Node::device(dev.kind, dev.rdev, dev.access)).map_err(PlanError::SpecDevice)?
                }
                None => warnings.push(format!("spec device {} is outside /dev; not served", dev.path)),
            }
        }
    }
    for node in inputs.dev_dir.iter().flat_map(|d| &d.passthrough) {
        b.insert(&node.rel_path, Node::device(DevKind::Char, node.rdev, node.access)).map_err(PlanError::SpecDevice)?;
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
                     serving the host GPU (prefer checkpoint to serve the saved one)",
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

    // Mount points last: a file mount goes onto whatever non-directory is there (a GPU node a
    // restore bind-mounts over, say), any other mount onto a directory; only a missing one is
    // made.
    if let Some(spec) = &inputs.spec {
        for m in &spec.dev_mounts {
            match b.get(&m.rel_path) {
                Some(_) if !m.onto_file => b.mkdir_all(&m.rel_path),
                Some(n) if n.kind == NodeKind::Dir => {
                    Err(TreeError::NodeOverDir { path: m.rel_path.clone(), new: "file mount" })
                }
                Some(_) => Ok(()),
                None if m.onto_file => b.insert(&m.rel_path, placeholder()),
                None => b.mkdir_all(&m.rel_path),
            }
            .map_err(PlanError::SpecMount)?;
        }
        if spec.terminal && b.get("console").is_none() {
            b.insert("console", placeholder()).expect("the root takes a console");
        }
    }

    let tpus = inputs.metadata.as_ref().map(|m| m.tpus.clone()).unwrap_or_default();
    Ok(Plan { remap, restored, tree: b.build(), warnings, tpus })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::HostNode;
    use crate::metadata::Format;
    use crate::spec::{DevMount, SpecDevice};

    fn saved(minor: u32) -> DeviceId {
        DeviceId {
            minor,
            pci_vendor_id: 4318,
            pci_device_id: 8896,
            gpu_id: 0,
            device_instance: 0,
            subdevice_instance: 0,
            uuid: format!("GPU-{minor}"),
        }
    }

    /// Inputs with saved GPUs `old` and a host dev dir whose `nvidiaN` for N in `new` opens 1:N+3.
    fn inputs(old: &[u32], new: &[u32]) -> Inputs {
        let gpus = new
            .iter()
            .map(|&n| {
                (n, HostNode { rel_path: gpu_name(n), rdev: Rdev::new(1, n + 3), access: Access::DEVICE_DEFAULT })
            })
            .collect();
        Inputs {
            metadata: Some(Metadata {
                format: Format::Array,
                gpus: old.iter().copied().map(saved).collect(),
                gpu_key_present: true,
                tpus: vec![],
            }),
            dev_dir: Some(DevDirScan { gpus, passthrough: vec![] }),
            ..Inputs::default()
        }
    }

    fn rdev_at(plan: &Plan, name: &str) -> Option<Rdev> {
        plan.tree.get(name).and_then(Node::rdev)
    }

    /// runc's /dev: with no inputs the tree is exactly the defaults.
    #[test]
    fn no_inputs_is_runcs_default_dev() {
        let plan = build(&Inputs::default()).unwrap();
        let names: Vec<&str> = plan.tree.iter().map(|(p, _)| p).collect();
        assert_eq!(
            names,
            ["fd", "full", "null", "ptmx", "random", "stderr", "stdin", "stdout", "tty", "urandom", "zero"]
        );
        assert_eq!(rdev_at(&plan, "tty"), Some(Rdev::new(5, 0)));
        assert!(plan.remap.is_empty() && plan.warnings.is_empty());
        let with_core =
            build(&Inputs { host: HostFacts { has_kcore: true, ..Default::default() }, ..Default::default() }).unwrap();
        assert_eq!(with_core.tree.get("core").unwrap().kind, NodeKind::Symlink("/proc/kcore".into()));
    }

    /// Both kinds of names: native names are the host GPUs, checkpoint names their pairs.
    #[test]
    fn native_and_checkpoint_names() {
        let plan = build(&inputs(&[0, 1], &[4, 5])).unwrap();
        assert_eq!(rdev_at(&plan, "nvidia4"), Some(Rdev::new(1, 7)));
        assert_eq!(rdev_at(&plan, "nvidia5"), Some(Rdev::new(1, 8)));
        assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 7)));
        assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 8)));
        assert!(plan.remap.iter().all(|e| e.served));
        assert!(plan.warnings.is_empty());
    }

    /// Collision: saved {0,1} onto {1,2}; nvidia1 is host GPU 1 by default, the saved GPU 1's
    /// device (host 2) with --prefer checkpoint; a warning either way.
    #[test]
    fn collision_native_wins_by_default() {
        let plan = build(&inputs(&[0, 1], &[1, 2])).unwrap();
        assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 4)));
        assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 4)));
        assert_eq!(plan.remap.iter().map(|e| e.served).collect::<Vec<_>>(), [true, false]);
        assert_eq!(plan.warnings.len(), 1);
        assert!(plan.warnings[0].starts_with("nvidia1: checkpoint name"), "{:?}", plan.warnings);

        let mut inp = inputs(&[0, 1], &[1, 2]);
        inp.prefer = Prefer::Checkpoint;
        let plan = build(&inp).unwrap();
        assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 5)));
        assert_eq!(rdev_at(&plan, "nvidia2"), Some(Rdev::new(1, 5)));
        assert!(plan.remap.iter().all(|e| e.served));
        assert_eq!(plan.warnings.len(), 1);
    }

    /// A restore onto the same GPUs serves each name as itself, with no warning.
    #[test]
    fn identity_restore() {
        let plan = build(&inputs(&[0, 1], &[0, 1])).unwrap();
        assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 3)));
        assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 4)));
        assert!(plan.warnings.is_empty() && plan.remap.iter().all(|e| e.served));
    }

    /// The metadata key absent (cuda-checkpoint released the devices): host GPUs still served.
    #[test]
    fn absent_key_still_serves_native_names() {
        let plan = build(&inputs(&[], &[3])).unwrap();
        assert!(plan.remap.is_empty());
        assert_eq!(rdev_at(&plan, "nvidia3"), Some(Rdev::new(1, 6)));
        assert_eq!(plan.tree.iter().filter(|(p, _)| p.starts_with("nvidia")).count(), 1);
    }

    /// Spec: mounts become directories; devices keep their path and access; spec GPUs are
    /// restored GPUs; a device outside /dev is reported; a device over a mount point is refused.
    #[test]
    fn spec_shapes_the_tree() {
        let dev = |path: &str, rdev: Rdev| SpecDevice {
            rel_path: path.strip_prefix("/dev/").map(str::to_owned),
            path: path.into(),
            kind: DevKind::Char,
            rdev,
            access: Access { mode: 0o600, uid: 1, gid: 2 },
        };
        let spec = SpecView {
            devices: vec![
                dev("/dev/dri/card0", Rdev::new(226, 0)),
                dev("/dev/nvidia7", Rdev::new(195, 7)),
                dev("/opt/x", Rdev::new(1, 3)),
            ],
            dev_mounts: ["pts", "shm"].map(|p| DevMount { rel_path: p.into(), ..DevMount::default() }).to_vec(),
            ..SpecView::default()
        };
        let plan = build(&Inputs { spec: Some(spec.clone()), ..Inputs::default() }).unwrap();
        assert_eq!(plan.tree.get("pts").unwrap().kind, NodeKind::Dir);
        assert_eq!(plan.tree.get("dri").unwrap().kind, NodeKind::Dir);
        assert_eq!(plan.tree.get("dri/card0").unwrap().access, Access { mode: 0o600, uid: 1, gid: 2 });
        assert_eq!(plan.restored.iter().map(|g| g.minor).collect::<Vec<_>>(), [7]);
        assert_eq!(plan.warnings, ["spec device /opt/x is outside /dev; not served"]);

        let mut clash = spec;
        clash.devices.push(dev("/dev/pts", Rdev::new(1, 3)));
        assert!(matches!(
            build(&Inputs { spec: Some(clash), ..Inputs::default() }),
            Err(PlanError::SpecMount(TreeError::DirOverNode { .. }))
        ));
    }

    /// Mount points: a mount onto an existing node (a restore's bind mount over a GPU) keeps
    /// the node; a file bind mount and a terminal's console get a non-directory placeholder.
    #[test]
    fn mount_points_onto_nodes_files_and_console() {
        let mut inp = inputs(&[], &[0]);
        let mount =
            |p: &str, file: bool| DevMount { rel_path: p.into(), bind_source: Some("/x".into()), onto_file: file };
        inp.spec = Some(SpecView {
            dev_mounts: vec![mount("nvidia0", true), mount("termination-log", true), mount("data/sub", false)],
            terminal: true,
            ..SpecView::default()
        });
        let plan = build(&inp).unwrap();
        assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 3)), "the GPU node stays as the mount point");
        assert_eq!(rdev_at(&plan, "termination-log"), Some(Rdev::new(1, 3)));
        assert_eq!(rdev_at(&plan, "console"), Some(Rdev::new(1, 3)));
        assert_eq!(plan.tree.get("data/sub").unwrap().kind, NodeKind::Dir);
        let no_tty = build(&Inputs { spec: Some(SpecView::default()), ..Inputs::default() }).unwrap();
        assert!(no_tty.tree.get("console").is_none());
    }

    /// Nothing enters the tree that no input asked for: every node is a default, a spec node,
    /// a pass-through node, or a GPU name.
    #[test]
    fn tree_holds_only_what_inputs_ask_for() {
        let mut inp = inputs(&[0, 1, 2], &[5, 6, 7, 9]);
        inp.dev_dir.as_mut().unwrap().passthrough.push(HostNode {
            rel_path: "nvidiactl".into(),
            rdev: Rdev::new(195, 255),
            access: Access::DEVICE_DEFAULT,
        });
        let plan = build(&inp).unwrap();
        let gpus: Vec<&str> = plan.tree.iter().map(|(p, _)| p).filter(|p| p.starts_with("nvidia")).collect();
        assert_eq!(gpus, ["nvidia0", "nvidia1", "nvidia2", "nvidia5", "nvidia6", "nvidia7", "nvidia9", "nvidiactl"]);
        assert_eq!(plan.tree.iter().count(), 11 + gpus.len());
    }
}
