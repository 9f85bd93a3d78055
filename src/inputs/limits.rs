//! The limits every input is held to: what the kernel can carry, and what keeps memory bounded.
//!
//! Kernel facts these rules stand on:
//! - a path handed to a system call is at most `PATH_MAX` (4,096) bytes counting its
//!   terminating NUL, so a node's path in the container (`/dev/...`) is at most 4,095 bytes;
//! - a name is at most `NAME_MAX` (255) bytes, and holds neither `/` nor NUL; `.` and `..` are
//!   every directory's own entries. A longer name, or one with a NUL, is listed but cannot be
//!   looked up (`ls` fails with EIO, a long enough one cuts the listing short);
//! - FUSE carries a device number in 32 bits, as the kernel's `new_encode_dev`: 12 bits of
//!   major and 20 of minor. A larger number is not refused by the kernel: it is served as
//!   another device (`1:1048585` opens `1:9`).
//!
//! Memory: an input is at most 16 MiB, but parsed JSON takes many times its text (`0,` is two
//! bytes of text and a 32-byte value), and a tree makes a directory of every prefix of a path.
//! So a JSON input may hold at most [`MAX_JSON_VALUES`] values, counted before it is parsed by a
//! pass that allocates nothing, and a tree at most [`MAX_NODES`] nodes whose paths total at most
//! [`MAX_TREE_PATH_BYTES`]. Together they keep a plan of any input within the size limits
//! under 100 MiB.

use crate::device::Rdev;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;
use thiserror::Error;

/// The longest path, without its NUL (`PATH_MAX` is 4,096 with it).
pub const MAX_PATH_LEN: usize = 4095;
/// The longest name (`NAME_MAX`).
pub const MAX_NAME_LEN: usize = 255;
/// The largest major FUSE can carry (12 bits).
pub const MAX_FUSE_MAJOR: u32 = (1 << 12) - 1;
/// The largest minor FUSE can carry (20 bits).
pub const MAX_FUSE_MINOR: u32 = (1 << 20) - 1;
/// The most values (objects, arrays, strings, numbers, booleans, nulls) a JSON input may hold.
/// A runtime spec holds hundreds, a checkpoint's header tens.
pub const MAX_JSON_VALUES: usize = 1 << 18;
/// The most nodes a tree may hold, the root included. A container's `/dev` holds tens.
pub const MAX_NODES: usize = 1 << 14;
/// The most bytes the paths of all the nodes of a tree may total.
pub const MAX_TREE_PATH_BYTES: usize = 1 << 20;
/// The prefix every path of the tree has in the container.
const DEV: &str = "/dev/";
/// How much of a long name or path an error message shows.
const SHOWN: usize = 64;

/// Why a name, path, device number or input is beyond the limits.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LimitError {
    #[error("the path is {0} bytes; the kernel takes at most {MAX_PATH_LEN}")]
    PathTooLong(usize),
    #[error("the name \"{name}\" is {len} bytes; the kernel takes at most {MAX_NAME_LEN}")]
    NameTooLong { name: String, len: usize },
    #[error("the name \"{0}\" holds a NUL byte")]
    Nul(String),
    #[error("\"{0}\" is not a file name")]
    NotAName(String),
    #[error(
        "device number {0} does not fit FUSE's 12-bit major and 20-bit minor (at most \
         {MAX_FUSE_MAJOR}:{MAX_FUSE_MINOR}), and would be served as another device"
    )]
    Rdev(Rdev),
    #[error("the tree would hold more than {MAX_NODES} nodes")]
    TooManyNodes,
    #[error("the tree's paths would total more than {MAX_TREE_PATH_BYTES} bytes")]
    TreeTooLarge,
}

/// Refuses a name the kernel cannot look up or list.
pub fn check_name(name: &str) -> Result<(), LimitError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') {
        return Err(LimitError::NotAName(shorten(name)));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(LimitError::NameTooLong { name: shorten(name), len: name.len() });
    }
    if name.contains('\0') {
        return Err(LimitError::Nul(shorten(name)));
    }
    Ok(())
}

/// Refuses a `/dev`-relative path (`dri/card0`) whose container path is too long or that
/// holds a name [`check_name`] refuses.
pub fn check_dev_path(rel: &str) -> Result<(), LimitError> {
    rel.split('/').try_for_each(check_name)?;
    let len = DEV.len() + rel.len();
    if len > MAX_PATH_LEN {
        return Err(LimitError::PathTooLong(len));
    }
    Ok(())
}

/// Refuses a device number FUSE would carry as another one.
pub fn check_rdev(rdev: Rdev) -> Result<(), LimitError> {
    if rdev.major > MAX_FUSE_MAJOR || rdev.minor > MAX_FUSE_MINOR {
        return Err(LimitError::Rdev(rdev));
    }
    Ok(())
}

