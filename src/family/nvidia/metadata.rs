//! NVIDIA's items of the checkpoint's device list, those without a `kind`: gVisor's
//! `DeviceRemapID` fields, the recorded `mode`, `uid` and `gid`, the driver's facts at save
//! time and `earlier_minors`.
//!
//! Pure. A `uuid` that is not a well-formed `GPU-` UUID is read as unknown (empty), never as an
//! identity; a minor over [`MAX_REGULAR_MINOR`] is refused.

use super::{MAX_REGULAR_MINOR, is_gpu_uuid};
use crate::device::{MAX_DRIVER_VERSION_LEN, MAX_MODEL_LEN, fact_fault};
use crate::inputs::metadata_items::{
    MetadataError, RecordedAccess, describe, earlier_minors, optional_u32, recorded_access, repeated_name,
};
use serde_json::{Map, Value};
use std::collections::BTreeSet;

/// One GPU as it was at save time (gVisor's `nvproxy.DeviceRemapID`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceId {
    pub minor: u32,
    pub pci_vendor_id: u32,
    pub pci_device_id: u32,
    pub gpu_id: u32,
    pub device_instance: u32,
    pub subdevice_instance: u32,
    /// A well-formed `GPU-` UUID, or empty when unknown: a missing or malformed one (the
    /// driver's `GPU-????????-...` placeholder) is never an identity.
    pub uuid: String,
    /// The mode, uid and gid the node had at save time, where `devremapd record` wrote them.
    pub recorded: RecordedAccess,
    /// The driver's model name at save time, where `devremapd record` wrote it: shown beside
    /// the PCI ids when the `model` check fails.
    #[serde(default)]
    pub model: Option<String>,
    /// The save host's driver version, where `devremapd record` wrote it: the `driver` check.
    #[serde(default)]
    pub driver_version: Option<String>,
    /// The other names this GPU had in the checkpointed container, sorted: the checkpoint names
    /// of an earlier restore that led to it (`record --metadata PREV` writes them). Each is
    /// served as this GPU's checkpoint name too, so a process migrated twice finds every name
    /// it may hold.
    #[serde(default)]
    pub earlier_minors: Vec<u32>,
}

impl DeviceId {
    /// PCI vendor and device id; `None` when the list left them out (0 is no vendor).
    pub fn pci(&self) -> Option<(u32, u32)> {
        (self.pci_vendor_id != 0).then_some((self.pci_vendor_id, self.pci_device_id))
    }
}

/// NVIDIA's items sorted by minor, each minor, earlier name and uuid once.
pub fn list(mut gpus: Vec<DeviceId>) -> Result<Vec<DeviceId>, MetadataError> {
    gpus.sort_by_key(|d| d.minor);
    if let Some(w) = gpus.windows(2).find(|w| w[0].minor == w[1].minor) {
        return Err(MetadataError::DuplicateMinor(w[0].minor));
    }
    // Every name leads to one GPU: an earlier name is no other GPU's minor or earlier name.
    let names = gpus.iter().flat_map(|d| std::iter::once(d.minor).chain(d.earlier_minors.iter().copied()));
    if let Some(minor) = repeated_name(names) {
        return Err(MetadataError::DuplicateMinor(minor));
    }
    // A UUID's hex digits mean the same in either case.
    let mut uuids = BTreeSet::new();
    if let Some(d) = gpus.iter().find(|d| !d.uuid.is_empty() && !uuids.insert(d.uuid.to_ascii_lowercase())) {
        return Err(MetadataError::DuplicateUuid(d.uuid.clone()));
    }
    Ok(gpus)
}

/// Reads NVIDIA item `index` of the list.
pub fn item(index: usize, obj: &Map<String, Value>) -> Result<DeviceId, MetadataError> {
    let optional = |field: &'static str| optional_u32(index, obj, field);
    let number = |field: &'static str, required: bool| -> Result<u32, MetadataError> {
        match optional(field)? {
            Some(n) => Ok(n),
            None if !required => Ok(0),
            None => Err(MetadataError::Field {
                index,
                field,
                expected: "an unsigned 32-bit integer",
                found: "nothing".into(),
            }),
        }
    };
    let minor = number("minor", true)?;
    if minor > MAX_REGULAR_MINOR {
        return Err(MetadataError::MinorTooLarge { index, minor, max: MAX_REGULAR_MINOR });
    }
    let uuid = match obj.get("uuid") {
        None => String::new(),
        Some(Value::String(s)) if is_gpu_uuid(s) => s.clone(),
        Some(Value::String(_)) => String::new(),
        Some(v) => {
            return Err(MetadataError::Field { index, field: "uuid", expected: "a string", found: describe(v) });
        }
    };
    // Facts are compared and shown in messages: text a driver writes, never echoed when not.
    let fact = |field: &'static str, max: usize| -> Result<Option<String>, MetadataError> {
        match obj.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => match fact_fault(s, max) {
                None => Ok(Some(s.clone())),
                Some(why) => Err(MetadataError::Fact { index, field, why }),
            },
            Some(v) => Err(MetadataError::Field { index, field, expected: "a string", found: describe(v) }),
        }
    };
    let model = fact("model", MAX_MODEL_LEN)?;
    let earlier_minors = earlier_minors(minor, obj.get("earlier_minors"), "GPU minors", |m| {
        (m > MAX_REGULAR_MINOR).then(|| format!("minor {m} is over {MAX_REGULAR_MINOR}, the largest GPU minor"))
    })
    .map_err(|what| MetadataError::Earlier { index, what })?;
    let driver_version = fact("driver_version", MAX_DRIVER_VERSION_LEN)?;
    let recorded = recorded_access(index, obj)?;
    Ok(DeviceId {
        minor,
        pci_vendor_id: number("pci_vendor_id", false)?,
        pci_device_id: number("pci_device_id", false)?,
        gpu_id: number("gpu_id", false)?,
        device_instance: number("device_instance", false)?,
        subdevice_instance: number("subdevice_instance", false)?,
        uuid,
        recorded,
        model,
        driver_version,
        earlier_minors,
    })
}
