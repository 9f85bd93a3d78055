//! The AMD items of the checkpoint's device list (`"kind": "amdgpu"`), read from JSON values.
//!
//! Pure. An item is one GPU the container had at save time: its render minor (`minor`), the
//! mode, uid and gid of its node, and, where `devremapd record` read the KFD topology, the
//! identity CRIU's amdgpu plugin pairs it by: `node`, `gpu_id`, `properties` (the topology's
//! properties, by the names [`Facts`] gives them) and `links` (its valid IO links). Unknown keys
//! are ignored, as in NVIDIA's items; a known key of the wrong type is refused, naming the key,
//! and a value is never echoed beyond [`describe`]'s short form. The items keep their order in
//! the list: the plugin pairs in the order the checkpoint recorded its GPUs.

use super::FIRST_RENDER_MINOR;
use super::plugin::{Gpu, GpuLink};
use super::topology::{self, Facts};
use crate::inputs::limits::MAX_FUSE_MINOR;
use crate::inputs::metadata_items::{self as items, MetadataError, RecordedAccess, describe};
use serde_json::{Map, Value};

/// The `kind` of an AMD item.
pub const KIND: &str = "amdgpu";

/// One AMD GPU as it was at save time.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AmdSaved {
    /// Its render minor: the N of `/dev/dri/renderD<N>` the process holds.
    pub minor: u32,
    /// The plugin's identity of it; `None` where the save host's topology was not read.
    pub gpu: Option<Gpu>,
    pub recorded: RecordedAccess,
    /// The other render names this GPU had in the checkpointed container, sorted: the
    /// checkpoint names of an earlier restore that led to it (`record --metadata PREV` writes
    /// them), each served as its checkpoint name too, as NVIDIA's `earlier_minors` are.
    #[serde(default)]
    pub earlier_minors: Vec<u32>,
}

/// Reads item `index`, an object whose `kind` is [`KIND`]; `recorded` is its mode, uid and gid,
/// already checked.
pub fn item(index: usize, obj: &Map<String, Value>, recorded: RecordedAccess) -> Result<AmdSaved, MetadataError> {
    let bad = |what: String| MetadataError::Amd { index, what };
    let number = |v: &Value, what: &str, max: u64| -> Result<u64, MetadataError> {
        v.as_u64()
            .filter(|&n| n <= max)
            .ok_or_else(|| bad(format!("{what}: expected an integer 0-{max}, found {}", describe(v))))
    };
    let minor = match obj.get("minor") {
        Some(v) => number(v, "minor", MAX_FUSE_MINOR.into())? as u32,
        None => return Err(bad("minor: expected the render minor, found nothing".into())),
    };
    if let Some(why) = render_fault(minor) {
        return Err(bad(why));
    }
    let earlier_minors = items::earlier_minors(minor, obj.get("earlier_minors"), "render minors", render_fault)
        .map_err(|what| bad(format!("earlier_minors: {what}")))?;
    // Read even without properties, where they are dropped: a bad one is bad input either way.
    let field = |name: &str, max: u64| -> Result<u32, MetadataError> {
        obj.get(name).map_or(Ok(0), |v| number(v, name, max).map(|n| n as u32))
    };
    let gpu_id = field("gpu_id", 0xffff)?;
    let node = field("node", u32::MAX.into())?;
    let links = match obj.get("links") {
        None => Vec::new(),
        Some(Value::Array(items)) => items.iter().map(link).collect::<Result<_, _>>().map_err(bad)?,
        Some(v) => return Err(bad(format!("links: expected an array, found {}", describe(v)))),
    };
    let Some(props) = obj.get("properties") else {
        return Ok(AmdSaved { minor, gpu: None, recorded, earlier_minors });
    };
    let Value::Object(props) = props else {
        return Err(bad(format!("properties: expected an object, found {}", describe(props))));
    };
    let facts = facts(props).map_err(bad)?;
    if facts.drm_render_minor != 0 && facts.drm_render_minor != minor {
        return Err(bad(format!(
            "properties.drm_render_minor {} is not the item's minor {minor}",
            facts.drm_render_minor
        )));
    }
    let facts = Facts { drm_render_minor: minor, ..facts };
    Ok(AmdSaved { minor, gpu: Some(Gpu { node, gpu_id, facts, links }), recorded, earlier_minors })
}

