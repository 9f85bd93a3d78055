//! The files devremap writes (`devremapd`'s pid file, state file, `oci-patch --in-place` and
//! `record --output`; `devremap-runtime`'s patched spec and checkpoint record): replaced
//! atomically, never through a symlink someone planted, and removed at exit only while
//! they are still the ones this process wrote.
//!
//! Assumption: the directory of such a file may be writable by users other than root, who may
//! plant symlinks or files under any name they can predict. So the temporary file is created
//! under a name `tempfile` makes unpredictable (`O_CREAT|O_EXCL`, mode 0600), filled, given
//! the mode and owner of the file it replaces, and renamed over it (a rename replaces a
//! symlink, it never follows it). A file that must outlive a power cut is synced before the
//! rename; one under `/run` that a reboot makes meaningless is not ([`Lasting`]). Every failure, a full or read-only filesystem included, removes the temporary
//! file; only a process killed outright can leave one (`.<name>.<pid>.<random>.tmp`, named by
//! the writer's pid so that whoever reaps a killed writer can remove what it left,
//! [`remove_left_temporaries`]).
//!
//! Only a regular file is ever replaced (issue 29.4): a device node, FIFO, socket, symlink or
//! directory at the path (`--output /dev/null`, `--state-file /dev/stdout`) is refused
//! ([`NotRegular`]) and left as it is. The path is looked at without following a symlink, in
//! the directory the temporary file was opened in, once before anything is written and again
//! right before the rename. Between that last look and the rename only a user who can write in
//! the directory can put something there, and then what the rename replaces is theirs: a
//! host's node (which only root can make) is never replaced. A regular file someone else owns is
//! replaced, keeping its mode and owner: the path is the operator's choice.

use crate::device::Access;
use nix::fcntl::{AtFlags, OFlag};
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The mode of a file that did not exist before: readable by all, like `File::create` under the
/// usual umask (the pid and state files are read by scripts and monitoring).
const NEW_FILE_MODE: u32 = 0o644;

/// A file this process wrote: its path and the inode it got.
#[derive(Debug)]
pub struct Written {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Written {
    /// The file's `(device, inode)`.
    pub fn identity(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// A file written by another process, known by its path and identity.
    pub fn known(path: &Path, (dev, ino): (u64, u64)) -> Written {
        Written { path: path.to_owned(), dev, ino }
    }

    /// Removes the file if the path still names the inode written here, still a regular file:
    /// a file that another process (another daemon given the same path) wrote since is left
    /// alone, and so is a node, FIFO or directory put there since, even one that got the freed
    /// inode's number, which filesystems hand out again at once (issue 29.4).
    pub fn remove_if_ours(&self) {
        let ours = |m: &std::fs::Metadata| m.file_type().is_file() && m.dev() == self.dev && m.ino() == self.ino;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| ours(&m)) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// How long a written file must last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lasting {
    /// Through a power cut: synced before the rename (a checkpoint record, a patched spec).
    Durable,
    /// Until the next boot: a pid or state file, a container's state under `/run`, meaningless
    /// after a reboot. Not synced: an fdatasync costs milliseconds on a busy disk at every
    /// container start (issue 17's benchmark), and a reader still sees the old content or the
    /// new, never a mix.
    UntilReboot,
}

/// Replaces `path` with `bytes` atomically: a reader sees the old content or the new, never a
/// mix, and a file that replaces another keeps its mode and owner.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<Written> {
    write_atomic_as(path, bytes, None)
}

/// [`replace_file`] for a file that lasts [`Lasting::UntilReboot`].
pub fn replace_runtime_file(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    write_atomic_told(path, bytes, None, Lasting::UntilReboot, |_| {})
        .map(drop)
        .map_err(|source| WriteError { path: path.to_owned(), source })
}

/// A file [`replace_file`] could not write: `<path>: cannot write: <why>`, or, when something
/// other than a regular file is there, `<path>: is a FIFO, not a regular file; refused: ...`.
#[derive(Debug, thiserror::Error)]
#[error("{}: {}{}", path.display(), if is_refusal(source) { "" } else { "cannot write: " }, crate::io_message(source))]
pub struct WriteError {
    pub path: PathBuf,
    pub source: io::Error,
}

/// Something other than a regular file where devremap writes a file: never replaced, never
/// removed.
#[derive(Debug, thiserror::Error)]
#[error("is {what}, not a regular file; refused: devremap replaces its output files")]
pub struct NotRegular {
    /// What is there, as [`crate::inputs::files::describe`] says it ("a char device").
    pub what: &'static str,
}

/// Whether `e` is a [`NotRegular`] refusal.
pub fn is_refusal(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<NotRegular>())
}

