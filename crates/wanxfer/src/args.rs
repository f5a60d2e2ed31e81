//! Flags in two stages: clap's structs close to the command line, then validated engine
//! requests ([`CpArgs::request`]) so that the engine never sees a half-checked value.
//!
//! Defaults come from the engine's own `Tuning::default()` and `ServerLimits::default()`
//! rather than being written here again: a default changed in the engine is what `--help`
//! shows and what a run without the flag gets. Only what the engine has no default for
//! (the port, the connect timeout, the provider name) is defined here, once.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use wanxfer_engine::fs::WriteMode;
use wanxfer_engine::ops::{server_address, RemoteUrl};
use wanxfer_engine::preserve::Preserve;
use wanxfer_engine::select::parse_file_list;
use wanxfer_engine::session::{
    ClientConfig, ClientCredential, ClientJob, PullDest, RetryPolicy, ServerLimits, Transport,
    Tuning, DEFAULT_IDLE_TIMEOUT,
};
use wanxfer_engine::source::{IoMode, Source};
use wanxfer_engine::Error;
use wanxfer_proto::ops::ChecksumAlgorithm;
use wanxfer_proto::{Compare, RelPath, SelectRule, Selection};

pub use wanxfer_proto::DEFAULT_PORT;
/// Seconds a client waits for a connection (`cp`, `bench`).
pub const DEFAULT_CONNECT_TIMEOUT_S: u64 = 10;
/// The libfabric provider asked for, or offered, by `--transport fabric`: the one every
/// machine has (RDMA hardware wants `verbs`).
pub const DEFAULT_PROVIDER: &str = "tcp";

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  internal error (a bug: please report it)
  2  usage: bad flags or arguments
  3  authentication failed (secret mismatch)
  4  network: cannot connect, or the peer went away
  5  protocol: the peer sent something malformed, or the path altered a TLS record
  6  integrity: a checksum or digest did not match
  7  local I/O: reading or writing a local file failed (disk full, permissions)
  8  remote: the server refused (path outside its root, missing) or failed on its side";

#[derive(Debug, Parser)]
#[command(
    name = "wanxfer",
    version,
    about = "Move datasets between data transfer nodes at line rate.",
    after_help = EXIT_CODES
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

const SERVE_ABOUT: &str = "\
Serve one directory to authenticated clients.

Settings can come from a TOML file (--config FILE): every flag below is a key, named as
the long flag without its dashes (`max-sessions = 16`; `max_sessions` is accepted too),
with the value the flag would take: a string or a number (`max-session-memory =
\"512MiB\"`), true or false for a flag without a value. Flags given on the command line
win over the file. --check-config FILE checks a file the same way and exits 0, or 2
naming each key that is unknown, of the wrong type or refused by its flag.";

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve one directory to authenticated clients.
    #[command(after_help = EXIT_CODES, long_about = SERVE_ABOUT)]
    Serve(ServeArgs),
    /// Copy files and trees to or from a server (like `cp -r`).
    #[command(after_help = EXIT_CODES)]
    Cp(CpArgs),
    /// Measure memory-to-memory throughput and CPU over block size × depth × streams.
    #[command(after_help = EXIT_CODES)]
    Bench(crate::bench::BenchArgs),
    /// List a remote directory (in the server's order; pipe through sort for another).
    #[command(after_help = EXIT_CODES)]
    Ls(LsArgs),
    /// Show a remote entry's kind, size, mode, mtime and symlink target (never followed).
    #[command(after_help = EXIT_CODES)]
    Stat(StatArgs),
    /// Create remote directories.
    #[command(after_help = EXIT_CODES)]
    Mkdir(MkdirArgs),
    /// Remove remote files, or directories with -r (symlinks are removed, never followed).
    #[command(after_help = EXIT_CODES)]
    Rm(RmArgs),
    /// Rename or move within one server (into DST when it is an existing directory).
    #[command(after_help = EXIT_CODES)]
    Mv(MvArgs),
    /// Print remote files' checksums, computed by the server next to the data.
    #[command(after_help = EXIT_CODES)]
    Sum(SumArgs),
}

/// What every remote operation takes.
#[derive(Debug, Args)]
pub struct RemoteArgs {
    /// Shared secret file (else WANXFER_SECRET).
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Print JSON: one object per line (per entry for ls, per operand otherwise).
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for a connection and its handshake.
    #[arg(long, default_value_t = DEFAULT_CONNECT_TIMEOUT_S)]
    pub connect_timeout: u64,
    /// Seconds a silent server is waited for (a long checksum or removal is not silence:
    /// the server reports progress).
    #[arg(long, value_name = "SECONDS", default_value_t = Tuning::default().stall_timeout.as_secs())]
    pub stall_timeout: u64,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

impl RemoteArgs {
    pub fn config(&self, server: &str, secret: Vec<u8>) -> ClientConfig {
        let tuning = Tuning {
            stall_timeout: Duration::from_secs(self.stall_timeout.max(2)),
            ..Tuning::default()
        };
        let mut config = ClientConfig::new(server.to_string(), secret, tuning);
        config.connect_timeout = Duration::from_secs(self.connect_timeout.max(1));
        config.security = self.security.security(false);
        config.client_cert = self.security.identity.pair().ok().flatten();
        config
    }
}

/// How a client protects its connections.
#[derive(Debug, Args)]
pub struct SecurityArgs {
    /// Send everything in plaintext (the server must allow it with --allow-unencrypted):
    /// anyone on the path can read the files and their names. Every control frame and
    /// block still carries a MAC, so changes on the path are caught.
    #[arg(long)]
    pub no_encryption: bool,
    /// Verify the server's certificate against these CA certificates (PEM) and its host
    /// name, instead of pinning its fingerprint on first use (in the state directory's
    /// known_hosts).
    #[arg(long, value_name = "FILE", conflicts_with = "no_encryption")]
    pub ca: Option<PathBuf>,
    /// Authenticate with this bearer token (a JWT, WLCG/SciTokens profile) instead of the
    /// shared secret. Without it and without a secret, the WLCG discovery is followed:
    /// BEARER_TOKEN, BEARER_TOKEN_FILE, then $XDG_RUNTIME_DIR/bt_u<UID>. Sent only over
    /// TLS, to a server verified by --ca or already pinned.
    #[arg(long, value_name = "FILE", conflicts_with = "no_encryption")]
    pub token: Option<PathBuf>,
    #[command(flatten)]
    pub identity: CertArgs,
}

/// The certificate this side presents in TLS: `serve`'s own identity, or a client's for
/// mutual TLS (the server then knows it by the certificate's subject DN).
#[derive(Debug, Clone, Args)]
pub struct CertArgs {
    /// The certificate chain (PEM) this side presents in TLS; with --key. A server without
    /// one creates a key and a self-signed certificate in its state directory on first
    /// start and prints the fingerprint clients pin; a client with one authenticates by
    /// it (mutual TLS) when it has no token, to a server started with --client-ca.
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// The private key (PEM) of --cert.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
}

impl CertArgs {
    /// Both files, or neither. Checked here rather than by clap's `requires`, which
    /// would also refuse a configuration file's keys checked one at a time.
    pub fn pair(&self) -> Result<Option<(PathBuf, PathBuf)>, Error> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Ok(Some((cert.clone(), key.clone()))),
            (None, None) => Ok(None),
            _ => Err(Error::Usage(
                "--cert and --key (or the keys cert and key) go together".into(),
            )),
        }
    }
}

