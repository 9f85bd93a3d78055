//! The Kubernetes files in `dist/kubernetes/`: the manifests against the Kubernetes API's
//! schemas, offline (PyPI's `kubernetes-validate`, which ships them), and the node setup's
//! install script on a fake host. No cluster runs here: docs/restore.md says what that leaves
//! untested.

mod common;

use common::{BIN, arg, bundle::find_in_path};
use std::fs;
use std::path::{Path, PathBuf};
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

/// A host for node-setup.sh, and the image's /opt/devremap as the Dockerfile makes it: the
/// binaries, the config, the shipped containerd entry and the node daemon's unit. `nsenter` on
/// node-setup's `PATH` records each command it is asked to run on the host instead of running
/// it, and plays the host's systemd: `test -d /run/systemd/system` holds unless the file
/// `no-systemd` is there, and devremap.service is active once started; and its containerd's
/// NRI socket, there unless the file `no-nri` is. Runs are in the RuntimeClass mode unless a
/// test gives `DEVREMAP_MODE`.
struct Setup {
    _tmp: TempDir,
    host: PathBuf,
    source: PathBuf,
    fake_bin: PathBuf,
}

/// The containerd entry the image ships.
const ENTRY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/dist/containerd/devremap.toml");
/// The node daemon's unit the image ships (the package's).
const UNIT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/dist/systemd/devremap.service");

