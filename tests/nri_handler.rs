//! The NRI plugin's handler (issue 32) in a real node daemon with real FUSE, without containerd:
//! a `--features test-hooks` build's node daemon takes an `nri-event` request (never in the
//! shipped binary) and calls its handler as the NRI transport would, with the pod and
//! containers in JSON. The containerd end to end tests are the transport's.
//!
//! The fake host has described GPUs 2 and 3 (`host_root` in the runtime config, no `host_dev`:
//! the GPUs are the containers' `linux.devices`, 195:N, as CDI and the device plugin give
//! them). A test looks at a container's `/dev` through its mountpoint `<state_dir>/<id>/dev`,
//! the tree the container's `/dev` would bind.

mod common;

use common::clients::WRAPPER;
use common::daemon::{
    is_mounted, keepers_under, kill_keepers_and_unmount, need_fuse, terminate, wait_for_or, wait_node_answers,
};
use common::{BIN, FakeHost, arg, host_uuid, need_test_hooks, write_file};
use devremap::node::client::ask;
use devremap::node::protocol::Request;
use serde_json::{Value, json};
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;

const ASK: Duration = Duration::from_secs(60);

/// A node daemon on a state dir of the test's own, with the runtime config it reads: on drop,
/// the daemon is stopped, every keeper under the test's directory killed, and whatever is left
/// mounted there detached, so a failing test leaves nothing behind.
struct Node {
    tmp: TempDir,
    host: FakeHost,
    config: PathBuf,
    child: Child,
}

impl Node {
    fn start() -> Node {
        Node::start_with(&[])
    }

    /// A node daemon with `env` set besides (a test hook's `DEVREMAPD_FAILPOINT`).
    fn start_with(env: &[(&str, &str)]) -> Node {
        let host = FakeHost::with_described_gpus(&[2, 3]);
        let tmp = TempDir::new().unwrap();
        let state = tmp.path().join("state");
        // `runtime` is the wrapper's (a runtime that fails at once), for a pod with the
        // RuntimeClass as well: the plugin ignores it.
        let config = json!({"host_root": arg(&host.root()), "state_dir": arg(&state), "runtime": "/bin/false"});
        let config = write_file(tmp.path(), "runtime.json", config.to_string());
        let log = fs::File::create(tmp.path().join("node.log")).unwrap();
        let socket = tmp.path().join("node.sock");
        let child = Command::new(BIN)
            .args(["node", "--socket", arg(&socket), "--state-dir", arg(&state)])
            .args(["--pid-file", arg(&tmp.path().join("node.pid")), "--config", arg(&config)])
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("devremapd node starts");
        let mut node = Node { tmp, host, config, child };
        let (socket, log) = (node.socket(), node.tmp.path().join("node.log"));
        wait_node_answers(&mut node.child, &socket, &log);
        node
    }

    /// A node daemon for a test that needs FUSE and the test hooks (it fails without them), and
    /// the test's directory.
    fn for_test() -> (Node, PathBuf) {
        need_fuse();
        need_test_hooks();
        let node = Node::start();
        let tmp = node.tmp.path().to_owned();
        (node, tmp)
    }

    fn socket(&self) -> PathBuf {
        self.tmp.path().join("node.sock")
    }

    fn log(&self) -> String {
        fs::read_to_string(self.tmp.path().join("node.log")).unwrap_or_default()
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.tmp.path().join("state").join(id)
    }

    /// The handler's answer to `event` for `containers` of `pod`.
    fn event(&self, event: &str, pod: &Value, containers: &[Value]) -> Result<Value, String> {
        let request = Request::NriEvent {
            config: Some(self.config.clone()),
            event: event.into(),
            pod: pod.clone(),
            containers: containers.to_vec(),
        };
        ask(&self.socket(), &request, ASK).map_err(|e| e.to_string())
    }

    /// `create` of `container`, which must succeed; its adjustment.
    fn create(&self, container: &Value) -> Value {
        self.event("create", &pod(), std::slice::from_ref(container))
            .unwrap_or_else(|e| panic!("create: {e}\n--- node log ---\n{}", self.log()))
    }

    /// The `devremapd` processes under the test's directory but the node daemon.
    fn keepers(&self) -> Vec<u32> {
        keepers_under(self.tmp.path())
    }

    /// Waits until container `id` has no directory, mount or keeper left.
    fn wait_gone(&self, id: &str) {
        let dir = self.dir(id);
        wait_for_or(
            &format!("container {id} to be torn down"),
            || self.log(),
            || (!dir.exists() && !is_mounted(&dir.join("dev")) && self.keepers().is_empty()).then_some(()),
        );
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        terminate(&mut self.child);
        kill_keepers_and_unmount(self.tmp.path());
        let _ = &self.host;
    }
}

