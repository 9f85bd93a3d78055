//! The wrapper's config file: a JSON object with `runtime` (the real runtime, a path or a name
//! looked up on `PATH`; default `runc`), `host_dev` and `host_root` (the daemon's `--host-dev`
//! and `--host-root`), `state_dir` (default `/run/devremap`), `devremapd` (the daemon's
//! binary; default the `devremapd` next to the wrapper), `node_socket` (the node daemon's
//! socket; default `<state_dir>/node.sock`), `annotations` (the `devremap.io/`
//! annotations launchers may set; default `devremap.io/enable`, `devremap.io/device-map`,
//! `devremap.io/prefer` and `devremap.io/gpus` (the NRI plugin's record): add `devremap.io/relax` to let them relax a check) and `relax` (the
//! checks every restore may fail with a warning, a `--relax` value: the operator's own choice).
//!
//! Pure: [`parse`] takes the file's bytes, [`check_access`] its owner and mode. Every key is
//! optional; an unknown key, a key given twice, a value of the wrong type, or a relative path
//! is refused, so a typo never silently falls back to a default and no second `runtime` hides
//! behind the first; so is a file that another user could write, or one in a directory another
//! user could write (they could rename another file over it), which for a symlinked config is
//! each link's directory and the directory of the file it leads to (the caller finds them).
//! Only those directories are checked, not the ones above them: `/etc` and `/` are root's on
//! any host this runs on, and a config named elsewhere is the caller's choice.

use crate::decision::checks::parse_relax;
use crate::runtime::annotations::{self, KNOWN};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;
use std::path::PathBuf;
use thiserror::Error;

/// Where the wrapper reads its config unless `DEVREMAP_RUNTIME_CONFIG` names another file.
pub const DEFAULT_PATH: &str = "/etc/devremap/runtime.json";
/// The environment variable naming the config file.
pub const ENV: &str = "DEVREMAP_RUNTIME_CONFIG";
/// The largest config file read.
pub const MAX_LEN: u64 = 64 << 10;

/// The wrapper's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The real runtime: an absolute path, or a bare name looked up on `PATH`.
    pub runtime: PathBuf,
    pub host_dev: Option<PathBuf>,
    pub host_root: PathBuf,
    /// Each container's daemon lives in `<state_dir>/<container id>/`.
    pub state_dir: PathBuf,
    /// The `devremapd` binary; `None` means the one next to the wrapper.
    pub devremapd: Option<PathBuf>,
    /// The node daemon's socket; `None` means `<state_dir>/node.sock` (`/run/devremap/node.sock`
    /// by default).
    pub node_socket: Option<PathBuf>,
    /// The `devremap.io/` annotations launchers may set (see `annotations`).
    pub annotations: Vec<String>,
    /// The operator's `--relax` value for every container's daemon, checked.
    pub relax: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            runtime: PathBuf::from("runc"),
            host_dev: None,
            host_root: PathBuf::from("/"),
            state_dir: PathBuf::from("/run/devremap"),
            devremapd: None,
            node_socket: None,
            annotations: annotations::launcher_default(),
            relax: None,
        }
    }
}

impl Config {
    /// The daemon flags the operator's config adds for every container.
    pub fn daemon_args(&self) -> Vec<String> {
        self.relax.iter().flat_map(|r| ["--relax".to_owned(), r.clone()]).collect()
    }

    /// The node daemon's socket.
    pub fn node_socket(&self) -> PathBuf {
        self.node_socket.clone().unwrap_or_else(|| self.state_dir.join("node.sock"))
    }
}

/// The keys a config may hold.
const KEYS: &[&str] =
    &["runtime", "host_dev", "host_root", "state_dir", "devremapd", "node_socket", "annotations", "relax"];

/// Why a config file was refused; the caller prefixes the file.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("expected a JSON object")]
    NotAnObject,
    #[error("unknown key {0:?} (known: {known})", known = KEYS.join(", "))]
    UnknownKey(String),
    /// serde_json keeps the last of a repeated key: the file would not be read as it reads.
    #[error("key {0:?} is given twice; refused: give each key once")]
    Duplicate(String),
    #[error("annotations: expected an array of annotation keys, found {0}")]
    NotAList(String),
    #[error("annotations: unknown annotation {0:?} (known: {known})", known = KNOWN.join(", "))]
    UnknownAnnotation(String),
    #[error("relax: {0}")]
    Relax(String),
    #[error("{key}: expected a string, found {found}")]
    NotAString { key: String, found: String },
    #[error("{key}: {value:?} is not an absolute path")]
    Relative { key: String, value: String },
    #[error("larger than {MAX_LEN} bytes")]
    TooLarge,
    /// The file chooses what runs as root: only root (the wrapper's user) may write it.
    #[error("owned by uid {owner}, not {me}; refused: the config chooses what runs as root (chown {me} it)")]
    Owner { owner: u32, me: u32 },
    #[error("writable by group or others; refused: the config chooses what runs as root (chmod go-w it)")]
    Writable,
    /// Whoever can write the directory can put another file in the config's place.
    #[error(
        "its directory {dir} is owned by uid {owner}, not {me} or root; refused: the config chooses what runs as root (chown {me} {dir})"
    )]
    DirOwner { dir: String, owner: u32, me: u32 },
    #[error(
        "its directory {dir} is writable by group or others; refused: the config chooses what runs as root (chmod go-w {dir})"
    )]
    DirWritable { dir: String },
    #[error(
        "the symlink {link} on the way to it is owned by uid {owner}, not {me} or root; refused: the config chooses what runs as root"
    )]
    LinkOwner { link: String, owner: u32, me: u32 },
}

