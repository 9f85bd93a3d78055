//! containerd of our own for the tests that drive it: a release as its Debian package ships it
//! (`.ci/containerd-packages`), started on its own socket, root and state directories and
//! stopped after; an offline busybox image to import; a CRI client as a kubelet is one.
//! Included by the test files that use it (`#[path = "common/cri.rs"] mod cri;`), beside
//! `mod common;`.

#![allow(dead_code)]

use crate::common::bundle::{Runtime, need_containers};
use crate::common::clients::{busybox_rootfs, need_client, succeeded, wait_client};
use crate::common::daemon::unmount;
use crate::common::write_file;
use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ImageSpec, ImageStatusRequest, LinuxPodSandboxConfig, LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata, RunPodSandboxRequest,
};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

pub const IMAGE: &str = "docker.io/devremap/busybox:test";

/// Fails the calling (`#[ignore]`d) test unless containerd and ctr are installed.
pub fn need_containerd() {
    need_client("containerd", &["containerd", "ctr", "containerd-shim-runc-v2"]);
}

/// A containerd of our own, stopped (with its containers in `namespace`) when dropped.
pub struct Containerd {
    pub child: Child,
    pub dir: PathBuf,
    pub id: String,
    pub namespace: &'static str,
    /// The `PATH` of containerd, its shims and `ctr`: a release's binaries first.
    pub path: String,
    /// What it was started with, for [`Containerd::restart`].
    config: PathBuf,
    env: Vec<(String, PathBuf)>,
}

/// A containerd release as its Debian package ships it, unpacked by `.ci/containerd-packages`
/// (into `target/clients/`, or `DEVREMAP_CONTAINERD_PACKAGES`): its binaries, and the
/// `/etc/containerd/config.toml` the package installs.
pub struct Release {
    pub root: PathBuf,
}

impl Release {
    /// Debian 12's containerd and Debian 13's; fails the calling (`#[ignore]`d) test unless both
    /// are unpacked.
    pub fn all() -> Vec<Release> {
        ["debian12", "debian13"].into_iter().map(Release::named).collect()
    }

    /// Debian `name`'s containerd (`debian12`, `debian13`); fails the calling (`#[ignore]`d)
    /// test unless it is unpacked.
    pub fn named(name: &str) -> Release {
        need_containers(Runtime::Runc);
        let dir = std::env::var_os("DEVREMAP_CONTAINERD_PACKAGES")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/clients"));
        let root = dir.join(format!("containerd-{name}"));
        assert!(
            root.join("usr/bin/containerd").is_file(),
            "{} is missing: run `bash .ci/containerd-packages` (as .ci/run does); this test runs it",
            root.display()
        );
        Release { root }
    }

    pub fn path(&self) -> String {
        format!("{}:{}", self.root.join("usr/bin").display(), std::env::var("PATH").unwrap_or_default())
    }

    /// What `containerd --version` prints, for the failures' messages and the log.
    pub fn version(&self) -> String {
        let out = Command::new(self.root.join("usr/bin/containerd")).arg("--version").output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `containerd --config <config> <args>` of this release; its stdout.
    pub fn containerd(&self, config: &Path, args: &[&str]) -> String {
        let mut c = Command::new(self.root.join("usr/bin/containerd"));
        c.arg("--config").arg(config).args(args);
        succeeded(&format!("{}: containerd {args:?}", self.version()), c.stdin(Stdio::null()).output().unwrap(), || {
            String::new()
        })
    }
}

impl Containerd {
    /// Starts the installed containerd without its CRI plugin, on a config of the test's own
    /// (the opt plugin's directory too, else /opt/containerd).
    pub fn start(dir: &Path, env: &[(&str, &Path)]) -> Containerd {
        let config = write_file(
            dir,
            "containerd.toml",
            format!(
                "version = 2\nroot = \"{0}/root\"\nstate = \"{0}/state\"\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{0}/containerd.sock\"\n[ttrpc]\n  address = \"{0}/containerd.ttrpc.sock\"\n\
                 [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{0}/containerd-opt\"\n",
                dir.display()
            ),
        );
        let path = std::env::var("PATH").unwrap_or_default();
        Containerd::spawn(dir, env, path, &config, "devremap-test")
    }

    /// Starts `release`'s containerd on a node's `config` (its CRI plugin's namespace), with the
    /// root, state and socket of the test's own given on the command line, which the config's
    /// own give way to.
    pub fn start_node(dir: &Path, env: &[(&str, &Path)], release: &Release, config: &Path) -> Containerd {
        Containerd::spawn(dir, env, release.path(), config, "k8s.io")
    }

    pub fn spawn(
        dir: &Path,
        env: &[(&str, &Path)],
        path: String,
        config: &Path,
        namespace: &'static str,
    ) -> Containerd {
        let env: Vec<(String, PathBuf)> = env.iter().map(|(k, v)| ((*k).to_owned(), v.to_path_buf())).collect();
        let log = fs::File::create(dir.join("containerd.log")).unwrap();
        let c = Containerd {
            child: launch(dir, &env, &path, config, log),
            dir: dir.to_owned(),
            id: format!("devremap-ctr-{}", std::process::id()),
            namespace,
            path,
            config: config.to_owned(),
            env,
        };
        c.wait_answers();
        c
    }

