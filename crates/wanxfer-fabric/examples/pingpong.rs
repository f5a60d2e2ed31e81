//! Ping-pong latency by message size (jin2005 §4.1, tian2011 Fig. 5), side by side: the
//! block channel's RDMA write into a granted slot (announced by remote CQ data, answered
//! the same way) against a plain TCP socket on the same path. Prints the median one-way
//! latency (half a round trip) and the rate a single outstanding message reaches.
//!
//! Usage: pingpong [--provider NAME] [--addr IP] [--iters N]
//! Sizes run from 8 B to 4 MiB. Both peers run in this process, on loopback by default.

use std::io::{IoSlice, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Instant;

use wanxfer_fabric::{
    Access, AlignedBuf, Channel, ChannelConfig, Credit, Event, FabricConfig, Listener, Result,
};

const SIZES: [usize; 11] = [
    8,
    64,
    512,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];
const MAX: usize = 4 << 20;

struct Args {
    provider: String,
    ip: IpAddr,
    iters: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        provider: "tcp".into(),
        ip: IpAddr::from([127, 0, 0, 1]),
        iters: 200,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--provider" => args.provider = value,
            "--addr" => args.ip = value.parse().unwrap_or_else(|_| usage("bad --addr")),
            "--iters" => args.iters = value.parse().unwrap_or_else(|_| usage("bad --iters")),
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    args
}

fn usage(problem: &str) -> ! {
    eprintln!("{problem}\nusage: pingpong [--provider NAME] [--addr IP] [--iters N]");
    std::process::exit(2)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One side of the fabric ping-pong: a one-slot pool granted to the peer, and a source
/// buffer written from.
struct Side {
    ch: Channel,
    src: AlignedBuf,
    credit: Option<Credit>,
}

impl Side {
    fn new(mut ch: Channel) -> Result<Side> {
        let pool = ch.register(AlignedBuf::new(MAX), Access::REMOTE_WRITE)?;
        ch.set_slot_pool(pool, MAX)?;
        ch.grant(0)?;
        let mut src = AlignedBuf::new(MAX);
        src.as_mut_slice().fill(0x5a);
        // SAFETY: `src` lives in this struct for as long as the channel.
        unsafe { ch.register_raw(src.as_mut_ptr(), MAX, Access::WRITE_SOURCE)? };
        Ok(Side {
            ch,
            src,
            credit: None,
        })
    }

    fn send(&mut self, len: usize) -> Result<()> {
        while self.credit.is_none() {
            let event = self.ch.wait(None)?.expect("no timeout");
            self.take(event);
        }
        let credit = self.credit.take().expect("just checked");
        self.ch
            .write_block(&[IoSlice::new(&self.src.as_slice()[..len])], credit)
    }

    fn receive(&mut self) -> Result<()> {
        loop {
            match self.ch.wait(None)?.expect("no timeout") {
                Event::BlockArrived { slot, .. } => return self.ch.grant(slot),
                other => self.take(other),
            }
        }
    }

    fn take(&mut self, event: Event) {
        match event {
            Event::Credit(c) => self.credit = Some(c),
            Event::WriteComplete { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn fabric_pingpong(args: &Args) -> Result<Vec<f64>> {
    let cfg = ChannelConfig::default();
    let fabric = FabricConfig::with_provider(&args.provider);
    let mut listener = Listener::bind(&fabric, SocketAddr::new(args.ip, 0))?;
    let addr = listener.local_addr();
    let iters = args.iters;
    let echo_cfg = cfg.clone();
    let echo = thread::spawn(move || -> Result<()> {
        let mut side = Side::new(Channel::accept(&mut listener, &echo_cfg)?)?;
        for &len in &SIZES {
            for _ in 0..iters + 1 {
                side.receive()?;
                side.send(len)?;
            }
        }
        side.ch.close(None).map(drop)
    });
    let mut side = Side::new(Channel::connect(&fabric, addr, &cfg)?)?;
    let mut out = Vec::new();
    for &len in &SIZES {
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters + 1 {
            let start = Instant::now();
            side.send(len)?;
            side.receive()?;
            if i > 0 {
                rtts.push(start.elapsed().as_secs_f64());
            }
        }
        out.push(median(rtts) / 2.0);
    }
    side.ch.close(None)?;
    echo.join().expect("echo thread")?;
    Ok(out)
}

fn tcp_pingpong(args: &Args) -> std::io::Result<Vec<f64>> {
    let listener = TcpListener::bind(SocketAddr::new(args.ip, 0))?;
    let addr = listener.local_addr()?;
    let iters = args.iters;
    let echo = thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; MAX];
        for &len in &SIZES {
            for _ in 0..iters + 1 {
                s.read_exact(&mut buf[..len])?;
                s.write_all(&buf[..len])?;
            }
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut buf = vec![0x5au8; MAX];
    let mut out = Vec::new();
    for &len in &SIZES {
        let mut rtts = Vec::with_capacity(iters);
        for i in 0..iters + 1 {
            let start = Instant::now();
            s.write_all(&buf[..len])?;
            s.read_exact(&mut buf[..len])?;
            if i > 0 {
                rtts.push(start.elapsed().as_secs_f64());
            }
        }
        out.push(median(rtts) / 2.0);
    }
    echo.join().expect("echo thread")?;
    Ok(out)
}

fn main() {
    let args = parse_args();
    let fabric = fabric_pingpong(&args).unwrap_or_else(|e| {
        eprintln!("fabric ping-pong failed: {e}");
        std::process::exit(1)
    });
    let tcp = tcp_pingpong(&args).unwrap_or_else(|e| {
        eprintln!("tcp ping-pong failed: {e}");
        std::process::exit(1)
    });
    println!(
        "one-way latency (median of {} round trips / 2), provider {}, {}",
        args.iters, args.provider, args.ip
    );
    println!(
        "{:>9} {:>12} {:>12} {:>12} {:>12}",
        "bytes", "fabric us", "tcp us", "fabric Gb/s", "tcp Gb/s"
    );
    for ((len, f), t) in SIZES.iter().zip(&fabric).zip(&tcp) {
        let rate = |secs: f64| *len as f64 * 8.0 / secs / 1e9;
        println!(
            "{len:>9} {:>12.1} {:>12.1} {:>12.2} {:>12.2}",
            f * 1e6,
            t * 1e6,
            rate(*f),
            rate(*t)
        );
    }
}
