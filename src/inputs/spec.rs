//! The OCI runtime spec, reduced to what shapes `/dev`: the devices it lists, the mounts it
//! places under `/dev`, whether it asks for GPUs through the NVIDIA hook, and whether the
//! process has a terminal.
//!
//! Pure: [`parse`] takes the spec's bytes, and the one fact about the bundle the spec alone
//! cannot tell (whether a bind mount's source is a non-directory), so the view is complete
//! when it returns. Paths are taken as the runtime takes them: absolute,
//! `/dev/`-relative for what we serve; a device outside `/dev` is not ours to serve and is
//! reported, not refused.

use crate::device::{Access, DevKind, Rdev};
use crate::family::table::{HOOK_FAMILY, HookCapabilities, HookError, HookRequest, hook_capabilities, hook_request};
use oci_spec::runtime::{LinuxDeviceType, Spec};
use thiserror::Error;

/// A `linux.devices` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecDevice {
    /// The path inside `/dev`, without the leading `/dev/`; `None` for a device outside `/dev`.
    pub rel_path: Option<String>,
    /// The path as the spec writes it.
    pub path: String,
    pub kind: DevKind,
    pub rdev: Rdev,
    pub access: Access,
}

impl SpecDevice {
    /// The GPU minor this entry grants, if it is a regular NVIDIA device (char 195:N, N <= 247).
    pub fn gpu_minor(&self) -> Option<u32> {
        HOOK_FAMILY.gpu_minor_of_device(self.kind, self.rdev)
    }
}

/// A mount the spec places under `/dev`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevMount {
    /// The destination relative to `/dev` (`pts`, `shm`, `termination-log`).
    pub rel_path: String,
    /// For a bind mount, its source as the spec writes it.
    pub bind_source: Option<String>,
    /// The source is not a directory, so the mount point must be a non-directory.
    pub onto_file: bool,
    /// For a tmpfs, the mode of its root as mounted: the last `mode=` as the kernel reads the
    /// options, else tmpfs's own `1777`. runc chmods a tmpfs mounted on a directory that exists to that directory's mode.
    pub tmpfs_mode: Option<u32>,
}

/// What of a spec matters to `/dev`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecView {
    pub devices: Vec<SpecDevice>,
    /// Mounts under `/dev` (`pts`, `shm`, `mqueue`, ...).
    pub dev_mounts: Vec<DevMount>,
    /// What the spec asks for through the NVIDIA hook (`NVIDIA_VISIBLE_DEVICES`), so the
    /// host's `/dev` names GPUs too; `None` when it asks for nothing that way.
    pub hook: Option<HookRequest>,
    /// Which of its control nodes the hook gives (`NVIDIA_DRIVER_CAPABILITIES`); every one in a
    /// view built by hand.
    pub hook_capabilities: HookCapabilities,
    /// `process.terminal`: the runtime bind-mounts the console onto `/dev/console`.
    pub terminal: bool,
    /// `process.cwd` relative to `/dev`, when it lies under it: runc makes the working
    /// directory (`MkdirAll`, 0755) before it changes into it.
    pub cwd: Option<String>,
}

impl SpecView {
    /// Whether `linux.devices` lists an NVIDIA GPU (`195:N`).
    pub fn lists_gpus(&self) -> bool {
        self.devices.iter().any(|d| d.gpu_minor().is_some())
    }

    /// Whether the spec asks for NVIDIA GPUs: by listing them, or through the hook.
    pub fn names_gpus(&self) -> bool {
        self.hook.is_some() || self.lists_gpus()
    }
}

