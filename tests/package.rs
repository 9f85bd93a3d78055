//! The Debian package, as an operator gets it: `cargo deb` builds it, dpkg installs it into a
//! scratch root (`dpkg --root`, a root of Debian 12's merged-/usr shape with an empty dpkg
//! database), and the installed files are checked, run, and upgraded over.
//!
//! The files it installs live in `dist/` and in the package's asset list (`Cargo.toml`'s
//! `[package.metadata.deb]`): every file in `dist/` must land in the package, at the place
//! [`installed_path`] gives it; `dist/debian/` holds its maintainer scripts.

mod common;

use common::bundle::{BUSYBOX, find_in_path, is_static_elf};
use common::{arg, need_root};
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tempfile::TempDir;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Where the package installs `dist/<rel>`: the wrapper's config as the conffile
/// `/etc/devremap/runtime.json`, systemd units in `/lib/systemd/system/`, the maintainer
/// scripts `debian/<script>` as dpkg's `/var/lib/dpkg/info/devremap.<script>` (not a file of the
/// package's own), the client configs and the Kubernetes manifests under `/usr/share/devremap/`.
fn installed_path(rel: &str) -> String {
    match rel.split_once('/') {
        None if rel == "runtime.json" => "/etc/devremap/runtime.json".to_owned(),
        Some(("systemd", unit)) => format!("/lib/systemd/system/{unit}"),
        Some(("debian", script)) => format!("/var/lib/dpkg/info/devremap.{script}"),
        _ => format!("/usr/share/devremap/{rel}"),
    }
}

/// The maintainer scripts, the files of `dist/debian/`.
const SCRIPTS: [&str; 3] = ["postinst", "prerm", "postrm"];

/// The unit the package installs.
const UNIT: &str = "dist/systemd/devremap.service";

/// Every file under `dist/`, relative to it.
fn dist_files() -> Vec<String> {
    fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let name = format!("{prefix}{}", entry.file_name().to_str().unwrap());
            if entry.file_type().unwrap().is_dir() {
                walk(&entry.path(), &format!("{name}/"), out);
            } else {
                out.push(name);
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(ROOT).join("dist"), "", &mut out);
    out.sort();
    out
}

/// Rule (issue 21): the unit docs/daemon.md shows is the one the package installs.
#[test]
fn the_documented_unit_is_the_shipped_one() {
    let doc = fs::read_to_string(Path::new(ROOT).join("docs/daemon.md")).unwrap();
    let unit = fs::read_to_string(Path::new(ROOT).join(UNIT)).unwrap();
    let block = doc
        .split("```ini\n")
        .nth(1)
        .and_then(|rest| rest.split("```\n").next())
        .expect("docs/daemon.md has an ```ini block");
    assert_eq!(block, unit, "docs/daemon.md's unit differs from {UNIT}");
}

/// The value of each line `key=` of `unit` (continuation lines joined), in order.
fn unit_values(unit: &str, key: &str) -> Vec<String> {
    let prefix = format!("{key}=");
    unit.replace("\\\n", " ").lines().filter_map(|l| l.strip_prefix(&prefix)).map(str::to_owned).collect()
}

/// Rule (issue 31, "How it runs"): the package's one unit runs the node daemon
/// (`devremapd node`, told by `READY=1` that its socket answers, SIGHUP on reload) and restarts
/// it when it fails; a stop or a restart signals the node alone (`KillMode=process`), so each
/// container's keeper, the node's child in the unit's cgroup, serves on; no
/// `RuntimeDirectory=` (systemd would remove `/run/devremap` under live mounts) and nothing
/// that gives the service a mount namespace of its own (the runtimes would not see its
/// mounts). The per-container template `devremap@.service` is gone.
#[test]
fn the_unit_runs_the_node_daemon_and_never_stops_a_keeper() {
    let unit = fs::read_to_string(Path::new(ROOT).join(UNIT)).unwrap();
    let one = |key: &str| {
        let values = unit_values(&unit, key);
        assert_eq!(values.len(), 1, "{key}= in {UNIT}: {values:?}");
        values[0].clone()
    };
    assert_eq!(
        one("ExecStart").split_whitespace().collect::<Vec<_>>(),
        [
            "/usr/bin/devremapd",
            "node",
            "--socket",
            "/run/devremap/node.sock",
            "--state-dir",
            "/run/devremap",
            "--pid-file",
            "/run/devremap/node.pid",
            // The operator's flags (`--nri`), from the optional environment file.
            "$DEVREMAPD_NODE_ARGS"
        ]
    );
    assert_eq!(one("EnvironmentFile"), "-/etc/default/devremap");
    assert_eq!(one("Type"), "notify");
    assert_eq!(one("KillMode"), "process");
    assert_eq!(one("ExecReload"), "/usr/bin/kill -HUP $MAINPID");
    assert!(["always", "on-failure"].contains(&one("Restart").as_str()), "{unit}");
    for key in ["RuntimeDirectory", "PrivateTmp", "PrivateDevices", "ProtectSystem", "ProtectHome", "PrivateMounts"] {
        assert!(unit_values(&unit, key).is_empty(), "{key}= in {UNIT}");
    }
    let units: Vec<String> = dist_files().into_iter().filter(|f| f.starts_with("systemd/")).collect();
    assert_eq!(units, ["systemd/devremap.service"]);
}

