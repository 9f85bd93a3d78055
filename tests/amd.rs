//! AMD GPUs end to end (issue 22): `devremapd record` and `devremapd plan` on the KFD fixture
//! host roots of `tests/fixtures/amd/` (real topology files of four machines), with specs whose
//! `linux.devices` hold render nodes (char 226:N), as a ROCm container's do.
//!
//! The restored GPUs are the spec's render devices, which need no device nodes; the fixture
//! root gives their KFD identity. A checkpoint is a list `record` wrote on one set of GPUs,
//! restored with a spec holding another.

mod common;

use common::*;
use serde_json::{Value, json};
use std::fs;
use std::path::Path;
use tempfile::TempDir;

const MACHINES: [&str; 4] = ["mi300x-8", "mi300x-cpx", "mi210-2", "radeon-7900xtx-2"];

/// The fixture host root of `machine`.
fn root(machine: &str) -> String {
    fixture(&format!("amd/{machine}"))
}

/// The render minors of `machine`'s GPUs, from its topology files, sorted.
fn render_minors(machine: &str) -> Vec<u32> {
    let nodes = Path::new(&root(machine)).join("sys/class/kfd/kfd/topology/nodes");
    let mut minors: Vec<u32> = fs::read_dir(nodes)
        .unwrap()
        .flatten()
        .filter(|n| fs::read_to_string(n.path().join("gpu_id")).unwrap().trim() != "0")
        .map(|n| {
            let props = fs::read_to_string(n.path().join("properties")).unwrap();
            let line = props.lines().find_map(|l| l.strip_prefix("drm_render_minor ")).unwrap();
            line.parse().unwrap()
        })
        .collect();
    minors.sort_unstable();
    minors
}

/// A spec granting `/dev/kfd` and the render nodes `minors` (fileMode 0660, gid 44, as the
/// `render` group), and NVIDIA GPUs `nvidia`.
fn spec(dir: &Path, name: &str, minors: &[u32], nvidia: &[u32]) -> String {
    let mut devices: Vec<Value> = vec![json!({"path": "/dev/kfd", "type": "c", "major": 235, "minor": 0,
                                               "fileMode": 0o666, "uid": 0, "gid": 0})];
    devices.extend(minors.iter().map(|m| {
        json!({"path": format!("/dev/dri/renderD{m}"), "type": "c", "major": 226, "minor": m,
               "fileMode": 0o660, "uid": 0, "gid": 44})
    }));
    devices.extend(
        nvidia.iter().map(|m| json!({"path": format!("/dev/nvidia{m}"), "type": "c", "major": 195, "minor": m})),
    );
    let spec = json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                      "process": {"cwd": "/", "args": ["sh"], "user": {"uid": 0, "gid": 0}},
                      "linux": {"devices": devices}});
    arg(&write_file(dir, name, spec.to_string())).to_owned()
}

/// `devremapd record` of `spec` on `machine`: the list it wrote. Only an NVIDIA GPU (which
/// the AMD fixtures do not describe) may draw a warning.
fn record(dir: &Path, machine: &str, spec: &str) -> (String, Value) {
    record_to(dir, "gpus.json", machine, spec, &[])
}

/// `devremapd record` of `spec` on `machine` with `extra` arguments, into `dir/name`.
fn record_to(dir: &Path, name: &str, machine: &str, spec: &str, extra: &[&str]) -> (String, Value) {
    let out = dir.join(name);
    let root = root(machine);
    let args = join(&["record", "--spec", spec, "--host-root", &root, "--output", arg(&out)], extra);
    let (code, stdout, stderr) = devremapd(&args);
    assert_eq!((code, stdout.as_str()), (0, ""), "record on {machine}: {stderr}");
    assert!(stderr.lines().all(|l| !l.contains("WARN") || l.contains("GPU nvidia")), "record on {machine}: {stderr}");
    let list = serde_json::from_str(&fs::read_to_string(&out).unwrap()).unwrap();
    (arg(&out).to_owned(), list)
}

/// The `amdgpu.remap` entries as `(name, new_name, by, served)`.
fn amd_remap(plan: &Value) -> Vec<(String, String, String, bool)> {
    let s = |v: &Value| v.as_str().unwrap().to_owned();
    plan["amdgpu"]["remap"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (s(&e["name"]), s(&e["new_name"]), s(&e["by"]), e["served"].as_bool().unwrap()))
        .collect()
}

