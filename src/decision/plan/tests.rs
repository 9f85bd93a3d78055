//! The shared plan's tests: runc's defaults, the spec's devices and mounts, the pass-through
//! nodes, errors and warnings, through [`super::build`] (each family's own are in its folder).

use super::fixtures::*;
use super::*;
use crate::decision::pairing::MapPair;
use crate::decision::tree::NodeKind;
use crate::decision::tree::TreeError;
use crate::device::DevKind;
use crate::device::{Access, Rdev};
use crate::family::facts::HostFacts;
use crate::family::nvidia::visible::{Selector, Visible};
use crate::inputs::host::HostNode;
use crate::inputs::spec::SpecView;
use crate::inputs::spec::{DevMount, SpecDevice};

/// runc's /dev: with no inputs the tree is exactly the defaults.
#[test]
fn no_inputs_is_runcs_default_dev() {
    let plan = build(&Inputs::default()).unwrap();
    let names: Vec<&str> = plan.tree.iter().map(|(p, _)| p).collect();
    assert_eq!(names, ["fd", "full", "null", "ptmx", "random", "stderr", "stdin", "stdout", "tty", "urandom", "zero"]);
    assert_eq!(rdev_at(&plan, "tty"), Some(Rdev::new(5, 0)));
    assert!(plan.parts.nvidia.remap.is_empty() && plan.warnings.is_empty());
    let with_core =
        build(&Inputs { host: HostFacts { has_kcore: true, ..Default::default() }, ..Default::default() }).unwrap();
    assert_eq!(with_core.tree.get("core").unwrap().kind, NodeKind::Symlink("/proc/kcore".into()));
}

/// Spec: mounts become directories; devices keep their path and access; spec GPUs are
/// restored GPUs; a device outside /dev is reported; a device over a mount point is refused.
#[test]
fn spec_shapes_the_tree() {
    let dev = |path: &str, rdev: Rdev| spec_dev(path, rdev, Access { mode: 0o600, uid: 1, gid: 2 });
    let spec = SpecView {
        devices: vec![
            dev("/dev/dri/card0", Rdev::new(226, 0)),
            dev("/dev/nvidia7", Rdev::new(195, 7)),
            dev("/opt/x", Rdev::new(1, 3)),
        ],
        dev_mounts: ["pts", "shm"].map(|p| DevMount { rel_path: p.into(), ..DevMount::default() }).to_vec(),
        ..SpecView::default()
    };
    let plan = build(&Inputs { spec: Some(spec.clone()), ..Inputs::default() }).unwrap();
    assert_eq!(plan.tree.get("pts").unwrap().kind, NodeKind::Dir);
    assert_eq!(plan.tree.get("dri").unwrap().kind, NodeKind::Dir);
    assert_eq!(plan.tree.get("dri/card0").unwrap().access, Access { mode: 0o600, uid: 1, gid: 2 });
    assert_eq!(plan.parts.nvidia.restored.iter().map(|g| g.minor).collect::<Vec<_>>(), [7]);
    assert_eq!(plan.warnings, ["spec device /opt/x is outside /dev; not served"]);

    let mut clash = spec;
    clash.devices.push(dev("/dev/pts", Rdev::new(1, 3)));
    assert!(matches!(
        build(&Inputs { spec: Some(clash), ..Inputs::default() }),
        Err(PlanError::SpecMount(TreeError::DirOverNode { .. }))
    ));
}

