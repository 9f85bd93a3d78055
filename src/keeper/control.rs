//! What the keeper and its server say to each other outside the FUSE traffic, over the
//! control socket (a `SOCK_SEQPACKET` pair: one record is one message), the resume payload (the
//! kernel's node table and the counters a server takes over) and the state file's fields about
//! the keeper and its servers: one protocol, [`PROTOCOL`], with serde deriving each encoding.
//!
//! A control record is the message as JSON (`{"Status":{"generation":3,...}}`), then, for the
//! two that carry bytes ([`Control::Part`], [`Control::Invalidate`]), a NUL byte and the bytes
//! as they are (compact JSON never holds a NUL). Two records are frozen, the same in every
//! version since protocol 1: [`Control::Load`] (`D`) and [`Control::Loaded`] (`L` and the
//! version, 4 bytes little-endian; a bare `L`, from a build before versions, is protocol 0), so
//! that a keeper and a server of any two versions always learn each other's version, and an
//! upgrade to another is refused naming both, never misread.
//!
//! Assumptions: a record is at most [`MAX_RECORD`] bytes, so the resume payload, which grows
//! with the nodes the kernel holds, goes in parts; what is read is bounded by the record (the
//! reader's buffer). A message that does not decode is an error naming what was wrong: a
//! server refuses to start on it.

use crate::keeper::kernel_nodes::{Held, HeldNode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// The version of what the keeper and its servers say to each other (the control messages, the
/// resume payload, the state file's keeper fields). A server says it with `Loaded`; an upgrade
/// to a binary that speaks another is refused, never misread. Raise it with any change to an
/// encoding. 1: hand-kept tag tables; 2: serde JSON.
pub const PROTOCOL: u32 = 2;

/// `devremapd --version`: the package's version and [`PROTOCOL`] (checked equal by a test).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (keeper protocol 2)");

/// What a server tells its keeper to tell the service manager (`READY=1`, `RELOADING=1`,
/// `STOPPING=1`): part of the keeper's protocol, so the keeper and the relay below the
/// filesystem take it from here, and the filesystem's machine above them says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Notice {
    Ready,
    Reloading,
    Stopping,
}

/// The largest control record: well under a socket's default buffer.
pub const MAX_RECORD: usize = 64 * 1024;
/// Room for a [`Control::Part`]'s JSON before its bytes.
const PART_HEADER: usize = 64;

