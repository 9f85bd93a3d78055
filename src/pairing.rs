//! Pairing saved GPUs with restored ones: gVisor's rules, plus explicit pairs.
//!
//! Pure. Assumes both lists are sorted by minor (the metadata reader and the restore-side
//! discovery both sort), which makes the positional rule reproducible: a restore onto the same
//! set of GPUs is the identity. Explicit pairs (`--device-map`) are taken first; the positional
//! rule pairs what is left, in order. Each side is checked on its own ([`check_saved`],
//! [`check_restored`], [`check_count`]) so that the caller can name the input at fault. A UUID
//! is an identity only when well formed, on either side and in `--device-map`, and its hex
//! digits are compared ignoring case, as `NVIDIA_VISIBLE_DEVICES` compares them.

use crate::device::{RestoredGpu, is_gpu_uuid};
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

/// The saved side can be remapped: every `subdevice_instance` 0, one model (where known).
pub fn check_saved(saved: &[DeviceId]) -> Result<(), PairingError> {
    if let Some(d) = saved.iter().find(|d| d.subdevice_instance != 0) {
        return Err(PairingError::Subdevice { minor: d.minor, instance: d.subdevice_instance });
    }
    homogeneous("saved", saved.iter().filter_map(|d| Some((format!("nvidia{}", d.minor), d.pci()?))))
}

/// The restored side is one model (where the host tells). Only asked when something is to be
/// remapped: gVisor refuses mixed models then, and a host with two models serves fine
/// otherwise.
pub fn check_restored(restored: &[RestoredGpu]) -> Result<(), PairingError> {
    homogeneous("restored", restored.iter().filter_map(|g| Some((g.name(), g.pci?))))
}

/// There are at least as many restored GPUs as saved ones.
pub fn check_count(saved: &[DeviceId], restored: &[RestoredGpu]) -> Result<(), PairingError> {
    if saved.len() > restored.len() {
        return Err(PairingError::Count { saved: saved.len(), restored: restored.len() });
    }
    Ok(())
}

