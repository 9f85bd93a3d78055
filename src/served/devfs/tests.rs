//! `Devfs`'s rules: numbering, reloads, retired nodes, listings across reloads, takeovers.

use super::*;
use crate::decision::tree::TreeBuilder;
use crate::device::{Access, DevKind, Rdev};
use crate::keeper::kernel_nodes::{Held, HeldNode};
use crate::served::takeover::type_bits;
use std::collections::BTreeMap;

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
    assert_eq!(new.entry(old_gpu1).unwrap().node.rdev(), Some(Rdev::new(1, 5)), "the retired node keeps its device");
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
