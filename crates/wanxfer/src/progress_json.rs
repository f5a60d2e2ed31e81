//! `cp --progress-json`: the transfer as JSON lines while it runs, for scripts and
//! dashboards that cannot wait for `--json`'s object at the end.
//!
//! Why two threads and a small queue: a sampler reads the engine's counters every
//! second and hands a finished line to a writer; the writer alone touches the file or
//! pipe. When the consumer falls behind (a full pipe, a slow disk), the queue fills and
//! the sampler drops lines instead of waiting: every line carries cumulative counts, so
//! the next one that gets through supersedes the ones dropped, and it says how many were
//! (`lines_dropped`). The transfer itself never waits on either thread. A tuner decision
//! counts as reported only once a line carrying it was queued, so dropping a line loses
//! no decision unless more than `wanxfer_engine::progress::LIVE_DECISIONS` pile up meanwhile (then
//! `decisions_missed` says how many).
//!
//! What it does not do: draw anything (the bar is `output.rs`), or measure: every figure
//! is the engine's (`Progress`, the client's `TCP_INFO` samples, the server's status).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use wanxfer_engine::progress::{process_cpu, CpuTime, Live, Progress};
use wanxfer_engine::session::Report;
use wanxfer_engine::Error;

/// The version of the lines' layout; it changes when a field changes meaning or goes
/// away (new fields may appear without it).
pub const SCHEMA: u32 = 1;

/// How often a line is written.
const EVERY: Duration = Duration::from_secs(1);

/// Lines waiting for the writer; beyond it the sampler drops lines.
const QUEUE_LINES: usize = 4;

/// What one line is made from: plain data copied out of the engine's counters, so that
/// the builder can be tested without a session.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub bytes: u64,
    pub bytes_skipped: u64,
    pub files: u64,
    pub failed_files: u64,
    pub total_bytes: u64,
    pub total_files: u64,
    /// Payload bytes by data channel.
    pub channel_bytes: Vec<(u16, u64)>,
    /// Pools by kind: buffers on loan and in all.
    pub pools: Vec<(&'static str, usize, usize)>,
    pub fabric_credits: u64,
    pub fabric_credit_wait_us: u64,
    pub channel_wait_us: u64,
    pub live: Live,
    /// This process's CPU since the command started.
    pub cpu: CpuTime,
    /// The data channels are fabric ones: their credits are worth showing, even at 0.
    pub fabric: bool,
}

impl Snapshot {
    fn take(progress: &Progress, cpu_start: CpuTime, fabric: bool) -> Snapshot {
        let cpu = process_cpu();
        Snapshot {
            bytes: progress.bytes.load(Ordering::Relaxed),
            bytes_skipped: progress.bytes_skipped.load(Ordering::Relaxed),
            files: progress.files.load(Ordering::Relaxed),
            failed_files: progress.failed_files.load(Ordering::Relaxed),
            total_bytes: progress.total_bytes.load(Ordering::Relaxed),
            total_files: progress.total_files.load(Ordering::Relaxed),
            channel_bytes: progress.channel_bytes(),
            pools: progress
                .pool_occupancy()
                .into_iter()
                .map(|(kind, in_use, capacity)| (kind.name(), in_use, capacity))
                .collect(),
            fabric_credits: progress.fabric_credits.load(Ordering::Relaxed),
            fabric_credit_wait_us: progress.fabric_credit_wait_us.load(Ordering::Relaxed),
            channel_wait_us: progress.channel_wait_us.load(Ordering::Relaxed),
            live: progress.live(),
            cpu: CpuTime {
                user_us: cpu.user_us.saturating_sub(cpu_start.user_us),
                sys_us: cpu.sys_us.saturating_sub(cpu_start.sys_us),
            },
            fabric,
        }
    }
}

/// Turns snapshots into lines, keeping what rates and "new since the last line" need.
pub struct LineBuilder {
    start: Instant,
    previous: Option<Previous>,
    /// The number of the last decision a queued line carried.
    decisions_reported: u64,
    lines_dropped: u64,
}

