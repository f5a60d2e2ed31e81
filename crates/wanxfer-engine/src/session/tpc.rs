//! Third-party copy at the source: a server pushing part of its tree to another server
//! because an authenticated client asked it to, with a grant the destination made.
//!
//! Why the source runs the ordinary client ([`run_client`]): a third-party push is a push
//! like any other from here on, so it gets the same channels, retries, resume and
//! verification, and a rerun of the same copy is the same transfer (its id comes from the
//! same sources and destination), which the destination resumes from its journal. The
//! only differences are who it trusts and how it proves itself: the destination must
//! present exactly the certificate the client verified (nothing is pinned or read from a
//! known_hosts file on this server), and the proof is the grant's, not a shared secret.
//!
//! The requesting client hears how it goes every [`REPORT_INTERVAL`] (which also tells
//! this side when the client is gone: the push is then cancelled, its partial files kept
//! for a rerun) and gets the whole report at the end.
//!
//! With `cp --preserve` the client's `PRESERVE_*` flags ride in the request: this side
//! reads owners, attributes and data ranges as any pushing client does, the destination
//! applies what its grant and its own rules allow, and what it could not keep comes
//! back to the client as the summary's notes.
//!
//! `--exclude`, `--include` and `--files-from` ride in the request too, and this side
//! walks its sources with them exactly as a client pushing the same tree would.
//!
//! What this module does not do: read anything outside the served root (sources are
//! opened beneath it, as a pull's are), or let the client choose where this server
//! keeps its state.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wanxfer_proto::tpc::{
    push_flags, PushTo, TransferProgress, TransferSummary, MAX_ENCRYPTION_NAME_BYTES,
    MAX_REPORTED_FAILURES, MAX_REPORTED_NOTES,
};
use wanxfer_proto::{FailureClass, Message, MAX_MESSAGE_BYTES};

use super::client::{run_client, ClientConfig, ClientJob, Failed, Report};
use super::conn::Control;
use super::server::ServerLimits;
use super::state::StateDir;
use super::Tuning;
use crate::fs::Root;
use crate::ops::server::relative_text;
use crate::pool::Cancel;
use crate::preserve::Preserve;
use crate::progress::Progress;
use crate::source::Source;
use crate::tls::ClientSecurity;
use crate::Error;

/// How often the requesting client is told where the push stands.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// What the source needs from its server.
pub(crate) struct SourceSide<'a> {
    pub root: &'a Root,
    /// What errors are shown against: paths relative to the export, as everywhere.
    pub exports: &'a crate::auth::Exports,
    pub limits: &'a ServerLimits,
    /// Where this server keeps its own state (placements of its pushes).
    pub state_dir: Option<&'a std::path::Path>,
    /// Set when the server stops.
    pub stopping: &'a Cancel,
}

