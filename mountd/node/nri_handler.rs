//! The NRI plugin's handler (issue 32): what the node daemon does when containerd creates,
//! stops, removes or lists containers. The transport (the multiplexed ttrpc connection)
//! calls it through [`devremap::nri::view::Handler`]; the decision is
//! [`devremap::nri::decide`]'s, and the mount is the node daemon's own ([`Node::mount`]), in
//! this process.
//!
//! A served container's directory `<state_dir>/<id>/` is prepared as the wrapper prepares it
//! (under the state dir's lock, no planted symlink followed), holds the spec synthesised from
//! NRI's view, the record it was created with (`restore/devremap-gpus.json`, from
//! `devremap.io/gpus`) and the marks `node` and `nri`. Its init is not known at
//! `CreateContainer`, so its keeper watches no process (`until_unmount`): the mount lasts until
//! `StopContainer` or `RemoveContainer`, and `Synchronize` (at each registration: after this
//! daemon's restart or containerd's) tears down every NRI container containerd no longer runs.
//! At `PostStartContainer` the init's pid and start time go into the `nri` mark: containerd 1.7
//! leaves out of `Synchronize` a container it marked unknown (its shim slow after containerd's
//! restart), and one whose init still runs is kept. Teardowns run on a thread of their own: a
//! keeper's stop may take long, and containerd holds every NRI event of the node until the
//! plugin answers, dropping a plugin that takes over 2 s. For the same reason a create is done
//! on a thread of its own and answered within `--nri-timeout`: containerd takes a plugin that
//! does not answer in time for gone and creates the container *without* its adjustment (a GPU
//! container with runc's `/dev`), where an error fails the create and the kubelet tries again.
//! What a create given up on makes later is torn down, as is what a create that panicked
//! left. A keeper outlives this daemon as for the wrapper's containers, and a daemon started
//! again adopts it from the state dir.
//!
//! Assumption: containerd does not reuse a container id (CRI ids are random), so a directory
//! found for a new container is a leftover of a plugin killed mid-way, not served, and torn
//! down.

use super::{Node, NodeError, procs::Host};
use devremap::inputs::load::Sources;
use devremap::node::protocol::MountRequest;
use devremap::nri::decide::{self, Decision, Served};
use devremap::nri::view::{Adjustment, Container, Handler, Pod, State};
use devremap::runtime::annotations::GPUS;
use devremap::runtime::config::Config;
use devremap::runtime::container_daemon::{Container as Dir, Lock};
use log::{info, warn};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

/// The name a restored container's record is kept under, as the wrapper's checkpoint writes it.
const RECORD_FILE: &str = "devremap-gpus.json";

/// The node daemon as the NRI plugin: built by [`NriHandler::new`] and handed to the transport.
pub struct NriHandler {
    /// What a create's thread needs: the node daemon and the runtime config.
    serving: Arc<Serving>,
    /// To the teardown thread: containers to tear down, and why (see [`tear_down`]).
    teardowns: Mutex<Sender<(String, &'static str)>>,
    /// How long a create may take before it is answered with an error (`--nri-timeout`), and
    /// `PostCreateContainer` before it gives up on the mount.
    timeout: Duration,
    /// The mounts under way, by container id: a create answers once the container's directory
    /// is set up, and its keeper's start (two processes: most of a create's time) overlaps
    /// containerd's own work on the container until `PostCreateContainer`, which waits for it.
    mounting: Arc<Mutex<HashMap<String, Mounting>>>,
}

/// What serving a container takes, shared with the create's thread.
struct Serving {
    node: Arc<Node>,
    /// The runtime config: `host_dev`, `host_root`, `annotations`, `relax` (its `state_dir` is
    /// the node daemon's `--state-dir`).
    config: Config,
}

/// A result one thread hands another, which waits for it until a deadline and may give up on
/// it: then the result goes back to its giver, who undoes what it made.
struct Handoff<T> {
    /// The result, once given; whether the waiter gave up.
    state: Mutex<(Option<T>, bool)>,
    given: Condvar,
}

impl<T> Handoff<T> {
    fn new() -> Arc<Handoff<T>> {
        Arc::new(Handoff { state: Mutex::new((None, false)), given: Condvar::new() })
    }

    /// Hands `value` over; it comes back when the waiter has given up on it.
    fn give(&self, value: T) -> Option<T> {
        let mut state = self.state.lock();
        if state.1 {
            return Some(value);
        }
        state.0 = Some(value);
        self.given.notify_all();
        None
    }

