//! The keeper's rules, each driven through [`Machine::handle`] as the keeper feeds it.

use super::machine::FIRST_BACKOFF;
use super::*;
use crate::keeper::control::{Control, PROTOCOL};

const TIMEOUT: Duration = Duration::from_secs(10);

/// A keeper fed events at one instant, `t0`, unless told another.
struct Run {
    m: Machine,
    t0: Instant,
}

impl Run {
    fn new() -> (Run, Vec<Action>) {
        let t0 = Instant::now();
        let (m, first) = Machine::new(TIMEOUT, TIMEOUT, t0);
        (Run { m, t0 }, first)
    }

    fn on(&mut self, event: Event) -> Vec<Action> {
        self.m.handle(event, self.t0)
    }

    fn at(&mut self, later: Duration, event: Event) -> Vec<Action> {
        self.m.handle(event, self.t0 + later)
    }

    /// The first server, epoch 1 (pid 100), ready: the keeper serves.
    fn serving() -> Run {
        let (mut r, _) = Run::new();
        r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
        r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL });
        r.on(Event::Answering(1));
        r.on(Event::Notice(1, Notice::Ready));
        assert_eq!(r.m.phase(), Phase::Serving);
        r
    }

    /// Successor `epoch` (pid `pid`) answers the INIT replay alike and says it is ready.
    fn takes_over(&mut self, epoch: u64, pid: u32) -> Vec<Action> {
        let mut all = self.on(Event::Spawned { epoch, pid, handed_plan: true });
        all.extend(self.on(Event::Loaded { epoch, protocol: PROTOCOL }));
        all.extend(self.on(Event::Probed { epoch, same: true }));
        all.extend(self.on(Event::Answering(epoch)));
        all.extend(self.on(Event::Notice(epoch, Notice::Ready)));
        all
    }
}

fn gone(epoch: u64) -> Event {
    Event::Gone { epoch, status: "signal 9 (SIGKILL)".into() }
}

fn spawns(actions: &[Action]) -> Vec<(u64, Binary, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Spawn { epoch, binary, plan } => Some((*epoch, *binary, *plan)),
            _ => None,
        })
        .collect()
}

fn refusal(actions: &[Action]) -> Option<&str> {
    actions.iter().find_map(|a| match a {
        Action::Tell(1, Control::Refused(why)) => Some(why.as_str()),
        _ => None,
    })
}

/// Rule (issue 13): the first server loads, the keeper mounts, and the mount answering
/// through it writes the pid file before it may declare the daemon ready; its death before
/// that is the command's error, with the error it said.
#[test]
fn the_start_mounts_then_writes_the_pid_file_and_fails_with_the_servers_error() {
    let (mut r, first) = Run::new();
    assert_eq!(first, [Action::Spawn { epoch: 1, binary: Binary::Good, plan: false }]);
    r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
    assert_eq!(r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL }), [Action::Mount(1)]);
    assert_eq!(r.m.hang_checked(), Some(1), "checked once mounted: the kernel's requests go to it");
    assert_eq!(r.on(Event::Answering(1)), [Action::WritePidFile, Action::Tell(1, Control::Proceed)]);
    assert_eq!(r.m.phase(), Phase::Serving);
    // The starter is told once the state file is written (found from outside: told at the
    // pid file, it ran the container though the state file then could not be written).
    assert_eq!(r.on(Event::Notice(1, Notice::Ready)), [Action::Notify(Notice::Ready), Action::SayReady]);
    assert_eq!(r.on(Event::Notice(1, Notice::Ready)), [Action::Notify(Notice::Ready)], "once");

    let (mut r, _) = Run::new();
    r.on(Event::Failed { epoch: 1, why: "spec.json: not JSON".into() });
    assert_eq!(r.on(gone(1)), [Action::Exit(Exit::StartFailed("spec.json: not JSON".into()))]);
    let (mut r, _) = Run::new();
    let exit = r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL + 1 });
    assert!(matches!(&exit[..], [Action::Exit(Exit::StartFailed(why))] if why.contains("protocol")), "{exit:?}");
    let (mut r, _) = Run::new();
    let exit = r.on(Event::SpawnFailed { epoch: 1, why: "ENOMEM".into() });
    assert_eq!(exit, [Action::Exit(Exit::StartFailed("cannot start the server: ENOMEM".into()))]);
}

