//! `devremapd`: the command line around the `devremap` library. Sets the logger up, parses
//! flags, and maps every error to one line `error: ...` and exit status 1.

mod cli;
mod containerd_config;
mod keeper;
mod logging;
mod memory;
mod mountpoint;
mod node;
mod parked;
mod record;
mod server;
mod session;
mod signals;
mod watch;
mod zygote;

use clap::Parser;
use cli::{Cli, Command};
use devremap::decision::escape::escape;
use devremap::decision::render;
use devremap::inputs::load;
use devremap::report::Failure;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

fn main() -> ExitCode {
    memory::malloc_settings();
    if let Err(e) = signals::swallow_write_faults() {
        let _ = writeln!(std::io::stderr(), "error: {e}");
        return ExitCode::FAILURE;
    }
    // A request handler's panic is answered with EIO and logged in one line by the adapter;
    // any other panic keeps the default report.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !devremap::served::adapter::answering() {
            default_hook(info);
        }
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version are not errors.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        // No arguments at all: the usage, whole, on stderr, and status 1 as for any bad input.
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::FAILURE;
        }
        // Every bad flag is bad input: one line, status 1.
        Err(e) => {
            // clap's message, up to its usage text, folded onto one line.
            let text = e.render().to_string();
            let words: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            // Not eprintln!, which panics when stderr cannot be written (a file at its size
            // limit, found from outside): the status says it.
            let _ = writeln!(std::io::stderr(), "{}", escape(&words.join(" ")));
            return ExitCode::FAILURE;
        }
    };
    // A spare keeper forks its server before the log writer, its second thread, starts.
    let parked = match &cli.command {
        Command::Parked(args) => Some(parked::start(args)),
        // Returns in a spare it forked; the zygote itself exits at its socket's end.
        Command::Zygote => Some(zygote::run().map_err(Into::into).and_then(|args| parked::start(&args))),
        _ => None,
    };
    // The daemon's processes read their signals from one thread (`signals::start`): blocked
    // before the log writer, the first other thread, starts.
    let daemon = matches!(
        cli.command,
        Command::Mount(_) | Command::Serve(_) | Command::Node(_) | Command::Parked(_) | Command::Zygote
    );
    if daemon && let Err(e) = signals::block() {
        let _ = writeln!(std::io::stderr(), "error: {e}");
        return ExitCode::FAILURE;
    }
    logging::init();
    let result = match cli.command {
        Command::Plan(args) => plan(&args),
        Command::Mount(args) => keeper::run(&args, std::env::args_os().skip(2).collect(), None).map_err(Failure::from),
        Command::Serve(args) => server::run(&args),
        Command::OciPatch(args) => oci_patch(&args),
        Command::Record(args) => record(&args),
        Command::CudaDeviceMap(args) => cuda_device_map(&args),
        Command::ContainerdConfig(args) => containerd_config::run(&args),
        Command::Node(args) => node::run(&args).map_err(Failure::from),
        Command::Ctl(args) => node::ctl::run(&args),
        Command::Parked(_) | Command::Zygote => parked.map_or(Ok(()), parked::run),
    };
    // The log lines first, then the error line after them; but a stderr that nobody reads
    // must not keep us from exiting.
    let drained = logging::flush(Duration::from_millis(200));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            // A server's load error is the keeper's to say: reported already.
            // Not eprintln!, which panics when stderr cannot be written (a log file on a full
            // disk): the exit status is what is left to tell.
            if let Some(line) = failure.line().filter(|_| drained) {
                let _ = writeln!(std::io::stderr(), "error: {}", escape(&line));
            }
            ExitCode::FAILURE
        }
    }
}

