//! The keeper's relay as a state machine: which server a kernel request goes to, which
//! requests are in flight, what a server's message becomes, and what a new server is handed
//! when it takes over. The keeper (`mountd/keeper/`) does the reading and writing; every
//! decision is made here, and unit-tested without a mount.
//!
//! Servers are numbered by *epoch*. At most one is *current* (answers the kernel); another may
//! be *replacing* it (a restart after a crash, or an upgrade). A replacement is first sent the
//! kernel's INIT again (a *probe*: fuser cannot adopt a connection that is already initialised),
//! and its reply, which must equal the first server's, is swallowed. Then, in [`Relay::switch`],
//! it is handed the node table ([`Resume`]) and every request still in flight, and becomes
//! current. While no server is current, or while an upgrade lets the old server finish
//! ([`Relay::hold`]), requests wait here.
//!
//! Assumptions: every request devremap answers is idempotent, so a request answered by a server
//! that then died, and sent again to its successor, is answered twice at worst (the kernel
//! refuses the second reply with ENOENT, and the keeper takes back what it counted for it). A
//! request that has been in flight at [`MAX_DEATHS`] server deaths is answered EIO by the
//! keeper instead of being sent a fourth time: it may be what kills them.

use crate::keeper::control::Resume;
use crate::keeper::fuse_wire::{self, Reply, Request, WireError};
use crate::keeper::kernel_nodes::Held;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Server deaths a request may be in flight for before the keeper gives up on it.
pub const MAX_DEATHS: u32 = 3;

/// A request the kernel waits for an answer to.
#[derive(Debug)]
struct Pending {
    msg: Vec<u8>,
    /// When it was written to a server (`None`: waiting here while no server takes requests).
    sent: Option<Instant>,
    /// Servers that died while it was sent to them.
    deaths: u32,
}

/// What to do with a message read from `/dev/fuse`.
#[derive(Debug, PartialEq, Eq)]
pub enum FromKernel {
    /// Write it to the server of this epoch.
    Forward(u64),
    /// Kept in flight; it goes to the next server that takes over.
    Held,
    /// Nothing to do (a FORGET while no server takes requests: the node table has it).
    Dropped,
}

/// What to do with a message read from a server.
#[derive(Debug, PartialEq, Eq)]
pub enum FromServer {
    /// Write it to `/dev/fuse`; if the kernel refuses it, [`Relay::undo`] these references.
    ToKernel(Vec<u64>),
    /// The reply to a probe: whether the server agreed with the first one on INIT.
    Probed { epoch: u64, same: bool },
    /// Drop it: from a server that no longer answers (its request went to the successor), or
    /// not a reply (servers write their notifications to `/dev/fuse` themselves).
    Stale,
}

/// What [`Relay::switch`] hands a server that takes over.
#[derive(Debug)]
pub struct Switch {
    pub resume: Resume,
    /// Requests in flight, oldest first, to write to it after the resume payload.
    pub resend: Vec<Vec<u8>>,
    /// Requests given up on: answer each EIO (`fuse_wire::error_reply`), and log it.
    pub give_up: Vec<(u64, u32)>,
}

#[derive(Debug, Default)]
pub struct Relay {
    /// The kernel's INIT request, and the body of the first server's reply to it.
    init: Option<Vec<u8>>,
    init_reply: Option<Vec<u8>>,
    pending: BTreeMap<u64, Pending>,
    held: Held,
    current: Option<u64>,
    holding: bool,
    /// `(epoch, unique)` of the INIT sent to a replacement, whose reply is swallowed.
    probe: Option<(u64, u64)>,
    generation: u64,
    last_error: Option<String>,
    reloads: u64,
    handovers: u64,
    /// The current server rested ([`Relay::rest`]): the next to take over is no handover.
    rested: bool,
}

impl Relay {
    /// The first server of the mount answers from now on; it starts from nothing.
    pub fn start(&mut self, epoch: u64) -> Resume {
        self.current = Some(epoch);
        Resume::default()
    }

    pub fn current(&self) -> Option<u64> {
        self.current
    }

    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The generation the current server serves, its last reload error and the reloads
    /// finished since the mount, as it last said.
    pub fn set_status(&mut self, epoch: u64, generation: u64, last_error: Option<String>, reloads: u64) {
        if self.current == Some(epoch) {
            self.generation = generation;
            self.last_error = last_error;
            self.reloads = reloads;
        }
    }

