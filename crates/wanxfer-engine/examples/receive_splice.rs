//! Whether the receiver should splice payloads from the socket into the file (socket →
//! pipe → file, no copy through user space) instead of reading them into a pool buffer
//! and writing that. Splicing saves one copy, but the bytes never pass through our memory:
//! the block checksum can then only be checked by reading them back, after they are
//! already in the file. This measures the CPU per GB of each way, over loopback into a
//! file in DIR (tmpfs by default), the sender being a plain writer thread in the same
//! process: on loopback, TCP's receive work lands on whichever side's thread happens to
//! run it, so only the two together compare fairly; the sender's share is the same in
//! every row.
//!
//! `cargo run --release -p wanxfer-engine --example receive_splice -- [DIR] [GiB]`

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use wanxfer_engine::progress::process_cpu;

const BLOCK: usize = 4 << 20;
const PIECE: usize = 256 << 10;

/// A loopback connection whose far end writes `bytes` from a buffer and exits.
fn connected_sender(bytes: u64) -> (TcpStream, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    let sender = std::thread::spawn(move || {
        let mut out = TcpStream::connect(addr).expect("connect");
        let buf = vec![0x5au8; BLOCK];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(BLOCK as u64) as usize;
            out.write_all(&buf[..n]).expect("send");
            left -= n as u64;
        }
    });
    let (stream, _) = listener.accept().expect("accept");
    (stream, sender)
}

/// The engine's way: read each block into a buffer piece by piece, checksumming each
/// piece while it is in cache, then write the block at its offset.
fn read_and_write(stream: &mut TcpStream, file: &File, bytes: u64, crc: bool) -> u32 {
    let mut block = vec![0u8; BLOCK];
    let (mut offset, mut sum) = (0u64, 0u32);
    while offset < bytes {
        let n = (bytes - offset).min(BLOCK as u64) as usize;
        for piece in block[..n].chunks_mut(PIECE) {
            stream.read_exact(piece).expect("recv");
            if crc {
                sum = crc32c::crc32c_append(sum, piece);
            }
        }
        file.write_all_at(&block[..n], offset).expect("pwrite");
        offset += n as u64;
    }
    sum
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 fills both descriptors, which we then own.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: fresh descriptors from pipe2, owned by nobody else.
    let ends = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_SETPIPE_SZ on our own pipe; a refusal leaves the default size.
    unsafe { libc::fcntl(ends.1.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    ends
}

fn splice(
    from: RawFd,
    from_off: Option<&mut i64>,
    to: RawFd,
    to_off: Option<&mut i64>,
    n: usize,
) -> usize {
    let ptr = |o: Option<&mut i64>| o.map_or(std::ptr::null_mut(), |o| o as *mut i64);
    // SAFETY: both descriptors are open; offsets, when given, point at live integers.
    let moved =
        unsafe { libc::splice(from, ptr(from_off), to, ptr(to_off), n, libc::SPLICE_F_MOVE) };
    assert!(moved > 0, "splice: {}", std::io::Error::last_os_error());
    moved as usize
}

/// Socket → pipe → file for every block; with `check`, each block is then read back and
/// checksummed, the only way to check bytes that never passed through our memory.
fn splice_to_file(stream: &TcpStream, file: &File, bytes: u64, check: bool) -> u32 {
    let (rd, wr) = pipe();
    let mut back = vec![0u8; BLOCK];
    let (mut offset, mut sum) = (0u64, 0u32);
    while offset < bytes {
        let n = (bytes - offset).min(BLOCK as u64) as usize;
        let mut done = 0;
        while done < n {
            let in_pipe = splice(stream.as_raw_fd(), None, wr.as_raw_fd(), None, n - done);
            let mut at = (offset + done as u64) as i64;
            let mut left = in_pipe;
            while left > 0 {
                left -= splice(rd.as_raw_fd(), None, file.as_raw_fd(), Some(&mut at), left);
            }
            done += in_pipe;
        }
        if check {
            file.read_exact_at(&mut back[..n], offset)
                .expect("read back");
            sum = crc32c::crc32c_append(sum, &back[..n]);
        }
        offset += n as u64;
    }
    sum
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "/dev/shm".into());
    let gib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(4);
    let bytes = gib << 30;
    let path = std::path::Path::new(&dir).join("wanxfer-receive-splice.tmp");
    println!(
        "{gib} GiB over loopback into {}, CPU of sender and receiver",
        path.display()
    );
    type Way = fn(&mut TcpStream, &File, u64) -> u32;
    let ways: [(&str, Way); 4] = [
        ("read + CRC + pwrite (engine)", |s, f, b| {
            read_and_write(s, f, b, true)
        }),
        ("read + pwrite, no CRC", |s, f, b| {
            read_and_write(s, f, b, false)
        }),
        ("splice, no CRC", |s, f, b| splice_to_file(s, f, b, false)),
        ("splice, then read back + CRC", |s, f, b| {
            splice_to_file(s, f, b, true)
        }),
    ];
    for round in 1..=3 {
        println!("round {round}");
        // The first file written in a round ran 2-8x slower whichever way came first
        // (tmpfs page allocation after the previous file's pages were freed), so each
        // round starts with an uncounted pass.
        let warm_up = ("(warm-up, not counted)", ways[0].1);
        for (name, way) in std::iter::once(warm_up).chain(ways) {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .expect("create the target file");
            let (mut stream, sender) = connected_sender(bytes);
            let (cpu0, t0) = (process_cpu().seconds(), std::time::Instant::now());
            std::hint::black_box(way(&mut stream, &file, bytes));
            sender.join().expect("sender thread");
            let cpu = process_cpu().seconds() - cpu0;
            let gb = bytes as f64 / 1e9;
            let gbit = gb * 8.0 / t0.elapsed().as_secs_f64();
            println!("{name:<32} {gbit:>6.2} Gbit/s {:>6.3} CPU s/GB", cpu / gb);
        }
    }
    let _ = std::fs::remove_file(&path);
}
