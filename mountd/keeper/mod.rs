//! `devremapd mount`: the keeper. It takes the mountpoint's lock, opens `/dev/fuse`, mounts,
//! writes the pid file and takes the signals, and it holds the FUSE connection for the mount's
//! whole life. It parses no input: the server (`devremapd serve`, [`crate::server`]), which it
//! starts as its child, loads the inputs and answers the kernel; the keeper relays whole FUSE
//! messages between `/dev/fuse` and the current server over a `SOCK_SEQPACKET` socket pair.
//!
//! So a server can die (a bug, the OOM killer, `SIGKILL`) or be replaced (`SIGUSR2`: an upgrade
//! to the binary now on disk) without the kernel noticing: the keeper starts another, replays
//! the kernel's INIT to it, hands it the node table the kernel holds, and sends it every
//! request still in flight ([`Relay`] decides the traffic, and the state machine [`devremap::keeper::Machine`]
//! what a signal, a server's message, its death or its hang leads to; this driver turns what
//! happens into the machine's events, and does the actions it returns: it reads, writes,
//! spawns and keeps the time). Requests
//! that arrive meanwhile wait. A crash restart runs the binary the dead server ran; an upgrade
//! runs the file now at the path the keeper was started from, and if that server fails to
//! start, load its inputs or agree on INIT, the old one serves on and its state file's
//! `last_error` says why.
//!
//! One thread, the main one, relays ([`relaying`]) and runs the life below: starting and
//! replacing servers, signals, timers (a restart's backoff, an upgrade's deadline, a hung
//! server), readiness and the end of the mount. It waits for `/dev/fuse`, every server's two
//! sockets, its threads' events, the signals (read from a `signalfd` there,
//! [`signals::reader`]) and the container's process ([`crate::watch::Watch`]) in one `poll`
//! ([`Keeper::wait`]): each had a thread of its own, in every container (issue 31). It waits on
//! nothing but the kernel (issue 31): a server is spawned by a spawner thread ([`spawner`]: a
//! spawn returns only once the child has exec'd), and one whose spawn has not returned within
//! `--reload-timeout` failed to start; a server whose sockets ended is reaped by a thread of its
//! own; what it writes to a server's socket is written without waiting, kept until the socket
//! takes it, or written by a thread of its own. A server's invalidations come over its control
//! socket and are written to `/dev/fuse` by a thread that lives while some wait, which answers
//! each with the write's result: the write returns once the kernel has dropped the entry, so a
//! reload's state file is written after it, as before; and the kernel may hold a directory lock
//! for an invalidation until a reply has passed, which the main thread must stay free to write.
//! Only the keeper ever holds `/dev/fuse`: a `SIGKILL` of the keeper ends the connection at
//! once, as it always did. Assumption: one daemon per mountpoint, enforced by the [`MountLock`]
//! held for the keeper's whole life.

mod error;
pub(crate) mod procs;
mod relaying;
mod spawner;
mod stop;
mod takeover;

use crate::cli::MountArgs;
use crate::mountpoint::{MountLock, check_private, prepare_mountpoint, resolve};
use crate::signals;
use crate::signals::Waking;
use devremap::atomic::Written;
use devremap::keeper::control::{Control, HandoverError};
use devremap::keeper::servers::{Action, Event, Exit, Hang, Machine, away, hang};
use devremap::served::lifecycle::Waited;
pub use error::KeeperError;
use log::{info, warn};
use nix::poll::{PollFd, PollFlags};
use procs::{Pending, Proc, own_path, status_text};
use relaying::{Link, Relaying, ready_of, replies_waiting};
use spawner::{Handed, Started};
pub(crate) use spawner::{Parked, ParkedServer, park_server};
use std::collections::HashMap;
use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long the hang check waits for replies that have arrived to be passed on before it looks
/// again at the next wake-up.
const REPLY_GRACE: Duration = Duration::from_millis(100);
/// How long a server has to exit once its sockets ended, before it is killed and said gone.
const EXIT_AFTER_SOCKETS: Duration = Duration::from_secs(2);

