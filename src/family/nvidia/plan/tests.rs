//! NVIDIA's step through the whole plan ([`crate::decision::plan::build`]): its restored GPUs,
//! native and checkpoint names, collisions, the hook's selection, its checks.

use crate::decision::checks::CheckName;
use crate::decision::pairing::PairingError;
use crate::decision::pairing::{By, Rule};
use crate::decision::plan::fixtures::*;
use crate::decision::plan::*;
use crate::device::{Access, Rdev};
use crate::family::nvidia::GpuInfo;
use crate::family::nvidia::RestoredGpu;
use crate::family::nvidia::visible::{Selector, Visible};
use crate::inputs::metadata::RecordedAccess;
use crate::inputs::spec::SpecView;

/// Bug (issue 17.9): with a host device directory, a container given only `/dev/nvidia0`
/// also listed `nvidia1` and every other host GPU. A spec that names GPU devices is given
/// those alone (the directory's node for the same minor still gives its number); one that
/// names none gets none (issue 29.3: runc makes none).
#[test]
fn a_spec_naming_gpus_gets_only_those() {
    let mut inp = inputs(&[], &[0, 1, 2]);
    inp.metadata = None;
    let gpu0 = spec_dev("/dev/nvidia0", Rdev::new(195, 0), Access::DEVICE_DEFAULT);
    inp.spec = Some(SpecView { devices: vec![gpu0], ..SpecView::default() });
    let plan = build(&inp).unwrap();
    let names: Vec<String> = plan.parts.nvidia.restored.iter().map(RestoredGpu::name).collect();
    assert_eq!(names, ["nvidia0"]);
    assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 3)));
    assert_eq!((rdev_at(&plan, "nvidia1"), rdev_at(&plan, "nvidia2")), (None, None));
    inp.spec = Some(SpecView::default());
    assert_eq!(build(&inp).unwrap().parts.nvidia.restored.len(), 0, "a spec naming no GPU gets none");
}

/// Both kinds of names: native names are the host GPUs, checkpoint names their pairs.
#[test]
fn native_and_checkpoint_names() {
    let plan = build(&inputs(&[0, 1], &[4, 5])).unwrap();
    assert_eq!(rdev_at(&plan, "nvidia4"), Some(Rdev::new(1, 7)));
    assert_eq!(rdev_at(&plan, "nvidia5"), Some(Rdev::new(1, 8)));
    assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 7)));
    assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 8)));
    assert!(plan.parts.nvidia.remap.iter().all(|e| e.served));
    assert!(plan.warnings.is_empty());
}

/// Collision: saved {0,1} onto {1,2}; nvidia1 is host GPU 1 by default, the saved GPU 1's
/// device (host 2) with --prefer checkpoint; a warning either way.
#[test]
fn collision_native_wins_by_default() {
    let plan = build(&inputs(&[0, 1], &[1, 2])).unwrap();
    assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 4)));
    assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 4)));
    assert_eq!(plan.parts.nvidia.remap.iter().map(|e| e.served).collect::<Vec<_>>(), [true, false]);
    assert_eq!(plan.warnings.len(), 1);
    assert!(plan.warnings[0].starts_with("nvidia1: checkpoint name"), "{:?}", plan.warnings);

    let mut inp = inputs(&[0, 1], &[1, 2]);
    inp.prefer = Prefer::Checkpoint;
    let plan = build(&inp).unwrap();
    assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 5)));
    assert_eq!(rdev_at(&plan, "nvidia2"), Some(Rdev::new(1, 5)));
    assert!(plan.parts.nvidia.remap.iter().all(|e| e.served));
    assert_eq!(plan.warnings.len(), 1);
}

/// A restore onto the same GPUs serves each name as itself, with no warning.
#[test]
fn identity_restore() {
    let plan = build(&inputs(&[0, 1], &[0, 1])).unwrap();
    assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 3)));
    assert_eq!(rdev_at(&plan, "nvidia1"), Some(Rdev::new(1, 4)));
    assert!(plan.warnings.is_empty() && plan.parts.nvidia.remap.iter().all(|e| e.served));
}

