//! NVIDIA's step of the plan, pure: the restored GPUs ([`super::restored`]), the checks of the
//! driver's files and of each side, the pairing (gVisor's rules, [`super::pairing`]), NVIDIA's
//! side of the named checks ([`super::checks`]), and its names in the tree: every restored GPU
//! under its native name, then every saved GPU under its checkpoint name and earlier names,
//! unless that name is another restored GPU's native name and natives are preferred.
//!
//! Assumption: the saved GPUs are sorted by minor (the metadata reader sorts), so the
//! positional rule is reproducible.

#[cfg(test)]
mod tests;

use super::checks::{self as nv_checks, Fault};
use super::metadata::DeviceId;
use super::pairing::{self, Pair};
use super::restored;
use super::{Nvidia, RestoredGpu};
use crate::decision::checks::{CheckName, CheckResult, Side};
use crate::decision::pairing::{By, DeviceRef, MapPair, PairingError};
use crate::decision::seam::{EarlierName, Input, Inputs, PlanError, Prefer, Step};
use crate::decision::tree::{Node, TreeBuilder};
use crate::device::DevKind;
use crate::family::Family;

/// One saved GPU and where its checkpoint name leads.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemapEntry {
    pub old: DeviceId,
    pub new: RestoredGpu,
    /// Which rule paired them.
    #[serde(default)]
    pub by: By,
    /// False when the checkpoint name lost a collision and is not in the tree as this GPU.
    pub served: bool,
    /// The saved GPU's earlier names (`earlier_minors`), each served as it unless it lost a
    /// collision.
    #[serde(default)]
    pub earlier: Vec<EarlierName>,
}

impl RemapEntry {
    /// The checkpoint name, `nvidia<saved minor>`.
    pub fn name(&self) -> String {
        Nvidia.gpu_name(self.old.minor)
    }
}

/// NVIDIA's part of a plan: its keys of the plan's serialized form (the state file's plan, a
/// handed-over plan) are the plan's own, `remap` and `restored`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NvidiaPlan {
    pub remap: Vec<RemapEntry>,
    pub restored: Vec<RestoredGpu>,
}

/// What NVIDIA's step decided before any node is placed.
pub struct Decided {
    pub plan: NvidiaPlan,
    pairs: Vec<Pair>,
    /// NVIDIA's side of each check, in [`CheckName::ALL`]'s order.
    checks: Vec<CheckResult>,
    /// Which side a failed `mixed` check is about.
    mixed: Option<Fault>,
    /// Whether NVIDIA has saved or restored GPUs: without, it takes no part in the checks.
    takes_part: bool,
}

/// The error for too few restored GPUs, as the input that gave them: the spec when there is one
/// (its devices and the hook's selection are all it is given), else the device directory, else
/// (no restore side given at all) the checkpoint, saying which flags give them.
fn too_few(inputs: &Inputs, error: PairingError) -> PlanError {
    match (&inputs.spec, &inputs.dev_dir) {
        (Some(_), _) => PlanError::SpecGpus(error),
        (None, Some(_)) => PlanError::HostDevGpus(error),
        (None, None) => PlanError::NoRestoreSide(error),
    }
}

/// Checks the driver's files, and finds the restored GPUs.
pub fn restore(inputs: &Inputs) -> Result<Vec<RestoredGpu>, PlanError> {
    restored::check_driver_files(&inputs.host.gpu_info)?;
    restored::restored_gpus(inputs)
}

