//! A container's devremap state and its daemon, for any front end that starts one `devremapd
//! mount` per container (the OCI runtime wrapper `devremap-runtime` is one; an NRI plugin or a
//! CRIU action script would be others): `<state_dir>/<id>/` holding the mountpoint `dev/`, the
//! daemon's pid, state and log files, the default pid file of the container's init, the front
//! end's own bundle `bundle/config.json` (the caller's spec with its `/dev` pointed at the
//! mount; the caller's bundle is never written), and a restore's metadata copied from the
//! client's checkpoint directory (`restore/`), which the client may remove while the container
//! runs: the daemon reads all its inputs from here, at every reload and after a crash. The
//! daemon's start and stop are in [`daemon`].
//!
//! Assumptions: only root writes under `<state_dir>`, which is made a root-owned directory of
//! mode 0700 (or checked to be root's and writable by no one else), so a pid file found there
//! was written by a daemon we started; still, a pid is signalled only if `/proc/<pid>/cmdline`
//! names this container's mountpoint, so a stale file whose pid was reused never makes us
//! signal another process. The library forbids `unsafe`: what needs it (detaching the daemon
//! before its exec, a pidfd) the front end gives through [`daemon::Processes`].

pub mod daemon;

use crate::io_message;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// What to do about a refused state dir, said after every refusal: the operator's fix.
const FIX: &str =
    "set the config's state_dir to a directory of root's that no one else can write (default /run/devremap)";

/// What went wrong with a container's directory or its daemon; every message names the file or
/// the program at fault.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{}: {}", path.display(), io_message(source))]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: {why}", path.display())]
    Read { path: PathBuf, why: crate::inputs::files::FileError },
    #[error(transparent)]
    Write(#[from] crate::atomic::WriteError),
    #[error("{}: cannot lock: {}", path.display(), errno.desc())]
    Lock { path: PathBuf, errno: Errno },
    #[error("{}: cannot remove: {}", path.display(), io_message(source))]
    Remove { path: PathBuf, source: io::Error },
    /// The config's `state_dir` could not be made, or is not private to root.
    #[error("state_dir {}: {what}", path.display())]
    StateDir { path: PathBuf, what: String },
    /// The pipe the daemon says it is ready on.
    #[error("cannot make a pipe for the daemon: {}", .0.desc())]
    Pipe(Errno),
    #[error("cannot start {}: {}", path.display(), io_message(source))]
    Spawn { path: PathBuf, source: io::Error },
    #[error("devremapd exited ({status}) before its mount answered: {log}")]
    Exited { status: ExitStatus, log: String },
    #[error("devremapd did not answer within {secs} s: {log}")]
    NoAnswer { secs: u64, log: String },
    /// A container's daemon that stopped after its mount was up (SIGKILLed): its `/dev` would
    /// answer ENOTCONN.
    #[error(
        "its devremap daemon is gone ({} names no live devremapd of {}){}",
        pid_file.display(),
        dev.display(),
        log.as_ref().map(|l| format!("; its log's last line: {l}")).unwrap_or_default()
    )]
    Gone { pid_file: PathBuf, dev: PathBuf, log: Option<String> },
    /// Something other than a directory in a container directory's place (a planted symlink):
    /// never followed, never removed.
    #[error("{}: is {what}, not a container's directory; refused (not followed)", path.display())]
    NotDirectory { path: PathBuf, what: &'static str },
    /// A directory that no devremap front end made ([`Container::check_ours`]): left as it is.
    #[error("{}: not a container's directory of devremap's ({why}); left as it is", path.display())]
    NotOurs { path: PathBuf, why: String },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> DaemonError + '_ {
    move |source| DaemonError::Io { path: path.to_owned(), source }
}

/// One container's directory.
pub struct Container {
    pub dir: PathBuf,
}

/// An exclusive `flock` on a directory, released when dropped (or when its holder dies).
pub struct Lock {
    held: Flock<fs::File>,
}

impl Lock {
    /// The locked directory's descriptor: a copy handed to another process (the node daemon,
    /// over its socket) holds the lock as long as either copy is open, since a `flock` belongs
    /// to the open file, not to a process.
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&*self.held)
    }
}

