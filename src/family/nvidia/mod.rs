//! The NVIDIA family: the `nvidiaN` nodes of a device directory, the NVIDIA nodes that pass
//! through unchanged, and what the driver's `/proc` and `/sys` files tell of each GPU.
//!
//! Assumes Linux device numbering: a GPU's regular device is char 195:N with N <= 247
//! (`NV_MINOR_DEVICE_NUMBER_REGULAR_MAX`); minors above that belong to `nvidiactl` and friends.
//! The N of `nvidiaN` is ASCII digits (Rust's `\d` would take any Unicode digit, gVisor's does
//! not). Missing driver files are not errors: a GPU is still served without its uuid or PCI
//! ids. A `GPU UUID` that is not a well-formed UUID (the driver prints
//! `GPU-????????-????-????-????-????????????` when it cannot read one) is unknown, never an
//! identity.

pub mod checks;
pub mod cuda_map;
pub mod hook;
pub mod info;
pub mod metadata;
pub mod pairing;
pub mod plan;
mod restored;
mod show;
pub mod visible;

pub use info::GpuInfo;

use super::Family;
use super::facts::HostFacts;
use crate::device::{Access, DevKind, MAX_DRIVER_VERSION_LEN, MAX_MODEL_LEN, Rdev, fact_fault};
use crate::inputs::host::{DevDir, DevDirScan, HostError, small_text};
use crate::inputs::pci::{bus_id, bus_name};
use std::fs;
use std::path::Path;

/// The NVIDIA driver's character major (`NV_MAJOR_DEVICE_NUMBER`).
pub const NV_MAJOR: u32 = 195;
/// The largest minor of a regular GPU device (`NV_MINOR_DEVICE_NUMBER_REGULAR_MAX`).
pub const MAX_REGULAR_MINOR: u32 = 247;

/// NVIDIA nodes that are served as they are on the host, never remapped. Their majors can be
/// dynamic (`nvidia-uvm`, `nvidia-caps`), so they are read again at every load.
const PASSTHROUGH: &[&str] = &["nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools"];
const CAPS_DIR: &str = "nvidia-caps";

/// Whether the NVIDIA hook gives pass-through node `rel_path` to a container that asks for GPU
/// support with `capabilities`: `nvidiactl` always, `nvidia-uvm` and `nvidia-uvm-tools` with
/// `compute`, `nvidia-modeset` with `display` ([`hook::Capabilities`]). Not `nvidia-caps/*`,
/// which the toolkit gives only for MIG devices (libnvidia-container's MIG capability mounts;
/// the CDI spec's MIG devices), and devremap serves no MIG device.
pub fn hook_control_node(rel_path: &str, capabilities: hook::Capabilities) -> bool {
    match rel_path {
        "nvidiactl" => true,
        "nvidia-uvm" | "nvidia-uvm-tools" => capabilities.compute,
        "nvidia-modeset" => capabilities.display,
        _ => false,
    }
}

/// The NVIDIA family ([`super::NVIDIA`]).
pub struct Nvidia;

impl Family for Nvidia {
    /// `nvidiaN` char devices (N over 247 or a leading zero is an error), the pass-through
    /// nodes, and `nvidia-caps/nvidia-cap*`, the directory opened without following a symlink.
    fn scan_dev_dir(&self, dir: &mut DevDir, scan: &mut DevDirScan) -> Result<(), HostError> {
        for name in dir.names("nvidia")? {
            if let Some(minor) = gpu_minor_of_name(&name).map_err(|m| HostError::BadName(dir.path(&name), m))? {
                scan.gpus.push((minor, dir.char_node(&name)?));
            } else if PASSTHROUGH.contains(&name.as_str()) {
                scan.passthrough.push(dir.char_node(&name)?);
            }
        }
        if let Some(mut caps) = dir.subdir(CAPS_DIR, &mut scan.warnings)? {
            for name in caps.names("nvidia")?.into_iter().filter(|n| n.starts_with("nvidia-cap")) {
                scan.passthrough.push(caps.char_node(&name)?);
            }
        }
        Ok(())
    }

