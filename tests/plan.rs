//! `devremapd plan --json` end to end: the real binary, committed fixtures, and fake hosts whose
//! GPUs are real char devices made with mknod (see `common`).
//!
//! The fake GPU `nvidiaN` has the rdev [`fake_rdev`]`(N)` (`nvidia0`..`nvidia3` are 1:3, 1:5,
//! 1:7, 1:8), so which host GPU a name leads to shows in its major:minor. The committed
//! metadata fixtures all save GPUs 0 and 1 (tests/fixtures/make_state.py).

mod common;

use common::*;
use serde_json::{Value, json};
use std::fs;
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Every input form the committed fixtures provide, with the `metadata.format` each reports.
const METADATA_FORMS: &[(&str, &str)] = &[
    ("checkpoint/checkpoint.img", "state-file"),
    ("checkpoint", "state-file"),
    ("metadata.json", "map"),
    ("metadata-array.json", "map"),
    ("devices.json", "array"),
];

fn default_nodes() -> Vec<Value> {
    let dev = |path: &str, major: u32, minor: u32| json!({"path": path, "type": "char", "major": major, "minor": minor, "mode": 438, "uid": 0, "gid": 0});
    let link = |path: &str, target: &str| json!({"path": path, "type": "symlink", "target": target});
    vec![
        link("fd", "/proc/self/fd"),
        dev("full", 1, 7),
        dev("null", 1, 3),
        link("ptmx", "pts/ptmx"),
        dev("random", 1, 8),
        link("stderr", "/proc/self/fd/2"),
        link("stdin", "/proc/self/fd/0"),
        link("stdout", "/proc/self/fd/1"),
        dev("tty", 5, 0),
        dev("urandom", 1, 9),
        dev("zero", 1, 5),
    ]
}

fn remap_targets(plan: &Value) -> Vec<(String, (u32, u32))> {
    plan["remap"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                (e["major"].as_u64().unwrap() as u32, e["minor"].as_u64().unwrap() as u32),
            )
        })
        .collect()
}

fn warnings(plan: &Value) -> Vec<String> {
    plan["warnings"].as_array().unwrap().iter().map(|w| w.as_str().unwrap().to_owned()).collect()
}

// ---------------------------------------------------------------------------------------------
// runc's default /dev
// ---------------------------------------------------------------------------------------------

/// Rule (semantics §6): with no inputs the tree is exactly runc's default nodes (null, zero,
/// full, random, urandom, tty as char 0666 root:root; fd, stdin, stdout, stderr, ptmx symlinks)
/// and nothing else; `core` only where the host root has `proc/kcore`, which an empty root lacks.
#[test]
fn no_inputs_give_exactly_runcs_default_nodes() {
    let host = FakeHost::new();
    let plan = plan_json(&with(&host.root_args(), &[]));
    assert_eq!(plan["nodes"], Value::Array(default_nodes()));
    assert_eq!(plan["remap"], json!([]));
    assert_eq!(plan["restored"], json!([]));
    assert_eq!(plan["tpu_devices"], json!([]));
    assert_eq!(plan["warnings"], json!([]));
    assert_eq!(plan["metadata"], Value::Null);
}

/// Rule (semantics §6): `core -> /proc/kcore` is added exactly when the host has `/proc/kcore`.
#[test]
fn core_symlink_only_where_the_host_has_kcore() {
    let host = FakeHost::new();
    fs::create_dir_all(host.root().join("proc")).unwrap();
    fs::write(host.root().join("proc/kcore"), "").unwrap();
    let plan = plan_json(&with(&host.root_args(), &[]));
    assert_eq!(node(&plan, "core"), Some(&json!({"path": "core", "type": "symlink", "target": "/proc/kcore"})));
    assert_eq!(node_paths(&plan).len(), default_nodes().len() + 1);
}

/// Rule: the table form (no `--json`) of the same inputs succeeds and prints to stdout only.
#[test]
fn text_output_succeeds() {
    let host = FakeHost::new();
    let (code, stdout, stderr) = plan(&with(&host.root_args(), &[]));
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert!(stdout.contains("remap: none"), "{stdout}");
    assert!(stdout.contains("/dev/null"), "{stdout}");
}

// ---------------------------------------------------------------------------------------------
// Metadata forms
// ---------------------------------------------------------------------------------------------

/// Rule (semantics §1): the state file, the checkpoint directory (meaning its `checkpoint.img`),
/// the metadata map with the list as a string or as an array, and the bare array are told apart
/// by content and all give the same remap.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn every_metadata_form_gives_the_same_remap() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    let mut first: Option<Value> = None;
    for &(name, format) in METADATA_FORMS {
        let path = fixture(name);
        let plan = plan_json(&with(&host.args(), &["--metadata", &path]));
        assert_eq!(plan["metadata"], json!({"format": format, "gpu_key_present": true, "saved_gpus": 2}), "{name}");
        match &first {
            None => first = Some(plan),
            Some(f) => {
                assert_eq!(plan["remap"], f["remap"], "{name} gives another remap");
                assert_eq!(plan["nodes"], f["nodes"], "{name} gives another tree");
            }
        }
    }
    let plan = first.unwrap();
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(2)), ("nvidia1".into(), fake_rdev(3))]);
    assert_eq!(remap_entry(&plan, "nvidia0")["old_uuid"], saved_uuid(0));
}

/// Rule (semantics §1): forms are told apart by content, never by file name: a state file named
/// `.json` and a JSON map named `checkpoint.img` (in a checkpoint directory) still parse.
#[test]
fn forms_are_told_apart_by_content_not_name() {
    let tmp = TempDir::new().unwrap();
    fs::copy(fixture("checkpoint/checkpoint.img"), tmp.path().join("state.json")).unwrap();
    let dir = tmp.path().join("ckpt");
    fs::create_dir(&dir).unwrap();
    fs::copy(fixture("metadata-nogpu.json"), dir.join("checkpoint.img")).unwrap();
    let host = FakeHost::new();

    // Two saved GPUs and none restored: the failure itself shows the state file was read.
    let state = tmp.path().join("state.json");
    plan_error(
        &with(&host.root_args(), &["--metadata", arg(&state)]),
        "can't remap 2 saved devices to 0 restored devices",
    );
    let plan = plan_json(&with(&host.root_args(), &["--metadata", arg(&dir)]));
    assert_eq!(plan["metadata"]["format"], "map");
}

/// Rule (semantics §1): `_timestamp`, `compression` and keys of other features are ignored:
/// changing them changes nothing, and a value of another feature need not be a device list.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn other_metadata_keys_are_ignored() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    let tmp = TempDir::new().unwrap();
    let reference = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint/checkpoint.img")]));
    let devices = saved_devices(&[0, 1]).to_string();
    let headers = [
        json!({"_timestamp": "x", "compression": "none", "nvproxy-device-remap-ids": devices}),
        json!({"_timestamp": "", "nvproxy-device-remap-ids": devices}),
        json!({"nvproxy-device-remap-ids": devices, "_internal": "{not json", "other-feature": "[1,2,3]", "compression": "zstd"}),
    ];
    for (i, header) in headers.iter().enumerate() {
        let path = write_file(tmp.path(), &format!("s{i}.img"), state_file(header.to_string().as_bytes(), b""));
        let plan = plan_json(&with(&host.args(), &["--metadata", arg(&path)]));
        assert_eq!(plan["remap"], reference["remap"], "header {header}");
        let path = write_file(tmp.path(), &format!("m{i}.json"), header.to_string());
        let plan = plan_json(&with(&host.args(), &["--metadata", arg(&path)]));
        assert_eq!(plan["remap"], reference["remap"], "map {header}");
    }
}

