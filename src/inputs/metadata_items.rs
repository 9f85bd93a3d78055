//! One item of the checkpoint's device list at a time: NVIDIA's (gVisor's `DeviceRemapID`
//! fields, the recorded `mode`, `uid` and `gid`, facts and `earlier_minors`), and what every
//! item kind shares: the access fields and the earlier names. Pure; the list itself is [`metadata`](super::metadata)'s.

use super::metadata::{DeviceId, MetadataError, RecordedAccess, describe};
use crate::device::{MAX_DRIVER_VERSION_LEN, MAX_MODEL_LEN, fact_fault};
use crate::family::nvidia::{MAX_REGULAR_MINOR, is_gpu_uuid};
use serde_json::{Map, Value};
use std::collections::BTreeSet;

/// NVIDIA's items sorted by minor, each minor, earlier name and uuid once.
pub(crate) fn nvidia_list(mut gpus: Vec<DeviceId>) -> Result<Vec<DeviceId>, MetadataError> {
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

/// An item's optional unsigned 32-bit `field`.
fn optional_u32(index: usize, obj: &Map<String, Value>, field: &'static str) -> Result<Option<u32>, MetadataError> {
    obj.get(field)
        .map(|v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| MetadataError::Field {
                index,
                field,
                expected: "an unsigned 32-bit integer",
                found: describe(v),
            })
        })
        .transpose()
}

/// An item's `mode`, `uid` and `gid`. The metadata may come from another host: it may give a
/// checkpoint name the mode the saved node had, but never setuid or setgid (runc clears them on
/// device nodes too, so a node a checkpoint saw never had them) nor the owner id that means "no
/// owner".
pub(crate) fn recorded_access(index: usize, obj: &Map<String, Value>) -> Result<RecordedAccess, MetadataError> {
    let field = |f| optional_u32(index, obj, f);
    let recorded = RecordedAccess { mode: field("mode")?, uid: field("uid")?, gid: field("gid")? };
    if let Some(mode) = recorded.mode.filter(|m| m & !0o1777 != 0) {
        return Err(MetadataError::ModeTooLarge { index, mode });
    }
    for (field, id) in [("uid", recorded.uid), ("gid", recorded.gid)] {
        if id == Some(u32::MAX) {
            return Err(MetadataError::NoOwner { index, field });
        }
    }
    Ok(recorded)
}

pub(crate) fn device_id(index: usize, obj: &Map<String, Value>) -> Result<DeviceId, MetadataError> {
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
        return Err(MetadataError::MinorTooLarge { index, minor });
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

/// The `earlier_minors` of an item whose minor is `minor`, either family's: `noun` minors,
/// each once, none the item's own, none that `fault` (the family's range) finds fault with;
/// sorted. The error is what is wrong, for the caller to name the item.
pub(crate) fn earlier_minors(
    minor: u32,
    value: Option<&Value>,
    noun: &str,
    fault: impl Fn(u32) -> Option<String>,
) -> Result<Vec<u32>, String> {
    let items = match value {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(v) => return Err(format!("expected an array of {noun}, found {}", describe(v))),
    };
    let mut out = BTreeSet::new();
    for item in items {
        let m = item
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("expected {noun}, found {}", describe(item)))?;
        if let Some(why) = fault(m) {
            return Err(why);
        }
        if m == minor || !out.insert(m) {
            return Err(format!("minor {m} is listed twice or is the GPU's own"));
        }
    }
    Ok(out.into_iter().collect())
}

/// The first name given twice among `names` (each item's minor and earlier minors): every
/// name must lead to one GPU.
pub(crate) fn repeated_name(names: impl IntoIterator<Item = u32>) -> Option<u32> {
    let mut seen = BTreeSet::new();
    names.into_iter().find(|&m| !seen.insert(m))
}
