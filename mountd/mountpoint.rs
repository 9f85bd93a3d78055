//! The mountpoint, before and after serving: who may reach it, the lock that makes one daemon
//! its only server, what is mounted there, whether a FUSE daemon behind it still answers, and
//! detaching what is left.
//!
//! Assumptions:
//! - `statfs` on a FUSE mount always reaches its daemon (the kernel caches stat answers, never
//!   statfs), so it tells a live mount from a dead one (ENOTCONN).
//! - The mount lives in the host's mount namespace with `allow_other` and `dev`: whoever can
//!   walk to the mountpoint can open every node the tree makes 0666. So a directory above it
//!   must keep out every user but root. Only mode bits and owners are read: POSIX ACLs on the
//!   directories above are not, and must not open them to others.

use devremap::inputs::files::is_mount_root;
use devremap::io_message;
use log::warn;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::mount::MntFlags;
use nix::sys::stat::Mode;
use nix::sys::statfs::{FUSE_SUPER_MAGIC, Statfs};
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What to tell an operator whose mountpoint others can reach.
const HOW_TO_FIX: &str = "mount under a directory only root can enter, e.g. `install -d -m 0700 /run/devremap` \
     and a mountpoint in it";

/// Why a mountpoint cannot be served, or is not a devremap mount: each names the path and what
/// is wrong with it. (`path` is the mountpoint as given, `file` another file on the way.)
#[derive(Debug, thiserror::Error)]
pub enum MountpointError {
    #[error("{path}: {why}")]
    Io { path: String, why: String },
    #[error("{0}: not a directory")]
    NotADirectory(String),
    #[error("{path}: {dir} can be changed by users other than root, who could swap the path; {HOW_TO_FIX}")]
    Changeable { path: String, dir: String },
    #[error("{0}: users other than root can reach it, and through it every device it would serve; {HOW_TO_FIX}")]
    Reachable(String),
    #[error("{0}: cannot mount on the root directory")]
    Root(String),
    #[error("{file}: cannot open the lock file: {why}")]
    OpenLock { file: String, why: String },
    #[error("{path}: another devremapd serves it (it holds {file}); refusing to start a second")]
    Locked { path: String, file: String },
    #[error("{file}: cannot lock: {why}")]
    Lock { file: String, why: String },
    #[error("{path}: already a mount point ({mounted}); refusing to mount over it")]
    Mounted { path: String, mounted: String },
    #[error(
        "{path}: not empty ({shown}); the mount would hide it (a container runtime may have written there while no \
         mount was up): empty it, then start again"
    )]
    NotEmpty { path: String, shown: String },
    #[error("{0}: the mount did not answer within 10 s")]
    NoAnswer(String),
    /// [`check_devremap_mount`]'s verdict, said of a path its caller names.
    #[error("{0}")]
    NotDevremap(String),
}

fn io(path: impl std::fmt::Display, e: &std::io::Error) -> MountpointError {
    MountpointError::Io { path: path.to_string(), why: io_message(e) }
}

/// The mountpoint's canonical path, which must be a directory, or a dead FUSE mount (on which
/// `realpath` fails with ENOTCONN; its parent is resolved instead). Neither step waits on a
/// FUSE daemon mounted there: `realpath` only reads links, and the type comes from what the
/// kernel already knows (`statx` with `AT_STATX_DONT_SYNC`), so a second daemon started on a
/// live mount whose server hangs reaches the lock, and is refused there, at once.
pub fn resolve(path: &Path) -> Result<PathBuf, MountpointError> {
    let m = path.display();
    let fail = |e: &std::io::Error| io(&m, e);
    let canonical = match path.canonicalize() {
        Ok(canonical) => canonical,
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else { return Err(fail(&e)) };
            let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            return Ok(parent.canonicalize().map_err(|e| fail(&e))?.join(name));
        }
        Err(e) => return Err(fail(&e)),
    };
    use rustix::fs::{AtFlags, CWD, FileType, StatxFlags, statx};
    match statx(CWD, &canonical, AtFlags::STATX_DONT_SYNC, StatxFlags::TYPE) {
        Ok(st) if FileType::from_raw_mode(st.stx_mode.into()) == FileType::Directory => Ok(canonical),
        Ok(_) => Err(MountpointError::NotADirectory(m.to_string())),
        Err(rustix::io::Errno::NOTCONN) => Ok(canonical),
        Err(e) => Err(fail(&e.into())),
    }
}

