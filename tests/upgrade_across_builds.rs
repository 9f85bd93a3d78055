//! An upgrade between two really different builds (issue 18): this checkout's `devremapd` and
//! one built from the last commit of the previous keeper protocol, which `.ci/previous-protocol`
//! builds once (from git history, in its own target directory) and names by its path; `.ci/run`
//! passes that path in `DEVREMAP_PREVIOUS_BUILD`. Each keeper asks the other build to take over
//! (`SIGUSR2` with the other binary at the keeper's path) and must refuse it: the two speak
//! different protocols, so the refusal names both versions, and the old server serves on. This
//! is what the frozen `Load` and `Loaded` records are for: a keeper learns the version of a
//! build of any protocol before it sends it anything else.
//!
//! Without `DEVREMAP_PREVIOUS_BUILD` the tests are ignored by a plain `cargo test`, and fail
//! when run (`-- --include-ignored`, as CI does), naming the command that makes the build.

mod common;

use common::daemon::{Daemon, has_exited, need_fuse, wait_for_or};
use common::{BIN, FakeHost, arg, fake_rdev, saved_devices, spec_asking_for_all_gpus};
use serde_json::Value;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use tempfile::TempDir;

/// The environment variable naming the previous protocol's build.
const PREVIOUS: &str = "DEVREMAP_PREVIOUS_BUILD";

/// The previous protocol's `devremapd`, or the test fails naming how to make it.
fn previous_build() -> PathBuf {
    let path = std::env::var_os(PREVIOUS).map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "{PREVIOUS} is not set: this test upgrades to and from a build of the previous keeper protocol; \
             make it with `export {PREVIOUS}=$(bash .ci/previous-protocol)` (as .ci/run does)"
        )
    });
    assert!(path.is_file(), "{PREVIOUS}={}: no such file (run bash .ci/previous-protocol)", path.display());
    path
}

/// After the checks that the test can run: the previous build, this build's protocol and the
/// previous build's, which differ.
fn builds() -> (PathBuf, u32, u32) {
    need_fuse();
    let previous = previous_build();
    let (ours, theirs) = (protocol_of(Path::new(BIN)), protocol_of(&previous));
    assert_ne!(ours, theirs, "{} speaks this build's protocol: it tests nothing", previous.display());
    (previous, ours, theirs)
}

