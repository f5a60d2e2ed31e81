//! The client side of a session: connect, authenticate, ask, open channels, run a role;
//! and around it, the transfer: a stable identity derived from the command, so that a
//! run after an interruption resumes the last one into the same place, and retries that
//! resume rather than restart.

use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use wanxfer_proto::handshake::{Authenticated, ClientHandshake, Side, Step};
use wanxfer_proto::{
    features, session_flags, ChannelJoin, ConnectionKind, Direction, FailureClass, Message,
    OpenSession, Placement as Wire, Preamble, RelPath, Selection, SessionAccepted, Stats,
    TransportKind,
};
use wanxfer_session::negotiate;

use super::conn::{self, Deadline};
use super::driver::{Driver, EarlyManifest, Event, Opened, Opener, Outcome, Setup};
use super::state::StateDir;
use super::{random, Params, Transport, Tuning, DISCARD_PATH, SYNTHETIC_PATH};
use crate::digest::BlockKey;
use crate::fs::{Kind, Root};
use crate::pool::Cancel;
use crate::preserve::Preserve;
use crate::progress::{process_cpu, CpuMeter, CpuTime, IoUse, Progress};
use crate::select::Matcher;
use crate::sink::{Placement, Sink, SinkLimits};
use crate::source::{Source, SYNTHETIC_NAME};
use crate::stream::Stream;
use crate::tls::{ClientSecurity, ClientTls, Trust};
use crate::transport::fabric::{FabricNames, FabricTransport, SlotPlan};
use crate::transport::{Joined, TcpTransport};
use crate::{Error, ErrorClass};

/// How often, and for how long, network failures and a busy server are retried.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub retries: u32,
    /// No retry starts later than this after the first attempt.
    pub retry_for: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            retries: 5,
            retry_for: Duration::from_secs(600),
        }
    }
}

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `host:port` of the server.
    pub server: String,
    pub secret: Vec<u8>,
    pub tuning: Tuning,
    /// Bounds connecting and the whole handshake, for the control connection and each
    /// data connection.
    pub connect_timeout: Duration,
    /// Where this client keeps journals (pulls) and placements.
    pub state_dir: PathBuf,
    pub retry: RetryPolicy,
    /// Set to interrupt the transfer (Ctrl-C): it stops, keeping what it has for the
    /// next run.
    pub cancel: Cancel,
    /// TLS (the default) and whom to trust, or no encryption.
    pub security: ClientSecurity,
    /// Authenticate with a token or the client certificate instead of the secret.
    pub credential: Option<ClientCredential>,
    /// The certificate chain and key (PEM) presented in TLS (`--cert`, `--key`).
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Authenticate with this third-party copy grant (id, secret) instead of `secret`.
    pub grant: Option<([u8; 16], [u8; 32])>,
    /// Which entries beneath the sources move (`--exclude`, `--include`,
    /// `--files-from`): applied here for a push, sent to the server for a pull.
    pub selection: Selection,
    /// What is kept beyond mode and mtime (`--preserve`, `-a`), where the receiving
    /// side may keep it.
    pub preserve: Preserve,
    /// Create the destination's missing parent directories first (`cp --parents`): a
    /// remote one through the server's `mkdir -p`, confined to its root.
    pub make_parents: bool,
}

/// How a client proves who it is when not by the shared secret.
#[derive(Clone)]
pub enum ClientCredential {
    /// A bearer token (`--token`, or WLCG discovery), sent only inside TLS.
    Token(Vec<u8>),
    /// The certificate of [`ClientConfig::client_cert`], verified by TLS.
    Certificate,
}

impl std::fmt::Debug for ClientCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientCredential::Token(t) => write!(f, "Token({} bytes)", t.len()),
            ClientCredential::Certificate => f.write_str("Certificate"),
        }
    }
}

impl ClientConfig {
    /// A configuration with this side's defaults: the default state directory, the
    /// default retries, a 10 s connect timeout, nothing to cancel it.
    pub fn new(server: String, secret: Vec<u8>, tuning: Tuning) -> ClientConfig {
        ClientConfig {
            server,
            secret,
            tuning,
            connect_timeout: Duration::from_secs(10),
            state_dir: StateDir::client_default(),
            retry: RetryPolicy::default(),
            cancel: Cancel::default(),
            security: ClientSecurity::default(),
            credential: None,
            client_cert: None,
            grant: None,
            selection: Selection::default(),
            preserve: Preserve::default(),
            make_parents: false,
        }
    }

    /// The TLS set-up for connections to the server (`None` without encryption): a CA
    /// file to verify against, or the fingerprints pinned in the state directory.
    pub fn tls(&self) -> Result<Option<Arc<ClientTls>>, Error> {
        match &self.security {
            ClientSecurity::Unencrypted => Ok(None),
            ClientSecurity::Tls { ca } => {
                let trust = match ca {
                    Some(file) => Trust::Ca(file.clone()),
                    None => Trust::Pinned {
                        known_hosts: crate::tls::known_hosts_in(&self.state_dir),
                    },
                };
                ClientTls::with_client_cert(&self.server, &trust, self.client_cert.as_ref())
                    .map(|t| Some(Arc::new(t)))
            }
            ClientSecurity::Fingerprint(fingerprint) => {
                ClientTls::new(&self.server, &Trust::Exact(fingerprint.clone()))
                    .map(|t| Some(Arc::new(t)))
            }
        }
    }
}

/// What to move.
#[derive(Debug)]
pub enum ClientJob {
    /// Send `source` to `dest` beneath the server's root (`dev/null` discards, for
    /// synthetic sources only). `into`: the destination was written with a trailing
    /// slash, so the sources go into it (created if needed).
    Push {
        source: Source,
        dest: RelPath,
        into: bool,
    },
    /// Fetch `sources` from beneath the server's root (or, with `synthetic_bytes`, that
    /// many generated bytes from `dev/zero`).
    Pull {
        sources: Vec<RelPath>,
        synthetic_bytes: Option<u64>,
        dest: PullDest,
    },
}

#[derive(Debug, Clone)]
pub enum PullDest {
    Discard,
    /// `into`: written with a trailing slash.
    Local {
        path: PathBuf,
        into: bool,
    },
}

/// What a finished session reports.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Payload bytes moved over the data channels, in all attempts.
    pub bytes: u64,
    /// Bytes not sent because the receiver had them (up to date, or resumed).
    pub bytes_skipped: u64,
    pub files: u64,
    pub files_up_to_date: u64,
    pub failed_files: u64,
    pub seconds: f64,
    pub cpu: CpuTime,
    pub peer_cpu: CpuTime,
    pub streams: u16,
    pub block_size: u32,
    pub depth: u16,
    pub transport: &'static str,
    /// Fabric sessions: what libfabric discovery chose on this side.
    pub fabric: Option<FabricNames>,
    /// How this side moved file bytes (sent them, or wrote what it received), and how
    /// the server did.
    pub io: IoUse,
    pub peer_io: IoUse,
    /// `--io zerocopy`: MSG_ZEROCOPY sends made, and how many the kernel copied anyway.
    pub zerocopy_sends: u64,
    pub zerocopy_copied: u64,
    pub skipped: Vec<String>,
    /// What `--preserve` could not keep, once per kind (not failures).
    pub notes: Vec<String>,
    /// Sessions it took (1 without retries).
    pub attempts: u32,
    /// Data channels that died mid-transfer and were replaced.
    pub channels_lost: u64,
    /// Data channels dropped at the end, their blocks sent again on idle ones, because
    /// those would deliver them sooner (a push's; a pull's sender is the server).
    pub channels_cut: u64,
    /// Data channels kept from taking more blocks near the end because faster ones
    /// would deliver them first (a push's).
    pub channels_held_back: u64,
    /// What failed, file by file (also when the transfer as a whole failed).
    pub failures: Vec<FileFailure>,
    /// The first of those as the error it was, for [`Error::Files`].
    pub first_failure: Option<Arc<Error>>,
    /// Request/response waits from the control connection's connect to the first data
    /// byte (sent, or received in a pull), on the longest chain of them; the session's
    /// own when no block moved.
    pub setup_round_trips: u32,
    /// Of those, the waits until the session was agreed (`SessionAccepted`).
    pub session_round_trips: u32,
    /// Wall clock from that connect to the first data block handed whole to a socket
    /// (push) or arrived whole (pull); 0 when no block moved. Blocks are the unit the
    /// session sees: a pull's first 4 MiB in slow start arrives some round trips after
    /// its first byte, which `setup_round_trips` does not count.
    pub setup_seconds: f64,
    /// The TLS suite the connections use, or `none`.
    pub encryption: String,
    /// What the tuner chose and why, and each channel's measurements.
    pub tune: Option<crate::session::steer::TuneReport>,
    /// Who seals the data channels' records: `wanxfer` (its own record layer, in user
    /// space), `kernel` or `none`.
    pub tls_records: &'static str,
    /// A third-party copy: who moved the data, and what this client moved itself.
    pub third_party: Option<ThirdPartyReport>,
}

