//! Rewriting an OCI runtime spec so that the container's `/dev` is a devremap mount.
//!
//! Pure: takes the spec as JSON and returns it changed, so that every field this crate does
//! not model survives byte for byte in meaning (and, with `preserve_order`, in order). The
//! `/dev` mount is replaced where it stands, so the mounts after it (`/dev/pts`, `/dev/shm`,
//! `/dev/mqueue`) still land on top of it; `linux.devices` and `linux.resources.devices` are
//! left alone, since the runtime builds the device cgroup from them.
//!
//! [`patch_text`] does the same to the spec's text, changing only the text of the `/dev` mount
//! (or inserting one), so that a text diff of the spec shows that change and nothing else: the
//! keys' order, the indentation and the line breaks elsewhere are the file's own.
//!
//! A spec that binds something else onto `/dev` (`docker run -v /dev:/dev`) asked for that
//! `/dev`: it is refused rather than silently replaced or left to cover the devremap mount
//! (issue 17.6); a second tmpfs `/dev` after the first would cover ours, so it is dropped.
//!
//! [`relocate`] is the wrapper's half: the patched spec goes into a bundle of the wrapper's own,
//! so its paths that the runtime resolves against the bundle (`root.path`, the sources of bind
//! mounts) are made absolute against the caller's bundle, which is never written (issue 17.7).

use serde_json::{Map, Value, json};
use std::path::Path;
use thiserror::Error;

/// Why a spec could not be patched.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PatchError {
    #[error("not a valid OCI runtime spec: {0}")]
    Spec(String),
    #[error(
        "mounts: {from:?} is bound onto /dev, which would cover the devremap /dev; \
         drop that mount, or run the container without devremap"
    )]
    DevBound { from: String },
    #[error("the bundle {0:?} is not a UTF-8 path, which a spec cannot hold; give the bundle another path")]
    BundleNotUtf8(String),
}

/// Whether a mount is a bind mount, as runc decides it: `bind`/`rbind` in its options or
/// its type (runc ignores the type of a bind mount).
fn is_bind(mount: &Value) -> bool {
    let opt = |o: &Value| matches!(o.as_str(), Some("bind" | "rbind"));
    mount.get("type").and_then(Value::as_str) == Some("bind")
        || mount.get("options").and_then(Value::as_array).is_some_and(|o| o.iter().any(opt))
}

/// The mount that puts `dev` (an absolute host path) at the container's `/dev`.
pub fn dev_mount(dev: &str) -> Value {
    json!({"destination": "/dev", "type": "bind", "source": dev, "options": ["rbind", "nosuid", "noexec"]})
}

fn destination(mount: &Value) -> Option<String> {
    let d = mount.get("destination")?.as_str()?;
    let trimmed = d.trim_end_matches('/');
    Some(if trimmed.is_empty() { "/".to_owned() } else { trimmed.to_owned() })
}

/// Replaces the spec's `/dev` mount with a bind mount of `dev`, in the same place; with no
/// `/dev` mount, puts one before the first mount under `/dev` (or last). Idempotent.
pub fn patch(spec: &Value, dev: &str) -> Result<Value, PatchError> {
    // The runtime must be able to read what we write: check the spec parses as one.
    serde_json::from_value::<oci_spec::runtime::Spec>(spec.clone()).map_err(|e| PatchError::Spec(e.to_string()))?;
    let mut spec = spec.clone();
    let obj: &mut Map<String, Value> =
        spec.as_object_mut().ok_or_else(|| PatchError::Spec("expected a JSON object".into()))?;
    let mounts = obj.entry("mounts").or_insert_with(|| Value::Array(Vec::new()));
    let mounts = mounts.as_array_mut().ok_or_else(|| PatchError::Spec("mounts: expected an array".into()))?;
    // Every mount has a string destination: the spec parsed.
    let dests: Vec<String> = mounts.iter().map(|m| destination(m).unwrap_or_default()).collect();
    let ours = dev_mount(dev);
    let at_dev: Vec<usize> = (0..mounts.len()).filter(|&i| dests[i] == "/dev").collect();
    // Our own mount (a spec patched before) is replaced; any other bind onto /dev is refused.
    if let Some(theirs) = at_dev.iter().map(|&i| &mounts[i]).find(|m| is_bind(m) && **m != ours) {
        let from = theirs.get("source").and_then(Value::as_str).unwrap_or_default().to_owned();
        return Err(PatchError::DevBound { from });
    }
    match at_dev.split_first() {
        Some((&first, rest)) => {
            mounts[first] = ours;
            // Later ones would be mounted over ours.
            for &i in rest.iter().rev() {
                mounts.remove(i);
            }
        }
        None => {
            let at = dests.iter().position(|d| d.starts_with("/dev/")).unwrap_or(mounts.len());
            mounts.insert(at, ours);
        }
    }
    Ok(spec)
}

