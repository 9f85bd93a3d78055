//! Real OCI containers for tests: a bundle whose rootfs is a static busybox, a `config.json`
//! written the way `runc spec` writes it, the runtimes (`runc`, `crun`) behind one interface,
//! and a guard that deletes the container even when the test fails.
//!
//! Assumptions: root, a static `/bin/busybox` (Debian's `busybox-static`), and the runtime on
//! `PATH`. The tests that need them are `#[ignore]`d, and [`need_containers`] fails one that is
//! asked to run without them. crun 1.8 refuses a hybrid cgroup layout
//! (v1 controllers plus cgroup2 at `/sys/fs/cgroup/unified`), so on such a host crun runs in a
//! private mount namespace in which that cgroup2 mount is gone (see [`Runtime::command`]).

use super::daemon::{PATIENCE, need_fuse};
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Where the static busybox of Debian's `busybox-static` lives.
pub const BUSYBOX: &str = "/bin/busybox";

/// The applets a test script may call, each a symlink to busybox in the rootfs.
pub const APPLETS: &[&str] = &[
    "sh", "cat", "chmod", "chown", "dd", "echo", "grep", "head", "ls", "mkdir", "mknod", "mount", "od", "readlink",
    "rm", "sleep", "stat", "test", "touch", "tr", "true", "false",
];

/// A hybrid cgroup layout mounts cgroup2 here, beside the v1 controllers.
pub const HYBRID_UNIFIED: &str = "/sys/fs/cgroup/unified";

/// An OCI runtime under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Runc,
    Crun,
}

impl Runtime {
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Crun => "crun",
        }
    }

    /// The runtime's binary on `PATH`, if any.
    pub fn binary(self) -> Option<PathBuf> {
        find_in_path(self.name())
    }

    /// `<runtime> --root <state_root> <args>`, ready to spawn. crun on a hybrid cgroup host runs
    /// as `unshare -m --propagation private sh -c 'umount /sys/fs/cgroup/unified && exec crun
    /// ...'`: the namespace is private, so the unmount never reaches the host.
    pub fn command(self, state_root: &Path, args: &[&str]) -> Command {
        let bin = self.binary().unwrap_or_else(|| panic!("{} is not on PATH", self.name()));
        if self == Runtime::Crun && is_mount_point(Path::new(HYBRID_UNIFIED)) {
            let mut c = Command::new("unshare");
            c.args([
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                &format!("umount {HYBRID_UNIFIED} && exec \"$0\" \"$@\""),
            ]);
            c.arg(bin).arg("--root").arg(state_root).args(args);
            c
        } else {
            let mut c = Command::new(bin);
            c.arg("--root").arg(state_root).args(args);
            c
        }
    }
}

/// Fails the calling (`#[ignore]`d) test unless it can run containers with `runtime` over a
/// devremap `/dev`: root, `/dev/fuse`, the runtime binary, `unshare` for crun, and a static
/// busybox.
pub fn need_containers(runtime: Runtime) {
    need_fuse();
    let missing = if runtime.binary().is_none() {
        Some(format!("{} is not installed (apt-get install {})", runtime.name(), runtime.name()))
    } else if runtime == Runtime::Crun && find_in_path("unshare").is_none() {
        Some("unshare (util-linux) is not installed".to_owned())
    } else if !is_static_elf(Path::new(BUSYBOX)) {
        Some(format!("{BUSYBOX} is missing or not a static binary (apt-get install busybox-static)"))
    } else {
        None
    };
    if let Some(why) = missing {
        panic!("{why}: this test runs a container");
    }
}

pub fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")
        .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

/// An ELF file without a `PT_INTERP` program header: it runs in an empty rootfs.
pub fn is_static_elf(path: &Path) -> bool {
    let Ok(bytes) = fs::read(path) else { return false };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return false; // not a 64-bit little-endian ELF: not one we know how to check
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(bytes[32..40].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    (0..phnum).all(|i| {
        let at = phoff + i * phentsize;
        at + 4 <= bytes.len() && u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) != 3
    })
}

/// Whether `path` is exactly a mount point in this process's mount table.
pub fn is_mount_point(path: &Path) -> bool {
    let target = path.to_string_lossy().replace(' ', "\\040");
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(target.as_str()))
}

/// A bundle in a temporary directory: `rootfs/` (busybox, its applets, `/proc`, `/sys`, `/dev`,
/// `/xchg`), `config.json`, and `state/` (the runtime's `--root`, so tests never see the
/// host's containers nor leave theirs in `/run`).
pub struct Bundle {
    pub tmp: TempDir,
}

