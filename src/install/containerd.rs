//! The CRI runtime handler `devremap` added to a node's containerd `config.toml` (`devremapd
//! containerd-config`, which `dist/kubernetes/node-setup.sh` runs): text in, the edited text or
//! a refusal out, every other byte of the operator's file kept.
//!
//! Assumptions, each containerd 1.6's and 1.7's (config version 2):
//! - An imported file's plugin table *replaces* config.toml's whole table of that plugin, so the
//!   handler cannot come from a drop-in, and an import holding a CRI table would drop the one
//!   added here: refused. Imports are resolved as containerd's `resolveImports` does: relative
//!   to the importing file's directory, globbed (Go's `filepath.Glob`) only when the path holds
//!   a `*`, imports of imports too; a file that cannot be read fails containerd's start.
//! - A `runtimes` table replaces the CRI plugin's default runtimes (`runc`), so a config with
//!   none gets `runc` back as containerd's defaults have it.
//! - The shim passes `SystemdCgroup` to the runtime; the kubelet's cgroup driver must match, so
//!   the handler gets `SystemdCgroup = true` when the default runtime has it (the deprecated
//!   `default_runtime` table when it has a `runtime_type`, else `default_runtime_name`'s).
//!
//! The TOML is edited with `toml_edit`, which reads every form TOML allows (quoted and dotted
//! keys, inline tables, CRLF) and writes back what it read byte for byte but line ends, which it
//! writes as "\n" (a CRLF file gets its "\r\n" back here): the handler is added
//! in the style of the table it goes into (a header table, dotted keys, an inline table). A
//! `devremap` runtime is devremap's own when its `BinaryName` is the wrapper this install puts
//! in place: it is then replaced with the entry's current content; any other is the operator's
//! and refused.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use toml_edit::{DocumentMut, InlineTable, Item, Table, TableLike, Value};

/// The CRI plugin's table under `plugins`.
pub const CRI: &str = "io.containerd.grpc.v1.cri";
/// Where the runtime handlers are, under `plugins.<CRI>`.
const RUNTIMES: [&str; 2] = ["containerd", "runtimes"];
/// The handler's name, as a RuntimeClass's `handler` names it.
pub const HANDLER: &str = "devremap";
/// The comment over a handler this adds as a table of its own.
const MARKER: &str = "# The CRI runtime handler devremap: added by devremap's node-setup (devremapd containerd-config),\n\
                      # replaced by it on each install while its BinaryName is the devremap-runtime it installs.\n";
/// The marker lines of the shell node-setup that came before: removed (the handler between them
/// is recognised by its BinaryName).
const OLD_MARKERS: [&str; 2] =
    ["# >>> devremap: the CRI runtime handler devremap, added by devremap's node-setup.sh", "# <<< devremap"];

/// Why a config is refused; each message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: not valid TOML ({at}): {why}; containerd cannot load it either: fix it first")]
    Toml { path: String, at: String, why: String },
    #[error(
        "{path}: not a version 2 config ({found}); the runtime handler's tables in {entry} are for containerd 1.6 and 1.7's version 2: {todo}"
    )]
    Version { path: String, found: String, entry: String, todo: &'static str },
    #[error("{path}: {key} is {what}, not a table: add the tables of {entry} by hand")]
    NotTable { path: String, key: String, what: &'static str, entry: String },
    #[error(
        "{path}: defines the runtime devremap itself ({key}, BinaryName {binary}), not as devremap's node-setup adds it (BinaryName \"{ours}\"): leaving it as it is; remove it, or make its BinaryName \"{ours}\""
    )]
    NotOurs { path: String, key: String, binary: String, ours: String },
    #[error("{path}: {why}")]
    Invalid { path: String, why: String },
    #[error(
        "{path}: imports {import}, which holds CRI settings (plugins.\"{CRI}\"): containerd replaces the CRI table of {path} with that file's, so the runtime handler added to {path} would be dropped. Add the tables of {entry} to {import} by hand (BinaryName \"{binary}\") and restart containerd"
    )]
    ImportHoldsCri { path: String, import: String, entry: String, binary: String },
    #[error("{path}: imports {import}, which {why}: containerd cannot load this config: fix that first")]
    ImportUnreadable { path: String, import: String, why: String },
}

