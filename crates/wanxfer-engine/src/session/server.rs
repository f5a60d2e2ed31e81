//! The server: one root, many sessions, each on threads of its own.
//!
//! Nothing touches the file system before a client has proved it knows the secret. Every
//! connection first sends a preamble; control connections then authenticate and ask,
//! data connections name a session and prove they belong to it. Pending connections,
//! sessions and per-session resources are bounded by [`ServerLimits`]; a failing or
//! panicking session ends alone, the listener goes on.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use wanxfer_proto::handshake::{Authenticated, ServerHandshake, Step};
use wanxfer_proto::{
    features, session_flags, ConnectionKind, Direction, ErrorMsg, FabricEndpoint, FailureClass,
    Message, OpenSession, SessionAccepted, Stats, TransportKind, MAX_BLOCK_PAYLOAD,
};

use super::control::{
    peer_on_this_host, read_message, read_preamble, spawn_reader, tune_socket, Control,
};
use super::driver::{run_receiver, run_sender, Core};
use super::{random, Params, DISCARD_PATH, SYNTHETIC_PATH};
use crate::fs::Root;
use crate::pool::Cancel;
use crate::progress::{CpuMeter, Progress};
use crate::sink::{Placement, Sink, SinkLimits};
use crate::source::Source;
use crate::transport::fabric::{self, SlotPlan};
use crate::Error;

/// The server's own bounds; a client's request is clamped to them.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    pub max_streams: u16,
    pub max_block_size: u32,
    pub max_depth: u16,
    pub max_window: u32,
    /// Concurrent sessions.
    pub max_sessions: usize,
    /// Connections that have not finished their handshake yet.
    pub max_pending: usize,
    pub readers: usize,
    pub writers: usize,
    pub max_open_files: usize,
    /// Time a connection may take to authenticate, and a session to open its channels.
    pub handshake_timeout: Duration,
    /// Bytes one session's block pool may use.
    pub max_pool_bytes: usize,
    /// How pulls send file bytes.
    pub io: crate::source::IoMode,
    /// How pushed files are written.
    pub write: crate::fs::WriteMode,
    /// The libfabric provider offered to clients asking for the fabric transport; `None`
    /// offers TCP only.
    pub fabric_provider: Option<String>,
    /// How long a silent peer is waited for before its session fails.
    pub stall_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_streams: 32,
            max_block_size: 16 << 20,
            max_depth: 32,
            max_window: 65_536,
            max_sessions: 16,
            max_pending: 64,
            readers: 2,
            writers: 2,
            max_open_files: 512,
            handshake_timeout: Duration::from_secs(30),
            max_pool_bytes: 512 << 20,
            io: crate::source::IoMode::Auto,
            write: crate::fs::WriteMode::Auto,
            fabric_provider: None,
            stall_timeout: super::DEFAULT_STALL_TIMEOUT,
        }
    }
}

type Joins = Sender<(u16, TcpStream)>;

#[derive(Default)]
struct Registry {
    sessions: Mutex<HashMap<[u8; 16], (Authenticated, u16, Joins)>>,
}

/// A listening server.
pub struct Server {
    listener: TcpListener,
    root: Arc<Root>,
    secret: Arc<Vec<u8>>,
    limits: ServerLimits,
    registry: Arc<Registry>,
    pending: Arc<AtomicUsize>,
    sessions: Arc<AtomicUsize>,
}

