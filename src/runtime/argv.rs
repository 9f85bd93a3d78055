//! runc's command line, as the wrapper must understand it to pass it on unchanged:
//! `runc [global flags] COMMAND [flags] ID`.
//!
//! Pure. Assumptions, from runc (urfave/cli over Go's `flag` package), which crun follows:
//! a flag is `-name` or `--name`, its value either `=value` or the next argument, and a boolean
//! flag never takes the next argument; flags come before the positional arguments, and the
//! first argument that is not a flag (or the one after `--`) ends them. Only the flags that
//! take a value must be known, to skip their values: an unknown flag is taken as a boolean, so
//! a newer runtime's new boolean flags pass through. A command's flags may also follow its
//! container id: runc's urfave/cli moves them to the front before parsing (`runc create ID
//! --bundle B` is `runc create --bundle B ID`), so they are read up to a `--` wherever they
//! stand. The wrapper never rewrites the command line; it only inserts `--pid-file` where a
//! create, run or restore lacks one.

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

/// One invocation of the runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The global flags, as given.
    pub global: Vec<String>,
    /// `--root`, where the runtime keeps its containers' state.
    pub root: Option<String>,
    /// `--log`, the file the runtime (and a caller like containerd) keeps errors in.
    pub log: Option<String>,
    /// `--log-format`.
    pub log_format: Option<String>,
    /// `--devremap-config`, the wrapper's config file (not passed on).
    pub config: Option<String>,
    /// The command (`create`, `run`, ...), if any.
    pub command: Option<String>,
    /// Everything after the command, as given.
    pub args: Vec<String>,
}

/// What a command's flags say that the wrapper needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandArgs {
    /// The first positional argument: the container id.
    pub id: Option<String>,
    pub bundle: Option<String>,
    pub pid_file: Option<String>,
    pub image_path: Option<String>,
    /// `--force`/`-f` (delete).
    pub force: bool,
    /// `--detach`/`-d` (run, restore).
    pub detach: bool,
    /// `--keep` (run): the container is not deleted when it exits.
    pub keep: bool,
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

/// Splits a command line (without the program name).
pub fn parse(argv: &[String]) -> Invocation {
    let (mut root, mut log, mut log_format, mut config) = (None, None, None, None);
    let end = walk_flags(argv, GLOBAL_VALUE_FLAGS, |name, value| {
        let slot = match name {
            "root" => &mut root,
            "log" => &mut log,
            "log-format" => &mut log_format,
            CONFIG_FLAG => &mut config,
            _ => return,
        };
        *slot = value.map(str::to_owned);
    });
    // A `--` before the command leaves `end` past it; the command is what follows. Our own
    // flag (and its value, when apart) is no business of the runtime's.
    let mut global = Vec::new();
    let mut args = argv[..end].iter().filter(|a| *a != "--");
    while let Some(a) = args.next() {
        match flag(a) {
            Some((CONFIG_FLAG, inline)) => {
                if inline.is_none() {
                    args.next();
                }
            }
            _ => global.push(a.clone()),
        }
    }
    Invocation {
        global,
        root,
        log,
        log_format,
        config,
        command: argv.get(end).cloned(),
        args: argv.get(end + 1..).map(<[String]>::to_vec).unwrap_or_default(),
    }
}

impl Invocation {
    /// The command's flags and container id.
    pub fn command_args(&self) -> CommandArgs {
        let mut c = CommandArgs::default();
        let mut rest = &self.args[..];
        while !rest.is_empty() {
            let end = walk_flags(rest, COMMAND_VALUE_FLAGS, |name, value| {
                let value = value.map(str::to_owned);
                // A boolean given as `--force=false` is false.
                let on = value.as_deref().is_none_or(|v| v != "false");
                match name {
                    "bundle" | "b" => c.bundle = value,
                    "pid-file" => c.pid_file = value,
                    "image-path" => c.image_path = value,
                    "force" | "f" => c.force = on,
                    "detach" | "d" => c.detach = on,
                    "keep" => c.keep = on,
                    _ => {}
                }
            });
            // After a `--` every argument is positional; before it, flags may follow the id.
            let ended = end > 0 && rest[end - 1] == "--";
            if c.id.is_none() {
                c.id = rest.get(end).cloned();
            }
            if ended {
                break;
            }
            rest = rest.get(end + 1..).unwrap_or_default();
        }
        c
    }

    /// The whole command line, with `--pid-file PATH` added after the command's own flags
    /// (before the container id) when it has none.
    pub fn with_pid_file(&self, path: &str) -> Vec<String> {
        self.line(self.inserting(self.args.clone(), path, &[]))
    }

