//! `devremap-runtime`: an OCI runtime with runc's command line that runs the real runtime (runc
//! by default) and gives containers that ask for it a devremap `/dev`, the way
//! `nvidia-container-runtime` wraps runc.
//!
//! - `create`, `run`: when the spec asks for devremap (see `devremap::runtime::annotations`),
//!   start `devremapd mount` on `<state_dir>/<id>/dev`, write the caller's spec, its `/dev`
//!   pointed at the mount, into a bundle of our own (`<state_dir>/<id>/bundle`) and run the
//!   runtime on that bundle: the caller's bundle is never written. If that fails, or a
//!   foreground `run` ends, everything is undone.
//! - `checkpoint`: record the container's GPUs into `<image-path>/devremap-gpus.json` first.
//! - `restore`: as `create`, with a copy of the image's `devremap-gpus.json` (or a gVisor
//!   `checkpoint.img`) as the daemon's metadata.
//! - `delete`: after the runtime, once the runtime no longer knows the container, stop the
//!   daemon and remove its directory; this also cleans up after a wrapper killed mid-create
//!   (as does the next `create` of that id).
//! - anything else: exec the runtime unchanged.
//!
//! The config is `--devremap-config PATH` (a global flag, taken out before the runtime sees
//! the line), else `DEVREMAP_RUNTIME_CONFIG`, else `/etc/devremap/runtime.json`: the flag and
//! the default path survive a caller that strips the environment, as Podman's conmon does.
//!
//! The runtime, when it runs as our child (create, run, restore, delete), gets the read end of
//! an empty pipe for stdin where ours is the host's `/dev/null`: runc reopens such stdio inside the container only when it builds `/dev`
//! itself, and CRIU cannot checkpoint a descriptor on a mount outside the container
//! (`docker run -d`, `podman run -d`); a pipe with no writer reads as `/dev/null` does.
//!
//! A daemon never outlives its container: it runs with `--owner-pid` (this process) and
//! `--container-pid-file` (the runtime's pid file), so it stops when the container's init
//! exits, or when this wrapper dies before the container was started.

#[path = "../pidfd.rs"]
mod pidfd;
mod state;

use devremap::io_message;
use devremap::runtime::annotations;
use devremap::runtime::argv::{self, Invocation};
use devremap::runtime::config::{self, Config};
use devremap::runtime::oci_patch::PatchError;
use devremap::runtime::osarg;
use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use serde_json::Value;
use signal_hook::consts::signal::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH};
use state::{Container, DaemonArgs, Found};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};

/// The file `checkpoint` writes and `restore` reads in the image directory.
const RECORD_FILE: &str = "devremap-gpus.json";

fn main() -> ExitCode {
    // Arguments that are not UTF-8 are carried through, each byte standing in (issue 17.8).
    let argv: Option<Vec<String>> = std::env::args_os().skip(1).map(|a| osarg::encode(&a)).collect();
    let inv = argv::parse(argv.as_deref().unwrap_or_default());
    // `--help`, `--version`: our lines first, then the real runtime's (run below, unchanged).
    if let Some(ask) = devremap::runtime::about::asked(&inv) {
        let text = devremap::runtime::about::text(ask, std::env::var_os(config::ENV).as_deref());
        let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    }
    let result = load_config(&inv).and_then(|config| dispatch(&config, &inv));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(message) => {
            report(&inv, "error", &message);
            ExitCode::FAILURE
        }
    }
}

fn dispatch(config: &Config, inv: &Invocation) -> Result<u8, String> {
    if std::env::args_os().skip(1).any(|a| osarg::encode(&a).is_none()) {
        // Not ours to understand: the runtime judges it.
        let e = Command::new(&config.runtime).args(std::env::args_os().skip(1)).exec();
        return Err(format!("cannot run {}: {}", config.runtime.display(), io_message(&e)));
    }
    match inv.command.as_deref() {
        Some("create" | "run") => start(config, inv, None),
        Some("restore") => restore(config, inv),
        Some("checkpoint") => checkpoint(config, inv),
        Some("delete") => delete(config, inv),
        _ => Err(exec(config, inv.original())),
    }
}