/// Runs the push `req` asks for, telling `control`'s client how it goes; returns the
/// summary to send it (which carries the failure, if the push failed). `Err` only for a
/// request refused before anything started, or a client that went away.
pub(crate) fn push(
    side: &SourceSide<'_>,
    req: &PushTo,
    control: &mut Control,
) -> Result<TransferSummary, Error> {
    let l = side.limits;
    let server = std::str::from_utf8(&req.server)
        .map_err(|_| Error::Usage("the destination's address is not text".into()))
        .and_then(|s| {
            crate::ops::server_address(s)
                .map_err(|why| Error::Usage(format!("destination {s}: {why}")))
        })?;
    let fingerprint = format!(
        "SHA256:{}",
        req.fingerprint
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    if req.sources.iter().any(|p| {
        p.split_first()
            .is_some_and(|(first, _)| first.starts_with(crate::ops::RESERVED_PREFIX))
    }) {
        return Err(Error::Op {
            failure: wanxfer_proto::ops::OpFailure::Reserved,
            message: "a name starting with .wanxfer is the server's own".into(),
        });
    }
    let source = Source::beneath(side.root, &req.sources).map_err(|e| Error::Op {
        failure: match &e {
            Error::LocalIo { source, .. } => crate::ops::failure_of(source),
            _ => wanxfer_proto::ops::OpFailure::Invalid,
        },
        message: relative_text(side.exports, &e.to_string()),
    })?;
    let defaults = Tuning::default();
    let tuning = Tuning {
        streams: req.streams.clamp(1, l.max_streams.max(1)),
        block_size: req
            .block_size
            .clamp(64 << 10, l.max_block_size.max(64 << 10)),
        depth: req.depth.clamp(1, l.max_depth.max(1)),
        readers: l.readers,
        io: l.io,
        stall_timeout: l.stall_timeout,
        compare: req.compare,
        resume: req.flags & push_flags::NO_RESUME == 0,
        file_digest: req.flags & push_flags::NO_FILE_DIGEST == 0,
        block_crc: req.flags & push_flags::NO_BLOCK_CHECKSUM == 0
            || req.flags & push_flags::NO_FILE_DIGEST == 0,
        ..defaults
    };
    let cancel = Cancel::default();
    let mut cfg = ClientConfig::new(server.clone(), Vec::new(), tuning);
    cfg.grant = Some((req.grant.id, req.grant.secret));
    cfg.security = ClientSecurity::Fingerprint(fingerprint);
    cfg.cancel = Cancel::linked(&[&cancel, side.stopping]);
    cfg.connect_timeout = l.handshake_timeout;
    cfg.preserve = Preserve::from_flags(req.preserve);
    // Applied by this side's walker, as a pushing client applies its own.
    cfg.selection = req.selection.clone();
    cfg.state_dir = match side.state_dir {
        Some(dir) => dir.join("third-party"),
        None => StateDir::client_default(),
    };
    let job = ClientJob::Push {
        source,
        dest: req.dest.clone(),
        into: req.into,
    };
    tracing::info!(
        "{}: third-party push of {} to {server}/{}",
        control.peer,
        req.sources
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(" "),
        req.dest
    );
    let progress = Arc::new(Progress::default());
    let running = {
        let progress = progress.clone();
        std::thread::Builder::new()
            .name("wanxfer-tpc".into())
            .spawn(move || run_client(&cfg, job, progress))
            .map_err(|e| Error::Internal(format!("cannot start a thread: {e}")))?
    };
    let mut told = Instant::now();
    while !running.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
        if told.elapsed() < REPORT_INTERVAL {
            continue;
        }
        told = Instant::now();
        let now = snapshot(&progress);
        if let Err(e) = control.send(&Message::OpReply(
            wanxfer_proto::ops::OpReply::TransferProgress(now),
        )) {
            // The client is gone: nobody to report to, so stop; what arrived is kept
            // for a rerun.
            cancel.cancel();
            let _ = running.join();
            return Err(e);
        }
    }
    let result = running.join().unwrap_or_else(|_| {
        Err(Failed {
            error: Error::Internal("the third-party push thread panicked".into()),
            report: Box::default(),
        })
    });
    let mut summary = match result {
        Ok(report) => summarize(&report, None),
        Err(Failed { error, report }) => {
            tracing::warn!("{}: third-party push to {server}: {error}", control.peer);
            summarize(&report, Some(&error))
        }
    };
    let fix = |m: &mut Vec<u8>| {
        *m = cut(
            relative_text(side.exports, &String::from_utf8_lossy(m)),
            MAX_MESSAGE_BYTES,
        );
    };
    summary.failures.iter_mut().for_each(|(_, m)| fix(m));
    summary.notes.iter_mut().for_each(fix);
    if let Some((_, m)) = &mut summary.error {
        fix(m);
    }
    Ok(summary)
}

fn snapshot(progress: &Progress) -> TransferProgress {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    TransferProgress {
        bytes: load(&progress.bytes),
        bytes_skipped: load(&progress.bytes_skipped),
        files: load(&progress.files),
        total_bytes: load(&progress.total_bytes),
        total_files: load(&progress.total_files),
        failed_files: load(&progress.failed_files),
    }
}

fn cut(text: String, max: usize) -> Vec<u8> {
    let mut bytes = text.into_bytes();
    bytes.truncate(max);
    bytes
}

/// The client's view of how the push went: this side's report, with the error that
/// ended it (a per-file failure summary is not repeated as the error).
fn summarize(report: &Report, error: Option<&Error>) -> TransferSummary {
    TransferSummary {
        bytes: report.bytes,
        bytes_skipped: report.bytes_skipped,
        files: report.files,
        files_up_to_date: report.files_up_to_date,
        failed_files: report
            .failed_files
            .max(report.failures.len().min(MAX_REPORTED_FAILURES) as u64),
        attempts: report.attempts,
        channels_lost: report.channels_lost,
        micros: (report.seconds * 1e6) as u64,
        cpu_user_us: report.cpu.user_us,
        cpu_sys_us: report.cpu.sys_us,
        peer_cpu_user_us: report.peer_cpu.user_us,
        peer_cpu_sys_us: report.peer_cpu.sys_us,
        streams: report.streams,
        block_size: report.block_size,
        depth: report.depth,
        encryption: cut(report.encryption.clone(), MAX_ENCRYPTION_NAME_BYTES),
        failures: report
            .failures
            .iter()
            .take(MAX_REPORTED_FAILURES)
            .map(|f| {
                let class = match f.class {
                    crate::ErrorClass::Integrity => FailureClass::Integrity,
                    crate::ErrorClass::LocalIo => FailureClass::Io,
                    _ => FailureClass::Refused,
                };
                (class, cut(f.message.clone(), MAX_MESSAGE_BYTES))
            })
            .collect(),
        error: error
            .filter(|e| !matches!(e, Error::Files { .. }))
            .map(|e| (summary_class(e), cut(e.to_string(), MAX_MESSAGE_BYTES))),
        notes: report
            .notes
            .iter()
            .take(MAX_REPORTED_NOTES)
            .map(|n| cut(n.clone(), MAX_MESSAGE_BYTES))
            .collect(),
    }
}

/// How the client is told why the push failed. Unlike [`Error::wire_class`], which tells
/// a peer about its own session, a network failure here is this server's failure to reach
/// the destination: the client retries that, so it must not look like a refusal.
fn summary_class(e: &Error) -> FailureClass {
    match e {
        Error::Network { .. } => FailureClass::Network,
        e => e.wire_class(),
    }
}
