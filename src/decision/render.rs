//! How a plan is shown: one JSON object for scripts (`plan --json`, the state file), and
//! aligned tables for people. The JSON keys are a contract; add, never rename.

use crate::decision::amd::AmdRestored;
use crate::decision::escape::escape;
use crate::decision::pairing::By;
use crate::decision::plan::{EarlierName, Plan};
use crate::decision::tree::{Node, NodeKind};
use crate::family::{AMD, Family, NVIDIA};
use crate::inputs::metadata::Metadata;
use serde_json::{Map, Value, json};
use std::borrow::Cow;
use std::fmt::Write;

/// The JSON of one node, `path` relative to `/dev`.
pub fn node_json(path: &str, node: &Node) -> Value {
    let mut o = Map::new();
    o.insert("path".into(), path.into());
    match &node.kind {
        NodeKind::Dir => {
            o.insert("type".into(), "dir".into());
        }
        NodeKind::Symlink(target) => {
            o.insert("type".into(), "symlink".into());
            o.insert("target".into(), target.as_str().into());
            return Value::Object(o);
        }
        NodeKind::Device(kind, rdev) => {
            o.insert("type".into(), kind.as_str().into());
            o.insert("major".into(), rdev.major.into());
            o.insert("minor".into(), rdev.minor.into());
        }
    }
    o.insert("mode".into(), node.access.mode.into());
    o.insert("uid".into(), node.access.uid.into());
    o.insert("gid".into(), node.access.gid.into());
    Value::Object(o)
}

/// The plan as one JSON object: `remap`, `nodes`, `warnings`, `restored`, `tpu_devices`,
/// `metadata` (`null` without checkpoint metadata), `checks` (every check evaluated, whether it
/// passed, whether it was relaxed, and what it compared), `driver_version` (the restore host's),
/// and `amdgpu` where the plan has AMD GPUs ([`amd_json`]).
pub fn plan_json(plan: &Plan, metadata: Option<&Metadata>) -> Map<String, Value> {
    let remap: Vec<Value> = plan
        .remap
        .iter()
        .map(|e| {
            json!({
                "name": e.name(),
                "old_minor": e.old.minor,
                "major": e.new.rdev.major,
                "minor": e.new.rdev.minor,
                "new_name": e.new.name(),
                "old_uuid": Some(&e.old.uuid).filter(|u| !u.is_empty()),
                "new_uuid": e.new.uuid,
                "served": e.served,
                "explicit": e.by == By::Explicit,
                "by": e.by.as_str(),
                "earlier_names": earlier_json(NVIDIA, &e.earlier),
            })
        })
        .collect();
    let restored: Vec<Value> = plan
        .restored
        .iter()
        .map(|g| {
            json!({
                "name": g.name(),
                "major": g.rdev.major,
                "minor": g.rdev.minor,
                "uuid": g.uuid,
                "bus": g.bus,
                "pci": g.pci.map(|(v, d)| format!("{v:04x}:{d:04x}")),
            })
        })
        .collect();
    let nodes: Vec<Value> = plan.tree.iter().map(|(p, n)| node_json(p, n)).collect();
    let mut o = Map::new();
    o.insert("remap".into(), remap.into());
    o.insert("nodes".into(), nodes.into());
    o.insert("warnings".into(), plan.warnings.clone().into());
    o.insert("restored".into(), restored.into());
    o.insert("tpu_devices".into(), plan.tpus.clone().into());
    let checks: Vec<Value> = plan
        .checks
        .iter()
        .map(|c| json!({"check": c.check.as_str(), "ok": c.ok, "relaxed": c.relaxed, "detail": c.detail}))
        .collect();
    o.insert("checks".into(), checks.into());
    o.insert("driver_version".into(), plan.driver_version.clone().into());
    o.insert(
        "metadata".into(),
        metadata.map_or(
            Value::Null,
            |m| json!({"format": m.format.as_str(), "gpu_key_present": m.gpu_key_present, "saved_gpus": m.gpus.len()}),
        ),
    );
    if !plan.amd.is_empty() {
        o.insert("amdgpu".into(), amd_json(plan));
    }
    o
}

/// A remap entry's earlier names, `{"name": ..., "served": ...}` each.
fn earlier_json(family: &dyn Family, earlier: &[EarlierName]) -> Vec<Value> {
    earlier.iter().map(|n| json!({"name": family.gpu_name(n.minor), "served": n.served})).collect()
}