impl SecurityArgs {
    /// The engine's setting; says loudly on stderr when there is no encryption.
    pub fn security(&self, quiet: bool) -> wanxfer_engine::tls::ClientSecurity {
        if self.no_encryption {
            if !quiet {
                eprintln!(
                    "wanxfer: WARNING: --no-encryption: file contents and names cross the \
                     network in plaintext (tampering is still detected)"
                );
            }
            wanxfer_engine::tls::ClientSecurity::Unencrypted
        } else {
            wanxfer_engine::tls::ClientSecurity::Tls {
                ca: self.ca.clone(),
            }
        }
    }
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Long listing: mode, size, mtime (UTC), symlink targets.
    #[arg(short = 'l')]
    pub long: bool,
    /// Recurse into subdirectories (never into symlinks); paths relative to URL.
    #[arg(short = 'R')]
    pub recursive: bool,
    /// wanxfer://HOST:PORT/PATH ...
    #[arg(required = true, value_name = "URL")]
    pub urls: Vec<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Debug, Args)]
pub struct StatArgs {
    /// wanxfer://HOST:PORT/PATH ...
    #[arg(required = true, value_name = "URL")]
    pub urls: Vec<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Debug, Args)]
pub struct MkdirArgs {
    /// Create missing parents; an existing directory is no error.
    #[arg(short = 'p', long)]
    pub parents: bool,
    /// Permission bits (octal), before the server's umask; set-id and sticky bits are
    /// dropped by the server.
    #[arg(short = 'm', long, default_value = "755", value_parser = parse_mode)]
    pub mode: u32,
    /// wanxfer://HOST:PORT/PATH ...
    #[arg(required = true, value_name = "URL")]
    pub urls: Vec<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Debug, Args)]
pub struct RmArgs {
    /// Remove directories and everything beneath them.
    #[arg(short = 'r', short_alias = 'R', long)]
    pub recursive: bool,
    /// Remove empty directories too.
    #[arg(short = 'd', long)]
    pub dir: bool,
    /// wanxfer://HOST:PORT/PATH ...
    #[arg(required = true, value_name = "URL")]
    pub urls: Vec<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Debug, Args)]
pub struct MvArgs {
    /// wanxfer://HOST:PORT/PATH to move.
    #[arg(value_name = "SRC")]
    pub source: PathBuf,
    /// wanxfer://HOST:PORT/PATH on the same server: the new name, or an existing
    /// directory to move SRC into.
    #[arg(value_name = "DST")]
    pub dest: PathBuf,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Debug, Args)]
pub struct SumArgs {
    /// xxh3 (XXH3-128, as `xxhsum -H2`), adler32 (8 hex digits, as Rucio), crc32c, md5.
    #[arg(short = 'a', long, value_enum, default_value = "xxh3")]
    pub algorithm: AlgorithmArg,
    /// wanxfer://HOST:PORT/PATH ...
    #[arg(required = true, value_name = "URL")]
    pub urls: Vec<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AlgorithmArg {
    Xxh3,
    Adler32,
    Crc32c,
    Md5,
}

impl AlgorithmArg {
    pub fn algorithm(self) -> ChecksumAlgorithm {
        match self {
            AlgorithmArg::Xxh3 => ChecksumAlgorithm::Xxh3,
            AlgorithmArg::Adler32 => ChecksumAlgorithm::Adler32,
            AlgorithmArg::Crc32c => ChecksumAlgorithm::Crc32c,
            AlgorithmArg::Md5 => ChecksumAlgorithm::Md5,
        }
    }
}

/// An octal mode such as `755` or `0750`.
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{s:?} is not an octal mode (e.g. 755)"))
}

impl Cli {
    /// The logging flags of the command being run.
    pub fn log(&self) -> LogArgs {
        match &self.command {
            Command::Serve(a) => a.log.clone(),
            Command::Cp(a) => a.log.clone(),
            Command::Bench(a) => a.log.clone(),
            Command::Ls(a) => a.remote.log.clone(),
            Command::Stat(a) => a.remote.log.clone(),
            Command::Mkdir(a) => a.remote.log.clone(),
            Command::Rm(a) => a.remote.log.clone(),
            Command::Mv(a) => a.remote.log.clone(),
            Command::Sum(a) => a.remote.log.clone(),
        }
    }
}

/// How log lines on stderr are written.
#[derive(Debug, Clone, Default, Args)]
pub struct LogArgs {
    /// Log lines on stderr as text, or as one JSON object per line for a log collector.
    /// RUST_LOG sets the level (serve logs at info, cp and bench at warn).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Plain lines, coloured only when stderr is a terminal (and NO_COLOR is unset).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, message and fields.
    Json,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Read settings from this TOML file (see above); flags given here win over it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Check this configuration file and exit: 0 if it is valid, else 2 naming each bad key.
    #[arg(long, value_name = "FILE", exclusive = true)]
    pub check_config: Option<PathBuf>,
    /// The directory served: nothing outside it is ever read or written. Required, here
    /// or as `root` in the configuration file.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Address and port to listen on (0.0.0.0 for every IPv4 address, [::] for every
    /// address).
    #[arg(long, value_name = "HOST:PORT", default_value = default_listen(), value_parser = parse_listen)]
    pub listen: String,
    /// Shared secret file; created (mode 0600, random secret) if missing. Without it the
    /// secret comes from WANXFER_SECRET.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    #[command(flatten)]
    pub identity: CertArgs,
    /// Ask clients for an X.509 certificate issued by these CAs (PEM): a client that
    /// presents one is known by its subject DN (`dn:...` in an export's read and write
    /// lists). Clients with the secret or a token still present none.
    #[arg(long, value_name = "FILE")]
    pub client_ca: Option<PathBuf>,
    /// This server's name in bearer tokens' `aud` (repeat for several); tokens for
    /// https://wlcg.cern.ch/jwt/v1/any are accepted too. Issuers and their keys are
    /// `[[issuer]]` tables of the configuration file.
    #[arg(long, value_name = "AUDIENCE")]
    pub audience: Vec<String>,
    /// Also accept clients that ask for no encryption (cp --no-encryption): their files
    /// and names cross the network in plaintext, authenticated but readable by anyone on
    /// the path. Encrypted clients are served as usual.
    #[arg(long)]
    pub allow_unencrypted: bool,
    /// Give pushed files the owner and group a client sends with `cp --preserve
    /// owner,group` or `-a` (running as root). Off by default: any client allowed to
    /// write could otherwise hand files to any user, root included; without it pushed
    /// files stay this server's and the client is told why.
    #[arg(long)]
    pub accept_owners: bool,
    /// Most concurrent sessions.
    #[arg(long, default_value_t = ServerLimits::default().max_sessions)]
    pub max_sessions: usize,
    /// Most data channels one session may open.
    #[arg(long, default_value_t = ServerLimits::default().max_streams)]
    pub max_streams: u16,
    /// Largest block a client may ask for.
    #[arg(long, value_name = "SIZE", default_value = size_text(ServerLimits::default().max_block_size.into()), value_parser = parse_block_size)]
    pub max_block_size: u32,
    /// Most memory one session's block pool may use.
    #[arg(long, value_name = "SIZE", default_value = size_text(ServerLimits::default().max_session_memory), value_parser = parse_size)]
    pub max_session_memory: u64,
    /// Disk reader threads per sending session.
    #[arg(long, default_value_t = ServerLimits::default().readers)]
    pub readers: usize,
    /// Disk writer threads per receiving session.
    #[arg(long, default_value_t = ServerLimits::default().writers)]
    pub writers: usize,
    /// How pulls send file bytes.
    #[arg(long, value_enum, default_value_t = IoArg::from(ServerLimits::default().io))]
    pub io: IoArg,
    /// How pushed files are written.
    #[arg(long, value_enum, default_value_t = WriteArg::from(ServerLimits::default().write))]
    pub write: WriteArg,
    /// `--transport fabric` offers libfabric channels as well as TCP.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// Seconds a silent client (cut link, crashed host) is waited for.
    #[arg(long, value_name = "SECONDS", default_value_t = ServerLimits::default().stall_timeout.as_secs())]
    pub stall_timeout: u64,
    /// How long a client that is alive but moves nothing (keepalives only) keeps its
    /// session, its slot and its reserved space; 0 for ever.
    #[arg(long, value_name = "DURATION", default_value = duration_text(DEFAULT_IDLE_TIMEOUT), value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Where journals of interrupted transfers are kept (default: beside a client's
    /// state, one directory per served root).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// How long the partial files of an abandoned transfer are kept for it to resume;
    /// after that they are removed (and the removal logged).
    #[arg(long, value_name = "DURATION", default_value = duration_text(ServerLimits::default().keep_partial), value_parser = parse_duration)]
    pub keep_partial: Duration,
    /// Acknowledge pushed files before they reach the disk: for scratch space only, where
    /// losing recent files in a crash does not matter.
    #[arg(long)]
    pub no_fsync: bool,
    /// Time a connection has for its whole handshake, however slowly it sends.
    #[arg(long, value_name = "DURATION", default_value = duration_text(ServerLimits::default().handshake_timeout), value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Connections not yet authenticated, in all (beyond it the oldest is dropped).
    #[arg(long, default_value_t = ServerLimits::default().max_pending)]
    pub max_pending: usize,
    /// Connections not yet authenticated from one address.
    #[arg(long, default_value_t = ServerLimits::default().max_pending_per_address)]
    pub max_pending_per_address: usize,
    /// Append one JSON line per session to this file (times, peer, identity, direction,
    /// paths, files, bytes, streams, transport, encryption, rate, result, error class).
    /// A file moved away (logrotate) is noticed at the next record and created anew.
    #[arg(long, value_name = "FILE")]
    pub transfer_log: Option<PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://HOST:PORT/metrics.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    pub metrics_listen: Option<String>,
    #[command(flatten)]
    pub log: LogArgs,
}

