//! `devremapd node --nri` (issue 32): the node daemon as containerd's NRI plugin `devremap`.
//! One thread connects to containerd's NRI socket, registers, and answers containerd's calls
//! through [`devremap::nri::session`] and the [`Handler`]; when the connection ends (containerd
//! restarted, or it dropped the plugin after a call timed out) it connects again, waiting
//! longer after each failure (up to [`MAX_BACKOFF`]). Nothing else in the daemon waits on it.
//!
//! Assumption: containerd 1.7's NRI (v0.6.1) with `[plugins."io.containerd.nri.v1.nri"]
//! disable = false` listens on the socket; until it does, the thread retries quietly (one
//! warning per streak of failures).

use devremap::io_message;
use devremap::nri::session::{Happened, Session, SessionError};
use devremap::nri::view::{Adjustment, Container, Handler, Pod};
use log::{debug, error, info, warn};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The name devremap registers as.
const PLUGIN_NAME: &str = "devremap";
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum NriError {
    #[error("NRI socket {}: cannot connect: {} (is NRI enabled in containerd's config?)", socket.display(), io_message(source))]
    Connect { socket: PathBuf, source: io::Error },
    #[error("NRI socket {}: {}", socket.display(), io_message(source))]
    Io { socket: PathBuf, source: io::Error },
    #[error("NRI socket {}: containerd closed the connection", socket.display())]
    Closed { socket: PathBuf },
    #[error("NRI socket {}: {source}", socket.display())]
    Protocol { socket: PathBuf, source: SessionError },
}

/// `handler`, with one line logged for each event containerd sends (what it decides is its
/// own to log).
pub fn logged(handler: Arc<dyn Handler>) -> Arc<dyn Handler> {
    Arc::new(Logged(handler))
}

struct Logged(Arc<dyn Handler>);

impl Handler for Logged {
    fn create(&self, pod: &Pod, container: &Container) -> Result<Adjustment, String> {
        info!("nri: create container {} ({}) in pod {}/{}", container.id, container.name, pod.namespace, pod.name);
        self.0.create(pod, container)
    }
    fn post_create(&self, pod: &Pod, container: &Container) {
        info!("nri: container {} created", container.id);
        self.0.post_create(pod, container)
    }
    fn started(&self, pod: &Pod, container: &Container) {
        info!("nri: container {} started (pid {})", container.id, container.pid);
        self.0.started(pod, container)
    }
    fn stopped(&self, pod: &Pod, container: &Container) {
        info!("nri: container {} stopped", container.id);
        self.0.stopped(pod, container)
    }
    fn removed(&self, pod: &Pod, container: &Container) {
        info!("nri: container {} removed", container.id);
        self.0.removed(pod, container)
    }
    fn synchronize(&self, pods: &[Pod], containers: &[Container]) {
        let running: Vec<&str> = containers.iter().map(|c| c.id.as_str()).collect();
        info!("nri: synchronize: {} pods, containers [{}]", pods.len(), running.join(", "));
        self.0.synchronize(pods, containers)
    }
}

/// Starts the plugin's thread: `socket` is containerd's NRI socket, `index` the plugin's place
/// among NRI plugins (0-99).
pub fn start(socket: PathBuf, index: u8, handler: Arc<dyn Handler>) -> io::Result<()> {
    std::thread::Builder::new().name("nri".into()).spawn(move || serve(&socket, &format!("{index:02}"), &*handler))?;
    Ok(())
}

fn serve(socket: &Path, index: &str, handler: &dyn Handler) {
    let mut backoff = MIN_BACKOFF;
    let mut failing = false;
    loop {
        let mut registered = false;
        let ended = connection(socket, index, handler, &mut registered);
        if registered {
            backoff = MIN_BACKOFF;
            failing = false;
        }
        match ended {
            // containerd going down, restarting, or dropping the plugin: say so once.
            Err(e) if registered => warn!("nri: {e}; connecting again"),
            Err(e) if !failing => warn!("nri: {e}; retrying every {} s at most", MAX_BACKOFF.as_secs()),
            Err(e) => debug!("nri: {e}"),
            Ok(never) => match never {},
        }
        failing = !registered;
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection, from connecting to its end (an error: a plugin's connection never ends
/// well). `registered` tells whether containerd accepted the plugin on it.
fn connection(
    socket: &Path,
    index: &str,
    handler: &dyn Handler,
    registered: &mut bool,
) -> Result<std::convert::Infallible, NriError> {
    let io = |source| NriError::Io { socket: socket.to_owned(), source };
    let mut stream =
        UnixStream::connect(socket).map_err(|source| NriError::Connect { socket: socket.to_owned(), source })?;
    let (mut session, hello) = Session::start(handler, PLUGIN_NAME, index);
    stream.write_all(&hello).map_err(io)?;
    let mut buf = vec![0; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).map_err(io)?;
        if n == 0 {
            return Err(NriError::Closed { socket: socket.to_owned() });
        }
        let turn =
            session.feed(&buf[..n]).map_err(|source| NriError::Protocol { socket: socket.to_owned(), source })?;
        stream.write_all(&turn.write).map_err(io)?;
        for happened in turn.happened {
            match happened {
                Happened::Registered => {
                    *registered = true;
                    info!("nri: registered with containerd on {} as plugin {index}-{PLUGIN_NAME}", socket.display());
                }
                Happened::Configured { runtime, version } => info!("nri: configured by {runtime} {version}"),
                Happened::Synchronized { pods, containers } => {
                    debug!("nri: synchronized: {pods} pods, {containers} containers")
                }
                Happened::Shutdown => info!("nri: containerd is shutting down"),
                Happened::Panicked(message) => error!("nri: {message}; answered with it as an error"),
            }
        }
    }
}
