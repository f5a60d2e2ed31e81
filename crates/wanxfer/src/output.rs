//! What a person or a script sees: the progress bar, the summary, the JSON report.
//!
//! Units are the same in the bar and the summary: sizes in binary units (KiB, MiB, GiB,
//! as the size flags take them) and rates in bits per second with decimal prefixes
//! (Mbit/s, Gbit/s, as links are rated). The bar is drawn only on a terminal and is cut
//! to its width, so it never wraps into a second line that the next redraw cannot erase.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use wanxfer_engine::progress::{IoUse, Progress};
use wanxfer_engine::session::steer::TuneReport;
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

/// How often the bar is redrawn, and the span its rate is measured over.
const REDRAW: Duration = Duration::from_millis(100);
const RATE_WINDOW: Duration = Duration::from_secs(2);

fn draw(progress: &Progress, stop: &AtomicBool) {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(ProgressStyle::with_template("{msg}").expect("template is valid"));
    let mut rate = RateMeter::default();
    while !stop.load(Ordering::SeqCst) {
        let (bytes, files, total_bytes, total_files) = progress.snapshot();
        let state = BarState {
            bytes,
            total_bytes: total_bytes.max(bytes),
            files,
            total_files: total_files.max(files),
            bits_per_s: rate.sample(Instant::now(), bytes),
            streams: Some(progress.live().streams).filter(|&n| n > 0),
        };
        // One column short of the width: writing the last column wraps on some terminals.
        let width = terminal_columns().unwrap_or(80).saturating_sub(1);
        bar.set_message(state.line(width));
        std::thread::sleep(REDRAW);
    }
    bar.finish_and_clear();
}

/// stderr's width in columns, if it is a terminal that knows.
fn terminal_columns() -> Option<usize> {
    // SAFETY: a zeroed winsize is valid, and TIOCGWINSZ only writes into the one we pass.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: fd 2 is open for the life of the process; the pointer is to a live winsize.
    let rc = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut size) };
    (rc == 0 && size.ws_col > 0).then_some(usize::from(size.ws_col))
}

/// The rate over the last [`RATE_WINDOW`], from samples of the byte count.
#[derive(Default)]
struct RateMeter {
    samples: VecDeque<(Instant, u64)>,
}

impl RateMeter {
    /// Bits per second, once there is enough time behind it to mean something.
    fn sample(&mut self, now: Instant, bytes: u64) -> Option<f64> {
        self.samples.push_back((now, bytes));
        while self
            .samples
            .get(1)
            .is_some_and(|&(t, _)| now.duration_since(t) >= RATE_WINDOW)
        {
            self.samples.pop_front();
        }
        let &(since, from) = self.samples.front()?;
        let span = now.duration_since(since).as_secs_f64();
        (span >= 0.2).then(|| bytes.saturating_sub(from) as f64 * 8.0 / span)
    }
}

/// The bar's cells, `=` done and ` ` to go: fewer than the minimum says too little to be
/// worth the columns, more than the maximum only stretches it.
const MIN_CELLS: usize = 8;
const MAX_CELLS: usize = 40;

/// What one redraw of the bar shows.
#[derive(Debug, Clone, Copy)]
struct BarState {
    bytes: u64,
    total_bytes: u64,
    files: u64,
    total_files: u64,
    bits_per_s: Option<f64>,
    /// Data channels carrying the transfer now, when known (the tuner changes it).
    streams: Option<u16>,
}

