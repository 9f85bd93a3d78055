//! The machine's steps: one function per event, from a phase to the next, pushing actions. They
//! build on the machine's data ([`super::machine`]); the dispatch (`super`) calls them.

use super::machine::{
    Action, Binary, Exit, FIRST_BACKOFF, FIRST_EPOCH, MAX_BACKOFF, MAX_RELOAD_DEATHS, Machine, Server, State, Successor,
};
use crate::keeper::control::{Control, HandoverError, Notice, PROTOCOL};
use std::time::Instant;

impl Machine {
    fn warn(&mut self, text: impl Into<String>) {
        self.out.push(Action::Warn(text.into()));
    }

    fn info(&mut self, text: impl Into<String>) {
        self.out.push(Action::Info(text.into()));
    }

    /// The end of the keeper's life (`why` logged and told to systemd, for a stop): the server
    /// that was `current` stays known, for the driver to tell it to stop (it removes the state
    /// file) before it kills what is left.
    pub(super) fn stop(&mut self, current: Option<Server>, exit: Exit, why: Option<String>) -> State {
        if let Some(why) = why {
            self.info(format!("{why}: stopping"));
            self.out.push(Action::Notify(Notice::Stopping));
        }
        self.out.push(Action::Exit(exit));
        State::Stopping { current }
    }

    /// `SIGHUP`: a reload asked for, which ends the run of deaths in reloads (the operator asks
    /// again, knowing the inputs). While resting, a server wakes and reloads once it serves.
    pub(super) fn sighup(&mut self, state: State, now: Instant) -> State {
        self.reload_deaths = 0;
        if let State::Resting { .. } = state {
            self.reload_when_ready = true;
            return self.wake(state, now);
        }
        self.reload(&state);
        state
    }

    /// Nothing was asked of the current server for `--rest-after`: one that [`Machine::may_rest`]
    /// rests, and no server runs until the next request or signal ([`Machine::wake`]).
    pub(super) fn idle(&mut self, state: State) -> State {
        match (self.restable(&state), state) {
            (Some(epoch), State::Serving { current }) => {
                self.out.push(Action::Rest(epoch));
                State::Resting { rested: current.pid }
            }
            (_, state) => state,
        }
    }

    /// A request or a signal while resting: a server starts from the rested one's binary and
    /// with its plan, and takes over as after a crash; nothing failed, so nothing is warned of.
    pub(super) fn wake(&mut self, state: State, now: Instant) -> State {
        let State::Resting { rested } = state else { return state };
        self.dead = Some((rested, "it rested"));
        self.restart(now)
    }

    /// A reload, asked for (`SIGHUP`) or due: a ready server reloads now; during an upgrade the
    /// new server reloads once more when it serves (it may have loaded the inputs before they
    /// changed); with no ready server, once one serves.
    fn reload(&mut self, state: &State) {
        match state {
            State::Serving { current } if current.ready => {
                self.reload_asked = true;
                self.out.push(Action::Reload(current.epoch));
            }
            State::Upgrading { current, .. } => {
                self.reload_when_ready = true;
                self.out.push(Action::Reload(current.epoch));
            }
            State::Starting { .. } => {
                self.defer(|m| &mut m.reload_when_ready, "signal SIGHUP while starting: reloading once serving")
            }
            State::Serving { .. } | State::Replacing { .. } => {
                self.defer(
                    |m| &mut m.reload_when_ready,
                    "signal SIGHUP while a server takes over: reloading once it serves",
                );
            }
            // A resting keeper wakes a server first ([`Machine::sighup`]).
            State::Resting { .. } | State::Stopping { .. } => {}
        }
    }