/// Refuses a mountpoint that a user other than root can reach, or could swap for another path.
///
/// Rule: some directory above the mountpoint (the mountpoint itself is hidden by the mount) is
/// owned by root and not searchable by others (nor by its group, unless that is root's group),
/// and neither it nor any directory above it can be changed by a user other than root (owned by
/// root; writable by others only with the sticky bit, by its group only when that is root's).
pub fn check_private(canonical: &Path, m: &str) -> Result<(), MountpointError> {
    // From `/` down to the mountpoint's parent.
    let mut ancestors: Vec<&Path> = canonical.ancestors().skip(1).collect();
    ancestors.reverse();
    for dir in ancestors {
        let meta = std::fs::symlink_metadata(dir).map_err(|e| io(dir.display(), &e))?;
        let (mode, root_group) = (meta.mode(), meta.gid() == 0);
        let sticky = mode & 0o1000 != 0;
        let changeable_by_others =
            meta.uid() != 0 || (mode & 0o002 != 0 && !sticky) || (mode & 0o020 != 0 && !sticky && !root_group);
        if changeable_by_others {
            return Err(MountpointError::Changeable { path: m.into(), dir: dir.display().to_string() });
        }
        let closed = mode & 0o001 == 0 && (root_group || mode & 0o010 == 0);
        if closed {
            return Ok(());
        }
    }
    Err(MountpointError::Reachable(m.into()))
}

/// An exclusive lock on a mountpoint, held for the daemon's life: a file `.<name>.lock` beside
/// the mountpoint, `flock`ed. Dropping it removes the file (while still holding the lock) and
/// releases it; a daemon killed outright leaves the file, and the kernel releases the lock.
#[derive(Debug)]
pub struct MountLock {
    path: PathBuf,
    lock: Flock<File>,
}

impl MountLock {
    /// The lock file of the mountpoint `canonical`: `.<name>.lock` beside it (`None` for `/`).
    pub fn path_of(canonical: &Path) -> Option<PathBuf> {
        let (dir, name) = (canonical.parent()?, canonical.file_name()?);
        Some(dir.join(format!(".{}.lock", name.to_string_lossy())))
    }

    /// Takes the lock of `mountpoint`, or says that another daemon holds it. The file is opened
    /// without following a symlink; after locking, it must still be the file at the path (a
    /// daemon that exits removes it, so a lock on a removed file is taken again).
    pub fn take(canonical: &Path, m: &str) -> Result<MountLock, MountpointError> {
        let Some(path) = MountLock::path_of(canonical) else { return Err(MountpointError::Root(m.into())) };
        let p = path.display().to_string();
        loop {
            // What is there said as for every file devremap writes ("is a symlink, not a regular
            // file"), rather than O_NOFOLLOW's ELOOP, which still refuses one swapped in after.
            devremap::atomic::check_destination(&path)
                .map_err(|e| MountpointError::OpenLock { file: p.clone(), why: io_message(&e) })?;
            let flags = OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
            let fd = nix::fcntl::open(&path, flags, Mode::from_bits_truncate(0o600))
                .map_err(|e| MountpointError::OpenLock { file: p.clone(), why: io_message(&e.into()) })?;
            let file = File::from(fd);
            // A FIFO or node there (O_NOFOLLOW already refused a symlink) is never locked, and
            // so never removed at exit.
            let mode = file.metadata().map_err(|e| io(&p, &e))?.mode();
            devremap::atomic::check_mode(mode)
                .map_err(|e| MountpointError::OpenLock { file: p.clone(), why: io_message(&e) })?;
            let lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => lock,
                Err((_, Errno::EWOULDBLOCK)) => {
                    return Err(MountpointError::Locked { path: m.into(), file: p });
                }
                Err((_, e)) => return Err(MountpointError::Lock { file: p, why: io_message(&e.into()) }),
            };
            let held = lock.metadata().map_err(|e| io(&p, &e))?;
            if std::fs::symlink_metadata(&path).is_ok_and(|now| now.dev() == held.dev() && now.ino() == held.ino()) {
                return Ok(MountLock { path, lock });
            }
        }
    }
}

