use super::*;
use std::collections::BTreeMap;

const ENTRY: &str = include_str!("../../../dist/containerd/devremap.toml");
const BIN: &str = "/usr/local/bin/devremap-runtime";
const RT: &str = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes";

fn entry() -> Entry {
    Entry::parse("devremap.toml", ENTRY, Some(BIN)).unwrap()
}

/// The edit of `text`, which must parse again, hold the handler with the wrapper's path, and
/// be left as it is by a second edit (a second install changes nothing).
fn edited(text: &str) -> String {
    let out = add_handler("config.toml", Some(text), &entry()).unwrap_or_else(|e| panic!("{text}: {e}"));
    let doc: DocumentMut = out.text.parse().unwrap_or_else(|e| panic!("{}: {e}", out.text));
    let binary = at(doc.as_item(), &handler_path()).and_then(|h| h.get("options")).and_then(|o| o.get("BinaryName"));
    assert_eq!(binary.and_then(Item::as_str), Some(BIN), "{}", out.text);
    let again = add_handler("config.toml", Some(&out.text), &entry()).unwrap();
    assert_eq!(again, Edited { text: out.text.clone(), had_ours: true }, "a second edit changed it");
    out.text
}

fn systemd(text: &str) -> Option<bool> {
    let doc: DocumentMut = text.parse().unwrap();
    at(doc.as_item(), &runtime_path(HANDLER, &["options", "SystemdCgroup"])).and_then(Item::as_bool)
}

fn refused(text: &str) -> String {
    match add_handler("config.toml", Some(text), &entry()) {
        Ok(out) => panic!("{text}: not refused:\n{}", out.text),
        Err(e) => e.to_string(),
    }
}

/// Rule (issue 30.1): the operator's file is kept byte for byte, the handler added after it as
/// tables of its own with the systemd cgroup driver of the default runtime (`nvidia` here).
#[test]
fn adds_after_the_operators_lines_keeping_them() {
    let operator = format!(
        "version = 2\n\n# the operator's\n{RT}.nvidia]\n  runtime_type = \"io.containerd.runc.v2\"\n{RT}.nvidia.options]\n  SystemdCgroup = true\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"nvidia\"\n"
    );
    let out = edited(&operator);
    let mut kept = out.lines();
    assert!(operator.lines().all(|l| kept.any(|k| k == l)), "the operator's lines not kept in order:\n{out}");
    assert!(out.contains(&format!("{RT}.devremap]")) && out.contains(MARKER), "{out}");
    assert_eq!(systemd(&out), Some(true));
    assert!(!out.contains("runtimes.runc"), "runc added beside the operator's runtimes: {out}");
}

/// Bug (found by the CI run of the merged attack test node_setup_adds_once_to_configs_of_any_style):
/// toml_edit writes "\n", so a CRLF config lost its line ends; the operator's lines come back
/// as they were, "\r\n" and all, and the handler's lines end alike.
#[test]
fn a_crlf_config_keeps_its_line_ends() {
    let operator = "version = 2\r\n[plugins.\"io.containerd.grpc.v1.cri\"]\r\n  sandbox_image = \"x/pause:3.9\"\r\n";
    let out = edited(operator);
    assert!(out.starts_with(operator), "{out:?}");
    assert!(!out.replace("\r\n", "").contains('\n'), "a bare \\n: {out:?}");
    assert_eq!(edited(&out), out, "a second edit changes nothing");
}

/// Rule (issue 30.1): a config with no runtimes gets containerd's default `runc` back with the
/// handler (a runtimes table replaces the defaults); a missing config is a version 2 one.
#[test]
fn adds_runc_back_where_no_runtimes_are() {
    for text in [
        "version = 2\n",
        "version = 2",
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"x\"\n",
    ] {
        let out = edited(text);
        assert!(out.contains(&format!("{RT}.runc]\nruntime_type = \"io.containerd.runc.v2\"")), "{out}");
        assert_eq!(systemd(&out), None);
    }
    let none = add_handler("config.toml", None, &entry()).unwrap();
    assert!(none.text.starts_with("version = 2\n") && none.text.contains("runtimes.runc]"), "{}", none.text);
}

