//! Signals for the daemon's processes (the keeper, the server, the node daemon): from their
//! first step on, every asynchronous signal whose default action ends or stops the process is
//! blocked in every thread ([`block`], before the first thread starts) and read from a
//! `signalfd` by one thread, which turns those a process acts on into its events and logs and
//! ignores the others: a thread of their own ([`start`]: the node daemon's, a server's), or the
//! thread that waits for the events ([`reader`]: a keeper's main thread, beside its container's
//! process). One arriving in between waits, pending, for that thread. A signal thread runs the
//! process's other long waits ([`Thread::then`]: a server's lifecycle and control socket),
//! polling the `signalfd` beside what each waits for.
//!
//! Left at their default: SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP, SIGSYS (the kernel sends them
//! as the fault of an instruction: this process is broken). SIGPIPE and SIGXFSZ are swallowed
//! instead (logging them from a write that failed would write again); the write that raised
//! them fails with its error, which the writer handles.
//!
//! Why a `signalfd` and not a handler per signal: `signal_hook` keeps a table of handlers that
//! it copies whole at each registration, 45 of them, and keeps: 25 KiB live and 580 KiB
//! allocated and freed in each process at its start, a keeper and a server each container
//! (docs/performance.md). Assumptions: every thread is started after [`block`] (a thread
//! inherits its creator's mask); a program exec'd from these processes starts with no signal
//! blocked, since std's `Command` empties the mask in the child; a process forked without exec
//! (the zygote's spares, a spare's parked server) calls [`block`] again, as `main` does.

use log::info;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use signal_hook::consts::{SIGPIPE, SIGXFSZ};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

/// Why the signals cannot be taken: the process would then be ended by one it should act on.
#[derive(Debug, thiserror::Error)]
pub enum SignalsError {
    #[error("cannot ignore {}: {}", signal_name(*signal), devremap::io_message(source))]
    Ignore { signal: i32, source: io::Error },
    #[error("cannot read signals (signalfd): {0}")]
    Handle(#[source] Errno),
    #[error("cannot start the signal thread: {0}")]
    Thread(#[source] io::Error),
}

/// Every signal whose default action ends or stops the process and which the kernel does not
/// send as the fault of an instruction nor as the consequence of our own write.
fn handled_signals() -> SigSet {
    use libc::*;
    // And the terminal's stops (SIGTSTP, SIGTTIN, SIGTTOU): a keeper stopped by one would hang
    // every lookup in its container's `/dev` (found from outside); SIGSTOP still stops it.
    let mut all = vec![
        SIGHUP, SIGTERM, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF, SIGIO, SIGPWR, SIGXCPU,
        SIGSTKFLT, SIGTSTP, SIGTTIN, SIGTTOU,
    ];
    all.extend(SIGRTMIN()..=SIGRTMAX());
    let mut set = SigSet::empty();
    // nix's `SigSet::add` takes no real-time signal: the set is the C one underneath.
    let raw: *mut sigset_t = std::ptr::from_mut(&mut set).cast();
    for sig in all {
        // SAFETY: `SigSet` is `repr(transparent)` over an initialised `sigset_t`; each number
        // is a signal of this system's.
        unsafe { sigaddset(raw, sig) };
    }
    set
}

/// Makes SIGPIPE and SIGXFSZ, which the kernel sends the writer of a pipe nobody reads or of a
/// file past `RLIMIT_FSIZE`, leave the process running: the write fails with its error, which
/// the writer handles. Called first thing in `main`, for every command (found from outside: a
/// daemon whose log file was over the limit was ended by SIGXFSZ at its first error line, a
/// bad flag's, before its signals were taken); once per process, as [`start`] calls it again.
/// A handler that only sets a flag nobody reads, installed without `unsafe`: as with SIG_IGN,
/// the signal no longer ends the process, and unlike SIG_IGN it is not passed on to a program
/// exec'd.
pub fn swallow_write_faults() -> Result<(), SignalsError> {
    static SWALLOWED: std::sync::OnceLock<Result<(), (i32, io::ErrorKind)>> = std::sync::OnceLock::new();
    let done = SWALLOWED.get_or_init(|| {
        let swallowed = Arc::new(AtomicBool::new(false));
        for sig in [SIGPIPE, SIGXFSZ] {
            signal_hook::flag::register(sig, swallowed.clone()).map_err(|e| (sig, e.kind()))?;
        }
        Ok(())
    });
    done.map_err(|(signal, kind)| SignalsError::Ignore { signal, source: kind.into() })
}

/// Blocks every handled signal in the calling thread, and so in every thread it starts later:
/// called on the main thread before any other starts (by `main`, for the daemon's commands).
/// Until [`start`]'s thread reads them, they wait.
pub fn block() -> Result<(), SignalsError> {
    ignore_glibcs_own();
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&handled_signals()), None).map_err(SignalsError::Handle)
}

