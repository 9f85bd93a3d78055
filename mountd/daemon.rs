//! `devremapd mount`: mounts the devfs, serves it, reloads it on SIGHUP, and unmounts on
//! SIGTERM/SIGINT or when someone else unmounts it.
//!
//! The main thread handles one batch of events at a time (signals, a reload's result, retired
//! nodes let go, the session ending), so reloads never overlap and SIGHUPs that arrive during
//! one are coalesced into one more. A reload's inputs are read on a worker thread: an input on
//! a stuck filesystem can block that thread in the kernel for ever, so the main thread gives a
//! reload `--reload-timeout` seconds and then abandons it, and a stop never waits for one. The
//! FUSE session runs on its own threads and only reads the shared [`Devfs`]. Readiness (pid
//! file, state file, `READY=1`) is declared only once the mount has answered a request.
//!
//! Assumption: one daemon per mountpoint, enforced by the [`MountLock`] held for its whole life.

use crate::cli::MountArgs;
use crate::logging;
use crate::mountpoint::{
    FSNAME, MountLock, check_private, detach, is_dead_mount, prepare_mountpoint, resolve, wait_answering,
};
use devremap::adapter::Adapter;
use devremap::atomic::{Written, write_atomic};
use devremap::load::{self, LoadError, Loaded, Sources};
use devremap::served::{Change, Devfs};
use devremap::{io_message, render};
use fuser::{Config, INodeNo, MountOption, Notifier, Session, SessionACL};
use log::{info, warn};
use sd_notify::NotifyState;
use serde_json::Value;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Abandoned reloads still blocked on their inputs beyond which no new reload is started: each
/// holds a thread until its input answers.
const MAX_STUCK_RELOADS: usize = 4;

/// What the main loop reacts to.
enum Event {
    /// SIGHUP, SIGTERM or SIGINT; the other signals are logged and ignored where received.
    Signal(i32),
    /// A reload's inputs, loaded (or refused) by its worker thread.
    Loaded(u64, Box<Result<Loaded, LoadError>>),
    /// A retired node was let go: the state file's count is stale.
    Retired,
    /// The FUSE session ended: someone unmounted us, or aborted the connection.
    Ended(io::Result<()>),
}

/// Why serving ended.
enum End {
    /// SIGTERM or SIGINT: we unmount.
    Stop,
    /// The session ended under us.
    Ended(io::Result<()>),
}

/// A reload whose inputs are being loaded.
struct InFlight {
    id: u64,
    started: Instant,
}

struct Daemon {
    sources: Sources,
    mountpoint: PathBuf,
    state_file: Option<PathBuf>,
    /// The state file as last written, removed at exit if still ours.
    state_written: Option<Written>,
    devfs: Arc<Devfs>,
    notifier: Notifier,
    current: Loaded,
    last_error: Option<String>,
    events: Sender<Event>,
    reload_timeout: Duration,
    reloading: Option<InFlight>,
    /// SIGHUPs arrived during a reload: one more reload follows it.
    reload_again: bool,
    next_reload: u64,
    /// Abandoned reloads whose worker has not returned yet.
    stuck: usize,
}

/// Every signal whose default action ends the process and which the kernel does not send as
/// the fault of an instruction (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP, SIGSYS keep their
/// default: they mean this process is broken) nor as the consequence of our own write
/// (SIGPIPE and SIGXFSZ are ignored instead: logging them from a write that failed would
/// write again). SIGHUP reloads, SIGTERM and SIGINT stop; the others are logged and ignored.
fn handled_signals() -> Vec<i32> {
    use libc::*;
    let mut all = vec![
        SIGHUP, SIGTERM, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF, SIGIO, SIGPWR, SIGXCPU,
        SIGSTKFLT,
    ];
    all.extend(SIGRTMIN()..=SIGRTMAX());
    all
}

/// A signal's name for the log: `SIGUSR1`, `SIGRTMIN+3`.
fn signal_name(sig: i32) -> String {
    match nix::sys::signal::Signal::try_from(sig) {
        Ok(s) => s.as_str().to_owned(),
        Err(_) => format!("SIGRTMIN+{}", sig - libc::SIGRTMIN()),
    }
}

