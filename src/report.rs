//! How a binary's command fails: the one error both binaries (`devremapd`,
//! `devremap-runtime`) end with, which their `main` turns into the one error line and exit
//! status 1. The library's own errors are typed per module; a binary formats them, with the
//! path or flag at fault, into a [`Failure::Message`].
//!
//! Assumption: exactly one process says a failure. A `devremapd serve` that fails before it
//! serves sends its error to its keeper, which reports it as the error of the command the user
//! ran; the server then ends with [`Failure::Reported`] and prints nothing more.

use std::fmt;

/// A command's failure.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// What went wrong, the text of the error line.
    #[error("{0}")]
    Message(String),
    /// Reported already, by the process whose job that was: nothing more is printed.
    #[error("reported already")]
    Reported,
    /// A failure, and each thing that could not be undone after it (a daemon not stopped, a
    /// directory not removed), in the order they were tried.
    #[error("{why}{}", NotUndone(.not_undone))]
    Undone { why: String, not_undone: Vec<String> },
}

impl Failure {
    /// `why`, with what its cleanup could not undo (none: just `why`).
    pub fn undone(why: String, not_undone: Vec<String>) -> Failure {
        if not_undone.is_empty() { Failure::Message(why) } else { Failure::Undone { why, not_undone } }
    }

    /// The text of the error line, unless the failure was reported already.
    pub fn line(&self) -> Option<String> {
        (*self != Failure::Reported).then(|| self.to_string())
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::Message(message)
    }
}

/// The cleanup's errors as the line shows them: each after `; and `.
struct NotUndone<'a>(&'a [String]);

impl fmt::Display for NotUndone<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|e| write!(f, "; and {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure reported already prints no line; any other prints its text.
    #[test]
    fn only_an_unreported_failure_has_a_line() {
        assert_eq!(Failure::Reported.line(), None);
        assert_eq!(Failure::from("spec.json: not JSON".to_owned()).line().as_deref(), Some("spec.json: not JSON"));
    }

    /// What a cleanup could not undo follows the failure, each after `; and `; a cleanup that
    /// undid everything leaves the failure as it was.
    #[test]
    fn what_was_not_undone_follows_the_failure() {
        let clean = Failure::undone("runc failed".into(), Vec::new());
        assert_eq!(clean, Failure::Message("runc failed".into()));
        let left = Failure::undone("runc failed".into(), vec!["/run/x: cannot remove: busy".into(), "y".into()]);
        assert_eq!(left.to_string(), "runc failed; and /run/x: cannot remove: busy; and y");
        assert!(matches!(left, Failure::Undone { ref not_undone, .. } if not_undone.len() == 2));
    }
}
