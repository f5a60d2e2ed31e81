//! The server: one root, many sessions, each on threads of its own.
//!
//! Nothing touches the file system before a client has proved it knows the secret. The
//! server greets every connection at once with a nonce fresh for it; control connections
//! then authenticate and ask, data connections name a session and prove they belong to it
//! with a proof bound to that nonce, so a captured join is worthless elsewhere.
//!
//! Strangers cannot lock real clients out: a handshake has one deadline for the whole of
//! it, however slowly its bytes trickle in; connections that have not authenticated are
//! limited per source address and in total, and when the total is reached the oldest
//! stranger is dropped to make room rather than the newcomer refused, so a real client's
//! handshake (a round trip or two) gets through; authenticated sessions are counted apart;
//! and an address that keeps failing to authenticate is turned away for a while.
//!
//! Every connection is TLS unless the server was started with `--allow-unencrypted` and
//! the client asked for none: the first byte a client sends tells (a TLS handshake record,
//! or the plaintext preamble's `W`), and the greeting rides in TLS's first flight. A
//! plaintext client the server does not allow gets a greeting that is a refusal naming
//! the flags. Without TLS, control frames after the proofs and every block carry a MAC.
//!
//! A failing or panicking session ends alone, the listener goes on. On a signal to stop
//! the server stops accepting, lets every session end the way an interrupted one does (its
//! partial files journaled for the next run), and returns within a bound.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use wanxfer_proto::handshake::{Authenticated, HandshakeError, ServerHandshake, Side, Step};
use wanxfer_proto::{
    features, session_flags, ConnectionKind, Direction, ErrorMsg, FabricEndpoint, FailureClass,
    Message, OpenSession, Preamble, Stats, TransportKind,
};
use wanxfer_session::negotiate::{self, Limits};

use super::conn::{self, Deadline};
use super::driver::{Driver, Event, Events, Outcome, Setup};
use super::grants::{GrantTable, GRANT_REFUSED};
use super::observe::{Observer, SessionEnd, SessionInfo, SessionKind};
use super::state::StateDir;
use super::{random, Params, Tuning, DISCARD_PATH, SYNTHETIC_PATH};
use crate::auth::{
    authorize, certificate_identity, Access, Export, ExportConfig, Exports, Identity, IssuerConfig,
    Issuers,
};
use crate::digest::BlockKey;
use crate::error::count_of;
use crate::fs::Root;
use crate::pool::Cancel;
use crate::progress::{CpuMeter, Progress};
use crate::select::Matcher;
use crate::sink::{Placement, Sink, SinkLimits};
use crate::source::Source;
use crate::stream::Stream;
use crate::tls::ServerIdentity;
use crate::transport::fabric::{self, FabricTransport, SlotPlan};
use crate::transport::{Joined, TcpTransport};
use crate::{Error, ErrorClass};

/// The server's own bounds; a client's request is clamped to them.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    pub max_streams: u16,
    pub max_block_size: u32,
    pub max_depth: u16,
    pub max_window: u32,
    /// Concurrent sessions.
    pub max_sessions: usize,
    /// Connections that have not finished their handshake yet, in all.
    pub max_pending: usize,
    /// Of those, from one source address.
    pub max_pending_per_address: usize,
    pub readers: usize,
    pub writers: usize,
    pub max_open_files: usize,
    /// Time a connection may take for its whole handshake.
    pub handshake_timeout: Duration,
    /// Bytes of block buffers one session may use (its pool, or its fabric slots).
    pub max_session_memory: u64,
    /// How pulls send file bytes.
    pub io: crate::source::IoMode,
    /// How pushed files are written.
    pub write: crate::fs::WriteMode,
    /// The libfabric provider offered to clients asking for the fabric transport; `None`
    /// offers TCP only.
    pub fabric_provider: Option<String>,
    /// How long a silent peer is waited for before its session fails.
    pub stall_timeout: Duration,
    /// How long a peer that sends only keepalives keeps its session.
    pub idle_timeout: Option<Duration>,
    /// Where journals of interrupted transfers are kept.
    pub state_dir: Option<PathBuf>,
    /// How long the partial files of an abandoned transfer are kept for it to resume.
    pub keep_partial: Duration,
    /// Pushed files are durable before they are acknowledged.
    pub durable: bool,
    /// Failed authentications from one address within a minute before it is turned away
    /// for the rest of that minute.
    pub max_auth_failures: u32,
    /// How long a stopping server waits for its sessions to end.
    pub drain_timeout: Duration,
    /// The TLS certificate and key (`--cert`/`--key`); without one the server uses the
    /// one it created in its state directory (or, without that, one for this run).
    pub identity: Option<ServerIdentity>,
    /// Clients may ask for no encryption (`--allow-unencrypted`).
    pub allow_unencrypted: bool,
    /// Pushed files get the owner and group the client sends (`--accept-owners`); without
    /// it they stay this server's, as when it does not run as root.
    pub accept_owners: bool,
    /// The exports (`[[export]]` in the configuration); empty: the root given to
    /// [`Server::bind`] is the one export, read and written with the shared secret.
    pub exports: Vec<ExportConfig>,
    /// Issuers whose bearer tokens are verified (`[[issuer]]`).
    pub issuers: Vec<IssuerConfig>,
    /// This server's names in a token's `aud` (`--audience`).
    pub audiences: Vec<String>,
    /// CA certificates that vouch for clients' X.509 certificates (`--client-ca`).
    pub client_ca: Option<PathBuf>,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_streams: 32,
            max_block_size: 16 << 20,
            max_depth: 32,
            max_window: 65_536,
            max_sessions: 16,
            max_pending: 256,
            max_pending_per_address: 16,
            readers: Tuning::default().readers,
            writers: Tuning::default().writers,
            max_open_files: 512,
            handshake_timeout: Duration::from_secs(10),
            max_session_memory: 512 << 20,
            io: crate::source::IoMode::Auto,
            write: crate::fs::WriteMode::Auto,
            fabric_provider: None,
            stall_timeout: super::DEFAULT_STALL_TIMEOUT,
            idle_timeout: Some(super::DEFAULT_IDLE_TIMEOUT),
            state_dir: None,
            keep_partial: Duration::from_secs(24 * 3600),
            durable: true,
            max_auth_failures: 10,
            drain_timeout: Duration::from_secs(10),
            identity: None,
            allow_unencrypted: false,
            accept_owners: false,
            exports: Vec::new(),
            issuers: Vec::new(),
            audiences: Vec::new(),
            client_ca: None,
        }
    }
}

/// Why a receiving server does not give pushed files the owners a client sends, if it
/// does not: giving files away takes root, and root gives them away only when told to.
fn owners_refusal(accept_owners: bool) -> Option<String> {
    if !crate::preserve::may_chown() {
        Some("owner and group not kept: the server does not run as root".into())
    } else if !accept_owners {
        Some(
            "owner and group not kept: the server keeps pushed files owned by itself; \
             start it with --accept-owners (accept_owners = true in its configuration) \
             to keep the owners clients send"
                .into(),
        )
    } else {
        None
    }
}

impl ServerLimits {
    /// The server's state directory by default: beside a client's, one per served root.
    pub fn default_state_dir(root: &Path) -> PathBuf {
        let absolute = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        let hash = twox_hash::XxHash3_64::oneshot(std::os::unix::ffi::OsStrExt::as_bytes(
            absolute.as_os_str(),
        ));
        StateDir::client_default().join(format!("server-{hash:016x}"))
    }
}

