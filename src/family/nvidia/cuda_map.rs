//! The pairing as cuda-checkpoint's `--device-map` value, `oldUUID=newUUID,...`, so that the
//! names in `/dev` and the GPUs CUDA restores its state onto come from one decision.
//!
//! Pure. cuda-checkpoint remaps by UUID and wants every saved GPU listed, so every saved GPU
//! and its restored pair must have a well-formed `GPU-` UUID (8-4-4-4-12 hex digits); the
//! driver's placeholder `GPU-????????-...` for an unreadable UUID is unknown, never an identity.

use super::is_gpu_uuid;
use crate::decision::plan::Plan;
use thiserror::Error;

/// Why no device map can be given.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CudaMapError {
    #[error("no saved GPUs: the metadata lists none, so there is nothing to map")]
    NoSavedGpus,
    #[error("saved GPU nvidia{minor} has no known UUID ({found}); cuda-checkpoint maps by UUID")]
    SavedUuid { minor: u32, found: String },
    #[error(
        "restored GPU nvidia{minor} (paired with saved nvidia{old}) has no known UUID ({found}); \
         the driver's information file under --host-root names it"
    )]
    RestoredUuid { minor: u32, old: u32, found: String },
}

/// `oldUUID=newUUID` for every saved GPU, in saved minor order, joined by commas.
pub fn device_map(plan: &Plan) -> Result<String, CudaMapError> {
    if plan.parts.nvidia.remap.is_empty() {
        return Err(CudaMapError::NoSavedGpus);
    }
    let pairs = plan
        .parts
        .nvidia
        .remap
        .iter()
        .map(|e| {
            if !is_gpu_uuid(&e.old.uuid) {
                return Err(CudaMapError::SavedUuid { minor: e.old.minor, found: shown(Some(&e.old.uuid)) });
            }
            match e.new.uuid.as_deref().filter(|u| is_gpu_uuid(u)) {
                Some(new) => Ok(format!("{}={new}", e.old.uuid)),
                None => Err(CudaMapError::RestoredUuid {
                    minor: e.new.minor,
                    old: e.old.minor,
                    found: shown(e.new.uuid.as_ref()),
                }),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(pairs.join(","))
}

fn shown(uuid: Option<&String>) -> String {
    match uuid.filter(|u| !u.is_empty()) {
        Some(u) => format!("{u:?}"),
        None => "none".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::tree::TreeBuilder;
    use crate::device::{Access, Rdev};
    use crate::family::nvidia::RestoredGpu;
    use crate::family::nvidia::metadata::DeviceId;
    use crate::family::nvidia::plan::{NvidiaPlan, RemapEntry};
    use crate::family::plans::Parts;

    fn uuid(side: u32, minor: u32) -> String {
        format!("GPU-{side:08x}-0000-0000-0000-{minor:012x}")
    }

    fn plan(pairs: &[(u32, Option<String>, u32, Option<String>)]) -> Plan {
        let remap = pairs
            .iter()
            .map(|(old, old_uuid, new, new_uuid)| RemapEntry {
                old: DeviceId {
                    minor: *old,
                    pci_vendor_id: 0,
                    pci_device_id: 0,
                    gpu_id: 0,
                    device_instance: 0,
                    subdevice_instance: 0,
                    uuid: old_uuid.clone().unwrap_or_default(),
                    ..Default::default()
                },
                new: RestoredGpu {
                    minor: *new,
                    rdev: Rdev::new(195, *new),
                    access: Access::DEVICE_DEFAULT,
                    uuid: new_uuid.clone(),
                    bus: None,
                    pci: None,
                    model: None,
                },
                by: Default::default(),
                served: true,
                earlier: vec![],
            })
            .collect();
        Plan {
            parts: Parts { nvidia: NvidiaPlan { remap, restored: vec![] }, amd: Default::default() },
            tree: TreeBuilder::default().build(),
            warnings: vec![],
            tpus: vec![],
            driver_version: None,
            checks: vec![],
            mixed_input: Default::default(),
        }
    }

    /// Rule (issue 12.4): every saved GPU, in saved order, old UUID = its pair's UUID.
    #[test]
    fn every_saved_gpu_by_uuid() {
        let p = plan(&[(0, Some(uuid(1, 0)), 2, Some(uuid(2, 2))), (1, Some(uuid(1, 1)), 3, Some(uuid(2, 3)))]);
        assert_eq!(device_map(&p).unwrap(), format!("{}={},{}={}", uuid(1, 0), uuid(2, 2), uuid(1, 1), uuid(2, 3)));
    }

    /// Rule (issue 12.4): a missing, placeholder or malformed UUID on either side is refused,
    /// naming the GPU; no saved GPUs is refused too.
    #[test]
    fn unknown_uuids_are_refused() {
        let placeholder = "GPU-????????-????-????-????-????????????".to_owned();
        let e = device_map(&plan(&[(0, None, 2, Some(uuid(2, 2)))])).unwrap_err();
        assert_eq!(e.to_string(), "saved GPU nvidia0 has no known UUID (none); cuda-checkpoint maps by UUID");
        let e = device_map(&plan(&[(0, Some(uuid(1, 0)), 2, Some(placeholder))])).unwrap_err();
        assert!(matches!(e, CudaMapError::RestoredUuid { minor: 2, old: 0, .. }), "{e}");
        let e = device_map(&plan(&[(0, Some(uuid(1, 0)), 2, None)])).unwrap_err();
        assert!(e.to_string().contains("restored GPU nvidia2 (paired with saved nvidia0) has no known UUID (none)"));
        assert_eq!(device_map(&plan(&[])), Err(CudaMapError::NoSavedGpus));
    }
}