    /// `SIGUSR2` (or one deferred): a ready server is upgraded; while a server starts, once it
    /// serves; during an upgrade, once more when it ends.
    pub(super) fn upgrade(&mut self, state: State, now: Instant) -> State {
        match state {
            State::Serving { current } if current.ready => {
                let successor = self.spawn(Binary::Path, false, now);
                State::Upgrading { current, successor }
            }
            // The binary at the path may have been replaced since this upgrade's server was
            // started (a second package upgrade): one more follows it, as for reloads.
            State::Upgrading { .. } => {
                self.defer(
                    |m| &mut m.upgrade_when_ready,
                    "signal SIGUSR2 during an upgrade: upgrading again once it is done",
                );
                state
            }
            // The rested server's binary wakes first, and is upgraded once it serves, as any
            // ready server is.
            State::Resting { .. } => {
                self.upgrade_when_ready = true;
                self.wake(state, now)
            }
            state => {
                self.defer(
                    |m| &mut m.upgrade_when_ready,
                    "signal SIGUSR2 while a server starts: upgrading once it serves",
                );
                state
            }
        }
    }

    /// Marks `due` (a reload or an upgrade for when a server serves) and says `line`, once
    /// however many signals ask for it meanwhile: anyone who may signal the keeper may send
    /// thousands (found from outside: a flood of `SIGUSR2`s during an upgrade wrote a line each,
    /// 222,672 in 8 s).
    fn defer(&mut self, due: fn(&mut Machine) -> &mut bool, line: &str) {
        if !std::mem::replace(due(self), true) {
            self.info(line);
        }
    }

    fn spawn(&mut self, binary: Binary, plan: bool, now: Instant) -> Successor {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        self.out.push(Action::Spawn { epoch, binary, plan });
        let server = Server { epoch, pid: 0, ready: false };
        Successor { server, deadline: now + self.reload_timeout, failed: None, handed_plan: false }
    }

    /// Starts a successor after a crash, from the dead server's binary and with its plan.
    fn restart(&mut self, now: Instant) -> State {
        let successor = self.spawn(Binary::Good, true, now);
        State::Replacing { successor: Some(successor), retry_at: None }
    }

    /// A successor after a crash failed: another is started after the backoff.
    fn retry_later(&mut self, now: Instant) -> State {
        self.failures += 1;
        let backoff = (FIRST_BACKOFF * 2u32.saturating_pow(self.failures - 1)).min(MAX_BACKOFF);
        self.warn(format!("starting another server in {} ms; requests wait until one serves", backoff.as_millis()));
        State::Replacing { successor: None, retry_at: Some(now + backoff) }
    }

    /// An upgrade that did not happen: logged, and recorded by the serving server, which
    /// serves on. A reload deferred to the new server is moot: the old one did it. An upgrade
    /// asked for meanwhile is tried now (the binary at the path may have been replaced since).
    fn refuse(&mut self, current: Server, why: String, now: Instant) -> State {
        self.warn(format!("{why}; the running server serves on"));
        self.out.push(Action::Tell(current.epoch, Control::Refused(why)));
        self.reload_when_ready = false;
        let state = State::Serving { current };
        if std::mem::take(&mut self.upgrade_when_ready) { self.upgrade(state, now) } else { state }
    }

    /// Successor `s` cannot take over (`why`, a sentence for a crash's log; `refusal`, the
    /// upgrade's `last_error`): killed, and the next is due, or the old server serves on.
    fn successor_failed(&mut self, state: State, why: String, refusal: String, now: Instant) -> State {
        match state {
            State::Replacing { successor: Some(s), .. } => {
                self.out.push(Action::Kill(s.server.epoch));
                self.warn(why);
                self.retry_later(now)
            }
            State::Upgrading { current, successor } => {
                self.out.push(Action::Kill(successor.server.epoch));
                self.refuse(current, refusal, now)
            }
            state => state,
        }
    }