/// Mount points: a mount onto an existing node (a restore's bind mount over a GPU) keeps
/// the node; a file bind mount and a terminal's console get a non-directory placeholder.
#[test]
fn mount_points_onto_nodes_files_and_console() {
    let mut inp = inputs(&[], &[0]);
    let mount = |p: &str, file: bool| DevMount {
        rel_path: p.into(),
        bind_source: Some("/x".into()),
        onto_file: file,
        tmpfs_mode: None,
    };
    inp.spec = Some(SpecView {
        dev_mounts: vec![mount("nvidia0", true), mount("termination-log", true), mount("data/sub", false)],
        terminal: true,
        ..SpecView::default()
    });
    let plan = build(&inp).unwrap();
    assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 3)), "the GPU node stays as the mount point");
    assert_eq!(rdev_at(&plan, "termination-log"), Some(Rdev::new(1, 3)));
    assert_eq!(rdev_at(&plan, "console"), Some(Rdev::new(1, 3)));
    assert_eq!(plan.tree.get("data/sub").unwrap().kind, NodeKind::Dir);
    let no_tty = build(&Inputs { spec: Some(SpecView::default()), ..Inputs::default() }).unwrap();
    assert!(no_tty.tree.get("console").is_none());
}

/// Bug (found from outside): a spec device under a spec mount (`/dev/shm/x` with a tmpfs on
/// `/dev/shm`) was served in silence, though the runtime's mount hides it in the container,
/// while runc's own /dev makes it inside the mount. A warning names it, once per mount;
/// directories made for other mounts under it are not warned about.
#[test]
fn a_node_under_a_mount_is_warned_about() {
    let mount = |p: &str| DevMount { rel_path: p.into(), ..DevMount::default() };
    let spec = SpecView {
        devices: vec![
            spec_dev("/dev/shm/x", Rdev::new(1, 3), Access::DEVICE_DEFAULT),
            spec_dev("/dev/shm/y", Rdev::new(1, 3), Access::DEVICE_DEFAULT),
        ],
        dev_mounts: vec![mount("shm"), mount("pts"), mount("pts/sub")],
        ..SpecView::default()
    };
    let plan = build(&Inputs { spec: Some(spec), ..Inputs::default() }).unwrap();
    assert_eq!(plan.warnings, ["/dev/shm/x lies under the mount /dev/shm, which hides it in the container"]);
}

/// Bug (found from outside): a working directory under /dev (`docker run -w /dev/work/dir`)
/// failed under devremap (`mkdir /dev/work: read-only file system`) where runc makes it in its
/// own /dev: the tree holds it, as runc makes it (0755, root's). One a node is in the way of is
/// left for the runtime to fail on, as it does on its own /dev, and fails no plan.
#[test]
fn a_working_directory_under_dev_is_in_the_tree() {
    let with_cwd = |cwd: &str| SpecView { cwd: Some(cwd.into()), ..SpecView::default() };
    let plan = build(&Inputs { spec: Some(with_cwd("work/dir")), ..Inputs::default() }).unwrap();
    for dir in ["work", "work/dir"] {
        let node = plan.tree.get(dir).unwrap_or_else(|| panic!("no /dev/{dir}"));
        assert_eq!((&node.kind, node.access), (&NodeKind::Dir, Access { mode: 0o755, uid: 0, gid: 0 }), "{dir}");
    }
    let blocked = build(&Inputs { spec: Some(with_cwd("null/x")), ..Inputs::default() }).unwrap();
    assert!(blocked.tree.get("null/x").is_none() && blocked.warnings.is_empty());
}

/// Nothing enters the tree that no input asked for: every node is a default, a spec node,
/// a pass-through node, or a GPU name.
#[test]
fn tree_holds_only_what_inputs_ask_for() {
    let mut inp = inputs(&[0, 1, 2], &[5, 6, 7, 9]);
    inp.dev_dir.as_mut().unwrap().passthrough.push(HostNode {
        rel_path: "nvidiactl".into(),
        rdev: Rdev::new(195, 255),
        access: Access::DEVICE_DEFAULT,
    });
    let plan = build(&inp).unwrap();
    let gpus: Vec<&str> = plan.tree.iter().map(|(p, _)| p).filter(|p| p.starts_with("nvidia")).collect();
    assert_eq!(gpus, ["nvidia0", "nvidia1", "nvidia2", "nvidia5", "nvidia6", "nvidia7", "nvidia9", "nvidiactl"]);
    assert_eq!(plan.tree.iter().count(), 11 + gpus.len());
}

