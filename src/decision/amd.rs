//! The AMD step of the plan, pure: which render nodes the container is given, which GPU each
//! checkpoint render name leads to, the AMD side of the named checks, and the nodes in the tree.
//!
//! The restored AMD GPUs are what CRIU's amdgpu plugin sees on restore: the GPUs the restored
//! container's device cgroup allows (the kernel hides the other KFD nodes from it), which are the
//! spec's render devices (char 226:N, N >= 128). Without a spec they are the device directory's
//! `dri/renderD<N>` nodes. The device directory's node (its `lstat`ed number) wins over the
//! spec's number, as for NVIDIA; the spec's mode and owner win over the host node's. Each one's
//! identity is the KFD topology's GPU with its render minor.
//!
//! A checkpoint render name leads to the GPU the plugin restores its process onto
//! ([`pairing::pair`]): the plugin chooses by itself and opens `renderD<minor of its choice>`,
//! while the process's own paths name the checkpoint's minors. `--device-map renderDOLD=renderDNEW`
//! wins. Where the plugin's choice is unknown (a GPU without its topology facts on either side)
//! or it would refuse, the rest is paired by position and the plan says so.

use crate::decision::checks::{self, CheckName, CheckResult};
use crate::decision::pairing::{DeviceRef, MapPair, PairingError};
use crate::decision::tree::{Node, TreeBuilder, TreeError};
use crate::device::{Access, DevKind, Rdev};
use crate::family::AMD;
use crate::family::amd::pairing::{self, By, PairError};
use crate::family::amd::plugin::{self, Gpu, Refusal};
use crate::family::amd::properties::{self, Checks};
use crate::family::amd::topology::{Facts, kernfs_order};
use crate::family::amd::{PLUGIN_LAST_MINOR, topology::Topology};
use crate::inputs::amd_metadata::AmdSaved;
use crate::inputs::host::DevDirScan;
use crate::inputs::spec::SpecView;
use std::collections::BTreeMap;

/// A render node the restored container is given.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AmdRestored {
    /// The N of `/dev/dri/renderD<N>`.
    pub minor: u32,
    /// The real device the node opens (226:N on a real host).
    pub rdev: Rdev,
    pub access: Access,
    /// Its GPU in the host's KFD topology; `None` when the topology has none with this minor.
    pub gpu: Option<Gpu>,
}

impl AmdRestored {
    pub fn name(&self) -> String {
        AMD.gpu_name(self.minor)
    }
}

/// A saved AMD GPU's render name and where it leads.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AmdRemap {
    /// The checkpoint's render minor.
    pub old_minor: u32,
    /// The restored GPU's render minor.
    pub new_minor: u32,
    pub rdev: Rdev,
    pub by: By,
    /// False when the checkpoint name lost a collision with another restored GPU's name.
    pub served: bool,
}

impl AmdRemap {
    pub fn name(&self) -> String {
        AMD.gpu_name(self.old_minor)
    }
}

/// The AMD part of a plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AmdPlan {
    /// Sorted by minor.
    pub restored: Vec<AmdRestored>,
    /// Sorted by the saved minor.
    pub remap: Vec<AmdRemap>,
    /// The saved render minors no restored GPU is left for.
    pub unpaired: Vec<u32>,
    /// The plugin's words where it will refuse this restore.
    pub refusal: Option<String>,
}

impl AmdPlan {
    pub fn is_empty(&self) -> bool {
        self.restored.is_empty() && self.remap.is_empty() && self.unpaired.is_empty()
    }
}

/// What the AMD step decided before any node is placed: the plan, the pairs' access, and the
/// AMD side of each named check.
pub struct Decided {
    pub plan: AmdPlan,
    /// Per pair (in `plan.remap`'s order), the access its checkpoint name is served with.
    access: Vec<Access>,
    /// The outcome of `count`, `model`, `driver`, `mode` for the AMD GPUs; `None` when there
    /// are no saved AMD GPUs.
    outcomes: Option<[(CheckName, Result<String, String>); 4]>,
    pub warnings: Vec<String>,
}

/// The restored render nodes: the spec's render devices (all of the device directory's without
/// a spec), the device directory's number winning, the spec's access winning, each with its
/// topology GPU.
pub fn restored(spec: Option<&SpecView>, dev_dir: Option<&DevDirScan>, topology: &Topology) -> Vec<AmdRestored> {
    let mut by_minor: BTreeMap<u32, (Rdev, Access)> = BTreeMap::new();
    for dev in spec.iter().flat_map(|s| &s.devices) {
        if let Some(minor) = AMD.gpu_minor_of_device(dev.kind, dev.rdev) {
            by_minor.entry(minor).or_insert((dev.rdev, dev.access));
        }
    }
    for (minor, node) in dev_dir.iter().flat_map(|d| &d.amd) {
        match by_minor.get_mut(minor) {
            Some(given) => given.0 = node.rdev,
            None if spec.is_none() => {
                by_minor.insert(*minor, (node.rdev, node.access));
            }
            None => {}
        }
    }
    // What the plugin sees: every CPU node and the visible GPUs, with their valid links.
    let ids: Vec<u32> = by_minor.keys().filter_map(|&m| topology.gpu_by_minor(m)).map(|n| n.id).collect();
    let visible = plugin::visible_gpus(topology, |id| ids.contains(&id));
    by_minor
        .into_iter()
        .map(|(minor, (rdev, access))| AmdRestored {
            minor,
            rdev,
            access,
            gpu: visible.iter().find(|g| g.facts.drm_render_minor == minor).cloned(),
        })
        .collect()
}

