//! `devremapd node`: one daemon per host through which every container's `/dev` is served
//! (issue 31). `devremap-runtime` asks it over its socket to mount a container's `/dev`, then
//! replaces itself with the runtime; `devremapd ctl` asks it what it serves and to reload.
//!
//! Each container keeps its own keeper (`devremapd mount`, [`crate::keeper`]), started by this
//! daemon with the container's flags: its own FUSE connection, mountpoint, tree, state file and
//! log, its crash and upgrade survival, its reloads on its own. This daemon is the table of
//! them ([`devremap::node::registry`]), the socket, and the one who tears a container's
//! directory down once its keeper has exited (its container is gone: the keeper watches the
//! container's init). Its own death touches no container: the keepers run on, and a daemon
//! started again adopts them from the state dir.
//!
//! Threads: the main one takes events (signals, a keeper's exit, the idle timer); one accepts
//! connections; each connection has its own, for its one request (at most [`MAX_CLIENTS`] at
//! once); each keeper one that waits on its pidfd (a small stack), so nothing here ever waits
//! on a keeper but its own request. With `--nri`, one more is containerd's NRI plugin
//! ([`nri`]), which nothing else waits on. Assumption: one node daemon per state dir, held by the
//! lock on `<state_dir>/node.lock` for the daemon's whole life.

pub mod ctl;
mod error;
mod nri;
mod nri_handler;
mod spare;

#[path = "../runtime/config_file.rs"]
mod config_file;

mod exits;
#[path = "../runtime/procs.rs"]
mod procs;

use crate::signals::{self, Acted};
use devremap::node::protocol::{self, Answer, Entry, MountRequest, Request};
use devremap::node::registry::{Adopt, Found, Registry};
use devremap::node::reload::Reloads;
use devremap::node::sweep::{Leftover, Sweep};
use devremap::pidfd::Child;
use devremap::runtime::argv::ContainerId;
use devremap::runtime::container_daemon::Container;
use devremap::runtime::container_daemon::daemon::DaemonArgs;
pub use error::NodeError;
use log::{info, warn};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use parking_lot::{Condvar, Mutex};
use procs::Host;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

use crate::cli::NodeArgs;

/// Requests handled at once; one more is answered "busy" at once.
const MAX_CLIENTS: usize = 256;
/// How long a client may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a reload may take before `reload` answers without it.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a service waits for a wrapper's daemon to go: longer than a start under way there
/// may take (its wait for a keeper, 30 s), which that daemon finishes first.
const TAKE_OVER_PATIENCE: Duration = Duration::from_secs(40);
/// How long a teardown waits for the runtime holding a container's lock to exit.
const TEARDOWN_PATIENCE: Duration = Duration::from_secs(30);
/// How large a container's log grows before its last lines are moved to `devremapd.log.1` (so
/// at most about twice this, and a sweep's worth, on `/run` for each container).
const LOG_KEPT: u64 = 256 << 10;
/// How often directories no one has are looked for ([`Node::sweep_every`]).
const SWEEP_EVERY: Duration = Duration::from_secs(10);

enum Ev {
    Signal(Acted),
    /// A keeper exited (reaped when it was our child).
    Exited(u32),
    /// A node daemon started as a service asked this one, a wrapper's, to make way.
    Yield,
}

fn act(sig: i32) -> Option<Ev> {
    signals::acted(sig).map(Ev::Signal)
}

struct Node {
    state_dir: PathBuf,
    /// The binary each container's keeper runs: the path this daemon was started from (an
    /// upgrade of a keeper runs what is there then).
    exe: PathBuf,
    /// The spare keeper each mount hands its container to.
    spares: spare::Spares,
    registry: Mutex<Registry>,
    /// Set once an idle daemon goes: a connection accepted after it is dropped unanswered (its
    /// client asks again, and starts a daemon).
    closing: Mutex<bool>,
    clients: AtomicUsize,
    events: Sender<Ev>,
    holds: Arc<Holds>,
    /// The thread that waits for the keepers and the lock holders to exit.
    exits: exits::Exits,
    /// Started by a wrapper (`--idle-exit`): it makes way for a service when asked.
    yields: bool,
    /// `--threads`, given to every container's server.
    threads: u16,
    /// `--rest-after`, given to every container's keeper.
    rest_after: u64,
}

/// The starter's `--ready-fd`: a newline once the socket answers; a start that fails leaves
/// it open until the process exits, after its `error:` line (found in CI: closed as the start
/// failed, the pipe's end let the wrapper read the log before the line was in it).
struct Ready(Option<std::fs::File>);

impl Ready {
    fn say(mut self) {
        if let Some(mut ready) = self.0.take() {
            let _ = ready.write_all(b"\n");
        }
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        if let Some(unsaid) = self.0.take() {
            std::mem::forget(unsaid);
        }
    }
}

