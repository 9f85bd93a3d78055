//! `cargo bench --bench devfs`: the devremap devfs against the kernel's tmpfs holding the same
//! nodes, and against a bare `fuser` filesystem (the floor any FUSE filesystem pays), all in
//! one process, in alternating rounds so the machine's drift cancels out. Prints a table for
//! people and, last, one JSON line. Needs root and `/dev/fuse`; skips with a reason otherwise.
//!
//! Every number is a median over rounds; a ratio is the median of the per-round ratios of two
//! targets measured back to back.

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, Generation, INodeNo, MountOption, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEntry, Request, SessionACL,
};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime};

// The readers of tests/handover.rs: the same load, measured here.
#[path = "../tests/common/readers.rs"]
mod readers;

const BIN: &str = env!("CARGO_BIN_EXE_devremapd");
const ROUNDS: usize = 7;
const SLICE: Duration = Duration::from_millis(150);
const TTL: Duration = Duration::from_secs(86400);
/// Real, harmless devices standing for host GPUs.
const FAKE: &[(u32, u32)] = &[(1, 3), (1, 5), (1, 7), (1, 8), (1, 9)];

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() {
        println!("devfs benchmark skipped: it mounts FUSE and tmpfs and needs root and /dev/fuse");
        return;
    }
    // 0700: devremapd mount refuses a mountpoint that users other than root can reach.
    let work =
        tempfile::Builder::new().permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700)).tempdir().unwrap();
    let w = work.path();
    let host = Host::new(w, 8);
    let plan = host.plan();
    let start_ms = start_to_ready(&host, w);

    let devfs = Daemon::start(&host, &w.join("devfs"), &[]);
    let (rss_mount, pss_mount) = (devfs.rss_kib(), devfs.pss_kib());
    let devfs0 = Daemon::start(&host, &w.join("devfs0"), &["--ttl", "0"]);
    let tmpfs = Tmpfs::new(&w.join("tmpfs"), &plan);
    let bare = Bare::mount(&w.join("bare"), &plan, TTL);
    let bare0 = Bare::mount(&w.join("bare0"), &plan, Duration::ZERO);

    let nodes = names(&plan, |_| true);
    let devices = names(&plan, |n| n["type"] == "char" && n["path"] != "tty" && n["path"] != "console");
    let missing: Vec<String> = (0..16).map(|i| format!("nvidia{}", 200 + i)).collect();
    let ops: [(&str, Op, &Vec<String>); 4] = [
        ("stat", Op::Stat, &nodes),
        ("open", Op::Open, &devices),
        ("readdir", Op::Readdir, &nodes),
        ("negative", Op::Stat, &missing),
    ];
    let targets: [(&str, &Path); 3] = [("devfs", &devfs.mountpoint), ("tmpfs", &tmpfs.path), ("bare", &bare.path)];

    println!(
        "devfs benchmark: {} nodes, 8 remapped GPUs, {ROUNDS} rounds of {SLICE:?} per cell, median ops/s",
        nodes.len()
    );
    println!(
        "{:<10} {:>3}  {:>12} {:>12} {:>12}  {:>10} {:>10}",
        "op", "thr", "devfs", "tmpfs", "bare", "vs tmpfs", "vs bare"
    );
    let mut summary = serde_json::Map::new();
    for (name, op, set) in ops {
        for threads in [1, 2] {
            let mut rates: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
            for round in 0..ROUNDS {
                // Alternate which target goes first.
                for k in 0..targets.len() {
                    let t = (k + round) % targets.len();
                    rates[t].push(measure(targets[t].1, op, set, threads, SLICE));
                }
            }
            let ratio = |a: usize, b: usize| median((0..ROUNDS).map(|r| rates[a][r] / rates[b][r]).collect());
            let (vs_tmpfs, vs_bare) = (ratio(0, 1), ratio(0, 2));
            println!(
                "{name:<10} {threads:>3}  {:>12.0} {:>12.0} {:>12.0}  {vs_tmpfs:>10.2} {vs_bare:>10.2}",
                median(rates[0].clone()),
                median(rates[1].clone()),
                median(rates[2].clone())
            );
            let suffix = if threads == 1 { "" } else { "_2t" };
            summary.insert(format!("{name}_ratio{suffix}"), round2(vs_tmpfs));
            summary.insert(format!("{name}_vs_bare{suffix}"), round2(vs_bare));
        }
    }

    // Uncached: every lookup reaches the daemon.
    let mut uncached = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let order: [&Path; 3] = [&devfs0.mountpoint, &bare0.path, &devfs.mountpoint];
        for k in 0..3 {
            let t = (k + round) % 3;
            let r = measure(order[t], Op::Stat, &nodes, 1, SLICE);
            [&mut uncached.0, &mut uncached.1, &mut uncached.2][t].push(r);
        }
    }
    let uncached_us = 1e6 / median(uncached.0.clone());
    let bare_us = 1e6 / median(uncached.1.clone());
    let vs_cached = median((0..ROUNDS).map(|r| uncached.0[r] / uncached.2[r]).collect());
    println!(
        "uncached stat (--ttl 0): {uncached_us:.1} us, bare fuser {bare_us:.1} us ({:.2}x), {vs_cached:.3} of the cached devfs",
        uncached_us / bare_us
    );
    println!(
        "  (the relay's cost: every uncached request goes kernel -> keeper -> server and back, so it is in these figures; cached requests never leave the kernel)"
    );
    summary.insert("uncached_stat_us".into(), round2(uncached_us));
    summary.insert("uncached_vs_bare".into(), round2(uncached_us / bare_us));
    summary.insert("uncached_vs_cached".into(), json!((vs_cached * 1000.0).round() / 1000.0));

    // Memory after 1,000,000 requests answered by the daemon (uncached stats).
    let before = devfs0.rss_kib();
    let served = drive(&devfs0.mountpoint, &nodes, 1_000_000);
    let rss_after = devfs0.rss_kib().max(devfs.rss_kib());
    println!(
        "resident memory: {rss_mount} KiB after mount; {before} -> {} KiB (--ttl 0 daemon) after {served} stats",
        devfs0.rss_kib()
    );
    summary.insert("rss_kib".into(), rss_after.into());
    summary.insert("rss_mount_kib".into(), rss_mount.into());
    // The daemon's own share of memory, keeper and server together: most of each process's
    // resident set is the same binary's pages and libc, which the two share.
    let pss_after = devfs0.pss_kib();
    println!(
        "proportional memory, keeper and server together: {pss_mount} KiB after mount; {pss_after} KiB (--ttl 0 daemon) after the stats"
    );
    summary.insert("daemon_pss_kib".into(), pss_after.max(pss_mount).into());
    drop(devfs0);
    drop(devfs);

    let (stalls, failed) = handover_stalls(&host, &w.join("handover"), 20);
    let ms = |p: f64| readers::quantile(&stalls, p).as_secs_f64() * 1e3;
    let (stall_p50, stall_p99, stall_max) = (ms(0.5), ms(0.99), ms(1.0));
    println!(
        "handover: 20 SIGKILLs of the server under 4 readers (--ttl 0 stat, open, readdir, readlink): longest stall per kill p50 {stall_p50:.1} ms, p99 {stall_p99:.1} ms, max {stall_max:.1} ms; {failed} failed operations"
    );
    summary.insert("handover_stall_p50_ms".into(), round2(stall_p50));
    summary.insert("handover_stall_p99_ms".into(), round2(stall_p99));
    summary.insert("handover_stall_max_ms".into(), round2(stall_max));
    summary.insert("handover_failed_ops".into(), failed.into());

    let (p50, p99) = reload_latency(&host, &w.join("reload8"), 200);
    println!(
        "reload, 8 GPUs: SIGHUP to the new rdev, p50 {p50:.3} ms, p99 {p99:.3} ms (200 reloads, 9 names change each)"
    );
    let host248 = Host::new(&w.join("h248"), 248);
    let (p50_248, p99_248) = reload_latency(&host248, &w.join("reload248"), 200);
    println!("reload, 248 GPUs: p50 {p50_248:.3} ms, p99 {p99_248:.3} ms (200 reloads, 248 names change each)");
    println!("start to ready: {start_ms:.2} ms (median of 11 starts)");
    summary.insert("reload_p50_ms".into(), round3(p50));
    summary.insert("reload_p99_ms".into(), round3(p99));
    summary.insert("reload_p50_ms_248".into(), round3(p50_248));
    summary.insert("reload_p99_ms_248".into(), round3(p99_248));
    summary.insert("start_to_ready_ms".into(), round2(start_ms));
    drop(bare);
    drop(bare0);
    drop(tmpfs);
    println!("{}", Value::Object(summary));
}