/// Unblocks every handled signal in the calling thread alone: a parked spare's main thread while
/// it waits for its container ([`crate::parked::run`]), so that, as any process that has not
/// taken its signals yet, it ends on `SIGTERM` (and the node daemon starts another) rather than
/// hold the signal for the container it is handed. The threads already started keep them
/// blocked, so it is this thread that a signal finds.
pub fn unblock() -> Result<(), SignalsError> {
    pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&handled_signals()), None).map_err(SignalsError::Handle)
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

/// A signal's name for the log: `SIGUSR1`, `SIGRTMIN+3`, and `SIG32` for one of glibc's own
/// (below its `SIGRTMIN`, see [`ignore_glibcs_own`]).
pub fn signal_name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => s.as_str().to_owned(),
        Err(_) if sig >= libc::SIGRTMIN() => format!("SIGRTMIN+{}", sig - libc::SIGRTMIN()),
        Err(_) => format!("SIG{sig}"),
    }
}

/// The kernel's `struct sigaction` where it has `sa_restorer` (x86-64, arm64).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[repr(C)]
#[derive(Default)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// glibc keeps the first real-time signals (32 and 33, below its `SIGRTMIN`) for itself: its
/// `sigprocmask` leaves them unblocked and its `sigaction` refuses them, and 32's default action
/// ends the process (found from outside: `kill -32` ended a keeper and left its mount dead, and
/// the node daemon). Each one still at its default is set to be ignored with the system call
/// itself (one glibc has a handler for, as 33, is left to it). Nothing is logged of them.
/// Inherited across exec, as any ignored signal: the programs these processes exec are
/// `devremapd`s.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn ignore_glibcs_own() {
    const KERNEL_SIGSET: usize = 8;
    for sig in 32..libc::SIGRTMIN() {
        let mut old = KernelSigaction::default();
        // SAFETY: rt_sigaction with no new action only fills `old`, a kernel `struct sigaction`.
        let read = unsafe {
            libc::syscall(libc::SYS_rt_sigaction, sig, std::ptr::null::<KernelSigaction>(), &mut old, KERNEL_SIGSET)
        };
        if read != 0 || old.handler != libc::SIG_DFL {
            continue;
        }
        let ignored = KernelSigaction { handler: libc::SIG_IGN, ..KernelSigaction::default() };
        // SAFETY: an ignored disposition needs no handler or restorer; the signal is glibc's,
        // which it uses only for pthread_cancel and setxid, neither of which this program calls
        // with it at its default.
        unsafe {
            libc::syscall(libc::SYS_rt_sigaction, sig, &ignored, std::ptr::null_mut::<KernelSigaction>(), KERNEL_SIGSET)
        };
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn ignore_glibcs_own() {}

/// Receives every handled signal for the process's life on a thread of its own (`signals`),
/// passing what `act` makes of one to `events` and logging the others (`act` gives `None`) as
/// ignored, with `why_ignored`. They were blocked by [`block`] (it is called again here, for a
/// caller that did not): those that arrived since wait in the `signalfd` and are handled now,
/// and their events wait in the channel until the main loop runs. A process whose main thread
/// waits on descriptors reads them there instead ([`reader`]).
pub fn start<E: Send + 'static>(
    events: impl Events<E>,
    act: fn(i32) -> Option<E>,
    why_ignored: &'static str,
) -> Result<(), SignalsError> {
    let reader = reader(events, act, why_ignored)?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            reader.wait_for(None, None);
        })
        .map_err(SignalsError::Thread)?;
    Ok(())
}

/// Where a process's events go: its main loop's channel, or a [`Woken`] queue.
pub trait Events<E>: Send + 'static {
    /// False once nobody takes them.
    fn send_event(&self, event: E) -> bool;
}

impl<E: Send + 'static> Events<E> for Sender<E> {
    fn send_event(&self, event: E) -> bool {
        self.send(event).is_ok()
    }
}

