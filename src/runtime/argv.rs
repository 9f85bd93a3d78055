//! runc's command line, decoded once into what the wrapper acts on: `runc [global flags]
//! COMMAND [flags] ID` becomes the global options, a typed [`Command`] and the [`Line`] as
//! given, to pass on unchanged or, for the wrapper's own bundle, with its `--bundle` and
//! `--pid-file`.
//!
//! Pure. Assumptions, from runc (urfave/cli over Go's `flag` package), which crun follows:
//! a flag is `-name` or `--name`, its value either `=value` or the next argument, and a boolean
//! flag never takes the next argument; flags come before the positional arguments, and the
//! first argument that is not a flag (or the one after `--`) ends them. Only the flags that
//! take a value must be known, to skip their values: an unknown flag is taken as a boolean, so
//! a newer runtime's new boolean flags pass through. A command's flags may also follow its
//! container id: runc's urfave/cli moves them to the front before parsing (`runc create ID
//! --bundle B` is `runc create --bundle B ID`), so they are read up to a `--` wherever they
//! stand. The wrapper never rewrites the command line otherwise; for its own bundle it replaces
//! the bundle flags and inserts `--pid-file` where a create, run or restore lacks one.

/// The global flags of runc and crun that take a value, and the wrapper's own.
const GLOBAL_VALUE_FLAGS: &[&str] =
    &["log", "log-format", "root", "criu", "rootless", "cgroup-manager", "log-level", CONFIG_FLAG];

/// The wrapper's own global flag, naming its config file; taken out of the command line before
/// it reaches the runtime. It survives a caller that strips the environment (conmon, so
/// Podman): `podman --runtime-flag devremap-config=PATH`, or Docker's `runtimeArgs`.
pub const CONFIG_FLAG: &str = "devremap-config";

/// The flags of runc's and crun's commands that take a value.
const COMMAND_VALUE_FLAGS: &[&str] = &[
    "bundle",
    "b",
    "console-socket",
    "pid-file",
    "preserve-fds",
    "pidfd-socket",
    "image-path",
    "work-path",
    "parent-path",
    "page-server",
    "manage-cgroups-mode",
    "empty-ns",
    "status-fd",
    "lsm-profile",
    "lsm-mount-context",
    "criu",
];

/// The flags of `create`, `run` and `restore` whose path the runtime opens after it has changed
/// into the bundle directory (runc and crun alike): a relative one names a file in the caller's
/// bundle, which the wrapper's own bundle replaces.
const BUNDLE_RELATIVE_FLAGS: &[&str] = &["console-socket", "pidfd-socket", "image-path", "work-path"];

/// One invocation of the runtime, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    pub global: Global,
    pub command: Command,
    /// The line as given, to pass on.
    pub line: Line,
}

/// The global options the wrapper reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Global {
    /// `--root`, where the runtime keeps its containers' state.
    pub root: Option<String>,
    /// `--log`, the file the runtime (and a caller like containerd) keeps errors in.
    pub log: Option<String>,
    /// `--log-format`.
    pub log_format: Option<String>,
    /// `--devremap-config`, the wrapper's config file (not passed on).
    pub config: Option<String>,
}

/// What the wrapper does something with; [`Command::Other`] is the runtime's alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Create(NewContainer),
    Run(NewContainer),
    Restore {
        container: NewContainer,
        /// `--image-path`.
        image_path: Option<String>,
    },
    /// `start` of a container with a valid id.
    Start(ContainerId),
    /// `checkpoint` of a container with a valid id.
    Checkpoint {
        id: ContainerId,
        /// `--image-path`.
        image_path: Option<String>,
    },
    /// `delete`, run through the wrapper whatever its id; the id when it is a valid one.
    Delete(Option<ContainerId>),
    /// Anything else, and a create, run or restore naming no container, a start or checkpoint
    /// naming no valid one.
    Other,
}

/// A `create`, `run` or `restore` naming a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewContainer {
    /// The container id; one that is not runc's kind is refused only when the wrapper would
    /// make a directory of it (the runtime alone judges it otherwise).
    pub id: Result<ContainerId, BadId>,
    /// `--bundle`/`-b`.
    pub bundle: Option<String>,
    /// `--pid-file`.
    pub pid_file: Option<String>,
    /// Whether the runtime deletes the container before it returns: a `run` or `restore` in the
    /// foreground (no `--detach`) without `--keep`.
    pub gone_on_return: bool,
    /// The command line without its bundle flags, split where the wrapper's flags go.
    ours: (Vec<String>, Vec<String>),
    /// Where in `ours` a [`BUNDLE_RELATIVE_FLAGS`] value stands.
    bundle_paths: Vec<PathSlot>,
}

