//! `NVIDIA_VISIBLE_DEVICES`: which GPUs a container asks for through the NVIDIA hook, read as the
//! NVIDIA Container Toolkit reads it, and resolved to host minors through what the driver's
//! information files say.
//!
//! Pure. The rules follow the toolkit (`internal/config/image`: `DevicesFromEnvvars`,
//! `NewVisibleDevices`) and the library its legacy hook calls (libnvidia-container
//! `src/cli/common.c`: `select_devices`):
//! - the value is split at commas, each entry trimmed, empty entries dropped;
//! - no entry at all, or an entry `void`: no GPU support (no hook request); else an entry `none`:
//!   no GPU, the driver's control nodes only; else an entry `all` (any case): every GPU;
//! - otherwise each entry is a GPU UUID (`GPU-` and 8-4-4-4-12 hex digits, matched whole,
//!   ignoring case), a PCI bus id (`domain:bus:device.function`, hex), or an index in the
//!   driver's enumeration order. That order is NVML's, by PCI bus id, which is not always the
//!   order of the minors.
//! - `MIG-...` UUIDs and `GPU:MIG` index pairs name MIG devices, which devremap does not support
//!   yet: refused. Any other entry is an unknown device, which the toolkit refuses too.
//! - in the toolkit's CDI mode an entry may be a CDI device name of its GPUs,
//!   `nvidia.com/gpu=<name>`, where the name is one the toolkit's CDI spec gives: `all`, an index
//!   or a UUID, selecting what the bare `all`, index or UUID selects.
//!
//! Assumption: a GPU the driver marks `GPU Excluded: Yes` (`Blacklisted: Yes` before driver 450)
//! is not enumerated by NVML, so it takes no index, cannot be selected and is not part of `all`.

use crate::family::nvidia::{GpuInfo, is_gpu_uuid};
use crate::inputs::pci::{BusId, bus_id, bus_name};
use std::collections::BTreeSet;
use std::fmt;
use thiserror::Error;

/// The most entries a list may hold. A host has at most 248 GPUs; a list of millions (a 16 MiB
/// spec allows eight million `0,`) would take hundreds of MiB as selectors.
pub const MAX_ENTRIES: usize = crate::inputs::limits::MAX_NODES;

/// What the variable asks for, when it asks for GPU support at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visible {
    /// `all`: every GPU.
    All,
    /// `none`: no GPU, only the driver's control nodes.
    None,
    /// A list of GPUs, in the order written, duplicates kept.
    Devices(Vec<Selector>),
}

/// One GPU named in the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// An index in the driver's enumeration (PCI bus id) order.
    Index(u32),
    /// A `GPU-` UUID, as written.
    Uuid(String),
    /// A PCI bus id: domain, bus, device, function.
    Bus(BusId),
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Selector::Index(n) => write!(f, "GPU index {n}"),
            Selector::Uuid(u) => write!(f, "GPU {u}"),
            Selector::Bus(b) => write!(f, "GPU at bus {}", bus_name(*b)),
        }
    }
}

/// Why the variable's GPUs cannot be served. The caller prefixes the spec's path.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum VisibleError {
    #[error("NVIDIA_VISIBLE_DEVICES: {0:?} is a MIG device; MIG devices are not supported yet")]
    Mig(String),
    #[error("NVIDIA_VISIBLE_DEVICES: {0:?} is not a GPU index, a GPU- UUID or a PCI bus id")]
    Unknown(String),
    #[error("NVIDIA_VISIBLE_DEVICES lists more than {MAX_ENTRIES} devices")]
    TooMany,
    #[error("NVIDIA_VISIBLE_DEVICES selects {selector}, which the host does not have ({listed})")]
    NotOnHost { selector: Selector, listed: String },
    #[error(
        "NVIDIA_VISIBLE_DEVICES selects {selector}, but the driver's information file of {bus} gives no Device Minor"
    )]
    NoMinor { selector: Selector, bus: String },
    #[error(
        "NVIDIA_VISIBLE_DEVICES selects {selector}, but the driver's information file of {unread} could not be read, so the order of the GPUs is unknown"
    )]
    OrderUnknown { selector: Selector, unread: String },
}

/// The CDI device kind of the toolkit's GPUs: `nvidia.com/gpu=all`, `=0`, `=GPU-...`.
const CDI_GPU: &str = "nvidia.com/gpu=";

/// An entry as its bare form: the name of a CDI GPU device, else the entry.
fn bare(entry: &str) -> &str {
    entry.strip_prefix(CDI_GPU).unwrap_or(entry)
}