/// The AMD part: `remap` (each saved render name, where it leads, `by` which rule: `plugin`,
/// `explicit` or `position`, whether it is served, and its `earlier_names` as NVIDIA's entries
/// have them), `restored` (each render node with its
/// KFD `gpu_id`, `node` and `device_id`, `null` where the topology has none), `unpaired` (the
/// saved render names nothing is left for) and `refusal` (the plugin's words where it will
/// refuse the restore, else `null`).
fn amd_json(plan: &Plan) -> Value {
    let remap: Vec<Value> = plan
        .amd
        .remap
        .iter()
        .map(|e| {
            json!({
                "name": e.name(),
                "old_minor": e.old_minor,
                "new_name": AMD.gpu_name(e.new_minor),
                "major": e.rdev.major,
                "minor": e.rdev.minor,
                "by": e.by.as_str(),
                "served": e.served,
                "earlier_names": earlier_json(AMD, &e.earlier),
            })
        })
        .collect();
    let unpaired: Vec<String> = plan.amd.unpaired.iter().map(|&m| AMD.gpu_name(m)).collect();
    let restored: Vec<Value> = plan.amd.restored.iter().map(amd_restored_json).collect();
    json!({"remap": remap, "restored": restored, "unpaired": unpaired, "refusal": plan.amd.refusal})
}

/// A restored render node, with its KFD identity where the topology gives it.
fn amd_restored_json(g: &AmdRestored) -> Value {
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

/// Columns are padded to their widest cell, up to this width: a longer cell (a long path) runs
/// over and shifts its own line only.
const MAX_COLUMN: usize = 40;

/// An aligned table. Every cell is escaped (see [`crate::decision::escape`]): cells hold names, paths and
/// uuids from the inputs.
fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let cells: Vec<Vec<Cow<str>>> = std::iter::once(header.iter().map(|h| escape(h)).collect())
        .chain(rows.iter().map(|row| row.iter().map(|c| escape(c)).collect()))
        .collect();
    let mut widths = vec![0; header.len()];
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count()).min(MAX_COLUMN);
        }
    }
    for row in &cells {
        let text: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        let _ = writeln!(out, "  {}", text.join("  ").trim_end());
    }
}

/// The plan for people: the pairing table, the tree, the warnings.
pub fn plan_text(plan: &Plan) -> String {
    let mut out = String::new();
    let amd_saved = plan.amd.remap.len() + plan.amd.unpaired.len();
    if plan.remap.is_empty() && amd_saved == 0 {
        out.push_str("remap: none (no saved GPUs)\n");
    } else if !plan.remap.is_empty() {
        let _ = writeln!(out, "remap ({} saved GPUs):", plan.remap.len());
        let rows: Vec<Vec<String>> = plan
            .remap
            .iter()
            .flat_map(|e| {
                let row = |name: String, status: String| {
                    vec![
                        name,
                        or_dash(Some(&e.old.uuid).filter(|u| !u.is_empty())),
                        format!("{} ({})", e.new.name(), e.new.rdev),
                        or_dash(e.new.uuid.as_ref()),
                        status,
                    ]
                };
                // An earlier restore's names of the GPU, each a row of its own.
                std::iter::once(row(e.name(), status(e.served).into()))
                    .chain(earlier_rows(NVIDIA, &e.earlier, e.name()).map(move |(name, what)| row(name, what)))
            })
            .collect();
        table(&mut out, &["OLD", "OLD UUID", "NEW", "NEW UUID", ""], &rows);
    }
    if amd_saved > 0 {
        let _ = writeln!(out, "amdgpu remap ({amd_saved} saved GPUs):");
        let rows: Vec<Vec<String>> =
            plan.amd
                .remap
                .iter()
                .flat_map(|e| {
                    let row = |name: String, status: String| {
                        vec![name, format!("{} ({})", AMD.gpu_name(e.new_minor), e.rdev), e.by.as_str().into(), status]
                    };
                    std::iter::once(row(e.name(), status(e.served).into()))
                        .chain(earlier_rows(AMD, &e.earlier, e.name()).map(move |(name, what)| row(name, what)))
                })
                .chain(
                    plan.amd.unpaired.iter().map(|&m| {
                        vec![AMD.gpu_name(m), "-".into(), "-".into(), "not served: no restored GPU left".into()]
                    }),
                )
                .collect();
        table(&mut out, &["OLD", "NEW", "BY", ""], &rows);
    }
    if !plan.tpus.is_empty() {
        let _ = writeln!(out, "tpu: {} saved TPU devices (reported, not remapped)", plan.tpus.len());
    }
    let _ = writeln!(out, "tree ({} nodes):", plan.tree.iter().count());
    let rows: Vec<Vec<String>> = plan
        .tree
        .iter()
        .map(|(path, node)| {
            let (kind, what) = match &node.kind {
                NodeKind::Dir => ("dir", String::new()),
                NodeKind::Symlink(t) => ("symlink", format!("-> {t}")),
                NodeKind::Device(k, rdev) => (k.as_str(), rdev.to_string()),
            };
            let mode = match node.kind {
                NodeKind::Symlink(_) => String::new(),
                _ => format!("{:04o} {}:{}", node.access.mode, node.access.uid, node.access.gid),
            };
            vec![format!("/dev/{path}"), kind.into(), what, mode]
        })
        .collect();
    table(&mut out, &["PATH", "TYPE", "DEVICE/TARGET", "MODE"], &rows);
    for w in &plan.warnings {
        let _ = writeln!(out, "warning: {}", escape(w));
    }
    out
}

