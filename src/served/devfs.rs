//! The live filesystem state: the served tree as node ids, swapped whole on reload.
//!
//! Kernel rules this module follows (see docs/architecture.md): an inode's rdev never changes,
//! so a name whose node changes gets a new node id; node ids are never reused; the kernel may
//! still ask for the attributes of a node it holds (an open file, a cwd) after a reload replaced
//! it, so a replaced node that the kernel has looked up is kept, as *retired*, until the kernel
//! forgets it. Lookup counts are per node and survive reloads for nodes that did not change.
//!
//! Concurrency: requests take the read lock. A reload builds the new snapshot and diffs it
//! against the old one without it, then takes the write lock only to swap the snapshot and move
//! replaced nodes aside, so no lookup can count a node that is being retired. Reloads are
//! serialised by a mutex of their own, which requests never take. Nothing here talks to the
//! kernel: [`Devfs::replace`] returns the names the caller must invalidate, after the lock is
//! released.
//!
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

use crate::decision::tree::{self, Diff, Node, NodeKind, Tree};
use crate::device::{Access, DevKind, Rdev};
use crate::keeper::kernel_nodes::{Held, HeldNode, ROOT};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::SystemTime;
use thiserror::Error;

/// Why a request names nothing that [`Devfs`] serves; the adapter turns it into an errno.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// No such name in the directory.
    #[error("no such name")]
    NotFound,
    /// No such node id (one the kernel no longer holds, or never had).
    #[error("no such node")]
    NoNode,
    /// The node looked in is not a directory.
    #[error("not a directory")]
    NotDir,
    /// The name looked up is longer than `NAME_MAX`: no node can have it. The kernel passes
    /// FUSE names up to 1,024 bytes; tmpfs answers ENAMETOOLONG for these, and so do we.
    #[error("name too long")]
    NameTooLong,
}

/// One node id: a node of the tree, as the kernel knows it.
#[derive(Debug)]
pub struct Entry {
    pub ino: u64,
    pub node: Node,
    /// When this node id was made: its mtime and ctime.
    pub born: SystemTime,
    nlookup: AtomicU64,
    /// A directory's link count as of the newest snapshot: see [`Entry::nlink`].
    links: AtomicU32,
}

impl Entry {
    fn new(ino: u64, node: Node, born: SystemTime) -> Entry {
        Entry { ino, node, born, nlookup: AtomicU64::new(0), links: AtomicU32::new(1) }
    }

    /// The link count `stat` shows: 1 for a device or symlink; for a directory, as on tmpfs
    /// and ext4, 2 (its name and its `.`) plus one for each subdirectory's `..`, which tools
    /// such as find(1) use to stop looking for subdirectories. A directory keeps its node id
    /// when only its children change, so the count is set by each snapshot built (a reload
    /// that changes it changes the listing too, and the kernel is told to drop its attributes).
    pub fn nlink(&self) -> u32 {
        self.links.load(Ordering::Relaxed)
    }
}

/// One name in a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Child {
    pub name: String,
    pub ino: u64,
    /// The name's listing offset: see [`Cookies`].
    cookie: u64,
}

/// A directory's children, in name order (the order `readdir` lists them).
#[derive(Debug, Default)]
pub struct Dir {
    pub parent: u64,
    names: Vec<Child>,
    index: HashMap<String, u64>,
}

impl Dir {
    /// Every child, in name order.
    pub fn children(&self) -> &[Child] {
        &self.names
    }
}

/// The listing offset of every name ever served, numbered in the order first seen: append-only,
/// and shared by the snapshots (copied only by a reload that brings a new name), so a cookie
/// handed out under any generation names the same name in every later one. `0` starts a
/// listing, `.` is `1` and `..` is `2`.
#[derive(Debug, Default, Clone)]
struct Cookies {
    names: Vec<String>,
    index: HashMap<String, u64>,
}

impl Cookies {
    /// The cookie of the first name.
    const FIRST: u64 = 3;

    fn get(&self, name: &str) -> Option<u64> {
        self.index.get(name).copied()
    }

    fn name(&self, cookie: u64) -> Option<&str> {
        let i = usize::try_from(cookie.checked_sub(Self::FIRST)?).ok()?;
        self.names.get(i).map(String::as_str)
    }

    /// The cookies a server before us gave the kernel (by cookie), at the same numbers; names
    /// it numbered that the kernel never saw leave gaps, which no listing can resume from.
    /// Cookies past [`Cookies::MAX_SEEDED`] are not taken (no tree has that many names).
    fn seeded(given: &BTreeMap<u64, String>) -> Cookies {
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

    fn add(&mut self, name: &str) -> u64 {
        let cookie = Self::FIRST + self.names.len() as u64;
        self.names.push(name.to_owned());
        self.index.insert(name.to_owned(), cookie);
        cookie
    }
}

/// One generation of the served tree.
#[derive(Debug)]
pub struct Snapshot {
    pub generation: u64,
    pub tree: Tree,
    entries: HashMap<u64, Arc<Entry>>,
    dirs: HashMap<u64, Dir>,
    paths: HashMap<String, u64>,
    cookies: Arc<Cookies>,
}

impl Snapshot {
    pub fn entry(&self, ino: u64) -> Option<&Arc<Entry>> {
        self.entries.get(&ino)
    }

