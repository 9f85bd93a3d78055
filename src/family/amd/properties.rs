//! CRIU's amdgpu plugin's property match (`device_properties_match` in
//! `plugins/amdgpu/amdgpu_plugin_topology.c`) and its `KFD_*_CHECK` switches, which
//! [`super::plugin`] applies to every candidate pair.
//!
//! Pure. Assumption: the properties are those the plugin reads from a node's `properties`
//! file and keeps in its image (see [`super::topology::Facts`]); equal ones must be equal,
//! the switchable ones on the restored side at least the saved value.

use super::topology::Facts;
use crate::inputs::limits::shorten;
use serde::{Deserialize, Serialize};

/// The plugin's `KFD_*_CHECK` switches, all on by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checks {
    pub fw_version: bool,
    pub sdma_fw_version: bool,
    pub caches_count: bool,
    pub num_gws: bool,
    pub vram_size: bool,
    pub numa: bool,
    pub capability: bool,
}

impl Default for Checks {
    fn default() -> Self {
        Checks {
            fw_version: true,
            sdma_fw_version: true,
            caches_count: true,
            num_gws: true,
            vram_size: true,
            numa: true,
            capability: true,
        }
    }
}

/// The plugin's environment variables, as `amdgpu_plugin_init` reads them (CRIU 4.2's
/// `plugins/amdgpu/amdgpu_plugin.c`), each the switch of [`Checks`] in field order.
pub const VARIABLES: [&str; 7] = [
    "KFD_FW_VER_CHECK",
    "KFD_SDMA_FW_VER_CHECK",
    "KFD_CACHES_COUNT_CHECK",
    "KFD_NUM_GWS_CHECK",
    "KFD_VRAM_SIZE_CHECK",
    "KFD_NUMA_CHECK",
    "KFD_CAPABILITY_CHECK",
];

/// The switches as the plugin's environment sets them, and the values it ignores.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Switches {
    pub checks: Checks,
    /// Each assignment the plugin ignores, leaving its check on, as `VARIABLE="value"`.
    pub ignored: Vec<String>,
}

impl Checks {
    /// The switches in [`VARIABLES`]' order.
    fn switches(&mut self) -> [&mut bool; 7] {
        [
            &mut self.fw_version,
            &mut self.sdma_fw_version,
            &mut self.caches_count,
            &mut self.num_gws,
            &mut self.vram_size,
            &mut self.numa,
            &mut self.capability,
        ]
    }

    /// The switches as `amdgpu_plugin_init` sets them at a restore, from the environment `var`
    /// reads (as `getenv_bool` does): `0` or `NO` (any case) off, `1` or `YES` on, unset on.
    /// Any other value, the empty one included, the plugin ignores with an error in its log and
    /// keeps the check on; so does this, and says so in [`Switches::ignored`].
    pub fn from_env(var: impl Fn(&str) -> Option<Vec<u8>>) -> Switches {
        let mut checks = Checks::default();
        let mut ignored = vec![];
        for (name, switch) in VARIABLES.into_iter().zip(checks.switches()) {
            let Some(value) = var(name) else { continue };
            if value == b"0" || value.eq_ignore_ascii_case(b"no") {
                *switch = false;
            } else if value == b"1" || value.eq_ignore_ascii_case(b"yes") {
                *switch = true;
            } else {
                // Not escaped here: the warning is, where it is written.
                ignored.push(format!("{name}=\"{}\"", shorten(&String::from_utf8_lossy(&value))));
            }
        }
        Switches { checks, ignored }
    }

    /// The variables of the switches that are off, in [`VARIABLES`]' order.
    pub fn off(&self) -> Vec<&'static str> {
        let mut copy = *self;
        VARIABLES.into_iter().zip(copy.switches()).filter(|(_, on)| !**on).map(|(name, _)| name).collect()
    }
}