/// What the keeper's main loop is told by its threads.
enum Ev {
    Reload,
    Upgrade,
    Stop(String),
    Control(u64, Control),
    /// Server `epoch`'s spawn returned ([`spawner`]).
    Started(u64, Started),
    /// A server's sockets ended: it exited, or is exiting.
    Gone(u64),
    /// A server the machine knows was reaped (its status), or had not exited in time after its
    /// sockets ended and was killed ([`EXIT_AFTER_SOCKETS`]).
    Exited(u64, String),
    /// The plan a server serves (`Loaded::to_bytes`), after each generation.
    Served(u64, Vec<u8>),
    /// A server sent more than the keeper keeps (the error).
    Overrun(u64, HandoverError),
    Probed(u64, bool),
    /// `/dev/fuse` ended: unmounted (`Ok`) or aborted (ECONNABORTED).
    KernelEnded(io::Result<()>),
    /// A request came while no server runs (the last one rested).
    Wanted,
    /// The server that rested was reaped: whether it exited cleanly (its state file says that
    /// no server runs), and its status.
    RestEnded {
        clean: bool,
        pid: u32,
        status: String,
    },
}

fn act(sig: i32) -> Option<Ev> {
    signals::acted(sig).map(|acted| match acted {
        signals::Acted::Reload => Ev::Reload,
        signals::Acted::Upgrade => Ev::Upgrade,
        signals::Acted::Stop(why) => Ev::Stop(why),
    })
}

/// The driver: the machine, and the processes, files and mount its actions are done on.
struct Keeper<'a> {
    args: &'a MountArgs,
    link: Arc<Link>,
    /// The relay, and the reading and writing of `/dev/fuse` and the servers' sockets, done by
    /// the main thread as it waits.
    relaying: Relaying,
    mountpoint: PathBuf,
    m: String,
    /// The arguments after `mount`, given to every server after `serve` (but `--ready-fd`).
    serve_args: Vec<OsString>,
    /// The path the keeper was started from: an upgrade runs what is there now.
    exe_path: PathBuf,
    server_timeout: Duration,
    /// The signals, read by the main thread as it waits ([`Keeper::wait`]).
    signals: signals::Reader,
    /// The container's watch, once mounted.
    watch: Option<crate::watch::Watch>,
    /// Events taken from the queue and not yet handled.
    queued: VecDeque<Ev>,
    /// Hears when the watch has had its first look at the container's pid file, until the
    /// mount is said to be ready.
    watch_armed: Option<std::sync::mpsc::Receiver<()>>,
    machine: Machine,
    /// The current server and the successor, by epoch.
    procs: HashMap<u64, Proc>,
    /// Servers being spawned, by epoch; one abandoned is no longer here.
    pending: HashMap<u64, Pending>,
    /// The first server, started ahead (a spare keeper's) and handed its command line as the
    /// keeper starts, until the machine starts its first server; or why it could not be.
    parked: Option<Handed>,
    /// Servers replaced by an upgrade, or rested, until they have exited.
    leaving: Vec<Proc>,
    /// `--rest-after`: how long the current server may be asked nothing before it rests.
    rest_after: Option<Duration>,
    /// The server that rested last, and by when it must have ended ([`Keeper::end_rested`]).
    rested: Option<(u64, Instant)>,
    mounted: bool,
    /// The mount's FUSE connection ([`crate::mountpoint::connection_of`]), read once mounted.
    connection: Option<u64>,
    /// Its `abort` file, opened once mounted ([`crate::mountpoint::abort_handle`]).
    abort: Option<File>,
    pid_written: Option<Written>,
    /// The mount answers (again): the heap's freed pages are given back once the actions that
    /// said so are done ([`crate::memory::give_back_start_memory`]).
    trim_due: bool,
    /// The starter's `--ready-fd`, until the mount answers.
    ready: Option<File>,
    /// The binary of the last server that took over: a crash restart runs it again (the file
    /// at `exe_path` may be a newer one that was never tried).
    good: Arc<File>,
    /// The plan the current server serves, opaque: a server restarted after a crash serves it,
    /// reading no input (an input that changed since, or made the server die, waits for a reload).
    plan: Option<Vec<u8>>,
    /// How `/dev/fuse` ended, for [`Exit::Ended`].
    kernel_ended: Option<io::Result<()>>,
}