impl BarState {
    /// The line, at most `width` columns: the bar takes what the figures leave, and the
    /// figures that matter least go first when even they do not fit.
    fn line(&self, width: usize) -> String {
        let fraction = if self.total_bytes == 0 {
            0.0
        } else {
            self.bytes as f64 / self.total_bytes as f64
        };
        let eta = match self.bits_per_s {
            Some(rate) if rate > 0.0 => {
                clock(self.total_bytes.saturating_sub(self.bytes) as f64 * 8.0 / rate)
            }
            _ => "--:--".to_string(),
        };
        let rate = self.bits_per_s.map_or("-- bit/s".to_string(), human_rate);
        // In the order shown, padded so that the bar keeps its length as figures change;
        // each with its rank in keeping (0 is kept longest).
        let mut figures = [
            (format!("{:>3.0}%", fraction * 100.0), 1),
            (
                format!(
                    "{:>10} / {}",
                    human_bytes(self.bytes),
                    human_bytes(self.total_bytes)
                ),
                0,
            ),
            // One file says nothing the percentage does not.
            (
                if self.total_files > 1 {
                    format!(
                        "{}/{}",
                        self.files,
                        plural(self.total_files, "file", "files")
                    )
                } else {
                    String::new()
                },
                4,
            ),
            (format!("{rate:>11}"), 2),
            (
                self.streams
                    .map_or(String::new(), |n| plural(n.into(), "stream", "streams")),
                5,
            ),
            (format!("ETA {eta:>5}"), 3),
        ]
        .map(|(text, rank)| (text, rank, true));
        let known = |figures: &mut [(String, usize, bool)]| {
            for f in figures.iter_mut().filter(|f| f.0.is_empty()) {
                f.2 = false;
            }
        };
        let text_width = |figures: &[(String, usize, bool)]| -> usize {
            let shown = figures.iter().filter(|f| f.2);
            shown.clone().map(|f| f.0.chars().count()).sum::<usize>()
                + 2 * shown.count().saturating_sub(1)
        };
        // Room for the figures and a bar of at least MIN_CELLS, dropping figures for it
        // down to the byte count; failing that, for figures alone.
        let bar_room = MIN_CELLS + 3; // `[`, `]` and a space
        let fits = |figures: &mut [(String, usize, bool)], room: usize| {
            figures.iter_mut().for_each(|f| f.2 = true);
            known(figures);
            for rank in (0..figures.len()).rev() {
                if text_width(figures) + room <= width {
                    return true;
                }
                if rank > 0 || room == 0 {
                    if let Some(f) = figures.iter_mut().find(|f| f.1 == rank) {
                        f.2 = false;
                    }
                }
            }
            text_width(figures) + room <= width
        };
        let with_bar = fits(&mut figures, bar_room);
        if !with_bar {
            fits(&mut figures, 0);
        }
        let text = figures
            .iter()
            .filter(|f| f.2)
            .map(|f| f.0.as_str())
            .collect::<Vec<_>>()
            .join("  ");
        if !with_bar {
            return text.chars().take(width).collect();
        }
        let cells = (width - text.chars().count() - 3).min(MAX_CELLS);
        let done = ((fraction * cells as f64) as usize).min(cells);
        let mut bar = "=".repeat(done);
        if done < cells {
            bar.push('>');
            bar.push_str(&" ".repeat(cells - done - 1));
        }
        format!("[{bar}] {text}")
    }
}

/// Seconds as `M:SS` or `H:MM:SS`.
fn clock(seconds: f64) -> String {
    let s = seconds.min(360_000.0 - 1.0).round() as u64;
    match s / 3600 {
        0 => format!("{}:{:02}", s / 60, s % 60),
        h => format!("{h}:{:02}:{:02}", s / 60 % 60, s % 60),
    }
}

/// `1 file`, `2 files`, `0 files`.
pub fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
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
    /// Data channels dropped at the end because idle ones would deliver their blocks
    /// sooner (sent again there).
    channels_cut: u64,
    /// Data channels slower than the others that took no more blocks near the end,
    /// left to faster ones.
    channels_held_back: u64,
    /// Request/response waits from connecting to the first data byte, on the longest
    /// chain of them (the session's own when nothing moved).
    setup_round_trips: u32,
    /// Of those, the waits until the session was agreed.
    session_round_trips: u32,
    /// Seconds from connecting to the first data byte (0 when nothing moved).
    setup_seconds: f64,
    /// The TLS suite every connection used, or `none` (`--no-encryption`).
    encryption: &'a str,
    /// Where the data channels' TLS records were sealed: `rustls`, `kernel`, `none`.
    tls_records: &'a str,
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
    /// Fabric sessions: slots per channel, and the control credits sized to grant them.
    #[serde(skip_serializing_if = "Option::is_none")]
    fabric_slots: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fabric_control_credits: Option<u32>,
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
    /// What --preserve could not keep, once per kind.
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    notes: &'a [String],
    /// A copy between two servers: the counts above are the source's, the CPU here this
    /// client's and the peer's the source server's.
    #[serde(skip_serializing_if = "Option::is_none")]
    third_party: Option<ThirdPartyJson<'a>>,
    /// `--rate`, bits per second, and `--congestion`, as applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    rate_bits_per_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    congestion: Option<&'a str>,
    /// What the tuner chose and why (see [`tuning_json`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    tuning: Option<serde_json::Value>,
    /// Each data channel as its socket last saw it: a straggler shows here.
    #[serde(skip_serializing_if = "Option::is_none")]
    channels: Option<serde_json::Value>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The tuner's choices: final streams, depth and pacing, the path as measured, and the