    /// The whole command line for the wrapper's own bundle: every `--bundle`/`-b` given is
    /// replaced by `--bundle BUNDLE`, and `--pid-file PATH` is added when there is none.
    pub fn with_bundle(&self, bundle: &str, pid_file: &str) -> Vec<String> {
        let mut args = Vec::with_capacity(self.args.len() + 4);
        let mut i = 0;
        while i < self.args.len() {
            let a = &self.args[i];
            if a == "--" {
                args.extend_from_slice(&self.args[i..]);
                break;
            }
            let n = match flag(a) {
                Some((name, None)) if COMMAND_VALUE_FLAGS.contains(&name) => 2,
                _ => 1,
            };
            let end = (i + n).min(self.args.len());
            if !matches!(flag(a), Some(("bundle" | "b", _))) {
                args.extend_from_slice(&self.args[i..end]);
            }
            i = end;
        }
        self.line(self.inserting(args, pid_file, &["--bundle".to_owned(), bundle.to_owned()]))
    }

    /// `args` with `extra` and, when they hold no `--pid-file`, `--pid-file PID_FILE` put after
    /// the command's flags, before a `--` that ends them or the id.
    fn inserting(&self, mut args: Vec<String>, pid_file: &str, extra: &[String]) -> Vec<String> {
        let mut added = extra.to_vec();
        if self.command_args().pid_file.is_none() {
            added.extend(["--pid-file".to_owned(), pid_file.to_owned()]);
        }
        let end = walk_flags(&args, COMMAND_VALUE_FLAGS, |_, _| {});
        let at = if end > 0 && args.get(end - 1).is_some_and(|a| a == "--") { end - 1 } else { end };
        args.splice(at..at, added);
        args
    }

    /// The command line as given.
    pub fn original(&self) -> Vec<String> {
        self.line(self.args.clone())
    }

    /// `runtime [global flags] <command>` followed by `rest`, for another command on the same
    /// runtime state (`state ID`).
    pub fn sibling(&self, command: &str, rest: &[&str]) -> Vec<String> {
        let mut v = self.global.clone();
        v.push(command.to_owned());
        v.extend(rest.iter().map(|s| (*s).to_owned()));
        v
    }

    fn line(&self, args: Vec<String>) -> Vec<String> {
        let mut v = self.global.clone();
        v.extend(self.command.clone());
        v.extend(args);
        v
    }
}

