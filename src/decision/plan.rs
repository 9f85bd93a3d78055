//! From gathered inputs to the remap table and the `/dev` tree: the whole decision, pure.
//!
//! Order of construction, each step able to replace a device placed by an earlier one: runc's
//! default nodes; the spec's devices; the host's pass-through nodes (the spec's mode and owner
//! where it lists them); then every family in `family::table::FAMILIES`'s order places its restored
//! GPUs under their native names and its saved GPUs under their checkpoint names, unless such a
//! name is another restored GPU's native name and natives are preferred (each family's step is
//! in its folder, behind [`crate::decision::seam::Step`]); last, the mount points of the spec's mounts under
//! `/dev` (a directory, or for a file bind mount whatever node is there or a placeholder) and,
//! for a terminal, the `console` placeholder (the steps that place no GPU are in `place`).
//! Nothing else enters the tree.
//!
//! Every error is made where its cause is known, as the variant of the input that holds it
//! ([`PlanError::input`]). The families' checks are merged into one result per check
//! ([`checks::merged`]).

#[cfg(test)]
pub(crate) mod fixtures;
#[cfg(test)]
mod tests;

use crate::decision::checks::{self, CheckName, CheckResult};
use crate::decision::pairing::PairingError;
use crate::decision::place;
use crate::decision::tree::{Tree, TreeBuilder};
use crate::family::plans::{self, Parts};
use crate::family::table::FAMILIES;
use crate::inputs::host::HostNode;
use serde_json::Value;

pub use crate::decision::seam::{EarlierName, Input, Inputs, PlanError, Prefer};

/// The result: what `plan` prints and what the daemon serves.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    /// Every family's remap table and restored GPUs ([`Parts`]).
    #[serde(flatten)]
    pub parts: Parts,
    pub tree: Tree,
    pub warnings: Vec<String>,
    pub tpus: Vec<Value>,
    /// The restore host's driver version, where its driver tells it.
    #[serde(default)]
    pub driver_version: Option<String>,
    /// Every check evaluated, in [`CheckName::ALL`]'s order; [`gate`] refuses the plan when one
    /// failed unrelaxed. Empty in a plan handed over by a server before checks existed.
    #[serde(default)]
    pub checks: Vec<CheckResult>,
    /// Whose fault a failed `mixed` check is: the checkpoint's or the host root's.
    #[serde(skip)]
    pub mixed_input: Input,
}

/// Whether pass-through node `node`, which the spec does not list, is served. Without a spec
/// (the operator's own `--host-dev`) the whole directory is. With one, the container gets what
/// runc makes from it and what a family's hook adds where the spec asks for it (issue 29.3: the
/// NVIDIA hook's control nodes, as its driver capabilities give them); nothing else adds an
/// unlisted node, AMD's `kfd` included.
fn unlisted_passthrough(inputs: &Inputs, node: &HostNode) -> bool {
    let Some(spec) = &inputs.spec else { return true };
    spec.hook.is_some() && FAMILIES.iter().any(|f| f.hook_gives(&node.rel_path, spec))
}

/// Computes the remap table and the tree: every family's checks and pairing first, then the
/// tree in the order of the module's documentation, each step able to replace a non-directory
/// placed by an earlier one.
pub fn build(inputs: &Inputs) -> Result<Plan, PlanError> {
    // The restore side first: its faults (the driver's files, the hook's selection) are said
    // before a map that has nothing to pair.
    let restored = plans::restore(inputs)?;
    if inputs.metadata.is_none() && !inputs.device_map.is_empty() {
        return Err(PlanError::DeviceMap(PairingError::NoCheckpoint));
    }
    let mut decided = restored.pair(inputs)?;
    let checks: Vec<CheckResult> = CheckName::ALL
        .into_iter()
        .map(|check| {
            let sides: Vec<checks::Side> = decided.steps().iter().filter_map(|s| s.side(check)).collect();
            checks::merged(check, &inputs.relax, &sides)
        })
        .collect();
    let mixed_input = decided.steps().iter().find_map(|s| s.fault(CheckName::Mixed)).unwrap_or(Input::Checkpoint);
    let mut warnings = inputs.host.warnings.clone();
    warnings.extend(inputs.dev_dir.iter().flat_map(|d| d.warnings.iter().cloned()));
    warnings.extend(
        checks.iter().filter(|c| !c.ok && c.relaxed).map(|c| format!("check {} relaxed: {}", c.check, c.detail)),
    );

    let mut b = TreeBuilder::default();
    place::defaults(&mut b, inputs.host.has_kcore);
    if let Some(spec) = &inputs.spec {
        place::spec_devices(&mut b, spec, &mut warnings)?;
    }
    if let Some(dir) = &inputs.dev_dir {
        place::passthrough(&mut b, &dir.passthrough, |node| unlisted_passthrough(inputs, node))
            .map_err(PlanError::HostNode)?;
    }
    for step in decided.steps() {
        step.place(&mut b, inputs.prefer, &mut warnings)?;
    }
    if let Some(spec) = &inputs.spec {
        place::mounts(&mut b, spec, &mut warnings)?;
    }

    let tpus = inputs.metadata.as_ref().map(|m| m.tpus.clone()).unwrap_or_default();
    Ok(Plan {
        parts: decided.parts(),
        tree: b.build(),
        warnings,
        tpus,
        driver_version: inputs.host.driver_version.clone(),
        checks,
        mixed_input,
    })
}

/// Refuses a plan one of whose checks failed unrelaxed: the first such, naming the input that
/// holds the cause (for `mixed`, the input its family named, else the checkpoint, which does
/// not fit this host).
pub fn gate(plan: &Plan) -> Result<(), PlanError> {
    match plan.checks.iter().find(|c| c.refuses()) {
        Some(result) => {
            let input = if result.check == CheckName::Mixed { plan.mixed_input } else { Input::Checkpoint };
            Err(PlanError::Check { input, result: result.clone() })
        }
        None => Ok(()),
    }
}

/// The number of saved GPUs, of every family, whose checkpoint name is served.
pub fn served_names(plan: &Plan) -> usize {
    plan.parts.shown().iter().map(|p| p.served()).sum()
}
