//! The link model, pure and clocked from outside so that it can be tested without a
//! network: what happens to one packet entering one direction of the link.
//!
//! Order of events for a packet (as a real path would treat it): a cut or blackhole
//! drops it; random loss drops it; corruption flips a payload byte (fixing the TCP
//! checksum, so that only an end-to-end check can notice); it joins the bottleneck queue,
//! dropped at the tail if the queue's bytes would exceed the buffer; it leaves the queue
//! at the bottleneck rate; it arrives `delay ± jitter` later, later still if picked for
//! reordering; a duplicate may follow it.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::packet;

/// One direction's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkConfig {
    /// One-way propagation delay.
    pub delay: Duration,
    /// Uniform jitter added to the delay, in `[0, jitter)`.
    pub jitter: Duration,
    /// Bottleneck rate in bits per second; 0 means unlimited.
    pub rate_bps: u64,
    /// Later rates: from each time (since the emulator started) the bottleneck runs at
    /// its rate instead, in time order (a path whose capacity drops and recovers, which
    /// a tuner must follow).
    pub rate_steps: Vec<(Duration, u64)>,
    /// Bottleneck buffer in bytes (drop-tail beyond it).
    pub buffer: u64,
    /// Probability that a packet is lost.
    pub loss: f64,
    /// Probability that a packet is held back by `reorder_gap` (and so overtaken).
    pub reorder: f64,
    pub reorder_gap: Duration,
    /// Probability that a packet is delivered twice.
    pub duplicate: f64,
    /// Probability that a TCP packet with payload gets one payload byte flipped, its
    /// checksum fixed up.
    pub corrupt: f64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            rate_bps: 0,
            rate_steps: Vec::new(),
            buffer: 1 << 20,
            loss: 0.0,
            reorder: 0.0,
            reorder_gap: Duration::from_millis(1),
            duplicate: 0.0,
            corrupt: 0.0,
        }
    }
}

/// What happened in one direction, for the report.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Counters {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    pub dropped_loss: u64,
    pub dropped_queue: u64,
    pub dropped_cut: u64,
    pub corrupted: u64,
    pub duplicated: u64,
    pub reordered: u64,
    /// Segments the far side's TUN refused to take (an unmodelled loss: a valid
    /// measurement has none).
    pub dropped_write: u64,
    /// GSO batches (several segments in one frame) read from the TUN.
    pub gso_batches: u64,
    /// Batches split because a segment was dropped, corrupted, reordered or duplicated.
    pub gso_split: u64,
    /// Most bytes the bottleneck queue held.
    pub queue_high_water: u64,
}

/// A packet's fate: delivered at these times (nanoseconds of the emulator's clock), once
/// or twice, or not at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    Dropped,
    Deliver(Vec<u64>),
}

/// What becomes of one segment; `Deliver` with nothing set is the common case in which
/// a GSO batch stays whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Dropped,
    Deliver {
        /// When it reaches the far side (ns of the emulator's clock).
        at: u64,
        /// Deliver a second copy just after.
        duplicate: bool,
        /// Flip a payload byte chosen by this number.
        corrupt: Option<u64>,
        /// Held back by the reorder gap.
        reordered: bool,
    },
}

impl Decision {
    /// Delivered unchanged, once, in order.
    pub fn is_plain(&self) -> bool {
        matches!(
            self,
            Decision::Deliver {
                duplicate: false,
                corrupt: None,
                reordered: false,
                ..
            }
        )
    }
}

/// One direction of the link.
pub struct Link {
    cfg: LinkConfig,
    rng: ChaCha8Rng,
    /// When the bottleneck finishes sending what is queued (ns).
    busy_until: u64,
    pub counters: Counters,
}

impl Link {
    pub fn new(cfg: LinkConfig, seed: u64) -> Link {
        Link {
            cfg,
            rng: ChaCha8Rng::seed_from_u64(seed),
            busy_until: 0,
            counters: Counters::default(),
        }
    }

