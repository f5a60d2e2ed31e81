//! What encryption costs, and the fastest an encrypted transfer could go on this machine.
//!
//! Part 1, per primitive, on 16 KiB pieces in cache (the TLS record size): AES-128-GCM,
//! AES-256-GCM and ChaCha20-Poly1305 sealing (ring, as rustls uses it), AES-128-GCM
//! sealing in place and opening out of place with aws-lc-rs (as the data channels' record
//! layer does, `src/records.rs`), and the hashes a
//! session without encryption uses or could have used per block: keyed BLAKE3 (what
//! wanxfer uses), HMAC-SHA-256, and XXH3-128 (the unkeyed digest, for scale). CPU seconds
//! per GB.
//!
//! Part 2, the floor: one thread seals 16 KiB records with AES-128-GCM and writes them to
//! a loopback TCP socket, another reads them and opens them in place, nothing else. Gbit/s
//! and CPU seconds per GB of each side. An encrypted wanxfer transfer memory to memory is
//! judged against this.
//!
//! `cargo run --release -p wanxfer-engine --example tls_floor -- [GiB] [--floor-only]`
//!
//! `--floor-only` skips part 1, so that `bench/secure.py` can run the floor between
//! wanxfer's runs at the same size without sealing gigabytes in cache first.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};

const RECORD: usize = 16 << 10;
const TAG: usize = 16;

fn thread_cpu_s() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

fn per_gb(name: &str, bytes: u64, mut f: impl FnMut(&mut [u8])) {
    let mut buf = vec![0x5au8; RECORD];
    let start = thread_cpu_s();
    let wall = Instant::now();
    let mut done = 0u64;
    while done < bytes {
        f(&mut buf);
        done += RECORD as u64;
    }
    let cpu = thread_cpu_s() - start;
    println!(
        "{name:<42} {:>6.3} CPU s/GB  {:>6.2} GB/s",
        cpu / (done as f64 / 1e9),
        done as f64 / 1e9 / wall.elapsed().as_secs_f64()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let floor_only = args.iter().any(|a| a == "--floor-only");
    let gib: u64 = args.iter().find_map(|a| a.parse().ok()).unwrap_or(4);
    let bytes = gib << 30;
    if !floor_only {
        primitives(gib, bytes);
    }
    floor(gib, bytes);
}

fn primitives(gib: u64, bytes: u64) {
    println!("-- primitives, 16 KiB pieces in cache, {gib} GiB each");
    for (name, alg) in [
        ("AES-128-GCM seal", &aead::AES_128_GCM),
        ("AES-256-GCM seal", &aead::AES_256_GCM),
        ("ChaCha20-Poly1305 seal", &aead::CHACHA20_POLY1305),
    ] {
        let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).unwrap());
        let mut seq = 0u64;
        per_gb(name, bytes, |buf| {
            seq += 1;
            let tag = key
                .seal_in_place_separate_tag(nonce(seq), Aad::from([0u8; 5]), buf)
                .unwrap();
            let _ = std::hint::black_box(tag);
        });
    }
    // The same cipher through aws-lc-rs, as wanxfer's data channels use it
    // (`records.rs`): sealing in place, and opening from one buffer into another.
    {
        use aws_lc_rs::aead as lc;
        let key = lc::LessSafeKey::new(lc::UnboundKey::new(&lc::AES_128_GCM, &[7u8; 16]).unwrap());
        let lc_nonce = |seq: u64| {
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&seq.to_be_bytes());
            lc::Nonce::assume_unique_for_key(n)
        };
        let mut seq = 0u64;
        per_gb("AES-128-GCM seal (aws-lc-rs)", bytes, |buf| {
            seq += 1;
            let tag = key
                .seal_in_place_separate_tag(lc_nonce(seq), lc::Aad::from([0u8; 5]), buf)
                .unwrap();
            let _ = std::hint::black_box(tag);
        });
        let mut sealed = vec![0x5au8; RECORD];
        let tag = key
            .seal_in_place_separate_tag(lc_nonce(0), lc::Aad::from([0u8; 5]), &mut sealed)
            .unwrap();
        per_gb("AES-128-GCM open (aws-lc-rs, out of place)", bytes, |buf| {
            key.open_separate_gather(
                lc_nonce(0),
                lc::Aad::from([0u8; 5]),
                &sealed,
                tag.as_ref(),
                buf,
            )
            .unwrap();
        });
    }
    let key = [9u8; 32];
    per_gb("BLAKE3 keyed", bytes, |buf| {
        std::hint::black_box(blake3::keyed_hash(&key, buf));
    });
    per_gb("HMAC-SHA-256", bytes / 4, |buf| {
        use hmac::Mac;
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
        m.update(buf);
        std::hint::black_box(m.finalize());
    });
    per_gb("XXH3-128 (unkeyed)", bytes, |buf| {
        std::hint::black_box(twox_hash::XxHash3_128::oneshot(buf));
    });
}

fn floor(gib: u64, bytes: u64) {
    println!("-- floor: AES-128-GCM records over loopback, {gib} GiB");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let receiver = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        let key = LessSafeKey::new(UnboundKey::new(&aead::AES_128_GCM, &[7u8; 16]).unwrap());
        let start = thread_cpu_s();
        let mut buf = vec![0u8; 64 * (RECORD + TAG)];
        let (mut have, mut seq, mut got) = (0usize, 0u64, 0u64);
        loop {
            let n = sock.read(&mut buf[have..]).unwrap();
            if n == 0 {
                break;
            }
            have += n;
            let mut at = 0;
            while have - at >= RECORD + TAG {
                seq += 1;
                let rec = &mut buf[at..at + RECORD + TAG];
                key.open_in_place(nonce(seq), Aad::from([0u8; 5]), rec)
                    .expect("intact");
                at += RECORD + TAG;
                got += RECORD as u64;
            }
            buf.copy_within(at..have, 0);
            have -= at;
        }
        (got, thread_cpu_s() - start)
    });
    let mut sock = TcpStream::connect(addr).unwrap();
    let key = LessSafeKey::new(UnboundKey::new(&aead::AES_128_GCM, &[7u8; 16]).unwrap());
    let source = vec![0x5au8; 4 << 20];
    let mut out = vec![0u8; 16 * (RECORD + TAG)];
    let wall = Instant::now();
    let start = thread_cpu_s();
    let (mut sent, mut seq) = (0u64, 0u64);
    while sent < bytes {
        for chunk in source.chunks(16 * RECORD) {
            let mut len = 0;
            for piece in chunk.chunks(RECORD) {
                seq += 1;
                let rec = &mut out[len..len + piece.len() + TAG];
                rec[..piece.len()].copy_from_slice(piece);
                let (data, tag) = rec.split_at_mut(piece.len());
                let t = key
                    .seal_in_place_separate_tag(nonce(seq), Aad::from([0u8; 5]), data)
                    .unwrap();
                tag.copy_from_slice(t.as_ref());
                len += piece.len() + TAG;
            }
            sock.write_all(&out[..len]).unwrap();
            sent += chunk.len() as u64;
        }
    }
    let send_cpu = thread_cpu_s() - start;
    drop(sock);
    let (got, recv_cpu) = receiver.join().unwrap();
    let secs = wall.elapsed().as_secs_f64();
    let gb = got as f64 / 1e9;
    println!(
        "floor: {:.2} Gbit/s, sender {:.3} CPU s/GB, receiver {:.3} CPU s/GB",
        got as f64 * 8.0 / secs / 1e9,
        send_cpu / gb,
        recv_cpu / gb
    );
}
