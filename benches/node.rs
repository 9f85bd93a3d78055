//! `cargo bench --bench node`: the node daemon (`devremapd node`, issue 31) with many
//! containers, measured from outside it. No runtime: each container is mounted as
//! `devremap-runtime` asks for it (its directory made and locked, then the node protocol's
//! `mount` with the container's spec, the host and the checkpoint's metadata), and its "init"
//! is this process, whose pid is written to the container's pid file once the mount answers,
//! as `runc create` would; each one's keeper ends with this process at the latest.
//!
//! - Reload: from the reload's trigger to the first `stat` through the container's mountpoint
//!   that shows the new device number, 200 reloads each (a host GPU's device number flips, so
//!   two names change), with 1 and with 100 containers mounted, triggered two ways: `SIGHUP`
//!   to the container's keeper, and the node protocol's `reload` of its id (what `devremapd
//!   ctl reload ID` sends; sent by a thread already waiting, so no process start is counted).
//!   The whole `devremapd ctl reload ID` command is timed too (its exec and its wait for the
//!   state file included).
//! - Scale: with 1, 10, 100 and 200 containers mounted: the median start of one more container
//!   (the request until its `/dev` answers, then its unmount, 41 times), the proportional set
//!   size (`Pss` of `/proc/PID/smaps_rollup`) and the threads of the node daemon and of every
//!   process under it (each container's keeper and server), and how they grow per container.
//!   With 1 container, also the median start of one more after the node daemon was idle for
//!   100 ms (`isolated_start_ms`), 41 times. Every server is kept (`--rest-after 0`): what a
//!   container costs while its `/dev` is in use.
//! - At rest: a second node daemon, `--rest-after 1`, with 1 and then 200 containers mounted,
//!   once every container's state file says `resting` (its server ended; its keeper alone
//!   holds the mount): the same PSS and threads, and how they grow per container. Then the
//!   wake: a `stat` of a name the kernel has not cached, in a resting container (a server
//!   starts, takes over and answers), timed from outside, 41 containers.
//!
//! Prints a table and, last, one JSON line. Needs root and `/dev/fuse`; skips otherwise.

#[path = "common/node.rs"]
mod node;