fn oci_patch(args: &cli::OciPatchArgs) -> Result<(), Failure> {
    let path = &args.config;
    let p = path.display();
    if args.in_place {
        // Before reading: a FIFO would block the read, and is never replaced.
        devremap::atomic::check_destination_named(path).map_err(|e| e.to_string())?;
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{p}: {}", devremap::io_message(&e)))?;
    let dev =
        std::path::absolute(&args.dev).map_err(|e| format!("{}: {}", args.dev.display(), devremap::io_message(&e)))?;
    if !args.allow_unmounted {
        mountpoint::check_devremap_mount(&dev).map_err(|why| {
            format!(
                "{}: not a live devremap mount ({why}); mount it with `devremapd mount` first, or pass --allow-unmounted to patch before it exists",
                dev.display()
            )
        })?;
    }
    let dev = dev.to_str().ok_or_else(|| format!("{}: not a UTF-8 path", dev.display()))?;
    // Only the /dev mount's text changes: a diff of the spec shows that and nothing else.
    let out = devremap::runtime::oci_patch::patch_text(&text, dev).map_err(|e| format!("{p}: {e}"))?;
    if !args.in_place {
        print!("{out}");
        return Ok(());
    }
    if out == text {
        return Ok(());
    }
    devremap::atomic::replace_file(path, out.as_bytes()).map_err(|e| Failure::Message(e.to_string()))
}

fn plan(args: &cli::PlanArgs) -> Result<(), Failure> {
    // A refusal, a failed check's too, is the one error line and nothing on stdout; with
    // `--relax` the JSON's `checks` say what every check found.
    let loaded = load::load(&sources_with_annotations(&args.inputs)?).map_err(|e| e.to_string())?;
    if args.json {
        let json = render::plan_json(&loaded.plan, loaded.metadata.as_ref());
        println!("{}", serde_json::Value::Object(json));
    } else {
        print!("{}", render::plan_text(&loaded.plan));
    }
    Ok(())
}

fn record(args: &cli::RecordArgs) -> Result<(), Failure> {
    if let Some(path) = &args.output {
        devremap::atomic::check_destination_named(path).map_err(|e| e.to_string())?;
    }
    let sources = load::Sources {
        metadata: args.metadata.clone(),
        spec: Some(args.spec.clone()),
        host_dev: args.host_dev.clone(),
        host_root: args.host_root.clone(),
        ..load::Sources::default()
    };
    let list = recorded(&sources)?;
    if args.metadata.is_none() {
        log::info!("recorded without --metadata: no names of an earlier restore are carried (earlier_minors left out)");
    }
    let text = format!("{list:#}\n");
    let Some(path) = &args.output else {
        print!("{text}");
        return Ok(());
    };
    devremap::atomic::replace_file(path, text.as_bytes()).map_err(|e| e.to_string())?;
    log::info!("recorded {} GPUs to {}", list.as_array().map_or(0, Vec::len), path.display());
    Ok(())
}

/// The record of a container's GPUs (`devremapd record`; the NRI plugin's `devremap.io/gpus`),
/// warning of what it lacks.
fn recorded(sources: &load::Sources) -> Result<serde_json::Value, Failure> {
    // The record says what the container has, not whether its restore was right: that was the
    // restore's to judge (and maybe relaxed), so the checks do not refuse it here.
    let loaded = load::load_unchecked(sources).map_err(|e| e.to_string())?;
    // An AMD GPU whose identity an unreadable topology hid is refused: found only at restore.
    devremap::decision::record::check(&loaded.plan).map_err(|e| e.to_string())?;
    if let Some(warning) = devremap::decision::record::unread_warning(&loaded.plan) {
        log::warn!("{warning}");
    }
    // Still recorded: a record without uuids pairs by minor.
    for gap in devremap::decision::record::gaps(&loaded.plan) {
        log::warn!("{}: {gap}", sources.host_root.display());
    }
    Ok(devremap::decision::record::devices(&loaded.plan, sources.metadata.is_some()))
}

/// The inputs of a reader of a container's spec (`plan`, `cuda-device-map`), with the spec's
/// annotations obeyed as the wrapper has its daemon obey them (issue 29.2): the pairing is
/// one decision. Every one is taken, since these readers grant nothing: the wrapper refuses
/// the container itself where its config does not let launchers set one.
fn sources_with_annotations(args: &cli::InputArgs) -> Result<load::Sources, Failure> {
    let mut sources = args.sources();
    if let Some(spec) = &args.spec {
        let value = load::read_spec_json(spec).map_err(|e| e.to_string())?;
        let request = devremap::runtime::annotations::parse(&value, &devremap::runtime::annotations::every_key())
            .and_then(|r| r.add_to(&mut sources).map(|()| r))
            .map_err(|e| format!("{}: {e}", spec.display()))?;
        for warning in request.warnings() {
            log::warn!("{}: {warning}", spec.display());
        }
    }
    Ok(sources)
}

fn cuda_device_map(args: &cli::InputArgs) -> Result<(), Failure> {
    let sources = sources_with_annotations(args)?;
    let loaded = load::load(&sources).map_err(|e| e.to_string())?;
    let map = devremap::family::nvidia::cuda_map::device_map(&loaded.plan).map_err(|e| {
        // A restored GPU's UUID comes from the host's driver files, a saved one's from the checkpoint.
        match (&e, &args.metadata) {
            (devremap::family::nvidia::cuda_map::CudaMapError::RestoredUuid { .. }, _) => {
                format!("{}: {e}", args.host_root.display())
            }
            (_, Some(metadata)) => format!("{}: {e}", metadata.display()),
            (_, None) => {
                "no saved GPUs: no --metadata given; cuda-device-map pairs the checkpoint's GPUs (--metadata: its \
                          devremap-gpus.json, or a gVisor checkpoint directory) with the restored ones \
                          (--spec or --host-dev)"
                    .to_owned()
            }
        }
    })?;
    println!("{map}");
    Ok(())
}
