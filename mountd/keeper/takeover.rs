//! The keeper's actions on the mount and at a takeover: mounting once the first server has
//! loaded, the pid file, the INIT replay to a successor, and the takeover itself (the old
//! server's drain and retirement at an upgrade, the node table and the requests in flight).

use super::procs::{Proc, status_text};
use super::relaying::mount;
use super::{Ev, Keeper, KeeperError, spawn_thread};
use devremap::atomic::{Lasting, write_atomic_told};
use devremap::io_message;
use devremap::keeper::control::Control;
use devremap::keeper::fuse_wire;
use log::{debug, warn};
use std::time::{Duration, Instant};

/// How long an upgrade lets the old server answer what it has before the rest goes to the new.
const DRAIN: Duration = Duration::from_millis(500);
/// How long a retired server has to end before it is killed.
const RETIRE: Duration = Duration::from_secs(1);
/// How long readiness waits for the watch's first look at the container's pid file: a look
/// takes a `stat`, which only a file system that does not answer makes last (found from
/// outside: taken on the main thread, it held the keeper, its pid file and its signals).
const WATCH_ARMED_PATIENCE: Duration = Duration::from_secs(1);

impl Keeper<'_> {
    /// The first server loaded its inputs: hand it the (empty) resume, mount, and relay. The
    /// server declares the daemon ready once the mount answers through it.
    pub(super) fn mount_now(&mut self, epoch: u64) -> Result<(), KeeperError> {
        let Some(first) = self.procs.get(&epoch) else { return Ok(()) };
        let resume = self.relaying.relay.start(epoch);
        for record in resume.records() {
            first.write_now(&first.control, &record, &"its resume");
        }
        if let Err(e) = mount(&self.link.dev, &self.mountpoint) {
            return Err(KeeperError::Mount { m: self.m.clone(), source: e.into() });
        }
        self.mounted = true;
        self.connection = crate::mountpoint::connection_of(&self.mountpoint);
        self.abort = self.connection.and_then(crate::mountpoint::abort_handle);
        self.relaying.read_kernel();
        if let Some((watch, armed)) =
            crate::watch::Watch::start(self.args.owner_pid, self.args.container_pid_file.clone())
        {
            self.watch = Some(watch);
            self.watch_armed = armed;
        }
        Ok(())
    }

    /// The mount answers: once the watch has had its first look at the container's pid file
    /// ([`WATCH_ARMED_PATIENCE`]), the pid file, once (a server taking over finds it written).
    /// The starter is told later, by [`Keeper::say_ready`].
    pub(super) fn write_pid_file(&mut self) -> Result<(), KeeperError> {
        if let (Some(armed), Some(path)) = (self.watch_armed.take(), &self.args.container_pid_file) {
            crate::watch::armed_within(&armed, WATCH_ARMED_PATIENCE, path);
        }
        if let Some(pid_file) = self.args.pid_file.as_ref().filter(|_| self.pid_written.is_none()) {
            let pid = format!("{}\n", std::process::id());
            let written = write_atomic_told(pid_file, pid.as_bytes(), None, Lasting::UntilReboot, |_| {})
                .map_err(|source| KeeperError::PidFile { path: pid_file.clone(), source })?;
            self.pid_written = Some(written);
        }
        Ok(())
    }

    /// The newline on `--ready-fd`, which is closed; once. One that cannot be written (the
    /// starter is gone, or never reads and the pipe is full) is warned of, and the mount serves
    /// on: the starter sees EOF and takes the start as failed, its own decision.
    pub(super) fn say_ready(&mut self) {
        if let Some(mut ready) = self.ready.take()
            && let Err(e) = std::io::Write::write_all(&mut ready, b"\n")
        {
            warn!("--ready-fd: cannot say ready ({}): the starter will take the start as failed", io_message(&e));
        }
    }

    /// Replays the kernel's INIT to successor `epoch`; it takes over once it answers alike.
    pub(super) fn probe(&mut self, epoch: u64) {
        let init = self.relaying.relay.probe(epoch);
        if let (Some(init), Some(p)) = (init, self.procs.get(&epoch)) {
            p.write_now(&p.socket, &init, &"the INIT replay");
        }
    }

    /// At an upgrade: the old server answers what it has (new requests wait here meanwhile),
    /// then ends, before the new one serves: a reload it was finishing can no longer write a
    /// state file over its successor's.
    fn retire(&mut self, old: u64) {
        self.relaying.relay.hold();
        self.relaying.pump_until(&self.link, Instant::now() + DRAIN, &mut self.queued, |r| r.relay.drained());
        let Some(old) = self.procs.get(&old) else { return };
        old.tell(&Control::Retire);
        let epoch = old.epoch;
        if !devremap::pidfd::exits_within(old.pid(), RETIRE) {
            warn!("server pid {} did not end within {} ms of its retirement; killed it", old.pid(), RETIRE.as_millis());
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.pid() as i32), nix::sys::signal::SIGKILL);
        }
        // Its last words (a reload it finished as it was retired) before its successor is
        // handed the counts: it has ended, so they are all there.
        self.relaying.pump_until(&self.link, Instant::now() + DRAIN, &mut self.queued, |r| !r.reads(epoch));
    }

    /// Server `epoch` rests: the relay sends it nothing more (nothing is in flight, so what the
    /// kernel asks next waits, and wakes a server), and it is told to say so in its state file
    /// and end. One that has not ended within [`RETIRE`] (a server of an earlier build, which
    /// does not know the message) is killed ([`Keeper::end_rested`]).
    pub(super) fn rest(&mut self, epoch: u64) {
        self.relaying.relay.rest(epoch);
        let Some(p) = self.procs.remove(&epoch) else { return };
        debug!("{}: server pid {} rests: nothing was asked of it for a while", self.m, p.pid());
        p.tell(&Control::Rest);
        self.rested = Some((epoch, Instant::now() + RETIRE));
        self.leaving.push(p);
    }

    /// A server starts while the one that rested has not ended (a request came just after the
    /// rest): the rested one is killed first, so that its state file, which says that no
    /// server runs, cannot land after its successor's (found from outside: a late one rolled
    /// `generation` and `reloads` back, and a `ctl reload` read it as done).
    pub(super) fn end_rest_now(&mut self) {
        let Some((epoch, _)) = self.rested.take() else { return };
        if let Some(p) = self.take_leaving(epoch) {
            debug!("{}: server pid {} had not ended its rest as another starts; killed it", self.m, p.pid());
            self.kill(p);
        }
    }

    /// The server that rested has ended: reaped on a thread of its own, which says how
    /// ([`Ev::RestEnded`]).
    pub(super) fn reap_rested(&mut self, p: Proc) {
        let (events, pid) = (self.link.events.clone(), p.pid());
        p.disconnect();
        let said = self.reap_later(p.child, move |status| {
            let clean = status.as_ref().is_ok_and(std::process::ExitStatus::success);
            let _ = events.send(Ev::RestEnded { clean, pid, status: status_text(status) });
        });
        if said.is_err() {
            warn!("{}: cannot start a thread to reap a rested server", self.m);
        }
    }

    /// The server that rested, if it has not ended by its time: killed; whether it was. Its
    /// state file still names it then, and the next server would not rest either (the same
    /// binary): no server rests on this mount any more, and the caller wakes one now, whose
    /// state file is right.
    pub(super) fn end_rested(&mut self, now: Instant) -> bool {
        let Some((epoch, _)) = self.rested.filter(|(_, by)| now >= *by) else { return false };
        self.rested = None;
        let Some(p) = self.take_leaving(epoch) else { return false };
        warn!(
            "server pid {} did not end within {} ms of its rest; killed it and starting another; no server rests on \
             this mount any more",
            p.pid(),
            RETIRE.as_millis()
        );
        self.kill(p);
        self.rest_after = None;
        true
    }

    /// Successor `epoch` takes over (from the old server `retire`, at an upgrade).
    pub(super) fn take_over(&mut self, epoch: u64, retire: Option<u64>, from: &str) {
        if let Some(old) = retire {
            self.retire(old);
        }
        let Some(new) = self.procs.get(&epoch) else { return };
        let mut switch = self.relaying.relay.switch(epoch, Instant::now());
        switch.resume.from = format!("{from}, {} requests resent", switch.resend.len());
        if retire.is_some() {
            switch.resume.previous_plan = self.plan.as_deref().and_then(|p| String::from_utf8(p.to_vec()).ok());
        }
        // Written by a thread of its own, outside the relay's lock: the resume (with the whole
        // previous plan, at an upgrade) can be larger than the socket's buffer, and a successor
        // that stops reading would otherwise block every request and the main thread. The
        // server reads the resume before it reads a request, and requests that arrive
        // meanwhile are independent of those resent (each is answered on its own), so the
        // order between the two sockets does not matter.
        let (records, resend) = (switch.resume.records(), std::mem::take(&mut switch.resend));
        let (control, socket) = (new.control.clone(), new.socket.clone());
        self.good = new.exe.clone();
        let _ = spawn_thread("hand-over", move || {
            let writes = records.iter().map(|m| (&control, m)).chain(resend.iter().map(|m| (&socket, m)));
            for (to, message) in writes {
                // A successor that died: its own end is seen by the main thread.
                if nix::unistd::write(&**to, message).is_err() {
                    break;
                }
            }
        });
        for (unique, opcode) in &switch.give_up {
            warn!("request {unique} (opcode {opcode}) was in flight at three server deaths: answered EIO");
            let _ = nix::unistd::write(&self.link.dev, &fuse_wire::error_reply(*unique, libc::EIO));
        }
        // The new server logs the takeover, with what it kept of the kernel's nodes.
        if let Some(old) = retire.and_then(|e| self.procs.remove(&e)) {
            old.disconnect();
            self.leaving.push(old);
        }
    }
}
