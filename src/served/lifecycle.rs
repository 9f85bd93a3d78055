//! The server's life as a state machine: starting (or taking over from another server),
//! serving, reloading, stopping. (Handing over between servers is the keeper's, in
//! [`crate::keeper::relay`].)
//!
//! [`Lifecycle`] decides what happens; it does no I/O of its own. What it needs from the world
//! goes through two small traits: [`Notifier`] (tell the kernel to drop what it cached of names
//! and directories: through the keeper, in the server) and [`Session`] (the server around the
//! FUSE session: load the inputs on a worker, publish the state file, tell the service
//! manager). So the rules of the daemon's life are unit-tested here, without root or a
//! mount:
//!
//! - any number of reload requests (`SIGHUP`s) in one batch make one reload, and those that
//!   arrive while a reload is in flight make exactly one more after it;
//! - a stop wins over a reload in the same batch and never waits for one in flight;
//! - a reload whose inputs have not loaded by its deadline is abandoned, its late result
//!   dropped, and while [`MAX_STUCK_RELOADS`] abandoned reloads are still blocked no new one
//!   starts (each holds a thread until its input answers);
//! - a refused reload keeps the served tree and records the error; a good one swaps the tree,
//!   invalidates exactly the changed names, and clears the error; each ends with "ready".
//!
//! Assumptions: events are handled by one thread (the daemon's main loop), in batches of what
//! was queued together; a load's result carries the id of the reload that asked for it.

use crate::decision::render;
use crate::decision::tree::{self, Diff};
use crate::inputs::load::{LoadError, Loaded};
use crate::served::devfs::{Change, Devfs};
use crate::served::takeover::Resumed;
use log::{info, warn};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Abandoned reloads still blocked on their inputs beyond which no new reload is started.
pub const MAX_STUCK_RELOADS: usize = 4;

/// What the daemon's main loop feeds the machine.
#[derive(Debug)]
pub enum Event {
    /// Reload the inputs (`SIGHUP`).
    Reload,
    /// Stop serving; the text names the cause for the log (`the keeper stops the mount`).
    Stop(String),
    /// A reload's inputs, loaded (or refused) by its worker.
    Loaded(u64, Box<Result<Loaded, LoadError>>),
    /// A retired node was let go: the published count is stale.
    Retired,
    /// The FUSE session ended: someone unmounted it, or aborted the connection.
    Ended(io::Result<()>),
    /// Something outside the machine failed (an upgrade the keeper refused): the served tree
    /// stays, and the text is recorded as the last error.
    Refused(String),
}

/// Why serving ended.
#[derive(Debug)]
pub enum End {
    /// A stop was asked for: the caller unmounts.
    Stop,
    /// The session ended under us, with its result.
    Ended(io::Result<()>),
}

/// Where the daemon is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Mounted, not yet declared ready.
    Starting,
    /// Ready, no reload in flight.
    Serving,
    /// Ready, a reload's inputs are loading.
    Reloading,
    /// Asked to stop, or the session ended: nothing more is handled.
    Stopping,
}

/// What the service manager is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Notice {
    Ready,
    Reloading,
    Stopping,
}

/// The kernel's side of the mount: drop cached entries and listings.
pub trait Notifier {
    /// Forgets each entry `(parent, name)`, then what is cached of each node id in `inodes` (a
    /// directory's listing), and returns once the kernel has. Returns the names the kernel
    /// refused for a reason other than "nothing was cached there", with the error. All at once,
    /// so that an implementation can send them together (the server's go through the keeper).
    fn invalidate(&self, entries: &[(u64, String)], inodes: &[u64]) -> Vec<(String, io::Error)>;
}

/// Why the daemon's state could not be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("{}: cannot write the state file: {}", path.display(), crate::io_message(source))]
    StateFile { path: PathBuf, source: io::Error },
}