/// What the last line counted, for the next one's rates.
struct Previous {
    at: Instant,
    bytes: u64,
    channels: BTreeMap<u16, u64>,
    /// Bytes the sockets delivered, if sampled.
    delivered: Option<u64>,
}

/// A built line, and the number of the last decision in it.
pub struct Line {
    pub value: Value,
    last_decision: u64,
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn seconds(us: u64) -> f64 {
    round3(us as f64 / 1e6)
}

fn cpu_json(cpu: CpuTime) -> Value {
    json!({"user_s": seconds(cpu.user_us), "sys_s": seconds(cpu.sys_us)})
}

impl LineBuilder {
    pub fn new(start: Instant) -> LineBuilder {
        LineBuilder {
            start,
            previous: None,
            decisions_reported: 0,
            lines_dropped: 0,
        }
    }

    /// The line for `snap` taken at `now`; `event` is `progress` or `end`. Rates are over
    /// the time since the previous line (since the start for the first).
    pub fn line(&mut self, now: Instant, snap: &Snapshot, event: &str) -> Line {
        let first = self.previous.is_none();
        let (since, bytes_before, channels_before, delivered_before) = match self.previous.take() {
            Some(p) => (p.at, p.bytes, p.channels, p.delivered),
            None => (self.start, 0, BTreeMap::new(), None),
        };
        let span = now.saturating_duration_since(since).as_secs_f64();
        let rate = |now: u64, before: u64| {
            (span > 0.0).then(|| (now.saturating_sub(before) as f64 * 8.0 / span).round())
        };
        let bits_per_s = rate(snap.bytes, bytes_before);
        // The path's rate as the sockets saw it; `bits_per_s` counts whole blocks.
        // Over a line whose start it knows: the first line's is the command's.
        let network_bits_per_s = match (snap.live.delivered_bytes, delivered_before) {
            (Some(now), Some(before)) => rate(now, before),
            (Some(now), None) if first => rate(now, 0),
            _ => None,
        };
        let done = snap.bytes + snap.bytes_skipped;
        let total = snap.total_bytes.max(done);
        let eta_s = match bits_per_s {
            _ if done >= total && total > 0 => Some(0.0),
            Some(r) if r > 0.0 => Some(round3((total - done) as f64 * 8.0 / r)),
            _ => None,
        };
        // Every channel that moved payload or has a socket sample, by index.
        let mut channels: BTreeMap<u16, Map<String, Value>> = BTreeMap::new();
        for &(index, bytes) in &snap.channel_bytes {
            let before = channels_before.get(&index).copied().unwrap_or(0);
            let c = channels.entry(index).or_default();
            c.insert("bytes".into(), bytes.into());
            c.insert("bits_per_s".into(), json!(rate(bytes, before)));
        }
        for sample in &snap.live.channels {
            let c = channels.entry(sample.index).or_default();
            c.entry("bytes").or_insert(0.into());
            c.entry("bits_per_s").or_insert(json!(rate(0, 0)));
            c.insert("state".into(), sample.state.into());
            c.insert(
                "rtt_ms".into(),
                json!(round3(sample.rtt.as_secs_f64() * 1e3)),
            );
            c.insert("cwnd".into(), sample.cwnd.into());
            c.insert("retransmits".into(), sample.retransmits.into());
            c.insert(
                "delivery_bits_per_s".into(),
                sample.delivery_bits_per_s.into(),
            );
            c.insert("pacing_bits_per_s".into(), sample.pacing_bits_per_s.into());
        }
        let channels: Vec<Value> = channels
            .into_iter()
            .map(|(index, mut c)| {
                c.insert("index".into(), index.into());
                Value::Object(c)
            })
            .collect();
        let pools: Map<String, Value> = snap
            .pools
            .iter()
            .map(|&(kind, in_use, capacity)| {
                (
                    kind.to_string(),
                    json!({"in_use": in_use, "capacity": capacity}),
                )
            })
            .collect();
        let live = &snap.live;
        let oldest_kept = live
            .decisions
            .front()
            .map_or(live.decisions_made + 1, |d| d.0);
        let decisions_missed = oldest_kept.saturating_sub(self.decisions_reported + 1);
        let decisions: Vec<Value> = live
            .decisions
            .iter()
            .filter(|(number, _)| *number > self.decisions_reported)
            .map(|(number, d)| {
                json!({
                    "number": number,
                    "at_s": round3(d.at_s),
                    "streams": d.streams,
                    "depth": d.depth,
                    "pacing_bits_per_s": d.pacing_bits_per_s,
                    "reason": d.reason,
                })
            })
            .collect();
        let mut out = json!({
            "schema": SCHEMA,
            "event": event,
            "t_s": round3(now.saturating_duration_since(self.start).as_secs_f64()),
            "bytes": snap.bytes,
            "bytes_skipped": snap.bytes_skipped,
            "total_bytes": total,
            "files": snap.files,
            "failed_files": snap.failed_files,
            "total_files": snap.total_files.max(snap.files + snap.failed_files),
            "bits_per_s": bits_per_s,
            "network_bits_per_s": network_bits_per_s,
            "eta_s": eta_s,
            "streams": (live.streams > 0).then_some(live.streams),
            "channels": channels,
            "pools": pools,
            "channel_wait_s": seconds(snap.channel_wait_us),
            "cpu": cpu_json(snap.cpu),
            "decisions": decisions,
        });
        if snap.fabric {
            out["fabric"] = json!({
                "credits": snap.fabric_credits,
                "credit_wait_s": seconds(snap.fabric_credit_wait_us),
            });
        }
        if let Some(peer) = &live.peer {
            // Only the pools the peer has: a fabric receiver has slots, not blocks.
            let mut pools = Map::new();
            for (kind, in_use, capacity) in [
                ("blocks", peer.pool_in_use, peer.pool_capacity),
                ("fabric_slots", peer.slots_in_use, peer.slots_capacity),
            ] {
                if capacity > 0 {
                    pools.insert(kind.into(), json!({"in_use": in_use, "capacity": capacity}));
                }
            }
            out["peer"] = json!({"cpu": cpu_json(peer.cpu), "pools": pools});
            if peer.slots_capacity > 0 {
                out["peer"]["fabric_credits"] = peer.fabric_credits.into();
            }
        }
        if decisions_missed > 0 {
            out["decisions_missed"] = decisions_missed.into();
        }
        if self.lines_dropped > 0 {
            out["lines_dropped"] = self.lines_dropped.into();
        }
        self.previous = Some(Previous {
            at: now,
            bytes: snap.bytes,
            channels: snap.channel_bytes.iter().copied().collect(),
            delivered: snap.live.delivered_bytes,
        });
        Line {
            value: out,
            last_decision: live.decisions_made,
        }
    }

