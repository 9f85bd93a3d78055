//! Signals for the daemon's two processes: from the first step on, every asynchronous signal
//! whose default action ends the process is received by one thread, which turns those a
//! process acts on into its events and logs and ignores the others.
//!
//! Left at their default: SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP, SIGSYS (the kernel sends them
//! as the fault of an instruction: this process is broken). SIGPIPE and SIGXFSZ are swallowed
//! instead (logging them from a write that failed would write again); the write that raised
//! them fails with its error, which the writer handles.

use log::info;
use nix::errno::Errno;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use signal_hook::consts::{SIGPIPE, SIGXFSZ};
use signal_hook::iterator::Signals;
use std::io;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;

/// Why the signals cannot be taken: the process would then be ended by one it should act on.
#[derive(Debug, thiserror::Error)]
pub enum SignalsError {
    #[error("cannot ignore {}: {}", signal_name(*signal), devremap::io_message(source))]
    Ignore { signal: i32, source: io::Error },
    #[error("cannot handle signals: {0}")]
    Handle(#[source] io::Error),
    #[error("cannot start the signal thread: {0}")]
    Thread(#[source] io::Error),
    #[error("cannot unblock SIGHUP, SIGTERM, SIGINT and SIGUSR2: {0}")]
    Unblock(#[source] Errno),
}

/// Every signal whose default action ends the process and which the kernel does not send as the
/// fault of an instruction nor as the consequence of our own write.
fn handled_signals() -> Vec<i32> {
    use libc::*;
    let mut all = vec![
        SIGHUP, SIGTERM, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF, SIGIO, SIGPWR, SIGXCPU,
        SIGSTKFLT,
    ];
    all.extend(SIGRTMIN()..=SIGRTMAX());
    all
}

/// What a daemon of ours (the keeper, the node daemon) does on a signal it acts on.
pub enum Acted {
    /// `SIGHUP`.
    Reload,
    /// `SIGUSR2`.
    Upgrade,
    /// `SIGTERM`, `SIGINT`: why, for the log.
    Stop(String),
}

/// What `sig` asks of a daemon, if anything.
pub fn acted(sig: i32) -> Option<Acted> {
    match sig {
        libc::SIGHUP => Some(Acted::Reload),
        libc::SIGUSR2 => Some(Acted::Upgrade),
        libc::SIGTERM | libc::SIGINT => Some(Acted::Stop(format!("signal {}", signal_name(sig)))),
        _ => None,
    }
}

/// A signal's name for the log: `SIGUSR1`, `SIGRTMIN+3`.
pub fn signal_name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => s.as_str().to_owned(),
        Err(_) => format!("SIGRTMIN+{}", sig - libc::SIGRTMIN()),
    }
}

/// Receives every handled signal for the process's life, passing what `act` makes of one to
/// `events` and logging the others (`act` gives `None`) as ignored, with `why_ignored`. Called
/// first thing, so that from then on none of them ends the process: until the main loop runs,
/// their events wait in the channel. Then unblocks SIGHUP, SIGTERM, SIGINT and SIGUSR2 in this
/// thread (and so in the threads it starts later): a signal mask is inherited across exec, and
/// a daemon started with them blocked would never act on them; one that arrived before now,
/// held pending, is handled here.
pub fn start<E: Send + 'static>(
    events: Sender<E>,
    act: fn(i32) -> Option<E>,
    why_ignored: &'static str,
) -> Result<(), SignalsError> {
    // A handler that only sets a flag nobody reads, installed without `unsafe`: as with
    // SIG_IGN, the signal no longer ends the process.
    let swallowed = Arc::new(AtomicBool::new(false));
    for sig in [SIGPIPE, SIGXFSZ] {
        signal_hook::flag::register(sig, swallowed.clone())
            .map_err(|source| SignalsError::Ignore { signal: sig, source })?;
    }
    let mut signals = Signals::new(handled_signals()).map_err(SignalsError::Handle)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                let Some(event) = act(sig) else {
                    info!("signal {}: ignored{why_ignored}", signal_name(sig));
                    continue;
                };
                if events.send(event).is_err() {
                    break;
                }
            }
        })
        .map_err(SignalsError::Thread)?;
    let acted_on: SigSet = [Signal::SIGHUP, Signal::SIGTERM, Signal::SIGINT, Signal::SIGUSR2].into_iter().collect();
    pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&acted_on), None).map_err(SignalsError::Unblock)
}
