//! The KFD topology as CRIU's amdgpu plugin reads it, parsed from file contents (pure).
//!
//! The kernel's KFD driver (`drivers/gpu/drm/amd/amdkfd/kfd_topology.c`) publishes one
//! directory per HSA node under `/sys/class/kfd/kfd/topology/nodes/<N>/`: `gpu_id` (a number,
//! 0 for a CPU node), `name`, `properties` (one `name value` line per property, decimal), and
//! the subdirectories `mem_banks/<B>/properties` and `io_links/<L>/properties` in the same
//! form. CRIU's amdgpu plugin (`plugins/amdgpu/amdgpu_plugin_topology.c`, `topology_parse`)
//! reads exactly these files to pair a checkpoint's GPUs with the restore host's.
//!
//! Assumptions, each from those sources:
//! - A node whose `gpu_id` is 0 is a CPU, not a GPU (`NODE_IS_GPU`).
//! - A sysfs attribute is at most a page (4,096 bytes); anything longer is not a KFD file.
//! - Property names are lower-case words of at most 64 bytes (the plugin's `MAX_PARAMETER_LEN`);
//!   values are unsigned decimal numbers of at most 64 bits. A line of another shape makes the
//!   plugin fail the whole topology (`get_prop`), so it is an error here too.
//! - Most properties are 32-bit in the plugin (`(uint32_t)value`); [`Facts`] keeps what it keeps.
//! - The plugin lists the nodes in the order `readdir` gives them, which on sysfs (kernfs) is
//!   the order of [`kernfs_hash`] of the names, then the names; its pairing depends on that
//!   order, so [`Topology::new`] keeps it ([`kernfs_order`]).
//!
//! Every error names the file (relative to the host root) and what is wrong with it.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Where the nodes are, relative to the host root.
pub const NODES_DIR: &str = "sys/class/kfd/kfd/topology/nodes";
/// The most bytes a topology file may hold: one page, what a sysfs attribute can show.
pub const MAX_FILE_LEN: u64 = 4096;
/// The most nodes a topology may have. A host has one per CPU socket and one per GPU or GPU
/// partition (64 for eight MI300X in CPX mode).
pub const MAX_NODES: usize = 1024;
/// The most memory banks or IO links one node may have.
pub const MAX_ENTRIES: usize = 1024;
/// The longest property name the plugin reads (`MAX_PARAMETER_LEN`).
pub const MAX_NAME_LEN: usize = 64;
/// The memory bank heap types that hold a GPU's frame buffer (`HSA_HEAPTYPE_FRAME_BUFFER_*`).
const HEAP_PUBLIC: u64 = 1;
const HEAP_PRIVATE: u64 = 2;

/// Why a topology file is refused. `file` is the path relative to the host root.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TopologyError {
    #[error("{file}: missing")]
    Missing { file: String },
    #[error("{file}: {why}")]
    Unreadable { file: String, why: String },
    #[error("{file}: over {MAX_FILE_LEN} bytes, more than a sysfs file holds")]
    TooLarge { file: String },
    #[error("{file}: not UTF-8 text")]
    NotText { file: String },
    #[error("{file}: line {line}: {what}")]
    Line { file: String, line: usize, what: String },
    #[error("{file}: property {name} is given twice")]
    Duplicate { file: String, name: String },
    #[error("{file}: {what}")]
    Value { file: String, what: String },
    #[error("{dir}: more than {limit} entries")]
    TooMany { dir: String, limit: usize },
    #[error(
        "{dir}: no frame-buffer memory bank (mem_banks/*/properties with heap_type 1 or 2 and a \
         size_in_bytes above 0), which CRIU's amdgpu plugin needs for a GPU"
    )]
    NoVram { dir: String },
    #[error("{dir}: {what}")]
    Conflict { dir: String, what: String },
}

/// What reading one file gave, as the reader at the edge found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Text {
    Read(String),
    Missing,
    TooLarge,
    NotText,
    Unreadable(String),
}

impl Text {
    /// The text, or the error naming `file`.
    pub fn get(&self, file: &str) -> Result<&str, TopologyError> {
        let file = file.to_owned();
        match self {
            Text::Read(text) => Ok(text),
            Text::Missing => Err(TopologyError::Missing { file }),
            Text::TooLarge => Err(TopologyError::TooLarge { file }),
            Text::NotText => Err(TopologyError::NotText { file }),
            Text::Unreadable(why) => Err(TopologyError::Unreadable { file, why: why.clone() }),
        }
    }
}

