//! Checkpoint metadata: the saved GPU list (`nvproxy-device-remap-ids`) and, for reporting,
//! the saved TPU list (`tpu-device-remap-ids`).
//!
//! Pure: every function here takes bytes and returns values. Three inputs are accepted, told
//! apart by their first bytes, never by file name: a gVisor state file (magic `gVisorSF`, an
//! 8-byte big-endian length, then a JSON object of strings), a JSON object (the metadata map),
//! and a JSON array (the device list alone). Only the state file's header is ever looked at;
//! [`needed_len`] tells a reader how many bytes that is, so a 50 GiB image costs 16 bytes
//! plus its header.

use crate::family::table::{self, Saved};
use serde_json::{Map, Value};

pub(crate) use crate::inputs::metadata_items::describe;
pub use crate::inputs::metadata_items::{GPU_KEY, MAX_METADATA_LEN, MetadataError, RecordedAccess};

/// The state file magic, ASCII `gVisorSF`.
pub const MAGIC: &[u8; 8] = b"gVisorSF";
/// The metadata key of the saved TPU list.
pub const TPU_KEY: &str = "tpu-device-remap-ids";
const PREFIX_LEN: usize = 16;

/// Which of the accepted forms the input was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Format {
    StateFile,
    Map,
    Array,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::StateFile => "state-file",
            Format::Map => "map",
            Format::Array => "array",
        }
    }
}

/// What the checkpoint says about its devices.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Metadata {
    pub format: Format,
    /// Every family's saved GPUs; empty when the key is absent (nothing was open at save).
    #[serde(flatten)]
    pub saved: Saved,
    /// Whether the GPU key was present at all.
    pub gpu_key_present: bool,
    /// Saved TPUs, as written; reported, not remapped.
    pub tpus: Vec<Value>,
    /// What a user should hear about the input (the caller prefixes the file).
    pub warnings: Vec<String>,
}

/// How many leading bytes of a file [`parse`] needs, judged from its first bytes: for a state
/// file, the 16-byte prefix and then the header; for JSON, everything up to the limit.
/// `Ok(None)` means "read up to `MAX_METADATA_LEN + 1` bytes" (JSON input).
pub fn needed_len(prefix: &[u8]) -> Result<Option<u64>, MetadataError> {
    if !looks_like_state_file(prefix) {
        return Ok(None);
    }
    if prefix.len() < PREFIX_LEN {
        return Ok(Some(PREFIX_LEN as u64));
    }
    let len = header_len(prefix)?;
    Ok(Some(PREFIX_LEN as u64 + len))
}

fn looks_like_state_file(bytes: &[u8]) -> bool {
    // A file shorter than the magic that starts like it is a truncated state file.
    let n = bytes.len().min(MAGIC.len());
    n > 0 && bytes[..n] == MAGIC[..n]
}

fn header_len(bytes: &[u8]) -> Result<u64, MetadataError> {
    let raw: [u8; 8] = bytes[8..16].try_into().expect("caller checked the prefix length");
    let len = u64::from_be_bytes(raw);
    if len > MAX_METADATA_LEN {
        return Err(MetadataError::TooLong(len));
    }
    Ok(len)
}

/// Parses metadata from the leading bytes of a file (the whole file for JSON; for a state
/// file, at least its header: anything after the header is never looked at).
pub fn parse(bytes: &[u8]) -> Result<Metadata, MetadataError> {
    if bytes.is_empty() {
        return Err(MetadataError::Empty);
    }
    if looks_like_state_file(bytes) {
        return parse_state_file(bytes);
    }
    if bytes.len() as u64 > MAX_METADATA_LEN {
        return Err(MetadataError::TooLarge);
    }
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {
            let map = parse_json_object(bytes)?;
            from_map(Format::Map, &map)
        }
        Some(b'[') => {
            let saved = table::read_items(list_items(GPU_KEY, &parse_json(bytes)?)?)?;
            Ok(Metadata { format: Format::Array, saved, gpu_key_present: true, tpus: Vec::new(), warnings: Vec::new() })
        }
        _ => {
            Err(crate::inputs::limits::byte_order_mark(bytes)
                .map_or(MetadataError::UnknownFormat, MetadataError::Encoding))
        }
    }
}