/// The node at `path` in a plan's JSON.
fn node<'a>(plan: &'a Value, path: &str) -> Option<&'a Value> {
    plan["nodes"].as_array().unwrap().iter().find(|n| n["path"] == path)
}

/// Rule (issue 22): on every fixture machine, `record` writes one `"kind": "amdgpu"` item per
/// spec render node with the plugin's identity (gpu_id, node, properties, links) and the
/// node's mode and owner, and `plan --metadata` of it on the same host leads every render name
/// to itself, by the plugin's choice, with no warning; `/dev/kfd` and the render nodes carry
/// the spec's numbers, mode and owner.
#[test]
fn record_and_plan_on_every_fixture_is_the_identity() {
    for machine in MACHINES {
        let tmp = TempDir::new().unwrap();
        let minors = render_minors(machine);
        let spec = spec(tmp.path(), "config.json", &minors, &[]);
        let (list, items) = record(tmp.path(), machine, &spec);
        let items = items.as_array().unwrap();
        assert_eq!(items.len(), minors.len(), "{machine}");
        for item in items {
            assert_eq!((&item["kind"], &item["mode"], &item["gid"]), (&json!("amdgpu"), &json!(0o660), &json!(44)));
            assert_eq!(item["properties"]["drm_render_minor"], item["minor"], "{machine}: {item}");
            assert!(item["gpu_id"].as_u64().unwrap() > 0 && item["properties"]["vendor_id"] == 4098, "{item}");
        }
        let plan = plan_json(&["--metadata", &list, "--spec", &spec, "--host-root", &root(machine)]);
        let want: Vec<_> = minors
            .iter()
            .map(|m| (format!("dri/renderD{m}"), format!("dri/renderD{m}"), "plugin".to_owned(), true))
            .collect();
        assert_eq!(amd_remap(&plan), want, "{machine}");
        assert_eq!(plan["warnings"], json!([]), "{machine}");
        assert_eq!(plan["amdgpu"]["refusal"], Value::Null);
        for m in &minors {
            let n = node(&plan, &format!("dri/renderD{m}")).unwrap();
            assert_eq!(
                (&n["major"], &n["minor"], &n["mode"], &n["gid"]),
                (&json!(226), &json!(m), &json!(0o660), &json!(44))
            );
        }
        assert_eq!(node(&plan, "kfd").unwrap()["major"], 235);
        assert!(plan["checks"].as_array().unwrap().iter().all(|c| c["ok"] == true), "{machine}: {}", plan["checks"]);
    }
}

/// Bug (CRIU #2723): a container checkpointed with the MI300X at renderD144 and restored with
/// the one at renderD136 reopens `/dev/dri/renderD144`: that name leads to the GPU the plugin
/// restores onto (226:136), and the plan's table says so.
#[test]
fn a_saved_render_name_leads_to_the_gpu_the_plugin_chooses() {
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "mi300x-8", &spec(tmp.path(), "saved.json", &[144], &[]));
    let restored = spec(tmp.path(), "restored.json", &[136], &[]);
    let args = ["--metadata", list.as_str(), "--spec", restored.as_str(), "--host-root", &root("mi300x-8")];
    let plan = plan_json(&args);
    assert_eq!(amd_remap(&plan), vec![("dri/renderD144".into(), "dri/renderD136".into(), "plugin".into(), true)]);
    let n = node(&plan, "dri/renderD144").unwrap();
    assert_eq!((&n["major"], &n["minor"], &n["mode"]), (&json!(226), &json!(136), &json!(0o660)));
    assert!(node(&plan, "dri/renderD136").is_some());
    let (code, text, _) = plan_cmd(&args);
    assert_eq!(code, 0);
    assert!(text.contains("amdgpu remap (1 saved GPUs):"), "{text}");
    assert!(text.contains("dri/renderD144  dri/renderD136 (226:136)  plugin  served"), "{text}");
    assert!(!text.contains("remap: none"), "{text}");
}

fn plan_cmd(args: &[&str]) -> (i32, String, String) {
    plan(args)
}

/// `base` and then `extra`.
fn join<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

