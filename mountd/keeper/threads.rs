//! The keeper's relay threads and what they share: one reads `/dev/fuse` and forwards each
//! request as the [`Relay`] says; for each server, one reads its replies (and writes them to
//! `/dev/fuse`) and its control messages, and one more, while a reload's invalidations wait,
//! writes them (each answered synchronously); and the socket pairs and the mount they run on.
//!
//! Assumption: every decision is the relay's, taken under `Link::shared`; no write to a server
//! or to the kernel is made under that lock (a full socket would block whoever waits for it).
//! A request is in flight from the moment the relay decides, so one written to a server that is
//! being replaced reaches the successor too; a reply's references are counted before it is
//! written to the kernel.

use super::Ev;
use crate::mountpoint::FSNAME;
use crate::signals::Woken;
use devremap::keeper::control::{Control, MAX_PLAN, Parts};
use devremap::keeper::relay::{FromKernel, FromServer, Relay};
use log::warn;
use nix::errno::Errno;
use nix::mount::MsFlags;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, setsockopt, socketpair, sockopt};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One read of `/dev/fuse`: the kernel refuses a buffer smaller than `max_write` plus the
/// headers, and fuser offers a `max_write` of up to 16 MiB. A server's records are read into a
/// buffer as large (a `SOCK_SEQPACKET` read would cut a longer record short without a word).
/// Only the pages a message touches are resident; the buffers of replies are reused from one
/// server to the next ([`Link::buffers`]), since the allocator may not give such a block back.
const READ_BUFFER: usize = 16 * 1024 * 1024 + 4096;
/// Socket buffers: a record must fit whole (a READDIRPLUS reply is as large as the kernel's
/// buffer), and requests must not wait for a busy server's buffer.
const SOCKET_BUFFER: usize = 4 << 20;

/// What the relay threads share.
pub(super) struct Link {
    pub(super) shared: Mutex<Shared>,
    /// Signalled whenever a server's reply passes, for an upgrade waiting for the old server.
    pub(super) answered: Condvar,
    pub(super) dev: File,
    pub(super) events: Woken<Ev>,
    /// Reply buffers of servers that ended, for the next: a fresh 16 MiB block per handover
    /// grew the keeper by that much each time (glibc served later ones from an arena, zeroing
    /// every page).
    pub(super) buffers: Mutex<Vec<Vec<u8>>>,
    /// The `(device, inode)` of the last two state files a server said it was renaming into
    /// place, newest last: kept by the server's reader thread itself, so that a stop knows them even
    /// with events still queued for the main thread.
    pub(super) state_files: Mutex<Vec<(u64, u64)>>,
    /// Invalidations whose write to `/dev/fuse` has not returned, over every server.
    pub(super) invalidating: AtomicUsize,
    /// Server reader threads alive ([`Readers`]), and their ends.
    pub(super) readers: (Mutex<usize>, Condvar),
}

pub(super) struct Shared {
    pub(super) relay: Relay,
    /// The relay socket of every live server, by epoch.
    pub(super) sockets: HashMap<u64, Arc<OwnedFd>>,
}

/// A `SOCK_SEQPACKET` pair with buffers a record always fits in.
pub(super) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let (a, b) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
    for fd in [&a, &b] {
        // Root may exceed the system's limit; the plain option is capped at it.
        if setsockopt(fd, sockopt::SndBufForce, &SOCKET_BUFFER).is_err() {
            setsockopt(fd, sockopt::SndBuf, &SOCKET_BUFFER)?;
        }
        if setsockopt(fd, sockopt::RcvBufForce, &SOCKET_BUFFER).is_err() {
            setsockopt(fd, sockopt::RcvBuf, &SOCKET_BUFFER)?;
        }
    }
    Ok((a, b))
}

