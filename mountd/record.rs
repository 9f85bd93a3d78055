//! One record of a keeper's `SOCK_SEQPACKET` control socket, read into a buffer of its own size.
//!
//! A record is at most [`MAX_RECORD`] bytes, but nearly all are a few dozen (an invalidation,
//! its answer, a go-ahead). Each read used a zeroed buffer of the largest size: 64 KiB written
//! for every message, on the path of every reload's invalidations, and pages of the heap
//! dirtied in every keeper and server. The record's length is asked of the kernel first
//! (`MSG_PEEK | MSG_TRUNC` gives a datagram's whole length without taking it).
//!
//! Assumption: one thread reads a socket (a record peeked is the record then read).

use devremap::keeper::control::MAX_RECORD;
use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, recv};
use std::os::fd::{AsRawFd, OwnedFd};

/// The next record, empty at EOF (no record is empty). One longer than [`MAX_RECORD`] comes
/// back as its first `MAX_RECORD + 1` bytes, for the decoder to refuse as too long; EINTR is
/// retried.
pub fn read(socket: &OwnedFd) -> nix::Result<Vec<u8>> {
    let fd = socket.as_raw_fd();
    let len = retried(|| recv(fd, &mut [], MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC))?;
    let mut buf = vec![0u8; len.min(MAX_RECORD + 1)];
    let n = retried(|| recv(fd, &mut buf, MsgFlags::empty()))?;
    buf.truncate(n);
    Ok(buf)
}

fn retried(mut call: impl FnMut() -> nix::Result<usize>) -> nix::Result<usize> {
    loop {
        match call() {
            Err(Errno::EINTR) => {}
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap()
    }

    /// Each record comes back whole and alone, in order, at its own size; EOF is empty.
    #[test]
    fn records_come_back_whole_at_their_size() {
        let (a, b) = pair();
        for record in [&b"go"[..], &[7u8; 3000][..], &[1u8; MAX_RECORD][..]] {
            nix::unistd::write(&a, record).unwrap();
            let got = read(&b).unwrap();
            assert_eq!(got, record);
            assert_eq!(got.capacity(), record.len(), "a buffer of the record's size");
        }
        drop(a);
        assert!(read(&b).unwrap().is_empty());
    }

    /// A record over the limit is cut one byte past it, so that the decoder refuses it as
    /// before; the next record is read whole.
    #[test]
    fn an_overlong_record_is_cut_past_the_limit() {
        let (a, b) = pair();
        nix::sys::socket::setsockopt(&a, nix::sys::socket::sockopt::SndBuf, &(4 << 20)).unwrap();
        nix::unistd::write(&a, &vec![2u8; MAX_RECORD + 100]).unwrap();
        nix::unistd::write(&a, b"next").unwrap();
        assert_eq!(read(&b).unwrap().len(), MAX_RECORD + 1);
        assert_eq!(read(&b).unwrap(), b"next");
    }
}