    pub(super) fn spawn_failed(&mut self, state: State, epoch: u64, why: String, now: Instant) -> State {
        match state {
            State::Starting { .. } => {
                self.stop(None, Exit::StartFailed(format!("cannot start the server: {why}")), None)
            }
            State::Replacing { successor: Some(s), .. } if s.server.epoch == epoch => {
                self.warn(format!("cannot start a server: {why}"));
                self.retry_later(now)
            }
            State::Upgrading { current, successor } if successor.server.epoch == epoch => {
                self.refuse(current, format!("upgrade refused: {why}"), now)
            }
            state => state,
        }
    }

    pub(super) fn loaded(&mut self, state: State, epoch: u64, protocol: u32, now: Instant) -> State {
        let is_successor = state.successor(epoch).is_some();
        if protocol != PROTOCOL {
            let why = format!("it speaks keeper protocol {protocol}, this keeper speaks protocol {PROTOCOL}");
            return match state {
                State::Starting { first, mounted: None, .. } if first.epoch == epoch => {
                    self.stop(None, Exit::StartFailed(format!("the server cannot serve: {why}")), None)
                }
                state if is_successor => {
                    let refusal = format!(
                        "upgrade refused: the new binary cannot take over: {why}; restart the daemon to use it"
                    );
                    self.successor_failed(state, format!("a server to take over cannot: {why}"), refusal, now)
                }
                state => state,
            };
        }
        match state {
            State::Starting { first, spawn_by, mounted: None, error } if first.epoch == epoch => {
                self.out.push(Action::Mount(epoch));
                State::Starting { first, spawn_by, mounted: Some(now + self.server_timeout), error }
            }
            state => {
                // Probed with the kernel's INIT; it takes over once it answers alike.
                if is_successor {
                    self.out.push(Action::Probe(epoch));
                }
                state
            }
        }
    }

    /// A server's load error: the first server's is the command's, said once it has exited; a
    /// successor's is why it could not take over; a current server's is logged (its exit next).
    pub(super) fn failed_said(&mut self, state: State, epoch: u64, why: String) -> State {
        match state {
            State::Starting { first, spawn_by, mounted, .. } if first.epoch == epoch => {
                State::Starting { first, spawn_by, mounted, error: Some(why) }
            }
            State::Replacing { successor: Some(mut s), retry_at } if s.server.epoch == epoch => {
                s.failed = Some(why);
                State::Replacing { successor: Some(s), retry_at }
            }
            State::Upgrading { current, mut successor } if successor.server.epoch == epoch => {
                successor.failed = Some(why);
                State::Upgrading { current, successor }
            }
            // The first server, answering but not yet ready, failed to declare the daemon
            // ready: the start fails once it has exited.
            State::Serving { current } if current.epoch == epoch && current.epoch == FIRST_EPOCH && !current.ready => {
                self.start_error = Some(why);
                State::Serving { current }
            }
            state => {
                if let Some(current) = state.current().filter(|c| c.epoch == epoch) {
                    let pid = current.pid;
                    self.warn(format!("server pid {pid}: {why}"));
                }
                state
            }
        }
    }

    /// The mount answers through the current server: the pid file first, then it may declare
    /// the daemon ready (the state file), which is when the starter is told ([`Action::SayReady`]).
    /// From now on a server that dies is replaced.
    pub(super) fn answering(&mut self, state: State, epoch: u64) -> State {
        if state.current().is_none_or(|c| c.epoch != epoch) {
            return state;
        }
        self.out.push(Action::WritePidFile);
        self.out.push(Action::Tell(epoch, Control::Proceed));
        match state {
            State::Starting { first, .. } => State::Serving { current: first },
            state => state,
        }
    }

