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
//! Each family writes its own items ([`crate::decision::seam::Shown::record`]), in the
//! families' order: NVIDIA's, then AMD's `"kind": "amdgpu"` items.
//!
//! [`check`] refuses a record that would lose a GPU's identity to host files that could not be
//! read (an AMD KFD topology); what the host's files merely lack is said ([`gaps`]), not refused.

use crate::decision::plan::Plan;
use serde_json::Value;
use thiserror::Error;

/// Why a record is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RecordError {
    /// The host's files that identify a GPU (an AMD KFD topology) could not be read, so a
    /// restored GPU's identity is unknown. Refused rather than recorded without it: a record is
    /// written once, at checkpoint, and one without the identity pairs by position on restore,
    /// which is found out only then.
    #[error(
        "{why}; so GPU {gpu} cannot be recorded with its KFD identity (a restore would pair it by position): \
         the record is refused"
    )]
    UnreadTopology { why: String, gpu: String },
}

/// Refuses a plan a restored GPU of which its family's host files could not identify because
/// they could not be read. Files read whole that lack a GPU are a gap ([`gaps`]), not this.
pub fn check(plan: &Plan) -> Result<(), RecordError> {
    match plan.parts.shown().iter().find_map(|f| f.unrecordable()) {
        Some((why, gpu)) => Err(RecordError::UnreadTopology { why, gpu }),
        None => Ok(()),
    }
}

/// The recorded device list: every family's items, NVIDIA's sorted by minor. With `carried`
/// (the plan was built with the metadata the container was restored with, `record --metadata
/// PREV`), each item's `earlier_minors` lists the other names that lead to it in the container:
/// the served checkpoint names of the saved GPUs paired with it, and their own earlier names.
/// Without, the key is left out, which says that no earlier names were looked for.
pub fn devices(plan: &Plan, carried: bool) -> Value {
    let families = plan.parts.shown();
    Value::Array(families.iter().flat_map(|f| f.record(&plan.tree, plan.driver_version.as_ref(), carried)).collect())
}

/// The warning `plan` gives for a family's host files that could not be read, naming the file:
/// a record that [`check`] lets through (it has no GPU to lose) still says it.
pub fn unread_warning(plan: &Plan) -> Option<String> {
    plan.parts.shown().iter().find_map(|f| f.unread_warning())
}

/// One line per recorded GPU the host's driver files did not describe whole, naming the GPU
/// and what it is recorded without.
pub fn gaps(plan: &Plan) -> Vec<String> {
    plan.parts.shown().iter().flat_map(|f| f.gaps()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::plan::{self, Inputs};
    use crate::device::{Access, Rdev};
    use crate::family::facts::HostFacts;
    use crate::family::nvidia::GpuInfo;
    use crate::inputs::host::{DevDirScan, HostNode};
    use crate::inputs::metadata;
    use serde_json::json;

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
        let pairs: Vec<(u32, u32)> = plan.parts.nvidia.remap.iter().map(|e| (e.old.minor, e.new.minor)).collect();
        assert_eq!(pairs, [(0, 0), (3, 3), (7, 7)]);
        assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
        assert!(plan.parts.nvidia.remap.iter().all(|e| Some(&e.old.uuid) == e.new.uuid.as_ref()));
        assert!(
            plan.parts
                .nvidia
                .remap
                .iter()
                .all(|e| e.old.model == e.new.model && e.old.driver_version == plan.driver_version)
        );
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
            plan.parts.nvidia.remap.iter().map(|e| e.earlier.iter().map(|n| (n.minor, n.served)).collect()).collect();
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
        let earlier: Vec<(u32, bool)> = plan.parts.amd.remap[0].earlier.iter().map(|n| (n.minor, n.served)).collect();
        assert_eq!((plan.parts.amd.remap[0].new_minor, earlier), (128, vec![(144, false), (152, true)]));
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
        assert!(metadata::parse(list.to_string().as_bytes()).unwrap().saved.gpus.is_empty());
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
}
