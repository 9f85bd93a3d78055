//! The plan's nodes that are no GPU's: runc's default nodes and symlinks, the spec's devices as
//! runc makes them, and the spec's mount points under `/dev` with the console; pure, the steps
//! of [`plan::build`](super::plan::build) before and after the GPUs.

use crate::decision::plan::PlanError;
use crate::decision::tree::{Node, NodeKind, TreeBuilder, TreeError};
use crate::device::{Access, DevKind, Rdev};
use crate::inputs::host::HostNode;
use crate::inputs::spec::SpecView;
use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

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

/// runc's default nodes and symlinks (`core` only where the host has `/proc/kcore`).
pub(super) fn defaults(b: &mut TreeBuilder, has_kcore: bool) {
    for &(name, major, minor) in DEFAULT_DEVICES {
        b.insert(name, Node::device(DevKind::Char, Rdev::new(major, minor), Access::DEVICE_DEFAULT))
            .expect("defaults fit an empty tree");
    }
    for &(name, target) in DEFAULT_LINKS {
        b.insert(name, Node::symlink(target)).expect("defaults fit an empty tree");
    }
    if has_kcore {
        b.insert("core", Node::symlink("/proc/kcore")).expect("defaults fit an empty tree");
    }
}

/// The host's pass-through nodes (NVIDIA's `nvidiactl` & co, AMD's `kfd`), each with the
/// device directory's number, which can be dynamic. A node the spec lists keeps the mode and
/// owner the spec gives it, which is what runc makes it with: the host node's may be wider
/// (`0666` for a spec's `0600`), and the tree gives no access that the spec, the defaults and
/// the remap do not. A node the spec does not list is served, with the host node's mode, only
/// where `unlisted` says its family's GPUs come from the device directory (hook mode, where the
/// NVIDIA hook copies the host's node; `--host-dev` alone): a spec that names its devices is
/// given those and no others, as runc gives them.
pub(super) fn passthrough(
    b: &mut TreeBuilder,
    nodes: &[HostNode],
    unlisted: impl Fn(&HostNode) -> bool,
) -> Result<(), TreeError> {
    for node in nodes {
        let access = match b.get(&node.rel_path) {
            Some(Node { kind: NodeKind::Device(DevKind::Char, _), access }) => *access,
            // The spec's block device or FIFO under the name is what runc makes: kept.
            Some(_) => continue,
            None if unlisted(node) => node.access,
            None => continue,
        };
        b.insert(&node.rel_path, Node::device(DevKind::Char, node.rdev, access))?;
    }
    Ok(())
}

/// The spec's devices, as runc makes them.
pub(super) fn spec_devices(b: &mut TreeBuilder, spec: &SpecView, warnings: &mut Vec<String>) -> Result<(), PlanError> {
    // runc keeps the first entry of a path: specconv's createDevices appends every
    // linux.devices entry in order, and rootfs_linux.go's createDeviceNode takes EEXIST from
    // mknod as success, so a later entry for the same path never replaces the node.
    // specconv drops a default device only for a spec device whose path is the default's
    // path as a string (`/dev/null`, not `/dev//null`); a default kept is made first, so an
    // entry spelled otherwise finds it there. And setupPtmx replaces whatever is at
    // /dev/ptmx with its symlink.
    let default_dropped = |name: &str| spec.devices.iter().any(|d| d.path.strip_prefix("/dev/") == Some(name));
    let mut first_of: BTreeMap<&str, &str> = BTreeMap::new();
    for dev in &spec.devices {
        let Some(rel) = &dev.rel_path else {
            warnings.push(format!("spec device {} is outside /dev; not served", dev.path));
            continue;
        };
        match first_of.entry(rel) {
            Entry::Occupied(first) => warnings.push(format!(
                "spec device {} is listed again as {}; serving the first entry, as runc does",
                first.get(),
                dev.path
            )),
            Entry::Vacant(_) if rel == "ptmx" => warnings.push(format!(
                "spec device {}: runc makes /dev/ptmx the symlink pts/ptmx whatever the spec lists; \
                 serving the symlink",
                dev.path
            )),
            Entry::Vacant(_) if DEFAULT_DEVICES.iter().any(|d| d.0 == rel) && !default_dropped(rel) => {
                warnings.push(format!(
                    "spec device {} is not written /dev/{rel}, so runc keeps its default /dev/{rel}; \
                     serving the default",
                    dev.path
                ))
            }
            Entry::Vacant(slot) => {
                slot.insert(&dev.path);
                b.insert(rel, Node::device(dev.kind, dev.rdev, dev.access)).map_err(PlanError::SpecDevice)?;
            }
        }
    }
    Ok(())
}

/// The spec's mount points under `/dev`, the warnings for what they hide, and the console.
/// Mount points come last: a file mount goes onto whatever non-directory is there (a GPU node a
/// restore bind-mounts over, say), any other mount onto a directory; only a missing one is made.
/// A directory whose first mount is a tmpfs has that tmpfs's mode: runc mounts a tmpfs on a
/// directory that exists and then chmods it to the directory's mode (rootfs_linux.go,
/// mountToRootfs), so a `0755` directory would leave `/dev/shm` unwritable to a non-root user
/// where runc's own `/dev`, which has no such directory, leaves the tmpfs's `1777` (issue 29.5).
/// A later mount on the same path finds the first one there, as it does in runc's own `/dev`.
pub(super) fn mounts(b: &mut TreeBuilder, spec: &SpecView, warnings: &mut Vec<String>) -> Result<(), PlanError> {
    let mut mounted = std::collections::BTreeSet::new();
    for m in &spec.dev_mounts {
        let first = mounted.insert(m.rel_path.as_str());
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
        if let (true, Some(mode)) = (first, m.tmpfs_mode) {
            b.chmod_dir(&m.rel_path, mode);
        }
    }
    // The runtime mounts onto the tree, so what a mount point holds is hidden in the
    // container, while runc's own /dev would make a spec device inside the mount: say so.
    for m in spec.dev_mounts.iter().filter(|m| !m.onto_file) {
        if let Some(hidden) = b.first_file_under(&m.rel_path) {
            warnings.push(format!(
                "/dev/{hidden} lies under the mount /dev/{}, which hides it in the container",
                m.rel_path
            ));
        }
    }
    // The console can be the node past the tree's limits: refused like any other.
    if spec.terminal && b.get("console").is_none() {
        b.insert("console", placeholder()).map_err(PlanError::SpecMount)?;
    }
    // A working directory under /dev, which runc makes (0755) before it changes into it: the
    // read-only tree must hold it (found from outside: `docker run -w /dev/work` failed,
    // `mkdir /dev/work: read-only file system`). One a node is in the way of, or past the
    // tree's limits, is left for the runtime to fail on, as it does on its own /dev.
    if let Some(cwd) = &spec.cwd
        && b.get(cwd).is_none()
    {
        let _ = b.mkdir_all(cwd);
    }
    Ok(())
}
