//! The wait of every main loop that also has a timer (the server's lifecycle, the keeper's).

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

/// What [`wait`] got.
#[derive(Debug)]
pub enum Waited<E> {
    Event(E),
    /// The deadline passed first.
    Deadline,
    /// Every sender is gone.
    Closed,
}

/// The next event on `rx`, waiting at most until `deadline` (for ever without one): the wait
/// of every main loop that also has a timer.
pub fn wait<E>(rx: &Receiver<E>, deadline: Option<Instant>) -> Waited<E> {
    let got = match deadline {
        Some(deadline) => rx.recv_timeout(deadline.saturating_duration_since(Instant::now())),
        None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
    };
    match got {
        Ok(event) => Waited::Event(event),
        Err(RecvTimeoutError::Timeout) => Waited::Deadline,
        Err(RecvTimeoutError::Disconnected) => Waited::Closed,
    }
}