/// Rule (issue 12.2): a checkpoint name is served with the mode, uid and gid the metadata
/// recorded; the native name keeps the host's; unrecorded fields come from the host node.
#[test]
fn checkpoint_names_keep_recorded_access() {
    let mut inp = inputs(&[0, 1], &[4, 5]);
    let gpus = &mut inp.metadata.as_mut().unwrap().saved.gpus;
    gpus[0].recorded = RecordedAccess { mode: Some(0o600), uid: Some(7), gid: Some(8) };
    gpus[1].recorded = RecordedAccess { mode: Some(0o640), uid: None, gid: None };
    let plan = build(&inp).unwrap();
    assert_eq!(plan.tree.get("nvidia0").unwrap().access, Access { mode: 0o600, uid: 7, gid: 8 });
    assert_eq!(plan.tree.get("nvidia1").unwrap().access, Access { mode: 0o640, uid: 0, gid: 0 });
    assert_eq!(plan.tree.get("nvidia4").unwrap().access, Access::DEVICE_DEFAULT);
    assert_eq!(rdev_at(&plan, "nvidia0"), Some(Rdev::new(1, 7)));
}

/// The metadata key absent (cuda-checkpoint released the devices): host GPUs still served.
#[test]
fn absent_key_still_serves_native_names() {
    let plan = build(&inputs(&[], &[3])).unwrap();
    assert!(plan.parts.nvidia.remap.is_empty());
    assert_eq!(rdev_at(&plan, "nvidia3"), Some(Rdev::new(1, 6)));
    assert_eq!(plan.tree.iter().filter(|(p, _)| p.starts_with("nvidia")).count(), 1);
}

/// Rule (issue 29.3): the remap still works for a restored container whose spec lists its
/// GPUs or asks the hook for them: saved GPUs 0 and 1 onto host GPUs 0 and 1 either way;
/// a spec that asks for no GPU is too few, the spec's fault.
#[test]
fn a_restore_gets_its_gpus_from_the_spec_or_the_hook() {
    let mut inp = full_dev_dir();
    inp.metadata = inputs(&[4, 5], &[]).metadata;
    let host = Access::DEVICE_DEFAULT;
    let listed = [0, 1].map(|m| spec_dev(&format!("/dev/nvidia{m}"), Rdev::new(195, m), host)).to_vec();
    for spec in [Some(SpecView { devices: listed, ..SpecView::default() }), hook(Visible::All)] {
        inp.spec = spec;
        let plan = build(&inp).unwrap();
        assert_eq!(
            (rdev_at(&plan, "nvidia4"), rdev_at(&plan, "nvidia5")),
            (Some(Rdev::new(1, 3)), Some(Rdev::new(1, 4)))
        );
    }
    inp.spec = Some(SpecView::default());
    assert_eq!(build(&inp).unwrap_err(), PlanError::SpecGpus(PairingError::Count { saved: 2, restored: 0 }));
}

/// Bug (issue 10.1): in hook mode the restored GPUs are exactly those NVIDIA_VISIBLE_DEVICES
/// selects, by the driver's (PCI bus) order: `2,3` on a host whose minors 0..3 sit on buses
/// 3c, 3d, 1a, 1b are minors 0 and 1; only they get native names; one GPU for two saved ones
/// is too few, blamed on the spec.
#[test]
fn hook_mode_serves_only_the_selected_gpus() {
    let mut inp = inputs(&[0, 1], &[0, 1, 2, 3]);
    inp.host = described(
        &[(0, "0000:3c:00.0"), (1, "0000:3d:00.0"), (2, "0000:1a:00.0"), (3, "0000:1b:00.0")],
        (0x10de, 0x2330),
    );
    inp.spec = hook(Visible::Devices(vec![Selector::Index(2), Selector::Index(3)]));
    let plan = build(&inp).unwrap();
    assert_eq!(native_gpus(&plan), [0, 1]);
    assert!(plan.tree.get("nvidia2").is_none() && plan.tree.get("nvidia3").is_none());

    inp.spec = hook(Visible::Devices(vec![Selector::Index(0)]));
    let err = build(&inp).unwrap_err();
    assert_eq!(err, PlanError::SpecGpus(PairingError::Count { saved: 2, restored: 1 }));
    assert_eq!(err.input(), Input::Spec);

    inp.spec = hook(Visible::None);
    inp.metadata = None;
    assert_eq!(native_gpus(&build(&inp).unwrap()), [0u32; 0]);
    inp.spec = hook(Visible::All);
    assert_eq!(native_gpus(&build(&inp).unwrap()), [0, 1, 2, 3]);
    inp.spec = hook(Visible::Devices(vec![Selector::Index(4)]));
    assert!(matches!(build(&inp), Err(PlanError::Visible(_))));
    inp.dev_dir.as_mut().unwrap().gpus.retain(|(m, _)| *m != 2);
    inp.spec = hook(Visible::Devices(vec![Selector::Index(0)]));
    assert_eq!(build(&inp).unwrap_err(), PlanError::HostDevMissing(2));
    assert_eq!(PlanError::HostDevMissing(2).input(), Input::HostDev);
}

