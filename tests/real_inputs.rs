//! `devremapd plan` on inputs shaped like real ones (issue 10): driver information files of
//! several generations (`tests/fixtures/driver/`), specs as Docker, containerd and the NVIDIA
//! Container Toolkit write them in legacy and CDI modes (`tests/fixtures/specs/`), and hosts
//! whose GPU minors do not follow the PCI bus order.
//!
//! The fake GPU `nvidiaN` has the rdev [`fake_rdev`]`(N)`, so which host GPU a name leads to
//! shows in its major:minor. The committed metadata fixtures save GPUs 0 and 1.

mod common;

use common::daemon::{Daemon, need_fuse, wait_for};
use common::*;
use serde_json::{Value, json};
use std::fs;
use std::path::{Path, PathBuf};
use tempfile::TempDir;

/// The most nodes a tree holds (`inputs::limits::MAX_NODES`).
const MAX_NODES: usize = 1 << 14;

/// The text of a driver fixture with the value of each `(key, value)` line replaced, the
/// driver's spacing kept.
fn edited(name: &str, edits: &[(&str, &str)]) -> String {
    let text = fs::read_to_string(fixture(&format!("driver/{name}"))).unwrap();
    text.lines()
        .map(|line| {
            let key = line.split_once(':').map(|(k, _)| k.trim());
            match edits.iter().find(|(k, _)| Some(*k) == key) {
                Some((_, value)) => {
                    let colon = line.find(':').unwrap();
                    let start = colon + 1 + line[colon + 1..].find(|c: char| !c.is_whitespace()).unwrap_or(0);
                    format!("{}{value}\n", &line[..start])
                }
                None => format!("{line}\n"),
            }
        })
        .collect()
}

/// Places information `text` under the host root at the bus its `Bus Location` names, with the
/// PCI ids `device` (vendor 0x10de) in sysfs. Returns the bus.
fn place(host: &FakeHost, text: &str, device: u32) -> String {
    let bus = text
        .lines()
        .find_map(|l| l.strip_prefix("Bus Location:"))
        .map(|b| b.trim().to_owned())
        .expect("a Bus Location line");
    let dir = host.root().join("proc/driver/nvidia/gpus").join(&bus);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("information"), text).unwrap();
    let sys = host.root().join("sys/bus/pci/devices").join(bus.to_ascii_lowercase());
    fs::create_dir_all(&sys).unwrap();
    fs::write(sys.join("vendor"), "0x10de\n").unwrap();
    fs::write(sys.join("device"), format!("0x{device:04x}\n")).unwrap();
    bus
}

/// The PCI bus of host GPU `minor` on [`dgx_host`]: minors 0 and 1 sit first on the bus, 2
/// and 3 in the other order, so the driver's enumeration (by bus) is minors 0, 1, 3, 2.
const DGX_BUSES: [&str; 4] = ["0000:07:00.0", "0000:0f:00.0", "0000:b7:00.0", "0000:87:00.0"];

/// Four H100s (the 535 driver's file) whose minors do not follow the bus order, with
/// `nvidiactl` beside them.
fn dgx_host() -> FakeHost {
    let host = FakeHost::with_gpus(&[0, 1, 2, 3]);
    for (minor, bus) in DGX_BUSES.iter().enumerate() {
        let text = edited(
            "hopper-h100-535.information",
            &[("Bus Location", bus), ("Device Minor", &minor.to_string()), ("GPU UUID", &host_uuid(minor as u32))],
        );
        place(&host, &text, 0x2330);
    }
    host.node("nvidiactl", (1, 9));
    host
}

