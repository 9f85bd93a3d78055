//! containerd running containers through `devremap-runtime`: `ctr run --runc-binary`, and
//! containerd's CRI plugin with the shipped `devremap` runtime handler (dist/containerd/),
//! driven by a CRI client the way a kubelet drives it. Debian's containerd is started by the
//! test on its own socket, root and state directories and stopped after.
//!
//! The image is built offline from the static busybox: one uncompressed layer (`bin/busybox`
//! and its applets), an OCI config and manifest, imported with `ctr images import`. The host
//! is the fake one of tests/runtime.rs (GPU `nvidia1` is char 1:5, zero); the container asks
//! for devremap with `--annotation devremap.io/enable=true`.

mod common;

use common::clients::{WRAPPER, WrappedHost, busybox_rootfs, need_client, shipped, succeeded, wait_client};
use common::daemon::{is_mounted, wait_for};
use common::{arg, write_file};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use tempfile::TempDir;

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, Device, ExecSyncRequest, ImageSpec,
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopPodSandboxRequest,
};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

const IMAGE: &str = "docker.io/devremap/busybox:test";

/// Fails the calling (`#[ignore]`d) test unless containerd and ctr are installed.
fn need_containerd() {
    need_client("containerd", &["containerd", "ctr", "containerd-shim-runc-v2"]);
}

/// A containerd of our own, stopped (with its containers in `namespace`) when dropped.
struct Containerd {
    child: Child,
    dir: PathBuf,
    id: String,
    namespace: &'static str,
}

/// The CRI plugin's settings for a test: the busybox image as the pod sandbox (nothing is
/// pulled), the sandbox's OOM score no lower than ours (this machine refuses the -998 a sandbox
/// asks for, as a nested node does), the native snapshotter, the default `runc` handler (the
/// CRI plugin refuses to load without it), CNI directories of the test's own (pods use the
/// host's network), and the shipped `devremap` runtime handler.
fn cri_config(dir: &Path, wrapper_config: &Path) -> String {
    format!(
        "[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"{IMAGE}\"\n  restrict_oom_score_adj = true\n\
         [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"native\"\n\
         [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\
         [plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"{0}/cni/bin\"\n  conf_dir = \"{0}/cni/conf\"\n{1}",
        dir.display(),
        // One file here: the drop-in's own `version` would be a second key of that name.
        shipped("containerd/config.toml", wrapper_config).replace("version = 2\n", "")
    )
}

impl Containerd {
    /// Starts containerd; `cri` is the CRI plugin's config, or `None` to run it without CRI.
    fn start(dir: &Path, env: &[(&str, &Path)], cri: Option<String>) -> Containerd {
        let (disabled, namespace) = match &cri {
            Some(_) => ("", "k8s.io"),
            None => ("\"io.containerd.grpc.v1.cri\"", "devremap-test"),
        };
        let config = write_file(
            dir,
            "containerd.toml",
            format!(
                "version = 2\nroot = \"{0}/root\"\nstate = \"{0}/state\"\ndisabled_plugins = [{disabled}]\n\
                 [grpc]\n  address = \"{0}/containerd.sock\"\n[ttrpc]\n  address = \"{0}/containerd.ttrpc.sock\"\n{1}",
                dir.display(),
                cri.unwrap_or_default()
            ),
        );
        let log = fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd starts");
        let c =
            Containerd { child, dir: dir.to_owned(), id: format!("devremap-ctr-{}", std::process::id()), namespace };
        let log = || fs::read_to_string(dir.join("containerd.log")).unwrap_or_default();
        wait_client("containerd to answer", log, || c.ctr(&["version"]).status.success().then_some(()));
        c
    }

