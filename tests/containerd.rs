//! containerd running a container through `devremap-runtime` (`ctr run --runc-binary`): the
//! way a containerd or Kubernetes user plugs the wrapper in, with Debian's containerd started by
//! the test on its own socket, root and state directories and stopped after.
//!
//! The image is built offline from the static busybox: one uncompressed layer (`bin/busybox`
//! and its applets), an OCI config and manifest, imported with `ctr images import`. The host
//! is the fake one of tests/runtime.rs (GPU `nvidia1` is char 1:5, zero); the container asks
//! for devremap with `--annotation devremap.io/enable=true`.

mod common;

use common::bundle::{APPLETS, BUSYBOX, Runtime, need_containers};
use common::daemon::{is_mounted, wait_for};
use common::{FakeHost, arg, write_file};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use tempfile::TempDir;

const WRAPPER: &str = env!("CARGO_BIN_EXE_devremap-runtime");
const IMAGE: &str = "docker.io/devremap/busybox:test";
const NAMESPACE: &str = "devremap-test";

/// Fails the calling (`#[ignore]`d) test unless containerd and ctr are installed.
fn need_containerd() {
    need_containers(Runtime::Runc);
    for bin in ["containerd", "ctr", "containerd-shim-runc-v2"] {
        let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).any(|d| d.join(bin).is_file());
        assert!(found, "{bin} is not installed (apt-get install containerd): this test runs containerd");
    }
}

/// A containerd of our own, stopped (and its container removed) when dropped.
struct Containerd {
    child: Child,
    dir: PathBuf,
    id: String,
}

impl Containerd {
    fn start(dir: &Path, env: &[(&str, &Path)]) -> Containerd {
        let config = write_file(
            dir,
            "containerd.toml",
            format!(
                "version = 2\nroot = \"{0}/root\"\nstate = \"{0}/state\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{0}/containerd.sock\"\n[ttrpc]\n  address = \"{0}/containerd.ttrpc.sock\"\n",
                dir.display()
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
        let c = Containerd { child, dir: dir.to_owned(), id: format!("devremap-ctr-{}", std::process::id()) };
        wait_for("containerd to answer", || c.ctr(&["version"]).status.success().then_some(()));
        c
    }

    /// `ctr --address <ours> --namespace devremap-test <args>`.
    fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", NAMESPACE])
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
        let _ = self.ctr(&["task", "kill", "--signal", "SIGKILL", &self.id]);
        let _ = self.ctr(&["task", "delete", "--force", &self.id]);
        let _ = self.ctr(&["container", "delete", &self.id]);
        let _ = self.ctr(&["images", "remove", IMAGE]);
        // SAFETY: kill our child containerd.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
        // The shim's runc root for our namespace, empty once its containers are gone.
        let _ = fs::remove_dir(format!("/run/containerd/runc/{NAMESPACE}"));
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

/// An OCI image archive of the static busybox, with `IMAGE` as its name.
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
               "os": "linux", "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
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
    let host = FakeHost::with_gpus(&[0, 1]);
    let state_dir = tmp.path().join("devremap");
    let wrapper_config = write_file(
        tmp.path(),
        "runtime.json",
        json!({"host_dev": arg(&host.dev()), "host_root": arg(&host.root()), "state_dir": arg(&state_dir)}).to_string(),
    );
    // The shim runs the wrapper with containerd's environment.
    let c = Containerd::start(tmp.path(), &[("DEVREMAP_RUNTIME_CONFIG", &wrapper_config)]);
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
