//! The NVIDIA GPUs a restore gets, from the spec, the device directory and the hook's
//! `NVIDIA_VISIBLE_DEVICES`, with what the driver's files say of them (the first step of NVIDIA's
//! [`super::plan`] after the checks of the driver files themselves).
//!
//! Pure. Assumption: the device directory's stat'd numbers are the truth for a GPU both it and
//! the spec name, since the spec may be older than the host's nodes; its mode and owner are
//! the spec's, which runc gives the node.

use super::visible;
use super::{GpuInfo, Nvidia, RestoredGpu};
use crate::decision::seam::{Inputs, PlanError};
use crate::family::Family;
use crate::inputs::pci;
use std::collections::{BTreeMap, BTreeSet};

/// The restored GPUs: the spec's 195:N devices and the device directory's `nvidiaN` nodes
/// (whose stat'd number wins, and the spec's mode and owner where the spec lists the GPU): of
/// the directory's, every one without a spec, else only those the spec lists and those the
/// hook's `NVIDIA_VISIBLE_DEVICES` selects; with what the driver says of them, sorted by minor.
pub fn restored_gpus(inputs: &Inputs) -> Result<Vec<RestoredGpu>, PlanError> {
    let mut by_minor = inputs.spec.as_ref().map(|s| Nvidia.spec_gpus(s)).unwrap_or_default();
    let selected = hook_selection(inputs)?;
    if let (Some(selected), Some(dir)) = (&selected, &inputs.dev_dir)
        && let Some(missing) = selected.iter().find(|m| !dir.gpus.iter().any(|(n, _)| n == *m))
    {
        return Err(PlanError::HostDevMissing(*missing));
    }
    // A spec is given the GPUs it lists and those the hook selects, and no others, as runc and
    // the NVIDIA hook give them (issues 17.9, 29.3): one that asks for none gets none. Only
    // without a spec (`--host-dev` alone, the operator's own flags) is every GPU of the
    // directory restored.
    let whole_dir = inputs.spec.is_none();
    for (minor, node) in inputs.dev_dir.iter().flat_map(|d| &d.gpus) {
        let given = match &selected {
            Some(s) => s.contains(minor),
            None => whole_dir || by_minor.contains_key(minor),
        };
        // The spec's mode and owner win where it lists the GPU, as runc makes its node with
        // them (the host's may be wider); the directory gives the number.
        if given {
            by_minor.entry(*minor).and_modify(|(rdev, _)| *rdev = node.rdev).or_insert((node.rdev, node.access));
        }
    }
    Ok(by_minor
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
                model: info.and_then(|i| i.model.clone()),
            }
        })
        .collect())
}

/// Refuses driver files that contradict each other: two GPUs with one Device Minor, one UUID
/// (in either case) or one bus. The driver gives each GPU its own; a UUID or selection would
/// otherwise silently mean the first of the two.
pub fn check_driver_files(gpus: &[GpuInfo]) -> Result<(), PlanError> {
    let key = |g: &GpuInfo| -> [Option<String>; 3] {
        [
            g.minor.map(|m| format!("Device Minor {m}")),
            // `get`: host.rs gives only `GPU-...` UUIDs, but `GpuInfo` is public, and a short or
            // non-ASCII one must not panic here.
            g.uuid.as_ref().map(|u| format!("GPU UUID GPU-{}", u.get(4..).unwrap_or(u).to_ascii_lowercase())),
            g.bus.as_deref().and_then(pci::bus_id).map(|b| format!("Bus Location {}", pci::bus_name(b))),
        ]
    };
    let mut seen: BTreeMap<String, &GpuInfo> = BTreeMap::new();
    for gpu in gpus {
        for what in key(gpu).into_iter().flatten() {
            if let Some(first) = seen.insert(what.clone(), gpu) {
                let name = |g: &GpuInfo| g.bus.clone().unwrap_or_else(|| "a GPU".into());
                return Err(PlanError::DriverFilesClash { first: name(first), second: name(gpu), what });
            }
        }
    }
    Ok(())
}

/// The host minors the spec's hook request selects; `None` for no selection (no hook request).
fn hook_selection(inputs: &Inputs) -> Result<Option<BTreeSet<u32>>, PlanError> {
    let Some(hook) = inputs.spec.as_ref().and_then(|s| s.hook.as_ref()) else { return Ok(None) };
    let present: Vec<u32> = inputs.dev_dir.iter().flat_map(|d| &d.gpus).map(|(minor, _)| *minor).collect();
    visible::resolve(hook, &inputs.host.gpu_info, &inputs.host.unread, &present).map(Some).map_err(PlanError::Visible)
}
