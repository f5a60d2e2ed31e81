//! The client's measurements of its session and the tuner they feed.
//!
//! Why here and not in the driver: the driver moves events; this keeps what the session
//! learns about its path (`TCP_INFO` of every data socket and of the control connection,
//! sampled on a timer) and turns it into [`Measurement`]s for
//! [`wanxfer_session::tune::Tuner`], whose decisions the driver carries out (opening and
//! retiring channels, setting each socket's pacing rate). The session's own round trips
//! are the RTT: the control connection's smoothed and lowest RTT come from the kernel
//! timing the handshake and every message since, and on a sending side each data socket
//! times its own segments.
//!
//! Fabric channels have no socket of their own to sample (the provider's are out of
//! reach, and the TCP connection that bound each channel to the session carries nothing
//! after the join): they are counted by the blocks they completed, and what each one may
//! have in flight is known exactly, the slots its receiver grants. That window is the
//! point: a fabric stream moves at most slots × block per round trip, so on a long fat
//! path its count is what fills the bandwidth-delay product, and the tuner must see
//! those streams to add them (fed none, it took no reading and held 2 streams, 42 MB in
//! flight against a 100 MB product at 200 ms: `bench/runs/fabric-2026-11-24-pathd.md`).
//!
//! What it does not do: resize the block pools (fixed when the session is agreed), so the
//! depth the measured bandwidth-delay product needs is reported, with whether the memory
//! budget bounds it, rather than applied (more streams, each with its own slots, are how a
//! fabric session grows its window); and nothing on the server, which only accepts the
//! channels the client opens.

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use wanxfer_session::tune::{Decision, Measurement, TuneConfig, Tuner};

use crate::transport::tcp_info::{self, TcpInfo};

/// How often sockets are sampled and the tuner fed.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// Decisions `--json` reports, the latest last.
pub const REPORTED_DECISIONS: usize = 8;

/// Channels `--json` reports (a long transfer that keeps losing channels opens more).
pub const REPORTED_CHANNELS: usize = 64;

/// What the session chose and why, for `--json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TuneReport {
    /// The tuner chose the stream count (no `--streams`).
    pub auto_streams: bool,
    /// Streams at the end, and the most the session agreed to.
    pub streams: u16,
    pub max_streams: u16,
    /// Blocks per channel the session ran with (fixed at its start), what the measured
    /// bandwidth-delay product needed, and whether the memory budget held it below that.
    pub depth: u16,
    pub depth_needed: Option<u64>,
    pub depth_bounded: bool,
    /// The session's pacing rate, bits per second, if it was paced.
    pub pacing_bits_per_s: Option<u64>,
    /// Congestion control of this side's data sockets.
    pub congestion: Option<String>,
    /// Latest smoothed and lowest RTT seen, and the bandwidth-delay product measured.
    pub rtt: Option<Duration>,
    pub min_rtt: Option<Duration>,
    pub bdp_bytes: Option<u64>,
    /// Intervals the tuner measured.
    pub readings: u64,
    /// The most channels up at once while the session ran.
    pub peak_streams: u16,
    /// Fabric: the most payload bytes its channels could have had in flight at once
    /// (slots granted per channel × block size × channels up); `None` over TCP, whose
    /// windows the kernel sizes.
    pub peak_window_bytes: Option<u64>,
    pub decisions: Vec<DecisionReport>,
    pub channels: Vec<ChannelReport>,
}

/// One decision of the tuner.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionReport {
    /// Seconds since the session started.
    pub at_s: f64,
    pub streams: u16,
    pub depth: u16,
    pub pacing_bits_per_s: Option<u64>,
    pub reason: String,
}

/// One data channel as its socket saw it, at its last sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChannelReport {
    pub index: u16,
    /// Bytes the peer acknowledged (sending) or that arrived (receiving), TLS and
    /// headers included.
    pub bytes: u64,
    /// Over the time it was sampled.
    pub bits_per_s: f64,
    pub rtt: Duration,
    pub cwnd: u32,
    pub retransmits: u64,
    pub delivery_bits_per_s: u64,
    pub pacing_bits_per_s: u64,
    /// `up` at the end of the session, `closed` with it, `retiring` (the tuner let it go
    /// and it is sending what it had taken), `retired` once gone, or `lost` (failed while
    /// the session ran).
    pub state: &'static str,
}

#[derive(Debug, Clone, Copy)]
struct Channel {
    first: Instant,
    first_bytes: u64,
    last: Instant,
    info: TcpInfo,
    state: &'static str,
}