fn pod() -> Value {
    json!({"id": "pod1", "name": "trainer", "namespace": "ml", "uid": "u1", "annotations": {}})
}

/// A container as containerd 1.7's CRI plugin describes it at `CreateContainer`: its default
/// `/dev` tmpfs and what goes under it, a kubelet bind mount of a file onto
/// `/dev/termination-log`, and GPU `gpu` in `linux.devices`.
fn container(tmp: &Path, id: &str, gpu: Option<u32>, annotations: Value) -> Value {
    let termination = write_file(tmp, &format!("termination-{id}"), "");
    let devices: Vec<Value> = gpu
        .into_iter()
        .map(|m| json!({"path": format!("/dev/nvidia{m}"), "kind": "c", "major": 195, "minor": m, "file_mode": 0o666}))
        .collect();
    json!({
        "id": id,
        "pod_sandbox_id": "pod1",
        "name": format!("ctr-{id}"),
        "state": "Created",
        "annotations": annotations,
        "args": ["sleep", "inf"],
        "env": ["PATH=/bin"],
        "mounts": [
            {"destination": "/proc", "kind": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "kind": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "kind": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/mqueue", "kind": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev/shm", "kind": "bind", "source": arg(tmp), "options": ["rbind", "ro"]},
            {"destination": "/dev/termination-log", "kind": "bind", "source": arg(&termination), "options": ["rbind"]},
        ],
        "devices": devices,
    })
}

/// What a path in a container's `/dev` is: `c M:m` for a char device, `d`, `f`, `l`.
fn what(path: &Path) -> String {
    let Ok(m) = fs::symlink_metadata(path) else { return "missing".into() };
    let t = m.file_type();
    if t.is_char_device() {
        format!("c {}:{}", libc::major(m.rdev()), libc::minor(m.rdev()))
    } else if t.is_dir() {
        "d".into()
    } else if t.is_symlink() {
        "l".into()
    } else {
        "f".into()
    }
}

/// Rule (issue 32): at `CreateContainer` of a GPU container the handler mounts its `/dev` at
/// `<state_dir>/<id>/dev` and answers with the bind of it at `/dev` (`rbind,nosuid,noexec`) and
/// the record `devremap.io/gpus` (`devremapd record`'s list: the GPU's minor and the host's UUID
/// for it); the mount holds the GPU, the defaults, and the mount points of what containerd
/// mounts under `/dev` (for a file's bind and the console, the placeholder: `/dev/null`'s
/// device). A container that asks for nothing, and the
/// pod sandbox, are answered with no change and get no directory. `RemoveContainer` leaves no
/// mount, directory or keeper.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn create_serves_a_gpu_containers_dev_and_remove_tears_it_down() {
    let (node, tmp) = Node::for_test();
    let gpu = container(&tmp, "gpu1", Some(2), json!({"io.kubernetes.cri.container-type": "container"}));
    let adjustment = node.create(&gpu);
    let dev = node.dir("gpu1").join("dev");
    assert_eq!(
        adjustment["mounts"],
        json!([{"destination": "/dev", "type": "bind", "source": arg(&dev), "options": ["rbind", "nosuid", "noexec"]}])
    );
    let record: Value = serde_json::from_str(adjustment["annotations"]["devremap.io/gpus"].as_str().unwrap()).unwrap();
    assert_eq!(
        (record[0]["minor"].as_u64(), record[0]["uuid"].as_str()),
        (Some(2), Some(host_uuid(2).as_str())),
        "{record}"
    );
    assert!(is_mounted(&dev));
    for (name, is) in [
        ("nvidia2", "c 195:2"),
        ("null", "c 1:3"),
        ("pts", "d"),
        ("shm", "d"),
        ("mqueue", "d"),
        ("termination-log", "c 1:3"),
        ("console", "c 1:3"),
    ] {
        assert_eq!(what(&dev.join(name)), is, "{name} in {}", dev.display());
    }
    assert_eq!(what(&dev.join("nvidia3")), "missing", "the container never gets a GPU its spec does not list");

    for plain in [
        container(&tmp, "plain", None, json!({})),
        container(
            &tmp,
            "sandbox",
            Some(3),
            json!({"io.kubernetes.cri.container-type": "sandbox", "devremap.io/enable": "true"}),
        ),
    ] {
        assert_eq!(node.create(&plain), json!({"annotations": {}, "mounts": [], "remove_mounts": []}));
    }
    assert!(!node.dir("plain").exists() && !node.dir("sandbox").exists());

    node.event("removed", &pod(), &[gpu]).unwrap();
    node.wait_gone("gpu1");
}