/// Bug (issue 18, found in CI): a first server that hung once mounted (stopped, or deadlocked,
/// between the mount and its word that the mount answers) was never called hung: the start
/// had no hang check and no bound, so `devremapd mount` and every request waited for ever.
/// Now a request it leaves unanswered for `--server-timeout`, or no word within it of the
/// mount, fails the start (exit 1, nothing left behind); a keeper that was away gets the time
/// back. Before the mount, the load is bounded ([`a_first_load_that_does_not_end_in_time_fails_the_start`]).
#[test]
fn a_first_server_that_hangs_once_mounted_fails_the_start() {
    let loaded = || {
        let (mut r, _) = Run::new();
        r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
        assert_eq!((r.m.deadline(), r.m.hang_checked()), (Some(r.t0 + TIMEOUT), None), "not mounted: its load is due");
        r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL });
        r
    };
    let mut r = loaded();
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT));
    assert_eq!(r.at(TIMEOUT / 2, Event::Tick), [], "not due yet");
    let exit = r.at(TIMEOUT, Event::Tick);
    assert!(
        matches!(&exit[..], [Action::Exit(Exit::StartFailed(why))] if why.contains("server pid 100") && why.contains("10 s of mounting")),
        "{exit:?}"
    );
    assert_eq!(r.m.phase(), Phase::Stopping);

    let mut r = loaded();
    let exit = r.at(TIMEOUT, Event::Hung { epoch: 1, since: r.t0 });
    assert!(
        matches!(&exit[..], [Action::Exit(Exit::StartFailed(why))] if why.contains("unanswered for 10 s while starting")),
        "{exit:?}"
    );

    let mut r = loaded();
    r.at(TIMEOUT * 2, Event::Away);
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT * 3), "the keeper's absence is not the server's");
    assert_eq!(r.at(TIMEOUT * 2, Event::Tick), []);
    r.at(TIMEOUT * 2, Event::Answering(1));
    assert_eq!((r.m.phase(), r.m.deadline()), (Phase::Serving, None), "answered: the start's bound is gone");
}

/// Bug (merge of issues 18 and 21, found by docs/daemon.md's transcript): the first server
/// answers, the pid file is written, and then its state file cannot be written: the start
/// fails with that error (exit 1, as the docs say), not a successor started to take over. A
/// first server that dies after answering without saying why is still replaced.
#[test]
fn a_first_server_that_cannot_declare_ready_fails_the_start() {
    let (mut r, _) = Run::new();
    r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
    r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL });
    r.on(Event::Answering(1));
    let why = "/nonexistent/ctr9.json: cannot write the state file: no such file or directory";
    assert_eq!(r.on(Event::Failed { epoch: 1, why: why.into() }), []);
    assert_eq!(r.on(gone(1)), [Action::Exit(Exit::StartFailed(why.into()))]);
    assert_eq!(r.m.phase(), Phase::Stopping);

    let (mut r, _) = Run::new();
    r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
    r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL });
    r.on(Event::Answering(1));
    r.on(gone(1));
    assert_eq!(r.m.phase(), Phase::Replacing, "a silent death is replaced");
}

/// Rule (issue 13): a ready server that dies is replaced at once, from its binary and with its
/// plan; a successor that dies before it is ready is retried after a backoff of 0.2 s doubling
/// to 5 s; a ready successor ends the run.
#[test]
fn a_crash_restarts_at_once_and_failed_successors_back_off() {
    let mut r = Run::serving();
    let died = r.on(gone(1));
    assert_eq!(spawns(&died), [(2, Binary::Good, true)]);
    assert!(died.contains(&Action::Lost(1)));
    assert_eq!(r.m.phase(), Phase::Replacing);
    let mut waits = Vec::new();
    let mut epoch = 2;
    for _ in 0..7 {
        let failed = r.on(gone(epoch));
        assert_eq!(spawns(&failed), [], "not at once");
        let due = r.m.deadline().expect("a restart is due");
        waits.push(due.duration_since(r.t0).as_millis());
        assert_eq!(r.at(due - r.t0 - Duration::from_millis(1), Event::Tick), [], "not before it is due");
        epoch += 1;
        assert_eq!(spawns(&r.at(due - r.t0, Event::Tick)), [(epoch, Binary::Good, true)]);
    }
    assert_eq!(waits, [200, 400, 800, 1600, 3200, 5000, 5000]);
    r.takes_over(epoch, 200);
    assert_eq!(r.m.phase(), Phase::Serving);
    r.on(gone(epoch));
    epoch += 1;
    r.on(gone(epoch));
    assert_eq!(r.m.deadline(), Some(r.t0 + FIRST_BACKOFF), "a ready server ended the run");
}

