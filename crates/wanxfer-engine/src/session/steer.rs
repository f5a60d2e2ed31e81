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
//! What it does not do: resize the block pools (fixed when the session is agreed), so the
//! depth the measured bandwidth-delay product needs is reported, with whether the memory
//! budget bounds it, rather than applied; and nothing on the server, which only accepts
//! the channels the client opens.

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
    /// `up` at the end of the session, `closed` with it, `retired` by the tuner, or
    /// `lost` (failed while the session ran).
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

/// The session's measurements and its tuner.
pub struct Steer {
    tuner: Tuner,
    start: Instant,
    next_sample: Instant,
    sending: bool,
    /// Counters of sockets that closed, so that the session's sums never go back.
    ended_segments: u64,
    ended_retransmits: u64,
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
}

/// A channel as the driver sees it when sampling.
pub struct Sampled<'a> {
    pub index: u16,
    pub socket: &'a TcpStream,
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
            pruned_bytes: 0,
            channels: BTreeMap::new(),
            delivered: None,
            congestion,
            control_rtt: None,
            min_rtt: None,
            max_streams,
            depth,
            auto_streams,
        }
    }

    /// When the next sample is due.
    pub fn due(&self) -> Instant {
        self.next_sample
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

    /// Samples the control connection and `channels` (those up and not retiring), feeds
    /// the tuner, and returns its decisions.
    pub fn sample<'a>(
        &mut self,
        now: Instant,
        bytes: u64,
        waited_us: u64,
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
        let (mut streams, mut segments, mut retransmits) = (0u16, 0u64, 0u64);
        let mut rtt_sum = Duration::ZERO;
        let mut rtt_count = 0u32;
        for c in channels {
            let Ok(info) = tcp_info::sample(c.socket) else {
                continue;
            };
            streams += 1;
            segments += info.segments_out;
            retransmits += info.total_retransmits;
            if self.sending && !info.rtt.is_zero() {
                rtt_sum += info.rtt;
                rtt_count += 1;
            }
            self.note_min_rtt(info.min_rtt);
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
        }
        while self.channels.len() > REPORTED_CHANNELS {
            // The oldest ended channel goes first.
            let Some(index) = self
                .channels
                .iter()
                .find(|(_, c)| c.state != "up")
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
        // What the sockets say was delivered (acknowledged, or received), not the blocks
        // the session counted: a block is 4 MiB, a few percent of what a 1 Gbit/s path
        // carries in a half-second reading, enough to fake a peak or a dip.
        let bytes = if self.channels.is_empty() {
            bytes
        } else {
            self.pruned_bytes
                + self
                    .channels
                    .values()
                    .map(|c| self.moved(&c.info))
                    .sum::<u64>()
        };
        if !self.channels.is_empty() {
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
            waited_us,
        };
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
            if c.state == "up" {
                c.state = state;
                if self.sending {
                    self.ended_segments += c.info.segments_out;
                    self.ended_retransmits += c.info.total_retransmits;
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