/// The config file: `--devremap-config`, else `DEVREMAP_RUNTIME_CONFIG`, else the default path
/// if it exists (a file named by the flag or the variable must exist).
fn load_config(inv: &Invocation) -> Result<Config, String> {
    let (path, required) = match (&inv.config, std::env::var_os(config::ENV)) {
        (Some(p), _) => (PathBuf::from(osarg::decode(p)), true),
        (None, Some(p)) => (PathBuf::from(p), true),
        (None, None) => (PathBuf::from(config::DEFAULT_PATH), false),
    };
    let p = path.display();
    let mut file = match devremap::inputs::files::open_regular(&path) {
        Ok(f) => f,
        Err(devremap::inputs::files::FileError::Io(e)) if !required && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Config::default());
        }
        Err(e) => return Err(format!("{p}: {e}")),
    };
    let meta = file.metadata().map_err(|e| format!("{p}: {}", io_message(&e)))?;
    let me = nix::unistd::geteuid().as_raw();
    config::check_access(meta.uid(), meta.mode(), me).map_err(|e| format!("{p}: {e}"))?;
    let mut buf = Vec::new();
    devremap::inputs::files::read_up_to(&mut file, config::MAX_LEN + 1, &mut buf)
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

/// One line at `level` (`error`, `warning`) in the runtime's `--log` file when there is one, as
/// runc does, where containerd and Docker look for the reason a runtime failed; on stderr when
/// there is none, and always for an error. A warning kept off stderr then is never taken by a
/// caller for the error of a runtime that failed after it.
fn report(inv: &Invocation, level: &str, message: &str) {
    // A path in the message may hold control characters: never a forged line (issue 9.6).
    let message = &*devremap::decision::escape::escape(message);
    if level == "error" || inv.log.is_none() {
        eprintln!("devremap-runtime: {level}: {message}");
    }
    let Some(log) = &inv.log else { return };
    let line = if inv.log_format.as_deref() == Some("json") {
        serde_json::json!({"level": level, "msg": format!("devremap-runtime: {message}")}).to_string()
    } else {
        format!("level={level} msg={:?}", format!("devremap-runtime: {message}"))
    };
    if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(osarg::decode(log)) {
        let _ = std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes());
    }
}

/// The runtime with `args`, each as the caller gave it (see `osarg`).
fn runtime_command(config: &Config, args: &[String]) -> Command {
    let mut c = Command::new(&config.runtime);
    c.args(args.iter().map(|a| osarg::decode(a)));
    c
}

/// Replaces this process with the runtime; returns only the error.
fn exec(config: &Config, args: Vec<String>) -> String {
    let e = runtime_command(config, &args).exec();
    format!("cannot run {}: {}", config.runtime.display(), io_message(&e))
}

/// The read end of an empty pipe whose write end is closed: what a create, run or restore is
/// given as stdin in place of the host's `/dev/null` (see the module doc). `None` when stdin is
/// anything else.
fn stdin_in_place_of_dev_null() -> Result<Option<std::os::fd::OwnedFd>, String> {
    let meta = match std::fs::metadata("/proc/self/fd/0") {
        Ok(m) => m,
        Err(_) => return Ok(None),
    };
    if !(meta.file_type().is_char_device() && meta.rdev() == libc::makedev(1, 3)) {
        return Ok(None);
    }
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| format!("cannot make a pipe for the container's stdin: {}", e.desc()))?;
    drop(write);
    Ok(Some(read))
}

/// Runs the runtime to its end, passing on the signals we get, and returns its exit status.
fn run_runtime(config: &Config, args: &[String]) -> Result<u8, String> {
    let mut command = runtime_command(config, args);
    if let Some(stdin) = stdin_in_place_of_dev_null()? {
        command.stdin(std::process::Stdio::from(stdin));
    }
    let mut child =
        command.spawn().map_err(|e| format!("cannot run {}: {}", config.runtime.display(), io_message(&e)))?;
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
    let out =
        runtime_command(config, &inv.sibling("state", &[id])).stderr(std::process::Stdio::null()).output().ok()?;
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
    let p = osarg::decode(p);
    std::path::absolute(&p).map_err(|e| format!("{}: {}", p.display(), io_message(&e)))
}