/// Rule (issue 22, the plugin's KFD_NUMA_CHECK): two GPUs of one socket restored onto two of
/// different sockets: the plugin will refuse, and the plan says so and pairs by position.
#[test]
fn a_refused_restore_is_said_and_paired_by_position() {
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "mi300x-8", &spec(tmp.path(), "saved.json", &[128, 136], &[]));
    let restored = spec(tmp.path(), "restored.json", &[144, 160], &[]);
    let plan = plan_json(&["--metadata", &list, "--spec", &restored, "--host-root", &root("mi300x-8")]);
    assert!(plan["amdgpu"]["refusal"].is_string(), "{}", plan["amdgpu"]);
    assert!(amd_remap(&plan).iter().all(|e| e.2 == "position"), "{:?}", amd_remap(&plan));
    let w = plan["warnings"].to_string();
    assert!(w.contains("CRIU's amdgpu plugin will refuse this restore"), "{w}");
}

/// Rule (issue 22): `--device-map renderDOLD=renderDNEW` wins over the plugin's choice, with a
/// warning that the plugin restores elsewhere; a render node paired with an NVIDIA minor, or a
/// render node that is no saved GPU, is refused naming the flag.
#[test]
fn device_map_pairs_render_nodes() {
    let tmp = TempDir::new().unwrap();
    let minors = render_minors("mi210-2");
    let spec = spec(tmp.path(), "config.json", &minors, &[]);
    let (list, _) = record(tmp.path(), "mi210-2", &spec);
    let base = ["--metadata", list.as_str(), "--spec", spec.as_str(), "--host-root", &root("mi210-2")];
    let plan = plan_json(&join(&base, &["--device-map", "renderD128=renderD129"]));
    let remap = amd_remap(&plan);
    assert_eq!((remap[0].1.as_str(), remap[0].2.as_str()), ("dri/renderD129", "explicit"), "{remap:?}");
    assert!(plan["warnings"].to_string().contains("--device-map leads it to renderD129"), "{}", plan["warnings"]);
    plan_error(&join(&base, &["--device-map", "renderD128=1"]), "a render node pairs only with a render node");
    plan_error(
        &join(&base, &["--device-map", "renderD130=renderD128"]),
        "error: --device-map: renderD130 is no saved AMD GPU",
    );
    plan_error(&join(&base, &["--device-map", "renderD12=renderD128"]), "--device-map");
}

/// Rule (issue 22, the `model` check's AMD side): an MI210 checkpoint onto a Radeon host is
/// refused, naming the differing KFD property; relaxed, it is served by position with warnings.
#[test]
fn another_model_is_refused_unless_relaxed() {
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "mi210-2", &spec(tmp.path(), "saved.json", &[128, 129], &[]));
    let restored = spec(tmp.path(), "restored.json", &[128, 129], &[]);
    let base = ["--metadata", list.as_str(), "--spec", restored.as_str(), "--host-root", &root("radeon-7900xtx-2")];
    let line = plan_error(
        &base,
        "model: amdgpu: saved renderD128 is not restored renderD128: another product: 0x740f (Instinct MI210, gfx90a) \
         vs 0x744c (Radeon RX 7900 XT/7900 XTX, gfx1100); simd_count",
    );
    assert!(line.contains(&list), "{line}");
    let plan = plan_json(&join(&base, &["--relax", "model,driver"]));
    assert!(amd_remap(&plan).iter().all(|e| e.2 == "position"));
    assert!(plan["warnings"].to_string().contains("check model relaxed"), "{}", plan["warnings"]);
}

/// Rule (issue 33, AMD count): CRIU's amdgpu plugin refuses a restore onto more GPUs than were
/// saved ("Number of devices mismatch (checkpointed:2 local:3)"), so the dry run refuses it too,
/// naming the plugin's words; onto as many it plans.
#[test]
fn two_saved_amd_gpus_onto_three_are_refused_as_criu_does() {
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "mi300x-8", &spec(tmp.path(), "saved.json", &[128, 136], &[]));
    let three = spec(tmp.path(), "three.json", &[144, 152, 160], &[]);
    let line = plan_error(
        &["--metadata", &list, "--spec", &three, "--host-root", &root("mi300x-8")],
        "count: amdgpu: can't remap 2 saved AMD GPUs to 3 restored: CRIU's amdgpu plugin needs as many on each side \
         (Number of devices mismatch (checkpointed:2 local:3))",
    );
    assert!(line.contains(&list), "{line}");
    let two = spec(tmp.path(), "two.json", &[144, 152], &[]);
    plan_json(&["--metadata", &list, "--spec", &two, "--host-root", &root("mi300x-8")]);
}

