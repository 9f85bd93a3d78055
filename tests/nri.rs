//! `devremapd node --nri` (issue 32) as containerd's NRI plugin: containerd 1.7.24 (Debian 13's
//! package, unpacked by `.ci/containerd-packages`) with NRI enabled on a socket of the test's
//! own, its CRI plugin driven by a CRI client as a kubelet drives it (no runtime handler: the
//! node's default runc), and the node daemon registered with it, with the real handler and a
//! runtime config (`--config`) naming a fake host's `host_root` (GPUs 2 and 3 described) and
//! the node's state dir. A GPU is given to a container as the device plugin gives it: a
//! `Device` whose host path is a char device 195:N the test makes, which containerd stats.
//! The tests pin the transport (registration, the events, Synchronize, reconnecting, never
//! blocking a pod) and, end to end, what the plugin serves: a container's `/dev` as the
//! container sees it (ExecSync), its record in its spec as containerd keeps it (`ctr
//! containers info`), the state dir and `devremapd ctl list`, across the plugin's and
//! containerd's restarts; and a CRI restore, simulated (containerd 2.1's CreateContainer with
//! the checkpoint's annotations, made by the test).

mod common;
#[path = "common/cri.rs"]
mod cri;

use common::clients::wait_client;
use common::daemon::{container_dirs, is_mounted, keepers_under, kill_keepers_and_unmount, need_fuse, stop_node};
use common::{BIN, FakeHost, GpuFacts, arg, host_uuid, mknod_char, write_file};
use cri::{Containerd, Cri, IMAGE, Release, busybox_image, need_containerd, pod_config};
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, Device, ExecSyncRequest, ImageSpec, PodSandboxConfig,
    RemoveContainerRequest, RemovePodSandboxRequest, StartContainerRequest, StopContainerRequest,
    StopPodSandboxRequest,
};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use tempfile::TempDir;

/// The annotation that asks for a devremap `/dev`, and the one that carries the record.
const ENABLE: &str = "devremap.io/enable";
const GPUS: &str = "devremap.io/gpus";

/// containerd 1.7.24 on `dir`, its NRI enabled on `<dir>/nri.sock` (no plugin directory of its
/// own to launch from), the busybox image imported and used as the pods' sandbox image.
fn containerd_with_nri(dir: &Path) -> Containerd {
    need_containerd();
    let release = Release::named("debian13");
    let config = write_file(
        dir,
        "config.toml",
        format!(
            "version = 2\n[plugins]\n  [plugins.\"io.containerd.grpc.v1.cri\"]\n    sandbox_image = \"{IMAGE}\"\n    \
             restrict_oom_score_adj = true\n  [plugins.\"io.containerd.internal.v1.opt\"]\n    path = \"{0}/opt\"\n  \
             [plugins.\"io.containerd.nri.v1.nri\"]\n    disable = false\n    socket_path = \"{0}/nri.sock\"\n    \
             plugin_path = \"{0}/nri-plugins\"\n    plugin_config_path = \"{0}/nri-conf\"\n",
            dir.display()
        ),
    );
    let c = Containerd::start_node(dir, &[], &release, &config);
    // Made once per test: a containerd stopped (dropped) takes its images with it.
    let archive = dir.join("image.tar");
    let archive = if archive.exists() { archive } else { busybox_image(dir) };
    c.ctr_ok(&["images", "import", arg(&archive)]);
    c
}

/// `devremapd node --nri --nri-socket <dir>/nri.sock --config <dir>/runtime.json`, its state
/// and socket in `<dir>/node` (the runtime config's `state_dir` too), its log in
/// `<dir>/node.log` (appended to, across restarts); the runtime config names the fake host's
/// `host_root`. On drop it is stopped (woken first if the test stopped it), and the keepers and
/// mounts it left (a keeper outlives its node daemon) are gone too.
struct Plugin {
    child: Child,
    dir: PathBuf,
}

impl Plugin {
    fn start(dir: &Path, host: &FakeHost) -> Plugin {
        let config = json!({"host_root": arg(&host.root()), "state_dir": arg(&dir.join("node"))});
        write_file(dir, "runtime.json", config.to_string());
        Plugin { child: Plugin::spawn(dir), dir: dir.to_owned() }
    }

