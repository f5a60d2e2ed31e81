//! Whether the sender should checksum file blocks through a memory mapping instead of
//! `pread`ing them into a pool buffer. A mapping saves the kernel's copy, but pays for
//! page faults, page-table setup and teardown instead; and a file truncated under a
//! mapping kills the reader with SIGBUS. This measures what the saving is worth on this
//! machine, over a file already in the page cache, with the reader's checks of protocol 3
//! (CRC-32C of the block and the file's XXH3-128; since protocol 4 the XXH3 alone) run on
//! every block either way.
//!
//! `cargo run --release -p wanxfer-engine --example page_cache_reads -- FILE [MiB]`
//! (FILE on tmpfs, or read once beforehand so that it is cached.)

use std::fs::File;
use std::hint::black_box;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use wanxfer_engine::digest::FileHasher;
use wanxfer_engine::progress::process_cpu;

/// The reader's checks over one block.
fn check(block: &[u8], hasher: &mut FileHasher) -> u32 {
    hasher.update(block);
    crc32c::crc32c(block)
}

/// A read-only shared mapping of `len` bytes of `file` at `offset`, unmapped on drop.
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(file: &File, offset: u64, len: usize, flags: libc::c_int) -> Mapping {
        // SAFETY: a fresh mapping at an address the kernel picks; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | flags,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes for as long as `self` lives (this
        // measurement does not truncate the file under it).
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

fn measure(name: &str, size: u64, read_all: impl FnOnce() -> u32) {
    let cpu0 = process_cpu().seconds();
    black_box(read_all());
    let cpu = process_cpu().seconds() - cpu0;
    println!("{name:<34} {:>6.3} CPU s/GB", cpu / (size as f64 / 1e9));
}

fn blocks(size: u64, block: usize) -> impl Iterator<Item = (u64, usize)> {
    (0..size)
        .step_by(block)
        .map(move |o| (o, (size - o).min(block as u64) as usize))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: page_cache_reads FILE [block MiB]");
    let block = args
        .next()
        .and_then(|a| a.parse::<usize>().ok())
        .unwrap_or(4)
        << 20;
    let file = File::open(&path).expect("open FILE");
    let size = file.metadata().expect("stat FILE").len();
    println!(
        "{path}: {:.2} GB, {} MiB blocks, CRC-32C + XXH3-128 per block",
        size as f64 / 1e9,
        block >> 20
    );
    for round in 1..=3 {
        println!("round {round}");
        measure("pread into a buffer", size, || {
            let (mut buf, mut h) = (vec![0u8; block], FileHasher::new());
            blocks(size, block).fold(0, |acc, (o, n)| {
                file.read_exact_at(&mut buf[..n], o).expect("pread");
                acc ^ check(&buf[..n], &mut h)
            })
        });
        measure("mmap per block (MAP_POPULATE)", size, || {
            let mut h = FileHasher::new();
            blocks(size, block).fold(0, |acc, (o, n)| {
                let map = Mapping::new(&file, o, n, libc::MAP_POPULATE);
                acc ^ check(map.bytes(), &mut h)
            })
        });
        measure("mmap per block (faulted)", size, || {
            let mut h = FileHasher::new();
            blocks(size, block).fold(0, |acc, (o, n)| {
                acc ^ check(Mapping::new(&file, o, n, 0).bytes(), &mut h)
            })
        });
        measure("one mapping, MADV_SEQUENTIAL", size, || {
            let map = Mapping::new(&file, 0, size as usize, 0);
            // SAFETY: advice on the range just mapped.
            unsafe { libc::madvise(map.ptr, map.len, libc::MADV_SEQUENTIAL) };
            let mut h = FileHasher::new();
            let bytes = map.bytes();
            blocks(size, block).fold(0, |acc, (o, n)| {
                acc ^ check(&bytes[o as usize..o as usize + n], &mut h)
            })
        });
    }
}
