//! `devremap-runtime`: an OCI runtime with runc's command line that runs the real runtime (runc
//! by default) and gives containers that ask for it a devremap `/dev`, the way
//! `nvidia-container-runtime` wraps runc.
//!
//! - `create`, `run`: when the spec asks for devremap (see `devremap::runtime::annotations`),
//!   start `devremapd mount` on `<state_dir>/<id>/dev`, point the bundle's spec at it, run the
//!   runtime. If that fails, or a foreground `run` ends, everything is undone.
//! - `checkpoint`: record the container's GPUs into `<image-path>/devremap-gpus.json` first.
//! - `restore`: as `create`, with the image's `devremap-gpus.json` (or a gVisor
//!   `checkpoint.img`) as the daemon's metadata.
//! - `delete`: after the runtime, once the runtime no longer knows the container, stop the
//!   daemon, put the bundle's original spec back and remove its directory; this also cleans up
//!   after a wrapper killed mid-create (as does the next `create` of that id).
//! - anything else: exec the runtime unchanged.
//!
//! A daemon never outlives its container: it runs with `--owner-pid` (this process) and
//! `--container-pid-file` (the runtime's pid file), so it stops when the container's init
//! exits, or when this wrapper dies before the container was started.

mod state;

use devremap::device::Access;
use devremap::io_message;
use devremap::runtime::annotations;
use devremap::runtime::argv::{self, Invocation};
use devremap::runtime::config::{self, Config};
use devremap::runtime::saved_spec::SavedSpec;
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use serde_json::Value;
use signal_hook::consts::signal::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH};
use state::{Container, DaemonArgs, Found};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};

/// The file `checkpoint` writes and `restore` reads in the image directory.
const RECORD_FILE: &str = "devremap-gpus.json";

fn main() -> ExitCode {
    let argv: Option<Vec<String>> = std::env::args_os().skip(1).map(|a| a.into_string().ok()).collect();
    let inv = argv::parse(&argv.unwrap_or_default());
    let result = load_config().and_then(|config| dispatch(&config, &inv));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(message) => {
            report(&inv, &message);
            ExitCode::FAILURE
        }
    }
}

fn dispatch(config: &Config, inv: &Invocation) -> Result<u8, String> {
    if std::env::args_os().skip(1).any(|a| a.to_str().is_none()) {
        // Not ours to understand: the runtime judges it.
        return Err(exec(config, std::env::args_os().skip(1).collect()));
    }
    match inv.command.as_deref() {
        Some("create" | "run") => start(config, inv, None),
        Some("restore") => restore(config, inv),
        Some("checkpoint") => checkpoint(config, inv),
        Some("delete") => delete(config, inv),
        _ => Err(exec(config, inv.original())),
    }
}

/// The config file: `DEVREMAP_RUNTIME_CONFIG`, else the default path if it exists.
fn load_config() -> Result<Config, String> {
    let (path, required) = match std::env::var_os(config::ENV) {
        Some(p) => (PathBuf::from(p), true),
        None => (PathBuf::from(config::DEFAULT_PATH), false),
    };
    let p = path.display();
    let mut file = match devremap::files::open_regular(&path) {
        Ok(f) => f,
        Err(devremap::files::FileError::Io(e)) if !required && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Config::default());
        }
        Err(devremap::files::FileError::Io(e)) => return Err(format!("{p}: {}", io_message(&e))),
        Err(devremap::files::FileError::NotRegular(what)) => {
            return Err(format!("{p}: is {what}; expected a regular file"));
        }
    };
    let mut buf = Vec::new();
    devremap::files::read_up_to(&mut file, config::MAX_LEN + 1, &mut buf)
        .map_err(|e| format!("{p}: {}", io_message(&e)))?;
    let config = config::parse(&buf).map_err(|e| format!("{p}: {e}"))?;
    if is_this_program(&config.runtime) {
        return Err(format!("{p}: runtime: {} is devremap-runtime itself", config.runtime.display()));
    }
    Ok(config)
}

/// Whether `runtime` (a path, or a name looked up on `PATH`) is this executable: running it
/// would run us again, forever.
fn is_this_program(runtime: &Path) -> bool {
    let found = if runtime.components().count() > 1 {
        Some(runtime.to_owned())
    } else {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(runtime))
            .find(|p| p.is_file())
    };
    let same = |a: &Path, b: &Path| matches!((std::fs::metadata(a), std::fs::metadata(b)), (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()));
    found.zip(std::env::current_exe().ok()).is_some_and(|(r, me)| same(&r, &me))
}

