//! `devremapd node --nri` (issue 32) as containerd's NRI plugin: containerd 1.7.24 (Debian 13's
//! package, unpacked by `.ci/containerd-packages`) with NRI enabled on a socket of the test's
//! own, its CRI plugin driven by a CRI client as a kubelet drives it (no runtime handler: the
//! node's default runc), and the node daemon registered with it, with the real handler and a
//! runtime config (`--config`) naming a fake host's `host_root` (GPUs 2 and 3 described) and
//! the node's state dir. A GPU is given to a container as the device plugin gives it: a
//! `Device` whose host path is a char device 195:N the test makes, which containerd stats.
//! The tests pin the transport (registration, the events, Synchronize, reconnecting, never
//! blocking a pod) and, end to end, what the plugin serves: a container's `/dev` as the
//! container sees it (ExecSync), its record in its spec as containerd keeps it (`ctr
//! containers info`), the state dir and `devremapd ctl list`, across the plugin's and
//! containerd's restarts; and a CRI restore, simulated (containerd 2.1's CreateContainer with
//! the checkpoint's annotations, made by the test).

mod common;
#[path = "common/cri.rs"]
mod cri;
#[path = "common/nri.rs"]
mod nri;

use common::clients::wait_client;
use common::daemon::{keepers_under, need_fuse};
use common::{FakeHost, GpuFacts, host_uuid};
use cri::{Containerd, Cri};
use k8s_cri::v1::{ExecSyncRequest, LinuxContainerConfig, LinuxContainerSecurityContext};
use nri::{Plugin, Pod, containerd_with_nri, gpu, registered, sleeper};
use serde_json::{Value, json};
use std::fs;
use std::path::Path;
use tempfile::TempDir;

/// The annotation that asks for a devremap `/dev`, and the one that carries the record.
const ENABLE: &str = "devremap.io/enable";
const GPUS: &str = "devremap.io/gpus";

/// Rule (issue 32): `devremapd node --nri` registers with containerd 1.7.24 as NRI plugin
/// `10-devremap` (both sides say so); a pod's container's CreateContainer, start (with its
/// init's pid), stop and removal each reach the handler, and the pod's sandbox is never created as a container; a node
/// daemon started again while the container runs is told of it at Synchronize; after
/// containerd is restarted, the plugin registers again by itself.
#[test]
#[ignore = "needs root, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn the_plugin_hears_a_containers_life_and_comes_back() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let containerd = containerd_with_nri(dir);
    let plugin = Plugin::start(dir, &host);
    plugin.wait_lines(&registered(dir), 1);
    let containerd_log = || fs::read_to_string(dir.join("containerd.log")).unwrap_or_default();
    wait_client("containerd to log the registration", containerd_log, || {
        containerd_log().contains("registered as \\\"10-devremap\\\"").then_some(())
    });

    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    let pod = Pod::run(&mut cri, dir, "nri-life");
    let id = pod.start_container(&mut cri);
    plugin.wait_lines(&format!("nri: create container {id} (sleeper) in pod default/nri-life"), 1);
    let started = format!("nri: container {id} started (pid ");
    plugin.wait_lines(&started, 1);
    // PostStartContainer carries the container's init, which a handler watches.
    let log = plugin.log();
    let pid = log.lines().find_map(|l| l.split_once(&started)).and_then(|(_, rest)| rest.strip_suffix(')'));
    assert!(pid.is_some_and(|p| p.parse::<u32>().is_ok_and(|p| p > 0)), "{log}");

    drop(plugin);
    let plugin = Plugin::start(dir, &host);
    plugin.wait_lines(&registered(dir), 2);
    plugin.wait_lines(&format!("nri: synchronize: 1 pods, containers [{id}]"), 1);

    Pod::stop_container(&mut cri, &id);
    plugin.wait_lines(&format!("nri: container {id} stopped"), 1);
    Pod::remove_container(&mut cri, &id);
    plugin.wait_lines(&format!("nri: container {id} removed"), 1);
    let sandbox = pod.sandbox.clone();
    pod.remove(&mut cri);
    assert!(!plugin.log().contains(&format!("create container {sandbox}")), "{}", plugin.log());

    drop(cri);
    drop(containerd);
    let _containerd = containerd_with_nri(dir);
    plugin.wait_lines(&registered(dir), 3);
}

