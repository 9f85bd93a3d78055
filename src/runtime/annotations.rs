//! What a container's spec asks of devremap: the `devremap.io/*` annotations, and whether the
//! spec has NVIDIA GPUs at all.
//!
//! Pure. `devremap.io/enable` is `"true"` or `"false"`; without it, devremap is used exactly
//! when the spec has NVIDIA GPUs in `linux.devices` or asks for them through the NVIDIA hook.
//! `devremap.io/device-map` is a `--device-map` value and `devremap.io/prefer` a `--prefer`
//! value, `devremap.io/relax` a `--relax` value (the checks a restore may fail with a warning);
//! all are checked here, so a bad one is refused before anything is set up. Any other
//! `devremap.io/` key is refused too: a misspelt annotation must not be ignored in silence.
//! `devremap.io/gpus` is the container's record (what `devremapd record` writes), which the NRI
//! plugin adds to every container it serves so that a CRI checkpoint carries it (issue 32): it
//! is kept here unchecked ([`Request::gpus`]); the NRI plugin reads it as untrusted metadata, with
//! a record file's rules and limits, and the wrapper, whose restore reads the record from the
//! checkpoint's image, accepts it and does not read it.
//!
//! Who may decide what (docs/security.md): annotations are the launcher's, and the operator's
//! runtime config says which of them launchers may set (its `annotations`, default
//! [`LAUNCHER_DEFAULT`]: not `devremap.io/relax`); one it does not allow is refused, naming the
//! config key that would allow it. `process.env` merges the image's `ENV` with the launcher's
//! `-e`, and the runtime cannot tell them apart, so it may only ask for a devremap `/dev`
//! (`DEVREMAP_ENABLE`, standing for `devremap.io/enable`, for clients that drop annotations):
//! the variables that once stood for the other annotations are not obeyed, only named in a
//! warning ([`Request::warnings`]). A pod's sandbox ([`is_sandbox`]) never gets devremap.

use crate::decision::checks::parse_relax;
use crate::decision::pairing::MapPair;
use crate::decision::plan::Prefer;
use crate::family::table::parse_device_map;
use crate::inputs::load::Sources;
use crate::inputs::spec::SpecView;
use serde_json::Value;
use thiserror::Error;

pub const ENABLE: &str = "devremap.io/enable";
pub const DEVICE_MAP: &str = "devremap.io/device-map";
pub const PREFER: &str = "devremap.io/prefer";
pub const RELAX: &str = "devremap.io/relax";
pub const GPUS: &str = "devremap.io/gpus";
const PREFIX: &str = "devremap.io/";
/// Every annotation devremap reads.
pub const KNOWN: &[&str] = &[ENABLE, DEVICE_MAP, PREFER, RELAX, GPUS];
/// The annotations launchers may set unless the operator's runtime config says otherwise:
/// none relaxes a check. `devremap.io/gpus` only names the container's own GPUs (as a
/// checkpoint's record file does, which a restore always reads): it never grants a device.
pub const LAUNCHER_DEFAULT: &[&str] = &[ENABLE, DEVICE_MAP, PREFER, GPUS];

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
    /// `devremap.io/gpus`, as written: untrusted, checked where it is read as a record.
    pub gpus: Option<String>,
    /// The `process.env` variables present that are not obeyed (see [`Request::warnings`]).
    pub ignored_env: Vec<&'static str>,
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
    #[error("unknown annotation {0} (known: {ENABLE}, {DEVICE_MAP}, {PREFER}, {RELAX}, {GPUS})")]
    Unknown(String),
    /// The operator's runtime config does not let launchers set this annotation.
    #[error(
        "annotation {0}: refused: the operator's runtime config does not let launchers set it (its \"annotations\" list must name {0})"
    )]
    NotAllowed(String),
    /// A reader of the spec was given a flag that contradicts the spec's annotation.
    #[error(
        "{flag} contradicts the spec's annotation {key}, which the container's daemon obeys; give the same value or none"
    )]
    Contradicts { flag: &'static str, key: &'static str },
}

/// The one `process.env` variable obeyed, standing for [`ENABLE`], for the clients that cannot
/// pass annotations: Docker before API 1.43 (Debian 12's 20.10) drops them without an error,
/// while `docker run -e DEVREMAP_ENABLE=true` reaches the spec (issue 17.4). Asking for a
/// devremap `/dev` (or opting out) gives no more than runc would, so the image's `ENV`, which
/// the runtime cannot tell from `-e`, may do it. The annotation wins over the variable.
pub const ENABLE_VAR: &str = "DEVREMAP_ENABLE";

