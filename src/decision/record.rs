//! The save side: the GPUs a container has, written as the device list `--metadata` reads, so
//! that a checkpoint made with any runtime says which GPUs it had (gVisor writes the same list
//! into its state file).
//!
//! Pure: [`devices`] takes a plan built without metadata and returns the list. The GPUs are
//! the plan's restored GPUs, so whatever chooses them there (the spec's `linux.devices`, or in
//! hook mode the device directory and `NVIDIA_VISIBLE_DEVICES`) chooses what is recorded, and a
//! `plan --metadata` of the list on the same host pairs each GPU with itself. Each item also
//! holds the `mode`, `uid` and `gid` of the node served under the GPU's name, which a restore
//! gives the checkpoint name back (CRIU compares a reopened file's mode with the saved one).
//! The plan's AMD render nodes follow, as `"kind": "amdgpu"` items (see
//! [`amd_metadata`](crate::inputs::amd_metadata)).
//!
//! `gpu_id` and `device_instance` are informational (pairing never reads them): `gpu_id` is
//! the PCI location encoded as the driver's gpu ids are, `domain << 16 | bus << 8 | device`
//! (0x300 for `0000:03:00.0`); `device_instance` is the GPU's position in PCI bus order among
//! the recorded GPUs. Both are 0 where the driver's files give no bus.
//!
//! [`check`] refuses a record that would lose an AMD GPU's identity to a KFD topology that could
//! not be read; what the host's files merely lack is said ([`gaps`]), not refused.

use crate::decision::amd::AmdRestored;
use crate::decision::plan::{EarlierName, Plan};
use crate::family::amd::topology::kernfs_order;
use crate::family::nvidia::RestoredGpu;
use crate::inputs::amd_metadata::{self, AmdSaved};
use crate::inputs::metadata::RecordedAccess;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use thiserror::Error;

/// Why a record is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecordError {
    /// The host's KFD topology could not be read, so a restored AMD GPU's identity is unknown.
    /// Refused rather than recorded without it: a record is written once, at checkpoint, and one
    /// without the identity pairs by position on restore, which is found out only then.
    #[error(
        "{why}; so GPU {gpu} cannot be recorded with its KFD identity (a restore would pair it by position): \
         the record is refused"
    )]
    UnreadTopology { why: String, gpu: String },
}

/// Refuses a plan whose restored AMD GPUs the host's KFD topology could not identify because
/// it could not be read. A topology read whole that lacks a GPU is a gap ([`gaps`]), not this:
/// that host's driver does not describe the GPU, and no reading will.
pub fn check(plan: &Plan) -> Result<(), RecordError> {
    match (&plan.amd.unread, plan.amd.restored.iter().find(|g| g.gpu.is_none())) {
        (Some(why), Some(g)) => Err(RecordError::UnreadTopology { why: why.clone(), gpu: g.name() }),
        _ => Ok(()),
    }
}

