//! Throwaway prototype for issue 13: a keeper that holds /dev/fuse and relays whole messages to
//! a server (fuser Session::from_fd on a SOCK_SEQPACKET end), replaying INIT and in-flight
//! requests to a successor when the server dies.
use devremap::adapter::Adapter;
use devremap::device::{Access, DevKind, Rdev};
use devremap::served::Devfs;
use devremap::tree::{Node, TreeBuilder};
use fuser::{Config, Session, SessionACL};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair, setsockopt, sockopt};
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FUSE_INIT: u32 = 26;
const FUSE_FORGET: u32 = 2;
const FUSE_BATCH_FORGET: u32 = 42;
const FUSE_INTERRUPT: u32 = 36;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args[1].as_str() {
        "keeper" => keeper(&args[2], &args[3]),
        "server" => server(),
        _ => panic!("keeper MNT PIDFILE | server"),
    }
}

fn server() {
    // SAFETY: the keeper passes the socket as fd 3.
    let fd = unsafe { OwnedFd::from_raw_fd(3) };
    let mut b = TreeBuilder::default();
    b.insert("null", Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
    b.insert("zero", Node::device(DevKind::Char, Rdev::new(1, 5), Access::DEVICE_DEFAULT)).unwrap();
    for i in 0..8 {
        b.insert(&format!("nvidia{i}"), Node::device(DevKind::Char, Rdev::new(1, 3), Access::DEVICE_DEFAULT)).unwrap();
    }
    b.insert("fd", Node::symlink("/proc/self/fd")).unwrap();
    b.mkdir_all("pts").unwrap();
    let devfs = Arc::new(Devfs::new(b.build()));
    let adapter = Adapter::new(devfs, Duration::ZERO, None);
    let mut config = Config::default();
    config.n_threads = Some(2);
    let session = Session::from_fd(adapter, fd, SessionACL::All, config).expect("handshake");
    let r = session.run();
    eprintln!("server {}: session ended: {r:?}", std::process::id());
}

fn spawn_server() -> (Child, OwnedFd) {
    let (mine, theirs) =
        socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
    for fd in [&mine, &theirs] {
        setsockopt(fd, sockopt::SndBuf, &(4 << 20)).unwrap();
        setsockopt(fd, sockopt::RcvBuf, &(4 << 20)).unwrap();
    }
    let raw = theirs.as_raw_fd();
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg("server");
    // SAFETY: dup2 is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    (child, mine)
}

fn keeper(mnt: &str, pidfile: &str) {
    if std::env::var("POLL").is_ok() {
        return keeper_poll(mnt, pidfile);
    }
    let dev = Arc::new(mount(mnt));
    let (child, sock) = spawn_server();
    write_pid(pidfile, &child);
    struct Shared {
        sock: Arc<OwnedFd>,
        inflight: HashMap<u64, Vec<u8>>,
        init: Option<Vec<u8>>,
    }
    let shared = Arc::new(std::sync::Mutex::new(Shared { sock: Arc::new(sock), inflight: HashMap::new(), init: None }));
    // kernel -> server
    let (d, sh) = (dev.clone(), shared.clone());
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 << 20 | 4096];
        loop {
            let n = match nix::unistd::read(&*d, &mut buf) {
                Ok(n) => n,
                Err(nix::errno::Errno::ENODEV) => std::process::exit(0),
                Err(_) => continue,
            };
            let opcode = u32::from_ne_bytes(buf[4..8].try_into().unwrap());
            let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
            let sock = {
                let mut g = sh.lock().unwrap();
                if opcode == FUSE_INIT {
                    g.init = Some(buf[..n].to_vec());
                }
                if ![FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT].contains(&opcode) {
                    g.inflight.insert(unique, buf[..n].to_vec());
                }
                g.sock.clone()
            };
            // A dead server: the reply thread resends what is in flight to the next one.
            let _ = nix::unistd::write(&*sock, &buf[..n]);
        }
    });
    // server -> kernel
    let mut child = child;
    let mut buf = vec![0u8; 16 << 20 | 4096];
    let mut swallow = None;
    let mut restarts = 0;
    let mut died_at: Option<Instant> = None;
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(format!("{pidfile}.log")).unwrap();
    loop {
        let sock = shared.lock().unwrap().sock.clone();
        match nix::unistd::read(&*sock, &mut buf) {
            Ok(n) if n > 0 => {
                let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
                if unique != 0 && swallow == Some(unique) {
                    swallow = None;
                    if let Some(t) = died_at.take() {
                        writeln!(log, "restart {restarts}: init replayed after {:?}", t.elapsed()).unwrap();
                    }
                    continue;
                }
                if unique != 0 {
                    shared.lock().unwrap().inflight.remove(&unique);
                }
                let _ = nix::unistd::write(&*dev, &buf[..n]);
            }
            _ => {
                died_at = Some(Instant::now());
                let _ = child.wait();
                restarts += 1;
                let (c, s) = spawn_server();
                child = c;
                let mut g = shared.lock().unwrap();
                g.sock = Arc::new(s);
                if let Some(init) = &g.init {
                    swallow = Some(u64::from_ne_bytes(init[8..16].try_into().unwrap()));
                    nix::unistd::write(&*g.sock, init).unwrap();
                }
                for msg in g.inflight.values() {
                    let _ = nix::unistd::write(&*g.sock, msg);
                }
                writeln!(log, "restart {restarts}: resent {} in flight", g.inflight.len()).unwrap();
                drop(g);
                write_pid(pidfile, &child);
            }
        }
    }
}

