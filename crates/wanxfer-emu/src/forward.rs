//! The forwarder: one thread that reads frames (virtio-net header + packet, a packet
//! often being a 64 KB GSO batch) from both TUN devices, asks each direction's [`Link`]
//! what becomes of each MSS segment, and writes them to the other side when
//! their time comes. Between events it sleeps in `ppoll` with a timeout to the next
//! delivery (timer slack set to the minimum), so an idle link costs nothing and a busy
//! one is paced to the microsecond.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::link::{Decision, Link};
use crate::packet::{self, VnetHdr, VNET_HDR_LEN};
use crate::{Config, FlowOutage, Outage, Report};

/// Packets read from one device before looking at the clock again.
const READ_BATCH: usize = 64;
/// How often the shared counters are refreshed.
const PUBLISH_EVERY: Duration = Duration::from_millis(50);
/// The longest sleep, so that a stop request is seen promptly.
const MAX_SLEEP: Duration = Duration::from_millis(50);

/// Connections remembered for per-flow outages; later ones are not told apart (and so
/// never cut), which a test opening this many would notice in the report.
const MAX_FLOWS: usize = 4096;

/// Room for the largest GSO batch a TUN hands over (64 KB) and its virtio-net header.
const FRAME_MAX: usize = 128 * 1024;

/// A frame (virtio-net header + packet) waiting for its delivery time; ordered by time,
/// then arrival.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Pending {
    at: u64,
    seq: u64,
    dir: usize,
    /// Segments and wire bytes it stands for.
    segments: u64,
    wire: u64,
    data: Vec<u8>,
}

/// Frames on their way, in delivery order.
#[derive(Default)]
struct DelayLine {
    heap: BinaryHeap<Reverse<Pending>>,
    seq: u64,
}

impl DelayLine {
    fn push(&mut self, dir: usize, at: u64, segments: u64, wire: u64, data: Vec<u8>) {
        self.seq += 1;
        self.heap.push(Reverse(Pending {
            at,
            seq: self.seq,
            dir,
            segments,
            wire,
            data,
        }));
    }

    fn next_at(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse(p)| p.at)
    }
}

/// The TCP connections seen so far, numbered in the order they opened, for
/// [`FlowOutage`]s. Only kept when there are flow outages to apply.
struct Flows<'a> {
    outages: &'a [FlowOutage],
    /// Number (from 1) and opening time of each connection.
    seen: HashMap<packet::FlowKey, (u32, u64)>,
    /// For outages that lose a share of packets (a stream of its own, so that the
    /// links' draws stay what they are without them).
    rng: ChaCha8Rng,
}

impl<'a> Flows<'a> {
    fn new(outages: &'a [FlowOutage], seed: u64) -> Self {
        Flows {
            outages,
            seen: HashMap::new(),
            rng: ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_f10e),
        }
    }

    /// Whether `packet`'s connection is in one of its outages at `now`.
    fn cut(&mut self, packet: &[u8], now: u64) -> bool {
        if self.outages.is_empty() {
            return false;
        }
        let Some((key, opening)) = packet::tcp_flow(packet) else {
            return false;
        };
        let number = self.seen.len() as u32 + 1;
        let (flow, opened) = match self.seen.get(&key) {
            Some(&known) => known,
            None if opening && self.seen.len() < MAX_FLOWS => {
                *self.seen.entry(key).or_insert((number, now))
            }
            None => return false,
        };
        let age = Duration::from_nanos(now.saturating_sub(opened));
        let loss = self
            .outages
            .iter()
            .filter(|o| o.flow == flow && o.from <= age && age < o.to)
            .map(|o| o.loss)
            .fold(0.0, f64::max);
        loss >= 1.0 || (loss > 0.0 && self.rng.random_bool(loss))
    }
}

