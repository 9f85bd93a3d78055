//! The decision, pure: from the inputs' values to the plan and what is shown of it.
//! [`pairing`] pairs saved with restored GPUs, [`checks`] evaluates the named checks, [`plan`]
//! builds the remap table and the `/dev` [`tree`] ([`amd`] is its AMD step); [`render`] shows a plan (the tables of
//! `devremapd plan`, its JSON, the state file's start), with every cell through [`escape`];
//! [`record`] writes the device list of the save side and [`cuda_map`] the map
//! `cuda-checkpoint` takes, both from a plan.

pub mod amd;
pub mod checks;
pub mod cuda_map;
pub mod escape;
pub mod pairing;
mod place;
pub mod plan;
pub mod record;
pub mod render;
pub mod tree;
