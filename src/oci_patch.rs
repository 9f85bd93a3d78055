//! Rewriting an OCI runtime spec so that the container's `/dev` is a devremap mount.
//!
//! Pure: takes the spec as JSON and returns it changed, so that every field this crate does
//! not model survives byte for byte in meaning (and, with `preserve_order`, in order). The
//! `/dev` mount is replaced where it stands, so the mounts after it (`/dev/pts`, `/dev/shm`,
//! `/dev/mqueue`) still land on top of it; `linux.devices` and `linux.resources.devices` are
//! left alone, since the runtime builds the device cgroup from them.
//!
//! A spec that binds something else onto `/dev` (`docker run -v /dev:/dev`) asked for that
//! `/dev`: it is refused rather than silently replaced or left to cover the devremap mount
//! (issue 17.6); a second tmpfs `/dev` after the first would cover ours, so it is dropped.
//!
//! [`relocate`] is the wrapper's half: the patched spec goes into a bundle of the wrapper's own,
//! so its paths that the runtime resolves against the bundle (`root.path`, the sources of bind
//! mounts) are made absolute against the caller's bundle, which is never written (issue 17.7).

use serde_json::{Map, Value, json};
use std::path::Path;
use thiserror::Error;

/// Why a spec could not be patched.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PatchError {
    #[error("not a valid OCI runtime spec: {0}")]
    Spec(String),
    #[error(
        "mounts: {from:?} is bound onto /dev, which would cover the devremap /dev; \
         drop that mount, or run the container without devremap"
    )]
    DevBound { from: String },
    #[error("the bundle {0:?} is not a UTF-8 path, which a spec cannot hold; give the bundle another path")]
    BundleNotUtf8(String),
}

/// Whether a mount is a bind mount, as runc decides it: `bind`/`rbind` in its options or
/// its type (runc ignores the type of a bind mount).
fn is_bind(mount: &Value) -> bool {
    let opt = |o: &Value| matches!(o.as_str(), Some("bind" | "rbind"));
    mount.get("type").and_then(Value::as_str) == Some("bind")
        || mount.get("options").and_then(Value::as_array).is_some_and(|o| o.iter().any(opt))
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
    let at_dev: Vec<usize> = (0..mounts.len()).filter(|&i| dests[i] == "/dev").collect();
    // Our own mount (a spec patched before) is replaced; any other bind onto /dev is refused.
    if let Some(theirs) = at_dev.iter().map(|&i| &mounts[i]).find(|m| is_bind(m) && **m != ours) {
        let from = theirs.get("source").and_then(Value::as_str).unwrap_or_default().to_owned();
        return Err(PatchError::DevBound { from });
    }
    match at_dev.split_first() {
        Some((&first, rest)) => {
            mounts[first] = ours;
            // Later ones would be mounted over ours.
            for &i in rest.iter().rev() {
                mounts.remove(i);
            }
        }
        None => {
            let at = dests.iter().position(|d| d.starts_with("/dev/")).unwrap_or(mounts.len());
            mounts.insert(at, ours);
        }
    }
    Ok(spec)
}

/// Makes the paths of `spec` that the runtime resolves against its bundle absolute against
/// `bundle` (an absolute path), so that the spec works from another bundle directory:
/// `root.path` and the source of every bind mount. Absolute paths are kept as they are.
/// (runc refuses a rootfs reached through a symlink, so a link to the caller's would not do.)
pub fn relocate(spec: &mut Value, bundle: &Path) -> Result<(), PatchError> {
    let base = bundle.to_str().ok_or_else(|| PatchError::BundleNotUtf8(bundle.to_string_lossy().into_owned()))?;
    let absolute = |v: &mut Value| {
        if let Some(p) = v.as_str().filter(|p| !p.starts_with('/')) {
            *v = Value::String(format!("{}/{p}", base.trim_end_matches('/')));
        }
    };
    if let Some(root) = spec.pointer_mut("/root/path") {
        absolute(root);
    }
    if let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) {
        for m in mounts.iter_mut().filter(|m| is_bind(m)) {
            if let Some(source) = m.get_mut("source") {
                absolute(source);
            }
        }
    }
    Ok(())
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

    /// Rule (issue 17.6): `docker run -v /dev:/dev` binds the host's /dev over the spec's: the
    /// devremap mount would be covered (or would silently replace the user's), so it is refused;
    /// a second tmpfs /dev is dropped, since it would be mounted over ours.
    #[test]
    fn another_dev_mount_is_refused_or_dropped() {
        let bound = spec(json!([{"destination": "/dev", "type": "tmpfs"},
                                {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind"]}]));
        assert_eq!(patch(&bound, "/d").unwrap_err(), PatchError::DevBound { from: "/dev".into() });
        let by_option = spec(json!([{"destination": "/dev/", "source": "/srv/dev", "options": ["bind", "ro"]}]));
        assert!(patch(&by_option, "/d").unwrap_err().to_string().contains("\"/srv/dev\" is bound onto /dev"));
        let two = spec(json!([{"destination": "/dev", "type": "tmpfs"}, {"destination": "/dev/pts"},
                              {"destination": "/dev", "type": "tmpfs"}]));
        assert_eq!(dests(&patch(&two, "/d").unwrap()), ["/dev", "/dev/pts"]);
    }

    /// Rule (issue 17.7): a spec moved to the wrapper's bundle keeps its rootfs and relative
    /// bind sources, resolved against the caller's bundle; absolute ones and non-bind mounts'
    /// sources (`proc`, `tmpfs`) are kept.
    #[test]
    fn relocate_makes_bundle_paths_absolute() {
        let mut s = spec(json!([{"destination": "/proc", "type": "proc", "source": "proc"},
                                {"destination": "/data", "type": "bind", "source": "data"},
                                {"destination": "/etc/x", "source": "x", "options": ["rbind"]},
                                {"destination": "/abs", "type": "bind", "source": "/srv/abs"}]));
        relocate(&mut s, Path::new("/b/u")).unwrap();
        assert_eq!(s["root"]["path"], "/b/u/rootfs");
        let sources: Vec<&str> =
            s["mounts"].as_array().unwrap().iter().map(|m| m["source"].as_str().unwrap()).collect();
        assert_eq!(sources, ["proc", "/b/u/data", "/b/u/x", "/srv/abs"]);
        let not_utf8 = std::os::unix::ffi::OsStrExt::from_bytes(b"/b/\xff");
        assert!(matches!(relocate(&mut s, Path::new(not_utf8)), Err(PatchError::BundleNotUtf8(_))));
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
