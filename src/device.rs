//! Device facts shared by every stage and every device family: node types, device numbers,
//! access, and the bounds on the facts a driver gives (model names, driver versions).

use std::fmt;

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
