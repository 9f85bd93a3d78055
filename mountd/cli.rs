//! The command line: `devremapd plan` and `devremapd mount`, sharing the input flags, and the
//! other commands.

use clap::{Args, Parser, Subcommand, ValueEnum};
use devremap::atomic::WriteError;
use devremap::decision::checks::{CheckName, ChecksError, parse_relax};
use devremap::decision::pairing::{MapPair, PairingError, Rule};
use devremap::decision::plan::Prefer;
use devremap::family::table::parse_device_map;
use devremap::inputs::load::Sources;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Why `devremapd mount`'s file flags are refused, naming the path and the flags.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Something other than a regular file where a pid or state file would be written.
    #[error(transparent)]
    Destination(#[from] WriteError),
    #[error("{}: given as both {first} and {second}; each needs a file of its own", path.display())]
    SameFile { path: PathBuf, first: &'static str, second: &'static str },
    #[error(
        "{flag} {}: inside the mountpoint {}, which the daemon serves read-only itself; give a path outside it",
        path.display(),
        mountpoint.display()
    )]
    InsideMountpoint { flag: &'static str, path: PathBuf, mountpoint: PathBuf },
}

#[derive(Debug, Parser)]
#[command(
    name = "devremapd",
    version = devremap::keeper::control::VERSION,
    about = "A FUSE /dev for containers whose GPUs were remapped by checkpoint/restore",
    arg_required_else_help = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the remap table and the /dev tree the inputs give, without mounting anything.
    Plan(PlanArgs),
    /// Mount the tree over FUSE at MOUNTPOINT and serve it in the foreground; SIGHUP reloads,
    /// SIGUSR2 upgrades to the binary now on disk.
    Mount(MountArgs),
    /// The server `mount` starts and restarts (fds 3 and 4 are its sockets); not for people.
    #[command(hide = true)]
    Serve(MountArgs),
    /// Print (or write) an OCI runtime spec whose /dev is a bind mount of a devremap mount.
    OciPatch(OciPatchArgs),
    /// Write the GPUs a container has as checkpoint metadata (the save side).
    Record(RecordArgs),
    /// Print the pairing as cuda-checkpoint's --device-map value: oldUUID=newUUID,...
    CudaDeviceMap(InputArgs),
    /// Serve every container's /dev on this host: one daemon per node, which devremap-runtime
    /// asks over its socket; SIGHUP reloads every container, SIGUSR2 upgrades each one's server.
    Node(NodeArgs),
    /// Ask the node daemon: `list`, `reload [ID]`, `status ID`.
    Ctl(CtlArgs),
    /// Add the CRI runtime handler devremap to containerd's config.toml, keeping everything
    /// else (node-setup.sh runs it); prints `changed` or `unchanged`.
    ContainerdConfig(ContainerdConfigArgs),
    /// A keeper or server started ahead of need: waits on fd 0 for its command line (`mount
    /// ...` or `serve ...`) and descriptors, then runs it; not for people.
    #[command(hide = true)]
    Parked(ParkedArgs),
    /// Forks the node daemon's spare keepers on request (`zygote.rs`).
    #[command(hide = true)]
    Zygote,
}

