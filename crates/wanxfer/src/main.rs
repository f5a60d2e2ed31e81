//! The `wanxfer` command line: parses flags into engine requests, shows progress, and maps
//! failures to exit codes. Transfer logic lives in `wanxfer-engine`.

mod args;
mod bench;
mod ops;
mod output;
mod secret;

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use wanxfer_engine::pool::Cancel;
use wanxfer_engine::progress::Progress;
use wanxfer_engine::session::{run_client, Server};
use wanxfer_engine::{Error, ErrorClass};

use args::{Cli, Command, CpArgs, ServeArgs};

/// Exit codes, one per failure class (documented in `--help` and the README).
pub mod exit {
    pub const OK: u8 = 0;
    pub const INTERNAL: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const AUTH: u8 = 3;
    pub const NETWORK: u8 = 4;
    pub const PROTOCOL: u8 = 5;
    pub const INTEGRITY: u8 = 6;
    pub const LOCAL_IO: u8 = 7;
    pub const REMOTE: u8 = 8;
}

fn exit_code(e: &Error) -> u8 {
    match e.class() {
        ErrorClass::Usage => exit::USAGE,
        ErrorClass::Auth => exit::AUTH,
        ErrorClass::Network => exit::NETWORK,
        ErrorClass::Protocol => exit::PROTOCOL,
        ErrorClass::Integrity => exit::INTEGRITY,
        ErrorClass::LocalIo => exit::LOCAL_IO,
        ErrorClass::Remote => exit::REMOTE,
        ErrorClass::Internal => exit::INTERNAL,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli);
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Cp(args) => cp(args),
        Command::Bench(args) => bench::run(&args),
        Command::Ls(args) => with_json_error(args.remote.json, ops::ls(&args)),
        Command::Stat(args) => with_json_error(args.remote.json, ops::stat(&args)),
        Command::Mkdir(args) => with_json_error(args.remote.json, ops::mkdir(&args)),
        Command::Rm(args) => with_json_error(args.remote.json, ops::rm(&args)),
        Command::Mv(args) => with_json_error(args.remote.json, ops::mv(&args)),
        Command::Sum(args) => with_json_error(args.remote.json, ops::sum(&args)),
    };
    match result {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            eprintln!("wanxfer: {}", output::cause_chain(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

fn init_logging(cli: &Cli) {
    let default = match &cli.command {
        Command::Serve(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn serve(args: ServeArgs) -> Result<(), Error> {
    let secret = secret::for_server(args.secret_file.as_deref())?;
    let server = Server::bind(&args.listen, &args.root, secret, args.limits())?;
    let addr = server.local_addr()?;
    // Tests and scripts read this line to learn the port when listening on port 0.
    println!("wanxfer serving {} on {addr}", args.root.display());
    tracing::info!("serving {} on {addr}", args.root.display());
    server.serve(&Cancel::default())
}

/// With `--json`, a failure is also one JSON object on stdout, as for `cp`.
fn with_json_error(json: bool, result: Result<(), Error>) -> Result<(), Error> {
    if let (true, Err(e)) = (json, &result) {
        output::print_error_json(e, exit_code(e));
    }
    result
}

fn cp(args: CpArgs) -> Result<(), Error> {
    let secret = secret::for_client(args.secret_file.as_deref())?;
    let request = args.request(secret)?;
    let progress = Arc::new(Progress::default());
    let bar = output::ProgressView::start(progress.clone(), args.show_progress());
    let result = run_client(&request.config, request.job, progress);
    bar.finish();
    match result {
        Ok(report) => {
            output::print_report(&report, &request.config.tuning, args.json);
            Ok(())
        }
        Err(e) => {
            if args.json {
                output::print_error_json(&e, exit_code(&e));
            }
            Err(e)
        }
    }
}
