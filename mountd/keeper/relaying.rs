//! The keeper's relay, on its main thread: `/dev/fuse` and every server's two sockets are
//! polled with the keeper's own events, signals and watch ([`super::Keeper::wait`]); each
//! request read from the kernel goes where the [`Relay`] says, each server's reply back to the
//! kernel, and its control messages become the keeper's events. While a reload's invalidations
//! wait, a thread of their own writes them (each answered synchronously).
//!
//! Issue 31 (threads per container): the kernel's requests and each server's replies had a
//! thread each, every decision taken under a lock they shared. Nothing done here waits: the
//! kernel's requests are read without blocking (`/dev/fuse` is non-blocking), a request a
//! server's full socket does not take waits in its backlog until the socket is writable (the
//! relay has it in flight, so a successor gets it too), and a reply's write to `/dev/fuse`
//! returns at once. What can wait is off this thread: an invalidation's write (the kernel
//! takes a directory's lock for it, which a lookup holds until its reply has passed, and
//! passing it is this thread's), a spawn, a reaping, a large handover.
//!
//! Assumption: every reply a server has written is read and passed before the keeper calls
//! it hung ([`Relaying::pump`] at each hang check); a reply's references are counted before it
//! is written to the kernel.

use super::Ev;
use crate::mountpoint::FSNAME;
use crate::signals::Woken;
use devremap::keeper::control::{Control, MAX_PLAN, Parts};
use devremap::keeper::relay::{FromKernel, FromServer, Relay};
use log::warn;
use nix::errno::Errno;
use nix::mount::MsFlags;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, send, setsockopt, socketpair, sockopt};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One read of `/dev/fuse`: the kernel refuses a buffer smaller than `max_write` plus the
/// headers, and fuser offers a `max_write` of up to 16 MiB. A server's records are read into a
/// buffer as large (a `SOCK_SEQPACKET` read would cut a longer record short without a word).
/// Only the pages a message touches are resident.
const READ_BUFFER: usize = 16 * 1024 * 1024 + 4096;
/// Socket buffers: a record must fit whole (a READDIRPLUS reply is as large as the kernel's
/// buffer), and requests must not wait for a busy server's buffer.
const SOCKET_BUFFER: usize = 4 << 20;
/// Requests read from the kernel at one wake-up before the servers' replies, the signals and
/// the events are looked at again.
const REQUESTS_PER_WAKE: usize = 64;

/// What the keeper shares with its threads: the connection, which the invalidations' writer
/// writes to, and the event queue, which spawners and reapers send to.
pub(super) struct Link {
    pub(super) dev: File,
    pub(super) events: Woken<Ev>,
    /// Invalidations whose write to `/dev/fuse` has not returned, over every server.
    pub(super) invalidating: AtomicUsize,
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

/// Whether a reply from a server waits in its socket, unread.
pub(super) fn replies_waiting(socket: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(socket.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
        && fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLIN))
}

/// What a descriptor the keeper polls is, for [`Relaying::handle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    Kernel,
    /// Server `epoch`'s relay socket.
    Replies(u64),
    /// Server `epoch`'s control socket.
    Control(u64),
}

/// The relay and its reading and writing.
pub(super) struct Relaying {
    pub(super) relay: Relay,
    /// `/dev/fuse` is read: mounted, and not ended.
    kernel_open: bool,
    /// One buffer for the kernel's requests, one for every server's replies (allocated at
    /// their first use; only the pages a message touches become resident).
    request: Vec<u8>,
    reply: Vec<u8>,
    servers: Vec<Server>,
    /// The `(device, inode)` of the last two state files a server said it was renaming into
    /// place, newest last, so that a stop knows them.
    pub(super) state_files: Vec<(u64, u64)>,
    /// When a request, a reply or a server's message last came: `--rest-after` counts from it.
    pub(super) last_traffic: Instant,
}

/// A server's sockets, until both have ended.
struct Server {
    epoch: u64,
    replies: Arc<OwnedFd>,
    control: Arc<OwnedFd>,
    replies_open: bool,
    control_open: bool,
    plan: Parts,
    invalidations: Invalidations,
    /// Requests the relay sent it that its full socket has not taken yet, in order.
    backlog: VecDeque<Vec<u8>>,
}

