//! From NRI's messages to the plain values of [`super::view`], and from an [`Adjustment`] to the
//! `ContainerAdjustment` containerd applies.
//!
//! Assumptions (containerd/nri v0.6.1, `pkg/api/helpers.go`, `pkg/adaptation/result.go`): a
//! mount is removed from the spec by an adjustment mount whose destination is the removed one's
//! with a `-` in front (`MarkForRemoval`) and nothing else set; an added mount with the
//! destination of one in the spec replaces it. Fields devremap does not read are dropped.

use super::api;
use super::view::{Adjustment, Container, Device, Mount, Pod, State};

pub fn pod(p: &api::PodSandbox) -> Pod {
    Pod {
        id: p.id.clone(),
        name: p.name.clone(),
        namespace: p.namespace.clone(),
        uid: p.uid.clone(),
        annotations: p.annotations.clone(),
    }
}

pub fn container(c: &api::Container) -> Container {
    Container {
        id: c.id.clone(),
        pod_sandbox_id: c.pod_sandbox_id.clone(),
        name: c.name.clone(),
        state: match c.state() {
            api::ContainerState::ContainerUnknown => State::Unknown,
            api::ContainerState::ContainerCreated => State::Created,
            api::ContainerState::ContainerPaused => State::Paused,
            api::ContainerState::ContainerRunning => State::Running,
            api::ContainerState::ContainerStopped => State::Stopped,
        },
        annotations: c.annotations.clone(),
        args: c.args.clone(),
        env: c.env.clone(),
        mounts: c.mounts.iter().map(mount).collect(),
        devices: c.linux.iter().flat_map(|l| &l.devices).map(device).collect(),
        devices_allow_all: allows_all(c.linux.iter().flat_map(|l| &l.resources).flat_map(|r| &r.devices)),
        pid: c.pid,
    }
}

