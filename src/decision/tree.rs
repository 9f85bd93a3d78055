//! The `/dev` tree a container sees, as an immutable value.
//!
//! A tree maps `/dev`-relative paths (`null`, `pts`, `dri/card0`; the root is `""`) to nodes.
//! A node's identity is its path together with its value: two trees agree on a name exactly
//! when both hold an equal node there, which is what [`diff`] reports and what the daemon uses
//! to decide which names the kernel must forget. Every parent of a node is a directory; the
//! builder refuses anything else, and anything beyond [`crate::inputs::limits`]: a name or path the
//! kernel cannot take, a device number FUSE cannot carry, a tree too large to serve.

use crate::device::{Access, DevKind, Rdev};
use crate::inputs::limits::{self, LimitError};
use std::collections::BTreeMap;
use thiserror::Error;

/// What a node is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum NodeKind {
    Dir,
    Symlink(String),
    Device(DevKind, Rdev),
}

/// One node of the tree. Symlinks carry `0777` root:root.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
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
    /// `path` is cut short when it is long.
    #[error("{path}: {error}")]
    Limit { path: String, error: LimitError },
    /// Nodes handed over that no builder makes (a parent missing, another root).
    #[error("the nodes do not make a tree")]
    NotATree,
}

impl TreeError {
    fn limit(path: &str, error: LimitError) -> TreeError {
        TreeError::Limit { path: limits::shorten(path), error }
    }
}

/// An immutable `/dev` tree. Built with [`TreeBuilder`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "BTreeMap<String, Node>", into = "BTreeMap<String, Node>")]
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

/// A tree handed over as its nodes (a server's plan, through its keeper) is rebuilt node by
/// node with [`TreeBuilder`], so it holds to every rule a built tree does, or is refused.
impl TryFrom<BTreeMap<String, Node>> for Tree {
    type Error = TreeError;

    fn try_from(nodes: BTreeMap<String, Node>) -> Result<Tree, TreeError> {
        let mut b = TreeBuilder::default();
        for (path, node) in nodes.iter().filter(|(p, _)| !p.is_empty()) {
            b.insert(path, node.clone())?;
        }
        let tree = b.build();
        if tree.nodes != nodes {
            return Err(TreeError::NotATree);
        }
        Ok(tree)
    }
}

impl From<Tree> for BTreeMap<String, Node> {
    fn from(tree: Tree) -> Self {
        tree.nodes
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
    /// The lengths of the paths of `nodes`, summed.
    path_bytes: usize,
}

impl Default for TreeBuilder {
    fn default() -> Self {
        TreeBuilder { nodes: BTreeMap::from([(String::new(), Node::dir())]), path_bytes: 0 }
    }
}

impl TreeBuilder {
    pub fn get(&self, path: &str) -> Option<&Node> {
        self.nodes.get(path)
    }

    /// The first node under directory `path` (not `path` itself) that is not a directory.
    pub fn first_file_under(&self, path: &str) -> Option<&str> {
        let prefix = format!("{path}/");
        self.nodes
            .range(prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&prefix))
            .find(|(_, n)| n.kind != NodeKind::Dir)
            .map(|(p, _)| p.as_str())
    }

    /// Adds a node at a path that has none, within the tree's limits.
    fn add(&mut self, path: &str, node: Node) -> Result<(), TreeError> {
        if self.nodes.len() >= limits::MAX_NODES {
            return Err(TreeError::limit(path, LimitError::TooManyNodes));
        }
        if self.path_bytes + path.len() > limits::MAX_TREE_PATH_BYTES {
            return Err(TreeError::limit(path, LimitError::TreeTooLarge));
        }
        self.path_bytes += path.len();
        self.nodes.insert(path.to_owned(), node);
        Ok(())
    }

    /// Creates `path` and its parents as directories; existing directories are kept.
    pub fn mkdir_all(&mut self, path: &str) -> Result<(), TreeError> {
        // Checked whole first: a path too long to serve makes no directories.
        limits::check_dev_path(path).map_err(|e| TreeError::limit(path, e))?;
        self.make_dirs(path)
    }

