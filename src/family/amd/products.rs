//! What a user calls an AMD GPU: its PCI device id, the marketing name the PCI ID Repository
//! (`pci.ids`) gives it, and its ISA name, for the `model` check's message.
//!
//! Pure. A KFD topology gives `vendor_id`, `device_id` and `gfx_target_version` of a GPU, and a
//! checkpoint's item keeps them, but no product name (a node's `name` file holds a code name,
//! `aldebaran`, or `ip discovery`). The names below are `pci.ids`' for vendor 1002 (Debian's
//! `pci.ids` package, newer entries from the repository's current list), limited to the GPUs
//! ROCm checkpoints run on; another device is shown by its id and ISA alone.

use super::topology::Facts;

/// AMD's PCI vendor id.
const AMD_VENDOR: u32 = 0x1002;

/// `pci.ids`' names (the bracketed product) of AMD's compute GPUs, by device id.
const NAMES: &[(u32, &str)] = &[
    (0x738c, "Instinct MI100"),
    (0x7408, "Instinct MI250X"),
    (0x740c, "Instinct MI250X/MI250"),
    (0x740f, "Instinct MI210"),
    (0x74a0, "Instinct MI300A"),
    (0x74a1, "Instinct MI300X"),
    (0x74a5, "Instinct MI325X"),
    (0x73bf, "Radeon RX 6800/6800 XT / 6900 XT"),
    (0x744c, "Radeon RX 7900 XT/7900 XTX"),
];

/// A GPU as `0x74a1 (Instinct MI300X, gfx942)`: the device id, then its name where known and its
/// ISA where the topology gives one.
pub fn describe(facts: &Facts) -> String {
    let name = (facts.vendor_id == AMD_VENDOR || facts.vendor_id == 0)
        .then(|| NAMES.iter().find(|(id, _)| *id == facts.device_id).map(|(_, n)| *n))
        .flatten();
    let isa = (facts.gfx_target_version != 0).then(|| facts.gfx_name());
    let about: Vec<String> = name.map(str::to_owned).into_iter().chain(isa).collect();
    match about.is_empty() {
        true => format!("{:#06x}", facts.device_id),
        false => format!("{:#06x} ({})", facts.device_id, about.join(", ")),
    }
}

/// `another product: <saved> vs <restored>` where the two GPUs' device or vendor ids differ,
/// the first thing a user needs before the property that differs.
pub fn another_product(saved: &Facts, restored: &Facts) -> Option<String> {
    ((saved.vendor_id, saved.device_id) != (restored.vendor_id, restored.device_id))
        .then(|| format!("another product: {} vs {}", describe(saved), describe(restored)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(device_id: u32, gfx_target_version: u32) -> Facts {
        Facts { vendor_id: AMD_VENDOR, device_id, gfx_target_version, ..Facts::default() }
    }

    /// Rule (issue 33, AMD model): a user is told the products first, by device id, `pci.ids`
    /// name and ISA, as far as they are known.
    #[test]
    fn products_are_named_by_id_name_and_isa() {
        assert_eq!(describe(&gpu(0x74a1, 90402)), "0x74a1 (Instinct MI300X, gfx942)");
        assert_eq!(describe(&gpu(0x740f, 90010)), "0x740f (Instinct MI210, gfx90a)");
        assert_eq!(describe(&gpu(0x1234, 110000)), "0x1234 (gfx1100)");
        assert_eq!(describe(&gpu(0x1234, 0)), "0x1234");
        let other_vendor = Facts { vendor_id: 0x10de, ..gpu(0x74a1, 0) };
        assert_eq!(describe(&other_vendor), "0x74a1");
        assert_eq!(
            another_product(&gpu(0x74a1, 90402), &gpu(0x740f, 90010)).as_deref(),
            Some("another product: 0x74a1 (Instinct MI300X, gfx942) vs 0x740f (Instinct MI210, gfx90a)")
        );
        assert_eq!(another_product(&gpu(0x74a1, 90402), &gpu(0x74a1, 90402)), None);
    }
}
