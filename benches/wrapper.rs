//! `cargo bench --bench wrapper`: container start through `devremap-runtime` against the real
//! runtime alone, in one run, paired and alternating so the machine's drift cancels out: `runc
//! run` of a busybox `true` bundle, plain and through the wrapper (a devremap `/dev` for a fake
//! two-GPU host, the state dir on tmpfs as the default `/run/devremap` is). Prints the medians
//! and, last, one JSON line with `wrapper_run_ratio` (the median of the per-pair ratios). Needs
//! root, `/dev/fuse`, runc and busybox-static; skips with a reason otherwise.

use serde_json::json;
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const WRAPPER: &str = env!("CARGO_BIN_EXE_devremap-runtime");
const PAIRS: usize = 25;
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
    let text = json!({"host_dev": dev, "host_root": w.join("host-root"), "state_dir": state_dir.path()});
    fs::write(&wrapper_config, text.to_string()).unwrap();
    let runc_root = w.join("runc-root");
    let run = |through_wrapper: bool, id: &str| -> Duration {
        let mut c = if through_wrapper {
            let mut c = Command::new(WRAPPER);
            c.arg(format!("--devremap-config={}", wrapper_config.display()));
            c
        } else {
            Command::new("runc")
        };
        c.arg("--root").arg(&runc_root).arg("run").arg("--bundle").arg(&bundle).arg(id);
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
        let t0 = Instant::now();
        let status = c.status().unwrap();
        let took = t0.elapsed();
        assert!(status.success(), "{} run {id}: {status}", if through_wrapper { "devremap-runtime" } else { "runc" });
        took
    };
    let (mut plain, mut wrapped, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..WARMUP + PAIRS {
        // Alternate which goes first, so neither always runs on a warmer cache.
        let (p, wr) = if i % 2 == 0 {
            let p = run(false, &format!("plain-{i}"));
            (p, run(true, &format!("wrapped-{i}")))
        } else {
            let wr = run(true, &format!("wrapped-{i}"));
            (run(false, &format!("plain-{i}")), wr)
        };
        if i >= WARMUP {
            plain.push(p.as_secs_f64() * 1e3);
            wrapped.push(wr.as_secs_f64() * 1e3);
            ratios.push(wr.as_secs_f64() / p.as_secs_f64());
        }
    }
    let leftover = fs::read_dir(state_dir.path()).unwrap().count();
    assert_eq!(leftover, 0, "the wrapper left container directories in its state dir");
    let (p, wr, ratio) = (median(plain), median(wrapped), median(ratios));
    println!("runc run of a busybox `true` bundle, {PAIRS} alternating pairs (medians):");
    println!("  runc alone              {p:7.1} ms");
    println!("  through devremap-runtime {wr:6.1} ms   ratio {ratio:.2} (target 1.25 or less)");
    let round2 = |x: f64| (x * 100.0).round() / 100.0;
    println!(
        "{}",
        json!({"runc_run_ms": round2(p), "wrapper_run_ms": round2(wr), "wrapper_run_ratio": round2(ratio), "pairs": PAIRS})
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
