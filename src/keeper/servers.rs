//! The keeper's decisions about its servers, as one state machine without I/O: events in
//! ([`Event`]: a signal, a server's message, its exit, its hang, a timer), actions out
//! ([`Action`]: start a server, probe it, let it take over, kill it, tell it something, log,
//! exit). The keeper (`mountd/keeper/`) feeds it what happens and does what it returns;
//! [`crate::keeper::relay::Relay`] decides the FUSE traffic.
//!
//! The phases ([`Phase`]) and their legal transitions, each made in one place ([`Machine::handle`]):
//!
//! - `Starting` (the first server loads, the keeper mounts, the mount answers through it):
//!   to `Serving` when it answers; a failure before that is the command's error (`Exit`), and
//!   so is a first server that hangs once mounted (a request unanswered for `--server-timeout`,
//!   or no word that the mount answers within it): nothing else would ever end the start.
//! - `Serving` (a current server takes requests; it is *ready* once it said `READY=1`): to
//!   `Upgrading` on `SIGUSR2` (ready only), to `Replacing` when it dies or hangs.
//! - `Replacing` (no current server: a successor is starting from the dead one's binary and
//!   plan, or due after a backoff): to `Serving` when the successor takes over.
//! - `Upgrading` (a ready server serves while the binary now on disk loads to take over): to
//!   `Serving` when the new server takes over, or when it is refused (the old one serves on);
//!   to `Replacing` when the old one dies (the upgrade is dropped).
//! - `Stopping` (`SIGTERM`, the container gone, the connection ended): from every phase, and
//!   final: no event starts anything any more.
//!
//! Assumptions: at most one server is current and at most one is a successor; a server that
//! took over answers every request at once, so one left unanswered for `--server-timeout` means
//! it hangs (ready or not: a successor is sent requests as soon as it takes over), unless its
//! replies wait on the keeper ([`hang`]).

use crate::keeper::control::{Control, HandoverError, Notice};
use std::time::{Duration, Instant};

/// The first wait before a server is started again after one died before it was ready.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait between two failed restarts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Servers in a row that may die in the middle of a reload before a successor stops reloading
/// on its own (the inputs may be what kills them).
pub const MAX_RELOAD_DEATHS: u32 = 2;
/// The first server's epoch.
pub const FIRST_EPOCH: u64 = 1;

/// Where the keeper is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Starting,
    Serving,
    Replacing,
    Upgrading,
    Stopping,
}

/// The binary a server is started from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// The one the last server that took over ran (the first: the keeper's own).
    Good,
    /// The file now at the path the keeper was started by (an upgrade).
    Path,
}

/// Why the keeper's life ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// Stopped (the reason was logged): unmount, stop the servers, exit 0.
    Stop,
    /// `/dev/fuse` ended: stop the servers; the connection's end decides the exit status.
    Ended,
    /// The start failed with this error: leave nothing behind, exit 1.
    StartFailed(String),
}

/// What the keeper does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start server `epoch`; `plan`: hand it the plan the current server served, if any, rather
    /// than have it load the inputs. Answered by [`Event::Spawned`] or [`Event::SpawnFailed`].
    Spawn {
        epoch: u64,
        binary: Binary,
        plan: bool,
    },
    /// The first server loaded: mount, and start relaying requests.
    Mount(u64),
    /// Write the pid file, unless it is written already.
    WritePidFile,
    Tell(u64, Control),
    /// Send `SIGHUP` to server `epoch` (a reload).
    Reload(u64),
    /// Replay the kernel's INIT to successor `epoch`.
    Probe(u64),
    /// Successor `epoch` takes over: at an upgrade the old server `retire` drains, retires and
    /// leaves first; then the relay hands it the node table (and, at an upgrade, the old plan)
    /// and the requests in flight. `from` starts the successor's log line.
    TakeOver {
        epoch: u64,
        retire: Option<u64>,
        from: String,
    },
    /// The relay counts a death for what was in flight at server `epoch`, which no longer answers.
    Lost(u64),
    Kill(u64),
    /// Tell the service manager.
    Notify(Notice),
    Info(String),
    Warn(String),
    Exit(Exit),
}