/// The daemon around the FUSE session: everything a transition does outside the machine.
pub trait Session {
    /// Starts loading the inputs on a worker, whose result comes back as `Event::Loaded(id, ..)`.
    fn load(&mut self, id: u64) -> io::Result<()>;
    /// Publishes the daemon's state (the state file); the error is one line for the log.
    fn publish(&mut self, status: &Status<'_>) -> Result<(), PublishError>;
    /// Tells the service manager.
    fn notify(&mut self, notice: Notice);
}

/// What [`Session::publish`] publishes.
#[derive(Debug)]
pub struct Status<'a> {
    pub loaded: &'a Loaded,
    pub generation: u64,
    pub last_error: Option<&'a str>,
    /// Reloads this server has finished (applied, refused or abandoned): a reload whose error
    /// is the one before still shows as done.
    pub reloads: u64,
    pub retired_nodes: usize,
}

/// A reload whose inputs are loading.
#[derive(Debug)]
struct InFlight {
    id: u64,
    started: Instant,
}

/// The daemon's life: the served [`Devfs`], the inputs it was built from, and the reload state.
pub struct Lifecycle<N, S> {
    devfs: Arc<Devfs>,
    notifier: N,
    session: S,
    current: Loaded,
    last_error: Option<String>,
    state: State,
    reload_timeout: Duration,
    reloading: Option<InFlight>,
    /// Reload requests arrived during a reload: one more reload follows it.
    reload_again: bool,
    next_reload: u64,
    /// Abandoned reloads whose worker has not returned yet.
    stuck: usize,
    /// Reloads finished (applied, refused or abandoned), published as `reloads`.
    finished: u64,
}