/// Rule (issue 13): a successor that has not taken over within `--reload-timeout` is killed
/// and the next is due after the backoff; the successor's log line names the dead server.
#[test]
fn a_successor_that_does_not_take_over_in_time_is_killed() {
    let mut r = Run::serving();
    r.on(gone(1));
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: true });
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT));
    let late = r.at(TIMEOUT, Event::Tick);
    assert!(late.contains(&Action::Kill(2)), "{late:?}");
    r.at(TIMEOUT + FIRST_BACKOFF, Event::Tick);
    r.on(Event::Spawned { epoch: 3, pid: 300, handed_plan: true });
    r.on(Event::Loaded { epoch: 3, protocol: PROTOCOL });
    let from = "from server pid 100 (it died; serving its plan)".to_owned();
    assert_eq!(r.on(Event::Probed { epoch: 3, same: true }), [Action::TakeOver { epoch: 3, retire: None, from }]);
}

/// Rule (issue 13): after two servers in a row died in the middle of a reload, the next serves
/// the last plan without reloading, until someone sends SIGHUP; a reload that finishes ends
/// the run. (The relay's rule for a request in flight at three deaths is `relay::MAX_DEATHS`.)
#[test]
fn two_deaths_in_a_reload_stop_the_reloads_until_a_sighup() {
    let mut r = Run::serving();
    r.on(Event::Notice(1, Notice::Reloading));
    r.on(gone(1));
    assert_eq!(r.takes_over(2, 200).last(), Some(&Action::Reload(2)), "the reload is not lost");
    r.on(Event::Notice(2, Notice::Reloading));
    let second = r.on(gone(2));
    assert!(second.iter().any(|a| matches!(a, Action::Warn(w) if w.contains("two servers in a row"))), "{second:?}");
    assert!(!r.takes_over(3, 300).iter().any(|a| matches!(a, Action::Reload(_))), "the inputs may kill them");
    assert_eq!(r.on(Event::Sighup), [Action::Reload(3)], "a SIGHUP tries again");
    r.on(Event::Notice(3, Notice::Reloading));
    r.on(gone(3));
    assert!(r.takes_over(4, 400).contains(&Action::Reload(4)));
    // A reload that finishes ends the run: one death in a reload, one finished, one more death.
    let mut r = Run::serving();
    r.on(Event::Notice(1, Notice::Reloading));
    r.on(gone(1));
    r.takes_over(2, 200);
    r.on(Event::Notice(2, Notice::Reloading));
    r.on(Event::Notice(2, Notice::Ready));
    r.on(Event::Notice(2, Notice::Reloading));
    r.on(gone(2));
    assert!(r.takes_over(3, 300).contains(&Action::Reload(3)));
}

/// Rule (issue 13, 18): a SIGHUP while no server can reload (starting, taking over after a
/// crash, or taken over and not yet ready) is done once, when one is ready, and said once (a
/// flood of signals wrote a line each); during an upgrade the old server reloads now and the
/// new one once more when it serves.
#[test]
fn a_sighup_during_a_takeover_is_done_once_a_server_serves() {
    let (mut r, _) = Run::new();
    r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
    assert!(matches!(&r.on(Event::Sighup)[..], [Action::Info(_)]));
    assert_eq!(r.on(Event::Sighup), [], "said once");
    r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL });
    r.on(Event::Answering(1));
    assert_eq!(
        r.on(Event::Notice(1, Notice::Ready)),
        [Action::Notify(Notice::Ready), Action::SayReady, Action::Reload(1)]
    );
    assert_eq!(r.on(Event::Notice(1, Notice::Ready)), [Action::Notify(Notice::Ready)], "once");

    let mut r = Run::serving();
    r.on(Event::Notice(1, Notice::Ready));
    r.on(gone(1));
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: true });
    // The crash made a reload due (its server may have died in one): the signal adds nothing
    // to say, however many come.
    assert_eq!(r.on(Event::Sighup), [], "replacing");
    r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL });
    r.on(Event::Probed { epoch: 2, same: true });
    assert_eq!(r.on(Event::Sighup), [], "taken over, not ready: done once");
    let ready = r.on(Event::Notice(2, Notice::Ready));
    assert_eq!(ready.iter().filter(|a| **a == Action::Reload(2)).count(), 1, "{ready:?}");

    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    assert_eq!(r.on(Event::Sighup), [Action::Reload(1)], "the old server reloads now");
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false });
    r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL });
    r.on(Event::Probed { epoch: 2, same: true });
    r.on(Event::Answering(2));
    assert!(r.on(Event::Notice(2, Notice::Ready)).contains(&Action::Reload(2)), "and the new one once it serves");
}

