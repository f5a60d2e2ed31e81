//! `wanxfer-emu`: runs commands on two hosts joined by an emulated wide-area path, prints
//! what the path did, and leaves nothing behind (namespaces, devices, processes), also
//! on Ctrl-C.

use std::process::{Child, Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use wanxfer_emu::{Config, Emulator, FlowOutage, LinkConfig, Outage, LEFT_IP, RIGHT_IP};

/// Two network namespaces, `left` (10.77.0.1) and `right` (10.77.0.2), joined through a
/// user-space link with delay, rate, buffer, loss, reordering, duplication, corruption
/// and cuts. Needs root.
#[derive(Debug, Parser)]
#[command(name = "wanxfer-emu", version)]
struct Args {
    /// Round-trip time, split evenly between the directions (e.g. 50ms).
    #[arg(long, value_parser = parse_duration, default_value = "0ms")]
    rtt: Duration,
    /// Uniform jitter added to each direction's delay.
    #[arg(long, value_parser = parse_duration, default_value = "0ms")]
    jitter: Duration,
    /// Bottleneck rate, left to right (e.g. 1gbit, 500mbit); 0 for none.
    #[arg(long, value_parser = parse_rate, default_value = "0")]
    rate: u64,
    /// From AT (since the start) the bottleneck runs at RATE both ways, e.g.
    /// 10s=500mbit; repeatable, in time order.
    #[arg(long, value_parser = parse_rate_step, value_name = "AT=RATE")]
    rate_step: Vec<(Duration, u64)>,
    /// Bottleneck rate right to left (default: as --rate).
    #[arg(long, value_parser = parse_rate)]
    rate_back: Option<u64>,
    /// Bottleneck buffer in bytes, drop-tail (e.g. 1MB, as kissel2013's policer).
    #[arg(long, value_parser = parse_bytes, default_value = "1MB")]
    buffer: u64,
    /// Probability of losing a packet (e.g. 0.0001).
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Probability of holding a packet back by --reorder-gap.
    #[arg(long, default_value_t = 0.0)]
    reorder: f64,
    #[arg(long, value_parser = parse_duration, default_value = "1ms")]
    reorder_gap: Duration,
    /// Probability of delivering a packet twice.
    #[arg(long, default_value_t = 0.0)]
    duplicate: f64,
    /// Probability of flipping a TCP payload byte, checksum fixed up (left to right).
    #[arg(long, default_value_t = 0.0)]
    corrupt: f64,
    /// The link is down both ways in this span from the start (e.g. 2s..5s, or 2s.. for
    /// good); repeatable.
    #[arg(long, value_parser = parse_span)]
    cut: Vec<(Duration, Duration)>,
    /// Left-to-right packets vanish in this span; repeatable.
    #[arg(long, value_parser = parse_span)]
    blackhole: Vec<(Duration, Duration)>,
    /// The Nth TCP connection to open (from 1) loses every packet, both ways, in this
    /// span from its opening, while the others carry on (e.g. 3@1s.. for one stream of
    /// several going dark for good); with =P, only that share of them (3@0s..=0.02: one
    /// stream on a lossy member of an aggregate); repeatable.
    #[arg(long, value_parser = parse_flow_outage, value_name = "N@FROM..TO[=P]")]
    cut_flow: Vec<FlowOutage>,
    /// Seed for every random choice (printed in the report).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// tcp_rmem/tcp_wmem maximum in both namespaces (at least 2 x BDP).
    #[arg(long, value_parser = parse_bytes, default_value = "64MB")]
    tcp_mem: u64,
    /// Core to run the forwarder on (keep the endpoints on others).
    #[arg(long)]
    cpu: Option<usize>,
    /// Command for the right host, started first and killed at the end (e.g. a server).
    #[arg(long)]
    right: Option<String>,
    /// Command for the left host; the emulator ends when it does, with its exit code.
    #[arg(long)]
    left: Option<String>,
    /// Seconds to wait after starting --right before --left.
    #[arg(long, default_value_t = 0.5)]
    settle: f64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = args.config();
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst));
    }
    let emu = match Emulator::start(config) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("wanxfer-emu: {e}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "wanxfer-emu: left {LEFT_IP} (netns {}) <-> right {RIGHT_IP} (netns {}), seed {}",
        emu.namespaces()[0],
        emu.namespaces()[1],
        args.seed
    );
    let code = run_commands(&args, &emu, &stop);
    match emu.stop() {
        Ok(report) => println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("plain data serializes")
        ),
        Err(e) => eprintln!("wanxfer-emu: {e}"),
    }
    ExitCode::from(code)
}