/// Which data channels to use (cp, bench) or offer (serve).
#[derive(Debug, Clone, Args)]
pub struct TransportArgs {
    /// Data channels: parallel TCP streams, or libfabric endpoints moving blocks by RDMA
    /// write (RoCE, InfiniBand, iWARP through `verbs`; the `tcp` provider anywhere).
    #[arg(long, value_enum, default_value_t = TransportArg::from(&Transport::default()))]
    pub transport: TransportArg,
    /// libfabric provider for --transport fabric (`fi_info -l` lists this machine's);
    /// never silently replaced by another.
    #[arg(long, default_value = DEFAULT_PROVIDER)]
    pub provider: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    Tcp,
    Fabric,
}

impl From<&Transport> for TransportArg {
    fn from(t: &Transport) -> TransportArg {
        match t {
            Transport::Tcp => TransportArg::Tcp,
            Transport::Fabric { .. } => TransportArg::Fabric,
        }
    }
}

impl TransportArgs {
    pub fn transport(&self) -> Transport {
        match self.transport {
            TransportArg::Tcp => Transport::Tcp,
            TransportArg::Fabric => Transport::Fabric {
                provider: self.provider.clone(),
            },
        }
    }

    /// The provider a server offers, if it offers fabric at all.
    pub fn offered_provider(&self) -> Option<String> {
        (self.transport == TransportArg::Fabric).then(|| self.provider.clone())
    }
}

impl ServeArgs {
    /// The directory to serve, which the command line or the configuration file must give.
    pub fn root(&self) -> Result<&std::path::Path, Error> {
        self.root.as_deref().ok_or_else(|| {
            Error::Usage(match &self.config {
                Some(file) => format!(
                    "no directory to serve: give --root DIR, or root = \"DIR\" in {}",
                    file.display()
                ),
                None => "no directory to serve: give --root DIR".into(),
            })
        })
    }

    pub fn limits(&self, root: &std::path::Path) -> ServerLimits {
        ServerLimits {
            max_sessions: self.max_sessions.max(1),
            max_streams: self.max_streams.max(1),
            max_block_size: self.max_block_size,
            max_session_memory: self.max_session_memory,
            readers: self.readers.max(1),
            writers: self.writers.max(1),
            io: self.io.mode(),
            write: self.write.mode(),
            fabric_provider: self.transport.offered_provider(),
            stall_timeout: Duration::from_secs(self.stall_timeout.max(2)),
            idle_timeout: idle_timeout(self.idle_timeout),
            state_dir: Some(
                self.state_dir
                    .clone()
                    .unwrap_or_else(|| ServerLimits::default_state_dir(root)),
            ),
            keep_partial: self.keep_partial,
            durable: !self.no_fsync,
            handshake_timeout: self.handshake_timeout.max(Duration::from_millis(100)),
            max_pending: self.max_pending.max(1),
            max_pending_per_address: self.max_pending_per_address.max(1),
            allow_unencrypted: self.allow_unencrypted,
            accept_owners: self.accept_owners,
            client_ca: self.client_ca.clone(),
            audiences: self.audience.clone(),
            ..ServerLimits::default()
        }
    }
}