/// Rule (issue 13): SIGUSR2 starts the binary at the keeper's path from a ready server; while a
/// server starts it waits for one to be ready; during an upgrade it waits for the upgrade's end
/// ([`an_upgrade_asked_during_an_upgrade_follows_it`]); once stopping it does nothing.
#[test]
fn an_upgrade_is_started_deferred_or_ignored_by_phase() {
    let mut r = Run::serving();
    assert_eq!(spawns(&r.on(Event::Sigusr2)), [(2, Binary::Path, false)]);
    assert_eq!(r.m.phase(), Phase::Upgrading);
    assert!(matches!(&r.on(Event::Sigusr2)[..], [Action::Info(_)]));
    let (mut r, _) = Run::new();
    r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false });
    assert_eq!(spawns(&r.on(Event::Sigusr2)), []);
    r.on(Event::Loaded { epoch: 1, protocol: PROTOCOL });
    r.on(Event::Answering(1));
    assert_eq!(spawns(&r.on(Event::Notice(1, Notice::Ready))), [(2, Binary::Path, false)]);
}

/// Rule (issue 13, 18): an upgrade whose server probes alike takes over from the old one, which
/// retires first; one that negotiates other FUSE parameters, speaks another keeper protocol,
/// cannot be started, exits, or does not load in time is refused, and the old server, told why
/// (its `last_error`), serves on. After a crash a replacement that differs serves anyway.
#[test]
fn an_upgrade_is_accepted_or_refused() {
    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false });
    assert_eq!(r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL }), [Action::Probe(2)]);
    let from = "from server pid 100 (an upgrade)".to_owned();
    assert_eq!(r.on(Event::Probed { epoch: 2, same: true }), [Action::TakeOver { epoch: 2, retire: Some(1), from }]);
    assert_eq!((r.m.phase(), r.m.current()), (Phase::Serving, Some(2)));

    let refused = |events: Vec<Event>| {
        let mut r = Run::serving();
        r.on(Event::Sigusr2);
        let mut actions = Vec::new();
        for event in events {
            actions = r.on(event);
        }
        assert_eq!((r.m.phase(), r.m.current()), (Phase::Serving, Some(1)), "{actions:?}");
        refusal(&actions).expect("refused").to_owned()
    };
    let spawned = Event::Spawned { epoch: 2, pid: 200, handed_plan: false };
    let loaded = Event::Loaded { epoch: 2, protocol: PROTOCOL };
    let other = refused(vec![spawned.clone(), Event::Loaded { epoch: 2, protocol: 7 }]);
    assert!(other.contains("protocol 7") && other.contains(&format!("protocol {PROTOCOL}")), "{other}");
    assert!(refused(vec![spawned.clone(), loaded, Event::Probed { epoch: 2, same: false }]).contains("FUSE"));
    assert!(refused(vec![Event::SpawnFailed { epoch: 2, why: "/x: ENOENT".into() }]).contains("/x: ENOENT"));
    let failed = Event::Failed { epoch: 2, why: "spec.json: bad".into() };
    assert!(refused(vec![spawned.clone(), failed, gone(2)]).contains("spec.json: bad"));
    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    assert!(refusal(&r.at(TIMEOUT, Event::Tick)).is_some_and(|w| w.contains("within 10 s")));

    let mut r = Run::serving();
    r.on(gone(1));
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: true });
    r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL });
    let differs = r.on(Event::Probed { epoch: 2, same: false });
    assert!(matches!(&differs[..], [Action::Warn(_), Action::TakeOver { retire: None, .. }]), "{differs:?}");
}

/// Rule (issue 18): a server that sends more than the keeper keeps (a plan over `MAX_PLAN`)
/// is treated as failed while it is a successor: an upgrade's is killed and refused with the
/// reason (the old server serves on), a crash successor's is killed and the next is due after
/// the backoff. The current server serves on (the driver forgets its plan), with a warning.
#[test]
fn a_server_that_sends_too_much_is_failed_as_a_successor_and_serves_on_as_current() {
    let why = HandoverError::TooLarge { limit: crate::keeper::control::MAX_PLAN };
    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false });
    let refused = r.on(Event::Overrun { epoch: 2, why: why.clone() });
    assert!(refused.contains(&Action::Kill(2)), "{refused:?}");
    assert_eq!(refusal(&refused), Some(format!("upgrade refused: the new server {why}").as_str()));
    assert_eq!((r.m.phase(), r.m.current()), (Phase::Serving, Some(1)));
    assert_eq!(r.on(Event::Probed { epoch: 2, same: true }), [], "the killed one never takes over");

    let current = r.on(Event::Overrun { epoch: 1, why: why.clone() });
    assert!(matches!(&current[..], [Action::Warn(w)] if w.contains("server pid 100 sent a plan")), "{current:?}");
    assert_eq!((r.m.phase(), r.m.current()), (Phase::Serving, Some(1)), "it serves on");

    r.on(gone(1));
    r.on(Event::Spawned { epoch: 3, pid: 300, handed_plan: true });
    let crash = r.on(Event::Overrun { epoch: 3, why });
    assert!(crash.contains(&Action::Kill(3)), "{crash:?}");
    assert_eq!((r.m.phase(), spawns(&crash)), (Phase::Replacing, vec![]), "the next after the backoff");
    assert_eq!(spawns(&r.at(MAX_BACKOFF, Event::Tick)), [(4, Binary::Good, true)]);
}

