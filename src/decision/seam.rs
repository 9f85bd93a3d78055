//! The seam between the shared plan and each device family: what a family's step of the plan
//! takes ([`Inputs`]), what it may fail with ([`PlanError`]), and the two traits a family
//! implements, [`Step`] (its part decided, placed in the tree) and [`Shown`] (its part of a
//! plan as `plan` prints it and `record` writes it). `decision::plan` runs every family in
//! `family::table::FAMILIES`'s order through them and names none.
//!
//! Pure. Assumption: the families' names and their `--device-map` entries do not overlap, so
//! one family's step never places or pairs another's GPU; the order of the families decides
//! only the order of their warnings, their checks' details and their record items.

use crate::decision::checks::{self, CheckName, CheckResult};
use crate::decision::pairing::{MapPair, PairingError, Rule};
use crate::decision::tree::{Tree, TreeBuilder, TreeError};
use crate::family::amd::pairing::PairError;
use crate::family::amd::properties::Switches;
use crate::family::facts::HostFacts;
use crate::family::nvidia::visible::VisibleError;
use crate::inputs::host::DevDirScan;
use crate::inputs::metadata::Metadata;
use crate::inputs::spec::SpecView;
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use thiserror::Error;

/// Which name wins when a checkpoint name is another restored GPU's native name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Prefer {
    /// The driver's view stays consistent: `nvidiaN` is host GPU N.
    #[default]
    Native,
    /// The restore's view: `nvidiaN` is what saved GPU N now is.
    Checkpoint,
}

/// Everything the plan is made from, already read.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    pub metadata: Option<Metadata>,
    pub spec: Option<SpecView>,
    /// The host device directory's GPU and pass-through nodes, when one was scanned.
    pub dev_dir: Option<DevDirScan>,
    pub host: HostFacts,
    pub device_map: Vec<MapPair>,
    pub prefer: Prefer,
    /// Identity first, or gVisor's positional rule (`--pairing positional`).
    pub pairing: Rule,
    /// The checks whose failure is a warning, not a refusal (`--relax`).
    pub relax: BTreeSet<CheckName>,
    /// CRIU's amdgpu plugin's `KFD_*_CHECK` switches, as its environment sets them.
    pub kfd: Switches,
}

/// A name a saved GPU had from an earlier restore, and whether it leads to its pair here.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EarlierName {
    pub minor: u32,
    pub served: bool,
}

/// Why no plan could be made from inputs that each parsed: one variant per input that can hold
/// the cause, made where the cause is known.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PlanError {
    /// The saved GPUs cannot be remapped (a subdevice, mixed models).
    #[error("{0}")]
    Checkpoint(PairingError),
    /// Saved GPUs, and no input that gives restored ones at all: neither a spec nor a device
    /// directory.
    #[error(
        "{0}; give the restored GPUs with --spec (the container's OCI spec) or --host-dev (a directory of their nvidiaN nodes)"
    )]
    NoRestoreSide(PairingError),
    /// The spec gives the restored GPUs (its devices, or the hook's selection) and too few.
    #[error("{0}")]
    SpecGpus(PairingError),
    /// `NVIDIA_VISIBLE_DEVICES` names GPUs the host cannot give.
    #[error("{0}")]
    Visible(VisibleError),
    /// The device directory gives the restored GPUs and too few.
    #[error("{0}")]
    HostDevGpus(PairingError),
    /// `NVIDIA_VISIBLE_DEVICES` selects a GPU that the device directory holds no node of.
    #[error("NVIDIA_VISIBLE_DEVICES selects nvidia{0}, which is not here")]
    HostDevMissing(u32),
    /// A host pass-through node cannot be placed (a spec node is in its way).
    #[error("host node {0}")]
    HostNode(TreeError),
    /// Two of the driver's information files describe the same GPU minor, UUID or bus, which
    /// the driver never writes: which GPU a name means would be a guess.
    #[error("the driver's information files of {first} and {second} both give {what}")]
    DriverFilesClash { first: String, second: String, what: String },
    /// An explicit pair cannot be made.
    #[error("{0}")]
    DeviceMap(PairingError),
    /// An explicit pair of AMD render nodes cannot be made.
    #[error("{0}")]
    AmdDeviceMap(PairError),
    #[error("spec device {0}")]
    SpecDevice(TreeError),
    #[error("spec mount {0}")]
    SpecMount(TreeError),
    /// A named check failed and was not relaxed: the checkpoint does not fit this host (or, for
    /// mixed restored GPUs, the host root's GPUs are two models).
    #[error("{}: {}", .result.check, .result.detail)]
    Check { input: Input, result: CheckResult },
}

