//! Every family's step of the plan run ([`restore`], then [`Restored::pair`]) and every
//! family's part of a plan held ([`Parts`]), in the table's order: what `decision::plan` runs
//! without naming a family.
//!
//! Wiring, no rules: each family's step is its folder's `plan.rs`.

use super::{amd, nvidia};
use crate::decision::seam::{Inputs, PlanError, Shown, Step};

/// Every family's part of a plan, in the table's order. Serialized (the state file's plan, a
/// plan handed to the next server) as the plan's own keys: NVIDIA's `remap` and `restored`,
/// AMD's `amd`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Parts {
    #[serde(flatten)]
    pub nvidia: nvidia::plan::NvidiaPlan,
    /// The AMD render nodes and where the checkpoint's lead.
    #[serde(default)]
    pub amd: amd::plan::AmdPlan,
}

impl Parts {
    /// Every family's part, to be shown.
    pub fn shown(&self) -> [&dyn Shown; 2] {
        [&self.nvidia, &self.amd]
    }
}

/// Every family's step, decided: the families' parts before any node is placed.
pub struct Decided {
    nvidia: nvidia::plan::Decided,
    amd: amd::plan::Decided,
}

impl Decided {
    /// Every family's step, in the table's order.
    pub fn steps(&mut self) -> [&mut dyn Step; 2] {
        [&mut self.nvidia, &mut self.amd]
    }

    /// The families' parts of the plan, once placed.
    pub fn parts(self) -> Parts {
        Parts { nvidia: self.nvidia.plan, amd: self.amd.plan }
    }
}

/// Every family's restored GPUs, found before anything is paired.
pub struct Restored {
    nvidia: Vec<nvidia::RestoredGpu>,
    amd: Vec<amd::plan::AmdRestored>,
}

/// Finds every family's restored GPUs on `inputs`, in the table's order (each family's checks
/// of the host's facts first): the first family's error is the plan's.
pub fn restore(inputs: &Inputs) -> Result<Restored, PlanError> {
    Ok(Restored { nvidia: nvidia::plan::restore(inputs)?, amd: amd::plan::restore(inputs) })
}

impl Restored {
    /// Pairs every family's saved GPUs with its restored ones and evaluates its side of the
    /// checks, in the table's order: the first family's error is the plan's.
    pub fn pair(self, inputs: &Inputs) -> Result<Decided, PlanError> {
        Ok(Decided { nvidia: nvidia::plan::decide(inputs, self.nvidia)?, amd: amd::plan::step(inputs, self.amd)? })
    }
}
