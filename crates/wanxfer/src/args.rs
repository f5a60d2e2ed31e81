//! Flags in two stages: clap's structs close to the command line, then validated engine
//! requests ([`CpArgs::request`]) so that the engine never sees a half-checked value.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use wanxfer_engine::fs::WriteMode;
use wanxfer_engine::ops::RemoteUrl;
use wanxfer_engine::session::{ClientConfig, ClientJob, PullDest, ServerLimits, Transport, Tuning};
use wanxfer_engine::source::{IoMode, Source};
use wanxfer_engine::Error;
use wanxfer_proto::ops::ChecksumAlgorithm;
use wanxfer_proto::RelPath;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  internal error (a bug: please report it)
  2  usage: bad flags or arguments
  3  authentication failed (secret mismatch)
  4  network: cannot connect, or the peer went away
  5  protocol: the peer sent something malformed
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

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve one directory to authenticated clients.
    #[command(after_help = EXIT_CODES)]
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
    /// Seconds to wait for a connection.
    #[arg(long, default_value_t = 10)]
    pub connect_timeout: u64,
    /// Seconds a silent server is waited for (a long checksum or removal is not silence:
    /// the server reports progress).
    #[arg(long, default_value_t = 120)]
    pub stall_timeout: u64,
}

impl RemoteArgs {
    pub fn config(&self, server: &str, secret: Vec<u8>) -> ClientConfig {
        ClientConfig {
            server: server.to_string(),
            secret,
            tuning: Tuning {
                stall_timeout: Duration::from_secs(self.stall_timeout.max(2)),
                ..Tuning::default()
            },
            connect_timeout: Duration::from_secs(self.connect_timeout.max(1)),
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

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The directory served: nothing outside it is ever read or written.
    #[arg(long)]
    pub root: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:7800")]
    pub listen: String,
    /// Shared secret file; created (mode 0600, random secret) if missing. Without it the
    /// secret comes from WANXFER_SECRET.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Most concurrent sessions.
    #[arg(long, default_value_t = 16)]
    pub max_sessions: usize,
    /// Most data channels one session may open.
    #[arg(long, default_value_t = 32)]
    pub max_streams: u16,
    /// Largest block a client may ask for.
    #[arg(long, default_value = "16MiB", value_parser = parse_block_size)]
    pub max_block_size: u32,
    /// Most memory one session's block pool may use.
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    pub max_session_memory: u64,
    /// Disk reader threads per sending session.
    #[arg(long, default_value_t = 2)]
    pub readers: usize,
    /// Disk writer threads per receiving session.
    #[arg(long, default_value_t = 2)]
    pub writers: usize,
    /// How pulls send file bytes.
    #[arg(long, value_enum, default_value = "auto")]
    pub io: IoArg,
    /// How pushed files are written.
    #[arg(long, value_enum, default_value = "auto")]
    pub write: WriteArg,
    /// `--transport fabric` offers libfabric channels as well as TCP.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// Seconds a silent client (cut link, crashed host) is waited for.
    #[arg(long, default_value_t = 120)]
    pub stall_timeout: u64,
}

/// Which data channels to use (cp, bench) or offer (serve).
#[derive(Debug, Clone, Args)]
pub struct TransportArgs {
    /// Data channels: parallel TCP streams, or libfabric endpoints moving blocks by RDMA
    /// write (RoCE, InfiniBand, iWARP through `verbs`; the `tcp` provider anywhere).
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: TransportArg,
    /// libfabric provider for --transport fabric (`fi_info -l` lists this machine's);
    /// never silently replaced by another.
    #[arg(long, default_value = "tcp")]
    pub provider: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    Tcp,
    Fabric,
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
    pub fn limits(&self) -> ServerLimits {
        ServerLimits {
            max_sessions: self.max_sessions.max(1),
            max_streams: self.max_streams.max(1),
            max_block_size: self.max_block_size,
            max_pool_bytes: usize::try_from(self.max_session_memory).unwrap_or(usize::MAX),
            readers: self.readers.max(1),
            writers: self.writers.max(1),
            io: self.io.mode(),
            write: self.write.mode(),
            fabric_provider: self.transport.offered_provider(),
            stall_timeout: Duration::from_secs(self.stall_timeout.max(2)),
            ..ServerLimits::default()
        }
    }
}

#[derive(Debug, Args)]
pub struct CpArgs {
    /// Sources then destination. A remote side is wanxfer://HOST:PORT/PATH, PATH relative
    /// to the server's root. Memory-to-memory: `--bytes 4GiB /dev/zero
    /// wanxfer://HOST:PORT/dev/null` (or pull from .../dev/zero into /dev/null).
    #[arg(required = true, num_args = 2.., value_name = "SRC... DST")]
    pub paths: Vec<PathBuf>,
    /// Parallel TCP streams (data channels).
    #[arg(long, default_value_t = 2)]
    pub streams: u16,
    /// Block size: the unit read, sent, checksummed and written (e.g. 4MiB).
    #[arg(long, default_value = "4MiB", value_parser = parse_block_size)]
    pub block_size: u32,
    /// Blocks queued per stream.
    #[arg(long, default_value_t = 4)]
    pub depth: u16,
    /// Reader threads when sending.
    #[arg(long, default_value_t = 2)]
    pub readers: usize,
    /// Writer threads when receiving.
    #[arg(long, default_value_t = 2)]
    pub writers: usize,
    /// Move SIZE synthetic bytes (memory-to-memory) from /dev/zero.
    #[arg(long, value_parser = parse_size)]
    pub bytes: Option<u64>,
    /// Print one JSON object with the results at the end.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
    /// Shared secret file (else WANXFER_SECRET).
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// With --no-file-digest: no block CRC either, nothing is checked (measuring protocol
    /// cost). On its own it changes nothing: the segment digests check every block.
    #[arg(long)]
    pub no_block_checksum: bool,
    /// Send no segment digests: files are renamed into place unverified and may be
    /// corrupt (blocks still carry a CRC-32C, unless --no-block-checksum).
    #[arg(long)]
    pub no_file_digest: bool,
    /// Seconds to wait for a connection.
    #[arg(long, default_value_t = 10)]
    pub connect_timeout: u64,
    /// How file bytes are sent when pushing.
    #[arg(long, value_enum, default_value = "auto")]
    pub io: IoArg,
    /// How pulled files are written.
    #[arg(long, value_enum, default_value = "auto")]
    pub write: WriteArg,
    #[command(flatten)]
    pub transport: TransportArgs,
    /// Seconds a silent server (cut link, crashed host) is waited for before giving up
    /// with a network error.
    #[arg(long, default_value_t = 120)]
    pub stall_timeout: u64,
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

/// A validated client request.
pub struct Request {
    pub config: ClientConfig,
    pub job: ClientJob,
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
            streams: self.streams.max(1),
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
            ..Tuning::default()
        }
    }

    pub fn request(&self, secret: Vec<u8>) -> Result<Request, Error> {
        if self.no_file_digest {
            eprintln!("wanxfer: WARNING: --no-file-digest: files are renamed into place without verification");
        }
        let (dst, srcs) = self.paths.split_last().expect("clap requires two paths");
        let dst = parse_location(dst)?;
        let srcs = srcs
            .iter()
            .map(|p| parse_location(p))
            .collect::<Result<Vec<_>, _>>()?;
        let (server, job) = match dst {
            Location::Remote { server, path } => (server, self.push_job(&srcs, path)?),
            Location::Local(dst) => self.pull_job(&srcs, dst)?,
        };
        Ok(Request {
            config: ClientConfig {
                server,
                secret,
                tuning: self.tuning(),
                connect_timeout: Duration::from_secs(self.connect_timeout.max(1)),
            },
            job,
        })
    }

    fn push_job(&self, srcs: &[Location], dest: RelPath) -> Result<ClientJob, Error> {
        let locals = srcs
            .iter()
            .map(|s| match s {
                Location::Local(p) => Ok(p.clone()),
                Location::Remote { .. } => Err(Error::Usage(
                    "copying between two servers is not supported: one side must be local".into(),
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
        Ok(ClientJob::Push { source, dest })
    }

    fn pull_job(&self, srcs: &[Location], dst: PathBuf) -> Result<(String, ClientJob), Error> {
        let mut server = None;
        let mut sources = Vec::new();
        for src in srcs {
            let Location::Remote { server: s, path } = src else {
                return Err(Error::Usage(
                    "one side must be remote (wanxfer://HOST:PORT/PATH); for local copies use cp"
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
                    "--bytes pulls from exactly one source, wanxfer://HOST:PORT/dev/zero".into(),
                ))
            }
            None => None,
        };
        let dest = if dst == std::path::Path::new("/dev/null") {
            PullDest::Discard
        } else {
            PullDest::Local(dst)
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
        assert!(parse_location(std::path::Path::new("wanxfer://host/x")).is_err());
        assert!(parse_location(std::path::Path::new("wanxfer://h:1/../etc")).is_err());
        assert_eq!(
            parse_location(std::path::Path::new("./local")).unwrap(),
            Location::Local(PathBuf::from("./local"))
        );
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
