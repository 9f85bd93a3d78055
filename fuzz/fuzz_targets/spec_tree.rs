//! Fuzz target: the spec-to-tree path.
//!
//! The input is `SPEC [\0 EXTRA]`. SPEC goes to `spec::parse`; when it parses, EXTRA (JSON
//! never holds a raw NUL, so the split is unambiguous) is read as a little program that adds
//! saved GPUs (as the metadata reader would give them: sorted, unique minors <= 247, unique
//! UUIDs, a `model` and a `driver_version` where recorded, `earlier_minors` that name no other
//! GPU), the driver's facts (its version, each GPU's model), a host device directory scan (`nvidiaN` nodes and pass-through nodes, as the scanner
//! would give them), `--device-map` pairs, file mounts and `--prefer`. Then `plan::build` must
//! answer Ok or Err, never panic; on Ok, the tree must be a tree: every node's parent is a
//! directory, no path has an empty, `.` or `..` component, every path, name and device number
//! is within `limits` (and the tree within its budget), and every served checkpoint name is
//! the restored GPU's device.
#![no_main]

use devremap::decision::pairing::{DeviceRef, MapPair, Rule};
use devremap::decision::plan::{self, Inputs, Prefer};
use devremap::decision::tree::{NodeKind, Tree};
use devremap::device::{Access, DevKind, Rdev};
use devremap::family::facts::HostFacts;
use devremap::family::nvidia::metadata::DeviceId;
use devremap::family::nvidia::{GpuInfo, MAX_REGULAR_MINOR};
use devremap::family::table::Saved;
use devremap::inputs::host::{DevDirScan, HostNode};
use devremap::inputs::limits;
use devremap::inputs::metadata::{Format, Metadata, RecordedAccess};
use devremap::inputs::spec;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

const PASSTHROUGH: &[&str] = &["nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools"];
/// Facts as a driver writes them: the `model` and `driver` checks compare them.
const MODELS: &[&str] = &["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"];
const VERSIONS: &[&str] = &["535.129.03", "570.86.15"];

fn minor(b: u8) -> u32 {
    u32::from(b) % (MAX_REGULAR_MINOR + 1)
}

/// A well-formed GPU UUID numbered `n`.
fn uuid(n: u8) -> String {
    format!("GPU-5b2c6f7e-0d1a-4c3e-9f10-{n:012}")
}

fn reference(tag: u8, b: u8) -> DeviceRef {
    if tag & 1 == 0 { DeviceRef::Minor(u32::from(b)) } else { DeviceRef::Uuid(uuid(b % 16)) }
}

/// What EXTRA's program adds up, kept as the readers would give it.
#[derive(Default)]
struct Extra {
    saved: BTreeMap<u32, DeviceId>,
    gpus: BTreeMap<u32, HostNode>,
    passthrough: BTreeMap<String, HostNode>,
    device_map: Vec<MapPair>,
    /// The host's driver version, and the model the driver gives GPU minors 0..8.
    driver_version: Option<String>,
    models: [Option<String>; 8],
}

impl Extra {
    /// Whether `minor` names a saved GPU already: its minor or one of its earlier names.
    fn names(&self, minor: u32) -> bool {
        self.saved.values().any(|d| d.minor == minor || d.earlier_minors.contains(&minor))
    }

    /// A saved GPU, with a model and a driver version as `devremapd record` writes them.
    fn save(&mut self, tag: u8, a: u8, b: u8) {
        let m = minor(a);
        let uuid = if b & 0x80 != 0 { String::new() } else { uuid(b % 16) };
        // The metadata reader refuses a UUID twice, and a name of two GPUs.
        let replaced = self.saved.remove(&m);
        if (!uuid.is_empty() && self.saved.values().any(|d| d.uuid == uuid)) || self.names(m) {
            self.saved.extend(replaced.map(|d| (m, d)));
            return;
        }
        let device = DeviceId {
            minor: m,
            pci_vendor_id: 0x10de,
            pci_device_id: if tag & 0x40 != 0 { u32::from(b) } else { 0x20b0 },
            gpu_id: 0,
            device_instance: m,
            subdevice_instance: u32::from(tag >> 7),
            uuid,
            recorded: RecordedAccess { mode: (b & 0x40 != 0).then_some(u32::from(b) & 0o777), ..Default::default() },
            model: (tag & 0x20 != 0).then(|| MODELS[usize::from(b & 1)].to_owned()),
            driver_version: (tag & 0x10 != 0).then(|| VERSIONS[usize::from(b >> 1 & 1)].to_owned()),
            earlier_minors: Vec::new(),
        };
        self.saved.insert(m, device);
    }

    /// An earlier name (`earlier_minors`) for the `a`th saved GPU: a minor that names no GPU.
    fn earlier(&mut self, a: u8, b: u8) {
        let m = minor(b);
        if self.saved.is_empty() || self.names(m) {
            return;
        }
        let i = usize::from(a) % self.saved.len();
        if let Some(d) = self.saved.values_mut().nth(i) {
            d.earlier_minors.push(m);
            d.earlier_minors.sort_unstable();
        }
    }

    fn host_gpu(&mut self, tag: u8, a: u8, b: u8) {
        let m = minor(a);
        let rdev = if tag & 0x80 != 0 { Rdev::new(u32::from(b), m) } else { Rdev::new(195, m) };
        let access = Access { mode: u32::from(b) << 1 & 0o7777, uid: u32::from(tag >> 5), gid: 0 };
        self.gpus.insert(m, HostNode { rel_path: format!("nvidia{m}"), rdev, access });
    }

