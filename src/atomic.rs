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

use crate::device::Access;
use std::io::{self, Write};
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

    /// Removes the file if the path still names the inode written here: a file that another
    /// process (another daemon given the same path) wrote since is left alone.
    pub fn remove_if_ours(&self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino) {
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

/// A file [`replace_file`] could not write.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot write: {}", path.display(), crate::io_message(source))]
pub struct WriteError {
    pub path: PathBuf,
    pub source: io::Error,
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
    let dir = dir_of(path);
    let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    // The file being replaced, never a symlink's target: a planted symlink is replaced too.
    let old = std::fs::symlink_metadata(path).ok().filter(|m| m.file_type().is_file());
    // O_CREAT|O_EXCL (`create_new`) never follows a symlink, not even a dangling one. Opened
    // here rather than by `tempfile_in`, whose errors carry the path in their text.
    let mut tmp = tempfile::Builder::new()
        .prefix(&temporary_prefix(name, std::process::id()))
        .suffix(".tmp")
        .make_in(dir, |path| std::fs::File::options().write(true).create_new(true).mode(0o600).open(path))?;
    // From here on, dropping `tmp` (any `?` below) removes the temporary file.
    let file = tmp.as_file_mut();
    let access = access.or_else(|| old.as_ref().map(|m| Access { mode: m.mode(), uid: m.uid(), gid: m.gid() }));
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
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(written)
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

    /// Rule: a write replaces a symlink planted at the path instead of writing through it, a
    /// replaced file keeps its mode, and no temporary file is left.
    #[test]
    fn never_follows_symlinks_and_keeps_the_mode() {
        let dir = tempfile::TempDir::new().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, "precious").unwrap();
        let path = dir.path().join("out.json");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
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