/// Refuses `path` as a destination if something other than a regular file is there (not
/// followed if a symlink): for a command to refuse a path it will write before it does
/// anything else. Nothing there, or a path that cannot be looked at, passes: the write says why.
pub fn check_destination(path: &Path) -> io::Result<()> {
    names_a_file(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) => check_mode(meta.mode()),
        Err(_) => Ok(()),
    }
}

/// [`check_destination`] with the path in the error: `<path>: is a FIFO, not a regular file; ...`.
pub fn check_destination_named(path: &Path) -> Result<(), WriteError> {
    check_destination(path).map_err(|source| WriteError { path: path.to_owned(), source })
}

/// Refuses a file of `mode` ([`NotRegular`]) unless it is a regular file.
pub fn check_mode(mode: u32) -> io::Result<()> {
    if mode & libc::S_IFMT == libc::S_IFREG {
        return Ok(());
    }
    Err(io::Error::new(io::ErrorKind::AlreadyExists, NotRegular { what: crate::inputs::files::describe(mode) }))
}

/// Refuses a path that ends with `/`: it names a directory (`--output dir/out/`), though
/// `Path::file_name` would drop the slash and a file `dir/out` would be written.
fn names_a_file(path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    match path.as_os_str().as_bytes().last() {
        Some(b'/') => {
            Err(io::Error::new(io::ErrorKind::InvalidInput, NotRegular { what: "a directory's name (it ends with /)" }))
        }
        _ => Ok(()),
    }
}