/// One error line on stderr and, as runc does, in the runtime's `--log` file, where
/// containerd and Docker look for the reason a runtime failed.
fn report(inv: &Invocation, message: &str) {
    // A path in the message may hold control characters: never a forged line (issue 9.6).
    let message = &*devremap::escape::escape(message);
    eprintln!("devremap-runtime: error: {message}");
    let Some(log) = &inv.log else { return };
    let line = if inv.log_format.as_deref() == Some("json") {
        serde_json::json!({"level": "error", "msg": format!("devremap-runtime: {message}")}).to_string()
    } else {
        format!("level=error msg={:?}", format!("devremap-runtime: {message}"))
    };
    if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(log) {
        let _ = std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes());
    }
}

fn runtime_command(config: &Config, args: impl IntoIterator<Item = impl AsRef<std::ffi::OsStr>>) -> Command {
    let mut c = Command::new(&config.runtime);
    c.args(args);
    c
}

/// Replaces this process with the runtime; returns only the error.
fn exec(config: &Config, args: Vec<impl AsRef<std::ffi::OsStr>>) -> String {
    let e = runtime_command(config, args).exec();
    format!("cannot run {}: {}", config.runtime.display(), io_message(&e))
}

/// Runs the runtime to its end, passing on the signals we get, and returns its exit status.
fn run_runtime(config: &Config, args: &[String]) -> Result<u8, String> {
    let mut child = runtime_command(config, args)
        .spawn()
        .map_err(|e| format!("cannot run {}: {}", config.runtime.display(), io_message(&e)))?;
    let pid = Pid::from_raw(child.id() as libc::pid_t);
    let mut signals =
        signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH])
            .map_err(|e| format!("cannot handle signals: {e}"))?;
    let handle = signals.handle();
    let forwarder = std::thread::spawn(move || {
        for sig in signals.forever().filter_map(|sig| Signal::try_from(sig).ok()) {
            let _ = kill(pid, sig);
        }
    });
    // Wait for the exit without reaping: until the forwarder has stopped, the pid stays our
    // child's (a zombie), so a late signal never reaches a process that reused it.
    let exited = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
    while let Err(Errno::EINTR) = waitid(Id::Pid(pid), exited) {}
    handle.close();
    let _ = forwarder.join();
    let status = child.wait();
    let status = status.map_err(|e| format!("waiting for {}: {}", config.runtime.display(), io_message(&e)))?;
    Ok(status.code().map_or_else(|| 128 + status.signal().unwrap_or(0) as u8, |c| c as u8))
}