/// Rule (issue 32): a container created with `devremap.io/gpus` (a CRI restore passes the
/// checkpoint's annotations) is served the remap onto its new GPUs: the record's GPU 2 is
/// served under its name `nvidia2` as the container's new GPU 3, and the new record carries the
/// name it was given (`earlier_minors`). A record that is not one fails the creation naming the
/// annotation, leaving nothing. `StopContainer` tears the mount down.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn a_container_created_with_a_record_is_served_the_remap() {
    let (node, tmp) = Node::for_test();
    let first = node.create(&container(&tmp, "before", Some(2), json!({})));
    let record = first["annotations"]["devremap.io/gpus"].as_str().unwrap().to_owned();
    node.event("removed", &pod(), &[container(&tmp, "before", Some(2), json!({}))]).unwrap();
    node.wait_gone("before");

    let restored = container(&tmp, "after", Some(3), json!({"devremap.io/gpus": record}));
    let adjustment = node.create(&restored);
    let dev = node.dir("after").join("dev");
    assert_eq!(what(&dev.join("nvidia2")), "c 195:3", "the checkpoint's name leads to the new GPU");
    let again: Value = serde_json::from_str(adjustment["annotations"]["devremap.io/gpus"].as_str().unwrap()).unwrap();
    assert_eq!(again[0]["minor"], 3, "{again}");
    assert_eq!(again[0]["earlier_minors"], json!([2]), "{again}");

    let bad = container(&tmp, "bad", Some(3), json!({"devremap.io/gpus": "[{\"minor\": true}]"}));
    let e = node.event("create", &pod(), &[bad]).unwrap_err();
    assert!(e.contains("container ctr-bad (bad): annotation devremap.io/gpus: "), "{e}");
    assert!(!node.dir("bad").exists());

    node.event("stopped", &pod(), &[restored]).unwrap();
    node.wait_gone("after");
}

/// Rule (issue 32): at `Synchronize` (the plugin's registration, after its restart or
/// containerd's) every NRI container containerd no longer runs is torn down, one it runs keeps
/// its mount, and a directory the wrapper made (no NRI mark) is not the plugin's to touch.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn synchronize_tears_down_only_nri_containers_that_are_gone() {
    let (node, tmp) = Node::for_test();
    let mut running = container(&tmp, "running", Some(2), json!({}));
    node.create(&running);
    node.create(&container(&tmp, "gone", Some(3), json!({})));
    let wrappers = node.dir("wrappers");
    fs::create_dir_all(wrappers.join("dev")).unwrap();
    running["state"] = json!("Running");
    node.event("synchronize", &pod(), &[running.clone()]).unwrap();
    let gone = node.dir("gone");
    wait_for_or("the gone container's teardown", || node.log(), || (!gone.exists()).then_some(()));
    assert!(is_mounted(&node.dir("running").join("dev")), "{}", node.log());
    assert!(wrappers.exists(), "a directory without the NRI mark is left alone");
    fs::remove_dir_all(&wrappers).unwrap();
    node.event("removed", &pod(), &[running]).unwrap();
    node.wait_gone("running");
}

/// Rule (issue 32): a container containerd leaves out of `Synchronize` while its init runs
/// (containerd 1.7 lists no container it marked unknown: its shim did not answer in time after
/// containerd's restart) keeps its `/dev`: the plugin recorded its init at `PostStartContainer`,
/// and tears it down only once that process (the same one: its start time) is gone. Without
/// this, the running container's `/dev` answered ENOTCONN for the rest of its life.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn an_unlisted_container_whose_init_runs_keeps_its_dev() {
    let (node, tmp) = Node::for_test();
    let mut unknown = container(&tmp, "unknown", Some(2), json!({}));
    node.create(&unknown);
    let mut init = Command::new("sleep").arg("3600").spawn().unwrap();
    unknown["state"] = json!("Running");
    unknown["pid"] = json!(init.id());
    node.event("started", &pod(), std::slice::from_ref(&unknown)).unwrap();
    let started = || fs::read_to_string(node.dir("unknown").join("nri")).unwrap_or_default();
    wait_for_or("the init recorded", started, || started().starts_with(&format!("{} ", init.id())).then_some(()));
    node.event("synchronize", &pod(), &[]).unwrap();
    let kept = "not listed by containerd at NRI Synchronize, but its init";
    wait_for_or("the kept line", || node.log(), || node.log().contains(kept).then_some(()));
    assert!(is_mounted(&node.dir("unknown").join("dev")), "{}", node.log());
    init.kill().unwrap();
    init.wait().unwrap();
    node.event("synchronize", &pod(), &[]).unwrap();
    node.wait_gone("unknown");
}