impl Bundle {
    /// A bundle whose process runs `script` with busybox's `sh`, under [`Bundle::config`].
    pub fn new(script: &str, config: &Value) -> Bundle {
        let tmp = TempDir::new().expect("a temp dir");
        let b = Bundle { tmp };
        let rootfs = b.rootfs();
        for dir in ["bin", "proc", "sys", "dev", "tmp", "xchg"] {
            fs::create_dir_all(rootfs.join(dir)).unwrap();
        }
        fs::copy(BUSYBOX, rootfs.join("bin/busybox")).expect("copy busybox");
        for applet in APPLETS {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        fs::write(rootfs.join("test.sh"), script).unwrap();
        fs::create_dir(b.state_root()).unwrap();
        b.write_config(config);
        b
    }

    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    pub fn rootfs(&self) -> PathBuf {
        self.dir().join("rootfs")
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir().join("config.json")
    }

    /// The runtime's `--root`.
    pub fn state_root(&self) -> PathBuf {
        self.dir().join("state")
    }

    /// `rootfs/xchg`: the test writes here, the container reads it at `/xchg` (the rootfs is
    /// read-only to the container, never to the test).
    pub fn xchg(&self) -> PathBuf {
        self.rootfs().join("xchg")
    }

    pub fn config(&self) -> Value {
        serde_json::from_slice(&fs::read(self.config_path()).unwrap()).expect("config.json is JSON")
    }

    pub fn write_config(&self, config: &Value) {
        fs::write(self.config_path(), serde_json::to_string_pretty(config).unwrap()).unwrap();
    }
}

/// A `config.json` as `runc spec` (1.1) writes it, with `process.terminal` false, `args`
/// running `/bin/sh /test.sh`, and `devices` as `linux.resources.devices` after the default
/// deny-all rule. The process also gets `CAP_MKNOD`, `CAP_CHOWN`, `CAP_FOWNER` and
/// `CAP_DAC_OVERRIDE`, so that a change to `/dev` is refused by the filesystem, not by a
/// missing capability.
pub fn oci_config(hostname: &str, devices: &[Value]) -> Value {
    let caps = json!([
        "CAP_AUDIT_WRITE",
        "CAP_KILL",
        "CAP_NET_BIND_SERVICE",
        "CAP_MKNOD",
        "CAP_CHOWN",
        "CAP_FOWNER",
        "CAP_DAC_OVERRIDE"
    ]);
    let mut rules = vec![json!({"allow": false, "access": "rwm"})];
    rules.extend(devices.iter().cloned());
    json!({
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "/test.sh"],
            "env": ["PATH=/bin", "TERM=xterm"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps, "ambient": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true
        },
        "root": {"path": "rootfs", "readonly": true},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}
        ],
        "linux": {
            "resources": {"devices": rules},
            "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
        }
    })
}

/// Makes `config` ask the NVIDIA hook for GPUs as `docker run --gpus` does: a prestart hook
/// named `nvidia-container-runtime-hook` (the [`nvidia_hook_script`] in `dir`) and, where
/// `visible` is given, `NVIDIA_VISIBLE_DEVICES=<visible>`.
pub fn nvidia_hook(config: &mut Value, dir: &Path, visible: Option<&str>) {
    let hook = nvidia_hook_script(dir);
    config["hooks"] =
        json!({"prestart": [{"path": hook.to_str().unwrap(), "args": ["nvidia-container-runtime-hook", "prestart"]}]});
    if let Some(visible) = visible {
        config["process"]["env"].as_array_mut().unwrap().push(json!(format!("NVIDIA_VISIBLE_DEVICES={visible}")));
    }
}

/// Writes `dir/nvidia-container-runtime-hook`, standing for the NVIDIA toolkit's hook, and
/// returns its path. The test hosts have no toolkit, so the hook does nothing but read the
/// container's state (the toolkit's own hook adds nothing for `void`); the runtime runs it as it
/// would run the toolkit's, and a client that adds the hook finds it where it looks.
pub fn nvidia_hook_script(dir: &Path) -> PathBuf {
    let hook = dir.join("nvidia-container-runtime-hook");
    super::write_executable(&hook, b"#!/bin/sh\ncat > /dev/null\n");
    hook
}

/// A device cgroup rule allowing char device `major:minor` (`rwm`).
pub fn allow_char(major: u32, minor: u32) -> Value {
    json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"})
}