impl Drop for MountLock {
    fn drop(&mut self) {
        // Still ours: nobody else removes or replaces the file while we hold the lock.
        if let (Ok(now), Ok(held)) = (std::fs::symlink_metadata(&self.path), self.lock.metadata())
            && now.dev() == held.dev()
            && now.ino() == held.ino()
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Detaches a dead FUSE mount left at the (canonical) mountpoint (ENOTCONN), refuses to stack
/// on a live mount, and refuses a directory that is not empty: what is in it would be hidden by the
/// mount (a runtime may have written `pts`, `shm`, `mqueue` there while no mount was up).
pub fn prepare_mountpoint(path: &Path, m: &str) -> Result<(), MountpointError> {
    // statfs always reaches a FUSE daemon (stat may be answered from the kernel's cache), so
    // ENOTCONN here means the daemon behind the mount is gone.
    if let Err(e) = statfs(path) {
        if e != Errno::ENOTCONN {
            return Err(io(m, &e.into()));
        }
        warn!("{m}: a dead FUSE mount was left here; detaching it");
        detach(path);
    }
    if let Some(fs) = mounted_at(path) {
        return Err(MountpointError::Mounted { path: m.into(), mounted: fs.to_string() });
    }
    let entries = std::fs::read_dir(path).map_err(|e| io(m, &e))?;
    let names: Vec<String> =
        entries.take(4).map(|e| e.map_or("?".into(), |e| format!("{:?}", e.file_name()))).collect();
    if !names.is_empty() {
        let more = if names.len() > 3 { ", ..." } else { "" };
        let shown = names.iter().take(3).map(String::as_str).collect::<Vec<_>>().join(", ");
        return Err(MountpointError::NotEmpty { path: m.into(), shown: format!("{shown}{more}") });
    }
    Ok(())
}

/// The source the daemon mounts with (`FSName`): with the type `fuse`, what marks a devremap
/// mount in the mount table.
pub const FSNAME: &str = "devremap";

/// What is mounted at a mount point, as the mount table says.
struct Mounted {
    fstype: String,
    source: String,
}

impl std::fmt::Display for Mounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.fstype, self.source)
    }
}

/// What is mounted exactly at `path` (canonical), if anything: the last, topmost, of the
/// mounts there. The mount table is read only when `path` is a mount's root, or the kernel
/// cannot say ([`is_mount_root`]): its reading grows with every mount on the host, a
/// container's start with it (1 to 200 containers: a start 17 % slower, `benches/node.rs`).
fn mounted_at(path: &Path) -> Option<Mounted> {
    if is_mount_root(path) == Some(false) {
        return None;
    }
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let target = path.to_str()?;
    info.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let dash = fields.iter().position(|f| *f == "-")?;
        if unescape(fields.get(4)?) != target {
            return None;
        }
        Some(Mounted { fstype: unescape(fields.get(dash + 1)?), source: unescape(fields.get(dash + 2)?) })
    })
}

/// Whether anything is mounted exactly at `path` (canonical), read from the mount table without
/// asking a daemon that may be gone or stuck.
pub fn is_mounted(path: &Path) -> bool {
    mounted_at(path).is_some()
}