/// Rule (semantics §1): only the header is read; what follows it (HMAC, state data) is never
/// looked at. A state file whose data part is 50 GiB (sparse) plans as fast as a small one, and
/// data that is not JSON after the header is not an error.
#[test]
fn state_data_after_the_header_is_never_read() {
    let tmp = TempDir::new().unwrap();
    let header = metadata_map(&json!([])).to_string();
    let path = write_file(tmp.path(), "checkpoint.img", state_file(header.as_bytes(), &[0xff; 32]));
    let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(50 << 30).unwrap();
    drop(file);
    let host = FakeHost::new();
    let start = Instant::now();
    let plan = plan_json(&with(&host.root_args(), &["--metadata", arg(tmp.path())]));
    let took = start.elapsed();
    assert_eq!(plan["metadata"], json!({"format": "state-file", "gpu_key_present": true, "saved_gpus": 0}));
    assert!(took < Duration::from_secs(5), "plan of a 50 GiB state file took {took:?}");
}

/// Rule (semantics §1): the committed state file has non-JSON bytes after its header (standing
/// for compressed state data); they are not parsed.
#[test]
fn trailing_state_bytes_are_not_parsed() {
    let bytes = fs::read(fixture("checkpoint/checkpoint.img")).unwrap();
    let len = u64::from_be_bytes(bytes[8..16].try_into().unwrap()) as usize;
    assert!(bytes.len() > 16 + len + 100, "the fixture carries state data after its header");
    assert!(serde_json::from_slice::<Value>(&bytes[16..]).is_err());
    let host = FakeHost::new();
    // No restored GPU: the pairing error proves the two saved GPUs were read from the header.
    plan_error(
        &with(&host.root_args(), &["--metadata", &fixture("checkpoint/checkpoint.img")]),
        "can't remap 2 saved devices",
    );
}

/// Rule (semantics §1, gVisor): a Go nil device list (`null`) and an empty list mean no saved
/// GPUs: no remap, not an error.
#[test]
fn null_or_empty_device_list_means_nothing_to_remap() {
    let tmp = TempDir::new().unwrap();
    let host = FakeHost::new();
    for (name, content) in [
        ("null.json", json!({"nvproxy-device-remap-ids": "null"}).to_string()),
        ("empty.json", json!({"nvproxy-device-remap-ids": "[]"}).to_string()),
        ("bare.json", "[]".to_owned()),
    ] {
        let path = write_file(tmp.path(), name, content);
        let plan = plan_json(&with(&host.root_args(), &["--metadata", arg(&path)]));
        assert_eq!(plan["remap"], json!([]), "{name}");
        assert_eq!(plan["metadata"]["saved_gpus"], 0, "{name}");
    }
}

/// Rule (semantics §4, gvisor#14525): without the GPU key nothing is remapped, yet every
/// restored GPU is still served under its native name.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn absent_gpu_key_remaps_nothing_but_serves_native_names() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("metadata-nogpu.json")]));
    assert_eq!(plan["metadata"], json!({"format": "map", "gpu_key_present": false, "saved_gpus": 0}));
    assert_eq!(plan["remap"], json!([]));
    assert_eq!(node_rdev(&plan, "nvidia2"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia3"), fake_rdev(3));
    assert!(node(&plan, "nvidia0").is_none());
}

/// Rule (semantics §1): the TPU key is reported under `tpu_devices`, as written, and is not an
/// error; it remaps nothing.
#[test]
fn tpu_key_is_reported_not_remapped() {
    let host = FakeHost::new();
    let plan = plan_json(&with(&host.root_args(), &["--metadata", &fixture("metadata-tpu.json")]));
    assert_eq!(
        plan["tpu_devices"],
        json!([{"bdf": "0000:00:04.0", "vfio_group": 12}, {"bdf": "0000:00:05.0", "vfio_group": 13}])
    );
    assert_eq!(plan["remap"], json!([]));
    assert_eq!(plan["metadata"]["gpu_key_present"], false);
    assert_eq!(plan["nodes"], Value::Array(default_nodes()));
}

// ---------------------------------------------------------------------------------------------
// Pairing
// ---------------------------------------------------------------------------------------------

/// Rule (semantics §3, §4): positional pairing. Saved {0,1} restored on host {2,3}: the i-th
/// saved GPU is the i-th restored one, so `nvidia0` opens host GPU 2 and `nvidia1` host GPU 3;
/// the native names `nvidia2`/`nvidia3` are served too; each remap entry carries its keys.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn positional_pairing_onto_other_minors() {
    need_root();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint")]));
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia1"), fake_rdev(3));
    assert_eq!(node_rdev(&plan, "nvidia2"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia3"), fake_rdev(3));
    for (old, new) in [(0, 2), (1, 3)] {
        let e = remap_entry(&plan, &format!("nvidia{old}"));
        for key in ["name", "old_minor", "major", "minor", "old_uuid", "new_uuid", "served"] {
            assert!(e.get(key).is_some(), "remap entry lacks {key}: {e}");
        }
        assert_eq!(e["old_minor"], old);
        assert_eq!((e["major"].as_u64().unwrap() as u32, e["minor"].as_u64().unwrap() as u32), fake_rdev(new));
        assert_eq!(e["old_uuid"], saved_uuid(old));
        assert_eq!(e["new_uuid"], host_uuid(new));
        assert_eq!(e["served"], true);
        assert_eq!(e["explicit"], false);
    }
    // The device nodes keep the host node's mode (0666 on the fake host).
    assert_eq!(node(&plan, "nvidia0").unwrap()["mode"], 0o666);
    assert_eq!(warnings(&plan), Vec::<String>::new());
    let restored: Vec<&str> =
        plan["restored"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(restored, ["nvidia2", "nvidia3"]);
    assert_eq!(plan["restored"][0]["pci"], "10de:22c0");
    assert_eq!(plan["restored"][0]["bus"], "0000:3d:00.0");
}

/// Rule (semantics §2, §3): a restore onto the same GPUs is the identity: saved {0,1} on host
/// {0,1} maps each name to itself, with no collision.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn restore_onto_the_same_gpus_is_the_identity() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("metadata.json")]));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(0)), ("nvidia1".into(), fake_rdev(1))]);
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(0));
    assert_eq!(node_rdev(&plan, "nvidia1"), fake_rdev(1));
    assert!(plan["remap"].as_array().unwrap().iter().all(|e| e["served"] == true));
    assert_eq!(warnings(&plan), Vec::<String>::new());
}

/// Rule (semantics §3): extra restored GPUs stay unpaired, and are served under their native
/// names. Saved {0,1} on host {0,1,2,3}: identity, and nvidia2/nvidia3 as themselves.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn extra_restored_gpus_stay_unpaired() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1, 2, 3]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("devices.json")]));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(0)), ("nvidia1".into(), fake_rdev(1))]);
    for m in 0..4 {
        assert_eq!(node_rdev(&plan, &format!("nvidia{m}")), fake_rdev(m));
    }
    assert_eq!(plan["restored"].as_array().unwrap().len(), 4);
}

