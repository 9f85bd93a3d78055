//! What the tests of real clients (Docker, Podman, containerd's CRI) share: a busybox image
//! built offline, a fake host with a wrapper config, CRIU on the client's `PATH`, the shipped
//! client configs of `dist/` with this build's paths, and the check that a removed container
//! left nothing behind.
//!
//! Each client runs with its own sockets, roots and state directories under a temporary
//! directory, started by the test and stopped when dropped.

use super::bundle::{APPLETS, BUSYBOX, Runtime, need_containers, nvidia_hook_script};
use super::{FakeHost, arg, write_file};
use serde_json::json;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// The wrapper Cargo built for these tests.
pub const WRAPPER: &str = env!("CARGO_BIN_EXE_devremap-runtime");

/// How long a client may take for one step (a start, a checkpoint) on a busy machine.
pub const CLIENT_PATIENCE: Duration = Duration::from_secs(180);

/// Polls `f` until it returns `Some`, failing the test after [`CLIENT_PATIENCE`] with
/// `context()` (a client's log).
/// Polled every 50 ms: each look runs a client's command.
pub fn wait_client<T>(what: &str, context: impl Fn() -> String, f: impl FnMut() -> Option<T>) -> T {
    super::daemon::wait_within(CLIENT_PATIENCE, Duration::from_millis(50), what, context, f)
}

/// Fails the calling (`#[ignore]`d) test unless `bins` are installed (`package` names them),
/// beside what a container over a devremap `/dev` needs.
pub fn need_client(package: &str, bins: &[&str]) {
    need_containers(Runtime::Runc);
    for bin in bins {
        let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).any(|d| d.join(bin).is_file());
        assert!(found, "{bin} is not installed (apt-get install {package}): this test runs it");
    }
}

/// A CRIU that works here: a `criu` on PATH whose `criu check` passes, else the CRIU 4.2 build
/// in `shared/tools/criu/` beside the repository (`../shared` in CI, `/work/shared` here).
/// Fails the calling (`#[ignore]`d) test when there is none.
pub fn need_criu() -> PathBuf {
    let works = |criu: &Path| {
        Command::new(criu).arg("check").output().is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&[o.stdout, o.stderr].concat()).contains("Looks good")
        })
    };
    let on_path = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("criu"))
        .find(|p| p.is_file());
    let shared = [
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/tools/criu/criu"),
        PathBuf::from("/work/shared/tools/criu/criu"),
    ];
    on_path.into_iter().chain(shared).find(|p| works(p)).unwrap_or_else(|| {
        panic!(
            "no working CRIU: neither a criu on PATH nor shared/tools/criu/criu passes `criu check` \
             (it needs libprotobuf-c1 libnl-3-200 libnet1 libgnutls30 libbsd0 libuuid1 iptables)"
        )
    })
}

/// A `PATH` whose first directory (under `dir`) holds a working `criu`: what a client and the
/// runtimes it starts find when they checkpoint.
pub fn path_with_criu(dir: &Path) -> String {
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).unwrap();
    let criu = bin.join("criu");
    if !criu.exists() {
        std::os::unix::fs::symlink(need_criu(), &criu).unwrap();
    }
    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default())
}

/// `path` with a directory (under `dir`) in front that holds the test's NVIDIA hook
/// ([`nvidia_hook_script`]): dockerd registers its `nvidia` device driver, which `docker run
/// --gpus` needs, only when `nvidia-container-runtime-hook` is on its `PATH` as it starts, and
/// then adds that hook to a GPU container's spec (moby's `daemon/nvidia_linux.go`, 20.10 to 26).
pub fn path_with_nvidia_hook(dir: &Path, path: &str) -> String {
    let bin = dir.join("nvidia-toolkit");
    fs::create_dir_all(&bin).unwrap();
    nvidia_hook_script(&bin);
    format!("{}:{path}", bin.display())
}