/// What a third-party copy adds to a report. The report's own byte and file counts are
/// the source's, `cpu` is this client's and `peer_cpu` the source server's.
#[derive(Debug, Clone, Default)]
pub struct ThirdPartyReport {
    /// `HOST:PORT` of the source and of the destination.
    pub source: String,
    pub destination: String,
    /// The destination's CPU for the push, as it reported it to the source.
    pub destination_cpu: CpuTime,
    /// Bytes this client sent and received over all its connections (both servers),
    /// counted by the kernel: the copy's data is not among them.
    pub client_tcp_bytes_sent: u64,
    pub client_tcp_bytes_received: u64,
}

/// One file that did not make it, for reports.
#[derive(Debug, Clone)]
pub struct FileFailure {
    pub class: ErrorClass,
    pub message: String,
}

/// A failed transfer: the error, and what was done before it.
#[derive(Debug)]
pub struct Failed {
    pub error: Error,
    pub report: Box<Report>,
}

/// The transfer a command names: the same server, direction, sources and destination
/// (and synthetic size) give the same id, so running the command again continues it.
pub fn transfer_id(server: &str, job: &ClientJob) -> [u8; 16] {
    use twox_hash::XxHash3_128;
    let mut h = XxHash3_128::new();
    let mut part = |bytes: &[u8]| {
        h.write(&(bytes.len() as u64).to_le_bytes());
        h.write(bytes);
    };
    part(b"wanxfer transfer 1");
    part(server.as_bytes());
    match job {
        ClientJob::Push { source, dest, into } => {
            part(b"push");
            for name in source.identity() {
                part(&name);
            }
            part(dest.as_bytes());
            part(&[u8::from(*into)]);
        }
        ClientJob::Pull {
            sources,
            synthetic_bytes,
            dest,
        } => {
            part(b"pull");
            for s in sources {
                part(s.as_bytes());
            }
            part(&synthetic_bytes.unwrap_or(0).to_le_bytes());
            match dest {
                PullDest::Discard => part(b"/dev/null"),
                PullDest::Local { path, into } => {
                    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                    part(absolute.as_os_str().as_bytes());
                    part(&[u8::from(*into)]);
                }
            }
        }
    }
    h.finish_128().to_le_bytes()
}

/// Whether a failure is worth another attempt: the network's, or a busy server.
fn retryable(e: &Error) -> bool {
    match e {
        Error::Cancelled => false,
        Error::Remote {
            class: FailureClass::Limit,
            ..
        } => true,
        e => e.class() == ErrorClass::Network,
    }
}

