//! What the keeper and its server say to each other outside the FUSE traffic, over the
//! control socket (a `SOCK_SEQPACKET` pair: one record is one message), and the resume payload:
//! the kernel's node table and the counters a server takes over.
//!
//! Assumptions: both ends are the same program, or an upgrade of it that speaks this
//! encoding (a tag byte, then the message); a record is at most [`MAX_RECORD`] bytes, so the
//! resume payload, which grows with the nodes the kernel holds, goes in parts. A message that
//! does not decode is an error naming what was wrong: a server refuses to start on it.

use crate::keeper::fuse_wire::Attr;
use crate::keeper::kernel_nodes::{Held, HeldNode};
use crate::served::lifecycle::Notice;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use thiserror::Error;

/// The version of what the keeper and its servers say to each other (the control messages and
/// the resume payload). A server says it with `Loaded`; an upgrade to a binary that speaks
/// another is refused, never misread. Raise it with any change to either encoding.
pub const PROTOCOL: u32 = 1;

/// `devremapd --version`: the package's version and [`PROTOCOL`] (checked equal by a test).
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (keeper protocol 1)");

/// The largest control record: well under a socket's default buffer.
pub const MAX_RECORD: usize = 64 * 1024;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum HandoverError {
    #[error("an empty control message")]
    Empty,
    #[error("an unknown control message (tag {0:#04x})")]
    Tag(u8),
    #[error("a truncated control message (tag {0:?})")]
    Truncated(char),
    #[error("a resume payload that is not valid: {0}")]
    Payload(String),
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Server to keeper: the inputs loaded, and the [`PROTOCOL`] it speaks; send the INIT. (A
    /// build before protocol versions sent no version: it decodes as 0.)
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
    },
    /// Server to keeper: the state file about to be renamed into place is this `(device,
    /// inode)`: at stop, the keeper removes the file at `--state-file` only if it is one its
    /// servers wrote (the last two told: the rename of the last may not have happened).
    StateFile(u64, u64),
    /// Server to keeper: tell the service manager (only the keeper, the main process, may).
    Notify(Notice),
    /// Server to keeper: write this notification (an invalidation) to `/dev/fuse`, then answer
    /// [`Control::Invalidated`] with the write's errno (0: done; ENOENT: nothing was cached).
    Invalidate(Vec<u8>),
    Invalidated(i32),
    /// A part of a payload larger than a record ([`records`]); [`Control::End`] ends it. From
    /// the keeper: the plan to serve (instead of [`Control::Load`]), then the [`Resume`]; from
    /// the server: the plan it serves, after each generation (`Loaded::to_bytes`).
    Part(Vec<u8>),
    End,
    /// Keeper to server, first: load the inputs (rather than serve the plan that follows).
    Load,
    /// Keeper to server: an upgrade failed; record it as the last error.
    Refused(String),
    /// Keeper to server: the daemon stops: remove the state file and exit.
    Stop,
    /// Keeper to server: another server takes over: exit without writing anything more (the
    /// state file is the successor's).
    Retire,
}

impl Control {
    pub fn encode(&self) -> Vec<u8> {
        let (tag, body): (u8, &[u8]) = match self {
            Control::Loaded(protocol) => return [&[b'L'][..], &protocol.to_le_bytes()].concat(),
            Control::Failed(text) => (b'F', text.as_bytes()),
            Control::Answering => (b'A', &[]),
            Control::Proceed => (b'O', &[]),
            Control::Status { generation, last_error } => {
                let error = last_error.as_deref().map_or(&b""[..], str::as_bytes);
                return [&[b'G'][..], &generation.to_le_bytes(), &[u8::from(last_error.is_some())], error].concat();
            }
            Control::Notify(n) => {
                let n = match n {
                    Notice::Ready => b'r',
                    Notice::Reloading => b'l',
                    Notice::Stopping => b's',
                };
                return vec![b'N', n];
            }
            Control::StateFile(dev, ino) => return [&[b'W'][..], &dev.to_le_bytes(), &ino.to_le_bytes()].concat(),
            Control::Invalidate(msg) => (b'I', msg),
            Control::Invalidated(errno) => return [&[b'i'][..], &errno.to_le_bytes()].concat(),
            Control::Part(part) => (b'P', part),
            Control::End => (b'E', &[]),
            Control::Load => (b'D', &[]),
            Control::Refused(text) => (b'R', text.as_bytes()),
            Control::Stop => (b'S', &[]),
            Control::Retire => (b'X', &[]),
        };
        [&[tag][..], body].concat()
    }

