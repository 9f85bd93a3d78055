//! `devremapd serve`: the server, which the keeper (`devremapd mount`, [`crate::keeper`])
//! starts and restarts. It loads the inputs, builds the `Devfs`, and runs its FUSE session
//! ([`crate::session`]) on the socket the keeper relays `/dev/fuse` through (fd 3); it talks
//! to the keeper about everything else over the control socket (fd 4). Reloads happen here
//! (the library's [`Lifecycle`]), so a bad input, a stuck input or a panic can never take the
//! FUSE connection with it: the keeper holds that.
//!
//! Order of a start: load the inputs, or take the plan the keeper hands over (after a crash: the
//! dead server's, so a crash restart serves what was served and reads no input file), say `Loaded`
//! (a failure is sent to the keeper, which reports it),
//! answer the INIT the keeper sends (the kernel's, or its replay), read the resume payload
//! (the kernel's node table when taking over), and only then serve requests, once the node
//! ids are the kernel's. Readiness (the state file, `READY=1` through the keeper) is declared
//! once the mount answers through us.
//!
//! Threads (issue 31: a container's server costs as few as can be): one, with `--threads 1`
//! (the node daemon's default). The main thread runs the lifecycle ([`serve`]), beside the
//! signals and the control socket, and answers the kernel whenever it waits (an invalidation
//! waits for the kernel, which may wait for a lookup only we answer); with `--threads N` (N > 1,
//! `devremapd mount`'s default 2), N threads of their own answer instead. A reload loads on a
//! thread of its own, and readiness is asked of the mount by one that ends.
//!
//! Assumptions: started by the keeper with fds 3 and 4 its `SOCK_SEQPACKET` sockets (checked:
//! run by hand, it refuses); the keeper is its parent for its whole life (the state file's
//! `pid` is the parent's pid). The session ends when the keeper closes the socket: the daemon
//! stopped (the keeper says `Stop` first: remove the state file), an upgrade replaced this
//! server, or the keeper died. SIGTERM and SIGINT are ignored here: the keeper stops the mount.