/// A spec fixture with its last `NVIDIA_VISIBLE_DEVICES` entry before any trailing `void` set
/// to `value` (removed when `None`), written into `dir`.
fn spec_with_visible(dir: &Path, name: &str, value: Option<&str>) -> PathBuf {
    let mut spec: Value =
        serde_json::from_str(&fs::read_to_string(fixture(&format!("specs/{name}"))).unwrap()).unwrap();
    let env = spec["process"]["env"].as_array_mut().unwrap();
    let user = env
        .iter()
        .rposition(|e| e.as_str().unwrap().starts_with("NVIDIA_VISIBLE_DEVICES=") && e != "NVIDIA_VISIBLE_DEVICES=void")
        .expect("the fixture sets NVIDIA_VISIBLE_DEVICES");
    match value {
        Some(v) => env[user] = format!("NVIDIA_VISIBLE_DEVICES={v}").into(),
        None => {
            env.remove(user);
        }
    }
    write_file(dir, name, spec.to_string())
}

/// The host minors of the restored GPUs, from their names (`minor` in the JSON is the number
/// the node opens, a fake one here).
fn restored_minors(plan: &Value) -> Vec<u32> {
    let minor = |g: &Value| g["name"].as_str().and_then(|n| n.strip_prefix("nvidia")).unwrap().parse().unwrap();
    plan["restored"].as_array().unwrap().iter().map(minor).collect()
}

fn gpu_names(plan: &Value) -> Vec<String> {
    node_paths(plan)
        .into_iter()
        .filter(|p| p.strip_prefix("nvidia").is_some_and(|n| n.parse::<u32>().is_ok()))
        .collect()
}

fn plan_warnings(plan: &Value) -> Vec<String> {
    plan["warnings"].as_array().unwrap().iter().map(|w| w.as_str().unwrap().to_owned()).collect()
}

// ---------------------------------------------------------------------------------------------
// Driver information files
// ---------------------------------------------------------------------------------------------

/// Rule: the information files of eight drivers/GPUs (Kepler to Hopper, with and without
/// `Blacklisted`, `GPU Excluded`, `GPU Firmware`, a placeholder UUID, no `Device Minor`) are read
/// as they are: each GPU with a minor gets its UUID and bus; the placeholder is no UUID; a file
/// without `Device Minor` describes no GPU by minor.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn driver_files_of_several_generations_are_read() {
    need_root();
    // (fixture, minor the host GPU has, expected uuid)
    let cases: &[(&str, u32, Option<&str>)] = &[
        ("kepler-gtx650-no-minor.information", 0, None),
        ("kepler-k80-placeholder.information", 0, None),
        ("maxwell-m60-390.information", 1, Some("GPU-3f9d3a46-6e4e-52e8-7f3e-1f5c3a9c2b71")),
        ("pascal-p100-418.information", 2, Some("GPU-6b1f0c4e-2f3a-8d41-9c0e-5a7b3d2e1f08")),
        ("volta-v100-440.information", 3, Some("GPU-a1c4f2d6-7e3b-1c9a-54f0-2b8d6e9a0c13")),
        ("ampere-a100-470.information", 4, Some("GPU-5d9a0f3c-81e2-4b7a-9c6d-0e2f4a8b1c57")),
        ("ada-l4-550.information", 5, Some("GPU-2c7e9b14-d03a-6f58-e1b2-7a4c9d0e3f62")),
        ("hopper-h100-535.information", 6, Some("GPU-9221d5d1-b60b-a624-bf14-0a1819cfda3b")),
    ];
    for &(name, minor, uuid) in cases {
        let host = FakeHost::new();
        host.node(&format!("nvidia{minor}"), (1, 3));
        let text = fs::read_to_string(fixture(&format!("driver/{name}"))).unwrap();
        let bus = place(&host, &text, 0x20b0);
        let plan = plan_json(&host.args().iter().map(String::as_str).collect::<Vec<_>>());
        let gpu = &plan["restored"][0];
        assert_eq!(restored_minors(&plan), [minor], "{name}");
        assert_eq!(gpu["uuid"], json!(uuid), "{name}");
        let known = name != "kepler-gtx650-no-minor.information";
        assert_eq!(gpu["bus"], if known { json!(bus) } else { Value::Null }, "{name}");
        assert_eq!(gpu["pci"], if known { json!("10de:20b0") } else { Value::Null }, "{name}");
        assert_eq!(plan_warnings(&plan), Vec::<String>::new(), "{name}");
    }
}