/// The handler to add: the entry file's `devremap` runtime, its `BinaryName` made the wrapper's
/// path on the node.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The entry file, for messages.
    pub path: String,
    runtime: Table,
    binary: String,
}

impl Entry {
    /// The `devremap` runtime of the entry file `path` (dist/containerd/devremap.toml), with
    /// `BinaryName` set to `binary` when given.
    pub fn parse(path: &str, text: &str, binary: Option<&str>) -> Result<Entry, ConfigError> {
        let doc = parse(path, text)?;
        let bad = |why: &str| ConfigError::Invalid { path: path.to_owned(), why: why.to_owned() };
        let item = at(doc.as_item(), &handler_path())
            .and_then(Item::as_table_like)
            .ok_or_else(|| bad("holds no table plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.devremap"))?;
        let mut runtime = fresh(item);
        let options = runtime.entry("options").or_insert_with(|| Item::Table(Table::new()));
        let options = options.as_table_mut().ok_or_else(|| bad("the handler's options are not a table"))?;
        let binary = match binary {
            Some(b) => b.to_owned(),
            None => options
                .get("BinaryName")
                .and_then(Item::as_str)
                .ok_or_else(|| bad("the handler's options name no BinaryName"))?
                .to_owned(),
        };
        options.insert("BinaryName", toml_edit::value(binary.as_str()));
        Ok(Entry { path: path.to_owned(), runtime, binary })
    }

    /// The wrapper the handler runs.
    pub fn binary(&self) -> &str {
        &self.binary
    }
}

/// What [`add_handler`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Edited {
    /// The new text (the old one when nothing changed).
    pub text: String,
    /// Whether a handler of devremap's was there before (replaced, or kept as it was).
    pub had_ours: bool,
}

/// `config.toml`'s text (`None`: there is none, and containerd runs on its defaults) with the
/// handler of `entry` added or, where devremap's own is there, replaced by it.
pub fn add_handler(path: &str, text: Option<&str>, entry: &Entry) -> Result<Edited, ConfigError> {
    let cleaned;
    let text = match text {
        Some(t) => {
            cleaned = without_old_markers(t);
            cleaned.as_str()
        }
        None => "version = 2\n",
    };
    let mut doc = parse(path, text)?;
    check_version(path, &doc, entry)?;
    let runtimes_key = format!("plugins.\"{CRI}\".containerd.runtimes");
    // Read before anything changes: the default runtime's cgroup driver. The deprecated
    // `default_runtime` table, given a `runtime_type`, is the default whatever
    // `default_runtime_name` says (the CRI plugin's config validation; found from outside: its
    // `SystemdCgroup` was not seen).
    let deprecated = ["plugins", CRI, "containerd", "default_runtime"];
    let default_options = if at(doc.as_item(), &[&deprecated[..], &["runtime_type"]].concat())
        .and_then(Item::as_str)
        .is_some_and(|t| !t.is_empty())
    {
        [&deprecated[..], &["options", "SystemdCgroup"]].concat()
    } else {
        let name = at(doc.as_item(), &["plugins", CRI, "containerd", "default_runtime_name"]).and_then(Item::as_str);
        runtime_path(name.unwrap_or("runc"), &["options", "SystemdCgroup"])
    };
    let systemd = at(doc.as_item(), &default_options).and_then(Item::as_bool).unwrap_or(false);

    let (runtimes, style) = table_at(doc.as_table_mut(), &["plugins", CRI, "containerd", "runtimes"], path, entry)?;
    let mut kept_decor = None;
    let mut form = style;
    let had_ours = match runtimes.get(HANDLER) {
        None => false,
        Some(existing) => {
            let binary = existing.get("options").and_then(|o| o.get("BinaryName"));
            if binary.and_then(Item::as_str) != Some(entry.binary()) {
                return Err(ConfigError::NotOurs {
                    path: path.to_owned(),
                    key: format!("{runtimes_key}.{HANDLER}"),
                    binary: binary.map_or("none".to_owned(), |b| b.to_string().trim().to_owned()),
                    ours: entry.binary().to_owned(),
                });
            }
            kept_decor = existing.as_table().map(|t| t.decor().clone());
            // Replaced in the form it has.
            form = match existing {
                Item::Value(Value::InlineTable(_)) => Style::Inline,
                Item::Table(t) if t.is_dotted() => Style::Dotted,
                _ => style,
            };
            runtimes.remove(HANDLER);
            true
        }
    };
    if runtimes.is_empty() {
        let mut runc = Table::new();
        runc.insert("runtime_type", toml_edit::value("io.containerd.runc.v2"));
        // 1.7's default; 1.6 ignores it.
        runc.insert("sandbox_mode", toml_edit::value("podsandbox"));
        runtimes.insert("runc", styled(runc, style, None));
    }
    let mut runtime = entry.runtime.clone();
    if systemd && let Some(options) = runtime.get_mut("options").and_then(Item::as_table_mut) {
        options.insert("SystemdCgroup", toml_edit::value(true));
    }
    let decor = kept_decor.unwrap_or_else(|| toml_edit::Decor::new(format!("\n{MARKER}"), ""));
    runtimes.insert(HANDLER, styled(runtime, form, Some(decor)));
    let mut out = doc.to_string();
    if text.ends_with('\n') && !out.ends_with('\n') {
        out.push('\n');
    }
    // toml_edit writes its lines with "\n": a file whose lines end in "\r\n" keeps them, so
    // the operator's lines stay as they were.
    if text.contains("\r\n") {
        out = out.replace("\r\n", "\n").replace('\n', "\r\n");
    }
    Ok(Edited { text: out, had_ours })
}