/// A container started with `<runtime> run` in the foreground; its stdout and stderr go to
/// files in the bundle. Dropping it deletes the container (`delete -f`) and reaps the runtime,
/// so a failing test leaves nothing running.
pub struct Container<'a> {
    pub runtime: Runtime,
    pub id: String,
    pub bundle: &'a Bundle,
    child: Option<Child>,
    stdout: PathBuf,
    stderr: PathBuf,
    /// runc failed to copy itself once and was run again ([`runc_could_not_clone_itself`]).
    ran_again: bool,
}

impl<'a> Container<'a> {
    /// `<runtime> run --bundle <dir> <id>`, stdin from `/dev/null`.
    pub fn run(runtime: Runtime, bundle: &'a Bundle, id: &str) -> Container<'a> {
        let stdout = bundle.dir().join("stdout");
        let stderr = bundle.dir().join("stderr");
        append_to(&stdout);
        append_to(&stderr);
        let mut c = Container { runtime, id: id.to_owned(), bundle, child: None, stdout, stderr, ran_again: false };
        c.child = Some(c.spawn());
        c
    }

    fn spawn(&self) -> Child {
        let append = |path: &Path| {
            fs::OpenOptions::new().append(true).open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        self.runtime
            .command(&self.bundle.state_root(), &["run", "--bundle", self.bundle.dir().to_str().unwrap(), &self.id])
            .stdin(Stdio::null())
            .stdout(append(&self.stdout))
            .stderr(append(&self.stderr))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.runtime.name()))
    }

    /// The runtime's exit status once it has exited. A runc that failed to copy itself before
    /// the container existed is run once more (and this says it has not exited): that failure
    /// is runc's and the kernel's on a busy machine, never what a test looks at.
    fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut().expect("the runtime was started").try_wait().unwrap()?;
        if status.success() || self.ran_again || !runc_could_not_clone_itself(&self.stderr()) {
            return Some(status);
        }
        eprintln!("runc could not copy itself (its failure, not the test's); running it once more");
        self.ran_again = true;
        let _ = self.delete();
        self.child = Some(self.spawn());
        None
    }

    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// What the container printed so far, and what the runtime said, for failure messages.
    pub fn transcript(&self) -> String {
        format!("--- stdout ---\n{}--- stderr ---\n{}", self.stdout(), self.stderr())
    }

    /// Waits until stdout holds the line `line`; fails if the runtime exits first or after
    /// `patience`.
    pub fn wait_line(&mut self, line: &str, patience: Duration) {
        let deadline = Instant::now() + patience;
        loop {
            if self.stdout().lines().any(|l| l == line) {
                return;
            }
            if let Some(status) = self.exited() {
                // It may have printed the line just before exiting.
                if self.stdout().lines().any(|l| l == line) {
                    return;
                }
                panic!("{} exited with {status} before printing {line:?}\n{}", self.runtime.name(), self.transcript());
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {line:?} from the container\n{}",
                self.transcript()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the runtime (and so the container's process) to exit.
    pub fn wait(&mut self, patience: Duration) -> ExitStatus {
        let deadline = Instant::now() + patience;
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            assert!(Instant::now() < deadline, "timed out waiting for the container to exit\n{}", self.transcript());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `<runtime> delete -f <id>`: removes the container whatever its state.
    pub fn delete(&self) -> Output {
        self.runtime
            .command(&self.bundle.state_root(), &["delete", "-f", &self.id])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} delete: {e}", self.runtime.name()))
    }
}

/// runc 1.1 copies its binary into a sealed memfd before each container's init (CVE-2019-5736).
/// The kernel refuses the seal with EBUSY while a page of the copy still has a reference it
/// cannot drain in time (`memfd_wait_for_pins`), which a loaded machine sometimes makes: runc
/// then fails with this line on `stderr` before the container exists (seen once in CI, Debian
/// 13's runc through the wrapper, nothing of devremap's on that path).
pub fn runc_could_not_clone_itself(stderr: &str) -> bool {
    stderr.contains("could not ensure we are a cloned binary: Device or resource busy")
}

/// A new file opened for appending: a process that reopens its stdout through
/// `/dev/stdout` (crun hands the container this very file) then writes after what is there,
/// instead of over it.
fn append_to(path: &Path) -> fs::File {
    fs::OpenOptions::new()
        .create_new(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        let _ = self.delete();
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + PATIENCE;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