/// Rule (issue 32): a plugin that does not answer (SIGSTOPped) never keeps a plain pod from
/// starting beyond NRI's own timeout: containerd drops it, and once woken it registers again
/// by itself; with the plugin gone, pods start as without NRI.
#[test]
#[ignore = "needs root, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn a_stopped_or_gone_plugin_never_blocks_a_pod() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let _containerd = containerd_with_nri(dir);
    let plugin = Plugin::start(dir, &host);
    plugin.wait_lines(&registered(dir), 1);
    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));

    plugin.signal(libc::SIGSTOP);
    let pod = Pod::run(&mut cri, dir, "nri-stopped");
    let id = pod.start_container(&mut cri);
    let containerd_log = fs::read_to_string(dir.join("containerd.log")).unwrap();
    assert!(
        containerd_log.contains("closing plugin 10-devremap, failed to handle CreateContainer request"),
        "containerd did not time the plugin out:\n{containerd_log}"
    );
    plugin.signal(libc::SIGCONT);
    plugin.wait_lines(&registered(dir), 2);
    plugin.wait_lines(&format!("nri: synchronize: 1 pods, containers [{id}]"), 1);
    Pod::stop_container(&mut cri, &id);
    Pod::remove_container(&mut cri, &id);
    pod.remove(&mut cri);

    drop(plugin);
    let pod = Pod::run(&mut cri, dir, "nri-gone");
    let id = pod.start_container(&mut cri);
    Pod::stop_container(&mut cri, &id);
    Pod::remove_container(&mut cri, &id);
    pod.remove(&mut cri);
}

/// Runs `script` with `sh -c` in container `id`, which must succeed; its stdout.
fn exec(cri: &mut Cri, id: &str, script: &str) -> String {
    let r = cri.call("ExecSync", |mut c| {
        let (container_id, cmd) = (id.to_owned(), vec!["sh".into(), "-c".into(), script.to_owned()]);
        async move { c.exec_sync(ExecSyncRequest { container_id, cmd, timeout: 60 }).await }
    });
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.exit_code, 0, "in container {id}: {script}: {stderr}");
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// Container `id`'s `/dev` as it sees it: the type of what is mounted there, and the device
/// numbers (`stat -c %t:%T`, hex) of `names` in it (`missing` for none); what a program does
/// with its `/dev` (write `/dev/null`, list `/dev/pts`, use `/dev/shm`) must work.
fn dev_of(cri: &mut Cri, id: &str, names: &[&str]) -> (String, Vec<String>) {
    let script = format!(
        "awk '$2 == \"/dev\" {{ print $3 }}' /proc/mounts; for n in {}; do stat -c %t:%T /dev/$n 2>/dev/null || \
         echo missing; done; echo x > /dev/null; ls /dev/pts | grep -q ptmx; echo x > /dev/shm/probe; rm /dev/shm/probe",
        names.join(" ")
    );
    let out = exec(cri, id, &script);
    let mut lines = out.lines().map(str::to_owned);
    (lines.next().unwrap_or_default(), lines.collect())
}

/// The annotation `key` of container `id`'s spec as containerd keeps it (what a checkpoint
/// saves), if any.
fn spec_annotation(containerd: &Containerd, id: &str, key: &str) -> Option<String> {
    let info: Value = serde_json::from_str(&containerd.ctr_ok(&["containers", "info", id])).unwrap();
    info["Spec"]["annotations"][key].as_str().map(str::to_owned)
}

/// A containerd with NRI, the plugin registered with it (the runtime config naming `host`'s
/// root), and a CRI client.
fn node_with_plugin(dir: &Path, host: &FakeHost) -> (Containerd, Plugin, Cri) {
    let containerd = containerd_with_nri(dir);
    let plugin = Plugin::start(dir, host);
    plugin.wait_lines(&registered(dir), 1);
    let cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    (containerd, plugin, cri)
}

