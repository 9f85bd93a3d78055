//! The restore host's devices: the `nvidiaN` nodes of a device directory, the NVIDIA nodes that
//! pass through unchanged, and what the driver's `/proc` and `/sys` files tell of each GPU.
//!
//! This is an I/O edge. Assumptions: the device directory is read through one open descriptor,
//! so a scan sees one directory even while a symlink to it is flipped; entries are examined
//! with `lstat` and never followed, so a symlink under a GPU name is refused rather than
//! resolved; only char devices count; the N of
//! `nvidiaN` is ASCII digits (Rust's `\d` would take any Unicode digit, gVisor's does not).
//! Missing driver files are not errors: a GPU is still served without its uuid or PCI ids; nor
//! are driver files that are not small regular files, which are skipped unread (one over
//! [`INFO_LIMIT`] with a warning, since it is no file the driver writes). A `GPU UUID` that is
//! not a well-formed UUID (the driver prints `GPU-????????-????-????-????-????????????` when it
//! cannot read one) is unknown, never an identity.

use crate::device::{Access, MAX_DRIVER_VERSION_LEN, MAX_MODEL_LEN, MAX_REGULAR_MINOR, Rdev, fact_fault, is_gpu_uuid};
use crate::files::{self, SmallText};
use crate::limits;
use crate::visible::{bus_id, bus_name};
use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, fstatat};
use regex::Regex;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use thiserror::Error;

/// NVIDIA nodes that are served as they are on the host, never remapped. Their majors can be
/// dynamic (`nvidia-uvm`, `nvidia-caps`), so they are read again at every load.
const PASSTHROUGH: &[&str] = &["nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools"];
const CAPS_DIR: &str = "nvidia-caps";
/// The driver's files are a few hundred bytes; a larger one is not theirs and is skipped.
pub const INFO_LIMIT: u64 = 64 << 10;

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
    /// A well-formed `GPU-` UUID; `None` when the driver gave none or a placeholder.
    pub uuid: Option<String>,
    /// The PCI bus location (`Bus Location`, else the directory's name).
    pub bus: Option<String>,
    pub pci: Option<(u32, u32)>,
    /// `GPU Excluded: Yes` (`Blacklisted: Yes` before driver 450): not usable, not enumerated.
    pub excluded: bool,
    /// The `Model:` line (`NVIDIA H100 80GB HBM3`); `None` when absent or no fact
    /// ([`fact_fault`]).
    pub model: Option<String>,
}

/// Facts about the host beyond its GPU nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub gpu_info: Vec<GpuInfo>,
    /// The GPU directories (bus ids) under `proc/driver/nvidia/gpus` whose information file
    /// could not be read: GPUs the host has but whose facts are unknown.
    pub unread: Vec<String>,
    /// What a user should hear about the driver's files (an oversized file skipped).
    pub warnings: Vec<String>,
    /// The host has `/proc/kcore`, so runc would add the `core` symlink.
    pub has_kcore: bool,
    /// The driver's version (`570.86.15`), from `proc/driver/nvidia/version`; `None` when the
    /// file is missing or gives none.
    pub driver_version: Option<String>,
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
    #[error("{}: holds more than {} NVIDIA nodes", .0.display(), limits::MAX_NODES)]
    TooMany(PathBuf),
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
///
/// The directory is opened once (following `dir` itself if it is a symlink: the caller named
/// it), and its entries are listed and `lstat`ed through that one descriptor, as is
/// `nvidia-caps` (opened without following a symlink). A directory swapped while it is scanned
/// (a symlink flipped to another) cannot mix into the scan: it is all of the directory opened.
pub fn scan_dev_dir(dir: &Path) -> Result<DevDirScan, HostError> {
    let mut fd = Dir::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| HostError::ReadDir(dir.to_owned(), e.into()))?;
    let mut scan = DevDirScan::default();
    for name in entry_names(&mut fd, dir)? {
        if let Some(minor) = gpu_minor_of_name(&name).map_err(|m| HostError::BadName(dir.join(&name), m))? {
            scan.gpus.push((minor, char_node(&fd, dir, &name, name.clone())?));
        } else if PASSTHROUGH.contains(&name.as_str()) {
            scan.passthrough.push(char_node(&fd, dir, &name, name.clone())?);
        }
    }
    let caps = dir.join(CAPS_DIR);
    let no_follow = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match Dir::openat(&fd, CAPS_DIR, no_follow, Mode::empty()) {
        Ok(mut caps_fd) => {
            for name in entry_names(&mut caps_fd, &caps)?.into_iter().filter(|n| n.starts_with("nvidia-cap")) {
                let rel = format!("{CAPS_DIR}/{name}");
                scan.passthrough.push(char_node(&caps_fd, dir, &name, rel)?);
            }
        }
        // None there, or not a directory (a symlink is never followed): no caps.
        Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => {}
        Err(e) => return Err(HostError::ReadDir(caps, e.into())),
    }
    if scan.gpus.len() + scan.passthrough.len() > limits::MAX_NODES {
        return Err(HostError::TooMany(dir.to_owned()));
    }
    scan.gpus.sort_by_key(|(minor, _)| *minor);
    scan.passthrough.sort_by(|a, b| a.rel_path.cmp(&b.rel_path));
    Ok(scan)
}

