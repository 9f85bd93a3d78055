//! A server taking over from one that died or is being replaced: the tree it loaded renumbered
//! so that the nodes the kernel holds (the keeper's table) keep their ids and lookup counts,
//! the others retired with the attributes the kernel has, and what the kernel may have cached
//! that no longer holds listed to invalidate.
//!
//! Pure but for the `Devfs` it swaps into. Assumption: the keeper's table is the kernel's (it
//! counted every reply it relayed), and a held node is the same node exactly when its type,
//! permissions, owner and device number (a symlink: its target, or its length where the kernel
//! never read it) are equal.

use super::devfs::{Change, Cookies, Devfs, Entry, Snapshot, State};
use crate::decision::tree::{Node, NodeKind};
use crate::device::{Access, DevKind, Rdev};
use crate::keeper::kernel_nodes::{Held, HeldNode, ROOT};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

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

pub(super) fn type_bits(kind: DevKind) -> u32 {
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
