//! What every family's pairing shares: `--device-map`'s entries ([`parse_device_map`]), which
//! rules pair what it leaves ([`Rule`]), which rule paired a GPU ([`By`]), and why devices cannot
//! be paired ([`PairingError`]). NVIDIA's pairing is `family::nvidia::pairing`, AMD's
//! `family::amd::pairing`.
//!
//! Pure. A UUID is an identity only when well formed (`GPU-` and 8-4-4-4-12 hex digits).

use crate::family::nvidia::is_gpu_uuid;
use std::fmt;
use thiserror::Error;


/// A device named on the command line: by minor or by `GPU-` UUID, or an AMD render node
/// (`renderD<N>`, paired in `family::amd::plan`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DeviceRef {
    Minor(u32),
    Uuid(String),
    Render(u32),
}

impl fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRef::Minor(m) => write!(f, "{m}"),
            DeviceRef::Uuid(u) => f.write_str(u),
            DeviceRef::Render(m) => write!(f, "renderD{m}"),
        }
    }
}

/// One `OLD=NEW` of `--device-map`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapPair {
    pub old: DeviceRef,
    pub new: DeviceRef,
}

/// Which rules pair what `--device-map` leaves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Rule {
    /// A saved GPU whose UUID a restored GPU has pairs with it; the rest by position.
    #[default]
    IdentityFirst,
    /// gVisor's rule exactly: by position only.
    Positional,
}

/// Which rule paired a saved GPU, as `plan --json` says it (`"by"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum By {
    /// Its UUID is the restored GPU's: the same GPU.
    Uuid,
    /// The i-th saved GPU left, with the i-th restored GPU left.
    #[default]
    Position,
    /// `--device-map`.
    Explicit,
}

impl By {
    pub fn as_str(self) -> &'static str {
        match self {
            By::Uuid => "uuid",
            By::Position => "position",
            By::Explicit => "explicit",
        }
    }
}

/// Why saved and restored devices cannot be paired.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PairingError {
    #[error("can't remap {saved} saved devices to {restored} restored devices")]
    Count { saved: usize, restored: usize },
    #[error("{side} devices are not homogeneous: {first} is {first_pci} but {other} is {other_pci}")]
    Heterogeneous { side: &'static str, first: String, first_pci: String, other: String, other_pci: String },
    #[error("saved device nvidia{minor} has subdevice_instance {instance}; only 0 can be remapped")]
    Subdevice { minor: u32, instance: u32 },
    #[error("invalid --device-map entry {entry:?}: {what}")]
    BadMapEntry { entry: String, what: &'static str },
    #[error("{side} device {reference} is not among the {side} devices")]
    Unknown { side: &'static str, reference: DeviceRef },
    #[error("{side} device {reference} is paired twice")]
    Claimed { side: &'static str, reference: DeviceRef },
    #[error("no checkpoint was given (--metadata), so there are no saved devices to pair")]
    NoCheckpoint,
}

/// Parses one `--device-map` value: `OLD=NEW[,OLD=NEW...]`, each a minor or a `GPU-` UUID.
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
                    if !is_gpu_uuid(s) {
                        return Err(bad("a GPU- UUID is GPU- and 8-4-4-4-12 hex digits"));
                    }
                    Ok(DeviceRef::Uuid(s.to_owned()))
                } else if s.starts_with("renderD") {
                    crate::family::amd::render_minor_of_name(s)
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

pub(crate) fn pci_text((vendor, device): (u32, u32)) -> String {
    format!("{vendor:04x}:{device:04x}")
}
