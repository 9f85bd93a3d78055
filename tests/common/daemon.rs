//! A live `devremapd mount` for tests: starts the real binary on a temporary mountpoint,
//! waits for its state file, and always unmounts, in `Drop` too, so a failing test leaves no
//! mount behind. Waiting is done by polling (the state file, the mount table), never by
//! sleeping a fixed time.

use super::BIN;
use serde_json::Value;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// How long any wait may take before the test fails: generous, since a wait that passes ends
/// at once, and a busy machine (CI beside other builds) can take many seconds for a step.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Fails the calling (`#[ignore]`d) test unless FUSE mounts can be made here: root and
/// `/dev/fuse`.
pub fn need_fuse() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let fuse = Path::new("/dev/fuse").exists();
    if !root || !fuse {
        let why = if root { "/dev/fuse is missing" } else { "mounting FUSE needs root" };
        panic!("{why}: this test mounts a FUSE filesystem");
    }
}

/// Polls `f` until it returns `Some`, failing the test after [`PATIENCE`].
pub fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    wait_for_or(what, String::new, f)
}

/// The text `log()` reads once it holds `text`. A daemon's processes write their lines from a
/// thread of their own, so a line can come after what the state file, the mount or an answer
/// already shows (seen in CI): a test that checks a line waits for it.
pub fn logged(text: &str, log: impl Fn() -> String) -> String {
    wait_for_or(&format!("the log line {text:?}"), &log, || {
        let text_now = log();
        text_now.contains(text).then_some(text_now)
    })
}

/// Like [`wait_for`]; a timeout's message ends with `context()` (a daemon's log, say).
pub fn wait_for_or<T>(what: &str, context: impl Fn() -> String, f: impl FnMut() -> Option<T>) -> T {
    wait_within(PATIENCE, Duration::from_micros(200), what, context, f)
}

/// Polls `f` every `interval` until it returns `Some`, failing the test after `patience` with
/// `context()`.
pub fn wait_within<T>(
    patience: Duration,
    interval: Duration,
    what: &str,
    context: impl Fn() -> String,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + patience;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}\n{}", context());
        std::thread::yield_now();
        std::thread::sleep(interval);
    }
}

/// Whether `path` is a mount point in this process's mount table.
pub fn is_mounted(path: &Path) -> bool {
    let Ok(canon) = path.canonicalize().or_else(|_| Ok::<_, ()>(path.to_owned())) else { return false };
    let target = canon.to_string_lossy().replace(' ', "\\040");
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(target.as_str()))
}

/// Sends `sig` to process `pid`, failing the test if it cannot.
pub fn kill(pid: u32, sig: i32) {
    // SAFETY: kill with a pid and a valid signal.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());
}

/// Whether process `pid` has ended: gone, or a zombie waiting for its parent.
pub fn has_exited(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold spaces.
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) == Some("Z"),
        Err(_) => true,
    }
}