/// A container id that is safe as one path component: runc's own rule (`^[\w+\-.]+$`), and not
/// `.` or `..`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= 1024
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_+-.".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    /// Rule (issue 17.3): `--devremap-config` (either spelling) names the wrapper's config and
    /// never reaches the runtime, which would refuse an unknown flag.
    #[test]
    fn config_flag_is_taken_out() {
        for line in
            ["--devremap-config /etc/x.json --root /r create c1", "--root /r --devremap-config=/etc/x.json create c1"]
        {
            let inv = parse(&v(line));
            assert_eq!(inv.config.as_deref(), Some("/etc/x.json"), "{line}");
            assert_eq!(inv.original(), v("--root /r create c1"), "{line}");
            assert_eq!(inv.root.as_deref(), Some("/r"));
        }
    }

    /// Rule (issue 17.7): the runtime gets the wrapper's bundle in place of every bundle flag
    /// given (before or after the id), and a pid file where none was given.
    #[test]
    fn bundle_replaced() {
        let inv = parse(&v("--root /r create -b /theirs --console-socket /s c1 --bundle=/again"));
        assert_eq!(
            inv.with_bundle("/ours", "/p"),
            v("--root /r create --console-socket /s --bundle /ours --pid-file /p c1")
        );
        let inv = parse(&v("run --pid-file /given -- c1"));
        assert_eq!(inv.with_bundle("/ours", "/p"), v("run --pid-file /given --bundle /ours -- c1"));
    }

    /// containerd's runc shim: global flags before the command, then create's flags and the id.
    #[test]
    fn containerd_create() {
        let argv = v("--root /run/containerd/runc/k8s.io --log /b/log.json --log-format json --systemd-cgroup \
                      create --bundle /b --pid-file /b/init.pid --console-socket /tmp/c.sock abc123");
        let inv = parse(&argv);
        assert_eq!(inv.root.as_deref(), Some("/run/containerd/runc/k8s.io"));
        assert_eq!((inv.log.as_deref(), inv.log_format.as_deref()), (Some("/b/log.json"), Some("json")));
        assert_eq!(inv.command.as_deref(), Some("create"));
        let c = inv.command_args();
        assert_eq!(c.id.as_deref(), Some("abc123"));
        assert_eq!((c.bundle.as_deref(), c.pid_file.as_deref()), (Some("/b"), Some("/b/init.pid")));
        assert_eq!(inv.original(), argv);
        assert_eq!(inv.with_pid_file("/x"), argv, "a pid file given is kept");
    }

    /// Go's flag forms: one or two dashes, `=value`, short `-b`, booleans that take no value,
    /// and `--` ending the flags.
    #[test]
    fn flag_forms() {
        let inv = parse(&v("-root=/r --debug run -b=/bun -d --no-pivot --keep -- my-id"));
        assert_eq!((inv.root.as_deref(), inv.command.as_deref()), (Some("/r"), Some("run")));
        assert_eq!(inv.global, v("-root=/r --debug"));
        let c = inv.command_args();
        assert_eq!((c.id.as_deref(), c.bundle.as_deref()), (Some("my-id"), Some("/bun")));
        assert!(c.detach && c.keep && !c.force);
        assert_eq!(
            inv.with_pid_file("/p"),
            v("-root=/r --debug run -b=/bun -d --no-pivot --keep --pid-file /p -- my-id")
        );
        let del = parse(&v("delete --force=false c1")).command_args();
        assert!(!del.force && del.id.as_deref() == Some("c1"));
        assert!(parse(&v("delete -f c1")).command_args().force);
    }

    /// checkpoint and restore: `--image-path` and the other value flags are skipped right.
    #[test]
    fn checkpoint_and_restore() {
        let c = parse(&v("--root /s checkpoint --image-path /img --work-path /w --leave-running c1")).command_args();
        assert_eq!((c.image_path.as_deref(), c.id.as_deref()), (Some("/img"), Some("c1")));
        let inv = parse(&v("restore --detach --image-path /img --bundle /b --manage-cgroups-mode soft c1"));
        let c = inv.command_args();
        assert_eq!(
            (c.image_path.as_deref(), c.bundle.as_deref(), c.id.as_deref()),
            (Some("/img"), Some("/b"), Some("c1"))
        );
        assert_eq!(inv.sibling("state", &["c1"]), v("state c1"));
    }

    /// Odd command lines never panic: nothing, flags only, a flag missing its value, no id.
    #[test]
    fn odd_command_lines() {
        assert_eq!(parse(&[]).command, None);
        assert_eq!(parse(&v("--version")).command, None);
        assert_eq!(parse(&v("--root")).root, None);
        let inv = parse(&v("create --bundle"));
        assert_eq!(inv.command_args(), CommandArgs::default());
        assert_eq!(inv.with_pid_file("/p"), v("create --bundle --pid-file /p"));
        assert_eq!(parse(&v("state")).command_args().id, None);
        assert_eq!(parse(&v("-- state x")).command.as_deref(), Some("state"));
    }

    /// Bug (found from outside): runc takes a command's flags after the container id too
    /// (urfave/cli reorders them), so `create ID --bundle B --pid-file P` created the bundle
    /// `B`, while the wrapper read the spec in its working directory and gave the runtime a
    /// second `--pid-file` that lost to the caller's, leaving the daemon waiting for a pid file
    /// that never came.
    #[test]
    fn flags_after_the_id() {
        let inv = parse(&v("--root /r create c1 --bundle /b -pid-file=/p --no-pivot"));
        let c = inv.command_args();
        assert_eq!((c.id.as_deref(), c.bundle.as_deref(), c.pid_file.as_deref()), (Some("c1"), Some("/b"), Some("/p")));
        assert_eq!(inv.with_pid_file("/x"), inv.original(), "a pid file given after the id is kept");
        let c = parse(&v("run c2 -d -b /b --keep")).command_args();
        assert_eq!((c.id.as_deref(), c.bundle.as_deref(), c.detach, c.keep), (Some("c2"), Some("/b"), true, true));
        let c = parse(&v("restore c3 --image-path /img --bundle /b")).command_args();
        assert_eq!((c.id.as_deref(), c.image_path.as_deref()), (Some("c3"), Some("/img")));
        assert!(parse(&v("delete c4 --force")).command_args().force);
        // After `--`, a word that looks like a flag is an argument.
        let c = parse(&v("create c5 -- --bundle /b")).command_args();
        assert_eq!((c.id.as_deref(), c.bundle), (Some("c5"), None));
        let c = parse(&v("create -- c6 --bundle /b")).command_args();
        assert_eq!((c.id.as_deref(), c.bundle), (Some("c6"), None));
    }

    /// Rule: an id is used as a path component only when it is runc's kind of id.
    #[test]
    fn ids() {
        for good in ["abc", "a.b-c_d+e", "0123456789abcdef"] {
            assert!(valid_id(good), "{good}");
        }
        for bad in ["", ".", "..", "a/b", "../x", "a b", "é"] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