    /// A notice of the current server: passed to the service manager. A reload it finishes
    /// ends the run of deaths in reloads; its first `READY=1` ends the run of failures, and
    /// what was deferred to a ready server is due.
    pub(super) fn notice(&mut self, state: State, epoch: u64, notice: Notice, now: Instant) -> State {
        if state.current().is_none_or(|c| c.epoch != epoch) {
            return state;
        }
        self.out.push(Action::Notify(notice));
        match notice {
            Notice::Reloading => self.reloading = true,
            Notice::Ready if std::mem::take(&mut self.reloading) => self.reload_deaths = 0,
            _ => {}
        }
        if notice == Notice::Ready {
            self.reload_asked = false;
        }
        let State::Serving { mut current } = state else { return state };
        if notice != Notice::Ready || current.ready {
            return State::Serving { current };
        }
        current.ready = true;
        if current.epoch == FIRST_EPOCH {
            self.out.push(Action::SayReady);
        }
        self.failures = 0;
        let mut state = State::Serving { current };
        // The upgrade first: a reload due with it is then one during an upgrade, which the new
        // server makes once more when it serves (found from outside: a `SIGHUP` and a `SIGUSR2`
        // that woke a resting mount together lost the reload, which the old server began and
        // its retirement ended).
        if std::mem::take(&mut self.upgrade_when_ready) {
            state = self.upgrade(state, now);
        }
        if std::mem::take(&mut self.reload_when_ready) {
            self.reload(&state);
        }
        state
    }

    /// A successor answered the INIT replay: it takes over, unless an upgrade disagrees (after
    /// a crash there is no server to keep, so it serves anyway, with a warning).
    pub(super) fn probed(&mut self, state: State, epoch: u64, same: bool, now: Instant) -> State {
        match state {
            State::Replacing { successor: Some(s), .. } if s.server.epoch == epoch => {
                if !same {
                    let pid = s.server.pid;
                    self.warn(format!(
                        "server pid {pid} negotiates other FUSE parameters than the kernel agreed to; it serves anyway"
                    ));
                }
                let from = match self.dead {
                    Some((dead, how)) if s.handed_plan => format!("from server pid {dead} ({how}; serving its plan)"),
                    Some((dead, how)) => format!("from server pid {dead} ({how})"),
                    None => "(the server before it died)".to_owned(),
                };
                self.out.push(Action::TakeOver { epoch, retire: None, from });
                State::Serving { current: s.server }
            }
            State::Upgrading { current, successor } if successor.server.epoch == epoch && !same => {
                self.out.push(Action::Kill(epoch));
                let why = "upgrade refused: the new binary negotiates other FUSE parameters with the kernel; restart \
                           the daemon to use it";
                self.refuse(current, why.into(), now)
            }
            State::Upgrading { current, successor } if successor.server.epoch == epoch => {
                let from = format!("from server pid {} (an upgrade)", current.pid);
                self.out.push(Action::TakeOver { epoch, retire: Some(current.epoch), from });
                State::Serving { current: successor.server }
            }
            state => state,
        }
    }

    pub(super) fn gone(&mut self, state: State, epoch: u64, status: &str, now: Instant) -> State {
        let died =
            |current: &Server| format!("server pid {} exited ({status}); starting another to take over", current.pid);
        match state {
            State::Starting { first, error, .. } if first.epoch == epoch => {
                let why = error.unwrap_or_else(|| format!("the server exited before it was ready ({status})"));
                self.stop(None, Exit::StartFailed(why), None)
            }
            State::Serving { current } if current.epoch == epoch => match self.start_error.take() {
                Some(why) => self.stop(None, Exit::StartFailed(why), None),
                None => {
                    self.warn(died(&current));
                    self.lose(current, None, "it died", now)
                }
            },
            State::Upgrading { current, successor } if current.epoch == epoch => {
                self.warn(died(&current));
                self.lose(current, Some(successor), "it died", now)
            }
            state => {
                let Some(s) = state.successor(epoch) else { return state };
                let why = s.failed.clone().unwrap_or_else(|| format!("it exited ({status})"));
                let crash = format!("server pid {} could not take over: {why}", s.server.pid);
                let refusal = format!("upgrade refused: the new server could not take over: {why}");
                self.successor_failed(state, crash, refusal, now)
            }
        }
    }