/// The recorded device list: one object per restored GPU, sorted by minor. With `carried`
/// (the plan was built with the metadata the container was restored with, `record --metadata
/// PREV`), each item's `earlier_minors` lists the other names that lead to it in the container:
/// the served checkpoint names of the saved GPUs paired with it, and their own earlier names.
/// Without, the key is left out, which says that no earlier names were looked for.
pub fn devices(plan: &Plan, carried: bool) -> Value {
    let mut by_bus: Vec<(u32, u32)> = plan.restored.iter().filter_map(|g| Some((gpu_id(g)?, g.minor))).collect();
    by_bus.sort_unstable();
    let items = plan
        .restored
        .iter()
        .map(|g| {
            let (vendor, device) = g.pci.unwrap_or((0, 0));
            // The node served under the native name: the spec's fileMode/uid/gid, or the host's.
            let access = plan.tree.get(&g.name()).map_or(g.access, |n| n.access);
            let mut item = json!({
                "minor": g.minor,
                "pci_vendor_id": vendor,
                "pci_device_id": device,
                "gpu_id": gpu_id(g).unwrap_or(0),
                "device_instance": by_bus.iter().position(|&(_, m)| m == g.minor).unwrap_or(0),
                "subdevice_instance": 0,
                "uuid": g.uuid.clone().unwrap_or_default(),
                "mode": access.mode,
                "uid": access.uid,
                "gid": access.gid,
            });
            // Only what the host tells: a record from a host without driver files stays as
            // it was, and reads as "unknown" for the checks.
            let Some(o) = item.as_object_mut() else { return item };
            for (key, fact) in [("model", &g.model), ("driver_version", &plan.driver_version)] {
                if let Some(fact) = fact {
                    o.insert(key.into(), fact.as_str().into());
                }
            }
            if carried {
                let names = plan.remap.iter().map(|e| (e.new.minor, e.served.then_some(e.old.minor), &e.earlier[..]));
                o.insert("earlier_minors".into(), earlier_minors(names, g.minor).into());
            }
            item
        })
        .chain(amd_items(plan, carried))
        .collect();
    Value::Array(items)
}

/// One `"kind": "amdgpu"` item per restored render node, in the order CRIU's amdgpu plugin
/// lists the GPUs (the topology's node order; those the topology lacks last, by minor), with
/// the plugin's identity of it, the mode, uid and gid of the node served under its name, and,
/// when `carried`, its earlier render names as NVIDIA's items have theirs.
fn amd_items(plan: &Plan, carried: bool) -> impl Iterator<Item = Value> + '_ {
    let mut gpus: Vec<&AmdRestored> = plan.amd.restored.iter().collect();
    gpus.sort_by_cached_key(|g| (g.gpu.is_none(), g.gpu.as_ref().map(|k| kernfs_order(&k.node.to_string()))));
    gpus.into_iter().map(move |g| {
        let access = plan.tree.get(&g.name()).map_or(g.access, |n| n.access);
        let recorded = RecordedAccess { mode: Some(access.mode), uid: Some(access.uid), gid: Some(access.gid) };
        let names = plan.amd.remap.iter().map(|e| (e.new_minor, e.served.then_some(e.old_minor), &e.earlier[..]));
        let earlier_minors = earlier_minors(names, g.minor);
        amd_metadata::to_json(&AmdSaved { minor: g.minor, gpu: g.gpu.clone(), recorded, earlier_minors }, carried)
    })
}

/// The names other than its own that lead to restored GPU `minor` in the plan's tree, of
/// either family: of each remap entry `(its restored minor, its checkpoint minor where served,
/// its earlier names)`, the served names of those paired with `minor`.
fn earlier_minors<'a>(entries: impl Iterator<Item = (u32, Option<u32>, &'a [EarlierName])>, minor: u32) -> Vec<u32> {
    let names: BTreeSet<u32> = entries
        .filter(|&(new, _, _)| new == minor)
        .flat_map(|(_, own, earlier)| own.into_iter().chain(earlier.iter().filter(|n| n.served).map(|n| n.minor)))
        .filter(|&m| m != minor)
        .collect();
    names.into_iter().collect()
}

/// The warning `plan` gives for a KFD topology that could not be read, naming the file: a record
/// that [`check`] lets through (it has no AMD GPU to lose) still says it.
pub fn unread_warning(plan: &Plan) -> Option<String> {
    plan.amd.unread.as_deref().map(crate::family::amd::facts_unknown)
}