/// Rule (issue 32): through containerd 1.7.24's CRI plugin with no runtime handler, a pod's
/// container with a GPU among its devices (`/dev/nvidia2`, 195:2) gets a devremap `/dev` (a
/// FUSE mount) holding its GPU and not the host's other one, where `/dev/null`, `/dev/pts` and
/// `/dev/shm` work, and its spec carries its record `devremap.io/gpus` (the host's UUID of GPU
/// 2); a GPU-less container asking by pod annotation or by its own annotation
/// `devremap.io/enable` gets one too; the pods' sandboxes, a plain container and a privileged
/// one with the GPU (every host device: a driver or monitoring agent) get none (no directory,
/// runc's tmpfs `/dev`). StopContainer/RemoveContainer leave no directory, mount,
/// keeper or `ctl list` entry. The plugin SIGKILLed while the GPU pod runs: the container's
/// `/dev` keeps answering (its keeper holds it); a node daemon started again registers, adopts
/// the running one and at Synchronize tears down the one removed meanwhile. containerd
/// restarted while the pod runs: the plugin registers again and the container's `/dev` still
/// answers. At the end nothing is served.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn containers_get_a_devremap_dev_through_plugin_and_containerd_restarts() {
    need_fuse();
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let (mut containerd, mut plugin, mut cri) = node_with_plugin(dir, &host);

    let gpus = Pod::run(&mut cri, dir, "nri-gpu");
    let cuda = gpus.start(&mut cri, sleeper("cuda", vec![gpu(dir, 2)], &[]));
    let served_gpu2 = || ("fuse".to_owned(), vec!["c3:2".to_owned(), "missing".to_owned()]);
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2(), "{}", plugin.log());
    let record = spec_annotation(&containerd, &cuda, GPUS).expect("the GPU container's spec has its record");
    let record: Value = serde_json::from_str(&record).unwrap();
    assert_eq!((record[0]["minor"].as_u64(), record[0]["uuid"].as_str()), (Some(2), Some(host_uuid(2).as_str())));

    let asking = Pod::run_with(&mut cri, dir, "nri-asking", &[(ENABLE, "true")]);
    let by_pod = asking.start(&mut cri, sleeper("tools", vec![], &[]));
    let plain = Pod::run(&mut cri, dir, "nri-plain");
    let by_container = plain.start(&mut cri, sleeper("tools", vec![], &[(ENABLE, "true")]));
    let untouched = plain.start(&mut cri, sleeper("sleeper", vec![], &[]));
    for id in [&by_pod, &by_container] {
        assert_eq!(dev_of(&mut cri, id, &[]).0, "fuse", "container {id}: {}", plugin.log());
    }
    assert_eq!(dev_of(&mut cri, &untouched, &[]).0, "tmpfs");
    assert_eq!(spec_annotation(&containerd, &untouched, GPUS), None);
    // A privileged container (a GPU node's driver or monitoring agent), its GPU among the
    // host's every device: left alone, as its device cgroup allows every device.
    let logs = dir.join("pod-logs").join("nri-privileged");
    fs::create_dir_all(&logs).unwrap();
    let mut config = cri::pod_config("nri-privileged", &format!("nri-privileged-{}", std::process::id()), &logs, &[]);
    config
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .expect("pod_config's security context")
        .privileged = true;
    let sandbox = cri.run_pod_sandbox(&config, "");
    let privileged = Pod { config, sandbox };
    let security_context = Some(LinuxContainerSecurityContext { privileged: true, ..Default::default() });
    let agent = privileged.start(
        &mut cri,
        k8s_cri::v1::ContainerConfig {
            linux: Some(LinuxContainerConfig { security_context, ..Default::default() }),
            ..sleeper("agent", vec![gpu(dir, 2)], &[])
        },
    );
    assert_eq!(dev_of(&mut cri, &agent, &[]).0, "tmpfs", "{}", plugin.log());
    plugin.wait_lines("privileged (its device cgroup allows every device): created without devremap", 1);
    Pod::stop_container(&mut cri, &agent);
    Pod::remove_container(&mut cri, &agent);
    privileged.remove(&mut cri);
    let mut served = vec![cuda.clone(), by_pod.clone(), by_container.clone()];
    served.sort();
    assert_eq!(plugin.served(), served, "only the containers asking have a directory (no sandbox)");
    assert_eq!(plugin.listed(), served);

    Pod::stop_container(&mut cri, &by_container);
    plugin.wait_gone(&by_container);
    Pod::remove_container(&mut cri, &by_container);

    plugin.kill();
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2(), "the keeper serves on");
    Pod::stop_container(&mut cri, &by_pod);
    Pod::remove_container(&mut cri, &by_pod);
    plugin.start_again();
    plugin.wait_lines(&registered(dir), 2);
    plugin.wait_lines(&format!("container {by_pod}: not running in containerd (heard at NRI Synchronize)"), 1);
    plugin.wait_gone(&by_pod);
    assert_eq!((plugin.served(), plugin.listed()), (vec![cuda.clone()], vec![cuda.clone()]));
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2());

    drop(cri);
    containerd.restart();
    plugin.wait_lines(&registered(dir), 3);
    let mut cri = Cri::connect(&dir.join("containerd.sock"), dir.join("containerd.log"));
    assert_eq!(dev_of(&mut cri, &cuda, &["nvidia2", "nvidia3"]), served_gpu2());
    assert_eq!(plugin.served(), vec![cuda.clone()], "a Synchronize after containerd's restart keeps it");

    Pod::stop_container(&mut cri, &cuda);
    Pod::remove_container(&mut cri, &cuda);
    plugin.wait_gone(&cuda);
    for pod in [gpus, asking, plain] {
        pod.remove(&mut cri);
    }
    assert_eq!((plugin.served(), plugin.listed()), (vec![], vec![]));
}

