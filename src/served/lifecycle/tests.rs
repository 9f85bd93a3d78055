//! The lifecycle's rules, each on a fake world that records what the machine did to it.

use super::*;
use crate::decision::plan::Plan;
use crate::decision::tree::{Node, Tree, TreeBuilder};
use crate::device::{Access, DevKind, Rdev};
use std::cell::RefCell;
use std::io;
use std::rc::Rc;

/// Everything the machine did to the world, in order.
#[derive(Debug, Default)]
struct World {
    loads: Vec<u64>,
    ended: Vec<u64>,
    published: Vec<(u64, Option<String>, usize)>,
    resting: Vec<bool>,
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
    fn load_ended(&mut self, id: u64) {
        self.0.borrow_mut().ended.push(id);
    }
    fn publish(&mut self, s: &Status<'_>) -> Result<(), PublishError> {
        let mut w = self.0.borrow_mut();
        if w.fail_publish {
            let source = io::Error::from_raw_os_error(libc::ENOSPC);
            return Err(PublishError::StateFile { path: "state.json".into(), source });
        }
        w.published.push((s.generation, s.last_error.map(str::to_owned), s.retired_nodes));
        w.reloads.push(s.reloads);
        w.resting.push(s.resting);
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
        parts: Default::default(),
        tree: b.build(),
        warnings: vec![],
        tpus: vec![],
        driver_version: None,
        checks: vec![],
        mixed_input: Default::default(),
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

/// A machine serving `loaded(5)`, not yet ready, whose state file cannot be written.
fn unpublishable() -> (Lifecycle<Fake, Fake>, Fake) {
    let first = loaded(5);
    let devfs = Arc::new(Devfs::new(tree(&first)));
    let world = Fake::default();
    world.0.borrow_mut().fail_publish = true;
    (Lifecycle::new(devfs, first, Duration::from_secs(10), world.clone(), world.clone()), world)
}

/// Rule: a state that cannot be published fails the start; nothing is declared ready.
#[test]
fn unpublishable_state_fails_the_start() {
    let (mut lc, world) = unpublishable();
    assert_eq!(lc.ready().unwrap_err().to_string(), "state.json: cannot write the state file: no space left on device");
    assert_eq!(lc.state(), State::Starting);
    assert!(world.0.borrow().notices.is_empty());
}

/// Bug (found from outside, issue 13): a server that took over after a crash died when its
/// state file could not be written (a full `/run`), and so did every successor. Now, the
/// daemon having been ready long before, it is logged and the server serves on.
#[test]
fn unpublishable_state_does_not_stop_a_server_that_took_over() {
    let (mut lc, world) = unpublishable();
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

/// Rule (issue 31, `--rest-after`): a server the keeper rests says so in its state (no server
/// runs) once, and ends as a session that ended does (its state file stays); only then.
#[test]
fn a_rest_publishes_that_no_server_runs_and_ends_serving() {
    let (mut lc, world, _) = ready();
    assert_eq!(world.0.borrow().resting, [false]);
    assert!(matches!(lc.handle([Event::Rest]), Some(End::Ended(Ok(())))));
    assert_eq!(world.0.borrow().resting, [false, true]);
    assert_eq!(lc.state(), State::Stopping);
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
/// its late result is dropped, never applied over a newer state; the session hears that its
/// worker has ended all the same (its thread is joined then: found from outside, it was not).
#[test]
fn abandoned_reload_result_is_dropped() {
    let (mut lc, world, devfs) = ready();
    lc.handle([Event::Reload]);
    assert!(lc.deadline().is_some());
    lc.expire();
    assert_eq!(lc.deadline(), None);
    assert_eq!(lc.state(), State::Serving);
    assert!(world.0.borrow().published.last().unwrap().1.as_deref().unwrap().starts_with("reload abandoned"));
    assert!(world.0.borrow().ended.is_empty(), "the abandoned worker is still loading");
    lc.handle([Event::Loaded(1, ok(loaded(9)))]);
    assert_eq!(world.0.borrow().ended, [1], "the late result's worker has ended");
    assert_eq!(devfs.snapshot().generation, 1, "the late result is not served");
    assert_eq!(devfs.snapshot().tree.get("nvidia0"), loaded(5).plan.tree.get("nvidia0"));
}

/// Rule: a reload asked for that was abandoned is made again, once, when the abandoned one's
/// input answers after all (its late result comes back): a `SIGHUP` sent while a filesystem
/// hung is not lost (before, the table stayed old, and `last_error` said the
/// reload was abandoned, until another `SIGHUP`). If that reload is abandoned in turn, its
/// own late result starts none.
#[test]
fn an_abandoned_reload_is_made_again_when_its_input_answers() {
    let (mut lc, world, devfs) = ready();
    lc.handle([Event::Reload]);
    lc.expire();
    lc.handle([Event::Loaded(1, ok(loaded(7)))]);
    assert_eq!(world.0.borrow().loads, [1, 2], "the reload is made anew");
    assert_eq!(lc.state(), State::Reloading);
    lc.handle([Event::Loaded(2, ok(loaded(9)))]);
    assert_eq!(devfs.snapshot().generation, 2);
    assert_eq!(devfs.snapshot().tree.get("nvidia0"), loaded(9).plan.tree.get("nvidia0"));
    assert_eq!(world.0.borrow().published.last().unwrap().1, None, "the abandonment is no longer the last error");

    // The remade reload abandoned in turn: once is all.
    lc.handle([Event::Reload]);
    lc.expire();
    lc.handle([Event::Loaded(3, ok(loaded(7)))]);
    assert_eq!(world.0.borrow().loads, [1, 2, 3, 4]);
    lc.expire();
    lc.handle([Event::Loaded(4, ok(loaded(7)))]);
    assert_eq!(world.0.borrow().loads, [1, 2, 3, 4], "no third try");
    assert_eq!(lc.state(), State::Serving);
}

/// Rule: nothing is owed once a reload asked for later has been made: an abandoned reload's
/// late result after that starts none.
#[test]
fn a_later_reload_settles_what_an_abandoned_one_owed() {
    let (mut lc, world, _) = ready();
    lc.handle([Event::Reload]);
    lc.expire();
    lc.handle([Event::Reload]);
    lc.handle([Event::Loaded(2, ok(loaded(9)))]);
    lc.handle([Event::Loaded(1, ok(loaded(7)))]);
    assert_eq!(world.0.borrow().loads, [1, 2]);
    assert_eq!(lc.state(), State::Serving);
}

/// Rule: while four abandoned reloads are still blocked, no fifth starts; one that comes
/// back frees a place, and the reload refused meanwhile is made then (it was asked for).
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
    // The refused reload is made as soon as one comes back and frees a place.
    lc.handle([Event::Loaded(2, refused())]);
    assert_eq!(world.0.borrow().loads, [1, 2, 3, 4, 5]);
    lc.handle([Event::Loaded(5, ok(loaded(9)))]);
    assert_eq!(world.0.borrow().published.last().unwrap().1, None, "the refusal is no longer the last error");
    lc.handle([Event::Reload]);
    assert_eq!(world.0.borrow().loads, [1, 2, 3, 4, 5, 6]);
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