    fn spawn(dir: &Path) -> Child {
        let log = fs::OpenOptions::new().create(true).append(true).open(dir.join("node.log")).unwrap();
        let node = dir.join("node");
        Command::new(BIN)
            .args(["node", "--nri", "--nri-socket", arg(&dir.join("nri.sock"))])
            .args(["--socket", arg(&node.join("node.sock")), "--state-dir", arg(&node)])
            .args(["--pid-file", arg(&node.join("node.pid")), "--config", arg(&dir.join("runtime.json"))])
            .stderr(log)
            .stdout(Stdio::null())
            .stdin(Stdio::null())
            // Its default level: the info lines the tests wait for.
            .env_remove("RUST_LOG")
            .spawn()
            .expect("devremapd node starts")
    }

    /// SIGKILL: the node daemon dies at once, its keepers serve on.
    fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// A node daemon started again on the same state dir and config.
    fn start_again(&mut self) {
        self.child = Plugin::spawn(&self.dir);
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }

    /// Waits until the node's log has `line` `times` times.
    fn wait_lines(&self, line: &str, times: usize) {
        wait_client(
            &format!("{times}x {line:?} in the node's log"),
            || self.log(),
            || (self.log().lines().filter(|l| l.contains(line)).count() >= times).then_some(()),
        );
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) of our child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.join("node")
    }

    /// The containers with a directory in the state dir, sorted.
    fn served(&self) -> Vec<String> {
        container_dirs(&self.state_dir())
    }

    /// The ids `devremapd ctl list` prints, sorted.
    fn listed(&self) -> Vec<String> {
        let out = Command::new(BIN)
            .args(["ctl", "--socket", arg(&self.state_dir().join("node.sock")), "list"])
            .output()
            .unwrap();
        assert!(out.status.success(), "ctl list: {}", String::from_utf8_lossy(&out.stderr));
        let mut ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    }

    /// Waits until container `id` has no directory, mount, keeper or `ctl list` entry left.
    fn wait_gone(&self, id: &str) {
        let dir = self.state_dir().join(id);
        wait_client(
            &format!("container {id} to be torn down"),
            || self.log(),
            || {
                (!dir.exists()
                    && !is_mounted(&dir.join("dev"))
                    && keepers_under(&dir).is_empty()
                    && !self.listed().contains(&id.to_owned()))
                .then_some(())
            },
        );
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        stop_node(&self.state_dir());
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_keepers_and_unmount(&self.state_dir());
    }
}

/// The node's line for its registration on `dir`'s NRI socket.
fn registered(dir: &Path) -> String {
    format!("nri: registered with containerd on {} as plugin 10-devremap", dir.join("nri.sock").display())
}

/// A pod named `name` (the host's network: no CNI here) and its containers, each CRI call
/// made as a kubelet makes it.
struct Pod {
    config: PodSandboxConfig,
    sandbox: String,
}

/// A container `name` that sleeps, with `devices` and `annotations`.
fn sleeper(name: &str, devices: Vec<Device>, annotations: &[(&str, &str)]) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata { name: name.into(), attempt: 0 }),
        image: Some(ImageSpec { image: IMAGE.into(), ..Default::default() }),
        command: vec!["/bin/sleep".into(), "86400".into()],
        log_path: format!("{name}.log"),
        devices,
        annotations: annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        ..Default::default()
    }
}

/// GPU `minor` as the device plugin gives it: `/dev/nvidia<minor>`, from a char device 195:minor
/// made in `dir` (containerd stats the host path for the device's numbers).
fn gpu(dir: &Path, minor: u32) -> Device {
    let host_path = dir.join(format!("nvidia{minor}"));
    if !host_path.exists() {
        mknod_char(&host_path, (195, minor), 0o666);
    }
    Device {
        container_path: format!("/dev/nvidia{minor}"),
        host_path: arg(&host_path).into(),
        permissions: "rw".into(),
    }
}

