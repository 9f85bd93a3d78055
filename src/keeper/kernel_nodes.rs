//! The node ids the kernel holds, as the keeper learns them from the messages it relays: for
//! each, the `(parent, name)` it was looked up as, the attributes the kernel was given, a
//! symlink's target once a READLINK reply passed, and the lookup count. A server that takes
//! over starts from this table ([`crate::served::devfs::Devfs::resume`]), so node ids and lookup counts
//! stay the kernel's across a crash or an upgrade.
//!
//! The kernel's counting rules followed here, as `Devfs` follows them: a LOOKUP reply with a
//! node id other than 0 takes one reference; a READDIRPLUS reply takes one per entry with a node
//! id, `.` and `..` excepted; FORGET and BATCH_FORGET give references back, and a node at 0 is
//! gone. The root (id 1) is never counted: the kernel never forgets it.
//!
//! Assumption: no other request returns an entry. Every change to the tree is refused (MKNOD,
//! MKDIR, SYMLINK, LINK, CREATE and TMPFILE answer an error), so LOOKUP and READDIRPLUS are the
//! only replies that give the kernel a node.

use crate::keeper::fuse_wire::{self, Attr, EntryOut, Reply, Request, WireError};
use std::collections::{BTreeMap, HashMap};

/// FUSE's node id of the root directory (`FUSE_ROOT_ID`), which the kernel never forgets.
pub const ROOT: u64 = 1;

/// One node id the kernel holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldNode {
    pub parent: u64,
    pub name: String,
    pub attr: Attr,
    /// A symlink's target, once the kernel read it (and so may have cached it).
    pub target: Option<String>,
    pub count: u64,
}

/// The kernel's references, by node id, the largest id ever given, and the listing offsets
/// (cookies) the kernel was given, by cookie.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Held {
    nodes: HashMap<u64, HeldNode>,
    max_ino: u64,
    cookies: BTreeMap<u64, String>,
}

impl Held {
    pub fn from_parts(nodes: HashMap<u64, HeldNode>, max_ino: u64, cookies: BTreeMap<u64, String>) -> Held {
        let max_ino = nodes.keys().copied().chain([max_ino]).max().unwrap_or(0);
        Held { nodes, max_ino, cookies }
    }

    /// Every listing offset the kernel was given for a name (`.` and `..` have fixed ones), so
    /// that a successor resumes a listing split by the takeover where the kernel left it.
    pub fn cookies(&self) -> &BTreeMap<u64, String> {
        &self.cookies
    }

    pub fn nodes(&self) -> &HashMap<u64, HeldNode> {
        &self.nodes
    }

    /// The largest node id the kernel was ever given: a successor numbers after it, so that
    /// no id is reused.
    pub fn max_ino(&self) -> u64 {
        self.max_ino
    }

    /// Applies a reply to the request it answers, before the reply reaches the kernel (so that
    /// no FORGET can come before its reference is counted). Returns the node ids it took a
    /// reference to, to [`Held::undo`] if the kernel refuses the reply.
    pub fn replied(&mut self, request: &Request, reply: &Reply) -> Result<Vec<u64>, WireError> {
        if reply.error != 0 {
            return Ok(Vec::new());
        }
        let mut added = Vec::new();
        match request.opcode {
            fuse_wire::LOOKUP => {
                let entry = fuse_wire::lookup_entry(reply.body)?;
                self.add(request.nodeid, request.name(), entry, &mut added);
            }
            fuse_wire::READDIR | fuse_wire::READDIRPLUS => {
                for d in fuse_wire::dirents(reply.body, request.opcode == fuse_wire::READDIRPLUS)? {
                    if d.name == b"." || d.name == b".." {
                        continue;
                    }
                    self.cookies.insert(d.off, String::from_utf8_lossy(&d.name).into_owned());
                    if let Some(entry) = d.entry {
                        self.add(request.nodeid, &d.name, entry, &mut added);
                    }
                }
            }
            fuse_wire::READLINK => {
                if let Some(node) = self.nodes.get_mut(&request.nodeid) {
                    node.target = Some(String::from_utf8_lossy(reply.body).into_owned());
                }
            }
            _ => {}
        }
        Ok(added)
    }

    fn add(&mut self, parent: u64, name: &[u8], entry: EntryOut, added: &mut Vec<u64>) {
        if entry.nodeid == 0 || entry.nodeid == ROOT {
            return;
        }
        self.max_ino = self.max_ino.max(entry.nodeid);
        let name = String::from_utf8_lossy(name).into_owned();
        let node = self.nodes.entry(entry.nodeid).or_insert_with(|| HeldNode {
            parent,
            name: name.clone(),
            attr: entry.attr.clone(),
            target: None,
            count: 0,
        });
        // A node id names one node for ever (a changed node gets a new id), so a second
        // reference only brings the attributes up to date (a directory's mtime never moves).
        node.attr = entry.attr;
        node.count += 1;
        added.push(entry.nodeid);
    }

