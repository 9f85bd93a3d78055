//! How a `devremapd` command fails: the one error its `main` turns into the one error line and
//! exit status 1. The library's own errors are typed per module; the binary formats them, with
//! the path or flag at fault, into a [`Failure::Message`]. (`devremap-runtime` has its own
//! typed failure, with the list of what a start's cleanup could not undo, in
//! `mountd/runtime/error.rs`.)
//!
//! Assumption: exactly one process says a failure. A `devremapd serve` that fails before it
//! serves sends its error to its keeper, which reports it as the error of the command the user
//! ran; the server then ends with [`Failure::Reported`] and prints nothing more.

/// A command's failure.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// What went wrong, the text of the error line.
    #[error("{0}")]
    Message(String),
    /// Reported already, by the process whose job that was: nothing more is printed.
    #[error("reported already")]
    Reported,
}

impl Failure {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure reported already prints no line; any other prints its text.
    #[test]
    fn only_an_unreported_failure_has_a_line() {
        assert_eq!(Failure::Reported.line(), None);
        assert_eq!(Failure::from("spec.json: not JSON".to_owned()).line().as_deref(), Some("spec.json: not JSON"));
    }
}