/// An argument holding a flag's path: in the first or second half of [`NewContainer::ours`],
/// at `at`, alone or as `--flag=path` (`inline`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PathSlot {
    after: bool,
    at: usize,
    inline: bool,
}

/// A container id that is safe as one path component: runc's own rule (`^[\w+\-.]+$`), and not
/// `.` or `..`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerId(String);

/// A container id that is not runc's kind, or too long to be a file's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("container id {id:?}: {why}", id = .0, why = why_bad(.0))]
pub struct BadId(pub String);

/// The longest id: a container's directory is named by it, and a file name has at most 255
/// bytes (`NAME_MAX`). Found from outside: ids of 256 to 1,024 bytes passed the check and failed
/// the start later (`file name too long`), and longer ones were said to hold other characters.
pub const MAX_ID_LEN: usize = 255;

fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"_+-.".contains(&b)
}

fn why_bad(id: &str) -> String {
    if id.len() > MAX_ID_LEN && id.bytes().all(allowed) {
        format!("{} bytes, longer than {MAX_ID_LEN}, the longest file name", id.len())
    } else {
        "only letters, digits and _+-. are allowed".to_owned()
    }
}

impl ContainerId {
    pub fn new(id: &str) -> Result<ContainerId, BadId> {
        let valid = !id.is_empty() && id != "." && id != ".." && id.len() <= MAX_ID_LEN && id.bytes().all(allowed);
        if valid { Ok(ContainerId(id.to_owned())) } else { Err(BadId(id.to_owned())) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The command line as given, less the wrapper's own flag.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Line {
    /// The global flags.
    pub global: Vec<String>,
    /// The command (`create`, `run`, ...), if any.
    pub command: Option<String>,
    /// Everything after the command.
    pub args: Vec<String>,
}

/// `-name`, `--name`, `--name=value` -> `(name, Some(value))`; `None` when not a flag.
fn flag(arg: &str) -> Option<(&str, Option<&str>)> {
    let name = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')).filter(|n| !n.is_empty())?;
    if arg == "-" {
        return None;
    }
    Some(match name.split_once('=') {
        Some((n, v)) => (n, Some(v)),
        None => (name, None),
    })
}

/// Walks flags from the start of `args`, calling `f(name, value)` for each, and returns the
/// index of the first positional argument (`args.len()` when there is none).
fn walk_flags<'a>(args: &'a [String], value_flags: &[&str], mut f: impl FnMut(&str, Option<&'a str>)) -> usize {
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        if arg == "--" {
            return i + 1;
        }
        let Some((name, inline)) = flag(arg) else { return i };
        let value = match inline {
            Some(v) => Some(v),
            None if value_flags.contains(&name) => {
                i += 1;
                args.get(i).map(String::as_str)
            }
            None => None,
        };
        f(name, value);
        i += 1;
    }
    args.len()
}

/// Decodes a command line (without the program name).
pub fn decode(argv: &[String]) -> Invocation {
    let mut g = Global::default();
    let end = walk_flags(argv, GLOBAL_VALUE_FLAGS, |name, value| {
        let slot = match name {
            "root" => &mut g.root,
            "log" => &mut g.log,
            "log-format" => &mut g.log_format,
            CONFIG_FLAG => &mut g.config,
            _ => return,
        };
        *slot = value.map(str::to_owned);
    });
    // A `--` before the command leaves `end` past it; the command is what follows. Our own
    // flag (and its value, when apart) is no business of the runtime's.
    let mut global = Vec::new();
    let mut flags = argv[..end].iter().filter(|a| *a != "--");
    while let Some(a) = flags.next() {
        match flag(a) {
            Some((CONFIG_FLAG, inline)) => {
                if inline.is_none() {
                    flags.next();
                }
            }
            _ => global.push(a.clone()),
        }
    }
    let line = Line {
        global,
        command: argv.get(end).cloned(),
        args: argv.get(end + 1..).map(<[String]>::to_vec).unwrap_or_default(),
    };
    Invocation { global: g, command: command(&line), line }
}

/// What a command's arguments say, from one walk.
#[derive(Default)]
struct Args {
    /// The first positional argument.
    id: Option<String>,
    bundle: Option<String>,
    pid_file: Option<String>,
    image_path: Option<String>,
    detach: bool,
    keep: bool,
    /// The arguments less every bundle flag (and its value).
    kept: Vec<String>,
    /// Where in `kept` a [`BUNDLE_RELATIVE_FLAGS`] value stands, and whether inline.
    bundle_paths: Vec<(usize, bool)>,
    /// Where in `kept` the wrapper's flags go: after the command's leading flags, before the
    /// `--` that ends them or the id.
    at: usize,
}

/// `args`'s flags (up to a `--`, before and after the id), its id, and the arguments for the
/// wrapper's bundle.
fn walk_command(args: &[String]) -> Args {
    let mut a = Args::default();
    let mut at = None;
    // Flags are read up to a `--`. A `--` given as a flag's value (`--console-socket -- ID`)
    // is taken for one that ends them after the next argument, and the wrapper's flags go
    // before it: so the wrapper has always read such a line, and issue 33 changed no line the
    // runtime gets (runc itself takes that `--` as the value).
    let mut reading = true;
    let before_dashes = |kept: &[String]| match kept.last() {
        Some(last) if last == "--" => kept.len() - 1,
        _ => kept.len(),
    };
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if arg == "--" {
            // After a `--` every argument is positional.
            at.get_or_insert(a.kept.len());
            if reading && a.id.is_none() {
                a.id = args.get(i + 1).cloned();
            }
            a.kept.extend_from_slice(&args[i..]);
            break;
        }
        let Some((name, inline)) = flag(arg) else {
            if at.is_none() {
                at = Some(before_dashes(&a.kept));
            }
            if reading && a.id.is_none() {
                a.id = Some(arg.clone());
            }
            reading &= !(i > 0 && args[i - 1] == "--");
            a.kept.push(arg.clone());
            i += 1;
            continue;
        };
        let takes_next = inline.is_none() && COMMAND_VALUE_FLAGS.contains(&name);
        let end = if takes_next { (i + 2).min(args.len()) } else { i + 1 };
        let value = if takes_next { args.get(i + 1).map(String::as_str) } else { inline };
        let is_bundle = matches!(name, "bundle" | "b");
        if reading {
            // A boolean given as `--detach=false` is false.
            let on = value.is_none_or(|v| v != "false");
            match name {
                _ if is_bundle => a.bundle = value.map(str::to_owned),
                "pid-file" => a.pid_file = value.map(str::to_owned),
                "image-path" => a.image_path = value.map(str::to_owned),
                "detach" | "d" => a.detach = on,
                "keep" => a.keep = on,
                _ => {}
            }
            if BUNDLE_RELATIVE_FLAGS.contains(&name) && value.is_some() {
                a.bundle_paths.push((a.kept.len() + usize::from(takes_next), inline.is_some()));
            }
        }
        if !is_bundle {
            a.kept.extend_from_slice(&args[i..end]);
        }
        i = end;
    }
    a.at = at.unwrap_or_else(|| before_dashes(&a.kept));
    a
}

