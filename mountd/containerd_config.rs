//! `devremapd containerd-config`: the files around [`devremap::install::containerd`]. Reads
//! containerd's config.toml and what it imports (under `--host-root`), writes the edited config
//! through [`devremap::atomic`] (by a rename, never through a symlink, keeping mode and owner),
//! and prints `changed` or `unchanged` for node-setup.sh to restart containerd only on a change.
//!
//! The backup `config.toml.before-devremap` is the config as it was before devremap first
//! added its handler: written (with the config's mode and owner) by the change that adds it,
//! never by one that replaces devremap's own handler, and never over a file already there (an
//! earlier install's backup, or the operator's file of that name, are both kept as they are).
//! Something other than a regular file there is refused before anything is written.

use devremap::inputs::files::SmallText;
use devremap::install::containerd::{self, ConfigError, Entry};
use devremap::report::Failure;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub fn run(args: &crate::cli::ContainerdConfigArgs) -> Result<(), Failure> {
    if !args.config.is_absolute() {
        return Err(format!(
            "--config {}: not an absolute path (the config as the host sees it)",
            args.config.display()
        )
        .into());
    }
    // containerd runs BinaryName as written, from its own directory: an empty or relative one
    // would run something else, or the plain runtime (found from outside).
    if let Some(runtime) = args.runtime.as_deref().filter(|r| !Path::new(r).is_absolute()) {
        return Err(format!("--runtime {runtime:?}: not an absolute path (containerd runs it as written)").into());
    }
    let root = &args.host_root;
    if let Err(e) = std::fs::metadata(root) {
        return Err(format!("--host-root {}: {}", root.display(), devremap::io_message(&e)).into());
    }
    let path =
        on_host(root, &args.config).map_err(|e| format!("{}: {}", args.config.display(), devremap::io_message(&e)))?;
    let shown = path.display().to_string();
    // A regular file, read up to 64 KiB (the package's is a few lines): a FIFO named by
    // mistake is refused, not waited on.
    let entry_text = match devremap::inputs::files::read_small_text(&args.entry, 64 << 10) {
        SmallText::Text(text) => text,
        SmallText::TooLarge => {
            return Err(format!("{}: over 64 KiB; not a containerd entry", args.entry.display()).into());
        }
        SmallText::Unreadable => {
            let why = devremap::inputs::files::open_regular(&args.entry)
                .map_or_else(|e| e.to_string(), |_| "cannot be read as UTF-8 text".to_owned());
            return Err(format!("{}: {why}", args.entry.display()).into());
        }
    };
    let entry = Entry::parse(&args.entry.display().to_string(), &entry_text, args.runtime.as_deref()).map_err(line)?;
    let by_hand = || format!("add the tables of {} to the file containerd reads by hand", entry.path);
    let old = match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(format!(
                "{shown}: is a symlink, not a regular file: its target is not this setup's to rewrite; {}",
                by_hand()
            )
            .into());
        }
        Ok(meta) if !meta.is_file() => {
            let what = devremap::inputs::files::describe(meta.mode());
            return Err(format!("{shown}: is {what}, not a regular file; {}", by_hand()).into());
        }
        Ok(meta) => {
            let text = std::fs::File::open(&path).and_then(|mut f| read_config(&mut f));
            Some((text.map_err(|e| format!("{shown}: {}", devremap::io_message(&e)))?, meta))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{shown}: {}", devremap::io_message(&e)).into()),
    };
    let text = old.as_ref().map(|(t, _)| t.as_str());
    let edited = containerd::add_handler(&shown, text, &entry).map_err(line)?;
    if let Some(text) = text {
        let read = |p: &Path| {
            let mut file = std::fs::File::from(open_in_root(root, p, OFlags::RDONLY | OFlags::NONBLOCK)?);
            if !file.metadata()?.is_file() {
                return Err(io::Error::other("not a regular file"));
            }
            read_config(&mut file)
        };
        let list = |d: &Path| -> io::Result<Vec<OsString>> {
            let dir = open_in_root(root, d, OFlags::RDONLY | OFlags::DIRECTORY)?;
            std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))?.map(|e| e.map(|e| e.file_name())).collect()
        };
        containerd::check_imports(&args.config, text, &entry, read, list).map_err(line)?;
    }
    let backup = PathBuf::from(format!("{shown}.before-devremap"));
    let make_backup = match (&old, edited.had_ours) {
        (Some(_), false) => match std::fs::symlink_metadata(&backup) {
            Ok(meta) if meta.is_file() => false,
            Ok(meta) => {
                let what = devremap::inputs::files::describe(meta.mode());
                return Err(format!(
                    "{}: is {what}, not a regular file; refused: the setup keeps {shown} as it was there: remove it",
                    backup.display()
                )
                .into());
            }
            Err(_) => true,
        },
        _ => false,
    };
    if args.dry_run {
        print!("{}", edited.text);
        return Ok(());
    }
    if text == Some(edited.text.as_str()) {
        println!("unchanged");
        return Ok(());
    }
    match &old {
        Some((text, meta)) if make_backup => {
            let access = devremap::device::Access { mode: meta.mode(), uid: meta.uid(), gid: meta.gid() };
            devremap::atomic::write_atomic_as(&backup, text.as_bytes(), Some(access))
                .map_err(|e| format!("{}: cannot write: {}", backup.display(), devremap::io_message(&e)))?;
            log::info!("{shown} as it was: {}", backup.display());
        }
        Some(_) if !edited.had_ours => {
            log::info!("{}: kept as it was (an earlier install's, or not devremap's)", backup.display())
        }
        Some(_) => {}
        None => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {}", dir.display(), devremap::io_message(&e)))?;
            }
        }
    }
    devremap::atomic::replace_file(&path, edited.text.as_bytes()).map_err(|e| e.to_string())?;
    let did = if edited.had_ours {
        "replaced devremap's runtime handler in"
    } else {
        "added the runtime handler devremap to"
    };
    log::info!("{did} {shown}");
    println!("changed");
    Ok(())
}