/// A name or path as error messages show it: cut to its first bytes (and `...`) when it is
/// long. It is not escaped here: the line it ends up in is escaped where it is written
/// (`escape::escape`), and escaping twice would double every backslash.
pub fn shorten(s: &str) -> String {
    if s.len() <= SHOWN {
        return s.to_owned();
    }
    let cut = (0..=SHOWN).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    format!("{}...", &s[..cut])
}

/// What a byte-order mark at the start of `bytes` says the text is, when it has one: JSON text
/// has none (RFC 8259), and one written by an editor would otherwise read as "not JSON".
pub fn byte_order_mark(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [0xef, 0xbb, 0xbf, ..] => Some("UTF-8 with a byte-order mark"),
        [0xff, 0xfe, ..] | [0xfe, 0xff, ..] => Some("UTF-16"),
        _ => None,
    }
}

/// Parses JSON text holding at most [`MAX_JSON_VALUES`] values (see [`check_json`]).
pub fn parse_json(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    check_json(bytes)?;
    serde_json::from_slice(bytes)
}

/// Refuses JSON text that is not valid or holds more than [`MAX_JSON_VALUES`] values. The
/// pass checks the syntax as the parse does, with its errors, but keeps nothing, so a refused
/// input never takes more memory than its text.
pub fn check_json(bytes: &[u8]) -> Result<(), serde_json::Error> {
    check_json_values(bytes, MAX_JSON_VALUES)
}

/// [`check_json`] with a limit of its own, `max` values: a message of a few fields (the node
/// protocol's request) is refused with thousands, before a parse gives each tens of bytes (found
/// from outside: a 1 MiB request line of `[0,0,...]` took 54 MB).
pub fn check_json_values(bytes: &[u8], max: usize) -> Result<(), serde_json::Error> {
    check(bytes, Keys::Unchecked, max)
}

/// [`check_json`] for an OCI spec, which runc and the other Go tools also read: refuses an
/// object with two keys that differ only in case. Go's `encoding/json` matches a struct's
/// field names without regard to case, and the last of such keys wins, where serde takes the
/// exact key: `"devices": [X], "Devices": []` gave devremap device X and runc none (found from
/// outside: a container got a device runc would not have made). The maps of the spec (its
/// `annotations`, `linux.sysctl`, `linux.resources.unified`), whose keys Go keeps as written,
/// are not checked.
pub fn check_spec_json(bytes: &[u8]) -> Result<(), serde_json::Error> {
    check(bytes, Keys::Struct, MAX_JSON_VALUES)
}

fn check(bytes: &[u8], keys: Keys, max: usize) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    Counted::deserialize(&mut de, &mut Budget { seen: 0, max }, keys)?;
    de.end()
}

/// The values counted so far, and how many may be.
struct Budget {
    seen: usize,
    max: usize,
}

/// What an object's keys are to the Go tools that read the same text.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// Not checked (an input only devremap reads).
    Unchecked,
    /// A struct's fields: keys that differ only in case are one field to Go.
    Struct,
    /// A map's keys, kept as written; the objects inside it are structs again.
    Map,
}

/// The fields of an OCI spec that are maps in Go (`map[string]...`), whose keys are data,
/// folded: `annotations`, `linux.sysctl`, `linux.resources.unified`, `linux.resources.rdma`,
/// `linux.netDevices`.
const SPEC_MAPS: [&str; 5] = ["annotations", "sysctl", "unified", "rdma", "netdevices"];

/// A key as Go's `encoding/json` compares field names: case folded, with the Kelvin sign and
/// the long s, which fold to `k` and `s`.
fn folded(key: &str) -> String {
    key.to_uppercase().to_lowercase()
}

/// One JSON value, counted into the budget; fails once more than its `max` are seen.
struct Counted<'a>(&'a mut Budget, Keys);

impl Counted<'_> {
    fn deserialize<'de, D: Deserializer<'de>>(de: D, seen: &mut Budget, keys: Keys) -> Result<(), D::Error> {
        de.deserialize_any(Counted(seen, keys))
    }

    fn count<E: de::Error>(self) -> Result<(), E> {
        self.0.seen += 1;
        if self.0.seen > self.0.max {
            return Err(E::custom(format_args!("more than {} JSON values, the limit", self.0.max)));
        }
        Ok(())
    }
}

/// Seeds the count into the elements of an array or object.
struct Seed<'a>(&'a mut Budget, Keys);

impl<'de> de::DeserializeSeed<'de> for Seed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        Counted::deserialize(de, self.0, self.1)
    }
}