/// Whether device cgroup rules end allowing every device: the last rule for every device (no
/// type or `a`, no major, no minor) allows. Later rules override earlier ones, as runc applies
/// them.
fn allows_all<'a>(rules: impl Iterator<Item = &'a api::LinuxDeviceCgroup>) -> bool {
    let every = |n: &Option<api::OptionalInt64>| n.as_ref().is_none_or(|n| n.value == -1);
    rules
        .filter(|r| matches!(r.r#type.as_str(), "" | "a") && every(&r.major) && every(&r.minor))
        .last()
        .is_some_and(|r| r.allow)
}

fn mount(m: &api::Mount) -> Mount {
    Mount {
        destination: m.destination.clone(),
        kind: m.r#type.clone(),
        source: m.source.clone(),
        options: m.options.clone(),
    }
}

fn device(d: &api::LinuxDevice) -> Device {
    Device {
        path: d.path.clone(),
        kind: d.r#type.clone(),
        major: d.major,
        minor: d.minor,
        file_mode: d.file_mode.as_ref().map(|m| m.value),
        uid: d.uid.as_ref().map(|v| v.value),
        gid: d.gid.as_ref().map(|v| v.value),
    }
}

/// The adjustment as NRI encodes it: each removed destination as a removal mark (before the
/// additions, though containerd applies removals first whatever the order), then the mounts
/// added, and the annotations.
pub fn adjustment(a: &Adjustment) -> api::ContainerAdjustment {
    let removed = a
        .remove_mounts
        .iter()
        .map(|destination| api::Mount { destination: format!("-{destination}"), ..api::Mount::default() });
    let added = a.mounts.iter().map(|m| api::Mount {
        destination: m.destination.clone(),
        r#type: m.kind.clone(),
        source: m.source.clone(),
        options: m.options.clone(),
    });
    api::ContainerAdjustment {
        annotations: a.annotations.clone(),
        mounts: removed.chain(added).collect(),
        ..api::ContainerAdjustment::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use std::collections::BTreeMap;

    /// Rule (issue 32): a removed mount travels as NRI v0.6.1's removal mark (`-` and the
    /// destination, nothing else), an added one as it is, annotations as given; the encoded
    /// `CreateContainerResponse` decodes to the same adjustment.
    #[test]
    fn adjustment_encodes_removals_as_marks_and_round_trips() {
        let a = Adjustment {
            annotations: BTreeMap::from([("devremap.io/gpus".to_owned(), "[0,1]".to_owned())]),
            mounts: vec![Mount {
                destination: "/dev".into(),
                kind: "bind".into(),
                source: "/run/devremap/c1/dev".into(),
                options: vec!["rbind".into(), "ro".into()],
            }],
            remove_mounts: vec!["/dev/shm".into()],
        };
        let response = api::CreateContainerResponse { adjust: Some(adjustment(&a)), ..Default::default() };
        let decoded = api::CreateContainerResponse::decode(response.encode_to_vec().as_slice()).unwrap();
        let adjust = decoded.adjust.unwrap();
        assert_eq!(adjust.annotations, a.annotations);
        assert_eq!(
            adjust.mounts,
            vec![
                api::Mount { destination: "-/dev/shm".into(), ..Default::default() },
                api::Mount {
                    destination: "/dev".into(),
                    r#type: "bind".into(),
                    source: "/run/devremap/c1/dev".into(),
                    options: vec!["rbind".into(), "ro".into()],
                },
            ]
        );
        assert_eq!(adjust.env, vec![]);
        assert_eq!(adjust.linux, None);
    }

    /// Rule (issue 32): the default adjustment changes nothing: it encodes to no bytes at all.
    #[test]
    fn default_adjustment_is_empty() {
        assert!(adjustment(&Adjustment::default()).encode_to_vec().is_empty());
    }

    /// Rule (issue 32): a device cgroup whose last rule for every device allows (containerd's
    /// privileged container: one `allow: true, access: rwm` rule) allows all; the default deny
    /// followed by allows of single devices does not, nor an allow-all overridden by a deny.
    #[test]
    fn devices_allow_all_is_the_last_rule_for_every_device() {
        let rule = |allow: bool, kind: &str, major: Option<i64>| api::LinuxDeviceCgroup {
            allow,
            r#type: kind.into(),
            major: major.map(|value| api::OptionalInt64 { value }),
            minor: None,
            access: "rwm".into(),
        };
        let with = |devices: Vec<api::LinuxDeviceCgroup>| {
            let resources = Some(api::LinuxResources { devices, ..Default::default() });
            let linux = Some(api::LinuxContainer { resources, ..Default::default() });
            container(&api::Container { linux, ..Default::default() }).devices_allow_all
        };
        assert!(with(vec![rule(true, "", None)]));
        assert!(with(vec![rule(false, "", None), rule(true, "a", Some(-1))]));
        assert!(!with(vec![rule(false, "", None), rule(true, "c", Some(195))]));
        assert!(!with(vec![rule(true, "", None), rule(false, "a", None)]));
        assert!(!with(vec![]));
    }

    /// Rule (issue 32): a container's devices are its `linux.devices`, optional fields as
    /// `None` where containerd left them out, and its state as NRI's.
    #[test]
    fn container_keeps_what_devremap_reads() {
        let c = api::Container {
            id: "c1".into(),
            pod_sandbox_id: "p1".into(),
            state: api::ContainerState::ContainerRunning as i32,
            env: vec!["NVIDIA_VISIBLE_DEVICES=all".into()],
            linux: Some(api::LinuxContainer {
                devices: vec![api::LinuxDevice {
                    path: "/dev/nvidia0".into(),
                    r#type: "c".into(),
                    major: 195,
                    minor: 0,
                    file_mode: Some(api::OptionalFileMode { value: 0o666 }),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            pid: 42,
            ..Default::default()
        };
        let v = container(&c);
        assert_eq!(v.state, State::Running);
        assert_eq!(v.pid, 42);
        assert_eq!(
            v.devices,
            vec![Device {
                path: "/dev/nvidia0".into(),
                kind: "c".into(),
                major: 195,
                minor: 0,
                file_mode: Some(0o666),
                uid: None,
                gid: None
            }]
        );
    }
}