/// A running session, as data connections and later sessions of its transfer find it.
struct Entry {
    auth: Authenticated,
    events: Events,
    /// A pipelined session this side receives (`features::PIPELINE`): a join is not
    /// answered, as the client's blocks follow it at once.
    silent_joins: bool,
    /// The session's CPU, which a data connection's thread adds itself to once it has
    /// joined: its TLS handshake is the session's work, done before the session was known.
    meter: Arc<CpuMeter>,
}

/// A session's transfer, so that a newer session of the same transfer (the client
/// retrying after a failure this side has not noticed yet) can end it first.
#[derive(Clone)]
struct Running {
    cancel: Cancel,
    done: Arc<(Mutex<bool>, Condvar)>,
    /// Its counters, once it has agreed its session: whether it still moves anything.
    moved: Arc<OnceLock<Arc<Progress>>>,
    /// Set once the session told the observer it ended, from inside (the `stats` hook,
    /// before the client hears the end), so that it is not told again.
    end_reported: Arc<AtomicBool>,
}

impl Running {
    /// Everything the session has done so far, as one number that grows while it lives.
    fn activity(&self) -> u64 {
        self.moved.get().map_or(0, |p| {
            [&p.bytes, &p.bytes_skipped, &p.files, &p.failed_files]
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .sum()
        })
    }

    /// Waits up to `timeout` for the session to end; true if it did.
    fn wait_done(&self, timeout: Duration) -> bool {
        let (lock, ended) = &*self.done;
        let guard = lock.lock().expect("no panics while held");
        let (guard, _) = ended
            .wait_timeout_while(guard, timeout, |d| !*d)
            .expect("no panics while held");
        *guard
    }
}

/// Transfers run by whom: the same request from another identity is another transfer,
/// which must not be able to end this one.
type TransferKey = (String, [u8; 16]);

/// How long a second session of a running transfer waits for the first to end on its
/// own (a client killed and run again: its old connections' FIN is on the way) or to
/// show it still moves data (two copies of one command running at once).
const TAKEOVER_GRACE: Duration = Duration::from_secs(5);

#[derive(Default)]
struct Registry {
    sessions: Mutex<HashMap<[u8; 16], Entry>>,
    /// Signalled (under `sessions`) when a session opens: a pull's data connections may
    /// join before it does (`features::PULL_PIPELINE`).
    opened: Condvar,
    transfers: Mutex<HashMap<TransferKey, Running>>,
}

/// Connections that have not authenticated yet.
#[derive(Default)]
struct Pending {
    state: Mutex<PendingState>,
}

#[derive(Default)]
struct PendingState {
    next: u64,
    per_address: HashMap<IpAddr, usize>,
    /// Oldest first: who is dropped when the total is reached.
    order: VecDeque<(u64, IpAddr, Arc<TcpStream>)>,
}

/// A pending connection's place; released when it authenticates or ends.
struct Ticket {
    pending: Arc<Pending>,
    id: Option<u64>,
}

impl Pending {
    fn admit(
        self: &Arc<Self>,
        ip: IpAddr,
        stream: &TcpStream,
        limits: &ServerLimits,
    ) -> Option<Ticket> {
        let mut st = self.state.lock().expect("no panics while held");
        if st.per_address.get(&ip).copied().unwrap_or(0) >= limits.max_pending_per_address {
            return None;
        }
        while st.order.len() >= limits.max_pending.max(1) {
            let (_, old_ip, old) = st.order.pop_front().expect("not empty");
            decrement(&mut st.per_address, old_ip);
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        let id = st.next;
        st.next += 1;
        *st.per_address.entry(ip).or_default() += 1;
        st.order
            .push_back((id, ip, Arc::new(stream.try_clone().ok()?)));
        Some(Ticket {
            pending: self.clone(),
            id: Some(id),
        })
    }
}

fn decrement(map: &mut HashMap<IpAddr, usize>, ip: IpAddr) {
    if let Some(n) = map.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            map.remove(&ip);
        }
    }
}

impl Ticket {
    fn release(&mut self) {
        let Some(id) = self.id.take() else { return };
        let mut st = self.pending.state.lock().expect("no panics while held");
        if let Some(at) = st.order.iter().position(|(i, _, _)| *i == id) {
            let (_, ip, _) = st.order.remove(at).expect("found");
            decrement(&mut st.per_address, ip);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.release();
    }
}

/// Failed authentications per address, within a minute.
#[derive(Default)]
struct Failures(Mutex<HashMap<IpAddr, (u32, Instant)>>);

const FAILURE_WINDOW: Duration = Duration::from_secs(60);

impl Failures {
    fn blocked(&self, ip: IpAddr, max: u32) -> bool {
        let map = self.0.lock().expect("no panics while held");
        map.get(&ip)
            .is_some_and(|(n, since)| *n >= max && since.elapsed() < FAILURE_WINDOW)
    }

    fn record(&self, ip: IpAddr) {
        let mut map = self.0.lock().expect("no panics while held");
        if map.len() > 4096 {
            map.retain(|_, (_, since)| since.elapsed() < FAILURE_WINDOW);
        }
        let entry = map.entry(ip).or_insert((0, Instant::now()));
        if entry.1.elapsed() >= FAILURE_WINDOW {
            *entry = (0, Instant::now());
        }
        entry.0 += 1;
    }
}

/// A listening server.
pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

struct Shared {
    exports: Exports,
    issuers: Issuers,
    /// `None`: no export names `secret`; only tokens and certificates get in.
    secret: Option<Vec<u8>>,
    tls: Arc<rustls::ServerConfig>,
    identity: ServerIdentity,
    limits: ServerLimits,
    state: Option<StateDir>,
    registry: Registry,
    pending: Arc<Pending>,
    failures: Failures,
    sessions: AtomicUsize,
    /// Every session's cancel token, to stop them all.
    stopping: Cancel,
    /// Metrics, a transfer log: told of every session.
    observer: Option<Arc<dyn Observer>>,
    /// The last session's number.
    numbered: AtomicU64,
    /// Grants this server made for third-party copies into it.
    grants: GrantTable,
}

/// How long a grant this server makes lives, unless the client asks for less.
pub const GRANT_TTL: Duration = Duration::from_secs(wanxfer_proto::tpc::MAX_GRANT_TTL_S as u64);

impl crate::ops::server::ThirdParty for Shared {
    fn grant(
        &self,
        request: &wanxfer_proto::tpc::Grant,
        identity: &Identity,
    ) -> Result<wanxfer_proto::tpc::Granted, Error> {
        if request
            .path
            .split_first()
            .is_some_and(|(first, _)| first.starts_with(crate::ops::RESERVED_PREFIX))
        {
            return Err(Error::Op {
                failure: wanxfer_proto::ops::OpFailure::Reserved,
                message: format!("{}: the name is the server's own", request.path),
            });
        }
        // Refused here already if the client could not write there itself (its session
        // is authorized again, as this client, when the push arrives).
        let (export, inside) = self.exports.resolve(&request.path)?;
        authorize(identity, export, &inside, Access::Create)?;
        let ttl = Duration::from_secs(request.ttl_s.into()).min(GRANT_TTL);
        self.grants.issue(
            request.path.clone(),
            request.preserve,
            identity.clone(),
            ttl,
            Instant::now(),
        )
    }