impl Relaying {
    pub(super) fn new() -> Relaying {
        Relaying {
            relay: Relay::default(),
            kernel_open: false,
            request: Vec::new(),
            reply: Vec::new(),
            servers: Vec::new(),
            state_files: Vec::new(),
            last_traffic: Instant::now(),
        }
    }

    /// The connection is mounted: its requests are read from now on.
    pub(super) fn read_kernel(&mut self) {
        self.kernel_open = true;
    }

    /// Server `epoch`'s sockets are read from now on, until both end ([`Ev::Gone`]).
    pub(super) fn add_server(&mut self, link: &Arc<Link>, epoch: u64, replies: Arc<OwnedFd>, control: Arc<OwnedFd>) {
        let invalidations = Invalidations::new(link.clone(), control.clone());
        self.servers.push(Server {
            epoch,
            replies,
            control,
            replies_open: true,
            control_open: true,
            plan: Parts::new(MAX_PLAN),
            invalidations,
            backlog: VecDeque::new(),
        });
    }

    /// Whether some server's sockets are still read.
    pub(super) fn servers_read(&self) -> bool {
        !self.servers.is_empty()
    }

    /// Whether server `epoch`'s sockets are still read.
    pub(super) fn reads(&self, epoch: u64) -> bool {
        self.servers.iter().any(|s| s.epoch == epoch)
    }