/// Undoes the mount table's octal escapes (`\040` for a space, `\134` for a backslash, ...).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal =
            bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |n, b| n.wrapping_mul(8).wrapping_add(b - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks that `path` is a live devremap mount: a mount point whose topmost mount is of type
/// `fuse` with source [`FSNAME`], and whose daemon answers. Says what it is instead, if not.
pub fn check_devremap_mount(path: &Path) -> Result<(), MountpointError> {
    let why = |e: std::io::Error| {
        MountpointError::NotDevremap(if e.raw_os_error() == Some(libc::ENOTCONN) {
            "a dead FUSE mount: its daemon is gone".to_owned()
        } else {
            io_message(&e)
        })
    };
    let canonical = path.canonicalize().map_err(why)?;
    match mounted_at(&canonical) {
        None => Err(MountpointError::NotDevremap("not a mount point".to_owned())),
        Some(m) if m.fstype != "fuse" || m.source != FSNAME => {
            Err(MountpointError::NotDevremap(format!("a {} mount of {}", m.fstype, m.source)))
        }
        Some(_) => statfs(&canonical).map(|_| ()).map_err(|e| why(e.into())),
    }
}

/// Lazily unmounts `path` (`umount -l`); what still uses the mount keeps it until done.
pub fn detach(path: &Path) {
    let _ = nix::mount::umount2(path, MntFlags::MNT_DETACH);
}

/// Waits until the mount answers a request (statfs through it reaches our daemon).
pub fn wait_answering(path: &Path) -> Result<(), MountpointError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if statfs(path).is_ok_and(|st| st.filesystem_type() == FUSE_SUPER_MAGIC) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(MountpointError::NoAnswer(path.display().to_string()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The FUSE connection a mount at `path` serves: its device number as the kernel writes it
/// (`(major << 20) | minor`, the name of its directory under `/sys/fs/fuse/connections`). Read
/// without asking the daemon (`AT_STATX_DONT_SYNC`: the superblock's number, cached attributes).
pub fn connection_of(path: &Path) -> Option<u64> {
    use rustix::fs::{AtFlags, CWD, StatxFlags, statx};
    let st = statx(CWD, path, AtFlags::STATX_DONT_SYNC, StatxFlags::empty()).ok()?;
    Some((u64::from(st.stx_dev_major) << 20) | u64::from(st.stx_dev_minor))
}

/// Whether FUSE connection `connection` still exists: its directory under the fusectl
/// filesystem goes when its superblock does, with its last mount (our `umount2` and a
/// container's bind mount alike), before `umount2` returns to us. `None` where fusectl is not
/// mounted at `/sys/fs/fuse/connections`.
pub fn connection_remains(connection: u64) -> Option<bool> {
    const FUSECTL_SUPER_MAGIC: i64 = 0x6573_5543;
    let dir = Path::new("/sys/fs/fuse/connections");
    let fusectl = statfs(dir).ok()?.filesystem_type().0 as i64 == FUSECTL_SUPER_MAGIC;
    fusectl.then(|| dir.join(connection.to_string()).exists())
}

/// The `abort` file of FUSE connection `connection` (fusectl), open for writing: opened while
/// the connection is ours (its mount held), it names that connection for as long as it lives
/// and nothing once it has ended, whatever later takes the number. `None` without fusectl.
pub fn abort_handle(connection: u64) -> Option<File> {
    let path = Path::new("/sys/fs/fuse/connections").join(connection.to_string()).join("abort");
    std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path).ok()
}

/// Whether the mount that `tree` (an `open_tree` copy, say) holds is the devremap mount topmost
/// at `path`: the mount table says a `fuse` mount of [`FSNAME`] is there, and `tree` is of its
/// FUSE connection ([`connection_of`]), which must be `expected` where that is known (the
/// connection its keeper's mount was seen with: found from outside, another container's mount
/// bound over it was handed out). Asks no daemon: a `statfs` would wait for a keeper that is
/// stopped, with no deadline (found from outside: a node daemon's every request slot held that
/// way by `attach` requests for one container, and no other container could start).
pub fn holds_devremap_mount_of(tree: &impl std::os::fd::AsFd, path: &Path, expected: Option<u64>) -> bool {
    use rustix::fs::{AtFlags, StatxFlags, statx};
    let ours = mounted_at(path).is_some_and(|m| m.fstype == "fuse" && m.source == FSNAME);
    let copied = statx(tree, "", AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC, StatxFlags::empty())
        .ok()
        .map(|st| (u64::from(st.stx_dev_major) << 20) | u64::from(st.stx_dev_minor));
    let topmost = connection_of(path);
    ours && copied.is_some() && copied == topmost && expected.is_none_or(|e| copied == Some(e))
}

/// Whether a FUSE mount whose daemon is gone sits at `path` (statfs answers ENOTCONN).
pub fn is_dead_mount(path: &Path) -> bool {
    statfs(path).err() == Some(Errno::ENOTCONN)
}

fn statfs(path: &Path) -> nix::Result<Statfs> {
    nix::sys::statfs::statfs(path)
}
