//! NVIDIA's side of the named checks (see [`crate::decision::checks`]): each a function from
//! the saved GPUs, the restored GPUs and their pairs to one [`CheckResult`], on gVisor's rules
//! (at least as many restored GPUs as saved, one model on each side) and the driver's facts.
//!
//! Pure. A fact unknown on either side passes, and the detail says it was not compared.

use super::RestoredGpu;
use super::metadata::DeviceId;
use super::pairing::{self, Pair};
use crate::decision::checks::{CheckName, CheckResult, access_text, widens};
use crate::decision::pairing::pci_text;
use std::collections::BTreeSet;

/// `count`: at least as many restored GPUs as saved ones.
pub fn count(saved: &[DeviceId], restored: &[RestoredGpu], relax: &BTreeSet<CheckName>) -> CheckResult {
    let outcome = match pairing::check_count(saved, restored) {
        Ok(()) => Ok(format!("{} saved GPUs, {} restored", saved.len(), restored.len())),
        Err(e) => Err(e.to_string()),
    };
    CheckResult::new(CheckName::Count, relax, outcome)
}

/// Which side a failed `mixed` check is about: the saved side is the checkpoint's, the
/// restored side the host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Saved,
    Restored,
}

/// `mixed`: one model per side, where the PCI ids are known; the restored side only when
/// something is to be remapped (gVisor refuses mixed models then, and a host with two models
/// serves fine otherwise).
pub fn mixed(
    saved: &[DeviceId],
    restored: &[RestoredGpu],
    relax: &BTreeSet<CheckName>,
) -> (CheckResult, Option<Fault>) {
    let failed = match pairing::check_homogeneous(saved) {
        Err(e) => Some((Fault::Saved, e)),
        Ok(()) if !saved.is_empty() => pairing::check_restored(restored).err().map(|e| (Fault::Restored, e)),
        Ok(()) => None,
    };
    match failed {
        Some((side, e)) => (CheckResult::new(CheckName::Mixed, relax, Err(e.to_string())), Some(side)),
        None => (CheckResult::new(CheckName::Mixed, relax, Ok("one model on each side".into())), None),
    }
}

/// `10de:2330 (NVIDIA H100 80GB HBM3)`, the model name where known.
fn model_text(pci: (u32, u32), model: Option<&String>) -> String {
    match model {
        Some(m) => format!("{} ({m})", pci_text(pci)),
        None => pci_text(pci),
    }
}

/// "all N compared", or how many of the pairs could be compared.
fn compared(n: usize, of: usize, what: &str) -> String {
    match (n, of) {
        (_, 0) => "nothing to compare: no saved GPUs".to_owned(),
        (0, _) => format!("not compared: {what} unknown on one side for every pair"),
        (n, of) if n == of => format!("{n} pairs compared"),
        (n, of) => format!("{n} of {of} pairs compared; {what} unknown on one side for the others"),
    }
}

/// `model`: each pair's saved and restored PCI ids are equal, where both are known.
pub fn model(pairs: &[Pair], relax: &BTreeSet<CheckName>) -> CheckResult {
    // Each pair with its saved and restored PCI ids (vendor, device).
    type Known<'a> = (&'a Pair, (u32, u32), (u32, u32));
    let known: Vec<Known> = pairs.iter().filter_map(|p| Some((p, p.old.pci()?, p.new.pci?))).collect();
    let outcome = match known.iter().find(|(_, old, new)| old != new) {
        Some((p, old, new)) => Err(format!(
            "saved nvidia{} is {}, restored {} is {}",
            p.old.minor,
            model_text(*old, p.old.model.as_ref()),
            p.new.name(),
            model_text(*new, p.new.model.as_ref())
        )),
        None => Ok(compared(known.len(), pairs.len(), "the PCI ids")),
    };
    CheckResult::new(CheckName::Model, relax, outcome)
}

/// `driver`: the driver version each saved GPU was recorded under is the restore host's,
/// where both are known.
pub fn driver(pairs: &[Pair], host: Option<&String>, relax: &BTreeSet<CheckName>) -> CheckResult {
    let known: Vec<(&Pair, &String, &String)> =
        pairs.iter().filter_map(|p| Some((p, p.old.driver_version.as_ref()?, host?))).collect();
    let outcome = match known.iter().find(|(_, old, new)| old != new) {
        Some((p, old, new)) => Err(format!(
            "saved nvidia{} was under driver {old}, restored {} is under driver {new}",
            p.old.minor,
            p.new.name()
        )),
        None => Ok(compared(known.len(), pairs.len(), "the driver version")),
    };
    CheckResult::new(CheckName::Driver, relax, outcome)
}

