//! `wanxfer bench`: memory-to-memory sweeps of block size × depth × streams, reported
//! like kissel2013's Table 1 (Gbit/s, sender and receiver CPU) and plotted against bytes
//! in flight like its Figures 2-3.
//!
//! Without `--server` it starts `wanxfer serve` as a child process on loopback, so the
//! client's CPU figures are its own and the server's come from the server's per-session
//! accounting. It does not compare with other tools: `bench/` does that.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use plotters::prelude::*;
use serde::Serialize;
use wanxfer_engine::progress::Progress;
use wanxfer_engine::session::{run_client, ClientConfig, ClientJob, Tuning};
use wanxfer_engine::source::Source;
use wanxfer_engine::Error;
use wanxfer_proto::RelPath;

use crate::args::{parse_size, parse_size_list};

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Use this server (wanxfer://HOST[:PORT] or HOST[:PORT]) instead of starting one on
    /// loopback.
    #[arg(long, value_parser = crate::args::parse_server)]
    pub server: Option<String>,
    /// Bytes moved per measurement.
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    pub bytes: u64,
    /// Block sizes to sweep (comma-separated).
    #[arg(long, default_value = "256KiB,1MiB,4MiB", value_parser = parse_size_list, value_delimiter = ',')]
    pub block_sizes: Vec<u64>,
    /// Depths to sweep (comma-separated).
    #[arg(long, default_value = "1,4,16", value_delimiter = ',')]
    pub depths: Vec<u16>,
    /// Stream counts to sweep (comma-separated).
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub streams: Vec<u16>,
    /// Send modes to sweep (comma-separated). Memory to memory sends from the block
    /// buffers, so `copy` and `zerocopy` are the ones that differ; measure both on a NIC
    /// before choosing `--io zerocopy` for a path.
    #[arg(long, default_value = "copy", value_delimiter = ',')]
    pub io: Vec<crate::args::IoArg>,
    /// Measure without checks too: no segment digests and no block CRC (protocol cost
    /// alone). `--no-block-checksum` is its old name.
    #[arg(long, alias = "no-block-checksum")]
    pub no_checks: bool,
    /// Measure without encryption (the local server allows it; a --server must have been
    /// started with --allow-unencrypted): blocks are MAC'd, not sealed, and the send
    /// modes other than copy can bypass user space.
    #[arg(long)]
    pub no_encryption: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a plot (Gbit/s against bytes in flight) as SVG to this file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Shared secret file (else WANXFER_SECRET; a local server gets a random one).
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    #[command(flatten)]
    pub transport: crate::args::TransportArgs,
    /// Instead of the bandwidth sweep: ping-pong latency by message size (8 B to 4 MiB),
    /// RDMA write over --provider against TCP, both ends in this process on loopback.
    #[arg(long)]
    pub latency: bool,
    #[command(flatten)]
    pub log: crate::args::LogArgs,
}

#[derive(Debug, Serialize)]
struct LatencyPoint {
    bytes: usize,
    tcp_us: f64,
    fabric_us: f64,
}

/// `wanxfer bench --latency` (jin2005 §4.1, tian2011 Fig. 5).
fn latency(args: &BenchArgs) -> Result<(), Error> {
    use wanxfer_fabric::pingpong::{fabric_pingpong, tcp_pingpong, SIZES};
    let ip = std::net::IpAddr::from([127, 0, 0, 1]);
    let iters = 200;
    let provider = &args.transport.provider;
    let fabric = fabric_pingpong(provider, ip, &SIZES, iters).map_err(|e| {
        Error::network(
            "ping-pong over fabric",
            provider,
            std::io::Error::other(e.to_string()),
        )
    })?;
    let tcp =
        tcp_pingpong(ip, &SIZES, iters).map_err(|e| Error::network("ping-pong over tcp", ip, e))?;
    println!("one-way latency, median of {iters} round trips / 2 (fabric provider {provider})");
    println!("{:>9} {:>10} {:>10}", "bytes", "tcp us", "fabric us");
    let points: Vec<LatencyPoint> = SIZES
        .iter()
        .zip(tcp.iter().zip(&fabric))
        .map(|(&bytes, (t, f))| LatencyPoint {
            bytes,
            tcp_us: t * 1e6,
            fabric_us: f * 1e6,
        })
        .collect();
    for p in &points {
        println!("{:>9} {:>10.1} {:>10.1}", p.bytes, p.tcp_us, p.fabric_us);
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&points).expect("plain data serializes");
        std::fs::write(path, text).map_err(|e| Error::local("write", path.display(), e))?;
    }
    Ok(())
}