/// Bug (issue 22): a pass-through node the spec lists (`/dev/kfd`, `/dev/nvidiactl`) was
/// served with the host node's mode and owner, replacing the spec's entry, and so was a GPU
/// both the spec and the device directory give: a spec's root-only `0600` on a host's `0666`
/// was served `0666`, access runc (which makes the node with the spec's `fileMode`, `uid`,
/// `gid`) never gives. Every node the spec lists keeps the spec's mode and owner, the
/// directory giving only its number, for both families; a node the spec does not list has
/// the host node's, as the NVIDIA hook's copy has.
#[test]
fn a_host_node_never_widens_the_specs_mode() {
    let host = Access::DEVICE_DEFAULT;
    let root_only = Access { mode: 0o600, uid: 0, gid: 0 };
    let render = Access { mode: 0o660, uid: 0, gid: 44 };
    let mut inp = inputs(&[], &[2, 3]);
    let dir = inp.dev_dir.as_mut().unwrap();
    for (name, rdev) in
        [("nvidiactl", Rdev::new(195, 255)), ("nvidia-uvm", Rdev::new(507, 0)), ("kfd", Rdev::new(5, 0))]
    {
        dir.passthrough.push(HostNode { rel_path: name.into(), rdev, access: host });
    }
    dir.amd.push((136, HostNode { rel_path: "dri/renderD136".into(), rdev: Rdev::new(1, 7), access: host }));
    inp.spec = Some(SpecView {
        devices: vec![
            spec_dev("/dev/nvidiactl", Rdev::new(195, 255), root_only),
            spec_dev("/dev/kfd", Rdev::new(235, 0), root_only),
            spec_dev("/dev/nvidia2", Rdev::new(195, 2), root_only),
            spec_dev("/dev/dri/renderD136", Rdev::new(226, 136), render),
        ],
        ..SpecView::default()
    });
    let plan = build(&inp).unwrap();
    let served = |name: &str| plan.tree.get(name).map(|n| (n.rdev(), n.access));
    assert_eq!(served("nvidiactl"), Some((Some(Rdev::new(195, 255)), root_only)));
    assert_eq!(served("kfd"), Some((Some(Rdev::new(5, 0)), root_only)), "the host's number, the spec's mode");
    assert_eq!(served("nvidia2"), Some((Some(Rdev::new(1, 5)), root_only)));
    assert_eq!(served("dri/renderD136"), Some((Some(Rdev::new(1, 7)), render)));
    assert_eq!(served("nvidia-uvm"), None, "a spec that names its devices is given those only");
    assert_eq!(served("nvidia3"), None, "a spec that names GPUs is given those only");
}

