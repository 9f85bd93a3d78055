//! Reading every input from disk: the I/O edge in front of [`crate::decision::plan::build`].
//!
//! Assumptions: inputs are small (metadata and specs are capped at 16 MiB; a state file is read
//! only up to the end of its header); every error names the file or flag at fault, so that a
//! user sees one line `error: <path>: <what is wrong>`; nothing here keeps state, so the daemon
//! calls [`load`] again for every reload and the dynamic majors of pass-through nodes are
//! never cached.

use crate::decision::checks::CheckName;
use crate::decision::pairing::{MapPair, Rule};
use crate::decision::plan::{self, Input, Inputs, Plan, PlanError, Prefer};
use crate::family::table;
use crate::inputs::files::{self, FileError, read_up_to};
use crate::inputs::host::HostError;
use crate::inputs::metadata::{self, MAX_METADATA_LEN, Metadata, MetadataError};
use crate::inputs::spec::{self, SpecError};
use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
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
    /// Identity first, or gVisor's positional rule.
    pub pairing: Rule,
    /// The checks whose failure only warns.
    pub relax: BTreeSet<CheckName>,
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
            pairing: Rule::default(),
            relax: BTreeSet::new(),
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
    #[error("{}: is {}; expected a directory", .0.display(), .1)]
    NotDir(PathBuf, &'static str),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("{0}: {1}")]
    Plan(String, Box<PlanError>),
    #[error("{}: expected `native` or `checkpoint`, found {:?}", .0.display(), .1)]
    Prefer(PathBuf, String),
    /// A plan handed over by the previous server ([`Loaded::from_bytes`]) does not read back.
    #[error("a plan handed over that does not read back: {0}")]
    HandedOver(#[source] serde_json::Error),
}

/// A loaded plan together with the metadata it came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Loaded {
    pub plan: Plan,
    pub metadata: Option<Metadata>,
}

impl Loaded {
    /// The plan as a server hands it to its keeper: what a server restarted after a crash serves
    /// without reading the inputs again. Empty if it cannot be written (these types always can).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A plan handed over by [`Loaded::to_bytes`]; its tree is rebuilt and checked node by node.
    pub fn from_bytes(bytes: &[u8]) -> Result<Loaded, LoadError> {
        serde_json::from_slice(bytes).map_err(LoadError::HandedOver)
    }
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
    read_spec_and_bytes(path).map(|(view, _)| view)
}

/// Reads an OCI runtime spec as [`read_spec`] does, and also as JSON, for what the view does
/// not keep (its `devremap.io/` annotations).
pub fn read_spec_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let (_, buf) = read_spec_and_bytes(path)?;
    serde_json::from_slice(&buf).map_err(|e| LoadError::Spec(path.to_owned(), SpecError::Parse(e.to_string())))
}

