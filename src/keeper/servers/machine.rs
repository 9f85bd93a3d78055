//! The keeper's state machine as data: its phases and the servers each has ([`State`]), the
//! counters and what is deferred to a ready server ([`Machine`]), what it tells the keeper to do
//! ([`Action`]) and its constants. The steps ([`super::steps`]) and the dispatch
//! ([`super`]: an event to its step) both build on this module, which builds on neither.

use crate::keeper::control::{Control, Notice};
use std::time::{Duration, Instant};

/// The first wait before a server is started again after one died before it was ready.
pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(200);
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
    Resting,
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
    /// than have it load the inputs. Answered by [`Event::Spawned`](crate::keeper::servers::Event::Spawned) or
    /// [`Event::SpawnFailed`](crate::keeper::servers::Event::SpawnFailed); a spawn that has not
    /// returned within `--reload-timeout` (a child stopped between fork and exec) is a failed
    /// start at the next [`Event::Tick`](crate::keeper::servers::Event::Tick).
    Spawn {
        epoch: u64,
        binary: Binary,
        plan: bool,
    },
    /// The first server loaded: mount, and start relaying requests.
    Mount(u64),
    /// Write the pid file, unless it is written already.
    WritePidFile,
    /// Say the start is done (`--ready-fd`): the first server has written its state file and
    /// declared the daemon ready. Not at the pid file: a state file that then cannot be
    /// written fails the start (found from outside: on a full state dir, the starter had
    /// already been told the mount served, and runc ran on its unmounted directory).
    SayReady,
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
    /// Server `epoch`, which nothing was asked of for `--rest-after` and which has nothing in
    /// flight, rests: the relay sends it nothing more (what the kernel asks next waits, and
    /// wakes a server, [`Event::Wanted`](crate::keeper::servers::Event::Wanted)), and it is told
    /// to say so in the state file and exit.
    Rest(u64),
    /// Kill server `epoch`; one whose spawn has not returned is abandoned: killed and reaped if
    /// it ever does, and never served.
    Kill(u64),
    /// Tell the service manager.
    Notify(Notice),
    Info(String),
    Warn(String),
    Exit(Exit),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Server {
    pub(super) epoch: u64,
    pub(super) pid: u32,
    /// It said `READY=1`.
    pub(super) ready: bool,
}

impl Server {
    /// Its spawn returned ([`Event::Spawned`](crate::keeper::servers::Event::Spawned) gave its pid).
    pub(super) fn started(&self) -> bool {
        self.pid != 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Successor {
    pub(super) server: Server,
    /// When it is given up on, if it has not taken over.
    pub(super) deadline: Instant,
    /// Why it failed, when it said so before exiting.
    pub(super) failed: Option<String>,
    pub(super) handed_plan: bool,
}

#[derive(Debug)]
pub(super) enum State {
    Starting {
        first: Server,
        /// Its spawn must have returned (`first.pid` is 0 until it has), and its inputs loaded
        /// (it is mounted then), by then: `--reload-timeout` from the start, as a successor gets.
        spawn_by: Instant,
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
    /// No server runs: the last one, `rested` (its pid), rested; the next request or signal
    /// starts another from its binary, with its plan.
    Resting {
        rested: u32,
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
    pub(super) state: State,
    pub(super) next_epoch: u64,
    pub(super) reload_timeout: Duration,
    pub(super) server_timeout: Duration,
    /// Servers in a row that died before they were ready (the backoff grows with them).
    pub(super) failures: u32,
    /// The current server said `RELOADING=1` and not yet `READY=1`.
    pub(super) reloading: bool,
    /// Servers in a row that died in the middle of a reload.
    pub(super) reload_deaths: u32,
    pub(super) reload_when_ready: bool,
    pub(super) upgrade_when_ready: bool,
    /// A reload was asked of the current server, which has not said `READY=1` since: it does
    /// not rest meanwhile (its `RELOADING=1` may not have come yet).
    pub(super) reload_asked: bool,
    /// The last server lost, and how (`it died`, `it hung`), named by the one that takes over.
    pub(super) dead: Option<(u32, &'static str)>,
    /// Why the first server could not declare the daemon ready after the mount answered (its
    /// state file cannot be written): its exit then fails the start, as a load error does.
    pub(super) start_error: Option<String>,
    pub(super) out: Vec<Action>,
}

impl Machine {
    /// A keeper starting its first server at `now`, which gives up on a server whose spawn
    /// has not returned, or a successor that has not taken over, within `reload_timeout`, and
    /// on a first server that has not answered through the mount within `server_timeout` of it.
    pub fn new(reload_timeout: Duration, server_timeout: Duration, now: Instant) -> (Machine, Vec<Action>) {
        let first = Server { epoch: FIRST_EPOCH, pid: 0, ready: false };
        let mut m = Machine {
            state: State::Starting { first, spawn_by: now + reload_timeout, mounted: None, error: None },
            next_epoch: FIRST_EPOCH + 1,
            reload_timeout,
            server_timeout,
            failures: 0,
            reloading: false,
            reload_deaths: 0,
            reload_when_ready: false,
            upgrade_when_ready: false,
            reload_asked: false,
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
            State::Resting { .. } => Phase::Resting,
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

    /// When [`Event::Tick`](crate::keeper::servers::Event::Tick) is due: a restart's backoff, a successor's deadline, or the first
    /// server's to start or to answer through the mount.
    pub fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Starting { spawn_by, mounted: None, .. } => Some(*spawn_by),
            State::Starting { mounted, .. } => *mounted,
            State::Replacing { successor: Some(s), .. } | State::Upgrading { successor: s, .. } => Some(s.deadline),
            State::Replacing { successor: None, retry_at } => *retry_at,
            _ => None,
        }
    }

    /// The server that may rest ([`Event::Idle`](crate::keeper::servers::Event::Idle)) if
    /// nothing is asked of it: a ready current server with no reload or upgrade under way or
    /// due.
    pub fn may_rest(&self) -> Option<u64> {
        self.restable(&self.state)
    }

    /// [`Machine::may_rest`], in `state`.
    pub(super) fn restable(&self, state: &State) -> Option<u64> {
        let busy = self.reloading || self.reload_asked || self.reload_when_ready || self.upgrade_when_ready;
        match state {
            State::Serving { current } if current.ready && !busy => Some(current.epoch),
            _ => None,
        }
    }

    /// The server of `epoch` is the current one or a successor (its exit is this machine's
    /// event; any other's is the driver's to reap).
    pub fn knows(&self, epoch: u64) -> bool {
        self.current() == Some(epoch) || self.state.successor(epoch).is_some()
    }

    /// The current server's epoch (the first server's, while it starts).
    pub fn current(&self) -> Option<u64> {
        self.state.current().map(|s| s.epoch)
    }

    /// Whether the current server has said it is ready (it serves, and wrote its state file).
    pub fn current_ready(&self) -> bool {
        self.state.current().is_some_and(|s| s.ready)
    }
}

impl State {
    pub(super) fn current(&self) -> Option<&Server> {
        match self {
            State::Starting { first: current, .. } | State::Serving { current } | State::Upgrading { current, .. } => {
                Some(current)
            }
            State::Stopping { current } => current.as_ref(),
            State::Replacing { .. } | State::Resting { .. } => None,
        }
    }

    /// The successor, if it is server `epoch`.
    pub(super) fn successor(&self, epoch: u64) -> Option<&Successor> {
        match self {
            State::Replacing { successor: Some(s), .. } | State::Upgrading { successor: s, .. } => {
                Some(s).filter(|s| s.server.epoch == epoch)
            }
            _ => None,
        }
    }
}