/// Bug (found from outside): a GPU the spec lists twice at its own path was served with the
/// last entry's mode and owner (`0666 0:0` after `0600 1000:1000`), where runc makes the node
/// from the first and a later entry finds it there: a container uid 2000 could open a GPU
/// that runc's node refuses it. The first entry at the GPU's own path wins, before an entry
/// of the same minor at another path; the checkpoint's names of it follow it. And (found
/// from outside, after): a GPU entry after another device at the same path (a block device,
/// `1:3`, another GPU) gave the GPU there, where runc's node is the first entry's: an entry
/// that is not the first at its path gives nothing.
#[test]
fn a_gpu_listed_twice_keeps_its_first_entrys_mode_as_runc_does() {
    let first = Access { mode: 0o600, uid: 1000, gid: 1000 };
    let wide = Access { mode: 0o666, uid: 0, gid: 0 };
    let served = |devices: Vec<SpecDevice>| {
        let mut inp = inputs(&[], &[1, 2]);
        inp.spec = Some(SpecView { devices, ..SpecView::default() });
        build(&inp).unwrap().tree.get("nvidia1").map(|n| n.access)
    };
    let gpu = |path: &str, access| spec_dev(path, Rdev::new(195, 1), access);
    let served_node = |devices: Vec<SpecDevice>| {
        let mut inp = inputs(&[], &[1, 2]);
        inp.spec = Some(SpecView { devices, ..SpecView::default() });
        let plan = build(&inp).unwrap();
        plan.tree.get("nvidia1").and_then(|n| match n.kind {
            NodeKind::Device(kind, rdev) => Some((kind, rdev, n.access)),
            _ => None,
        })
    };
    assert_eq!(served(vec![gpu("/dev/nvidia1", first), gpu("/dev/nvidia1", wide)]), Some(first));
    assert_eq!(served(vec![gpu("/dev/nvidia1", wide), gpu("/dev/nvidia1", first)]), Some(wide));
    assert_eq!(served(vec![gpu("/dev/gpu-one", wide), gpu("/dev/nvidia1", first)]), Some(first), "its own path first");
    assert_eq!(served(vec![gpu("/dev/gpu-one", first), gpu("/dev/gpu-two", wide)]), Some(first));
    // Another device first at the GPU's path: runc's node there is that one, and the GPU entry
    // after it gives nothing.
    let block = SpecDevice { kind: DevKind::Block, ..spec_dev("/dev/nvidia1", Rdev::new(195, 1), first) };
    assert_eq!(
        served_node(vec![block.clone(), gpu("/dev/nvidia1", wide)]),
        Some((DevKind::Block, Rdev::new(195, 1), first))
    );
    let null = spec_dev("/dev/nvidia1", Rdev::new(1, 3), first);
    assert_eq!(served_node(vec![null, gpu("/dev/nvidia1", wide)]), Some((DevKind::Char, Rdev::new(1, 3), first)));
    let other_gpu = spec_dev("/dev/nvidia1", Rdev::new(195, 2), first);
    assert_eq!(served_node(vec![other_gpu, gpu("/dev/nvidia1", wide)]).map(|n| n.2), Some(first));
    // AMD's render nodes by the same rule (they took the first entry of the minor anywhere).
    let render = |devices: Vec<SpecDevice>| {
        let mut inp = inputs(&[], &[]);
        let node = HostNode { rel_path: "dri/renderD136".into(), rdev: Rdev::new(1, 7), access: wide };
        inp.dev_dir.as_mut().unwrap().amd.push((136, node));
        inp.spec = Some(SpecView { devices, ..SpecView::default() });
        build(&inp).unwrap().tree.get("dri/renderD136").map(|n| n.access)
    };
    let amd = |path: &str, access| spec_dev(path, Rdev::new(226, 136), access);
    assert_eq!(render(vec![amd("/dev/dri/renderD136", first), amd("/dev/dri/renderD136", wide)]), Some(first));
    assert_eq!(render(vec![amd("/dev/dri/other", wide), amd("/dev/dri/renderD136", first)]), Some(first));
}

/// Bug: a spec that named its devices (`docker run --device /dev/nvidia0`) was given every
/// pass-through node of the device directory as well (`nvidiactl`, `nvidia-uvm`, `kfd`),
/// nodes the spec never listed. A node the spec does not list is served only without a
/// spec, or in hook mode for the NVIDIA hook's control nodes (issue 29.3: not for a spec
/// that lists no NVIDIA GPU); never AMD's `kfd` with a spec that does not list it.
#[test]
fn a_spec_that_names_its_devices_gets_no_other_passthrough_node() {
    let host = Access::DEVICE_DEFAULT;
    let with = |spec: Option<SpecView>| {
        let mut inp = inputs(&[], &[0, 1]);
        let dir = inp.dev_dir.as_mut().unwrap();
        for (name, rdev) in
            [("nvidiactl", Rdev::new(195, 255)), ("nvidia-uvm", Rdev::new(507, 0)), ("kfd", Rdev::new(235, 0))]
        {
            dir.passthrough.push(HostNode { rel_path: name.into(), rdev, access: host });
        }
        inp.spec = spec;
        let plan = build(&inp).unwrap();
        ["nvidiactl", "nvidia-uvm", "kfd"].into_iter().filter(|n| plan.tree.get(n).is_some()).collect::<Vec<_>>()
    };
    let gpu0 = spec_dev("/dev/nvidia0", Rdev::new(195, 0), host);
    let ctl = spec_dev("/dev/nvidiactl", Rdev::new(195, 255), host);
    let named = |devices| Some(SpecView { devices, ..SpecView::default() });
    assert_eq!(with(named(vec![gpu0.clone()])), Vec::<&str>::new(), "only the spec's devices");
    assert_eq!(with(named(vec![gpu0, ctl])), ["nvidiactl"], "the one it lists");
    assert_eq!(with(named(vec![])), Vec::<&str>::new(), "no device named: none of them");
    assert_eq!(with(hook(Visible::All)), ["nvidiactl", "nvidia-uvm"], "hook mode: the hook copies them");
    assert_eq!(with(None), ["nvidiactl", "nvidia-uvm", "kfd"], "--host-dev alone");
}