    fn push_to(
        &self,
        request: &wanxfer_proto::tpc::PushTo,
        identity: &Identity,
        control: &mut conn::Control,
    ) -> Result<wanxfer_proto::tpc::TransferSummary, Error> {
        // Every source within one export, each readable by the client.
        let mut export: Option<&Export> = None;
        let mut sources = Vec::with_capacity(request.sources.len());
        for path in &request.sources {
            let (named, inside) = self.exports.resolve(path)?;
            if export.is_some_and(|e| !std::ptr::eq(e, named)) {
                return Err(Error::Refused {
                    path: path.to_string(),
                    reason: "the sources of one third-party copy are in one export".into(),
                });
            }
            authorize(identity, named, &inside, Access::Read)?;
            export = Some(named);
            sources.push(inside);
        }
        let Some(export) = export else {
            return Err(Error::Usage("a third-party copy names no source".into()));
        };
        let request = wanxfer_proto::tpc::PushTo {
            sources,
            ..request.clone()
        };
        let side = super::tpc::SourceSide {
            root: &export.root,
            exports: &self.exports,
            limits: &self.limits,
            state_dir: self.limits.state_dir.as_deref(),
            stopping: &self.stopping,
        };
        super::tpc::push(&side, &request, control)
    }
}

impl Server {
    /// A server of `root`, or of `limits.exports` when there are any (`root` is then
    /// unused). Without a `secret`, only clients with a credential are let in.
    pub fn bind(
        addr: &str,
        root: &Path,
        secret: Option<Vec<u8>>,
        limits: ServerLimits,
    ) -> Result<Server, Error> {
        let exports = if limits.exports.is_empty() {
            Exports::single(Root::open(root)?)
        } else {
            Exports::open(&limits.exports)?
        };
        let issuers = Issuers::load(&limits.issuers, &limits.audiences)?;
        let state = limits
            .state_dir
            .as_deref()
            .map(StateDir::open)
            .transpose()?;
        let identity = match (&limits.identity, &limits.state_dir) {
            (Some(identity), _) => identity.clone(),
            (None, Some(dir)) => ServerIdentity::load_or_create(dir)?,
            (None, None) => ServerIdentity::ephemeral()?,
        };
        let tls = identity.server_config_with(limits.client_ca.as_deref())?;
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::network("listening on", addr, e))?;
        Ok(Server {
            listener,
            shared: Arc::new(Shared {
                exports,
                issuers,
                secret,
                tls,
                identity,
                limits,
                state,
                registry: Registry::default(),
                pending: Arc::default(),
                failures: Failures::default(),
                sessions: AtomicUsize::new(0),
                stopping: Cancel::default(),
                grants: GrantTable::default(),
                observer: None,
                numbered: AtomicU64::new(0),
            }),
        })
    }