    pub fn decode(record: &[u8]) -> Result<Control, HandoverError> {
        let (&tag, body) = record.split_first().ok_or(HandoverError::Empty)?;
        let text = || String::from_utf8_lossy(body).into_owned();
        Ok(match tag {
            b'L' if body.is_empty() => Control::Loaded(0),
            b'L' => Control::Loaded(u32::from_le_bytes(body.try_into().map_err(|_| HandoverError::Truncated('L'))?)),
            b'F' => Control::Failed(text()),
            b'A' => Control::Answering,
            b'O' => Control::Proceed,
            b'G' => {
                let (generation, rest) = body.split_first_chunk::<8>().ok_or(HandoverError::Truncated('G'))?;
                let (&has_error, error) = rest.split_first().ok_or(HandoverError::Truncated('G'))?;
                Control::Status {
                    generation: u64::from_le_bytes(*generation),
                    last_error: (has_error != 0).then(|| String::from_utf8_lossy(error).into_owned()),
                }
            }
            b'N' => Control::Notify(match body {
                b"r" => Notice::Ready,
                b"l" => Notice::Reloading,
                b"s" => Notice::Stopping,
                _ => return Err(HandoverError::Truncated('N')),
            }),
            b'W' => {
                let (dev, ino) = body.split_first_chunk::<8>().ok_or(HandoverError::Truncated('W'))?;
                let ino: [u8; 8] = ino.try_into().map_err(|_| HandoverError::Truncated('W'))?;
                Control::StateFile(u64::from_le_bytes(*dev), u64::from_le_bytes(ino))
            }
            b'I' => Control::Invalidate(body.to_vec()),
            b'i' => {
                Control::Invalidated(i32::from_le_bytes(body.try_into().map_err(|_| HandoverError::Truncated('i'))?))
            }
            b'P' => Control::Part(body.to_vec()),
            b'E' => Control::End,
            b'D' => Control::Load,
            b'R' => Control::Refused(text()),
            b'S' => Control::Stop,
            b'X' => Control::Retire,
            other => return Err(HandoverError::Tag(other)),
        })
    }
}

/// A payload as the records that carry it: parts of at most [`MAX_RECORD`] bytes, then
/// [`Control::End`].
pub fn records(payload: &[u8]) -> Vec<Vec<u8>> {
    let mut records: Vec<Vec<u8>> =
        payload.chunks(MAX_RECORD - 1).map(|part| Control::Part(part.to_vec()).encode()).collect();
    records.push(Control::End.encode());
    records
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
}

impl Resume {
    /// The first server of a mount: numbers its tree afresh.
    pub fn is_first(&self) -> bool {
        self.generation == 0
    }

    /// The payload as the records that carry it, [`Control::End`] last.
    pub fn records(&self) -> Vec<Vec<u8>> {
        let nodes: Vec<Value> = self
            .held
            .nodes()
            .iter()
            .map(|(ino, n)| {
                let a = &n.attr;
                json!([
                    ino, n.parent, n.name, a.mode, a.uid, a.gid, a.rdev, a.size, a.mtime.0, a.mtime.1, n.target,
                    n.count
                ])
            })
            .collect();
        let payload = json!({
            "generation": self.generation,
            "handovers": self.handovers,
            "max_ino": self.held.max_ino(),
            "from": self.from,
            "last_error": self.last_error,
            "previous_plan": self.previous_plan,
            "nodes": nodes,
            "cookies": self.held.cookies().iter().map(|(c, name)| json!([c, name])).collect::<Vec<Value>>(),
        })
        .to_string();
        records(payload.as_bytes())
    }