/// Rule (semantics §4): a checkpoint name that is another restored GPU's native name goes to
/// the native GPU by default. Saved {0,1} restored {1,2}: `nvidia1` stays host GPU 1, the
/// remap entry of `nvidia1` (now host 2) is `served: false`, a warning names `nvidia1`;
/// `nvidia0` (no collision) opens host GPU 1.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn collision_native_name_wins_by_default() {
    need_root();
    let host = FakeHost::with_gpus(&[1, 2]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint")]));
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(1));
    assert_eq!(node_rdev(&plan, "nvidia1"), fake_rdev(1));
    assert_eq!(node_rdev(&plan, "nvidia2"), fake_rdev(2));
    let e1 = remap_entry(&plan, "nvidia1");
    assert_eq!(e1["served"], false);
    assert_eq!((e1["major"].as_u64().unwrap() as u32, e1["minor"].as_u64().unwrap() as u32), fake_rdev(2));
    assert_eq!(remap_entry(&plan, "nvidia0")["served"], true);
    let w = warnings(&plan);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("nvidia1"), "{w:?}");

    // `--prefer native` is the default, spelled out.
    let explicit = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint"), "--prefer", "native"]));
    assert_eq!(explicit, plan);
}

/// Rule (semantics §4): with `--prefer checkpoint` the checkpoint name wins the collision:
/// `nvidia1` opens host GPU 2 (what saved GPU 1 now is), served, and the collision is still
/// named in a warning.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn collision_prefer_checkpoint_serves_the_saved_gpu() {
    need_root();
    let host = FakeHost::with_gpus(&[1, 2]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint"), "--prefer", "checkpoint"]));
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(1));
    assert_eq!(node_rdev(&plan, "nvidia1"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia2"), fake_rdev(2));
    assert_eq!(remap_entry(&plan, "nvidia1")["served"], true);
    let w = warnings(&plan);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("nvidia1"), "{w:?}");
}

/// Rule (semantics §4): the plan names every collision. Saved {0,1,2} restored {1,2,3}: both
/// `nvidia1` and `nvidia2` collide; by default both stay native, with `--prefer checkpoint` both
/// lead to the saved GPU's new device, and either way there is one warning per collision.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn every_collision_is_named() {
    need_root();
    let host = FakeHost::with_gpus(&[1, 2, 3]);
    let tmp = TempDir::new().unwrap();
    let path = write_file(tmp.path(), "m.json", saved_devices(&[0, 1, 2]).to_string());
    let native = plan_json(&with(&host.args(), &["--metadata", arg(&path)]));
    let checkpoint = plan_json(&with(&host.args(), &["--metadata", arg(&path), "--prefer", "checkpoint"]));
    for (plan, served) in [(&native, false), (&checkpoint, true)] {
        let w = warnings(plan);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("nvidia1") && w[1].contains("nvidia2"), "{w:?}");
        assert_eq!(remap_entry(plan, "nvidia0")["served"], true);
        assert_eq!(remap_entry(plan, "nvidia1")["served"], served);
        assert_eq!(remap_entry(plan, "nvidia2")["served"], served);
        assert_eq!(node_rdev(plan, "nvidia0"), fake_rdev(1));
        assert_eq!(node_rdev(plan, "nvidia3"), fake_rdev(3));
    }
    assert_eq!((node_rdev(&native, "nvidia1"), node_rdev(&native, "nvidia2")), (fake_rdev(1), fake_rdev(2)));
    assert_eq!((node_rdev(&checkpoint, "nvidia1"), node_rdev(&checkpoint, "nvidia2")), (fake_rdev(2), fake_rdev(3)));
}

/// Rule (issue 20, the `model` check): saved and restored sets that are each homogeneous but of
/// different models are refused, naming the check, the GPUs and both PCI ids (and the restored
/// model name the driver gives); `--relax model` pairs them with a warning. The host's `Bus
/// Location` may be upper case; its sysfs directory is lower case.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn another_model_on_restore_is_refused_unless_relaxed() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    for m in [0, 1] {
        let gpu = GpuFacts::nvidia(m);
        host.describe(&GpuFacts { device: 0x2330, bus: gpu.bus.to_ascii_uppercase(), ..gpu });
    }
    let path = fixture("metadata.json");
    let line = plan_error(&with(&host.args(), &["--metadata", &path]), "");
    assert_eq!(
        line,
        format!(
            "error: {path}: model: saved nvidia0 is 10de:22c0, restored nvidia0 is 10de:2330 (NVIDIA H100 80GB HBM3)"
        )
    );
    let plan = plan_json(&with(&host.args(), &["--metadata", &path, "--relax", "model"]));
    assert_eq!(plan["restored"][0]["pci"], "10de:2330");
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(0)), ("nvidia1".into(), fake_rdev(1))]);
    let w = warnings(&plan);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].starts_with("check model relaxed: saved nvidia0 is 10de:22c0, restored"), "{w:?}");
    let model = plan["checks"].as_array().unwrap().iter().find(|c| c["check"] == "model").unwrap().clone();
    assert_eq!((&model["ok"], &model["relaxed"]), (&json!(false), &json!(true)), "{model}");
}

/// Rule (semantics §3): more saved GPUs than restored ones is gVisor's error, naming both
/// counts and (issue 10.7) the input that gave too few GPUs: here the device directory; with no
/// restore-side input at all, the metadata file.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn more_saved_than_restored_is_an_error() {
    need_root();
    let host = FakeHost::with_gpus(&[3]);
    let path = fixture("checkpoint/checkpoint.img");
    let line = plan_error(&with(&host.args(), &["--metadata", &path]), "");
    assert_eq!(line, format!("error: {}: can't remap 2 saved devices to 1 restored devices", host.dev().display()));
    // No restored GPU at all is the same error.
    let empty = FakeHost::new();
    let line = plan_error(&with(&empty.args(), &["--metadata", &path]), "");
    assert_eq!(line, format!("error: {}: can't remap 2 saved devices to 0 restored devices", empty.dev().display()));
    let line = plan_error(&with(&empty.root_args(), &["--metadata", &path]), "");
    // Neither a spec nor a device directory: the error says which flag gives restored GPUs.
    assert_eq!(
        line,
        format!(
            "error: {path}: can't remap 2 saved devices to 0 restored devices; give the restored GPUs with --spec \
             (the container's OCI spec) or --host-dev (a directory of their nvidiaN nodes)"
        )
    );
}

/// Rule (semantics §3): saved devices must be homogeneous (same PCI vendor and device id); the
/// error names the metadata file and both differing devices.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn heterogeneous_saved_gpus_are_an_error() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    let tmp = TempDir::new().unwrap();
    let mut devices = saved_devices(&[0, 1]);
    devices[1]["pci_device_id"] = json!(8897);
    let path = write_file(tmp.path(), "m.json", metadata_map(&devices).to_string());
    let line = plan_error(&with(&host.args(), &["--metadata", arg(&path)]), arg(&path));
    assert!(line.contains("nvidia0") && line.contains("nvidia1"), "{line}");
    assert!(line.contains("homogeneous"), "{line}");
}