    pub fn from_kernel(&mut self, msg: &[u8], now: Instant) -> Result<FromKernel, WireError> {
        let req = Request::parse(msg)?;
        let target = self.current.filter(|_| !self.holding);
        if req.opcode == fuse_wire::FORGET || req.opcode == fuse_wire::BATCH_FORGET {
            self.held.forgot(&req)?;
        }
        if req.unanswered() {
            return Ok(target.map_or(FromKernel::Dropped, FromKernel::Forward));
        }
        if req.opcode == fuse_wire::INIT && self.init.is_none() {
            self.init = Some(msg.to_vec());
        }
        self.pending.insert(req.unique, Pending { msg: msg.to_vec(), sent: target.map(|_| now), deaths: 0 });
        Ok(target.map_or(FromKernel::Held, FromKernel::Forward))
    }

    pub fn from_server(&mut self, epoch: u64, msg: &[u8]) -> Result<FromServer, WireError> {
        let reply = Reply::parse(msg)?;
        if self.probe == Some((epoch, reply.unique)) {
            self.probe = None;
            return Ok(FromServer::Probed { epoch, same: self.init_reply.as_deref() == Some(reply.body) });
        }
        if self.current != Some(epoch) {
            return Ok(FromServer::Stale);
        }
        if reply.unique == 0 {
            return Ok(FromServer::Stale);
        }
        // A reply to nothing in flight (answered already): the kernel decides.
        let Some(pending) = self.pending.remove(&reply.unique) else { return Ok(FromServer::ToKernel(Vec::new())) };
        let req = Request::parse(&pending.msg)?;
        if req.opcode == fuse_wire::INIT && self.init_reply.is_none() && reply.error == 0 {
            self.init_reply = Some(reply.body.to_vec());
        }
        Ok(FromServer::ToKernel(self.held.replied(&req, &reply)?))
    }

    pub fn undo(&mut self, added: &[u64]) {
        self.held.undo(added);
    }

    /// The current server died: requests wait until a successor takes over.
    pub fn lost(&mut self, epoch: u64) {
        if self.current == Some(epoch) {
            self.current = None;
            for p in self.pending.values_mut().filter(|p| p.sent.is_some()) {
                p.sent = None;
                p.deaths += 1;
            }
        }
    }

    /// The current server rests, with nothing in flight: requests wait here until a server
    /// wakes and takes over, which counts as no handover (nothing was replaced). Said
    /// [`Relay::rested`] whatever the relay's current server: the keeper wakes a server only
    /// for a request held while this holds, and must never leave one held with none coming.
    pub fn rest(&mut self, epoch: u64) {
        self.lost(epoch);
        self.rested = true;
    }

    /// The current server rested and none has taken over since: a request held now wants one.
    pub fn rested(&self) -> bool {
        self.rested
    }

    /// New requests wait here, while the current server finishes those it has (an upgrade).
    pub fn hold(&mut self) {
        self.holding = true;
    }

    /// Whether every request sent to a server has been answered.
    pub fn drained(&self) -> bool {
        self.oldest_sent().is_none()
    }

    /// When the oldest request the server has not answered was sent to it: a server that
    /// leaves one unanswered for long is hung (devremap answers every request at once).
    pub fn oldest_sent(&self) -> Option<Instant> {
        self.pending.values().filter_map(|p| p.sent).min()
    }

    /// The keeper itself did not run for `away` up to `now` (stopped, or starved of CPU): every
    /// request sent to a server counts as sent that much later (never later than `now`). A
    /// server is not blamed for the time its requests and replies waited on the keeper's
    /// threads, and only for that time: a keeper that is starved again and again still calls a
    /// hung server hung once it has itself run for `--server-timeout`.
    pub fn credit(&mut self, away: Duration, now: Instant) {
        for sent in self.pending.values_mut().filter_map(|p| p.sent.as_mut()) {
            *sent = (*sent + away).min(now);
        }
    }

    /// The INIT to send a replacement, whose reply is then swallowed and compared; `None`
    /// before the first server answered INIT (no replacement can be probed then).
    pub fn probe(&mut self, epoch: u64) -> Option<Vec<u8>> {
        self.init_reply.as_ref()?;
        let init = self.init.clone()?;
        self.probe = Some((epoch, Request::parse(&init).ok()?.unique));
        Some(init)
    }