/// Bug (issue 10.2): with nothing to remap (no metadata, or metadata without GPUs) a host
/// with two GPU models is served; with saved GPUs the mixed restored side is refused, as the
/// host root's fault.
#[test]
fn mixed_models_refused_only_with_something_to_remap() {
    let mut inp = inputs(&[], &[0, 1]);
    inp.host = described(&[(0, "0000:3c:00.0"), (1, "0000:3d:00.0")], (0x10de, 0x2330));
    inp.host.gpu_info[1].pci = Some((0x10de, 0x2684));
    assert_eq!(native_gpus(&build(&inp).unwrap()), [0, 1]);
    inp.metadata = None;
    assert_eq!(native_gpus(&build(&inp).unwrap()), [0, 1]);
    let mut with_saved = inputs(&[0], &[0, 1]);
    with_saved.host = inp.host.clone();
    let err = gate(&build(&with_saved).unwrap()).unwrap_err();
    assert_eq!(err.input(), Input::HostRoot);
    assert_eq!(
        err.to_string(),
        "mixed: restored devices are not homogeneous: nvidia0 is 10de:2330 but nvidia1 is 10de:2684"
    );
    // Relaxed, it is served with a warning.
    with_saved.relax.insert(CheckName::Mixed);
    with_saved.relax.insert(CheckName::Model);
    let plan = build(&with_saved).unwrap();
    assert_eq!(gate(&plan), Ok(()));
    assert_eq!(
        plan.warnings[0],
        "check mixed relaxed: restored devices are not homogeneous: nvidia0 is 10de:2330 but nvidia1 is 10de:2684"
    );
}

/// Bug (found from outside): two driver information files giving the same Device Minor
/// made NVIDIA_VISIBLE_DEVICES=<second GPU's UUID> serve that minor under the first GPU's
/// UUID, and `0,1` one GPU, in silence. Two files describing one minor, UUID (in either
/// case) or bus are refused, naming both, as the host root's fault.
#[test]
fn driver_files_that_contradict_each_other_are_refused() {
    let host = |edit: fn(&mut GpuInfo)| {
        let mut h = described(&[(0, "0000:3c:00.0"), (1, "0000:3d:00.0")], (0x10de, 0x2330));
        edit(&mut h.gpu_info[1]);
        Inputs { host: h, ..Inputs::default() }
    };
    let err = build(&host(|g| g.minor = Some(0))).unwrap_err();
    assert_eq!(err.input(), Input::HostRoot);
    assert_eq!(
        err.to_string(),
        "the driver's information files of 0000:3c:00.0 and 0000:3d:00.0 both give Device Minor 0"
    );
    let err = build(&host(|g| g.uuid = Some("GPU-0B5E55ED-1111-4222-8333-000000000000".into()))).unwrap_err();
    assert!(err.to_string().ends_with("both give GPU UUID GPU-0b5e55ed-1111-4222-8333-000000000000"), "{err}");
    let err = build(&host(|g| g.bus = Some("0000:3C:00.0".into()))).unwrap_err();
    assert!(err.to_string().ends_with("both give Bus Location 0000:3c:00.0"), "{err}");
    assert!(build(&host(|g| g.minor = None)).is_ok(), "a file without a minor contradicts nothing");
}