/// One line per recorded GPU the host's driver files did not describe whole, naming the GPU
/// and what it is recorded without. Such a record still pairs by minor, but
/// `cuda-device-map` refuses a GPU without a uuid. A GPU without a bus location had no driver
/// information file at all (a read file always gives one: its directory's name).
pub fn gaps(plan: &Plan) -> Vec<String> {
    plan.restored
        .iter()
        .filter_map(|g| {
            let missing: Vec<&str> = [
                (g.uuid.is_none(), "uuid"),
                (g.bus.is_none(), "bus location (gpu_id 0)"),
                (g.pci.is_none(), "PCI vendor and device ids"),
            ]
            .into_iter()
            .filter_map(|(gone, what)| gone.then_some(what))
            .collect();
            if missing.is_empty() {
                return None;
            }
            let why = if g.bus.is_none() {
                format!("no driver information file names minor {}", g.minor)
            } else {
                "the driver's files do not give them".to_owned()
            };
            // What the record then cannot do: a recorded uuid serves cuda-device-map.
            let cost = if g.uuid.is_none() {
                "the record pairs by minor, but cuda-device-map needs the uuid"
            } else {
                "the record pairs by minor and uuid, without comparing models"
            };
            Some(format!("GPU {} recorded without {}: {why}; {cost}", g.name(), missing.join(", ")))
        })
        .chain(plan.amd.restored.iter().filter(|g| g.gpu.is_none() && plan.amd.unread.is_none()).map(|g| {
            format!(
                "GPU {} recorded without its KFD identity: the host root's KFD topology has no GPU with \
                 drm_render_minor {}; a restore pairs it by position",
                g.name(),
                g.minor
            )
        }))
        .collect()
}

