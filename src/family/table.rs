//! The table of families and what is asked of all of them at once: the device directory's scan
//! ([`scan_dev_dir`]), the driver files under the host root ([`read_host_facts`]), and the
//! checkpoint's device list, each item read by its family ([`read_items`]), a `--device-map`
//! side in its family's form ([`parse_device_map`]) and what the families read from the
//! environment ([`switches_from_env`]).
//!
//! Wiring, no rules: each family's rules are in its folder. The order of [`FAMILIES`] is the
//! order of the scan and of the families' items.

use super::amd::properties::{Checks, Switches};
use super::facts::HostFacts;
use super::{Family, amd, nvidia};
use crate::decision::pairing::{DeviceRef, MapPair, PairingError};
use crate::inputs::host::{DevDir, DevDirScan, HostError};
use crate::inputs::limits;
use crate::inputs::metadata_items::{GPU_KEY, MetadataError, describe, recorded_access};
use serde_json::Value;
use std::path::Path;

/// The NVIDIA family.
pub static NVIDIA: &dyn Family = &nvidia::Nvidia;
/// The AMD family.
pub static AMD: &dyn Family = &amd::Amd;

/// The family whose runtime hook a spec may ask for GPUs through, and whose GPUs in a spec's
/// `linux.devices` say it asks for GPUs: NVIDIA's, the one hook that makes GPU nodes.
pub static HOOK_FAMILY: &dyn Family = NVIDIA;
/// What a spec asks of that hook: `NVIDIA_VISIBLE_DEVICES` as the toolkit reads it.
pub type HookRequest = nvidia::visible::Visible;
/// Why a spec's request of that hook is refused.
pub type HookError = nvidia::visible::VisibleError;
pub use nvidia::hook::request as hook_request;
/// Which of the family's control nodes that hook gives (`NVIDIA_DRIVER_CAPABILITIES`).
pub type HookCapabilities = nvidia::hook::Capabilities;
pub use nvidia::hook::capabilities as hook_capabilities;

/// Every family, in the order they are asked.
pub static FAMILIES: &[&dyn Family] = &[NVIDIA, AMD];

/// Every family's saved GPUs, as the checkpoint's device list gives them. Serialized with the
/// metadata as its own keys: NVIDIA's `gpus`, AMD's `amd`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    /// NVIDIA's items (those without a `kind`), sorted by minor.
    pub gpus: Vec<nvidia::metadata::DeviceId>,
    /// AMD's items (`"kind": "amdgpu"`), in the list's order.
    #[serde(default)]
    pub amd: Vec<amd::metadata::AmdSaved>,
}

/// Reads the checkpoint's device list: each item by the family whose `kind` it has (NVIDIA's
/// items have none), then each family's list as a whole (a name given twice is refused).
pub fn read_items(items: &[Value]) -> Result<Saved, MetadataError> {
    let (mut gpus, mut amd) = (Vec::new(), Vec::new());
    for (index, item) in items.iter().enumerate() {
        let Value::Object(obj) = item else {
            return Err(MetadataError::Shape {
                key: GPU_KEY,
                what: format!("item {index}: expected an object, found {}", describe(item)),
            });
        };
        match obj.get("kind") {
            None => gpus.push(nvidia::metadata::item(index, obj)?),
            Some(Value::String(k)) if k == amd::metadata::KIND => {
                amd.push(amd::metadata::item(index, obj, recorded_access(index, obj)?)?);
            }
            Some(other) => return Err(MetadataError::Kind { index, found: describe(other) }),
        }
    }
    Ok(Saved { gpus: nvidia::metadata::list(gpus)?, amd: amd::metadata::list(amd)? })
}

/// Lists every family's GPU and pass-through nodes of `dir`.
///
/// The directory is opened once (following `dir` itself if it is a symlink: the caller named
/// it), and its entries are listed and `lstat`ed through that one descriptor, as are the
/// directories under it a family reads (opened without following a symlink). A directory
/// swapped while it is scanned (a symlink flipped to another) cannot mix into the scan: it is
/// all of the directory opened.
pub fn scan_dev_dir(dir: &Path) -> Result<DevDirScan, HostError> {
    let mut top = DevDir::open(dir)?;
    let mut scan = DevDirScan::default();
    for family in FAMILIES {
        family.scan_dev_dir(&mut top, &mut scan)?;
    }
    if scan.gpus.len() + scan.amd.len() + scan.passthrough.len() > limits::MAX_NODES {
        return Err(HostError::TooMany(dir.to_owned()));
    }
    scan.gpus.sort_by_key(|(minor, _)| *minor);
    scan.amd.sort_by_key(|(minor, _)| *minor);
    scan.passthrough.sort_by(|a, b| a.rel_path.cmp(&b.rel_path));
    Ok(scan)
}

/// Reads what every family's driver files under `root` say, and whether `root` has
/// `proc/kcore`.
pub fn read_host_facts(root: &Path) -> HostFacts {
    let mut facts = HostFacts { has_kcore: root.join("proc/kcore").exists(), ..HostFacts::default() };
    for family in FAMILIES {
        family.read_host_facts(root, &mut facts);
    }
    facts
}

/// Parses one `--device-map` value: `OLD=NEW[,OLD=NEW...]`, each side a minor, or a GPU in its
/// family's own form: NVIDIA's `GPU-` UUID, AMD's `renderD<N>`.
pub fn parse_device_map(value: &str) -> Result<Vec<MapPair>, PairingError> {
    value
        .split(',')
        .map(|entry| {
            let bad = |what| PairingError::BadMapEntry { entry: entry.to_owned(), what };
            let (old, new) = entry.split_once('=').ok_or_else(|| bad("expected OLD=NEW"))?;
            let parse = |s: &str| -> Result<DeviceRef, PairingError> {
                let s = s.trim();
                if s.starts_with("GPU-????????") {
                    Err(bad("the driver prints this placeholder for a UUID it cannot read; name the GPU by its minor"))
                } else if s.starts_with("GPU-") && s.len() > 4 {
                    if !nvidia::is_gpu_uuid(s) {
                        return Err(bad("a GPU- UUID is GPU- and 8-4-4-4-12 hex digits"));
                    }
                    Ok(DeviceRef::Uuid(s.to_owned()))
                } else if s.starts_with("renderD") {
                    amd::render_minor_of_name(s)
                        .map(DeviceRef::Render)
                        .map_err(|_| bad("a render node is renderD and its minor, 128 or more"))
                } else if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
                    s.parse().map(DeviceRef::Minor).map_err(|_| bad("minor out of range"))
                } else {
                    Err(bad("each side must be a minor number or a GPU- UUID"))
                }
            };
            Ok(MapPair { old: parse(old)?, new: parse(new)? })
        })
        .collect()
}

/// What the families read from the process's environment: CRIU's amdgpu plugin's `KFD_*_CHECK`
/// switches. CRIU inherits the environment of whoever runs the restore, as this process does
/// (devremap-runtime and its daemon are started by the same caller as runc and CRIU).
pub fn switches_from_env() -> Switches {
    Checks::from_env(|name| std::env::var_os(name).map(std::os::unix::ffi::OsStringExt::into_vec))
}
