//! What the NRI plugin does at `CreateContainer` (issue 32): the same decision as
//! `devremap-runtime`'s, from the pod and container containerd describes instead of a bundle.
//!
//! Pure. [`spec_of`] writes the container's view as the OCI spec the container's keeper reads:
//! `process.env`, `linux.devices`, the annotations, and the mounts at or under `/dev`; nothing
//! else of the view shapes `/dev` ([`crate::inputs::spec`]), so the tree holds only what this
//! spec, the defaults and the remap put there, as it would from the bundle runc gets. Two
//! things the view does not carry are written so:
//! - no hooks: NRI v0.6.1 shows none the toolkit adds (`nvidia-container-runtime` adds its hook
//!   to the spec after containerd's NRI call), so `NVIDIA_VISIBLE_DEVICES` never asks for GPUs
//!   here, as it does not for the wrapper without the hook: the GPUs are `linux.devices`' (CDI,
//!   the device plugin's device list);
//! - `process.terminal` is true: the view does not say, and runc binds the console onto
//!   `/dev/console` for a container with a terminal (`tty: true`), which needs the placeholder
//!   there; the placeholder is `/dev/null`'s device, which every container has anyway.
//!
//! The annotations are the container's, with the pod's `devremap.io/` annotations for the keys
//! the container does not set: a pod's annotation asks for each of its containers, a
//! container's own wins ([`merged_annotations`]). `devremap.io/gpus` is the container's record
//! alone: on a pod it would give every container one list, and is refused. The rest is
//! [`crate::runtime::annotations`]' rules, with the runtime config's `annotations` allow-list:
//! a pod's sandbox never gets devremap, `DEVREMAP_ENABLE` in `process.env` may only ask.
//!
//! A container created with `devremap.io/gpus` (CRI restore from a checkpoint passes the
//! checkpoint's annotations) is restored: the annotation is untrusted input read with a record
//! file's rules and limits ([`crate::inputs::metadata::parse`]), and only names: the devices
//! are the spec's, so it never widens access.

use super::view::{Adjustment, Container, Mount, Pod};
use crate::inputs::metadata::{self, MAX_METADATA_LEN, MetadataError};
use crate::inputs::spec::{self, SpecError};
use crate::runtime::annotations::{self, AnnotationError, GPUS, Request};
use crate::runtime::oci_patch::{self, PatchError};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use thiserror::Error;

/// The annotation prefix devremap owns.
const PREFIX: &str = "devremap.io/";

/// Why a container that asks for devremap cannot have it; its creation fails with this.
#[derive(Debug, Error, PartialEq)]
pub enum NriError {
    #[error(transparent)]
    Annotation(#[from] AnnotationError),
    #[error(
        "pod annotation {GPUS}: a container's record, which on a pod would name every container's GPUs alike; refused (it belongs on the container)"
    )]
    PodRecord,
    #[error("{0}")]
    Spec(#[from] SpecError),
    #[error("{0}")]
    Patch(#[from] PatchError),
    #[error("annotation {GPUS}: {0}")]
    Record(#[from] MetadataError),
    #[error("annotation {GPUS}: {0} bytes, over the limit of {MAX_METADATA_LEN} bytes of a record")]
    RecordTooLong(usize),
}

/// What a container that gets devremap gets.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    /// The spec its keeper reads ([`spec_of`]), its `/dev` mount pointed at the mountpoint.
    pub spec: Value,
    /// What its annotations ask (`--device-map`, `--prefer`, `--relax`).
    pub request: Request,
    /// The record it was created with (`devremap.io/gpus`), checked: it is being restored.
    pub restored: Option<String>,
    /// What to log about it (variables in `process.env` not obeyed).
    pub warnings: Vec<String>,
}

/// The decision at `CreateContainer`.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Not devremap's: the container is created unchanged; with a reason to log when it asked
    /// nothing by name but its spec cannot have devremap (it binds its own `/dev`).
    Untouched(Option<String>),
    Serve(Box<Served>),
}

/// The container's annotations, with the pod's `devremap.io/` ones it does not set itself.
/// Rule (issue 32): the container wins, key by key.
pub fn merged_annotations(pod: &Pod, container: &Container) -> Result<BTreeMap<String, String>, NriError> {
    let mut merged = container.annotations.clone();
    for (key, value) in pod.annotations.iter().filter(|(k, _)| k.starts_with(PREFIX)) {
        if key == GPUS {
            return Err(NriError::PodRecord);
        }
        merged.entry(key.clone()).or_insert_with(|| value.clone());
    }
    Ok(merged)
}