/// Rule (semantics §3): restored devices must be homogeneous too; the host's PCI ids come from
/// `sys/bus/pci/devices/<bus>/{vendor,device}`.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn heterogeneous_restored_gpus_are_an_error() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    host.describe(&GpuFacts::nvidia(0));
    host.describe(&GpuFacts { device: 0x2330, ..GpuFacts::nvidia(1) });
    let path = fixture("metadata.json");
    let line = plan_error(&with(&host.args(), &["--metadata", &path]), "restored");
    assert!(line.contains("nvidia0") && line.contains("nvidia1"), "{line}");
}

/// Rule (semantics §3): every saved `subdevice_instance` must be 0.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn nonzero_subdevice_instance_is_an_error() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    let tmp = TempDir::new().unwrap();
    let mut devices = saved_devices(&[0, 1]);
    devices[1]["subdevice_instance"] = json!(1);
    let path = write_file(tmp.path(), "m.json", devices.to_string());
    let line = plan_error(&with(&host.args(), &["--metadata", arg(&path)]), arg(&path));
    assert!(line.contains("subdevice_instance"), "{line}");
}

/// Rule (semantics §1, §2): minor 247 (`NV_MINOR_DEVICE_NUMBER_REGULAR_MAX`) is a valid saved
/// GPU; it pairs like any other.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn saved_minor_247_is_accepted() {
    need_root();
    let host = FakeHost::with_gpus(&[0]);
    let tmp = TempDir::new().unwrap();
    let path = write_file(tmp.path(), "m.json", saved_devices(&[247]).to_string());
    let plan = plan_json(&with(&host.args(), &["--metadata", arg(&path)]));
    assert_eq!(remap_targets(&plan), vec![("nvidia247".into(), fake_rdev(0))]);
    assert_eq!(node_rdev(&plan, "nvidia247"), fake_rdev(0));
}

// ---------------------------------------------------------------------------------------------
// --device-map
// ---------------------------------------------------------------------------------------------

/// Rule (semantics §3): an explicit pair by minor wins over position. Saved {0,1} on host {2,3}
/// with `0=3,1=2` crosses the positional pairing; the entries are `explicit`.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn device_map_by_minor_wins_over_position() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint"), "--device-map", "0=3,1=2"]));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(3)), ("nvidia1".into(), fake_rdev(2))]);
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(3));
    assert_eq!(node_rdev(&plan, "nvidia1"), fake_rdev(2));
    assert!(plan["remap"].as_array().unwrap().iter().all(|e| e["explicit"] == true));
}

/// Rule (semantics §3): explicit pairs are taken first; the positional rule pairs what is left,
/// in order. Saved {0,1} on host {2,3} with only `0=3`: `nvidia1` gets the free host GPU 2.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn device_map_partial_leaves_the_rest_to_position() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("checkpoint"), "--device-map", "0=3"]));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(3)), ("nvidia1".into(), fake_rdev(2))]);
    assert_eq!(remap_entry(&plan, "nvidia0")["explicit"], true);
    assert_eq!(remap_entry(&plan, "nvidia1")["explicit"], false);
}

/// Rule (semantics §3, §4): cuda-checkpoint style pairs by UUID (saved UUID from the metadata,
/// new UUID from the host's driver files) win over position; `--device-map` may be repeated.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn device_map_by_uuid_wins_over_position() {
    need_root();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let first = format!("{}={}", saved_uuid(0), host_uuid(3));
    let second = format!("{}={}", saved_uuid(1), host_uuid(2));
    let plan = plan_json(&with(
        &host.args(),
        &["--metadata", &fixture("metadata-array.json"), "--device-map", &first, "--device-map", &second],
    ));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(3)), ("nvidia1".into(), fake_rdev(2))]);
    assert_eq!(remap_entry(&plan, "nvidia0")["new_uuid"], host_uuid(3));
    assert_eq!(remap_entry(&plan, "nvidia1")["new_uuid"], host_uuid(2));

    // Mixed: a saved UUID onto a host minor.
    let mixed = format!("{}=3", saved_uuid(0));
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("metadata-array.json"), "--device-map", &mixed]));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(3)), ("nvidia1".into(), fake_rdev(2))]);
}

/// Rule (semantics §3): a pair naming a device that is not among the saved or restored devices
/// is an error: exit 1, one `error:` line naming the device.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn device_map_naming_an_unknown_device_is_an_error() {
    need_root();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let unknown_uuid = "GPU-00000000-0000-0000-0000-000000000000";
    let cases = [
        ("5=2".to_owned(), "saved device 5".to_owned()),
        ("0=7".to_owned(), "restored device 7".to_owned()),
        // 0 is a saved minor but not a restored one.
        ("1=0".to_owned(), "restored device 0".to_owned()),
        (format!("{unknown_uuid}=2"), format!("saved device {unknown_uuid}")),
        (format!("0={unknown_uuid}"), format!("restored device {unknown_uuid}")),
        // A host UUID is not a saved one, a saved UUID not a restored one.
        (format!("{}=2", host_uuid(3)), format!("saved device {}", host_uuid(3))),
        (format!("0={}", saved_uuid(1)), format!("restored device {}", saved_uuid(1))),
    ];
    for (map, needle) in &cases {
        let line =
            plan_error(&with(&host.args(), &["--metadata", &fixture("metadata.json"), "--device-map", map]), needle);
        assert!(line.contains("--device-map"), "{map}: {line}");
    }
}

/// Rule (semantics §3): two pairs claiming one device (restored or saved) is an error.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn device_map_claiming_a_device_twice_is_an_error() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    for map in [vec!["0=2,1=2"], vec!["0=2,0=3"], vec!["0=2", "1=2"]] {
        let mut args = vec!["--metadata".to_owned(), fixture("metadata.json")];
        for m in &map {
            args.extend(["--device-map".to_owned(), m.to_string()]);
        }
        let line = plan_error(&with(&host.args(), &args.iter().map(String::as_str).collect::<Vec<_>>()), "twice");
        assert!(line.contains("--device-map"), "{map:?}: {line}");
    }
}

/// Rule: a malformed `--device-map` value is bad input: exit 1, one `error:` line.
#[test]
fn device_map_malformed_is_an_error() {
    let host = FakeHost::new();
    for map in ["0", "0=", "=1", "a=b", "0=GPU-", "0=1,", "-1=2", "99999999999=1"] {
        let flag = format!("--device-map={map}");
        plan_error(&with(&host.root_args(), &[&flag]), "--device-map");
    }
}

// ---------------------------------------------------------------------------------------------
// OCI spec
// ---------------------------------------------------------------------------------------------