/// `path` as an argument of the runtime's command line (see `osarg`).
fn arg_of(path: &Path) -> Result<String, String> {
    osarg::encode(path.as_os_str()).ok_or_else(|| format!("{}: a path the wrapper cannot pass on", path.display()))
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
    // A killed wrapper's leftover for this id is torn down before anything is set up.
    let mut claimed = None;
    if let Some(container) = container.as_ref().filter(|c| c.exists()) {
        claimed = Some(claim(config, inv, container)?);
    }
    let bundle = absolute(c.bundle.as_deref().unwrap_or("."))?;
    let spec_path = bundle.join("config.json");
    // A spec we cannot read or parse is the runtime's to refuse, in its own words.
    let Some(original) = read_spec(&spec_path) else { return Err(exec(config, inv.original())) };
    let Ok(value) = serde_json::from_slice::<Value>(&original) else { return Err(exec(config, inv.original())) };
    if annotations::is_sandbox(&value) {
        return Err(exec(config, inv.original()));
    }
    let s = spec_path.display();
    let request = annotations::parse(&value).map_err(|e| format!("{s}: {e}"))?;
    // Only whether the spec wants GPUs matters here, not what its bind mounts are onto.
    let view = match devremap::inputs::spec::parse(&original, &|_| false) {
        Ok(v) => v,
        Err(e) if request.enable == Some(true) => return Err(format!("{s}: {e}")),
        Err(e) => return without_devremap(config, inv, &format!("{s}: {e}")),
    };
    let metadata = restoring.and_then(|r| r.metadata);
    let recorded = metadata.as_ref().is_some_and(|m| m.ends_with(RECORD_FILE));
    if !(request.wanted(&view) || (recorded && request.enable != Some(false))) {
        return Err(exec(config, inv.original()));
    }
    let Some(container) = container else {
        return Err(format!("container id {id:?}: only letters, digits and _+-. are allowed"));
    };
    // The spec is patched before anything is set up: one that binds its own /dev is refused
    // when devremap was asked for, and runs without it otherwise (issue 17.6).
    let dev = container.dev();
    let dev = dev.to_str().ok_or_else(|| format!("{}: not a UTF-8 path", dev.display()))?;
    let patched = devremap::runtime::oci_patch::patch(&value, dev).and_then(|mut p| {
        devremap::runtime::oci_patch::relocate(&mut p, &bundle)?;
        Ok(p)
    });
    let patched = match patched {
        Ok(p) => p,
        Err(e @ (PatchError::DevBound { .. } | PatchError::BundleNotUtf8(_))) if request.enable != Some(true) => {
            return without_devremap(config, inv, &format!("{s}: {e}"));
        }
        Err(e) => return Err(format!("{s}: {e}")),
    };
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
    let pid_file_arg = arg_of(&pid_file)?;
    let _mine = container.prepare(root).map_err(|e| undo(&container, None, e))?;
    drop(claiming);
    let ours = container.write_bundle(&format!("{patched:#}\n")).map_err(|e| undo(&container, None, e))?;
    let metadata = match metadata.map(|m| container.keep_metadata(&m)).transpose() {
        Ok(m) => m,
        Err(e) => return Err(undo(&container, None, e)),
    };
    let devremapd = devremapd_path(config)?;
    let daemon = container.start_daemon(&DaemonArgs {
        devremapd: &devremapd,
        spec: &ours,
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
    let code = match arg_of(&container.bundle()).and_then(|b| run_runtime(config, &inv.with_bundle(&b, &pid_file_arg)))
    {
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

/// Runs the container on the runtime alone, saying why: devremap was not asked for by name and
/// the spec cannot have it.
fn without_devremap(config: &Config, inv: &Invocation, why: &str) -> Result<u8, String> {
    report(inv, "warning", &format!("{why}; running without devremap"));
    Err(exec(config, inv.original()))
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

/// Undoes a half-made start: stops the daemon and removes the directory; returns `why`, with
/// what could not be undone.
fn undo(container: &Container, daemon: Option<Child>, why: String) -> String {
    match container.teardown(daemon) {
        Ok(()) => why,
        Err(e) => format!("{why}; and {e}"),
    }
}

fn read_spec(path: &Path) -> Option<Vec<u8>> {
    let mut file = devremap::inputs::files::open_regular(path).ok()?;
    let mut buf = Vec::new();
    devremap::inputs::files::read_up_to(&mut file, devremap::inputs::metadata::MAX_METADATA_LEN, &mut buf).ok()?;
    Some(buf)
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
        let sources = devremap::inputs::load::Sources {
            metadata: container.restored_metadata(),
            spec: Some(Path::new(bundle).join("config.json")),
            host_dev: config.host_dev.clone(),
            host_root: config.host_root.clone(),
            ..Default::default()
        };
        let loaded = devremap::inputs::load::load_unchecked(&sources).map_err(|e| e.to_string())?;
        // As `devremapd record` does: the record still pairs by minor, but say what it lacks.
        for gap in devremap::decision::record::gaps(&loaded.plan) {
            report(inv, "warning", &format!("{}: {gap}", config.host_root.display()));
        }
        let text = format!("{:#}\n", devremap::decision::record::devices(&loaded.plan, sources.metadata.is_some()));
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