/// The spec's text patched as [`patch`] patches its value: only the `/dev` mount's text is
/// replaced (or a new one inserted between two mounts), written in the layout of the mount
/// beside it (on one line, compact or spaced, or indented like it). The text is returned as
/// it is when nothing changes. A spec whose mounts cannot be found in the text this way (no
/// `mounts` array, an empty one) is written whole, in its own indentation.
pub fn patch_text(text: &str, dev: &str) -> Result<String, PatchError> {
    let spec: Value = serde_json::from_str(text).map_err(|e| PatchError::Spec(e.to_string()))?;
    let patched = patch(&spec, dev)?;
    if patched == spec {
        return Ok(text.to_owned());
    }
    let ours = dev_mount(dev);
    // A splice that does not read back as the patched spec (a second /dev mount dropped)
    // gives way to the whole spec written in the file's indentation.
    let spliced =
        splice(text, &spec, &ours).filter(|out| serde_json::from_str::<Value>(out).ok() == Some(patched.clone()));
    Ok(spliced.unwrap_or_else(|| {
        let mut whole = render(&patched, text, "", &indent_unit(text));
        if text.ends_with('\n') {
            whole.push('\n');
        }
        whole
    }))
}

/// One element of the `mounts` array in the text: the whitespace before it starts at
/// `gap`, the element spans `start..end`.
struct Span {
    gap: usize,
    start: usize,
    end: usize,
}

/// Replaces or inserts `ours` in the text's `mounts` array, where [`patch`] does.
fn splice(text: &str, spec: &Value, ours: &Value) -> Option<String> {
    let mounts = spec.get("mounts")?.as_array()?;
    let elements = mount_spans(text)?;
    if elements.len() != mounts.len() || elements.is_empty() {
        return None;
    }
    let dests: Vec<String> = mounts.iter().map(|m| destination(m).unwrap_or_default()).collect();
    let unit = indent_unit(text);
    let mut out = String::with_capacity(text.len() + 128);
    if let Some(i) = dests.iter().position(|d| d == "/dev") {
        let e = &elements[i];
        out.push_str(&text[..e.start]);
        out.push_str(&render(ours, &text[e.start..e.end], line_indent(text, e.start), &unit));
        out.push_str(&text[e.end..]);
    } else {
        let at = dests.iter().position(|d| d.starts_with("/dev/"));
        let beside = &elements[at.unwrap_or(elements.len() - 1)];
        let rendered = render(ours, &text[beside.start..beside.end], line_indent(text, beside.start), &unit);
        let gap = &text[beside.gap..beside.start];
        let cut = if at.is_some() { beside.start } else { beside.end };
        out.push_str(&text[..cut]);
        if at.is_some() {
            out.push_str(&format!("{rendered},{gap}"));
        } else {
            out.push_str(&format!(",{gap}{rendered}"));
        }
        out.push_str(&text[cut..]);
    }
    Some(out)
}

/// `value` in the layout of `like` (text of a JSON value): compact or spaced on one line, or
/// indented by `unit` a level, its lines after the first starting with `indent`.
fn render(value: &Value, like: &str, indent: &str, unit: &str) -> String {
    if !like.trim_end().contains('\n') {
        return if like.contains("\": ") || like.contains(", ") { spaced(value) } else { value.to_string() };
    }
    let mut buf = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(unit.as_bytes());
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, formatter);
    // A Value always serialises, into memory.
    let _ = serde::Serialize::serialize(value, &mut ser);
    String::from_utf8_lossy(&buf).replace('\n', &format!("\n{indent}"))
}

