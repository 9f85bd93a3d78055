//! Listing offsets: the offset given with each `readdir` entry is a *cookie* naming that entry,
//! not its position. A listing is resumed (with a small buffer, after a reload, after `seekdir`)
//! from the offset of the last entry the caller got, possibly under a newer snapshot whose
//! names are not at the same positions; a position would then skip or repeat names. So every
//! name ever served gets a number the first time it is seen, kept for the life of the
//! filesystem ([`Cookies`]), and listings go in name order: resuming from a cookie lists the
//! names that sort after the cookie's name in the snapshot of that moment. Each listing is thus
//! a walk in strictly increasing name order, whatever snapshots answered its parts: no name is
//! given twice, and a name present in every snapshot it spanned is given once, even when the
//! cookie's own name has gone. (A hash of the name, the other position-independent key, can
//! collide and does not keep name order.) The table only grows, by the distinct names the
//! inputs ever held, which are few.

use std::collections::{BTreeMap, HashMap};

/// The listing offset of every name ever served, numbered in the order first seen: append-only,
/// and shared by the snapshots (copied only by a reload that brings a new name), so a cookie
/// handed out under any generation names the same name in every later one. `0` starts a
/// listing, `.` is `1` and `..` is `2`.
#[derive(Debug, Default, Clone)]
pub(in crate::served) struct Cookies {
    names: Vec<String>,
    index: HashMap<String, u64>,
}

impl Cookies {
    /// The cookie of the first name.
    pub(super) const FIRST: u64 = 3;

    pub(super) fn get(&self, name: &str) -> Option<u64> {
        self.index.get(name).copied()
    }

    pub(super) fn name(&self, cookie: u64) -> Option<&str> {
        let i = usize::try_from(cookie.checked_sub(Self::FIRST)?).ok()?;
        self.names.get(i).map(String::as_str)
    }

    /// The cookies a server before us gave the kernel (by cookie), at the same numbers; names
    /// it numbered that the kernel never saw leave gaps, which no listing can resume from.
    /// Cookies past [`Cookies::MAX_SEEDED`] are not taken (no tree has that many names).
    pub(in crate::served) fn seeded(given: &BTreeMap<u64, String>) -> Cookies {
        let mut cookies = Cookies::default();
        for (&cookie, name) in given.range(Self::FIRST..=Self::MAX_SEEDED) {
            let i = (cookie - Self::FIRST) as usize;
            if cookies.names.len() <= i {
                cookies.names.resize(i + 1, String::new());
            }
            cookies.names[i] = name.clone();
            cookies.index.insert(name.clone(), cookie);
        }
        cookies
    }

    const MAX_SEEDED: u64 = Self::FIRST + (1 << 20);

    pub(super) fn add(&mut self, name: &str) -> u64 {
        let cookie = Self::FIRST + self.names.len() as u64;
        self.names.push(name.to_owned());
        self.index.insert(name.to_owned(), cookie);
        cookie
    }
}
