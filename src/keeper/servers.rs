//! The keeper's decisions about its servers, without I/O: what a `SIGHUP` or a `SIGUSR2` does
//! in each phase, what follows a server's readiness or its loss (restart at once or after a
//! backoff, reload or not), whether a replacement that answered the INIT probe takes over, and
//! whether a server is hung. The keeper (`mountd/keeper/`) derives the [`Phase`] from the
//! servers it has, feeds these the events and does what they return; [`crate::keeper::relay::Relay`]
//! decides the FUSE traffic.
//!
//! Assumptions: at most one server is current and at most one replaces it (after a crash, or
//! an upgrade); a server that said `READY=1` answers every request at once, so one left
//! unanswered for `--server-timeout` means it hangs, unless its replies wait on the keeper.

use crate::served::lifecycle::Notice;
use std::time::{Duration, Instant};

/// The first wait before a server is started again after one died before it was ready.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait between two failed restarts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Servers in a row that may die in the middle of a reload before a successor stops reloading
/// on its own (the inputs may be what kills them).
pub const MAX_RELOAD_DEATHS: u32 = 2;

/// Where the keeper is, as its servers tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The first server has not yet answered through the mount.
    Starting,
    /// A ready server answers, and none replaces it.
    Serving,
    /// No ready server: one died (or hung) and another is starting, or due, to take over.
    Replacing,
    /// A ready server answers while the binary now on disk loads to take over from it.
    Upgrading,
}

/// What a reload request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    /// Pass the `SIGHUP` to the current server.
    Now,
    /// Pass it, and reload once more when the upgrade's server serves (it may have loaded
    /// the inputs before they changed).
    NowAndOnceServing,
    /// No server can reload yet: reload once one serves.
    OnceServing,
}

/// What a `SIGUSR2` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    /// Start the binary at the keeper's path to take over.
    Start,
    /// A server is starting: upgrade once it serves.
    OnceServing,
    /// An upgrade is under way already.
    Ignored,
}

/// What the current server's first `READY=1` makes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WhenReady {
    pub reload: bool,
    pub upgrade: bool,
}

/// What follows the loss of the current server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    /// Start a successor now (`None`), or after this backoff (it was not ready: it may die
    /// the same way at once).
    pub retry_in: Option<Duration>,
    /// The successor reloads once it serves (a reload the dead server was asked for, or had
    /// begun, is not lost); `false` after [`MAX_RELOAD_DEATHS`] deaths in a reload.
    pub reload: bool,
}

/// Whether a replacement that answered the INIT probe takes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// It takes over; `differs`: it negotiates other FUSE parameters (after a crash there is
    /// no server to keep, so it serves anyway, with a warning).
    TakeOver { differs: bool },
    /// An upgrade that disagrees with the kernel's INIT: refused, the old server serves on.
    Refuse,
}

/// The hang check's verdict on the current server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hang {
    /// Nothing has waited on it for `--server-timeout`.
    No,
    /// Something has, but replies it sent wait to be passed on: pass them on, then look again.
    WaitForReplies,
    /// It has left a request unanswered since then: kill it, another takes over.
    Hung(Instant),
}

/// The counters and the requests deferred to a ready server.
#[derive(Debug, Default)]
pub struct Policy {
    /// Servers in a row that died before they were ready (the backoff grows with them).
    failures: u32,
    /// The current server said `RELOADING=1` and not yet `READY=1`.
    reloading: bool,
    /// Servers in a row that died in the middle of a reload.
    reload_deaths: u32,
    reload_when_ready: bool,
    upgrade_when_ready: bool,
}

impl Policy {
    /// A `SIGHUP` from someone: whatever servers died of before, the reload is tried.
    pub fn sighup(&mut self, phase: Phase) -> Reload {
        self.reload_deaths = 0;
        self.reload(phase)
    }

    /// A reload, asked for or due.
    pub fn reload(&mut self, phase: Phase) -> Reload {
        match phase {
            Phase::Serving => Reload::Now,
            Phase::Upgrading => {
                self.reload_when_ready = true;
                Reload::NowAndOnceServing
            }
            Phase::Starting | Phase::Replacing => {
                self.reload_when_ready = true;
                Reload::OnceServing
            }
        }
    }

