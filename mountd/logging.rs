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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::time::Duration;

/// Lines waiting for stderr before new ones are dropped.
const QUEUE_LINES: usize = 256;

static DROPPED: AtomicU64 = AtomicU64::new(0);
static QUEUE: OnceLock<SyncSender<Message>> = OnceLock::new();

enum Message {
    Line(Vec<u8>),
    /// Answered once every line queued before it was written.
    Flush(mpsc::Sender<()>),
}

/// What `env_logger` writes to: one formatted record per `write` call, into the queue.
struct Queue(SyncSender<Message>);

impl Write for Queue {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.0.try_send(Message::Line(buf.to_vec()))
        {
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
    let (tx, rx) = mpsc::sync_channel(QUEUE_LINES);
    let _ = QUEUE.set(tx.clone());
    std::thread::Builder::new().name("log-writer".into()).spawn(move || write_lines(&rx)).ok();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info,fuser=error,fuser::request=off"))
        .format(log_line)
        .target(env_logger::Target::Pipe(Box::new(Queue(tx))))
        .init();
}

/// One log record on one line, as env_logger's own format with millisecond timestamps, its
/// message escaped: a name from an input cannot forge a second record or drive a terminal.
fn log_line(buf: &mut env_logger::fmt::Formatter, record: &log::Record) -> std::io::Result<()> {
    let message = record.args().to_string();
    writeln!(buf, "[{} {:<5} {}] {}", buf.timestamp_millis(), record.level(), record.target(), escape(&message))
}

fn write_lines(rx: &Receiver<Message>) {
    let mut stderr = std::io::stderr();
    let slow = slow_writer();
    for message in rx {
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
    if queue.try_send(Message::Flush(tx)).is_err() {
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