/// Reads `/dev/fuse` and forwards each request as the relay says, until the connection ends.
pub(super) fn relay_requests(link: &Link) {
    let mut buf = vec![0u8; READ_BUFFER];
    loop {
        let n = match nix::unistd::read(&link.dev, &mut buf) {
            Ok(n) => n,
            // Interrupted, or a request the kernel took back before we read it.
            Err(Errno::EINTR | Errno::EAGAIN | Errno::ENOENT) => continue,
            Err(e) => {
                // ENODEV: unmounted; anything else, aborted (ECONNABORTED) or broken.
                let ended = if e == Errno::ENODEV { Ok(()) } else { Err(e.into()) };
                let _ = link.events.send(Ev::KernelEnded(ended));
                break;
            }
        };
        let msg = &buf[..n];
        let target = {
            let mut shared = link.shared.lock();
            match shared.relay.from_kernel(msg, Instant::now()) {
                Ok(FromKernel::Forward(epoch)) => shared.sockets.get(&epoch).cloned(),
                Ok(FromKernel::Held | FromKernel::Dropped) => None,
                Err(e) => {
                    warn!("a request from the kernel that cannot be read: {e}");
                    None
                }
            }
        };
        // Written outside the lock: a hung server's full socket blocks only this thread, and
        // the main thread, which takes the lock to see that it hangs, kills it (the write then
        // fails). A switch between the decision and the write is harmless: the request is in
        // flight, so the successor is sent it too (the old server's answer is dropped), and a
        // FORGET is already in the node table the successor starts from.
        if let Some(socket) = target {
            // A server that died: the request stays in flight for its successor.
            let _ = nix::unistd::write(&*socket, msg);
        }
    }
}

/// Says `Gone` once a server's reader thread has ended: every reply and every control message
/// it sent has been handled by then (a load error is read before the exit it causes). Counted
/// in [`Link::readers`] while it lives.
pub(super) struct Readers {
    epoch: u64,
    link: Arc<Link>,
}

impl Readers {
    pub(super) fn new(epoch: u64, link: &Arc<Link>) -> Readers {
        *link.readers.0.lock() += 1;
        Readers { epoch, link: link.clone() }
    }
}

impl Drop for Readers {
    fn drop(&mut self) {
        let (count, ended) = &self.link.readers;
        *count.lock() -= 1;
        ended.notify_all();
        let _ = self.link.events.send(Ev::Gone(self.epoch));
    }
}

impl Link {
    /// Waits up to `patience` for every server's reader thread to end (each ends once its
    /// server's sockets are shut and what they held is read); whether they all did.
    pub(super) fn readers_end_within(&self, patience: Duration) -> bool {
        let (count, ended) = &self.readers;
        let until = Instant::now() + patience;
        let mut live = count.lock();
        while *live > 0 {
            if ended.wait_until(&mut live, until).timed_out() {
                return *live == 0;
            }
        }
        true
    }
}

/// Whether replies from a server have arrived that the relay has not yet counted: one still in
/// its socket, or one [`read_server`] has read and not yet passed to the relay (`passing`).
/// A server is never called hung while this holds: after the keeper itself was stopped
/// (`SIGSTOP`) or starved of CPU, its main thread can wake before the reply thread, with every
/// answer the server gave meanwhile waiting to be read.
pub(super) fn replies_waiting(socket: &OwnedFd, passing: &AtomicBool) -> bool {
    if passing.load(Ordering::Acquire) {
        return true;
    }
    let mut fds = [PollFd::new(socket.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
        && fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLIN))
}

/// One server's two sockets, as [`read_server`] reads them.
pub(super) struct ServerSockets {
    pub(super) epoch: u64,
    pub(super) relay: Arc<OwnedFd>,
    pub(super) control: Arc<OwnedFd>,
    pub(super) passing: Arc<AtomicBool>,
}