    /// `line` was queued: its decisions are reported.
    pub fn sent(&mut self, line: &Line) {
        self.decisions_reported = self.decisions_reported.max(line.last_decision);
    }

    /// A line was dropped for a slow consumer.
    pub fn dropped(&mut self) {
        self.lines_dropped += 1;
    }
}

/// The sampler and writer of one `cp`.
pub struct ProgressJson {
    progress: Arc<Progress>,
    cpu_start: CpuTime,
    fabric: bool,
    stop: Option<SyncSender<()>>,
    sampler: Option<JoinHandle<LineBuilder>>,
    lines: SyncSender<String>,
    writer: JoinHandle<Result<(), std::io::Error>>,
    target: String,
}

impl ProgressJson {
    /// Starts writing to `target` (`-` for stdout; a file is created or truncated).
    pub fn start(
        target: &Path,
        progress: Arc<Progress>,
        fabric: bool,
    ) -> Result<ProgressJson, Error> {
        let start = Instant::now();
        let cpu_start = process_cpu();
        let (out, name): (Box<dyn Write + Send>, String) = if target == Path::new("-") {
            (Box::new(std::io::stdout()), "stdout".into())
        } else {
            let file = std::fs::File::create(target).map_err(|e| {
                Error::local(
                    "create --progress-json file",
                    target.display().to_string(),
                    e,
                )
            })?;
            (
                Box::new(std::io::BufWriter::new(file)),
                target.display().to_string(),
            )
        };
        let (lines, queued) = mpsc::sync_channel::<String>(QUEUE_LINES);
        let writer = std::thread::Builder::new()
            .name("wanxfer-progress-json".into())
            .spawn(move || write_lines(out, &queued))
            .map_err(|e| Error::local("start thread", "progress-json".to_string(), e))?;
        let (stop, stopped) = mpsc::sync_channel::<()>(1);
        let sampler = {
            let (progress, lines) = (progress.clone(), lines.clone());
            std::thread::Builder::new()
                .name("wanxfer-progress-sample".into())
                .spawn(move || {
                    let mut builder = LineBuilder::new(start);
                    let mut next = start + EVERY;
                    loop {
                        match stopped.recv_timeout(next.saturating_duration_since(Instant::now())) {
                            Err(RecvTimeoutError::Timeout) => {}
                            _ => return builder,
                        }
                        next += EVERY;
                        let now = Instant::now();
                        let line = builder.line(
                            now,
                            &Snapshot::take(&progress, cpu_start, fabric),
                            "progress",
                        );
                        match lines.try_send(line.value.to_string()) {
                            Ok(()) => builder.sent(&line),
                            Err(TrySendError::Full(_)) => builder.dropped(),
                            Err(TrySendError::Disconnected(_)) => return builder,
                        }
                    }
                })
                .map_err(|e| Error::local("start thread", "progress-json".to_string(), e))?
        };
        Ok(ProgressJson {
            progress,
            cpu_start,
            fabric,
            stop: Some(stop),
            sampler: Some(sampler),
            lines,
            writer,
            target: name,
        })
    }