/// The keeper's life. `words` are its arguments after `mount` (every server gets them, but
/// `--ready-fd`); `parked`, the first server, started already (by a spare keeper).
pub fn run(args: &MountArgs, words: Vec<OsString>, parked: Option<ParkedServer>) -> Result<(), KeeperError> {
    // Before the event queue's socket pair takes 3 and 4, which a server's sockets replace.
    let ready = args.ready_fd.map(claim_ready_fd).transpose()?;
    // Then: a SIGHUP or SIGTERM sent as soon as we were started must not end us.
    let (tx, rx) = signals::woken().map_err(|source| KeeperError::Thread { name: "signals", source })?;
    let signals = signals::reader(tx.clone(), act, "")?;
    let serve_args = keeper_only_removed(words.into_iter());
    let exe = parked.as_ref().map(ParkedServer::exe);
    // Handed its command line first, so that its own start (its arguments, its threads) runs
    // beside ours (about 0.4 ms of a container's mount); it reads no input until the first
    // server is started below and told to load. If we stop before, it reads EOF and exits.
    let parked = parked.map(|server| server.hand(&serve_args));
    args.check_files()?;
    if !nix::unistd::geteuid().is_root() {
        return Err(KeeperError::NotRoot);
    }
    let m = args.mountpoint.display().to_string();
    // Every directory above it is root's alone (check_private), so the canonical path stays
    // the one checked; a symlink in the path as given could not be trusted to.
    let mountpoint = resolve(&args.mountpoint)?;
    args.check_outside(&mountpoint)?;
    check_private(&mountpoint, &m)?;
    // Held until we return: a second daemon on this mountpoint stops here.
    let _lock = MountLock::take(&mountpoint, &m)?;
    prepare_mountpoint(&mountpoint, &m)?;
    if args.inputs.spec.is_none() {
        warn!(
            "no --spec: the tree has no mount points for the container runtime (pts, shm, mqueue), so a runtime \
             that mounts there fails (\"read-only file system\"); give the container's config.json with --spec"
        );
    }
    let exe = match exe {
        Some(exe) => exe,
        None => Arc::new(File::open("/proc/self/exe").map_err(KeeperError::OpenOwnBinary)?),
    };
    let exe_path = own_path(&exe).map_err(KeeperError::FindOwnBinary)?;
    // Read only once poll says a request waits; one the kernel took back meanwhile must not
    // hold the main thread in the read.
    let dev = File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/fuse")
        .map_err(KeeperError::DevFuse)?;
    let link = Arc::new(Link { dev, events: tx, invalidating: AtomicUsize::new(0) });
    let (machine, first) = Machine::new(
        Duration::from_secs(args.reload_timeout),
        Duration::from_secs(args.server_timeout),
        Instant::now(),
    );
    let mut keeper = Keeper {
        args,
        link,
        relaying: Relaying::new(),
        mountpoint,
        m,
        serve_args,
        exe_path,
        server_timeout: Duration::from_secs(args.server_timeout),
        signals,
        watch: None,
        queued: VecDeque::new(),
        watch_armed: None,
        machine,
        procs: HashMap::new(),
        pending: HashMap::new(),
        parked,
        leaving: Vec::new(),
        rest_after: (args.rest_after > 0).then(|| Duration::from_secs(args.rest_after)),
        rested: None,
        mounted: false,
        connection: None,
        abort: None,
        pid_written: None,
        trim_due: false,
        ready,
        good: exe,
        plan: None,
        kernel_ended: None,
    };
    let result = keeper.perform_all(first, &rx).map_or_else(|end| end, |()| keeper.serve(&rx));
    keeper.pid_written.iter().for_each(Written::remove_if_ours);
    // An invalidation still in its write to `/dev/fuse` (waiting for a directory's lock, held
    // by a lookup no server answers now) would keep this process, `/dev/fuse` with it, from
    // ever ending: a zombie keeper, and lookups in the mount that hang for good instead of
    // ENOTCONN (found from outside). The connection is ended first, as our exit would end it.
    if keeper.link.invalidating.load(Ordering::Acquire) > 0
        && let Some(mut abort) = keeper.abort.take()
    {
        warn!("{}: an invalidation still waits on the kernel; aborting the FUSE connection before we exit", keeper.m);
        let _ = std::io::Write::write_all(&mut abort, b"1");
    }
    crate::logging::warn_if_dropped(module_path!());
    result
}