    /// Reads what `<root>/proc/driver/nvidia/gpus/*/information`, `proc/driver/nvidia/version`
    /// and `<root>/sys/bus/pci/devices/<bus>/{vendor,device}` say.
    fn read_host_facts(&self, root: &Path, facts: &mut HostFacts) {
        facts.driver_version =
            small_text(&root.join("proc/driver/nvidia/version"), &mut facts.warnings).and_then(|t| parse_version(&t));
        let gpus_dir = root.join("proc/driver/nvidia/gpus");
        let mut dirs: Vec<fs::DirEntry> = fs::read_dir(&gpus_dir).into_iter().flatten().flatten().collect();
        dirs.sort_by_key(fs::DirEntry::file_name);
        for dir in dirs {
            let dir_name = dir.file_name().to_string_lossy().into_owned();
            let Some(text) = small_text(&dir.path().join("information"), &mut facts.warnings) else {
                facts.unread.push(dir_name);
                continue;
            };
            let mut info = parse_information(&text);
            info.bus = info.bus.or(Some(dir_name));
            // Only a PCI bus id names a sysfs directory, written as sysfs does: any other text
            // (`../..`, an absolute path) would lead out of the host root.
            if let Some(id) = info.bus.as_deref().and_then(bus_id) {
                let pci_dir = root.join("sys/bus/pci/devices").join(bus_name(id));
                let mut read_hex =
                    |f: &str| small_text(&pci_dir.join(f), &mut facts.warnings).and_then(|s| parse_hex(&s));
                info.pci = read_hex("vendor").zip(read_hex("device"));
            }
            facts.gpu_info.push(info);
        }
    }

    fn gpu_name(&self, minor: u32) -> String {
        format!("nvidia{minor}")
    }

    /// A regular NVIDIA device: char 195:N, N <= 247.
    fn gpu_minor_of_device(&self, kind: DevKind, rdev: Rdev) -> Option<u32> {
        (kind == DevKind::Char && rdev.major == NV_MAJOR && rdev.minor <= MAX_REGULAR_MINOR).then_some(rdev.minor)
    }

    /// The NVIDIA hook (`NVIDIA_VISIBLE_DEVICES`) gives the driver's control nodes whenever it
    /// asks for GPU support, `none` included, as its capabilities say ([`hook_control_node`]).
    fn hook_gives(&self, rel_path: &str, spec: &crate::inputs::spec::SpecView) -> bool {
        hook_control_node(rel_path, spec.hook_capabilities)
    }
}

/// A GPU present on the restore host, named `nvidia<minor>` there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RestoredGpu {
    /// The host minor: the N of its native name `nvidiaN`.
    pub minor: u32,
    /// The real device the node opens (195:N on a real host).
    pub rdev: Rdev,
    pub access: Access,
    pub uuid: Option<String>,
    /// PCI bus location, e.g. `0000:3b:00.0`.
    pub bus: Option<String>,
    /// PCI vendor and device id, when the host tells them.
    pub pci: Option<(u32, u32)>,
    /// The driver's `Model:` line (`NVIDIA H100 80GB HBM3`), when the host tells it.
    #[serde(default)]
    pub model: Option<String>,
}

impl RestoredGpu {
    /// The native name of this GPU.
    pub fn name(&self) -> String {
        Nvidia.gpu_name(self.minor)
    }
}

/// The digits of a GPU name, `nvidia` and one or more ASCII digits (`^nvidia([0-9]+)$`).
/// Matched by hand, not with a `Regex`: a compiled one and its matching caches took about
/// 30 KiB of every container's server, kept for its life (issue 31's memory per container).
fn gpu_digits(name: &str) -> Option<&str> {
    name.strip_prefix("nvidia").filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// The GPU minor a device file name stands for: `Ok(None)` for a name that is not a GPU
/// name, an error for one that is but names no valid regular minor.
pub fn gpu_minor_of_name(name: &str) -> Result<Option<u32>, String> {
    let Some(digits) = gpu_digits(name) else { return Ok(None) };
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(format!("GPU name {name:?} has a leading zero; the driver never makes one"));
    }
    let minor: u32 = digits.parse().map_err(|_| format!("GPU name {name:?}: the number is out of range"))?;
    if minor > MAX_REGULAR_MINOR {
        return Err(format!("GPU name {name:?}: minor {minor} is over {MAX_REGULAR_MINOR}"));
    }
    Ok(Some(minor))
}

/// Whether `s` is a well-formed GPU UUID as the driver prints it: `GPU-` and 8-4-4-4-12 hex
/// digits. Anything else is no identity: the driver prints `GPU-????????-????-????-????-????????????`
/// for every GPU whose UUID it could not read, so two GPUs may "share" such a string.
pub fn is_gpu_uuid(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("GPU-") else { return false };
    let groups: Vec<&str> = rest.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Parses the driver's `information` file (`Key: \t value` lines).
pub fn parse_information(text: &str) -> GpuInfo {
    let mut info = GpuInfo::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        match key.trim() {
            "Device Minor" => info.minor = value.parse().ok(),
            "GPU UUID" if is_gpu_uuid(value) => info.uuid = Some(value.to_owned()),
            "Bus Location" if !value.is_empty() => info.bus = Some(value.to_owned()),
            "GPU Excluded" | "Blacklisted" => info.excluded = value == "Yes",
            // A model that is no fact is unknown, as a malformed UUID is: the host's files are
            // read best effort.
            "Model" if fact_fault(value, MAX_MODEL_LEN).is_none() => info.model = Some(value.to_owned()),
            _ => {}
        }
    }
    info
}

