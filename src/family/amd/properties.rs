//! CRIU's amdgpu plugin's property match (`device_properties_match` in
//! `plugins/amdgpu/amdgpu_plugin_topology.c`) and its `KFD_*_CHECK` switches, which
//! [`super::plugin`] applies to every candidate pair.
//!
//! Pure. Assumption: the properties are those the plugin reads from a node's `properties`
//! file and keeps in its image (see [`super::topology::Facts`]); equal ones must be equal,
//! the switchable ones on the restored side at least the saved value.

use super::topology::Facts;
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

/// The plugin's environment variables, as `amdgpu_plugin_init` reads them.
pub const VARIABLES: [&str; 7] = [
    "KFD_FW_VER_CHECK",
    "KFD_SDMA_FW_VER_CHECK",
    "KFD_CACHES_COUNT_CHECK",
    "KFD_NUM_GWS_CHECK",
    "KFD_VRAM_SIZE_CHECK",
    "KFD_NUMA_CHECK",
    "KFD_CAPABILITY_CHECK",
];

impl Checks {
    fn switch(&mut self, variable: &str) -> Option<&mut bool> {
        Some(match variable {
            "KFD_FW_VER_CHECK" => &mut self.fw_version,
            "KFD_SDMA_FW_VER_CHECK" => &mut self.sdma_fw_version,
            "KFD_CACHES_COUNT_CHECK" => &mut self.caches_count,
            "KFD_NUM_GWS_CHECK" => &mut self.num_gws,
            "KFD_VRAM_SIZE_CHECK" => &mut self.vram_size,
            "KFD_NUMA_CHECK" => &mut self.numa,
            "KFD_CAPABILITY_CHECK" => &mut self.capability,
            _ => return None,
        })
    }

    /// Sets one switch from `VARIABLE=VALUE` as the plugin's `getenv_bool` reads it: `0` or
    /// `NO` (any case) off, `1` or `YES` on; anything else the plugin ignores, so it is refused
    /// here rather than guessed.
    pub fn set(&mut self, assignment: &str) -> Result<(), String> {
        let Some((variable, value)) = assignment.split_once('=') else {
            return Err(format!("\"{assignment}\": expected VARIABLE=VALUE, one of {}", VARIABLES.join(", ")));
        };
        let Some(switch) = self.switch(variable) else {
            return Err(format!("\"{variable}\" is not one of {}", VARIABLES.join(", ")));
        };
        *switch = if value == "0" || value.eq_ignore_ascii_case("no") {
            false
        } else if value == "1" || value.eq_ignore_ascii_case("yes") {
            true
        } else {
            return Err(format!("{variable}=\"{value}\": the plugin takes 0, 1, NO or YES"));
        };
        Ok(())
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
