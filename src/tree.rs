//! The `/dev` tree a container sees, as an immutable value.
//!
//! A tree maps `/dev`-relative paths (`null`, `pts`, `dri/card0`; the root is `""`) to nodes.
//! A node's identity is its path together with its value: two trees agree on a name exactly
//! when both hold an equal node there, which is what [`diff`] reports and what the daemon uses
//! to decide which names the kernel must forget. Every parent of a node is a directory; the
//! builder refuses anything else.

use crate::device::{Access, DevKind, Rdev};
use std::collections::BTreeMap;
use thiserror::Error;

/// What a node is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NodeKind {
    Dir,
    Symlink(String),
    Device(DevKind, Rdev),
}

/// One node of the tree. Symlinks carry `0777` root:root.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Node {
    pub kind: NodeKind,
    pub access: Access,
}

impl Node {
    pub fn dir() -> Node {
        Node { kind: NodeKind::Dir, access: Access::DIR_DEFAULT }
    }

    pub fn symlink(target: &str) -> Node {
        Node { kind: NodeKind::Symlink(target.to_owned()), access: Access { mode: 0o777, uid: 0, gid: 0 } }
    }

    pub fn device(kind: DevKind, rdev: Rdev, access: Access) -> Node {
        Node { kind: NodeKind::Device(kind, rdev), access }
    }

    /// The device number a device node opens.
    pub fn rdev(&self) -> Option<Rdev> {
        match self.kind {
            NodeKind::Device(_, rdev) => Some(rdev),
            _ => None,
        }
    }
}

/// Why a node could not be placed.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TreeError {
    #[error("{path}: its parent {parent} is not a directory")]
    ParentNotDir { path: String, parent: String },
    #[error("{path}: a directory is needed there, but it is already a {existing}")]
    DirOverNode { path: String, existing: &'static str },
    #[error("{path}: a {new} cannot replace a directory")]
    NodeOverDir { path: String, new: &'static str },
}

/// An immutable `/dev` tree. Built with [`TreeBuilder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    nodes: BTreeMap<String, Node>,
}

impl Tree {
    /// The node at `path` (`""` is the root).
    pub fn get(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path)
    }

    /// Every node but the root, sorted by path.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Node)> {
        self.nodes.iter().filter(|(p, _)| !p.is_empty()).map(|(p, n)| (p.as_str(), n))
    }

    /// The number of nodes, the root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always false: a tree has its root.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The parent path and the last component of `path`.
    pub fn split(path: &str) -> (&str, &str) {
        path.rsplit_once('/').unwrap_or(("", path))
    }
}

/// The differences between two trees, by path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    /// Names held by both trees with different nodes.
    pub changed: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl Diff {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.added.is_empty() && self.removed.is_empty()
    }
}

/// Which names differ between `old` and `new`.
pub fn diff(old: &Tree, new: &Tree) -> Diff {
    let mut d = Diff::default();
    for (path, node) in old.iter() {
        match new.get(path) {
            None => d.removed.push(path.to_owned()),
            Some(n) if n != node => d.changed.push(path.to_owned()),
            Some(_) => {}
        }
    }
    d.added = new.iter().filter(|(p, _)| old.get(p).is_none()).map(|(p, _)| p.to_owned()).collect();
    d
}

fn kind_name(node: &Node) -> &'static str {
    match &node.kind {
        NodeKind::Dir => "directory",
        NodeKind::Symlink(_) => "symlink",
        NodeKind::Device(DevKind::Char, _) => "char device",
        NodeKind::Device(DevKind::Block, _) => "block device",
        NodeKind::Device(DevKind::Fifo, _) => "FIFO",
    }
}

/// Builds a [`Tree`]; parents are created as directories, a later node replaces an earlier
/// one of a non-directory kind.
#[derive(Debug)]
pub struct TreeBuilder {
    nodes: BTreeMap<String, Node>,
}

