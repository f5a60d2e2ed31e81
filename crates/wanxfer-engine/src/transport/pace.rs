//! A session-wide rate kept by the pumps themselves, one block at a time (kissel2013 paces
//! at message granularity too).
//!
//! Why not only the kernel's pacing: `SO_MAX_PACING_RATE` paces what a socket sends, so it
//! serves a TCP sender. A receiving side (a pull, whose sender is the server) holds the
//! rate by reading no faster than it, which closes the window its sender sees; RDMA writes
//! have no kernel pacing at all. All the pumps of a session share one [`Pacer`], so the
//! rate is the session's whatever the number of channels. What this does not do: smooth
//! within a block (a block leaves at the link's speed; the average over blocks holds).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::pool::{Cancel, CANCEL_POLL};

/// How far ahead of the rate a pump may get after an idle spell: about one block at
/// 1 Gbit/s. Without it an idle pacer would owe nothing and then let a burst through.
const BURST: Duration = Duration::from_millis(20);

/// A token bucket over the session's channels.
#[derive(Debug)]
pub struct Pacer {
    bits_per_s: u64,
    /// When the next byte may go, as reserved by the pumps so far.
    next: Mutex<Instant>,
}

impl Pacer {
    /// A pacer to `bits_per_s` (at least 1).
    pub fn new(bits_per_s: u64) -> Pacer {
        Pacer {
            bits_per_s: bits_per_s.max(1),
            next: Mutex::new(Instant::now()),
        }
    }

    pub fn bits_per_s(&self) -> u64 {
        self.bits_per_s
    }

    /// Reserves `bytes` at the rate and waits until their turn (or `cancel`).
    pub fn take(&self, bytes: u64, cancel: &Cancel) {
        let cost = Duration::from_secs_f64(bytes as f64 * 8.0 / self.bits_per_s as f64);
        let start = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let start = (*next).max(now.checked_sub(BURST).unwrap_or(now));
            *next = start + cost;
            start
        };
        // The block may go once the ones reserved before it have had their time.
        while let Some(left) = start.checked_duration_since(Instant::now()) {
            if left.is_zero() || cancel.is_cancelled() {
                break;
            }
            std::thread::sleep(left.min(CANCEL_POLL));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reservations follow the rate: the n-th block waits for the n-1 before it, whatever
    /// thread takes it (counted on reservations, not on the clock).
    #[test]
    fn reservations_follow_the_rate() {
        let pacer = Pacer::new(8_000_000); // a megabyte a second
        let before = *pacer.next.lock().unwrap();
        let cancel = Cancel::default();
        cancel.cancel(); // reserve without sleeping
        for _ in 0..10 {
            pacer.take(100_000, &cancel);
        }
        let after = *pacer.next.lock().unwrap();
        let reserved = after.duration_since(before);
        assert!(
            reserved >= Duration::from_millis(1000) - BURST
                && reserved <= Duration::from_millis(1000) + BURST,
            "{reserved:?}"
        );
    }
}