    /// Stops containerd (SIGTERM) and starts it again on the same config and directories, its
    /// log appended to: its shims, and so its containers, run on meanwhile, as on a node whose
    /// containerd is restarted.
    pub fn restart(&mut self) {
        // SAFETY: kill our child containerd.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
        let log = fs::OpenOptions::new().append(true).open(self.dir.join("containerd.log")).unwrap();
        self.child = launch(&self.dir, &self.env, &self.path, &self.config, log);
        self.wait_answers();
    }

    fn wait_answers(&self) {
        let log = || fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        wait_client("containerd to answer", log, || self.ctr(&["version"]).status.success().then_some(()));
    }

    /// `ctr --address <ours> --namespace <ours> <args>`.
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", self.namespace])
            .args(args)
            .env("PATH", &self.path)
            .stdin(Stdio::null())
            .output()
            .expect("ctr runs")
    }

    pub fn ctr_ok(&self, args: &[&str]) -> String {
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
        for image in listed("images") {
            let _ = self.ctr(&["images", "remove", &image]);
        }
        // SAFETY: kill our child containerd.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
        // The shim's runc root for our namespace, empty once its containers are gone.
        let _ = fs::remove_dir(format!("/run/containerd/runc/{}", self.namespace));
        // The CRI plugin's sandbox mounts (shm) and the snapshotter's, left by a test that
        // failed mid-way: every mount under state/ and root/, deepest first (`umount -R` of
        // the directories themselves, which are no mount points, left them all).
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut left: Vec<PathBuf> = mountinfo
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
            .filter(|m| ["state", "root"].iter().any(|d| m.starts_with(self.dir.join(d))))
            .collect();
        left.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
        for mount in left {
            unmount(&mount);
        }
    }
}

/// containerd on `config` with the root, state and socket of `dir`, logging to `log`.
fn launch(dir: &Path, env: &[(String, PathBuf)], path: &str, config: &Path, log: fs::File) -> Child {
    Command::new("containerd")
        .arg("--config")
        .arg(config)
        .arg("--root")
        .arg(dir.join("root"))
        .arg("--state")
        .arg(dir.join("state"))
        .arg("--address")
        .arg(dir.join("containerd.sock"))
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("containerd starts")
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
pub fn busybox_image(dir: &Path) -> PathBuf {
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

/// A CRI client on containerd's socket, as a kubelet is one: each call run to its end.
pub struct Cri {
    pub rt: tokio::runtime::Runtime,
    pub runtime: RuntimeServiceClient<Channel>,
    pub images: ImageServiceClient<Channel>,
    /// containerd's log, shown with a failed call.
    pub log: PathBuf,
}

impl Cri {
    pub fn connect(socket: &Path, log: PathBuf) -> Cri {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let socket = socket.to_owned();
        let channel = rt
            .block_on(Endpoint::from_static("http://[::]").connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
            })))
            .expect("the CRI socket answers");
        Cri { rt, runtime: RuntimeServiceClient::new(channel.clone()), images: ImageServiceClient::new(channel), log }
    }

    /// Waits until the CRI plugin knows image `name`. It learns of an image `ctr` imported or
    /// tagged from containerd's events, after `ctr` returns: a RunPodSandbox right after finds
    /// no sandbox image and pulls it, which fails offline (seen on containerd 1.7.24, CI).
    pub fn wait_image(&self, name: &str) {
        let request =
            ImageStatusRequest { image: Some(ImageSpec { image: name.into(), ..Default::default() }), verbose: false };
        wait_client(
            &format!("the CRI plugin to know image {name}"),
            || fs::read_to_string(&self.log).unwrap_or_default(),
            || {
                let mut client = self.images.clone();
                let status = self.rt.block_on(client.image_status(request.clone())).ok()?;
                status.into_inner().image.map(|_| ())
            },
        );
    }

    /// Runs one call; a failure names the call and containerd's status.
    pub fn call<T, F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>>(
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

/// Pod `name`'s config as a kubelet sends it, with `annotations`, on the host's network (no CNI
/// here), its logs in `logs`.
pub fn pod_config(name: &str, uid: &str, logs: &Path, annotations: &[(&str, &str)]) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: logs.to_str().expect("a UTF-8 path").into(),
        annotations: annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption { network: NamespaceMode::Node as i32, ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl Cri {
    /// RunPodSandbox of `config` with the runtime `handler` (empty: the default); the sandbox's id.
    pub fn run_pod_sandbox(&mut self, config: &PodSandboxConfig, handler: &str) -> String {
        self.call("RunPodSandbox", |mut c| {
            let request = RunPodSandboxRequest { config: Some(config.clone()), runtime_handler: handler.into() };
            async move { c.run_pod_sandbox(request).await }
        })
        .pod_sandbox_id
    }
}