/// Receives every handled signal for the daemon's life: passes SIGHUP, SIGTERM and SIGINT to
/// the main loop and logs the others.
fn start_signal_thread(events: Sender<Event>) -> Result<(), String> {
    for sig in [nix::sys::signal::Signal::SIGPIPE, nix::sys::signal::Signal::SIGXFSZ] {
        // SAFETY: SIG_IGN runs no code in the handler's context.
        unsafe { nix::sys::signal::signal(sig, nix::sys::signal::SigHandler::SigIgn) }
            .map_err(|e| format!("cannot ignore {sig}: {}", io_message(&e.into())))?;
    }
    let mut signals = Signals::new(handled_signals()).map_err(|e| format!("cannot handle signals: {e}"))?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if ![SIGHUP, SIGTERM, SIGINT].contains(&sig) {
                    info!("signal {}: ignored", signal_name(sig));
                } else if events.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })
        .map(drop)
        .map_err(|e| format!("cannot start the signal thread: {e}"))
}

pub fn run(args: &MountArgs) -> Result<(), String> {
    let sources = args.inputs.sources();
    let loaded = load::load(&sources).map_err(|e| e.to_string())?;
    // Before the mountpoint is looked at: under a directory only root can enter, another user
    // would only be told "permission denied".
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
    if sources.spec.is_none() {
        warn!(
            "no --spec: the tree has no mount points for the container runtime (pts, shm, mqueue), so a runtime \
             that mounts there fails (\"read-only file system\"); give the container's config.json with --spec"
        );
    }

    let devfs = Arc::new(Devfs::new(loaded.plan.tree.clone()));
    let (tx, rx) = mpsc::channel();
    let retired_tx = tx.clone();
    let on_retired = Box::new(move || {
        let _ = retired_tx.send(Event::Retired);
    });
    start_signal_thread(tx.clone())?;

    let adapter = hooks(Adapter::new(devfs.clone(), Duration::from_secs(args.ttl), Some(on_retired)));
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(FSNAME.into()),
        MountOption::Dev,
        MountOption::NoSuid,
        MountOption::NoExec,
        MountOption::NoAtime,
        MountOption::DefaultPermissions,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(args.threads.into());
    let mut session =
        Session::new(adapter, &mountpoint, &config).map_err(|e| format!("{m}: cannot mount: {}", io_message(&e)))?;
    let notifier = session.notifier();
    let mut unmounter = session.unmount_callable();
    let session_tx = tx.clone();
    let session_thread = std::thread::Builder::new()
        .name("fuse-session".into())
        .spawn(move || {
            let _ = session_tx.send(Event::Ended(session.run()));
        })
        .map_err(|e| format!("cannot start the session thread: {e}"))?;

    let mut daemon = Daemon {
        sources,
        mountpoint: args.mountpoint.clone(),
        state_file: args.state_file.clone(),
        state_written: None,
        devfs,
        notifier,
        current: loaded,
        last_error: None,
        events: tx,
        reload_timeout: Duration::from_secs(args.reload_timeout),
        reloading: None,
        reload_again: false,
        next_reload: 1,
        stuck: 0,
    };
    // Ready only once the mount answers: the pid file, then the state file (which scripts and
    // tests wait for). If either fails, nothing is left behind: no mount, no files.
    let mut pid_written = None;
    let ready = wait_answering(&mountpoint).and_then(|()| {
        if let Some(pid_file) = &args.pid_file {
            let written = write_atomic(pid_file, format!("{}\n", std::process::id()).as_bytes())
                .map_err(|e| format!("{}: cannot write the pid file: {}", pid_file.display(), io_message(&e)))?;
            pid_written = Some(written);
        }
        daemon.write_state()
    });
    if let Err(e) = ready {
        let _ = unmounter.unmount();
        detach(&mountpoint);
        // Only what this daemon wrote: a state file that failed to write was never ours.
        pid_written.iter().for_each(Written::remove_if_ours);
        return Err(e);
    }
    notify(&[NotifyState::Ready]);
    let watch_tx = daemon.events.clone();
    crate::watch::spawn(args.owner_pid, args.container_pid_file.clone(), move |why| {
        info!("{why}: stopping");
        let _ = watch_tx.send(Event::Signal(SIGTERM));
    });
    info!(
        "serving {m}: generation 1, nodes: {}, remapped GPUs: {}{}",
        daemon.current.plan.tree.len() - 1,
        daemon.current.plan.remap.iter().filter(|e| e.served).count(),
        warnings(&daemon.current)
    );

    let result = match daemon.serve(&rx) {
        End::Stop => {
            unmount(&mut unmounter, &mountpoint, &rx, &session_thread, &m);
            Ok(())
        }
        End::Ended(result) => ended(&mountpoint, &m, result),
    };
    for written in pid_written.iter().chain(&daemon.state_written) {
        written.remove_if_ours();
    }
    if logging::dropped() > 0 {
        warn!("{} log lines were dropped: stderr was not being read", logging::dropped());
    }
    result
}

