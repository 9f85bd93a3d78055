//! `devremapd parked`: a keeper, or a keeper's server, started before the container it will
//! serve is known, so that the container's start does not wait for its execs (issues 31 and
//! 32: the keeper's and the server's exec and start were about 3.5 ms of the node daemon's
//! 7.7 ms mount). The node daemon keeps one spare keeper (`parked --spare-server`, see
//! `node/spare.rs`), which starts its own server parked in turn; a mount hands the spare its
//! command line and descriptors in one message (a *parcel*) on its fd 0, and the keeper hands
//! its first server its own the same way.
//!
//! Once it has its parcel a parked process is the daemon its command line names, to everyone:
//! `/proc/PID/cmdline` is rewritten to that command line (`PR_SET_MM_MAP`, as CRIU restores a
//! process's), so `ps` shows the mountpoint, and a teardown finds it
//! (`Container::daemon_pid` signals only a process whose command line names the container's
//! mountpoint), exactly as for a keeper started directly. A parked process that cannot rewrite
//! its command line refuses at once, before any parcel, and the node daemon then starts
//! keepers directly.
//!
//! Assumptions: the parcel comes from the process that started us, over a socket pair whose
//! other end only it holds, so no one else can send one; that end closing (EOF) means none
//! will come, and the parked process exits quietly. A parcel is one `SOCK_SEQPACKET` message:
//! its words, each ending in NUL, and up to two descriptors (the log, then a keeper's ready
//! pipe).

use crate::cli::{Cli, Command, ParkedArgs};
use crate::keeper::{self, KeeperError, Parked, ParkedServer};
use crate::signals;
use clap::Parser;
use devremap::io_message;
use devremap::procfs::Stat;
use devremap::report::Failure;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use std::ffi::OsString;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

/// The most a parcel's words may take (a keeper's command line is about 1 KiB).
const MOST_BYTES: usize = 64 * 1024;
/// The most descriptors a parcel carries: the log, and a keeper's ready pipe.
const MOST_FDS: usize = 2;

