//! The few FUSE messages the keeper reads as they pass: headers, the name a LOOKUP asks for,
//! the entries LOOKUP and READDIRPLUS replies give, the names and offsets of READDIR and
//! READDIRPLUS replies, what FORGET and BATCH_FORGET let go, and a READLINK reply's target. Everything else passes as opaque bytes.
//!
//! Assumptions: the kernel speaks FUSE 7.12 or later (the layouts of [`crate::fuse::abi`]), in native byte order; a message is one
//! whole read of `/dev/fuse` or one record of a `SOCK_SEQPACKET` socket. Nothing here trusts a
//! length it did not check: a short or inconsistent message is an error, never a panic.

use zerocopy::IntoBytes;

pub use crate::fuse::abi::{
    BATCH_FORGET, FORGET, IN_HEADER, INIT, INTERRUPT, LOOKUP, OUT_HEADER, READDIR, READDIRPLUS, READLINK,
};
use crate::fuse::abi::{FuseDirent, FuseEntryOut, InvalEntryOut, InvalInodeOut, OutHeader, read};
pub use crate::fuse::{Reply, Request, WireError, error_reply};

/// What an entry told the kernel about a node: the attributes that make its identity.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Attr {
    /// `st_mode`: the type bits and the permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// In FUSE's encoding (the kernel's `new_encode_dev`).
    pub rdev: u32,
    pub size: u64,
    pub mtime: (u64, u32),
}

/// One entry of a LOOKUP or READDIRPLUS reply: the node id the kernel now holds a reference
/// to (0: none, a negative entry) and its attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryOut {
    pub nodeid: u64,
    pub attr: Attr,
}

impl From<FuseEntryOut> for EntryOut {
    fn from(e: FuseEntryOut) -> EntryOut {
        let a = e.attr;
        EntryOut {
            nodeid: e.nodeid,
            attr: Attr {
                size: a.size,
                mtime: (a.mtime, a.mtimensec),
                mode: a.mode,
                uid: a.uid,
                gid: a.gid,
                rdev: a.rdev,
            },
        }
    }
}

/// The entry of a LOOKUP reply.
pub fn lookup_entry(body: &[u8]) -> Result<EntryOut, WireError> {
    read::<FuseEntryOut>(body).map(|(e, _)| e.into()).ok_or(WireError::Truncated { what: "entry" })
}

/// One entry of a READDIR or READDIRPLUS reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirent {
    pub name: Vec<u8>,
    /// The listing offset the kernel resumes from after this entry (devremap's cookie).
    pub off: u64,
    /// The entry of a READDIRPLUS reply (`None` for READDIR).
    pub entry: Option<EntryOut>,
}

/// The entries of a READDIR reply (`plus` false) or a READDIRPLUS reply, `.` and `..` included.
pub fn dirents(body: &[u8], plus: bool) -> Result<Vec<Dirent>, WireError> {
    let what = if plus { "direntplus" } else { "dirent" };
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (entry, after) = match plus {
            true => read::<FuseEntryOut>(rest).map(|(e, after)| (Some(e.into()), after)),
            false => Some((None, rest)),
        }
        .ok_or(WireError::Truncated { what })?;
        let (dirent, after) = read::<FuseDirent>(after).ok_or(WireError::Truncated { what })?;
        let name = after.get(..dirent.namelen as usize).ok_or(WireError::Truncated { what })?;
        out.push(Dirent { name: name.to_vec(), off: dirent.off, entry });
        // Each entry is padded to 8 bytes; the last one may end without its padding.
        let size = rest.len() - after.len() + name.len();
        rest = &rest[size.next_multiple_of(8).min(rest.len())..];
    }
    Ok(out)
}

/// `FUSE_NOTIFY_INVAL_INODE`: drop what the kernel cached of node `ino` (attributes, a
/// directory's listing).
pub fn inval_inode(ino: u64) -> Vec<u8> {
    // Offset 0, length 0: the whole cached content, with the attributes.
    notification(NOTIFY_INVAL_INODE, &[InvalInodeOut { ino, off: 0, len: 0 }.as_bytes()])
}

/// `FUSE_NOTIFY_INVAL_ENTRY`: drop the kernel's entry `name` in directory `parent`.
pub fn inval_entry(parent: u64, name: &[u8]) -> Vec<u8> {
    let head = InvalEntryOut { parent, namelen: name.len() as u32, flags: 0 };
    notification(NOTIFY_INVAL_ENTRY, &[head.as_bytes(), name, &[0]])
}

