//! The kernel's FUSE structs (`include/uapi/linux/fuse.h`) and opcodes, as `#[repr(C)]` structs
//! of the kernel's layout, read and written by copy (a message's fields need not be aligned in
//! its buffer); each size is checked against the kernel's at compile time.
//!
//! Assumptions: FUSE 7.12 or later (the attribute layout with `blksize`, `fuse_getattr_in`,
//! `fuse_read_in` with its lock owner), in native byte order.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

pub const LOOKUP: u32 = 1;
pub const FORGET: u32 = 2;
pub const GETATTR: u32 = 3;
pub const SETATTR: u32 = 4;
pub const READLINK: u32 = 5;
pub const SYMLINK: u32 = 6;
pub const MKNOD: u32 = 8;
pub const MKDIR: u32 = 9;
pub const UNLINK: u32 = 10;
pub const RMDIR: u32 = 11;
pub const RENAME: u32 = 12;
pub const LINK: u32 = 13;
pub const OPEN: u32 = 14;
pub const STATFS: u32 = 17;
pub const RELEASE: u32 = 18;
pub const SETXATTR: u32 = 21;
pub const GETXATTR: u32 = 22;
pub const LISTXATTR: u32 = 23;
pub const REMOVEXATTR: u32 = 24;
pub const INIT: u32 = 26;
pub const OPENDIR: u32 = 27;
pub const READDIR: u32 = 28;
pub const RELEASEDIR: u32 = 29;
pub const CREATE: u32 = 35;
pub const INTERRUPT: u32 = 36;
pub const DESTROY: u32 = 38;
pub const NOTIFY_REPLY: u32 = 41;
pub const BATCH_FORGET: u32 = 42;
pub const READDIRPLUS: u32 = 44;
pub const RENAME2: u32 = 45;
pub const TMPFILE: u32 = 51;

/// An opcode's name for log lines, as the kernel's header names it, lower case.
pub fn name(opcode: u32) -> &'static str {
    match opcode {
        LOOKUP => "lookup",
        FORGET => "forget",
        GETATTR => "getattr",
        SETATTR => "setattr",
        READLINK => "readlink",
        SYMLINK => "symlink",
        MKNOD => "mknod",
        MKDIR => "mkdir",
        UNLINK => "unlink",
        RMDIR => "rmdir",
        RENAME => "rename",
        LINK => "link",
        OPEN => "open",
        STATFS => "statfs",
        RELEASE => "release",
        SETXATTR => "setxattr",
        GETXATTR => "getxattr",
        LISTXATTR => "listxattr",
        REMOVEXATTR => "removexattr",
        INIT => "init",
        OPENDIR => "opendir",
        READDIR => "readdir",
        RELEASEDIR => "releasedir",
        CREATE => "create",
        INTERRUPT => "interrupt",
        DESTROY => "destroy",
        NOTIFY_REPLY => "notify_reply",
        BATCH_FORGET => "batch_forget",
        READDIRPLUS => "readdirplus",
        RENAME2 => "rename2",
        TMPFILE => "tmpfile",
        _ => "an operation not served",
    }
}

/// `fuse_in_header`'s size.
pub const IN_HEADER: usize = size_of::<InHeader>();
/// `fuse_out_header`'s size.
pub const OUT_HEADER: usize = size_of::<OutHeader>();

/// `fuse_in_header`.
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
    pub padding: u16,
}

/// `fuse_out_header`.
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct OutHeader {
    pub len: u32,
    pub error: i32,
    pub unique: u64,
}

/// `fuse_attr` (7.9 and later).
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Default)]
pub struct FuseAttr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

/// `fuse_entry_out`.
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FuseEntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: FuseAttr,
}

/// `fuse_attr_out`.
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: FuseAttr,
}

/// `fuse_dirent`'s fixed part (the name follows, padded to 8 bytes).
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FuseDirent {
    pub ino: u64,
    pub off: u64,
    pub namelen: u32,
    pub typ: u32,
}

/// `fuse_forget_in`, and `fuse_batch_forget_in` with its `fuse_forget_one`s.
#[repr(C)]
#[derive(FromBytes, Immutable, KnownLayout)]
pub struct ForgetIn {
    pub nlookup: u64,
}

#[repr(C)]
#[derive(FromBytes, Immutable, KnownLayout)]
pub struct BatchForgetIn {
    pub count: u32,
    pub dummy: u32,
}

#[repr(C)]
#[derive(FromBytes, Immutable, KnownLayout)]
pub struct ForgetOne {
    pub nodeid: u64,
    pub nlookup: u64,
}

/// `fuse_read_in`, which READDIR and READDIRPLUS carry.
#[repr(C)]
#[derive(FromBytes, Immutable, KnownLayout)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub read_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `fuse_open_out`.
#[repr(C)]
#[derive(IntoBytes, Immutable)]
pub struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub backing_id: i32,
}

/// `fuse_kstatfs`, the whole of `fuse_statfs_out`.
#[repr(C)]
#[derive(IntoBytes, Immutable)]
pub struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
    pub padding: u32,
    pub spare: [u32; 6],
}

/// `fuse_init_in`'s first part, which every kernel sends; 7.36 and later add `flags2` (read
/// when it came) and room after it.
#[repr(C)]
#[derive(FromBytes, Immutable, KnownLayout)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
}

/// `fuse_init_out`, whole (7.23 and later).
#[repr(C)]
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
    pub unused2: u16,
    pub flags2: u32,
    pub max_stack_depth: u32,
    pub reserved: [u32; 6],
}

/// `fuse_notify_inval_inode_out` and `fuse_notify_inval_entry_out` (the name follows).
#[repr(C)]
#[derive(IntoBytes, Immutable)]
pub struct InvalInodeOut {
    pub ino: u64,
    pub off: i64,
    pub len: i64,
}

#[repr(C)]
#[derive(IntoBytes, Immutable)]
pub struct InvalEntryOut {
    pub parent: u64,
    pub namelen: u32,
    pub flags: u32,
}

/// `fuse_init_out`'s size for a kernel older than 7.23 (`FUSE_COMPAT_22_INIT_OUT_SIZE`).
pub const INIT_OUT_COMPAT_22: usize = 24;

const _: () = {
    assert!(size_of::<InHeader>() == 40);
    assert!(size_of::<OutHeader>() == 16);
    assert!(size_of::<FuseAttr>() == 88);
    assert!(size_of::<FuseEntryOut>() == 128);
    assert!(size_of::<AttrOut>() == 104);
    assert!(size_of::<FuseDirent>() == 24);
    assert!(size_of::<ForgetIn>() == 8);
    assert!(size_of::<BatchForgetIn>() == 8);
    assert!(size_of::<ForgetOne>() == 16);
    assert!(size_of::<ReadIn>() == 40);
    assert!(size_of::<OpenOut>() == 16);
    assert!(size_of::<StatfsOut>() == 80);
    assert!(size_of::<InitIn>() == 16);
    assert!(size_of::<InitOut>() == 64);
    assert!(size_of::<InvalInodeOut>() == 24);
    assert!(size_of::<InvalEntryOut>() == 16);
};

/// The `T` at the start of `b`, and what follows it; `None` if `b` is shorter.
pub fn read<T: FromBytes + KnownLayout + Immutable>(b: &[u8]) -> Option<(T, &[u8])> {
    T::read_from_prefix(b).ok()
}