/// Checks a config file's owner and mode (`st_uid`, `st_mode`) for a wrapper running as
/// `me`: a file another user could write would let them choose the runtime, the daemon and
/// the directories the wrapper runs and writes as root.
pub fn check_access(owner: u32, mode: u32, me: u32) -> Result<(), ConfigError> {
    if owner != me {
        return Err(ConfigError::Owner { owner, me });
    }
    if mode & 0o022 != 0 {
        return Err(ConfigError::Writable);
    }
    Ok(())
}

/// Checks a symlink on the way to the config (`st_uid` of `link`, not followed) for a wrapper
/// running as `me`: in a sticky directory (`/tmp`) the link's owner may still replace it.
pub fn check_link_owner(link: &str, owner: u32, me: u32) -> Result<(), ConfigError> {
    if owner != me && owner != 0 {
        return Err(ConfigError::LinkOwner { link: link.to_owned(), owner, me });
    }
    Ok(())
}

/// Checks the directory holding the config file (`st_uid`, `st_mode` of `dir`) for a wrapper
/// running as `me`: it must be `me`'s or root's, and writable by no one else, unless it is
/// sticky (as `/tmp` is): there only the file's owner, checked by [`check_access`], or the
/// directory's can rename or remove the file.
pub fn check_dir_access(dir: &str, owner: u32, mode: u32, me: u32) -> Result<(), ConfigError> {
    if owner != me && owner != 0 {
        return Err(ConfigError::DirOwner { dir: dir.to_owned(), owner, me });
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(ConfigError::DirWritable { dir: dir.to_owned() });
    }
    Ok(())
}

/// A JSON object's members in the file's order, repeated keys kept (serde_json's map keeps
/// only the last of them).
struct Members(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Members, D::Error> {
        struct Collect;
        impl<'de> Visitor<'de> for Collect {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Value>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Collect)
    }
}

fn text<'a>(key: &str, value: &'a Value) -> Result<&'a str, ConfigError> {
    value
        .as_str()
        .ok_or_else(|| ConfigError::NotAString { key: key.to_owned(), found: crate::inputs::metadata::describe(value) })
}

/// The `annotations` list: `devremap.io/` keys devremap reads.
fn allowed_annotations(value: &Value) -> Result<Vec<String>, ConfigError> {
    let describe = crate::inputs::metadata::describe;
    let list = value.as_array().ok_or_else(|| ConfigError::NotAList(describe(value)))?;
    list.iter()
        .map(|key| match key.as_str() {
            Some(k) if KNOWN.contains(&k) => Ok(k.to_owned()),
            Some(k) => Err(ConfigError::UnknownAnnotation(k.to_owned())),
            None => Err(ConfigError::NotAList(format!("{} in it", describe(key)))),
        })
        .collect()
}

