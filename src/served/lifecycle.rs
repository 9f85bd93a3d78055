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
//! - a reload asked for that did not happen (abandoned, or not started while reloads were
//!   stuck) is made once, anew, when an abandoned reload's input answers after all: the user's
//!   `SIGHUP` is not lost to a filesystem that hung for a while (its late result itself is
//!   still dropped: it may have read its inputs before a newer change);
//! - a refused reload keeps the served tree and records the error; a good one swaps the tree,
//!   invalidates exactly the changed names, and clears the error; each ends with "ready".
//!
//! Assumptions: events are handled by one thread (the daemon's main loop), in batches of what
//! was queued together; a load's result carries the id of the reload that asked for it.

mod edges;
mod log_lines;
#[cfg(test)]
mod tests;
mod wait;

use crate::keeper::control::Notice;
pub use edges::{End, Event, Notifier, PublishError, Session, Status, Taken};
pub use log_lines::warnings;
pub use wait::{Waited, wait};

use crate::decision::tree;
use crate::inputs::load::{LoadError, Loaded};
use crate::served::devfs::{Change, Devfs};
use crate::served::takeover::Resumed;
use log::{debug, info, warn};
use log_lines::describe;
use std::sync::Arc;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// Abandoned reloads still blocked on their inputs beyond which no new reload is started.
pub const MAX_STUCK_RELOADS: usize = 4;

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

/// A reload whose inputs are loading.
#[derive(Debug)]
struct InFlight {
    id: u64,
    started: Instant,
    /// Made on its own for a reload asked for that did not happen ([`Lifecycle::owed`]): if
    /// it is abandoned in turn, none is made again for it.
    retry: bool,
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
    /// The last reload asked for did not happen (abandoned, or not started while reloads were
    /// stuck): one is made when an abandoned reload's worker returns (its input answers).
    owed: bool,
    /// Reloads finished (applied, refused or abandoned), published as `reloads`.
    finished: u64,
    /// Ending for a rest ([`Event::Rest`]).
    resting: bool,
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
            owed: false,
            finished: 0,
            resting: false,
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
        let stuck_before = self.stuck;
        for event in batch {
            match event {
                Event::Ended(result) => {
                    self.state = State::Stopping;
                    return Some(End::Ended(result));
                }
                Event::Stop(why) => {
                    // The keeper, which asked for the stop, has logged it for the user.
                    debug!("{why}: stopping");
                    self.session.notify(Notice::Stopping);
                    return Some(self.stop());
                }
                Event::Reload => reload = true,
                Event::Loaded(id, result) => self.loaded(id, *result),
                Event::Retired => retired = true,
                Event::Refused(e) => self.refused("", e),
                Event::Rest => return Some(self.rest()),
            }
        }
        self.reload_again |= reload;
        let retry = self.reloading.is_none() && self.owed && !self.reload_again && self.stuck < stuck_before;
        if self.reloading.is_none() && std::mem::take(&mut self.reload_again) {
            self.start_reload(false);
        } else if retry {
            info!("an abandoned reload's inputs answer again: reloading, as was asked");
            self.start_reload(true);
        } else if retired {
            self.update_state();
        }
        None
    }

    /// The reload in flight did not load by its deadline: the served tree stays, and its
    /// worker is left to finish (or not) on its own.
    pub fn expire(&mut self) {
        let Some(abandoned) = self.reloading.take() else { return };
        self.owed = !abandoned.retry;
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

    /// The keeper rests this server: a reload in flight is dropped with it (the keeper rests
    /// none it asked for), the state says that no server runs, and serving ends.
    fn rest(&mut self) -> End {
        self.resting = true;
        self.update_state();
        self.state = State::Stopping;
        End::Ended(Ok(()))
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

    /// Starts loading the inputs (`retry`: on its own, for a reload asked for that did not
    /// happen); the result comes back as an event.
    fn start_reload(&mut self, retry: bool) {
        // Asked for now, or made now: either way the reload owed is this one.
        self.owed = false;
        if self.stuck >= MAX_STUCK_RELOADS {
            self.owed = !retry;
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
                self.reloading = Some(InFlight { id, started: Instant::now(), retry });
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
        self.session.load_ended(id);
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
    /// `last_error` is the server before's last error, which stays until a reload succeeds,
    /// or `None` when this server loaded the inputs itself (a successful upgrade).
    /// `previous` is the plan the server before served, when known (an upgrade): the log line
    /// then says what changed, as a reload's does. The count of reloads goes on from the
    /// servers before; a takeover after a rest is said at debug level (nothing failed, and it
    /// comes whenever a resting mount is asked something).
    pub fn resumed(&mut self, resumed: &Resumed, taken: &Taken, last_error: Option<String>, previous: Option<&Loaded>) {
        self.last_error = last_error;
        self.finished = taken.reloads;
        self.invalidate(&resumed.change);
        let changed = previous.map_or(String::new(), |old| {
            format!(": {}", describe(&tree::diff(&old.plan.tree, &self.current.plan.tree), old, &self.current))
        });
        let level = if taken.woken { log::Level::Debug } else { log::Level::Info };
        log::log!(
            level,
            "took over {}: generation {}, kept {} nodes the kernel holds, retired {}{changed}{}",
            taken.from,
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
            resting: self.resting,
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