    /// Tells `observer` of every session from now on; call before [`Server::serve`].
    pub fn observe(mut self, observer: Arc<dyn Observer>) -> Server {
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => shared.observer = Some(observer),
            // Shared only once `serve` hands it to threads, which it has not yet: a
            // `Server` is consumed here and `serve` borrows it.
            None => unreachable!("the server's state is shared only while it serves"),
        }
        self
    }

    /// The certificate clients see, for the operator to print and compare.
    pub fn identity(&self) -> &ServerIdentity {
        &self.shared.identity
    }

    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.listener
            .local_addr()
            .map_err(|e| Error::network("listening on", "local socket", e))
    }

    /// Removes what transfers abandoned for longer than `--keep-partial` left, and gives
    /// back space reserved beyond what interrupted ones verified; logs what it did.
    fn collect_garbage(shared: &Shared) {
        if let Some(state) = &shared.state {
            let sweep = state.collect_garbage(shared.limits.keep_partial);
            for line in sweep.lines {
                tracing::info!("{line}");
            }
            if let Some(observer) = &shared.observer {
                observer.partial_files_kept(sweep.partial_files_kept);
            }
        }
    }

    /// Accepts connections until `cancel` is set, then drains: no new connection, every
    /// session ends (keeping partial files for a later run), within the drain timeout.
    pub fn serve(&self, cancel: &Cancel) -> Result<(), Error> {
        Server::collect_garbage(&self.shared);
        if let Some(provider) = &self.shared.limits.fabric_provider {
            // libfabric's start-up (0.46 s here) is paid now, not by the first fabric
            // session, and a provider that is missing is logged before anyone asks.
            let provider_name = provider.clone();
            FabricTransport::prepare(provider, move |found| match found {
                Ok(names) => tracing::info!(
                    "fabric transport ready: provider {}, fabric {}, domain {}",
                    names.provider,
                    names.fabric,
                    names.domain
                ),
                Err(e) => tracing::warn!(
                    "fabric transport {provider_name} unavailable, so sessions asking for it \
                     will fail: {e}"
                ),
            });
        }
        let gc = {
            let shared = self.shared.clone();
            let every = (self.shared.limits.keep_partial / 4)
                .clamp(Duration::from_secs(60), Duration::from_secs(3600));
            std::thread::Builder::new()
                .name("wanxfer-gc".into())
                .spawn(move || {
                    let mut last = Instant::now();
                    while !shared.stopping.is_cancelled() {
                        std::thread::sleep(Duration::from_millis(200));
                        if last.elapsed() >= every {
                            Server::collect_garbage(&shared);
                            last = Instant::now();
                        }
                    }
                })
                .ok()
        };
        self.listener
            .set_nonblocking(true)
            .map_err(|e| Error::network("listening on", "local socket", e))?;
        while !cancel.is_cancelled() {
            match self.listener.accept() {
                Ok((stream, addr)) => self.admit(stream, addr),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Woken by the next connection at once, by a stop request within a
                    // tenth of a second; an idle server costs nothing.
                    let mut fds = [rustix::event::PollFd::new(
                        &self.listener,
                        rustix::event::PollFlags::IN,
                    )];
                    let tenth = rustix::event::Timespec {
                        tv_sec: 0,
                        tv_nsec: 100_000_000,
                    };
                    let _ = rustix::event::poll(&mut fds, Some(&tenth));
                }
                Err(e) => {
                    // Out of descriptors, say: wait and go on rather than exit.
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        self.drain();
        if let Some(gc) = gc {
            let _ = gc.join();
        }
        Ok(())
    }

    fn drain(&self) {
        let running = self.shared.sessions.load(Ordering::SeqCst);
        tracing::info!(
            "stopping: no new connections; ending {}",
            count_of(running as u64, "session")
        );
        self.shared.stopping.cancel();
        let deadline = Instant::now() + self.shared.limits.drain_timeout;
        while self.shared.sessions.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let left = self.shared.sessions.load(Ordering::SeqCst);
        if left == 0 {
            tracing::info!(
                "stopped: every session ended, partial files kept for their transfers to resume"
            );
        } else {
            tracing::warn!(
                "stopped with {} still ending after {:?}",
                count_of(left as u64, "session"),
                self.shared.limits.drain_timeout
            );
        }
    }

    fn admit(&self, stream: TcpStream, addr: SocketAddr) {
        let _ = stream.set_nonblocking(false);
        let peer = addr.to_string();
        let Some(ticket) = self
            .shared
            .pending
            .admit(addr.ip(), &stream, &self.shared.limits)
        else {
            tracing::debug!("{peer}: too many unauthenticated connections from this address");
            return;
        };
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("wanxfer-conn".into())
            .spawn(move || {
                let connection = Connection {
                    shared,
                    ticket,
                    peer,
                    ip: addr.ip(),
                };
                connection.run(stream);
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start a thread for {addr}: {e}");
        }
    }
}

struct Connection {
    shared: Arc<Shared>,
    ticket: Ticket,
    peer: String,
    ip: IpAddr,
}

impl Connection {
    fn run(mut self, tcp: TcpStream) {
        let limits = &self.shared.limits;
        conn::tune_socket(&tcp, limits.stall_timeout);
        let deadline = Deadline::after(limits.handshake_timeout);
        // Whether the connection said what it is: a client closing the data connections
        // it opened early (see `join_channel`) may do so before that, and neither that nor
        // a port scan is a failure to count.
        let mut identified = false;
        let result = random().and_then(|nonce| {
            let mut handshake =
                ServerHandshake::with_secret(self.shared.secret.as_deref(), nonce, self.features());
            let greeting = conn::greeting(&handshake.hello());
            let mut stream = self.secure(tcp, &greeting, deadline)?;
            handshake.set_binding(stream.binding());
            let kind = conn::read_preamble(&mut stream, deadline, &self.peer)?;
            identified = true;
            match kind {
                ConnectionKind::Control => self.control(stream, deadline, &mut handshake),
                ConnectionKind::Data => self.join_channel(stream, deadline, &nonce),
                _ => Err(Error::protocol(&self.peer, "not a client's connection")),
            }
        });
        if let Err(e) = result {
            let unnamed_close = !identified && matches!(e, Error::Network { .. });
            if let (Some(observer), false) = (&self.shared.observer, unnamed_close) {
                observer.connection_failed(e.class());
            }
            match e {
                Error::Network { .. } => tracing::debug!("connection from {}: {e}", self.peer),
                _ => tracing::warn!("session with {}: {e}", self.peer),
            }
        }
    }

    /// TLS, or plaintext where allowed, as the client's first byte says; the greeting
    /// goes out in the server's first flight either way.
    fn secure(&self, tcp: TcpStream, greeting: &[u8], deadline: Deadline) -> Result<Stream, Error> {
        let first = peek_first(&tcp, deadline, &self.peer)?;
        if first == crate::tls::HANDSHAKE_RECORD {
            return crate::tls::accept(tcp, &self.shared.tls, greeting, deadline, &self.peer);
        }
        let mut stream = Stream::plain(tcp);
        if !self.shared.limits.allow_unencrypted {
            let mut refusal = Preamble::new(ConnectionKind::Server).encode().to_vec();
            refusal.extend_from_slice(&conn::frames(&[&Message::Error(ErrorMsg::new(
                FailureClass::Refused,
                "this server requires encryption: the client asked for none \
                 (--no-encryption), which a server accepts only when started with \
                 --allow-unencrypted",
            ))]));
            let _ = conn::write_all_by(&mut stream, &refusal, deadline, &self.peer);
            return Err(Error::Usage(format!(
                "{}: refused a client without encryption (start with --allow-unencrypted to \
                 accept it)",
                self.peer
            )));
        }
        conn::write_all_by(&mut stream, greeting, deadline, &self.peer)?;
        Ok(stream)
    }

    fn features(&self) -> u64 {
        let mut offered = features::SUPPORTED;
        if self.shared.limits.fabric_provider.is_none() {
            offered &= !features::FABRIC;
        }
        if self.shared.state.is_none() {
            offered &= !features::RESUME;
        }
        if !self.shared.issuers.is_empty() || self.shared.limits.client_ca.is_some() {
            offered |= features::CREDENTIAL;
        }
        offered
    }

    fn refuse(stream: &mut Stream, class: FailureClass, text: &str, peer: &str) {
        let msg = Message::Error(ErrorMsg::new(class, text));
        let _ = conn::write_all_by(
            stream,
            &conn::frames(&[&msg]),
            Deadline::after(Duration::from_secs(1)),
            peer,
        );
        close_after_refusal(stream);
    }

    fn join_channel(
        &mut self,
        mut stream: Stream,
        deadline: Deadline,
        nonce: &[u8; 32],
    ) -> Result<(), Error> {
        let first = match conn::read_message_by(&mut stream, deadline, &self.peer) {
            // A client opens its first data connections while its control connection
            // authenticates, and closes those its session did not take (it was refused,
            // or agreed on fewer streams): no error of anyone's, however the close looks
            // from here (an end, a reset, no close_notify).
            Err(e @ Error::Network { .. }) => {
                tracing::debug!(
                    "{}: a data connection closed before joining: {e}",
                    self.peer
                );
                return Ok(());
            }
            other => other?,
        };
        let Message::ChannelJoin(join) = first else {
            return Err(Error::protocol(
                &self.peer,
                "a data channel must start by joining",
            ));
        };
        let registry = &self.shared.registry;
        let mut sessions = registry.sessions.lock().expect("no panics while held");
        // A pull's client joins as soon as its proof is out, and the session it names may
        // still be opening on its control connection: wait for it, as long as this
        // connection's handshake may take, and no longer than the client keeps the
        // connection (it closes it when its session is refused).
        while !sessions.contains_key(&join.session_id) {
            let Ok(Some(left)) = deadline.left() else {
                break;
            };
            sessions = registry
                .opened
                .wait_timeout(sessions, left.min(Duration::from_millis(100)))
                .expect("no panics while held")
                .0;
            if !sessions.contains_key(&join.session_id) && conn::peer_closed(stream.tcp()) {
                tracing::debug!(
                    "{}: a data connection closed while its session was opening",
                    self.peer
                );
                return Ok(());
            }
        }
        let found = sessions
            .get(&join.session_id)
            .filter(|e| {
                e.auth.verify_channel(
                    &join.session_id,
                    join.index,
                    nonce,
                    &stream.binding(),
                    &join.proof,
                )
            })
            .map(|e| (e.events.clone(), e.silent_joins, e.meter.clone()));
        drop(sessions);
        let Some((events, silent, meter)) = found else {
            Self::refuse(
                &mut stream,
                FailureClass::Auth,
                "unknown session or bad channel proof",
                &self.peer,
            );
            return Err(Error::Auth {
                peer: self.peer.clone(),
                detail: "data channel with an unknown session or a bad proof".into(),
            });
        };
        if !silent {
            conn::write_all_by(
                &mut stream,
                &conn::frames(&[&Message::ChannelAccepted { index: join.index }]),
                deadline,
                &self.peer,
            )?;
        }
        self.ticket.release();
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        // This thread ends here; what it did (mostly the TLS handshake) was the session's.
        meter.add_this_thread();
        events
            .try_send(Event::Joined(Joined { stream, join }))
            .map_err(|_| {
                Error::Limit(format!(
                    "{}: a data channel for a session that is ending or full",
                    self.peer
                ))
            })
    }

    fn control(
        &mut self,
        mut stream: Stream,
        deadline: Deadline,
        handshake: &mut ServerHandshake,
    ) -> Result<(), Error> {
        if self
            .shared
            .failures
            .blocked(self.ip, self.shared.limits.max_auth_failures)
        {
            Self::refuse(
                &mut stream,
                FailureClass::Auth,
                "too many failed authentications from this address: wait a minute",
                &self.peer,
            );
            return Err(Error::Auth {
                peer: self.peer.clone(),
                detail: "turned away after repeated failed authentications".into(),
            });
        }
        // The grant this connection proved instead of the secret (a third-party push).
        let mut grant = None;
        let auth = loop {
            let msg = conn::read_message_by(&mut stream, deadline, &self.peer)?;
            let step = match msg {
                Message::GrantProof { grant_id, mac } => {
                    grant = Some(grant_id);
                    let secret = self.shared.grants.secret(&grant_id, Instant::now());
                    handshake.handle_grant(&grant_id, &mac, secret.as_ref())
                }
                msg => handshake.handle(msg),
            };
            match step {
                Ok(Step::Wait) => {}
                Ok(Step::Send(reply)) => {
                    conn::write_all_by(&mut stream, &conn::frames(&[&reply]), deadline, &self.peer)?
                }
                Ok(Step::SendAndDone(reply, auth)) => {
                    // Without encryption, everything after the proofs carries MACs.
                    stream.authenticate_reads(auth.control_key(Side::Client));
                    conn::write_all_by(
                        &mut stream,
                        &conn::frames(&[&reply]),
                        deadline,
                        &self.peer,
                    )?;
                    stream.authenticate_writes(auth.control_key(Side::Server));
                    break auth;
                }
                Ok(Step::Done(auth)) => break auth,
                Err(e) => {
                    if e == HandshakeError::BadProof {
                        self.shared.failures.record(self.ip);
                    }
                    let refusal = match grant {
                        // Nothing to guess here: saying so helps the client and no one else.
                        None if e == HandshakeError::NoSecret => {
                            Message::Error(ErrorMsg::new(FailureClass::Auth, &e.to_string()))
                        }
                        None => ServerHandshake::auth_failed(),
                        Some(_) => Message::Error(ErrorMsg::new(FailureClass::Auth, GRANT_REFUSED)),
                    };
                    let _ = conn::write_all_by(
                        &mut stream,
                        &conn::frames(&[&refusal]),
                        deadline,
                        &self.peer,
                    );
                    close_after_refusal(&mut stream);
                    return Err(Error::handshake(&self.peer, e));
                }
            }
        };
        let identity = if auth.peer_features & features::CREDENTIAL != 0 {
            match self.credential(&mut stream, deadline) {
                Ok(identity) => identity,
                Err(e) => {
                    if matches!(e, Error::Auth { .. }) {
                        self.shared.failures.record(self.ip);
                    }
                    Self::refuse(&mut stream, e.wire_class(), &e.to_string(), &self.peer);
                    return Err(e);
                }
            }
        } else {
            Identity::Secret
        };
        tracing::debug!("{}: authenticated as {identity}", self.peer);
        self.ticket.release();
        let request = conn::read_message_by(&mut stream, deadline, &self.peer)?;
        if !matches!(request, Message::OpenSession(_) | Message::OpRequest(_)) {
            return Err(Error::protocol(&self.peer, "expected a request"));
        }
        if self.shared.sessions.fetch_add(1, Ordering::SeqCst) >= self.shared.limits.max_sessions {
            self.shared.sessions.fetch_sub(1, Ordering::SeqCst);
            Self::refuse(
                &mut stream,
                FailureClass::Limit,
                "server busy: too many sessions, retry later",
                &self.peer,
            );
            return Err(Error::Limit("too many sessions".into()));
        }
        let result = match (request, grant) {
            (Message::OpenSession(open), None) => self.session(stream, auth, identity, open),
            (Message::OpenSession(open), Some(id)) => self.granted_session(stream, auth, open, id),
            (_, Some(_)) => {
                Self::refuse(
                    &mut stream,
                    FailureClass::Refused,
                    "a third-party grant allows one push, nothing else",
                    &self.peer,
                );
                Err(Error::Auth {
                    peer: self.peer.clone(),
                    detail: "a grant's connection asked for something other than its push".into(),
                })
            }
            // Remote operations instead of a session: this connection carries only them.
            (Message::OpRequest(first), None) => {
                let _ = stream.set_write_timeout(None);
                let info = self.info(SessionKind::Op, Vec::new(), &stream, &identity);
                self.observe_start(&info);
                let result = conn::Control::new(&stream, self.peer.clone()).and_then(|control| {
                    let idle = self.shared.limits.stall_timeout;
                    let served = crate::ops::server::Served {
                        exports: &self.shared.exports,
                        identity: &identity,
                        third_party: &*self.shared,
                        features: auth.negotiated(),
                    };
                    crate::ops::server::serve(&served, stream, control, first, idle)
                });
                self.observe_end(&info, &result);
                result
            }
            _ => Err(Error::protocol(&self.peer, "expected a request")),
        };
        self.shared.sessions.fetch_sub(1, Ordering::SeqCst);
        result
    }

    /// Who a client that authenticates with a credential is: its token verified
    /// against the configured issuers, or the certificate TLS verified against
    /// `--client-ca`. Read within the handshake's deadline, right after the proofs.
    fn credential(&self, stream: &mut Stream, deadline: Deadline) -> Result<Identity, Error> {
        let refused = |detail: &str| Error::Auth {
            peer: self.peer.clone(),
            detail: detail.to_string(),
        };
        match conn::read_message_by(stream, deadline, &self.peer)? {
            Message::Credential(wanxfer_proto::Credential::Token(token)) => {
                if self.shared.issuers.is_empty() {
                    return Err(refused("this server is configured to accept no tokens"));
                }
                self.shared.issuers.verify(&token, &self.peer)
            }
            Message::Credential(wanxfer_proto::Credential::Certificate) => {
                if self.shared.limits.client_ca.is_none() {
                    return Err(refused(
                        "this server takes no client certificates (it has no --client-ca)",
                    ));
                }
                match stream.peer_certificate() {
                    Some(der) => certificate_identity(&der),
                    None => Err(refused(
                        "no client certificate was presented (cp --cert FILE --key FILE)",
                    )),
                }
            }
            _ => Err(Error::protocol(
                &self.peer,
                "expected the client's credential",
            )),
        }
    }

    /// Takes the place of a running session of the same transfer, or refuses.
    ///
    /// A client retrying after a failure this side has not noticed yet (a connection
    /// half open, a peer gone without a FIN) leaves a session that moves nothing: it is
    /// ended and replaced, so that the retry resumes at once. A session that still moves
    /// data is another copy of the same command running at the same time: ending it
    /// would only make its client retry and end this one in turn, each resuming the
    /// other's work and neither finishing. The newcomer is refused instead (as a busy
    /// server refuses, so its client tries again later and then finds what is done).
    fn claim_transfer(&self, key: TransferKey, ours: &Running) -> Result<(), String> {
        let ours = ours.clone();
        let transfers = &self.shared.registry.transfers;
        let previous = {
            let mut running = transfers.lock().expect("no panics while held");
            match running.get(&key) {
                Some(previous) => previous.clone(),
                None => {
                    running.insert(key, ours);
                    return Ok(());
                }
            }
        };
        let before = previous.activity();
        if !previous.wait_done(TAKEOVER_GRACE) {
            if previous.activity() > before {
                return Err(format!(
                    "the same transfer is already running in another session, still moving \
                     data; this one was not started (retry once that one has ended, and what \
                     it moved will be skipped), and the other was left alone ({})",
                    self.peer
                ));
            }
            tracing::info!(
                "{}: a new session of a running transfer whose old session moved nothing \
                 for {} s: ending the old one first",
                self.peer,
                TAKEOVER_GRACE.as_secs()
            );
            previous.cancel.cancel();
            previous.wait_done(Duration::from_secs(30));
        }
        let mut running = transfers.lock().expect("no panics while held");
        match running.get(&key) {
            // Another newcomer took the place while this one waited: it runs.
            Some(other) if !Arc::ptr_eq(&other.done, &previous.done) => Err(format!(
                "the same transfer was started again in another session while this one \
                 waited; this one was not started ({})",
                self.peer
            )),
            _ => {
                running.insert(key, ours);
                Ok(())
            }
        }
    }

    fn release_transfer(&self, key: &TransferKey, done: &Arc<(Mutex<bool>, Condvar)>) {
        let mut transfers = self
            .shared
            .registry
            .transfers
            .lock()
            .expect("no panics while held");
        if transfers
            .get(key)
            .is_some_and(|r| Arc::ptr_eq(&r.done, done))
        {
            transfers.remove(key);
        }
        drop(transfers);
        let (lock, ended) = &**done;
        *lock.lock().expect("no panics while held") = true;
        ended.notify_all();
    }

    /// A push from a third-party copy's source, proved with grant `id`: only what the
    /// grant allows (see [`GrantTable::admit`]), and the grant spent once it completes.
    fn granted_session(
        &self,
        mut stream: Stream,
        auth: Authenticated,
        open: OpenSession,
        id: [u8; 16],
    ) -> Result<(), Error> {
        // The push runs as the client the grant was made for, so it may do exactly what
        // that client may.
        let identity = match self.shared.grants.admit(&id, &open, Instant::now()) {
            Ok(identity) => identity,
            Err(e) => {
                let text = match &e {
                    Error::Auth { detail, .. } => detail.clone(),
                    e => e.to_string(),
                };
                Self::refuse(&mut stream, e.wire_class(), &text, &self.peer);
                return Err(e);
            }
        };
        tracing::info!(
            "{}: third-party push into {} for {identity}",
            self.peer,
            open.paths[0]
        );
        let result = self.session(stream, auth, identity, open);
        self.shared.grants.finish(&id, result.is_ok());
        result
    }

    fn session(
        &self,
        stream: Stream,
        auth: Authenticated,
        identity: Identity,
        request: OpenSession,
    ) -> Result<(), Error> {
        let key = (identity.to_string(), request.transfer_id);
        let ours = Running {
            cancel: Cancel::default(),
            done: Arc::new((Mutex::new(false), Condvar::new())),
            moved: Arc::new(OnceLock::new()),
            end_reported: Arc::new(AtomicBool::new(false)),
        };
        match self.claim_transfer(key.clone(), &ours) {
            Ok(()) => {}
            Err(why) => {
                let mut stream = stream;
                Self::refuse(&mut stream, FailureClass::Limit, &why, &self.peer);
                return Err(Error::Limit(why));
            }
        }
        let kind = match request.direction {
            Direction::Push => SessionKind::Push,
            _ => SessionKind::Pull,
        };
        let paths = request.paths.iter().map(|p| p.to_string()).collect();
        let mut info = self.info(kind, paths, &stream, &identity);
        // A bug in one session must not leak its place or its transfer.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run_session(stream, auth, &identity, &request, &ours, &mut info)
        }))
        .unwrap_or_else(|_| Err(Error::Internal("a session thread panicked".into())));
        self.release_transfer(&key, &ours.done);
        if !ours.end_reported.load(Ordering::Acquire) {
            self.observe_end(&info, &result);
        }
        result
    }

    /// A session as its observer first sees it; `run_session` fills in what it agrees.
    fn info(
        &self,
        kind: SessionKind,
        paths: Vec<String>,
        stream: &Stream,
        identity: &Identity,
    ) -> SessionInfo {
        SessionInfo {
            number: self.shared.numbered.fetch_add(1, Ordering::Relaxed) + 1,
            peer: self.peer.clone(),
            identity: identity.to_string(),
            kind,
            paths,
            streams: 0,
            transport: "tcp",
            encryption: if stream.is_encrypted() { "tls" } else { "none" },
            started: std::time::SystemTime::now(),
            progress: None,
        }
    }

    fn observe_start(&self, info: &SessionInfo) {
        if let Some(observer) = &self.shared.observer {
            observer.session_started(info);
        }
    }

    fn observe_end(&self, info: &SessionInfo, result: &Result<(), Error>) {
        let Some(observer) = &self.shared.observer else {
            return;
        };
        let error = result.as_ref().err().map(|e| (e.class(), self.relative(e)));
        observer.session_ended(info, &session_end(info, error));
    }

    fn run_session(
        &self,
        mut stream: Stream,
        auth: Authenticated,
        identity: &Identity,
        request: &OpenSession,
        ours: &Running,
        info: &mut SessionInfo,
    ) -> Result<(), Error> {
        let shared = &self.shared;
        let l = &shared.limits;
        // Derived, not drawn: the client knows it once its proof is out, so a pull's data
        // connections can join before the answer reaches it.
        let session_id = auth.session_id();
        let receiving = request.direction == Direction::Push;
        let prepared = self.prepare(identity, request);
        let (role, wire_placement, export) = match prepared {
            Ok(p) => p,
            Err(e) => {
                Self::refuse(&mut stream, e.wire_class(), &self.relative(&e), &self.peer);
                return Err(e);
            }
        };
        let limits = Limits {
            max_streams: l.max_streams,
            max_block_size: l.max_block_size,
            max_depth: l.max_depth,
            max_window: l.max_window,
            max_memory: l.max_session_memory,
            disk_threads: if receiving { l.writers } else { l.readers } as u32,
        };
        let mut accepted = negotiate::clamp(request, &limits, session_id, wire_placement);
        if auth.negotiated() & features::PULL_PIPELINE == 0 {
            accepted.flags &= !session_flags::FRESH;
        }
        let pipelined = receiving && auth.negotiated() & features::PIPELINE != 0;
        if pipelined {
            // The entries the client may have sent behind its request must fit.
            accepted.window = accepted
                .window
                .max(request.window.min(wanxfer_proto::MAX_PIPELINED_ENTRIES));
        }
        // What this side cannot or will not keep is not asked of the sender; the client
        // learns of it from the answer, and why from this side's note.
        let owner_group = session_flags::PRESERVE_OWNER | session_flags::PRESERVE_GROUP;
        let mut owners_refused = None;
        if auth.negotiated() & wanxfer_proto::features::PRESERVE == 0 {
            accepted.flags &= !session_flags::PRESERVE_ALL;
        } else if receiving && accepted.flags & owner_group != 0 {
            owners_refused = owners_refusal(l.accept_owners);
            if owners_refused.is_some() {
                accepted.flags &= !owner_group;
            }
        }
        let tuning = Tuning {
            readers: l.readers,
            writers: l.writers,
            io: l.io,
            write: l.write,
            stall_timeout: l.stall_timeout,
            idle_timeout: l.idle_timeout,
            compare: request.compare,
            durable: l.durable,
            ..Tuning::default()
        };
        let mut params =
            Params::from_accepted(&accepted, &request.transfer_id, &tuning, auth.negotiated());
        params.resolve_io(conn::peer_on_this_host(&stream));
        let (kernel_tls, io_note) = params.settle_for_tls(&stream);
        let unencrypted = !stream.is_encrypted();
        if unencrypted {
            params.send_key = Some(BlockKey::new(auth.block_key(Side::Server)));
        }
        let receive_key = unencrypted.then(|| BlockKey::new(auth.block_key(Side::Client)));
        let fabric = match self.fabric_listener(request, &stream) {
            Ok(f) => f,
            Err(e) => {
                Self::refuse(&mut stream, e.wire_class(), &e.to_string(), &self.peer);
                return Err(e);
            }
        };
        let session_cancel = Cancel::linked(&[&ours.cancel, &shared.stopping]);
        // Registered before the client learns the session's id, so that its data
        // connections, which it opens at once, find it.
        let events = crossbeam_channel::bounded(super::driver::EVENT_QUEUE);
        let meter = Arc::new(CpuMeter::default());
        shared
            .registry
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                session_id,
                Entry {
                    auth,
                    events: events.0.clone(),
                    silent_joins: pipelined && request.transport != TransportKind::Fabric,
                    meter: meter.clone(),
                },
            );
        shared.registry.opened.notify_all();
        let _registered = Registered(&shared.registry, session_id);
        let transport: Arc<dyn crate::transport::Transport> = match fabric {
            Some((listener, endpoint)) => {
                // RDMA writes go from pool buffers: file bytes must be read into them.
                params.io = crate::source::IoMode::Copy;
                let transport = FabricTransport::server(
                    listener,
                    SlotPlan::new(params.block_size, params.depth),
                    params.session_tag,
                    params.block_size as usize,
                    self.peer.clone(),
                    session_cancel.clone(),
                )?
                .with_receive_key(receive_key);
                conn::write_all_by(
                    &mut stream,
                    &conn::frames(&[
                        &Message::SessionAccepted(accepted.clone()),
                        &Message::FabricEndpoint(endpoint),
                    ]),
                    Deadline::after(l.handshake_timeout),
                    &self.peer,
                )?;
                Arc::new(transport)
            }
            None => {
                conn::write_all_by(
                    &mut stream,
                    &conn::frames(&[&Message::SessionAccepted(accepted.clone())]),
                    Deadline::after(l.handshake_timeout),
                    &self.peer,
                )?;
                Arc::new(TcpTransport {
                    peer: self.peer.clone(),
                    block_size: params.block_size as usize,
                    session_tag: params.session_tag,
                    io: params.io,
                    receive_key,
                    kernel_tls,
                })
            }
        };
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        let progress = Arc::new(Progress::default());
        if let Some(note) = io_note {
            let _ = progress.io_fallback.set(note);
        }
        info.streams = accepted.streams;
        info.transport = match request.transport {
            TransportKind::Fabric => "fabric",
            _ => "tcp",
        };
        if kernel_tls {
            info.encryption = "ktls";
        }
        info.progress = Some(progress.clone());
        let _ = ours.moved.set(progress.clone());
        self.observe_start(info);
        let started = Instant::now();
        let (role, sink) = match role {
            Role::Send(source, selection) => (Role::Send(source, selection), None),
            Role::Receive(target) => {
                let report_to = events.0.clone();
                let report: crate::commit::Report = Arc::new(move |id, result| {
                    let _ = report_to.send(Event::Resolved { id, result });
                });
                let journal = match (&shared.state, &target, export) {
                    (Some(state), Some(_), Some(export)) if params.resumes() => Some(Arc::new(
                        state.journal(request.transfer_id, export.root.path())?,
                    )),
                    _ => None,
                };
                let sink = Arc::new(Sink::new(
                    target,
                    self.peer.clone(),
                    params.transfer_tag,
                    params.check_flags(),
                    SinkLimits {
                        max_open_files: l.max_open_files,
                        write: l.write,
                        compare: request.compare,
                        durable: l.durable,
                        block_size: u64::from(params.block_size),
                        checkpoint_bytes: super::client::checkpoint_bytes(&params),
                        preserve: params.preserve,
                        marked_links: params.marks_link_targets(),
                        // A push is never fresh: its entries come first.
                        entry_wait: None,
                    },
                    journal,
                    report,
                )?);
                if let Some(why) = owners_refused {
                    sink.note("owner".into(), why);
                }
                (Role::Receive(None), Some(sink))
            }
        };
        let stats_sink = sink.clone();
        let stats_meter = meter.clone();
        let (ending, end_observer, end_reported) = (
            info.clone(),
            shared.observer.clone(),
            ours.end_reported.clone(),
        );
        let direction = if receiving { "received" } else { "sent" };
        let who = format!("{} ({identity})", self.peer);
        let setup = Setup {
            params: params.clone(),
            peer: self.peer.clone(),
            transport,
            progress: progress.clone(),
            meter: meter.clone(),
            cancel: session_cancel,
            opener: None,
            round_trips: None,
            stats: Some(Box::new(move |outcome: &Outcome, progress: &Progress| {
                // Links and workers still running count too: at `Finish` the links have
                // not ended yet, and they did the decryption and the socket work.
                let cpu = stats_meter.so_far();
                let io = match &stats_sink {
                    Some(sink) => sink.io_use(),
                    None => outcome.io.clone(),
                };
                // Logged before the client hears the end, so that the log is complete
                // by the time the client is done.
                let secs = started.elapsed().as_secs_f64().max(1e-9);
                let bytes = progress.bytes.load(Ordering::Relaxed);
                tracing::info!(
                    "session with {who}: {direction} {bytes} bytes in {} ({} up to date, {} failed) in {secs:.2} s, {:.2} Gbit/s, CPU {:.2} s",
                    count_of(outcome.files_ok, "file"),
                    outcome.up_to_date,
                    outcome.failures.len(),
                    bytes as f64 * 8.0 / secs / 1e9,
                    cpu.seconds(),
                );
                // So is the transfer log's record: a script that reads it as soon as the
                // client exits finds it there. What follows (the client's last word, the
                // links' close) can still fail, but the files are in place and counted;
                // such a failure shows in the server's log and its metrics' connection
                // errors, not as a second record.
                if let Some(observer) = &end_observer {
                    observer.session_ended(&ending, &session_end(&ending, None));
                    end_reported.store(true, Ordering::Release);
                }
                Stats {
                    cpu_user_us: cpu.user_us,
                    cpu_sys_us: cpu.sys_us,
                    bytes: progress.bytes.load(Ordering::Relaxed),
                    files: outcome.files_ok,
                    io_mode: io.mode.into_bytes(),
                    direct_bytes: io.direct_bytes,
                    io_fallback: io.fallback.unwrap_or_default().into_bytes(),
                }
            })),
            shown: Some({
                let shared = self.shared.clone();
                Box::new(move |text: &str| crate::ops::server::relative_text(&shared.exports, text))
            }),
        };
        let driver = Driver::new(setup, &stream, events)?;
        let outcome = match (role, sink) {
            (Role::Send(source, selection), _) => driver.send(&source, selection, None),
            (_, Some(sink)) => driver.receive(sink),
            _ => Err(Error::Internal("a session with no role".into())),
        };
        let _ = stream.shutdown(std::net::Shutdown::Both);
        if let Err(e) = &outcome {
            let bytes = progress.bytes.load(Ordering::Relaxed);
            tracing::warn!(
                "session with {} ended: {e} ({bytes} bytes {direction} first; partial files kept to resume)",
                self.peer
            );
        }
        outcome.map(drop)
    }

    /// An error as the client sees it: paths relative to the export, never the
    /// server's own.
    fn relative(&self, e: &Error) -> String {
        crate::ops::server::relative(&self.shared.exports, e)
    }

    /// For a fabric session, this session's own listener (on the address the client
    /// reached) and the endpoint message that tells the client where it is.
    fn fabric_listener(
        &self,
        req: &OpenSession,
        control: &Stream,
    ) -> Result<Option<(wanxfer_fabric::Listener, FabricEndpoint)>, Error> {
        match req.transport {
            TransportKind::Tcp => return Ok(None),
            TransportKind::Fabric => {}
            _ => return Err(Error::Usage("unknown transport".into())),
        }
        if control.is_encrypted() {
            // RDMA writes land in our memory without passing through TLS; a fabric
            // session runs only as an explicit unencrypted one, its blocks MAC'd.
            return Err(Error::Usage(
                "the fabric transport cannot be encrypted: the client must ask for \
                 --no-encryption (and this server allow it with --allow-unencrypted)"
                    .into(),
            ));
        }
        let Some(provider) = &self.shared.limits.fabric_provider else {
            return Err(Error::Usage(
                "this server offers only the tcp transport (start it with --transport fabric)"
                    .into(),
            ));
        };
        let ip = control
            .local_addr()
            .map_err(|e| Error::network("reading the local address for", &self.peer, e))?
            .ip();
        let (listener, names) = fabric::listen(provider, ip)?;
        let endpoint = FabricEndpoint {
            port: listener.local_addr().port(),
            provider: names.provider.into_bytes(),
            fabric: names.fabric.into_bytes(),
            domain: names.domain.into_bytes(),
        };
        Ok(Some((listener, endpoint)))
    }

    /// The session's role, for a push where its sources land, and the export it works
    /// in (none for memory to memory). Authorization happens here, before anything on
    /// disk is opened, created or journaled.
    fn prepare(
        &self,
        identity: &Identity,
        req: &OpenSession,
    ) -> Result<(Role, wanxfer_proto::Placement, Option<&Export>), Error> {
        let exports = &self.shared.exports;
        match req.direction {
            Direction::Push => {
                let [dest] = req.paths.as_slice() else {
                    return Err(Error::Usage("a push names exactly one destination".into()));
                };
                if !req.selection.is_empty() {
                    // The pushing client lists its own tree and applies its selection.
                    return Err(Error::Usage("a push carries no selection".into()));
                }
                let discard =
                    req.flags & session_flags::DISCARD != 0 || dest.as_bytes() == DISCARD_PATH;
                if discard {
                    return Ok((Role::Receive(None), wanxfer_proto::Placement::Into, None));
                }
                let (export, dest) = exports.resolve(dest)?;
                let root = &export.root;
                if dest
                    .split_first()
                    .is_some_and(|(first, _)| first == crate::sink::RESERVED_NAME)
                {
                    return Err(Error::Refused {
                        path: dest.to_string(),
                        reason: "the name is reserved".into(),
                    });
                }
                // Writing where something exists may replace it: more than creating. A
                // path that cannot be looked at asks for the most; placing says why.
                let access = match root.meta(&dest) {
                    Ok(None) => Access::Create,
                    _ => Access::Modify,
                };
                authorize(identity, export, &dest, access)?;
                let (placement, wire) =
                    Placement::decide(root, &dest, req.source_count, req.placement)?;
                Ok((
                    Role::Receive(Some((root.try_clone()?, placement))),
                    wire,
                    Some(export),
                ))
            }
            Direction::Pull => {
                let synthetic = req.flags & session_flags::SYNTHETIC_SOURCE != 0;
                if synthetic && req.paths.iter().all(|p| p.as_bytes() == SYNTHETIC_PATH) {
                    return Ok((
                        Role::Send(
                            Source::Synthetic {
                                bytes: req.synthetic_bytes,
                            },
                            Arc::default(),
                        ),
                        wanxfer_proto::Placement::Resolve,
                        None,
                    ));
                }
                if req.paths.is_empty() {
                    return Err(Error::Usage("a pull names at least one source".into()));
                }
                let mut export = None;
                let mut paths = Vec::with_capacity(req.paths.len());
                for path in &req.paths {
                    let (named, inside) = exports.resolve(path)?;
                    if export.is_some_and(|e: &Export| !std::ptr::eq(e, named)) {
                        return Err(Error::Refused {
                            path: path.to_string(),
                            reason: "the sources of one pull come from one export".into(),
                        });
                    }
                    if inside
                        .split_first()
                        .is_some_and(|(first, _)| first == crate::sink::RESERVED_NAME)
                    {
                        return Err(Error::Refused {
                            path: String::from_utf8_lossy(crate::sink::RESERVED_NAME).into_owned(),
                            reason: "the name is reserved".into(),
                        });
                    }
                    authorize(identity, named, &inside, Access::Read)?;
                    export = Some(named);
                    paths.push(inside);
                }
                let export = export.expect("at least one path");
                let selection = Arc::new(Matcher::new(&req.selection)?);
                Ok((
                    Role::Send(Source::beneath(&export.root, &paths)?, selection),
                    wanxfer_proto::Placement::Resolve,
                    Some(export),
                ))
            }
            _ => Err(Error::Usage("unknown direction".into())),
        }
    }
}

