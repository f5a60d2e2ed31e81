//! When to give up waiting on a slow channel at the end of a session.
//!
//! A session's channels do not all run alike: on a lossy long path one TCP connection of
//! several now and then leaves its start-up far below the others and stays there for
//! seconds (bench/runs/fabric-2026-11-28-opening.md: one of eight at 60-100 Mbit/s on a
//! 1 Gbit/s, 100 ms path). While blocks remain to hand out that costs little, since each
//! channel takes the next block only when it has room. Once every block has been handed
//! out, though, the session ends only when the slowest channel has delivered the blocks
//! it holds, while the others stand idle. Sending those blocks again on the idle channels
//! is what MapReduce calls a backup task; here it is the failover path every session
//! already has: the sender drops the channel (`DropChannel`), the receiver answers with
//! how many of its blocks arrived, and only the rest is sent again.
//!
//! The rule weighs what waiting costs against what cutting costs, from what the sender
//! itself sees: the receiver's count per channel (every 4 MiB, and once a channel has
//! been quiet a moment) and the blocks each channel has taken and not had confirmed. A
//! channel that still holds `held` bytes and had `rate` confirmed over its last second
//! of counts needs about `held / rate` more; one quiet for several of its usual gaps
//! between counts has stopped, and needs at least as long as it has been quiet. Cutting
//! it costs a round trip and a half (the drop, its answer, the first block again) plus
//! `held` at the pace the idle channels ran at. It is cut only when waiting would take
//! at least twice that and a quarter second more, and only while it has stopped or
//! delivers at less than half the channels' average pace, once it has held blocks long
//! enough to have a pace: at the end of a healthy transfer every channel holds a few
//! blocks, and trading one of them for a sum of idle ones only wastes what it had in
//! flight (on path (b), cutting by cost alone cut up to five of seven fabric channels a
//! run and made runs slower). A wrong cut wastes a little bandwidth at the very end; a
//! right one saves up to a second on such a path, and the stall timeout (two minutes by
//! default) when a channel goes quiet at the end without dying.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How far back a channel's rate is judged. Confirmations come in bursts (several blocks
/// of one channel can be counted in one pass of the receiver's loop): over a few of them
/// a channel's rate was seen to swing by half (bench/runs/tail-2026-11-28.md).
const RATE_WINDOW: Duration = Duration::from_secs(1);

/// Most confirmations kept per channel, whatever the window holds.
const MAX_SAMPLES: usize = 64;

/// How much longer waiting must take than cutting before a channel is cut.
const MARGIN: f64 = 2.0;

/// What a cut must save at least: a drop and a resend are not worth a few milliseconds
/// (on loopback a channel whose thread waited for a core would otherwise be cut, and
/// its blocks sent twice, for nothing anyone could see).
const MIN_SAVING: Duration = Duration::from_millis(250);

/// A channel is judged only once it has held blocks this many round trips (and
/// [`RATE_WINDOW`]) without a break: a connection the tuner just opened is in TCP's slow
/// start, about eight round trips from its first 4 MiB block (initial window 10 segments,
/// doubling), and a channel that was idle until it took a cut one's blocks has no rate
/// of its own yet (judged from its idle window it looked slow, and cuts cascaded: eight
/// in one run through a lossy 50 ms path, `wan.rs`).
const SETTLE_ROUND_TRIPS: u32 = 10;

/// A channel has stopped when it has been quiet this many times the usual gap between
/// its counts. Counts come per 4 MiB: a CUBIC stream at 40 Mbit/s on a lossy path is
/// counted less than once a second, so a second of quiet is no sign of anything (judged
/// by its rate over the last second, such channels read as stopped, and six or seven of
/// eight were cut in a 192 MiB push through a lossy 50 ms path, `wan.rs`).
const STALLED_GAPS: u32 = 3;

/// A channel is cut only while it delivers at less than this share of what the channels
/// ran at: the rule is for the connection that fell behind, not for trading a
/// channel about as fast as the others for a sum of idle ones (their rates were measured
/// while they shared the path, so that sum is what the path may not give them).
const SLOW_SHARE: f64 = 0.5;

/// A channel's recent confirmations: when, and how many of its bytes the receiver had
/// confirmed by then.
#[derive(Debug, Default, Clone)]
pub struct Confirmations {
    samples: VecDeque<(Instant, u64)>,
}