/// The container's view as an OCI runtime spec (see the module's doc): what its `/dev` is built
/// from.
pub fn spec_of(container: &Container, annotations: &BTreeMap<String, String>) -> Value {
    let devices: Vec<Value> = container
        .devices
        .iter()
        .map(|d| {
            let mut dev = json!({"path": d.path, "type": d.kind, "major": d.major, "minor": d.minor});
            for (key, value) in [("fileMode", d.file_mode), ("uid", d.uid), ("gid", d.gid)] {
                if let Some(v) = value {
                    dev[key] = json!(v);
                }
            }
            dev
        })
        .collect();
    let mounts: Vec<Value> = container.mounts.iter().filter(|m| under_dev(&m.destination)).map(mount_json).collect();
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": true, "user": {"uid": 0, "gid": 0}, "cwd": "/", "args": container.args, "env": container.env,
        },
        "root": {"path": "rootfs"},
        "annotations": annotations,
        "mounts": mounts,
        "linux": {"devices": devices},
    })
}

/// Whether a destination is `/dev` or under it, as runc cleans it.
fn under_dev(destination: &str) -> bool {
    let d = destination.trim_end_matches('/');
    d == "/dev" || d.starts_with("/dev/")
}

fn mount_json(m: &Mount) -> Value {
    let mut out = Map::new();
    out.insert("destination".into(), json!(m.destination));
    if !m.kind.is_empty() {
        out.insert("type".into(), json!(m.kind));
    }
    if !m.source.is_empty() {
        out.insert("source".into(), json!(m.source));
    }
    out.insert("options".into(), json!(m.options));
    Value::Object(out)
}

/// Decides as `devremap-runtime` does whether `container` gets a devremap `/dev` at `dev` (its
/// mountpoint, an absolute path), under the runtime config's `allowed` annotations.
pub fn decide(pod: &Pod, container: &Container, allowed: &[String], dev: &str) -> Result<Decision, NriError> {
    let annotations = merged_annotations(pod, container)?;
    let value = spec_of(container, &annotations);
    // Rule (issue 17.5): never the sandbox, whatever the pod's annotations say.
    if annotations::is_sandbox(&value) {
        return Ok(Decision::Untouched(None));
    }
    let request = annotations::parse(&value, allowed)?;
    let bytes = serde_json::to_vec(&value).expect("a JSON value serializes");
    let view = match spec::parse(&bytes, &|_| false) {
        Ok(v) => v,
        Err(e) if request.enable == Some(true) => return Err(e.into()),
        Err(e) => return Ok(Decision::Untouched(Some(format!("{e}; created without devremap")))),
    };
    let recorded = request.gpus.is_some() && request.enable != Some(false);
    if !(request.wanted(&view) || recorded) {
        return Ok(Decision::Untouched(None));
    }
    // Rule (issue 32): a privileged container (its device cgroup allows every device) is given
    // every host device, GPUs among them, by containerd: it is not asking for a GPU's `/dev`
    // (driver installers, monitoring agents, device plugins make nodes in theirs), so it is
    // served only when it asks by name.
    if container.devices_allow_all && request.enable != Some(true) && !recorded {
        return Ok(Decision::Untouched(Some(format!(
            "privileged (its device cgroup allows every device): created without devremap; annotation {}: \"true\" asks for it",
            annotations::ENABLE
        ))));
    }
    let restored = match &request.gpus {
        Some(record) if recorded => Some(check_record(record)?),
        _ => None,
    };
    // Rule (issue 17.6): a spec binding its own /dev asked for that /dev.
    let spec = match oci_patch::patch(&value, dev) {
        Ok(spec) => spec,
        Err(e @ PatchError::DevBound { .. }) if request.enable != Some(true) => {
            return Ok(Decision::Untouched(Some(format!("{e}; created without devremap"))));
        }
        Err(e) => return Err(e.into()),
    };
    let warnings = request.warnings();
    Ok(Decision::Serve(Box::new(Served { spec, request, restored, warnings })))
}

/// A record from an annotation, as a record file is read: within the limit, and parsed.
fn check_record(record: &str) -> Result<String, NriError> {
    if record.len() as u64 > MAX_METADATA_LEN {
        return Err(NriError::RecordTooLong(record.len()));
    }
    metadata::parse(record.as_bytes())?;
    Ok(record.to_owned())
}

/// The answer to `CreateContainer` of a served container: its `/dev` replaced by the mount of
/// `dev` (the runtime's own `/dev` mount has the same destination, so NRI drops it), and its
/// record in `devremap.io/gpus`, which a checkpoint then carries.
pub fn adjustment(dev: &str, record: &str) -> Adjustment {
    let ours = oci_patch::dev_mount(dev);
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mount = Mount {
        destination: text(&ours["destination"]),
        kind: text(&ours["type"]),
        source: text(&ours["source"]),
        options: ours["options"].as_array().into_iter().flatten().map(text).collect(),
    };
    Adjustment {
        annotations: BTreeMap::from([(GPUS.to_owned(), record.to_owned())]),
        mounts: vec![mount],
        remove_mounts: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