#[derive(Debug, Serialize, Clone)]
pub struct Point {
    /// The send mode the session used (`auto` as it was settled for this server).
    pub io: String,
    /// The TLS suite, or `none`.
    pub encryption: String,
    /// Whether every block was checked (segment digests), or nothing was.
    pub checked: bool,
    pub streams: u16,
    pub block_size: u32,
    pub depth: u16,
    pub bytes_in_flight: u64,
    pub gbit_per_s: f64,
    pub seconds: f64,
    pub sender_cpu_percent: f64,
    pub receiver_cpu_percent: f64,
    pub sender_cpu_s_per_gb: f64,
    pub receiver_cpu_s_per_gb: f64,
}

/// A `wanxfer serve` child on loopback, killed on drop.
struct LocalServer {
    child: Child,
    addr: String,
    _root: tempfile::TempDir,
}

impl LocalServer {
    fn start(
        secret: &[u8],
        transport: &crate::args::TransportArgs,
        log: &crate::args::LogArgs,
        allow_unencrypted: bool,
    ) -> Result<LocalServer, Error> {
        let root =
            tempfile::tempdir().map_err(|e| Error::local("create", "a temporary root", e))?;
        let exe =
            std::env::current_exe().map_err(|e| Error::local("find", "the wanxfer binary", e))?;
        let mut child = Command::new(exe)
            .args(["serve", "--listen", "127.0.0.1:0", "--root"])
            .arg(root.path())
            .arg("--log-format")
            .arg(
                log.log_format
                    .to_possible_value()
                    .expect("no log format is hidden")
                    .get_name(),
            )
            .args(
                transport
                    .offered_provider()
                    .map(|p| {
                        vec![
                            "--transport".to_string(),
                            "fabric".into(),
                            "--provider".into(),
                            p,
                        ]
                    })
                    .unwrap_or_default(),
            )
            .args(allow_unencrypted.then_some("--allow-unencrypted"))
            .env(
                "WANXFER_SECRET",
                <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(secret),
            )
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::local("start", "wanxfer serve", e))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| Error::local("read", "wanxfer serve output", e))?;
        let addr = line
            .trim()
            .rsplit(" on ")
            .next()
            .filter(|a| a.contains(':'))
            .ok_or_else(|| Error::Usage(format!("the local server did not start: {line:?}")))?
            .to_string();
        Ok(LocalServer {
            child,
            addr,
            _root: root,
        })
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(args: &BenchArgs) -> Result<(), Error> {
    if args.latency {
        return latency(args);
    }
    let (secret, local) = match &args.server {
        Some(_) => (
            crate::secret::for_client(args.secret_file.as_deref())?,
            None,
        ),
        None => {
            let secret = crate::secret::generate()?.into_bytes();
            let server =
                LocalServer::start(&secret, &args.transport, &args.log, args.no_encryption)?;
            (secret, Some(server))
        }
    };
    let addr = match (&args.server, &local) {
        (Some(a), _) => a.clone(),
        (None, Some(l)) => l.addr.clone(),
        (None, None) => unreachable!("a local server is started when none is given"),
    };
    let checks: &[bool] = if args.no_checks {
        &[true, false]
    } else {
        &[true]
    };
    let mut points = Vec::new();
    println!(
        "{:>8} {:>7} {:>10} {:>5} {:>5} {:>10} {:>9} {:>9} {:>11} {:>11}",
        "io",
        "streams",
        "block",
        "depth",
        "check",
        "Gbit/s",
        "send CPU%",
        "recv CPU%",
        "send s/GB",
        "recv s/GB"
    );
    let grid = checks.iter().flat_map(|&check| {
        args.io.iter().flat_map(move |&io| {
            args.streams.iter().flat_map(move |&streams| {
                args.block_sizes.iter().flat_map(move |&block| {
                    args.depths
                        .iter()
                        .map(move |&depth| (check, io, streams, block, depth))
                })
            })
        })
    });
    for (check, io, streams, block, depth) in grid {
        let tuning = Tuning {
            streams,
            block_size: block as u32,
            depth,
            // Digests check every block; without them nothing is checked.
            block_crc: check,
            file_digest: check,
            io: io.mode(),
            transport: args.transport.transport(),
            ..Tuning::default()
        };
        let p = measure(&addr, &secret, args.bytes, tuning, args.no_encryption)?;
        println!(
            "{:>8} {:>7} {:>10} {:>5} {:>5} {:>10.2} {:>9.0} {:>9.0} {:>11.3} {:>11.3}",
            p.io,
            p.streams,
            block,
            p.depth,
            if check { "on" } else { "off" },
            p.gbit_per_s,
            p.sender_cpu_percent,
            p.receiver_cpu_percent,
            p.sender_cpu_s_per_gb,
            p.receiver_cpu_s_per_gb
        );
        points.push(p);
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&points).expect("plain data serializes");
        std::fs::write(path, text).map_err(|e| Error::local("write", path.display(), e))?;
    }
    if let Some(path) = &args.svg {
        plot(&points, path)
            .map_err(|e| Error::local("write plot", path.display(), std::io::Error::other(e)))?;
    }
    Ok(())
}