/// Bug (attack 1, B1): a `devremap` runtime the operator wrote in any form (quoted keys, only
/// its options table, an inline table, dotted keys) is refused, named; the shell version added
/// a second one, which containerd cannot load.
#[test]
fn refuses_an_operators_devremap_in_every_form() {
    for text in [
        format!("{RT}.\"devremap\"]\n  runtime_type = \"io.containerd.runc.v2\"\n"),
        format!("{RT}.'devremap']\n  runtime_type = \"io.containerd.runc.v2\"\n"),
        format!("{RT}.devremap.options]\n  BinaryName = \"/x\"\n"),
        format!("{RT}]\n  devremap = {{ runtime_type = \"io.containerd.runc.v2\" }}\n"),
        format!("{RT}]\n  devremap.runtime_type = \"io.containerd.runc.v2\"\n"),
        "[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  runtimes.devremap.options.BinaryName = \"/usr/bin/devremap-runtime\"\n".into(),
        "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap.runtime_type = \"x\"\n".into(),
    ] {
        let why = refused(&format!("version = 2\n{text}"));
        assert!(why.starts_with("config.toml: defines the runtime devremap itself"), "{text}: {why}");
        assert!(why.contains(&format!("make its BinaryName \"{BIN}\"")), "{why}");
    }
}