#[derive(Debug, Args)]
pub struct CpArgs {
    /// Sources then destination. A remote side is wanxfer://HOST[:PORT]/PATH (port 7800
    /// if none), PATH relative to the server's root; with both sides remote the data goes
    /// from one server to the other, not through this client (third-party copy).
    /// Memory-to-memory: `--bytes 4GiB /dev/zero wanxfer://HOST/dev/null` (or pull from
    /// .../dev/zero into /dev/null).
    #[arg(required = true, num_args = 2.., value_name = "SRC... DST")]
    pub paths: Vec<PathBuf>,
    /// Parallel TCP streams (data channels). Without it the client tunes the count while
    /// the transfer runs (from 2, up to 16: see --json's `tuning`); with it, N is fixed.
    #[arg(long, value_name = "N")]
    pub streams: Option<u16>,
    /// Pace the session to RATE bits per second (decimal: 500M, 2G, 1.5G), spread over
    /// its streams (the kernel's pacing on TCP senders; a token bucket otherwise).
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub rate: Option<u64>,
    /// TCP congestion control of the data streams (`cubic`, `bbr`, ...; the kernel's
    /// list is in /proc/sys/net/ipv4/tcp_available_congestion_control). Pushes only: on a
    /// pull the server sends.
    #[arg(long, value_name = "NAME")]
    pub congestion: Option<String>,
    /// Block size: the unit read, sent, checksummed and written.
    #[arg(long, value_name = "SIZE", default_value = size_text(Tuning::default().block_size.into()), value_parser = parse_block_size)]
    pub block_size: u32,
    /// Blocks queued per stream.
    #[arg(long, default_value_t = Tuning::default().depth)]
    pub depth: u16,
    /// Reader threads when sending.
    #[arg(long, default_value_t = Tuning::default().readers)]
    pub readers: usize,
    /// Writer threads when receiving.
    #[arg(long, default_value_t = Tuning::default().writers)]
    pub writers: usize,
    /// Move SIZE synthetic bytes (memory-to-memory) from /dev/zero.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub bytes: Option<u64>,
    /// Print one JSON object with the results at the end.
    #[arg(long)]
    pub json: bool,
    /// Write a JSON object a line about once a second while the transfer runs (schema
    /// in the README: per-channel bytes, rate and TCP_INFO, pools, CPU of both sides,
    /// the tuner's decisions) and one at its end: to stdout without a value or with
    /// `=-` (before --json's object), or `--progress-json=FILE`.
    #[arg(long, value_name = "FILE", num_args = 0..=1, require_equals = true, default_missing_value = "-")]
    pub progress_json: Option<PathBuf>,
    /// Print nothing on success: no progress bar, no summary, no notes or warnings
    /// (errors, and the JSON --json asks for, are still printed).
    #[arg(long, short)]
    pub quiet: bool,
    /// Shared secret file (else WANXFER_SECRET).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Copies between two servers: the source server's secret file (else --secret-file,
    /// else WANXFER_SECRET).
    #[arg(long, value_name = "FILE")]
    pub source_secret_file: Option<PathBuf>,
    /// Copies between two servers: the destination server's secret file (else
    /// --secret-file, else WANXFER_SECRET).
    #[arg(long, value_name = "FILE")]
    pub dest_secret_file: Option<PathBuf>,
    /// Copies between two servers: a bearer token for the source server (it needs
    /// storage.read there), instead of its secret.
    #[arg(long, value_name = "FILE", conflicts_with = "source_secret_file")]
    pub source_token: Option<PathBuf>,
    /// Copies between two servers: a bearer token for the destination server (it needs
    /// storage.create, or storage.modify over what exists), instead of its secret.
    #[arg(long, value_name = "FILE", conflicts_with = "dest_secret_file")]
    pub dest_token: Option<PathBuf>,
    /// With --no-file-digest: no block CRC either, nothing is checked (measuring protocol
    /// cost). On its own it changes nothing: the segment digests check every block.
    #[arg(long)]
    pub no_block_checksum: bool,
    /// Send no segment digests: files are renamed into place unverified and may be
    /// corrupt (blocks still carry a CRC-32C, unless --no-block-checksum).
    #[arg(long)]
    pub no_file_digest: bool,
    /// Seconds to wait for a connection.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_CONNECT_TIMEOUT_S)]
    pub connect_timeout: u64,
    /// How file bytes are sent when pushing.
    #[arg(long, value_enum, default_value_t = IoArg::from(Tuning::default().io))]
    pub io: IoArg,
    /// How pulled files are written.
    #[arg(long, value_enum, default_value_t = WriteArg::from(Tuning::default().write))]
    pub write: WriteArg,
    #[command(flatten)]
    pub transport: TransportArgs,
    /// Seconds a silent server (cut link, crashed host) is waited for before giving up
    /// with a network error.
    #[arg(long, value_name = "SECONDS", default_value_t = Tuning::default().stall_timeout.as_secs())]
    pub stall_timeout: u64,
    /// How long a server that is alive but moves nothing (keepalives only) is waited
    /// for before giving up with a network error (retried like one); 0 for ever.
    #[arg(long, value_name = "DURATION", default_value = duration_text(DEFAULT_IDLE_TIMEOUT), value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Retries after a network failure or a busy server, each resuming where the last
    /// attempt stopped.
    #[arg(long, default_value_t = RetryPolicy::default().retries)]
    pub retries: u32,
    /// No retry starts later than this after the first attempt.
    #[arg(long, value_name = "DURATION", default_value = duration_text(RetryPolicy::default().retry_for), value_parser = parse_duration)]
    pub retry_for: Duration,
    /// Start over instead of resuming: the receiver keeps no journal and no partial
    /// files, and an interrupted run is sent again in full.
    #[arg(long)]
    pub no_resume: bool,
    /// Send files even when the destination has them with the same size and modification
    /// time (by default those are skipped, as rsync's quick check does).
    #[arg(long, conflicts_with = "checksum")]
    pub ignore_times: bool,
    /// Compare files of the same size by content digests computed on both sides, and send
    /// only the parts that differ.
    #[arg(long)]
    pub checksum: bool,
    /// Pulls: acknowledge files before they reach the disk (scratch space only).
    #[arg(long)]
    pub no_fsync: bool,
    /// Where journals of interrupted pulls, the places of earlier transfers and the
    /// pinned server certificates (known_hosts) are kept (default: $WANXFER_STATE_DIR,
    /// $XDG_STATE_HOME/wanxfer or ~/.local/state/wanxfer).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Leave out what matches PATTERN beneath the sources (repeatable). --include and
    /// --exclude are tried in the order given and the first that matches decides, as
    /// rsync does; a trailing / matches only directories, a leading / anchors at the
    /// source's top, ** crosses directories. Excluded files are neither sent nor touched
    /// on the destination.
    #[arg(long, value_name = "PATTERN")]
    pub exclude: Vec<String>,
    /// Take what matches PATTERN even if a later --exclude matches it (repeatable).
    #[arg(long, value_name = "PATTERN")]
    pub include: Vec<String>,
    /// Take only the paths listed in FILE (one per line, relative to each source; - reads
    /// standard input), the directories above them and everything beneath them.
    #[arg(long, value_name = "FILE")]
    pub files_from: Option<PathBuf>,
    /// The --files-from list is separated by NUL bytes (find -print0), not lines.
    #[arg(long, requires = "files_from")]
    pub from0: bool,
    /// List what would be sent (with --json, as a list) and move nothing: nothing is
    /// written on either side, and no journal is kept. A pull asks the server for a
    /// listing; files the destination already has are listed too.
    #[arg(long, short = 'n')]
    pub dry_run: bool,
    /// Create the destination's missing parent directories (as mkdir -p; a remote one
    /// on the server, beneath its root).
    #[arg(long)]
    pub parents: bool,
    /// Keep more than mode and mtime (comma-separated, repeatable): owner and group
    /// (numeric ids; only where the receiving side runs as root), xattrs (user.*
    /// attributes; trusted.* and security.* never travel), acls (POSIX ACLs), sparse
    /// (holes: only data is sent, and holes stay unallocated on the destination),
    /// hardlinks (names of one file within the transfer stay names of one file; its
    /// data is sent once). What the destination cannot keep is noted once, not failed.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LIST")]
    pub preserve: Vec<PreserveArg>,
    /// Archive: --preserve owner,group,xattrs,acls,sparse,hardlinks, each where the
    /// destination allows it (owner and group only where the receiving side runs as
    /// root, attributes only where its file system has them, links where it can link);
    /// modes and mtimes are always kept.
    #[arg(long, short = 'a')]
    pub archive: bool,
    /// --include and --exclude in the order given on the command line (filled in after
    /// parsing, from the positions clap records).
    #[arg(skip)]
    pub rules: Vec<SelectRule>,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The --include and --exclude rules of `cp` in command-line order: clap keeps each
/// flag's values apart, but their order across the two flags is what decides.
pub fn ordered_rules(cp: &clap::ArgMatches) -> Vec<SelectRule> {
    let mut rules: Vec<(usize, SelectRule)> = Vec::new();
    for (id, include) in [("include", true), ("exclude", false)] {
        let (Some(indices), Some(values)) = (cp.indices_of(id), cp.get_many::<String>(id)) else {
            continue;
        };
        rules.extend(indices.zip(values).map(|(i, v)| {
            (
                i,
                SelectRule {
                    include,
                    pattern: v.clone().into_bytes(),
                },
            )
        }));
    }
    rules.sort_by_key(|(i, _)| *i);
    rules.into_iter().map(|(_, r)| r).collect()
}

/// One item of `cp --preserve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PreserveArg {
    /// The numeric owner (uid).
    Owner,
    /// The numeric group (gid).
    Group,
    /// user.* extended attributes.
    Xattrs,
    /// POSIX ACLs (access and default).
    Acls,
    /// Holes in sparse files: only data ranges are sent, holes stay unallocated.
    Sparse,
    /// Hard links within the transfer: a file's data is sent once, its other names are
    /// linked to it (copied where the destination cannot link).
    Hardlinks,
}