#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum HandoverError {
    #[error("an empty control message")]
    Empty,
    #[error("a control message that is not valid: {0}")]
    Message(String),
    #[error("a truncated control message ({0})")]
    Truncated(&'static str),
    #[error("a resume payload that is not valid: {0}")]
    Payload(String),
    /// A payload over [`Parts`]'s limit (of bytes), said of the server that sent it: `server
    /// pid 12 sent a plan of more than 128 MiB, ...`.
    #[error("sent a plan of more than {} MiB, the most a keeper keeps", .limit >> 20)]
    TooLarge { limit: usize },
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// Server to keeper: the inputs loaded, and the [`PROTOCOL`] it speaks; send the INIT.
    /// (Frozen: see the module's doc.)
    Loaded(u32),
    /// Server to keeper: the inputs did not load (the error line); the server exits 1.
    Failed(String),
    /// Server to keeper: the mount answers through me; write the pid file, then say
    /// [`Control::Proceed`] (so the pid file is there before the state file, as always).
    Answering,
    /// Keeper to server: the pid file is written; declare the daemon ready.
    Proceed,
    /// Server to keeper: serving this generation, and the last reload's error if it was
    /// refused (with every state the server publishes): a successor keeps both.
    Status {
        generation: u64,
        last_error: Option<String>,
        /// Reloads finished since the mount (absent from an earlier build: 0).
        #[serde(default)]
        reloads: u64,
    },
    /// Server to keeper: the state file about to be renamed into place is this `(device,
    /// inode)`: at stop, the keeper removes the file at `--state-file` only if it is one its
    /// servers wrote (the last two told: the rename of the last may not have happened).
    StateFile(u64, u64),
    /// Server to keeper: tell the service manager (only the keeper, the main process, may).
    Notify(Notice),
    /// Server to keeper: write this notification (an invalidation) to `/dev/fuse`, then answer
    /// [`Control::Invalidated`] with the write's errno (0: done; ENOENT: nothing was cached).
    Invalidate(#[serde(skip)] Vec<u8>),
    Invalidated(i32),
    /// A part of a payload larger than a record ([`records`]); [`Control::End`] ends it. From
    /// the keeper: the plan to serve (instead of [`Control::Load`]), then the [`Resume`]; from
    /// the server: the plan it serves, after each generation (`Loaded::to_bytes`).
    Part(#[serde(skip)] Vec<u8>),
    End,
    /// Keeper to server, first: load the inputs (rather than serve the plan that follows).
    /// (Frozen: see the module's doc.)
    Load,
    /// Keeper to server: an upgrade failed; record it as the last error.
    Refused(String),
    /// Keeper to server: the daemon stops: remove the state file and exit.
    Stop,
    /// Keeper to server: another server takes over: exit without writing anything more (the
    /// state file is the successor's).
    Retire,
    /// Keeper to server: nothing was asked of you for `--rest-after`, and the keeper no longer
    /// sends you requests: say in the state file that no server runs (`server_pid` null,
    /// `resting` true), and exit. The next request or signal starts another, which serves your
    /// plan. (A server of an earlier build does not know it: the keeper kills it.)
    Rest,
}

impl Control {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Control::Loaded(protocol) => return [&b"L"[..], &protocol.to_le_bytes()].concat(),
            Control::Load => return b"D".to_vec(),
            _ => {}
        }
        // An enum of plain data with string keys only: its JSON cannot fail.
        let mut record = serde_json::to_vec(self).expect("a control message serializes");
        if let Control::Part(bytes) | Control::Invalidate(bytes) = self {
            record.push(0);
            record.extend_from_slice(bytes);
        }
        record
    }

    pub fn decode(record: &[u8]) -> Result<Control, HandoverError> {
        match record {
            [] => return Err(HandoverError::Empty),
            [b'L'] => return Ok(Control::Loaded(0)),
            [b'L', version @ ..] => {
                let version = version.try_into().map_err(|_| HandoverError::Truncated("Loaded"))?;
                return Ok(Control::Loaded(u32::from_le_bytes(version)));
            }
            [b'D'] => return Ok(Control::Load),
            _ => {}
        }
        let (json, bytes) = match record.iter().position(|&b| b == 0) {
            Some(nul) => (&record[..nul], Some(&record[nul + 1..])),
            None => (record, None),
        };
        let mut message: Control = serde_json::from_slice(json).map_err(|e| HandoverError::Message(e.to_string()))?;
        match (&mut message, bytes) {
            (Control::Part(b) | Control::Invalidate(b), Some(bytes)) => *b = bytes.to_vec(),
            (Control::Part(_) | Control::Invalidate(_), None) => return Err(HandoverError::Truncated("no bytes")),
            (Control::Loaded(_) | Control::Load, _) => {
                return Err(HandoverError::Message("not in its frozen form".into()));
            }
            (_, Some(_)) => return Err(HandoverError::Message("bytes after a message that has none".into())),
            _ => {}
        }
        Ok(message)
    }
}

/// A payload as the records that carry it: parts of at most [`MAX_RECORD`] bytes, then
/// [`Control::End`].
pub fn records(payload: &[u8]) -> Vec<Vec<u8>> {
    let mut records: Vec<Vec<u8>> =
        payload.chunks(MAX_RECORD - PART_HEADER).map(|part| Control::Part(part.to_vec()).encode()).collect();
    records.push(Control::End.encode());
    records
}

/// The most bytes of a plan the keeper keeps of a server (`Loaded::to_bytes`, in parts). A
/// plan of inputs within their limits is far smaller: every input is at most 16 MiB and a tree
/// at most 16,384 nodes whose paths total 1 MiB, and the server that builds one stays under
/// 100 MiB whole (tests/limits.rs). A server that sends more is broken, whatever it is.
pub const MAX_PLAN: usize = 128 << 20;

