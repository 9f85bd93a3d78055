//! `create`, `run` and `restore` of a container that asks for devremap: claim the id (tearing
//! down a killed wrapper's leftover), decide from the spec, set up the container's directory and
//! `/dev` (through the node daemon), and replace this process with the runtime on our bundle;
//! undo everything if a step before that fails.

use crate::error::Failure;
use crate::procs::Host;
use crate::runner::{exec, exec_container, report, runtime_knows};
use crate::{RECORD_FILE, absolute, arg_of};
use devremap::node::protocol::MountRequest;
use devremap::runtime::annotations::{self, Request};
use devremap::runtime::argv::{BadId, Invocation, NewContainer};
use devremap::runtime::config::Config;
use devremap::runtime::container_daemon::{Container, DaemonError, Found, Lock, root_in_words};
use devremap::runtime::oci_patch::{self, PatchError};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What `start` needs to know beyond the command line.
pub struct Restoring {
    /// The checkpoint's metadata: the image's record, or a gVisor state file.
    pub metadata: Option<PathBuf>,
}

/// What a spec that asks for devremap gets.
struct Wanted {
    request: Request,
    /// The caller's spec, its `/dev` pointed at the mount and its paths made absolute.
    patched: Value,
    /// The caller's spec file, in the caller's bundle ([`callers_bundle`]).
    spec: PathBuf,
    metadata: Option<PathBuf>,
}

/// `create`, `run` and `restore` of a container that asks for devremap; the runtime alone for
/// one that does not.
pub fn start(
    config: &Config,
    inv: &Invocation,
    new: &NewContainer,
    restoring: Option<Restoring>,
) -> Result<u8, Failure> {
    let container = new.id.as_ref().map(|id| Container::new(&config.state_dir, id.as_str()));
    // The NRI plugin served this container at containerd's CreateContainer (issue 32): its spec
    // binds the plugin's mount at /dev already, and the directory is the plugin's, which tears
    // it down when containerd says the container ended.
    if container.as_ref().is_ok_and(Container::is_nri) {
        return Err(exec(config, inv.line.original()));
    }
    // A killed wrapper's leftover for this id is torn down before anything is set up.
    let claimed = match container.as_ref().ok().filter(|c| c.exists()) {
        Some(container) => {
            no_empty_root(inv)?;
            Some(claim(config, inv, container)?)
        }
        None => None,
    };
    let Some((container, wanted)) = decide(config, inv, new, container, restoring)? else {
        return Err(exec(config, inv.line.original()));
    };
    no_empty_root(inv)?;
    // Claiming the id and tearing down a leftover happen under the state dir's lock; the
    // container's own lock, held until this wrapper ends, tells others it is not a leftover.
    let claiming = match claimed {
        Some(lock) => lock,
        None => claim(config, inv, &container)?,
    };
    let pid_file = match &new.pid_file {
        Some(p) => absolute(p)?,
        None => container.default_container_pid_file(),
    };
    let pid_file_arg = arg_of(&pid_file)?;
    let devremapd = devremapd_path(config)?;
    // Held until the runtime replaces this process (the lock's descriptor is close-on-exec,
    // so the container never gets it), and by the node daemon's copy until the runtime exits.
    // A prepare that fails removes what it made (found from outside: an undo after it, finding
    // nothing, added "no such file or directory" to a full disk's error).
    let mine = container.prepare(inv.global.root.as_deref()).map_err(Failure::from)?;
    // Marked at once: a wrapper killed before its request reaches the node daemon leaves the
    // directory, which only a mark lets the node daemon take for one of its own to sweep.
    container.mark_node().map_err(|e| undo(&container, e.into()))?;
    drop(claiming);
    // The caller's bundle as `decide` resolved it: the directory of the spec it read.
    let callers = wanted.spec.parent().unwrap_or(Path::new("/"));
    let args =
        arg_of(&container.bundle()).and_then(|ours| Ok(new.line_for_bundle(&ours, &pid_file_arg, &arg_of(callers)?)));
    set_up(config, &container, wanted, &devremapd, &pid_file, &mine).map_err(|e| undo(&container, e))?;
    // The runtime replaces this process: no wrapper stays behind, and a foreground `run` is
    // the runtime itself. The container's keeper ends with the container's init (or with this
    // process, the runtime, when it exits before the container was made), and the node daemon
    // then removes the directory.
    Err(undo(&container, args.map_or_else(|e| e, |args| exec_container(config, &args))))
}

/// The caller's bundle directory: `--bundle`, else the working directory, as the runtime takes
/// it: it changes into the directory and works from there, so the physical path, `..` and
/// symlinks resolved (found from outside: the spec's `root.path` under `-b ../b` made runc
/// panic at a restore, and under a symlinked bundle runc refused it, `invalid rootfs`). One
/// that cannot be resolved (missing) is the runtime's to refuse, named as given.
pub fn callers_bundle(new: &NewContainer) -> Result<PathBuf, Failure> {
    let given = absolute(new.bundle.as_deref().unwrap_or("."))?;
    Ok(std::fs::canonicalize(&given).unwrap_or(given))
}

