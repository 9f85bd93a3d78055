//! The server's INIT reply against fuser 0.18's, the session it replaced (issue 31), for the
//! INITs kernels send: a keeper compares a replacement server's INIT reply with its first
//! server's byte for byte, and a keeper of an earlier build, whose first server ran fuser's
//! session, hands its connection to a server of this build at an upgrade. Needs no root: each
//! side answers an INIT written to a socket pair.

use devremap::served::adapter::{Adapter, Handshake};
use devremap::served::devfs::Devfs;
use fuser::{Filesystem, InitFlags, KernelConfig, Request, SessionACL};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use std::sync::Arc;
use std::time::Duration;

/// The capabilities the fuser adapter asked for, each where the kernel offered it (the
/// adapter this build replaced, `Filesystem::init`, as it was).
struct AsBefore;

impl Filesystem for AsBefore {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        for flag in [
            InitFlags::FUSE_ABORT_ERROR,
            InitFlags::FUSE_NO_OPENDIR_SUPPORT,
            InitFlags::FUSE_CACHE_SYMLINKS,
            InitFlags::FUSE_PARALLEL_DIROPS,
            InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO,
        ] {
            let _ = config.add_capabilities(flag);
        }
        Ok(())
    }
}

/// An INIT request of FUSE 7.`minor` offering `flags`, `readahead` bytes of read-ahead.
fn init(minor: u32, flags: u64, readahead: u32) -> Vec<u8> {
    let mut body = Vec::new();
    for word in [7, minor, readahead, flags as u32, (flags >> 32) as u32] {
        body.extend_from_slice(&word.to_ne_bytes());
    }
    body.resize(if minor >= 36 { 64 } else { 16 }, 0);
    let mut msg = Vec::new();
    msg.extend_from_slice(&(40 + body.len() as u32).to_ne_bytes());
    msg.extend_from_slice(&26u32.to_ne_bytes());
    msg.extend_from_slice(&77u64.to_ne_bytes());
    msg.extend_from_slice(&[0; 24]);
    msg.extend(body);
    msg
}

/// fuser's reply to `msg`: its session's handshake, on one end of a socket pair.
fn fusers_reply(msg: &[u8]) -> Vec<u8> {
    let (ours, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
    nix::unistd::write(&ours, msg).unwrap();
    let config = fuser::Config::default();
    let session = fuser::Session::from_fd(AsBefore, theirs, SessionACL::All, config).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = nix::unistd::read(&ours, &mut buf).unwrap();
    drop(session);
    buf.truncate(n);
    buf
}

fn our_reply(msg: &[u8]) -> Vec<u8> {
    let mut adapter = Adapter::new(
        Arc::new(Devfs::new(devremap::decision::tree::TreeBuilder::default().build())),
        Duration::from_secs(86400),
        None,
    );
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).unwrap().unwrap() as u32;
    match adapter.handshake(msg, page) {
        Handshake::Agreed(reply) => reply,
        other => panic!("not agreed: {other:?}"),
    }
}

/// Rule (issue 31): for every INIT a kernel sends (7.12 to 7.45; flags none, some, all; with
/// and without INIT_EXT's second word; read-ahead under and over max_write), the server's reply
/// is fuser 0.18's, byte for byte.
#[test]
fn the_init_reply_is_fusers_byte_for_byte() {
    let linux_6_18 = 0x0000_01ff_ffff_ffffu64;
    let flag_sets = [
        0,
        linux_6_18,
        linux_6_18 & 0xffff_ffff & !(1 << 30),
        linux_6_18 & !(1 << 24) & !(1 << 14),
        (1 << 13) | (1 << 23) | (1 << 22),
    ];
    for minor in [12, 22, 23, 31, 36, 40, 45] {
        for flags in flag_sets {
            for readahead in [0, 128 * 1024, 32 << 20] {
                let msg = init(minor, flags, readahead);
                assert_eq!(our_reply(&msg), fusers_reply(&msg), "7.{minor}, flags {flags:#x}, readahead {readahead}");
            }
        }
    }
}