    /// Decides what happens to `packet` arriving at `now` (ns); may corrupt it in place.
    /// `cut` says the link is down at this moment.
    pub fn admit(&mut self, packet: &mut [u8], now: u64, cut: bool) -> Fate {
        match self.decide(packet.len(), now, cut) {
            Decision::Dropped => Fate::Dropped,
            Decision::Deliver {
                at,
                duplicate,
                corrupt,
                ..
            } => {
                if let Some(pick) = corrupt {
                    self.corrupt(packet, pick);
                }
                let mut times = vec![at];
                if duplicate {
                    times.push(at + 1);
                }
                Fate::Deliver(times)
            }
        }
    }

    /// Decides what happens to one segment of `len` wire bytes arriving at `now` (ns),
    /// without touching it (the forwarder asks for each segment of a GSO batch, and
    /// splits the batch only if one of them is not simply delivered).
    pub fn decide(&mut self, len: usize, now: u64, cut: bool) -> Decision {
        let len = len as u64;
        self.counters.packets_in += 1;
        self.counters.bytes_in += len;
        if cut {
            self.counters.dropped_cut += 1;
            return Decision::Dropped;
        }
        if self.chance(self.cfg.loss) {
            self.counters.dropped_loss += 1;
            return Decision::Dropped;
        }
        let corrupt = self
            .chance(self.cfg.corrupt)
            .then(|| self.rng.random::<u64>());
        let Some(departure) = self.enqueue(len, now) else {
            self.counters.dropped_queue += 1;
            return Decision::Dropped;
        };
        let mut at = departure + self.cfg.delay.as_nanos() as u64 + self.jitter();
        let reordered = self.chance(self.cfg.reorder);
        if reordered {
            at += self.cfg.reorder_gap.as_nanos() as u64;
            self.counters.reordered += 1;
        }
        let duplicate = self.chance(self.cfg.duplicate);
        if duplicate {
            self.counters.duplicated += 1;
        }
        Decision::Deliver {
            at,
            duplicate,
            corrupt,
            reordered,
        }
    }

    /// Applies a corruption decision to a segment; counts it if it took (TCP with payload).
    pub fn corrupt(&mut self, packet: &mut [u8], pick: u64) {
        if packet::corrupt_tcp_payload(packet, pick) {
            self.counters.corrupted += 1;
        }
    }

    /// Counts a delivery of `segments` segments, `bytes` on the wire (the caller wrote
    /// them to the far side).
    pub fn delivered(&mut self, segments: u64, bytes: u64) {
        self.counters.packets_out += segments;
        self.counters.bytes_out += bytes;
    }

    /// Puts `len` bytes in the bottleneck queue at `now`; `None` if the buffer is full.
    /// Returns when the last byte leaves the bottleneck.
    fn enqueue(&mut self, len: u64, now: u64) -> Option<u64> {
        let rate = self.rate_at(now);
        if rate == 0 {
            return Some(now);
        }
        let backlog_ns = self.busy_until.saturating_sub(now);
        let backlog = (u128::from(backlog_ns) * u128::from(rate) / 8 / 1_000_000_000) as u64;
        if backlog + len > self.cfg.buffer {
            return None;
        }
        self.counters.queue_high_water = self.counters.queue_high_water.max(backlog + len);
        let serialize = (u128::from(len) * 8 * 1_000_000_000 / u128::from(rate)) as u64;
        self.busy_until = self.busy_until.max(now) + serialize;
        Some(self.busy_until)
    }

    /// The bottleneck's rate at `now` (ns since the start).
    fn rate_at(&self, now: u64) -> u64 {
        self.cfg
            .rate_steps
            .iter()
            .take_while(|(from, _)| from.as_nanos() as u64 <= now)
            .last()
            .map_or(self.cfg.rate_bps, |(_, rate)| *rate)
    }

