//! The one way text from inputs is shown to people: control characters escaped.
//!
//! Paths and names come from inputs (a spec's device path, a directory entry) and may hold any
//! character but `/` and NUL. Printed raw, a newline forges a second `error:` line or log
//! record, and an escape sequence drives the reader's terminal. So every line a person reads
//! (the `error:` line, each log record, the plan's tables and warnings) goes through
//! [`escape`] where it is written. JSON output needs nothing: JSON escapes control characters
//! itself.

use std::borrow::Cow;
use std::fmt::Write;

/// `s` with every control character (C0, DEL, C1) written as an escape: `\n`, `\t`, `\r`, and
/// `\x1b`-style for the rest (`\u{9b}` for C1). A backslash is written `\\`, so an escape and
/// the same characters typed literally never print alike. Everything else, non-ASCII letters
/// included, is kept.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| c.is_control() || c == '\\') {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule (issue 9.6): no control character survives, so one message is one line and drives
    /// no terminal; printable text, non-ASCII included, is untouched.
    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape("nvidia0"), "nvidia0");
        assert!(matches!(escape("café/ü"), Cow::Borrowed("café/ü")));
        assert_eq!(escape("a\nerror: forged"), "a\\nerror: forged");
        assert_eq!(escape("\x1b[31mred\x07\r\t\x00\x7f"), "\\x1b[31mred\\x07\\r\\t\\x00\\x7f");
        assert_eq!(escape("c1:\u{9b}2J"), "c1:\\u{9b}2J");
        for c in (0u32..0x20).chain(0x7f..0xa0).filter_map(char::from_u32) {
            assert!(!escape(&c.to_string()).chars().any(char::is_control), "{c:?}");
        }
    }

    /// Bug (found from outside): a name holding a literal backslash and `n` printed the same as
    /// one holding a newline, because backslashes were kept as they were.
    #[test]
    fn backslash_is_escaped_so_output_is_unambiguous() {
        assert_eq!(escape("a\\nb"), "a\\\\nb");
        assert_ne!(escape("a\\nb"), escape("a\nb"));
        assert_eq!(escape("\\"), "\\\\");
        assert_eq!(escape("C:\\x1b"), "C:\\\\x1b");
    }
}
