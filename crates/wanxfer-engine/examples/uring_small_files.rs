//! Would io_uring cut the per-file cost of many small files? Issue #3 asks for io_uring
//! "where it measurably cuts syscalls for many small files"; this is the measurement.
//!
//! It creates and then reads back small files on a tmpfs with the exact sequence the
//! engine uses, once with plain system calls and once through io_uring in batches, and
//! reports files per second and CPU microseconds per file for each (process CPU from
//! `getrusage`, which counts io_uring's `iou-wrk` worker threads too: work the ring punts
//! to them is not hidden, and the count of such threads is printed).
//!
//! Writing, per file (what the receiver does for a file that arrives in one piece):
//! `openat(dir, ".", O_TMPFILE)`, `pwrite`, `futimens`, `linkat(fd, "", dir, name,
//! AT_EMPTY_PATH)`, `close`. Through the ring, in batches of B files: a round of B
//! `OPENAT`s, a round of B `WRITE`s, the `futimens` calls (io_uring has no operation for
//! them, and a write would move the mtime again), then a round of B linked `LINKAT` +
//! `CLOSE` pairs: 3 `io_uring_enter` per batch instead of 4 system calls per file.
//! Reading (the sender): `openat`, `pread`, `close`; through the ring a round of `OPENAT`s
//! then one of linked `READ` + `CLOSE` pairs.
//!
//!     sudo cargo run --release -p wanxfer-engine --example uring_small_files -- \
//!         [--files 20000] [--size 65536] [--dirs 100] [--rounds 5] [--batches 1,8,32,128]
//!
//! Measured on the 2-core test VM (kernel 6.18, tmpfs at /dev/shm), 5 alternating
//! rounds, median CPU microseconds per file (files/s in brackets):
//!
//! | files | phase | syscalls | B=1 | B=8 | B=32 | B=128 |
//! |---|---|---|---|---|---|---|
//! | 20,000 × 64 KiB | write | 54.6 (17.6k) | 277 (2.8k) | 100 (9.8k) | 73.9 (14.6k) | 69.9 (16.7k) |
//! | 20,000 × 64 KiB | read | 22.0 (45.2k) | 118 (6.7k) | 40.7 (25.6k) | 33.7 (33.0k) | 33.9 (35.6k) |
//! | 50,000 × 4 KiB | write | 18.6 (53.4k) | 118 (6.5k) | 52.7 (17.9k) | 33.4 (34.0k) | 27.9 (41.5k) |
//! | 50,000 × 4 KiB | read | 5.5 (179k) | 95.4 (8.1k) | 22.3 (41.1k) | 11.1 (103k) | 9.6 (132k) |
//!
//! The ring costs 28-73% more CPU per file at its best batch, never less; with
//! `SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN` it was the same (64 KiB, B=128: 65.6
//! against 47.7 write, 28.2 against 18.7 read). Why: creating a file on tmpfs is work the
//! kernel does whoever submits it, and system call entry is a few percent of it (a perf
//! profile of the receiver put it at about 2%); `O_TMPFILE` and `O_CREAT` opens cannot
//! complete inline, so the ring hands each to an `iou-wrk` thread (2 to 4 appeared), and
//! every operation pays the ring's own bookkeeping. Tracing the kernel's
//! `io_uring_queue_async_work` showed more: `LINKAT` and `RENAMEAT` always go to a worker
//! too, and on tmpfs so do `READ` and `WRITE` (it offers no non-blocking attempt); only
//! `CLOSE` and opens of existing files completed inline. A variant with direct descriptors
//! (which `LINKAT` refuses, so a named temporary and a rename) cost as much. So the engine keeps plain system
//! calls, and there is no `--io uring`: it would be a mode that is always slower here.
//! Run it again on a machine with a different kernel or file system before believing
//! that elsewhere.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

use io_uring::{opcode, squeue, types, IoUring};

struct Options {
    files: usize,
    size: usize,
    dirs: usize,
    rounds: usize,
    batches: Vec<usize>,
    base: PathBuf,
}