/// The files of one node directory, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFiles {
    /// The directory's name: the node id.
    pub id: u32,
    pub gpu_id: Text,
    pub name: Text,
    pub properties: Text,
    /// `mem_banks/<B>/properties`, by `B`.
    pub mem_banks: Vec<(u32, Text)>,
    /// `io_links/<L>/properties`, by `L`.
    pub io_links: Vec<(u32, Text)>,
}

/// The `name value` lines of a properties file, in order.
pub type Properties = Vec<(String, u64)>;

/// Parses a properties file: one `name value` line each, as the kernel prints them.
pub fn parse_properties(file: &str, text: &str) -> Result<Properties, TopologyError> {
    let mut out: Properties = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |what: String| TopologyError::Line { file: file.to_owned(), line: i + 1, what };
        let Some((name, value)) = line.split_once(' ') else {
            return Err(bad("expected \"name value\"".into()));
        };
        if name.is_empty()
            || name.len() > MAX_NAME_LEN
            || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(bad(format!(
                "\"{}\" is not a property name (lower-case letters, digits and _, at most {MAX_NAME_LEN} bytes)",
                crate::inputs::limits::shorten(name)
            )));
        }
        if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(format!("{name}: \"{}\" is not a decimal number", crate::inputs::limits::shorten(value))));
        }
        let value: u64 = value.parse().map_err(|_| bad(format!("{name}: {value} is over 64 bits")))?;
        if out.iter().any(|(n, _)| n == name) {
            return Err(TopologyError::Duplicate { file: file.to_owned(), name: name.to_owned() });
        }
        out.push((name.to_owned(), value));
    }
    Ok(out)
}

fn get(props: &Properties, name: &str) -> Option<u64> {
    props.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
}

/// Parses a `gpu_id` file: a decimal number and a newline; 0 is a CPU node. KFD's gpu_id is a
/// 16-bit hash (`KFD_GPU_ID_HASH_WIDTH`), and the plugin reads at most 6 characters of it.
pub fn parse_gpu_id(file: &str, text: &str) -> Result<u32, TopologyError> {
    let value = text.strip_suffix('\n').unwrap_or(text);
    let bad = |what: String| TopologyError::Value { file: file.to_owned(), what };
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(format!("\"{}\" is not a gpu_id (a decimal number)", crate::inputs::limits::shorten(value))));
    }
    match value.parse::<u32>() {
        Ok(id) if id <= 0xffff => Ok(id),
        _ => Err(bad(format!("gpu_id {value} is over 65535; KFD's gpu_id is 16 bits"))),
    }
}

/// A GPU's facts as CRIU's amdgpu plugin compares them (`struct tp_node`, `device_properties_match`),
/// with the identity facts devremap shows. A property the file lacks is 0, as in the plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Facts {
    pub simd_count: u32,
    pub mem_banks_count: u32,
    pub caches_count: u32,
    pub io_links_count: u32,
    pub max_waves_per_simd: u32,
    pub lds_size_in_kb: u32,
    pub num_gws: u32,
    pub wave_front_size: u32,
    pub array_count: u32,
    pub simd_arrays_per_engine: u32,
    pub cu_per_simd_array: u32,
    pub simd_per_cu: u32,
    pub max_slots_scratch_cu: u32,
    pub vendor_id: u32,
    pub device_id: u32,
    pub domain: u32,
    pub drm_render_minor: u32,
    pub hive_id: u64,
    pub num_sdma_engines: u32,
    pub num_sdma_xgmi_engines: u32,
    pub num_sdma_queues_per_engine: u32,
    pub num_cp_queues: u32,
    pub fw_version: u32,
    pub capability: u32,
    pub sdma_fw_version: u32,
    pub vram_public: bool,
    pub vram_size: u64,
    /// Not compared by the plugin: the PCI location (bus << 8 | devfn), ISA and unique id.
    pub location_id: u32,
    pub gfx_target_version: u32,
    pub unique_id: u64,
}