/// Reads the variable's value. `Ok(None)`: no GPU support asked for (`void`, or no entry).
pub fn parse(value: &str) -> Result<Option<Visible>, VisibleError> {
    // Walked, never collected whole: a 16 MiB spec can hold a value of eight million entries.
    let entries = || value.split(',').map(str::trim).filter(|e| !e.is_empty());
    // The toolkit's precedence of the special values: void, then none, then all.
    if entries().next().is_none() || entries().any(|e| e == "void") {
        return Ok(None);
    }
    if entries().any(|e| e == "none") {
        return Ok(Some(Visible::None));
    }
    if entries().any(|e| bare(e).eq_ignore_ascii_case("all")) {
        return Ok(Some(Visible::All));
    }
    let mut list = Vec::new();
    for entry in entries() {
        if list.len() == MAX_ENTRIES {
            return Err(VisibleError::TooMany);
        }
        list.push(selector(entry)?);
    }
    Ok(Some(Visible::Devices(list)))
}

fn selector(written: &str) -> Result<Selector, VisibleError> {
    let entry = bare(written);
    // The CDI spec names a GPU by index or UUID only (and `all`, taken above).
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if entry.len() != written.len() && !digits(entry) && !is_gpu_uuid(entry) {
        return Err(VisibleError::Unknown(written.to_owned()));
    }
    let has_prefix = |p: &str| entry.get(..p.len()).is_some_and(|head| head.eq_ignore_ascii_case(p));
    if has_prefix("MIG-") {
        return Err(VisibleError::Mig(entry.to_owned()));
    }
    if has_prefix("GPU-") {
        // libnvidia-container compares UUIDs ignoring case, the prefix included.
        return if is_gpu_uuid(&format!("GPU-{}", &entry[4..])) {
            Ok(Selector::Uuid(entry.to_owned()))
        } else {
            Err(VisibleError::Unknown(entry.to_owned()))
        };
    }
    if let Some(bus) = bus_id(entry) {
        return Ok(Selector::Bus(bus));
    }
    if let Some((gpu, mig)) = entry.split_once(':')
        && digits(gpu)
        && digits(mig)
    {
        return Err(VisibleError::Mig(entry.to_owned()));
    }
    match entry.parse() {
        Ok(n) if digits(entry) => Ok(Selector::Index(n)),
        _ => Err(VisibleError::Unknown(entry.to_owned())),
    }
}

