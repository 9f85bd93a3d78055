//! The end of the keeper's life: a stop, the connection's end from outside, a start that
//! failed; and what it tells systemd.

use super::procs::Proc;
use super::{End, Ev, Keeper, KeeperError};
use crate::mountpoint::{connection_remains, detach, is_dead_mount};
use crate::signals::Waking;
use devremap::atomic::Written;
use devremap::io_message;
use devremap::keeper::control::Control;
use devremap::keeper::control::Notice;
use devremap::served::lifecycle::Waited;
use log::{info, warn};
use nix::mount::MntFlags;
use sd_notify::NotifyState;
use std::io;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// How long a stop waits for the end of the sockets of the servers it ended.
const READERS_PATIENCE: Duration = Duration::from_secs(2);
/// How long a ready server has, once told the daemon stops, to remove its state file and end.
const SERVER_STOP: Duration = Duration::from_secs(2);

/// Whether server `p` ends within `timeout`: its process exits, or it closes its side of the
/// control socket, which it does once it has said all. Its process may not exit for long after
/// that: a reload's thread waiting in another FUSE filesystem's request that its daemon has read
/// cannot be ended by any signal until it is answered (the kernel's rule), and the exit waits
/// for every thread. A server of an earlier build, which does not close it, is waited for to
/// exit, as before.
fn said_all_within(p: &Proc, timeout: Duration) -> bool {
    let Ok(pidfd) = devremap::pidfd::pidfd_open(p.pid()) else { return true };
    // nix names no POLLRDHUP: the end of the peer's writing, which a seqpacket socket reports.
    let closed = nix::poll::PollFlags::from_bits_retain(libc::POLLRDHUP);
    devremap::pidfd::exited_or(&pidfd, Some((p.control.as_fd(), closed)), Some(timeout))
}

