//! `serve --metrics-listen`: the server's state as Prometheus series, for Grafana.
//!
//! The engine reports sessions through its `Observer` seam and counts bytes with atomics
//! in each session's `Progress`; this module turns both into series named after
//! Prometheus's conventions (`wanxfer_` prefix, `_total` counters, units last) with the
//! `prometheus-client` crate, and serves them in the OpenMetrics text format.
//!
//! Counters are brought up to date from the live sessions' counters at every scrape and
//! once a second; throughput gauges are the bytes of the last second. Label cardinality
//! is bounded: the per-session and per-channel series carry a session number and are
//! removed when the session ends, so at most `--max-sessions` × (1 + channels counted)
//! exist; every other label takes a handful of fixed values.
//!
//! The HTTP side is a loop over `std`'s listener on its own thread rather than an HTTP
//! crate: it answers one short request at a time with a deadline for each, so a slow or
//! hostile scraper holds at most one connection for a few seconds and no thread or queue
//! grows with connections (`tiny_http`, the small crate that fits, starts a thread per
//! concurrent connection with no bound).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use wanxfer_engine::progress::{process_cpu, Progress};
use wanxfer_engine::session::observe::{Observer, SessionEnd, SessionInfo, SessionKind};
use wanxfer_engine::{Error, ErrorClass};