/// Bug (found reading libnvidia-container, 2026-12-04): hook mode served `nvidia-modeset` and
/// `nvidia-uvm` to every container asking the hook for GPUs, where the hook mounts
/// `nvidia-uvm(-tools)` only with the `compute` driver capability and `nvidia-modeset` only
/// with `display` (`nvc_mount.c`): a container asking for `utility` alone had two nodes the
/// hook never gives it. The control nodes follow `NVIDIA_DRIVER_CAPABILITIES`; `nvidiactl` and
/// the selected GPUs are given whatever it says.
#[test]
fn the_hooks_control_nodes_follow_its_driver_capabilities() {
    use crate::family::table::HookCapabilities;
    let with = |compute: bool, display: bool| {
        let mut inp = full_dev_dir();
        inp.spec = Some(SpecView {
            hook: Some(Visible::Devices(vec![Selector::Index(1)])),
            hook_capabilities: HookCapabilities { compute, display },
            ..SpecView::default()
        });
        gpu_family_nodes(&build(&inp).unwrap()).into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    assert_eq!(with(false, false), ["nvidia1", "nvidiactl"], "utility alone");
    assert_eq!(with(true, false), ["nvidia-uvm", "nvidia1", "nvidiactl"], "compute");
    assert_eq!(with(false, true), ["nvidia-modeset", "nvidia1", "nvidiactl"], "display");
    assert_eq!(with(true, true), ["nvidia-modeset", "nvidia-uvm", "nvidia1", "nvidiactl"], "all");
}

/// Bug (issue 29.3): with a device directory, a spec was given nodes runc never makes from
/// it: one asking the hook for nothing (`void`, empty, `,`, the variable unset: no hook
/// request) or listing no device got every `nvidiaN`, `nvidiactl`, `nvidia-uvm` and
/// `nvidia-caps/*`; one listing only `nvidiactl`, `kfd` or a render node got every NVIDIA
/// node at the host's `0666`. A spec gets what it lists and, in hook mode, what the toolkit
/// gives: the selected GPUs and the control nodes (`none`: those alone), never
/// `nvidia-caps/*` (MIG only). Only without a spec is the whole directory served.
#[test]
fn a_spec_gets_only_what_it_lists_and_the_hook_selects() {
    let with = |spec: Option<SpecView>| {
        let mut inp = full_dev_dir();
        inp.spec = spec;
        let plan = build(&inp).unwrap();
        gpu_family_nodes(&plan).into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let host = Access::DEVICE_DEFAULT;
    let listing = |devices: Vec<SpecDevice>| Some(SpecView { devices, ..SpecView::default() });
    let none: Vec<String> = vec![];
    assert_eq!(with(Some(SpecView::default())), none, "no device listed, no hook request");
    assert_eq!(with(listing(vec![spec_dev("/dev/nvidiactl", Rdev::new(195, 255), host)])), ["nvidiactl"]);
    assert_eq!(with(listing(vec![spec_dev("/dev/nvidia-uvm", Rdev::new(507, 0), host)])), ["nvidia-uvm"]);
    assert_eq!(with(listing(vec![spec_dev("/dev/kfd", Rdev::new(235, 0), host)])), ["kfd"]);
    let render = spec_dev("/dev/dri/renderD128", Rdev::new(226, 128), host);
    assert_eq!(with(listing(vec![render])), ["dri", "dri/renderD128"]);
    assert_eq!(with(hook(Visible::None)), ["nvidia-modeset", "nvidia-uvm", "nvidiactl"]);
    assert_eq!(
        with(hook(Visible::Devices(vec![Selector::Index(1)]))),
        ["nvidia-modeset", "nvidia-uvm", "nvidia1", "nvidiactl"]
    );
    assert_eq!(with(hook(Visible::All)), ["nvidia-modeset", "nvidia-uvm", "nvidia0", "nvidia1", "nvidiactl"]);
    assert_eq!(
        with(None),
        [
            "dri",
            "dri/renderD128",
            "kfd",
            "nvidia-caps",
            "nvidia-caps/nvidia-cap1",
            "nvidia-modeset",
            "nvidia-uvm",
            "nvidia0",
            "nvidia1",
            "nvidiactl"
        ],
        "the operator's own --host-dev without a spec: the whole directory"
    );
}

/// Bug (issue 29.5): runc mounts a tmpfs on a directory that exists and then chmods it to
/// that directory's mode, so the tree's `0755` mount point left `/dev/shm` unwritable to a
/// non-root user, where runc's own `/dev` leaves the tmpfs's `1777`. A tmpfs's mount point
/// has the tmpfs's mode (its `mode=`, else `1777`), the first mount on a path deciding; any
/// other mount's stays `0755`.
#[test]
fn a_tmpfs_mount_point_has_the_tmpfs_mode() {
    let mount = |p: &str, tmpfs_mode: Option<u32>| DevMount { rel_path: p.into(), tmpfs_mode, ..DevMount::default() };
    let spec = SpecView {
        dev_mounts: vec![
            mount("shm", Some(0o1777)),
            mount("shm", Some(0o700)),
            mount("a/b", Some(0o750)),
            mount("pts", None),
            mount("mqueue", None),
            mount("mqueue", Some(0o700)),
        ],
        ..SpecView::default()
    };
    let plan = build(&Inputs { spec: Some(spec), ..Inputs::default() }).unwrap();
    let mode = |p: &str| plan.tree.get(p).map(|n| (n.kind.clone(), n.access.mode));
    assert_eq!(mode("shm"), Some((NodeKind::Dir, 0o1777)));
    assert_eq!(mode("a/b"), Some((NodeKind::Dir, 0o750)));
    assert_eq!(mode("a"), Some((NodeKind::Dir, 0o755)));
    assert_eq!(mode("pts"), Some((NodeKind::Dir, 0o755)));
    assert_eq!(mode("mqueue"), Some((NodeKind::Dir, 0o755)), "the first mount there is no tmpfs");
}

/// Bug (found attacking the pass-through rule): a spec listing `/dev/nvidiactl` as a block
/// device or a FIFO had it served as a char device with the directory's number; runc makes
/// what the spec says, so the spec's node is kept. A char device takes the number only.
#[test]
fn a_spec_node_of_another_type_under_a_passthrough_name_is_kept() {
    let mut inp = inputs(&[], &[0]);
    let host = Access::DEVICE_DEFAULT;
    inp.dev_dir.as_mut().unwrap().passthrough.push(HostNode {
        rel_path: "nvidiactl".into(),
        rdev: Rdev::new(195, 255),
        access: host,
    });
    let mut block = spec_dev("/dev/nvidiactl", Rdev::new(8, 0), host);
    block.kind = DevKind::Block;
    inp.spec = Some(SpecView {
        devices: vec![spec_dev("/dev/nvidia0", Rdev::new(195, 0), host), block],
        ..SpecView::default()
    });
    let plan = build(&inp).unwrap();
    assert_eq!(plan.tree.get("nvidiactl").map(|n| &n.kind), Some(&NodeKind::Device(DevKind::Block, Rdev::new(8, 0))));
}

/// Bug (issue 10.6): the same path twice in linux.devices: the first entry is served, as runc
/// does, and a warning names both.
#[test]
fn duplicate_spec_device_path_keeps_the_first() {
    let dev = |path: &str, minor: u32| spec_dev(path, Rdev::new(1, minor), Access::DEVICE_DEFAULT);
    let spec = SpecView { devices: vec![dev("/dev/x", 3), dev("/dev/y", 7), dev("/dev/x", 5)], ..SpecView::default() };
    let plan = build(&Inputs { spec: Some(spec), ..Inputs::default() }).unwrap();
    assert_eq!(rdev_at(&plan, "x"), Some(Rdev::new(1, 3)));
    assert_eq!(plan.warnings, ["spec device /dev/x is listed again as /dev/x; serving the first entry, as runc does"]);
}

/// Bug (found from outside): runc's own /dev (runc 1.1.5, measured) differs from the spec's
/// list in two ways the plan did not follow: /dev/ptmx is always the symlink `pts/ptmx`
/// (setupPtmx removes what is there), and a default node is replaced only by a device
/// written exactly as its path (`/dev//null`, `/dev/./zero`, `/dev/full/` leave the
/// default, unless another entry is written `/dev/null`, which drops it). Each kept node
/// is warned about.
#[test]
fn spec_devices_over_defaults_follow_runc() {
    let dev = |path: &str, minor: u32| spec_dev(path, Rdev::new(1, minor), Access::DEVICE_DEFAULT);
    let d = |path: &str, minor: u32| {
        let mut v = dev(path, minor);
        v.rel_path = Some(path.trim_start_matches("/dev/").trim_matches(&['/', '.'][..]).replace("//", "/"));
        v
    };
    let devices = vec![
        d("/dev/ptmx", 2),
        d("/dev//null", 5),
        d("/dev/./zero", 7),
        d("/dev/full/", 3),
        d("/dev/fd", 9),
        d("/dev//tty", 11),
        d("/dev/tty", 12),
    ];
    let plan = build(&Inputs { spec: Some(SpecView { devices, ..SpecView::default() }), ..Inputs::default() }).unwrap();
    assert_eq!(plan.tree.get("ptmx").unwrap().kind, NodeKind::Symlink("pts/ptmx".into()));
    assert_eq!(rdev_at(&plan, "null"), Some(Rdev::new(1, 3)));
    assert_eq!(rdev_at(&plan, "zero"), Some(Rdev::new(1, 5)));
    assert_eq!(rdev_at(&plan, "full"), Some(Rdev::new(1, 7)));
    assert_eq!(rdev_at(&plan, "fd"), Some(Rdev::new(1, 9)), "a device over a default symlink stays");
    assert_eq!(rdev_at(&plan, "tty"), Some(Rdev::new(1, 11)), "/dev/tty drops the default; the first entry wins");
    assert_eq!(plan.warnings.len(), 5, "{:?}", plan.warnings);
    assert!(plan.warnings[0].contains("runc makes /dev/ptmx the symlink pts/ptmx"), "{:?}", plan.warnings);
    assert_eq!(
        plan.warnings[1],
        "spec device /dev//null is not written /dev/null, so runc keeps its default /dev/null; serving the default"
    );
}

/// Bug (issue 10.7): each error is the variant of the input that holds its cause: too few
/// GPUs is the spec's when the spec names the GPUs, the device directory's when it alone
/// does; a pass-through node in a spec node's way is the host's; --device-map without a
/// checkpoint is the flag's.
#[test]
fn errors_name_the_input_that_holds_the_cause() {
    let spec_gpu = spec_dev("/dev/nvidia3", Rdev::new(195, 3), Access::DEVICE_DEFAULT);
    let mut inp = inputs(&[0, 1], &[]);
    inp.dev_dir = None;
    inp.spec = Some(SpecView { devices: vec![spec_gpu], ..SpecView::default() });
    assert_eq!(build(&inp).unwrap_err().input(), Input::Spec);
    let mut inp = inputs(&[0, 1], &[5]);
    assert_eq!(build(&inp).unwrap_err(), PlanError::HostDevGpus(PairingError::Count { saved: 2, restored: 1 }));
    // Issue 29.3: a spec gets only the GPUs it names, so too few is the spec's.
    inp.spec = Some(SpecView::default());
    assert_eq!(build(&inp).unwrap_err(), PlanError::SpecGpus(PairingError::Count { saved: 2, restored: 0 }));
    let mut inp = inputs(&[0, 1], &[]);
    inp.dev_dir = None;
    assert_eq!(build(&inp).unwrap_err().input(), Input::Checkpoint);

    // The hook's control node past the tree's node limit (a spec's devices fill it).
    let mut inp = inputs(&[], &[]);
    inp.metadata = None;
    inp.dev_dir.as_mut().unwrap().passthrough.push(HostNode {
        rel_path: "nvidiactl".into(),
        rdev: Rdev::new(195, 255),
        access: Access::DEVICE_DEFAULT,
    });
    let defaults = build(&Inputs::default()).unwrap().tree.len();
    let devices = (0..crate::inputs::limits::MAX_NODES - defaults)
        .map(|i| spec_dev(&format!("/dev/d{i}"), Rdev::new(1, 3), Access::DEVICE_DEFAULT))
        .collect();
    inp.spec = Some(SpecView { devices, hook: Some(Visible::None), ..SpecView::default() });
    let err = build(&inp).unwrap_err();
    assert!(matches!(err, PlanError::HostNode(TreeError::Limit { .. })), "{err}");
    assert_eq!(err.input(), Input::HostDev);

    let mut inp = inputs(&[], &[2]);
    inp.metadata = None;
    inp.device_map = vec![MapPair {
        old: crate::decision::pairing::DeviceRef::Minor(0),
        new: crate::decision::pairing::DeviceRef::Minor(2),
    }];
    let err = build(&inp).unwrap_err();
    assert_eq!(err, PlanError::DeviceMap(PairingError::NoCheckpoint));
    assert_eq!(err.to_string(), "no checkpoint was given (--metadata), so there are no saved devices to pair");
}

/// Bug (found from outside): a spec with a terminal whose other nodes fill the tree to its
/// node limit made `plan` panic (exit 101) placing the console, and a daemon reloading it
/// died, leaving a dead mount. The console past the limit is refused like any other node.
#[test]
fn a_console_past_the_node_limit_is_refused_not_a_panic() {
    let defaults = build(&Inputs::default()).unwrap().tree.len();
    let devices = (0..crate::inputs::limits::MAX_NODES - defaults)
        .map(|i| spec_dev(&format!("/dev/d{i}"), Rdev::new(1, 3), Access::DEVICE_DEFAULT))
        .collect();
    let mut spec = SpecView { devices, ..SpecView::default() };
    assert_eq!(
        build(&Inputs { spec: Some(spec.clone()), ..Inputs::default() }).unwrap().tree.len(),
        crate::inputs::limits::MAX_NODES
    );
    spec.terminal = true;
    let err = build(&Inputs { spec: Some(spec), ..Inputs::default() }).unwrap_err();
    assert_eq!(err.input(), Input::Spec);
    assert_eq!(err.to_string(), "spec mount console: the tree would hold more than 16384 nodes");
}

/// Rule: the host's warnings (an oversized driver file skipped) reach the plan's.
#[test]
fn host_warnings_reach_the_plan() {
    let host = HostFacts { warnings: vec!["x: skipped".into()], ..HostFacts::default() };
    assert_eq!(build(&Inputs { host, ..Inputs::default() }).unwrap().warnings, ["x: skipped"]);
}