    /// Writes the last line (`event: end`) and waits for the writer: with the report's
    /// totals, the same as `--json`'s, and the error if the transfer failed. Returns a
    /// note to show if lines could not be written.
    pub fn finish(mut self, report: Option<&Report>, error: Option<&Error>) -> Option<String> {
        drop(self.stop.take());
        let builder = self.sampler.take().and_then(|s| s.join().ok());
        let mut builder = builder.unwrap_or_else(|| LineBuilder::new(Instant::now()));
        let mut snap = Snapshot::take(&self.progress, self.cpu_start, self.fabric);
        if let Some(r) = report {
            snap.bytes = r.bytes;
            snap.bytes_skipped = r.bytes_skipped;
            snap.files = r.files;
            snap.failed_files = r.failed_files;
        }
        let mut line = builder.line(Instant::now(), &snap, "end").value;
        if let Some(r) = report {
            line["seconds"] = json!(round3(r.seconds));
            line["cpu"] = cpu_json(r.cpu);
            if r.peer_cpu != CpuTime::default() {
                line["peer_cpu"] = cpu_json(r.peer_cpu);
            }
        }
        if let Some(e) = error {
            line["error"] = crate::output::cause_chain(e).into();
            line["error_class"] = crate::output::class_name(e.class()).into();
        }
        // The transfer is over: waiting for the writer here holds nothing up.
        let _ = self.lines.send(line.to_string());
        drop(self.lines);
        match self.writer.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!(
                "--progress-json: writing to {} failed: {e}",
                self.target
            )),
            Err(_) => Some("--progress-json: the writer failed".into()),
        }
    }
}