    /// The value, once given; `None` if it is not given by `deadline` (then the waiter gives up
    /// on it). No deadline: until it is given.
    fn wait(&self, deadline: Option<Instant>) -> Option<T> {
        let mut state = self.state.lock();
        while state.0.is_none() {
            match deadline {
                Some(deadline) if self.given.wait_until(&mut state, deadline).timed_out() => break,
                Some(_) => {}
                None => self.given.wait(&mut state),
            }
        }
        let value = state.0.take();
        state.1 = value.is_none();
        value
    }
}

/// What a create's thread answers when it panicked, once what it left is removed.
fn panicked<T>(serving: &Serving, dir: &Dir, id: &str) -> Result<T, String> {
    discard(&serving.node, dir, id);
    Err("the plugin failed (a panic; see the node daemon's log); nothing is left of it".to_owned())
}

/// A container's mount under way since `create` answered: its result, for `PostCreateContainer`.
type Mounting = Arc<Handoff<Result<(), String>>>;

impl NriHandler {
    /// The handler of `node`, with the runtime config at `config` (`--config`; `None`: the
    /// default path, whose absence gives the defaults, as for the wrapper). A config that is
    /// not root's alone, or not valid, is refused as the wrapper refuses it.
    /// A create not done within `timeout` is answered with an error.
    pub(super) fn new(node: Arc<Node>, config: Option<&Path>, timeout: Duration) -> Result<NriHandler, NodeError> {
        let (path, required) = match config {
            Some(path) => (path, true),
            None => (Path::new(devremap::runtime::config::DEFAULT_PATH), false),
        };
        let config = super::config_file::read(path, required).map_err(|e| NodeError::Config(e.to_string()))?;
        if config.state_dir != node.state_dir {
            warn!(
                "NRI: the runtime config's state_dir {} is not this node daemon's {}: NRI containers go in the daemon's",
                config.state_dir.display(),
                node.state_dir.display()
            );
        }
        let (teardowns, queued) = mpsc::channel::<(String, &'static str)>();
        let (tearing, mounting) = (node.clone(), Arc::new(Mutex::new(HashMap::<String, Mounting>::new())));
        let underway = mounting.clone();
        let tear = move |(id, why): (String, &'static str)| {
            // A mount under way (containerd undoing a create) is waited for, not raced.
            let pending = underway.lock().remove(&id);
            if let Some(pending) = pending {
                pending.wait(None);
            }
            tear_down(&tearing, &id, why)
        };
        std::thread::Builder::new()
            .name("nri-teardown".into())
            .spawn(move || queued.iter().for_each(tear))
            .map_err(NodeError::Thread)?;
        let serving = Arc::new(Serving { node, config });
        Ok(NriHandler { serving, teardowns: Mutex::new(teardowns), timeout, mounting })
    }

    fn node(&self) -> &Node {
        &self.serving.node
    }

    /// Has NRI container `id` torn down on the teardown thread: containerd holds every NRI
    /// event of the node until a plugin answers, and drops a plugin that takes over 2 s (a
    /// GPU container created meanwhile would get no devremap), so no teardown (a keeper's stop
    /// may take long) is done on the plugin's thread.
    fn end(&self, id: &str, why: &'static str) {
        let _ = self.teardowns.lock().send((id.to_owned(), why));
    }

    /// Serves `c` on a thread of its own: waits for its directory to be set up until the
    /// timeout and answers the adjustment, leaving the mount under way (see [`Self::mounting`]).
    /// Past the timeout the create is answered with an error and what the thread still makes
    /// is torn down; a panic on it is an error, and what it left is torn down too.
    /// `served_line` is logged once the mount answers.
    fn serve_in_time(
        &self,
        dir: Dir,
        c: &Container,
        served: Served,
        served_line: String,
    ) -> Result<Adjustment, String> {
        let (prepared, mounted) = (Handoff::new(), Handoff::new());
        let (serving, id) = (self.serving.clone(), c.id.clone());
        let (c, told_prepared, told_mounted) = (c.clone(), prepared.clone(), mounted.clone());
        let teardowns = self.teardowns.lock().clone();
        let spawned = std::thread::Builder::new().name("nri-create".into()).spawn(move || {
            let set_up = catch_unwind(AssertUnwindSafe(|| serving.prepare(&dir, &c, served)))
                .unwrap_or_else(|_| panicked(&serving, &dir, &c.id));
            let (hold, request, sources) = match set_up {
                Ok(set_up) => set_up,
                Err(e) => {
                    told_prepared.give(Err(e));
                    return;
                }
            };
            // The keeper starts while the record is read here: the two overlap, and the create is
            // answered once the record is (issue 32's benchmark: about a millisecond).
            let mounting = {
                let (serving, id) = (serving.clone(), c.id.clone());
                std::thread::Builder::new().name("nri-mount".into()).spawn(move || {
                    let dir = serving.node.container(&id)?;
                    catch_unwind(AssertUnwindSafe(|| serving.mount(&dir, &id, request)))
                        .unwrap_or_else(|_| panicked(&serving, &dir, &id))
                })
            };
            let recorded = match mounting {
                Ok(_) => catch_unwind(AssertUnwindSafe(|| serving.adjustment(&dir, &sources)))
                    .unwrap_or_else(|_| Err("the plugin failed (a panic; see the node daemon's log)".to_owned())),
                Err(ref e) => Err(format!("cannot start a thread: {e}")),
            };
            let join = |mounting: std::io::Result<std::thread::JoinHandle<Result<(), String>>>| match mounting {
                Ok(thread) => thread.join().unwrap_or_else(|_| Err("the plugin failed (a panic)".to_owned())),
                Err(_) => Err("not mounted".to_owned()),
            };
            let adjustment = match recorded {
                Ok(adjustment) => adjustment,
                Err(e) => {
                    // Refused with nothing left of it, as when nothing was mounted yet.
                    let _ = join(mounting);
                    drop(hold);
                    discard(&serving.node, &dir, &c.id);
                    told_prepared.give(Err(e));
                    return;
                }
            };
            // Answered now, the mount still under way; `Some`: no one waits any more (the create
            // was answered with an error past the timeout).
            let refused = told_prepared.give(Ok(adjustment)).is_some();
            let mounted = join(mounting);
            drop(hold);
            if refused {
                discard(&serving.node, &dir, &c.id);
                info!("container {}: set up after its create was answered with an error; removed", c.id);
                return;
            }
            if mounted.is_ok() {
                info!("{served_line}");
            }
            if let Some(Ok(())) = told_mounted.give(mounted) {
                let _ = teardowns.send((c.id.clone(), "served after PostCreateContainer gave up on it"));
            }
        });
        spawned.map_err(|e| format!("cannot start a thread: {e}"))?;
        match prepared.wait(Some(Instant::now() + self.timeout)) {
            Some(Ok(adjustment)) => {
                self.mounting.lock().insert(id, mounted);
                Ok(adjustment)
            }
            Some(Err(e)) => Err(e),
            None => {
                warn!(
                    "container {id}: not served within {:?}; whatever is made of it later is torn down",
                    self.timeout
                );
                Err(format!(
                    "not served within --nri-timeout ({:?}; containerd's plugin_request_timeout is 2 s by default): the state dir's lock is held long; the kubelet tries again",
                    self.timeout
                ))
            }
        }
    }

    /// The outcome of container `c`'s mount that `create` left under way, waited for until the
    /// timeout (see [`Handler::post_create`]).
    pub(super) fn mounted(&self, c: &Container) -> Result<(), String> {
        let Some(mounting) = self.mounting.lock().remove(&c.id) else { return Ok(()) };
        match mounting.wait(Some(Instant::now() + self.timeout)) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(format!("its /dev is not served: {e}; its directory is removed, so its start fails")),
            None => Err(format!(
                "its /dev did not answer within {:?} of its creation; it is torn down once it does, and its start fails",
                self.timeout
            )),
        }
    }
}

impl Serving {
    /// Sets up `c`'s directory: its spec, record and marks. The lock on the directory (held
    /// until its mount is done: no node daemon's teardown takes it for a leftover meanwhile),
    /// the request that mounts it, and the adjustment; nothing is left on error.
    fn prepare(&self, dir: &Dir, c: &Container, served: Served) -> Result<(Lock, MountRequest, Sources), String> {
        let text = |e: &dyn std::fmt::Display| e.to_string();
        let claiming = dir.lock_state_dir().map_err(|e| text(&e))?;
        if dir.exists() {
            if self.node.registry.lock().keeper(&c.id).is_ok() {
                return Err("already served (containerd created the id twice?)".into());
            }
            dir.teardown(&Host).map_err(|e| format!("a leftover of an earlier plugin: {e}"))?;
        }
        let mine = dir.prepare(None).map_err(|e| text(&e))?;
        drop(claiming);
        match self.write(dir, c, served) {
            Ok((request, sources)) => Ok((mine, request, sources)),
            Err(e) => {
                drop(mine);
                remove_half_made(dir, &c.id);
                Err(e)
            }
        }
    }

