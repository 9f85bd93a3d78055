//! Device families: what one kind of GPU (one driver) brings to a container's `/dev`, each
//! one folder behind the [`Family`] trait.
//!
//! A family says which names of the host's device directory are its GPUs and which of its
//! nodes pass through unchanged (NVIDIA: `nvidiaN`, and `nvidiactl`, `nvidia-uvm`,
//! `nvidia-caps/...`), what its driver's files under the host root say of each GPU, and how
//! its GPUs are named and recognised in a spec. Its folder also holds its items of the
//! checkpoint's device list (`metadata.rs`), its step of the plan (`plan.rs`: its restored GPUs,
//! pairing, side of the checks and names in the tree, behind [`crate::decision::seam::Step`])
//! and its part of a plan as shown and recorded (`show.rs`, [`crate::decision::seam::Shown`]).
//!
//! The wiring, the only code that names every family: [`table`] (the families in the order
//! they are asked, the device scan and host facts of all of them, the device list's items
//! handed to their families) and [`plans`] (every family's step run, every family's part of a
//! plan held). [`facts`] is what the families' driver files say. Nothing in this module names a
//! family, so a family's folder depends on the trait without a cycle.
//!
//! Assumption: the families' names do not overlap (no name in a device directory is two
//! families' node), so the order of the table changes nothing but the order of the scan.

pub mod amd;
pub mod facts;
pub mod nvidia;
pub mod plans;
pub mod table;

use crate::device::{Access, DevKind, Rdev};
use crate::inputs::host::{DevDir, DevDirScan, HostError};
use facts::HostFacts;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One device family's rules. Every method is pure but the two that read the host, which read
/// only through what they are given (an open [`DevDir`], files under the host root).
pub trait Family: Sync {
    /// Adds this family's GPU and pass-through nodes in the device directory to `scan`.
    /// A name that is this family's but wrong (a GPU name with no valid number, a non-char
    /// node under a GPU name) is an error naming it.
    fn scan_dev_dir(&self, dir: &mut DevDir, scan: &mut DevDirScan) -> Result<(), HostError>;
    /// Adds what this family's driver files under `root` say to `facts`. Best effort: what is
    /// missing or unreadable is left out, an oversized file with a warning.
    fn read_host_facts(&self, root: &Path, facts: &mut HostFacts);
    /// The `/dev`-relative name of this family's GPU `minor` (`nvidia3`).
    fn gpu_name(&self, minor: u32) -> String;
    /// The GPU minor a spec's device entry grants, if it is one of this family's GPUs.
    fn gpu_minor_of_device(&self, kind: DevKind, rdev: Rdev) -> Option<u32>;
    /// Whether the family's runtime hook, where `spec` asks for it, gives the container this
    /// pass-through node (`rel_path` under `/dev`) though the spec does not list it.
    fn hook_gives(&self, rel_path: &str, spec: &crate::inputs::spec::SpecView) -> bool;

    /// The spec's entries for this family's GPUs, by minor: the number and the mode and owner
    /// its node is made with. runc makes a path's node from its first entry, whatever it is (a
    /// later one finds it there), so an entry that is not the first at its path gives nothing;
    /// of those that are, a GPU takes the one at its own path ([`Family::gpu_name`]), else the
    /// first of its minor at another path. Bugs (found from outside): NVIDIA's GPUs took the
    /// last entry, and a spec listing `/dev/nvidia1` twice, `0600 1000:1000` then `0666 0:0`,
    /// was served `0666`, where runc's node is `0600`; and a GPU entry after another device at
    /// the same path (a block device, `1:3`, another GPU) gave the GPU, which runc's node there
    /// is not.
    fn spec_gpus(&self, spec: &crate::inputs::spec::SpecView) -> BTreeMap<u32, (Rdev, Access)> {
        let mut by_minor = BTreeMap::new();
        let mut at_own_path = BTreeSet::new();
        let mut paths = BTreeSet::new();
        for dev in &spec.devices {
            if dev.rel_path.as_deref().is_some_and(|p| !paths.insert(p)) {
                continue;
            }
            let Some(minor) = self.gpu_minor_of_device(dev.kind, dev.rdev) else { continue };
            let own = dev.rel_path.as_deref() == Some(self.gpu_name(minor).as_str());
            if !by_minor.contains_key(&minor) || (own && !at_own_path.contains(&minor)) {
                by_minor.insert(minor, (dev.rdev, dev.access));
            }
            if own {
                at_own_path.insert(minor);
            }
        }
        by_minor
    }
}