impl Confirmations {
    /// The receiver has confirmed `bytes` on this channel in all, as of `now`.
    pub fn confirmed(&mut self, now: Instant, bytes: u64) {
        if self.samples.back().is_some_and(|(_, b)| *b >= bytes) {
            return;
        }
        self.samples.push_back((now, bytes));
        // One sample at or before the window's start stays: the rate is measured from it.
        while self.samples.len() > MAX_SAMPLES
            || self
                .samples
                .get(1)
                .is_some_and(|(at, _)| *at + RATE_WINDOW <= now)
        {
            self.samples.pop_front();
        }
    }

    /// The mean time between its recent confirmations.
    fn gap(&self) -> Option<Duration> {
        let first = self.samples.front()?.0;
        let last = self.samples.back()?.0;
        let gaps = u32::try_from(self.samples.len() - 1).ok()?;
        (gaps > 0).then(|| last.saturating_duration_since(first) / gaps)
    }

    /// Bytes per second over the window before its last confirmation, measured to that
    /// one: what the channel ran at while it had work. `None` before two confirmations.
    fn rate_while_busy(&self) -> Option<f64> {
        let (last_at, last) = *self.samples.back()?;
        let start = last_at.checked_sub(RATE_WINDOW);
        let (from_at, from) = self
            .samples
            .iter()
            .rev()
            .skip(1)
            .find(|(at, _)| start.is_some_and(|start| *at <= start))
            .or(self.samples.front())
            .copied()?;
        let span = last_at.saturating_duration_since(from_at).as_secs_f64();
        (span > 0.0).then(|| (last - from) as f64 / span)
    }
}

/// One open channel as the tail rule sees it.
#[derive(Debug, Clone)]
pub struct TailChannel<'a> {
    pub index: u16,
    /// Bytes sent on it and not yet confirmed.
    pub held: u64,
    /// Since when it has held some without a break (meaningless while `held` is 0).
    pub busy_since: Instant,
    pub confirmations: &'a Confirmations,
}