/// The version in the driver's `version` file, whose first line is
/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Tue Oct 10 ...` (the open
/// modules: `... Open Kernel Module for x86_64  570.86.15  Release Build ...`): the first word
/// of that line made of digits and dots with a dot in it.
pub fn parse_version(text: &str) -> Option<String> {
    let line = text.lines().find_map(|l| l.strip_prefix("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| w.contains('.') && w.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
        .filter(|w| fact_fault(w, MAX_DRIVER_VERSION_LEN).is_none())
        .map(str::to_owned)
}

fn parse_hex(s: &str) -> Option<u32> {
    let s = s.trim();
    u32::from_str_radix(s.strip_prefix("0x").unwrap_or(s), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bug (issue 10.3): the driver's placeholder `GPU-????????-????-????-????-????????????`
    /// (UUID unreadable) and any other malformed string is not a UUID, so never an identity.
    #[test]
    fn only_well_formed_gpu_uuids_are_identities() {
        assert!(is_gpu_uuid("GPU-9221d5d1-b60b-a624-bf14-0a1819cfda3b"));
        assert!(is_gpu_uuid("GPU-9221D5D1-B60B-A624-BF14-0A1819CFDA3B"));
        for bad in [
            "GPU-????????-????-????-????-????????????",
            "GPU-nope",
            "GPU-",
            "9221d5d1-b60b-a624-bf14-0a1819cfda3b",
            "MIG-9221d5d1-b60b-a624-bf14-0a1819cfda3b",
            "GPU-9221d5d1-b60b-a624-bf14-0a1819cfda3",
            "GPU-9221d5d1-b60b-a624-bf14-0a1819cfda3b-1",
            "GPU-9221d5d1b60b-a624-bf14-0a1819cfda3b",
            "GPU-9221d5d1-b60b-a624-bf14-0a1819cfda3g",
        ] {
            assert!(!is_gpu_uuid(bad), "{bad}");
        }
    }

    /// Rule: only `nvidia` + ASCII digits is a GPU name; gVisor's `\d` is ASCII, Rust's is not.
    #[test]
    fn gpu_names_are_ascii_digits_only() {
        assert_eq!(gpu_minor_of_name("nvidia0"), Ok(Some(0)));
        assert_eq!(gpu_minor_of_name("nvidia247"), Ok(Some(247)));
        assert_eq!(gpu_minor_of_name("nvidiactl"), Ok(None));
        assert_eq!(gpu_minor_of_name("nvidia-1"), Ok(None));
        assert_eq!(gpu_minor_of_name("nvidia\u{0663}"), Ok(None));
        assert_eq!(gpu_minor_of_name("nvidia"), Ok(None));
        // Anchored at both ends, as the regular expression it replaces was (issue 31).
        for name in ["nvidia1x", "xnvidia1", "nvidia 1", "nvidia1\n", "Nvidia1", "nvidia+1", "nvidia1.0"] {
            assert_eq!(gpu_minor_of_name(name), Ok(None), "{name:?}");
        }
    }

    /// Rule: a matched number above 247 is an error, not a skip (as in gVisor).
    #[test]
    fn gpu_name_over_max_or_huge_is_an_error() {
        assert!(gpu_minor_of_name("nvidia248").unwrap_err().contains("over 247"));
        assert!(gpu_minor_of_name("nvidia12345678901234567890").unwrap_err().contains("out of range"));
        assert!(gpu_minor_of_name("nvidia01").unwrap_err().contains("leading zero"));
    }

    /// The driver's information file gives minor, uuid, bus and exclusion, each field as the
    /// driver prints it (`Key: \t value`, `GPU Excluded:\t No`).
    #[test]
    fn parses_driver_information() {
        let text = "Model: \t\t NVIDIA A100-SXM4-80GB\nIRQ:   \t\t 156\n\
                    GPU UUID: \t GPU-5b2c6f7e-0d1a-4c3e-9f10-aa0000000000\nVideo BIOS: \t 92.00.45.00.06\n\
                    Bus Type: \t PCIe\nDMA Size: \t 47 bits\nDMA Mask: \t 0x7fffffffffff\n\
                    Bus Location: \t 0000:3B:00.0\nDevice Minor: \t 3\nGPU Excluded:\t No\n";
        let info = parse_information(text);
        assert_eq!(info.minor, Some(3));
        assert_eq!(info.uuid.as_deref(), Some("GPU-5b2c6f7e-0d1a-4c3e-9f10-aa0000000000"));
        assert_eq!(info.bus.as_deref(), Some("0000:3B:00.0"));
        assert!(!info.excluded);
        assert_eq!(info.model.as_deref(), Some("NVIDIA A100-SXM4-80GB"));
        assert_eq!(parse_information("Model: \t\t NVIDIA \x1b[2J\n").model, None);
        assert_eq!(parse_information(&format!("Model: \t\t {}\n", "x".repeat(96))).model, None);
        assert!(parse_information("Blacklisted:\t Yes\n").excluded);
        assert!(parse_information("GPU Excluded:\t Yes\n").excluded);
        assert_eq!(parse_hex("0x10de\n"), Some(0x10de));
    }

    /// Bug (found from outside): a `Bus Location` that is not a PCI bus id (`/etc/x`,
    /// `../../../../x`) was joined to `sys/bus/pci/devices` as a path, so the PCI ids were
    /// read from outside the host root. Only a bus id names a sysfs directory, written as
    /// sysfs writes it (lower-case hex).
    #[test]
    fn a_bus_location_that_is_no_bus_id_never_leaves_the_host_root() {
        let tmp = tempfile::TempDir::new().unwrap();
        let (root, outside) = (tmp.path().join("root"), tmp.path().join("outside"));
        let write = |path: &Path, text: &str| {
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        };
        write(&outside.join("vendor"), "0x1234\n");
        write(&outside.join("device"), "0x5678\n");
        for (dir, bus) in [("0000:07:00.0", outside.to_str().unwrap()), ("0000:0f:00.0", "../../../../../outside")] {
            let info = format!("GPU UUID: \t GPU-9221d5d1-b60b-a624-bf14-000000000000\nBus Location: \t {bus}\n");
            write(&root.join("proc/driver/nvidia/gpus").join(dir).join("information"), &info);
            fs::create_dir_all(root.join("sys/bus/pci/devices").join(dir)).unwrap();
        }
        let facts = crate::family::table::read_host_facts(&root);
        assert_eq!(facts.gpu_info.len(), 2);
        assert!(facts.gpu_info.iter().all(|g| g.pci.is_none()), "{:?}", facts.gpu_info);

        write(&root.join("proc/driver/nvidia/gpus/0000:3b:00.0/information"), "Bus Location: \t 0000:3B:00.0\n");
        write(&root.join("sys/bus/pci/devices/0000:3b:00.0/vendor"), "0x10de\n");
        write(&root.join("sys/bus/pci/devices/0000:3b:00.0/device"), "0x2330\n");
        let facts = crate::family::table::read_host_facts(&root);
        assert_eq!(facts.gpu_info.iter().find_map(|g| g.pci), Some((0x10de, 0x2330)));
    }

    /// Rule (issue 20): the driver version is the version word of the `NVRM version:` line, as
    /// the proprietary and the open modules print it; anything else is unknown.
    #[test]
    fn parses_the_driver_version() {
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Tue Oct 10 16:06:50 UTC 2023\n\
                      GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n";
        assert_eq!(parse_version(closed).as_deref(), Some("535.129.03"));
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  \
                    (dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 23:06:32 UTC 2025\n";
        assert_eq!(parse_version(open).as_deref(), Some("570.86.15"));
        for bad in ["", "GCC version: 12.2.0\n", "NVRM version: NVIDIA UNIX Kernel Module\n", "NVRM version: 535\n"] {
            assert_eq!(parse_version(bad), None, "{bad:?}");
        }
        let tmp = tempfile::TempDir::new().unwrap();
        fs::create_dir_all(tmp.path().join("proc/driver/nvidia")).unwrap();
        fs::write(tmp.path().join("proc/driver/nvidia/version"), closed).unwrap();
        assert_eq!(crate::family::table::read_host_facts(tmp.path()).driver_version.as_deref(), Some("535.129.03"));
    }

    /// Bug (issue 10.3): the placeholder the driver prints for an unreadable UUID is no UUID.
    #[test]
    fn placeholder_uuid_is_unknown() {
        let info = parse_information("GPU UUID: \t GPU-????????-????-????-????-????????????\nDevice Minor: \t 0\n");
        assert_eq!((info.uuid, info.minor), (None, Some(0)));
    }
}
