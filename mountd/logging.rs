//! The logger: `env_logger`'s lines (default filter `info,fuser=error,fuser::request=off`, as
//! fuser logs a server's end, the keeper closing its socket, as a short read; `RUST_LOG`
//! overrides), millisecond timestamps, the message escaped, written to stderr by a thread of
//! their own.
//!
//! Assumption: nobody may be reading stderr (a pipe whose reader stopped fills up, and then
//! every write to it blocks). So a log call never writes: it hands its line to a bounded queue
//! and returns; the writer thread is the only one that can block on stderr. A line that finds
//! the queue full is dropped and counted ([`dropped`]), so serving, reloading and stopping never
//! wait for a log line.

use devremap::decision::escape::escape;
use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Duration;

/// Lines waiting for stderr before new ones are dropped.
const QUEUE_LINES: usize = 256;

static DROPPED: AtomicU64 = AtomicU64::new(0);
static QUEUE: OnceLock<Bounded> = OnceLock::new();

/// The queue: std's unbounded channel, which allocates its slots as lines come (31 at a time),
/// and a count that bounds it at [`QUEUE_LINES`]. A `sync_channel` of as many allocated them
/// all at the start: 8 KiB live in every keeper and server, two of each container.
struct Bounded {
    tx: Sender<Message>,
    queued: AtomicUsize,
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

/// What `env_logger` writes to: one formatted record per `write` call, into the queue.
struct Queue(&'static Bounded);

impl Write for Queue {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.0.try_send(Message::Line(buf.to_vec())) {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sets the logger up and starts its writer thread.
pub fn init() {
    let (tx, rx) = mpsc::channel();
    let queue = QUEUE.get_or_init(|| Bounded { tx, queued: AtomicUsize::new(0) });
    std::thread::Builder::new().name("log-writer".into()).spawn(move || write_lines(&rx, &queue.queued)).ok();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info,fuser=error,fuser::request=off"))
        .format(log_line)
        .target(env_logger::Target::Pipe(Box::new(Queue(queue))))
        .init();
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

/// Waits for the lines logged so far to reach stderr (before exiting): up to `patience` while
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
        let queue = Bounded { tx, queued: AtomicUsize::new(0) };
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
