//! CRIU's amdgpu plugin's pairing of checkpointed GPUs with the restore host's, step for step.
//!
//! Pure. The plugin (`plugins/amdgpu/amdgpu_plugin_topology.c`, `set_restore_gpu_maps`) has no
//! operator map: it pairs by itself, and opens `/dev/dri/renderD<minor of the GPU it chose>`.
//! So that a checkpoint's render node leads to the GPU the process is restored onto, devremap
//! makes the same choice, with the same rules in the same order:
//!
//! 1. as many GPUs on each side (`Number of devices mismatch`), and no more XGMI hives saved
//!    than restored;
//! 2. the XGMI hives first: each saved hive onto a restored hive (`match_xgmi_groups`), each
//!    of its GPUs onto one of that hive's GPUs (`map_devices`), backtracking;
//! 3. then the other GPUs, backtracking (`map_devices`), over lists built head-first, so in the
//!    reverse of the nodes' order;
//! 4. a saved GPU maps onto a restored one when `device_properties_match` holds (equal
//!    properties; `capability` equal and `vram_size`, `num_gws`, `caches_count`, `fw_version`,
//!    `sdma_fw_version` no smaller, each unless its `KFD_*_CHECK` is off), it has no more valid
//!    IO links, and its links to CPUs agree with the CPU mapping made so far (`KFD_NUMA_CHECK`).
//!
//! The search is the plugin's, list for list: the candidates are tried in the order its linked
//! lists hold them, including how a failed branch reorders them, and its quirks are kept (a
//! hive's size is never compared, since `num_nodes` is never set; a hive whose later hives fail
//! leaves its mappings behind). Where several restored GPUs fit, the first one found wins, as in
//! the plugin, so the node order matters: each side's GPUs come in the order the plugin reads
//! them (kernfs order of the node directories; a checkpoint's in the order it recorded).
//!
//! The backtracking is exponential at worst, in the plugin as here: past [`BUDGET`] attempts
//! the choice is [`Refusal::Unknown`], which the caller reports as unknowable.

use super::properties::{Checks, mismatch};
use super::topology::{Facts, LINK_XGMI, Topology};
use serde::{Deserialize, Serialize};

/// The most GPU-onto-GPU attempts (`map_device` calls) tried before giving up on knowing.
pub const BUDGET: usize = 200_000;

/// One valid IO link of a GPU (to a node present on its side), as the plugin keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLink {
    /// 2 (PCIe) or 11 (XGMI).
    pub kind: u32,
    /// The node it leads to.
    pub to: u32,
    /// Whether that node is a GPU (else a CPU).
    pub to_gpu: bool,
    /// Whether that node has a link of the same type back (a bi-directional link).
    pub peer: bool,
}

/// A GPU as the plugin pairs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Its node id on its host.
    pub node: u32,
    pub gpu_id: u32,
    pub facts: Facts,
    pub links: Vec<GpuLink>,
}

/// The GPUs of `topology` that `visible` keeps, with their valid links, in the topology's
/// order: what the plugin sees from a container whose device cgroup lets it read only those
/// GPUs' nodes (every CPU node stays). As `topology_determine_iolinks`: a link is valid when
/// its node is there, and bi-directional when that node links back with the same type.
pub fn visible_gpus(topology: &Topology, visible: impl Fn(u32) -> bool) -> Vec<Gpu> {
    let present: Vec<&super::topology::Node> = topology.nodes.iter().filter(|n| !n.is_gpu() || visible(n.id)).collect();
    let find = |id: u32| present.iter().find(|n| n.id == id);
    present
        .iter()
        .filter(|n| n.is_gpu())
        .map(|n| Gpu {
            node: n.id,
            gpu_id: n.gpu_id,
            facts: n.facts.clone().unwrap_or_default(),
            links: n
                .links
                .iter()
                .filter_map(|l| {
                    let to = find(l.to)?;
                    let peer = to.links.iter().any(|b| b.to == n.id && b.kind == l.kind);
                    Some(GpuLink { kind: l.kind, to: l.to, to_gpu: to.is_gpu(), peer })
                })
                .collect(),
        })
        .collect()
}