    /// The payload put back together from its parts.
    pub fn parse(payload: &[u8]) -> Result<Resume, HandoverError> {
        let bad = |what: &str| HandoverError::Payload(what.to_owned());
        let v: Value = serde_json::from_slice(payload).map_err(|e| HandoverError::Payload(e.to_string()))?;
        let num = |key: &str| v.get(key).and_then(Value::as_u64).ok_or_else(|| bad(key));
        let mut nodes = HashMap::new();
        for row in v.get("nodes").and_then(Value::as_array).ok_or_else(|| bad("nodes"))? {
            let row = row.as_array().filter(|r| r.len() == 12).ok_or_else(|| bad("a node row"))?;
            let n = |i: usize| row[i].as_u64().ok_or_else(|| bad("a node row's number"));
            let n32 = |i: usize| n(i).and_then(|x| u32::try_from(x).map_err(|_| bad("a node row's number")));
            let node = HeldNode {
                parent: n(1)?,
                name: row[2].as_str().ok_or_else(|| bad("a node's name"))?.to_owned(),
                attr: Attr {
                    mode: n32(3)?,
                    uid: n32(4)?,
                    gid: n32(5)?,
                    rdev: n32(6)?,
                    size: n(7)?,
                    mtime: (n(8)?, n32(9)?),
                },
                target: row[10].as_str().map(str::to_owned),
                count: n(11)?,
            };
            nodes.insert(n(0)?, node);
        }
        let mut cookies = BTreeMap::new();
        for row in v.get("cookies").and_then(Value::as_array).ok_or_else(|| bad("cookies"))? {
            let cookie = row.get(0).and_then(Value::as_u64).ok_or_else(|| bad("a cookie"))?;
            let name = row.get(1).and_then(Value::as_str).ok_or_else(|| bad("a cookie's name"))?;
            cookies.insert(cookie, name.to_owned());
        }
        Ok(Resume {
            generation: num("generation")?,
            handovers: num("handovers")?,
            held: Held::from_parts(nodes, num("max_ino")?, cookies),
            from: v.get("from").and_then(Value::as_str).ok_or_else(|| bad("from"))?.to_owned(),
            last_error: v.get("last_error").and_then(Value::as_str).map(str::to_owned),
            previous_plan: v.get("previous_plan").and_then(Value::as_str).map(str::to_owned),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: every control message decodes to itself; unknown and truncated ones are errors.
    #[test]
    fn control_messages_round_trip() {
        let all = [
            Control::Loaded(PROTOCOL),
            Control::Failed("spec.json: not json".into()),
            Control::Answering,
            Control::Proceed,
            Control::Status { generation: u64::MAX, last_error: None },
            Control::Status { generation: 3, last_error: Some("spec.json: bad".into()) },
            Control::Notify(Notice::Reloading),
            Control::StateFile(2049, u64::MAX),
            Control::Invalidate(vec![9; 40]),
            Control::Invalidated(-2),
            Control::Part(vec![1, 2, 3]),
            Control::End,
            Control::Load,
            Control::Refused("upgrade refused".into()),
            Control::Stop,
            Control::Retire,
        ];
        for c in all {
            assert_eq!(Control::decode(&c.encode()).unwrap(), c);
        }
        assert_eq!(Control::decode(&[]), Err(HandoverError::Empty));
        assert_eq!(Control::decode(b"Z"), Err(HandoverError::Tag(b'Z')));
        assert_eq!(Control::decode(b"G123"), Err(HandoverError::Truncated('G')));
        assert_eq!(Control::decode(b"L"), Ok(Control::Loaded(0)), "a build before versions");
        assert_eq!(Control::decode(b"L12"), Err(HandoverError::Truncated('L')));
        assert!(VERSION.ends_with(&format!("(keeper protocol {PROTOCOL})")), "{VERSION}");
        assert_eq!(Control::decode(b"W12345678123"), Err(HandoverError::Truncated('W')));
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
    }
}