    /// `ctr --address <ours> --namespace <ours> <args>`.
    fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", self.namespace])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("ctr runs")
    }

    fn ctr_ok(&self, args: &[&str]) -> String {
        succeeded(&format!("ctr {args:?}"), self.ctr(args), || {
            fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
        })
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let listed = |what: &str| {
            let out = self.ctr(&[what, "ls", "-q"]);
            String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_owned).collect::<Vec<_>>()
        };
        for task in listed("task") {
            let _ = self.ctr(&["task", "kill", "--signal", "SIGKILL", &task]);
            let _ = self.ctr(&["task", "delete", "--force", &task]);
        }
        for container in listed("container") {
            let _ = self.ctr(&["container", "delete", &container]);
        }
        let _ = self.ctr(&["images", "remove", IMAGE]);
        // SAFETY: kill our child containerd.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
        // The shim's runc root for our namespace, empty once its containers are gone.
        let _ = fs::remove_dir(format!("/run/containerd/runc/{}", self.namespace));
        // The CRI plugin's sandbox mounts (shm), left by a test that failed mid-way.
        let _ = Command::new("umount").arg("-R").arg("-l").arg(self.dir.join("state")).status();
    }
}

/// `sha256:<hex>` of a file, and its size.
fn digest(path: &Path) -> (String, u64) {
    let out = Command::new("sha256sum").arg(path).output().expect("sha256sum runs");
    let hex = String::from_utf8(out.stdout).unwrap().split_whitespace().next().unwrap().to_owned();
    (format!("sha256:{hex}"), fs::metadata(path).unwrap().len())
}

/// Puts `path` into the layout's blobs, returning its descriptor.
fn blob(layout: &Path, path: &Path, media_type: &str) -> Value {
    let (digest, size) = digest(path);
    fs::copy(path, layout.join("blobs/sha256").join(digest.trim_start_matches("sha256:"))).unwrap();
    json!({"mediaType": media_type, "digest": digest, "size": size})
}

/// An OCI image archive of the static busybox, with `IMAGE` as its name; it sleeps when run
/// without a command, so it also serves as a pod's sandbox (pause) image.
fn busybox_image(dir: &Path) -> PathBuf {
    let rootfs = busybox_rootfs(dir);
    let layer = dir.join("layer.tar");
    let ok = Command::new("tar").arg("-C").arg(&rootfs).arg("-cf").arg(&layer).arg(".").status().unwrap();
    assert!(ok.success());
    let layout = dir.join("layout");
    fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    let layer_desc = blob(&layout, &layer, "application/vnd.oci.image.layer.v1.tar");
    let config = write_file(
        dir,
        "config.json",
        json!({"architecture": std::env::consts::ARCH.replace("x86_64", "amd64").replace("aarch64", "arm64"),
               "os": "linux", "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sleep", "86400"]},
               "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]}})
        .to_string(),
    );
    let config_desc = blob(&layout, &config, "application/vnd.oci.image.config.v1+json");
    let manifest = write_file(
        dir,
        "manifest.json",
        json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
               "config": config_desc, "layers": [layer_desc]})
        .to_string(),
    );
    let mut manifest_desc = blob(&layout, &manifest, "application/vnd.oci.image.manifest.v1+json");
    manifest_desc["annotations"] =
        json!({"io.containerd.image.name": IMAGE, "org.opencontainers.image.ref.name": "test"});
    fs::write(layout.join("index.json"), json!({"schemaVersion": 2, "manifests": [manifest_desc]}).to_string())
        .unwrap();
    fs::write(layout.join("oci-layout"), r#"{"imageLayoutVersion": "1.0.0"}"#).unwrap();
    let archive = dir.join("image.tar");
    let ok = Command::new("tar").arg("-C").arg(&layout).arg("-cf").arg(&archive).arg(".").status().unwrap();
    assert!(ok.success());
    archive
}

