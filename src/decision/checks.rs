//! The named checks a restore must pass before anything is served: `count`, `mixed`, `model`,
//! `driver` and `mode`; each family evaluates its side of them, and [`merged`] makes one result
//! of every family's side.
//!
//! Pure. The systems that restore GPU processes refuse a restore that cannot work before it
//! starts, with a reason (CUDA restores only onto "the same chip type"; NVIDIA's Dynamo
//! Snapshot gates on model, count and driver; KEP-6274 pins the driver stack; CRIU's amdgpu
//! plugin compares the KFD properties), since one that starts anyway fails later inside the
//! driver with nothing that says why. A fact that is unknown on either side (a gVisor list has
//! no driver version, a host without driver files no PCI ids) passes, and the detail says it was
//! not compared: refusing the unknown would refuse every restore from gVisor's own checkpoints.
//! An operator may relax a check by name (it then warns); `count` cannot be, since a saved GPU
//! without a restored one has nowhere to go.

use crate::device::Access;
use std::collections::BTreeSet;
use std::fmt;
use thiserror::Error;

/// A check's name, as `--relax`, `devremap.io/relax` and `plan --json` write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckName {
    /// At least as many restored GPUs as saved ones.
    Count,
    /// One model on each side (gVisor's homogeneity rule).
    Mixed,
    /// Each pair's saved and restored PCI ids are equal.
    Model,
    /// The saved driver version is the restore host's.
    Driver,
    /// A checkpoint name's recorded mode and owner give no more access than the restored node.
    Mode,
}

impl CheckName {
    /// Every check, in the order they are evaluated and listed.
    pub const ALL: [CheckName; 5] =
        [CheckName::Count, CheckName::Mixed, CheckName::Model, CheckName::Driver, CheckName::Mode];

    pub fn as_str(self) -> &'static str {
        match self {
            CheckName::Count => "count",
            CheckName::Mixed => "mixed",
            CheckName::Model => "model",
            CheckName::Driver => "driver",
            CheckName::Mode => "mode",
        }
    }
}

impl fmt::Display for CheckName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a `--relax` value (or the `devremap.io/relax` annotation) was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChecksError {
    #[error("unknown check {0:?}: the checks are count, mixed, model, driver and mode")]
    Unknown(String),
    #[error("count cannot be relaxed: a saved GPU without a restored one has nowhere to go")]
    CountNotRelaxable,
}

/// Parses `CHECK[,CHECK...]`: names trimmed, empty entries refused as unknown.
pub fn parse_relax(value: &str) -> Result<BTreeSet<CheckName>, ChecksError> {
    value
        .split(',')
        .map(|word| {
            let word = word.trim();
            match CheckName::ALL.into_iter().find(|c| c.as_str() == word) {
                Some(CheckName::Count) => Err(ChecksError::CountNotRelaxable),
                Some(check) => Ok(check),
                // Shown with {:?}: the value may come from an annotation, and may hold anything.
                None => Err(ChecksError::Unknown(word.chars().take(32).collect())),
            }
        })
        .collect()
}

/// One check's outcome, as `plan --json` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CheckResult {
    pub check: CheckName,
    pub ok: bool,
    /// The check was named in `--relax`: a failure is a warning, not a refusal.
    pub relaxed: bool,
    /// What was compared; for a failure, the GPU and both values.
    pub detail: String,
}

impl CheckResult {
    pub fn new(check: CheckName, relax: &BTreeSet<CheckName>, outcome: Result<String, String>) -> Self {
        let ok = outcome.is_ok();
        CheckResult { check, ok, relaxed: relax.contains(&check), detail: outcome.unwrap_or_else(|e| e) }
    }

    /// A failure that refuses the restore.
    pub fn refuses(&self) -> bool {
        !self.ok && !self.relaxed
    }
}

/// One family's side of one check: whether the family has GPUs it applies to (`takes_part`),
/// and its outcome, `Err` with the finding when it fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    pub takes_part: bool,
    /// Put before the family's detail where families' details are joined (`amdgpu: `).
    pub label: &'static str,
    pub outcome: Result<String, String>,
}

/// One result of every family's side of `check`, in the families' order: it fails when a
/// family taking part fails, and its detail is the failing families' (else every taking
/// family's), each after its label, joined by `; `. Where no family takes part, the first
/// family's side stands for the check (what it says of no GPUs).
pub fn merged(check: CheckName, relax: &BTreeSet<CheckName>, sides: &[Side]) -> CheckResult {
    let taking: Vec<&Side> = sides.iter().filter(|s| s.takes_part).collect();
    let Some(first) = sides.first() else {
        return CheckResult::new(check, relax, Ok(String::new()));
    };
    if taking.is_empty() {
        return CheckResult::new(check, relax, first.outcome.clone());
    }
    let failing: Vec<&Side> = taking.iter().copied().filter(|s| s.outcome.is_err()).collect();
    let shown = if failing.is_empty() { &taking } else { &failing };
    let detail = shown
        .iter()
        .map(|s| format!("{}{}", s.label, s.outcome.as_ref().unwrap_or_else(|e| e)))
        .collect::<Vec<_>>()
        .join("; ");
    CheckResult::new(check, relax, if failing.is_empty() { Ok(detail) } else { Err(detail) })
}