/// Rule (semantics §6): every spec mount under `/dev` becomes a directory (0755 root:root; a
/// tmpfs's has the tmpfs's mode, which runc gives the tmpfs it mounts there, issue 29.5), every
/// `linux.devices` entry is served at its path with its type, numbers, `fileMode`, uid and gid,
/// and its parents are created as directories. Mounts elsewhere and `/dev` itself add nothing.
#[test]
fn spec_mounts_become_dirs_and_devices_keep_their_attributes() {
    let host = FakeHost::new();
    let plan = plan_json(&with(&host.root_args(), &["--spec", &fixture("spec-basic.json")]));
    for (dir, mode) in [("pts", 0o755), ("shm", 0o1777), ("mqueue", 0o755), ("dri", 0o755)] {
        assert_eq!(
            node(&plan, dir),
            Some(&json!({"path": dir, "type": "dir", "mode": mode, "uid": 0, "gid": 0})),
            "{dir}"
        );
    }
    assert_eq!(
        node(&plan, "fuse"),
        Some(&json!({"path": "fuse", "type": "char", "major": 10, "minor": 229, "mode": 0o600, "uid": 0, "gid": 0}))
    );
    assert_eq!(
        node(&plan, "dri/card0"),
        Some(
            &json!({"path": "dri/card0", "type": "char", "major": 226, "minor": 0, "mode": 0o660, "uid": 0, "gid": 44})
        )
    );
    let mut expected: Vec<String> = default_nodes().iter().map(|n| n["path"].as_str().unwrap().to_owned()).collect();
    expected.extend(["pts", "shm", "mqueue", "dri", "dri/card0", "fuse"].map(String::from));
    expected.sort();
    assert_eq!(node_paths(&plan), expected);
}

/// Rule (semantics §6): a device without `fileMode`, `uid`, `gid` gets 0666 root:root; block
/// devices and fifos keep their type.
#[test]
fn spec_device_defaults_and_types() {
    let tmp = TempDir::new().unwrap();
    let spec = json!({
        "ociVersion": "1.0.2",
        "root": {"path": "rootfs"},
        "linux": {"devices": [
            {"path": "/dev/loop0", "type": "b", "major": 7, "minor": 0},
            {"path": "/dev/kmsg", "type": "c", "major": 1, "minor": 11},
            {"path": "/dev/initctl", "type": "p", "major": 0, "minor": 0}
        ]}
    });
    let path = write_file(tmp.path(), "config.json", spec.to_string());
    let host = FakeHost::new();
    let plan = plan_json(&with(&host.root_args(), &["--spec", arg(&path)]));
    assert_eq!(
        node(&plan, "loop0"),
        Some(&json!({"path": "loop0", "type": "block", "major": 7, "minor": 0, "mode": 438, "uid": 0, "gid": 0}))
    );
    assert_eq!(
        node(&plan, "kmsg"),
        Some(&json!({"path": "kmsg", "type": "char", "major": 1, "minor": 11, "mode": 438, "uid": 0, "gid": 0}))
    );
    assert_eq!(node(&plan, "initctl").map(|n| n["type"].clone()), Some(json!("fifo")));
}

/// Rule (semantics §2): the spec's char 195:N devices (N <= 247) are the restored GPUs; saved
/// {0,1} pair with them by position. `nvidiactl` (195:255) passes through, not a GPU.
#[test]
fn spec_gpu_devices_are_the_restored_gpus() {
    let host = FakeHost::new();
    let plan = plan_json(&with(
        &host.root_args(),
        &["--spec", &fixture("spec-gpus.json"), "--metadata", &fixture("checkpoint")],
    ));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), (195, 2)), ("nvidia1".into(), (195, 3))]);
    assert_eq!(node_rdev(&plan, "nvidia0"), (195, 2));
    assert_eq!(node_rdev(&plan, "nvidia1"), (195, 3));
    assert_eq!(node_rdev(&plan, "nvidia2"), (195, 2));
    assert_eq!(node_rdev(&plan, "nvidia3"), (195, 3));
    assert_eq!(node_rdev(&plan, "nvidiactl"), (195, 255));
    let restored: Vec<&str> =
        plan["restored"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(restored, ["nvidia2", "nvidia3"]);
}

/// Rule (semantics §2): a spec that asks for GPUs through the NVIDIA hook (prestart
/// `.../nvidia-container-runtime-hook`, `NVIDIA_VISIBLE_DEVICES=all`) with `--host-dev` takes the
/// restored GPUs from that directory's `nvidiaN` names.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn hook_spec_takes_gpus_from_the_host_dev_dir() {
    need_root();
    let host = FakeHost::with_gpus(&[2, 3]);
    let plan =
        plan_json(&with(&host.args(), &["--spec", &fixture("spec-hook.json"), "--metadata", &fixture("checkpoint")]));
    assert_eq!(remap_targets(&plan), vec![("nvidia0".into(), fake_rdev(2)), ("nvidia1".into(), fake_rdev(3))]);
    assert_eq!(node_rdev(&plan, "nvidia2"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia3"), fake_rdev(3));
    assert!(node(&plan, "pts").is_some());
}

/// Rule (semantics §2): without `--host-dev`, the host's `/dev` is scanned for `nvidiaN` only
/// when the spec asks for GPUs through the NVIDIA hook: not when `NVIDIA_VISIBLE_DEVICES` is
/// `void` or empty; never for the CDI hook, which makes no node (issue 29, attack 2 B1).
/// (On a host without GPUs the scanned and the unscanned cases look alike; the expected list
/// is read from the real `/dev`.)
#[test]
fn hook_spec_without_host_dev_scans_dev_only_when_gpus_are_asked_for() {
    let host = FakeHost::new();
    let tmp = TempDir::new().unwrap();
    let real_gpus: Vec<String> = {
        let mut minors: Vec<u32> = fs::read_dir("/dev")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("nvidia")?.parse::<u32>().ok())
            .collect();
        minors.sort();
        minors.into_iter().map(|m| format!("nvidia{m}")).collect()
    };
    let spec = |hook: (&str, &str), env: &[&str]| {
        let mut spec: Value = serde_json::from_str(&fs::read_to_string(fixture("spec-hook.json")).unwrap()).unwrap();
        spec["hooks"] = json!({hook.0: [{"path": hook.1}]});
        spec["process"]["env"] = json!(env);
        spec
    };
    let legacy = ("prestart", "/usr/bin/nvidia-container-runtime-hook");
    let cdi = ("createContainer", "/usr/bin/nvidia-cdi-hook");
    let cases = [
        (spec(legacy, &["NVIDIA_VISIBLE_DEVICES=all"]), true),
        (spec(legacy, &["NVIDIA_VISIBLE_DEVICES=void"]), false),
        (spec(legacy, &["NVIDIA_VISIBLE_DEVICES="]), false),
        (spec(legacy, &["PATH=/bin"]), false),
        (spec(("prestart", "/usr/bin/some-other-hook"), &["NVIDIA_VISIBLE_DEVICES=all"]), false),
        (spec(cdi, &["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"]), false),
        (spec(cdi, &["NVIDIA_VISIBLE_DEVICES=void"]), false),
    ];
    for (i, (spec, scanned)) in cases.iter().enumerate() {
        let path = write_file(tmp.path(), &format!("spec{i}.json"), spec.to_string());
        let plan = plan_json(&with(&host.root_args(), &["--spec", arg(&path)]));
        let restored: Vec<String> =
            plan["restored"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap().to_owned()).collect();
        let expected = if *scanned { real_gpus.clone() } else { Vec::new() };
        assert_eq!(restored, expected, "spec {i}: {}", spec["hooks"]);
    }
}

