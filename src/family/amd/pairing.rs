//! Pairing saved AMD GPUs with restored ones for the tree: the plugin's choice, `--device-map`
//! overrides, and what devremap cannot know.
//!
//! Pure. CRIU's amdgpu plugin chooses the GPU a process is restored onto by itself
//! ([`plugin::choose`]); the tree must lead the checkpoint's render node to that GPU, so that
//! choice is the rule. `--device-map OLD=NEW` (render minors) still wins: an operator who knows
//! better (a plugin built with other rules, another `KFD_*_CHECK` setting) says so; where it
//! differs from the plugin's choice the plan warns. Where the plugin would refuse the restore,
//! or its choice cannot be known, what `--device-map` leaves is paired by position in
//! render-minor order, and the plan says so for each GPU.

use super::plugin::{self, Gpu, Refusal};
use super::properties::Checks;
use std::collections::BTreeSet;
use thiserror::Error;

/// Which rule paired a saved GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum By {
    /// The plugin's own choice.
    Plugin,
    /// `--device-map`.
    Explicit,
    /// By position: the plugin's choice is unknown or it refuses.
    Position,
}

impl By {
    pub fn as_str(self) -> &'static str {
        match self {
            By::Plugin => "plugin",
            By::Explicit => "explicit",
            By::Position => "position",
        }
    }
}

/// A saved GPU (index into the saved list) and the restored GPU (index) it now means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    pub saved: usize,
    pub restored: usize,
    pub by: By,
}

/// The pairs, with what the plan must say about them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pairing {
    pub pairs: Vec<Pair>,
    /// Saved GPUs nothing is left for (fewer restored GPUs).
    pub unpaired: Vec<usize>,
    pub warnings: Vec<String>,
    /// The plugin's words when it will refuse this restore.
    pub refusal: Option<String>,
}

/// Why `--device-map` cannot be used as given.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PairError {
    #[error("renderD{0} is no saved AMD GPU")]
    NotSaved(u32),
    #[error("renderD{0} is no restored AMD GPU")]
    NotRestored(u32),
    #[error("renderD{0} is given twice")]
    Twice(u32),
}

fn minor(gpu: &Gpu) -> u32 {
    gpu.facts.drm_render_minor
}

/// Pairs `saved` with `restored` (each in the plugin's order), honouring `explicit`
/// (`(saved render minor, restored render minor)`).
pub fn pair(saved: &[Gpu], restored: &[Gpu], checks: &Checks, explicit: &[(u32, u32)]) -> Result<Pairing, PairError> {
    pair_with(saved, restored, explicit, plugin::choose(saved, restored, checks))
}

