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
//!   `Upgrading` on `SIGUSR2` (ready only), to `Replacing` when it dies or hangs, to `Resting`
//!   when nothing was asked of it for `--rest-after` (ready, with nothing under way).
//! - `Resting` (no server runs; the keeper keeps the plan): to `Replacing` at the next request,
//!   `SIGHUP` or `SIGUSR2`, as after a crash but quietly (a signal's reload or upgrade follows
//!   once the new server serves).
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
//!
//! Three modules, whose dependencies go one way: `machine` holds the machine's data (its
//! states, the counters, the actions, the constants); `steps` one step per event, from a state
//! to the next, pushing actions; this module the events and the dispatch ([`Machine::handle`]:
//! an event to its step), with the driver's checks that make events ([`hang`], [`away`]).

mod machine;
mod steps;
#[cfg(test)]
mod tests;

use crate::keeper::control::{HandoverError, Notice};
use machine::State;
pub use machine::{Action, Binary, Exit, FIRST_EPOCH, MAX_BACKOFF, MAX_RELOAD_DEATHS, Machine, Phase};
use std::time::{Duration, Instant};

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
    /// Nothing was asked of the server [`Machine::may_rest`] names for `--rest-after`, and it
    /// has nothing in flight (the driver's check).
    Idle,
    /// A request came while no server runs.
    Wanted,
}

impl Machine {
    /// Feeds one event; returns what to do, in order.
    pub fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let state = std::mem::replace(&mut self.state, State::Stopping { current: None });
        self.state = match (state, event) {
            (state @ State::Stopping { .. }, _) => state,
            (state, Event::Stop(why)) => self.stop(state.current().copied(), Exit::Stop, Some(why)),
            (state, Event::KernelEnded) => self.stop(state.current().copied(), Exit::Ended, None),
            (state, Event::Spawned { epoch, pid, handed_plan }) => steps::spawned(state, epoch, pid, handed_plan),
            (state, Event::SpawnFailed { epoch, why }) => self.spawn_failed(state, epoch, why, now),
            (state, Event::Sighup) => self.sighup(state, now),
            (state, Event::Sigusr2) => self.upgrade(state, now),
            (state, Event::Idle) => self.idle(state),
            (state, Event::Wanted) => self.wake(state, now),
            (state, Event::Loaded { epoch, protocol }) => self.loaded(state, epoch, protocol, now),
            (state, Event::Failed { epoch, why }) => self.failed_said(state, epoch, why),
            (state, Event::Answering(epoch)) => self.answering(state, epoch),
            (state, Event::Notice(epoch, notice)) => self.notice(state, epoch, notice, now),
            (state, Event::Probed { epoch, same }) => self.probed(state, epoch, same, now),
            (state, Event::Gone { epoch, status }) => self.gone(state, epoch, &status, now),
            (state, Event::Overrun { epoch, why }) => self.overrun(state, epoch, &why, now),
            (state, Event::Hung { epoch, since }) => self.hung(state, epoch, since, now),
            (state, Event::Away) => self.away(state, now),
            (state, Event::Tick) => self.tick(state, now),
        };
        std::mem::take(&mut self.out)
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
