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
//!
//! Cutting still sends the slow channel's blocks twice and costs the round trip of the
//! drop; better that the slow channel not take them. So, before the tail, a channel that
//! runs below half the channels' mean pace is held back (takes no block for now) once the
//! block it would take next would land after the other channels have sent everything
//! not yet taken: `(held + block) / rate > (untaken + held by the others) / their rate`.
//! Far from the end that never holds; in the last seconds it keeps blocks in the queue
//! for the channels that will deliver them first, which is what a scheduler minimising
//! the finish time of independent jobs on machines of unequal speed does.

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

/// How far from the others' end a slow channel may be held back, at most (or this many
/// round trips, if longer). A held channel sends nothing, so its pace is not measured
/// again: judged on a dip of its rate, it would stay held for the rest of the session.
/// Near the end that costs at most a few seconds of one channel; a bound keeps it there.
const HOLD_HORIZON: Duration = Duration::from_secs(3);
const HOLD_HORIZON_ROUND_TRIPS: u32 = 20;

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

/// The mean pace of the channels whose pace is known (bytes per second), if any.
///
/// Every channel's pace, not only the idle ones': those finished first because they were
/// the fastest, and half of the fastest of eight CUBIC streams on a lossy path is where
/// an ordinary one runs now and then. The fastest channel is never below the mean, so a
/// rule that spares channels at some share of it below 1 spares the fastest.
fn mean_pace(channels: &[TailChannel<'_>]) -> Option<f64> {
    let rates: Vec<f64> = channels
        .iter()
        .filter_map(|c| c.confirmations.rate_while_busy())
        .collect();
    (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
}

/// Whether `c` has held blocks long enough to have a pace of its own (see
/// [`SETTLE_ROUND_TRIPS`]).
fn settled(c: &TailChannel<'_>, rtt: Duration, now: Instant) -> bool {
    now.saturating_duration_since(c.busy_since) >= RATE_WINDOW.max(rtt * SETTLE_ROUND_TRIPS)
}

/// Which channels should take no block for now, before the tail: those below
/// [`SLOW_SHARE`] of the channels' mean pace whose next block (of `block` bytes) would
/// land after the channels still taking blocks have sent all `untaken` bytes (not yet
/// taken by any channel) and what they hold. Slowest first, each judged against those
/// not held: two slow channels must not each count on the other to take the rest. Never
/// every channel: the fastest is never below the mean.
pub fn held_back(
    channels: &[TailChannel<'_>],
    untaken: u64,
    block: u64,
    rtt: Duration,
    now: Instant,
) -> Vec<u16> {
    let Some(mean) = mean_pace(channels) else {
        return Vec::new();
    };
    let horizon = HOLD_HORIZON
        .max(rtt * HOLD_HORIZON_ROUND_TRIPS)
        .as_secs_f64();
    let paced: Vec<(&TailChannel<'_>, f64)> = channels
        .iter()
        .map(|c| (c, c.confirmations.rate_while_busy().unwrap_or(0.0)))
        .collect();
    let mut candidates: Vec<(&TailChannel<'_>, f64)> = paced
        .iter()
        .copied()
        .filter(|(c, rate)| *rate > 0.0 && *rate < SLOW_SHARE * mean && settled(c, rtt, now))
        .collect();
    candidates.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut held: Vec<u16> = Vec::new();
    for (c, rate) in candidates {
        let taking = paced
            .iter()
            .filter(|(o, _)| o.index != c.index && !held.contains(&o.index));
        let (others_rate, others_held) =
            taking.fold((0.0, 0u64), |(r, h), (o, rate)| (r + rate, h + o.held));
        if others_rate <= 0.0 {
            continue;
        }
        let others_end = (untaken + others_held) as f64 / others_rate;
        if others_end <= horizon && (c.held + block) as f64 / rate > others_end {
            held.push(c.index);
        }
    }
    held.sort_unstable();
    held
}

/// Which channels to cut now. Call only once every block has been handed to a channel:
/// before that an idle channel is waiting for the readers, not for the end.
pub fn stragglers(channels: &[TailChannel<'_>], rtt: Duration, now: Instant) -> Vec<u16> {
    let idle_rate: f64 = channels
        .iter()
        .filter(|c| c.held == 0)
        .filter_map(|c| c.confirmations.rate_while_busy())
        .sum();
    let Some(slow) = mean_pace(channels)
        .filter(|_| idle_rate > 0.0)
        .map(|mean| SLOW_SHARE * mean)
    else {
        return Vec::new(); // nobody to send it again, or no idea how fast they would
    };
    let round_trip = rtt.as_secs_f64();
    channels
        .iter()
        .filter(|c| c.held > 0 && settled(c, rtt, now))
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

    /// Path (b)'s slow run: seven channels at 20 MiB/s, one at 6 MiB/s holding 8 MiB.
    fn eight_one_slow<'a>(
        now: Instant,
        fast: &'a Confirmations,
        slow: &'a Confirmations,
    ) -> Vec<TailChannel<'a>> {
        let mut channels: Vec<TailChannel> = (0..7)
            .map(|index| chan(index, 8 * MIB, now - Duration::from_secs(2), fast))
            .collect();
        channels.push(chan(7, 8 * MIB, now - Duration::from_secs(2), slow));
        channels
    }

    fn paces(now: Instant) -> (Confirmations, Confirmations) {
        let ms = Duration::from_millis;
        (
            steady(now, ms(200), 4 * MIB, 8),
            steady(now, ms(667), 4 * MIB, 4),
        )
    }

    #[test]
    fn a_slow_channel_is_held_back_once_its_next_block_would_land_last() {
        let now = Instant::now() + Duration::from_secs(10);
        let (fast, slow) = paces(now);
        let channels = eight_one_slow(now, &fast, &slow);
        let rtt = Duration::from_millis(100);
        // Its next block lands in (8 + 4) / 6 = 2 s; the others send 200 MiB and their
        // 56 in 256 / 140 = 1.8 s.
        assert_eq!(held_back(&channels, 200 * MIB, 4 * MIB, rtt, now), vec![7]);
        // With 300 MiB not yet taken they need 2.5 s: the block is worth taking.
        assert!(held_back(&channels, 300 * MIB, 4 * MIB, rtt, now).is_empty());
    }

    #[test]
    fn channels_of_one_pace_are_never_held_back() {
        let now = Instant::now() + Duration::from_secs(10);
        let (fast, _) = paces(now);
        let channels = eight_one_slow(now, &fast, &fast);
        let rtt = Duration::from_millis(100);
        assert!(held_back(&channels, 0, 4 * MIB, rtt, now).is_empty());
    }

    #[test]
    fn a_channel_is_held_back_only_once_it_has_a_pace_of_its_own() {
        let now = Instant::now() + Duration::from_secs(10);
        let (fast, slow) = paces(now);
        let mut channels = eight_one_slow(now, &fast, &slow);
        // In its slow start on a 200 ms path: busy for 1.5 s, less than ten round trips.
        channels[7].busy_since = now - Duration::from_millis(1500);
        let rtt = Duration::from_millis(200);
        assert!(held_back(&channels, 0, 4 * MIB, rtt, now).is_empty());
        channels[7].busy_since = now - Duration::from_secs(2);
        assert_eq!(held_back(&channels, 0, 4 * MIB, rtt, now), vec![7]);
    }

    /// Two slow channels beside one fast one: each alone could be spared, but not both,
    /// or the fast one would have to send all that is left.
    #[test]
    fn slow_channels_do_not_each_count_on_the_other_to_take_the_rest() {
        let now = Instant::now() + Duration::from_secs(10);
        let ms = Duration::from_millis;
        let fast = steady(now, ms(200), 4 * MIB, 8); // 20 MiB/s
        let slower = steady(now, ms(1333), 4 * MIB, 8); // 3 MiB/s
        let slow = steady(now, ms(1143), 4 * MIB, 8); // 3.5 MiB/s
        let since = now - Duration::from_secs(2);
        let channels = [
            chan(0, 4 * MIB, since, &fast),
            chan(1, 4 * MIB, since, &slower),
            chan(2, 4 * MIB, since, &slow),
        ];
        let rtt = Duration::from_millis(50);
        // Channel 1's next block lands in 2.67 s, the 43 MiB left on 0 and 2 in 2.17 s:
        // held. Then channel 2's in 2.29 s, the rest on 0 alone in 2.35 s: it takes it
        // (counting on channel 1 as well, it would be held too).
        assert_eq!(held_back(&channels, 43 * MIB, 4 * MIB, rtt, now), vec![1]);
    }

    #[test]
    fn nothing_is_held_back_far_from_the_end() {
        let now = Instant::now() + Duration::from_secs(10);
        let ms = Duration::from_millis;
        let fast = steady(now, ms(200), 4 * MIB, 8);
        // At 0.4 MiB/s its next block would take half a minute, but the others have
        // 4 s of work left: its pace may be a dip, and held it is not measured again.
        let crawling = steady(now, ms(10_000), 4 * MIB, 2);
        let channels = eight_one_slow(now, &fast, &crawling);
        let rtt = Duration::from_millis(100);
        assert!(held_back(&channels, 500 * MIB, 4 * MIB, rtt, now).is_empty());
        assert_eq!(held_back(&channels, 300 * MIB, 4 * MIB, rtt, now), vec![7]);
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
