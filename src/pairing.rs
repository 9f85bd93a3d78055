//! Pairing saved GPUs with restored ones: gVisor's rules, plus explicit pairs.
//!
//! Pure. Assumes both lists are sorted by minor (the metadata reader and the restore-side
//! discovery both sort), which makes the positional rule reproducible: a restore onto the same
//! set of GPUs is the identity. Explicit pairs (`--device-map`) are taken first; the positional
//! rule pairs what is left, in order.

use crate::device::RestoredGpu;
use crate::metadata::DeviceId;
use std::collections::BTreeSet;
use std::fmt;
use thiserror::Error;

/// A device named on the command line: by minor or by `GPU-` UUID.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DeviceRef {
    Minor(u32),
    Uuid(String),
}

impl fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRef::Minor(m) => write!(f, "{m}"),
            DeviceRef::Uuid(u) => f.write_str(u),
        }
    }
}

/// One `OLD=NEW` of `--device-map`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapPair {
    pub old: DeviceRef,
    pub new: DeviceRef,
}

/// A saved GPU and the restored GPU it now means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub old: DeviceId,
    pub new: RestoredGpu,
    /// Chosen by `--device-map` rather than by position.
    pub explicit: bool,
}

/// The pairs, sorted by saved minor, and what is worth telling the user.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pairing {
    pub pairs: Vec<Pair>,
    pub warnings: Vec<String>,
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
    #[error("--device-map names {side} device {reference}, which is not among the {side} devices")]
    Unknown { side: &'static str, reference: DeviceRef },
    #[error("--device-map pairs {side} device {reference} twice")]
    Claimed { side: &'static str, reference: DeviceRef },
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
                if s.starts_with("GPU-") && s.len() > 4 {
                    Ok(DeviceRef::Uuid(s.to_owned()))
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

fn pci_text((vendor, device): (u32, u32)) -> String {
    format!("{vendor:04x}:{device:04x}")
}

/// Checks that every device with known PCI ids has the same ones.
fn homogeneous<'a>(
    side: &'static str,
    devices: impl Iterator<Item = (String, (u32, u32))> + 'a,
) -> Result<(), PairingError> {
    let mut first: Option<(String, (u32, u32))> = None;
    for (name, pci) in devices {
        match &first {
            None => first = Some((name, pci)),
            Some((first_name, first_pci)) if *first_pci != pci => {
                return Err(PairingError::Heterogeneous {
                    side,
                    first: first_name.clone(),
                    first_pci: pci_text(*first_pci),
                    other: name,
                    other_pci: pci_text(pci),
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Pairs `saved` (sorted by minor) with `restored` (sorted by minor).
pub fn pair(
    saved: &[DeviceId],
    restored: &[RestoredGpu],
    map: &[MapPair],
) -> Result<Pairing, PairingError> {
    if saved.len() > restored.len() {
        return Err(PairingError::Count { saved: saved.len(), restored: restored.len() });
    }
    if let Some(d) = saved.iter().find(|d| d.subdevice_instance != 0) {
        return Err(PairingError::Subdevice { minor: d.minor, instance: d.subdevice_instance });
    }
    homogeneous("saved", saved.iter().map(|d| (format!("nvidia{}", d.minor), (d.pci_vendor_id, d.pci_device_id))))?;
    homogeneous("restored", restored.iter().filter_map(|g| Some((g.name(), g.pci?))))?;

    let mut new_of_old: Vec<Option<(usize, bool)>> = vec![None; saved.len()];
    let mut taken = BTreeSet::new();
    for p in map {
        let old = saved.iter().position(|d| match &p.old {
            DeviceRef::Minor(m) => d.minor == *m,
            DeviceRef::Uuid(u) => d.uuid == *u,
        });
        let old = old.ok_or_else(|| PairingError::Unknown { side: "saved", reference: p.old.clone() })?;
        let new = restored.iter().position(|g| match &p.new {
            DeviceRef::Minor(m) => g.minor == *m,
            DeviceRef::Uuid(u) => g.uuid.as_deref() == Some(u.as_str()),
        });
        let new = new.ok_or_else(|| PairingError::Unknown { side: "restored", reference: p.new.clone() })?;
        if new_of_old[old].is_some() {
            return Err(PairingError::Claimed { side: "saved", reference: p.old.clone() });
        }
        if !taken.insert(new) {
            return Err(PairingError::Claimed { side: "restored", reference: p.new.clone() });
        }
        new_of_old[old] = Some((new, true));
    }
    let mut free = (0..restored.len()).filter(|i| !taken.contains(i));
    for slot in new_of_old.iter_mut().filter(|s| s.is_none()) {
        // Enough are free: saved.len() <= restored.len() and each explicit pair took one of each.
        *slot = free.next().map(|i| (i, false));
    }

    let mut warnings = Vec::new();
    let pairs: Vec<Pair> = saved
        .iter()
        .zip(new_of_old)
        .filter_map(|(old, slot)| slot.map(|(i, explicit)| Pair { old: old.clone(), new: restored[i].clone(), explicit }))
        .collect();
    if let (Some(old), Some(new)) = (saved.first(), restored.iter().find_map(|g| g.pci)) {
        let old_pci = (old.pci_vendor_id, old.pci_device_id);
        if old_pci != new {
            warnings.push(format!(
                "saved GPUs are {} but restored GPUs are {}: the checkpoint may not restore on this model",
                pci_text(old_pci),
                pci_text(new)
            ));
        }
    }
    Ok(Pairing { pairs, warnings })
}
