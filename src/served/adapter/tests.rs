//! The adapter's rules, bytes in and bytes out, read back with the keeper's readers (which
//! read at the kernel's offsets): INIT, the answers, the refusals, and bad requests.

use super::*;
use crate::decision::tree::{Node, Tree, TreeBuilder};
use crate::device::{Access, Rdev};
use crate::keeper::fuse_wire::{self, Reply, build};
use std::sync::atomic::{AtomicUsize, Ordering};

fn tree() -> Tree {
    let mut b = TreeBuilder::default();
    b.insert("null", Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
    b.insert("nvidia0", Node::device(DevKind::Char, Rdev::new(195, 5), Access::DEVICE_DEFAULT)).unwrap();
    b.insert("stdin", Node::symlink("/proc/self/fd/0")).unwrap();
    b.mkdir_all("pts").unwrap();
    b.build()
}

fn adapter(ttl: u64) -> Adapter {
    Adapter::new(Arc::new(Devfs::new(tree())), Duration::from_secs(ttl), None)
}

/// An INIT request of FUSE 7.`minor` offering `flags` (with `flags2` when the INIT_EXT flag is
/// among them).
fn init(major: u32, minor: u32, flags: u64) -> Vec<u8> {
    let mut body = Vec::new();
    for word in [major, minor, 128 * 1024, flags as u32, (flags >> 32) as u32] {
        body.extend_from_slice(&word.to_ne_bytes());
    }
    body.resize(64, 0);
    build::request(abi::INIT, 1, 0, &body)
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
}

/// What a kernel that offers everything (Linux 6.18's flags, INIT_EXT with flags2) offers.
const EVERYTHING: u64 = 0x0000_01ff_ffff_ffff;

fn agreed(a: &mut Adapter, msg: &[u8]) -> Vec<u8> {
    match a.handshake(msg, 4096) {
        Handshake::Agreed(reply) => reply,
        other => panic!("not agreed: {other:?}"),
    }
}

fn answer(a: &Adapter, msg: &[u8]) -> Reply<'static> {
    let bytes = a.answer(msg).expect("a reply");
    Reply::parse(Box::leak(bytes.into_boxed_slice())).unwrap()
}

/// Rule: INIT is answered as fuser 0.18 answered it (the keeper compares a replacement server's
/// reply with its first server's, byte for byte): FUSE 7.40, fuser's settings, and the flags
/// asked for that the kernel offers; a kernel older than 7.23 gets the 24-byte reply.
#[test]
fn init_agrees_to_what_the_kernel_offers_with_fusers_settings() {
    let mut a = adapter(86400);
    let reply = agreed(&mut a, &init(7, 45, EVERYTHING));
    let r = Reply::parse(&reply).unwrap();
    assert_eq!((r.unique, r.error, r.body.len()), (1, 0, 64));
    let wanted = flag::ASYNC_READ
        | flag::BIG_WRITES
        | flag::MAX_PAGES
        | flag::ABORT_ERROR
        | flag::NO_OPENDIR_SUPPORT
        | flag::CACHE_SYMLINKS
        | flag::PARALLEL_DIROPS
        | flag::DO_READDIRPLUS
        | flag::READDIRPLUS_AUTO
        | flag::INIT_EXT;
    assert_eq!((word(r.body, 0), word(r.body, 4), word(r.body, 8)), (7, 40, 128 * 1024));
    assert_eq!(u64::from(word(r.body, 12)) | u64::from(word(r.body, 36)) << 32, wanted);
    assert_eq!(&r.body[16..20], &[16, 0, 12, 0], "max_background, congestion_threshold");
    assert_eq!((word(r.body, 20), word(r.body, 24)), (16 << 20, 1), "max_write, time_gran");
    assert_eq!(u16::from_ne_bytes([r.body[28], r.body[29]]), 4096, "max_pages");
    assert!(r.body[40..].iter().all(|&b| b == 0));

    // Only what is offered; readdirplus only as a pair.
    let mut a = adapter(86400);
    let offered = flag::ASYNC_READ | flag::DO_READDIRPLUS | flag::CACHE_SYMLINKS;
    let reply = agreed(&mut a, &init(7, 22, offered));
    let r = Reply::parse(&reply).unwrap();
    assert_eq!(r.body.len(), 24, "7.22: fuse_init_out's compat size");
    assert_eq!(u64::from(word(r.body, 12)), flag::ASYNC_READ | flag::CACHE_SYMLINKS);
}

