//! Pairing saved NVIDIA GPUs with restored ones: gVisor's rules, plus explicit pairs.
//!
//! Pure. Assumes both lists are sorted by minor (the metadata reader and the restore-side
//! discovery both sort), which makes the positional rule reproducible: a restore onto the same
//! set of GPUs is the identity. Explicit pairs (`--device-map`) are taken first; then, unless
//! the rule is gVisor's [`Rule::Positional`], each saved GPU whose UUID is among the restored
//! GPUs pairs with itself (a GPU still there keeps its process, as NVIDIA's Dynamo Snapshot
//! does, instead of moving because another GPU left); the positional rule pairs what is left,
//! in order. Each side is checked on its own ([`check_subdevice`], [`check_homogeneous`],
//! [`check_restored`], [`check_count`]) so that the caller can name the input at fault. A UUID
//! is an identity only when well formed, on either side and in `--device-map`, and its hex
//! digits are compared ignoring case, as `NVIDIA_VISIBLE_DEVICES` compares them.

use super::metadata::DeviceId;
use super::{RestoredGpu, is_gpu_uuid};
use crate::decision::pairing::{By, DeviceRef, MapPair, PairingError, Rule, pci_text};
use std::collections::BTreeSet;

/// A saved GPU and the restored GPU it now means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub old: DeviceId,
    pub new: RestoredGpu,
    pub by: By,
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

/// The saved side can be remapped: every `subdevice_instance` 0.
pub fn check_subdevice(saved: &[DeviceId]) -> Result<(), PairingError> {
    match saved.iter().find(|d| d.subdevice_instance != 0) {
        Some(d) => Err(PairingError::Subdevice { minor: d.minor, instance: d.subdevice_instance }),
        None => Ok(()),
    }
}

