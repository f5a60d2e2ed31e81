//! Counters a user interface can poll while a session runs, and CPU accounting.
//!
//! The engine never prints: it updates atomics, and whoever drives it (the CLI's
//! progress bar, a benchmark, a test) reads them when it likes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::pool::{Pool, PoolGauge};
use crate::session::steer::{ChannelReport, DecisionReport};

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
    /// Fabric sender: microseconds its channels waited with a block to write and no
    /// credit to write it into, summed over channels.
    pub fabric_credit_wait_us: AtomicU64,
    /// Payload bytes by channel index, the first [`COUNTED_CHANNELS`] channels.
    channel_bytes: ChannelBytes,
    /// The session's block pools (its buffer pool; a fabric receiver's slot pools), for
    /// watchers of their occupancy. Weak: watching keeps no memory.
    pools: Mutex<Vec<(PoolKind, PoolGauge)>>,
    /// What the client's session measured and decided lately, and the peer's status.
    live: Mutex<Live>,
}

/// Tuner decisions kept for a watcher between two of its reads; older ones are counted,
/// not kept.
pub const LIVE_DECISIONS: usize = 32;

/// The session's latest measurements, for watchers (`--progress-json`, the bar). The
/// driver writes it as it samples its sockets; a watcher copies it out under a short lock.
#[derive(Debug, Clone, Default)]
pub struct Live {
    /// Client: data channels up and not being retired; 0 before the first sample.
    pub streams: u16,
    /// Client, TCP: each data channel as its socket last saw it.
    pub channels: Vec<ChannelReport>,
    /// Client, TCP: bytes the data sockets delivered in all, the ended ones' included
    /// (`Steer::delivered`): the network's count, where `Progress::bytes` counts whole
    /// blocks as they are handed to a socket.
    pub delivered_bytes: Option<u64>,
    /// Client: the tuner's latest decisions, each numbered from 1 in the order made.
    pub decisions: VecDeque<(u64, DecisionReport)>,
    /// How many decisions were made in all (the number of the latest).
    pub decisions_made: u64,
    /// The peer's latest periodic status, if it sends one.
    pub peer: Option<PeerStatus>,
}

/// The peer's side of the session while it runs (`wanxfer_proto::PeerStatus` as
/// received).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerStatus {
    /// The CPU the peer's threads of this session used so far.
    pub cpu: CpuTime,
    /// Its block pool: buffers on loan and in all.
    pub pool_in_use: u32,
    pub pool_capacity: u32,
    /// A fabric receiver's registered slots on loan and in all, and the credits its
    /// sender holds.
    pub slots_in_use: u32,
    pub slots_capacity: u32,
    pub fabric_credits: u32,
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
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.streams = 0;
        live.channels.clear();
        live.delivered_bytes = None;
        live.peer = None;
    }

    /// A copy of the latest measurements and decisions.
    pub fn live(&self) -> Live {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The client's latest sample of its data channels.
    pub fn set_live_channels(
        &self,
        streams: u16,
        channels: Vec<ChannelReport>,
        delivered_bytes: Option<u64>,
    ) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.streams = streams;
        live.channels = channels;
        live.delivered_bytes = delivered_bytes.or(live.delivered_bytes);
    }

    /// The tuner decided: kept for watchers, the oldest dropped beyond
    /// [`LIVE_DECISIONS`].
    pub fn push_decision(&self, decision: DecisionReport) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.decisions_made += 1;
        let number = live.decisions_made;
        live.decisions.push_back((number, decision));
        while live.decisions.len() > LIVE_DECISIONS {
            live.decisions.pop_front();
        }
    }

    /// The peer's latest status arrived.
    pub fn set_peer_status(&self, status: PeerStatus) {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).peer = Some(status);
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
/// several sessions reports each one's own cost, at the end ([`CpuMeter::total`]) and
/// while it runs ([`CpuMeter::so_far`]).
#[derive(Debug, Default)]
pub struct CpuMeter {
    /// Threads that ended, and the running threads that entered, by kernel thread id.
    /// One lock for both, so that a thread ending is counted once, never twice.
    inner: Mutex<MeterInner>,
}

#[derive(Debug, Default)]
struct MeterInner {
    ended: CpuTime,
    running: Vec<libc::pid_t>,
}

/// Most running threads a meter follows: more than a session ever has (its links are
/// bounded by its streams, its workers by the server's flags). Beyond it a thread is
/// still counted when it ends.
const METERED_THREADS: usize = 1024;

