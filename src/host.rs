//! The restore host's devices: the `nvidiaN` nodes of a device directory, the NVIDIA nodes that
//! pass through unchanged, and what the driver's `/proc` and `/sys` files tell of each GPU.
//!
//! This is an I/O edge. Assumptions: entries are examined with `lstat` and never followed, so a
//! symlink under a GPU name is refused rather than resolved; only char devices count; the N of
//! `nvidiaN` is ASCII digits (Rust's `\d` would take any Unicode digit, gVisor's does not).
//! Missing driver files are not errors: a GPU is still served without its uuid or PCI ids; nor
//! are driver files that are not small regular files, which are skipped unread.

use crate::device::{Access, MAX_REGULAR_MINOR, Rdev};
use crate::files;
use regex::Regex;
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use thiserror::Error;

/// NVIDIA nodes that are served as they are on the host, never remapped. Their majors can be
/// dynamic (`nvidia-uvm`, `nvidia-caps`), so they are read again at every load.
const PASSTHROUGH: &[&str] = &["nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools"];
const CAPS_DIR: &str = "nvidia-caps";
/// The driver's files are a few hundred bytes; more is not theirs.
const INFO_LIMIT: u64 = 64 << 10;

static GPU_NAME: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^nvidia([0-9]+)$").expect("a valid regex"));

/// A device node found on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNode {
    /// Path relative to the device directory.
    pub rel_path: String,
    pub rdev: Rdev,
    pub access: Access,
}

/// The `nvidiaN` nodes of a device directory, and the NVIDIA nodes beside them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevDirScan {
    /// `(N, node)` for every `nvidiaN`, sorted by N.
    pub gpus: Vec<(u32, HostNode)>,
    pub passthrough: Vec<HostNode>,
}

/// What the driver says of one GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuInfo {
    pub minor: Option<u32>,
    pub uuid: Option<String>,
    pub bus: Option<String>,
    pub pci: Option<(u32, u32)>,
}

/// Facts about the host beyond its GPU nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub gpu_info: Vec<GpuInfo>,
    /// The host has `/proc/kcore`, so runc would add the `core` symlink.
    pub has_kcore: bool,
}

/// Why the host's devices could not be read. Each names the file at fault.
#[derive(Debug, Error)]
pub enum HostError {
    #[error("{}: cannot read the directory: {}", .0.display(), crate::io_message(.1))]
    ReadDir(PathBuf, io::Error),
    #[error("{}: cannot stat: {}", .0.display(), crate::io_message(.1))]
    Stat(PathBuf, io::Error),
    #[error("{}: {}", .0.display(), .1)]
    BadName(PathBuf, String),
    #[error("{}: is {}, not a char device; refused", .0.display(), .1)]
    NotCharDevice(PathBuf, &'static str),
}

/// The GPU minor a device file name stands for: `Ok(None)` for a name that is not a GPU
/// name, an error for one that is but names no valid regular minor.
pub fn gpu_minor_of_name(name: &str) -> Result<Option<u32>, String> {
    let Some(caps) = GPU_NAME.captures(name) else { return Ok(None) };
    let digits = &caps[1];
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(format!("GPU name {name:?} has a leading zero; the driver never makes one"));
    }
    let minor: u32 = digits.parse().map_err(|_| format!("GPU name {name:?}: the number is out of range"))?;
    if minor > MAX_REGULAR_MINOR {
        return Err(format!("GPU name {name:?}: minor {minor} is over {MAX_REGULAR_MINOR}"));
    }
    Ok(Some(minor))
}

