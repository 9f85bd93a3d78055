//! The wrapper's side of the node daemon (`devremapd node`, issue 31): it asks the daemon at
//! the config's `node_socket` to mount a container's `/dev`, and starts one itself, detached,
//! where none answers: a user installs nothing more than the wrapper.

use crate::error::Failure;
use crate::procs::Host;
use devremap::node::client::{ClientError, ask_passing, ask_receiving};
use devremap::node::protocol::{MountRequest, Request};
use devremap::runtime::config::Config;
use devremap::runtime::container_daemon::daemon::Processes;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longer than the daemon's own wait for a container's keeper (30 s).
const MOUNT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a daemon the wrapper started may wait without a container before it goes.
const IDLE_EXIT_SECS: &str = "60";
/// Starts of a daemon tried when none takes the request (another wrapper's daemon may win the
/// state dir's lock, or one going idle drop the request: each time, ask again).
const TRIES: usize = 3;

/// Asks the node daemon to serve `request`'s container, starting a daemon when none answers;
/// returns once the container's `/dev` answers.
/// `hold` is this wrapper's lock on the container's directory, which the daemon keeps until
/// this process (the runtime, by then) has exited.
pub fn mount(config: &Config, devremapd: &Path, request: MountRequest, hold: BorrowedFd) -> Result<(), Failure> {
    let socket = config.node_socket();
    let request = Request::Mount(request);
    let mut tries = 0;
    let busy_until = Instant::now() + MOUNT_TIMEOUT;
    let mut pause = BUSY_PAUSE;
    // What the last daemon we started said as it exited without answering.
    let mut said = None;
    loop {
        match ask_passing(&socket, &request, Some(hold), MOUNT_TIMEOUT) {
            Ok(_) => return Ok(()),
            Err(e) if e.untaken() && tries < TRIES => {
                tries += 1;
                said = start_daemon(config, devremapd, &socket)?.or(said);
            }
            // Found from outside: the reason was only in node.log, which the client's user
            // (`docker run`) never sees.
            Err(e) if e.untaken() && said.is_some() => {
                let said = said.unwrap_or_default();
                return Err(Failure::Node(format!("{e}; the node daemon started for it exited: {said}")));
            }
            // Every place taken (a burst of starts, or clients that hold theirs): asked
            // again, as the daemon says, until the mount's own timeout.
            Err(e) if e.busy() && Instant::now() + pause < busy_until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(node_failure(&socket, e)),
        }
    }
}

/// Makes the container's `/dev`, which the node daemon has mounted, seen where this runtime
/// runs. The wrapper, and the runtime it becomes, may run in a mount namespace of their own
/// (Podman's, for a user-namespace container) that the daemon's mounts do not reach, or the
/// daemon in one that ours do not (a wrapper started it from there): the runtime would bind the
/// bare mountpoint as `/dev` and fail far from the cause (found from outside: runc's `lstat
/// .../dev/pts: permission denied`, or `stat /dev/null: no such file or directory`). Then the
/// daemon hands over a detached copy of the mount ([`Request::Attach`]), which is moved onto the
/// mountpoint here; it goes with the container's directory (removing a mountpoint detaches the
/// mounts other namespaces have on it). Refused, saying why, where that cannot be done.
///
/// `dir` is the container's directory, which this wrapper holds locked: its `dev` is looked at
/// and mounted on through it, never through a symlink planted in its path (found from outside:
/// a directory swapped for a symlink put the copy where it pointed, and no teardown reached it).
pub fn seen_here(config: &Config, id: &str, dir: BorrowedFd, dev: &Path) -> Result<(), Failure> {
    if mounted_here(dir) {
        return Ok(());
    }
    devremap::failpoint::wait_at("attach");
    match attach(config, id, dir) {
        Ok(()) if mounted_here(dir) => Ok(()),
        Ok(()) => Err(unseen(dev, "its copy, moved here, does not answer")),
        Err(why) => Err(unseen(dev, &why)),
    }
}

/// Whether something is mounted on `dev` in directory `dir` (not followed) where this process
/// sees it: the directory the wrapper made is only ever mounted on by the node daemon. Asked of
/// the kernel without a request to the mount (`AT_STATX_DONT_SYNC`): its keeper stopped there
/// held the wrapper, and the client's start, in a `statfs` without end (found from outside).
/// Where the kernel does not say (before Linux 5.8), the file system's type, which asks it.
fn mounted_here(dir: BorrowedFd) -> bool {
    use rustix::fs::{Mode, OFlags, openat};
    if let Some(mounted) = devremap::inputs::files::is_mount_root_at(dir, Path::new("dev")) {
        return mounted;
    }
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let Ok(dev) = openat(dir, "dev", flags, Mode::empty()) else { return false };
    nix::sys::statfs::fstatfs(&dev).is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::FUSE_SUPER_MAGIC)
}

/// How long an `attach` is asked again while no node daemon takes it (a service restarting
/// between the mount and this request: found from outside, the start failed at once).
const ATTACH_PATIENCE: Duration = Duration::from_secs(30);

