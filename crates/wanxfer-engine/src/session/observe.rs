//! What a server tells whoever watches it: a metrics exporter, a transfer log.
//!
//! The engine knows when a session starts and ends and what it moved; what an operator
//! wants made of that (Prometheus series, JSON lines) is the binary's business. This
//! trait is the one seam between them, so the engine names no metrics crate and no file
//! format, and the accounting points in `server.rs` stay a handful of calls. Watchers are
//! called on the session's own thread and must not block it for long.
//!
//! Not reported here: per-block events (watchers poll the session's [`Progress`] instead,
//! which the data path updates with atomics only).

use std::sync::Arc;
use std::time::SystemTime;

use crate::progress::Progress;
use crate::ErrorClass;

/// A server's watcher. Every method has an empty default.
pub trait Observer: Send + Sync {
    /// A session was accepted and is about to move data.
    fn session_started(&self, _session: &SessionInfo) {}
    /// A session ended, well or not; also for one refused before it started.
    fn session_ended(&self, _session: &SessionInfo, _end: &SessionEnd) {}
    /// A connection ended with an error (a session's, a handshake's, a refusal's).
    fn connection_failed(&self, _class: ErrorClass) {}
    /// The number of partial files kept for interrupted transfers to resume, as the last
    /// sweep of the state directory found them.
    fn partial_files_kept(&self, _files: u64) {}
}

/// What a session is, as known once it was accepted (before that: the request's part).
#[derive(Debug, Clone)]
pub struct SessionInfo {
    /// Numbers this server's sessions in order; unique while the process runs.
    pub number: u64,
    pub peer: String,
    /// Who the handshake authenticated: today `secret` (the shared secret); token and
    /// certificate identities will name their holder here.
    pub identity: String,
    pub kind: SessionKind,
    /// Paths as the client named them, relative to the served directory.
    pub paths: Vec<String>,
    /// Data channels agreed.
    pub streams: u16,
    /// `tcp` or `fabric`.
    pub transport: &'static str,
    /// `tls`, `ktls` (the kernel's TLS on the data channels), or `none` (MACs only).
    pub encryption: &'static str,
    pub started: SystemTime,
    /// The session's live counters; `None` until it is accepted.
    pub progress: Option<Arc<Progress>>,
}

/// What kind of session: the direction seen from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionKind {
    /// Files to the server.
    Push,
    /// Files from the server.
    Pull,
    /// Remote operations (ls, stat, mkdir, rm, mv, sum).
    Op,
}

impl SessionKind {
    pub fn name(self) -> &'static str {
        match self {
            SessionKind::Push => "push",
            SessionKind::Pull => "pull",
            SessionKind::Op => "op",
        }
    }
}

/// How a session ended.
#[derive(Debug, Clone)]
pub struct SessionEnd {
    pub ended: SystemTime,
    /// Files in place (received or sent), and files that failed alone.
    pub files: u64,
    pub failed_files: u64,
    /// Payload bytes moved over the data channels.
    pub bytes: u64,
    /// The error that ended the session, as the client was told it (paths relative to
    /// the served directory), with its class; `None` for a session that succeeded.
    pub error: Option<(ErrorClass, String)>,
}
