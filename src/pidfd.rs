//! Processes watched through pidfds (Linux 5.3), which cannot confuse a process with a later
//! one reusing its pid: shared by the daemon (its watchdog, its servers) and the runtime
//! wrapper (waiting for a daemon to stop). An I/O edge, as [`crate::atomic`] is: the pure
//! core does not use it.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

/// A pidfd for `pid`.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw);
    let pid = pid.ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    Ok(rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?)
}

/// Waits up to `timeout` (forever with `None`) for the process behind `fd` to exit.
pub fn exited(fd: &OwnedFd, timeout: Option<Duration>) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
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