/// `mode`: no checkpoint name's recorded mode, uid and gid give more access than the node the
/// spec and host give the GPU it now opens. The metadata may come from anywhere, and is trusted
/// for nothing: it may keep a name as it was (CRIU compares the whole `st_mode` on reopening),
/// never open a GPU to someone the restore host does not.
pub fn mode(pairs: &[Pair], relax: &BTreeSet<CheckName>) -> CheckResult {
    let wider = pairs.iter().find(|p| widens(p.old.recorded.over(p.new.access), p.new.access));
    let outcome = match wider {
        Some(p) => Err(format!(
            "saved nvidia{} was recorded {}, more access than the {} that restored {} has here",
            p.old.minor,
            access_text(p.old.recorded.over(p.new.access)),
            access_text(p.new.access),
            p.new.name()
        )),
        None => Ok(format!("{} checkpoint names give no more access than their GPUs' nodes", pairs.len())),
    };
    CheckResult::new(CheckName::Mode, relax, outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::pairing::By;
    use crate::device::Access;
    use crate::device::Rdev;
    use crate::inputs::metadata::RecordedAccess;

    fn saved(minor: u32, pci: Option<(u32, u32)>) -> DeviceId {
        let (pci_vendor_id, pci_device_id) = pci.unwrap_or((0, 0));
        DeviceId { minor, pci_vendor_id, pci_device_id, ..DeviceId::default() }
    }

    fn restored(minor: u32, pci: Option<(u32, u32)>) -> RestoredGpu {
        RestoredGpu {
            minor,
            rdev: Rdev::new(195, minor),
            access: Access::DEVICE_DEFAULT,
            uuid: None,
            bus: None,
            pci,
            model: None,
        }
    }

    fn pair(old: DeviceId, new: RestoredGpu) -> Pair {
        Pair { old, new, by: By::Position }
    }

    const H100: Option<(u32, u32)> = Some((0x10de, 0x2330));
    const A100: Option<(u32, u32)> = Some((0x10de, 0x20b0));

    fn none() -> BTreeSet<CheckName> {
        BTreeSet::new()
    }

    fn relax(check: CheckName) -> BTreeSet<CheckName> {
        BTreeSet::from([check])
    }

    /// Rule (issue 20): `count` passes with at least as many restored as saved, fails with
    /// gVisor's message otherwise, and is never relaxed (parse_relax refuses it).
    #[test]
    fn count_check() {
        let c = count(&[saved(0, H100)], &[restored(2, H100), restored(3, H100)], &none());
        assert!(c.ok && !c.relaxed);
        assert_eq!(c.detail, "1 saved GPUs, 2 restored");
        let c = count(&[saved(0, H100), saved(1, H100)], &[restored(2, H100)], &none());
        assert!(c.refuses());
        assert_eq!(c.detail, "can't remap 2 saved devices to 1 restored devices");
    }

    /// Rule (issue 20): `mixed` passes one model per side, fails naming both GPUs and the side,
    /// warns when relaxed, and ignores GPUs whose PCI ids are unknown.
    #[test]
    fn mixed_check() {
        let (c, side) = mixed(&[saved(0, H100), saved(1, None)], &[restored(2, H100), restored(3, A100)], &none());
        assert_eq!((c.refuses(), side), (true, Some(Fault::Restored)));
        assert_eq!(c.detail, "restored devices are not homogeneous: nvidia2 is 10de:2330 but nvidia3 is 10de:20b0");
        let (c, side) = mixed(&[saved(0, H100), saved(1, A100)], &[], &relax(CheckName::Mixed));
        assert_eq!((c.ok, c.relaxed, c.refuses(), side), (false, true, false, Some(Fault::Saved)));
        let (c, side) = mixed(&[saved(0, H100), saved(1, None)], &[restored(2, H100), restored(3, None)], &none());
        assert_eq!((c.ok, side), (true, None));
        // Nothing saved: a host of two models serves.
        assert!(mixed(&[], &[restored(2, H100), restored(3, A100)], &none()).0.ok);
    }

    /// Rule (issue 20): `model` compares each pair's PCI ids; a failure names the GPUs, both ids
    /// and the model names where recorded; unknown on one side is not compared, and says so.
    #[test]
    fn model_check() {
        let same = [pair(saved(0, H100), restored(4, H100))];
        assert_eq!(model(&same, &none()).detail, "1 pairs compared");
        let mut old = saved(0, H100);
        old.model = Some("NVIDIA H100 80GB HBM3".into());
        let mut new = restored(4, A100);
        new.model = Some("NVIDIA A100-SXM4-80GB".into());
        let c = model(&[pair(old, new)], &none());
        assert!(c.refuses());
        assert_eq!(
            c.detail,
            "saved nvidia0 is 10de:2330 (NVIDIA H100 80GB HBM3), restored nvidia4 is 10de:20b0 (NVIDIA A100-SXM4-80GB)"
        );
        let c = model(&[pair(saved(0, H100), restored(4, A100))], &relax(CheckName::Model));
        assert!(!c.ok && c.relaxed && !c.refuses());
        assert_eq!(c.detail, "saved nvidia0 is 10de:2330, restored nvidia4 is 10de:20b0");
        let unknown = [pair(saved(0, None), restored(4, A100)), pair(saved(1, H100), restored(5, None))];
        let c = model(&unknown, &none());
        assert!(c.ok);
        assert_eq!(c.detail, "not compared: the PCI ids unknown on one side for every pair");
        assert_eq!(model(&[], &none()).detail, "nothing to compare: no saved GPUs");
    }

    /// Rule (issue 20): `driver` compares the recorded version with the host's; a failure names
    /// the GPUs and both versions; unknown on either side (a gVisor list, a host without the
    /// driver's version file) is not compared.
    #[test]
    fn driver_check() {
        let mut old = saved(0, H100);
        old.driver_version = Some("535.129.03".into());
        let p = [pair(old.clone(), restored(4, H100)), pair(saved(1, H100), restored(5, H100))];
        let host = |v: &str| Some(v.to_owned());
        let c = driver(&p, host("535.129.03").as_ref(), &none());
        assert!(c.ok);
        assert_eq!(c.detail, "1 of 2 pairs compared; the driver version unknown on one side for the others");
        let c = driver(&p, host("570.86.15").as_ref(), &none());
        assert!(c.refuses());
        assert_eq!(c.detail, "saved nvidia0 was under driver 535.129.03, restored nvidia4 is under driver 570.86.15");
        assert!(!driver(&p, host("570.86.15").as_ref(), &relax(CheckName::Driver)).refuses());
        assert!(driver(&p, None, &none()).ok, "a host that tells no version");
    }

    /// Rule (issue 20): `mode` refuses a recorded mode or owner that opens the GPU to someone the
    /// restore host's node does not (the security.md case: 0600 root-only made 0666, or given to
    /// uid 65534), and passes one that keeps or narrows access; relaxed, it warns.
    #[test]
    fn mode_check() {
        let with = |mode: Option<u32>, uid: Option<u32>, gid: Option<u32>, base: Access| {
            let mut old = saved(0, H100);
            old.recorded = RecordedAccess { mode, uid, gid };
            let mut new = restored(4, H100);
            new.access = base;
            [pair(old, new)]
        };
        let root_only = Access { mode: 0o600, uid: 0, gid: 0 };
        let c = mode(&with(Some(0o666), None, None, root_only), &none());
        assert!(c.refuses());
        assert_eq!(
            c.detail,
            "saved nvidia0 was recorded 0666 0:0, more access than the 0600 0:0 that restored nvidia4 has here"
        );
        assert!(mode(&with(Some(0o600), Some(65534), None, root_only), &none()).refuses());
        assert!(mode(&with(None, None, Some(44), Access { mode: 0o660, uid: 0, gid: 0 }), &none()).refuses());
        assert!(!mode(&with(Some(0o666), None, None, root_only), &relax(CheckName::Mode)).refuses());
        // Kept or narrowed: the same, 0666 to 0660 or 0600, any owner of an 0666 node.
        let open = Access::DEVICE_DEFAULT;
        for (m, u, g) in [(None, None, None), (Some(0o660), None, None), (Some(0o600), Some(1000), Some(1000))] {
            assert!(mode(&with(m, u, g, open), &none()).ok, "{m:?} {u:?} {g:?}");
        }
        assert!(mode(&with(Some(0o660), None, Some(44), Access { mode: 0o660, uid: 0, gid: 44 }), &none()).ok);
        assert!(mode(&[], &none()).ok);
    }
}