/// The variables that stood for the other annotations until issue 29.1, now never obeyed:
/// the image's `ENV` could relax a check or pair the GPUs through them.
pub const NOT_OBEYED: &[(&str, &str)] =
    &[("DEVREMAP_DEVICE_MAP", DEVICE_MAP), ("DEVREMAP_PREFER", PREFER), ("DEVREMAP_RELAX", RELAX)];

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
            ENABLE if self.enable.is_none() => self.enable = Some(parse_enable(text, from)?),
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
            GPUS if self.gpus.is_none() => self.gpus = Some(text.to_owned()),
            ENABLE | DEVICE_MAP | PREFER | RELAX | GPUS => {}
            _ => return Err(AnnotationError::Unknown(key.to_owned())),
        }
        Ok(())
    }
}

impl Request {
    /// Adds what was asked to `sources`, as the wrapper gives it to the container's daemon,
    /// for another reader of the same spec (`cuda-device-map`): the pairing is one decision.
    /// A `--device-map` given as well must give the annotation's pairs ([`same_pairs`]);
    /// relaxed checks add up.
    pub fn add_to(&self, sources: &mut Sources) -> Result<(), AnnotationError> {
        if let Some(map) = &self.device_map {
            // Checked when read.
            let pairs = parse_device_map(map)
                .map_err(|e| AnnotationError::DeviceMap { from: DEVICE_MAP.into(), why: e.to_string() })?;
            if !sources.device_map.is_empty() && !same_pairs(&sources.device_map, &pairs) {
                return Err(AnnotationError::Contradicts { flag: "--device-map", key: DEVICE_MAP });
            }
            sources.device_map = pairs;
        }
        match self.prefer.as_deref() {
            Some("checkpoint") => sources.prefer = Prefer::Checkpoint,
            Some(_) => sources.prefer = Prefer::Native,
            None => {}
        }
        if let Some(relax) = &self.relax {
            sources.relax.extend(
                parse_relax(relax).map_err(|e| AnnotationError::Relax { from: RELAX.into(), why: e.to_string() })?,
            );
        }
        Ok(())
    }

    /// One line for each `process.env` variable present but not obeyed, naming it and what
    /// to use instead; the caller logs them.
    pub fn warnings(&self) -> Vec<String> {
        self.ignored_env
            .iter()
            .map(|&name| {
                let instead = match NOT_OBEYED.iter().find(|(var, _)| *var == name) {
                    Some((_, RELAX)) => format!(
                        "the annotation {RELAX} where the runtime config's \"annotations\" allows it, or the runtime config's \"relax\""
                    ),
                    Some((_, key)) => format!("the annotation {key}"),
                    None => format!("the annotation {ENABLE}, which the runtime config's \"annotations\" must allow"),
                };
                format!(
                    "process.env {name} is not obeyed: the image's ENV may set it, and only the operator or the launcher decides this; use {instead}"
                )
            })
            .collect()
    }
}

/// Whether two device maps give the same pairs: in any order (`--device-map` repeated gives
/// them as a list), a UUID in any case (the pairing compares UUIDs so). A UUID and the minor of
/// the same GPU are not told alike: that needs the inputs, and the one error is "give the same
/// value".
fn same_pairs(a: &[MapPair], b: &[MapPair]) -> bool {
    let sorted = |map: &[MapPair]| {
        let mut pairs: Vec<(String, String)> = map
            .iter()
            .map(|p| (p.old.to_string().to_ascii_lowercase(), p.new.to_string().to_ascii_lowercase()))
            .collect();
        pairs.sort();
        pairs
    };
    sorted(a) == sorted(b)
}

/// `devremap.io/enable`'s value, or its variable's; `from` names where it was read.
fn parse_enable(text: &str, from: String) -> Result<bool, AnnotationError> {
    match text {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(AnnotationError::Enable { from, value: other.to_owned() }),
    }
}