    /// The container's files (its spec, a restore's record, the marks) and what its keeper is
    /// started with; the inputs its record is read from.
    fn write(&self, dir: &Dir, c: &Container, served: Served) -> Result<(MountRequest, Sources), String> {
        let text = |e: &dyn std::fmt::Display| e.to_string();
        let spec = dir.write_bundle(&format!("{:#}\n", served.spec)).map_err(|e| text(&e))?;
        let metadata = served
            .restored
            .map(|record| dir.keep_metadata_bytes(RECORD_FILE.as_ref(), record.as_bytes()))
            .transpose()
            .map_err(|e| text(&e))?;
        let sources = Sources {
            metadata: metadata.clone(),
            spec: Some(spec.clone()),
            host_dev: self.config.host_dev.clone(),
            host_root: self.config.host_root.clone(),
            ..Sources::default()
        };
        dir.mark_node().map_err(|e| text(&e))?;
        dir.mark_nri().map_err(|e| text(&e))?;
        let request = MountRequest {
            id: c.id.clone(),
            state_dir: self.node.state_dir.clone(),
            spec,
            host_dev: self.config.host_dev.clone(),
            host_root: self.config.host_root.clone(),
            metadata,
            extra: [self.config.daemon_args(), served.request.daemon_args()].concat(),
            // Not used: the mount lasts until the container's end is heard of.
            container_pid_file: dir.default_container_pid_file(),
            owner_pid: 0,
            until_unmount: true,
        };
        Ok((request, sources))
    }

