//! containerd running containers through `devremap-runtime`: `ctr run --runc-binary`, and
//! containerd's CRI plugin with the `devremap` runtime handler exactly as an operator installs
//! it: `dist/kubernetes/node-setup.sh` run on real containerd configs (the package's own, `containerd
//! config default`, an operator's), then containerd started on the result and driven by a CRI
//! client the way a kubelet drives it. The CRI tests run on containerd 1.6.20 (Debian 12's
//! package) and 1.7.24 (Debian 13's), as `.ci/containerd-packages` unpacks them; `ctr run` on
//! the installed containerd. Each containerd is started by the test on its own socket, root and
//! state directories and stopped after.
//!
//! The image is built offline from the static busybox: one uncompressed layer (`bin/busybox`
//! and its applets), an OCI config and manifest, imported with `ctr images import`. The host
//! is the fake one of tests/runtime.rs (GPU `nvidia1` is char 1:5, zero); the container asks
//! for devremap with `--annotation devremap.io/enable=true`.

mod common;
#[path = "common/cri.rs"]
mod cri;

use common::bundle::{nvidia_hook, oci_config};
use common::clients::{WRAPPER, WrappedHost, busybox_rootfs, succeeded};
use common::daemon::{is_mounted, wait_for};
use common::{arg, write_file};
use cri::{Containerd, Cri, IMAGE, Release, busybox_image, need_containerd, pod_config};
use serde_json::json;
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tempfile::TempDir;

use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, Device, ExecSyncRequest, ImageSpec,
    RemovePodSandboxRequest, StartContainerRequest, StopPodSandboxRequest,
};

/// Rule (issue 12.3): containerd runs a container through the wrapper (`ctr run
/// --runc-binary`): its `/dev` is the devremap mount, and deleting the task stops the daemon and
/// removes its directory. Rule (issue 29.3): the container gets the GPUs its spec asks for, as
/// runc and the NVIDIA toolkit would give them: one that asks for devremap alone (`--annotation
/// devremap.io/enable=true`) gets no `nvidia1`; one whose spec (`ctr run --config`) asks the
/// NVIDIA hook for every GPU, as `docker run --gpus all` does, gets the host's.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd: runs containerd"]
fn containerd_runs_a_container_through_the_wrapper() {
    need_containerd();
    let tmp = TempDir::new().unwrap();
    let w = WrappedHost::new(tmp.path());
    // The shim runs the wrapper with containerd's environment.
    let c = Containerd::start(tmp.path(), &[("DEVREMAP_RUNTIME_CONFIG", &w.config)]);
    c.ctr_ok(&["images", "import", arg(&busybox_image(tmp.path()))]);
    let script = "while read -r s mp fs rest; do [ \"$mp\" = /dev ] && echo \"dev.fs: $fs\"; done < /proc/mounts; \
                  if [ -e /dev/nvidia1 ]; then echo \"nvidia1: $(stat -c %t:%T /dev/nvidia1)\"; \
                  else echo 'nvidia1: none'; fi; echo ready; exec sleep 600";
    // Runs container `id` with `args` before its own, then checks what it reports, and deletes it.
    let run = |id: &str, args: &[&str], nvidia1: &str| {
        let log = tmp.path().join(format!("{id}.log"));
        let log_uri = format!("file://{}", log.display());
        let own = ["run", "--detach", "--runc-binary", WRAPPER, "--log-uri", &log_uri];
        c.ctr_ok(&[&own[..], args].concat());
        let output = || fs::read_to_string(&log).unwrap_or_default();
        wait_for("the container's report", || output().contains("ready").then_some(()));
        assert!(output().contains("dev.fs: fuse\n"), "{}", output());
        assert!(output().contains(&format!("nvidia1: {nvidia1}\n")), "{}", output());
        let dir = w.state_dir.join(id);
        assert!(is_mounted(&dir.join("dev")));
        let daemon: u32 = fs::read_to_string(dir.join("devremapd.pid")).unwrap().trim().parse().unwrap();

        c.ctr_ok(&["task", "kill", "--signal", "SIGKILL", id]);
        wait_for("the task to stop", || {
            c.ctr_ok(&["task", "ls"]).lines().any(|l| l.starts_with(id) && l.contains("STOPPED")).then_some(())
        });
        c.ctr_ok(&["task", "delete", id]);
        wait_for("the daemon to stop", || {
            (!fs::read(format!("/proc/{daemon}/cmdline")).is_ok_and(|c| !c.is_empty())).then_some(())
        });
        assert!(!dir.exists(), "the task's delete left {}", dir.display());
        c.ctr_ok(&["container", "delete", id]);
    };
    let id = c.id.as_str();
    let image = ["--snapshotter", "native", "--annotation", "devremap.io/enable=true", IMAGE, id];
    run(id, &[&image[..], &["/bin/sh", "-c", script]].concat(), "none");

    let mut spec = oci_config("gpus", &[]);
    let gpus = tmp.path().join("gpus");
    fs::create_dir(&gpus).unwrap();
    spec["root"] = json!({"path": arg(&busybox_rootfs(&gpus)), "readonly": true});
    spec["process"]["args"] = json!(["/bin/sh", "-c", script]);
    nvidia_hook(&mut spec, &gpus, Some("all"));
    let config = write_file(&gpus, "config.json", spec.to_string());
    let id = format!("{id}-gpus");
    run(&id, &["--config", arg(&config), &id], "1:5");
}