/// Reads the `devremap.io/*` annotations of a spec (as JSON), refusing one that `allowed`
/// (the runtime config's `annotations`) does not list, then `DEVREMAP_ENABLE` in its
/// `process.env` where the annotation is allowed: every value checked, the last one counting
/// (as runc gives the process the environment, and as the toolkit's map of it reads it), and
/// only if the annotation is unsaid; the other `DEVREMAP_*` variables are only noted in
/// `ignored_env`, each once.
pub fn parse(spec: &Value, allowed: &[String]) -> Result<Request, AnnotationError> {
    let mut request = Request::default();
    let map = match spec.get("annotations") {
        None | Some(Value::Null) => None,
        Some(Value::Object(map)) => Some(map),
        Some(_) => return Err(AnnotationError::NotAMap),
    };
    let is_allowed = |key: &str| allowed.iter().any(|a| a == key);
    for (key, value) in map.into_iter().flatten().filter(|(k, _)| k.starts_with(PREFIX)) {
        let text = value.as_str().ok_or_else(|| AnnotationError::NotAString {
            key: key.clone(),
            found: crate::inputs::metadata::describe(value),
        })?;
        if KNOWN.contains(&key.as_str()) && !is_allowed(key) {
            return Err(AnnotationError::NotAllowed(key.clone()));
        }
        request.set(key, text, format!("annotation {key}"))?;
    }
    // The spec parsed as an OCI spec before this is asked, so `env` holds strings; anything
    // else is no variable of ours.
    let env = spec.pointer("/process/env").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str);
    let mut enable_var = None;
    for (name, text) in env.filter_map(|e| e.split_once('=')) {
        if name == ENABLE_VAR && is_allowed(ENABLE) {
            enable_var = Some(parse_enable(text, format!("process.env {name}"))?);
        } else if let Some(var) = NOT_OBEYED.iter().map(|(var, _)| *var).chain([ENABLE_VAR]).find(|var| *var == name)
            && !request.ignored_env.contains(&var)
        {
            request.ignored_env.push(var);
        }
    }
    request.enable = request.enable.or(enable_var);
    Ok(request)
}

/// Every annotation devremap reads, as a runtime config's `annotations` list: for readers
/// that grant nothing (`devremapd cuda-device-map` only prints a pairing), which take a spec's
/// annotations as the wrapper obeys them when it runs the container at all.
pub fn every_key() -> Vec<String> {
    KNOWN.iter().map(|k| (*k).to_owned()).collect()
}