    /// The adjustment: the container's `/dev` and its record (the GPUs it has, read from
    /// `sources`), which travels with it as an annotation.
    fn adjustment(&self, dir: &Dir, sources: &Sources) -> Result<Adjustment, String> {
        // What the pairing of a restored container's record with its devices refuses came from the
        // annotation, the one input its launcher gave: the error names it.
        let record = crate::recorded(sources).map_err(|e| match &sources.metadata {
            Some(_) => format!("annotation {GPUS} (the record it was created with): {e}"),
            None => e.to_string(),
        })?;
        Ok(decide::adjustment(&dir.dev().to_string_lossy(), &record.to_string()))
    }

    fn mount(&self, dir: &Dir, id: &str, request: MountRequest) -> Result<(), String> {
        let mounted = self.node.mount(request, None).map(|_| ());
        #[cfg(feature = "test-hooks")]
        failpoint_panic(id);
        mounted.inspect_err(|_| remove_half_made(dir, id))
    }
}

fn remove_half_made(dir: &Dir, id: &str) {
    if let Err(e) = dir.teardown(&Host) {
        warn!("container {id}: cannot remove its half-made directory: {e}");
    }
}

/// The test hook `DEVREMAPD_FAILPOINT=nri-create-panic:ID`: the create of container ID
/// panics once its keeper serves it, the worst moment for what is left.
#[cfg(feature = "test-hooks")]
fn failpoint_panic(id: &str) {
    if std::env::var("DEVREMAPD_FAILPOINT").ok().and_then(|f| f.strip_prefix("nri-create-panic:").map(str::to_owned))
        == Some(id.to_owned())
    {
        panic!("failpoint nri-create-panic:{id}");
    }
}

/// Tears down NRI container `id` of `node`, if it is one: its keeper stopped, its directory removed.
fn tear_down(node: &Node, id: &str, why: &str) {
    let Ok(dir) = node.container(id) else { return };
    if !dir.is_nri() {
        return;
    }
    match remove(node, &dir, id, true) {
        Ok(Some(what)) => info!("container {id}: {why}; its {what}"),
        Ok(None) => info!("container {id}: {why}; a create of the id is setting it up: left to it"),
        Err(e) => warn!("container {id}: {why}; cannot tear down: {e}"),
    }
}

/// Removes what a create that panicked or was given up on made of container `id` (its keeper
/// and mount, its directory), whatever marks it has by then. Called by the create itself, which
/// may hold the directory's lock: unlike [`tear_down`], it does not leave a busy directory.
fn discard(node: &Node, dir: &Dir, id: &str) {
    if let Err(e) = remove(node, dir, id, false) {
        warn!("container {id}: cannot remove its half-made directory: {e}");
    }
}

/// Stops container `id`'s keeper if one serves it, or else removes what is left of its
/// directory (a keeper that died leaves its mount dead), and says which; with `leave_busy`,
/// not a directory a create of the id holds while it sets it up (an event of an earlier one):
/// then `None`.
fn remove(node: &Node, dir: &Dir, id: &str, leave_busy: bool) -> Result<Option<&'static str>, String> {
    if node.unmount(id).is_ok() {
        return Ok(Some("/dev is unmounted"));
    }
    let torn = dir.lock_state_dir().and_then(|_lock| match leave_busy && dir.is_busy()? {
        true => Ok(None),
        false => dir.teardown(&Host).map(|()| Some("directory is removed")),
    });
    torn.map_err(|e| e.to_string())
}

