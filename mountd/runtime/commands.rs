//! `restore`, `checkpoint` and `delete`, which add to what the runtime does around a devremap
//! container.

use crate::error::Failure;
use crate::procs::Host;
use crate::runner::{exec, note, report, run_runtime, runtime_knows};
use crate::start::{Restoring, callers_bundle, start};
use crate::{RECORD_FILE, absolute, arg_of};
use devremap::io_message;
use devremap::runtime::argv::{self, ContainerId, Invocation, NewContainer};
use devremap::runtime::config::Config;
use devremap::runtime::container_daemon::{Container, Found};
use std::path::{Path, PathBuf};

/// The image directory of a checkpoint, or of a restore given an absolute one or none:
/// `--image-path`, else runc's default `./checkpoint`.
fn image_dir(image_path: Option<&str>) -> Result<PathBuf, Failure> {
    absolute(given(image_path).unwrap_or("checkpoint"))
}

/// A path flag's value as the runtime takes it: an empty one is none (found from outside:
/// `--image-path=` read the record from the bundle, where runc restores from `./checkpoint`).
fn given(value: Option<&str>) -> Option<&str> {
    value.filter(|v| !v.is_empty())
}

pub fn restore(
    config: &Config,
    inv: &Invocation,
    container: &NewContainer,
    image_path: Option<&str>,
) -> Result<u8, Failure> {
    // Where the runtime opens it: in the caller's bundle, when relative.
    let image = match given(image_path).filter(|p| !p.starts_with('/')) {
        Some(relative) => absolute(&argv::in_dir(&arg_of(&callers_bundle(container)?)?, relative))?,
        None => image_dir(image_path)?,
    };
    // The first that is there at all: one that is not a regular file (a symlink, a FIFO, a
    // directory in a hostile image) is refused when it is kept, naming it, rather than passed
    // over for the next, or for none (found from outside: the restore went on unremapped).
    let metadata = [RECORD_FILE, "checkpoint.img"].iter().map(|f| image.join(f)).find(|p| p.symlink_metadata().is_ok());
    start(config, inv, container, Some(Restoring { metadata }))
}

/// The devremap container `id` names, when it is one of this runtime root's.
fn devremap_container(config: &Config, inv: &Invocation, id: &ContainerId) -> Option<Container> {
    let container = Container::new(&config.state_dir, id.as_str());
    (container.exists() && container.other_root(inv.global.root.as_deref()).is_none()).then_some(container)
}

/// Records the GPUs of a devremap container into the image directory, then checkpoints.
pub fn checkpoint(
    config: &Config,
    inv: &Invocation,
    id: &ContainerId,
    image_path: Option<&str>,
) -> Result<u8, Failure> {
    if let Some(container) = devremap_container(config, inv, id) {
        // Found from outside: CRIU then failed on the dead mount (`Can't statfs fd`), after
        // the record was written.
        container.check_daemon().map_err(|e| Failure::Container {
            id: id.as_str().to_owned(),
            what: format!("{e}; not checkpointed (its /dev is dead; delete the container)"),
        })?;
        record(config, inv, id, &container, image_path)?;
    }
    Err(exec(config, inv.line.original()))
}

/// Starts a devremap container only while its daemon still serves its `/dev`; refuses one whose
/// daemon is gone (its container would run on a dead mount), leaving it for `delete`.
pub fn start_created(config: &Config, inv: &Invocation, id: &ContainerId) -> Result<u8, Failure> {
    if let Some(container) = devremap_container(config, inv, id) {
        container.check_daemon().map_err(|e| Failure::Container {
            id: id.as_str().to_owned(),
            what: format!("{e}; not started (delete it, then create it again)"),
        })?;
    }
    Err(exec(config, inv.line.original()))
}

/// Writes `<image>/devremap-gpus.json` for container `id`.
fn record(
    config: &Config,
    inv: &Invocation,
    id: &ContainerId,
    container: &Container,
    image_path: Option<&str>,
) -> Result<(), Failure> {
    let lost = |what: &str| Failure::Container { id: id.as_str().to_owned(), what: what.into() };
    let state = runtime_knows(config, &inv.line, id.as_str()).ok_or_else(|| lost("the runtime does not know it"))?;
    let bundle = state["bundle"].as_str().ok_or_else(|| lost("the runtime's state names no bundle"))?;
    let image = image_dir(image_path)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .create(&image)
        .map_err(|e| Failure::at(image.display(), io_message(&e)))?;
    // As `devremapd record --metadata PREV`: a container restored with metadata carries the
    // names it was given into the record; the restore was judged then, not here.
    let sources = devremap::inputs::load::Sources {
        metadata: container.restored_metadata(),
        spec: Some(Path::new(bundle).join("config.json")),
        host_dev: config.host_dev.clone(),
        host_root: config.host_root.clone(),
        ..Default::default()
    };
    let loaded = devremap::inputs::load::load_unchecked(&sources)?;
    // As `devremapd record` does: a GPU an unreadable KFD topology hid fails the checkpoint
    // before CRIU runs; a topology that hid none is said.
    devremap::decision::record::check(&loaded.plan)?;
    if let Some(warning) = devremap::decision::record::unread_warning(&loaded.plan) {
        report(&inv.global, "warning", &warning);
    }
    // The record still pairs by minor, but say what it lacks: in the runtime's log, not on
    // every checkpoint's stderr (issue 30.4); `devremapd record` warns of it.
    for gap in devremap::decision::record::gaps(&loaded.plan) {
        note(&inv.global, "info", &format!("{}: {gap}", config.host_root.display()));
    }
    let text = format!("{:#}\n", devremap::decision::record::devices(&loaded.plan, sources.metadata.is_some()));
    devremap::atomic::replace_file(&image.join(RECORD_FILE), text.as_bytes())?;
    Ok(())
}

/// Deletes through the runtime, then, once the runtime no longer knows the container, stops
/// its daemon and removes its directory (also when the runtime's delete failed because the
/// container never got made).
pub fn delete(config: &Config, inv: &Invocation, id: Option<&ContainerId>) -> Result<u8, Failure> {
    // A node daemon's container: the runtime alone; its keeper ends with the container, and the
    // node daemon removes the directory then (issue 31). An earlier version's, or one whose
    // keeper died (its mount dead): torn down here, after the runtime.
    let ours = |c: &Container| c.exists() && (!c.is_node() || c.check_daemon().is_err());
    if !id.map(|id| Container::new(&config.state_dir, id.as_str())).is_some_and(|c| ours(&c)) {
        return Err(exec(config, inv.line.original()));
    }
    let code = run_runtime(config, &inv.line.original())?;
    if let Some(id) = id {
        let container = Container::new(&config.state_dir, id.as_str());
        if container.exists() {
            // Not a container another wrapper is setting up or running, nor another root's.
            let _claiming = container.lock_state_dir()?;
            // The node daemon may have removed it meanwhile (under this lock): its keeper ended
            // with the container.
            if container.exists()
                && let Found::Idle = container.found(inv.global.root.as_deref())?
                && runtime_knows(config, &inv.line, id.as_str()).is_none()
            {
                container.teardown(&Host)?;
            }
        }
    }
    Ok(code)
}