/// Pairs `saved` (sorted by minor) with `restored` (sorted by minor): explicit pairs, then by
/// position. The sides are checked by the caller ([`check_saved`], [`check_restored`]); the
/// count is checked again here since the positional rule depends on it.
pub fn pair(saved: &[DeviceId], restored: &[RestoredGpu], map: &[MapPair]) -> Result<Pairing, PairingError> {
    check_count(saved, restored)?;
    let mut new_of_old: Vec<Option<(usize, bool)>> = vec![None; saved.len()];
    let mut taken = BTreeSet::new();
    for p in map {
        let old = saved.iter().position(|d| match &p.old {
            DeviceRef::Minor(m) => d.minor == *m,
            DeviceRef::Uuid(u) => is_gpu_uuid(&d.uuid) && d.uuid.eq_ignore_ascii_case(u),
        });
        let old = old.ok_or_else(|| PairingError::Unknown { side: "saved", reference: p.old.clone() })?;
        let new = restored.iter().position(|g| match &p.new {
            DeviceRef::Minor(m) => g.minor == *m,
            DeviceRef::Uuid(u) => g.uuid.as_deref().is_some_and(|g| is_gpu_uuid(g) && g.eq_ignore_ascii_case(u)),
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
        .filter_map(|(old, slot)| {
            slot.map(|(i, explicit)| Pair { old: old.clone(), new: restored[i].clone(), explicit })
        })
        .collect();
    if let (Some(old_pci), Some(new)) = (saved.iter().find_map(DeviceId::pci), restored.iter().find_map(|g| g.pci))
        && old_pci != new
    {
        warnings.push(format!(
            "saved GPUs are {} but restored GPUs are {}: the checkpoint may not restore on this model",
            pci_text(old_pci),
            pci_text(new)
        ));
    }
    Ok(Pairing { pairs, warnings })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, Rdev};
    use proptest::prelude::*;

    fn saved(minor: u32) -> DeviceId {
        DeviceId {
            minor,
            pci_vendor_id: 0x10de,
            pci_device_id: 0x20b0,
            gpu_id: 0,
            device_instance: 0,
            subdevice_instance: 0,
            uuid: format!("GPU-0000aaaa-0000-0000-0000-{minor:012}"),
            ..Default::default()
        }
    }

    fn restored(minor: u32) -> RestoredGpu {
        RestoredGpu {
            minor,
            rdev: Rdev::new(195, minor),
            access: Access::DEVICE_DEFAULT,
            uuid: Some(format!("GPU-0000bbbb-0000-0000-0000-{minor:012}")),
            bus: None,
            pci: Some((0x10de, 0x20b0)),
            model: None,
        }
    }

    fn minors(p: &Pairing) -> Vec<(u32, u32)> {
        p.pairs.iter().map(|p| (p.old.minor, p.new.minor)).collect()
    }

    /// gVisor: the i-th saved device (by minor) pairs with the i-th restored; extras stay unpaired.
    #[test]
    fn positional_pairing_in_minor_order() {
        let p = pair(&[saved(0), saved(1)], &[restored(2), restored(5), restored(7)], &[]).unwrap();
        assert_eq!(minors(&p), vec![(0, 2), (1, 5)]);
        assert!(p.pairs.iter().all(|p| !p.explicit));
    }

    /// gVisor: more saved than restored is an error, with gVisor's wording.
    #[test]
    fn more_saved_than_restored_is_an_error() {
        let err = pair(&[saved(0), saved(1), saved(2), saved(3)], &[restored(0), restored(1)], &[]).unwrap_err();
        assert_eq!(err.to_string(), "can't remap 4 saved devices to 2 restored devices");
    }

    /// gVisor: no saved devices, no remapping, whatever is restored.
    #[test]
    fn no_saved_devices_no_pairs() {
        assert!(pair(&[], &[restored(0)], &[]).unwrap().pairs.is_empty());
    }

    /// gVisor: each side homogeneous, naming the differing devices; subdevice 0 only.
    #[test]
    fn homogeneity_and_subdevice() {
        let mut odd = saved(1);
        odd.pci_device_id = 0x2330;
        let err = check_saved(&[saved(0), odd]).unwrap_err().to_string();
        assert!(err.contains("nvidia0 is 10de:20b0 but nvidia1 is 10de:2330"), "{err}");
        let mut odd = restored(1);
        odd.pci = Some((0x10de, 0x2330));
        let err = check_restored(&[restored(0), odd]).unwrap_err().to_string();
        assert!(err.starts_with("restored devices are not homogeneous"), "{err}");
        let mut sub = saved(0);
        sub.subdevice_instance = 1;
        assert_eq!(check_saved(&[sub]), Err(PairingError::Subdevice { minor: 0, instance: 1 }));
    }

    /// Explicit pairs win over position; the rest pair positionally among what is left.
    #[test]
    fn explicit_pairs_win() {
        let map = parse_device_map("GPU-0000aaaa-0000-0000-0000-000000000000=GPU-0000bbbb-0000-0000-0000-000000000007")
            .unwrap();
        let p = pair(&[saved(0), saved(1)], &[restored(2), restored(5), restored(7)], &map).unwrap();
        assert_eq!(minors(&p), vec![(0, 7), (1, 2)]);
        assert!(p.pairs[0].explicit && !p.pairs[1].explicit);
        let map = parse_device_map("1=2,0=5").unwrap();
        let p = pair(&[saved(0), saved(1)], &[restored(2), restored(5)], &map).unwrap();
        assert_eq!(minors(&p), vec![(0, 5), (1, 2)]);
    }

    /// Saved devices without PCI ids (hand-written lists) are neither compared nor warned about.
    #[test]
    fn missing_pci_ids_are_unknown_not_zero() {
        let mut bare = saved(1);
        (bare.pci_vendor_id, bare.pci_device_id) = (0, 0);
        let p = pair(&[saved(0), bare.clone()], &[restored(0), restored(1)], &[]).unwrap();
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let p = pair(&[bare], &[restored(0)], &[]).unwrap();
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    }

    /// Explicit pairs naming unknown devices, or claiming one twice, are errors.
    #[test]
    fn explicit_pair_errors() {
        let s = [saved(0), saved(1)];
        let r = [restored(2), restored(5)];
        let run = |m: &str| pair(&s, &r, &parse_device_map(m).unwrap()).unwrap_err();
        assert!(matches!(run("9=2"), PairingError::Unknown { side: "saved", .. }));
        assert!(matches!(
            run("0=GPU-0000cccc-0000-0000-0000-000000000000"),
            PairingError::Unknown { side: "restored", .. }
        ));
        assert!(matches!(run("0=2,1=2"), PairingError::Claimed { side: "restored", .. }));
        assert!(matches!(run("0=2,0=5"), PairingError::Claimed { side: "saved", .. }));
        for bad in ["", "0", "a=1", "0=GPU-", "1=2,", "99999999999=1", "0=GPU-nope"] {
            assert!(parse_device_map(bad).is_err(), "{bad:?}");
        }
    }

    /// Bug (found from outside): `--device-map` compared UUIDs byte for byte, so a UUID
    /// typed in upper case was "not among the restored devices" though the host had it, while
    /// NVIDIA_VISIBLE_DEVICES takes either case. A UUID's hex digits match in either case.
    #[test]
    fn device_map_uuids_match_in_either_case() {
        let map = parse_device_map("GPU-0000AAAA-0000-0000-0000-000000000001=GPU-0000BBBB-0000-0000-0000-000000000005")
            .unwrap();
        let p = pair(&[saved(0), saved(1)], &[restored(2), restored(5)], &map).unwrap();
        assert_eq!(minors(&p), vec![(0, 2), (1, 5)]);
        assert!(p.pairs[1].explicit);
    }

    /// Bug (issue 10.3): a placeholder or malformed UUID is no identity: `--device-map` naming
    /// one is refused with a reason, and two GPUs carrying the placeholder match nothing.
    #[test]
    fn malformed_uuids_are_no_identity() {
        let placeholder = "GPU-????????-????-????-????-????????????";
        let err = parse_device_map(&format!("0={placeholder}")).unwrap_err().to_string();
        assert!(err.contains("placeholder for a UUID it cannot read; name the GPU by its minor"), "{err}");
        let err = parse_device_map("GPU-5b2c=1").unwrap_err().to_string();
        assert!(err.contains("8-4-4-4-12 hex digits"), "{err}");
        // A restored GPU whose uuid is malformed (never made so by the parsers, but a
        // hand-built list) is not found by a UUID that equals it.
        let mut odd = restored(2);
        odd.uuid = Some("GPU-5b2c".into());
        let map = vec![MapPair { old: DeviceRef::Minor(0), new: DeviceRef::Uuid("GPU-5b2c".into()) }];
        assert!(matches!(pair(&[saved(0)], &[odd], &map), Err(PairingError::Unknown { side: "restored", .. })));
    }

    fn minor_set(max: usize) -> impl Strategy<Value = Vec<u32>> {
        proptest::collection::btree_set(0u32..=247, 0..max).prop_map(|s| s.into_iter().collect())
    }

    proptest! {
        /// Property: the pairing is injective and maps saved devices to restored devices only.
        #[test]
        fn pairing_is_injective_onto_restored(old in minor_set(8), new in minor_set(12), seed in any::<u64>()) {
            let s: Vec<_> = old.iter().copied().map(saved).collect();
            let r: Vec<_> = new.iter().copied().map(restored).collect();
            // Some explicit pairs, drawn from the sets so they are valid.
            let k = (seed as usize) % (s.len().min(r.len()) + 1);
            let map: Vec<MapPair> = (0..k).map(|i| MapPair {
                old: DeviceRef::Minor(s[i].minor),
                new: DeviceRef::Minor(r[r.len() - 1 - i].minor),
            }).collect();
            match pair(&s, &r, &map) {
                Err(PairingError::Count { .. }) => prop_assert!(s.len() > r.len()),
                Err(e) => prop_assert!(false, "unexpected {e}"),
                Ok(p) => {
                    prop_assert_eq!(p.pairs.len(), s.len());
                    let targets: BTreeSet<u32> = p.pairs.iter().map(|p| p.new.minor).collect();
                    prop_assert_eq!(targets.len(), p.pairs.len());
                    prop_assert!(targets.iter().all(|m| new.contains(m)));
                    for m in &map {
                        let DeviceRef::Minor(o) = m.old else { unreachable!() };
                        let DeviceRef::Minor(n) = m.new else { unreachable!() };
                        prop_assert!(p.pairs.iter().any(|p| p.old.minor == o && p.new.minor == n));
                    }
                }
            }
        }

        /// Property: a restore onto the same set of GPUs is the identity.
        #[test]
        fn same_set_is_identity(set in minor_set(12)) {
            let s: Vec<_> = set.iter().copied().map(saved).collect();
            let r: Vec<_> = set.iter().copied().map(restored).collect();
            let p = pair(&s, &r, &[]).unwrap();
            prop_assert!(p.pairs.iter().all(|p| p.old.minor == p.new.minor));
        }
    }
}
