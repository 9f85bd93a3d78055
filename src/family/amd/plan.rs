//! AMD's step of the plan, pure: which render nodes the container is given, which GPU each
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

use super::metadata::AmdSaved;
use super::pairing::{self, By, PairError};
use super::plugin::{self, Gpu, Refusal};
use super::products;
use super::properties::{self, Checks, Switches};
use super::topology::{Facts, Topology, kernfs_order};
use super::{Amd, PLUGIN_LAST_MINOR};
use crate::decision::checks::{self, CheckName, Side};
use crate::decision::pairing::{DeviceRef, MapPair, PairingError};
use crate::decision::seam::{EarlierName, Input, Inputs, PlanError, Prefer, Step};
use crate::decision::tree::{Node, TreeBuilder, TreeError};
use crate::device::{Access, DevKind, Rdev};
use crate::family::Family;
use crate::inputs::host::DevDirScan;
use crate::inputs::spec::SpecView;

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
        Amd.gpu_name(self.minor)
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
    /// The saved GPU's earlier render names (`earlier_minors`), each served as it unless it lost
    /// a collision.
    #[serde(default)]
    pub earlier: Vec<EarlierName>,
}

impl AmdRemap {
    pub fn name(&self) -> String {
        Amd.gpu_name(self.old_minor)
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
    /// Why the host's KFD topology could not be read, naming the file: the restored GPUs'
    /// identities are then unknown, not absent.
    #[serde(default)]
    pub unread: Option<String>,
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
    let mut by_minor = spec.map(|s| Amd.spec_gpus(s)).unwrap_or_default();
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

/// Pairs the saved AMD GPUs with `restored` and evaluates the AMD side of the checks, with the
/// plugin's `KFD_*_CHECK` switches as its environment (`kfd`) sets them: what the plugin
/// would accept is neither refused by a check nor paired otherwise.
pub fn decide(
    saved: &[AmdSaved],
    restored: Vec<AmdRestored>,
    explicit: &[(u32, u32)],
    kfd: &Switches,
    unread: Option<&str>,
) -> Result<Decided, PairError> {
    let mut warnings = past_the_plugin(&restored);
    let unread = unread.map(str::to_owned);
    if saved.is_empty() {
        let plan = AmdPlan { restored, unread, ..AmdPlan::default() };
        return Ok(Decided { plan, access: vec![], outcomes: None, warnings });
    }
    warnings.extend(kfd.ignored.iter().map(|a| {
        format!("{a}: CRIU's amdgpu plugin ignores this value (it takes 0, 1, NO or YES) and keeps the check on; so does devremap")
    }));
    let (saved_side, saved_unknown) = plugin_side(saved.iter().map(|s| (s.minor, s.gpu.as_ref())));
    let mut order: Vec<&AmdRestored> = restored.iter().collect();
    order.sort_by_cached_key(|g| g.gpu.as_ref().map(|gpu| kernfs_order(&gpu.node.to_string())));
    order.sort_by_key(|g| g.gpu.is_none());
    let (restored_side, restored_unknown) = plugin_side(order.iter().map(|g| (g.minor, g.gpu.as_ref())));
    let checks = kfd.checks;
    let choice = match (saved_unknown, restored_unknown) {
        (Some(m), _) => Err(Refusal::Unknown(format!("the checkpoint gives no KFD properties of renderD{m}"))),
        // A topology thrown out (its warning names the file) says nothing of which GPUs it has.
        (_, Some(m)) if unread.is_some() => Err(Refusal::Unknown(format!(
            "the host root's KFD topology could not be read, as warned: renderD{m}'s identity is unknown"
        ))),
        (_, Some(m)) => Err(Refusal::Unknown(format!("the host root's KFD topology has no GPU renderD{m}"))),
        _ => plugin::choose(&saved_side, &restored_side, &checks),
    };
    let pairing = pairing::pair_with(&saved_side, &restored_side, explicit, choice)?;
    warnings.extend(pairing.warnings.iter().cloned());
    let known = saved_unknown.is_none() && restored_unknown.is_none();
    let mut plan = AmdPlan {
        unpaired: pairing.unpaired.iter().map(|&s| saved[s].minor).collect(),
        refusal: pairing.refusal.clone(),
        unread,
        ..AmdPlan::default()
    };
    let (mut access, mut model, mut firmware, mut wider) = (vec![], None, None, None);
    for p in &pairing.pairs {
        let (old, new) = (&saved[p.saved], order[p.restored]);
        let served_access = old.recorded.over(new.access);
        if known && model.is_none() {
            let no_fw = Checks { fw_version: false, sdma_fw_version: false, ..checks };
            let (a, b) = (&saved_side[p.saved].facts, &restored_side[p.restored].facts);
            // The products first (what a user knows a GPU by), then the property that differs.
            let product = products::another_product(a, b).map(|p| format!("{p}; ")).unwrap_or_default();
            model = properties::mismatch(a, b, &no_fw)
                .map(|why| format!("saved renderD{} is not restored renderD{}: {product}{why}", old.minor, new.minor));
        }
        if known && firmware.is_none() {
            firmware = firmware_lower(&saved_side[p.saved].facts, &restored_side[p.restored].facts, &checks)
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
            earlier: old.earlier_minors.iter().map(|&minor| EarlierName { minor, served: true }).collect(),
        });
    }
    let n = plan.remap.len();
    let unknown = |what: &str| format!("not compared: {what} unknown on one side");
    // The switches off that leave out some of a check's comparisons, named in its detail.
    let off = checks.off();
    let compared = |what: &str, switches: &[&str]| {
        let relaxed: Vec<&str> = off.iter().copied().filter(|v| switches.contains(v)).collect();
        match (known, relaxed.is_empty()) {
            (false, _) => unknown(what),
            (true, true) => format!("{n} pairs compared"),
            (true, false) => format!("{n} pairs compared, {} off as for the plugin", relaxed.join(" and ")),
        }
    };
    // CRIU's amdgpu plugin restores onto exactly as many GPUs as were saved
    // (`set_restore_gpu_maps`), not onto more, as NVIDIA's rule (gVisor's) allows.
    let count = if saved.len() != restored.len() {
        Err(format!(
            "can't remap {} saved AMD GPUs to {} restored: CRIU's amdgpu plugin needs as many on each side \
             (Number of devices mismatch (checkpointed:{} local:{}))",
            saved.len(),
            restored.len(),
            saved.len(),
            restored.len()
        ))
    } else {
        Ok(format!("{} saved AMD GPUs, {} restored", saved.len(), restored.len()))
    };
    let outcomes = [
        (CheckName::Count, count),
        (CheckName::Model, model.map_or_else(|| Ok(compared("the KFD properties", &MODEL_SWITCHES)), Err)),
        (CheckName::Driver, firmware.map_or_else(|| Ok(compared("the firmware versions", &DRIVER_SWITCHES)), Err)),
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

/// The switches that leave out comparisons of the `model` check (firmware is `driver`'s).
const MODEL_SWITCHES: [&str; 4] =
    ["KFD_CACHES_COUNT_CHECK", "KFD_NUM_GWS_CHECK", "KFD_VRAM_SIZE_CHECK", "KFD_CAPABILITY_CHECK"];
/// The switches of the `driver` check's comparisons.
const DRIVER_SWITCHES: [&str; 2] = ["KFD_FW_VER_CHECK", "KFD_SDMA_FW_VER_CHECK"];

/// The first firmware the restored GPU has older than the saved one's, among those whose
/// switch is on (the plugin's `KFD_FW_VER_CHECK` and `KFD_SDMA_FW_VER_CHECK` rules), as
/// `fw_version 150, newer`.
fn firmware_lower(saved: &Facts, restored: &Facts, checks: &Checks) -> Option<String> {
    [
        (checks.fw_version, "fw_version", saved.fw_version, restored.fw_version),
        (checks.sdma_fw_version, "sdma_fw_version", saved.sdma_fw_version, restored.sdma_fw_version),
    ]
    .into_iter()
    .find(|&(on, _, a, b)| on && b < a)
    .map(|(_, name, a, b)| format!("{name} {a}, newer ({b})"))
}

/// AMD's restored render nodes on `inputs` ([`restored`]).
pub fn restore(inputs: &Inputs) -> Vec<AmdRestored> {
    restored(inputs.spec.as_ref(), inputs.dev_dir.as_ref(), &inputs.host.amd)
}

/// AMD's step: the `--device-map` pairs that name render nodes, and [`decide`] with the
/// plugin's switches as the environment sets them.
pub fn step(inputs: &Inputs, restored: Vec<AmdRestored>) -> Result<Decided, PlanError> {
    let saved = inputs.metadata.as_ref().map(|m| m.saved.amd.as_slice()).unwrap_or_default();
    let explicit = explicit(&inputs.device_map).map_err(PlanError::DeviceMap)?;
    decide(saved, restored, &explicit, &inputs.kfd, inputs.host.amd_unread.as_deref()).map_err(PlanError::AmdDeviceMap)
}

impl Step for Decided {
    fn side(&self, check: CheckName) -> Option<Side> {
        let (_, outcome) = self.outcomes.iter().flatten().find(|(c, _)| *c == check)?;
        Some(Side { takes_part: true, label: "amdgpu: ", outcome: outcome.clone() })
    }

    fn fault(&self, _check: CheckName) -> Option<Input> {
        None
    }

    fn place(&mut self, b: &mut TreeBuilder, prefer: Prefer, warnings: &mut Vec<String>) -> Result<(), PlanError> {
        self.place_names(b, prefer == Prefer::Native).map_err(PlanError::SpecDevice)?;
        warnings.append(&mut self.warnings);
        Ok(())
    }
}

impl Decided {
    /// Places every restored render node under its name, then every saved one's checkpoint
    /// name and earlier names, each leading to its pair unless another restored GPU's name wins
    /// (`prefer_native`).
    fn place_names(&mut self, b: &mut TreeBuilder, prefer_native: bool) -> Result<(), TreeError> {
        for g in &self.plan.restored {
            b.insert(&g.name(), Node::device(DevKind::Char, g.rdev, g.access))?;
        }
        let restored = &self.plan.restored;
        for (entry, access) in self.plan.remap.iter_mut().zip(&self.access) {
            let node = Node::device(DevKind::Char, entry.rdev, *access);
            let (old, new) = (entry.old_minor, entry.new_minor);
            let mut place = |minor: u32, what: &str| -> Result<bool, TreeError> {
                let name = Amd.gpu_name(minor);
                let holder = restored.iter().any(|g| g.minor == minor && g.minor != new);
                let served = !(holder && prefer_native);
                if holder {
                    let outcome = if served {
                        "serving the saved one, so the restored GPU has no name of its own"
                    } else {
                        "serving the restored GPU (prefer checkpoint to serve the saved one)"
                    };
                    self.warnings.push(format!(
                        "/dev/{name}: {what} of saved renderD{old} (now renderD{new}) is a restored GPU's name; {outcome}"
                    ));
                }
                if served {
                    b.insert(&name, node.clone())?;
                }
                Ok(served)
            };
            entry.served = place(old, "checkpoint name")?;
            for earlier in &mut entry.earlier {
                earlier.served = place(earlier.minor, "earlier name")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::amd::plugin::GpuLink;
    use crate::family::amd::topology::LINK_PCIE;
    use crate::inputs::metadata::RecordedAccess;

    /// An MI210-like GPU at `minor`, with `tweak` applied to its facts.
    fn gpu(minor: u32, tweak: impl Fn(&mut Facts)) -> Gpu {
        let mut facts = Facts {
            drm_render_minor: minor,
            device_id: 0x740f,
            vendor_id: 0x1002,
            vram_size: 64 << 30,
            fw_version: 100,
            sdma_fw_version: 20,
            io_links_count: 1,
            ..Facts::default()
        };
        tweak(&mut facts);
        Gpu {
            node: 1,
            gpu_id: minor,
            facts,
            links: vec![GpuLink { kind: LINK_PCIE, to: 0, to_gpu: false, peer: true }],
        }
    }

    /// Saved renderD144 restored onto renderD136 (`tweak`ed), with the plugin's environment `env`.
    fn decided(tweak: impl Fn(&mut Facts), env: &[(&str, &str)]) -> Decided {
        let saved = [AmdSaved {
            minor: 144,
            gpu: Some(gpu(144, |_| {})),
            recorded: RecordedAccess::default(),
            earlier_minors: vec![],
        }];
        let restored = vec![AmdRestored {
            minor: 136,
            rdev: Rdev::new(226, 136),
            access: Access::DEVICE_DEFAULT,
            gpu: Some(gpu(136, tweak)),
        }];
        let kfd = Checks::from_env(|name| env.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_bytes().to_vec()));
        decide(&saved, restored, &[], &kfd, None).unwrap()
    }

    fn outcome(d: &Decided, check: CheckName) -> Result<String, String> {
        d.outcomes.iter().flatten().find(|(c, _)| *c == check).unwrap().1.clone()
    }

    /// Rule (issue 22, the plugin's KFD_FW_VER_CHECK): older firmware on the restore host fails
    /// `driver`, and the plugin will refuse the pair; with `KFD_FW_VER_CHECK=0` in the plugin's
    /// environment the plugin accepts it, so `driver` passes, saying what was left out, and the
    /// pair is the plugin's.
    #[test]
    fn older_firmware_passes_where_the_plugin_skips_its_check() {
        let older = |f: &mut Facts| f.fw_version = 90;
        let strict = decided(older, &[]);
        assert_eq!(
            outcome(&strict, CheckName::Driver),
            Err("saved renderD144 was on fw_version 100, newer (90) than restored renderD136".into())
        );
        assert_eq!(strict.plan.remap[0].by, By::Position);
        assert!(strict.plan.refusal.is_some());
        let relaxed = decided(older, &[("KFD_FW_VER_CHECK", "0")]);
        assert_eq!(
            outcome(&relaxed, CheckName::Driver),
            Ok("1 pairs compared, KFD_FW_VER_CHECK off as for the plugin".into())
        );
        assert_eq!(outcome(&relaxed, CheckName::Model), Ok("1 pairs compared".into()));
        assert_eq!((relaxed.plan.remap[0].by, &relaxed.plan.refusal), (By::Plugin, &None));
        assert!(relaxed.warnings.is_empty(), "{:?}", relaxed.warnings);
        // Only its own firmware: an older SDMA firmware still fails.
        let sdma = decided(|f| f.sdma_fw_version = 19, &[("KFD_FW_VER_CHECK", "0")]);
        assert!(outcome(&sdma, CheckName::Driver).unwrap_err().contains("sdma_fw_version 20, newer (19)"));
    }

    /// Rule (issue 22, KFD_VRAM_SIZE_CHECK, KFD_CAPABILITY_CHECK): a smaller VRAM or another
    /// capability fails `model` unless its switch is off in the plugin's environment; a
    /// property no switch covers fails whatever the switches say.
    #[test]
    fn model_follows_the_plugins_switches() {
        let smaller = |f: &mut Facts| f.vram_size = 32 << 30;
        assert!(outcome(&decided(smaller, &[]), CheckName::Model).unwrap_err().contains("vram_size"));
        let relaxed = decided(smaller, &[("KFD_VRAM_SIZE_CHECK", "no")]);
        assert_eq!(
            outcome(&relaxed, CheckName::Model),
            Ok("1 pairs compared, KFD_VRAM_SIZE_CHECK off as for the plugin".into())
        );
        assert_eq!(relaxed.plan.remap[0].by, By::Plugin);
        let capability = |f: &mut Facts| f.capability = 7;
        assert!(outcome(&decided(capability, &[]), CheckName::Model).is_err());
        assert!(outcome(&decided(capability, &[("KFD_CAPABILITY_CHECK", "NO")]), CheckName::Model).is_ok());
        let all_off: Vec<(&str, &str)> = properties::VARIABLES.iter().map(|v| (*v, "0")).collect();
        let other = decided(|f| f.simd_count = 8, &all_off);
        assert!(outcome(&other, CheckName::Model).unwrap_err().contains("simd_count 0 vs 8"));
    }

    /// Rule (issue 33, AMD count): CRIU's amdgpu plugin refuses any difference in the number of
    /// GPUs ("Number of devices mismatch"), so `count` fails for 1 saved GPU onto 2 as for 2
    /// onto 1, in the plugin's words; NVIDIA's rule (gVisor's: at least as many) is not AMD's.
    #[test]
    fn the_amd_count_must_be_equal_as_for_the_plugin() {
        let saved = |minors: &[u32]| -> Vec<AmdSaved> {
            let item = |m: u32| AmdSaved {
                minor: m,
                gpu: Some(gpu(m, |_| {})),
                recorded: RecordedAccess::default(),
                earlier_minors: vec![],
            };
            minors.iter().copied().map(item).collect()
        };
        let restored = |minors: &[u32]| -> Vec<AmdRestored> {
            let node = |m: u32| AmdRestored {
                minor: m,
                rdev: Rdev::new(226, m),
                access: Access::DEVICE_DEFAULT,
                gpu: Some(gpu(m, |_| {})),
            };
            minors.iter().copied().map(node).collect()
        };
        let count = |s: &[u32], r: &[u32]| {
            let d = decide(&saved(s), restored(r), &[], &Switches::default(), None).unwrap();
            outcome(&d, CheckName::Count)
        };
        assert_eq!(
            count(&[128], &[128, 129]),
            Err("can't remap 1 saved AMD GPUs to 2 restored: CRIU's amdgpu plugin needs as many on each side \
                 (Number of devices mismatch (checkpointed:1 local:2))"
                .into())
        );
        assert!(count(&[128, 129], &[128]).unwrap_err().contains("(checkpointed:2 local:1)"));
        assert_eq!(count(&[128, 129], &[130, 131]), Ok("2 saved AMD GPUs, 2 restored".into()));
    }

    /// Rule (issue 33, AMD model): another product is named first, by device id, name and ISA,
    /// then the first property that differs; the same product shows only the property.
    #[test]
    fn another_model_names_the_products_first() {
        let mi300x = |f: &mut Facts| {
            f.device_id = 0x74a1;
            f.gfx_target_version = 90402;
            f.simd_count = 1216;
        };
        assert_eq!(
            outcome(&decided(mi300x, &[]), CheckName::Model),
            Err("saved renderD144 is not restored renderD136: another product: 0x740f (Instinct MI210) vs \
                 0x74a1 (Instinct MI300X, gfx942); simd_count 0 vs 1216"
                .into())
        );
        let same_product = decided(|f| f.simd_count = 8, &[]);
        assert_eq!(
            outcome(&same_product, CheckName::Model),
            Err("saved renderD144 is not restored renderD136: simd_count 0 vs 8".into())
        );
    }

    /// Bug (attack F6): a restored GPU without facts because the host's topology was thrown
    /// out is paired by position saying the topology could not be read, not that it lacks the
    /// GPU (it may well have it); a topology read whole that lacks it still says so.
    #[test]
    fn an_unread_topology_is_not_said_to_lack_the_gpu() {
        let saved = [AmdSaved {
            minor: 144,
            gpu: Some(gpu(144, |_| {})),
            recorded: RecordedAccess::default(),
            earlier_minors: vec![],
        }];
        let restored =
            vec![AmdRestored { minor: 136, rdev: Rdev::new(226, 136), access: Access::DEVICE_DEFAULT, gpu: None }];
        let why = |unread: Option<&str>| {
            let d = decide(&saved, restored.clone(), &[], &Checks::from_env(|_| None), unread).unwrap();
            assert_eq!(d.plan.unread.as_deref(), unread);
            d.warnings.into_iter().find(|w| w.starts_with("renderD144: devremap cannot know")).unwrap()
        };
        let unread = why(Some("/h/sys/class/kfd/kfd/topology/nodes: nodes 3 and 2 have one gpu_id, 53538"));
        assert!(
            unread.contains("KFD topology could not be read, as warned: renderD136's identity is unknown"),
            "{unread}"
        );
        assert!(!unread.contains("has no GPU"), "{unread}");
        assert!(why(None).contains("the host root's KFD topology has no GPU renderD136"));
    }

    /// Rule (CRIU's getenv_bool): a value the plugin ignores leaves the check on here too, with
    /// a warning naming it; without saved AMD GPUs nothing is said.
    #[test]
    fn an_ignored_value_keeps_the_check_and_is_said() {
        let d = decided(|f| f.fw_version = 90, &[("KFD_FW_VER_CHECK", "off")]);
        assert!(outcome(&d, CheckName::Driver).is_err());
        assert_eq!(
            d.warnings[0],
            "KFD_FW_VER_CHECK=\"off\": CRIU's amdgpu plugin ignores this value (it takes 0, 1, NO or YES) and keeps \
             the check on; so does devremap"
        );
        let kfd = Checks::from_env(|_| Some(b"off".to_vec()));
        assert!(decide(&[], vec![], &[], &kfd, None).unwrap().warnings.is_empty());
    }
}