    fn host_passthrough(&mut self, tag: u8, a: u8, b: u8) {
        let rel = match a % 6 {
            i @ 0..4 => PASSTHROUGH[usize::from(i)].to_owned(),
            4 => format!("nvidia-caps/nvidia-cap{b}"),
            _ => format!("nvidia-caps/nvidia-cap{}", char::from(b'a' + b % 26)),
        };
        let node = HostNode {
            rel_path: rel.clone(),
            rdev: Rdev::new(u32::from(tag), u32::from(b)),
            access: Access::DEVICE_DEFAULT,
        };
        self.passthrough.insert(rel, node);
    }

    /// What the host's driver files say: its version, and GPU `b % 8`'s model (none: unknown).
    fn host_facts(&mut self, a: u8, b: u8) {
        self.driver_version = (a & 0x80 == 0).then(|| VERSIONS[usize::from(a & 1)].to_owned());
        self.models[usize::from(b % 8)] = (b & 0x80 == 0).then(|| MODELS[usize::from(a >> 1 & 1)].to_owned());
    }
}

/// Builds the inputs beside the spec from EXTRA.
fn extra_inputs(view: spec::SpecView, extra: &[u8]) -> Inputs {
    let mut view = view;
    let Some((&flags, ops)) = extra.split_first() else {
        return Inputs { spec: Some(view), ..Default::default() };
    };
    let mut x = Extra::default();
    for op in ops.chunks_exact(3) {
        let (tag, a, b) = (op[0], op[1], op[2]);
        match tag % 7 {
            0 => x.save(tag, a, b),
            1 => x.host_gpu(tag, a, b),
            2 => x.host_passthrough(tag, a, b),
            3 => x.device_map.push(MapPair { old: reference(tag >> 1, a), new: reference(tag >> 2, b) }),
            4 => {
                // A bind mount whose source is not a directory (the parser asks the loader).
                if let Some(m) = view.dev_mounts.get_mut(usize::from(a)) {
                    m.onto_file = b & 1 != 0;
                }
            }
            5 => x.earlier(a, b),
            _ => x.host_facts(a, b),
        }
    }
    let metadata = (flags & 1 != 0).then(|| Metadata {
        format: Format::Array,
        saved: Saved { gpus: x.saved.into_values().collect(), amd: Vec::new() },
        gpu_key_present: true,
        tpus: Vec::new(),
        warnings: Vec::new(),
    });
    let dev_dir = (flags & 2 != 0).then(|| DevDirScan {
        gpus: x.gpus.into_iter().collect(),
        amd: Vec::new(),
        passthrough: x.passthrough.into_values().collect(),
        warnings: Vec::new(),
    });
    // The driver's information files name some GPUs by minor.
    let gpu_info = (0..u32::from(flags >> 5))
        .map(|m| GpuInfo {
            minor: Some(m),
            uuid: Some(uuid(m as u8)),
            // Bus order is not minor order, as on real hosts.
            bus: Some(format!("0000:{:02x}:00.0", 0xff - m)),
            pci: Some((0x10de, 0x20b0)),
            excluded: false,
            model: x.models[m as usize].clone(),
        })
        .collect();
    let host =
        HostFacts { gpu_info, has_kcore: flags & 4 != 0, driver_version: x.driver_version, ..HostFacts::default() };
    Inputs {
        metadata,
        spec: Some(view),
        dev_dir,
        host,
        device_map: x.device_map,
        prefer: if flags & 8 != 0 { Prefer::Checkpoint } else { Prefer::Native },
        pairing: if flags & 16 != 0 { Rule::Positional } else { Rule::IdentityFirst },
        relax: Default::default(),
        kfd: Default::default(),
    }
}

fn check_tree(tree: &Tree) {
    assert_eq!(tree.get("").map(|n| &n.kind), Some(&NodeKind::Dir), "the root is not a directory");
    assert!(tree.len() <= limits::MAX_NODES, "{} nodes", tree.len());
    assert!(tree.iter().map(|(p, _)| p.len()).sum::<usize>() <= limits::MAX_TREE_PATH_BYTES);
    for (path, node) in tree.iter() {
        assert!(path.split('/').all(|c| !c.is_empty() && c != "." && c != ".."), "bad path component in {path:?}");
        assert_eq!(limits::check_dev_path(path), Ok(()), "a path the kernel cannot take");
        if let Some(rdev) = node.rdev() {
            assert_eq!(limits::check_rdev(rdev), Ok(()), "{path}: a device number FUSE cannot carry");
        }
        let (parent, _) = Tree::split(path);
        if !parent.is_empty() {
            match tree.get(parent) {
                Some(n) if n.kind == NodeKind::Dir => {}
                other => panic!("{path:?}: parent {parent:?} is {other:?}, not a directory"),
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (spec_bytes, extra) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(view) = spec::parse(spec_bytes, &|_| false) else { return };

    // The spec alone, as `plan --spec` sees it.
    let alone = Inputs { spec: Some(view.clone()), ..Default::default() };
    if let Ok(plan) = plan::build(&alone) {
        check_tree(&plan.tree);
    }

    if extra.is_empty() {
        return;
    }
    let inputs = extra_inputs(view, extra);
    if let Ok(plan) = plan::build(&inputs) {
        check_tree(&plan.tree);
        for e in plan.parts.nvidia.remap.iter().filter(|e| e.served) {
            let node = plan.tree.get(&e.name());
            assert_eq!(
                node.map(|n| &n.kind),
                Some(&NodeKind::Device(DevKind::Char, e.new.rdev)),
                "served checkpoint name {} is not the restored GPU's device",
                e.name()
            );
        }
    }
});
