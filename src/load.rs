//! Reading every input from disk: the I/O edge in front of [`crate::plan::build`].
//!
//! Assumptions: inputs are small (metadata and specs are capped at 16 MiB; a state file is read
//! only up to the end of its header); every error names the file or flag at fault, so that a
//! user sees one line `error: <path>: <what is wrong>`; nothing here keeps state, so the daemon
//! calls [`load`] again for every reload and the dynamic majors of pass-through nodes are
//! never cached.

use crate::files::{self, FileError, read_up_to};
use crate::host::{self, HostError};
use crate::metadata::{self, MAX_METADATA_LEN, Metadata, MetadataError};
use crate::pairing::{MapPair, PairingError};
use crate::plan::{self, Inputs, Plan, PlanError, Prefer};
use crate::spec::{self, SpecError};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Where the inputs are, as the command line gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    pub metadata: Option<PathBuf>,
    pub spec: Option<PathBuf>,
    pub host_dev: Option<PathBuf>,
    pub host_root: PathBuf,
    pub device_map: Vec<MapPair>,
    pub prefer: Prefer,
    /// A file holding `native` or `checkpoint`, read at every load and winning over
    /// `prefer`: how a running daemon is switched between the two (write it, then SIGHUP).
    pub prefer_file: Option<PathBuf>,
}

impl Default for Sources {
    fn default() -> Self {
        Sources {
            metadata: None,
            spec: None,
            host_dev: None,
            host_root: PathBuf::from("/"),
            device_map: Vec::new(),
            prefer: Prefer::Native,
            prefer_file: None,
        }
    }
}

/// Why the inputs could not be turned into a plan. Displays as `<path>: <what is wrong>`.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{}: {}", .0.display(), crate::io_message(.1))]
    Io(PathBuf, io::Error),
    #[error("{}: {}", .0.display(), .1)]
    Metadata(PathBuf, MetadataError),
    #[error("{}: {}", .0.display(), .1)]
    Spec(PathBuf, SpecError),
    #[error("{}: is {}; expected a regular file", .0.display(), .1)]
    NotRegular(PathBuf, &'static str),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("{0}: {1}")]
    Plan(String, Box<PlanError>),
    #[error("{}: expected `native` or `checkpoint`, found {:?}", .0.display(), .1)]
    Prefer(PathBuf, String),
}

/// A loaded plan together with the metadata it came from.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub plan: Plan,
    pub metadata: Option<Metadata>,
}

/// Opens an input file, refusing anything but a regular file.
fn open_regular(path: &Path) -> Result<File, LoadError> {
    files::open_regular(path).map_err(|e| match e {
        FileError::Io(e) => LoadError::Io(path.to_owned(), e),
        FileError::NotRegular(what) => LoadError::NotRegular(path.to_owned(), what),
    })
}

/// Reads checkpoint metadata from a state file, a checkpoint directory, or a JSON file,
/// reading no more of the file than its header.
pub fn read_metadata(path: &Path) -> Result<Metadata, LoadError> {
    let io_err = |p: &Path, e| LoadError::Io(p.to_owned(), e);
    let path = if path.is_dir() { path.join("checkpoint.img") } else { path.to_owned() };
    let mut file = open_regular(&path)?;
    let mut buf = Vec::new();
    read_up_to(&mut file, 16, &mut buf).map_err(|e| io_err(&path, e))?;
    let meta_err = |e| LoadError::Metadata(path.clone(), e);
    let limit = metadata::needed_len(&buf).map_err(meta_err)?.unwrap_or(MAX_METADATA_LEN + 1);
    read_up_to(&mut file, limit, &mut buf).map_err(|e| io_err(&path, e))?;
    metadata::parse(&buf).map_err(|e| LoadError::Metadata(path.clone(), e))
}