/// What is wrong with render minor `minor`, if anything: a render node's minor is at least
/// [`FIRST_RENDER_MINOR`] and fits FUSE's 20 bits.
fn render_fault(minor: u32) -> Option<String> {
    if minor < FIRST_RENDER_MINOR {
        Some(format!("minor {minor} is under {FIRST_RENDER_MINOR}, the first render minor"))
    } else {
        (minor > MAX_FUSE_MINOR).then(|| format!("minor {minor} is over {MAX_FUSE_MINOR}, the largest FUSE carries"))
    }
}

/// The AMD items, in the list's order, each render name (minor or earlier minor) once.
pub fn list(amd: Vec<AmdSaved>) -> Result<Vec<AmdSaved>, MetadataError> {
    let names = amd.iter().flat_map(|a| std::iter::once(a.minor).chain(a.earlier_minors.iter().copied()));
    match items::repeated_name(names) {
        Some(minor) => Err(MetadataError::DuplicateRender(minor)),
        None => Ok(amd),
    }
}

/// The properties object: each key a [`Facts`] field, each value of that field's type (an
/// integer within its width, `vram_public` a boolean); missing ones are 0, as in the plugin.
fn facts(props: &Map<String, Value>) -> Result<Facts, String> {
    let Ok(Value::Object(zero)) = serde_json::to_value(Facts::default()) else {
        return Err("properties: cannot be read".into());
    };
    let wide = ["hive_id", "vram_size", "unique_id"];
    for (name, value) in props {
        let Some(kind) = zero.get(name) else {
            return Err(format!(
                "properties.{}: not a property the plugin compares",
                crate::inputs::limits::shorten(name)
            ));
        };
        let fits = match kind {
            Value::Bool(_) => value.is_boolean(),
            _ if wide.contains(&name.as_str()) => value.is_u64(),
            _ => value.as_u64().is_some_and(|n| n <= u32::MAX.into()),
        };
        if !fits {
            let expected = if kind.is_boolean() { "a boolean" } else { "an unsigned integer of its width" };
            return Err(format!("properties.{name}: expected {expected}, found {}", describe(value)));
        }
    }
    serde_json::from_value(Value::Object(props.clone())).map_err(|_| "properties: cannot be read".into())
}

/// One valid IO link: `{"kind": 2|11, "to": node, "to_gpu": bool, "peer": bool}`.
fn link(value: &Value) -> Result<GpuLink, String> {
    let Value::Object(o) = value else { return Err(format!("links: expected objects, found {}", describe(value))) };
    let num = |k: &str| o.get(k).and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok());
    let flag = |k: &str| o.get(k).and_then(Value::as_bool);
    match (num("kind"), num("to"), flag("to_gpu"), flag("peer")) {
        (Some(kind @ (topology::LINK_PCIE | topology::LINK_XGMI)), Some(to), Some(to_gpu), Some(peer)) => {
            Ok(GpuLink { kind, to, to_gpu, peer })
        }
        _ => {
            Err("links: each is {\"kind\": 2 or 11, \"to\": a node, \"to_gpu\": a boolean, \"peer\": a boolean}".into())
        }
    }
}