/// The GPUs of one side in the plugin's order (a topology's node order; a checkpoint's list
/// order), with a stand-in (its minor, no facts) for one whose facts are unknown; and the first
/// unknown one's minor.
fn plugin_side<'a>(gpus: impl Iterator<Item = (u32, Option<&'a Gpu>)>) -> (Vec<Gpu>, Option<u32>) {
    let mut unknown = None;
    let side = gpus
        .map(|(minor, gpu)| match gpu {
            Some(g) => g.clone(),
            None => {
                unknown.get_or_insert(minor);
                Gpu { node: 0, gpu_id: 0, facts: Facts { drm_render_minor: minor, ..Facts::default() }, links: vec![] }
            }
        })
        .collect();
    (side, unknown)
}

/// The `--device-map` pairs that name render nodes, as `(saved minor, restored minor)`; an
/// entry with a render node on one side only is refused.
pub fn explicit(map: &[MapPair]) -> Result<Vec<(u32, u32)>, PairingError> {
    map.iter()
        .filter(|p| matches!(p.old, DeviceRef::Render(_)) || matches!(p.new, DeviceRef::Render(_)))
        .map(|p| match (&p.old, &p.new) {
            (DeviceRef::Render(a), DeviceRef::Render(b)) => Ok((*a, *b)),
            _ => Err(PairingError::BadMapEntry {
                entry: format!("{}={}", p.old, p.new),
                what: "a render node pairs only with a render node: renderDOLD=renderDNEW",
            }),
        })
        .collect()
}

/// Pairs the saved AMD GPUs with `restored` and evaluates the AMD side of the checks.
pub fn decide(saved: &[AmdSaved], restored: Vec<AmdRestored>, explicit: &[(u32, u32)]) -> Result<Decided, PairError> {
    let mut warnings = past_the_plugin(&restored);
    if saved.is_empty() {
        let plan = AmdPlan { restored, ..AmdPlan::default() };
        return Ok(Decided { plan, access: vec![], outcomes: None, warnings });
    }
    let (saved_side, saved_unknown) = plugin_side(saved.iter().map(|s| (s.minor, s.gpu.as_ref())));
    let mut order: Vec<&AmdRestored> = restored.iter().collect();
    order.sort_by_cached_key(|g| g.gpu.as_ref().map(|gpu| kernfs_order(&gpu.node.to_string())));
    order.sort_by_key(|g| g.gpu.is_none());
    let (restored_side, restored_unknown) = plugin_side(order.iter().map(|g| (g.minor, g.gpu.as_ref())));
    let checks = Checks::default();
    let choice = match (saved_unknown, restored_unknown) {
        (Some(m), _) => Err(Refusal::Unknown(format!("the checkpoint gives no KFD properties of renderD{m}"))),
        (_, Some(m)) => Err(Refusal::Unknown(format!("the host root's KFD topology has no GPU renderD{m}"))),
        _ => plugin::choose(&saved_side, &restored_side, &checks),
    };
    let pairing = pairing::pair_with(&saved_side, &restored_side, explicit, choice)?;
    warnings.extend(pairing.warnings.iter().cloned());
    let known = saved_unknown.is_none() && restored_unknown.is_none();
    let mut plan = AmdPlan {
        unpaired: pairing.unpaired.iter().map(|&s| saved[s].minor).collect(),
        refusal: pairing.refusal.clone(),
        ..AmdPlan::default()
    };
    let (mut access, mut model, mut firmware, mut wider) = (vec![], None, None, None);
    for p in &pairing.pairs {
        let (old, new) = (&saved[p.saved], order[p.restored]);
        let served_access = old.recorded.over(new.access);
        if known && model.is_none() {
            let no_fw = Checks { fw_version: false, sdma_fw_version: false, ..checks };
            model = properties::mismatch(&saved_side[p.saved].facts, &restored_side[p.restored].facts, &no_fw)
                .map(|why| format!("saved renderD{} is not restored renderD{}: {why}", old.minor, new.minor));
        }
        if known && firmware.is_none() {
            firmware = firmware_lower(&saved_side[p.saved].facts, &restored_side[p.restored].facts)
                .map(|why| format!("saved renderD{} was on {why} than restored renderD{}", old.minor, new.minor));
        }
        if wider.is_none() && checks::widens(served_access, new.access) {
            wider = Some(wider_access(old.minor, served_access, new));
        }
        access.push(served_access);
        plan.remap.push(AmdRemap {
            old_minor: old.minor,
            new_minor: new.minor,
            rdev: new.rdev,
            by: p.by,
            served: true,
        });
    }
    let n = plan.remap.len();
    let unknown = |what: &str| format!("not compared: {what} unknown on one side");
    let compared = |what: &str| if known { format!("{n} pairs compared") } else { unknown(what) };
    let count = if saved.len() > restored.len() {
        Err(format!("can't remap {} saved AMD GPUs to {} restored", saved.len(), restored.len()))
    } else {
        Ok(format!("{} saved AMD GPUs, {} restored", saved.len(), restored.len()))
    };
    let outcomes = [
        (CheckName::Count, count),
        (CheckName::Model, model.map_or_else(|| Ok(compared("the KFD properties")), Err)),
        (CheckName::Driver, firmware.map_or_else(|| Ok(compared("the firmware versions")), Err)),
        (CheckName::Mode, wider.map_or_else(|| Ok(format!("{n} render names give no more access")), Err)),
    ];
    plan.restored = restored;
    Ok(Decided { plan, access, outcomes: Some(outcomes), warnings })
}

