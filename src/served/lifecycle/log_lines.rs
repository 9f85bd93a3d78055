//! What the log lines of a served plan say of it: its warnings, and what a reload or a
//! takeover changed.

use crate::decision::render;
use crate::decision::tree::Diff;
use crate::inputs::load::Loaded;

/// `; warning: ...` for each warning of a plan, for the log line that serves it.
pub fn warnings(loaded: &Loaded) -> String {
    loaded.plan.warnings.iter().map(|w| format!("; warning: {w}")).collect()
}

/// `nvidia0: 1:5 -> 1:7, nvidia1: mode 0666 -> 0600, nvidia9: added 1:8, nvidia3: removed` for
/// the reload log line.
pub(super) fn describe(d: &Diff, old: &Loaded, new: &Loaded) -> String {
    let node = |l: &Loaded, p: &str| l.plan.tree.get(p).cloned();
    let parts: Vec<String> = d
        .changed
        .iter()
        .map(|p| match (node(old, p), node(new, p)) {
            (Some(before), Some(after)) => format!("{p}: {}", render::node_change(&before, &after)),
            _ => format!("{p}: changed"),
        })
        .chain(
            d.added
                .iter()
                .map(|p| format!("{p}: added {}", node(new, p).map_or("?".into(), |n| render::node_what(&n)))),
        )
        .chain(d.removed.iter().map(|p| format!("{p}: removed")))
        .collect();
    if parts.is_empty() { "no change".to_owned() } else { parts.join(", ") }
}