use devremap::node::client::ask;
use devremap::node::protocol::{MountRequest, Request};
use devremap::runtime::container_daemon::Container;
use node::{ASK, NodeDaemon};
use serde_json::{Value, json};
use std::ffi::CString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DEVREMAPD: &str = env!("CARGO_BIN_EXE_devremapd");
const RELOADS: usize = 200;
/// Starts measured at each scale: 41, not the 11 of the first runs, whose medians moved from
/// x0.8 to x1.6 between 1 and 200 containers from one run to the next (docs/performance.md).
const STARTS: usize = 41;
/// How long the node daemon is left idle before an isolated start.
const IDLE: Duration = Duration::from_millis(100);
const SCALE: [usize; 4] = [1, 10, 100, 200];
/// The pause before the memory and threads at each scale are read: three of the pid file's
/// polls.
const SETTLE: Duration = Duration::from_millis(300);
/// The number of containers mounted for the second reload measurement.
const MANY: usize = 100;
/// Between two probes of a reload's device number.
const PROBE_PAUSE: Duration = Duration::from_micros(20);

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() {
        println!("node benchmark skipped: it mounts FUSE and needs root and /dev/fuse");
        return;
    }
    let work =
        tempfile::Builder::new().permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700)).tempdir().unwrap();
    let state_dir = StateDir::new();
    let host = Host::new(work.path());
    let node =
        NodeDaemon::start_with(DEVREMAPD, state_dir.0.path(), &work.path().join("node.log"), &["--rest-after", "0"]);
    let mut summary = serde_json::Map::new();
    let mut mounted = 0;
    let mut scale = Vec::new();
    println!("node daemon benchmark: containers of 2 remapped GPUs each (18 nodes), medians");
    for n in SCALE {
        while mounted < n {
            mount(&node, &host, &format!("c{mounted}"));
            mounted += 1;
        }
        if n == 1 || n == MANY {
            reloads(&node, &host, n, &mut summary);
        }
        if n == 1 {
            let isolated = median((0..STARTS).map(|k| isolated_start(&node, &host, k)).collect());
            println!("{n:4} containers: one more starts in {isolated:.2} ms after the node was idle for {IDLE:?}");
            summary.insert("isolated_start_ms".into(), round(isolated, 2));
        }
        // What a container keeps, not what its start still holds: a keeper reads its
        // container's pid file every 100 ms on a thread that ends once the file names the
        // process, which the containers mounted last may not have yet.
        std::thread::sleep(SETTLE);
        let (memory, starts) = (Memory::of(node.pid()), (0..STARTS).map(|k| start_one(&node, &host, k)).collect());
        let start_ms = median(starts);
        println!("{n:4} containers: one more starts in {start_ms:.2} ms; {}", memory.describe(n));
        scale.push(json!({
            "containers": n,
            "start_ms": round(start_ms, 2),
            "pss_kib": memory.pss_kib,
            "pss_kib_per_container": round(memory.pss_kib as f64 / n as f64, 0),
            "node_pss_kib": memory.node_pss_kib,
            "processes": memory.processes,
            "threads": memory.threads,
            "node_threads": memory.node_threads,
        }));
    }
    let (first, last) = (&scale[0], &scale[scale.len() - 1]);
    let containers = (last["containers"].as_u64().unwrap() - first["containers"].as_u64().unwrap()) as f64;
    let growth = |k: &str| (last[k].as_u64().unwrap() as f64 - first[k].as_u64().unwrap() as f64) / containers;
    let flat = |k: &str| last[k].as_f64().unwrap() / first[k].as_f64().unwrap();
    summary.insert("pss_growth_kib_per_container".into(), round(growth("pss_kib"), 0));
    summary.insert("node_pss_growth_kib_per_container".into(), round(growth("node_pss_kib"), 1));
    summary.insert("threads_growth_per_container".into(), round(growth("threads"), 2));
    summary.insert("node_threads_growth_per_container".into(), round(growth("node_threads"), 2));
    summary.insert("start_ratio_200_to_1".into(), round(flat("start_ms"), 2));
    summary.insert("scale".into(), Value::Array(scale));
    println!(
        "per container from 1 to 200: PSS {} KiB (target 300 or less), threads {} (target: flat, or 1), start time x{} (target within 1.10)",
        summary["pss_growth_kib_per_container"],
        summary["threads_growth_per_container"],
        summary["start_ratio_200_to_1"]
    );
    for k in 0..mounted {
        unmount(&node, &format!("c{k}"));
    }
    node.assert_torn_down();
    drop(node);
    at_rest(&work.path().join("rest"), &mut summary);
    println!("{}", Value::Object(summary));
}