impl Pod {
    fn run(cri: &mut Cri, dir: &Path, name: &str) -> Pod {
        Pod::run_with(cri, dir, name, &[])
    }

    fn run_with(cri: &mut Cri, dir: &Path, name: &str, annotations: &[(&str, &str)]) -> Pod {
        let logs = dir.join("pod-logs").join(name);
        fs::create_dir_all(&logs).unwrap();
        let config = pod_config(name, &format!("{name}-{}", std::process::id()), &logs, annotations);
        let sandbox = cri.run_pod_sandbox(&config, "");
        Pod { config, sandbox }
    }

    /// CreateContainer of `container`: its id, or containerd's refusal.
    fn try_create(&self, cri: &mut Cri, container: ContainerConfig) -> Result<String, tonic::Status> {
        let request = CreateContainerRequest {
            pod_sandbox_id: self.sandbox.clone(),
            config: Some(container),
            sandbox_config: Some(self.config.clone()),
        };
        let mut client = cri.runtime.clone();
        cri.rt.block_on(client.create_container(request)).map(|r| r.into_inner().container_id)
    }

    /// CreateContainer and StartContainer of `container`; its id.
    fn start(&self, cri: &mut Cri, container: ContainerConfig) -> String {
        let id = self.try_create(cri, container).unwrap_or_else(|e| panic!("CreateContainer: {e}"));
        cri.call("StartContainer", |mut c| {
            let container_id = id.clone();
            async move { c.start_container(StartContainerRequest { container_id }).await }
        });
        id
    }

    /// CreateContainer and StartContainer of a container that sleeps; its id.
    fn start_container(&self, cri: &mut Cri) -> String {
        self.start(cri, sleeper("sleeper", vec![], &[]))
    }

    fn stop_container(cri: &mut Cri, id: &str) {
        cri.call("StopContainer", |mut c| {
            let container_id = id.to_owned();
            async move { c.stop_container(StopContainerRequest { container_id, timeout: 0 }).await }
        });
    }

    fn remove_container(cri: &mut Cri, id: &str) {
        cri.call("RemoveContainer", |mut c| {
            let container_id = id.to_owned();
            async move { c.remove_container(RemoveContainerRequest { container_id }).await }
        });
    }

    fn remove(self, cri: &mut Cri) {
        cri.call("StopPodSandbox", |mut c| {
            let pod_sandbox_id = self.sandbox.clone();
            async move { c.stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id }).await }
        });
        cri.call("RemovePodSandbox", |mut c| {
            let pod_sandbox_id = self.sandbox.clone();
            async move { c.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id }).await }
        });
    }
}

/// Rule (issue 32): `devremapd node --nri` registers with containerd 1.7.24 as NRI plugin
/// `10-devremap` (both sides say so); a pod's container's CreateContainer, start (with its
/// init's pid), stop and removal each reach the handler, and the pod's sandbox is never created as a container; a node
/// daemon started again while the container runs is told of it at Synchronize; after
/// containerd is restarted, the plugin registers again by itself.
#[test]
#[ignore = "needs root, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn the_plugin_hears_a_containers_life_and_comes_back() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let containerd = containerd_with_nri(dir);
    let plugin = Plugin::start(dir, &host);
    plugin.wait_lines(&registered(dir), 1);
    let containerd_log = || fs::read_to_string(dir.join("containerd.log")).unwrap_or_default();
    wait_client("containerd to log the registration", containerd_log, || {
        containerd_log().contains("registered as \\\"10-devremap\\\"").then_some(())
    });

    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    let pod = Pod::run(&mut cri, dir, "nri-life");
    let id = pod.start_container(&mut cri);
    plugin.wait_lines(&format!("nri: create container {id} (sleeper) in pod default/nri-life"), 1);
    let started = format!("nri: container {id} started (pid ");
    plugin.wait_lines(&started, 1);
    // PostStartContainer carries the container's init, which a handler watches.
    let log = plugin.log();
    let pid = log.lines().find_map(|l| l.split_once(&started)).and_then(|(_, rest)| rest.strip_suffix(')'));
    assert!(pid.is_some_and(|p| p.parse::<u32>().is_ok_and(|p| p > 0)), "{log}");

    drop(plugin);
    let plugin = Plugin::start(dir, &host);
    plugin.wait_lines(&registered(dir), 2);
    plugin.wait_lines(&format!("nri: synchronize: 1 pods, containers [{id}]"), 1);

    Pod::stop_container(&mut cri, &id);
    plugin.wait_lines(&format!("nri: container {id} stopped"), 1);
    Pod::remove_container(&mut cri, &id);
    plugin.wait_lines(&format!("nri: container {id} removed"), 1);
    let sandbox = pod.sandbox.clone();
    pod.remove(&mut cri);
    assert!(!plugin.log().contains(&format!("create container {sandbox}")), "{}", plugin.log());

    drop(cri);
    drop(containerd);
    let _containerd = containerd_with_nri(dir);
    plugin.wait_lines(&registered(dir), 3);
}