/// Why the plugin would not pair, in its own words where it has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The plugin refuses the restore: `Number of devices mismatch`, `Failed to match ...`.
    Refused(String),
    /// The search ran past [`BUDGET`]: devremap cannot say what the plugin would choose.
    Unknown(String),
}

/// The plugin's choice: for each saved GPU (by index), the restored GPU (by index) it restores
/// the process onto.
pub fn choose(saved: &[Gpu], restored: &[Gpu], checks: &Checks) -> Result<Vec<(usize, usize)>, Refusal> {
    // The plugin forms the hives (`topology_determine_iolinks`) before it counts.
    let src_groups = hives(saved)?;
    let dest_groups = hives(restored)?;
    if saved.len() != restored.len() {
        return Err(Refusal::Refused(format!(
            "Number of devices mismatch (checkpointed:{} local:{})",
            saved.len(),
            restored.len()
        )));
    }
    let mut search = Search::new(saved, restored, *checks);
    if src_groups.len() > dest_groups.len() {
        return Err(Refusal::Refused(format!(
            "Number of xgmi groups mismatch (checkpointed:{} local:{})",
            src_groups.len(),
            dest_groups.len()
        )));
    }
    let mut maps = Maps::default();
    if !src_groups.is_empty() {
        let s = saved.len();
        let mut groups = Lists::new(src_groups.len() + dest_groups.len());
        let (src_head, dest_head) = (groups.new_head(), groups.new_head());
        let split = src_groups.len();
        let members: Vec<Vec<usize>> = src_groups
            .into_iter()
            .chain(dest_groups.into_iter().map(|g| g.into_iter().map(|i| i + s).collect()))
            .collect();
        for g in 0..members.len() {
            groups.add_tail(g, if g < split { src_head } else { dest_head });
        }
        if !search.match_groups(&mut groups, &members, src_head, dest_head, &mut maps)? {
            return Err(Refusal::Refused("Failed to match all GPU groups".into()));
        }
    }
    let (src_head, dest_head) = (search.lists.new_head(), search.lists.new_head());
    for (i, gpu) in saved.iter().enumerate() {
        if maps.dest_gpu(gpu.gpu_id).is_none() {
            search.lists.add(i, src_head);
        }
    }
    for (j, gpu) in restored.iter().enumerate() {
        if !maps.gpu.iter().any(|&(_, d)| d == gpu.gpu_id) {
            search.lists.add(saved.len() + j, dest_head);
        }
    }
    if !search.map_devices(src_head, dest_head, &mut maps)? {
        return Err(Refusal::Refused("Failed to match remaining nodes".into()));
    }
    let mut pairs: Vec<(usize, usize)> = (0..saved.len())
        .map(|i| {
            let dest = maps.dest_gpu(saved[i].gpu_id).unwrap_or(0);
            (i, restored.iter().position(|r| r.gpu_id == dest).unwrap_or(usize::MAX))
        })
        .collect();
    pairs.retain(|&(_, j)| j != usize::MAX);
    if pairs.len() != saved.len() {
        return Err(Refusal::Unknown("the plugin's maps left a GPU out".into()));
    }
    Ok(pairs)
}