#[derive(Debug, Args)]
pub struct ParkedArgs {
    /// Start the server ahead too, parked in turn (the node daemon's spare keeper).
    #[arg(long)]
    pub spare_server: bool,
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The socket clients ask on; its directory must be root's alone.
    #[arg(long, value_name = "PATH", default_value = "/run/devremap/node.sock")]
    pub socket: PathBuf,
    /// Where each container's directory is (`<DIR>/<id>/`): the runtime config's state_dir.
    #[arg(long, value_name = "DIR", default_value = "/run/devremap")]
    pub state_dir: PathBuf,
    #[arg(long, value_name = "PATH", default_value = "/run/devremap/node.pid")]
    pub pid_file: PathBuf,
    /// Exit after SECS with no container to serve (the daemon devremap-runtime starts when
    /// none answers runs with 60); without it, run until stopped.
    #[arg(long, value_name = "SECS")]
    pub idle_exit: Option<u64>,
    /// Start each container's keeper when its mount is asked for, keeping no spare keeper
    /// (two processes, started ahead so that a mount does not wait for their execs).
    #[arg(long)]
    pub no_spare: bool,
    /// Threads answering the kernel in each container's server (`devremapd mount --threads`).
    /// One, the server's main thread between its other work: a container's `/dev` is answered
    /// from the kernel's cache once listed, and a second thread only waited, 14 KiB and a
    /// thread in every container.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub threads: u16,
    /// A container's server asked nothing for this many seconds rests (`devremapd mount
    /// --rest-after`): a container whose `/dev` the kernel answers from its cache costs its
    /// keeper alone, one process and one thread, until the next request (0: never).
    #[arg(long, value_name = "SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub rest_after: u64,
    /// Write a newline to FD once the socket answers, and close it.
    #[arg(long, value_name = "FD", hide = true)]
    pub ready_fd: Option<i32>,
    /// Register with containerd as the NRI plugin `devremap` (issue 32): containerd's NRI
    /// must be enabled; until its socket answers the daemon keeps trying. Not with
    /// `--idle-exit`: a plugin must not go when no container is served.
    #[arg(long, conflicts_with = "idle_exit")]
    pub nri: bool,
    /// containerd's NRI socket (its `socket_path`).
    #[arg(long, value_name = "PATH", default_value = "/var/run/nri/nri.sock", requires = "nri")]
    pub nri_socket: PathBuf,
    /// The plugin's place among NRI plugins (0-99; lower is called first).
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u8).range(0..=99), requires = "nri")]
    pub nri_index: u8,
    /// A CreateContainer not done within this many milliseconds is answered with an error (the
    /// kubelet tries again). Keep it under containerd's `plugin_request_timeout` (2 s by
    /// default): a plugin that answers later is dropped, and the container created without it.
    #[arg(long, value_name = "MS", default_value_t = 1500, value_parser = clap::value_parser!(u64).range(100..=600000), requires = "nri")]
    pub nri_timeout: u64,
    /// The runtime config devremap-runtime reads (host_dev, host_root, annotations, relax), for
    /// the containers the NRI plugin serves [default: /etc/devremap/runtime.json, the defaults
    /// where it does not exist].
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct CtlArgs {
    /// The node daemon's socket.
    #[arg(long, value_name = "PATH", default_value = "/run/devremap/node.sock", global = true)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Debug, Subcommand)]
pub enum CtlCommand {
    /// One JSON object per container served: id, mountpoint, state_file, last_error, ...
    List,
    /// Reload container ID (every container without one), each on its own; waits for each
    /// reload to finish and prints its entry; exit status 1 if one was refused.
    Reload { id: Option<String> },
    /// Container ID's entry and its daemon's state file, as one JSON object.
    Status { id: String },
}

#[derive(Debug, Args)]
pub struct ContainerdConfigArgs {
    /// containerd's config, as the host sees it (under --host-root).
    #[arg(long, value_name = "PATH", default_value = "/etc/containerd/config.toml")]
    pub config: PathBuf,
    /// The handler's tables: dist/containerd/devremap.toml (/usr/share/devremap/containerd/).
    #[arg(long, value_name = "PATH")]
    pub entry: PathBuf,
    /// The devremap-runtime the handler runs (its BinaryName; default: the entry's).
    #[arg(long, value_name = "PATH")]
    pub runtime: Option<String>,
    /// Where the host's root is: CONFIG and the files it imports are read under it.
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,
    /// Print the config as it would be written; write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct RecordArgs {
    /// The container's OCI runtime spec (config.json).
    #[arg(long, value_name = "CONFIG")]
    pub spec: PathBuf,
    /// Device directory whose nvidiaN nodes are the container's GPUs (default /dev when the
    /// spec asks for GPUs through the NVIDIA hook).
    #[arg(long, value_name = "DIR")]
    pub host_dev: Option<PathBuf>,
    /// Root under which /proc/driver/nvidia and /sys/bus/pci are read.
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,
    /// Write the list here (atomically) instead of printing it.
    #[arg(long, value_name = "PATH")]
    pub output: Option<PathBuf>,
    /// The metadata the container was restored with, if it was: the names it gave the GPUs
    /// are carried into the record (`earlier_minors`), so a second migration keeps them.
    #[arg(long, value_name = "PREV")]
    pub metadata: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct OciPatchArgs {
    /// The bundle's config.json.
    pub config: PathBuf,
    /// The devremap mountpoint to bind at the container's /dev.
    #[arg(long = "dev", value_name = "MOUNTPOINT")]
    pub dev: PathBuf,
    /// Replace CONFIG (atomically) instead of printing the result.
    #[arg(long)]
    pub in_place: bool,
    /// Patch even if MOUNTPOINT is not (yet) a live devremap mount, to patch before mounting.
    #[arg(long)]
    pub allow_unmounted: bool,
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// Where to mount the devfs: an empty directory under one that only root can enter.
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub inputs: InputArgs,
    /// Write the daemon's pid (the keeper's, which takes the signals) here once the mount
    /// answers; removed at exit.
    #[arg(long, value_name = "PATH")]
    pub pid_file: Option<PathBuf>,
    /// Keep the served plan, generation and last reload error here (JSON, replaced atomically).
    #[arg(long, value_name = "PATH")]
    pub state_file: Option<PathBuf>,
    /// Threads answering the kernel: with 1, the server's main thread, between its other work;
    /// with more, threads of their own (a request that never returns then holds one of them,
    /// never the server's reloads).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub threads: u16,
    /// Entry and attribute timeout given to the kernel, in seconds; every change is pushed to
    /// the kernel, so it can be long.
    #[arg(long, value_name = "SECONDS", default_value_t = 86400)]
    pub ttl: u64,
    /// A reload whose inputs have not loaded within this many seconds (an input on a stuck
    /// filesystem) is abandoned: the served tree stays and `last_error` says so.
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub reload_timeout: u64,
    /// A server that leaves a request of the kernel unanswered this long is hung: it is killed
    /// and another takes over (processes waiting on it cannot even be killed meanwhile).
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub server_timeout: u64,
    /// A server asked nothing for this many seconds rests: it ends, the state file says so
    /// (`resting`), and the next request or signal starts another, which serves the same plan
    /// (0: never). The keeper keeps the mount meanwhile.
    #[arg(long, value_name = "SECONDS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub rest_after: u64,
    /// Stop when the process whose pid this file holds (the container's init, as the runtime's
    /// --pid-file writes it) exits, once the file appears.
    #[arg(long, value_name = "PATH")]
    pub container_pid_file: Option<PathBuf>,
    /// Stop when process PID (whoever started us) exits before --container-pid-file appears.
    #[arg(long, value_name = "PID")]
    pub owner_pid: Option<u32>,
    /// Write a newline to FD, a pipe inherited from whoever started us, once the mount answers
    /// (after the pid file), and close it: the starter reads readiness there. EOF without the
    /// newline: the start failed.
    #[arg(long, value_name = "FD")]
    pub ready_fd: Option<i32>,
}

impl MountArgs {
    /// Refuses one path given for two of the daemon's files: the state file's JSON would
    /// replace the pid (or the container's pid), and whoever reads one file gets the other.
    /// Refuses a pid or state file path where something other than a regular file is (issue
    /// 29.4: `--state-file /dev/stdout` would have replaced the node), before anything is done.
    pub fn check_files(&self) -> Result<(), CliError> {
        for path in [&self.pid_file, &self.state_file].into_iter().flatten() {
            devremap::atomic::check_destination_named(path)?;
        }
        let flags = [
            ("--pid-file", &self.pid_file),
            ("--state-file", &self.state_file),
            ("--container-pid-file", &self.container_pid_file),
        ];
        let given: Vec<(&str, &PathBuf, PathBuf)> =
            flags.iter().filter_map(|(flag, path)| path.as_ref().map(|p| (*flag, p, place(p)))).collect();
        for (i, (first, path, place_a)) in given.iter().enumerate() {
            if let Some((second, ..)) = given[i + 1..].iter().find(|(_, _, place_b)| place_b == place_a) {
                return Err(CliError::SameFile { path: path.to_path_buf(), first, second });
            }
        }
        Ok(())
    }

    /// Refuses a pid or state file inside the mountpoint (`canonical`, resolved): written
    /// through the mount, it would wait for the keeper's own thread, which relays the mount's
    /// requests (found from outside: the pid file's write hung the keeper and its mount for
    /// good), and find a read-only file system at best.
    pub fn check_outside(&self, canonical: &Path) -> Result<(), CliError> {
        for (flag, path) in [("--pid-file", &self.pid_file), ("--state-file", &self.state_file)] {
            let Some(path) = path else { continue };
            let at = place(path);
            if std::path::absolute(&at).unwrap_or(at).starts_with(canonical) {
                return Err(CliError::InsideMountpoint { flag, path: path.clone(), mountpoint: canonical.to_owned() });
            }
        }
        Ok(())
    }
}

/// Where `path` puts its file: its directory resolved (`dir/./x`, a symlinked directory), then
/// its name. A directory that cannot be resolved is compared as written (the write fails later).
pub(crate) fn place(path: &Path) -> PathBuf {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return path.to_path_buf() };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    dir.canonicalize().map_or_else(|_| path.to_path_buf(), |d| d.join(name))
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub inputs: InputArgs,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Which name wins a collision between a checkpoint name and a native name.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PreferArg {
    Native,
    Checkpoint,
}

/// Which rules pair the saved GPUs `--device-map` leaves.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PairingArg {
    /// A saved GPU whose UUID is among the restored GPUs pairs with itself; the rest by position.
    Identity,
    /// gVisor's rule exactly: the i-th saved GPU with the i-th restored one, by minor.
    Positional,
}

/// The checks of one `--relax` occurrence.
#[derive(Debug, Clone)]
pub struct RelaxList(BTreeSet<CheckName>);

/// clap's value parser of `--relax`: clap prints the error's text after the flag.
fn relax_list(s: &str) -> Result<RelaxList, ChecksError> {
    parse_relax(s).map(RelaxList)
}

/// Parsed pairs of one `--device-map` occurrence.
#[derive(Debug, Clone)]
pub struct MapList(Vec<MapPair>);

/// clap's value parser of `--device-map`.
fn map_list(s: &str) -> Result<MapList, PairingError> {
    parse_device_map(s).map(MapList)
}

/// The inputs of a plan, shared by `plan` and `mount`.
#[derive(Debug, Args)]
pub struct InputArgs {
    /// Checkpoint metadata: a gVisor state file, a checkpoint directory, a JSON metadata map,
    /// or a JSON array of device ids.
    #[arg(long, value_name = "PATH")]
    pub metadata: Option<PathBuf>,
    /// The container's OCI runtime spec (config.json).
    #[arg(long, value_name = "PATH")]
    pub spec: Option<PathBuf>,
    /// Device directory whose nvidiaN nodes are the restored GPUs (default /dev when the spec
    /// asks for GPUs through the NVIDIA hook).
    #[arg(long, value_name = "DIR")]
    pub host_dev: Option<PathBuf>,
    /// Root under which /proc/driver/nvidia and /sys/bus/pci are read.
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub host_root: PathBuf,
    /// Explicit pairs OLD=NEW[,OLD=NEW...], each a minor or a GPU- UUID; repeatable.
    #[arg(long, value_name = "OLD=NEW", value_parser = map_list)]
    pub device_map: Vec<MapList>,
    /// Which name wins when a checkpoint name is another restored GPU's native name.
    #[arg(long, value_enum, default_value = "native")]
    pub prefer: PreferArg,
    /// A file holding `native` or `checkpoint`, read at every (re)load and winning over
    /// --prefer: write it and send SIGHUP to switch a running daemon.
    #[arg(long, value_name = "PATH")]
    pub prefer_file: Option<PathBuf>,
    /// How saved GPUs that --device-map leaves are paired.
    #[arg(long, value_enum, default_value = "identity")]
    pub pairing: PairingArg,
    /// Checks whose failure only warns: mixed, model, driver, mode (count cannot be relaxed);
    /// CHECK[,CHECK...], repeatable.
    #[arg(long, value_name = "CHECK", value_parser = relax_list)]
    pub relax: Vec<RelaxList>,
}

impl InputArgs {
    pub fn sources(&self) -> Sources {
        Sources {
            metadata: self.metadata.clone(),
            spec: self.spec.clone(),
            host_dev: self.host_dev.clone(),
            host_root: self.host_root.clone(),
            device_map: self.device_map.iter().flat_map(|m| m.0.iter().cloned()).collect(),
            prefer: match self.prefer {
                PreferArg::Native => Prefer::Native,
                PreferArg::Checkpoint => Prefer::Checkpoint,
            },
            prefer_file: self.prefer_file.clone(),
            pairing: match self.pairing {
                PairingArg::Identity => Rule::IdentityFirst,
                PairingArg::Positional => Rule::Positional,
            },
            relax: self.relax.iter().flat_map(|r| r.0.iter().copied()).collect(),
        }
    }
}
