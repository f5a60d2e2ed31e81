//! `wanxfer cp wanxfer://A/x wanxfer://B/y`: a copy between two servers that this client
//! drives and the data never passes through.
//!
//! The order is chosen so that nothing is granted before both credentials have worked:
//! authenticate to the source, then to the destination, ask the destination for a grant
//! for the one path, then ask the source to push with it (see `wanxfer_proto::tpc`). The
//! source reports progress every second, which drives the same progress bar, and its
//! summary becomes the same report and `--json` as a normal `cp`, plus what this client
//! moved itself, as the kernel counted it on its two connections.
//!
//! `--preserve` and `-a` travel in both requests: the grant names them, so the source
//! can ask the destination for no more than this client did, and what the destination
//! could not keep comes back in the summary as the notes a push would show.
//!
//! `--exclude`, `--include` and `--files-from` travel to the source, which walks its
//! tree with them; `--parents` creates the directories above the destination on the
//! destination server (a remote `mkdir -p`, confined there as any) before the grant.
//! `--dry-run` never gets here: it lists the source as a pull's dry run does.
//!
//! What this does not do: retry. The source retries its own connection to the
//! destination and resumes; if this client's connection to the source fails, the source
//! stops, and running the same command again resumes the same transfer with a new grant.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use wanxfer_engine::ops::Client;
use wanxfer_engine::pool::Cancel;
use wanxfer_engine::progress::{process_cpu, CpuTime, Progress};
use wanxfer_engine::select::Matcher;
use wanxfer_engine::session::client::{fits_request, remote_parent, FileFailure, Report};
use wanxfer_engine::session::ThirdPartyReport;
use wanxfer_engine::{Error, ErrorClass};
use wanxfer_proto::tpc::{push_flags, PushTo, TransferSummary, MAX_GRANT_TTL_S};
use wanxfer_proto::{ErrorMsg, FailureClass};

use crate::args::ThirdPartyRequest;

/// Runs the copy; `Err` carries what was done before it failed.
pub fn run(
    req: &ThirdPartyRequest,
    progress: &Arc<Progress>,
    cancel: &Cancel,
) -> Result<Report, (Error, Box<Report>)> {
    let started = Instant::now();
    let cpu_before = process_cpu();
    let early = |e: Error| (e, Box::<Report>::default());
    // A selection the source would refuse is refused here, before anything connects.
    let selection = &req.source.selection;
    Matcher::new(selection).map_err(early)?;
    fits_request(selection, "a copy between two servers").map_err(early)?;
    let mut source = Client::connect(&req.source).map_err(early)?;
    let mut dest = Client::connect(&req.dest).map_err(early)?;
    if let Some(parent) = remote_parent(&req.dest_path).filter(|_| req.dest.make_parents) {
        dest.mkdir(&parent, true, 0o777).map_err(early)?;
    }
    let Some(fingerprint) = dest.fingerprint().map(parse_fingerprint) else {
        return Err(early(Error::Usage(
            "a copy between two servers needs TLS to the destination".into(),
        )));
    };
    let fingerprint = fingerprint.map_err(early)?;
    // The grant names what the push may keep, so that the source cannot use it for more.
    let preserve = req.source.preserve.flags();
    let grant = dest
        .grant(&req.dest_path, MAX_GRANT_TTL_S, preserve)
        .map_err(early)?;
    let tuning = &req.source.tuning;
    let mut flags = 0;
    if !tuning.resume {
        flags |= push_flags::NO_RESUME;
    }
    if !tuning.file_digest {
        flags |= push_flags::NO_FILE_DIGEST;
    }
    if !tuning.block_crc {
        flags |= push_flags::NO_BLOCK_CHECKSUM;
    }
    let push = PushTo {
        sources: req.sources.clone(),
        server: req.dest.server.clone().into_bytes(),
        fingerprint,
        dest: req.dest_path.clone(),
        into: req.into,
        grant,
        streams: tuning.streams,
        block_size: tuning.block_size,
        depth: tuning.depth,
        compare: tuning.compare,
        flags,
        preserve,
        selection: selection.clone(),
    };
    let summary = source.push_to(push, |p| {
        if cancel.is_cancelled() {
            // Dropping the connection tells the source to stop, keeping what arrived.
            return Err(Error::Cancelled);
        }
        progress.bytes.store(p.bytes, Ordering::Relaxed);
        progress
            .bytes_skipped
            .store(p.bytes_skipped, Ordering::Relaxed);
        progress.files.store(p.files, Ordering::Relaxed);
        progress.total_bytes.store(p.total_bytes, Ordering::Relaxed);
        progress.total_files.store(p.total_files, Ordering::Relaxed);
        progress
            .failed_files
            .store(p.failed_files, Ordering::Relaxed);
        Ok(())
    });
    let summary = summary.map_err(early)?;
    let (mut sent, mut received) = (0, 0);
    for client in [&source, &dest] {
        let (s, r) = client.tcp_bytes().unwrap_or_default();
        sent += s;
        received += r;
    }
    let cpu_after = process_cpu();
    let mut report = report(&summary, req);
    report.notes = summary
        .notes
        .iter()
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    report.seconds = started.elapsed().as_secs_f64();
    report.cpu = CpuTime {
        user_us: cpu_after.user_us - cpu_before.user_us,
        sys_us: cpu_after.sys_us - cpu_before.sys_us,
    };
    if let Some(t) = &mut report.third_party {
        t.client_tcp_bytes_sent = sent;
        t.client_tcp_bytes_received = received;
    }
    if let Some((class, message)) = &summary.error {
        let error = Error::remote(
            &req.source.server,
            &ErrorMsg::new(*class, &String::from_utf8_lossy(message)),
        );
        return Err((error, Box::new(report)));
    }
    if let Some(first) = report.failures.first() {
        let error = Error::Files {
            count: report.failed_files,
            first: Box::new(Error::Remote {
                peer: req.source.server.clone(),
                class: match first.class {
                    ErrorClass::Integrity => FailureClass::Integrity,
                    ErrorClass::LocalIo => FailureClass::Io,
                    _ => FailureClass::Refused,
                },
                message: first.message.clone(),
            }),
        };
        return Err((error, Box::new(report)));
    }
    Ok(report)
}