    pub fn dir(&self, ino: u64) -> Option<&Dir> {
        self.dirs.get(&ino)
    }

    /// The node id of `path` (`""` is the root).
    pub fn ino_of(&self, path: &str) -> Option<u64> {
        self.paths.get(path).copied()
    }

    /// Numbers `tree`: `keep` gives the entry a path keeps (its node id and lookup count), if
    /// any; every other node gets a new id.
    fn build(
        mut keep: impl FnMut(&str, &Node) -> Option<Arc<Entry>>,
        mut cookies: Arc<Cookies>,
        tree: Tree,
        generation: u64,
        next_ino: &mut u64,
        now: SystemTime,
    ) -> Snapshot {
        let (mut entries, mut dirs, mut paths) = (HashMap::new(), HashMap::<u64, Dir>::new(), HashMap::new());
        let root = std::iter::once(("", tree.get("").expect("a tree has its root")));
        // Sorted by path, so every parent is numbered before its children.
        for (path, node) in root.chain(tree.iter()) {
            let entry = keep(path, node).unwrap_or_else(|| {
                let ino = if path.is_empty() { ROOT } else { take(next_ino) };
                Arc::new(Entry::new(ino, node.clone(), now))
            });
            let ino = entry.ino;
            if node.kind == NodeKind::Dir {
                dirs.insert(ino, Dir::default());
            }
            if !path.is_empty() {
                let (parent_path, name) = Tree::split(path);
                let parent = paths[parent_path];
                let dir = dirs.get_mut(&parent).expect("a node's parent is a directory");
                // Copies the table once, at the first new name; later ones go into the copy.
                let cookie = cookies.get(name).unwrap_or_else(|| Arc::make_mut(&mut cookies).add(name));
                dir.names.push(Child { name: name.to_owned(), ino, cookie });
                dir.index.insert(name.to_owned(), ino);
                if let Some(d) = dirs.get_mut(&ino) {
                    d.parent = parent;
                }
            } else {
                dirs.get_mut(&ino).expect("the root is a directory").parent = ino;
            }
            paths.insert(path.to_owned(), ino);
            entries.insert(ino, entry);
        }
        for (ino, dir) in &dirs {
            let subdirs = dir.names.iter().filter(|c| entries[&c.ino].node.kind == NodeKind::Dir).count();
            entries[ino].links.store(2 + subdirs as u32, Ordering::Relaxed);
        }
        Snapshot { generation, tree, entries, dirs, paths, cookies }
    }
}

fn take(next: &mut u64) -> u64 {
    let ino = *next;
    *next += 1;
    ino
}

/// What a reload changed, for the caller to push to the kernel and to log.
#[derive(Debug, Default)]
pub struct Change {
    pub generation: u64,
    pub diff: Diff,
    /// `(parent node id, name)` of every name whose node changed, appeared or went away, in
    /// the tree the kernel may have cached (the old one for removals and changes).
    pub invalidate: Vec<(u64, String)>,
    /// Directories whose listing changed.
    pub dirs: Vec<u64>,
}

#[derive(Debug)]
struct State {
    snap: Arc<Snapshot>,
    retired: HashMap<u64, Arc<Entry>>,
}

/// The live filesystem: answers what the FUSE adapter asks, swaps trees on reload.
#[derive(Debug)]
pub struct Devfs {
    state: RwLock<State>,
    /// Held through a whole reload, so reloads never interleave; it guards the next free node
    /// id, which only reloads take from.
    reload: Mutex<u64>,
}

impl Devfs {
    pub fn new(tree: Tree) -> Devfs {
        let mut next_ino = ROOT + 1;
        let snap = Snapshot::build(|_, _| None, Arc::default(), tree, 1, &mut next_ino, SystemTime::now());
        Devfs {
            state: RwLock::new(State { snap: Arc::new(snap), retired: HashMap::new() }),
            reload: Mutex::new(next_ino),
        }
    }

    /// The current generation.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.state.read().snap.clone()
    }

