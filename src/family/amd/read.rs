//! Reading a host's KFD topology: the thin edge in front of [`topology`](super::topology).
//!
//! Lists `<host-root>/sys/class/kfd/kfd/topology/nodes/`, and in each node directory (a name
//! of ASCII digits; the plugin skips other names too) `mem_banks/` and `io_links/`, without
//! following symlinks to directories; reads each file through [`files`](crate::inputs::files), which
//! takes only regular files and reads at most one byte past the limit. A numbered entry that is
//! a symlink is skipped with a warning naming it (the plugin reads only directories). A host without the
//! directory has no KFD (no AMD GPU driver loaded): an empty topology, not an error. Every
//! other failure is a [`TopologyError`] naming the file.

use super::topology::{MAX_ENTRIES, MAX_FILE_LEN, MAX_NODES, NODES_DIR, NodeFiles, Text, Topology, TopologyError};
use crate::inputs::files;
use std::io;
use std::path::Path;

/// Reads and parses the topology under `root`; what it skips is said in `warnings`.
pub fn read_topology(root: &Path, warnings: &mut Vec<String>) -> Result<Topology, TopologyError> {
    let dir = root.join(NODES_DIR);
    let mut skipped = |rel: String| {
        warnings.push(format!(
            "{}/{rel}: is a symlink, which is not followed; skipped",
            root.to_string_lossy().trim_end_matches('/')
        ))
    };
    let ids = match numbered_dirs(&dir, NODES_DIR, MAX_NODES, &mut skipped) {
        Err(TopologyError::Missing { .. }) => return Ok(Topology { nodes: vec![] }),
        other => other?,
    };
    let mut nodes = Vec::with_capacity(ids.len());
    for id in ids {
        let rel = format!("{NODES_DIR}/{id}");
        let node = dir.join(id.to_string());
        let mut list = |sub: &str| -> Result<Vec<(u32, Text)>, TopologyError> {
            numbered_dirs(&node.join(sub), &format!("{rel}/{sub}"), MAX_ENTRIES, &mut skipped)
                .or_else(|e| if matches!(e, TopologyError::Missing { .. }) { Ok(vec![]) } else { Err(e) })?
                .into_iter()
                .map(|n| Ok((n, read_text(&node.join(format!("{sub}/{n}/properties"))))))
                .collect()
        };
        nodes.push(NodeFiles {
            id,
            gpu_id: read_text(&node.join("gpu_id")),
            name: read_text(&node.join("name")),
            properties: read_text(&node.join("properties")),
            mem_banks: list("mem_banks")?,
            io_links: list("io_links")?,
        });
    }
    Topology::parse(&nodes)
}

/// The numbers that name subdirectories of `dir` (other names are skipped, as the plugin
/// does; a symlink under such a name is given to `symlink` by its path, `rel/<name>`), at most
/// `limit`, sorted. `rel` names `dir` in errors.
fn numbered_dirs(
    dir: &Path,
    rel: &str,
    limit: usize,
    symlink: &mut dyn FnMut(String),
) -> Result<Vec<u32>, TopologyError> {
    let io = |e: io::Error| match e.kind() {
        io::ErrorKind::NotFound => TopologyError::Missing { file: rel.to_owned() },
        _ => TopologyError::Unreadable { file: rel.to_owned(), why: crate::io_message(&e) },
    };
    let meta = std::fs::symlink_metadata(dir).map_err(io)?;
    if !meta.is_dir() {
        use std::os::unix::fs::MetadataExt;
        let what = format!("is {}; expected a directory", files::describe(meta.mode()));
        return Err(TopologyError::Unreadable { file: rel.to_owned(), why: what });
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(n) = name.parse::<u32>() else { continue };
        let file_type = entry.file_type().map_err(io)?;
        if file_type.is_symlink() {
            symlink(format!("{rel}/{name}"));
        }
        if !file_type.is_dir() {
            continue;
        }
        if out.len() == limit {
            return Err(TopologyError::TooMany { dir: rel.to_owned(), limit });
        }
        out.push(n);
    }
    out.sort_unstable();
    Ok(out)
}

