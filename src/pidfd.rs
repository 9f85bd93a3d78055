//! Processes watched through pidfds (Linux 5.3), which cannot confuse a process with a later
//! one reusing its pid: shared by the daemon (its watchdog, its servers) and the runtime
//! wrapper (waiting for a daemon to stop). An I/O edge, as [`crate::atomic`] is: the pure
//! core does not use it.

use nix::poll::PollFlags;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

/// A pidfd for `pid`.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw);
    let pid = pid.ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?)
}

/// Waits up to `timeout` (forever with `None`) for the process behind `fd` to exit.
pub fn exited(fd: &OwnedFd, timeout: Option<Duration>) -> bool {
    exited_or(fd, None, timeout)
}

/// [`exited`], or until `other` shows one of its events (a socket's end, say), whichever
/// comes first: whether either came.
pub fn exited_or(fd: &OwnedFd, other: Option<(BorrowedFd<'_>, PollFlags)>, timeout: Option<Duration>) -> bool {
    use nix::poll::{PollFd, PollTimeout};
    let mut fds = vec![PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    fds.extend(other.map(|(fd, events)| PollFd::new(fd, events)));
    // A timeout past poll's range (24 days) is as good as forever.
    let timeout = timeout.map_or(PollTimeout::NONE, |t| PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX));
    loop {
        match nix::poll::poll(&mut fds, timeout) {
            Err(nix::errno::Errno::EINTR) => continue,
            rc => return rc.is_ok_and(|n| n > 0),
        }
    }
}

/// Whether process `pid` exits within `timeout` (not reaped here). A pidfd that cannot be had
/// means the process is already gone.
pub fn exits_within(pid: u32, timeout: Duration) -> bool {
    match pidfd_open(pid) {
        Ok(fd) => exited(&fd, Some(timeout)),
        Err(_) => true,
    }
}

/// A child process: one spawned (an exec, [`std::process::Child`]), or one forked and never
/// exec'd (a spare keeper's server, the node daemon's spare keepers), which the standard library
/// has no handle for. Assumption: a forked one is our child, unreaped until [`Child::wait`]
/// returns, so its pid names it alone until then; a kill after that signals nothing.
pub enum Child {
    Spawned(std::process::Child),
    Forked { pid: u32, status: Option<std::process::ExitStatus> },
}

impl Child {
    /// Our child `pid`, forked.
    pub fn forked(pid: u32) -> Child {
        Child::Forked { pid, status: None }
    }

    pub fn id(&self) -> u32 {
        match self {
            Child::Spawned(child) => child.id(),
            Child::Forked { pid, .. } => *pid,
        }
    }

    /// `SIGKILL`, unless it was reaped already.
    pub fn kill(&mut self) -> io::Result<()> {
        match self {
            Child::Spawned(child) => child.kill(),
            Child::Forked { status: Some(_), .. } => Ok(()),
            Child::Forked { pid, status: None } => {
                Ok(nix::sys::signal::kill(nix_pid(*pid)?, nix::sys::signal::Signal::SIGKILL)?)
            }
        }
    }

    /// Waits for its exit and reaps it; its status again once reaped.
    pub fn wait(&mut self) -> io::Result<std::process::ExitStatus> {
        self.reap(true)?.ok_or_else(|| io::Error::other("a blocking wait returned no status"))
    }

    /// Its status if it has exited (reaping it), `None` while it runs.
    pub fn try_wait(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        self.reap(false)
    }

    /// Through rustix, whose status is the raw one: nix's `waitpid` names the signal that ended
    /// a process with its `Signal`, which has no real-time signals, and so failed (EINVAL) for
    /// a child it had reaped already, its status lost (found from outside: a spare killed by
    /// `SIGRTMIN+6` was never said to have ended).
    fn reap(&mut self, block: bool) -> io::Result<Option<std::process::ExitStatus>> {
        use rustix::process::{Pid, WaitOptions, waitpid};
        use std::os::unix::process::ExitStatusExt;
        let (pid, status) = match self {
            Child::Spawned(child) if block => return child.wait().map(Some),
            Child::Spawned(child) => return child.try_wait(),
            Child::Forked { status: Some(status), .. } => return Ok(Some(*status)),
            Child::Forked { pid, status } => (*pid, status),
        };
        let pid = i32::try_from(pid).ok().and_then(Pid::from_raw).ok_or(io::Error::from_raw_os_error(libc::ESRCH))?;
        let options = if block { WaitOptions::empty() } else { WaitOptions::NOHANG };
        loop {
            match waitpid(Some(pid), options) {
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
                Ok(None) => return Ok(None),
                // Stopped or continued: not waited for (no WUNTRACED), so not seen; wait on.
                Ok(Some((_, waited))) if waited.stopped() || waited.continued() => {}
                Ok(Some((_, waited))) => {
                    return Ok(Some(*status.insert(std::process::ExitStatus::from_raw(waited.as_raw()))));
                }
            }
        }
    }
}

fn nix_pid(pid: u32) -> io::Result<nix::unistd::Pid> {
    i32::try_from(pid).map(nix::unistd::Pid::from_raw).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    /// Bug (found from outside): a forked child ended by a real-time signal was reaped, and its
    /// status lost (nix's `waitpid` cannot name such a signal, so it failed with EINVAL). The
    /// status says the signal, and a second wait gives it again.
    #[test]
    #[expect(clippy::zombie_processes, reason = "reaped by `Child::forked`, the code under test")]
    fn a_child_ended_by_a_real_time_signal_is_reaped_with_its_status() {
        let spawned = std::process::Command::new("sh").args(["-c", "kill -s RTMIN+6 $$; sleep 10"]).spawn().unwrap();
        let mut child = Child::forked(spawned.id());
        let status = child.wait().expect("reaped");
        assert_eq!(status.signal(), Some(libc::SIGRTMIN() + 6), "{status:?}");
        assert_eq!(child.try_wait().unwrap(), Some(status), "the status is kept");
    }
}