/// The names of the entries of an open directory that may be GPU or NVIDIA nodes: UTF-8 names
/// starting `nvidia`, at most one more than [`limits::MAX_NODES`] of them.
fn entry_names(fd: &mut Dir, path: &Path) -> Result<Vec<String>, HostError> {
    let mut names = Vec::new();
    for entry in fd.iter() {
        let entry = entry.map_err(|e| HostError::ReadDir(path.to_owned(), e.into()))?;
        if let Some(name) = entry.file_name().to_str().ok().filter(|n| n.starts_with("nvidia")) {
            names.push(name.to_owned());
            if names.len() > limits::MAX_NODES {
                return Err(HostError::TooMany(path.to_owned()));
            }
        }
    }
    Ok(names)
}

/// `lstat`s `name` in the open directory `fd` and takes it only if it is a char device; it is
/// served as `rel` (its path under `dir`, which messages name).
fn char_node(fd: &Dir, dir: &Path, name: &str, rel: String) -> Result<HostNode, HostError> {
    let path = || dir.join(&rel);
    let st = fstatat(fd, name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(|e| HostError::Stat(path(), e.into()))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFCHR {
        return Err(HostError::NotCharDevice(path(), files::describe(st.st_mode)));
    }
    Ok(HostNode {
        rel_path: rel,
        rdev: Rdev::from_raw(st.st_rdev),
        access: Access { mode: st.st_mode & 0o7777, uid: st.st_uid, gid: st.st_gid },
    })
}

/// Reads what `<root>/proc/driver/nvidia/gpus/*/information` and
/// `<root>/sys/bus/pci/devices/<bus>/{vendor,device}` say. Best effort: what is missing or
/// unreadable is left out, a file over [`INFO_LIMIT`] with a warning.
pub fn read_host_facts(root: &Path) -> HostFacts {
    let mut facts = HostFacts { has_kcore: root.join("proc/kcore").exists(), ..HostFacts::default() };
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
            let mut read_hex = |f: &str| small_text(&pci_dir.join(f), &mut facts.warnings).and_then(|s| parse_hex(&s));
            info.pci = read_hex("vendor").zip(read_hex("device"));
        }
        facts.gpu_info.push(info);
    }
    facts
}

/// A driver file's text, if it is a small regular file; a larger one is skipped with a warning.
fn small_text(path: &Path, warnings: &mut Vec<String>) -> Option<String> {
    match files::read_small_text(path, INFO_LIMIT) {
        SmallText::Text(text) => Some(text),
        SmallText::TooLarge => {
            warnings.push(format!(
                "{}: larger than {} KiB, not a driver file; skipped",
                path.display(),
                INFO_LIMIT >> 10
            ));
            None
        }
        SmallText::Unreadable => None,
    }
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
        let facts = read_host_facts(&root);
        assert_eq!(facts.gpu_info.len(), 2);
        assert!(facts.gpu_info.iter().all(|g| g.pci.is_none()), "{:?}", facts.gpu_info);

        write(&root.join("proc/driver/nvidia/gpus/0000:3b:00.0/information"), "Bus Location: \t 0000:3B:00.0\n");
        write(&root.join("sys/bus/pci/devices/0000:3b:00.0/vendor"), "0x10de\n");
        write(&root.join("sys/bus/pci/devices/0000:3b:00.0/device"), "0x2330\n");
        let facts = read_host_facts(&root);
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
        assert_eq!(read_host_facts(tmp.path()).driver_version.as_deref(), Some("535.129.03"));
    }

    /// Bug (issue 10.3): the placeholder the driver prints for an unreadable UUID is no UUID.
    #[test]
    fn placeholder_uuid_is_unknown() {
        let info = parse_information("GPU UUID: \t GPU-????????-????-????-????-????????????\nDevice Minor: \t 0\n");
        assert_eq!((info.uuid, info.minor), (None, Some(0)));
    }
}