/// Whether the runtime knows container `id` (`<runtime> state <id>` succeeds).
fn runtime_knows(config: &Config, inv: &Invocation, id: &str) -> Option<Value> {
    let out = runtime_command(config, inv.sibling("state", &[id])).stderr(std::process::Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(serde_json::from_slice(&out.stdout).unwrap_or(Value::Null))
}

fn devremapd_path(config: &Config) -> Result<PathBuf, String> {
    if let Some(p) = &config.devremapd {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().map_err(|e| format!("cannot find our own executable: {}", io_message(&e)))?;
    Ok(me.with_file_name("devremapd"))
}

fn absolute(p: &str) -> Result<PathBuf, String> {
    std::path::absolute(p).map_err(|e| format!("{p}: {}", io_message(&e)))
}

/// What `start` needs to know beyond the command line.
struct Restoring {
    /// The checkpoint's metadata: the image's record, or a gVisor state file.
    metadata: Option<PathBuf>,
}

/// `create`, `run` and `restore` of a container that asks for devremap.
fn start(config: &Config, inv: &Invocation, restoring: Option<Restoring>) -> Result<u8, String> {
    let c = inv.command_args();
    let Some(id) = c.id.clone() else { return Err(exec(config, inv.original())) };
    let root = inv.root.as_deref();
    let container = argv::valid_id(&id).then(|| Container::new(&config.state_dir, &id));
    // A killed wrapper's leftover for this id may hold the bundle's original spec: it is put
    // back before the spec is read, or the patched one would be taken for the original.
    let mut claimed = None;
    if let Some(container) = container.as_ref().filter(|c| c.exists()) {
        claimed = Some(claim(config, inv, container)?);
    }
    let bundle = absolute(c.bundle.as_deref().unwrap_or("."))?;
    let spec_path = bundle.join("config.json");
    // A spec we cannot read or parse is the runtime's to refuse, in its own words.
    let Some(original) = read_spec(&spec_path) else { return Err(exec(config, inv.original())) };
    let Ok(value) = serde_json::from_slice::<Value>(&original) else { return Err(exec(config, inv.original())) };
    let s = spec_path.display();
    let request = annotations::parse(&value).map_err(|e| format!("{s}: {e}"))?;
    // Only whether the spec wants GPUs matters here, not what its bind mounts are onto.
    let view = match devremap::spec::parse(&original, &|_| false) {
        Ok(v) => v,
        Err(e) if request.enable == Some(true) => return Err(format!("{s}: {e}")),
        Err(e) => {
            eprintln!("devremap-runtime: warning: {s}: {e}; running without devremap");
            return Err(exec(config, inv.original()));
        }
    };
    let metadata = restoring.and_then(|r| r.metadata);
    let recorded = metadata.as_ref().is_some_and(|m| m.ends_with(RECORD_FILE));
    if !(request.wanted(&view) || (recorded && request.enable != Some(false))) {
        return Err(exec(config, inv.original()));
    }
    let Some(container) = container else {
        return Err(format!("container id {id:?}: only letters, digits and _+-. are allowed"));
    };
    // The patch and its undoing replace the file: they would turn a link into a copy.
    let spec_meta = std::fs::symlink_metadata(&spec_path).map_err(|e| format!("{s}: {}", io_message(&e)))?;
    if spec_meta.file_type().is_symlink() {
        return Err(format!(
            "{s}: is a symbolic link; devremap-runtime rewrites the spec in place: give it a regular file"
        ));
    }
    // Claiming the id and tearing down a leftover happen under the state dir's lock; the
    // container's own lock, held until this wrapper ends, tells others it is not a leftover.
    let claiming = match claimed {
        Some(lock) => lock,
        None => claim(config, inv, &container)?,
    };
    let pid_file = match &c.pid_file {
        Some(p) => absolute(p)?,
        None => container.default_container_pid_file(),
    };
    let pid_file_arg = pid_file.to_str().ok_or_else(|| format!("{}: not a UTF-8 path", pid_file.display()))?;
    let _mine = container.prepare(root).map_err(|e| undo(&container, None, e))?;
    drop(claiming);
    let devremapd = devremapd_path(config)?;
    let daemon = container.start_daemon(&DaemonArgs {
        devremapd: &devremapd,
        spec: &spec_path,
        host_dev: config.host_dev.as_deref(),
        host_root: &config.host_root,
        metadata: metadata.as_deref(),
        extra: request.daemon_args(),
        container_pid_file: &pid_file,
    });
    let daemon = match daemon {
        Ok(d) => d,
        Err(e) => return Err(undo(&container, None, e)),
    };
    let saved = SavedSpec {
        path: spec_path.clone(),
        access: Access { mode: spec_meta.mode() & 0o7777, uid: spec_meta.uid(), gid: spec_meta.gid() },
        // The spec parsed as JSON, which is UTF-8.
        original: String::from_utf8_lossy(&original).into_owned(),
        patched: String::new(),
    };
    if let Err(e) = patch_spec(&container, saved, &value) {
        return Err(undo(&container, Some(daemon), e));
    }
    let code = match run_runtime(config, &inv.with_pid_file(pid_file_arg)) {
        Ok(code) => code,
        Err(e) => return Err(undo(&container, Some(daemon), e)),
    };
    let foreground = inv.command.as_deref() != Some("create") && !c.detach;
    if code != 0 || (foreground && !c.keep) {
        // Failed, or a foreground container ended and the runtime deleted it.
        container.teardown(Some(daemon))?;
    }
    Ok(code)
}

/// Takes the state dir's lock to claim `container`'s id, and tears down a killed wrapper's
/// leftover directory for it (putting its bundle's spec back); refuses an id another wrapper
/// holds or another runtime root uses. Replaces this process with the runtime when the runtime
/// already knows the id (it refuses it in its own words).
fn claim(config: &Config, inv: &Invocation, container: &Container) -> Result<state::Lock, String> {
    let lock = container.lock_state_dir()?;
    if !container.exists() {
        return Ok(lock);
    }
    let id = container.dir.file_name().unwrap_or_default().to_string_lossy();
    match container.found(inv.root.as_deref())? {
        Found::Busy => Err(format!("container {id}: another devremap-runtime is setting it up or running it")),
        Found::OtherRoot(theirs) => Err(format!(
            "container {id}: the id is in use by a devremap container of runtime root {theirs:?} \
             (ids are unique per root only)"
        )),
        Found::Idle if runtime_knows(config, inv, &id).is_some() => Err(exec(config, inv.original())),
        // Left by a wrapper killed mid-way: its container never ran or is gone.
        Found::Idle => container.teardown(None).map(|()| lock),
    }
}

/// Undoes a half-made start: stops the daemon, puts the bundle's spec back and removes the
/// directory; returns `why`, with what could not be undone.
fn undo(container: &Container, daemon: Option<Child>, why: String) -> String {
    match container.teardown(daemon) {
        Ok(()) => why,
        Err(e) => format!("{why}; and {e}"),
    }
}

fn read_spec(path: &Path) -> Option<Vec<u8>> {
    let mut file = devremap::files::open_regular(path).ok()?;
    let mut buf = Vec::new();
    devremap::files::read_up_to(&mut file, devremap::metadata::MAX_METADATA_LEN, &mut buf).ok()?;
    Some(buf)
}

/// Points the spec's `/dev` at the mount, as `devremapd oci-patch --in-place` does, after
/// saving the original in the container's directory (`saved` without its `patched`).
fn patch_spec(container: &Container, mut saved: SavedSpec, spec: &Value) -> Result<(), String> {
    let dev = container.dev();
    let p = saved.path.display().to_string();
    let dev = dev.to_str().ok_or_else(|| format!("{}: not a UTF-8 path", dev.display()))?;
    let patched = devremap::oci_patch::patch(spec, dev).map_err(|e| format!("{p}: {e}"))?;
    saved.patched = format!("{patched:#}\n");
    container.save_spec(&saved)?;
    devremap::atomic::replace_file(&saved.path, saved.patched.as_bytes()).map_err(|e| e.to_string())
}

/// The image directory of a checkpoint or restore: `--image-path`, else runc's default
/// `./checkpoint`.
fn image_dir(inv: &Invocation) -> Result<PathBuf, String> {
    absolute(inv.command_args().image_path.as_deref().unwrap_or("checkpoint"))
}

fn restore(config: &Config, inv: &Invocation) -> Result<u8, String> {
    let image = image_dir(inv)?;
    let metadata = [RECORD_FILE, "checkpoint.img"].iter().map(|f| image.join(f)).find(|p| p.is_file());
    start(config, inv, Some(Restoring { metadata }))
}

/// Records the GPUs of a devremap container into the image directory, then checkpoints.
fn checkpoint(config: &Config, inv: &Invocation) -> Result<u8, String> {
    let id = inv.command_args().id.filter(|id| argv::valid_id(id));
    if let Some(id) = id
        && let container = Container::new(&config.state_dir, &id)
        && container.exists()
        && container.other_root(inv.root.as_deref()).is_none()
    {
        let state =
            runtime_knows(config, inv, &id).ok_or_else(|| format!("container {id}: the runtime does not know it"))?;
        let bundle =
            state["bundle"].as_str().ok_or_else(|| format!("container {id}: the runtime's state names no bundle"))?;
        let image = image_dir(inv)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .create(&image)
            .map_err(|e| format!("{}: {}", image.display(), io_message(&e)))?;
        // As `devremapd record --metadata PREV`: a container restored with metadata carries the
        // names it was given into the record; the restore was judged then, not here.
        let sources = devremap::load::Sources {
            metadata: container.daemon_metadata(),
            spec: Some(Path::new(bundle).join("config.json")),
            host_dev: config.host_dev.clone(),
            host_root: config.host_root.clone(),
            ..Default::default()
        };
        let loaded = devremap::load::load_unchecked(&sources).map_err(|e| e.to_string())?;
        // As `devremapd record` does: the record still pairs by minor, but say what it lacks.
        for gap in devremap::record::gaps(&loaded.plan) {
            let line = format!("{}: {gap}", config.host_root.display());
            eprintln!("devremap-runtime: warning: {}", devremap::escape::escape(&line));
        }
        let text = format!("{:#}\n", devremap::record::devices(&loaded.plan, sources.metadata.is_some()));
        let out = image.join(RECORD_FILE);
        devremap::atomic::replace_file(&out, text.as_bytes()).map_err(|e| e.to_string())?;
    }
    Err(exec(config, inv.original()))
}

/// Deletes through the runtime, then, once the runtime no longer knows the container, stops
/// its daemon and removes its directory (also when the runtime's delete failed because the
/// container never got made).
fn delete(config: &Config, inv: &Invocation) -> Result<u8, String> {
    let code = run_runtime(config, &inv.original())?;
    if let Some(id) = inv.command_args().id.filter(|id| argv::valid_id(id)) {
        let container = Container::new(&config.state_dir, &id);
        if container.exists() {
            // Not a container another wrapper is setting up or running, nor another root's.
            let _claiming = container.lock_state_dir()?;
            if let Found::Idle = container.found(inv.root.as_deref())?
                && runtime_knows(config, inv, &id).is_none()
            {
                container.teardown(None)?;
            }
        }
    }
    Ok(code)
}
