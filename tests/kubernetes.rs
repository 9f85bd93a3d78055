//! The Kubernetes files in `dist/kubernetes/`: the manifests against the Kubernetes API's
//! schemas, offline (PyPI's `kubernetes-validate`, which ships them), and the node setup's
//! install script on a fake host. No cluster runs here: docs/restore.md says what that leaves
//! untested.

mod common;

use common::{BIN, arg, bundle::find_in_path};
use std::fs;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use tempfile::TempDir;

const DIST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/dist/kubernetes");

/// The oldest and the newest Kubernetes the manifests are checked against.
const VERSIONS: &[&str] = &["1.29.0", "1.37.0"];

/// Fails the calling (`#[ignore]`d) test unless `kubernetes-validate` is on `PATH`.
fn need_kubernetes_validate() {
    if find_in_path("kubernetes-validate").is_none() {
        panic!(
            "kubernetes-validate is not on PATH (pip install kubernetes-validate==1.37.0, as .ci/run does): \
             this test validates the Kubernetes manifests"
        );
    }
}

/// Rule (issue 21): every manifest is valid, in strict mode (no unknown field), against the
/// schemas of each of [`VERSIONS`].
#[test]
#[ignore = "needs kubernetes-validate (pip)"]
fn the_manifests_match_the_kubernetes_schemas() {
    need_kubernetes_validate();
    let mut manifests: Vec<String> = fs::read_dir(DIST)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| arg(&p).to_owned())
        .collect();
    manifests.sort();
    assert!(manifests.len() >= 2, "{manifests:?}");
    for version in VERSIONS {
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "--kubernetes-version", version])
            .args(&manifests)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "kubernetes {version}: {stdout}{stderr}");
        for manifest in &manifests {
            assert!(
                stdout.lines().chain(stderr.lines()).any(|l| l.contains(manifest.as_str()) && l.contains(" passed ")),
                "kubernetes {version}: no pass for {manifest}: {stdout}{stderr}"
            );
        }
    }
}

/// A host for node-setup.sh, and the image's /opt/devremap: the binaries, the config and one
/// containerd entry.
struct Setup {
    _tmp: TempDir,
    host: std::path::PathBuf,
    source: std::path::PathBuf,
}

impl Setup {
    fn new(containerd_config: &str) -> Setup {
        let tmp = TempDir::new().unwrap();
        let (host, source) = (tmp.path().join("host"), tmp.path().join("opt"));
        fs::create_dir_all(host.join("etc/containerd")).unwrap();
        fs::write(host.join("etc/containerd/config.toml"), containerd_config).unwrap();
        fs::create_dir_all(source.join("bin")).unwrap();
        fs::create_dir_all(source.join("containerd")).unwrap();
        fs::copy(BIN, source.join("bin/devremapd")).unwrap();
        fs::copy(env!("CARGO_BIN_EXE_devremap-runtime"), source.join("bin/devremap-runtime")).unwrap();
        fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/dist/runtime.json"), source.join("runtime.json")).unwrap();
        fs::write(source.join("containerd/devremap.toml"), "BinaryName = \"/usr/bin/devremap-runtime\"\n").unwrap();
        Setup { _tmp: tmp, host, source }
    }

    fn run(&self) -> Output {
        Command::new(Path::new(DIST).join("node-setup.sh"))
            .env("DEVREMAP_HOST", &self.host)
            .env("DEVREMAP_SOURCE", &self.source)
            .env("DEVREMAP_RESTART_CONTAINERD", "0")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }
}

/// Rule (issue 21): the node setup installs both binaries into the host's /usr/local/bin, the
/// config only where there is none (an operator's edit stays, run after run), and the
/// containerd entry into conf.d; the installed wrapper runs with the installed config.
#[test]
fn node_setup_installs_and_keeps_the_operators_config() {
    let setup = Setup::new("version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n");
    let out = setup.run();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let host = &setup.host;
    for bin in ["devremapd", "devremap-runtime"] {
        let meta = fs::metadata(host.join("usr/local/bin").join(bin)).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o755, "{bin}");
    }
    assert_eq!(
        fs::read_to_string(host.join("etc/containerd/conf.d/devremap.toml")).unwrap(),
        "BinaryName = \"/usr/local/bin/devremap-runtime\"\n",
        "the entry names the wrapper where this installs it"
    );
    let config = host.join("etc/devremap/runtime.json");
    let shipped = fs::read_to_string(setup.source.join("runtime.json")).unwrap();
    assert_eq!(fs::read_to_string(&config).unwrap(), shipped);
    let out = Command::new(host.join("usr/local/bin/devremapd")).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("devremapd {} (keeper protocol {})\n", env!("CARGO_PKG_VERSION"), devremap::keeper::control::PROTOCOL)
    );

    let edited = "{\"runtime\": \"crun\"}\n";
    fs::write(&config, edited).unwrap();
    let out = setup.run();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read_to_string(&config).unwrap(), edited, "a second run overwrote the operator's config");
    // Each binary was replaced by a rename: no temporary file is left.
    let left: Vec<_> = fs::read_dir(host.join("usr/local/bin")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
}

/// Rule (issue 21): a containerd whose config does not import conf.d would never see the
/// entry: the setup refuses, installs nothing, and says which line to add.
#[test]
fn node_setup_refuses_a_containerd_that_reads_no_conf_d() {
    let setup = Setup::new("version = 2\n");
    let out = setup.run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("config.toml does not import /etc/containerd/conf.d/*.toml"), "{stderr}");
    assert!(stderr.contains("imports = [\"/etc/containerd/conf.d/*.toml\"]"), "{stderr}");
    assert!(!setup.host.join("usr/local/bin").exists());
}