/// Bug (issue 18, found from outside): a keeper stopped (`SIGSTOP`) past an upgrade's
/// `--reload-timeout` and continued refused the upgrade as "did not load its inputs within N
/// s", two times in five, though the new server had loaded long before: its `Loaded` waited
/// unread while the keeper was stopped, and the deadline passed first. Now the time the keeper
/// was away ([`Event::Away`]) gives a successor a new `--reload-timeout`.
#[test]
fn the_time_the_keeper_was_away_is_not_the_successors() {
    let late = Duration::from_secs(3);
    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false });
    r.at(TIMEOUT + late, Event::Away);
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT + late + TIMEOUT), "a new --reload-timeout");
    assert_eq!(r.at(TIMEOUT + late, Event::Tick), [], "not given up on");
    assert_eq!(r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL }), [Action::Probe(2)]);
    let overdue = r.at(TIMEOUT + late + TIMEOUT, Event::Tick);
    assert!(refusal(&overdue).is_some_and(|w| w.contains("within 10 s")), "then it is: {overdue:?}");

    let mut r = Run::serving();
    r.on(gone(1));
    r.at(late, Event::Away);
    assert_eq!(r.m.deadline(), Some(r.t0 + late + TIMEOUT), "a crash successor's too");
    r.on(Event::Away);
    assert_eq!(r.m.deadline(), Some(r.t0 + late + TIMEOUT), "never earlier");
}

/// Rule: a SIGUSR2 during an upgrade makes one more upgrade after it, however many come, as
/// SIGHUPs during a reload do: the binary at the path may have been replaced again since the
/// upgrade's server was started (two package upgrades in a row), and the last SIGUSR2 must end
/// with that binary serving (before, it was ignored, and the keeper served on from the binary
/// in between). After an upgrade that took over, once the new server is ready; after one that
/// was refused, at once. Asked many times meanwhile, it is said once (a `SIGUSR2` flood wrote a
/// line each).
#[test]
fn an_upgrade_asked_during_an_upgrade_follows_it() {
    let mut r = Run::serving();
    assert_eq!(spawns(&r.on(Event::Sigusr2)), [(2, Binary::Path, false)]);
    assert!(matches!(&r.on(Event::Sigusr2)[..], [Action::Info(_)]), "deferred, and said");
    for _ in 0..3 {
        assert_eq!(r.on(Event::Sigusr2), [], "coalesced, and said once: a flood writes no line each");
    }
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false });
    r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL });
    r.on(Event::Probed { epoch: 2, same: true });
    r.on(Event::Answering(2));
    assert_eq!(spawns(&r.on(Event::Notice(2, Notice::Ready))), [(3, Binary::Path, false)], "once more");
    assert_eq!(r.m.phase(), Phase::Upgrading);

    r.on(Event::Sigusr2);
    r.on(Event::Spawned { epoch: 3, pid: 300, handed_plan: false });
    r.on(Event::Loaded { epoch: 3, protocol: PROTOCOL });
    let refused = r.on(Event::Probed { epoch: 3, same: false });
    let told = refused.iter().any(|a| matches!(a, Action::Tell(2, Control::Refused(_))));
    assert!(told && refused.contains(&Action::Kill(3)), "{refused:?}");
    assert_eq!(spawns(&refused), [(4, Binary::Path, false)], "the one asked meanwhile is tried at once");
    let refused = r.on(Event::Probed { epoch: 4, same: false });
    assert_eq!(spawns(&refused), [], "and once only");
    assert_eq!((r.m.phase(), r.m.current()), (Phase::Serving, Some(2)));
}