impl Channel {
    /// Its socket is still open and sampled.
    fn live(&self) -> bool {
        matches!(self.state, "up" | "retiring")
    }
}

/// The session's measurements and its tuner.
pub struct Steer {
    tuner: Tuner,
    start: Instant,
    next_sample: Instant,
    sending: bool,
    /// Counters of sockets that closed, so that the session's sums never go back.
    ended_segments: u64,
    ended_retransmits: u64,
    ended_carried: u64,
    /// Bytes the sockets of channels no longer listed in `channels` moved.
    pruned_bytes: u64,
    channels: BTreeMap<u16, Channel>,
    /// What the data sockets delivered in all at the last sample (see [`Steer::delivered`]).
    delivered: Option<u64>,
    congestion: Option<String>,
    control_rtt: Option<Duration>,
    min_rtt: Option<Duration>,
    max_streams: u16,
    depth: u16,
    auto_streams: bool,
    peak_streams: u16,
    peak_window_bytes: Option<u64>,
}

/// A channel as the driver sees it when sampling.
pub struct Sampled<'a> {
    pub index: u16,
    pub socket: &'a TcpStream,
    /// Retired by the tuner and still sending what it had taken: its bytes and losses
    /// are the session's, but it is not one of the streams the tuner is measuring.
    pub retiring: bool,
}

/// What the session counted itself, beside what its sockets say.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counted {
    /// Payload bytes of the blocks moved.
    pub bytes: u64,
    /// Microseconds sending channels waited for a block to send (see
    /// [`Measurement::waited_us`]).
    pub waited_us: u64,
    /// Channels whose bytes no socket of ours sees (fabric), up and not retiring: the
    /// session's blocks are then its only count. `None` over TCP, where the sockets
    /// sampled are the channels.
    pub block_counted_streams: Option<u16>,
    /// Payload bytes one such channel may have in flight: the slots its receiver grants
    /// times the block size.
    pub window_per_stream: Option<u64>,
    /// Sending: every block is in some channel's hands (`SenderMachine::in_tail`). The
    /// reading is kept for the reports but not judged: a decision now would open
    /// channels with nothing to carry (three opened at the tail of a 128 MiB push on a
    /// lossy 50 ms path carried 385 bytes each), and the channels cut at the tail would
    /// read as ones the server refused.
    pub tail: bool,
}

impl Steer {
    pub fn new(cfg: TuneConfig, sending: bool, congestion: Option<String>) -> Steer {
        let now = Instant::now();
        let (max_streams, depth, auto_streams) =
            (cfg.max_streams, cfg.max_depth, !cfg.fixed_streams);
        Steer {
            tuner: Tuner::new(cfg),
            start: now,
            next_sample: now + SAMPLE_EVERY,
            sending,
            ended_segments: 0,
            ended_retransmits: 0,
            ended_carried: 0,
            pruned_bytes: 0,
            channels: BTreeMap::new(),
            delivered: None,
            congestion,
            control_rtt: None,
            min_rtt: None,
            max_streams,
            depth,
            auto_streams,
            peak_streams: 0,
            peak_window_bytes: None,
        }
    }

    /// When the next sample is due.
    pub fn due(&self) -> Instant {
        self.next_sample
    }

    /// The smallest round trip the sockets have seen.
    pub fn min_rtt(&self) -> Option<Duration> {
        self.min_rtt
    }

    /// Streams the tuner wants now.
    pub fn wanted(&self) -> u16 {
        self.tuner.current().streams
    }

    /// The session's pacing rate per channel among `streams`, bytes per second.
    pub fn pacing_per_channel(&self, streams: usize) -> Option<u64> {
        let total = self.tuner.current().pacing_bits_per_s?;
        Some((total / 8 / streams.max(1) as u64).max(1))
    }