/// Reads what of an OCI runtime spec shapes `/dev`.
pub fn read_spec(path: &Path) -> Result<spec::SpecView, LoadError> {
    let mut view = parse_spec(path)?;
    // A bind mount whose source is not a directory needs a non-directory mount point. A
    // relative source is relative to the bundle, the spec's directory.
    let bundle = path.parent().unwrap_or(Path::new("."));
    for m in &mut view.dev_mounts {
        if let Some(source) = &m.bind_source {
            m.onto_file = std::fs::metadata(bundle.join(source)).is_ok_and(|meta| !meta.is_dir());
        }
    }
    Ok(view)
}

fn parse_spec(path: &Path) -> Result<spec::SpecView, LoadError> {
    let mut file = open_regular(path)?;
    let mut buf = Vec::new();
    read_up_to(&mut file, MAX_METADATA_LEN + 1, &mut buf).map_err(|e| LoadError::Io(path.to_owned(), e))?;
    if buf.len() as u64 > MAX_METADATA_LEN {
        return Err(LoadError::Spec(path.to_owned(), SpecError::TooLarge));
    }
    spec::parse(&buf).map_err(|e| LoadError::Spec(path.to_owned(), e))
}

/// Reads a `--prefer-file`: one word, `native` or `checkpoint`.
fn read_prefer(path: &Path) -> Result<Prefer, LoadError> {
    let mut file = open_regular(path)?;
    let mut buf = Vec::new();
    read_up_to(&mut file, 65, &mut buf).map_err(|e| LoadError::Io(path.to_owned(), e))?;
    let word = String::from_utf8_lossy(&buf[..buf.len().min(64)]).trim().to_owned();
    if buf.len() > 64 {
        return Err(LoadError::Prefer(path.to_owned(), format!("{word}...")));
    }
    match word.as_str() {
        "native" => Ok(Prefer::Native),
        "checkpoint" => Ok(Prefer::Checkpoint),
        _ => Err(LoadError::Prefer(path.to_owned(), word)),
    }
}

/// Reads every input named by `sources`.
pub fn gather(sources: &Sources) -> Result<Inputs, LoadError> {
    let metadata = sources.metadata.as_deref().map(read_metadata).transpose()?;
    let spec = sources.spec.as_deref().map(read_spec).transpose()?;
    // A spec that asks for GPUs through the NVIDIA hook means the host's /dev names them.
    let host_dev =
        sources.host_dev.clone().or_else(|| spec.as_ref().filter(|s| s.wants_hook).map(|_| PathBuf::from("/dev")));
    let dev_dir = host_dev.as_deref().map(host::scan_dev_dir).transpose()?;
    Ok(Inputs {
        metadata,
        spec,
        dev_dir,
        host: host::read_host_facts(&sources.host_root),
        device_map: sources.device_map.clone(),
        prefer: match &sources.prefer_file {
            Some(path) => read_prefer(path)?,
            None => sources.prefer,
        },
    })
}

/// The input a plan error is about: the checkpoint for its own devices, the host for the
/// restored ones, the flag for explicit pairs, the spec for nodes.
fn blame(e: &PlanError, sources: &Sources) -> String {
    let show = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let who = match e {
        PlanError::Pairing(
            PairingError::BadMapEntry { .. } | PairingError::Unknown { .. } | PairingError::Claimed { .. },
        ) => Some("--device-map".to_owned()),
        PlanError::Pairing(PairingError::Heterogeneous { side: "restored", .. }) => {
            Some(sources.host_root.display().to_string())
        }
        PlanError::Pairing(_) => show(&sources.metadata),
        PlanError::SpecDevice(_) | PlanError::SpecMount(_) => show(&sources.spec).or_else(|| show(&sources.host_dev)),
    };
    who.unwrap_or_else(|| "inputs".to_owned())
}

/// Reads every input and builds the plan.
pub fn load(sources: &Sources) -> Result<Loaded, LoadError> {
    let inputs = gather(sources)?;
    let plan = plan::build(&inputs).map_err(|e| LoadError::Plan(blame(&e, sources), Box::new(e)))?;
    Ok(Loaded { plan, metadata: inputs.metadata })
}