/// Reads server `epoch`'s replies and control messages, on one thread, until it exits: passes
/// each reply on as the relay says, and each control message as [`on_control`] does. `passing`
/// is set from the moment a reply is readable until the relay has it, so that an arrived reply
/// is always seen by [`replies_waiting`]: in the socket, or passing.
///
/// Issue 31 (threads per container): the control socket had a thread of its own, which waited
/// for ever in every keeper for the few messages a reload sends. Nothing handled here waits on
/// anything but this process's locks: an invalidation, whose write can wait for a lookup's
/// reply that only this thread passes, goes to [`Invalidations`]' thread.
pub(super) fn read_server(link: &Arc<Link>, sockets: &ServerSockets, _done: Readers) {
    let ServerSockets { epoch, relay, control, passing } = sockets;
    let mut buf = link.buffers.lock().pop().unwrap_or_else(|| vec![0u8; READ_BUFFER]);
    let mut plan = Parts::new(MAX_PLAN);
    let invalidations = Invalidations::new(link.clone(), control.clone());
    let (mut relay_open, mut control_open) = (true, true);
    while relay_open || control_open {
        let mut fds = [PollFd::new(relay.as_fd(), PollFlags::POLLIN), PollFd::new(control.as_fd(), PollFlags::POLLIN)];
        // A socket at its end is polled no more (it would say so for ever); no allocation on
        // a reply's way.
        let (from, to) = (usize::from(!relay_open), 1 + usize::from(control_open));
        match poll(&mut fds[from..to], PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
        let ready = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
        let (reply, message) = (relay_open && ready(0), control_open && ready(1));
        if reply {
            relay_open = pass_reply(link, *epoch, relay, passing, &mut buf);
        }
        if message {
            control_open = on_control(link, *epoch, control, &mut plan, &invalidations);
        }
    }
    passing.store(false, Ordering::Release);
    link.buffers.lock().push(buf);
    invalidations.leave();
}

/// Reads one reply of server `epoch` and passes it to the kernel as the relay says; false once
/// the socket has ended.
fn pass_reply(link: &Link, epoch: u64, socket: &OwnedFd, passing: &AtomicBool, buf: &mut [u8]) -> bool {
    passing.store(true, Ordering::Release);
    let n = match nix::unistd::read(socket, buf) {
        Ok(0) => return false,
        Ok(n) => n,
        Err(Errno::EINTR | Errno::EAGAIN) => {
            passing.store(false, Ordering::Release);
            return true;
        }
        Err(_) => return false,
    };
    let msg = &buf[..n];
    let action = link.shared.lock().relay.from_server(epoch, msg);
    passing.store(false, Ordering::Release);
    link.answered.notify_all();
    match action {
        Ok(FromServer::ToKernel(added)) => {
            // ENOENT: the kernel no longer waits for it (answered already by a server that
            // died, or interrupted); what it counted is taken back.
            if nix::unistd::write(&link.dev, msg).is_err() && !added.is_empty() {
                link.shared.lock().relay.undo(&added);
            }
        }
        Ok(FromServer::Probed { epoch, same }) => {
            let _ = link.events.send(Ev::Probed(epoch, same));
        }
        Ok(FromServer::Stale) => {}
        Err(e) => warn!("server {epoch}: a message that cannot be read: {e}"),
    }
    true
}

/// Handles one control message of server `epoch`: its invalidations go to `invalidations`, the
/// plan it serves is put back together from its parts, up to [`MAX_PLAN`] bytes (one that
/// sends more is reported, `Overrun`, and the rest of that plan ignored), the rest become the
/// main thread's events. False once the socket has ended (or nobody takes events).
fn on_control(link: &Link, epoch: u64, control: &OwnedFd, plan: &mut Parts, invalidations: &Invalidations) -> bool {
    let record = match crate::record::read(control) {
        Ok(record) if record.is_empty() => return false,
        Ok(record) => record,
        Err(_) => return false,
    };
    let message = match Control::decode(&record) {
        Ok(Control::Invalidate(note)) => {
            invalidations.push(note);
            return true;
        }
        other => other,
    };
    invalidations.settle();
    match message {
        Ok(Control::StateFile(dev, ino)) => {
            let mut known = link.state_files.lock();
            known.push((dev, ino));
            let excess = known.len().saturating_sub(2);
            known.drain(..excess);
        }
        Ok(Control::Part(part)) => {
            if let Err(why) = plan.push(&part) {
                let _ = link.events.send(Ev::Overrun(epoch, why));
            }
        }
        Ok(Control::End) => {
            if let Some(plan) = plan.end() {
                let _ = link.events.send(Ev::Served(epoch, plan));
            }
        }
        Ok(message) => return link.events.send(Ev::Control(epoch, message)),
        Err(e) => warn!("server {epoch}: {e}"),
    }
    true
}

/// One server's invalidations, written to `/dev/fuse` in order, each answered on its control
/// socket with the write's result, by a thread of their own: not the thread that reads the
/// server's replies, since the kernel takes a directory's lock for an entry's invalidation, and
/// a lookup in that directory holds it until its reply has passed. That thread lives only
/// through a reload's invalidations (issue 31's threads per container): the server sends
/// nothing else until it has every answer, so its next message (the reload's status) finds the
/// writer idle, and it is ended and joined then (its stack unmapped).
struct Invalidations {
    link: Arc<Link>,
    control: Arc<OwnedFd>,
    queue: Arc<(Mutex<Queue>, Condvar)>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

#[derive(Default)]
struct Queue {
    notes: std::collections::VecDeque<Vec<u8>>,
    /// The writer holds a note whose write to the kernel has not returned.
    writing: bool,
    /// The writer is to end once no note is left.
    stop: bool,
}

impl Invalidations {
    fn new(link: Arc<Link>, control: Arc<OwnedFd>) -> Invalidations {
        Invalidations { link, control, queue: Arc::default(), writer: Mutex::new(None) }
    }

    /// Queues `note`, starting the writer if none runs. One that cannot start (no thread left
    /// to the process) answers the note with its errno, which the server reports as a name the
    /// kernel may still cache.
    fn push(&self, note: Vec<u8>) {
        let (queue, wake) = &*self.queue;
        queue.lock().notes.push_back(note);
        let mut writer = self.writer.lock();
        if writer.is_some() {
            wake.notify_one();
            return;
        }
        let (link, control, shared) = (self.link.clone(), self.control.clone(), self.queue.clone());
        match std::thread::Builder::new().name("invalidate".into()).spawn(move || write_all(&link, &control, &shared)) {
            Ok(started) => *writer = Some(started),
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(libc::EAGAIN);
                for _ in queue.lock().notes.drain(..) {
                    let _ = nix::unistd::write(&*self.control, &Control::Invalidated(errno).encode());
                }
            }
        }
    }

    /// The server sent something else: its invalidations are answered, and an idle writer is
    /// ended and joined. One still writing (a server that did not wait for its answers) is left
    /// to the next message: joining it here could wait for a reply only this thread passes.
    fn settle(&self) {
        let mut writer = self.writer.lock();
        if writer.is_none() {
            return;
        }
        let (queue, wake) = &*self.queue;
        {
            let mut queue = queue.lock();
            if !queue.notes.is_empty() || queue.writing {
                return;
            }
            queue.stop = true;
        }
        wake.notify_one();
        if let Some(idle) = writer.take() {
            let _ = idle.join();
        }
        queue.lock().stop = false;
    }

    /// The server is gone: the writer is joined if idle; one still waiting on the kernel ends
    /// by itself once its write returns (its answers then go nowhere).
    fn leave(&self) {
        self.settle();
        self.queue.0.lock().stop = true;
        self.queue.1.notify_one();
    }
}

/// The writer: each queued note, in order, waiting for more until told to stop.
fn write_all(link: &Link, control: &OwnedFd, shared: &(Mutex<Queue>, Condvar)) {
    let (queue, wake) = shared;
    loop {
        let note = {
            let mut queue = queue.lock();
            while queue.notes.is_empty() && !queue.stop {
                wake.wait(&mut queue);
            }
            let Some(note) = queue.notes.pop_front() else { return };
            queue.writing = true;
            note
        };
        link.invalidating.fetch_add(1, Ordering::AcqRel);
        let errno = nix::unistd::write(&link.dev, &note).map_or_else(|e| e as i32, |_| 0);
        link.invalidating.fetch_sub(1, Ordering::AcqRel);
        // Not writing before the answer goes: the server's next message, sent once it has the
        // answer, must find the writer idle.
        queue.lock().writing = false;
        let _ = nix::unistd::write(control, &Control::Invalidated(errno).encode());
    }
}

/// Mounts the FUSE connection `dev` at `mountpoint`, as fuser would with the options the
/// daemon always used: `dev` (device nodes open devices), `nosuid`, `noexec`, `noatime`, the
/// kernel checking permissions, and every user allowed (the container's users).
pub(super) fn mount(dev: &File, mountpoint: &Path) -> nix::Result<()> {
    let data = format!("fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other", dev.as_raw_fd());
    nix::mount::mount(
        Some(FSNAME),
        mountpoint,
        Some("fuse"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NOATIME,
        Some(data.as_str()),
    )
}