/// last few decisions with their reasons.
fn tuning_json(t: &TuneReport) -> serde_json::Value {
    serde_json::json!({
        "auto_streams": t.auto_streams,
        "streams": t.streams,
        "max_streams": t.max_streams,
        "depth": t.depth,
        "depth_needed": t.depth_needed,
        "depth_bounded_by_memory": t.depth_bounded,
        "pacing_bits_per_s": t.pacing_bits_per_s,
        "rtt_ms": t.rtt.map(ms),
        "min_rtt_ms": t.min_rtt.map(ms),
        "bdp_bytes": t.bdp_bytes,
        "readings": t.readings,
        "peak_streams": t.peak_streams,
        "peak_window_bytes": t.peak_window_bytes,
        "decisions": t.decisions.iter().map(|d| serde_json::json!({
            "at_s": (d.at_s * 1000.0).round() / 1000.0,
            "streams": d.streams,
            "depth": d.depth,
            "pacing_bits_per_s": d.pacing_bits_per_s,
            "reason": d.reason,
        })).collect::<Vec<_>>(),
    })
}

/// Per-channel figures from `TCP_INFO`.
fn channels_json(t: &TuneReport) -> serde_json::Value {
    t.channels
        .iter()
        .map(|c| {
            serde_json::json!({
                "index": c.index,
                "state": c.state,
                "bytes": c.bytes,
                "bits_per_s": c.bits_per_s.round(),
                "rtt_ms": ms(c.rtt),
                "cwnd": c.cwnd,
                "retransmits": c.retransmits,
                "delivery_bits_per_s": c.delivery_bits_per_s,
                "pacing_bits_per_s": c.pacing_bits_per_s,
            })
        })
        .collect()
}

#[derive(Serialize)]
struct ThirdPartyJson<'a> {
    source: &'a str,
    destination: &'a str,
    destination_cpu_user_s: f64,
    destination_cpu_sys_s: f64,
    /// What this client sent and received over its own connections, counted by the
    /// kernel: the copy's data never passes through it.
    client_tcp_bytes_sent: u64,
    client_tcp_bytes_received: u64,
}

/// Whether a side's I/O was writing received files (so its direct byte count means
/// something).
fn wrote_files(io: &IoUse) -> bool {
    matches!(io.mode.as_str(), "direct" | "buffered")
}

fn seconds(us: u64) -> f64 {
    us as f64 / 1e6
}

