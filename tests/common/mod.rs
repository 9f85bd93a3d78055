//! Helpers shared by the integration tests of `devremapd`: running the binary, the committed
//! fixtures, and fake hosts (a device directory of real char devices standing for GPUs, and a
//! root holding the driver's `/proc` and `/sys` files).
//!
//! Fake GPUs are real char devices made with `mknod`, so creating them needs root. Tests that
//! need them are `#[ignore]`d with the reason and call [`need_root`] first, which fails them
//! when they are asked to run without root: a plain `cargo test` reports them as ignored, never
//! as passed.

#![allow(dead_code)]

pub mod bundle;
pub mod clients;
pub mod daemon;
pub mod readers;

use serde_json::Value;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tempfile::TempDir;

/// The `devremapd` binary Cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_devremapd");

/// The device numbers of the fake GPU `nvidiaN`: real, harmless char devices, so that a test can
/// tell which host GPU a name leads to by its rdev alone. `nvidia0`..`nvidia3` are
/// `null`, `zero`, `full`, `random`.
pub const FAKE_RDEV: &[(u32, u32)] = &[(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (1, 11)];

/// The fake rdev of host GPU `minor`.
pub fn fake_rdev(minor: u32) -> (u32, u32) {
    FAKE_RDEV[minor as usize]
}

/// Fails the calling test unless this process runs as root. Every test that calls it is
/// `#[ignore]`d, so it runs only when asked for (`-- --include-ignored`, as the README's test
/// command and CI do): a run that cannot make device nodes then fails with the reason instead
/// of passing without having tested anything.
pub fn need_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test makes device nodes with mknod and must run as root");
    }
}

/// Fails the calling (`#[ignore]`d) test unless the binary has the test hooks
/// (`DEVREMAPD_FAILPOINT`): a build with `--features test-hooks`, as the README's test command
/// makes. A release build has none.
pub fn need_test_hooks() {
    if !cfg!(feature = "test-hooks") {
        panic!("this test injects faults through DEVREMAPD_FAILPOINT: run it with --features test-hooks");
    }
}

/// The path of a committed fixture, `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name).to_str().expect("a UTF-8 path").to_owned()
}

/// Writes the committed spec `tests/fixtures/<name>` to `dest`, asking the NVIDIA hook for every
/// GPU as `docker run --gpus all` does ([`bundle::nvidia_hook`], its no-op hook script beside
/// `dest`): with a device directory a spec is given only the GPUs it lists or the hook selects
/// (issue 29.3), and the fake GPUs, not being 195:N, can only be selected. Returns `dest`.
pub fn spec_asking_for_all_gpus(name: &str, dest: &Path) -> PathBuf {
    let mut spec: Value = serde_json::from_str(&fs::read_to_string(fixture(name)).unwrap()).unwrap();
    bundle::nvidia_hook(&mut spec, dest.parent().expect("a file in a directory"), Some("all"));
    fs::write(dest, serde_json::to_string_pretty(&spec).unwrap()).unwrap();
    dest.to_owned()
}

/// A `--host-root` with no driver files and no `/proc/kcore`, for tests that need none (a
/// missing host root is an error).
pub fn empty_root() -> String {
    fixture("empty-root")
}

/// A path as a `&str` argument.
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).env_remove("RUST_LOG").output().unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"))
}

/// Runs `devremapd <args>`: (exit status, stdout, stderr). A death by signal is -1.
pub fn devremapd(args: &[&str]) -> (i32, String, String) {
    let out = run(args);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).expect("stdout is UTF-8"),
        String::from_utf8(out.stderr).expect("stderr is UTF-8"),
    )
}

/// Runs `devremapd plan <args>`: (exit status, stdout, stderr). A death by signal is -1.
pub fn plan(args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    devremapd(&all)
}

/// Runs `devremapd plan --json <args>`, asserts success with nothing on stderr, and returns the
/// parsed object.
pub fn plan_json(args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = plan(&all);
    assert_eq!(code, 0, "plan {all:?} failed: stderr: {stderr}");
    assert_eq!(stderr, "", "plan {all:?} wrote to stderr");
    let value: Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("plan {all:?}: stdout is not JSON ({e}): {stdout}"));
    assert!(value.is_object(), "plan --json printed {value}");
    value
}

