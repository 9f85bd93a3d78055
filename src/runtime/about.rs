//! What `devremap-runtime --help` and `--version` print before the real runtime's own text:
//! what the wrapper adds, its config file, its annotations and its version.
//!
//! Pure: [`asked`] reads the command line, [`text`] is the lines. The wrapper prints them and
//! then runs the real runtime with the same command line, so its help or version follows.
//! No line of the version text but the first holds the word "version": Docker reads a
//! runtime's `--version` by its last line with that word (`runc version 1.1.5`) and a
//! `commit:` line, which stay the real runtime's.

use super::annotations::{DEVICE_MAP, ENABLE, PREFER, RELAX};
use super::argv::Line;
use super::config::{DEFAULT_PATH, ENV};
use std::ffi::OsStr;

/// What the command line asks the wrapper about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// `--help`, `-h`, or the command `help` alone.
    Help,
    /// `--version`, `-v`.
    Version,
}

/// Whether the command line asks for the top-level help or version: a global flag with no
/// command, or `help` with nothing after it. A command's own `--help` (`create --help`) is the
/// runtime's alone.
pub fn asked(line: &Line) -> Option<Ask> {
    match line.command.as_deref() {
        Some("help") if line.args.is_empty() => return Some(Ask::Help),
        Some(_) => return None,
        None => {}
    }
    // The last such flag wins, as with runc's: `--version --help` is help.
    line.global.iter().rev().find_map(|a| match a.trim_start_matches('-') {
        "help" | "h" if a.starts_with('-') => Some(Ask::Help),
        "version" | "v" if a.starts_with('-') => Some(Ask::Version),
        _ => None,
    })
}

/// The wrapper's lines; `config_env` is `DEVREMAP_RUNTIME_CONFIG`'s value, if set.
pub fn text(ask: Ask, config_env: Option<&OsStr>) -> String {
    let version = env!("CARGO_PKG_VERSION");
    let config = match config_env {
        Some(p) => format!("{} (from {ENV}; default {DEFAULT_PATH})", p.to_string_lossy()),
        None => format!("{DEFAULT_PATH} ({ENV} names another)"),
    };
    match ask {
        Ask::Version => format!(
            "devremap-runtime version {version}\n\
             devremap-runtime config: {config}\n\
             the real runtime (the config's \"runtime\", default runc):\n"
        ),
        Ask::Help => format!(
            "devremap-runtime {version}: an OCI runtime with runc's command line around the real runtime,\n\
             giving the containers that ask for it a devremap /dev (GPU device names remapped after\n\
             checkpoint/restore, served by devremapd):\n  \
               create, run   have the node daemon (devremapd node) mount a devremap /dev for the\n                \
                             container; become the runtime on its spec, pointed at it, from a\n                \
                             bundle of the wrapper's own\n  \
               checkpoint    first record the container's GPUs in <image-path>/devremap-gpus.json\n  \
               restore       as create, with the image's devremap-gpus.json as the checkpoint's GPUs\n  \
               delete        the real runtime (the container's /dev goes with the container)\n  \
               other         the real runtime, unchanged\n\
             Annotations (in the spec):\n  \
               {ENABLE}      \"true\" or \"false\"; unset: true when the spec has NVIDIA GPUs\n  \
               {DEVICE_MAP}  pairs saved GPUs with restored ones (devremapd's --device-map)\n  \
               {PREFER}      \"native\" or \"checkpoint\": which name wins a collision\n  \
               {RELAX}       checks a restore may fail with a warning, where the config's\n                \
                             \"annotations\" lets launchers set it\n\
             (DEVREMAP_ENABLE in the container's env stands for {ENABLE}; the env, which the\n\
             image's ENV fills too, decides nothing else)\n\
             Config: {config}; --devremap-config PATH (a global flag) names another\n\
             Docs: /usr/share/doc/devremap/restore.md\n\
             \n\
             The real runtime's help (the config's \"runtime\", default runc):\n\
             \n"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::argv::decode;

    fn ask(line: &[&str]) -> Option<Ask> {
        asked(&decode(&line.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).line)
    }

    #[test]
    fn only_the_top_level_help_and_version_are_ours() {
        assert_eq!(ask(&["--help"]), Some(Ask::Help));
        assert_eq!(ask(&["-h"]), Some(Ask::Help));
        assert_eq!(ask(&["help"]), Some(Ask::Help));
        assert_eq!(ask(&["--root", "/r", "--version"]), Some(Ask::Version));
        assert_eq!(ask(&["-v"]), Some(Ask::Version));
        assert_eq!(ask(&["--version", "--help"]), Some(Ask::Help));
        assert_eq!(ask(&[]), None);
        assert_eq!(ask(&["create", "--help"]), None);
        assert_eq!(ask(&["help", "create"]), None);
        assert_eq!(ask(&["--debug", "state", "x"]), None);
        // A flag's value is not a flag.
        assert_eq!(ask(&["--root", "help"]), None);
    }

    /// Docker takes a runtime's version from its last line holding "version": the real
    /// runtime's, which follows ours.
    #[test]
    fn the_version_text_names_version_once() {
        let t = text(Ask::Version, None);
        assert_eq!(t.matches("version").count(), 1, "{t}");
        assert!(t.starts_with(&format!("devremap-runtime version {}\n", env!("CARGO_PKG_VERSION"))));
        assert!(t.contains(DEFAULT_PATH), "{t}");
        let t = text(Ask::Version, Some(OsStr::new("/x/rt.json")));
        assert!(t.contains("/x/rt.json (from DEVREMAP_RUNTIME_CONFIG"), "{t}");
    }

    #[test]
    fn the_help_names_the_config_and_the_annotations() {
        let t = text(Ask::Help, None);
        for needle in [DEFAULT_PATH, ENV, ENABLE, DEVICE_MAP, PREFER, RELAX, env!("CARGO_PKG_VERSION")] {
            assert!(t.contains(needle), "{needle} missing from {t}");
        }
    }
}