/// A payload put back together from its parts ([`records`]), within a bound: past it, the parts
/// kept are dropped and the rest of that payload is ignored, so what a peer sends never grows
/// the reader beyond the bound.
#[derive(Debug)]
pub struct Parts {
    bytes: Vec<u8>,
    limit: usize,
    /// This payload went over the limit: its parts are ignored until [`Control::End`].
    over: bool,
}

impl Parts {
    pub fn new(limit: usize) -> Parts {
        Parts { bytes: Vec::new(), limit, over: false }
    }

    /// Adds a part. `Err` once, the first time the payload goes over the limit, with the error
    /// to log.
    pub fn push(&mut self, part: &[u8]) -> Result<(), HandoverError> {
        if self.over {
            return Ok(());
        }
        if self.bytes.len() + part.len() > self.limit {
            self.over = true;
            self.bytes = Vec::new();
            return Err(HandoverError::TooLarge { limit: self.limit });
        }
        self.bytes.extend_from_slice(part);
        Ok(())
    }

    /// The payload at its [`Control::End`]; `None` if it went over the limit. The next part
    /// starts the next payload.
    pub fn end(&mut self) -> Option<Vec<u8>> {
        let bytes = std::mem::take(&mut self.bytes);
        (!std::mem::take(&mut self.over)).then_some(bytes)
    }
}

/// What a server starts from: nothing (the first server), or the kernel's view and the
/// counters of the servers before it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resume {
    /// The generation the last server served; 0 for the first server.
    pub generation: u64,
    /// Servers replaced since the mount (crashes and upgrades).
    pub handovers: u64,
    pub held: Held,
    /// Whom this server takes over from and how, for its log line: `from server pid 12 (a
    /// crash), 3 requests resent`.
    pub from: String,
    /// The last reload's error, if it was refused: still true of the inputs until a reload
    /// succeeds.
    pub last_error: Option<String>,
    /// The plan the server before served (`Loaded::to_bytes`), at an upgrade: the successor's
    /// log line says what changed.
    pub previous_plan: Option<String>,
    /// Reloads the servers before finished since the mount: the count goes on.
    pub reloads: u64,
    /// The server before rested (nothing failed): the takeover is said at debug level.
    pub woken: bool,
}

/// The resume payload as it travels: [`Resume`], with the node table and the cookies as maps
/// and the previous plan as JSON inside it (not a string of JSON).
#[derive(Serialize, Deserialize)]
struct Payload<'a> {
    protocol: u32,
    generation: u64,
    handovers: u64,
    max_ino: u64,
    from: String,
    last_error: Option<String>,
    #[serde(borrow)]
    previous_plan: Option<&'a RawValue>,
    nodes: Cow<'a, HashMap<u64, HeldNode>>,
    cookies: Cow<'a, BTreeMap<u64, String>>,
    /// Absent from an earlier build's keeper: 0 and false.
    #[serde(default)]
    reloads: u64,
    #[serde(default)]
    woken: bool,
}

impl Resume {
    /// The first server of a mount: numbers its tree afresh.
    pub fn is_first(&self) -> bool {
        self.generation == 0
    }

    /// The payload as the records that carry it, [`Control::End`] last. A previous plan that is
    /// not JSON (it always is: `Loaded::to_bytes`) is left out: the successor's log line then
    /// says less.
    pub fn records(&self) -> Vec<Vec<u8>> {
        let plan = self.previous_plan.as_deref().and_then(|p| serde_json::from_str::<&RawValue>(p).ok());
        let payload = Payload {
            protocol: PROTOCOL,
            generation: self.generation,
            handovers: self.handovers,
            max_ino: self.held.max_ino(),
            from: self.from.clone(),
            last_error: self.last_error.clone(),
            previous_plan: plan,
            nodes: Cow::Borrowed(self.held.nodes()),
            cookies: Cow::Borrowed(self.held.cookies()),
            reloads: self.reloads,
            woken: self.woken,
        };
        // Maps with integer keys and plain data: its JSON cannot fail.
        records(&serde_json::to_vec(&payload).expect("a resume payload serializes"))
    }