/// Rule (issue 31): the maintainer scripts are shell that `sh -n` passes, and each call of
/// `systemctl` that starts, stops or restarts something is made only where systemd runs (`[ -d
/// /run/systemd/system ]`): the tests below run them where it does not too.
#[test]
fn the_maintainer_scripts_are_valid_shell() {
    for script in SCRIPTS {
        let path = Path::new(ROOT).join("dist/debian").join(script);
        run(Command::new("sh").arg("-n").arg(&path));
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111, 0o111, "{script}");
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("#!/bin/sh\n") && text.contains("\nset -e\n"), "{script}");
        assert!(text.contains("[ -d /run/systemd/system ]"), "{script} has no guard for hosts without systemd");
    }
}

/// Rule (issue 21): the config the package ships parses, and says what the defaults say; it
/// names no `devremapd`, so the wrapper runs the one beside it (`/usr/bin` from the package,
/// `/usr/local/bin` from the Kubernetes node setup).
#[test]
fn the_shipped_config_is_valid() {
    let bytes = fs::read(Path::new(ROOT).join("dist/runtime.json")).unwrap();
    let config = devremap::runtime::config::parse(&bytes).unwrap();
    let defaults = devremap::runtime::config::Config::default();
    assert_eq!(config, defaults);
}

/// Fails the calling (`#[ignore]`d) test unless it can build and install the package: root
/// (dpkg writes files owned by root), cargo-deb, dpkg, `unshare`, `systemd-analyze`, the runc
/// that the shipped config names, and a static busybox (the scratch root's shell, for the
/// maintainer scripts).
fn need_packaging() {
    need_root();
    if !is_static_elf(Path::new(BUSYBOX)) {
        panic!(
            "{BUSYBOX} is missing or not a static binary (apt-get install busybox-static): the scratch root's shell"
        );
    }
    let cargo_deb = Command::new(cargo()).args(["deb", "--version"]).output().is_ok_and(|o| o.status.success());
    if !cargo_deb {
        panic!("cargo-deb is not installed (cargo install --locked cargo-deb): this test builds the .deb");
    }
    for (tool, package) in
        [("dpkg", "dpkg"), ("unshare", "util-linux"), ("systemd-analyze", "systemd"), ("runc", "runc")]
    {
        if find_in_path(tool).is_none() {
            panic!("{tool} is not installed (apt-get install {package}): this test installs the .deb");
        }
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Runs `command`, asserting success; returns its stdout.
fn run(command: &mut Command) -> String {
    let out = command.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{command:?} failed: {}\n{stderr}", out.status);
    String::from_utf8(out.stdout).unwrap()
}

/// Builds the package into `out` with version `version`, from a release build without test
/// hooks in `target/package` (the test binaries' own `target/release` has them, and must keep
/// them for the tests run after this one).
fn build_deb(out: &Path, version: Option<&str>) -> PathBuf {
    let deb = out.join(format!("devremap-{}.deb", version.unwrap_or("default")));
    let mut c = Command::new(cargo());
    c.current_dir(ROOT).env("CARGO_TARGET_DIR", Path::new(ROOT).join("target/package"));
    c.args(["deb", "--quiet", "--output", arg(&deb)]);
    if let Some(v) = version {
        c.args(["--no-build", "--deb-version", v]);
    }
    run(&mut c);
    deb
}

/// Where the scratch root's fake systemd commands write what they were asked, one line each.
const ASKED: &str = "asked-of-systemd";

/// An empty root of Debian 12's shape (`/bin`, `/lib`, `/sbin` link into `/usr`) with an empty
/// dpkg database, a static busybox as `/bin/sh` and a `/dev/null` (dpkg runs the maintainer
/// scripts chrooted into it), and, in `/usr/sbin`, a `systemctl`, `deb-systemd-helper` and `deb-systemd-invoke` that
/// only write their command line to [`ASKED`] at the root and succeed: no systemd runs there,
/// and `/run/systemd/system` is not there until a test makes it.
fn scratch_root(dir: &Path) -> PathBuf {
    let root = dir.join("root");
    for d in ["usr/bin", "usr/lib", "usr/sbin", "var/lib/dpkg/info", "var/lib/dpkg/updates"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    for link in ["bin", "lib", "sbin"] {
        std::os::unix::fs::symlink(format!("usr/{link}"), root.join(link)).unwrap();
    }
    fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    fs::create_dir(root.join("dev")).unwrap();
    nix::sys::stat::mknod(
        &root.join("dev/null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    fs::copy(BUSYBOX, root.join("usr/bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("usr/bin/sh")).unwrap();
    for fake in ["systemctl", "deb-systemd-helper", "deb-systemd-invoke"] {
        let path = root.join("usr/sbin").join(fake);
        common::write_executable(&path, format!("#!/bin/sh\necho \"{fake} $*\" >> /{ASKED}\n").as_bytes());
    }
    root
}

/// What the maintainer scripts asked of the scratch root's fake systemd since the last call.
fn asked(root: &Path) -> Vec<String> {
    let path = root.join(ASKED);
    let text = fs::read_to_string(&path).unwrap_or_default();
    let _ = fs::remove_file(&path);
    text.lines().map(str::to_owned).collect()
}

/// `dpkg --root ROOT <args>`. The package's dependencies (libc) are not in the scratch root.
fn dpkg(root: &Path, args: &[&str]) -> String {
    run(Command::new("dpkg").arg(format!("--root={}", arg(root))).arg("--force-depends").args(args))
}

fn installed_version(root: &Path) -> String {
    let admin = root.join("var/lib/dpkg");
    run(Command::new("dpkg-query").arg(format!("--admindir={}", arg(&admin))).args(["-W", "-f=${Version}", "devremap"]))
}

/// Rule (issue 21): `cargo deb` builds package `devremap`; installed, it has both binaries in
/// `/usr/bin` (and they run), every file of `dist/` in its place, `/etc/devremap/runtime.json`
/// as a conffile, and units that `systemd-analyze verify` passes on the installed paths. An
/// upgrade keeps an operator's edit of the conffile; a purge removes everything.
///
/// Rule (issue 31, "How it runs"): the installed unit's `ExecStart` runs the installed node
/// daemon, which says `READY=1` once `devremapd ctl list` answers, reloads on `ExecReload` and
/// exits 0 on SIGTERM (a stop). The maintainer scripts: without systemd running, only the
/// enablement is recorded (`deb-systemd-helper`); with it, an install starts the node, an
/// upgrade restarts it and then sends SIGUSR2 to the node alone (which passes it on to every
/// container's server), and a remove stops the unit and nothing else (`KillMode=process`: the
/// node alone).
#[test]
#[ignore = "needs root and cargo-deb"]
fn the_package_installs_runs_and_upgrades() {
    need_packaging();
    let tmp = TempDir::new().unwrap();
    let deb = build_deb(tmp.path(), None);
    let root = scratch_root(tmp.path());
    dpkg(&root, &["--install", arg(&deb)]);

    // Contents: the binaries, every dist/ file, the docs; and nothing else outside the docs.
    let listed: BTreeSet<String> = dpkg(&root, &["--listfiles", "devremap"]).lines().map(str::to_owned).collect();
    let mut expected: BTreeSet<String> = ["/usr/bin/devremapd", "/usr/bin/devremap-runtime"].map(str::to_owned).into();
    expected.extend(dist_files().iter().filter(|f| !f.starts_with("debian/")).map(|f| installed_path(f)));
    let files: BTreeSet<String> = listed.iter().filter(|p| root.join(&p[1..]).is_file()).cloned().collect();
    let docs = "/usr/share/doc/devremap/";
    assert!(files.contains(&format!("{docs}README.md")) && files.contains(&format!("{docs}daemon.md")), "{files:?}");
    let other: BTreeSet<String> = files.iter().filter(|p| !p.starts_with(docs)).cloned().collect();
    assert_eq!(other, expected, "the package's files (left) against the binaries and dist/ (right)");
    for (path, mode) in
        [("usr/bin/devremapd", 0o755), ("usr/bin/devremap-runtime", 0o755), ("etc/devremap/runtime.json", 0o644)]
    {
        let meta = fs::metadata(root.join(path)).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777, mode, "{path}");
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 0, "{path}");
    }
    let conffiles = fs::read_to_string(root.join("var/lib/dpkg/info/devremap.conffiles")).unwrap();
    assert_eq!(conffiles.trim(), "/etc/devremap/runtime.json");
    // The maintainer scripts are the package's, as dist/debian/ has them.
    for script in SCRIPTS {
        let installed = root.join(&installed_path(&format!("debian/{script}"))[1..]);
        let ours = fs::read(Path::new(ROOT).join("dist/debian").join(script)).unwrap();
        assert_eq!(fs::read(&installed).unwrap(), ours, "{script}");
        run(Command::new("sh").arg("-n").arg(&installed));
    }
    // No systemd runs in the scratch root: the install only recorded the enablement.
    assert_eq!(
        asked(&root),
        [
            "deb-systemd-helper unmask devremap.service",
            "deb-systemd-helper --quiet was-enabled devremap.service",
            "deb-systemd-helper enable devremap.service",
        ]
    );

    // The installed binaries run; the wrapper with the installed config, whose runtime (runc)
    // prints its version after ours.
    let version = env!("CARGO_PKG_VERSION");
    let out = run(Command::new(root.join("usr/bin/devremapd")).arg("--version"));
    assert_eq!(out, format!("devremapd {version} (keeper protocol {})\n", devremap::keeper::control::PROTOCOL));
    let config = root.join("etc/devremap/runtime.json");
    let out = run(Command::new(root.join("usr/bin/devremap-runtime"))
        .arg("--version")
        .env("DEVREMAP_RUNTIME_CONFIG", &config));
    assert!(out.starts_with(&format!("devremap-runtime version {version}\n")), "{out}");
    assert!(out.lines().any(|l| l.starts_with("runc version")), "runc's version does not follow: {out}");

    // The units, on the installed paths: in a mount namespace of this test's own, the scratch
    // root's /usr/bin lies over the host's (which keeps `kill`).
    let units = root.join("lib/systemd/system");
    for unit in dist_files().iter().filter_map(|f| f.strip_prefix("systemd/")) {
        let script = "mount -t overlay overlay -o \"lowerdir=$0/usr/bin:/usr/bin\" /usr/bin && exec systemd-analyze verify \"$1\"";
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", script, arg(&root), arg(&units.join(unit))])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stderr.is_empty(), "systemd-analyze verify {unit}: {}\n{stderr}", out.status);
    }
    the_installed_unit_runs_the_node(&root, tmp.path());

    // With systemd running, an upgrade restarts the node and then upgrades every container's
    // server, through the node alone; it keeps the operator's edit of the conffile, without
    // asking (stdin is null).
    fs::create_dir_all(root.join("run/systemd/system")).unwrap();
    let edited = "{\"runtime\": \"crun\"}\n";
    fs::write(&config, edited).unwrap();
    let next = build_deb(tmp.path(), Some(&format!("{version}-2")));
    dpkg(&root, &["--install", arg(&next)]);
    assert_eq!(installed_version(&root), format!("{version}-2"));
    assert_eq!(fs::read_to_string(&config).unwrap(), edited, "the upgrade overwrote the conffile");
    let upgrade = asked(&root);
    let restart = upgrade.iter().position(|c| c == "deb-systemd-invoke restart devremap.service");
    let usr2 = upgrade.iter().position(|c| c == "systemctl kill --kill-who=main --signal=SIGUSR2 devremap.service");
    assert!(restart.is_some() && restart < usr2, "{upgrade:?}");
    let signals: Vec<&String> = upgrade.iter().filter(|c| c.contains("kill") || c.contains("stop")).collect();
    assert_eq!(signals.len(), 1, "{upgrade:?}");

    // A remove stops the unit, and only it; the purge forgets it and takes every file, the
    // conffile too.
    dpkg(&root, &["--purge", "devremap"]);
    let purge = asked(&root);
    let signals: Vec<&String> = purge.iter().filter(|c| c.contains("kill") || c.contains("stop")).collect();
    assert_eq!(signals, ["deb-systemd-invoke stop devremap.service"], "{purge:?}");
    assert!(purge.contains(&"deb-systemd-helper purge devremap.service".to_owned()), "{purge:?}");
    for path in &expected {
        assert!(!root.join(&path[1..]).exists(), "{path} is left after the purge");
    }

    // A first install where systemd runs starts the node.
    dpkg(&root, &["--install", arg(&next)]);
    let install = asked(&root);
    assert!(install.contains(&"deb-systemd-invoke start devremap.service".to_owned()), "{install:?}");
    assert!(!install.iter().any(|c| c.contains("restart") || c.contains("kill")), "{install:?}");
}

/// Kills the node daemon whose pid is in `pid_file` (when it still is `devremapd node`), so
/// that a failing test leaves none behind.
struct NodeGuard {
    pid_file: PathBuf,
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        let Ok(text) = fs::read_to_string(&self.pid_file) else { return };
        let Ok(pid) = text.trim().parse::<i32>() else { return };
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmdline.windows(6).any(|w| w == b"\0node\0") {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Runs the installed unit's `ExecStart` as systemd would (no systemd is PID 1 here), in a
/// mount namespace of its own where `/run` is an empty tmpfs and the scratch root's `/usr/bin`
/// lies over the host's, with `NOTIFY_SOCKET` naming a socket of this test: `READY=1` comes
/// once the socket answers (`devremapd ctl list`, the installed one, answers, listing no
/// container), the `ExecReload` command leaves it serving, and SIGTERM (`systemctl stop`) ends
/// it with status 0 and its pid file gone.
fn the_installed_unit_runs_the_node(root: &Path, dir: &Path) {
    let unit = fs::read_to_string(root.join("lib/systemd/system/devremap.service")).unwrap();
    let start = unit_values(&unit, "ExecStart").join("");
    let reload = unit_values(&unit, "ExecReload").join("");
    let notify = dir.join("notify.sock");
    let ready = UnixDatagram::bind(&notify).unwrap();
    ready.set_nonblocking(true).unwrap();
    let guard = NodeGuard { pid_file: dir.join("node.pid") };
    let script = format!(
        r#"set -eu
mount -t tmpfs tmpfs /run
mount -t overlay overlay -o "lowerdir={root}/usr/bin:/usr/bin" /usr/bin
node=""
trap '[ -z "$node" ] || kill -KILL $node 2>/dev/null || true' EXIT
# No /etc/default/devremap: systemd expands the unset variable to no word at all.
DEVREMAPD_NODE_ARGS=""
NOTIFY_SOCKET={notify} {start} 2> /run/node.log &
node=$!
echo $node > {pid_file}
answered=""
for _ in $(seq 600); do
    if list=$(/usr/bin/devremapd ctl list 2>&1); then answered=yes; break; fi
    kill -0 $node || {{ echo "the node exited:"; cat /run/node.log; exit 1; }}
    sleep 0.1
done
[ -n "$answered" ] || {{ echo "ctl list never answered: $list"; cat /run/node.log; exit 1; }}
echo "listed: [$list]"
MAINPID=$node
{reload}
for _ in $(seq 600); do
    grep -q "reloading 0 containers" /run/node.log && break
    sleep 0.1
done
grep -q "reloading 0 containers" /run/node.log && echo "reloaded"
/usr/bin/devremapd ctl list > /dev/null && echo "serves after a reload"
kill -TERM $node
status=0
wait $node || status=$?
node=""
echo "stopped: $status"
[ -e /run/devremap/node.pid ] || echo "pid file gone"
cat /run/node.log
"#,
        root = arg(root),
        notify = arg(&notify),
        pid_file = arg(&guard.pid_file),
        reload = reload,
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    drop(guard);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    assert!(
        stdout.contains("listed: []\nreloaded\nserves after a reload\nstopped: 0\npid file gone\n"),
        "{stdout}\n{stderr}"
    );
    let mut buf = [0u8; 256];
    let n = ready.recv(&mut buf).unwrap_or_else(|e| panic!("no notification from the node ({e}): {stdout}"));
    assert!(
        String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == "READY=1"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
}