impl Options {
    fn parse() -> Options {
        let mut o = Options {
            files: 20_000,
            size: 64 << 10,
            dirs: 100,
            rounds: 5,
            batches: vec![1, 8, 32, 128],
            base: PathBuf::from("/dev/shm"),
        };
        let args: Vec<String> = std::env::args().skip(1).collect();
        for pair in args.chunks(2) {
            let value = pair.get(1).map(String::as_str).unwrap_or_default();
            let number = || value.parse::<usize>().expect("a number");
            match pair[0].as_str() {
                "--files" => o.files = number(),
                "--size" => o.size = number(),
                "--dirs" => o.dirs = number(),
                "--rounds" => o.rounds = number(),
                "--base" => o.base = PathBuf::from(value),
                "--batches" => {
                    o.batches = value
                        .split(',')
                        .map(|b| b.parse().expect("a batch size"))
                        .collect()
                }
                other => panic!("unknown option {other}"),
            }
        }
        o
    }
}

/// Process CPU so far, microseconds (all threads, exited ones included).
fn cpu_us() -> u64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer, valid `who`.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    us(ru.ru_utime) + us(ru.ru_stime)
}

/// How many of this process's threads are io_uring workers right now.
fn uring_workers() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|comm| comm.starts_with("iou-wrk"))
                .count()
        })
        .unwrap_or(0)
}

fn check(rc: libc::c_int, what: &str) -> libc::c_int {
    if rc < 0 {
        panic!("{what}: {}", std::io::Error::last_os_error());
    }
    rc
}

fn cqe_result(rc: i32, what: &str) -> i32 {
    if rc < 0 {
        panic!("{what}: {}", std::io::Error::from_raw_os_error(-rc));
    }
    rc
}

/// A fresh tree of `dirs` directories; their descriptors and the files' names.
struct Tree {
    root: PathBuf,
    dirs: Vec<OwnedFd>,
    names: Vec<CString>,
}