/// Rule (issue 32): a plugin that does not answer (SIGSTOPped) never keeps a plain pod from
/// starting beyond NRI's own timeout: containerd drops it, and once woken it registers again
/// by itself; with the plugin gone, pods start as without NRI.
#[test]
#[ignore = "needs root, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn a_stopped_or_gone_plugin_never_blocks_a_pod() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let _containerd = containerd_with_nri(dir);
    let plugin = Plugin::start(dir, &host);
    plugin.wait_lines(&registered(dir), 1);
    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));

    plugin.signal(libc::SIGSTOP);
    let pod = Pod::run(&mut cri, dir, "nri-stopped");
    let id = pod.start_container(&mut cri);
    let containerd_log = fs::read_to_string(dir.join("containerd.log")).unwrap();
    assert!(
        containerd_log.contains("closing plugin 10-devremap, failed to handle CreateContainer request"),
        "containerd did not time the plugin out:\n{containerd_log}"
    );
    plugin.signal(libc::SIGCONT);
    plugin.wait_lines(&registered(dir), 2);
    plugin.wait_lines(&format!("nri: synchronize: 1 pods, containers [{id}]"), 1);
    Pod::stop_container(&mut cri, &id);
    Pod::remove_container(&mut cri, &id);
    pod.remove(&mut cri);

    drop(plugin);
    let pod = Pod::run(&mut cri, dir, "nri-gone");
    let id = pod.start_container(&mut cri);
    Pod::stop_container(&mut cri, &id);
    Pod::remove_container(&mut cri, &id);
    pod.remove(&mut cri);
}

/// Runs `script` with `sh -c` in container `id`, which must succeed; its stdout.
fn exec(cri: &mut Cri, id: &str, script: &str) -> String {
    let r = cri.call("ExecSync", |mut c| {
        let (container_id, cmd) = (id.to_owned(), vec!["sh".into(), "-c".into(), script.to_owned()]);
        async move { c.exec_sync(ExecSyncRequest { container_id, cmd, timeout: 60 }).await }
    });
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.exit_code, 0, "in container {id}: {script}: {stderr}");
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// Container `id`'s `/dev` as it sees it: the type of what is mounted there, and the device
/// numbers (`stat -c %t:%T`, hex) of `names` in it (`missing` for none); what a program does
/// with its `/dev` (write `/dev/null`, list `/dev/pts`, use `/dev/shm`) must work.
fn dev_of(cri: &mut Cri, id: &str, names: &[&str]) -> (String, Vec<String>) {
    let script = format!(
        "awk '$2 == \"/dev\" {{ print $3 }}' /proc/mounts; for n in {}; do stat -c %t:%T /dev/$n 2>/dev/null || \
         echo missing; done; echo x > /dev/null; ls /dev/pts | grep -q ptmx; echo x > /dev/shm/probe; rm /dev/shm/probe",
        names.join(" ")
    );
    let out = exec(cri, id, &script);
    let mut lines = out.lines().map(str::to_owned);
    (lines.next().unwrap_or_default(), lines.collect())
}

