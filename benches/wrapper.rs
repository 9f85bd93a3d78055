//! `cargo bench --bench wrapper`: container start through `devremap-runtime` against the real
//! runtime alone, in one run, in rotating rounds so the machine's drift cancels out: `runc
//! run` of a busybox `true` bundle, plain, through the wrapper (a devremap `/dev` for a fake
//! two-GPU host, the state dir on tmpfs as the default `/run/devremap` is), and through the
//! wrapper on the same container not asking for devremap (the wrapper reads its config and the
//! spec and execs runc: what any wrapper costs). Prints the medians and, last, one JSON line
//! with `wrapper_run_ratio` and `wrapper_passthrough_ratio` (medians of the per-round ratios to
//! runc alone). The node daemon (`devremapd node`, issue 31) is started on the state dir before
//! the rounds, as `devremap.service` runs it, and stopped after. Needs root, `/dev/fuse`, runc
//! and busybox-static; skips with a reason otherwise.

#[path = "common/node.rs"]
mod node;

use serde_json::json;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

const WRAPPER: &str = env!("CARGO_BIN_EXE_devremap-runtime");
const DEVREMAPD: &str = env!("CARGO_BIN_EXE_devremapd");
/// Rounds measured: at 25, two runs of one build differed by more (1.24 to 1.64) than any
/// change tried; `benches/nri.rs` settled on 61 for the same reason.
const PAIRS: usize = 61;
const WARMUP: usize = 3;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let have = |p: &str| Path::new(p).exists();
    if !root || !have("/dev/fuse") || !have("/bin/busybox") || Command::new("runc").arg("--version").output().is_err() {
        println!("wrapper benchmark skipped: it runs containers and needs root, /dev/fuse, runc and busybox-static");
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    // On tmpfs, as /run/devremap is: the wrapper's files cost what they cost in production.
    let state_dir = tempfile::Builder::new().prefix("devremap-bench-").tempdir_in("/run").unwrap();
    let bundle = w.join("bundle");
    fs::create_dir_all(bundle.join("rootfs/bin")).unwrap();
    fs::copy("/bin/busybox", bundle.join("rootfs/bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", bundle.join("rootfs/bin/true")).unwrap();
    let ok = Command::new("runc").arg("spec").arg("--bundle").arg(&bundle).status().unwrap();
    assert!(ok.success(), "runc spec");
    let config = bundle.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&fs::read(&config).unwrap()).unwrap();
    spec["process"]["terminal"] = json!(false);
    spec["process"]["args"] = json!(["/bin/true"]);
    spec["annotations"] = json!({"devremap.io/enable": "true"});
    fs::write(&config, spec.to_string()).unwrap();
    let dev = w.join("host-dev");
    fs::create_dir_all(&dev).unwrap();
    fs::create_dir_all(w.join("host-root")).unwrap();
    for (name, minor) in [("nvidia0", 3), ("nvidia1", 5)] {
        let path = std::ffi::CString::new(dev.join(name).to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path; mknod only makes a node.
        assert_eq!(unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, minor)) }, 0);
    }
    let wrapper_config = w.join("runtime.json");
    // Already running, as under `devremap.service`: a start asks it, and starts nothing else.
    let node = node::NodeDaemon::start(DEVREMAPD, state_dir.path(), &w.join("node.log"));
    let text = json!({"host_dev": dev, "host_root": w.join("host-root"), "state_dir": state_dir.path(),
        "node_socket": node.socket});
    fs::write(&wrapper_config, text.to_string()).unwrap();
    // The same container not asking for devremap: the wrapper only reads its config and the
    // spec and execs runc. What any wrapper costs, whatever serves /dev (the floor under
    // `wrapper_run_ratio`).
    let passing = w.join("bundle-passing");
    fs::create_dir_all(&passing).unwrap();
    spec["annotations"] = json!({});
    spec["root"]["path"] = json!(bundle.join("rootfs"));
    fs::write(passing.join("config.json"), spec.to_string()).unwrap();
    let runc_root = w.join("runc-root");
    let run = |arm: Arm, id: &str| -> f64 {
        let mut c = if arm == Arm::Runc {
            Command::new("runc")
        } else {
            let mut c = Command::new(WRAPPER);
            c.arg(format!("--devremap-config={}", wrapper_config.display()));
            c
        };
        let bundle = if arm == Arm::Passing { &passing } else { &bundle };
        c.arg("--root").arg(&runc_root).arg("run").arg("--bundle").arg(bundle).arg(id);
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
        let t0 = Instant::now();
        let status = c.status().unwrap();
        let took = t0.elapsed();
        assert!(status.success(), "{arm:?} run {id}: {status}");
        took.as_secs_f64() * 1e3
    };
    let arms = [Arm::Runc, Arm::Wrapped, Arm::Passing];
    let mut ms: [Vec<f64>; 3] = Default::default();
    let (mut ratios, mut passing_ratios) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + PAIRS {
        // Rotate which goes first, so none always runs on a warmer cache.
        let mut took = [0.0; 3];
        for k in 0..arms.len() {
            let a = (i + k) % arms.len();
            took[a] = run(arms[a], &format!("{:?}-{i}", arms[a]).to_lowercase());
        }
        if i >= WARMUP {
            for (v, t) in ms.iter_mut().zip(took) {
                v.push(t);
            }
            ratios.push(took[1] / took[0]);
            passing_ratios.push(took[2] / took[0]);
        }
    }
    // The node daemon removes a container's directory once its keeper has gone with it.
    node.assert_torn_down();
    drop(node);
    let [p, wr, pass] = ms.map(median);
    let (ratio, pass_ratio) = (median(ratios), median(passing_ratios));
    println!("runc run of a busybox `true` bundle, {PAIRS} rotating rounds (medians):");
    println!("  runc alone                                   {p:6.1} ms");
    println!("  through devremap-runtime                     {wr:6.1} ms   ratio {ratio:.2} (target 1.15 or less)");
    println!(
        "  through devremap-runtime, not asking for it  {pass:6.1} ms   ratio {pass_ratio:.2} (the wrapper alone)"
    );
    let round2 = |x: f64| (x * 100.0).round() / 100.0;
    println!(
        "{}",
        json!({
            "runc_run_ms": round2(p),
            "wrapper_run_ms": round2(wr),
            "wrapper_run_ratio": round2(ratio),
            "passthrough_run_ms": round2(pass),
            "wrapper_passthrough_ratio": round2(pass_ratio),
            "pairs": PAIRS
        })
    );
}

/// What one run goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    /// runc alone.
    Runc,
    /// `devremap-runtime` on the bundle that asks for devremap.
    Wrapped,
    /// `devremap-runtime` on the same container not asking for it: runc exec'd unchanged.
    Passing,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