/// What happens to the keeper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// [`Action::Spawn`] started server `epoch` as `pid`; `handed_plan`: it was handed a plan.
    Spawned {
        epoch: u64,
        pid: u32,
        handed_plan: bool,
    },
    SpawnFailed {
        epoch: u64,
        why: String,
    },
    Sighup,
    Sigusr2,
    /// `SIGTERM`, `SIGINT` or the watched container gone: the reason.
    Stop(String),
    /// `/dev/fuse` ended (unmounted or aborted from outside).
    KernelEnded,
    /// Server `epoch` loaded its inputs and speaks `protocol`.
    Loaded {
        epoch: u64,
        protocol: u32,
    },
    /// Server `epoch` failed to load (its error line); it exits next.
    Failed {
        epoch: u64,
        why: String,
    },
    /// The mount answers through server `epoch`.
    Answering(u64),
    Notice(u64, Notice),
    /// Successor `epoch` answered the INIT replay, alike (`same`) or not.
    Probed {
        epoch: u64,
        same: bool,
    },
    /// Server `epoch` exited, with this status.
    Gone {
        epoch: u64,
        status: String,
    },
    /// Server `epoch` sent more than the keeper keeps (`why`, what it sent: a plan over
    /// [`crate::keeper::control::MAX_PLAN`]).
    Overrun {
        epoch: u64,
        why: HandoverError,
    },
    /// Server `epoch` has left a request unanswered since `since` ([`hang`] said so).
    Hung {
        epoch: u64,
        since: Instant,
    },
    /// The keeper itself did not run for a while past a deadline (stopped, starved of CPU): a
    /// successor gets a new `--reload-timeout`, since what it said meanwhile waits unread.
    Away,
    /// A deadline ([`Machine::deadline`]) passed.
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Server {
    epoch: u64,
    pid: u32,
    /// It said `READY=1`.
    ready: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Successor {
    server: Server,
    /// When it is given up on, if it has not taken over.
    deadline: Instant,
    /// Why it failed, when it said so before exiting.
    failed: Option<String>,
    handed_plan: bool,
}

#[derive(Debug)]
enum State {
    Starting {
        first: Server,
        /// Mounted, and the first server must say the mount answers through it by then.
        mounted: Option<Instant>,
        error: Option<String>,
    },
    Serving {
        current: Server,
    },
    Replacing {
        successor: Option<Successor>,
        retry_at: Option<Instant>,
    },
    Upgrading {
        current: Server,
        successor: Successor,
    },
    /// `current`: the server that was current, which the driver tells to stop (it removes the
    /// state file), rather than only killing it.
    Stopping {
        current: Option<Server>,
    },
}

/// The keeper's state: the phase with its servers, the counters and what is deferred to a
/// ready server.
#[derive(Debug)]
pub struct Machine {
    state: State,
    next_epoch: u64,
    reload_timeout: Duration,
    server_timeout: Duration,
    /// Servers in a row that died before they were ready (the backoff grows with them).
    failures: u32,
    /// The current server said `RELOADING=1` and not yet `READY=1`.
    reloading: bool,
    /// Servers in a row that died in the middle of a reload.
    reload_deaths: u32,
    reload_when_ready: bool,
    upgrade_when_ready: bool,
    /// The last server lost, and how (`it died`, `it hung`), named by the one that takes over.
    dead: Option<(u32, &'static str)>,
    /// Why the first server could not declare the daemon ready after the mount answered (its
    /// state file cannot be written): its exit then fails the start, as a load error does.
    start_error: Option<String>,
    out: Vec<Action>,
}

impl Machine {
    /// A keeper starting its first server, which gives up on a successor that has not taken
    /// over within `reload_timeout`, and on a first server that has not answered through the
    /// mount within `server_timeout` of it.
    pub fn new(reload_timeout: Duration, server_timeout: Duration) -> (Machine, Vec<Action>) {
        let first = Server { epoch: FIRST_EPOCH, pid: 0, ready: false };
        let mut m = Machine {
            state: State::Starting { first, mounted: None, error: None },
            next_epoch: FIRST_EPOCH + 1,
            reload_timeout,
            server_timeout,
            failures: 0,
            reloading: false,
            reload_deaths: 0,
            reload_when_ready: false,
            upgrade_when_ready: false,
            dead: None,
            start_error: None,
            out: Vec::new(),
        };
        m.out.push(Action::Spawn { epoch: FIRST_EPOCH, binary: Binary::Good, plan: false });
        let actions = std::mem::take(&mut m.out);
        (m, actions)
    }

    pub fn phase(&self) -> Phase {
        match self.state {
            State::Starting { .. } => Phase::Starting,
            State::Serving { .. } => Phase::Serving,
            State::Replacing { .. } => Phase::Replacing,
            State::Upgrading { .. } => Phase::Upgrading,
            State::Stopping { .. } => Phase::Stopping,
        }
    }

    /// The server requests go to that is checked for a hang: the current one once it took
    /// over (the first once mounted), ready or not.
    pub fn hang_checked(&self) -> Option<u64> {
        match &self.state {
            State::Starting { first: current, mounted: Some(_), .. }
            | State::Serving { current }
            | State::Upgrading { current, .. } => Some(current.epoch),
            _ => None,
        }
    }

    /// When [`Event::Tick`] is due: a restart's backoff, a successor's deadline, or the first
    /// server's to answer through the mount.
    pub fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Starting { mounted, .. } => *mounted,
            State::Replacing { successor: Some(s), .. } | State::Upgrading { successor: s, .. } => Some(s.deadline),
            State::Replacing { successor: None, retry_at } => *retry_at,
            _ => None,
        }
    }

    /// The server of `epoch` is the current one or a successor (its exit is this machine's
    /// event; any other's is the driver's to reap).
    pub fn knows(&self, epoch: u64) -> bool {
        self.current() == Some(epoch) || self.state.successor(epoch).is_some()
    }

    /// Feeds one event; returns what to do, in order.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let state = std::mem::replace(&mut self.state, State::Stopping { current: None });
        self.state = match (state, event) {
            (state @ State::Stopping { .. }, _) => state,
            (state, Event::Stop(why)) => self.stop(state.current().copied(), Exit::Stop, Some(why)),
            (state, Event::KernelEnded) => self.stop(state.current().copied(), Exit::Ended, None),
            (state, Event::Spawned { epoch, pid, handed_plan }) => steps::spawned(state, epoch, pid, handed_plan),
            (state, Event::SpawnFailed { epoch, why }) => self.spawn_failed(state, epoch, why, now),
            (state, Event::Sighup) => {
                self.reload_deaths = 0;
                self.reload(&state);
                state
            }
            (state, Event::Sigusr2) => self.upgrade(state, now),
            (state, Event::Loaded { epoch, protocol }) => self.loaded(state, epoch, protocol, now),
            (state, Event::Failed { epoch, why }) => self.failed_said(state, epoch, why),
            (state, Event::Answering(epoch)) => self.answering(state, epoch),
            (state, Event::Notice(epoch, notice)) => self.notice(state, epoch, notice, now),
            (state, Event::Probed { epoch, same }) => self.probed(state, epoch, same),
            (state, Event::Gone { epoch, status }) => self.gone(state, epoch, &status, now),
            (state, Event::Overrun { epoch, why }) => self.overrun(state, epoch, &why, now),
            (state, Event::Hung { epoch, since }) => self.hung(state, epoch, since, now),
            (state, Event::Away) => self.away(state, now),
            (state, Event::Tick) => self.tick(state, now),
        };
        std::mem::take(&mut self.out)
    }

    /// The current server's epoch (the first server's, while it starts).
    pub fn current(&self) -> Option<u64> {
        self.state.current().map(|s| s.epoch)
    }
}

