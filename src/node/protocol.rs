//! The node daemon's protocol: one request per connection, one JSON object on one line, and one
//! answer, also one line. Every request and answer carries `protocol`, [`PROTOCOL`]; a daemon
//! refuses a request of another version, and a client an answer of another, each naming both
//! versions, so that a wrapper of one release never misreads the daemon of another (an upgrade
//! replaces them at different times: a running daemon answers wrappers installed after it).

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The version of this protocol; both sides check it.
pub const PROTOCOL: u32 = 1;
/// The longest request line a daemon reads, in bytes (a `mount` request names a few paths and
/// flags).
pub const MAX_LINE: usize = 1 << 20;
/// The longest answer line a client reads (a `list` of thousands of containers).
pub const MAX_ANSWER: usize = 64 << 20;
/// The most JSON values a request holds (a `mount` request has about 20): a line's memory once
/// parsed grows with its values, tens of bytes each, not with its length.
pub const MAX_REQUEST_VALUES: usize = 4096;
/// The refusal of a daemon with every place for a request taken: nothing was done, and the
/// client may ask again.
pub const BUSY: &str = "busy: too many requests at once; ask again";
/// A daemon asked to make way while it sets a container up: it finishes that first.
pub const SETTING_UP: &str = "busy: a container is being set up; ask again";

/// Why a line is not a request or an answer of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error(
        "speaks node protocol {theirs}, this build {PROTOCOL}; refused (upgrade devremap-runtime and devremapd together)"
    )]
    Version { theirs: u32 },
    #[error("not a node protocol message: {0}")]
    Malformed(String),
    #[error("a message of more than {0} bytes; refused")]
    TooLong(usize),
    /// A request this build cannot send (a path holding a character that stands for a byte).
    #[error("cannot send the request: {0}")]
    Unsendable(String),
}

/// What a client asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Whether the daemon answers, and what it is.
    Hello,
    /// Start serving container `id`'s `/dev` at `<state_dir>/<id>/dev`; answered once the mount
    /// answers (or with why not).
    Mount(MountRequest),
    /// Stop serving container `id` and remove its directory, answered once done.
    Unmount { id: String },
    /// Every container served, one [`Entry`] a line after the answer.
    List,
    /// Reload container `id`, or every container, each on its own; answered once each reload
    /// has finished (applied or refused: the entries say which).
    Reload { id: Option<String> },
    /// Container `id`'s entry and its daemon's state file.
    Status { id: String },
    /// A detached copy of container `id`'s mount (`open_tree(OPEN_TREE_CLONE)`), handed over
    /// with the answer (`SCM_RIGHTS`): for a client in a mount namespace the daemon's mounts do
    /// not reach (Podman's, for a user-namespace container), which moves it onto the
    /// container's mountpoint in its own (`move_mount`). A daemon of an earlier build refuses
    /// it as a line it cannot read, and the client says why it cannot go on.
    Attach { id: String },
    /// From a node daemon started as a service to one a wrapper started on the same state dir:
    /// make way (stop taking requests and exit; the keepers serve on, and the service adopts
    /// them). A service refuses.
    Yield,
    /// Test builds only (`test-hooks`, never the shipped binary): the node daemon calls its NRI
    /// handler as the NRI transport would, for `event` (`create`, `started`, `stopped`, `removed`: one
    /// container; `synchronize`: all, in the one pod), with the runtime config at `config` (the
    /// first event's: one handler serves the daemon's life, as with the transport);
    /// `create` answers the adjustment. Pods and containers are `devremap::nri::view`'s, in JSON.
    #[cfg(feature = "test-hooks")]
    NriEvent {
        #[serde(default)]
        config: Option<PathBuf>,
        event: String,
        pod: serde_json::Value,
        containers: Vec<serde_json::Value>,
    },
}

/// What `mount` names: the container and what its daemon is started with (the flags of
/// `devremapd mount`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountRequest {
    pub id: String,
    /// The state dir the client put the container's directory in: it must be the daemon's.
    #[serde(with = "os_path")]
    pub state_dir: PathBuf,
    #[serde(with = "os_path")]
    pub spec: PathBuf,
    #[serde(with = "os_path_opt")]
    pub host_dev: Option<PathBuf>,
    #[serde(with = "os_path")]
    pub host_root: PathBuf,
    #[serde(with = "os_path_opt")]
    pub metadata: Option<PathBuf>,
    /// More flags of `devremapd mount` (`--relax`, `--device-map`, `--prefer`).
    pub extra: Vec<String>,
    /// The runtime's pid file of the container's init: its exit ends the mount. A path that is
    /// not UTF-8 is the caller's to give (issue 17.8): paths travel as [`crate::runtime::osarg`]
    /// encodes them.
    #[serde(with = "os_path")]
    pub container_pid_file: PathBuf,
    /// The process that will start the container (the wrapper, which becomes the runtime): if
    /// it exits before the pid file appears, no one will, and the mount ends.
    pub owner_pid: u32,
    /// No process to watch: the mount lasts until `unmount` (the NRI plugin's containers, whose
    /// init is not known at `CreateContainer`: torn down at `StopContainer`/`RemoveContainer`),
    /// and `container_pid_file` and `owner_pid` are not used. Optional, and left out when
    /// false: a request of protocol 1 without it reads as before (issue 32).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub until_unmount: bool,
}