/// The test hooks, in a build with the `test-hooks` feature: `DEVREMAPD_FAILPOINT=lookup-panic:NAME`
/// makes every lookup of NAME panic.
#[cfg(feature = "test-hooks")]
fn hooks(adapter: Adapter) -> Adapter {
    let failpoint =
        std::env::var("DEVREMAPD_FAILPOINT").ok().and_then(|f| f.strip_prefix("lookup-panic:").map(str::to_owned));
    adapter.panic_on_lookup(failpoint)
}

#[cfg(not(feature = "test-hooks"))]
fn hooks(adapter: Adapter) -> Adapter {
    adapter
}

/// Unmounts after a stop, and says what became of the connection.
fn unmount(
    unmounter: &mut fuser::SessionUnmounter,
    mountpoint: &Path,
    rx: &Receiver<Event>,
    session_thread: &std::thread::JoinHandle<()>,
    m: &str,
) {
    match unmounter.unmount() {
        // Unmounted here; the connection ends once no other mount holds it. A container's
        // bind mount of it does: then exiting ends it, and the container sees ENOTCONN.
        Ok(()) => {
            let deadline = Instant::now() + Duration::from_millis(500);
            let ended = loop {
                match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(Event::Ended(_)) | Err(RecvTimeoutError::Disconnected) => break true,
                    Ok(_) => {}
                    Err(RecvTimeoutError::Timeout) => break session_thread.is_finished(),
                }
            };
            if ended {
                info!("unmounted {m}");
            } else {
                warn!(
                    "unmounted {m}, but other mounts of it (a container's /dev?) remain; they lose their /dev as we exit"
                );
            }
        }
        // Busy (a process has its cwd in it): detach; the same holds for its last users.
        Err(e) => {
            warn!(
                "{m}: unmount failed ({}); detached it, and what still holds it loses its /dev as we exit",
                io_message(&e)
            );
            detach(mountpoint);
        }
    }
}

/// The session ended without a stop. A clean outside `umount` ends it with ENODEV (`Ok`):
/// exit 0. An aborted connection (`umount -f`, a write to `/sys/fs/fuse/connections/N/abort`)
/// ends it with ECONNABORTED (the adapter asks for `FUSE_ABORT_ERROR`) and may leave a dead
/// mount answering ENOTCONN (when it was busy): detach that and fail, so that a supervisor
/// (systemd's `Restart=on-failure`) starts a new daemon.
fn ended(mountpoint: &Path, m: &str, result: io::Result<()>) -> Result<(), String> {
    let aborted = result.as_ref().err().and_then(io::Error::raw_os_error) == Some(libc::ECONNABORTED);
    if is_dead_mount(mountpoint) {
        detach(mountpoint);
        return Err(format!("{m}: the FUSE connection was aborted; detached the dead mount"));
    }
    match result {
        _ if aborted => return Err(format!("{m}: the FUSE connection was aborted")),
        Ok(()) => info!("{m}: unmounted from outside"),
        Err(e) => warn!("{m}: the FUSE session ended: {e}"),
    }
    Ok(())
}

