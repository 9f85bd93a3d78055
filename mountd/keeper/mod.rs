//! `devremapd mount`: the keeper. It takes the mountpoint's lock, opens `/dev/fuse`, mounts,
//! writes the pid file and takes the signals, and it holds the FUSE connection for the mount's
//! whole life. It parses no input: the server (`devremapd serve`, [`crate::server`]), which it
//! starts as its child, loads the inputs and answers the kernel; the keeper relays whole FUSE
//! messages between `/dev/fuse` and the current server over a `SOCK_SEQPACKET` socket pair.
//!
//! So a server can die (a bug, the OOM killer, `SIGKILL`) or be replaced (`SIGUSR2`: an upgrade
//! to the binary now on disk) without the kernel noticing: the keeper starts another, replays
//! the kernel's INIT to it, hands it the node table the kernel holds, and sends it every
//! request still in flight ([`Relay`] decides the traffic, and [`devremap::keeper`] what a signal,
//! a server's readiness, its death or its hang leads to; this file reads, writes, spawns and
//! keeps the time). Requests
//! that arrive meanwhile wait. A crash restart runs the binary the dead server ran; an upgrade
//! runs the file now at the path the keeper was started from, and if that server fails to
//! start, load its inputs or agree on INIT, the old one serves on and its state file's
//! `last_error` says why.
//!
//! The relay runs on threads of its own ([`threads`]); the main thread runs the life below:
//! starting and replacing servers, signals, timers (a restart's backoff, an upgrade's deadline,
//! a hung server), readiness and the end of the mount. A server's invalidations come over its
//! control socket and are written to `/dev/fuse` by that socket's thread, which answers each
//! with the write's result: the write returns once the kernel has dropped the entry, so a
//! reload's state file is written after it, as before; and the kernel may hold a directory lock
//! for an invalidation until a reply has passed, which the reply thread must stay free to write.
//! Only the keeper ever holds `/dev/fuse`: a `SIGKILL` of the keeper ends the connection at
//! once, as it always did. Assumption: one daemon per mountpoint, enforced by the [`MountLock`]
//! held for the keeper's whole life.

mod threads;

use crate::cli::MountArgs;
use crate::mountpoint::{MountLock, check_private, detach, is_dead_mount, prepare_mountpoint, resolve};
use crate::signals;
use devremap::atomic::{Lasting, Written, write_atomic_told};
use devremap::io_message;
use devremap::keeper::control::{self as handover, Control, PROTOCOL};
use devremap::keeper::fuse_wire;
use devremap::keeper::relay::Relay;
use devremap::keeper::servers::{Hang, Phase, Policy, Probe, Reload, Upgrade, away, hang, probed};
use devremap::served::lifecycle::{Notice, Waited, wait};
use log::{info, warn};
use nix::errno::Errno;
use nix::mount::MntFlags;
use nix::sys::socket::{MsgFlags, Shutdown, send, shutdown};
use parking_lot::{Condvar, Mutex};
use sd_notify::NotifyState;
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use threads::{
    Link, Readers, Shared, mount, read_control, relay_replies, relay_requests, replies_waiting, seqpacket_pair,
};

/// How long an upgrade lets the old server answer what it has before the rest goes to the new.
const DRAIN: Duration = Duration::from_millis(500);
/// The first server's epoch: its errors before it is ready are the command's.
const FIRST_EPOCH: u64 = 1;
/// How long a retired server has to end before it is killed.
const RETIRE: Duration = Duration::from_secs(1);
/// How long the hang check waits for replies that have arrived to be passed on before it looks
/// again at the next wake-up.
const REPLY_GRACE: Duration = Duration::from_millis(100);

/// What the keeper's main loop acts on.
enum Ev {
    Reload,
    Upgrade,
    Stop(String),
    Control(u64, Control),
    /// A server's sockets ended: it exited.
    Gone(u64),
    /// The plan a server serves (`Loaded::to_bytes`), after each generation.
    Served(u64, Vec<u8>),
    Probed(u64, bool),
    /// `/dev/fuse` ended: unmounted (`Ok`) or aborted (ECONNABORTED).
    KernelEnded(io::Result<()>),
}

fn act(sig: i32) -> Option<Ev> {
    match sig {
        libc::SIGHUP => Some(Ev::Reload),
        libc::SIGUSR2 => Some(Ev::Upgrade),
        libc::SIGTERM | libc::SIGINT => Some(Ev::Stop(format!("signal {}", signals::signal_name(sig)))),
        _ => None,
    }
}

/// A server process.
struct Proc {
    epoch: u64,
    child: Child,
    socket: Arc<OwnedFd>,
    control: Arc<OwnedFd>,
    /// The binary it runs, kept open: the next crash restart runs the same one.
    exe: Arc<File>,
    /// It said it is ready (it answers, and its state file is written).
    ready: bool,
    /// Its reply thread holds a reply the relay has not counted yet ([`replies_waiting`]).
    passing: Arc<AtomicBool>,
}

