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
    /// policer's shallow buffer).
    burst_loss: Option<(u16, f64)>,
}

impl Path {
    fn window_limited(capacity: f64, per_stream: f64) -> Path {
        Path {
            capacity,
            per_stream,
            loss_per_stream: 0.001,
            burst_loss: None,
        }
    }

    /// Goodput and loss of each transfer, given the streams each runs.
    fn share(&self, streams: &[u16]) -> Vec<(f64, f64)> {
        let total: u16 = streams.iter().sum();
        let total_f = f64::from(total.max(1));
        let per = (self.capacity / total_f).min(self.per_stream);
        let mut loss = if total_f * self.per_stream > self.capacity * 1.000_001 {
            self.loss_per_stream * total_f
        } else {
            0.0
        };
        if let Some((above, rate)) = self.burst_loss {
            if total > above {
                loss = loss.max(rate);
            }
        }
        streams
            .iter()
            .map(|&n| (f64::from(n) * per, loss))
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
}

impl Transfer {
    fn new(cfg: TuneConfig, started: Duration) -> Transfer {
        Transfer {
            tuner: Tuner::new(cfg),
            m: Measurement::default(),
            started,
            log: Vec::new(),
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
        self.m.rtt = Some(RTT);
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
            .map(|d| format!("{:.1}s:{}:{:?}", d.at.as_secs_f64(), d.streams, d.reason))
            .collect::<Vec<_>>()
            .join(" ")
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
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut now = Duration::ZERO;
    while now < end {
        now += TICK;
        let active: Vec<usize> = (0..transfers.len())
            .filter(|&i| transfers[i].started < now)
            .collect();
        let streams: Vec<u16> = active.iter().map(|&i| transfers[i].streams()).collect();
        let shares = path(now).share(&streams);
        for (&i, (goodput, loss)) in active.iter().zip(shares) {
            let jitter = 1.0 + noise * (rng.random::<f64>() * 2.0 - 1.0);
            transfers[i].tick(now, goodput * jitter, loss, 0.0);
        }
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn the_utility_charges_for_streams_and_loss() {
    let clean = utility(1000.0, 4, 0.0);
    assert!(utility(1000.0, 5, 0.0) < clean, "a stream costs");
    assert!(utility(1000.0, 4, 0.01) < clean, "loss costs");
    assert!(utility(1100.0, 5, 0.0) > clean, "unless it buys goodput");
}

/// A window-limited path (100 Mbit/s per stream, 1 Gbit/s bottleneck) needs 10 streams;
/// starting from 2 the controller finds about that many and fills the path.
#[test]
fn converges_to_the_streams_a_window_limited_path_needs() {
    for seed in 0..32 {
        let mut t = [Transfer::new(config(2), Duration::ZERO)];
        let path = Path::window_limited(G, 100.0 * M);
        run(&mut t, |_| path, secs(40), 0.03, seed);
        let streams = t[0].streams();
        assert!(
            (9..=12).contains(&streams),
            "seed {seed}: {streams} streams; {}",
            t[0].story()
        );
        let late = t[0].mean(secs(30), secs(40));
        assert!(late >= 0.9 * G, "seed {seed}: {late} bit/s at the end");
        // Most of the way within the first few intervals, not after a long crawl.
        let first_full = t[0]
            .log
            .iter()
            .find(|(_, g)| *g >= 0.85 * G)
            .map(|(at, _)| *at)
            .expect("the path was filled");
        assert!(
            first_full <= secs(15),
            "seed {seed}: full at {first_full:?}"
        );
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

/// Loss beyond [`LOSS_BACKOFF`] (a policer dropping bursts once more than 4 streams
/// crowd it) sheds streams at once (after the first reading, which holds every stream's
/// slow start), and the controller stays below that.
#[test]
fn backs_off_on_loss() {
    let mut t = [Transfer::new(config(12), Duration::ZERO)];
    let path = Path {
        capacity: G,
        per_stream: G,
        loss_per_stream: 0.0,
        burst_loss: Some((4, 0.05)),
    };
    run(&mut t, |_| path, secs(40), 0.02, 7);
    let reasons = t[0].reasons();
    // The first reading, which holds slow start, is scored but sheds nothing; the next
    // one does.
    assert!(
        matches!(reasons.get(2), Some(Reason::Loss(_))),
        "shed at the second reading: {reasons:?}"
    );
    assert!(t[0].streams() <= 4, "{reasons:?}");
    // Later probes past 4 are cut short again, not held.
    let above: usize = t[0].log.iter().filter(|(at, _)| *at >= secs(20)).count();
    assert!(above > 0);
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
    let mut deviations = Vec::new();
    for seed in 0..32 {
        let mut t = [
            Transfer::new(
                TuneConfig {
                    seed: seed + 50,
                    ..config(2)
                },
                Duration::ZERO,
            ),
            Transfer::new(
                TuneConfig {
                    seed: seed + 100,
                    ..config(2)
                },
                secs(10),
            ),
        ];
        let per_stream = if seed % 2 == 0 { 200.0 * M } else { G };
        let path = Path::window_limited(G, per_stream);
        run(&mut t, |_| path, secs(50), 0.03, seed);
        let (a, b) = (t[0].mean(secs(40), secs(50)), t[1].mean(secs(40), secs(50)));
        assert!(a + b >= 0.9 * G, "seed {seed}: together they fill the path");
        let equal = (a + b) / 2.0;
        let worst = ((a - equal).abs() / equal).max((b - equal).abs() / equal);
        deviations.push((seed, worst, t[0].story(), t[1].story()));
    }
    let missed: Vec<_> = deviations.iter().filter(|d| d.1 > 0.2).collect();
    let mean = deviations.iter().map(|d| d.1).sum::<f64>() / deviations.len() as f64;
    assert!(
        missed.len() <= deviations.len() / 8 && mean <= 0.1,
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
        rate_bits_per_s: Some(800_000_000),
        ..config(2)
    };
    let mut t = [Transfer::new(cfg, Duration::ZERO)];
    assert_eq!(t[0].tuner.current().pacing_bits_per_s, Some(800_000_000));
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
