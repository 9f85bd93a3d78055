//! The node daemon's sweep (found from outside): every few seconds it tears down the
//! directories no one has ([`super::registry::Registry::left_over`]), which a front end killed
//! before its request reached the daemon leaves. It passes over a directory whose teardown
//! would only say again what was said: a killed keeper's (a dead mount at its `/dev`, which
//! stays until the container's delete, said as the keeper exited) and one a teardown left in
//! place before (a mount inside it). Pure: the binary looks at the directories and tears down.

use std::collections::HashSet;

/// A directory's identity (device, inode): a directory made again for the id is another.
pub type DirIdentity = (u64, u64);

/// A left-over directory as a sweep finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub id: String,
    pub at: DirIdentity,
    /// Its `/dev` is a mount (a killed keeper's, dead).
    pub mounted: bool,
}

/// What the sweep remembers from one round to the next: the directories left in place.
#[derive(Debug, Default)]
pub struct Sweep {
    kept: HashSet<(String, DirIdentity)>,
}

impl Sweep {
    /// The ids of `left` to tear down this round. A kept directory no longer left over (removed,
    /// made again, taken by a start) is forgotten.
    pub fn round(&mut self, left: &[Leftover]) -> Vec<String> {
        self.kept.retain(|(id, at)| left.iter().any(|l| &l.id == id && &l.at == at));
        left.iter().filter(|l| !l.mounted && !self.kept.contains(&(l.id.clone(), l.at))).map(|l| l.id.clone()).collect()
    }

    /// A teardown left `id`'s directory `at` in place: passed over while it stays so.
    pub fn kept(&mut self, id: &str, at: DirIdentity) {
        self.kept.insert((id.to_owned(), at));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn left(id: &str, ino: u64, mounted: bool) -> Leftover {
        Leftover { id: id.into(), at: (1, ino), mounted }
    }

    /// Rule (found from outside): a directory no teardown can remove, or a killed keeper's with
    /// its dead mount, is not retried (and said again) every sweep; the id's directory made
    /// again is another, swept as any.
    #[test]
    fn a_sweep_says_nothing_twice() {
        let mut s = Sweep::default();
        assert_eq!(s.round(&[left("gone", 1, false), left("dead", 2, true)]), vec!["gone"]);
        s.kept("gone", (1, 1));
        assert_eq!(s.round(&[left("gone", 1, false), left("dead", 2, true)]), Vec::<String>::new());
        assert_eq!(s.round(&[left("gone", 3, false)]), vec!["gone"], "made again");
        assert_eq!(s.round(&[left("gone", 1, false)]), vec!["gone"], "forgotten once it was not left over");
    }
}
