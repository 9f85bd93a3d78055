//! `devremap-runtime`, the OCI runtime wrapper, with real runtimes: runc's create/start/delete
//! and run, crun through the config's `runtime`, the refusal of bad annotations and configs,
//! and the daemon's lifetime (gone after delete, gone when the container's init exits, gone
//! when the wrapper is killed before the container started).
//!
//! The fake host is the one of tests/containers.rs: GPUs `nvidia0` and `nvidia1` are char
//! devices 1:3 (null) and 1:5 (zero). The bundle asks for devremap by annotation, since a fake
//! GPU's number is not NVIDIA's. Every wrapper runs with its own config file
//! (`DEVREMAP_RUNTIME_CONFIG`) whose `state_dir` is in the test's temporary directory.

mod common;

use common::bundle::{
    Bundle, HYBRID_UNIFIED, Runtime, allow_char, is_mount_point, need_containers, oci_config,
    runc_could_not_clone_itself,
};
use common::clients::need_criu;
use common::daemon::{Stopped, is_mounted, need_fuse, wait_for, wait_for_or};
use common::{FakeHost, arg, devremapd, fake_rdev, fixture, write_file};
use serde_json::{Value, json};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use tempfile::TempDir;

const WRAPPER: &str = env!("CARGO_BIN_EXE_devremap-runtime");

/// One container at a time, as in tests/containers.rs.
static SERIAL: Mutex<()> = Mutex::new(());

/// The container reports what its `/dev` is, then waits for `/xchg/go`.
const SCRIPT: &str = r#"#!/bin/sh
while read -r src mp fs rest; do [ "$mp" = /dev ] && echo "dev.fs: $fs"; done < /proc/mounts
echo "nvidia1: $(stat -c '%t:%T' /dev/nvidia1)"
echo "nvidia1.reads: $(head -c 4 /dev/nvidia1 | od -An -tx1 | tr -d ' \n')"
echo ready
i=0
while [ ! -e /xchg/go ]; do i=$((i + 1)); [ "$i" -gt 1200 ] && exit 1; sleep 0.05; done
echo done
"#;

/// A fake host, a bundle asking for devremap, and the wrapper's config.
struct Setup {
    host: FakeHost,
    bundle: Bundle,
    tmp: TempDir,
    config: PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        common::daemon::stop_node(&self.state_dir());
        // A test may have pointed the config at another state dir, with a node daemon of its own.
        let config: Value =
            fs::read(&self.config).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        if let Some(dir) = config["state_dir"].as_str() {
            common::daemon::stop_node(Path::new(dir));
        }
    }
}

impl Setup {
    fn new(runtime: Runtime, annotations: Value) -> Setup {
        Setup::with_script(runtime, annotations, SCRIPT)
    }

    fn with_script(runtime: Runtime, annotations: Value, script: &str) -> Setup {
        let rules: Vec<Value> = (0..3).map(fake_rdev).map(|(ma, mi)| allow_char(ma, mi)).collect();
        let mut spec = oci_config("wrapped", &rules);
        spec["annotations"] = annotations;
        Setup::on_host(runtime, FakeHost::with_gpus(&[0, 1]), &spec, script)
    }

    /// A bundle of `spec` running `script`, on `host`.
    fn on_host(runtime: Runtime, host: FakeHost, spec: &Value, script: &str) -> Setup {
        let bundle = Bundle::new(script, spec);
        let tmp = TempDir::new().unwrap();
        let config = write_file(
            tmp.path(),
            "runtime.json",
            json!({"runtime": arg(&runtime_binary(runtime, tmp.path())), "host_dev": arg(&host.dev()),
                   "host_root": arg(&host.root()), "state_dir": arg(&tmp.path().join("state"))})
            .to_string(),
        );
        Setup { host, bundle, tmp, config }
    }

    /// Makes the bundle's spec ask the NVIDIA hook for every GPU (`docker run --gpus all`): a
    /// spec is given only the GPUs it asks for (issue 29.3).
    fn ask_for_gpus(&self) {
        let mut config = self.bundle.config();
        common::bundle::nvidia_hook(&mut config, self.tmp.path(), Some("all"));
        self.bundle.write_config(&config);
    }

    fn state_dir(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    /// Waits until container `id`'s directory is gone: the node daemon removes it once the
    /// container's keeper has ended (issue 31), after the runtime that replaced the wrapper.
    fn wait_gone(&self, id: &str) {
        let dir = self.state_dir().join(id);
        wait_for_or(
            &format!("{} to be removed", dir.display()),
            || self.daemon_log(id),
            || (!dir.exists()).then_some(()),
        );
    }

    /// `devremap-runtime --root <bundle state> <args>`, stdout and stderr to the bundle's files.
    fn wrapper(&self, args: &[&str]) -> Command {
        let mut c = Command::new(WRAPPER);
        c.env(devremap_config_env(), &self.config)
            .env_remove("RUST_LOG")
            .arg("--root")
            .arg(self.bundle.state_root())
            .args(args)
            .stdin(Stdio::null());
        c
    }

    /// Runs the wrapper to its end, the container's output going to `stdout`; returns its
    /// status and what it wrote to stderr. Files, not pipes: a container started by `create`
    /// keeps the runtime's stdio open.
    ///
    /// A `run` or `create` that runc itself failed before the container existed because it
    /// could not copy itself (see [`runc_could_not_clone_itself`]) is tried once more, once
    /// the node daemon has let go of the id: that failure is runc's and the kernel's on a busy
    /// machine, not devremap's, and the wrapper has already exec'd runc when it happens.
    fn run(&self, args: &[&str]) -> Ran {
        let ran = self.run_once(args);
        let starts = args.iter().any(|a| matches!(*a, "run" | "create"));
        match args.last() {
            Some(id) if starts && !ran.status.success() && runc_could_not_clone_itself(&ran.stderr) => {
                eprintln!(
                    "runc could not copy itself (its failure, not devremap's); trying once more:\n{}",
                    ran.stderr
                );
                self.wait_gone(id);
                self.run_once(args)
            }
            _ => ran,
        }
    }

    fn run_once(&self, args: &[&str]) -> Ran {
        let out = append(&self.bundle.dir().join("stdout"));
        let err_path = self.tmp.path().join("wrapper.stderr");
        let err = fs::File::create(&err_path).unwrap();
        let status = self.wrapper(args).stdout(out).stderr(err).status().expect("the wrapper runs");
        Ran { status, stderr: fs::read_to_string(&err_path).unwrap() }
    }

    fn stdout(&self) -> String {
        fs::read_to_string(self.bundle.dir().join("stdout")).unwrap_or_default()
    }

    fn wait_line(&self, line: &str) {
        wait_for(&format!("{line:?} from the container"), || self.stdout().lines().any(|l| l == line).then_some(()));
    }

    /// Container `id`'s daemon log, kept open: read after the node daemon removed the
    /// container's directory (once its keeper exited), it still holds the keeper's last lines.
    fn open_log(&self, id: &str) -> fs::File {
        fs::File::open(self.state_dir().join(id).join("devremapd.log")).unwrap()
    }

    fn daemon_log(&self, id: &str) -> String {
        fs::read_to_string(self.state_dir().join(id).join("devremapd.log")).unwrap_or_default()
    }

    /// The daemon's pid, from its pid file.
    fn daemon_pid(&self, id: &str) -> u32 {
        fs::read_to_string(self.state_dir().join(id).join("devremapd.pid")).unwrap().trim().parse().unwrap()
    }

    /// Sets one key of the wrapper's config file.
    fn set_config(&self, key: &str, value: impl Into<Value>) {
        let mut config: Value = serde_json::from_slice(&fs::read(&self.config).unwrap()).unwrap();
        config[key] = value.into();
        fs::write(&self.config, config.to_string()).unwrap();
    }

    /// Makes the real runtime a script that leaves the returned file as its mark, then exits
    /// with `status`: whether the runtime ran at all.
    fn marking_runtime(&self, status: u8) -> PathBuf {
        let ran = self.tmp.path().join("runtime-ran");
        let script = format!("#!/bin/sh\ntouch {}\nexit {status}\n", ran.display());
        let runtime = self.tmp.path().join("mark.sh");
        common::write_executable(&runtime, script.as_bytes());
        self.set_config("runtime", arg(&runtime));
        ran
    }

    /// Makes the real runtime a script that writes what container `id`'s `/dev` serves for
    /// `names` (`name major:minor mode`, hex numbers, octal mode) to the returned file, then
    /// fails: the wrapper undoes everything, and no container runs.
    fn probing_runtime(&self, id: &str, names: &[&str]) -> PathBuf {
        let out = self.tmp.path().join("probed");
        let dev = self.state_dir().join(id).join("dev");
        let paths: Vec<String> = names.iter().map(|n| arg(&dev.join(n)).to_owned()).collect();
        let script = format!("#!/bin/sh\nstat -c '%n %t:%T %a' {} > {}\nexit 1\n", paths.join(" "), arg(&out));
        let runtime = self.tmp.path().join("probe.sh");
        common::write_executable(&runtime, script.as_bytes());
        self.set_config("runtime", arg(&runtime));
        out
    }

    /// Makes the real runtime a script that hangs in `create` and knows no containers.
    fn hanging_runtime(&self) {
        let hang = self.tmp.path().join("hang.sh");
        common::write_executable(
            &hang,
            "#!/bin/sh\ncase \"$*\" in *create*) exec sleep 600;; esac\nexit 1\n".as_bytes(),
        );
        self.set_config("runtime", arg(&hang));
    }
}

/// Deletes the container through the wrapper (`delete --force`, which stops its daemon) when
/// dropped, so a failing test leaves no container, daemon or mount behind.
struct Deleting<'a>(&'a Setup, String);

impl Drop for Deleting<'_> {
    fn drop(&mut self) {
        let _ = self.0.wrapper(&["delete", "--force", &self.1]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    }
}

/// [`Deleting`] under runtime root `.1`.
struct DeletingUnder<'a>(&'a Setup, PathBuf, String);

impl Drop for DeletingUnder<'_> {
    fn drop(&mut self) {
        let _ = self.0.run(&["--root", arg(&self.1), "delete", "--force", &self.2]);
    }
}

/// A wrapper's exit status and stderr.
struct Ran {
    status: ExitStatus,
    stderr: String,
}

fn devremap_config_env() -> &'static str {
    "DEVREMAP_RUNTIME_CONFIG"
}

fn append(path: &Path) -> fs::File {
    fs::OpenOptions::new().create(true).append(true).open(path).unwrap()
}

/// The runtime's binary, or for crun on a hybrid cgroup host a script running it where the
/// cgroup2 mount is gone (see tests/common/bundle.rs).
fn runtime_binary(runtime: Runtime, dir: &Path) -> PathBuf {
    let bin = runtime.binary().unwrap_or_else(|| panic!("{} is not on PATH", runtime.name()));
    if runtime != Runtime::Crun || !is_mount_point(Path::new(HYBRID_UNIFIED)) {
        return bin;
    }
    let script = dir.join("crun.sh");
    common::write_executable(&script, format!(
            "#!/bin/sh\nexec unshare -m --propagation private sh -c 'umount {HYBRID_UNIFIED} && exec \"$0\" \"$@\"' {} \"$@\"\n",
            bin.display()
        ).as_bytes());
    script
}

/// SIGKILLs a wrapper started in its own process group, with its "runtime", and reaps it.
fn kill_group(wrapper: &mut std::process::Child) {
    // SAFETY: kill the wrapper's process group (the wrapper and its hanging "runtime").
    unsafe { libc::kill(-(wrapper.id() as i32), libc::SIGKILL) };
    let _ = wrapper.wait();
}

/// Whether process `pid` is alive (a zombie is not).
fn alive(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
}