/// Which channels to cut now. Call only once every block has been handed to a channel:
/// before that an idle channel is waiting for the readers, not for the end.
pub fn stragglers(channels: &[TailChannel<'_>], rtt: Duration, now: Instant) -> Vec<u16> {
    let rates: Vec<(bool, f64)> = channels
        .iter()
        .filter_map(|c| Some((c.held == 0, c.confirmations.rate_while_busy()?)))
        .collect();
    let idle_rate: f64 = rates.iter().filter(|(idle, _)| *idle).map(|r| r.1).sum();
    if idle_rate <= 0.0 {
        return Vec::new(); // nobody to send it again, or no idea how fast they would
    }
    // Against every channel's pace, not only the idle ones': those finished first
    // because they were the fastest, and half of the fastest of eight CUBIC streams on a
    // lossy path is where an ordinary one runs now and then.
    let slow = SLOW_SHARE * rates.iter().map(|r| r.1).sum::<f64>() / rates.len() as f64;
    let round_trip = rtt.as_secs_f64();
    let settle = RATE_WINDOW.max(rtt * SETTLE_ROUND_TRIPS);
    channels
        .iter()
        .filter(|c| c.held > 0 && now.saturating_duration_since(c.busy_since) >= settle)
        .filter(|c| {
            let held = c.held as f64;
            let cut = 1.5 * round_trip + held / idle_rate;
            let confirmations = c.confirmations;
            let since = confirmations
                .samples
                .back()
                .map_or(c.busy_since, |s| s.0.max(c.busy_since));
            let silence = now.saturating_duration_since(since);
            let wait = match (confirmations.rate_while_busy(), confirmations.gap()) {
                // Quiet for several of its own gaps between counts: it has stopped, and
                // will take as long as it has been silent, at least.
                (Some(_), Some(gap)) if silence > gap * STALLED_GAPS => silence.as_secs_f64(),
                (Some(rate), _) if rate >= slow => return false,
                (Some(rate), _) => held / rate,
                // Never counted twice: judged by its silence since it took blocks.
                _ => silence.as_secs_f64(),
            };
            wait > MARGIN * cut && wait - cut >= MIN_SAVING.as_secs_f64()
        })
        .map(|c| c.index)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Before every instant the tests judge at (they start ten seconds from now).
    fn long_ago() -> Instant {
        Instant::now()
    }

    fn chan(index: u16, held: u64, busy_since: Instant, c: &Confirmations) -> TailChannel<'_> {
        TailChannel {
            index,
            held,
            busy_since,
            confirmations: c,
        }
    }

    /// A channel that confirmed a block of `block` bytes every `every`, `count` times,
    /// the last at `last`.
    fn steady(last: Instant, every: Duration, block: u64, count: u32) -> Confirmations {
        let mut c = Confirmations::default();
        for i in (0..count).rev() {
            c.confirmed(last - every * i, block * u64::from(count - i));
        }
        c
    }

    #[test]
    fn a_slow_channel_holding_blocks_is_cut_when_others_stand_idle() {
        let now = Instant::now() + Duration::from_secs(10);
        // Seven idle channels that ran at 16 MiB/s; one at 4 MiB/s holding 12 MiB.
        let fast = steady(
            now - Duration::from_millis(300),
            Duration::from_millis(250),
            4 * MIB,
            5,
        );
        let slow = steady(now, Duration::from_secs(1), 4 * MIB, 5);
        let mut channels: Vec<TailChannel> = (0..7)
            .map(|index| chan(index, 0, long_ago(), &fast))
            .collect();
        channels.push(chan(7, 12 * MIB, long_ago(), &slow));
        assert_eq!(
            stragglers(&channels, Duration::from_millis(100), now),
            vec![7]
        );
    }

    #[test]
    fn a_channel_about_to_finish_is_left_alone() {
        let now = Instant::now() + Duration::from_secs(10);
        let fast = steady(
            now - Duration::from_millis(300),
            Duration::from_millis(250),
            4 * MIB,
            5,
        );
        // As fast as the others, one block left: cutting would cost more than waiting.
        let busy = steady(now, Duration::from_millis(250), 4 * MIB, 5);
        let channels = [
            chan(0, 0, long_ago(), &fast),
            chan(1, 4 * MIB, long_ago(), &busy),
        ];
        assert!(stragglers(&channels, Duration::from_millis(100), now).is_empty());
    }

    #[test]
    fn a_channel_as_fast_as_the_idle_ones_is_left_alone_however_many_idle() {
        let now = Instant::now() + Duration::from_secs(10);
        let fast = steady(
            now - Duration::from_millis(300),
            Duration::from_millis(250),
            4 * MIB,
            5,
        );
        let busy = steady(now, Duration::from_millis(300), 4 * MIB, 5);
        let mut channels: Vec<TailChannel> = (0..7)
            .map(|index| chan(index, 0, long_ago(), &fast))
            .collect();
        // Four blocks at 13 MiB/s: 1.2 s, against 0.4 s on seven idle channels.
        channels.push(chan(7, 16 * MIB, long_ago(), &busy));
        assert!(stragglers(&channels, Duration::from_millis(100), now).is_empty());
    }

    #[test]
    fn a_cut_saving_milliseconds_is_not_made() {
        // Loopback: a channel at a third of the others' pace, 8 MiB left at 1 GiB/s.
        let now = Instant::now() + Duration::from_secs(10);
        let ms = Duration::from_millis;
        let fast = steady(now - ms(1), ms(4), 4 * MIB, 40);
        let slow = steady(now, ms(12), 4 * MIB, 40);
        let channels = [
            chan(0, 0, long_ago(), &fast),
            chan(1, 8 * MIB, long_ago(), &slow),
        ];
        assert!(stragglers(&channels, Duration::from_micros(50), now).is_empty());
    }

    #[test]
    fn nobody_idle_means_nothing_to_gain() {
        let now = Instant::now() + Duration::from_secs(10);
        let slow = steady(now, Duration::from_secs(1), 4 * MIB, 5);
        let busy = steady(now, Duration::from_millis(250), 4 * MIB, 5);
        let channels = [
            chan(0, 8 * MIB, long_ago(), &busy),
            chan(1, 12 * MIB, long_ago(), &slow),
        ];
        assert!(stragglers(&channels, Duration::from_millis(100), now).is_empty());
    }

    #[test]
    fn a_channel_gone_silent_is_cut_once_its_silence_outlasts_the_cost() {
        let start = Instant::now() + Duration::from_secs(10);
        let fast = steady(start, Duration::from_millis(250), 4 * MIB, 5);
        let mut silent = Confirmations::default();
        silent.confirmed(start, 4 * MIB);
        let channels = [
            chan(0, 0, long_ago(), &fast),
            chan(1, 4 * MIB, long_ago(), &silent),
        ];
        // 4 MiB again at 16 MiB/s plus 150 ms: 0.4 s; twice that is 0.8 s of silence.
        let rtt = Duration::from_millis(100);
        let early = start + Duration::from_millis(500);
        assert!(stragglers(&channels, rtt, early).is_empty());
        let late = start + Duration::from_millis(900);
        assert_eq!(stragglers(&channels, rtt, late), vec![1]);
    }

    #[test]
    fn a_channel_that_never_confirmed_is_judged_from_its_first_block() {
        let start = Instant::now() + Duration::from_secs(10);
        let fast = steady(start, Duration::from_millis(250), 4 * MIB, 5);
        let none = Confirmations::default();
        let took = start + Duration::from_millis(500);
        let channels = [chan(0, 0, long_ago(), &fast), chan(1, 4 * MIB, took, &none)];
        // Silent long enough, but not yet busy for ten round trips.
        let rtt = Duration::from_millis(200);
        assert!(stragglers(&channels, rtt, took + Duration::from_millis(1900)).is_empty());
        assert_eq!(
            stragglers(&channels, rtt, took + Duration::from_secs(2)),
            vec![1]
        );
    }

    /// A channel that was idle, then took a cut channel's blocks, is not judged by the
    /// window it spent idle: its confirmations stopped when it had nothing to send, not
    /// because it slowed down.
    #[test]
    fn a_channel_just_given_work_again_is_not_judged_by_its_idle_time() {
        let now = Instant::now() + Duration::from_secs(10);
        let ms = Duration::from_millis;
        // Both ran at 16 MiB/s and stopped 2 s ago; channel 1 then took 12 MiB.
        let fast = steady(now - ms(2000), ms(250), 4 * MIB, 5);
        let mut channels = [
            chan(0, 0, long_ago(), &fast),
            chan(1, 12 * MIB, now - ms(100), &fast),
        ];
        let rtt = ms(50);
        assert!(stragglers(&channels, rtt, now).is_empty());
        // Had it held them all along, its silence would have been its own.
        channels[1].busy_since = long_ago();
        assert_eq!(stragglers(&channels, rtt, now), vec![1]);
    }

    /// Counted once per 4 MiB block, a channel at 4.8 MiB/s is quiet most of a second
    /// between counts: quiet for a second and a half it is running, not stopped.
    #[test]
    fn a_channel_counted_rarely_is_stopped_only_after_several_of_its_gaps() {
        let now = Instant::now() + Duration::from_secs(10);
        let ms = Duration::from_millis;
        let idle = steady(now - ms(1500), ms(670), 4 * MIB, 5);
        let rare = steady(now - ms(1500), ms(840), 4 * MIB, 5);
        let mut channels: Vec<TailChannel> = (0..3)
            .map(|index| chan(index, 0, long_ago(), &idle))
            .collect();
        channels.push(chan(3, 8 * MIB, long_ago(), &rare));
        let rtt = ms(50);
        assert!(stragglers(&channels, rtt, now).is_empty());
        // Three of its gaps (2.5 s) without a count: stopped.
        assert_eq!(stragglers(&channels, rtt, now + ms(1100)), vec![3]);
    }

    #[test]
    fn idle_channels_of_unknown_speed_are_not_counted_on() {
        let now = Instant::now() + Duration::from_secs(10);
        let unknown = Confirmations::default();
        let slow = steady(now, Duration::from_secs(1), 4 * MIB, 5);
        let channels = [
            chan(0, 0, long_ago(), &unknown),
            chan(1, 12 * MIB, long_ago(), &slow),
        ];
        assert!(stragglers(&channels, Duration::from_millis(100), now).is_empty());
    }

    #[test]
    fn confirmations_keep_a_bounded_few_and_never_go_back() {
        let start = Instant::now();
        let mut c = Confirmations::default();
        for i in 1..100u64 {
            c.confirmed(start + Duration::from_millis(i), i * MIB);
        }
        c.confirmed(start + Duration::from_millis(200), MIB);
        assert!(c.samples.len() <= MAX_SAMPLES);
        assert_eq!(c.samples.back().map(|s| s.1), Some(99 * MIB));
    }
}