    /// [`Self::mkdir_all`] for a path whose names and length are already checked.
    fn make_dirs(&mut self, path: &str) -> Result<(), TreeError> {
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
                None => self.add(prefix, Node::dir())?,
            }
            end += 1;
        }
        Ok(())
    }

    /// Gives directory `path` the permission bits `mode`; a path that is no directory is left.
    pub fn chmod_dir(&mut self, path: &str, mode: u32) {
        if let Some(node) = self.nodes.get_mut(path).filter(|n| n.kind == NodeKind::Dir) {
            node.access.mode = mode;
        }
    }

    /// Places a non-directory node at `path`, replacing a non-directory one.
    pub fn insert(&mut self, path: &str, node: Node) -> Result<(), TreeError> {
        limits::check_dev_path(path).map_err(|e| TreeError::limit(path, e))?;
        if let Some(rdev) = node.rdev() {
            limits::check_rdev(rdev).map_err(|e| TreeError::limit(path, e))?;
        }
        let (parent, _) = Tree::split(path);
        if !parent.is_empty() {
            // The parent's names and length are within the path's, checked above.
            self.make_dirs(parent).map_err(|e| match e {
                TreeError::DirOverNode { path: parent, .. } => {
                    TreeError::ParentNotDir { path: path.to_owned(), parent }
                }
                TreeError::Limit { error, .. } => TreeError::limit(path, error),
                other => other,
            })?;
        }
        match self.nodes.get_mut(path) {
            Some(n) if n.kind == NodeKind::Dir => {
                Err(TreeError::NodeOverDir { path: path.to_owned(), new: kind_name(&node) })
            }
            Some(n) => {
                *n = node;
                Ok(())
            }
            None => self.add(path, node),
        }
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

    fn limit_error(r: Result<(), TreeError>) -> LimitError {
        match r {
            Err(TreeError::Limit { error, .. }) => error,
            other => panic!("expected a limit error, got {other:?}"),
        }
    }

    /// Bug (issue 9.1): a device number FUSE cannot carry was served as another device
    /// (`1:1048585` as `1:9`, `16777217:1` as `1:1`, `4097:1` as `1:257`); the tree refuses it,
    /// wherever it comes from.
    #[test]
    fn device_numbers_beyond_fuse_are_refused() {
        let mut b = TreeBuilder::default();
        for (major, minor) in [(1, 1_048_585), (16_777_217, 1), (4097, 1)] {
            let node = Node::device(DevKind::Char, Rdev::new(major, minor), Access::DEVICE_DEFAULT);
            assert_eq!(limit_error(b.insert("x", node)), LimitError::Rdev(Rdev::new(major, minor)));
        }
        assert!(b.get("x").is_none());
        b.insert("x", Node::device(DevKind::Block, Rdev::new(4095, (1 << 20) - 1), Access::DEVICE_DEFAULT)).unwrap();
    }

    /// Bug (issue 9.4): a path nested 40,000 directories deep made a directory of every prefix,
    /// each its own string (3 GiB); a path the kernel cannot take is refused before any
    /// directory is made, and no tree grows past its node or path-bytes budget.
    #[test]
    fn deep_paths_and_large_trees_are_refused() {
        let mut b = TreeBuilder::default();
        let deep = format!("{}x", "a/".repeat(40_000));
        assert_eq!(limit_error(b.insert(&deep, null())), LimitError::PathTooLong(80_006));
        assert_eq!(limit_error(b.mkdir_all(&deep)), LimitError::PathTooLong(80_006));
        assert_eq!(b.build().len(), 1, "no directory was made");

        let mut b = TreeBuilder::default();
        let refused = (0..).map(|i| b.insert(&format!("d{i}"), null())).find_map(Result::err);
        assert_eq!(limit_error(refused.map_or(Ok(()), Err)), LimitError::TooManyNodes);
        assert_eq!(b.build().len(), limits::MAX_NODES);

        // Chains of 2,000 directories, each path near the kernel's limit: the path bytes run out
        // long before the nodes do.
        let mut b = TreeBuilder::default();
        let chain = |i: usize| format!("{i:03}/{}x", "a/".repeat(2000));
        let refused = (0..100).map(|i| b.insert(&chain(i), null())).find_map(Result::err);
        assert_eq!(limit_error(refused.map_or(Ok(()), Err)), LimitError::TreeTooLarge);
        let tree = b.build();
        assert!(tree.iter().map(|(p, _)| p.len()).sum::<usize>() <= limits::MAX_TREE_PATH_BYTES);
    }

    /// Bug (issue 9.5): names the kernel cannot list (over 255 bytes, holding a NUL) or that
    /// are not names (empty, `.`, `..`) are refused, and the error shows a long one cut short.
    #[test]
    fn names_the_kernel_cannot_list_are_refused() {
        let mut b = TreeBuilder::default();
        for (path, want) in [
            ("n".repeat(256), "is 256 bytes; the kernel takes at most 255"),
            (format!("dir/{}", "n".repeat(64 << 10)), "is 65536 bytes; the kernel takes at most 255"),
            ("a\0b".to_owned(), "holds a NUL byte"),
            ("a//b".to_owned(), "\"\" is not a file name"),
            ("a/./b".to_owned(), "\".\" is not a file name"),
            ("../b".to_owned(), "\"..\" is not a file name"),
        ] {
            let err = b.insert(&path, null()).unwrap_err().to_string();
            assert!(err.contains(want), "{path:.80?}: {err}");
            assert!(err.len() < 300, "{err}");
        }
        assert_eq!(b.build().len(), 1);
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