/// Bug (issue 32): a pod with the RuntimeClass `devremap` on a node whose NRI plugin is on too
/// gets both: the plugin serves the container at `CreateContainer`, then containerd runs
/// `devremap-runtime create`, which found the plugin's directory and refused the container (the
/// id "in use by a devremap container of runtime root"), or, with the runtime's default root,
/// took it for a killed wrapper's leftover and tore the container's `/dev` down. The wrapper
/// leaves an NRI container to the plugin and runs the runtime alone, with either root.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn the_wrapper_leaves_an_nri_container_to_the_plugin() {
    let (node, tmp) = Node::for_test();
    let gpu = container(&tmp, "both", Some(2), json!({}));
    node.create(&gpu);
    let bundle = tmp.join("bundle");
    fs::create_dir_all(&bundle).unwrap();
    let spec = json!({"ociVersion": "1.0.2", "annotations": {"devremap.io/enable": "true"},
                      "linux": {"devices": [{"path": "/dev/nvidia2", "type": "c", "major": 195, "minor": 2}]}});
    fs::write(bundle.join("config.json"), spec.to_string()).unwrap();
    let runc_root = tmp.join("runc");
    for root in [&["--root", arg(&runc_root)][..], &[]] {
        let out = Command::new(WRAPPER)
            .args(["--devremap-config", arg(&node.config)])
            .args(root)
            .args(["create", "--bundle", arg(&bundle), "both"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        // The runtime, /bin/false, ran: it says nothing and exits 1.
        assert_eq!((out.status.code(), String::from_utf8_lossy(&out.stderr).as_ref()), (Some(1), ""), "{root:?}");
        let dev = node.dir("both").join("dev");
        assert!(is_mounted(&dev) && what(&dev.join("nvidia2")) == "c 195:2", "{root:?}: {}", node.log());
    }
    node.event("removed", &pod(), &[gpu]).unwrap();
    node.wait_gone("both");
}

/// Bug (issue 32's note): a create held up past containerd's plugin timeout (2 s) had
/// containerd drop the plugin and create the GPU container *without* its devremap `/dev`. Held
/// up here by the state dir's lock (what a wrapper's claim or a slow teardown holds), the create
/// is answered with an error within `--nri-timeout` (1.5 s): containerd fails it and the
/// kubelet tries again. Once the lock is free, what the late create made is torn down.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn a_create_held_up_is_refused_in_time_and_what_it_makes_later_goes() {
    let (node, tmp) = Node::for_test();
    let state = fs::File::open(tmp.join("state")).unwrap();
    let state = nix::fcntl::Flock::lock(state, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| e).unwrap();
    let gpu = container(&tmp, "late", Some(2), json!({}));
    let asked = std::time::Instant::now();
    let answer = node.event("create", &pod(), std::slice::from_ref(&gpu));
    let took = asked.elapsed();
    let e = answer.expect_err("a create that cannot take the state dir's lock is refused");
    assert!(e.contains("container ctr-late (late): not served within --nri-timeout"), "{e}");
    // Well under the 10 s the test's request would wait; the bound is the handler's, not ours.
    assert!(took < Duration::from_secs(8), "answered after {took:?}");
    drop(state);
    wait_for_or(
        "the late create's teardown",
        || node.log(),
        || {
            node.log()
                .contains("container late: set up after its create was answered with an error; removed")
                .then_some(())
        },
    );
    node.wait_gone("late");
    // The daemon serves on.
    node.create(&container(&tmp, "next", Some(2), json!({})));
    assert!(is_mounted(&node.dir("next").join("dev")));
}

/// Bug (issue 32's note): a create that panicked once its keeper served the container left the
/// keeper, its mount and the directory behind. The test hook `nri-create-panic:ID` panics at
/// that moment, after the create was answered (the mount is done while containerd finishes
/// creating the container): `PostCreateContainer` says the container's `/dev` is not served,
/// nothing of it is left (so the runtime's bind of it fails the start), and the daemon serves
/// the next container.
#[test]
#[ignore = "needs root, /dev/fuse and a test-hooks build: mounts FUSE through the node daemon"]
fn a_create_that_panics_leaves_nothing() {
    need_fuse();
    need_test_hooks();
    let node = Node::start_with(&[("DEVREMAPD_FAILPOINT", "nri-create-panic:boom")]);
    let tmp = node.tmp.path().to_owned();
    node.create(&container(&tmp, "boom", Some(2), json!({})));
    node.wait_gone("boom");
    let log = node.log();
    assert!(log.contains("container ctr-boom (boom): its /dev is not served: the plugin failed (a panic"), "{log}");
    node.create(&container(&tmp, "fine", Some(3), json!({})));
    assert!(is_mounted(&node.dir("fine").join("dev")));
}