/// Why a parked process did not become the daemon its parcel names.
#[derive(Debug, thiserror::Error)]
pub enum ParkedError {
    #[error("parked: cannot read its command line on fd 0: {}", io_message(.0))]
    Receive(io::Error),
    #[error("parked: its parcel came cut short (at most {MOST_BYTES} bytes and {MOST_FDS} descriptors)")]
    Truncated,
    #[error("parked: its parcel is not a command line (words ending in NUL, a log first)")]
    Malformed,
    #[error("parked: cannot take its log as stdout and stderr: {}", io_message(.0))]
    Log(io::Error),
    #[error("parked: cannot rewrite its command line (PR_SET_MM_MAP, which needs CONFIG_CHECKPOINT_RESTORE): {}", io_message(.0))]
    Cmdline(io::Error),
    #[error("parked: it runs `mount` or `serve`, not `{0}`")]
    NotDaemon(String),
    #[error("parked: {0}")]
    Flags(String),
    #[error(transparent)]
    Keeper(#[from] KeeperError),
    #[error(transparent)]
    Zygote(#[from] crate::zygote::ZygoteError),
    #[error("parked: {0}")]
    Signals(crate::signals::SignalsError),
}

impl From<ParkedError> for Failure {
    fn from(e: ParkedError) -> Failure {
        match e {
            ParkedError::Keeper(e) => e.into(),
            e => Failure::from(e.to_string()),
        }
    }
}

/// A parked process before its parcel: the name it will be run by (its `argv[0]`), and, in a
/// spare keeper, its parked server.
pub struct Started {
    argv0: OsString,
    server: Option<ParkedServer>,
}

/// `devremapd parked`, up to its parcel: its command line rewritten, and with `--spare-server`
/// its server forked ([`keeper::park_server`]; the forked server goes on as a parked server
/// spawned would, named `devremapd` as a spawned server is). Called before the process's
/// second thread (the log writer) starts.
pub fn start(args: &ParkedArgs) -> Result<Started, ParkedError> {
    let argv0 = std::env::args_os().next().unwrap_or_else(|| "devremapd".into());
    // Refused here, before any parcel, rather than after: a daemon that could not be told
    // from another by its command line must never start.
    set_cmdline(&[argv0.clone(), "parked".into()]).map_err(ParkedError::Cmdline)?;
    if !args.spare_server {
        return Ok(Started { argv0, server: None });
    }
    match keeper::park_server()? {
        Parked::Keeper(server) => Ok(Started { argv0, server: Some(server) }),
        Parked::Server => {
            let argv0 = OsString::from("devremapd");
            set_cmdline(&[argv0.clone(), "parked".into()]).map_err(ParkedError::Cmdline)?;
            Ok(Started { argv0, server: None })
        }
    }
}

/// `devremapd parked`, once [`start`]ed: waits for its parcel and runs what it names.
pub fn run(started: Result<Started, ParkedError>) -> Result<(), Failure> {
    let Started { argv0, server } = started?;
    // SAFETY: fd 0 is the parcel socket our starter gave us; nothing else here uses it.
    let socket = unsafe { OwnedFd::from_raw_fd(0) };
    // Parked, a signal takes its default action (a spare that was told to end must not end the
    // container it is handed next); from the parcel on, the daemon's signals are its own.
    signals::unblock().map_err(ParkedError::Signals)?;
    let parcel = receive(&socket)?;
    signals::block().map_err(ParkedError::Signals)?;
    let Some((mut words, mut fds)) = parcel else { return Ok(()) };
    drop(socket);
    let log = fds.next().ok_or(ParkedError::Malformed)?;
    take_standard_fds(log).map_err(ParkedError::Log)?;
    // The container's log, most often a file on /run: its lines may be written at once.
    crate::logging::stderr_replaced();
    if let Some(ready) = fds.next() {
        // A keeper's ready pipe: its `--ready-fd`, claimed as when inherited.
        words.extend(["--ready-fd".into(), ready.into_raw_fd().to_string().into()]);
    }
    let what = words.first().map(|w| w.to_string_lossy().into_owned()).unwrap_or_default();
    if what != "mount" && what != "serve" {
        return Err(ParkedError::NotDaemon(what).into());
    }
    let argv: Vec<OsString> = std::iter::once(argv0).chain(words.iter().cloned()).collect();
    set_cmdline(&argv).map_err(ParkedError::Cmdline)?;
    let cli = Cli::try_parse_from(&argv).map_err(|e| {
        let text = e.render().to_string();
        ParkedError::Flags(text.lines().next().unwrap_or_default().trim_start_matches("error: ").to_owned())
    })?;
    match cli.command {
        Command::Mount(mount) => keeper::run(&mount, words.split_off(1), server).map_err(Failure::from),
        Command::Serve(serve) => crate::server::run(&serve),
        _ => Err(ParkedError::NotDaemon(what).into()),
    }
}

/// A parcel's words, encoded: each ends in NUL. Refused, as `exec` refuses them, when a word
/// holds a NUL (which would split it into words of the sender's choosing: a flag smuggled into
/// an argument) or they take more than [`MOST_BYTES`]; checked before a spare is taken, so a bad
/// command line never costs one.
pub struct Words(Vec<u8>);

impl Words {
    pub fn encode(words: &[OsString]) -> io::Result<Words> {
        let bytes = nul_terminated(words)?;
        if bytes.len() > MOST_BYTES {
            return Err(io::Error::other(ParkedError::Truncated));
        }
        Ok(Words(bytes))
    }
}

/// `words`, each ending in NUL; refused when one holds a NUL.
fn nul_terminated(words: &[OsString]) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    for word in words {
        if word.as_bytes().contains(&0) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an argument holds a NUL byte"));
        }
        bytes.extend_from_slice(word.as_bytes());
        bytes.push(0);
    }
    Ok(bytes)
}

/// Sends a parcel: `words` (a command line after the program's name) and `fds`.
pub fn send(to: BorrowedFd, words: &Words, fds: &[RawFd]) -> io::Result<()> {
    if fds.len() > MOST_FDS {
        return Err(io::Error::other(ParkedError::Truncated));
    }
    let rights = [ControlMessage::ScmRights(fds)];
    let sent = sendmsg::<()>(to.as_raw_fd(), &[IoSlice::new(&words.0)], &rights, MsgFlags::MSG_NOSIGNAL, None)?;
    if sent == words.0.len() { Ok(()) } else { Err(io::Error::other(ParkedError::Truncated)) }
}

/// A parcel received: its words, and its descriptors in the order sent.
type Parcel = (Vec<OsString>, std::vec::IntoIter<OwnedFd>);

/// Waits for the parcel on `socket`; `None` at EOF (our starter went: none will come).
fn receive(socket: &OwnedFd) -> Result<Option<Parcel>, ParkedError> {
    let mut bytes = vec![0u8; MOST_BYTES + 1];
    let mut space = nix::cmsg_space!([RawFd; MOST_FDS]);
    let (len, flags, fds) =
        receive_rights(socket.as_raw_fd(), &mut bytes, &mut space).map_err(|e| ParkedError::Receive(e.into()))?;
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    if flags.intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC) || len > MOST_BYTES {
        return Err(ParkedError::Truncated);
    }
    let Some(body) = bytes[..len].strip_suffix(&[0]) else { return Err(ParkedError::Malformed) };
    let words = body.split(|&b| b == 0).map(|w| OsString::from_vec(w.to_vec())).collect();
    Ok(Some((words, fds.into_iter())))
}

