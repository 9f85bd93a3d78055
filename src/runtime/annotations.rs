//! What a container's spec asks of devremap: the `devremap.io/*` annotations, and whether the
//! spec has NVIDIA GPUs at all.
//!
//! Pure. `devremap.io/enable` is `"true"` or `"false"`; without it, devremap is used exactly
//! when the spec has NVIDIA GPUs in `linux.devices` or asks for them through the NVIDIA hook.
//! `devremap.io/device-map` is a `--device-map` value and `devremap.io/prefer` a `--prefer`
//! value, `devremap.io/relax` a `--relax` value (the checks a restore may fail with a warning);
//! all are checked here, so a bad one is refused before anything is set up. Any other
//! `devremap.io/` key is refused too: a misspelt annotation must not be ignored in silence.

use crate::checks::parse_relax;
use crate::pairing::parse_device_map;
use crate::spec::SpecView;
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
        self.enable.unwrap_or_else(|| spec.hook.is_some() || spec.devices.iter().any(|d| d.gpu_minor().is_some()))
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

/// Why the annotations were refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AnnotationError {
    #[error("annotations: expected an object of strings")]
    NotAMap,
    #[error("annotation {key}: expected a string, found {found}")]
    NotAString { key: String, found: String },
    #[error("annotation {ENABLE}: expected \"true\" or \"false\", found {0:?}")]
    Enable(String),
    #[error("annotation {DEVICE_MAP}: {0}")]
    DeviceMap(String),
    #[error("annotation {PREFER}: expected \"native\" or \"checkpoint\", found {0:?}")]
    Prefer(String),
    #[error("annotation {RELAX}: {0}")]
    Relax(String),
    #[error("unknown annotation {0} (known: {ENABLE}, {DEVICE_MAP}, {PREFER}, {RELAX})")]
    Unknown(String),
}

/// Reads the `devremap.io/*` annotations of a spec (as JSON).
pub fn parse(spec: &Value) -> Result<Request, AnnotationError> {
    let mut request = Request::default();
    let Some(annotations) = spec.get("annotations") else { return Ok(request) };
    let map = match annotations {
        Value::Null => return Ok(request),
        Value::Object(map) => map,
        _ => return Err(AnnotationError::NotAMap),
    };
    for (key, value) in map.iter().filter(|(k, _)| k.starts_with(PREFIX)) {
        let text = value
            .as_str()
            .ok_or_else(|| AnnotationError::NotAString { key: key.clone(), found: crate::metadata::describe(value) })?;
        match key.as_str() {
            ENABLE => {
                request.enable = Some(match text {
                    "true" => true,
                    "false" => false,
                    other => return Err(AnnotationError::Enable(other.to_owned())),
                })
            }
            DEVICE_MAP => {
                parse_device_map(text).map_err(|e| AnnotationError::DeviceMap(e.to_string()))?;
                request.device_map = Some(text.to_owned());
            }
            RELAX => {
                parse_relax(text).map_err(|e| AnnotationError::Relax(e.to_string()))?;
                request.relax = Some(text.to_owned());
            }
            PREFER => match text {
                "native" | "checkpoint" => request.prefer = Some(text.to_owned()),
                other => return Err(AnnotationError::Prefer(other.to_owned())),
            },
            _ => return Err(AnnotationError::Unknown(key.clone())),
        }
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, DevKind, Rdev};
    use crate::spec::SpecDevice;
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
        assert!(none.wanted(&SpecView { hook: Some(crate::visible::Visible::All), ..SpecView::default() }));
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