/// The XGMI hives of one side, as `topology_determine_iolinks` forms them: over the GPUs in
/// order, each bi-directional XGMI link puts its two GPUs in the group of the first (a new one
/// if it has none). Members are indexes into `gpus`, in the order they joined. A GPU the plugin
/// would put in a second group (links that are not one clique per hive) corrupts its lists, and
/// it then loops or crashes (measured: the plugin's own code on such topologies): unknown.
fn hives(gpus: &[Gpu]) -> Result<Vec<Vec<usize>>, Refusal> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, gpu) in gpus.iter().enumerate() {
        for link in gpu.links.iter().filter(|l| l.kind == LINK_XGMI && l.to_gpu && l.peer) {
            let Some(peer) = gpus.iter().position(|g| g.node == link.to) else { continue };
            let g = match groups.iter().position(|g| g.contains(&i)) {
                Some(g) => g,
                None => {
                    groups.push(vec![i]);
                    groups.len() - 1
                }
            };
            if groups[g].contains(&peer) {
                continue;
            }
            if groups.iter().any(|g| g.contains(&peer)) {
                return Err(Refusal::Unknown(format!(
                    "the XGMI links of node {} are no hive the plugin can form: it would put node {} in two",
                    gpu.node, gpus[peer].node
                )));
            }
            groups[g].push(peer);
        }
    }
    Ok(groups)
}

/// The plugin's `struct device_maps`: entries newest first, as `maps_push` splices them in.
#[derive(Debug, Default, Clone)]
struct Maps {
    gpu: Vec<(u32, u32)>,
    cpu: Vec<(u32, u32)>,
}

impl Maps {
    fn dest_gpu(&self, src: u32) -> Option<u32> {
        self.gpu.iter().find(|&&(s, _)| s == src).map(|&(_, d)| d)
    }
    fn dest_cpu(&self, src: u32) -> Option<u32> {
        self.cpu.iter().find(|&&(s, _)| s == src).map(|&(_, d)| d)
    }
    fn cpu_taken(&self, dest: u32) -> bool {
        self.cpu.iter().any(|&(_, d)| d == dest)
    }

    /// `maps_push`: refused when a new entry's source or destination is already mapped.
    fn push(&mut self, new: &Maps) -> bool {
        let clash = |old: &[(u32, u32)], new: &[(u32, u32)]| {
            new.iter().any(|&(s, d)| old.iter().any(|&(os, od)| os == s || od == d))
        };
        if clash(&self.cpu, &new.cpu) || clash(&self.gpu, &new.gpu) {
            return false;
        }
        self.cpu.splice(0..0, new.cpu.iter().copied());
        self.gpu.splice(0..0, new.gpu.iter().copied());
        true
    }

    /// `maps_pop`: takes back what `push` of `new` put in, at the front.
    fn pop(&mut self, new: &Maps) {
        self.cpu.drain(..new.cpu.len().min(self.cpu.len()));
        self.gpu.drain(..new.gpu.len().min(self.gpu.len()));
    }
}

/// Doubly-linked lists over indexes, with the kernel list operations the plugin uses, so that
/// its searches visit candidates in exactly its order. Items are `0..items`; heads follow.
struct Lists {
    next: Vec<usize>,
    prev: Vec<usize>,
}

impl Lists {
    fn new(items: usize) -> Self {
        Lists { next: (0..items).collect(), prev: (0..items).collect() }
    }
    fn new_head(&mut self) -> usize {
        let h = self.next.len();
        self.next.push(h);
        self.prev.push(h);
        h
    }
    fn insert(&mut self, item: usize, prev: usize, next: usize) {
        self.next[prev] = item;
        self.prev[next] = item;
        self.next[item] = next;
        self.prev[item] = prev;
    }
    /// `list_add`: right after the head.
    fn add(&mut self, item: usize, head: usize) {
        let next = self.next[head];
        self.insert(item, head, next);
    }
    /// `list_add_tail`: right before the head.
    fn add_tail(&mut self, item: usize, head: usize) {
        let prev = self.prev[head];
        self.insert(item, prev, head);
    }
    /// `list_del`.
    fn del(&mut self, item: usize) {
        let (prev, next) = (self.prev[item], self.next[item]);
        self.next[prev] = next;
        self.prev[next] = prev;
    }
}

struct Search<'a> {
    gpus: Vec<&'a Gpu>,
    lists: Lists,
    checks: Checks,
    tries: usize,
}