    /// What to poll (the kernel's connection only with `kernel`), and what each is.
    pub(super) fn interest<'a>(&'a self, link: &'a Link, kernel: bool) -> Vec<(BorrowedFd<'a>, PollFlags, Source)> {
        let mut fds = Vec::with_capacity(1 + 2 * self.servers.len());
        if kernel && self.kernel_open {
            fds.push((link.dev.as_fd(), PollFlags::POLLIN, Source::Kernel));
        }
        for s in &self.servers {
            if s.replies_open {
                let out = if s.backlog.is_empty() { PollFlags::empty() } else { PollFlags::POLLOUT };
                fds.push((s.replies.as_fd(), PollFlags::POLLIN | out, Source::Replies(s.epoch)));
            }
            if s.control_open {
                fds.push((s.control.as_fd(), PollFlags::POLLIN, Source::Control(s.epoch)));
            }
        }
        fds
    }

    /// Handles what a poll found ready (`ready`: each source with its `revents`): the servers'
    /// replies and control messages first (a reply frees a waiting process), then the
    /// requests their sockets did not take, then the kernel's new requests. What the keeper's
    /// machine is to hear goes to `queued`; a server whose sockets have both ended is said
    /// [`Ev::Gone`] after every message it sent.
    pub(super) fn handle(&mut self, link: &Link, ready: &[(Source, PollFlags)], queued: &mut VecDeque<Ev>) {
        if !ready.is_empty() {
            self.last_traffic = Instant::now();
        }
        for &(source, flags) in ready {
            match source {
                Source::Replies(epoch) => {
                    if flags.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
                        self.replies_of(link, epoch, queued);
                    }
                    if flags.contains(PollFlags::POLLOUT) {
                        self.servers.iter_mut().filter(|s| s.epoch == epoch).for_each(Server::flush);
                    }
                }
                Source::Control(epoch) => self.control_of(epoch, queued),
                Source::Kernel => {}
            }
        }
        if ready.iter().any(|(source, _)| *source == Source::Kernel) {
            // One clock read a wake: each request's hang-check clock starts at it.
            self.requests(link, self.last_traffic, queued);
        }
        self.servers.retain(|s| {
            let open = s.replies_open || s.control_open;
            if !open {
                s.invalidations.leave();
                queued.push_back(Ev::Gone(s.epoch));
            }
            open
        });
    }

    /// Waits up to `timeout` for the servers' sockets (not the kernel's requests), and handles
    /// what is ready: an upgrade's drain, a hang check and a stop wait for replies alone.
    pub(super) fn pump(&mut self, link: &Link, timeout: Duration, queued: &mut VecDeque<Ev>) {
        let ready = {
            let interest = self.interest(link, false);
            if interest.is_empty() {
                return;
            }
            let mut fds: Vec<PollFd> = interest.iter().map(|(fd, flags, _)| PollFd::new(*fd, *flags)).collect();
            if poll(&mut fds, crate::signals::poll_timeout(timeout)).is_err() {
                return;
            }
            ready_of(&interest, &fds)
        };
        self.handle(link, &ready, queued);
    }

    /// Pumps the servers' sockets ([`Relaying::pump`]) until `done` holds, or no server's
    /// socket is left to read, or `until` passes; whether `done` held. An upgrade's drain and a
    /// stop's wait for the servers' last messages are this one loop.
    pub(super) fn pump_until(
        &mut self,
        link: &Link,
        until: Instant,
        queued: &mut VecDeque<Ev>,
        done: impl Fn(&Relaying) -> bool,
    ) -> bool {
        loop {
            if done(self) {
                return true;
            }
            let now = Instant::now();
            if !self.servers_read() || now >= until {
                return false;
            }
            self.pump(link, until - now, queued);
        }
    }

    /// Reads server `epoch`'s replies, as many as wait (up to [`REQUESTS_PER_WAKE`]), and
    /// passes each on as the relay says.
    fn replies_of(&mut self, link: &Link, epoch: u64, queued: &mut VecDeque<Ev>) {
        let Relaying { relay, reply, servers, .. } = self;
        let Some(server) = servers.iter_mut().find(|s| s.epoch == epoch && s.replies_open) else { return };
        if reply.is_empty() {
            // Zeroed by the allocator's fresh mapping: no page touched until a message is read.
            *reply = vec![0u8; READ_BUFFER];
        }
        for _ in 0..REQUESTS_PER_WAKE {
            let n = match nix::sys::socket::recv(server.replies.as_raw_fd(), reply, MsgFlags::MSG_DONTWAIT) {
                Ok(0) => {
                    server.replies_open = false;
                    return;
                }
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return,
                Err(_) => {
                    server.replies_open = false;
                    return;
                }
            };
            pass_reply(link, relay, epoch, &reply[..n], queued);
        }
    }

    /// Handles one control message of server `epoch`: its invalidations go to its
    /// [`Invalidations`], the plan it serves is put back together from its parts, up to
    /// [`MAX_PLAN`] bytes (one that sends more is reported, `Overrun`, and the rest of that plan
    /// ignored), the rest become the keeper's events.
    fn control_of(&mut self, epoch: u64, queued: &mut VecDeque<Ev>) {
        let Relaying { relay, servers, state_files, .. } = self;
        let Some(server) = servers.iter_mut().find(|s| s.epoch == epoch && s.control_open) else { return };
        let record = match crate::record::read(&server.control) {
            Ok(record) if !record.is_empty() => record,
            _ => {
                server.control_open = false;
                return;
            }
        };
        let message = match Control::decode(&record) {
            Ok(Control::Invalidate(note)) => {
                server.invalidations.push(note);
                return;
            }
            other => other,
        };
        server.invalidations.settle();
        match message {
            Ok(Control::StateFile(dev, ino)) => {
                state_files.push((dev, ino));
                let excess = state_files.len().saturating_sub(2);
                state_files.drain(..excess);
            }
            Ok(Control::Part(part)) => {
                if let Err(why) = server.plan.push(&part) {
                    queued.push_back(Ev::Overrun(epoch, why));
                }
            }
            Ok(Control::End) => {
                if let Some(plan) = server.plan.end() {
                    queued.push_back(Ev::Served(epoch, plan));
                }
            }
            // To the relay as it is read, not queued: what a successor is handed must count
            // every reload its predecessor said it finished (found in CI's way: a retired
            // server's last word, queued behind the takeover, was lost to the successor's
            // `reloads`, and a `ctl reload` read before it waited for a count never reached).
            Ok(Control::Status { generation, last_error, reloads }) => {
                relay.set_status(epoch, generation, last_error, reloads);
            }
            Ok(message) => queued.push_back(Ev::Control(epoch, message)),
            Err(e) => warn!("server {epoch}: {e}"),
        }
    }

    /// Reads the kernel's requests, as many as wait (up to [`REQUESTS_PER_WAKE`]), and sends
    /// each where the relay says.
    fn requests(&mut self, link: &Link, now: Instant, queued: &mut VecDeque<Ev>) {
        let Relaying { relay, kernel_open, request, servers, .. } = self;
        if request.is_empty() {
            *request = vec![0u8; READ_BUFFER];
        }
        for _ in 0..REQUESTS_PER_WAKE {
            let n = match nix::unistd::read(&link.dev, request) {
                Ok(n) => n,
                // Interrupted, or a request the kernel took back before we read it.
                Err(Errno::EINTR | Errno::ENOENT) => continue,
                Err(Errno::EAGAIN) => return,
                Err(e) => {
                    // ENODEV: unmounted; anything else, aborted (ECONNABORTED) or broken.
                    let ended = if e == Errno::ENODEV { Ok(()) } else { Err(e.into()) };
                    *kernel_open = false;
                    queued.push_back(Ev::KernelEnded(ended));
                    return;
                }
            };
            let msg = &request[..n];
            let epoch = match relay.from_kernel(msg, now) {
                Ok(FromKernel::Forward(epoch)) => epoch,
                // Held while the server rests: it wants one (the machine wakes one once).
                Ok(FromKernel::Held) => {
                    if relay.rested() {
                        queued.push_back(Ev::Wanted);
                    }
                    continue;
                }
                Ok(FromKernel::Dropped) => continue,
                Err(e) => {
                    warn!("a request from the kernel that cannot be read: {e}");
                    continue;
                }
            };
            // A server that died: the request stays in flight for its successor.
            if let Some(server) = servers.iter_mut().find(|s| s.epoch == epoch && s.replies_open) {
                server.send(msg);
            }
        }
    }
}