fn parse_state_file(bytes: &[u8]) -> Result<Metadata, MetadataError> {
    if bytes.len() < PREFIX_LEN {
        return Err(MetadataError::Truncated(format!("{} bytes, the magic and length take {PREFIX_LEN}", bytes.len())));
    }
    let len = header_len(bytes)? as usize;
    let header = bytes.get(PREFIX_LEN..PREFIX_LEN + len).ok_or_else(|| {
        MetadataError::Truncated(format!(
            "the header says {len} bytes of metadata, the file has {}",
            bytes.len() - PREFIX_LEN
        ))
    })?;
    let map = parse_json_object(header)?;
    if let Some((key, value)) = map.iter().find(|(_, v)| !v.is_string()) {
        return Err(MetadataError::NotAString { key: key.clone(), found: describe(value) });
    }
    from_map(Format::StateFile, &map)
}

fn parse_json(bytes: &[u8]) -> Result<Value, MetadataError> {
    crate::inputs::limits::parse_json(bytes).map_err(|e| MetadataError::Json(e.to_string()))
}

fn parse_json_object(bytes: &[u8]) -> Result<Map<String, Value>, MetadataError> {
    match parse_json(bytes)? {
        Value::Object(map) => Ok(map),
        other => Err(MetadataError::Shape {
            key: "metadata",
            what: format!("expected a JSON object, found {}", describe(&other)),
        }),
    }
}

fn from_map(format: Format, map: &Map<String, Value>) -> Result<Metadata, MetadataError> {
    let saved = match map.get(GPU_KEY) {
        Some(v) => table::read_items(list_items(GPU_KEY, &embedded(GPU_KEY, v)?)?)?,
        None => Saved::default(),
    };
    let tpus = match map.get(TPU_KEY) {
        Some(v) => tpu_list(&embedded(TPU_KEY, v)?)?,
        None => Vec::new(),
    };
    let mut warnings = Vec::new();
    // gVisor always writes `_timestamp`: a map with neither it nor the GPU list is some other
    // JSON object (a spec given as --metadata, say), which would otherwise pass as "no GPUs".
    if format == Format::Map && !map.is_empty() && !map.contains_key(GPU_KEY) && !map.contains_key("_timestamp") {
        let mut keys: Vec<&str> = map.keys().take(6).map(String::as_str).collect();
        if map.len() > keys.len() {
            keys.push("...");
        }
        warnings.push(format!(
            "a JSON object with neither {GPU_KEY} nor _timestamp (its keys: {}): not checkpoint metadata? \
             no saved GPUs",
            keys.join(", ")
        ));
    }
    Ok(Metadata { format, saved, gpu_key_present: map.contains_key(GPU_KEY), tpus, warnings })
}

/// gVisor stores a list as a string holding JSON; hand-written maps may hold the list itself.
fn embedded(key: &'static str, value: &Value) -> Result<Value, MetadataError> {
    match value {
        Value::String(s) => crate::inputs::limits::parse_json(s.as_bytes())
            .map_err(|e| MetadataError::Shape { key, what: format!("the string value is not valid JSON: {e}") }),
        // A hand-written `null` means what Go's `null` list means: no devices.
        Value::Array(_) | Value::Null => Ok(value.clone()),
        other => Err(MetadataError::Shape {
            key,
            what: format!("expected a JSON array or a string holding one, found {}", describe(other)),
        }),
    }
}

fn list_items<'a>(key: &'static str, value: &'a Value) -> Result<&'a [Value], MetadataError> {
    match value {
        // Go marshals a nil slice as `null`.
        Value::Null => Ok(&[]),
        Value::Array(items) => Ok(items),
        other => Err(MetadataError::Shape {
            key,
            what: format!("expected a JSON array of device ids, found {}", describe(other)),
        }),
    }
}

fn tpu_list(value: &Value) -> Result<Vec<Value>, MetadataError> {
    let items = list_items(TPU_KEY, value)?;
    if let Some((i, item)) = items.iter().enumerate().find(|(_, v)| !v.is_object()) {
        return Err(MetadataError::Shape {
            key: TPU_KEY,
            what: format!("item {i}: expected an object, found {}", describe(item)),
        });
    }
    Ok(items.to_vec())
}