/// Why a spec was refused; the caller prefixes the file.
#[derive(Debug, Error, PartialEq)]
pub enum SpecError {
    #[error("not a valid OCI runtime spec: {0}")]
    Parse(String),
    #[error("larger than {} bytes", crate::inputs::metadata::MAX_METADATA_LEN)]
    TooLarge,
    #[error("linux.devices[{index}] ({path}): {what}")]
    Device { index: usize, path: String, what: String },
    #[error("mounts[{index}]: destination {path:?} {what}")]
    Mount { index: usize, path: String, what: &'static str },
    #[error("process.env: {0}")]
    Visible(HookError),
}

/// Parses a spec and keeps what shapes `/dev`. `file_source(source)` tells whether a bind
/// mount's source (as the spec writes it) is a non-directory, which needs a non-directory mount
/// point.
pub fn parse(bytes: &[u8], file_source: &dyn Fn(&str) -> bool) -> Result<SpecView, SpecError> {
    let parse_error = |e: serde_json::Error| SpecError::Parse(e.to_string());
    // Checked and counted first (memory stays bounded), then parsed straight into the spec,
    // which skips unknown fields without keeping them. Serde would also take a struct from a
    // JSON array.
    if let Some(encoding) = crate::inputs::limits::byte_order_mark(bytes) {
        return Err(SpecError::Parse(format!("the text is {encoding}; JSON is UTF-8 without a byte-order mark")));
    }
    crate::inputs::limits::check_spec_json(bytes).map_err(parse_error)?;
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(SpecError::Parse("expected a JSON object".into()));
    }
    let mut spec: Spec = serde_json::from_slice(bytes).map_err(parse_error)?;
    let mut view = SpecView {
        hook: hook_request(&spec).map_err(SpecError::Visible)?,
        hook_capabilities: hook_capabilities(&spec),
        terminal: spec.process().as_ref().and_then(|p| p.terminal()).unwrap_or(false),
        // One that `/dev` cannot hold is the runtime's to refuse, as under its own `/dev`.
        cwd: spec
            .process()
            .as_ref()
            .and_then(|p| dev_relative(&p.cwd().to_string_lossy()).ok().flatten())
            .filter(|rel| !rel.is_empty()),
        ..SpecView::default()
    };
    // Taken out of the spec, each path moved rather than copied: memory holds one copy of them.
    let devices = spec.linux_mut().as_mut().and_then(|l| l.devices_mut().take()).unwrap_or_default();
    for (index, mut dev) in devices.into_iter().enumerate() {
        let path = std::mem::take(dev.path_mut())
            .into_os_string()
            .into_string()
            .unwrap_or_else(|p| p.to_string_lossy().into_owned());
        let err = |what: String| SpecError::Device { index, path: path.clone(), what };
        let kind = match dev.typ() {
            LinuxDeviceType::C | LinuxDeviceType::U => DevKind::Char,
            LinuxDeviceType::B => DevKind::Block,
            LinuxDeviceType::P => DevKind::Fifo,
            LinuxDeviceType::A => return Err(err("type \"a\" is not a device node type".into())),
        };
        let number =
            |n: i64, which: &str| u32::try_from(n).map_err(|_| err(format!("{which} number {n} is out of range")));
        let rdev = Rdev::new(number(dev.major(), "major")?, number(dev.minor(), "minor")?);
        let mode = dev.file_mode().map(|m| permission_bits(m, kind)).transpose().map_err(err)?;
        let access = as_runc_leaves_it(Access {
            mode: mode.unwrap_or(Access::DEVICE_DEFAULT.mode),
            uid: dev.uid().unwrap_or(0),
            gid: dev.gid().unwrap_or(0),
        });
        let rel_path = dev_relative(&path).map_err(|what| err(what.to_string()))?;
        if rel_path.as_deref() == Some("") {
            return Err(err("is /dev itself".into()));
        }
        view.devices.push(SpecDevice { rel_path, path, kind, rdev, access });
    }
    for (index, mount) in spec.mounts().iter().flatten().enumerate() {
        let path = mount.destination().to_string_lossy().into_owned();
        let rel = dev_relative(&path).map_err(|what| SpecError::Mount { index, path: path.clone(), what })?;
        if let Some(rel_path) = rel.filter(|r| !r.is_empty()) {
            let is_bind = mount.typ().as_deref() == Some("bind")
                || mount.options().iter().flatten().any(|o| o == "bind" || o == "rbind");
            let bind_source =
                is_bind.then(|| mount.source().as_ref().map(|s| s.to_string_lossy().into_owned())).flatten();
            let onto_file = bind_source.as_deref().is_some_and(file_source);
            let tmpfs_mode = (!is_bind && mount.typ().as_deref() == Some("tmpfs"))
                .then(|| tmpfs_root_mode(mount.options().iter().flatten().map(String::as_str)));
            view.dev_mounts.push(DevMount { rel_path, bind_source, onto_file, tmpfs_mode });
        }
    }
    Ok(view)
}

/// The mode of a tmpfs's root as the kernel mounts it. runc hands the options it does not
/// take as mount flags to the kernel joined with `,`, and the kernel (`shmem_parse_options`)
/// splits them again and applies each `mode=` in order, so the last one stands, read as
/// `kstrtouint(value, 8)` reads it ([`kernel_octal`]); its permission bits count. Without one,
/// tmpfs's `1777`. A value the kernel cannot read fails the mount, so whatever is served for it
/// is never seen; `1777` is. (The kernel glues a piece that starts with a digit onto the one
/// before it, for `mpol=`'s node lists; after a `mode=` that makes a value it cannot read.)
fn tmpfs_root_mode<'a>(options: impl Iterator<Item = &'a str>) -> u32 {
    let mut modes = options.flat_map(|o| o.split(',')).filter_map(|o| o.strip_prefix("mode="));
    modes.try_fold(0o1777, |_, value| kernel_octal(value)).map_or(0o1777, |m| m & 0o7777)
}