/// Takes the starter's `--ready-fd`: moved to 10 or above and closed on exec, so that no server
/// inherits it and it never holds 3 or 4 (a server's sockets; the event queue's socket pair
/// takes them, for the keeper's life, and a spawn refuses a binary's fd there). Refused unless
/// it is the write end of a pipe other than stdin, stdout or stderr: a number that names nothing
/// inherited must never make us write into a file or socket of our own, nor leave a standard fd
/// closed for the next open to take. It is made non-blocking: a starter that never reads (a
/// full pipe) must not stop the keeper, which takes the signals, in its write.
pub(crate) fn claim_ready_fd(fd: i32) -> Result<File, KeeperError> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let unusable = |e: nix::errno::Errno| KeeperError::ReadyFdUnusable { fd, source: e.into() };
    if fd < 0 {
        return Err(KeeperError::ReadyFdNegative(fd));
    }
    if fd < 3 {
        return Err(KeeperError::ReadyFdStandard(fd));
    }
    // SAFETY: F_DUPFD_CLOEXEC only duplicates the number if it is open; the copy is a new fd
    // that nothing else in this process knows, so the File below owns it alone.
    let moved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
    if moved < 0 {
        return Err(KeeperError::ReadyFdUnusable { fd, source: io::Error::last_os_error() });
    }
    // SAFETY: see above.
    let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(moved) };
    let is_pipe = file.metadata().is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_fifo(&m.file_type()));
    if !is_pipe {
        return Err(KeeperError::ReadyFdNotPipe(fd));
    }
    let flags = fcntl(&file, FcntlArg::F_GETFL).map(OFlag::from_bits_truncate).map_err(unusable)?;
    if flags & OFlag::O_ACCMODE == OFlag::O_RDONLY {
        return Err(KeeperError::ReadyFdReadEnd(fd));
    }
    fcntl(&file, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(unusable)?;
    // SAFETY: the number was inherited for us alone and nothing uses it: its copy replaces it.
    unsafe { libc::close(fd) };
    Ok(file)
}

/// The keeper's flags that no server needs, each with a value.
const KEEPER_ONLY: [&str; 2] = ["--ready-fd", "--rest-after"];

/// The keeper's arguments without its own flags ([`KEEPER_ONLY`], as `--flag N` or
/// `--flag=N`): no server needs them, and a server of an older build (an upgrade back to it)
/// would refuse a flag it does not know.
fn keeper_only_removed(mut args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    while let Some(arg) = args.next() {
        let bytes = arg.as_encoded_bytes();
        let own = |flag: &str| bytes.strip_prefix(flag.as_bytes()).is_some_and(|rest| rest.first() == Some(&b'='));
        if KEEPER_ONLY.iter().any(|flag| arg == *flag) {
            args.next();
        } else if !KEEPER_ONLY.iter().any(|flag| own(flag)) {
            out.push(arg);
        }
    }
    out
}

fn spawn_thread(name: &'static str, f: impl FnOnce() + Send + 'static) -> Result<(), KeeperError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
        .map_err(|source| KeeperError::Thread { name, source })
}

/// The end of the keeper's life, with the command's result.
type End = Result<(), KeeperError>;