/// Runs `devremapd plan --json <args>`, asserts that it failed as bad input does: exit status 1,
/// nothing on stdout, exactly one line on stderr, starting with `error: ` and containing
/// `needle` (a file path, typically). Returns that line.
pub fn plan_error(args: &[&str], needle: &str) -> String {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (code, stdout, stderr) = plan(&all);
    assert_eq!(code, 1, "plan {all:?}: expected exit status 1; stdout: {stdout}; stderr: {stderr}");
    assert_eq!(stdout, "", "plan {all:?}: expected nothing on stdout");
    assert!(stderr.ends_with('\n'), "plan {all:?}: stderr is not one line: {stderr:?}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "plan {all:?}: expected one line on stderr, got {stderr:?}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "plan {all:?}: stderr line does not start with `error: `: {line:?}");
    assert!(line.contains(needle), "plan {all:?}: stderr line does not name {needle:?}: {line:?}");
    line.to_owned()
}

/// Makes a char device at `path` with mode `mode` (umask not applied).
/// Writes the executable `path` (mode 0755) with `content` from a child process: a descriptor
/// open for writing in the test process would be inherited by a child another test thread
/// forks meanwhile, and executing the file would fail with ETXTBSY ("Text file busy") until
/// that child execs (found in CI: node-setup could not run its copy of devremapd).
pub fn write_executable(path: &Path, content: &[u8]) {
    use std::io::Write;
    let mut sh = Command::new("/bin/sh")
        .args(["-c", "cat > \"$0\" && chmod 755 \"$0\"", arg(path)])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("/bin/sh runs");
    sh.stdin.as_mut().unwrap().write_all(content).unwrap();
    drop(sh.stdin.take());
    assert!(sh.wait().unwrap().success(), "writing {}", path.display());
}

pub fn mknod_char(path: &Path, (major, minor): (u32, u32), mode: u32) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("no NUL in a temp path");
    // SAFETY: `c` is a valid NUL-terminated path; mknod only reads it.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | mode as libc::mode_t, libc::makedev(major, minor)) };
    assert_eq!(rc, 0, "mknod {}: {}", path.display(), std::io::Error::last_os_error());
    fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).expect("chmod a fresh node");
}

/// What the driver tells of one fake GPU.
#[derive(Debug, Clone)]
pub struct GpuFacts {
    pub minor: u32,
    pub uuid: String,
    /// PCI bus location as the driver writes it, e.g. `0000:3b:00.0`.
    pub bus: String,
    pub vendor: u32,
    pub device: u32,
}

impl GpuFacts {
    /// An NVIDIA 0x10de:0x22c0 at bus `0000:<minor + 0x3b>:00.0`, uuid [`host_uuid`]`(minor)`.
    pub fn nvidia(minor: u32) -> GpuFacts {
        GpuFacts {
            minor,
            uuid: host_uuid(minor),
            bus: format!("0000:{:02x}:00.0", 0x3b + minor),
            vendor: 0x10de,
            device: 0x22c0,
        }
    }
}

/// The uuid the fake host root gives host GPU `minor`.
pub fn host_uuid(minor: u32) -> String {
    format!("GPU-0b5e55ed-1111-4222-8333-{minor:012}")
}

/// The uuid of saved GPU `minor` in the committed metadata fixtures (minors 0 and 1).
pub fn saved_uuid(minor: u32) -> String {
    format!("GPU-5b2c6f7e-0d1a-4c3e-9f10-aa{minor:010}")
}

/// A fake restore host in a temporary directory: `dev/` (the `--host-dev` directory) and
/// `root/` (the `--host-root`, empty until facts are added, so the real host never leaks in).
pub struct FakeHost {
    pub tmp: TempDir,
}

impl FakeHost {
    /// An empty host: no GPUs, no driver files, no `/proc/kcore`.
    pub fn new() -> FakeHost {
        let tmp = TempDir::new().expect("a temp dir");
        fs::create_dir(tmp.path().join("dev")).unwrap();
        fs::create_dir(tmp.path().join("root")).unwrap();
        FakeHost { tmp }
    }

    /// A host whose device directory holds `nvidiaN` for each of `minors`, with [`fake_rdev`]
    /// numbers. Needs root.
    pub fn with_gpus(minors: &[u32]) -> FakeHost {
        let host = FakeHost::new();
        for &m in minors {
            host.node(&format!("nvidia{m}"), fake_rdev(m));
        }
        host
    }

    /// Like [`FakeHost::with_gpus`], and the driver's files describe each GPU as
    /// [`GpuFacts::nvidia`].
    pub fn with_described_gpus(minors: &[u32]) -> FakeHost {
        let host = FakeHost::with_gpus(minors);
        for &m in minors {
            host.describe(&GpuFacts::nvidia(m));
        }
        host
    }

    pub fn dev(&self) -> PathBuf {
        self.tmp.path().join("dev")
    }

    pub fn root(&self) -> PathBuf {
        self.tmp.path().join("root")
    }

    /// A char device `dev/<rel>` (parents created), mode 0666.
    pub fn node(&self, rel: &str, rdev: (u32, u32)) {
        let path = self.dev().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        mknod_char(&path, rdev, 0o666);
    }

