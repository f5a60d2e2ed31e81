//! The forwarder: one thread that reads packets from both TUN devices, asks each
//! direction's [`Link`] what becomes of them, and writes them to the other side when
//! their time comes. Between events it sleeps in `ppoll` with a timeout to the next
//! delivery (timer slack set to the minimum), so an idle link costs nothing and a busy
//! one is paced to the microsecond.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::link::{Fate, Link};
use crate::{Config, Outage, Report};

/// Packets read from one device before looking at the clock again.
const READ_BATCH: usize = 64;
/// How often the shared counters are refreshed.
const PUBLISH_EVERY: Duration = Duration::from_millis(50);
/// The longest sleep, so that a stop request is seen promptly.
const MAX_SLEEP: Duration = Duration::from_millis(50);

/// A packet waiting for its delivery time; ordered by time, then arrival.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Pending {
    at: u64,
    seq: u64,
    dir: usize,
    data: Vec<u8>,
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
    let mut queue: BinaryHeap<Reverse<Pending>> = BinaryHeap::new();
    let mut buf = vec![0u8; 65_536];
    let mut seq = 0u64;
    let mut published = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        let now = start.elapsed();
        deliver_due(&mut queue, &mut devices, &mut links, now.as_nanos() as u64)?;
        for dir in 0..2 {
            for _ in 0..READ_BATCH {
                let n = match devices[dir].read(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                let now = start.elapsed();
                let mut packet = buf[..n].to_vec();
                let cut = in_outage(&config.outages, now, dir);
                if let Fate::Deliver(times) =
                    links[dir].admit(&mut packet, now.as_nanos() as u64, cut)
                {
                    for at in times {
                        seq += 1;
                        queue.push(Reverse(Pending {
                            at,
                            seq,
                            dir,
                            data: packet.clone(),
                        }));
                    }
                }
            }
        }
        let now = start.elapsed();
        if now - published >= PUBLISH_EVERY {
            publish(report, &links, start, cpu_start);
            published = now;
        }
        let next = queue.peek().map(|Reverse(p)| Duration::from_nanos(p.at));
        let sleep = next.map_or(MAX_SLEEP, |at| at.saturating_sub(now).min(MAX_SLEEP));
        if !sleep.is_zero() {
            wait_readable(&devices, sleep)?;
        }
    }
    publish(report, &links, start, cpu_start);
    Ok(())
}

fn deliver_due(
    queue: &mut BinaryHeap<Reverse<Pending>>,
    devices: &mut [File; 2],
    links: &mut [Link; 2],
    now: u64,
) -> io::Result<()> {
    while queue.peek().is_some_and(|Reverse(p)| p.at <= now) {
        let Reverse(p) = queue.pop().expect("peeked");
        match devices[1 - p.dir].write(&p.data) {
            Ok(_) => links[p.dir].delivered(p.data.len()),
            // The far stack would not take it: as if lost on the wire.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAGAIN | libc::ENOBUFS | libc::EINVAL)
                ) => {}
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
