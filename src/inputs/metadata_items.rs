//! What every family's items of the checkpoint's device list share: the list's key and
//! limit, its errors ([`MetadataError`]), the recorded `mode`, `uid` and `gid`
//! ([`recorded_access`]), the earlier names ([`earlier_minors`], [`repeated_name`]) and
//! [`describe`] for messages. Each family reads its own items (`family::table::read_items` hands each
//! item to the family whose `kind` it has); the list itself is [`metadata`](super::metadata)'s.
//!
//! Pure. Assumption: a family's item is a JSON object, and its index in the list names it in
//! every error.

use crate::device::Access;
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use thiserror::Error;

/// gVisor refuses metadata longer than this; so do we, for every form.
pub const MAX_METADATA_LEN: u64 = 16 << 20;
/// The metadata key of the saved GPU list.
pub const GPU_KEY: &str = "nvproxy-device-remap-ids";

/// The optional `mode`, `uid` and `gid` of a saved device: what its node was at save time.
/// CRIU compares a reopened file's whole `st_mode` with the saved one, so a checkpoint name must
/// keep the recorded mode even when the restore host's node has another.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecordedAccess {
    /// Permission bits, at most 0o7777.
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl RecordedAccess {
    /// `base` with each recorded field put in its place.
    pub fn over(self, base: Access) -> Access {
        Access {
            mode: self.mode.unwrap_or(base.mode),
            uid: self.uid.unwrap_or(base.uid),
            gid: self.gid.unwrap_or(base.gid),
        }
    }
}

/// Why metadata bytes were refused. Messages name the key and index at fault; the caller
/// prefixes the file.
#[derive(Debug, Error, PartialEq)]
pub enum MetadataError {
    #[error("file is empty")]
    Empty,
    #[error("truncated state file header: {0}")]
    Truncated(String),
    #[error("metadata length {0} is over the limit of {MAX_METADATA_LEN} bytes")]
    TooLong(u64),
    #[error("the file is larger than the limit of {MAX_METADATA_LEN} bytes")]
    TooLarge,
    #[error("not checkpoint metadata: expected a gVisor state file, a JSON object or a JSON array")]
    UnknownFormat,
    #[error("the text is {0}; JSON is UTF-8 without a byte-order mark")]
    Encoding(&'static str),
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("state file metadata: key {key:?} holds {found}, expected a string")]
    NotAString { key: String, found: String },
    #[error("{key}: {what}")]
    Shape { key: &'static str, what: String },
    #[error("{GPU_KEY}[{index}].{field}: expected {expected}, found {found}")]
    Field { index: usize, field: &'static str, expected: &'static str, found: String },
    #[error("{GPU_KEY}[{index}].{field}: {why}")]
    Fact { index: usize, field: &'static str, why: String },
    #[error("{GPU_KEY}[{index}].mode: {mode:#o} has bits beyond the permission and sticky bits (0o1777)")]
    ModeTooLarge { index: usize, mode: u32 },
    #[error("{GPU_KEY}[{index}].{field}: 4294967295 is no owner (chown reads it as \"leave unchanged\")")]
    NoOwner { index: usize, field: &'static str },
    #[error("{GPU_KEY}[{index}]: minor {minor} is over {max}, the largest GPU minor")]
    MinorTooLarge { index: usize, minor: u32, max: u32 },
    #[error("{GPU_KEY}: minor {0} appears twice")]
    DuplicateMinor(u32),
    #[error("{GPU_KEY}: uuid {0} appears twice")]
    DuplicateUuid(String),
    #[error("{GPU_KEY}[{index}].earlier_minors: {what}")]
    Earlier { index: usize, what: String },
    #[error("{GPU_KEY}[{index}].kind: expected \"amdgpu\" (an NVIDIA item has no kind), found {found}")]
    Kind { index: usize, found: String },
    #[error("{GPU_KEY}[{index}] (amdgpu): {what}")]
    Amd { index: usize, what: String },
    #[error("{GPU_KEY}: amdgpu render minor {0} appears twice")]
    DuplicateRender(u32),
}

/// An item's optional unsigned 32-bit `field`.
pub(crate) fn optional_u32(
    index: usize,
    obj: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<u32>, MetadataError> {
    obj.get(field)
        .map(|v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| MetadataError::Field {
                index,
                field,
                expected: "an unsigned 32-bit integer",
                found: describe(v),
            })
        })
        .transpose()
}

/// An item's `mode`, `uid` and `gid`. The metadata may come from another host: it may give a
/// checkpoint name the mode the saved node had, but never setuid or setgid (runc clears them on
/// device nodes too, so a node a checkpoint saw never had them) nor the owner id that means "no
/// owner".
pub(crate) fn recorded_access(index: usize, obj: &Map<String, Value>) -> Result<RecordedAccess, MetadataError> {
    let field = |f| optional_u32(index, obj, f);
    let recorded = RecordedAccess { mode: field("mode")?, uid: field("uid")?, gid: field("gid")? };
    if let Some(mode) = recorded.mode.filter(|m| m & !0o1777 != 0) {
        return Err(MetadataError::ModeTooLarge { index, mode });
    }
    for (field, id) in [("uid", recorded.uid), ("gid", recorded.gid)] {
        if id == Some(u32::MAX) {
            return Err(MetadataError::NoOwner { index, field });
        }
    }
    Ok(recorded)
}

/// The `earlier_minors` of an item whose minor is `minor`, either family's: `noun` minors,
/// each once, none the item's own, none that `fault` (the family's range) finds fault with;
/// sorted. The error is what is wrong, for the caller to name the item.
pub(crate) fn earlier_minors(
    minor: u32,
    value: Option<&Value>,
    noun: &str,
    fault: impl Fn(u32) -> Option<String>,
) -> Result<Vec<u32>, String> {
    let items = match value {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(v) => return Err(format!("expected an array of {noun}, found {}", describe(v))),
    };
    let mut out = BTreeSet::new();
    for item in items {
        let m = item
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("expected {noun}, found {}", describe(item)))?;
        if let Some(why) = fault(m) {
            return Err(why);
        }
        if m == minor || !out.insert(m) {
            return Err(format!("minor {m} is listed twice or is the GPU's own"));
        }
    }
    Ok(out.into_iter().collect())
}

/// The first name given twice among `names` (each item's minor and earlier minors): every
/// name must lead to one GPU.
pub(crate) fn repeated_name(names: impl IntoIterator<Item = u32>) -> Option<u32> {
    let mut seen = BTreeSet::new();
    names.into_iter().find(|&m| !seen.insert(m))
}

/// A short description of a JSON value for error messages: numbers as written, the rest by kind.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) if s.len() <= 40 => format!("the string {s:?}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}