/// Containers whose servers rested (`--rest-after 1`): what they keep, and a wake's time.
fn at_rest(work: &Path, summary: &mut serde_json::Map<String, Value>) {
    fs::create_dir(work).unwrap();
    let state_dir = StateDir::new();
    let host = Host::new(work);
    let node = NodeDaemon::start_with(DEVREMAPD, state_dir.0.path(), &work.join("node.log"), &["--rest-after", "1"]);
    let (mut mounted, mut rows) = (0, Vec::new());
    for n in [1, SCALE[SCALE.len() - 1]] {
        while mounted < n {
            mount(&node, &host, &format!("c{mounted}"));
            mounted += 1;
        }
        all_rest(&node, mounted);
        std::thread::sleep(SETTLE);
        let memory = Memory::of(node.pid());
        println!("{n:4} containers at rest: {}", memory.describe(n));
        rows.push((n, memory));
    }
    let ((n1, first), (n2, last)) = (&rows[0], &rows[1]);
    let per = |a: u64, b: u64| (b as f64 - a as f64) / (*n2 - *n1) as f64;
    let wakes: Vec<f64> = (0..STARTS)
        .map(|k| {
            let name = Container::new(&node.state_dir, &format!("c{k}")).dev().join(format!("never-looked-up-{k}"));
            let t0 = Instant::now();
            assert!(fs::symlink_metadata(&name).is_err(), "{} exists", name.display());
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let wake = median(wakes);
    println!(
        "per container at rest from 1 to {n2}: PSS {:.0} KiB, threads {:.2}; a resting container answers a name not cached in {wake:.2} ms (a server wakes)",
        per(first.pss_kib, last.pss_kib),
        per(first.threads, last.threads)
    );
    summary.insert("rest_pss_growth_kib_per_container".into(), round(per(first.pss_kib, last.pss_kib), 0));
    summary.insert("rest_threads_growth_per_container".into(), round(per(first.threads, last.threads), 2));
    summary.insert("wake_ms".into(), round(wake, 2));
    for k in 0..mounted {
        unmount(&node, &format!("c{k}"));
    }
    node.assert_torn_down();
}

/// Waits until the first `n` containers' state files say they rest.
fn all_rest(node: &NodeDaemon, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let resting = |k: usize| {
        let state = fs::read(Container::new(&node.state_dir, &format!("c{k}")).state_file()).unwrap_or_default();
        serde_json::from_slice::<Value>(&state).is_ok_and(|s| s["resting"] == true)
    };
    while !(0..n).all(resting) {
        assert!(Instant::now() < deadline, "the containers' servers did not all rest within 120 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A fake host: GPUs `nvidia0` and `nvidia1` (real char devices), a spec giving the container
/// both, and a checkpoint that saved 100 and 101, so each container serves `nvidia100` as the
/// host's `nvidia0` and `nvidia101` as `nvidia1`.
/// The state dir on a tmpfs of its own, as `/run/devremap` is on a host (`/run` is a tmpfs
/// under systemd; in a container it may be the root's file system): each container's log is
/// a file there, which its keeper and server write from the thread that logs only on tmpfs.
/// Unmounted (lazily) once the node daemon, dropped first, has gone.
struct StateDir(tempfile::TempDir);

impl StateDir {
    fn new() -> StateDir {
        let dir = tempfile::Builder::new().prefix("devremap-node-bench-").tempdir_in("/run").unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "mode=0700", "devremap-node-bench"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount -t tmpfs {}", dir.path().display());
        StateDir(dir)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

struct Host {
    dir: PathBuf,
}

impl Host {
    fn new(dir: &Path) -> Host {
        let h = Host { dir: dir.to_owned() };
        fs::create_dir_all(h.dev()).unwrap();
        fs::create_dir_all(dir.join("root")).unwrap();
        h.gpu(0, 3);
        h.gpu(1, 4);
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config.json");
        let mut spec: Value = serde_json::from_slice(&fs::read(example).unwrap()).unwrap();
        let devices = spec["linux"]["devices"].as_array_mut().unwrap();
        devices.retain(|d| !d["path"].as_str().unwrap().starts_with("/dev/nvidia"));
        for m in [0, 1] {
            devices.push(json!({"path": format!("/dev/nvidia{m}"), "type": "c", "major": 195, "minor": m,
                "fileMode": 438, "uid": 0, "gid": 0}));
        }
        fs::write(dir.join("config.json"), spec.to_string()).unwrap();
        fs::write(dir.join("meta.json"), json!([{"minor": 100}, {"minor": 101}]).to_string()).unwrap();
        h
    }

    fn dev(&self) -> PathBuf {
        self.dir.join("dev")
    }

    /// (Re)makes host GPU `nvidia<m>` as the char device 1:`minor`.
    fn gpu(&self, m: u32, minor: u32) {
        let p = self.dev().join(format!("nvidia{m}"));
        let _ = fs::remove_file(&p);
        let c = cpath(&p);
        // SAFETY: a NUL-terminated path; mknod only makes a node.
        assert_eq!(unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, minor)) }, 0);
    }

    fn request(&self, node: &NodeDaemon, c: &Container, id: &str) -> MountRequest {
        MountRequest {
            id: id.to_owned(),
            state_dir: node.state_dir.clone(),
            spec: self.dir.join("config.json"),
            host_dev: Some(self.dev()),
            host_root: self.dir.join("root"),
            metadata: Some(self.dir.join("meta.json")),
            extra: vec![],
            container_pid_file: c.dir.join("init.pid"),
            owner_pid: std::process::id(),
            until_unmount: false,
        }
    }
}

/// Mounts container `id` as the wrapper does (its directory made and locked, then the node's
/// `mount`), then writes its init's pid file as `runc create` would. The lock is not handed
/// over: the daemon would keep it, on a thread, until its owner (here this process, for a
/// wrapper the runtime, which exits once the container is made) exits.
/// Returns the milliseconds until its `/dev` answered.
fn mount(node: &NodeDaemon, host: &Host, id: &str) -> f64 {
    let c = Container::new(&node.state_dir, id);
    let t0 = Instant::now();
    let lock = c.prepare(None).unwrap();
    c.mark_node().unwrap();
    let request = Request::Mount(host.request(node, &c, id));
    ask(&node.socket, &request, ASK).unwrap_or_else(|e| panic!("mount {id}: {e}"));
    let took = t0.elapsed().as_secs_f64() * 1e3;
    drop(lock);
    let pid_file = c.dir.join("init.pid");
    let tmp = c.dir.join(".init.pid.tmp");
    fs::write(&tmp, format!("{}\n", std::process::id())).unwrap();
    fs::rename(tmp, pid_file).unwrap();
    took
}

fn unmount(node: &NodeDaemon, id: &str) {
    ask(&node.socket, &Request::Unmount { id: id.to_owned() }, ASK).unwrap_or_else(|e| panic!("unmount {id}: {e}"));
}

/// One more container's start after the node daemon was idle for [`IDLE`] (as on most nodes,
/// where containers do not start back to back): what the spare's replacement and anything else
/// left over from the last start cost it is not counted, but neither is the warmth of a start
/// that just ran.
fn isolated_start(node: &NodeDaemon, host: &Host, k: usize) -> f64 {
    std::thread::sleep(IDLE);
    start_one(node, host, STARTS + k)
}

/// One more container's start, and its unmount.
fn start_one(node: &NodeDaemon, host: &Host, k: usize) -> f64 {
    let id = format!("extra{k}");
    let took = mount(node, host, &id);
    unmount(node, &id);
    took
}

/// Reload latencies of container `c0` with `n` containers mounted, into `summary`.
fn reloads(node: &NodeDaemon, host: &Host, n: usize, summary: &mut serde_json::Map<String, Value>) {
    let keeper = node.list().into_iter().find(|(id, ..)| id == "c0").unwrap().1;
    // SAFETY: a signal to the keeper of our own container.
    let sighup = || unsafe {
        libc::kill(keeper as i32, libc::SIGHUP);
    };
    let c = Container::new(&node.state_dir, "c0");
    let (dev, state_file) = (c.dev(), c.state_file());
    let by_signal = reload_latency(&dev, &state_file, host, &sighup, &|| ());
    // The request ctl sends, by a thread that waits for the word: no thread or process start.
    let (go, asked) = mpsc::channel::<()>();
    let (answered, done) = mpsc::channel();
    let socket = node.socket.clone();
    let asker = std::thread::spawn(move || {
        for () in asked {
            let reply = ask(&socket, &Request::Reload { id: Some("c0".into()) }, ASK);
            answered.send(reply.is_ok()).unwrap();
        }
    });
    // Each request's answer is waited for before the next is sent, as `ctl reload` does: the
    // node answers once it sees the reload's state file (polled), which may be after the
    // prober saw it, and a request sent meanwhile would wait for the asker, not the daemon.
    let by_request = reload_latency(&dev, &state_file, host, &|| go.send(()).unwrap(), &|| {
        assert!(done.recv().unwrap(), "a reload request failed");
    });
    drop(go);
    asker.join().unwrap();
    let ctl: Vec<f64> = (0..21)
        .map(|_| {
            let t0 = Instant::now();
            let out = std::process::Command::new(DEVREMAPD)
                .args(["ctl", "--socket", node.socket.to_str().unwrap(), "reload", "c0"])
                .output()
                .unwrap();
            assert!(out.status.success(), "ctl reload: {}", String::from_utf8_lossy(&out.stderr));
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    let ctl_ms = median(ctl);
    for (how, times) in [("sighup", by_signal), ("request", by_request)] {
        let (p50, p99) = (median(times.clone()), percentile(times, 0.99));
        println!(
            "{n:4} containers: reload by {how:7}: new rdev seen after p50 {p50:.3} ms, p99 {p99:.3} ms ({RELOADS} reloads; target p99 < 2 ms)"
        );
        summary.insert(format!("reload_{how}_p50_ms_{n}"), round(p50, 3));
        summary.insert(format!("reload_{how}_p99_ms_{n}"), round(p99, 3));
    }
    println!("{n:4} containers: `devremapd ctl reload c0`, the whole command: {ctl_ms:.2} ms (median of 21)");
    summary.insert(format!("ctl_reload_ms_{n}"), round(ctl_ms, 2));
}

/// Milliseconds from `trigger` to the first stat of `c0`'s `nvidia101` that shows the host
/// GPU's new device number, over [`RELOADS`] reloads, each waited out (its state file's
/// `reloads` moved on, and `answered` returned) before the next.
fn reload_latency(dev: &Path, state_file: &Path, host: &Host, trigger: &dyn Fn(), answered: &dyn Fn()) -> Vec<f64> {
    let probe = cpath(&dev.join("nvidia101"));
    let rdev = || {
        // SAFETY: a NUL-terminated path and a stat buffer of the right type.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            assert_eq!(libc::lstat(probe.as_ptr(), &mut st), 0);
            st.st_rdev
        }
    };
    let reloads = || {
        let state: Value = fs::read(state_file).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        state["reloads"].as_u64()
    };
    let mut times = Vec::with_capacity(RELOADS);
    for i in 0..RELOADS {
        let (before, finished) = (rdev(), reloads());
        host.gpu(1, if i % 2 == 0 { 5 } else { 4 });
        let t0 = Instant::now();
        trigger();
        // Sleep briefly between probes, as a container's process would not spin: the keeper
        // runs in a session of its own (an autogroup of its own where the scheduler has them),
        // and a prober's `sched_yield` yields only within its own group, so a yielding prober
        // keeps the CPU from the daemon it waits for.
        while rdev() == before {
            assert!(t0.elapsed() < Duration::from_secs(10), "reload {i} never showed");
            std::thread::sleep(PROBE_PAUSE);
        }
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        while reloads() <= finished {
            std::thread::yield_now();
        }
        answered();
    }
    host.gpu(1, 4);
    times
}

/// The proportional set size and threads of the node daemon and every process under it.
struct Memory {
    pss_kib: u64,
    node_pss_kib: u64,
    processes: usize,
    threads: u64,
    node_threads: u64,
}

impl Memory {
    fn of(node: u32) -> Memory {
        let all = descendants(node);
        let (pss, threads): (Vec<u64>, Vec<u64>) = all.iter().map(|&p| (pss_kib(p), threads(p))).unzip();
        Memory {
            pss_kib: pss.iter().sum(),
            node_pss_kib: pss[0],
            processes: all.len(),
            threads: threads.iter().sum(),
            node_threads: threads[0],
        }
    }

    /// One line of the table, for `n` containers.
    fn describe(&self, n: usize) -> String {
        format!(
            "PSS {:.1} MiB in all ({:.0} KiB each), node daemon {} KiB; {} processes, {} threads ({} in the node daemon)",
            self.pss_kib as f64 / 1024.0,
            self.pss_kib as f64 / n as f64,
            self.node_pss_kib,
            self.processes,
            self.threads,
            self.node_threads
        )
    }
}

/// `pid` and every process below it, `pid` first.
fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let p: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            // The field after the command, whose name may hold anything up to its last ')'.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(parents.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    found
}

fn proc_field(pid: u32, file: &str, key: &str) -> u64 {
    let text = fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("/proc/{pid}/{file}: no {key}"))
}

fn pss_kib(pid: u32) -> u64 {
    proc_field(pid, "smaps_rollup", "Pss:")
}

fn threads(pid: u32) -> u64 {
    proc_field(pid, "status", "Threads:")
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
}

fn round(x: f64, digits: i32) -> Value {
    let f = 10f64.powi(digits);
    json!((x * f).round() / f)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}