    /// A `SIGUSR2`.
    pub fn upgrade(&mut self, phase: Phase) -> Upgrade {
        match phase {
            Phase::Serving => Upgrade::Start,
            Phase::Upgrading => Upgrade::Ignored,
            Phase::Starting | Phase::Replacing => {
                self.upgrade_when_ready = true;
                Upgrade::OnceServing
            }
        }
    }

    /// A notice of the current server (`RELOADING=1`, `READY=1`): a reload it finishes ends
    /// the run of deaths in reloads.
    pub fn notice(&mut self, notice: Notice) {
        match notice {
            Notice::Reloading => self.reloading = true,
            Notice::Ready if std::mem::take(&mut self.reloading) => self.reload_deaths = 0,
            _ => {}
        }
    }

    /// The current server's first `READY=1`: the run of failures ends, and what was deferred
    /// to a ready server is due.
    pub fn ready(&mut self) -> WhenReady {
        self.failures = 0;
        WhenReady {
            reload: std::mem::take(&mut self.reload_when_ready),
            upgrade: std::mem::take(&mut self.upgrade_when_ready),
        }
    }

    /// The current server died or was killed as hung; `was_ready`: it had said `READY=1`.
    pub fn lost(&mut self, was_ready: bool) -> Lost {
        self.reload_deaths += u32::from(std::mem::take(&mut self.reloading));
        let reload = self.reload_deaths < MAX_RELOAD_DEATHS;
        self.reload_when_ready |= reload;
        Lost { retry_in: (!was_ready).then(|| self.failed()), reload }
    }

    /// A server that was to take over failed (it died, or did not load in time): the wait
    /// before the next start.
    pub fn failed(&mut self) -> Duration {
        self.failures += 1;
        (FIRST_BACKOFF * 2u32.saturating_pow(self.failures - 1)).min(MAX_BACKOFF)
    }
}