impl Facts {
    fn from_properties(props: &Properties, vram: Vram) -> Facts {
        // The plugin keeps these in 32 bits: `(uint32_t)value`.
        let u = |name: &str| get(props, name).unwrap_or(0) as u32;
        Facts {
            simd_count: u("simd_count"),
            mem_banks_count: u("mem_banks_count"),
            caches_count: u("caches_count"),
            io_links_count: u("io_links_count"),
            max_waves_per_simd: u("max_waves_per_simd"),
            lds_size_in_kb: u("lds_size_in_kb"),
            num_gws: u("num_gws"),
            wave_front_size: u("wave_front_size"),
            array_count: u("array_count"),
            simd_arrays_per_engine: u("simd_arrays_per_engine"),
            cu_per_simd_array: u("cu_per_simd_array"),
            simd_per_cu: u("simd_per_cu"),
            max_slots_scratch_cu: u("max_slots_scratch_cu"),
            vendor_id: u("vendor_id"),
            device_id: u("device_id"),
            domain: u("domain"),
            drm_render_minor: u("drm_render_minor"),
            hive_id: get(props, "hive_id").unwrap_or(0),
            num_sdma_engines: u("num_sdma_engines"),
            num_sdma_xgmi_engines: u("num_sdma_xgmi_engines"),
            num_sdma_queues_per_engine: u("num_sdma_queues_per_engine"),
            num_cp_queues: u("num_cp_queues"),
            fw_version: u("fw_version"),
            capability: u("capability"),
            sdma_fw_version: u("sdma_fw_version"),
            vram_public: vram.public,
            vram_size: vram.size,
            location_id: u("location_id"),
            gfx_target_version: u("gfx_target_version"),
            unique_id: get(props, "unique_id").unwrap_or(0),
        }
    }

    /// The PCI address the location and domain give, `0000:0c:00.0`.
    pub fn pci_address(&self) -> String {
        let l = self.location_id;
        format!("{:04x}:{:02x}:{:02x}.{}", self.domain, (l >> 8) & 0xff, (l >> 3) & 0x1f, l & 7)
    }

    /// The ISA name the ISA version gives (`90402` is `gfx942`, `90010` is `gfx90a`: the minor
    /// and stepping are hex digits).
    pub fn gfx_name(&self) -> String {
        let v = self.gfx_target_version;
        format!("gfx{}{:x}{:x}", v / 10000, (v / 100) % 100, v % 100)
    }
}

/// A GPU's frame buffer, from its first memory bank of a frame-buffer heap type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Vram {
    pub public: bool,
    pub size: u64,
}

/// One IO link of a node: its type (2 PCIe, 11 XGMI; the plugin keeps only those) and the node
/// it leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    pub kind: u32,
    pub to: u32,
}

/// The IO link types the plugin keeps (`TOPO_IOLINK_TYPE_PCIE`, `TOPO_IOLINK_TYPE_XGMI`).
pub const LINK_PCIE: u32 = 2;
pub const LINK_XGMI: u32 = 11;

/// One node of the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub id: u32,
    /// 0 for a CPU node.
    pub gpu_id: u32,
    /// The `name` file, without its newline (`ip discovery`, `navi31`, empty for a CPU).
    pub name: String,
    /// For a GPU node; a CPU node's are not read, as the plugin does not read them.
    pub facts: Option<Facts>,
    /// The PCIe and XGMI links, in the order of their directories.
    pub links: Vec<Link>,
}

impl Node {
    pub fn is_gpu(&self) -> bool {
        self.gpu_id != 0
    }
}

/// Parses one node's files. `dir` is the node's directory relative to the host root.
pub fn parse_node(dir: &str, files: &NodeFiles) -> Result<Node, TopologyError> {
    let path = |rel: &str| format!("{dir}/{rel}");
    let gpu_id_file = path("gpu_id");
    let gpu_id = parse_gpu_id(&gpu_id_file, files.gpu_id.get(&gpu_id_file)?)?;
    let name_file = path("name");
    let name = files.name.get(&name_file)?;
    let name = name.strip_suffix('\n').unwrap_or(name);
    if name.chars().any(char::is_control) || name.len() > 64 {
        return Err(TopologyError::Value { file: name_file, what: "is not a node name".into() });
    }
    let props_file = path("properties");
    let props = parse_properties(&props_file, files.properties.get(&props_file)?)?;
    for (what, n) in [("mem_banks", files.mem_banks.len()), ("io_links", files.io_links.len())] {
        if n > MAX_ENTRIES {
            return Err(TopologyError::TooMany { dir: path(what), limit: MAX_ENTRIES });
        }
    }
    let mut links = Vec::new();
    for (i, text) in &files.io_links {
        let file = path(&format!("io_links/{i}/properties"));
        let link = parse_properties(&file, text.get(&file)?)?;
        let kind = get(&link, "type").unwrap_or(0) as u32;
        if kind == LINK_PCIE || kind == LINK_XGMI {
            links.push(Link { kind, to: get(&link, "node_to").unwrap_or(0) as u32 });
        }
    }
    if gpu_id == 0 {
        return Ok(Node { id: files.id, gpu_id, name: name.to_owned(), facts: None, links });
    }
    let minor = get(&props, "drm_render_minor").unwrap_or(0);
    if minor == 0 || minor > u64::from(crate::inputs::limits::MAX_FUSE_MINOR) {
        return Err(TopologyError::Value {
            file: props_file,
            what: format!("drm_render_minor {minor}: a GPU needs a render node's minor"),
        });
    }
    let vram = vram(dir, files)?;
    let facts = Facts::from_properties(&props, vram);
    Ok(Node { id: files.id, gpu_id, name: name.to_owned(), facts: Some(facts), links })
}