/// Bug (issue 10.9): docs say a driver file over 64 KiB is skipped; the code read its first
/// 64 KiB. Now a file of exactly 64 KiB is read, one byte more is skipped with a warning naming
/// it, and the GPU is served without what it would have said.
#[test]
fn oversized_information_file_is_skipped_with_a_warning() {
    let host = FakeHost::new();
    let text = edited("hopper-h100-535.information", &[("Device Minor", "2")]);
    let pad = |len: usize| format!("{text}{}", " ".repeat(len - text.len()));
    let spec = fixture("spec-gpus.json");
    let bus = place(&host, &pad(64 << 10), 0x2330);
    let exact = plan_json(&with(&host.root_args(), &["--spec", &spec]));
    assert_eq!(exact["restored"][0]["uuid"], "GPU-9221d5d1-b60b-a624-bf14-0a1819cfda3b");
    assert_eq!(plan_warnings(&exact), Vec::<String>::new());

    place(&host, &pad((64 << 10) + 1), 0x2330);
    let planned = plan_json(&with(&host.root_args(), &["--spec", &spec]));
    assert_eq!(planned["restored"][0]["uuid"], Value::Null);
    let file = host.root().join("proc/driver/nvidia/gpus").join(&bus).join("information");
    assert_eq!(
        plan_warnings(&planned),
        [format!("{}: larger than 64 KiB, not a driver file; skipped", file.display())]
    );
    // The table form prints it too, on stdout with the plan.
    let (code, stdout, _) = plan(&with(&host.root_args(), &["--spec", &spec]));
    assert_eq!(code, 0);
    assert!(stdout.contains("larger than 64 KiB, not a driver file; skipped"), "{stdout}");
}

// ---------------------------------------------------------------------------------------------
// NVIDIA_VISIBLE_DEVICES in hook mode
// ---------------------------------------------------------------------------------------------

/// Bug (issue 10.1): with Docker's legacy hook and `NVIDIA_VISIBLE_DEVICES=2,3` on a four-GPU
/// host, the restored GPUs are the 3rd and 4th in the driver's (PCI bus) order, here minors 3
/// and 2; the saved GPUs 0 and 1 pair with them, and only they get native names.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn legacy_hook_restores_exactly_the_visible_devices() {
    need_root();
    let host = dgx_host();
    let tmp = TempDir::new().unwrap();
    let (host_args, meta) = (host.args(), fixture("metadata.json"));
    // The checkpoint's GPUs (10de:22c0) are not this host's H100s: the model check is relaxed,
    // since the selection, not the model, is what this test is about.
    let run = |value: &str| {
        let spec = spec_with_visible(tmp.path(), "docker-legacy-hook.json", Some(value));
        plan_json(&with(&host_args, &["--spec", arg(&spec), "--metadata", &meta, "--relax", "model"]))
    };
    let plan = run("2,3");
    assert_eq!(restored_minors(&plan), [2, 3]);
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia1"), fake_rdev(3));
    assert_eq!(gpu_names(&plan), ["nvidia0", "nvidia1", "nvidia2", "nvidia3"]);
    assert_eq!(node_rdev(&plan, "nvidia2"), fake_rdev(2));
    assert_eq!(node_rdev(&plan, "nvidia3"), fake_rdev(3));
    assert_eq!(node_rdev(&plan, "nvidiactl"), (1, 9));

    // Index 2 is minor 3 here, not minor 2; by UUID and by bus id the same GPUs.
    let by_bus = run(&format!("{},{}", DGX_BUSES[2], host_uuid(3).to_uppercase().replacen("GPU-", "gpu-", 1)));
    assert_eq!(restored_minors(&by_bus), [2, 3]);
    assert_eq!(restored_minors(&run("2,0")), [0, 3]);
    let plan = run("0,1");
    assert_eq!(restored_minors(&plan), [0, 1]);
    assert_eq!(gpu_names(&plan), ["nvidia0", "nvidia1"]);
}