impl Proc {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends it a control message without waiting: a server that no longer reads its control
    /// socket (hung, or stopped) must not block the keeper's main thread once the socket is
    /// full. A message that does not fit is logged; the keeper's timers deal with the server.
    fn tell(&self, message: &Control) {
        // Any other failure is a server that is gone, which its sockets' end tells.
        if send(self.control.as_raw_fd(), &message.encode(), MsgFlags::MSG_DONTWAIT) == Err(Errno::EAGAIN) {
            warn!("server pid {}: its control socket is full; {message:?} not sent", self.pid());
        }
    }

    /// Ends its relay and control sockets: it reads EOF and exits, and so does our reader.
    fn disconnect(&self) {
        let _ = shutdown(self.socket.as_raw_fd(), Shutdown::Both);
        let _ = shutdown(self.control.as_raw_fd(), Shutdown::Both);
    }
}

/// A server starting to take over from the current one (or from none, after a crash).
struct Replacement {
    proc: Proc,
    crashed: bool,
    deadline: Instant,
    /// Why it failed, when it said so before exiting.
    failed: Option<String>,
    /// It serves the plan it was handed, not the inputs.
    handed_plan: bool,
}

struct Keeper {
    link: Arc<Link>,
    mountpoint: PathBuf,
    m: String,
    /// The arguments after `mount`, given to every server after `serve`.
    args: Vec<OsString>,
    /// The path the keeper was started from: an upgrade runs what is there now.
    exe_path: PathBuf,
    reload_timeout: Duration,
    server_timeout: Duration,
    next_epoch: u64,
    current: Option<Proc>,
    replacing: Option<Replacement>,
    /// Servers replaced by an upgrade, until they have exited.
    leaving: Vec<Proc>,
    mounted: bool,
    /// The mount answered through the first server and the pid file is written: a server that
    /// dies from now on is replaced, not the end of the start.
    started: bool,
    /// What a signal or a server's readiness or loss leads to ([`Policy`]).
    policy: Policy,
    /// Why the first server failed, as it said before exiting: the command's error.
    start_error: Option<String>,
    /// When the next start after a failed one is due.
    retry_at: Option<Instant>,
    pid_written: Option<Written>,
    state_file: Option<PathBuf>,
    /// The binary of the last server that took over: a crash restart runs it again (the file
    /// at `exe_path` may be a newer one that was never tried).
    good: Arc<File>,
    /// The last server lost, and how (`it died`, `it hung`), named by the one that takes over.
    dead: Option<(u32, &'static str)>,
    /// The plan the current server serves, opaque: a server restarted after a crash serves it,
    /// reading no input (an input that changed since, or made the server die, waits for a reload).
    plan: Option<Vec<u8>>,
}

/// The path the keeper was started by, unresolved: `argv[0]` made absolute, or, for a bare
/// name, the first file of that name on `PATH` (as the shell found it); `None` when that is
/// not the binary we run (`exec -a`). An upgrade opens the file this path names then, so an
/// install that switches a symlink (alternatives, stow, `/opt/x-<version>`) upgrades to the
/// binary the link names now: `current_exe` reads `/proc/self/exe`, where every symlink is
/// already resolved to the old binary.
fn started_as(running: &File) -> Option<PathBuf> {
    let argv0 = PathBuf::from(std::env::args_os().next()?);
    let path = if argv0.as_os_str().as_encoded_bytes().contains(&b'/') {
        std::path::absolute(&argv0).ok()?
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?).map(|dir| dir.join(&argv0)).find(|p| p.is_file())?
    };
    let (named, ours) = (std::fs::metadata(&path).ok()?, running.metadata().ok()?);
    (named.dev() == ours.dev() && named.ino() == ours.ino()).then(|| std::path::absolute(&path).ok()).flatten()
}

/// A server's exit status in words: `exit status 1`, `signal 9 (SIGKILL)`.
fn status_text(status: io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => match s.signal() {
            Some(sig) => format!("signal {sig} ({})", signals::signal_name(sig)),
            None => format!("exit status {}", s.code().unwrap_or(-1)),
        },
        Err(e) => format!("unknown status: {}", io_message(&e)),
    }
}

