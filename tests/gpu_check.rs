//! `tests/gpu/restore.sh`, the check a GPU machine runs (issue 33), kept from rotting where
//! there is no GPU: its `--fake` mode runs every step but CUDA's (the devremap `/dev` in a
//! private mount namespace, the checkpoint name held open across a reload, CRIU's dump and
//! restore through that `/dev`) with a fake GPU, a char node 1:5 named `nvidia0`; and without a
//! GPU, the real mode skips.

mod common;

use common::clients::need_criu;
use common::daemon::need_fuse;
use std::process::Command;

/// Runs `sh tests/gpu/restore.sh ARGS` from the repository with this build's `devremapd`:
/// (exit status, its stdout and stderr in one stream, in the order it printed them).
fn restore_sh(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new("sh")
        .args(["-c", "exec sh tests/gpu/restore.sh \"$@\" 2>&1", "sh"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("DEVREMAPD", common::BIN)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .output()
        .expect("cannot run sh");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Rule (issue 33): the GPU check's steps work with a fake GPU: the app holds `/dev/nvidia100`
/// (saved minor 100, host `nvidia0`) open across a reload whose generation rises, then CRIU
/// dumps it and restores it through the devremap `/dev`, and its descriptor and data are the
/// same each time; nothing is left mounted or running.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn the_gpu_restore_check_passes_with_a_fake_gpu() {
    need_fuse();
    let criu = need_criu();
    let (code, out) = restore_sh(&["--fake"], &[("CRIU", criu.to_str().unwrap())]);
    assert_eq!(code, 0, "{out}");
    for line in [
        "devremap reload (prefer checkpoint): generation=2 last_error=null",
        "PASS: (fake GPU) a devremap reload under a held /dev/nvidia100: the descriptor and the data equal",
        "  fd   3 /dev/nvidia100           1:5      through /dev (fuse devremap)",
        "devremap reload (prefer native): generation=3 last_error=null",
        "criu restore: pid ",
        "PASS: (fake GPU) CRIU dump and restore through the devremap /dev: /dev/nvidia100 reopened, the data equal",
    ] {
        assert!(out.contains(line), "no {line:?} in:\n{out}");
    }
    assert!(out.ends_with("PASS\n"), "{out}");
    assert!(!out.contains("SKIP"), "{out}");
    // The restored app is no child of the script's: it must have been ended all the same.
    let pid = out.split("criu restore: pid ").nth(1).and_then(|s| s.split(' ').next()).unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&cmdline).contains("restore.py"), "the app (pid {pid}) still runs");
}

/// Rule (issue 33): where there is no GPU the check skips: one `SKIP:` line with the reason,
/// exit 0 (here a device directory with no `nvidiaN`, or no root, or no nvidia-smi).
#[test]
fn the_gpu_restore_check_skips_without_a_gpu() {
    let empty = tempfile::tempdir().unwrap();
    let (code, out) = restore_sh(&[], &[("HOST_DEV", empty.path().to_str().unwrap())]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("SKIP: ") && out.lines().count() == 1, "{out}");
}