/// Rule (issue 13): a server that dies during an upgrade is replaced from its own binary and
/// plan; the untried upgrade is dropped, and the warning names it by its pid once known.
#[test]
fn a_death_during_an_upgrade_drops_it() {
    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false });
    let died = r.on(gone(1));
    assert!(died.contains(&Action::Kill(2)), "{died:?}");
    assert_eq!(spawns(&died), [(3, Binary::Good, true)]);
    assert_eq!(r.on(Event::Probed { epoch: 2, same: true }), [], "the dropped one never takes over");

    // Found from outside: one whose spawn had not returned was named "server pid 0".
    let mut r = Run::serving();
    r.on(Event::Sigusr2);
    let died = r.on(gone(1));
    let said = died.iter().find_map(|a| match a {
        Action::Warn(w) if w.starts_with("upgrade abandoned") => Some(w.as_str()),
        _ => None,
    });
    assert_eq!(said, Some("upgrade abandoned: the serving server died while its successor was starting"), "{died:?}");
}

/// Rule (issue 18): the server requests go to is checked for a hang once it took over, ready or
/// not (a successor is sent the requests in flight at once); a hung one is killed and replaced
/// as a dead one is: at once if it was ready, after the backoff if not.
#[test]
fn a_hung_server_is_killed_and_replaced_ready_or_not() {
    let mut r = Run::serving();
    assert_eq!(r.m.hang_checked(), Some(1));
    let hung = r.on(Event::Hung { epoch: 1, since: r.t0 });
    assert!(hung.contains(&Action::Kill(1)) && hung.contains(&Action::Lost(1)), "{hung:?}");
    assert_eq!(spawns(&hung), [(2, Binary::Good, true)]);
    assert_eq!(r.m.hang_checked(), None, "nothing takes requests while a successor starts");
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: true });
    r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL });
    let taken = r.on(Event::Probed { epoch: 2, same: true });
    assert!(matches!(&taken[..], [Action::TakeOver { from, .. }] if from.contains("pid 100 (it hung")), "{taken:?}");
    assert_eq!(r.m.hang_checked(), Some(2), "taken over, not ready: checked");
    let hung = r.on(Event::Hung { epoch: 2, since: r.t0 });
    assert!(hung.contains(&Action::Kill(2)));
    assert_eq!(spawns(&hung), [], "it was not ready: after the backoff");
    assert_eq!(r.m.deadline(), Some(r.t0 + FIRST_BACKOFF));
    assert_eq!(r.on(Event::Hung { epoch: 2, since: r.t0 }), [], "once");
}

/// Rule (issue 18): a request unanswered for the timeout makes a server hung, unless replies it
/// sent wait to be passed on: those are passed on first.
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

/// Rule (issue 18): a stop in any phase logs why, tells systemd and exits, with the current
/// server still known, to be told to stop (a first draft forgot it, and the server was only
/// killed: `lifecycle::a_forced_unmount_of_a_busy_mount_fails_the_daemon` found its state file
/// left); from then on nothing starts, kills or reloads anything.
#[test]
fn a_stop_in_each_phase_ends_everything() {
    let starting = Run::new().0;
    let serving = Run::serving();
    let mut replacing = Run::serving();
    replacing.on(gone(1));
    let mut upgrading = Run::serving();
    upgrading.on(Event::Sigusr2);
    for (mut r, phase, current) in [
        (starting, Phase::Starting, Some(1)),
        (serving, Phase::Serving, Some(1)),
        (replacing, Phase::Replacing, None),
        (upgrading, Phase::Upgrading, Some(1)),
    ] {
        assert_eq!(r.m.phase(), phase);
        let stop = r.on(Event::Stop("signal SIGTERM".into()));
        let expected = [
            Action::Info("signal SIGTERM: stopping".into()),
            Action::Notify(Notice::Stopping),
            Action::Exit(Exit::Stop),
        ];
        assert_eq!(stop, expected, "{phase:?}");
        assert_eq!(r.m.phase(), Phase::Stopping);
        assert_eq!(r.m.current(), current, "{phase:?}: the server told to stop (it removes the state file)");
        for event in [gone(1), gone(2), Event::Sighup, Event::Sigusr2, Event::Tick, Event::KernelEnded] {
            assert_eq!(r.at(TIMEOUT * 10, event.clone()), [], "{phase:?}: {event:?}");
        }
        assert_eq!((r.m.deadline(), r.m.hang_checked()), (None, None));
    }
    let mut r = Run::serving();
    assert_eq!(r.on(Event::KernelEnded), [Action::Exit(Exit::Ended)]);
}

