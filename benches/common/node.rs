//! The node daemon (`devremapd node`, issue 31) as the benchmarks run it: started on a state
//! dir before the rounds, and on drop (also when the benchmark panics) every container it
//! still serves unmounted and the daemon stopped, so that no mount or process is left behind.

// Each benchmark that includes this file uses part of it.
#![allow(dead_code)]

use devremap::node::client::ask;
use devremap::node::protocol::Request;
use std::fs;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a request to the daemon may take.
pub const ASK: Duration = Duration::from_secs(60);

pub struct NodeDaemon {
    child: Child,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    log: PathBuf,
}

impl NodeDaemon {
    /// Starts `devremapd node` on `state_dir`, its socket `<state_dir>/node.sock` (the
    /// runtime config's default), its log in `log`; returns once the socket answers.
    pub fn start(devremapd: &str, state_dir: &Path, log: &Path) -> NodeDaemon {
        NodeDaemon::start_with(devremapd, state_dir, log, &[])
    }

    /// [`NodeDaemon::start`], with `extra` flags after the daemon's own.
    pub fn start_with(devremapd: &str, state_dir: &Path, log: &Path, extra: &[&str]) -> NodeDaemon {
        let socket = state_dir.join("node.sock");
        let log_file = fs::File::create(log).unwrap();
        let child = Command::new(devremapd)
            .arg("node")
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(state_dir)
            .arg("--pid-file")
            .arg(state_dir.join("node.pid"))
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap();
        let mut node = NodeDaemon { child, socket, state_dir: state_dir.to_owned(), log: log.to_owned() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&node.socket).is_err() {
            assert!(node.child.try_wait().unwrap().is_none(), "devremapd node exited before it answered");
            assert!(Instant::now() < deadline, "devremapd node did not answer within 20 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        node
    }

    /// The daemon's log (warnings only).
    pub fn log(&self) -> &Path {
        &self.log
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The containers the daemon serves: `(id, keeper pid, server pid)`.
    pub fn list(&self) -> Vec<(String, u32, Option<u32>)> {
        let data = ask(&self.socket, &Request::List, ASK).unwrap();
        data.as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let pid = |k: &str| e[k].as_u64().map(|p| p as u32);
                (e["id"].as_str().unwrap().to_owned(), pid("pid").unwrap(), pid("server_pid"))
            })
            .collect()
    }

    /// Fails the benchmark, naming them and printing the daemon's log, when container
    /// directories are still in the state dir 20 s after the last round.
    pub fn assert_torn_down(&self) {
        let left = self.wait_torn_down(Duration::from_secs(20));
        assert!(
            left.is_empty(),
            "container directories left in the state dir: {left:?}; the node daemon's log:\n{}",
            fs::read_to_string(self.log()).unwrap_or_default()
        );
    }

    /// Waits until no container directory is left in the state dir (the daemon removes one
    /// once its keeper has exited); the names of those still there after `within`.
    fn wait_torn_down(&self, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        loop {
            let left: Vec<String> = fs::read_dir(&self.state_dir)
                .unwrap()
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            if left.is_empty() || Instant::now() >= deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for NodeDaemon {
    fn drop(&mut self) {
        // The keepers outlive a stopped daemon by design: unmount each container first.
        if let Ok(serving) = ask(&self.socket, &Request::List, ASK) {
            for e in serving.as_array().into_iter().flatten() {
                if let Some(id) = e["id"].as_str() {
                    let _ = ask(&self.socket, &Request::Unmount { id: id.to_owned() }, ASK);
                }
            }
        }
        // SAFETY: a signal to our own child, which we reap below.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}