/// Runs the transfer to the end, retrying network failures and a busy server with
/// exponential backoff and jitter; each retry resumes. Per-file failures make it return
/// [`Error::Files`] after everything else has been moved.
pub fn run_client(
    cfg: &ClientConfig,
    job: ClientJob,
    progress: Arc<Progress>,
) -> Result<Report, Failed> {
    if let ClientJob::Push {
        source: Source::Items(_),
        dest,
        ..
    } = &job
    {
        if dest.as_bytes() == DISCARD_PATH {
            return Err(Failed {
                error: Error::Usage(
                    "dev/null on the server discards what it gets: only a synthetic source \
                     (--bytes SIZE /dev/zero) goes there, to measure the path"
                        .into(),
                ),
                report: Box::default(),
            });
        }
    }
    // Bad patterns, and a pull's selection the request could not carry, are the
    // user's to fix before anything connects.
    let selection = check_selection(cfg, &job).map_err(|error| Failed {
        error,
        report: Box::default(),
    })?;
    if cfg.make_parents {
        make_parents(cfg, &job).map_err(|error| Failed {
            error,
            report: Box::default(),
        })?;
    }
    let started = Instant::now();
    let cpu_before = process_cpu();
    let id = transfer_id(&cfg.server, &job);
    let state = StateDir::open(&cfg.state_dir).map_err(|error| Failed {
        error,
        report: Box::default(),
    })?;
    let mut total = Report::default();
    let mut attempt = 0u32;
    let mut backoff = Duration::from_millis(500);
    loop {
        attempt += 1;
        progress.reset_totals();
        let result = run_once(cfg, &job, &id, &state, &selection, progress.clone());
        let bytes = progress.bytes.load(std::sync::atomic::Ordering::Relaxed);
        total.bytes += bytes;
        total.bytes_skipped = progress
            .bytes_skipped
            .load(std::sync::atomic::Ordering::Relaxed);
        let finish = |mut report: Report, total: &Report| {
            report.bytes = total.bytes;
            report.attempts = attempt;
            report.seconds = started.elapsed().as_secs_f64();
            let cpu_after = process_cpu();
            report.cpu = CpuTime {
                user_us: cpu_after.user_us - cpu_before.user_us,
                sys_us: cpu_after.sys_us - cpu_before.sys_us,
            };
            report
        };
        match result {
            Ok(report) => {
                let mut report = finish(report, &total);
                let Some(summary) = report.failures.first().map(first_error) else {
                    return Ok(report);
                };
                // The error itself where this side still has it: its own words and class
                // (and errno), not a copy rebuilt from its text.
                let first = match report.first_failure.take().map(Arc::try_unwrap) {
                    Some(Ok(error)) => error,
                    _ => summary,
                };
                return Err(Failed {
                    error: Error::Files {
                        count: report.failed_files,
                        first: Box::new(first),
                    },
                    report: Box::new(report),
                });
            }
            Err(e)
                if retryable(&e)
                    && attempt <= cfg.retry.retries
                    && started.elapsed() < cfg.retry.retry_for
                    && !cfg.cancel.is_cancelled() =>
            {
                let jitter = 0.75 + f64::from(random::<1>().map_or(128, |b| b[0])) / 512.0;
                let wait = backoff.mul_f64(jitter);
                tracing::warn!(
                    "{e}; retrying in {:.1} s (attempt {} of {}), resuming where this one stopped",
                    wait.as_secs_f64(),
                    attempt + 1,
                    cfg.retry.retries + 1
                );
                let until = Instant::now() + wait;
                while Instant::now() < until && !cfg.cancel.is_cancelled() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
            Err(error) => {
                return Err(Failed {
                    error,
                    report: Box::new(finish(total.clone(), &total)),
                })
            }
        }
    }
}

fn first_error(f: &FileFailure) -> Error {
    match f.class {
        ErrorClass::Integrity => Error::Integrity {
            path: String::new(),
            offset: 0,
            detail: f.message.clone(),
        },
        ErrorClass::LocalIo => Error::local("", "", std::io::Error::other(f.message.clone())),
        _ => Error::Remote {
            peer: String::new(),
            class: FailureClass::Refused,
            message: f.message.clone(),
        },
    }
}

/// What the handshake established.
struct Agreed {
    stream: Stream,
    tls: Option<Arc<ClientTls>>,
    auth: Authenticated,
    accepted: SessionAccepted,
    fabric_port: Option<u16>,
    /// Waits from the connect to the session's answer (see [`authenticate`]).
    round_trips: u32,
    /// When the control connection's connect began.
    started: Instant,
}

fn run_once(
    cfg: &ClientConfig,
    job: &ClientJob,
    id: &[u8; 16],
    state: &StateDir,
    selection: &Arc<Matcher>,
    progress: Arc<Progress>,
) -> Result<Report, Error> {
    let pinned = match job {
        ClientJob::Push { into: true, .. } => Some(Wire::Into),
        ClientJob::Push { .. } => state.placement(id),
        ClientJob::Pull { .. } => None,
    };
    // Fitted into this side's memory budget before asking: the server only lowers. A
    // tuned session asks for pools for a few streams; more join and share them.
    let mut asked = cfg.tuning.clone();
    if asked.auto_streams {
        let start = match asked.transport {
            Transport::Fabric { .. } => super::AUTO_FABRIC_STREAMS,
            Transport::Tcp => super::AUTO_POOL_STREAMS,
        };
        asked.streams = asked.streams.max(start);
    }
    let tuning = asked.fitted(matches!(job, ClientJob::Pull { .. }));
    let mut request = open_request(
        job,
        &tuning,
        *id,
        pinned.unwrap_or(Wire::Resolve),
        &cfg.selection,
    );
    let mut notes = Vec::new();
    let owner_group = session_flags::PRESERVE_OWNER | session_flags::PRESERVE_GROUP;
    let asked = cfg.preserve.flags();
    if !matches!(job, ClientJob::Pull { .. }) || crate::preserve::may_chown() {
        request.flags |= asked;
    } else {
        request.flags |= asked & !owner_group;
        if asked & owner_group != 0 {
            notes.push("owner and group not kept: this side does not run as root".to_string());
        }
    }
    // The first data connections are opened while the control connection authenticates,
    // so that their TCP and TLS handshakes overlap it (see `Early`): a pull's right
    // behind its SYN, to join behind its proof, the others' once it is up, to join once
    // the session is agreed.
    let early = Arc::new(Early::default());
    let fabric = matches!(cfg.tuning.transport, Transport::Fabric { .. });
    let pull_over_tcp = matches!(job, ClientJob::Pull { .. }) && !fabric;
    // Nothing of this transfer here yet: the server may send each file's data right
    // behind its entry (`session_flags::FRESH`).
    if pull_over_tcp && is_fresh(job, id, state) {
        request.flags |= session_flags::FRESH;
    }
    // A push's first entries go behind the request when the server takes them
    // (`features::PIPELINE`), to be answered with the session: not with --preserve,
    // whose entries depend on what the server agrees to keep.
    let mut early_manifest = None;
    let pipeline = || match job {
        ClientJob::Push { source, .. }
            if request.flags & session_flags::PRESERVE_ALL == 0
                && request.transport == TransportKind::Tcp =>
        {
            let most = request.window.min(wanxfer_proto::MAX_PIPELINED_ENTRIES);
            let walked = EarlyManifest::walk(source, selection.clone(), most);
            let manifest = walked.manifest();
            early_manifest = Some(walked);
            manifest
        }
        _ => None,
    };
    // libfabric's start-up (see `FabricTransport::prepare`) holds the dynamic loader's
    // lock for 0.2 s, and every thread takes that lock as it starts: begun after the
    // early connections' threads, it no longer holds them up. A fabric client starts both
    // as its control connection's SYN leaves, as a pull over TCP starts its connections:
    // the start-up takes about 0.4 s with no RDMA hardware, and each fabric channel waits
    // for it, so on a 100 ms path it ended after the first joins had left (the first
    // block left 0.69 s after the connect when begun once connected, 0.60 s when begun
    // with the SYN). What it finds, the session's own discovery finds again and reports.
    let prepare = || {
        if let Transport::Fabric { provider } = &cfg.tuning.transport {
            FabricTransport::prepare(provider, |_| ());
        }
    };
    let agreed = handshake(
        cfg,
        request.clone(),
        || {
            if pull_over_tcp {
                early.start(cfg, tuning.streams, true, 0);
            } else if fabric {
                early.start(cfg, tuning.streams, false, 0);
                prepare();
            }
        },
        || {
            if !pull_over_tcp && !fabric {
                early.start(cfg, tuning.streams, false, 1);
            }
        },
        pipeline,
        |keys| early.proved(keys),
    )?;
    // A server that knows --preserve says itself why it keeps no owners (not root, or
    // not started with --accept-owners), in a note of the session.
    if matches!(job, ClientJob::Push { .. })
        && request.flags & owner_group & !agreed.accepted.flags != 0
        && agreed.auth.negotiated() & wanxfer_proto::features::PRESERVE == 0
    {
        notes.push(format!(
            "owner and group not kept: the server {} does not support --preserve",
            cfg.server
        ));
    }
    if let ClientJob::Push { .. } = job {
        state.set_placement(id, agreed.accepted.placement)?;
    }
    let mut params = Params::from_accepted(&agreed.accepted, id, &tuning, agreed.auth.negotiated());
    if cfg.tuning.auto_streams {
        // A tuned session starts with every stream its pools (and the server's slot
        // budget) were agreed for: each new stream's slow start costs round trips the
        // tuner cannot win back on a short transfer. A fabric stream has only its slots
        // in flight whatever the path: through the emulator at 200 ms, 4 Gbit/s, 2
        // fabric streams moved 1.2-1.5 Gbit/s, and each probe's new channels took
        // seconds to open their windows. TCP streams grow their windows, but 4 grow
        // together from four initial windows: at 100 ms, 1 Gbit/s (issue 19's path b),
        // 250 MB took 3.29-3.30 s from 4 streams against 3.48-3.64 s from 2, tuned or
        // not.
        params.auto_streams = true;
    }
    if matches!(job, ClientJob::Pull { .. }) && fabric {
        // Each fabric channel this side receives on registers slots of its own: the
        // tuner may open only as many as this side's budget holds, whatever the server
        // allows (it counts a pull's memory on its own side, not ours).
        params.max_streams = wanxfer_session::negotiate::fabric_streams_within(
            params.max_streams,
            params.depth,
            params.block_size,
            tuning.writers as u32,
            tuning.max_memory,
        )
        .max(params.streams);
    }
    params.resolve_io(conn::peer_on_this_host(&agreed.stream));
    let (kernel_tls, io_note) = params.settle_for_tls(&agreed.stream);
    if let Some(note) = io_note {
        let _ = progress.io_fallback.set(note);
    }
    let unencrypted = !agreed.stream.is_encrypted();
    if unencrypted {
        params.send_key = Some(BlockKey::new(agreed.auth.block_key(Side::Client)));
    }
    let receive_key = unencrypted.then(|| BlockKey::new(agreed.auth.block_key(Side::Server)));
    let transport: Arc<dyn crate::transport::Transport> =
        match (&cfg.tuning.transport, agreed.fabric_port) {
            (Transport::Fabric { provider }, Some(port)) => {
                // RDMA writes go from pool buffers: file bytes must be read into them.
                params.io = crate::source::IoMode::Copy;
                let ip = agreed
                    .stream
                    .peer_addr()
                    .map_err(|e| Error::network("reading the address of", &cfg.server, e))?
                    .ip();
                Arc::new(
                    FabricTransport::client(
                        provider,
                        SocketAddr::new(ip, port),
                        SlotPlan::new(params.block_size, params.depth),
                        params.session_tag,
                        params.block_size as usize,
                    )
                    .with_receive_key(receive_key),
                )
            }
            _ => Arc::new(TcpTransport {
                peer: cfg.server.clone(),
                block_size: params.block_size as usize,
                session_tag: params.session_tag,
                io: params.io,
                receive_key,
                kernel_tls,
            }),
        };
    let opener: Opener = {
        let session = Session {
            tls: agreed.tls.clone(),
            auth: agreed.auth.clone(),
            id: agreed.accepted.session_id,
            certificate: agreed.stream.peer_certificate(),
            round_trips: agreed.round_trips,
            silent_joins: matches!(job, ClientJob::Push { .. })
                && agreed.auth.negotiated() & features::PIPELINE != 0
                && request.transport == TransportKind::Tcp,
        };
        // As many as the driver opens at the start (see `Driver::open_initial_links`).
        early.keep(params.streams);
        let (cfg, early) = (cfg.clone(), early.clone());
        Arc::new(move |index, joining| {
            open_channel(&cfg, &session, early.take(index), index, joining)
        })
    };
    let setup = Setup {
        params: params.clone(),
        peer: cfg.server.clone(),
        transport: transport.clone(),
        progress: progress.clone(),
        meter: Arc::new(CpuMeter::default()),
        // Its own token, which ending the session sets, linked to the user's interrupt.
        cancel: Cancel::linked(&[&cfg.cancel]),
        opener: Some(opener),
        stats: None,
        shown: None,
        round_trips: Some(agreed.round_trips),
    };
    let events = crossbeam_channel::bounded(super::driver::EVENT_QUEUE);
    let report_to = events.0.clone();
    let driver = Driver::new(setup, &agreed.stream, events)?;
    let outcome = match job {
        ClientJob::Push { source, .. } => driver.send(source, selection.clone(), early_manifest),
        ClientJob::Pull {
            sources,
            synthetic_bytes,
            dest,
        } => {
            let tops = pull_tops(sources, *synthetic_bytes);
            let (target, journal) = match dest {
                PullDest::Discard => (None, None),
                PullDest::Local { path, into } => {
                    let pinned = if *into {
                        Some(Wire::Into)
                    } else {
                        state.placement(id)
                    };
                    let (root, placement, chosen) = local_target(path, tops, pinned)?;
                    state.set_placement(id, chosen)?;
                    let journal = match params.resumes() {
                        true => Some(Arc::new(state.journal(*id, root.path())?)),
                        false => None,
                    };
                    (Some((root, placement)), journal)
                }
            };
            let limits = SinkLimits {
                write: cfg.tuning.write,
                compare: cfg.tuning.compare,
                durable: cfg.tuning.durable,
                block_size: u64::from(params.block_size),
                checkpoint_bytes: checkpoint_bytes(&params),
                preserve: params.preserve,
                marked_links: params.marks_link_targets(),
                ..SinkLimits::default()
            };
            let limits = if params.fresh {
                limits.fresh(params.stall_timeout)
            } else {
                limits
            };
            let report: crate::commit::Report = Arc::new(move |id, result| {
                let _ = report_to.send(Event::Resolved { id, result });
            });
            let sink = Sink::new(
                target,
                cfg.server.clone(),
                params.transfer_tag,
                params.check_flags(),
                limits,
                journal,
                report,
            )?;
            driver.receive(Arc::new(sink))
        }
    }?;
    let mut report = report(cfg, &params, &agreed, outcome, &progress);
    notes.append(&mut report.notes);
    report.notes = notes;
    report.fabric = transport.fabric_names();
    let protection = agreed.stream.protection();
    report.encryption = protection.encryption;
    report.tls_records = match protection.offload {
        "none" => "none",
        _ if kernel_tls => "kernel",
        // Data channels leave rustls once joined (`Stream::own_records`).
        _ => "wanxfer",
    };
    Ok(report)
}

/// How many verified bytes of a partial file wait before they are journaled: about what
/// the session has in flight, so that a crash costs at most that much again.
pub fn checkpoint_bytes(params: &Params) -> u64 {
    (params.receive_buffers() as u64 * u64::from(params.block_size)).max(16 << 20)
}

fn report(
    cfg: &ClientConfig,
    params: &Params,
    agreed: &Agreed,
    outcome: Outcome,
    progress: &Progress,
) -> Report {
    let peer = outcome.peer_stats.clone().unwrap_or_default();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    Report {
        bytes: load(&progress.bytes),
        bytes_skipped: load(&progress.bytes_skipped),
        files: outcome.files_ok,
        files_up_to_date: outcome.up_to_date,
        failed_files: outcome.failures.len() as u64,
        seconds: 0.0,
        cpu: CpuTime::default(),
        peer_cpu: CpuTime {
            user_us: peer.cpu_user_us,
            sys_us: peer.cpu_sys_us,
        },
        streams: outcome.tune.as_ref().map_or(params.streams, |t| t.streams),
        block_size: params.block_size,
        depth: params.depth,
        transport: cfg.tuning.transport.name(),
        fabric: None,
        io: outcome.io,
        peer_io: peer_io_use(&peer),
        zerocopy_sends: load(&progress.zerocopy_sends),
        zerocopy_copied: load(&progress.zerocopy_copied),
        skipped: outcome.skipped,
        notes: outcome.notes,
        attempts: 1,
        channels_lost: outcome.channels_lost,
        channels_cut: outcome.channels_cut,
        channels_held_back: outcome.channels_held_back,
        failures: outcome
            .failures
            .iter()
            .map(|e| FileFailure {
                class: e.class(),
                message: e.to_string(),
            })
            .collect(),
        first_failure: outcome.failures.into_iter().next().map(Arc::new),
        setup_round_trips: outcome
            .first_data
            .map_or(agreed.round_trips, |f| f.round_trips),
        session_round_trips: agreed.round_trips,
        setup_seconds: outcome.first_data.map_or(0.0, |f| {
            f.at.saturating_duration_since(agreed.started).as_secs_f64()
        }),
        tune: outcome.tune.clone(),
        encryption: String::new(),
        tls_records: "none",
        third_party: None,
    }
}

/// What the server's `Stats` say about its I/O. Its text is shown to the user as the
/// server's own words, so anything that is not UTF-8 is replaced, not trusted.
fn peer_io_use(stats: &Stats) -> IoUse {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    IoUse {
        mode: text(&stats.io_mode),
        direct_bytes: stats.direct_bytes,
        fallback: (!stats.io_fallback.is_empty()).then(|| text(&stats.io_fallback)),
    }
}

/// A control connection to `cfg.server`, authenticated and ready for a request other
/// than a session (remote operations), with a read timeout of the connect timeout.
pub(crate) fn open_control(
    cfg: &ClientConfig,
) -> Result<(Stream, conn::Control, Authenticated, Option<String>), Error> {
    let deadline = Deadline::after(cfg.connect_timeout);
    let tls = cfg.tls()?;
    let (stream, auth, _) = authenticate(
        cfg,
        tls.as_deref(),
        deadline,
        |_, _| Ok(Vec::new()),
        || {},
        || {},
        |_, _| {},
    )?;
    let _ = stream.set_write_timeout(None);
    let control = conn::Control::new(&stream, cfg.server.clone())?;
    // The certificate the server presented, verified (pinned, or by its CA) and proved
    // by the handshake: what a third-party copy's source is told to expect.
    let fingerprint = tls.and_then(|tls| {
        tls.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fingerprint
            .clone()
    });
    Ok((stream, control, auth, fingerprint))
}

/// Connects (TLS unless the session runs without encryption), greets and proves this
/// side knows the secret, sending what `check_greeting` returns for the server's greeting
/// (a request, and what may go behind it) right behind the proof, and checks the
/// server's proof. Without encryption, what follows the proof carries MACs both ways.
/// The server's certificate is pinned only now, once it has proved itself. `connected`
/// runs once the TCP connection is up, before TLS (`dialing` as soon as its SYN is
/// out); `proved` once the proof and what follows it are out, with the keys the session
/// will have if the server proves itself too and the features its greeting offered.
///
/// Also returns the request/response waits it took: the connect, TLS (whose server
/// flight carries the greeting as 0.5-RTT data) or, in plaintext, the greeting (sent
/// when the server accepts: half a round trip after the connect returns, counted as a
/// whole), and the server's proof, which the answer to `request` follows in one flight.
fn authenticate(
    cfg: &ClientConfig,
    tls: Option<&ClientTls>,
    deadline: Deadline,
    check_greeting: impl FnOnce(&wanxfer_proto::Hello, bool) -> Result<Vec<Message>, Error>,
    dialing: impl FnOnce(),
    connected: impl FnOnce(),
    proved: impl FnOnce(&Authenticated, u64),
) -> Result<(Stream, Authenticated, u32), Error> {
    let peer = cfg.server.as_str();
    if cfg.credential.is_some() && tls.is_none() {
        return Err(Error::Usage(
            "a token or client certificate is sent only over TLS: drop --no-encryption".into(),
        ));
    }
    // Drawn before `dialing` and `connected` start threads: the first draw looks its
    // system call up through the dynamic loader, whose lock a fabric client's libfabric
    // start-up (begun in one of them) holds for 0.2 s.
    let nonce = random()?;
    let tcp = conn::connect_then(peer, deadline, cfg.tuning.stall_timeout, dialing)?;
    connected();
    let mut stream = conn::secure(tcp, peer, tls, deadline)?;
    // The connect, then TLS or the plaintext greeting; the proof's answer below.
    let round_trips = 3;
    let mut handshake = match &cfg.grant {
        None => ClientHandshake::new(&cfg.secret, nonce, client_features(&cfg.tuning)),
        Some((id, secret)) => {
            ClientHandshake::for_grant(*id, secret, nonce, client_features(&cfg.tuning))
        }
    }
    .with_binding(stream.binding());
    let credential = match &cfg.credential {
        None => None,
        Some(credential) => {
            // Without the secret nothing proves the server is the one meant but its
            // certificate: a token goes only to a server verified by --ca or pinned.
            if tls.is_some_and(|t| t.seen.lock().unwrap_or_else(|e| e.into_inner()).first_use) {
                return Err(Error::Auth {
                    peer: peer.to_string(),
                    detail: "its certificate is not pinned yet and no --ca was given: a token \
                             or client certificate is presented only to a server whose identity \
                             is known (verify it with --ca FILE, or pin it first with a \
                             command using the shared secret)"
                        .into(),
                });
            }
            handshake = handshake.with_credential();
            Some(Message::Credential(match credential {
                ClientCredential::Token(token) => wanxfer_proto::Credential::Token(token.clone()),
                ClientCredential::Certificate => wanxfer_proto::Credential::Certificate,
            }))
        }
    };
    let mut first = Preamble::new(ConnectionKind::Control).encode().to_vec();
    first.extend_from_slice(&conn::frames(&[&handshake.hello()]));
    conn::write_all_by(&mut stream, &first, deadline, peer)?;
    let greeting = conn::read_greeting(&mut stream, deadline, peer)?;
    // Whether the certificate this connection met is already known to be the server's
    // (verified by --ca, or pinned): only then does more than the request go before the
    // server's proof.
    let verified = tls.is_some_and(|t| !t.seen.lock().unwrap_or_else(|e| e.into_inner()).first_use);
    let offered = greeting.features;
    let after_proof = check_greeting(&greeting, verified)?;
    let Step::Send(proof) = handshake
        .handle(Message::Hello(greeting))
        .map_err(|e| Error::handshake(peer, e))?
    else {
        return Err(Error::protocol(
            peer,
            "the handshake did not ask for a proof",
        ));
    };
    conn::write_all_by(&mut stream, &conn::frames(&[&proof]), deadline, peer)?;
    if let Some(keys) = handshake.pending() {
        stream.authenticate_writes(keys.control_key(Side::Client));
    }
    if let Some(credential) = &credential {
        conn::write_all_by(&mut stream, &conn::frames(&[credential]), deadline, peer)?;
    }
    if !after_proof.is_empty() {
        let flight = conn::frames(&after_proof.iter().collect::<Vec<_>>());
        conn::write_all_by(&mut stream, &flight, deadline, peer)?;
    }
    if let Some(keys) = handshake.pending() {
        proved(keys, offered);
    }
    let Step::Done(auth) = handshake
        .handle(conn::read_message_by(&mut stream, deadline, peer)?)
        .map_err(|e| Error::handshake(peer, e))?
    else {
        return Err(Error::protocol(peer, "the handshake did not complete"));
    };
    stream.authenticate_reads(auth.control_key(Side::Server));
    if let Some(tls) = tls {
        tls.pin_if_new(peer)?;
    }
    Ok((stream, auth, round_trips))
}

/// Connects and agrees on a session. Under TLS the server's greeting rides in its first
/// flight (0.5-RTT data), so the client's Finished, preamble, `Hello`, proof and request
/// leave together once that flight is in: from the connection to the session's answer,
/// two round trips more than the connect (TLS, then the request), as without TLS (the
/// greeting, then the request). `connected` runs once the TCP connection is up.
/// With a server that offers [`features::PIPELINE`] and a certificate already verified,
/// what `pipeline` returns (a push's first manifest entries) goes right behind the
/// request. `session_flags::FRESH` is asked only of a server that offers
/// [`features::PULL_PIPELINE`]; `proved` hears whether that server lets data connections
/// join before its answer, and with which keys.
fn handshake(
    cfg: &ClientConfig,
    mut request: OpenSession,
    dialing: impl FnOnce(),
    connected: impl FnOnce(),
    pipeline: impl FnOnce() -> Option<Message>,
    proved: impl FnOnce(Option<&Authenticated>),
) -> Result<Agreed, Error> {
    let peer = cfg.server.as_str();
    let started = Instant::now();
    let deadline = Deadline::after(cfg.connect_timeout);
    if request.transport == TransportKind::Fabric
        && !matches!(cfg.security, ClientSecurity::Unencrypted)
    {
        return Err(Error::Usage(
            "the fabric transport writes blocks straight into the peer's memory, where TLS \
             cannot protect them: add --no-encryption (every block then still carries a MAC)"
                .into(),
        ));
    }
    let tls = cfg.tls()?;
    let pull_pipeline = |offered: u64| {
        offered & features::PULL_PIPELINE != 0 && request.direction == Direction::Pull
    };
    let mut sent = request.clone();
    let check = |greeting: &wanxfer_proto::Hello, verified: bool| {
        if cfg.grant.is_some() && greeting.features & features::THIRD_PARTY == 0 {
            return Err(Error::Usage(format!(
                "{peer} does not take third-party copies (an older wanxfer)"
            )));
        }
        if request.transport == TransportKind::Fabric && greeting.features & features::FABRIC == 0 {
            return Err(Error::Usage(format!(
                "{peer} does not offer the fabric transport (start it with --transport fabric)"
            )));
        }
        if request.flags & session_flags::PRESERVE_ALL != 0
            && greeting.features & features::PRESERVE == 0
        {
            return Err(Error::Usage(format!(
                "{peer} cannot preserve owners, groups or attributes (--preserve, -a): it \
                 runs an older wanxfer"
            )));
        }
        if !request.selection.is_empty() && greeting.features & features::SELECT == 0 {
            return Err(Error::Usage(format!(
                "{peer} cannot select what it sends (--exclude, --include, --files-from): \
                     it runs an older wanxfer"
            )));
        }
        if !pull_pipeline(greeting.features) {
            sent.flags &= !session_flags::FRESH;
        }
        let mut flight = vec![Message::OpenSession(sent.clone())];
        if verified && greeting.features & features::PIPELINE != 0 {
            flight.extend(pipeline());
        }
        Ok(flight)
    };
    let proved = |keys: &Authenticated, offered: u64| {
        proved(pull_pipeline(offered).then_some(keys));
    };
    let (mut stream, auth, round_trips) = authenticate(
        cfg,
        tls.as_deref(),
        deadline,
        check,
        dialing,
        connected,
        proved,
    )?;
    request = sent;
    let accepted = match conn::read_message_by(&mut stream, deadline, peer)? {
        Message::SessionAccepted(a) => a,
        Message::Error(e) => return Err(Error::remote(peer, &e)),
        _ => return Err(Error::protocol(peer, "expected the session's answer")),
    };
    negotiate::check_accepted(&request, &accepted)
        .map_err(|detail| Error::protocol(peer, detail))?;
    let fabric_port = match request.transport {
        TransportKind::Fabric => Some(read_fabric_endpoint(&mut stream, deadline, cfg)?),
        _ => None,
    };
    Ok(Agreed {
        stream,
        tls,
        auth,
        accepted,
        fabric_port,
        // The answer came in the proof's flight; so does the fabric endpoint.
        round_trips,
        started,
    })
}

/// Whether this side holds nothing of pull `job` (transfer `id`): no journal of an
/// earlier run, and no destination yet (or none at all: data thrown away), or a
/// directory the sources land in (`cp -r` into it) holding none of their names yet; so
/// that nothing can be up to date or held (`session_flags::FRESH`). Into a directory
/// only where no earlier run of the transfer placed its source onto the destination
/// itself: a rerun lands where that one did, whose files the directory then holds.
fn is_fresh(job: &ClientJob, id: &[u8; 16], state: &StateDir) -> bool {
    let ClientJob::Pull {
        sources,
        synthetic_bytes,
        dest,
    } = job
    else {
        return false;
    };
    let PullDest::Local { path, .. } = dest else {
        return true;
    };
    let absent = |path: &Path| matches!(path.symlink_metadata(), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
    if state.has_journal(id) {
        return false;
    }
    match path.symlink_metadata() {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(meta) if meta.is_dir() && state.placement(id) != Some(Wire::Onto) => {
            // Every source named (there is one, and none is the root), no two alike
            // (they would meet at one destination file), none there yet.
            let tops = pull_tops(sources, *synthetic_bytes);
            let distinct: std::collections::HashSet<&Vec<u8>> = tops.iter().collect();
            tops.len() == sources.len().max(1)
                && distinct.len() == tops.len()
                && tops
                    .iter()
                    .all(|top| absent(&path.join(std::ffi::OsStr::from_bytes(top))))
        }
        Ok(_) => false,
    }
}

/// The names a pull's sources take at its destination: each source's last component
/// (the synthetic source's fixed name).
fn pull_tops(sources: &[RelPath], synthetic_bytes: Option<u64>) -> Vec<Vec<u8>> {
    if synthetic_bytes.is_some() {
        return vec![SYNTHETIC_NAME.to_vec()];
    }
    sources
        .iter()
        .filter_map(|s| s.split_last().map(|(_, n)| n.to_vec()))
        .collect()
}

/// Creates the missing directories above the job's destination, as `mkdir -p` would:
/// on the server for a push (through a remote-operations connection, so the server's
/// confinement applies), here for a pull. An existing directory is no error; a file in
/// the way is.
pub fn make_parents(cfg: &ClientConfig, job: &ClientJob) -> Result<(), Error> {
    match job {
        ClientJob::Push { dest, .. } => match remote_parent(dest) {
            Some(parent) => crate::ops::Client::connect(cfg)?.mkdir(&parent, true, 0o777),
            None => Ok(()),
        },
        ClientJob::Pull {
            dest: PullDest::Local { path, .. },
            ..
        } => match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => std::fs::create_dir_all(parent)
                .map_err(|e| Error::local("create directory", parent.display(), e)),
            _ => Ok(()),
        },
        ClientJob::Pull { .. } => Ok(()),
    }
}

/// The directory `--parents` creates on a server above destination `dest`, if any: a
/// push's, or a copy between two servers'.
pub fn remote_parent(dest: &RelPath) -> Option<RelPath> {
    match dest.split_last() {
        Some((parent, _)) if !parent.is_root() && dest.as_bytes() != DISCARD_PATH => Some(parent),
        _ => None,
    }
}

/// The selection compiled for this side's walker, once its patterns (and, for a pull,
/// its size) are known to be acceptable.
fn check_selection(cfg: &ClientConfig, job: &ClientJob) -> Result<Arc<Matcher>, Error> {
    let matcher = Matcher::new(&cfg.selection)?;
    if let ClientJob::Pull { .. } = job {
        fits_request(&cfg.selection, "a pull")?;
    }
    Ok(Arc::new(matcher))
}

/// Whether `selection` fits the one frame of a request that carries it to the server
/// that walks (`carrier`: "a pull", or a copy between two servers): it must leave room
/// for the rest of the request (its sources' paths and a few dozen bytes of numbers).
pub fn fits_request(selection: &Selection, carrier: &str) -> Result<(), Error> {
    let rules = selection.rules.len();
    if rules > wanxfer_proto::MAX_SELECT_RULES {
        return Err(Error::Usage(format!(
            "{rules} --include/--exclude rules: {carrier} carries at most {}",
            wanxfer_proto::MAX_SELECT_RULES
        )));
    }
    let paths = selection.files.as_ref().map_or(0, Vec::len);
    if paths > wanxfer_proto::MAX_SELECTED_PATHS {
        return Err(Error::Usage(format!(
            "--files-from names {paths} paths: {carrier} carries at most {} (split the list \
             over several commands)",
            wanxfer_proto::MAX_SELECTED_PATHS
        )));
    }
    let carried: usize = selection
        .rules
        .iter()
        .map(|r| 5 + r.pattern.len())
        .sum::<usize>()
        + selection
            .files
            .iter()
            .flatten()
            .map(|p| 4 + p.as_bytes().len())
            .sum::<usize>();
    if carried > wanxfer_proto::MAX_FRAME_BODY / 2 {
        return Err(Error::Usage(format!(
            "the selection takes {carried} bytes: {carrier}'s request carries at most {} \
             (shorten --files-from)",
            wanxfer_proto::MAX_FRAME_BODY / 2
        )));
    }
    Ok(())
}

fn client_features(tuning: &Tuning) -> u64 {
    let mut offered = features::SUPPORTED;
    if tuning.compare == wanxfer_proto::Compare::Always {
        offered &= !features::COMPARE;
    }
    if !tuning.resume {
        offered &= !features::RESUME;
    }
    offered
}

/// The server's answer to a fabric request: the port of its listener, after checking it
/// runs the provider we asked for (never another one).
fn read_fabric_endpoint(
    stream: &mut Stream,
    deadline: Deadline,
    cfg: &ClientConfig,
) -> Result<u16, Error> {
    let Transport::Fabric { provider } = &cfg.tuning.transport else {
        return Err(Error::Internal(
            "a fabric endpoint for a TCP session".into(),
        ));
    };
    let endpoint = match conn::read_message_by(stream, deadline, &cfg.server)? {
        Message::FabricEndpoint(f) => f,
        Message::Error(e) => return Err(Error::remote(&cfg.server, &e)),
        _ => return Err(Error::protocol(&cfg.server, "expected the fabric endpoint")),
    };
    let theirs = String::from_utf8_lossy(&endpoint.provider);
    // Providers come layered ("verbs;ofi_rxm"): the first name is the one asked for.
    if theirs.split(';').next() != Some(provider.as_str()) {
        return Err(Error::Usage(format!(
            "asked for libfabric provider {provider}, but {} offers {theirs}",
            cfg.server
        )));
    }
    Ok(endpoint.port)
}

fn open_request(
    job: &ClientJob,
    tuning: &Tuning,
    transfer_id: [u8; 16],
    placement: Wire,
    selection: &Selection,
) -> OpenSession {
    let mut flags = 0;
    if !tuning.block_crc {
        flags |= session_flags::NO_BLOCK_CHECKSUM;
    }
    if !tuning.file_digest {
        flags |= session_flags::NO_FILE_DIGEST;
    }
    let mut pull_selection = Selection::default();
    let (direction, paths, source_count, synthetic_bytes) = match job {
        ClientJob::Push { source, dest, .. } => {
            if dest.as_bytes() == DISCARD_PATH {
                flags |= session_flags::DISCARD;
            }
            let count = source.top_names().len() as u32;
            (Direction::Push, vec![dest.clone()], count, 0)
        }
        ClientJob::Pull {
            sources,
            synthetic_bytes,
            dest,
        } => {
            if matches!(dest, PullDest::Discard) {
                flags |= session_flags::DISCARD;
            }
            if synthetic_bytes.is_none() {
                pull_selection = selection.clone();
            }
            if let Some(bytes) = synthetic_bytes {
                flags |= session_flags::SYNTHETIC_SOURCE;
                (
                    Direction::Pull,
                    vec![RelPath::new(SYNTHETIC_PATH).expect("valid")],
                    1,
                    *bytes,
                )
            } else {
                (Direction::Pull, sources.clone(), sources.len() as u32, 0)
            }
        }
    };
    let discard = flags & session_flags::DISCARD != 0;
    OpenSession {
        direction,
        transport: match tuning.transport {
            Transport::Tcp => TransportKind::Tcp,
            Transport::Fabric { .. } => TransportKind::Fabric,
        },
        paths,
        source_count,
        streams: tuning.streams,
        block_size: tuning.block_size,
        depth: tuning.depth,
        window: tuning.window,
        flags,
        synthetic_bytes,
        transfer_id,
        placement: if direction == Direction::Push && !discard {
            placement
        } else {
            Wire::Resolve
        },
        compare: tuning.compare,
        selection: pull_selection,
    }
}

/// What a data connection needs of the agreed session to join it.
struct Session {
    tls: Option<Arc<ClientTls>>,
    auth: Authenticated,
    id: [u8; 16],
    /// The certificate the control connection's server presented and then proved to
    /// hold the session's secret with: an early connection must have met the same one.
    certificate: Option<Vec<u8>>,
    round_trips: u32,
    /// A pipelined push (`features::PIPELINE`): the server does not answer a join, and
    /// blocks follow it at once.
    silent_joins: bool,
}

/// A data connection opened early: connected, TLS done, preamble sent, greeting read;
/// joined already if the session's key was known by then (a pull, see [`Early`]).
struct EarlyChannel {
    stream: Stream,
    greeting: wanxfer_proto::Hello,
    /// The join it sent before the session's answer came.
    joined: Option<ChannelJoin>,
    /// The waits until it was open (or, joined, its join sent): its connect and TLS, after
    /// the control connection's connect for one started then.
    ready: u32,
}

/// An early data connection's thread, which ends with it open (or failed).
type Opening = std::thread::JoinHandle<Result<EarlyChannel, Error>>;

/// The most data connections opened early, whatever the request asks for.
const MAX_EARLY: u16 = 8;

/// What early connections join with, once the control connection has sent its proof.
enum EarlyKey {
    /// The proof is not out yet.
    Waiting,
    /// The session's keys (its id among them): join now.
    Join(Box<Authenticated>),
    /// Join only once the session is agreed (a push, or a server that does not pipeline
    /// pulls), or the session failed.
    Later,
}

/// The key early connections wait for, set once by the control connection.
struct KeySlot {
    key: std::sync::Mutex<EarlyKey>,
    set: std::sync::Condvar,
}

impl KeySlot {
    fn set(&self, key: EarlyKey) {
        let mut held = self.key.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*held, EarlyKey::Waiting) {
            *held = key;
        }
        self.set.notify_all();
    }

    /// The key to join with now, waiting for it until `deadline`; `None` to join later.
    fn wait(&self, deadline: Deadline) -> Option<Box<Authenticated>> {
        let mut held = self.key.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*held {
                EarlyKey::Join(auth) => return Some(auth.clone()),
                EarlyKey::Later => return None,
                EarlyKey::Waiting => {}
            }
            let Ok(Some(left)) = deadline.left() else {
                return None;
            };
            held = self
                .set
                .wait_timeout(held, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Data connections opened while the control connection authenticates, each for one
/// channel index. A push's start once its TCP connection is up and finish their own TCP
/// and TLS handshakes by the time it has its answer; a pull's start right behind its
/// SYN (so that the server still admits the control connection first, whatever its
/// per-address limit), finish with its TLS, and the first joins as soon as its proof is
/// out ([`features::PULL_PIPELINE`]: the server holds the join until the session opens
/// and sends blocks right behind its answer), so that the first block arrives with the
/// session's answer. Until the join, all they carry is the preamble, and nothing is read
/// from one whose certificate is not the one the control connection's server proved
/// itself behind (a first use pins nothing for them): it is dropped for a connection
/// opened the usual way, after the session is agreed.
struct Early {
    pending: std::sync::Mutex<Vec<(u16, Opening)>>,
    key: Arc<KeySlot>,
}

impl Default for Early {
    fn default() -> Self {
        Early {
            pending: std::sync::Mutex::default(),
            key: Arc::new(KeySlot {
                key: std::sync::Mutex::new(EarlyKey::Waiting),
                set: std::sync::Condvar::new(),
            }),
        }
    }
}

impl Drop for Early {
    /// Connections still waiting for the key give up (and close) at once.
    fn drop(&mut self) {
        self.key.set(EarlyKey::Later);
    }
}

impl Early {
    /// Starts opening `count` data connections in the background, channels 0 to
    /// `count - 1`; with `join_early`, channel 0 joins as soon as [`Early::proved`] gives
    /// it the key (the others once the session is agreed).
    fn start(&self, cfg: &ClientConfig, count: u16, join_early: bool, after: u32) {
        // Their own verifier state: the control connection's records what its server
        // presented, for pinning once it has proved itself.
        let tls = match cfg.tls() {
            Ok(tls) => tls,
            Err(_) => return,
        };
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for index in 0..count.min(MAX_EARLY) {
            let (cfg, tls, key) = (cfg.clone(), tls.clone(), self.key.clone());
            let spawned = std::thread::Builder::new()
                .name("wanxfer-early".into())
                .spawn(move || {
                    let peer = cfg.server.as_str();
                    let deadline = Deadline::after(cfg.connect_timeout);
                    let mut stream = conn::connect_secure(
                        peer,
                        tls.as_deref(),
                        deadline,
                        cfg.tuning.stall_timeout,
                    )?;
                    conn::write_all_by(
                        &mut stream,
                        &Preamble::new(ConnectionKind::Data).encode(),
                        deadline,
                        peer,
                    )?;
                    let greeting = conn::read_greeting(&mut stream, deadline, peer)?;
                    let mut joined = None;
                    // Only the first channel: every session agrees on at least one, and
                    // a server that agreed on fewer than were opened early would take
                    // whichever joins came first, not the channels the client keeps.
                    let join_early = join_early && index == 0;
                    if let Some(auth) = join_early.then(|| key.wait(deadline)).flatten() {
                        let join =
                            channel_join(&auth, auth.session_id(), index, &greeting, &stream);
                        send_join(&mut stream, &join, deadline, peer)?;
                        joined = Some(join);
                    }
                    Ok(EarlyChannel {
                        stream,
                        greeting,
                        joined,
                        // The proof leaves after the control connection's connect and
                        // TLS, as a join sent early does after this one's.
                        ready: after + 2,
                    })
                });
            if let Ok(handle) = spawned {
                pending.push((index, handle));
            }
        }
    }

    /// The control connection's proof is out: early connections join with `auth` now
    /// where they may (`Some`), or once the session is agreed.
    fn proved(&self, auth: Option<&Authenticated>) {
        self.key.set(match auth {
            Some(auth) => EarlyKey::Join(Box::new(auth.clone())),
            None => EarlyKey::Later,
        });
    }

    /// Closes the early connections of channels `count` and above: the session takes no
    /// more at its start, and a later channel must not inherit one the server has given
    /// up on (or joined under another index).
    fn keep(&self, count: u16) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        // Dropping a handle detaches its thread; its connection closes when it ends.
        pending.retain(|(index, _)| *index < count);
    }

    /// The early connection of channel `index`, once it is open (or failed); `None` if
    /// there is none. Each ends within the connect timeout, so this waits no longer.
    fn take(&self, index: u16) -> Option<Result<EarlyChannel, Error>> {
        let handle = loop {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let at = pending.iter().position(|(i, _)| *i == index)?;
            if pending[at].1.is_finished() {
                break pending.swap_remove(at).1;
            }
            drop(pending);
            std::thread::sleep(Duration::from_millis(1));
        };
        Some(
            handle.join().unwrap_or_else(|_| {
                Err(Error::Internal("opening a data connection panicked".into()))
            }),
        )
    }
}

/// The join of channel `index` to session `id` on `stream`, whose greeting was `greeting`.
fn channel_join(
    auth: &Authenticated,
    id: [u8; 16],
    index: u16,
    greeting: &wanxfer_proto::Hello,
    stream: &Stream,
) -> ChannelJoin {
    ChannelJoin {
        session_id: id,
        index,
        proof: auth.channel_proof(&id, index, &greeting.nonce, &stream.binding()),
    }
}

/// Opens data connection `index`: connect (and TLS), read the server's greeting (its
/// nonce, and the connection's TLS exporter, bind the join to this connection), join,
/// wait for the server to take it. An early connection (see [`Early`]) skips to the
/// join. `joining` is told the join once it has left.
fn open_channel(
    cfg: &ClientConfig,
    session: &Session,
    early: Option<Result<EarlyChannel, Error>>,
    index: u16,
    joining: &dyn Fn(&ChannelJoin),
) -> Result<Opened, Error> {
    let peer = cfg.server.as_str();
    let deadline = Deadline::after(cfg.connect_timeout);
    let early = match early {
        Some(Ok(ch)) if ch.stream.peer_certificate() == session.certificate => Some(ch),
        Some(Ok(_)) => {
            tracing::warn!(
                "{peer}: a data connection opened early met another certificate than the \
                 authenticated control connection; opening it again"
            );
            None
        }
        Some(Err(e)) => {
            tracing::debug!("{peer}: opening a data connection early: {e}");
            None
        }
        None => None,
    };
    // A join sent early named the session as this side derived it, and this channel.
    let early = early.filter(|ch| match &ch.joined {
        Some(j) if j.session_id != session.id || j.index != index => {
            tracing::warn!(
                "{peer}: a data connection joined an unexpected session early; opening it again"
            );
            false
        }
        _ => true,
    });
    // The join, and the waits until it could leave: the connection's connect and TLS (or
    // greeting), and for a join that waited for the session, the session's answer.
    let (mut stream, join, ready) = match early {
        // Its answer comes in the flight of the session's.
        Some(EarlyChannel {
            stream,
            joined: Some(join),
            ready,
            ..
        }) => (stream, join, ready),
        Some(EarlyChannel {
            mut stream,
            greeting,
            ready,
            ..
        }) => {
            let join = channel_join(&session.auth, session.id, index, &greeting, &stream);
            send_join(&mut stream, &join, deadline, peer)?;
            (stream, join, ready.max(session.round_trips))
        }
        None => {
            let mut stream = conn::connect_secure(
                peer,
                session.tls.as_deref(),
                deadline,
                cfg.tuning.stall_timeout,
            )?;
            conn::write_all_by(
                &mut stream,
                &Preamble::new(ConnectionKind::Data).encode(),
                deadline,
                peer,
            )?;
            let greeting = conn::read_greeting(&mut stream, deadline, peer)?;
            let join = channel_join(&session.auth, session.id, index, &greeting, &stream);
            send_join(&mut stream, &join, deadline, peer)?;
            (stream, join, session.round_trips + 2)
        }
    };
    joining(&join);
    if session.silent_joins {
        // A refused join is an error and a close, which ends the link like any loss.
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        return Ok(Opened {
            joined: Joined { stream, join },
            round_trips: ready,
            join_left: ready,
        });
    }
    match conn::read_message_by(&mut stream, deadline, peer)? {
        Message::ChannelAccepted { index: i } if i == index => {
            let _ = stream.set_read_timeout(None);
            let _ = stream.set_write_timeout(None);
            Ok(Opened {
                joined: Joined { stream, join },
                round_trips: ready + 1,
                join_left: ready,
            })
        }
        Message::Error(e) => Err(Error::remote(peer, &e)),
        _ => Err(Error::protocol(
            peer,
            "expected the data channel to be accepted",
        )),
    }
}

fn send_join(
    stream: &mut Stream,
    join: &ChannelJoin,
    deadline: Deadline,
    peer: &str,
) -> Result<(), Error> {
    conn::write_all_by(
        stream,
        &conn::frames(&[&Message::ChannelJoin(*join)]),
        deadline,
        peer,
    )
}

/// The root and placement for a pull into local `dest`, `cp -r` style, and how the
/// placement was decided: pinned by an earlier run of the transfer (or a trailing slash),
/// or resolved now. Only `tops` are accepted from the server.
fn local_target(
    dest: &Path,
    tops: Vec<Vec<u8>>,
    pinned: Option<Wire>,
) -> Result<(Root, Placement, Wire), Error> {
    let count = tops.len() as u32;
    let is_dir = dest.is_dir();
    let as_name = || -> Result<(Root, RelPath), Error> {
        let name = dest
            .file_name()
            .ok_or_else(|| Error::Usage(format!("{}: not a usable destination", dest.display())))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let root = Root::open(parent)?;
        let rel = RelPath::new(name.as_bytes())
            .map_err(|e| Error::Usage(format!("{}: {e}", dest.display())))?;
        Ok((root, rel))
    };
    let (root, rel) = match pinned {
        Some(Wire::Into) if is_dir => (Root::open(dest)?, RelPath::root()),
        Some(_) => as_name()?,
        None if is_dir => (Root::open(dest)?, RelPath::root()),
        None => {
            let (root, rel) = as_name()?;
            if root.meta(&rel)?.is_some_and(|m| m.kind == Kind::Dir) {
                return Err(Error::Usage(format!(
                    "{}: is a directory reached through a symlink; name the directory itself",
                    dest.display()
                )));
            }
            (root, rel)
        }
    };
    let (mut placement, chosen) =
        Placement::decide(&root, &rel, count, pinned.unwrap_or(Wire::Resolve))?;
    placement.allowed_tops = Some(tops);
    Ok((root, placement, chosen))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pull(dest: &Path, sources: &[&str]) -> ClientJob {
        ClientJob::Pull {
            sources: sources
                .iter()
                .map(|s| RelPath::new(s.as_bytes()).unwrap())
                .collect(),
            synthetic_bytes: None,
            dest: PullDest::Local {
                path: dest.to_path_buf(),
                into: false,
            },
        }
    }

    /// A pull is fresh into a path that does not exist, or a directory that holds none
    /// of its sources' names; not where one is there, where the destination is a file,
    /// where an earlier run left a journal, or where it placed its source onto the
    /// directory itself (a rerun lands in it again).
    #[test]
    fn a_pull_is_fresh_only_where_nothing_of_it_can_be() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(&dir.path().join("state")).unwrap();
        let dest = dir.path().join("dest");
        let id = [7; 16];
        let fresh = |job: &ClientJob| is_fresh(job, &id, &state);
        assert!(fresh(&pull(&dest, &["data/run42"])), "missing destination");
        std::fs::create_dir(&dest).unwrap();
        assert!(
            fresh(&pull(&dest, &["data/run42", "b.bin"])),
            "empty directory"
        );
        std::fs::write(dest.join("b.bin"), b"older").unwrap();
        assert!(fresh(&pull(&dest, &["data/run42"])), "other names only");
        assert!(
            !fresh(&pull(&dest, &["data/run42", "b.bin"])),
            "one name there"
        );
        assert!(!fresh(&pull(&dest, &["a/x", "b/x"])), "one name twice");
        std::os::unix::fs::symlink("nowhere", dest.join("run42")).unwrap();
        assert!(
            !fresh(&pull(&dest, &["data/run42"])),
            "a dangling link there"
        );
        assert!(!fresh(&pull(&dest.join("b.bin"), &["x"])), "a file");
        state.set_placement(&id, Wire::Onto).unwrap();
        assert!(!fresh(&pull(&dest, &["data/new"])), "placed onto before");
        state.set_placement(&id, Wire::Into).unwrap();
        assert!(fresh(&pull(&dest, &["data/new"])), "placed into before");
        std::fs::write(state.journal_path(&id), b"").unwrap();
        assert!(!fresh(&pull(&dest, &["data/new"])), "a journal");
        let discard = ClientJob::Pull {
            sources: vec![RelPath::new(b"x").unwrap()],
            synthetic_bytes: None,
            dest: PullDest::Discard,
        };
        assert!(fresh(&discard));
    }
}