/// A channel whose receiver also waits on descriptors (a server's lifecycle, run on the signal
/// thread beside its control socket: issue 31's threads per container): each event sent makes
/// [`Woken::fd`] readable, so a [`Reader::wait_for_any`] on it returns. Sent from any thread.
pub struct Woken<E> {
    events: Sender<E>,
    wake: Arc<UnixStream>,
}

impl<E> Clone for Woken<E> {
    fn clone(&self) -> Self {
        Woken { events: self.events.clone(), wake: self.wake.clone() }
    }
}

/// The receiving end of a [`Woken`] queue.
pub struct Waking<E> {
    events: mpsc::Receiver<E>,
    woken: UnixStream,
}

/// A [`Woken`] queue and its receiving end.
pub fn woken<E>() -> io::Result<(Woken<E>, Waking<E>)> {
    let (wake, woken) = UnixStream::pair()?;
    wake.set_nonblocking(true)?;
    woken.set_nonblocking(true)?;
    let (events, received) = mpsc::channel();
    Ok((Woken { events, wake: Arc::new(wake) }, Waking { events: received, woken }))
}

impl<E: Send + 'static> Events<E> for Woken<E> {
    fn send_event(&self, event: E) -> bool {
        let sent = self.events.send(event).is_ok();
        self.wake();
        sent
    }
}

impl<E> Woken<E> {
    /// Wakes the receiving end with no event: something it polls for besides them is ready.
    pub fn wake(&self) {
        // Full only if wake-ups are already waiting to be read, which is as good.
        let _ = (&*self.wake).write(&[1]);
    }

    pub fn send(&self, event: E) -> bool
    where
        E: Send + 'static,
    {
        self.send_event(event)
    }
}

impl<E> Waking<E> {
    /// What to wait on for the next event.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.woken.as_fd()
    }

    /// Every event sent so far; the wake-ups are read first, so that one sent after is not lost.
    pub fn take(&self) -> Vec<E> {
        let mut buf = [0; 64];
        while (&self.woken).read(&mut buf).is_ok_and(|n| n > 0) {}
        self.events.try_iter().collect()
    }
}

/// The signals, read by the thread that waits with the returned [`Reader`] (a keeper's main
/// thread, which waits for its events and its container there: issue 31's threads per
/// container), each passed to `events` as `act` makes it, or logged as ignored, as [`start`]'s
/// thread does. They were blocked by [`block`] (called again here) and wait until then.
pub fn reader<E: Send + 'static>(
    events: impl Events<E>,
    act: fn(i32) -> Option<E>,
    why_ignored: &'static str,
) -> Result<Reader, SignalsError> {
    swallow_write_faults()?;
    block()?;
    let fd = SignalFd::with_flags(&handled_signals(), SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(SignalsError::Handle)?;
    let ignored = parking_lot::Mutex::new(Ignored::default());
    Ok(Reader { fd, forward: Box::new(move |sig| forward(&events, act, why_ignored, &ignored, sig)) })
}

/// Passes `sig` on as its event, or logs it as ignored; false once nobody takes events.
fn forward<E>(
    events: &impl Events<E>,
    act: fn(i32) -> Option<E>,
    why_ignored: &str,
    ignored: &parking_lot::Mutex<Ignored>,
    sig: i32,
) -> bool {
    match act(sig) {
        Some(event) => events.send_event(event),
        None => {
            let name = signal_name(sig);
            match ignored.lock().note(sig, Instant::now()) {
                Said::Line(0) => info!("signal {name}: ignored{why_ignored}"),
                Said::Line(unsaid) => {
                    info!("signal {name}: ignored{why_ignored} (and {unsaid} more before it, not logged)")
                }
                Said::LastThisSecond => info!(
                    "signal {name}: ignored{why_ignored}; {IGNORED_LINES_PER_SECOND} in a second: more this second are counted, not logged"
                ),
                Said::Counted => {}
            }
            true
        }
    }
}

/// `left` as poll's timeout: whole milliseconds, rounded up. Rounded down, the last one was
/// polled for with no wait, over and over (found from outside: 20,000 polls a second while a
/// keeper waited for its container). Past poll's range (24 days) is as good as forever.
pub(crate) fn poll_timeout(left: Duration) -> PollTimeout {
    let ms = left.as_micros().div_ceil(1000);
    i32::try_from(ms).ok().and_then(|ms| PollTimeout::try_from(ms).ok()).unwrap_or(PollTimeout::MAX)
}

/// Lines said per second about each ignored signal: a flood of one (anyone who may signal the
/// process may send 100,000) must not fill the log's disk, now that a log file on a local file
/// system takes every line (`crate::logging`).
const IGNORED_LINES_PER_SECOND: u32 = 5;

/// For each ignored signal seen, the lines about it in the current second, and those not said.
/// Empty (allocating nothing) until a signal is ignored.
#[derive(Default)]
struct Ignored(std::collections::HashMap<i32, Window>);

#[derive(Clone, Copy)]
struct Window {
    second: Instant,
    said: u32,
    unsaid: u64,
}

/// What is said of one more ignored signal.
#[derive(Debug, PartialEq, Eq)]
enum Said {
    /// Its line, with the count of those not said since its last line.
    Line(u64),
    /// Its line, saying that the rest of this second's are counted, not said: so a burst that
    /// ends before the next second shows in the log even if no later one comes to say its
    /// count (found from outside).
    LastThisSecond,
    /// Counted only.
    Counted,
}

impl Ignored {
    /// Signal `sig` ignored at `now`: what of it is said.
    fn note(&mut self, sig: i32, now: Instant) -> Said {
        let window = self.0.entry(sig).or_insert(Window { second: now, said: 0, unsaid: 0 });
        if now.duration_since(window.second) >= Duration::from_secs(1) {
            window.second = now;
            window.said = 0;
        }
        window.said = window.said.saturating_add(1);
        match window.said.cmp(&IGNORED_LINES_PER_SECOND) {
            std::cmp::Ordering::Less => Said::Line(std::mem::take(&mut window.unsaid)),
            std::cmp::Ordering::Equal => {
                window.unsaid = 0;
                Said::LastThisSecond
            }
            std::cmp::Ordering::Greater => {
                window.unsaid += 1;
                Said::Counted
            }
        }
    }
}

/// The `signalfd`, and what a signal read from it becomes.
pub struct Reader {
    fd: SignalFd,
    forward: Box<dyn Fn(i32) -> bool + Send>,
}

/// How [`Reader::wait_for`] ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Waited {
    /// The descriptor at this index is readable (or at its end, or in error: a read says
    /// which).
    Ready(usize),
    /// The time was up first.
    TimedOut,
    /// Nobody takes the signals' events any more, or they can no longer be read: the process
    /// is ending.
    Gone,
}

