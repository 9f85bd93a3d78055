//! What the library's daemon start and stop need that takes `unsafe`
//! ([`devremap::runtime::container_daemon::daemon::Processes`]): detaching the daemon before its exec,
//! and pidfds.

use devremap::runtime::container_daemon::daemon::Processes;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

pub struct Host;

impl Processes for Host {
    fn detach(&self, cmd: &mut Command, keep: RawFd) {
        let old_kernel = no_close_range_cloexec();
        // The daemon must not share our session (a terminal's ^C) nor hold a descriptor of our
        // caller's (containerd waits for EOF on the runtime's output pipes). Descriptors are
        // marked close-on-exec rather than closed, so that the pipe `spawn` reports a failed
        // exec through stays open; closing is the fallback before Linux 5.11 (around `keep`).
        // SAFETY: the closure runs in the forked child before exec, and calls only setsid,
        // close_range and fcntl, which are async-signal-safe, allocate nothing and touch only
        // the child.
        unsafe {
            cmd.pre_exec(move || {
                let _ = nix::unistd::setsid();
                let (first, last) = (3u32, u32::MAX);
                if old_kernel || libc::syscall(libc::SYS_close_range, first, last, libc::CLOSE_RANGE_CLOEXEC) != 0 {
                    // Bug (found from outside): a `keep` below 3 (the spare's stdin) closed
                    // stdout and stderr here too: the spare's refusal went nowhere.
                    let keep = keep as u32;
                    if keep > first {
                        libc::syscall(libc::SYS_close_range, first, keep - 1, 0u32);
                    }
                    libc::syscall(libc::SYS_close_range, (keep + 1).max(first), last, 0u32);
                }
                if libc::fcntl(keep, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    fn exit_watch(&self, pid: u32) -> Option<OwnedFd> {
        devremap::pidfd::pidfd_open(pid).ok()
    }
}

/// The test hook `DEVREMAPD_FAILPOINT=no-close-range-cloexec`: a detached process's
/// descriptors are closed as before Linux 5.11, which has no `CLOSE_RANGE_CLOEXEC`.
#[cfg(feature = "test-hooks")]
fn no_close_range_cloexec() -> bool {
    std::env::var("DEVREMAPD_FAILPOINT").is_ok_and(|f| f == "no-close-range-cloexec")
}

#[cfg(not(feature = "test-hooks"))]
fn no_close_range_cloexec() -> bool {
    false
}