/// Rule (issue 33, AMD model): an MI300X checkpoint planned onto an MI210 host names the two
/// products (device ids, `pci.ids` names, ISAs) before the first property that differs.
#[test]
fn an_mi300x_onto_an_mi210_names_both_products() {
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "mi300x-8", &spec(tmp.path(), "saved.json", &[128], &[]));
    let restored = spec(tmp.path(), "restored.json", &[128], &[]);
    plan_error(
        &["--metadata", &list, "--spec", &restored, "--host-root", &root("mi210-2")],
        "model: amdgpu: saved renderD128 is not restored renderD128: another product: 0x74a1 (Instinct MI300X, \
         gfx942) vs 0x740f (Instinct MI210, gfx90a); simd_count 1216 vs 416",
    );
}

/// Rule (issue 22): a container with NVIDIA and AMD GPUs records both kinds in one list, and
/// each family pairs on its own rules: the NVIDIA item has no kind, the AMD one is paired by the
/// plugin's rule, and both tables show.
#[test]
fn mixed_nvidia_and_amd() {
    let tmp = TempDir::new().unwrap();
    let spec = spec(tmp.path(), "config.json", &[129], &[0]);
    let (list, items) = record(tmp.path(), "mi210-2", &spec);
    assert_eq!((items[0]["minor"].clone(), items[0].get("kind")), (json!(0), None), "{items}");
    assert_eq!((&items[1]["minor"], &items[1]["kind"]), (&json!(129), &json!("amdgpu")));
    let plan = plan_json(&["--metadata", &list, "--spec", &spec, "--host-root", &root("mi210-2")]);
    assert_eq!(plan["remap"][0]["name"], "nvidia0");
    assert_eq!(amd_remap(&plan), vec![("dri/renderD129".into(), "dri/renderD129".into(), "plugin".into(), true)]);
    let count = plan["checks"].as_array().unwrap().iter().find(|c| c["check"] == "count").unwrap().clone();
    assert_eq!(count["detail"], "1 saved GPUs, 1 restored; amdgpu: 1 saved AMD GPUs, 1 restored", "{count}");
}

/// Rule (issue 22, security): a checkpoint's AMD item may keep the mode its node had, never
/// widen it: a recorded 0666 onto a 0660 render node fails the `mode` check.
#[test]
fn a_recorded_mode_never_widens_a_render_node() {
    let tmp = TempDir::new().unwrap();
    let item = json!([{"kind": "amdgpu", "minor": 128, "mode": 0o666, "uid": 0, "gid": 0}]);
    let list = write_file(tmp.path(), "gpus.json", item.to_string());
    let spec = spec(tmp.path(), "config.json", &[128], &[]);
    let line =
        plan_error(&["--metadata", arg(&list), "--spec", &spec, "--host-root", &root("mi210-2")], "mode: amdgpu:");
    assert!(line.contains("saved renderD128 was recorded 0666 0:0"), "{line}");
}

/// Rule (issue 22): an item without KFD properties (a record made without the topology) is
/// paired by position, and the plan says devremap cannot know the plugin's choice.
#[test]
fn an_unknown_identity_is_said() {
    let tmp = TempDir::new().unwrap();
    let list = write_file(tmp.path(), "gpus.json", json!([{"kind": "amdgpu", "minor": 128}]).to_string());
    let spec = spec(tmp.path(), "config.json", &[129], &[]);
    let plan = plan_json(&["--metadata", arg(&list), "--spec", &spec, "--host-root", &root("mi210-2")]);
    assert_eq!(amd_remap(&plan), vec![("dri/renderD128".into(), "dri/renderD129".into(), "position".into(), true)]);
    let w = plan["warnings"].to_string();
    assert!(w.contains("devremap cannot know which GPU CRIU's amdgpu plugin restores it onto"), "{w}");
}