impl<'de> Visitor<'de> for Counted<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.count()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.count()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.count()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.count()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.count()
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.count()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let (seen, keys) = (self.0, self.1);
        Counted(seen, keys).count()?;
        while seq.next_element_seed(Seed(seen, keys))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (seen, keys) = (self.0, self.1);
        Counted(seen, keys).count()?;
        if keys == Keys::Unchecked {
            // Keys are strings the parser checks; only values count.
            while map.next_key::<IgnoredAny>()?.is_some() {
                map.next_value_seed(Seed(seen, keys))?;
            }
            return Ok(());
        }
        // Each key folded, with the key as written; as many as the values counted.
        let mut fields: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let fold = folded(&key);
            let inner =
                if keys == Keys::Struct && SPEC_MAPS.contains(&fold.as_str()) { Keys::Map } else { Keys::Struct };
            if keys == Keys::Struct {
                match fields.get(&fold) {
                    Some(other) if *other != key => {
                        return Err(de::Error::custom(format_args!(
                            "keys {other:?} and {key:?} differ only in case: runc and the other Go tools read them as one field, the last; refused"
                        )));
                    }
                    _ => drop(fields.insert(fold, key)),
                }
            }
            map.next_value_seed(Seed(seen, inner))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel fact: names up to 255 bytes, paths up to 4,095 bytes (with `/dev/`); no NUL, no
    /// empty name, no `.` or `..`.
    #[test]
    fn names_and_paths_at_and_over_the_kernel_limits() {
        assert_eq!(check_name(&"n".repeat(255)), Ok(()));
        assert!(matches!(check_name(&"n".repeat(256)), Err(LimitError::NameTooLong { len: 256, .. })));
        assert!(matches!(check_name("a\0b"), Err(LimitError::Nul(_))));
        for bad in ["", ".", "..", "a/b"] {
            assert!(matches!(check_name(bad), Err(LimitError::NotAName(_))), "{bad:?}");
        }
        let at_limit = ["a"; 2045].join("/");
        assert_eq!(DEV.len() + at_limit.len(), 4094);
        assert_eq!(check_dev_path(&format!("{at_limit}/b")), Err(LimitError::PathTooLong(4096)));
        assert_eq!(check_dev_path(&format!("{at_limit}b")), Ok(()));
        assert!(check_dev_path("dri//card0").is_err());
        assert_eq!(check_dev_path("dri/card0"), Ok(()));
    }

    /// Kernel fact: FUSE's rdev is `new_encode_dev`, 12 bits of major and 20 of minor; every
    /// number within them survives the round trip through the kernel's `new_decode_dev`, and
    /// the numbers of issue 9.1 are refused.
    #[test]
    fn device_numbers_fuse_cannot_carry_are_refused() {
        let decode = |raw: u32| Rdev::new((raw & 0xfff00) >> 8, (raw & 0xff) | ((raw >> 12) & 0xfff00));
        for (major, minor) in [(0, 0), (1, 9), (195, 255), (MAX_FUSE_MAJOR, MAX_FUSE_MINOR), (4095, 256), (256, 1)] {
            let rdev = Rdev::new(major, minor);
            assert_eq!(check_rdev(rdev), Ok(()));
            assert_eq!(decode(rdev.to_fuse()), rdev, "{rdev}");
        }
        for (major, minor) in [(1, 1_048_585), (16_777_217, 1), (4097, 1), (4096, 0), (0, 1 << 20)] {
            let rdev = Rdev::new(major, minor);
            assert_eq!(check_rdev(rdev), Err(LimitError::Rdev(rdev)));
            assert_ne!(decode(rdev.to_fuse()), rdev, "{rdev} would be served as itself");
        }
    }

    /// Rule: JSON is counted before it is parsed; the limit is exact, and the count pass gives
    /// the parser's own syntax errors.
    #[test]
    fn json_values_are_counted_before_parsing() {
        let array = |n: usize| format!("[{}]", vec!["0"; n].join(","));
        assert!(parse_json(array(MAX_JSON_VALUES - 1).as_bytes()).is_ok());
        let err = parse_json(array(MAX_JSON_VALUES).as_bytes()).unwrap_err().to_string();
        assert!(err.contains("more than 262144 JSON values"), "{err}");
        let object = parse_json(br#"{"a": {"b": [1, "x", null, true]}}"#).unwrap();
        assert_eq!(object["a"]["b"][1], "x");
        assert!(parse_json(b"[1] 2").unwrap_err().to_string().contains("trailing characters"));
        assert!(parse_json(b"[\"\\ud800x\"]").is_err());
        assert!(parse_json(&[b'['; 10_000]).unwrap_err().to_string().contains("recursion limit"));
    }

    /// Error messages show long names cut short, not escaped: the written line is escaped once,
    /// so a name's backslash is not doubled.
    #[test]
    fn long_names_are_shown_cut_short() {
        assert_eq!(shorten("a\nb\\"), "a\nb\\");
        let shown = shorten(&"é".repeat(100));
        assert!(shown.ends_with("é...") && shown.len() == 67, "{shown}");
    }
}
