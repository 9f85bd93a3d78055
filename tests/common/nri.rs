//! containerd with NRI and devremap's NRI plugin (issue 32), for tests/nri.rs and benches/nri.rs:
//! containerd 1.7.24 (Debian 13's package, unpacked by `.ci/containerd-packages`) with NRI
//! enabled on a socket of the caller's own, `devremapd node --nri` registered with it (or not),
//! and pods made through CRI as a kubelet makes them. Included beside `mod common;` and the
//! CRI helpers (`#[path = "common/cri.rs"] mod cri;`) as `#[path = "common/nri.rs"] mod nri;`.

#![allow(dead_code)]

use crate::common::clients::wait_client;
use crate::common::daemon::{container_dirs, is_mounted, keepers_under, kill_keepers_and_unmount, stop_node};
use crate::common::{BIN, FakeHost, arg, mknod_char, write_file};
use crate::cri::{Containerd, Cri, IMAGE, Release, busybox_image, need_containerd, pod_config};
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, Device, ImageSpec, PodSandboxConfig,
    RemoveContainerRequest, RemovePodSandboxRequest, StartContainerRequest, StopContainerRequest,
    StopPodSandboxRequest,
};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// containerd 1.7.24 on `dir`, its NRI enabled on `<dir>/nri.sock` (no plugin directory of its
/// own to launch from), the busybox image imported and used as the pods' sandbox image.
pub fn containerd_with_nri(dir: &Path) -> Containerd {
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
pub struct Plugin {
    child: Child,
    dir: PathBuf,
}

impl Plugin {
    pub fn start(dir: &Path, host: &FakeHost) -> Plugin {
        let config = json!({"host_root": arg(&host.root()), "state_dir": arg(&dir.join("node"))});
        write_file(dir, "runtime.json", config.to_string());
        Plugin { child: Plugin::spawn(dir), dir: dir.to_owned() }
    }

    pub fn spawn(dir: &Path) -> Child {
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
    pub fn kill(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// A node daemon started again on the same state dir and config.
    pub fn start_again(&mut self) {
        self.child = Plugin::spawn(&self.dir);
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }

    /// Waits until the node's log has `line` `times` times.
    pub fn wait_lines(&self, line: &str, times: usize) {
        wait_client(
            &format!("{times}x {line:?} in the node's log"),
            || self.log(),
            || (self.log().lines().filter(|l| l.contains(line)).count() >= times).then_some(()),
        );
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) of our child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("node")
    }

    /// The containers with a directory in the state dir, sorted.
    pub fn served(&self) -> Vec<String> {
        container_dirs(&self.state_dir())
    }

    /// The ids `devremapd ctl list` prints, sorted.
    pub fn listed(&self) -> Vec<String> {
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
    pub fn wait_gone(&self, id: &str) {
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
pub fn registered(dir: &Path) -> String {
    format!("nri: registered with containerd on {} as plugin 10-devremap", dir.join("nri.sock").display())
}

/// A pod named `name` (the host's network: no CNI here) and its containers, each CRI call
/// made as a kubelet makes it.
pub struct Pod {
    pub config: PodSandboxConfig,
    pub sandbox: String,
}

/// A container `name` that sleeps, with `devices` and `annotations`.
pub fn sleeper(name: &str, devices: Vec<Device>, annotations: &[(&str, &str)]) -> ContainerConfig {
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
pub fn gpu(dir: &Path, minor: u32) -> Device {
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
    pub fn run(cri: &mut Cri, dir: &Path, name: &str) -> Pod {
        Pod::run_with(cri, dir, name, &[])
    }

    pub fn run_with(cri: &mut Cri, dir: &Path, name: &str, annotations: &[(&str, &str)]) -> Pod {
        let logs = dir.join("pod-logs").join(name);
        fs::create_dir_all(&logs).unwrap();
        let config = pod_config(name, &format!("{name}-{}", std::process::id()), &logs, annotations);
        // The busybox image is the sandbox's too.
        cri.wait_image(IMAGE);
        let sandbox = cri.run_pod_sandbox(&config, "");
        Pod { config, sandbox }
    }

    /// CreateContainer of `container`: its id, or containerd's refusal.
    pub fn try_create(&self, cri: &mut Cri, container: ContainerConfig) -> Result<String, tonic::Status> {
        let request = CreateContainerRequest {
            pod_sandbox_id: self.sandbox.clone(),
            config: Some(container),
            sandbox_config: Some(self.config.clone()),
        };
        let mut client = cri.runtime.clone();
        cri.rt.block_on(client.create_container(request)).map(|r| r.into_inner().container_id)
    }

    /// CreateContainer and StartContainer of `container`; its id.
    pub fn start(&self, cri: &mut Cri, container: ContainerConfig) -> String {
        let id = self.try_create(cri, container).unwrap_or_else(|e| panic!("CreateContainer: {e}"));
        Pod::start_created(cri, &id);
        id
    }

    /// StartContainer of container `id`.
    pub fn start_created(cri: &mut Cri, id: &str) {
        cri.call("StartContainer", |mut c| {
            let container_id = id.to_owned();
            async move { c.start_container(StartContainerRequest { container_id }).await }
        });
    }

    /// CreateContainer and StartContainer of a container that sleeps; its id.
    pub fn start_container(&self, cri: &mut Cri) -> String {
        self.start(cri, sleeper("sleeper", vec![], &[]))
    }

    pub fn stop_container(cri: &mut Cri, id: &str) {
        cri.call("StopContainer", |mut c| {
            let container_id = id.to_owned();
            async move { c.stop_container(StopContainerRequest { container_id, timeout: 0 }).await }
        });
    }

    pub fn remove_container(cri: &mut Cri, id: &str) {
        cri.call("RemoveContainer", |mut c| {
            let container_id = id.to_owned();
            async move { c.remove_container(RemoveContainerRequest { container_id }).await }
        });
    }

    pub fn remove(self, cri: &mut Cri) {
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
