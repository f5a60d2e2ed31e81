//! What a person or a script sees: the progress bar, the summary, the JSON report.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use wanxfer_engine::progress::{IoUse, Progress};
use wanxfer_engine::session::{Report, Tuning};
use wanxfer_engine::Error;

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
    bytes: u64,
    files: u64,
    failed_files: u64,
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
            files: report.files,
            failed_files: report.failed_files,
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

pub fn print_error_json(e: &Error, code: u8) {
    let out = serde_json::json!({ "error": cause_chain(e), "exit_code": code });
    println!("{out}");
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