/// One container as the daemon serves it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub id: String,
    pub mountpoint: PathBuf,
    pub state_file: PathBuf,
    /// The state file's `last_error`: why the last reload or upgrade was refused, if it was.
    pub last_error: Option<String>,
    /// The state file's `generation`, `None` until it is written.
    pub generation: Option<u64>,
    /// The container's keeper (it holds the FUSE connection).
    pub pid: u32,
    /// The server answering now; none while the container's `/dev` rests.
    pub server_pid: Option<u32>,
    /// The state file's `resting`: no server runs (nothing was asked of the last one for
    /// `--rest-after`); the next request or reload starts one. Absent from a daemon before it.
    #[serde(default)]
    pub resting: bool,
}

/// The daemon's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub protocol: u32,
    /// `None` when the request was done.
    pub error: Option<String>,
    /// The daemon's pid and version (`hello`), the entries (`list`, `reload`), or the entry and
    /// state file (`status`).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
}

impl Answer {
    pub fn done(data: serde_json::Value) -> Answer {
        Answer { protocol: PROTOCOL, error: None, data }
    }

    pub fn refused(why: impl Into<String>) -> Answer {
        Answer { protocol: PROTOCOL, error: Some(why.into()), data: serde_json::Value::Null }
    }
}

#[derive(Serialize, Deserialize)]
struct Envelope<T> {
    protocol: u32,
    #[serde(flatten)]
    body: T,
}

/// Paths as [`osarg`] encodes them: every byte carried, UTF-8 or not.
mod os_path {
    use crate::runtime::osarg;
    use serde::{Deserialize, Deserializer, Serializer, ser::Error};
    use std::path::{Path, PathBuf};

    pub fn serialize<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        match osarg::encode(path.as_os_str()) {
            Some(text) => s.serialize_str(&text),
            None => Err(S::Error::custom(format!("{}: a path the node protocol cannot carry", path.display()))),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        Ok(PathBuf::from(osarg::decode(&String::deserialize(d)?)))
    }
}

mod os_path_opt {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::path::PathBuf;

    pub fn serialize<S: Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
        match path {
            Some(p) => super::os_path::serialize(p, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.map(|t| PathBuf::from(crate::runtime::osarg::decode(&t))))
    }
}

/// The line a client sends.
pub fn request_line(request: &Request) -> Result<String, ProtocolError> {
    let mut line = serde_json::to_string(&Envelope { protocol: PROTOCOL, body: request })
        .map_err(|e| ProtocolError::Unsendable(e.to_string()))?;
    line.push('\n');
    Ok(line)
}

/// The version a message says it speaks, read before anything else: a message of another
/// version is refused by its number, not by what its fields fail to be.
fn version_of(line: &[u8], max: usize, max_values: usize) -> Result<serde_json::Value, ProtocolError> {
    if line.len() > max {
        return Err(ProtocolError::TooLong(max));
    }
    crate::inputs::limits::check_json_values(line, max_values).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_slice(line).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    match value.get("protocol").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(PROTOCOL) => Ok(value),
        Some(v) => Err(ProtocolError::Version { theirs: u32::try_from(v).unwrap_or(u32::MAX) }),
        None => Err(ProtocolError::Malformed("no protocol version".into())),
    }
}

/// A request line, as the daemon reads it.
pub fn parse_request(line: &[u8]) -> Result<Request, ProtocolError> {
    let value = version_of(line, MAX_LINE, request_values(line))?;
    let envelope: Envelope<Request> =
        serde_json::from_value(value).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    Ok(envelope.body)
}

/// The most values request `line` may hold: [`MAX_REQUEST_VALUES`], but for test builds' NRI
/// events (`Request::NriEvent`, a synchronize of thousands of containers), which the NRI
/// transport carries in a shipped build, and which keep the inputs' limit. The `op` is read
/// alone, every other value skipped unkept.
fn request_values(line: &[u8]) -> usize {
    #[cfg(feature = "test-hooks")]
    {
        #[derive(Deserialize)]
        struct Op {
            op: String,
        }
        if serde_json::from_slice::<Op>(line).is_ok_and(|o| o.op == "nri-event") {
            return crate::inputs::limits::MAX_JSON_VALUES;
        }
    }
    let _ = line;
    MAX_REQUEST_VALUES
}

