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

/// The text [`escape`] was given, from what it wrote: a line read back from a log, which is
/// escaped again where it is shown (each backslash would double). A backslash that starts
/// none of [`escape`]'s escapes is kept.
pub fn unescape(s: &str) -> Cow<'_, str> {
    if !s.contains('\\') {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (c, used) = match after.chars().next() {
            Some('\\') => (Some('\\'), 1),
            Some('n') => (Some('\n'), 1),
            Some('t') => (Some('\t'), 1),
            Some('r') => (Some('\r'), 1),
            Some('x') => (after.get(1..3).and_then(code), 3),
            Some('u') => match after.strip_prefix("u{").and_then(|t| t.split_once('}')) {
                Some((hex, _)) => (code(hex), hex.len() + 3),
                None => (None, 0),
            },
            _ => (None, 0),
        };
        match c {
            Some(c) => {
                out.push(c);
                rest = &after[used..];
            }
            None => {
                out.push('\\');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// The character hex digits `hex` name, if they do.
fn code(hex: &str) -> Option<char> {
    u32::from_str_radix(hex, 16).ok().and_then(char::from_u32)
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

    /// What [`unescape`] gives back is what [`escape`] was given, for every kind of escape; a
    /// backslash starting none is kept (a line read back from a log is shown once escaped).
    #[test]
    fn unescape_undoes_escape() {
        for s in ["plain", "a\nb", "a\\nb", "\x1b[31m\u{9b}\r\t\x00\x7f", "C:\\x1b", "\\", "café\n"] {
            assert_eq!(unescape(&escape(s)), s, "{s:?}");
        }
        assert!(matches!(unescape("no escapes"), Cow::Borrowed(_)));
        assert_eq!(unescape("odd \\q and \\x1 and \\u{zz}"), "odd \\q and \\x1 and \\u{zz}");
    }
}