/// The saved side is one model (where known).
pub fn check_homogeneous(saved: &[DeviceId]) -> Result<(), PairingError> {
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

/// Whether a saved and a restored GPU carry one well-formed UUID (its hex digits in either case).
fn same_uuid(old: &DeviceId, new: &RestoredGpu) -> bool {
    is_gpu_uuid(&old.uuid) && new.uuid.as_deref().is_some_and(|u| is_gpu_uuid(u) && u.eq_ignore_ascii_case(&old.uuid))
}

/// Pairs `saved` (sorted by minor) with `restored` (sorted by minor): explicit pairs, then (by
/// `rule`) by UUID, then by position; sorted by saved minor. The sides are checked by the
/// caller; the count is checked again here since the positional rule depends on it.
pub fn pair(
    saved: &[DeviceId],
    restored: &[RestoredGpu],
    map: &[MapPair],
    rule: Rule,
) -> Result<Vec<Pair>, PairingError> {
    check_count(saved, restored)?;
    let mut new_of_old: Vec<Option<(usize, By)>> = vec![None; saved.len()];
    let mut taken = BTreeSet::new();
    for p in map {
        let old = saved.iter().position(|d| match &p.old {
            DeviceRef::Minor(m) => d.minor == *m,
            DeviceRef::Uuid(u) => is_gpu_uuid(&d.uuid) && d.uuid.eq_ignore_ascii_case(u),
            DeviceRef::Render(_) => false,
        });
        let old = old.ok_or_else(|| PairingError::Unknown { side: "saved", reference: p.old.clone() })?;
        let new = restored.iter().position(|g| match &p.new {
            DeviceRef::Minor(m) => g.minor == *m,
            DeviceRef::Uuid(u) => g.uuid.as_deref().is_some_and(|g| is_gpu_uuid(g) && g.eq_ignore_ascii_case(u)),
            DeviceRef::Render(_) => false,
        });
        let new = new.ok_or_else(|| PairingError::Unknown { side: "restored", reference: p.new.clone() })?;
        if new_of_old[old].is_some() {
            return Err(PairingError::Claimed { side: "saved", reference: p.old.clone() });
        }
        if !taken.insert(new) {
            return Err(PairingError::Claimed { side: "restored", reference: p.new.clone() });
        }
        new_of_old[old] = Some((new, By::Explicit));
    }
    if rule == Rule::IdentityFirst {
        for (old, slot) in saved.iter().zip(new_of_old.iter_mut()).filter(|(_, s)| s.is_none()) {
            // UUIDs are unique on each side (the readers refuse a duplicate), so at most one.
            if let Some(new) = (0..restored.len()).find(|i| !taken.contains(i) && same_uuid(old, &restored[*i])) {
                taken.insert(new);
                *slot = Some((new, By::Uuid));
            }
        }
    }
    let mut free = (0..restored.len()).filter(|i| !taken.contains(i));
    for slot in new_of_old.iter_mut().filter(|s| s.is_none()) {
        // Enough are free: saved.len() <= restored.len() and each pair before took one of each.
        *slot = free.next().map(|i| (i, By::Position));
    }
    Ok(saved
        .iter()
        .zip(new_of_old)
        .filter_map(|(old, slot)| slot.map(|(i, by)| Pair { old: old.clone(), new: restored[i].clone(), by }))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, Rdev};
    use crate::family::table::parse_device_map;
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

    fn minors(p: &[Pair]) -> Vec<(u32, u32)> {
        p.iter().map(|p| (p.old.minor, p.new.minor)).collect()
    }

    /// gVisor: the i-th saved device (by minor) pairs with the i-th restored; extras stay unpaired.
    #[test]
    fn positional_pairing_in_minor_order() {
        let p =
            pair(&[saved(0), saved(1)], &[restored(2), restored(5), restored(7)], &[], Rule::IdentityFirst).unwrap();
        assert_eq!(minors(&p), vec![(0, 2), (1, 5)]);
        assert!(p.iter().all(|p| p.by == By::Position));
    }

    /// gVisor: more saved than restored is an error, with gVisor's wording.
    #[test]
    fn more_saved_than_restored_is_an_error() {
        let err =
            pair(&[saved(0), saved(1), saved(2), saved(3)], &[restored(0), restored(1)], &[], Rule::IdentityFirst)
                .unwrap_err();
        assert_eq!(err.to_string(), "can't remap 4 saved devices to 2 restored devices");
    }

    /// gVisor: no saved devices, no remapping, whatever is restored.
    #[test]
    fn no_saved_devices_no_pairs() {
        assert!(pair(&[], &[restored(0)], &[], Rule::IdentityFirst).unwrap().is_empty());
    }

    /// gVisor: each side homogeneous, naming the differing devices; subdevice 0 only.
    #[test]
    fn homogeneity_and_subdevice() {
        let mut odd = saved(1);
        odd.pci_device_id = 0x2330;
        let err = check_homogeneous(&[saved(0), odd]).unwrap_err().to_string();
        assert!(err.contains("nvidia0 is 10de:20b0 but nvidia1 is 10de:2330"), "{err}");
        let mut odd = restored(1);
        odd.pci = Some((0x10de, 0x2330));
        let err = check_restored(&[restored(0), odd]).unwrap_err().to_string();
        assert!(err.starts_with("restored devices are not homogeneous"), "{err}");
        let mut sub = saved(0);
        sub.subdevice_instance = 1;
        assert_eq!(check_subdevice(&[sub]), Err(PairingError::Subdevice { minor: 0, instance: 1 }));
    }

    /// Explicit pairs win over position; the rest pair positionally among what is left.
    #[test]
    fn explicit_pairs_win() {
        let map = parse_device_map("GPU-0000aaaa-0000-0000-0000-000000000000=GPU-0000bbbb-0000-0000-0000-000000000007")
            .unwrap();
        let p =
            pair(&[saved(0), saved(1)], &[restored(2), restored(5), restored(7)], &map, Rule::IdentityFirst).unwrap();
        assert_eq!(minors(&p), vec![(0, 7), (1, 2)]);
        assert_eq!((p[0].by, p[1].by), (By::Explicit, By::Position));
        let map = parse_device_map("1=2,0=5").unwrap();
        let p = pair(&[saved(0), saved(1)], &[restored(2), restored(5)], &map, Rule::IdentityFirst).unwrap();
        assert_eq!(minors(&p), vec![(0, 5), (1, 2)]);
    }

    /// Rule (issue 20): a saved GPU whose UUID a restored GPU has pairs with it (in either
    /// case), the rest by position among what is left; `Rule::Positional` is gVisor's rule
    /// exactly. Saved {0,1,2} on host {1,2,3} whose GPU 1 and 2 are saved 1 and 2 (GPU 0 left,
    /// 3 came): positionally every GPU moves, identity first only saved 0 does, onto 3.
    #[test]
    fn identity_first_against_positional() {
        let same = |minor: u32| {
            let mut g = restored(minor);
            g.uuid = Some(saved(minor).uuid.to_ascii_uppercase());
            g
        };
        let s = [saved(0), saved(1), saved(2)];
        let r = [same(1), same(2), restored(3)];
        let p = pair(&s, &r, &[], Rule::Positional).unwrap();
        assert_eq!(minors(&p), [(0, 1), (1, 2), (2, 3)]);
        assert!(p.iter().all(|p| p.by == By::Position));
        let p = pair(&s, &r, &[], Rule::IdentityFirst).unwrap();
        assert_eq!(minors(&p), [(0, 3), (1, 1), (2, 2)]);
        assert_eq!(p.iter().map(|p| p.by).collect::<Vec<_>>(), [By::Position, By::Uuid, By::Uuid]);
        // An explicit pair takes the GPU first: saved 0 onto host 1 leaves saved 1 to position.
        let p = pair(&s, &r, &parse_device_map("0=1").unwrap(), Rule::IdentityFirst).unwrap();
        assert_eq!(minors(&p), [(0, 1), (1, 3), (2, 2)]);
        assert_eq!(p.iter().map(|p| p.by).collect::<Vec<_>>(), [By::Explicit, By::Position, By::Uuid]);
        // A UUID that is no identity (empty) pairs by position.
        let mut bare = saved(1);
        bare.uuid.clear();
        let p = pair(&[saved(0), bare], &[restored(0), restored(1)], &[], Rule::IdentityFirst).unwrap();
        assert!(p.iter().all(|p| p.by == By::Position));
    }

    /// Explicit pairs naming unknown devices, or claiming one twice, are errors.
    #[test]
    fn explicit_pair_errors() {
        let s = [saved(0), saved(1)];
        let r = [restored(2), restored(5)];
        let run = |m: &str| pair(&s, &r, &parse_device_map(m).unwrap(), Rule::IdentityFirst).unwrap_err();
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
        let p = pair(&[saved(0), saved(1)], &[restored(2), restored(5)], &map, Rule::IdentityFirst).unwrap();
        assert_eq!(minors(&p), vec![(0, 2), (1, 5)]);
        assert_eq!(p[1].by, By::Explicit);
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
        assert!(matches!(
            pair(&[saved(0)], &[odd], &map, Rule::IdentityFirst),
            Err(PairingError::Unknown { side: "restored", .. })
        ));
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
            match pair(&s, &r, &map, Rule::IdentityFirst) {
                Err(PairingError::Count { .. }) => prop_assert!(s.len() > r.len()),
                Err(e) => prop_assert!(false, "unexpected {e}"),
                Ok(p) => {
                    prop_assert_eq!(p.len(), s.len());
                    let targets: BTreeSet<u32> = p.iter().map(|p| p.new.minor).collect();
                    prop_assert_eq!(targets.len(), p.len());
                    prop_assert!(targets.iter().all(|m| new.contains(m)));
                    for m in &map {
                        let DeviceRef::Minor(o) = m.old else { unreachable!() };
                        let DeviceRef::Minor(n) = m.new else { unreachable!() };
                        prop_assert!(p.iter().any(|p| p.old.minor == o && p.new.minor == n));
                    }
                }
            }
        }

        /// Property: identity first, every saved GPU whose UUID is restored pairs with it, and
        /// the pairing stays injective.
        #[test]
        fn identity_first_keeps_every_gpu_still_there(old in minor_set(8), new in minor_set(12)) {
            let s: Vec<_> = old.iter().copied().map(saved).collect();
            // Restored GPUs that share a minor with a saved one are that GPU.
            let r: Vec<_> = new.iter().map(|&m| {
                let mut g = restored(m);
                if old.contains(&m) { g.uuid = Some(saved(m).uuid); }
                g
            }).collect();
            if let Ok(p) = pair(&s, &r, &[], Rule::IdentityFirst) {
                let targets: BTreeSet<u32> = p.iter().map(|p| p.new.minor).collect();
                prop_assert_eq!(targets.len(), p.len());
                for p in &p {
                    prop_assert_eq!(p.by == By::Uuid, new.contains(&p.old.minor));
                    if p.by == By::Uuid { prop_assert_eq!(p.old.minor, p.new.minor); }
                }
            }
        }

        /// Property: a restore onto the same set of GPUs is the identity.
        #[test]
        fn same_set_is_identity(set in minor_set(12)) {
            let s: Vec<_> = set.iter().copied().map(saved).collect();
            let r: Vec<_> = set.iter().copied().map(restored).collect();
            let p = pair(&s, &r, &[], Rule::IdentityFirst).unwrap();
            prop_assert!(p.iter().all(|p| p.old.minor == p.new.minor));
        }
    }
}
