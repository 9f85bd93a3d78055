//! Four readers that hammer a devremap mount while the process answering the kernel is killed
//! or replaced (issue 13): one thread each for `stat`, `open`, `readdir` and `readlink`, over
//! every name of the plan, each result checked against the plan. Used by tests/handover.rs and
//! by the benchmark (benches/devfs.rs includes this file by path), so it needs nothing but std,
//! libc and serde_json.
//!
//! A stall is the time between two successful operations of one reader. The caller numbers
//! periods ([`Load::next_period`], just before each kill): a stall counts in the period during
//! which it ended, so the stall a kill caused is the longest one of the period the kill began.
//! Assumptions: the mount serves the plan unchanged while the readers run (no reload), and
//! every char device with major 1 (null, zero, full, random...) is harmless to open.

use serde_json::Value;
use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How many failure messages a reader keeps (it counts them all).
const KEPT_FAILURES: usize = 10;

/// What the readers expect to see, from a plan (`plan --json` or the state file).
#[derive(Clone, Debug)]
pub struct Expect {
    /// Every node path and, for a char device, its `(major, minor)`.
    pub nodes: Vec<(String, Option<(u32, u32)>)>,
    /// Char devices with major 1: opened `O_RDONLY | O_NONBLOCK`.
    pub open: Vec<String>,
    /// Every directory (`""` is the root) and the names it must list, no more, no less.
    pub dirs: Vec<(String, BTreeSet<String>)>,
    /// Every symlink and its target.
    pub links: Vec<(String, String)>,
}

impl Expect {
    pub fn from_plan(plan: &Value) -> Expect {
        let nodes = plan["nodes"].as_array().expect("nodes is an array");
        let path = |n: &Value| n["path"].as_str().expect("a node path").to_owned();
        let rdev = |n: &Value| {
            (n["type"] == "char").then(|| (n["major"].as_u64().unwrap() as u32, n["minor"].as_u64().unwrap() as u32))
        };
        let mut dirs = vec![(String::new(), BTreeSet::new())];
        dirs.extend(nodes.iter().filter(|n| n["type"] == "dir").map(|n| (path(n), BTreeSet::new())));
        for n in nodes {
            let p = path(n);
            let (parent, name) = p.rsplit_once('/').unwrap_or(("", &p));
            let listed = dirs.iter_mut().find(|(d, _)| d == parent).expect("a node's parent is a directory");
            listed.1.insert(name.to_owned());
        }
        Expect {
            nodes: nodes.iter().map(|n| (path(n), rdev(n))).collect(),
            open: nodes.iter().filter(|n| rdev(n).is_some_and(|(major, _)| major == 1)).map(path).collect(),
            dirs,
            links: nodes
                .iter()
                .filter(|n| n["type"] == "symlink")
                .map(|n| (path(n), n["target"].as_str().expect("a symlink target").to_owned()))
                .collect(),
        }
    }
}

/// The four kinds of reader, one thread each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Stat,
    Open,
    Readdir,
    Readlink,
}

pub const KINDS: [Kind; 4] = [Kind::Stat, Kind::Open, Kind::Readdir, Kind::Readlink];

/// What one reader did.
#[derive(Debug)]
pub struct Reader {
    pub kind: Kind,
    pub ops: u64,
    pub failures: u64,
    /// The first failures, as `period N: what failed`.
    pub failure_messages: Vec<String>,
    /// Listings read whole and equal to the expected names (readdir only).
    pub complete_listings: u64,
    /// The longest stall that ended in each period.
    pub stalls: Vec<Duration>,
}

impl Reader {
    pub fn longest_stall(&self) -> Duration {
        self.stalls.iter().copied().max().unwrap_or_default()
    }
}

/// The readers, running.
pub struct Load {
    stop: Arc<AtomicBool>,
    period: Arc<AtomicUsize>,
    ok: Arc<[AtomicU64; 4]>,
    threads: Vec<JoinHandle<Reader>>,
}