/// Rule: a kernel of a newer major version is told ours and asked again; one older than 7.12
/// is refused with EPROTO; a first request that is not INIT is answered EIO and ends it.
#[test]
fn init_of_other_versions_and_other_requests_first() {
    let mut a = adapter(86400);
    let Handshake::Again(reply) = a.handshake(&init(8, 1, EVERYTHING), 4096) else { panic!("not again") };
    let r = Reply::parse(&reply).unwrap();
    assert_eq!((word(r.body, 0), word(r.body, 4), word(r.body, 12)), (7, 40, 0));
    let Handshake::Refused(Some(reply), HandshakeError::TooOld(7, 11)) = a.handshake(&init(7, 11, 0), 4096) else {
        panic!("7.11 not refused")
    };
    assert_eq!(Reply::parse(&reply).unwrap().error, -libc::EPROTO);
    let Handshake::Refused(Some(reply), HandshakeError::NotInit(1)) = a.handshake(&build::lookup(5, 1, "x"), 4096)
    else {
        panic!("a lookup first not refused")
    };
    assert_eq!(Reply::parse(&reply).unwrap().error, -libc::EIO);
    assert!(matches!(a.handshake(&[0; 12], 4096), Handshake::Refused(None, HandshakeError::Wire(_))));
}

/// Rule: lookups answer entries the keeper (and the kernel) read back: a node with its type,
/// mode and device number; a missing name a negative entry for the TTL (ENOENT with TTL 0);
/// getattr and readlink the same node's.
#[test]
fn lookups_getattr_and_readlink_answer_the_trees_nodes() {
    let a = adapter(86400);
    let r = answer(&a, &build::lookup(2, 1, "nvidia0"));
    let entry = fuse_wire::lookup_entry(r.body).unwrap();
    assert_ne!(entry.nodeid, 0);
    assert_eq!((entry.attr.mode, entry.attr.rdev), (libc::S_IFCHR | 0o666, Rdev::new(195, 5).to_fuse()));
    assert_eq!(word(r.body, 16), 86400, "entry_valid");

    let getattr = answer(&a, &build::request(abi::GETATTR, 3, entry.nodeid, &[0; 16]));
    assert_eq!((getattr.error, getattr.body.len()), (0, 104));
    assert_eq!(&getattr.body[16..], &r.body[40..], "the same attributes");

    let miss = answer(&a, &build::lookup(4, 1, "nvidia1"));
    assert_eq!((miss.error, fuse_wire::lookup_entry(miss.body).unwrap().nodeid), (0, 0));
    assert_eq!(answer(&adapter(0), &build::lookup(4, 1, "nvidia1")).error, -libc::ENOENT);

    let link = fuse_wire::lookup_entry(answer(&a, &build::lookup(5, 1, "stdin")).body).unwrap();
    let target = answer(&a, &build::request(abi::READLINK, 6, link.nodeid, &[]));
    assert_eq!(target.body, b"/proc/self/fd/0");
    assert_eq!(answer(&a, &build::request(abi::READLINK, 7, entry.nodeid, &[])).error, -libc::EINVAL);
    assert_eq!(answer(&a, &build::request(abi::GETATTR, 8, 999, &[0; 16])).error, -libc::ENOENT);
}

/// A READDIR(PLUS) request for `size` bytes from `offset`.
fn readdir(opcode: u32, unique: u64, offset: u64, size: u32) -> Vec<u8> {
    let mut body = vec![0u8; 40];
    body[8..16].copy_from_slice(&offset.to_ne_bytes());
    body[16..20].copy_from_slice(&size.to_ne_bytes());
    build::request(opcode, unique, 1, &body)
}

/// Rule: a listing has `.`, `..` and every name, in entries of the kernel's layout, cut where
/// the kernel's buffer ends and resumed from the last entry's offset; readdirplus entries carry
/// the node's attributes.
#[test]
fn listings_fill_the_kernels_buffer_and_resume_from_its_offset() {
    let a = adapter(86400);
    let names = |opcode, size| {
        let mut got = Vec::new();
        let mut offset = 0;
        loop {
            let r = answer(&a, &readdir(opcode, 9, offset, size));
            let page = fuse_wire::dirents(r.body, opcode == abi::READDIRPLUS).unwrap();
            assert!(r.body.len() <= size as usize);
            let Some(last) = page.last() else { return got };
            offset = last.off;
            got.extend(page.into_iter().map(|d| (String::from_utf8(d.name).unwrap(), d.entry.map(|e| e.attr.mode))));
        }
    };
    let all = names(abi::READDIRPLUS, 4096);
    let listed: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(listed, [".", "..", "null", "nvidia0", "pts", "stdin"]);
    assert_eq!(all[3].1, Some(libc::S_IFCHR | 0o666));
    assert_eq!(all[4].1.map(|m| m & libc::S_IFMT), Some(libc::S_IFDIR));
    // One entry per page: a READDIRPLUS entry is 152 bytes and more.
    assert_eq!(names(abi::READDIRPLUS, 160), all);
    let plain: Vec<String> = names(abi::READDIR, 32).into_iter().map(|(n, _)| n).collect();
    assert_eq!(plain, listed);
}