/// The inputs a plan error can be about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Input {
    #[default]
    Checkpoint,
    Spec,
    HostDev,
    HostRoot,
    DeviceMap,
}

impl PlanError {
    /// The input that holds the cause.
    pub fn input(&self) -> Input {
        match self {
            PlanError::Checkpoint(_) | PlanError::NoRestoreSide(_) => Input::Checkpoint,
            PlanError::SpecGpus(_) | PlanError::Visible(_) | PlanError::SpecDevice(_) | PlanError::SpecMount(_) => {
                Input::Spec
            }
            PlanError::HostDevGpus(_) | PlanError::HostDevMissing(_) | PlanError::HostNode(_) => Input::HostDev,
            PlanError::DriverFilesClash { .. } => Input::HostRoot,
            PlanError::DeviceMap(_) | PlanError::AmdDeviceMap(_) => Input::DeviceMap,
            PlanError::Check { input, .. } => *input,
        }
    }
}

/// A family's part of a plan once its GPUs are known and paired, before any node is placed.
pub trait Step {
    /// This family's side of `check`; `None` where the family has nothing to say of it.
    fn side(&self, check: CheckName) -> Option<checks::Side>;
    /// The input that holds the cause of this family's failed `check`, where it is not the
    /// checkpoint.
    fn fault(&self, check: CheckName) -> Option<Input>;
    /// Places the family's restored GPUs under their names, then every saved one's checkpoint
    /// and earlier names, each leading to its pair unless a restored GPU's name wins (`prefer`);
    /// adds the family's warnings (its decision's, then the collisions').
    fn place(&mut self, b: &mut TreeBuilder, prefer: Prefer, warnings: &mut Vec<String>) -> Result<(), PlanError>;
}

/// Where in `plan --json`'s object a family's keys go: the keys' order is the contract's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonAt {
    /// Before `nodes`.
    First,
    /// After `warnings`.
    AfterWarnings,
    /// After `metadata`, last.
    Last,
}

/// A family's part of a plan, shown: `plan`'s text and JSON, the state file, `record`'s items.
pub trait Shown {
    /// How many saved GPUs of this family the plan has.
    fn saved(&self) -> usize;
    /// How many of them have their checkpoint name served.
    fn served(&self) -> usize;
    /// Adds this family's keys at `at` to `plan --json`'s object.
    fn json(&self, at: JsonAt, o: &mut Map<String, Value>);
    /// Writes this family's remap table, where it has saved GPUs.
    fn text(&self, out: &mut String);
    /// The recorded device list's items of this family's restored GPUs: their nodes as `tree`
    /// serves them, the host's `driver_version`, and with `carried` their earlier names.
    fn record(&self, tree: &Tree, driver_version: Option<&String>, carried: bool) -> Vec<Value>;
    /// Why a record of this family's GPUs would lose what identifies one: `(why, the GPU)`.
    fn unrecordable(&self) -> Option<(String, String)>;
    /// What `plan` warns of the family's host facts that could not be read, also said by a
    /// record that is let through.
    fn unread_warning(&self) -> Option<String>;
    /// One line per restored GPU the host's files did not describe whole, naming what it is
    /// recorded without.
    fn gaps(&self) -> Vec<String>;
}

/// The names other than its own that lead to restored GPU `minor` in a plan's tree: of each
/// remap entry `(its restored minor, its checkpoint minor where served, its earlier names)`,
/// the served names of those paired with `minor`.
pub fn earlier_minors<'a>(
    entries: impl Iterator<Item = (u32, Option<u32>, &'a [EarlierName])>,
    minor: u32,
) -> Vec<u32> {
    let names: BTreeSet<u32> = entries
        .filter(|&(new, _, _)| new == minor)
        .flat_map(|(_, own, earlier)| own.into_iter().chain(earlier.iter().filter(|n| n.served).map(|n| n.minor)))
        .filter(|&m| m != minor)
        .collect();
    names.into_iter().collect()
}