/// The children of process `pid` (of all its threads), from `/proc/<pid>/task/*/children`;
/// none once it has ended.
pub fn children(pid: u32) -> Vec<u32> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| list.split_whitespace().filter_map(|c| c.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// Starts `devremapd ARGS` without `RUST_LOG`, with nothing on stdin and stdout and stderr
/// piped to the test.
pub fn spawn_piped<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Child {
    Command::new(super::BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("devremapd starts")
}

/// Stops process `pid` (`SIGSTOP`) and waits until every thread of it has stopped. The
/// signal stops each thread only when it next runs, so a request sent right after `kill` may
/// still be answered: a test that then waited for a hang waited for ever (the flake of
/// `a_hung_server_is_replaced_after_the_server_timeout` and `an_upgrade_takes_over_from_a_frozen_server`
/// on a busy machine: every server thread stopped, no request in flight).
pub fn freeze(pid: u32) {
    kill(pid, libc::SIGSTOP);
    wait_for_or("the process to stop", || threads_of(pid), || all_stopped(pid).then_some(()));
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`).
fn all_stopped(pid: u32) -> bool {
    let tasks = tasks(pid);
    !tasks.is_empty() && tasks.iter().all(|t| t.state == "T")
}

/// One thread of a process, as `/proc/<pid>/task/<tid>` shows it now.
pub struct Task {
    pub tid: String,
    /// Its name (`comm`).
    pub name: String,
    /// Its state letter (`R`, `S`, `D`, `T`, `Z`...).
    pub state: String,
    /// Where it sleeps in the kernel.
    pub wchan: String,
}

/// The threads of process `pid` now (none once it has ended).
pub fn tasks(pid: u32) -> Vec<Task> {
    let entries = fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    entries
        .map(|task| {
            let read = |f: &str| fs::read_to_string(task.path().join(f)).unwrap_or_default();
            let stat = read("stat");
            // The name may hold anything up to its last ')'.
            let (name, rest) = stat.split_once(" (").and_then(|(_, r)| r.rsplit_once(") ")).unwrap_or(("?", "?"));
            Task {
                tid: task.file_name().to_string_lossy().into_owned(),
                name: name.to_owned(),
                state: rest.split_whitespace().next().unwrap_or("?").to_owned(),
                wchan: read("wchan"),
            }
        })
        .collect()
}

/// Process `pid` and its children, each thread with its state and where it sleeps in the
/// kernel (`wchan`): what a test that timed out waiting on a daemon prints, to tell a stopped
/// server, a keeper thread blocked in a write and one that never woke apart.
pub fn threads_of(pid: u32) -> String {
    let mut out = String::new();
    for p in std::iter::once(pid).chain(children(pid)) {
        for t in tasks(p) {
            out += &format!("pid {p} thread {} ({}): {} in {}\n", t.tid, t.name, t.state, t.wchan);
        }
    }
    out
}

/// The FUSE connection number of the mount at `path` (its device's minor), for
/// `/sys/fs/fuse/connections/N`; mounts fusectl there if nobody has.
pub fn fuse_connection(path: &Path) -> PathBuf {
    let dev = fs::metadata(path).unwrap().dev();
    let conn = Path::new("/sys/fs/fuse/connections").join(libc::minor(dev).to_string());
    if !conn.exists() {
        let _ = Command::new("mount").args(["-t", "fusectl", "fusectl", "/sys/fs/fuse/connections"]).status();
    }
    assert!(conn.exists(), "{} is missing (fusectl not mounted?)", conn.display());
    conn
}

/// Lazily unmounts `path` and waits until the mount table no longer shows it.
pub fn unmount(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid path; umount2 does not keep it.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    wait_for("the mount to go away", || (!is_mounted(path)).then_some(()));
}

/// A tmpfs mounted at a path (made if missing), mode 0700, with `options` (`size=64k`,
/// `nr_inodes=N`): a filesystem a test can fill. Detached on drop.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn mount(path: &Path, options: &str) -> Tmpfs {
        fs::create_dir_all(path).unwrap();
        let options = format!("{options},mode=0700");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &options, "devremap-test", path.to_str().unwrap()])
            .status();
        assert!(status.unwrap().success(), "mount -t tmpfs -o {options}");
        Tmpfs(path.to_owned())
    }

    pub fn remount(&self, mode: &str) {
        let status = Command::new("mount").args(["-o", &format!("remount,{mode}"), self.0.to_str().unwrap()]).status();
        assert!(status.unwrap().success(), "mount -o remount,{mode}");
    }

    /// Writes `name` until the filesystem is full.
    pub fn fill(&self, name: &str) {
        use std::io::Write;
        let mut f = fs::File::create(self.0.join(name)).unwrap();
        let page = [0u8; 4096];
        while f.write_all(&page).is_ok() {}
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        unmount(&self.0);
    }
}

/// A temporary directory only root can enter (0700), as `devremapd mount` requires above its
/// mountpoint (the docs' `install -d -m 0700 /run/devremap`); `TempDir::new` makes 0755 ones.
pub fn private_dir() -> TempDir {
    tempfile::Builder::new()
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .tempdir()
        .expect("a temp dir")
}

/// A [`private_dir`] holding an empty mountpoint `mnt`.
pub fn private_mountpoint() -> (TempDir, PathBuf) {
    let dir = private_dir();
    let mnt = dir.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    (dir, mnt)
}

/// A running daemon and its files.
pub struct Daemon {
    pub child: Child,
    pub dir: TempDir,
    pub mountpoint: PathBuf,
    pub state_file: PathBuf,
    pub pid_file: PathBuf,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts `devremapd mount <tmp>/mnt --state-file .. --pid-file .. <args>` and waits for
    /// the state file, which the daemon writes only once the mount answers.
    pub fn start(args: &[&str]) -> Daemon {
        let (dir, mountpoint) = private_mountpoint();
        Daemon::start_at(dir, mountpoint, args)
    }

    /// Like [`Daemon::start`], with `env` added to the daemon's environment (for instance
    /// `DEVREMAPD_FAILPOINT`).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let (dir, mountpoint) = private_mountpoint();
        Daemon::start_at_with_env(dir, mountpoint, args, env)
    }

    /// Like [`Daemon::start`] on a given mountpoint, which `dir` owns or outlives.
    pub fn start_at(dir: TempDir, mountpoint: PathBuf, args: &[&str]) -> Daemon {
        Daemon::start_at_with_env(dir, mountpoint, args, &[])
    }

    /// Like [`Daemon::start_at`], with `env` added to the daemon's environment.
    pub fn start_at_with_env(dir: TempDir, mountpoint: PathBuf, args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let log = fs::File::create(dir.path().join("daemon.log")).unwrap();
        Daemon::launch(dir, mountpoint, args, env, log.into())
    }

    /// Like [`Daemon::start`], running `program` (a copy of the binary, which a test may replace
    /// to upgrade to) instead of the binary Cargo built.
    pub fn start_program(program: &Path, args: &[&str]) -> Daemon {
        let (dir, mountpoint) = private_mountpoint();
        let log = fs::File::create(dir.path().join("daemon.log")).unwrap();
        Daemon::spawn(program, dir, mountpoint, args, &[], log.into())
    }

    /// Like [`Daemon::start_at_with_env`], with the daemon's stderr going to `stderr` (then
    /// [`Daemon::log_text`] is empty).
    pub fn launch(dir: TempDir, mountpoint: PathBuf, args: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Daemon {
        Daemon::spawn(Path::new(BIN), dir, mountpoint, args, env, stderr)
    }

    fn spawn(
        program: &Path,
        dir: TempDir,
        mountpoint: PathBuf,
        args: &[&str],
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Daemon {
        let state_file = dir.path().join("state.json");
        let pid_file = dir.path().join("devremapd.pid");
        let log = dir.path().join("daemon.log");
        let child = Command::new(program)
            .arg("mount")
            .arg(&mountpoint)
            .arg("--state-file")
            .arg(&state_file)
            .arg("--pid-file")
            .arg(&pid_file)
            .args(args)
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("devremapd starts");
        let mut d = Daemon { child, dir, mountpoint, state_file, pid_file, log };
        // The pid file too, not only the state file: the server writes the state file just
        // before it tells the keeper it answers, and only once the keeper has taken that (and
        // written the pid file) does it watch the server for a hang. A test that stopped the
        // server in between waited for ever for a hung server to be replaced (seen in CI).
        wait_for("the state file and the pid file", || {
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!("devremapd exited early with {status}: {}", d.log_text());
            }
            (d.state_file.exists() && d.pid_file.exists()).then_some(())
        });
        d
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log once it holds `text` ([`logged`]).
    pub fn log_with(&self, text: &str) -> String {
        logged(text, || self.log_text())
    }

    /// The state file, parsed.
    pub fn state(&self) -> Value {
        let text = fs::read_to_string(&self.state_file).expect("the state file is readable");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("state file is not JSON ({e}): {text}"))
    }

    /// The pid of the server answering the kernel (the state file's `server_pid`): the
    /// process that parses the inputs and holds the tree, whose memory tests measure.
    pub fn server_pid(&self) -> u32 {
        let pid = self.state()["server_pid"].as_u64().expect("the state file names the server");
        u32::try_from(pid).expect("a pid")
    }

    pub fn generation(&self) -> u64 {
        self.state()["generation"].as_u64().expect("generation is a number")
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill with a child's pid and a valid signal.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Sends SIGHUP and waits until the state file shows the reload finished: its server's
    /// `reloads` count moved (a refused reload may repeat the error before it word for word),
    /// or another server serves, which reloads once it does. Returns the new state.
    pub fn reload(&self) -> Value {
        let before = self.state();
        self.signal(libc::SIGHUP);
        wait_for("the reload to show in the state file", || {
            let now = fs::read_to_string(&self.state_file).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok())?;
            let moved = now["server_pid"] != before["server_pid"] || now["reloads"] != before["reloads"];
            moved.then_some(now)
        })
    }

    /// Sends SIGTERM and waits for the exit status; one that is not success is shown with the
    /// daemon's log (its error line comes last), which goes with the daemon's directory.
    pub fn stop(mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        let status = wait_for("devremapd to exit", || self.child.try_wait().unwrap());
        if !status.success() {
            eprintln!("devremapd exited with {status} on SIGTERM; its log:\n{}", self.log_text());
        }
        assert!(!is_mounted(&self.mountpoint), "SIGTERM left the mount behind");
        status
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        end(&mut self.child, &self.mountpoint);
    }
}

/// Ends `child` if it still runs (SIGTERM, then SIGKILL after [`PATIENCE`]) and unmounts
/// whatever is left at `mountpoint`.
fn end(child: &mut Child, mountpoint: &Path) {
    if let Ok(None) = child.try_wait() {
        // SAFETY: kill with our child's pid and a valid signal.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + PATIENCE;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    if is_mounted(mountpoint) {
        unmount(mountpoint);
    }
}

/// A `devremapd mount` (or a command that runs one) a test started itself, with its own flags:
/// ended and its mountpoint unmounted on drop, like [`Daemon`], even when the test fails.
pub struct Spawned {
    pub child: Child,
    pub mountpoint: PathBuf,
}

impl Spawned {
    pub fn new(child: Child, mountpoint: &Path) -> Spawned {
        Spawned { child, mountpoint: mountpoint.to_owned() }
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        // SAFETY: kill with our child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        wait_for("the daemon to exit", || self.child.try_wait().unwrap())
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        end(&mut self.child, &self.mountpoint);
    }
}

/// Waits until `devremapd node` `child` answers `hello` on `socket`, failing the test with its
/// log `log` if it exits first or never answers.
pub fn wait_node_answers(child: &mut Child, socket: &Path, log: &Path) {
    wait_for_or(
        "the node daemon to answer",
        || fs::read_to_string(log).unwrap_or_default(),
        || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("devremapd node exited with {status}");
            }
            let hello = devremap::node::protocol::Request::Hello;
            devremap::node::client::ask(socket, &hello, PATIENCE).ok()
        },
    );
}

/// Stops our child `child`, if it still runs, as a service manager would: SIGTERM, waited for,
/// SIGKILL after [`PATIENCE`].
pub fn terminate(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        // SAFETY: kill(2) of our child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + PATIENCE;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Stops the node daemon serving `state_dir` (its pid file `<state_dir>/node.pid`), if one
/// runs, and waits for it to go: the daemon a test's wrapper started (issue 31). Its
/// containers' keepers are the test's own cleanup's.
pub fn stop_node(state_dir: &Path) {
    let Some(pid) = fs::read_to_string(state_dir.join("node.pid")).ok().and_then(|t| t.trim().parse::<i32>().ok())
    else {
        return;
    };
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if cmdline.split(|&b| b == 0).nth(1) != Some(b"node") {
        return;
    }
    // SAFETY: kill(2) of the node daemon whose pid file names it and whose command line is one.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let gone = || !Path::new(&format!("/proc/{pid}")).exists() || proc_state(pid) == Some('Z');
    let deadline = Instant::now() + PATIENCE;
    while !gone() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The state of process `pid` (`R`, `S`, `T`, `Z`, ...), from `/proc/PID/stat`.
pub fn proc_state(pid: impl std::fmt::Display) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
}

/// The `devremapd` processes whose command line names a path under `dir`, but node daemons:
/// the keepers (and their servers) of the containers a node daemon on a state dir there serves.
pub fn keepers_under(dir: &Path) -> Vec<u32> {
    let dir = dir.to_str().expect("a UTF-8 path");
    let Ok(procs) = fs::read_dir("/proc") else { return vec![] };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> =
                cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
            args.first().is_some_and(|a| a.ends_with("devremapd"))
                && args.get(1).map(String::as_str) != Some("node")
                && args.iter().any(|a| a.contains(dir))
        })
        .collect()
}

/// What a test whose node daemon served containers under `dir` may have left, gone: every
/// keeper killed, every mount there detached (a keeper outlives its node daemon by design).
pub fn kill_keepers_and_unmount(dir: &Path) {
    for pid in keepers_under(dir) {
        // SAFETY: kill(2) of a keeper the test's node daemon started (one gone meanwhile: ESRCH).
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for m in mounts.lines().filter_map(|l| l.split(' ').nth(4)).filter(|m| Path::new(m).starts_with(dir)) {
        unmount(Path::new(m));
    }
}

/// The container directories in a node daemon's `state_dir`, sorted.
pub fn container_dirs(state_dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(state_dir) else { return vec![] };
    let mut ids: Vec<String> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ids.sort();
    ids
}

/// The names of `pid`'s threads, sorted.
pub fn thread_names(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = tasks(pid).into_iter().map(|t| t.name).collect();
    names.sort();
    names
}

/// Whether one of `pid`'s threads is named `name`.
pub fn has_thread(pid: u32, name: &str) -> bool {
    tasks(pid).iter().any(|t| t.name == name)
}

/// The thread stacks of process `pid` (its anonymous read-write mappings of 2 MiB, the size of
/// Rust's threads' stacks) that hold no thread's stack pointer, as `/proc/PID/maps` ranges;
/// `None` while a thread runs (its stack pointer is not shown then).
pub fn ended_threads_stacks(pid: u32) -> Option<Vec<String>> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let stacks = maps.lines().filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [range, "rw-p", "00000000", "00:00", "0"] = fields[..] else { return None };
        let (start, end) = range.split_once('-')?;
        let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
        (end - start == 2 << 20).then_some((start, end, range.to_owned()))
    });
    let mut pointers = Vec::new();
    for task in fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        // "NR ARG1 .. ARG6 SP PC" while the thread waits in a system call.
        let syscall = fs::read_to_string(task.path().join("syscall")).unwrap_or_default();
        let fields: Vec<&str> = syscall.split_whitespace().collect();
        let sp =
            fields.len().checked_sub(2).and_then(|i| u64::from_str_radix(fields[i].trim_start_matches("0x"), 16).ok());
        pointers.push(sp?);
    }
    Some(
        stacks
            .filter(|(start, end, _)| !pointers.iter().any(|sp| (start..end).contains(&sp)))
            .map(|(.., r)| r)
            .collect(),
    )
}

/// A daemon stopped with `SIGSTOP` ([`freeze`]: every thread of it stopped), continued when the
/// guard is dropped (even when a test fails).
pub struct Frozen<'a>(Stopped, std::marker::PhantomData<&'a Daemon>);

impl<'a> Frozen<'a> {
    pub fn new(d: &'a Daemon) -> Frozen<'a> {
        Frozen(Stopped::new(d.child.id()), std::marker::PhantomData)
    }
}

/// Process `pid` stopped with `SIGSTOP` ([`freeze`]), continued when the guard is dropped (even
/// when a test fails): a keeper a node daemon started, say.
pub struct Stopped(u32);

impl Stopped {
    pub fn new(pid: u32) -> Stopped {
        // The guard first: a wait that fails still continues the process.
        let stopped = Stopped(pid);
        freeze(pid);
        stopped
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        kill(self.0, libc::SIGCONT);
    }
}

/// A daemon `stuck` (`--ttl 0`, so every stat reaches it) and a spec in `dir` whose bind source
/// lies on it: reading that spec's inputs blocks while `stuck` is [`Frozen`].
pub fn spec_on_a_stuck_mount(dir: &Path) -> (Daemon, PathBuf) {
    let stuck = Daemon::start(&["--ttl", "0", "--host-root", &super::empty_root()]);
    let spec = dir.join("config.json");
    fs::write(
        &spec,
        serde_json::json!({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "mounts": [{"destination": "/dev/held", "type": "bind", "source": super::arg(&stuck.path("null")), "options": ["bind"]}]
        })
        .to_string(),
    )
    .unwrap();
    (stuck, spec)
}