/// The first memory bank, in the order given, of a frame-buffer heap type, as the plugin's
/// `parse_topo_node_mem_banks` takes it.
fn vram(dir: &str, files: &NodeFiles) -> Result<Vram, TopologyError> {
    for (b, text) in &files.mem_banks {
        let file = format!("{dir}/mem_banks/{b}/properties");
        let bank = parse_properties(&file, text.get(&file)?)?;
        let heap = get(&bank, "heap_type").unwrap_or(0);
        if heap == HEAP_PUBLIC || heap == HEAP_PRIVATE {
            let size = get(&bank, "size_in_bytes").unwrap_or(0);
            if size == 0 {
                break;
            }
            return Ok(Vram { public: heap == HEAP_PUBLIC, size });
        }
    }
    Err(TopologyError::NoVram { dir: dir.to_owned() })
}

/// A host's topology: its nodes in the plugin's order ([`kernfs_order`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    pub nodes: Vec<Node>,
}

impl Topology {
    /// Builds a topology from its parsed nodes, in kernfs order. Two GPUs with one gpu_id or
    /// one render minor are refused: the plugin and the tree would each take only one.
    pub fn new(mut nodes: Vec<Node>) -> Result<Topology, TopologyError> {
        if nodes.len() > MAX_NODES {
            return Err(TopologyError::TooMany { dir: NODES_DIR.into(), limit: MAX_NODES });
        }
        nodes.sort_by_cached_key(|n| kernfs_order(&n.id.to_string()));
        let gpus: Vec<&Node> = nodes.iter().filter(|n| n.is_gpu()).collect();
        for (i, a) in gpus.iter().enumerate() {
            for b in &gpus[i + 1..] {
                let minor = |n: &Node| n.facts.as_ref().map_or(0, |f| f.drm_render_minor);
                let what = if a.gpu_id == b.gpu_id {
                    format!("nodes {} and {} have one gpu_id, {}", a.id, b.id, a.gpu_id)
                } else if minor(a) == minor(b) {
                    format!("nodes {} and {} have one drm_render_minor, {}", a.id, b.id, minor(a))
                } else {
                    continue;
                };
                return Err(TopologyError::Conflict { dir: NODES_DIR.into(), what });
            }
        }
        Ok(Topology { nodes })
    }

    /// Parses every node's files (`nodes`: each node's files, any order).
    pub fn parse(nodes: &[NodeFiles]) -> Result<Topology, TopologyError> {
        if nodes.len() > MAX_NODES {
            return Err(TopologyError::TooMany { dir: NODES_DIR.into(), limit: MAX_NODES });
        }
        let parsed = nodes.iter().map(|f| parse_node(&format!("{NODES_DIR}/{}", f.id), f)).collect::<Result<_, _>>()?;
        Topology::new(parsed)
    }

    /// The GPU nodes, in order.
    pub fn gpus(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.is_gpu())
    }

    /// The GPU whose render minor is `minor`.
    pub fn gpu_by_minor(&self, minor: u32) -> Option<&Node> {
        self.gpus().find(|n| n.facts.as_ref().is_some_and(|f| f.drm_render_minor == minor))
    }
}

/// kernfs's name hash (`fs/kernfs/dir.c`, `kernfs_name_hash`, with no namespace), which orders
/// a sysfs directory's entries: `readdir` lists them by this hash, then by name.
pub fn kernfs_hash(name: &str) -> u32 {
    // `partial_name_hash` over an unsigned long, then `end_name_hash` (`hash_long(hash, 32)`,
    // the 64-bit golden-ratio multiply).
    let mut hash: u64 = 0;
    for &c in name.as_bytes() {
        let c = u64::from(c);
        hash = hash.wrapping_add(c << 4).wrapping_add(c >> 4).wrapping_mul(11);
    }
    let mut hash = (hash.wrapping_mul(0x61C8_8646_80B5_83EB) >> 32) as u32;
    hash &= 0x7fff_ffff;
    if hash < 2 {
        hash += 2;
    }
    if hash >= 0x7fff_ffff {
        hash = 0x7fff_fffe;
    }
    hash
}