impl Keeper<'_> {
    /// The keeper's life, from the first server's start to the end of the mount.
    fn serve(&mut self, rx: &Waking<Ev>) -> End {
        loop {
            let (waited, deadline) = self.wait(rx, Keeper::deadline);
            let now = Instant::now();
            if let Some(away) = self.woke(deadline, now)
                && let Err(end) = self.feed(away, rx)
            {
                return end;
            }
            let event = match waited {
                Waited::Event(ev) => match self.event(ev) {
                    Some(event) => event,
                    None => continue,
                },
                Waited::Deadline => {
                    if let Some(hung) = self.hang_check(now)
                        && let Err(end) = self.feed(hung, rx)
                    {
                        return end;
                    }
                    if self.end_rested(now)
                        && let Err(end) = self.feed(Event::Wanted, rx)
                    {
                        return end;
                    }
                    if self.rest_due(now)
                        && let Err(end) = self.feed(Event::Idle, rx)
                    {
                        return end;
                    }
                    Event::Tick
                }
                Waited::Closed => Event::Stop("the event channel closed".into()),
            };
            if let Err(end) = self.feed(event, rx) {
                return end;
            }
            // After the event's actions: the server is told to proceed first.
            if std::mem::take(&mut self.trim_due) {
                crate::memory::give_back_start_memory();
            }
        }
    }

    /// The next event, or `Deadline` once `deadline` has passed: the queue's, the signals' (read
    /// here, on the main thread), and the container's watch's, which says when the daemon must
    /// stop (a thread waited for each, in every container: issue 31). `Closed` once the signals
    /// cannot be waited for any more. Meanwhile it relays: the kernel's requests and the
    /// servers' replies and messages are polled with the rest ([`relaying`]), and what they
    /// tell the machine is queued. The deadline is asked again before every poll, and the last
    /// one asked is returned with what came: the relay's traffic moves it (found from outside:
    /// a wait begun while a request was in flight waited out the heartbeat, a quarter of
    /// `--server-timeout`, and the server rested that much later than `--rest-after`).
    fn wait(&mut self, rx: &Waking<Ev>, deadline: impl Fn(&Self) -> Option<Instant>) -> (Waited<Ev>, Option<Instant>) {
        loop {
            let deadline = deadline(self);
            if let Some(ev) = self.queued.pop_front() {
                return (Waited::Event(ev), deadline);
            }
            let now = Instant::now();
            let watch_deadline = self.watch.as_ref().and_then(crate::watch::Watch::deadline);
            let until = [deadline, watch_deadline].into_iter().flatten().min();
            let (queue_woke, watch_woke, relay_ready) = {
                let own: Vec<BorrowedFd> =
                    std::iter::once(rx.fd()).chain(self.watch.iter().flat_map(|w| w.fds())).collect();
                let interest = self.relaying.interest(&self.link, true);
                let mut fds: Vec<PollFd> = own
                    .iter()
                    .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
                    .chain(interest.iter().map(|(fd, flags, _)| PollFd::new(*fd, *flags)))
                    .collect();
                if !self.signals.poll_with(&mut fds, until.map(|u| u.saturating_duration_since(now))) {
                    return (Waited::Closed, deadline);
                }
                let woke = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
                let watch_woke = fds[1..own.len()].iter().position(woke);
                (woke(&fds[0]), watch_woke, ready_of(&interest, &fds[own.len()..]))
            };
            self.relaying.handle(&self.link, &relay_ready, &mut self.queued);
            if queue_woke {
                self.queued.extend(rx.take());
            }
            if let Some(why) = watch_woke.and_then(|i| self.watch.as_mut().and_then(|w| w.ready(i))) {
                self.watch = None;
                self.queued.push_back(Ev::Stop(why));
            }
            if !self.queued.is_empty() {
                continue;
            }
            // Looked at after every poll, not only one that timed out: the relay's traffic may
            // wake it without end. Never before one: what the queue, the signals and the kernel
            // have is always taken first (found from outside: a deadline that stayed past held
            // the keeper in a loop that read none of them).
            let now = Instant::now();
            if watch_deadline.is_some_and(|d| now >= d)
                && let Some(why) = self.watch.as_mut().and_then(|w| w.timed_out(now))
            {
                self.watch = None;
                self.queued.push_back(Ev::Stop(why));
            } else if deadline.is_some_and(|d| now >= d) {
                return (Waited::Deadline, deadline);
            }
        }
    }

    /// What the machine is told of a message from a thread (some are the driver's alone).
    fn event(&mut self, ev: Ev) -> Option<Event> {
        Some(match ev {
            Ev::Reload => Event::Sighup,
            Ev::Upgrade => Event::Sigusr2,
            Ev::Stop(why) => Event::Stop(why),
            Ev::KernelEnded(result) => {
                self.kernel_ended = Some(result);
                Event::KernelEnded
            }
            Ev::Started(epoch, started) => return self.started(epoch, started),
            Ev::Gone(epoch) => return self.gone(epoch),
            Ev::Exited(epoch, status) => Event::Gone { epoch, status },
            Ev::Probed(epoch, same) => Event::Probed { epoch, same },
            Ev::Wanted => Event::Wanted,
            Ev::RestEnded { clean, pid, status } => {
                // Killed (by anyone but us) or failed before it said it rests: its state file
                // still names it as serving, so a server wakes now to say what is true.
                if clean || self.machine.phase() != devremap::keeper::servers::Phase::Resting {
                    return None;
                }
                warn!("{}: server pid {pid} ended while it rested ({status}); starting another", self.m);
                Event::Wanted
            }
            Ev::Served(epoch, plan) => {
                if self.machine.current() == Some(epoch) {
                    self.plan = Some(plan);
                }
                return None;
            }
            Ev::Overrun(epoch, why) => {
                if self.machine.current() == Some(epoch) {
                    self.plan = None;
                }
                Event::Overrun { epoch, why }
            }
            Ev::Control(epoch, message) => match message {
                Control::Loaded(protocol) => Event::Loaded { epoch, protocol },
                Control::Failed(why) => Event::Failed { epoch, why },
                Control::Answering => Event::Answering(epoch),
                Control::Notify(notice) => Event::Notice(epoch, notice),
                _ => return None,
            },
        })
    }

    /// A server's sockets ended. One the machine knows is reaped by a thread of its own, which
    /// says its status ([`Ev::Exited`]): one that closed its sockets and lives on, or is ending
    /// only once a stuck filesystem answers, must not hold the main thread; one that has not
    /// exited within [`EXIT_AFTER_SOCKETS`] is killed and said gone. A retired one is reaped
    /// off the main thread too, as a killed one is.
    fn gone(&mut self, epoch: u64) -> Option<Event> {
        if self.machine.knows(epoch)
            && let Some(mut p) = self.procs.remove(&epoch)
        {
            p.disconnect();
            let (events, state_file) = (self.link.events.clone(), self.args.state_file.clone());
            let reaper = move || {
                let late = !devremap::pidfd::exits_within(p.pid(), EXIT_AFTER_SOCKETS);
                if late {
                    let _ = p.child.kill();
                    let within = EXIT_AFTER_SOCKETS.as_secs();
                    let status = format!("its sockets closed, and it had not exited within {within} s; killed it");
                    let _ = events.send(Ev::Exited(epoch, status));
                }
                let status = status_text(procs::reap(&mut p.child, state_file.as_deref()));
                if !late {
                    let _ = events.send(Ev::Exited(epoch, status));
                }
            };
            // Without a reaper it is said gone now, unreaped: the machine must replace it.
            return spawn_thread("reaper", reaper)
                .err()
                .map(|e| Event::Gone { epoch, status: format!("unknown status: {e}") });
        }
        if let Some(p) = self.take_leaving(epoch) {
            match self.rested.take_if(|(rested, _)| *rested == epoch) {
                Some(_) => self.reap_rested(p),
                None => self.forget(p),
            }
        }
        None
    }

    /// Feeds the machine an event and does what it says; `Err` ends the keeper's life.
    fn feed(&mut self, event: Event, rx: &Waking<Ev>) -> Result<(), End> {
        let actions = self.machine.handle(event, Instant::now());
        self.perform_all(actions, rx)
    }

    fn perform_all(&mut self, actions: Vec<Action>, rx: &Waking<Ev>) -> Result<(), End> {
        for action in actions {
            // A spawn that failed at once goes back to the machine before the next action.
            if let Some(event) = self.perform(action, rx)? {
                self.feed(event, rx)?;
            }
        }
        Ok(())
    }

    fn perform(&mut self, action: Action, rx: &Waking<Ev>) -> Result<Option<Event>, End> {
        match action {
            Action::Spawn { epoch, binary, plan } => {
                self.end_rest_now();
                return Ok(self.start(epoch, binary, plan));
            }
            Action::Mount(epoch) => self.mount_now(epoch).map_err(|why| Err(self.start_failed(why)))?,
            Action::WritePidFile => {
                self.write_pid_file().map_err(|why| Err(self.start_failed(why)))?;
                self.trim_due = true;
            }
            Action::SayReady => self.say_ready(),
            Action::Tell(epoch, message) => self.procs.get(&epoch).iter().for_each(|p| p.tell(&message)),
            Action::Reload(epoch) => {
                if let Some(p) = self.procs.get(&epoch) {
                    let pid = nix::unistd::Pid::from_raw(p.pid() as i32);
                    let _ = nix::sys::signal::kill(pid, nix::sys::signal::SIGHUP);
                }
            }
            Action::Probe(epoch) => self.probe(epoch),
            Action::TakeOver { epoch, retire, from } => self.take_over(epoch, retire, &from),
            Action::Lost(epoch) => self.relaying.relay.lost(epoch),
            Action::Rest(epoch) => self.rest(epoch),
            Action::Kill(epoch) => match self.procs.remove(&epoch) {
                Some(p) => self.kill(p),
                None => self.abandon(epoch),
            },
            Action::Notify(notice) => stop::notify(notice),
            Action::Info(text) => info!("{text}"),
            Action::Warn(text) => warn!("{text}"),
            Action::Exit(Exit::Stop) => return Err(self.stop(rx)),
            Action::Exit(Exit::Ended) => {
                let result = self.kernel_ended.take().unwrap_or(Ok(()));
                return Err(self.ended(result));
            }
            Action::Exit(Exit::StartFailed(why)) => return Err(Err(self.start_failed(KeeperError::StartFailed(why)))),
        }
        Ok(None)
    }

    /// The longest the main thread sleeps while a server answers: a wake-up later than this
    /// past its deadline means the keeper itself did not run ([`Keeper::woke`]).
    fn heartbeat(&self) -> Duration {
        self.server_timeout / 4
    }

    fn deadline(&self) -> Option<Instant> {
        // While a server takes requests, wake when its oldest request would make it hung, and
        // at least every heartbeat, so that a late wake-up tells that the keeper was away. Not
        // for one whose sockets have ended: it is gone, and its reaping tells the machine so
        // (found from outside: a server killed just before its hang deadline, reaped late,
        // left a deadline in the past that the keeper woke for without end).
        let hung = self.machine.hang_checked().filter(|epoch| self.procs.contains_key(epoch)).map(|_| {
            let oldest = self.relaying.relay.oldest_sent();
            let now = Instant::now();
            oldest.map_or(now + self.server_timeout, |t| t + self.server_timeout).min(now + self.heartbeat())
        });
        let rest = self.rest_at();
        let rested = self.rested.map(|(_, by)| by);
        [self.machine.deadline(), hung, rest, rested].into_iter().flatten().min()
    }

    /// When the current server rests, if nothing is asked of it before: `--rest-after` past the
    /// relay's last traffic, for a server that may rest ([`Machine::may_rest`]) with nothing in
    /// flight, whose plan the keeper has (a server woken without it would load the inputs: a
    /// reload nobody asked for).
    fn rest_at(&self) -> Option<Instant> {
        let after = self.rest_after?;
        self.machine.may_rest()?;
        if self.plan.is_none() || self.relaying.relay.in_flight() > 0 {
            return None;
        }
        Some(self.relaying.last_traffic + after)
    }

    fn rest_due(&self, now: Instant) -> bool {
        self.rest_at().is_some_and(|at| now >= at)
    }

    /// The main thread woke at `now` from a wait until `deadline`. Woken more than a heartbeat
    /// late, the keeper did not run meanwhile (SIGSTOP, or starved of CPU): requests it had
    /// decided to send may not have been written, and replies may wait unread, so the server's
    /// clock leaves that absence out ([`Relay::credit`]), and only that: a keeper starved again
    /// and again still calls a hung server hung once it has run for `--server-timeout`. (A
    /// false "hung" needs a keeper away for at least `--server-timeout`: it is then at least
    /// three heartbeats late.) Woken later than [`REPLY_GRACE`], the machine is told
    /// ([`Event::Away`]): a successor gets a new `--reload-timeout`.
    fn woke(&mut self, deadline: Option<Instant>, now: Instant) -> Option<Event> {
        let moved = away(deadline, now, REPLY_GRACE).map(|_| Event::Away);
        let Some(late) = away(deadline, now, self.heartbeat()) else { return moved };
        if self.machine.hang_checked().is_some() {
            info!(
                "the keeper did not run for {} ms (stopped, or starved of CPU): its server is not blamed for that time",
                late.as_millis()
            );
            self.relaying.relay.credit(late, now);
        }
        moved
    }

    /// Whether the server requests go to has left one unanswered for `--server-timeout`,
    /// counting the replies it has sent: those that arrived are passed on first (a little
    /// while, [`REPLY_GRACE`], while more keep coming), and while any remain it is not hung.
    /// After the keeper itself was stopped (`SIGSTOP`) or starved of CPU, every answer the
    /// server gave meanwhile waits to be read when it wakes.
    fn hang_check(&mut self, now: Instant) -> Option<Event> {
        let epoch = self.machine.hang_checked()?;
        let until = now + REPLY_GRACE;
        loop {
            self.relaying.pump(&self.link, Duration::ZERO, &mut self.queued);
            let p = self.procs.get(&epoch)?;
            match hang(self.relaying.relay.oldest_sent(), now, self.server_timeout, replies_waiting(&p.socket)) {
                Hang::No => return None,
                Hang::Hung(since) => return Some(Event::Hung { epoch, since }),
                // Still passing replies on once the grace is over: it answers, and the next
                // wake-up looks again.
                Hang::WaitForReplies if Instant::now() >= until => return None,
                Hang::WaitForReplies => {}
            }
        }
    }
}
