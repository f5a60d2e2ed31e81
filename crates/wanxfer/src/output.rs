//! What a person or a script sees: the progress bar, the summary, the JSON report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use wanxfer_engine::progress::{IoUse, Progress};
use wanxfer_engine::session::{Report, Tuning};
use wanxfer_engine::{Error, ErrorClass};

/// A progress bar redrawn from the engine's counters, or nothing when not on a terminal.
pub struct ProgressView {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressView {
    pub fn start(progress: Arc<Progress>, enabled: bool) -> ProgressView {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = enabled.then(|| {
            let stop = stop.clone();
            std::thread::spawn(move || draw(&progress, &stop))
        });
        ProgressView { stop, thread }
    }

    pub fn finish(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn draw(progress: &Progress, stop: &AtomicBool) {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30.cyan/blue} {bytes}/{total_bytes} {msg} {binary_bytes_per_sec} ETA {eta}",
        )
        .expect("template is valid")
        .progress_chars("=> "),
    );
    while !stop.load(Ordering::SeqCst) {
        let (bytes, files, total_bytes, total_files) = progress.snapshot();
        bar.set_length(total_bytes.max(bytes));
        bar.set_position(bytes);
        bar.set_message(format!("{files}/{total_files} files"));
        std::thread::sleep(Duration::from_millis(100));
    }
    bar.finish_and_clear();
}

#[derive(Serialize)]
struct JsonReport<'a> {
    /// Payload bytes moved over the network (all attempts).
    bytes: u64,
    /// Bytes not sent because the destination had them (up to date, or resumed).
    bytes_skipped: u64,
    files: u64,
    /// Of `files`, already in place: not sent.
    files_up_to_date: u64,
    failed_files: u64,
    /// Sessions it took: more than 1 after retries (each resumed the last).
    attempts: u32,
    /// Data channels that died mid-transfer (their blocks were sent again on others).
    channels_lost: u64,
    /// Round trips from connecting to the session being agreed.
    setup_round_trips: u32,
    failed: Vec<FailedJson>,
    seconds: f64,
    gbit_per_s: f64,
    files_per_s: f64,
    cpu_user_s: f64,
    cpu_sys_s: f64,
    peer_cpu_user_s: f64,
    peer_cpu_sys_s: f64,
    streams: u16,
    block_size: u32,
    depth: u16,
    transport: &'a str,
    /// Fabric sessions: what libfabric discovery chose here.
    #[serde(skip_serializing_if = "Option::is_none")]
    fabric_provider: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fabric_fabric: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fabric_domain: Option<&'a str>,
    /// How this side moved file bytes: its send mode, or how it wrote what it received.
    io: &'a str,
    /// Why it did less than that mode asks for, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    io_fallback: Option<&'a str>,
    /// Receiving into files: bytes written with O_DIRECT.
    #[serde(skip_serializing_if = "Option::is_none")]
    direct_bytes: Option<u64>,
    peer_io: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer_io_fallback: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer_direct_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zerocopy_sends: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zerocopy_copied: Option<u64>,
    block_checksum: bool,
    file_digest: bool,
    skipped: &'a [String],
}

/// Whether a side's I/O was writing received files (so its direct byte count means
/// something).
fn wrote_files(io: &IoUse) -> bool {
    matches!(io.mode.as_str(), "direct" | "buffered")
}

fn seconds(us: u64) -> f64 {
    us as f64 / 1e6
}