/// The top-level `imports` of a config, as written.
pub fn imports(path: &str, text: &str) -> Result<Vec<String>, ConfigError> {
    let doc = parse(path, text)?;
    let Some(item) = doc.get("imports") else { return Ok(Vec::new()) };
    let array = item
        .as_array()
        .ok_or_else(|| ConfigError::Invalid { path: path.to_owned(), why: "imports is not a list of paths".into() })?;
    Ok(array.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
}

/// Whether the config `text` holds a table of the CRI plugin (`cri` is its name in a version 1
/// file, which containerd 1.7 reads as the same plugin).
pub fn holds_cri(path: &str, text: &str) -> Result<bool, ConfigError> {
    let doc = parse(path, text)?;
    Ok(doc.get("plugins").and_then(Item::as_table_like).is_some_and(|p| p.contains_key(CRI) || p.contains_key("cri")))
}

/// Refuses an import of the config `path` (a path as containerd sees it) that would drop the
/// handler or that containerd cannot load, imports of imports too. `read` gives a file's text,
/// `list` a directory's names (for globs).
pub fn check_imports(
    path: &Path,
    text: &str,
    entry: &Entry,
    mut read: impl FnMut(&Path) -> io::Result<String>,
    list: impl Fn(&Path) -> io::Result<Vec<OsString>>,
) -> Result<(), ConfigError> {
    let shown = path.display().to_string();
    let mut pending: Vec<PathBuf> = resolve(path, &imports(&shown, text)?, &list);
    let mut loaded = BTreeSet::from([path.to_owned()]);
    while !pending.is_empty() {
        let import = pending.remove(0);
        if !loaded.insert(import.clone()) {
            continue;
        }
        let name = import.display().to_string();
        let unreadable = |why: String| ConfigError::ImportUnreadable { path: shown.clone(), import: name.clone(), why };
        let body = read(&import).map_err(|e| unreadable(format!("cannot be read ({})", crate::io_message(&e))))?;
        let within = |e: ConfigError| unreadable(format!("is not valid: {e}"));
        if holds_cri(&name, &body).map_err(within)? {
            return Err(ConfigError::ImportHoldsCri {
                path: shown,
                import: name,
                entry: entry.path.clone(),
                binary: entry.binary().to_owned(),
            });
        }
        pending.extend(resolve(&import, &imports(&name, &body).map_err(within)?, &list));
    }
    Ok(())
}

/// containerd's `resolveImports`: a relative path is joined to `parent`'s directory; a path with
/// a `*` is globbed (matches in Go's order: sorted by name within each directory).
fn resolve(parent: &Path, imports: &[String], list: &impl Fn(&Path) -> io::Result<Vec<OsString>>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for import in imports {
        let path = Path::new(import);
        let path =
            if path.is_absolute() { path.to_owned() } else { parent.parent().unwrap_or(Path::new("/")).join(path) };
        let path = clean(&path);
        if import.contains('*') {
            out.extend(glob(&path, list));
        } else {
            out.push(path);
        }
    }
    out
}

/// Go's `filepath.Clean`, lexical as `filepath.Join` applies it: `.` and `x/..` dropped.
fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                if !out.pop() || out.as_os_str().is_empty() {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// Go's `filepath.Glob` for an absolute `pattern`: each component with `*`, `?` or `[` is
/// matched against the names in its directory; unreadable directories match nothing.
fn glob(pattern: &Path, list: &impl Fn(&Path) -> io::Result<Vec<OsString>>) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::from("/")];
    for part in pattern.components().skip(1) {
        let part = part.as_os_str().to_string_lossy();
        let mut next = Vec::new();
        for dir in &found {
            if !part.contains(['*', '?', '[', '\\']) {
                next.push(dir.join(&*part));
                continue;
            }
            let Ok(mut names) = list(dir) else { continue };
            names.sort();
            next.extend(names.iter().filter(|n| go_match(&part, &n.to_string_lossy())).map(|n| dir.join(n)));
        }
        found = next;
    }
    found
}

