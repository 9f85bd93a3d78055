//! The bad-input corpus (`tests/fixtures/bad/cases.txt`) run through every door an input comes
//! in by: `devremapd plan`, `devremapd mount` at startup, and a live daemon's SIGHUP reload.
//!
//! Rules pinned here (issue 6, "Nothing lost, nothing widened"):
//! - bad input to `plan` or to `mount` at startup: exit status 1, nothing on stdout, exactly one
//!   stderr line `error: <path or flag>: <what>`, and a startup failure leaves no mount;
//! - bad input at a reload: the tree, the remap and the generation stay as they were, the state
//!   file's `last_error` says what was wrong, the daemon serves on, and the next good reload
//!   clears `last_error`;
//! - no input can make the daemon hang, read without bound or follow a link: every case runs
//!   with a deadline and a memory cap, and its peak memory is checked.
//!
//! Each case is bad in exactly one way against good inputs: saved GPUs 4 and 5 (a state file)
//! restored onto host GPUs 0 and 1 (fake char devices, described by fake driver files), and a
//! basic spec. The manifest documents the case syntax.

mod common;

use common::daemon::{Daemon, children, is_mounted, need_fuse, private_dir, unmount};
use common::*;
use serde_json::{Value, json};
use std::ffi::{CString, OsString};
use std::fs;
use std::io::Read;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const MIB: u64 = 1 << 20;
/// The KFD topology's node directories under the host root, where `kfd` cases apply.
const KFD_NODES: &str = "sys/class/kfd/kfd/topology/nodes";
/// The metadata and spec size limit (gVisor's 16 MiB).
const LIMIT: u64 = 16 * MIB;
/// How long one `plan` or a reload may take before the case counts as a hang.
const DEADLINE: Duration = Duration::from_secs(8);
/// The address-space cap each `plan` runs under, so that a case reading without bound fails
/// instead of taking the machine's memory.
const RLIMIT_AS: u64 = 1 << 30;
/// The most memory (peak RSS) any case may take: the largest legal input is 16 MiB, read once
/// and parsed once.
const MAX_RSS_KIB: i64 = 128 * 1024;

// ---------------------------------------------------------------------------------------------
// The manifest
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    Metadata,
    Spec,
    HostDev,
    HostRoot,
    Flags,
    MountFlags,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    Both,
    Plan,
    Mount,
}

#[derive(Debug, Clone)]
struct Case {
    name: String,
    feed: Feed,
    /// The input column, as written.
    input: String,
    /// The expected substring of the error; `None` for "not an error".
    expect: Option<String>,
    /// For an input that is not an error but is said: a substring of the plan's warning, which
    /// must also start with the input's path.
    warns: Option<String>,
    place: Where,
}

impl Case {
    fn words(&self) -> Vec<&str> {
        self.input.split_whitespace().collect()
    }

    fn flag_args(&self) -> Vec<String> {
        let w = self.words();
        assert_eq!(w[0], "args", "{}: a flags case takes `args ...`", self.name);
        w[1..].iter().map(|s| s.to_string()).collect()
    }

    fn in_plan(&self) -> bool {
        self.feed != Feed::MountFlags && self.place != Where::Mount
    }

    fn in_mount_startup(&self) -> bool {
        self.expect.is_some() && self.place != Where::Plan
    }

    fn in_reload(&self) -> bool {
        !matches!(self.feed, Feed::Flags | Feed::MountFlags) && self.place == Where::Both
    }
}

fn bad_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad")
}

/// Parses `cases.txt`.
fn cases() -> Vec<Case> {
    let text = fs::read_to_string(bad_dir().join("cases.txt")).expect("tests/fixtures/bad/cases.txt");
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        assert!(matches!(cols.len(), 4 | 5), "cases.txt:{}: expected 4 or 5 columns: {line}", i + 1);
        let feed = match cols[1] {
            "--metadata" => Feed::Metadata,
            "--spec" => Feed::Spec,
            "--host-dev" => Feed::HostDev,
            "--host-root" => Feed::HostRoot,
            "flags" => Feed::Flags,
            "mount-flags" => Feed::MountFlags,
            other => panic!("cases.txt:{}: unknown feed {other:?}", i + 1),
        };
        let place = match cols.get(4).copied() {
            None | Some("both") => Where::Both,
            Some("plan") => Where::Plan,
            Some("mount") => Where::Mount,
            Some(other) => panic!("cases.txt:{}: unknown where {other:?}", i + 1),
        };
        let warns = cols[3].strip_prefix("warns ").map(str::to_owned);
        let expect = (cols[3] != "-" && warns.is_none()).then(|| cols[3].to_owned());
        out.push(Case { name: cols[0].to_owned(), feed, input: cols[2].to_owned(), expect, warns, place });
    }
    out
}