impl Setup {
    fn new(containerd_config: &str) -> Setup {
        let tmp = TempDir::new().unwrap();
        let (host, source, fake_bin) = (tmp.path().join("host"), tmp.path().join("opt"), tmp.path().join("fake-bin"));
        fs::create_dir_all(host.join("etc/containerd")).unwrap();
        fs::write(host.join("etc/containerd/config.toml"), containerd_config).unwrap();
        fs::create_dir_all(source.join("bin")).unwrap();
        fs::create_dir_all(source.join("containerd")).unwrap();
        // Executed by node-setup: written by a child process (ETXTBSY otherwise).
        common::write_executable(&source.join("bin/devremapd"), &fs::read(BIN).unwrap());
        let runtime = fs::read(env!("CARGO_BIN_EXE_devremap-runtime")).unwrap();
        common::write_executable(&source.join("bin/devremap-runtime"), &runtime);
        fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/dist/runtime.json"), source.join("runtime.json")).unwrap();
        fs::copy(ENTRY, source.join("containerd/devremap.toml")).unwrap();
        fs::create_dir_all(source.join("systemd")).unwrap();
        fs::copy(UNIT, source.join("systemd/devremap.service")).unwrap();
        fs::create_dir_all(&fake_bin).unwrap();
        let nsenter = fake_bin.join("nsenter");
        let script = format!(
            r#"#!/bin/sh
cd {}
echo "$*" >> on-host
case "$*" in
*"test -d /run/systemd/system") [ ! -e no-systemd ] ;;
*"test -S /var/run/nri/nri.sock") [ ! -e no-nri ] ;;
*"is-active devremap.service") [ -e active ] ;;
*" start devremap.service" | *" restart devremap.service") touch active ;;
esac
"#,
            tmp.path().display()
        );
        common::write_executable(&nsenter, script.as_bytes());
        Setup { _tmp: tmp, host, source, fake_bin }
    }

    /// A file on the fake host.
    fn write(&self, path: &str, text: &str) {
        let path = self.host.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    fn config(&self) -> String {
        fs::read_to_string(self.host.join("etc/containerd/config.toml")).unwrap()
    }

    fn run(&self) -> Output {
        self.run_with(&[])
    }

    /// Runs node-setup with the environment `env` added.
    fn run_with(&self, env: &[(&str, &str)]) -> Output {
        let path = format!("{}:{}", self.fake_bin.display(), std::env::var("PATH").unwrap_or_default());
        Command::new(Path::new(DIST).join("node-setup.sh"))
            .env("DEVREMAP_HOST", &self.host)
            .env("DEVREMAP_SOURCE", &self.source)
            .env("PATH", path)
            .env_remove("DEVREMAP_RESTART_CONTAINERD")
            .env_remove("DEVREMAP_NODE_SERVICE")
            .env_remove("DEVREMAP_SYSTEMD_UNIT")
            .env("DEVREMAP_MODE", "runtimeclass")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Runs node-setup, which must succeed; returns its stdout.
    fn run_ok(&self) -> String {
        let out = self.run();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs node-setup, which must refuse with exit status 1, install nothing and leave the
    /// containerd config as it was; returns its stderr.
    fn refused(&self) -> String {
        let before = self.config();
        let out = self.run();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(!self.host.join("usr/local/bin").exists(), "a refusal installed the binaries");
        assert_eq!(self.config(), before, "a refusal changed config.toml");
        assert_eq!(self.restarts(), 0);
        stderr
    }

    /// The commands node-setup ran on the host (through `nsenter`), in order, without
    /// nsenter's own arguments.
    fn on_host(&self) -> Vec<String> {
        let record = fs::read_to_string(self._tmp.path().join("on-host")).unwrap_or_default();
        record.lines().map(|l| l.split_once(" -- ").map_or(l, |(_, cmd)| cmd).to_owned()).collect()
    }

    /// How many containerd restarts node-setup asked for.
    fn restarts(&self) -> usize {
        self.on_host().iter().filter(|c| *c == "systemctl restart containerd").count()
    }
}

/// Rule (issue 21): the node setup installs both binaries into the host's /usr/local/bin, the
/// config only where there is none (an operator's edit stays, run after run); the installed
/// wrapper runs with the installed config.
#[test]
fn node_setup_installs_and_keeps_the_operators_config() {
    let setup = Setup::new("version = 2\n");
    setup.run_ok();
    let host = &setup.host;
    for bin in ["devremapd", "devremap-runtime"] {
        let meta = fs::metadata(host.join("usr/local/bin").join(bin)).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o755, "{bin}");
    }
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
    setup.run_ok();
    assert_eq!(fs::read_to_string(&config).unwrap(), edited, "a second run overwrote the operator's config");
    // Each binary was replaced by a rename: no temporary file is left.
    let left: Vec<_> = fs::read_dir(host.join("usr/local/bin")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
}

/// Rule (issue 30.1): the runtime handler goes into config.toml itself, after the operator's
/// lines, kept as they were (a backup of the file beside it), naming the wrapper where the setup
/// put it; nothing is written into conf.d. tests/containerd.rs runs containerd on the result.
#[test]
fn node_setup_adds_the_runtime_handler_to_config_toml() {
    let operator =
        "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"registry.example/pause:3.9\"\n";
    let setup = Setup::new(operator);
    let out = setup.run_ok();
    let config = setup.config();
    assert!(config.starts_with(operator), "{config}");
    assert!(config.contains("BinaryName = \"/usr/local/bin/devremap-runtime\""), "{config}");
    assert!(config.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap]"), "{config}");
    assert_eq!(fs::read_to_string(setup.host.join("etc/containerd/config.toml.before-devremap")).unwrap(), operator);
    assert!(!setup.host.join("etc/containerd/conf.d").exists());
    assert!(out.contains("node-setup: devremap installed"), "{out}");
}

/// Rule (issue 30.2): containerd is restarted only when its config changed: a second run
/// changes nothing and restarts nothing; an upgrade's new entry replaces the block it added
/// before (once), and restarts.
#[test]
fn node_setup_restarts_containerd_only_on_a_change() {
    let setup = Setup::new("version = 2\n");
    setup.run_ok();
    assert_eq!(setup.restarts(), 1);
    let first = setup.config();
    let out = setup.run_ok();
    assert_eq!(setup.restarts(), 1, "a run that changed nothing restarted containerd: {out}");
    assert_eq!(setup.config(), first);
    assert!(out.contains("containerd not restarted"), "{out}");

    let entry = setup.source.join("containerd/devremap.toml");
    let newer = fs::read_to_string(&entry).unwrap().replace("[\"devremap.io/*\"]", "[\"devremap.io/*\", \"x\"]");
    fs::write(&entry, newer).unwrap();
    setup.run_ok();
    assert_eq!(setup.restarts(), 2);
    let config = setup.config();
    assert_eq!(config.matches("runtimes.devremap]").count(), 1, "{config}");
    assert!(config.contains("\"devremap.io/*\", \"x\""), "{config}");
}

/// Rule (issue 30.2): an existing conf.d/config.toml (a generic name, maybe the operator's) is
/// neither overwritten nor needed: node-setup writes nothing into conf.d.
#[test]
fn node_setup_never_touches_a_conf_d_file() {
    let setup = Setup::new("version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n");
    let operators = "# the operator's\nversion = 2\n[debug]\n  level = \"info\"\n";
    setup.write("etc/containerd/conf.d/config.toml", operators);
    setup.run_ok();
    assert_eq!(fs::read_to_string(setup.host.join("etc/containerd/conf.d/config.toml")).unwrap(), operators);
    let entries: Vec<_> =
        fs::read_dir(setup.host.join("etc/containerd/conf.d")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
}

/// Rule (issue 30.2): a file config.toml imports that holds CRI settings would replace the
/// handler added to config.toml: the setup refuses, names the file and says what to add there;
/// the imports are read as containerd reads them: a single file, a glob, an indented line.
#[test]
fn node_setup_refuses_an_import_that_holds_cri_settings() {
    let cri = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"nvidia\"\n";
    for imports in [
        "imports = [\"/etc/containerd/conf.d/nvidia.toml\"]",
        "imports = [\"/etc/containerd/conf.d/*.toml\"]",
        "  imports = [\n    \"/etc/containerd/conf.d/*.toml\", # the drop-ins\n  ]",
        "imports = [\"conf.d/nvidia.toml\"]",
    ] {
        let setup = Setup::new(&format!("version = 2\n{imports}\n"));
        setup.write("etc/containerd/conf.d/nvidia.toml", cri);
        let stderr = setup.refused();
        assert!(
            stderr.contains("imports /etc/containerd/conf.d/nvidia.toml, which holds CRI settings"),
            "{imports}: {stderr}"
        );
        assert!(stderr.contains("/devremap.toml to /etc/containerd/conf.d/nvidia.toml by hand"), "{imports}: {stderr}");
    }
}

/// Rule (issue 30.2): an import that containerd does not read is no reason to refuse, nor one
/// to think the handler is read from conf.d: a commented-out path, an empty list, a file that
/// holds no CRI settings. The handler goes into config.toml.
#[test]
fn node_setup_reads_imports_as_containerd_does() {
    for imports in [
        "imports = []  # was /etc/containerd/conf.d/*.toml",
        "# imports = [\"/etc/containerd/conf.d/*.toml\"]",
        "imports = [\"/etc/containerd/conf.d/debug.toml\"]",
    ] {
        let setup = Setup::new(&format!("version = 2\n{imports}\n"));
        setup.write("etc/containerd/conf.d/nvidia.toml", "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n");
        setup.write("etc/containerd/conf.d/debug.toml", "version = 2\n[debug]\n  level = \"debug\"\n");
        setup.run_ok();
        assert!(setup.config().contains("runtimes.devremap]"), "{imports}: {}", setup.config());
    }
}

/// Bug (found from outside): a 4 GiB sparse `config.toml` was read whole and ended the command
/// with an allocation failure (signal 6, 8 GB resident). A config or import over 16 MiB is
/// refused, naming it, and nothing is written.
#[test]
fn a_config_too_large_for_containerd_is_refused_unread() {
    for (config, import) in [(true, false), (false, true)] {
        let setup = Setup::new("version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n");
        setup.write("etc/containerd/conf.d/big.toml", "version = 2\n");
        let huge =
            setup.host.join(if config { "etc/containerd/config.toml" } else { "etc/containerd/conf.d/big.toml" });
        // Sparse, and only just too large: `refused` reads the config before and after.
        fs::OpenOptions::new().write(true).open(&huge).unwrap().set_len((16 << 20) + 1).unwrap();
        let stderr = setup.refused();
        assert!(
            stderr.contains("over 16 MiB, more than a containerd config holds; refused"),
            "{config} {import}: {stderr}"
        );
        assert!(!setup.host.join("etc/containerd/config.toml.before-devremap").exists());
    }
}

/// Rule (issue 30.1): what the setup cannot add without guessing is refused, with the reason:
/// a config of another version (containerd 2's version 3, 1.x's version 1), a config.toml that
/// is a symlink (its target is not the setup's to rewrite), a config that is not TOML, and a
/// runtime `devremap` of the operator's own, however written (attack 1, B1).
#[test]
fn node_setup_refuses_what_it_cannot_add_to() {
    let cases = [
        ("version = 3\n", "not a version 2 config"),
        ("[plugins.cri]\n", "not a version 2 config"),
        (
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap]\n  runtime_type = \"io.containerd.runc.v2\"\n",
            "defines the runtime devremap itself",
        ),
        (
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes]\n  devremap = { runtime_type = \"io.containerd.runc.v2\" }\n",
            "defines the runtime devremap itself",
        ),
        ("version = 2\n[debug\n", "not valid TOML (line 2, column 7)"),
    ];
    for (config, why) in cases {
        let setup = Setup::new(config);
        let stderr = setup.refused();
        assert!(stderr.contains(why), "{config}: {stderr}");
    }
    let setup = Setup::new("");
    let target = setup.host.join("etc/containerd/real.toml");
    fs::write(&target, "version = 2\n").unwrap();
    fs::remove_file(setup.host.join("etc/containerd/config.toml")).unwrap();
    std::os::unix::fs::symlink("real.toml", setup.host.join("etc/containerd/config.toml")).unwrap();
    let stderr = setup.refused();
    assert!(stderr.contains("is a symlink, not a regular file"), "{stderr}");
    assert_eq!(fs::read_to_string(&target).unwrap(), "version = 2\n");
}

/// Bug (found from outside): `containerd-config --host-root H` resolved symlinks in the host's
/// tree against the tool's own root: with the host's `/etc/containerd` an absolute symlink
/// (`-> /some/dir`, as a host may have it), the tool rewrote `/some/dir/config.toml` of its
/// own filesystem (a pod's, in node-setup) and said `changed`, and the host's config stayed as
/// it was. Every path is now resolved under the host root as the host resolves it
/// (`RESOLVE_IN_ROOT`), imports too. And an empty or relative `--runtime` (the handler's
/// `BinaryName`, which containerd runs as written) is refused.
#[test]
fn containerd_config_resolves_the_hosts_symlinks_under_its_root() {
    let tmp = TempDir::new().unwrap();
    let (host, outside) = (tmp.path().join("host"), tmp.path().join("outside"));
    // The host's /etc/containerd -> <outside>, which on the host is H/<outside>.
    let on_host = host.join(outside.strip_prefix("/").unwrap());
    for dir in [&on_host, &outside, &host.join("etc")] {
        fs::create_dir_all(dir).unwrap();
    }
    let config = "version = 2\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n";
    for dir in [&on_host, &outside] {
        fs::write(dir.join("config.toml"), config).unwrap();
        fs::create_dir_all(dir.join("conf.d")).unwrap();
    }
    // The host's import is harmless; the tool's own would be refused (it holds CRI settings).
    fs::write(on_host.join("conf.d/debug.toml"), "version = 2\n[debug]\n  level = \"debug\"\n").unwrap();
    fs::write(outside.join("conf.d/cri.toml"), "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n").unwrap();
    std::os::unix::fs::symlink(&outside, host.join("etc/containerd")).unwrap();
    let out = Command::new(BIN)
        .args(["containerd-config", "--host-root", arg(&host), "--entry", ENTRY])
        .args(["--runtime", "/usr/local/bin/devremap-runtime"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "changed\n");
    assert!(fs::read_to_string(on_host.join("config.toml")).unwrap().contains("runtimes.devremap]"));
    assert_eq!(fs::read_to_string(outside.join("config.toml")).unwrap(), config, "the tool's own file is untouched");
    assert!(!outside.join("config.toml.before-devremap").exists());

    // And a BinaryName containerd would run as written: refused when it is not absolute.
    for runtime in ["", "bin/devremap-runtime"] {
        let out = Command::new(BIN)
            .args(["containerd-config", "--host-root", arg(&host), "--entry", ENTRY, "--runtime", runtime])
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("not an absolute path (containerd runs it as written)"), "{stderr}");
    }
}

/// Rule (issue 30.2, held when attacked from outside): a config.toml written in another style
/// (CRLF line endings, tab indentation, no newline at its end, comments that hold a table
/// header and the word `runtimes`) gets one block after the operator's lines, kept as they
/// were, and one restart; a second and a third run change nothing and restart nothing.
#[test]
fn node_setup_adds_once_to_configs_of_any_style() {
    let cri = "plugins.\"io.containerd.grpc.v1.cri\"";
    let styles = [
        ("CRLF", format!("version = 2\r\n[{cri}]\r\n  sandbox_image = \"registry.example/pause:3.9\"\r\n")),
        ("tabs", format!("version = 2\n[{cri}]\n\tsandbox_image = \"registry.example/pause:3.9\"\n")),
        ("no final newline", format!("version = 2\n[{cri}]\n  sandbox_image = \"registry.example/pause:3.9\"")),
        (
            "comments",
            format!(
                "# [{cri}.containerd.runtimes.devremap]\nversion = 2 # [not.a.table]\n[{cri}]\n  \
                 sandbox_image = \"registry.example/pause:3.9\" # runtimes [x]\n"
            ),
        ),
    ];
    for (style, operator) in styles {
        let setup = Setup::new(&operator);
        setup.run_ok();
        let config = setup.config();
        assert!(config.starts_with(operator.trim_end_matches('\n')), "{style}: {config}");
        let handlers = config.lines().filter(|l| l.starts_with("[") && l.ends_with("runtimes.devremap]")).count();
        assert_eq!(handlers, 1, "{style}: {config}");
        assert_eq!(setup.restarts(), 1, "{style}");
        for run in [2, 3] {
            let out = setup.run_ok();
            assert_eq!(setup.config(), config, "{style}: run {run} changed config.toml");
            assert_eq!(setup.restarts(), 1, "{style}: run {run} restarted containerd: {out}");
        }
    }
}

/// Rule (issue 30.1, held when attacked from outside): a node without config.toml (containerd
/// on its defaults) gets one holding only `version = 2` and the block, with the CRI plugin's
/// default runc, which a runtimes table would otherwise replace; no backup of a file that was
/// not there.
#[test]
fn node_setup_writes_a_config_where_there_is_none() {
    let setup = Setup::new("");
    fs::remove_file(setup.host.join("etc/containerd/config.toml")).unwrap();
    setup.run_ok();
    let config = setup.config();
    assert!(config.starts_with("version = 2\n"), "{config}");
    assert!(config.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]"), "{config}");
    assert!(config.contains("BinaryName = \"/usr/local/bin/devremap-runtime\""), "{config}");
    assert!(!setup.host.join("etc/containerd/config.toml.before-devremap").exists());
    assert_eq!(setup.restarts(), 1);
}

/// Bug (attack 1, B2): an import path with a space is one path, as containerd reads it: the
/// import holding CRI settings is refused (the shell version split the path, skipped the check,
/// and the import dropped the handler).
#[test]
fn node_setup_reads_an_import_path_with_a_space() {
    let setup = Setup::new("version = 2\nimports = [\"/etc/containerd/conf d/*.toml\"]\n");
    setup.write(
        "etc/containerd/conf d/cri.toml",
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"x/pause:1\"\n",
    );
    let stderr = setup.refused();
    assert!(stderr.contains("imports /etc/containerd/conf d/cri.toml, which holds CRI settings"), "{stderr}");
}

/// Bug (attack 1, B4): runtime.json is installed by a rename, and an empty one (what a setup
/// killed while writing it left) is replaced: the shell version kept it for good, and the
/// wrapper failed every devremap container. An operator's file stays.
#[test]
fn node_setup_replaces_an_empty_runtime_config() {
    let setup = Setup::new("version = 2\n");
    setup.write("etc/devremap/runtime.json", "");
    setup.run_ok();
    let config = setup.host.join("etc/devremap/runtime.json");
    assert_eq!(fs::read_to_string(&config).unwrap(), fs::read_to_string(setup.source.join("runtime.json")).unwrap());
    let left: Vec<_> = fs::read_dir(config.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 1, "a temporary file left: {left:?}");
}

/// Bug (attack 1, B6, B7): config.toml keeps its owner and mode; the backup is made once, by
/// the change that first adds the handler, never over a file already there, and something
/// other than a regular file at its path is refused (the shell version moved the backup into
/// such a directory); no temporary file is left beside config.toml, on success or refusal.
#[test]
fn node_setup_keeps_the_owner_and_never_replaces_a_backup() {
    let setup = Setup::new("version = 2\n");
    let dir = setup.host.join("etc/containerd");
    let config = dir.join("config.toml");
    fs::create_dir(dir.join("config.toml.before-devremap")).unwrap();
    let stderr = setup.refused();
    assert!(stderr.contains("config.toml.before-devremap: is a directory, not a regular file; refused"), "{stderr}");
    fs::remove_dir(dir.join("config.toml.before-devremap")).unwrap();

    fs::set_permissions(&config, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    let root = nix::unistd::geteuid().is_root();
    if root {
        std::os::unix::fs::chown(&config, Some(65534), Some(65534)).unwrap();
    }
    setup.run_ok();
    let meta = fs::metadata(&config).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777, 0o640);
    let backup = fs::metadata(dir.join("config.toml.before-devremap")).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&backup.permissions()) & 0o7777, 0o640);
    if root {
        use std::os::unix::fs::MetadataExt;
        assert_eq!((meta.uid(), backup.uid()), (65534, 65534), "the owner not kept");
    }
    assert_eq!(fs::read_to_string(dir.join("config.toml.before-devremap")).unwrap(), "version = 2\n");

    // The handler removed by hand, and added again: the first backup is kept.
    fs::write(&config, "version = 2\n# mine\n").unwrap();
    setup.run_ok();
    assert_eq!(fs::read_to_string(dir.join("config.toml.before-devremap")).unwrap(), "version = 2\n");
    let mut left: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, ["config.toml", "config.toml.before-devremap"], "a temporary file left");
}