/// Bug (issue 29, attack 2 B1): the toolkit's CDI spec (nvidia-cdi-hook createContainer hooks,
/// GPU 0 and the control nodes in `linux.devices`, the image's `NVIDIA_VISIBLE_DEVICES=all`
/// followed by the toolkit's `void`) got every GPU of the device directory, and its `nvidia-modeset`,
/// where runc makes only the listed nodes: the CDI hook makes none. The tree holds GPU 0 and
/// what the spec lists, nothing else of the directory.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn a_cdi_spec_gets_only_the_gpus_it_lists_whatever_the_images_env() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1, 2, 3]);
    host.node("nvidia-modeset", (1, 9));
    let tmp = TempDir::new().unwrap();
    let mut spec: Value =
        serde_json::from_str(&fs::read_to_string(fixture("specs/cdi-nvidia-cdi-hook.json")).unwrap()).unwrap();
    spec["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"]);
    let path = write_file(tmp.path(), "cdi.json", spec.to_string());
    let plan = plan_json(&with(&host.args(), &["--spec", arg(&path)]));
    let restored: Vec<&str> =
        plan["restored"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(restored, ["nvidia0"]);
    for absent in ["nvidia1", "nvidia2", "nvidia3", "nvidia-modeset"] {
        assert!(node(&plan, absent).is_none(), "{absent} served:\n{plan:#}");
    }
    for listed in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
        assert!(node(&plan, listed).is_some(), "{listed} missing");
    }
}

/// Bug (found reading libnvidia-container, 2026-12-04): hook mode served `nvidia-modeset` and
/// `nvidia-uvm(-tools)` whatever the container's driver capabilities, where the toolkit's hook
/// gives `nvidia-uvm(-tools)` only with `compute` and `nvidia-modeset` only with `display`.
/// `plan --spec` of Docker's legacy-hook spec asking for the control nodes (`none`), with each
/// of several capabilities: the control nodes served are the hook's.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn hook_mode_serves_the_control_nodes_the_hooks_capabilities_give() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    for (name, rdev) in
        [("nvidiactl", (1, 3)), ("nvidia-uvm", (1, 5)), ("nvidia-uvm-tools", (1, 7)), ("nvidia-modeset", (1, 8))]
    {
        host.node(name, rdev);
    }
    let tmp = TempDir::new().unwrap();
    let docker: Value =
        serde_json::from_str(&fs::read_to_string(fixture("specs/docker-legacy-hook.json")).unwrap()).unwrap();
    let served = |capabilities: &str| {
        let mut spec = docker.clone();
        let env = spec["process"]["env"].as_array_mut().unwrap();
        env.retain(|e| !e.as_str().unwrap().starts_with("NVIDIA_"));
        // `none`: the control nodes alone (this host's driver describes no GPU).
        env.push(json!("NVIDIA_VISIBLE_DEVICES=none"));
        env.push(json!(format!("NVIDIA_DRIVER_CAPABILITIES={capabilities}")));
        let path = write_file(tmp.path(), "spec.json", spec.to_string());
        let plan = plan_json(&with(&host.args(), &["--spec", arg(&path)]));
        ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"]
            .into_iter()
            .filter(|n| node(&plan, n).is_some())
            .collect::<Vec<_>>()
    };
    assert_eq!(served("compute,utility"), ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]);
    assert_eq!(served("utility"), ["nvidiactl"]);
    assert_eq!(served("display,graphics"), ["nvidiactl", "nvidia-modeset"]);
    assert_eq!(served("all"), ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"]);
}

/// Bug (issue 29, attack 2 B6): `plan --spec` ignored the spec's `devremap.io/device-map`, which
/// `cuda-device-map` and the wrapper's daemon obey: the preview paired 0 -> 2, 1 -> 3 where the
/// daemon serves 0 -> 3, 1 -> 2. It reads the annotations as `cuda-device-map` does: a
/// `--device-map` giving other pairs is refused, the same pairs in another order are not.
#[test]
fn plan_obeys_the_specs_device_map_annotation() {
    let host = FakeHost::new();
    let tmp = TempDir::new().unwrap();
    let gpu = |m: u32| json!({"path": format!("/dev/nvidia{m}"), "type": "c", "major": 195, "minor": m});
    let mut spec: Value = serde_json::from_str(&fs::read_to_string(fixture("spec-gpus.json")).unwrap()).unwrap();
    spec["linux"]["devices"] = json!([gpu(2), gpu(3)]);
    spec["annotations"] = json!({"devremap.io/device-map": "0=3,1=2"});
    let path = write_file(tmp.path(), "map.json", spec.to_string());
    let mut owned = host.root_args();
    owned.extend(["--spec".into(), arg(&path).to_owned(), "--metadata".into(), fixture("checkpoint")]);
    let served = vec![("nvidia0".to_owned(), (195, 3)), ("nvidia1".to_owned(), (195, 2))];
    assert_eq!(remap_targets(&plan_json(&with(&owned, &[]))), served);
    assert_eq!(remap_targets(&plan_json(&with(&owned, &["--device-map", "1=2,0=3"]))), served);
    assert_eq!(remap_targets(&plan_json(&with(&owned, &["--device-map", "0=3", "--device-map", "1=2"]))), served);
    plan_error(
        &with(&owned, &["--device-map", "0=2"]),
        "--device-map contradicts the spec's annotation devremap.io/device-map",
    );
}

/// Rule (semantics §2): the host's pass-through NVIDIA nodes (`nvidiactl`, `nvidia-uvm`,
/// `nvidia-uvm-tools`, `nvidia-modeset`, `nvidia-caps/nvidia-capN`) are served with the numbers
/// they have on the host, never remapped; other host nodes are not served.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn host_passthrough_nodes_are_served_as_they_are() {
    need_root();
    let host = FakeHost::with_gpus(&[0]);
    host.node("nvidiactl", (1, 3));
    host.node("nvidia-uvm", (1, 5));
    host.node("nvidia-uvm-tools", (1, 7));
    host.node("nvidia-modeset", (1, 8));
    host.node("nvidia-caps/nvidia-cap1", (1, 9));
    host.node("sda", (1, 3));
    let plan = plan_json(&with(&host.args(), &[]));
    assert_eq!(node_rdev(&plan, "nvidiactl"), (1, 3));
    assert_eq!(node_rdev(&plan, "nvidia-uvm"), (1, 5));
    assert_eq!(node_rdev(&plan, "nvidia-uvm-tools"), (1, 7));
    assert_eq!(node_rdev(&plan, "nvidia-modeset"), (1, 8));
    assert_eq!(node_rdev(&plan, "nvidia-caps/nvidia-cap1"), (1, 9));
    assert_eq!(node(&plan, "nvidia-caps").map(|n| n["type"].clone()), Some(json!("dir")));
    assert!(node(&plan, "sda").is_none());
}