/// Lists the GPU and pass-through NVIDIA nodes of `dir`.
pub fn scan_dev_dir(dir: &Path) -> Result<DevDirScan, HostError> {
    let entries = fs::read_dir(dir).map_err(|e| HostError::ReadDir(dir.to_owned(), e))?;
    let mut scan = DevDirScan::default();
    for entry in entries {
        let entry = entry.map_err(|e| HostError::ReadDir(dir.to_owned(), e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(minor) = gpu_minor_of_name(name).map_err(|m| HostError::BadName(entry.path(), m))? {
            scan.gpus.push((minor, char_node(dir, name)?));
        } else if PASSTHROUGH.contains(&name) {
            scan.passthrough.push(char_node(dir, name)?);
        }
    }
    let caps = dir.join(CAPS_DIR);
    if fs::symlink_metadata(&caps).is_ok_and(|m| m.is_dir()) {
        let entries = fs::read_dir(&caps).map_err(|e| HostError::ReadDir(caps.clone(), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| HostError::ReadDir(caps.clone(), e))?;
            if let Some(name) = entry.file_name().to_str().filter(|n| n.starts_with("nvidia-cap")) {
                scan.passthrough.push(char_node(dir, &format!("{CAPS_DIR}/{name}"))?);
            }
        }
    }
    scan.gpus.sort_by_key(|(minor, _)| *minor);
    scan.passthrough.sort_by(|a, b| a.rel_path.cmp(&b.rel_path));
    Ok(scan)
}

/// `lstat`s `dir/rel` and takes it only if it is a char device.
fn char_node(dir: &Path, rel: &str) -> Result<HostNode, HostError> {
    let path = dir.join(rel);
    let meta = fs::symlink_metadata(&path).map_err(|e| HostError::Stat(path.clone(), e))?;
    let ft = meta.file_type();
    if !ft.is_char_device() {
        let kind = files::describe(ft);
        return Err(HostError::NotCharDevice(path, kind));
    }
    Ok(HostNode {
        rel_path: rel.to_owned(),
        rdev: Rdev::from_raw(meta.rdev()),
        access: Access { mode: meta.mode() & 0o7777, uid: meta.uid(), gid: meta.gid() },
    })
}

/// Reads what `<root>/proc/driver/nvidia/gpus/*/information` and
/// `<root>/sys/bus/pci/devices/<bus>/{vendor,device}` say. Best effort: what is missing or
/// unreadable is left out.
pub fn read_host_facts(root: &Path) -> HostFacts {
    let gpus_dir = root.join("proc/driver/nvidia/gpus");
    let mut gpu_info: Vec<GpuInfo> = fs::read_dir(&gpus_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| files::read_small_text(&e.path().join("information"), INFO_LIMIT))
        .map(|text| parse_information(&text))
        .collect();
    for info in &mut gpu_info {
        if let Some(bus) = &info.bus {
            let pci_dir = root.join("sys/bus/pci/devices").join(bus.to_ascii_lowercase());
            let read_hex = |f: &str| files::read_small_text(&pci_dir.join(f), INFO_LIMIT).and_then(|s| parse_hex(&s));
            info.pci = read_hex("vendor").zip(read_hex("device"));
        }
    }
    HostFacts { gpu_info, has_kcore: root.join("proc/kcore").exists() }
}

/// Parses the driver's `information` file (`Key: value` lines).
pub fn parse_information(text: &str) -> GpuInfo {
    let mut info = GpuInfo::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        match key.trim() {
            "Device Minor" => info.minor = value.parse().ok(),
            "GPU UUID" if !value.is_empty() => info.uuid = Some(value.to_owned()),
            "Bus Location" if !value.is_empty() => info.bus = Some(value.to_owned()),
            _ => {}
        }
    }
    info
}

fn parse_hex(s: &str) -> Option<u32> {
    let s = s.trim();
    u32::from_str_radix(s.strip_prefix("0x").unwrap_or(s), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: only `nvidia` + ASCII digits is a GPU name; gVisor's `\d` is ASCII, Rust's is not.
    #[test]
    fn gpu_names_are_ascii_digits_only() {
        assert_eq!(gpu_minor_of_name("nvidia0"), Ok(Some(0)));
        assert_eq!(gpu_minor_of_name("nvidia247"), Ok(Some(247)));
        assert_eq!(gpu_minor_of_name("nvidiactl"), Ok(None));
        assert_eq!(gpu_minor_of_name("nvidia-1"), Ok(None));
        assert_eq!(gpu_minor_of_name("nvidia\u{0663}"), Ok(None));
        assert_eq!(gpu_minor_of_name("nvidia"), Ok(None));
    }

    /// Rule: a matched number above 247 is an error, not a skip (as in gVisor).
    #[test]
    fn gpu_name_over_max_or_huge_is_an_error() {
        assert!(gpu_minor_of_name("nvidia248").unwrap_err().contains("over 247"));
        assert!(gpu_minor_of_name("nvidia12345678901234567890").unwrap_err().contains("out of range"));
        assert!(gpu_minor_of_name("nvidia01").unwrap_err().contains("leading zero"));
    }

    /// The driver's information file gives minor, uuid and bus.
    #[test]
    fn parses_driver_information() {
        let text =
            "Model: \t\t NVIDIA A100\nGPU UUID: \t GPU-5b2c\nBus Location: \t 0000:3B:00.0\nDevice Minor: \t 3\n";
        let info = parse_information(text);
        assert_eq!(info.minor, Some(3));
        assert_eq!(info.uuid.as_deref(), Some("GPU-5b2c"));
        assert_eq!(info.bus.as_deref(), Some("0000:3B:00.0"));
        assert_eq!(parse_hex("0x10de\n"), Some(0x10de));
    }
}