/// The spec of the wrapper's own bundle for container `id`, which the runtime runs.
fn ours(s: &Setup, id: &str) -> Value {
    serde_json::from_slice(&fs::read(s.state_dir().join(id).join("bundle/config.json")).unwrap()).unwrap()
}

fn dev_source(config: &Value) -> Option<String> {
    config["mounts"]
        .as_array()?
        .iter()
        .find(|m| m["destination"] == "/dev")
        .and_then(|m| m["source"].as_str())
        .map(str::to_owned)
}

fn assert_ok(out: &Ran, what: &str, s: &Setup, id: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}\n--- container ---\n{}--- daemon log ---\n{}",
        out.status,
        out.stderr,
        s.stdout(),
        s.daemon_log(id)
    );
}

/// create, start, a container on the devremap `/dev`, its init's exit stopping the daemon,
/// and delete removing the rest.
fn create_start_delete(runtime: Runtime) {
    need_containers(runtime);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(runtime, json!({"devremap.io/enable": "true"}));
    s.ask_for_gpus();
    let id = format!("wrapped-{}-{}", runtime.name(), std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let original = fs::read(s.bundle.config_path()).unwrap();

    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_ok(&out, "create", &s, &id);
    let dir = s.state_dir().join(&id);
    let meta = fs::metadata(s.state_dir()).unwrap();
    assert_eq!((meta.mode() & 0o7777, meta.uid()), (0o700, 0), "the state dir is private to root");
    assert!(is_mounted(&dir.join("dev")), "no mount at {}", dir.display());
    assert_eq!(dev_source(&ours(&s, &id)).as_deref(), Some(arg(&dir.join("dev"))));
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original, "the caller's spec is never written");
    let daemon = s.daemon_pid(&id);

    let out = s.run(&["start", &id]);
    assert_ok(&out, "start", &s, &id);
    s.wait_line("ready");
    let stdout = s.stdout();
    assert!(stdout.contains("dev.fs: fuse\n"), "{stdout}");
    assert!(stdout.contains("nvidia1: 1:5\n") && stdout.contains("nvidia1.reads: 00000000\n"), "{stdout}");

    // The container's init exits: its daemon stops by itself, before anyone deletes it.
    let mut log = s.open_log(&id);
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    s.wait_line("done");
    wait_for("the daemon to stop when the container exits", || (!alive(daemon)).then_some(()));
    let log = std::io::read_to_string(&mut log).unwrap();
    assert!(log.contains("exited: stopping"), "{log}");
    assert!(!is_mounted(&dir.join("dev")));

    let out = s.run(&["delete", &id]);
    assert_ok(&out, "delete", &s, &id);
    s.wait_gone(&id);
}

/// Rule (issue 12.3): runc through the wrapper: create/start/delete on a devremap /dev, no
/// daemon left.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn runc_create_start_delete() {
    create_start_delete(Runtime::Runc);
}

/// Rule (issue 12.3): crun as the config's `runtime`, the same flow.
#[test]
#[ignore = "needs root, /dev/fuse, crun and busybox-static: runs a container"]
fn crun_create_start_delete() {
    create_start_delete(Runtime::Crun);
}

/// Bug (attack s4, F3): a container whose daemon was SIGKILLed between `create` and `start`
/// was started on a dead `/dev` (ENOTCONN). `start` (and `checkpoint`) refuses it, exit status
/// 1, naming the container and its gone daemon, without running the runtime's start (the
/// container stays created); `delete` still cleans everything up.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn start_refuses_a_container_whose_daemon_was_killed_after_create() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-dead-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let dir = s.state_dir().join(&id);
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_ok(&out, "create", &s, &id);
    let daemon = s.daemon_pid(&id);
    // SAFETY: kill(2) of the daemon this test's create started.
    assert_eq!(unsafe { libc::kill(daemon as i32, libc::SIGKILL) }, 0);
    wait_for("the killed daemon to be gone", || (!alive(daemon)).then_some(()));

    // Nor checkpointed (found from outside: CRIU failed on the dead mount, `Can't statfs fd`,
    // after the record was written into the image).
    let image = s.tmp.path().join("image");
    let out = s.run(&["checkpoint", "--image-path", arg(&image), &id]);
    assert_eq!(out.status.code(), Some(1), "checkpoint of a container on a dead /dev: {}", out.stderr);
    assert!(
        out.stderr.contains(&format!("container {id}: its devremap daemon is gone ("))
            && out.stderr.contains("not checkpointed"),
        "{}",
        out.stderr
    );
    assert!(!image.join("devremap-gpus.json").exists(), "a record was written");

    let out = s.run(&["start", &id]);
    assert_eq!(out.status.code(), Some(1), "start of a container on a dead /dev: {}", out.stderr);
    assert!(
        out.stderr.starts_with(&format!("devremap-runtime: error: container {id}: its devremap daemon is gone ("))
            && out.stderr.contains("devremapd.pid names no live devremapd of")
            && out.stderr.contains("not started"),
        "{}",
        out.stderr
    );
    let state = s.wrapper(&["state", &id]).output().unwrap();
    let state: Value = serde_json::from_slice(&state.stdout).unwrap_or_default();
    assert_eq!(state["status"], "created", "the runtime's start never ran");
    assert!(!s.stdout().contains("ready"), "the container ran: {}", s.stdout());

    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete", &s, &id);
    assert!(!dir.exists() && !is_mounted(&dir.join("dev")), "delete left {}", dir.display());
}

/// Bug (issue 31, found by the wrapper benchmark): a foreground `run` whose runtime was still
/// deleting its container when the container's keeper exited left the container's directory
/// for good: the node daemon, holding the wrapper's lock on it until the runtime exits, took
/// its own hold for a front end's and skipped the teardown. It now waits for its hold to go.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_runtime_that_outlives_its_container_still_leaves_nothing() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    // runc, then a while before it exits: the keeper is gone well before the runtime is.
    let runc = Runtime::Runc.binary().unwrap();
    let lingering = s.tmp.path().join("lingering-runc.sh");
    common::write_executable(
        &lingering,
        format!(
            "#!/bin/sh
{} \"$@\"; status=$?; sleep 1; exit $status\n",
            runc.display()
        )
        .as_bytes(),
    );
    s.set_config("runtime", arg(&lingering));
    let id = format!("wrapped-linger-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    let out = s.run(&["run", "--bundle", arg(s.bundle.dir()), &id]);
    assert_ok(&out, "run", &s, &id);
    assert!(s.stdout().contains("done\n"), "{}", s.stdout());
    s.wait_gone(&id);
}

/// Rule (issue 12.3): `run` in the foreground: the container runs on the devremap /dev, and
/// when it ends the daemon, its directory and the spec's patch are gone; `delete --force` of a
/// running container stops the daemon.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn runc_run_and_delete_force() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true", "devremap.io/prefer": "checkpoint"}));
    let original = fs::read(s.bundle.config_path()).unwrap();
    let id = format!("wrapped-run-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    let out = s.run(&["run", "--bundle", &bundle, &id]);
    assert_ok(&out, "run", &s, &id);
    assert!(s.stdout().contains("dev.fs: fuse\n") && s.stdout().contains("done\n"), "{}", s.stdout());
    s.wait_gone(&id);
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original, "the spec is as it was");

    // Detached, then deleted by force while it runs.
    fs::remove_file(s.bundle.xchg().join("go")).unwrap();
    let mut child = s
        .wrapper(&["run", "--detach", "--bundle", &bundle, &id])
        .stdout(append(&s.bundle.dir().join("stdout")))
        .spawn()
        .unwrap();
    let status = wait_for("run --detach", || child.try_wait().unwrap());
    assert!(status.success());
    s.wait_line("ready");
    let daemon = s.daemon_pid(&id);
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete --force", &s, &id);
    s.wait_gone(&id);
    wait_for("the daemon to stop", || (!alive(daemon)).then_some(()));
}

/// Rule (issue 17, the teardown that the benchmark's cuts must keep; issue 31): a create of an
/// id right after its delete (`podman restart`) can never have the old keeper unmount the new
/// mount or the old server write into the new directory: the delete is the runtime's, the old
/// keeper stops with the container, and a create that finds its directory still there stops
/// that keeper and waits for it before anything of the new container is set up; the new
/// container's mount stays.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn delete_waits_for_the_daemon_before_the_id_is_reused() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-reuse-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let dir = s.state_dir().join(&id);
    let server_pid = || {
        let state: Value = serde_json::from_slice(&fs::read(dir.join("state.json")).ok()?).ok()?;
        state["server_pid"].as_u64().map(|p| p as u32)
    };
    let mut old = Vec::new();
    for round in ["first", "second"] {
        let out = s.run(&["create", "--bundle", &bundle, &id]);
        assert_ok(&out, &format!("the {round} create"), &s, &id);
        let (daemon, server) = (s.daemon_pid(&id), wait_for("the server's pid in the state file", server_pid));
        assert!(alive(daemon) && alive(server));
        old.extend([daemon, server]);
        // No wait: the next create comes at once.
        let out = s.run(&["delete", "--force", &id]);
        assert_ok(&out, &format!("the {round} delete"), &s, &id);
    }
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_ok(&out, "the create after two deletes", &s, &id);
    for pid in old {
        wait_for("the earlier keepers and servers to be gone", || (!alive(pid)).then_some(()));
    }
    assert!(is_mounted(&dir.join("dev")) && alive(s.daemon_pid(&id)), "the new container's mount stays");
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "the last delete", &s, &id);
}

/// Rule (issue 12.3): a bad annotation or config is one clear error, also in the runtime's
/// `--log` where containerd reads it, and leaves no container, no daemon, no directory and the
/// spec as it was.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn bad_annotations_and_config_leave_nothing() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true", "devremap.io/device-map": "0-1"}));
    let id = format!("wrapped-bad-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let original = fs::read(s.bundle.config_path()).unwrap();
    let log = s.tmp.path().join("log.json");
    let out = s.run(&["--log", arg(&log), "--log-format", "json", "create", "--bundle", &bundle, &id]);
    let stderr = &out.stderr;
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("annotation devremap.io/device-map: ") && stderr.contains(arg(&s.bundle.config_path())),
        "{stderr}"
    );
    let logged: Value = serde_json::from_str(fs::read_to_string(&log).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(logged["level"], "error");
    assert!(logged["msg"].as_str().unwrap().contains("devremap.io/device-map"));
    s.wait_gone(&id);
    assert!(!s.run(&["state", &id]).status.success(), "the runtime knows no such container");
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);

    // A daemon that cannot start (its host dev directory is gone) undoes everything too.
    let mut spec = s.bundle.config();
    spec["annotations"] = json!({"devremap.io/enable": "true"});
    s.bundle.write_config(&spec);
    let original = fs::read(s.bundle.config_path()).unwrap();
    fs::rename(s.host.dev(), s.tmp.path().join("gone")).unwrap();
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stderr.contains("devremapd exited"), "{}", out.stderr);
    s.wait_gone(&id);
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);
    fs::rename(s.tmp.path().join("gone"), s.host.dev()).unwrap();

    // Bug (found in review): a devremapd that cannot be executed is named as such, not taken
    // for a daemon that exited with nothing in its log (the fds the wrapper closed before exec
    // included the pipe through which spawn reports a failed exec).
    let missing = s.tmp.path().join("no-such-devremapd");
    // The binary is the node daemon's to start (issue 31): none may run already.
    common::daemon::stop_node(&s.state_dir());
    let mut config: Value = serde_json::from_slice(&fs::read(&s.config).unwrap()).unwrap();
    config["devremapd"] = json!(arg(&missing));
    fs::write(&s.config, config.to_string()).unwrap();
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stderr.contains(&format!("cannot start {}: ", missing.display())), "{}", out.stderr);
    s.wait_gone(&id);
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);

    // A bad config: one line naming the file and the key.
    write_file(s.tmp.path(), "runtime.json", r#"{"state_dir": "relative"}"#);
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    let stderr = &out.stderr;
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr.trim_end(),
        format!("devremap-runtime: error: {}: state_dir: \"relative\" is not an absolute path", s.config.display())
    );
    assert!(!s.run(&["state", &id]).status.success());
}

