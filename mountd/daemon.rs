//! `devremapd mount`: mounts the devfs, serves it, reloads it on SIGHUP, and unmounts on
//! SIGTERM/SIGINT or when someone else unmounts it.
//!
//! The rules of the daemon's life (reloads coalesced, never overlapping, abandoned after
//! `--reload-timeout`; a stop wins and never waits) are the library's [`Lifecycle`]; this file
//! is its edges: the mount, the signal thread that turns signals into events, the worker
//! threads that load a reload's inputs (an input on a stuck filesystem can block one in the
//! kernel for ever), the state file and systemd. The FUSE session runs on its own threads and
//! only reads the shared [`Devfs`]. Readiness (pid file, state file, `READY=1`) is declared only
//! once the mount has answered a request. Signals are handled from the first step on: until the
//! main loop runs, their events wait in its channel (a stop before the mount ends the start).
//!
//! Assumption: one daemon per mountpoint, enforced by the [`MountLock`] held for its whole life.

use crate::cli::MountArgs;
use crate::logging;
use crate::mountpoint::{
    FSNAME, MountLock, check_private, detach, is_dead_mount, prepare_mountpoint, resolve, wait_answering,
};
use devremap::adapter::Adapter;
use devremap::atomic::{Written, write_atomic};
use devremap::lifecycle::{End, Event, Lifecycle, Notice, PublishError, Session, Status, warnings};
use devremap::load::{self, Sources};
use devremap::served::Devfs;
use devremap::{io_message, render};
use fuser::{Config, MountOption, SessionACL};
use log::{info, warn};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use sd_notify::NotifyState;
use serde_json::Value;
use signal_hook::consts::{SIGHUP, SIGINT, SIGPIPE, SIGTERM, SIGXFSZ};
use signal_hook::iterator::Signals;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// The daemon around the FUSE session, as the [`Lifecycle`] sees it: loads inputs on worker
/// threads, writes the state file, tells systemd.
struct Daemon {
    sources: Sources,
    mountpoint: PathBuf,
    state_file: Option<PathBuf>,
    /// The state file as last written, removed at exit if still ours.
    state_written: Option<Written>,
    events: Sender<Event>,
}

/// Every signal whose default action ends the process and which the kernel does not send as
/// the fault of an instruction (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP, SIGSYS keep their
/// default: they mean this process is broken) nor as the consequence of our own write
/// (SIGPIPE and SIGXFSZ are swallowed instead: logging them from a write that failed would
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

/// Receives every handled signal for the daemon's life: passes SIGHUP (reload), SIGTERM and
/// SIGINT (stop) to the main loop and logs the others. Called first thing, so that from then on
/// none of them ends the process: until the main loop runs, their events wait in the channel.
/// Then unblocks SIGHUP, SIGTERM and SIGINT in this thread (and so in the threads it starts
/// later): a signal mask is inherited across exec, and a daemon started with them blocked
/// would never reload or stop; one that arrived before now, held pending, is handled here.
fn start_signal_thread(events: Sender<Event>) -> Result<(), String> {
    // A handler that only sets a flag nobody reads, installed without `unsafe`: as with
    // SIG_IGN, the signal no longer ends the process and the write that raised it fails with
    // its error (EPIPE, EFBIG), which the writer handles.
    let swallowed = Arc::new(AtomicBool::new(false));
    for sig in [SIGPIPE, SIGXFSZ] {
        signal_hook::flag::register(sig, swallowed.clone())
            .map_err(|e| format!("cannot ignore {}: {}", signal_name(sig), io_message(&e)))?;
    }
    let mut signals = Signals::new(handled_signals()).map_err(|e| format!("cannot handle signals: {e}"))?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                let event = match sig {
                    SIGHUP => Event::Reload,
                    SIGTERM | SIGINT => Event::Stop(format!("signal {}", signal_name(sig))),
                    _ => {
                        info!("signal {}: ignored", signal_name(sig));
                        continue;
                    }
                };
                if events.send(event).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| format!("cannot start the signal thread: {e}"))?;
    let acted_on: SigSet = [Signal::SIGHUP, Signal::SIGTERM, Signal::SIGINT].into_iter().collect();
    pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&acted_on), None)
        .map_err(|e| format!("cannot unblock SIGHUP, SIGTERM and SIGINT: {e}"))
}

/// The cause of a stop asked for while starting (SIGTERM or SIGINT before the mount), if one
/// was. Every other event waiting is put back, in order: a SIGHUP while starting means the
/// inputs may have changed since they were loaded, so it reloads once serving.
fn stop_while_starting(rx: &Receiver<Event>, tx: &Sender<Event>) -> Option<String> {
    let waiting: Vec<Event> = rx.try_iter().collect();
    if let Some(why) = waiting.iter().find_map(|e| if let Event::Stop(why) = e { Some(why.clone()) } else { None }) {
        return Some(why);
    }
    if waiting.iter().any(|e| matches!(e, Event::Reload)) {
        info!("signal SIGHUP while starting: reloading once serving");
    }
    waiting.into_iter().for_each(|e| drop(tx.send(e)));
    None
}

