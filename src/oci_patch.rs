//! Rewriting an OCI runtime spec so that the container's `/dev` is a devremap mount.
//!
//! Pure: takes the spec as JSON and returns it changed, so that every field this crate does
//! not model survives byte for byte in meaning (and, with `preserve_order`, in order). The
//! `/dev` mount is replaced where it stands, so the mounts after it (`/dev/pts`, `/dev/shm`,
//! `/dev/mqueue`) still land on top of it; `linux.devices` and `linux.resources.devices` are
//! left alone, since the runtime builds the device cgroup from them.

use serde_json::{Map, Value, json};
use thiserror::Error;

/// Why a spec could not be patched.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PatchError {
    #[error("not a valid OCI runtime spec: {0}")]
    Spec(String),
}

/// The mount that puts `dev` (an absolute host path) at the container's `/dev`.
pub fn dev_mount(dev: &str) -> Value {
    json!({"destination": "/dev", "type": "bind", "source": dev, "options": ["rbind", "nosuid", "noexec"]})
}

fn destination(mount: &Value) -> Option<String> {
    let d = mount.get("destination")?.as_str()?;
    let trimmed = d.trim_end_matches('/');
    Some(if trimmed.is_empty() { "/".to_owned() } else { trimmed.to_owned() })
}

/// Replaces the spec's `/dev` mount with a bind mount of `dev`, in the same place; with no
/// `/dev` mount, puts one before the first mount under `/dev` (or last). Idempotent.
pub fn patch(spec: &Value, dev: &str) -> Result<Value, PatchError> {
    // The runtime must be able to read what we write: check the spec parses as one.
    serde_json::from_value::<oci_spec::runtime::Spec>(spec.clone()).map_err(|e| PatchError::Spec(e.to_string()))?;
    let mut spec = spec.clone();
    let obj: &mut Map<String, Value> =
        spec.as_object_mut().ok_or_else(|| PatchError::Spec("expected a JSON object".into()))?;
    let mounts = obj.entry("mounts").or_insert_with(|| Value::Array(Vec::new()));
    let mounts = mounts.as_array_mut().ok_or_else(|| PatchError::Spec("mounts: expected an array".into()))?;
    // Every mount has a string destination: the spec parsed.
    let dests: Vec<String> = mounts.iter().map(|m| destination(m).unwrap_or_default()).collect();
    let ours = dev_mount(dev);
    match dests.iter().position(|d| d == "/dev") {
        Some(i) => mounts[i] = ours,
        None => {
            let at = dests.iter().position(|d| d.starts_with("/dev/")).unwrap_or(mounts.len());
            mounts.insert(at, ours);
        }
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mounts: Value) -> Value {
        json!({"ociVersion": "1.0.2", "process": {"cwd": "/", "user": {"uid": 0, "gid": 0}, "args": ["sh"]},
               "root": {"path": "rootfs"}, "mounts": mounts, "x-unknown": {"kept": true},
               "linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
                         "resources": {"devices": [{"allow": false, "access": "rwm"}]}}})
    }

    fn dests(v: &Value) -> Vec<&str> {
        v["mounts"].as_array().unwrap().iter().map(|m| m["destination"].as_str().unwrap()).collect()
    }

    /// The tmpfs /dev becomes our bind mount in the same place; the rest is untouched.
    #[test]
    fn replaces_dev_in_place() {
        let s = spec(
            json!([{"destination": "/proc", "type": "proc"}, {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                            {"destination": "/dev/pts", "type": "devpts"}]),
        );
        let p = patch(&s, "/run/devremap/c1").unwrap();
        assert_eq!(dests(&p), ["/proc", "/dev", "/dev/pts"]);
        assert_eq!(p["mounts"][1], dev_mount("/run/devremap/c1"));
        assert_eq!(p["linux"], s["linux"]);
        assert_eq!(p["x-unknown"], s["x-unknown"]);
    }

    /// Patching a patched spec changes nothing.
    #[test]
    fn idempotent() {
        let s = spec(json!([{"destination": "/dev/", "type": "tmpfs"}, {"destination": "/dev/shm", "type": "tmpfs"}]));
        let once = patch(&s, "/d").unwrap();
        assert_eq!(patch(&once, "/d").unwrap(), once);
    }

    /// Without a /dev mount, ours goes before the first mount under /dev.
    #[test]
    fn inserts_before_dev_submounts() {
        let s = spec(json!([{"destination": "/proc"}, {"destination": "/dev/pts"}, {"destination": "/sys"}]));
        assert_eq!(dests(&patch(&s, "/d").unwrap()), ["/proc", "/dev", "/dev/pts", "/sys"]);
    }

    /// A spec that does not parse is refused.
    #[test]
    fn refuses_bad_specs() {
        assert!(matches!(patch(&json!([]), "/d"), Err(PatchError::Spec(_))));
        assert!(matches!(patch(&json!({"mounts": 5}), "/d"), Err(PatchError::Spec(_))));
        assert_eq!(
            patch(&spec(json!([{"type": "tmpfs"}])), "/d").unwrap_err(),
            PatchError::Spec("missing field `destination`".into())
        );
    }
}