/// Whether the spec gets devremap, and the container and patched spec if so; `None` for the
/// runtime alone (a spec we cannot read or parse is the runtime's to refuse, in its own words).
fn decide(
    config: &Config,
    inv: &Invocation,
    new: &NewContainer,
    container: Result<Container, &BadId>,
    restoring: Option<Restoring>,
) -> Result<Option<(Container, Wanted)>, Failure> {
    let bundle = callers_bundle(new)?;
    let spec_path = bundle.join("config.json");
    let Some(original) = read_spec(&spec_path) else { return Ok(None) };
    // Larger than devremap reads: it cannot tell whether devremap was asked for, so the
    // runtime runs it as it is, saying so (found from outside: it ran without a word).
    let Some(original) = original else {
        let limit = devremap::inputs::metadata::MAX_METADATA_LEN >> 20;
        return Ok(without_devremap(
            inv,
            &format!("{}: over {limit} MiB, the most devremap reads", spec_path.display()),
        ));
    };
    let Ok(value) = serde_json::from_slice::<Value>(&original) else { return Ok(None) };
    if annotations::is_sandbox(&value) {
        return Ok(None);
    }
    let s = spec_path.display();
    let request = annotations::parse(&value, &config.annotations).map_err(|e| Failure::at(&s, e))?;
    // Only whether the spec wants GPUs matters here, not what its bind mounts are onto.
    let view = match devremap::inputs::spec::parse(&original, &|_| false) {
        Ok(v) => v,
        Err(e) if request.enable == Some(true) => return Err(Failure::at(&s, e)),
        Err(e) => return Ok(without_devremap(inv, &format!("{s}: {e}"))),
    };
    let metadata = restoring.and_then(|r| r.metadata);
    let recorded = metadata.as_ref().is_some_and(|m| m.ends_with(RECORD_FILE));
    if !(request.wanted(&view) || (recorded && request.enable != Some(false))) {
        return Ok(None);
    }
    let container = container.map_err(|bad| Failure::BadId(bad.clone()))?;
    let id = container.dir.file_name().unwrap_or_default().to_string_lossy();
    devremap::node::check_not_own_file(&id).map_err(|e| Failure::Node(e.to_string()))?;
    for warning in request.warnings() {
        report(&inv.global, "warning", &format!("{s}: {warning}"));
    }
    // The spec is patched before anything is set up: one that binds its own /dev is refused
    // when devremap was asked for, and runs without it otherwise (issue 17.6).
    let dev = container.dev();
    let dev = dev.to_str().ok_or_else(|| Failure::at(dev.display(), "not a UTF-8 path"))?;
    let patched = oci_patch::patch(&value, dev).and_then(|mut p| {
        oci_patch::relocate(&mut p, &bundle)?;
        Ok(p)
    });
    match patched {
        Ok(patched) => Ok(Some((container, Wanted { request, patched, spec: spec_path, metadata }))),
        Err(e @ (PatchError::DevBound { .. } | PatchError::BundleNotUtf8(_))) if request.enable != Some(true) => {
            Ok(without_devremap(inv, &format!("{s}: {e}")))
        }
        Err(e) => Err(Failure::at(&s, e)),
    }
}

/// Writes our bundle, keeps a restore's metadata, and has the node daemon mount the
/// container's `/dev`, which answers when this returns.
fn set_up(
    config: &Config,
    container: &Container,
    wanted: Wanted,
    devremapd: &Path,
    pid_file: &Path,
    mine: &Lock,
) -> Result<(), Failure> {
    let ours = container.write_bundle(&format!("{:#}\n", wanted.patched))?;
    let metadata = wanted.metadata.as_ref().map(|m| container.keep_metadata(m)).transpose()?;
    // The node daemon names the copies it reads; the caller knows the files they were made
    // from (found from outside: a refused record was named by its copy, which the undo removes).
    let copies = [(Some(&ours), Some(&wanted.spec)), (metadata.as_ref(), wanted.metadata.as_ref())];
    let copies: Vec<(String, String)> = copies
        .into_iter()
        .filter_map(|(copy, original)| Some((copy?.display().to_string(), original?.display().to_string())))
        .collect();
    let id = container.dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let request = MountRequest {
        id,
        state_dir: config.state_dir.clone(),
        spec: ours,
        host_dev: config.host_dev.clone(),
        host_root: config.host_root.clone(),
        metadata,
        extra: [config.daemon_args(), wanted.request.daemon_args()].concat(),
        container_pid_file: pid_file.to_owned(),
        // This process, which the runtime replaces.
        owner_pid: std::process::id(),
        until_unmount: false,
    };
    let (dev, id) = (container.dev(), request.id.clone());
    crate::node::mount(config, devremapd, request, mine.as_fd())
        .and_then(|()| crate::node::seen_here(config, &id, mine.as_fd(), &dev))
        .map_err(|e| match e {
            Failure::Node(why) => {
                Failure::Node(copies.iter().fold(why, |why, (copy, original)| why.replace(copy.as_str(), original)))
            }
            other => other,
        })
}