    /// Server `epoch` takes over: it gets the node table and every request in flight.
    pub fn switch(&mut self, epoch: u64, now: Instant) -> Switch {
        let woken = std::mem::take(&mut self.rested);
        self.handovers += u64::from(!woken);
        let mut give_up = Vec::new();
        self.pending.retain(|unique, p| {
            if p.deaths >= MAX_DEATHS {
                let opcode = Request::parse(&p.msg).map_or(0, |r| r.opcode);
                give_up.push((*unique, opcode));
                return false;
            }
            true
        });
        let resend = self
            .pending
            .values_mut()
            .map(|p| {
                p.sent = Some(now);
                p.msg.clone()
            })
            .collect();
        self.current = Some(epoch);
        self.holding = false;
        Switch {
            resume: Resume {
                generation: self.generation,
                handovers: self.handovers,
                held: self.held.clone(),
                from: String::new(),
                last_error: self.last_error.clone(),
                previous_plan: None,
                reloads: self.reloads,
                woken,
            },
            resend,
            give_up,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keeper::fuse_wire::{Attr, build};
    use crate::keeper::kernel_nodes::ROOT;

    fn attr() -> Attr {
        Attr { mode: 0o20666, uid: 0, gid: 0, rdev: 0x103, size: 0, mtime: (1, 0) }
    }

    /// A relay whose first server (epoch 1) answered INIT with `init_body`.
    fn started(init_body: &[u8]) -> Relay {
        let mut r = Relay::default();
        r.start(1);
        assert_eq!(
            r.from_kernel(&build::request(fuse_wire::INIT, 1, 0, &[0; 64]), Instant::now()).unwrap(),
            FromKernel::Forward(1)
        );
        assert_eq!(r.from_server(1, &build::reply(1, 0, init_body)).unwrap(), FromServer::ToKernel(vec![]));
        r
    }

    /// Rule (issue 13): requests the dead server had not answered go to its successor, after
    /// the INIT replay (whose reply is swallowed), with the node table the kernel holds.
    #[test]
    fn a_crash_hands_the_successor_what_was_in_flight() {
        let mut r = started(b"flags");
        r.from_kernel(&build::lookup(2, ROOT, "nvidia0"), Instant::now()).unwrap();
        r.from_server(1, &build::reply(2, 0, &build::entry(5, &attr()))).unwrap();
        assert_eq!(r.from_kernel(&build::lookup(3, ROOT, "zero"), Instant::now()).unwrap(), FromKernel::Forward(1));
        r.lost(1);
        assert_eq!(r.from_kernel(&build::lookup(4, ROOT, "null"), Instant::now()).unwrap(), FromKernel::Held);
        assert_eq!(r.from_kernel(&build::forget(5, 5, 1), Instant::now()).unwrap(), FromKernel::Dropped);
        let init = r.probe(2).expect("INIT was answered");
        assert_eq!(Request::parse(&init).unwrap().opcode, fuse_wire::INIT);
        assert_eq!(
            r.from_server(2, &build::reply(1, 0, b"flags")).unwrap(),
            FromServer::Probed { epoch: 2, same: true }
        );
        let sw = r.switch(2, Instant::now());
        let uniques: Vec<u64> = sw.resend.iter().map(|m| Request::parse(m).unwrap().unique).collect();
        assert_eq!(uniques, vec![3, 4]);
        // The forget that came while no server answered is in the table.
        assert!(sw.resume.held.nodes().is_empty());
        assert_eq!((sw.resume.handovers, sw.give_up.len()), (1, 0));
        assert_eq!(r.from_kernel(&build::lookup(6, ROOT, "tty"), Instant::now()).unwrap(), FromKernel::Forward(2));
        assert_eq!(r.from_server(1, &build::reply(3, 0, &build::entry(9, &attr()))).unwrap(), FromServer::Stale);
    }

    /// Rule (issue 13): a replacement that negotiates other INIT parameters is told apart.
    #[test]
    fn a_probe_that_disagrees_is_reported() {
        let mut r = started(b"flags");
        r.probe(2).unwrap();
        assert_eq!(
            r.from_server(2, &build::reply(1, 0, b"other")).unwrap(),
            FromServer::Probed { epoch: 2, same: false }
        );
        // The old server still answers.
        assert_eq!(r.current(), Some(1));
    }

    /// Rule (issue 13): an upgrade holds new requests while the old server finishes its own.
    #[test]
    fn an_upgrade_holds_requests_until_the_old_server_has_drained() {
        let mut r = started(b"f");
        r.from_kernel(&build::lookup(2, ROOT, "a"), Instant::now()).unwrap();
        r.hold();
        assert_eq!(r.from_kernel(&build::lookup(3, ROOT, "b"), Instant::now()).unwrap(), FromKernel::Held);
        assert!(!r.drained());
        assert_eq!(r.from_server(1, &build::reply(2, -libc::ENOENT, &[])).unwrap(), FromServer::ToKernel(vec![]));
        assert!(r.drained());
        let sw = r.switch(2, Instant::now());
        assert_eq!(sw.resend.len(), 1);
    }

    /// Rule (issue 13): a request in flight at three deaths is given up on, not sent again.
    #[test]
    fn a_request_that_kills_every_server_is_answered_eio() {
        let mut r = started(b"f");
        r.from_kernel(&build::lookup(2, ROOT, "poison"), Instant::now()).unwrap();
        for epoch in 1..=MAX_DEATHS as u64 {
            r.lost(epoch);
            let sw = r.switch(epoch + 1, Instant::now());
            if epoch < MAX_DEATHS as u64 {
                assert_eq!(sw.resend.len(), 1);
            } else {
                assert_eq!(sw.give_up, vec![(2, fuse_wire::LOOKUP)]);
                assert!(sw.resend.is_empty());
            }
        }
        assert_eq!(r.in_flight(), 0);
    }

    /// Rule (issue 13): generation, handovers, the reloads finished and the last reload error
    /// carry over to the successor (a crash must not tell a monitor that a refused input is
    /// fine; issue 31: nor a count of reloads start again, which says when a `SIGHUP` is done).
    #[test]
    fn counters_carry_over() {
        let mut r = started(b"f");
        r.set_status(1, 7, Some("spec: bad".into()), 4);
        r.set_status(9, 100, None, 99);
        r.lost(1);
        let sw = r.switch(2, Instant::now());
        assert_eq!((sw.resume.generation, sw.resume.handovers, sw.resume.reloads), (7, 1, 4));
        assert_eq!(sw.resume.last_error.as_deref(), Some("spec: bad"));
        assert!(!sw.resume.woken);
    }

    /// Rule (issue 31): a server that rested is no handover: the one that wakes takes over
    /// quietly (`woken`), and `handovers` still counts only crashes and upgrades.
    #[test]
    fn a_wake_after_a_rest_is_no_handover() {
        let mut r = started(b"f");
        r.rest(1);
        assert_eq!(r.from_kernel(&build::lookup(2, ROOT, "a"), Instant::now()).unwrap(), FromKernel::Held);
        let sw = r.switch(2, Instant::now());
        assert_eq!((sw.resume.handovers, sw.resume.woken, sw.resend.len()), (0, true, 1));
        r.lost(2);
        let sw = r.switch(3, Instant::now());
        assert_eq!((sw.resume.handovers, sw.resume.woken), (1, false), "a crash after it is one");
    }

    /// Rule (issue 13): the oldest unanswered request's age is what tells a hung server; one
    /// held here (no server took it) does not count, and an answer clears it.
    #[test]
    fn the_oldest_sent_request_tells_a_hung_server() {
        let mut r = started(b"f");
        let t0 = Instant::now();
        assert_eq!(r.oldest_sent(), None);
        r.from_kernel(&build::lookup(2, ROOT, "a"), t0).unwrap();
        r.from_kernel(&build::lookup(3, ROOT, "b"), t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(r.oldest_sent(), Some(t0));
        r.from_server(1, &build::reply(2, -libc::ENOENT, &[])).unwrap();
        assert_eq!(r.oldest_sent(), Some(t0 + Duration::from_secs(1)));
        r.lost(1);
        assert_eq!(r.oldest_sent(), None, "requests waiting for a successor are not the server's");
    }

    /// Rule (issue 18): after the keeper did not run for a while, every request sent counts
    /// that much later, never later than its return: a server is not blamed for the keeper's
    /// own absence.
    #[test]
    fn credited_clocks_leave_out_the_keepers_absence() {
        let mut r = started(b"f");
        let t0 = Instant::now();
        r.from_kernel(&build::lookup(2, ROOT, "a"), t0).unwrap();
        r.lost(1);
        r.from_kernel(&build::lookup(3, ROOT, "b"), t0).unwrap();
        r.switch(2, t0);
        r.from_kernel(&build::lookup(4, ROOT, "c"), t0 + Duration::from_secs(1)).unwrap();
        r.credit(Duration::from_secs(2), t0 + Duration::from_secs(5));
        assert_eq!(r.oldest_sent(), Some(t0 + Duration::from_secs(2)));
        r.credit(Duration::from_secs(60), t0 + Duration::from_secs(6));
        assert_eq!(r.oldest_sent(), Some(t0 + Duration::from_secs(6)), "never sent after the keeper's return");
    }

    /// Bug (issue 18, seen in the full suite): a keeper woken late again and again (starved of
    /// CPU by the tests beside it) restarted its server's clock each time, so a server stopped
    /// for good was never called hung. Credited with only its absences, the keeper calls it
    /// hung once it has itself run for the timeout.
    #[test]
    fn a_keeper_starved_again_and_again_still_tells_a_hung_server() {
        let timeout = Duration::from_secs(3);
        let mut r = started(b"f");
        let t0 = Instant::now();
        r.from_kernel(&build::lookup(2, ROOT, "a"), t0).unwrap();
        // Every wake-up comes 1 s late after 0.75 s of running.
        let mut now = t0;
        let hung_after = (1..=20).find(|_| {
            now += Duration::from_millis(1750);
            r.credit(Duration::from_secs(1), now);
            now.saturating_duration_since(r.oldest_sent().unwrap()) >= timeout
        });
        assert_eq!(hung_after, Some(4), "hung once the keeper has run for 4 × 0.75 s");
    }
}
