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
        (None, Some(p)) if p.is_empty() => {
            return Err(Failure::at(
                config::ENV,
                format!("set but empty; name the config file, or unset it to read {}", config::DEFAULT_PATH),
            ));
        }
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
    let (dirs, real) = directories(&path, &file, me).map_err(|e| at(&e))?;
    for dir in dirs {
        // A directory the path does not name is explained by where the path leads.
        let at = |what: &dyn std::fmt::Display| match dir == dir_of(&path) {
            true => at(what),
            false => Failure::at(format!("{p} (leading to {})", real.display()), what),
        };
        let dmeta = std::fs::metadata(&dir).map_err(|e| at(&format!("{}: {}", dir.display(), io_message(&e))))?;
        config::check_dir_access(&dir.display().to_string(), dmeta.uid(), dmeta.mode(), me).map_err(|e| at(&e))?;
    }
    let mut buf = Vec::new();
    devremap::inputs::files::read_up_to(&mut file, config::MAX_LEN + 1, &mut buf).map_err(|e| at(&io_message(&e)))?;
    let config = config::parse(&buf).map_err(|e| at(&e))?;
    if is_this_program(&config.runtime) {
        return Err(at(&format!("runtime: {} is devremap-runtime itself", config.runtime.display())));
    }
    Ok(config)
}

fn dir_of(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// The directories whose writers could put another file in the config's place: that of
/// `path`, of each symlink `path` leads through (a link's writer can point it elsewhere), and
/// of the file actually `opened` (issue 29.6: a config symlinked into a user's directory was
/// checked only where the link lies); and that file's path. Each link must be root's or
/// `me`'s: in a sticky directory its owner could point it elsewhere.
fn directories(path: &Path, opened: &std::fs::File, me: u32) -> Result<(Vec<PathBuf>, PathBuf), String> {
    let mut dirs = vec![];
    let mut link = path.to_owned();
    // As many links as the kernel follows; the open succeeded, so the chain ends before.
    for _ in 0..40 {
        let dir = dir_of(&link);
        dirs.push(dir.clone());
        let Some(meta) = std::fs::symlink_metadata(&link).ok().filter(|m| m.file_type().is_symlink()) else {
            break;
        };
        config::check_link_owner(&link.display().to_string(), meta.uid(), me).map_err(|e| e.to_string())?;
        let target = std::fs::read_link(&link).map_err(|e| format!("{}: {}", link.display(), io_message(&e)))?;
        link = dir.join(target);
    }
    // The file opened, wherever the links and any symlinked directory led.
    let fd = std::os::fd::AsRawFd::as_raw_fd(opened);
    let real = std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_err(|e| format!("/proc/self/fd/{fd}: {}", io_message(&e)))?;
    dirs.push(dir_of(&real));
    dirs.dedup();
    Ok((dirs, real))
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