/// Rule (issue 22): bad AMD items are refused with the file named, in one line, never echoing
/// the value; an unknown `kind` is refused too (an NVIDIA item has none).
#[test]
fn bad_amd_items_are_refused_naming_the_file() {
    let tmp = TempDir::new().unwrap();
    let long = "y".repeat(300);
    let cases = [
        (json!([{"kind": "amdgpu"}]), "nvproxy-device-remap-ids[0] (amdgpu): minor: expected the render minor"),
        (json!([{"kind": "amdgpu", "minor": 12}]), "minor 12 is under 128"),
        (json!([{"kind": "amdgpu", "minor": 128}, {"kind": "amdgpu", "minor": 128}]), "render minor 128 appears twice"),
        (
            json!([{"kind": "amdgpu", "minor": 128, "properties": {"device_id": long}}]),
            "properties.device_id: expected",
        ),
        (json!([{"kind": "amdgpu", "minor": 128, "mode": 0o4666}]), "bits beyond the permission"),
        (json!([{"kind": long, "minor": 128}]), "[0].kind: expected \"amdgpu\""),
        (json!([{"kind": 7, "minor": 0}]), "found 7"),
    ];
    for (i, (list, want)) in cases.iter().enumerate() {
        let file = write_file(tmp.path(), &format!("bad{i}.json"), list.to_string());
        let line = plan_error(&["--metadata", arg(&file), "--host-root", &root("mi210-2")], want);
        assert!(line.contains(arg(&file)) && !line.contains(&long), "{line}");
    }
}

/// Rule (issue 22): a host root whose KFD topology cannot be read is a warning naming the file
/// (the AMD GPUs' facts are unknown), not a refusal of NVIDIA's plan.
#[test]
fn a_bad_topology_is_a_warning_naming_the_file() {
    let tmp = TempDir::new().unwrap();
    let props = tmp.path().join("sys/class/kfd/kfd/topology/nodes/1");
    fs::create_dir_all(&props).unwrap();
    fs::write(props.join("gpu_id"), "7\n").unwrap();
    fs::write(props.join("properties"), "not a property line\n").unwrap();
    fs::write(props.join("name"), "x\n").unwrap();
    let plan = plan_json(&["--host-root", arg(tmp.path())]);
    let w = plan["warnings"].to_string();
    assert!(w.contains("sys/class/kfd/kfd/topology/nodes/1/properties: line 1"), "{w}");
    assert!(plan.get("amdgpu").is_none());
}

/// Rule (issue 22): a device directory's `dri/renderD<N>` nodes are the restored GPUs when no
/// spec is given, served with their `lstat`ed numbers (fake GPUs: real char devices), and
/// `kfd` passes through with whatever number the host gives it, read again at every load; a
/// checkpoint's render name leads to the plugin's choice among them; a `renderD` name that is
/// not a char device is refused, naming it.
#[test]
#[ignore = "needs root (makes device nodes)"]
fn a_device_directory_gives_render_nodes_and_kfd() {
    need_root();
    let tmp = TempDir::new().unwrap();
    let dev = tmp.path().join("dev");
    fs::create_dir_all(dev.join("dri")).unwrap();
    mknod_char(&dev.join("dri/renderD128"), (1, 5), 0o660);
    mknod_char(&dev.join("dri/renderD129"), (1, 7), 0o660);
    mknod_char(&dev.join("kfd"), (511, 0), 0o666);
    for m in [128, 129] {
        std::os::unix::fs::chown(dev.join(format!("dri/renderD{m}")), Some(0), Some(44)).unwrap();
    }
    let (list, _) = record(tmp.path(), "mi210-2", &spec(tmp.path(), "saved.json", &[128, 129], &[]));
    let base = ["--metadata", list.as_str(), "--host-dev", arg(&dev), "--host-root", &root("mi210-2")];
    let plan = plan_json(&base);
    let at = |p: &str| node(&plan, p).map(|n| (n["major"].clone(), n["minor"].clone()));
    assert_eq!(at("kfd"), Some((json!(511), json!(0))));
    assert_eq!(at("dri/renderD128"), Some((json!(1), json!(5))));
    // The plugin pairs each with itself: every restored GPU here was saved.
    let remap = amd_remap(&plan);
    assert!(remap.iter().all(|e| e.0 == e.1 && e.2 == "plugin" && e.3), "{remap:?}");
    assert_eq!(at("dri/renderD129"), Some((json!(1), json!(7))));
    // kfd's number is read again: a new major shows in the next plan.
    fs::remove_file(dev.join("kfd")).unwrap();
    mknod_char(&dev.join("kfd"), (510, 0), 0o666);
    assert_eq!(node(&plan_json(&base), "kfd").unwrap()["major"], 510);
    fs::remove_file(dev.join("dri/renderD128")).unwrap();
    std::os::unix::fs::symlink("/dev/null", dev.join("dri/renderD128")).unwrap();
    plan_error(&base, "dri/renderD128: is a symlink, not a char device; refused");
}