/// Asks the node daemon for a copy of container `id`'s mount and moves it onto `dev` in `dir`.
fn attach(config: &Config, id: &str, dir: BorrowedFd) -> Result<(), String> {
    use rustix::mount::{MoveMountFlags, move_mount};
    let request = Request::Attach { id: id.to_owned() };
    let until = Instant::now() + ATTACH_PATIENCE;
    let mut pause = BUSY_PAUSE;
    let tree = loop {
        match ask_receiving(&config.node_socket(), &request, MOUNT_TIMEOUT) {
            Ok((_, tree)) => break tree.ok_or("the node daemon answered without a copy of the mount")?,
            Err(e) if (e.untaken() || e.busy()) && Instant::now() + pause < until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    devremap::failpoint::wait_at("move");
    move_mount(tree.as_fd(), "", dir, "dev", MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
        .map_err(|e| format!("moving the node daemon's copy of the mount here: {}", devremap::io_message(&e.into())))
}

fn unseen(dev: &Path, why: &str) -> Failure {
    Failure::Node(format!(
        "{}: the node daemon mounted the container's /dev, but not where this runtime sees it, and it cannot be \
         moved here ({why}): this runtime runs in a mount namespace of its own, or the node daemon does, which \
         mounts made on the host do not reach (run the node daemon as the service, in the host's namespace, and \
         make the state dir's mount shared, `mount --make-rshared`, as systemd makes /run)",
        dev.display()
    ))
}

/// The first wait before a request the daemon was too busy for is asked again; it doubles,
/// up to a second.
const BUSY_PAUSE: Duration = Duration::from_millis(20);

/// Why the mount failed; a daemon still busy after every try is named by its socket (its
/// other refusals name the container and the file at fault).
fn node_failure(socket: &Path, e: ClientError) -> Failure {
    match e {
        _ if e.busy() => Failure::Node(format!("{}: {e}", socket.display())),
        // Its words quote its keepers' error lines, escaped as they were logged; the wrapper's
        // own line escapes them again (found from outside: each backslash doubled).
        ClientError::Refused { why } => Failure::Node(devremap::decision::escape::unescape(&why).into_owned()),
        e => Failure::Node(e.to_string()),
    }
}

/// Starts `devremapd node` on the config's state dir and socket, detached (its own session, its
/// log `<state_dir>/node.log`, appended to), and waits until it answers or exits (it lost the state dir to
/// another daemon, which answers then, or it could not start); returns the `error:` line it
/// wrote to its log if it exited.
fn start_daemon(config: &Config, devremapd: &Path, socket: &Path) -> Result<Option<String>, Failure> {
    devremap::runtime::container_daemon::ensure_private_dir(&config.state_dir)?;
    let log_path = config.state_dir.join(devremap::node::NODE_LOG);
    let log = devremap::atomic::append_log(&log_path, devremap::node::NODE_LOG_KEPT)?;
    let logged_before = log.metadata().map_or(0, |m| m.len());
    let log2 = log.try_clone().map_err(|e| Failure::at(log_path.display(), devremap::io_message(&e)))?;
    let (ready, ready_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(Failure::Pipe)?;
    let mut cmd = Command::new(devremapd);
    cmd.arg("node")
        .arg("--socket")
        .arg(socket)
        .arg("--state-dir")
        .arg(&config.state_dir)
        .arg("--pid-file")
        .arg(config.state_dir.join("node.pid"))
        .arg("--idle-exit")
        .arg(IDLE_EXIT_SECS)
        .arg("--ready-fd")
        .arg(ready_write.as_raw_fd().to_string())
        // Not the caller's directory (a bundle containerd removes later).
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    Host.detach(&mut cmd, ready_write.as_raw_fd());
    // Not our child: this process becomes the runtime, which would never reap it. The child
    // forks once more and exits; its child, the daemon, is the init's (or a subreaper's).
    // SAFETY: runs in the forked child before exec; fork and _exit are async-signal-safe and
    // allocate nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || match libc::fork() {
            -1 => Err(std::io::Error::last_os_error()),
            0 => Ok(()),
            _ => libc::_exit(0),
        });
    }
    let spawned = cmd.spawn().map_err(|source| {
        Failure::Daemon(devremap::runtime::container_daemon::DaemonError::Spawn { path: devremapd.to_owned(), source })
    });
    drop(ready_write);
    let _ = spawned?.wait();
    // A newline: it answers; EOF: it exited (another daemon holds the state dir, or it could
    // not start). Either way the caller asks again. Neither in time: it hangs where nothing
    // else would end the wait (found from outside: a FIFO as its lock held it, and `docker
    // run` with it, for good).
    let mut pollfd = [nix::poll::PollFd::new(ready.as_fd(), nix::poll::PollFlags::POLLIN)];
    let waited = nix::poll::poll(
        &mut pollfd,
        nix::poll::PollTimeout::try_from(MOUNT_TIMEOUT).unwrap_or(nix::poll::PollTimeout::MAX),
    );
    if waited.is_ok_and(|n| n == 0) {
        return Err(Failure::Node(format!(
            "{}: the node daemon started for it did not answer within {} s (stopped, or stuck?); see {}",
            socket.display(),
            MOUNT_TIMEOUT.as_secs(),
            log_path.display()
        )));
    }
    let mut answer = [0u8; 1];
    let exited = matches!(nix::unistd::read(&ready, &mut answer), Ok(0));
    Ok(exited.then(|| error_line(&log_path, logged_before)).flatten())
}

/// The last `error:` line of the log at `path` after its first `from` bytes (read up to 64 KiB).
fn error_line(path: &Path, from: u64) -> Option<String> {
    use std::io::{Seek, SeekFrom};
    let mut file = devremap::inputs::files::open_regular(path).ok()?;
    file.seek(SeekFrom::Start(from)).ok()?;
    let text = devremap::inputs::files::read_at_most(&mut file, 64 << 10).ok().flatten()?;
    let text = String::from_utf8_lossy(&text);
    // Escaped as it was written; the wrapper's own line escapes it again (found from outside:
    // each backslash doubled).
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix("error: "))
        .map(|l| devremap::decision::escape::unescape(l).into_owned())
}
