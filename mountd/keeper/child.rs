//! A server process of the keeper's: one it spawned (an exec of its binary, a
//! [`std::process::Child`]), or the spare keeper's first server, forked from the keeper before
//! the keeper had a second thread and never exec'd ([`super::spawner::park_server`]), which the
//! standard library has no handle for.
//!
//! Assumptions: either is our child, unreaped until [`ServerChild::wait`] returns, so its pid
//! names it alone until then; a kill after that signals nothing.

use nix::errno::Errno;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};

/// A server process: spawned, or forked.
pub(crate) enum ServerChild {
    Spawned(Child),
    Forked { pid: libc::pid_t, status: Option<ExitStatus> },
}

impl ServerChild {
    /// A child forked as `pid`.
    pub(super) fn forked(pid: libc::pid_t) -> ServerChild {
        ServerChild::Forked { pid, status: None }
    }

    pub(crate) fn id(&self) -> u32 {
        match self {
            ServerChild::Spawned(child) => child.id(),
            ServerChild::Forked { pid, .. } => *pid as u32,
        }
    }

    /// `SIGKILL`, unless it was reaped already.
    pub(crate) fn kill(&mut self) -> io::Result<()> {
        match self {
            ServerChild::Spawned(child) => child.kill(),
            ServerChild::Forked { status: Some(_), .. } => Ok(()),
            // SAFETY: kill(2) on our own unreaped child.
            ServerChild::Forked { pid, status: None } => match unsafe { libc::kill(*pid, libc::SIGKILL) } {
                0 => Ok(()),
                _ => Err(io::Error::last_os_error()),
            },
        }
    }

    /// Waits for its exit and reaps it; its status again when reaped already.
    pub(crate) fn wait(&mut self) -> io::Result<ExitStatus> {
        match self {
            ServerChild::Spawned(child) => child.wait(),
            ServerChild::Forked { status: Some(status), .. } => Ok(*status),
            ServerChild::Forked { pid, status } => {
                let mut raw = 0;
                // SAFETY: waitpid(2) on our own child, into a local.
                while unsafe { libc::waitpid(*pid, &mut raw, 0) } < 0 {
                    if Errno::last() != Errno::EINTR {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(*status.insert(ExitStatus::from_raw(raw)))
            }
        }
    }
}
