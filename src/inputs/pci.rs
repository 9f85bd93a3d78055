//! PCI bus ids as the drivers and sysfs write them (`0000:3b:00.0`), parsed and written back.
//!
//! Pure. Any GPU family names its devices' PCI locations this way, and only a parsed bus id may
//! name a directory under `sys/bus/pci/devices`: text that is not one (`../..`, an absolute
//! path) would lead out of the host root.

/// A PCI bus id: domain, bus, device, function, ordered as NVML enumerates GPUs.
pub type BusId = (u32, u32, u32, u32);

/// `dddd:bb:dd.f` (hex, as the driver's `Bus Location` and NVML write it) as numbers.
pub fn bus_id(text: &str) -> Option<BusId> {
    let (domain, rest) = text.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str| (!s.is_empty() && s.len() <= 8).then(|| u32::from_str_radix(s, 16).ok()).flatten();
    Some((hex(domain)?, hex(bus)?, hex(device)?, hex(function)?))
}

/// A bus id written as sysfs names its directory and the driver writes it, lower-case:
/// `0000:3b:00.0`.
pub fn bus_name((domain, bus, device, function): BusId) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}")
}
