//! Someone on the path: a proxy thread between a real client and a real server that
//! records every byte both ways and can flip one, replayed handshakes, and a server whose
//! certificate changed. With TLS (the default) nothing readable crosses the network and
//! tampering ends a channel or the session cleanly; without encryption the MACs catch
//! tampering as an integrity error naming the file; in no case does anything corrupt reach
//! a final name.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;

/// What the proxy does to one byte stream: flip the byte at `offset` of the
/// client-to-server bytes of connection number `connection` (0 is the control
/// connection; data channels follow).
#[derive(Clone, Copy)]
struct Flip {
    connection: usize,
    offset: u64,
}

/// Per connection: (client to server, server to client).
type Captured = Arc<Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

/// A forwarding proxy on loopback, recording both directions of every connection.
struct Proxy {
    addr: String,
    captured: Captured,
    flipped: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: &str, flip: Option<Flip>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let captured = Arc::new(Mutex::new(Vec::new()));
        let flipped = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (up, cap, fl, st) = (
            upstream.to_string(),
            captured.clone(),
            flipped.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            let count = AtomicUsize::new(0);
            // Bounded: a test never runs this long, and the proxy must stop on its own.
            let until = std::time::Instant::now() + Duration::from_secs(120);
            while !st.load(Ordering::Relaxed) && std::time::Instant::now() < until {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(&up) else {
                    continue;
                };
                let n = count.fetch_add(1, Ordering::Relaxed);
                let slot = {
                    let mut c = cap.lock().unwrap();
                    c.push((Vec::new(), Vec::new()));
                    c.len() - 1
                };
                let flip_here = flip.filter(|f| f.connection == n).map(|f| f.offset);
                pump(
                    &client,
                    &server,
                    cap.clone(),
                    slot,
                    true,
                    flip_here,
                    fl.clone(),
                );
                pump(&server, &client, cap.clone(), slot, false, None, fl.clone());
            }
        });
        Proxy {
            addr,
            captured,
            flipped,
            stop,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("wanxfer://{}/{path}", self.addr)
    }

    fn all_bytes(&self) -> Vec<u8> {
        let c = self.captured.lock().unwrap();
        let mut all = Vec::new();
        for (up, down) in c.iter() {
            all.extend_from_slice(up);
            all.extend_from_slice(down);
        }
        all
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Copies `from` to `to` on a thread, recording (and maybe flipping) what passes.
fn pump(
    from: &TcpStream,
    to: &TcpStream,
    captured: Captured,
    slot: usize,
    upstream: bool,
    flip_at: Option<u64>,
    flipped: Arc<AtomicBool>,
) {
    let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        let mut at = 0u64;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(off) = flip_at {
                if off >= at && off < at + n as u64 {
                    buf[(off - at) as usize] ^= 0x20;
                    flipped.store(true, Ordering::Relaxed);
                }
            }
            at += n as u64;
            {
                let mut c = captured.lock().unwrap();
                let side = if upstream {
                    &mut c[slot].0
                } else {
                    &mut c[slot].1
                };
                side.extend_from_slice(&buf[..n]);
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The file under its final name is either absent or exactly the source.
#[track_caller]
fn nothing_corrupt(dest: &std::path::Path, source: &[u8]) {
    if let Ok(got) = std::fs::read(dest) {
        assert!(got == source, "a corrupt file reached its final name");
    }
    assert!(
        temp_files(dest.parent().unwrap()).is_empty() || !dest.exists(),
        "no partial file beside a finished one"
    );
}

const PAYLOAD_LEN: usize = 6 << 20;

fn big_source(site: &Site) -> (std::path::PathBuf, Vec<u8>) {
    let src = site.path("big.bin");
    write_pattern(&src, PAYLOAD_LEN as u64, 7);
    let bytes = std::fs::read(&src).unwrap();
    (src, bytes)
}

/// One flipped byte inside a data channel's TLS records: the record fails its AEAD tag,
/// the channel (or the session) ends cleanly, and the file is either sent again on
/// another channel or not placed at all.
#[test]
fn a_byte_flipped_in_a_tls_data_channel_ends_it_cleanly() {
    let site = Site::new();
    let (src, bytes) = big_source(&site);
    let proxy = Proxy::start(
        &site.server.addr,
        Some(Flip {
            connection: 1,
            offset: 1 << 20,
        }),
    );
    let run = cp(["--json", "--retries", "0", "--streams", "1"]
        .iter()
        .map(std::ffi::OsStr::new)
        .chain([src.as_os_str(), std::ffi::OsStr::new(&proxy.url("big.bin"))]));
    assert!(
        proxy.flipped.load(Ordering::Relaxed),
        "the proxy flipped a byte"
    );
    nothing_corrupt(&site.server.root.join("big.bin"), &bytes);
    if run.code == 0 {
        assert!(
            run.json()["channels_lost"].as_u64().unwrap() >= 1,
            "success only by failing over: {}",
            run.stdout
        );
        assert_eq!(
            std::fs::read(site.server.root.join("big.bin")).unwrap(),
            bytes
        );
    }
    assert!(
        site.server.log().contains("TLS") || run.code == 0,
        "the server names TLS as the reason: {}",
        site.server.log()
    );
}

/// Without encryption the block's MAC catches the same flip as an integrity error
/// naming the file, and the file never reaches its name.
#[test]
fn a_byte_flipped_without_encryption_is_an_integrity_error_naming_the_file() {
    let site = Site::with_serve_flags(&["--allow-unencrypted"]);
    let (src, bytes) = big_source(&site);
    let proxy = Proxy::start(
        &site.server.addr,
        Some(Flip {
            connection: 1,
            offset: 1 << 20,
        }),
    );
    let run = cp(["--no-encryption", "--retries", "0", "--streams", "1"]
        .iter()
        .map(std::ffi::OsStr::new)
        .chain([src.as_os_str(), std::ffi::OsStr::new(&proxy.url("big.bin"))]));
    assert!(
        proxy.flipped.load(Ordering::Relaxed),
        "the proxy flipped a byte"
    );
    run.assert_code(6).assert_stderr_mentions("big.bin");
    nothing_corrupt(&site.server.root.join("big.bin"), &bytes);
    assert!(!site.server.root.join("big.bin").exists());
}

/// The contents and the name of a file never appear on the wire under TLS, on any
/// connection; the same transfer without encryption shows both (so the check can fail).
#[test]
fn names_and_contents_do_not_cross_the_network_in_the_clear() {
    let content_marker = b"MARKER-content-xyzzy-4711";
    let name_marker = "MARKER-name-plugh-0815";
    for encrypted in [true, false] {
        let site = if encrypted {
            Site::new()
        } else {
            Site::with_serve_flags(&["--allow-unencrypted"])
        };
        let src = site.path(name_marker);
        std::fs::write(&src, content_marker.repeat(5000)).unwrap();
        let proxy = Proxy::start(&site.server.addr, None);
        let mut args = vec![std::ffi::OsString::from("--json")];
        if !encrypted {
            args.push("--no-encryption".into());
        }
        args.push(src.clone().into());
        args.push(proxy.url("").into());
        let run = cp(&args);
        run.assert_ok();
        let json = run.json();
        let wire = proxy.all_bytes();
        assert!(
            proxy.captured.lock().unwrap().len() >= 2,
            "control and data captured"
        );
        if encrypted {
            assert_eq!(json["encryption"], "TLS13_AES_128_GCM_SHA256");
            assert!(!contains(&wire, content_marker), "contents in the clear");
            assert!(
                !contains(&wire, name_marker.as_bytes()),
                "the name in the clear"
            );
        } else {
            assert_eq!(json["encryption"], "none");
            assert!(contains(&wire, content_marker));
            assert!(contains(&wire, name_marker.as_bytes()));
        }
        assert!(site.server.root.join(name_marker).exists());
    }
}

/// A recorded control connection replayed byte for byte is refused: under TLS the
/// server's fresh random makes the recorded handshake worthless; without encryption its
/// fresh nonce makes the recorded proof wrong. Nothing is written either way.
#[test]
fn a_replayed_handshake_is_refused_and_touches_nothing() {
    for encrypted in [true, false] {
        let site = if encrypted {
            Site::new()
        } else {
            Site::with_serve_flags(&["--allow-unencrypted"])
        };
        let src = site.path("once");
        std::fs::write(&src, b"sent once").unwrap();
        let proxy = Proxy::start(&site.server.addr, None);
        let mut args = vec![];
        if !encrypted {
            args.push(std::ffi::OsString::from("--no-encryption"));
        }
        args.push(src.clone().into());
        args.push(proxy.url("first").into());
        cp(&args).assert_ok();
        let recorded = proxy.captured.lock().unwrap()[0].0.clone();
        std::fs::remove_file(site.server.root.join("first")).unwrap();

        let mut replay = TcpStream::connect(&site.server.addr).unwrap();
        replay
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let _ = replay.write_all(&recorded);
        let _ = replay.shutdown(Shutdown::Write);
        let mut answer = Vec::new();
        let _ = replay.read_to_end(&mut answer);
        assert!(
            !contains(&answer, b"SessionAccepted"),
            "no session for a replay"
        );
        wait_for(
            "the server to log the refusal",
            Duration::from_secs(10),
            || {
                let log = site.server.log();
                if encrypted {
                    log.contains("TLS")
                } else {
                    log.contains("authentication failed")
                }
            },
        );
        assert!(snapshot(&site.server.root).is_empty(), "nothing touched");
    }
}

/// A server whose certificate changed is refused with a message saying what changed and
/// how to accept it, with the authentication exit code, and nothing is written; the
/// server with the pinned certificate is accepted again.
#[test]
fn a_changed_server_certificate_is_refused_with_what_changed() {
    let mut site = Site::new();
    let src = site.path("f");
    std::fs::write(&src, b"pinned").unwrap();
    let state = site.path("client-state");
    let with_state = |dest: &str, server: &Server| {
        let mut cmd = cp_command([
            std::ffi::OsString::from("--state-dir"),
            state.clone().into(),
            src.clone().into(),
            server.url(dest),
        ]);
        cmd.env("RUST_LOG", "warn");
        Run::from_cmd(cmd)
    };
    with_state("first", &site.server).assert_ok();
    let pinned = std::fs::read_to_string(state.join("known_hosts")).unwrap();
    assert!(
        pinned.starts_with(&format!("{} SHA256:", site.server.addr)),
        "{pinned}"
    );

    // The same address, another key.
    let other = site.path("other-identity");
    wanxfer_engine::tls::ServerIdentity::load_or_create(&other).unwrap();
    let addr = site.server.addr.clone();
    site.server.kill();
    let mut cmd = std::process::Command::new(wanxfer_bin());
    cmd.args(["serve", "--listen", &addr]);
    let cert = other.join(wanxfer_engine::tls::CERT_FILE);
    let key = other.join(wanxfer_engine::tls::KEY_FILE);
    let impostor = Server::start_with(
        cmd,
        &site.server.root.clone(),
        &[
            "--cert",
            cert.to_str().unwrap(),
            "--key",
            key.to_str().unwrap(),
        ],
    );
    let run = with_state("second", &impostor);
    run.assert_code(3)
        .assert_stderr_mentions("certificate changed")
        .assert_stderr_mentions("known_hosts line 1")
        .assert_stderr_mentions("delete that line");
    assert!(!impostor.root.join("second").exists(), "nothing touched");
    assert_eq!(
        std::fs::read_to_string(state.join("known_hosts")).unwrap(),
        pinned,
        "the pin is not replaced"
    );
}

/// Both sides must agree to go without encryption, and a mismatch names the flag.
#[test]
fn plaintext_needs_both_sides_and_says_which_flag() {
    let site = Site::new();
    let src = site.path("f");
    std::fs::write(&src, b"x").unwrap();
    let run = cp([
        std::ffi::OsString::from("--no-encryption"),
        src.clone().into(),
        site.server.url("f"),
    ]);
    assert_ne!(run.code, 0);
    run.assert_stderr_mentions("--allow-unencrypted");
    assert!(!site.server.root.join("f").exists());
    // With both, it works and warns on both sides.
    let site = Site::with_serve_flags(&["--allow-unencrypted"]);
    let src = site.path("f");
    std::fs::write(&src, b"x").unwrap();
    let run = cp_with_notes([
        std::ffi::OsString::from("--no-encryption"),
        src.clone().into(),
        site.server.url("f"),
    ]);
    run.assert_ok()
        .assert_stderr_mentions("WARNING: --no-encryption");
    assert!(site.server.log().contains("--allow-unencrypted"));
}

/// Under TLS sealed in user space `sendfile` would bypass the encryption: the session
/// copies instead, and `--json` says so and why, and that wanxfer's record layer sealed
/// the data channels; where the kernel offers TLS the mode stays and records are sealed
/// there.
#[test]
fn under_tls_sendfile_copies_unless_the_kernel_seals_records() {
    let site = Site::new();
    let (src, bytes) = big_source(&site);
    let run = cp([
        std::ffi::OsString::from("--json"),
        "--io".into(),
        "sendfile".into(),
        src.clone().into(),
        site.server.url("big.bin"),
    ]);
    let json = run.assert_ok().json();
    assert_eq!(
        std::fs::read(site.server.root.join("big.bin")).unwrap(),
        bytes
    );
    match wanxfer_engine::tls::kernel_offers_tls() {
        Ok(()) => {
            assert_eq!(json["io"], "sendfile", "{json}");
            assert_eq!(json["tls_records"], "kernel", "{json}");
        }
        Err(_) => {
            assert_eq!(json["io"], "copy", "{json}");
            assert_eq!(json["tls_records"], "wanxfer", "{json}");
            let why = json["io_fallback"].as_str().unwrap();
            assert!(why.contains("TLS") && why.contains("kernel"), "{why}");
        }
    }
}
