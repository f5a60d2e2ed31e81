//! The controller against modelled paths, on simulated time: no sockets, no clocks.
//!
//! A path here is a bottleneck of some capacity shared by every stream crossing it, each
//! stream at most `per_stream` (what its window or its loss allows it), and a loss rate
//! that grows with the number of streams once their demand exceeds the capacity (more
//! flows overrun a drop-tail queue more often). Goodput readings carry a few percent of
//! seeded noise, as real intervals do.

use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const RTT: Duration = Duration::from_millis(100);
const TICK: Duration = Duration::from_millis(200);
const G: f64 = 1e9;
const M: f64 = 1e6;

#[derive(Debug, Clone, Copy)]
struct Path {
    capacity: f64,
    per_stream: f64,
    /// Loss per stream sharing the bottleneck, once it is overrun.
    loss_per_stream: f64,
    /// Loss once more than this many streams share it, whatever the capacity (a
    /// policer's shallow buffer), and the fraction of its share each keeps then.
    burst_loss: Option<(u16, f64, f64)>,
    /// A policer (or a queue too shallow for a window's bursts): unpaced streams that
    /// fill it lose this fraction of segments and deliver this fraction of the
    /// capacity; streams paced below it lose nothing.
    shallow: Option<(f64, f64)>,
    /// The queue holds a bandwidth-delay product: full, it doubles the round trip.
    deep: bool,
}

impl Path {
    fn window_limited(capacity: f64, per_stream: f64) -> Path {
        Path {
            capacity,
            per_stream,
            loss_per_stream: 0.001,
            burst_loss: None,
            shallow: None,
            deep: false,
        }
    }

    /// A policer (or a queue too shallow for a window's bursts) at `capacity`: unpaced,
    /// one stream or many lose 4% of their segments and deliver 85% of its rate.
    fn policer(capacity: f64, per_stream: f64) -> Path {
        Path {
            capacity,
            per_stream,
            loss_per_stream: 0.0,
            burst_loss: None,
            shallow: Some((0.04, 0.85)),
            deep: false,
        }
    }

    /// Whether the transfers would send more than the capacity, paced ones at their
    /// pacing: then the queue fills, and drops whoever's packets arrive.
    fn full(&self, transfers: &[(u16, Option<u64>)]) -> bool {
        let demand: f64 = transfers
            .iter()
            .map(|&(n, pacing)| {
                let unpaced = f64::from(n) * self.per_stream;
                pacing.map_or(unpaced, |p| unpaced.min(p as f64 / WIRE_OVERHEAD))
            })
            .sum();
        demand > self.capacity * 1.000_001
    }

    /// Goodput and loss of each transfer, given the streams each runs and its pacing
    /// rate (wire bits per second).
    fn share(&self, transfers: &[(u16, Option<u64>)]) -> Vec<(f64, f64)> {
        let total: u16 = transfers.iter().map(|t| t.0).sum();
        let total_f = f64::from(total.max(1));
        let mut per = (self.capacity / total_f).min(self.per_stream);
        // What the transfers would send, paced ones at their pacing: more than the
        // capacity fills the queue, which then drops whoever's packets arrive.
        let full = self.full(transfers);
        let mut loss = if full {
            self.loss_per_stream * total_f
        } else {
            0.0
        };
        if let Some((above, rate, kept)) = self.burst_loss {
            if total > above {
                loss = loss.max(rate);
                per *= kept;
            }
        }
        transfers
            .iter()
            .map(|&(n, pacing)| {
                let share = f64::from(n) * per;
                let paced = pacing.map(|p| p as f64 / WIRE_OVERHEAD);
                match (paced, self.shallow) {
                    // Below a policer's rate nothing is dropped; in a queue others
                    // keep full, a paced stream loses as much as theirs.
                    (Some(paced), Some(_)) if paced <= share => (paced, 0.0),
                    (Some(paced), None) if paced <= share => (paced, if full { loss } else { 0.0 }),
                    (_, Some((lost, delivered))) if full => (share * delivered, loss.max(lost)),
                    _ => (share, loss),
                }
            })
            .collect()
    }
}

/// One transfer: its controller and the counters a driver would feed it.
struct Transfer {
    tuner: Tuner,
    m: Measurement,
    started: Duration,
    /// (time, goodput) of each tick, for the assertions.
    log: Vec<(Duration, f64)>,
    /// Bytes each stream may have in flight, where the session fixes it (fabric).
    window_per_stream: Option<u64>,
    /// Queueing delay its round trips show above the path's lowest.
    queue_delay: Duration,
}

impl Transfer {
    fn new(cfg: TuneConfig, started: Duration) -> Transfer {
        Transfer {
            tuner: Tuner::new(cfg),
            m: Measurement::default(),
            started,
            log: Vec::new(),
            window_per_stream: None,
            queue_delay: Duration::ZERO,
        }
    }

    fn streams(&self) -> u16 {
        self.tuner.current().streams
    }

    /// Moves `goodput` with `loss` for one tick ending at `now` (global time).
    fn tick(&mut self, now: Duration, goodput: f64, loss: f64, waited: f64) {
        let bytes = (goodput * TICK.as_secs_f64() / 8.0) as u64;
        let segments = bytes / 1448;
        self.m.at = now - self.started;
        self.m.bytes += bytes;
        self.m.segments_sent += segments;
        self.m.segments_retransmitted += (segments as f64 * loss) as u64;
        self.m.streams = self.streams();
        self.m.window_bytes = self
            .window_per_stream
            .map(|w| w * u64::from(self.m.streams));
        self.m.rtt = Some(RTT + self.queue_delay);
        self.m.min_rtt = Some(RTT);
        self.m.waited_us += (waited * TICK.as_secs_f64() * 1e6 * f64::from(self.m.streams)) as u64;
        self.log.push((now, goodput));
        self.tuner.handle_measurement(self.m);
        while self.tuner.poll_decision().is_some() {}
    }

