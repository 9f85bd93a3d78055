//! Continuity across the node daemon (issue 31): a host running the per-container daemons of the
//! version before the node daemon keeps them until their containers end, while new containers
//! use the node daemon; this version's `delete` still stops them.
//!
//! The earlier version is a real build, `devremap-runtime` and `devremapd` at the last commit
//! before the node daemon, made once by `.ci/previous-wrapper` (as `.ci/run` does) and named by
//! `DEVREMAP_PREVIOUS_WRAPPER`. Without it the test is ignored by a plain `cargo test`, and
//! fails when run (`-- --include-ignored`, as CI does), naming the command that makes the build.

mod common;

use common::bundle::{Bundle, Runtime, allow_char, need_containers, oci_config};
use common::daemon::{stop_node, wait_for, wait_for_or};
use common::{FakeHost, arg, fake_rdev, write_file};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use tempfile::TempDir;

const WRAPPER: &str = env!("CARGO_BIN_EXE_devremap-runtime");
const PREVIOUS: &str = "DEVREMAP_PREVIOUS_WRAPPER";

/// The earlier version's directory (its `devremap-runtime` and `devremapd`), or the test fails
/// naming how to make it.
fn previous() -> PathBuf {
    let dir = std::env::var_os(PREVIOUS).map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "{PREVIOUS} is not set: this test runs the wrapper of the version before the node daemon; make it \
             with `export {PREVIOUS}=$(bash .ci/previous-wrapper)` (as .ci/run does)"
        )
    });
    for bin in ["devremap-runtime", "devremapd"] {
        assert!(
            dir.join(bin).is_file(),
            "{PREVIOUS}={}: no {bin} there (run bash .ci/previous-wrapper)",
            dir.display()
        );
    }
    dir
}

/// One container's bundle, asking for devremap, running until `SIGTERM`.
fn bundle(name: &str) -> Bundle {
    let rules: Vec<Value> = (0..3).map(fake_rdev).map(|(ma, mi)| allow_char(ma, mi)).collect();
    let mut spec = oci_config(name, &rules);
    spec["annotations"] = json!({"devremap.io/enable": "true"});
    Bundle::new("trap 'exit 0' TERM; echo ready; while :; do sleep 1; done\n", &spec)
}

/// The host, the config both wrappers read, and the containers to delete at the end.
struct Host {
    _host: FakeHost,
    tmp: TempDir,
    config: PathBuf,
    made: Vec<(String, PathBuf)>,
}