/// One file's text, bounded by [`MAX_FILE_LEN`].
fn read_text(path: &Path) -> Text {
    let mut file = match files::open_regular(path) {
        Ok(file) => file,
        Err(files::FileError::Io(e)) if e.kind() == io::ErrorKind::NotFound => return Text::Missing,
        Err(e) => return Text::Unreadable(e.to_string()),
    };
    match files::read_at_most(&mut file, MAX_FILE_LEN) {
        Ok(Some(bytes)) => String::from_utf8(bytes).map_or(Text::NotText, Text::Read),
        Ok(None) => Text::TooLarge,
        Err(e) => Text::Unreadable(crate::io_message(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(machine: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/amd").join(machine)
    }

    /// What each fixture machine holds: its CPU nodes are not GPUs, its GPUs have their render
    /// minors, ISA, vram, and links (fixtures copied in shape from the machines in
    /// tests/fixtures/amd/README.md).
    #[test]
    fn every_fixture_parses() {
        for (machine, cpus, minors, gfx, hive) in [
            ("mi300x-8", 2, (0..8).map(|i| 128 + 8 * i).collect::<Vec<u32>>(), "gfx942", true),
            ("mi300x-cpx", 1, (128..136).collect(), "gfx942", true),
            ("mi210-2", 1, vec![128, 129], "gfx90a", false),
            ("radeon-7900xtx-2", 1, vec![128, 129], "gfx1100", false),
        ] {
            let topo = read_topology(&fixture(machine), &mut vec![]).unwrap_or_else(|e| panic!("{machine}: {e}"));
            assert_eq!(topo.nodes.iter().filter(|n| !n.is_gpu()).count(), cpus, "{machine}");
            let mut got: Vec<u32> = topo.gpus().map(|n| n.facts.as_ref().unwrap().drm_render_minor).collect();
            got.sort_unstable();
            assert_eq!(got, minors, "{machine}");
            for gpu in topo.gpus() {
                let f = gpu.facts.as_ref().unwrap();
                assert_eq!((f.vendor_id, f.gfx_name().as_str()), (0x1002, gfx), "{machine}");
                assert!(f.vram_size > 0 && f.vram_public, "{machine}");
                assert_eq!(f.hive_id != 0, hive, "{machine}");
                assert!(gpu.links.iter().any(|l| l.kind == super::super::topology::LINK_PCIE), "{machine}");
                assert_eq!(gpu.links.len() as u32, f.io_links_count, "{machine}");
            }
            // The order is sysfs's, not the names'.
            let ids: Vec<u32> = topo.nodes.iter().map(|n| n.id).collect();
            let keys: Vec<_> = ids.iter().map(|i| super::super::topology::kernfs_order(&i.to_string())).collect();
            assert!(keys.windows(2).all(|w| w[0] < w[1]), "{machine}: {ids:?}");
        }
    }

    /// Rule: a host without KFD has no AMD GPUs (an empty topology); a topology directory that
    /// is a file is an error naming it.
    #[test]
    fn no_kfd_is_no_gpus() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_topology(dir.path(), &mut vec![]).unwrap().nodes, vec![]);
        let nodes = dir.path().join(NODES_DIR);
        std::fs::create_dir_all(nodes.parent().unwrap()).unwrap();
        std::fs::write(&nodes, "").unwrap();
        let err = read_topology(dir.path(), &mut vec![]).unwrap_err().to_string();
        assert_eq!(err, format!("{NODES_DIR}: is a regular file; expected a directory"));
    }

    /// Topology node 1 under `root`, a GPU with one memory bank, but no `properties` file yet.
    fn gpu_node_without_properties(root: &Path) -> PathBuf {
        let node = root.join(NODES_DIR).join("1");
        std::fs::create_dir_all(node.join("mem_banks/0")).unwrap();
        std::fs::write(node.join("gpu_id"), "7\n").unwrap();
        std::fs::write(node.join("name"), "navi31\n").unwrap();
        std::fs::write(node.join("mem_banks/0/properties"), "heap_type 1\nsize_in_bytes 4096\n").unwrap();
        node
    }

    /// Bug (issue 29.7): a numbered topology entry that is a symlink (`nodes/N`,
    /// `mem_banks/N`) was skipped without a word; it is still skipped, never followed, and a
    /// warning names it under the host root.
    #[test]
    fn a_symlinked_topology_entry_is_skipped_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let node = gpu_node_without_properties(dir.path());
        std::fs::write(node.join("properties"), "drm_render_minor 128\n").unwrap();
        std::os::unix::fs::symlink(&node, dir.path().join(NODES_DIR).join("2")).unwrap();
        std::os::unix::fs::symlink(node.join("mem_banks/0"), node.join("mem_banks/1")).unwrap();
        let mut warnings = vec![];
        let topo = read_topology(dir.path(), &mut warnings).unwrap();
        assert_eq!(topo.nodes.len(), 1);
        let root = dir.path().to_string_lossy().into_owned();
        assert_eq!(
            warnings,
            [
                format!("{root}/{NODES_DIR}/2: is a symlink, which is not followed; skipped"),
                format!("{root}/{NODES_DIR}/1/mem_banks/1: is a symlink, which is not followed; skipped"),
            ]
        );
    }

    /// Rule: a huge, missing, or non-regular file is an error naming it; a file over a page is
    /// read only one byte past the page.
    #[test]
    fn bad_files_on_disk_name_themselves() {
        let dir = tempfile::tempdir().unwrap();
        let node = gpu_node_without_properties(dir.path());
        std::fs::write(node.join("properties"), "simd_count 1\n".repeat(10_000)).unwrap();
        let err = read_topology(dir.path(), &mut vec![]).unwrap_err().to_string();
        assert_eq!(err, format!("{NODES_DIR}/1/properties: over 4096 bytes, more than a sysfs file holds"));
        std::fs::remove_file(node.join("properties")).unwrap();
        let err = read_topology(dir.path(), &mut vec![]).unwrap_err().to_string();
        assert_eq!(err, format!("{NODES_DIR}/1/properties: missing"));
        std::fs::create_dir(node.join("properties")).unwrap();
        let err = read_topology(dir.path(), &mut vec![]).unwrap_err().to_string();
        assert_eq!(err, format!("{NODES_DIR}/1/properties: is a directory; expected a regular file"));
        std::fs::remove_dir(node.join("properties")).unwrap();
        std::fs::write(node.join("properties"), b"drm_render_minor 128\n\xff\n").unwrap();
        let err = read_topology(dir.path(), &mut vec![]).unwrap_err().to_string();
        assert_eq!(err, format!("{NODES_DIR}/1/properties: not UTF-8 text"));
        std::fs::write(node.join("properties"), "drm_render_minor 128\n").unwrap();
        let topo = read_topology(dir.path(), &mut vec![]).unwrap();
        assert_eq!(topo.gpus().count(), 1);
    }
}
