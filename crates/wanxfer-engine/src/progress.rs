//! Counters a user interface can poll while a session runs, and CPU accounting.
//!
//! The engine never prints: it updates atomics, and whoever drives it (the CLI's
//! progress bar, a benchmark, a test) reads them when it likes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::pool::{Pool, PoolGauge};

/// Channels whose bytes are counted one by one; a channel of a higher index is counted
/// only in the session's total. Bounds what a watcher (metrics) reports per session.
pub const COUNTED_CHANNELS: usize = 64;

/// Live counters of one session, seen from this side.
#[derive(Debug, Default)]
pub struct Progress {
    /// Payload bytes moved over the data channels.
    pub bytes: AtomicU64,
    /// Bytes not moved because the receiver had them: files up to date, ranges resumed.
    pub bytes_skipped: AtomicU64,
    /// Files verified and in place (or, discarding, fully received).
    pub files: AtomicU64,
    /// Bytes and files announced so far; final once the manifest is complete.
    pub total_bytes: AtomicU64,
    pub total_files: AtomicU64,
    pub failed_files: AtomicU64,
    /// `--io zerocopy`: sends made with `MSG_ZEROCOPY`, and how many of them the kernel
    /// reported it copied after all (all of them on loopback).
    pub zerocopy_sends: AtomicU64,
    pub zerocopy_copied: AtomicU64,
    /// Sending: the first reason a channel did less than `--io` asked for (see
    /// [`IoUse::fallback`]).
    pub io_fallback: OnceLock<String>,
    /// Microseconds sending channels spent waiting for a block to send, summed over
    /// channels: the share of their time the disks or readers kept them idle.
    pub channel_wait_us: AtomicU64,
    /// Fabric receiver: slots granted to the sender and not yet written (its credits).
    pub fabric_credits: AtomicU64,
    /// Payload bytes by channel index, the first [`COUNTED_CHANNELS`] channels.
    channel_bytes: ChannelBytes,
    /// The session's block pools (its buffer pool; a fabric receiver's slot pools), for
    /// watchers of their occupancy. Weak: watching keeps no memory.
    pools: Mutex<Vec<(PoolKind, PoolGauge)>>,
}

/// What a watched pool's buffers are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// The session's block buffers (TCP channels, and a fabric sender's).
    Blocks,
    /// A fabric receiving channel's registered slots: each one on loan is a credit the
    /// sender does not have.
    FabricSlots,
}

impl PoolKind {
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Blocks => "blocks",
            PoolKind::FabricSlots => "fabric_slots",
        }
    }
}

#[derive(Debug)]
struct ChannelBytes(Box<[AtomicU64]>);

impl Default for ChannelBytes {
    fn default() -> Self {
        ChannelBytes((0..COUNTED_CHANNELS).map(|_| AtomicU64::new(0)).collect())
    }
}

/// How one side moved file bytes in a session, reported at its end (the server's in its
/// `Stats`), so that a fallback is seen where it happened instead of guessed from a rate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IoUse {
    /// Sending: `sendfile`, `copy` or `zerocopy`; receiving: `direct`, `buffered` (how
    /// files of more than one block were written) or `discard`.
    pub mode: String,
    /// Receiving: bytes written with `O_DIRECT`.
    pub direct_bytes: u64,
    /// The first thing that made this side do less than its mode asked for: a file
    /// system refusing `sendfile` or `O_DIRECT`, say. Later ones are usually the same.
    pub fallback: Option<String>,
}

impl Progress {
    /// Starts counting a new attempt of a transfer.
    pub fn reset_totals(&self) {
        for counter in [
            &self.bytes,
            &self.bytes_skipped,
            &self.files,
            &self.total_bytes,
            &self.total_files,
            &self.failed_files,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        for counter in self.channel_bytes.0.iter() {
            counter.store(0, Ordering::Relaxed);
        }
    }

    /// `len` payload bytes moved over channel `index` (sent, or received and checked).
    pub fn moved(&self, index: u16, len: u64) {
        self.bytes.fetch_add(len, Ordering::Relaxed);
        if let Some(counter) = self.channel_bytes.0.get(usize::from(index)) {
            counter.fetch_add(len, Ordering::Relaxed);
        }
    }

    /// Bytes moved so far on each channel that moved any, by index.
    pub fn channel_bytes(&self) -> Vec<(u16, u64)> {
        (0u16..)
            .zip(self.channel_bytes.0.iter())
            .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Lets watchers see `pool`'s occupancy while it lives.
    pub fn watch_pool(&self, kind: PoolKind, pool: &Pool) {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        // Pools of channels that ended go, so the list stays as long as the live ones.
        pools.retain(|(_, gauge)| gauge.occupancy().is_some());
        pools.push((kind, pool.gauge()));
    }

    /// Buffers on loan and in all, per kind of pool, summed over the live pools.
    pub fn pool_occupancy(&self) -> Vec<(PoolKind, usize, usize)> {
        let pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        let mut sums: Vec<(PoolKind, usize, usize)> = Vec::new();
        for (kind, gauge) in pools.iter() {
            let Some((in_use, capacity)) = gauge.occupancy() else {
                continue;
            };
            match sums.iter_mut().find(|(k, _, _)| k == kind) {
                Some((_, u, c)) => {
                    *u += in_use;
                    *c += capacity;
                }
                None => sums.push((*kind, in_use, capacity)),
            }
        }
        sums
    }

    /// Bytes done (moved or found in place), files done, and the totals announced.
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.bytes.load(Ordering::Relaxed) + self.bytes_skipped.load(Ordering::Relaxed),
            self.files.load(Ordering::Relaxed),
            self.total_bytes.load(Ordering::Relaxed),
            self.total_files.load(Ordering::Relaxed),
        )
    }
}

/// User and system CPU time in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTime {
    pub user_us: u64,
    pub sys_us: u64,
}

impl CpuTime {
    /// User and system time together, in seconds, as reports and benchmarks show it.
    pub fn seconds(self) -> f64 {
        (self.user_us + self.sys_us) as f64 / 1e6
    }
}

fn rusage(who: libc::c_int) -> CpuTime {
    // SAFETY: getrusage only writes into the struct we pass; a zeroed rusage is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage; RUSAGE_SELF/RUSAGE_THREAD are valid `who`.
    let rc = unsafe { libc::getrusage(who, &mut ru) };
    if rc != 0 {
        return CpuTime::default();
    }
    let us = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000 + tv.tv_usec as u64;
    CpuTime {
        user_us: us(ru.ru_utime),
        sys_us: us(ru.ru_stime),
    }
}

/// CPU used by the whole process so far.
pub fn process_cpu() -> CpuTime {
    rusage(libc::RUSAGE_SELF)
}

/// CPU used by the calling thread so far.
pub fn thread_cpu() -> CpuTime {
    rusage(libc::RUSAGE_THREAD)
}

/// Sums the CPU of the threads that worked for one session, so that a server running
/// several sessions reports each one's own cost.
#[derive(Debug, Default)]
pub struct CpuMeter {
    user_us: AtomicU64,
    sys_us: AtomicU64,
}

impl CpuMeter {
    /// Adds the calling thread's CPU; call once, as the thread ends.
    pub fn add_this_thread(&self) {
        let t = thread_cpu();
        self.user_us.fetch_add(t.user_us, Ordering::Relaxed);
        self.sys_us.fetch_add(t.sys_us, Ordering::Relaxed);
    }

    pub fn total(&self) -> CpuTime {
        CpuTime {
            user_us: self.user_us.load(Ordering::Relaxed),
            sys_us: self.sys_us.load(Ordering::Relaxed),
        }
    }
}