    /// Writes the driver's `information` file and the PCI ids of one GPU under `root/`.
    pub fn describe(&self, gpu: &GpuFacts) {
        let proc_dir = self.root().join("proc/driver/nvidia/gpus").join(&gpu.bus);
        fs::create_dir_all(&proc_dir).unwrap();
        fs::write(
            proc_dir.join("information"),
            format!(
                "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 42\nGPU UUID: \t {}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t {}\nDevice Minor: \t {}\nGPU Excluded:\t No\n",
                gpu.uuid, gpu.bus, gpu.minor
            ),
        )
        .unwrap();
        let sys_dir = self.root().join("sys/bus/pci/devices").join(gpu.bus.to_ascii_lowercase());
        fs::create_dir_all(&sys_dir).unwrap();
        fs::write(sys_dir.join("vendor"), format!("0x{:04x}\n", gpu.vendor)).unwrap();
        fs::write(sys_dir.join("device"), format!("0x{:04x}\n", gpu.device)).unwrap();
    }

    /// `--host-dev <dev> --host-root <root>`.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--host-dev".into(),
            self.dev().to_str().unwrap().into(),
            "--host-root".into(),
            self.root().to_str().unwrap().into(),
        ]
    }

    /// `--host-root <root>` only (no device directory scanned).
    pub fn root_args(&self) -> Vec<String> {
        vec!["--host-root".into(), self.root().to_str().unwrap().into()]
    }
}

/// `owned` plus `extra`, as the `&[&str]` the runners take.
pub fn with<'a>(owned: &'a [String], extra: &[&'a str]) -> Vec<&'a str> {
    owned.iter().map(String::as_str).chain(extra.iter().copied()).collect()
}

/// The node at `path` (relative to `/dev`) in a plan, if any.
pub fn node<'a>(plan: &'a Value, path: &str) -> Option<&'a Value> {
    plan["nodes"].as_array().expect("nodes is an array").iter().find(|n| n["path"] == path)
}

/// Every node path of a plan, in the order printed.
pub fn node_paths(plan: &Value) -> Vec<String> {
    plan["nodes"]
        .as_array()
        .expect("nodes is an array")
        .iter()
        .map(|n| n["path"].as_str().expect("a path").to_owned())
        .collect()
}

/// The `(major, minor)` of the device node at `path`; panics when there is none.
pub fn node_rdev(plan: &Value, path: &str) -> (u32, u32) {
    let n = node(plan, path).unwrap_or_else(|| panic!("no node {path} in {}", plan["nodes"]));
    assert!(matches!(n["type"].as_str(), Some("char" | "block")), "{path} is not a device: {n}");
    (n["major"].as_u64().unwrap() as u32, n["minor"].as_u64().unwrap() as u32)
}

/// The remap entry of checkpoint name `name`; panics when there is none.
pub fn remap_entry<'a>(plan: &'a Value, name: &str) -> &'a Value {
    plan["remap"]
        .as_array()
        .expect("remap is an array")
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("no remap entry {name} in {}", plan["remap"]))
}

/// A gVisor state file: magic, big-endian length, `header` verbatim, then `data`.
pub fn state_file(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = b"gVisorSF".to_vec();
    out.extend_from_slice(&(header.len() as u64).to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// A gVisor metadata map (all values strings) holding `devices` as the GPU key's string value.
pub fn metadata_map(devices: &Value) -> Value {
    serde_json::json!({
        "_timestamp": "2025-01-02 03:04:05 +0000 UTC",
        "compression": "flate-best-speed",
        "nvproxy-device-remap-ids": devices.to_string(),
    })
}

/// A saved device object as gVisor writes it.
pub fn saved_device(minor: u32) -> Value {
    serde_json::json!({
        "minor": minor,
        "pci_vendor_id": 4318,
        "pci_device_id": 8896,
        "gpu_id": 768 + 256 * minor,
        "device_instance": minor,
        "subdevice_instance": 0,
        "uuid": saved_uuid(minor),
    })
}

/// Saved devices with the given minors, as a JSON array.
pub fn saved_devices(minors: &[u32]) -> Value {
    Value::Array(minors.iter().map(|&m| saved_device(m)).collect())
}

/// Writes `content` to `dir/name` and returns the path.
pub fn write_file(dir: &Path, name: &str, content: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, content).unwrap();
    path
}

/// Writes a state file for saved devices `minors` to `dir/name` and returns its path.
pub fn write_state(dir: &Path, name: &str, minors: &[u32]) -> PathBuf {
    let header = metadata_map(&saved_devices(minors)).to_string();
    write_file(dir, name, state_file(header.as_bytes(), b"\x78\x01state data"))
}