/// Locks directory `dir`: waits for the lock when `wait`, else `None` when another process
/// holds it.
fn lock_dir(dir: &Path, wait: bool) -> Result<Option<Lock>, DaemonError> {
    use std::os::unix::fs::OpenOptionsExt;
    // A directory, never what is planted in its place: a FIFO's open would wait for a writer
    // for ever (with the state dir's lock held, every start on the host behind it: found from
    // outside), a device's could act on the device, a symlink's would lock elsewhere.
    let opened = fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(dir);
    let file = opened.map_err(|e| match (e.raw_os_error(), fs::symlink_metadata(dir)) {
        (Some(libc::ENOTDIR | libc::ELOOP), Ok(meta)) => {
            DaemonError::NotDirectory { path: dir.to_owned(), what: crate::inputs::files::describe(meta.mode()) }
        }
        _ => io_at(dir)(e),
    })?;
    let how = if wait { FlockArg::LockExclusive } else { FlockArg::LockExclusiveNonblock };
    match Flock::lock(file, how) {
        Ok(held) => Ok(Some(Lock { held })),
        Err((_, Errno::EWOULDBLOCK)) if !wait => Ok(None),
        Err((_, errno)) => Err(DaemonError::Lock { path: dir.to_owned(), errno }),
    }
}

/// Locks directory `dir`, waiting for another holder to let go.
fn wait_lock_dir(dir: &Path) -> Result<Lock, DaemonError> {
    // A waiting flock never answers EWOULDBLOCK, so `None` cannot come back.
    lock_dir(dir, true)?.ok_or(DaemonError::Lock { path: dir.to_owned(), errno: Errno::EWOULDBLOCK })
}

/// How long a busy container directory, or another root's, is given to be let go or removed
/// before [`Container::claim`] says what it is, and how often it is looked at meanwhile.
const LET_GO_PATIENCE: Duration = Duration::from_millis(500);
const LET_GO_POLL: Duration = Duration::from_millis(5);

/// What a container directory found in the state dir is to the front end that finds it.
pub enum Found {
    /// A front end is setting it up, or running its container in the foreground.
    Busy,
    /// It belongs to a container of another runtime root (`--root`), named here.
    OtherRoot(String),
    /// Nobody holds it: the caller may tear it down if the runtime does not know the container
    /// (no one can claim it meanwhile: that takes the state dir's lock the caller holds).
    Idle,
}

/// How a refusal names runtime root `root` (as [`Found::OtherRoot`] holds it): the default
/// root is stored empty, which read `runtime root ""` (found from outside).
pub fn root_in_words(root: &str) -> String {
    if root.is_empty() { "the runtime's default root (no --root)".into() } else { format!("runtime root {root:?}") }
}

impl Container {
    pub fn new(state_dir: &Path, id: &str) -> Container {
        Container { dir: state_dir.join(id) }
    }

    /// The mountpoint, which the front end's bundle binds onto the container's `/dev`.
    pub fn dev(&self) -> PathBuf {
        self.dir.join("dev")
    }

    /// The daemon's state file (`devremapd mount --state-file`).
    pub fn state_file(&self) -> PathBuf {
        self.dir.join("state.json")
    }

    fn pid_file(&self) -> PathBuf {
        self.dir.join("devremapd.pid")
    }