/// The stdout of a client's command that must succeed; its failure shows `context()` (the
/// client's log).
pub fn succeeded(what: &str, out: Output, context: impl Fn() -> String) -> String {
    assert!(
        out.status.success(),
        "{what}: {}{}\n--- context ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        context()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A filesystem tarball of the static busybox and its applets: `docker import` and `podman
/// import` make an image of it.
pub fn busybox_rootfs_tar(dir: &Path) -> PathBuf {
    let rootfs = busybox_rootfs(dir);
    let tar = dir.join("rootfs.tar");
    let ok = Command::new("tar").arg("-C").arg(&rootfs).arg("-cf").arg(&tar).arg(".").status().unwrap();
    assert!(ok.success());
    tar
}

/// A root filesystem (under `dir`) of the static busybox and its applets.
pub fn busybox_rootfs(dir: &Path) -> PathBuf {
    let rootfs = dir.join("image-rootfs");
    fs::create_dir_all(rootfs.join("bin")).unwrap();
    for d in ["proc", "sys", "dev", "tmp", "etc", "xchg"] {
        fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    fs::copy(BUSYBOX, rootfs.join("bin/busybox")).unwrap();
    for applet in APPLETS {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    rootfs
}

/// A fake host with GPUs `nvidia0` (null, 1:3) and `nvidia1` (zero, 1:5), and the wrapper's
/// config naming it, with its state directory under `dir`.
pub struct WrappedHost {
    pub host: FakeHost,
    pub config: PathBuf,
    pub state_dir: PathBuf,
}

impl Drop for WrappedHost {
    fn drop(&mut self) {
        super::daemon::stop_node(&self.state_dir);
    }
}

impl WrappedHost {
    pub fn new(dir: &Path) -> WrappedHost {
        let host = FakeHost::with_gpus(&[0, 1]);
        let state_dir = dir.join("devremap");
        let config = write_file(
            dir,
            "runtime.json",
            json!({"host_dev": arg(&host.dev()), "host_root": arg(&host.root()), "state_dir": arg(&state_dir)})
                .to_string(),
        );
        WrappedHost { host, config, state_dir }
    }

    /// The restore host: GPU 1 is gone, GPU 2 (full, 1:7) is there.
    pub fn change_gpus(&self) {
        fs::remove_file(self.host.dev().join("nvidia1")).unwrap();
        self.host.node("nvidia2", super::fake_rdev(2));
    }

    /// The containers devremap serves now: the state directory's directories (the node
    /// daemon's socket, pid, lock and log files are beside them).
    pub fn containers(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.state_dir) else { return vec![] };
        entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// What a removed container must not leave: a state directory, a mount or a daemon.
    pub fn leftovers(&self) -> Vec<String> {
        let log = |c: &str| fs::read_to_string(self.state_dir.join(c).join("devremapd.log")).unwrap_or_default();
        let mut left: Vec<String> =
            self.containers().into_iter().map(|c| format!("state dir {c}, its daemon's log:\n{}", log(&c))).collect();
        let state = arg(&self.state_dir).to_owned();
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        left.extend(mounts.lines().filter(|l| l.contains(&state)).map(|l| format!("mount {l}")));
        for proc in fs::read_dir("/proc").unwrap().flatten() {
            let cmdline = fs::read(proc.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // The node daemon serves the state dir for as long as it runs: not a leftover.
            if cmdline.contains("devremapd") && cmdline.contains(&state) && !cmdline.contains("devremapd node ") {
                left.push(format!("daemon {}: {cmdline}", proc.file_name().to_string_lossy()));
            }
        }
        left
    }

    /// Waits until a removed container has left nothing behind.
    pub fn wait_clean(&self, after: &str) {
        wait_client(
            &format!("nothing left after {after}"),
            || format!("{:?}", self.leftovers()),
            || self.leftovers().is_empty().then_some(()),
        );
    }
}

/// A client config shipped in `dist/` (`docker/daemon.json`, ...), with the installed paths
/// replaced by this build's: the wrapper, and the wrapper's config `config`.
pub fn shipped(name: &str, config: &Path) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("dist").join(name);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(text.contains("/usr/bin/devremap-runtime"), "{name} names the installed wrapper");
    text.replace("/usr/bin/devremap-runtime", WRAPPER).replace("/etc/devremap/runtime.json", arg(config))
}

/// The script of the checkpointed container: it reports its `/dev`, holds the checkpoint name
/// `/dev/nvidia1` open on fd 3, and then sleeps, leaving `SIGTERM` to end it at once.
pub const HOLDER: &str = "trap 'exit 0' TERM; \
    while read -r s mp fs rest; do [ \"$mp\" = /dev ] && echo \"dev.fs: $fs\"; done < /proc/mounts; \
    exec 3<> /dev/nvidia1; echo \"fd3: $(stat -L -c %t:%T /proc/self/fd/3)\"; echo ready; \
    while :; do sleep 1; done";
