//! What a container's spec asks of devremap: the `devremap.io/*` annotations, and whether the
//! spec has NVIDIA GPUs at all.
//!
//! Pure. `devremap.io/enable` is `"true"` or `"false"`; without it, devremap is used exactly
//! when the spec has NVIDIA GPUs in `linux.devices` or asks for them through the NVIDIA hook.
//! `devremap.io/device-map` is a `--device-map` value and `devremap.io/prefer` a `--prefer`
//! value, `devremap.io/relax` a `--relax` value (the checks a restore may fail with a warning);
//! all are checked here, so a bad one is refused before anything is set up. Any other
//! `devremap.io/` key is refused too: a misspelt annotation must not be ignored in silence.
//! Each annotation has a `process.env` variable standing for it ([`ENV_VARS`]), for clients
//! that drop annotations; a pod's sandbox ([`is_sandbox`]) never gets devremap.

use crate::decision::checks::parse_relax;
use crate::decision::pairing::parse_device_map;
use crate::inputs::spec::SpecView;
use serde_json::Value;
use thiserror::Error;

pub const ENABLE: &str = "devremap.io/enable";
pub const DEVICE_MAP: &str = "devremap.io/device-map";
pub const PREFER: &str = "devremap.io/prefer";
pub const RELAX: &str = "devremap.io/relax";
const PREFIX: &str = "devremap.io/";

/// What the annotations ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// `Some` when `devremap.io/enable` says so.
    pub enable: Option<bool>,
    /// The `--device-map` value, checked.
    pub device_map: Option<String>,
    /// The `--prefer` value, `native` or `checkpoint`.
    pub prefer: Option<String>,
    /// The `--relax` value, checked.
    pub relax: Option<String>,
}

impl Request {
    /// Whether the container gets a devremap `/dev`: as the annotation says, else when the spec
    /// has NVIDIA GPUs.
    pub fn wanted(&self, spec: &SpecView) -> bool {
        self.enable.unwrap_or_else(|| spec.names_gpus())
    }

    /// The daemon's flags for what was asked.
    pub fn daemon_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(map) = &self.device_map {
            args.extend(["--device-map".to_owned(), map.clone()]);
        }
        if let Some(prefer) = &self.prefer {
            args.extend(["--prefer".to_owned(), prefer.clone()]);
        }
        if let Some(relax) = &self.relax {
            args.extend(["--relax".to_owned(), relax.clone()]);
        }
        args
    }
}

/// Why the annotations were refused; `from` names where the value was read (the annotation,
/// or the `process.env` variable standing for it).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AnnotationError {
    #[error("annotations: expected an object of strings")]
    NotAMap,
    #[error("annotation {key}: expected a string, found {found}")]
    NotAString { key: String, found: String },
    #[error("{from}: expected \"true\" or \"false\", found {value:?}")]
    Enable { from: String, value: String },
    #[error("{from}: {why}")]
    DeviceMap { from: String, why: String },
    #[error("{from}: expected \"native\" or \"checkpoint\", found {value:?}")]
    Prefer { from: String, value: String },
    #[error("{from}: {why}")]
    Relax { from: String, why: String },
    #[error("unknown annotation {0} (known: {ENABLE}, {DEVICE_MAP}, {PREFER}, {RELAX})")]
    Unknown(String),
}

/// The `process.env` variables that stand for the annotations, for the clients that cannot
/// pass annotations: Docker before API 1.43 (Debian 12's 20.10) drops them without an error,
/// while `docker run -e DEVREMAP_ENABLE=true` reaches the spec (issue 17.4). An annotation
/// wins over its variable.
pub const ENV_VARS: &[(&str, &str)] = &[
    ("DEVREMAP_ENABLE", ENABLE),
    ("DEVREMAP_DEVICE_MAP", DEVICE_MAP),
    ("DEVREMAP_PREFER", PREFER),
    ("DEVREMAP_RELAX", RELAX),
];

/// The annotations by which CRI runtimes mark a pod's sandbox (its pause container).
const SANDBOX_MARKS: &[&str] = &["io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType"];