/// The item's JSON, as `devremapd record` writes it and [`item`] reads it back; `earlier_minors`
/// only when `carried` (the record looked for earlier names), as for NVIDIA's items.
pub fn to_json(saved: &AmdSaved, carried: bool) -> Value {
    let mut o = Map::new();
    o.insert("kind".into(), KIND.into());
    o.insert("minor".into(), saved.minor.into());
    if let Some(gpu) = &saved.gpu {
        o.insert("node".into(), gpu.node.into());
        o.insert("gpu_id".into(), gpu.gpu_id.into());
        o.insert("properties".into(), serde_json::to_value(&gpu.facts).unwrap_or_default());
        o.insert("links".into(), serde_json::to_value(&gpu.links).unwrap_or_default());
    }
    for (key, v) in [("mode", saved.recorded.mode), ("uid", saved.recorded.uid), ("gid", saved.recorded.gid)] {
        if let Some(v) = v {
            o.insert(key.into(), v.into());
        }
    }
    if carried {
        o.insert("earlier_minors".into(), saved.earlier_minors.clone().into());
    }
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<AmdSaved, MetadataError> {
        item(0, v.as_object().unwrap(), RecordedAccess::default())
    }

    /// Rule: an item record writes reads back as it was (the plugin's identity whole).
    #[test]
    fn an_item_round_trips() {
        let gpu = Gpu {
            node: 2,
            gpu_id: 4242,
            facts: Facts {
                device_id: 0x74a1,
                vram_size: 1 << 40,
                vram_public: true,
                drm_render_minor: 136,
                ..Facts::default()
            },
            links: vec![GpuLink { kind: 11, to: 3, to_gpu: true, peer: true }],
        };
        let saved = AmdSaved {
            minor: 136,
            gpu: Some(gpu),
            recorded: RecordedAccess { mode: Some(0o660), uid: Some(0), gid: Some(44) },
            earlier_minors: vec![144, 200],
        };
        let back = item(0, to_json(&saved, true).as_object().unwrap(), saved.recorded).unwrap();
        assert_eq!(back, saved);
        assert!(to_json(&saved, false).get("earlier_minors").is_none(), "not looked for: left out");
        assert_eq!(read(json!({"kind": "amdgpu", "minor": 129})).unwrap().gpu, None);
    }

    /// Rule: a bad item names its key and never echoes a long value.
    #[test]
    fn bad_items_name_the_key() {
        let long = "x".repeat(100);
        for (v, want) in [
            (json!({"kind": "amdgpu"}), "minor: expected the render minor"),
            (json!({"kind": "amdgpu", "minor": 5}), "minor 5 is under 128"),
            (json!({"kind": "amdgpu", "minor": "136"}), "minor: expected an integer"),
            (json!({"kind": "amdgpu", "minor": 136, "properties": []}), "properties: expected an object"),
            (
                json!({"kind": "amdgpu", "minor": 136, "properties": {"device_id": -1}}),
                "properties.device_id: expected",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "properties": {"device_id": 4294967296u64}}),
                "properties.device_id",
            ),
            (json!({"kind": "amdgpu", "minor": 136, "properties": {"vram_public": 1}}), "expected a boolean"),
            (json!({"kind": "amdgpu", "minor": 136, "properties": {long.clone(): 1}}), "not a property the plugin"),
            (
                json!({"kind": "amdgpu", "minor": 136, "properties": {"drm_render_minor": 128}}),
                "is not the item's minor",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "properties": {}, "gpu_id": 70000}),
                "gpu_id: expected an integer 0-65535",
            ),
            (json!({"kind": "amdgpu", "minor": 136, "properties": {}, "links": [{"kind": 3}]}), "links: each is"),
            // Earlier names: render minors, each once, none the item's own.
            (
                json!({"kind": "amdgpu", "minor": 136, "earlier_minors": [136]}),
                "earlier_minors: minor 136 is listed twice or is the GPU's own",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "earlier_minors": [144, 144]}),
                "earlier_minors: minor 144 is listed twice",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "earlier_minors": [5]}),
                "earlier_minors: minor 5 is under 128, the first render minor",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "earlier_minors": [1048576]}),
                "earlier_minors: minor 1048576 is over 1048575",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "earlier_minors": long.clone()}),
                "earlier_minors: expected an array of render minors, found a string",
            ),
            (
                json!({"kind": "amdgpu", "minor": 136, "earlier_minors": [-1]}),
                "earlier_minors: expected render minors, found -1",
            ),
            // Bug: without properties, gpu_id, node and links went unread, a bad one taken.
            (json!({"kind": "amdgpu", "minor": 136, "gpu_id": -1}), "gpu_id: expected an integer 0-65535"),
            (json!({"kind": "amdgpu", "minor": 136, "node": 1.5}), "node: expected an integer"),
            (json!({"kind": "amdgpu", "minor": 136, "links": {}}), "links: expected an array"),
            (
                json!({"kind": "amdgpu", "minor": 136, "properties": {}, "links": long}),
                "links: expected an array, found a string",
            ),
        ] {
            let e = read(v).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains(&long), "{e}");
        }
    }
}