/// Bug (issue 10.1): a selection of fewer GPUs than the checkpoint saved is refused as the
/// spec's fault; `none` restores no GPU but keeps the control nodes; `all` every GPU; a GPU
/// the host does not have and a MIG device are refused, naming the spec.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn visible_devices_forms_and_refusals() {
    need_root();
    let host = dgx_host();
    let tmp = TempDir::new().unwrap();
    let spec = |value: &str| spec_with_visible(tmp.path(), "docker-legacy-hook.json", Some(value));
    let meta = fixture("metadata.json");

    let one = spec(&host_uuid(1));
    let line = plan_error(&with(&host.args(), &["--spec", arg(&one), "--metadata", &meta]), "");
    assert_eq!(line, format!("error: {}: can't remap 2 saved devices to 1 restored devices", one.display()));

    let none = spec("none");
    let plan = plan_json(&with(&host.args(), &["--spec", arg(&none)]));
    assert_eq!(restored_minors(&plan), Vec::<u32>::new());
    assert_eq!(gpu_names(&plan), Vec::<String>::new());
    assert_eq!(node_rdev(&plan, "nvidiactl"), (1, 9));

    let all = spec("all");
    assert_eq!(restored_minors(&plan_json(&with(&host.args(), &["--spec", arg(&all)]))), [0, 1, 2, 3]);

    for (value, what) in [
        ("4", "NVIDIA_VISIBLE_DEVICES selects GPU index 4, which the host does not have (the driver's information files describe 4 GPUs, indexes 0 to 3)".to_owned()),
        ("GPU-0b5e55ed-1111-4222-8333-000000000009", "NVIDIA_VISIBLE_DEVICES selects GPU GPU-0b5e55ed-1111-4222-8333-000000000009, which the host does not have".to_owned()),
        ("MIG-5d9a0f3c-81e2-4b7a-9c6d-0e2f4a8b1c57", "process.env: NVIDIA_VISIBLE_DEVICES: \"MIG-5d9a0f3c-81e2-4b7a-9c6d-0e2f4a8b1c57\" is a MIG device; MIG devices are not supported yet".to_owned()),
        ("0:1", "process.env: NVIDIA_VISIBLE_DEVICES: \"0:1\" is a MIG device; MIG devices are not supported yet".to_owned()),
        ("nvidia0", "process.env: NVIDIA_VISIBLE_DEVICES: \"nvidia0\" is not a GPU index, a GPU- UUID or a PCI bus id".to_owned()),
    ] {
        let path = spec(value);
        let line = plan_error(&with(&host.args(), &["--spec", arg(&path)]), &what);
        assert!(line.starts_with(&format!("error: {}: ", path.display())), "{line}");
    }
}

/// Rule: the hook selection reads the driver's files; a GPU the driver marks excluded takes no
/// index, and one whose file has no `Device Minor` cannot be selected (it could not be named).
#[test]
#[ignore = "needs root (makes device nodes)"]
fn excluded_and_minorless_gpus_in_hook_mode() {
    need_root();
    let host = dgx_host();
    let tmp = TempDir::new().unwrap();
    // Minor 0 (bus 07, index 0) excluded: index 0 is now minor 1.
    let excluded = edited(
        "hopper-h100-535.information",
        &[("Bus Location", DGX_BUSES[0]), ("Device Minor", "0"), ("GPU UUID", &host_uuid(0)), ("GPU Excluded", "Yes")],
    );
    place(&host, &excluded, 0x2330);
    let spec = spec_with_visible(tmp.path(), "docker-legacy-hook.json", Some("0"));
    assert_eq!(restored_minors(&plan_json(&with(&host.args(), &["--spec", arg(&spec)]))), [1]);
    // The GTX 650's file (no Device Minor) at the first bus: index 0 cannot be served.
    let old = edited("kepler-gtx650-no-minor.information", &[("Bus Location", "0000:01:00.0")]);
    place(&host, &old, 0x11c6);
    plan_error(
        &with(&host.args(), &["--spec", arg(&spec)]),
        "NVIDIA_VISIBLE_DEVICES selects GPU index 0, but the driver's information file of 0000:01:00.0 gives no Device Minor",
    );
}