/// A remap table's status of a name.
fn status(served: bool) -> &'static str {
    if served { "served" } else { "not served: name collision" }
}

/// The table's rows of a remap entry's earlier names (of the checkpoint name `of`): each name
/// and its status.
fn earlier_rows<'a>(
    family: &'static dyn Family,
    earlier: &'a [EarlierName],
    of: String,
) -> impl Iterator<Item = (String, String)> + 'a {
    earlier.iter().map(move |n| (family.gpu_name(n.minor), format!("{} (an earlier name of {of})", status(n.served))))
}

fn or_dash(s: Option<&String>) -> String {
    s.cloned().unwrap_or_else(|| "-".into())
}

/// What a node is, in a word: its device number, `symlink <target>`, or `dir`.
pub fn node_what(node: &Node) -> String {
    match &node.kind {
        NodeKind::Device(_, rdev) => rdev.to_string(),
        NodeKind::Symlink(t) => format!("symlink {t}"),
        NodeKind::Dir => "dir".to_owned(),
    }
}

/// What changed between two nodes at one name, for the reload log line: the device (or
/// target), the mode, the owner; only the parts that differ, so a change of mode alone does not
/// read `1:3 -> 1:3`.
pub fn node_change(before: &Node, after: &Node) -> String {
    let mut parts = Vec::new();
    if before.kind != after.kind {
        parts.push(format!("{} -> {}", node_what(before), node_what(after)));
    }
    let (a, b) = (before.access, after.access);
    if a.mode != b.mode {
        parts.push(format!("mode {:04o} -> {:04o}", a.mode, b.mode));
    }
    if (a.uid, a.gid) != (b.uid, b.gid) {
        parts.push(format!("owner {}:{} -> {}:{}", a.uid, a.gid, b.uid, b.gid));
    }
    parts.join(" and ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, DevKind, Rdev};

    /// Bug (issue 10.9): a reload that changed only a node's mode or owner logged
    /// `nvidia0: 1:3 -> 1:3`; the line says what changed, and only that.
    #[test]
    fn node_change_names_what_changed() {
        let dev = |minor, mode, uid| Node::device(DevKind::Char, Rdev::new(1, minor), Access { mode, uid, gid: 0 });
        assert_eq!(node_change(&dev(3, 0o666, 0), &dev(3, 0o600, 0)), "mode 0666 -> 0600");
        assert_eq!(node_change(&dev(3, 0o666, 0), &dev(3, 0o666, 7)), "owner 0:0 -> 7:0");
        assert_eq!(node_change(&dev(3, 0o666, 0), &dev(5, 0o666, 0)), "1:3 -> 1:5");
        assert_eq!(node_change(&dev(3, 0o666, 0), &dev(5, 0o660, 0)), "1:3 -> 1:5 and mode 0666 -> 0660");
        assert_eq!(node_change(&dev(3, 0o666, 0), &Node::dir()), "1:3 -> dir and mode 0666 -> 0755");
        assert_eq!(node_change(&Node::symlink("a"), &Node::symlink("b")), "symlink a -> symlink b");
    }
}