use crate::cli::MountArgs;
use crate::logging;
use crate::mountpoint::{MountpointError, wait_answering};
use crate::session::{Answerer, Session as FuseSession};
use crate::signals::{self, SignalsError, Waited, Waking, Woken};
use devremap::atomic::{Lasting, Written, write_atomic_told};
use devremap::decision::{plan, render};
use devremap::inputs::load::{self, LoadError, Loaded, Sources};
use devremap::io_message;
use devremap::keeper::control::Notice;
use devremap::keeper::control::{self, Control, HandoverError, Resume};
use devremap::keeper::fuse_wire;
use devremap::report::Failure;
use devremap::served::adapter::Adapter;
use devremap::served::devfs::Devfs;
use devremap::served::lifecycle::{End, Event, Lifecycle, Notifier, PublishError, Session, Status, Taken, warnings};
use devremap::served::takeover::Resumed;
use log::info;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{SockType, getsockopt, sockopt};
use serde_json::Value;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a server cannot start serving: sent to the keeper, which reports it as the error of the
/// command the user ran (run by hand: printed).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("devremapd serve is started by `devremapd mount`, with its sockets as fds 3 and 4 (fd {0} is not one)")]
    NotStartedByKeeper(i32),
    #[error(transparent)]
    Signals(#[from] SignalsError),
    #[error("the keeper closed the control socket")]
    KeeperClosed,
    #[error("cannot read the control socket: {0}")]
    ReadControl(#[source] Errno),
    /// A message from the keeper that does not decode, or a resume payload that does not parse.
    #[error("from the keeper: {0}")]
    FromKeeper(#[source] HandoverError),
    /// A message the keeper sends, where it must not (`context`: where).
    #[error("from the keeper: {message:?} {context}")]
    Unexpected { message: Box<Control>, context: &'static str },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("the FUSE handshake through the keeper failed: {}", io_message(.0))]
    Handshake(#[source] io::Error),
    #[error("cannot start the {name} thread: {source}")]
    Thread { name: &'static str, source: io::Error },
    /// The mount did not answer through this server.
    #[error(transparent)]
    Mountpoint(#[from] MountpointError),
    #[error("the keeper did not answer")]
    KeeperSilent,
    /// The first state file cannot be written.
    #[error(transparent)]
    Publish(#[from] PublishError),
}

impl From<ServerError> for Failure {
    fn from(e: ServerError) -> Failure {
        Failure::Message(e.to_string())
    }
}

/// The fds the keeper passes: the FUSE relay and the control socket.
const FUSE_FD: i32 = 3;
const CONTROL_FD: i32 = 4;

/// Invalidations, sent to the keeper over the control socket, all of a change at once; the
/// keeper answers each once the kernel has dropped what it cached (so a reload's state file is
/// written after, as it always was), in order. Only the lifecycle's thread invalidates, and it
/// is the thread that reads the control socket: what else comes meanwhile becomes its events.
struct Invalidator {
    control: Arc<OwnedFd>,
    events: Woken<Event>,
    answering: Answering,
}

impl Notifier for Invalidator {
    fn invalidate(&self, entries: &[(u64, String)], inodes: &[u64]) -> Vec<(String, io::Error)> {
        let notes = entries
            .iter()
            .map(|(parent, name)| fuse_wire::inval_entry(*parent, name.as_bytes()))
            .chain(inodes.iter().map(|ino| fuse_wire::inval_inode(*ino)));
        let mut sent = 0;
        for note in notes {
            if nix::unistd::write(&*self.control, &Control::Invalidate(note).encode()).is_err() {
                break;
            }
            sent += 1;
        }
        let mut refused = Vec::new();
        for i in 0..sent {
            let Some(errno) = answer(&self.control, &self.events, &self.answering, |m| match m {
                Control::Invalidated(errno) => Some(*errno),
                _ => None,
            }) else {
                break;
            };
            // ENOENT: nothing was cached there. A listing's invalidation may fail harmlessly.
            if let Some((_, name)) = entries.get(i).filter(|_| errno != 0 && errno != libc::ENOENT) {
                refused.push((name.clone(), io::Error::from_raw_os_error(errno)));
            }
        }
        refused
    }
}

/// The thread that runs the lifecycle answers FUSE requests whenever it waits (issue 31: it is
/// the server's only thread with `--threads 1`): a reload's invalidations wait for the kernel,
/// which may wait for a lookup in flight in the same directory, which only we answer.
type Answering = Arc<parking_lot::Mutex<Answerer>>;

/// Waits until `fd` is readable (or at its end, or in error: a read says which), answering
/// every FUSE request that comes meanwhile; false if the wait failed. A FUSE socket that ends
/// is no longer watched: the keeper is gone, or ended the session, and says so by its control
/// socket's end too.
fn answer_until(answering: &Answering, fd: BorrowedFd<'_>) -> bool {
    let fuse = answering.lock().fd();
    let mut fuse_open = fuse.is_some();
    loop {
        let mut fds = vec![PollFd::new(fd, PollFlags::POLLIN)];
        if let Some(fuse) = fuse.as_ref().filter(|_| fuse_open) {
            fds.push(PollFd::new(fuse.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => return false,
        }
        let ready = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
        if ready(&fds[0]) {
            return true;
        }
        if fds.get(1).is_some_and(ready) {
            fuse_open = answering.lock().answer_waiting().unwrap_or(false);
        }
    }
}

/// Writes the state file and tells the keeper its identity (the `die-writing-state` test hook
/// between the two).
fn write_state(path: &Path, text: &[u8], control: &OwnedFd) -> Result<Written, PublishError> {
    let told = |w: &Written| {
        let (dev, ino) = w.identity();
        tell(control, &Control::StateFile(dev, ino));
        die_writing_state(path);
    };
    write_atomic_told(path, text, None, Lasting::UntilReboot, told)
        .map_err(|source| PublishError::StateFile { path: path.to_owned(), source })
}

/// The state file's writes once serving. The thread that answers the kernel (the only one,
/// with `--threads 1`) must never wait on a file system: found from outside, a state file on a
/// frozen one (`fsfreeze`, as a snapshot or backup freezes it) held every request of the
/// container's `/dev` from the reload's end to the thaw, and the keeper replaced the hung
/// server again and again. A write is handed to a thread that lives while writes wait (the
/// newest wins; they stay in order), and its failure is logged there; the first server's first
/// write, at its readiness, is made at once: it can fail the start.
struct StateWriter {
    now: bool,
    slot: Arc<parking_lot::Mutex<StateSlot>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Woken once the thread has written all it was given, to join it ([`StateWriter::reap`]).
    events: Woken<Event>,
}

#[derive(Default)]
struct StateSlot {
    /// The text waiting to be written.
    next: Option<String>,
    written: Option<Written>,
    busy: bool,
    /// The last write's failure, logged once: a reload that changes the tree writes twice, and
    /// a full file system said so twice (found from outside).
    failed: Option<String>,
}

impl StateSlot {
    /// Keeps what a write on the thread did, logging a failure unlike the last one, and the
    /// first success after one.
    fn written(&mut self, path: &Path, result: Result<Written, PublishError>) {
        match result {
            Ok(written) => {
                self.written = Some(written);
                if self.failed.take().is_some() {
                    log::info!("{}: the state file is written again", path.display());
                }
            }
            Err(e) => {
                let e = e.to_string();
                if self.failed.as_ref() != Some(&e) {
                    log::warn!("{e}");
                }
                self.failed = Some(e);
            }
        }
    }
}

impl StateWriter {
    fn new(first: bool, events: Woken<Event>) -> StateWriter {
        StateWriter { now: first, slot: Arc::default(), thread: None, events }
    }

    fn write(&mut self, path: &Path, text: String, control: &Arc<OwnedFd>) -> Result<(), PublishError> {
        if std::mem::take(&mut self.now) {
            let written = write_state(path, text.as_bytes(), control)?;
            self.slot.lock().written = Some(written);
            return Ok(());
        }
        let mut slot = self.slot.lock();
        slot.next = Some(text);
        if slot.busy {
            return Ok(());
        }
        slot.busy = true;
        drop(slot);
        // The last thread said it was done (`busy`), and only returns now.
        if let Some(ended) = self.thread.take() {
            let _ = ended.join();
        }
        let (state, to, told, done) = (self.slot.clone(), path.to_owned(), control.clone(), self.events.clone());
        let writer = std::thread::Builder::new().name("state".into()).spawn(move || {
            while let Some(text) = {
                let mut slot = state.lock();
                let next = slot.next.take();
                slot.busy = next.is_some();
                next
            } {
                let result = write_state(&to, text.as_bytes(), &told);
                state.lock().written(&to, result);
            }
            done.wake();
        });
        match writer {
            Ok(thread) => self.thread = Some(thread),
            Err(_) => {
                // No thread: written here, as before.
                let text = {
                    let mut slot = self.slot.lock();
                    slot.busy = false;
                    slot.next.take().unwrap_or_default()
                };
                let written = write_state(path, text.as_bytes(), control)?;
                self.slot.lock().written = Some(written);
            }
        }
        Ok(())
    }

    /// Joins the thread once it has written all it was given, so that its stack goes (a thread
    /// not joined keeps it mapped until the next write).
    fn reap(&mut self) {
        if !self.slot.lock().busy
            && let Some(ended) = self.thread.take()
        {
            let _ = ended.join();
        }
    }

    /// Waits for the writes handed over, and says what was written last.
    fn finish(&mut self) -> Option<Written> {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.slot.lock().written.take()
    }
}

/// The server as the [`Lifecycle`] sees it.
struct Server {
    sources: Sources,
    mountpoint: PathBuf,
    state_file: Option<PathBuf>,
    /// The state file's writes once serving, on a thread of their own ([`StateWriter`]); the
    /// first server's first, at its readiness, is written here.
    state: StateWriter,
    events: Woken<Event>,
    control: Arc<OwnedFd>,
    handovers: u64,
    /// The generation whose plan the keeper has.
    handed: u64,
    /// The threads loading the inputs for a reload, by their reload's id, joined once their
    /// result has come back ([`Session::load_ended`]).
    loaders: Vec<(u64, std::thread::JoinHandle<()>)>,
}

/// The keeper's sockets, after checking that they are `SOCK_SEQPACKET` sockets: `devremapd
/// serve` run by hand would otherwise take whatever fds 3 and 4 happen to be. Called before
/// this process opens anything (the signal thread's own socket pair would land there).
fn inherited() -> Result<(OwnedFd, OwnedFd), ServerError> {
    let mut fds = Vec::new();
    for fd in [FUSE_FD, CONTROL_FD] {
        let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap_or_default();
        if !link.to_string_lossy().starts_with("socket:") {
            return Err(ServerError::NotStartedByKeeper(fd));
        }
        // SAFETY: fd is open (its /proc link names a socket) and is the socket the keeper
        // passed for us alone; nothing else in this process owns it.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        if getsockopt(&owned, sockopt::SockType).ok() != Some(SockType::SeqPacket) {
            // Not the keeper's: leave it open, as it was.
            let _ = owned.into_raw_fd();
            return Err(ServerError::NotStartedByKeeper(fd));
        }
        fds.push(owned);
    }
    let [fuse, control] = <[OwnedFd; 2]>::try_from(fds).expect("two fds");
    Ok((fuse, control))
}

/// Sends one control message; a keeper that is gone is noticed by the session's end.
fn tell(control: &OwnedFd, message: &Control) {
    let _ = nix::unistd::write(control, &message.encode());
}

/// Reads one control message; EOF (the keeper is gone) or a message that does not decode is an
/// error.
fn receive(control: &OwnedFd) -> Result<Control, ServerError> {
    match crate::record::read(control) {
        Ok(record) if record.is_empty() => Err(ServerError::KeeperClosed),
        Ok(record) => Control::decode(&record).map_err(ServerError::FromKeeper),
        Err(e) => Err(ServerError::ReadControl(e)),
    }
}

/// A payload from the keeper, put back together from its parts (`first` may be the first).
fn read_payload(control: &OwnedFd, first: Option<Vec<u8>>) -> Result<Vec<u8>, ServerError> {
    let mut payload = first.unwrap_or_default();
    loop {
        match receive(control)? {
            Control::Part(part) => payload.extend(part),
            Control::End => return Ok(payload),
            other => return Err(ServerError::Unexpected { message: Box::new(other), context: "within a payload" }),
        }
    }
}

/// What to serve: the inputs, loaded now, or (after a crash) the plan the dead server served,
/// as the keeper says first. A plan that does not read back is logged, and the inputs loaded.
/// Says whether the inputs were loaded now.
fn what_to_serve(control: &OwnedFd, sources: &Sources) -> Result<(Loaded, bool), ServerError> {
    let plan = match receive(control)? {
        Control::Load => None,
        Control::Part(part) => Some(read_payload(control, Some(part))?),
        other => {
            return Err(ServerError::Unexpected { message: Box::new(other), context: "instead of what to serve" });
        }
    };
    if let Some(plan) = plan {
        match Loaded::from_bytes(&plan) {
            Ok(loaded) => return Ok((loaded, false)),
            Err(e) => log::warn!("{e}; loading the inputs instead"),
        }
    }
    Ok((load::load(sources)?, true))
}

/// What a signal does to the server: SIGHUP reloads (the keeper passes its SIGHUP on).
fn act(sig: i32) -> Option<Event> {
    (sig == libc::SIGHUP).then_some(Event::Reload)
}

pub fn run(args: &MountArgs) -> Result<(), Failure> {
    name_process();
    let (fuse, control) = inherited()?;
    let (tx, rx) = signals::woken().map_err(|source| ServerError::Thread { name: "signals", source })?;
    // The signals are read on this thread, beside everything else it waits for.
    let reader =
        signals::reader(tx.clone(), act, " (signal the keeper, the pid in the pid file)").map_err(ServerError::from)?;
    let control = Arc::new(control);
    let sources = args.inputs.sources();
    // Until ready, every error goes to the keeper, which reports it as the error of the
    // command the user ran (and `main` prints nothing more).
    let fail = |e: ServerError| {
        tell(&control, &Control::Failed(e.to_string()));
        Failure::Reported
    };
    let (loaded, loaded_now) = what_to_serve(&control, &sources).map_err(fail)?;
    tell(&control, &Control::Loaded(protocol()));

    let devfs = Arc::new(Devfs::new(loaded.plan.tree.clone()));
    // Kept to end the session's other threads when serving ends here ([`EndSession`]).
    let session_end = nix::unistd::dup(&fuse).map_err(|e| fail(ServerError::ReadControl(e)))?;
    let session = handshake(args, &devfs, fuse, &tx).map_err(fail)?;
    stall_before_resume();
    let resume = read_payload(&control, None)
        .and_then(|payload| Resume::parse(&payload).map_err(ServerError::FromKeeper))
        .map_err(fail)?;
    let resumed = (!resume.is_first()).then(|| devfs.resume(&resume.held, resume.generation));
    let session_ended = tx.clone();
    let (answerer, others) = session.start(move |result| {
        session_ended.send(Event::Ended(result));
    });
    let answering: Answering = Arc::new(parking_lot::Mutex::new(answerer));
    let notifier = Invalidator { control: control.clone(), events: tx.clone(), answering: answering.clone() };
    let server = Server {
        sources,
        mountpoint: args.mountpoint.clone(),
        state_file: args.state_file.clone(),
        state: StateWriter::new(resume.is_first(), tx.clone()),
        events: tx.clone(),
        control: control.clone(),
        handovers: resume.handovers,
        handed: 0,
        loaders: Vec::new(),
    };
    let mut life = Lifecycle::new(devfs, loaded, Duration::from_secs(args.reload_timeout), notifier, server);
    let takeover = resumed.map(|resumed| Takeover {
        resumed,
        from: resume.from.clone(),
        // A server that loaded the inputs itself (an upgrade's) succeeded where the last error
        // (a refused reload, or upgrade) failed: as a successful reload, it clears it (issue
        // 29.7). One serving the dead server's plan keeps it: the inputs were not read.
        last_error: resume.last_error.clone().filter(|_| !loaded_now),
        previous: resume.previous_plan.as_deref().and_then(|p| Loaded::from_bytes(p.as_bytes()).ok()),
        reloads: resume.reloads,
        woken: resume.woken,
    });
    // The start's deep calls (the flags' parser, the load) are over on this thread, which now
    // serves: what they wrote of its stack goes back (docs/performance.md).
    crate::memory::give_back_unused_stack();
    let lived = {
        let _ending = EndSession(session_end);
        live(&reader, &mut life, &args.mountpoint, &control, &rx, takeover, &answering)
    };
    if let Err(e) = others.join() {
        log::debug!("the FUSE session ended: {e}");
    }
    logging::warn_if_dropped(module_path!());
    // All said: the keeper reads the end of the control socket now, not at this process's end,
    // which a reload's thread waiting in another FUSE filesystem's request (read by its daemon,
    // not answered) holds off until that request is answered: no signal ends that wait. Found
    // from outside: a stop then took the keeper's 2 s wait for this process to exit. The log's
    // lines first: the keeper kills what is left of this process once it reads the end.
    logging::flush(Duration::from_millis(200));
    let _ = nix::sys::socket::shutdown(control.as_raw_fd(), nix::sys::socket::Shutdown::Write);
    lived
}

/// The session's end, made when serving ends (a stop, a retirement, a failure before
/// readiness, the keeper's close): a shutdown of the relay socket's reading side, which the
/// session's other threads read as the keeper's close, and end.
struct EndSession(OwnedFd);

impl Drop for EndSession {
    fn drop(&mut self) {
        let _ = nix::sys::socket::shutdown(self.0.as_raw_fd(), nix::sys::socket::Shutdown::Read);
    }
}

/// What a server taking over is handed: the kernel's nodes as it kept them, and the last
/// server's state.
struct Takeover {
    resumed: Resumed,
    from: String,
    last_error: Option<String>,
    previous: Option<Loaded>,
    reloads: u64,
    woken: bool,
}

/// The server's life on its main thread: a takeover's invalidations, readiness, then serving
/// until the keeper says the daemon stops, or retires us, or the session ends (the keeper
/// closed the socket: an upgrade, its death). Until ready, every error goes to the keeper,
/// which reports it as the error of the command the user ran (and `main` prints nothing more).
///
/// Bug (found from outside): the takeover was made on the main thread before it ran the FUSE
/// session, and its invalidations wait for the kernel, which waits for a lookup in flight in
/// the same directory, which only the session answers: every successor hung until killed three
/// times and the lookup answered EIO. It is made here, answering while it waits.
fn live(
    reader: &signals::Reader,
    life: &mut Lifecycle<Invalidator, Server>,
    mountpoint: &Path,
    control: &Arc<OwnedFd>,
    events: &Waking<Event>,
    takeover: Option<Takeover>,
    answering: &Answering,
) -> Result<(), Failure> {
    let resumed = takeover.is_some();
    if let Some(t) = takeover {
        let from = Taken { from: &t.from, reloads: t.reloads, woken: t.woken };
        life.resumed(&t.resumed, &from, t.last_error, t.previous.as_ref());
    }
    if let Err(e) = become_ready(life, mountpoint, control, resumed, answering) {
        tell(control, &Control::Failed(e.to_string()));
        return Err(Failure::Reported);
    }
    crate::memory::give_back_freed_heap();
    let keeper = nix::unistd::getppid();
    let end = serve(reader, life, control, events, answering);
    // The state file goes with the daemon: when the keeper said it stops, or died (we were
    // handed to another parent). A server replaced by an upgrade leaves it to its successor.
    let written = life.session().state.finish();
    if matches!(end, End::Stop) || nix::unistd::getppid() != keeper {
        written.iter().for_each(Written::remove_if_ours);
    }
    Ok(())
}

/// Serves: the kernel's requests, the lifecycle's events (signals, the loads' results, the
/// session's end, the kernel's forgetting of a retired node) and the keeper's control messages,
/// as they come, with the lifecycle's deadline (a reload's), until serving ends.
fn serve(
    reader: &signals::Reader,
    life: &mut Lifecycle<Invalidator, Server>,
    control: &OwnedFd,
    events: &Waking<Event>,
    answering: &Answering,
) -> End {
    let fuse = answering.lock().fd();
    let (mut control_open, mut fuse_open) = (true, fuse.is_some());
    loop {
        // Looked at before every wait, not only after one that timed out, as the keeper's is:
        // with `--threads 1` the kernel's requests can wake this loop without end, and a stuck
        // reload was never abandoned while they came (found in review, 2026-12-06).
        if life.deadline().is_some_and(|d| Instant::now() >= d) {
            life.expire();
        }
        let timeout = life.deadline().map(|d| d.saturating_duration_since(Instant::now()));
        // The events first: `Ready` names the first readable one.
        let mut fds = vec![events.fd()];
        let control_at = control_open.then(|| {
            fds.push(control.as_fd());
            fds.len() - 1
        });
        let fuse_at = fuse.as_ref().filter(|_| fuse_open).map(|fuse| {
            fds.push(fuse.as_fd());
            fds.len() - 1
        });
        let mut batch = Vec::new();
        match reader.wait_for_any(&fds, timeout) {
            Waited::Ready(i) if Some(i) == fuse_at => match answering.lock().answer_waiting() {
                // Straight back to the poll: the events' descriptor is polled first, so none
                // waited when this request was taken, and one sent since wakes the next poll.
                // Their drain and the state writer's reap here cost a request the kernel did not
                // cache about 7 % (measured against fuser's worker, docs/performance.md).
                Ok(true) => continue,
                ended => {
                    fuse_open = false;
                    batch.push(Event::Ended(ended.map(drop)));
                }
            },
            Waited::Ready(i) if Some(i) == control_at => match receive(control) {
                Ok(message) => batch.extend(control_event(message)),
                // The keeper is gone, or closed it: the session's end says so.
                Err(_) => control_open = false,
            },
            // The deadline is looked at before the next wait.
            Waited::Ready(_) | Waited::TimedOut => {}
            Waited::Gone => return End::Ended(Err(io::Error::other("cannot wait for signals any more"))),
        }
        batch.extend(events.take());
        life.session().state.reap();
        if !batch.is_empty()
            && let Some(end) = life.handle(batch)
        {
            return end;
        }
    }
}

/// What a control message from the keeper asks of the lifecycle, if anything.
fn control_event(message: Control) -> Option<Event> {
    match message {
        Control::Refused(e) => Some(Event::Refused(e)),
        // The daemon stops: the state file goes with it.
        Control::Stop => Some(Event::Stop("the keeper stops the mount".into())),
        // Replaced: end before the successor writes its state file.
        Control::Retire => Some(Event::Ended(Ok(()))),
        Control::Rest => Some(Event::Rest),
        _ => None,
    }
}

/// Reads control messages until one that `wanted` takes, answering the kernel meanwhile; those
/// that ask something of the lifecycle meanwhile become its events. None once the socket ends.
fn answer<T>(
    control: &OwnedFd,
    events: &Woken<Event>,
    answering: &Answering,
    wanted: impl Fn(&Control) -> Option<T>,
) -> Option<T> {
    loop {
        if !answer_until(answering, control.as_fd()) {
            return None;
        }
        let message = receive(control).ok()?;
        if let Some(answer) = wanted(&message) {
            return Some(answer);
        }
        if let Some(event) = control_event(message) {
            events.send(event);
        }
    }
}

/// The FUSE session on the keeper's relay: answers the INIT the keeper sends (the kernel's, or
/// its replay). A retired node the kernel forgets becomes an event.
/// Names the process `devremapd`, as the keeper is: started from a descriptor (the binary the
/// keeper holds open), a server's name was that number ("6"), which `ps`, `pgrep -x devremapd`
/// and `killall devremapd` do not find. Set first, on the main thread, so that the threads
/// started after it, which take its name, are not named "6" either.
fn name_process() {
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"devremapd".as_ptr()) };
}

fn handshake(
    args: &MountArgs,
    devfs: &Arc<Devfs>,
    fuse: OwnedFd,
    events: &Woken<Event>,
) -> Result<FuseSession, ServerError> {
    let retired_tx = events.clone();
    let on_retired = Box::new(move || {
        let _ = retired_tx.send(Event::Retired);
    });
    let adapter = hooks(Adapter::new(devfs.clone(), Duration::from_secs(args.ttl), Some(on_retired)));
    crate::session::handshake(fuse, adapter, args.threads).map_err(ServerError::Handshake)
}

/// Readiness, once the mount answers through us: the keeper writes the pid file, then says to
/// proceed, and the state file is written (taking over: as the resumed generation was).
fn become_ready(
    life: &mut Lifecycle<Invalidator, Server>,
    mountpoint: &Path,
    control: &Arc<OwnedFd>,
    resumed: bool,
    answering: &Answering,
) -> Result<(), ServerError> {
    // The mount answers through us: we answer while a thread of the start's asks it.
    let (done, waiting) =
        std::os::unix::net::UnixStream::pair().map_err(|source| ServerError::Thread { name: "ready", source })?;
    let path = mountpoint.to_owned();
    let asking = std::thread::Builder::new()
        .name("ready".into())
        .spawn(move || {
            let answered = wait_answering(&path);
            drop(done);
            answered
        })
        .map_err(|source| ServerError::Thread { name: "ready", source })?;
    answer_until(answering, waiting.as_fd());
    asking.join().unwrap_or_else(|_| Err(MountpointError::NoAnswer(mountpoint.display().to_string())))?;
    stop_before_answering();
    // The keeper writes the pid file now, before the state file is.
    tell(control, &Control::Answering);
    let events = &life.session().events.clone();
    answer(control, events, answering, |m| matches!(m, Control::Proceed).then_some(()))
        .ok_or(ServerError::KeeperSilent)?;
    if resumed {
        life.ready_after_takeover();
        return Ok(());
    }
    life.ready()?;
    let current = life.current();
    info!(
        "serving {}: generation 1, nodes: {}, remapped GPUs: {} (keeper pid {}, server pid {}){}",
        mountpoint.display(),
        current.plan.tree.len() - 1,
        plan::served_names(&current.plan),
        nix::unistd::getppid(),
        std::process::id(),
        warnings(current)
    );
    Ok(())
}

/// The test hook `DEVREMAPD_FAILPOINT` names, in a build with the `test-hooks` feature.
#[cfg(feature = "test-hooks")]
fn failpoint() -> Option<String> {
    std::env::var("DEVREMAPD_FAILPOINT").ok()
}

/// `DEVREMAPD_FAILPOINT=lookup-panic:NAME` makes every lookup of NAME panic,
/// `lookup-stall:NAME` never return, and `lookup-slow:PREFIX` every lookup of a name beginning
/// with PREFIX take a few milliseconds.
#[cfg(feature = "test-hooks")]
fn hooks(adapter: Adapter) -> Adapter {
    use devremap::served::adapter::LookupFault;
    let fault = failpoint().and_then(|f| {
        let (kind, name) = f.split_once(':')?;
        let kind = match kind {
            "lookup-panic" => LookupFault::Panic,
            "lookup-stall" => LookupFault::Stall,
            "lookup-slow" => LookupFault::Slow,
            _ => return None,
        };
        Some((kind, name.to_owned()))
    });
    adapter.fault_on_lookup(fault)
}

#[cfg(not(feature = "test-hooks"))]
fn hooks(adapter: Adapter) -> Adapter {
    adapter
}

/// The keeper protocol this server speaks: [`control::PROTOCOL`], or with the test hook
/// `DEVREMAPD_FAILPOINT=protocol:N`, N (a build of another protocol, without a second build).
#[cfg(feature = "test-hooks")]
fn protocol() -> u32 {
    failpoint().and_then(|f| f.strip_prefix("protocol:")?.parse().ok()).unwrap_or(control::PROTOCOL)
}

#[cfg(not(feature = "test-hooks"))]
fn protocol() -> u32 {
    control::PROTOCOL
}

/// The test hook `DEVREMAPD_FAILPOINT=stall-before-resume`: the server answers the INIT, then
/// stops reading its control socket for ever (until killed), before the resume payload: a
/// successor that no longer reads what the keeper hands it.
#[cfg(feature = "test-hooks")]
fn stall_before_resume() {
    if failpoint().as_deref() == Some("stall-before-resume") {
        log::warn!("failpoint stall-before-resume: no longer reading the control socket");
        loop {
            std::thread::park();
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
fn stall_before_resume() {}

/// The test hook `DEVREMAPD_FAILPOINT=stop-before-answering`: the server stops itself
/// (`SIGSTOP`) once the mount answers through it, before it tells the keeper so: a first server
/// that hangs once mounted.
#[cfg(feature = "test-hooks")]
fn stop_before_answering() {
    if failpoint().as_deref() == Some("stop-before-answering") {
        raise_flushed(
            &format!("stop-before-answering: server pid {} stopping", std::process::id()),
            nix::sys::signal::Signal::SIGSTOP,
        );
    }
}

#[cfg(not(feature = "test-hooks"))]
fn stop_before_answering() {}

/// The test hook `DEVREMAPD_FAILPOINT=die-writing-state:MARKER`: the first server to replace
/// an existing state file (a reload's, not the start's) makes MARKER and is killed
/// (`SIGKILL`) once its temporary file exists, before the rename; the servers after it go on.
#[cfg(feature = "test-hooks")]
fn die_writing_state(state_file: &Path) {
    let Some(marker) = failpoint().and_then(|f| f.strip_prefix("die-writing-state:").map(PathBuf::from)) else {
        return;
    };
    if state_file.exists() && std::fs::File::options().write(true).create_new(true).open(&marker).is_ok() {
        raise_flushed("die-writing-state: killed before the rename", nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(not(feature = "test-hooks"))]
fn die_writing_state(_: &Path) {}

/// Logs a failpoint's line and raises `signal`, once the line is on stderr: the log's writer
/// thread stops (or dies) with the rest of us.
#[cfg(feature = "test-hooks")]
fn raise_flushed(line: &str, signal: nix::sys::signal::Signal) {
    log::warn!("failpoint {line}");
    crate::logging::flush(Duration::from_secs(5));
    let _ = nix::sys::signal::raise(signal);
}

impl Session for Server {
    /// Loads the inputs on a worker thread: an input on a stuck filesystem blocks only it.
    fn load(&mut self, id: u64) -> io::Result<()> {
        let (sources, events) = (self.sources.clone(), self.events.clone());
        let loader = std::thread::Builder::new().name("reload".into()).spawn(move || {
            let _ = events.send(Event::Loaded(id, Box::new(load::load(&sources))));
        })?;
        self.loaders.push((id, loader));
        Ok(())
    }

    /// Joins the reload thread whose result came back (it only returns now), and any other that
    /// has ended, so that their stacks are unmapped: one not joined leaves its stack's touched
    /// pages (the load's deep calls wrote many) in glibc's cache of stacks
    /// ([`crate::memory::glibc_tunables`]). An abandoned reload's thread is joined when its late
    /// result comes (found from outside: until then it was joined only at the next reload).
    /// One still loading, an input on a stuck file system, is left running.
    fn load_ended(&mut self, id: u64) {
        let (ended, loading) =
            std::mem::take(&mut self.loaders).into_iter().partition(|(of, t)| *of == id || t.is_finished());
        self.loaders = loading;
        for (_, thread) in ended {
            let _ = thread.join();
        }
    }

    /// Replaces the state file, if there is one, and tells the keeper the generation served.
    fn publish(&mut self, status: &Status<'_>) -> Result<(), PublishError> {
        let last_error = status.last_error.map(str::to_owned);
        let reloads = status.reloads;
        tell(&self.control, &Control::Status { generation: status.generation, last_error, reloads });
        // The plan of each generation, for a server restarted after a crash to serve as it was.
        if self.handed != status.generation {
            self.handed = status.generation;
            for record in control::records(&status.loaded.to_bytes()) {
                let _ = nix::unistd::write(&*self.control, &record);
            }
        }
        // The generation before is gone (or this one was refused): what its load took goes back.
        crate::memory::give_back_freed_heap();
        let Some(path) = &self.state_file else { return Ok(()) };
        let mut state = render::plan_json(&status.loaded.plan, status.loaded.metadata.as_ref());
        state.insert("generation".into(), status.generation.into());
        state.insert("last_error".into(), status.last_error.map_or(Value::Null, Value::from));
        state.insert("reloads".into(), status.reloads.into());
        state.insert("retired_nodes".into(), status.retired_nodes.into());
        let mountpoint = self.mountpoint.display().to_string();
        let keeper = control::StateFields {
            protocol: control::PROTOCOL,
            pid: nix::unistd::getppid().as_raw(),
            server_pid: (!status.resting).then(std::process::id),
            resting: status.resting,
            handovers: self.handovers,
            mountpoint: &mountpoint,
            log_lines_dropped: logging::dropped(),
        };
        if let Ok(Value::Object(fields)) = serde_json::to_value(&keeper) {
            state.extend(fields);
        }
        let mut text = Value::Object(state).to_string();
        text.push('\n');
        self.state.write(path, text, &self.control)
    }

    /// Passes the notice to the keeper, the process systemd knows.
    fn notify(&mut self, notice: Notice) {
        tell(&self.control, &Control::Notify(notice));
    }
}