/// What of `commands` (run on the host) changes the host's systemd for the node daemon: its
/// `daemon-reload` and every `systemctl` naming devremap.service but `is-active`, which reads.
fn service_commands(commands: &[String]) -> Vec<String> {
    let changes =
        |c: &&String| *c == "systemctl daemon-reload" || (c.contains("devremap.service") && !c.contains("is-active"));
    commands.iter().filter(changes).cloned().collect()
}

/// Rule (issue 31, "How it runs"): the DaemonSet runs the node daemon as the host's systemd
/// service, never as a process of its pod (a pod's processes die with it, and each container's
/// keeper is the node's child): node-setup installs the shipped unit as the host's
/// /etc/systemd/system/devremap.service, naming the devremapd it installed and keeping
/// KillMode=process, enables and starts it. A run that changes nothing restarts nothing; a new
/// devremapd restarts the node (the keepers serve on) and then sends SIGUSR2 to the node alone,
/// which passes it to every container's server.
#[test]
fn node_setup_runs_the_node_daemon_as_a_host_service() {
    let setup = Setup::new("version = 2\n");
    let out = setup.run_ok();
    assert!(out.contains("node-setup: started devremap.service"), "{out}");
    let unit = fs::read_to_string(setup.host.join("etc/systemd/system/devremap.service")).unwrap();
    let shipped = fs::read_to_string(UNIT).unwrap();
    assert_eq!(unit, shipped.replace("ExecStart=/usr/bin/devremapd node", "ExecStart=/usr/local/bin/devremapd node"));
    assert!(unit.contains("\nKillMode=process\n"), "{unit}");
    let first = setup.on_host();
    assert_eq!(
        service_commands(&first),
        ["systemctl daemon-reload", "systemctl --quiet enable devremap.service", "systemctl start devremap.service"],
        "{first:?}"
    );

    let out = setup.run_ok();
    let second = setup.on_host()[first.len()..].to_vec();
    assert_eq!(service_commands(&second), ["systemctl --quiet enable devremap.service"], "{second:?}");
    assert!(!out.contains("devremap.service"), "{out}");

    // A new devremapd in the image: installed, the node restarted, then the servers upgraded.
    let mut bin = fs::read(setup.source.join("bin/devremapd")).unwrap();
    bin.extend_from_slice(b"\0next");
    fs::write(setup.source.join("bin/devremapd"), bin).unwrap();
    let before = setup.on_host().len();
    let out = setup.run_ok();
    assert!(out.contains("node-setup: restarted devremap.service"), "{out}");
    let third = setup.on_host()[before..].to_vec();
    assert_eq!(
        service_commands(&third),
        [
            "systemctl --quiet enable devremap.service",
            "systemctl restart devremap.service",
            "systemctl kill --kill-who=main --signal=SIGUSR2 devremap.service",
        ],
        "{third:?}"
    );
}