/// Rule (issue 20): a restore whose record fails a check here (the `driver` check: recorded
/// under 535.129.03, this host runs 570.86.15) is refused before the runtime runs, in one line
/// naming the check and the image's record, and leaves nothing behind: no state directory, no
/// daemon, the spec as it was. `devremap.io/relax: driver` lets the same restore reach the
/// runtime.
#[test]
#[ignore = "needs root and /dev/fuse: starts the daemon"]
fn a_restore_failing_a_check_is_refused_before_the_runtime_runs() {
    need_fuse();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, Value::Null);
    s.ask_for_gpus();
    let version = s.host.root().join("proc/driver/nvidia/version");
    fs::create_dir_all(version.parent().unwrap()).unwrap();
    fs::write(&version, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Release Build\n").unwrap();
    let image = s.tmp.path().join("image");
    fs::create_dir(&image).unwrap();
    write_file(&image, "devremap-gpus.json", json!([{"minor": 0, "driver_version": "535.129.03"}]).to_string());
    // The runtime leaves a mark when it runs.
    let ran = s.marking_runtime(1);
    let id = format!("wrapped-check-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let original = fs::read(s.bundle.config_path()).unwrap();
    let restore = ["restore", "--image-path", arg(&image), "--bundle", &bundle, &id];
    let out = s.run(&restore);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("driver: saved nvidia0 was under driver 535.129.03, restored nvidia0 is under driver 570.86.15"),
        "{}",
        out.stderr
    );
    // The image's record, not the copy the node daemon read (found from outside: the copy was
    // named, and removed with the refusal).
    assert!(
        out.stderr.contains(&format!("error: {}: ", image.join("devremap-gpus.json").display()))
            && !out.stderr.contains(arg(&s.state_dir())),
        "{}",
        out.stderr
    );
    assert!(!ran.exists(), "the runtime ran");
    s.wait_gone(&id);
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);

    // `--image-path=`, empty, is runc's default `./checkpoint` (found from outside: the record
    // was read from the bundle).
    fs::rename(&image, s.tmp.path().join("checkpoint")).unwrap();
    let err_path = s.tmp.path().join("wrapper.stderr");
    let status = s
        .wrapper(&["restore", "--image-path=", "--bundle", &bundle, &id])
        .current_dir(s.tmp.path())
        .stderr(fs::File::create(&err_path).unwrap())
        .status()
        .unwrap();
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    let record = s.tmp.path().join("checkpoint/devremap-gpus.json");
    assert!(stderr.contains(&format!("error: {}: driver: ", record.display())), "{stderr}");
    assert!(!ran.exists(), "the runtime ran");
    s.wait_gone(&id);
    fs::rename(s.tmp.path().join("checkpoint"), &image).unwrap();

    let mut spec = s.bundle.config();
    spec["annotations"] = json!({"devremap.io/relax": "driver"});
    s.bundle.write_config(&spec);
    s.set_config("annotations", json!(["devremap.io/enable", "devremap.io/relax"]));
    let out = s.run(&restore);
    assert!(ran.exists(), "relaxed, the restore reaches the runtime: {}", out.stderr);
    s.wait_gone(&id); // the runtime failed: everything is undone
}

/// Bug (found from outside): the node daemon's refusal quotes its keeper's error line as the
/// keeper logged it, escaped, and the wrapper's line escaped it again: serde's `(\u0000-\u001F)`
/// for a record holding a raw NUL showed each backslash doubled twice. Escaped once, as
/// `devremapd plan` says it.
#[test]
#[ignore = "needs root and /dev/fuse: starts the daemon"]
fn a_refusal_quoting_a_keeper_is_escaped_once() {
    need_fuse();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, Value::Null);
    s.ask_for_gpus();
    let image = s.tmp.path().join("image");
    fs::create_dir(&image).unwrap();
    write_file(&image, "devremap-gpus.json", b"[{\"minor\": 0, \"model\": \"a\0b\"}]");
    let id = format!("wrapped-escaped-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let out = s.run(&["restore", "--image-path", arg(&image), "--bundle", arg(s.bundle.dir()), &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("control character (\\\\u0000-\\\\u001F)"), "{}", out.stderr);
    s.wait_gone(&id);
}

/// Bug (found from outside): a checkpoint image whose record (`devremap-gpus.json`) is not a
/// regular file (a FIFO, a directory) was passed over as if absent, and the container restored
/// with nothing remapped; one that is a symlink was followed and its target copied into the
/// state dir. The image is untrusted: each is refused, naming the file, before the runtime
/// runs, and nothing is left.
#[test]
#[ignore = "needs root and /dev/fuse: starts the daemon"]
fn a_record_that_is_not_a_regular_file_refuses_the_restore() {
    need_fuse();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, Value::Null);
    s.ask_for_gpus();
    let ran = s.marking_runtime(1);
    let outside = write_file(s.tmp.path(), "outside.json", json!([{"minor": 0}]).to_string());
    let bundle = arg(s.bundle.dir()).to_owned();
    for (kind, what) in [("fifo", "is a FIFO"), ("dir", "is a directory"), ("symlink", "is a symlink")] {
        let image = s.tmp.path().join(format!("image-{kind}"));
        fs::create_dir(&image).unwrap();
        let record = image.join("devremap-gpus.json");
        match kind {
            "fifo" => nix::unistd::mkfifo(&record, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap(),
            "dir" => fs::create_dir(&record).unwrap(),
            _ => std::os::unix::fs::symlink(&outside, &record).unwrap(),
        }
        let id = format!("record-{kind}-{}", std::process::id());
        let delete = Deleting(&s, id.clone());
        let out = s.run(&["restore", "--image-path", arg(&image), "--bundle", &bundle, &id]);
        assert_eq!(out.status.code(), Some(1), "{kind}: {}", out.stderr);
        assert!(out.stderr.contains(&format!("{}: {what}", record.display())), "{kind}: {}", out.stderr);
        assert!(!ran.exists(), "{kind}: the runtime ran: {}", out.stderr);
        s.wait_gone(&id);
        // The guard's `delete` runs the runtime, which leaves its mark.
        drop(delete);
        let _ = fs::remove_file(&ran);
    }
}

/// Bug (found from outside): a spec over the 16 MiB devremap reads, asking for devremap,
/// ran without it and without a word (the wrapper took the cut text for a spec it cannot
/// parse, the runtime's to refuse). It still runs as the runtime takes it, since devremap
/// cannot tell whether it was asked for, but the wrapper says why it did not serve `/dev`.
#[test]
#[ignore = "needs root and /dev/fuse: starts the daemon"]
fn a_spec_too_large_to_read_runs_without_devremap_saying_so() {
    need_fuse();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, Value::Null);
    s.ask_for_gpus();
    let ran = s.marking_runtime(0);
    let mut spec = s.bundle.config();
    spec["annotations"] = json!({"devremap.io/enable": "true", "padding": "x".repeat(17 << 20)});
    s.bundle.write_config(&spec);
    let id = format!("large-{}", std::process::id());
    let out = s.run(&["create", "--bundle", arg(s.bundle.dir()), &id]);
    assert!(ran.exists(), "the runtime runs it: {}", out.stderr);
    let said =
        format!("{}: over 16 MiB, the most devremap reads; running without devremap", s.bundle.config_path().display());
    assert!(out.stderr.contains(&said), "{}", out.stderr);
    s.wait_gone(&id);
}

/// Bug (issue 29.1): the image's `ENV` (in `process.env`, merged with `-e`) relaxed the checks:
/// `DEVREMAP_RELAX=mode` plus a record claiming 0666 restored a 0600 GPU as `crw-rw-rw-` under
/// its checkpoint name. Now the variable is not obeyed, only named in a warning, and the
/// `mode` check refuses the restore before the runtime runs. The launcher's annotation
/// `devremap.io/relax` is refused too, naming the config's `annotations`, unless the operator's
/// config lists it; the operator's own `relax` relaxes every restore.
#[test]
#[ignore = "needs root and /dev/fuse: starts the daemon"]
fn the_image_env_never_relaxes_a_check() {
    need_fuse();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut spec = oci_config("wrapped", &[]);
    spec["process"]["env"].as_array_mut().unwrap().push(json!("DEVREMAP_RELAX=mode"));
    let host = FakeHost::with_gpus(&[0, 1]);
    for n in ["nvidia0", "nvidia1"] {
        fs::set_permissions(host.dev().join(n), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    }
    let s = Setup::on_host(Runtime::Runc, host, &spec, SCRIPT);
    s.ask_for_gpus();
    let image = s.tmp.path().join("image");
    fs::create_dir(&image).unwrap();
    let record =
        json!([{"minor": 0, "mode": 0o666, "uid": 0, "gid": 0}, {"minor": 1, "mode": 0o666, "uid": 0, "gid": 0}]);
    write_file(&image, "devremap-gpus.json", record.to_string());
    let id = format!("wrapped-envrelax-{}", std::process::id());
    let probed = s.probing_runtime(&id, &["nvidia0", "nvidia1"]);
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let restore = ["restore", "--image-path", arg(&image), "--bundle", &bundle, &id];

    let out = s.run(&restore);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    let warning = format!(
        "devremap-runtime: warning: {}: process.env DEVREMAP_RELAX is not obeyed: the image's ENV may set it",
        arg(&s.bundle.config_path())
    );
    assert!(!probed.exists(), "the runtime ran on: {}", fs::read_to_string(&probed).unwrap_or_default());
    assert!(out.stderr.contains(&warning), "{}", out.stderr);
    assert!(
        out.stderr.contains("mode: saved nvidia0 was recorded 0666 0:0, more access than the 0600"),
        "{}",
        out.stderr
    );
    s.wait_gone(&id);

    // The launcher's annotation, which the default config does not let launchers set.
    let mut spec = s.bundle.config();
    spec["annotations"] = json!({"devremap.io/relax": "mode"});
    s.bundle.write_config(&spec);
    let out = s.run(&restore);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "devremap-runtime: error: {}: annotation devremap.io/relax: refused: the operator's runtime config does not \
             let launchers set it (its \"annotations\" list must name devremap.io/relax)",
            arg(&s.bundle.config_path())
        )),
        "{}",
        out.stderr
    );
    assert!(!probed.exists());
    s.wait_gone(&id);

    // The operator decides: letting launchers relax, or relaxing every restore itself.
    let relaxed = |how: &str| {
        let _ = fs::remove_file(&probed);
        let out = s.run(&restore);
        assert_eq!(out.status.code(), Some(1), "{how}: the probing runtime fails: {}", out.stderr);
        let served =
            fs::read_to_string(&probed).unwrap_or_else(|_| panic!("{how}: the runtime never ran: {}", out.stderr));
        assert!(served.contains("/nvidia0 1:3 666\n"), "{how}: {served}");
        s.wait_gone(&id);
    };
    s.set_config("annotations", json!(["devremap.io/enable", "devremap.io/relax"]));
    relaxed("the config's annotations list devremap.io/relax");
    s.set_config("annotations", json!([]));
    s.set_config("relax", "mode");
    let mut spec = s.bundle.config();
    spec["annotations"] = Value::Null;
    s.bundle.write_config(&spec);
    relaxed("the config's relax");
}

