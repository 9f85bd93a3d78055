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
//! Listings go by cookie, not position, so that a listing resumed across a reload neither
//! skips nor repeats a name: see [`cookies`].

mod cookies;

pub(super) use cookies::Cookies;

use crate::decision::tree::{self, Diff, Node, NodeKind, Tree};
use crate::keeper::kernel_nodes::ROOT;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
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
    pub(super) nlookup: AtomicU64,
    /// A directory's link count as of the newest snapshot: see [`Entry::nlink`].
    links: AtomicU32,
}

impl Entry {
    pub(super) fn new(ino: u64, node: Node, born: SystemTime) -> Entry {
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
    pub(super) names: Vec<Child>,
    index: HashMap<String, u64>,
}

impl Dir {
    /// Every child, in name order.
    pub fn children(&self) -> &[Child] {
        &self.names
    }
}

/// One generation of the served tree.
#[derive(Debug)]
pub struct Snapshot {
    pub generation: u64,
    pub tree: Tree,
    entries: HashMap<u64, Arc<Entry>>,
    pub(super) dirs: HashMap<u64, Dir>,
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
    pub(super) fn build(
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
pub(super) struct State {
    pub(super) snap: Arc<Snapshot>,
    pub(super) retired: HashMap<u64, Arc<Entry>>,
}

/// The live filesystem: answers what the FUSE adapter asks, swaps trees on reload.
#[derive(Debug)]
pub struct Devfs {
    pub(super) state: RwLock<State>,
    /// Held through a whole reload, so reloads never interleave; it guards the next free node
    /// id, which only reloads take from.
    pub(super) reload: Mutex<u64>,
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

#[cfg(test)]
mod tests;