/// What is at `name` in directory `dir`, not followed: `None` when nothing is; a refusal when
/// it is not a regular file.
fn regular_at(dir: &OwnedFd, name: &std::ffi::OsStr) -> io::Result<Option<nix::sys::stat::FileStat>> {
    match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) => check_mode(stat.st_mode).map(|()| Some(stat)),
        Err(nix::errno::Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// [`write_atomic`] for a caller that keeps nothing but the failure, which names the file.
pub fn replace_file(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    write_atomic(path, bytes).map(drop).map_err(|source| WriteError { path: path.to_owned(), source })
}

/// As [`write_atomic`], but the new file gets `access` (mode bits and owner) when given,
/// whatever the file it replaces had: how a saved file is put back as it was.
pub fn write_atomic_as(path: &Path, bytes: &[u8], access: Option<Access>) -> io::Result<Written> {
    write_atomic_told(path, bytes, access, Lasting::Durable, |_| {})
}

/// As [`write_atomic_as`], for a file that lasts `lasting`, telling `told` the new file's
/// identity just before it is renamed to `path`: another process that removes the file only
/// while it is this one (the keeper, at stop, the state file its server wrote) then knows it
/// before it can be at the path, even if the writer dies right after the rename.
pub fn write_atomic_told(
    path: &Path,
    bytes: &[u8],
    access: Option<Access>,
    lasting: Lasting,
    told: impl FnOnce(&Written),
) -> io::Result<Written> {
    names_a_file(path)?;
    let dir = dir_of(path);
    let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    // Looked at and renamed into through one descriptor: a directory renamed or replaced by a
    // symlink meanwhile fails the rename instead of moving the check elsewhere.
    let dir_fd =
        nix::fcntl::open(dir, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
    // The file being replaced, never a symlink's target; anything but a regular file is refused.
    let old = regular_at(&dir_fd, name)?;
    // O_CREAT|O_EXCL (`create_new`) never follows a symlink, not even a dangling one. Opened
    // here rather than by `tempfile_in`, whose errors carry the path in their text.
    let mut tmp = tempfile::Builder::new()
        .prefix(&temporary_prefix(name, std::process::id()))
        .suffix(".tmp")
        .make_in(dir, |path| std::fs::File::options().write(true).create_new(true).mode(0o600).open(path))?;
    // From here on, dropping `tmp` (any `?` below) removes the temporary file.
    let file = tmp.as_file_mut();
    let access = access.or_else(|| old.as_ref().map(|m| Access { mode: m.st_mode, uid: m.st_uid, gid: m.st_gid }));
    file.set_permissions(std::fs::Permissions::from_mode(access.map_or(NEW_FILE_MODE, |a| a.mode & 0o7777)))?;
    // Only root can give a file away; as another user the new file is that user's.
    if let Some(a) = access
        && nix::unistd::geteuid().is_root()
    {
        std::os::unix::fs::fchown(&*file, Some(a.uid), Some(a.gid))?;
    }
    file.write_all(bytes)?;
    if lasting == Lasting::Durable {
        file.sync_data()?;
    }
    let meta = file.metadata()?;
    let written = Written { path: path.to_owned(), dev: meta.dev(), ino: meta.ino() };
    told(&written);
    // Looked at again: what was put there while we wrote is refused as well.
    regular_at(&dir_fd, name)?;
    let tmp_name = tmp.path().file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?.to_owned();
    nix::fcntl::renameat(&dir_fd, tmp_name.as_os_str(), &dir_fd, name)?;
    // Renamed: nothing left to remove.
    let _ = tmp.into_temp_path().keep();
    Ok(written)
}

/// Creates or truncates the log file `path` for appending (a daemon's stdout and stderr): as
/// the files replaced here, never through a symlink, and never a node, FIFO or directory
/// that is there (refused, left as it is).
pub fn create_log(path: &Path) -> Result<std::fs::File, WriteError> {
    let file = open_log(path)?;
    one_link(&file, "not emptied").map_err(|source| WriteError { path: path.to_owned(), source })?;
    file.set_len(0).map_err(|source| WriteError { path: path.to_owned(), source })?;
    Ok(file)
}

/// Refuses a file with another name than ours: emptying it or writing to it would empty or
/// write the file a hard link planted in the log's place names (found from outside: a trim
/// emptied it; a node daemon's start appended its lines to it). `left`: what was not done.
fn one_link(file: &std::fs::File, left: &str) -> io::Result<()> {
    let links = file.metadata()?.nlink();
    if links != 1 {
        return Err(io::Error::other(format!("has {links} names (a hard link); refused ({left})")));
    }
    Ok(())
}

/// Opens the log file `path` for appending, as [`create_log`] does, keeping what it holds: a
/// log that every start of a daemon opens (the node daemon's, which each wrapper that finds
/// none answering starts), so that one start never empties the lines of the one before, nor
/// of one racing it. Once over `keep` bytes, its lines are moved to `<path>.1` (replacing an
/// older one; a daemon still writing there goes on) and a new file is begun: it never grows
/// past about `keep` and one daemon's life ([`trim_log`] keeps a running daemon's). Where the
/// move fails, the log is appended to as it is: never emptied (found from outside: a
/// directory at `<path>.1` had the next start empty the log).
pub fn append_log(path: &Path, keep: u64) -> Result<std::fs::File, WriteError> {
    let file = open_log(path)?;
    one_link(&file, "not appended to").map_err(|source| WriteError { path: path.to_owned(), source })?;
    if file.metadata().map_err(|source| WriteError { path: path.to_owned(), source })?.len() <= keep {
        return Ok(file);
    }
    let mut older = path.as_os_str().to_owned();
    older.push(".1");
    // A rename moves the name alone: whatever was put at either since is not followed.
    match std::fs::rename(path, &older) {
        Ok(()) => open_log(path),
        Err(_) => Ok(file),
    }
}

/// Keeps the log at `path`, which running daemons append to, at about `keep` bytes: once over
/// it, its last `keep` bytes (from the first whole line) replace `<path>.1`, and the log is
/// emptied in place (its writers append, so they go on at its new end; a line written between
/// the copy and the emptying is lost). A log of a container that lives for months, reloaded
/// every minute, grew without bound on `/run`, which is memory (found from outside: about 108
/// bytes a reload). Returns whether it was trimmed; a log that is missing is not.
pub fn trim_log(path: &Path, keep: u64) -> Result<bool, WriteError> {
    use std::io::{Read, Seek, SeekFrom};
    let at = |source| WriteError { path: path.to_owned(), source };
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(false);
    }
    let mut file = open_log_to(path, true)?;
    one_link(&file, "not emptied").map_err(at)?;
    let len = file.metadata().map_err(at)?.len();
    if len <= keep {
        return Ok(false);
    }
    let mut tail = Vec::new();
    file.seek(SeekFrom::Start(len - keep)).map_err(at)?;
    (&mut file).take(keep).read_to_end(&mut tail).map_err(at)?;
    let whole = tail.iter().position(|&b| b == b'\n').map_or(0, |i| i + 1);
    let mut older = path.as_os_str().to_owned();
    older.push(".1");
    replace_runtime_file(Path::new(&older), &tail[whole..])?;
    file.set_len(0).map_err(at)?;
    Ok(true)
}

/// `path` opened for appending, created if missing, refused unless a regular file of ours.
fn open_log(path: &Path) -> Result<std::fs::File, WriteError> {
    open_log_to(path, false)
}

/// [`open_log`], also for reading with `read`.
fn open_log_to(path: &Path, read: bool) -> Result<std::fs::File, WriteError> {
    let at = |source| WriteError { path: path.to_owned(), source };
    check_destination(path).map_err(at)?;
    // O_NONBLOCK: a FIFO put there since is not waited on (ENXIO without a reader).
    let file = std::fs::File::options()
        .read(read)
        .append(true)
        .create(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .mode(NEW_FILE_MODE)
        .open(path)
        .map_err(at)?;
    check_mode(file.metadata().map_err(at)?.mode()).map_err(at)?;
    Ok(file)
}

/// The directory `path`'s file is in (`.` for a bare name).
fn dir_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The start of the temporary names process `pid` gives its replacements of file `name`.
fn temporary_prefix(name: &std::ffi::OsStr, pid: u32) -> String {
    format!(".{}.{pid}.", name.to_string_lossy())
}

/// Removes what writer `pid`, killed between its temporary file and the rename, left of a
/// replacement of `path`: regular files beside it named `.<name>.<pid>.<random>.tmp` and owned
/// by us (the writer ran as we do). For a writer's parent, between its exit and its reaping,
/// while no other process can have its pid; a file another user made under such a name, a
/// symlink or a directory is left alone.
pub fn remove_left_temporaries(path: &Path, pid: u32) {
    let Some(name) = path.file_name() else { return };
    let prefix = temporary_prefix(name, pid);
    let Ok(entries) = std::fs::read_dir(dir_of(path)) else { return };
    let me = nix::unistd::geteuid().as_raw();
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        if !(file_name.starts_with(&prefix) && file_name.ends_with(".tmp")) {
            continue;
        }
        // DirEntry::metadata never follows a symlink.
        if entry.metadata().is_ok_and(|m| m.file_type().is_file() && m.uid() == me) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bug (noticed in stop 45, left then): each wrapper that started a node daemon emptied
    /// `node.log`, so a daemon's start lost the lines of the one before it (one that idled out,
    /// or one racing it for the state dir). The log is appended to, and moved to `node.log.1`
    /// once over its size; a symlink there is refused as before.
    #[test]
    fn a_shared_log_is_appended_to_and_moved_aside_once_large() {
        use std::io::Write;
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("node.log");
        writeln!(append_log(&path, 100).unwrap(), "first start").unwrap();
        writeln!(append_log(&path, 100).unwrap(), "second start").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "first start\nsecond start\n");
        std::fs::write(&path, "x".repeat(101)).unwrap();
        writeln!(append_log(&path, 100).unwrap(), "third start").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "third start\n");
        assert_eq!(std::fs::read_to_string(dir.path().join("node.log.1")).unwrap(), "x".repeat(101));
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("node.log.1"), &path).unwrap();
        assert!(append_log(&path, 100).is_err(), "a symlink is refused");
        assert_eq!(std::fs::read_to_string(dir.path().join("node.log.1")).unwrap(), "x".repeat(101));
    }

    /// Bug (found from outside): a hard link planted as `node.log` was appended to (the file it
    /// names got the node daemon's lines), and a directory at `node.log.1` (a container of that
    /// id) had the next start empty the log, its move aside failing. The hard link is refused,
    /// the file it names left whole; a log that cannot be moved aside is appended to.
    #[test]
    fn a_shared_log_is_never_written_through_a_hard_link_nor_emptied() {
        use std::io::Write;
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("node.log");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "theirs\n").unwrap();
        std::fs::hard_link(&victim, &path).unwrap();
        let e = append_log(&path, 100).unwrap_err().to_string();
        assert!(e.contains("has 2 names (a hard link); refused (not appended to)"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "theirs\n");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(dir.path().join("node.log.1")).unwrap();
        std::fs::write(&path, "x".repeat(101)).unwrap();
        writeln!(append_log(&path, 100).unwrap(), "next start").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}next start\n", "x".repeat(101)));
    }

    /// Bug (found from outside): a container's log grew without bound on `/run` (about 108
    /// bytes a reload). Trimmed, its last whole lines go to `<log>.1` and it is emptied in
    /// place: a writer that holds it open (appending) goes on at its start; one under the
    /// size, or missing, is left alone; a symlink is refused, and so is a hard link planted in
    /// its place (found from outside: the file it named was emptied).
    #[test]
    fn a_log_over_its_size_is_trimmed_in_place() {
        use std::io::Write;
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("devremapd.log");
        assert!(!trim_log(&path, 20).unwrap(), "missing");
        let mut writer = append_log(&path, u64::MAX).unwrap();
        writer.write_all(b"line one\nline two\n").unwrap();
        assert!(!trim_log(&path, 20).unwrap(), "under the size");
        writer.write_all(b"line three\n").unwrap();
        assert!(trim_log(&path, 20).unwrap());
        assert_eq!(std::fs::read_to_string(dir.path().join("devremapd.log.1")).unwrap(), "line three\n");
        writer.write_all(b"line four\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "line four\n");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("devremapd.log.1"), &path).unwrap();
        assert!(trim_log(&path, 0).is_err(), "a symlink is refused");
        // A hard link to another file: refused, that file left whole.
        std::fs::remove_file(&path).unwrap();
        let other = dir.path().join("other");
        std::fs::write(&other, "x".repeat(100)).unwrap();
        std::fs::hard_link(&other, &path).unwrap();
        let e = trim_log(&path, 10).unwrap_err().to_string();
        assert!(e.contains("has 2 names (a hard link); refused"), "{e}");
        assert!(create_log(&path).is_err());
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "x".repeat(100));
    }

    /// Bug (attack A2 on issue 29.4): `record --output dir/out/` wrote a regular file `dir/out`
    /// (`Path::file_name` drops the slash): a path ending in `/` names a directory, refused.
    #[test]
    fn a_path_ending_in_a_slash_is_refused() {
        let dir = tempfile::TempDir::new().unwrap();
        let path = PathBuf::from(format!("{}/out/", dir.path().display()));
        let refused = replace_file(&path, b"new").unwrap_err().to_string();
        assert_eq!(
            refused,
            format!(
                "{}: is a directory's name (it ends with /), not a regular file; refused: devremap replaces its output files",
                path.display()
            )
        );
        assert!(check_destination(&path).is_err_and(|e| is_refusal(&e)));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
    }

    /// Rule (issue 29.4): a symlink, FIFO or directory at the path is refused, named as what it
    /// is, and left as it was (never written through, never replaced), with no temporary file
    /// left; a regular file is replaced and keeps its mode.
    #[test]
    fn refuses_what_is_not_a_regular_file_and_keeps_the_mode() {
        let dir = tempfile::TempDir::new().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, "precious").unwrap();
        let path = dir.path().join("out.json");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let refused = replace_file(&path, b"new").unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "{}: is a symlink, not a regular file; refused: devremap replaces its output files",
                path.display()
            )
        );
        assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_symlink(), "the symlink is kept");
        assert!(check_destination(&path).is_err_and(|e| is_refusal(&e)));
        std::fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(write_atomic(&path, b"new").unwrap_err().to_string().starts_with("is a FIFO, not a regular file"));
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(write_atomic(&path, b"new").unwrap_err().to_string().starts_with("is a directory"));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "no temporary file left");
        std::fs::remove_dir(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file() && meta.mode() & 0o7777 == NEW_FILE_MODE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let written = write_atomic(&path, b"newer").unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o7777, 0o600);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "no temporary file left");
        written.remove_if_ours();
        assert!(!path.exists());
        write_atomic(&path, b"old").unwrap();
        write_atomic_as(&path, b"back", Some(Access { mode: 0o640, uid: 0, gid: 0 })).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o7777, 0o640, "the given mode, not the old one");
    }

    /// Rule: what a writer killed before its rename left is named by its pid (attack finding: a
    /// server killed there left `.state.json.<random>.tmp` for good), and
    /// [`remove_left_temporaries`] removes exactly those of that pid: not another pid's (a live
    /// writer's), not another file's, not a symlink, not a file another user made under such a
    /// name (an earlier fix matched by inode, which the filesystem reuses: it removed both).
    #[test]
    fn what_a_killed_writer_left_is_removed_and_nothing_else() {
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("state.json");
        let me = std::process::id();
        write_atomic_told(&path, b"{}", None, Lasting::UntilReboot, |_| {
            let names: Vec<String> = std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .map(|e| e.file_name().into_string().unwrap())
                .collect();
            assert!(names.len() == 1 && names[0].starts_with(&format!(".state.json.{me}.")), "{names:?}");
        })
        .unwrap();
        let at = |name: &str| dir.path().join(name);
        let (left, live, other) =
            (at(".state.json.4242.aB3dE9.tmp"), at(".state.json.4243.aB3dE9.tmp"), at(".other.json.4242.x.tmp"));
        for f in [&left, &live, &other] {
            std::fs::write(f, "").unwrap();
        }
        let link = at(".state.json.4242.link.tmp");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let theirs = at(".state.json.4242.theirs.tmp");
        std::fs::write(&theirs, "").unwrap();
        let root = nix::unistd::geteuid().is_root();
        if root {
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        }
        remove_left_temporaries(&path, 4242);
        assert!(!left.exists(), "the killed writer's: removed");
        assert!(live.exists() && other.exists() && path.exists(), "another pid's, another file's, the file: kept");
        assert!(link.symlink_metadata().is_ok(), "a symlink: kept");
        assert_eq!(theirs.exists(), root, "another user's: kept (made only as root)");
    }
}
