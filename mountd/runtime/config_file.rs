//! Finding and reading the wrapper's config file: `--devremap-config`, else
//! `DEVREMAP_RUNTIME_CONFIG`, else the default path if it exists (a file named by the flag or
//! the variable must exist).

use crate::error::Failure;
use devremap::io_message;
use devremap::runtime::argv::Invocation;
use devremap::runtime::config::{self, Config};
use devremap::runtime::osarg;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub fn load(inv: &Invocation) -> Result<Config, Failure> {
    let (path, required) = match (&inv.config, std::env::var_os(config::ENV)) {
        (Some(p), _) => (PathBuf::from(osarg::decode(p)), true),
        (None, Some(p)) => (PathBuf::from(p), true),
        (None, None) => (PathBuf::from(config::DEFAULT_PATH), false),
    };
    let p = path.display();
    let at = |what: &dyn std::fmt::Display| Failure::at(&p, what);
    let mut file = match devremap::inputs::files::open_regular(&path) {
        Ok(f) => f,
        Err(devremap::inputs::files::FileError::Io(e)) if !required && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Config::default());
        }
        Err(e) => return Err(at(&e)),
    };
    let meta = file.metadata().map_err(|e| at(&io_message(&e)))?;
    let me = nix::unistd::geteuid().as_raw();
    config::check_access(meta.uid(), meta.mode(), me).map_err(|e| at(&e))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dmeta = std::fs::metadata(dir).map_err(|e| at(&format!("{}: {}", dir.display(), io_message(&e))))?;
    config::check_dir_access(&dir.display().to_string(), dmeta.uid(), dmeta.mode(), me).map_err(|e| at(&e))?;
    let mut buf = Vec::new();
    devremap::inputs::files::read_up_to(&mut file, config::MAX_LEN + 1, &mut buf).map_err(|e| at(&io_message(&e)))?;
    let config = config::parse(&buf).map_err(|e| at(&e))?;
    if is_this_program(&config.runtime) {
        return Err(at(&format!("runtime: {} is devremap-runtime itself", config.runtime.display())));
    }
    Ok(config)
}

/// Whether `runtime` (a path, or a name looked up on `PATH`) is this executable: running it
/// would run us again, forever.
fn is_this_program(runtime: &Path) -> bool {
    let found = if runtime.components().count() > 1 {
        Some(runtime.to_owned())
    } else {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(runtime))
            .find(|p| p.is_file())
    };
    let same = |a: &Path, b: &Path| matches!((std::fs::metadata(a), std::fs::metadata(b)), (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()));
    found.zip(std::env::current_exe().ok()).is_some_and(|(r, me)| same(&r, &me))
}
