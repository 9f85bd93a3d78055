//! The node daemon's spare keeper: one `devremapd parked --spare-server` (with its server,
//! parked in turn) started ahead of need, so that a container's mount hands it the container's
//! command line ([`crate::parked`]) instead of waiting for two execs. A mount that finds no
//! spare (the first of a burst, or spares off) spawns its keeper directly, as before; each
//! spare used is replaced at once by a thread of its own, beside the container's start.
//!
//! A spare runs the binary the node daemon's path named when it was started. One found stale
//! at a mount (the binary at that path replaced since, as a package upgrade does) is stopped
//! and the keeper spawned from the new binary, as a direct start would. A spare that exits with
//! status 1 before it is used refused to start (it cannot rewrite its command line, or that
//! binary has no `parked`): spares are turned off, said once in the node daemon's log, until
//! another binary is at the path (a package upgrade or downgrade). Assumptions: the spare is
//! our child, so its pid cannot be reused while we hold it unreaped; it holds none of our
//! descriptors but its parcel socket, and exits when that closes (when this daemon exits).

use super::procs::Host;
use devremap::pidfd::Child;
use devremap::runtime::container_daemon::daemon::{Launch, Processes, spawn_detached};
use log::{info, warn};
use nix::sys::socket::{AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, sendmsg, socketpair};
use parking_lot::Mutex;
use std::io;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::time::Duration;

/// The longest a mount (or the daemon's stop) waits for a spare being spawned: its exec takes a
/// millisecond; only a spawn stopped before its exec takes this long.
const SPAWNING: Duration = Duration::from_millis(250);

/// A spare keeper, waiting for its parcel.
struct Spare {
    child: Child,
    parcel: OwnedFd,
    /// The device and inode of the binary it was started from.
    binary: (u64, u64),
}

enum Slot {
    Empty,
    Ready(Spare),
    /// A spare of this binary (its device and inode) refused to start: keepers are spawned
    /// directly until another binary is at the daemon's path.
    Refused((u64, u64)),
    /// `--no-spare`: keepers are spawned directly.
    Off,
}

struct Shared {
    exe: PathBuf,
    slot: Mutex<Slot>,
    /// Where spares are forked from; taken with `slot` held.
    zygote: Mutex<Option<Zygote>>,
}

/// The node daemon's `devremapd zygote` ([`crate::zygote`]): the process, our end of its
/// request socket, and the device and inode of the binary it was started from.
struct Zygote {
    child: std::process::Child,
    requests: OwnedFd,
    binary: (u64, u64),
}

/// The spare keeper, and the thread that starts the next one.
pub(super) struct Spares {
    shared: Arc<Shared>,
    refill: Mutex<Sender<()>>,
}

impl Spares {
    /// Starts the refilling thread, which starts the first spare at once; with `on` false
    /// (`--no-spare`), none is ever started.
    pub(super) fn start(exe: PathBuf, on: bool) -> io::Result<Spares> {
        let slot = Mutex::new(if on { Slot::Empty } else { Slot::Off });
        let shared = Arc::new(Shared { exe, slot, zygote: Mutex::new(None) });
        let (tx, rx) = mpsc::channel::<()>();
        let filling = shared.clone();
        std::thread::Builder::new().name("spare".into()).spawn(move || {
            // Ends with the daemon (the sender is never dropped before).
            while rx.recv().is_ok() {
                filling.fill();
            }
        })?;
        let _ = tx.send(());
        Ok(Spares { shared, refill: Mutex::new(tx) })
    }

    /// At the daemon's end: its spare is killed, and no other started. (One that is stopped
    /// would not read the end of its socket, and would stay with its parked server until
    /// continued; its server dies with it.)
    pub(super) fn stop(&self) {
        let Some(mut slot) = self.shared.slot.try_lock_for(SPAWNING) else { return };
        if let Slot::Ready(mut spare) = std::mem::replace(&mut *slot, Slot::Off) {
            let _ = spare.child.kill();
            let _ = spare.child.wait();
        }
        if let Some(zygote) = self.shared.zygote.lock().take() {
            zygote.stop();
        }
    }
}

impl Shared {
    /// Starts a spare into an empty slot.
    ///
    /// The slot is held while the spare is spawned (until its exec), so that a mount meanwhile
    /// waits for that spare ([`SPAWNING`]) rather than finding the slot empty. Bug (seen under
    /// load): the spare had exec'd, and started its own server, while this thread had not yet
    /// put it in the slot; a mount then started its keeper directly.
    fn fill(&self) {
        let mut slot = self.slot.lock();
        if !matches!(*slot, Slot::Empty) {
            return;
        }
        match self.fork_spare().or_else(|e| {
            warn!("cannot fork a spare keeper ({e}): starting one by exec");
            spawn_spare(&self.exe)
        }) {
            Ok(spare) => {
                slow_keep();
                *slot = Slot::Ready(spare);
            }
            Err(e) => warn!("cannot start a spare keeper ({}): the next container's keeper is started directly", e),
        }
    }