/// The node setup's script, as the image runs it.
const NODE_SETUP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/dist/kubernetes/node-setup.sh");

/// An operator's node: the NVIDIA toolkit's runtime as the default, the systemd cgroup driver
/// (kubeadm's), a private registry's pause image.
const OPERATORS: &str = r#"version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.example/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "nvidia"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
        privileged_without_host_devices = false
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
          BinaryName = "/usr/bin/nvidia-container-runtime"
          SystemdCgroup = true
"#;

/// `config` with `key = value` set in `table`: the key's line replaced where the table has it,
/// else the line added under the table's header, else the table added. What an operator of
/// this machine would set before the setup (see [`Node::set_up`]).
fn with_setting(config: &str, table: &str, key: &str, value: &str) -> String {
    let header = format!("[{table}]");
    let line = format!("{key} = {value}");
    let mut out = String::new();
    let (mut inside, mut done) = (false, false);
    for l in config.lines() {
        let trimmed = l.trim_start();
        if trimmed.starts_with('[') {
            if inside && !done {
                out.push_str(&format!("  {line}\n"));
                done = true;
            }
            inside = trimmed.trim_end() == header;
        } else if inside && !done && trimmed.starts_with(&format!("{key} =")) {
            out.push_str(&format!("{}{line}\n", &l[..l.len() - trimmed.len()]));
            done = true;
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    if inside && !done {
        out.push_str(&format!("  {line}\n"));
    } else if !done {
        out.push_str(&format!("\n{header}\n  {line}\n"));
    }
    out
}

/// The (table, line) pairs of a `containerd config dump`.
fn settings(dump: &str) -> BTreeSet<(String, String)> {
    let mut table = String::new();
    let mut out = BTreeSet::new();
    for line in dump.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with('[') {
            table = line.to_owned();
        } else {
            out.insert((table.clone(), line.to_owned()));
        }
    }
    out
}

/// A node of `release` set up as an operator sets it up: its containerd config `base`,
/// `node-setup.sh` (the shipped one, with the shipped entry and this build's binaries as the
/// image holds them) run on it, containerd started on the result.
struct Node {
    containerd: Containerd,
    /// `containerd config dump` before the setup and after.
    before: String,
    after: String,
    bin_dir: PathBuf,
}

impl Node {
    /// `@BIN@` in `base` is the directory the setup installs the binaries in.
    fn set_up(dir: &Path, release: &Release, base: &str, w: &WrappedHost) -> Node {
        let version = release.version();
        let config = dir.join("etc/containerd/config.toml");
        fs::create_dir_all(config.parent().unwrap()).unwrap();
        // This machine refuses the OOM score a sandbox asks for, as a nested node does; the
        // opt plugin's directory (/opt/containerd, /var/lib/containerd/opt) is the test's own.
        let base = with_setting(base, "plugins.\"io.containerd.grpc.v1.cri\"", "restrict_oom_score_adj", "true");
        let opt = format!("\"{}\"", dir.join("containerd-opt").display());
        let base = with_setting(&base, "plugins.\"io.containerd.internal.v1.opt\"", "path", &opt);
        // `with_setting` writes lines ending in \n: a CRLF config is given back its \r\n.
        let base = if base.contains("\r\n") { base.replace('\n', "\r\n") } else { base };
        let base = base.replace("@BIN@", &dir.join("bin").display().to_string());
        fs::write(&config, &base).unwrap();
        let before = release.containerd(&config, &["config", "dump"]);

        // The image's /opt/devremap: this build's binaries, and dist/'s runtime.json,
        // containerd entry and unit themselves. The unit goes to the test's directory, and no
        // systemd is asked to run it (tests/kubernetes.rs checks what node-setup asks).
        let source = dir.join("opt");
        fs::create_dir_all(source.join("bin")).unwrap();
        std::os::unix::fs::symlink(common::BIN, source.join("bin/devremapd")).unwrap();
        std::os::unix::fs::symlink(WRAPPER, source.join("bin/devremap-runtime")).unwrap();
        let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("dist");
        std::os::unix::fs::symlink(dist.join("runtime.json"), source.join("runtime.json")).unwrap();
        std::os::unix::fs::symlink(dist.join("containerd"), source.join("containerd")).unwrap();
        std::os::unix::fs::symlink(dist.join("systemd"), source.join("systemd")).unwrap();
        let bin_dir = dir.join("bin");
        let out = Command::new(NODE_SETUP)
            // The runtime handler this test runs containerd with (the default mode is NRI's).
            .env("DEVREMAP_MODE", "runtimeclass")
            .env("DEVREMAP_HOST", "")
            .env("DEVREMAP_SOURCE", &source)
            .env("DEVREMAP_BIN_DIR", &bin_dir)
            .env("DEVREMAP_RUNTIME_CONFIG", &w.config)
            .env("DEVREMAP_CONTAINERD_CONFIG", &config)
            .env("DEVREMAP_RESTART_CONTAINERD", "0")
            .env("DEVREMAP_SYSTEMD_UNIT", dir.join("etc/systemd/system/devremap.service"))
            .env("DEVREMAP_NODE_SERVICE", "0")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        succeeded(&format!("{version}: node-setup.sh"), out, || base.clone());
        let after = release.containerd(&config, &["config", "dump"]);

        let containerd = Containerd::start_node(dir, &[("DEVREMAP_RUNTIME_CONFIG", &w.config)], release, &config);
        let plugins = containerd.ctr_ok(&["plugins", "ls"]);
        assert!(
            plugins.lines().any(|l| {
                let fields: Vec<&str> = l.split_whitespace().collect();
                fields.get(1) == Some(&"cri") && fields.last() == Some(&"ok")
            }),
            "{version}: the CRI plugin did not load:\n{plugins}\n--- containerd log ---\n{}",
            fs::read_to_string(dir.join("containerd.log")).unwrap_or_default()
        );
        Node { containerd, before, after, bin_dir }
    }

    /// Fails unless every setting of the node's config is still there, and the handler is
    /// there with the wrapper where the setup put it.
    fn kept_everything(&self, release: &Release) {
        let (before, after) = (settings(&self.before), settings(&self.after));
        let handler = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap";
        // A runtime's options at their zero values are the shim's defaults, as no options are:
        // the runc the setup adds back (the CRI plugin's default) has none.
        let zero = |t: &str, l: &str| {
            t.ends_with(".options]") && [" = \"\"", " = 0", " = false"].iter().any(|z| l.ends_with(z))
        };
        // A handler of devremap's before the setup is replaced whole.
        let lost: Vec<_> = before.difference(&after).filter(|(t, l)| !zero(t, l) && !t.starts_with(handler)).collect();
        assert!(lost.is_empty(), "{}: the setup lost the node's settings {lost:#?}", release.version());
        let added: Vec<_> = after.difference(&before).filter(|(t, _)| !t.starts_with(handler)).collect();
        assert!(added.is_empty(), "{}: the setup changed {added:#?}", release.version());
        let binary = format!("BinaryName = \"{}/devremap-runtime\"", self.bin_dir.display());
        assert!(
            after.contains(&(format!("{handler}.options]"), binary.clone())),
            "{}: no {binary} in the handler:\n{}",
            release.version(),
            self.after
        );
    }
}

/// Rule (issue 17.5): a pod with one GPU container, through containerd's CRI plugin and the
/// `devremap` runtime handler, as a kubelet makes it: RunPodSandbox with the handler and the
/// pod annotation `devremap.io/enable` (passed on by `pod_annotations` to the sandbox and the
/// container), CreateContainer with `/dev/nvidia1` among its devices, ExecSync. The pod costs
/// one devremap daemon, not two (the sandbox gets none); the container's `/dev` is the
/// devremap mount; stopping and removing the pod leaves no daemon, mount or state dir. A pod
/// without the handler runs on the node's default runtime, without devremap.
fn run_pods(node: &Node, w: &WrappedHost, dir: &Path) {
    let c = &node.containerd;
    c.ctr_ok(&["images", "import", arg(&busybox_image(dir))]);
    // The node's own pause image is the busybox one: nothing is pulled.
    let sandbox_image = settings(&node.after)
        .into_iter()
        .find_map(|(t, l)| {
            (t == "[plugins.\"io.containerd.grpc.v1.cri\"]")
                .then(|| l.strip_prefix("sandbox_image = ").map(|v| v.trim_matches('"').to_owned()))
                .flatten()
        })
        .expect("the dump names a sandbox_image");
    c.ctr_ok(&["images", "tag", IMAGE, &sandbox_image]);
    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    for image in [IMAGE, &sandbox_image] {
        cri.wait_image(image);
    }
    let logs = dir.join("pod-logs");
    fs::create_dir_all(&logs).unwrap();

    for handler in ["", "devremap"] {
        let uid = format!("pod-{}-{handler}", std::process::id());
        let pod = pod_config(&format!("gpu-pod{handler}"), &uid, &logs, &[("devremap.io/enable", "true")]);
        let sandbox = cri.run_pod_sandbox(&pod, handler);
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
        let mut exec = |cmd: &[&str]| {
            let r = cri.call("ExecSync", |mut c| {
                let (id, cmd) = (id.clone(), cmd.iter().map(|s| (*s).to_owned()).collect());
                async move { c.exec_sync(ExecSyncRequest { container_id: id, cmd, timeout: 60 }).await }
            });
            assert_eq!(r.exit_code, 0, "{cmd:?}: {}", String::from_utf8_lossy(&r.stderr));
            String::from_utf8_lossy(&r.stdout).into_owned()
        };
        assert_eq!(exec(&["stat", "-c", "%t:%T", "/dev/nvidia1"]), "1:5\n");
        let fuse = exec(&["sh", "-c", "grep -c ' /dev fuse ' /proc/mounts || true"]);
        if handler == "devremap" {
            assert_eq!(w.containers(), std::slice::from_ref(&id), "one daemon for the pod: its GPU container's");
            assert_eq!(fuse, "1\n", "the container's /dev is devremap's");
        } else {
            assert!(w.containers().is_empty(), "the default runtime gave the pod a daemon");
            assert_eq!(fuse, "0\n", "the default runtime served a devremap /dev");
        }

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
}

/// The config.toml a release's package installs.
fn packaged_config(release: &Release) -> String {
    fs::read_to_string(release.root.join("etc/containerd/config.toml")).unwrap()
}

/// On each release: a node set up from the config `base` gives, which must keep every setting,
/// then `then` on it.
fn on_each_release(base: impl Fn(&Release) -> String, then: impl Fn(&Release, &Node, &WrappedHost, &Path)) {
    for release in Release::all() {
        let tmp = TempDir::new().unwrap();
        let w = WrappedHost::new(tmp.path());
        let node = Node::set_up(tmp.path(), &release, &base(&release), &w);
        node.kept_everything(&release);
        then(&release, &node, &w, tmp.path());
    }
}

/// Rule (issues 17.5 and 30.1): on a node with the config.toml its containerd package ships
/// (Debian 12's 1.6 and Debian 13's 1.7), the shipped node setup adds the handler and keeps
/// every setting (the CNI `bin_dir` among them); the CRI plugin loads; a pod runs on the default
/// runtime and a GPU pod through the `devremap` handler. The old drop-in lost the CNI
/// `bin_dir`, and the CRI plugin failed to load.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd 1.6 and 1.7 (.ci/containerd-packages)"]
fn a_cri_pod_through_the_runtime_handler() {
    on_each_release(packaged_config, |_, node, w, dir| run_pods(node, w, dir));
}

/// Rule (issue 30.1): on a node whose config.toml is `containerd config default`'s (each
/// release's own), the setup keeps every setting, the CRI plugin loads, and pods run on the
/// default runtime and through the handler.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd 1.6 and 1.7 (.ci/containerd-packages)"]
fn node_setup_keeps_containerd_config_default() {
    on_each_release(
        |release| release.containerd(Path::new("/dev/null"), &["config", "default"]),
        |_, node, w, dir| run_pods(node, w, dir),
    );
}

/// Rule (issue 30.1): an operator's node (the `nvidia` runtime as the default, the systemd
/// cgroup driver, a private pause image) keeps all of it after the setup, the CRI plugin loads,
/// and the handler uses the systemd cgroup driver too, as the kubelet's must match. No pod runs
/// here: the systemd cgroup driver needs systemd as PID 1, and the NVIDIA runtime is not here.
#[test]
#[ignore = "needs root, runc and containerd 1.6 and 1.7 (.ci/containerd-packages)"]
fn node_setup_keeps_an_operators_runtimes() {
    on_each_release(
        |_| OPERATORS.to_owned(),
        |release, node, _, _| {
            let after = settings(&node.after);
            for (table, line) in [
                ("[plugins.\"io.containerd.grpc.v1.cri\"]", "sandbox_image = \"registry.example/pause:3.9\""),
                ("[plugins.\"io.containerd.grpc.v1.cri\".containerd]", "default_runtime_name = \"nvidia\""),
                ("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]", "SystemdCgroup = true"),
                (
                    "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap.options]",
                    "SystemdCgroup = true",
                ),
            ] {
                assert!(
                    after.contains(&(table.to_owned(), line.to_owned())),
                    "{}: no {table} {line}",
                    release.version()
                );
            }
        },
    );
}

/// Bug (attack 1, B1, B3, B5): configs the shell node-setup broke or half-read, each loaded by
/// containerd 1.6 and 1.7 after the setup, with every setting kept and the CRI plugin loaded:
/// runtimes as an inline table, as dotted keys, a `runc` inline table under a runtimes header
/// (the shell version then added a table containerd refused: "could not re-define exist inline
/// table"), quoted headers and a CRLF file whose default runtime uses the systemd cgroup driver
/// (the shell version dropped SystemdCgroup from the handler), the deprecated `default_runtime`
/// table with it (found from outside: not seen), devremap's own handler as an
/// inline table (replaced in place), and an old block whose end marker the operator deleted,
/// with a registry setting after it (the shell version dropped it).
#[test]
#[ignore = "needs root, runc and containerd 1.6 and 1.7 (.ci/containerd-packages)"]
fn node_setup_adds_to_configs_of_every_form() {
    const CRI: &str = "[plugins.\"io.containerd.grpc.v1.cri\".containerd]";
    const RT: &str = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes";
    const DEPRECATED: &str = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.default_runtime";
    let cases: Vec<(String, bool)> = vec![
        (format!("version = 2\n{CRI}\n  runtimes = {{ runc = {{ runtime_type = \"io.containerd.runc.v2\" }} }}\n"), false),
        (format!("version = 2\n{CRI}\n  runtimes.runc.runtime_type = \"io.containerd.runc.v2\"\n  runtimes.runc.options.SystemdCgroup = true\n"), true),
        (format!("version = 2\n{RT}]\n  runc = {{ runtime_type = \"io.containerd.runc.v2\" }}\n"), false),
        (
            format!("version = 2\r\n{RT}.runc]\r\n  runtime_type = \"io.containerd.runc.v2\"\r\n{RT}.runc.options]\r\n  SystemdCgroup = true\r\n"),
            true,
        ),
        (
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".\"containerd\".\"runtimes\".\"runc\"]\n  runtime_type = \"io.containerd.runc.v2\"\n[plugins.\"io.containerd.grpc.v1.cri\".\"containerd\".\"runtimes\".\"runc\".options]\n  SystemdCgroup = true\n".into(),
            true,
        ),
        (
            format!("version = 2\n{DEPRECATED}]\n  runtime_type = \"io.containerd.runc.v2\"\n{DEPRECATED}.options]\n  SystemdCgroup = true\n"),
            true,
        ),
        (
            format!("version = 2\n{RT}]\n  runc = {{ runtime_type = \"io.containerd.runc.v2\" }}\n  devremap = {{ runtime_type = \"io.containerd.runc.v1\", options = {{ BinaryName = \"@BIN@/devremap-runtime\" }} }}\n"),
            false,
        ),
        (
            format!("version = 2\n\n# >>> devremap: the CRI runtime handler devremap, added by devremap's node-setup.sh\n{RT}.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n{RT}.devremap]\n  runtime_type = \"io.containerd.runc.v2\"\n{RT}.devremap.options]\n  BinaryName = \"@BIN@/devremap-runtime\"\n\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"/etc/containerd/certs.d\"\n"),
            false,
        ),
    ];
    for (base, systemd) in cases {
        for release in Release::all() {
            let tmp = TempDir::new().unwrap();
            let w = WrappedHost::new(tmp.path());
            let node = Node::set_up(tmp.path(), &release, &base, &w);
            node.kept_everything(&release);
            let handler = (
                "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap.options]".to_owned(),
                "SystemdCgroup = true".to_owned(),
            );
            assert_eq!(
                settings(&node.after).contains(&handler),
                systemd,
                "{}: {base}\n{}",
                release.version(),
                node.after
            );
            let config = fs::read_to_string(tmp.path().join("etc/containerd/config.toml")).unwrap();
            assert!(!config.contains(">>> devremap") && !config.contains("runc.v1"), "{config}");
        }
    }
}