pub fn run(args: &MountArgs) -> Result<(), String> {
    // First: a SIGHUP or SIGTERM sent as soon as we were started must not end us.
    let (tx, rx) = mpsc::channel();
    start_signal_thread(tx.clone())?;
    args.check_files()?;
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

    // The last point where a stop leaves nothing to undo: nothing is mounted or written yet.
    if let Some(why) = stop_while_starting(&rx, &tx) {
        info!("{why} while starting: stopping before the mount");
        return Ok(());
    }

    let devfs = Arc::new(Devfs::new(loaded.plan.tree.clone()));
    let retired_tx = tx.clone();
    let on_retired = Box::new(move || {
        let _ = retired_tx.send(Event::Retired);
    });

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
    let mut session = fuser::Session::new(adapter, &mountpoint, &config)
        .map_err(|e| format!("{m}: cannot mount: {}", io_message(&e)))?;
    let notifier = session.notifier();
    let mut unmounter = session.unmount_callable();
    let session_tx = tx.clone();
    let session_thread = std::thread::Builder::new()
        .name("fuse-session".into())
        .spawn(move || {
            let _ = session_tx.send(Event::Ended(session.run()));
        })
        .map_err(|e| format!("cannot start the session thread: {e}"))?;

    let daemon = Daemon {
        sources,
        mountpoint: args.mountpoint.clone(),
        state_file: args.state_file.clone(),
        state_written: None,
        events: tx,
    };
    let mut life = Lifecycle::new(devfs, loaded, Duration::from_secs(args.reload_timeout), notifier, daemon);
    // Ready only once the mount answers: the pid file, then the state file (which scripts and
    // tests wait for). If either fails, nothing is left behind: no mount, no files.
    let mut pid_written = None;
    let ready = wait_answering(&mountpoint).and_then(|()| {
        if let Some(pid_file) = &args.pid_file {
            let written = write_atomic(pid_file, format!("{}\n", std::process::id()).as_bytes())
                .map_err(|e| format!("{}: cannot write the pid file: {}", pid_file.display(), io_message(&e)))?;
            pid_written = Some(written);
        }
        life.ready().map_err(|e| e.to_string())
    });
    if let Err(e) = ready {
        let _ = unmounter.unmount();
        detach(&mountpoint);
        // Only what this daemon wrote: a state file that failed to write was never ours.
        pid_written.iter().for_each(Written::remove_if_ours);
        return Err(e);
    }
    let watch_tx = life.session().events.clone();
    crate::watch::spawn(args.owner_pid, args.container_pid_file.clone(), move |why| {
        let _ = watch_tx.send(Event::Stop(why));
    });
    let current = life.current();
    info!(
        "serving {m}: generation 1, nodes: {}, remapped GPUs: {}{}",
        current.plan.tree.len() - 1,
        current.plan.remap.iter().filter(|e| e.served).count(),
        warnings(current)
    );

    let result = match life.serve(&rx) {
        End::Stop => {
            unmount(&mut unmounter, &mountpoint, &rx, &session_thread, &m);
            Ok(())
        }
        End::Ended(result) => ended(&mountpoint, &m, result),
    };
    for written in pid_written.iter().chain(&life.session().state_written) {
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

impl Session for Daemon {
    /// Loads the inputs on a worker thread: an input on a stuck filesystem blocks only it.
    fn load(&mut self, id: u64) -> io::Result<()> {
        let (sources, events) = (self.sources.clone(), self.events.clone());
        std::thread::Builder::new().name("reload".into()).spawn(move || {
            let _ = events.send(Event::Loaded(id, Box::new(load::load(&sources))));
        })?;
        Ok(())
    }

    /// Replaces the state file, if there is one.
    fn publish(&mut self, status: &Status<'_>) -> Result<(), PublishError> {
        let Some(path) = &self.state_file else { return Ok(()) };
        let mut state = render::plan_json(&status.loaded.plan, status.loaded.metadata.as_ref());
        state.insert("generation".into(), status.generation.into());
        state.insert("last_error".into(), status.last_error.map_or(Value::Null, Value::from));
        state.insert("retired_nodes".into(), status.retired_nodes.into());
        state.insert("pid".into(), std::process::id().into());
        state.insert("mountpoint".into(), self.mountpoint.display().to_string().into());
        state.insert("log_lines_dropped".into(), logging::dropped().into());
        let mut text = Value::Object(state).to_string();
        text.push('\n');
        let written = write_atomic(path, text.as_bytes())
            .map_err(|source| PublishError::StateFile { path: path.clone(), source })?;
        self.state_written = Some(written);
        Ok(())
    }

    /// Tells systemd, when it started us with a notify socket (`Type=notify` or
    /// `notify-reload`, which shows the unit as reloading until `READY=1`).
    fn notify(&mut self, notice: Notice) {
        match notice {
            Notice::Ready => notify(&[NotifyState::Ready]),
            Notice::Stopping => notify(&[NotifyState::Stopping]),
            Notice::Reloading => {
                let mut reloading = vec![NotifyState::Reloading];
                reloading.extend(NotifyState::monotonic_usec_now().ok());
                notify(&reloading);
            }
        }
    }
}

/// Tells systemd, when it started us with a notify socket; without one this does nothing.
fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!("cannot notify systemd: {}", io_message(&e));
    }
}
