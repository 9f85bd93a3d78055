//! The mountpoint, before and after serving: what is mounted there, whether a FUSE daemon
//! behind it still answers, and detaching what is left.
//!
//! Assumption: `statfs` on a FUSE mount always reaches its daemon (the kernel caches stat
//! answers, never statfs), so it tells a live mount from a dead one (ENOTCONN).

use devremap::io_message;
use log::warn;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Detaches a dead FUSE mount left at the mountpoint (ENOTCONN) and refuses to stack on a
/// live mount.
pub fn prepare_mountpoint(path: &Path) -> Result<(), String> {
    let m = path.display();
    // statfs always reaches a FUSE daemon (stat may be answered from the kernel's cache), so
    // ENOTCONN here means the daemon behind the mount is gone.
    if let Err(e) = statfs(path) {
        if e.raw_os_error() != Some(libc::ENOTCONN) {
            return Err(format!("{m}: {}", io_message(&e)));
        }
        warn!("{m}: a dead FUSE mount was left here; detaching it");
        detach(path);
    }
    match std::fs::metadata(path) {
        Err(e) => return Err(format!("{m}: {}", io_message(&e))),
        Ok(meta) if !meta.is_dir() => return Err(format!("{m}: not a directory")),
        Ok(_) => {}
    }
    let canonical = path.canonicalize().map_err(|e| format!("{m}: {}", io_message(&e)))?;
    if let Some(fs) = mounted_at(&canonical) {
        return Err(format!("{m}: already a mount point ({fs}); refusing to mount over it"));
    }
    Ok(())
}

/// The filesystem type and source mounted exactly at `path`, if any.
fn mounted_at(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let target = path.to_str()?;
    info.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let dash = fields.iter().position(|f| *f == "-")?;
        let mount_point = fields.get(4)?.replace("\\040", " ");
        if mount_point != target {
            return None;
        }
        Some(format!("{} {}", fields.get(dash + 1)?, fields.get(dash + 2)?))
    })
}

pub fn detach(path: &Path) {
    if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
        // SAFETY: a valid NUL-terminated path; umount2 does not keep it.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Waits until the mount answers a request (statfs through it reaches our daemon).
pub fn wait_answering(path: &Path) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if statfs(path).is_ok_and(|st| st.f_type == FUSE_SUPER_MAGIC) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{}: the mount did not answer within 10 s", path.display()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn statfs(path: &Path) -> io::Result<libc::statfs> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: statfs writes into a zeroed struct we own; `c` is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 { Ok(st) } else { Err(io::Error::last_os_error()) }
}
