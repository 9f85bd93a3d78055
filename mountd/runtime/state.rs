//! A container's devremap state: `<state_dir>/<id>/` holding the mountpoint `dev/`, the
//! daemon's pid, state and log files, the default pid file of the container's init, the
//! wrapper's own bundle `bundle/config.json` (the caller's spec with its `/dev` pointed at the
//! mount; the caller's bundle is never written), and a restore's metadata copied from the
//! client's checkpoint directory (`restore/`), which the client may remove while the container
//! runs: the daemon reads all its inputs from here, at every reload and after a crash.
//!
//! Assumptions: only root writes under `<state_dir>`, which is made a root-owned directory of
//! mode 0700 (or checked to be root's and writable by no one else), so a pid file found there
//! was written by a daemon we started; still, a pid is signalled only if `/proc/<pid>/cmdline`
//! names this container's mountpoint, so a stale file whose pid was reused never makes us
//! signal another process.

use devremap::io_message;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::fs::{self, DirBuilder};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a daemon may take to answer, and to stop.
const PATIENCE: Duration = Duration::from_secs(30);

/// One container's directory.
pub struct Container {
    pub dir: PathBuf,
}

/// An exclusive `flock` on a directory, released when dropped (or when its holder dies).
pub struct Lock {
    _held: Flock<fs::File>,
}

/// Locks directory `dir`: waits for the lock when `wait`, else `None` when another process
/// holds it.
fn lock_dir(dir: &Path, wait: bool) -> Result<Option<Lock>, String> {
    let d = dir.display();
    let file = fs::File::open(dir).map_err(|e| format!("{d}: {}", io_message(&e)))?;
    let how = if wait { FlockArg::LockExclusive } else { FlockArg::LockExclusiveNonblock };
    match Flock::lock(file, how) {
        Ok(held) => Ok(Some(Lock { _held: held })),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) if !wait => Ok(None),
        Err((_, e)) => Err(format!("{d}: cannot lock: {}", e.desc())),
    }
}

/// Locks directory `dir`, waiting for another holder to let go.
fn wait_lock_dir(dir: &Path) -> Result<Lock, String> {
    // A waiting flock never answers EWOULDBLOCK, so `None` cannot come back.
    lock_dir(dir, true)?.ok_or_else(|| format!("{}: cannot lock", dir.display()))
}

/// What a container directory found in the state dir is to the wrapper that finds it.
pub enum Found {
    /// A wrapper is setting it up, or running its container in the foreground.
    Busy,
    /// It belongs to a container of another runtime root (`--root`), named here.
    OtherRoot(String),
    /// Nobody holds it: the caller may tear it down if the runtime does not know the container
    /// (no one can claim it meanwhile: that takes the state dir's lock the caller holds).
    Idle,
}

/// What the daemon is started with.
pub struct DaemonArgs<'a> {
    pub devremapd: &'a Path,
    pub spec: &'a Path,
    pub host_dev: Option<&'a Path>,
    pub host_root: &'a Path,
    pub metadata: Option<&'a Path>,
    /// `--device-map` and `--prefer` from the annotations.
    pub extra: Vec<String>,
    /// The runtime's pid file of the container's init.
    pub container_pid_file: &'a Path,
}

impl Container {
    pub fn new(state_dir: &Path, id: &str) -> Container {
        Container { dir: state_dir.join(id) }
    }

    pub fn dev(&self) -> PathBuf {
        self.dir.join("dev")
    }

    fn pid_file(&self) -> PathBuf {
        self.dir.join("devremapd.pid")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("devremapd.log")
    }

    /// The pid file given to the runtime when its caller gave none.
    pub fn default_container_pid_file(&self) -> PathBuf {
        self.dir.join("container.pid")
    }

    pub fn exists(&self) -> bool {
        fs::symlink_metadata(&self.dir).is_ok()
    }

    fn state_dir(&self) -> &Path {
        self.dir.parent().expect("a container dir has a parent")
    }

    /// The file naming the runtime root (`--root`, empty for the runtime's default) that the
    /// container belongs to: ids are unique per root only.
    fn root_file(&self) -> PathBuf {
        self.dir.join("runtime-root")
    }

    /// Makes `<state_dir>` (root-owned, 0700) if missing and locks it: the lock serialises
    /// wrappers claiming ids (`claim`, `prepare`) and tearing down leftovers.
    pub fn lock_state_dir(&self) -> Result<Lock, String> {
        ensure_private_dir(self.state_dir())?;
        wait_lock_dir(self.state_dir())
    }

    /// What this existing directory is to a wrapper of runtime root `root` (under the state
    /// dir's lock).
    pub fn found(&self, root: Option<&str>) -> Result<Found, String> {
        if lock_dir(&self.dir, false)?.is_none() {
            return Ok(Found::Busy);
        }
        Ok(self.other_root(root).map_or(Found::Idle, Found::OtherRoot))
    }