/// Rule (semantics §2 and host.rs): in the device directory, `nvidiaN` with N over 247 is an
/// error (not a skip), and so is a GPU name that is not a char device (a symlink is refused,
/// never followed); each error names the entry.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn bad_host_gpu_entries_are_errors() {
    need_root();
    let host = FakeHost::with_gpus(&[0]);
    host.node("nvidia248", (1, 3));
    plan_error(&with(&host.args(), &[]), "nvidia248");

    let host = FakeHost::with_gpus(&[0]);
    std::os::unix::fs::symlink(host.dev().join("nvidia0"), host.dev().join("nvidia1")).unwrap();
    let line = plan_error(&with(&host.args(), &[]), "nvidia1");
    assert!(line.contains("symlink"), "{line}");

    let host = FakeHost::new();
    fs::write(host.dev().join("nvidia0"), "").unwrap();
    plan_error(&with(&host.args(), &[]), "nvidia0");
}

// ---------------------------------------------------------------------------------------------
// Bad input: exit 1, one `error:` line naming the file, nothing on stdout
// ---------------------------------------------------------------------------------------------

/// Writes each `(name, bytes)` into a temp dir and asserts that `--metadata` of it fails as bad
/// input naming the file, and (when given) that the line contains `what`.
fn assert_bad_metadata(cases: &[(&str, Vec<u8>, &str)]) {
    let tmp = TempDir::new().unwrap();
    let host = FakeHost::new();
    for (name, bytes, what) in cases {
        let path = write_file(tmp.path(), name, bytes);
        let line = plan_error(&with(&host.root_args(), &["--metadata", arg(&path)]), arg(&path));
        assert!(line.contains(what), "{name}: expected {what:?} in {line:?}");
    }
}

fn prefix(magic: &[u8], len: u64) -> Vec<u8> {
    let mut out = magic.to_vec();
    out.extend_from_slice(&len.to_be_bytes());
    out
}

/// Rule (semantics §1): a file that is neither a state file (wrong magic) nor a JSON object or
/// array is refused, as is an empty file.
#[test]
fn wrong_magic_is_an_error() {
    let header = metadata_map(&saved_devices(&[0])).to_string();
    let mut wrong = b"gVisorXX".to_vec();
    wrong.extend_from_slice(&state_file(header.as_bytes(), b"")[8..]);
    let mut little_endian = b"gvisorsf".to_vec();
    little_endian.extend_from_slice(&state_file(header.as_bytes(), b"")[8..]);
    assert_bad_metadata(&[
        ("wrong-magic.img", wrong, ""),
        ("lower-case-magic.img", little_endian, ""),
        ("garbage.img", b"\x00\x01\x02\x03garbage".to_vec(), ""),
        ("empty.img", Vec::new(), "empty"),
        ("number.json", b"42".to_vec(), ""),
        ("string.json", b"\"nvproxy-device-remap-ids\"".to_vec(), ""),
    ]);
}

/// Rule (semantics §1): a state file cut short (inside the magic, the length, or the metadata
/// the length announces) is refused.
#[test]
fn truncated_state_file_header_is_an_error() {
    let header = metadata_map(&saved_devices(&[0])).to_string();
    let full = state_file(header.as_bytes(), b"");
    assert_bad_metadata(&[
        ("magic-only-part.img", b"gVis".to_vec(), "truncated"),
        ("magic-only.img", b"gVisorSF".to_vec(), "truncated"),
        ("half-length.img", b"gVisorSF\x00\x00\x00\x00".to_vec(), "truncated"),
        ("short-metadata.img", full[..full.len() - 10].to_vec(), "truncated"),
        ("length-only.img", prefix(b"gVisorSF", 100), "truncated"),
    ]);
}

/// Rule (semantics §1): gVisor refuses a metadata length over 16 MiB; so does the plan, without
/// reading that much (exactly 16 MiB is within the limit and only truncated here).
#[test]
fn metadata_length_over_16_mib_is_an_error() {
    let mut at_limit = prefix(b"gVisorSF", 16 << 20);
    at_limit.extend_from_slice(b"{}");
    assert_bad_metadata(&[
        ("over.img", prefix(b"gVisorSF", (16 << 20) + 1), "over the limit"),
        ("huge.img", prefix(b"gVisorSF", u64::MAX), "over the limit"),
        ("at-limit.img", at_limit, "truncated"),
    ]);
}

/// Rule (semantics §1): a JSON input over 16 MiB is refused too.
#[test]
fn json_over_16_mib_is_an_error() {
    let mut big = b"[".to_vec();
    big.resize((16 << 20) + 10, b' ');
    big.push(b']');
    assert_bad_metadata(&[("big.json", big, "")]);
}

/// Rule (semantics §1): JSON of the wrong shape is refused, naming what is wrong: a state file
/// whose metadata is not an object or has a non-string value; a GPU key that is neither an
/// array nor a string holding one; items that are not objects; invalid JSON.
#[test]
fn json_of_the_wrong_shape_is_an_error() {
    let gpu = |v: Value| json!({"nvproxy-device-remap-ids": v}).to_string().into_bytes();
    let state = |s: &str| state_file(s.as_bytes(), b"");
    assert_bad_metadata(&[
        ("header-array.img", state("[]"), ""),
        ("header-not-json.img", state("{\"a\":"), ""),
        ("header-number-value.img", state(&json!({"_timestamp": 5}).to_string()), "_timestamp"),
        (
            "header-array-value.img",
            state(&json!({"nvproxy-device-remap-ids": []}).to_string()),
            "nvproxy-device-remap-ids",
        ),
        ("key-number.json", gpu(json!(5)), "nvproxy-device-remap-ids"),
        ("key-object.json", gpu(json!({"minor": 0})), "nvproxy-device-remap-ids"),
        ("key-string-not-json.json", gpu(json!("not json")), "nvproxy-device-remap-ids"),
        ("key-string-object.json", gpu(json!("{\"minor\":0}")), "nvproxy-device-remap-ids"),
        ("key-string-numbers.json", gpu(json!("[1,2]")), "nvproxy-device-remap-ids"),
        ("array-of-numbers.json", b"[1,2]".to_vec(), "nvproxy-device-remap-ids"),
        ("array-of-arrays.json", b"[[]]".to_vec(), ""),
        ("invalid.json", b"{\"nvproxy-device-remap-ids\": ".to_vec(), ""),
        ("trailing.json", b"[] []".to_vec(), ""),
        ("tpu-number.json", json!({"tpu-device-remap-ids": 5}).to_string().into_bytes(), "tpu-device-remap-ids"),
        ("missing-minor.json", json!([{"uuid": "GPU-x"}]).to_string().into_bytes(), "minor"),
        ("uuid-number.json", json!([{"minor": 0, "uuid": 5}]).to_string().into_bytes(), "uuid"),
    ]);
}