impl<'a> Search<'a> {
    fn new(saved: &'a [Gpu], restored: &'a [Gpu], checks: Checks) -> Self {
        let gpus: Vec<&Gpu> = saved.iter().chain(restored).collect();
        let lists = Lists::new(gpus.len());
        Search { gpus, lists, checks, tries: 0 }
    }

    /// `match_xgmi_groups`.
    fn match_groups(
        &mut self,
        groups: &mut Lists,
        members: &[Vec<usize>],
        src_head: usize,
        dest_head: usize,
        maps: &mut Maps,
    ) -> Result<bool, Refusal> {
        let src_group = groups.next[src_head];
        if src_group == src_head {
            return Ok(true);
        }
        groups.del(src_group);
        let mut dest_group = groups.next[dest_head];
        while dest_group != dest_head {
            let following = groups.next[dest_group];
            let (src_nodes, dest_nodes) = (self.lists.new_head(), self.lists.new_head());
            for &n in &members[src_group] {
                self.lists.add_tail(n, src_nodes);
            }
            for &n in &members[dest_group] {
                self.lists.add_tail(n, dest_nodes);
            }
            if self.map_devices(src_nodes, dest_nodes, maps)? {
                groups.del(dest_group);
                if self.match_groups(groups, members, src_head, dest_head, maps)? {
                    return Ok(true);
                }
                groups.add(dest_group, dest_head);
            }
            dest_group = following;
        }
        groups.add_tail(src_group, src_head);
        Ok(false)
    }

    /// `map_devices`.
    fn map_devices(&mut self, src_head: usize, dest_head: usize, maps: &mut Maps) -> Result<bool, Refusal> {
        let src = self.lists.next[src_head];
        if src == src_head {
            return Ok(true);
        }
        self.lists.del(src);
        let mut dest = self.lists.next[dest_head];
        while dest != dest_head {
            let following = self.lists.next[dest];
            let mut new_maps = Maps::default();
            if self.map_device(src, dest, maps, &mut new_maps)? {
                self.lists.del(dest);
                if !maps.push(&new_maps) {
                    return Ok(false);
                }
                if self.map_devices(src_head, dest_head, maps)? {
                    return Ok(true);
                }
                self.lists.add(dest, dest_head);
                maps.pop(&new_maps);
            }
            dest = following;
        }
        self.lists.add(src, src_head);
        Ok(false)
    }

    /// `map_device`: whether GPU `s` can be restored onto GPU `d`; the CPU and GPU entries it
    /// implies go into `new_maps`.
    fn map_device(&mut self, s: usize, d: usize, maps: &Maps, new_maps: &mut Maps) -> Result<bool, Refusal> {
        self.tries += 1;
        if self.tries > BUDGET {
            return Err(Refusal::Unknown(format!(
                "the plugin's search takes more than {BUDGET} attempts on these GPUs"
            )));
        }
        let (src, dest) = (self.gpus[s], self.gpus[d]);
        if mismatch(&src.facts, &dest.facts, &self.checks).is_some() || src.links.len() > dest.links.len() {
            return Ok(false);
        }
        for link in src.links.iter().filter(|l| !l.to_gpu) {
            let fits = |d: &GpuLink| iolink_match(link, d);
            let matched = if !self.checks.numa {
                dest.links.iter().any(fits)
            } else if let Some(cpu) = maps.dest_cpu(link.to).or_else(|| new_maps.dest_cpu(link.to)) {
                dest.links.iter().find(|d| d.to == cpu && d.kind == link.kind).is_some_and(fits)
            } else if let Some(d) =
                dest.links.iter().find(|d| fits(d) && !maps.cpu_taken(d.to) && !new_maps.cpu_taken(d.to))
            {
                new_maps.cpu.push((link.to, d.to));
                true
            } else {
                false
            };
            if !matched {
                return Ok(false);
            }
        }
        new_maps.gpu.push((src.gpu_id, dest.gpu_id));
        Ok(true)
    }
}