impl State {
    fn current(&self) -> Option<&Server> {
        match self {
            State::Starting { first: current, .. } | State::Serving { current } | State::Upgrading { current, .. } => {
                Some(current)
            }
            State::Stopping { current } => current.as_ref(),
            State::Replacing { .. } => None,
        }
    }

    /// The successor, if it is server `epoch`.
    fn successor(&self, epoch: u64) -> Option<&Successor> {
        match self {
            State::Replacing { successor: Some(s), .. } | State::Upgrading { successor: s, .. } => {
                Some(s).filter(|s| s.server.epoch == epoch)
            }
            _ => None,
        }
    }
}

/// The hang check at `now`: `oldest_sent` is when the oldest request the server has not
/// answered was written to it, `replies_waiting` whether replies it sent are not yet counted.
/// Replies are passed on before a server is called hung.
pub fn hang(oldest_sent: Option<Instant>, now: Instant, timeout: Duration, replies_waiting: bool) -> Hang {
    match oldest_sent.filter(|t| now.saturating_duration_since(*t) >= timeout) {
        None => Hang::No,
        Some(_) if replies_waiting => Hang::WaitForReplies,
        Some(since) => Hang::Hung(since),
    }
}

/// The hang check's verdict on the current server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hang {
    /// Nothing has waited on it for `--server-timeout`.
    No,
    /// Something has, but replies it sent wait to be passed on: pass them on, then look again.
    WaitForReplies,
    /// It has left a request unanswered since then: [`Event::Hung`].
    Hung(Instant),
}

/// How late a wake-up at `now` was for `deadline`, when later than `heartbeat` (the longest the
/// keeper sleeps while a server answers): then the keeper itself did not run meanwhile
/// (stopped, or starved of CPU), and its server's clock leaves that time out.
pub fn away(deadline: Option<Instant>, now: Instant, heartbeat: Duration) -> Option<Duration> {
    deadline.map(|d| now.saturating_duration_since(d)).filter(|late| *late > heartbeat)
}

mod steps;
#[cfg(test)]
mod tests;