/// How file bytes are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IoArg {
    /// The measured best: sendfile for large files and plain sends from the block buffers
    /// for the rest, except to a peer on this host while checksums are on, where plain
    /// sends of everything measured faster (MSG_ZEROCOPY is not tried: see zerocopy).
    Auto,
    /// pread into a buffer and write: two copies.
    Copy,
    /// Large files straight from the page cache (sendfile is a splice into the socket,
    /// hence the alias); falls back to copying where a file system refuses it, and
    /// --json says so in io_fallback.
    #[value(alias = "splice")]
    Sendfile,
    /// Send from the block buffers with MSG_ZEROCOPY; pays only where the NIC can send
    /// from user pages (on loopback the kernel copies: --json counts it).
    Zerocopy,
}

impl IoArg {
    pub fn mode(self) -> IoMode {
        match self {
            IoArg::Auto => IoMode::Auto,
            IoArg::Sendfile => IoMode::Sendfile,
            IoArg::Copy => IoMode::Copy,
            IoArg::Zerocopy => IoMode::Zerocopy,
        }
    }
}

impl From<IoMode> for IoArg {
    fn from(mode: IoMode) -> IoArg {
        match mode {
            IoMode::Auto => IoArg::Auto,
            IoMode::Sendfile => IoArg::Sendfile,
            IoMode::Copy => IoArg::Copy,
            IoMode::Zerocopy => IoArg::Zerocopy,
        }
    }
}

/// How received files are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WriteArg {
    /// Direct on ext4 and XFS (where it was measured to pay), buffered elsewhere.
    Auto,
    /// Through the page cache.
    Buffered,
    /// Files of more than one block bypass the page cache (O_DIRECT); small files and
    /// file tails stay buffered, and a file system that refuses O_DIRECT is written
    /// buffered.
    Direct,
}

impl WriteArg {
    pub fn mode(self) -> WriteMode {
        match self {
            WriteArg::Auto => WriteMode::Auto,
            WriteArg::Buffered => WriteMode::Buffered,
            WriteArg::Direct => WriteMode::Direct,
        }
    }
}

impl From<WriteMode> for WriteArg {
    fn from(mode: WriteMode) -> WriteArg {
        match mode {
            WriteMode::Auto => WriteArg::Auto,
            WriteMode::Buffered => WriteArg::Buffered,
            WriteMode::Direct => WriteArg::Direct,
        }
    }
}

/// A validated client request.
pub struct Request {
    pub config: ClientConfig,
    pub job: ClientJob,
}

/// A validated copy between two servers.
pub struct ThirdPartyRequest {
    /// How to reach each server, with its own credential (and, in both, what
    /// --preserve asks to keep; in the source's, the selection; in the destination's,
    /// whether --parents creates the directories above it).
    pub source: ClientConfig,
    pub dest: ClientConfig,
    pub sources: Vec<RelPath>,
    pub dest_path: RelPath,
    /// The destination was written with a trailing slash.
    pub into: bool,
}

/// A side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Location {
    Local(PathBuf),
    Remote { server: String, path: RelPath },
}

impl CpArgs {
    pub fn show_progress(&self) -> bool {
        !self.json && !self.quiet && std::io::stderr().is_terminal()
    }

    pub fn tuning(&self) -> Tuning {
        Tuning {
            streams: self.streams.unwrap_or(Tuning::default().streams).max(1),
            auto_streams: self.streams.is_none(),
            rate_bits_per_s: self.rate,
            congestion: self.congestion.clone(),
            block_size: self.block_size,
            depth: self.depth.max(1),
            readers: self.readers.max(1),
            writers: self.writers.max(1),
            block_crc: !self.no_block_checksum,
            file_digest: !self.no_file_digest,
            io: self.io.mode(),
            write: self.write.mode(),
            transport: self.transport.transport(),
            stall_timeout: Duration::from_secs(self.stall_timeout.max(2)),
            idle_timeout: idle_timeout(self.idle_timeout),
            compare: if self.checksum {
                Compare::Checksum
            } else if self.ignore_times {
                Compare::Always
            } else {
                Compare::QuickCheck
            },
            durable: !self.no_fsync,
            resume: !self.no_resume,
            ..Tuning::default()
        }
    }

    pub fn request(&self, secret: Vec<u8>) -> Result<Request, Error> {
        if self.no_file_digest && !self.quiet {
            eprintln!("wanxfer: WARNING: --no-file-digest: files are renamed into place without verification");
        }
        let (dst, srcs) = self.paths.split_last().expect("clap requires two paths");
        let dst = parse_location(dst)?;
        let srcs = srcs
            .iter()
            .map(|p| parse_location(p))
            .collect::<Result<Vec<_>, _>>()?;
        let into = ends_with_slash(self.paths.last().expect("clap requires two paths"));
        let (server, job) = match dst {
            Location::Remote { server, path } => (server, self.push_job(&srcs, path, into)?),
            Location::Local(dst) => self.pull_job(&srcs, dst, into)?,
        };
        if let Some(name) = &self.congestion {
            if matches!(job, ClientJob::Pull { .. }) {
                return Err(Error::Usage(format!(
                    "--congestion {name} sets how the sending side's TCP probes the path, and \
                     on a pull the server sends: set it there (sysctl \
                     net.ipv4.tcp_congestion_control={name})"
                )));
            }
            if matches!(
                self.transport.transport(),
                wanxfer_engine::session::Transport::Fabric { .. }
            ) {
                return Err(Error::Usage(format!(
                    "--congestion {name} applies to TCP streams, not to --transport fabric"
                )));
            }
            wanxfer_engine::transport::tcp_info::check_congestion(name).map_err(Error::Usage)?;
        }
        let mut config = ClientConfig::new(server, secret, self.tuning());
        config.connect_timeout = Duration::from_secs(self.connect_timeout.max(1));
        config.retry = RetryPolicy {
            retries: self.retries,
            retry_for: self.retry_for,
        };
        if let Some(dir) = &self.state_dir {
            config.state_dir = dir.clone();
        }
        config.security = self.security.security(self.quiet);
        config.client_cert = self.security.identity.pair()?;
        config.selection = self.selection()?;
        config.preserve = self.preserve();
        config.make_parents = self.parents;
        Ok(Request { config, job })
    }