/// Rule: every change is refused (setattr EPERM, the rest EROFS, O_TMPFILE's FUSE_TMPFILE
/// too); xattrs, INTERRUPT and unknown opcodes are ENOSYS; FORGET gets no reply.
#[test]
fn changes_are_refused_and_the_rest_is_enosys() {
    let a = adapter(86400);
    let error = |opcode| answer(&a, &build::request(opcode, 11, 1, &[0; 64])).error;
    assert_eq!(error(abi::SETATTR), -libc::EPERM);
    for opcode in [
        abi::MKNOD,
        abi::MKDIR,
        abi::UNLINK,
        abi::RMDIR,
        abi::SYMLINK,
        abi::RENAME,
        abi::RENAME2,
        abi::LINK,
        abi::CREATE,
        abi::TMPFILE,
        abi::SETXATTR,
        abi::REMOVEXATTR,
    ] {
        assert_eq!(error(opcode), -libc::EROFS, "opcode {opcode}");
    }
    for opcode in [abi::GETXATTR, abi::LISTXATTR, abi::INTERRUPT, 52, 4096] {
        assert_eq!(error(opcode), -libc::ENOSYS, "opcode {opcode}");
    }
    assert_eq!(error(abi::INIT), -libc::EIO, "INIT after the handshake");
    assert!(a.answer(&build::forget(12, 2, 1)).is_none());
    assert!(a.answer(&build::batch_forget(13, &[(2, 1)])).is_none());
}

/// Rule: opendir is ENOSYS once the kernel agreed to go without it (and entries are cached),
/// and answered where it did not or the TTL is 0.
#[test]
fn opendir_is_enosys_only_where_the_kernel_goes_without_it() {
    let opendir = build::request(abi::OPENDIR, 14, 1, &[0; 8]);
    for (ttl, offered, errno) in
        [(86400, EVERYTHING, -libc::ENOSYS), (0, EVERYTHING, 0), (86400, EVERYTHING & !flag::NO_OPENDIR_SUPPORT, 0)]
    {
        let mut a = adapter(ttl);
        agreed(&mut a, &init(7, 45, offered));
        assert_eq!(answer(&a, &opendir).error, errno, "ttl {ttl}, offered {offered:#x}");
    }
}

/// Rule: a retired node the kernel forgets is reported; the report is called once per node
/// let go, and a FORGET of a live node reports nothing.
#[test]
fn forgetting_a_retired_node_is_reported() {
    let fs = Arc::new(Devfs::new(tree()));
    let reported = Arc::new(AtomicUsize::new(0));
    let count = reported.clone();
    let a = Adapter::new(
        fs.clone(),
        Duration::from_secs(86400),
        Some(Box::new(move || {
            count.fetch_add(1, Ordering::Relaxed);
        })),
    );
    let gpu = fuse_wire::lookup_entry(answer(&a, &build::lookup(2, 1, "nvidia0")).body).unwrap().nodeid;
    let null = fuse_wire::lookup_entry(answer(&a, &build::lookup(3, 1, "null")).body).unwrap().nodeid;
    let mut b = TreeBuilder::default();
    b.insert("null", Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
    fs.replace(b.build());
    assert!(a.answer(&build::forget(4, null, 1)).is_none());
    assert_eq!(reported.load(Ordering::Relaxed), 0);
    assert!(a.answer(&build::batch_forget(5, &[(gpu, 1)])).is_none());
    assert_eq!(reported.load(Ordering::Relaxed), 1);
}

/// Rule: a request that does not read (short, cut, a length that lies, a body too short for
/// its opcode) is answered EIO where its header names it, and never panics.
#[test]
fn requests_that_do_not_read_answer_eio() {
    let a = adapter(86400);
    assert!(a.answer(&[0; 20]).is_none());
    let mut lying = build::lookup(21, 1, "null");
    lying.truncate(lying.len() - 2);
    assert_eq!(Reply::parse(&a.answer(&lying).unwrap()).unwrap().error, -libc::EIO);
    let short = build::request(abi::READDIRPLUS, 22, 1, &[0; 8]);
    assert_eq!(answer(&a, &short).error, -libc::EIO);
    assert_eq!(answer(&a, &build::request(abi::LOOKUP, 23, 1, &[])).error, 0, "an empty name: a miss");
}

proptest::proptest! {
    /// Rule: no request, however made, panics the adapter.
    #[test]
    fn no_request_panics(opcode in 0u32..60, nodeid in 0u64..8, body in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
        let a = adapter(86400);
        let _ = a.answer(&build::request(opcode, 1, nodeid, &body));
    }
}