    /// Takes back the references of a reply the kernel did not take (it had no such request
    /// any more: answered already, or interrupted).
    pub fn undo(&mut self, added: &[u64]) {
        for ino in added {
            self.drop_refs(*ino, 1);
        }
    }

    /// Applies a FORGET or BATCH_FORGET.
    pub fn forgot(&mut self, request: &Request) -> Result<(), WireError> {
        for (ino, n) in request.forgets()? {
            self.drop_refs(ino, n);
        }
        Ok(())
    }

    fn drop_refs(&mut self, ino: u64, n: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.count = node.count.saturating_sub(n);
            if node.count == 0 {
                self.nodes.remove(&ino);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keeper::fuse_wire::build;

    fn attr(mode: u32) -> Attr {
        Attr { mode, uid: 0, gid: 0, rdev: 0, size: 0, mtime: (1, 2) }
    }

    fn apply(held: &mut Held, req: &[u8], reply: &[u8]) -> Vec<u64> {
        held.replied(&Request::parse(req).unwrap(), &Reply::parse(reply).unwrap()).unwrap()
    }

    /// Rule: lookups count, forgets give back, a node at 0 is gone; ids never go back down.
    #[test]
    fn lookups_and_forgets_balance() {
        let mut held = Held::default();
        for u in 0..3 {
            apply(&mut held, &build::lookup(u, ROOT, "null"), &build::reply(u, 0, &build::entry(5, &attr(0o20666))));
        }
        assert_eq!(held.nodes()[&5].count, 3);
        assert_eq!((held.nodes()[&5].parent, held.nodes()[&5].name.as_str()), (ROOT, "null"));
        held.forgot(&Request::parse(&build::forget(9, 5, 2)).unwrap()).unwrap();
        assert_eq!(held.nodes()[&5].count, 1);
        held.forgot(&Request::parse(&build::batch_forget(10, &[(5, 1), (77, 4)])).unwrap()).unwrap();
        assert!(held.nodes().is_empty());
        assert_eq!(held.max_ino(), 5);
    }

    /// Rule: a failed or negative lookup takes no reference, nor does the root.
    #[test]
    fn errors_negative_entries_and_the_root_take_nothing() {
        let mut held = Held::default();
        let req = build::lookup(1, ROOT, "gone");
        assert!(apply(&mut held, &req, &build::reply(1, -libc::ENOENT, &[])).is_empty());
        assert!(apply(&mut held, &req, &build::reply(1, 0, &build::entry(0, &attr(0)))).is_empty());
        assert!(apply(&mut held, &req, &build::reply(1, 0, &build::entry(ROOT, &attr(0o40755)))).is_empty());
        assert!(held.nodes().is_empty());
    }

    /// Rule: READDIRPLUS counts every entry but `.` and `..`, as the kernel does; READDIR counts
    /// nothing; both record the listing offset given with each name.
    #[test]
    fn readdirplus_counts_all_but_the_dots() {
        let entries = [
            (".", ROOT, attr(0o40755)),
            ("..", ROOT, attr(0o40755)),
            ("pts", 6, attr(0o40755)),
            ("fd", 7, attr(0o120777)),
        ];
        for (opcode, plus) in [(fuse_wire::READDIRPLUS, true), (fuse_wire::READDIR, false)] {
            let mut held = Held::default();
            let body = build::dirent_body(&entries, plus);
            let added = apply(&mut held, &build::request(opcode, 3, ROOT, &[0; 24]), &build::reply(3, 0, &body));
            assert_eq!(added, if plus { vec![6, 7] } else { vec![] });
            assert_eq!(held.nodes().len(), added.len());
            let cookies: Vec<(u64, &str)> = held.cookies().iter().map(|(c, n)| (*c, n.as_str())).collect();
            assert_eq!(cookies, [(102, "pts"), (103, "fd")]);
        }
    }

    /// Rule: a reply the kernel refused is taken back; a READLINK reply records the target.
    #[test]
    fn undo_and_readlink() {
        let mut held = Held::default();
        let added =
            apply(&mut held, &build::lookup(1, ROOT, "fd"), &build::reply(1, 0, &build::entry(7, &attr(0o120777))));
        apply(&mut held, &build::request(fuse_wire::READLINK, 2, 7, &[]), &build::reply(2, 0, b"/proc/self/fd"));
        assert_eq!(held.nodes()[&7].target.as_deref(), Some("/proc/self/fd"));
        held.undo(&added);
        assert!(held.nodes().is_empty());
    }
}