/// Bug (found from outside): a first server whose inputs never loaded (the spec's bind source
/// on a stopped FUSE mount) kept the keeper and itself for good, with nothing to end them once
/// whoever asked for the mount had gone: the first server must be mounted (its inputs loaded)
/// within `--reload-timeout` of the start, as a successor must take over, or the start fails.
#[test]
fn a_first_load_that_does_not_end_in_time_fails_the_start() {
    let (mut r, _) = Run::new();
    assert_eq!(r.on(Event::Spawned { epoch: 1, pid: 100, handed_plan: false }), []);
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT), "the first server's load is bounded");
    assert_eq!(r.at(TIMEOUT / 2, Event::Tick), []);
    let exit = r.at(TIMEOUT, Event::Tick);
    let why = "server pid 100 did not load its inputs within 10 s (an input on a stuck filesystem?)";
    assert_eq!(exit, [Action::Exit(Exit::StartFailed(why.into()))]);
}

/// Rule (issue 31): the keeper never waits on a spawn. A server whose spawn has not returned
/// within `--reload-timeout` (a child stopped between fork and exec) failed to start, as one
/// whose spawn failed: the first fails the command, an upgrade's is refused (the old server
/// serves on, and is told why), a crash successor's is retried after the backoff. Signals are
/// taken meanwhile, and a spawn that returns once abandoned starts nothing.
#[test]
fn a_spawn_that_does_not_return_in_time_is_a_failed_start() {
    let not_started = "did not start within 10 s (stopped between fork and exec?)";
    let (mut r, _) = Run::new();
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT), "the first server's spawn is bounded");
    assert_eq!(r.at(TIMEOUT / 2, Event::Tick), []);
    r.at(TIMEOUT * 2, Event::Away);
    assert_eq!(r.m.deadline(), Some(r.t0 + TIMEOUT * 3), "the keeper's absence is not the spawn's");
    let exit = r.at(TIMEOUT * 3, Event::Tick);
    assert_eq!(exit, [Action::Exit(Exit::StartFailed(format!("cannot start the server: it {not_started}")))]);

    let mut r = Run::serving();
    assert_eq!(spawns(&r.on(Event::Sigusr2)), [(2, Binary::Path, false)]);
    assert_eq!(r.on(Event::Sighup), [Action::Reload(1)], "signals are served while it spawns");
    let refused = r.at(TIMEOUT, Event::Tick);
    assert!(refused.contains(&Action::Kill(2)), "abandoned: {refused:?}");
    assert_eq!(refusal(&refused), Some(format!("upgrade refused: the new server {not_started}").as_str()));
    assert_eq!((r.m.phase(), r.m.current()), (Phase::Serving, Some(1)));
    assert_eq!(r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: false }), [], "returned too late");
    assert_eq!((r.m.knows(2), r.m.current()), (false, Some(1)), "the driver kills it");
    assert_eq!(spawns(&r.on(Event::Sigusr2)), [(3, Binary::Path, false)], "the next upgrade starts another");

    let mut r = Run::serving();
    r.on(gone(1));
    let late = r.at(TIMEOUT, Event::Tick);
    assert!(late.contains(&Action::Kill(2)), "{late:?}");
    assert!(late.iter().any(|a| matches!(a, Action::Warn(w) if w.contains(not_started))), "{late:?}");
    assert_eq!(r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: true }), []);
    assert!(!r.m.knows(2));
    assert_eq!(spawns(&r.at(TIMEOUT + FIRST_BACKOFF, Event::Tick)), [(3, Binary::Good, true)], "retried");
    assert_eq!(r.on(Event::Stop("signal SIGTERM".into())).last(), Some(&Action::Exit(Exit::Stop)));
}

/// Rule (issue 31, `--rest-after`): a ready server with nothing under way rests when idle, and
/// the next request wakes one from the same binary with its plan, which takes over quietly (no
/// warning: nothing failed) naming the rested server.
#[test]
fn an_idle_server_rests_and_a_request_wakes_another_with_its_plan() {
    let mut r = Run::serving();
    assert_eq!(r.m.may_rest(), Some(1));
    assert_eq!(r.on(Event::Idle), vec![Action::Rest(1)]);
    assert_eq!(r.m.phase(), Phase::Resting);
    assert_eq!((r.m.current(), r.m.may_rest(), r.m.deadline(), r.m.hang_checked()), (None, None, None, None));
    // The rested server's exit is the driver's to reap.
    assert!(!r.m.knows(1));
    assert!(r.on(gone(1)).is_empty());
    assert!(r.on(Event::Idle).is_empty(), "nothing runs to rest");
    let woke = r.on(Event::Wanted);
    assert_eq!(spawns(&woke), vec![(2, Binary::Good, true)]);
    assert!(!woke.iter().any(|a| matches!(a, Action::Warn(_))), "{woke:?}");
    assert_eq!(r.m.phase(), Phase::Replacing);
    let took = r.takes_over(2, 200);
    let from = took.iter().find_map(|a| match a {
        Action::TakeOver { epoch: 2, retire: None, from } => Some(from.clone()),
        _ => None,
    });
    assert_eq!(from.as_deref(), Some("from server pid 100 (it rested; serving its plan)"));
    assert!(!took.iter().any(|a| matches!(a, Action::Warn(_) | Action::Reload(_))), "{took:?}");
    assert_eq!((r.m.phase(), r.m.may_rest()), (Phase::Serving, Some(2)));
    assert!(r.on(Event::Wanted).is_empty(), "a request while serving wakes nothing");
}