/// Rule (issue 29.3, attack 2 B1): the CDI toolkit's spec (nvidia-cdi-hook createContainer
/// hooks, the GPUs as CDI device nodes, a trailing `NVIDIA_VISIBLE_DEVICES=void`) asks nothing
/// through the hook: its GPUs are the spec's own devices (GPU 0 here), whatever the value
/// before the `void` says (gVisor's rule read that value, and so did devremap's before).
#[test]
#[ignore = "needs root (makes device nodes)"]
fn a_cdi_spec_gets_the_gpus_its_devices_list() {
    need_root();
    let host = dgx_host();
    let spec = fixture("specs/cdi-nvidia-cdi-hook.json");
    let tmp = TempDir::new().unwrap();
    let single = write_file(tmp.path(), "one.json", json!([saved_device(0)]).to_string());
    // Another model than the H100s here; the selection is what is tested (issue 20's model check).
    let plan = plan_json(&with(&host.args(), &["--spec", &spec, "--metadata", arg(&single), "--relax", "model"]));
    assert_eq!(restored_minors(&plan), [0]);
    assert_eq!(gpu_names(&plan), ["nvidia0"]);
    // The directory's number wins over the spec's 195:0 for the same minor.
    assert_eq!(node_rdev(&plan, "nvidia0"), fake_rdev(0));
    assert_eq!(node_rdev(&plan, "nvidia-uvm"), (508, 0));
}

/// Rule (semantics §2): older CDI specs (`nvidia-ctk hook ...`) and specs whose
/// NVIDIA_VISIBLE_DEVICES is unset, empty or `void` do not ask through the hook: the restored
/// GPUs are the spec's devices only, and no device directory is scanned.
#[test]
fn specs_that_do_not_ask_through_the_hook() {
    let host = FakeHost::new();
    let tmp = TempDir::new().unwrap();
    let plan = plan_json(&with(&host.root_args(), &["--spec", &fixture("specs/cdi-nvidia-ctk-hook.json")]));
    assert_eq!(restored_minors(&plan), [0]);
    assert_eq!(node_rdev(&plan, "nvidia0"), (195, 0));
    assert_eq!(node_rdev(&plan, "nvidiactl"), (195, 255));
    for value in [None, Some(""), Some("void"), Some(" , ")] {
        let spec = spec_with_visible(tmp.path(), "docker-legacy-hook.json", value);
        let plan = plan_json(&with(&host.root_args(), &["--spec", arg(&spec)]));
        assert_eq!(restored_minors(&plan), Vec::<u32>::new(), "{value:?}");
        assert!(node(&plan, "nvidiactl").is_none(), "{value:?}: /dev was scanned");
    }
}

// ---------------------------------------------------------------------------------------------
// Mixed models, placeholder UUIDs, fileMode type bits, duplicate paths
// ---------------------------------------------------------------------------------------------

