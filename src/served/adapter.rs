//! The server's answers: a FUSE request's bytes in, its reply's bytes out, from a [`Devfs`].
//! Every decision about names and nodes is made in [`crate::served::devfs`]; this file only
//! translates (with [`crate::fuse`]'s codec), refuses every change, and reports retired nodes
//! let go. It reads no socket: the session that reads the requests and writes the answers is
//! the server's (`mountd/session.rs`), so one thread can answer many connections.
//!
//! It answers as fuser 0.18's session did with the adapter it replaced, byte for byte where the
//! kernel or the keeper compares: the INIT reply (a keeper compares its replacement server's
//! with its first server's, and an upgrade from a fuser build replaces one), the entries,
//! attributes and listings. Operations it does not serve answer ENOSYS, as fuser's defaults.
//!
//! No `access` handler: under `default_permissions` the kernel checks permissions itself and
//! never sends one.
//!
//! Refusals: setattr answers EPERM, so that runtimes which chown their std streams carry on
//! (crun 1.8 aborts on anything but EPERM or EINVAL); every other change answers EROFS.
//!
//! Assumptions: the kernel speaks FUSE 7.12 or later (the layouts of [`crate::fuse::abi`]).

use crate::decision::tree::NodeKind;
use crate::device::DevKind;
use crate::fuse::abi::{self, FuseAttr, FuseDirent, FuseEntryOut, InitIn, InitOut, ReadIn};
use crate::fuse::{Dirents, Request, WireError, error_reply, reply};
use crate::served::devfs::{Devfs, Entry, Miss};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use thiserror::Error;
use zerocopy::{FromZeros, IntoBytes};

/// The FUSE version this server speaks: fuser 0.18's, so that the INIT reply is the one a
/// server of an earlier build gave (the keeper compares them).
const MAJOR: u32 = 7;
const MINOR: u32 = 40;
/// The oldest kernel protocol answered.
const OLDEST_MINOR: u32 = 12;
/// fuser's INIT settings: 16 MiB writes (there are none here), 16 background requests.
const MAX_WRITE: u32 = 16 * 1024 * 1024;
const MAX_BACKGROUND: u16 = 16;
const CONGESTION_THRESHOLD: u16 = MAX_BACKGROUND * 3 / 4;

/// `FUSE_*` INIT flags (`include/uapi/linux/fuse.h`); bits 32 and up travel in `flags2`.
mod flag {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const ABORT_ERROR: u64 = 1 << 21;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const NO_OPENDIR_SUPPORT: u64 = 1 << 24;
    pub const INIT_EXT: u64 = 1 << 30;
}

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
    /// Every lookup of a name that begins with the hook's takes [`SLOW_LOOKUP`]: a server
    /// slower than its requests come, so that one is always waiting.
    Slow,
}

/// How long a lookup [`LookupFault::Slow`] names takes.
#[cfg(feature = "test-hooks")]
pub const SLOW_LOOKUP: std::time::Duration = std::time::Duration::from_millis(5);

/// What the first messages of a session come to ([`Adapter::handshake`]).
#[derive(Debug)]
pub enum Handshake {
    /// INIT agreed: send the reply, then serve.
    Agreed(Vec<u8>),
    /// The kernel speaks a newer major version: send the reply (ours), and the kernel sends
    /// INIT again.
    Again(Vec<u8>),
    /// No session: send the reply (an error) if there is one, and end.
    Refused(Option<Vec<u8>>, HandshakeError),
}

