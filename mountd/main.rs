//! `devremapd`: the command line around the `devremap` library. Sets the logger up, parses
//! flags, and maps every error to one line `error: ...` and exit status 1.

mod cli;
mod daemon;

use clap::Parser;
use cli::{Cli, Command};
use devremap::load;
use devremap::render;
use std::process::ExitCode;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info,fuser=warn"))
        .format_timestamp_millis()
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version are not errors.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        // Every bad flag is bad input: one line, status 1.
        Err(e) => {
            let text = e.render().to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: invalid arguments"));
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Plan(args) => plan(&args),
        Command::Mount(args) => daemon::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn plan(args: &cli::PlanArgs) -> Result<(), String> {
    let loaded = load::load(&args.inputs.sources()).map_err(|e| e.to_string())?;
    if args.json {
        let json = render::plan_json(&loaded.plan, loaded.metadata.as_ref());
        println!("{}", serde_json::Value::Object(json));
    } else {
        print!("{}", render::plan_text(&loaded.plan));
    }
    Ok(())
}