/// An answer line, as a client reads it.
pub fn parse_answer(line: &[u8]) -> Result<Answer, ProtocolError> {
    let value = version_of(line, MAX_ANSWER, crate::inputs::limits::MAX_JSON_VALUES)?;
    serde_json::from_value(value).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// The line the daemon sends.
pub fn answer_line(answer: &Answer) -> String {
    let mut line = serde_json::to_string(answer).expect("an answer always serializes");
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    /// Rule (issue 31): every request travels as one line a daemon of the same protocol reads
    /// back unchanged.
    #[test]
    fn requests_read_back() {
        let mount = Request::Mount(MountRequest {
            id: "ctr1".into(),
            state_dir: "/run/devremap".into(),
            spec: "/run/devremap/ctr1/bundle/config.json".into(),
            host_dev: None,
            host_root: "/".into(),
            metadata: Some("/run/devremap/ctr1/restore/devremap-gpus.json".into()),
            extra: vec!["--relax".into(), "driver".into()],
            container_pid_file: "/run/devremap/ctr1/container.pid".into(),
            owner_pid: 42,
            until_unmount: false,
        });
        let mut odd = match &mount {
            Request::Mount(m) => m.clone(),
            _ => unreachable!(),
        };
        odd.container_pid_file = PathBuf::from(std::ffi::OsString::from_vec(b"/run/pid-\xff\x80".to_vec()));
        for request in [
            Request::Hello,
            mount,
            Request::Mount(odd),
            Request::List,
            Request::Reload { id: None },
            Request::Status { id: "a".into() },
            Request::Attach { id: "a".into() },
            Request::Yield,
        ] {
            let line = request_line(&request).unwrap();
            assert!(line.ends_with('\n') && !line.trim_end().contains('\n'));
            assert_eq!(parse_request(line.as_bytes()).unwrap(), request);
        }
    }

    /// Rule (issue 32): `until_unmount` is optional: a mount line without it (every client of
    /// protocol 1 before it) reads as false, and a false one is written as before.
    #[test]
    fn until_unmount_is_optional() {
        let line = r#"{"protocol":1,"op":"mount","id":"c","state_dir":"/s","spec":"/s/c/x.json","host_dev":null,"host_root":"/","metadata":null,"extra":[],"container_pid_file":"/p","owner_pid":1}"#;
        let Request::Mount(mut m) = parse_request(line.as_bytes()).unwrap() else { panic!("not a mount") };
        assert!(!m.until_unmount);
        assert_eq!(request_line(&Request::Mount(m.clone())).unwrap().trim_end(), line);
        m.until_unmount = true;
        assert!(request_line(&Request::Mount(m)).unwrap().contains(r#""until_unmount":true"#));
    }

    /// Rule (issue 31): both sides check the version; another one is refused naming both.
    #[test]
    fn another_version_is_refused_by_its_number() {
        let e = parse_request(br#"{"protocol":2,"op":"teleport"}"#).unwrap_err();
        assert_eq!(e, ProtocolError::Version { theirs: 2 });
        assert!(e.to_string().contains("protocol 2, this build 1"), "{e}");
        let e = parse_answer(br#"{"protocol":7,"error":null}"#).unwrap_err();
        assert_eq!(e, ProtocolError::Version { theirs: 7 });
    }

    /// Rule (issue 31): a line that is not ours is refused, never half-read.
    #[test]
    fn bad_lines_are_refused() {
        for line in [&b"{"[..], b"[]", br#"{"op":"list"}"#, br#"{"protocol":1,"op":"format-disk"}"#, b"\xff"] {
            assert!(parse_request(line).is_err(), "{}", String::from_utf8_lossy(line));
        }
        assert_eq!(parse_request(&vec![b' '; MAX_LINE + 1]), Err(ProtocolError::TooLong(MAX_LINE)));
    }

    /// Bug (found from outside): a request line's values were all parsed before its fields
    /// were looked at, tens of bytes each: a 1 MiB `hello` carrying `"x":[0,0,...]` took 54 MB,
    /// and 40 at once 1.4 GB. A request of more than [`MAX_REQUEST_VALUES`] values is refused
    /// before it is parsed; one within them reads as before.
    #[test]
    fn a_request_of_too_many_values_is_refused_unparsed() {
        let values = |n: usize| format!(r#"{{"protocol":1,"op":"hello","x":[{}]}}"#, vec!["0"; n].join(","));
        assert_eq!(parse_request(values(100).as_bytes()), Ok(Request::Hello));
        let e = parse_request(values(MAX_REQUEST_VALUES).as_bytes()).unwrap_err();
        assert!(e.to_string().contains(&format!("more than {MAX_REQUEST_VALUES} JSON values")), "{e}");
    }

    /// Rule (issue 31): an answer reads back, with its data or its error.
    #[test]
    fn answers_read_back() {
        for answer in [Answer::done(serde_json::json!({"pid": 7})), Answer::refused("no such container: x")] {
            assert_eq!(parse_answer(answer_line(&answer).as_bytes()).unwrap(), answer);
        }
    }
}