/// Rule (issue 32): the default mode is NRI's: node-setup leaves containerd's config as it was
/// (no runtime handler, no restart) and runs the node daemon as the NRI plugin (`devremapd node
/// --nri` in the unit), once it has found containerd's NRI socket on the host; without it,
/// it refuses, installing nothing, and says how to enable NRI and what the other mode is.
#[test]
fn node_setup_defaults_to_the_nri_plugin_and_checks_nri_is_on() {
    let setup = Setup::new("version = 2\n");
    let out = setup.run_with(&[("DEVREMAP_MODE", "nri")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("NRI mode: /etc/containerd/config.toml left as it was"), "{stdout}");
    assert_eq!(setup.config(), "version = 2\n");
    assert_eq!(setup.restarts(), 0);
    let unit = fs::read_to_string(setup.host.join("etc/systemd/system/devremap.service")).unwrap();
    let shipped = fs::read_to_string(UNIT).unwrap();
    assert_eq!(
        unit,
        shipped.replace("ExecStart=/usr/bin/devremapd node", "ExecStart=/usr/local/bin/devremapd node --nri")
    );
    assert!(setup.on_host().iter().any(|c| c == "systemctl start devremap.service"), "{:?}", setup.on_host());

    let setup = Setup::new("version = 2\n");
    fs::write(setup._tmp.path().join("no-nri"), "").unwrap();
    let out = setup.run_with(&[("DEVREMAP_MODE", "nri")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for says in [
        "no /var/run/nri/nri.sock",
        "[plugins.\"io.containerd.nri.v1.nri\"]",
        "disable = false",
        "DEVREMAP_MODE=runtimeclass",
    ] {
        assert!(stderr.contains(says), "{says}: {stderr}");
    }
    assert!(!setup.host.join("usr/local/bin").exists(), "a refusal installed the binaries");
    // The DaemonSet's default is this mode.
    let yaml = fs::read_to_string(Path::new(DIST).join("node-setup.yaml")).unwrap();
    assert!(yaml.contains("name: DEVREMAP_MODE\n              value: nri\n"), "{yaml}");
}

/// Rule (issue 31, "How it runs"): on a host without systemd node-setup installs the unit
/// but asks nothing of systemd, and says that devremap-runtime starts the node daemon there;
/// nor does it with `DEVREMAP_NODE_SERVICE=0` (tests/containerd.rs runs it so, on this host),
/// which installs the unit where `DEVREMAP_SYSTEMD_UNIT` says.
#[test]
fn node_setup_starts_no_service_without_systemd() {
    let setup = Setup::new("version = 2\n");
    fs::write(setup._tmp.path().join("no-systemd"), "").unwrap();
    let out = setup.run_ok();
    assert!(out.contains("the host runs no systemd; devremap-runtime starts the node daemon itself"), "{out}");
    assert!(setup.host.join("etc/systemd/system/devremap.service").is_file());
    assert_eq!(service_commands(&setup.on_host()), Vec::<String>::new(), "{:?}", setup.on_host());

    let setup = Setup::new("version = 2\n");
    let out = setup.run_with(&[("DEVREMAP_NODE_SERVICE", "0"), ("DEVREMAP_SYSTEMD_UNIT", "/units/devremap.service")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("devremap.service not started (DEVREMAP_NODE_SERVICE=0)"), "{stdout}");
    assert!(setup.host.join("units/devremap.service").is_file());
    assert!(!setup.host.join("etc/systemd").exists());
    assert_eq!(setup.on_host(), ["systemctl restart containerd"]);
}
