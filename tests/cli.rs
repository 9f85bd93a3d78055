//! The `devremapd` command line outside `plan`'s inputs: what it prints with no arguments, and
//! `oci-patch`'s refusal of a `--dev` that is not a devremap mount. These need no root: the
//! mounts they refuse are the host's own (`/proc`) or none.

mod common;

use common::{arg, devremapd};
use std::fs;
use tempfile::TempDir;

/// The shipped example spec, copied into `dir` (so `--in-place` can be tried on it).
fn example_spec(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.path().join("config.json");
    fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/config.json"), &path).unwrap();
    path
}

/// Rule (issue 11.3): `devremapd` with no arguments prints the whole usage, with every
/// subcommand, on stderr, and exits 1 as any bad input does.
#[test]
fn no_arguments_print_the_usage() {
    let (code, stdout, stderr) = devremapd(&[]);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(stdout, "");
    assert!(stderr.contains("Usage: devremapd <COMMAND>"), "{stderr}");
    for command in ["plan", "mount", "oci-patch"] {
        assert!(stderr.lines().any(|l| l.trim_start().starts_with(command)), "{command} missing: {stderr}");
    }
}

/// Rule (issue 18): `devremapd --version` names the keeper protocol, which an upgrade must
/// speak too.
#[test]
fn the_version_names_the_keeper_protocol() {
    let (code, stdout, stderr) = devremapd(&["--version"]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, format!("devremapd {}\n", devremap::handover::VERSION));
    assert!(stdout.contains("(keeper protocol 1)"), "{stdout}");
}

/// Rule (issue 11.3): `oci-patch --dev` refuses a path that is not a live devremap mount
/// (missing, a plain directory, another filesystem's mount point) with one line naming it and
/// the way out, exit 1, and leaves the spec alone, `--in-place` or not.
#[test]
fn oci_patch_refuses_what_is_not_a_devremap_mount() {
    let tmp = TempDir::new().unwrap();
    let spec = example_spec(&tmp);
    let before = fs::read(&spec).unwrap();
    let missing = tmp.path().join("no-such-mount");
    let cases = [
        (arg(&missing), "no such file or directory"),
        (arg(tmp.path()), "not a mount point"),
        ("/proc", "a proc mount of proc"),
    ];
    for (dev, why) in cases {
        for in_place in [false, true] {
            let mut args = vec!["oci-patch", arg(&spec), "--dev", dev];
            if in_place {
                args.push("--in-place");
            }
            let (code, stdout, stderr) = devremapd(&args);
            assert_eq!(code, 1, "{args:?}: {stderr}");
            assert_eq!(stdout, "");
            let expected = format!(
                "error: {dev}: not a live devremap mount ({why}); mount it with `devremapd mount` first, or pass --allow-unmounted to patch before it exists\n"
            );
            assert_eq!(stderr, expected);
            assert_eq!(fs::read(&spec).unwrap(), before, "{args:?} changed the spec");
        }
    }
}

/// Rule (issue 11.3): `--allow-unmounted` patches before the mount exists.
#[test]
fn oci_patch_allow_unmounted_patches_before_the_mount() {
    let tmp = TempDir::new().unwrap();
    let spec = example_spec(&tmp);
    let dev = tmp.path().join("not-yet");
    let (code, stdout, stderr) = devremapd(&["oci-patch", arg(&spec), "--dev", arg(&dev), "--allow-unmounted"]);
    assert_eq!((code, stderr.as_str()), (0, ""));
    let patched: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let mounts = patched["mounts"].as_array().unwrap();
    let dev_mount = mounts.iter().find(|m| m["destination"] == "/dev").unwrap();
    assert_eq!(dev_mount["source"], arg(&dev));
    assert_eq!(dev_mount["type"], "bind");
}

/// Bug (found from outside): `mount --pid-file X --state-file X` was accepted; the state
/// file's JSON then replaced the pid, so `kill -HUP "$(cat X)"` failed. Two of the daemon's
/// files at one place (`dir/x` and `dir/./x` included) are now refused before anything is
/// mounted or written, naming the path and both flags.
#[test]
fn mount_refuses_one_file_for_two_flags() {
    let tmp = TempDir::new().unwrap();
    let mountpoint = tmp.path().join("mnt");
    fs::create_dir(&mountpoint).unwrap();
    let file = tmp.path().join("x");
    let same = tmp.path().join(".").join("x");
    let cases = [
        ["--pid-file", "--state-file"],
        ["--state-file", "--container-pid-file"],
        ["--pid-file", "--container-pid-file"],
    ];
    for [a, b] in cases {
        let (code, _, stderr) = devremapd(&["mount", arg(&mountpoint), a, arg(&file), b, arg(&same)]);
        assert_eq!(code, 1, "{a} {b}: {stderr}");
        assert!(stderr.contains(&format!("given as both {a} and {b}")), "{a} {b}: {stderr}");
        assert!(stderr.contains(arg(&file)), "{stderr}");
        assert!(!file.exists(), "{a} {b}: nothing is written");
    }
}