pub fn print_report(report: &Report, tuning: &Tuning, json: bool) {
    let secs = report.seconds.max(1e-9);
    let gbit = report.bytes as f64 * 8.0 / secs / 1e9;
    let files_per_s = report.files as f64 / secs;
    if json {
        let out = JsonReport {
            bytes: report.bytes,
            bytes_skipped: report.bytes_skipped,
            files: report.files,
            files_up_to_date: report.files_up_to_date,
            failed_files: report.failed_files,
            attempts: report.attempts,
            channels_lost: report.channels_lost,
            setup_round_trips: report.setup_round_trips,
            failed: failed_json(report),
            seconds: report.seconds,
            gbit_per_s: gbit,
            files_per_s,
            cpu_user_s: seconds(report.cpu.user_us),
            cpu_sys_s: seconds(report.cpu.sys_us),
            peer_cpu_user_s: seconds(report.peer_cpu.user_us),
            peer_cpu_sys_s: seconds(report.peer_cpu.sys_us),
            streams: report.streams,
            block_size: report.block_size,
            depth: report.depth,
            transport: report.transport,
            fabric_provider: report.fabric.as_ref().map(|f| f.provider.as_str()),
            fabric_fabric: report.fabric.as_ref().map(|f| f.fabric.as_str()),
            fabric_domain: report.fabric.as_ref().map(|f| f.domain.as_str()),
            io: &report.io.mode,
            io_fallback: report.io.fallback.as_deref(),
            direct_bytes: wrote_files(&report.io).then_some(report.io.direct_bytes),
            peer_io: &report.peer_io.mode,
            peer_io_fallback: report.peer_io.fallback.as_deref(),
            peer_direct_bytes: wrote_files(&report.peer_io).then_some(report.peer_io.direct_bytes),
            zerocopy_sends: (report.io.mode == "zerocopy").then_some(report.zerocopy_sends),
            zerocopy_copied: (report.io.mode == "zerocopy").then_some(report.zerocopy_copied),
            // Segment digests check every block's bytes as they arrive.
            block_checksum: tuning.block_crc || tuning.file_digest,
            file_digest: tuning.file_digest,
            skipped: &report.skipped,
        };
        println!(
            "{}",
            serde_json::to_string(&out).expect("plain data serializes")
        );
        return;
    }
    for s in &report.skipped {
        eprintln!("wanxfer: skipped {s}: not a file, directory or symlink");
    }
    if let Some(why) = &report.io.fallback {
        eprintln!("wanxfer: note: {why}");
    }
    if let Some(why) = &report.peer_io.fallback {
        eprintln!("wanxfer: note: the server says: {why}");
    }
    let verified = if tuning.file_digest {
        "verified"
    } else {
        "NOT verified"
    };
    if report.files_up_to_date > 0 || report.bytes_skipped > 0 {
        eprintln!(
            "wanxfer: {} file(s) already in place, {} not sent again",
            report.files_up_to_date,
            human_bytes(report.bytes_skipped)
        );
    }
    if report.attempts > 1 {
        eprintln!("wanxfer: completed after {} attempts", report.attempts);
    }
    println!(
        "{} in {} files ({verified}) in {:.2} s: {:.2} Gbit/s, {:.0} files/s; CPU here {:.2}s user {:.2}s sys, server {:.2}s user {:.2}s sys",
        human_bytes(report.bytes),
        report.files,
        report.seconds,
        gbit,
        files_per_s,
        seconds(report.cpu.user_us),
        seconds(report.cpu.sys_us),
        seconds(report.peer_cpu.user_us),
        seconds(report.peer_cpu.sys_us),
    );
}

/// One file that failed, for `--json`.
#[derive(Serialize)]
struct FailedJson {
    class: &'static str,
    message: String,
}

fn failed_json(report: &Report) -> Vec<FailedJson> {
    report
        .failures
        .iter()
        .map(|f| FailedJson {
            class: class_name(f.class),
            message: f.message.clone(),
        })
        .collect()
}

fn class_name(class: ErrorClass) -> &'static str {
    match class {
        ErrorClass::Usage => "usage",
        ErrorClass::Auth => "auth",
        ErrorClass::Network => "network",
        ErrorClass::Protocol => "protocol",
        ErrorClass::Integrity => "integrity",
        ErrorClass::LocalIo => "local_io",
        ErrorClass::Remote => "remote",
        ErrorClass::Internal => "internal",
    }
}

/// A failed run's JSON: the error, its exit code, and what was done before it (bytes,
/// files, and the files that failed).
pub fn print_error_json(e: &Error, code: u8, report: &Report) {
    let out = serde_json::json!({
        "error": cause_chain(e),
        "error_class": class_name(e.class()),
        "exit_code": code,
        "bytes": report.bytes,
        "bytes_skipped": report.bytes_skipped,
        "files": report.files,
        "files_up_to_date": report.files_up_to_date,
        "failed_files": report.failed_files,
        "attempts": report.attempts,
        "failed": failed_json(report),
    });
    println!("{out}");
}

/// The command line this process was started with, quoted for a shell to run again.
pub fn command_line() -> String {
    std::env::args_os()
        .map(|arg| {
            let text = arg.to_string_lossy().into_owned();
            let plain = !text.is_empty()
                && text
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c));
            if plain {
                text
            } else {
                format!("'{}'", text.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn cause_chain(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}
