//! Reading the runtime config file (`/etc/devremap/runtime.json`), checked as the wrapper
//! checks it: only root's, in directories only root can write, each symlink on the way too.
//! Shared by `devremap-runtime` (which finds the path: `--devremap-config`, else
//! `DEVREMAP_RUNTIME_CONFIG`, else the default path if it exists) and `devremapd node`
//! (`--config`, for the NRI plugin).

use devremap::io_message;
use devremap::runtime::config::{self, Config};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why the config was refused: the file (or how it was named), then what is wrong.
#[derive(Debug, Error)]
#[error("{at}: {what}")]
pub struct ConfigFileError {
    pub at: String,
    pub what: String,
}

impl ConfigFileError {
    fn at(at: impl std::fmt::Display, what: impl std::fmt::Display) -> ConfigFileError {
        ConfigFileError { at: at.to_string(), what: what.to_string() }
    }
}

/// Why the directories around the config's path could not be listed; shown after the path.
#[derive(Debug, Error)]
enum WalkError {
    #[error("{}: {}", .0.display(), io_message(.1))]
    Io(PathBuf, #[source] io::Error),
    #[error("{}: more than 40 symlinks on the way", .0.display())]
    TooManyLinks(PathBuf),
    #[error(transparent)]
    Link(#[from] config::ConfigError),
}

/// Reads the config at `path`; a missing file is the defaults unless it is `required` (named by
/// a flag or a variable, not the default path).
pub fn read(path: &Path, required: bool) -> Result<Config, ConfigFileError> {
    let p = path.display();
    let at = |what: &dyn std::fmt::Display| ConfigFileError::at(&p, what);
    let mut file = match devremap::inputs::files::open_regular(path) {
        Ok(f) => f,
        Err(devremap::inputs::files::FileError::Io(e)) if !required && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Config::default());
        }
        Err(e) => return Err(at(&e)),
    };
    let meta = file.metadata().map_err(|e| at(&io_message(&e)))?;
    let me = nix::unistd::geteuid().as_raw();
    config::check_access(meta.uid(), meta.mode(), me).map_err(|e| at(&e))?;
    let (dirs, real) = directories(path, &file, me).map_err(|e| at(&e))?;
    for dir in dirs {
        // A directory the path does not name is explained by where the path leads.
        let at = |what: &dyn std::fmt::Display| match dir == dir_of(path) {
            true => at(what),
            false => ConfigFileError::at(format!("{p} (leading to {})", real.display()), what),
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
    // Said here, naming the config, rather than as a `cannot run` that names no file (found
    // from outside). A bare name is looked up on PATH when it runs.
    let runtime = config.runtime.as_os_str().as_encoded_bytes();
    if runtime.contains(&0) {
        return Err(at(&"runtime: holds a NUL byte, which no path can"));
    }
    if config.runtime.is_absolute()
        && let Err(e) = std::fs::metadata(&config.runtime)
    {
        return Err(at(&format!("runtime: {}: {}", config.runtime.display(), io_message(&e))));
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
/// `path`, of each symlink met on the way (a link's writer can point it elsewhere), and of the
/// file actually `opened` (issue 29.6: a config symlinked into a user's directory was checked
/// only where the link lies); and that file's path. Each link must be root's or `me`'s: in a
/// sticky directory its owner could point it elsewhere. The path is resolved as the kernel
/// resolves it, component by component, so a link naming a directory on the way (`link/x`,
/// `link/../x`) is met as well as one at the end (attack 2 B5), and no more than 40 links.
fn directories(path: &Path, opened: &std::fs::File, me: u32) -> Result<(Vec<PathBuf>, PathBuf), WalkError> {
    use std::os::unix::ffi::OsStrExt;
    let mut dirs = vec![dir_of(path)];
    let mut resolved = match path.is_absolute() {
        true => PathBuf::from("/"),
        false => std::env::current_dir().map_err(|e| WalkError::Io("the working directory".into(), e))?,
    };
    // What is left to resolve, its next component last.
    let components = |p: &Path| -> Vec<PathBuf> {
        p.as_os_str()
            .as_bytes()
            .split(|b| *b == b'/')
            .rev()
            .map(|c| PathBuf::from(std::ffi::OsStr::from_bytes(c)))
            .collect()
    };
    let mut rest = components(path);
    let mut links = 0;
    while let Some(name) = rest.pop() {
        match name.as_os_str().as_bytes() {
            b"" | b"." => continue,
            b".." => {
                // `resolved` holds no link, so its parent is the directory `..` names.
                resolved.pop();
                continue;
            }
            _ => {}
        }
        let next = resolved.join(&name);
        let meta = std::fs::symlink_metadata(&next).map_err(|e| WalkError::Io(next.clone(), e))?;
        if !meta.file_type().is_symlink() {
            resolved = next;
            continue;
        }
        links += 1;
        if links > 40 {
            return Err(WalkError::TooManyLinks(next));
        }
        config::check_link_owner(&next.display().to_string(), meta.uid(), me)?;
        dirs.push(resolved.clone());
        let target = std::fs::read_link(&next).map_err(|e| WalkError::Io(next.clone(), e))?;
        if target.is_absolute() {
            resolved = PathBuf::from("/");
        }
        rest.extend(components(&target));
    }
    // The file opened (the walk above raced with whoever may change the links; the open did not).
    let fd = std::os::fd::AsRawFd::as_raw_fd(opened);
    let proc_fd = PathBuf::from(format!("/proc/self/fd/{fd}"));
    let real = std::fs::read_link(&proc_fd).map_err(|e| WalkError::Io(proc_fd, e))?;
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
