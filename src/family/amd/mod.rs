//! The AMD family: `/dev/dri/renderD<N>` GPUs, `/dev/kfd`, the KFD topology, and the pairing
//! CRIU's amdgpu plugin makes.
//!
//! A ROCm process holds `/dev/kfd` and one `/dev/dri/renderD<N>` per GPU. CRIU's amdgpu plugin
//! restores it onto GPUs it chooses itself from the restore host's KFD topology, and opens
//! `/dev/dri/renderD<minor of that GPU>` in the container; the process's own paths name the
//! checkpoint host's minors. [`topology`] parses the topology files (pure), [`read`] reads them
//! under a host root (the edge), [`plugin`] makes the plugin's choice (pure) with the property
//! match of [`properties`], and [`pairing`] pairs saved with restored GPUs for the tree, with
//! `--device-map` and warnings (pure).
//!
//! Assumptions: a render node is char 226:N with N >= 128 (`DRM_MAJOR`, the render minors
//! start at 128); `renderD<N>`'s N is ASCII digits without a leading zero, as the kernel names
//! them; `/dev/kfd`'s major is dynamic, so it passes through as the host's `lstat` gives it, read
//! again at every load. `card<N>` (the display node) is never opened by the plugin or a ROCm
//! process for compute: it is served only where the spec lists it, as a spec device.

pub mod metadata;
pub mod pairing;
pub mod plan;
pub mod plugin;
pub mod products;
pub mod properties;
pub mod read;
mod show;
pub mod topology;

use super::Family;
use super::facts::HostFacts;
use crate::device::{DevKind, Rdev};
use crate::inputs::host::{DevDir, DevDirScan, HostError};
use crate::inputs::limits::MAX_FUSE_MINOR;
use std::path::Path;

/// The DRM character major (`DRM_MAJOR`).
pub const DRM_MAJOR: u32 = 226;
/// The first render minor.
pub const FIRST_RENDER_MINOR: u32 = 128;
/// The last render minor CRIU's amdgpu plugin opens (`open_drm_render_device` refuses others).
pub const PLUGIN_LAST_MINOR: u32 = 255;
const DRI_DIR: &str = "dri";
const RENDER_PREFIX: &str = "renderD";
const KFD: &str = "kfd";

/// The AMD family ([`super::AMD`]).
pub struct Amd;

impl Family for Amd {
    /// `dri/renderD<N>` char devices (N under 128 or a leading zero is an error), the `dri`
    /// directory opened without following a symlink (one is skipped with a warning), and `kfd`
    /// as a pass-through node.
    fn scan_dev_dir(&self, dir: &mut DevDir, scan: &mut DevDirScan) -> Result<(), HostError> {
        if let Some(mut dri) = dir.subdir(DRI_DIR, &mut scan.warnings)? {
            for name in dri.names(RENDER_PREFIX)? {
                let minor = render_minor_of_name(&name).map_err(|m| HostError::BadName(dri.path(&name), m))?;
                scan.amd.push((minor, dri.char_node(&name)?));
            }
        }
        if dir.names(KFD)?.iter().any(|n| n == KFD) {
            scan.passthrough.push(dir.char_node(KFD)?);
        }
        Ok(())
    }

    /// Reads `<root>/sys/class/kfd/kfd/topology/nodes/*`. A topology that cannot be parsed is
    /// left out with a warning naming the file: the AMD GPUs' facts are then unknown, and the
    /// reason is kept (`amd_unread`) for what must say so (`record` refuses such a GPU).
    fn read_host_facts(&self, root: &Path, facts: &mut HostFacts) {
        match read::read_topology(root, &mut facts.warnings) {
            Ok(topology) => facts.amd = topology,
            Err(e) => {
                let why = format!("{}/{e}", root.to_string_lossy().trim_end_matches('/'));
                facts.warnings.push(facts_unknown(&why));
                facts.amd_unread = Some(why);
            }
        }
    }

    fn gpu_name(&self, minor: u32) -> String {
        format!("{DRI_DIR}/{RENDER_PREFIX}{minor}")
    }

    /// A render node: char 226:N, N >= 128.
    fn gpu_minor_of_device(&self, kind: DevKind, rdev: Rdev) -> Option<u32> {
        (kind == DevKind::Char && rdev.major == DRM_MAJOR && rdev.minor >= FIRST_RENDER_MINOR).then_some(rdev.minor)
    }

    /// No hook of AMD's adds a node: `kfd` is given only where the spec lists it.
    fn hook_gives(&self, _rel_path: &str, _spec: &crate::inputs::spec::SpecView) -> bool {
        false
    }
}

/// The warning for a KFD topology that could not be read (`why` names the file).
pub fn facts_unknown(why: &str) -> String {
    format!("{why}; the AMD GPUs' KFD facts are unknown")
}

/// The render minor `renderD<N>` names, or why the name is wrong.
pub fn render_minor_of_name(name: &str) -> Result<u32, String> {
    let digits = name.strip_prefix(RENDER_PREFIX).unwrap_or(name);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("render node name {name:?}: expected renderD and a number"));
    }
    if digits.len() > 1 && digits.starts_with('0') {
        return Err(format!("render node name {name:?} has a leading zero; the kernel never makes one"));
    }
    match digits.parse::<u32>() {
        Ok(m) if (FIRST_RENDER_MINOR..=MAX_FUSE_MINOR).contains(&m) => Ok(m),
        _ => Err(format!("render node name {name:?}: the minor is not in {FIRST_RENDER_MINOR}-{MAX_FUSE_MINOR}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bug (issue 29.7): a `dri` (or `nvidia-caps`) directory that is a symlink was skipped
    /// without a word, its render nodes missing from the tree; the scan says so, one line
    /// naming the path, and still follows no symlink.
    #[test]
    fn a_symlinked_node_directory_is_skipped_with_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        let (dev, elsewhere) = (tmp.path().join("dev"), tmp.path().join("elsewhere"));
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::create_dir(&dev).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dev.join("dri")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dev.join("nvidia-caps")).unwrap();
        let scan = crate::family::table::scan_dev_dir(&dev).unwrap();
        assert!(scan.amd.is_empty() && scan.passthrough.is_empty());
        let said = |name: &str| {
            format!(
                "{}: is a symlink, which is not followed; the nodes under it are not served",
                dev.join(name).display()
            )
        };
        assert_eq!(scan.warnings, [said("nvidia-caps"), said("dri")]);
        std::fs::remove_file(dev.join("dri")).unwrap();
        std::fs::write(dev.join("dri"), "").unwrap();
        assert_eq!(
            crate::family::table::scan_dev_dir(&dev).unwrap().warnings,
            [said("nvidia-caps")],
            "a file is no directory"
        );
    }

    /// Rule: only `renderD` + ASCII digits from 128 is a render node name.
    #[test]
    fn render_names() {
        assert_eq!(render_minor_of_name("renderD128"), Ok(128));
        assert_eq!(render_minor_of_name("renderD300"), Ok(300));
        for bad in ["renderD", "renderD127", "renderD0128", "renderDx", "renderD\u{0663}", "renderD99999999999"] {
            assert!(render_minor_of_name(bad).is_err(), "{bad}");
        }
        assert_eq!(Amd.gpu_name(136), "dri/renderD136");
        assert_eq!(Amd.gpu_minor_of_device(DevKind::Char, Rdev::new(226, 136)), Some(136));
        assert_eq!(Amd.gpu_minor_of_device(DevKind::Char, Rdev::new(226, 0)), None);
        assert_eq!(Amd.gpu_minor_of_device(DevKind::Block, Rdev::new(226, 128)), None);
    }
}