/// The permission bits (`rwx`) a process of `uid` in groups `in_group` (whether it is in the
/// node's group) gets from `access`, as the kernel's `generic_permission` picks the class.
fn class_bits(access: Access, uid: u32, in_group: bool) -> u32 {
    let shift = if uid == access.uid {
        6
    } else if in_group {
        3
    } else {
        0
    };
    (access.mode >> shift) & 0o7
}

/// Whether `recorded` lets some process do what `base` does not let it. Every kind of process
/// is tried: the owner of either, someone else, each in or out of either group. Root is left
/// out: it opens a device whatever its bits say.
pub fn widens(recorded: Access, base: Access) -> bool {
    const SOMEONE_ELSE: u32 = u32::MAX;
    let uids = [recorded.uid, base.uid, SOMEONE_ELSE];
    uids.into_iter().filter(|&uid| uid != 0).any(|uid| {
        [(false, false), (false, true), (true, false), (true, true)].into_iter().any(|(in_rec, in_base)| {
            // One group is one membership.
            if recorded.gid == base.gid && in_rec != in_base {
                return false;
            }
            class_bits(recorded, uid, in_rec) & !class_bits(base, uid, in_base) != 0
        })
    })
}

/// `0660 0:44`: an access as the `mode` check's details show it.
pub fn access_text(a: Access) -> String {
    format!("{:04o} {}:{}", a.mode, a.uid, a.gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule (issue 20): `--relax` takes the names, comma separated; `count` and unknown names
    /// are refused, an unknown one shown quoted and cut short.
    #[test]
    fn relax_names() {
        assert_eq!(parse_relax("model, driver").unwrap(), BTreeSet::from([CheckName::Model, CheckName::Driver]));
        assert_eq!(parse_relax("mixed,mode").unwrap(), BTreeSet::from([CheckName::Mixed, CheckName::Mode]));
        assert_eq!(parse_relax("count"), Err(ChecksError::CountNotRelaxable));
        assert_eq!(parse_relax("model,"), Err(ChecksError::Unknown(String::new())));
        let long = parse_relax(&format!("\u{1b}[2J{}", "x".repeat(100))).unwrap_err().to_string();
        assert!(long.starts_with("unknown check \"\\u{1b}[2Jxxx") && long.len() < 120, "{long}");
    }

    /// Property: an access never widens itself, and removing bits never widens.
    #[test]
    fn widening_is_about_more_bits() {
        for mode in [0o600, 0o640, 0o660, 0o666, 0o604, 0o060] {
            for (uid, gid) in [(0, 0), (1000, 44), (0, 44)] {
                let base = Access { mode, uid, gid };
                assert!(!widens(base, base), "{base:?}");
                assert!(!widens(Access { mode: mode & 0o640, ..base }, base), "{base:?}");
            }
        }
        let base = Access { mode: 0o640, uid: 1000, gid: 44 };
        assert!(widens(Access { mode: 0o644, ..base }, base));
        assert!(widens(Access { uid: 1001, ..base }, base), "another owner gets rw where it had r or nothing");
    }

    fn side(takes_part: bool, label: &'static str, outcome: Result<&str, &str>) -> Side {
        Side { takes_part, label, outcome: outcome.map(str::to_owned).map_err(str::to_owned) }
    }

    /// Rule (issue 33): one check of two families, as the plan showed it before the families
    /// were one seam: the failing family's finding alone; both when both pass or both fail;
    /// a family without GPUs leaves the other's detail alone; none taking part, the first's.
    #[test]
    fn families_sides_merge_into_one_result() {
        let none = BTreeSet::new();
        let nv = |part, o| side(part, "", o);
        let amd = |o| side(true, "amdgpu: ", o);
        let m = |sides: &[Side]| {
            let r = merged(CheckName::Model, &none, sides);
            (r.ok, r.detail)
        };
        assert_eq!(m(&[nv(true, Err("n")), amd(Ok("a"))]), (false, "n".into()));
        assert_eq!(m(&[nv(true, Ok("n")), amd(Err("a"))]), (false, "amdgpu: a".into()));
        assert_eq!(m(&[nv(true, Ok("n")), amd(Ok("a"))]), (true, "n; amdgpu: a".into()));
        assert_eq!(m(&[nv(true, Err("n")), amd(Err("a"))]), (false, "n; amdgpu: a".into()));
        assert_eq!(m(&[nv(false, Ok("n")), amd(Err("a"))]), (false, "amdgpu: a".into()));
        assert_eq!(m(&[nv(false, Ok("nothing")), side(false, "amdgpu: ", Ok("a"))]), (true, "nothing".into()));
        assert_eq!(m(&[nv(true, Err("n"))]), (false, "n".into()));
        assert!(merged(CheckName::Mode, &BTreeSet::from([CheckName::Mode]), &[nv(true, Err("n"))]).relaxed);
    }
}
