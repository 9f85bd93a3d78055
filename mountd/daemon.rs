//! `devremapd mount`: mounts the devfs, serves it, reloads it on SIGHUP, and unmounts on
//! SIGTERM/SIGINT or when someone else unmounts it.
//!
//! Everything happens on the main thread, one event at a time (signals, retired nodes let go,
//! the session ending), so reloads never overlap and SIGHUPs that arrive during one are
//! coalesced into one more. The FUSE session runs on its own threads and only reads the
//! shared [`Devfs`]. Readiness (pid file, state file, `READY=1`) is declared only once the
//! mount has answered a request.

use crate::cli::MountArgs;
use crate::mountpoint::{detach, prepare_mountpoint, wait_answering};
use devremap::adapter::Adapter;
use devremap::load::{self, Loaded, Sources};
use devremap::served::{Change, Devfs};
use devremap::{io_message, render};
use fuser::{Config, INodeNo, MountOption, Notifier, Session, SessionACL};
use log::{info, warn};
use sd_notify::NotifyState;
use serde_json::Value;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::ffi::OsStr;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// What the main loop reacts to.
enum Event {
    Signal(i32),
    /// A retired node was let go: the state file's count is stale.
    Retired,
    /// The FUSE session ended: someone unmounted us.
    Ended(io::Result<()>),
}

struct Daemon {
    sources: Sources,
    mountpoint: PathBuf,
    state_file: Option<PathBuf>,
    devfs: Arc<Devfs>,
    notifier: Notifier,
    current: Loaded,
    last_error: Option<String>,
}

pub fn run(args: &MountArgs) -> Result<(), String> {
    let sources = args.inputs.sources();
    let loaded = load::load(&sources).map_err(|e| e.to_string())?;
    let mountpoint = &args.mountpoint;
    let m = mountpoint.display();
    prepare_mountpoint(mountpoint)?;

    let devfs = Arc::new(Devfs::new(loaded.plan.tree.clone()));
    let (tx, rx) = mpsc::channel();
    let retired_tx = tx.clone();
    let on_retired = Box::new(move || {
        let _ = retired_tx.send(Event::Retired);
    });
    let mut signals = Signals::new([SIGHUP, SIGTERM, SIGINT]).map_err(|e| format!("cannot handle signals: {e}"))?;
    let signal_tx = tx.clone();
    std::thread::spawn(move || {
        for sig in signals.forever() {
            if signal_tx.send(Event::Signal(sig)).is_err() {
                break;
            }
        }
    });

    let failpoint =
        std::env::var("DEVREMAPD_FAILPOINT").ok().and_then(|f| f.strip_prefix("lookup-panic:").map(str::to_owned));
    let adapter =
        Adapter::new(devfs.clone(), Duration::from_secs(args.ttl), Some(on_retired)).panic_on_lookup(failpoint);
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("devremap".into()),
        MountOption::Dev,
        MountOption::NoSuid,
        MountOption::NoExec,
        MountOption::NoAtime,
        MountOption::DefaultPermissions,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(args.threads.into());
    let mut session =
        Session::new(adapter, mountpoint, &config).map_err(|e| format!("{m}: cannot mount: {}", io_message(&e)))?;
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
        mountpoint: mountpoint.clone(),
        state_file: args.state_file.clone(),
        devfs,
        notifier,
        current: loaded,
        last_error: None,
    };
    // Ready only once the mount answers: the pid file, then the state file (which scripts and
    // tests wait for). If either fails, nothing is left behind: no mount, no files.
    let mut written = Vec::new();
    let ready = wait_answering(mountpoint).and_then(|()| {
        if let Some(pid_file) = &args.pid_file {
            write_atomic(pid_file, format!("{}\n", std::process::id()).as_bytes())
                .map_err(|e| format!("{}: cannot write the pid file: {}", pid_file.display(), io_message(&e)))?;
            written.push(pid_file);
        }
        daemon.write_state()
    });
    if let Err(e) = ready {
        let _ = unmounter.unmount();
        detach(mountpoint);
        // Only what this daemon wrote: a state file that failed to write was never ours.
        for file in written {
            let _ = std::fs::remove_file(file);
        }
        return Err(e);
    }
    notify(&[NotifyState::Ready]);
    info!(
        "serving {m}: generation 1, nodes: {}, remapped GPUs: {}{}",
        daemon.current.plan.tree.len() - 1,
        daemon.current.plan.remap.iter().filter(|e| e.served).count(),
        warnings(&daemon.current)
    );

    let ended_by_us = daemon.serve(&rx);
    if ended_by_us {
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
    for file in [&args.pid_file, &args.state_file].into_iter().flatten() {
        let _ = std::fs::remove_file(file);
    }
    Ok(())
}