fn round2(x: f64) -> Value {
    json!((x * 100.0).round() / 100.0)
}

fn round3(x: f64) -> Value {
    json!((x * 1000.0).round() / 1000.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Top-level names of plan nodes matching `keep`.
fn names(plan: &Value, keep: impl Fn(&Value) -> bool) -> Vec<String> {
    plan["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| !n["path"].as_str().unwrap().contains('/') && keep(n))
        .map(|n| n["path"].as_str().unwrap().to_owned())
        .collect()
}

/// A fake restore host: GPUs `0..=n` under `dev/` (capped at 247) and metadata saving
/// GPUs that pair with them, so that removing host GPU 0 shifts every checkpoint name.
struct Host {
    dir: PathBuf,
    /// Flags beyond the inputs: with every name taken by a host GPU, checkpoint names only
    /// show when they win collisions.
    extra: Vec<String>,
    /// The saved minor whose checkpoint name the reload benchmark watches.
    probe: u32,
}

impl Host {
    /// `n` GPUs in the tree: with a few, saved minors 100.. (every name remapped); with many,
    /// host GPUs 0..=247 and saved 0..=246, so a reload changes every name.
    fn new(dir: &Path, n: u32) -> Host {
        fs::create_dir_all(dir.join("dev")).unwrap();
        fs::create_dir_all(dir.join("root")).unwrap();
        let (host, saved): (Vec<u32>, Vec<u32>) = if n <= 100 {
            ((0..=n).collect(), (100..100 + n).collect())
        } else {
            ((0..n).collect(), (0..n - 1).collect())
        };
        let extra = if n <= 100 { vec![] } else { vec!["--prefer".into(), "checkpoint".into()] };
        let h = Host { dir: dir.to_owned(), extra, probe: *saved.last().unwrap() };
        for m in host {
            h.gpu(m, true);
        }
        let saved: Vec<Value> = saved.iter().map(|m| json!({"minor": m})).collect();
        fs::write(dir.join("meta.json"), Value::from(saved).to_string()).unwrap();
        h
    }

    fn gpu(&self, minor: u32, present: bool) {
        let p = self.dir.join("dev").join(format!("nvidia{minor}"));
        if present {
            let (ma, mi) = FAKE[minor as usize % FAKE.len()];
            let rc = unsafe { libc::mknod(cpath(&p).as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(ma, mi)) };
            assert_eq!(rc, 0, "mknod {}", p.display());
        } else {
            fs::remove_file(p).unwrap();
        }
    }

    fn args(&self) -> Vec<String> {
        let d = |s: &str| self.dir.join(s).to_str().unwrap().to_owned();
        let mut args =
            vec!["--metadata".into(), d("meta.json"), "--host-dev".into(), d("dev"), "--host-root".into(), d("root")];
        args.extend(self.extra.iter().cloned());
        args
    }

    fn plan(&self) -> Value {
        let out = Command::new(BIN).arg("plan").arg("--json").args(self.args()).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

struct Daemon {
    child: Child,
    mountpoint: PathBuf,
    state: PathBuf,
}

impl Daemon {
    fn spawn(host: &Host, mountpoint: &Path, extra: &[&str]) -> Daemon {
        fs::create_dir_all(mountpoint).unwrap();
        let state = mountpoint.with_extension("state.json");
        let _ = fs::remove_file(&state);
        let child = Command::new(BIN)
            .arg("mount")
            .arg(mountpoint)
            .arg("--state-file")
            .arg(&state)
            .args(host.args())
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Daemon { child, mountpoint: mountpoint.to_owned(), state }
    }

    fn start(host: &Host, mountpoint: &Path, extra: &[&str]) -> Daemon {
        let d = Daemon::spawn(host, mountpoint, extra);
        d.wait_ready();
        d
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.state.exists() {
            assert!(Instant::now() < deadline, "devremapd did not become ready");
            std::thread::yield_now();
        }
    }

    fn state(&self) -> Value {
        serde_json::from_str(&fs::read_to_string(&self.state).unwrap()).unwrap()
    }

    fn generation(&self) -> u64 {
        self.state()["generation"].as_u64().unwrap()
    }

    /// The process that answers the kernel; `child` is the keeper, which holds `/dev/fuse`.
    fn server_pid(&self) -> u32 {
        self.state()["server_pid"].as_u64().expect("the state file names the server") as u32
    }

    /// Servers replaced since the mount.
    fn handovers(&self) -> u64 {
        self.state()["handovers"].as_u64().expect("the state file counts handovers")
    }

    /// The proportional set size (`Pss`) of the keeper (our child) and the server together.
    fn pss_kib(&self) -> u64 {
        [self.child.id(), self.server_pid()]
            .iter()
            .map(|pid| {
                let rollup = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
                rollup
                    .lines()
                    .find_map(|l| l.strip_prefix("Pss:"))
                    .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
                    .unwrap()
            })
            .sum()
    }

    /// The server's resident memory: it holds the tree; the keeper parses nothing.
    fn rss_kib(&self) -> u64 {
        let status = fs::read_to_string(format!("/proc/{}/status", self.server_pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        unsafe { libc::umount2(cpath(&self.mountpoint).as_ptr(), libc::MNT_DETACH) };
    }
}

/// A tmpfs holding the same nodes as the plan, made by mknod.
struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    fn new(path: &Path, plan: &Value) -> Tmpfs {
        fs::create_dir_all(path).unwrap();
        let src = CString::new("tmpfs").unwrap();
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                cpath(path).as_ptr(),
                src.as_ptr(),
                libc::MS_NOSUID | libc::MS_NOEXEC,
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "mount tmpfs: {}", std::io::Error::last_os_error());
        for n in plan["nodes"].as_array().unwrap() {
            let p = path.join(n["path"].as_str().unwrap());
            match n["type"].as_str().unwrap() {
                "dir" => fs::create_dir_all(&p).unwrap(),
                "symlink" => std::os::unix::fs::symlink(n["target"].as_str().unwrap(), &p).unwrap(),
                _ => {
                    let dev = libc::makedev(n["major"].as_u64().unwrap() as u32, n["minor"].as_u64().unwrap() as u32);
                    let rc = unsafe {
                        libc::mknod(cpath(&p).as_ptr(), libc::S_IFCHR | n["mode"].as_u64().unwrap() as u32, dev)
                    };
                    assert_eq!(rc, 0);
                }
            }
        }
        Tmpfs { path: path.to_owned() }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        unsafe { libc::umount2(cpath(&self.path).as_ptr(), libc::MNT_DETACH) };
    }
}

/// The floor: a minimal fuser filesystem serving the same top-level nodes, answering lookup,
/// getattr, readlink and readdir from a map, with nothing else.
struct BareFs {
    ttl: Duration,
    attrs: Vec<FileAttr>,
    by_name: HashMap<Vec<u8>, usize>,
    names: Vec<String>,
    targets: Vec<String>,
}

impl BareFs {
    fn new(plan: &Value, ttl: Duration) -> BareFs {
        let now = SystemTime::now();
        let attr = |ino: u64, kind: FileType, perm: u16, rdev: u32, size: u64| FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev,
            blksize: 4096,
            flags: 0,
        };
        let mut fs = BareFs {
            ttl,
            attrs: vec![attr(1, FileType::Directory, 0o755, 0, 0)],
            by_name: HashMap::new(),
            names: vec![String::new()],
            targets: vec![String::new()],
        };
        for n in plan["nodes"].as_array().unwrap() {
            let path = n["path"].as_str().unwrap();
            if path.contains('/') {
                continue;
            }
            let ino = fs.attrs.len() as u64 + 1;
            let target = n["target"].as_str().unwrap_or("").to_owned();
            let a = match n["type"].as_str().unwrap() {
                "dir" => attr(ino, FileType::Directory, 0o755, 0, 0),
                "symlink" => attr(ino, FileType::Symlink, 0o777, 0, target.len() as u64),
                _ => {
                    let (ma, mi) = (n["major"].as_u64().unwrap() as u32, n["minor"].as_u64().unwrap() as u32);
                    attr(
                        ino,
                        FileType::CharDevice,
                        n["mode"].as_u64().unwrap() as u16,
                        (mi & 0xff) | (ma << 8) | ((mi & !0xff) << 12),
                        0,
                    )
                }
            };
            fs.by_name.insert(path.as_bytes().to_vec(), fs.attrs.len());
            fs.attrs.push(a);
            fs.names.push(path.to_owned());
            fs.targets.push(target);
        }
        fs
    }
}

impl Filesystem for BareFs {
    fn lookup(&self, _r: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.by_name.get(name.as_bytes()) {
            Some(&i) if parent.0 == 1 => reply.entry(&self.ttl, &self.attrs[i], Generation(0)),
            _ => reply.error(Errno::ENOENT),
        }
    }
    fn getattr(&self, _r: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attrs.get(ino.0 as usize - 1) {
            Some(a) => reply.attr(&self.ttl, a),
            None => reply.error(Errno::ENOENT),
        }
    }
    fn readlink(&self, _r: &Request, ino: INodeNo, reply: ReplyData) {
        reply.data(self.targets[ino.0 as usize - 1].as_bytes());
    }
    fn readdir(&self, _r: &Request, _ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        for i in offset as usize..self.attrs.len() {
            let name = if i == 0 { "." } else { self.names[i].as_str() };
            if reply.add(self.attrs[i].ino, i as u64 + 1, self.attrs[i].kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

struct Bare {
    path: PathBuf,
    session: Option<fuser::BackgroundSession>,
}

impl Bare {
    fn mount(path: &Path, plan: &Value, ttl: Duration) -> Bare {
        fs::create_dir_all(path).unwrap();
        let mut config = fuser::Config::default();
        config.mount_options =
            vec![MountOption::FSName("bare".into()), MountOption::Dev, MountOption::DefaultPermissions];
        config.acl = SessionACL::All;
        config.n_threads = Some(2);
        let session = fuser::spawn_mount(BareFs::new(plan, ttl), path, &config).unwrap();
        Bare { path: path.to_owned(), session: Some(session) }
    }
}

impl Drop for Bare {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}

#[derive(Clone, Copy)]
enum Op {
    Stat,
    Open,
    Readdir,
}

fn do_op(op: Op, dir: &CString, path: &CString) -> bool {
    unsafe {
        match op {
            Op::Stat => {
                let mut st: libc::stat = std::mem::zeroed();
                libc::lstat(path.as_ptr(), &mut st) == 0
            }
            Op::Open => {
                let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC);
                fd >= 0 && libc::close(fd) == 0
            }
            Op::Readdir => {
                let d = libc::opendir(dir.as_ptr());
                if d.is_null() {
                    return false;
                }
                while !libc::readdir(d).is_null() {}
                libc::closedir(d) == 0
            }
        }
    }
}

/// Ops per second of `op` on `set` under `root`, on `threads` threads, for `slice`.
fn measure(root: &Path, op: Op, set: &[String], threads: usize, slice: Duration) -> f64 {
    let paths: Arc<Vec<CString>> = Arc::new(set.iter().map(|n| cpath(&root.join(n))).collect());
    let dir = Arc::new(cpath(root));
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let go = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (paths, dir, stop, count, go) = (paths.clone(), dir.clone(), stop.clone(), count.clone(), go.clone());
            std::thread::spawn(move || {
                let mut i = t * 7919;
                let mut n = 0u64;
                go.wait();
                while !stop.load(Ordering::Relaxed) {
                    // A cheap pseudo-random walk over the set.
                    i = i.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    let p = &paths[(i >> 8) % paths.len()];
                    let ok = do_op(op, &dir, p);
                    assert!(ok || matches!(op, Op::Stat), "op failed on {p:?}: {}", std::io::Error::last_os_error());
                    n += 1;
                }
                count.fetch_add(n, Ordering::Relaxed);
            })
        })
        .collect();
    go.wait();
    let t0 = Instant::now();
    std::thread::sleep(slice);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    count.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64()
}

/// Runs `total` stats on two threads; returns how many ran.
fn drive(root: &Path, set: &[String], total: u64) -> u64 {
    let paths: Arc<Vec<CString>> = Arc::new(set.iter().map(|n| cpath(&root.join(n))).collect());
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let paths = paths.clone();
            std::thread::spawn(move || {
                for k in 0..total / 2 {
                    do_op(Op::Stat, &CString::default(), &paths[(k as usize + t) % paths.len()]);
                }
                total / 2
            })
        })
        .collect();
    workers.into_iter().map(|w| w.join().unwrap()).sum()
}

/// Median milliseconds from spawning `devremapd mount` to its state file being written.
fn start_to_ready(host: &Host, w: &Path) -> f64 {
    let times: Vec<f64> = (0..11)
        .map(|i| {
            let t0 = Instant::now();
            let d = Daemon::spawn(host, &w.join(format!("start{i}")), &[]);
            d.wait_ready();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    median(times)
}

/// p50 and p99 milliseconds from SIGHUP to the first stat of a checkpoint name that shows the
/// new rdev, over `n` reloads that flip the pairing (host GPU 0 removed and restored).
fn reload_latency(host: &Host, mountpoint: &Path, n: usize) -> (f64, f64) {
    let d = Daemon::start(host, mountpoint, &[]);
    let probe = cpath(&mountpoint.join(format!("nvidia{}", host.probe)));
    let rdev = || unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::lstat(probe.as_ptr(), &mut st), 0);
        st.st_rdev
    };
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let before = rdev();
        let generation = d.generation();
        host.gpu(0, i % 2 == 1);
        let t0 = Instant::now();
        unsafe { libc::kill(d.child.id() as i32, libc::SIGHUP) };
        // Yield between probes: a prober that spins without yielding measures the
        // scheduler's time slice (it may share a vCPU with the daemon), not the reload.
        while rdev() == before {
            assert!(t0.elapsed() < Duration::from_secs(10), "reload {i} never showed");
            std::thread::yield_now();
        }
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        // Let the daemon finish (state file) before the next round.
        while d.generation() == generation {
            std::thread::yield_now();
        }
    }
    if n % 2 == 1 {
        host.gpu(0, true);
    }
    (median(times.clone()), percentile(times, 0.99))
}

/// Kills the server of a `--ttl 0` daemon `kills` times (each time after the new one has
/// answered every reader) while the four readers of tests/handover.rs run. Returns the longest
/// stall any reader saw after each kill, and how many operations failed (which must be none).
fn handover_stalls(host: &Host, mountpoint: &Path, kills: usize) -> (Vec<Duration>, u64) {
    let d = Daemon::start(host, mountpoint, &["--ttl", "0"]);
    let load = readers::Load::start(mountpoint, &readers::Expect::from_plan(&d.state()));
    let until = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(Instant::now() < deadline, "handover benchmark: timed out waiting for {what}");
            std::thread::sleep(Duration::from_micros(200));
        }
    };
    until("the readers", &|| load.advanced([0; 4], 20));
    for _ in 0..kills {
        let (old, count) = (d.server_pid(), d.handovers());
        load.next_period();
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        // The state file is replaced atomically, so it always reads whole.
        until("a new server", &|| d.server_pid() != old && d.handovers() == count + 1);
        let ready = load.ok_counts();
        until("every reader to be served", &|| load.advanced(ready, 20));
    }
    let done = load.finish();
    for r in &done {
        println!(
            "  {:?} reader: {} ops, {} failed {:?}, longest gap between successes {:.1} ms",
            r.kind,
            r.ops,
            r.failures,
            r.failure_messages,
            r.longest_stall().as_secs_f64() * 1e3
        );
    }
    (readers::stall_per_period(&done), done.iter().map(|r| r.failures).sum())
}