/// Rule (issue 30.1, attack 1 B1): the handler is added in the style of the runtimes table it
/// goes into (an inline table, dotted keys, a header with inline runtimes, quoted keys), and a
/// handler of devremap's (its BinaryName is the installed wrapper) in any of those forms is
/// replaced by the entry's content, once.
#[test]
fn adds_and_replaces_in_every_form() {
    let stale = format!("{{ runtime_type = \"old\", options = {{ BinaryName = \"{BIN}\" }} }}");
    for (text, expect) in [
        (
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  runtimes = { runc = { runtime_type = \"io.containerd.runc.v2\" } }\n".to_owned(),
            "devremap = { runtime_type = \"io.containerd.runc.v2\"",
        ),
        (
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  runtimes.nvidia.runtime_type = \"io.containerd.runc.v2\"\n".into(),
            "runtimes.devremap.runtime_type = \"io.containerd.runc.v2\"",
        ),
        (format!("{RT}]\n  runc = {{ runtime_type = \"io.containerd.runc.v2\" }}\n"), "runtimes.devremap]"),
        (
            "[plugins.\"io.containerd.grpc.v1.cri\".\"containerd\".\"runtimes\".\"runc\"]\n  runtime_type = \"io.containerd.runc.v2\"\n".into(),
            "\"runtimes\".devremap]",
        ),
        ("[plugins]\n  \"io.containerd.grpc.v1.cri\" = { sandbox_image = \"x\" }\n".into(), "runc = {"),
        (format!("{RT}]\n  runc = {{ runtime_type = \"io.containerd.runc.v2\" }}\n  devremap = {stale}\n"), "devremap = {"),
        (format!("{RT}.\"devremap\"]\n  runtime_type = \"old\"\n{RT}.\"devremap\".options]\n  BinaryName = \"{BIN}\"\n"), "runtimes.devremap]"),
        (format!("{RT}.runc]\n{RT}.devremap.options]\n  BinaryName = \"{BIN}\"\n"), "runtimes.devremap]"),
    ] {
        let out = edited(&format!("version = 2\n{text}"));
        assert!(out.contains(expect), "{text}: no {expect} in\n{out}");
        assert!(!out.contains("\"old\""), "{text}: the stale handler kept:\n{out}");
        assert!(out.contains("pod_annotations = [\"devremap.io/*\"]"), "{out}");
    }
}

/// Bug (attack 1, B3): SystemdCgroup on the default runtime is seen in a CRLF file and under
/// quoted headers; the shell version missed it, and devremap pods used cgroupfs. And in the
/// deprecated `default_runtime` table (found from outside).
#[test]
fn sees_systemd_cgroup_however_it_is_written() {
    for text in [
        format!("version = 2\r\n{RT}.runc]\r\n  runtime_type = \"io.containerd.runc.v2\"\r\n{RT}.runc.options]\r\n  SystemdCgroup = true\r\n"),
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"nvidia\"\n[plugins.\"io.containerd.grpc.v1.cri\".\"containerd\".\"runtimes\".\"nvidia\".options]\n  SystemdCgroup = true\n".into(),
        "version = 2\n[plugins.'io.containerd.grpc.v1.cri'.containerd]\n  runtimes.runc.options = { SystemdCgroup = true } # kubeadm\n".into(),
    ] {
        assert_eq!(systemd(&edited(&text)), Some(true), "{text}");
    }
    assert_eq!(systemd(&edited(&format!("version = 2\n{RT}.runc.options]\n  SystemdCgroup = false\n"))), None);
    // The deprecated `default_runtime` table, the default when it has a type (found from
    // outside: its driver was not seen, and devremap's pods got cgroupfs).
    let deprecated = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.default_runtime]\n  runtime_type = \"io.containerd.runc.v2\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.default_runtime.options]\n  SystemdCgroup = true\n";
    assert_eq!(systemd(&edited(deprecated)), Some(true));
    assert_eq!(
        systemd(&edited(&deprecated.replace("\"io.containerd.runc.v2\"", "\"\""))),
        None,
        "no type: not the default"
    );
}

/// Bug (attack 1, B5): an old shell block without its end marker (the operator deleted it)
/// and settings after it: every line after it is kept, the old markers are gone, the handler
/// is replaced.
#[test]
fn keeps_the_lines_after_an_old_block_without_its_end() {
    let text = format!(
        "version = 2\n\n{}\n{RT}.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n{RT}.devremap]\n  runtime_type = \"io.containerd.runc.v2\"\n{RT}.devremap.options]\n    BinaryName = \"{BIN}\"\n\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"/etc/containerd/certs.d\"\n",
        OLD_MARKERS[0]
    );
    let out = edited(&text);
    assert!(out.contains("config_path = \"/etc/containerd/certs.d\""), "{out}");
    assert!(!out.contains(">>> devremap"), "{out}");
    assert_eq!(out.matches("runtimes.devremap]").count(), 1, "{out}");
    let ended = edited(&format!("{text}{}\n", OLD_MARKERS[1]));
    assert!(!ended.contains("<<< devremap"), "{ended}");
}

/// Rule (issue 30.1, attack 1 B8): a config that is not version 2 or not TOML is refused, saying
/// what to do; nothing is guessed.
#[test]
fn refuses_other_versions_and_broken_toml() {
    for (text, why) in [
        ("version = 3\n", "version = 3: containerd 2's"),
        ("version = 1\n", "containerd config migrate"),
        ("[plugins.cri]\n", "no version: version 1"),
        ("version = 2.0\n", "version = 2.0, not an integer"),
        ("version = \"2\"\n", "version = \"2\", not an integer"),
        ("", "no version"),
        ("version = 2\nversion = 2\n", "not valid TOML (line 2, column 1)"),
        (&format!("version = 2\n{RT}.runc]\n{RT}.runc]\n"), "not valid TOML (line 3"),
        (
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  runtimes = 5\n",
            "runtimes is a value, not a table",
        ),
    ] {
        let got = refused(text);
        assert!(got.starts_with("config.toml: ") && got.contains(why), "{text:?}: {got}");
    }
}

/// A fake filesystem for [`check_imports`].
fn files(list: &[(&str, &str)]) -> BTreeMap<PathBuf, String> {
    list.iter().map(|(p, t)| (PathBuf::from(p), (*t).to_owned())).collect()
}

fn check(config: &str, fs: &BTreeMap<PathBuf, String>) -> Result<(), ConfigError> {
    let read = |p: &Path| fs.get(p).cloned().ok_or_else(|| io::Error::from(io::ErrorKind::NotFound));
    let list = |d: &Path| {
        // The files and directories under `d`.
        let names: BTreeSet<OsString> = fs
            .keys()
            .filter_map(|p| p.strip_prefix(d).ok()?.components().next().map(|c| c.as_os_str().to_owned()))
            .collect();
        let names: Vec<OsString> = names.into_iter().collect();
        if names.is_empty() { Err(io::Error::from(io::ErrorKind::NotFound)) } else { Ok(names) }
    };
    check_imports(Path::new("/etc/containerd/config.toml"), config, &entry(), read, list)
}

/// Rule (issue 30.2, attack 1 B2/B8): imports are resolved as containerd does (relative to the
/// importing file, globs only with `*`, paths with spaces, imports of imports); one holding
/// CRI settings is refused, naming it, and so is one containerd cannot load.
#[test]
fn reads_imports_as_containerd_does() {
    let cri = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"x\"\n";
    let fs = files(&[
        ("/etc/containerd/conf d/cri.toml", cri),
        ("/etc/containerd/conf.d/debug.toml", "version = 2\n[debug]\n  level = \"debug\"\n"),
        ("/etc/containerd/conf.d/next.toml", "version = 2\nimports = [\"../conf d/*.toml\"]\n"),
        ("/etc/containerd/v1.toml", "[plugins.cri]\n"),
        ("/etc/containerd/bad.toml", "[debug\n"),
    ]);
    for (imports, found) in [
        (
            "[\"/etc/containerd/conf d/*.toml\"]",
            Some("imports /etc/containerd/conf d/cri.toml, which holds CRI settings"),
        ),
        ("[\"conf d/cri.toml\"]", Some("which holds CRI settings")),
        (
            "[\"/etc/containerd/conf d/c?i.toml\"]",
            Some("imports /etc/containerd/conf d/c?i.toml, which cannot be read"),
        ),
        ("[\"/etc/containerd/conf.d/*.toml\"]", Some("imports /etc/containerd/conf d/cri.toml, which holds")),
        ("[\"/etc/containerd/conf.d/deb*.toml\", \"/etc/containerd/none/*.toml\"]", None),
        ("[]  # was \"/etc/containerd/conf d/*.toml\"", None),
        ("[\"/etc/containerd/v1.toml\"]", Some("which holds CRI settings")),
        ("[\"/etc/containerd/missing.toml\"]", Some("which cannot be read (entity not found)")),
        (
            "[\"/etc/containerd/bad.toml\"]",
            Some("bad.toml, which is not valid: /etc/containerd/bad.toml: not valid TOML (line 1"),
        ),
        ("[\"/etc/containerd/*/[cd]*.toml\"]", Some("conf d/cri.toml, which holds")),
    ] {
        let config = format!("version = 2\nimports = {imports}\n");
        match (check(&config, &fs), found) {
            (Ok(()), None) => {}
            (Err(e), Some(want)) => {
                let e = e.to_string();
                assert!(e.starts_with("/etc/containerd/config.toml: ") && e.contains(want), "{imports}: {e}");
            }
            (got, want) => panic!("{imports}: {got:?}, wanted {want:?}"),
        }
    }
    let e = check("version = 2\nimports = [\"conf d/cri.toml\"]\n", &fs).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "Add the tables of devremap.toml to /etc/containerd/conf d/cri.toml by hand (BinaryName \"{BIN}\")"
        )),
        "{e}"
    );
}

/// Rule: Go's `filepath.Match` within a component, as containerd globs imports.
#[test]
fn matches_as_go_does() {
    for (pattern, name, want) in [
        ("*.toml", "a.toml", true),
        ("*.toml", ".hidden.toml", true),
        ("*.toml", "a.toml.bak", false),
        ("c?i.toml", "cri.toml", true),
        ("[a-c]*", "bx", true),
        ("[^a-c]*", "bx", false),
        ("[!a]", "!", true),
        ("\\*", "*", true),
        ("\\*", "a", false),
        ("[]a]", "]", true),
        ("[a-", "a", false),
    ] {
        assert_eq!(go_match(pattern, name), want, "{pattern} {name}");
    }
}