    /// The payload put back together from its parts.
    pub fn parse(payload: &[u8]) -> Result<Resume, HandoverError> {
        let p: Payload = serde_json::from_slice(payload).map_err(|e| HandoverError::Payload(e.to_string()))?;
        if p.protocol != PROTOCOL {
            return Err(HandoverError::Payload(format!("keeper protocol {}, not {PROTOCOL}", p.protocol)));
        }
        Ok(Resume {
            generation: p.generation,
            handovers: p.handovers,
            held: Held::from_parts(p.nodes.into_owned(), p.max_ino, p.cookies.into_owned()),
            from: p.from,
            last_error: p.last_error,
            previous_plan: p.previous_plan.map(|plan| plan.get().to_owned()),
            reloads: p.reloads,
            woken: p.woken,
        })
    }
}

/// The state file's fields about the keeper and its servers (the rest is the plan served).
#[derive(Debug, Serialize)]
pub struct StateFields<'a> {
    /// [`PROTOCOL`]: what a tool reading these fields may expect of them.
    pub protocol: u32,
    /// The keeper's (the daemon's) pid.
    pub pid: i32,
    /// The server answering now; none while the mount rests.
    pub server_pid: Option<u32>,
    /// No server runs: nothing was asked of the last one for `--rest-after`, and the next
    /// request or signal starts one.
    pub resting: bool,
    /// Servers replaced since the mount (crashes and upgrades).
    pub handovers: u64,
    pub mountpoint: &'a str,
    pub log_lines_dropped: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keeper::fuse_wire::Attr;

    /// Rule (issue 18): every control message decodes to itself; unknown, truncated and
    /// misplaced ones are errors; `Load` and `Loaded` keep the form every version reads.
    #[test]
    fn control_messages_round_trip() {
        let all = [
            Control::Loaded(PROTOCOL),
            Control::Failed("spec.json: not json".into()),
            Control::Answering,
            Control::Proceed,
            Control::Status { generation: u64::MAX, last_error: None, reloads: 0 },
            Control::Status { generation: 3, last_error: Some("spec.json: bad\n\0".into()), reloads: 12 },
            Control::Notify(Notice::Reloading),
            Control::StateFile(2049, u64::MAX),
            Control::Invalidate(vec![0; 40]),
            Control::Invalidated(-2),
            Control::Part(vec![1, 0, 3]),
            Control::Part(Vec::new()),
            Control::End,
            Control::Load,
            Control::Refused("upgrade refused".into()),
            Control::Stop,
            Control::Retire,
            Control::Rest,
        ];
        for c in all {
            assert_eq!(Control::decode(&c.encode()).unwrap(), c);
        }
        assert_eq!(Control::Loaded(1).encode(), b"L\x01\0\0\0", "frozen since protocol 1");
        assert_eq!(Control::Load.encode(), b"D", "frozen since protocol 1");
        assert_eq!(Control::decode(b"L"), Ok(Control::Loaded(0)), "a build before versions");
        assert_eq!(Control::decode(&[]), Err(HandoverError::Empty));
        assert_eq!(Control::decode(b"L12"), Err(HandoverError::Truncated("Loaded")));
        assert!(matches!(Control::decode(b"Z"), Err(HandoverError::Message(_))));
        assert!(matches!(Control::decode(b"{\"Status\":{\"last_error\":null}}"), Err(HandoverError::Message(_))));
        assert!(matches!(Control::decode(b"{\"StateFile\":[1]}"), Err(HandoverError::Message(_))));
        let earlier = Control::decode(b"{\"Status\":{\"generation\":3,\"last_error\":null}}");
        assert_eq!(earlier, Ok(Control::Status { generation: 3, last_error: None, reloads: 0 }), "an earlier build's");
        assert!(matches!(Control::decode(b"{\"Loaded\":2}"), Err(HandoverError::Message(_))), "only frozen");
        assert_eq!(Control::decode(b"\"Part\""), Err(HandoverError::Truncated("no bytes")));
        assert!(matches!(Control::decode(b"\"End\"\0x"), Err(HandoverError::Message(_))));
        assert!(VERSION.ends_with(&format!("(keeper protocol {PROTOCOL})")), "{VERSION}");
    }

    /// Rule (issue 18): a payload is put back together only within its bound. One part over
    /// it is refused once (the bytes kept are dropped, the rest of the payload ignored, so the
    /// reader never holds more than the bound), and the next payload starts afresh.
    #[test]
    fn parts_are_put_together_within_their_bound() {
        let mut parts = Parts::new(10);
        assert_eq!(parts.push(b"12345"), Ok(()));
        assert_eq!(parts.push(b"67890"), Ok(()));
        assert_eq!(parts.end(), Some(b"1234567890".to_vec()), "exactly the bound is kept");
        assert_eq!(parts.push(b"123456"), Ok(()));
        assert_eq!(parts.push(b"78901"), Err(HandoverError::TooLarge { limit: 10 }));
        assert_eq!(parts.push(&[0; 4]), Ok(()), "refused once per payload");
        assert_eq!(parts.bytes.len(), 0, "nothing is kept of a payload over the bound");
        assert_eq!(parts.end(), None);
        assert_eq!(parts.push(b"ab"), Ok(()));
        assert_eq!(parts.end(), Some(b"ab".to_vec()), "the next payload is read afresh");
        assert_eq!(Parts::new(MAX_PLAN).push(&[0; 1]).map(drop), Ok(()));
        let refused = Parts::new(MAX_PLAN).push(&vec![0; MAX_PLAN + 1]).unwrap_err();
        assert_eq!(refused.to_string(), "sent a plan of more than 128 MiB, the most a keeper keeps");
    }

    /// Rule: a payload larger than a record goes in parts, and comes back whole.
    #[test]
    fn a_large_resume_goes_in_parts_and_comes_back() {
        let attr = Attr { mode: 0o20666, uid: 1, gid: 2, rdev: 0x1234, size: 9, mtime: (3, 4) };
        let nodes: HashMap<u64, HeldNode> = (2..5000)
            .map(|i| {
                let node = HeldNode {
                    parent: 1,
                    name: format!("nvidia{i}-with-a-long-name"),
                    attr: attr.clone(),
                    target: (i % 2 == 0).then(|| format!("/t/{i}")),
                    count: i,
                };
                (i, node)
            })
            .collect();
        let resume = Resume {
            generation: 7,
            handovers: 3,
            held: Held::from_parts(nodes, 9000, (3..4000).map(|c| (c, format!("name{c}"))).collect()),
            from: "from pid 1".into(),
            last_error: Some("x: bad".into()),
            previous_plan: Some("{\"plan\": 1}".into()),
            reloads: 41,
            woken: true,
        };
        let records = resume.records();
        assert!(records.len() > 2 && records.iter().all(|r| r.len() <= MAX_RECORD));
        let mut payload = Vec::new();
        for r in &records[..records.len() - 1] {
            let Control::Part(part) = Control::decode(r).unwrap() else { panic!("not a part") };
            payload.extend(part);
        }
        assert_eq!(Control::decode(records.last().unwrap()).unwrap(), Control::End);
        assert_eq!(Resume::parse(&payload).unwrap(), resume);
        assert!(Resume::parse(&payload[..payload.len() / 2]).is_err());
        assert!(Resume::parse(b"{\"generation\":1}").is_err());
        let other =
            String::from_utf8(payload).unwrap().replacen(&format!("\"protocol\":{PROTOCOL}"), "\"protocol\":9", 1);
        assert_eq!(
            Resume::parse(other.as_bytes()),
            Err(HandoverError::Payload(format!("keeper protocol 9, not {PROTOCOL}"))),
            "a payload of another protocol is never misread"
        );
        // The previous plan travels as JSON inside the payload, not as a string of JSON.
        assert!(other.contains("\"previous_plan\":{\"plan\": 1}"), "{}", &other[..200]);
    }
}