/// `iolink_match`: whether `dest` can stand for `src`: both to a GPU or both to a CPU, an XGMI
/// link not replaced by PCIe, a bi-directional one not by a one-way one.
fn iolink_match(src: &GpuLink, dest: &GpuLink) -> bool {
    src.to_gpu == dest.to_gpu && !(src.kind == LINK_XGMI && dest.kind != LINK_XGMI) && (!src.peer || dest.peer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::amd::topology::LINK_PCIE;

    fn gpu(node: u32, gpu_id: u32, device_id: u32, cpu: u32) -> Gpu {
        let facts = Facts { device_id, vendor_id: 0x1002, vram_size: 1 << 30, io_links_count: 1, ..Facts::default() };
        Gpu { node, gpu_id, facts, links: vec![GpuLink { kind: LINK_PCIE, to: cpu, to_gpu: false, peer: true }] }
    }

    fn hive(gpus: &mut [Gpu]) {
        let nodes: Vec<u32> = gpus.iter().map(|g| g.node).collect();
        for g in gpus.iter_mut() {
            for &n in nodes.iter().filter(|&&n| n != g.node) {
                g.links.push(GpuLink { kind: LINK_XGMI, to: n, to_gpu: true, peer: true });
            }
            g.facts.io_links_count = g.links.len() as u32;
        }
    }

    /// Rule (plugin): the counts must be equal, not merely enough.
    #[test]
    fn counts_must_be_equal() {
        let saved = vec![gpu(1, 10, 0x74a1, 0)];
        let restored = vec![gpu(1, 20, 0x74a1, 0), gpu(2, 21, 0x74a1, 0)];
        assert_eq!(
            choose(&saved, &restored, &Checks::default()),
            Err(Refusal::Refused("Number of devices mismatch (checkpointed:1 local:2)".into()))
        );
    }

    /// Rule (plugin): the remaining GPUs are tried from the last node back, each onto the first
    /// fitting restored GPU from the last node back: identical GPUs pair in order.
    #[test]
    fn identical_gpus_pair_in_node_order() {
        let saved: Vec<Gpu> = (0..4).map(|i| gpu(i + 1, 100 + i, 0x74a1, 0)).collect();
        let restored: Vec<Gpu> = (0..4).map(|i| gpu(i + 1, 200 + i, 0x74a1, 0)).collect();
        let pairs = choose(&saved, &restored, &Checks::default()).unwrap();
        assert_eq!(pairs, vec![(0, 0), (1, 1), (2, 2), (3, 3)]);
    }

    /// Rule (plugin): the device ids must match, whatever the order; backtracking finds the
    /// only fit.
    #[test]
    fn models_pair_with_their_own_kind() {
        let saved = vec![gpu(1, 10, 0x740f, 0), gpu(2, 11, 0x744c, 0)];
        let restored = vec![gpu(1, 20, 0x744c, 0), gpu(2, 21, 0x740f, 0)];
        assert_eq!(choose(&saved, &restored, &Checks::default()).unwrap(), vec![(0, 1), (1, 0)]);
        let restored = vec![gpu(1, 20, 0x744c, 0), gpu(2, 21, 0x744c, 0)];
        assert_eq!(
            choose(&saved, &restored, &Checks::default()),
            Err(Refusal::Refused("Failed to match remaining nodes".into()))
        );
    }

    /// Rule (plugin): firmware may be newer on the restore host, not older, unless
    /// KFD_FW_VER_CHECK=0; the same for the other "at least" properties.
    #[test]
    fn older_firmware_is_refused_unless_relaxed() {
        let mut saved = vec![gpu(1, 10, 0x744c, 0)];
        saved[0].facts.fw_version = 2150;
        let mut restored = vec![gpu(1, 20, 0x744c, 0)];
        restored[0].facts.fw_version = 2140;
        assert!(choose(&saved, &restored, &Checks::default()).is_err());
        assert_eq!(
            mismatch(&saved[0].facts, &restored[0].facts, &Checks::default()).as_deref(),
            Some("fw_version 2150 vs 2140, smaller (KFD_FW_VER_CHECK)")
        );
        let relaxed = Checks { fw_version: false, ..Checks::default() };
        assert_eq!(choose(&saved, &restored, &relaxed).unwrap(), vec![(0, 0)]);
        restored[0].facts.fw_version = 2160;
        assert_eq!(choose(&saved, &restored, &Checks::default()).unwrap(), vec![(0, 0)]);
    }

    /// Rule (plugin): hives first; a saved hive goes onto a restored hive of its kind, so the
    /// hive of 0xD000 GPUs follows its device id even when the restore host lists it second
    /// (the plugin's test 0, test_topology_remap.c, in small).
    #[test]
    fn hives_go_onto_hives_of_their_kind() {
        let mut a: Vec<Gpu> = (0..2).map(|i| gpu(2 + i, 0xa000 + i, 0xd000, 0)).collect();
        let mut b: Vec<Gpu> = (0..2).map(|i| gpu(4 + i, 0xa010 + i, 0xd001, 0)).collect();
        hive(&mut a);
        hive(&mut b);
        let saved: Vec<Gpu> = a.into_iter().chain(b).collect();
        let mut c: Vec<Gpu> = (0..2).map(|i| gpu(2 + i, 0xb000 + i, 0xd001, 0)).collect();
        let mut d: Vec<Gpu> = (0..2).map(|i| gpu(4 + i, 0xb010 + i, 0xd000, 0)).collect();
        hive(&mut c);
        hive(&mut d);
        let restored: Vec<Gpu> = c.into_iter().chain(d).collect();
        assert_eq!(hives(&saved), Ok(vec![vec![0, 1], vec![2, 3]]));
        let pairs = choose(&saved, &restored, &Checks::default()).unwrap();
        for (s, r) in pairs {
            assert_eq!(saved[s].facts.device_id, restored[r].facts.device_id);
        }
    }

    /// Rule (plugin): with KFD_NUMA_CHECK on, GPUs that shared a CPU keep sharing one: two
    /// saved GPUs on CPU 0 cannot go onto GPUs on different CPUs.
    #[test]
    fn numa_check_keeps_gpus_that_shared_a_socket_together() {
        let saved = vec![gpu(2, 10, 0x74a1, 0), gpu(3, 11, 0x74a1, 0)];
        let restored = vec![gpu(2, 20, 0x74a1, 0), gpu(3, 21, 0x74a1, 1)];
        assert!(matches!(choose(&saved, &restored, &Checks::default()), Err(Refusal::Refused(_))));
        let relaxed = Checks { numa: false, ..Checks::default() };
        assert_eq!(choose(&saved, &restored, &relaxed).unwrap(), vec![(0, 0), (1, 1)]);
    }

    /// Rule: a search past the budget is unknown, never a hang. Five GPUs of one model whose
    /// firmware differs (three saved need the newer one, four restored have it): the plugin's
    /// own code loops on this (measured: its topology code built alone, killed after 3 s),
    /// and the emulation stops at the budget.
    #[test]
    fn a_search_the_plugin_never_ends_is_unknown() {
        let with_fw = |(node, gpu_id, fw): (u32, u32, u32)| {
            let mut g = gpu(node, gpu_id, 1, 0);
            g.facts.fw_version = fw;
            g
        };
        let saved: Vec<Gpu> = [(1, 131, 2), (2, 20462, 2), (4, 50353, 2), (3, 34344, 1), (5, 37387, 1)]
            .into_iter()
            .map(with_fw)
            .collect();
        let restored: Vec<Gpu> = [(4, 22222, 2), (5, 53049, 1), (3, 42321, 2), (1, 42168, 2), (2, 25422, 2)]
            .into_iter()
            .map(with_fw)
            .collect();
        let checks = Checks { numa: false, ..Checks::default() };
        let got = choose(&saved, &restored, &checks);
        assert!(matches!(got, Err(Refusal::Unknown(_))), "{got:?}");
    }
}