/// The host minors `visible` selects among the GPUs the driver describes and the device
/// directory holds (`present`, their minors). `all` is every present GPU but those the driver
/// excludes, which NVML does not list. `unread` names the GPUs whose information file could
/// not be read (then indexes are refused, since the enumeration order is not known).
pub fn resolve(
    visible: &Visible,
    gpus: &[GpuInfo],
    unread: &[String],
    present: &[u32],
) -> Result<BTreeSet<u32>, VisibleError> {
    let list = match visible {
        Visible::All => {
            let excluded = |m: &u32| gpus.iter().any(|g| g.excluded && g.minor == Some(*m));
            return Ok(present.iter().copied().filter(|m| !excluded(m)).collect());
        }
        Visible::None => return Ok(BTreeSet::new()),
        Visible::Devices(list) => list,
    };
    let mut enumerated: Vec<&GpuInfo> = gpus.iter().filter(|g| !g.excluded).collect();
    // Each bus parsed once, its text borrowed: the key is not remade at every comparison.
    enumerated.sort_by_cached_key(|&g| {
        g.bus.as_deref().map(|b| {
            let id = bus_id(b);
            (id.is_none(), id, b)
        })
    });
    let listed = match enumerated.len() {
        0 => "the driver's information files describe no GPU".to_owned(),
        1 => "the driver's information files describe 1 GPU, index 0".to_owned(),
        n => format!("the driver's information files describe {n} GPUs, indexes 0 to {}", n - 1),
    };
    let mut minors = BTreeSet::new();
    for selector in list {
        let found = match selector {
            Selector::Index(n) => {
                if let Some(unread) = unread.first() {
                    return Err(VisibleError::OrderUnknown { selector: selector.clone(), unread: unread.clone() });
                }
                usize::try_from(*n).ok().and_then(|i| enumerated.get(i))
            }
            Selector::Uuid(u) => {
                enumerated.iter().find(|g| g.uuid.as_deref().is_some_and(|have| have.eq_ignore_ascii_case(u)))
            }
            Selector::Bus(b) => enumerated.iter().find(|g| g.bus.as_deref().and_then(bus_id) == Some(*b)),
        };
        let gpu =
            found.ok_or_else(|| VisibleError::NotOnHost { selector: selector.clone(), listed: listed.clone() })?;
        let minor = gpu.minor.ok_or_else(|| VisibleError::NoMinor {
            selector: selector.clone(),
            bus: gpu.bus.clone().unwrap_or_else(|| "a GPU".into()),
        })?;
        minors.insert(minor);
    }
    Ok(minors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(bus: &str, minor: Option<u32>, uuid: &str) -> GpuInfo {
        GpuInfo {
            minor,
            uuid: Some(uuid.to_owned()),
            bus: Some(bus.to_owned()),
            pci: Some((0x10de, 0x2330)),
            excluded: false,
            model: None,
        }
    }

    fn uuid(n: u32) -> String {
        format!("GPU-9221d5d1-b60b-a624-bf14-{n:012x}")
    }

    /// A host whose minors do not follow the PCI bus order (as on machines whose GPUs the
    /// driver probed out of bus order): index 0 is bus 07 (minor 2), index 3 is bus 4e (minor 1).
    fn host() -> Vec<GpuInfo> {
        vec![
            gpu("0000:47:00.0", Some(0), &uuid(0)),
            gpu("0000:4e:00.0", Some(1), &uuid(1)),
            gpu("0000:07:00.0", Some(2), &uuid(2)),
            gpu("0000:0f:00.0", Some(3), &uuid(3)),
        ]
    }

    fn select(value: &str) -> Result<BTreeSet<u32>, VisibleError> {
        resolve(&parse(value)?.expect("a request"), &host(), &[], &[0, 1, 2, 3, 9])
    }

    fn set(minors: &[u32]) -> BTreeSet<u32> {
        minors.iter().copied().collect()
    }

    /// Rule (toolkit): `void` or no entry asks for nothing; `none` for no GPU; `all` for every
    /// GPU; the precedence is void, none, all; entries are trimmed, empty ones dropped.
    #[test]
    fn special_values_as_the_toolkit_reads_them() {
        for void in ["", " ", ",", " , ", "void", "0,void", "all,void", "none,void"] {
            assert_eq!(parse(void), Ok(None), "{void:?}");
        }
        assert_eq!(parse("none"), Ok(Some(Visible::None)));
        assert_eq!(parse("all,none"), Ok(Some(Visible::None)));
        for all in ["all", " all ", "ALL", "0,all", "all,MIG-x"] {
            assert_eq!(parse(all), Ok(Some(Visible::All)), "{all:?}");
        }
        assert_eq!(select("none"), Ok(set(&[])));
        assert_eq!(select("all"), Ok(set(&[0, 1, 2, 3, 9])));
    }

    /// Bug (issue 10.1): indexes follow the driver's enumeration order, PCI bus id order, not
    /// the minors: on this host `2,3` are minors 0 and 1, and `0` is minor 2.
    #[test]
    fn indexes_are_pci_bus_order_not_minor_order() {
        assert_eq!(select("2,3"), Ok(set(&[0, 1])));
        assert_eq!(select("0"), Ok(set(&[2])));
        assert_eq!(select(" 1 , ,0,1"), Ok(set(&[2, 3])));
    }

    /// Rule (issue 20): the toolkit's CDI device names of its GPUs select what the bare `all`,
    /// index or UUID selects, in lists too; other CDI names (a bus id, MIG, another kind) are
    /// refused naming the entry as written.
    #[test]
    fn cdi_device_names_select_as_their_bare_form() {
        assert_eq!(parse("nvidia.com/gpu=all"), Ok(Some(Visible::All)));
        assert_eq!(select("nvidia.com/gpu=2,nvidia.com/gpu=3"), select("2,3"));
        assert_eq!(select(&format!("nvidia.com/gpu={},0", uuid(3))), Ok(set(&[3, 2])));
        for bad in [
            "nvidia.com/gpu=0000:4e:00.0",
            "nvidia.com/gpu=0:1",
            "nvidia.com/mig=0",
            "nvidia.com/gpu=",
            "nvidia.com/gpu=void",
        ] {
            assert_eq!(parse(bad), Err(VisibleError::Unknown(bad.to_owned())), "{bad}");
        }
    }

    /// Bug (issue 10.1): UUIDs (any case) and PCI bus ids select the GPU they name.
    #[test]
    fn uuids_and_bus_ids_select_their_gpu() {
        assert_eq!(select(&uuid(3)), Ok(set(&[3])));
        assert_eq!(select(&uuid(1).to_uppercase().replacen("GPU-", "gpu-", 1)), Ok(set(&[1])));
        assert_eq!(select(&format!("{},2", uuid(0))), Ok(set(&[0, 0])));
        assert_eq!(select("0000:4E:00.0"), Ok(set(&[1])));
    }

    /// Bug (issue 10.1): MIG devices are refused as not supported; unknown entries, malformed
    /// or placeholder UUIDs too; a GPU the host does not have is refused naming what it has.
    #[test]
    fn mig_unknown_and_missing_gpus_are_refused() {
        for mig in ["MIG-9221d5d1-b60b-a624-bf14-0a1819cfda3b", "mig-GPU-x/1/0", "0:1", "3:0"] {
            assert_eq!(parse(mig), Err(VisibleError::Mig(mig.into())), "{mig}");
        }
        for bad in ["GPU-????????-????-????-????-????????????", "GPU-nope", "nvidia0", "-1", "+1", "1.0", "99999999999"]
        {
            assert_eq!(parse(bad), Err(VisibleError::Unknown(bad.into())), "{bad}");
        }
        let err = select("4").unwrap_err().to_string();
        assert_eq!(
            err,
            "NVIDIA_VISIBLE_DEVICES selects GPU index 4, which the host does not have \
             (the driver's information files describe 4 GPUs, indexes 0 to 3)"
        );
        assert!(matches!(select(&uuid(9)), Err(VisibleError::NotOnHost { .. })));
        assert!(matches!(select("0000:99:00.0"), Err(VisibleError::NotOnHost { .. })));
        let none = resolve(&parse("0").unwrap().unwrap(), &[], &[], &[]).unwrap_err().to_string();
        assert!(none.ends_with("(the driver's information files describe no GPU)"), "{none}");
    }

    /// Rule: an excluded GPU takes no index and cannot be selected; a selected GPU without a
    /// `Device Minor` line cannot be served; an unread information file makes indexes unknown.
    #[test]
    fn excluded_unread_and_minorless_gpus() {
        let mut gpus = host();
        gpus[2].excluded = true; // bus 07: index 0 is now bus 0f (minor 3)
        let pick = |v: &str, gpus: &[GpuInfo], unread: &[String]| {
            resolve(&parse(v).unwrap().unwrap(), gpus, unread, &[0, 1, 2, 3])
        };
        assert_eq!(pick("0", &gpus, &[]), Ok(set(&[3])));
        assert!(matches!(pick(&uuid(2), &gpus, &[]), Err(VisibleError::NotOnHost { .. })));
        gpus[3].minor = None;
        let err = pick("0", &gpus, &[]).unwrap_err().to_string();
        assert!(err.ends_with("the driver's information file of 0000:0f:00.0 gives no Device Minor"), "{err}");
        let unread = ["0000:50:00.0".to_owned()];
        assert!(matches!(pick("1", &host(), &unread), Err(VisibleError::OrderUnknown { .. })));
        assert_eq!(pick(&uuid(1), &host(), &unread), Ok(set(&[1])));
    }

    /// Bug (found from outside): `all` selected a GPU the driver marks `GPU Excluded: Yes`,
    /// which NVML (and so the toolkit's `all`) never lists, while index 0 already skipped it;
    /// `all` is every GPU of the directory but the excluded ones, those without a driver file
    /// included.
    #[test]
    fn all_leaves_out_excluded_gpus() {
        let mut gpus = host();
        gpus[2].excluded = true; // minor 2
        assert_eq!(resolve(&Visible::All, &gpus, &[], &[0, 1, 2, 3, 9]), Ok(set(&[0, 1, 3, 9])));
        assert_eq!(resolve(&Visible::All, &host(), &[], &[0, 1, 2, 3]), Ok(set(&[0, 1, 2, 3])));
    }

    /// Bug (found from outside): a 16 MiB spec whose NVIDIA_VISIBLE_DEVICES lists `0,0,...`
    /// eight million times made `plan` peak at 381 MiB; a list is held to 16,384 entries,
    /// duplicates included, and the special values are still found anywhere in a longer one.
    #[test]
    fn long_lists_are_refused_past_the_entry_limit() {
        let list = |n: usize| vec!["0"; n].join(",");
        assert!(matches!(parse(&list(MAX_ENTRIES)), Ok(Some(Visible::Devices(l))) if l.len() == MAX_ENTRIES));
        assert_eq!(parse(&list(MAX_ENTRIES + 1)), Err(VisibleError::TooMany));
        assert_eq!(VisibleError::TooMany.to_string(), "NVIDIA_VISIBLE_DEVICES lists more than 16384 devices");
        let long = list(1 << 20);
        assert_eq!(parse(&format!("{long},void")), Ok(None));
        assert_eq!(parse(&format!("{long},none")), Ok(Some(Visible::None)));
        assert_eq!(parse(&format!("{long},ALL")), Ok(Some(Visible::All)));
    }

    proptest::proptest! {
        /// Property: any value, however odd (non-ASCII, huge numbers, stray colons), is read
        /// and resolved to an answer or an error, never a panic; a selection only names minors
        /// the driver describes.
        #[test]
        fn any_value_is_answered(value in "[0-9a-fA-F:.,GPUMI \\-\u{e9}\u{663}]{0,40}") {
            if let Ok(Some(visible)) = parse(&value)
                && let Ok(minors) = resolve(&visible, &host(), &[], &[0, 1, 2, 3])
            {
                proptest::prop_assert!(minors.iter().all(|m| *m < 4));
            }
        }
    }
}