fn read_spec_and_bytes(path: &Path) -> Result<(spec::SpecView, Vec<u8>), LoadError> {
    let mut file = open_regular(path)?;
    let buf = files::read_at_most(&mut file, MAX_METADATA_LEN)
        .map_err(|e| LoadError::Io(path.to_owned(), e))?
        .ok_or_else(|| LoadError::Spec(path.to_owned(), SpecError::TooLarge))?;
    // A bind mount whose source is not a directory needs a non-directory mount point. A
    // relative source is relative to the bundle, the spec's directory.
    let bundle = path.parent().unwrap_or(Path::new("."));
    let file_source = |source: &str| std::fs::metadata(bundle.join(source)).is_ok_and(|meta| !meta.is_dir());
    let view = spec::parse(&buf, &file_source).map_err(|e| LoadError::Spec(path.to_owned(), e))?;
    Ok((view, buf))
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

/// The device directory scanned: `--host-dev`, else `/dev` when the spec asks for GPUs through
/// the NVIDIA hook.
fn dev_dir_of(sources: &Sources, spec: Option<&spec::SpecView>) -> Option<PathBuf> {
    sources.host_dev.clone().or_else(|| spec.filter(|s| s.hook.is_some()).map(|_| PathBuf::from("/dev")))
}

/// Reads every input named by `sources`.
pub fn gather(sources: &Sources) -> Result<Inputs, LoadError> {
    let metadata = sources.metadata.as_deref().map(read_metadata).transpose()?;
    let spec = sources.spec.as_deref().map(read_spec).transpose()?;
    let dev_dir = dev_dir_of(sources, spec.as_ref()).as_deref().map(table::scan_dev_dir).transpose()?;
    // A host root that is not there would read as a host without driver files, in silence.
    let root = &sources.host_root;
    let meta = std::fs::metadata(root).map_err(|e| LoadError::Io(root.clone(), e))?;
    if !meta.is_dir() {
        return Err(LoadError::NotDir(root.clone(), files::describe(meta.mode())));
    }
    Ok(Inputs {
        metadata,
        spec,
        dev_dir,
        host: table::read_host_facts(root),
        device_map: sources.device_map.clone(),
        prefer: match &sources.prefer_file {
            Some(path) => read_prefer(path)?,
            None => sources.prefer,
        },
        pairing: sources.pairing,
        relax: sources.relax.clone(),
        kfd: table::switches_from_env(),
    })
}

/// The path (or flag) of the input that holds the cause of a plan error.
fn input_name(input: Input, inputs: &Inputs, sources: &Sources) -> String {
    let path = match input {
        Input::Checkpoint => sources.metadata.clone(),
        Input::Spec => sources.spec.clone(),
        Input::HostDev => dev_dir_of(sources, inputs.spec.as_ref()),
        Input::HostRoot => Some(sources.host_root.clone()),
        Input::DeviceMap => return "--device-map".to_owned(),
    };
    // Each variant is made only when its input was given; "inputs" is never expected.
    path.map_or_else(|| "inputs".to_owned(), |p| p.display().to_string())
}

/// Reads every input and builds the plan, whatever its checks say: for showing them
/// (`plan --json`) and for `record`, which describes what is served rather than judging it.
pub fn load_unchecked(sources: &Sources) -> Result<Loaded, LoadError> {
    let inputs = gather(sources)?;
    let mut plan =
        plan::build(&inputs).map_err(|e| LoadError::Plan(input_name(e.input(), &inputs, sources), Box::new(e)))?;
    if let (Some(path), Some(meta)) = (&sources.metadata, &inputs.metadata) {
        let noted = meta.warnings.iter().map(|w| format!("{}: {w}", path.display()));
        plan.warnings.splice(0..0, noted);
    }
    Ok(Loaded { plan, metadata: inputs.metadata })
}

/// Refuses a loaded plan one of whose checks failed unrelaxed, naming the input at fault.
pub fn gate(loaded: &Loaded, sources: &Sources) -> Result<(), LoadError> {
    plan::gate(&loaded.plan).map_err(|e| {
        // A check names the checkpoint or the host root, neither of which needs the inputs.
        let name = input_name(e.input(), &Inputs::default(), sources);
        LoadError::Plan(name, Box::new(e))
    })
}

/// Reads every input and builds the plan, refused when a check fails unrelaxed: what `mount`,
/// every reload and `cuda-device-map` serve or print.
pub fn load(sources: &Sources) -> Result<Loaded, LoadError> {
    let loaded = load_unchecked(sources)?;
    gate(&loaded, sources)?;
    Ok(loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule (issue 13): a plan handed over reads back equal, and a tree that no builder makes
    /// (a node without its parent directory) is refused, not served.
    #[test]
    fn a_plan_handed_over_reads_back() {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
        let sources = Sources {
            metadata: Some(examples.join("checkpoint")),
            spec: Some(examples.join("config.json")),
            host_root: examples.join("host-root"),
            ..Sources::default()
        };
        let loaded = load(&sources).unwrap();
        assert!(loaded.metadata.is_some() && !loaded.plan.parts.nvidia.remap.is_empty());
        let bytes = loaded.to_bytes();
        assert_eq!(Loaded::from_bytes(&bytes).unwrap(), loaded);
        let text = String::from_utf8(bytes).unwrap();
        let orphan = text.replacen("\"pts\":", "\"pts-gone/x\":", 1);
        assert_ne!(orphan, text, "the example has /dev/pts");
        assert!(Loaded::from_bytes(orphan.as_bytes()).unwrap_err().to_string().contains("do not make a tree"));
        assert!(Loaded::from_bytes(&text.as_bytes()[..text.len() / 2]).is_err());
    }
}