impl Default for TreeBuilder {
    fn default() -> Self {
        TreeBuilder { nodes: BTreeMap::from([(String::new(), Node::dir())]) }
    }
}

impl TreeBuilder {
    pub fn get(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path)
    }

    /// Creates `path` and its parents as directories; existing directories are kept.
    pub fn mkdir_all(&mut self, path: &str) -> Result<(), TreeError> {
        let mut end = 0;
        for component in path.split('/') {
            end += component.len();
            let prefix = &path[..end];
            match self.nodes.get(prefix) {
                Some(n) if n.kind == NodeKind::Dir => {}
                Some(n) if prefix == path => {
                    return Err(TreeError::DirOverNode { path: path.to_owned(), existing: kind_name(n) });
                }
                Some(_) => {
                    return Err(TreeError::ParentNotDir { path: path.to_owned(), parent: prefix.to_owned() });
                }
                None => {
                    self.nodes.insert(prefix.to_owned(), Node::dir());
                }
            }
            end += 1;
        }
        Ok(())
    }

    /// Places a non-directory node at `path`, replacing a non-directory one.
    pub fn insert(&mut self, path: &str, node: Node) -> Result<(), TreeError> {
        let (parent, _) = Tree::split(path);
        if !parent.is_empty() {
            self.mkdir_all(parent).map_err(|e| match e {
                TreeError::DirOverNode { path: parent, .. } => {
                    TreeError::ParentNotDir { path: path.to_owned(), parent }
                }
                other => other,
            })?;
        }
        if self.nodes.get(path).is_some_and(|n| n.kind == NodeKind::Dir) {
            return Err(TreeError::NodeOverDir { path: path.to_owned(), new: kind_name(&node) });
        }
        self.nodes.insert(path.to_owned(), node);
        Ok(())
    }

    pub fn build(self) -> Tree {
        Tree { nodes: self.nodes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn null() -> Node {
        Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)
    }

    /// Rule: parents of a node are made as directories.
    #[test]
    fn insert_creates_parent_directories() {
        let mut b = TreeBuilder::default();
        b.insert("dri/by-path/card0", null()).unwrap();
        let t = b.build();
        assert_eq!(t.get("dri").unwrap().kind, NodeKind::Dir);
        assert_eq!(t.get("dri/by-path").unwrap().kind, NodeKind::Dir);
        assert_eq!(t.len(), 4);
    }

    /// A node cannot sit under a non-directory, and a directory is never replaced.
    #[test]
    fn refuses_nodes_under_files_and_over_directories() {
        let mut b = TreeBuilder::default();
        b.insert("null", null()).unwrap();
        assert!(matches!(b.insert("null/x", null()), Err(TreeError::ParentNotDir { .. })));
        assert!(matches!(b.mkdir_all("null"), Err(TreeError::DirOverNode { .. })));
        b.mkdir_all("pts").unwrap();
        assert!(matches!(b.insert("pts", null()), Err(TreeError::NodeOverDir { .. })));
    }

    /// Identity: diff names exactly the paths whose nodes differ, appear or vanish.
    #[test]
    fn diff_names_changed_added_removed() {
        let mut a = TreeBuilder::default();
        a.insert("null", null()).unwrap();
        a.insert("nvidia0", Node::device(DevKind::Char, Rdev::new(195, 0), Access::DEVICE_DEFAULT)).unwrap();
        a.insert("gone", null()).unwrap();
        let a = a.build();
        let mut b = TreeBuilder::default();
        b.insert("null", null()).unwrap();
        b.insert("nvidia0", Node::device(DevKind::Char, Rdev::new(195, 1), Access::DEVICE_DEFAULT)).unwrap();
        b.insert("new", null()).unwrap();
        let b = b.build();
        let d = diff(&a, &b);
        assert_eq!(d.changed, vec!["nvidia0"]);
        assert_eq!(d.added, vec!["new"]);
        assert_eq!(d.removed, vec!["gone"]);
        assert!(diff(&a, &a).is_empty());
    }
}