/// Bug (issue 33, found from outside): once the families were one seam, a `--device-map`
/// without a checkpoint was refused before the restore side was looked at, so the driver's
/// files contradicting each other went unsaid (the error named `--device-map`). The restore
/// side's fault is said first, as before.
#[test]
fn a_restore_side_fault_is_said_before_a_map_without_a_checkpoint() {
    let mut host = described(&[(0, "0000:3c:00.0"), (1, "0000:3d:00.0")], (0x10de, 0x2330));
    host.gpu_info[1].minor = Some(0);
    let device_map = crate::family::table::parse_device_map("0=1").unwrap();
    let err = build(&Inputs { host, device_map: device_map.clone(), ..Inputs::default() }).unwrap_err();
    assert_eq!(err.input(), Input::HostRoot, "{err}");
    let err = build(&Inputs { device_map, ..Inputs::default() }).unwrap_err();
    assert_eq!(err, PlanError::DeviceMap(PairingError::NoCheckpoint));
}

/// Rule (issue 20, the `mode` check): metadata that would make a root-only 0600 GPU 0666,
/// or give it to uid 65534, through its checkpoint name is refused, naming the check; relaxed,
/// the recorded mode is served with a warning; one that narrows access passes unwarned.
#[test]
fn a_checkpoint_name_never_widens_access() {
    let mut inp = inputs(&[0], &[2]);
    inp.dev_dir.as_mut().unwrap().gpus[0].1.access = Access { mode: 0o600, uid: 0, gid: 0 };
    let recorded = |inp: &mut Inputs, r: RecordedAccess| inp.metadata.as_mut().unwrap().saved.gpus[0].recorded = r;
    recorded(&mut inp, RecordedAccess { mode: Some(0o666), ..RecordedAccess::default() });
    let err = gate(&build(&inp).unwrap()).unwrap_err();
    assert_eq!(err.input(), Input::Checkpoint);
    assert_eq!(
        err.to_string(),
        "mode: saved nvidia0 was recorded 0666 0:0, more access than the 0600 0:0 that restored nvidia2 has here"
    );
    recorded(&mut inp, RecordedAccess { uid: Some(65534), ..RecordedAccess::default() });
    assert!(gate(&build(&inp).unwrap()).is_err());
    inp.relax.insert(CheckName::Mode);
    let plan = build(&inp).unwrap();
    assert_eq!(gate(&plan), Ok(()));
    assert_eq!(plan.tree.get("nvidia0").unwrap().access.uid, 65534);
    assert!(
        plan.warnings[0].starts_with("check mode relaxed: saved nvidia0 was recorded 0600 65534:0"),
        "{:?}",
        plan.warnings
    );
    inp.relax.clear();
    recorded(&mut inp, RecordedAccess { mode: Some(0o400), ..RecordedAccess::default() });
    let plan = build(&inp).unwrap();
    assert_eq!((gate(&plan), plan.warnings.len()), (Ok(()), 0));
    let names: Vec<&str> = plan.checks.iter().map(|c| c.check.as_str()).collect();
    assert_eq!(names, ["count", "mixed", "model", "driver", "mode"]);
}

/// Rule (issue 20): a GPU still there keeps its process (identity first), the plan says which
/// rule paired each, and `Rule::Positional` is gVisor's rule.
#[test]
fn remap_entries_say_which_rule_paired_them() {
    let mut inp = inputs(&[0, 1], &[1, 2]);
    inp.host = described(&[(1, "0000:3c:00.0"), (2, "0000:3d:00.0")], (4318, 8896));
    // Saved GPU 1 is host GPU 1: the same UUID.
    inp.metadata.as_mut().unwrap().saved.gpus[1].uuid = inp.host.gpu_info[0].uuid.clone().unwrap();
    let by = |plan: &Plan| plan.parts.nvidia.remap.iter().map(|e| (e.old.minor, e.new.minor, e.by)).collect::<Vec<_>>();
    assert_eq!(by(&build(&inp).unwrap()), [(0, 2, By::Position), (1, 1, By::Uuid)]);
    inp.pairing = Rule::Positional;
    assert_eq!(by(&build(&inp).unwrap()), [(0, 1, By::Position), (1, 2, By::Position)]);
}