/// How long one scrape may take to send its request and read the answer.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(5);
/// The largest request head read; a scrape's is a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;
/// How often throughput gauges are recomputed.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    /// `in`: pushed to this server; `out`: pulled from it.
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SessionLabels {
    session: String,
    kind: &'static str,
    peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChannelLabels {
    session: String,
    channel: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    session: String,
    pool: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The series, and the sessions whose counters feed them.
pub struct Metrics {
    registry: Registry,
    sessions_active: Family<KindLabels, Gauge>,
    sessions: Family<EndLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    files: Family<DirectionLabels, Counter>,
    errors: Family<ClassLabels, Counter>,
    session_rate: Family<SessionLabels, FloatGauge>,
    channel_rate: Family<ChannelLabels, FloatGauge>,
    pool_in_use: Family<PoolLabels, Gauge>,
    pool_size: Family<PoolLabels, Gauge>,
    fabric_credits: Family<SessionLabels, Gauge>,
    cpu: Counter<f64, AtomicU64>,
    partial_files: Gauge,
    live: Mutex<HashMap<u64, Live>>,
}

/// A running session's counters and what of them the series already hold.
struct Live {
    labels: SessionLabels,
    direction: &'static str,
    progress: Option<Arc<Progress>>,
    counted_bytes: u64,
    counted_files: u64,
    sampled_at: Instant,
    sampled_bytes: u64,
    sampled_channels: HashMap<u16, u64>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("wanxfer");
        let m = Metrics {
            sessions_active: Family::default(),
            sessions: Family::default(),
            bytes: Family::default(),
            files: Family::default(),
            errors: Family::default(),
            session_rate: Family::default(),
            channel_rate: Family::default(),
            pool_in_use: Family::default(),
            pool_size: Family::default(),
            fabric_credits: Family::default(),
            cpu: Counter::default(),
            partial_files: Gauge::default(),
            live: Mutex::default(),
            registry: Registry::default(),
        };
        registry.register(
            "sessions_active",
            "Sessions running now, by kind (push, pull, op)",
            m.sessions_active.clone(),
        );
        registry.register(
            "sessions",
            "Sessions ended, by kind and result (ok, failed)",
            m.sessions.clone(),
        );
        registry.register_with_unit(
            "transferred",
            "Payload bytes moved over data channels: in (pushed here) or out (pulled)",
            Unit::Bytes,
            m.bytes.clone(),
        );
        registry.register(
            "files",
            "Files put in place here (in) or sent and acknowledged (out)",
            m.files.clone(),
        );
        registry.register(
            "errors",
            "Connections and sessions that ended with an error, by class",
            m.errors.clone(),
        );
        registry.register_with_unit(
            "session_throughput",
            "Payload bytes per second of a running session over the last second",
            Unit::Other("bytes_per_second".into()),
            m.session_rate.clone(),
        );
        registry.register_with_unit(
            "channel_throughput",
            "Payload bytes per second of a running session's data channel over the last second",
            Unit::Other("bytes_per_second".into()),
            m.channel_rate.clone(),
        );
        registry.register(
            "pool_buffers_in_use",
            "Block buffers (or fabric slots) of a running session on loan: being read, \
             sent, received or written, or (fabric) granted to the sender",
            m.pool_in_use.clone(),
        );
        registry.register(
            "pool_buffers",
            "Block buffers (or fabric slots) a running session has in all",
            m.pool_size.clone(),
        );
        registry.register(
            "fabric_credits",
            "Fabric receive slots granted to the sender and not yet written (its credits)",
            m.fabric_credits.clone(),
        );
        registry.register_with_unit(
            "process_cpu",
            "User and system CPU time of the server process",
            Unit::Seconds,
            m.cpu.clone(),
        );
        registry.register(
            "partial_files_kept",
            "Partial files of interrupted transfers kept for them to resume, as the last \
             sweep of the state directory found them",
            m.partial_files.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Brings counters and gauges up to date with the live sessions; with `sample`, also
    /// the throughput gauges (bytes since the last sample over the time since).
    fn sync(&self, sample: bool) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        for session in live.values_mut() {
            self.sync_session(session, sample);
        }
        drop(live);
        let cpu = process_cpu().seconds();
        let counted = self.cpu.get();
        if cpu > counted {
            self.cpu.inc_by(cpu - counted);
        }
    }

    fn sync_session(&self, s: &mut Live, sample: bool) {
        let Some(progress) = &s.progress else { return };
        let labels = DirectionLabels {
            direction: s.direction,
        };
        let bytes = progress.bytes.load(Ordering::Relaxed);
        let files = progress.files.load(Ordering::Relaxed);
        // A client's new attempt is a new session here, so these only grow.
        self.bytes
            .get_or_create(&labels)
            .inc_by(bytes.saturating_sub(s.counted_bytes));
        self.files
            .get_or_create(&labels)
            .inc_by(files.saturating_sub(s.counted_files));
        s.counted_bytes = s.counted_bytes.max(bytes);
        s.counted_files = s.counted_files.max(files);
        let number = s.labels.session.clone();
        for (kind, in_use, size) in progress.pool_occupancy() {
            let pool = PoolLabels {
                session: number.clone(),
                pool: kind.name(),
            };
            self.pool_in_use.get_or_create(&pool).set(in_use as i64);
            self.pool_size.get_or_create(&pool).set(size as i64);
        }
        let credits = progress.fabric_credits.load(Ordering::Relaxed);
        if credits > 0 {
            self.fabric_credits
                .get_or_create(&s.labels)
                .set(credits as i64);
        }
        if !sample {
            return;
        }
        let seconds = s.sampled_at.elapsed().as_secs_f64().max(1e-3);
        s.sampled_at = Instant::now();
        let rate = |now: u64, before: u64| now.saturating_sub(before) as f64 / seconds;
        self.session_rate
            .get_or_create(&s.labels)
            .set(rate(bytes, s.sampled_bytes));
        s.sampled_bytes = bytes;
        for (index, bytes) in progress.channel_bytes() {
            let before = s.sampled_channels.insert(index, bytes).unwrap_or(0);
            let channel = ChannelLabels {
                session: number.clone(),
                channel: index.to_string(),
            };
            self.channel_rate
                .get_or_create(&channel)
                .set(rate(bytes, before));
        }
    }

    /// Removes a session's own series.
    fn forget(&self, s: &Live) {
        self.session_rate.remove(&s.labels);
        self.fabric_credits.remove(&s.labels);
        for &index in s.sampled_channels.keys() {
            self.channel_rate.remove(&ChannelLabels {
                session: s.labels.session.clone(),
                channel: index.to_string(),
            });
        }
        for pool in ["blocks", "fabric_slots"] {
            let labels = PoolLabels {
                session: s.labels.session.clone(),
                pool,
            };
            self.pool_in_use.remove(&labels);
            self.pool_size.remove(&labels);
        }
    }

    /// The exposition, up to date.
    pub fn render(&self) -> String {
        self.sync(false);
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    /// Binds `addr` now (so that a taken port fails the start) and serves scrapes and
    /// samples throughput on threads of their own for the life of the process.
    pub fn serve(self: &Arc<Self>, addr: &str) -> Result<std::net::SocketAddr, Error> {
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::network("listening on", addr, e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::network("listening on", addr, e))?;
        let sampler = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("wanxfer-sample".into())
            .spawn(move || loop {
                std::thread::sleep(SAMPLE_EVERY);
                match sampler.upgrade() {
                    Some(metrics) => metrics.sync(true),
                    None => return,
                }
            })
            .map_err(|e| Error::Internal(format!("starting the metrics sampler: {e}")))?;
        let metrics = self.clone();
        std::thread::Builder::new()
            .name("wanxfer-metrics".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    match stream {
                        Ok(stream) => {
                            if let Err(e) = metrics.answer(stream) {
                                tracing::debug!("metrics scrape: {e}");
                            }
                        }
                        Err(e) => {
                            // Out of descriptors, say: wait rather than spin.
                            tracing::warn!("metrics listener: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            })
            .map_err(|e| Error::Internal(format!("starting the metrics listener: {e}")))?;
        Ok(local)
    }

    /// Reads one request head and answers it; the connection is closed after.
    fn answer(&self, mut stream: TcpStream) -> std::io::Result<()> {
        let deadline = Instant::now() + SCRAPE_DEADLINE;
        let mut head = Vec::with_capacity(1024);
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || head.len() >= MAX_REQUEST {
                return respond(&mut stream, "408 Request Timeout", "text/plain", "");
            }
            stream.set_read_timeout(Some(left))?;
            let n = stream.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            head.extend_from_slice(&buf[..n]);
        }
        stream.set_write_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100)),
        ))?;
        let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
        let mut words = line.split(|&b| b == b' ');
        let (method, target) = (words.next(), words.next());
        match (method, target.map(|t| t.split(|&b| b == b'?').next())) {
            (Some(b"GET"), Some(Some(b"/metrics"))) => respond(
                &mut stream,
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                &self.render(),
            ),
            (Some(b"GET"), _) => respond(
                &mut stream,
                "404 Not Found",
                "text/plain",
                "wanxfer serves its metrics at /metrics\n",
            ),
            _ => respond(&mut stream, "405 Method Not Allowed", "text/plain", ""),
        }
    }
}

fn respond(stream: &mut TcpStream, status: &str, kind: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

fn direction(kind: SessionKind) -> &'static str {
    match kind {
        SessionKind::Push => "in",
        _ => "out",
    }
}

impl Observer for Metrics {
    fn session_started(&self, session: &SessionInfo) {
        let kind = session.kind.name();
        self.sessions_active
            .get_or_create(&KindLabels { kind })
            .inc();
        let bytes = session
            .progress
            .as_ref()
            .map_or(0, |p| p.bytes.load(Ordering::Relaxed));
        let live = Live {
            labels: SessionLabels {
                session: session.number.to_string(),
                kind,
                peer: session.peer.clone(),
            },
            direction: direction(session.kind),
            progress: session.progress.clone(),
            counted_bytes: 0,
            counted_files: 0,
            sampled_at: Instant::now(),
            sampled_bytes: bytes,
            sampled_channels: HashMap::new(),
        };
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(session.number, live);
    }

    fn session_ended(&self, session: &SessionInfo, end: &SessionEnd) {
        let kind = session.kind.name();
        let started = self
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&session.number);
        if let Some(mut live) = started {
            self.sync_session(&mut live, false);
            self.forget(&live);
            self.sessions_active
                .get_or_create(&KindLabels { kind })
                .dec();
        }
        let result = if end.error.is_none() { "ok" } else { "failed" };
        self.sessions
            .get_or_create(&EndLabels { kind, result })
            .inc();
    }

    fn connection_failed(&self, class: ErrorClass) {
        self.errors
            .get_or_create(&ClassLabels {
                class: crate::output::class_name(class),
            })
            .inc();
    }

    fn partial_files_kept(&self, files: u64) {
        self.partial_files.set(files as i64);
    }
}