/// Bug (issue 29.2): `devremapd cuda-device-map --metadata M --spec S` ignored the spec's
/// `devremap.io/device-map`, which the wrapper's daemon obeys: the daemon served
/// `nvidia0 -> nvidia3, nvidia1 -> nvidia2` while the map said 0 -> 2, 1 -> 3, so CUDA would
/// restore each GPU's memory onto the other's name. Both now read the annotation through one
/// parser: the GPU behind each checkpoint name in the wrapper's `/dev` is the one the map gives
/// its saved UUID.
#[test]
#[ignore = "needs root and /dev/fuse: starts the daemon"]
fn cuda_device_map_and_the_wrappers_daemon_pair_alike() {
    need_fuse();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut spec = oci_config("wrapped", &[]);
    spec["annotations"] = json!({"devremap.io/device-map": "0=3,1=2"});
    let s = Setup::on_host(Runtime::Runc, FakeHost::with_described_gpus(&[2, 3]), &spec, SCRIPT);
    s.ask_for_gpus();
    let image = s.tmp.path().join("image");
    fs::create_dir(&image).unwrap();
    let saved = |m: u32| format!("GPU-5a7ed000-1111-4222-8333-{m:012}");
    let record = json!([{"minor": 0, "uuid": saved(0)}, {"minor": 1, "uuid": saved(1)}]);
    let metadata = write_file(&image, "devremap-gpus.json", record.to_string());
    let id = format!("wrapped-cudamap-{}", std::process::id());
    let probed = s.probing_runtime(&id, &["nvidia0", "nvidia1"]);
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();

    let out = s.run(&["restore", "--image-path", arg(&image), "--bundle", &bundle, &id]);
    let served = fs::read_to_string(&probed).unwrap_or_else(|_| panic!("the runtime never ran: {}", out.stderr));
    // Host GPU N has the fake rdev of nvidiaN: nvidia3 is 1:8, nvidia2 is 1:7.
    let dev = s.state_dir().join(&id).join("dev");
    assert_eq!(
        served,
        format!("{} 1:8 666\n{} 1:7 666\n", arg(&dev.join("nvidia0")), arg(&dev.join("nvidia1"))),
        "the daemon serves the annotation's pairs"
    );

    let (host_dev, host_root) = (s.host.dev(), s.host.root());
    let spec_path = s.bundle.config_path();
    let (code, stdout, stderr) = devremapd(&[
        "cuda-device-map",
        "--metadata",
        arg(&metadata),
        "--spec",
        arg(&spec_path),
        "--host-dev",
        arg(&host_dev),
        "--host-root",
        arg(&host_root),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let uuid = |m: u32| common::GpuFacts::nvidia(m).uuid;
    assert_eq!(stdout, format!("{}={},{}={}\n", saved(0), uuid(3), saved(1), uuid(2)), "{stderr}");
}

/// Rule (issue 12.3): a wrapper killed before the container started leaves no daemon behind
/// (it watches the wrapper until the runtime's pid file appears), and the next delete of that
/// id removes its directory.
#[test]
#[ignore = "needs root, /dev/fuse and busybox-static: starts the daemon"]
fn killed_wrapper_leaves_no_daemon() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    s.hanging_runtime();
    let id = format!("wrapped-killed-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let mut wrapper = s.wrapper(&["create", "--bundle", &bundle, &id]).process_group(0).spawn().unwrap();
    let pid_file = s.state_dir().join(&id).join("devremapd.pid");
    wait_for("the daemon to answer", || pid_file.exists().then_some(()));
    let daemon = s.daemon_pid(&id);
    let mut log = s.open_log(&id);
    kill_group(&mut wrapper);
    wait_for("the daemon to stop after its wrapper died", || (!alive(daemon)).then_some(()));
    let log = std::io::read_to_string(&mut log).unwrap();
    assert!(log.contains("exited before the container started"), "{log}");
    let out = s.run(&["delete", &id]);
    assert_eq!(out.status.code(), Some(1), "the runtime knows no such container");
    s.wait_gone(&id);
}

/// Bug (found from outside): the bundle's `config.json` stayed patched (its `/dev` mount on
/// the devremap mount, gone with the container) after `create` -> `delete`; later (issue 17.7)
/// two containers created from one bundle and deleted in creation order left it pointing at
/// the first one's removed `dev/`. Now the caller's bundle is never written: the runtime runs
/// the wrapper's own bundle, whose spec's rootfs is the caller's, so the spec stays the same
/// bytes, mode and owner through create, run and delete of any number of containers.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn the_callers_spec_is_never_written() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let ids: Vec<String> = (0..2).map(|n| format!("wrapped-onebundle{n}-{}", std::process::id())).collect();
    let _delete: Vec<Deleting> = ids.iter().map(|id| Deleting(&s, id.clone())).collect();
    let bundle = arg(s.bundle.dir()).to_owned();
    let spec = s.bundle.config_path();
    // Not pretty-printed as the wrapper writes it, and not the mode and owner a new file gets.
    fs::write(&spec, s.bundle.config().to_string()).unwrap();
    fs::set_permissions(&spec, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(&spec, Some(1000), Some(44)).unwrap();
    let original = fs::read(&spec).unwrap();

    for id in &ids {
        let out = s.run(&["create", "--bundle", &bundle, id]);
        assert_ok(&out, "create", &s, id);
        assert_eq!(dev_source(&ours(&s, id)).as_deref(), Some(arg(&s.state_dir().join(id).join("dev"))));
        assert_eq!(ours(&s, id)["root"]["path"], arg(&s.bundle.dir().join("rootfs")), "the caller's rootfs");
    }
    for id in &ids {
        let out = s.run(&["start", id]);
        assert_ok(&out, "start", &s, id);
    }
    wait_for("both containers to report", || (s.stdout().matches("dev.fs: fuse\n").count() == 2).then_some(()));
    for id in &ids {
        let out = s.run(&["delete", "--force", id]);
        assert_ok(&out, "delete", &s, id);
        s.wait_gone(id);
        assert_eq!(fs::read(&spec).unwrap(), original, "the caller's spec is as it was");
    }
    let meta = fs::metadata(&spec).unwrap();
    assert_eq!((meta.mode() & 0o7777, meta.uid(), meta.gid()), (0o640, 1000, 44));
}

/// Bug (found from outside): a wrapper SIGKILLed between setting up and the runtime's end left
/// its directory (and once the bundle's spec patched for good). Now the next `create` of that
/// id, or a `delete`, tears the leftover down (unless the node daemon already did, once the
/// keeper ended with its owner: CI with burners saw both); the caller's spec was never touched.
#[test]
#[ignore = "needs root, /dev/fuse and busybox-static: starts the daemon"]
fn killed_wrapper_leftover_is_torn_down() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-killspec-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let original = fs::read(s.bundle.config_path()).unwrap();
    let kill_set_up = || {
        s.hanging_runtime();
        let mut wrapper = s.wrapper(&["create", "--bundle", &bundle, &id]).process_group(0).spawn().unwrap();
        let pid_file = s.state_dir().join(&id).join("devremapd.pid");
        wait_for("the daemon to answer", || pid_file.exists().then_some(()));
        let daemon = s.daemon_pid(&id);
        kill_group(&mut wrapper);
        wait_for("the daemon to stop after its wrapper died", || (!alive(daemon)).then_some(()));
        // What is left (the node daemon may already have removed it, once the keeper ended
        // with its owner) goes at the next create or delete.
        assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);
    };

    // The next create (its runtime fails at once) tears it down.
    kill_set_up();
    s.set_config("runtime", "/bin/false");
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    s.wait_gone(&id);

    // A delete of the id does too.
    kill_set_up();
    let out = s.run(&["delete", &id]);
    assert_eq!(out.status.code(), Some(1), "the runtime knows no such container");
    s.wait_gone(&id);
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);
}

/// Bug (found from outside): an existing `state_dir` that was not mode 0700 was chmod'ed to
/// 0700: a hurried operator's `"state_dir": "/tmp"` (or `/run`) took the sticky, world-writable
/// `/tmp` away from every other user. An existing state dir is now checked, never changed: one
/// that others can write into is refused, and one they can only read is used as it is.
#[test]
#[ignore = "needs root and runc: runs the wrapper's create"]
fn existing_state_dir_is_never_chmoded() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    // A runtime that fails at once, should the wrapper get that far.
    s.set_config("runtime", "/bin/false");
    let id = format!("wrapped-chmod-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let original = fs::read(s.bundle.config_path()).unwrap();
    let shared = s.tmp.path().join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    s.set_config("state_dir", arg(&shared));
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "state_dir {}: writable by group or others; refused: set the config's state_dir to",
            shared.display()
        )),
        "{}",
        out.stderr
    );
    assert_eq!(fs::metadata(&shared).unwrap().mode() & 0o7777, 0o1777, "the directory is left as it was");
    assert!(!shared.join(&id).exists());
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);

    // Readable by others but writable only by root: used as it is.
    fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    s.hanging_runtime();
    let mut wrapper = s.wrapper(&["create", "--bundle", &bundle, &id]).process_group(0).spawn().unwrap();
    let pid_file = shared.join(&id).join("devremapd.pid");
    wait_for("the daemon to answer", || pid_file.exists().then_some(()));
    assert_eq!(fs::metadata(&shared).unwrap().mode() & 0o7777, 0o755);
    assert_eq!(fs::metadata(shared.join(&id)).unwrap().mode() & 0o7777, 0o700);
    kill_group(&mut wrapper);
    let _ = s.run(&["delete", &id]);
    let dir = shared.join(&id);
    wait_for("the node daemon to remove the directory", || (!dir.exists()).then_some(()));
}

/// Bug (found from outside): a second `create` of an id whose first `create` was still in the
/// runtime took the first one's directory for a killed wrapper's leftover (the runtime did not
/// know the id yet) and tore it down, stopping the daemon under the first container; a
/// `delete` of the id meanwhile did the same. Now the second is refused, the delete leaves it.
#[test]
#[ignore = "needs root, /dev/fuse and busybox-static: starts the daemon"]
fn concurrent_create_of_one_id() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    s.hanging_runtime();
    let id = format!("wrapped-twice-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let mut first = s.wrapper(&["create", "--bundle", &bundle, &id]).process_group(0).spawn().unwrap();
    let dir = s.state_dir().join(&id);
    wait_for("the daemon to answer", || dir.join("devremapd.pid").exists().then_some(()));
    let daemon = s.daemon_pid(&id);

    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("container {id}: another devremap-runtime is setting it up")),
        "{}",
        out.stderr
    );
    assert!(alive(daemon) && is_mounted(&dir.join("dev")), "the first create's daemon is left alone");
    let out = s.run(&["delete", &id]);
    assert_eq!(out.status.code(), Some(1), "the runtime knows no such container");
    assert!(alive(daemon) && is_mounted(&dir.join("dev")), "delete leaves a create in progress alone");

    kill_group(&mut first);
    wait_for("the daemon to stop after its wrapper died", || (!alive(daemon)).then_some(()));
    let _ = s.run(&["delete", &id]);
    wait_for("the node daemon to remove the directory", || (!dir.exists()).then_some(()));
}

/// Bug (found from outside): ids are unique per runtime root only (containerd gives each
/// namespace its own `--root`), but the state dir is keyed by id: a `create` under another root
/// found the running container's directory, asked its own root, was told no such container,
/// and tore down the running container's daemon; a `delete` under the other root did too. Now
/// the create is refused, naming the root, and the delete leaves it.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn one_id_under_two_runtime_roots() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-roots-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_ok(&out, "create", &s, &id);
    let dir = s.state_dir().join(&id);
    let daemon = s.daemon_pid(&id);

    // The last `--root` wins, for runc as for the wrapper.
    let other = s.tmp.path().join("other-root");
    let out = s.run(&["--root", arg(&other), "create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!(
            "the id is in use by a devremap container of runtime root {:?}",
            arg(&s.bundle.state_root())
        )),
        "{}",
        out.stderr
    );
    let out = s.run(&["--root", arg(&other), "delete", &id]);
    assert_eq!(out.status.code(), Some(1), "runc under the other root knows no such container");
    assert!(alive(daemon) && is_mounted(&dir.join("dev")), "the running container's daemon is left alone");
    assert!(s.run(&["state", &id]).status.success());
}