    /// A copy between two servers (every source on one server, the destination on
    /// another or the same): `None` when a side is local.
    pub fn third_party(&self) -> Result<Option<ThirdPartyRequest>, Error> {
        let (dst, srcs) = self.paths.split_last().expect("clap requires two paths");
        let Location::Remote {
            server: dest_server,
            path: dest,
        } = parse_location(dst)?
        else {
            return Ok(None);
        };
        let srcs = srcs
            .iter()
            .map(|p| parse_location(p))
            .collect::<Result<Vec<_>, _>>()?;
        if !srcs.iter().any(|s| matches!(s, Location::Remote { .. })) {
            return Ok(None);
        }
        let mut source_server = None;
        let mut sources = Vec::new();
        for src in srcs {
            let Location::Remote { server, path } = src else {
                return Err(Error::Usage(
                    "a copy between two servers takes only remote sources: copy local files \
                     in a command of their own"
                        .into(),
                ));
            };
            if source_server.get_or_insert_with(|| server.clone()) != &server {
                return Err(Error::Usage(
                    "all remote sources must be on one server".into(),
                ));
            }
            sources.push(path);
        }
        if self.bytes.is_some() {
            return Err(Error::Usage(
                "--bytes measures a path with synthetic data: not between two servers".into(),
            ));
        }
        if self.transport.transport() != wanxfer_engine::session::Transport::Tcp {
            return Err(Error::Usage(
                "a copy between two servers runs over TCP: the servers choose no fabric".into(),
            ));
        }
        if self.security.no_encryption {
            return Err(Error::Usage(
                "a copy between two servers needs TLS: the source pins the destination's \
                 certificate as this client verified it (drop --no-encryption)"
                    .into(),
            ));
        }
        let source_server = source_server.expect("at least one remote source");
        // Each side's own flag first; then what a one-server copy would use (--token,
        // --cert/--key, --secret-file, the environment, token discovery).
        let credential = |side: &str,
                          server: &str,
                          file: &Option<PathBuf>,
                          token: &Option<PathBuf>,
                          flag: &str| {
            if let Some(token) = token {
                let token = crate::secret::read_token(token)?;
                return Ok((Vec::new(), Some(ClientCredential::Token(token))));
            }
            if let Some(file) = file {
                return Ok((crate::secret::for_client(Some(file))?, None));
            }
            crate::secret::for_client_with(self.secret_file.as_deref(), &self.security).map_err(
                |e| match e {
                    Error::Usage(why) => Error::Usage(format!(
                        "no credential for the {side} server {server}: give {flag} FILE, \
                         {flag_token} FILE or --secret-file FILE, or set {env} ({why})",
                        flag_token = flag.replace("secret-file", "token"),
                        env = wanxfer_engine::secret::SECRET_ENV,
                    )),
                    e => e,
                },
            )
        };
        let source_credential = credential(
            "source",
            &source_server,
            &self.source_secret_file,
            &self.source_token,
            "--source-secret-file",
        )?;
        let dest_credential = credential(
            "destination",
            &dest_server,
            &self.dest_secret_file,
            &self.dest_token,
            "--dest-secret-file",
        )?;
        let config = |server: &str, (secret, credential): (Vec<u8>, Option<ClientCredential>)| {
            let mut config = ClientConfig::new(server.to_string(), secret, self.tuning());
            config.credential = credential;
            config.connect_timeout = Duration::from_secs(self.connect_timeout.max(1));
            config.retry = RetryPolicy {
                retries: self.retries,
                retry_for: self.retry_for,
            };
            if let Some(dir) = &self.state_dir {
                config.state_dir = dir.clone();
            }
            config.security = self.security.security(self.quiet);
            config.preserve = self.preserve();
            config
        };
        let mut source = config(&source_server, source_credential);
        // The source walks its tree with the selection, as a pushing client would.
        source.selection = self.selection()?;
        let mut dest_config = config(&dest_server, dest_credential);
        dest_config.make_parents = self.parents;
        Ok(Some(ThirdPartyRequest {
            source,
            dest: dest_config,
            sources,
            dest_path: dest,
            into: ends_with_slash(self.paths.last().expect("clap requires two paths")),
        }))
    }

    /// What --preserve and -a ask to keep.
    fn preserve(&self) -> Preserve {
        if self.archive {
            return Preserve::ALL;
        }
        let mut keep = Preserve::default();
        for item in &self.preserve {
            match item {
                PreserveArg::Owner => keep.owner = true,
                PreserveArg::Group => keep.group = true,
                PreserveArg::Xattrs => keep.xattrs = true,
                PreserveArg::Acls => keep.acls = true,
                PreserveArg::Sparse => keep.sparse = true,
                PreserveArg::Hardlinks => keep.hardlinks = true,
            }
        }
        keep
    }