    /// A spare forked by the zygote, which is started first if there is none, or it is gone,
    /// or its binary is no longer the one at the daemon's path. A zygote that fails a request
    /// (it died, or does not answer within [`SPAWNING`]: stopped) is stopped; the next spare
    /// starts another.
    fn fork_spare(&self) -> io::Result<Spare> {
        let mut held = self.zygote.lock();
        let binary = binary_of(&self.exe)?;
        if let Some(mut zygote) = held.take() {
            if zygote.binary == binary && matches!(zygote.child.try_wait(), Ok(None)) {
                *held = Some(zygote);
            } else {
                zygote.stop();
            }
        }
        let zygote = match &mut *held {
            Some(zygote) => zygote,
            None => held.insert(Zygote::spawn(&self.exe, binary)?),
        };
        let forked = zygote.fork();
        if forked.is_err()
            && let Some(zygote) = held.take()
        {
            zygote.stop();
        }
        let (pid, parcel) = forked?;
        Ok(Spare { child: Child::forked(pid), parcel, binary })
    }

    /// The spare, if one is ready, fresh and alive, and whether the slot is left empty (to be
    /// filled again); else it is left refused or off. A spawn that holds the slot longer than
    /// [`SPAWNING`] (stopped before its exec) is not waited for: the keeper is started directly.
    fn take(&self, program: &Path) -> (Option<Spare>, bool) {
        let Some(mut slot) = self.slot.try_lock_for(SPAWNING) else { return (None, false) };
        let spare = take_from(&mut slot, program);
        (spare, matches!(*slot, Slot::Empty))
    }
}

/// [`Shared::take`] from the held `slot`.
fn take_from(slot: &mut Slot, program: &Path) -> Option<Spare> {
    let mut spare = match std::mem::replace(slot, Slot::Empty) {
        Slot::Ready(spare) => spare,
        // Bug (found from outside): spares stayed off for the daemon's life, even once the
        // binary that refused (a release without `parked`, a downgrade) was replaced.
        Slot::Refused(binary) if binary_of(program).is_ok_and(|now| now != binary) => {
            info!(
                "the binary at the node daemon's path was replaced since a spare keeper refused to start: \
                 spare keepers are started again"
            );
            return None;
        }
        other => {
            *slot = other;
            return None;
        }
    };
    match spare.child.try_wait() {
        Ok(None) => {
            let pid = spare.child.id();
            let why = if !devremap::procfs::runs(pid) {
                "it is stopped"
            } else if binary_of(program).ok() != Some(spare.binary) {
                "its binary was replaced since it started"
            } else {
                return Some(spare);
            };
            info!("the spare keeper (pid {pid}) is not used ({why}): stopped it; the keeper is started directly");
            let _ = spare.child.kill();
            let _ = spare.child.wait();
        }
        Ok(Some(status)) if status.code() == Some(1) => {
            warn!(
                "the spare keeper refused to start ({status}; its error is in this daemon's log above): \
                 containers' keepers are started directly until the binary at {} is replaced",
                program.display()
            );
            *slot = Slot::Refused(spare.binary);
        }
        Ok(Some(status)) => {
            warn!("the spare keeper (pid {}) ended before it was used ({status})", spare.child.id())
        }
        Err(_) => {}
    }
    None
}

impl Processes for Spares {
    fn detach(&self, cmd: &mut Command, keep: RawFd) {
        Host.detach(cmd, keep)
    }

    fn exit_watch(&self, pid: u32) -> Option<OwnedFd> {
        Host.exit_watch(pid)
    }

    /// Hands `launch` to the spare, or spawns its keeper when there is none or the hand-over
    /// fails; then has the spare replaced.
    fn launch(&self, launch: Launch) -> io::Result<Child> {
        // A command line no exec would take is refused by the spawn below, costing no spare.
        let Ok(words) = crate::parked::Words::encode(&launch.args) else { return spawn_detached(self, launch) };
        let (spare, empty) = self.shared.take(launch.program);
        if empty {
            let _ = self.refill.lock().send(());
        }
        if let Some(mut spare) = spare {
            let fds = [launch.log.as_raw_fd(), launch.ready.as_raw_fd()];
            match crate::parked::send(spare.parcel.as_fd(), &words, &fds) {
                // Our copies of the log and the pipe go with `launch`: the keeper's exit is EOF.
                Ok(()) => return Ok(spare.child),
                Err(e) => {
                    warn!("the spare keeper (pid {}) did not take a container ({e}); starting one", spare.child.id());
                    let _ = spare.child.kill();
                    let _ = spare.child.wait();
                }
            }
        }
        spawn_detached(self, launch)
    }
}