    /// Samples the control connection and `channels` (those up, retiring ones included),
    /// feeds the tuner, and returns its decisions.
    ///
    /// Why retiring channels are sampled: a retired TCP stream still delivers what its
    /// socket held (up to its unsent limit, and its window in flight), at its share of
    /// the path. Left out, those bytes never counted: each retirement showed as a dip in
    /// goodput the path did not have, in progress lines and in the reading that judged
    /// the count the tuner had just chosen.
    pub fn sample<'a>(
        &mut self,
        now: Instant,
        counted: Counted,
        control: &TcpStream,
        channels: impl Iterator<Item = Sampled<'a>>,
    ) -> Vec<Decision> {
        self.next_sample = now + SAMPLE_EVERY;
        if let Ok(info) = tcp_info::sample(control) {
            if !info.rtt.is_zero() {
                self.control_rtt = Some(info.rtt);
            }
            self.note_min_rtt(info.min_rtt);
        }
        let (mut streams, mut segments, mut retransmits, mut carried) = (0u16, 0u64, 0u64, 0u64);
        let mut rtt_sum = Duration::ZERO;
        let mut rtt_count = 0u32;
        for c in channels {
            let Ok(info) = tcp_info::sample(c.socket) else {
                continue;
            };
            segments += info.segments_out;
            retransmits += info.total_retransmits;
            carried += carried_bytes(&info);
            self.note_min_rtt(info.min_rtt);
            if !c.retiring {
                streams += 1;
                if self.sending && !info.rtt.is_zero() {
                    rtt_sum += info.rtt;
                    rtt_count += 1;
                }
            }
            let moved = self.moved(&info);
            let entry = self.channels.entry(c.index).or_insert(Channel {
                first: now,
                first_bytes: moved,
                last: now,
                info,
                state: "up",
            });
            entry.last = now;
            entry.info = info;
            if c.retiring && entry.state == "up" {
                entry.state = "retiring";
            }
        }
        while self.channels.len() > REPORTED_CHANNELS {
            // The oldest ended channel goes first.
            let Some(index) = self
                .channels
                .iter()
                .find(|(_, c)| !c.live())
                .map(|(i, _)| *i)
            else {
                break;
            };
            if let Some(c) = self.channels.remove(&index) {
                self.pruned_bytes += self.moved(&c.info);
            }
        }
        let rtt = if rtt_count > 0 {
            Some(rtt_sum / rtt_count)
        } else {
            self.control_rtt
        };
        let mut window_bytes = None;
        if let Some(n) = counted.block_counted_streams {
            streams = n;
            window_bytes = counted
                .window_per_stream
                .map(|w| w.saturating_mul(u64::from(n)));
            self.peak_window_bytes = window_bytes.max(self.peak_window_bytes);
        }
        self.peak_streams = self.peak_streams.max(streams);
        // What the sockets say was delivered (acknowledged, or received), not the blocks
        // the session counted: a block is 4 MiB, a few percent of what a 1 Gbit/s path
        // carries in a half-second reading, enough to fake a peak or a dip. Fabric has
        // only its blocks: its readings are longer than a long path's round trips make
        // them anyway (a 200 ms path's spans hold dozens of blocks).
        let bytes = if self.channels.is_empty() || counted.block_counted_streams.is_some() {
            counted.bytes
        } else {
            self.pruned_bytes
                + self
                    .channels
                    .values()
                    .map(|c| self.moved(&c.info))
                    .sum::<u64>()
        };
        if !self.channels.is_empty() && counted.block_counted_streams.is_none() {
            self.delivered = Some(bytes);
        }
        let m = Measurement {
            at: now.duration_since(self.start),
            bytes,
            streams,
            rtt,
            min_rtt: self.min_rtt,
            segments_sent: self.ended_segments + if self.sending { segments } else { 0 },
            segments_retransmitted: self.ended_retransmits
                + if self.sending { retransmits } else { 0 },
            bytes_carried: self.ended_carried + if self.sending { carried } else { 0 },
            waited_us: counted.waited_us,
            window_bytes,
        };
        if counted.tail {
            return Vec::new();
        }
        self.tuner.handle_measurement(m);
        std::iter::from_fn(|| self.tuner.poll_decision()).collect()
    }

    /// Bytes the data sockets delivered so far (acknowledged by the peer when sending,
    /// arrived when receiving; TLS and headers included), as of the last sample; `None`
    /// before one. The session's own count moves a whole block at a time, as each is
    /// handed to a socket: at 500 Mbit/s a 4 MiB block is 7% of a second, and a socket
    /// buffer of several blocks takes them in bursts, so one second's count swings
    /// while the path's rate does not.
    pub fn delivered(&self) -> Option<u64> {
        self.delivered
    }

    /// A channel ended (`retired` by the tuner, `lost`, or `closed` with the session):
    /// its counters stay in the session's sums.
    pub fn ended(&mut self, index: u16, state: &'static str) {
        if let Some(c) = self.channels.get_mut(&index) {
            if c.live() {
                c.state = state;
                if self.sending {
                    self.ended_segments += c.info.segments_out;
                    self.ended_retransmits += c.info.total_retransmits;
                    self.ended_carried += carried_bytes(&c.info);
                }
            }
        }
    }

    fn note_min_rtt(&mut self, rtt: Duration) {
        if !rtt.is_zero() {
            self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
        }
    }

    fn moved(&self, info: &TcpInfo) -> u64 {
        if self.sending {
            info.bytes_acked
        } else {
            info.bytes_received
        }
    }

    /// What was chosen and why, and what each channel saw.
    pub fn report(&self) -> TuneReport {
        let current = self.tuner.current();
        let (depth_needed, depth_bounded) = match self.tuner.depth_needed() {
            Some((needed, bounded)) => (Some(needed), bounded),
            None => (None, false),
        };
        let history: Vec<&Decision> = self.tuner.history().collect();
        let decisions = history[history.len().saturating_sub(REPORTED_DECISIONS)..]
            .iter()
            .map(|d| DecisionReport::from(*d))
            .collect();
        TuneReport {
            auto_streams: self.auto_streams,
            streams: current.streams,
            max_streams: self.max_streams,
            depth: self.depth,
            depth_needed,
            depth_bounded,
            pacing_bits_per_s: current.pacing_bits_per_s,
            congestion: self.congestion.clone(),
            rtt: self.control_rtt,
            min_rtt: self.min_rtt,
            bdp_bytes: self.tuner.measured_bdp(),
            readings: self.tuner.readings(),
            peak_streams: self.peak_streams,
            peak_window_bytes: self.peak_window_bytes,
            decisions,
            channels: self.channel_reports(),
        }
    }

    /// Each data channel as its socket last saw it.
    pub fn channel_reports(&self) -> Vec<ChannelReport> {
        self.channels
            .iter()
            .map(|(index, c)| {
                let bytes = self.moved(&c.info);
                let seconds = c.last.duration_since(c.first).as_secs_f64();
                ChannelReport {
                    index: *index,
                    bytes,
                    bits_per_s: if seconds > 0.0 {
                        bytes.saturating_sub(c.first_bytes) as f64 * 8.0 / seconds
                    } else {
                        0.0
                    },
                    rtt: if self.sending {
                        c.info.rtt
                    } else {
                        c.info.rcv_rtt
                    },
                    cwnd: c.info.cwnd,
                    retransmits: c.info.total_retransmits,
                    delivery_bits_per_s: c.info.delivery_rate.saturating_mul(8),
                    pacing_bits_per_s: if c.info.pacing_rate == u64::MAX {
                        0
                    } else {
                        c.info.pacing_rate.saturating_mul(8)
                    },
                    state: c.state,
                }
            })
            .collect()
    }
}