/// Rule (semantics §1): `minor` must be an unsigned integer: a string, a negative number, a
/// float (even 1.0), a boolean or null is refused, naming the field; so is another numeric field
/// of the wrong type.
#[test]
fn minor_of_the_wrong_type_is_an_error() {
    let with_minor = |m: Value| json!([{"minor": m, "uuid": "GPU-a"}]).to_string().into_bytes();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("string.json", with_minor(json!("0")), "minor"),
        ("negative.json", with_minor(json!(-1)), "minor"),
        ("float.json", with_minor(json!(1.5)), "minor"),
        ("float-integral.json", b"[{\"minor\": 1.0}]".to_vec(), "minor"),
        ("bool.json", with_minor(json!(true)), "minor"),
        ("null.json", with_minor(Value::Null), "minor"),
        ("over-u32.json", with_minor(json!(4294967296u64)), "minor"),
        (
            "vendor-string.json",
            json!([{"minor": 0, "pci_vendor_id": "0x10de"}]).to_string().into_bytes(),
            "pci_vendor_id",
        ),
    ];
    assert_bad_metadata(&cases);
    // The same through the state file's string value.
    let header = metadata_map(&json!([{"minor": "0"}])).to_string();
    assert_bad_metadata(&[("string-minor.img", state_file(header.as_bytes(), b""), "minor")]);
}

/// Rule (semantics §1): saved minors are unique; a duplicate is refused, naming the minor. A
/// duplicate UUID is refused too.
#[test]
fn duplicate_minors_are_an_error() {
    let mut dup_uuid = saved_devices(&[0, 1]);
    dup_uuid[1]["uuid"] = dup_uuid[0]["uuid"].clone();
    assert_bad_metadata(&[
        ("dup.json", json!([{"minor": 1}, {"minor": 0}, {"minor": 1}]).to_string().into_bytes(), "minor 1"),
        ("dup-map.json", metadata_map(&saved_devices(&[3, 3])).to_string().into_bytes(), "minor 3"),
        ("dup-uuid.json", dup_uuid.to_string().into_bytes(), "uuid"),
    ]);
}

/// Rule (semantics §2): a saved minor over 247 (`NV_MINOR_DEVICE_NUMBER_REGULAR_MAX`) is refused.
#[test]
fn minor_248_is_an_error() {
    assert_bad_metadata(&[
        ("248.json", saved_devices(&[0, 248]).to_string().into_bytes(), "248"),
        ("255.json", json!([{"minor": 255}]).to_string().into_bytes(), "255"),
    ]);
}

/// Rule: a metadata path that cannot be read is an error naming it: a missing file, a
/// checkpoint directory without `checkpoint.img` (named as `<dir>/checkpoint.img`), a
/// `checkpoint.img` that is itself a directory, a dangling symlink.
#[test]
fn missing_or_unreadable_metadata_is_an_error() {
    let tmp = TempDir::new().unwrap();
    let host = FakeHost::new();
    let missing = tmp.path().join("missing.img");
    plan_error(&with(&host.root_args(), &["--metadata", arg(&missing)]), arg(&missing));

    let empty_dir = tmp.path().join("empty-ckpt");
    fs::create_dir(&empty_dir).unwrap();
    plan_error(&with(&host.root_args(), &["--metadata", arg(&empty_dir)]), arg(&empty_dir.join("checkpoint.img")));

    let nested = tmp.path().join("nested");
    fs::create_dir_all(nested.join("checkpoint.img")).unwrap();
    plan_error(&with(&host.root_args(), &["--metadata", arg(&nested)]), arg(&nested.join("checkpoint.img")));

    let dangling = tmp.path().join("dangling.img");
    std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).unwrap();
    plan_error(&with(&host.root_args(), &["--metadata", arg(&dangling)]), arg(&dangling));

    // Permission bits stop only non-root readers.
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        let locked = write_file(tmp.path(), "locked.json", "[]");
        fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
        let line = plan_error(&with(&host.root_args(), &["--metadata", arg(&locked)]), arg(&locked));
        assert!(line.contains("permission denied"), "{line}");
    }
}

/// Rule: a spec that cannot be read or does not parse as an OCI runtime spec is an error naming
/// it; so is a spec device that is not a node type (`a`) or a mount or device path with `..`.
#[test]
fn bad_spec_is_an_error() {
    let tmp = TempDir::new().unwrap();
    let host = FakeHost::new();
    let base = || json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"}});
    let mut dotdot_dev = base();
    dotdot_dev["linux"] = json!({"devices": [{"path": "/dev/../etc/x", "type": "c", "major": 1, "minor": 3}]});
    let mut dotdot_mount = base();
    dotdot_mount["mounts"] = json!([{"destination": "/dev/../x", "type": "tmpfs", "source": "tmpfs"}]);
    let mut type_a = base();
    type_a["linux"] = json!({"devices": [{"path": "/dev/all", "type": "a", "major": 1, "minor": 3}]});
    let mut bad_mode = base();
    bad_mode["linux"] =
        json!({"devices": [{"path": "/dev/x", "type": "c", "major": 1, "minor": 3, "fileMode": 0o100666}]});
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not-json.json", b"this is not json".to_vec()),
        ("empty.json", Vec::new()),
        ("array.json", b"[]".to_vec()),
        ("wrong-types.json", json!({"ociVersion": 5, "mounts": "none"}).to_string().into_bytes()),
        (
            "device-no-type.json",
            json!({"ociVersion": "1.0.2", "linux": {"devices": [{"path": "/dev/x"}]}}).to_string().into_bytes(),
        ),
        ("dotdot-dev.json", dotdot_dev.to_string().into_bytes()),
        ("dotdot-mount.json", dotdot_mount.to_string().into_bytes()),
        ("type-a.json", type_a.to_string().into_bytes()),
        ("bad-mode.json", bad_mode.to_string().into_bytes()),
    ];
    for (name, bytes) in &cases {
        let path = write_file(tmp.path(), name, bytes);
        plan_error(&with(&host.root_args(), &["--spec", arg(&path)]), arg(&path));
    }
    let missing = tmp.path().join("missing.json");
    plan_error(&with(&host.root_args(), &["--spec", arg(&missing)]), arg(&missing));
    plan_error(&with(&host.root_args(), &["--spec", arg(tmp.path())]), arg(tmp.path()));
}

/// Rule: a spec whose nodes cannot form a tree (a device under another device, a mount onto a
/// device path) is an error naming the spec.
#[test]
fn spec_nodes_that_do_not_fit_a_tree_are_an_error() {
    let tmp = TempDir::new().unwrap();
    let host = FakeHost::new();
    let under_null = json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "linux": {"devices": [{"path": "/dev/null/x", "type": "c", "major": 1, "minor": 3}]}});
    let mount_on_null = json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "mounts": [{"destination": "/dev/null/sub", "type": "tmpfs", "source": "tmpfs"}]});
    for (name, spec) in [("under-null.json", under_null), ("mount-on-null.json", mount_on_null)] {
        let path = write_file(tmp.path(), name, spec.to_string());
        plan_error(&with(&host.root_args(), &["--spec", arg(&path)]), arg(&path));
    }
}

/// Rule: a `--host-dev` directory that does not exist is an error naming it.
#[test]
fn missing_host_dev_is_an_error() {
    let tmp = TempDir::new().unwrap();
    let missing = tmp.path().join("dev");
    plan_error(&["--host-dev", arg(&missing), "--host-root", arg(tmp.path())], arg(&missing));
}

/// Rule: an unknown flag or subcommand value is bad input: exit 1, one `error:` line.
#[test]
fn bad_flags_are_an_error() {
    let host = FakeHost::new();
    plan_error(&with(&host.root_args(), &["--prefer", "both"]), "--prefer");
    plan_error(&with(&host.root_args(), &["--no-such-flag"]), "--no-such-flag");
}