impl Keeper<'_> {
    /// A start that failed: nothing is left behind (no server, no mount); returns `why`.
    pub(super) fn start_failed(&mut self, why: KeeperError) -> KeeperError {
        let all: Vec<Proc> = self.procs.drain().map(|(_, p)| p).collect();
        for p in all {
            self.kill(p);
        }
        if self.mounted {
            if nix::mount::umount2(&self.mountpoint, MntFlags::empty()).is_err() {
                detach(&self.mountpoint);
            }
            self.mounted = false;
        }
        why
    }

    /// SIGTERM, SIGINT, or the watched container gone (logged, and told to systemd, by the
    /// machine's actions): unmount, stop the server.
    pub(super) fn stop(&mut self, rx: &Waking<Ev>) -> End {
        if self.mounted {
            match nix::mount::umount2(&self.mountpoint, MntFlags::empty()) {
                // Unmounted here; the connection ends once no other mount holds it. A
                // container's bind mount of it does: then exiting ends it, and the container
                // sees ENOTCONN.
                Ok(()) => {
                    // Whether the connection outlived our mount is a fact the kernel shows at
                    // once; the wait for the connection's end is only where it does not (no
                    // fusectl): a busy machine may take longer, and then the warning is false.
                    let ended = match self.connection.and_then(connection_remains) {
                        Some(remains) => !remains,
                        None => self.connection_ends_within(rx, Duration::from_millis(500)),
                    };
                    if ended {
                        info!("unmounted {}", self.m);
                    } else {
                        warn!(
                            "unmounted {}, but other mounts of it (a container's /dev?) remain; they lose their /dev as we exit",
                            self.m
                        );
                    }
                }
                // Busy (a process has its cwd in it): detach; the same holds for its last users.
                Err(e) => {
                    warn!(
                        "{}: unmount failed ({}); detached it, and what still holds it loses its /dev as we exit",
                        self.m,
                        io_message(&e.into())
                    );
                    detach(&self.mountpoint);
                }
            }
        }
        self.end_servers();
        Ok(())
    }

    /// Whether the kernel ends the connection (the relay reads its end) within `patience`.
    fn connection_ends_within(&mut self, rx: &Waking<Ev>, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        loop {
            match self.wait(rx, |_| Some(deadline)).0 {
                Waited::Event(Ev::KernelEnded(_)) | Waited::Closed => return true,
                Waited::Event(_) => {}
                Waited::Deadline => return false,
            }
        }
    }

    /// Tells a ready server that the daemon stops (it removes the state file) and waits a
    /// little for it; kills whatever is left. A state file no server removed (none was serving, or it
    /// was stopped and killed) is removed here if it is still a file one of them wrote (the
    /// temporary file a killed one left goes as it is reaped, [`super::procs::reap`]).
    fn end_servers(&mut self) {
        let ready = self.machine.current_ready();
        if let Some(p) = self.machine.current().and_then(|epoch| self.procs.remove(&epoch)) {
            // A ready one removes its state file and exits; whatever is left then is killed.
            // One not ready has no state file of its own (one it was writing is known here, and
            // removed below) and may be waiting for the mount to answer, which it no longer
            // does: it would read the stop only once that wait gave up (found from outside: a
            // stop just after the mount took 2 s, and a node daemon held the killed wrapper's
            // lock on the container's directory meanwhile).
            if ready {
                p.tell(&Control::Stop);
                if !said_all_within(&p, SERVER_STOP) {
                    warn!(
                        "{}: server pid {} did not end within {} s of the stop; killed it",
                        self.m,
                        p.pid(),
                        SERVER_STOP.as_secs()
                    );
                }
            }
            self.kill(p);
        }
        let rest: Vec<Proc> = self.procs.drain().map(|(_, p)| p).chain(self.leaving.drain(..)).collect();
        for p in rest {
            self.kill(p);
        }
        // Never read: a file at the path is removed only if it is one our servers wrote (a
        // file another user put there may be of any size, and is theirs). What a killed server
        // said last (the state file it was putting in place) is read to its sockets' end first
        // (found in CI's way: a stop as the first server wrote its state file left the file).
        if let Some(path) = &self.args.state_file {
            let until = Instant::now() + READERS_PATIENCE;
            if !self.relaying.pump_until(&self.link, until, &mut self.queued, |r| !r.servers_read()) {
                warn!(
                    "{}: a server's messages were not all read within {} s of its end",
                    self.m,
                    READERS_PATIENCE.as_secs()
                );
            }
            for identity in self.relaying.state_files.drain(..) {
                Written::known(path, identity).remove_if_ours();
            }
        }
    }

    /// `/dev/fuse` ended without a stop. A clean outside `umount` ends it with ENODEV (`Ok`):
    /// exit 0. An aborted connection (`umount -f`, a write to `/sys/fs/fuse/connections/N/abort`)
    /// ends it with ECONNABORTED (the server asks for `FUSE_ABORT_ERROR`) and may leave a dead
    /// mount answering ENOTCONN (when it was busy): detach that and fail, so that a supervisor
    /// (systemd's `Restart=on-failure`) starts a new daemon.
    pub(super) fn ended(&mut self, result: io::Result<()>) -> End {
        self.end_servers();
        let aborted = result.as_ref().err().and_then(io::Error::raw_os_error) == Some(libc::ECONNABORTED);
        if is_dead_mount(&self.mountpoint) {
            detach(&self.mountpoint);
            return Err(KeeperError::AbortedDetached(self.m.clone()));
        }
        match result {
            _ if aborted => return Err(KeeperError::Aborted(self.m.clone())),
            Ok(()) => info!("{}: unmounted from outside", self.m),
            Err(e) => warn!("{}: the FUSE connection ended: {}", self.m, io_message(&e)),
        }
        Ok(())
    }
}

/// Tells systemd, when it started us with a notify socket (`Type=notify` or `notify-reload`,
/// which shows the unit as reloading until `READY=1`); without one this does nothing. Sent
/// without waiting, as `sd_notify::notify` does but for that: the main thread relays the
/// mount's requests, and a socket that nobody reads fills (10 datagrams by default) and then
/// holds a blocking send (found from outside: every `stat` through the mount hung from the sixth
/// reload on). A notice that does not fit is warned of.
pub(super) fn notify(notice: Notice) {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let states = match notice {
        Notice::Ready => vec![NotifyState::Ready],
        Notice::Stopping => vec![NotifyState::Stopping],
        Notice::Reloading => {
            let mut reloading = vec![NotifyState::Reloading];
            reloading.extend(NotifyState::monotonic_usec_now().ok());
            reloading
        }
    };
    let message: String = states.iter().map(|state| format!("{state}\n")).collect();
    let sent = (|| {
        let datagram = std::os::unix::net::UnixDatagram::unbound()?;
        datagram.set_nonblocking(true)?;
        datagram.connect(&socket)?;
        datagram.send(message.as_bytes())
    })();
    if let Err(e) = sent {
        warn!("cannot notify systemd: {}", io_message(&e));
    }
}