pub fn run(args: &MountArgs) -> Result<(), String> {
    // First: a SIGHUP or SIGTERM sent as soon as we were started must not end us.
    let (tx, rx) = mpsc::channel();
    signals::start(tx.clone(), act, "")?;
    args.check_files()?;
    if !nix::unistd::geteuid().is_root() {
        return Err("devremapd mount needs root: only root can mount a FUSE filesystem whose device nodes open \
                    devices (the `dev` mount option)"
            .into());
    }
    let m = args.mountpoint.display().to_string();
    // Every directory above it is root's alone (check_private), so the canonical path stays
    // the one checked; a symlink in the path as given could not be trusted to.
    let mountpoint = resolve(&args.mountpoint)?;
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
    let exe =
        Arc::new(File::open("/proc/self/exe").map_err(|e| format!("cannot open our own binary: {}", io_message(&e)))?);
    let exe_path = started_as(&exe)
        .map_or_else(std::env::current_exe, Ok)
        .map_err(|e| format!("cannot find our own binary: {}", io_message(&e)))?;
    let dev = File::options()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| format!("/dev/fuse: {}", io_message(&e)))?;
    let link = Arc::new(Link {
        shared: Mutex::new(Shared { relay: Relay::default(), sockets: HashMap::new() }),
        answered: Condvar::new(),
        dev,
        events: tx,
        buffers: Mutex::new(Vec::new()),
        state_files: Mutex::new(Vec::new()),
    });
    let mut keeper = Keeper {
        link,
        mountpoint,
        m,
        args: std::env::args_os().skip(2).collect(),
        exe_path,
        reload_timeout: Duration::from_secs(args.reload_timeout),
        server_timeout: Duration::from_secs(args.server_timeout),
        next_epoch: FIRST_EPOCH,
        current: None,
        replacing: None,
        leaving: Vec::new(),
        mounted: false,
        started: false,
        policy: Policy::default(),
        start_error: None,
        retry_at: None,
        pid_written: None,
        state_file: args.state_file.clone(),
        good: exe.clone(),
        dead: None,
        plan: None,
    };
    keeper.current = Some(keeper.spawn(exe, None).map_err(|e| format!("cannot start the server: {}", io_message(&e)))?);
    let result = keeper.serve(&rx, args);
    keeper.pid_written.iter().for_each(Written::remove_if_ours);
    if crate::logging::dropped() > 0 {
        warn!("{} log lines were dropped: stderr was not being read", crate::logging::dropped());
    }
    result
}

fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), String> {
    std::thread::Builder::new().name(name.into()).spawn(f).map(drop).map_err(|e| format!("cannot start a thread: {e}"))
}