const NOTIFY_INVAL_INODE: i32 = 2;
const NOTIFY_INVAL_ENTRY: i32 = 3;

/// A notification: an out header with unique 0 and the code where a reply has its error.
fn notification(code: i32, body: &[&[u8]]) -> Vec<u8> {
    let len = OUT_HEADER + body.iter().map(|part| part.len()).sum::<usize>();
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(OutHeader { len: len as u32, error: code, unique: 0 }.as_bytes());
    body.iter().for_each(|part| b.extend_from_slice(part));
    b
}

/// Builders of wire messages for tests of the keeper's logic (here and in `relay`).
#[cfg(test)]
pub mod build {
    use super::*;

    /// `fuse_entry_out`'s size and `fuse_dirent`'s fixed part, as the kernel has them: the
    /// builders below write at the kernel's offsets, not through the structs they test.
    pub const ENTRY_OUT: usize = 128;
    pub const DIRENT: usize = 24;

    pub fn request(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&((IN_HEADER + body.len()) as u32).to_ne_bytes());
        b.extend_from_slice(&opcode.to_ne_bytes());
        b.extend_from_slice(&unique.to_ne_bytes());
        b.extend_from_slice(&nodeid.to_ne_bytes());
        b.extend_from_slice(&[0; 16]);
        b.extend_from_slice(body);
        b
    }

    pub fn reply(unique: u64, error: i32, body: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&((OUT_HEADER + body.len()) as u32).to_ne_bytes());
        b.extend_from_slice(&error.to_ne_bytes());
        b.extend_from_slice(&unique.to_ne_bytes());
        b.extend_from_slice(body);
        b
    }

    pub fn entry(nodeid: u64, attr: &Attr) -> Vec<u8> {
        let mut b = vec![0u8; ENTRY_OUT];
        b[0..8].copy_from_slice(&nodeid.to_ne_bytes());
        b[40..48].copy_from_slice(&nodeid.to_ne_bytes());
        b[48..56].copy_from_slice(&attr.size.to_ne_bytes());
        b[72..80].copy_from_slice(&attr.mtime.0.to_ne_bytes());
        b[92..96].copy_from_slice(&attr.mtime.1.to_ne_bytes());
        b[100..104].copy_from_slice(&attr.mode.to_ne_bytes());
        b[108..112].copy_from_slice(&attr.uid.to_ne_bytes());
        b[112..116].copy_from_slice(&attr.gid.to_ne_bytes());
        b[116..120].copy_from_slice(&attr.rdev.to_ne_bytes());
        b
    }

    /// A READDIRPLUS reply's body (READDIR's with `plus` false); entry i has offset 100 + i.
    pub fn dirent_body(entries: &[(&str, u64, Attr)], plus: bool) -> Vec<u8> {
        let mut b = Vec::new();
        for (i, (name, nodeid, attr)) in entries.iter().enumerate() {
            if plus {
                b.extend(entry(*nodeid, attr));
            }
            b.extend_from_slice(&nodeid.to_ne_bytes());
            b.extend_from_slice(&(i as u64 + 100).to_ne_bytes());
            b.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            b.extend_from_slice(&(attr.mode >> 12).to_ne_bytes());
            b.extend_from_slice(name.as_bytes());
            b.resize(b.len().next_multiple_of(8), 0);
        }
        b
    }

    pub fn forget(unique: u64, nodeid: u64, n: u64) -> Vec<u8> {
        request(FORGET, unique, nodeid, &n.to_ne_bytes())
    }

    pub fn batch_forget(unique: u64, ones: &[(u64, u64)]) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&(ones.len() as u32).to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        for (id, n) in ones {
            body.extend_from_slice(&id.to_ne_bytes());
            body.extend_from_slice(&n.to_ne_bytes());
        }
        request(BATCH_FORGET, unique, 0, &body)
    }

    pub fn lookup(unique: u64, parent: u64, name: &str) -> Vec<u8> {
        let mut body = name.as_bytes().to_vec();
        body.push(0);
        request(LOOKUP, unique, parent, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;

    fn dev_attr() -> Attr {
        Attr { mode: 0o20666, uid: 0, gid: 0, rdev: (195 << 8) | 3, size: 0, mtime: (7, 8) }
    }

    /// Rule: the fields read back are the ones written at the kernel's offsets.
    #[test]
    fn a_lookup_reply_gives_the_node_and_its_attributes() {
        let msg = reply(9, 0, &entry(42, &dev_attr()));
        let r = Reply::parse(&msg).unwrap();
        assert_eq!(r.unique, 9);
        assert_eq!(lookup_entry(r.body).unwrap(), EntryOut { nodeid: 42, attr: dev_attr() });
        let req = lookup(9, 1, "nvidia3");
        let q = Request::parse(&req).unwrap();
        assert_eq!((q.opcode, q.nodeid, q.name()), (LOOKUP, 1, &b"nvidia3"[..]));
    }

    /// Rule: every entry of a READDIR or READDIRPLUS reply is read, names of any length, the
    /// padding skipped, with its offset.
    #[test]
    fn dirents_reads_every_entry() {
        let names = [".", "..", "a", "nvidia0", "1234567", "12345678"];
        let entries: Vec<(&str, u64, Attr)> =
            names.iter().enumerate().map(|(i, n)| (*n, i as u64 + 2, dev_attr())).collect();
        for plus in [true, false] {
            let got = dirents(&dirent_body(&entries, plus), plus).unwrap();
            assert_eq!(got.len(), names.len());
            for (i, (d, want)) in got.iter().zip(&entries).enumerate() {
                assert_eq!((d.name.as_slice(), d.off), (want.0.as_bytes(), i as u64 + 100));
                assert_eq!(d.entry.as_ref().map(|e| e.nodeid), plus.then_some(want.1));
            }
        }
    }

    /// Rule: a truncated or lying message is an error, never a panic.
    #[test]
    fn short_and_inconsistent_messages_are_errors() {
        assert_eq!(Request::parse(&[0; 10]).unwrap_err(), WireError::Short(10));
        let mut msg = lookup(1, 1, "x");
        msg.push(0);
        assert!(matches!(Request::parse(&msg), Err(WireError::Length { .. })));
        let body = dirent_body(&[("abc", 5, dev_attr())], true);
        for cut in [1, ENTRY_OUT, ENTRY_OUT + DIRENT + 1] {
            assert!(dirents(&body[..cut], true).is_err(), "cut at {cut}");
        }
        assert!(dirents(&body[..DIRENT + 1], false).is_err());
        assert!(lookup_entry(&[0; 100]).is_err());
        let batch = batch_forget(3, &[(5, 1), (6, 2)]);
        let mut lying = batch.clone();
        lying[IN_HEADER..IN_HEADER + 4].copy_from_slice(&3u32.to_ne_bytes());
        assert!(Request::parse(&lying).unwrap().forgets().is_err());
        assert_eq!(Request::parse(&batch).unwrap().forgets().unwrap(), vec![(5, 1), (6, 2)]);
        assert_eq!(Request::parse(&forget(4, 9, 3)).unwrap().forgets().unwrap(), vec![(9, 3)]);
    }

    /// Rule: notifications are whole messages with unique 0, the code in the error field, and
    /// the kernel's layouts (`fuse_notify_inval_entry_out` then the name and a NUL).
    #[test]
    fn notifications_have_the_kernels_layout() {
        let entry = inval_entry(7, b"nvidia3");
        let r = Reply::parse(&entry).unwrap();
        assert_eq!((r.unique, r.error, r.body.len()), (0, 3, 16 + 7 + 1));
        assert_eq!(&r.body[0..8], &7u64.to_ne_bytes());
        assert_eq!(&r.body[8..12], &7u32.to_ne_bytes());
        assert_eq!(&r.body[16..], b"nvidia3\0");
        let inode = inval_inode(9);
        let r = Reply::parse(&inode).unwrap();
        assert_eq!((r.unique, r.error, r.body.len()), (0, 2, 24));
    }

    /// Rule: the keeper's own error reply is a whole FUSE reply with a negative errno.
    #[test]
    fn error_reply_is_a_reply() {
        let msg = error_reply(77, libc::EIO);
        let r = Reply::parse(&msg).unwrap();
        assert_eq!((r.unique, r.error, r.body.len()), (77, -libc::EIO, 0));
    }
}
