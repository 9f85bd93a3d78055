//! The bundle's spec as it was before the wrapper patched it, kept in the container's state
//! directory (`<state_dir>/<id>/spec.json`) so that every teardown (delete, a failed start,
//! the cleanup of a killed wrapper's leftovers) can put it back.
//!
//! Pure: [`SavedSpec::to_json`] and [`SavedSpec::parse`] are the file's format, a JSON object
//! `{"path", "mode", "uid", "gid", "original", "patched"}`: the spec's absolute path, the
//! original's mode (permission bits) and owner, the original bytes and the bytes the wrapper
//! wrote. A spec is JSON, hence UTF-8, so both texts are kept byte for byte as JSON strings.
//! [`SavedSpec::still_ours`] decides whether the file now at `path` is still the wrapper's
//! (the same bytes): a spec someone rewrote since is never overwritten.

use crate::device::Access;
use serde_json::{Value, json};
use std::path::PathBuf;
use thiserror::Error;

/// What is needed to put a bundle's spec back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedSpec {
    /// The bundle's `config.json`, absolute.
    pub path: PathBuf,
    /// The original's mode (permission bits), uid and gid.
    pub access: Access,
    pub original: String,
    /// What the wrapper wrote in its place.
    pub patched: String,
}

/// Why a saved spec file could not be read back.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SavedSpecError {
    #[error("not a saved spec: {0}")]
    Json(String),
    #[error("{0}: missing, or of the wrong type")]
    Field(&'static str),
}

impl SavedSpec {
    pub fn to_json(&self) -> Vec<u8> {
        let value = json!({
            "path": self.path.to_string_lossy(),
            "mode": self.access.mode,
            "uid": self.access.uid,
            "gid": self.access.gid,
            "original": self.original,
            "patched": self.patched,
        });
        format!("{value:#}\n").into_bytes()
    }

    pub fn parse(bytes: &[u8]) -> Result<SavedSpec, SavedSpecError> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| SavedSpecError::Json(e.to_string()))?;
        let text =
            |key: &'static str| v.get(key).and_then(Value::as_str).map(str::to_owned).ok_or(SavedSpecError::Field(key));
        let number = |key: &'static str| {
            v.get(key).and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok()).ok_or(SavedSpecError::Field(key))
        };
        let path = PathBuf::from(text("path")?);
        if !path.is_absolute() {
            return Err(SavedSpecError::Field("path"));
        }
        Ok(SavedSpec {
            path,
            access: Access { mode: number("mode")? & 0o7777, uid: number("uid")?, gid: number("gid")? },
            original: text("original")?,
            patched: text("patched")?,
        })
    }

    /// Whether `current`, the bytes now at [`SavedSpec::path`], are what the wrapper wrote.
    pub fn still_ours(&self, current: &[u8]) -> bool {
        current == self.patched.as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved() -> SavedSpec {
        SavedSpec {
            path: PathBuf::from("/b/config.json"),
            access: Access { mode: 0o640, uid: 1000, gid: 44 },
            original: "{\"ociVersion\": \"1.0.2\",\n\t\"x\": \"\\u00e9 é\"}".into(),
            patched: "{\n  \"ociVersion\": \"1.0.2\"\n}\n".into(),
        }
    }

    /// Rule: what is written reads back the same, the original byte for byte.
    #[test]
    fn round_trip() {
        let s = saved();
        assert_eq!(SavedSpec::parse(&s.to_json()).unwrap(), s);
    }

    /// Rule: only the bytes the wrapper wrote are its own; any other content is someone's.
    #[test]
    fn still_ours_is_the_patched_bytes_only() {
        let s = saved();
        assert!(s.still_ours(s.patched.as_bytes()));
        assert!(!s.still_ours(s.original.as_bytes()));
        assert!(!s.still_ours(&s.patched.as_bytes()[1..]));
        assert!(!s.still_ours(b""));
    }

    /// A truncated or odd file is an error naming what is wrong, never a panic.
    #[test]
    fn bad_files() {
        let good = saved().to_json();
        assert!(matches!(SavedSpec::parse(&good[..good.len() / 2]), Err(SavedSpecError::Json(_))));
        let mut v: Value = serde_json::from_slice(&good).unwrap();
        v["path"] = json!("relative/config.json");
        assert_eq!(SavedSpec::parse(v.to_string().as_bytes()), Err(SavedSpecError::Field("path")));
        v["path"] = json!("/b/config.json");
        v["uid"] = json!(1u64 << 40);
        assert_eq!(SavedSpec::parse(v.to_string().as_bytes()), Err(SavedSpecError::Field("uid")));
        v["uid"] = json!(0);
        v.as_object_mut().unwrap().remove("original");
        assert_eq!(SavedSpec::parse(v.to_string().as_bytes()), Err(SavedSpecError::Field("original")));
    }
}