impl Reader {
    /// Waits up to `timeout` (forever with `None`) for `fd` to be readable (with no `fd`, for
    /// the time alone), handling every signal that comes meanwhile.
    pub fn wait_for(&self, fd: Option<BorrowedFd>, timeout: Option<Duration>) -> Waited {
        self.wait_for_any(fd.as_slice(), timeout)
    }

    /// Polls `fds` (each for what it asks) and the signals once, up to `timeout` (forever with
    /// `None`), handling every signal that came: the caller reads each one's `revents`. False
    /// once the signals can no longer be waited for (see [`Waited::Gone`]).
    pub fn poll_with<'a>(&'a self, fds: &mut Vec<PollFd<'a>>, timeout: Option<Duration>) -> bool {
        fds.push(PollFd::new(self.fd.as_fd(), PollFlags::POLLIN));
        let polled = poll(fds, timeout.map_or(PollTimeout::NONE, poll_timeout));
        let signalled = fds.pop().and_then(|p| p.revents()).is_some_and(|r| !r.is_empty());
        match polled {
            Ok(_) | Err(Errno::EINTR) => !signalled || self.take_pending(),
            Err(e) => {
                log::warn!("cannot wait for signals any more: {e}; they stay blocked");
                false
            }
        }
    }

    /// Waits up to `timeout` (forever with `None`) for one of `fds` to be readable, handling
    /// every signal that comes meanwhile: `Ready(i)`, `fds[i]` the first readable one.
    pub fn wait_for_any(&self, fds: &[BorrowedFd], timeout: Option<Duration>) -> Waited {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let mut polled: Vec<PollFd> = fds.iter().map(|fd| PollFd::new(*fd, PollFlags::POLLIN)).collect();
            if !self.poll_with(&mut polled, left) {
                return Waited::Gone;
            }
            if let Some(i) = polled.iter().position(|p| p.revents().is_some_and(|r| !r.is_empty())) {
                return Waited::Ready(i);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Waited::TimedOut;
            }
        }
    }

    /// Handles the signals pending, at most [`SIGNALS_PER_WAKE`] of them; false once nobody
    /// takes their events, or the `signalfd` fails.
    fn take_pending(&self) -> bool {
        for _ in 0..SIGNALS_PER_WAKE {
            match self.fd.read_signal() {
                Ok(Some(info)) => {
                    if !(self.forward)(info.ssi_signo as i32) {
                        return false;
                    }
                }
                Ok(None) => return true,
                Err(Errno::EINTR) => {}
                Err(e) => {
                    log::warn!("cannot read signals any more: {e}; they stay blocked");
                    return false;
                }
            }
        }
        true
    }
}