    /// Its daemon's log (the keeper's and its servers' stderr).
    pub fn log(&self) -> PathBuf {
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
    /// front ends claiming ids (`claim`, `prepare`) and tearing down leftovers.
    pub fn lock_state_dir(&self) -> Result<Lock, DaemonError> {
        lock_state_dir(self.state_dir())
    }

    /// What this existing directory is to a front end of runtime root `root` (under the state
    /// dir's lock). Another root's is said to be so, busy or not: its `runtime-root` was written
    /// under both locks, so it is there and final.
    pub fn found(&self, root: Option<&str>) -> Result<Found, DaemonError> {
        if let Some(theirs) = self.other_root(root) {
            return Ok(Found::OtherRoot(theirs));
        }
        Ok(if self.is_busy()? { Found::Busy } else { Found::Idle })
    }

    /// Locks the state dir for a front end of runtime root `root` claiming this id, and says
    /// what its directory is ([`Container::found`]; `None`: there is none). A busy directory,
    /// or another root's, is looked at again for up to [`LET_GO_PATIENCE`], with the state
    /// dir's lock let go in between: a node daemon lets a wrapper's lock go when the runtime
    /// that replaced the wrapper exits, and removes a directory once its container is gone (under
    /// the state dir's lock), each a moment after the runtime's caller has seen the runtime exit
    /// (found in CI, on a busy machine, and from outside: a `create` under another root, made as
    /// the first `create` or a foreground `run` of the id returned, was refused, 16 times in 20).
    pub fn claim(&self, root: Option<&str>) -> Result<(Lock, Option<Found>), DaemonError> {
        let deadline = Instant::now() + LET_GO_PATIENCE;
        loop {
            let lock = self.lock_state_dir()?;
            if !self.exists() {
                return Ok((lock, None));
            }
            let found = self.found(root)?;
            if matches!(found, Found::Idle) || Instant::now() >= deadline {
                return Ok((lock, Some(found)));
            }
            drop(lock);
            // flock has no timed wait, and the directory's end has no event to wait for.
            std::thread::sleep(LET_GO_POLL);
        }
    }

    /// Marks this container's daemon as the node daemon's (issue 31), which tears its
    /// directory down once the container is gone; a directory without the mark is an earlier
    /// version's, whose daemon the wrapper stops at `delete` as it always did.
    pub fn mark_node(&self) -> Result<(), DaemonError> {
        Ok(crate::atomic::replace_runtime_file(&self.dir.join("node"), b"")?)
    }

    /// Marks this container as the NRI plugin's (issue 32): its mount lasts until the plugin
    /// hears of the container's end, and only such a container is torn down when containerd no
    /// longer lists it.
    pub fn mark_nri(&self) -> Result<(), DaemonError> {
        Ok(crate::atomic::replace_runtime_file(&self.dir.join("nri"), b"")?)
    }

    /// Records in the NRI mark the container's init: `pid`, started at `start` (`/proc`'s
    /// clock ticks since boot, so a pid reused later is not taken for it).
    pub fn mark_nri_init(&self, pid: u32, start: u64) -> Result<(), DaemonError> {
        self.check_directory()?;
        Ok(crate::atomic::replace_runtime_file(&self.dir.join("nri"), format!("{pid} {start}\n").as_bytes())?)
    }

    /// The init [`Container::mark_nri_init`] recorded, if any.
    pub fn nri_init(&self) -> Option<(u32, u64)> {
        let crate::inputs::files::SmallText::Text(text) =
            crate::inputs::files::read_own_small_text(&self.dir.join("nri"), 64)
        else {
            return None;
        };
        let (pid, start) = text.trim_end().split_once(' ')?;
        Some((pid.parse().ok()?, start.parse().ok()?))
    }

    /// Refuses a directory no devremap front end made, before it is torn down: one that is not
    /// a directory ([`Container::check_directory`]), one another user owns or may write into
    /// (its entries could be swapped under the removal), or, in a state dir others share, one
    /// without the `runtime-root` every front end writes first, ours. The state dir may be a shared
    /// one (`/run`), whose other directories (`/run/lock`, `/run/lvm`) are not ours, whatever
    /// id names them (found from outside: a node daemon's start removed such a directory
    /// holding a file named `node`).
    pub fn check_ours(&self) -> Result<(), DaemonError> {
        self.check_directory()?;
        let not_ours = |why: String| DaemonError::NotOurs { path: self.dir.clone(), why };
        let me = nix::unistd::geteuid().as_raw();
        let meta = fs::symlink_metadata(&self.dir).map_err(io_at(&self.dir))?;
        if meta.uid() != me || meta.mode() & 0o022 != 0 {
            return Err(not_ours(format!("owned by uid {} with mode {:o}", meta.uid(), meta.mode() & 0o7777)));
        }
        // In a state dir of devremap's alone (mode 0700, as it makes one) every directory is a
        // front end's; in a shared one, only one holding its runtime-root, ours, whatever it is
        // now (a leftover's entries may have been swapped for symlinks, which the removal
        // takes without following).
        let shared = fs::metadata(self.state_dir()).map_or(true, |d| d.mode() & 0o077 != 0);
        match fs::symlink_metadata(self.root_file()) {
            _ if !shared => Ok(()),
            Ok(m) if m.uid() == me => Ok(()),
            _ => Err(not_ours("holds no runtime-root of ours, in a state dir others share".into())),
        }
    }

    /// Refuses a directory that is not one (a symlink planted in its place): what is written,
    /// read or stopped through it would be outside the state dir.
    pub fn check_directory(&self) -> Result<(), DaemonError> {
        match fs::symlink_metadata(&self.dir) {
            Ok(meta) if !meta.is_dir() => Err(DaemonError::NotDirectory {
                path: self.dir.clone(),
                what: crate::inputs::files::describe(meta.mode()),
            }),
            _ => Ok(()),
        }
    }

    /// Whether [`Container::mark_nri`] marked it (see [`Container::is_node`]): the wrapper
    /// then runs the runtime unchanged (found from outside: a FIFO named `nri` in a leftover
    /// did so, and the container ran without devremap).
    pub fn is_nri(&self) -> bool {
        self.marked("nri")
    }

    /// Whether [`Container::mark_node`] marked it: a regular file of ours (a directory or a
    /// symlink named `node`, or another user's file, is no mark).
    pub fn is_node(&self) -> bool {
        self.marked("node")
    }

    fn marked(&self, mark: &str) -> bool {
        let me = nix::unistd::geteuid().as_raw();
        fs::symlink_metadata(self.dir.join(mark)).is_ok_and(|m| m.is_file() && m.uid() == me)
    }

    /// Whether a front end holds this directory's lock (setting it up, or running its
    /// container in the foreground).
    pub fn is_busy(&self) -> Result<bool, DaemonError> {
        Ok(lock_dir(&self.dir, false)?.is_none())
    }

    /// The runtime root this directory's container belongs to, when it is not `root`.
    pub fn other_root(&self, root: Option<&str>) -> Option<String> {
        // A directory without the file was left by a front end killed before writing it.
        match crate::inputs::files::read_small_text(&self.root_file(), 4096) {
            crate::inputs::files::SmallText::Text(theirs) if !same_root(&theirs, root.unwrap_or_default()) => {
                Some(theirs)
            }
            _ => None,
        }
    }

    /// Makes this container's directory and mountpoint, records the runtime root, and locks
    /// the directory for as long as the returned lock lives (under the state dir's lock).
    pub fn prepare(&self, root: Option<&str>) -> Result<Lock, DaemonError> {
        let mut builder = DirBuilder::new();
        builder.mode(0o700);
        builder.create(&self.dir).map_err(io_at(&self.dir))?;
        let made = wait_lock_dir(&self.dir).and_then(|lock| {
            builder.create(self.dev()).map_err(io_at(&self.dev()))?;
            crate::atomic::replace_runtime_file(&self.root_file(), root.unwrap_or_default().as_bytes())?;
            Ok(lock)
        });
        // Made partway (a full disk): no one's, so not left for the next front end to find.
        if made.is_err() {
            let _ = remove_within_its_mount(&self.dir);
        }
        made
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

    /// The front end's bundle, which the runtime is given in place of the caller's.
    pub fn bundle(&self) -> PathBuf {
        self.dir.join("bundle")
    }

    /// Writes the front end's bundle: `spec`, whose paths were made absolute against the
    /// caller's bundle, as `bundle/config.json`; returns the spec's path.
    pub fn write_bundle(&self, spec: &str) -> Result<PathBuf, DaemonError> {
        let dir = self.bundle();
        DirBuilder::new().mode(0o700).create(&dir).map_err(io_at(&dir))?;
        let path = dir.join("config.json");
        crate::atomic::replace_runtime_file(&path, spec.as_bytes())?;
        Ok(path)
    }

    /// Copies a restore's metadata into `restore/`, under its own name (the daemon tells the
    /// forms apart by content; the front end by name), and returns the copy's path. At most one
    /// byte past the metadata limit is copied, so the daemon still refuses a file too large.
    pub fn keep_metadata(&self, from: &Path) -> Result<PathBuf, DaemonError> {
        let read = |why| DaemonError::Read { path: from.to_owned(), why };
        // A checkpoint image is untrusted: a symlink in it is not followed.
        let mut file = crate::inputs::files::open_own_regular(from).map_err(read)?;
        let mut bytes = Vec::new();
        crate::inputs::files::read_up_to(&mut file, crate::inputs::metadata::MAX_METADATA_LEN + 1, &mut bytes)
            .map_err(io_at(from))?;
        self.keep_metadata_bytes(from.file_name().unwrap_or("metadata".as_ref()), &bytes)
    }

    /// Keeps `bytes` as the restore's metadata `restore/<name>` (an NRI container's record,
    /// from its annotation), written without following a planted symlink; returns its path.
    pub fn keep_metadata_bytes(&self, name: &std::ffi::OsStr, bytes: &[u8]) -> Result<PathBuf, DaemonError> {
        let dir = self.restore_dir();
        DirBuilder::new().mode(0o700).create(&dir).map_err(io_at(&dir))?;
        let to = dir.join(name);
        crate::atomic::replace_runtime_file(&to, bytes)?;
        Ok(to)
    }
}

/// Whether runtime roots `a` and `b` (absolute, or empty for the runtime's default) are one
/// directory: spelled alike, or both there and resolving to one (found from outside:
/// `/var/run/runc` was another root than `/run/runc`, through `/var/run -> /run`).
pub fn same_root(a: &str, b: &str) -> bool {
    a == b
        || (!a.is_empty()
            && !b.is_empty()
            && matches!((fs::canonicalize(a), fs::canonicalize(b)), (Ok(x), Ok(y)) if x == y))
}

/// Removes directory `dir` and everything in it, never crossing into another mount: a mount
/// at `dir` or inside it (one planted there, or one a runtime left behind) is an error naming
/// it, and it, what it holds and the directories above it stay (`std::fs::remove_dir_all`
/// would have emptied the mounted filesystem). Symlinks are removed, never followed. Assumes
/// `dir` is private to root (in the state dir), so nothing is swapped under the walk.
fn remove_within_its_mount(dir: &Path) -> io::Result<()> {
    // Looked for first, so that a refusal removes nothing (found from outside: the mark and the
    // files before the mount went, and the directory, no longer marked, was never retried).
    if let Some(mount) = mount_within(dir)? {
        return Err(io::Error::other(format!("{} is a mount point; left in place", mount.display())));
    }
    remove_tree(dir)
}

/// The first mount at `dir` or below it, if any.
fn mount_within(dir: &Path) -> io::Result<Option<PathBuf>> {
    let meta = fs::symlink_metadata(dir)?;
    // Unknown (a kernel before 5.8, or a dead FUSE mount that statx cannot reach): a mount
    // unless it is on its parent's filesystem.
    let on_parents = || dir.parent().and_then(|p| fs::symlink_metadata(p).ok()).is_some_and(|p| p.dev() == meta.dev());
    if crate::inputs::files::is_mount_root(dir).unwrap_or_else(|| !on_parents()) {
        return Ok(Some(dir.to_owned()));
    }
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let found = match fs::symlink_metadata(&path)? {
            m if m.is_dir() => mount_within(&path)?,
            // A file bind-mounted over another.
            _ if crate::inputs::files::is_mount_root(&path) == Some(true) => Some(path),
            _ => None,
        };
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

/// Removes `dir` and what it holds, symlinks removed, never followed.
fn remove_tree(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if fs::symlink_metadata(&path)?.is_dir() {
            remove_tree(&path)?;
        } else {
            fs::remove_file(&path)?;
        }
    }
    fs::remove_dir(dir)
}

/// Makes `state_dir` (root-owned, 0700) if missing and locks it ([`Container::lock_state_dir`]):
/// a node daemon looks at every directory in it under this lock.
pub fn lock_state_dir(state_dir: &Path) -> Result<Lock, DaemonError> {
    ensure_private_dir(state_dir)?;
    wait_lock_dir(state_dir)
}

/// Makes `dir` (and its missing parents) a directory of mode 0700, or checks that it is one
/// owned by us: never a symlink, never a directory another user could write into. An existing
/// directory is never changed: the config may name a shared one (`/run`, even `/tmp`).
pub fn ensure_private_dir(dir: &Path) -> Result<(), DaemonError> {
    // Named as the config names it: the operator's fix is there.
    let refused = |what: String| DaemonError::StateDir { path: dir.to_owned(), what };
    let io = |e: io::Error| refused(io_message(&e));
    DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io)?;
    let meta = fs::symlink_metadata(dir).map_err(io)?;
    if !meta.is_dir() {
        let what = crate::inputs::files::describe(meta.mode());
        return Err(refused(format!("is {what}, not a directory; refused: {FIX}")));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refused(format!("owned by uid {}, not {me}; refused: {FIX}", meta.uid())));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refused(format!("writable by group or others; refused: {FIX}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: a container's directory is removed whole, and a symlink in it is removed, never
    /// followed: what it names outside stays. (A mount inside it is refused: tests/node.rs
    /// `a_node_daemons_start_tears_down_only_its_containers_and_no_mount_inside`, which needs
    /// root.)
    #[test]
    fn removal_takes_symlinks_not_what_they_name() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("kept"), "kept").unwrap();
        let dir = tmp.path().join("c1");
        fs::create_dir_all(dir.join("bundle/deep")).unwrap();
        fs::write(dir.join("bundle/deep/config.json"), "{}").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("dev")).unwrap();
        std::os::unix::fs::symlink(outside.join("kept"), dir.join("bundle/state.json")).unwrap();
        remove_within_its_mount(&dir).unwrap();
        assert!(!dir.exists());
        assert_eq!(fs::read_to_string(outside.join("kept")).unwrap(), "kept");
        assert_eq!(remove_within_its_mount(&dir).unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    /// Bug (CI, a busy machine; and from outside): a node daemon lets a wrapper's lock go only
    /// when it sees the runtime that replaced the wrapper exit, and removes a directory once its
    /// container is gone, each a moment after the runtime's caller sees it exit; a front end
    /// that looked once in that moment refused the id. A directory let go within the patience
    /// is idle, and one removed (another root's) is none; one held, or of another root, beyond
    /// it is said to be so. The state dir's lock is let go while it waits (the removal takes it).
    #[test]
    fn a_claim_waits_a_moment_for_a_directory_to_be_let_go_or_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let c = Container::new(tmp.path(), "c1");
        let held = c.prepare(None).unwrap();
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(LET_GO_PATIENCE / 5);
            drop(held);
        });
        assert!(matches!(c.claim(None).unwrap(), (_, Some(Found::Idle))));
        letting_go.join().unwrap();
        let held = wait_lock_dir(&c.dir).unwrap();
        assert!(matches!(c.claim(None).unwrap(), (_, Some(Found::Busy))));
        drop(held);