impl Server {
    pub fn bind(
        addr: &str,
        root: &Path,
        secret: Vec<u8>,
        limits: ServerLimits,
    ) -> Result<Server, Error> {
        let root = Root::open(root)?;
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::network("listening on", addr, e))?;
        Ok(Server {
            listener,
            root: Arc::new(root),
            secret: Arc::new(secret),
            limits,
            registry: Arc::default(),
            pending: Arc::default(),
            sessions: Arc::default(),
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        self.listener
            .local_addr()
            .map_err(|e| Error::network("listening on", "local socket", e))
    }

    /// Accepts connections until `stop` is set (checked between connections).
    pub fn serve(&self, stop: &Cancel) -> Result<(), Error> {
        for conn in self.listener.incoming() {
            if stop.is_cancelled() {
                break;
            }
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            self.admit(stream);
        }
        Ok(())
    }

    fn admit(&self, stream: TcpStream) {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown peer".into());
        if self.pending.fetch_add(1, Ordering::SeqCst) >= self.limits.max_pending {
            self.pending.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("refusing {peer}: too many connections still authenticating");
            return;
        }
        let conn = Connection {
            root: self.root.clone(),
            secret: self.secret.clone(),
            limits: self.limits.clone(),
            registry: self.registry.clone(),
            pending: PendingGuard(Some(self.pending.clone())),
            sessions: self.sessions.clone(),
            peer: peer.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("wanxfer-conn".into())
            .spawn(move || conn.run(stream));
        if let Err(e) = spawned {
            tracing::error!("cannot start a thread for {peer}: {e}");
        }
    }
}

/// Counts a connection as pending until it authenticates or ends.
struct PendingGuard(Option<Arc<AtomicUsize>>);

impl PendingGuard {
    fn release(&mut self) {
        if let Some(p) = self.0.take() {
            p.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.release();
    }
}

struct Connection {
    root: Arc<Root>,
    secret: Arc<Vec<u8>>,
    limits: ServerLimits,
    registry: Arc<Registry>,
    pending: PendingGuard,
    sessions: Arc<AtomicUsize>,
    peer: String,
}

impl Connection {
    fn run(mut self, mut stream: TcpStream) {
        tune_socket(&stream, self.limits.stall_timeout);
        let _ = stream.set_read_timeout(Some(self.limits.handshake_timeout));
        let result = match read_preamble(&mut stream, &self.peer) {
            Ok(ConnectionKind::Control) => self.control(stream),
            Ok(ConnectionKind::Data) => self.join_channel(stream),
            Ok(_) => Err(Error::protocol(&self.peer, "unknown connection kind")),
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => {}
            Err(e) => tracing::warn!("session with {}: {e}", self.peer),
        }
    }

    fn join_channel(&mut self, mut stream: TcpStream) -> Result<(), Error> {
        let mut reply = Control::new(&stream, self.peer.clone())?;
        let Message::ChannelJoin(join) = read_message(&mut stream, &self.peer)? else {
            return Err(Error::protocol(
                &self.peer,
                "a data channel must start by joining",
            ));
        };
        let sessions = self.registry.sessions.lock().expect("no panics while held");
        let found = sessions.get(&join.session_id).filter(|(auth, streams, _)| {
            join.index < *streams && auth.verify_channel(&join.session_id, join.index, &join.proof)
        });
        let Some((_, _, joins)) = found else {
            drop(sessions);
            let refusal = ErrorMsg::new(FailureClass::Auth, "unknown session or bad channel proof");
            let _ = reply.send(&Message::Error(refusal));
            return Err(Error::Auth {
                peer: self.peer.clone(),
                detail: "data channel with an unknown session or a bad proof".into(),
            });
        };
        let joins = joins.clone();
        drop(sessions);
        reply.send(&Message::ChannelAccepted { index: join.index })?;
        self.pending.release();
        let _ = stream.set_read_timeout(None);
        joins
            .send((join.index, stream))
            .map_err(|_| Error::protocol(&self.peer, "channel for a session that has ended"))
    }

    fn control(&mut self, mut stream: TcpStream) -> Result<(), Error> {
        let mut control = Control::new(&stream, self.peer.clone())?;
        let auth = self.authenticate(&mut stream, &mut control)?;
        self.pending.release();
        if self.sessions.fetch_add(1, Ordering::SeqCst) >= self.limits.max_sessions {
            self.sessions.fetch_sub(1, Ordering::SeqCst);
            let busy = ErrorMsg::new(
                FailureClass::Limit,
                "server busy: too many sessions, retry later",
            );
            let _ = control.send(&Message::Error(busy));
            return Err(Error::Limit("too many sessions".into()));
        }
        let result = self.session(stream, control, auth);
        self.sessions.fetch_sub(1, Ordering::SeqCst);
        result
    }

    fn authenticate(
        &self,
        stream: &mut TcpStream,
        control: &mut Control,
    ) -> Result<Authenticated, Error> {
        let mut handshake = ServerHandshake::new(&self.secret, random()?, features::SUPPORTED);
        loop {
            let msg = read_message(stream, &self.peer)?;
            match handshake.handle(msg) {
                Ok(Step::Send(reply)) => control.send(&reply)?,
                Ok(Step::SendAndDone(reply, auth)) => {
                    control.send(&reply)?;
                    return Ok(auth);
                }
                Ok(Step::Done(auth)) => return Ok(auth),
                Err(e) => {
                    let _ = control.send(&ServerHandshake::auth_failed());
                    return Err(Error::handshake(&self.peer, e));
                }
            }
        }
    }

    fn session(
        &self,
        mut stream: TcpStream,
        mut control: Control,
        auth: Authenticated,
    ) -> Result<(), Error> {
        let request = match read_message(&mut stream, &self.peer)? {
            Message::OpenSession(o) => o,
            // Remote operations instead of a session: this connection carries only them.
            Message::OpRequest(first) => {
                let idle = self.limits.stall_timeout;
                return crate::ops::server::serve(&self.root, stream, control, first, idle);
            }
            other => {
                return Err(Error::protocol(
                    &self.peer,
                    format!("expected a request, got {other:?}"),
                ))
            }
        };
        let session_id: [u8; 16] = random()?;
        let (accepted, mut params) = self.clamp(&request, &session_id);
        params.resolve_io(peer_on_this_host(&stream));
        let prepared = self.prepare_role(&request, &params).and_then(|role| {
            let listener = self.fabric_listener(&request, &stream)?;
            Ok((role, listener))
        });
        let (role, mut fabric) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => {
                let _ = control.send(&Message::Error(ErrorMsg::new(
                    e.wire_class(),
                    &e.to_string(),
                )));
                return Err(e);
            }
        };
        if fabric.is_some() {
            // RDMA writes go from pool buffers: file bytes must be read into them.
            params.io = crate::source::IoMode::Copy;
        }
        let (joins_tx, joins_rx) = crossbeam_channel::bounded(usize::from(params.streams));
        self.registry
            .sessions
            .lock()
            .expect("no panics while held")
            .insert(session_id, (auth, params.streams, joins_tx));
        let channels = control
            .send(&Message::SessionAccepted(accepted))
            .and_then(|()| match &fabric {
                Some((_, endpoint)) => control.send(&Message::FabricEndpoint(endpoint.clone())),
                None => Ok(()),
            })
            .and_then(|()| self.collect_channels(&joins_rx, params.streams));
        let auth = self
            .registry
            .sessions
            .lock()
            .expect("no panics while held")
            .remove(&session_id)
            .map(|(auth, _, _)| auth);
        let channels = channels?;
        let fabric_channels = match (&mut fabric, auth) {
            (Some((listener, _)), Some(auth)) => fabric::accept_channels(
                listener,
                SlotPlan::new(params.block_size, params.depth),
                &auth,
                &session_id,
                params.streams,
                &self.peer,
            )?,
            _ => Vec::new(),
        };
        drop(fabric);
        let _ = stream.set_read_timeout(None);
        let (incoming, reader) = spawn_reader(&stream, self.peer.clone())?;
        let meter = Arc::new(CpuMeter::default());
        let progress = Arc::new(Progress::default());
        let mut core = Core::new(
            control,
            incoming,
            channels,
            params,
            progress.clone(),
            meter.clone(),
        );
        core.fabric = fabric_channels;
        let started = std::time::Instant::now();
        let (verb, outcome) = match role {
            Role::Send(source) => ("sent", run_sender(&mut core, &source)),
            Role::Receive(sink) => ("received", run_receiver(&mut core, sink)),
        };
        let result = outcome.and_then(|outcome| {
            await_finish(&mut core)?;
            meter.add_this_thread();
            let cpu = meter.total();
            let stats = Stats {
                cpu_user_us: cpu.user_us,
                cpu_sys_us: cpu.sys_us,
                bytes: progress.bytes.load(Ordering::Relaxed),
                files: outcome.files_ok,
                io_mode: outcome.io.mode.clone().into_bytes(),
                direct_bytes: outcome.io.direct_bytes,
                io_fallback: outcome.io.fallback.clone().unwrap_or_default().into_bytes(),
            };
            let secs = started.elapsed().as_secs_f64().max(1e-9);
            tracing::info!(
                "session with {}: {verb} {} bytes in {} files ({} failed) in {secs:.2} s, {:.2} Gbit/s, CPU {:.2} s",
                self.peer,
                stats.bytes,
                stats.files,
                outcome.failures.len(),
                stats.bytes as f64 * 8.0 / secs / 1e9,
                cpu.seconds(),
            );
            core.control.send(&Message::Stats(stats))
        });
        let _ = stream.shutdown(std::net::Shutdown::Both);
        let _ = reader.join();
        result
    }

    /// The agreed parameters: the client's wishes within our limits, with the pool's
    /// depth lowered until it fits this server's memory bound.
    fn clamp(&self, req: &OpenSession, session_id: &[u8; 16]) -> (SessionAccepted, Params) {
        let l = &self.limits;
        let mut accepted = SessionAccepted {
            session_id: *session_id,
            streams: req.streams.clamp(1, l.max_streams),
            block_size: req
                .block_size
                .clamp(64 << 10, l.max_block_size.min(MAX_BLOCK_PAYLOAD)),
            depth: req.depth.clamp(1, l.max_depth),
            window: req.window.clamp(1, l.max_window),
            flags: req.flags,
        };
        let mut params = Params::from_accepted(&accepted, l.readers, l.writers, l.io);
        while params.depth > 1
            && params.pool_blocks() * params.block_size as usize > l.max_pool_bytes
        {
            params.depth -= 1;
        }
        accepted.depth = params.depth;
        (accepted, params)
    }

    /// For a fabric session, this session's own listener (on the address the client
    /// reached) and the endpoint message that tells the client where it is.
    fn fabric_listener(
        &self,
        req: &OpenSession,
        control: &TcpStream,
    ) -> Result<Option<(wanxfer_fabric::Listener, FabricEndpoint)>, Error> {
        match req.transport {
            TransportKind::Tcp => return Ok(None),
            TransportKind::Fabric => {}
            _ => return Err(Error::Usage("unknown transport".into())),
        }
        let Some(provider) = &self.limits.fabric_provider else {
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

    fn prepare_role(&self, req: &OpenSession, params: &Params) -> Result<Role, Error> {
        match req.direction {
            Direction::Push => {
                let [dest] = req.paths.as_slice() else {
                    return Err(Error::Usage("a push names exactly one destination".into()));
                };
                let discard =
                    req.flags & session_flags::DISCARD != 0 || dest.as_bytes() == DISCARD_PATH;
                let target = if discard {
                    None
                } else {
                    let placement = Placement::resolve(&self.root, dest, req.source_count)?;
                    Some((self.root.try_clone()?, placement))
                };
                let limits = SinkLimits {
                    max_open_files: self.limits.max_open_files,
                    write: self.limits.write,
                };
                let sink = Sink::new(
                    target,
                    self.peer.clone(),
                    params.session_tag,
                    params.check_flags(),
                    limits,
                );
                Ok(Role::Receive(Arc::new(sink)))
            }
            Direction::Pull => {
                let synthetic = req.flags & session_flags::SYNTHETIC_SOURCE != 0;
                if synthetic && req.paths.iter().all(|p| p.as_bytes() == SYNTHETIC_PATH) {
                    return Ok(Role::Send(Source::Synthetic {
                        bytes: req.synthetic_bytes,
                    }));
                }
                if req.paths.is_empty() {
                    return Err(Error::Usage("a pull names at least one source".into()));
                }
                Ok(Role::Send(Source::beneath(&self.root, &req.paths)?))
            }
            _ => Err(Error::Usage("unknown direction".into())),
        }
    }

    fn collect_channels(
        &self,
        joins: &Receiver<(u16, TcpStream)>,
        streams: u16,
    ) -> Result<Vec<TcpStream>, Error> {
        let mut slots: Vec<Option<TcpStream>> = (0..streams).map(|_| None).collect();
        let deadline = std::time::Instant::now() + self.limits.handshake_timeout;
        while slots.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let (index, stream) = joins.recv_timeout(left).map_err(|_| {
                Error::network(
                    "waiting for data channels from",
                    &self.peer,
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "not all channels arrived"),
                )
            })?;
            let slot = &mut slots[usize::from(index)];
            if slot.is_some() {
                return Err(Error::protocol(&self.peer, "the same channel joined twice"));
            }
            *slot = Some(stream);
        }
        Ok(slots
            .into_iter()
            .map(|s| s.expect("all slots filled"))
            .collect())
    }
}

enum Role {
    Send(Source),
    Receive(Arc<Sink>),
}

fn await_finish(core: &mut Core) -> Result<(), Error> {
    loop {
        match core.incoming.recv().map_err(|_| Error::Cancelled)?? {
            Message::Finish => return Ok(()),
            Message::FileAck { .. } | Message::ManifestAck { .. } => {}
            Message::Error(e) => return Err(Error::remote(&core.control.peer, &e)),
            other => {
                return Err(Error::protocol(
                    &core.control.peer,
                    format!("expected the end of the session, got {other:?}"),
                ))
            }
        }
    }
}