/// Go's `filepath.Match` for one path component: `*`, `?`, `[...]` (`^` negates, `a-z` ranges),
/// `\` escapes. A malformed class matches nothing, as Go's error does.
fn go_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    fn at(p: &[char], n: &[char]) -> bool {
        let Some((&first, rest)) = p.split_first() else { return n.is_empty() };
        match first {
            '*' => (0..=n.len()).any(|i| at(rest, &n[i..])),
            '?' => !n.is_empty() && at(rest, &n[1..]),
            '[' => {
                let Some((&c, n_rest)) = n.split_first() else { return false };
                let Some((matched, after)) = class(rest, c) else { return false };
                matched && at(after, n_rest)
            }
            '\\' => rest.split_first().is_some_and(|(&e, r)| n.first() == Some(&e) && at(r, &n[1..])),
            _ => n.first() == Some(&first) && at(rest, &n[1..]),
        }
    }
    /// Whether `c` is in the class `p` starts (after its `[`), and what follows the class.
    fn class(mut p: &[char], c: char) -> Option<(bool, &[char])> {
        let negated = p.first() == Some(&'^');
        if negated {
            p = &p[1..];
        }
        let mut matched = false;
        let mut first = true;
        loop {
            let (&lo, rest) = p.split_first()?;
            if lo == ']' && !first {
                return Some((matched != negated, rest));
            }
            first = false;
            let (lo, rest) = if lo == '\\' { (*rest.first()?, &rest[1..]) } else { (lo, rest) };
            let (hi, rest) = match rest {
                ['-', ']', ..] | [] => (lo, rest),
                ['-', '\\', h, r @ ..] | ['-', h, r @ ..] => (*h, r),
                _ => (lo, rest),
            };
            matched |= lo <= c && c <= hi;
            p = rest;
        }
    }
    at(&p, &n)
}

/// `text` parsed; an error names the line and column.
fn parse(path: &str, text: &str) -> Result<DocumentMut, ConfigError> {
    text.parse::<DocumentMut>().map_err(|e| {
        let at = e.span().map_or_else(String::new, |s| {
            // A span starts on a character; `get` keeps a bad one from panicking.
            let before = text.get(..s.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("line {line}, column {column}")
        });
        ConfigError::Toml { path: path.to_owned(), at, why: e.message().trim().to_owned() }
    })
}

/// Refuses a config that is not version 2 (none written is version 1).
fn check_version(path: &str, doc: &DocumentMut, entry: &Entry) -> Result<(), ConfigError> {
    let written = doc.get("version");
    let version = written.and_then(Item::as_integer);
    // Written, but not as an integer (`2.0`, `"2"`): containerd refuses it; said as written
    // (found from outside: it was called "no version").
    if let (Some(item), None) = (written, version) {
        let found = format!("version = {}, not an integer", item.to_string().trim());
        let todo = "write it as version = 2, an integer, as containerd reads it";
        return Err(ConfigError::Version { path: path.to_owned(), found, entry: entry.path.clone(), todo });
    }
    let (found, todo) = match version {
        Some(2) => return Ok(()),
        Some(3) => (
            "version = 3: containerd 2's",
            "containerd 2 names the runtimes under plugins.\"io.containerd.cri.v1.runtime\"; add the handler there by hand",
        ),
        Some(1) | None => (
            if version.is_some() { "version = 1" } else { "no version: version 1" },
            "write the config as version 2 (containerd 1.7: `containerd config migrate`), or add the tables by hand",
        ),
        Some(_) => ("an unknown version", "add the tables by hand"),
    };
    Err(ConfigError::Version { path: path.to_owned(), found: found.to_owned(), entry: entry.path.clone(), todo })
}

/// `text` without the old shell node-setup's marker lines.
fn without_old_markers(text: &str) -> String {
    text.split_inclusive('\n').filter(|l| !OLD_MARKERS.contains(&l.trim_end_matches(['\r', '\n']))).collect()
}

/// The path of the handler's table.
fn handler_path() -> Vec<&'static str> {
    let mut path = vec!["plugins", CRI];
    path.extend(RUNTIMES);
    path.push(HANDLER);
    path
}