/// The keeper protocol `binary` speaks, from its `--version` (`0.1.0 (keeper protocol N)`).
fn protocol_of(binary: &Path) -> u32 {
    let out = Command::new(binary).arg("--version").output().expect("the binary runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("(keeper protocol ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{} --version names no keeper protocol: {text:?}", binary.display()))
}

/// The path a keeper is started from, in a directory of its own: an upgrade runs the file put
/// there next.
struct Installed {
    dir: TempDir,
}

impl Installed {
    fn new(from: &Path) -> Installed {
        let installed = Installed { dir: TempDir::new().unwrap() };
        installed.install(from);
        installed
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("devremapd")
    }

    /// Puts a copy of `from` at the path as a new file renamed over the old, as a package
    /// manager does. `cp` writes it: a descriptor open for writing here would be inherited by a
    /// child another test thread forks, and executing the file would then fail (ETXTBSY).
    fn install(&self, from: &Path) {
        let next = self.dir.path().join("devremapd.next");
        let copied = Command::new("cp").arg(from).arg(&next).status().expect("cp runs");
        assert!(copied.success(), "cp {} {}", from.display(), next.display());
        fs::rename(&next, self.path()).unwrap();
    }
}

/// A fake host with GPUs 0..=3 and a checkpoint that saved 4 and 5 (served as host 0 and 1),
/// the basic spec asking the NVIDIA hook for every GPU (a spec gets only the GPUs it asks for,
/// issue 29.3).
struct Inputs {
    host: FakeHost,
}

impl Inputs {
    fn new() -> Inputs {
        let host = FakeHost::with_gpus(&[0, 1, 2, 3]);
        fs::write(host.tmp.path().join("meta.json"), saved_devices(&[4, 5]).to_string()).unwrap();
        spec_asking_for_all_gpus("spec-basic.json", &host.tmp.path().join("config.json"));
        Inputs { host }
    }

    /// A keeper started from `installed`.
    fn start(&self, installed: &Installed) -> Daemon {
        let (meta, spec) = (self.host.tmp.path().join("meta.json"), self.host.tmp.path().join("config.json"));
        let mut args = vec!["--metadata".to_owned(), arg(&meta).to_owned(), "--spec".to_owned(), arg(&spec).to_owned()];
        args.extend(self.host.args());
        args.extend(["--ttl".to_owned(), "0".to_owned()]);
        Daemon::start_program(&installed.path(), &args.iter().map(String::as_str).collect::<Vec<_>>())
    }
}

fn read_state(d: &Daemon) -> Option<Value> {
    fs::read_to_string(&d.state_file).ok().and_then(|t| serde_json::from_str(&t).ok())
}

fn serves_saved_gpu4(d: &Daemon) -> bool {
    fs::symlink_metadata(d.path("nvidia4"))
        .is_ok_and(|m| (libc::major(m.rdev()), libc::minor(m.rdev())) == fake_rdev(0))
}

/// Installs `other` at the keeper's path, sends `SIGUSR2`, and checks the refusal: `last_error`
/// names the other build's protocol and the keeper's (`theirs`, `ours`), the server that served
/// before serves on (the same `server_pid`, no handover, still running and answering).
fn upgrade_is_refused(d: &Daemon, installed: &Installed, other: &Path, theirs: u32, ours: u32) {
    let before = d.state();
    let server = before["server_pid"].as_u64().expect("the state file names the server") as u32;
    installed.install(other);
    d.signal(libc::SIGUSR2);
    let state = wait_for_or(
        "the upgrade's last_error",
        || d.log_text(),
        || read_state(d).filter(|s| !s["last_error"].is_null()),
    );
    let error = state["last_error"].as_str().unwrap_or_default();
    let both = format!("keeper protocol {theirs}, this keeper speaks protocol {ours}");
    assert!(error.contains(&both), "last_error {error:?} does not say {both:?}\n{}", d.log_text());
    assert!(error.starts_with("upgrade refused"), "{error}");
    assert_eq!(state["server_pid"], before["server_pid"], "another server serves\n{}", d.log_text());
    assert_eq!(state["handovers"], before["handovers"]);
    assert_eq!(state["generation"], before["generation"]);
    assert!(!has_exited(server), "the old server ended\n{}", d.log_text());
    assert!(serves_saved_gpu4(d), "the mount no longer serves nvidia4 as host GPU 0\n{}", d.log_text());
}

/// Rule (issue 18): a keeper of this build asked to upgrade to a build of the previous keeper
/// protocol refuses it, naming both versions (`upgrade refused: the new binary cannot take
/// over: it speaks keeper protocol 1, this keeper speaks protocol 2; ...`), and its server
/// serves on; an upgrade to this build after it still takes over.
#[test]
#[ignore = "needs root, /dev/fuse and DEVREMAP_PREVIOUS_BUILD (bash .ci/previous-protocol)"]
fn this_keeper_refuses_an_upgrade_to_a_build_of_the_previous_protocol() {
    let (previous, ours, theirs) = builds();
    let inputs = Inputs::new();
    let installed = Installed::new(Path::new(BIN));
    let d = inputs.start(&installed);
    upgrade_is_refused(&d, &installed, &previous, theirs, ours);
    let old = d.server_pid();
    installed.install(Path::new(BIN));
    d.signal(libc::SIGUSR2);
    wait_for_or(
        "the upgrade to this build to take over",
        || d.log_text(),
        || read_state(&d).filter(|s| s["handovers"] == 1 && s["server_pid"] != old),
    );
    assert!(serves_saved_gpu4(&d));
    assert!(d.stop().success());
}

/// Rule (issue 18): a keeper of the previous protocol's build asked to upgrade to this build
/// refuses it too, naming both versions the other way round, and its server serves on: the
/// old build reads the version this build's server says in the frozen `Loaded` record. Then
/// it stops as it always did (`SIGTERM`: exit 0, the mount gone).
#[test]
#[ignore = "needs root, /dev/fuse and DEVREMAP_PREVIOUS_BUILD (bash .ci/previous-protocol)"]
fn a_keeper_of_the_previous_protocol_refuses_an_upgrade_to_this_build() {
    let (previous, ours, theirs) = builds();
    let inputs = Inputs::new();
    let installed = Installed::new(&previous);
    let d = inputs.start(&installed);
    upgrade_is_refused(&d, &installed, Path::new(BIN), ours, theirs);
    assert!(d.stop().success());
}
