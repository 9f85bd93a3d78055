//! NRI's two framings, as bytes in and bytes out: the multiplexer that carries two logical
//! connections over the one Unix socket (containerd/nri v0.6.1 `pkg/net/multiplex`), and ttrpc's
//! message frames inside each connection (containerd/ttrpc v1.2, `PROTOCOL.md`), with ttrpc's
//! envelope messages.
//!
//! Assumptions, from the Go code containerd 1.7.24 runs: a mux frame is an 8-byte header (the
//! connection id, then the payload's length, both big-endian u32) and at most 16 MiB of payload;
//! each connection is a byte stream (ttrpc's reader is buffered, so a ttrpc message may span
//! frames, and a frame may hold several). Go's mux hands its reader one whole frame per read and
//! fails one larger than the 4 KiB buffer it reads into, so every frame written here carries at
//! most [`MAX_WRITTEN_PAYLOAD`] bytes. A ttrpc frame is a 10-byte header (length, stream id,
//! both big-endian u32, type, flags) and at most 4 MiB of data.

/// The connection the plugin serves NRI's `Plugin` service on (containerd is the client).
pub const PLUGIN_CONN: u32 = 1;
/// The connection containerd serves NRI's `Runtime` service on (the plugin is the client).
pub const RUNTIME_CONN: u32 = 2;

const MUX_HEADER: usize = 8;
const MAX_MUX_PAYLOAD: usize = 1 << 24;
/// The largest payload of a mux frame written: Go's reader (`bufio`, 4 KiB) takes no more.
pub const MAX_WRITTEN_PAYLOAD: usize = 4096;

const TTRPC_HEADER: usize = 10;
const MAX_TTRPC_DATA: usize = 4 << 20;
/// ttrpc message types.
pub const REQUEST: u8 = 1;
pub const RESPONSE: u8 = 2;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("a mux frame for connection {conn} carries {len} bytes, over the 16 MiB limit")]
    MuxFrameTooLarge { conn: u32, len: usize },
    #[error("a ttrpc message on connection {conn} carries {len} bytes, over the 4 MiB limit")]
    MessageTooLarge { conn: u32, len: usize },
}

/// The mux frames that carry `payload` on connection `conn`.
pub fn mux_frames(conn: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + MUX_HEADER * (payload.len() / MAX_WRITTEN_PAYLOAD + 1));
    for chunk in payload.chunks(MAX_WRITTEN_PAYLOAD) {
        out.extend_from_slice(&conn.to_be_bytes());
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    out
}

/// Bytes received and not yet split off. What is split off moves an offset; the bytes before it
/// go at the next push once they are half of the buffer: splitting N bytes costs O(N) whatever
/// the sizes of what is in them (draining the front at each split was quadratic: one 16 MiB
/// frame of small messages moved the rest of the frame once per message).
#[derive(Debug, Default)]
struct Pending {
    bytes: Vec<u8>,
    start: usize,
}

impl Pending {
    fn push(&mut self, more: &[u8]) {
        if self.start * 2 >= self.bytes.len() {
            self.bytes.drain(..self.start);
            self.start = 0;
        }
        self.bytes.extend_from_slice(more);
    }

    fn unread(&self) -> &[u8] {
        &self.bytes[self.start..]
    }

    /// The `len` bytes after the first `skip` of what is unread, which are split off with them.
    fn split_off(&mut self, skip: usize, len: usize) -> Vec<u8> {
        let out = self.unread()[skip..skip + len].to_vec();
        self.start += skip + len;
        out
    }
}

/// Splits the trunk's bytes into frames, however the reads cut them.
#[derive(Debug, Default)]
pub struct Demux {
    pending: Pending,
}

impl Demux {
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.push(bytes);
    }

    /// The next whole frame (connection id, payload), `None` until one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<(u32, Vec<u8>)>, WireError> {
        let unread = self.pending.unread();
        let Some(header) = unread.get(..MUX_HEADER) else { return Ok(None) };
        let conn = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]) as usize;
        if len > MAX_MUX_PAYLOAD {
            return Err(WireError::MuxFrameTooLarge { conn, len });
        }
        if unread.len() < MUX_HEADER + len {
            return Ok(None);
        }
        Ok(Some((conn, self.pending.split_off(MUX_HEADER, len))))
    }
}

/// A ttrpc message's frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub stream: u32,
    pub kind: u8,
    pub flags: u8,
}

/// A ttrpc message as bytes: its header, then `data`.
pub fn message(header: Header, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(TTRPC_HEADER + data.len());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&header.stream.to_be_bytes());
    out.push(header.kind);
    out.push(header.flags);
    out.extend_from_slice(data);
    out
}

/// Splits one connection's bytes into ttrpc messages.
#[derive(Debug)]
pub struct Messages {
    conn: u32,
    pending: Pending,
}

impl Messages {
    pub fn new(conn: u32) -> Messages {
        Messages { conn, pending: Pending::default() }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.push(bytes);
    }