/// When process `pid` started (`/proc/<pid>/stat`'s 22nd field, clock ticks since boot), if
/// it runs.
fn start_time(pid: u32) -> Option<u64> {
    devremap::procfs::Stat::of(&pid.to_string())?.number(22)
}

/// Whether the init recorded for `dir`'s container still runs.
fn init_runs(dir: &Dir) -> Option<u32> {
    let (pid, start) = dir.nri_init()?;
    (start_time(pid) == Some(start)).then_some(pid)
}

impl Handler for NriHandler {
    fn create(&self, pod: &Pod, c: &Container) -> Result<Adjustment, String> {
        let named = |what: &dyn std::fmt::Display| format!("devremap: container {} ({}): {what}", c.name, c.id);
        let dir = self.node().container(&c.id).map_err(|e| named(&e))?;
        let dev = dir.dev();
        let dev = dev.to_str().ok_or_else(|| named(&"the state dir is not a UTF-8 path"))?;
        let served = match decide::decide(pod, c, &self.serving.config.annotations, dev).map_err(|e| named(&e))? {
            Decision::Untouched(why) => {
                if let Some(why) = why {
                    warn!("{}", named(&why));
                }
                return Ok(Adjustment::default());
            }
            Decision::Serve(served) => *served,
        };
        for warning in &served.warnings {
            warn!("{}", named(warning));
        }
        let served_line = format!(
            "container {} ({}) of pod {}/{}: {} /dev served{}",
            c.name,
            c.id,
            pod.namespace,
            pod.name,
            dir.dev().display(),
            if served.restored.is_some() { ", restored from its record" } else { "" }
        );
        self.serve_in_time(dir, c, served, served_line).map_err(|e| named(&e))
    }

    /// Waits (until the timeout) for the container's mount that `create` left under way: once
    /// this is answered containerd's CreateContainer returns, and a start may follow.
    /// containerd only logs a plugin's error here: what went wrong is the daemon's log's.
    fn post_create(&self, _pod: &Pod, c: &Container) {
        if let Err(e) = self.mounted(c) {
            warn!("container {} ({}): {e}", c.name, c.id);
        }
    }

    /// Records the container's init in its NRI mark, so that a container containerd leaves out
    /// of `Synchronize` while it runs is not taken for gone.
    fn started(&self, _pod: &Pod, c: &Container) {
        let Ok(dir) = self.node().container(&c.id) else { return };
        if c.pid == 0 || !dir.is_nri() {
            return;
        }
        let Some(start) = start_time(c.pid) else { return };
        if let Err(e) = dir.mark_nri_init(c.pid, start) {
            warn!("container {} ({}): cannot record its init (pid {}): {e}", c.name, c.id, c.pid);
        }
    }

    fn stopped(&self, _pod: &Pod, c: &Container) {
        self.end(&c.id, "stopped");
    }

    fn removed(&self, _pod: &Pod, c: &Container) {
        self.end(&c.id, "removed");
    }

    fn synchronize(&self, _pods: &[Pod], containers: &[Container]) {
        let live: HashSet<&str> =
            containers.iter().filter(|c| c.state != State::Stopped).map(|c| c.id.as_str()).collect();
        let Ok(entries) = std::fs::read_dir(&self.node().state_dir) else { return };
        for id in entries.flatten().filter_map(|e| e.file_name().into_string().ok()) {
            let Ok(dir) = self.node().container(&id) else { continue };
            if live.contains(id.as_str()) || !dir.is_nri() {
                continue;
            }
            // containerd 1.7 lists no container it marked unknown (its shim did not answer in
            // time after containerd's restart), though it runs.
            match init_runs(&dir) {
                Some(pid) => warn!(
                    "container {id}: not listed by containerd at NRI Synchronize, but its init (pid {pid}) runs: its /dev is kept"
                ),
                None => self.end(&id, "not running in containerd (heard at NRI Synchronize)"),
            }
        }
        // A container we served whose keeper died: its /dev answers ENOTCONN, and no mount can
        // be put back into a running container's /dev.
        for c in containers.iter().filter(|c| live.contains(c.id.as_str()) && c.annotations.contains_key(GPUS)) {
            let Ok(dir) = self.node().container(&c.id) else { continue };
            if dir.is_nri() && self.node().registry.lock().keeper(&c.id).is_err() {
                warn!(
                    "container {} ({}): no keeper serves its /dev (it answers ENOTCONN); restart the container",
                    c.name, c.id
                );
            }
        }
    }
}