/// Opens `p`, a path as the host sees it, under `root` (`--host-root`), every symlink on the
/// way resolved there as the host would resolve it (`RESOLVE_IN_ROOT`): an absolute symlink
/// in the host's tree (`/etc/containerd -> /opt/ctd`) names the host's `/opt/ctd`, not ours
/// (found from outside: the setup rewrote a config outside `--host-root` and said `changed`).
fn open_in_root(root: &Path, p: &Path, flags: OFlags) -> io::Result<OwnedFd> {
    let top = rustix::fs::open(root, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
    let rel = p.strip_prefix("/").unwrap_or(p);
    let rel = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
    Ok(rustix::fs::openat2(&top, rel, flags | OFlags::CLOEXEC, Mode::empty(), ResolveFlags::IN_ROOT)?)
}

/// Where the host's file `p` is here: its directory resolved under `root` ([`open_in_root`]),
/// then its name, not followed (the config itself is refused when it is a symlink). Where the
/// directory, or some directories above it, do not exist yet, the nearest one that does is
/// resolved and the rest added to it (they are made later, where nothing can redirect them
/// but another root process).
fn on_host(root: &Path, p: &Path) -> io::Result<PathBuf> {
    let name = p.file_name().ok_or_else(|| io::Error::other("names no file"))?;
    let mut dir = p.parent().unwrap_or(Path::new("/")).to_path_buf();
    let mut missing = Vec::new();
    loop {
        match open_in_root(root, &dir, OFlags::PATH | OFlags::DIRECTORY) {
            Ok(fd) => {
                let mut here = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
                here.extend(missing.iter().rev());
                return Ok(here.join(name));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let Some(last) = dir.file_name().map(OsString::from) else { return Err(e) };
                missing.push(last);
                dir.pop();
            }
            Err(e) => return Err(e),
        }
    }
}

fn line(e: ConfigError) -> Failure {
    Failure::Message(e.to_string())
}

/// The most of a containerd config, or of a file it imports, read: a node's are a few KiB.
const CONFIG_LIMIT: u64 = 16 << 20;

/// A config's text, refused past [`CONFIG_LIMIT`] rather than read whole (found from outside: a
/// 4 GiB sparse `config.toml` ended the command with an allocation failure).
fn read_config(file: &mut std::fs::File) -> io::Result<String> {
    let mut text = String::new();
    io::Read::read_to_string(&mut io::Read::take(file, CONFIG_LIMIT + 1), &mut text)?;
    if text.len() as u64 > CONFIG_LIMIT {
        return Err(io::Error::other(format!(
            "over {} MiB, more than a containerd config holds; refused",
            CONFIG_LIMIT >> 20
        )));
    }
    Ok(text)
}