/// The command `line` names, with its arguments.
fn command(line: &Line) -> Command {
    let name = line.command.as_deref().unwrap_or_default();
    let a = walk_command(&line.args);
    let valid = a.id.as_deref().and_then(|id| ContainerId::new(id).ok());
    match (name, valid) {
        ("create", _) => new_container(line, name, a).map_or(Command::Other, Command::Create),
        ("run", _) => new_container(line, name, a).map_or(Command::Other, Command::Run),
        ("restore", _) => {
            let image_path = a.image_path.clone();
            new_container(line, name, a).map_or(Command::Other, |container| Command::Restore { container, image_path })
        }
        ("start", Some(id)) => Command::Start(id),
        ("checkpoint", Some(id)) => Command::Checkpoint { id, image_path: a.image_path },
        ("delete", id) => Command::Delete(id),
        _ => Command::Other,
    }
}

/// The container a `create`, `run` or `restore` (`name`) names; `None` when it names none.
fn new_container(line: &Line, name: &str, mut a: Args) -> Option<NewContainer> {
    let id = a.id?;
    let after = a.kept.split_off(a.at);
    let before = [&line.global[..], std::slice::from_ref(&name.to_owned()), &a.kept].concat();
    let bundle_paths = a
        .bundle_paths
        .iter()
        .map(|&(at, inline)| match at.checked_sub(a.at) {
            Some(at) => PathSlot { after: true, at, inline },
            None => PathSlot { after: false, at: at + line.global.len() + 1, inline },
        })
        .collect();
    Some(NewContainer {
        id: ContainerId::new(&id),
        bundle: a.bundle,
        pid_file: a.pid_file,
        gone_on_return: name != "create" && !a.detach && !a.keep,
        ours: (before, after),
        bundle_paths,
    })
}

