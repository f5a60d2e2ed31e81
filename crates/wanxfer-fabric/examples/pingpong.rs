//! Ping-pong latency by message size, RDMA write (block channel) against TCP.
//!
//! Usage: pingpong [--provider NAME] [--addr IP] [--iters N]
//! (`wanxfer bench --latency` prints the same table.)

use std::net::IpAddr;

use wanxfer_fabric::pingpong::{fabric_pingpong, tcp_pingpong, SIZES};

fn main() {
    let mut provider = "tcp".to_string();
    let mut ip: IpAddr = [127, 0, 0, 1].into();
    let mut iters = 200;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--provider" => provider = value,
            "--addr" => ip = value.parse().unwrap_or_else(|_| usage("bad --addr")),
            "--iters" => iters = value.parse().unwrap_or_else(|_| usage("bad --iters")),
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    let fabric = fabric_pingpong(&provider, ip, &SIZES, iters).unwrap_or_else(|e| fail(&e));
    let tcp = tcp_pingpong(ip, &SIZES, iters).unwrap_or_else(|e| fail(&e));
    println!("one-way latency (median of {iters} round trips / 2), provider {provider}, {ip}");
    println!("{:>9} {:>12} {:>12}", "bytes", "fabric us", "tcp us");
    for ((len, f), t) in SIZES.iter().zip(&fabric).zip(&tcp) {
        println!("{len:>9} {:>12.1} {:>12.1}", f * 1e6, t * 1e6);
    }
}

fn fail(e: &dyn std::fmt::Display) -> ! {
    eprintln!("ping-pong failed: {e}");
    std::process::exit(1)
}

fn usage(problem: &str) -> ! {
    eprintln!("{problem}\nusage: pingpong [--provider NAME] [--addr IP] [--iters N]");
    std::process::exit(2)
}