/// One message received on `socket` into `bytes`, with the descriptors it carries
/// (`SCM_RIGHTS`, room for them in `space`), ours and closed on exec; EINTR is retried. Its
/// length and flags (`MSG_TRUNC`, `MSG_CTRUNC`) are the caller's to judge. Also the zygote's.
pub fn receive_rights(
    socket: RawFd,
    bytes: &mut [u8],
    space: &mut Vec<u8>,
) -> nix::Result<(usize, MsgFlags, Vec<OwnedFd>)> {
    loop {
        let mut iov = [IoSliceMut::new(&mut *bytes)];
        match recvmsg::<()>(socket, &mut iov, Some(&mut *space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for cmsg in msg.cmsgs()? {
                    if let ControlMessageOwned::ScmRights(rights) = cmsg {
                        // SAFETY: the kernel gave us these descriptors, ours alone.
                        fds.extend(rights.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                    }
                }
                return Ok((msg.bytes, msg.flags, fds));
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Makes `log` our stdout and stderr (where the log writer writes) and `/dev/null` our stdin
/// (the parcel socket's number, closed by then), as for a daemon spawned with them.
///
/// Bug (found from outside): `/dev/null`, opened into the free number 0, was closed again as
/// its `File` went, leaving fd 0 to the next socket the keeper or server made, where a direct
/// start has `/dev/null`.
fn take_standard_fds(log: OwnedFd) -> io::Result<()> {
    let null = std::fs::File::open("/dev/null")?;
    for (from, to) in [(null.as_raw_fd(), 0), (log.as_raw_fd(), 1), (log.as_raw_fd(), 2)] {
        // SAFETY: dup2 onto a standard fd; both are open, and the standard fds are ours to set.
        if unsafe { libc::dup2(from, to) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    if null.as_raw_fd() == 0 {
        // Our stdin itself: kept open for the process's life.
        let _ = null.into_raw_fd();
    }
    Ok(())
}

/// The kernel's `struct prctl_mm_map` (`linux/prctl.h`): a process's memory layout, as
/// `PR_SET_MM_MAP` sets it whole.
#[repr(C)]
struct MmMap {
    start_code: u64,
    end_code: u64,
    start_data: u64,
    end_data: u64,
    start_brk: u64,
    brk: u64,
    start_stack: u64,
    arg_start: u64,
    arg_end: u64,
    env_start: u64,
    env_end: u64,
    auxv: *mut u64,
    auxv_size: u32,
    exe_fd: u32,
}

/// `PR_SET_MM_MAP`, which `libc` does not name.
const PR_SET_MM_MAP: libc::c_ulong = 14;

/// Makes `/proc/self/cmdline` read `argv` (each word NUL-terminated), from a buffer kept for
/// the process's life: the layout is read from `/proc/self/stat` and set back whole with the
/// command line's bounds moved (`PR_SET_MM_MAP`, as CRIU restores a process; unlike the
/// single-field `PR_SET_MM` calls it needs no `CAP_SYS_RESOURCE`, only
/// `CONFIG_CHECKPOINT_RESTORE`). Called while no other thread allocates (before the log writer
/// starts, or, for a parcel's command line, while it waits): the break read here is still the
/// break when the layout is set.
fn set_cmdline(argv: &[OsString]) -> io::Result<()> {
    let kept: &'static [u8] = Box::leak(nul_terminated(argv)?.into_boxed_slice());
    let stat = Stat::of("self").ok_or_else(|| io::Error::other("/proc/self/stat unreadable"))?;
    let field = |n: usize| stat.number(n).ok_or_else(|| io::Error::other("/proc/self/stat too short"));
    // SAFETY: sbrk(0) only reads the current break.
    let brk = unsafe { libc::sbrk(0) } as u64;
    let map = MmMap {
        start_code: field(26)?,
        end_code: field(27)?,
        start_data: field(45)?,
        end_data: field(46)?,
        start_brk: field(47)?,
        brk,
        start_stack: field(28)?,
        arg_start: kept.as_ptr() as u64,
        arg_end: kept.as_ptr() as u64 + kept.len() as u64,
        env_start: field(50)?,
        env_end: field(51)?,
        auxv: std::ptr::null_mut(),
        auxv_size: 0,
        exe_fd: u32::MAX,
    };
    // SAFETY: the kernel copies `map` in and checks it; every field is the process's own value
    // but the command line's bounds, which name memory kept for the process's life.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_MM,
            PR_SET_MM_MAP,
            &map as *const MmMap as libc::c_ulong,
            std::mem::size_of::<MmMap>() as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}