/// Serialises a state file header exactly as gVisor writes it (magic, big-endian length, JSON),
/// for the unit tests below (integration tests and fixtures have their own writers).
#[cfg(test)]
fn encode_state_header(map: &Map<String, Value>) -> Vec<u8> {
    let json = serde_json::to_vec(map).expect("a JSON map always serialises");
    let mut out = Vec::with_capacity(PREFIX_LEN + json.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(json.len() as u64).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Access;
    use crate::family::nvidia::metadata::DeviceId;
    use serde_json::json;

    const UA: &str = "GPU-5b2c6f7e-0d1a-4c3e-9f10-aa0000000000";
    const UB: &str = "GPU-5b2c6f7e-0d1a-4c3e-9f10-aa0000000001";

    fn dev(minor: u32, uuid: &str) -> Value {
        json!({"minor": minor, "pci_vendor_id": 4318, "pci_device_id": 8896, "gpu_id": 768 + minor,
               "device_instance": minor, "subdevice_instance": 0, "uuid": uuid, "future_field": true})
    }

    fn state_file(list: &Value) -> Vec<u8> {
        let mut map = Map::new();
        map.insert("_timestamp".into(), "2026-11-29T00:00:00Z".into());
        map.insert("compression".into(), "flate-best-speed".into());
        map.insert(GPU_KEY.into(), list.to_string().into());
        let mut bytes = encode_state_header(&map);
        bytes.extend_from_slice(b"\x01\x02 state data follows");
        bytes
    }

    /// Rule (issue 20): `model` and `driver_version` are read where present, absent ones are
    /// unknown (gVisor's lists, older records), and one that is no fact is refused naming the
    /// field, never echoing the value.
    #[test]
    fn recorded_facts_are_read_or_refused() {
        let m = parse(br#"[{"minor":0,"model":"NVIDIA H100 80GB HBM3","driver_version":"535.129.03"},{"minor":1}]"#)
            .unwrap();
        assert_eq!(m.saved.gpus[0].model.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(m.saved.gpus[0].driver_version.as_deref(), Some("535.129.03"));
        assert_eq!((m.saved.gpus[1].model.as_ref(), m.saved.gpus[1].driver_version.as_ref()), (None, None));
        let huge = format!(r#"[{{"minor":0,"model":"{}"}}]"#, "x".repeat(10_000));
        for (text, message) in [
            (huge.as_str(), "nvproxy-device-remap-ids[0].model: is 10000 bytes, longer than the 95 any driver writes"),
            (r#"[{"minor":0,"model":""}]"#, "nvproxy-device-remap-ids[0].model: is empty"),
            (r#"[{"minor":0,"model":null}]"#, "nvproxy-device-remap-ids[0].model: expected a string, found null"),
            (
                r#"[{"minor":0,"driver_version":5}]"#,
                "nvproxy-device-remap-ids[0].driver_version: expected a string, found 5",
            ),
            (
                r#"[{"minor":0,"driver_version":"5\u001b[2J"}]"#,
                "nvproxy-device-remap-ids[0].driver_version: holds a control character",
            ),
        ] {
            assert_eq!(parse(text.as_bytes()).unwrap_err().to_string(), message);
        }
    }

    /// Rule (issue 20; issue 22 for AMD's render names): `earlier_minors` are GPU minors, sorted
    /// on reading; one that is the GPU's own, listed twice, over 247, or another GPU's name is
    /// refused.
    #[test]
    fn earlier_minors_are_names_of_one_gpu_each() {
        let m = parse(br#"[{"minor":2,"earlier_minors":[7,0]},{"minor":3}]"#).unwrap();
        assert_eq!(
            (m.saved.gpus[0].earlier_minors.as_slice(), m.saved.gpus[1].earlier_minors.as_slice()),
            (&[0, 7][..], &[][..])
        );
        for (text, message) in [
            (
                r#"[{"minor":2,"earlier_minors":[2]}]"#,
                "[0].earlier_minors: minor 2 is listed twice or is the GPU's own",
            ),
            (
                r#"[{"minor":2,"earlier_minors":[0,0]}]"#,
                "[0].earlier_minors: minor 0 is listed twice or is the GPU's own",
            ),
            (
                r#"[{"minor":2,"earlier_minors":[248]}]"#,
                "[0].earlier_minors: minor 248 is over 247, the largest GPU minor",
            ),
            (
                r#"[{"minor":2,"earlier_minors":"0"}]"#,
                "[0].earlier_minors: expected an array of GPU minors, found the string \"0\"",
            ),
            (r#"[{"minor":2,"earlier_minors":[-1]}]"#, "[0].earlier_minors: expected GPU minors, found -1"),
            (r#"[{"minor":2,"earlier_minors":[3]},{"minor":3}]"#, "nvproxy-device-remap-ids: minor 3 appears twice"),
            (r#"[{"minor":2,"earlier_minors":[0]},{"minor":3,"earlier_minors":[0]}]"#, "minor 0 appears twice"),
            // AMD's earlier names, each render name one GPU's.
            (
                r#"[{"kind":"amdgpu","minor":136,"earlier_minors":[144]},{"kind":"amdgpu","minor":144}]"#,
                "nvproxy-device-remap-ids: amdgpu render minor 144 appears twice",
            ),
            (
                r#"[{"kind":"amdgpu","minor":136,"earlier_minors":[152]},{"kind":"amdgpu","minor":144,"earlier_minors":[152]}]"#,
                "amdgpu render minor 152 appears twice",
            ),
        ] {
            let e = parse(text.as_bytes()).unwrap_err().to_string();
            assert!(e.ends_with(message), "{text}: {e}");
        }
    }

    /// Format: a state file's list is a string holding JSON; all seven fields are read, unknown
    /// ones ignored, and the result is sorted by minor.
    #[test]
    fn state_file_header_gives_sorted_devices() {
        let m = parse(&state_file(&json!([dev(3, UB), dev(1, UA)]))).unwrap();
        assert_eq!(m.format, Format::StateFile);
        assert_eq!(m.saved.gpus.iter().map(|d| d.minor).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(
            m.saved.gpus[0],
            DeviceId {
                minor: 1,
                pci_vendor_id: 4318,
                pci_device_id: 8896,
                gpu_id: 769,
                device_instance: 1,
                subdevice_instance: 0,
                uuid: UA.into(),
                ..DeviceId::default()
            }
        );
    }

    /// Format: the three forms are told apart by content and agree.
    #[test]
    fn map_and_array_forms_agree_with_state_file() {
        let list = json!([dev(0, UA), dev(1, UB)]);
        let from_state = parse(&state_file(&list)).unwrap().saved.gpus;
        let as_string = json!({ GPU_KEY: list.to_string() }).to_string();
        let as_array = json!({ GPU_KEY: list }).to_string();
        assert_eq!(parse(as_string.as_bytes()).unwrap().saved.gpus, from_state);
        assert_eq!(parse(as_array.as_bytes()).unwrap().saved.gpus, from_state);
        let bare = parse(format!("  \n{list}").as_bytes()).unwrap();
        assert_eq!((bare.format, bare.saved.gpus), (Format::Array, from_state));
    }

    /// An absent key means nothing to remap, not an error; a TPU list is kept for the report.
    #[test]
    fn absent_gpu_key_and_tpu_key() {
        let m = parse(
            json!({"_timestamp": "x", TPU_KEY: "[{\"BDF\":\"0000:00:04.0\",\"vfio_group\":3}]"}).to_string().as_bytes(),
        )
        .unwrap();
        assert!(m.saved.gpus.is_empty() && !m.gpu_key_present);
        assert_eq!(m.tpus.len(), 1);
    }

    /// Bug (issue 10.3): a UUID that is not well formed (the driver's placeholder for an
    /// unreadable one) is unknown: two saved GPUs with it are not duplicates, and it is no
    /// identity a `--device-map` could name.
    #[test]
    fn malformed_saved_uuids_are_unknown() {
        let placeholder = "GPU-????????-????-????-????-????????????";
        let m =
            parse(json!([dev(0, placeholder), dev(1, placeholder), dev(2, "GPU-a")]).to_string().as_bytes()).unwrap();
        assert!(m.saved.gpus.iter().all(|d| d.uuid.is_empty()), "{:?}", m.saved.gpus);
    }

    /// Bug (issue 10.8): a JSON object with neither the GPU list nor gVisor's `_timestamp` (a
    /// spec given as --metadata) is accepted as "no saved GPUs" but warned about, naming its
    /// keys; gVisor's own map without the GPU list (nothing was open at save) is not.
    #[test]
    fn map_that_is_not_metadata_is_warned_about() {
        let spec = json!({"ociVersion": "1.0.2", "process": {}, "root": {}, "hostname": "h", "mounts": [],
                          "linux": {}, "hooks": {}});
        let m = parse(spec.to_string().as_bytes()).unwrap();
        assert!(m.saved.gpus.is_empty() && !m.gpu_key_present);
        assert_eq!(m.warnings.len(), 1);
        assert!(m.warnings[0].contains("neither nvproxy-device-remap-ids nor _timestamp"), "{:?}", m.warnings);
        assert!(
            m.warnings[0].contains("(its keys: ociVersion, process, root, hostname, mounts, linux, ...)"),
            "{:?}",
            m.warnings
        );
        for quiet in [json!({"_timestamp": "x", "compression": "none"}), json!({}), json!({GPU_KEY: "[]", "x": 1})] {
            assert!(parse(quiet.to_string().as_bytes()).unwrap().warnings.is_empty(), "{quiet}");
        }
        let mut map = Map::new();
        map.insert("other".into(), "x".into());
        assert!(parse(&encode_state_header(&map)).unwrap().warnings.is_empty(), "a state file is a checkpoint");
    }

    /// Header: only the header is needed; `needed_len` stops a reader there.
    #[test]
    fn needed_len_is_the_header() {
        let bytes = state_file(&json!([dev(0, UA)]));
        let n = needed_len(&bytes[..16]).unwrap().unwrap() as usize;
        assert!(n < bytes.len());
        assert_eq!(parse(&bytes[..n]).unwrap().saved.gpus.len(), 1);
        assert_eq!(needed_len(b"[1]").unwrap(), None);
    }

    /// Bad input: each malformed header or list is refused with a message naming the problem.
    #[test]
    fn malformed_inputs_are_refused() {
        let good = state_file(&json!([dev(0, UA)]));
        assert_eq!(parse(b""), Err(MetadataError::Empty));
        assert!(matches!(parse(&good[..12]), Err(MetadataError::Truncated(_))));
        assert!(matches!(parse(&good[..20]), Err(MetadataError::Truncated(_))));
        assert!(matches!(parse(b"gVisor"), Err(MetadataError::Truncated(_))));
        let mut long = MAGIC.to_vec();
        long.extend_from_slice(&(MAX_METADATA_LEN + 1).to_be_bytes());
        assert_eq!(parse(&long), Err(MetadataError::TooLong(MAX_METADATA_LEN + 1)));
        assert_eq!(parse(b"gVisorXX\0\0\0\0\0\0\0\x02{}"), Err(MetadataError::UnknownFormat));
        assert_eq!(parse(b"hello"), Err(MetadataError::UnknownFormat));
        assert!(matches!(parse(b"{\"a\": "), Err(MetadataError::Json(_))));
        let cases = [
            (json!([{"minor": "1"}]), "minor: expected an unsigned 32-bit integer, found the string \"1\""),
            (json!([{"minor": -1}]), "found -1"),
            (json!([{"minor": 1.5}]), "found 1.5"),
            (json!([{"minor": 1, "uuid": 7}]), "uuid: expected a string"),
            (json!([{"uuid": "GPU-a"}]), "found nothing"),
            (json!([{"minor": 248}]), "minor 248 is over 247"),
            (json!([{"minor": 1}, {"minor": 1}]), "minor 1 appears twice"),
            (json!([dev(1, UA), dev(2, UA)]), "uuid GPU-5b2c6f7e-0d1a-4c3e-9f10-aa0000000000 appears twice"),
            (json!([[1]]), "expected an object"),
            (json!({GPU_KEY: 5}), "expected a JSON array or a string"),
            (json!({GPU_KEY: {}}), "expected a JSON array or a string"),
            (json!({GPU_KEY: "{}"}), "expected a JSON array of device ids"),
            (json!({GPU_KEY: "[nope"}), "not valid JSON"),
        ];
        for (input, expected) in cases {
            let err = parse(input.to_string().as_bytes()).unwrap_err().to_string();
            assert!(err.contains(expected), "{input}: {err:?} lacks {expected:?}");
        }
    }

    /// Format: `mode`, `uid` and `gid` are optional and read when present; a mode with type
    /// bits or a negative owner is refused. Bug (found from outside): metadata from another host
    /// could give a served GPU node setuid/setgid or the owner 4294967295.
    #[test]
    fn recorded_access_fields() {
        let mut item = dev(0, "GPU-a");
        item["mode"] = json!(0o660);
        item["gid"] = json!(44);
        let m = parse(json!([item, dev(1, "GPU-b")]).to_string().as_bytes()).unwrap();
        assert_eq!(m.saved.gpus[0].recorded, RecordedAccess { mode: Some(0o660), uid: None, gid: Some(44) });
        assert_eq!(m.saved.gpus[0].recorded.over(Access::DEVICE_DEFAULT), Access { mode: 0o660, uid: 0, gid: 44 });
        assert_eq!(m.saved.gpus[1].recorded, RecordedAccess::default());
        let cases = [
            (json!([{"minor": 0, "mode": 0o20666}]), "mode: 0o20666 has bits beyond the permission and sticky bits"),
            (json!([{"minor": 0, "mode": 0o4666}]), "mode: 0o4666 has bits beyond"),
            (json!([{"minor": 0, "mode": 0o2666}]), "mode: 0o2666 has bits beyond"),
            (json!([{"minor": 0, "uid": 4294967295u32}]), "[0].uid: 4294967295 is no owner"),
            (json!([{"minor": 0, "gid": 4294967295u32}]), "[0].gid: 4294967295 is no owner"),
            (json!([{"minor": 0, "uid": -1}]), "[0].uid: expected an unsigned 32-bit integer, found -1"),
            (json!([{"minor": 0, "gid": "5"}]), "[0].gid: expected an unsigned 32-bit integer"),
        ];
        for (input, expected) in cases {
            let err = parse(input.to_string().as_bytes()).unwrap_err().to_string();
            assert!(err.contains(expected), "{input}: {err:?} lacks {expected:?}");
        }
    }

    /// Bug (found from outside): two saved GPUs whose UUIDs differ only in the case of their
    /// hex digits are the same GPU, yet passed the duplicate check and were both remapped.
    #[test]
    fn a_uuid_twice_in_two_cases_is_a_duplicate() {
        let err = parse(json!([dev(0, UA), dev(1, &UA.to_uppercase())]).to_string().as_bytes()).unwrap_err();
        assert!(matches!(err, MetadataError::DuplicateUuid(_)), "{err}");
    }

    /// Bug (found from outside): a JSON file saved by an editor with a byte-order mark, or as
    /// UTF-16, was "not checkpoint metadata: expected ... a JSON object or a JSON array",
    /// though it held one; the error says what the text is.
    #[test]
    fn a_byte_order_mark_is_named() {
        let err = parse(b"\xef\xbb\xbf[{\"minor\":0}]").unwrap_err();
        assert_eq!(
            err.to_string(),
            "the text is UTF-8 with a byte-order mark; JSON is UTF-8 without a byte-order mark"
        );
        assert_eq!(parse(b"\xff\xfe[\0]\0"), Err(MetadataError::Encoding("UTF-16")));
    }

    /// A state file's map holds strings only, as gVisor writes it.
    #[test]
    fn state_file_values_must_be_strings() {
        let mut map = Map::new();
        map.insert("_timestamp".into(), json!(5));
        let err = parse(&encode_state_header(&map)).unwrap_err();
        assert!(matches!(err, MetadataError::NotAString { .. }), "{err}");
    }

    /// Deep nesting is an error from the JSON parser's recursion limit, never a stack overflow.
    #[test]
    fn deep_nesting_is_an_error() {
        let deep = "[".repeat(100_000);
        assert!(matches!(parse(deep.as_bytes()), Err(MetadataError::Json(_))));
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Property: parsing any bytes returns Ok or Err, never panics.
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse(&bytes);
            let _ = needed_len(&bytes);
        }

        /// Property: any bytes after a valid magic never panic, whatever the length field says.
        #[test]
        fn state_headers_never_panic(len in any::<u64>(), tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&len.to_be_bytes());
            bytes.extend_from_slice(&tail);
            let _ = parse(&bytes);
        }
    }
}