/// Whether the spec is a Kubernetes pod's sandbox, which never needs a device: a runtime
/// handler's `pod_annotations` reach it as they reach the pod's containers, and it must not
/// cost a daemon (issue 17.5).
pub fn is_sandbox(spec: &Value) -> bool {
    SANDBOX_MARKS
        .iter()
        .any(|k| spec.pointer(&format!("/annotations/{}", k.replace('/', "~1"))) == Some(&"sandbox".into()))
}

impl Request {
    /// Sets what `key` (one of the annotations) says, read from `from`; a field already set
    /// (by the annotation, over its variable) is kept.
    fn set(&mut self, key: &str, text: &str, from: String) -> Result<(), AnnotationError> {
        match key {
            ENABLE if self.enable.is_none() => {
                self.enable = Some(match text {
                    "true" => true,
                    "false" => false,
                    other => return Err(AnnotationError::Enable { from, value: other.to_owned() }),
                })
            }
            DEVICE_MAP if self.device_map.is_none() => {
                parse_device_map(text).map_err(|e| AnnotationError::DeviceMap { from, why: e.to_string() })?;
                self.device_map = Some(text.to_owned());
            }
            PREFER if self.prefer.is_none() => match text {
                "native" | "checkpoint" => self.prefer = Some(text.to_owned()),
                other => return Err(AnnotationError::Prefer { from, value: other.to_owned() }),
            },
            RELAX if self.relax.is_none() => {
                parse_relax(text).map_err(|e| AnnotationError::Relax { from, why: e.to_string() })?;
                self.relax = Some(text.to_owned());
            }
            ENABLE | DEVICE_MAP | PREFER | RELAX => {}
            _ => return Err(AnnotationError::Unknown(key.to_owned())),
        }
        Ok(())
    }
}

