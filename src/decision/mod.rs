//! The decision, pure: from the inputs' values to the plan and what is shown of it, every
//! family run the same way. [`seam`] is what a family's step takes and gives; [`pairing`] and
//! [`checks`] are what every family's pairing and checks share ([`checks::merged`] makes one
//! result of every family's side); [`plan`] runs every family's step and builds the remap
//! table and the `/dev` [`tree`]; [`render`] shows a plan (the tables of `devremapd plan`, its
//! JSON, the state file's start) from [`table`]'s pieces, with every cell through [`escape`];
//! [`record`] writes the device list of the save side from a plan. Each family's own rules are
//! in its folder under `crate::family`.

pub mod checks;
pub mod escape;
pub mod pairing;
mod place;
pub mod plan;
pub mod record;
pub mod render;
pub mod seam;
pub mod table;
pub mod tree;