/// Bug (issue 10.2): a workstation with an H100 and an L4 is served when there is nothing to
/// remap (no metadata, or metadata without a GPU list); with saved GPUs the mixed restore side is
/// refused, as the host root's fault.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn mixed_models_are_refused_only_with_something_to_remap() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    place(&host, &edited("hopper-h100-535.information", &[("Device Minor", "0")]), 0x2330);
    place(&host, &edited("ada-l4-550.information", &[("Device Minor", "1")]), 0x27b8);
    let plan = plan_json(&host.args().iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(restored_minors(&plan), [0, 1]);
    assert_eq!(
        (plan["restored"][0]["pci"].as_str(), plan["restored"][1]["pci"].as_str()),
        (Some("10de:2330"), Some("10de:27b8"))
    );
    let plan = plan_json(&with(&host.args(), &["--metadata", &fixture("metadata-nogpu.json")]));
    assert_eq!(restored_minors(&plan), [0, 1]);
    let line = plan_error(&with(&host.args(), &["--metadata", &fixture("metadata.json")]), "");
    assert_eq!(
        line,
        format!(
            "error: {}: mixed: restored devices are not homogeneous: nvidia0 is 10de:2330 but nvidia1 is 10de:27b8",
            host.root().display()
        )
    );
}

/// Bug (issue 10.3): two K80 dies whose driver could not read their UUIDs print the same
/// placeholder; it is no identity: both are served without a UUID, saved GPUs carrying it are
/// not duplicates, and a `--device-map` naming it is refused with the reason.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn placeholder_uuids_are_no_identity() {
    need_root();
    let host = FakeHost::with_gpus(&[0, 1]);
    for (minor, bus) in [(0, "0000:03:00.0"), (1, "0000:04:00.0")] {
        let text = edited(
            "kepler-k80-placeholder.information",
            &[("Device Minor", &minor.to_string()), ("Bus Location", bus)],
        );
        place(&host, &text, 0x102d);
    }
    let tmp = TempDir::new().unwrap();
    let placeholder = "GPU-????????-????-????-????-????????????";
    let mut saved = saved_devices(&[0, 1]);
    for d in saved.as_array_mut().unwrap() {
        d["uuid"] = placeholder.into();
    }
    let meta = write_file(tmp.path(), "k80.json", saved.to_string());
    // Saved as 10de:22c0, restored onto K80s: the model check is relaxed, the UUIDs are tested.
    let plan = plan_json(&with(&host.args(), &["--metadata", arg(&meta), "--device-map", "0=1", "--relax", "model"]));
    assert_eq!(plan["restored"][0]["uuid"], Value::Null);
    assert_eq!(plan["restored"][1]["uuid"], Value::Null);
    assert_eq!(remap_entry(&plan, "nvidia0")["old_uuid"], Value::Null);
    assert_eq!(remap_entry(&plan, "nvidia0")["new_name"], "nvidia1");
    let map = format!("{placeholder}=1");
    plan_error(
        &with(&host.args(), &["--metadata", arg(&meta), "--device-map", &map]),
        "the driver prints this placeholder for a UUID it cannot read; name the GPU by its minor",
    );
}

/// Bug (issue 10.4): containerd wrote `fileMode` with the file-type bits (8630 = 0o20666 for a
/// char device, containerd#5028); a real containerd spec with such devices is served with mode
/// 0666; type bits of another node type are refused, naming the spec and the entry.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn containerd_file_modes_with_type_bits() {
    need_root();
    let host = dgx_host();
    let spec = fixture("specs/containerd-legacy-hook.json");
    let plan = plan_json(&with(&host.args(), &["--spec", &spec]));
    assert_eq!(node(&plan, "infiniband/uverbs0").unwrap()["mode"], 0o666);
    assert_eq!(node_rdev(&plan, "infiniband/rdma_cm"), (10, 56));
    // The device plugin's envvar strategy named host GPU 2 by UUID.
    assert_eq!(restored_minors(&plan), [2]);

    let tmp = TempDir::new().unwrap();
    let mut bad: Value = serde_json::from_str(&fs::read_to_string(&spec).unwrap()).unwrap();
    bad["linux"]["devices"][1]["fileMode"] = json!(0o60666);
    let bad = write_file(tmp.path(), "bad.json", bad.to_string());
    let line = plan_error(&with(&host.args(), &["--spec", arg(&bad)]), "");
    assert_eq!(
        line,
        format!(
            "error: {}: linux.devices[1] (/dev/infiniband/rdma_cm): fileMode 0o60666: its file-type bits 0o60000 are not those of a char node (0o20000)",
            bad.display()
        )
    );
}

