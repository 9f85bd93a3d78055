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

use devremap::install::containerd::{self, ConfigError, Entry};
use devremap::report::Failure;
use std::ffi::OsString;
use std::io;
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
    let on_host = |p: &Path| args.host_root.join(p.strip_prefix("/").unwrap_or(p));
    let path = on_host(&args.config);
    let shown = path.display().to_string();
    let entry_text = std::fs::read_to_string(&args.entry)
        .map_err(|e| format!("{}: {}", args.entry.display(), devremap::io_message(&e)))?;
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
            Some((std::fs::read_to_string(&path).map_err(|e| format!("{shown}: {}", devremap::io_message(&e)))?, meta))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{shown}: {}", devremap::io_message(&e)).into()),
    };
    let text = old.as_ref().map(|(t, _)| t.as_str());
    let edited = containerd::add_handler(&shown, text, &entry).map_err(line)?;
    if let Some(text) = text {
        let read = |p: &Path| {
            let p = on_host(p);
            if !std::fs::metadata(&p)?.is_file() {
                return Err(io::Error::other("not a regular file"));
            }
            std::fs::read_to_string(p)
        };
        let list = |d: &Path| -> io::Result<Vec<OsString>> {
            std::fs::read_dir(on_host(d))?.map(|e| e.map(|e| e.file_name())).collect()
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

fn line(e: ConfigError) -> Failure {
    Failure::Message(e.to_string())
}