impl NewContainer {
    /// The whole command line for the wrapper's own bundle: every `--bundle`/`-b` given is
    /// replaced by `--bundle BUNDLE`, and `--pid-file PID_FILE` is added when there is none,
    /// after the command's flags (before a `--` that ends them, or the id). A relative path
    /// the runtime would open in the caller's bundle (`--image-path ck`, found from outside: a
    /// restore so named failed, `open ck: no such file or directory`, and a relative
    /// `--work-path` went into the wrapper's bundle and with it) is made `CALLERS_BUNDLE/ck`.
    pub fn line_for_bundle(&self, bundle: &str, pid_file: &str, callers_bundle: &str) -> Vec<String> {
        let (mut before, mut after) = self.ours.clone();
        for slot in &self.bundle_paths {
            let half = if slot.after { &mut after } else { &mut before };
            if let Some(arg) = half.get_mut(slot.at) {
                let (flag, path) = match arg.split_once('=').filter(|_| slot.inline) {
                    Some((flag, path)) => (format!("{flag}="), path),
                    None => (String::new(), arg.as_str()),
                };
                if !path.is_empty() && !path.starts_with('/') {
                    *arg = format!("{flag}{}", in_dir(callers_bundle, path));
                }
            }
        }
        let mut v = before;
        v.extend(["--bundle".to_owned(), bundle.to_owned()]);
        if self.pid_file.is_none() {
            v.extend(["--pid-file".to_owned(), pid_file.to_owned()]);
        }
        v.extend(after);
        v
    }
}

/// Relative `path` in directory `dir`, as an open after `chdir(dir)` finds it: joined, not
/// cleaned (a `..` after a symlink is the kernel's to resolve).
pub fn in_dir(dir: &str, path: &str) -> String {
    format!("{}/{path}", dir.trim_end_matches('/'))
}

impl Line {
    /// The command line as given.
    pub fn original(&self) -> Vec<String> {
        let mut v = self.global.clone();
        v.extend(self.command.clone());
        v.extend_from_slice(&self.args);
        v
    }

    /// `runtime [global flags] <command>` followed by `rest`, for another command on the same
    /// runtime state (`state ID`).
    pub fn sibling(&self, command: &str, rest: &[&str]) -> Vec<String> {
        let mut v = self.global.clone();
        v.push(command.to_owned());
        v.extend(rest.iter().map(|s| (*s).to_owned()));
        v
    }
}

/// `--root` as the runtime takes it: against `cwd` when relative (runc's `filepath.Abs`),
/// cleaned of `.`, `..` and repeated `/` as Go's `filepath.Clean` does, so that one root is one
/// key however it is spelled, and two roots spelled alike from two directories are two keys
/// (found from outside: `--root rr` from two directories was taken for one root, and the second
/// `create` of an id tore down the first's running container's `/dev`). Lexical: the root may
/// not exist yet (the runtime makes it). The empty root (the runtime's default) stays empty.
pub fn absolute_root(root: &str, cwd: &str) -> String {
    if root.is_empty() {
        return String::new();
    }
    let joined = if root.starts_with('/') { root.to_owned() } else { format!("{cwd}/{root}") };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    format!("/{}", parts.join("/"))
}

/// What decides where a runtime keeps its state when given no `--root`.
#[derive(Debug, Clone, Copy)]
pub struct RootFacts<'a> {
    pub euid: u32,
    /// Whether the process runs in a user namespace (its uid map is not the identity).
    pub in_userns: bool,
    /// `XDG_RUNTIME_DIR`, when set.
    pub xdg_runtime_dir: Option<&'a str>,
}

/// The root runc or crun takes without `--root`, as each works it out (runc's `main.go`:
/// `/run/runc`, or `$XDG_RUNTIME_DIR/runc` for a user other than root; crun's
/// `get_run_directory`: `$XDG_RUNTIME_DIR/crun` whenever that is set, even for root, else
/// `/run/crun` for root); `None` for another runtime, or where the rule is not this simple (a
/// user namespace, where runc asks `$USER`; a user without `$XDG_RUNTIME_DIR`).
pub fn default_root(runtime: &str, facts: RootFacts) -> Option<String> {
    let xdg = facts.xdg_runtime_dir.filter(|d| !d.is_empty());
    let root = facts.euid == 0 && !facts.in_userns;
    match runtime {
        "runc" if root => Some("/run/runc".to_owned()),
        "crun" if root || xdg.is_some() => {
            Some(xdg.map_or_else(|| "/run/crun".to_owned(), |d| absolute_root("crun", d)))
        }
        "runc" if facts.euid != 0 => xdg.map(|d| absolute_root("runc", d)),
        _ => None,
    }
}