/// The device and inode of the file at `path`.
fn binary_of(path: &Path) -> io::Result<(u64, u64)> {
    let meta = std::fs::metadata(path)?;
    Ok((meta.dev(), meta.ino()))
}

impl Zygote {
    /// Starts `exe zygote`, detached as a keeper is, its request socket its stdin and its
    /// stderr ours (where it says why it stopped, if it does).
    fn spawn(exe: &Path, binary: (u64, u64)) -> io::Result<Zygote> {
        let (requests, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        let mut cmd = Command::new(exe);
        cmd.arg("zygote").env_remove("NOTIFY_SOCKET").stdin(Stdio::from(theirs)).stdout(Stdio::null());
        cmd.envs(crate::memory::glibc_tunables().map(|t| ("GLIBC_TUNABLES", t)));
        Host.detach(&mut cmd, 0);
        Ok(Zygote { child: cmd.spawn()?, requests, binary })
    }

    /// Has it fork a spare, whose parcel socket's other end is returned with its pid: our child,
    /// by `CLONE_PARENT`.
    fn fork(&mut self) -> io::Result<(u32, OwnedFd)> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let (parcel, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        let rights = [ControlMessage::ScmRights(&[theirs.as_raw_fd()])];
        let request = [0u8; crate::zygote::REQUEST];
        sendmsg::<()>(self.requests.as_raw_fd(), &[IoSlice::new(&request)], &rights, MsgFlags::MSG_NOSIGNAL, None)?;
        drop(theirs);
        let mut fds = [PollFd::new(self.requests.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::try_from(SPAWNING).unwrap_or(PollTimeout::MAX))? == 0 {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the zygote did not answer (is it stopped?)"));
        }
        let mut answer = [0u8; crate::zygote::ANSWER];
        match nix::sys::socket::recv(self.requests.as_raw_fd(), &mut answer, MsgFlags::MSG_DONTWAIT)? {
            crate::zygote::ANSWER => {}
            _ => return Err(io::Error::other(format!("the zygote (pid {}) ended", self.child.id()))),
        }
        match crate::zygote::answer_words(&answer) {
            (0, errno) => Err(io::Error::from_raw_os_error(errno as i32)),
            (pid, _) => Ok((pid, parcel)),
        }
    }

    /// Kills and reaps it (its spares live on: each waits on its own socket). An answer it sent
    /// that was not read (it came after the wait for it ended) names a spare we never took,
    /// our child, which is killed and reaped here rather than left a zombie. (One forked in the
    /// instant before the kill and never named is left so; the zygote is killed only when it
    /// did not answer within [`SPAWNING`], stopped.)
    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut answer = [0u8; crate::zygote::ANSWER];
        while nix::sys::socket::recv(self.requests.as_raw_fd(), &mut answer, MsgFlags::MSG_DONTWAIT)
            == Ok(crate::zygote::ANSWER)
        {
            match crate::zygote::answer_words(&answer) {
                (0, _) => {}
                (pid, _) => {
                    let mut unused = Child::forked(pid);
                    let _ = unused.kill();
                    let _ = unused.wait();
                }
            }
        }
    }
}

/// Starts `exe parked --spare-server`, detached as a keeper is, its parcel socket its stdin and
/// its stderr ours (where its refusal, if any, is said).
fn spawn_spare(exe: &Path) -> io::Result<Spare> {
    let binary = binary_of(exe)?;
    let (parcel, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
    let mut cmd = Command::new(exe);
    cmd.arg("parked")
        .arg("--spare-server")
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::from(theirs))
        .stdout(Stdio::null())
        .envs(crate::memory::glibc_tunables().map(|t| ("GLIBC_TUNABLES", t)));
    Host.detach(&mut cmd, 0);
    Ok(Spare { child: Child::Spawned(cmd.spawn()?), parcel, binary })
}

/// The test hook `DEVREMAPD_FAILPOINT=spare-slow-keep`: the spare is put in the slot 150 ms
/// after its spawn returned (a thread descheduled on a busy machine), well within [`SPAWNING`].
#[cfg(feature = "test-hooks")]
fn slow_keep() {
    if std::env::var("DEVREMAPD_FAILPOINT").is_ok_and(|f| f == "spare-slow-keep") {
        std::thread::sleep(Duration::from_millis(150));
    }
}

#[cfg(not(feature = "test-hooks"))]
fn slow_keep() {}