    /// Resolves `name` in directory `parent` and counts a kernel reference to the result.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Arc<Entry>, Miss> {
        let state = self.state.read();
        let dir = state.snap.dir(parent).ok_or(if state.snap.entry(parent).is_some() {
            Miss::NotDir
        } else {
            Miss::NoNode
        })?;
        if name.len() > crate::inputs::limits::MAX_NAME_LEN {
            return Err(Miss::NameTooLong);
        }
        let name = std::str::from_utf8(name.as_bytes()).map_err(|_| Miss::NotFound)?;
        let ino = dir.index.get(name).ok_or(Miss::NotFound)?;
        let entry = &state.snap.entries[ino];
        entry.nlookup.fetch_add(1, Ordering::Relaxed);
        Ok(entry.clone())
    }

    /// Drops `n` kernel references to `ino`. Returns true when a retired node was let go.
    pub fn forget(&self, ino: u64, n: u64) -> bool {
        let drained = {
            let state = self.state.read();
            let Some(entry) = state.snap.entry(ino).or_else(|| state.retired.get(&ino)) else { return false };
            let before = entry
                .nlookup
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| Some(c.saturating_sub(n)))
                .unwrap_or_else(|c| c);
            before <= n && state.retired.contains_key(&ino)
        };
        if !drained {
            return false;
        }
        let mut state = self.state.write();
        let gone = state.retired.get(&ino).is_some_and(|e| e.nlookup.load(Ordering::Relaxed) == 0);
        if gone {
            state.retired.remove(&ino);
        }
        gone
    }

    /// Lists directory `dir` (`.` and `..` first, then the names in order) to `add`, which is
    /// given each entry with its cookie and answers true when its buffer is full. `offset` is 0
    /// or the cookie of the last entry the caller got (under this or an earlier snapshot): the
    /// listing goes on after it. An offset that is no cookie lists nothing. With `counted`
    /// (readdirplus), every name but the dots counts a kernel reference, as a lookup does: the
    /// kernel takes one for each entry it is given.
    pub fn list(
        &self,
        dir: u64,
        offset: u64,
        counted: bool,
        mut add: impl FnMut(&Entry, u64, &str) -> bool,
    ) -> Result<(), Miss> {
        let state = self.state.read();
        let snap = &state.snap;
        let d = snap.dir(dir).ok_or(Miss::NoNode)?;
        let (dots, first_child) = match offset {
            0 => (&[(".", dir, 1), ("..", d.parent, 2)][..], 0),
            1 => (&[("..", d.parent, 2)][..], 0),
            2 => (&[][..], 0),
            cookie => {
                let after = snap.cookies.name(cookie);
                // The names after the cookie's, whether or not it is still here.
                (&[][..], after.map_or(d.names.len(), |a| d.names.partition_point(|c| c.name.as_str() <= a)))
            }
        };
        for &(name, ino, cookie) in dots {
            if add(&snap.entries[&ino], cookie, name) {
                return Ok(());
            }
        }
        for child in &d.names[first_child..] {
            let entry = &snap.entries[&child.ino];
            if add(entry, child.cookie, &child.name) {
                break;
            }
            if counted {
                entry.nlookup.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// A live or retired node.
    pub fn entry(&self, ino: u64) -> Option<Arc<Entry>> {
        let state = self.state.read();
        state.snap.entry(ino).or_else(|| state.retired.get(&ino)).cloned()
    }

    /// How many replaced nodes the kernel still holds.
    pub fn retired_count(&self) -> usize {
        self.state.read().retired.len()
    }

    /// Serves `tree` from now on. Nodes that did not change keep their ids; the rest get new
    /// ones; replaced nodes the kernel holds are retired. Returns what to tell the kernel.
    pub fn replace(&self, tree: Tree) -> Change {
        let mut next_ino = self.reload.lock();
        // No other reload runs, so this stays the current snapshot until the swap below.
        let old = self.snapshot();
        let generation = old.generation + 1;
        // Nodes unchanged since the old snapshot keep their ids and lookup counts.
        let keep = |path: &str, node: &Node| {
            old.paths.get(path).and_then(|ino| old.entries.get(ino)).filter(|e| e.node == *node).cloned()
        };
        let new = Snapshot::build(keep, old.cookies.clone(), tree, generation, &mut next_ino, SystemTime::now());
        let diff = tree::diff(&old.tree, &new.tree);
        let mut change = Change { generation, ..Change::default() };
        let parent_in = |snap: &Snapshot, path: &str| snap.ino_of(Tree::split(path).0);
        let mut replaced = Vec::new();
        for path in diff.changed.iter().chain(&diff.removed) {
            let ino = old.ino_of(path).expect("a diffed path is in the old tree");
            replaced.push(old.entries[&ino].clone());
            change
                .invalidate
                .push((parent_in(&old, path).expect("parents precede children"), Tree::split(path).1.to_owned()));
        }
        for path in &diff.added {
            // A parent that is itself new was never cached by the kernel: nothing to drop there.
            if let Some(parent) = parent_in(&old, path).filter(|p| new.entry(*p).is_some()) {
                change.invalidate.push((parent, Tree::split(path).1.to_owned()));
            }
        }
        change.dirs = old
            .dirs
            .iter()
            .filter(|(ino, d)| new.dir(**ino).is_some_and(|n| n.names != d.names))
            .map(|(ino, _)| *ino)
            .collect();
        change.diff = diff;
        let mut state = self.state.write();
        // Lookups count references under the read lock, so these counts are final: a node
        // looked up until now is kept for the kernel, and none can be looked up after the swap.
        for entry in replaced {
            if entry.nlookup.load(Ordering::Relaxed) > 0 {
                state.retired.insert(entry.ino, entry);
            }
        }
        state.snap = Arc::new(new);
        change
    }
}

/// What a server that took over found: how many of the nodes the kernel holds it kept (same
/// path, same node in its tree) and how many it retired, and what to tell the kernel.
#[derive(Debug, Default)]
pub struct Resumed {
    pub change: Change,
    pub kept: usize,
    pub retired: usize,
}

impl Devfs {
    /// Takes over from a server that died or is being replaced: renumbers the tree this
    /// `Devfs` was made with so that every node the kernel holds (`held`, the keeper's table)
    /// that names an equal node at the same path keeps its id and lookup count; every other
    /// held node is retired with the attributes the kernel has; new ids start after every id
    /// ever given. Serves generation `generation + 1`. Call it before any request is answered.
    ///
    /// What the kernel may have cached that no longer holds is returned to invalidate: the
    /// names of retired nodes, every name of a directory the kernel knows that it does not
    /// hold (a negative entry from the old tree), and those directories' listings.
    pub fn resume(&self, held: &Held, generation: u64) -> Resumed {
        let mut next_ino = self.reload.lock();
        let tree = self.snapshot().tree.clone();
        let paths = held_paths(held);
        let mut by_path: HashMap<&str, Vec<u64>> = HashMap::new();
        for (ino, path) in &paths {
            by_path.entry(path.as_str()).or_default().push(*ino);
        }
        let nodes = held.nodes();
        let mut kept = std::collections::HashSet::new();
        let keep = |path: &str, node: &Node| {
            // The newest id, if two held nodes match (a name that went back to an old node).
            let ino = by_path.get(path)?.iter().copied().filter(|i| same_node(&nodes[i], node)).max()?;
            kept.insert(ino);
            let h = &nodes[&ino];
            let entry = Entry::new(ino, node.clone(), born(h));
            entry.nlookup.store(h.count, Ordering::Relaxed);
            Some(Arc::new(entry))
        };
        *next_ino = (*next_ino).max(held.max_ino() + 1);
        let cookies = Arc::new(Cookies::seeded(held.cookies()));
        let snap = Snapshot::build(keep, cookies, tree, generation + 1, &mut next_ino, SystemTime::now());
        let mut change = Change { generation: generation + 1, ..Change::default() };
        let mut retired = HashMap::new();
        for (ino, h) in nodes.iter().filter(|(ino, _)| !kept.contains(*ino)) {
            let mut entry = Entry::new(*ino, held_node(h), born(h));
            entry.nlookup = AtomicU64::new(h.count);
            retired.insert(*ino, Arc::new(entry));
            change.invalidate.push((h.parent, h.name.clone()));
        }
        let known = |ino: u64| ino == ROOT || kept.contains(&ino);
        for (dir_ino, dir) in snap.dirs.iter().filter(|(ino, _)| known(**ino)) {
            change.dirs.push(*dir_ino);
            for child in dir.names.iter().filter(|c| !kept.contains(&c.ino)) {
                change.invalidate.push((*dir_ino, child.name.clone()));
            }
        }
        let resumed = Resumed { kept: kept.len(), retired: retired.len(), change };
        *self.state.write() = State { snap: Arc::new(snap), retired };
        resumed
    }
}

/// The path of every held node, from the parents the kernel looked it up in (`""` is the
/// root); a node whose parent chain the table does not hold has none.
fn held_paths(held: &Held) -> HashMap<u64, String> {
    let nodes = held.nodes();
    let mut paths: HashMap<u64, String> = HashMap::new();
    for &start in nodes.keys() {
        // Walk up to a known path, then write the paths on the way back down.
        let mut chain = vec![start];
        let mut base = None;
        while let Some(&ino) = chain.last() {
            if ino == ROOT {
                chain.pop();
                base = Some(String::new());
                break;
            }
            if let Some(p) = paths.get(&ino) {
                chain.pop();
                base = Some(p.clone());
                break;
            }
            match nodes.get(&ino) {
                // A cycle cannot come from the kernel; stop rather than loop.
                Some(n) if chain.len() <= nodes.len() => chain.push(n.parent),
                _ => break,
            }
        }
        let Some(mut path) = base else { continue };
        for ino in chain.into_iter().rev() {
            let name = &nodes[&ino].name;
            path = if path.is_empty() { name.clone() } else { format!("{path}/{name}") };
            paths.insert(ino, path.clone());
        }
    }
    paths
}

/// Whether a held node is `node` as the kernel knows it: same type, permissions, owner, device
/// number; a symlink's target compared when the kernel read it, else its length (the kernel
/// caches a target only once it read it).
fn same_node(h: &HeldNode, node: &Node) -> bool {
    let a = &h.attr;
    let access = a.mode & 0o7777 == node.access.mode && a.uid == node.access.uid && a.gid == node.access.gid;
    let file_type = a.mode & libc::S_IFMT;
    access
        && match &node.kind {
            NodeKind::Dir => file_type == libc::S_IFDIR,
            NodeKind::Symlink(target) => {
                file_type == libc::S_IFLNK && h.target.as_ref().map_or(a.size == target.len() as u64, |t| t == target)
            }
            NodeKind::Device(kind, rdev) => file_type == type_bits(*kind) && a.rdev == rdev.to_fuse(),
        }
}

fn type_bits(kind: DevKind) -> u32 {
    match kind {
        DevKind::Char => libc::S_IFCHR,
        DevKind::Block => libc::S_IFBLK,
        DevKind::Fifo => libc::S_IFIFO,
    }
}

/// A retired node as the kernel knows it. A symlink whose target the kernel never read keeps
/// an empty one: nothing can follow it any more (its name is invalidated).
fn held_node(h: &HeldNode) -> Node {
    let a = &h.attr;
    let access = Access { mode: a.mode & 0o7777, uid: a.uid, gid: a.gid };
    let kind = match a.mode & libc::S_IFMT {
        libc::S_IFDIR => NodeKind::Dir,
        libc::S_IFLNK => NodeKind::Symlink(h.target.clone().unwrap_or_default()),
        bits => {
            let kind =
                [DevKind::Block, DevKind::Fifo].into_iter().find(|k| type_bits(*k) == bits).unwrap_or(DevKind::Char);
            NodeKind::Device(kind, Rdev::from_fuse(a.rdev))
        }
    };
    Node { kind, access }
}

/// When the kernel was told a held node was made.
fn born(h: &HeldNode) -> SystemTime {
    SystemTime::UNIX_EPOCH + std::time::Duration::new(h.attr.mtime.0, h.attr.mtime.1.min(999_999_999))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::tree::TreeBuilder;
    use crate::device::{Access, DevKind, Rdev};

    fn tree(gpus: &[(u32, u32)]) -> Tree {
        let mut b = TreeBuilder::default();
        b.insert("null", Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
        b.mkdir_all("pts").unwrap();
        for &(n, minor) in gpus {
            b.insert(&format!("nvidia{n}"), Node::device(DevKind::Char, Rdev::new(1, minor), Access::DEVICE_DEFAULT))
                .unwrap();
        }
        b.build()
    }

    fn name(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    /// Lookup without a mount: names resolve to their node; a missing name, an unknown node or
    /// a lookup in a non-directory is a miss the adapter turns into ENOENT or ENOTDIR.
    #[test]
    fn lookup_resolves_names() {
        let fs = Devfs::new(tree(&[(0, 5)]));
        let e = fs.lookup(1, name("nvidia0")).unwrap();
        assert_eq!(e.node, Node::device(DevKind::Char, Rdev::new(1, 5), Access::DEVICE_DEFAULT));
        assert_eq!(fs.lookup(1, name("nvidia1")).unwrap_err(), Miss::NotFound);
        let null = fs.lookup(1, name("null")).unwrap().ino;
        assert_eq!(fs.lookup(null, name("x")).unwrap_err(), Miss::NotDir);
        assert_eq!(fs.lookup(9999, name("x")).unwrap_err(), Miss::NoNode);
    }

    /// Bug (found from outside): a lookup of a name over 255 bytes answered ENOENT where tmpfs
    /// answers ENAMETOOLONG. 255 bytes is still an ordinary miss; a parent that is no directory
    /// is still ENOTDIR, as the kernel's walk finds that first.
    #[test]
    fn lookup_of_a_name_over_255_bytes_is_name_too_long() {
        let fs = Devfs::new(tree(&[(0, 5)]));
        assert_eq!(fs.lookup(1, name(&"a".repeat(255))).unwrap_err(), Miss::NotFound);
        assert_eq!(fs.lookup(1, name(&"a".repeat(256))).unwrap_err(), Miss::NameTooLong);
        assert_eq!(fs.lookup(1, name(&"a".repeat(1024))).unwrap_err(), Miss::NameTooLong);
        assert_eq!(fs.lookup(1, OsStr::from_bytes(&[0xff; 256])).unwrap_err(), Miss::NameTooLong);
        let null = fs.lookup(1, name("null")).unwrap().ino;
        assert_eq!(fs.lookup(null, name(&"a".repeat(256))).unwrap_err(), Miss::NotDir);
    }

    /// Bug (found from outside): every directory had 2 links, where tmpfs gives 2 plus one per
    /// subdirectory (find(1) counts on it). A reload that adds a subdirectory keeps the
    /// directory's node id and raises its count, and lists the directory as changed, so the
    /// kernel drops the cached count.
    #[test]
    fn directories_link_once_more_for_each_subdirectory() {
        let fs = Devfs::new(tree(&[(0, 5)]));
        let pts = fs.lookup(ROOT, name("pts")).unwrap();
        assert_eq!((fs.entry(ROOT).unwrap().nlink(), pts.nlink()), (3, 2));
        assert_eq!(fs.lookup(ROOT, name("null")).unwrap().nlink(), 1);
        let mut b = TreeBuilder::default();
        for dir in ["pts", "shm", "dri/by-path", "mqueue"] {
            b.mkdir_all(dir).unwrap();
        }
        b.insert("dri/card0", Node::device(DevKind::Char, Rdev::new(226, 0), Access::DEVICE_DEFAULT)).unwrap();
        let change = fs.replace(b.build());
        assert_eq!(change.dirs, vec![ROOT]);
        assert_eq!(fs.entry(ROOT).unwrap().nlink(), 2 + 4);
        assert_eq!(fs.lookup(ROOT, name("dri")).unwrap().nlink(), 3);
        let kept = fs.lookup(ROOT, name("pts")).unwrap();
        assert_eq!((kept.ino, kept.nlink()), (pts.ino, 2));
    }

    /// Kernel fact: an inode's rdev is fixed, so a changed name gets a new node id; unchanged
    /// names keep theirs, and only changed names are invalidated.
    #[test]
    fn reload_renumbers_only_changed_names() {
        let fs = Devfs::new(tree(&[(0, 5), (1, 7)]));
        let a0 = fs.lookup(1, name("nvidia0")).unwrap().ino;
        let a1 = fs.lookup(1, name("nvidia1")).unwrap().ino;
        let pts = fs.lookup(1, name("pts")).unwrap().ino;
        let change = fs.replace(tree(&[(0, 7), (1, 7)]));
        assert_eq!(change.generation, 2);
        assert_eq!(change.invalidate, vec![(1, "nvidia0".to_owned())]);
        let b0 = fs.lookup(1, name("nvidia0")).unwrap();
        assert_ne!(b0.ino, a0);
        assert_eq!(b0.node.rdev(), Some(Rdev::new(1, 7)));
        assert_eq!(fs.lookup(1, name("nvidia1")).unwrap().ino, a1);
        assert_eq!(fs.lookup(1, name("pts")).unwrap().ino, pts);
        // The listing carries node ids, so the directory's cached listing is stale too.
        assert_eq!(change.dirs, vec![1]);
    }

    /// Node ids are never reused, and a retired node answers getattr until forgotten.
    #[test]
    fn retired_nodes_live_until_forgotten() {
        let fs = Devfs::new(tree(&[(0, 5)]));
        let old = fs.lookup(1, name("nvidia0")).unwrap().ino;
        fs.lookup(1, name("nvidia0")).unwrap();
        fs.replace(tree(&[(0, 7)]));
        fs.replace(tree(&[(0, 5)]));
        let now = fs.lookup(1, name("nvidia0")).unwrap().ino;
        assert!(now > old, "a node id came back: {now} <= {old}");
        assert_eq!(fs.retired_count(), 1);
        assert_eq!(fs.entry(old).unwrap().node.rdev(), Some(Rdev::new(1, 5)));
        assert!(!fs.forget(old, 1));
        assert!(fs.forget(old, 1));
        assert_eq!(fs.retired_count(), 0);
        assert!(fs.entry(old).is_none());
    }

    /// A replaced node the kernel never looked up is not kept.
    #[test]
    fn unlooked_nodes_are_not_retired() {
        let fs = Devfs::new(tree(&[(0, 5)]));
        for i in 0..100 {
            fs.replace(tree(&[(0, 5 + i % 2)]));
        }
        assert_eq!(fs.retired_count(), 0);
    }

    /// Names that appear or vanish are invalidated (a cached negative lookup would hide a new
    /// name), and the directory's listing is reported as changed.
    #[test]
    fn added_and_removed_names_are_invalidated() {
        let fs = Devfs::new(tree(&[(0, 5)]));
        let change = fs.replace(tree(&[(1, 5)]));
        let mut inval = change.invalidate.clone();
        inval.sort();
        assert_eq!(inval, vec![(1, "nvidia0".to_owned()), (1, "nvidia1".to_owned())]);
        assert_eq!(change.dirs, vec![1]);
        let snap = fs.snapshot();
        let listed: Vec<&str> = snap.dir(1).unwrap().children().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(listed, ["null", "nvidia1", "pts"]);
    }

    /// A tree of char devices named `names`.
    fn named(names: &[&str]) -> Tree {
        let mut b = TreeBuilder::default();
        for n in names {
            b.insert(n, Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
        }
        b.build()
    }

    /// One getdents call as the kernel makes it: up to `room` entries of the root from
    /// `offset`, and the offset to go on from (the last entry's cookie), or None at the end.
    fn page(fs: &Devfs, offset: u64, room: usize, out: &mut Vec<String>) -> Option<u64> {
        let (mut next, mut got) = (None, 0);
        fs.list(1, offset, false, |_, cookie, name| {
            if got == room {
                return true;
            }
            out.push(name.to_owned());
            next = Some(cookie);
            got += 1;
            false
        })
        .unwrap();
        next
    }

    /// Bug (issue 10.5): offsets were positions, so a listing that spanned a reload adding or
    /// removing a name that sorts first lost or repeated names. Rule: a listing split anywhere
    /// by a reload gives every name of both trees exactly once, and no name twice.
    #[test]
    fn listing_spanning_a_reload_loses_and_repeats_nothing() {
        let both = ["full", "null", "random", "tty", "zero"];
        let a: Vec<&str> = both.iter().copied().chain(["aaa", "console", "urandom"]).collect();
        let b: Vec<&str> = both.iter().copied().chain(["0first", "abc", "ptmx", "zzz"]).collect();
        for (from, to) in [(&a, &b), (&b, &a)] {
            for room in 1..4 {
                for split in 0..=from.len() + 2 {
                    let fs = Devfs::new(named(from));
                    let (mut listed, mut offset) = (Vec::new(), 0);
                    for _ in 0..split.div_ceil(room) {
                        offset = page(&fs, offset, room, &mut listed).unwrap_or(u64::MAX);
                    }
                    fs.replace(named(to));
                    while offset != u64::MAX {
                        offset = page(&fs, offset, room, &mut listed).unwrap_or(u64::MAX);
                    }
                    let at = format!("{from:?} -> {to:?}, {room} a call, reload after {split}: {listed:?}");
                    for name in [".", ".."].iter().chain(&both) {
                        assert_eq!(listed.iter().filter(|n| n == name).count(), 1, "{name}: {at}");
                    }
                    let mut unique = listed.clone();
                    unique.sort();
                    unique.dedup();
                    assert_eq!(unique.len(), listed.len(), "a name came twice: {at}");
                }
            }
        }
    }

    /// Rule: a cookie keeps naming its name across reloads, also while the name is gone, so a
    /// listing resumed after a vanished name goes on with the names after it; an offset that
    /// was never a cookie lists nothing.
    #[test]
    fn cookies_outlive_their_names() {
        let fs = Devfs::new(named(&["a", "b", "c"]));
        let mut first = Vec::new();
        let after_b = {
            let o = page(&fs, 0, 3, &mut first).unwrap();
            page(&fs, o, 1, &mut first).unwrap()
        };
        assert_eq!(first, [".", "..", "a", "b"]);
        fs.replace(named(&["a", "bb", "c"]));
        let mut rest = Vec::new();
        assert!(page(&fs, after_b, 10, &mut rest).is_some());
        assert_eq!(rest, ["bb", "c"]);
        fs.replace(named(&["a", "b", "c"]));
        let mut again = Vec::new();
        page(&fs, 0, 4, &mut again);
        let mut cookies = Vec::new();
        fs.list(1, 0, false, |_, c, _| {
            cookies.push(c);
            false
        })
        .unwrap();
        assert_eq!(cookies[3], after_b, "b's cookie changed when b came back");
        let mut none = Vec::new();
        assert_eq!(page(&fs, 1 << 40, 10, &mut none), None);
        assert!(none.is_empty());
    }

    /// The kernel's view of `fs` after looking each path up `count` times, as the keeper's
    /// table would hold it (attributes as the adapter sends them).
    fn held_after_lookups(fs: &Devfs, paths: &[&str], count: u64) -> Held {
        let mut nodes = HashMap::new();
        for path in paths {
            let snap = fs.snapshot();
            let (parent_path, leaf) = Tree::split(path);
            let parent = snap.ino_of(parent_path).unwrap();
            let mut e = None;
            for _ in 0..count {
                e = Some(fs.lookup(parent, name(leaf)).unwrap());
            }
            let e = e.unwrap();
            let (bits, size, rdev) = match &e.node.kind {
                NodeKind::Dir => (libc::S_IFDIR, 0, 0),
                NodeKind::Symlink(t) => (libc::S_IFLNK, t.len() as u64, 0),
                NodeKind::Device(k, r) => (type_bits(*k), 0, r.to_fuse()),
            };
            let attr = crate::keeper::fuse_wire::Attr {
                mode: bits | e.node.access.mode,
                uid: e.node.access.uid,
                gid: e.node.access.gid,
                rdev,
                size,
                mtime: (5, 6),
            };
            nodes.insert(e.ino, HeldNode { parent, name: leaf.to_owned(), attr, target: None, count });
        }
        Held::from_parts(nodes, fs.reload.lock().saturating_sub(1), BTreeMap::new())
    }

    /// Rule (issue 13): a server that takes over keeps the id and lookup count of every node
    /// the kernel holds that its tree has unchanged, retires the others (to be forgotten
    /// down to 0), numbers new nodes after every id ever given, and invalidates what changed.
    #[test]
    fn resume_keeps_held_nodes_and_retires_changed_ones() {
        let old = Devfs::new(tree(&[(0, 3), (1, 5)]));
        let held = held_after_lookups(&old, &["null", "nvidia0", "nvidia1", "pts"], 2);
        let max = held.max_ino();
        let new = Devfs::new(tree(&[(0, 3), (1, 7), (2, 8)]));
        let r = new.resume(&held, 4);
        assert_eq!((r.kept, r.retired, r.change.generation), (3, 1, 5));
        let snap = new.snapshot();
        for path in ["null", "nvidia0", "pts"] {
            assert_eq!(snap.ino_of(path), old.snapshot().ino_of(path), "{path} keeps its id");
        }
        let old_gpu1 = old.snapshot().ino_of("nvidia1").unwrap();
        assert!(snap.ino_of("nvidia1").unwrap() > max && snap.ino_of("nvidia2").unwrap() > max);
        assert_eq!(
            new.entry(old_gpu1).unwrap().node.rdev(),
            Some(Rdev::new(1, 5)),
            "the retired node keeps its device"
        );
        assert_eq!(new.retired_count(), 1);
        assert!(r.change.invalidate.contains(&(ROOT, "nvidia1".to_owned())));
        assert!(r.change.invalidate.contains(&(ROOT, "nvidia2".to_owned())), "a negative entry is dropped");
        assert!(!r.change.invalidate.contains(&(ROOT, "null".to_owned())));
        assert!(r.change.dirs.contains(&ROOT));
        // The kept counts are the kernel's: two forgets let null go, one more is too many.
        assert!(!new.forget(old_gpu1, 1));
        assert!(new.forget(old_gpu1, 1), "the retired node is let go at 0");
        assert_eq!(new.retired_count(), 0);
        let null = snap.ino_of("null").unwrap();
        assert_eq!(new.entry(null).unwrap().nlookup.load(Ordering::Relaxed), 2);
    }

    /// Rule (issue 13): a held node whose parent the table does not hold, or whose symlink
    /// target differs from the one the kernel read, is retired, never matched by guess.
    #[test]
    fn resume_retires_what_it_cannot_place() {
        let mut b = TreeBuilder::default();
        b.insert("fd", Node::symlink("/proc/self/fd")).unwrap();
        b.insert("pts/x", Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
        let fs = Devfs::new(b.build());
        let mut held = held_after_lookups(&fs, &["fd", "pts", "pts/x"], 1);
        let mut nodes = held.nodes().clone();
        let fd = fs.snapshot().ino_of("fd").unwrap();
        let pts = fs.snapshot().ino_of("pts").unwrap();
        nodes.get_mut(&fd).unwrap().target = Some("/proc/self/fX".into());
        nodes.remove(&pts);
        held = Held::from_parts(nodes, held.max_ino(), BTreeMap::new());
        let r = fs.resume(&held, 1);
        assert_eq!((r.kept, r.retired), (0, 2));
        assert_eq!(fs.retired_count(), 2);
    }

    /// Rule: FUSE's device encoding decodes back to the number, for the widest numbers FUSE
    /// can carry.
    #[test]
    fn fuse_rdev_round_trips() {
        for (major, minor) in [(1, 3), (195, 255), (4095, 0xfffff), (0, 256)] {
            let r = Rdev::new(major, minor);
            assert_eq!(Rdev::from_fuse(r.to_fuse()), r);
        }
    }

    /// Rule (issue 13): a listing split by a takeover resumes after the name its cookie named
    /// under the old server, even when the two servers would number names differently (a
    /// reload had brought a name the new tree sorts earlier).
    #[test]
    fn resume_keeps_the_cookies_the_kernel_was_given() {
        let old = Devfs::new(tree(&[(0, 3)]));
        old.replace(tree(&[(0, 3), (1, 5)]));
        let mut given = BTreeMap::new();
        let mut listed = Vec::new();
        old.list(ROOT, 0, false, |_, cookie, name| {
            if cookie >= Cookies::FIRST {
                given.insert(cookie, name.to_owned());
            }
            listed.push(name.to_owned());
            false
        })
        .unwrap();
        let (&cut, cut_name) = given.iter().find(|(_, n)| *n == "nvidia0").unwrap();
        let new = Devfs::new(tree(&[(0, 3), (1, 5)]));
        new.resume(&Held::from_parts(HashMap::new(), 100, given.clone()), 2);
        let mut rest = Vec::new();
        new.list(ROOT, cut, false, |_, _, name| {
            rest.push(name.to_owned());
            false
        })
        .unwrap();
        let after: Vec<String> = listed.iter().skip_while(|n| *n != cut_name).skip(1).cloned().collect();
        assert_eq!(rest, after);
        // A fresh server would have given nvidia1 another cookie than the old one did.
        let fresh = Devfs::new(tree(&[(0, 3), (1, 5)]));
        let mut fresh_cookies = BTreeMap::new();
        fresh
            .list(ROOT, 0, false, |_, cookie, name| {
                fresh_cookies.insert(name.to_owned(), cookie);
                false
            })
            .unwrap();
        assert!(given.iter().any(|(c, n)| fresh_cookies[n] != *c), "the test needs numberings that differ");
    }
}
