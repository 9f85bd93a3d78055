//! The daemon's watchdog: stop serving when the container it serves is gone, so that no daemon
//! outlives its container, also when whatever started it was killed mid-way.
//!
//! Two flags. `--container-pid-file PATH` names the runtime's pid file of the container's init
//! (`runc create --pid-file`): once it appears, the daemon stops when that process exits.
//! `--owner-pid PID` names the process that started the daemon (`devremap-runtime`): until
//! the pid file appears, the daemon stops when that process exits, since then no one will
//! start the container. Processes are watched through pidfds (Linux 5.3), which cannot
//! confuse a process with a later one reusing its pid; the pid file is looked at every
//! 100 ms until it appears.

use log::info;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

const PID_FILE_POLL: Duration = Duration::from_millis(100);

/// A pidfd for `pid`.
fn pidfd_open(pid: u32) -> io::Result<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this fd, and nothing else owns it.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// Waits up to `timeout` (forever with `None`) for the process behind `fd` to exit.
fn exited(fd: &std::os::fd::OwnedFd, timeout: Option<Duration>) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    loop {
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return rc > 0;
        }
    }
}

/// The pid a runtime's pid file holds, once it holds a whole one.
fn read_pid(path: &Path) -> Option<u32> {
    let devremap::files::SmallText::Text(text) = devremap::files::read_small_text(path, 64) else { return None };
    text.trim().parse().ok().filter(|&pid| pid > 0)
}

/// Starts the watchdog thread; `stop(reason)` is called once, when the daemon must stop.
pub fn spawn(owner: Option<u32>, pid_file: Option<PathBuf>, stop: impl FnOnce(String) + Send + 'static) {
    if owner.is_none() && pid_file.is_none() {
        return;
    }
    std::thread::spawn(move || stop(watch(owner, pid_file.as_deref())));
}

fn watch(owner: Option<u32>, pid_file: Option<&Path>) -> String {
    // An owner already gone (or one we may not watch) is as good as gone.
    let mut owner = owner.map(|pid| (pid, pidfd_open(pid).ok()));
    loop {
        if let Some(pid) = pid_file.and_then(read_pid) {
            info!("watching container process {pid}");
            return match pidfd_open(pid) {
                Ok(fd) => {
                    exited(&fd, None);
                    format!("container process {pid} exited")
                }
                Err(_) => format!("container process {pid} is gone"),
            };
        }
        match &owner {
            Some((pid, fd)) => {
                let gone = fd.as_ref().is_none_or(|fd| exited(fd, Some(PID_FILE_POLL)));
                if gone {
                    // It may have exited right after the runtime wrote the pid file.
                    if pid_file.and_then(read_pid).is_some() {
                        owner = None;
                        continue;
                    }
                    return format!("process {pid} that started us exited before the container started");
                }
            }
            None => std::thread::sleep(PID_FILE_POLL),
        }
    }
}
