//! Docker (Debian's `docker.io`: dockerd 20.10 on Debian 12, 26.1 on Debian 13, where
//! .ci/newest-clients runs this file) running containers through `devremap-runtime`
//! the way its users do: `docker run -d` (no `-i`), exec, stop, start, restart, rm, and
//! `docker checkpoint create` + `docker start --checkpoint` onto a host whose GPUs changed.
//!
//! The test starts its own dockerd (its own socket, data root, exec root and managed
//! containerd; `--iptables=false --bridge=none`, the vfs storage driver) with the shipped
//! `dist/docker/daemon.json`, and stops it after. The container asks for its GPUs as users do,
//! `--gpus all`: a test directory on dockerd's `PATH` holds a no-op `nvidia-container-runtime-hook`
//! standing for the NVIDIA toolkit's, so dockerd adds that hook and `NVIDIA_VISIBLE_DEVICES=all`
//! to the spec. It also opts in as docs/restore.md says: `--annotation devremap.io/enable=true`
//! on Docker 24 and later, `-e DEVREMAP_ENABLE=true` on 20.10, which drops annotations. The image
//! is the static busybox, imported offline. The host is a fake one (GPU `nvidia1` is char 1:5,
//! zero).

mod common;

use common::arg;
use common::clients::{
    HOLDER, WrappedHost, busybox_rootfs_tar, need_client, path_with_criu, path_with_nvidia_hook, shipped, succeeded,
    wait_client,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use tempfile::TempDir;

const IMAGE: &str = "devremap/busybox:test";

/// A dockerd of our own, stopped (with its containers) when dropped.
struct Dockerd {
    child: Child,
    dir: PathBuf,
}

impl Dockerd {
    fn start(dir: &Path, wrapper_config: &Path) -> Dockerd {
        let config = common::write_file(dir, "daemon.json", shipped("docker/daemon.json", wrapper_config));
        let log = fs::File::create(dir.join("dockerd.log")).unwrap();
        let tmp = dir.join("tmp");
        fs::create_dir(&tmp).unwrap();
        let child = Command::new("dockerd")
            .arg("--data-root")
            .arg(dir.join("root"))
            .arg("--exec-root")
            .arg(dir.join("exec"))
            .arg("--pidfile")
            .arg(dir.join("docker.pid"))
            .arg("--host")
            .arg(format!("unix://{}", dir.join("docker.sock").display()))
            .arg("--config-file")
            .arg(&config)
            .args(["--iptables=false", "--ip6tables=false", "--bridge=none", "--ip-masq=false"])
            .args(["--storage-driver", "vfs"])
            // runc checkpoints with the `criu` it finds on the PATH dockerd hands down; dockerd
            // gives `--gpus` with the NVIDIA hook it finds on its own.
            .env("PATH", path_with_nvidia_hook(dir, &path_with_criu(dir)))
            // containerd unpacks a checkpoint for `start --checkpoint` into a temporary
            // directory it never removes (`ctrd-checkpoint*`, under `$XDG_RUNTIME_DIR` or else
            // the temporary directory): in the test's directory, it goes with it.
            .env("TMPDIR", &tmp)
            .env_remove("XDG_RUNTIME_DIR")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("dockerd starts");
        let d = Dockerd { child, dir: dir.to_owned() };
        wait_client("dockerd to answer", || d.log(), || d.docker(&["version"]).status.success().then_some(()));
        d
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default()
    }

    fn docker(&self, args: &[&str]) -> Output {
        Command::new("docker")
            .arg("--host")
            .arg(format!("unix://{}", self.dir.join("docker.sock").display()))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("docker runs")
    }

    fn ok(&self, args: &[&str]) -> String {
        succeeded(&format!("docker {args:?}"), self.docker(args), || tail(&self.log(), 30))
    }

    /// The docker run flags that ask for devremap on this dockerd: the annotation where Docker
    /// passes annotations to the runtime (24 and later), else the variable.
    fn opt_in(&self) -> [&'static str; 2] {
        let version = self.ok(&["version", "--format", "{{.Server.Version}}"]);
        let major: u32 = version
            .split('.')
            .next()
            .and_then(|m| m.trim().parse().ok())
            .unwrap_or_else(|| panic!("dockerd's version {version:?} does not start with a number"));
        if major >= 24 { ["--annotation", "devremap.io/enable=true"] } else { ["-e", "DEVREMAP_ENABLE=true"] }
    }

    /// `docker logs` of a container.
    fn logs(&self, name: &str) -> String {
        let out = self.docker(&["logs", name]);
        String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned()
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let ids = self.docker(&["ps", "-aq"]);
        for id in String::from_utf8_lossy(&ids.stdout).split_whitespace() {
            let _ = self.docker(&["rm", "-f", id]);
        }
        // SAFETY: kill our child dockerd (it stops its containerd).
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = Command::new("umount").arg("-R").arg("-l").arg(self.dir.join("root")).status();
        let _ = Command::new("umount").arg("-R").arg("-l").arg(self.dir.join("exec")).status();
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Rule (issue 17): Docker's default flows through the wrapper. A `docker run -d --gpus all`
/// container (stdin the host's `/dev/null`) gets the devremap `/dev` with the host's GPUs
/// (issue 29.3: the GPUs the NVIDIA hook selects, as runc and the toolkit would give it), opted
/// in by the annotation, or on Docker 20.10 `DEVREMAP_ENABLE` (issue 30); exec
/// sees it; stop, start and restart each leave one daemon while it runs and none after; the
/// container is checkpointed holding `/dev/nvidia1` open (issue 17.2: this failed on fd 0),
/// the host's GPU 1 is replaced by GPU 2, and `docker start --checkpoint` restores it: the
/// restored descriptor and a reopen reach the new device. `rm` leaves no daemon, mount or
/// state directory.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static, docker.io and CRIU: runs dockerd"]
fn docker_run_restart_checkpoint_restore() {
    need_client("docker.io", &["dockerd", "docker", "containerd"]);
    let tmp = TempDir::new().unwrap();
    let w = WrappedHost::new(tmp.path());
    let d = Dockerd::start(tmp.path(), &w.config);
    d.ok(&["import", arg(&busybox_rootfs_tar(tmp.path())), IMAGE]);
    let name = format!("devremap-docker-{}", std::process::id());
    let one_daemon = |what: &str| {
        wait_client(
            &format!("one devremap container while it runs ({what})"),
            || d.logs(&name),
            || (w.containers().len() == 1).then_some(()),
        )
    };
    let run = ["run", "-d", "--runtime", "devremap", "--gpus", "all", "--name", &name];
    d.ok(&[&run[..], &d.opt_in(), &[IMAGE, "sh", "-c", HOLDER]].concat());
    wait_client("the container's report", || d.logs(&name), || d.logs(&name).contains("ready").then_some(()));
    assert!(d.logs(&name).contains("dev.fs: fuse\n") && d.logs(&name).contains("fd3: 1:5\n"), "{}", d.logs(&name));
    assert_eq!(d.ok(&["exec", &name, "stat", "-c", "%t:%T", "/dev/nvidia1"]), "1:5\n");
    one_daemon("run");

    d.ok(&["stop", "-t", "5", &name]);
    w.wait_clean("stop");
    d.ok(&["start", &name]);
    one_daemon("start");
    assert_eq!(d.ok(&["exec", &name, "stat", "-c", "%t:%T", "/dev/nvidia1"]), "1:5\n");
    d.ok(&["restart", "-t", "5", &name]);
    one_daemon("restart");
    assert_eq!(d.ok(&["exec", &name, "sh", "-c", "grep -c ' /dev fuse ' /proc/mounts"]), "1\n");

    let checkpoint = format!("cp-{}", std::process::id());
    d.ok(&["checkpoint", "create", &name, &checkpoint]);
    w.wait_clean("checkpoint");
    w.change_gpus();
    // Docker 20.10 with containerd 1.6: `checkpoint create` leaves the checkpoint's archive in
    // containerd's content store until its garbage collector runs, and a restore that uploads
    // the same archive before then fails ("failed to upload checkpoint to containerd: commit
    // failed: content sha256:...: already exists"; seen with plain runc too). A user retries;
    // so does the test, until the collector has run.
    wait_client(
        "docker start --checkpoint",
        || d.log(),
        || {
            let out = d.docker(&["start", "--checkpoint", &checkpoint, &name]);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success() || stderr.contains("already exists"), "start --checkpoint: {stderr}");
            out.status.success().then_some(())
        },
    );
    one_daemon("start --checkpoint");
    assert_eq!(d.ok(&["exec", &name, "stat", "-L", "-c", "%t:%T", "/proc/1/fd/3"]), "1:7\n", "the restored fd");
    assert_eq!(d.ok(&["exec", &name, "stat", "-c", "%t:%T", "/dev/nvidia1"]), "1:7\n", "a reopen");

    d.ok(&["rm", "-f", &name]);
    w.wait_clean("rm");
}