/// The annotation `key` of container `id`'s spec as containerd keeps it (what a checkpoint
/// saves), if any.
fn spec_annotation(containerd: &Containerd, id: &str, key: &str) -> Option<String> {
    let info: Value = serde_json::from_str(&containerd.ctr_ok(&["containers", "info", id])).unwrap();
    info["Spec"]["annotations"][key].as_str().map(str::to_owned)
}

/// A containerd with NRI, the plugin registered with it (the runtime config naming `host`'s
/// root), and a CRI client.
fn node_with_plugin(dir: &Path, host: &FakeHost) -> (Containerd, Plugin, Cri) {
    let containerd = containerd_with_nri(dir);
    let plugin = Plugin::start(dir, host);
    plugin.wait_lines(&registered(dir), 1);
    let cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    (containerd, plugin, cri)
}

/// Rule (issue 32): through containerd 1.7.24's CRI plugin with no runtime handler, a pod's
/// container with a GPU among its devices (`/dev/nvidia2`, 195:2) gets a devremap `/dev` (a
/// FUSE mount) holding its GPU and not the host's other one, where `/dev/null`, `/dev/pts` and
/// `/dev/shm` work, and its spec carries its record `devremap.io/gpus` (the host's UUID of GPU
/// 2); a GPU-less container asking by pod annotation or by its own annotation
/// `devremap.io/enable` gets one too; the pods' sandboxes and a plain container get none (no
/// directory, runc's tmpfs `/dev`). StopContainer/RemoveContainer leave no directory, mount,
/// keeper or `ctl list` entry. The plugin SIGKILLed while the GPU pod runs: the container's
/// `/dev` keeps answering (its keeper holds it); a node daemon started again registers, adopts
/// the running one and at Synchronize tears down the one removed meanwhile. containerd
/// restarted while the pod runs: the plugin registers again and the container's `/dev` still
/// answers. At the end nothing is served.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn containers_get_a_devremap_dev_through_plugin_and_containerd_restarts() {
    need_fuse();
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let (mut containerd, mut plugin, mut cri) = node_with_plugin(dir, &host);

    let gpus = Pod::run(&mut cri, dir, "nri-gpu");
    let cuda = gpus.start(&mut cri, sleeper("cuda", vec![gpu(dir, 2)], &[]));
    let served_gpu2 = || ("fuse".to_owned(), vec!["c3:2".to_owned(), "missing".to_owned()]);
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2(), "{}", plugin.log());
    let record = spec_annotation(&containerd, &cuda, GPUS).expect("the GPU container's spec has its record");
    let record: Value = serde_json::from_str(&record).unwrap();
    assert_eq!((record[0]["minor"].as_u64(), record[0]["uuid"].as_str()), (Some(2), Some(host_uuid(2).as_str())));

    let asking = Pod::run_with(&mut cri, dir, "nri-asking", &[(ENABLE, "true")]);
    let by_pod = asking.start(&mut cri, sleeper("tools", vec![], &[]));
    let plain = Pod::run(&mut cri, dir, "nri-plain");
    let by_container = plain.start(&mut cri, sleeper("tools", vec![], &[(ENABLE, "true")]));
    let untouched = plain.start(&mut cri, sleeper("sleeper", vec![], &[]));
    for id in [&by_pod, &by_container] {
        assert_eq!(dev_of(&mut cri, id, &[]).0, "fuse", "container {id}: {}", plugin.log());
    }
    assert_eq!(dev_of(&mut cri, &untouched, &[]).0, "tmpfs");
    assert_eq!(spec_annotation(&containerd, &untouched, GPUS), None);
    let mut served = vec![cuda.clone(), by_pod.clone(), by_container.clone()];
    served.sort();
    assert_eq!(plugin.served(), served, "only the containers asking have a directory (no sandbox)");
    assert_eq!(plugin.listed(), served);

    Pod::stop_container(&mut cri, &by_container);
    plugin.wait_gone(&by_container);
    Pod::remove_container(&mut cri, &by_container);

    plugin.kill();
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2(), "the keeper serves on");
    Pod::stop_container(&mut cri, &by_pod);
    Pod::remove_container(&mut cri, &by_pod);
    plugin.start_again();
    plugin.wait_lines(&registered(dir), 2);
    plugin.wait_gone(&by_pod);
    assert_eq!((plugin.served(), plugin.listed()), (vec![cuda.clone()], vec![cuda.clone()]));
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2());

    drop(cri);
    containerd.restart();
    plugin.wait_lines(&registered(dir), 3);
    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2());
    assert_eq!(plugin.served(), vec![cuda.clone()], "a Synchronize after containerd's restart keeps it");

    Pod::stop_container(&mut cri, &cuda);
    Pod::remove_container(&mut cri, &cuda);
    plugin.wait_gone(&cuda);
    for pod in [gpus, asking, plain] {
        pod.remove(&mut cri);
    }
    assert_eq!((plugin.served(), plugin.listed()), (vec![], vec![]));
}