    /// The runtime root this directory's container belongs to, when it is not `root`.
    pub fn other_root(&self, root: Option<&str>) -> Option<String> {
        // A directory without the file was left by a wrapper killed before writing it.
        match devremap::inputs::files::read_small_text(&self.root_file(), 4096) {
            devremap::inputs::files::SmallText::Text(theirs) if theirs != root.unwrap_or_default() => Some(theirs),
            _ => None,
        }
    }

    /// Makes this container's directory and mountpoint, records the runtime root, and locks
    /// the directory for as long as the returned lock lives (under the state dir's lock).
    pub fn prepare(&self, root: Option<&str>) -> Result<Lock, String> {
        let mut builder = DirBuilder::new();
        builder.mode(0o700);
        builder.create(&self.dir).map_err(|e| format!("{}: {}", self.dir.display(), io_message(&e)))?;
        let lock = wait_lock_dir(&self.dir)?;
        builder.create(self.dev()).map_err(|e| format!("{}: {}", self.dev().display(), io_message(&e)))?;
        devremap::atomic::replace_runtime_file(&self.root_file(), root.unwrap_or_default().as_bytes())
            .map_err(|e| e.to_string())?;
        Ok(lock)
    }

    /// The metadata this container was restored with, when it was: the copy [`keep_metadata`]
    /// made (the daemon's `--metadata`), which its next checkpoint's record carries forward
    /// (issue 20).
    ///
    /// [`keep_metadata`]: Container::keep_metadata
    pub fn restored_metadata(&self) -> Option<PathBuf> {
        let mut entries = fs::read_dir(self.restore_dir()).ok()?.flatten();
        entries.find(|e| e.file_type().is_ok_and(|t| t.is_file())).map(|e| e.path())
    }

    fn restore_dir(&self) -> PathBuf {
        self.dir.join("restore")
    }