impl From<&Decision> for DecisionReport {
    fn from(d: &Decision) -> DecisionReport {
        DecisionReport {
            at_s: d.at.as_secs_f64(),
            streams: d.streams,
            depth: d.depth,
            pacing_bits_per_s: d.pacing_bits_per_s,
            reason: d.reason.to_string(),
        }
    }
}

/// Payload bytes a socket's segments carried across the path (acknowledged or
/// selectively acknowledged, retransmissions included), at its segment size.
fn carried_bytes(info: &TcpInfo) -> u64 {
    info.delivered.saturating_mul(u64::from(info.mss))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn config() -> TuneConfig {
        TuneConfig {
            start_streams: 2,
            min_streams: 1,
            max_streams: 16,
            fixed_streams: false,
            block_size: 4 << 20,
            max_depth: 4,
            rate_bits_per_s: None,
            seed: 7,
            may_pace: false,
            loss_blind: false,
        }
    }

    /// Feeds `steer` 300 readings of fabric channels on a path where each stream moves
    /// its window (5 slots of 4 MiB) per 200 ms round trip, up to 4 Gbit/s.
    fn fabric_readings(steer: &mut Steer, window: u64, tail: bool) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let control = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let start = Instant::now();
        let mut bytes = 0u64;
        let mut streams = steer.wanted();
        for tick in 1..=300u32 {
            let goodput = (f64::from(streams) * window as f64 * 8.0 / 0.2).min(4e9);
            bytes += (goodput * SAMPLE_EVERY.as_secs_f64() / 8.0) as u64;
            let counted = Counted {
                bytes,
                waited_us: 0,
                block_counted_streams: Some(streams),
                window_per_stream: Some(window),
                tail,
            };
            let now = start + SAMPLE_EVERY * tick;
            for d in steer.sample(now, counted, &control, std::iter::empty()) {
                streams = d.streams;
            }
        }
    }

    /// Issue 19, path (d): fabric channels have no socket to sample, so the tuner was fed
    /// 0 streams against the 2 it asked for, took no reading and never added one. Fed
    /// the channels counted by their blocks, on a path where each stream moves its window
    /// (5 slots of 4 MiB) per 200 ms round trip up to 4 Gbit/s, it adds streams until the
    /// window covers the path, and reports the window it reached.
    #[test]
    fn fabric_streams_counted_by_blocks_are_tuned() {
        let mut steer = Steer::new(config(), true, None);
        let window = 5 * (4u64 << 20);
        fabric_readings(&mut steer, window, false);
        let report = steer.report();
        assert!(report.readings > 0, "{report:?}");
        assert!(
            report.peak_streams >= 5,
            "4 Gbit/s x 200 ms needs 5 windows of 21 MB: {report:?}"
        );
        assert!(report.streams > 2, "{report:?}");
        assert_eq!(
            report.peak_window_bytes,
            Some(window * u64::from(report.peak_streams))
        );
        assert!(report.channels.is_empty(), "no socket was sampled");
    }

    /// Once every block is in a channel's hands, readings are not judged: the same path
    /// that had the tuner add streams above leaves it where it started.
    #[test]
    fn readings_at_the_tail_decide_nothing() {
        let mut steer = Steer::new(config(), true, None);
        fabric_readings(&mut steer, 5 * (4u64 << 20), true);
        let report = steer.report();
        assert_eq!(report.readings, 0, "{report:?}");
        assert_eq!(report.streams, 2, "{report:?}");
        assert_eq!(report.decisions.len(), 1, "only the start: {report:?}");
    }

    fn sampled(senders: &[TcpStream], retiring: bool) -> Vec<Sampled<'_>> {
        vec![
            Sampled {
                index: 0,
                socket: &senders[0],
                retiring: false,
            },
            Sampled {
                index: 1,
                socket: &senders[1],
                retiring,
            },
        ]
    }

    /// Writes 1 MiB on `sender` and reads it all on `peer`.
    fn move_chunk(sender: &mut TcpStream, peer: &mut TcpStream) {
        use std::io::{Read, Write};
        let mut chunk = vec![7u8; 1 << 20];
        sender.write_all(&chunk).unwrap();
        peer.read_exact(&mut chunk).unwrap();
    }

    /// Waits (bounded) until the peer has acknowledged everything `socket` sent.
    fn acknowledged(socket: &TcpStream, sent: u64) {
        for _ in 0..5000 {
            // `bytes_acked` counts the SYN as well.
            if tcp_info::sample(socket).unwrap().bytes_acked > sent {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("loopback did not acknowledge {sent} bytes in 5 s");
    }

    /// A retired stream keeps sending what its socket held. Those bytes were left out of
    /// what the session delivered (the driver stopped sampling a channel once it
    /// retired), which showed every retirement as a dip the path did not have.
    #[test]
    fn a_retiring_channel_still_counts_what_it_delivers() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let control = TcpStream::connect(addr).unwrap();
        let _control_peer = listener.accept().unwrap();
        let mut senders = Vec::new();
        let mut peers = Vec::new();
        for _ in 0..2 {
            senders.push(TcpStream::connect(addr).unwrap());
            peers.push(listener.accept().unwrap().0);
        }
        let mut steer = Steer::new(config(), true, None);
        let start = Instant::now();
        move_chunk(&mut senders[0], &mut peers[0]);
        move_chunk(&mut senders[1], &mut peers[1]);
        acknowledged(&senders[0], 1 << 20);
        acknowledged(&senders[1], 1 << 20);
        let counted = Counted::default();
        let _ = steer.sample(
            start,
            counted,
            &control,
            sampled(&senders, false).into_iter(),
        );
        let before = steer.delivered().unwrap();
        assert!(before >= 2 << 20, "{before}");

        // Channel 1 is retired, and sends what it had taken.
        move_chunk(&mut senders[1], &mut peers[1]);
        acknowledged(&senders[1], 2 << 20);
        let now = start + SAMPLE_EVERY;
        let _ = steer.sample(now, counted, &control, sampled(&senders, true).into_iter());
        let after = steer.delivered().unwrap();
        assert!(after >= before + (1 << 20), "{before} then {after}");
        let states: Vec<_> = steer.report().channels.iter().map(|c| c.state).collect();
        assert_eq!(states, ["up", "retiring"]);
        assert_eq!(steer.report().peak_streams, 2);

        // Gone: what it delivered stays in the session's sum.
        steer.ended(1, "retired");
        let one = sampled(&senders, false).into_iter().take(1);
        let _ = steer.sample(now + SAMPLE_EVERY, counted, &control, one);
        assert!(steer.delivered().unwrap() >= after);
        let states: Vec<_> = steer.report().channels.iter().map(|c| c.state).collect();
        assert_eq!(states, ["up", "retired"]);
    }
}