/// Rule (issue 12.3): containerd runs a container through the wrapper (`ctr run
/// --runc-binary`): its `/dev` is the devremap mount with the host's GPUs, and deleting the
/// task stops the daemon and removes its directory.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd: runs containerd"]
fn containerd_runs_a_container_through_the_wrapper() {
    need_containerd();
    let tmp = TempDir::new().unwrap();
    let w = WrappedHost::new(tmp.path());
    let state_dir = w.state_dir.clone();
    // The shim runs the wrapper with containerd's environment.
    let c = Containerd::start(tmp.path(), &[("DEVREMAP_RUNTIME_CONFIG", &w.config)], None);
    c.ctr_ok(&["images", "import", arg(&busybox_image(tmp.path()))]);
    let log = tmp.path().join("container.log");
    let script = "while read -r s mp fs rest; do [ \"$mp\" = /dev ] && echo \"dev.fs: $fs\"; done < /proc/mounts; \
                  echo \"nvidia1: $(stat -c %t:%T /dev/nvidia1)\"; echo ready; exec sleep 600";
    c.ctr_ok(&[
        "run",
        "--detach",
        "--snapshotter",
        "native",
        "--runc-binary",
        WRAPPER,
        "--annotation",
        "devremap.io/enable=true",
        "--log-uri",
        &format!("file://{}", log.display()),
        IMAGE,
        &c.id,
        "/bin/sh",
        "-c",
        script,
    ]);
    let output = || fs::read_to_string(&log).unwrap_or_default();
    wait_for("the container's report", || output().contains("ready").then_some(()));
    assert!(output().contains("dev.fs: fuse\n") && output().contains("nvidia1: 1:5\n"), "{}", output());
    let dir = state_dir.join(&c.id);
    assert!(is_mounted(&dir.join("dev")));
    let daemon: u32 = fs::read_to_string(dir.join("devremapd.pid")).unwrap().trim().parse().unwrap();

    c.ctr_ok(&["task", "kill", "--signal", "SIGKILL", &c.id]);
    wait_for("the task to stop", || {
        c.ctr_ok(&["task", "ls"]).lines().any(|l| l.starts_with(&c.id) && l.contains("STOPPED")).then_some(())
    });
    c.ctr_ok(&["task", "delete", &c.id]);
    wait_for("the daemon to stop", || {
        (!fs::read(format!("/proc/{daemon}/cmdline")).is_ok_and(|c| !c.is_empty())).then_some(())
    });
    assert!(!dir.exists(), "the task's delete left {}", dir.display());
    c.ctr_ok(&["container", "delete", &c.id]);
}

/// A CRI client on containerd's socket, as a kubelet is one: each call run to its end.
struct Cri {
    rt: tokio::runtime::Runtime,
    runtime: RuntimeServiceClient<Channel>,
    /// containerd's log, shown with a failed call.
    log: PathBuf,
}

impl Cri {
    fn connect(socket: &Path, log: PathBuf) -> Cri {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let socket = socket.to_owned();
        let channel = rt
            .block_on(Endpoint::from_static("http://[::]").connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
            })))
            .expect("the CRI socket answers");
        Cri { rt, runtime: RuntimeServiceClient::new(channel), log }
    }

    /// Runs one call; a failure names the call and containerd's status.
    fn call<T, F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>>(
        &mut self,
        what: &str,
        f: impl FnOnce(RuntimeServiceClient<Channel>) -> F,
    ) -> T {
        let client = self.runtime.clone();
        match self.rt.block_on(f(client)) {
            Ok(r) => r.into_inner(),
            Err(status) => {
                let log = fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(25).collect();
                panic!("CRI {what}: {status}\n--- containerd log (last lines first) ---\n{}", tail.join("\n"))
            }
        }
    }
}