#[derive(Debug, Error)]
pub enum HandshakeError {
    #[error("the first FUSE request is opcode {0}, not INIT")]
    NotInit(u32),
    #[error("the kernel speaks FUSE {0}.{1}, older than 7.{OLDEST_MINOR}, the oldest this server answers")]
    TooOld(u32, u32),
    #[error("the FUSE INIT does not read: {0}")]
    Wire(#[from] WireError),
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
    /// `lookup-stall:NAME` (and every lookup of a name beginning with NAME take a while, from
    /// `lookup-slow:NAME`). Only in a build with the `test-hooks` feature.
    #[cfg(feature = "test-hooks")]
    pub fn fault_on_lookup(mut self, fault: Option<(LookupFault, String)>) -> Adapter {
        self.lookup_fault = fault;
        self
    }

    /// Answers a session's first message, the kernel's INIT (or the keeper's replay of it):
    /// each capability below where the kernel offers it, and fuser's settings. Listings and
    /// symlink targets cached by the kernel, parallel lookups in one directory, readdirplus;
    /// without them, plain requests serve. `FUSE_ABORT_ERROR` makes an aborted connection end
    /// the session with ECONNABORTED rather than the ENODEV of an unmount, so the daemon can
    /// tell the two apart. `page_size` sets `max_pages`, as fuser did.
    pub fn handshake(&mut self, msg: &[u8], page_size: u32) -> Handshake {
        let req = match Request::parse(msg) {
            Ok(req) => req,
            Err(e) => return Handshake::Refused(Request::unique_of(msg).map(|u| error_reply(u, libc::EIO)), e.into()),
        };
        let refused = |errno, e| Handshake::Refused(Some(error_reply(req.unique, errno)), e);
        if req.opcode != abi::INIT {
            return refused(libc::EIO, HandshakeError::NotInit(req.opcode));
        }
        let Some((init, rest)) = abi::read::<InitIn>(req.body) else {
            return refused(libc::EIO, WireError::Truncated { what: "init" }.into());
        };
        if init.major > MAJOR {
            let ours = InitOut { major: MAJOR, minor: MINOR, ..InitOut::new_zeroed() };
            return Handshake::Again(reply(req.unique, &[ours.as_bytes()]));
        }
        if init.major < MAJOR || init.minor < OLDEST_MINOR {
            return refused(libc::EPROTO, HandshakeError::TooOld(init.major, init.minor));
        }
        let mut offered = u64::from(init.flags);
        if offered & flag::INIT_EXT != 0
            && let Some((flags2, _)) = abi::read::<u32>(rest)
        {
            offered |= u64::from(flags2) << 32;
        }
        let mut requested = flag::ASYNC_READ | flag::BIG_WRITES | (offered & flag::MAX_PAGES);
        for wanted in [
            flag::ABORT_ERROR,
            flag::NO_OPENDIR_SUPPORT,
            flag::CACHE_SYMLINKS,
            flag::PARALLEL_DIROPS,
            flag::DO_READDIRPLUS | flag::READDIRPLUS_AUTO,
        ] {
            if offered & wanted == wanted {
                requested |= wanted;
            }
        }
        self.no_opendir = requested & flag::NO_OPENDIR_SUPPORT != 0 && !self.ttl.is_zero();
        let agreed = (requested | flag::INIT_EXT) & offered;
        let max_pages = ((MAX_WRITE.max(init.max_readahead) - 1) / page_size.max(1) + 1) as u16;
        let out = init_out(init.max_readahead, agreed, max_pages);
        let out = out.as_bytes();
        let out = if init.minor < 23 { &out[..abi::INIT_OUT_COMPAT_22] } else { out };
        Handshake::Agreed(reply(req.unique, &[out]))
    }

    /// The reply to one request after the handshake, `None` for those that get none (FORGET,
    /// BATCH_FORGET, NOTIFY_REPLY). A request that does not read answers EIO; a handler that
    /// panics answers EIO and is logged, and serving goes on.
    pub fn answer(&self, msg: &[u8]) -> Option<Vec<u8>> {
        let req = match Request::parse(msg) {
            Ok(req) => req,
            Err(e) => {
                log::warn!("a FUSE request that does not read ({e}): answered EIO");
                return Request::unique_of(msg).map(|u| error_reply(u, libc::EIO));
            }
        };
        log::debug!("FUSE {} (opcode {}) unique {} node {}", abi::name(req.opcode), req.opcode, req.unique, req.nodeid);
        ANSWERING.set(true);
        let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.dispatch(&req)));
        ANSWERING.set(false);
        match answered {
            Ok(answer) => answer.map(|r| r.unwrap_or_else(|errno| error_reply(req.unique, errno))),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                log::error!("{}: handler panicked ({what}); answered EIO and serving on", abi::name(req.opcode));
                (!req.unanswered()).then(|| error_reply(req.unique, libc::EIO))
            }
        }
    }

    /// One request's answer: the reply, or the errno to answer; `None` for no reply.
    fn dispatch(&self, req: &Request<'_>) -> Option<Result<Vec<u8>, i32>> {
        use abi::*;
        let u = req.unique;
        let truncated = |what| Err(libc::EIO).inspect_err(|_| log::warn!("a FUSE {what} request is truncated"));
        Some(match req.opcode {
            LOOKUP => self.lookup(u, req.nodeid, req.name()),
            FORGET | BATCH_FORGET => {
                match req.forgets() {
                    Ok(forgets) => forgets.into_iter().for_each(|(ino, n)| self.forgot(ino, n)),
                    Err(e) => log::warn!("{e}: nothing let go"),
                }
                return None;
            }
            // A reply to a retrieve, which is never asked for, gets none.
            NOTIFY_REPLY => return None,
            GETATTR => match self.fs.entry(req.nodeid) {
                Some(e) => {
                    let (secs, nanos) = (self.ttl.as_secs(), self.ttl.subsec_nanos());
                    let out = AttrOut { attr_valid: secs, attr_valid_nsec: nanos, dummy: 0, attr: attr(&e) };
                    Ok(reply(u, &[out.as_bytes()]))
                }
                None => Err(libc::ENOENT),
            },
            SETATTR => Err(libc::EPERM),
            READLINK => match self.fs.entry(req.nodeid).as_deref().map(|e| &e.node.kind) {
                Some(NodeKind::Symlink(target)) => Ok(reply(u, &[target.as_bytes()])),
                Some(_) => Err(libc::EINVAL),
                None => Err(libc::ENOENT),
            },
            SYMLINK | MKNOD | MKDIR | UNLINK | RMDIR | RENAME | RENAME2 | LINK | CREATE | TMPFILE | SETXATTR
            | REMOVEXATTR => Err(libc::EROFS),
            OPENDIR if self.no_opendir => Err(libc::ENOSYS),
            OPENDIR => match self.fs.entry(req.nodeid).as_deref().map(|e| &e.node.kind) {
                Some(NodeKind::Dir) => Ok(reply(u, &[OpenOut { fh: 0, open_flags: 0, backing_id: 0 }.as_bytes()])),
                Some(_) => Err(libc::ENOTDIR),
                None => Err(libc::ENOENT),
            },
            // fuser's defaults: an open (never sent for a node here) gets handle 0.
            OPEN => Ok(reply(u, &[OpenOut { fh: 0, open_flags: 0, backing_id: 0 }.as_bytes()])),
            RELEASE | RELEASEDIR | DESTROY => Ok(reply(u, &[])),
            READDIR | READDIRPLUS => match read::<ReadIn>(req.body) {
                Some((read_in, _)) => self.list(u, req.nodeid, &read_in, req.opcode == READDIRPLUS),
                None => truncated("readdir"),
            },
            STATFS => {
                let files = self.fs.snapshot().tree.len() as u64;
                let out = StatfsOut {
                    blocks: 0,
                    bfree: 0,
                    bavail: 0,
                    files,
                    ffree: 0,
                    bsize: 4096,
                    namelen: 255,
                    frsize: 4096,
                    padding: 0,
                    spare: [0; 6],
                };
                Ok(reply(u, &[out.as_bytes()]))
            }
            INIT => Err(libc::EIO).inspect_err(|_| log::warn!("a FUSE INIT after the handshake: answered EIO")),
            // No xattrs here, ever: ENOSYS once makes the kernel stop asking. INTERRUPT,
            // STATX and everything else: as fuser's defaults.
            _ => Err(libc::ENOSYS),
        })
    }

    fn lookup(&self, unique: u64, parent: u64, name: &[u8]) -> Result<Vec<u8>, i32> {
        let name = OsStr::from_bytes(name);
        #[cfg(feature = "test-hooks")]
        match &self.lookup_fault {
            Some((LookupFault::Panic, n)) if name == OsStr::new(n) => panic!("fault injected on lookup of {name:?}"),
            Some((LookupFault::Stall, n)) if name == OsStr::new(n) => loop {
                std::thread::park();
            },
            Some((LookupFault::Slow, n)) if name.as_bytes().starts_with(n.as_bytes()) => {
                std::thread::sleep(SLOW_LOOKUP);
            }
            _ => {}
        }
        match self.fs.lookup(parent, name) {
            Ok(entry) => Ok(reply(unique, &[self.entry_out(entry.ino, attr(&entry)).as_bytes()])),
            // A negative entry lets the kernel answer the next miss itself; a reload that adds
            // the name invalidates it. A missing name in a directory that exists: no second
            // look at the parent.
            Err(Miss::NotFound) if !self.ttl.is_zero() => {
                Ok(reply(unique, &[self.entry_out(0, negative()).as_bytes()]))
            }
            Err(e) => Err(errno(e)),
        }
    }

    /// A READDIR (`plus` false) or READDIRPLUS reply of the size the kernel asked for.
    fn list(&self, unique: u64, dir: u64, read_in: &ReadIn, plus: bool) -> Result<Vec<u8>, i32> {
        let mut out = Dirents::new(read_in.size as usize);
        self.fs
            .list(dir, read_in.offset, plus, |e, next, name| {
                let dirent = FuseDirent { ino: e.ino, off: next, namelen: name.len() as u32, typ: type_bits(e) >> 12 };
                let entry = plus.then(|| self.entry_out(e.ino, attr(e)));
                out.push(entry.as_ref(), &dirent, name.as_bytes())
            })
            .map_err(errno)?;
        Ok(reply(unique, &[out.body()]))
    }

    /// An entry the kernel keeps for the TTL: node `ino` (0: a negative entry) with `attr`.
    fn entry_out(&self, ino: u64, attr: FuseAttr) -> FuseEntryOut {
        let (secs, nanos) = (self.ttl.as_secs(), self.ttl.subsec_nanos());
        FuseEntryOut {
            nodeid: ino,
            generation: 0,
            entry_valid: secs,
            attr_valid: secs,
            entry_valid_nsec: nanos,
            attr_valid_nsec: nanos,
            attr,
        }
    }

    fn forgot(&self, ino: u64, n: u64) {
        if self.fs.forget(ino, n)
            && let Some(f) = &self.on_retired
        {
            f();
        }
    }
}