    /// Starts `devremapd mount` on `dev/`, detached (its own session, stdio to its log file, no
    /// inherited descriptors), and waits until its mount answers (its pid file appears).
    pub fn start_daemon(&self, a: &DaemonArgs) -> Result<Child, String> {
        let log = fs::File::create(self.log()).map_err(|e| format!("{}: {}", self.log().display(), io_message(&e)))?;
        let log2 = log.try_clone().map_err(|e| format!("{}: {}", self.log().display(), io_message(&e)))?;
        let mut cmd = Command::new(a.devremapd);
        cmd.arg("mount")
            .arg(self.dev())
            .arg("--spec")
            .arg(a.spec)
            .arg("--host-root")
            .arg(a.host_root)
            .arg("--pid-file")
            .arg(self.pid_file())
            .arg("--state-file")
            .arg(self.dir.join("state.json"))
            .arg("--container-pid-file")
            .arg(a.container_pid_file)
            .arg("--owner-pid")
            .arg(std::process::id().to_string())
            .args(&a.extra)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        if let Some(dev) = a.host_dev {
            cmd.arg("--host-dev").arg(dev);
        }
        if let Some(meta) = a.metadata {
            cmd.arg("--metadata").arg(meta);
        }
        // The daemon must not share our session (a terminal's ^C) nor hold a descriptor of our
        // caller's (containerd waits for EOF on the runtime's output pipes). Descriptors are
        // marked close-on-exec rather than closed, so that the pipe `spawn` reports a failed
        // exec through stays open; closing is the fallback before Linux 5.11.
        // SAFETY: the closure runs in the forked child before exec, and calls only setsid and
        // close_range, which are async-signal-safe, allocate nothing and touch only the child.
        unsafe {
            cmd.pre_exec(|| {
                let _ = nix::unistd::setsid();
                let (first, last) = (3u32, u32::MAX);
                if libc::syscall(libc::SYS_close_range, first, last, libc::CLOSE_RANGE_CLOEXEC) != 0 {
                    libc::syscall(libc::SYS_close_range, first, last, 0u32);
                }
                Ok(())
            });
        }
        // Watched before the spawn, so that the pid file's arrival cannot be missed.
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)
            .map_err(|e| format!("cannot watch {}: {}", self.dir.display(), e.desc()))?;
        inotify
            .add_watch(&self.dir, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
            .map_err(|e| format!("cannot watch {}: {}", self.dir.display(), e.desc()))?;
        let mut child =
            cmd.spawn().map_err(|e| format!("cannot start {}: {}", a.devremapd.display(), io_message(&e)))?;
        match self.wait_ready(&mut child, &inotify) {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Waits until the daemon's pid file appears (its mount answers), woken by the directory's
    /// events and the daemon's exit rather than by a timer: the wait costs no more than the
    /// daemon's start (issue 17's benchmark).
    fn wait_ready(&self, child: &mut Child, inotify: &Inotify) -> Result<(), String> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let exited = crate::pidfd::pidfd_open(child.id()).ok();
        let deadline = Instant::now() + PATIENCE;
        loop {
            if self.pid_file().exists() {
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("devremapd exited ({status}) before its mount answered: {}", self.last_log_line()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "devremapd did not answer within {} s: {}",
                    PATIENCE.as_secs(),
                    self.last_log_line()
                ));
            }
            let mut fds = vec![PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
            fds.extend(exited.as_ref().map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN)));
            // Without a pidfd (before Linux 5.3) the child's exit is looked at every 100 ms.
            let _ =
                poll(&mut fds, PollTimeout::try_from(left.min(Duration::from_millis(100))).unwrap_or(PollTimeout::MAX));
            // Drained only to rearm the wakeup: which name appeared is checked above.
            let _ = inotify.read_events();
        }
    }

    fn last_log_line(&self) -> String {
        let text = fs::read_to_string(self.log()).unwrap_or_default();
        text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("(no log)").to_owned()
    }

    /// Stops the daemon (if it still runs), detaches whatever is left mounted on `dev/`, and
    /// removes the directory. `child` is the daemon when this process started it (to reap it).
    pub fn teardown(&self, child: Option<Child>) -> Result<(), String> {
        if let Some(pid) = self.daemon_pid() {
            stop(pid);
        }
        if let Some(mut child) = child {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A daemon that was killed leaves a dead FUSE mount; a live one has unmounted already.
        // EINVAL when nothing is mounted there.
        let _ = nix::mount::umount2(&self.dev(), nix::mount::MntFlags::MNT_DETACH);
        match fs::remove_dir_all(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(format!("{}: cannot remove: {}", self.dir.display(), io_message(&e)))
            }
            _ => Ok(()),
        }
    }

    /// The wrapper's bundle, which the runtime is given in place of the caller's.
    pub fn bundle(&self) -> PathBuf {
        self.dir.join("bundle")
    }

    /// Writes the wrapper's bundle: `spec`, whose paths were made absolute against the caller's
    /// bundle, as `bundle/config.json`; returns the spec's path.
    pub fn write_bundle(&self, spec: &str) -> Result<PathBuf, String> {
        let dir = self.bundle();
        DirBuilder::new().mode(0o700).create(&dir).map_err(|e| format!("{}: {}", dir.display(), io_message(&e)))?;
        let path = dir.join("config.json");
        devremap::atomic::replace_runtime_file(&path, spec.as_bytes()).map_err(|e| e.to_string())?;
        Ok(path)
    }

    /// Copies a restore's metadata into `restore/`, under its own name (the daemon tells the
    /// forms apart by content; the wrapper by name), and returns the copy's path. At most one
    /// byte past the metadata limit is copied, so the daemon still refuses a file too large.
    pub fn keep_metadata(&self, from: &Path) -> Result<PathBuf, String> {
        let f = from.display();
        let mut file = devremap::inputs::files::open_regular(from).map_err(|e| format!("{f}: {e}"))?;
        let mut bytes = Vec::new();
        devremap::inputs::files::read_up_to(&mut file, devremap::inputs::metadata::MAX_METADATA_LEN + 1, &mut bytes)
            .map_err(|e| format!("{f}: {}", io_message(&e)))?;
        let dir = self.restore_dir();
        DirBuilder::new().mode(0o700).create(&dir).map_err(|e| format!("{}: {}", dir.display(), io_message(&e)))?;
        let to = dir.join(from.file_name().unwrap_or("metadata".as_ref()));
        devremap::atomic::replace_runtime_file(&to, &bytes).map_err(|e| e.to_string())?;
        Ok(to)
    }

    /// The daemon's pid, if its pid file names a live process serving this mountpoint.
    fn daemon_pid(&self) -> Option<u32> {
        let pid = devremap::inputs::files::read_pid(&self.pid_file()).filter(|&p| p > 1)?;
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let dev = self.dev();
        let dev = dev.as_os_str().as_encoded_bytes();
        cmdline.split(|&b| b == 0).any(|arg| arg == dev).then_some(pid)
    }
}

/// SIGTERM, then waits for the process to exit (SIGKILL after [`PATIENCE`]), through a pidfd.
fn stop(pid: u32) {
    let pid = Pid::from_raw(pid as libc::pid_t);
    // The pid was checked to be our daemon's; an error means it has exited already.
    let _ = kill(pid, Signal::SIGTERM);
    if !crate::pidfd::exits_within(pid.as_raw() as u32, PATIENCE) {
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// Makes `dir` (and its missing parents) a directory of mode 0700, or checks that it is one
/// owned by us: never a symlink, never a directory another user could write into. An existing
/// directory is never changed: the config may name a shared one (`/run`, even `/tmp`).
fn ensure_private_dir(dir: &Path) -> Result<(), String> {
    // Named as the config names it: the operator's fix is there.
    let d = format!("state_dir {}", dir.display());
    const FIX: &str = "set the config's state_dir to a directory of root's that no one else can write \
                       (default /run/devremap)";
    DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| format!("{d}: {}", io_message(&e)))?;
    let meta = fs::symlink_metadata(dir).map_err(|e| format!("{d}: {}", io_message(&e)))?;
    if !meta.is_dir() {
        return Err(format!(
            "{d}: is {}, not a directory; refused: {FIX}",
            devremap::inputs::files::describe(meta.mode())
        ));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(format!("{d}: owned by uid {}, not {me}; refused: {FIX}", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!("{d}: writable by group or others; refused: {FIX}"));
    }
    Ok(())
}