/// Whether a replacement takes over, given whether it answered the probe as the first server
/// did and whether it replaces a crashed server (or an upgrade's).
pub fn probed(same: bool, crashed: bool) -> Probe {
    match (same, crashed) {
        (false, false) => Probe::Refuse,
        (same, _) => Probe::TakeOver { differs: !same },
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

/// How late a wake-up at `now` was for `deadline`, when later than `heartbeat` (the longest the
/// keeper sleeps while a server answers): then the keeper itself did not run meanwhile
/// (stopped, or starved of CPU), and its server's clock starts again.
pub fn away(deadline: Option<Instant>, now: Instant, heartbeat: Duration) -> Option<Duration> {
    deadline.map(|d| now.saturating_duration_since(d)).filter(|late| *late > heartbeat)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule (issue 13): a server that dies before it is ready is started again after a backoff
    /// of 0.2 s doubling to 5 s; a ready successor ends the run.
    #[test]
    fn failed_starts_back_off_and_a_ready_server_resets_it() {
        let mut p = Policy::default();
        let waits: Vec<u128> = (0..7).map(|_| p.failed().as_millis()).collect();
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 5000, 5000]);
        p.ready();
        assert_eq!(p.failed(), FIRST_BACKOFF);
    }

    /// Rule (issue 13): a ready server that dies is replaced at once; one that was not ready
    /// is retried after the backoff; either way its successor reloads.
    #[test]
    fn a_crash_restarts_at_once_and_an_unready_death_backs_off() {
        let mut p = Policy::default();
        assert_eq!(p.lost(true), Lost { retry_in: None, reload: true });
        assert_eq!(p.lost(false), Lost { retry_in: Some(FIRST_BACKOFF), reload: true });
        assert_eq!(p.ready(), WhenReady { reload: true, upgrade: false });
    }

    /// Rule (issue 13): after two servers in a row died in the middle of a reload, the next
    /// serves the last plan without reloading, until someone sends SIGHUP.
    #[test]
    fn two_deaths_in_a_reload_stop_the_reloads_until_a_sighup() {
        let mut p = Policy::default();
        p.notice(Notice::Reloading);
        assert!(p.lost(true).reload);
        p.ready();
        p.notice(Notice::Reloading);
        assert!(!p.lost(true).reload, "the inputs may be what kills them");
        assert_eq!(p.ready(), WhenReady::default());
        assert_eq!(p.sighup(Phase::Replacing), Reload::OnceServing);
        assert!(p.ready().reload);
        p.notice(Notice::Reloading);
        assert!(p.lost(true).reload, "a SIGHUP tries again");
        // A reload that finishes ends the run.
        let mut q = Policy::default();
        q.notice(Notice::Reloading);
        q.lost(true);
        q.notice(Notice::Reloading);
        q.notice(Notice::Ready);
        q.notice(Notice::Reloading);
        assert!(q.lost(true).reload);
    }

    /// Rule (issue 13, 18): a SIGHUP while no server can reload (starting, or taking over
    /// after a crash) is done once one serves; during an upgrade the old server reloads and the
    /// new one reloads again once it serves.
    #[test]
    fn a_sighup_during_a_takeover_is_done_once_a_server_serves() {
        for phase in [Phase::Starting, Phase::Replacing] {
            let mut p = Policy::default();
            assert_eq!(p.sighup(phase), Reload::OnceServing);
            assert_eq!(p.ready(), WhenReady { reload: true, upgrade: false }, "{phase:?}");
            assert_eq!(p.ready(), WhenReady::default(), "{phase:?}: once");
        }
        let mut p = Policy::default();
        assert_eq!(p.sighup(Phase::Upgrading), Reload::NowAndOnceServing);
        assert!(p.ready().reload);
        assert_eq!(Policy::default().sighup(Phase::Serving), Reload::Now);
    }

    /// Rule (issue 13): SIGUSR2 starts an upgrade from a serving server; during a start or a
    /// takeover it waits for a ready server; during an upgrade it is ignored.
    #[test]
    fn an_upgrade_is_started_deferred_or_ignored_by_phase() {
        let mut p = Policy::default();
        assert_eq!(p.upgrade(Phase::Serving), Upgrade::Start);
        assert_eq!(p.upgrade(Phase::Upgrading), Upgrade::Ignored);
        assert_eq!(p.ready(), WhenReady::default());
        for phase in [Phase::Starting, Phase::Replacing] {
            assert_eq!(p.upgrade(phase), Upgrade::OnceServing);
            assert_eq!(p.ready(), WhenReady { reload: false, upgrade: true });
        }
    }

    /// Rule (issue 13): an upgrade that negotiates other FUSE parameters is refused; after a
    /// crash the replacement takes over anyway (there is no server to keep).
    #[test]
    fn an_upgrade_that_disagrees_on_init_is_refused() {
        assert_eq!(probed(true, false), Probe::TakeOver { differs: false });
        assert_eq!(probed(false, false), Probe::Refuse);
        assert_eq!(probed(true, true), Probe::TakeOver { differs: false });
        assert_eq!(probed(false, true), Probe::TakeOver { differs: true });
    }

    /// Rule (issue 18): a request unanswered for the timeout makes a server hung, unless
    /// replies it sent wait to be passed on: those are passed on first.
    #[test]
    fn replies_are_drained_before_a_server_is_called_hung() {
        let (t0, timeout) = (Instant::now(), Duration::from_secs(1));
        let late = t0 + Duration::from_millis(1500);
        assert_eq!(hang(None, late, timeout, false), Hang::No);
        assert_eq!(hang(Some(t0), t0 + Duration::from_millis(999), timeout, false), Hang::No);
        assert_eq!(hang(Some(t0), late, timeout, true), Hang::WaitForReplies);
        assert_eq!(hang(Some(t0), late, timeout, false), Hang::Hung(t0));
    }

    /// Rule (issue 18): a wake-up more than a heartbeat past its deadline means the keeper was
    /// away; one within it, or before the deadline, does not.
    #[test]
    fn a_late_wake_up_tells_that_the_keeper_was_away() {
        let (d, beat) = (Instant::now(), Duration::from_millis(250));
        assert_eq!(away(None, d + beat * 10, beat), None);
        assert_eq!(away(Some(d), d, beat), None);
        assert_eq!(away(Some(d + beat), d, beat), None);
        assert_eq!(away(Some(d), d + beat, beat), None);
        assert_eq!(away(Some(d), d + beat * 6, beat), Some(beat * 6));
    }
}