/// Refuses an empty `--root` for a devremap container, before its id is claimed (a claim with
/// it would wait for, or tear down, the id's directory first: found from outside). The
/// runtime takes an empty root for its working directory, which is our bundle: its state of
/// the container would go with our directory.
fn no_empty_root(inv: &Invocation) -> Result<(), Failure> {
    match inv.global.root.as_deref() {
        Some("") => Err(Failure::at(
            "--root",
            "empty; name the runtime's state directory, or leave --root out for the runtime's default",
        )),
        _ => Ok(()),
    }
}

/// The runtime alone, saying why: devremap was not asked for by name and the spec cannot have
/// it. Always `None` (run the runtime unchanged).
fn without_devremap<T>(inv: &Invocation, why: &str) -> Option<T> {
    report(&inv.global, "warning", &format!("{why}; running without devremap"));
    None
}

fn devremapd_path(config: &Config) -> Result<PathBuf, Failure> {
    if let Some(p) = &config.devremapd {
        return Ok(p.clone());
    }
    let me = std::env::current_exe().map_err(Failure::OwnExe)?;
    Ok(me.with_file_name("devremapd"))
}

/// Takes the state dir's lock to claim `container`'s id, and tears down a killed wrapper's
/// leftover directory for it; refuses an id another wrapper holds or another runtime root
/// uses. Replaces this process with the runtime when the runtime already knows the id (it
/// refuses it in its own words).
fn claim(config: &Config, inv: &Invocation, container: &Container) -> Result<Lock, Failure> {
    let id = container.dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let refused = |what: String| Err(Failure::Container { id: id.clone(), what });
    let keeper_gone_by = Instant::now() + KEEPER_PATIENCE;
    loop {
        let (lock, found) = container.claim(inv.global.root.as_deref())?;
        let Some(found) = found else { return Ok(lock) };
        return match found {
            Found::Busy => refused("another devremap-runtime is setting it up or running it".into()),
            Found::OtherRoot(theirs) => refused(format!(
                "the id is in use by a devremap container of {} (ids are unique per root only)",
                root_in_words(&theirs)
            )),
            Found::Idle if runtime_knows(config, &inv.line, &id).is_some() => Err(exec(config, inv.line.original())),
            // Left by a wrapper killed mid-way, its container never ran or is gone; but a keeper
            // that still serves watches a container that runs, whatever this root's runtime
            // says (found from outside: a root the runtime resolves otherwise than the wrapper,
            // through a symlink, had a running container's `/dev` torn down). One that is
            // stopping (its owner gone) is waited for, the state dir's lock let go meanwhile.
            Found::Idle => match container.daemon_pid() {
                Some(pid) if Instant::now() < keeper_gone_by => {
                    drop(lock);
                    devremap::pidfd::exits_within(pid, keeper_gone_by.saturating_duration_since(Instant::now()));
                    continue;
                }
                // Found from outside: a stopped keeper (`docker restart` after a `SIGSTOP` of it)
                // was said to serve a container of another root, sending the operator there.
                Some(pid) if !devremap::procfs::runs(pid) => refused(format!(
                    "its devremap /dev is still served by keeper pid {pid}, which is stopped (SIGSTOP, or a \
                     debugger) and so cannot end with its container: continue it (kill -CONT {pid}) or kill it"
                )),
                Some(pid) => refused(format!(
                    "its devremap /dev is still served (keeper pid {pid}) for a container the runtime does not know \
                     under this root: it runs under another runtime root, or one spelled otherwise; delete it there"
                )),
                None => Ok(container.teardown(&Host).map(|()| lock)?),
            },
        };
    }
}

/// How long a keeper still serving a directory the runtime does not know is given to stop (its
/// owner gone, it stops within a few seconds) before the id is refused as still served.
const KEEPER_PATIENCE: Duration = Duration::from_secs(5);

/// Undoes a half-made start: stops the daemon and removes the directory; returns `why`, with
/// what could not be undone.
fn undo(container: &Container, why: Failure) -> Failure {
    let cleanup: Vec<DaemonError> = container.teardown(&Host).err().into_iter().collect();
    if cleanup.is_empty() { why } else { Failure::Undone { why: Box::new(why), cleanup } }
}

/// The spec's bytes, `Some(None)` when it holds more than devremap reads; `None` when it
/// cannot be read (the runtime's to refuse, in its own words).
fn read_spec(path: &Path) -> Option<Option<Vec<u8>>> {
    let mut file = devremap::inputs::files::open_regular(path).ok()?;
    devremap::inputs::files::read_at_most(&mut file, devremap::inputs::metadata::MAX_METADATA_LEN).ok()
}