impl Host {
    fn state_dir(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    /// `<wrapper> --root <bundle's runtime root> <args>`, the config by environment: its exit
    /// status and stderr. Files, not pipes: a container it starts keeps the runtime's stdio.
    fn wrapper(&self, wrapper: &Path, bundle: &Bundle, args: &[&str]) -> (ExitStatus, String) {
        let err = self.tmp.path().join("wrapper.stderr");
        let status = Command::new(wrapper)
            .env("DEVREMAP_RUNTIME_CONFIG", &self.config)
            .env_remove("RUST_LOG")
            .arg("--root")
            .arg(bundle.state_root())
            .args(args)
            .stdin(Stdio::null())
            .stdout(fs::File::create(bundle.dir().join("stdout")).unwrap())
            .stderr(fs::File::create(&err).unwrap())
            .status()
            .expect("the wrapper runs");
        (status, fs::read_to_string(&err).unwrap_or_default())
    }

    fn run_detached(&mut self, wrapper: &Path, bundle: &Bundle, id: &str) {
        self.made.push((id.to_owned(), bundle.state_root()));
        let (status, stderr) = self.wrapper(wrapper, bundle, &["run", "--detach", "--bundle", arg(bundle.dir()), id]);
        assert!(status.success(), "run --detach {id}: {stderr}");
    }

    fn keeper(&self, id: &str) -> u32 {
        let path = self.state_dir().join(id).join("devremapd.pid");
        fs::read_to_string(&path).unwrap().trim().parse().unwrap()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        for (id, root) in &self.made {
            let _ = Command::new("runc").arg("--root").arg(root).args(["delete", "--force", id]).output();
        }
        stop_node(&self.state_dir());
    }
}

fn alive(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

/// Rule (issue 31): a container of the per-container daemons of the version before the node
/// daemon keeps its daemon while this version's wrapper runs new containers through the node
/// daemon (which adopts it, and lists it); this version's `delete` stops its daemon and removes
/// its directory, as that version's did.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and DEVREMAP_PREVIOUS_WRAPPER (bash .ci/previous-wrapper)"]
fn an_earlier_versions_container_serves_on_beside_the_node_daemon() {
    need_containers(Runtime::Runc);
    let previous = previous();
    // Before the host: dropped after it, whose drop deletes the containers from their roots.
    let (old_bundle, new_bundle) = (bundle("earlier"), bundle("node"));
    let fake = FakeHost::with_gpus(&[0, 1]);
    let tmp = TempDir::new().unwrap();
    let config = write_file(
        tmp.path(),
        "runtime.json",
        json!({"host_dev": arg(&fake.dev()), "host_root": arg(&fake.root()), "state_dir": arg(&tmp.path().join("state"))})
            .to_string(),
    );
    let mut host = Host { _host: fake, tmp, config, made: vec![] };
    let old_id = format!("earlier-{}", std::process::id());
    let new_id = format!("node-{}", std::process::id());

    // The earlier version's wrapper: a daemon of its own, no node daemon.
    host.run_detached(&previous.join("devremap-runtime"), &old_bundle, &old_id);
    let old_keeper = host.keeper(&old_id);
    assert!(!host.state_dir().join("node.sock").exists(), "the earlier version starts no node daemon");
    let old_dev = host.state_dir().join(&old_id).join("dev");
    // Its tree: every name with its device number.
    let listing = |dev: &Path| -> Vec<(String, u64)> {
        let mut names: Vec<(String, u64)> = fs::read_dir(dev)
            .unwrap()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::os::unix::fs::MetadataExt::rdev(&e.metadata().unwrap()),
                )
            })
            .collect();
        names.sort();
        names
    };
    let before = listing(&old_dev);
    assert!(before.iter().any(|(name, _)| name == "null"), "{before:?}");

    // This version's wrapper: a node daemon, which adopts the running container.
    host.run_detached(Path::new(WRAPPER), &new_bundle, &new_id);
    let socket = host.state_dir().join("node.sock");
    let listed = Command::new(common::BIN).args(["ctl", "--socket", arg(&socket), "list"]).output().unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(listed.contains(&format!("\"id\":\"{old_id}\"")), "the earlier container is adopted: {listed}");
    assert!(listed.contains(&format!("\"id\":\"{new_id}\"")), "{listed}");
    assert!(alive(old_keeper), "the earlier daemon serves on");
    assert_eq!(listing(&old_dev), before, "its /dev is as it was");

    // This version's delete stops the earlier daemon and removes its directory, as before.
    let (status, stderr) = host.wrapper(Path::new(WRAPPER), &old_bundle, &["delete", "--force", &old_id]);
    assert!(status.success(), "delete: {stderr}");
    assert!(!host.state_dir().join(&old_id).exists(), "torn down by the delete itself");
    wait_for("the earlier daemon to stop", || (!alive(old_keeper)).then_some(()));

    // The node daemon's container goes with its container.
    let new_dir = host.state_dir().join(&new_id);
    let (status, stderr) = host.wrapper(Path::new(WRAPPER), &new_bundle, &["delete", "--force", &new_id]);
    assert!(status.success(), "delete: {stderr}");
    let log = host.state_dir().join("node.log");
    wait_for_or(
        "the node daemon to remove the container's directory",
        || fs::read_to_string(&log).unwrap_or_default(),
        || (!new_dir.exists()).then_some(()),
    );
}