    /// The rules and the --files-from list, read now: a list that cannot be read or
    /// names a bad path is a usage error before anything connects.
    fn selection(&self) -> Result<Selection, Error> {
        let files = match &self.files_from {
            None => None,
            Some(file) => {
                let list = if file == std::path::Path::new("-") {
                    let mut list = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut list)
                        .map_err(|e| Error::local("read", "standard input", e))?;
                    list
                } else {
                    std::fs::read(file).map_err(|e| Error::local("read", file.display(), e))?
                };
                Some(parse_file_list(&list, self.from0)?)
            }
        };
        Ok(Selection {
            rules: self.rules.clone(),
            files,
        })
    }

    fn push_job(&self, srcs: &[Location], dest: RelPath, into: bool) -> Result<ClientJob, Error> {
        let locals = srcs
            .iter()
            .map(|s| match s {
                Location::Local(p) => Ok(p.clone()),
                // `third_party` takes every request with a remote source and destination.
                Location::Remote { .. } => Err(Error::Usage(
                    "a copy between two servers takes only remote sources".into(),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let source = match (self.bytes, locals.as_slice()) {
            (Some(bytes), [zero]) if zero == std::path::Path::new("/dev/zero") => {
                Source::Synthetic { bytes }
            }
            (Some(_), _) => {
                return Err(Error::Usage(
                    "--bytes takes exactly one source, /dev/zero".into(),
                ))
            }
            (None, _)
                if locals
                    .iter()
                    .any(|p| p == std::path::Path::new("/dev/zero")) =>
            {
                return Err(Error::Usage("/dev/zero needs --bytes SIZE".into()))
            }
            (None, _) => Source::local(&locals)?,
        };
        Ok(ClientJob::Push { source, dest, into })
    }

    fn pull_job(
        &self,
        srcs: &[Location],
        dst: PathBuf,
        into: bool,
    ) -> Result<(String, ClientJob), Error> {
        let mut server = None;
        let mut sources = Vec::new();
        for src in srcs {
            let Location::Remote { server: s, path } = src else {
                return Err(Error::Usage(
                    "one side must be remote (wanxfer://HOST[:PORT]/PATH); for local copies use cp"
                        .into(),
                ));
            };
            if server.get_or_insert_with(|| s.clone()) != s {
                return Err(Error::Usage(
                    "all remote sources must be on one server".into(),
                ));
            }
            sources.push(path.clone());
        }
        let server = server.expect("at least one source");
        let synthetic_bytes = match self.bytes {
            Some(bytes) if sources.len() == 1 && sources[0].as_bytes() == b"dev/zero" => {
                Some(bytes)
            }
            Some(_) => {
                return Err(Error::Usage(
                    "--bytes pulls from exactly one source, wanxfer://HOST[:PORT]/dev/zero".into(),
                ))
            }
            None => None,
        };
        let dest = if dst == std::path::Path::new("/dev/null") {
            PullDest::Discard
        } else {
            PullDest::Local { path: dst, into }
        };
        Ok((
            server,
            ClientJob::Pull {
                sources,
                synthetic_bytes,
                dest,
            },
        ))
    }
}

/// A side of a copy from its argument (see `RemoteUrl::parse`).
fn parse_location(arg: &std::path::Path) -> Result<Location, Error> {
    use std::os::unix::ffi::OsStrExt;
    Ok(match RemoteUrl::parse(arg.as_os_str().as_bytes())? {
        Some(url) => Location::Remote {
            server: url.server,
            path: url.path,
        },
        None => Location::Local(arg.to_path_buf()),
    })
}

/// `bench --server`: `HOST[:PORT]` or `wanxfer://HOST[:PORT]`, as `HOST:PORT`.
pub fn parse_server(s: &str) -> Result<String, String> {
    let authority = match s.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("wanxfer") => {
            rest.strip_suffix('/').unwrap_or(rest)
        }
        Some((scheme, _)) => {
            return Err(format!(
                "unknown scheme {scheme}://: give HOST[:PORT] or wanxfer://HOST[:PORT]"
            ))
        }
        None => s,
    };
    if authority.contains('/') {
        return Err("a server, not a path: give HOST[:PORT] or wanxfer://HOST[:PORT]".into());
    }
    server_address(authority)
}

fn default_listen() -> String {
    format!("0.0.0.0:{DEFAULT_PORT}")
}

/// `serve --listen`: `HOST:PORT` with both parts, so that a bare port, which would
/// otherwise fail later as an unresolvable name (exit 4, "network"), is a usage error
/// that says what to write.
fn parse_listen(s: &str) -> Result<String, String> {
    let hint = |port: &str| {
        format!("give an address and a port: 0.0.0.0:{port} (every IPv4 address), [::]:{port} (every address) or 127.0.0.1:{port}")
    };
    if s.parse::<u16>().is_ok() {
        return Err(format!("{s:?} is only a port: {}", hint(s)));
    }
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(s.to_string()),
        Some(("", port)) => Err(format!("{s:?} has no address: {}", hint(port))),
        _ => Err(format!(
            "{s:?} is not HOST:PORT: {}",
            hint(&DEFAULT_PORT.to_string())
        )),
    }
}

/// A size as the size flags take it, in the largest binary unit that divides it exactly
/// (`4MiB`), so that `--help` shows defaults the way a person would write them.
pub fn size_text(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes != 0 && bytes % (1u64 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Whether a destination was written with a trailing slash: "into this directory",
/// created if it is missing, as rsync users expect.
fn ends_with_slash(arg: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    arg.as_os_str().as_bytes().ends_with(b"/")
}

/// A duration as `--help` shows it and [`parse_duration`] reads it back.
pub fn duration_text(d: Duration) -> String {
    let secs = d.as_secs();
    for (unit, n) in [("d", 86400), ("h", 3600), ("m", 60)] {
        if secs != 0 && secs % n == 0 && d.subsec_nanos() == 0 {
            return format!("{}{unit}", secs / n);
        }
    }
    if d.subsec_millis() != 0 || secs == 0 {
        return format!("{}ms", d.as_millis());
    }
    format!("{secs}s")
}

/// `--idle-timeout`: 0 is for ever; anything else at least a few keepalives long.
fn idle_timeout(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then(|| d.max(Duration::from_secs(2)))
}

/// Parses durations like `30s`, `10m`, `2h`, `1d` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (try 30s, 10m, 2h, 1d)"))?;
    let seconds = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        other => {
            return Err(format!(
                "unknown duration unit {other:?} (use ms, s, m, h or d)"
            ))
        }
    };
    Duration::try_from_secs_f64(value * seconds).map_err(|_| format!("{s:?} is out of range"))
}

/// Parses sizes like `4096`, `64K`, `4MiB`, `1.5GB`: one-letter and `iB` suffixes are
/// binary (as in dd and iperf3), `KB`/`MB`/`GB`/`TB` decimal.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 4096, 64K, 4MiB, 2GB)"))?;
    let multiplier: f64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown size suffix {other:?}")),
    };
    let bytes = value * multiplier;
    if !(0.0..=u64::MAX as f64).contains(&bytes) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// A rate in bits per second: a number with an optional decimal prefix (`k`, `M`, `G`,
/// `T`) and an optional `bit/s`, `bps` or `b` (network rates are decimal, as links are
/// rated; bytes are not accepted, to avoid a factor of 8 by mistake).
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = ["bit/s", "bps", "bit", "b"]
        .iter()
        .find_map(|unit| t.strip_suffix(unit))
        .unwrap_or(t);
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, prefix) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a rate (e.g. 500M or 2G, in bits per second)"))?;
    let multiplier = match prefix.trim() {
        "" => 1.0,
        "k" | "K" => 1e3,
        "m" | "M" => 1e6,
        "g" | "G" => 1e9,
        "t" | "T" => 1e12,
        other => {
            return Err(format!(
                "unknown rate prefix {other:?} in {s:?} (k, M, G or T, bits per second)"
            ))
        }
    };
    let bits = value * multiplier;
    if !(1000.0..=1e15).contains(&bits) {
        return Err(format!(
            "{s:?} is out of range (1k to 1000T bits per second)"
        ));
    }
    Ok(bits as u64)
}

