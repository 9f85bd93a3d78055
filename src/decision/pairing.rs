//! What every family's pairing shares: `--device-map`'s entries ([`MapPair`], which
//! `family::table::parse_device_map` reads, each side in the form of its family), which
//! rules pair what it leaves ([`Rule`]), which rule paired a GPU ([`By`]), and why devices cannot
//! be paired ([`PairingError`]). NVIDIA's pairing is `family::nvidia::pairing`, AMD's
//! `family::amd::pairing`.
//!
//! Pure. A UUID is an identity only when well formed (`GPU-` and 8-4-4-4-12 hex digits).

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

pub(crate) fn pci_text((vendor, device): (u32, u32)) -> String {
    format!("{vendor:04x}:{device:04x}")
}
