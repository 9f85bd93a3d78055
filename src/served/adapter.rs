//! The `fuser::Filesystem` implementation: a thin adapter from requests to [`Devfs`] and back
//! to `Reply*`. Every decision about names and nodes is made in [`crate::served::devfs`]; this file
//! only translates, refuses every change, and reports retired nodes let go.
//!
//! No `access` handler: under `default_permissions` the kernel checks permissions itself and
//! never sends one.
//!
//! Refusals: setattr answers EPERM, so that runtimes which chown their std streams carry on
//! (crun 1.8 aborts on anything but EPERM or EINVAL); every other change answers EROFS.

use crate::decision::tree::NodeKind;
use crate::device::DevKind;
use crate::served::devfs::{Devfs, Entry, Miss};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, Request, TimeOrNow,
};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Serves a [`Devfs`] to the kernel.
pub struct Adapter {
    fs: Arc<Devfs>,
    ttl: Duration,
    /// The kernel agreed to go without opendir: answering ENOSYS once makes it stop sending
    /// opendir and releasedir and cache directory listings (`FOPEN_CACHE_DIR`).
    no_opendir: bool,
    /// Called whenever a retired node is let go, so the state file can be brought up to date.
    on_retired: Option<Box<dyn Fn() + Send + Sync>>,
    /// Fault injection for tests: a lookup of this name panics, or never returns.
    #[cfg(feature = "test-hooks")]
    lookup_fault: Option<(LookupFault, String)>,
}

impl std::fmt::Debug for Adapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapter").field("fs", &self.fs).field("ttl", &self.ttl).finish_non_exhaustive()
    }
}

/// What [`Adapter::fault_on_lookup`] does to a lookup of its name.
#[cfg(feature = "test-hooks")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupFault {
    Panic,
    Stall,
}

impl Adapter {
    pub fn new(fs: Arc<Devfs>, ttl: Duration, on_retired: Option<Box<dyn Fn() + Send + Sync>>) -> Adapter {
        Adapter {
            fs,
            ttl,
            no_opendir: false,
            on_retired,
            #[cfg(feature = "test-hooks")]
            lookup_fault: None,
        }
    }

    /// Makes every lookup of `name` panic (a panicking request cannot end the daemon) or never
    /// return (a server that leaves one request unanswered, holding the kernel's lock on the
    /// directory); the daemon sets it from `DEVREMAPD_FAILPOINT=lookup-panic:NAME` or
    /// `lookup-stall:NAME`. Only in a build with the `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    pub fn fault_on_lookup(mut self, fault: Option<(LookupFault, String)>) -> Adapter {
        self.lookup_fault = fault;
        self
    }

    fn forgot(&self, ino: u64, n: u64) {
        if self.fs.forget(ino, n)
            && let Some(f) = &self.on_retired
        {
            f();
        }
    }
}

/// Runs a request handler so that a panic in it answers EIO (the unsent reply is dropped,
/// and fuser answers a dropped reply with EIO) and is logged, instead of ending the thread
/// that serves the kernel.
fn guard(op: &str, f: impl FnOnce()) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        log::error!("{op}: handler panicked ({what}); answered EIO and serving on");
    }
}

/// A miss as the kernel's errno.
fn errno(miss: Miss) -> Errno {
    match miss {
        Miss::NotFound | Miss::NoNode => Errno::ENOENT,
        Miss::NotDir => Errno::ENOTDIR,
        Miss::NameTooLong => Errno::ENAMETOOLONG,
    }
}

/// A node's type as FUSE names it.
fn file_type(e: &Entry) -> FileType {
    match &e.node.kind {
        NodeKind::Dir => FileType::Directory,
        NodeKind::Symlink(_) => FileType::Symlink,
        NodeKind::Device(DevKind::Char, _) => FileType::CharDevice,
        NodeKind::Device(DevKind::Block, _) => FileType::BlockDevice,
        NodeKind::Device(DevKind::Fifo, _) => FileType::NamedPipe,
    }
}

/// A node's attributes as FUSE carries them: its mtime and ctime are when its node id was
/// made, rdev in FUSE's encoding, a symlink's size its target's length.
fn attr(e: &Entry) -> FileAttr {
    let (size, rdev) = match &e.node.kind {
        NodeKind::Dir => (0, 0),
        NodeKind::Symlink(target) => (target.len() as u64, 0),
        NodeKind::Device(_, rdev) => (0, rdev.to_fuse()),
    };
    FileAttr {
        ino: INodeNo(e.ino),
        size,
        blocks: 0,
        atime: e.born,
        mtime: e.born,
        ctime: e.born,
        crtime: e.born,
        kind: file_type(e),
        perm: e.node.access.mode as u16,
        nlink: e.nlink(),
        uid: e.node.access.uid,
        gid: e.node.access.gid,
        rdev,
        blksize: 4096,
        flags: 0,
    }
}

/// The attributes of "no such name", which the kernel caches as a negative entry.
fn negative() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