    /// The current server is gone (dead, or killed as hung): another takes over at once from
    /// the same binary and with its plan, or after the backoff if it was not ready (it may die
    /// the same way at once); a reload it was asked for, or had begun, is asked again, unless
    /// [`MAX_RELOAD_DEATHS`] servers in a row died in one; an upgrade under way is dropped.
    fn lose(&mut self, current: Server, upgrade: Option<Successor>, how: &'static str, now: Instant) -> State {
        self.out.push(Action::Lost(current.epoch));
        self.dead = Some((current.pid, how));
        self.reload_deaths += u32::from(std::mem::take(&mut self.reloading));
        let reload = self.reload_deaths < MAX_RELOAD_DEATHS;
        self.reload_when_ready |= reload;
        if !reload {
            self.warn(
                "two servers in a row died in the middle of a reload; the next serves the last plan and reloads only \
                 on SIGHUP (the inputs may be what kills them)",
            );
        }
        // Dropped: the dead server's binary and plan take over at once, rather than waiting for
        // an untried binary still loading its inputs.
        if let Some(s) = upgrade {
            // Its pid is known once its spawn returned (found from outside: "server pid 0").
            let which = match s.server.pid {
                0 => "its successor".to_owned(),
                pid => format!("server pid {pid}"),
            };
            self.warn(format!("upgrade abandoned: the serving server died while {which} was starting"));
            self.out.push(Action::Kill(s.server.epoch));
        }
        if current.ready { self.restart(now) } else { self.retry_later(now) }
    }

    /// Server `epoch` sent more than the keeper keeps: a successor is treated as failed (killed;
    /// the next is due, or the old server serves on); the current server serves on, and the
    /// driver forgets its plan (a server restarted after its crash loads the inputs).
    pub(super) fn overrun(&mut self, state: State, epoch: u64, why: &HandoverError, now: Instant) -> State {
        if let Some(s) = state.successor(epoch) {
            let crash = format!("server pid {} could not take over: it {why}; killed it", s.server.pid);
            let refusal = format!("upgrade refused: the new server {why}");
            return self.successor_failed(state, crash, refusal, now);
        }
        if let Some(current) = state.current().filter(|c| c.epoch == epoch) {
            let pid = current.pid;
            self.warn(format!(
                "server pid {pid} {why}: not kept, so a server restarted after a crash loads the inputs; it serves on"
            ));
        }
        state
    }

    /// The keeper did not run for a while: a successor gets a new `--reload-timeout` from `now`
    /// (a first server, a new `--server-timeout` to say the mount answers).
    /// Its `Loaded` may have waited unread all that time, and its deadline would otherwise pass
    /// before the keeper's control thread has read it (an upgrade refused for a slow load that
    /// was not), as a server gets a new `--server-timeout` for its requests.
    pub(super) fn away(&mut self, state: State, now: Instant) -> State {
        match state {
            State::Starting { first, spawn_by, mounted: Some(by), error } => {
                State::Starting { first, spawn_by, mounted: Some(by.max(now + self.server_timeout)), error }
            }
            // Its spawn runs on a thread of the keeper's, which did not run either, and its load
            // may have waited unread.
            State::Starting { first, spawn_by, mounted: None, error } => {
                State::Starting { first, spawn_by: spawn_by.max(now + self.reload_timeout), mounted: None, error }
            }
            State::Replacing { successor: Some(mut s), retry_at } => {
                s.deadline = s.deadline.max(now + self.reload_timeout);
                State::Replacing { successor: Some(s), retry_at }
            }
            State::Upgrading { current, mut successor } => {
                successor.deadline = successor.deadline.max(now + self.reload_timeout);
                State::Upgrading { current, successor }
            }
            state => state,
        }
    }