pub fn run(args: &NodeArgs) -> Result<(), NodeError> {
    let ready = Ready(args.ready_fd.map(crate::keeper::claim_ready_fd).transpose()?);
    raise_open_files_limit();
    // The test hook `DEVREMAPD_FAILPOINT=node-start-stall`: a start that never ends (as one
    // stopped, or stuck on its state dir's file system), for its starter's patience.
    #[cfg(feature = "test-hooks")]
    if std::env::var("DEVREMAPD_FAILPOINT").is_ok_and(|f| f == "node-start-stall") {
        loop {
            std::thread::park();
        }
    }
    let (tx, rx) = mpsc::channel();
    // The node daemon reads its signals on a thread of its own.
    signals::start(tx.clone(), act, "")?;
    if !nix::unistd::geteuid().is_root() {
        return Err(NodeError::NotRoot);
    }
    devremap::runtime::container_daemon::ensure_private_dir(&args.state_dir)?;
    let state_dir = args.state_dir.canonicalize().map_err(NodeError::at(&args.state_dir))?;
    // Found from outside: a pid file written over the held node.lock let a second daemon take
    // the state dir.
    let pid_place = crate::cli::place(&args.pid_file);
    for (taken, what) in [(state_dir.join("node.lock"), "lock"), (crate::cli::place(&args.socket), "socket")] {
        if pid_place == taken {
            return Err(NodeError::PidFileTaken { path: args.pid_file.clone(), what });
        }
    }
    let _lock = match lock_node(&state_dir) {
        // A service takes over from a daemon a wrapper started (at boot, or in an upgrade's
        // restart): that one goes, its keepers serve on, and this one adopts them.
        Err(NodeError::Running { .. }) if args.idle_exit.is_none() => take_over(&state_dir, &args.socket)?,
        held => held?,
    };
    let (listener, _bound) = bind(&args.socket)?;
    let running = std::fs::File::open("/proc/self/exe").map_err(NodeError::at(Path::new("/proc/self/exe")))?;
    let exe = crate::keeper::procs::own_path(&running).map_err(|_| NodeError::OwnBinary)?;
    let spares = spare::Spares::start(exe.clone(), !args.no_spare).map_err(NodeError::Thread)?;
    let node = Arc::new(Node {
        state_dir,
        exe,
        spares,
        registry: Mutex::new(Registry::default()),
        closing: Mutex::new(false),
        clients: AtomicUsize::new(0),
        events: tx,
        holds: Arc::default(),
        exits: exits::Exits::start().map_err(NodeError::Thread)?,
        yields: args.idle_exit.is_some(),
        threads: args.threads,
        rest_after: args.rest_after,
    });
    node.adopt();
    node.sweep_every().map_err(NodeError::Thread)?;
    // Made before the daemon says it serves: a bad runtime config fails the start, naming it.
    let nri_handler = match args.nri {
        true => Some(nri_handler::NriHandler::new(
            node.clone(),
            args.config.as_deref(),
            Duration::from_millis(args.nri_timeout),
        )?),
        false => None,
    };
    let pid_text = format!("{}\n", std::process::id());
    let pid_written = devremap::atomic::write_atomic_told(
        &args.pid_file,
        pid_text.as_bytes(),
        None,
        devremap::atomic::Lasting::UntilReboot,
        |_| {},
    )
    .map_err(NodeError::at(&args.pid_file))?;
    let accepting = node.clone();
    std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || accepting.accept(listener))
        .map_err(NodeError::Thread)?;
    if let Some(handler) = nri_handler {
        nri::start(args.nri_socket.clone(), args.nri_index, nri::logged(Arc::new(handler)))
            .map_err(NodeError::Thread)?;
    }
    info!("node daemon serving {} on {} (pid {})", node.state_dir.display(), args.socket.display(), std::process::id());
    ready.say();
    // Under `devremap.service` (Type=notify): the socket answers.
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    let idle_exit = args.idle_exit.map(Duration::from_secs);
    let mut idle_since = Instant::now();
    let why = loop {
        let ev = match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(ev) => ev,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if !node.idle() {
                    idle_since = Instant::now();
                } else if idle_exit.is_some_and(|limit| idle_since.elapsed() >= limit) && node.close_if_idle() {
                    break "idle: no container to serve".to_owned();
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break "the signal thread ended".to_owned(),
        };
        match ev {
            Ev::Signal(Acted::Reload) => {
                let all = node.registry.lock().reload_all();
                signal_all(&all, Signal::SIGHUP, "reloading");
            }
            Ev::Signal(Acted::Upgrade) => {
                let all = node.registry.lock().serving_all();
                signal_all(&all, Signal::SIGUSR2, "upgrading the servers of");
            }
            Ev::Signal(Acted::Stop(why)) => break why,
            Ev::Exited(pid) => node.exited(pid),
            Ev::Yield => break "making way for a node daemon started as a service".to_owned(),
        }
    };
    node.spares.stop();
    // The keepers serve on: a daemon started again adopts them. The socket goes with
    // `_bound`.
    pid_written.remove_if_ours();
    info!("node daemon stopping ({why}); {} containers' keepers serve on", node.registry.lock().serving_all().len());
    Ok(())
}

/// Raises the soft limit of open files to the hard one: the daemon holds a descriptor for each
/// container (its keeper's pidfd, its hold), and systemd's soft 1024 refused the thousandth
/// container `too many open files` (found from outside; the hard limit, 512K under systemd,
/// is the operator's). Its keepers inherit the raise.
fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let raised = rustix::process::Rlimit { current: limit.maximum, ..limit };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            warn!("cannot raise the limit of open files to {:?}: {e}", limit.maximum);
        }
    }
}

/// The lock that makes this the state dir's one node daemon. Opened without waiting and only
/// kept if a regular file (found from outside: a FIFO planted as `node.lock` held the daemon,
/// deaf to `SIGTERM`, and every start behind it in its open; a device's open may act).
fn lock_node(state_dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, NodeError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let path = state_dir.join("node.lock");
    devremap::atomic::check_destination(&path).map_err(NodeError::at(&path))?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .map_err(NodeError::at(&path))?;
    // Swapped in between the check and the open: opened, but never locked or written.
    file.metadata().and_then(|m| devremap::atomic::check_mode(m.mode())).map_err(NodeError::at(&path))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| NodeError::Running { state_dir: state_dir.to_owned() })
}