/// Rule: a server with a reload asked of it (before its `RELOADING=1` comes), reloading, or
/// with a reload or an upgrade due, does not rest: its reload would be lost with it.
#[test]
fn a_server_with_a_reload_under_way_does_not_rest() {
    let mut r = Run::serving();
    assert_eq!(r.on(Event::Sighup), vec![Action::Reload(1)]);
    assert_eq!(r.m.may_rest(), None, "asked, not yet said RELOADING=1");
    assert!(r.on(Event::Idle).is_empty());
    r.on(Event::Notice(1, Notice::Reloading));
    assert!(r.on(Event::Idle).is_empty());
    r.on(Event::Notice(1, Notice::Ready));
    assert_eq!(r.on(Event::Idle), vec![Action::Rest(1)]);
    // A server not yet ready (one that took over, before its READY=1) does not rest either.
    let mut r = Run::serving();
    r.on(Event::Idle);
    r.on(Event::Wanted);
    r.on(Event::Spawned { epoch: 2, pid: 200, handed_plan: true });
    r.on(Event::Loaded { epoch: 2, protocol: PROTOCOL });
    r.on(Event::Probed { epoch: 2, same: true });
    assert_eq!((r.m.phase(), r.m.may_rest()), (Phase::Serving, None));
    assert!(r.on(Event::Idle).is_empty());
}

/// Rule: `SIGHUP` or `SIGUSR2` while resting wakes a server, which reloads (or is upgraded)
/// once it serves, as for one that starts; a stop while resting has no server to stop.
#[test]
fn a_signal_while_resting_wakes_a_server_that_then_does_it() {
    let mut r = Run::serving();
    r.on(Event::Idle);
    let woke = r.on(Event::Sighup);
    assert_eq!(spawns(&woke), vec![(2, Binary::Good, true)]);
    assert!(!woke.iter().any(|a| matches!(a, Action::Info(_))), "no line for a reload deferred by a rest: {woke:?}");
    let took = r.takes_over(2, 200);
    assert!(took.contains(&Action::Reload(2)), "{took:?}");

    let mut r = Run::serving();
    r.on(Event::Idle);
    assert_eq!(spawns(&r.on(Event::Sigusr2)), vec![(2, Binary::Good, true)]);
    let took = r.takes_over(2, 200);
    assert_eq!(spawns(&took), vec![(3, Binary::Path, false)], "upgraded once it serves");

    let mut r = Run::serving();
    r.on(Event::Idle);
    assert_eq!(r.on(Event::Stop("signal SIGTERM".into())).last(), Some(&Action::Exit(Exit::Stop)));
    assert_eq!(r.m.current(), None, "no server to tell to stop");
}

/// Bug (found from outside): a `SIGHUP` and a `SIGUSR2` that came together while no server was
/// ready (a resting mount woken by them, or a server starting) asked the woken server to
/// reload and then upgraded it: its retirement ended the reload, and no server made it. Rule:
/// the reload is one during the upgrade, made once more by the server that takes over.
#[test]
fn a_reload_and_an_upgrade_due_together_end_with_the_new_servers_reload() {
    for upgrade_first in [false, true] {
        let mut r = Run::serving();
        r.on(Event::Idle);
        let (first, second) =
            if upgrade_first { (Event::Sigusr2, Event::Sighup) } else { (Event::Sighup, Event::Sigusr2) };
        r.on(first);
        r.on(second);
        let woke = r.takes_over(2, 200);
        assert_eq!(spawns(&woke), vec![(3, Binary::Path, false)], "{woke:?}");
        assert!(woke.contains(&Action::Reload(2)), "the old server reloads now: {woke:?}");
        r.on(Event::Spawned { epoch: 3, pid: 300, handed_plan: false });
        r.on(Event::Loaded { epoch: 3, protocol: PROTOCOL });
        r.on(Event::Probed { epoch: 3, same: true });
        r.on(Event::Answering(3));
        let ready = r.on(Event::Notice(3, Notice::Ready));
        assert!(ready.contains(&Action::Reload(3)), "the new server reloads once more: {ready:?}");
    }
}