impl Keeper {
    /// Starts a server running `exe`, with its relay socket as fd 3 and its control socket as
    /// fd 4, and the threads that read them; tells it to serve `plan`, or to load the inputs.
    fn spawn(&mut self, exe: Arc<File>, plan: Option<&[u8]>) -> io::Result<Proc> {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let (socket, their_socket) = seqpacket_pair()?;
        let (control, their_control) = seqpacket_pair()?;
        let (fds, exe_fd) = ([their_socket.as_raw_fd(), their_control.as_raw_fd()], exe.as_raw_fd());
        let mut cmd = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()));
        cmd.arg0("devremapd").arg("serve").args(&self.args).stdin(Stdio::null());
        // Only the keeper talks to systemd (the main process); the server tells the keeper.
        cmd.env_remove("NOTIFY_SOCKET");
        // SAFETY: between fork and exec the closure makes only async-signal-safe calls (fcntl,
        // prctl, dup2, close) on fds it owns in the child. The copies above 10 keep one source from
        // being overwritten by the other's dup2 to 3 or 4; dup2 clears close-on-exec. The binary's
        // fd stays open across exec (an interpreter of a script reads it by that name) and is
        // never 3 or 4 (the signal thread's, for the keeper's life).
        unsafe {
            cmd.pre_exec(move || {
                if exe_fd == 3 || exe_fd == 4 || libc::fcntl(exe_fd, libc::F_SETFD, 0) < 0 {
                    return Err(io::Error::from_raw_os_error(libc::EBADF));
                }
                // A server dies with its keeper, even one stopped (SIGSTOP) that would never read
                // the end of its socket. (The keeper's main thread, which spawns, lives as long.)
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                    return Err(io::Error::last_os_error());
                }
                let high = fds.map(|fd| libc::fcntl(fd, libc::F_DUPFD, 10));
                for (from, to) in high.into_iter().zip([3, 4]) {
                    if from < 0 || libc::dup2(from, to) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    libc::close(from);
                }
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        // The child has its copies: ours would keep its sockets open after it died, and a
        // write to them would wait for ever instead of failing.
        drop((their_socket, their_control));
        let (socket, control) = (Arc::new(socket), Arc::new(control));
        self.link.shared.lock().sockets.insert(epoch, socket.clone());
        let readers = Arc::new(AtomicU8::new(2));
        let done = || Readers(readers.clone(), epoch, self.link.events.clone());
        let passing = Arc::new(AtomicBool::new(false));
        let (link, reader, replies_done, flag) = (self.link.clone(), socket.clone(), done(), passing.clone());
        let spawned = spawn_thread("replies", move || relay_replies(&link, epoch, &reader, &flag, replies_done))
            .and_then(|()| {
                let (link, control, control_done) = (self.link.clone(), control.clone(), done());
                spawn_thread("control", move || read_control(&link, epoch, &control, control_done))
            });
        let proc = Proc { epoch, child, socket, control, exe, ready: false, passing };
        if let Err(e) = spawned {
            self.kill(proc);
            return Err(io::Error::other(e));
        }
        // Written by a thread of its own: a plan larger than the socket's buffer waits for the
        // server to read it, and the main thread must not.
        let (what, to) = (plan.map_or_else(|| vec![Control::Load.encode()], handover::records), proc.control.clone());
        let _ = spawn_thread("hand-plan", move || {
            for record in what {
                if nix::unistd::write(&*to, &record).is_err() {
                    break;
                }
            }
        });
        Ok(proc)
    }

    /// Kills a server and forgets it. It is reaped by a thread of its own: a process killed
    /// while it waits for a FUSE request that a stuck filesystem's daemon has read (an input on
    /// a hung mount) dies only once that request is answered, and the keeper must not wait.
    fn kill(&mut self, mut proc: Proc) {
        let _ = proc.child.kill();
        self.forget(proc);
    }

    /// Forgets a server that has ended or is ending, and reaps it on a thread of its own.
    fn forget(&mut self, mut proc: Proc) {
        proc.disconnect();
        self.link.shared.lock().sockets.remove(&proc.epoch);
        let _ = std::thread::Builder::new().name("reaper".into()).spawn(move || drop(proc.child.wait()));
    }

    /// The longest the main thread sleeps while a server answers: a wake-up later than this
    /// past its deadline means the keeper itself did not run ([`Keeper::woke`]).
    fn heartbeat(&self) -> Duration {
        self.server_timeout / 4
    }

    fn deadline(&self) -> Option<Instant> {
        // While a server answers, wake when its oldest request would make it hung, and at least
        // every heartbeat, so that a late wake-up tells that the keeper was away.
        let hung = self.current.as_ref().filter(|p| p.ready).map(|_| {
            let oldest = self.link.shared.lock().relay.oldest_sent();
            let now = Instant::now();
            oldest.map_or(now + self.server_timeout, |t| t + self.server_timeout).min(now + self.heartbeat())
        });
        [self.retry_at, self.replacing.as_ref().map(|r| r.deadline), hung].into_iter().flatten().min()
    }

    /// The main thread woke at `now` from a wait until `deadline`. Woken more than a heartbeat
    /// late, the keeper did not run meanwhile (SIGSTOP, or starved of CPU): requests it had
    /// decided to send may not have been written, and replies may wait unread, so the server's
    /// clock starts again. (A false "hung" needs a keeper away for at least `--server-timeout`:
    /// it is then at least three heartbeats late.)
    fn woke(&mut self, deadline: Option<Instant>, now: Instant) {
        let Some(late) = away(deadline, now, self.heartbeat()) else { return };
        if self.current.as_ref().is_some_and(|p| p.ready) {
            info!(
                "the keeper did not run for {} ms (stopped, or starved of CPU): its server gets a new --server-timeout",
                late.as_millis()
            );
            self.link.shared.lock().relay.restart_clocks(now);
        }
    }

    /// The keeper's life, from the first server's start to the end of the mount.
    fn serve(&mut self, rx: &Receiver<Ev>, args: &MountArgs) -> Result<(), String> {
        loop {
            let deadline = self.deadline();
            let waited = wait(rx, deadline);
            self.woke(deadline, Instant::now());
            let ev = match waited {
                Waited::Event(ev) => ev,
                Waited::Deadline => {
                    self.timer();
                    continue;
                }
                Waited::Closed => return self.stop("the event channel closed", rx),
            };
            match ev {
                Ev::Reload => {
                    let reload = self.policy.sighup(self.phase());
                    self.reload(reload);
                }
                Ev::Upgrade => {
                    let upgrade = self.policy.upgrade(self.phase());
                    self.upgrade(upgrade);
                }
                Ev::Stop(why) => return self.stop(&why, rx),
                Ev::KernelEnded(result) => return self.ended(result),
                Ev::Gone(epoch) => self.gone(epoch)?,
                Ev::Control(epoch, message) => self.control(epoch, message, args)?,
                Ev::Probed(epoch, same) => self.probed(epoch, same),
                Ev::Served(epoch, plan) if self.current.as_ref().is_some_and(|p| p.epoch == epoch) => {
                    self.plan = Some(plan)
                }
                Ev::Served(..) => {}
            }
        }
    }

    /// Where the keeper is, from the servers it has.
    fn phase(&self) -> Phase {
        match (&self.current, &self.replacing) {
            _ if !self.started => Phase::Starting,
            (Some(p), Some(_)) if p.ready => Phase::Upgrading,
            (Some(p), None) if p.ready => Phase::Serving,
            _ => Phase::Replacing,
        }
    }

    fn reload(&mut self, reload: Reload) {
        match (reload, &self.current) {
            (Reload::Now | Reload::NowAndOnceServing, Some(p)) => {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid() as i32), nix::sys::signal::SIGHUP);
            }
            // A server that is starting loads the inputs as they are now (or serves the plan it
            // was handed); one more reload once serving, as the inputs may have changed.
            _ if !self.started => info!("signal SIGHUP while starting: reloading once serving"),
            _ => info!("signal SIGHUP while a server takes over: reloading once it serves"),
        }
    }

    /// `SIGUSR2`: starts the binary now at the path we were started from, to take over.
    fn upgrade(&mut self, upgrade: Upgrade) {
        match upgrade {
            Upgrade::Ignored => return info!("signal SIGUSR2: ignored, an upgrade is under way"),
            // A server starting (the first, or one taking over after a crash) serves first.
            Upgrade::OnceServing => return info!("signal SIGUSR2 while a server starts: upgrading once it serves"),
            Upgrade::Start => {}
        }
        let path = self.exe_path.display().to_string();
        let started = File::open(&self.exe_path).and_then(|exe| self.spawn(Arc::new(exe), None));
        match started {
            Ok(proc) => {
                info!("upgrade: started {path} as server pid {}", proc.pid());
                self.replacing = Some(Replacement {
                    proc,
                    crashed: false,
                    deadline: Instant::now() + self.reload_timeout,
                    failed: None,
                    handed_plan: false,
                });
            }
            Err(e) => self.refuse(format!("upgrade refused: {path}: {}", io_message(&e))),
        }
    }

    /// An upgrade that did not happen: logged, and recorded by the serving server.
    fn refuse(&mut self, why: String) {
        warn!("{why}; the running server serves on");
        if let Some(current) = &self.current {
            current.tell(&Control::Refused(why));
        }
    }

    /// Starts a server to take over after a crash, from the binary the dead one ran.
    fn restart(&mut self) {
        let exe = self.good.clone();
        self.retry_at = None;
        let plan = self.plan.clone();
        match self.spawn(exe, plan.as_deref()) {
            Ok(proc) => {
                self.replacing = Some(Replacement {
                    proc,
                    crashed: true,
                    deadline: Instant::now() + self.reload_timeout,
                    failed: None,
                    handed_plan: plan.is_some(),
                })
            }
            Err(e) => {
                warn!("cannot start a server: {}", io_message(&e));
                self.retry_later();
            }
        }
    }

    fn retry_later(&mut self) {
        let backoff = self.policy.failed();
        self.retry_at_in(backoff);
    }

    fn retry_at_in(&mut self, backoff: Duration) {
        warn!("starting another server in {} ms; requests wait until one serves", backoff.as_millis());
        self.retry_at = Some(Instant::now() + backoff);
    }

    /// Whether the current server has left a request unanswered for `--server-timeout`, counting
    /// the replies it has sent: those that arrived and are not yet passed on are waited for (a
    /// little, [`REPLY_GRACE`]), and while any remain it is not hung.
    fn hung_since(&self, now: Instant) -> Option<Instant> {
        let p = self.current.as_ref().filter(|p| p.ready)?;
        let mut shared = self.link.shared.lock();
        let until = now + REPLY_GRACE;
        loop {
            let oldest = shared.relay.oldest_sent();
            match hang(oldest, now, self.server_timeout, replies_waiting(&p.socket, &p.passing)) {
                Hang::No => return None,
                Hang::Hung(since) => return Some(since),
                Hang::WaitForReplies => {
                    if self.link.answered.wait_until(&mut shared, until).timed_out() {
                        // Still passing replies on: it answers, and the next wake-up looks again.
                        return None;
                    }
                }
            }
        }
    }

    fn timer(&mut self) {
        let now = Instant::now();
        if let Some(since) = self.hung_since(now)
            && let Some(p) = self.current.take()
        {
            warn!(
                "server pid {} has left a request unanswered for {} s: hung; killing it and starting another to take over",
                p.pid(),
                now.duration_since(since).as_secs()
            );
            self.link.shared.lock().relay.lost(p.epoch);
            self.replace_lost(&p, "it hung");
            self.kill(p);
        }
        if self.retry_at.is_some_and(|t| t <= now) {
            self.retry_at = None;
            // Unless a server took over meanwhile (an upgrade).
            if self.current.is_none() && self.replacing.is_none() {
                self.restart();
            }
        }
        if let Some(r) = self.replacing.take_if(|r| r.deadline <= now) {
            let (crashed, pid) = (r.crashed, r.proc.pid());
            let secs = self.reload_timeout.as_secs();
            self.kill(r.proc);
            if crashed {
                warn!(
                    "server pid {pid} did not take over within {secs} s (an input on a stuck filesystem?); killed it"
                );
                self.retry_later();
            } else {
                self.refuse(format!("upgrade refused: the new server did not load its inputs within {secs} s"));
            }
        }
    }

    /// The current server `p` is gone (dead, or killed as hung): another takes over, from the
    /// same binary and with its plan; a reload it was asked for is asked again; an upgrade
    /// under way is dropped.
    fn replace_lost(&mut self, p: &Proc, how: &'static str) {
        self.dead = Some((p.pid(), how));
        self.good = p.exe.clone();
        let lost = self.policy.lost(p.ready);
        if !lost.reload {
            warn!(
                "two servers in a row died in the middle of a reload; the next serves the last plan and reloads only on SIGHUP (the inputs may be what kills them)"
            );
        }
        // An upgrade under way is dropped: the dead server's binary and plan take over at
        // once, rather than waiting for an untried binary still loading its inputs.
        if let Some(r) = self.replacing.take() {
            warn!("upgrade abandoned: the serving server died while server pid {} was starting", r.proc.pid());
            self.kill(r.proc);
        }
        match lost.retry_in {
            None => self.restart(),
            Some(backoff) => self.retry_at_in(backoff),
        }
    }

    /// A server's sockets ended: it exited.
    fn gone(&mut self, epoch: u64) -> Result<(), String> {
        if let Some(mut p) = self.current.take_if(|p| p.epoch == epoch) {
            let status = status_text(p.child.wait());
            self.link.shared.lock().sockets.remove(&epoch);
            self.link.shared.lock().relay.lost(epoch);
            p.disconnect();
            if let Some(why) = self.start_error.take() {
                return Err(self.start_failed(why));
            }
            if !self.started {
                return Err(self.start_failed(format!("the server exited before it was ready ({status})")));
            }
            warn!("server pid {} exited ({status}); starting another to take over", p.pid());
            self.replace_lost(&p, "it died");
        } else if let Some(mut r) = self.replacing.take_if(|r| r.proc.epoch == epoch) {
            let status = status_text(r.proc.child.wait());
            self.link.shared.lock().sockets.remove(&epoch);
            r.proc.disconnect();
            let why = r.failed.take().unwrap_or_else(|| format!("it exited ({status})"));
            if r.crashed {
                warn!("server pid {} could not take over: {why}", r.proc.pid());
                self.retry_later();
            } else {
                self.refuse(format!("upgrade refused: the new server could not take over: {why}"));
            }
        } else if let Some(i) = self.leaving.iter().position(|p| p.epoch == epoch) {
            // A retired server may be ending only once a stuck filesystem answers: reaped off the
            // main thread, as a killed one is.
            let p = self.leaving.swap_remove(i);
            self.forget(p);
        }
        Ok(())
    }

    fn control(&mut self, epoch: u64, message: Control, args: &MountArgs) -> Result<(), String> {
        let is_current = self.current.as_ref().is_some_and(|p| p.epoch == epoch);
        match message {
            Control::Loaded(protocol) if protocol != PROTOCOL => {
                let why = format!("it speaks keeper protocol {protocol}, this keeper speaks protocol {PROTOCOL}");
                if is_current && !self.mounted {
                    return Err(self.start_failed(format!("the server cannot serve: {why}")));
                }
                if let Some(r) = self.replacing.take_if(|r| r.proc.epoch == epoch) {
                    let crashed = r.crashed;
                    self.kill(r.proc);
                    if crashed {
                        warn!("a server to take over cannot: {why}");
                        self.retry_later();
                    } else {
                        self.refuse(format!(
                            "upgrade refused: the new binary cannot take over: {why}; restart the daemon to use it"
                        ));
                    }
                }
            }
            Control::Loaded(_) if is_current && !self.mounted => self.mount_now(args)?,
            Control::Loaded(_) => {
                let init = self.link.shared.lock().relay.probe(epoch);
                // Probed with the kernel's INIT; it takes over once it answers alike.
                if let (Some(init), Some(r)) = (init, self.replacing.as_ref().filter(|r| r.proc.epoch == epoch)) {
                    let _ = nix::unistd::write(&*r.proc.socket, &init);
                }
            }
            // The first server: its error is the command's, said once it has exited.
            // (A server sends it only before it is ready.)
            Control::Failed(why) if is_current && epoch == FIRST_EPOCH => self.start_error = Some(why),
            Control::Failed(why) => match self.replacing.as_mut().filter(|r| r.proc.epoch == epoch) {
                Some(r) => r.failed = Some(why),
                // A server that took over and then failed: its exit is logged next, with this.
                None if is_current => warn!("server pid {}: {why}", self.current.as_ref().map_or(0, Proc::pid)),
                None => {}
            },
            // The mount answers through the server: the pid file first, then it may declare
            // the daemon ready (the state file). A server taking over finds it written.
            Control::Answering if is_current => {
                if let Some(pid_file) = args.pid_file.as_ref().filter(|_| self.pid_written.is_none()) {
                    let pid = format!("{}\n", std::process::id());
                    let written = write_atomic_told(pid_file, pid.as_bytes(), None, Lasting::UntilReboot, |_| {});
                    match written {
                        Ok(w) => self.pid_written = Some(w),
                        Err(e) => {
                            let why = format!("{}: cannot write the pid file: {}", pid_file.display(), io_message(&e));
                            return Err(self.start_failed(why));
                        }
                    }
                }
                if let Some(p) = &self.current {
                    p.tell(&Control::Proceed);
                }
                // Mounted, answering, the pid file written: from now on a server that dies is
                // replaced, even if it had not yet said it was ready.
                self.started = true;
            }
            Control::Status { generation, last_error } => {
                self.link.shared.lock().relay.set_status(epoch, generation, last_error)
            }
            Control::Notify(notice) if is_current => {
                self.policy.notice(notice);
                if notice == Notice::Ready
                    && let Some(p) = self.current.as_mut().filter(|p| !p.ready)
                {
                    p.ready = true;
                    let due = self.policy.ready();
                    if due.reload {
                        let reload = self.policy.reload(self.phase());
                        self.reload(reload);
                    }
                    if due.upgrade {
                        let upgrade = self.policy.upgrade(self.phase());
                        self.upgrade(upgrade);
                    }
                }
                notify(notice);
            }
            _ => {}
        }
        Ok(())
    }

    /// The first server loaded its inputs: mount, and write the pid file. The server declares
    /// the daemon ready once the mount answers through it.
    fn mount_now(&mut self, args: &MountArgs) -> Result<(), String> {
        let Some(first) = &self.current else { return Ok(()) };
        let resume = self.link.shared.lock().relay.start(first.epoch);
        for record in resume.records() {
            let _ = nix::unistd::write(&*first.control, &record);
        }
        if let Err(e) = mount(&self.link.dev, &self.mountpoint) {
            return Err(self.start_failed(format!("{}: cannot mount: {}", self.m, io_message(&e.into()))));
        }
        self.mounted = true;
        let link = self.link.clone();
        spawn_thread("requests", move || relay_requests(&link))?;
        let events = self.link.events.clone();
        crate::watch::spawn(args.owner_pid, args.container_pid_file.clone(), move |why| {
            let _ = events.send(Ev::Stop(why));
        });
        Ok(())
    }

    /// A start that failed: nothing is left behind (no server, no mount); returns `why`.
    fn start_failed(&mut self, why: String) -> String {
        if let Some(p) = self.current.take() {
            self.kill(p);
        }
        if self.mounted {
            if nix::mount::umount2(&self.mountpoint, MntFlags::empty()).is_err() {
                detach(&self.mountpoint);
            }
            self.mounted = false;
        }
        why
    }

    /// A replacement answered the INIT replay: it takes over, unless an upgrade disagrees.
    fn probed(&mut self, epoch: u64, same: bool) {
        let Some(r) = self.replacing.take_if(|r| r.proc.epoch == epoch) else { return };
        let differs = match probed(same, r.crashed) {
            Probe::TakeOver { differs } => differs,
            Probe::Refuse => {
                self.kill(r.proc);
                self.refuse(
                "upgrade refused: the new binary negotiates other FUSE parameters with the kernel; restart the daemon \
                 to use it"
                    .into(),
                );
                return;
            }
        };
        if differs {
            warn!(
                "server pid {} negotiates other FUSE parameters than the kernel agreed to; it serves anyway",
                r.proc.pid()
            );
        }
        if !r.crashed {
            let mut shared = self.link.shared.lock();
            // The old server answers what it has; new requests wait here meanwhile.
            shared.relay.hold();
            let until = Instant::now() + DRAIN;
            while !shared.relay.drained() && !self.link.answered.wait_until(&mut shared, until).timed_out() {}
            drop(shared);
            // Then it ends, before the new one serves: a reload it was finishing can no longer
            // write a state file over its successor's.
            if let Some(old) = &self.current {
                old.tell(&Control::Retire);
                if !crate::watch::exits_within(old.pid(), RETIRE) {
                    warn!(
                        "server pid {} did not end within {} ms of its retirement; killed it",
                        old.pid(),
                        RETIRE.as_millis()
                    );
                    let _ =
                        nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.pid() as i32), nix::sys::signal::SIGKILL);
                }
            }
        }
        let mut switch = self.link.shared.lock().relay.switch(epoch, Instant::now());
        let how = match (&self.current, self.dead) {
            (Some(old), _) if !r.crashed => format!("from server pid {} (an upgrade)", old.pid()),
            (_, Some((dead, how))) if r.handed_plan => format!("from server pid {dead} ({how}; serving its plan)"),
            (_, Some((dead, how))) => format!("from server pid {dead} ({how})"),
            _ => "(the server before it died)".to_owned(),
        };
        switch.resume.from = format!("{how}, {} requests resent", switch.resend.len());
        if !r.crashed {
            switch.resume.previous_plan = self.plan.as_deref().and_then(|p| String::from_utf8(p.to_vec()).ok());
        }
        // Written by a thread of its own, outside the relay's lock: the resume (with the whole
        // previous plan, at an upgrade) can be larger than the socket's buffer, and a successor
        // that stops reading would otherwise block every request and the main thread. The
        // server reads the resume before it reads a request, and requests that arrive
        // meanwhile are independent of those resent (each is answered on its own), so the
        // order between the two sockets does not matter.
        let (records, resend) = (switch.resume.records(), std::mem::take(&mut switch.resend));
        let (control, socket) = (r.proc.control.clone(), r.proc.socket.clone());
        let _ = spawn_thread("hand-over", move || {
            let writes = records.iter().map(|m| (&control, m)).chain(resend.iter().map(|m| (&socket, m)));
            for (to, message) in writes {
                // A successor that died: its own end is seen by the main thread.
                if nix::unistd::write(&**to, message).is_err() {
                    break;
                }
            }
        });
        for (unique, opcode) in &switch.give_up {
            warn!("request {unique} (opcode {opcode}) was in flight at three server deaths: answered EIO");
            let _ = nix::unistd::write(&self.link.dev, &fuse_wire::error_reply(*unique, libc::EIO));
        }
        // The new server logs the takeover, with what it kept of the kernel's nodes.
        if let Some(o) = self.current.take() {
            o.disconnect();
            self.leaving.push(o);
        }
        self.good = r.proc.exe.clone();
        self.current = Some(r.proc);
        // A restart that was due is not needed any more (this may be an upgrade after a crash).
        self.retry_at = None;
    }

    /// SIGTERM, SIGINT, or the watched container gone: unmount, stop the server.
    fn stop(&mut self, why: &str, rx: &Receiver<Ev>) -> Result<(), String> {
        info!("{why}: stopping");
        notify(Notice::Stopping);
        if self.mounted {
            match nix::mount::umount2(&self.mountpoint, MntFlags::empty()) {
                // Unmounted here; the connection ends once no other mount holds it. A
                // container's bind mount of it does: then exiting ends it, and the container
                // sees ENOTCONN.
                Ok(()) => {
                    let deadline = Instant::now() + Duration::from_millis(500);
                    let ended = loop {
                        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                            Ok(Ev::KernelEnded(_)) | Err(RecvTimeoutError::Disconnected) => break true,
                            Ok(_) => {}
                            Err(RecvTimeoutError::Timeout) => break false,
                        }
                    };
                    if ended {
                        info!("unmounted {}", self.m);
                    } else {
                        warn!(
                            "unmounted {}, but other mounts of it (a container's /dev?) remain; they lose their /dev as we exit",
                            self.m
                        );
                    }
                }
                // Busy (a process has its cwd in it): detach; the same holds for its last users.
                Err(e) => {
                    warn!(
                        "{}: unmount failed ({}); detached it, and what still holds it loses its /dev as we exit",
                        self.m,
                        io_message(&e.into())
                    );
                    detach(&self.mountpoint);
                }
            }
        }
        self.end_servers();
        Ok(())
    }

    /// Tells the server that the daemon stops (it removes the state file) and waits a little
    /// for it; kills whatever is left. A state file no server removed (none was serving, or it
    /// was stopped and killed) is removed here if it is still a file one of them wrote.
    fn end_servers(&mut self) {
        if let Some(p) = self.current.take() {
            p.tell(&Control::Stop);
            // It removes the state file and exits; whatever is left then is killed.
            crate::watch::exits_within(p.pid(), Duration::from_secs(2));
            self.kill(p);
        }
        for p in self.replacing.take().map(|r| r.proc).into_iter().chain(std::mem::take(&mut self.leaving)) {
            self.kill(p);
        }
        // Never read: a file at the path is removed only if it is one our servers wrote (a
        // file another user put there may be of any size, and is theirs).
        if let Some(path) = &self.state_file {
            for identity in self.link.state_files.lock().drain(..) {
                Written::known(path, identity).remove_if_ours();
            }
        }
    }

    /// `/dev/fuse` ended without a stop. A clean outside `umount` ends it with ENODEV (`Ok`):
    /// exit 0. An aborted connection (`umount -f`, a write to `/sys/fs/fuse/connections/N/abort`)
    /// ends it with ECONNABORTED (the server asks for `FUSE_ABORT_ERROR`) and may leave a dead
    /// mount answering ENOTCONN (when it was busy): detach that and fail, so that a supervisor
    /// (systemd's `Restart=on-failure`) starts a new daemon.
    fn ended(&mut self, result: io::Result<()>) -> Result<(), String> {
        self.end_servers();
        let aborted = result.as_ref().err().and_then(io::Error::raw_os_error) == Some(libc::ECONNABORTED);
        if is_dead_mount(&self.mountpoint) {
            detach(&self.mountpoint);
            return Err(format!("{}: the FUSE connection was aborted; detached the dead mount", self.m));
        }
        match result {
            _ if aborted => return Err(format!("{}: the FUSE connection was aborted", self.m)),
            Ok(()) => info!("{}: unmounted from outside", self.m),
            Err(e) => warn!("{}: the FUSE connection ended: {}", self.m, io_message(&e)),
        }
        Ok(())
    }
}

/// Tells systemd, when it started us with a notify socket (`Type=notify` or `notify-reload`,
/// which shows the unit as reloading until `READY=1`); without one this does nothing.
fn notify(notice: Notice) {
    let states = match notice {
        Notice::Ready => vec![NotifyState::Ready],
        Notice::Stopping => vec![NotifyState::Stopping],
        Notice::Reloading => {
            let mut reloading = vec![NotifyState::Reloading];
            reloading.extend(NotifyState::monotonic_usec_now().ok());
            reloading
        }
    };
    if let Err(e) = sd_notify::notify(&states) {
        warn!("cannot notify systemd: {}", io_message(&e));
    }
}