/// A warning for each restored GPU whose render minor CRIU's amdgpu plugin cannot open.
fn past_the_plugin(restored: &[AmdRestored]) -> Vec<String> {
    let warn = |g: &AmdRestored| {
        format!(
            "/dev/{}: CRIU's amdgpu plugin opens only render minors 128-{PLUGIN_LAST_MINOR}; a restore onto this \
             GPU fails in the plugin",
            g.name()
        )
    };
    restored.iter().filter(|g| g.minor > PLUGIN_LAST_MINOR).map(warn).collect()
}

/// The `mode` check's finding: saved render node `old` was recorded with `recorded`, more
/// access than `new` has here.
fn wider_access(old: u32, recorded: Access, new: &AmdRestored) -> String {
    format!(
        "saved renderD{old} was recorded {:04o} {}:{}, more access than the {:04o} {}:{} that restored renderD{} \
         has here",
        recorded.mode, recorded.uid, recorded.gid, new.access.mode, new.access.uid, new.access.gid, new.minor
    )
}

/// The first firmware the restored GPU has older than the saved one's (the plugin's
/// `KFD_FW_VER_CHECK` and `KFD_SDMA_FW_VER_CHECK` rules), as `fw_version 150, newer`.
fn firmware_lower(saved: &Facts, restored: &Facts) -> Option<String> {
    [
        ("fw_version", saved.fw_version, restored.fw_version),
        ("sdma_fw_version", saved.sdma_fw_version, restored.sdma_fw_version),
    ]
    .into_iter()
    .find(|(_, a, b)| b < a)
    .map(|(name, a, b)| format!("{name} {a}, newer ({b})"))
}

impl Decided {
    /// `result` (NVIDIA's side of one check) with the AMD side merged in: it fails when either
    /// side fails. `nvidia` says whether NVIDIA's side had GPUs at all; without, AMD's detail
    /// stands alone.
    pub fn merge(&self, result: CheckResult, nvidia: bool) -> CheckResult {
        let Some((_, amd)) = self.outcomes.iter().flatten().find(|(c, _)| *c == result.check) else { return result };
        let (amd_ok, amd_detail) = match amd {
            Ok(d) => (true, d),
            Err(d) => (false, d),
        };
        let detail = match (nvidia, result.ok, amd_ok) {
            (true, false, true) => result.detail.clone(),
            (false, _, _) | (true, true, false) => format!("amdgpu: {amd_detail}"),
            _ => format!("{}; amdgpu: {amd_detail}", result.detail),
        };
        CheckResult { ok: amd_ok && (result.ok || !nvidia), detail, ..result }
    }

    /// Places every restored render node under its name, then every saved one's checkpoint
    /// name, leading to its pair unless another restored GPU's name wins (`prefer_native`).
    pub fn place(&mut self, b: &mut TreeBuilder, prefer_native: bool) -> Result<(), TreeError> {
        for g in &self.plan.restored {
            b.insert(&g.name(), Node::device(DevKind::Char, g.rdev, g.access))?;
        }
        for (entry, access) in self.plan.remap.iter_mut().zip(&self.access) {
            let name = entry.name();
            let holder = self.plan.restored.iter().any(|g| g.minor == entry.old_minor && g.minor != entry.new_minor);
            if holder {
                let (what, served) = if prefer_native {
                    ("serving the restored GPU (prefer checkpoint to serve the saved one)", false)
                } else {
                    ("serving the saved one, so the restored GPU has no name of its own", true)
                };
                self.warnings.push(format!(
                    "/dev/{name}: checkpoint name of saved renderD{} (now renderD{}) is a restored GPU's name; {what}",
                    entry.old_minor, entry.new_minor
                ));
                entry.served = served;
            }
            if entry.served {
                b.insert(&name, Node::device(DevKind::Char, entry.rdev, *access))?;
            }
        }
        Ok(())
    }
}
