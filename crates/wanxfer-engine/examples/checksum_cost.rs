//! What the integrity checks cost per GB on this CPU, over a buffer already in cache: the
//! XXH3-128 every segment carries (the check on every byte since protocol 4), the payload
//! CRC-32C that stands in for it in sessions without digests, and both together (what a
//! receiver paid per byte up to protocol 3).
//!
//! The last lines show why both ends check a block piece by piece: a 4 MiB block copied
//! in (as `recv` or `pread` does) and then checked comes back from memory, while each
//! piece (`IN_CACHE_PIECE_BYTES`) checked right after its copy is still in the core's cache.
//!
//! `cargo run --release -p wanxfer-engine --example checksum_cost [-- MiB]`

use std::hint::black_box;

use std::time::Instant;
use wanxfer_engine::digest::{digest_of, FileHasher, IN_CACHE_PIECE_BYTES};
use wanxfer_engine::progress::thread_cpu;

fn measure(name: &str, data: &[u8], rounds: usize, mut f: impl FnMut(&[u8]) -> u128) {
    let (cpu0, t0) = (thread_cpu().seconds(), Instant::now());
    let mut acc = 0u128;
    for _ in 0..rounds {
        acc ^= f(black_box(data));
    }
    black_box(acc);
    let (cpu, wall) = (thread_cpu().seconds() - cpu0, t0.elapsed().as_secs_f64());
    let gb = (data.len() * rounds) as f64 / 1e9;
    println!(
        "{name:<22} {:>7.2} GB/s  {:>6.3} CPU s/GB",
        gb / wall,
        cpu / gb
    );
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4);
    // One block's worth, as the engine checks it: in cache, just written by recv.
    let data: Vec<u8> = (0..mib << 20).map(|i| (i * 131 % 251) as u8).collect();
    let rounds = (4usize << 30) / data.len();
    println!("{} MiB buffer, 4 GiB per measurement", mib);
    measure("payload CRC-32C", &data, rounds, |d| {
        u128::from(crc32c::crc32c(d))
    });
    measure("segment XXH3-128", &data, rounds, |d| {
        u128::from_le_bytes(digest_of(d))
    });
    // The SSE2 loop that a compile-time choice gives a default x86-64 build.
    measure(
        "XXH3-128, SSE2 only",
        &data,
        rounds,
        xxhash_rust::xxh3::xxh3_128,
    );
    measure("both (protocol 3)", &data, rounds, |d| {
        u128::from(crc32c::crc32c(d)) ^ u128::from_le_bytes(digest_of(d))
    });
    copy_then_hash(&data, rounds, data.len());
    copy_then_hash(&data, rounds, IN_CACHE_PIECE_BYTES);
    copy_then_crc(&data, rounds, data.len());
    copy_then_crc(&data, rounds, IN_CACHE_PIECE_BYTES);
}

/// Copies `data` into a block-sized buffer `piece` bytes at a time, hashing each piece
/// right after copying it, and reports the CPU of copy and digest together.
fn copy_then_hash(data: &[u8], rounds: usize, piece: usize) {
    let mut block = vec![0u8; data.len()];
    let name = format!("copy+XXH3 per {} KiB", piece >> 10);
    measure(&name, data, rounds, |d| {
        let mut hasher = FileHasher::new();
        for (to, from) in block.chunks_mut(piece).zip(d.chunks(piece)) {
            to.copy_from_slice(from);
            hasher.update(black_box(to));
        }
        u128::from_le_bytes(hasher.digest())
    });
}

/// As [`copy_then_hash`], with the payload CRC.
fn copy_then_crc(data: &[u8], rounds: usize, piece: usize) {
    let mut block = vec![0u8; data.len()];
    let name = format!("copy+CRC per {} KiB", piece >> 10);
    measure(&name, data, rounds, |d| {
        let mut crc = 0;
        for (to, from) in block.chunks_mut(piece).zip(d.chunks(piece)) {
            to.copy_from_slice(from);
            crc = crc32c::crc32c_append(crc, black_box(to));
        }
        u128::from(crc)
    });
}