/// Parses a config file's bytes.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.len() as u64 > MAX_LEN {
        return Err(ConfigError::TooLarge);
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
    if !value.is_object() {
        return Err(ConfigError::NotAnObject);
    }
    // Valid JSON and an object: read again, keeping every member.
    let Members(members) = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
    if let Some((i, _)) = members.iter().enumerate().find(|(i, (k, _))| members[..*i].iter().any(|(o, _)| o == k)) {
        return Err(ConfigError::Duplicate(members[i].0.clone()));
    }
    let mut config = Config::default();
    for (key, value) in &members {
        match key.as_str() {
            "annotations" => config.annotations = allowed_annotations(value)?,
            "relax" => {
                let checks = text(key, value)?;
                parse_relax(checks).map_err(|e| ConfigError::Relax(e.to_string()))?;
                config.relax = Some(checks.to_owned());
            }
            k if KEYS.contains(&k) => {
                let text = text(key, value)?;
                // A bare name is looked up on PATH, as a shell would; anything with a slash must
                // be absolute, since the wrapper runs in whatever directory its caller chose.
                let bare_name_ok = key == "runtime" && !text.is_empty() && !text.contains('/');
                if !text.starts_with('/') && !bare_name_ok {
                    return Err(ConfigError::Relative { key: key.clone(), value: text.to_owned() });
                }
                let path = PathBuf::from(text);
                match k {
                    "runtime" => config.runtime = path,
                    "host_dev" => config.host_dev = Some(path),
                    "host_root" => config.host_root = path,
                    "state_dir" => config.state_dir = path,
                    "node_socket" => config.node_socket = Some(path),
                    _ => config.devremapd = Some(path),
                }
            }
            _ => return Err(ConfigError::UnknownKey(key.clone())),
        }
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key read; absent keys keep their defaults.
    #[test]
    fn keys_and_defaults() {
        assert_eq!(parse(b"{}").unwrap(), Config::default());
        let c = parse(
            br#"{"runtime": "/usr/bin/crun", "host_dev": "/dev", "host_root": "/host", "state_dir": "/run/x",
                "devremapd": "/opt/devremapd"}"#,
        )
        .unwrap();
        assert_eq!(c.runtime, PathBuf::from("/usr/bin/crun"));
        assert_eq!(c.host_dev, Some(PathBuf::from("/dev")));
        assert_eq!((c.host_root.to_str(), c.state_dir.to_str()), (Some("/host"), Some("/run/x")));
        assert_eq!(c.devremapd, Some(PathBuf::from("/opt/devremapd")));
        assert_eq!(c.node_socket(), PathBuf::from("/run/x/node.sock"), "the node socket defaults into state_dir");
        assert_eq!(Config::default().node_socket(), PathBuf::from("/run/devremap/node.sock"));
        let node = parse(br#"{"node_socket": "/run/node.sock"}"#).unwrap();
        assert_eq!(node.node_socket(), PathBuf::from("/run/node.sock"));
        assert_eq!(parse(br#"{"runtime": "crun"}"#).unwrap().runtime, PathBuf::from("crun"));
        assert_eq!(
            Config::default().annotations,
            ["devremap.io/enable", "devremap.io/device-map", "devremap.io/prefer", "devremap.io/gpus"]
        );
        let c =
            parse(br#"{"annotations": ["devremap.io/enable", "devremap.io/relax"], "relax": "model,driver"}"#).unwrap();
        assert_eq!(c.annotations, ["devremap.io/enable", "devremap.io/relax"]);
        assert_eq!(c.daemon_args(), ["--relax", "model,driver"]);
        assert!(Config::default().daemon_args().is_empty());
    }

    /// Bug (issue 29.7): a key given twice was last-wins (a second `"runtime"` ran that
    /// program); it is refused, naming the key.
    #[test]
    fn a_key_given_twice_is_refused() {
        let e = parse(br#"{"runtime": "/usr/bin/runc", "host_dev": "/dev", "runtime": "/tmp/evil"}"#).unwrap_err();
        assert_eq!(e, ConfigError::Duplicate("runtime".into()));
        assert_eq!(e.to_string(), "key \"runtime\" is given twice; refused: give each key once");
        // The same key spelt with an escape is the same key.
        let e = parse(br#"{"runtime": "/usr/bin/runc", "run\u0074ime": "/tmp/evil"}"#).unwrap_err();
        assert_eq!(e, ConfigError::Duplicate("runtime".into()));
        let e = parse(br#"{"annotations": [], "annotations": ["devremap.io/relax"]}"#).unwrap_err();
        assert_eq!(e, ConfigError::Duplicate("annotations".into()));
    }

    /// Rule (issue 12.3): a bad config is a clear error naming the key at fault.
    #[test]
    fn bad_configs_are_refused() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "not valid JSON"),
            (b"[]", "expected a JSON object"),
            (br#"{"runtim": "runc"}"#, "unknown key \"runtim\""),
            (br#"{"state_dir": 5}"#, "state_dir: expected a string, found 5"),
            (br#"{"state_dir": "run/devremap"}"#, "state_dir: \"run/devremap\" is not an absolute path"),
            (br#"{"runtime": "bin/runc"}"#, "not an absolute path"),
            (br#"{"runtime": ""}"#, "not an absolute path"),
            (br#"{"host_root": null}"#, "expected a string, found null"),
            (br#"{"annotations": "devremap.io/relax"}"#, "annotations: expected an array of annotation keys"),
            (br#"{"annotations": [1]}"#, "annotations: expected an array of annotation keys, found 1 in it"),
            (br#"{"annotations": ["devremap.io/relaxed"]}"#, "annotations: unknown annotation \"devremap.io/relaxed\""),
            (br#"{"relax": "count"}"#, "relax: count cannot be relaxed"),
            (br#"{"relax": ["mode"]}"#, "relax: expected a string"),
        ];
        for (input, expected) in cases {
            let e = parse(input).unwrap_err().to_string();
            assert!(e.contains(expected), "{}: {e:?} lacks {expected:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(parse(&vec![b' '; MAX_LEN as usize + 1]), Err(ConfigError::TooLarge));
    }

    /// Rule (issue 29.7, held when attacked from outside): `relax` and `annotations` take
    /// only what they name exactly: an empty or trailing check, another case, a key with a NUL
    /// or in another case, and `null` are refused, never read as "none" or as the default.
    #[test]
    fn odd_spellings_of_relax_and_annotations_are_refused() {
        let cases: &[(&[u8], &str)] = &[
            (br#"{"relax": ""}"#, "relax: unknown check \"\""),
            (br#"{"relax": "mode,"}"#, "relax: unknown check \"\""),
            (br#"{"relax": "MODE"}"#, "relax: unknown check \"MODE\""),
            (br#"{"relax": null}"#, "relax: expected a string, found null"),
            (br#"{"annotations": null}"#, "annotations: expected an array of annotation keys, found null"),
            (br#"{"annotations": ["Devremap.io/relax"]}"#, "unknown annotation \"Devremap.io/relax\""),
            (br#"{"annotations": ["devremap.io/relax\u0000"]}"#, "unknown annotation \"devremap.io/relax\\0\""),
            (br#"{"annotations": ["io.kubernetes.cri/x"]}"#, "unknown annotation \"io.kubernetes.cri/x\""),
            (br#"{"Runtime": "/bin/true"}"#, "unknown key \"Runtime\""),
        ];
        for (input, expected) in cases {
            let e = parse(input).unwrap_err().to_string();
            assert!(e.contains(expected), "{}: {e:?} lacks {expected:?}", String::from_utf8_lossy(input));
        }
        // An empty list allows no annotation at all; a check repeated is the same check.
        assert!(parse(br#"{"annotations": []}"#).unwrap().annotations.is_empty());
        assert_eq!(parse(br#"{"relax": "mode,mode"}"#).unwrap().daemon_args(), ["--relax", "mode,mode"]);
    }

    /// Rule (issue 21): a config another user can write is refused, with the fix.
    #[test]
    fn a_config_others_can_write_is_refused() {
        assert_eq!(check_access(0, 0o100644, 0), Ok(()));
        assert_eq!(check_access(1000, 0o100600, 1000), Ok(()));
        assert_eq!(check_access(1000, 0o100644, 0), Err(ConfigError::Owner { owner: 1000, me: 0 }));
        assert_eq!(check_access(0, 0o100664, 0), Err(ConfigError::Writable));
        assert_eq!(check_access(0, 0o100646, 0), Err(ConfigError::Writable));
        assert!(ConfigError::Writable.to_string().contains("chmod go-w"));
    }

    /// Rule (issue 29.6): a symlink on the way to the config must be root's or the wrapper
    /// user's: in a sticky directory its owner could point it elsewhere.
    #[test]
    fn a_symlink_of_another_user_is_refused() {
        assert_eq!(check_link_owner("/tmp/rt.json", 0, 0), Ok(()));
        assert_eq!(check_link_owner("/tmp/rt.json", 1000, 1000), Ok(()));
        assert_eq!(check_link_owner("/tmp/rt.json", 0, 1000), Ok(()));
        let e = check_link_owner("/tmp/rt.json", 1000, 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the symlink /tmp/rt.json on the way to it is owned by uid 1000, not 0 or root; refused: the config chooses what runs as root"
        );
    }

    /// Rule (issue 21): a config in a directory another user can write is refused, naming the
    /// directory; a sticky directory (`/tmp`) keeps others from replacing the file.
    #[test]
    fn a_config_in_a_directory_others_can_write_is_refused() {
        let d = "/etc/devremap";
        assert_eq!(check_dir_access(d, 0, 0o40755, 0), Ok(()));
        assert_eq!(check_dir_access(d, 0, 0o40755, 1000), Ok(()));
        assert_eq!(check_dir_access(d, 1000, 0o40700, 1000), Ok(()));
        assert_eq!(check_dir_access("/tmp", 0, 0o41777, 0), Ok(()));
        let owner = ConfigError::DirOwner { dir: d.to_owned(), owner: 1000, me: 0 };
        assert_eq!(check_dir_access(d, 1000, 0o40755, 0), Err(owner));
        for mode in [0o40775, 0o40757, 0o40777] {
            assert_eq!(
                check_dir_access(d, 0, mode, 0),
                Err(ConfigError::DirWritable { dir: d.to_owned() }),
                "{mode:o}"
            );
        }
        let text = ConfigError::DirWritable { dir: d.to_owned() }.to_string();
        assert_eq!(
            text,
            "its directory /etc/devremap is writable by group or others; refused: the config chooses what runs as root (chmod go-w /etc/devremap)"
        );
    }
}
