//! The node daemon's one thread that waits for the processes it watches: each container's keeper
//! (its exit tears the container's directory down) and each runtime that holds a wrapper's lock
//! (its exit lets the lock go). It polls their pidfds, all at once, and runs what each exit
//! calls for.
//!
//! Bug (a trace of one container's start with 200 mounted): a thread per watched process grew
//! the daemon by two threads and their stacks per container, and the spare keeper's spawn, a
//! fork of the daemon, copied every one of their mappings under the daemon's memory lock: 0.1 ms
//! with 1 container, 0.4 ms with 200, while the mount being handed the spare stalled on the same
//! lock. Assumptions: what an exit calls for is quick (a reap of a process that has exited, a
//! message, a descriptor closed), so one thread runs them all in turn; a process whose pidfd
//! cannot be opened (no pidfd: before Linux 5.3) is waited for by a thread of its own, as before.

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, Sender};

/// What an exit calls for.
pub(super) type OnExit = Box<dyn FnOnce() + Send>;

/// The stack of a thread that only waits for one process (where there is no pidfd).
const WAITER_STACK: usize = 64 << 10;

pub(super) struct Exits {
    add: Sender<(OwnedFd, OnExit)>,
    /// The write end of the pipe that wakes the thread to take what was added.
    wake: OwnedFd,
}

impl Exits {
    /// Starts the waiting thread, which lives as long as the daemon.
    pub(super) fn start() -> io::Result<Exits> {
        use nix::fcntl::OFlag;
        let (woken, wake) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
        let (add, added) = mpsc::channel();
        std::thread::Builder::new().name("exits".into()).spawn(move || wait_all(&woken, &added))?;
        Ok(Exits { add, wake })
    }

    /// Runs `on_exit` once process `pid` has exited (at once if it has already). Where the
    /// process has no pidfd, `on_exit` runs at once on a thread of its own: a child's reap in it
    /// waits for the exit; anything else cannot tell.
    pub(super) fn watch(&self, pid: u32, on_exit: OnExit) {
        match devremap::pidfd::pidfd_open(pid) {
            Ok(fd) => {
                if self.add.send((fd, on_exit)).is_ok() {
                    let _ = nix::unistd::write(&self.wake, &[1]);
                }
            }
            Err(_) => {
                let spawned =
                    std::thread::Builder::new().name(format!("exit-{pid}")).stack_size(WAITER_STACK).spawn(on_exit);
                if let Err(e) = spawned {
                    log::warn!("cannot watch pid {pid}: {e}; what its exit calls for waits until `delete`");
                }
            }
        }
    }
}

/// The waiting thread: polls the wake pipe and every pidfd added, and runs each one's `OnExit`
/// once its process has exited. Ends when the daemon drops its [`Exits`].
fn wait_all(woken: &OwnedFd, added: &Receiver<(OwnedFd, OnExit)>) {
    let mut watched: Vec<(OwnedFd, OnExit)> = Vec::new();
    loop {
        let exited: Vec<usize> = {
            let mut fds: Vec<PollFd> = std::iter::once(woken.as_fd())
                .chain(watched.iter().map(|(fd, _)| fd.as_fd()))
                .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                // Nothing here can make poll fail but a bug; never spin on it.
                Err(e) => {
                    log::error!("the node daemon's exit watch failed ({e}): containers are torn down at `delete` only");
                    return;
                }
            }
            fds.iter().skip(1).enumerate().filter(|(_, fd)| fd.any().unwrap_or(true)).map(|(i, _)| i).collect()
        };
        // Highest first: swap_remove moves the last entry into the place it empties.
        for i in exited.into_iter().rev() {
            let (_fd, on_exit) = watched.swap_remove(i);
            on_exit();
        }
        let mut byte = [0u8; 64];
        while matches!(nix::unistd::read(woken, &mut byte), Ok(n) if n > 0) {}
        loop {
            match added.try_recv() {
                Ok(entry) => watched.push(entry),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
    }
}