fn mount(mnt: &str) -> std::fs::File {
    let dev = OpenOptions::new().read(true).write(true).open("/dev/fuse").unwrap();
    let opts = format!("fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other", dev.as_raw_fd());
    use nix::mount::MsFlags;
    nix::mount::mount(
        Some("devremap"),
        mnt,
        Some("fuse"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NOATIME,
        Some(opts.as_str()),
    )
    .unwrap();
    dev
}

fn keeper_poll(mnt: &str, pidfile: &str) {
    let dev = OpenOptions::new().read(true).write(true).open("/dev/fuse").unwrap();
    let opts = format!("fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other", dev.as_raw_fd());
    use nix::mount::MsFlags;
    nix::mount::mount(
        Some("devremap"),
        mnt,
        Some("fuse"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NOATIME,
        Some(opts.as_str()),
    )
    .unwrap();
    let (mut child, mut sock) = spawn_server();
    write_pid(pidfile, &child);
    let mut init: Option<Vec<u8>> = None;
    let mut inflight: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut swallow: Option<u64> = None;
    let mut buf = vec![0u8; 16 << 20 | 4096];
    let mut restarts = 0u32;
    let mut died_at: Option<Instant> = None;
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(format!("{pidfile}.log")).unwrap();
    loop {
        let (dev_ready, sock_ready) = {
            let mut fds = [PollFd::new(dev.as_fd(), PollFlags::POLLIN), PollFd::new(sock.as_fd(), PollFlags::POLLIN)];
            poll(&mut fds, PollTimeout::NONE).unwrap();
            let r = |f: &PollFd| f.revents().is_some_and(|e| !e.is_empty());
            (r(&fds[0]), r(&fds[1]))
        };
        let mut server_dead = false;
        if sock_ready {
            match nix::unistd::read(&sock, &mut buf) {
                Ok(0) | Err(_) => server_dead = true,
                Ok(n) => {
                    let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
                    if unique != 0 && swallow == Some(unique) {
                        swallow = None;
                        if let Some(t) = died_at.take() {
                            writeln!(log, "restart {restarts}: init replayed after {:?}", t.elapsed()).unwrap();
                        }
                    } else {
                        if unique != 0 {
                            inflight.remove(&unique);
                        }
                        // ENOENT: the request was interrupted and is gone.
                        let _ = nix::unistd::write(&dev, &buf[..n]);
                    }
                }
            }
        }
        if dev_ready && !server_dead {
            match nix::unistd::read(&dev, &mut buf) {
                Ok(n) => {
                    let opcode = u32::from_ne_bytes(buf[4..8].try_into().unwrap());
                    let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
                    let msg = buf[..n].to_vec();
                    if opcode == FUSE_INIT {
                        init = Some(msg.clone());
                    }
                    if ![FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT].contains(&opcode) {
                        inflight.insert(unique, msg.clone());
                    }
                    if nix::unistd::write(&sock, &msg).is_err() {
                        server_dead = true;
                    }
                }
                Err(nix::errno::Errno::ENODEV) => {
                    let _ = child.kill();
                    return;
                }
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::ENOENT) => {}
                Err(e) => panic!("read /dev/fuse: {e}"),
            }
        }
        if server_dead {
            died_at = Some(Instant::now());
            let _ = child.wait();
            restarts += 1;
            (child, sock) = spawn_server();
            write_pid(pidfile, &child);
            if let Some(init) = &init {
                swallow = Some(u64::from_ne_bytes(init[8..16].try_into().unwrap()));
                nix::unistd::write(&sock, init).unwrap();
            }
            for msg in inflight.values() {
                let _ = nix::unistd::write(&sock, msg);
            }
            writeln!(log, "restart {restarts}: resent {} in flight", inflight.len()).unwrap();
        }
    }
}

fn write_pid(pidfile: &str, child: &Child) {
    let tmp = format!("{pidfile}.tmp");
    std::fs::write(&tmp, format!("{} {}\n", std::process::id(), child.id())).unwrap();
    std::fs::rename(tmp, pidfile).unwrap();
}
