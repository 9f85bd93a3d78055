//! FUSE's wire, as both halves of devremap speak it: [`abi`] holds the kernel's structs and
//! opcodes; this module reads a request's header and the few bodies more than one layer reads,
//! and writes replies. The keeper ([`crate::keeper::fuse_wire`]) reads what passes through it;
//! the server ([`crate::served::adapter`]) answers with what is written here. Nothing here
//! knows a tree or a socket, as fuser keeps its codec (`ll/`) apart from its session.
//!
//! Assumptions: a message is one whole read of `/dev/fuse` or one record of a `SOCK_SEQPACKET`
//! socket, in native byte order. Nothing here trusts a length it did not check: a short or
//! inconsistent message is an error, never a panic.

pub mod abi;

pub use abi::{BATCH_FORGET, FORGET, INTERRUPT};
use abi::{
    BatchForgetIn, ForgetIn, ForgetOne, FuseDirent, FuseEntryOut, IN_HEADER, InHeader, OUT_HEADER, OutHeader, read,
};
use thiserror::Error;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("a FUSE message of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("a FUSE message's header says {said} bytes, but {got} came")]
    Length { said: usize, got: usize },
    #[error("a FUSE {what} is truncated")]
    Truncated { what: &'static str },
}

/// Checks that `msg` starts with a header `H` and is as long as its first field (`len`) says.
fn whole<H: FromBytes + KnownLayout + Immutable>(msg: &[u8], len: impl Fn(&H) -> u32) -> Result<H, WireError> {
    let (header, _) = read::<H>(msg).ok_or(WireError::Short(msg.len()))?;
    let said = len(&header) as usize;
    if said != msg.len() {
        return Err(WireError::Length { said, got: msg.len() });
    }
    Ok(header)
}

/// A request from the kernel: `fuse_in_header` and what follows it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub body: &'a [u8],
}

impl<'a> Request<'a> {
    pub fn parse(msg: &'a [u8]) -> Result<Request<'a>, WireError> {
        let h = whole::<InHeader>(msg, |h| h.len)?;
        Ok(Request { opcode: h.opcode, unique: h.unique, nodeid: h.nodeid, body: &msg[IN_HEADER..] })
    }

    /// The `unique` of a message that starts with a request's header, whole or not: what an
    /// error reply to a request that does not read answers.
    pub fn unique_of(msg: &[u8]) -> Option<u64> {
        read::<InHeader>(msg).map(|(h, _)| h.unique)
    }

    /// A request that gets no reply: FORGET, BATCH_FORGET, INTERRUPT.
    pub fn unanswered(&self) -> bool {
        matches!(self.opcode, FORGET | BATCH_FORGET | INTERRUPT)
    }

    /// The name a LOOKUP asks for: the bytes up to the first NUL.
    pub fn name(&self) -> &'a [u8] {
        self.body.split(|&b| b == 0).next().unwrap_or_default()
    }

    /// The references a FORGET or BATCH_FORGET lets go: `(node id, count)`.
    pub fn forgets(&self) -> Result<Vec<(u64, u64)>, WireError> {
        let truncated = WireError::Truncated { what: "forget" };
        match self.opcode {
            FORGET => read::<ForgetIn>(self.body).map(|(f, _)| vec![(self.nodeid, f.nlookup)]).ok_or(truncated),
            BATCH_FORGET => {
                let (batch, mut ones) = read::<BatchForgetIn>(self.body).ok_or(truncated)?;
                let count = batch.count as usize;
                if ones.len() / size_of::<ForgetOne>() < count {
                    return Err(WireError::Truncated { what: "forget" });
                }
                let mut out = Vec::with_capacity(count);
                for _ in 0..count {
                    let (one, rest) = read::<ForgetOne>(ones).ok_or(WireError::Truncated { what: "forget" })?;
                    out.push((one.nodeid, one.nlookup));
                    ones = rest;
                }
                Ok(out)
            }
            _ => Ok(Vec::new()),
        }
    }
}

/// A message from the server: a reply (`unique` not 0) or a notification (`unique` 0, `error`
/// the notification's code).
#[derive(Debug, Clone, Copy)]
pub struct Reply<'a> {
    pub error: i32,
    pub unique: u64,
    pub body: &'a [u8],
}

impl<'a> Reply<'a> {
    pub fn parse(msg: &'a [u8]) -> Result<Reply<'a>, WireError> {
        let h = whole::<OutHeader>(msg, |h| h.len)?;
        Ok(Reply { error: h.error, unique: h.unique, body: &msg[OUT_HEADER..] })
    }
}

/// An error reply to request `unique`: what the keeper answers for a request it gives up on.
pub fn error_reply(unique: u64, errno: i32) -> Vec<u8> {
    OutHeader { len: OUT_HEADER as u32, error: -errno, unique }.as_bytes().to_vec()
}

/// A reply to request `unique` whose body is `parts`, one after the other.
pub fn reply(unique: u64, parts: &[&[u8]]) -> Vec<u8> {
    let len = OUT_HEADER + parts.iter().map(|part| part.len()).sum::<usize>();
    let mut b = Vec::with_capacity(len);
    b.extend_from_slice(OutHeader { len: len as u32, error: 0, unique }.as_bytes());
    parts.iter().for_each(|part| b.extend_from_slice(part));
    b
}

/// A READDIR or READDIRPLUS reply's body, filled up to the size the kernel asked for.
#[derive(Debug)]
pub struct Dirents {
    buf: Vec<u8>,
    max: usize,
}

impl Dirents {
    pub fn new(max: usize) -> Dirents {
        Dirents { buf: Vec::new(), max }
    }

    /// Adds an entry (with its `fuse_entry_out` for READDIRPLUS), padded to 8 bytes; true, and
    /// nothing added, when it does not fit.
    pub fn push(&mut self, entry: Option<&FuseEntryOut>, dirent: &FuseDirent, name: &[u8]) -> bool {
        let head = entry.map_or(0, |_| size_of::<FuseEntryOut>()) + size_of::<FuseDirent>();
        let size = (head + name.len()).next_multiple_of(8);
        if self.buf.len() + size > self.max {
            return true;
        }
        if let Some(entry) = entry {
            self.buf.extend_from_slice(entry.as_bytes());
        }
        self.buf.extend_from_slice(dirent.as_bytes());
        self.buf.extend_from_slice(name);
        self.buf.resize(self.buf.len().next_multiple_of(8), 0);
        false
    }

    pub fn body(&self) -> &[u8] {
        &self.buf
    }
}