/// Rule (issue 32): a CRI restore, simulated (no registry here ships containerd 2.1, whose CRI
/// restore creates the container with the checkpoint's annotations): a GPU container's record
/// `devremap.io/gpus` taken from its spec as containerd keeps it (what `CheckpointContainer`
/// saves), and CreateContainer made as containerd 2.1 makes it, with that annotation, on a host
/// where the record's GPU (its UUID) is now GPU 3, the container given GPU 3: the container
/// finds its GPU under its old name `nvidia2` (195:3), and its new record names the old name.
/// A hostile record (not a record; naming more GPUs than the container's devices) fails
/// CreateContainer with an error naming the annotation, and leaves no container, directory,
/// mount or keeper.
#[test]
#[ignore = "needs root, /dev/fuse, runc, busybox-static and containerd 1.7 (.ci/containerd-packages)"]
fn a_container_created_with_its_checkpoints_record_is_served_the_remap() {
    need_fuse();
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let host = FakeHost::with_described_gpus(&[2, 3]);
    let (containerd, plugin, mut cri) = node_with_plugin(dir, &host);
    let pod = Pod::run(&mut cri, dir, "nri-restore");
    let before = pod.start(&mut cri, sleeper("cuda", vec![gpu(dir, 2)], &[]));
    let record = spec_annotation(&containerd, &before, GPUS).expect("the GPU container's spec has its record");
    Pod::stop_container(&mut cri, &before);
    Pod::remove_container(&mut cri, &before);
    plugin.wait_gone(&before);

    // The restore host: the checkpoint's GPU is now minor 3, and minor 2 is another GPU.
    host.describe(&GpuFacts { uuid: host_uuid(2), ..GpuFacts::nvidia(3) });
    host.describe(&GpuFacts { uuid: host_uuid(3), ..GpuFacts::nvidia(2) });
    let after = pod.start(&mut cri, sleeper("cuda-restored", vec![gpu(dir, 3)], &[(GPUS, &record)]));
    assert_eq!(
        dev_of(&mut cri, &after, &["nvidia2"]),
        ("fuse".to_owned(), vec!["c3:3".to_owned()]),
        "{}",
        plugin.log()
    );
    let again: Value = serde_json::from_str(&spec_annotation(&containerd, &after, GPUS).unwrap()).unwrap();
    assert_eq!((again[0]["minor"].as_u64(), &again[0]["earlier_minors"]), (Some(3), &json!([2])), "{again}");

    let mut two: Vec<Value> = serde_json::from_str(&record).unwrap();
    let mut other = two[0].clone();
    (other["minor"], other["uuid"]) = (json!(3), json!(host_uuid(3)));
    two.push(other);
    let before_hostile = containerd.ctr_ok(&["containers", "ls", "-q"]);
    for hostile in ["[{\"minor\": true}]".to_owned(), Value::from(two).to_string()] {
        let refused = pod
            .try_create(&mut cri, sleeper("hostile", vec![gpu(dir, 3)], &[(GPUS, &hostile)]))
            .expect_err("a hostile record is refused");
        assert!(refused.message().contains("annotation devremap.io/gpus"), "{hostile}: {refused}");
        assert_eq!(plugin.served(), vec![after.clone()], "{hostile}");
        assert_eq!(containerd.ctr_ok(&["containers", "ls", "-q"]), before_hostile, "{hostile}");
        assert_eq!(plugin.listed(), vec![after.clone()], "{hostile}");
        let processes = keepers_under(&plugin.state_dir());
        assert!(!processes.is_empty(), "the restored container's keeper runs");
        assert_eq!(processes, keepers_under(&plugin.state_dir().join(&after)), "only the restored one's keeper runs");
    }

    Pod::stop_container(&mut cri, &after);
    Pod::remove_container(&mut cri, &after);
    plugin.wait_gone(&after);
    pod.remove(&mut cri);
}
