//! The wrapper's config file: a JSON object with `runtime` (the real runtime, a path or a name
//! looked up on `PATH`; default `runc`), `host_dev` and `host_root` (the daemon's `--host-dev`
//! and `--host-root`), `state_dir` (default `/run/devremap`) and `devremapd` (the daemon's
//! binary; default the `devremapd` next to the wrapper).
//!
//! Pure: [`parse`] takes the file's bytes, [`check_access`] its owner and mode. Every key is
//! optional; an unknown key, a value that is not a string, or a relative path is refused, so a
//! typo never silently falls back to a default; so is a file that another user could write.

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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            runtime: PathBuf::from("runc"),
            host_dev: None,
            host_root: PathBuf::from("/"),
            state_dir: PathBuf::from("/run/devremap"),
            devremapd: None,
        }
    }
}

/// Why a config file was refused; the caller prefixes the file.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("expected a JSON object")]
    NotAnObject,
    #[error("unknown key {0:?} (known: runtime, host_dev, host_root, state_dir, devremapd)")]
    UnknownKey(String),
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

/// Parses a config file's bytes.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.len() as u64 > MAX_LEN {
        return Err(ConfigError::TooLarge);
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
    let obj = value.as_object().ok_or(ConfigError::NotAnObject)?;
    let mut config = Config::default();
    for (key, value) in obj {
        if !["runtime", "host_dev", "host_root", "state_dir", "devremapd"].contains(&key.as_str()) {
            return Err(ConfigError::UnknownKey(key.clone()));
        }
        let text = value.as_str().ok_or_else(|| ConfigError::NotAString {
            key: key.clone(),
            found: crate::inputs::metadata::describe(value),
        })?;
        // A bare name is looked up on PATH, as a shell would; anything with a slash must be
        // absolute, since the wrapper runs in whatever directory its caller chose.
        let bare_name_ok = key == "runtime" && !text.is_empty() && !text.contains('/');
        if !text.starts_with('/') && !bare_name_ok {
            return Err(ConfigError::Relative { key: key.clone(), value: text.to_owned() });
        }
        let path = PathBuf::from(text);
        match key.as_str() {
            "runtime" => config.runtime = path,
            "host_dev" => config.host_dev = Some(path),
            "host_root" => config.host_root = path,
            "state_dir" => config.state_dir = path,
            _ => config.devremapd = Some(path),
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
        assert_eq!(parse(br#"{"runtime": "crun"}"#).unwrap().runtime, PathBuf::from("crun"));
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
        ];
        for (input, expected) in cases {
            let e = parse(input).unwrap_err().to_string();
            assert!(e.contains(expected), "{}: {e:?} lacks {expected:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(parse(&vec![b' '; MAX_LEN as usize + 1]), Err(ConfigError::TooLarge));
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
}