/// `\xNN` escapes to bytes, the rest as UTF-8.
fn unescape(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1] == b'x' {
            out.push(u8::from_str_radix(&s[i + 2..i + 4], 16).expect("a \\xNN escape"));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The good inputs, and applying one case to them
// ---------------------------------------------------------------------------------------------

/// Good inputs: host GPUs 0 and 1 (fake, described), saved GPUs 4 and 5 in a state file, and
/// the basic spec in a bundle directory, asking the NVIDIA hook for every GPU (a spec gets only
/// the GPUs it asks for, issue 29.3).
struct Env {
    host: FakeHost,
    meta: PathBuf,
    spec: PathBuf,
}

impl Env {
    fn new() -> Env {
        let host = FakeHost::with_described_gpus(&[0, 1]);
        // An AMD host's KFD topology too, which the spec's GPUs (none AMD) leave unused.
        let copied = Command::new("cp").arg("-r").arg(fixture("amd/mi210-2/sys")).arg(host.root()).status().unwrap();
        assert!(copied.success(), "cp of the KFD fixture: {copied}");
        let meta = write_state(host.tmp.path(), "checkpoint.img", &[4, 5]);
        let bundle = host.tmp.path().join("bundle");
        fs::create_dir(&bundle).unwrap();
        let spec = spec_asking_for_all_gpus("spec-basic.json", &bundle.join("config.json"));
        Env { host, meta, spec }
    }

    fn args(&self) -> Vec<String> {
        let mut v = vec!["--metadata".into(), arg(&self.meta).into(), "--spec".into(), arg(&self.spec).into()];
        v.extend(self.host.args());
        v
    }

    /// The path a case of `feed` replaces or adds to.
    fn target(&self, feed: Feed) -> PathBuf {
        match feed {
            Feed::Metadata => self.meta.clone(),
            Feed::Spec => self.spec.clone(),
            Feed::HostDev => self.host.dev(),
            Feed::HostRoot => self.host.root(),
            Feed::Flags | Feed::MountFlags => panic!("flags have no path"),
        }
    }

    /// What an error line about `case` must start with (after `error: `): the path of the
    /// input. For flags, what it must contain: the flag's name or its value.
    fn blame(&self, case: &Case) -> Vec<String> {
        match case.feed {
            Feed::Flags | Feed::MountFlags => {
                let args = case.flag_args();
                let mut names = vec![args[0].split('=').next().unwrap().to_owned()];
                names.extend(args.get(1).cloned());
                names
            }
            feed => vec![arg(&self.target(feed)).to_owned()],
        }
    }
}

/// One case applied to an [`Env`]; [`Applied::restore`] puts the good input back.
struct Applied {
    /// Paths to remove (entries a case added), then `(aside, original)` pairs to move back.
    remove: Vec<PathBuf>,
    moved: Vec<(PathBuf, PathBuf)>,
    /// FIFOs a reader may block on.
    fifos: Vec<PathBuf>,
    extra_args: Vec<String>,
}

fn remove_any(path: &Path) {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path).unwrap(),
        Ok(_) => fs::remove_file(path).unwrap(),
        Err(_) => {}
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn mkfifo(path: &Path) {
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(cpath(path).as_ptr(), 0o644) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

fn mknod(path: &Path, kind: libc::mode_t, rdev: &str) {
    let (ma, mi) = rdev.split_once(':').expect("MAJ:MIN");
    let (ma, mi): (u32, u32) = (ma.parse().unwrap(), mi.parse().unwrap());
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mknod(cpath(path).as_ptr(), kind | 0o644, libc::makedev(ma, mi)) };
    assert_eq!(rc, 0, "mknod {}: {}", path.display(), std::io::Error::last_os_error());
}

/// A state file whose metadata is exactly [`LIMIT`] bytes, holding saved GPUs 4 and 5.
fn state_at_limit() -> Vec<u8> {
    let mut map = metadata_map(&saved_devices(&[4, 5]));
    map["pad"] = json!("");
    let len = map.to_string().len() as u64;
    map["pad"] = json!("p".repeat((LIMIT - len) as usize));
    let header = map.to_string();
    assert_eq!(header.len() as u64, LIMIT);
    state_file(header.as_bytes(), b"\x78\x01state data")
}

/// `[` or `{`, spaces, and the closing bracket: valid JSON one byte over the limit.
fn json_over_limit(open: u8, close: u8) -> Vec<u8> {
    let mut v = vec![b' '; (LIMIT + 1) as usize];
    v[0] = open;
    *v.last_mut().unwrap() = close;
    v
}

/// JSON holding one value more than the limit (262,144): an array of 262,144 zeros, in a spec
/// object for `--spec`.
fn values_over_limit(feed: Feed) -> String {
    let zeros = vec!["0"; 1 << 18].join(",");
    match feed {
        Feed::Spec => format!(r#"{{"ociVersion":"1.0.2","x":[{zeros}]}}"#),
        _ => format!("[{zeros}]"),
    }
}

impl Applied {
    fn new() -> Applied {
        Applied { remove: Vec::new(), moved: Vec::new(), fifos: Vec::new(), extra_args: Vec::new() }
    }

    /// Moves `path` aside (if it exists), to be moved back by `restore`.
    fn aside(&mut self, path: &Path) {
        if fs::symlink_metadata(path).is_ok() {
            let mut aside = path.as_os_str().to_owned();
            aside.push(".good");
            let aside = PathBuf::from(aside);
            fs::rename(path, &aside).unwrap();
            self.moved.push((aside, path.to_owned()));
        }
        self.remove.push(path.to_owned());
    }

    /// Creates, at `path`, a thing of `kind` with `rest` as its argument.
    fn make(&mut self, path: &Path, kind: &str, rest: &[&str], feed: Feed) {
        match kind {
            "missing" => {}
            "dir" => fs::create_dir(path).unwrap(),
            "ckpt-dir-img-dir" => fs::create_dir_all(path.join("checkpoint.img")).unwrap(),
            "fifo" => {
                mkfifo(path);
                self.fifos.push(path.to_owned());
            }
            "char" => mknod(path, libc::S_IFCHR, rest[0]),
            "block" => mknod(path, libc::S_IFBLK, rest[0]),
            "symlink" => std::os::unix::fs::symlink(rest[0], path).unwrap(),
            "file" => fs::write(path, "a regular file\n").unwrap(),
            "socket" => drop(std::os::unix::net::UnixListener::bind(path).unwrap()),
            "text" | "bytes" => fs::write(path, unescape(&rest.join(" "))).unwrap(),
            "lines" => fs::write(path, format!("{}\n", rest[1..].join(" ")).repeat(rest[0].parse().unwrap())).unwrap(),
            "json-over-limit" => match feed {
                Feed::Spec => fs::write(path, json_over_limit(b'{', b'}')).unwrap(),
                _ => fs::write(path, json_over_limit(b'[', b']')).unwrap(),
            },
            "state-at-limit" => fs::write(path, state_at_limit()).unwrap(),
            "values-over-limit" => fs::write(path, values_over_limit(feed)).unwrap(),
            other => panic!("unknown kind {other:?}"),
        }
    }

    /// Applies `case` to `env`.
    fn apply(env: &Env, case: &Case) -> Applied {
        let mut a = Applied::new();
        let w = case.words();
        match (case.feed, w[0]) {
            (Feed::Flags | Feed::MountFlags, "args") => a.extra_args = case.flag_args(),
            (feed, "file") => {
                let target = env.target(feed);
                a.aside(&target);
                fs::copy(bad_dir().join(w[1]), &target).unwrap_or_else(|e| panic!("{}: {e}", w[1]));
            }
            (feed, "make") => {
                let target = env.target(feed);
                a.aside(&target);
                a.make(&target, w[1], &w[2..], feed);
            }
            (Feed::HostDev, "add") => {
                let name = PathBuf::from(OsString::from_vec(unescape(w[2])));
                let path = env.host.dev().join(&name);
                let parent = path.parent().unwrap().to_owned();
                if !parent.exists() {
                    fs::create_dir_all(&parent).unwrap();
                    a.remove.push(parent);
                }
                a.remove.insert(0, path.clone());
                a.make(&path, w[1], &w[3..], Feed::HostDev);
            }
            (Feed::HostRoot, "info") => {
                let bus = GpuFacts::nvidia(w[1].parse().unwrap()).bus;
                let path = env.host.root().join("proc/driver/nvidia/gpus").join(bus).join("information");
                a.aside(&path);
                a.make(&path, w[2], &w[3..], Feed::HostRoot);
            }
            (Feed::HostRoot, "kfd") => {
                let nodes = env.host.root().join(KFD_NODES);
                let path = if w[1] == "." { nodes } else { nodes.join(w[1]) };
                a.aside(&path);
                a.make(&path, w[2], &w[3..], Feed::HostRoot);
            }
            (Feed::HostRoot, "pci") => {
                let bus = GpuFacts::nvidia(w[1].parse().unwrap()).bus;
                let path = env.host.root().join("sys/bus/pci/devices").join(bus).join(w[2]);
                a.aside(&path);
                a.make(&path, w[3], &w[4..], Feed::HostRoot);
            }
            (feed, verb) => panic!("{}: {verb:?} does not apply to {feed:?}", case.name),
        }
        a
    }

    /// Lets a reader blocked on one of our FIFOs go: opening the write end and closing it
    /// completes the reader's open and gives it end of file.
    fn unblock(&self) {
        for f in &self.fifos {
            // SAFETY: a valid path; the descriptor is closed at once.
            let fd = unsafe { libc::open(cpath(f).as_ptr(), libc::O_WRONLY | libc::O_NONBLOCK) };
            if fd >= 0 {
                unsafe { libc::close(fd) };
            }
        }
    }

    fn restore(self) {
        for p in &self.remove {
            remove_any(p);
        }
        for (aside, original) in self.moved.iter().rev() {
            fs::rename(aside, original).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running the binary with a deadline and a memory cap
// ---------------------------------------------------------------------------------------------

struct Run {
    /// `None` when it had to be killed at the deadline.
    code: Option<i32>,
    stdout: String,
    stderr: String,
    max_rss_kib: i64,
}

impl Run {
    fn describe(&self) -> String {
        match self.code {
            None => format!("still running after {DEADLINE:?} (killed); stderr: {:?}", self.stderr),
            Some(c) => format!(
                "exit {c}, stdout {} bytes, stderr {:?}, peak RSS {} KiB",
                self.stdout.len(),
                self.stderr,
                self.max_rss_kib
            ),
        }
    }
}

/// The peak RSS (`VmHWM`) of a running process, in KiB.
fn vm_hwm_kib(pid: libc::pid_t) -> Option<i64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The largest peak RSS of a running process and its descendants, in KiB: `devremapd mount`
/// loads its inputs in a server child (issue 13), so its own peak says nothing of theirs.
fn tree_hwm_kib(pid: libc::pid_t) -> i64 {
    let children = children(pid as u32).into_iter().map(|c| c as libc::pid_t);
    children.map(tree_hwm_kib).fold(vm_hwm_kib(pid).unwrap_or(0), i64::max)
}

/// Runs `devremapd <args>` with stdout and stderr to files, under [`RLIMIT_AS`] (set by a
/// shell that then execs the binary), killed at [`DEADLINE`]. Its peak RSS (and its children's) is
/// sampled from `/proc/<pid>/status` every millisecond while it runs: `ru_maxrss` would not do, as the
/// kernel counts in it the pages of this (large) test process that the child started as. A
/// short run may end between samples, but a run that reads without bound is long enough to be
/// seen.
// The child is reaped by `waitpid` below, which also lets us sample it while it runs.
#[allow(clippy::zombie_processes)]
fn run_limited(args: &[String], dir: &Path) -> Run {
    let out = dir.join("stdout");
    let err = dir.join("stderr");
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {} && exec \"$0\" \"$@\"", RLIMIT_AS / 1024))
        .arg(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out).unwrap())
        .stderr(fs::File::create(&err).unwrap());
    let child = cmd.spawn().expect("devremapd starts");
    let pid = child.id() as libc::pid_t;
    let deadline = Instant::now() + DEADLINE;
    let mut status = 0;
    let mut killed = false;
    let mut max_rss_kib = 0;
    loop {
        max_rss_kib = max_rss_kib.max(tree_hwm_kib(pid));
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        assert_eq!(r, 0, "waitpid: {}", std::io::Error::last_os_error());
        if Instant::now() > deadline && !killed {
            // SAFETY: our child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let code = if killed {
        None
    } else if libc::WIFEXITED(status) {
        Some(libc::WEXITSTATUS(status))
    } else {
        Some(128 + libc::WTERMSIG(status))
    };
    Run {
        code,
        stdout: String::from_utf8_lossy(&fs::read(&out).unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&fs::read(&err).unwrap()).into_owned(),
        max_rss_kib,
    }
}

/// Checks that `run` failed as bad input does, naming one of `blame` and saying `expect`. For
/// a path, the line starts `error: <blame>`; for a flag, it names the flag or its value.
fn check_error(run: &Run, blame: &[String], is_path: bool, expect: &str) -> Result<String, String> {
    let bad = |why: &str| Err(format!("{why}: {}", run.describe()));
    if run.code != Some(1) {
        return bad("expected exit status 1");
    }
    if !run.stdout.is_empty() {
        return bad("expected nothing on stdout");
    }
    if !run.stderr.ends_with('\n') || run.stderr.lines().count() != 1 {
        return bad("expected exactly one line on stderr");
    }
    let line = run.stderr.trim_end();
    let named = if is_path {
        blame.iter().any(|b| line.starts_with(&format!("error: {b}")))
    } else {
        line.starts_with("error: ") && blame.iter().any(|b| line.contains(b.as_str()))
    };
    if !named {
        return bad(&format!("the line must start with `error: ` and name {blame:?}"));
    }
    if !line.contains(expect) {
        return bad(&format!("the line lacks {expect:?}"));
    }
    if run.max_rss_kib > MAX_RSS_KIB {
        return bad(&format!("peak RSS over {MAX_RSS_KIB} KiB"));
    }
    Ok(line.to_owned())
}

fn plan_args(env: &Env, applied: &Applied) -> Vec<String> {
    let mut args = vec!["plan".to_owned(), "--json".to_owned()];
    args.extend(env.args());
    args.extend(applied.extra_args.iter().cloned());
    args
}

/// The plan of the good inputs.
fn good_plan(env: &Env) -> Value {
    plan_json(&env.args().iter().map(String::as_str).collect::<Vec<_>>())
}

fn report(what: &str, failures: &[String], ran: usize) {
    assert!(failures.is_empty(), "{what}: {} of {ran} cases failed:\n  {}", failures.len(), failures.join("\n  "));
    eprintln!("{what}: {ran} cases passed");
}

// ---------------------------------------------------------------------------------------------
// The corpus itself
// ---------------------------------------------------------------------------------------------

/// The corpus is well formed: at least 30 error cases, unique names, every case's file exists,
/// and every committed input file is used by exactly one case (none is dead weight).
#[test]
fn corpus_is_well_formed() {
    let cases = cases();
    let errors = cases.iter().filter(|c| c.expect.is_some()).count();
    assert!(errors >= 30, "only {errors} error cases");
    let mut names: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    names.sort();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "duplicate case names");
    let mut used = Vec::new();
    for c in &cases {
        let w = c.words();
        match w[0] {
            "file" => {
                assert!(bad_dir().join(w[1]).is_file(), "{}: no file {}", c.name, w[1]);
                used.push(w[1].to_owned());
            }
            "make" | "add" | "info" | "pci" | "kfd" | "args" => {}
            other => panic!("{}: unknown input verb {other:?}", c.name),
        }
        if matches!(c.feed, Feed::Flags | Feed::MountFlags) {
            assert_eq!(w[0], "args", "{}", c.name);
        }
    }
    let mut files: Vec<String> = fs::read_dir(bad_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "cases.txt" && n != "make_bad.py")
        .collect();
    files.sort();
    used.sort();
    assert_eq!(files, used, "committed files and cases differ");
    eprintln!(
        "corpus: {} cases ({errors} errors, {} ignored inputs), {} committed files",
        cases.len(),
        cases.len() - errors,
        files.len()
    );
}

/// Rule: every bad input makes `devremapd plan` exit 1 with nothing on stdout and exactly one
/// stderr line `error: <path or flag>: <what>` holding the case's expected message; no case
/// hangs (deadline) or reads without bound (address-space cap, peak RSS checked).
#[test]
#[ignore = "needs root (makes device nodes)"]
fn every_bad_input_fails_plan_with_one_line() {
    need_root();
    let env = Env::new();
    let out = TempDir::new().unwrap();
    let (mut failures, mut ran) = (Vec::new(), 0);
    for case in cases().iter().filter(|c| c.in_plan() && c.expect.is_some()) {
        let applied = Applied::apply(&env, case);
        let run = run_limited(&plan_args(&env, &applied), out.path());
        applied.unblock();
        applied.restore();
        ran += 1;
        let is_path = !matches!(case.feed, Feed::Flags | Feed::MountFlags);
        if let Err(e) = check_error(&run, &env.blame(case), is_path, case.expect.as_deref().unwrap()) {
            failures.push(format!("{} ({}): {e}", case.name, case.input));
        }
    }
    report("plan", &failures, ran);
}

/// Rule: inputs that are not GPUs are not errors either: `nvidia-1`, `nvidia` + Arabic-Indic or
/// fullwidth digits (Rust's `\d` matches them, gVisor's does not), `nvidia`, `NVIDIA2`, a
/// non-UTF-8 name, a symlink under such a name (never looked at), missing or garbled driver
/// files (best effort), a KFD topology file that cannot be read or parsed (a warning naming it:
/// the AMD facts are unknown, NVIDIA's plan unchanged), a host render node the spec does not
/// grant, and a complete state file exactly at the 16 MiB limit. Each plans
/// like the good inputs: exit 0, the same tree, host GPUs 0 and 1 only; none hangs or reads
/// without bound (a driver file that is a FIFO or `/dev/zero` must be skipped or capped).
#[test]
#[ignore = "needs root (makes device nodes)"]
fn ignored_inputs_give_the_good_plan() {
    need_root();
    let env = Env::new();
    let good = good_plan(&env);
    let out = TempDir::new().unwrap();
    let (mut failures, mut ran) = (Vec::new(), 0);
    for case in cases().iter().filter(|c| c.in_plan() && c.expect.is_none()) {
        let applied = Applied::apply(&env, case);
        let run = run_limited(&plan_args(&env, &applied), out.path());
        applied.unblock();
        applied.restore();
        ran += 1;
        let plan: Option<Value> = serde_json::from_str(&run.stdout).ok();
        let restored: Option<Vec<&str>> = plan
            .as_ref()
            .and_then(|p| p["restored"].as_array())
            .map(|r| r.iter().filter_map(|g| g["name"].as_str()).collect());
        let why = if run.code != Some(0) || !run.stderr.is_empty() {
            Some("expected success with nothing on stderr".to_owned())
        } else if plan.as_ref().map(|p| &p["nodes"]) != Some(&good["nodes"]) {
            Some(format!(
                "the tree differs from the good inputs' (nodes: {})",
                plan.as_ref().map_or(Value::Null, |p| p["nodes"].clone())
            ))
        } else if restored != Some(vec!["nvidia0", "nvidia1"]) {
            Some(format!("restored GPUs {restored:?}, expected nvidia0 and nvidia1"))
        } else if let Some(why) = unsaid(case, &env, plan.as_ref().map_or(&Value::Null, |p| &p["warnings"])) {
            Some(why)
        } else if run.max_rss_kib > MAX_RSS_KIB {
            Some(format!("peak RSS over {MAX_RSS_KIB} KiB"))
        } else {
            None
        };
        if let Some(why) = why {
            failures.push(format!("{} ({}): {why}: {}", case.name, case.input, run.describe()));
        }
    }
    report("ignored inputs", &failures, ran);
}

/// Why the plan's `warnings` do not say what `case` must: a warning starting with the input's
/// path and holding the case's text.
fn unsaid(case: &Case, env: &Env, warnings: &Value) -> Option<String> {
    let text = case.warns.as_ref()?;
    let path = &env.blame(case)[0];
    let warnings: Vec<&str> = warnings.as_array().map(|w| w.iter().filter_map(Value::as_str).collect())?;
    let said = warnings.iter().any(|w| w.starts_with(path.as_str()) && w.contains(text.as_str()));
    (!said).then(|| format!("no warning starting with {path:?} and holding {text:?}: {warnings:?}"))
}

/// Rule: bad input or bad flags to `devremapd mount` fail at startup like `plan`: exit 1, one
/// `error:` line with the expected message, and no mount left behind (not even a dead one), no
/// state file written.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn every_bad_input_fails_mount_startup_and_leaves_no_mount() {
    need_fuse();
    let env = Env::new();
    let out = private_dir();
    let (mut failures, mut ran) = (Vec::new(), 0);
    for (i, case) in cases().iter().filter(|c| c.in_mount_startup()).enumerate() {
        let mnt = out.path().join(format!("mnt{i}"));
        fs::create_dir(&mnt).unwrap();
        let state = out.path().join(format!("state{i}.json"));
        let applied = Applied::apply(&env, case);
        let mut args = vec!["mount".to_owned(), arg(&mnt).to_owned(), "--state-file".into(), arg(&state).to_owned()];
        args.extend(env.args());
        args.extend(applied.extra_args.iter().cloned());
        let run = run_limited(&args, out.path());
        applied.unblock();
        let left_mounted = is_mounted(&mnt);
        if left_mounted {
            unmount(&mnt);
        }
        applied.restore();
        ran += 1;
        let is_path = !matches!(case.feed, Feed::Flags | Feed::MountFlags);
        let mut why = check_error(&run, &env.blame(case), is_path, case.expect.as_deref().unwrap()).err();
        if left_mounted {
            why = Some(format!("left a mount at the mountpoint; {}", why.unwrap_or_else(|| run.describe())));
        } else if state.exists() && why.is_none() {
            why = Some("wrote a state file".into());
        }
        if let Some(why) = why {
            failures.push(format!("{} ({}): {why}", case.name, case.input));
        }
    }
    report("mount startup", &failures, ran);
}

/// Rule: `devremapd mount` without a usable mountpoint fails with one line naming what is
/// wrong: no mountpoint argument (the line must name MOUNTPOINT), a missing directory, a
/// regular file. (As root: any other user is told that `mount` needs root first.)
#[test]
#[ignore = "needs root"]
fn mount_without_a_usable_mountpoint_fails_with_one_line() {
    need_root();
    let tmp = TempDir::new().unwrap();
    let file = write_file(tmp.path(), "file", "x");
    let missing = tmp.path().join("missing");
    // An empty host root, so the real host's driver files are not read.
    let empty_root = tmp.path().join("empty-root");
    fs::create_dir(&empty_root).unwrap();
    let no_root = ["--host-root".to_owned(), arg(&empty_root).to_owned()];
    let cases: Vec<(Vec<String>, String, Option<&str>)> = vec![
        (vec!["mount".into()], "MOUNTPOINT".into(), None),
        (
            [vec!["mount".into(), arg(&missing).into()], no_root.to_vec()].concat(),
            format!("error: {}", missing.display()),
            Some("no such file or directory"),
        ),
        (
            [vec!["mount".into(), arg(&file).into()], no_root.to_vec()].concat(),
            format!("error: {}", file.display()),
            Some("not a directory"),
        ),
    ];
    let mut failures = Vec::new();
    for (args, blame, expect) in &cases {
        let run = run_limited(args, tmp.path());
        let ok = run.code == Some(1)
            && run.stdout.is_empty()
            && run.stderr.lines().count() == 1
            && run.stderr.starts_with("error: ")
            && run.stderr.contains(blame.as_str())
            && expect.is_none_or(|e| run.stderr.contains(e));
        if !ok {
            failures.push(format!(
                "devremapd {}: expected one line naming {blame:?}: {}",
                args.join(" "),
                run.describe()
            ));
        }
        if let Some(p) = args.get(1) {
            assert!(!is_mounted(Path::new(p)));
        }
    }
    report("mount without a mountpoint", &failures, cases.len());
}

// ---------------------------------------------------------------------------------------------
// A live daemon's reload
// ---------------------------------------------------------------------------------------------

/// Every node under the mount, as `path type mode uid:gid rdev ino [-> target]`, sorted.
fn walk(root: &Path) -> Vec<String> {
    fn go(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("readdir {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            let m = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("stat {}: {e}", p.display()));
            let ft = m.file_type();
            let kind = if ft.is_dir() {
                "dir"
            } else if ft.is_symlink() {
                "symlink"
            } else if ft.is_char_device() {
                "char"
            } else if ft.is_block_device() {
                "block"
            } else {
                "other"
            };
            let target =
                if ft.is_symlink() { format!(" -> {}", fs::read_link(&p).unwrap().display()) } else { String::new() };
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            out.push(format!(
                "{rel} {kind} {:o} {}:{} {}:{} ino {}{target}",
                m.mode() & 0o7777,
                m.uid(),
                m.gid(),
                libc::major(m.rdev()),
                libc::minor(m.rdev()),
                m.ino()
            ));
            if ft.is_dir() {
                go(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    go(root, root, &mut out);
    out
}

fn read_state(d: &Daemon) -> Option<Value> {
    fs::read_to_string(&d.state_file).ok().and_then(|t| serde_json::from_str(&t).ok())
}

/// Sends SIGHUP and waits (up to [`DEADLINE`]) until the state file shows the reload finished
/// (its `reloads` count moved).
fn reload_within(d: &Daemon, before: &Value) -> Option<Value> {
    d.signal(libc::SIGHUP);
    let deadline = Instant::now() + DEADLINE;
    while Instant::now() < deadline {
        if let Some(now) = read_state(d).filter(|now| now["reloads"] != before["reloads"]) {
            return Some(now);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// The daemon answers: the process lives, `null` stats, and checkpoint name `nvidia4` opens
/// host GPU 0 (a fake: `/dev/null`, which reads empty).
fn serving(d: &mut Daemon) -> Result<(), String> {
    if let Ok(Some(status)) = d.child.try_wait() {
        return Err(format!("the daemon exited with {status}: {}", d.log_text()));
    }
    fs::symlink_metadata(d.path("null")).map_err(|e| format!("stat null: {e}"))?;
    let mut buf = [0u8; 4];
    let n = fs::File::open(d.path("nvidia4"))
        .and_then(|mut f| f.read(&mut buf))
        .map_err(|e| format!("open nvidia4: {e}"))?;
    if n != 0 {
        return Err("nvidia4 no longer opens host GPU 0".into());
    }
    Ok(())
}

/// Rule: a reload with bad input changes nothing: the generation stays, `last_error` is set
/// (naming the input and holding the expected message), the state's nodes and remap are the
/// old ones, a stat of every node through the mount (type, mode, owner, rdev, inode number)
/// is unchanged, and the daemon serves on; restoring the good input and reloading clears
/// `last_error`. An ignored input reloads like the good one (same tree). No reload may hang.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn every_bad_input_leaves_a_live_daemon_unchanged() {
    need_fuse();
    let env = Env::new();
    let mut d = Daemon::start(&env.args().iter().map(String::as_str).collect::<Vec<_>>());
    let base = d.state();
    let base_walk = walk(&d.mountpoint);
    assert!(base_walk.iter().any(|l| l.starts_with("nvidia4 char")), "{base_walk:?}");
    assert!(base_walk.iter().any(|l| l.starts_with("dri/card0 char")), "{base_walk:?}");
    let (mut failures, mut ran) = (Vec::new(), 0);
    for case in cases().iter().filter(|c| c.in_reload()) {
        ran += 1;
        let before = d.state();
        let applied = Applied::apply(&env, case);
        let mut why: Vec<String> = Vec::new();
        let after = reload_within(&d, &before);
        let after = match after {
            Some(s) => s,
            None => {
                why.push(format!("the reload did not finish within {DEADLINE:?}"));
                // Let a reader blocked on a FIFO go, and wait for that reload to end.
                let mut got = None;
                for _ in 0..250 {
                    applied.unblock();
                    got = read_state(&d).filter(|s| s["reloads"] != before["reloads"]);
                    if got.is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                got.unwrap_or_else(|| read_state(&d).unwrap())
            }
        };
        match &case.expect {
            Some(expect) => {
                // The state file holds the text raw (JSON escapes it); the corpus gives it as a
                // person reads it, escaped, as the CLI's `error:` line shows it.
                let err = devremap::decision::escape::escape(after["last_error"].as_str().unwrap_or("")).into_owned();
                if after["generation"] != before["generation"] {
                    why.push(format!(
                        "the generation moved {} -> {}: the bad input was taken",
                        before["generation"], after["generation"]
                    ));
                }
                if !err.starts_with(&env.blame(case)[0]) || !err.contains(expect.as_str()) {
                    why.push(format!(
                        "last_error {:?} does not start with {:?} and hold {expect:?}",
                        after["last_error"],
                        env.blame(case)
                    ));
                }
                if after["nodes"] != base["nodes"] || after["remap"] != base["remap"] {
                    why.push("the state's nodes or remap changed".into());
                }
            }
            None => {
                if after["last_error"] != Value::Null || after["generation"] == before["generation"] {
                    why.push(format!("expected a good reload; last_error {}", after["last_error"]));
                }
                if after["nodes"] != base["nodes"] {
                    why.push("the tree changed".into());
                }
            }
        }
        let now_walk = walk(&d.mountpoint);
        if now_walk != base_walk {
            why.push(format!(
                "the mount changed: {:?}",
                now_walk.iter().filter(|l| !base_walk.contains(l)).collect::<Vec<_>>()
            ));
        }
        if let Err(e) = serving(&mut d) {
            why.push(e);
        }
        applied.restore();
        let before = read_state(&d).unwrap();
        match reload_within(&d, &before) {
            Some(s) if s["last_error"].is_null() && s["nodes"] == base["nodes"] => {}
            other => why.push(format!("the good reload after it: {other:?}")),
        }
        if walk(&d.mountpoint) != base_walk {
            why.push("the mount differs after restoring the good input".into());
        }
        if !why.is_empty() {
            failures.push(format!("{} ({}): {}", case.name, case.input, why.join("; ")));
        }
    }
    report("live reload", &failures, ran);
    assert!(d.stop().success());
}

/// Rule: a file rewritten while it is read (truncated to nothing and written again, over and
/// over) gives, each time, either the good plan or one clean error (`truncated state file
/// header`, `file is empty`): never a panic, a hang, a garbled line or a mixed plan. Which of
/// them a run gets depends on timing; the set of allowed outcomes does not. A live daemon
/// reloading the same file either takes the good tree or refuses and keeps it.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn file_rewritten_while_read_gives_one_clean_outcome() {
    need_fuse();
    let env = Env::new();
    let good = good_plan(&env);
    // A large header (about 1 MiB) widens the window between the reader's two reads.
    let mut map = metadata_map(&saved_devices(&[4, 5]));
    map["pad"] = json!("p".repeat(1 << 20));
    let content = state_file(map.to_string().as_bytes(), b"\x78\x01state data");
    fs::write(&env.meta, &content).unwrap();
    let mut d = Daemon::start(&env.args().iter().map(String::as_str).collect::<Vec<_>>());
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, path, content) = (stop.clone(), env.meta.clone(), content.clone());
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mut f = fs::OpenOptions::new().write(true).truncate(true).open(&path).unwrap();
                for chunk in content.chunks(64 * 1024) {
                    std::io::Write::write_all(&mut f, chunk).unwrap();
                    std::thread::yield_now();
                }
                rounds += 1;
                // Complete for a while, so that some reads see all of it.
                std::thread::sleep(Duration::from_millis(2));
            }
            rounds
        })
    };
    let allowed = ["truncated state file header", "file is empty"];
    let out = TempDir::new().unwrap();
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    let mut failures = Vec::new();
    let args = {
        let mut a = vec!["plan".to_owned(), "--json".to_owned()];
        a.extend(env.args());
        a
    };
    for _ in 0..40 {
        let run = run_limited(&args, out.path());
        let outcome = match run.code {
            Some(0)
                if serde_json::from_str::<Value>(&run.stdout)
                    .is_ok_and(|p| p["nodes"] == good["nodes"] && p["remap"] == good["remap"]) =>
            {
                "ok".to_owned()
            }
            Some(1) => match check_error(&run, &[arg(&env.meta).to_owned()], true, "") {
                Ok(line) => allowed.iter().find(|a| line.contains(*a)).map(|a| a.to_string()).unwrap_or_else(|| {
                    failures.push(format!("plan: unexpected error {line:?}"));
                    "other".into()
                }),
                Err(e) => {
                    failures.push(format!("plan: {e}"));
                    "bad".into()
                }
            },
            _ => {
                failures.push(format!("plan: {}", run.describe()));
                "bad".into()
            }
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    let base = d.state();
    for _ in 0..40 {
        // Two refusals in a row may leave the same last_error: a reload shows as a new state
        // file (written by rename, so a new inode).
        let ino = fs::metadata(&d.state_file).unwrap().ino();
        d.signal(libc::SIGHUP);
        let deadline = Instant::now() + DEADLINE;
        let after = loop {
            if fs::metadata(&d.state_file).is_ok_and(|m| m.ino() != ino) {
                break read_state(&d);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let Some(after) = after else {
            failures.push("a reload did not finish".into());
            break;
        };
        let outcome = match after["last_error"].as_str() {
            None if after["nodes"] == base["nodes"] && after["remap"] == base["remap"] => "reload ok".to_owned(),
            None => {
                failures.push(format!("a reload took another tree: {}", after["nodes"]));
                "reload bad".into()
            }
            Some(err) => match allowed.iter().find(|a| err.contains(*a)) {
                Some(a) if after["nodes"] == base["nodes"] => format!("reload refused: {a}"),
                _ => {
                    failures.push(format!("reload: unexpected error {err:?}"));
                    "reload bad".into()
                }
            },
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    if let Err(e) = serving(&mut d) {
        failures.push(e);
    }
    eprintln!("outcomes over {rounds} rewrites: {outcomes:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(d.stop().success());
}

/// Rule: a GPU name that is a symlink is refused and never followed: `plan` refuses it
/// without opening its target. Shown with a FIFO as the target: a writer blocked in opening it
/// would be released by any reader.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn a_gpu_symlink_is_never_followed() {
    need_root();
    let env = Env::new();
    let fifo = env.host.tmp.path().join("watch.fifo");
    mkfifo(&fifo);
    std::os::unix::fs::symlink(&fifo, env.host.dev().join("nvidia2")).unwrap();
    let watcher = {
        let fifo = fifo.clone();
        // Blocks until someone opens the FIFO for reading.
        std::thread::spawn(move || drop(fs::OpenOptions::new().write(true).open(&fifo)))
    };
    let out = TempDir::new().unwrap();
    let mut args = vec!["plan".to_owned(), "--json".to_owned()];
    args.extend(env.args());
    let run = run_limited(&args, out.path());
    let result = check_error(
        &run,
        &[arg(&env.host.dev()).to_owned()],
        true,
        "nvidia2: is a symlink, not a char device; refused",
    );
    std::thread::sleep(Duration::from_millis(50));
    let opened = watcher.is_finished();
    // Release the watcher ourselves.
    drop(fs::File::open(&fifo));
    watcher.join().unwrap();
    result.unwrap_or_else(|e| panic!("{e}"));
    assert!(!opened, "plan opened the target of the symlink nvidia2");
}