/// Rule (issue 17.5): a pod with one GPU container, through containerd's CRI plugin and the
/// shipped `devremap` runtime handler, as a kubelet makes it: RunPodSandbox with the handler
/// and the pod annotation `devremap.io/enable` (passed on by `pod_annotations` to the sandbox
/// and the container), CreateContainer with `/dev/nvidia1` among its devices, ExecSync. The
/// pod costs one devremap daemon, not two (the sandbox gets none); the container's `/dev` is
/// the devremap mount; stopping and removing the pod leaves no daemon, mount or state dir.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd: runs containerd's CRI plugin"]
fn a_cri_pod_through_the_runtime_handler() {
    need_containerd();
    let tmp = TempDir::new().unwrap();
    let w = WrappedHost::new(tmp.path());
    let c = Containerd::start(
        tmp.path(),
        &[("DEVREMAP_RUNTIME_CONFIG", &w.config)],
        Some(cri_config(tmp.path(), &w.config)),
    );
    c.ctr_ok(&["images", "import", arg(&busybox_image(tmp.path()))]);
    let mut cri = Cri::connect(&tmp.path().join("containerd.sock"), tmp.path().join("containerd.log"));
    let logs = tmp.path().join("pod-logs");
    fs::create_dir_all(&logs).unwrap();
    let uid = format!("pod-{}", std::process::id());
    let pod = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "gpu-pod".into(),
            uid: uid.clone(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: arg(&logs).into(),
        annotations: [("devremap.io/enable".to_owned(), "true".to_owned())].into(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption { network: NamespaceMode::Node as i32, ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let sandbox = cri
        .call("RunPodSandbox", |mut c| {
            let pod = pod.clone();
            async move {
                c.run_pod_sandbox(RunPodSandboxRequest { config: Some(pod), runtime_handler: "devremap".into() }).await
            }
        })
        .pod_sandbox_id;
    assert!(w.containers().is_empty(), "the sandbox got a daemon: {:?}", w.containers());

    let gpu = w.host.dev().join("nvidia1");
    let container = ContainerConfig {
        metadata: Some(ContainerMetadata { name: "cuda".into(), attempt: 0 }),
        image: Some(ImageSpec { image: IMAGE.into(), ..Default::default() }),
        command: vec!["/bin/sleep".into(), "86400".into()],
        log_path: "cuda.log".into(),
        devices: vec![Device {
            container_path: "/dev/nvidia1".into(),
            host_path: arg(&gpu).into(),
            permissions: "rw".into(),
        }],
        ..Default::default()
    };
    let id = cri
        .call("CreateContainer", |mut c| {
            let (sandbox, container, pod) = (sandbox.clone(), container.clone(), pod.clone());
            async move {
                c.create_container(CreateContainerRequest {
                    pod_sandbox_id: sandbox,
                    config: Some(container),
                    sandbox_config: Some(pod),
                })
                .await
            }
        })
        .container_id;
    cri.call("StartContainer", |mut c| {
        let id = id.clone();
        async move { c.start_container(StartContainerRequest { container_id: id }).await }
    });
    assert_eq!(w.containers(), std::slice::from_ref(&id), "one daemon for the pod: its GPU container's");
    let mut exec = |cmd: &[&str]| {
        let r = cri.call("ExecSync", |mut c| {
            let (id, cmd) = (id.clone(), cmd.iter().map(|s| (*s).to_owned()).collect());
            async move { c.exec_sync(ExecSyncRequest { container_id: id, cmd, timeout: 60 }).await }
        });
        assert_eq!(r.exit_code, 0, "{cmd:?}: {}", String::from_utf8_lossy(&r.stderr));
        String::from_utf8_lossy(&r.stdout).into_owned()
    };
    assert_eq!(exec(&["stat", "-c", "%t:%T", "/dev/nvidia1"]), "1:5\n");
    assert_eq!(exec(&["sh", "-c", "grep -c ' /dev fuse ' /proc/mounts"]), "1\n", "the container's /dev is devremap's");

    cri.call("StopPodSandbox", |mut c| {
        let sandbox = sandbox.clone();
        async move { c.stop_pod_sandbox(StopPodSandboxRequest { pod_sandbox_id: sandbox }).await }
    });
    cri.call("RemovePodSandbox", |mut c| {
        let sandbox = sandbox.clone();
        async move { c.remove_pod_sandbox(RemovePodSandboxRequest { pod_sandbox_id: sandbox }).await }
    });
    w.wait_clean("RemovePodSandbox");
}