    /// The hang check found the current server hung: killed, and replaced as a dead one is; a
    /// first server still starting fails the start (nothing has served from it).
    pub(super) fn hung(&mut self, state: State, epoch: u64, since: Instant, now: Instant) -> State {
        let secs = now.saturating_duration_since(since).as_secs();
        let (current, upgrade) = match state {
            State::Starting { first, mounted: Some(_), .. } if first.epoch == epoch => {
                let why =
                    format!("server pid {} left a request unanswered for {secs} s while starting: hung", first.pid);
                return self.stop(None, Exit::StartFailed(why), None);
            }
            State::Serving { current } if current.epoch == epoch => (current, None),
            State::Upgrading { current, successor } if current.epoch == epoch => (current, Some(successor)),
            state => return state,
        };
        self.warn(format!(
            "server pid {} has left a request unanswered for {secs} s: hung; killing it and starting another to take over",
            current.pid,
        ));
        self.out.push(Action::Kill(epoch));
        self.lose(current, upgrade, "it hung", now)
    }

    /// A deadline passed: a restart that was due, a successor that did not take over in time, or
    /// a first server that did not start, or did not answer through the mount, in time (the
    /// start fails). A server whose spawn has not returned (a child stopped between fork and
    /// exec: the keeper waits on no spawn) has failed to start; its spawn is abandoned.
    pub(super) fn tick(&mut self, state: State, now: Instant) -> State {
        let secs = self.reload_timeout.as_secs();
        let not_started = format!("did not start within {secs} s (stopped between fork and exec?)");
        let overdue = match &state {
            State::Replacing { successor: Some(s), .. } | State::Upgrading { successor: s, .. } => {
                Some(s.server).filter(|_| s.deadline <= now)
            }
            _ => None,
        };
        match (state, overdue) {
            (State::Starting { first, spawn_by, mounted: None, .. }, _) if spawn_by <= now => {
                // A load that never ends (an input on a stuck filesystem) kept the keeper and its
                // server for good, whoever had asked for the mount gone (found from outside).
                let why = if first.started() {
                    format!(
                        "server pid {} did not load its inputs within {secs} s (an input on a stuck filesystem?)",
                        first.pid
                    )
                } else {
                    format!("cannot start the server: it {not_started}")
                };
                self.stop(None, Exit::StartFailed(why), None)
            }
            (State::Starting { first, mounted: Some(by), .. }, _) if by <= now => {
                let why = format!(
                    "server pid {} did not say that the mount answers through it within {} s of mounting: hung",
                    first.pid,
                    self.server_timeout.as_secs()
                );
                self.stop(None, Exit::StartFailed(why), None)
            }
            (State::Replacing { successor: None, retry_at: Some(t) }, _) if t <= now => self.restart(now),
            (state, Some(server)) if !server.started() => {
                let crash = format!("a server to take over {not_started}; abandoned its start");
                let refusal = format!("upgrade refused: the new server {not_started}");
                self.successor_failed(state, crash, refusal, now)
            }
            (state, Some(server)) => {
                let crash = format!(
                    "server pid {} did not take over within {secs} s (an input on a stuck filesystem?); killed it",
                    server.pid
                );
                let refusal = format!("upgrade refused: the new server did not load its inputs within {secs} s");
                self.successor_failed(state, crash, refusal, now)
            }
            (state, None) => state,
        }
    }
}

/// Records the pid of a server just started.
pub(super) fn spawned(state: State, epoch: u64, pid: u32, handed_plan: bool) -> State {
    match state {
        State::Starting { mut first, spawn_by, mounted, error } if first.epoch == epoch => {
            first.pid = pid;
            State::Starting { first, spawn_by, mounted, error }
        }
        State::Replacing { successor: Some(mut s), retry_at } if s.server.epoch == epoch => {
            (s.server.pid, s.handed_plan) = (pid, handed_plan);
            State::Replacing { successor: Some(s), retry_at }
        }
        State::Upgrading { current, mut successor } if successor.server.epoch == epoch => {
            (successor.server.pid, successor.handed_plan) = (pid, handed_plan);
            State::Upgrading { current, successor }
        }
        state => state,
    }
}
