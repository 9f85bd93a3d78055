use super::*;
use crate::nri::view::Device;
use crate::runtime::annotations::{DEVICE_MAP, ENABLE, RELAX, every_key, launcher_default};

const DEV: &str = "/run/devremap/ctr/dev";

fn gpu(minor: i64) -> Device {
    Device {
        path: format!("/dev/nvidia{minor}"),
        kind: "c".into(),
        major: 195,
        minor,
        file_mode: Some(0o666),
        uid: Some(0),
        gid: Some(0),
    }
}

fn mount(destination: &str, kind: &str, source: &str, options: &[&str]) -> Mount {
    Mount {
        destination: destination.into(),
        kind: kind.into(),
        source: source.into(),
        options: options.iter().map(|o| (*o).to_owned()).collect(),
    }
}

/// A container as containerd 1.7's CRI plugin describes it: its default mounts (`/dev` a
/// tmpfs, then what goes under it), the kubelet's bind mounts, and `devices`.
fn container(devices: Vec<Device>, annotations: &[(&str, &str)]) -> Container {
    Container {
        id: "ctr".into(),
        pod_sandbox_id: "pod".into(),
        name: "cuda".into(),
        annotations: annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        args: vec!["sleep".into(), "inf".into()],
        env: vec!["PATH=/bin".into()],
        mounts: vec![
            mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"]),
            mount("/dev", "tmpfs", "tmpfs", &["nosuid", "strictatime", "mode=755", "size=65536k"]),
            mount("/dev/pts", "devpts", "devpts", &["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]),
            mount("/dev/mqueue", "mqueue", "mqueue", &["nosuid", "noexec", "nodev"]),
            mount("/sys", "sysfs", "sysfs", &["nosuid", "noexec", "nodev", "ro"]),
            mount("/etc/hosts", "bind", "/var/lib/kubelet/pods/x/etc-hosts", &["rbind", "rprivate", "rw"]),
            mount("/dev/termination-log", "bind", "/var/lib/kubelet/pods/x/termination", &["rbind", "rw"]),
            mount("/dev/shm", "bind", "/run/containerd/sandboxes/pod/shm", &["rbind", "ro"]),
        ],
        devices,
        ..Container::default()
    }
}

fn pod(annotations: &[(&str, &str)]) -> Pod {
    Pod {
        id: "pod".into(),
        annotations: annotations.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        ..Pod::default()
    }
}

fn served(pod: &Pod, c: &Container) -> bool {
    matches!(decide(pod, c, &launcher_default(), DEV).unwrap(), Decision::Serve(_))
}

fn serve(pod: &Pod, c: &Container, allowed: &[String]) -> Served {
    match decide(pod, c, allowed, DEV).unwrap() {
        Decision::Serve(s) => *s,
        other => panic!("not served: {other:?}"),
    }
}

/// A record as `devremapd record` writes it, of GPU `minor`.
fn record(minor: u32) -> String {
    json!([{"minor": minor, "uuid": format!("GPU-00000000-0000-0000-0000-{minor:012}")}]).to_string()
}

/// Rule (issue 32): as the wrapper decides, devremap is used when the spec lists NVIDIA GPUs in
/// `linux.devices` or when `devremap.io/enable` says so; a container without either is left
/// alone.
#[test]
fn gpus_or_the_annotation_ask() {
    assert!(served(&pod(&[]), &container(vec![gpu(1)], &[])));
    assert!(!served(&pod(&[]), &container(vec![], &[])));
    assert!(served(&pod(&[]), &container(vec![], &[(ENABLE, "true")])));
    assert!(!served(&pod(&[]), &container(vec![gpu(1)], &[(ENABLE, "false")])));
}

/// Rule (issue 32): `devremap.io/enable` on the pod asks for each of its containers, and a
/// container's own annotation wins over the pod's, key by key.
#[test]
fn the_container_wins_over_the_pod() {
    let plain = container(vec![], &[]);
    assert!(served(&pod(&[(ENABLE, "true")]), &plain));
    assert!(!served(&pod(&[(ENABLE, "true")]), &container(vec![], &[(ENABLE, "false")])));
    assert!(!served(&pod(&[(ENABLE, "false")]), &container(vec![gpu(0)], &[])));
    assert!(served(&pod(&[(ENABLE, "false")]), &container(vec![gpu(0)], &[(ENABLE, "true")])));
    // The pod's other keys reach the container too, unless it sets them.
    let s = serve(&pod(&[(DEVICE_MAP, "0=1")]), &container(vec![gpu(1)], &[]), &launcher_default());
    assert_eq!(s.request.daemon_args(), ["--device-map", "0=1"]);
    let s = serve(&pod(&[(DEVICE_MAP, "0=1")]), &container(vec![gpu(1)], &[(DEVICE_MAP, "2=1")]), &every_key());
    assert_eq!(s.request.daemon_args(), ["--device-map", "2=1"]);
    // Someone else's pod annotations are not the container's.
    let merged = merged_annotations(&pod(&[("team", "a")]), &plain).unwrap();
    assert!(!merged.contains_key("team"));
}

/// Rule (issue 32): the pod sandbox never gets devremap, whatever the annotations ask (NRI does
/// not create it as a container; a container marked so is told apart all the same).
#[test]
fn the_pod_sandbox_never_gets_devremap() {
    let sandbox = container(vec![gpu(0)], &[("io.kubernetes.cri.container-type", "sandbox"), (ENABLE, "true")]);
    assert_eq!(decide(&pod(&[(ENABLE, "true")]), &sandbox, &launcher_default(), DEV), Ok(Decision::Untouched(None)));
}

/// Rule (issue 32, as the wrapper's issue 29.1): the operator's `annotations` list says which
/// annotations launchers set, on the pod as on the container; `process.env` may only ask for a
/// devremap `/dev`, and the variables that stood for the others are named in a warning.
#[test]
fn launchers_and_the_image_env_ask_only_what_they_may() {
    let e = decide(&pod(&[(RELAX, "model")]), &container(vec![gpu(0)], &[]), &launcher_default(), DEV).unwrap_err();
    assert_eq!(e, NriError::Annotation(AnnotationError::NotAllowed(RELAX.into())));
    let mut c = container(vec![], &[]);
    c.env.extend(["DEVREMAP_ENABLE=true".into(), "DEVREMAP_RELAX=mode".into()]);
    let s = serve(&pod(&[]), &c, &launcher_default());
    assert!(s.request.daemon_args().is_empty());
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    let none: Vec<String> = vec![];
    assert!(matches!(decide(&pod(&[]), &c, &none, DEV), Ok(Decision::Untouched(None))));
}

/// Rule (issue 32): `NVIDIA_VISIBLE_DEVICES` asks for GPUs only where the spec has the NVIDIA
/// hook (hook mode), and NRI's view of a container holds no hook of the toolkit's, so the
/// variable alone never makes a container devremap's.
#[test]
fn nvidia_visible_devices_alone_does_not_ask() {
    let mut c = container(vec![], &[]);
    c.env.push("NVIDIA_VISIBLE_DEVICES=all".into());
    assert!(!served(&pod(&[]), &c));
}

/// Rule (issue 32): the spec the keeper reads is the container's view: its devices, its env,
/// its annotations, and only its mounts at or under `/dev`; the `/dev` mount is ours, pointed at
/// the mountpoint, and the tree builder reads the same devices and `/dev` mounts from it.
#[test]
fn the_spec_is_the_containers_view() {
    let c = container(vec![gpu(3)], &[("io.kubernetes.cri.container-type", "container")]);
    let s = serve(&pod(&[(ENABLE, "true")]), &c, &launcher_default());
    let dests: Vec<&str> =
        s.spec["mounts"].as_array().unwrap().iter().map(|m| m["destination"].as_str().unwrap()).collect();
    assert_eq!(dests, ["/dev", "/dev/pts", "/dev/mqueue", "/dev/termination-log", "/dev/shm"]);
    assert_eq!(s.spec["mounts"][0], oci_patch::dev_mount(DEV));
    assert_eq!(s.spec["process"]["env"], json!(["PATH=/bin"]));
    assert_eq!(s.spec["annotations"][ENABLE], "true");
    assert_eq!(
        s.spec["linux"]["devices"],
        json!([{"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3, "fileMode": 0o666, "uid": 0, "gid": 0}])
    );
    let view = spec::parse(s.spec.to_string().as_bytes(), &|src| src.ends_with("termination")).unwrap();
    assert_eq!(view.devices.len(), 1);
    assert_eq!(view.devices[0].gpu_minor(), Some(3));
    let under: Vec<(&str, bool)> = view.dev_mounts.iter().map(|m| (m.rel_path.as_str(), m.onto_file)).collect();
    assert_eq!(under, [("pts", false), ("mqueue", false), ("termination-log", true), ("shm", false)]);
    assert!(view.terminal && view.hook.is_none());
}

/// Rule (issue 32, as issue 17.6): a container binding something onto `/dev` (a `hostPath`
/// of `/dev`) asked for that `/dev`: refused when it asked for devremap by name, created
/// without it (saying so) otherwise. A device that cannot be a node is refused alike.
#[test]
fn a_container_binding_its_own_dev_keeps_it() {
    let mut c = container(vec![gpu(0)], &[]);
    c.mounts.push(mount("/dev", "bind", "/dev", &["rbind"]));
    match decide(&pod(&[]), &c, &launcher_default(), DEV).unwrap() {
        Decision::Untouched(Some(why)) => assert!(why.contains("\"/dev\" is bound onto /dev"), "{why}"),
        other => panic!("{other:?}"),
    }
    let e = decide(&pod(&[(ENABLE, "true")]), &c, &launcher_default(), DEV).unwrap_err();
    assert!(matches!(e, NriError::Patch(PatchError::DevBound { .. })), "{e}");
    let mut bad = container(vec![gpu(0)], &[(ENABLE, "true")]);
    bad.devices[0].minor = -1;
    let e = decide(&pod(&[]), &bad, &launcher_default(), DEV).unwrap_err().to_string();
    assert!(e.contains("linux.devices[0] (/dev/nvidia0): minor number -1 is out of range"), "{e}");
}

/// Rule (issue 32): a container created with `devremap.io/gpus` (a CRI restore passes the
/// checkpoint's annotations) is restored onto its new GPUs: the record is read as a record
/// file is, within its limit, and refused naming the annotation when it is not one; opted out,
/// it is not read at all. The record names GPUs, never grants one: the devices are the spec's.
#[test]
fn a_container_created_with_a_record_is_restored() {
    let c = container(vec![gpu(1)], &[(GPUS, &record(0))]);
    let s = serve(&pod(&[]), &c, &launcher_default());
    assert_eq!(s.restored, Some(record(0)));
    assert_eq!(s.spec["linux"]["devices"].as_array().unwrap().len(), 1);
    // Without a GPU in the spec, the record alone still asks (as the wrapper's restore does).
    assert_eq!(
        serve(&pod(&[]), &container(vec![], &[(GPUS, &record(0))]), &launcher_default()).restored,
        Some(record(0))
    );
    for (bad, says) in
        [("{", "annotation devremap.io/gpus: "), ("[{\"minor\": \"x\"}]", "annotation devremap.io/gpus: ")]
    {
        let e = decide(&pod(&[]), &container(vec![gpu(1)], &[(GPUS, bad)]), &launcher_default(), DEV).unwrap_err();
        assert!(matches!(e, NriError::Record(_)) && e.to_string().starts_with(says), "{bad}: {e}");
    }
    let huge = format!("[{}]", " ".repeat(MAX_METADATA_LEN as usize));
    let e = decide(&pod(&[]), &container(vec![gpu(1)], &[(GPUS, &huge)]), &launcher_default(), DEV).unwrap_err();
    assert_eq!(e, NriError::RecordTooLong(huge.len()));
    let out = container(vec![gpu(1)], &[(GPUS, "{"), (ENABLE, "false")]);
    assert_eq!(decide(&pod(&[]), &out, &launcher_default(), DEV), Ok(Decision::Untouched(None)));
}

/// Rule (issue 32): the record is the container's alone (a pod's would name every container's
/// GPUs alike), and the operator's `annotations` list governs it as any other.
#[test]
fn the_record_is_the_containers_and_the_operators_to_allow() {
    let e = decide(&pod(&[(GPUS, &record(0))]), &container(vec![gpu(1)], &[]), &launcher_default(), DEV);
    assert_eq!(e, Err(NriError::PodRecord));
    let only_enable = vec![ENABLE.to_owned()];
    let e = decide(&pod(&[]), &container(vec![gpu(1)], &[(GPUS, &record(0))]), &only_enable, DEV);
    assert_eq!(e, Err(NriError::Annotation(AnnotationError::NotAllowed(GPUS.into()))));
}

/// Rule (issue 32): the answer replaces the container's `/dev` with a bind of the mountpoint,
/// with the options of the wrapper's own `/dev` mount (runc then makes no node of its own, and
/// nothing there is executable or set-user-ID), and carries the record.
#[test]
fn the_adjustment_binds_the_mount_and_carries_the_record() {
    let a = adjustment(DEV, &record(2));
    assert_eq!(a.mounts, [mount("/dev", "bind", DEV, &["rbind", "nosuid", "noexec"])]);
    assert_eq!(a.annotations.get(GPUS), Some(&record(2)));
    assert!(a.remove_mounts.is_empty());
}

/// Rule (issue 32): a privileged container (its device cgroup allows every device), which
/// containerd gives every host device GPUs and all, is left alone (with a reason to log): a
/// GPU node's driver installer or monitoring agent keeps the `/dev` it makes nodes in. It gets
/// devremap only when it asks by `devremap.io/enable: "true"`, or is restored from a record.
#[test]
fn a_privileged_container_is_served_only_when_it_asks() {
    let privileged = |annotations: &[(&str, &str)]| Container {
        devices_allow_all: true,
        ..container(vec![gpu(0), gpu(1)], annotations)
    };
    let left = decide(&pod(&[]), &privileged(&[]), &launcher_default(), DEV).unwrap();
    assert!(matches!(&left, Decision::Untouched(Some(why)) if why.starts_with("privileged")), "{left:?}");
    assert!(served(&pod(&[]), &privileged(&[(ENABLE, "true")])));
    assert!(served(&pod(&[(ENABLE, "true")]), &privileged(&[])));
    assert!(served(&pod(&[]), &privileged(&[(GPUS, &record(0))])));
    assert!(served(&pod(&[]), &container(vec![gpu(0)], &[])), "an unprivileged GPU container is served");
}