/// [`pair`] with the plugin's `choice` already made (or known to be unknowable).
pub fn pair_with(
    saved: &[Gpu],
    restored: &[Gpu],
    explicit: &[(u32, u32)],
    choice: Result<Vec<(usize, usize)>, Refusal>,
) -> Result<Pairing, PairError> {
    let mut out = Pairing::default();
    let mut seen = (BTreeSet::new(), BTreeSet::new());
    let mut taken = vec![false; restored.len()];
    for &(old, new) in explicit {
        let s = saved.iter().position(|g| minor(g) == old).ok_or(PairError::NotSaved(old))?;
        let r = restored.iter().position(|g| minor(g) == new).ok_or(PairError::NotRestored(new))?;
        if !seen.0.insert(old) {
            return Err(PairError::Twice(old));
        }
        if !seen.1.insert(new) {
            return Err(PairError::Twice(new));
        }
        taken[r] = true;
        out.pairs.push(Pair { saved: s, restored: r, by: By::Explicit });
    }
    let mut left: Vec<usize> = (0..saved.len()).filter(|&s| !out.pairs.iter().any(|p| p.saved == s)).collect();
    match &choice {
        Ok(map) => {
            for &(s, r) in map {
                if let Some(p) = out.pairs.iter().find(|p| p.saved == s).filter(|p| p.restored != r) {
                    out.warnings.push(format!(
                        "renderD{}: --device-map leads it to renderD{}, but CRIU's amdgpu plugin restores its \
                         process onto renderD{}",
                        minor(&saved[s]),
                        minor(&restored[p.restored]),
                        minor(&restored[r])
                    ));
                } else if left.contains(&s) && !taken[r] {
                    taken[r] = true;
                    out.pairs.push(Pair { saved: s, restored: r, by: By::Plugin });
                }
            }
            left.retain(|&s| !out.pairs.iter().any(|p| p.saved == s));
        }
        Err(Refusal::Refused(why)) => {
            out.warnings.push(format!("CRIU's amdgpu plugin will refuse this restore: {why}"));
            out.refusal = Some(why.clone());
        }
        Err(Refusal::Unknown(_)) => {}
    }
    // What is left, by position in render-minor order.
    left.sort_by_key(|&s| minor(&saved[s]));
    let mut free: Vec<usize> = (0..restored.len()).filter(|&r| !taken[r]).collect();
    free.sort_by_key(|&r| minor(&restored[r]));
    let mut free = free.into_iter();
    for s in left {
        let Some(r) = free.next() else {
            out.unpaired.push(s);
            continue;
        };
        let why = match &choice {
            Err(Refusal::Unknown(why)) => why.clone(),
            Err(Refusal::Refused(_)) => "the plugin refuses this restore".into(),
            Ok(_) => "--device-map took the GPU the plugin chose".into(),
        };
        out.warnings.push(format!(
            "renderD{}: devremap cannot know which GPU CRIU's amdgpu plugin restores it onto ({why}); \
             paired by position with renderD{}",
            minor(&saved[s]),
            minor(&restored[r])
        ));
        out.pairs.push(Pair { saved: s, restored: r, by: By::Position });
    }
    out.pairs.sort_by_key(|p| minor(&saved[p.saved]));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::amd::plugin::visible_gpus;
    use crate::family::amd::read::read_topology;
    use std::path::Path;

    fn host(machine: &str) -> crate::family::amd::topology::Topology {
        read_topology(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/amd").join(machine), &mut vec![])
            .unwrap()
    }

    fn all(machine: &str) -> Vec<Gpu> {
        visible_gpus(&host(machine), |_| true)
    }

    fn minors(side: &[Gpu], pairing: &Pairing, restored: &[Gpu]) -> Vec<(u32, u32, By)> {
        pairing.pairs.iter().map(|p| (minor(&side[p.saved]), minor(&restored[p.restored]), p.by)).collect()
    }

    /// Rule: a restore onto the same host's same GPUs leads every render node to itself, on
    /// every fixture machine (the plugin's choice, so no warning).
    #[test]
    fn the_same_host_pairs_each_gpu_with_itself() {
        for machine in ["mi300x-8", "mi300x-cpx", "mi210-2", "radeon-7900xtx-2"] {
            let gpus = all(machine);
            let pairing = pair(&gpus, &gpus, &Checks::default(), &[]).unwrap();
            assert!(pairing.warnings.is_empty() && pairing.refusal.is_none(), "{machine}: {pairing:?}");
            for (old, new, by) in minors(&gpus, &pairing, &gpus) {
                assert_eq!((old, by), (new, By::Plugin), "{machine}");
            }
            assert_eq!(pairing.pairs.len(), gpus.len());
        }
    }

    /// Bug (CRIU #2723): a container that had one MI300X (renderD144 on the checkpoint host)
    /// restored with another one (renderD136 here): the checkpoint's renderD144 leads to the
    /// GPU the plugin restores onto.
    #[test]
    fn one_mi300x_onto_another() {
        let topo = host("mi300x-8");
        let by_minor = |m: u32| topo.gpu_by_minor(m).unwrap().id;
        let saved = visible_gpus(&topo, |id| id == by_minor(144));
        let restored = visible_gpus(&topo, |id| id == by_minor(136));
        let pairing = pair(&saved, &restored, &Checks::default(), &[]).unwrap();
        assert_eq!(minors(&saved, &pairing, &restored), vec![(144, 136, By::Plugin)]);
    }

    /// Rule (plugin, KFD_NUMA_CHECK): on the two-socket MI300X host, a container with two GPUs
    /// on one socket cannot be restored onto two GPUs on different sockets; devremap says the
    /// plugin will refuse and pairs by position. Relaxed, the plugin pairs them.
    #[test]
    fn a_container_split_across_sockets_is_refused_unless_relaxed() {
        let topo = host("mi300x-8");
        let ids = |minors: &[u32]| -> Vec<u32> { minors.iter().map(|&m| topo.gpu_by_minor(m).unwrap().id).collect() };
        let (a, b) = (ids(&[128, 136]), ids(&[144, 160]));
        let saved = visible_gpus(&topo, |id| a.contains(&id));
        let restored = visible_gpus(&topo, |id| b.contains(&id));
        let pairing = pair(&saved, &restored, &Checks::default(), &[]).unwrap();
        assert!(pairing.refusal.is_some(), "{pairing:?}");
        assert!(minors(&saved, &pairing, &restored).iter().all(|p| p.2 == By::Position));
        let relaxed = Checks { numa: false, ..Checks::default() };
        let pairing = pair(&saved, &restored, &relaxed, &[]).unwrap();
        assert!(pairing.refusal.is_none() && pairing.pairs.iter().all(|p| p.by == By::Plugin), "{pairing:?}");
    }

    /// Rule (plugin): the RX 7900 XTX with MEC firmware 2150 cannot go onto the one with 2140,
    /// but the reverse is fine; with one GPU each way the plugin's choice follows firmware.
    #[test]
    fn firmware_decides_between_two_radeons() {
        let topo = host("radeon-7900xtx-2");
        let newer = topo.gpu_by_minor(128).unwrap().id;
        let older = topo.gpu_by_minor(129).unwrap().id;
        let from_older = visible_gpus(&topo, |id| id == older);
        let onto_newer = visible_gpus(&topo, |id| id == newer);
        let pairing = pair(&from_older, &onto_newer, &Checks::default(), &[]).unwrap();
        assert_eq!(minors(&from_older, &pairing, &onto_newer), vec![(129, 128, By::Plugin)]);
        let pairing = pair(&onto_newer, &from_older, &Checks::default(), &[]).unwrap();
        assert_eq!(pairing.refusal.as_deref(), Some("Failed to match remaining nodes"));
    }

    /// Rule: --device-map wins; where it differs from the plugin's choice the plan warns, and
    /// the GPU it took from the plugin's choice is paired by position, with a warning.
    #[test]
    fn device_map_wins_with_a_warning() {
        let gpus = all("mi210-2");
        let pairing = pair(&gpus, &gpus, &Checks::default(), &[(128, 129)]).unwrap();
        assert_eq!(minors(&gpus, &pairing, &gpus), vec![(128, 129, By::Explicit), (129, 128, By::Position)]);
        assert!(
            pairing.warnings[0].contains("renderD128: --device-map leads it to renderD129, but CRIU's amdgpu plugin")
        );
        assert!(pairing.warnings[1].contains("renderD129: devremap cannot know"), "{:?}", pairing.warnings);
        let agreed = pair(&gpus, &gpus, &Checks::default(), &[(128, 128)]).unwrap();
        assert!(agreed.warnings.is_empty());
        assert_eq!(pair(&gpus, &gpus, &Checks::default(), &[(130, 128)]), Err(PairError::NotSaved(130)));
        assert_eq!(pair(&gpus, &gpus, &Checks::default(), &[(128, 131)]), Err(PairError::NotRestored(131)));
        assert_eq!(pair(&gpus, &gpus, &Checks::default(), &[(128, 128), (128, 129)]), Err(PairError::Twice(128)));
    }

    /// Rule: another model cannot take the plugin's restore (an MI210 checkpoint onto a Radeon
    /// host): the plugin refuses, devremap says so and still serves the names by position.
    #[test]
    fn another_model_is_a_refusal_by_position() {
        let saved = all("mi210-2");
        let restored = all("radeon-7900xtx-2");
        let pairing = pair(&saved, &restored, &Checks::default(), &[]).unwrap();
        assert_eq!(pairing.refusal.as_deref(), Some("Failed to match remaining nodes"));
        assert_eq!(minors(&saved, &pairing, &restored), vec![(128, 128, By::Position), (129, 129, By::Position)]);
        let fewer = &restored[..1];
        let pairing = pair(&saved, fewer, &Checks::default(), &[]).unwrap();
        assert_eq!(pairing.unpaired.len(), 1);
        assert!(pairing.refusal.as_deref().unwrap().starts_with("Number of devices mismatch"));
    }

    /// Rule (plugin): the eight CPX partitions of one MI300X are one hive; a container with
    /// four of them restored with the other four pairs hive to hive, each in the plugin's order.
    #[test]
    fn partitions_pair_within_their_hive() {
        let topo = host("mi300x-cpx");
        let ids =
            |minors: std::ops::Range<u32>| -> Vec<u32> { minors.map(|m| topo.gpu_by_minor(m).unwrap().id).collect() };
        let (a, b) = (ids(128..132), ids(132..136));
        let saved = visible_gpus(&topo, |id| a.contains(&id));
        let restored = visible_gpus(&topo, |id| b.contains(&id));
        let pairing = pair(&saved, &restored, &Checks::default(), &[]).unwrap();
        assert!(pairing.refusal.is_none() && pairing.warnings.is_empty(), "{pairing:?}");
        let got = minors(&saved, &pairing, &restored);
        assert_eq!(got.len(), 4);
        let targets: BTreeSet<u32> = got.iter().map(|p| p.1).collect();
        assert_eq!(targets, (132..136).collect());
    }
}