/// Bug (issue 10.6): the same path twice in linux.devices: runc keeps the first (its mknod of
/// the second fails with EEXIST, which it ignores); so does the tree, with a warning.
#[test]
fn same_device_path_twice_keeps_the_first_and_warns() {
    let host = FakeHost::new();
    let tmp = TempDir::new().unwrap();
    let spec = json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "linux": {"devices": [
        {"path": "/dev/nvidia2", "type": "c", "major": 195, "minor": 2},
        {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229},
        {"path": "/dev//nvidia2", "type": "c", "major": 195, "minor": 3, "fileMode": 0o600}]}});
    let spec = write_file(tmp.path(), "dup.json", spec.to_string());
    let plan = plan_json(&with(&host.root_args(), &["--spec", arg(&spec)]));
    assert_eq!(node_rdev(&plan, "nvidia2"), (195, 2));
    assert_eq!(node(&plan, "nvidia2").unwrap()["mode"], 0o666);
    assert_eq!(
        plan_warnings(&plan),
        ["spec device /dev/nvidia2 is listed again as /dev//nvidia2; serving the first entry, as runc does"]
    );
}

// ---------------------------------------------------------------------------------------------
// Errors name the input that holds the cause; wrong inputs do not pass in silence
// ---------------------------------------------------------------------------------------------

/// Bug (issue 10.7): a GPU removed from the spec leaves too few restored GPUs: the error names
/// the spec, not the checkpoint.
#[test]
fn too_few_spec_gpus_blame_the_spec() {
    let host = FakeHost::new();
    let tmp = TempDir::new().unwrap();
    let mut spec: Value = serde_json::from_str(&fs::read_to_string(fixture("spec-gpus.json")).unwrap()).unwrap();
    spec["linux"]["devices"].as_array_mut().unwrap().retain(|d| d["path"] != "/dev/nvidia2");
    let spec = write_file(tmp.path(), "spec-3.json", spec.to_string());
    let line =
        plan_error(&with(&host.root_args(), &["--spec", arg(&spec), "--metadata", &fixture("metadata.json")]), "");
    assert_eq!(line, format!("error: {}: can't remap 2 saved devices to 1 restored devices", spec.display()));
}

/// Bug (issue 10.7): a host pass-through node the tree cannot take is the host directory's
/// error, naming it, not the spec's. Since issue 29.3 a spec is never given `nvidia-caps/*`
/// and keeps its own entry under a control node's name, so no spec node is in a host node's
/// way any more (this test's old case, a spec file `/dev/nvidia-caps` over the host's
/// `nvidia-caps/nvidia-cap1`, no longer clashes); what is left is the tree's node limit: a
/// spec asking the hook for no GPU (`none`: the control nodes alone) whose devices fill the
/// tree, which plans without the device directory, and the host's `nvidiactl`, which the tree
/// cannot take.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn passthrough_clash_blames_the_host_directory() {
    need_root();
    let host = FakeHost::new();
    host.node("nvidiactl", (1, 3));
    let tmp = TempDir::new().unwrap();
    let spec_of = |n: usize| {
        let devices: Vec<Value> =
            (0..n).map(|i| json!({"path": format!("/dev/d{i}"), "type": "c", "major": 1, "minor": 3})).collect();
        let mut spec = json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"cwd": "/", "args": ["sh"], "user": {"uid": 0, "gid": 0}, "env": []},
                              "linux": {"devices": devices}});
        bundle::nvidia_hook(&mut spec, tmp.path(), Some("none"));
        write_file(tmp.path(), "config.json", spec.to_string())
    };
    // The tree's nodes: the plan's, and its root, which the plan does not list.
    let nodes = |spec: &Path| node_paths(&plan_json(&with(&host.root_args(), &["--spec", arg(spec)]))).len() + 1;
    let spec = spec_of(MAX_NODES - nodes(&spec_of(0)));
    assert_eq!(nodes(&spec), MAX_NODES, "the spec fills the tree");
    let line = plan_error(&with(&host.args(), &["--spec", arg(&spec)]), "");
    assert_eq!(
        line,
        format!(
            "error: {}: host node nvidiactl: the tree would hold more than {MAX_NODES} nodes",
            host.dev().display()
        )
    );
}