fn measure(
    addr: &str,
    secret: &[u8],
    bytes: u64,
    tuning: Tuning,
    no_encryption: bool,
) -> Result<Point, Error> {
    let checked = tuning.file_digest;
    let mut cfg = ClientConfig::new(addr.to_string(), secret.to_vec(), tuning);
    if no_encryption {
        cfg.security = wanxfer_engine::tls::ClientSecurity::Unencrypted;
    }
    // A measurement: a failed point is reported as such, not retried.
    cfg.retry.retries = 0;
    cfg.connect_timeout = Duration::from_secs(crate::args::DEFAULT_CONNECT_TIMEOUT_S);
    let job = ClientJob::Push {
        source: Source::Synthetic { bytes },
        dest: RelPath::new(b"dev/null").expect("valid path"),
        into: false,
    };
    let r = run_client(&cfg, job, Arc::new(Progress::default())).map_err(|f| f.error)?;
    let secs = r.seconds.max(1e-9);
    let gb = r.bytes as f64 / 1e9;
    let (send, recv) = (r.cpu.seconds(), r.peer_cpu.seconds());
    Ok(Point {
        io: r.io.mode.clone(),
        encryption: r.encryption.clone(),
        checked,
        streams: r.streams,
        block_size: r.block_size,
        depth: r.depth,
        bytes_in_flight: u64::from(r.block_size) * u64::from(r.depth) * u64::from(r.streams),
        gbit_per_s: r.bytes as f64 * 8.0 / secs / 1e9,
        seconds: r.seconds,
        sender_cpu_percent: send / secs * 100.0,
        receiver_cpu_percent: recv / secs * 100.0,
        sender_cpu_s_per_gb: send / gb,
        receiver_cpu_s_per_gb: recv / gb,
    })
}

/// Gbit/s against bytes in flight (log scale), one line per stream count and send mode.
fn plot(points: &[Point], path: &std::path::Path) -> Result<(), String> {
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let x_max = points.iter().map(|p| p.bytes_in_flight).max().unwrap_or(1) as f64 * 2.0;
    let x_min = points.iter().map(|p| p.bytes_in_flight).min().unwrap_or(1) as f64 / 2.0;
    let y_max = points.iter().map(|p| p.gbit_per_s).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("wanxfer memory-to-memory", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("bytes in flight (block size × depth × streams)")
        .y_desc("Gbit/s")
        .x_label_formatter(&|v| format!("{:.0} KiB", v / 1024.0))
        .draw()
        .map_err(|e| e.to_string())?;
    let mut lines: Vec<(u16, &str)> = points.iter().map(|p| (p.streams, p.io.as_str())).collect();
    lines.sort_unstable();
    lines.dedup();
    for (i, &(s, io)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut series: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| (p.streams, p.io.as_str()) == (s, io))
            .map(|p| (p.bytes_in_flight as f64, p.gbit_per_s))
            .collect();
        series.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(format!("{s} stream(s), {io}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(
                series
                    .iter()
                    .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
            )
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