    fn jitter(&mut self) -> u64 {
        let jitter = self.cfg.jitter.as_nanos() as u64;
        if jitter == 0 {
            0
        } else {
            self.rng.random_range(0..jitter)
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.random_bool(p.min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivered_at(fate: Fate) -> u64 {
        match fate {
            Fate::Deliver(t) => t[0],
            Fate::Dropped => panic!("dropped"),
        }
    }

    #[test]
    fn the_rate_follows_its_steps() {
        let link = Link::new(
            LinkConfig {
                rate_bps: 8_000_000,
                rate_steps: vec![
                    (Duration::from_secs(10), 2_000_000),
                    (Duration::from_secs(20), 8_000_000),
                ],
                ..LinkConfig::default()
            },
            1,
        );
        let s = 1_000_000_000u64;
        assert_eq!(link.rate_at(0), 8_000_000);
        assert_eq!(link.rate_at(10 * s), 2_000_000);
        assert_eq!(link.rate_at(15 * s), 2_000_000);
        assert_eq!(link.rate_at(25 * s), 8_000_000);
    }

    #[test]
    fn packets_leave_at_the_bottleneck_rate_after_the_delay() {
        let mut link = Link::new(
            LinkConfig {
                delay: Duration::from_millis(10),
                rate_bps: 8_000_000, // one byte per microsecond
                buffer: 1 << 20,
                ..LinkConfig::default()
            },
            1,
        );
        let mut p = vec![0u8; 1000];
        assert_eq!(
            delivered_at(link.admit(&mut p, 0, false)),
            1_000_000 + 10_000_000
        );
        // Back to back: queued behind the first.
        assert_eq!(
            delivered_at(link.admit(&mut p, 0, false)),
            2_000_000 + 10_000_000
        );
        // After the queue drained: only its own serialization.
        assert_eq!(
            delivered_at(link.admit(&mut p, 50_000_000, false)),
            51_000_000 + 10_000_000
        );
    }

    #[test]
    fn the_buffer_drops_at_the_tail_and_records_its_high_water() {
        let mut link = Link::new(
            LinkConfig {
                rate_bps: 8_000_000,
                buffer: 3000,
                ..LinkConfig::default()
            },
            1,
        );
        let mut p = vec![0u8; 1000];
        let fates: Vec<_> = (0..5).map(|_| link.admit(&mut p, 0, false)).collect();
        assert_eq!(fates.iter().filter(|f| **f == Fate::Dropped).count(), 2);
        assert_eq!(link.counters.dropped_queue, 2);
        assert_eq!(link.counters.queue_high_water, 3000);
    }

    #[test]
    fn loss_follows_its_probability_and_the_seed_reproduces_it() {
        let run = |seed| {
            let mut link = Link::new(
                LinkConfig {
                    loss: 0.01,
                    ..LinkConfig::default()
                },
                seed,
            );
            let mut p = vec![0u8; 100];
            (0..200_000)
                .map(|i| link.admit(&mut p, i, false) == Fate::Dropped)
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7), "same seed, same losses");
        let lost = a.iter().filter(|d| **d).count() as f64 / a.len() as f64;
        assert!((lost - 0.01).abs() < 0.001, "loss rate {lost}");
    }

    #[test]
    fn cuts_drop_everything_and_say_so() {
        let mut link = Link::new(LinkConfig::default(), 1);
        let mut p = vec![0u8; 100];
        assert_eq!(link.admit(&mut p, 0, true), Fate::Dropped);
        assert_eq!(link.counters.dropped_cut, 1);
    }

    #[test]
    fn reordered_packets_are_overtaken_and_duplicates_follow() {
        let mut link = Link::new(
            LinkConfig {
                delay: Duration::from_millis(1),
                reorder: 1.0,
                reorder_gap: Duration::from_millis(5),
                duplicate: 1.0,
                ..LinkConfig::default()
            },
            3,
        );
        let mut p = vec![0u8; 100];
        let Fate::Deliver(times) = link.admit(&mut p, 0, false) else {
            panic!("dropped")
        };
        assert_eq!(times, vec![6_000_000, 6_000_001]);
        assert_eq!((link.counters.reordered, link.counters.duplicated), (1, 1));
    }
}
