//! The Debian package, as an operator gets it: `cargo deb` builds it, dpkg installs it into a
//! scratch root (`dpkg --root`, a root of Debian 12's merged-/usr shape with an empty dpkg
//! database), and the installed files are checked, run, and upgraded over.
//!
//! The files it installs live in `dist/` and in the package's asset list (`Cargo.toml`'s
//! `[package.metadata.deb]`): every file in `dist/` must land in the package, at the place
//! [`installed_path`] gives it.

mod common;

use common::{arg, bundle::find_in_path, need_root};
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tempfile::TempDir;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Where the package installs `dist/<rel>`: the wrapper's config as the conffile
/// `/etc/devremap/runtime.json`, systemd units in `/lib/systemd/system/`, the client configs
/// and the Kubernetes manifests under `/usr/share/devremap/`.
fn installed_path(rel: &str) -> String {
    match rel.split_once('/') {
        None if rel == "runtime.json" => "/etc/devremap/runtime.json".to_owned(),
        Some(("systemd", unit)) => format!("/lib/systemd/system/{unit}"),
        _ => format!("/usr/share/devremap/{rel}"),
    }
}

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
    let unit = fs::read_to_string(Path::new(ROOT).join("dist/systemd/devremap@.service")).unwrap();
    let block = doc
        .split("```ini\n")
        .nth(1)
        .and_then(|rest| rest.split("```\n").next())
        .expect("docs/daemon.md has an ```ini block");
    assert_eq!(block, unit, "docs/daemon.md's unit differs from dist/systemd/devremap@.service");
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
/// (dpkg writes files owned by root), cargo-deb, dpkg, `unshare`, `systemd-analyze`, and the
/// runc that the shipped config names.
fn need_packaging() {
    need_root();
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

/// An empty root of Debian 12's shape (`/bin`, `/lib`, `/sbin` link into `/usr`) with an empty
/// dpkg database.
fn scratch_root(dir: &Path) -> PathBuf {
    let root = dir.join("root");
    for d in ["usr/bin", "usr/lib", "usr/sbin", "var/lib/dpkg/info", "var/lib/dpkg/updates"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    for link in ["bin", "lib", "sbin"] {
        std::os::unix::fs::symlink(format!("usr/{link}"), root.join(link)).unwrap();
    }
    fs::write(root.join("var/lib/dpkg/status"), "").unwrap();
    root
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
    expected.extend(dist_files().iter().map(|f| installed_path(f)));
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
    // root's /usr/bin lies over the host's (which keeps `install`, `mkdir` and `kill`).
    let units = root.join("lib/systemd/system");
    for unit in dist_files().iter().filter_map(|f| f.strip_prefix("systemd/")) {
        let instance = units.join(unit.replace("@.", "@ctr1."));
        let script = "mount -t overlay overlay -o \"lowerdir=$0/usr/bin:/usr/bin\" /usr/bin && exec systemd-analyze verify \"$1\"";
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", script, arg(&root), arg(&instance)])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stderr.is_empty(), "systemd-analyze verify {unit}: {}\n{stderr}", out.status);
    }

    // An upgrade keeps the operator's edit of the conffile, without asking (stdin is null).
    let edited = "{\"runtime\": \"crun\"}\n";
    fs::write(&config, edited).unwrap();
    let next = build_deb(tmp.path(), Some(&format!("{version}-2")));
    dpkg(&root, &["--install", arg(&next)]);
    assert_eq!(installed_version(&root), format!("{version}-2"));
    assert_eq!(fs::read_to_string(&config).unwrap(), edited, "the upgrade overwrote the conffile");

    // A purge takes everything, the conffile too.
    dpkg(&root, &["--purge", "devremap"]);
    for path in &expected {
        assert!(!root.join(&path[1..]).exists(), "{path} is left after the purge");
    }
}

/// The commands systemd runs to start an instance of `unit`, in order: each `ExecStartPre=`
/// (with whether a failure is ignored, the `-` prefix) and then `ExecStart=`, continuation
/// lines joined and `%i` made `instance`.
fn start_commands(unit: &str, instance: &str) -> Vec<(bool, String)> {
    unit.replace("\\\n", " ")
        .lines()
        .filter_map(|l| l.strip_prefix("ExecStartPre=").or_else(|| l.strip_prefix("ExecStart=")))
        .map(|cmd| match cmd.strip_prefix('-') {
            Some(cmd) => (true, cmd.replace("%i", instance)),
            None => (false, cmd.replace("%i", instance)),
        })
        .collect()
}

/// Rule (issue 30.3): the unit comes back after its daemon is SIGKILLed (an OOM kill): on
/// `Restart=`, systemd runs the start commands again over the dead FUSE mount, and they serve.
/// `ExecStartPre=mkdir -p /run/devremap/%i` failed on it (`Transport endpoint is not
/// connected`) on every attempt. Runs the shipped unit's start commands as systemd does (no
/// systemd is PID 1 here), in a mount namespace of the test's own where `/run`, `/var/lib` are
/// empty and `/usr/bin` has this build's `devremapd` over the host's; the instance's inputs
/// are an empty checkpoint and a spec listing no device.
#[test]
#[ignore = "needs root and /dev/fuse: mounts the unit's FUSE /dev"]
fn the_unit_restarts_after_its_daemon_is_killed() {
    common::daemon::need_fuse();
    let unit = fs::read_to_string(Path::new(ROOT).join("dist/systemd/devremap@.service")).unwrap();
    let commands = start_commands(&unit, "ctr1");
    assert!(commands.len() >= 2 && commands.last().unwrap().1.starts_with("/usr/bin/devremapd mount "), "{commands:?}");
    let tmp = TempDir::new().unwrap();
    let bin = tmp.path().join("bin");
    fs::create_dir_all(&bin).unwrap();
    fs::copy(common::BIN, bin.join("devremapd")).unwrap();
    let (pre, start) = commands.split_at(commands.len() - 1);
    let pre: String = pre
        .iter()
        .map(|(ignored, cmd)| if *ignored { format!("{cmd} || true\n") } else { format!("{cmd}\n") })
        .collect();
    // Each start runs the ExecStartPre commands (a failure fails the start) and ExecStart in
    // the background, and waits (60 s at most) for the mount to serve `null`.
    let script = format!(
        r#"set -eu
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /var/lib
mount -t overlay overlay -o "lowerdir={bin}:/usr/bin" /usr/bin
mkdir -p /var/lib/devremap/ctr1
echo '[]' > /var/lib/devremap/ctr1/checkpoint
echo '{{"ociVersion": "1.0.2", "linux": {{"devices": []}}}}' > /var/lib/devremap/ctr1/config.json
echo native > /var/lib/devremap/ctr1/prefer
# On any exit, the daemons this started and their servers, and nothing else.
started=""
trap 'for p in $started; do kill -KILL $(cat /proc/$p/task/*/children 2>/dev/null) $p 2>/dev/null || true; done' EXIT
start() {{
{pre}    {start} 2> /run/daemon.log &
    started="$started $!"
    # Its pid in the pid file (the killed daemon's stays there) says it serves.
    for _ in $(seq 600); do
        [ "$(cat /run/devremap/ctr1.pid 2>/dev/null)" = $! ] && [ -c /run/devremap/ctr1/null ] && return 0
        sleep 0.1
    done
    echo "the unit's daemon did not serve:"; cat /run/daemon.log; exit 1
}}
start
keeper=${{started# }}
server=$(cat /proc/$keeper/task/*/children)
kill -KILL $keeper $server
wait $keeper || true
# Reaped: its pid is no longer ours to kill.
started=""
if ls /run/devremap/ctr1 2>/dev/null; then echo "the mount still answers"; exit 1; fi
echo "dead mount: $(stat /run/devremap/ctr1 2>&1 | tail -n 1)"
start
echo "serves again: $(stat -c %t:%T /run/devremap/ctr1/null)"
keeper=${{started# }}
kill -TERM $keeper
status=0
wait $keeper || status=$?
started=""
echo "stopped: $status"
"#,
        bin = arg(&bin),
        start = start[0].1
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("Transport endpoint is not connected"), "{stdout}");
    assert!(stdout.contains("serves again: 1:3\nstopped: 0\n"), "{stdout}\n{stderr}");
}