impl Daemon {
    /// Handles events until the daemon must stop. Returns true when we must unmount
    /// (a signal), false when the mount is already gone. Events queued together are handled
    /// as one batch: any number of SIGHUPs make one reload, and a stop wins over a reload.
    fn serve(&mut self, rx: &Receiver<Event>) -> bool {
        loop {
            let Ok(first) = rx.recv() else { return true };
            let batch: Vec<Event> = std::iter::once(first).chain(rx.try_iter()).collect();
            let (mut reload, mut retired) = (false, false);
            for event in batch {
                match event {
                    Event::Ended(r) => return self.ended(r),
                    Event::Signal(SIGHUP) => reload = true,
                    Event::Signal(sig) => {
                        info!("signal {sig}: stopping");
                        notify(&[NotifyState::Stopping]);
                        return true;
                    }
                    Event::Retired => retired = true,
                }
            }
            if reload {
                self.reload();
            } else if retired {
                self.update_state();
            }
        }
    }

    fn ended(&self, result: io::Result<()>) -> bool {
        match result {
            Ok(()) => info!("{}: unmounted from outside", self.mountpoint.display()),
            Err(e) => warn!("{}: the FUSE session ended: {e}", self.mountpoint.display()),
        }
        false
    }

    fn reload(&mut self) {
        let started = Instant::now();
        // systemd (Type=notify or notify-reload) shows the unit as reloading until READY=1.
        let mut reloading = vec![NotifyState::Reloading];
        reloading.extend(NotifyState::monotonic_usec_now().ok());
        notify(&reloading);
        self.reload_inputs(started);
        notify(&[NotifyState::Ready]);
    }

    fn reload_inputs(&mut self, started: Instant) {
        let generation = self.devfs.snapshot().generation;
        let loaded = match load::load(&self.sources) {
            Ok(l) => l,
            Err(e) => {
                warn!("reload refused: {e}; still serving generation {generation}");
                self.last_error = Some(e.to_string());
                self.update_state();
                return;
            }
        };
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
    fn write_state(&self) -> Result<(), String> {
        let Some(path) = &self.state_file else { return Ok(()) };
        let mut state = render::plan_json(&self.current.plan, self.current.metadata.as_ref());
        state.insert("generation".into(), self.devfs.snapshot().generation.into());
        state.insert("last_error".into(), self.last_error.clone().map_or(Value::Null, Value::from));
        state.insert("retired_nodes".into(), self.devfs.retired_count().into());
        state.insert("pid".into(), std::process::id().into());
        state.insert("mountpoint".into(), self.mountpoint.display().to_string().into());
        let mut text = Value::Object(state).to_string();
        text.push('\n');
        write_atomic(path, text.as_bytes())
            .map_err(|e| format!("{}: cannot write the state file: {}", path.display(), io_message(&e)))
    }

    /// Replaces the state file after a change; a failure is logged, and serving goes on.
    fn update_state(&self) {
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

/// Replaces `path` atomically: a temporary file in the same directory, then rename.
/// A temporary file left by a crash is named `.<name>.<pid>.tmp`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    let tmp = dir.join(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    // A replaced file keeps its permissions (a config.json may be private).
    if let Ok(meta) = std::fs::metadata(path) {
        f.set_permissions(meta.permissions())?;
    }
    f.write_all(bytes)?;
    f.sync_data()?;
    drop(f);
    std::fs::rename(&tmp, path)
}