/// Checks the saved GPUs, and pairs them with the `restored` ones.
pub fn decide(inputs: &Inputs, restored: Vec<RestoredGpu>) -> Result<Decided, PlanError> {
    let saved = inputs.metadata.as_ref().map(|m| m.saved.gpus.as_slice()).unwrap_or_default();
    pairing::check_subdevice(saved).map_err(PlanError::Checkpoint)?;
    // Without as many restored GPUs there is no pairing, so no plan to show: refused here.
    pairing::check_count(saved, &restored).map_err(|e| too_few(inputs, e))?;
    let relax = &inputs.relax;
    let (mixed, fault) = nv_checks::mixed(saved, &restored, relax);
    let render = |r: &DeviceRef| matches!(r, DeviceRef::Render(_));
    let map: Vec<MapPair> = inputs.device_map.iter().filter(|p| !render(&p.old) && !render(&p.new)).cloned().collect();
    let pairs = pairing::pair(saved, &restored, &map, inputs.pairing).map_err(PlanError::DeviceMap)?;
    let checks = vec![
        nv_checks::count(saved, &restored, relax),
        mixed,
        nv_checks::model(&pairs, relax),
        nv_checks::driver(&pairs, inputs.host.driver_version.as_ref(), relax),
        nv_checks::mode(&pairs, relax),
    ];
    let takes_part = !saved.is_empty() || !restored.is_empty();
    Ok(Decided { plan: NvidiaPlan { remap: vec![], restored }, pairs, checks, mixed: fault, takes_part })
}

impl Step for Decided {
    fn side(&self, check: CheckName) -> Option<Side> {
        let result = self.checks.iter().find(|c| c.check == check)?;
        let outcome = if result.ok { Ok(result.detail.clone()) } else { Err(result.detail.clone()) };
        Some(Side { takes_part: self.takes_part, label: "", outcome })
    }

    fn fault(&self, check: CheckName) -> Option<Input> {
        (check == CheckName::Mixed && self.mixed == Some(Fault::Restored)).then_some(Input::HostRoot)
    }

    fn place(&mut self, b: &mut TreeBuilder, prefer: Prefer, warnings: &mut Vec<String>) -> Result<(), PlanError> {
        for gpu in &self.plan.restored {
            b.insert(&gpu.name(), Node::device(DevKind::Char, gpu.rdev, gpu.access)).map_err(PlanError::SpecDevice)?;
        }
        let pairs = std::mem::take(&mut self.pairs);
        self.plan.remap = place_saved_names(b, prefer, &self.plan.restored, pairs, warnings)?;
        Ok(())
    }
}

/// Every saved GPU under its checkpoint name and its earlier names, each leading to its pair
/// unless another restored GPU's native name wins; the remap table says which were served.
fn place_saved_names(
    b: &mut TreeBuilder,
    prefer: Prefer,
    restored: &[RestoredGpu],
    pairs: Vec<Pair>,
    warnings: &mut Vec<String>,
) -> Result<Vec<RemapEntry>, PlanError> {
    let mut remap = Vec::with_capacity(pairs.len());
    for p in pairs {
        // The checkpoint name keeps the mode and owner it had at save time where the metadata
        // recorded them: CRIU refuses a reopened file whose mode changed.
        let node = Node::device(DevKind::Char, p.new.rdev, p.old.recorded.over(p.new.access));
        // Each name the saved GPU had, its own and those of earlier restores, leads to its pair
        // unless another restored GPU's native name wins.
        let mut place = |minor: u32, what: &str| -> Result<bool, PlanError> {
            let name = Nvidia.gpu_name(minor);
            let holder = restored.iter().any(|g| g.minor == minor && g.minor != p.new.minor);
            let served = match (holder, prefer) {
                (true, Prefer::Native) => {
                    warnings.push(format!(
                        "{name}: {what} of saved GPU {} (now {}) collides with host GPU {name}; \
                         serving the host GPU (prefer checkpoint to serve the saved one)",
                        p.old.minor,
                        p.new.name()
                    ));
                    false
                }
                (true, Prefer::Checkpoint) => {
                    warnings.push(format!(
                        "{name}: {what} of saved GPU {} (now {}) collides with host GPU {name}; \
                         serving the saved one, so host GPU {name} has no name of its own",
                        p.old.minor,
                        p.new.name()
                    ));
                    true
                }
                (false, _) => true,
            };
            if served {
                b.insert(&name, node.clone()).map_err(PlanError::SpecDevice)?;
            }
            Ok(served)
        };
        let served = place(p.old.minor, "checkpoint name")?;
        let earlier = p
            .old
            .earlier_minors
            .iter()
            .map(|&minor| Ok(EarlierName { minor, served: place(minor, "earlier name")? }))
            .collect::<Result<Vec<_>, PlanError>>()?;
        remap.push(RemapEntry { old: p.old, new: p.new, by: p.by, served, earlier });
    }
    Ok(remap)
}
