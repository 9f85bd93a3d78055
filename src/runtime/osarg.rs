//! Command-line arguments that are not UTF-8, carried through the wrapper's `String` parsing
//! without loss.
//!
//! Pure. A caller may hand the runtime a path that is not UTF-8 (a bundle, a pid file, a log);
//! the wrapper once skipped devremap for any such line, even for a container that asked for it
//! (issue 17.8). [`encode`] maps each byte that is not part of valid UTF-8 to one character of
//! the last private-use plane, U+10FF80..=U+10FFFF (byte 0x80..=0xFF: a lone byte below 0x80
//! is always valid), and [`decode`] maps them back. An argument that already holds one of those
//! characters cannot be told apart, so [`encode`] refuses it (`None`) and the caller leaves the
//! line to the runtime, as before.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

/// The character standing for byte `0x80 + n`.
const BASE: u32 = 0x10FF00;

fn stands_for_a_byte(c: char) -> bool {
    (BASE + 0x80..=BASE + 0xFF).contains(&(c as u32))
}

/// `arg` as a string, each byte that is not valid UTF-8 replaced by its stand-in; `None` when
/// `arg` holds a stand-in character of its own.
pub fn encode(arg: &OsStr) -> Option<String> {
    let mut out = String::with_capacity(arg.len());
    for chunk in arg.as_bytes().utf8_chunks() {
        if chunk.valid().chars().any(stands_for_a_byte) {
            return None;
        }
        out.push_str(chunk.valid());
        // The stand-ins are below char::MAX: from_u32 never fails here.
        out.extend(chunk.invalid().iter().filter_map(|&b| char::from_u32(BASE + u32::from(b))));
    }
    Some(out)
}

/// The argument [`encode`] made `s` from.
pub fn decode(s: &str) -> OsString {
    let mut bytes = Vec::with_capacity(s.len());
    let mut buf = [0u8; 4];
    for c in s.chars() {
        if stands_for_a_byte(c) {
            bytes.push((c as u32 - BASE) as u8);
        } else {
            bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
        }
    }
    OsString::from_vec(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Rule (issue 17.8): a path that is not UTF-8 survives the round trip byte for byte, and
    /// a UTF-8 argument is itself.
    #[test]
    fn non_utf8_survives() {
        let raw = OsStr::from_bytes(b"/b/\xff\xfe-\xc3(ok)/caf\xc3\xa9");
        let s = encode(raw).unwrap();
        assert!(s.ends_with("/café"));
        assert_eq!(decode(&s), raw);
        assert_eq!(encode(OsStr::new("--bundle")).as_deref(), Some("--bundle"));
    }

    /// An argument holding a stand-in of its own cannot be told apart: refused.
    #[test]
    fn own_stand_ins_are_refused() {
        assert_eq!(encode(OsStr::new("x\u{10FFFF}")), None);
        assert!(encode(OsStr::new("x\u{10FF7F}")).is_some());
    }

    proptest! {
        /// Any bytes: encode then decode is the identity wherever encode answers.
        #[test]
        fn round_trip(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let raw = OsString::from_vec(bytes);
            if let Some(s) = encode(&raw) {
                prop_assert_eq!(decode(&s), raw);
            }
        }
    }
}