/// The path of `rest` within the runtime `name`.
fn runtime_path<'a>(name: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    let mut path = vec!["plugins", CRI];
    path.extend(RUNTIMES);
    path.push(name);
    path.extend(rest);
    path
}

/// The item at `path` under `item`, through tables of every form.
fn at<'a>(item: &'a Item, path: &[&str]) -> Option<&'a Item> {
    path.iter().try_fold(item, |item, key| item.get(key))
}

/// How a table is written, which a table added into it follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    Header,
    Dotted,
    Inline,
}

/// The table at `path` under `table`, made (in the style of the table it goes into) where it
/// is missing, and its style.
fn table_at<'a>(
    table: &'a mut Table,
    path: &[&str],
    file: &str,
    entry: &Entry,
) -> Result<(&'a mut dyn TableLike, Style), ConfigError> {
    let mut current: &mut dyn TableLike = table;
    let mut style = Style::Header;
    for (depth, key) in path.iter().enumerate() {
        let item = current.entry(key).or_insert_with(|| match style {
            Style::Header => Item::Table(implicit(false)),
            Style::Dotted => Item::Table(implicit(true)),
            Style::Inline => Item::Value(Value::InlineTable(InlineTable::new())),
        });
        (current, style) = match item {
            Item::Table(t) => {
                let style = if t.is_dotted() { Style::Dotted } else { Style::Header };
                (t as &mut dyn TableLike, style)
            }
            Item::Value(Value::InlineTable(t)) => (t as &mut dyn TableLike, Style::Inline),
            other => {
                let shown: Vec<String> = path[..=depth]
                    .iter()
                    .map(|k| if k.contains('.') { format!("\"{k}\"") } else { (*k).to_owned() })
                    .collect();
                return Err(ConfigError::NotTable {
                    path: file.to_owned(),
                    key: shown.join("."),
                    what: if other.is_array_of_tables() { "an array of tables" } else { "a value" },
                    entry: entry.path.clone(),
                });
            }
        };
    }
    Ok((current, style))
}

/// An empty table that shows no header of its own.
fn implicit(dotted: bool) -> Table {
    let mut t = Table::new();
    t.set_implicit(true);
    t.set_dotted(dotted);
    t
}

/// A copy of `table`'s keys and values without the entry file's formatting and positions.
fn fresh(table: &dyn TableLike) -> Table {
    let mut out = Table::new();
    for (key, item) in table.iter() {
        if let Some(sub) = item.as_table_like() {
            out.insert(key, Item::Table(fresh(sub)));
        } else if let Some(value) = item.as_value() {
            let mut value = value.clone();
            value.decor_mut().clear();
            out.insert(key, Item::Value(value));
        }
    }
    out
}

/// `table` written in `style`, with `decor` over it where it has a header.
fn styled(mut table: Table, style: Style, decor: Option<toml_edit::Decor>) -> Item {
    match style {
        Style::Inline => Item::Value(Value::InlineTable(table.into_inline_table())),
        Style::Dotted => {
            set_dotted(&mut table);
            Item::Table(table)
        }
        Style::Header => {
            if let Some(decor) = decor {
                *table.decor_mut() = decor;
            }
            Item::Table(table)
        }
    }
}

fn set_dotted(table: &mut Table) {
    table.set_dotted(true);
    for (_, item) in table.iter_mut() {
        if let Item::Table(sub) = item {
            set_dotted(sub);
        }
    }
}

#[cfg(test)]
mod tests;