/// [`LAUNCHER_DEFAULT`], as a runtime config's `annotations` list.
pub fn launcher_default() -> Vec<String> {
    LAUNCHER_DEFAULT.iter().map(|k| (*k).to_owned()).collect()
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

    /// Parsed as a runtime config allowing every annotation would.
    fn parse(spec: &Value) -> Result<Request, AnnotationError> {
        super::parse(spec, &every_key())
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
    fn the_enable_variable_stands_for_its_annotation() {
        let env = |vars: &[&str]| json!({"process": {"env": vars}});
        let r = parse(&env(&["PATH=/bin", "DEVREMAP_ENABLE=true"])).unwrap();
        assert_eq!(r.enable, Some(true));
        assert!(r.wanted(&SpecView::default()));
        assert_eq!(parse(&env(&["DEVREMAP_ENABLE=false"])).unwrap().enable, Some(false));
        let mut both = env(&["DEVREMAP_ENABLE=true"]);
        both["annotations"] = json!({ENABLE: "false"});
        assert_eq!(parse(&both).unwrap().enable, Some(false));
        let e = parse(&env(&["DEVREMAP_ENABLE=1"])).unwrap_err().to_string();
        assert_eq!(e, "process.env DEVREMAP_ENABLE: expected \"true\" or \"false\", found \"1\"");
        assert!(parse(&env(&["DEVREMAP_ENABLEX=1", "NOEQUALS"])).unwrap() == Request::default());
    }

    /// Bug (issue 29, attack 2 B7): `DEVREMAP_ENABLE` given twice (an image's `true`, a
    /// launcher's trailing `false` in a hand-made spec) took the first value, while runc gives
    /// the process the last and the toolkit reads the last; the second value was never checked.
    /// The last counts, every one is checked, and a repeated variable that is not obeyed is
    /// named in one warning.
    #[test]
    fn a_repeated_variable_counts_as_its_last_value() {
        let env = |vars: &[&str]| json!({"process": {"env": vars}});
        assert_eq!(parse(&env(&["DEVREMAP_ENABLE=true", "DEVREMAP_ENABLE=false"])).unwrap().enable, Some(false));
        assert_eq!(parse(&env(&["DEVREMAP_ENABLE=false", "DEVREMAP_ENABLE=true"])).unwrap().enable, Some(true));
        for bad in
            [["DEVREMAP_ENABLE=true", "DEVREMAP_ENABLE=bogus"], ["DEVREMAP_ENABLE=bogus", "DEVREMAP_ENABLE=true"]]
        {
            let e = parse(&env(&bad)).unwrap_err().to_string();
            assert_eq!(e, "process.env DEVREMAP_ENABLE: expected \"true\" or \"false\", found \"bogus\"");
        }
        let r = parse(&env(&["DEVREMAP_RELAX=mode", "DEVREMAP_PREFER=native", "DEVREMAP_RELAX=mode"])).unwrap();
        assert_eq!(r.warnings().len(), 2, "{:?}", r.warnings());
        let none = super::parse(&env(&["DEVREMAP_ENABLE=true", "DEVREMAP_ENABLE=true"]), &[]).unwrap();
        assert_eq!(none.ignored_env, ["DEVREMAP_ENABLE"]);
    }

    /// Bug (issue 29.1): the image's `ENV` (merged into `process.env` with `-e`) relaxed the
    /// checks and paired the GPUs through `DEVREMAP_RELAX`, `DEVREMAP_DEVICE_MAP` and
    /// `DEVREMAP_PREFER`. They are no longer obeyed, whatever their value, and each is named
    /// in one warning saying what to use instead.
    #[test]
    fn the_image_env_never_relaxes_pairs_or_names() {
        let spec = json!({"process": {"env": ["DEVREMAP_RELAX=mode", "DEVREMAP_DEVICE_MAP=0=1",
                                                "DEVREMAP_PREFER=checkpoint", "DEVREMAP_ENABLE=true"]}});
        let r = parse(&spec).unwrap();
        assert_eq!((&r.relax, &r.device_map, &r.prefer, r.enable), (&None, &None, &None, Some(true)));
        assert!(r.daemon_args().is_empty());
        assert_eq!(r.ignored_env, ["DEVREMAP_RELAX", "DEVREMAP_DEVICE_MAP", "DEVREMAP_PREFER"]);
        let w = r.warnings();
        assert_eq!(w.len(), 3);
        assert_eq!(
            w[0],
            "process.env DEVREMAP_RELAX is not obeyed: the image's ENV may set it, and only the operator or the \
             launcher decides this; use the annotation devremap.io/relax where the runtime config's \"annotations\" \
             allows it, or the runtime config's \"relax\""
        );
        assert!(w[1].ends_with("use the annotation devremap.io/device-map"), "{}", w[1]);
        // A value that would be refused as an annotation is not even read.
        let r = parse(&json!({"process": {"env": ["DEVREMAP_RELAX=count", "DEVREMAP_DEVICE_MAP=x"]}})).unwrap();
        assert_eq!(r.ignored_env.len(), 2);
    }

    /// Rule (issue 29.1, held when attacked from outside): no spelling of the variables in
    /// `process.env` relaxes, pairs or names: another case, a repeat, no `=`, a NUL or a 1 MiB
    /// value; and an annotation whose prefix is in another case is no annotation of ours, so
    /// it is not obeyed either (the default config does not allow `devremap.io/relax`).
    #[test]
    fn no_spelling_of_the_env_or_annotation_keys_relaxes() {
        let long = format!("DEVREMAP_RELAX={}", "mode,".repeat(200_000));
        let env: Vec<&str> = vec![
            "devremap_relax=mode",
            "Devremap_Relax=mode",
            "DEVREMAP_RELAX",
            "DEVREMAP_RELAX=mode\0",
            &long,
            "DEVREMAP_DEVICE_MAP=0=1",
            "DEVREMAP_DEVICE_MAP=1=0",
            " DEVREMAP_PREFER=checkpoint",
        ];
        let spec = json!({"process": {"env": env},
                          "annotations": {"Devremap.io/relax": "mode", "DEVREMAP.IO/device-map": "0=1"}});
        let r = super::parse(&spec, &launcher_default()).unwrap();
        assert_eq!((&r.relax, &r.device_map, &r.prefer, r.enable), (&None, &None, &None, None));
        assert!(r.daemon_args().is_empty());
        assert!(r.ignored_env.iter().all(|v| NOT_OBEYED.iter().any(|(n, _)| n == v)), "{:?}", r.ignored_env);
    }

    /// Rule (issue 29.1): launchers set only the annotations the operator's runtime config
    /// lists; by default not `devremap.io/relax`. One not listed is refused naming it and the
    /// config's `annotations`, never ignored; `DEVREMAP_ENABLE` where `devremap.io/enable` is
    /// not listed is not obeyed, only warned about.
    #[test]
    fn the_operator_says_which_annotations_launchers_set() {
        let default = launcher_default();
        let r = super::parse(&with(json!({ENABLE: "true", DEVICE_MAP: "0=1", PREFER: "checkpoint"})), &default);
        assert_eq!(r.unwrap().daemon_args(), ["--device-map", "0=1", "--prefer", "checkpoint"]);
        let e = super::parse(&with(json!({RELAX: "mode"})), &default).unwrap_err();
        assert_eq!(
            e.to_string(),
            "annotation devremap.io/relax: refused: the operator's runtime config does not let launchers set it \
             (its \"annotations\" list must name devremap.io/relax)"
        );
        let mut relaxing = default.clone();
        relaxing.push(RELAX.to_owned());
        assert_eq!(super::parse(&with(json!({RELAX: "mode"})), &relaxing).unwrap().relax.as_deref(), Some("mode"));
        let none: Vec<String> = vec![];
        assert_eq!(
            super::parse(&with(json!({ENABLE: "true"})), &none),
            Err(AnnotationError::NotAllowed(ENABLE.into()))
        );
        let r = super::parse(&json!({"process": {"env": ["DEVREMAP_ENABLE=true"]}}), &none).unwrap();
        assert_eq!((r.enable, r.ignored_env.as_slice()), (None, &["DEVREMAP_ENABLE"][..]));
        assert!(r.warnings()[0].contains("runtime config's \"annotations\" must allow"), "{:?}", r.warnings());
        // Someone else's annotations are not ours to refuse.
        assert!(super::parse(&with(json!({"io.kubernetes.x": "y"})), &none).is_ok());
    }

    /// Rule (issue 32): `devremap.io/gpus`, the NRI plugin's record, is a known annotation the
    /// launchers' default allows: kept as written (it is checked where it is read as a record),
    /// no daemon flag, and refused like any other where the config does not list it.
    #[test]
    fn the_record_annotation_is_known_and_kept_as_written() {
        let r = super::parse(&with(json!({GPUS: "not even JSON"})), &launcher_default()).unwrap();
        assert_eq!(r.gpus.as_deref(), Some("not even JSON"));
        assert!(r.daemon_args().is_empty() && r.enable.is_none());
        let only_enable = vec![ENABLE.to_owned()];
        assert_eq!(
            super::parse(&with(json!({GPUS: "[]"})), &only_enable),
            Err(AnnotationError::NotAllowed(GPUS.into()))
        );
    }

    /// Rule (issue 29.2): another reader of the spec (`cuda-device-map`) gets the pairing the
    /// wrapper gives the daemon: the annotation's device map, prefer and relax; a
    /// `--device-map` that contradicts the annotation is refused, the same one is not.
    #[test]
    fn the_annotations_become_a_readers_sources() {
        let r = parse(&with(json!({DEVICE_MAP: "0=3,1=2", PREFER: "checkpoint", RELAX: "model"}))).unwrap();
        let mut sources = Sources::default();
        r.add_to(&mut sources).unwrap();
        assert_eq!(sources.device_map, parse_device_map("0=3,1=2").unwrap());
        assert_eq!(sources.prefer, Prefer::Checkpoint);
        assert_eq!(sources.relax, parse_relax("model").unwrap());
        r.add_to(&mut sources).unwrap();
        let mut other = Sources { device_map: parse_device_map("0=2").unwrap(), ..Sources::default() };
        let e = r.add_to(&mut other).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--device-map contradicts the spec's annotation devremap.io/device-map, which the container's daemon \
             obeys; give the same value or none"
        );
        let mut untouched = Sources::default();
        parse(&json!({})).unwrap().add_to(&mut untouched).unwrap();
        assert_eq!(untouched, Sources::default());
    }

    /// Bug (issue 29, attack 2 B6): a `--device-map` was compared with the annotation as a
    /// list, so the same pairs in another order, or a UUID in another case, were refused as a
    /// contradiction while `--device-map 0=3 --device-map 1=2` was taken; pairs are compared
    /// as a set of parsed pairs.
    #[test]
    fn the_same_pairs_in_another_order_do_not_contradict() {
        let uuid = "GPU-5b2c0000-1111-4222-8333-000000000000";
        let r = parse(&with(json!({DEVICE_MAP: format!("{uuid}=3,1=2")}))).unwrap();
        let flag = |map: &str| Sources { device_map: parse_device_map(map).unwrap(), ..Sources::default() };
        for same in [format!("1=2,{uuid}=3"), format!("1=2,{}=3", uuid.to_uppercase())] {
            r.add_to(&mut flag(&same)).unwrap_or_else(|e| panic!("{same}: {e}"));
        }
        for other in ["1=2", "1=2,0=3", "1=3,GPU-5b2c0000-1111-4222-8333-000000000000=2"] {
            assert!(r.add_to(&mut flag(other)).is_err(), "{other}");
        }
        let mut untouched = Sources::default();
        parse(&json!({})).unwrap().add_to(&mut untouched).unwrap();
        assert_eq!(untouched, Sources::default());
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
