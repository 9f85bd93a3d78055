//! The logger: `env_logger`'s lines (default filter `info`; `RUST_LOG` overrides), millisecond timestamps, the message escaped, written to stderr.
//!
//! Assumption: nobody may be reading stderr (a pipe whose reader stopped fills up, and then
//! every write to it blocks), and a file system may block writes (a frozen one). So where
//! stderr is anything but a regular file on tmpfs, a log call never writes: it hands its line to a bounded queue and returns; a writer
//! thread, started with the first line, is the only one that can block on stderr. A line that
//! finds the queue full is dropped and counted ([`dropped`]), so serving, reloading and
//! stopping never wait for a log line. A regular file on tmpfs (the node daemon's
//! `<state-dir>/<id>/devremapd.log`, on `/run`) takes a line at once, from memory: each line is
//! written by the thread that logs it, and no writer thread is started (one thread fewer in
//! each of a container's two processes, issue 31). A line a full tmpfs refuses is counted
//! dropped, as a pipe's are.
//!
//! Which of the two is decided when stderr is known: at [`init`], and again by
//! [`stderr_replaced`] (a spare, handed the container's log), unless a writer thread was
//! started by then (its queued lines must stay ahead of later ones).

use devremap::decision::escape::escape;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Lines waiting for stderr before new ones are dropped.
const QUEUE_LINES: usize = 256;

static DROPPED: AtomicU64 = AtomicU64::new(0);
static QUEUE: OnceLock<Bounded> = OnceLock::new();
/// Whether lines are written by the thread that logs them (see the module's doc).
static AT_ONCE: AtomicBool = AtomicBool::new(false);
/// Held while the choice between the two is made or acted on, so that no line is queued after
/// a switch to writing at once, nor written at once after the queue started.
static CHOICE: Mutex<()> = Mutex::new(());
/// Set, under [`CHOICE`], once the writer thread is started: lines stay queued from then on.
static STARTED: AtomicBool = AtomicBool::new(false);

/// The queue: std's unbounded channel, which allocates its slots as lines come (31 at a time),
/// and a count that bounds it at [`QUEUE_LINES`]. A `sync_channel` of as many allocated them
/// all at the start: 8 KiB live in every keeper and server, two of each container.
struct Bounded {
    tx: Sender<Message>,
    queued: Arc<AtomicUsize>,
}

impl Bounded {
    /// Queues `message` unless [`QUEUE_LINES`] wait already, or the writer is gone.
    fn try_send(&self, message: Message) -> bool {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= QUEUE_LINES {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        if self.tx.send(message).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }
}

enum Message {
    Line(Vec<u8>),
    /// Answered once every line queued before it was written.
    Flush(mpsc::Sender<()>),
}

/// What `env_logger` writes to: one formatted record per `write` call, written to stderr at
/// once or queued for the writer thread.
struct Lines;

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = if AT_ONCE.load(Ordering::Acquire) {
            std::io::stderr().write_all(buf).is_ok()
        } else {
            queue().try_send(Message::Line(buf.to_vec()))
        };
        if !written {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sets the logger up, deciding how lines reach stderr.
pub fn init() {
    stderr_replaced();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(log_line)
        .target(env_logger::Target::Pipe(Box::new(Lines)))
        .init();
}

/// Decides again how lines reach stderr, which the caller has just replaced (a spare takes the
/// container's log as its stderr after [`init`]). Once a writer thread runs, lines stay queued.
pub fn stderr_replaced() {
    let _choice = CHOICE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !STARTED.load(Ordering::Acquire) {
        AT_ONCE.store(stderr_takes_lines_at_once(), Ordering::Release);
    }
}

/// The queue, and its writer thread started with the first line that needs it.
fn queue() -> &'static Bounded {
    QUEUE.get_or_init(|| {
        let _choice = CHOICE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        STARTED.store(true, Ordering::Release);
        AT_ONCE.store(false, Ordering::Release);
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let counted = queued.clone();
        std::thread::Builder::new().name("log-writer".into()).spawn(move || write_lines(&rx, &counted)).ok();
        Bounded { tx, queued }
    })
}

/// Whether stderr is a regular file on tmpfs, which takes a line without making its
/// writer wait on anything but memory, or fail at once (a full file system). Not a file on a
/// disk's file system: `fsfreeze` (a snapshot, a backup) blocks every write to one until it is
/// thawed, which held a reload, a stop and a dead server's replacement for the whole freeze
/// (found from outside); tmpfs cannot be frozen. Not a pipe, socket or terminal either. The
/// test hook `slow-log-writer` keeps the writer thread, whose pace it sets.
fn stderr_takes_lines_at_once() -> bool {
    use nix::sys::stat::{SFlag, fstat};
    use nix::sys::statfs::{TMPFS_MAGIC, fstatfs};
    let stderr = std::io::stderr();
    let regular =
        fstat(&stderr).is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG);
    regular && slow_writer().is_none() && fstatfs(&stderr).is_ok_and(|fs| fs.filesystem_type() == TMPFS_MAGIC)
}

