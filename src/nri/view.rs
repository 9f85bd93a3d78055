//! What the NRI transport hands the handler: a pod, a container and the adjustment to answer
//! `CreateContainer` with, as plain values (NRI v0.6.1's `PodSandbox`, `Container` and
//! `ContainerAdjustment`, reduced to what devremap reads or writes), and the [`Handler`] the
//! transport calls for each event.
//!
//! Assumptions: every string is as containerd sent it (NRI's maps and lists keep their order
//! here only where the protocol has one); a `pid` of 0 means the runtime did not say. With
//! `test-hooks`, each reads from JSON (the node daemon's test request drives the handler so).

use std::collections::BTreeMap;

/// A pod sandbox (NRI `PodSandbox`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "test-hooks", derive(serde::Deserialize), serde(default))]
pub struct Pod {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub annotations: BTreeMap<String, String>,
}

/// A container's state (NRI `ContainerState`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "test-hooks", derive(serde::Deserialize))]
pub enum State {
    #[default]
    Unknown,
    Created,
    Paused,
    Running,
    Stopped,
}

/// A container (NRI `Container`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "test-hooks", derive(serde::Deserialize), serde(default))]
pub struct Container {
    pub id: String,
    pub pod_sandbox_id: String,
    pub name: String,
    pub state: State,
    pub annotations: BTreeMap<String, String>,
    pub args: Vec<String>,
    /// `KEY=VALUE`, as in an OCI spec's `process.env`.
    pub env: Vec<String>,
    pub mounts: Vec<Mount>,
    /// `linux.devices`.
    pub devices: Vec<Device>,
    /// Whether its device cgroup (`linux.resources.devices`) ends allowing every device: a
    /// privileged container, which containerd gives every host device.
    pub devices_allow_all: bool,
    /// The container's init, 0 where the runtime did not say.
    pub pid: u32,
}

/// A mount (NRI `Mount`, an OCI spec's mount).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "test-hooks", derive(serde::Deserialize), serde(default))]
pub struct Mount {
    pub destination: String,
    /// The mount's type (`bind`, `tmpfs`, ...).
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

/// A device node the spec asks for (NRI `LinuxDevice`, an OCI spec's `linux.devices` entry).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "test-hooks", derive(serde::Deserialize), serde(default))]
pub struct Device {
    pub path: String,
    /// `c`, `b`, `u` or `p`, as in the OCI spec.
    pub kind: String,
    pub major: i64,
    pub minor: i64,
    pub file_mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

/// What a `CreateContainer` is answered with (NRI `ContainerAdjustment`): annotations to add,
/// mounts to add, and the destinations of the spec's mounts to remove. The default changes
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Adjustment {
    pub annotations: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
    pub remove_mounts: Vec<String>,
}

/// What the NRI transport calls for each event, one call at a time per container. An error
/// from [`Handler::create`] fails the container's creation with the message (a container that
/// asked for devremap never starts without it); the other events only inform.
pub trait Handler: Send + Sync {
    /// `CreateContainer` (never called for a pod's sandbox, which NRI does not create as a
    /// container).
    fn create(&self, pod: &Pod, container: &Container) -> Result<Adjustment, String>;
    /// `PostCreateContainer`: containerd has created the container `create` adjusted, and
    /// waits for this answer before its CreateContainer returns (so before any start).
    fn post_create(&self, pod: &Pod, container: &Container);
    /// `StartContainer`/`PostStartContainer`: the container runs (its `pid` may now be known).
    fn started(&self, pod: &Pod, container: &Container);
    /// `StopContainer` (also sent when the container's task exited).
    fn stopped(&self, pod: &Pod, container: &Container);
    /// `RemoveContainer`.
    fn removed(&self, pod: &Pod, container: &Container);
    /// `Synchronize`, at registration: every pod and container the runtime knows.
    fn synchronize(&self, pods: &[Pod], containers: &[Container]);
}