/// Asks the daemon holding `state_dir` (at `socket`) to make way, and takes its lock once it
/// has gone; a daemon that is a service too refuses, and this one stops there.
fn take_over(state_dir: &Path, socket: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, NodeError> {
    let running = || NodeError::Running { state_dir: state_dir.to_owned() };
    let deadline = Instant::now() + TAKE_OVER_PATIENCE;
    loop {
        match devremap::node::client::ask(socket, &Request::Yield, REQUEST_TIMEOUT) {
            Ok(_) => break,
            Err(e) if e.busy() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => return Err(running()),
        }
    }
    loop {
        match lock_node(state_dir) {
            Err(NodeError::Running { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            taken => {
                info!("took over {} from the node daemon a wrapper started", state_dir.display());
                return taken;
            }
        }
    }
}

/// The socket this daemon bound: removed when it is dropped (the daemon's end, or a start
/// that failed after the bind: found from outside, it was left), only if the file at the path
/// is still the one bound, never a socket another daemon bound there since, nor one that was
/// there before.
struct Bound {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        let now = identity(&self.path);
        if now.is_some() && now == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The device and inode of the file at `path` (not followed).
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Binds the socket, replacing a socket a dead daemon left (never anything else), in a
/// directory of root's alone.
fn bind(socket: &Path) -> Result<(UnixListener, Bound), NodeError> {
    let dir = socket.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    devremap::runtime::container_daemon::ensure_private_dir(dir)?;
    match std::fs::symlink_metadata(socket) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(socket).is_ok() {
                return Err(NodeError::SocketAnswers(socket.to_owned()));
            }
            std::fs::remove_file(socket).map_err(NodeError::at(socket))?;
        }
        Ok(m) => {
            return Err(NodeError::NotSocket {
                path: socket.to_owned(),
                what: devremap::inputs::files::describe(std::os::unix::fs::MetadataExt::mode(&m)),
            });
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(socket).map_err(NodeError::at(socket))?;
    let bound = Bound { path: socket.to_owned(), id: identity(socket) };
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(NodeError::at(socket))?;
    Ok((listener, bound))
}

impl Node {
    fn container(&self, id: &str) -> Result<Container, String> {
        let id = ContainerId::new(id).map_err(|e| e.to_string())?;
        devremap::node::check_not_own_file(id.as_str()).map_err(|e| e.to_string())?;
        Ok(Container::new(&self.state_dir, id.as_str()))
    }

    /// Records the FUSE connection of the mount keeper `pid` serves for `id`, read from the
    /// mountpoint without asking the keeper ([`crate::mountpoint::connection_of`]), once it
    /// answers or is adopted: `attach` hands out a copy of that connection alone.
    fn connected(&self, id: &str, pid: u32) {
        let Ok(container) = self.container(id) else { return };
        if let Some(connection) = crate::mountpoint::connection_of(&container.dev()) {
            self.registry.lock().connected(id, pid, connection);
        }
    }

    /// Takes in what an earlier daemon served: the state dir's container directories.
    fn adopt(self: &Arc<Self>) {
        let found = self.found_locked();
        let decisions = self.registry.lock().adopt(found);
        for decision in decisions {
            match decision {
                Adopt::Watch { id, pid } => {
                    info!("container {id}: adopted (keeper pid {pid})");
                    self.connected(&id, pid);
                    self.watch(pid, None);
                }
                Adopt::TearDown { id } => self.tear_down(&id, "left by a container that is gone"),
                Adopt::Leave { .. } => {}
            }
        }
    }

    /// Sweeps every [`SWEEP_EVERY`] ([`Node::sweep`]), and keeps each served container's log
    /// at about [`LOG_KEPT`], on a thread of its own.
    fn sweep_every(self: &Arc<Self>) -> std::io::Result<()> {
        let node = self.clone();
        std::thread::Builder::new().name("sweep".into()).spawn(move || {
            let mut sweep = Sweep::default();
            loop {
                std::thread::sleep(SWEEP_EVERY);
                node.sweep(&mut sweep);
                node.trim_logs();
            }
        })?;
        Ok(())
    }

    /// Trims the log of each container served ([`devremap::atomic::trim_log`]): its keeper and
    /// server append to it for the container's life, on `/run`, which is memory.
    fn trim_logs(&self) {
        let served = self.registry.lock().serving_all();
        for (id, _) in served {
            let Ok(container) = self.container(&id) else { continue };
            match devremap::atomic::trim_log(&container.log(), LOG_KEPT) {
                Ok(true) => info!(
                    "container {id}: its log passed {} KiB; its last lines moved to devremapd.log.1",
                    LOG_KEPT >> 10
                ),
                Ok(false) => {}
                Err(e) => warn!("container {id}: cannot trim its log: {e}"),
            }
        }
        self.trim_own_log();
    }

    /// Trims `<state_dir>/node.log` ([`devremap::node::NODE_LOG`]) where it is this daemon's
    /// stderr (a wrapper started it): the same file, by device and inode. Another daemon's, or a
    /// file that is not ours, is left alone.
    fn trim_own_log(&self) {
        use std::os::unix::fs::MetadataExt;
        let path = self.state_dir.join(devremap::node::NODE_LOG);
        let ours = |m: std::fs::Metadata| (m.dev(), m.ino());
        let stderr = nix::sys::stat::fstat(std::io::stderr()).ok().map(|st| (st.st_dev, st.st_ino));
        if stderr.is_none() || std::fs::symlink_metadata(&path).ok().map(ours) != stderr {
            return;
        }
        match devremap::atomic::trim_log(&path, devremap::node::NODE_LOG_KEPT) {
            Ok(true) => {
                info!("node.log passed {} KiB; its last lines moved to node.log.1", devremap::node::NODE_LOG_KEPT >> 10)
            }
            Ok(false) => {}
            Err(e) => warn!("cannot trim the node daemon's log: {e}"),
        }
    }

    /// Tears down the directories no one has, as `sweep` says (see [`devremap::node::sweep`]).
    fn sweep(&self, sweep: &mut Sweep) {
        let left = {
            let found = self.found_locked();
            self.registry.lock().left_over(found)
        };
        let identity = |c: &Container| std::fs::symlink_metadata(&c.dir).ok().map(|m| (m.dev(), m.ino()));
        let left: Vec<Leftover> = left
            .into_iter()
            .filter_map(|id| {
                let c = self.container(&id).ok()?;
                Some(Leftover { at: identity(&c)?, mounted: crate::mountpoint::is_mounted(&c.dev()), id })
            })
            .collect();
        for id in sweep.round(&left) {
            self.tear_down(&id, "left by a front end that was gone before it asked for its mount");
            if let Ok(c) = self.container(&id)
                && let Some(at) = identity(&c).filter(|at| left.iter().any(|l| l.id == id && l.at == *at))
            {
                sweep.kept(&id, at);
            }
        }
    }

    /// [`Node::found`] under the state dir's lock, under which front ends look at a directory
    /// too: our probe of a directory's lock would otherwise look to a `delete` like a front end
    /// holding it, and the delete left the directory for good (found from outside).
    fn found_locked(&self) -> Vec<Found> {
        match devremap::runtime::container_daemon::lock_state_dir(&self.state_dir) {
            Ok(_claims) => self.found(),
            Err(_) => Vec::new(),
        }
    }

    /// The state dir's container directories a node daemon may act on: those with a live
    /// keeper, and those a front end marked for a node daemon that are ours.
    fn found(&self) -> Vec<Found> {
        let Ok(entries) = std::fs::read_dir(&self.state_dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| {
                let id = e.file_name().into_string().ok()?;
                let container = self.container(&id).ok()?;
                let keeper = container.daemon_pid();
                // One with no live keeper is torn down only if a wrapper or the NRI plugin
                // marked it for a node daemon, and it is ours (root's, written by no one
                // else, with its runtime-root): the state dir may be a shared one (`/run`),
                // whose other directories are not ours (found from outside: a start removed
                // `/run/systemd`), and an earlier version's leftover is its wrapper's.
                if keeper.is_none() && !(container.is_node() && container.check_ours().is_ok()) {
                    return None;
                }
                let busy = container.is_busy().unwrap_or(true);
                Some(Found { id, keeper, busy, node: container.is_node() })
            })
            .collect()
    }

    /// Has keeper `pid`'s exit said to the main loop, reaping it when it is our child.
    fn watch(&self, pid: u32, child: Option<Child>) {
        let events = self.events.clone();
        self.exits.watch(
            pid,
            Box::new(move || {
                if let Some(mut child) = child {
                    let _ = child.wait();
                }
                let _ = events.send(Ev::Exited(pid));
            }),
        );
    }

    fn exited(self: &Arc<Self>, pid: u32) {
        let Some(id) = self.registry.lock().exited(pid) else { return };
        self.tear_down_apart(id, format!("its keeper (pid {pid}) exited"));
    }

    /// [`Node::tear_down`] on a thread of its own: the state dir's lock may be held by a
    /// wrapper setting a container up, and the caller must not wait for it.
    fn tear_down_apart(self: &Arc<Self>, id: String, why: String) {
        let node = self.clone();
        let _ = std::thread::Builder::new().name("teardown".into()).spawn(move || node.tear_down(&id, &why));
    }

    /// Removes container `id`'s directory, unless a front end holds it or a new start of the id
    /// has begun (under the state dir's lock, which a wrapper takes to claim an id).
    fn tear_down(&self, id: &str, why: &str) {
        let Ok(container) = self.container(id) else { return };
        // Our own hold is not a front end's: a foreground `run` whose container ended is still
        // deleting it when the keeper exits.
        self.holds.wait_released(id, TEARDOWN_PATIENCE);
        let Ok(_lock) = container.lock_state_dir() else { return };
        if !container.exists() || !self.registry.lock().is_free(id) || container.is_busy().unwrap_or(true) {
            return;
        }
        // A keeper that stops unmounts first; one still mounted died (SIGKILL, a crash): its
        // container may still be there, and `start` must refuse it (its `/dev` answers
        // ENOTCONN) until `delete`, which tears it down.
        if crate::mountpoint::is_mounted(&container.dev()) {
            warn!("container {id}: {why} and left its mount dead; its directory stays until the container's delete");
            return;
        }
        match container.teardown(&Host) {
            Ok(()) => info!("container {id}: {why}; torn down"),
            Err(e) => warn!("container {id}: {why}; cannot tear down: {e}"),
        }
    }

    fn idle(&self) -> bool {
        self.registry.lock().is_empty() && self.clients.load(Ordering::SeqCst) == 0
    }

    /// Marks the daemon closing when it still has nothing to do.
    fn close_if_idle(&self) -> bool {
        let mut closing = self.closing.lock();
        *closing = self.idle();
        *closing
    }

    fn accept(self: Arc<Self>, listener: UnixListener) {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            if *self.closing.lock() {
                continue;
            }
            if self.clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                self.clients.fetch_sub(1, Ordering::SeqCst);
                let _ = (&stream).write_all(protocol::answer_line(&Answer::refused(protocol::BUSY)).as_bytes());
                continue;
            }
            let node = self.clone();
            let spawned = std::thread::Builder::new().name("client".into()).spawn(move || {
                node.serve(stream);
                // The last client gone: what the requests read (up to 1 MiB each, on every
                // place at once) goes back to the kernel. Found from outside: bursts of 256
                // requests of 1 MiB grew the heap by 5 to 20 MiB each, for good (freed blocks
                // between live ones are kept by the allocator); some microseconds, after the
                // answer.
                if node.clients.fetch_sub(1, Ordering::SeqCst) == 1 {
                    crate::memory::give_back_freed_heap();
                }
            });
            if spawned.is_err() {
                self.clients.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// One connection: its request, and the answer.
    fn serve(self: &Arc<Self>, stream: UnixStream) {
        // Read (bounded) even from a peer that is refused: a socket closed with the peer's
        // request unread resets the connection, and the peer would read no answer at all.
        let request = read_request(&stream);
        let (answer, handed) = match (peer_is_root(&stream), request) {
            (false, _) => (Answer::refused("only root may ask the node daemon"), None),
            (true, Ok((request, passed))) => self.answer(request, passed),
            (true, Err(why)) => (Answer::refused(why), None),
        };
        let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
        let line = protocol::answer_line(&answer);
        let _ = devremap::node::client::send(&stream, line.as_bytes(), handed.as_ref().map(|fd| fd.as_fd()));
    }

    /// The answer to `request`, and the descriptor handed over with it (`attach`'s).
    fn answer(self: &Arc<Self>, request: Request, passed: Option<OwnedFd>) -> (Answer, Option<OwnedFd>) {
        let result = match request {
            Request::Hello => Ok(json!({
                "pid": std::process::id(),
                "version": devremap::keeper::control::VERSION,
                "state_dir": self.state_dir,
                "containers": self.registry.lock().serving_all().len(),
            })),
            Request::Mount(m) => self.mount(m, passed),
            Request::Unmount { id } => self.unmount(&id),
            Request::List => {
                let all = self.registry.lock().serving_all();
                Ok(Value::Array(all.into_iter().map(|(id, pid)| json!(self.entry(&id, pid).0)).collect()))
            }
            Request::Reload { id } => self.reload(id.as_deref()),
            Request::Yield => self.make_way(),
            Request::Status { id } => self.status(&id),
            Request::Attach { id } => {
                return match self.attach(&id) {
                    Ok(tree) => (Answer::done(Value::Null), Some(tree)),
                    Err(why) => (Answer::refused(why), None),
                };
            }
            #[cfg(feature = "test-hooks")]
            Request::NriEvent { config, event, pod, containers } => {
                self.nri_event(config.as_deref(), &event, pod, containers)
            }
        };
        match result {
            Ok(data) => (Answer::done(data), None),
            Err(why) => (Answer::refused(why), None),
        }
    }

    /// Starts container `m.id`'s keeper. `hold` is the wrapper's lock on the container's
    /// directory: kept until the wrapper, which the runtime replaces, has exited, so that until
    /// the runtime knows the container no other wrapper takes the directory for a leftover.
    fn mount(self: &Arc<Self>, m: MountRequest, hold: Option<OwnedFd>) -> Result<Value, String> {
        let container = self.container(&m.id)?;
        let theirs = m.state_dir.canonicalize().unwrap_or_else(|_| m.state_dir.clone());
        if theirs != self.state_dir {
            return Err(format!(
                "container {}: its state dir is {}, and this node daemon serves {} (give the runtime config's state_dir and node_socket to one daemon)",
                m.id,
                m.state_dir.display(),
                self.state_dir.display()
            ));
        }
        // Neither the directory nor its mountpoint through a symlink planted in its place: the
        // keeper's files and mount would land where it names (found from outside).
        container.check_directory().map_err(|e| format!("container {}: {e}", m.id))?;
        if !std::fs::symlink_metadata(container.dev()).is_ok_and(|d| d.is_dir()) {
            return Err(format!(
                "container {}: {}: no mountpoint (the wrapper makes it; a symlink is refused)",
                m.id,
                container.dev().display()
            ));
        }
        // The wrapper that holds the directory asks again: the node daemon it asked first stopped
        // (a restart) after it started the keeper and before it answered (found from outside:
        // 3 of 125 starts failed across restarts in bursts, `served already` or `another
        // devremapd serves it`). That keeper was started for this request: it is the answer.
        let asker_holds = hold.as_ref().is_some_and(|fd| same_file(fd, &container.dir));
        if asker_holds && let Ok(pid) = self.registry.lock().keeper(&m.id) {
            info!(
                "container {}: serving {} (keeper pid {pid}, started before a node daemon's restart)",
                m.id,
                container.dev().display()
            );
            if let Some(hold) = hold {
                self.holds.keep(&self.exits, &m.id, m.owner_pid, hold);
            }
            return Ok(json!({"pid": pid, "mountpoint": container.dev(), "state_file": container.state_file()}));
        }
        let serial = self.registry.lock().begin(&m.id).map_err(|e| e.to_string())?;
        let args = DaemonArgs {
            devremapd: &self.exe,
            spec: &m.spec,
            host_dev: m.host_dev.as_deref(),
            host_root: &m.host_root,
            metadata: m.metadata.as_deref(),
            extra: m.extra.clone(),
            container_pid_file: (!m.until_unmount).then_some(m.container_pid_file.as_path()),
            owner_pid: (!m.until_unmount).then_some(m.owner_pid),
            threads: self.threads,
            rest_after: self.rest_after,
        };
        let started = match asker_holds.then(|| keeper_under_way(&container)).flatten() {
            Some(pid) => Ok((pid, None)),
            None => container.start_daemon(&args, &self.spares).map(|child| (child.id(), Some(child))),
        };
        match started {
            Ok((pid, child)) => {
                let reload = self.registry.lock().serving(&m.id, serial, pid);
                self.connected(&m.id, pid);
                self.watch(pid, child);
                if let Some(hold) = hold.filter(|fd| same_file(fd, &container.dir)) {
                    self.holds.keep(&self.exits, &m.id, m.owner_pid, hold);
                }
                info!("container {}: serving {} (keeper pid {pid})", m.id, container.dev().display());
                if reload {
                    info!("container {}: reloading, as asked of every container while it started", m.id);
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGHUP);
                }
                warm(container.dev());
                Ok(json!({"pid": pid, "mountpoint": container.dev(), "state_file": container.state_file()}))
            }
            Err(e) => {
                self.registry.lock().failed(&m.id, serial);
                warn!("container {}: not served: {e}", m.id);
                // The front end that asked undoes its half-made start, unless it is gone (found
                // from outside: a runtime killed as its container started left the directory
                // until `delete --force`, once in 20): once the process that asked has exited,
                // what it left is torn down here, if no start of the id holds it by then.
                if !m.until_unmount {
                    // Ours let go first: the exit may be seen before this returns.
                    drop(hold);
                    let (node, id) = (self.clone(), m.id.clone());
                    let why =
                        format!("its start failed and the process that asked for it (pid {}) exited", m.owner_pid);
                    self.exits.watch(m.owner_pid, Box::new(move || node.tear_down_apart(id, why)));
                }
                Err(format!("container {}: {e}", m.id))
            }
        }
    }

    /// Test builds only: calls the NRI handler as the transport would (see `Request::NriEvent`).
    #[cfg(feature = "test-hooks")]
    fn nri_event(
        self: &Arc<Self>,
        config: Option<&Path>,
        event: &str,
        pod: Value,
        containers: Vec<Value>,
    ) -> Result<Value, String> {
        use devremap::nri::view::{Container as Ctr, Handler, Pod};
        // One handler for the daemon's life, as the transport has: its teardowns run in the
        // order the events came (the config of the first event is kept), with
        // `--nri-timeout`'s default.
        static HANDLER: std::sync::OnceLock<nri_handler::NriHandler> = std::sync::OnceLock::new();
        let handler = match HANDLER.get() {
            Some(handler) => handler,
            None => {
                let timeout = Duration::from_millis(1500);
                let made = nri_handler::NriHandler::new(self.clone(), config, timeout).map_err(|e| e.to_string())?;
                HANDLER.get_or_init(|| made)
            }
        };
        let pod: Pod = serde_json::from_value(pod).map_err(|e| format!("pod: {e}"))?;
        let containers: Vec<Ctr> = containers
            .into_iter()
            .map(serde_json::from_value)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("containers: {e}"))?;
        match (event, containers.as_slice()) {
            // containerd's CreateContainer, then its PostCreateContainer (which waits for the
            // mount), as containerd sends them before its CreateContainer returns.
            // What PostCreateContainer logs is this request's error, for the tests to see.
            ("create", [c]) => handler
                .create(&pod, c)
                .and_then(|a| {
                    let named = |e| format!("devremap: container {} ({}): {e}", c.name, c.id);
                    handler.mounted(c).map(|()| a).map_err(named)
                })
                .map(|a| {
                let mounts: Vec<Value> = a
                    .mounts
                    .iter()
                    .map(|m| json!({"destination": m.destination, "type": m.kind, "source": m.source, "options": m.options}))
                    .collect();
                json!({"annotations": a.annotations, "mounts": mounts, "remove_mounts": a.remove_mounts})
            }),
            ("started", [c]) => {
                handler.started(&pod, c);
                Ok(Value::Null)
            }
            ("stopped", [c]) => {
                handler.stopped(&pod, c);
                Ok(Value::Null)
            }
            ("removed", [c]) => {
                handler.removed(&pod, c);
                Ok(Value::Null)
            }
            ("synchronize", all) => {
                handler.synchronize(std::slice::from_ref(&pod), all);
                Ok(Value::Null)
            }
            _ => Err(format!("nri-event: unknown event {event:?}, or not one container for it")),
        }
    }

    /// A wrapper's daemon (one with `--idle-exit`) makes way for a service: it stops taking
    /// requests and goes; a service refuses.
    fn make_way(&self) -> Result<Value, String> {
        if !self.yields {
            return Err("this node daemon runs as a service (no --idle-exit): it does not make way".into());
        }
        // A start under way finishes here first: its client is waiting for this daemon's answer.
        let registry = self.registry.lock();
        if registry.starting() {
            return Err(protocol::SETTING_UP.into());
        }
        *self.closing.lock() = true;
        drop(registry);
        let _ = self.events.send(Ev::Yield);
        Ok(Value::Null)
    }

    fn unmount(&self, id: &str) -> Result<Value, String> {
        let container = self.container(id)?;
        let pid = self.registry.lock().keeper(id).map_err(|e| e.to_string())?;
        let _lock = container.lock_state_dir().map_err(|e| e.to_string())?;
        container.teardown(&Host).map_err(|e| format!("container {id}: {e}"))?;
        // Free now, not when the main thread hears of the exit: a mount of the id right after
        // this answer must not be refused as served.
        self.registry.lock().exited(pid);
        info!("container {id}: unmounted on request (keeper pid {pid})");
        Ok(Value::Null)
    }

    /// The entry of container `id`, and its daemon's state file (`Null` until written).
    fn entry(&self, id: &str, pid: u32) -> (Entry, Value) {
        let container = Container::new(&self.state_dir, id);
        let state = read_state(&container.state_file());
        let entry = Entry {
            id: id.to_owned(),
            mountpoint: container.dev(),
            state_file: container.state_file(),
            last_error: state["last_error"].as_str().map(str::to_owned),
            generation: state["generation"].as_u64(),
            pid,
            server_pid: state["server_pid"].as_u64().and_then(|p| u32::try_from(p).ok()),
            resting: state["resting"].as_bool().unwrap_or(false),
        };
        (entry, state)
    }

    fn status(&self, id: &str) -> Result<Value, String> {
        let pid = self.keeper_of(id)?;
        let (entry, state) = self.entry(id, pid);
        let mut value = json!(entry);
        value["state"] = state;
        Ok(value)
    }

    /// A detached copy of container `id`'s mount, for a front end whose mount namespace ours do
    /// not reach ([`Request::Attach`]): only a container this daemon serves, and only its FUSE
    /// mount (a symlink planted for its directory or mountpoint is not followed).
    fn attach(&self, id: &str) -> Result<OwnedFd, String> {
        use rustix::mount::{OpenTreeFlags, open_tree};
        let container = self.container(id)?;
        self.keeper_of(id)?;
        container.check_directory().map_err(|e| format!("container {id}: {e}"))?;
        let dev = container.dev();
        let flags =
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC | OpenTreeFlags::AT_SYMLINK_NOFOLLOW;
        let tree = open_tree(rustix::fs::CWD, &dev, flags).map_err(|e| {
            format!("container {id}: {}: cannot copy its mount: {}", dev.display(), devremap::io_message(&e.into()))
        })?;
        let expected = self.registry.lock().connection(id);
        if !crate::mountpoint::holds_devremap_mount_of(&tree, &dev, expected) {
            return Err(format!(
                "container {id}: {}: its own mount is not there where the node daemon runs (its keeper is starting \
                 or stopping, or mounted it from an earlier node daemon's mount namespace, or another mount is over it)",
                dev.display()
            ));
        }
        info!("container {id}: its mount handed to a front end in another mount namespace");
        Ok(tree)
    }

    /// The keeper of container `id`, which this daemon serves; or why not, naming a directory
    /// whose keeper died and left its mount (found from outside: "no such container" for a
    /// container that was there, whose `/dev` answered ENOTCONN).
    fn keeper_of(&self, id: &str) -> Result<u32, String> {
        let container = self.container(id)?;
        let served = self.registry.lock().keeper(id);
        served.map_err(|e| {
            let dead = container.exists()
                && container.daemon_pid().is_none()
                && crate::mountpoint::is_mounted(&container.dev());
            if dead {
                format!(
                    "container {id}: its keeper exited and left its /dev dead (ENOTCONN); the node daemon \
                     no longer serves it: delete the container (or restart it) to tear it down"
                )
            } else {
                e.to_string()
            }
        })
    }

    /// Reloads `id` (every container with `None`), each on its own, and waits until each has
    /// finished a reload begun after the request (its state file's `reloads` moved on), or has
    /// been torn down: `id` is then an error, and with `None` it is left out.
    fn reload(&self, id: Option<&str>) -> Result<Value, String> {
        let one = id.is_some();
        let targets = match id {
            Some(id) => vec![(id.to_owned(), self.keeper_of(id)?)],
            None => self.registry.lock().reload_all(),
        };
        let before: Vec<(String, u32, Reloads)> = targets
            .into_iter()
            .map(|(id, pid)| {
                let reloads = Reloads::of(&read_state(&Container::new(&self.state_dir, &id).state_file()));
                (id, pid, reloads)
            })
            .collect();
        for (_, pid, _) in &before {
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGHUP);
        }
        let deadline = Instant::now() + RELOAD_TIMEOUT;
        let mut done = Vec::new();
        for (id, pid, reloads) in before {
            let file = Container::new(&self.state_dir, &id).state_file();
            let mut pause = Duration::from_micros(50);
            let (mut gone, mut unfinished) = (false, None);
            loop {
                if reloads.finished_by(Reloads::of(&read_state(&file))) {
                    break;
                }
                // Torn down meanwhile (its container ended): no reload of it will finish.
                if self.registry.lock().keeper(&id) != Ok(pid) {
                    gone = true;
                    break;
                }
                if Instant::now() >= deadline {
                    let why = format!("no reload finished within {} s", RELOAD_TIMEOUT.as_secs());
                    warn!("container {id}: {why}");
                    unfinished = Some(why);
                    break;
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
            match (gone, one) {
                (true, true) => {
                    return Err(format!("container {id}: torn down while it reloaded (its container ended)"));
                }
                (true, false) => {}
                (false, _) => {
                    let mut entry = json!(self.entry(&id, pid).0);
                    // Said apart from `last_error`, which is the last reload that did finish
                    // (found from outside: `ctl reload` printed the old entry and exited 0).
                    if let Some(why) = unfinished {
                        entry["reload_unfinished"] = json!(why);
                    }
                    done.push(entry);
                }
            }
        }
        Ok(Value::Array(done))
    }
}

/// Lists a freshly mounted `/dev` once: the kernel's first READDIRPLUS of it gives it every
/// entry and its attributes (kept for the TTL, a day, and invalidated by a reload), so that the
/// runtime's own lookups as it sets the container up (its mounts on `pts`, `shm` and `mqueue`,
/// the symlinks, `null`, a bind's mount point) no longer each go through the keeper to the
/// server: one round trip instead of one each. By a thread of its own, beside the answer: the
/// runtime the answer lets go takes milliseconds (its exec, its start) before its first lookup
/// there, and the listing (0.3 to 0.5 ms of a start, traced) need not come before it. A lookup
/// that comes first, or every lookup where no thread could be started, is answered by the
/// server, as without the listing.
fn warm(dev: PathBuf) {
    let _ = std::thread::Builder::new().name("warm".into()).spawn(move || {
        if let Ok(entries) = std::fs::read_dir(&dev) {
            entries.for_each(drop);
        }
    });
}

/// How long a keeper that another node daemon started is waited for ([`keeper_under_way`]):
/// as long as the daemon's own wait for a keeper it starts.
const UNDER_WAY_PATIENCE: Duration = Duration::from_secs(30);

/// The keeper of `container` that a node daemon which has since stopped was starting, once its
/// mount answers (its pid file written); `None` when there is none (its mountpoint's lock is
/// free), or it has not answered within [`UNDER_WAY_PATIENCE`] (a second keeper then refuses
/// the mountpoint, saying that one holds it).
fn keeper_under_way(container: &Container) -> Option<u32> {
    use nix::fcntl::{Flock, FlockArg};
    // The lock a keeper holds on its mountpoint for its life.
    let lock = crate::mountpoint::MountLock::path_of(&container.dev());
    let held = || {
        let Some(Ok(file)) = lock.as_deref().map(devremap::inputs::files::open_own_regular) else { return false };
        matches!(Flock::lock(file, FlockArg::LockSharedNonblock), Err((_, nix::errno::Errno::EWOULDBLOCK)))
    };
    let deadline = Instant::now() + UNDER_WAY_PATIENCE;
    loop {
        if let Some(pid) = container.daemon_pid() {
            return Some(pid);
        }
        if !held() || Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `signal` to each keeper of `all`, saying what for.
fn signal_all(all: &[(String, u32)], signal: Signal, doing: &str) {
    info!("{doing} {} containers", all.len());
    for (_, pid) in all {
        let _ = kill(Pid::from_raw(*pid as i32), signal);
    }
}

/// Whether `fd` is the file at `path`.
fn same_file(fd: &OwnedFd, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(a), Ok(b)) = (nix::sys::stat::fstat(fd), std::fs::metadata(path)) else { return false };
    (a.st_dev, a.st_ino) == (b.dev(), b.ino())
}

/// The wrappers' locks the daemon holds, by container id: kept until the runtime that replaced
/// each wrapper has exited.
#[derive(Default)]
struct Holds {
    held: Mutex<HashMap<String, usize>>,
    released: Condvar,
}

impl Holds {
    /// Keeps `fd`, container `id`'s lock, until process `pid` has exited ([`exits::Exits`]).
    fn keep(self: &Arc<Self>, exits: &exits::Exits, id: &str, pid: u32, fd: OwnedFd) {
        *self.held.lock().entry(id.to_owned()).or_default() += 1;
        let (holds, mine) = (self.clone(), id.to_owned());
        exits.watch(
            pid,
            Box::new(move || {
                drop(fd);
                holds.release(&mine);
            }),
        );
    }

    fn release(&self, id: &str) {
        let mut held = self.held.lock();
        if let Some(n) = held.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                held.remove(id);
            }
        }
        self.released.notify_all();
    }

    /// Waits (at most `patience`) until the daemon holds no lock of container `id`: a keeper
    /// can exit (its container's init did) before the runtime holding the lock has.
    fn wait_released(&self, id: &str, patience: Duration) {
        let deadline = Instant::now() + patience;
        let mut held = self.held.lock();
        while held.contains_key(id) {
            if self.released.wait_until(&mut held, deadline).timed_out() {
                return;
            }
        }
    }
}

/// A daemon's state file as JSON, `Null` when it cannot be read (not written yet, or being
/// replaced: it is renamed into place whole).
/// A container's state file, `Null` until it is written. Read as a file of our own, and only up
/// to [`MAX_STATE`]: one planted in its place (a symlink to /dev/zero, a FIFO) is never
/// followed or read without end (found from outside: `ctl list` grew the daemon by 500 MB/s,
/// or hung one of its threads).
fn read_state(path: &Path) -> Value {
    use devremap::inputs::files::{open_own_regular, read_at_most};
    let bytes = open_own_regular(path).ok().and_then(|mut f| read_at_most(&mut f, MAX_STATE).ok().flatten());
    bytes.and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or(Value::Null)
}

/// The largest state file read: a server writes a few KiB (its plan's summary, even for
/// thousands of devices).
const MAX_STATE: u64 = 16 << 20;

fn peer_is_root(stream: &UnixStream) -> bool {
    nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials).is_ok_and(|c| c.uid() == 0)
}

/// The request on `stream`, and the descriptor its client handed over with it, if any.
/// Reads of a client's request, each given only what is left of the time for the whole.
struct Deadline<'a> {
    stream: &'a UnixStream,
    until: Instant,
}

impl Deadline<'_> {
    /// Sets the socket's read timeout to the time left; `TimedOut` once none is.
    fn arm(&self) -> io::Result<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        (&mut &*self.stream).read(buf)
    }
}

