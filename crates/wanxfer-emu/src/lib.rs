//! wanxfer's WAN emulator: two network namespaces (`left`, `right`) whose only link is a
//! user-space forwarder applying delay, jitter, a bottleneck rate and buffer, loss,
//! reordering, duplication, payload corruption and cuts.
//!
//! Why in user space: this kernel has no netem (nor fq, red or police), and a data mover
//! never tried on a long fat path is untested (jin2005 §3 built `degen`, kissel2013 §3.6
//! a hardware emulator with a 1 MB policer buffer, for the same reason). Why namespaces:
//! both ends run real kernel TCP (and libfabric's tcp provider) with their own buffer
//! settings, and the test traffic never leaves the machine.
//!
//! Every random choice comes from one seed, printed in the report, so a failing run can
//! be repeated.
//!
//! Why GSO batches: the TUN devices carry a virtio-net header and offer TSO and checksum
//! offload, so the sender's stack hands the forwarder up to 64 KB of TCP per packet (44
//! segments of 1448 bytes) and the receiver's stack takes such batches whole; a
//! forwarder that moves one 1500-byte packet per system call tops out near 1 Gbit/s on
//! this machine. Every decision (loss, corruption, queue, reordering, duplication) is
//! still taken per MSS segment with wire lengths, and a batch is split (headers and
//! checksums fixed up) only when one of its segments is not simply delivered, so a loss
//! costs one segment, as on a real path.

mod forward;
mod link;
mod netns;
mod packet;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

pub use link::{Counters, Decision, Fate, Link, LinkConfig};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("setting up the emulated link: {what}: {detail} (the emulator needs root, iproute2 and /dev/net/tun)")]
    Setup { what: String, detail: String },
    #[error("the forwarder failed: {0}")]
    Forward(std::io::Error),
}

/// A span of time, from the emulator's start, during which the link drops packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    pub from: Duration,
    pub to: Duration,
    /// Both directions (a cut) or left-to-right only (a blackhole).
    pub both_ways: bool,
}

/// A span during which one TCP connection, both ways, loses every packet (or a share of
/// them) while the others carry on: one stream of several going dark behind a failing
/// router or a stuck ECMP path, which is what a data mover's failover has to notice, or
/// hashed onto a lossy member of a link aggregate, so that it runs far slower than its
/// siblings, which is what its scheduling at the end has to notice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowOutage {
    /// The connection, counted from 1 in the order the emulator sees them open (their
    /// first SYN), whichever side opens them.
    pub flow: u32,
    /// From the connection's opening.
    pub from: Duration,
    pub to: Duration,
    /// The share of its packets lost in the span: 1 for dark.
    pub loss: f64,
}

impl FlowOutage {
    /// Connection `flow` loses every packet from `from` on.
    pub fn dark(flow: u32, from: Duration) -> FlowOutage {
        FlowOutage {
            flow,
            from,
            to: Duration::MAX,
            loss: 1.0,
        }
    }
}

/// The whole emulated path.
#[derive(Debug, Clone)]
pub struct Config {
    /// Left to right.
    pub forward: LinkConfig,
    /// Right to left.
    pub back: LinkConfig,
    pub outages: Vec<Outage>,
    pub flow_outages: Vec<FlowOutage>,
    pub seed: u64,
    /// `tcp_rmem`/`tcp_wmem` maximum inside both namespaces (at least 2 × BDP).
    pub tcp_mem: u64,
    /// The core the forwarder runs on, if any.
    pub cpu: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            forward: LinkConfig::default(),
            back: LinkConfig::default(),
            outages: Vec::new(),
            flow_outages: Vec::new(),
            seed: 1,
            tcp_mem: 64 << 20,
            cpu: None,
        }
    }
}

impl Config {
    /// The same settings both ways, with `rtt` split evenly.
    pub fn symmetric(link: LinkConfig, rtt: Duration) -> Config {
        let one_way = LinkConfig {
            delay: rtt / 2,
            ..link
        };
        Config {
            forward: one_way.clone(),
            back: one_way,
            ..Config::default()
        }
    }
}