/// Bug (found from outside): `runc create ID` (runc's default root) and `runc --root
/// /run/runc start ID` name one container to runc, but the wrapper keyed the first by no root
/// and took the second for another root's: it did not check the container's `/dev` before the
/// start, wrote no record at a checkpoint, and left a dead keeper's directory at `delete`.
/// `--root` naming the runtime's default is now no root given, however spelled (a second
/// attack: `/var/run/runc`, through `/var/run -> /run`, still was another). And another root's
/// create of the id names the default root in words, not as `runtime root ""`.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn the_runtimes_default_root_named_is_the_same_root() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-default-root-{}", std::process::id());
    let default = Path::new("/run/runc");
    let _delete = DeletingUnder(&s, default.to_owned(), id.clone());
    let err_path = s.tmp.path().join("wrapper.stderr");
    let status = Command::new(WRAPPER)
        .env(devremap_config_env(), &s.config)
        .env_remove("RUST_LOG")
        .env_remove("XDG_RUNTIME_DIR")
        .args(["create", "--bundle", arg(s.bundle.dir()), &id])
        .stdin(Stdio::null())
        .stdout(append(&s.bundle.dir().join("stdout")))
        .stderr(fs::File::create(&err_path).unwrap())
        .status()
        .unwrap();
    assert_ok(&Ran { status, stderr: fs::read_to_string(&err_path).unwrap() }, "create", &s, &id);
    assert!(default.join(&id).exists(), "runc keeps it under its default root");
    let dir = s.state_dir().join(&id);
    let daemon = s.daemon_pid(&id);
    // Another root's create of the id names the default root in words (it read `runtime root
    // ""`, found from outside).
    let other = s.tmp.path().join("other-root");
    let out = s.run(&["--root", arg(&other), "create", "--bundle", arg(s.bundle.dir()), &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("the id is in use by a devremap container of the runtime's default root (no --root)"),
        "{}",
        out.stderr
    );
    // SAFETY: kill(2) of the keeper this test's create started.
    assert_eq!(unsafe { libc::kill(daemon as i32, libc::SIGKILL) }, 0);
    wait_for("the killed keeper to be gone", || (!alive(daemon)).then_some(()));

    // Spelled through a symlink too, as Debian's `/var/run -> /run` makes it.
    let spelled =
        if fs::canonicalize("/var/run/runc").is_ok_and(|p| p == default) { "/var/run/runc" } else { "/run/runc" };
    let out = s.run(&["--root", spelled, "start", &id]);
    assert_eq!(out.status.code(), Some(1), "start of a container on a dead /dev: {}", out.stderr);
    assert!(out.stderr.contains("its devremap daemon is gone"), "{}", out.stderr);
    let out = s.run(&["--root", arg(default), "delete", "--force", &id]);
    assert_ok(&out, "delete under the default root named", &s, &id);
    assert!(!default.join(&id).exists(), "runc deleted it");
    assert!(!dir.exists() && !is_mounted(&dir.join("dev")), "delete left {}", dir.display());
}

/// Bug (found from outside): runc takes `--root ''` for its working directory, which for a
/// devremap container is the wrapper's own bundle, so the container's runtime state went into
/// `<state_dir>/<id>/bundle/<id>` and with devremap's directory. The wrapper refuses an empty
/// root for a devremap container, naming the flag, and leaves nothing behind; for an id whose
/// container runs, before it looks at the id's directory.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn an_empty_runtime_root_is_refused() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-empty-root-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    // Where the runtime kept the container made before the refusal.
    let _delete = DeletingUnder(&s, s.state_dir().join(&id).join("bundle"), id.clone());
    for root in [&["--root", ""][..], &["--root="]] {
        let out = s.run(&[root, &["create", "--bundle", &bundle, &id]].concat());
        assert_eq!(out.status.code(), Some(1), "{root:?}: {}", out.stderr);
        assert!(out.stderr.contains("--root: empty; name the runtime's state directory"), "{}", out.stderr);
        assert!(!s.state_dir().join(&id).exists(), "{root:?}: the id's directory is left");
    }
    // An id with a directory: refused before the claim, which waited 5 s for its keeper and
    // then refused it as still served (found from outside).
    let _delete_made = Deleting(&s, id.clone());
    assert_ok(&s.run(&["create", "--bundle", &bundle, &id]), "create", &s, &id);
    let daemon = s.daemon_pid(&id);
    for root in [&["--root", ""][..], &["--root="]] {
        let out = s.run(&[root, &["create", "--bundle", &bundle, &id]].concat());
        assert_eq!(out.status.code(), Some(1), "{root:?}: {}", out.stderr);
        assert!(out.stderr.contains("--root: empty; name the runtime's state directory"), "{}", out.stderr);
        assert!(alive(daemon) && is_mounted(&s.state_dir().join(&id).join("dev")), "{root:?}");
    }
}

/// Bug (found from outside): a node daemon the wrapper started that could not start (here a
/// regular file where its socket goes) said why only in `node.log`; the client's user saw "no
/// node daemon answers". The wrapper's error now ends with the daemon's own `error:` line.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_node_daemon_that_cannot_start_says_why_through_the_wrapper() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-no-node-{}", std::process::id());
    fs::create_dir_all(s.state_dir()).unwrap();
    fs::set_permissions(s.state_dir(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    fs::write(s.state_dir().join("node.sock"), "").unwrap();
    let out = s.run(&["create", "--bundle", arg(s.bundle.dir()), &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("no node daemon answers")
            && out.stderr.contains("; the node daemon started for it exited: ")
            && out.stderr.contains("node.sock: is a regular file, not a socket; refused"),
        "{}",
        out.stderr
    );
    assert!(!s.state_dir().join(&id).exists(), "the id's directory is left");
}

/// Bug (found from outside): the wrapper waited for the node daemon it started with no
/// deadline, so one that never got to answer (a FIFO as its lock; stopped; stuck on its state
/// dir's file system) held the start, and `docker run`, for good. After the mount's patience
/// (60 s) the start fails, naming the socket and the daemon's log, and leaves no directory.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_node_daemon_that_never_answers_fails_the_start_in_time() {
    need_containers(Runtime::Runc);
    common::need_test_hooks();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-stalled-node-{}", std::process::id());
    let _stalled = NodeDaemonsOf(s.state_dir());
    let err_path = s.tmp.path().join("wrapper.stderr");
    let status = s
        .wrapper(&["create", "--bundle", arg(s.bundle.dir()), &id])
        .env("DEVREMAPD_FAILPOINT", "node-start-stall")
        .stdout(append(&s.bundle.dir().join("stdout")))
        .stderr(fs::File::create(&err_path).unwrap())
        .status()
        .unwrap();
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "node.sock: the node daemon started for it did not answer within 60 s (stopped, or stuck?); see "
        ) && stderr.contains("node.log"),
        "{stderr}"
    );
    assert!(!s.state_dir().join(&id).exists(), "the id's directory is left");
}

/// SIGKILLs, on drop, every `devremapd node` of state dir `.0`.
struct NodeDaemonsOf(PathBuf);

