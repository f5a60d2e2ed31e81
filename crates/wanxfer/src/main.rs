//! The `wanxfer` command line: parses flags into engine requests, shows progress, and maps
//! failures to exit codes. Transfer logic lives in `wanxfer-engine`.

mod args;
mod assets;
mod bench;
mod config;
mod metrics;
mod ops;
mod output;
mod progress_json;
mod secret;
mod tpc;
mod transfer_log;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use wanxfer_engine::auth::Grant;
use wanxfer_engine::pool::Cancel;
use wanxfer_engine::progress::Progress;
use wanxfer_engine::session::{run_client, ClientJob, PullDest, Server};
use wanxfer_engine::{Error, ErrorClass};

use args::{Cli, Command, CpArgs, LogFormat, ServeArgs};

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
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == assets::SUBCOMMAND) {
        return match assets::main(argv[1..].to_vec()) {
            Ok(()) => ExitCode::from(exit::OK),
            Err(e) => {
                eprintln!("wanxfer: {e}");
                ExitCode::from(exit::LOCAL_IO)
            }
        };
    }
    let cli = match config::parse(argv) {
        Ok(cli) => cli,
        Err(config::ParseFailure::Clap(e)) => e.exit(),
        Err(config::ParseFailure::Config(problems)) => {
            for p in problems {
                eprintln!("wanxfer: {p}");
            }
            return ExitCode::from(exit::USAGE);
        }
    };
    if let Command::Serve(ServeArgs {
        check_config: Some(file),
        ..
    }) = &cli.command
    {
        return check_config(file);
    }
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
        // Interrupted by a signal: the shell's convention, and the message was printed.
        Err(Error::Cancelled) => ExitCode::from(130),
        Err(e) => {
            eprintln!("wanxfer: {}", output::cause_chain(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// Log lines go to stderr, as text or JSON; colour only for a person at a terminal, so
/// that a log file, journald or a pipe never gets escape codes.
fn init_logging(cli: &Cli) {
    let default = match &cli.command {
        Command::Serve(_) => "info",
        // Quiet means nothing on success, warnings included; failures still say why.
        Command::Cp(args) if args.quiet => "error",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log().log_format {
        LogFormat::Text => {
            let colour = std::io::stderr().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            builder.with_ansi(colour).init();
        }
        LogFormat::Json => builder.json().flatten_event(true).with_ansi(false).init(),
    }
}

/// `serve --check-config FILE`: every problem on its own line, exit 2 if there is one.
fn check_config(file: &std::path::Path) -> ExitCode {
    match config::check(file) {
        Ok(settings) => {
            let s = if settings == 1 { "" } else { "s" };
            println!("{}: valid ({settings} setting{s})", file.display());
            ExitCode::from(exit::OK)
        }
        Err(problems) => {
            for p in problems {
                eprintln!("wanxfer: {p}");
            }
            ExitCode::from(exit::USAGE)
        }
    }
}

/// A token set by SIGINT or SIGTERM.
fn on_signal() -> Cancel {
    let cancel = Cancel::default();
    let set = cancel.clone();
    // Only fails if a handler is already installed, which this program never does twice.
    let _ = ctrlc::set_handler(move || set.cancel());
    cancel
}

fn serve(args: ServeArgs) -> Result<(), Error> {
    let tables = match &args.config {
        Some(file) => config::auth_tables(file)?,
        None => config::AuthTables::default(),
    };
    // With exports, --root is not needed: the first export stands for the server where
    // one directory is named (the default state directory, the start line).
    let first_export = tables.exports.first().map(|e| e.path.clone());
    let root = match (&first_export, &args.root) {
        (Some(_), Some(_)) => {
            return Err(Error::Usage(
                "give either --root (one directory, the shared secret reads and writes it) or \
                 [[export]] tables, not both"
                    .into(),
            ))
        }
        (Some(first), None) => first.as_path(),
        (None, _) => args.root()?,
    };
    // A server whose exports all name tokens or certificates has no use for a secret:
    // it needs none, and clients proving one are told so.
    let wants_secret = tables.exports.is_empty()
        || tables
            .exports
            .iter()
            .any(|e| e.read.iter().chain(&e.write).any(|g| *g == Grant::Secret));
    let secret = match (wants_secret, &args.secret_file) {
        (false, None) => secret::from_env().transpose()?,
        _ => Some(secret::for_server(args.secret_file.as_deref())?),
    };
    let mut limits = args.limits(root);
    if let Some((cert, key)) = args.identity.pair()? {
        limits.identity = Some(wanxfer_engine::tls::ServerIdentity::from_files(
            &cert, &key,
        )?);
    }
    limits.exports = tables.exports;
    limits.issuers = tables.issuers;
    let mut server = Server::bind(&args.listen, root, secret, limits.clone())?;
    let watchers = Watchers {
        log: args
            .transfer_log
            .as_deref()
            .map(transfer_log::TransferLog::open)
            .transpose()?,
        metrics: args
            .metrics_listen
            .as_ref()
            .map(|_| Arc::new(metrics::Metrics::new())),
    };
    if let (Some(metrics), Some(listen)) = (&watchers.metrics, &args.metrics_listen) {
        let at = metrics.serve(listen)?;
        tracing::info!("metrics at http://{at}/metrics");
    }
    if watchers.log.is_some() || watchers.metrics.is_some() {
        server = server.observe(Arc::new(watchers));
    }
    let addr = server.local_addr()?;
    // The one start line, on stdout: scripts and tests read the address from it (the port
    // when listening on port 0). It is not logged too, which would say it twice.
    println!("wanxfer serving {} on {addr}", root.display());
    let identity = server.identity();
    let made = if identity.created {
        ", created now"
    } else {
        ""
    };
    // What an operator hands to clients to compare with what they pin. Logged, not on
    // stdout, whose one line scripts read.
    tracing::info!(
        "TLS certificate fingerprint {} ({}{made})",
        identity.fingerprint,
        identity.origin
    );
    if args.allow_unencrypted {
        tracing::warn!(
            "--allow-unencrypted: clients may ask for plaintext; their files and names then \
             cross the network readable by anyone on the path (still authenticated)"
        );
    }
    if let Some(state) = &limits.state_dir {
        tracing::debug!("journals of interrupted transfers in {}", state.display());
    }
    // SIGTERM (systemd stopping the service) or Ctrl-C: drain, then exit 0.
    server.serve(&on_signal())
}

/// Who watches the server's sessions: the transfer log and the metrics, either or both.
struct Watchers {
    log: Option<transfer_log::TransferLog>,
    metrics: Option<Arc<metrics::Metrics>>,
}

impl wanxfer_engine::session::observe::Observer for Watchers {
    fn session_started(&self, session: &wanxfer_engine::session::observe::SessionInfo) {
        if let Some(m) = &self.metrics {
            m.session_started(session);
        }
    }

    fn session_ended(
        &self,
        session: &wanxfer_engine::session::observe::SessionInfo,
        end: &wanxfer_engine::session::observe::SessionEnd,
    ) {
        // The record first: whoever sees the metrics count a session finds its line.
        if let Some(log) = &self.log {
            log.session_ended(session, end);
        }
        if let Some(m) = &self.metrics {
            m.session_ended(session, end);
        }
    }

    fn connection_failed(&self, class: ErrorClass) {
        if let Some(m) = &self.metrics {
            m.connection_failed(class);
        }
    }

    fn partial_files_kept(&self, files: u64) {
        if let Some(m) = &self.metrics {
            m.partial_files_kept(files);
        }
    }
}

/// With `--json`, a failure is also one JSON object on stdout, as for `cp`.
fn with_json_error(json: bool, result: Result<(), Error>) -> Result<(), Error> {
    if let (true, Err(e)) = (json, &result) {
        output::print_error_json(e, exit_code(e), None);
    }
    result
}

fn cp(args: CpArgs) -> Result<(), Error> {
    if let Some(request) = args.third_party()? {
        return third_party_cp(&args, &request);
    }
    let (secret, credential) =
        secret::for_client_with(args.secret_file.as_deref(), &args.security)?;
    let mut request = args.request(secret)?;
    request.config.credential = credential;
    if args.dry_run {
        return output::print_dry_run(&request.config, &request.job, args.json);
    }
    request.config.cancel = on_signal();
    let progress = Arc::new(Progress::default());
    let lines = start_progress_json(&args, &progress)?;
    let bar = output::ProgressView::start(progress.clone(), args.show_progress());
    let result = run_client(&request.config, request.job, progress);
    bar.finish();
    if let Some(lines) = lines {
        let (report, error) = match &result {
            Ok(report) => (Some(report), None),
            Err(failed) => (Some(&*failed.report), Some(&failed.error)),
        };
        if let (Some(note), false) = (lines.finish(report, error), args.quiet) {
            eprintln!("wanxfer: {note}");
        }
    }
    match result {
        Ok(report) => {
            output::print_report(&report, &request.config.tuning, args.json, args.quiet);
            Ok(())
        }
        Err(failed) => {
            let e = failed.error;
            if args.json {
                output::print_error_json(&e, exit_code(&e), Some(&failed.report));
            }
            if request.config.cancel.is_cancelled() {
                eprintln!(
                    "wanxfer: interrupted; what arrived is kept. Run the same command again to resume:\n  {}",
                    output::command_line()
                );
                return Err(Error::Cancelled);
            }
            Err(e)
        }
    }
}

/// `--progress-json`'s writer, if asked for.
fn start_progress_json(
    args: &CpArgs,
    progress: &Arc<Progress>,
) -> Result<Option<progress_json::ProgressJson>, Error> {
    args.progress_json
        .as_deref()
        .map(|target| {
            let fabric = args.transport.transport != args::TransportArg::Tcp;
            progress_json::ProgressJson::start(target, progress.clone(), fabric)
        })
        .transpose()
}

/// `cp` between two servers: the same progress, report, JSON and exit codes as `cp`.
fn third_party_cp(args: &CpArgs, request: &args::ThirdPartyRequest) -> Result<(), Error> {
    if args.dry_run {
        // What the source would walk: its listing, as a pull's dry run takes it.
        let listing = ClientJob::Pull {
            sources: request.sources.clone(),
            synthetic_bytes: None,
            dest: PullDest::Discard,
        };
        return output::print_dry_run(&request.source, &listing, args.json);
    }
    let cancel = on_signal();
    let progress = Arc::new(Progress::default());
    let lines = start_progress_json(args, &progress)?;
    let bar = output::ProgressView::start(progress.clone(), args.show_progress());
    let result = tpc::run(request, &progress, &cancel);
    bar.finish();
    if let Some(lines) = lines {
        let (report, error) = match &result {
            Ok(report) => (Some(report), None),
            Err((e, report)) => (Some(&**report), Some(e)),
        };
        if let (Some(note), false) = (lines.finish(report, error), args.quiet) {
            eprintln!("wanxfer: {note}");
        }
    }
    match result {
        Ok(report) => {
            output::print_report(&report, &request.source.tuning, args.json, args.quiet);
            Ok(())
        }
        Err((e, report)) => {
            if args.json {
                output::print_error_json(&e, exit_code(&e), Some(&report));
            }
            if cancel.is_cancelled() {
                eprintln!(
                    "wanxfer: interrupted; what arrived is kept. Run the same command again to resume:\n  {}",
                    output::command_line()
                );
                return Err(Error::Cancelled);
            }
            Err(e)
        }
    }
}