/// Signals handled per wake-up before the descriptors waited on beside them are looked at:
/// real-time signals queue (up to the user's `RLIMIT_SIGPENDING`, about 100,000), and a
/// sender that keeps the queue full kept a keeper's main thread reading them, its events
/// (a server's death, its own stop) waiting for the flood's end (found from outside).
const SIGNALS_PER_WAKE: usize = 64;

#[cfg(test)]
mod ignored_tests {
    use super::*;

    /// Bug (found from outside, 2026-12-04, once a keeper read its signals on its main
    /// thread): real-time signals queue (about 100,000 deep), and a wake-up read them until
    /// none was left: a sender keeping the queue full kept the keeper's events (a server's
    /// death, its own `SIGTERM`) waiting for the flood's end, 5 to 14 s. A wake-up handles at
    /// most [`SIGNALS_PER_WAKE`], then the descriptors beside them are looked at.
    #[test]
    fn a_wake_up_handles_a_bounded_number_of_signals() {
        let (events, taken) = mpsc::channel();
        let reader = reader(events, Some, "").unwrap();
        let sig = libc::SIGRTMIN() + 5;
        for _ in 0..2 * SIGNALS_PER_WAKE + 1 {
            // SAFETY: a real-time signal to this thread, which blocks it (`reader` did).
            assert_eq!(unsafe { libc::pthread_kill(libc::pthread_self(), sig) }, 0);
        }
        for expected in [SIGNALS_PER_WAKE, SIGNALS_PER_WAKE, 1, 0] {
            assert!(reader.take_pending());
            assert_eq!(taken.try_iter().count(), expected);
        }
    }

    /// Bug (found from outside, 2026-12-04): the time left was rounded down to whole
    /// milliseconds, so under one millisecond before a deadline poll was asked to wait for
    /// none, over and over: a keeper waiting for its container spun. It is rounded up.
    #[test]
    fn a_wait_under_a_millisecond_polls_for_a_whole_one() {
        assert_eq!(poll_timeout(Duration::from_micros(1)), PollTimeout::from(1u16));
        assert_eq!(poll_timeout(Duration::from_micros(999)), PollTimeout::from(1u16));
        assert_eq!(poll_timeout(Duration::from_micros(99_001)), PollTimeout::from(100u16));
        assert_eq!(poll_timeout(Duration::ZERO), PollTimeout::ZERO);
        assert_eq!(poll_timeout(Duration::from_secs(100 * 86_400)), PollTimeout::MAX);
    }

    /// Rule: at most IGNORED_LINES_PER_SECOND lines a second about each ignored signal; the
    /// rest are counted and the count said on its next line, in a later second. Another
    /// signal has its own lines.
    #[test]
    fn a_flood_of_one_ignored_signal_is_logged_five_a_second_and_counted() {
        let mut ignored = Ignored::default();
        let start = Instant::now();
        let said: Vec<Said> = (0..25).map(|_| ignored.note(libc::SIGUSR1, start)).collect();
        let allowed = IGNORED_LINES_PER_SECOND as usize;
        assert!(said[..allowed - 1].iter().all(|s| *s == Said::Line(0)), "{said:?}");
        assert_eq!(said[allowed - 1], Said::LastThisSecond, "the last line says the rest are counted");
        assert!(said[allowed..].iter().all(|s| *s == Said::Counted), "{said:?}");
        assert_eq!(ignored.note(libc::SIGALRM, start), Said::Line(0), "another signal is said");
        assert_eq!(ignored.note(libc::SIGUSR1, start + Duration::from_millis(999)), Said::Counted);
        assert_eq!(ignored.note(libc::SIGUSR1, start + Duration::from_secs(1)), Said::Line(21), "the 21 counted");
        assert_eq!(ignored.note(libc::SIGUSR1, start + Duration::from_secs(1)), Said::Line(0));
    }
}