fn read_request(stream: &UnixStream) -> Result<(Request, Option<OwnedFd>), String> {
    let reading = |e: io::Error| match e.kind() {
        // The socket's timeout, which the deadline sets to the time left.
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            format!("reading the request: no whole request within {} s", REQUEST_TIMEOUT.as_secs())
        }
        _ => format!("reading the request: {}", devremap::io_message(&e)),
    };
    // The whole request within REQUEST_TIMEOUT, not each read (found from outside: a client
    // sending a byte every 5 s held its place, and 256 such held every place).
    let mut request = Deadline { stream, until: Instant::now() + REQUEST_TIMEOUT };
    request.arm().map_err(reading)?;
    // The first part with its descriptors (a client sends them with its first bytes), the
    // rest as it comes.
    let mut first = vec![0u8; 64 << 10];
    let (len, mut passed) = devremap::node::client::receive_with_fds(stream, &mut first).map_err(reading)?;
    let mut line = first[..len].to_vec();
    if !line.contains(&b'\n') && len > 0 {
        BufReader::new((&mut request).take((protocol::MAX_LINE + 1).saturating_sub(len) as u64))
            .read_until(b'\n', &mut line)
            .map_err(reading)?;
    }
    let request = protocol::parse_request(line.strip_suffix(b"\n").unwrap_or(&line))
        .map_err(|e| format!("the client's request: {e}"))?;
    // One descriptor at most is taken; any more are closed here.
    Ok((request, passed.drain(..).next()))
}