/// Bug (issue 10.8): wrong inputs that passed in silence: a spec given as `--metadata` is
/// warned about (a JSON object without the GPU list or gVisor's `_timestamp`); a `--host-root`
/// that does not exist, or is a file, is an error; `--device-map` without `--metadata` says that
/// no checkpoint was given.
#[test]
fn wrong_inputs_do_not_pass_in_silence() {
    let host = FakeHost::new();
    let spec = fixture("specs/docker-legacy-hook.json");
    let plan = plan_json(&with(&host.root_args(), &["--metadata", &spec]));
    assert_eq!(plan["remap"], json!([]));
    let warnings = plan_warnings(&plan);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with(&format!("{spec}: a JSON object with neither nvproxy-device-remap-ids nor _timestamp (its keys: ociVersion, process, root, hostname, mounts, hooks, ...)")), "{warnings:?}");
    // gVisor's own metadata without the GPU list (nothing was open at save) is not warned about.
    assert_eq!(
        plan_warnings(&plan_json(&with(&host.root_args(), &["--metadata", &fixture("metadata-nogpu.json")]))),
        Vec::<String>::new()
    );

    let missing = host.tmp.path().join("no-such-root");
    let line = plan_error(&["--host-root", arg(&missing)], "");
    assert_eq!(line, format!("error: {}: no such file or directory", missing.display()));
    let file = write_file(host.tmp.path(), "root-file", "");
    let line = plan_error(&["--host-root", arg(&file)], "");
    assert_eq!(line, format!("error: {}: is a regular file; expected a directory", file.display()));

    let line = plan_error(&with(&host.root_args(), &["--spec", &fixture("spec-gpus.json"), "--device-map", "0=2"]), "");
    assert_eq!(
        line,
        "error: --device-map: no checkpoint was given (--metadata), so there are no saved devices to pair"
    );
}

// ---------------------------------------------------------------------------------------------
// The reload log line
// ---------------------------------------------------------------------------------------------

/// Bug (issue 10.9): a reload that changed only a node's mode (or owner) logged
/// `x: 1:3 -> 1:3`; the line now says what changed.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn reload_log_line_says_what_changed() {
    need_fuse();
    let host = FakeHost::new();
    let tmp = TempDir::new().unwrap();
    let spec_of = |mode: u32, uid: u32| {
        json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
               "linux": {"devices": [{"path": "/dev/x", "type": "c", "major": 1, "minor": 3, "fileMode": mode, "uid": uid}]}})
        .to_string()
    };
    let spec = write_file(tmp.path(), "spec.json", spec_of(0o666, 0));
    let d = Daemon::start(&with(&host.root_args(), &["--spec", arg(&spec)]));
    fs::write(&spec, spec_of(0o600, 0)).unwrap();
    d.reload();
    fs::write(&spec, spec_of(0o600, 1000)).unwrap();
    d.reload();
    let log = wait_for("both reload lines", || {
        let log = d.log_text();
        log.contains("reloaded: generation 3 ").then_some(log)
    });
    let line = |generation: u32| {
        log.lines().find(|l| l.contains(&format!("reloaded: generation {generation} "))).unwrap().to_owned()
    };
    assert!(line(2).ends_with(": x: mode 0666 -> 0600"), "{}", line(2));
    assert!(line(3).ends_with(": x: owner 0:0 -> 1000:0"), "{}", line(3));
    assert!(!log.contains("1:3 -> 1:3"), "{log}");
}