/// Reads the `devremap.io/*` annotations of a spec (as JSON), then the variables of
/// [`ENV_VARS`] in its `process.env` for what the annotations leave unsaid.
pub fn parse(spec: &Value) -> Result<Request, AnnotationError> {
    let mut request = Request::default();
    let map = match spec.get("annotations") {
        None | Some(Value::Null) => None,
        Some(Value::Object(map)) => Some(map),
        Some(_) => return Err(AnnotationError::NotAMap),
    };
    for (key, value) in map.into_iter().flatten().filter(|(k, _)| k.starts_with(PREFIX)) {
        let text = value.as_str().ok_or_else(|| AnnotationError::NotAString {
            key: key.clone(),
            found: crate::inputs::metadata::describe(value),
        })?;
        request.set(key, text, format!("annotation {key}"))?;
    }
    // The spec parsed as an OCI spec before this is asked, so `env` holds strings; anything
    // else is no variable of ours.
    let env = spec.pointer("/process/env").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str);
    for (name, text) in env.filter_map(|e| e.split_once('=')) {
        if let Some((_, key)) = ENV_VARS.iter().find(|(var, _)| *var == name) {
            request.set(key, text, format!("process.env {name}"))?;
        }
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, DevKind, Rdev};
    use crate::inputs::spec::SpecDevice;
    use serde_json::json;

    fn with(annotations: Value) -> Value {
        json!({"ociVersion": "1.0.2", "annotations": annotations})
    }

    fn gpu_spec() -> SpecView {
        SpecView {
            devices: vec![SpecDevice {
                rel_path: Some("nvidia1".into()),
                path: "/dev/nvidia1".into(),
                kind: DevKind::Char,
                rdev: Rdev::new(195, 1),
                access: Access::DEVICE_DEFAULT,
            }],
            ..SpecView::default()
        }
    }

    /// Rule (issue 12.3): devremap is used when asked, or when the spec has NVIDIA GPUs
    /// (devices or the hook); `enable: "false"` opts a GPU container out.
    #[test]
    fn when_devremap_is_wanted() {
        let none = parse(&json!({})).unwrap();
        assert!(!none.wanted(&SpecView::default()));
        assert!(none.wanted(&gpu_spec()));
        assert!(
            none.wanted(&SpecView { hook: Some(crate::family::nvidia::visible::Visible::All), ..SpecView::default() })
        );
        assert!(parse(&with(json!({ENABLE: "true"}))).unwrap().wanted(&SpecView::default()));
        assert!(!parse(&with(json!({ENABLE: "false"}))).unwrap().wanted(&gpu_spec()));
    }

    /// The device map and prefer annotations become the daemon's flags; other annotations
    /// are not ours.
    #[test]
    fn daemon_flags() {
        let r = parse(&with(json!({DEVICE_MAP: "0=2,GPU-00000000-0000-0000-0000-000000000001=3", PREFER: "checkpoint", RELAX: "model,driver", "io.kubernetes.x": "y"}))).unwrap();
        assert_eq!(
            r.daemon_args(),
            [
                "--device-map",
                "0=2,GPU-00000000-0000-0000-0000-000000000001=3",
                "--prefer",
                "checkpoint",
                "--relax",
                "model,driver"
            ]
        );
        assert!(parse(&with(Value::Null)).unwrap().daemon_args().is_empty());
    }

    /// Rule (issue 17.4): Docker 20.10 drops annotations, so `docker run -e DEVREMAP_ENABLE=true`
    /// opts in through the spec's `process.env`; the annotation wins over its variable, and a
    /// bad variable is refused naming it.
    #[test]
    fn env_variables_stand_for_annotations() {
        let env = |vars: &[&str]| json!({"process": {"env": vars}});
        let r = parse(&env(&["PATH=/bin", "DEVREMAP_ENABLE=true", "DEVREMAP_PREFER=checkpoint"])).unwrap();
        assert_eq!((r.enable, r.prefer.as_deref()), (Some(true), Some("checkpoint")));
        assert!(r.wanted(&SpecView::default()));
        let mut both = env(&["DEVREMAP_ENABLE=true", "DEVREMAP_DEVICE_MAP=0=1"]);
        both["annotations"] = json!({ENABLE: "false"});
        let r = parse(&both).unwrap();
        assert_eq!((r.enable, r.device_map.as_deref()), (Some(false), Some("0=1")));
        let e = parse(&env(&["DEVREMAP_ENABLE=1"])).unwrap_err().to_string();
        assert_eq!(e, "process.env DEVREMAP_ENABLE: expected \"true\" or \"false\", found \"1\"");
        assert!(parse(&env(&["DEVREMAP_ENABLEX=1", "NOEQUALS"])).unwrap() == Request::default());
    }

    /// Rule (issue 17.5): a CRI pod's sandbox (containerd's and CRI-O's marks) never gets a
    /// daemon, whatever `pod_annotations` pass to it.
    #[test]
    fn a_pod_sandbox_is_told_apart() {
        let marked = |k: &str, v: &str| json!({"annotations": {k: v, ENABLE: "true"}});
        assert!(is_sandbox(&marked("io.kubernetes.cri.container-type", "sandbox")));
        assert!(is_sandbox(&marked("io.kubernetes.cri-o.ContainerType", "sandbox")));
        assert!(!is_sandbox(&marked("io.kubernetes.cri.container-type", "container")));
        assert!(!is_sandbox(&json!({})));
    }

    /// Rule (issue 12.3): a bad annotation is a clear error naming it.
    #[test]
    fn bad_annotations_are_refused() {
        let cases = [
            (with(json!({ENABLE: "yes"})), "devremap.io/enable: expected \"true\" or \"false\", found \"yes\""),
            (with(json!({ENABLE: true})), "devremap.io/enable: expected a string, found true"),
            (with(json!({DEVICE_MAP: "0-2"})), "annotation devremap.io/device-map: "),
            (with(json!({DEVICE_MAP: ""})), "annotation devremap.io/device-map: "),
            (with(json!({PREFER: "Native"})), "devremap.io/prefer: expected \"native\" or \"checkpoint\""),
            (with(json!({"devremap.io/enabled": "true"})), "unknown annotation devremap.io/enabled"),
            (with(json!({RELAX: "count"})), "annotation devremap.io/relax: count cannot be relaxed"),
            (with(json!({RELAX: "modle"})), "annotation devremap.io/relax: unknown check \"modle\""),
            (with(json!(["x"])), "expected an object of strings"),
        ];
        for (spec, expected) in cases {
            let e = parse(&spec).unwrap_err().to_string();
            assert!(e.contains(expected), "{spec}: {e:?} lacks {expected:?}");
        }
    }
}
