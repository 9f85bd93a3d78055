//! `devremapd ctl`: the operator's client of the node daemon. `list` prints one JSON object per
//! container, `reload [ID]` one per container reloaded (exit status 1 when one was refused or
//! did not finish in time, with an error line naming it), `status ID` one object: the entry
//! and its state file.

use crate::cli::{CtlArgs, CtlCommand};
use devremap::node::client::ask;
use devremap::node::protocol::Request;
use devremap::report::Failure;
use serde_json::Value;
use std::io::Write;
use std::time::Duration;

/// Longer than the daemon's own wait for a reload.
const TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(args: &CtlArgs) -> Result<(), Failure> {
    let request = match &args.command {
        CtlCommand::List => Request::List,
        CtlCommand::Reload { id } => Request::Reload { id: id.clone() },
        CtlCommand::Status { id } => Request::Status { id: id.clone() },
    };
    let data = ask(&args.socket, &request, TIMEOUT).map_err(|e| e.to_string())?;
    let entries = match data {
        Value::Array(entries) => entries,
        one => vec![one],
    };
    let mut refused = Vec::new();
    let (mut out, mut reader_gone) = (std::io::stdout().lock(), false);
    for entry in &entries {
        // A reader that has had enough (`| head`) ends the printing quietly, not the command
        // (found from outside: `println!` panicked, `failed printing to stdout: Broken pipe`).
        match writeln!(out, "{entry}") {
            _ if reader_gone => {}
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => reader_gone = true,
            Err(e) => return Err(Failure::Message(format!("stdout: {}", devremap::io_message(&e)))),
            Ok(()) => {}
        }
        // A reload refused, or none finished (the keeper stopped, its state dir full).
        let why = entry["reload_unfinished"].as_str().or(entry["last_error"].as_str());
        if let (CtlCommand::Reload { .. }, Some(why)) = (&args.command, why) {
            refused.push(format!("container {}: {why}", entry["id"].as_str().unwrap_or_default()));
        }
    }
    if refused.is_empty() { Ok(()) } else { Err(Failure::Message(refused.join("; "))) }
}