/// The end of a successful run: the JSON object with `json`; else, unless `quiet`, notes
/// and a one-line summary.
pub fn print_report(report: &Report, tuning: &Tuning, json: bool, quiet: bool) {
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
            channels_cut: report.channels_cut,
            channels_held_back: report.channels_held_back,
            setup_round_trips: report.setup_round_trips,
            session_round_trips: report.session_round_trips,
            setup_seconds: report.setup_seconds,
            encryption: &report.encryption,
            tls_records: report.tls_records,
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
            fabric_slots: report.fabric.as_ref().map(|f| f.slots),
            fabric_control_credits: report.fabric.as_ref().map(|f| f.control_credits),
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
            notes: &report.notes,
            third_party: report.third_party.as_ref().map(|t| ThirdPartyJson {
                source: &t.source,
                destination: &t.destination,
                destination_cpu_user_s: seconds(t.destination_cpu.user_us),
                destination_cpu_sys_s: seconds(t.destination_cpu.sys_us),
                client_tcp_bytes_sent: t.client_tcp_bytes_sent,
                client_tcp_bytes_received: t.client_tcp_bytes_received,
            }),
            rate_bits_per_s: tuning.rate_bits_per_s,
            congestion: report.tune.as_ref().and_then(|t| t.congestion.as_deref()),
            tuning: report.tune.as_ref().map(tuning_json),
            channels: report.tune.as_ref().map(channels_json),
        };
        println!(
            "{}",
            serde_json::to_string(&out).expect("plain data serializes")
        );
        return;
    }
    if quiet {
        return;
    }
    for s in &report.skipped {
        eprintln!("wanxfer: skipped {s}: not a file, directory or symlink");
    }
    for note in &report.notes {
        eprintln!("wanxfer: note: {note}");
    }
    if let Some(why) = &report.io.fallback {
        eprintln!("wanxfer: note: {why}");
    }
    if let Some(why) = &report.peer_io.fallback {
        eprintln!("wanxfer: note: the server says: {why}");
    }
    if report.files_up_to_date > 0 || report.bytes_skipped > 0 {
        eprintln!(
            "wanxfer: {} already in place, {} not sent again",
            plural(report.files_up_to_date, "file", "files"),
            human_bytes(report.bytes_skipped)
        );
    }
    if report.attempts > 1 {
        eprintln!("wanxfer: completed after {} attempts", report.attempts);
    }
    println!("{}", summary(report, tuning.file_digest));
}