thread_local! {
    static ANSWERING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is answering a request: a panic hook leaves a handler's panic to the
/// one line [`Adapter::answer`] logs.
pub fn answering() -> bool {
    ANSWERING.get()
}

/// `fuse_init_out` with fuser's settings.
fn init_out(max_readahead: u32, flags: u64, max_pages: u16) -> InitOut {
    InitOut {
        major: MAJOR,
        minor: MINOR,
        max_readahead,
        flags: flags as u32,
        max_background: MAX_BACKGROUND,
        congestion_threshold: CONGESTION_THRESHOLD,
        max_write: MAX_WRITE,
        time_gran: 1,
        max_pages,
        unused2: 0,
        flags2: (flags >> 32) as u32,
        max_stack_depth: 0,
        reserved: [0; 6],
    }
}

/// A miss as the kernel's errno.
fn errno(miss: Miss) -> i32 {
    match miss {
        Miss::NotFound | Miss::NoNode => libc::ENOENT,
        Miss::NotDir => libc::ENOTDIR,
        Miss::NameTooLong => libc::ENAMETOOLONG,
    }
}

/// A node's type bits (`S_IF*`).
fn type_bits(e: &Entry) -> u32 {
    match &e.node.kind {
        NodeKind::Dir => libc::S_IFDIR,
        NodeKind::Symlink(_) => libc::S_IFLNK,
        NodeKind::Device(DevKind::Char, _) => libc::S_IFCHR,
        NodeKind::Device(DevKind::Block, _) => libc::S_IFBLK,
        NodeKind::Device(DevKind::Fifo, _) => libc::S_IFIFO,
    }
}

/// A time as FUSE carries it: seconds and nanoseconds since the epoch.
fn time(t: SystemTime) -> (u64, u32) {
    let since = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    (since.as_secs(), since.subsec_nanos())
}

/// A node's attributes as FUSE carries them: its mtime and ctime are when its node id was
/// made, rdev in FUSE's encoding, a symlink's size its target's length.
fn attr(e: &Entry) -> FuseAttr {
    let (size, rdev) = match &e.node.kind {
        NodeKind::Dir => (0, 0),
        NodeKind::Symlink(target) => (target.len() as u64, 0),
        NodeKind::Device(_, rdev) => (0, rdev.to_fuse()),
    };
    let (secs, nanos) = time(e.born);
    FuseAttr {
        ino: e.ino,
        size,
        blocks: 0,
        atime: secs,
        mtime: secs,
        ctime: secs,
        atimensec: nanos,
        mtimensec: nanos,
        ctimensec: nanos,
        // The permission bits as fuser took them (16 bits), with the node's type.
        mode: type_bits(e) | u32::from(e.node.access.mode as u16),
        nlink: e.nlink(),
        uid: e.node.access.uid,
        gid: e.node.access.gid,
        rdev,
        blksize: 4096,
        flags: 0,
    }
}

/// The attributes of "no such name", which the kernel caches as a negative entry.
fn negative() -> FuseAttr {
    FuseAttr { mode: libc::S_IFREG, ..FuseAttr::default() }
}

#[cfg(test)]
mod tests;
