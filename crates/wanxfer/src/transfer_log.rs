//! `serve --transfer-log FILE`: one JSON line per session, what an operator greps when a
//! user says a transfer went wrong (GridFTP's `-Z` log, as JSON lines).
//!
//! Each record is one `write` of a whole line to a file opened with `O_APPEND`, under a
//! lock: sessions ending together never interleave, and another process appending to the
//! same file (a second server) does not split a line either. Before each record the path
//! is checked against the open file, so when logrotate moves the file away (its default
//! `create` mode) the next record starts the new file; `copytruncate` works as is, as
//! appends always go to the end. No signal is needed, which keeps SIGHUP free for the
//! service manager.
//!
//! What the log does not hold: per-file lines (the paths are what the client asked for,
//! relative to the served directory, as the server never shows its own paths).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Serialize;
use wanxfer_engine::session::observe::{Observer, SessionEnd, SessionInfo};
use wanxfer_engine::Error;

/// The transfer log, open for appending.
pub struct TransferLog {
    path: PathBuf,
    file: Mutex<File>,
}

/// One line of the log. Field names are the log's interface: add, never rename.
#[derive(Debug, Serialize)]
pub struct Record<'a> {
    /// RFC 3339, UTC.
    pub start: String,
    pub end: String,
    /// This server's session number (also the `session` label of its metrics).
    pub session: u64,
    pub peer: &'a str,
    /// Who authenticated: `secret` for the shared secret.
    pub identity: &'a str,
    /// `push` (to the server), `pull` (from it) or `op` (remote operations).
    pub direction: &'static str,
    /// As the client named them, relative to the served directory.
    pub paths: &'a [String],
    pub files: u64,
    pub failed_files: u64,
    pub bytes: u64,
    pub streams: u16,
    pub transport: &'static str,
    pub encryption: &'static str,
    pub seconds: f64,
    pub rate_bytes_per_s: f64,
    /// `ok` or `failed`.
    pub result: &'static str,
    /// With `failed`: the class (as in `cp --json`) and the message the client was given.
    pub error_class: Option<&'static str>,
    pub error: Option<&'a str>,
}

fn rfc3339(t: SystemTime) -> String {
    time::OffsetDateTime::from(t)
        .format(&time::format_description::well_known::Rfc3339)
        // Only years beyond 9999 fail to format.
        .unwrap_or_else(|_| "unrepresentable".into())
}

fn open(path: &Path) -> Result<File, Error> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o640)
        .open(path)
        .map_err(|e| Error::local("open the transfer log", path.display(), e))
}

impl TransferLog {
    pub fn open(path: &Path) -> Result<TransferLog, Error> {
        Ok(TransferLog {
            path: path.to_path_buf(),
            file: Mutex::new(open(path)?),
        })
    }

    /// Appends `line` (ending in a newline) in one write, reopening a rotated file first.
    fn append(&self, line: &[u8]) -> Result<(), Error> {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let same = match (std::fs::metadata(&self.path), file.metadata()) {
            (Ok(on_disk), Ok(open)) => on_disk.dev() == open.dev() && on_disk.ino() == open.ino(),
            _ => false,
        };
        if !same {
            *file = open(&self.path)?;
        }
        file.write_all(line)
            .map_err(|e| Error::local("append to the transfer log", self.path.display(), e))
    }
}

impl Observer for TransferLog {
    fn session_ended(&self, session: &SessionInfo, end: &SessionEnd) {
        let seconds = end
            .ended
            .duration_since(session.started)
            .unwrap_or_default()
            .as_secs_f64();
        let record = Record {
            start: rfc3339(session.started),
            end: rfc3339(end.ended),
            session: session.number,
            peer: &session.peer,
            identity: &session.identity,
            direction: session.kind.name(),
            paths: &session.paths,
            files: end.files,
            failed_files: end.failed_files,
            bytes: end.bytes,
            streams: session.streams,
            transport: session.transport,
            encryption: session.encryption,
            seconds,
            rate_bytes_per_s: if seconds > 0.0 {
                end.bytes as f64 / seconds
            } else {
                0.0
            },
            result: if end.error.is_none() { "ok" } else { "failed" },
            error_class: end
                .error
                .as_ref()
                .map(|(class, _)| crate::output::class_name(*class)),
            error: end.error.as_ref().map(|(_, message)| message.as_str()),
        };
        let line = match serde_json::to_vec(&record) {
            Ok(mut line) => {
                line.push(b'\n');
                line
            }
            Err(e) => {
                tracing::error!("transfer log record: {e}");
                return;
            }
        };
        if let Err(e) = self.append(&line) {
            // The transfer itself went as it went; the operator learns the log failed.
            tracing::error!("{e}");
        }
    }
}