/// Runs the right then the left command; without a left command, waits for Ctrl-C.
fn run_commands(args: &Args, emu: &Emulator, stop: &AtomicBool) -> u8 {
    let mut right: Option<Child> = args
        .right
        .as_ref()
        .and_then(|cmd| shell(emu.right("sh"), cmd).spawn().ok());
    if right.is_some() {
        std::thread::sleep(Duration::from_secs_f64(args.settle));
    }
    let code = match &args.left {
        Some(cmd) => match shell(emu.left("sh"), cmd).spawn() {
            Ok(mut child) => loop {
                if let Ok(Some(status)) = child.try_wait() {
                    break status.code().unwrap_or(1) as u8;
                }
                if stop.load(Ordering::SeqCst) {
                    let _ = child.kill();
                    let _ = child.wait();
                    break 130;
                }
                std::thread::sleep(Duration::from_millis(20));
            },
            Err(e) => {
                eprintln!("wanxfer-emu: cannot run the left command: {e}");
                2
            }
        },
        None => {
            while !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
            0
        }
    };
    if let Some(child) = right.as_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    code
}

fn shell(mut cmd: Command, script: &str) -> Command {
    cmd.args(["-c", script]);
    cmd
}

impl Args {
    fn config(&self) -> Config {
        let forward = LinkConfig {
            delay: self.rtt / 2,
            jitter: self.jitter,
            rate_bps: self.rate,
            rate_steps: self.rate_step.clone(),
            buffer: self.buffer,
            loss: self.loss,
            reorder: self.reorder,
            reorder_gap: self.reorder_gap,
            duplicate: self.duplicate,
            corrupt: self.corrupt,
        };
        let back = LinkConfig {
            rate_bps: self.rate_back.unwrap_or(self.rate),
            corrupt: 0.0,
            ..forward.clone()
        };
        let outage = |both_ways| {
            move |&(from, to): &(Duration, Duration)| Outage {
                from,
                to,
                both_ways,
            }
        };
        Config {
            forward,
            back,
            outages: self
                .cut
                .iter()
                .map(outage(true))
                .chain(self.blackhole.iter().map(outage(false)))
                .collect(),
            flow_outages: self.cut_flow.clone(),
            seed: self.seed,
            tcp_mem: self.tcp_mem,
            cpu: self.cpu,
        }
    }
}

fn split_number(s: &str) -> Result<(f64, String), String> {
    let s = s.trim();
    let at = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let value = s[..at]
        .parse::<f64>()
        .map_err(|_| format!("{s:?}: expected a number with a unit"))?;
    Ok((value, s[at..].trim().to_ascii_lowercase()))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (v, unit) = split_number(s)?;
    let secs = match unit.as_str() {
        "s" => v,
        "ms" | "" => v / 1e3,
        "us" => v / 1e6,
        other => return Err(format!("unknown time unit {other:?} (s, ms, us)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

fn parse_rate(s: &str) -> Result<u64, String> {
    let (v, unit) = split_number(s)?;
    let scale = match unit.as_str() {
        "" | "bit" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        other => return Err(format!("unknown rate unit {other:?} (kbit, mbit, gbit)")),
    };
    Ok((v * scale) as u64)
}

fn parse_rate_step(s: &str) -> Result<(Duration, u64), String> {
    let (at, rate) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected AT=RATE, e.g. 10s=500mbit"))?;
    Ok((parse_duration(at)?, parse_rate(rate)?))
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let (v, unit) = split_number(s)?;
    let scale = match unit.as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("unknown size unit {other:?}")),
    };
    Ok((v * scale) as u64)
}

fn parse_span(s: &str) -> Result<(Duration, Duration), String> {
    let (from, to) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?}: expected FROM..TO, e.g. 2s..5s"))?;
    let from = parse_duration(from)?;
    let to = match to.trim() {
        "" => Duration::MAX,
        to => parse_duration(to)?,
    };
    if to <= from {
        return Err(format!("{s:?}: the span ends before it starts"));
    }
    Ok((from, to))
}

fn parse_flow_outage(s: &str) -> Result<FlowOutage, String> {
    let (flow, rest) = s
        .split_once('@')
        .ok_or_else(|| format!("{s:?}: expected N@FROM..TO[=P], e.g. 3@1s.."))?;
    let flow = match flow.trim().parse::<u32>() {
        Ok(n) if n > 0 => n,
        _ => return Err(format!("{flow:?}: connections are counted from 1")),
    };
    let (span, loss) = match rest.split_once('=') {
        Some((span, p)) => match p.trim().parse::<f64>() {
            Ok(p) if p > 0.0 && p <= 1.0 => (span, p),
            _ => return Err(format!("{p:?}: a share of packets lost, in (0, 1]")),
        },
        None => (rest, 1.0),
    };
    let (from, to) = parse_span(span)?;
    Ok(FlowOutage {
        flow,
        from,
        to,
        loss,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_outage_is_dark_unless_given_a_share() {
        let dark = parse_flow_outage("3@1s..").unwrap();
        assert_eq!(dark, FlowOutage::dark(3, Duration::from_secs(1)));
        let lossy = parse_flow_outage("2@0s..5s=0.02").unwrap();
        assert_eq!((lossy.flow, lossy.loss), (2, 0.02));
        assert_eq!(lossy.to, Duration::from_secs(5));
        for bad in ["3@1s..=0", "3@1s..=1.5", "3@1s..=x", "0@1s..", "3"] {
            assert!(parse_flow_outage(bad).is_err(), "{bad}");
        }
    }
}