impl Filesystem for Adapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        use fuser::InitFlags as F;
        // Each where the kernel offers it: listings and symlink targets cached by the kernel,
        // parallel lookups in one directory, readdirplus. Without them, plain requests serve.
        // FUSE_ABORT_ERROR makes an aborted connection end the session with ECONNABORTED
        // rather than the ENODEV of an unmount, so the daemon can tell the two apart.
        for flag in [
            F::FUSE_ABORT_ERROR,
            F::FUSE_NO_OPENDIR_SUPPORT,
            F::FUSE_CACHE_SYMLINKS,
            F::FUSE_PARALLEL_DIROPS,
            F::FUSE_DO_READDIRPLUS | F::FUSE_READDIRPLUS_AUTO,
        ] {
            let granted = config.add_capabilities(flag).is_ok();
            if flag == F::FUSE_NO_OPENDIR_SUPPORT {
                self.no_opendir = granted && !self.ttl.is_zero();
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        guard("lookup", || {
            #[cfg(feature = "test-hooks")]
            match &self.lookup_fault {
                Some((LookupFault::Panic, n)) if name == OsStr::new(n) => {
                    panic!("fault injected on lookup of {name:?}")
                }
                Some((LookupFault::Stall, n)) if name == OsStr::new(n) => loop {
                    std::thread::park();
                },
                _ => {}
            }
            match self.fs.lookup(parent.0, name) {
                Ok(entry) => reply.entry(&self.ttl, &attr(&entry), Generation(0)),
                // A negative entry lets the kernel answer the next miss itself; a reload that
                // adds the name invalidates it.
                // A missing name in a directory that exists: no second look at the parent.
                Err(Miss::NotFound) if !self.ttl.is_zero() => reply.entry(&self.ttl, &negative(), Generation(0)),
                Err(e) => reply.error(errno(e)),
            }
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        guard("forget", || {
            self.forgot(ino.0, nlookup);
        });
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        guard("getattr", || match self.fs.entry(ino.0) {
            Some(e) => reply.attr(&self.ttl, &attr(&e)),
            None => reply.error(Errno::ENOENT),
        });
    }

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EPERM);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        guard("readlink", || {
            let result = self.fs.entry(ino.0).ok_or(Errno::ENOENT).and_then(|e| match &e.node.kind {
                crate::decision::tree::NodeKind::Symlink(target) => Ok(target.clone()),
                _ => Err(Errno::EINVAL),
            });
            match result {
                Ok(target) => reply.data(target.as_bytes()),
                Err(e) => reply.error(e),
            }
        });
    }

    fn mknod(&self, _req: &Request, _p: INodeNo, _n: &OsStr, _m: u32, _u: u32, _r: u32, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn mkdir(&self, _req: &Request, _p: INodeNo, _n: &OsStr, _m: u32, _u: u32, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _p: INodeNo, _n: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _p: INodeNo, _n: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(&self, _req: &Request, _p: INodeNo, _n: &OsStr, _t: &Path, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _p: INodeNo,
        _n: &OsStr,
        _np: INodeNo,
        _nn: &OsStr,
        _f: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(&self, _req: &Request, _i: INodeNo, _np: INodeNo, _nn: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::EROFS);
    }

    fn create(&self, _req: &Request, _p: INodeNo, _n: &OsStr, _m: u32, _u: u32, _f: i32, reply: ReplyCreate) {
        reply.error(Errno::EROFS);
    }

    fn getxattr(&self, _req: &Request, _i: INodeNo, _n: &OsStr, _s: u32, reply: fuser::ReplyXattr) {
        // ENOSYS once makes the kernel stop asking (no xattrs here, ever).
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _i: INodeNo, _s: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn setxattr(&self, _req: &Request, _i: INodeNo, _n: &OsStr, _v: &[u8], _f: i32, _p: u32, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn removexattr(&self, _req: &Request, _i: INodeNo, _n: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        guard("opendir", || {
            if self.no_opendir {
                return reply.error(Errno::ENOSYS);
            }
            match self.fs.entry(ino.0).map(|e| file_type(&e)) {
                Some(FileType::Directory) => reply.opened(FileHandle(0), FopenFlags::empty()),
                Some(_) => reply.error(Errno::ENOTDIR),
                None => reply.error(Errno::ENOENT),
            }
        });
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        guard("readdir", || {
            match self
                .fs
                .list(ino.0, offset, false, |e, next, name| reply.add(INodeNo(e.ino), next, file_type(e), name))
            {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(e)),
            }
        });
    }

    fn readdirplus(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        guard("readdirplus", || {
            let ttl = self.ttl;
            let listed = self.fs.list(ino.0, offset, true, |e, next, name| {
                reply.add(INodeNo(e.ino), next, name, &ttl, &attr(e), Generation(0))
            });
            match listed {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(e)),
            }
        });
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        guard("statfs", || {
            let files = self.fs.snapshot().tree.len() as u64;
            reply.statfs(0, 0, 0, files, 0, 4096, 255, 4096);
        });
    }
}