/// Two lines, each within 80 columns for any transfer under a few hours: what moved and
/// how fast, then whether it was verified and the CPU it cost each side.
fn summary(report: &Report, verified: bool) -> String {
    let secs = report.seconds.max(1e-9);
    let files_per_s = if report.files > 1 {
        format!(", {:.0} files/s", report.files as f64 / secs)
    } else {
        String::new()
    };
    let moved = format!(
        "{} in {} in {:.2} s: {}{files_per_s}",
        human_bytes(report.bytes),
        plural(report.files, "file", "files"),
        report.seconds,
        human_rate(report.bytes as f64 * 8.0 / secs),
    );
    let verified = if verified { "verified" } else { "NOT verified" };
    if let Some(t) = &report.third_party {
        return format!(
            "{moved}, {} -> {}\n\
             {verified}; CPU user+sys source {:.2}+{:.2} s, destination {:.2}+{:.2} s, here {:.2}+{:.2} s",
            t.source,
            t.destination,
            seconds(report.peer_cpu.user_us),
            seconds(report.peer_cpu.sys_us),
            seconds(t.destination_cpu.user_us),
            seconds(t.destination_cpu.sys_us),
            seconds(report.cpu.user_us),
            seconds(report.cpu.sys_us),
        );
    }
    format!(
        "{moved}\n\
         {verified}; CPU user+sys here {:.2}+{:.2} s, server {:.2}+{:.2} s",
        seconds(report.cpu.user_us),
        seconds(report.cpu.sys_us),
        seconds(report.peer_cpu.user_us),
        seconds(report.peer_cpu.sys_us),
    )
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

pub fn class_name(class: ErrorClass) -> &'static str {
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
pub fn print_error_json(e: &Error, code: u8, report: Option<&Report>) {
    let mut out = serde_json::json!({
        "error": cause_chain(e),
        "error_class": class_name(e.class()),
        "exit_code": code,
    });
    if let Some(report) = report {
        out["bytes"] = report.bytes.into();
        out["bytes_skipped"] = report.bytes_skipped.into();
        out["files"] = report.files.into();
        out["files_up_to_date"] = report.files_up_to_date.into();
        out["failed_files"] = report.failed_files.into();
        out["attempts"] = report.attempts.into();
        out["failed"] = serde_json::to_value(failed_json(report)).expect("plain data serializes");
    }
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

/// A size in binary units: `512 B`, `1.50 KiB`, `4.00 GiB`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// A rate in bits per second with decimal prefixes: `950.00 Mbit/s`, `9.87 Gbit/s`.
fn human_rate(bits_per_s: f64) -> String {
    const UNITS: [&str; 5] = ["bit/s", "kbit/s", "Mbit/s", "Gbit/s", "Tbit/s"];
    let mut value = bits_per_s.max(0.0);
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// `cp --dry-run`: what the transfer would move, one entry a line (a directory with a
/// trailing `/`, a symlink with its target, another name of a file listed before with
/// `=> ` and that name, as rsync shows hard links) and a summary line, or with `json` one
/// object whose `entries` list them. Entries are written as they are listed, so that a
/// tree of millions is never held in memory; a failure part way still closes the JSON
/// object, with the error in it.
pub fn print_dry_run(
    cfg: &wanxfer_engine::session::ClientConfig,
    job: &wanxfer_engine::session::ClientJob,
    json: bool,
) -> Result<(), Error> {
    use std::io::Write;
    use wanxfer_proto::EntryKind;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let (mut files, mut dirs, mut bytes) = (0u64, 0u64, 0u64);
    if json {
        let _ = write!(out, "{{\"dry_run\":true,\"entries\":[");
    }
    let result = wanxfer_engine::select::dry_run(cfg, job, |entry, first_name| {
        let path = String::from_utf8_lossy(entry.path.as_bytes());
        let first_name = first_name.map(|p| String::from_utf8_lossy(p.as_bytes()));
        let (kind, shown) = match (entry.kind, &first_name) {
            (EntryKind::Dir, _) => ("dir", format!("{path}/")),
            (EntryKind::Symlink, _) => (
                "symlink",
                format!("{path} -> {}", String::from_utf8_lossy(&entry.link_target)),
            ),
            (_, Some(first)) => ("hardlink", format!("{path} => {first}")),
            _ => ("file", path.to_string()),
        };
        if entry.kind == EntryKind::Dir {
            dirs += 1;
        } else {
            files += 1;
        }
        // Another name's data is its first name's: it is not sent again.
        if first_name.is_none() {
            bytes += entry.size;
        }
        if json {
            let mut one = serde_json::json!({"path": path, "kind": kind, "size": entry.size});
            if let Some(first) = &first_name {
                one["link_to"] = first.as_ref().into();
            }
            let comma = if files + dirs > 1 { "," } else { "" };
            let _ = write!(out, "{comma}{one}");
        } else {
            let _ = writeln!(out, "{shown}");
        }
    });
    if json {
        let _ = write!(out, "],\"files\":{files},\"dirs\":{dirs},\"bytes\":{bytes}");
        if let Err(e) = &result {
            let error = serde_json::json!(cause_chain(e));
            let _ = write!(
                out,
                ",\"error\":{error},\"error_class\":\"{}\",\"exit_code\":{}",
                class_name(e.class()),
                crate::exit_code(e)
            );
        }
        let _ = writeln!(out, "}}");
    } else if result.is_ok() {
        let _ = writeln!(
            out,
            "dry run: would send {files} files and {dirs} directories, {} (nothing moved)",
            crate::args::size_text(bytes)
        );
    }
    let _ = out.flush();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_fits_every_width_whatever_the_figures() {
        let extremes = [
            (0, 0, 0, 0, None),
            (1, 1, 1, 1, Some(1.0)),
            (5 << 30, 10 << 30, 12_345, 1_000_000, Some(9.87e9)),
            (u64::MAX / 2, u64::MAX, u64::MAX, u64::MAX, Some(1e15)),
            (1 << 20, 1 << 40, 0, 1, Some(1e3)),
        ];
        for ((bytes, total_bytes, files, total_files, bits_per_s), streams) in extremes
            .into_iter()
            .zip([None, Some(1), Some(16), Some(u16::MAX), None])
        {
            let state = BarState {
                bytes,
                total_bytes,
                files,
                total_files,
                bits_per_s,
                streams,
            };
            for width in 0..=200 {
                let line = state.line(width);
                assert!(line.chars().count() <= width, "{width}: {line:?}");
            }
            let line = state.line(79);
            assert!(line.contains(" / ") && line.contains('%'), "{line:?}");
        }
    }

    #[test]
    fn a_wide_bar_shows_every_figure_and_80_columns_streams_or_files() {
        let state = BarState {
            bytes: 3 << 29,
            total_bytes: 4 << 30,
            files: 2_500,
            total_files: 5_000,
            bits_per_s: Some(9.5e9),
            streams: Some(4),
        };
        let line = state.line(100);
        assert!(line.starts_with("[=") && line.contains(">"), "{line:?}");
        for figure in [
            "38%",
            "1.50 GiB / 4.00 GiB",
            "2500/5000 files",
            "9.50 Gbit/s",
            "4 streams",
            "ETA  0:02",
        ] {
            assert!(line.contains(figure), "{line:?} lacks {figure:?}");
        }
        // At 80 columns the stream count gives way to the file count; a transfer of one
        // file (or memory to memory) shows its streams instead.
        let line = state.line(79);
        assert!(line.starts_with("[=") && line.contains(">"), "{line:?}");
        assert!(!line.contains("streams"), "{line:?}");
        assert!(line.contains("2500/5000 files"), "{line:?}");
        let one = BarState {
            total_files: 1,
            files: 0,
            streams: Some(1),
            ..state
        }
        .line(79);
        assert!(one.starts_with("[=") && one.contains(">"), "{one:?}");
        assert!(one.contains("9.50 Gbit/s  1 stream  ETA"), "{one:?}");
        assert!(!one.contains("file"), "{one:?}");
    }

    #[test]
    fn the_summary_fits_80_columns_and_counts_files_grammatically() {
        use wanxfer_engine::progress::CpuTime;
        let cpu = CpuTime {
            user_us: 999_990_000,
            sys_us: 999_990_000,
        };
        let report = |bytes, files, seconds, cpu| Report {
            bytes,
            files,
            failed_files: 0,
            seconds,
            cpu,
            peer_cpu: cpu,
            streams: 2,
            block_size: 4 << 20,
            depth: 4,
            transport: "tcp",
            fabric: None,
            io: IoUse::default(),
            peer_io: IoUse::default(),
            zerocopy_sends: 0,
            zerocopy_copied: 0,
            skipped: Vec::new(),
            ..Report::default()
        };
        let big = report(1023 << 40, 1_000_000, 9999.99, cpu);
        for verified in [true, false] {
            let text = summary(&big, verified);
            assert_eq!(text.lines().count(), 2, "{text}");
            for line in text.lines() {
                assert!(line.chars().count() <= 80, "{line:?}");
            }
        }
        let one = report(3 << 20, 1, 0.5, CpuTime::default());
        let text = summary(&one, true);
        assert!(
            text.starts_with("3.00 MiB in 1 file in 0.50 s: 50.33 Mbit/s\nverified;"),
            "{text}"
        );
        assert!(!text.contains("files"), "{text}");
        let none = report(3 << 20, 0, 0.5, CpuTime::default());
        assert!(summary(&none, false).contains("in 0 files in"));
    }

    #[test]
    fn units_and_plurals() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_rate(9.87e9), "9.87 Gbit/s");
        assert_eq!(human_rate(950e6), "950.00 Mbit/s");
        assert_eq!(plural(1, "file", "files"), "1 file");
        assert_eq!(plural(0, "file", "files"), "0 files");
        assert_eq!(clock(62.0), "1:02");
        assert_eq!(clock(3723.0), "1:02:03");
    }

    #[test]
    fn the_rate_is_measured_over_the_recent_window() {
        let mut meter = RateMeter::default();
        let start = Instant::now();
        assert_eq!(meter.sample(start, 0), None, "no rate from one sample");
        // 1 GB/s for 3 s, then nothing: after 2 s more the window holds only the stop.
        let mut rate = None;
        for tenth in 1..=30u64 {
            rate = meter.sample(
                start + Duration::from_millis(100 * tenth),
                tenth * 100_000_000,
            );
        }
        let gbit = rate.unwrap() / 1e9;
        assert!((gbit - 8.0).abs() < 0.01, "{gbit}");
        for tenth in 31..=55u64 {
            rate = meter.sample(start + Duration::from_millis(100 * tenth), 3_000_000_000);
        }
        assert_eq!(rate, Some(0.0));
    }
}