/// The first byte the client sends, within `deadline`, left in the socket.
fn peek_first(tcp: &TcpStream, deadline: Deadline, peer: &str) -> Result<u8, Error> {
    let mut byte = [0u8; 1];
    loop {
        let left = deadline.left().map_err(|()| {
            Error::network(
                "timed out waiting for",
                peer,
                std::io::Error::new(std::io::ErrorKind::TimedOut, "no first byte in time"),
            )
        })?;
        tcp.set_read_timeout(left)
            .map_err(|e| Error::network("reading from", peer, e))?;
        match tcp.peek(&mut byte) {
            Ok(0) => {
                return Err(Error::network(
                    "connection closed by",
                    peer,
                    std::io::ErrorKind::UnexpectedEof.into(),
                ))
            }
            Ok(_) => return Ok(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Error::network("timed out waiting for", peer, e))
            }
            Err(e) => return Err(Error::network("receiving from", peer, e)),
        }
    }
}

/// Ends a refused connection so that the client gets to read why. Closing a socket
/// with input still unread (the request a client sends with its proof, the `Hello` it
/// sends with its preamble) makes the kernel reset the connection, and a reset can
/// overtake the refusal: the client then saw "connection reset" (a network error, which it
/// retries) instead of, say, its address being turned away for failing too often. So our
/// end is closed first and what the client still sends is read and dropped, for a moment
/// and a few kilobytes at most, until it hangs up.
fn close_after_refusal(stream: &mut Stream) {
    use std::io::Read;
    // Under TLS the refusal is followed by close_notify, so the client reads it as the
    // end and not as a connection cut short; what it still sends is dropped unread.
    let _ = stream.finish_writes();
    let mut tcp = stream.tcp();
    let until = Instant::now() + Duration::from_secs(1);
    let mut scratch = [0u8; 4096];
    let mut budget = 64usize << 10;
    while budget > 0 {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || tcp.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match tcp.read(&mut scratch) {
            Ok(0) | Err(_) => break,
            Ok(n) => budget = budget.saturating_sub(n),
        }
    }
}

/// Removes a session from the registry however it ends.
struct Registered<'a>(&'a Registry, [u8; 16]);

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.0
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

enum Role {
    /// What to send, and which entries beneath it the client selected.
    Send(Source, Arc<Matcher>),
    /// Where pushed files land; `None` discards (memory to memory).
    Receive(Option<(Root, Placement)>),
}

/// How `info`'s session ended, from its counters, `error` as the client was told it.
fn session_end(info: &SessionInfo, error: Option<(ErrorClass, String)>) -> SessionEnd {
    let load = |f: fn(&Progress) -> &AtomicU64| {
        info.progress
            .as_deref()
            .map_or(0, |p| f(p).load(Ordering::Relaxed))
    };
    SessionEnd {
        ended: std::time::SystemTime::now(),
        files: load(|p| &p.files),
        failed_files: load(|p| &p.failed_files),
        bytes: load(|p| &p.bytes),
        error,
    }
}
