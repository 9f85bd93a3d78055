//! The restore host's device directory and driver files, read safely for every device family:
//! [`DevDir`] lists and `lstat`s a device directory's entries through one open descriptor,
//! [`small_text`] reads a driver file. Which names a family takes, and what its files say, is
//! the family's ([`crate::family`]).
//!
//! This is an I/O edge. Assumptions: the device directory is read through one open descriptor,
//! so a scan sees one directory even while a symlink to it is flipped; entries are examined
//! with `lstat` and never followed, so a symlink under a GPU name is refused rather than
//! resolved; only char devices count. Driver files that are not small regular files are
//! skipped unread (one over 64 KiB, `INFO_LIMIT`, with a warning, since it is no file a
//! driver writes).

use crate::device::{Access, Rdev};
use crate::inputs::files::{self, SmallText};
use crate::inputs::limits;
use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, fstatat};
use std::io;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The driver's files are a few hundred bytes; a larger one is not theirs and is skipped.
const INFO_LIMIT: u64 = 64 << 10;

/// A device node found on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNode {
    /// Path relative to the device directory.
    pub rel_path: String,
    pub rdev: Rdev,
    pub access: Access,
}

/// The GPU nodes of a device directory, and the nodes beside them that pass through unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevDirScan {
    /// `(N, node)` for every `nvidiaN`, sorted by N.
    pub gpus: Vec<(u32, HostNode)>,
    /// `(N, node)` for every AMD `dri/renderDN`, sorted by N.
    pub amd: Vec<(u32, HostNode)>,
    pub passthrough: Vec<HostNode>,
    /// What the scan skipped and says so: a directory a family reads that is a symlink.
    pub warnings: Vec<String>,
}

/// Why the host's devices could not be read. Each names the file at fault.
#[derive(Debug, Error)]
pub enum HostError {
    #[error("{}: cannot read the directory: {}", .0.display(), crate::io_message(.1))]
    ReadDir(PathBuf, io::Error),
    #[error("{}: cannot stat: {}", .0.display(), crate::io_message(.1))]
    Stat(PathBuf, io::Error),
    #[error("{}: {}", .0.display(), .1)]
    BadName(PathBuf, String),
    #[error("{}: is {}, not a char device; refused", .0.display(), .1)]
    NotCharDevice(PathBuf, &'static str),
    /// More entries named with a family's prefix (`nvidia`) than a tree can hold.
    #[error("{}: holds more than {} entries named {}*", .0.display(), limits::MAX_NODES, .1)]
    TooManyNamed(PathBuf, String),
    /// More GPU and pass-through nodes, all families together, than a tree can hold.
    #[error("{}: holds more than {} GPU and pass-through nodes", .0.display(), limits::MAX_NODES)]
    TooMany(PathBuf),
}

/// An open directory of the device directory (itself or one under it), read through its one
/// descriptor.
pub struct DevDir {
    fd: Dir,
    /// The device directory, as the caller named it: messages name paths under it.
    top: PathBuf,
    /// This directory's path relative to `top` (`""` for the device directory itself).
    rel: String,
}

impl DevDir {
    /// Opens the device directory (following `dir` itself if it is a symlink: the caller named
    /// it).
    pub fn open(dir: &Path) -> Result<DevDir, HostError> {
        let fd = Dir::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| HostError::ReadDir(dir.to_owned(), e.into()))?;
        Ok(DevDir { fd, top: dir.to_owned(), rel: String::new() })
    }

    /// An entry's path relative to the device directory.
    pub fn rel_path(&self, name: &str) -> String {
        if self.rel.is_empty() { name.to_owned() } else { format!("{}/{name}", self.rel) }
    }

    /// An entry's path as messages name it.
    pub fn path(&self, name: &str) -> PathBuf {
        self.top.join(self.rel_path(name))
    }

    /// The UTF-8 names of the entries starting with `prefix`, at most one more than
    /// [`limits::MAX_NODES`] of them.
    pub fn names(&mut self, prefix: &str) -> Result<Vec<String>, HostError> {
        let here = if self.rel.is_empty() { self.top.clone() } else { self.top.join(&self.rel) };
        let mut names = Vec::new();
        for entry in self.fd.iter() {
            let entry = entry.map_err(|e| HostError::ReadDir(here.clone(), e.into()))?;
            if let Some(name) = entry.file_name().to_str().ok().filter(|n| n.starts_with(prefix)) {
                names.push(name.to_owned());
                if names.len() > limits::MAX_NODES {
                    return Err(HostError::TooManyNamed(here, prefix.to_owned()));
                }
            }
        }
        Ok(names)
    }

    /// `lstat`s entry `name` and takes it only if it is a char device, served as its path
    /// relative to the device directory.
    pub fn char_node(&self, name: &str) -> Result<HostNode, HostError> {
        let st = fstatat(&self.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| HostError::Stat(self.path(name), e.into()))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFCHR {
            return Err(HostError::NotCharDevice(self.path(name), files::describe(st.st_mode)));
        }
        Ok(HostNode {
            rel_path: self.rel_path(name),
            rdev: Rdev::from_raw(st.st_rdev),
            access: Access { mode: st.st_mode & 0o7777, uid: st.st_uid, gid: st.st_gid },
        })
    }

    /// The directory `name` under this one, opened through this one's descriptor without
    /// following a symlink; `None` when there is none, or it is not a directory. A symlink is
    /// never followed, and skipping it is said in `warnings`, naming it: the nodes it leads to
    /// are not served.
    pub fn subdir(&self, name: &str, warnings: &mut Vec<String>) -> Result<Option<DevDir>, HostError> {
        let no_follow = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match Dir::openat(&self.fd, name, no_follow, Mode::empty()) {
            Ok(fd) => Ok(Some(DevDir { fd, top: self.top.clone(), rel: self.rel_path(name) })),
            Err(Errno::ENOENT) => Ok(None),
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                let st = fstatat(&self.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .map_err(|e| HostError::Stat(self.path(name), e.into()))?;
                if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                    warnings.push(format!(
                        "{}: is a symlink, which is not followed; the nodes under it are not served",
                        self.path(name).display()
                    ));
                }
                Ok(None)
            }
            Err(e) => Err(HostError::ReadDir(self.path(name), e.into())),
        }
    }
}

/// A driver file's text, if it is a small regular file; a larger one is skipped with a warning.
pub fn small_text(path: &Path, warnings: &mut Vec<String>) -> Option<String> {
    match files::read_small_text(path, INFO_LIMIT) {
        SmallText::Text(text) => Some(text),
        SmallText::TooLarge => {
            warnings.push(format!(
                "{}: larger than {} KiB, not a driver file; skipped",
                path.display(),
                INFO_LIMIT >> 10
            ));
            None
        }
        SmallText::Unreadable => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limit (security.md): a device directory with more entries under a family's prefix than
    /// a tree can hold is refused, naming the prefix counted, not a family.
    #[test]
    fn too_many_entries_under_a_prefix_are_refused_by_prefix() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..=limits::MAX_NODES {
            std::fs::File::create(dir.path().join(format!("amdgpu{i}"))).unwrap();
        }
        let mut top = DevDir::open(dir.path()).unwrap();
        assert!(top.names("nvidia").unwrap().is_empty());
        let e = top.names("amdgpu").unwrap_err();
        assert_eq!(e.to_string(), format!("{}: holds more than 16384 entries named amdgpu*", dir.path().display()));
    }
}