impl Drop for NodeDaemonsOf {
    fn drop(&mut self) {
        let state_dir = arg(&self.0).to_owned();
        for entry in fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
            let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            if args.get(1) == Some(&&b"node"[..]) && args.contains(&state_dir.as_bytes()) {
                // SAFETY: kill(2) of a node daemon this test's wrapper started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

/// Bug (found from outside): a start on a full state dir failed with "cannot write: no space
/// left on device; and <dir>: no such file or directory": the directory the start made was
/// removed twice, and the second try's error was added to the first (whose "no such file or
/// directory" also made Docker call the runtime not found, exit 127). Only the first is said.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_full_state_dir_is_said_once() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let full = common::daemon::Tmpfs::mount(&s.tmp.path().join("full"), "size=64k");
    full.fill("filler");
    s.set_config("state_dir", arg(&full.0));
    let id = format!("wrapped-full-{}", std::process::id());
    let out = s.run(&["create", "--bundle", arg(s.bundle.dir()), &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("no space left on device"), "{}", out.stderr);
    assert!(!out.stderr.contains("no such file or directory"), "{}", out.stderr);
    assert!(!full.0.join(&id).exists(), "the id's directory is left");
}

/// Bug (found from outside): the runtime resolves a relative `--root` against its working
/// directory, but the wrapper recorded and compared it as typed, so `--root rr` from two
/// directories was taken for one root: the second `create` of an id, finding the first's
/// container unknown to its own runc, took its directory for a leftover and tore down the
/// running container's `/dev` (7 times in 7). Now roots are keyed absolute and cleaned: the
/// second is refused, naming the first's root, and the same root spelled otherwise is one.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_relative_runtime_root_is_the_callers() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-relative-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let (a, b) = (s.tmp.path().join("a"), s.tmp.path().join("b"));
    fs::create_dir(&a).unwrap();
    fs::create_dir(&b).unwrap();
    let run_in = |dir: &Path, args: &[&str]| {
        let err_path = s.tmp.path().join("wrapper.stderr");
        let status = s
            .wrapper(&[&["--root", "rr"], args].concat())
            .current_dir(dir)
            .stdout(append(&s.bundle.dir().join("stdout")))
            .stderr(fs::File::create(&err_path).unwrap())
            .status()
            .unwrap();
        Ran { status, stderr: fs::read_to_string(&err_path).unwrap() }
    };
    let _delete = DeletingUnder(&s, a.join("rr"), id.clone());
    // A failing run (the bug) makes the id's container under b's root too.
    let _delete_b = DeletingUnder(&s, b.join("rr"), id.clone());
    let out = run_in(&a, &["create", "--bundle", &bundle, &id]);
    assert_ok(&out, "create", &s, &id);
    let dir = s.state_dir().join(&id);
    let daemon = s.daemon_pid(&id);

    let out = run_in(&b, &["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    let theirs = format!("runtime root {:?}", arg(&a.join("rr")));
    assert!(out.stderr.contains(&theirs), "{}", out.stderr);
    assert!(alive(daemon) && is_mounted(&dir.join("dev")), "the running container's daemon is left alone");
    assert!(fs::read_dir(dir.join("dev")).is_ok(), "and its /dev answers");

    // The same root, spelled otherwise: the runtime's own refusal, not another root's.
    let out = s.run(&["--root", &format!("{}/./rr/", arg(&a)), "create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(!out.stderr.contains("runtime root"), "{}", out.stderr);
    assert!(alive(daemon) && is_mounted(&dir.join("dev")));
}

/// Bug (found from outside): runc resolves a relative `--root` against the shell's logical
/// `$PWD` (Go's `os.Getwd`), the wrapper against the physical working directory: from a
/// directory reached through a symlink, `--root ../rr` named two roots, and a `create` of the
/// id under the one the wrapper had recorded (another, empty runc root) took the running
/// container's directory for a leftover and tore its `/dev` down (3 of 3; crun, which resolves
/// physically, the same with `SYMLINK/../root`). Whatever a root's spelling, a directory whose
/// keeper still serves is never torn down: the claim waits for a stopping keeper, then refuses.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_running_containers_dev_is_never_torn_down_for_a_root_spelled_otherwise() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-spelled-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let deep = s.tmp.path().join("deep/a/b");
    fs::create_dir_all(&deep).unwrap();
    let link = s.tmp.path().join("link");
    std::os::unix::fs::symlink(&deep, &link).unwrap();
    let err_path = s.tmp.path().join("wrapper.stderr");
    // As a shell in `link` runs it: its `$PWD` is the logical path.
    let status = s
        .wrapper(&["--root", "../rr", "create", "--bundle", &bundle, &id])
        .current_dir(&link)
        .env("PWD", &link)
        .stdout(append(&s.bundle.dir().join("stdout")))
        .stderr(fs::File::create(&err_path).unwrap())
        .status()
        .unwrap();
    let out = Ran { status, stderr: fs::read_to_string(&err_path).unwrap() };
    let runc_root = s.tmp.path().join("rr");
    let _delete = DeletingUnder(&s, runc_root.clone(), id.clone());
    // A failing run (the bug) makes the id's container under the other root too.
    let other_root = s.tmp.path().join("deep/a/rr");
    let _delete_other = DeletingUnder(&s, other_root.clone(), id.clone());
    assert_ok(&out, "create", &s, &id);
    assert!(runc_root.join(&id).exists(), "runc keeps it under the logical path");
    let dir = s.state_dir().join(&id);
    let daemon = s.daemon_pid(&id);

    // The root the wrapper resolved, another runc root, empty: the runtime does not know the id.
    let out = s.run(&["--root", arg(&other_root), "create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains(&format!("its devremap /dev is still served (keeper pid {daemon})")), "{}", out.stderr);
    assert!(alive(daemon) && is_mounted(&dir.join("dev")), "the running container's keeper is left alone");
}

/// Bug (found from outside: `docker restart` after a `SIGSTOP` of the keeper): a directory whose
/// keeper is stopped, and so cannot end with its container, was refused as served for a
/// container of another runtime root or a root spelled otherwise, sending the operator to look
/// there. The refusal names the stopped keeper and how to continue or end it; the keeper is
/// left alone, and once continued it ends with its container.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_stopped_keeper_is_named_as_stopped_when_its_id_is_created_again() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-stopped-keeper-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let _delete = Deleting(&s, id.clone());
    assert_ok(&s.run(&["create", "--bundle", &bundle, &id]), "create", &s, &id);
    let keeper = s.daemon_pid(&id);
    let stopped = Stopped::new(keeper);
    // The runtime forgets the container behind the wrapper's back, as a client's own delete
    // does; the stopped keeper cannot see its container go.
    let deleted = Command::new("runc")
        .arg("--root")
        .arg(s.bundle.state_root())
        .args(["delete", "--force", &id])
        .status()
        .unwrap();
    assert!(deleted.success(), "runc delete --force");

    let out = s.run(&["create", "--bundle", &bundle, &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains(&format!("served by keeper pid {keeper}, which is stopped")), "{}", out.stderr);
    assert!(out.stderr.contains(&format!("kill -CONT {keeper}")), "{}", out.stderr);
    assert!(!out.stderr.contains("another runtime root"), "{}", out.stderr);
    assert!(alive(keeper), "the stopped keeper is left alone");
    drop(stopped);
    wait_for("the continued keeper to end with its container", || (!alive(keeper)).then_some(()));
}

/// Bug (found from outside): a node daemon removes a container's directory a moment after the
/// runtime's caller has seen the container go (its keeper sees the init exit, then the runtime
/// holding the lock), and a `create` of the id under another runtime root in that moment was
/// refused as in use by the first root's container (16 times in 20 after a foreground `run`).
/// Now such a claim looks again for a moment, with the state dir's lock let go, and the
/// directory's removal lets it through.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs containers"]
fn an_id_is_free_for_another_root_as_soon_as_its_container_is_gone() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-handed-on-{}", std::process::id());
    let bundle = arg(s.bundle.dir()).to_owned();
    let other = s.tmp.path().join("other-root");
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    for round in 0..5 {
        let out = s.run(&["run", "--bundle", &bundle, &id]);
        assert_ok(&out, &format!("round {round}: run"), &s, &id);
        let out = s.run(&["--root", arg(&other), "create", "--bundle", &bundle, &id]);
        assert_ok(&out, &format!("round {round}: create under another root"), &s, &id);
        let out = s.run(&["--root", arg(&other), "delete", "--force", &id]);
        assert_ok(&out, &format!("round {round}: delete"), &s, &id);
        s.wait_gone(&id);
    }
}

/// Bug (found from outside): a bundle whose `config.json` is a symlink (runc follows it) lost
/// the link when the wrapper patched the spec in place; then such specs were refused. Now the
/// caller's spec is never written: a linked spec runs as runc runs it, and the link stays. A
/// linked bundle directory runs too.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn symlinked_spec_runs_and_is_kept() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-link-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let real = s.bundle.dir().join("real.json");
    fs::rename(s.bundle.config_path(), &real).unwrap();
    std::os::unix::fs::symlink("real.json", s.bundle.config_path()).unwrap();
    let original = fs::read(&real).unwrap();
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    let out = s.run(&["run", "--bundle", &bundle, &id]);
    assert_ok(&out, "run", &s, &id);
    assert!(s.stdout().contains("dev.fs: fuse\n"), "{}", s.stdout());
    assert!(fs::symlink_metadata(s.bundle.config_path()).unwrap().file_type().is_symlink(), "the link is kept");
    assert_eq!(fs::read(&real).unwrap(), original);
    s.wait_gone(&id);

    // A bundle reached through a symlink (found from outside: runc refused the rootfs the
    // wrapper wrote through the link, `invalid rootfs: not an absolute path, or a symlink`).
    let link = s.tmp.path().join("bundle-link");
    std::os::unix::fs::symlink(s.bundle.dir(), &link).unwrap();
    let out = s.run(&["run", "--bundle", arg(&link), &id]);
    assert_ok(&out, "run through a linked bundle", &s, &id);
    s.wait_gone(&id);
}

/// Bug (found from outside): a config whose `runtime` is `devremap-runtime` itself (a hurried
/// `"runtime": "/usr/local/bin/devremap-runtime"`) made every command exec the wrapper again,
/// forever, instead of failing. Now it is one clear error naming the config.
#[test]
fn runtime_that_is_the_wrapper_itself_is_refused() {
    let tmp = TempDir::new().unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(WRAPPER, &link).unwrap();
    for runtime in [WRAPPER, arg(&link)] {
        let config = write_file(tmp.path(), "runtime.json", json!({"runtime": runtime}).to_string());
        let err = tmp.path().join("stderr");
        let child = Command::new(WRAPPER)
            .env(devremap_config_env(), &config)
            .args(["state", "x"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let mut child = Killed(child);
        let status = wait_for("the wrapper to exit", || child.0.try_wait().unwrap());
        let stderr = fs::read_to_string(&err).unwrap();
        assert_eq!(status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("{}: runtime: ", config.display()))
                && stderr.contains("is devremap-runtime itself"),
            "{stderr}"
        );
    }
}

/// Bug (found from outside): a config whose `runtime` is an absolute path where nothing is, or
/// holds a NUL byte, failed every command with `cannot run /nonexistent/runc: ...`, naming no
/// file: the operator was not told which config to fix. Now the error names the config.
#[test]
fn a_runtime_that_cannot_be_is_named_with_its_config() {
    let tmp = TempDir::new().unwrap();
    for (runtime, says) in [
        ("/nonexistent/runc", "runtime: /nonexistent/runc: no such file or directory"),
        ("ru\u{0}nc", "runtime: holds a NUL byte"),
    ] {
        let config = write_file(tmp.path(), "runtime.json", json!({"runtime": runtime}).to_string());
        let out = Command::new(WRAPPER).env(devremap_config_env(), &config).args(["state", "x"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(&format!("{}: {says}", config.display())), "{stderr}");
    }
}

/// A child killed (and reaped) when dropped, so a failing test leaves no process behind.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the wrapper as `docker run -d` and `podman run -d` run the runtime: stdin the host's
/// `/dev/null` (no `-i`), stdout and stderr a pipe into a `cat` appending to the bundle's
/// `stdout`. Returns the wrapper's status and the `cat`, to be reaped by the caller.
fn run_on_pipes(s: &Setup, args: &[&str]) -> (ExitStatus, std::process::Child) {
    let mut cat = Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(append(&s.bundle.dir().join("stdout")))
        .spawn()
        .expect("cat runs");
    let pipe = std::os::fd::OwnedFd::from(cat.stdin.take().unwrap());
    let status = s
        .wrapper(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(pipe.try_clone().unwrap()))
        .stderr(Stdio::from(pipe))
        .status()
        .expect("the wrapper runs");
    (status, cat)
}

/// The last error lines of a CRIU log in the image directory, for failure messages.
fn criu_log(image: &Path, name: &str) -> String {
    let text = fs::read_to_string(image.join(name)).unwrap_or_default();
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("Error") || l.contains("rror (")).collect();
    format!("{name}: {}", errors[errors.len().saturating_sub(8)..].join("\n"))
}

/// The container holds the checkpoint name `/dev/nvidia1` open on fd 3, then, after
/// `/xchg/go`, reports where fd 3 and a reopen lead.
const CRIU_SCRIPT: &str = r#"#!/bin/sh
exec 3<> /dev/nvidia1
echo "before fd3: $(stat -L -c '%t:%T' /proc/self/fd/3)"
echo ready
while [ ! -e /xchg/go ]; do sleep 0.05; done
echo "after fd3: $(stat -L -c '%t:%T' /proc/self/fd/3)"
echo "after reopen: $(stat -c '%t:%T %a' /dev/nvidia1)"
if (echo x >&3) 2>/dev/null; then echo "after fd3.write: ok"; else echo "after fd3.write: refused"; fi
echo done
"#;

/// Rule (issue 12.3): runc checkpoint and restore through the wrapper with a real CRIU. The
/// container holds GPU 1 (zero, 1:5) open by its name; `checkpoint` records it in the image;
/// the host then has GPU 2 (full, 1:7) instead, and `restore` pairs saved GPU 1 with it: the
/// restored descriptor and a reopen of `/dev/nvidia1` both reach full.
///
/// Bug (issue 17.2): run detached with stdin the host's `/dev/null` (`docker run -d`), the
/// checkpoint failed: "Can't lookup mount=N for fd=0 path=/dev/null" (runc reopens such stdio
/// only when it builds `/dev`). Bug (issue 17.10): the daemon read its metadata from the
/// client's checkpoint directory, which containerd removes: with the image gone, a reload
/// still loads every input.
/// A container of [`CRIU_SCRIPT`] that asks for GPUs, on a host with GPU 1 (zero, 1:5) alone.
fn criu_setup() -> Setup {
    let s = Setup::with_script(Runtime::Runc, json!({"devremap.io/enable": "true"}), CRIU_SCRIPT);
    s.ask_for_gpus();
    fs::remove_file(s.host.dev().join("nvidia0")).unwrap();
    s
}

/// Container `id` of `s` run detached through the wrapper with CRIU at `criu`, checkpointed
/// into `image` and restored from it, each step asserted to succeed.
struct Criu<'a> {
    s: &'a Setup,
    id: &'a str,
    criu: &'a Path,
    image: PathBuf,
}

impl Criu<'_> {
    fn with_criu(&self, args: &[&str]) -> Vec<String> {
        ["--criu", arg(self.criu)].into_iter().chain(args.iter().copied()).map(String::from).collect()
    }

    /// `run --detach`, once the container says `ready`; returns its stdin's writer.
    fn run(&self) -> std::process::Child {
        let (s, id) = (self.s, self.id);
        let args = self.with_criu(&["run", "--detach", "--bundle", arg(s.bundle.dir()), id]);
        let (status, cat) = run_on_pipes(s, &args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(status.success(), "run --detach: {status}\n{}\n{}", s.stdout(), s.daemon_log(id));
        s.wait_line("ready");
        cat
    }

    /// `checkpoint`; returns the record the wrapper wrote into the image.
    fn checkpoint(&self) -> Value {
        let (s, id) = (self.s, self.id);
        let args = self.with_criu(&["checkpoint", "--image-path", arg(&self.image), id]);
        let out = s.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_ok(&out, &format!("checkpoint ({})", criu_log(&self.image, "dump.log")), s, id);
        assert!(!out.stderr.contains("recorded without uuid"), "the client is shown a host's fact: {}", out.stderr);
        serde_json::from_slice(&fs::read(self.image.join("devremap-gpus.json")).unwrap()).unwrap()
    }

    /// [`Criu::checkpoint`], once the keeper has ended with its container; then the restore
    /// host: GPU 1 is gone, GPU 2 (full, 1:7) is there. Returns the record.
    fn checkpoint_for_gpu_2(&self) -> Value {
        let daemon = self.s.daemon_pid(self.id);
        let recorded = self.checkpoint();
        wait_for("the daemon to stop with its checkpointed container", || (!alive(daemon)).then_some(()));
        fs::remove_file(self.s.host.dev().join("nvidia1")).unwrap();
        self.s.host.node("nvidia2", fake_rdev(2));
        recorded
    }

    /// `restore --detach`; returns the restored container's stdin's writer.
    fn restore(&self) -> std::process::Child {
        let (s, id) = (self.s, self.id);
        let args = self.with_criu(&[
            "restore",
            "--detach",
            "--image-path",
            arg(&self.image),
            "--bundle",
            arg(s.bundle.dir()),
            id,
        ]);
        let (status, cat) = run_on_pipes(s, &args.iter().map(String::as_str).collect::<Vec<_>>());
        let log = criu_log(&self.image, "restore.log");
        assert!(status.success(), "restore: {status}\n{log}\n{}\n{}", s.stdout(), s.daemon_log(id));
        cat
    }
}

/// Bug (issue 30.4): on this host, whose driver files give no uuid, every checkpoint printed
/// `warning: ... GPU nvidia1 recorded without uuid` to the client (Podman shows it on each
/// `container checkpoint`); it goes to the runtime's `--log` alone ([`Criu::checkpoint`]).
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and CRIU: checkpoints a container"]
fn runc_checkpoint_restore_onto_another_device() {
    need_containers(Runtime::Runc);
    let criu = need_criu();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = criu_setup();
    let id = format!("wrapped-criu-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let c = Criu { s: &s, id: &id, criu: &criu, image: s.tmp.path().join("image") };
    let cat1 = c.run();
    assert!(s.stdout().contains("before fd3: 1:5\n"), "{}", s.stdout());
    let recorded = c.checkpoint_for_gpu_2();
    assert_eq!(
        recorded.as_array().map(|a| a.iter().map(|d| d["minor"].clone()).collect::<Vec<_>>()),
        Some(vec![json!(1)])
    );
    assert_eq!(recorded[0]["mode"], 0o666);
    let cat2 = c.restore();
    let state_file = s.state_dir().join(&id).join("state.json");
    let state: Value = serde_json::from_slice(&fs::read(&state_file).unwrap()).unwrap();
    assert_eq!(state["remap"][0]["new_name"], "nvidia2", "{}", state["remap"]);
    fs::remove_dir_all(&c.image).unwrap();
    let daemon = s.daemon_pid(&id);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon as i32), nix::sys::signal::Signal::SIGHUP).unwrap();
    let reloaded = wait_for("a reload after the image was removed", || {
        let now: Value = serde_json::from_slice(&fs::read(&state_file).ok()?).ok()?;
        (now["generation"].as_u64() > state["generation"].as_u64()).then_some(now)
    });
    assert_eq!(reloaded["last_error"], Value::Null, "{reloaded}");
    assert_eq!(reloaded["remap"][0]["new_name"], "nvidia2", "{}", reloaded["remap"]);
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    s.wait_line("done");
    let stdout = s.stdout();
    assert!(stdout.contains("after fd3: 1:7\n"), "the restored descriptor: {stdout}");
    assert!(stdout.contains("after reopen: 1:7 666\n"), "a reopen: {stdout}");
    assert!(stdout.contains("after fd3.write: refused\n"), "{stdout}");
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete", &s, &id);
    s.wait_gone(&id);
    for mut cat in [cat1, cat2] {
        let _ = cat.kill();
        let _ = cat.wait();
    }
}

/// Bug (found from outside): runc and crun open a restore's `--image-path` and `--work-path`
/// after changing into the bundle, and the wrapper's bundle replaced the caller's: `restore
/// --image-path ck` failed (`open ck: no such file or directory`), and CRIU's `restore.log`
/// under a relative `--work-path` went into the wrapper's bundle and was deleted with it. Both
/// are now the caller's bundle's, as with runc alone, from whatever directory the restore runs
/// and however the bundle is named.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and CRIU: checkpoints a container"]
fn a_restores_relative_paths_are_the_callers_bundles() {
    need_containers(Runtime::Runc);
    let criu = need_criu();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = criu_setup();
    let id = format!("wrapped-criu-rel-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let c = Criu { s: &s, id: &id, criu: &criu, image: s.bundle.dir().join("ck") };
    let cat1 = c.run();
    c.checkpoint_for_gpu_2();

    // The bundle named from a sibling directory, `..` and all (found from outside: the
    // `root.path` the wrapper wrote kept the `..`, and runc's restore panicked on it).
    let elsewhere = TempDir::new_in(s.bundle.dir().parent().unwrap()).unwrap();
    let bundle = format!("../{}", s.bundle.dir().file_name().unwrap().to_str().unwrap());
    let args = c.with_criu(&["restore", "--detach", "--image-path", "ck", "--work-path=wp", "--bundle", &bundle, &id]);
    let out = append(&s.bundle.dir().join("stdout"));
    let status = s
        .wrapper(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .current_dir(elsewhere.path())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .status()
        .unwrap();
    assert!(status.success(), "restore: {status}\n{}\n{}", s.stdout(), s.daemon_log(&id));
    let state: Value = serde_json::from_slice(&fs::read(s.state_dir().join(&id).join("state.json")).unwrap()).unwrap();
    assert_eq!(state["remap"][0]["new_name"], "nvidia2", "the record in the bundle's ck was read: {}", state["remap"]);
    assert!(s.bundle.dir().join("wp/restore.log").exists(), "CRIU's log is in the caller's bundle");
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete", &s, &id);
    s.wait_gone(&id);
    let mut cat1 = cat1;
    let _ = cat1.kill();
    let _ = cat1.wait();
}

/// A fake AMD host: the MI300X fixture's KFD topology under the host root, render node
/// `renderD144` a real char device (zero, 1:5) and `kfd` another (random, 1:8).
fn amd_host() -> FakeHost {
    let host = FakeHost::new();
    host.node("dri/renderD144", fake_rdev(1));
    host.node("kfd", fake_rdev(3));
    let copied = Command::new("cp").arg("-r").arg(fixture("amd/mi300x-8/sys")).arg(host.root()).status().unwrap();
    assert!(copied.success(), "cp of the KFD fixture: {copied}");
    host
}

/// A devremap container given `/dev/kfd` and `renderD144`, allowed the fake devices 1-3.
fn amd_spec() -> Value {
    let rules: Vec<Value> = [1, 2, 3].map(fake_rdev).into_iter().map(|(ma, mi)| allow_char(ma, mi)).collect();
    let mut spec = oci_config("wrapped", &rules);
    spec["annotations"] = json!({"devremap.io/enable": "true"});
    spec["linux"]["devices"] = amd_devices(&[144]);
    spec
}

/// Bug (attack F5): `checkpoint` of an AMD container on a host whose KFD topology cannot be
/// read (a duplicate gpu_id) recorded its render node without its identity, and CRIU ran; a
/// restore would then pair by position. It now fails with `record`'s error naming the file,
/// before the runtime's checkpoint: nothing is recorded and the container keeps running.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn checkpoint_fails_before_criu_when_the_topology_hides_a_gpu() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let host = amd_host();
    let gpu_id = host.root().join("sys/class/kfd/kfd/topology/nodes/3/gpu_id");
    fs::write(&gpu_id, "53538\n").unwrap();
    let s = Setup::on_host(Runtime::Runc, host, &amd_spec(), AMD_CRIU_SCRIPT);
    let id = format!("wrapped-amd-unread-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let image = s.tmp.path().join("image");

    let (status, mut cat) = run_on_pipes(&s, &["run", "--detach", "--bundle", &bundle, &id]);
    assert!(status.success(), "run --detach: {status}\n{}\n{}", s.stdout(), s.daemon_log(&id));
    s.wait_line("ready");
    let daemon = s.daemon_pid(&id);
    let out = s.run(&["checkpoint", "--image-path", arg(&image), &id]);
    assert!(!out.status.success(), "checkpoint: {}", out.stderr);
    let named =
        format!("{}/sys/class/kfd/kfd/topology/nodes: nodes 3 and 2 have one gpu_id, 53538", s.host.root().display());
    assert!(out.stderr.contains(&named), "{}", out.stderr);
    assert!(out.stderr.contains("GPU dri/renderD144 cannot be recorded with its KFD identity"), "{}", out.stderr);
    assert!(!image.join("devremap-gpus.json").exists(), "a refused record is not written");
    assert!(alive(daemon), "the container and its daemon keep running");
    let _ = cat.kill();
    let _ = cat.wait();
}

/// The AMD container holds the checkpoint name `/dev/dri/renderD144` open on fd 3, then, after
/// `/xchg/go`, reports where fd 3, a reopen, the restored GPU's own name and `/dev/kfd` lead.
const AMD_CRIU_SCRIPT: &str = r#"#!/bin/sh
exec 3<> /dev/dri/renderD144
echo "before fd3: $(stat -L -c '%t:%T' /proc/self/fd/3)"
echo "before kfd: $(stat -c '%t:%T' /dev/kfd)"
echo ready
while [ ! -e /xchg/go ]; do sleep 0.05; done
echo "after fd3: $(stat -L -c '%t:%T' /proc/self/fd/3)"
echo "after reopen: $(stat -c '%t:%T %a %g' /dev/dri/renderD144)"
echo "after native: $(stat -c '%t:%T' /dev/dri/renderD136)"
echo "after kfd: $(stat -c '%t:%T' /dev/kfd)"
echo done
"#;

/// `/dev/kfd` and the render nodes `minors` as a ROCm container's `linux.devices` give them
/// (the real numbers: the restored GPUs are the spec's render devices; the host's nodes give
/// the numbers served), render nodes 0660 in group 44 (`render`).
fn amd_devices(minors: &[u32]) -> Value {
    let mut devices = vec![json!({"path": "/dev/kfd", "type": "c", "major": 235, "minor": 0, "fileMode": 0o666})];
    devices.extend(minors.iter().map(|m| {
        json!({"path": format!("/dev/dri/renderD{m}"), "type": "c", "major": 226, "minor": m,
               "fileMode": 0o660, "uid": 0, "gid": 44})
    }));
    Value::Array(devices)
}

/// Rule (issue 22, CRIU #2723): runc checkpoint and restore of an AMD container through the
/// wrapper with a real CRIU, on a fake AMD host: the MI300X fixture's KFD topology under the
/// host root, render node `renderD144` a real char device (zero, 1:5) and `kfd` another
/// (random, 1:8). `checkpoint` records the render node into the image exactly as `devremapd
/// record` does; the host then renumbers: the container is given `renderD136` (full, 1:7) and
/// `kfd` has another major (tty, 5:0). After `restore`, the saved name `/dev/dri/renderD144`
/// leads to the GPU the plugin restores onto: the restored descriptor and a reopen reach full,
/// as does `renderD136`, and `/dev/kfd` is the host's new number.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and CRIU: checkpoints a container"]
fn runc_checkpoint_restore_of_an_amd_container_onto_a_renumbered_gpu() {
    need_containers(Runtime::Runc);
    let criu = need_criu();
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let host = amd_host();
    let mut spec = amd_spec();
    let s = Setup::on_host(Runtime::Runc, host, &spec, AMD_CRIU_SCRIPT);
    let id = format!("wrapped-amd-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let c = Criu { s: &s, id: &id, criu: &criu, image: s.tmp.path().join("image") };
    let cat1 = c.run();
    assert!(s.stdout().contains("before fd3: 1:5\nbefore kfd: 1:8\n"), "{}", s.stdout());
    let daemon = s.daemon_pid(&id);

    let recorded = c.checkpoint();
    let item = &recorded[0];
    assert_eq!(
        (&item["kind"], &item["minor"], &item["mode"], &item["gid"]),
        (&json!("amdgpu"), &json!(144), &json!(0o660), &json!(44))
    );
    assert_eq!(item["properties"]["drm_render_minor"], 144, "{item}");
    let by_hand = s.tmp.path().join("by-hand.json");
    let spec_path = s.bundle.config_path();
    let host_args = s.host.args();
    let mut record = vec!["record", "--spec", arg(&spec_path), "--output", arg(&by_hand)];
    record.extend(host_args.iter().map(String::as_str));
    let (code, _, stderr) = devremapd(&record);
    assert_eq!(code, 0, "devremapd record: {stderr}");
    let by_hand: Value = serde_json::from_slice(&fs::read(&by_hand).unwrap()).unwrap();
    assert_eq!(recorded, by_hand, "the wrapper's record is devremapd record's");
    wait_for("the daemon to stop with its checkpointed container", || (!alive(daemon)).then_some(()));

    // The restore host: the GPU is renderD136 now, and kfd has another major.
    for gone in ["dri/renderD144", "kfd"] {
        fs::remove_file(s.host.dev().join(gone)).unwrap();
    }
    s.host.node("dri/renderD136", fake_rdev(2));
    s.host.node("kfd", (5, 0));
    spec["linux"]["devices"] = amd_devices(&[136]);
    s.bundle.write_config(&spec);
    let cat2 = c.restore();
    let state: Value = serde_json::from_slice(&fs::read(s.state_dir().join(&id).join("state.json")).unwrap()).unwrap();
    let pair = &state["amdgpu"]["remap"][0];
    assert_eq!(
        (&pair["name"], &pair["new_name"], &pair["by"]),
        (&json!("dri/renderD144"), &json!("dri/renderD136"), &json!("plugin")),
        "{}",
        state["amdgpu"]
    );
    let daemon = s.daemon_pid(&id);
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    s.wait_line("done");
    let stdout = s.stdout();
    assert!(stdout.contains("after fd3: 1:7\n"), "the restored descriptor: {stdout}");
    assert!(stdout.contains("after reopen: 1:7 660 44\n"), "a reopen: {stdout}");
    assert!(stdout.contains("after native: 1:7\n"), "the restored GPU's own name: {stdout}");
    assert!(stdout.contains("after kfd: 5:0\n"), "kfd's new number: {stdout}");
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete", &s, &id);
    s.wait_gone(&id);
    assert!(!alive(daemon) && !is_mounted(&s.state_dir().join(&id).join("dev")));
    for mut cat in [cat1, cat2] {
        let _ = cat.kill();
        let _ = cat.wait();
    }
}

/// Bug (issue 17.1): Podman passes the same `--pid-file` to every start of a container, and
/// runc never removes it: the daemon took the stale pid for the container and stopped at once
/// ("devremapd exited (exit status: 0) before its mount answered"); a stale pid of a live,
/// unrelated process made the container lose `/dev` when that process exited. Now a pid file
/// found at the daemon's start counts only once the runtime has written it again.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_stale_pid_file_is_never_the_container() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-stalepid-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let pid_file = s.tmp.path().join("userdata-pidfile");
    // A live process that is not the container: its pid is what a stale file may name.
    let unrelated = Killed(Command::new("sleep").arg("600").spawn().unwrap());
    fs::write(&pid_file, unrelated.0.id().to_string()).unwrap();
    for round in 0..2 {
        let out = s.run(&["run", "--detach", "--pid-file", arg(&pid_file), "--bundle", &bundle, &id]);
        assert_ok(&out, &format!("run --detach, round {round}"), &s, &id);
        s.wait_line("ready");
        let container: u32 = fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
        let line = format!("watching container process {container}");
        wait_for("the daemon to watch the container", || s.daemon_log(&id).contains(&line).then_some(()));
        let log = s.daemon_log(&id);
        let stale = format!("watching container process {}", unrelated.0.id());
        assert!(!log.lines().any(|l| l.ends_with(&stale)), "{log}");
        assert!(log.contains("left by an earlier run"), "{log}");
        let out = s.run(&["delete", "--force", &id]);
        assert_ok(&out, "delete", &s, &id);
        fs::remove_file(s.bundle.dir().join("stdout")).unwrap();
        // The file stays, as runc leaves it, for the next round.
        assert!(pid_file.exists());
    }
}

/// Rule (issue 17.3): `--devremap-config PATH` names the config where the caller strips the
/// environment (Podman's conmon: `podman --runtime-flag devremap-config=PATH`), and never
/// reaches the runtime, which would refuse an unknown flag.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn the_config_flag_survives_a_stripped_environment() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let id = format!("wrapped-cfgflag-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let bundle = arg(s.bundle.dir()).to_owned();
    let flag = format!("--devremap-config={}", arg(&s.config));
    let status = Command::new(WRAPPER)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap())
        .args([&flag, "--root", arg(&s.bundle.state_root()), "create", "--bundle", &bundle, &id])
        .stdin(Stdio::null())
        .stdout(append(&s.bundle.dir().join("stdout")))
        .status()
        .unwrap();
    assert!(status.success());
    assert!(is_mounted(&s.state_dir().join(&id).join("dev")), "the config's state_dir was used");
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete", &s, &id);
}

/// Rule (issue 17.4): Docker 20.10 drops annotations; `docker run -e DEVREMAP_ENABLE=true`
/// puts the opt-in in the spec's `process.env`, which the wrapper reads.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn an_env_variable_opts_in() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({}));
    let mut spec = s.bundle.config();
    spec["process"]["env"].as_array_mut().unwrap().push(json!("DEVREMAP_ENABLE=true"));
    s.bundle.write_config(&spec);
    let id = format!("wrapped-env-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    let out = s.run(&["run", "--bundle", arg(s.bundle.dir()), &id]);
    assert_ok(&out, "run", &s, &id);
    assert!(s.stdout().contains("dev.fs: fuse\n"), "{}", s.stdout());
}

/// Rule (issue 17.5): a CRI pod's sandbox gets no daemon, though the runtime handler's
/// `pod_annotations` pass `devremap.io/enable` to it as to the pod's containers.
#[test]
#[ignore = "needs root, runc and busybox-static: runs a container"]
fn a_pod_sandbox_gets_no_daemon() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s =
        Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true", "io.kubernetes.cri.container-type": "sandbox"}));
    let id = format!("wrapped-sandbox-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    fs::write(s.bundle.xchg().join("go"), "").unwrap();
    let out = s.run(&["run", "--bundle", arg(s.bundle.dir()), &id]);
    assert_ok(&out, "run", &s, &id);
    assert!(s.stdout().contains("dev.fs: tmpfs\n"), "{}", s.stdout());
    s.wait_gone(&id);
}

/// Bug (issue 17.6): a spec binding another `/dev` (`docker run -v /dev:/dev`) covered the
/// devremap mount while the wrapper reported success. Asked for by name, it is refused before
/// anything is set up, naming the mount.
#[test]
#[ignore = "needs root, runc and busybox-static: runs the wrapper's create"]
fn a_second_dev_mount_is_refused() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let mut spec = s.bundle.config();
    spec["mounts"].as_array_mut().unwrap().push(json!({"destination": "/dev", "type": "bind", "source": "/dev",
                                                         "options": ["rbind"]}));
    s.bundle.write_config(&spec);
    let original = fs::read(s.bundle.config_path()).unwrap();
    let id = format!("wrapped-devbind-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let out = s.run(&["create", "--bundle", arg(s.bundle.dir()), &id]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("mounts: \"/dev\" is bound onto /dev, which would cover the devremap /dev"),
        "{}",
        out.stderr
    );
    s.wait_gone(&id);
    assert!(!s.run(&["state", &id]).status.success(), "the runtime never ran");
    assert_eq!(fs::read(s.bundle.config_path()).unwrap(), original);
}

/// Bug (issue 17.8): any argument that was not UTF-8 made the wrapper skip devremap silently,
/// even with `devremap.io/enable: "true"`. Now a pid file and a log whose paths are not UTF-8
/// are passed on byte for byte, and the container gets its devremap `/dev`.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn arguments_that_are_not_utf8_keep_devremap() {
    use std::os::unix::ffi::OsStrExt;
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Setup::new(Runtime::Runc, json!({"devremap.io/enable": "true"}));
    let odd = s.tmp.path().join(std::ffi::OsStr::from_bytes(b"caf\xe9-\xff"));
    fs::create_dir(&odd).unwrap();
    let (pid_file, log) = (odd.join("init.pid"), odd.join("log.json"));
    let id = format!("wrapped-utf8-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let status = Command::new(WRAPPER)
        .env(devremap_config_env(), &s.config)
        .arg("--root")
        .arg(s.bundle.state_root())
        .arg("--log")
        .arg(&log)
        .args(["create", "--bundle", arg(s.bundle.dir()), "--pid-file"])
        .arg(&pid_file)
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(append(&s.bundle.dir().join("stdout")))
        .status()
        .unwrap();
    assert!(status.success(), "{}", s.daemon_log(&id));
    assert!(is_mounted(&s.state_dir().join(&id).join("dev")), "devremap was used");
    assert!(fs::read_to_string(&pid_file).unwrap().trim().parse::<u32>().is_ok(), "runc wrote the pid file there");
    let out = s.run(&["delete", "--force", &id]);
    assert_ok(&out, "delete", &s, &id);
}

/// Bug (found from outside): a working directory under /dev (`docker run -w /dev/work/dir`)
/// failed under devremap (`mkdir /dev/work: read-only file system`), where runc makes it in
/// its own /dev and runs the container there. The tree holds it now, as runc makes it.
#[test]
#[ignore = "needs root, /dev/fuse, runc and busybox-static: runs a container"]
fn a_working_directory_under_dev_is_made_as_runc_makes_it() {
    need_containers(Runtime::Runc);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let script = "#!/bin/sh\necho \"cwd: $(pwd)\"\necho \"mode: $(stat -c '%A %u' /dev/work/dir)\"\n";
    let s = Setup::with_script(Runtime::Runc, json!({"devremap.io/enable": "true"}), script);
    let mut spec = s.bundle.config();
    spec["process"]["cwd"] = json!("/dev/work/dir");
    s.bundle.write_config(&spec);
    let id = format!("wrapped-cwd-{}", std::process::id());
    let _delete = Deleting(&s, id.clone());
    let out = s.run(&["run", "--bundle", arg(s.bundle.dir()), &id]);
    assert_ok(&out, "run with its working directory under /dev", &s, &id);
    assert!(s.stdout().contains("cwd: /dev/work/dir\nmode: drwxr-xr-x 0\n"), "{}", s.stdout());
    s.wait_gone(&id);
}