/// `domain << 16 | bus << 8 | device` of a bus location `DDDD:BB:DD.F`, if it parses.
fn gpu_id(gpu: &RestoredGpu) -> Option<u32> {
    let bus = gpu.bus.as_deref()?;
    let (domain, rest) = bus.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, _function) = rest.split_once('.')?;
    let hex = |s: &str, max: u32| u32::from_str_radix(s, 16).ok().filter(|&n| n <= max);
    Some((hex(domain, 0xffff)? << 16) | (hex(bus, 0xff)? << 8) | hex(device, 0x1f)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::plan::{self, Inputs};
    use crate::device::{Access, Rdev};
    use crate::family::HostFacts;
    use crate::family::nvidia::GpuInfo;
    use crate::inputs::host::{DevDirScan, HostNode};
    use crate::inputs::metadata;

    fn uuid(minor: u32) -> String {
        format!("GPU-00000000-0000-0000-0000-{minor:012}")
    }

    /// A host with GPUs `minors`, each 1:N+3 with `access`; the driver describes each, the bus
    /// order being the reverse of the minor order.
    fn host(minors: &[u32], access: Access) -> Inputs {
        let gpus = minors
            .iter()
            .map(|&n| (n, HostNode { rel_path: format!("nvidia{n}"), rdev: Rdev::new(1, n + 3), access }))
            .collect();
        let gpu_info = minors
            .iter()
            .map(|&n| GpuInfo {
                minor: Some(n),
                uuid: Some(uuid(n)),
                bus: Some(format!("0001:{:02x}:02.0", 0x40 - n)),
                pci: Some((0x10de, 0x2330)),
                model: Some("NVIDIA H100 80GB HBM3".into()),
                ..GpuInfo::default()
            })
            .collect();
        Inputs {
            dev_dir: Some(DevDirScan { gpus, amd: vec![], passthrough: vec![], warnings: vec![] }),
            host: HostFacts { gpu_info, driver_version: Some("535.129.03".into()), ..HostFacts::default() },
            ..Inputs::default()
        }
    }

    /// Rule (issue 12.1): every field of a recorded GPU, the node's mode and owner included.
    #[test]
    fn records_every_field() {
        let plan = plan::build(&host(&[2, 5], Access { mode: 0o660, uid: 0, gid: 44 })).unwrap();
        let list = devices(&plan, false);
        assert_eq!(
            list[0],
            json!({"minor": 2, "pci_vendor_id": 0x10de, "pci_device_id": 0x2330, "gpu_id": 0x1_3e02,
                   "device_instance": 1, "subdevice_instance": 0, "uuid": uuid(2),
                   "mode": 0o660, "uid": 0, "gid": 44,
                   "model": "NVIDIA H100 80GB HBM3", "driver_version": "535.129.03"})
        );
        assert_eq!((list[1]["minor"].as_u64(), list[1]["device_instance"].as_u64()), (Some(5), Some(0)));
    }

    /// Rule (issue 12.1): what is recorded, read back as metadata and planned on the same host,
    /// is the identity remap, and every checkpoint name keeps its node's access.
    #[test]
    fn round_trip_is_the_identity() {
        let access = Access { mode: 0o640, uid: 3, gid: 4 };
        let inputs = host(&[0, 3, 7], access);
        let list = devices(&plan::build(&inputs).unwrap(), false);
        let meta = metadata::parse(list.to_string().as_bytes()).unwrap();
        let plan = plan::build(&Inputs { metadata: Some(meta), ..inputs }).unwrap();
        let pairs: Vec<(u32, u32)> = plan.remap.iter().map(|e| (e.old.minor, e.new.minor)).collect();
        assert_eq!(pairs, [(0, 0), (3, 3), (7, 7)]);
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
        assert!(plan.remap.iter().all(|e| Some(&e.old.uuid) == e.new.uuid.as_ref()));
        assert!(plan.remap.iter().all(|e| e.old.model == e.new.model && e.old.driver_version == plan.driver_version));
        assert!(plan.tree.iter().filter(|(p, _)| p.starts_with("nvidia")).all(|(_, n)| n.access == access));
    }

    /// Rule (issue 20): three hosts. Checkpointed on A (GPUs 0, 1), restored on B (GPUs 2, 3),
    /// checkpointed again on B with the metadata it was restored with, restored on C (GPUs 6,
    /// 7): every name the process may hold, A's checkpoint names and B's native names, leads on C
    /// to the GPU it was paired with. Without the earlier metadata, A's names are lost on C, and
    /// the record says so by leaving `earlier_minors` out.
    #[test]
    fn three_host_migration_keeps_every_name() {
        let access = Access::DEVICE_DEFAULT;
        let restore = |host: Inputs, list: &Value| {
            let meta = metadata::parse(list.to_string().as_bytes()).unwrap();
            plan::build(&Inputs { metadata: Some(meta), ..host }).unwrap()
        };
        let on_a = devices(&plan::build(&host(&[0, 1], access)).unwrap(), false);
        assert!(on_a[0].get("earlier_minors").is_none());
        let on_b = restore(host(&[2, 3], access), &on_a);
        let on_b = devices(&on_b, true);
        assert_eq!((&on_b[0]["minor"], &on_b[0]["earlier_minors"]), (&json!(2), &json!([0])));
        assert_eq!((&on_b[1]["minor"], &on_b[1]["earlier_minors"]), (&json!(3), &json!([1])));
        let on_c = restore(host(&[6, 7], access), &on_b);
        let rdev = |name: &str| match on_c.tree.get(name).map(|n| &n.kind) {
            Some(crate::decision::tree::NodeKind::Device(_, rdev)) => Some(*rdev),
            _ => None,
        };
        let (c6, c7) = (Some(Rdev::new(1, 9)), Some(Rdev::new(1, 10)));
        assert_eq!([rdev("nvidia0"), rdev("nvidia2"), rdev("nvidia6")], [c6; 3]);
        assert_eq!([rdev("nvidia1"), rdev("nvidia3"), rdev("nvidia7")], [c7; 3]);
        // Recorded on B without the earlier metadata: only B's names reach C.
        let forgot = devices(&plan::build(&host(&[2, 3], access)).unwrap(), false);
        let on_c = restore(host(&[6, 7], access), &forgot);
        assert!(on_c.tree.get("nvidia0").is_none() && on_c.tree.get("nvidia2").is_some());
    }

    /// Rule (issue 20): an earlier name that is a restored GPU's native name loses the
    /// collision as a checkpoint name does (native preferred), and is then not carried again:
    /// in the container it meant the host's GPU.
    #[test]
    fn an_earlier_name_that_collides_is_not_served_nor_carried() {
        let access = Access::DEVICE_DEFAULT;
        let list = json!([{"minor": 2, "earlier_minors": [0]}, {"minor": 3, "earlier_minors": [6]}]);
        let meta = metadata::parse(list.to_string().as_bytes()).unwrap();
        let plan = plan::build(&Inputs { metadata: Some(meta), ..host(&[6, 7], access) }).unwrap();
        let earlier: Vec<Vec<(u32, bool)>> =
            plan.remap.iter().map(|e| e.earlier.iter().map(|n| (n.minor, n.served)).collect()).collect();
        assert_eq!(earlier, [vec![(0, true)], vec![(6, false)]]);
        assert!(
            plan.warnings.iter().any(|w| w.starts_with("nvidia6: earlier name of saved GPU 3 (now nvidia7) collides"))
        );
        let again = devices(&plan, true);
        assert_eq!((&again[0]["earlier_minors"], &again[1]["earlier_minors"]), (&json!([0, 2]), &json!([3])));
    }

    /// Rule (issue 22, as issue 20 for NVIDIA): an AMD GPU's earlier render names lead to its
    /// pair as its checkpoint name does; one that is another restored GPU's name loses the
    /// collision (native preferred), is said, and is not carried into the next record, which
    /// carries the served checkpoint name and earlier names instead. Without `carried` the key
    /// is left out.
    #[test]
    fn amd_earlier_names_are_served_and_carried_as_nvidias() {
        let node = |m: u32| {
            (
                m,
                HostNode {
                    rel_path: format!("dri/renderD{m}"),
                    rdev: Rdev::new(1, m - 120),
                    access: Access::DEVICE_DEFAULT,
                },
            )
        };
        let saved = json!([{"kind": "amdgpu", "minor": 136, "earlier_minors": [152, 144]}]);
        let inputs = Inputs {
            metadata: Some(metadata::parse(saved.to_string().as_bytes()).unwrap()),
            dev_dir: Some(DevDirScan {
                gpus: vec![],
                amd: vec![node(128), node(144)],
                passthrough: vec![],
                warnings: vec![],
            }),
            ..Inputs::default()
        };
        let plan = plan::build(&inputs).unwrap();
        let earlier: Vec<(u32, bool)> = plan.amd.remap[0].earlier.iter().map(|n| (n.minor, n.served)).collect();
        assert_eq!((plan.amd.remap[0].new_minor, earlier), (128, vec![(144, false), (152, true)]));
        let rdev = |name: &str| plan.tree.get(name).and_then(|n| n.rdev());
        assert_eq!(
            [rdev("dri/renderD136"), rdev("dri/renderD152"), rdev("dri/renderD144")],
            [Some(Rdev::new(1, 8)), Some(Rdev::new(1, 8)), Some(Rdev::new(1, 24))]
        );
        assert!(
            plan.warnings.iter().any(|w| w.starts_with("/dev/dri/renderD144: earlier name of saved renderD136 (now renderD128) is a restored GPU's name; serving the restored GPU")),
            "{:?}",
            plan.warnings
        );
        let again = devices(&plan, true);
        assert_eq!((&again[0]["minor"], &again[0]["earlier_minors"]), (&json!(128), &json!([136, 152])));
        assert_eq!((&again[1]["minor"], &again[1]["earlier_minors"]), (&json!(144), &json!([])));
        assert!(devices(&plan, false)[0].get("earlier_minors").is_none());
    }

    /// No GPUs: an empty list, which reads back as "no saved GPUs".
    #[test]
    fn no_gpus_is_an_empty_list() {
        let list = devices(&plan::build(&Inputs::default()).unwrap(), false);
        assert_eq!(list, json!([]));
        assert!(metadata::parse(list.to_string().as_bytes()).unwrap().gpus.is_empty());
    }

    /// Rule (issue 12.1): a GPU the driver's files describe whole is no gap; one they do not
    /// describe at all, or only in part, is one line naming the GPU and what is missing.
    #[test]
    fn gaps_name_the_gpu_and_what_is_missing() {
        let mut inputs = host(&[2, 5, 7], Access::DEVICE_DEFAULT);
        inputs.host.gpu_info.retain(|i| i.minor != Some(5));
        inputs.host.gpu_info.iter_mut().find(|i| i.minor == Some(7)).unwrap().uuid = None;
        let gaps = gaps(&plan::build(&inputs).unwrap());
        assert_eq!(gaps.len(), 2, "{gaps:?}");
        assert!(gaps[0].starts_with("GPU nvidia5 recorded without uuid, bus location (gpu_id 0), PCI vendor and device ids: no driver information file names minor 5;"), "{}", gaps[0]);
        assert!(gaps[1].starts_with("GPU nvidia7 recorded without uuid: the driver's files"), "{}", gaps[1]);
    }

    /// Bug (attack F5): a restored AMD GPU whose identity is unknown because the host's KFD
    /// topology could not be read is refused, naming the file (a record without it pairs by
    /// position at restore, found out only then); without AMD GPUs the record goes on and says
    /// the topology's warning; a topology read whole that lacks the GPU is a gap, not a refusal.
    #[test]
    fn an_unread_topology_refuses_an_amd_gpu_only() {
        let why = "/h/sys/class/kfd/kfd/topology/nodes/2/properties: is a char device; expected a regular file";
        let render = |m: u32| {
            (
                m,
                HostNode {
                    rel_path: format!("dri/renderD{m}"),
                    rdev: Rdev::new(226, m),
                    access: Access::DEVICE_DEFAULT,
                },
            )
        };
        let inputs = |amd: Vec<(u32, HostNode)>, unread: Option<&str>| Inputs {
            dev_dir: Some(DevDirScan { gpus: vec![], amd, passthrough: vec![], warnings: vec![] }),
            host: HostFacts { amd_unread: unread.map(str::to_owned), ..HostFacts::default() },
            ..Inputs::default()
        };
        let plan = plan::build(&inputs(vec![render(144)], Some(why))).unwrap();
        let err = check(&plan).unwrap_err().to_string();
        assert!(err.starts_with(why) && err.contains("GPU dri/renderD144 cannot be recorded"), "{err}");
        assert!(gaps(&plan).is_empty(), "{:?}", gaps(&plan));
        let none = plan::build(&inputs(vec![], Some(why))).unwrap();
        assert_eq!(check(&none), Ok(()));
        assert_eq!(unread_warning(&none), Some(format!("{why}; the AMD GPUs' KFD facts are unknown")));
        let lacking = plan::build(&inputs(vec![render(144)], None)).unwrap();
        assert_eq!((check(&lacking), unread_warning(&lacking)), (Ok(()), None));
        assert!(gaps(&lacking)[0].contains("KFD topology has no GPU with drm_render_minor 144"));
    }

    /// A bus location that does not parse gives gpu_id 0, never a panic.
    #[test]
    fn odd_bus_locations() {
        let gpu = |bus: &str| RestoredGpu {
            minor: 0,
            rdev: Rdev::new(195, 0),
            access: Access::DEVICE_DEFAULT,
            uuid: None,
            bus: Some(bus.into()),
            pci: None,
            model: None,
        };
        assert_eq!(gpu_id(&gpu("0000:03:00.0")), Some(0x300));
        for bad in ["", "03:00.0", "0000:3b:00", "0000:zz:00.0", "10000:03:00.0", "0000:03:20.0"] {
            assert_eq!(gpu_id(&gpu(bad)), None, "{bad}");
        }
    }
}