        let theirs = Container::new(tmp.path(), "c2");
        drop(theirs.prepare(Some("/run/theirs")).unwrap());
        let removing = {
            let dir = theirs.dir.clone();
            let state_dir = tmp.path().to_owned();
            std::thread::spawn(move || {
                std::thread::sleep(LET_GO_PATIENCE / 5);
                // As a node daemon removes one: under the state dir's lock.
                let _lock = wait_lock_dir(&state_dir).unwrap();
                remove_within_its_mount(&dir).unwrap();
            })
        };
        assert!(matches!(theirs.claim(Some("/run/mine")).unwrap(), (_, None)));
        removing.join().unwrap();
        drop(theirs.prepare(Some("/run/theirs")).unwrap());
        assert!(
            matches!(theirs.claim(Some("/run/mine")).unwrap(), (_, Some(Found::OtherRoot(r))) if r == "/run/theirs")
        );
    }

    /// Rule: a directory of another runtime root is said to be so, busy or not (ids are unique
    /// per root only): the refusal names the root, not a front end setting the id up.
    #[test]
    fn another_roots_directory_is_named_busy_or_not() {
        let tmp = tempfile::tempdir().unwrap();
        let c = Container::new(tmp.path(), "c1");
        let _held = c.prepare(Some("/run/theirs")).unwrap();
        assert!(matches!(c.found(Some("/run/mine")).unwrap(), Found::OtherRoot(r) if r == "/run/theirs"));
        assert!(matches!(c.found(None).unwrap(), Found::OtherRoot(r) if r == "/run/theirs"));
    }

    /// Rule: the default root, stored empty, is named in words, never as `""`.
    #[test]
    fn the_default_root_is_named_in_words() {
        assert_eq!(root_in_words(""), "the runtime's default root (no --root)");
        assert_eq!(root_in_words("/run/theirs"), "runtime root \"/run/theirs\"");
    }
}