/// The key that sorts names in the order sysfs lists them.
pub fn kernfs_order(name: &str) -> (u32, String) {
    (kernfs_hash(name), name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(id: u32, gpu_id: &str, props: &str) -> NodeFiles {
        NodeFiles {
            id,
            gpu_id: Text::Read(gpu_id.into()),
            name: Text::Read("ip discovery\n".into()),
            properties: Text::Read(props.into()),
            mem_banks: vec![(0, Text::Read("heap_type 1\nsize_in_bytes 1024\n".into()))],
            io_links: vec![],
        }
    }

    /// Kernel fact: properties are `name value` lines; the plugin fails the whole topology on a
    /// line of another shape, so devremap refuses it too, naming the file and line.
    #[test]
    fn properties_lines_are_name_and_decimal_value() {
        let ok = parse_properties("p", "simd_count 1216\nhive_id 10631624818852212319\n").unwrap();
        assert_eq!(ok, vec![("simd_count".into(), 1216), ("hive_id".into(), 10631624818852212319)]);
        assert_eq!(parse_properties("p", "").unwrap(), vec![]);
        for (text, what) in [
            ("simd_count\n", "line 1: expected \"name value\""),
            ("a 1\n\nb 2\n", "line 2: expected \"name value\""),
            ("a 1\nSimd 2\n", "line 2: \"Simd\" is not a property name"),
            ("a -1\n", "line 1: a: \"-1\" is not a decimal number"),
            ("a 0x10\n", "is not a decimal number"),
            ("a 1 2\n", "\"1 2\" is not a decimal number"),
            ("a 18446744073709551616\n", "a: 18446744073709551616 is over 64 bits"),
            ("a 1\na 2\n", "p: property a is given twice"),
        ] {
            let err = parse_properties("p", text).unwrap_err().to_string();
            assert!(err.contains(what) && err.starts_with("p: "), "{text:?}: {err}");
        }
        let long = format!("{} 1\n", "a".repeat(65));
        assert!(parse_properties("p", &long).is_err());
        assert!(parse_properties("p", &format!("{} 1\n", "a".repeat(64))).is_ok());
    }

    /// Kernel fact: gpu_id is a 16-bit hash in decimal, 0 for a CPU node.
    #[test]
    fn gpu_ids_are_16_bit_decimal() {
        assert_eq!(parse_gpu_id("g", "0\n"), Ok(0));
        assert_eq!(parse_gpu_id("g", "53538\n"), Ok(53538));
        assert_eq!(parse_gpu_id("g", "65535"), Ok(65535));
        for bad in ["", "\n", "65536\n", "0x10\n", " 1\n", "1\n\n", "99999999999999999999\n"] {
            let err = parse_gpu_id("g", bad).unwrap_err().to_string();
            assert!(err.starts_with("g: "), "{bad:?}: {err}");
        }
    }

    /// Rule: a missing, huge or non-text file is an error naming it, never a panic or a skip.
    #[test]
    fn unreadable_files_name_themselves() {
        let mut f = files(3, "5\n", "drm_render_minor 128\n");
        f.properties = Text::Missing;
        assert_eq!(parse_node("n/3", &f).unwrap_err().to_string(), "n/3/properties: missing");
        f.properties = Text::TooLarge;
        assert_eq!(
            parse_node("n/3", &f).unwrap_err().to_string(),
            "n/3/properties: over 4096 bytes, more than a sysfs file holds"
        );
        f.properties = Text::Read("drm_render_minor 128\n".into());
        f.gpu_id = Text::NotText;
        assert_eq!(parse_node("n/3", &f).unwrap_err().to_string(), "n/3/gpu_id: not UTF-8 text");
        f.gpu_id = Text::Unreadable("permission denied".into());
        assert_eq!(parse_node("n/3", &f).unwrap_err().to_string(), "n/3/gpu_id: permission denied");
        f.gpu_id = Text::Read("5\n".into());
        f.mem_banks[0].1 = Text::Read("heap_type 0\nsize_in_bytes 10\n".into());
        assert!(matches!(parse_node("n/3", &f), Err(TopologyError::NoVram { .. })));
        f.mem_banks.clear();
        assert!(parse_node("n/3", &f).unwrap_err().to_string().starts_with("n/3: no frame-buffer memory bank"));
    }

    /// Rule: a GPU node names its render node; a CPU node (gpu_id 0) needs neither minor nor
    /// memory bank.
    #[test]
    fn gpus_need_a_render_minor_and_cpus_nothing() {
        let f = files(3, "5\n", "simd_count 4\n");
        let err = parse_node("n/3", &f).unwrap_err().to_string();
        assert_eq!(err, "n/3/properties: drm_render_minor 0: a GPU needs a render node's minor");
        let mut cpu = files(0, "0\n", "cpu_cores_count 16\n");
        cpu.mem_banks.clear();
        let node = parse_node("n/0", &cpu).unwrap();
        assert!(!node.is_gpu() && node.facts.is_none());
    }

    /// Rule: two GPUs with one gpu_id or one render minor are refused.
    #[test]
    fn duplicate_gpus_are_refused() {
        let a = parse_node("n/1", &files(1, "5\n", "drm_render_minor 128\n")).unwrap();
        let b = parse_node("n/2", &files(2, "5\n", "drm_render_minor 129\n")).unwrap();
        let c = parse_node("n/3", &files(3, "6\n", "drm_render_minor 128\n")).unwrap();
        let err = Topology::new(vec![a.clone(), b]).unwrap_err().to_string();
        assert!(err.contains("have one gpu_id, 5"), "{err}");
        let err = Topology::new(vec![a, c]).unwrap_err().to_string();
        assert!(err.contains("have one drm_render_minor, 128"), "{err}");
    }

    /// Kernel fact: sysfs lists a directory by kernfs_name_hash, then name (checked against
    /// `ls -f` of /sys/module, /sys/kernel/slab and /sys/class/tty on Linux 6.1): node 10 comes
    /// before node 2, and the order is not the names' order.
    #[test]
    fn nodes_are_in_the_order_sysfs_lists_them() {
        let mut names: Vec<String> = (0..12).map(|i| i.to_string()).collect();
        names.sort_by_cached_key(|n| kernfs_order(n));
        let sorted: Vec<String> = (0..12).map(|i| i.to_string()).collect();
        assert_ne!(names, sorted);
        // Each hash is in kernfs's range: 2 ..= INT_MAX - 1.
        assert!(names.iter().all(|n| (2..0x7fff_ffff).contains(&kernfs_hash(n))));
        assert_eq!(names.len(), 12);
    }

    /// The ISA and PCI address as tools print them.
    #[test]
    fn gfx_names_and_pci_addresses() {
        let f = Facts { gfx_target_version: 90010, location_id: 0xc100, ..Facts::default() };
        assert_eq!(f.gfx_name(), "gfx90a");
        assert_eq!(f.pci_address(), "0000:c1:00.0");
        let f = Facts { gfx_target_version: 110000, domain: 1, location_id: 0x0309, ..Facts::default() };
        assert_eq!(f.gfx_name(), "gfx1100");
        assert_eq!(f.pci_address(), "0001:03:01.1");
    }

    mod garbage {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// Rule: no input makes the parser panic; what it accepts it gives back line by line.
            #[test]
            fn properties_never_panic(text in "\\PC{0,200}") {
                if let Ok(props) = parse_properties("p", &text) {
                    prop_assert_eq!(props.len(), text.lines().count());
                }
            }

            #[test]
            fn near_miss_lines_never_panic(lines in proptest::collection::vec("[a-z_]{0,70}[ ]{0,2}[0-9a-z-]{0,22}", 0..20)) {
                let text = lines.join("\n");
                let _ = parse_properties("p", &text);
                let _ = parse_gpu_id("g", &text);
            }

            #[test]
            fn nodes_never_panic(gpu_id in "[0-9]{0,7}\n?", props in "([a-z_]{1,12} [0-9]{1,21}\n){0,12}", banks in proptest::collection::vec("(heap_type [0-3]\n)?(size_in_bytes [0-9]{1,5}\n)?", 0..3)) {
                let f = NodeFiles {
                    id: 1,
                    gpu_id: Text::Read(gpu_id),
                    name: Text::Read("x\n".into()),
                    properties: Text::Read(props),
                    mem_banks: banks.into_iter().enumerate().map(|(i, b)| (i as u32, Text::Read(b))).collect(),
                    io_links: vec![(0, Text::Read("type 11\nnode_to 2\n".into()))],
                };
                let _ = parse_node("n/1", &f);
            }
        }
    }
}