/// Each polled source that woke, with its `revents`.
pub(super) fn ready_of(interest: &[(BorrowedFd, PollFlags, Source)], fds: &[PollFd]) -> Vec<(Source, PollFlags)> {
    interest
        .iter()
        .zip(fds)
        .filter_map(|((_, _, source), fd)| fd.revents().filter(|r| !r.is_empty()).map(|r| (*source, r)))
        .collect()
}

/// Passes one reply of server `epoch` to the kernel as the relay says.
fn pass_reply(link: &Link, relay: &mut Relay, epoch: u64, msg: &[u8], queued: &mut VecDeque<Ev>) {
    match relay.from_server(epoch, msg) {
        Ok(FromServer::ToKernel(added)) => {
            // ENOENT: the kernel no longer waits for it (answered already by a server that
            // died, or interrupted); what it counted is taken back.
            if nix::unistd::write(&link.dev, msg).is_err() && !added.is_empty() {
                relay.undo(&added);
            }
        }
        Ok(FromServer::Probed { epoch, same }) => queued.push_back(Ev::Probed(epoch, same)),
        Ok(FromServer::Stale) => {}
        Err(e) => warn!("server {epoch}: a message that cannot be read: {e}"),
    }
}

/// How a write to a server's socket went.
enum Sent {
    Done,
    Full,
    /// The server is gone (its sockets' end says so).
    Gone,
}

fn send_now(socket: &OwnedFd, msg: &[u8]) -> Sent {
    loop {
        match send(socket.as_raw_fd(), msg, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL) {
            Ok(_) => return Sent::Done,
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => return Sent::Full,
            Err(_) => return Sent::Gone,
        }
    }
}

impl Server {
    /// Writes a request to it without waiting. One its full socket does not take (a hung
    /// server's, until the hang check replaces it, or a busy one's) waits in its backlog, after
    /// those before it, until the socket is writable: the backlog holds only requests the
    /// kernel waits for (and FORGETs), so it is bounded by the kernel's.
    fn send(&mut self, msg: &[u8]) {
        if self.backlog.is_empty() {
            match send_now(&self.replies, msg) {
                Sent::Done | Sent::Gone => return,
                Sent::Full => {}
            }
        }
        self.backlog.push_back(msg.to_vec());
    }

    /// Writes what its socket takes of its backlog.
    fn flush(&mut self) {
        while let Some(msg) = self.backlog.front() {
            match send_now(&self.replies, msg) {
                Sent::Done => drop(self.backlog.pop_front()),
                Sent::Full => return,
                Sent::Gone => return self.backlog.clear(),
            }
        }
    }
}

/// One server's invalidations, written to `/dev/fuse` in order, each answered on its control
/// socket with the write's result, by a thread of their own: not the keeper's main thread,
/// which passes the server's replies, since the kernel takes a directory's lock for an entry's invalidation, and
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