pub fn run(
    left: File,
    right: File,
    config: &Config,
    stop: &AtomicBool,
    report: &Mutex<Report>,
) -> io::Result<()> {
    prepare_thread(config.cpu);
    let mut devices = [left, right];
    let mut links = [
        Link::new(config.forward.clone(), config.seed),
        Link::new(
            config.back.clone(),
            config.seed.rotate_left(32) ^ 0x9e37_79b9,
        ),
    ];
    let start = Instant::now();
    let cpu_start = thread_cpu_seconds();
    let mut line = DelayLine::default();
    let mut buf = vec![0u8; FRAME_MAX];
    let mut published = Duration::ZERO;
    let mut flows = Flows::new(&config.flow_outages, config.seed);
    while !stop.load(Ordering::Relaxed) {
        let now = start.elapsed();
        deliver_due(&mut line, &mut devices, &mut links, now.as_nanos() as u64)?;
        for dir in 0..2 {
            for _ in 0..READ_BATCH {
                let n = match devices[dir].read(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                let now = start.elapsed();
                let cut = in_outage(&config.outages, now, dir);
                let now = now.as_nanos() as u64;
                let cut = cut || flows.cut(buf.get(VNET_HDR_LEN..n).unwrap_or_default(), now);
                admit_frame(&buf[..n], dir, &mut links[dir], &mut line, now, cut);
            }
        }
        let now = start.elapsed();
        if now - published >= PUBLISH_EVERY {
            publish(report, &links, start, cpu_start);
            published = now;
        }
        let next = line.next_at().map(Duration::from_nanos);
        let sleep = next.map_or(MAX_SLEEP, |at| at.saturating_sub(now).min(MAX_SLEEP));
        if !sleep.is_zero() {
            wait_readable(&devices, sleep)?;
        }
    }
    publish(report, &links, start, cpu_start);
    Ok(())
}

/// Takes one frame read from a TUN through `link`: a GSO batch whose segments are all
/// simply delivered travels whole, arriving with its last segment; otherwise it is split
/// and each segment meets its own fate.
fn admit_frame(
    frame: &[u8],
    dir: usize,
    link: &mut Link,
    line: &mut DelayLine,
    now: u64,
    cut: bool,
) {
    let Some(hdr) = VnetHdr::parse(frame) else {
        return;
    };
    let packet = &frame[VNET_HDR_LEN..];
    let Some(batch) = packet::gso_batch(&hdr, packet) else {
        let decision = link.decide(packet.len(), now, cut);
        place(frame.to_vec(), hdr, decision, dir, link, line);
        return;
    };
    link.counters.gso_batches += 1;
    let decisions: Vec<Decision> = (0..batch.segments())
        .map(|i| link.decide(batch.segment_len(i), now, cut))
        .collect();
    if decisions.iter().all(Decision::is_plain) {
        let at = decisions.iter().filter_map(arrival).max().unwrap_or(now);
        let segments = decisions.len() as u64;
        line.push(dir, at, segments, batch.wire_len() as u64, frame.to_vec());
        return;
    }
    link.counters.gso_split += 1;
    for (segment, decision) in packet::split(packet, &batch).into_iter().zip(decisions) {
        place(segment, VnetHdr::default(), decision, dir, link, line);
    }
}

fn arrival(decision: &Decision) -> Option<u64> {
    match decision {
        Decision::Deliver { at, .. } => Some(*at),
        Decision::Dropped => None,
    }
}

/// Puts one single-segment frame on the delay line as `decision` says.
fn place(
    mut frame: Vec<u8>,
    mut hdr: VnetHdr,
    decision: Decision,
    dir: usize,
    link: &mut Link,
    line: &mut DelayLine,
) {
    let Decision::Deliver {
        at,
        duplicate,
        corrupt,
        ..
    } = decision
    else {
        return;
    };
    if let Some(pick) = corrupt {
        let (head, packet) = frame.split_at_mut(VNET_HDR_LEN);
        packet::finish_checksum(&mut hdr, packet);
        head.copy_from_slice(&hdr.encode());
        link.corrupt(packet, pick);
    }
    let wire = (frame.len() - VNET_HDR_LEN) as u64;
    if duplicate {
        line.push(dir, at + 1, 1, wire, frame.clone());
    }
    line.push(dir, at, 1, wire, frame);
}

fn deliver_due(
    line: &mut DelayLine,
    devices: &mut [File; 2],
    links: &mut [Link; 2],
    now: u64,
) -> io::Result<()> {
    while line.next_at().is_some_and(|at| at <= now) {
        let Reverse(p) = line.heap.pop().expect("peeked");
        match devices[1 - p.dir].write(&p.data) {
            Ok(_) => links[p.dir].delivered(p.segments, p.wire),
            // The far stack would not take it: as if lost on the wire.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAGAIN | libc::ENOBUFS | libc::EINVAL)
                ) =>
            {
                links[p.dir].counters.dropped_write += p.segments;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn in_outage(outages: &[Outage], now: Duration, dir: usize) -> bool {
    outages
        .iter()
        .any(|o| (o.both_ways || dir == 0) && o.from <= now && now < o.to)
}

fn publish(report: &Mutex<Report>, links: &[Link; 2], start: Instant, cpu_start: f64) {
    let mut r = report.lock().expect("no panics while held");
    r.forward = links[0].counters.clone();
    r.back = links[1].counters.clone();
    r.cpu_seconds = thread_cpu_seconds() - cpu_start;
    r.max_rss_bytes = max_rss_bytes();
    r.wall_seconds = start.elapsed().as_secs_f64();
}

/// Sleeps until a device has a packet or `timeout` passes.
fn wait_readable(devices: &[File; 2], timeout: Duration) -> io::Result<()> {
    let mut fds = devices.each_ref().map(|d| libc::pollfd {
        fd: d.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    });
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `fds` and `ts` are valid for the call; no signal mask is changed.
    let rc = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// Minimal timer slack (sleeps end on time, not up to 50 µs late) and the chosen core.
fn prepare_thread(cpu: Option<usize>) {
    // SAFETY: prctl with PR_SET_TIMERSLACK takes a plain integer.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    if let Some(cpu) = cpu {
        // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes within it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

fn thread_cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct; RUSAGE_THREAD is valid on Linux.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn max_rss_bytes() -> u64 {
    // SAFETY: getrusage fills the zeroed struct; RUSAGE_SELF is always valid.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    u64::try_from(usage.ru_maxrss).unwrap_or(0) * 1024 // kilobytes on Linux
}