/// Rule (issue 32): a CRI restore, simulated (no registry here ships containerd 2.1, whose CRI
/// restore creates the container with the checkpoint's annotations): a GPU container's record
/// `devremap.io/gpus` taken from its spec as containerd keeps it (what `CheckpointContainer`
/// saves), and CreateContainer made as containerd 2.1 makes it, with that annotation, on a host
/// where the record's GPU (its UUID) is now GPU 3, the container given GPU 3: the container
/// finds its GPU under its old name `nvidia2` (195:3), and its new record names the old name.
/// A hostile record (not a record; naming more GPUs than the container's devices) fails
/// CreateContainer with an error naming the annotation, and leaves no container, directory,
/// mount or keeper.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn a_container_created_with_its_checkpoints_record_is_served_the_remap() {
    need_fuse();
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let (containerd, plugin, mut cri) = node_with_plugin(dir, &host);
    let pod = Pod::run(&mut cri, dir, "nri-restore");
    let before = pod.start(&mut cri, sleeper("cuda", vec![gpu(dir, 2)], &[]));
    let record = spec_annotation(&containerd, &before, GPUS).expect("the GPU container's spec has its record");
    Pod::stop_container(&mut cri, &before);
    Pod::remove_container(&mut cri, &before);
    plugin.wait_gone(&before);

    // The restore host: the checkpoint's GPU is now minor 3, and minor 2 is another GPU.
    host.describe(&GpuFacts { uuid: host_uuid(2), ..GpuFacts::nvidia(3) });
    host.describe(&GpuFacts { uuid: host_uuid(3), ..GpuFacts::nvidia(2) });
    let after = pod.start(&mut cri, sleeper("cuda-restored", vec![gpu(dir, 3)], &[(GPUS, &record)]));
    assert_eq!(
        dev_of(&mut cri, &after, &["nvidia2"]),
        ("fuse".to_owned(), vec!["c3:3".to_owned()]),
        "{}",
        plugin.log()
    );
    let again: Value = serde_json::from_str(&spec_annotation(&containerd, &after, GPUS).unwrap()).unwrap();
    assert_eq!((again[0]["minor"].as_u64(), &again[0]["earlier_minors"]), (Some(3), &json!([2])), "{again}");

    let mut two: Vec<Value> = serde_json::from_str(&record).unwrap();
    let mut other = two[0].clone();
    (other["minor"], other["uuid"]) = (json!(3), json!(host_uuid(3)));
    two.push(other);
    let before_hostile = containerd.ctr_ok(&["containers", "ls", "-q"]);
    for hostile in ["[{\"minor\": true}]".to_owned(), Value::from(two).to_string()] {
        let refused = pod
            .try_create(&mut cri, sleeper("hostile", vec![gpu(dir, 3)], &[(GPUS, &hostile)]))
            .expect_err("a hostile record is refused");
        assert!(refused.message().contains("annotation devremap.io/gpus"), "{hostile}: {refused}");
        assert_eq!(plugin.served(), vec![after.clone()], "{hostile}");
        assert_eq!(containerd.ctr_ok(&["containers", "ls", "-q"]), before_hostile, "{hostile}");
        assert_eq!(plugin.listed(), vec![after.clone()], "{hostile}");
    }

    Pod::stop_container(&mut cri, &after);
    Pod::remove_container(&mut cri, &after);
    plugin.wait_gone(&after);
    pod.remove(&mut cri);
}
