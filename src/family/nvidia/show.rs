//! NVIDIA's part of a plan, shown: its keys of `plan --json` (`remap` first, `restored` after
//! the warnings), its remap table, and its items of `record`'s device list.
//!
//! Pure. `gpu_id` and `device_instance` of a recorded item are informational (pairing never
//! reads them): `gpu_id` is the PCI location encoded as the driver's gpu ids are,
//! `domain << 16 | bus << 8 | device` (0x300 for `0000:03:00.0`); `device_instance` is the
//! GPU's position in PCI bus order among the recorded GPUs. Both are 0 where the driver's files
//! give no bus.

use super::plan::NvidiaPlan;
use super::{Nvidia, RestoredGpu};
use crate::decision::pairing::By;
use crate::decision::seam::{JsonAt, Shown, earlier_minors};
use crate::decision::table::{earlier_json, earlier_rows, or_dash, status, table};
use crate::decision::tree::Tree;
use serde_json::{Map, Value, json};
use std::fmt::Write;

impl Shown for NvidiaPlan {
    fn saved(&self) -> usize {
        self.remap.len()
    }

    fn served(&self) -> usize {
        self.remap.iter().filter(|e| e.served).count()
    }

    fn json(&self, at: JsonAt, o: &mut Map<String, Value>) {
        match at {
            JsonAt::First => {
                let remap: Vec<Value> = self
                    .remap
                    .iter()
                    .map(|e| {
                        json!({
                            "name": e.name(),
                            "old_minor": e.old.minor,
                            "major": e.new.rdev.major,
                            "minor": e.new.rdev.minor,
                            "new_name": e.new.name(),
                            "old_uuid": Some(&e.old.uuid).filter(|u| !u.is_empty()),
                            "new_uuid": e.new.uuid,
                            "served": e.served,
                            "explicit": e.by == By::Explicit,
                            "by": e.by.as_str(),
                            "earlier_names": earlier_json(&Nvidia, &e.earlier),
                        })
                    })
                    .collect();
                o.insert("remap".into(), remap.into());
            }
            JsonAt::AfterWarnings => {
                let restored: Vec<Value> = self
                    .restored
                    .iter()
                    .map(|g| {
                        json!({
                            "name": g.name(),
                            "major": g.rdev.major,
                            "minor": g.rdev.minor,
                            "uuid": g.uuid,
                            "bus": g.bus,
                            "pci": g.pci.map(|(v, d)| format!("{v:04x}:{d:04x}")),
                        })
                    })
                    .collect();
                o.insert("restored".into(), restored.into());
            }
            JsonAt::Last => {}
        }
    }

    fn text(&self, out: &mut String) {
        if self.remap.is_empty() {
            return;
        }
        let _ = writeln!(out, "remap ({} saved GPUs):", self.remap.len());
        let rows: Vec<Vec<String>> = self
            .remap
            .iter()
            .flat_map(|e| {
                let row = |name: String, status: String| {
                    vec![
                        name,
                        or_dash(Some(&e.old.uuid).filter(|u| !u.is_empty())),
                        format!("{} ({})", e.new.name(), e.new.rdev),
                        or_dash(e.new.uuid.as_ref()),
                        status,
                    ]
                };
                // An earlier restore's names of the GPU, each a row of its own.
                std::iter::once(row(e.name(), status(e.served).into()))
                    .chain(earlier_rows(&Nvidia, &e.earlier, e.name()).map(move |(name, what)| row(name, what)))
            })
            .collect();
        table(out, &["OLD", "OLD UUID", "NEW", "NEW UUID", ""], &rows);
    }

