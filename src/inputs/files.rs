//! Opening input files without being tricked: every input is meant to be a small regular file.
//!
//! A path is checked with `stat` before it is opened, so a device is never opened (opening
//! some, like a watchdog, acts); it is opened non-blocking, so a FIFO swapped in between cannot
//! hang the daemon; and the opened file must be the one that was checked. Reads are bounded.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Why an input file could not be read.
#[derive(Debug)]
pub enum FileError {
    Io(io::Error),
    /// Not a regular file: what it is instead.
    NotRegular(&'static str),
}

/// What went wrong, for a message that names the file first (`<path>: <this>`).
impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::Io(e) => f.write_str(&crate::io_message(e)),
            FileError::NotRegular(what) => write!(f, "is {what}; expected a regular file"),
        }
    }
}

/// Whether `path` is the root of a mount (`STATX_ATTR_MOUNT_ROOT`, Linux 5.8+), asking no
/// daemon (`AT_STATX_DONT_SYNC`: a FUSE mount's cached attributes, so a stuck or dead one does
/// not hang us); `None` where the kernel does not say, or the call fails (a dead FUSE mount).
pub fn is_mount_root(path: &Path) -> Option<bool> {
    is_mount_root_at(rustix::fs::CWD, path)
}

/// [`is_mount_root`] of `path` in directory `dir` (not followed).
pub fn is_mount_root_at(dir: std::os::fd::BorrowedFd, path: &Path) -> Option<bool> {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags, statx};
    let st = statx(dir, path, AtFlags::SYMLINK_NOFOLLOW | AtFlags::STATX_DONT_SYNC, StatxFlags::empty()).ok()?;
    let root = StatxAttributes::MOUNT_ROOT;
    st.stx_attributes_mask.contains(root).then(|| st.stx_attributes.contains(root))
}

/// What a file of mode `mode` (`st_mode`) is, with its article, for messages: `a FIFO`,
/// `a symlink`, ...
pub fn describe(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symlink",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFCHR => "a char device",
        libc::S_IFBLK => "a block device",
        libc::S_IFSOCK => "a socket",
        _ => "a special file",
    }
}

/// Opens `path` for reading if it is a regular file (symlinks followed).
pub fn open_regular(path: &Path) -> Result<File, FileError> {
    open_regular_at(path, true)
}

/// Opens `path` for reading if it is a regular file and not a symlink: a file of our own (a
/// container's state file or log in the state dir), where a symlink, a FIFO or a device was
/// planted in its place by someone else, never followed, opened or read without end.
pub fn open_own_regular(path: &Path) -> Result<File, FileError> {
    open_regular_at(path, false)
}

fn open_regular_at(path: &Path, follow: bool) -> Result<File, FileError> {
    let before = if follow { std::fs::metadata(path) } else { std::fs::symlink_metadata(path) };
    let before = before.map_err(FileError::Io)?;
    if !before.is_file() {
        return Err(FileError::NotRegular(describe(before.mode())));
    }
    let flags = libc::O_NONBLOCK | if follow { 0 } else { libc::O_NOFOLLOW };
    let file = OpenOptions::new().read(true).custom_flags(flags).open(path).map_err(FileError::Io)?;
    let after = file.metadata().map_err(FileError::Io)?;
    if !after.is_file() {
        return Err(FileError::NotRegular(describe(after.mode())));
    }
    if (after.dev(), after.ino()) != (before.dev(), before.ino()) {
        return Err(FileError::Io(io::Error::other("replaced while being opened")));
    }
    Ok(file)
}

/// Appends at most `limit - buf.len()` more bytes of `file` to `buf`.
pub fn read_up_to(file: &mut File, limit: u64, buf: &mut Vec<u8>) -> io::Result<()> {
    let want = limit.saturating_sub(buf.len() as u64);
    // Room for what the file holds, at once: growing by doubling would take up to twice the
    // bytes read (a 16 MiB input in a 32 MiB buffer, and the copies on the way).
    let size = file.metadata()?.len();
    buf.reserve_exact(usize::try_from(want.min(size)).unwrap_or(0));
    file.take(want).read_to_end(buf).map(|_| ())
}

/// All of `file` if it holds at most `limit` bytes; `None` if it holds more. It is read up to
/// one byte past the limit to tell: procfs files report size 0, so a size cannot be trusted.
pub fn read_at_most(file: &mut File, limit: u64) -> io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    read_up_to(file, limit + 1, &mut buf)?;
    Ok((buf.len() as u64 <= limit).then_some(buf))
}

/// What [`read_small_text`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SmallText {
    Text(String),
    /// A regular file longer than the limit.
    TooLarge,
    /// Missing, not a regular file, unreadable, or not UTF-8.
    Unreadable,
}

/// A small regular file of at most `limit` bytes, as text.
pub fn read_small_text(path: &Path, limit: u64) -> SmallText {
    small_text(open_regular(path), limit)
}

/// [`read_small_text`] of a file of our own ([`open_own_regular`]: no symlink followed).
pub fn read_own_small_text(path: &Path, limit: u64) -> SmallText {
    small_text(open_own_regular(path), limit)
}

fn small_text(file: Result<File, FileError>, limit: u64) -> SmallText {
    let Ok(mut file) = file else { return SmallText::Unreadable };
    match read_at_most(&mut file, limit) {
        Ok(Some(buf)) => String::from_utf8(buf).map_or(SmallText::Unreadable, SmallText::Text),
        Ok(None) => SmallText::TooLarge,
        Err(_) => SmallText::Unreadable,
    }
}

/// The pid a pid file holds (a positive number, blanks around it allowed), once it holds a
/// whole one: what `devremapd` watches (the runtime's pid file) and the runtime wrapper stops
/// (the daemon's).
pub fn read_pid(path: &Path) -> Option<u32> {
    let SmallText::Text(text) = read_small_text(path, 64) else { return None };
    parse_pid(&text)
}

/// The pid in a pid file's `text`: decimal digits alone (runc, crun, conmon and devremapd write
/// nothing else; Rust's parse would also take `+5`), a positive number a pid can be (at most
/// `i32::MAX`: the kernel's `pid_t`), blanks around it allowed.
fn parse_pid(text: &str) -> Option<u32> {
    let digits = text.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<i32>().ok().filter(|&pid| pid > 0).map(i32::unsigned_abs)
}

#[cfg(test)]
mod tests {
    use super::parse_pid;

    /// Rule: a pid file counts only when it holds a pid as the runtimes write one: digits, a
    /// pid the kernel can have. Bug: `+5` was read as 5 (Rust's parse takes a sign).
    #[test]
    fn a_pid_is_digits_alone_and_within_pid_t() {
        for (text, pid) in [("5", Some(5)), ("  42\n", Some(42)), ("2147483647", Some(2_147_483_647))] {
            assert_eq!(parse_pid(text), pid, "{text:?}");
        }
        for text in ["", "\n", "+5", "-5", "0", "5 6", "0x10", "2147483648", "99999999999", "\u{0665}"] {
            assert_eq!(parse_pid(text), None, "{text:?}");
        }
    }
}