/// Bug (CRIU #2723) on a live mount: the checkpoint's `/dev/dri/renderD144` reaches the device
/// of the GPU the plugin restores onto (here the fake `renderD136`, a real char device), with
/// the spec's mode and owner, next to `/dev/kfd`; the state file carries the AMD pair.
#[test]
#[ignore = "needs root and /dev/fuse: mounts a FUSE filesystem"]
fn live_mount_leads_the_saved_render_name_to_the_paired_gpu() {
    common::daemon::need_fuse();
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "mi300x-8", &spec(tmp.path(), "saved.json", &[144], &[]));
    let dev = tmp.path().join("dev");
    fs::create_dir_all(dev.join("dri")).unwrap();
    mknod_char(&dev.join("dri/renderD136"), (1, 7), 0o660);
    mknod_char(&dev.join("kfd"), (1, 5), 0o666);
    let restored = spec(tmp.path(), "restored.json", &[136], &[]);
    let d = common::daemon::Daemon::start(&[
        "--metadata",
        &list,
        "--spec",
        &restored,
        "--host-dev",
        arg(&dev),
        "--host-root",
        &root("mi300x-8"),
    ]);
    use std::os::unix::fs::MetadataExt;
    let saved = fs::metadata(d.path("dri/renderD144")).unwrap();
    assert_eq!((saved.rdev(), saved.mode(), saved.gid()), (libc::makedev(1, 7), 0o20660, 44));
    assert_eq!(fs::metadata(d.path("kfd")).unwrap().rdev(), libc::makedev(1, 5));
    // The fake GPU is /dev/full: a write through the checkpoint name reaches it.
    let err = fs::write(d.path("dri/renderD144"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    let state = d.state();
    assert_eq!(state["amdgpu"]["remap"][0]["new_name"], "dri/renderD136", "{}", state["amdgpu"]);
    assert_eq!(state["amdgpu"]["remap"][0]["by"], "plugin");
    d.stop();
}

/// Three MI300X hosts: checkpointed on A with the GPU at renderD144, restored on B onto
/// renderD136 and checkpointed there with the metadata it was restored with (as
/// `devremap-runtime checkpoint` records a restored container), the list given to C, whose
/// spec gives renderD128. Returns B's list and C's spec.
fn migrated_twice(dir: &Path) -> (String, String) {
    let (on_a, items) = record(dir, "mi300x-8", &spec(dir, "a.json", &[144], &[]));
    assert!(items[0].get("earlier_minors").is_none(), "recorded without --metadata: {}", items[0]);
    let b = spec(dir, "b.json", &[136], &[]);
    let (on_b, items) = record_to(dir, "b-gpus.json", "mi300x-8", &b, &["--metadata", &on_a]);
    assert_eq!((&items[0]["minor"], &items[0]["earlier_minors"]), (&json!(136), &json!([144])), "{}", items[0]);
    (on_b, spec(dir, "c.json", &[128], &[]))
}

/// Rule (issue 22, repeated migrations, as issue 20 for NVIDIA): a process migrated twice may
/// hold A's render name (renderD144, the name it was given on A) and B's (renderD136): on C both
/// lead to the GPU the plugin restores onto, with the saved mode and owner; the plan lists the
/// earlier name. Recorded on B without the earlier metadata, A's name is lost on C. A record on
/// C carries both names on.
#[test]
fn three_host_migration_keeps_every_render_name() {
    let tmp = TempDir::new().unwrap();
    let (on_b, c) = migrated_twice(tmp.path());
    let args = ["--metadata", on_b.as_str(), "--spec", c.as_str(), "--host-root", &root("mi300x-8")];
    let plan = plan_json(&args);
    assert_eq!(amd_remap(&plan), vec![("dri/renderD136".into(), "dri/renderD128".into(), "plugin".into(), true)]);
    assert_eq!(plan["amdgpu"]["remap"][0]["earlier_names"], json!([{"name": "dri/renderD144", "served": true}]));
    for name in ["dri/renderD128", "dri/renderD136", "dri/renderD144"] {
        let n = node(&plan, name).unwrap_or_else(|| panic!("{name} is not served: {plan}"));
        assert_eq!(
            (&n["major"], &n["minor"], &n["mode"], &n["gid"]),
            (&json!(226), &json!(128), &json!(0o660), &json!(44))
        );
    }
    assert_eq!(plan["warnings"], json!([]));
    let (code, text, _) = plan_cmd(&args);
    assert_eq!(code, 0);
    assert!(
        text.contains("dri/renderD144  dri/renderD128 (226:128)  plugin  served (an earlier name of dri/renderD136)"),
        "{text}"
    );
    // Recorded on B without the earlier metadata: only B's name reaches C.
    let (forgot, _) = record(tmp.path(), "mi300x-8", &spec(tmp.path(), "b2.json", &[136], &[]));
    let plan = plan_json(&["--metadata", &forgot, "--spec", &c, "--host-root", &root("mi300x-8")]);
    assert!(node(&plan, "dri/renderD144").is_none() && node(&plan, "dri/renderD136").is_some(), "{plan}");
    // The chain goes on: C's record carries both.
    let (_, items) = record_to(tmp.path(), "c-gpus.json", "mi300x-8", &c, &["--metadata", &on_b]);
    assert_eq!((&items[0]["minor"], &items[0]["earlier_minors"]), (&json!(128), &json!([136, 144])));
}

/// Rule (issue 22, repeated migrations) on a live mount: after two migrations, A's render name,
/// B's and C's own all open C's GPU (the fake renderD128, `/dev/full`).
#[test]
#[ignore = "needs root and /dev/fuse: mounts a FUSE filesystem"]
fn live_mount_after_two_migrations_serves_every_render_name() {
    common::daemon::need_fuse();
    let tmp = TempDir::new().unwrap();
    let (on_b, c) = migrated_twice(tmp.path());
    let dev = tmp.path().join("dev");
    fs::create_dir_all(dev.join("dri")).unwrap();
    mknod_char(&dev.join("dri/renderD128"), (1, 7), 0o660);
    let d = common::daemon::Daemon::start(&[
        "--metadata",
        &on_b,
        "--spec",
        &c,
        "--host-dev",
        arg(&dev),
        "--host-root",
        &root("mi300x-8"),
    ]);
    for name in ["dri/renderD128", "dri/renderD136", "dri/renderD144"] {
        // /dev/full: a write through any of the names reaches it.
        let err = fs::write(d.path(name), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{name}: {err}");
    }
    d.stop();
}

/// Rule (issue 22, CRIU's `KFD_*_CHECK` variables): the plan honours the plugin's switches
/// from its own environment, as the plugin reads CRIU's: the Radeon with the newer firmware
/// (renderD128) restored onto the older one (renderD129) fails `driver` with the checks on;
/// with `KFD_FW_VER_CHECK=0` and `KFD_SDMA_FW_VER_CHECK=no` the plugin accepts it, and so does
/// the plan, pairing by the plugin's choice; a value the plugin ignores (`off`) keeps the
/// check on, with a warning naming it.
#[test]
fn the_plugins_check_variables_relax_the_plan_as_they_relax_the_plugin() {
    let tmp = TempDir::new().unwrap();
    let (list, _) = record(tmp.path(), "radeon-7900xtx-2", &spec(tmp.path(), "saved.json", &[128], &[]));
    let restored = spec(tmp.path(), "restored.json", &[129], &[]);
    let radeon = root("radeon-7900xtx-2");
    let base = ["--metadata", list.as_str(), "--spec", restored.as_str(), "--host-root", radeon.as_str()];
    plan_error(&base, "driver: amdgpu: saved renderD128 was on fw_version 2150, newer (2140)");
    // `devremapd plan --json <base> <extra>` under `env`: status, stdout, stderr.
    let plan_with = |extra: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(BIN)
            .args(join(&join(&["plan", "--json"], &base), extra))
            .envs(env.iter().copied())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
    };
    let (code, stdout, stderr) = plan_with(&[], &[("KFD_FW_VER_CHECK", "0"), ("KFD_SDMA_FW_VER_CHECK", "no")]);
    assert_eq!(code, Some(0), "{stderr}");
    let plan: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(amd_remap(&plan), vec![("dri/renderD128".into(), "dri/renderD129".into(), "plugin".into(), true)]);
    let driver = plan["checks"].as_array().unwrap().iter().find(|c| c["check"] == "driver").unwrap().clone();
    assert_eq!(
        driver["detail"],
        "amdgpu: 1 pairs compared, KFD_FW_VER_CHECK and KFD_SDMA_FW_VER_CHECK off as for the plugin"
    );
    let ignored = [("KFD_FW_VER_CHECK", "off"), ("KFD_SDMA_FW_VER_CHECK", "0")];
    let (code, _, stderr) = plan_with(&[], &ignored);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("driver: amdgpu: saved renderD128 was on fw_version 2150"), "{stderr}");
    let (_, stdout, _) = plan_with(&["--relax", "driver"], &ignored);
    let plan: Value = serde_json::from_str(&stdout).unwrap();
    let said =
        plan["warnings"].as_array().unwrap().iter().any(|w| {
            w.as_str().unwrap().starts_with("KFD_FW_VER_CHECK=\"off\": CRIU's amdgpu plugin ignores this value")
        });
    assert!(said, "{}", plan["warnings"]);
}