impl<N: Notifier, S: Session> Lifecycle<N, S> {
    /// A daemon serving `devfs`, built from `current`, not yet ready.
    pub fn new(devfs: Arc<Devfs>, current: Loaded, reload_timeout: Duration, notifier: N, session: S) -> Self {
        Lifecycle {
            devfs,
            notifier,
            session,
            current,
            last_error: None,
            state: State::Starting,
            reload_timeout,
            reloading: None,
            reload_again: false,
            next_reload: 1,
            stuck: 0,
            finished: 0,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// The inputs the served tree was built from.
    pub fn current(&self) -> &Loaded {
        &self.current
    }

    pub fn session(&mut self) -> &mut S {
        &mut self.session
    }

    /// Declares the daemon ready: publishes its state, then tells the service manager. A state
    /// that cannot be published fails the start (the caller unmounts).
    pub fn ready(&mut self) -> Result<(), PublishError> {
        self.publish()?;
        self.state = State::Serving;
        self.session.notify(Notice::Ready);
        Ok(())
    }

    /// Declares ready a server that took over from another: the daemon was ready long before,
    /// so a state file that cannot be written is logged and serving goes on, as after a reload.
    pub fn ready_after_takeover(&mut self) {
        self.update_state();
        self.state = State::Serving;
        self.session.notify(Notice::Ready);
    }

    /// When the reload in flight is abandoned, if one is.
    pub fn deadline(&self) -> Option<Instant> {
        self.reloading.as_ref().map(|r| r.started + self.reload_timeout)
    }

    /// Handles events until the daemon must stop: each wait takes what was queued with the
    /// first event as one batch, and a reload in flight is abandoned at its deadline.
    pub fn serve(&mut self, rx: &Receiver<Event>) -> End {
        loop {
            let first = match wait(rx, self.deadline()) {
                Waited::Event(event) => event,
                Waited::Deadline => {
                    self.expire();
                    continue;
                }
                Waited::Closed => return self.stop(),
            };
            if let Some(end) = self.handle(std::iter::once(first).chain(rx.try_iter())) {
                return end;
            }
        }
    }

    /// Handles one batch of events: any number of reload requests make one reload, and a stop
    /// or the session's end wins over everything after it. Returns how serving ended, if it did.
    pub fn handle(&mut self, batch: impl IntoIterator<Item = Event>) -> Option<End> {
        let (mut reload, mut retired) = (false, false);
        for event in batch {
            match event {
                Event::Ended(result) => {
                    self.state = State::Stopping;
                    return Some(End::Ended(result));
                }
                Event::Stop(why) => {
                    info!("{why}: stopping");
                    self.session.notify(Notice::Stopping);
                    return Some(self.stop());
                }
                Event::Reload => reload = true,
                Event::Loaded(id, result) => self.loaded(id, *result),
                Event::Retired => retired = true,
                Event::Refused(e) => self.refused("", e),
            }
        }
        self.reload_again |= reload;
        if self.reloading.is_none() && std::mem::take(&mut self.reload_again) {
            self.start_reload();
        } else if retired {
            self.update_state();
        }
        None
    }

    /// The reload in flight did not load by its deadline: the served tree stays, and its
    /// worker is left to finish (or not) on its own.
    pub fn expire(&mut self) {
        if self.reloading.take().is_none() {
            return;
        }
        self.state = State::Serving;
        self.stuck += 1;
        self.finished += 1;
        let e = format!(
            "reload abandoned: the inputs did not load within {} s (an input on a stuck filesystem?)",
            self.reload_timeout.as_secs()
        );
        self.refused("", e);
        self.session.notify(Notice::Ready);
    }

    fn stop(&mut self) -> End {
        self.state = State::Stopping;
        End::Stop
    }

    fn generation(&self) -> u64 {
        self.devfs.snapshot().generation
    }

    /// Logs a reload that was refused, abandoned or not started (`<log_prefix><e>; still
    /// serving generation G`), records `e` as the last error, and publishes it.
    fn refused(&mut self, log_prefix: &str, e: String) {
        warn!("{log_prefix}{e}; still serving generation {}", self.generation());
        self.last_error = Some(e);
        self.update_state();
    }

    /// Starts loading the inputs; the result comes back as an event.
    fn start_reload(&mut self) {
        if self.stuck >= MAX_STUCK_RELOADS {
            self.finished += 1;
            self.refused(
                "",
                format!(
                    "not reloading: {} abandoned reloads are still blocked on their inputs (a stuck filesystem?)",
                    self.stuck
                ),
            );
            return;
        }
        self.session.notify(Notice::Reloading);
        let id = self.next_reload;
        self.next_reload += 1;
        match self.session.load(id) {
            Ok(()) => {
                self.reloading = Some(InFlight { id, started: Instant::now() });
                self.state = State::Reloading;
            }
            Err(e) => {
                self.finished += 1;
                self.refused("reload refused: ", format!("cannot start a reload thread: {e}"));
                self.session.notify(Notice::Ready);
            }
        }
    }

    /// A worker's result: applied if it is the reload in flight, dropped if it was abandoned.
    fn loaded(&mut self, id: u64, result: Result<Loaded, LoadError>) {
        let Some(started) = self.reloading.as_ref().filter(|r| r.id == id).map(|r| r.started) else {
            self.stuck = self.stuck.saturating_sub(1);
            info!("an abandoned reload finished after all; its result was dropped");
            return;
        };
        self.reloading = None;
        self.state = State::Serving;
        self.finished += 1;
        match result {
            Ok(loaded) => self.swap(loaded, started),
            Err(e) => self.refused("reload refused: ", e.to_string()),
        }
        self.session.notify(Notice::Ready);
    }

    fn swap(&mut self, loaded: Loaded, started: Instant) {
        let change = self.devfs.replace(loaded.plan.tree.clone());
        self.invalidate(&change);
        info!(
            "reloaded: generation {} in {:.2} ms: {}{}",
            change.generation,
            started.elapsed().as_secs_f64() * 1e3,
            describe(&change.diff, &self.current, &loaded),
            warnings(&loaded)
        );
        self.current = loaded;
        self.last_error = None;
        self.update_state();
    }

    /// This server took over from another (a crash or an upgrade, [`Devfs::resume`]): tells
    /// the kernel what it may have cached that no longer holds, and logs the takeover.
    /// The last reload error the server before had recorded stays until a reload succeeds.
    /// `previous` is the plan the server before served, when known (an upgrade): the log line
    /// then says what changed, as a reload's does.
    pub fn resumed(&mut self, resumed: &Resumed, from: &str, last_error: Option<String>, previous: Option<&Loaded>) {
        self.last_error = last_error;
        self.invalidate(&resumed.change);
        let changed = previous.map_or(String::new(), |old| {
            format!(": {}", describe(&tree::diff(&old.plan.tree, &self.current.plan.tree), old, &self.current))
        });
        info!(
            "took over {from}: generation {}, kept {} nodes the kernel holds, retired {}{changed}{}",
            resumed.change.generation,
            resumed.kept,
            resumed.retired,
            warnings(&self.current)
        );
    }

    /// Drops what the kernel cached of every changed name, so the next lookup asks us.
    fn invalidate(&self, change: &Change) {
        for (name, e) in self.notifier.invalidate(&change.invalidate, &change.dirs) {
            warn!("invalidating {name}: {e}");
        }
    }

    fn publish(&mut self) -> Result<(), PublishError> {
        let status = Status {
            loaded: &self.current,
            generation: self.generation(),
            last_error: self.last_error.as_deref(),
            reloads: self.finished,
            retired_nodes: self.devfs.retired_count(),
        };
        self.session.publish(&status)
    }

    /// Publishes after a change; a failure is logged, and serving goes on.
    fn update_state(&mut self) {
        if let Err(e) = self.publish() {
            warn!("{e}");
        }
    }
}

/// What [`wait`] got.
#[derive(Debug)]
pub enum Waited<E> {
    Event(E),
    /// The deadline passed first.
    Deadline,
    /// Every sender is gone.
    Closed,
}

/// The next event on `rx`, waiting at most until `deadline` (for ever without one): the wait
/// of every main loop that also has a timer.
pub fn wait<E>(rx: &Receiver<E>, deadline: Option<Instant>) -> Waited<E> {
    let got = match deadline {
        Some(deadline) => rx.recv_timeout(deadline.saturating_duration_since(Instant::now())),
        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
    };
    match got {
        Ok(event) => Waited::Event(event),
        Err(RecvTimeoutError::Timeout) => Waited::Deadline,
        Err(RecvTimeoutError::Disconnected) => Waited::Closed,
    }
}

/// `; warning: ...` for each warning of a plan, for the log line that serves it.
pub fn warnings(loaded: &Loaded) -> String {
    loaded.plan.warnings.iter().map(|w| format!("; warning: {w}")).collect()
}

/// `nvidia0: 1:5 -> 1:7, nvidia1: mode 0666 -> 0600, nvidia9: added 1:8, nvidia3: removed` for
/// the reload log line.
fn describe(d: &Diff, old: &Loaded, new: &Loaded) -> String {
    let node = |l: &Loaded, p: &str| l.plan.tree.get(p).cloned();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::plan::Plan;
    use crate::decision::tree::{Node, Tree, TreeBuilder};
    use crate::device::{Access, DevKind, Rdev};
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Everything the machine did to the world, in order.
    #[derive(Debug, Default)]
    struct World {
        loads: Vec<u64>,
        published: Vec<(u64, Option<String>, usize)>,
        reloads: Vec<u64>,
        notices: Vec<Notice>,
        invalidated: Vec<(u64, String)>,
        dirs: Vec<u64>,
        fail_load: bool,
        fail_publish: bool,
    }

    #[derive(Clone, Default)]
    struct Fake(Rc<RefCell<World>>);

    impl Notifier for Fake {
        fn invalidate(&self, entries: &[(u64, String)], inodes: &[u64]) -> Vec<(String, io::Error)> {
            let mut w = self.0.borrow_mut();
            w.invalidated.extend_from_slice(entries);
            w.dirs.extend_from_slice(inodes);
            Vec::new()
        }
    }

    impl Session for Fake {
        fn load(&mut self, id: u64) -> io::Result<()> {
            let mut w = self.0.borrow_mut();
            if w.fail_load {
                return Err(io::Error::other("no threads left"));
            }
            w.loads.push(id);
            Ok(())
        }
        fn publish(&mut self, s: &Status<'_>) -> Result<(), PublishError> {
            let mut w = self.0.borrow_mut();
            if w.fail_publish {
                let source = io::Error::from_raw_os_error(libc::ENOSPC);
                return Err(PublishError::StateFile { path: "state.json".into(), source });
            }
            w.published.push((s.generation, s.last_error.map(str::to_owned), s.retired_nodes));
            w.reloads.push(s.reloads);
            Ok(())
        }
        fn notify(&mut self, notice: Notice) {
            self.0.borrow_mut().notices.push(notice);
        }
    }

    fn loaded(minor: u32) -> Loaded {
        let mut b = TreeBuilder::default();
        b.insert("null", Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
        b.insert("nvidia0", Node::device(DevKind::Char, Rdev::new(1, minor), Access::DEVICE_DEFAULT)).unwrap();
        let plan = Plan {
            remap: vec![],
            restored: vec![],
            tree: b.build(),
            warnings: vec![],
            tpus: vec![],
            driver_version: None,
            checks: vec![],
            mixed_input: Default::default(),
            amd: Default::default(),
        };
        Loaded { plan, metadata: None }
    }

    fn tree(l: &Loaded) -> Tree {
        l.plan.tree.clone()
    }

    /// A ready machine serving `loaded(5)`, and the world it acts on.
    fn ready() -> (Lifecycle<Fake, Fake>, Fake, Arc<Devfs>) {
        let first = loaded(5);
        let devfs = Arc::new(Devfs::new(tree(&first)));
        let world = Fake::default();
        let mut lc = Lifecycle::new(devfs.clone(), first, Duration::from_secs(10), world.clone(), world.clone());
        assert_eq!(lc.state(), State::Starting);
        lc.ready().unwrap();
        (lc, world, devfs)
    }

    fn ok(l: Loaded) -> Box<Result<Loaded, LoadError>> {
        Box::new(Ok(l))
    }

    fn refused() -> Box<Result<Loaded, LoadError>> {
        Box::new(Err(LoadError::Prefer("p".into(), "both".into())))
    }

    /// Rule: the daemon is ready only once its state is published, and says so after.
    #[test]
    fn ready_publishes_then_notifies() {
        let (lc, world, _) = ready();
        assert_eq!(lc.state(), State::Serving);
        let w = world.0.borrow();
        assert_eq!(w.published, [(1, None, 0)]);
        assert_eq!(w.notices, [Notice::Ready]);
    }

    /// Rule: a state that cannot be published fails the start; nothing is declared ready.
    #[test]
    fn unpublishable_state_fails_the_start() {
        let first = loaded(5);
        let devfs = Arc::new(Devfs::new(tree(&first)));
        let world = Fake::default();
        world.0.borrow_mut().fail_publish = true;
        let mut lc = Lifecycle::new(devfs, first, Duration::from_secs(10), world.clone(), world.clone());
        assert_eq!(
            lc.ready().unwrap_err().to_string(),
            "state.json: cannot write the state file: no space left on device"
        );
        assert_eq!(lc.state(), State::Starting);
        assert!(world.0.borrow().notices.is_empty());
    }

    /// Bug (found from outside, issue 13): a server that took over after a crash died when its
    /// state file could not be written (a full `/run`), and so did every successor. Now, the
    /// daemon having been ready long before, it is logged and the server serves on.
    #[test]
    fn unpublishable_state_does_not_stop_a_server_that_took_over() {
        let first = loaded(5);
        let devfs = Arc::new(Devfs::new(tree(&first)));
        let world = Fake::default();
        world.0.borrow_mut().fail_publish = true;
        let mut lc = Lifecycle::new(devfs, first, Duration::from_secs(10), world.clone(), world.clone());
        lc.ready_after_takeover();
        assert_eq!(lc.state(), State::Serving);
        assert_eq!(world.0.borrow().notices, [Notice::Ready]);
    }

    /// Rule: any number of reload requests in one batch make one reload; those arriving while
    /// it is in flight make exactly one more, started when it ends.
    #[test]
    fn reload_requests_coalesce() {
        let (mut lc, world, _) = ready();
        assert!(lc.handle([Event::Reload, Event::Reload, Event::Reload]).is_none());
        assert_eq!(lc.state(), State::Reloading);
        assert_eq!(world.0.borrow().loads, [1]);
        lc.handle([Event::Reload]);
        lc.handle([Event::Reload, Event::Reload]);
        assert_eq!(world.0.borrow().loads, [1], "no second load while one is in flight");
        lc.handle([Event::Loaded(1, ok(loaded(5)))]);
        assert_eq!(world.0.borrow().loads, [1, 2], "one more for all the requests during the first");
        lc.handle([Event::Loaded(2, ok(loaded(5)))]);
        assert_eq!(world.0.borrow().loads, [1, 2]);
        assert_eq!(lc.state(), State::Serving);
        let w = world.0.borrow();
        assert_eq!(
            w.notices,
            [Notice::Ready, Notice::Reloading, Notice::Ready, Notice::Reloading, Notice::Ready],
            "each reload is bracketed by reloading and ready"
        );
    }

    /// Rule: a stop wins over a reload in the same batch, and does not wait for one in flight.
    #[test]
    fn stop_wins_over_reload() {
        let (mut lc, world, _) = ready();
        assert!(matches!(lc.handle([Event::Reload, Event::Stop("signal SIGTERM".into())]), Some(End::Stop)));
        assert!(world.0.borrow().loads.is_empty());
        assert_eq!(lc.state(), State::Stopping);

        let (mut lc, world, _) = ready();
        lc.handle([Event::Reload]);
        assert!(matches!(lc.handle([Event::Stop("signal SIGINT".into())]), Some(End::Stop)));
        assert_eq!(world.0.borrow().notices.last(), Some(&Notice::Stopping));
    }

    /// Rule: the session ending under the daemon ends serving, with the session's result.
    #[test]
    fn session_end_ends_serving() {
        let (mut lc, _, _) = ready();
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        match lc.handle([Event::Reload, Event::Ended(Err(aborted))]) {
            Some(End::Ended(Err(e))) => assert_eq!(e.raw_os_error(), Some(libc::ECONNABORTED)),
            other => panic!("{other:?}"),
        }
        assert_eq!(lc.state(), State::Stopping);
    }

    /// Rule: a good reload swaps the tree, invalidates exactly the changed name, and publishes
    /// the new generation with no error.
    #[test]
    fn good_reload_swaps_and_invalidates() {
        let (mut lc, world, devfs) = ready();
        lc.handle([Event::Reload]);
        lc.handle([Event::Loaded(1, ok(loaded(7)))]);
        assert_eq!(devfs.snapshot().generation, 2);
        let w = world.0.borrow();
        assert_eq!(w.invalidated, [(1, "nvidia0".to_owned())]);
        assert_eq!(w.dirs, [1], "the root's listing names a new node id");
        assert_eq!(w.published.last(), Some(&(2, None, 0)));
        assert_eq!(lc.current().plan.tree.get("nvidia0"), loaded(7).plan.tree.get("nvidia0"));
    }

    /// Rule: a refused reload keeps the served tree, records the error, and still ends with
    /// ready; the next good reload clears the error.
    #[test]
    fn refused_reload_keeps_the_tree() {
        let (mut lc, world, devfs) = ready();
        lc.handle([Event::Reload]);
        lc.handle([Event::Loaded(1, refused())]);
        assert_eq!(devfs.snapshot().generation, 1);
        assert_eq!(lc.state(), State::Serving);
        {
            let w = world.0.borrow();
            let (generation, error, _) = w.published.last().unwrap();
            assert_eq!(*generation, 1);
            assert_eq!(
                error.as_deref(),
                Some("p: expected `native` or `checkpoint`, found \"both\""),
                "the error as loaded, without the log line's words"
            );
            assert!(w.invalidated.is_empty());
            assert_eq!(w.notices.last(), Some(&Notice::Ready));
        }
        lc.handle([Event::Reload]);
        lc.handle([Event::Loaded(2, ok(loaded(5)))]);
        assert_eq!(world.0.borrow().published.last(), Some(&(2, None, 0)));
    }

    /// Bug (issue 18, CI): a reload refused with the error of the one before published the same
    /// state, so whoever sent the SIGHUP (a test, a health check) could not tell it was done.
    /// Every reload that ends, applied, refused or abandoned, counts in `reloads`.
    #[test]
    fn every_finished_reload_counts_even_with_the_same_error() {
        let (mut lc, world, _) = ready();
        for id in 1..=2 {
            lc.handle([Event::Reload]);
            lc.handle([Event::Loaded(id, refused())]);
        }
        lc.handle([Event::Reload]);
        lc.expire();
        lc.handle([Event::Reload]);
        lc.handle([Event::Loaded(4, ok(loaded(7)))]);
        let w = world.0.borrow();
        assert_eq!(w.published[1].1, w.published[2].1, "the same error twice");
        assert_eq!(w.reloads, [0, 1, 2, 3, 4]);
    }

    /// Rule: a reload past its deadline is abandoned (the tree stays, the error says why), and
    /// its late result is dropped, never applied over a newer state.
    #[test]
    fn abandoned_reload_result_is_dropped() {
        let (mut lc, world, devfs) = ready();
        lc.handle([Event::Reload]);
        assert!(lc.deadline().is_some());
        lc.expire();
        assert_eq!(lc.deadline(), None);
        assert_eq!(lc.state(), State::Serving);
        assert!(world.0.borrow().published.last().unwrap().1.as_deref().unwrap().starts_with("reload abandoned"));
        lc.handle([Event::Loaded(1, ok(loaded(9)))]);
        assert_eq!(devfs.snapshot().generation, 1, "the late result is not served");
        assert_eq!(devfs.snapshot().tree.get("nvidia0"), loaded(5).plan.tree.get("nvidia0"));
    }

    /// Rule: while four abandoned reloads are still blocked, no fifth starts; one that comes
    /// back frees a place.
    #[test]
    fn stuck_reloads_hold_off_new_ones() {
        let (mut lc, world, _) = ready();
        for _ in 0..MAX_STUCK_RELOADS {
            lc.handle([Event::Reload]);
            lc.expire();
        }
        assert_eq!(world.0.borrow().loads, [1, 2, 3, 4]);
        lc.handle([Event::Reload]);
        assert_eq!(world.0.borrow().loads.len(), 4);
        assert!(world.0.borrow().published.last().unwrap().1.as_deref().unwrap().starts_with("not reloading: 4"));
        lc.handle([Event::Loaded(2, refused())]);
        lc.handle([Event::Reload]);
        assert_eq!(world.0.borrow().loads, [1, 2, 3, 4, 5]);
    }

    /// Rule: a reload that cannot start is a refused reload: recorded, and ready again.
    #[test]
    fn reload_that_cannot_start_is_refused() {
        let (mut lc, world, _) = ready();
        world.0.borrow_mut().fail_load = true;
        lc.handle([Event::Reload]);
        assert_eq!(lc.state(), State::Serving);
        let w = world.0.borrow();
        assert!(w.published.last().unwrap().1.as_deref().unwrap().contains("no threads left"));
        assert_eq!(w.notices, [Notice::Ready, Notice::Reloading, Notice::Ready]);
    }

    /// Rule: a retired node let go republishes the state (its count changed); a failed
    /// publication is logged and serving goes on.
    #[test]
    fn retired_republishes() {
        let (mut lc, world, _) = ready();
        lc.handle([Event::Retired, Event::Retired]);
        assert_eq!(world.0.borrow().published.len(), 2, "one publication per batch");
        world.0.borrow_mut().fail_publish = true;
        assert!(lc.handle([Event::Retired]).is_none());
        assert_eq!(lc.state(), State::Serving);
    }

    /// Rule: `serve` takes what was queued together as one batch, and ends when no event can
    /// come any more.
    #[test]
    fn serve_batches_and_ends() {
        let (mut lc, world, _) = ready();
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..3 {
            tx.send(Event::Reload).unwrap();
        }
        drop(tx);
        assert!(matches!(lc.serve(&rx), End::Stop));
        assert_eq!(world.0.borrow().loads, [1]);
        assert_eq!(lc.state(), State::Stopping);
    }
}