/// Writes each line whole and flushed; after a failure it drains the queue without
/// writing, so that the sampler's queue never stays full.
fn write_lines(
    mut out: Box<dyn Write + Send>,
    lines: &mpsc::Receiver<String>,
) -> Result<(), std::io::Error> {
    let mut result = Ok(());
    for mut line in lines.iter() {
        if result.is_err() {
            continue;
        }
        line.push('\n');
        result = out.write_all(line.as_bytes()).and_then(|()| out.flush());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use wanxfer_engine::progress::{PeerStatus, LIVE_DECISIONS};
    use wanxfer_engine::session::steer::{ChannelReport, DecisionReport};

    fn decision(streams: u16) -> DecisionReport {
        DecisionReport {
            at_s: 1.0,
            streams,
            depth: 4,
            pacing_bits_per_s: None,
            reason: "probe".into(),
        }
    }

    #[test]
    fn a_line_has_rates_per_channel_and_its_schema() {
        let start = Instant::now();
        let mut b = LineBuilder::new(start);
        let mut snap = Snapshot {
            bytes: 1_000_000,
            total_bytes: 4_000_000,
            total_files: 1,
            channel_bytes: vec![(0, 600_000), (1, 400_000)],
            pools: vec![("blocks", 3, 8)],
            ..Snapshot::default()
        };
        snap.live.streams = 2;
        snap.live.channels = vec![ChannelReport {
            index: 1,
            rtt: Duration::from_micros(40_500),
            cwnd: 100,
            retransmits: 3,
            pacing_bits_per_s: 5_000,
            state: "up",
            ..ChannelReport::default()
        }];
        let first = b
            .line(start + Duration::from_secs(1), &snap, "progress")
            .value;
        assert_eq!(first["schema"], SCHEMA);
        assert_eq!(first["event"], "progress");
        assert_eq!(first["bits_per_s"], 8e6);
        assert_eq!(first["eta_s"], 3.0);
        assert_eq!(first["streams"], 2);
        assert_eq!(first["pools"]["blocks"]["capacity"], 8);
        let channels = first["channels"].as_array().unwrap();
        assert_eq!(channels.len(), 2);
        assert_eq!(channels[0]["index"], 0);
        assert_eq!(channels[0]["bits_per_s"], 4.8e6);
        assert_eq!(channels[1]["rtt_ms"], 40.5);
        assert_eq!(channels[1]["retransmits"], 3);
        assert!(first.get("peer").is_none() && first.get("fabric").is_none());
        assert!(
            first["network_bits_per_s"].is_null(),
            "no socket sampled yet"
        );
        // The next line's rates cover only the interval since this one.
        snap.bytes = 1_500_000;
        snap.channel_bytes = vec![(0, 600_000), (1, 900_000)];
        let second = b
            .line(start + Duration::from_secs(2), &snap, "progress")
            .value;
        assert_eq!(second["bits_per_s"], 4e6);
        assert_eq!(second["channels"][0]["bits_per_s"], 0.0);
        assert_eq!(second["channels"][1]["bits_per_s"], 4e6);
        assert_eq!(second["eta_s"], 5.0);
        assert!(
            second["network_bits_per_s"].is_null(),
            "a line whose start the sockets did not see has no network rate"
        );
        // The sockets' count, not the blocks handed to them: a block-sized step in
        // `bytes` does not show in the network rate.
        snap.live.delivered_bytes = Some(1_400_000);
        snap.bytes = 5_694_304;
        let third = b
            .line(start + Duration::from_secs(3), &snap, "progress")
            .value;
        assert!(third["network_bits_per_s"].is_null());
        snap.live.delivered_bytes = Some(1_900_000);
        let fourth = b
            .line(start + Duration::from_secs(4), &snap, "progress")
            .value;
        assert_eq!(fourth["network_bits_per_s"], 4e6);
        assert_eq!(fourth["bits_per_s"], 0.0);
    }

    #[test]
    fn decisions_are_reported_once_and_survive_a_dropped_line() {
        let start = Instant::now();
        let mut b = LineBuilder::new(start);
        let mut snap = Snapshot::default();
        snap.live.decisions_made = 2;
        snap.live.decisions = [(1, decision(2)), (2, decision(3))].into();
        let line = b.line(start, &snap, "progress");
        assert_eq!(line.value["decisions"].as_array().unwrap().len(), 2);
        b.sent(&line);
        // Dropped: its decision is still new for the next line.
        snap.live.decisions_made = 3;
        snap.live.decisions.push_back((3, decision(4)));
        let _dropped = b.line(start, &snap, "progress");
        b.dropped();
        let line = b.line(start, &snap, "progress");
        let decisions = line.value["decisions"].as_array().unwrap();
        assert_eq!(decisions.len(), 1);
        assert_eq!(decisions[0]["number"], 3);
        assert_eq!(decisions[0]["streams"], 4);
        assert_eq!(line.value["lines_dropped"], 1);
        assert!(line.value.get("decisions_missed").is_none());
        b.sent(&line);
        // More than the engine keeps came and went between two lines.
        let made = 3 + LIVE_DECISIONS as u64 + 5;
        snap.live.decisions = (made - LIVE_DECISIONS as u64 + 1..=made)
            .map(|n| (n, decision(2)))
            .collect();
        snap.live.decisions_made = made;
        let line = b.line(start, &snap, "progress");
        assert_eq!(line.value["decisions_missed"], 5);
        assert_eq!(
            line.value["decisions"].as_array().unwrap().len(),
            LIVE_DECISIONS
        );
    }

    #[test]
    fn peer_fabric_and_unknowns_are_shown_as_such() {
        let start = Instant::now();
        let mut b = LineBuilder::new(start);
        let mut snap = Snapshot {
            pools: vec![("blocks", 1, 4), ("fabric_slots", 2, 5)],
            fabric_credits: 3,
            fabric_credit_wait_us: 1_500_000,
            fabric: true,
            ..Snapshot::default()
        };
        snap.live.peer = Some(PeerStatus {
            cpu: CpuTime {
                user_us: 2_000_000,
                sys_us: 500_000,
            },
            pool_in_use: 7,
            pool_capacity: 16,
            ..PeerStatus::default()
        });
        let tcp = b.line(start, &Snapshot::default(), "progress").value;
        assert!(tcp.get("fabric").is_none(), "{tcp}");
        // At the very start nothing is known: no rate, no ETA, no streams.
        let line = b.line(start, &snap, "progress").value;
        assert!(line["bits_per_s"].is_null() && line["eta_s"].is_null());
        assert!(line["streams"].is_null());
        assert_eq!(line["fabric"]["credits"], 3);
        assert_eq!(line["fabric"]["credit_wait_s"], 1.5);
        assert_eq!(line["pools"]["fabric_slots"]["in_use"], 2);
        assert_eq!(line["peer"]["cpu"]["user_s"], 2.0);
        assert_eq!(line["peer"]["pools"]["blocks"]["in_use"], 7);
        // Every line is one line of JSON.
        let text = line.to_string();
        assert!(!text.contains('\n'));
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), line);
    }

    #[test]
    fn a_slow_consumer_never_blocks_the_sampler() {
        // The queue's bound is what the sampler meets: try_send fails, it does not wait.
        let (tx, rx) = mpsc::sync_channel::<String>(QUEUE_LINES);
        let mut b = LineBuilder::new(Instant::now());
        for _ in 0..QUEUE_LINES + 3 {
            let line = b.line(Instant::now(), &Snapshot::default(), "progress");
            match tx.try_send(line.value.to_string()) {
                Ok(()) => b.sent(&line),
                Err(_) => b.dropped(),
            }
        }
        assert_eq!(b.lines_dropped, 3);
        drop(tx);
        // The writer: what it gets, it writes whole, one line each.
        struct Shared(Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Arc::new(std::sync::Mutex::new(Vec::new()));
        write_lines(Box::new(Shared(buffer.clone())), &rx).unwrap();
        let text = String::from_utf8(buffer.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), QUEUE_LINES);
        for line in text.lines() {
            serde_json::from_str::<Value>(line).unwrap();
        }
    }
}