/// One log record on one line, as env_logger's own format with millisecond timestamps, its
/// message escaped: a name from an input cannot forge a second record or drive a terminal.
fn log_line(buf: &mut env_logger::fmt::Formatter, record: &log::Record) -> std::io::Result<()> {
    let message = record.args().to_string();
    writeln!(buf, "[{} {:<5} {}] {}", buf.timestamp_millis(), record.level(), record.target(), escape(&message))
}

fn write_lines(rx: &Receiver<Message>, queued: &AtomicUsize) {
    let mut stderr = std::io::stderr();
    let slow = slow_writer();
    for message in rx {
        queued.fetch_sub(1, Ordering::AcqRel);
        if let Some(pause) = slow {
            std::thread::sleep(pause);
        }
        match message {
            Message::Line(line) => {
                if stderr.write_all(&line).is_err() {
                    DROPPED.fetch_add(1, Ordering::Relaxed);
                }
            }
            Message::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

/// The test hook `DEVREMAPD_FAILPOINT=slow-log-writer:MS`: the writer thread takes MS
/// milliseconds before each message, as on a machine too busy to run it.
#[cfg(feature = "test-hooks")]
fn slow_writer() -> Option<Duration> {
    let ms = std::env::var("DEVREMAPD_FAILPOINT").ok()?.strip_prefix("slow-log-writer:")?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

#[cfg(not(feature = "test-hooks"))]
fn slow_writer() -> Option<Duration> {
    None
}

/// Log lines dropped so far because stderr could not take them.
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// At a keeper's or server's end: says how many lines were dropped, if any were, as a line of
/// `target` (the caller's module).
pub fn warn_if_dropped(target: &str) {
    if dropped() > 0 {
        log::warn!(
            target: target,
            "{} log lines were dropped: stderr took them slower than they came (not read, or a flood)",
            dropped()
        );
    }
}

/// How long [`flush`] waits for a writer that stderr is taking lines from: on a busy machine
/// the writer thread may not run for a while, and the lines (the `error:` line after them)
/// must not be lost for it.
const WRITABLE_PATIENCE: Duration = Duration::from_secs(10);

/// Waits for the lines logged so far to reach stderr (before exiting; written at once, they
/// have): up to `patience` while
/// stderr cannot take a line (a pipe nobody reads), up to [`WRITABLE_PATIENCE`] while it can;
/// gives up at once when the queue is full, since then stderr is not being read. Returns
/// whether they did.
///
/// Bug (issue 33, found from outside): a plain 200 ms wait ran out on a machine at load 4 with
/// stderr read, and `devremapd` exited 1 without its `error:` line (5 of 12,000 runs).
pub fn flush(patience: Duration) -> bool {
    let Some(queue) = QUEUE.get() else { return true };
    let (tx, rx) = mpsc::channel();
    if !queue.try_send(Message::Flush(tx)) {
        return false;
    }
    let start = std::time::Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(()) => return true,
            Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let waited = start.elapsed();
        if waited >= WRITABLE_PATIENCE || (waited >= patience && !stderr_writable()) {
            return false;
        }
    }
}

/// Whether stderr can take a line now without blocking (for a pipe: at least `PIPE_BUF` free).
fn stderr_writable() -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let stderr = std::io::stderr();
    let mut fds = [PollFd::new(std::os::fd::AsFd::as_fd(&stderr), PollFlags::POLLOUT)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
        && fds[0].revents().is_some_and(|r| r.contains(PollFlags::POLLOUT))
}

#[cfg(test)]
mod bounded_tests {
    use super::*;

    /// The queue holds at most `QUEUE_LINES` messages: one more is refused (the caller counts it
    /// dropped) until the writer takes one; with the writer gone, every message is refused.
    #[test]
    fn the_queue_is_bounded_and_refuses_once_the_writer_is_gone() {
        let (tx, rx) = mpsc::channel();
        let queue = Bounded { tx, queued: Arc::new(AtomicUsize::new(0)) };
        for _ in 0..QUEUE_LINES {
            assert!(queue.try_send(Message::Line(b"x\n".to_vec())));
        }
        assert!(!queue.try_send(Message::Line(b"one too many\n".to_vec())));
        rx.recv().unwrap();
        queue.queued.fetch_sub(1, Ordering::AcqRel);
        assert!(queue.try_send(Message::Line(b"room again\n".to_vec())));
        drop(rx);
        queue.queued.store(0, Ordering::Release);
        assert!(!queue.try_send(Message::Line(b"nobody writes\n".to_vec())));
        assert_eq!(queue.queued.load(Ordering::Acquire), 0, "a refused message is not counted");
    }
}