/// The first property on which `dest` cannot replace `src` (`device_properties_match`), as
/// `name saved vs restored`; `None` when the properties match.
pub fn mismatch(src: &Facts, dest: &Facts, checks: &Checks) -> Option<String> {
    let equal = [
        ("simd_count", src.simd_count, dest.simd_count),
        ("mem_banks_count", src.mem_banks_count, dest.mem_banks_count),
        ("io_links_count", src.io_links_count, dest.io_links_count),
        ("max_waves_per_simd", src.max_waves_per_simd, dest.max_waves_per_simd),
        ("lds_size_in_kb", src.lds_size_in_kb, dest.lds_size_in_kb),
        ("wave_front_size", src.wave_front_size, dest.wave_front_size),
        ("array_count", src.array_count, dest.array_count),
        ("simd_arrays_per_engine", src.simd_arrays_per_engine, dest.simd_arrays_per_engine),
        ("cu_per_simd_array", src.cu_per_simd_array, dest.cu_per_simd_array),
        ("simd_per_cu", src.simd_per_cu, dest.simd_per_cu),
        ("max_slots_scratch_cu", src.max_slots_scratch_cu, dest.max_slots_scratch_cu),
        ("vendor_id", src.vendor_id, dest.vendor_id),
        ("device_id", src.device_id, dest.device_id),
        ("num_sdma_engines", src.num_sdma_engines, dest.num_sdma_engines),
        ("num_sdma_xgmi_engines", src.num_sdma_xgmi_engines, dest.num_sdma_xgmi_engines),
        ("num_sdma_queues_per_engine", src.num_sdma_queues_per_engine, dest.num_sdma_queues_per_engine),
        ("num_cp_queues", src.num_cp_queues, dest.num_cp_queues),
        ("vram_public", u32::from(src.vram_public), u32::from(dest.vram_public)),
    ];
    if let Some((name, a, b)) = equal.into_iter().find(|(_, a, b)| a != b) {
        return Some(format!("{name} {a} vs {b}"));
    }
    if checks.capability && src.capability != dest.capability {
        return Some(format!("capability {} vs {} (KFD_CAPABILITY_CHECK)", src.capability, dest.capability));
    }
    let at_least = [
        (checks.vram_size, "vram_size", src.vram_size, dest.vram_size, "KFD_VRAM_SIZE_CHECK"),
        (checks.num_gws, "num_gws", src.num_gws.into(), dest.num_gws.into(), "KFD_NUM_GWS_CHECK"),
        (
            checks.caches_count,
            "caches_count",
            src.caches_count.into(),
            dest.caches_count.into(),
            "KFD_CACHES_COUNT_CHECK",
        ),
        (checks.fw_version, "fw_version", src.fw_version.into(), dest.fw_version.into(), "KFD_FW_VER_CHECK"),
        (
            checks.sdma_fw_version,
            "sdma_fw_version",
            src.sdma_fw_version.into(),
            dest.sdma_fw_version.into(),
            "KFD_SDMA_FW_VER_CHECK",
        ),
    ];
    at_least
        .into_iter()
        .find(|&(on, _, a, b, _)| on && a > b)
        .map(|(_, name, a, b, var)| format!("{name} {a} vs {b}, smaller ({var})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<Vec<u8>> + 'a {
        move |name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_bytes().to_vec())
    }

    /// Rule (CRIU's `getenv_bool`): `0`, `NO`, `1`, `YES` in any case set a switch; unset
    /// leaves it on; any other value (`off`, `false`, the empty one) is ignored with the check
    /// left on, and named.
    #[test]
    fn switches_are_read_as_the_plugin_reads_them() {
        assert_eq!(Checks::from_env(env(&[])), Switches::default());
        let s = Checks::from_env(env(&[
            ("KFD_NUMA_CHECK", "no"),
            ("KFD_FW_VER_CHECK", "0"),
            ("KFD_VRAM_SIZE_CHECK", "Yes"),
        ]));
        assert_eq!(s.checks, Checks { numa: false, fw_version: false, ..Checks::default() });
        assert_eq!(s.checks.off(), ["KFD_FW_VER_CHECK", "KFD_NUMA_CHECK"]);
        assert!(s.ignored.is_empty());
        for value in ["off", "false", "", " 0", "2", "nO\n"] {
            let s = Checks::from_env(env(&[("KFD_CAPABILITY_CHECK", value)]));
            assert_eq!(s.checks, Checks::default(), "{value:?}");
            assert_eq!(s.ignored, [format!("KFD_CAPABILITY_CHECK=\"{value}\"")]);
        }
        let s = Checks::from_env(env(&[("KFD_OTHER_CHECK", "0"), ("kfd_numa_check", "0")]));
        assert_eq!(s, Switches::default(), "only the plugin's own names, as spelt");
    }

    /// Rule (plugin, `device_properties_match`): each "at least" property and `capability`
    /// counts only while its switch is on; the equal ones always count.
    #[test]
    fn each_switch_turns_off_its_own_comparison() {
        let saved = Facts {
            vram_size: 64,
            num_gws: 64,
            caches_count: 9,
            fw_version: 9,
            sdma_fw_version: 9,
            capability: 1,
            ..Facts::default()
        };
        let smaller = [
            ("KFD_VRAM_SIZE_CHECK", Facts { vram_size: 32, ..saved.clone() }),
            ("KFD_NUM_GWS_CHECK", Facts { num_gws: 0, ..saved.clone() }),
            ("KFD_CACHES_COUNT_CHECK", Facts { caches_count: 8, ..saved.clone() }),
            ("KFD_FW_VER_CHECK", Facts { fw_version: 8, ..saved.clone() }),
            ("KFD_SDMA_FW_VER_CHECK", Facts { sdma_fw_version: 8, ..saved.clone() }),
            ("KFD_CAPABILITY_CHECK", Facts { capability: 2, ..saved.clone() }),
        ];
        for (var, restored) in smaller {
            let why = mismatch(&saved, &restored, &Checks::default()).unwrap();
            assert!(why.ends_with(&format!("({var})")), "{why}");
            let relaxed = Checks::from_env(env(&[(var, "0")])).checks;
            assert_eq!(mismatch(&saved, &restored, &relaxed), None, "{var}");
        }
        let other = Facts { simd_count: 1, ..saved.clone() };
        let all_off = Checks::from_env(|_| Some(b"0".to_vec())).checks;
        assert_eq!(mismatch(&saved, &other, &all_off).as_deref(), Some("simd_count 0 vs 1"));
    }
}