/// An unsigned octal number as the kernel's `kstrtouint(s, 8)` reads it: one optional leading
/// `+`, octal digits, one optional trailing newline, within 32 bits.
fn kernel_octal(value: &str) -> Option<u32> {
    let value = value.strip_prefix('+').unwrap_or(value);
    let digits = value.strip_suffix('\n').unwrap_or(value);
    if digits.is_empty() || !digits.bytes().all(|b| matches!(b, b'0'..=b'7')) {
        return None;
    }
    u32::from_str_radix(digits, 8).ok()
}

/// A node's access as runc leaves it: runc makes each node as root and then chowns it to the
/// spec's `uid` and `gid`, where 4294967295 is chown's "leave as is" (the node stays root's), and
/// the kernel's chown of a non-directory clears set-user-ID, and set-group-ID where group execute
/// is set (measured with runc 1.1.5: `fileMode` 0o7777 gives 0o1777).
fn as_runc_leaves_it(access: Access) -> Access {
    let unchanged = |id: u32| if id == u32::MAX { 0 } else { id };
    let mut mode = access.mode & !libc::S_ISUID;
    if mode & libc::S_IXGRP != 0 {
        mode &= !libc::S_ISGID;
    }
    Access { mode, uid: unchanged(access.uid), gid: unchanged(access.gid) }
}

/// The permission bits of a device's `fileMode`. containerd wrote the file-type bits too
/// (0o20666 for a char device, containerd#5028) and runc ORs the type into the mode before
/// mknod, so type bits that match the device's type are harmless and dropped; others would make
/// another kind of node and are refused.
fn permission_bits(mode: u32, kind: DevKind) -> Result<u32, String> {
    let type_bits = match kind {
        DevKind::Char => libc::S_IFCHR,
        DevKind::Block => libc::S_IFBLK,
        DevKind::Fifo => libc::S_IFIFO,
    };
    match mode & !0o7777 {
        0 => Ok(mode),
        bits if bits == type_bits => Ok(mode & 0o7777),
        bits if bits & !libc::S_IFMT == 0 => Err(format!(
            "fileMode {mode:#o}: its file-type bits {bits:#o} are not those of a {} node ({type_bits:#o})",
            kind.as_str()
        )),
        _ => Err(format!("fileMode {mode:#o} has bits beyond the file type and permission bits")),
    }
}