/// The runtime root as the wrapper keys its containers: `--root` naming the runtime's own
/// default (by `same`, which says whether two roots are one directory) is no root given, so
/// that `runc run ID` and `runc --root /run/runc delete ID` name one container (found from
/// outside: the second was refused as another root's). `root` is already [`absolute_root`]'s;
/// an empty one stays, to be refused.
pub fn root_key(root: Option<String>, default: Option<&str>, same: impl Fn(&str, &str) -> bool) -> Option<String> {
    root.filter(|r| r.is_empty() || !default.is_some_and(|d| same(r, d)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    fn id(s: &str) -> ContainerId {
        ContainerId::new(s).unwrap()
    }

    /// The create, run or restore `line` names.
    fn new_container(line: &str) -> NewContainer {
        match decode(&v(line)).command {
            Command::Create(c) | Command::Run(c) | Command::Restore { container: c, .. } => c,
            other => panic!("{line}: {other:?}"),
        }
    }

    /// What the runtime gets for `line` on the wrapper's bundle `/ours` with pid file `/p`.
    fn ours(line: &str) -> Vec<String> {
        new_container(line).line_for_bundle("/ours", "/p", "/cb")
    }

    /// Rule (issue 17.3): `--devremap-config` (either spelling) names the wrapper's config and
    /// never reaches the runtime, which would refuse an unknown flag.
    #[test]
    fn config_flag_is_taken_out() {
        for line in
            ["--devremap-config /etc/x.json --root /r create c1", "--root /r --devremap-config=/etc/x.json create c1"]
        {
            let inv = decode(&v(line));
            assert_eq!(inv.global.config.as_deref(), Some("/etc/x.json"), "{line}");
            assert_eq!(inv.line.original(), v("--root /r create c1"), "{line}");
            assert_eq!(ours(line), v("--root /r create --bundle /ours --pid-file /p c1"), "{line}");
            assert_eq!(inv.global.root.as_deref(), Some("/r"));
        }
    }

    /// Rule (issue 17.7): the runtime gets the wrapper's bundle in place of every bundle flag
    /// given (before or after the id), and a pid file where none was given.
    #[test]
    fn bundle_replaced() {
        assert_eq!(
            ours("--root /r create -b /theirs --console-socket /s c1 --bundle=/again"),
            v("--root /r create --console-socket /s --bundle /ours --pid-file /p c1")
        );
        assert_eq!(ours("run --pid-file /given -- c1"), v("run --pid-file /given --bundle /ours -- c1"));
    }

    /// Rule (issue 33): the line the runtime gets for the wrapper's bundle, byte for byte as
    /// before the command line was decoded once, for create, run and restore: with and without
    /// `--bundle`/`-b` and `--pid-file`, in the `--flag=value` and `--flag value` forms, with
    /// flags after the id, `--`, and flags the wrapper does not know.
    #[test]
    fn the_line_for_our_bundle() {
        let cases = [
            ("create c1", "create --bundle /ours --pid-file /p c1"),
            ("create --bundle /b c1", "create --bundle /ours --pid-file /p c1"),
            ("create -b /b c1", "create --bundle /ours --pid-file /p c1"),
            ("create --bundle=/b -b=/c c1", "create --bundle /ours --pid-file /p c1"),
            ("create -bundle /b c1", "create --bundle /ours --pid-file /p c1"),
            ("create --pid-file /q c1", "create --pid-file /q --bundle /ours c1"),
            ("create --pid-file=/q -b /b c1", "create --pid-file=/q --bundle /ours c1"),
            ("create c1 --pid-file /q --bundle /b", "create --bundle /ours c1 --pid-file /q"),
            ("create c1 -b=/b --no-new-keyring", "create --bundle /ours --pid-file /p c1 --no-new-keyring"),
            (
                "--root /r --log /l --systemd-cgroup create --console-socket /s c1",
                "--root /r --log /l --systemd-cgroup create --console-socket /s --bundle /ours --pid-file /p c1",
            ),
            ("run -d --unknown --keep c1", "run -d --unknown --keep --bundle /ours --pid-file /p c1"),
            ("run -b /b -- c1", "run --bundle /ours --pid-file /p -- c1"),
            ("run -- c1 --bundle /b", "run --bundle /ours --pid-file /p -- c1 --bundle /b"),
            ("run c1 -- --bundle /b", "run --bundle /ours --pid-file /p c1 -- --bundle /b"),
            (
                "run --preserve-fds 2 --new-flag=x c1",
                "run --preserve-fds 2 --new-flag=x --bundle /ours --pid-file /p c1",
            ),
            (
                "restore --detach --image-path /img --bundle /b --manage-cgroups-mode soft c1",
                "restore --detach --image-path /img --manage-cgroups-mode soft --bundle /ours --pid-file /p c1",
            ),
            (
                "restore --image-path=/img -b /b c1 --pid-file /q",
                "restore --image-path=/img --bundle /ours c1 --pid-file /q",
            ),
            ("restore c1 --work-path /w", "restore --bundle /ours --pid-file /p c1 --work-path /w"),
            // A flag missing its value at the end.
            ("create c1 --bundle", "create --bundle /ours --pid-file /p c1"),
            ("create c1 --console-socket", "create --bundle /ours --pid-file /p c1 --console-socket"),
        ];
        for (line, want) in cases {
            assert_eq!(ours(line), v(want), "{line}");
        }
    }

    /// containerd's runc shim: global flags before the command, then create's flags and the id.
    #[test]
    fn containerd_create() {
        let argv = v("--root /run/containerd/runc/k8s.io --log /b/log.json --log-format json --systemd-cgroup \
                      create --bundle /b --pid-file /b/init.pid --console-socket /tmp/c.sock abc123");
        let inv = decode(&argv);
        assert_eq!(inv.global.root.as_deref(), Some("/run/containerd/runc/k8s.io"));
        assert_eq!((inv.global.log.as_deref(), inv.global.log_format.as_deref()), (Some("/b/log.json"), Some("json")));
        let Command::Create(c) = &inv.command else { panic!("{:?}", inv.command) };
        assert_eq!(c.id, Ok(id("abc123")));
        assert_eq!((c.bundle.as_deref(), c.pid_file.as_deref()), (Some("/b"), Some("/b/init.pid")));
        assert!(!c.gone_on_return);
        assert_eq!(inv.line.original(), argv);
        assert_eq!(
            c.line_for_bundle("/ours", "/x", "/cb"),
            v("--root /run/containerd/runc/k8s.io --log /b/log.json --log-format json --systemd-cgroup \
               create --pid-file /b/init.pid --console-socket /tmp/c.sock --bundle /ours abc123"),
            "a pid file given is kept"
        );
    }

    /// Go's flag forms: one or two dashes, `=value`, short `-b`, booleans that take no value,
    /// and `--` ending the flags.
    #[test]
    fn flag_forms() {
        let inv = decode(&v("-root=/r --debug run -b=/bun -d --no-pivot --keep -- my-id"));
        assert_eq!(inv.global.root.as_deref(), Some("/r"));
        assert_eq!(inv.line.global, v("-root=/r --debug"));
        let Command::Run(c) = &inv.command else { panic!("{:?}", inv.command) };
        assert_eq!((&c.id, c.bundle.as_deref()), (&Ok(id("my-id")), Some("/bun")));
        assert_eq!(
            c.line_for_bundle("/ours", "/p", "/cb"),
            v("-root=/r --debug run -d --no-pivot --keep --bundle /ours --pid-file /p -- my-id")
        );
    }

    /// Rule: a run or restore in the foreground without `--keep` is gone when the runtime
    /// returns (the wrapper then tears its daemon down); a create, a detached one or a kept one
    /// is not. A boolean given `=false` is false.
    #[test]
    fn gone_on_return() {
        for (line, gone) in [
            ("create c1", false),
            ("run c1", true),
            ("run -d c1", false),
            ("run --detach=false c1", true),
            ("run c1 --keep", false),
            ("run --keep=false c1", true),
            ("restore c1", true),
            ("restore --detach c1", false),
        ] {
            assert_eq!(new_container(line).gone_on_return, gone, "{line}");
        }
    }

    /// checkpoint, restore, start and delete: the id and `--image-path`, with the other value
    /// flags skipped right.
    #[test]
    fn the_other_commands() {
        let inv = decode(&v("--root /s checkpoint --image-path /img --work-path /w --leave-running c1"));
        assert_eq!(inv.command, Command::Checkpoint { id: id("c1"), image_path: Some("/img".into()) });
        assert_eq!(inv.line.sibling("state", &["c1"]), v("--root /s state c1"));
        let inv = decode(&v("restore --detach --image-path /img --bundle /b --manage-cgroups-mode soft c1"));
        let Command::Restore { container: c, image_path } = &inv.command else { panic!("{:?}", inv.command) };
        assert_eq!((image_path.as_deref(), c.bundle.as_deref(), &c.id), (Some("/img"), Some("/b"), &Ok(id("c1"))));
        assert_eq!(decode(&v("start c1")).command, Command::Start(id("c1")));
        assert_eq!(decode(&v("delete -f c1")).command, Command::Delete(Some(id("c1"))));
        assert_eq!(decode(&v("delete c4 --force")).command, Command::Delete(Some(id("c4"))));
        assert_eq!(decode(&v("delete --force")).command, Command::Delete(None));
        assert_eq!(decode(&v("delete ../x")).command, Command::Delete(None));
        // A start or checkpoint of no valid id is the runtime's alone.
        assert_eq!(decode(&v("start ../x")).command, Command::Other);
        assert_eq!(decode(&v("checkpoint")).command, Command::Other);
        assert_eq!(decode(&v("state c1")).command, Command::Other);
        // A create's id the wrapper cannot use as a directory is kept, to refuse by name.
        assert_eq!(new_container("create a/b").id, Err(BadId("a/b".into())));
    }

    /// Odd command lines never panic: nothing, flags only, a flag missing its value, no id.
    #[test]
    fn odd_command_lines() {
        assert_eq!(decode(&[]).line.command, None);
        assert_eq!(decode(&[]).command, Command::Other);
        assert_eq!(decode(&v("--version")).line.command, None);
        assert_eq!(decode(&v("--root")).global.root, None);
        assert_eq!(decode(&v("create --bundle")).command, Command::Other);
        assert_eq!(decode(&v("run")).command, Command::Other);
        assert_eq!(decode(&v("restore --image-path /i")).command, Command::Other);
        assert_eq!(decode(&v("-- state x")).line.command.as_deref(), Some("state"));
        assert_eq!(decode(&v("-- start x")).command, Command::Start(id("x")));
    }

    /// Bug (found from outside): runc takes a command's flags after the container id too
    /// (urfave/cli reorders them), so `create ID --bundle B --pid-file P` created the bundle
    /// `B`, while the wrapper read the spec in its working directory and gave the runtime a
    /// second `--pid-file` that lost to the caller's, leaving the daemon waiting for a pid file
    /// that never came.
    #[test]
    fn flags_after_the_id() {
        let c = new_container("--root /r create c1 --bundle /b -pid-file=/p --no-pivot");
        assert_eq!((&c.id, c.bundle.as_deref(), c.pid_file.as_deref()), (&Ok(id("c1")), Some("/b"), Some("/p")));
        assert_eq!(
            c.line_for_bundle("/ours", "/x", "/cb"),
            v("--root /r create --bundle /ours c1 -pid-file=/p --no-pivot")
        );
        let c = new_container("run c2 -d -b /b --keep");
        assert_eq!((&c.id, c.bundle.as_deref(), c.gone_on_return), (&Ok(id("c2")), Some("/b"), false));
        let inv = decode(&v("restore c3 --image-path /img --bundle /b"));
        let Command::Restore { container: c, image_path } = &inv.command else { panic!("{:?}", inv.command) };
        assert_eq!((&c.id, image_path.as_deref()), (&Ok(id("c3")), Some("/img")));
        // After `--`, a word that looks like a flag is an argument.
        let c = new_container("create c5 -- --bundle /b");
        assert_eq!((&c.id, c.bundle.as_deref()), (&Ok(id("c5")), None));
        let c = new_container("create -- c6 --bundle /b");
        assert_eq!((&c.id, c.bundle.as_deref()), (&Ok(id("c6")), None));
    }

    /// Rule: an id is used as a path component only when it is runc's kind of id.
    #[test]
    fn ids() {
        for good in ["abc", "a.b-c_d+e", "0123456789abcdef"] {
            assert_eq!(ContainerId::new(good).map(|i| i.as_str().to_owned()), Ok(good.to_owned()));
        }
        for bad in ["", ".", "..", "a/b", "../x", "a b", "é"] {
            assert_eq!(ContainerId::new(bad), Err(BadId(bad.into())));
        }
    }

    /// Bug (found from outside): an id is a directory's name, so at most 255 bytes; ids of 256 to
    /// 1,024 bytes passed and failed the start later (`file name too long`), and longer ones
    /// were refused for characters they did not have.
    #[test]
    fn ids_are_at_most_a_file_names_length() {
        let longest = "a".repeat(MAX_ID_LEN);
        assert_eq!(ContainerId::new(&longest).map(|i| i.as_str().len()), Ok(MAX_ID_LEN));
        for len in [MAX_ID_LEN + 1, 1024, 1025, 4096] {
            let e = ContainerId::new(&"a".repeat(len)).unwrap_err().to_string();
            assert!(e.ends_with(&format!(": {len} bytes, longer than 255, the longest file name")), "{e}");
        }
        let e = ContainerId::new(&"é".repeat(200)).unwrap_err().to_string();
        assert!(e.ends_with(": only letters, digits and _+-. are allowed"), "{e}");
    }

    /// Bug (found from outside): runc and crun change into the bundle before they open a
    /// restore's images, its work directory and the console socket, so a relative one named a
    /// file in the wrapper's bundle (`open ck: no such file or directory`). The wrapper's line
    /// names them in the caller's bundle; absolute ones, flags of other commands' and values
    /// after the flags end are left as given.
    #[test]
    fn paths_the_runtime_opens_in_the_bundle_stay_the_callers() {
        let c = new_container("restore --image-path ck --work-path=wp -console-socket ../s -d --pidfd-socket /abs r1");
        assert_eq!(
            c.line_for_bundle("/ours", "/p", "/home/u/b/"),
            v("restore --image-path /home/u/b/ck --work-path=/home/u/b/wp -console-socket /home/u/b/../s -d \
               --pidfd-socket /abs --bundle /ours --pid-file /p r1")
        );
        let c = new_container("--root /r run r1 --console-socket cs -- --image-path x");
        assert_eq!(
            c.line_for_bundle("/ours", "/p", "/"),
            v("--root /r run --bundle /ours --pid-file /p r1 --console-socket /cs -- --image-path x")
        );
        assert_eq!(
            new_container("create --console-socket= c1").line_for_bundle("/ours", "/p", "/b"),
            v("create --console-socket= --bundle /ours --pid-file /p c1")
        );
    }

    /// Rule (found from outside): runc's and crun's default root and `--root` naming it are
    /// one root to the wrapper, as they are to the runtime; another runtime's, or a rule we do
    /// not know (a user namespace), leaves `--root` as given.
    #[test]
    fn a_runtimes_default_root_is_no_root_given() {
        let root = RootFacts { euid: 0, in_userns: false, xdg_runtime_dir: None };
        let xdg = RootFacts { xdg_runtime_dir: Some("/run/user/0/"), ..root };
        assert_eq!(default_root("runc", root).as_deref(), Some("/run/runc"));
        assert_eq!(default_root("runc", xdg).as_deref(), Some("/run/runc"), "runc's root ignores XDG_RUNTIME_DIR");
        assert_eq!(default_root("crun", root).as_deref(), Some("/run/crun"));
        assert_eq!(default_root("crun", xdg).as_deref(), Some("/run/user/0/crun"), "crun's does not");
        assert_eq!(default_root("crun", RootFacts { xdg_runtime_dir: Some(""), ..root }).as_deref(), Some("/run/crun"));
        let user = RootFacts { euid: 1000, in_userns: false, xdg_runtime_dir: Some("/run/user/1000") };
        assert_eq!(default_root("runc", user).as_deref(), Some("/run/user/1000/runc"));
        assert_eq!(default_root("runc", RootFacts { xdg_runtime_dir: None, ..user }), None);
        assert_eq!(default_root("runc", RootFacts { in_userns: true, ..root }), None);
        assert_eq!(default_root("runsc", root), None);

        let default = default_root("runc", root);
        let eq = |a: &str, b: &str| a == b;
        assert_eq!(root_key(Some("/run/runc".into()), default.as_deref(), eq), None);
        assert_eq!(root_key(Some("/run/runc2".into()), default.as_deref(), eq).as_deref(), Some("/run/runc2"));
        assert_eq!(root_key(Some(String::new()), default.as_deref(), |_, _| true).as_deref(), Some(""));
        assert_eq!(root_key(None, default.as_deref(), eq), None);
        assert_eq!(root_key(Some("/run/runc".into()), None, eq).as_deref(), Some("/run/runc"));
    }

    /// Rule (found from outside): a runtime root is one key however it is spelled, and a
    /// relative one is resolved against the caller's directory, as the runtime resolves it.
    #[test]
    fn a_runtime_root_is_keyed_as_the_runtime_resolves_it() {
        assert_eq!(absolute_root("rr", "/tmp/a"), "/tmp/a/rr");
        assert_eq!(absolute_root("rr", "/tmp/b"), "/tmp/b/rr");
        assert_eq!(absolute_root("/tmp/a/rr/", "/"), "/tmp/a/rr");
        assert_eq!(absolute_root("./x/../rr//", "/tmp/a/"), "/tmp/a/rr");
        assert_eq!(absolute_root("../../..", "/tmp/a"), "/");
        assert_eq!(absolute_root("/run/containerd/runc/k8s.io", "/somewhere"), "/run/containerd/runc/k8s.io");
        assert_eq!(absolute_root("", "/tmp/a"), "");
    }
}