/// A comma-separated list of block sizes.
pub fn parse_size_list(s: &str) -> Result<u64, String> {
    let bytes = parse_block_size(s)?;
    Ok(u64::from(bytes))
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    let bytes = parse_size(s)?;
    if !(4096..=wanxfer_proto::MAX_BLOCK_PAYLOAD as u64).contains(&bytes) {
        return Err(format!(
            "block size must be between 4KiB and {}MiB",
            wanxfer_proto::MAX_BLOCK_PAYLOAD >> 20
        ));
    }
    Ok(bytes as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_in_decimal_bits() {
        assert_eq!(parse_rate("500M"), Ok(500_000_000));
        assert_eq!(parse_rate("2G"), Ok(2_000_000_000));
        assert_eq!(parse_rate("1.5Gbit/s"), Ok(1_500_000_000));
        assert_eq!(parse_rate("100000"), Ok(100_000));
        assert_eq!(parse_rate("2Gbps"), Ok(2_000_000_000));
        for bad in ["", "fast", "2GiB", "0", "10", "2X", "-1G"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes_parse_binary_and_decimal() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_block_size("1K").is_err());
    }

    #[test]
    fn remote_locations_parse() {
        let loc =
            parse_location(std::path::Path::new("wanxfer://127.0.0.1:7800/dev/null")).unwrap();
        assert_eq!(
            loc,
            Location::Remote {
                server: "127.0.0.1:7800".into(),
                path: RelPath::new(b"dev/null").unwrap()
            }
        );
        let root = parse_location(std::path::Path::new("wanxfer://[::1]:7800")).unwrap();
        assert!(matches!(root, Location::Remote { path, .. } if path.is_root()));
        assert!(parse_location(std::path::Path::new("wanxfer://h:1/../etc")).is_err());
        assert_eq!(
            parse_location(std::path::Path::new("./local")).unwrap(),
            Location::Local(PathBuf::from("./local"))
        );
    }

    fn server_of(url: &str) -> Result<String, String> {
        match parse_location(std::path::Path::new(url)) {
            Ok(Location::Remote { server, .. }) => Ok(server),
            Ok(Location::Local(_)) => Err("local".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn a_url_without_a_port_reaches_the_default_port() {
        assert_eq!(server_of("wanxfer://dtn2/x"), Ok("dtn2:7800".into()));
        assert_eq!(server_of("wanxfer://dtn2"), Ok("dtn2:7800".into()));
        assert_eq!(server_of("WANXFER://dtn2:9/x"), Ok("dtn2:9".into()));
        assert_eq!(server_of("wanxfer://[::1]/x"), Ok("[::1]:7800".into()));
        assert_eq!(server_of("wanxfer://[::1]:7801/"), Ok("[::1]:7801".into()));
        for bad in [
            "wanxfer:///x",
            "wanxfer://:7800/x",
            "wanxfer://h:/x",
            "wanxfer://h:0/x",
            "wanxfer://h:99999/x",
            "wanxfer://::1/x",
            "wanxfer://[::1/x",
        ] {
            assert!(server_of(bad).is_err_and(|e| e != "local"), "{bad}");
        }
    }

    #[test]
    fn mistyped_schemes_are_refused_not_taken_as_local_paths() {
        for typo in [
            "wanxfr://h/x",
            "http://h/x",
            "wanxfer:/x",
            "wanxfer:x",
            "wanxfer//h/x",
            "wanxfe://h:1/x",
            "wnaxfer:/x",
        ] {
            let err = server_of(typo).unwrap_err();
            assert!(err.contains("wanxfer://HOST[:PORT]/PATH"), "{typo}: {err}");
        }
        for local in [
            "wanxfer/x",
            "./wanxfer:/x",
            "data:/x",
            "a:b",
            "/tmp/x",
            "-",
            "x//y",
        ] {
            assert_eq!(server_of(local), Err("local".into()), "{local}");
        }
    }

    #[test]
    fn bench_servers_take_a_url_or_host_and_port() {
        assert_eq!(parse_server("dtn2:7801"), Ok("dtn2:7801".into()));
        assert_eq!(parse_server("dtn2"), Ok("dtn2:7800".into()));
        assert_eq!(parse_server("wanxfer://dtn2:7801"), Ok("dtn2:7801".into()));
        assert_eq!(parse_server("wanxfer://dtn2/"), Ok("dtn2:7800".into()));
        assert!(parse_server("wanxfer://dtn2/data").is_err());
        assert!(parse_server("https://dtn2").is_err());
    }

    #[test]
    fn listen_addresses_need_a_host_and_a_port() {
        assert_eq!(parse_listen("0.0.0.0:7803"), Ok("0.0.0.0:7803".into()));
        assert_eq!(parse_listen("[::]:7803"), Ok("[::]:7803".into()));
        assert_eq!(parse_listen("localhost:1"), Ok("localhost:1".into()));
        let bare = parse_listen("7803").unwrap_err();
        assert!(bare.contains("0.0.0.0:7803"), "{bare}");
        assert!(parse_listen(":7803").unwrap_err().contains("0.0.0.0:7803"));
        assert!(parse_listen("host").is_err());
        assert!(parse_listen("host:http").is_err());
    }

    #[test]
    fn help_defaults_are_the_engines() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let default_of = |sub: &str, long: &str| -> String {
            let cmd = cli.find_subcommand(sub).unwrap();
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .unwrap_or_else(|| panic!("{sub} --{long}"));
            arg.get_default_values()[0].to_string_lossy().into_owned()
        };
        let tuning = Tuning::default();
        let limits = ServerLimits::default();
        let size = |s: String| parse_size(&s).unwrap();
        // --streams has no default: without it the tuner starts from the engine's.
        let streams = cli
            .find_subcommand("cp")
            .unwrap()
            .get_arguments()
            .find(|a| a.get_long() == Some("streams"))
            .unwrap();
        assert!(streams.get_default_values().is_empty());
        assert!(
            !Tuning::default().auto_streams,
            "the engine's default is what it is told"
        );
        assert_eq!(
            size(default_of("cp", "block-size")),
            u64::from(tuning.block_size)
        );
        assert_eq!(default_of("cp", "block-size"), "4MiB");
        assert_eq!(default_of("cp", "depth"), tuning.depth.to_string());
        assert_eq!(default_of("cp", "readers"), tuning.readers.to_string());
        assert_eq!(default_of("cp", "writers"), tuning.writers.to_string());
        assert_eq!(
            default_of("cp", "stall-timeout"),
            tuning.stall_timeout.as_secs().to_string()
        );
        assert_eq!(default_of("cp", "io"), "auto");
        assert_eq!(default_of("cp", "transport"), "tcp");
        assert_eq!(
            default_of("serve", "max-sessions"),
            limits.max_sessions.to_string()
        );
        assert_eq!(
            size(default_of("serve", "max-block-size")),
            u64::from(limits.max_block_size)
        );
        assert_eq!(
            size(default_of("serve", "max-session-memory")),
            limits.max_session_memory
        );
        assert_eq!(default_of("serve", "max-session-memory"), "512MiB");
        assert_eq!(default_of("serve", "listen"), "0.0.0.0:7800");
    }

    #[test]
    fn flags_left_out_give_the_engines_defaults() {
        let Command::Cp(cp) = Cli::parse_from(["wanxfer", "cp", "a", "wanxfer://h/x"]).command
        else {
            panic!("cp parses as cp")
        };
        let (ours, engine) = (cp.tuning(), Tuning::default());
        assert_eq!(
            (
                ours.streams,
                ours.block_size,
                ours.depth,
                ours.readers,
                ours.writers
            ),
            (
                engine.streams,
                engine.block_size,
                engine.depth,
                engine.readers,
                engine.writers
            )
        );
        assert_eq!((ours.io, ours.write), (engine.io, engine.write));
        assert_eq!(ours.transport, engine.transport);
        assert_eq!(ours.stall_timeout, engine.stall_timeout);
        let Command::Serve(serve) = Cli::parse_from(["wanxfer", "serve", "--root", "/x"]).command
        else {
            panic!("serve parses as serve")
        };
        let (ours, engine) = (
            serve.limits(std::path::Path::new("/x")),
            ServerLimits::default(),
        );
        assert_eq!(
            (
                ours.max_sessions,
                ours.max_streams,
                ours.max_block_size,
                ours.max_session_memory
            ),
            (
                engine.max_sessions,
                engine.max_streams,
                engine.max_block_size,
                engine.max_session_memory
            )
        );
        assert_eq!(
            (ours.readers, ours.writers),
            (engine.readers, engine.writers)
        );
        assert_eq!((ours.io, ours.write), (engine.io, engine.write));
        assert_eq!(ours.fabric_provider, engine.fabric_provider);
        assert_eq!(ours.stall_timeout, engine.stall_timeout);
    }

    #[test]
    fn sizes_print_as_they_parse() {
        for bytes in [1, 4095, 4096, 4 << 20, 512 << 20, 3 << 30, (1 << 40) + 1024] {
            assert_eq!(
                parse_size(&size_text(bytes)),
                Ok(bytes),
                "{}",
                size_text(bytes)
            );
        }
        assert_eq!(size_text(16 << 20), "16MiB");
    }

    #[test]
    fn durations_print_as_they_parse() {
        for d in [
            Duration::from_secs(86400),
            Duration::from_secs(600),
            Duration::from_secs(45),
            Duration::from_millis(250),
        ] {
            assert_eq!(parse_duration(&duration_text(d)), Ok(d));
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5"), Ok(Duration::from_secs(5)));
        assert!(parse_duration("3 fortnights").is_err());
    }

    #[test]
    fn modes_are_octal_permission_bits() {
        assert_eq!(parse_mode("755"), Ok(0o755));
        assert_eq!(parse_mode("0750"), Ok(0o750));
        assert!(parse_mode("8").is_err());
        assert!(parse_mode("17777").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
