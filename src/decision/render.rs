//! How a plan is shown: one JSON object for scripts (`plan --json`, the state file), and
//! aligned tables for people. The JSON keys are a contract; add, never rename.

use crate::decision::escape::escape;
use crate::decision::plan::Plan;
use crate::decision::seam::JsonAt;
use crate::decision::table::table;
use crate::decision::tree::{Node, NodeKind};
use crate::inputs::metadata::Metadata;
use serde_json::{Map, Value, json};
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

/// The plan as one JSON object: each family's first keys (NVIDIA's `remap`), `nodes`,
/// `warnings`, each family's keys after them (NVIDIA's `restored`), `tpu_devices`, `checks`
/// (every check evaluated, whether it passed, whether it was relaxed, and what it compared),
/// `driver_version` (the restore host's), `metadata` (`null` without checkpoint metadata), and
/// each family's last keys (AMD's `amdgpu`, where the plan has AMD GPUs).
pub fn plan_json(plan: &Plan, metadata: Option<&Metadata>) -> Map<String, Value> {
    let families = plan.parts.shown();
    let mut o = Map::new();
    families.iter().for_each(|f| f.json(JsonAt::First, &mut o));
    let nodes: Vec<Value> = plan.tree.iter().map(|(p, n)| node_json(p, n)).collect();
    o.insert("nodes".into(), nodes.into());
    o.insert("warnings".into(), plan.warnings.clone().into());
    families.iter().for_each(|f| f.json(JsonAt::AfterWarnings, &mut o));
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
            |m| json!({"format": m.format.as_str(), "gpu_key_present": m.gpu_key_present, "saved_gpus": m.saved.gpus.len()}),
        ),
    );
    families.iter().for_each(|f| f.json(JsonAt::Last, &mut o));
    o
}

/// The plan for people: the pairing table, the tree, the warnings.
pub fn plan_text(plan: &Plan) -> String {
    let mut out = String::new();
    let families = plan.parts.shown();
    if families.iter().all(|f| f.saved() == 0) {
        out.push_str("remap: none (no saved GPUs)\n");
    }
    families.iter().for_each(|f| f.text(&mut out));
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