impl Daemon {
    /// Handles events until the daemon must stop. Events queued together are handled as one
    /// batch: any number of SIGHUPs make one reload, and a stop wins over a reload.
    fn serve(&mut self, rx: &Receiver<Event>) -> End {
        loop {
            let first = match &self.reloading {
                Some(r) => {
                    let left = (r.started + self.reload_timeout).saturating_duration_since(Instant::now());
                    match rx.recv_timeout(left) {
                        Ok(event) => event,
                        Err(RecvTimeoutError::Timeout) => {
                            self.abandon_reload();
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => return End::Stop,
                    }
                }
                None => match rx.recv() {
                    Ok(event) => event,
                    Err(_) => return End::Stop,
                },
            };
            let batch: Vec<Event> = std::iter::once(first).chain(rx.try_iter()).collect();
            let (mut reload, mut retired) = (false, false);
            for event in batch {
                match event {
                    Event::Ended(r) => return End::Ended(r),
                    Event::Signal(SIGHUP) => reload = true,
                    Event::Signal(sig) => {
                        info!("signal {}: stopping", signal_name(sig));
                        notify(&[NotifyState::Stopping]);
                        return End::Stop;
                    }
                    Event::Loaded(id, result) => self.loaded(id, *result),
                    Event::Retired => retired = true,
                }
            }
            self.reload_again |= reload;
            if self.reloading.is_none() && std::mem::take(&mut self.reload_again) {
                self.start_reload();
            } else if retired {
                self.update_state();
            }
        }
    }

    /// Starts loading the inputs on a worker thread; its result comes back as an event.
    fn start_reload(&mut self) {
        let generation = self.devfs.snapshot().generation;
        if self.stuck >= MAX_STUCK_RELOADS {
            let e = format!(
                "not reloading: {} abandoned reloads are still blocked on their inputs (a stuck filesystem?)",
                self.stuck
            );
            warn!("{e}; still serving generation {generation}");
            self.last_error = Some(e);
            self.update_state();
            return;
        }
        // systemd (Type=notify or notify-reload) shows the unit as reloading until READY=1.
        let mut reloading = vec![NotifyState::Reloading];
        reloading.extend(NotifyState::monotonic_usec_now().ok());
        notify(&reloading);
        let id = self.next_reload;
        self.next_reload += 1;
        let (sources, events) = (self.sources.clone(), self.events.clone());
        let spawned = std::thread::Builder::new().name("reload".into()).spawn(move || {
            let _ = events.send(Event::Loaded(id, Box::new(load::load(&sources))));
        });
        match spawned {
            Ok(_) => self.reloading = Some(InFlight { id, started: Instant::now() }),
            Err(e) => {
                warn!("reload refused: cannot start a thread: {e}; still serving generation {generation}");
                self.last_error = Some(format!("cannot start a reload thread: {e}"));
                self.update_state();
                notify(&[NotifyState::Ready]);
            }
        }
    }

    /// A reload's inputs did not load in time: the served tree stays, and its worker is left
    /// to finish (or not) on its own.
    fn abandon_reload(&mut self) {
        self.reloading = None;
        self.stuck += 1;
        let generation = self.devfs.snapshot().generation;
        let e = format!(
            "reload abandoned: the inputs did not load within {} s (an input on a stuck filesystem?)",
            self.reload_timeout.as_secs()
        );
        warn!("{e}; still serving generation {generation}");
        self.last_error = Some(e);
        self.update_state();
        notify(&[NotifyState::Ready]);
    }

    /// A worker's result: applied if it is the reload in flight, dropped if it was abandoned.
    fn loaded(&mut self, id: u64, result: Result<Loaded, LoadError>) {
        let Some(started) = self.reloading.as_ref().filter(|r| r.id == id).map(|r| r.started) else {
            self.stuck = self.stuck.saturating_sub(1);
            info!("an abandoned reload finished after all; its result was dropped");
            return;
        };
        self.reloading = None;
        let generation = self.devfs.snapshot().generation;
        match result {
            Ok(loaded) => self.swap(loaded, started),
            Err(e) => {
                warn!("reload refused: {e}; still serving generation {generation}");
                self.last_error = Some(e.to_string());
                self.update_state();
            }
        }
        notify(&[NotifyState::Ready]);
    }

    fn swap(&mut self, loaded: Loaded, started: Instant) {
        let change = self.devfs.replace(loaded.plan.tree.clone());
        self.invalidate(&change);
        info!(
            "reloaded: generation {} in {:.2} ms: {}{}",
            change.generation,
            started.elapsed().as_secs_f64() * 1e3,
            describe(&change, &self.current, &loaded),
            warnings(&loaded)
        );
        self.current = loaded;
        self.last_error = None;
        self.update_state();
    }

    /// Drops what the kernel cached of every changed name, so the next lookup asks us.
    fn invalidate(&self, change: &Change) {
        for (parent, name) in &change.invalidate {
            // ENOENT: the kernel had nothing cached there.
            if let Err(e) = self.notifier.inval_entry(INodeNo(*parent), OsStr::new(name))
                && e.raw_os_error() != Some(libc::ENOENT)
            {
                warn!("invalidating {name}: {e}");
            }
        }
        for dir in &change.dirs {
            let _ = self.notifier.inval_inode(INodeNo(*dir), 0, 0);
        }
    }

    /// Replaces the state file, if there is one.
    fn write_state(&mut self) -> Result<(), String> {
        let Some(path) = &self.state_file else { return Ok(()) };
        let mut state = render::plan_json(&self.current.plan, self.current.metadata.as_ref());
        state.insert("generation".into(), self.devfs.snapshot().generation.into());
        state.insert("last_error".into(), self.last_error.clone().map_or(Value::Null, Value::from));
        state.insert("retired_nodes".into(), self.devfs.retired_count().into());
        state.insert("pid".into(), std::process::id().into());
        state.insert("mountpoint".into(), self.mountpoint.display().to_string().into());
        state.insert("log_lines_dropped".into(), logging::dropped().into());
        let mut text = Value::Object(state).to_string();
        text.push('\n');
        let written = write_atomic(path, text.as_bytes())
            .map_err(|e| format!("{}: cannot write the state file: {}", path.display(), io_message(&e)))?;
        self.state_written = Some(written);
        Ok(())
    }

    /// Replaces the state file after a change; a failure is logged, and serving goes on.
    fn update_state(&mut self) {
        if let Err(e) = self.write_state() {
            warn!("{e}");
        }
    }
}

/// `; warning: ...` for each warning of a plan, for the log line that serves it.
fn warnings(loaded: &Loaded) -> String {
    loaded.plan.warnings.iter().map(|w| format!("; warning: {w}")).collect()
}

/// Tells systemd, when it started us with a notify socket; without one this does nothing.
fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!("cannot notify systemd: {}", io_message(&e));
    }
}

/// `nvidia0: 1:5 -> 1:7, nvidia1: mode 0666 -> 0600, nvidia9: added 1:8, nvidia3: removed` for
/// the reload log line.
fn describe(change: &Change, old: &Loaded, new: &Loaded) -> String {
    let node = |l: &Loaded, p: &str| l.plan.tree.get(p).cloned();
    let d = &change.diff;
    let parts: Vec<String> = d
        .changed
        .iter()
        .map(|p| match (node(old, p), node(new, p)) {
            (Some(before), Some(after)) => format!("{p}: {}", render::node_change(&before, &after)),
            _ => format!("{p}: changed"),
        })
        .chain(
            d.added
                .iter()
                .map(|p| format!("{p}: added {}", node(new, p).map_or("?".into(), |n| render::node_what(&n)))),
        )
        .chain(d.removed.iter().map(|p| format!("{p}: removed")))
        .collect();
    if parts.is_empty() { "no change".to_owned() } else { parts.join(", ") }
}
