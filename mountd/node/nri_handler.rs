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
//! plugin answers, dropping a plugin that takes over 2 s. A keeper outlives this daemon as for the wrapper's containers, and a daemon started again
//! adopts it from the state dir.
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
use devremap::runtime::container_daemon::Container as Dir;
use log::{info, warn};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};

/// The name a restored container's record is kept under, as the wrapper's checkpoint writes it.
const RECORD_FILE: &str = "devremap-gpus.json";

/// The node daemon as the NRI plugin: built by [`NriHandler::new`] and handed to the transport.
pub struct NriHandler {
    node: Arc<Node>,
    /// To the teardown thread: containers to tear down, and why (see [`tear_down`]).
    teardowns: Mutex<Sender<(String, &'static str)>>,
    /// The runtime config: `host_dev`, `host_root`, `annotations`, `relax` (its `state_dir` is
    /// the node daemon's `--state-dir`).
    config: Config,
}

impl NriHandler {
    /// The handler of `node`, with the runtime config at `config` (`--config`; `None`: the
    /// default path, whose absence gives the defaults, as for the wrapper). A config that is
    /// not root's alone, or not valid, is refused as the wrapper refuses it.
    pub(super) fn new(node: Arc<Node>, config: Option<&Path>) -> Result<NriHandler, NodeError> {
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
        let tearing = node.clone();
        std::thread::Builder::new()
            .name("nri-teardown".into())
            .spawn(move || queued.iter().for_each(|(id, why)| tear_down(&tearing, &id, why)))
            .map_err(NodeError::Thread)?;
        Ok(NriHandler { node, config, teardowns: Mutex::new(teardowns) })
    }

    /// Has NRI container `id` torn down on the teardown thread: containerd holds every NRI
    /// event of the node until a plugin answers, and drops a plugin that takes over 2 s (a
    /// GPU container created meanwhile would get no devremap), so no teardown (a keeper's stop
    /// may take long) is done on the plugin's thread.
    fn end(&self, id: &str, why: &'static str) {
        let _ = self.teardowns.lock().send((id.to_owned(), why));
    }

    /// Sets up `c`'s directory and mount; the adjustment on success, and nothing left otherwise.
    fn serve(&self, dir: &Dir, c: &Container, served: Served) -> Result<Adjustment, String> {
        let text = |e: &dyn std::fmt::Display| e.to_string();
        let claiming = dir.lock_state_dir().map_err(|e| text(&e))?;
        if dir.exists() {
            if self.node.registry.lock().keeper(&c.id).is_ok() {
                return Err("already served (containerd created the id twice?)".into());
            }
            dir.teardown(&Host).map_err(|e| format!("a leftover of an earlier plugin: {e}"))?;
        }
        // Held while it is set up: no node daemon's teardown takes it for a leftover meanwhile.
        let mine = dir.prepare(None).map_err(|e| text(&e))?;
        drop(claiming);
        let result = self.set_up(dir, c, served);
        drop(mine);
        result.inspect_err(|_| {
            if let Err(e) = dir.teardown(&Host) {
                warn!("container {}: cannot remove its half-made directory: {e}", c.id);
            }
        })
    }

    fn set_up(&self, dir: &Dir, c: &Container, served: Served) -> Result<Adjustment, String> {
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
        // What the pairing of a restored container's record with its devices refuses came from the
        // annotation, the one input its launcher gave: the error names it.
        let record = crate::recorded(&sources).map_err(|e| match &metadata {
            Some(_) => format!("annotation {GPUS} (the record it was created with): {e}"),
            None => text(&e),
        })?;
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
        self.node.mount(request, None)?;
        let dev = dir.dev();
        Ok(decide::adjustment(&dev.to_string_lossy(), &record.to_string()))
    }
}

/// Tears down NRI container `id` of `node`, if it is one: its keeper stopped, its directory removed.
fn tear_down(node: &Node, id: &str, why: &str) {
    let Ok(dir) = node.container(id) else { return };
    if !dir.is_nri() {
        return;
    }
    if node.unmount(id).is_ok() {
        info!("container {id}: {why}; its /dev is unmounted");
        return;
    }
    // No keeper serves it (one that died leaves its mount dead): what is left goes, but not a
    // directory a create of the id holds while it sets it up (an event of an earlier one).
    let torn = dir.lock_state_dir().and_then(|_lock| match dir.is_busy()? {
        true => Ok(false),
        false => dir.teardown(&Host).map(|()| true),
    });
    match torn {
        Ok(true) => info!("container {id}: {why}; its directory is removed"),
        Ok(false) => info!("container {id}: {why}; a create of the id is setting it up: left to it"),
        Err(e) => warn!("container {id}: {why}; cannot tear down: {e}"),
    }
}

/// When process `pid` started (`/proc/<pid>/stat`'s 22nd field, clock ticks since boot), if
/// it runs.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields count from its end.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the init recorded for `dir`'s container still runs.
fn init_runs(dir: &Dir) -> Option<u32> {
    let (pid, start) = dir.nri_init()?;
    (start_time(pid) == Some(start)).then_some(pid)
}

impl Handler for NriHandler {
    fn create(&self, pod: &Pod, c: &Container) -> Result<Adjustment, String> {
        let named = |what: &dyn std::fmt::Display| format!("devremap: container {} ({}): {what}", c.name, c.id);
        let dir = self.node.container(&c.id).map_err(|e| named(&e))?;
        let dev = dir.dev();
        let dev = dev.to_str().ok_or_else(|| named(&"the state dir is not a UTF-8 path"))?;
        let served = match decide::decide(pod, c, &self.config.annotations, dev).map_err(|e| named(&e))? {
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
        let restored = served.restored.is_some();
        let adjustment = self.serve(&dir, c, served).map_err(|e| named(&e))?;
        info!(
            "container {} ({}) of pod {}/{}: {} /dev served{}",
            c.name,
            c.id,
            pod.namespace,
            pod.name,
            dir.dev().display(),
            if restored { ", restored from its record" } else { "" }
        );
        Ok(adjustment)
    }

    /// Records the container's init in its NRI mark, so that a container containerd leaves out
    /// of `Synchronize` while it runs is not taken for gone.
    fn started(&self, _pod: &Pod, c: &Container) {
        let Ok(dir) = self.node.container(&c.id) else { return };
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
        let Ok(entries) = std::fs::read_dir(&self.node.state_dir) else { return };
        for id in entries.flatten().filter_map(|e| e.file_name().into_string().ok()) {
            let Ok(dir) = self.node.container(&id) else { continue };
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
            let Ok(dir) = self.node.container(&c.id) else { continue };
            if dir.is_nri() && self.node.registry.lock().keeper(&c.id).is_err() {
                warn!(
                    "container {} ({}): no keeper serves its /dev (it answers ENOTCONN); restart the container",
                    c.name, c.id
                );
            }
        }
    }
}