/// What the emulator saw, per direction, and what it cost.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub seed: u64,
    pub forward: Counters,
    pub back: Counters,
    /// CPU seconds of the forwarder thread.
    pub cpu_seconds: f64,
    pub wall_seconds: f64,
    /// Peak resident memory of the whole process (getrusage `ru_maxrss`): for the
    /// `wanxfer-emu` binary, the emulator's; it should stay near rate × delay + buffer.
    pub max_rss_bytes: u64,
    /// Packets the kernel dropped before the emulator saw them (must be 0 for a valid
    /// measurement), per side.
    pub tun_tx_dropped: [Option<u64>; 2],
}

/// A running emulated path; dropping it stops the forwarder and removes the namespaces.
pub struct Emulator {
    left: netns::Host,
    right: netns::Host,
    stop: Arc<AtomicBool>,
    forwarder: Option<JoinHandle<Result<(), std::io::Error>>>,
    report: Arc<Mutex<Report>>,
}

pub const LEFT_IP: &str = "10.77.0.1";
pub const RIGHT_IP: &str = "10.77.0.2";

impl Emulator {
    pub fn start(config: Config) -> Result<Emulator, Error> {
        let prefix = netns::unique_prefix();
        let (left_ns, right_ns) = (format!("{prefix}l"), format!("{prefix}r"));
        let setup = || -> Result<(netns::Host, netns::Host), Error> {
            let left = netns::host(
                &left_ns,
                &format!("{prefix}a"),
                LEFT_IP,
                RIGHT_IP,
                config.tcp_mem,
            )?;
            let right = netns::host(
                &right_ns,
                &format!("{prefix}b"),
                RIGHT_IP,
                LEFT_IP,
                config.tcp_mem,
            )?;
            Ok((left, right))
        };
        let (left, right) = setup().inspect_err(|_| {
            netns::remove(&left_ns);
            netns::remove(&right_ns);
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let report = Arc::new(Mutex::new(Report {
            seed: config.seed,
            ..Report::default()
        }));
        let fds = (left.tun.try_clone(), right.tun.try_clone());
        let (Ok(l), Ok(r)) = fds else {
            return Err(Error::Setup {
                what: "duplicating TUN descriptors".into(),
                detail: std::io::Error::last_os_error().to_string(),
            });
        };
        let forwarder = {
            let (stop, report) = (stop.clone(), report.clone());
            std::thread::Builder::new()
                .name("wanxfer-emu".into())
                .spawn(move || forward::run(l, r, &config, &stop, &report))
                .map_err(|e| Error::Setup {
                    what: "starting the forwarder".into(),
                    detail: e.to_string(),
                })?
        };
        Ok(Emulator {
            left,
            right,
            stop,
            forwarder: Some(forwarder),
            report,
        })
    }

    /// `ip netns exec LEFT program`: a command to run on the left host.
    pub fn left(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        in_netns(&self.left.netns, program)
    }

    /// A command to run on the right host.
    pub fn right(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        in_netns(&self.right.netns, program)
    }

    pub fn namespaces(&self) -> [&str; 2] {
        [&self.left.netns, &self.right.netns]
    }

    /// The counters so far.
    pub fn report(&self) -> Report {
        let mut report = self.report.lock().expect("no panics while held").clone();
        report.tun_tx_dropped = [
            netns::tx_dropped(&self.left),
            netns::tx_dropped(&self.right),
        ];
        report
    }

    /// Stops the forwarder and returns the final counters (the namespaces go on drop).
    pub fn stop(mut self) -> Result<Report, Error> {
        self.halt()?;
        Ok(self.report())
    }

    fn halt(&mut self) -> Result<(), Error> {
        self.stop.store(true, Ordering::SeqCst);
        match self.forwarder.take().map(|h| h.join()) {
            Some(Ok(Err(e))) => Err(Error::Forward(e)),
            _ => Ok(()),
        }
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.halt();
        kill_namespace_processes(&self.left.netns);
        kill_namespace_processes(&self.right.netns);
        netns::remove(&self.left.netns);
        netns::remove(&self.right.netns);
    }
}

fn in_netns(netns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns]).arg(program);
    cmd
}

/// Ends whatever still runs inside a namespace, so that nothing outlives the emulator.
fn kill_namespace_processes(netns: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if let Ok(pid) = pid.parse::<i32>() {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Whether this process can build the emulated path (root, namespaces, TUN); tests skip
/// with the reason when not.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the WAN emulator needs root (network namespaces and TUN devices)".into());
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("no /dev/net/tun".into());
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(o) if o.status.success() => None,
        _ => Some("`ip netns` (iproute2) is not usable here".into()),
    }
}