    fn record(&self, tree: &Tree, driver_version: Option<&String>, carried: bool) -> Vec<Value> {
        let mut by_bus: Vec<(u32, u32)> = self.restored.iter().filter_map(|g| Some((gpu_id(g)?, g.minor))).collect();
        by_bus.sort_unstable();
        self.restored
            .iter()
            .map(|g| {
                let (vendor, device) = g.pci.unwrap_or((0, 0));
                // The node served under the native name: the spec's fileMode/uid/gid, or the host's.
                let access = tree.get(&g.name()).map_or(g.access, |n| n.access);
                let mut item = json!({
                    "minor": g.minor,
                    "pci_vendor_id": vendor,
                    "pci_device_id": device,
                    "gpu_id": gpu_id(g).unwrap_or(0),
                    "device_instance": by_bus.iter().position(|&(_, m)| m == g.minor).unwrap_or(0),
                    "subdevice_instance": 0,
                    "uuid": g.uuid.clone().unwrap_or_default(),
                    "mode": access.mode,
                    "uid": access.uid,
                    "gid": access.gid,
                });
                // Only what the host tells: a record from a host without driver files stays as
                // it was, and reads as "unknown" for the checks.
                let Some(o) = item.as_object_mut() else { return item };
                for (key, fact) in [("model", g.model.as_ref()), ("driver_version", driver_version)] {
                    if let Some(fact) = fact {
                        o.insert(key.into(), fact.as_str().into());
                    }
                }
                if carried {
                    let names =
                        self.remap.iter().map(|e| (e.new.minor, e.served.then_some(e.old.minor), &e.earlier[..]));
                    o.insert("earlier_minors".into(), earlier_minors(names, g.minor).into());
                }
                item
            })
            .collect()
    }

    fn unrecordable(&self) -> Option<(String, String)> {
        None
    }

    fn unread_warning(&self) -> Option<String> {
        None
    }

    /// A GPU without a bus location had no driver information file at all (a read file always
    /// gives one: its directory's name). Such a record still pairs by minor, but
    /// `cuda-device-map` refuses a GPU without a uuid.
    fn gaps(&self) -> Vec<String> {
        self.restored
            .iter()
            .filter_map(|g| {
                let missing: Vec<&str> = [
                    (g.uuid.is_none(), "uuid"),
                    (g.bus.is_none(), "bus location (gpu_id 0)"),
                    (g.pci.is_none(), "PCI vendor and device ids"),
                ]
                .into_iter()
                .filter_map(|(gone, what)| gone.then_some(what))
                .collect();
                if missing.is_empty() {
                    return None;
                }
                let why = if g.bus.is_none() {
                    format!("no driver information file names minor {}", g.minor)
                } else {
                    "the driver's files do not give them".to_owned()
                };
                // What the record then cannot do: a recorded uuid serves cuda-device-map.
                let cost = if g.uuid.is_none() {
                    "the record pairs by minor, but cuda-device-map needs the uuid"
                } else {
                    "the record pairs by minor and uuid, without comparing models"
                };
                Some(format!("GPU {} recorded without {}: {why}; {cost}", g.name(), missing.join(", ")))
            })
            .collect()
    }
}

/// `domain << 16 | bus << 8 | device` of a bus location `DDDD:BB:DD.F`, if it parses.
fn gpu_id(gpu: &RestoredGpu) -> Option<u32> {
    let bus = gpu.bus.as_deref()?;
    let (domain, rest) = bus.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, _function) = rest.split_once('.')?;
    let hex = |s: &str, max: u32| u32::from_str_radix(s, 16).ok().filter(|&n| n <= max);
    Some((hex(domain, 0xffff)? << 16) | (hex(bus, 0xff)? << 8) | hex(device, 0x1f)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Access, Rdev};

    /// A bus location that does not parse gives gpu_id 0, never a panic.
    #[test]
    fn odd_bus_locations() {
        let gpu = |bus: &str| RestoredGpu {
            minor: 0,
            rdev: Rdev::new(195, 0),
            access: Access::DEVICE_DEFAULT,
            uuid: None,
            bus: Some(bus.into()),
            pci: None,
            model: None,
        };
        assert_eq!(gpu_id(&gpu("0000:03:00.0")), Some(0x300));
        for bad in ["", "03:00.0", "0000:3b:00", "0000:zz:00.0", "10000:03:00.0", "0000:03:20.0"] {
            assert_eq!(gpu_id(&gpu(bad)), None, "{bad}");
        }
    }
}