/// `value` on one line, with a space after each `:` and `,`.
fn spaced(value: &Value) -> String {
    match value {
        Value::Array(items) => format!("[{}]", items.iter().map(spaced).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let members: Vec<String> =
                map.iter().map(|(k, v)| format!("{}: {}", Value::from(k.as_str()), spaced(v))).collect();
            format!("{{{}}}", members.join(", "))
        }
        other => other.to_string(),
    }
}

/// The whitespace that starts the line holding byte `at`.
fn line_indent(text: &str, at: usize) -> &str {
    let line = text[..at].rfind('\n').map_or(0, |n| n + 1);
    let rest = &text[line..at];
    &rest[..rest.len() - rest.trim_start().len()]
}

/// The text's indentation unit: the leading whitespace of its first indented line, after
/// the indentation of the line before (two spaces when no line is indented).
fn indent_unit(text: &str) -> String {
    let mut previous = "";
    for line in text.lines() {
        let lead = &line[..line.len() - line.trim_start().len()];
        if lead.len() > previous.len() && lead.starts_with(previous) && !line.trim().is_empty() {
            return lead[previous.len()..].to_owned();
        }
        if !line.trim().is_empty() {
            previous = lead;
        }
    }
    "  ".to_owned()
}

/// The spans of the elements of the top-level object's `mounts` array (its last, as a
/// parser takes duplicate keys); `None` when the text is not an object with such an array.
fn mount_spans(text: &str) -> Option<Vec<Span>> {
    let b = text.as_bytes();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(b, i + 1);
    let mut array = None;
    while b.get(i) == Some(&b'"') {
        let key_end = skip_string(b, i)?;
        let key: String = serde_json::from_str(&text[i..key_end]).ok()?;
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, i + 1);
        let end = skip_value(b, start)?;
        if key == "mounts" {
            array = Some(start);
        }
        i = skip_ws(b, end);
        if b.get(i) == Some(&b',') {
            i = skip_ws(b, i + 1);
        }
    }
    let start = array?;
    if b.get(start) != Some(&b'[') {
        return None;
    }
    let mut spans = Vec::new();
    let mut gap = start + 1;
    loop {
        let element = skip_ws(b, gap);
        match b.get(element)? {
            b']' => return Some(spans),
            b',' => gap = element + 1,
            _ => {
                let end = skip_value(b, element)?;
                spans.push(Span { gap, start: element, end });
                gap = end;
            }
        }
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// Past the string starting at `i`.
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    loop {
        match b.get(i)? {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

/// Past the value starting at `i`, in text that parsed as JSON.
fn skip_value(b: &[u8], mut i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            loop {
                match b.get(i)? {
                    b'"' => {
                        i = skip_string(b, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            while b.get(i).is_some_and(|c| !matches!(c, b',' | b'}' | b']') && !c.is_ascii_whitespace()) {
                i += 1;
            }
            Some(i)
        }
    }
}

/// Makes the paths of `spec` that the runtime resolves against its bundle absolute against
/// `bundle` (an absolute path), so that the spec works from another bundle directory:
/// `root.path` and the source of every bind mount. Absolute paths are kept as they are.
/// (runc refuses a rootfs reached through a symlink, so a link to the caller's would not do.)
pub fn relocate(spec: &mut Value, bundle: &Path) -> Result<(), PatchError> {
    let base = bundle.to_str().ok_or_else(|| PatchError::BundleNotUtf8(bundle.to_string_lossy().into_owned()))?;
    let absolute = |v: &mut Value| {
        if let Some(p) = v.as_str().filter(|p| !p.starts_with('/')) {
            *v = Value::String(format!("{}/{p}", base.trim_end_matches('/')));
        }
    };
    if let Some(root) = spec.pointer_mut("/root/path") {
        absolute(root);
    }
    if let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) {
        for m in mounts.iter_mut().filter(|m| is_bind(m)) {
            if let Some(source) = m.get_mut("source") {
                absolute(source);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mounts: Value) -> Value {
        json!({"ociVersion": "1.0.2", "process": {"cwd": "/", "user": {"uid": 0, "gid": 0}, "args": ["sh"]},
               "root": {"path": "rootfs"}, "mounts": mounts, "x-unknown": {"kept": true},
               "linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
                         "resources": {"devices": [{"allow": false, "access": "rwm"}]}}})
    }

    fn dests(v: &Value) -> Vec<&str> {
        v["mounts"].as_array().unwrap().iter().map(|m| m["destination"].as_str().unwrap()).collect()
    }

    /// The tmpfs /dev becomes our bind mount in the same place; the rest is untouched.
    #[test]
    fn replaces_dev_in_place() {
        let s = spec(
            json!([{"destination": "/proc", "type": "proc"}, {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                            {"destination": "/dev/pts", "type": "devpts"}]),
        );
        let p = patch(&s, "/run/devremap/c1").unwrap();
        assert_eq!(dests(&p), ["/proc", "/dev", "/dev/pts"]);
        assert_eq!(p["mounts"][1], dev_mount("/run/devremap/c1"));
        assert_eq!(p["linux"], s["linux"]);
        assert_eq!(p["x-unknown"], s["x-unknown"]);
    }

    /// Patching a patched spec changes nothing.
    #[test]
    fn idempotent() {
        let s = spec(json!([{"destination": "/dev/", "type": "tmpfs"}, {"destination": "/dev/shm", "type": "tmpfs"}]));
        let once = patch(&s, "/d").unwrap();
        assert_eq!(patch(&once, "/d").unwrap(), once);
    }

    /// Without a /dev mount, ours goes before the first mount under /dev.
    #[test]
    fn inserts_before_dev_submounts() {
        let s = spec(json!([{"destination": "/proc"}, {"destination": "/dev/pts"}, {"destination": "/sys"}]));
        assert_eq!(dests(&patch(&s, "/d").unwrap()), ["/proc", "/dev", "/dev/pts", "/sys"]);
    }

    /// Rule (issue 17.6): `docker run -v /dev:/dev` binds the host's /dev over the spec's: the
    /// devremap mount would be covered (or would silently replace the user's), so it is refused;
    /// a second tmpfs /dev is dropped, since it would be mounted over ours.
    #[test]
    fn another_dev_mount_is_refused_or_dropped() {
        let bound = spec(json!([{"destination": "/dev", "type": "tmpfs"},
                                {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind"]}]));
        assert_eq!(patch(&bound, "/d").unwrap_err(), PatchError::DevBound { from: "/dev".into() });
        let by_option = spec(json!([{"destination": "/dev/", "source": "/srv/dev", "options": ["bind", "ro"]}]));
        assert!(patch(&by_option, "/d").unwrap_err().to_string().contains("\"/srv/dev\" is bound onto /dev"));
        let two = spec(json!([{"destination": "/dev", "type": "tmpfs"}, {"destination": "/dev/pts"},
                              {"destination": "/dev", "type": "tmpfs"}]));
        assert_eq!(dests(&patch(&two, "/d").unwrap()), ["/dev", "/dev/pts"]);
    }

    /// Rule (issue 17.7): a spec moved to the wrapper's bundle keeps its rootfs and relative
    /// bind sources, resolved against the caller's bundle; absolute ones and non-bind mounts'
    /// sources (`proc`, `tmpfs`) are kept.
    #[test]
    fn relocate_makes_bundle_paths_absolute() {
        let mut s = spec(json!([{"destination": "/proc", "type": "proc", "source": "proc"},
                                {"destination": "/data", "type": "bind", "source": "data"},
                                {"destination": "/etc/x", "source": "x", "options": ["rbind"]},
                                {"destination": "/abs", "type": "bind", "source": "/srv/abs"}]));
        relocate(&mut s, Path::new("/b/u")).unwrap();
        assert_eq!(s["root"]["path"], "/b/u/rootfs");
        let sources: Vec<&str> =
            s["mounts"].as_array().unwrap().iter().map(|m| m["source"].as_str().unwrap()).collect();
        assert_eq!(sources, ["proc", "/b/u/data", "/b/u/x", "/srv/abs"]);
        let not_utf8: &std::ffi::OsStr = std::os::unix::ffi::OsStrExt::from_bytes(b"/b/\xff");
        assert!(matches!(relocate(&mut s, Path::new(not_utf8)), Err(PatchError::BundleNotUtf8(_))));
    }

    /// A spec that does not parse is refused.
    #[test]
    fn refuses_bad_specs() {
        assert!(matches!(patch(&json!([]), "/d"), Err(PatchError::Spec(_))));
        assert!(matches!(patch(&json!({"mounts": 5}), "/d"), Err(PatchError::Spec(_))));
        assert_eq!(
            patch(&spec(json!([{"type": "tmpfs"}])), "/d").unwrap_err(),
            PatchError::Spec("missing field `destination`".into())
        );
    }

    /// The lines of `b` that are not lines of `a`, and the other way round.
    fn changed(a: &str, b: &str) -> (Vec<String>, Vec<String>) {
        let (la, lb): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
        let only = |x: &[&str], y: &[&str]| x.iter().filter(|l| !y.contains(l)).map(|l| (*l).to_owned()).collect();
        (only(&la, &lb), only(&lb, &la))
    }

    fn patched_value(text: &str, dev: &str) -> Value {
        patch(&serde_json::from_str(text).unwrap(), dev).unwrap()
    }

    /// Rule (issue 21): the shipped example, hand-laid-out, changes in its /dev line alone.
    #[test]
    fn the_example_changes_in_one_line() {
        let text = include_str!("../../examples/config.json");
        let out = patch_text(text, "/run/devremap/ctr1").unwrap();
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), patched_value(text, "/run/devremap/ctr1"));
        let (gone, added) = changed(text, &out);
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert!(gone[0].contains(r#""destination": "/dev", "type": "tmpfs""#), "{gone:?}");
        assert_eq!(
            added,
            [gone[0].replace(
                gone[0].trim(),
                r#"{"destination": "/dev", "type": "bind", "source": "/run/devremap/ctr1", "options": ["rbind", "nosuid", "noexec"]},"#
            )]
        );
        assert_eq!(out.lines().count(), text.lines().count());
        // Patched again: the same text.
        assert_eq!(patch_text(&out, "/run/devremap/ctr1").unwrap(), out);
    }

    /// Pretty-printed with `unit`, as `runc spec` (tabs) and others (spaces) write specs.
    fn pretty(v: &Value, unit: &str) -> String {
        let mut buf = Vec::new();
        let mut ser = serde_json::Serializer::with_formatter(
            &mut buf,
            serde_json::ser::PrettyFormatter::with_indent(unit.as_bytes()),
        );
        serde::Serialize::serialize(v, &mut ser).unwrap();
        String::from_utf8(buf).unwrap() + "\n"
    }

    /// Rule (issue 21): an indented spec keeps its indentation and key order: only the /dev
    /// mount's lines change, and an inserted mount is laid out like its neighbour.
    #[test]
    fn indented_specs_keep_their_layout() {
        let with_dev = spec(
            json!([{"destination": "/proc", "type": "proc"}, {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                                   {"destination": "/dev/pts", "type": "devpts"}]),
        );
        let without = spec(json!([{"destination": "/proc", "type": "proc"}, {"destination": "/sys", "type": "sysfs"}]));
        let before_pts =
            spec(json!([{"destination": "/proc", "type": "proc"}, {"destination": "/dev/pts", "type": "devpts"}]));
        for unit in ["\t", "  ", "    "] {
            for s in [&with_dev, &without, &before_pts] {
                let text = pretty(s, unit);
                let out = patch_text(&text, "/d").unwrap();
                assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), patch(s, "/d").unwrap(), "{out}");
                assert_eq!(out, pretty(&patch(s, "/d").unwrap(), unit), "{unit:?}: laid out as the rest");
                let (gone, _) = changed(&text, &out);
                assert!(gone.iter().all(|l| l.contains("tmpfs") || l.contains("/dev")), "{gone:?}");
            }
        }
    }

    /// A compact spec (containerd and Docker write them) stays compact and on one line.
    #[test]
    fn compact_specs_stay_compact() {
        let s = spec(json!([{"destination": "/proc", "type": "proc"}, {"destination": "/dev", "type": "tmpfs"}]));
        let out = patch_text(&s.to_string(), "/d").unwrap();
        assert_eq!(out, patch(&s, "/d").unwrap().to_string());
        // No mounts at all: written whole, compact still.
        let bare = json!({"ociVersion": "1.0.2", "root": {"path": "rootfs"}});
        assert_eq!(patch_text(&bare.to_string(), "/d").unwrap(), patch(&bare, "/d").unwrap().to_string());
        assert!(matches!(patch_text("{", "/d"), Err(PatchError::Spec(_))));
    }
}
