//! `devremap-runtime`: an OCI runtime with runc's command line that runs the real runtime (runc
//! by default) and gives containers that ask for it a devremap `/dev`, the way
//! `nvidia-container-runtime` wraps runc.
//!
//! - `create`, `run`: when the spec asks for devremap (see `devremap::runtime::annotations`),
//!   write the caller's spec, its `/dev` pointed at `<state_dir>/<id>/dev`, into a bundle of our
//!   own (`<state_dir>/<id>/bundle`: the caller's bundle is never written), have the node daemon
//!   (`devremapd node`, started here where none answers at the config's `node_socket`) mount
//!   that `/dev`, and replace this process with the runtime on our bundle. If a step before the
//!   runtime fails, everything is undone; after it, the container's keeper ends with the
//!   container and the node daemon removes the directory.
//! - `start`: refuse a devremap container whose daemon is gone (it would run on a dead mount).
//! - `checkpoint`: record the container's GPUs into `<image-path>/devremap-gpus.json` first.
//! - `restore`: as `create`, with a copy of the image's `devremap-gpus.json` (or a gVisor
//!   `checkpoint.img`) as the daemon's metadata.
//! - `delete`: exec the runtime; for a container of an earlier version's per-container daemon
//!   (or one whose keeper died), after the runtime, once the runtime no longer knows the
//!   container, stop the daemon and remove its directory, as before.
//! - anything else: exec the runtime unchanged.
//!
//! The config is `--devremap-config PATH` (a global flag, taken out before the runtime sees
//! the line), else `DEVREMAP_RUNTIME_CONFIG`, else `/etc/devremap/runtime.json`: the flag and
//! the default path survive a caller that strips the environment, as Podman's conmon does.
//!
//! The runtime of a container we set up gets the read end of an empty pipe for stdin where
//! ours is the host's `/dev/null`: runc reopens such stdio inside the container only when it
//! builds `/dev` itself, and CRIU cannot checkpoint a descriptor on a mount outside the
//! container (`docker run -d`, `podman run -d`); a pipe with no writer reads as `/dev/null` does.
//!
//! A keeper never outlives its container: it runs with `--owner-pid` (this process, which the
//! runtime becomes) and `--container-pid-file` (the runtime's pid file), so it stops when the
//! container's init exits, or when the runtime exits before the container was made.

mod commands;
mod config_file;
mod error;
mod node;
mod procs;
mod runner;
mod start;

use devremap::io_message;
use devremap::runtime::argv::{self, Command, Invocation};
use devremap::runtime::config::{self, Config};
use devremap::runtime::container_daemon::same_root;
use devremap::runtime::osarg;
use error::Failure;
use runner::{exec, exec_unchanged, report};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The file `checkpoint` writes and `restore` reads in the image directory.
const RECORD_FILE: &str = "devremap-gpus.json";

fn main() -> ExitCode {
    // Arguments that are not UTF-8 are carried through, each byte standing in (issue 17.8).
    let argv: Option<Vec<String>> = std::env::args_os().skip(1).map(|a| osarg::encode(&a)).collect();
    // The command line, decoded once: everything below acts on what it says.
    let mut inv = argv::decode(argv.as_deref().unwrap_or_default());
    // The runtime resolves a relative `--root` against its working directory, which is ours:
    // recorded and compared so. A directory that cannot be named leaves it as given.
    if let (Some(root), Some(cwd)) =
        (&inv.global.root, std::env::current_dir().ok().and_then(|d| osarg::encode(d.as_os_str())))
    {
        inv.global.root = Some(argv::absolute_root(root, &cwd));
    }
    // `--help`, `--version`: our lines first, then the real runtime's (run below, unchanged).
    if let Some(ask) = devremap::runtime::about::asked(&inv.line) {
        let text = devremap::runtime::about::text(ask, std::env::var_os(config::ENV).as_deref());
        let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    }
    let result = load_config(&inv.global).and_then(|config| {
        // Only a root given can name the default (the rule's facts read only then).
        if inv.global.root.is_some() {
            let default = default_root(&config);
            inv.global.root = argv::root_key(inv.global.root.take(), default.as_deref(), same_root);
        }
        match argv {
            Some(_) => dispatch(&config, &inv),
            // Not ours to understand: the runtime judges it.
            None => Err(exec_unchanged(&config)),
        }
    });
    match result {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            report(&inv.global, "error", &failure.to_string());
            ExitCode::FAILURE
        }
    }
}

fn dispatch(config: &Config, inv: &Invocation) -> Result<u8, Failure> {
    match &inv.command {
        Command::Create(new) | Command::Run(new) => start::start(config, inv, new, None),
        Command::Restore { container, image_path } => commands::restore(config, inv, container, image_path.as_deref()),
        Command::Checkpoint { id, image_path } => commands::checkpoint(config, inv, id, image_path.as_deref()),
        Command::Start(id) => commands::start_created(config, inv, id),
        Command::Delete(id) => commands::delete(config, inv, id.as_ref()),
        Command::Other => Err(exec(config, inv.line.original())),
    }
}

/// The wrapper's config: `--devremap-config`, else `DEVREMAP_RUNTIME_CONFIG`, else the default
/// path if it exists (a file named by the flag or the variable must exist).
fn load_config(global: &argv::Global) -> Result<Config, Failure> {
    let (path, required) = match (&global.config, std::env::var_os(config::ENV)) {
        (Some(p), _) => (PathBuf::from(osarg::decode(p)), true),
        (None, Some(p)) if p.is_empty() => {
            return Err(Failure::at(
                config::ENV,
                format!("set but empty; name the config file, or unset it to read {}", config::DEFAULT_PATH),
            ));
        }
        (None, Some(p)) => (PathBuf::from(p), true),
        (None, None) => (PathBuf::from(config::DEFAULT_PATH), false),
    };
    config_file::read(&path, required).map_err(|e| Failure::at(e.at, e.what))
}

/// The root the config's runtime takes without `--root`, where its rule is known.
fn default_root(config: &Config) -> Option<String> {
    let name = config.runtime.file_name()?.to_str()?;
    let xdg = std::env::var("XDG_RUNTIME_DIR").ok();
    // A user namespace maps some ids only; the host's is the identity.
    let in_userns = std::fs::read_to_string("/proc/self/uid_map")
        .map_or(true, |map| map.split_whitespace().collect::<Vec<_>>() != ["0", "0", "4294967295"]);
    let facts = argv::RootFacts { euid: nix::unistd::geteuid().as_raw(), in_userns, xdg_runtime_dir: xdg.as_deref() };
    argv::default_root(name, facts)
}

fn absolute(p: &str) -> Result<PathBuf, Failure> {
    let p = osarg::decode(p);
    std::path::absolute(&p).map_err(|e| Failure::at(p.display(), io_message(&e)))
}

/// `path` as an argument of the runtime's command line (see `osarg`).
fn arg_of(path: &Path) -> Result<String, Failure> {
    osarg::encode(path.as_os_str()).ok_or_else(|| Failure::NotPassable(path.to_owned()))
}