/// `/dev/a/b` -> `Some("a/b")`, `/dev` -> `Some("")`, `/other` -> `None`. Refuses `..`, which
/// would let a spec place a node outside the tree.
fn dev_relative(path: &str) -> Result<Option<String>, &'static str> {
    // Walked, not collected: a path of millions of components takes no more than its length.
    let parts = || path.split('/').filter(|p| !p.is_empty() && *p != ".");
    if parts().any(|p| p == "..") {
        return Err("contains \"..\"");
    }
    if !path.starts_with('/') {
        return Err("is not an absolute path");
    }
    let mut rest = parts();
    if rest.next() != Some("dev") {
        return Ok(None);
    }
    let mut rel = String::new();
    for part in rest {
        if !rel.is_empty() {
            rel.push('/');
        }
        rel.push_str(part);
    }
    Ok(Some(rel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::nvidia::visible::{Selector, Visible};
    use serde_json::json;

    fn no_files(_: &str) -> bool {
        false
    }

    fn spec(linux_devices: serde_json::Value, mounts: serde_json::Value) -> serde_json::Value {
        json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
               "process": {"cwd": "/", "args": ["sh"], "user": {"uid": 0, "gid": 0}, "terminal": true},
               "mounts": mounts, "linux": {"devices": linux_devices}})
    }

    /// Rule: `process.cwd` under /dev is kept relative to it (runc makes it there); /dev
    /// itself, a path elsewhere, and one /dev cannot hold are not ours.
    #[test]
    fn a_working_directory_under_dev_is_kept() {
        let cwd_of = |cwd: &str| {
            let mut s = spec(json!([]), json!([]));
            s["process"]["cwd"] = json!(cwd);
            parse(s.to_string().as_bytes(), &no_files).unwrap().cwd
        };
        assert_eq!(cwd_of("/dev/work/dir").as_deref(), Some("work/dir"));
        assert_eq!(cwd_of("/dev/work/"), Some("work".into()));
        for outside in ["/dev", "/dev/", "/work", "/dev/../etc"] {
            assert_eq!(cwd_of(outside), None, "{outside}");
        }
    }

    /// runc's /dev: spec devices keep type, numbers, mode (0666 default), uid and gid; mounts
    /// under /dev become directories; /dev itself and mounts elsewhere are not ours.
    #[test]
    fn devices_and_dev_mounts() {
        let s = spec(
            json!([{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229, "fileMode": 0o600, "uid": 7, "gid": 8},
                   {"path": "/dev/sda", "type": "b", "major": 8, "minor": 0},
                   {"path": "/dev/fifo", "type": "p"}]),
            json!([{"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                   {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
                   {"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev/shm/", "type": "tmpfs", "source": "shm"},
                   {"destination": "/dev/termination-log", "source": "/var/log/t", "options": ["rbind", "ro"]}]),
        );
        let v = parse(s.to_string().as_bytes(), &no_files).unwrap();
        let rels: Vec<&str> = v.dev_mounts.iter().map(|m| m.rel_path.as_str()).collect();
        assert_eq!(rels, ["pts", "shm", "termination-log"]);
        assert_eq!(v.dev_mounts[2].bind_source.as_deref(), Some("/var/log/t"));
        assert_eq!(v.dev_mounts[0].bind_source, None);
        assert!(v.terminal && v.hook.is_none());
        assert_eq!(v.cwd, None, "/ is not under /dev");
        assert_eq!(v.devices[0].rel_path.as_deref(), Some("fuse"));
        assert_eq!(v.devices[0].access, Access { mode: 0o600, uid: 7, gid: 8 });
        assert_eq!((v.devices[1].kind, v.devices[1].rdev), (DevKind::Block, Rdev::new(8, 0)));
        assert_eq!(v.devices[1].access, Access::DEVICE_DEFAULT);
        assert_eq!(v.devices[2].kind, DevKind::Fifo);
    }

    /// gVisor's rule: a spec GPU is a char device 195:N with N <= 247.
    #[test]
    fn gpu_minor_rule() {
        let s = spec(
            json!([{"path": "/dev/nvidia3", "type": "c", "major": 195, "minor": 3},
                   {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
                   {"path": "/dev/x", "type": "b", "major": 195, "minor": 1}]),
            json!([]),
        );
        let v = parse(s.to_string().as_bytes(), &no_files).unwrap();
        let minors: Vec<_> = v.devices.iter().map(SpecDevice::gpu_minor).collect();
        assert_eq!(minors, vec![Some(3), None, None]);
    }

    /// Hook detection: the legacy hook's path suffix, NVIDIA_VISIBLE_DEVICES asking for
    /// something (not void or empty); what it asks for is read as the toolkit reads it.
    #[test]
    fn hook_request_rules() {
        let with = |hooks: serde_json::Value, env: &[&str]| {
            let mut s = spec(json!([]), json!([]));
            s["hooks"] = hooks;
            s["process"]["env"] = json!(env);
            parse(s.to_string().as_bytes(), &no_files).map(|v| v.hook)
        };
        let legacy = json!({"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]});
        let env = |v: &str| format!("NVIDIA_VISIBLE_DEVICES={v}");
        assert_eq!(with(legacy.clone(), &[&env("all")]), Ok(Some(Visible::All)));
        assert_eq!(with(legacy.clone(), &[&env("none")]), Ok(Some(Visible::None)));
        assert_eq!(
            with(legacy.clone(), &[&env("2,3")]),
            Ok(Some(Visible::Devices(vec![Selector::Index(2), Selector::Index(3)])))
        );
        for nothing in [vec![env("void")], vec![env("")], vec![env(" , ")], vec!["PATH=/bin".into()]] {
            let nothing: Vec<&str> = nothing.iter().map(String::as_str).collect();
            assert_eq!(with(legacy.clone(), &nothing), Ok(None), "{nothing:?}");
        }
        assert_eq!(with(legacy.clone(), &[&env("all"), &env("void")]), Ok(None));
        assert_eq!(with(json!({"prestart": [{"path": "/bin/other-hook"}]}), &[&env("MIG-x")]), Ok(None));
        // Bug (issue 30, Podman 5.4 tried from outside): Podman 5 moves the hooks directory's
        // prestart hook to createRuntime; the toolkit's hook there is the same request.
        let podman5 = json!({"createRuntime": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]});
        assert_eq!(with(podman5, &[&env("all")]), Ok(Some(Visible::All)));
        // Bug (issue 10.1): a MIG device is refused, but only where the hook would read it.
        let mig = with(legacy, &[&env("0:1")]).unwrap_err().to_string();
        assert_eq!(
            mig,
            "process.env: NVIDIA_VISIBLE_DEVICES: \"0:1\" is a MIG device; MIG devices are not supported yet"
        );
    }

    /// Bug (issue 29, attack 2 B1): the toolkit's CDI spec lists the GPUs it gives in
    /// `linux.devices` and appends `NVIDIA_VISIBLE_DEVICES=void` after the image's `ENV`; its
    /// `nvidia-cdi-hook` makes no node. devremap read the value before the `void` (`all` in the
    /// nvidia/cuda images) and served every GPU of the device directory. With the CDI hook alone
    /// nothing is asked through a hook, whatever the env; with the legacy hook too, the last
    /// value (`void`) decides, as that hook reads it.
    #[test]
    fn the_cdi_hook_asks_for_no_gpu_whatever_the_env() {
        let with = |hooks: serde_json::Value, env: &[&str]| {
            let mut s = spec(json!([{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]), json!([]));
            s["hooks"] = hooks;
            s["process"]["env"] = json!(env);
            parse(s.to_string().as_bytes(), &no_files).unwrap()
        };
        let cdi = json!({"createContainer": [{"path": "/usr/bin/nvidia-cdi-hook", "args": ["nvidia-cdi-hook", "create-symlinks"]}]});
        let both = json!({"createContainer": [{"path": "/usr/bin/nvidia-cdi-hook"}],
                          "prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]});
        for env in [
            &["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"][..],
            &["NVIDIA_VISIBLE_DEVICES=0,1", "NVIDIA_VISIBLE_DEVICES=void"],
            &["NVIDIA_VISIBLE_DEVICES=all"],
            &["CUDA_VERSION=12.4.1"],
        ] {
            let view = with(cdi.clone(), env);
            assert_eq!(view.hook, None, "{env:?}");
            assert!(view.lists_gpus() && view.names_gpus(), "{env:?}: the spec's own GPU stays");
        }
        assert_eq!(with(both, &["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"]).hook, None);
    }

    /// What a spec with the legacy NVIDIA hook and `env` asks of it.
    fn legacy_hook_request(env: &[&str]) -> Result<Option<Visible>, SpecError> {
        let mut s = spec(json!([]), json!([]));
        s["hooks"] = json!({"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]});
        s["process"]["env"] = json!(env);
        parse(s.to_string().as_bytes(), &no_files).map(|v| v.hook)
    }

    /// Rule (issue 29.3, the toolkit's `DevicesFromEnvvars`): a legacy CUDA image
    /// (`CUDA_VERSION` set, `NVIDIA_REQUIRE_CUDA` unset or empty) without the variable asks the
    /// hook for every GPU; with the variable set, even empty, or in a newer image, the variable
    /// decides; the last of repeated entries counts, as the toolkit's map of the environment.
    #[test]
    fn a_legacy_cuda_image_without_the_variable_asks_for_every_gpu() {
        let with = legacy_hook_request;
        assert_eq!(with(&["CUDA_VERSION=12.4.1"]), Ok(Some(Visible::All)));
        assert_eq!(with(&["CUDA_VERSION=12.4.1", "NVIDIA_REQUIRE_CUDA="]), Ok(Some(Visible::All)));
        assert_eq!(with(&["CUDA_VERSION=12.4.1", "NVIDIA_REQUIRE_CUDA=cuda>=12.4"]), Ok(None));
        assert_eq!(with(&["CUDA_VERSION=12.4.1", "NVIDIA_VISIBLE_DEVICES="]), Ok(None));
        assert_eq!(with(&["CUDA_VERSION=12.4.1", "NVIDIA_VISIBLE_DEVICES=void"]), Ok(None));
        assert_eq!(with(&["CUDA_VERSION=11", "CUDA_VERSION="]), Ok(None), "the last CUDA_VERSION is empty");
        assert_eq!(with(&["CUDA_VERSIONX=1"]), Ok(None));
        assert_eq!(with(&["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=,"]), Ok(None));
    }

    /// Rule (the toolkit hook's `getDriverCapabilities`): `NVIDIA_DRIVER_CAPABILITIES` set and
    /// not empty gives what it lists (`all`: every capability; its last value counts); unset
    /// in a legacy CUDA image, every capability; otherwise (unset, or empty) the default,
    /// `compute,utility`: `compute` without `display`.
    #[test]
    fn the_hooks_driver_capabilities_are_read_as_the_toolkit_reads_them() {
        let caps = |env: &[&str]| {
            let mut s = spec(json!([]), json!([]));
            s["hooks"] = json!({"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]});
            s["process"]["env"] = json!(env);
            let view = parse(s.to_string().as_bytes(), &no_files).unwrap();
            (view.hook_capabilities.compute, view.hook_capabilities.display)
        };
        let (none, compute, display, all) = ((false, false), (true, false), (false, true), (true, true));
        assert_eq!(caps(&[]), compute, "unset: the default");
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES="]), compute, "empty: the default");
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES=utility"]), none);
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES=compute,utility"]), compute);
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES=graphics, display"]), display);
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES=all"]), all);
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"]), none, "the last");
        assert_eq!(caps(&["NVIDIA_DRIVER_CAPABILITIES=displayx,compute2"]), none, "names, not prefixes");
        assert_eq!(caps(&["CUDA_VERSION=12.4.1"]), all, "a legacy image without it");
        assert_eq!(caps(&["CUDA_VERSION=12.4.1", "NVIDIA_DRIVER_CAPABILITIES=utility"]), none);
        assert_eq!(caps(&["CUDA_VERSION=12.4.1", "NVIDIA_DRIVER_CAPABILITIES="]), compute, "set, empty: the default");
    }

    /// Rule (toolkit's map of the environment, held when attacked from outside): the last
    /// `NVIDIA_REQUIRE_CUDA` counts, so one emptied after it was set leaves a legacy image
    /// asking for every GPU, as the toolkit reads it; a legacy image whose variable is `void`,
    /// `none` or a list asks for that, not for every GPU; a `void` is not skipped for the
    /// legacy hook, only after the CDI hook's own.
    #[test]
    fn the_legacy_default_follows_the_last_entries() {
        let with = legacy_hook_request;
        let all = Ok(Some(Visible::All));
        assert_eq!(with(&["CUDA_VERSION=11.0", "NVIDIA_REQUIRE_CUDA=cuda>=11", "NVIDIA_REQUIRE_CUDA="]), all);
        assert_eq!(with(&["CUDA_VERSION=11.0", "NVIDIA_VISIBLE_DEVICES=none"]), Ok(Some(Visible::None)));
        assert_eq!(with(&["CUDA_VERSION=11.0", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=void"]), Ok(None));
        assert_eq!(
            with(&["CUDA_VERSION=11.0", "NVIDIA_VISIBLE_DEVICES=0,,1"]),
            Ok(Some(Visible::Devices(vec![Selector::Index(0), Selector::Index(1)])))
        );
    }

    /// Rule (issue 29.5, held when attacked from outside, measured with runc 1.1.5): the
    /// kernel reads `mode=` as an unsigned octal number and takes a leading `+`, so `mode=+700`
    /// is `0700` in the tree as runc's own `/dev` has it; `mode=0o700` fails the mount.
    #[test]
    fn a_tmpfs_mode_with_a_plus_sign_is_read_as_the_kernel_reads_it() {
        let s = spec(
            json!([]),
            json!([{"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["mode=+700"]}]),
        );
        let v = parse(s.to_string().as_bytes(), &no_files).unwrap();
        assert_eq!(v.dev_mounts[0].tmpfs_mode, Some(0o700));
    }

    /// Bug (issue 29, attack 2 B3, runc 1.1.5 measured): runc joins a tmpfs's data options with
    /// `,` and the kernel splits them again, the last `mode=` standing, its value read as
    /// `kstrtouint` reads it (a trailing newline taken); devremap took the last option starting
    /// with `mode=` whole, so runc chmodded `/dev/shm` to another mode than the tmpfs's own.
    /// A value the kernel refuses fails the mount (each case below measured with mount(2) on
    /// Linux 6.18: EINVAL); the tree then has tmpfs's `1777`.
    #[test]
    fn a_tmpfs_mode_is_read_from_the_options_as_the_kernel_reads_them() {
        let mode = |options: &[&str]| tmpfs_root_mode(options.iter().copied());
        assert_eq!(mode(&["size=1m,mode=700"]), 0o700);
        assert_eq!(mode(&["mode=700\n"]), 0o700);
        assert_eq!(mode(&["mode=700", "nr_inodes=0,mode=1777"]), 0o1777);
        assert_eq!(mode(&["nosuid", "mode=0750,size=64k", "noexec"]), 0o750);
        assert_eq!(mode(&["mode=37777777777"]), 0o7777, "32 bits, its permission bits");
        for refused in [
            &["mode="][..],
            &["mode=+"],
            &["mode=++700"],
            &["mode=-700"],
            &["mode=700\n\n"],
            &["mode= 700"],
            &["mode=0x1c0"],
            &["mode=40000000000"],
            &["mode=700,mode=8"],
            &["mode=x", "mode=700"],
        ] {
            assert_eq!(mode(refused), 0o1777, "{refused:?}: the kernel fails the mount");
        }
    }

    /// Rule (issue 29.5): a tmpfs mount's root mode is its last `mode=` option's permission
    /// bits, else tmpfs's `1777`; other mounts, bind mounts of type tmpfs included, have none.
    #[test]
    fn a_tmpfs_mount_has_its_root_mode() {
        let s = spec(
            json!([]),
            json!([{"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "mode=1777", "size=64k"]},
                   {"destination": "/dev/a", "type": "tmpfs", "source": "t"},
                   {"destination": "/dev/b", "type": "tmpfs", "source": "t", "options": ["mode=700", "mode=0750"]},
                   {"destination": "/dev/c", "type": "tmpfs", "source": "t", "options": ["mode=x"]},
                   {"destination": "/dev/d", "type": "tmpfs", "source": "t", "options": ["mode=107777"]},
                   {"destination": "/dev/e", "type": "tmpfs", "source": "/x", "options": ["rbind"]},
                   {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"}]),
        );
        let v = parse(s.to_string().as_bytes(), &no_files).unwrap();
        let modes: Vec<Option<u32>> = v.dev_mounts.iter().map(|m| m.tmpfs_mode).collect();
        assert_eq!(modes, [Some(0o1777), Some(0o1777), Some(0o750), Some(0o1777), Some(0o7777), None, None]);
    }

    /// Bug (found from outside): runc 1.1.5 (measured) chowns every node it makes: `uid` and
    /// `gid` 4294967295 leave it root's (chown's -1), and the chown clears set-user-ID, and
    /// set-group-ID with group execute. The plan served 0o7777 and owner 4294967295, which the
    /// kernel shows as nobody.
    #[test]
    fn access_is_what_runc_leaves_after_its_chown() {
        let access = |extra: serde_json::Value| {
            let mut d = json!({"path": "/dev/x", "type": "c", "major": 1, "minor": 3});
            d.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse(spec(json!([d]), json!([])).to_string().as_bytes(), &no_files).unwrap().devices[0].access
        };
        assert_eq!(
            access(json!({"uid": 4_294_967_295u32, "gid": 4_294_967_295u32, "fileMode": 0o600})),
            Access { mode: 0o600, uid: 0, gid: 0 }
        );
        assert_eq!(access(json!({"fileMode": 0o7777})).mode, 0o1777);
        assert_eq!(access(json!({"fileMode": 0o4640, "uid": 5, "gid": 6})), Access { mode: 0o640, uid: 5, gid: 6 });
        assert_eq!(access(json!({"fileMode": 0o2640})).mode, 0o2640, "set-group-ID without group execute stays");
    }

    /// Bug (found from outside): a spec saved with a byte-order mark was "expected value at
    /// line 1 column 1"; the error says what the text is.
    #[test]
    fn a_byte_order_mark_is_named() {
        let err = parse(b"\xef\xbb\xbf{\"ociVersion\":\"1.0.2\"}", &no_files).unwrap_err().to_string();
        assert_eq!(
            err,
            "not a valid OCI runtime spec: the text is UTF-8 with a byte-order mark; JSON is UTF-8 without a byte-order mark"
        );
    }

    /// Bug (issue 10.4): containerd wrote `fileMode` with the file-type bits set
    /// (containerd#5028); type bits matching the device's type are accepted and dropped, other
    /// type bits (which would make runc create another kind of node) are refused.
    #[test]
    fn file_mode_type_bits() {
        let mode = |typ: &str, file_mode: u32| {
            let d = json!({"path": "/dev/x", "type": typ, "major": 1, "minor": 3, "fileMode": file_mode});
            parse(spec(json!([d]), json!([])).to_string().as_bytes(), &no_files).map(|v| v.devices[0].access.mode)
        };
        assert_eq!(mode("c", 0o20666), Ok(0o666));
        assert_eq!(mode("u", 0o20600), Ok(0o600));
        assert_eq!(mode("b", 0o60660), Ok(0o660));
        assert_eq!(mode("p", 0o10644), Ok(0o644));
        assert_eq!(mode("c", 0o4755), Ok(0o755), "runc's chown clears set-user-ID");
        let err = mode("c", 0o60666).unwrap_err().to_string();
        assert_eq!(
            err,
            "linux.devices[0] (/dev/x): fileMode 0o60666: its file-type bits 0o60000 are not those of a char node (0o20000)"
        );
        assert!(mode("b", 0o20666).is_err());
        assert!(mode("c", 0o100666).is_err());
        assert!(mode("c", 0o1020666).unwrap_err().to_string().contains("beyond the file type and permission bits"));
    }

    /// Rule: a bind mount onto `/dev` whose source is a file needs a file mount point; the
    /// parser asks once, for bind mounts only, with the source as written.
    #[test]
    fn bind_sources_are_asked_once() {
        let s = spec(
            json!([]),
            json!([{"destination": "/dev/termination-log", "source": "log", "options": ["rbind"]},
                   {"destination": "/dev/data", "source": "data", "type": "bind"},
                   {"destination": "/dev/shm", "source": "log", "type": "tmpfs"}]),
        );
        let asked = std::cell::RefCell::new(Vec::new());
        let is_file = |src: &str| {
            asked.borrow_mut().push(src.to_owned());
            src == "log"
        };
        let v = parse(s.to_string().as_bytes(), &is_file).unwrap();
        assert_eq!(v.dev_mounts.iter().map(|m| m.onto_file).collect::<Vec<_>>(), [true, false, false]);
        assert_eq!(*asked.borrow(), ["log", "data"]);
    }

    /// Bug (found from outside): Go's `encoding/json`, which runc and the NVIDIA hook read the
    /// spec with, takes a struct's field without regard to case, the last key winning; serde
    /// takes the exact key. `"devices": [X], "Devices": []` gave devremap X and runc nothing, and
    /// `"env"`/`"Env"` gave it other GPUs than the hook's. Such a spec is refused, at any depth,
    /// the Kelvin sign and long s folded as Go folds them; keys of the spec's maps
    /// (annotations, sysctl, unified, rdma, netDevices: the last two found from outside),
    /// which Go keeps as written, may differ in case.
    #[test]
    fn keys_that_differ_only_in_case_are_refused_outside_the_maps() {
        let dev = json!({"path": "/dev/xmem", "type": "c", "major": 10, "minor": 229});
        let mut twice = spec(json!([dev]), json!([]));
        twice["linux"]["Devices"] = json!([]);
        let e = parse(twice.to_string().as_bytes(), &no_files).unwrap_err().to_string();
        assert!(e.contains(r#"keys "devices" and "Devices" differ only in case"#), "{e}");
        let mut env = spec(json!([]), json!([]));
        env["process"] = json!({"env": ["NVIDIA_VISIBLE_DEVICES=all"], "ENV": ["NVIDIA_VISIBLE_DEVICES=void"]});
        assert!(parse(env.to_string().as_bytes(), &no_files).is_err());
        let mut kelvin = spec(json!([]), json!([]));
        kelvin["linux"]["\u{212a}ernelMemory"] = json!(1);
        kelvin["linux"]["kernelMemory"] = json!(1);
        assert!(parse(kelvin.to_string().as_bytes(), &no_files).is_err(), "the Kelvin sign folds to k");
        let mut maps = spec(json!([dev]), json!([]));
        maps["annotations"] = json!({"a.example/Key": "1", "a.example/key": "2"});
        maps["linux"]["sysctl"] = json!({"net.X": "1", "net.x": "2"});
        maps["linux"]["resources"] =
            json!({"unified": {"io.Max": "1", "io.max": "2"}, "rdma": {"mlx5_0": {}, "MLX5_0": {}}});
        maps["linux"]["netDevices"] = json!({"eth0": {}, "ETH0": {}});
        assert!(parse(maps.to_string().as_bytes(), &no_files).is_ok());
    }

    /// Bad specs are refused: not a spec, wrong types, numbers out of range, `..` escapes.
    #[test]
    fn bad_specs() {
        assert!(matches!(parse(b"{", &no_files), Err(SpecError::Parse(_))));
        assert!(matches!(parse(b"[]", &no_files), Err(SpecError::Parse(_))));
        let bad_dev = |d: serde_json::Value| {
            parse(spec(json!([d]), json!([])).to_string().as_bytes(), &no_files).unwrap_err().to_string()
        };
        assert!(bad_dev(json!({"path": "/dev/x", "type": "c", "major": -1, "minor": 0})).contains("out of range"));
        assert!(bad_dev(json!({"path": "/dev/../etc/x", "type": "c", "major": 1, "minor": 3})).contains(".."));
        assert!(bad_dev(json!({"path": "/dev/x", "type": "a"})).contains("not a device node type"));
        assert!(bad_dev(json!({"path": "dev/x", "type": "c", "major": 1, "minor": 3})).contains("absolute"));
        let err = parse(
            spec(json!([]), json!([{"destination": "/dev/../x", "type": "tmpfs"}])).to_string().as_bytes(),
            &no_files,
        );
        assert!(matches!(err, Err(SpecError::Mount { .. })));
    }
}