    /// Mean goodput over `[from, to)` of global time.
    fn mean(&self, from: Duration, to: Duration) -> f64 {
        let span: Vec<f64> = self
            .log
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, g)| *g)
            .collect();
        span.iter().sum::<f64>() / span.len().max(1) as f64
    }

    fn reasons(&self) -> Vec<Reason> {
        self.tuner.history().map(|d| d.reason).collect()
    }

    /// The decisions, briefly, for failure messages.
    fn story(&self) -> String {
        self.tuner
            .history()
            .map(|d| {
                let paced = d
                    .pacing_bits_per_s
                    .map_or(String::new(), |p| format!("@{:.0}M", p as f64 / M));
                format!(
                    "{:.1}s:{}{paced}:{:?}",
                    d.at.as_secs_f64(),
                    d.streams,
                    d.reason
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// As a tuned TCP session is configured: 4 streams to start with, never fewer than 2.
fn tuned_tcp(seed: u64) -> TuneConfig {
    TuneConfig {
        seed,
        min_streams: 2,
        ..config(4)
    }
}

fn config(start: u16) -> TuneConfig {
    TuneConfig {
        start_streams: start,
        min_streams: 1,
        max_streams: 32,
        fixed_streams: false,
        block_size: 4 << 20,
        max_depth: 16,
        rate_bits_per_s: None,
        seed: u64::from(start),
        may_pace: true,
        loss_blind: false,
    }
}

/// Runs `transfers` over `path(now)` until `end`, with `noise` (a fraction) on every
/// goodput reading.
fn run(
    transfers: &mut [Transfer],
    path: impl Fn(Duration) -> Path,
    end: Duration,
    noise: f64,
    seed: u64,
) {
    run_noisy(transfers, path, end, Noise::every_tick(noise), seed)
}

/// Seeded noise on each transfer's goodput: a fraction drawn anew every `hold`. Drawn
/// every tick it averages out over a reading; held for a second or more it does not, as
/// through a shallow queue, where a loss burst and its recovery swing whole seconds.
#[derive(Debug, Clone, Copy)]
struct Noise {
    amplitude: f64,
    hold: Duration,
}

impl Noise {
    fn every_tick(amplitude: f64) -> Noise {
        Noise {
            amplitude,
            hold: TICK,
        }
    }
}

fn run_noisy(
    transfers: &mut [Transfer],
    path: impl Fn(Duration) -> Path,
    end: Duration,
    noise: Noise,
    seed: u64,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut now = Duration::ZERO;
    let mut jitter = vec![1.0; transfers.len()];
    let mut drawn = Duration::ZERO;
    while now < end {
        now += TICK;
        if now >= drawn + noise.hold || now == TICK {
            drawn = now;
            for j in jitter.iter_mut() {
                *j = 1.0 + noise.amplitude * (rng.random::<f64>() * 2.0 - 1.0);
            }
        }
        let active: Vec<usize> = (0..transfers.len())
            .filter(|&i| transfers[i].started < now)
            .collect();
        let streams: Vec<(u16, Option<u64>)> = active
            .iter()
            .map(|&i| {
                let d = transfers[i].tuner.current();
                (d.streams, d.pacing_bits_per_s)
            })
            .collect();
        let path = path(now);
        let delay = if path.deep && path.full(&streams) {
            RTT
        } else {
            Duration::ZERO
        };
        let shares = path.share(&streams);
        for (&i, (goodput, loss)) in active.iter().zip(shares) {
            transfers[i].queue_delay = delay;
            transfers[i].tick(now, goodput * jitter[i], loss, 0.0);
        }
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Feeds `tuner` one tick of `goodput` (the session's, bits per second) losing `loss` of
/// its segments, at the streams it last decided on: for tests that shape the readings by
/// hand rather than through a [`Path`].
fn tick_by_hand(tuner: &mut Tuner, m: &mut Measurement, goodput: f64, loss: f64) {
    m.at += TICK;
    m.streams = tuner.current().streams;
    let bytes = (goodput * TICK.as_secs_f64() / 8.0) as u64;
    m.bytes += bytes;
    m.segments_sent += bytes / 1448;
    m.segments_retransmitted += ((bytes / 1448) as f64 * loss) as u64;
    tuner.handle_measurement(*m);
    while tuner.poll_decision().is_some() {}
}

#[test]
fn the_utility_charges_for_streams_and_loss() {
    let clean = utility(1000.0, 4, 0.0);
    assert!(utility(1000.0, 5, 0.0) < clean, "a stream costs");
    assert!(utility(1000.0, 4, 0.01) < clean, "loss costs");
    assert!(utility(1100.0, 5, 0.0) > clean, "unless it buys goodput");
}

/// A window-limited path (100 Mbit/s per stream, 1 Gbit/s bottleneck) needs 10 streams;
/// starting from 2, or from 4 (which probes down first, loses, then doubles), the
/// controller finds about that many and fills the path.
#[test]
fn converges_to_the_streams_a_window_limited_path_needs() {
    for (seed, start) in (0..32).flat_map(|seed| [(seed, 2), (seed, 4)]) {
        let mut t = [Transfer::new(config(start), Duration::ZERO)];
        let path = Path::window_limited(G, 100.0 * M);
        run(&mut t, |_| path, secs(40), 0.03, seed);
        let streams = t[0].streams();
        assert!(
            (9..=12).contains(&streams),
            "seed {seed}, from {start}: {streams} streams; {}",
            t[0].story()
        );
        let late = t[0].mean(secs(30), secs(40));
        assert!(
            late >= 0.9 * G,
            "seed {seed}, from {start}: {late} bit/s at the end"
        );
        // Most of the way within the first few intervals, not after a long crawl.
        let first_full = t[0]
            .log
            .iter()
            .find(|(_, g)| *g >= 0.85 * G)
            .map(|(at, _)| *at)
            .expect("the path was filled");
        assert!(
            first_full <= secs(15),
            "seed {seed}, from {start}: full at {first_full:?}"
        );
    }
}

/// A session that starts with 4 streams where one fills the path probes down first, and
/// keeps fewer: the streams it started with were for the slow start, not the path.
#[test]
fn a_session_started_with_more_streams_than_it_needs_sheds_them() {
    for seed in 0..16 {
        let mut t = [Transfer::new(
            TuneConfig { seed, ..config(4) },
            Duration::ZERO,
        )];
        let path = Path::window_limited(G, 2.0 * G);
        run(&mut t, |_| path, secs(30), 0.03, seed);
        let story = t[0].story();
        let history: Vec<Decision> = t[0].tuner.history().copied().collect();
        assert_eq!(
            (history[1].streams, history[1].reason),
            (3, Reason::Probe),
            "seed {seed}: the first probe is down: {story}"
        );
        assert!(t[0].streams() <= 3, "seed {seed}: {story}");
        let late = t[0].mean(secs(20), secs(30));
        assert!(late >= 0.9 * G, "seed {seed}: {late}: {story}");
    }
}

/// Issue 19, path (d): fabric streams each have a fixed window (10 MB of slots here, of
/// which turnaround leaves 500 Mbit/s at 100 ms), and 4 fill a 2 Gbit/s path with 40 MB
/// for a 25 MB product. Told the window, the controller stops doubling there and never
/// asks for 8 streams, as it does (and measures them for nothing) without it.
#[test]
fn a_fixed_window_that_holds_the_path_stops_the_doubling() {
    let path = Path::window_limited(2.0 * G, 500.0 * M);
    for seed in 0..16 {
        let most = |window: Option<u64>| {
            let mut t = [Transfer::new(config(2), Duration::ZERO)];
            t[0].window_per_stream = window;
            run(&mut t, |_| path, secs(20), 0.03, seed);
            let most = t[0].tuner.history().map(|d| d.streams).max();
            (most.unwrap_or(0), t)
        };
        let (fabric, t) = most(Some(10_000_000));
        assert!((4..8).contains(&fabric), "seed {seed}: {}", t[0].story());
        assert!(
            t[0].mean(secs(12), secs(20)) >= 0.9 * 2.0 * G,
            "seed {seed}: {}",
            t[0].story()
        );
        let (tcp, t) = most(None);
        assert!(tcp >= 8, "seed {seed}: {}", t[0].story());
    }
}

/// Too many streams to start with, on a path one stream fills: the controller sheds
/// them (each costs, none buys anything).
#[test]
fn sheds_streams_that_buy_nothing() {
    let mut t = [Transfer::new(config(8), Duration::ZERO)];
    let path = Path::window_limited(100.0 * M, G);
    run(&mut t, |_| path, secs(30), 0.03, 3);
    assert!(t[0].streams() <= 2, "{:?}", t[0].reasons());
    assert!(t[0].mean(secs(20), secs(30)) >= 0.95 * 100.0 * M);
}

/// The path's rate drops from 2 Gbit/s to 500 Mbit/s at 10 s and comes back at 20 s
/// (issue 19's path f), with streams limited to 250 Mbit/s each: the controller notices
/// the change, drops the streams that only add loss, and finds the rate again after it
/// recovers.
#[test]
fn follows_a_rate_that_drops_and_recovers() {
    let mut t = [Transfer::new(config(2), Duration::ZERO)];
    let rate = |now: Duration| {
        if now >= secs(10) && now < secs(20) {
            500.0 * M
        } else {
            2.0 * G
        }
    };
    run(
        &mut t,
        |now| Path::window_limited(rate(now), 250.0 * M),
        secs(40),
        0.03,
        5,
    );
    let history: Vec<Decision> = t[0].tuner.history().copied().collect();
    let during: Vec<&Decision> = history
        .iter()
        .filter(|d| d.at >= secs(10) && d.at < secs(20))
        .collect();
    assert!(
        during
            .iter()
            .any(|d| matches!(d.reason, Reason::PathChanged(_) | Reason::Loss(_))),
        "the drop was noticed: {history:?}"
    );
    let low = during.last().map(|d| d.streams).unwrap_or(0);
    assert!(
        low <= 4,
        "streams that only add loss were shed: {low}; {history:?}"
    );
    assert!(
        t[0].mean(secs(15), secs(20)) >= 0.9 * 500.0 * M,
        "{}: {history:?}",
        t[0].mean(secs(15), secs(20))
    );
    assert!(
        t[0].mean(secs(32), secs(40)) >= 0.9 * 2.0 * G,
        "the recovered rate is found again: {history:?}"
    );
}

/// Loss beyond [`LOSS_BACKOFF`] that costs goodput sheds streams without waiting for a
/// comparison, once a second reading confirms it: here a policer appears at 20 s under
/// a transfer holding 3 streams of 400 Mbit/s, dropping 5% and delivering 60% of
/// 1 Gbit/s once more than 2 streams crowd it. The controller sheds for the loss and
/// stays below it, where 2 streams deliver 800 Mbit/s cleanly.
#[test]
fn backs_off_on_loss_that_costs_goodput() {
    let clean = Path::window_limited(G, 400.0 * M);
    let policed = Path {
        loss_per_stream: 0.0,
        burst_loss: Some((2, 0.05, 0.6)),
        ..clean
    };
    let mut t = [Transfer::new(config(2), Duration::ZERO)];
    run(
        &mut t,
        |now| if now < secs(20) { clean } else { policed },
        secs(45),
        0.02,
        7,
    );
    let story = t[0].story();
    let shed = t[0]
        .tuner
        .history()
        .find(|d| d.at >= secs(20) && matches!(d.reason, Reason::Loss(_)))
        .copied();
    let shed = shed.unwrap_or_else(|| panic!("shed for the loss: {story}"));
    assert!(
        shed.at <= secs(20) + 2 * MEASURE_BOUNDS.1 + SETTLE_BOUNDS.1,
        "within two readings: {story}"
    );
    assert!(t[0].streams() <= 2, "{story}");
    // More than staying crowded would deliver (0.6 Gbit/s), its probes up and down
    // included.
    let late = t[0].mean(secs(35), secs(45));
    assert!(late >= 0.66 * G, "{late}: {story}");
}

/// One lossy reading that costs goodput is not enough: through a shallow queue a loss
/// burst's reading is as often noise. Here a single reading's span at 8 streams loses
/// 10% at half the rate, then the path is as before: nothing is shed.
#[test]
fn one_lossy_reading_sheds_nothing() {
    let mut tuner = Tuner::new(TuneConfig {
        min_streams: 1,
        max_streams: 8,
        fixed_streams: false,
        ..config(8)
    });
    let mut m = Measurement {
        streams: 8,
        rtt: Some(RTT),
        min_rtt: Some(RTT),
        ..Measurement::default()
    };
    let mut feed = |tuner: &mut Tuner, rate: f64, loss: f64| {
        tick_by_hand(tuner, &mut m, rate, loss);
    };
    // At the top of its range the controller holds 8 (every probe down costs).
    for _ in 0..20 {
        feed(&mut tuner, G, 0.0);
    }
    let readings = tuner.readings();
    while tuner.readings() == readings {
        feed(&mut tuner, G, 0.0);
    }
    let before = tuner.history().count();
    let readings = tuner.readings();
    while tuner.readings() == readings {
        feed(&mut tuner, G / 2.0, 0.1);
    }
    assert!(
        !tuner
            .history()
            .skip(before)
            .any(|d| matches!(d.reason, Reason::Loss(_))),
        "one reading shed: {:?}",
        tuner.history().collect::<Vec<_>>()
    );
    // The same again, for two readings in a row: now it sheds.
    let readings = tuner.readings();
    while tuner.readings() < readings + 2 {
        feed(&mut tuner, G / 2.0, 0.1);
    }
    assert!(
        tuner
            .history()
            .skip(before)
            .any(|d| matches!(d.reason, Reason::Loss(_))),
        "two readings in a row shed: {:?}",
        tuner.history().collect::<Vec<_>>()
    );
}

/// The same loss at an undiminished rate is a full queue: nothing is shed for it at
/// once, and the streams that buy nothing go by comparison instead.
#[test]
fn loss_at_the_full_rate_is_weighed_not_shed() {
    let mut t = [Transfer::new(config(12), Duration::ZERO)];
    let path = Path {
        capacity: G,
        per_stream: G,
        loss_per_stream: 0.0,
        burst_loss: Some((4, 0.05, 1.0)),
        shallow: None,
        deep: false,
    };
    run(&mut t, |_| path, secs(40), 0.02, 7);
    let reasons = t[0].reasons();
    assert!(
        !reasons.iter().any(|r| matches!(r, Reason::Loss(_))),
        "{reasons:?}"
    );
    assert!(t[0].streams() <= 4, "{}", t[0].story());
    assert!(t[0].mean(secs(5), secs(40)) >= 0.9 * G, "{}", t[0].story());
}

/// A shallow policer at 1 Gbit/s: unpaced, one stream or many lose 4% of their
/// segments and deliver 85% of its rate. The controller sees loss at a steady rate,
/// paces, then probes the pacing up to just below the policer, and delivers more than
/// unpaced streams could.
#[test]
fn paces_below_a_policer_it_detects() {
    for seed in 0..8 {
        let mut t = [Transfer::new(
            TuneConfig { seed, ..config(2) },
            Duration::ZERO,
        )];
        let path = Path::policer(G, 2.0 * G);
        run(&mut t, |_| path, secs(60), 0.02, seed);
        let story = t[0].story();
        assert!(
            t[0].reasons()
                .iter()
                .any(|r| matches!(r, Reason::Policer(_))),
            "seed {seed}: {story}"
        );
        let pacing = t[0].tuner.current().pacing_bits_per_s.expect("paced") as f64;
        assert!(
            (0.85 * G * WIRE_OVERHEAD..=G * WIRE_OVERHEAD).contains(&pacing),
            "seed {seed}: paced at {pacing}: {story}"
        );
        let late = t[0].mean(secs(40), secs(60));
        assert!(late >= 0.9 * G, "seed {seed}: {late}: {story}");
    }
}

/// Fabric streams starting at 4 whose fixed windows (5 MB each, 400 Mbit/s at 100 ms)
/// cannot hold a 2 Gbit/s path: the first probe is up, not down, and the path is filled.
#[test]
fn a_fixed_window_too_small_for_the_path_probes_up_first() {
    for seed in 0..16 {
        let mut t = [Transfer::new(tuned_tcp(seed), Duration::ZERO)];
        t[0].window_per_stream = Some(5_000_000);
        let path = Path::window_limited(2.0 * G, 400.0 * M);
        run(&mut t, |_| path, secs(30), 0.03, seed);
        let story = t[0].story();
        let history: Vec<Decision> = t[0].tuner.history().copied().collect();
        assert!(history[1].streams > 4, "seed {seed}: {story}");
        let late = t[0].mean(secs(20), secs(30));
        assert!(late >= 0.9 * 2.0 * G, "seed {seed}: {late}: {story}");
    }
}

/// A long path whose streams are still in slow start: what they deliver grows for the
/// first 8 s whatever their number, up to 2 Gbit/s, which takes all 4 streams the session
/// started with (500 Mbit/s each). Readings taken during the climb score any later count
/// better; the probe down waits until they stop growing, finds 3 worse, and the session
/// keeps its 4.
#[test]
fn a_start_still_ramping_is_not_taken_for_fewer_streams_being_better() {
    let ramp = |now: Duration| 2.0 * G * (now.as_secs_f64() / 8.0).clamp(0.1, 1.0);
    for seed in 0..16 {
        let mut t = [Transfer::new(tuned_tcp(seed), Duration::ZERO)];
        run(
            &mut t,
            |now| Path::window_limited(ramp(now), 500.0 * M),
            secs(30),
            0.03,
            seed,
        );
        let story = t[0].story();
        let history: Vec<Decision> = t[0].tuner.history().copied().collect();
        assert!(
            history
                .iter()
                .filter(|d| d.at < secs(8))
                .all(|d| d.streams >= 4),
            "seed {seed}: fewer streams while the path was still growing: {story}"
        );
        assert!(t[0].streams() >= 4, "seed {seed}: {story}");
        let late = t[0].mean(secs(20), secs(30));
        assert!(late >= 0.9 * 2.0 * G, "seed {seed}: {late}: {story}");
    }
}

/// The same losses at a steady rate, but with the round trip twice the path's lowest:
/// a deep queue overflowing (others fill it, or this transfer's own streams), not a
/// policer. Pacing would not remove that loss, only hold the transfer where it is.
#[test]
fn a_deep_queue_that_loses_is_not_taken_for_a_policer() {
    for seed in 0..8 {
        let mut t = [Transfer::new(
            TuneConfig { seed, ..config(2) },
            Duration::ZERO,
        )];
        let path = Path {
            deep: true,
            ..Path::policer(G, 2.0 * G)
        };
        run(&mut t, |_| path, secs(60), 0.02, seed);
        let story = t[0].story();
        assert!(
            !t[0]
                .reasons()
                .iter()
                .any(|r| matches!(r, Reason::Policer(_))),
            "seed {seed}: {story}"
        );
        assert_eq!(t[0].tuner.current().pacing_bits_per_s, None, "{story}");
    }
}

/// Paced below a policer when the path slows (a rate that drops to a quarter): the
/// pacing is released, and found again after the rate comes back.
#[test]
fn pacing_follows_a_policer_that_changes() {
    let mut t = [Transfer::new(config(2), Duration::ZERO)];
    let at = |now: Duration| {
        let capacity = if now >= secs(30) && now < secs(45) {
            250.0 * M
        } else {
            G
        };
        Path::policer(capacity, 2.0 * G)
    };
    run(&mut t, at, secs(90), 0.02, 3);
    let story = t[0].story();
    assert!(
        t[0].reasons()
            .iter()
            .any(|r| matches!(r, Reason::PacingReleased)),
        "{story}"
    );
    assert!(t[0].mean(secs(40), secs(45)) >= 0.8 * 250.0 * M, "{story}");
    assert!(t[0].mean(secs(75), secs(90)) >= 0.88 * G, "{story}");
}

/// A receiver (or a fabric sender) cannot pace itself: it never tries.
#[test]
fn a_session_that_cannot_pace_is_never_paced() {
    let mut t = [Transfer::new(
        TuneConfig {
            may_pace: false,
            ..config(2)
        },
        Duration::ZERO,
    )];
    let path = Path::policer(G, G);
    run(&mut t, |_| path, secs(30), 0.02, 1);
    assert!(t[0].tuner.history().all(|d| d.pacing_bits_per_s.is_none()));
}

/// Two transfers at one bottleneck, the second starting 10 s after the first (issue
/// 19's fairness target), over 32 seeds: streams each held to a fifth of the path, or
/// each able to fill it alone. 30 s after the second starts, over the next 10 s, each
/// has within 20% of an equal share in at least 7 runs of 8, and within 10% on average.
/// (Not every run: each transfer reads the other's probes as noise in its own, and with
/// few streams one probe moves a share by a third; the misses are runs still moving
/// toward equal counts.)
#[test]
fn two_controllers_share_a_bottleneck_fairly() {
    let path = |seed: u64| {
        let per_stream = if seed % 2 == 0 { 200.0 * M } else { G };
        Path::window_limited(G, per_stream)
    };
    assert_shared_fairly(
        config(2),
        0..32,
        (50, 100),
        Noise::every_tick(0.03),
        path,
        0.125,
        0.1,
    );
}

/// Two transfers configured as `cfg` (each with a seed of its own), the second started 10 s after the first, over
/// `path(seed)` for each seed: together they fill it, and 30 s after the second start
/// at most `missed_at_most` of the seeds (a fraction) are beyond 20% of an equal share,
/// `mean_at_most` on average. `seeds` vary the noise and, offset, each controller's own
/// seed.
fn assert_shared_fairly(
    cfg: TuneConfig,
    seeds: std::ops::Range<u64>,
    offsets: (u64, u64),
    noise: Noise,
    path: impl Fn(u64) -> Path,
    missed_at_most: f64,
    mean_at_most: f64,
) {
    let mut deviations = Vec::new();
    for seed in seeds {
        let transfer = |offset: u64, started: Duration| {
            Transfer::new(
                TuneConfig {
                    seed: seed + offset,
                    ..cfg.clone()
                },
                started,
            )
        };
        let mut t = [
            transfer(offsets.0, Duration::ZERO),
            transfer(offsets.1, secs(10)),
        ];
        let p = path(seed);
        run_noisy(&mut t, |_| p, secs(50), noise, seed);
        let (a, b) = (t[0].mean(secs(40), secs(50)), t[1].mean(secs(40), secs(50)));
        assert!(a + b >= 0.9 * G, "seed {seed}: together they fill the path");
        let equal = (a + b) / 2.0;
        let worst = ((a - equal).abs() / equal).max((b - equal).abs() / equal);
        deviations.push((seed, worst, t[0].story(), t[1].story()));
    }
    let missed: Vec<_> = deviations.iter().filter(|d| d.1 > 0.2).collect();
    let mean = deviations.iter().map(|d| d.1).sum::<f64>() / deviations.len() as f64;
    assert!(
        missed.len() as f64 <= missed_at_most * deviations.len() as f64 && mean <= mean_at_most,
        "{} of {} runs beyond 20% of an equal share, {mean:.3} on average: {missed:#?}",
        missed.len(),
        deviations.len()
    );
}

/// A sender whose channels wait for blocks (a slow disk) gains nothing from streams:
/// none is added.
#[test]
fn a_starved_sender_adds_no_streams() {
    let mut tuner = Tuner::new(config(2));
    let mut m = Measurement::default();
    for i in 1..=100u64 {
        m.at = TICK * i as u32;
        m.bytes += (300.0 * M * TICK.as_secs_f64() / 8.0) as u64;
        m.streams = tuner.current().streams;
        m.rtt = Some(RTT);
        m.waited_us += (0.8 * TICK.as_secs_f64() * 1e6) as u64 * u64::from(m.streams);
        tuner.handle_measurement(m);
    }
    assert!(tuner.history().all(|d| d.streams <= 2));
    assert!(tuner
        .history()
        .any(|d| matches!(d.reason, Reason::Starved(_))));
}

/// `--streams N` is the user's: the count never moves, whatever the path; depth still
/// follows the measured bandwidth-delay product, and a declared rate is paced.
#[test]
fn fixed_streams_stay_and_depth_covers_the_measured_bdp() {
    let cfg = TuneConfig {
        fixed_streams: true,
        // Above the path's rate, so that the path, not the pacing, sets the BDP.
        rate_bits_per_s: Some(2_000_000_000),
        ..config(2)
    };
    let mut t = [Transfer::new(cfg, Duration::ZERO)];
    assert_eq!(t[0].tuner.current().pacing_bits_per_s, Some(2_000_000_000));
    let path = Path::window_limited(G, G);
    run(&mut t, |_| path, secs(20), 0.0, 1);
    assert!(t[0].tuner.history().all(|d| d.streams == 2));
    // 1 Gbit/s × 100 ms = 12.5 MB over 2 streams of 4 MiB blocks: 2 blocks each.
    let bdp = t[0].tuner.measured_bdp().unwrap();
    assert!((12_000_000..=13_000_000).contains(&bdp), "{bdp}");
    let d = t[0].tuner.current();
    assert_eq!(d.depth, 2);
    assert!(
        u64::from(d.depth) * 2 * (4 << 20) >= bdp,
        "never below the BDP"
    );
    assert_eq!(t[0].tuner.depth_needed(), Some((2, false)));
}

/// A budget that holds depth below the bandwidth-delay product says so.
#[test]
fn a_budget_below_the_bdp_is_reported() {
    let cfg = TuneConfig {
        fixed_streams: true,
        max_depth: 1,
        ..config(1)
    };
    let mut t = [Transfer::new(cfg, Duration::ZERO)];
    let path = Path::window_limited(G, G);
    run(&mut t, |_| path, secs(10), 0.0, 1);
    assert_eq!(t[0].tuner.current().depth, 1);
    assert_eq!(t[0].tuner.depth_needed(), Some((3, true)));
}

/// Channels that do not come up (a server refusing more) are not waited for forever:
/// the controller settles for those it has.
#[test]
fn settles_for_the_channels_that_opened() {
    let mut tuner = Tuner::new(config(2));
    let mut m = Measurement::default();
    let mut at_most = 0;
    for i in 1..=300u64 {
        m.at = TICK * i as u32;
        // Never more than 3 channels come up.
        m.streams = tuner.current().streams.min(3);
        m.bytes += (f64::from(m.streams) * 100.0 * M * TICK.as_secs_f64() / 8.0) as u64;
        m.rtt = Some(RTT);
        tuner.handle_measurement(m);
        at_most = at_most.max(m.streams);
    }
    assert!(tuner
        .history()
        .any(|d| d.reason == Reason::OpenFailed && d.streams == 3));
    assert_eq!(tuner.current().streams, 3);
    assert_eq!(at_most, 3);
}

/// A server that lets one channel open, below the controller's own minimum of 2: it
/// settles for one, and stops asking for a second every time its patience runs out.
#[test]
fn settles_for_one_channel_below_its_minimum() {
    let mut tuner = Tuner::new(TuneConfig {
        min_streams: 2,
        ..config(2)
    });
    let mut m = Measurement::default();
    let mut decisions = 0;
    for i in 1..=600u64 {
        m.at = TICK * i as u32;
        m.streams = 1;
        m.bytes += (100.0 * M * TICK.as_secs_f64() / 8.0) as u64;
        m.rtt = Some(RTT);
        tuner.handle_measurement(m);
        while tuner.poll_decision().is_some() {
            decisions += 1;
        }
    }
    assert_eq!(tuner.current().streams, 1, "{}", decisions);
    assert!(
        decisions <= 4,
        "{decisions} decisions in 2 minutes: {:?}",
        tuner.history().collect::<Vec<_>>()
    );
}

/// Counters from the caller that go back in time are ignored, not a panic.
#[test]
fn counters_that_go_back_are_ignored() {
    let mut tuner = Tuner::new(config(2));
    let mut m = Measurement {
        at: secs(5),
        bytes: 1 << 30,
        streams: 2,
        ..Measurement::default()
    };
    tuner.handle_measurement(m);
    m.at = secs(1);
    m.bytes = 0;
    tuner.handle_measurement(m);
    m.at = secs(9);
    m.bytes = 1 << 20;
    tuner.handle_measurement(m);
    assert_eq!(tuner.current().streams, 2);
}

/// A single reading far off (a loss burst's recovery, here one reading's span at a
/// third of the rate) is not taken for a new path, nor averaged into the held count's
/// score: only a change that the next reading confirms is.
#[test]
fn one_reading_off_is_not_a_path_change() {
    let mut tuner = Tuner::new(TuneConfig {
        min_streams: 2,
        max_streams: 2,
        ..config(2)
    });
    let mut m = Measurement {
        streams: 2,
        rtt: Some(RTT),
        min_rtt: Some(RTT),
        ..Measurement::default()
    };
    let mut feed = |tuner: &mut Tuner, ticks: u32, rate: f64| {
        for _ in 0..ticks {
            m.at += TICK;
            m.bytes += (rate * TICK.as_secs_f64() / 8.0) as u64;
            tuner.handle_measurement(m);
        }
    };
    feed(&mut tuner, 100, G);
    let held = tuner.best.expect("a count is held").goodput;
    assert!((0.95 * G..=1.05 * G).contains(&held), "{held}");
    // Exactly one reading's span (5 ticks, 1 s: MEASURE_BOUNDS) at a third, then the
    // rate as before.
    let readings = tuner.readings();
    while tuner.readings() == readings {
        feed(&mut tuner, 1, G);
    }
    feed(&mut tuner, 5, G / 3.0);
    assert_eq!(
        tuner.readings(),
        readings + 2,
        "one reading spanned the dip"
    );
    let after = tuner.best.expect("still held").goodput;
    assert!(after >= 0.95 * G, "the dip set the score: {after}");
    assert!(
        tuner.unconfirmed.is_some(),
        "the dip waits for confirmation"
    );
    // The dip also widened the readings (it is noise until confirmed): the next one
    // takes as long as it now needs.
    let readings = tuner.readings();
    while tuner.readings() == readings {
        feed(&mut tuner, 1, G);
    }
    assert!(tuner.unconfirmed.is_none());
    assert!(tuner.best.expect("held").goodput >= 0.95 * G);
    // A change that lasts is confirmed by the next reading.
    let readings = tuner.readings();
    while tuner.readings() < readings + 2 {
        feed(&mut tuner, 1, G / 3.0);
    }
    assert!(
        tuner.best.expect("held").goodput <= 0.5 * G,
        "a lasting change resets the score"
    );
}

/// A transfer held at 8 streams in a queue that loses 12% at any count (a shallow one
/// others share) sees its goodput halve at the same loss rate: a competitor took share,
/// its own streams did not overrun anything, and nothing is shed for loss. Only loss
/// that grows beyond [`LOSS_GROWTH`] times the held count's is.
#[test]
fn loss_that_did_not_grow_sheds_nothing() {
    let mut tuner = Tuner::new(TuneConfig {
        max_streams: 8,
        ..config(8)
    });
    let mut m = Measurement {
        rtt: Some(RTT),
        min_rtt: Some(RTT),
        ..Measurement::default()
    };
    // Each stream carries an eighth of `rate` (window-limited): fewer deliver less, so
    // the controller holds 8.
    let mut feed = |tuner: &mut Tuner, rate: f64, loss: f64| {
        let streams = tuner.current().streams;
        tick_by_hand(tuner, &mut m, rate * f64::from(streams) / 8.0, loss);
    };
    for _ in 0..60 {
        feed(&mut tuner, G, 0.12);
    }
    let before = tuner.history().count();
    let shed = |tuner: &Tuner| {
        tuner
            .history()
            .skip(before)
            .any(|d| matches!(d.reason, Reason::Loss(_)))
    };
    let readings = tuner.readings();
    while tuner.readings() < readings + 4 {
        feed(&mut tuner, G / 2.0, 0.12);
    }
    assert!(!shed(&tuner), "{:?}", tuner.history().collect::<Vec<_>>());
    let readings = tuner.readings();
    while tuner.readings() < readings + 4 {
        feed(&mut tuner, G / 4.0, 0.30);
    }
    assert!(shed(&tuner), "{:?}", tuner.history().collect::<Vec<_>>());
}

/// A drop-tail queue of a bandwidth-delay product at 1 Gbit/s, streams of at most 250
/// Mbit/s each, losing 0.5% per stream sharing it once full.
const LOSSY_FULL_QUEUE: Path = Path {
    capacity: G,
    per_stream: 250.0 * M,
    loss_per_stream: 0.005,
    burst_loss: None,
    shallow: None,
    deep: true,
};

/// A drop-tail bottleneck whose full queue loses more than [`LOSS_BACKOFF`] (4% at 8
/// streams) shared by two transfers, the second started 10 s after the first. The first
/// sees its goodput halve at a loss rate above the threshold: that is a competitor's
/// share, not loss that costs goodput, and must not ratchet it down a quarter of its
/// streams at a time against the rate it had alone. They end near equal shares.
#[test]
fn a_competitor_on_a_lossy_full_queue_is_shared_with_not_fled() {
    assert_lossy_full_queue_shared(config(2));
}

/// The same, both transfers starting from 4 streams and kept at 2 or more, as tuned TCP
/// sessions are: the first, alone, finds it needs fewer before the second arrives.
#[test]
fn transfers_started_with_four_streams_share_a_lossy_full_queue() {
    assert_lossy_full_queue_shared(tuned_tcp(0));
}

/// Issue 19's path (b) as BBR streams see it: a queue of a bandwidth-delay product at 1
/// Gbit/s that any two streams keep standing (BBR keeps twice its estimate in flight),
/// shared per flow, the full queue losing a little more with every stream.
const BBR_DEEP_QUEUE: Path = Path {
    capacity: G,
    per_stream: G,
    loss_per_stream: 0.008,
    burst_loss: None,
    shallow: None,
    deep: true,
};

/// A tuned session of BBR streams beside a competitor that keeps 4 streams at
/// [`BBR_DEEP_QUEUE`]: each stream it adds takes a flow's share from the competitor
/// (4 against 4: half; 5 against 4: 5/9), a gain the utility passes at about the same
/// loss, and it climbed to 7 streams and 0.6 of the path. Where the queue stands, a BBR
/// session keeps the count it started from (`Tuner::probe`): 4, and half the path. A
/// competitor with more streams that never gives way keeps more than an equal share;
/// two tuned sessions hold equal counts.
#[test]
fn a_stream_that_only_takes_a_share_is_not_kept_at_a_standing_queue() {
    let run = |loss_blind: bool| {
        let competitor = TuneConfig {
            fixed_streams: true,
            max_streams: 4,
            ..config(4)
        };
        let mut t = [
            Transfer::new(competitor, Duration::ZERO),
            Transfer::new(
                TuneConfig {
                    loss_blind,
                    ..tuned_tcp(3)
                },
                secs(5),
            ),
        ];
        run(&mut t, |_| BBR_DEEP_QUEUE, secs(60), 0.02, 3);
        let share = t[1].mean(secs(45), secs(60)) / G;
        (t[1].streams(), share, t[1].story())
    };
    let (streams, share, story) = run(true);
    assert!(
        streams == 4 && (0.45..=0.55).contains(&share),
        "{streams} streams, {share:.2}: {story}"
    );
    let (streams, share, story) = run(false);
    assert!(
        streams >= 6 && share >= 0.57,
        "{streams} streams, {share:.2}: {story}"
    );
}

/// [`LOSSY_FULL_QUEUE`] shared by two transfers configured as `cfg`: at most 1 in 8 of 48
/// seeds beyond 20% of an equal share, 0.12 on average.
fn assert_lossy_full_queue_shared(cfg: TuneConfig) {
    let noise = Noise::every_tick(0.05);
    assert_shared_fairly(
        cfg,
        0..48,
        (7, 70),
        noise,
        |_| LOSSY_FULL_QUEUE,
        0.125,
        0.12,
    );
}

/// Issue 19's path (a) as two BBR transfers saw it through the emulator: a 1 MB buffer at
/// 2 Gbit/s and 50 ms, where streams share per flow, the full queue loses 12-29% of
/// segments whatever the count, and one transfer's one-second readings swing by up to
/// ±50% (`bench/runs/fairness-2026-11-24-shared.json`). A stream's worth of share is well
/// inside that noise, so no controller resolves it in 30 s; what this one must not do is
/// take a noisy reading for a path change, a won probe or loss that costs goodput, and
/// so ratchet one transfer down. Over 48 seeds, reading them at face value left 31
/// beyond 20% of an equal share (0.257 on average); judged against the noise, 29
/// (0.232); with the tuner as it is now, 18 (0.183). (Shedding for every lossy reading here happened to help, 19 and 0.219, but
/// the same rule handed a growing competitor the path through the emulator.)
#[test]
fn two_transfers_share_a_shallow_noisy_queue() {
    assert_shared_fairly(
        config(2),
        0..48,
        (11, 110),
        SHALLOW_NOISE,
        |_| SHALLOW_NOISY,
        0.625,
        0.245,
    );
}

/// Path (a) as in [`two_transfers_share_a_shallow_noisy_queue`], configured as tuned
/// sessions are (4 streams to start, never fewer than 2): at a bottleneck overrun at any
/// count, both keep to the convention of `Tuner::overrun_verdict` and meet at equal
/// counts. Over the 48 seeds, beyond 20% of an equal share: 17 (0.164 on average)
/// judged by the utility alone, none (0.056) with it.
#[test]
fn tuned_transfers_meet_at_equal_counts_on_a_shallow_noisy_queue() {
    assert_shared_fairly(
        tuned_tcp(0),
        0..48,
        (11, 110),
        SHALLOW_NOISE,
        |_| SHALLOW_NOISY,
        0.125,
        0.1,
    );
}

/// A 1 MB buffer at 2 Gbit/s: 15% loss whatever the count, streams sharing per flow.
const SHALLOW_NOISY: Path = Path {
    capacity: 2.0 * G,
    per_stream: 2.0 * G,
    loss_per_stream: 0.0,
    burst_loss: Some((1, 0.15, 1.0)),
    shallow: None,
    deep: false,
};

/// One transfer's one-second readings through it swing by up to ±40%.
const SHALLOW_NOISE: Noise = Noise {
    amplitude: 0.4,
    hold: Duration::from_secs(1),
};

/// Each decision's depth is for the streams it sets: judged on the count it left, a step
/// down said too few blocks per channel for the measured product until a second decision
/// corrected it.
#[test]
fn each_decision_sizes_depth_for_its_own_streams() {
    let mut t = [Transfer::new(config(4), Duration::ZERO)];
    // Full at any count: fewer streams score better, down to one.
    let path = Path::window_limited(2.0 * G, 2.0 * G);
    run(&mut t, |_| path, secs(30), 0.0, 3);
    let bdp = t[0].tuner.measured_bdp().unwrap();
    let block = u64::from(config(4).block_size);
    let history: Vec<Decision> = t[0].tuner.history().copied().collect();
    assert!(
        history.iter().any(|d| d.streams < 4),
        "the path needs fewer than 4: {history:?}"
    );
    for d in history.iter().skip(1) {
        assert!(
            u64::from(d.depth) * u64::from(d.streams) * block >= bdp,
            "{d:?} does not cover {bdp} bytes: {history:?}"
        );
    }
}

/// Less goodput at the fewest streams the session may run is no reason to add one: the
/// path slowed, and a new stream's slow start would only overrun its queue.
#[test]
fn a_drop_met_at_the_fewest_streams_adds_none() {
    let mut t = [Transfer::new(tuned_tcp(11), Duration::ZERO)];
    let rate = |now| if now >= secs(15) { 500.0 * M } else { 2.0 * G };
    run(
        &mut t,
        |now| Path::window_limited(rate(now), 2.0 * G),
        secs(25),
        0.02,
        11,
    );
    let history: Vec<Decision> = t[0].tuner.history().copied().collect();
    let at_drop = history
        .iter()
        .rev()
        .find(|d| d.at < secs(15))
        .map(|d| d.streams)
        .unwrap();
    assert_eq!(
        at_drop, 2,
        "full at any count: down to the minimum; {history:?}"
    );
    let noticed = history
        .iter()
        .find(|d| d.at >= secs(15) && matches!(d.reason, Reason::PathChanged(_)));
    assert!(
        noticed.is_none(),
        "nothing to change at 2 streams: {history:?}"
    );
    assert!(
        history
            .iter()
            .filter(|d| d.at >= secs(15) && d.at < secs(15) + secs(5))
            .all(|d| d.streams <= 2),
        "{}",
        t[0].story()
    );
}

/// A decision that says "back to the best" sets a count already measured: a probe that
/// lost and turned the other way (4 streams, 3 no better, then 8) says it probes on.
#[test]
fn back_to_the_best_means_a_count_already_tried() {
    let mut t = [Transfer::new(tuned_tcp(5), Duration::ZERO)];
    // Each stream at most 250 Mbit/s: 3 streams do worse than 4, and more do better.
    let path = Path::window_limited(2.0 * G, 250.0 * M);
    run(&mut t, |_| path, secs(30), 0.02, 5);
    let history: Vec<Decision> = t[0].tuner.history().copied().collect();
    assert!(
        history.iter().any(|d| d.reason == Reason::Onward(false)),
        "{}",
        t[0].story()
    );
    for (i, d) in history.iter().enumerate() {
        if d.reason == Reason::NoBetter {
            assert!(
                history[..i].iter().any(|e| e.streams == d.streams),
                "{d:?} is no count tried before: {}",
                t[0].story()
            );
        }
    }
}

/// Two tuned sessions of BBR streams at [`BBR_DEEP_QUEUE`], the second started 10 s
/// after the first, with readings that swing by ±5% for a second at a time: while the
/// queue stands both keep the 4 streams they started with, and the path splits evenly.
/// Over 64 seeds, none ended beyond 20% of an equal share (0.005 on average). Judged per
/// stream alone, giving way toward their floor, 3 did (0.059); when a stream more kept
/// there went on to the next at once, 6 (0.076); and without the per-stream rule the
/// counts raced apart.
#[test]
fn two_bbr_transfers_share_a_standing_queue() {
    assert_shared_fairly(
        TuneConfig {
            loss_blind: true,
            ..tuned_tcp(0)
        },
        0..64,
        (7, 70),
        Noise {
            amplitude: 0.05,
            hold: secs(1),
        },
        |_| BBR_DEEP_QUEUE,
        1.0 / 64.0,
        0.02,
    );
}

/// BBR streams held at 4, whose loss grows sixfold as their goodput halves: another
/// transfer's streams arrived (BBR loses about as much at any count, so its own did not
/// cause it), and nothing is shed for that loss, whether a queue stands (path (b)) or
/// not (a shallow one, (a)). The same readings from loss-based streams shed a quarter of
/// them.
#[test]
fn loss_that_came_with_others_sheds_no_bbr_stream() {
    let sheds = |loss_blind: bool, rtt: Duration| {
        let mut tuner = Tuner::new(TuneConfig {
            loss_blind,
            fixed_streams: false,
            ..tuned_tcp(1)
        });
        let mut m = Measurement {
            rtt: Some(rtt),
            min_rtt: Some(RTT),
            ..Measurement::default()
        };
        // Each stream a quarter of `rate`, more fill nothing more: the session holds 4.
        let mut feed = |tuner: &mut Tuner, rate: f64, loss: f64| {
            let streams = tuner.current().streams;
            tick_by_hand(tuner, &mut m, rate * f64::from(streams.min(4)) / 4.0, loss);
        };
        for _ in 0..200 {
            feed(&mut tuner, G, 0.02);
        }
        assert_eq!(
            tuner.current().streams,
            4,
            "{:?}",
            tuner.history().collect::<Vec<_>>()
        );
        let before = tuner.history().count();
        let readings = tuner.readings();
        while tuner.readings() < readings + 4 {
            feed(&mut tuner, G / 2.0, 0.12);
        }
        let shed = tuner
            .history()
            .skip(before)
            .any(|d| matches!(d.reason, Reason::Loss(_)));
        (shed, tuner.history().copied().collect::<Vec<_>>())
    };
    for rtt in [2 * RTT, RTT] {
        let (shed, history) = sheds(true, rtt);
        assert!(!shed, "{rtt:?}: {history:?}");
        let (shed, history) = sheds(false, rtt);
        assert!(shed, "{rtt:?}: {history:?}");
    }
}

/// A tuned session of BBR streams, a measurement whose round trip is twice the path's
/// lowest (a queue of a bandwidth-delay product stands), and the readings' noise.
fn bbr_at_standing_queue(seed: u64) -> (Tuner, Measurement, ChaCha8Rng) {
    let tuner = Tuner::new(TuneConfig {
        loss_blind: true,
        ..tuned_tcp(seed)
    });
    let m = Measurement {
        rtt: Some(2 * RTT),
        min_rtt: Some(RTT),
        ..Measurement::default()
    };
    (tuner, m, ChaCha8Rng::seed_from_u64(seed))
}

/// BBR streams that keep a queue standing have a full path: a tuned session keeps the
/// count it started from while the queue stands, whatever its readings say (transfers
/// sharing the queue then hold equal counts); once the queue drains and streams buy
/// goodput again, it adds them.
#[test]
fn bbr_streams_keep_their_count_while_their_queue_stands() {
    for seed in 0..16 {
        let (mut tuner, mut m, mut noise) = bbr_at_standing_queue(seed);
        let mut counts = vec![tuner.current().streams];
        for _ in 0..400 {
            // The path full at any count; readings ±10%.
            let goodput = G * noise.random_range(0.9..1.1);
            let before = tuner.current().streams;
            tick_by_hand(&mut tuner, &mut m, goodput, 0.05);
            if tuner.current().streams != before {
                counts.push(tuner.current().streams);
            }
        }
        assert_eq!(counts, [4], "seed {seed}");
        // The queue drains, and each stream now moves a quarter of the path.
        m.rtt = Some(RTT);
        for _ in 0..400 {
            let streams = f64::from(tuner.current().streams);
            tick_by_hand(&mut tuner, &mut m, streams * 0.25 * G, 0.0);
        }
        assert!(
            tuner.current().streams > 4,
            "seed {seed}: {:?}",
            tuner.history().collect::<Vec<_>>()
        );
    }
}

/// Where a standing queue holds a BBR session's count toward the one it started from
/// (4), a probe larger than one stream (a doubling, a shed of several) stops at 4, never
/// past it, and one that starts at 4 does not move; with no queue standing the same
/// probes go where they would anywhere.
#[test]
fn a_standing_queue_bounds_a_bbr_probe_at_the_starting_count() {
    let probe = |full: bool, from: u16, dir: Dir, step: u16| {
        let mut tuner = Tuner::new(TuneConfig {
            loss_blind: true,
            ..tuned_tcp(0)
        });
        tuner.full = full;
        tuner.current.streams = from;
        tuner.probe(secs(1), dir, step, Reason::Probe);
        tuner.current().streams
    };
    assert_eq!(probe(true, 2, Dir::Up, 4), 4);
    assert_eq!(probe(true, 3, Dir::Up, 1), 4);
    assert_eq!(probe(true, 4, Dir::Up, 2), 4);
    assert_eq!(probe(true, 9, Dir::Down, 4), 5);
    assert_eq!(probe(true, 6, Dir::Down, 4), 4);
    assert_eq!(probe(true, 4, Dir::Down, 1), 4);
    assert_eq!(probe(false, 2, Dir::Up, 4), 6);
    assert_eq!(probe(false, 6, Dir::Down, 3), 3);
}

/// Feeds one tick as [`tick_by_hand`], with `carried` (bits per second) crossing the
/// path: what the sockets acknowledge (`goodput`) may differ from it while holes wait
/// for their repair.
fn tick_carrying(tuner: &mut Tuner, m: &mut Measurement, goodput: f64, carried: f64, loss: f64) {
    m.bytes_carried += (carried * TICK.as_secs_f64() / 8.0) as u64;
    tick_by_hand(tuner, m, goodput, loss);
}

/// Which signs of a slowed path [`slowed_path`] shows: all of them, or all but one.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Overfill {
    All,
    NoLoss,
    NoQueue,
    /// What crosses the path falls by less than [`DRAIN_FALL`] (to 90%).
    SmallDrop,
    /// Nothing crosses the path at all: the streams stalled (retransmission timeouts),
    /// every segment sent is a retransmission.
    Stalled,
}

/// How a path that slows under BBR streams looks to the tuner, issue 19's (f) through
/// the emulator: 2 Gbit/s for 10 s, then 500 Mbit/s under a queue sized for the old
/// rate. Until the session is paced below the new rate, the streams' stale estimates
/// overfill the queue: a quarter of their segments are lost, the round trip is five
/// times its lowest, and what the sockets acknowledge comes in bursts as holes are
/// repaired, while what crosses the path is the new rate. `signs` leaves out one of
/// those; the tuner's history is returned with the time of the drop.
fn slowed_path(cfg: TuneConfig, signs: Overfill, seed: u64) -> (Vec<Decision>, Duration) {
    let mut tuner = Tuner::new(cfg);
    let mut m = Measurement {
        rtt: Some(RTT),
        min_rtt: Some(RTT),
        ..Measurement::default()
    };
    let mut noise = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..50 {
        let g = 2.0 * G * noise.random_range(0.95..1.05);
        tick_carrying(&mut tuner, &mut m, g, g, 0.0);
    }
    assert!(tuner.current().pacing_bits_per_s.is_none());
    let drop = m.at;
    let rate = if signs == Overfill::SmallDrop {
        1.8 * G
    } else {
        0.5 * G
    };
    for _ in 0..100 {
        let paced_below = tuner
            .current()
            .pacing_bits_per_s
            .is_some_and(|p| p as f64 / WIRE_OVERHEAD < rate);
        let drained = paced_below
            || tuner
                .history()
                .any(|d| d.at > drop && d.reason == Reason::Drained);
        if drained {
            m.rtt = Some(RTT);
            let g = rate * noise.random_range(0.88..0.92);
            tick_carrying(&mut tuner, &mut m, g, g, 0.0);
            continue;
        }
        m.rtt = Some(if signs == Overfill::NoQueue {
            RTT
        } else {
            5 * RTT
        });
        let loss = if signs == Overfill::NoLoss { 0.0 } else { 0.25 };
        if signs == Overfill::Stalled {
            m.segments_sent += 100;
            m.segments_retransmitted += 100;
            tick_carrying(&mut tuner, &mut m, 0.0, 0.0, 0.0);
            continue;
        }
        // Holes repaired in bursts: acknowledged 20-200% of the rate, tick by tick.
        let acked = rate * noise.random_range(0.2..2.0);
        tick_carrying(&mut tuner, &mut m, acked, rate, loss);
    }
    (tuner.history().copied().collect(), drop)
}

/// BBR streams whose path slowed under them are paced, within a second, just below what
/// crosses the path (not what the sockets acknowledged, which bursts), while the queue
/// drains; unpaced again a reading later; at the count they had throughout.
#[test]
fn a_path_that_slowed_under_bbr_streams_is_paced_while_its_queue_drains() {
    for seed in 0..16 {
        let cfg = TuneConfig {
            loss_blind: true,
            ..tuned_tcp(seed)
        };
        let (history, drop) = slowed_path(cfg, Overfill::All, seed);
        assert_one_drain(&history, drop, 0.5 * G, 0.02, seed);
    }
}

/// That `history` holds one drain, decided within a second after `change`, paced at
/// [`DRAIN_PACE`] of `carried` (within `tolerance` of it), and unpaced within 4 s, both
/// at the count held before the change.
fn assert_one_drain(
    history: &[Decision],
    change: Duration,
    carried: f64,
    tolerance: f64,
    seed: u64,
) {
    let story = format!("seed {seed}: {history:?}");
    let held = history
        .iter()
        .rev()
        .find(|d| d.at <= change)
        .unwrap()
        .streams;
    let drains: Vec<_> = history
        .iter()
        .filter(|d| matches!(d.reason, Reason::Drain(_)))
        .collect();
    assert_eq!(drains.len(), 1, "{story}");
    let drain = drains[0];
    assert!(drain.at > change && drain.at <= change + secs(1), "{story}");
    let pace = drain.pacing_bits_per_s.unwrap() as f64 / WIRE_OVERHEAD;
    let expected = DRAIN_PACE * carried;
    assert!(
        (pace - expected).abs() < tolerance * expected,
        "paced at {pace}: {story}"
    );
    let drained = history
        .iter()
        .find(|d| d.reason == Reason::Drained)
        .unwrap_or_else(|| panic!("never unpaced: {story}"));
    assert!(drained.pacing_bits_per_s.is_none(), "{story}");
    assert!(drained.at <= drain.at + secs(4), "{story}");
    assert!(
        [drain, drained].iter().all(|d| d.streams == held),
        "{story}"
    );
}

/// Without every sign of a slowed path the session is not paced for it: loss-based
/// streams (they slow down for loss themselves), a session that cannot pace, less
/// goodput with nothing lost (a competitor took a share), loss with the round trip at
/// its lowest (a policer: the hold's own rule), a dip within a path change's margin, or
/// streams that stalled (nothing crosses the path: a pace of nothing would hold them).
#[test]
fn nothing_drains_without_every_sign_of_a_slowed_path() {
    let bbr = |seed| TuneConfig {
        loss_blind: true,
        ..tuned_tcp(seed)
    };
    for seed in 0..8 {
        let cases = [
            (tuned_tcp(seed), Overfill::All),
            (
                TuneConfig {
                    may_pace: false,
                    ..bbr(seed)
                },
                Overfill::All,
            ),
            (bbr(seed), Overfill::NoLoss),
            (bbr(seed), Overfill::NoQueue),
            (bbr(seed), Overfill::SmallDrop),
            (bbr(seed), Overfill::Stalled),
        ];
        for (cfg, signs) in cases {
            let (history, _) = slowed_path(cfg.clone(), signs, seed);
            assert!(
                !history
                    .iter()
                    .any(|d| matches!(d.reason, Reason::Drain(_) | Reason::Drained)),
                "seed {seed}, {signs:?}, loss-blind {}, may pace {}: {history:?}",
                cfg.loss_blind,
                cfg.may_pace
            );
        }
    }
}

/// BBR streams alone at a standing queue (issue 19's (b) through the emulator: what
/// crosses the path steady at 0.96 of its rate, 7% of segments lost), when another
/// transfer's streams join it: what this session carries falls to about 0.7 of the path,
/// and its loss grows threefold and more. It is paced for a reading, at 0.9 of what it
/// carries, and unpaced at the count it had; where its loss stays as it was, it is not.
#[test]
fn a_transfer_joining_a_bbr_sessions_queue_is_given_room() {
    let joined = |seed: u64, loss_after: f64| {
        let (mut tuner, mut m, mut noise) = bbr_at_standing_queue(seed);
        for _ in 0..100 {
            let carried = 0.96 * G * noise.random_range(0.99..1.01);
            let acked = carried * noise.random_range(0.9..1.1);
            tick_carrying(&mut tuner, &mut m, acked, carried, 0.07);
        }
        let join = m.at;
        for _ in 0..50 {
            let paced = tuner.current().pacing_bits_per_s;
            let (carried, loss) = match paced {
                Some(rate) => (rate as f64 / WIRE_OVERHEAD, 0.02),
                None if tuner.history().any(|d| d.reason == Reason::Drained) => (0.5 * G, 0.08),
                None => (0.7 * G * noise.random_range(0.97..1.03), loss_after),
            };
            // Holes repaired in bursts, as the overflow leaves them.
            let acked = carried * noise.random_range(0.5..1.5);
            tick_carrying(&mut tuner, &mut m, acked, carried, loss);
        }
        (tuner.history().copied().collect::<Vec<_>>(), join)
    };
    for seed in 0..16 {
        let (history, join) = joined(seed, 0.25);
        assert_one_drain(&history, join, 0.7 * G, 0.05, seed);

        let (history, _) = joined(seed, 0.07);
        assert!(
            !history.iter().any(|d| matches!(d.reason, Reason::Drain(_))),
            "seed {seed}, loss as before: {history:?}"
        );
    }
}