impl CpuMeter {
    /// Counts the calling thread in [`CpuMeter::so_far`] while it runs; call as it
    /// starts, and [`CpuMeter::add_this_thread`] as it ends.
    pub fn enter_this_thread(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.running.len() < METERED_THREADS {
            inner.running.push(this_thread_id());
        }
    }

    /// Adds the calling thread's CPU; call once, as the thread ends.
    pub fn add_this_thread(&self) {
        let t = thread_cpu();
        let id = this_thread_id();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.running.retain(|&r| r != id);
        inner.ended.user_us += t.user_us;
        inner.ended.sys_us += t.sys_us;
    }

    /// The CPU of the threads that ended.
    pub fn total(&self) -> CpuTime {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).ended
    }

    /// The threads that ended and, so far, those still running (from
    /// `/proc/self/task/*/stat`, to the kernel's clock tick).
    pub fn so_far(&self) -> CpuTime {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut sum = inner.ended;
        for &id in &inner.running {
            if let Some(t) = running_thread_cpu(id) {
                sum.user_us += t.user_us;
                sum.sys_us += t.sys_us;
            }
        }
        sum
    }
}

fn this_thread_id() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// A running thread of this process's CPU, from its `stat` (fields 14 and 15, after the
/// parenthesised name, which may itself hold spaces and parentheses).
fn running_thread_cpu(id: libc::pid_t) -> Option<CpuTime> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{id}/stat")).ok()?;
    parse_thread_stat(&stat, clock_ticks_per_s())
}

fn parse_thread_stat(stat: &str, ticks_per_s: u64) -> Option<CpuTime> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name: state (field 3) first, so utime (14) is the 12th.
    let mut fields = after_name.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let sys: u64 = fields.next()?.parse().ok()?;
    let us = |ticks: u64| ticks.saturating_mul(1_000_000) / ticks_per_s.max(1);
    Some(CpuTime {
        user_us: us(user),
        sys_us: us(sys),
    })
}

fn clock_ticks_per_s() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0).unwrap_or(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_stat_gives_its_user_and_system_time() {
        let stat = "1234 (wanxfer) link0) R 1 2 3 4 5 6 7 8 9 10 250 75 0 0 20 0 1 0";
        let cpu = parse_thread_stat(stat, 100).unwrap();
        assert_eq!(
            cpu,
            CpuTime {
                user_us: 2_500_000,
                sys_us: 750_000
            }
        );
        assert_eq!(parse_thread_stat("garbage", 100), None);
        assert_eq!(parse_thread_stat("1 (x) R 1 2", 100), None);
    }

    #[test]
    fn a_running_thread_counts_once_and_an_ended_one_stays() {
        let meter = std::sync::Arc::new(CpuMeter::default());
        let (m, (stop_tx, stop_rx)) = (meter.clone(), std::sync::mpsc::channel::<()>());
        let (busy_tx, busy_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            m.enter_this_thread();
            // Spin until this thread has used some CPU the kernel can see.
            while running_thread_cpu(this_thread_id()).unwrap().seconds() < 0.03 {}
            busy_tx.send(()).unwrap();
            stop_rx.recv().unwrap();
            m.add_this_thread();
        });
        busy_rx.recv().unwrap();
        let running = meter.so_far();
        assert!(running.seconds() >= 0.03, "{running:?}");
        assert_eq!(meter.total(), CpuTime::default());
        stop_tx.send(()).unwrap();
        worker.join().unwrap();
        let ended = meter.total();
        assert!(
            ended.seconds() >= running.seconds() - 0.011,
            "{ended:?} {running:?}"
        );
        assert_eq!(
            meter.so_far(),
            ended,
            "an ended thread is not counted twice"
        );
    }

    /// A thread that worked for a session before it knew which (a server's data
    /// connection, through its TLS handshake and join) adds its whole CPU when it hands
    /// over, without having entered.
    #[test]
    fn a_thread_that_never_entered_adds_all_it_used() {
        let meter = std::sync::Arc::new(CpuMeter::default());
        let m = meter.clone();
        let used = std::thread::spawn(move || {
            while thread_cpu().seconds() < 0.02 {}
            let used = thread_cpu();
            m.add_this_thread();
            used
        })
        .join()
        .unwrap();
        let total = meter.total();
        assert!(total.seconds() >= used.seconds(), "{total:?} {used:?}");
        assert_eq!(meter.so_far(), total);
    }
}