impl Tree {
    fn new(base: &Path, tag: &str, o: &Options) -> Tree {
        let root = base.join(format!("wanxfer-uring-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dirs = (0..o.dirs)
            .map(|d| {
                let path = root.join(format!("d{d:03}"));
                std::fs::create_dir_all(&path).expect("create the tree");
                OwnedFd::from(std::fs::File::open(&path).expect("open a directory"))
            })
            .collect();
        let names = (0..o.files)
            .map(|i| CString::new(format!("f{i:06}")).unwrap())
            .collect();
        Tree { root, dirs, names }
    }

    fn dir_of(&self, i: usize) -> RawFd {
        self.dirs[i % self.dirs.len()].as_raw_fd()
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const MTIME: [libc::timespec; 2] = [
    libc::timespec {
        tv_sec: 1_600_000_000,
        tv_nsec: 0,
    },
    libc::timespec {
        tv_sec: 1_600_000_000,
        tv_nsec: 0,
    },
];

fn write_with_syscalls(tree: &Tree, data: &[u8]) {
    let dot = c".";
    for (i, name) in tree.names.iter().enumerate() {
        let dir = tree.dir_of(i);
        // SAFETY: plain system calls on descriptors we own and buffers that outlive them.
        unsafe {
            let fd = check(
                libc::openat(
                    dir,
                    dot.as_ptr(),
                    libc::O_TMPFILE | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o644,
                ),
                "open",
            );
            let n = libc::pwrite(fd, data.as_ptr().cast(), data.len(), 0);
            assert_eq!(n, data.len() as isize, "write");
            check(libc::futimens(fd, MTIME.as_ptr()), "futimens");
            check(
                libc::linkat(fd, c"".as_ptr(), dir, name.as_ptr(), libc::AT_EMPTY_PATH),
                "linkat",
            );
            libc::close(fd);
        }
    }
}

/// Submits what is queued and collects exactly `expected` completions, results by
/// `user_data`.
fn complete(ring: &mut IoUring, expected: usize, results: &mut [i32]) {
    ring.submit_and_wait(expected).expect("io_uring_enter");
    let mut got = 0;
    while got < expected {
        for cqe in ring.completion() {
            results[cqe.user_data() as usize] = cqe.result();
            got += 1;
        }
        if got < expected {
            ring.submit_and_wait(expected - got)
                .expect("io_uring_enter");
        }
    }
}

fn push(ring: &mut IoUring, sqe: squeue::Entry) {
    // SAFETY: every pointer in the entries made here (paths, buffers) outlives the round
    // that completes them.
    unsafe {
        ring.submission()
            .push(&sqe)
            .expect("ring sized for the batch")
    };
}

fn write_with_uring(tree: &Tree, data: &[u8], batch: usize) {
    let mut ring = IoUring::new((2 * batch) as u32).expect("io_uring_setup");
    let dot = c".";
    let mut results = vec![0i32; 2 * batch];
    let mut fds = vec![0 as RawFd; batch];
    for start in (0..tree.names.len()).step_by(batch) {
        let count = batch.min(tree.names.len() - start);
        for j in 0..count {
            let sqe = opcode::OpenAt::new(types::Fd(tree.dir_of(start + j)), dot.as_ptr())
                .flags(libc::O_TMPFILE | libc::O_WRONLY | libc::O_CLOEXEC)
                .mode(0o644)
                .build()
                .user_data(j as u64);
            push(&mut ring, sqe);
        }
        complete(&mut ring, count, &mut results);
        for j in 0..count {
            fds[j] = cqe_result(results[j], "open");
            let sqe = opcode::Write::new(types::Fd(fds[j]), data.as_ptr(), data.len() as u32)
                .offset(0)
                .build()
                .user_data(j as u64);
            push(&mut ring, sqe);
        }
        complete(&mut ring, count, &mut results);
        for (j, &fd) in fds[..count].iter().enumerate() {
            assert_eq!(results[j], data.len() as i32, "write");
            // SAFETY: a descriptor we own and a valid times array.
            check(unsafe { libc::futimens(fd, MTIME.as_ptr()) }, "futimens");
            let dir = tree.dir_of(start + j);
            let link = opcode::LinkAt::new(
                types::Fd(fd),
                c"".as_ptr(),
                types::Fd(dir),
                tree.names[start + j].as_ptr(),
            )
            .flags(libc::AT_EMPTY_PATH)
            .build()
            .flags(squeue::Flags::IO_LINK)
            .user_data((2 * j) as u64);
            push(&mut ring, link);
            let close = opcode::Close::new(types::Fd(fd))
                .build()
                .user_data((2 * j + 1) as u64);
            push(&mut ring, close);
        }
        complete(&mut ring, 2 * count, &mut results);
        for r in &results[..2 * count] {
            cqe_result(*r, "link or close");
        }
    }
}

fn read_with_syscalls(tree: &Tree, buf: &mut [u8]) {
    for (i, name) in tree.names.iter().enumerate() {
        // SAFETY: plain system calls on descriptors we own into a buffer we own.
        unsafe {
            let fd = check(
                libc::openat(
                    tree.dir_of(i),
                    name.as_ptr(),
                    libc::O_RDONLY | libc::O_CLOEXEC,
                ),
                "open",
            );
            let n = libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
            assert_eq!(n, buf.len() as isize, "read");
            libc::close(fd);
        }
    }
}

fn read_with_uring(tree: &Tree, bufs: &mut [Vec<u8>], batch: usize) {
    let mut ring = IoUring::new((2 * batch) as u32).expect("io_uring_setup");
    let mut results = vec![0i32; 2 * batch];
    for start in (0..tree.names.len()).step_by(batch) {
        let count = batch.min(tree.names.len() - start);
        for j in 0..count {
            let sqe = opcode::OpenAt::new(
                types::Fd(tree.dir_of(start + j)),
                tree.names[start + j].as_ptr(),
            )
            .flags(libc::O_RDONLY | libc::O_CLOEXEC)
            .build()
            .user_data(j as u64);
            push(&mut ring, sqe);
        }
        complete(&mut ring, count, &mut results);
        let fds: Vec<RawFd> = results[..count]
            .iter()
            .map(|&r| cqe_result(r, "open"))
            .collect();
        for (j, &fd) in fds.iter().enumerate() {
            let buf = &mut bufs[j];
            let read = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), buf.len() as u32)
                .offset(0)
                .build()
                .flags(squeue::Flags::IO_LINK)
                .user_data((2 * j) as u64);
            push(&mut ring, read);
            let close = opcode::Close::new(types::Fd(fd))
                .build()
                .user_data((2 * j + 1) as u64);
            push(&mut ring, close);
        }
        complete(&mut ring, 2 * count, &mut results);
        for j in 0..count {
            assert_eq!(results[2 * j], bufs[j].len() as i32, "read");
            cqe_result(results[2 * j + 1], "close");
        }
    }
}

/// One timed run of one phase.
struct Sample {
    secs: f64,
    cpu_us: u64,
    /// io_uring worker threads alive after it.
    workers: usize,
}

/// The runs of one variant and phase, over the rounds.
struct Row {
    variant: String,
    phase: &'static str,
    runs: Vec<Sample>,
}

fn measure(work: impl FnOnce()) -> Sample {
    let (cpu, wall) = (cpu_us(), Instant::now());
    work();
    let secs = wall.elapsed().as_secs_f64();
    Sample {
        secs,
        cpu_us: cpu_us() - cpu,
        workers: uring_workers(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let o = Options::parse();
    let data: Vec<u8> = (0..o.size).map(|i| (i * 7 % 251) as u8).collect();
    let variants: Vec<Option<usize>> = std::iter::once(None)
        .chain(o.batches.iter().copied().map(Some))
        .collect();
    let name = |v: &Option<usize>| match v {
        None => "syscalls".to_string(),
        Some(b) => format!("io_uring B={b}"),
    };
    let mut table: Vec<Row> = Vec::new();
    for v in &variants {
        for phase in ["write", "read"] {
            table.push(Row {
                variant: name(v),
                phase,
                runs: Vec::new(),
            });
        }
    }
    for round in 0..o.rounds {
        for (k, v) in variants.iter().enumerate() {
            let tree = Tree::new(&o.base, &format!("{round}-{k}"), &o);
            let wrote = measure(|| match v {
                None => write_with_syscalls(&tree, &data),
                Some(b) => write_with_uring(&tree, &data, *b),
            });
            let read = measure(|| match v {
                None => read_with_syscalls(&tree, &mut vec![0u8; o.size]),
                Some(b) => read_with_uring(&tree, &mut vec![vec![0u8; o.size]; *b], *b),
            });
            table[2 * k].runs.push(wrote);
            table[2 * k + 1].runs.push(read);
        }
        eprintln!("round {} of {} done", round + 1, o.rounds);
    }
    println!(
        "{} files of {} bytes in {} directories under {}, {} rounds (medians; CPU min..max)",
        o.files,
        o.size,
        o.dirs,
        o.base.display(),
        o.rounds
    );
    println!(
        "{:<16} {:<6} {:>10} {:>12} {:>18} {:>8}",
        "variant", "phase", "files/s", "CPU µs/file", "range", "iou-wrk"
    );
    for Row {
        variant,
        phase,
        runs,
    } in &table
    {
        let per_file = |s: &Sample| s.cpu_us as f64 / o.files as f64;
        let rate = median(runs.iter().map(|s| o.files as f64 / s.secs).collect());
        let cpu = median(runs.iter().map(per_file).collect());
        let lo = runs.iter().map(per_file).fold(f64::MAX, f64::min);
        let hi = runs.iter().map(per_file).fold(0.0, f64::max);
        let workers = runs.iter().map(|s| s.workers).max().unwrap_or(0);
        println!(
            "{variant:<16} {phase:<6} {rate:>10.0} {cpu:>12.2} {:>18} {workers:>8}",
            format!("{lo:.2}..{hi:.2}")
        );
    }
}
