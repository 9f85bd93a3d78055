//! The pieces every family's part of `plan`'s output is made of: aligned tables whose cells
//! are escaped, a name's status, a saved GPU's earlier names.

use crate::decision::escape::escape;
use crate::decision::seam::EarlierName;
use crate::family::Family;
use serde_json::{Value, json};
use std::borrow::Cow;
use std::fmt::Write;

/// A remap entry's earlier names, `{"name": ..., "served": ...}` each.
pub fn earlier_json(family: &dyn Family, earlier: &[EarlierName]) -> Vec<Value> {
    earlier.iter().map(|n| json!({"name": family.gpu_name(n.minor), "served": n.served})).collect()
}

/// Columns are padded to their widest cell, up to this width: a longer cell (a long path) runs
/// over and shifts its own line only.
const MAX_COLUMN: usize = 40;

/// An aligned table. Every cell is escaped (see [`crate::decision::escape`]): cells hold names, paths and
/// uuids from the inputs.
pub fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
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

/// A remap table's status of a name.
pub fn status(served: bool) -> &'static str {
    if served { "served" } else { "not served: name collision" }
}

/// The table's rows of a remap entry's earlier names (of the checkpoint name `of`): each name
/// and its status.
pub fn earlier_rows<'a>(
    family: &'static dyn Family,
    earlier: &'a [EarlierName],
    of: String,
) -> impl Iterator<Item = (String, String)> + 'a {
    earlier.iter().map(move |n| (family.gpu_name(n.minor), format!("{} (an earlier name of {of})", status(n.served))))
}

pub fn or_dash(s: Option<&String>) -> String {
    s.cloned().unwrap_or_else(|| "-".into())
}
