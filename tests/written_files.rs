//! The files `devremapd` writes (issue 9.2): the pid file, the state file and
//! `oci-patch --in-place` are replaced atomically, never through a symlink someone planted,
//! keep the replaced file's mode and owner, and leave no temporary file behind on any failure.

mod common;

use common::daemon::{
    Spawned, Tmpfs, has_thread, is_mounted, need_fuse, private_dir, private_mountpoint, wait_for, wait_for_or,
};
use common::{arg, empty_root, need_root, need_test_hooks};
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tempfile::TempDir;

/// The old temporary names were `.<name>.<pid>.tmp`; in a new pid namespace the command is
/// pid 1, so these are the names it would have used.
const PIDS: std::ops::RangeInclusive<u32> = 1..=16;

fn example_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config.json")
}

/// A root-only file (0600) that no write may touch.
fn secret(dir: &Path) -> PathBuf {
    let path = dir.join("secret");
    fs::write(&path, "root only\n").unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn assert_untouched(secret: &Path) {
    assert_eq!(fs::read_to_string(secret).unwrap(), "root only\n", "the secret was overwritten");
    assert_eq!(fs::metadata(secret).unwrap().mode() & 0o7777, 0o600, "the secret's mode changed");
}

/// Plants, as uid 65534, a symlink to `target` at every temporary name the old code would have
/// used for `name` (a symlink at `name` itself is refused: [`Planted`]).
fn plant(dir: &Path, name: &str, target: &Path) {
    for link in PIDS.map(|pid| format!(".{name}.{pid}.tmp")) {
        let link = dir.join(link);
        std::os::unix::fs::symlink(target, &link).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).unwrap();
    }
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// A directory owned by uid 65534, as a user's own directory where the operator put the files.
fn users_dir(tmp: &TempDir) -> PathBuf {
    let dir = tmp.path().join("users");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    dir
}

/// Bug (issue 9.2): the pid file, the state file and `oci-patch --in-place` were written through
/// `.NAME.PID.tmp`, opened with O_CREAT|O_TRUNC following symlinks, so a user who could write
/// in the directory made root overwrite any file (a 0600 root file became JSON, 0644). With
/// symlinks planted at every such name (the commands run as pid 1 of a new pid namespace, so
/// the names are the ones they would use), the root-only target is unchanged; the destinations
/// are regular files holding what was written. (A symlink at a destination itself is refused,
/// issue 29.4: [`what_is_not_a_regular_file_is_refused_as_an_output`].)
#[test]
#[ignore = "needs root and /dev/fuse"]
fn planted_symlinks_never_redirect_a_write() {
    need_fuse();
    let keep = private_dir();
    let secret = secret(keep.path());
    let tmp = TempDir::new().unwrap();
    let users = users_dir(&tmp);

    // oci-patch --in-place: the config itself is the user's.
    let config = users.join("config.json");
    fs::copy(example_config(), &config).unwrap();
    for pid in PIDS {
        let link = users.join(format!(".config.json.{pid}.tmp"));
        std::os::unix::fs::symlink(&secret, &link).unwrap();
    }
    let out = Command::new("unshare")
        .args([
            "-p",
            "-f",
            common::BIN,
            "oci-patch",
            arg(&config),
            "--dev",
            "/run/devremap/ctr1",
            "--allow-unmounted",
            "--in-place",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_untouched(&secret);
    assert!(fs::read_to_string(&config).unwrap().contains("/run/devremap/ctr1"));

    // mount: the pid file and the state file.
    plant(&users, "state.json", &secret);
    plant(&users, "d.pid", &secret);
    let mnt = keep.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let (state, pid_file) = (users.join("state.json"), users.join("d.pid"));
    // --kill-child: if the test ends unshare, the daemon gets SIGTERM too.
    let child = Command::new("unshare")
        .args(["-p", "-f", "--kill-child=SIGTERM", common::BIN, "mount", arg(&mnt), "--host-root", &empty_root()])
        .args(["--state-file", arg(&state), "--pid-file", arg(&pid_file)])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut unshare = Spawned::new(child, &mnt);
    let daemon: i32 = wait_for("the daemon in its pid namespace", || {
        let children = fs::read_to_string(format!("/proc/{0}/task/{0}/children", unshare.child.id())).ok()?;
        children.split_whitespace().next()?.parse().ok()
    });
    wait_for("the state file", || {
        assert!(unshare.child.try_wait().unwrap().is_none(), "the daemon exited");
        fs::symlink_metadata(&state).is_ok_and(|m| m.is_file()).then_some(())
    });
    assert_untouched(&secret);
    assert!(fs::symlink_metadata(&pid_file).unwrap().is_file(), "the pid file is a regular file");
    let written: serde_json::Value = serde_json::from_str(&fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(written["generation"], 1);
    // SAFETY: kill with the pid of our grandchild, read from /proc.
    unsafe { libc::kill(daemon, libc::SIGTERM) };
    assert!(wait_for("the daemon to exit", || unshare.child.try_wait().unwrap()).success());
    assert!(!is_mounted(&mnt), "the daemon left its mount");
    assert_untouched(&secret);
    let planted = |n: &String| fs::symlink_metadata(users.join(n)).unwrap().file_type().is_symlink();
    let left: Vec<String> = listing(&users).into_iter().filter(|n| !planted(n)).collect();
    assert_eq!(left, ["config.json"], "only the config is left (and the planted links)");
}

/// Rule (issue 9.2): a file `--in-place` replaces keeps its mode and owner: a 0640 config owned
/// by uid 65534 is still 0640 and 65534's after root patched it.
#[test]
#[ignore = "needs root (to chown)"]
fn oci_patch_in_place_keeps_mode_and_owner() {
    need_root();
    let tmp = TempDir::new().unwrap();
    let config = tmp.path().join("config.json");
    fs::copy(example_config(), &config).unwrap();
    fs::set_permissions(&config, fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::chown(&config, Some(65534), Some(65534)).unwrap();
    let out = Command::new(common::BIN)
        .args(["oci-patch", arg(&config), "--dev", "/run/devremap/ctr1", "--allow-unmounted", "--in-place"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta = fs::metadata(&config).unwrap();
    assert_eq!((meta.mode() & 0o7777, meta.uid(), meta.gid()), (0o640, 65534, 65534));
    assert!(fs::read_to_string(&config).unwrap().contains("/run/devremap/ctr1"));
    assert_eq!(listing(tmp.path()), ["config.json"]);
}

/// `devremapd mount` with its pid and state files in `files`, its log in `log`.
fn spawn_mount(mnt: &Path, files: &Path, log: &Path) -> Spawned {
    spawn_mount_with(mnt, files, log, &[])
}

fn spawn_mount_with(mnt: &Path, files: &Path, log: &Path, env: &[(&str, &str)]) -> Spawned {
    spawn_mount_command(mnt, files, log, env, &[])
}

/// [`spawn_mount`] with `extra` arguments.
fn spawn_mount_with_args(mnt: &Path, files: &Path, log: &Path, extra: &[&str]) -> Spawned {
    spawn_mount_command(mnt, files, log, &[], extra)
}

fn spawn_mount_command(mnt: &Path, files: &Path, log: &Path, env: &[(&str, &str)], extra: &[&str]) -> Spawned {
    let child = Command::new(common::BIN)
        .args(["mount", arg(mnt), "--host-root", &empty_root()])
        .args(["--state-file", arg(&files.join("state.json")), "--pid-file", arg(&files.join("d.pid"))])
        .args(extra)
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stderr(fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    Spawned::new(child, mnt)
}

/// Bug (issue 9.2): a write that failed (a full disk, at start or later) left its temporary
/// file behind: a partial one filling the disk, or `.d.pid.PID.tmp` after a failed start. On a
/// tiny tmpfs: a start whose state file does not fit fails (exit 1, no mount) and leaves only
/// what was there; a running daemon whose state file no longer fits (full disk, then a
/// read-only filesystem) logs it, keeps the old state file whole and leaves no temporary file.
/// The failed start never tells its starter it is ready. Bug (found from outside, 2026-12-05):
/// with the disk full, every write said so again (twice for a reload that changes the tree);
/// a failure is logged once, until a write succeeds, which is said once too.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn a_failed_write_leaves_no_temporary_file() {
    need_fuse();
    let (dir, mnt) = private_mountpoint();
    let log = dir.path().join("daemon.log");
    let tmpfs = Tmpfs::mount(&dir.path().join("fs"), "size=64k");
    let files = tmpfs.0.clone();

    // At start: room for the pid file (one page), none for the state file.
    tmpfs.fill("filler");
    let filler = files.join("filler");
    let full = fs::metadata(&filler).unwrap().len();
    fs::File::options().write(true).open(&filler).unwrap().set_len(full - 4096).unwrap();
    // Its starter's `--ready-fd` (inherited: no close-on-exec).
    let (ready, ready_write) = nix::unistd::pipe().unwrap();
    let ready_arg = ready_write.as_raw_fd().to_string();
    let mut mount = spawn_mount_with_args(&mnt, &files, &log, &["--ready-fd", &ready_arg]);
    drop(ready_write);
    let status = wait_for("the start to fail", || mount.child.try_wait().unwrap());
    let text = fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(text.contains("cannot write the state file: no space left on device\n"), "{text}");
    assert!(!is_mounted(&mnt));
    assert_eq!(listing(&files), ["filler"], "a failed start left files");
    // Never told it was ready (found from outside: told at the pid file, the node daemon let
    // the runtime run the container on the directory the failed start then unmounted).
    // Read without waiting: a process another test started meanwhile may hold the pipe too.
    nix::fcntl::fcntl(&ready, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).unwrap();
    let said = nix::unistd::read(&ready, &mut [0u8; 8]);
    assert!(
        matches!(said, Ok(0) | Err(nix::errno::Errno::EAGAIN)),
        "the starter was told the start was done: {said:?}"
    );

    // Later: a running daemon, then a full disk, then a read-only filesystem.
    fs::remove_file(&filler).unwrap();
    let mut mount = spawn_mount(&mnt, &files, &log);
    let state = files.join("state.json");
    wait_for("the state file", || {
        assert!(mount.child.try_wait().unwrap().is_none(), "{}", fs::read_to_string(&log).unwrap());
        state.exists().then_some(())
    });
    let before = fs::read_to_string(&state).unwrap();
    tmpfs.fill("filler");
    let hup = |failures: usize| {
        // SAFETY: kill with our child's pid.
        unsafe { libc::kill(mount.child.id() as libc::pid_t, libc::SIGHUP) };
        wait_for("the failed write to be logged", || {
            let text = fs::read_to_string(&log).unwrap();
            (text.matches("cannot write the state file").count() >= failures).then_some(text)
        })
    };
    let text = hup(1);
    assert!(text.contains("cannot write the state file: no space left on device\n"), "{text}");
    assert_eq!(fs::read_to_string(&state).unwrap(), before, "the old state file is whole");
    assert_eq!(listing(&files), ["d.pid", "filler", "state.json"], "a failed write left files");
    // The same failure again is not logged again: each reload wrote, and failed, once more.
    let server = serde_json::from_str::<serde_json::Value>(&before).unwrap()["server_pid"].as_u64().unwrap() as u32;
    let reloaded = |text: &str| text.matches("reloaded: generation").count();
    let reloads = reloaded(&text);
    for more in 1..=3 {
        // SAFETY: kill with our child's pid.
        unsafe { libc::kill(mount.child.id() as libc::pid_t, libc::SIGHUP) };
        wait_for("the reload", || (reloaded(&fs::read_to_string(&log).unwrap()) >= reloads + more).then_some(()));
    }
    wait_for("the state file's writes to be done", || (!has_thread(server, "state")).then_some(()));
    fs::remove_file(&filler).unwrap();
    tmpfs.remount("ro");
    let text = hup(2);
    assert!(text.contains("cannot write the state file: read-only file system\n"), "{text}");
    assert_eq!(text.matches("no space left on device").count(), 1, "a failure logged at every write: {text}");
    assert_eq!(listing(&files), ["d.pid", "state.json"]);
    tmpfs.remount("rw");
    // SAFETY: kill with our child's pid.
    unsafe { libc::kill(mount.child.id() as libc::pid_t, libc::SIGHUP) };
    let text = wait_for("the state file to be written again", || {
        let text = fs::read_to_string(&log).unwrap();
        text.contains("state.json: the state file is written again").then_some(text)
    });
    assert_ne!(fs::read_to_string(&state).unwrap(), before, "{text}");
    assert!(mount.stop().success());
    assert!(listing(&files).is_empty(), "the daemon left files: {:?}", listing(&files));
}

/// Bug (found attacking the written files): a server killed between its temporary state file
/// and the rename left `.state.json.<random>.tmp` for good; the keeper started a new server,
/// and its stop removed the state file but not that. Temporary names now carry the writer's
/// pid, and the keeper removes what a server left between its exit and its reaping. Only that:
/// a file another user made under the dead server's temporary name and a symlink there are
/// kept (a first fix matched the file's inode, which the filesystem hands out again, and removed
/// other users' files and a live server's temporary file).
#[test]
#[ignore = "needs root and /dev/fuse"]
fn a_server_killed_while_writing_the_state_file_leaves_no_temporary_file() {
    need_fuse();
    need_test_hooks();
    let (dir, mnt) = private_mountpoint();
    let files = dir.path().join("files");
    fs::create_dir(&files).unwrap();
    let (log, marker) = (dir.path().join("daemon.log"), dir.path().join("killed"));
    let hook = format!("die-writing-state:{}", marker.display());
    let mut mount = spawn_mount_with(&mnt, &files, &log, &[("DEVREMAPD_FAILPOINT", &hook)]);
    let state = files.join("state.json");
    let server = || -> Option<u64> {
        let text = fs::read_to_string(&state).ok()?;
        serde_json::from_str::<serde_json::Value>(&text).ok()?["server_pid"].as_u64()
    };
    let first = wait_for("the state file", || {
        assert!(mount.child.try_wait().unwrap().is_none(), "{}", fs::read_to_string(&log).unwrap());
        server()
    });
    let theirs = files.join(format!(".state.json.{first}.theirs.tmp"));
    fs::write(&theirs, "").unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let link = files.join(format!(".state.json.{first}.link.tmp"));
    std::os::unix::fs::symlink(&state, &link).unwrap();
    let planted = [link.file_name().unwrap().to_str().unwrap(), theirs.file_name().unwrap().to_str().unwrap()];
    // SAFETY: kill with our child's pid.
    unsafe { libc::kill(mount.child.id() as libc::pid_t, libc::SIGHUP) };
    // The reload's server is killed with its temporary file there; the next one serves.
    wait_for("a server after the one killed while writing", || (marker.exists() && server()? != first).then_some(()));
    let text = fs::read_to_string(&log).unwrap();
    assert!(text.contains("failpoint die-writing-state: killed before the rename"), "{text}");
    let expected = [planted[0], planted[1], "d.pid", "state.json"];
    let left = || format!("{:?}", listing(&files));
    wait_for_or("the killed server's temporary file to go", left, || (listing(&files) == expected).then_some(()));
    assert!(mount.stop().success());
    assert_eq!(listing(&files), planted, "the daemon left files, or removed what it did not make");
}

/// What a test puts where devremap writes a file (issue 29.4): a char device (a copy of
/// `/dev/null`'s 1:3), a FIFO, a symlink to a root-only file, a directory holding a file.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Planted {
    CharDevice,
    Fifo,
    Symlink,
    Directory,
}

impl Planted {
    const ALL: [Planted; 4] = [Planted::CharDevice, Planted::Fifo, Planted::Symlink, Planted::Directory];

    /// Puts it at `path`; a symlink points at `secret`.
    fn plant(self, path: &Path, secret: &Path) {
        match self {
            Planted::CharDevice => common::mknod_char(path, (1, 3), 0o666),
            Planted::Fifo => nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap(),
            Planted::Symlink => std::os::unix::fs::symlink(secret, path).unwrap(),
            Planted::Directory => {
                fs::create_dir(path).unwrap();
                fs::write(path.join("inside"), "kept\n").unwrap();
            }
        }
    }

    fn what(self) -> &'static str {
        match self {
            Planted::CharDevice => "a char device",
            Planted::Fifo => "a FIFO",
            Planted::Symlink => "a symlink",
            Planted::Directory => "a directory",
        }
    }

    /// Why a write refuses it.
    fn refused(self) -> String {
        format!("is {}, not a regular file; refused: devremap replaces its output files", self.what())
    }

    /// The refusal naming `path`, as a command's error line says it.
    fn refusal(self, path: &Path) -> String {
        format!("{}: {}", path.display(), self.refused())
    }
}

/// What is at `path`, not followed: its identity, type and mode, device number, a symlink's
/// target and a directory's names; equal before and after means untouched.
fn snapshot(path: &Path) -> (u64, u64, u32, u64, Option<PathBuf>, Vec<String>) {
    let meta = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: gone: {e}", path.display()));
    let target = meta.file_type().is_symlink().then(|| fs::read_link(path).unwrap());
    let names = if meta.is_dir() { listing(path) } else { Vec::new() };
    (meta.dev(), meta.ino(), meta.mode(), meta.rdev(), target, names)
}

/// Runs devremapd with `args`: (exit status, stderr).
fn run_devremapd(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(common::BIN).args(args).env_remove("RUST_LOG").output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Bug (issue 29.4): `record --output P`, `oci-patch P --in-place`, `mount --pid-file P` and
/// `mount --state-file P` turned a char device, FIFO or symlink at P into a regular 0644 file
/// (`--output /dev/null` would replace the host's node; a FIFO blocked `oci-patch`). Each is
/// now refused before anything is done: exit 1, one error line naming the path and what is
/// there, no mount, and what was planted is still there, unchanged, as is the symlink's target.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn what_is_not_a_regular_file_is_refused_as_an_output() {
    need_fuse();
    let (dir, mnt) = private_mountpoint();
    let secret = secret(dir.path());
    let spec = dir.path().join("spec.json");
    fs::copy(example_config(), &spec).unwrap();
    let root = empty_root();
    for planted in Planted::ALL {
        let path = dir.path().join("out");
        planted.plant(&path, &secret);
        let before = snapshot(&path);
        let p = arg(&path);
        let m = arg(&mnt);
        let commands: [(&str, Vec<&str>); 4] = [
            ("record --output", vec!["record", "--spec", arg(&spec), "--host-root", &root, "--output", p]),
            (
                "oci-patch --in-place",
                vec!["oci-patch", p, "--dev", "/run/devremap/c", "--allow-unmounted", "--in-place"],
            ),
            ("mount --pid-file", vec!["mount", m, "--host-root", &root, "--pid-file", p]),
            ("mount --state-file", vec!["mount", m, "--host-root", &root, "--state-file", p]),
        ];
        for (command, args) in commands {
            let (code, stderr) = run_devremapd(&args);
            let case = format!("{command} onto {}", planted.what());
            assert_eq!(code, Some(1), "{case}: {stderr}");
            assert_eq!(stderr, format!("error: {}\n", planted.refusal(&path)), "{case}");
            assert_eq!(snapshot(&path), before, "{case}: what was there changed");
            assert!(!is_mounted(&mnt), "{case}: mounted");
            assert_untouched(&secret);
        }
        assert_eq!(listing(dir.path()), ["mnt", "out", "secret", "spec.json"], "{}: files left", planted.what());
        if planted == Planted::Directory {
            fs::remove_dir_all(&path).unwrap();
        } else {
            fs::remove_file(&path).unwrap();
        }
    }
}

/// Bug (issue 29.4): a running daemon's state file replaced by a node, FIFO, symlink or
/// directory was turned back into a regular file at the next reload or upgrade, and a stop
/// then removed it. Each is refused at every write (a reload's, an upgrade's new server's),
/// logged naming the path and what is there, and left as it is by the stop, as is a FIFO put
/// in the pid file's place: the daemon removes only the files it wrote.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn a_running_daemon_never_replaces_nor_removes_what_was_put_at_its_files() {
    need_fuse();
    let (dir, mnt) = private_mountpoint();
    let secret = secret(dir.path());
    let files = dir.path().join("files");
    fs::create_dir(&files).unwrap();
    let log = dir.path().join("daemon.log");
    let mut mount = spawn_mount(&mnt, &files, &log);
    let (state, pid_file) = (files.join("state.json"), files.join("d.pid"));
    wait_for("the state file", || {
        assert!(mount.child.try_wait().unwrap().is_none(), "{}", fs::read_to_string(&log).unwrap());
        state.exists().then_some(())
    });
    let signal = |sig| {
        // SAFETY: kill with our child's pid.
        unsafe { libc::kill(mount.child.id() as libc::pid_t, sig) };
    };
    for (planted, how) in Planted::ALL.iter().flat_map(|p| [(*p, libc::SIGHUP), (*p, libc::SIGUSR2)]) {
        let _ = fs::remove_file(&state);
        let _ = fs::remove_dir_all(&state);
        planted.plant(&state, &secret);
        let before = snapshot(&state);
        let line = format!("{}: cannot write the state file: {}", state.display(), planted.refused());
        let logged = || fs::read_to_string(&log).unwrap().matches(&line).count();
        let earlier = logged();
        signal(how);
        let case = format!("{} at the state file, signal {how}", planted.what());
        wait_for_or(
            &format!("{case}: the refusal to be logged"),
            || fs::read_to_string(&log).unwrap(),
            || (logged() > earlier).then_some(()),
        );
        assert_eq!(snapshot(&state), before, "{case}: what was there changed");
        assert_untouched(&secret);
    }
    fs::remove_file(&pid_file).unwrap();
    Planted::Fifo.plant(&pid_file, &secret);
    let fifo = snapshot(&pid_file);
    let planted = snapshot(&state);
    assert!(mount.stop().success(), "{}", fs::read_to_string(&log).unwrap());
    assert_eq!(snapshot(&pid_file), fifo, "the stop removed the FIFO at the pid file");
    assert_eq!(snapshot(&state), planted, "the stop removed what was at the state file");
    assert_untouched(&secret);
    assert_eq!(listing(&files), ["d.pid", "state.json"], "files left");
}

/// Rule (issue 29.4, held when attacked from outside): `record --output` refuses the kinds
/// [`what_is_not_a_regular_file_is_refused_as_an_output`] does not plant (a block device, a
/// socket, a dangling symlink, a symlink to `/dev/null` as `--output /dev/null` would be, a
/// symlink to a directory), each named, exit 1, left as it was, no temporary file; a hard link
/// to a root-only file is a regular file, so its name is replaced by the rename and the file it
/// shared an inode with keeps its content, mode and its other name.
#[test]
#[ignore = "needs root (mknod)"]
fn record_refuses_every_other_kind_and_never_writes_through_a_hard_link() {
    need_root();
    let dir = TempDir::new().unwrap();
    let secret = secret(dir.path());
    let spec = dir.path().join("spec.json");
    fs::copy(example_config(), &spec).unwrap();
    fs::create_dir(dir.path().join("sub")).unwrap();
    let path = dir.path().join("out");
    let record = |path: &Path| {
        run_devremapd(&["record", "--spec", arg(&spec), "--host-root", &empty_root(), "--output", arg(path)])
    };
    type Plant = fn(&Path, &Path);
    let kinds: [(&str, Plant); 5] = [
        ("a block device", |p, _| {
            nix::sys::stat::mknod(
                p,
                nix::sys::stat::SFlag::S_IFBLK,
                nix::sys::stat::Mode::from_bits_truncate(0o600),
                nix::sys::stat::makedev(7, 250),
            )
            .unwrap()
        }),
        ("a socket", |p, _| drop(std::os::unix::net::UnixListener::bind(p).unwrap())),
        ("a symlink", |p, d| std::os::unix::fs::symlink(d.join("nowhere"), p).unwrap()),
        ("a symlink", |p, _| std::os::unix::fs::symlink("/dev/null", p).unwrap()),
        ("a symlink", |p, d| std::os::unix::fs::symlink(d.join("sub"), p).unwrap()),
    ];
    for (what, plant) in kinds {
        plant(&path, dir.path());
        let before = snapshot(&path);
        let (code, stderr) = record(&path);
        assert_eq!(code, Some(1), "{what}: {stderr}");
        let refusal =
            format!("{}: is {what}, not a regular file; refused: devremap replaces its output files", path.display());
        assert_eq!(stderr, format!("error: {refusal}\n"), "{what}");
        assert_eq!(snapshot(&path), before, "{what}: what was there changed");
        assert_eq!(listing(dir.path()), ["out", "secret", "spec.json", "sub"], "{what}: files left");
        assert!(listing(&dir.path().join("sub")).is_empty(), "{what}: written through");
        fs::remove_file(&path).unwrap();
    }
    assert_untouched(&secret);

    fs::hard_link(&secret, &path).unwrap();
    let (code, stderr) = record(&path);
    assert_eq!(code, Some(0), "{stderr}");
    assert_untouched(&secret);
    let (out, kept) = (fs::symlink_metadata(&path).unwrap(), fs::metadata(&secret).unwrap());
    assert_ne!(out.ino(), kept.ino(), "the record was written into the hard link's inode");
    assert_eq!((out.nlink(), kept.nlink()), (1, 1));
    assert!(fs::read_to_string(&path).unwrap().contains("\"minor\""), "no record written");
}

/// Bug (found from outside, 2026-12-05): a pid file inside the mountpoint was written through
/// the mount the keeper serves, and once the keeper relayed on its main thread that write
/// waited on that very thread for good: the mount hung and SIGTERM went unheard. A state file
/// there cost the server its life without a word and left the keeper a zombie. Both are
/// refused before anything is mounted, naming the flag, the path and the mountpoint, also
/// through a symlinked directory.
#[test]
#[ignore = "needs root and /dev/fuse"]
fn a_pid_or_state_file_inside_the_mountpoint_is_refused() {
    need_fuse();
    let (dir, mnt) = private_mountpoint();
    let files = dir.path().join("files");
    fs::create_dir(&files).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&mnt, &link).unwrap();
    let cases = [
        ("--pid-file", mnt.join("keeper.pid")),
        ("--state-file", mnt.join("state.json")),
        ("--pid-file", link.join("keeper.pid")),
        ("--state-file", mnt.join("sub").join("state.json")),
    ];
    for (flag, inside) in cases {
        let log = dir.path().join("daemon.log");
        let (pid_file, state_file) = match flag {
            "--pid-file" => (inside.clone(), files.join("state.json")),
            _ => (files.join("d.pid"), inside.clone()),
        };
        let child = Command::new(common::BIN)
            .args(["mount", arg(&mnt), "--host-root", &empty_root()])
            .args(["--pid-file", arg(&pid_file), "--state-file", arg(&state_file)])
            .env_remove("RUST_LOG")
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut mount = Spawned::new(child, &mnt);
        let status = wait_for("the start to be refused", || mount.child.try_wait().unwrap());
        let text = fs::read_to_string(&log).unwrap();
        assert_eq!(status.code(), Some(1), "{flag} {}: {text}", inside.display());
        let said = format!("{flag} {}: inside the mountpoint {}", inside.display(), mnt.display());
        assert!(text.contains(&said), "{said}: {text}");
        assert!(!is_mounted(&mnt), "{flag} {}: a refused start left a mount", inside.display());
        assert_eq!(listing(&files), Vec::<String>::new(), "a refused start wrote files");
    }
}