impl Load {
    /// Starts the four readers on the mount at `root`, in period 0.
    pub fn start(root: &Path, expect: &Expect) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let period = Arc::new(AtomicUsize::new(0));
        let ok: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
        let threads = KINDS
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let (stop, period, ok) = (stop.clone(), period.clone(), ok.clone());
                let (root, expect) = (root.to_owned(), expect.clone());
                std::thread::Builder::new()
                    .name(format!("{kind:?}").to_lowercase())
                    .spawn(move || read(kind, &root, &expect, &stop, &period, &ok[i]))
                    .expect("a reader thread")
            })
            .collect();
        Load { stop, period, ok, threads }
    }

    /// Begins the next period (call it just before a kill) and returns its number.
    pub fn next_period(&self) -> usize {
        self.period.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Successful operations so far, per reader (in [`KINDS`] order).
    pub fn ok_counts(&self) -> [u64; 4] {
        std::array::from_fn(|i| self.ok[i].load(Ordering::Relaxed))
    }

    /// Whether every reader has succeeded at least `n` more times than `since` says.
    pub fn advanced(&self, since: [u64; 4], n: u64) -> bool {
        self.ok_counts().iter().zip(since).all(|(now, then)| *now >= then + n)
    }

    /// Stops the readers and returns what each did.
    pub fn finish(mut self) -> Vec<Reader> {
        self.stop.store(true, Ordering::SeqCst);
        self.threads.drain(..).map(|t| t.join().expect("a reader panicked")).collect()
    }
}

impl Drop for Load {
    /// Readers left running (a test that failed) stop at their next operation.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The longest stall any reader saw in each period, from period 1 on (period `k` began with
/// the `k`-th kill).
pub fn stall_per_period(readers: &[Reader]) -> Vec<Duration> {
    let periods = readers.iter().map(|r| r.stalls.len()).max().unwrap_or(0);
    (1..periods).map(|p| readers.iter().filter_map(|r| r.stalls.get(p).copied()).max().unwrap_or_default()).collect()
}

/// The `p` quantile (0..=1, nearest rank) of `v`, which must not be empty.
pub fn quantile(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn read(kind: Kind, root: &Path, expect: &Expect, stop: &AtomicBool, period: &AtomicUsize, ok: &AtomicU64) -> Reader {
    let mut r =
        Reader { kind, ops: 0, failures: 0, failure_messages: Vec::new(), complete_listings: 0, stalls: Vec::new() };
    let count = match kind {
        Kind::Stat => expect.nodes.len(),
        Kind::Open => expect.open.len(),
        Kind::Readdir => expect.dirs.len(),
        Kind::Readlink => expect.links.len(),
    };
    assert!(count > 0, "the plan has nothing for the {kind:?} reader");
    let mut last_ok = Instant::now();
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let result = once(kind, root, expect, i % count);
        i += 1;
        r.ops += 1;
        let now = Instant::now();
        let p = period.load(Ordering::SeqCst);
        match result {
            Ok(()) => {
                if r.stalls.len() <= p {
                    r.stalls.resize(p + 1, Duration::ZERO);
                }
                r.stalls[p] = r.stalls[p].max(now - last_ok);
                last_ok = now;
                if kind == Kind::Readdir {
                    r.complete_listings += 1;
                }
                ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                r.failures += 1;
                if r.failure_messages.len() < KEPT_FAILURES {
                    r.failure_messages.push(format!("period {p}: {e}"));
                }
            }
        }
    }
    r
}

/// One operation of `kind` on its `i`-th name, checked against the plan.
fn once(kind: Kind, root: &Path, expect: &Expect, i: usize) -> Result<(), String> {
    let at = |p: &str| -> PathBuf { root.join(p) };
    match kind {
        Kind::Stat => {
            let (path, rdev) = &expect.nodes[i];
            let m = fs::symlink_metadata(at(path)).map_err(|e| format!("stat {path}: {e}"))?;
            let got = m.file_type().is_char_device().then(|| (libc::major(m.rdev()), libc::minor(m.rdev())));
            if got != *rdev {
                return Err(format!("stat {path}: device {got:?}, the plan says {rdev:?}"));
            }
        }
        Kind::Open => {
            let path = &expect.open[i];
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(at(path))
                .map_err(|e| format!("open {path}: {e}"))?;
        }
        Kind::Readdir => {
            let (dir, want) = &expect.dirs[i];
            let names = fs::read_dir(at(dir))
                .and_then(|entries| entries.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect())
                .map_err(|e| format!("readdir {dir:?}: {e}"))?;
            let got: BTreeSet<String> = names;
            if got != *want {
                let missing: Vec<_> = want.difference(&got).collect();
                let extra: Vec<_> = got.difference(want).collect();
                return Err(format!("readdir {dir:?}: missing {missing:?}, extra {extra:?}"));
            }
        }
        Kind::Readlink => {
            let (path, target) = &expect.links[i];
            let got = fs::read_link(at(path)).map_err(|e| format!("readlink {path}: {e}"))?;
            if got != Path::new(target) {
                return Err(format!("readlink {path}: {}, the plan says {target}", got.display()));
            }
        }
    }
    Ok(())
}
