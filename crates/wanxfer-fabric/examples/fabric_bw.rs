//! Loopback throughput probe for the block channel: one thread receives into
//! a slot pool and regrants each slot as soon as its block arrives, the other
//! RDMA-writes header + payload blocks into whatever slot it is granted.
//! Prints GB/s and the CPU seconds each side used.
//!
//! Usage: fabric_bw [--provider NAME] [--block BYTES] [--inflight N] [--total-mib MIB]

use std::io::IoSlice;
use std::thread;
use std::time::{Duration, Instant};

use wanxfer_fabric::{
    Access, AlignedBuf, Channel, ChannelConfig, Event, FabricConfig, Listener, Result,
};

/// Bytes of the per-block header gathered in front of the payload.
const HEADER: usize = 64;

#[derive(Clone)]
struct Args {
    provider: String,
    block: usize,
    inflight: u32,
    total_mib: u64,
}

fn parse_args() -> Args {
    let mut args = Args {
        provider: "tcp".into(),
        block: 1 << 20,
        inflight: 8,
        total_mib: 4096,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        let number = || {
            value
                .parse::<u64>()
                .unwrap_or_else(|_| usage(&format!("bad number {value}")))
        };
        match flag.as_str() {
            "--provider" => args.provider = value.clone(),
            "--block" => args.block = number() as usize,
            "--inflight" => args.inflight = number() as u32,
            "--total-mib" => args.total_mib = number(),
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    args
}

fn usage(problem: &str) -> ! {
    eprintln!("{problem}\nusage: fabric_bw [--provider NAME] [--block BYTES] [--inflight N] [--total-mib MIB]");
    std::process::exit(2)
}

/// CPU seconds (user + system) used by the calling thread so far.
fn thread_cpu() -> f64 {
    // SAFETY: getrusage fills the zeroed struct we pass; RUSAGE_THREAD is
    // valid on Linux.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn receive(mut ch: Channel, args: &Args, blocks: u64) -> Result<f64> {
    let cpu_start = thread_cpu();
    let slot_size = HEADER + args.block;
    let pool = ch.register(
        AlignedBuf::new(args.inflight as usize * slot_size),
        Access::REMOTE_WRITE,
    )?;
    ch.set_slot_pool(pool, slot_size)?;
    for slot in 0..args.inflight {
        ch.grant(slot)?;
    }
    let (mut arrived, mut granted) = (0, u64::from(args.inflight));
    while arrived < blocks {
        if let Some(Event::BlockArrived { slot, .. }) = ch.wait(None)? {
            arrived += 1;
            if granted < blocks {
                ch.grant(slot)?;
                granted += 1;
            }
        }
    }
    ch.close(None)?;
    Ok(thread_cpu() - cpu_start)
}

fn send(mut ch: Channel, args: &Args, blocks: u64) -> Result<f64> {
    let cpu_start = thread_cpu();
    let header = ch.register(AlignedBuf::new(HEADER), Access::WRITE_SOURCE)?;
    let payload = ch.register(AlignedBuf::new(args.block), Access::WRITE_SOURCE)?;
    let iov = [
        IoSlice::new(&header.as_slice()[..HEADER]),
        IoSlice::new(&payload.as_slice()[..args.block]),
    ];
    let (mut written, mut completed) = (0, 0);
    while completed < blocks {
        match ch.wait(None)? {
            Some(Event::Credit(credit)) if written < blocks => {
                ch.write_block(&iov, credit)?;
                written += 1;
            }
            Some(Event::WriteComplete { .. }) => completed += 1,
            _ => {}
        }
    }
    ch.close(None)?;
    Ok(thread_cpu() - cpu_start)
}

fn main() -> Result<()> {
    let args = parse_args();
    let fabric = FabricConfig::with_provider(&args.provider);
    let cfg = ChannelConfig {
        max_grants: args.inflight,
        max_writes: args.inflight as usize,
        connect_timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let blocks = (args.total_mib << 20) / args.block as u64;
    let mut listener = Listener::bind(&fabric, "127.0.0.1:0".parse().expect("literal parses"))?;
    let addr = listener.local_addr();
    let accept_cfg = cfg.clone();
    let acceptor = thread::spawn(move || Channel::accept(&mut listener, &accept_cfg));
    let tx = Channel::connect(&fabric, addr, &cfg)?;
    let rx = acceptor.join().expect("accept thread panicked")?;
    let info = tx.provider().clone();
    println!(
        "provider {} fabric {} domain {} (mr_mode {:#x}, cq data {}): {} blocks of {} B + {HEADER} B header, {} in flight",
        info.provider, info.fabric, info.domain, info.mr_mode, tx.uses_cq_data(),
        blocks, args.block, args.inflight
    );

    let start = Instant::now();
    let rx_args = args.clone();
    let receiver = thread::spawn(move || receive(rx, &rx_args, blocks));
    let sent = send(tx, &args, blocks);
    let received = receiver.join().expect("receiver thread panicked");
    if let Err(e) = &sent {
        eprintln!("sender failed: {e}");
    }
    if let Err(e) = &received {
        eprintln!("receiver failed: {e}");
    }
    let (sender_cpu, receiver_cpu) = (sent?, received?);
    let secs = start.elapsed().as_secs_f64();
    let bytes = blocks * (args.block + HEADER) as u64;
    println!(
        "{:.2} GB/s ({bytes} bytes in {secs:.2} s); CPU seconds: sender {sender_cpu:.2}, receiver {receiver_cpu:.2}",
        bytes as f64 / secs / 1e9
    );
    Ok(())
}
