//! AMD's part of a plan, shown: its `amdgpu` key of `plan --json`, its remap table, and its
//! `"kind": "amdgpu"` items of `record`'s device list (see [`super::metadata`]).
//!
//! Pure. A record is refused ([`Shown::unrecordable`]) where the host's KFD topology could not
//! be read and so a restored GPU's identity would be lost; what the host's files merely lack is
//! said ([`Shown::gaps`]), not refused: that host's driver does not describe the GPU, and no
//! reading will.

use super::metadata::{self, AmdSaved};
use super::plan::{AmdPlan, AmdRestored};
use super::topology::kernfs_order;
use super::{Amd, facts_unknown};
use crate::decision::seam::{JsonAt, Shown, earlier_minors};
use crate::decision::table::{earlier_json, earlier_rows, status, table};
use crate::decision::tree::Tree;
use crate::family::Family;
use crate::inputs::metadata::RecordedAccess;
use serde_json::{Map, Value, json};
use std::fmt::Write;

impl Shown for AmdPlan {
    fn saved(&self) -> usize {
        self.remap.len() + self.unpaired.len()
    }

    fn served(&self) -> usize {
        self.remap.iter().filter(|e| e.served).count()
    }

    /// `amdgpu`, last, where the plan has AMD GPUs: `remap` (each saved render name, where it
    /// leads, `by` which rule: `plugin`, `explicit` or `position`, whether it is served, and its
    /// `earlier_names` as NVIDIA's entries have them), `restored` (each render node with its
    /// KFD `gpu_id`, `node` and `device_id`, `null` where the topology has none), `unpaired`
    /// (the saved render names nothing is left for) and `refusal` (the plugin's words where it
    /// will refuse the restore, else `null`).
    fn json(&self, at: JsonAt, o: &mut Map<String, Value>) {
        if at != JsonAt::Last || self.is_empty() {
            return;
        }
        let remap: Vec<Value> = self
            .remap
            .iter()
            .map(|e| {
                json!({
                    "name": e.name(),
                    "old_minor": e.old_minor,
                    "new_name": Amd.gpu_name(e.new_minor),
                    "major": e.rdev.major,
                    "minor": e.rdev.minor,
                    "by": e.by.as_str(),
                    "served": e.served,
                    "earlier_names": earlier_json(&Amd, &e.earlier),
                })
            })
            .collect();
        let unpaired: Vec<String> = self.unpaired.iter().map(|&m| Amd.gpu_name(m)).collect();
        let restored: Vec<Value> = self.restored.iter().map(restored_json).collect();
        o.insert(
            "amdgpu".into(),
            json!({"remap": remap, "restored": restored, "unpaired": unpaired, "refusal": self.refusal}),
        );
    }

    fn text(&self, out: &mut String) {
        let saved = self.saved();
        if saved == 0 {
            return;
        }
        let _ = writeln!(out, "amdgpu remap ({saved} saved GPUs):");
        let rows: Vec<Vec<String>> = self
            .remap
            .iter()
            .flat_map(|e| {
                let row = |name: String, status: String| {
                    vec![name, format!("{} ({})", Amd.gpu_name(e.new_minor), e.rdev), e.by.as_str().into(), status]
                };
                std::iter::once(row(e.name(), status(e.served).into()))
                    .chain(earlier_rows(&Amd, &e.earlier, e.name()).map(move |(name, what)| row(name, what)))
            })
            .chain(
                self.unpaired
                    .iter()
                    .map(|&m| vec![Amd.gpu_name(m), "-".into(), "-".into(), "not served: no restored GPU left".into()]),
            )
            .collect();
        table(out, &["OLD", "NEW", "BY", ""], &rows);
    }

    /// One item per restored render node, in the order CRIU's amdgpu plugin lists the GPUs (the
    /// topology's node order; those the topology lacks last, by minor), with the plugin's
    /// identity of it, the mode, uid and gid of the node served under its name, and, when
    /// `carried`, its earlier render names as NVIDIA's items have theirs.
    fn record(&self, tree: &Tree, _driver_version: Option<&String>, carried: bool) -> Vec<Value> {
        let mut gpus: Vec<&AmdRestored> = self.restored.iter().collect();
        gpus.sort_by_cached_key(|g| (g.gpu.is_none(), g.gpu.as_ref().map(|k| kernfs_order(&k.node.to_string()))));
        gpus.into_iter()
            .map(|g| {
                let access = tree.get(&g.name()).map_or(g.access, |n| n.access);
                let recorded = RecordedAccess { mode: Some(access.mode), uid: Some(access.uid), gid: Some(access.gid) };
                let names = self.remap.iter().map(|e| (e.new_minor, e.served.then_some(e.old_minor), &e.earlier[..]));
                let earlier_minors = earlier_minors(names, g.minor);
                metadata::to_json(&AmdSaved { minor: g.minor, gpu: g.gpu.clone(), recorded, earlier_minors }, carried)
            })
            .collect()
    }

    /// A KFD topology that could not be read leaves a restored GPU's identity unknown: refused
    /// rather than recorded without it, since a record is written once, at checkpoint, and one
    /// without the identity pairs by position on restore, which is found out only then.
    fn unrecordable(&self) -> Option<(String, String)> {
        let why = self.unread.as_ref()?;
        self.restored.iter().find(|g| g.gpu.is_none()).map(|g| (why.clone(), g.name()))
    }

    fn unread_warning(&self) -> Option<String> {
        self.unread.as_deref().map(facts_unknown)
    }

    fn gaps(&self) -> Vec<String> {
        self.restored
            .iter()
            .filter(|g| g.gpu.is_none() && self.unread.is_none())
            .map(|g| {
                format!(
                    "GPU {} recorded without its KFD identity: the host root's KFD topology has no GPU with \
                     drm_render_minor {}; a restore pairs it by position",
                    g.name(),
                    g.minor
                )
            })
            .collect()
    }
}

/// A restored render node, with its KFD identity where the topology gives it.
fn restored_json(g: &AmdRestored) -> Value {
    let kfd = g.gpu.as_ref();
    json!({
        "name": g.name(),
        "gpu_id": kfd.map(|k| k.gpu_id),
        "node": kfd.map(|k| k.node),
        "device_id": kfd.map(|k| format!("{:04x}", k.facts.device_id)),
        "major": g.rdev.major,
        "minor": g.rdev.minor,
    })
}