    /// The next whole message, `None` until one has arrived.
    pub fn next_message(&mut self) -> Result<Option<(Header, Vec<u8>)>, WireError> {
        let unread = self.pending.unread();
        let Some(h) = unread.get(..TTRPC_HEADER) else { return Ok(None) };
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let header = Header { stream: u32::from_be_bytes([h[4], h[5], h[6], h[7]]), kind: h[8], flags: h[9] };
        if len > MAX_TTRPC_DATA {
            return Err(WireError::MessageTooLarge { conn: self.conn, len });
        }
        if unread.len() < TTRPC_HEADER + len {
            return Ok(None);
        }
        Ok(Some((header, self.pending.split_off(TTRPC_HEADER, len))))
    }
}

/// ttrpc's request envelope (`ttrpc.Request`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    #[prost(string, tag = "1")]
    pub service: String,
    #[prost(string, tag = "2")]
    pub method: String,
    #[prost(bytes = "vec", tag = "3")]
    pub payload: Vec<u8>,
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
}

/// ttrpc's response envelope (`ttrpc.Response`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

/// A call's outcome (`google.rpc.Status`): code 0 is success.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Status {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}

/// gRPC status codes used here.
pub const UNKNOWN: i32 = 2;
pub const UNIMPLEMENTED: i32 = 12;
pub const INTERNAL: i32 = 13;

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule (issue 32): a payload over Go's 4 KiB read buffer goes in several frames, each with
    /// the connection id and its own length, big-endian, and the demux puts it back together
    /// however the trunk's reads cut it.
    #[test]
    fn mux_frames_round_trip_in_chunks_go_can_read() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let bytes = mux_frames(PLUGIN_CONN, &payload);
        assert_eq!(&bytes[..8], &[0, 0, 0, 1, 0, 0, 0x10, 0]);
        let mut demux = Demux::default();
        let mut got = Vec::new();
        for byte in &bytes {
            demux.push(std::slice::from_ref(byte));
            while let Some((conn, chunk)) = demux.next_frame().unwrap() {
                assert_eq!(conn, PLUGIN_CONN);
                assert!(chunk.len() <= MAX_WRITTEN_PAYLOAD);
                got.extend(chunk);
            }
        }
        assert_eq!(got, payload);
    }

    /// Rule (issue 32): a frame over the mux's 16 MiB limit is an error, not an allocation.
    #[test]
    fn oversized_frames_are_refused() {
        let mut demux = Demux::default();
        demux.push(&[0, 0, 0, 2, 0x01, 0, 0, 1]);
        assert_eq!(demux.next_frame(), Err(WireError::MuxFrameTooLarge { conn: 2, len: (1 << 24) + 1 }));
        let mut messages = Messages::new(1);
        messages.push(&[0, 0x40, 0, 1, 0, 0, 0, 1, REQUEST, 0]);
        assert_eq!(messages.next_message(), Err(WireError::MessageTooLarge { conn: 1, len: (4 << 20) + 1 }));
    }

    /// Rule (issue 32): ttrpc's header is length, stream id (big-endian u32), type, flags; two
    /// messages in one read come out as two.
    #[test]
    fn ttrpc_messages_split_and_join() {
        let first = message(Header { stream: 3, kind: REQUEST, flags: 0 }, b"abc");
        assert_eq!(&first[..10], &[0, 0, 0, 3, 0, 0, 0, 3, 1, 0]);
        let second = message(Header { stream: 5, kind: RESPONSE, flags: 0 }, b"");
        let mut messages = Messages::new(1);
        messages.push(&[first, second].concat());
        assert_eq!(
            messages.next_message().unwrap(),
            Some((Header { stream: 3, kind: REQUEST, flags: 0 }, b"abc".to_vec()))
        );
        assert_eq!(
            messages.next_message().unwrap(),
            Some((Header { stream: 5, kind: RESPONSE, flags: 0 }, Vec::new()))
        );
        assert_eq!(messages.next_message().unwrap(), None);
    }

    /// Bug (issue 32's note: reassembly was quadratic): 20,000 messages arriving in one read,
    /// then the rest in reads cut anywhere, come out whole and in order; what was split off is
    /// not kept (the buffer holds at most what is unread and one read more), and splitting
    /// moves an offset instead of the rest of the buffer.
    #[test]
    fn many_messages_in_one_read_are_split_in_order_and_not_kept() {
        let all: Vec<u8> = (0..30_000u32)
            .flat_map(|i| message(Header { stream: i, kind: REQUEST, flags: 0 }, &i.to_be_bytes()))
            .collect();
        let (first, rest) = all.split_at(20_000 * 14 + 5);
        let mut messages = Messages::new(1);
        let mut next = 0u32;
        for read in std::iter::once(first).chain(rest.chunks(333)) {
            messages.push(read);
            assert!(messages.pending.bytes.len() <= 2 * (messages.pending.unread().len() + read.len()) + 14);
            while let Some((header, data)) = messages.next_message().unwrap() {
                assert_eq!((header.stream, data), (next, next.to_be_bytes().to_vec()));
                next += 1;
            }
        }
        assert_eq!(next, 30_000);
    }
}