/// `SHA256:hex` as the 32 bytes it names.
fn parse_fingerprint(text: &str) -> Result<[u8; 32], Error> {
    let bad = || {
        Error::Internal(format!(
            "a certificate fingerprint {text:?} is not SHA256:hex"
        ))
    };
    let hex = text.strip_prefix("SHA256:").ok_or_else(bad)?;
    if hex.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The source's summary as the report a normal `cp` prints.
fn report(s: &TransferSummary, req: &ThirdPartyRequest) -> Report {
    Report {
        bytes: s.bytes,
        bytes_skipped: s.bytes_skipped,
        files: s.files,
        files_up_to_date: s.files_up_to_date,
        failed_files: s.failed_files,
        peer_cpu: CpuTime {
            user_us: s.cpu_user_us,
            sys_us: s.cpu_sys_us,
        },
        streams: s.streams,
        block_size: s.block_size,
        depth: s.depth,
        transport: "tcp",
        attempts: s.attempts,
        channels_lost: s.channels_lost,
        // The source's push client cuts and holds back its own channels; its status
        // carries no count.
        channels_cut: 0,
        channels_held_back: 0,
        failures: s
            .failures
            .iter()
            .map(|(class, message)| FileFailure {
                class: match class {
                    FailureClass::Integrity => ErrorClass::Integrity,
                    FailureClass::Io => ErrorClass::LocalIo,
                    _ => ErrorClass::Remote,
                },
                message: String::from_utf8_lossy(message).into_owned(),
            })
            .collect(),
        encryption: String::from_utf8_lossy(&s.encryption).into_owned(),
        tls_records: "none",
        // This client moved no file bytes; the servers' I/O is theirs to log.
        io: wanxfer_engine::progress::IoUse {
            mode: "none".into(),
            ..Default::default()
        },
        third_party: Some(ThirdPartyReport {
            source: req.source.server.clone(),
            destination: req.dest.server.clone(),
            destination_cpu: CpuTime {
                user_us: s.peer_cpu_user_us,
                sys_us: s.peer_cpu_sys_us,
            },
            ..ThirdPartyReport::default()
        }),
        ..Report::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_parse_back() {
        let fp = format!("SHA256:{}", "0a".repeat(32));
        assert_eq!(parse_fingerprint(&fp).unwrap(), [10; 32]);
        assert!(parse_fingerprint("SHA256:0a").is_err());
        assert!(parse_fingerprint(&format!("MD5:{}", "0a".repeat(32))).is_err());
        assert!(parse_fingerprint(&format!("SHA256:{}", "zz".repeat(32))).is_err());
    }
}