/// A way to break a topology: its name, what it does to the nodes directory, and what the
/// error says after the nodes directory.
type Break = (&'static str, fn(&Path), &'static str);

/// Bug (attack F5): `record` on a host root whose KFD topology cannot be read (a duplicate
/// gpu_id, a properties file that is a symlink to /dev/zero or a FIFO) refused a GPU the spec
/// gives only with a warning claiming the topology lacked it, recording it without its identity,
/// exit 0. It is now refused, exit 1, nothing written, the error naming the file; a spec
/// without AMD GPUs is recorded with the topology's warning, as `plan` gives it. And (attack F6)
/// `plan`'s pairing warning says the topology could not be read, not that it has no GPU.
#[test]
fn record_refuses_a_gpu_an_unreadable_topology_hides() {
    let tmp = TempDir::new().unwrap();
    let spec144 = spec(tmp.path(), "amd-144.json", &[144], &[]);
    let nvidia = spec(tmp.path(), "nvidia.json", &[], &[0]);
    let (saved, _) = record(tmp.path(), "mi300x-8", &spec144);
    let nodes = "sys/class/kfd/kfd/topology/nodes";
    let breaks: [Break; 3] = [
        ("dup", |n| fs::write(n.join("3/gpu_id"), "53538\n").unwrap(), ": nodes 3 and 2 have one gpu_id, 53538"),
        (
            "zero",
            |n| {
                fs::remove_file(n.join("2/properties")).unwrap();
                std::os::unix::fs::symlink("/dev/zero", n.join("2/properties")).unwrap();
            },
            "/2/properties: ",
        ),
        (
            "fifo",
            |n| {
                fs::remove_file(n.join("2/properties")).unwrap();
                let path = std::ffi::CString::new(arg(&n.join("2/properties"))).unwrap();
                assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o644) }, 0);
            },
            "/2/properties: ",
        ),
    ];
    // Each way to break it, and what the error says after the nodes directory.
    for (name, break_it, file) in breaks {
        let host = tmp.path().join(name);
        let copied = std::process::Command::new("cp").arg("-r").arg(root("mi300x-8")).arg(&host).status().unwrap();
        assert!(copied.success());
        break_it(&host.join(nodes));
        let named = format!("{}/{nodes}{file}", arg(&host));
        let out = tmp.path().join(format!("{name}.json"));
        let args = ["record", "--spec", &spec144, "--host-root", arg(&host), "--output", arg(&out)];
        let (code, stdout, stderr) = devremapd(&args);
        assert_eq!((code, stdout.as_str()), (1, ""), "{name}: {stderr}");
        let line = stderr.lines().last().unwrap();
        assert!(line.starts_with("error: ") && line.contains(&named), "{name}: {stderr}");
        assert!(line.contains("GPU dri/renderD144 cannot be recorded with its KFD identity"), "{name}: {line}");
        assert!(!stderr.contains("has no GPU"), "{name}: {stderr}");
        assert!(!out.exists(), "{name}: a refused record is not written");
        // No AMD GPU to lose: recorded, with plan's warning naming the file.
        let args = ["record", "--spec", &nvidia, "--host-root", arg(&host), "--output", arg(&out)];
        let (code, _, stderr) = devremapd(&args);
        assert_eq!(code, 0, "{name}: {stderr}");
        assert!(stderr.contains(&named) && stderr.contains("the AMD GPUs' KFD facts are unknown"), "{name}: {stderr}");
        // F6: the plan's pairing warning says why the identity is unknown.
        let plan = plan_json(&["--metadata", &saved, "--spec", &spec144, "--host-root", arg(&host)]);
        let w = plan["warnings"].to_string();
        assert!(w.contains(&named), "{name}: {w}");
        assert!(
            w.contains("KFD topology could not be read, as warned: renderD144's identity is unknown"),
            "{name}: {w}"
        );
        assert!(!w.contains("has no GPU"), "{name}: {w}");
    }
}
