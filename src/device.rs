//! Device facts shared by every stage: node types, device numbers, and a restored GPU.
//!
//! Assumes Linux device numbering: a GPU's regular device is char 195:N with N <= 247
//! (`NV_MINOR_DEVICE_NUMBER_REGULAR_MAX`); minors above that belong to `nvidiactl` and friends.

use std::fmt;

/// The NVIDIA driver's character major (`NV_MAJOR_DEVICE_NUMBER`).
pub const NV_MAJOR: u32 = 195;
/// The largest minor of a regular GPU device (`NV_MINOR_DEVICE_NUMBER_REGULAR_MAX`).
pub const MAX_REGULAR_MINOR: u32 = 247;

/// The type of a special file in the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DevKind {
    Char,
    Block,
    Fifo,
}

impl DevKind {
    /// The name used in `plan --json` and the state file.
    pub fn as_str(self) -> &'static str {
        match self {
            DevKind::Char => "char",
            DevKind::Block => "block",
            DevKind::Fifo => "fifo",
        }
    }
}

/// A device number, as `stat` reports it in `st_rdev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Rdev {
    pub major: u32,
    pub minor: u32,
}

impl Rdev {
    pub const fn new(major: u32, minor: u32) -> Self {
        Rdev { major, minor }
    }

    /// Splits a raw `st_rdev` the way glibc's `major()`/`minor()` do.
    pub fn from_raw(raw: u64) -> Self {
        Rdev::new(libc::major(raw as libc::dev_t), libc::minor(raw as libc::dev_t))
    }

    /// The number as FUSE carries it (`fuse_attr.rdev`, the kernel's `new_encode_dev`).
    pub fn to_fuse(self) -> u32 {
        (self.minor & 0xff) | (self.major << 8) | ((self.minor & !0xff) << 12)
    }

    /// The number back from FUSE's encoding (the kernel's `new_decode_dev`).
    pub fn from_fuse(dev: u32) -> Self {
        Rdev::new((dev >> 8) & 0xfff, (dev & 0xff) | ((dev >> 12) & 0xfff00))
    }
}

impl fmt::Display for Rdev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// The permission bits and owner a node is served with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Access {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl Access {
    /// `rw-rw-rw-` root:root, runc's default for device nodes.
    pub const DEVICE_DEFAULT: Access = Access { mode: 0o666, uid: 0, gid: 0 };
    /// `rwxr-xr-x` root:root, for directories.
    pub const DIR_DEFAULT: Access = Access { mode: 0o755, uid: 0, gid: 0 };
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
        gpu_name(self.minor)
    }
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

/// The longest GPU model name taken, in bytes: NVML's `NVML_DEVICE_NAME_V2_BUFFER_SIZE` (96)
/// holds the driver's names with their NUL.
pub const MAX_MODEL_LEN: usize = 95;
/// The longest driver version taken, in bytes: NVML's `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`
/// (80) holds the driver's versions with their NUL.
pub const MAX_DRIVER_VERSION_LEN: usize = 79;

/// Why a recorded fact (a model name, a driver version) is no fact: it is compared and shown in
/// messages, so it must be short, non-empty text without control characters (a terminal escape
/// in a checkpoint must never reach an operator's screen). `None` when it is one.
pub fn fact_fault(text: &str, max: usize) -> Option<String> {
    if text.trim().is_empty() {
        Some("is empty".into())
    } else if text.len() > max {
        Some(format!("is {} bytes, longer than the {max} any driver writes", text.len()))
    } else if text.chars().any(char::is_control) {
        Some("holds a control character".into())
    } else {
        None
    }
}

/// `nvidia<minor>`, the device file name of a GPU minor.
pub fn gpu_name(minor: u32) -> String {
    format!("nvidia{minor}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel fact: FUSE carries rdev as `new_encode_dev`, which for majors below 4096 is the
    /// low 32 bits of glibc's `makedev`, minors above 255 included.
    #[test]
    fn fuse_rdev_encoding_matches_the_kernel() {
        for (major, minor) in [(1, 3), (195, 247), (195, 255), (511, 300), (4095, 1 << 19)] {
            let raw = libc::makedev(major, minor) as u64;
            assert_eq!(u64::from(Rdev::new(major, minor).to_fuse()), raw & 0xffff_ffff, "{major}:{minor}");
            assert_eq!(Rdev::from_raw(raw), Rdev::new(major, minor));
        }
    }

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

    /// Rule (issue 20): a fact is short, non-empty text without control characters.
    #[test]
    fn facts_are_short_printable_text() {
        assert_eq!(fact_fault("NVIDIA H100 80GB HBM3", MAX_MODEL_LEN), None);
        assert_eq!(fact_fault("", 8).as_deref(), Some("is empty"));
        assert_eq!(fact_fault("  ", 8).as_deref(), Some("is empty"));
        assert_eq!(fact_fault("123456789", 8).as_deref(), Some("is 9 bytes, longer than the 8 any driver writes"));
        assert_eq!(fact_fault("a\x1b[2J", 8).as_deref(), Some("holds a control character"));
        assert_eq!(fact_fault("a\u{85}", 8).as_deref(), Some("holds a control character"));
    }
}
