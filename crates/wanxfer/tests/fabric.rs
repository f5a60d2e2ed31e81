//! The end-to-end suite over the fabric transport (libfabric's `tcp` provider, which runs
//! the same RDMA-write code path as real hardware): trees both ways, thousands of tiny
//! packed files, memory-to-memory, a receiver that stops granting credits, a server that
//! vanishes, and the refusals when fabric or the provider is not there.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::process::Stdio;
use std::time::Duration;

use common::*;

const FABRIC: [&str; 4] = ["--transport", "fabric", "--provider", "tcp"];
/// RDMA writes cannot go through TLS: fabric sessions run only as explicitly unencrypted
/// ones (their blocks MAC'd), so servers allow it and clients ask for it.
const ALLOW: &str = "--allow-unencrypted";
const PLAIN: &str = "--no-encryption";

fn fabric_site() -> Site {
    let mut flags = FABRIC.to_vec();
    flags.push(ALLOW);
    Site::with_serve_flags(&flags)
}

/// `wanxfer cp --transport fabric ARGS...`.
fn fabric_cp<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut all: Vec<std::ffi::OsString> = FABRIC.iter().map(Into::into).collect();
    all.push(PLAIN.into());
    all.extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
    cp(all)
}

#[test]
fn trees_go_both_ways_over_fabric() {
    if !fabric_available() {
        return;
    }
    let site = fabric_site();
    let src = site.path("src/tree");
    odd_tree(&src);
    let run = fabric_cp([
        OsStr::new("--json"),
        src.as_os_str(),
        &site.server.url("copy"),
    ]);
    let json = run.assert_ok().json();
    assert_eq!(json["transport"], "fabric");
    assert_eq!(json["fabric_provider"], "tcp");
    assert!(json["fabric_domain"].is_string(), "{json}");
    assert_same_tree(&src, &site.root().join("copy"), true);

    let back = site.path("back");
    fabric_cp([&site.server.url("copy"), back.as_os_str()]).assert_ok();
    assert_same_tree(&src, &back, true);
    assert!(temp_files(site.root()).is_empty() && temp_files(&back).is_empty());
}

/// Blocks land in RDMA slots and are written from there; a chunk of a large file lands
/// page-aligned, so `--write direct` bypasses the page cache for all of its aligned bytes,
/// on the server (push) and on the client (pull), and the files are intact.
#[test]
fn chunks_of_large_files_land_aligned_for_direct_writes() {
    if !fabric_available() {
        return;
    }
    let mut flags = FABRIC.to_vec();
    flags.extend(["--write", "direct", ALLOW]);
    let site = Site::with_serve_flags(&flags);
    let src = site.path("src/tree");
    odd_tree(&src);
    write_pattern(&src.join("multi-block"), (3 << 20) + 10_000, 5);
    let aligned = direct_writable_bytes(&src, 1 << 20);
    let opts = ["--json", "--write", "direct", "--block-size", "1MiB"];
    let url = site.server.url("copy");
    let push: Vec<&OsStr> = opts
        .iter()
        .map(OsStr::new)
        .chain([src.as_os_str(), &url])
        .collect();
    let json = fabric_cp(push).assert_ok().json();
    assert_same_tree(&src, &site.root().join("copy"), true);
    assert_writes_reported(&json, "peer_", "direct", aligned);

    let back = site.path("back");
    let pull: Vec<&OsStr> = opts
        .iter()
        .map(OsStr::new)
        .chain([url.as_os_str(), back.as_os_str()])
        .collect();
    let json = fabric_cp(pull).assert_ok().json();
    assert_same_tree(&src, &back, true);
    assert_writes_reported(&json, "", "direct", aligned);
}

#[test]
fn thousands_of_tiny_packed_files_keep_credits_and_control_in_step() {
    if !fabric_available() {
        return;
    }
    let site = fabric_site();
    let src = site.path("tiny");
    for d in 0..20 {
        let dir = src.join(format!("d{d}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..250 {
            fs::write(
                dir.join(format!("f{f}")),
                pattern_bytes(f % 200, d * 1000 + f),
            )
            .unwrap();
        }
    }
    // Small blocks and one credit per stream: thousands of grant/write/regrant rounds.
    let run = fabric_cp([
        OsStr::new("--json"),
        OsStr::new("--block-size"),
        OsStr::new("64KiB"),
        OsStr::new("--depth"),
        OsStr::new("1"),
        OsStr::new("--streams"),
        OsStr::new("3"),
        src.as_os_str(),
        &site.server.url("tiny"),
    ]);
    assert_eq!(run.assert_ok().json()["files"], 5000);
    assert_same_tree(&src, &site.root().join("tiny"), false);

    let back = site.path("back");
    fabric_cp([
        OsStr::new("--block-size"),
        OsStr::new("64KiB"),
        OsStr::new("--depth"),
        OsStr::new("1"),
        &site.server.url("tiny"),
        back.as_os_str(),
    ])
    .assert_ok();
    assert_same_tree(&src, &back, false);
}

#[test]
fn memory_to_memory_over_fabric_both_ways() {
    if !fabric_available() {
        return;
    }
    let site = fabric_site();
    for (src, dst) in [
        ("/dev/zero".to_string(), site.server.url("dev/null")),
        (
            site.server.url("dev/zero").to_string_lossy().into_owned(),
            "/dev/null".into(),
        ),
    ] {
        let run = fabric_cp([
            OsStr::new("--json"),
            OsStr::new("--bytes"),
            OsStr::new("256MiB"),
            OsStr::new(&src),
            &dst,
        ]);
        let json = run.assert_ok().json();
        assert_eq!(json["bytes"], 256u64 << 20);
        assert_eq!(json["transport"], "fabric");
    }
    assert!(snapshot(site.root()).is_empty());
}

#[test]
fn a_receiver_that_stops_granting_makes_the_sender_wait_not_fail() {
    if !fabric_available() {
        return;
    }
    let site = fabric_site();
    let src = site.path("data.bin");
    fs::File::create(&src).unwrap().set_len(1 << 30).unwrap();
    let client = cp_command(
        FABRIC
            .iter()
            .chain([&PLAIN])
            .map(OsStr::new)
            .chain([
                OsStr::new("--block-size"),
                OsStr::new("1MiB"),
                src.as_os_str(),
                &site.server.url("data.bin"),
            ])
            .collect::<Vec<_>>(),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Freeze the receiver once blocks flow: it stops granting slots, so the sender runs
    // out of credits and must wait for as long as the receiver is stopped.
    let root = site.server.root.clone();
    wait_for("blocks to arrive", Duration::from_secs(60), || {
        !temp_files(&root).is_empty()
    });
    signal(site.server.pid(), "STOP");
    assert!(
        !temp_files(&root).is_empty(),
        "the receiver was stopped mid-transfer"
    );
    std::thread::sleep(Duration::from_millis(1500));
    signal(site.server.pid(), "CONT");
    finish(client).assert_ok();
    assert_eq!(node(&src), node(&site.root().join("data.bin")));
}

#[test]
fn a_server_vanishing_mid_fabric_push_is_a_network_error() {
    if !fabric_available() {
        return;
    }
    let mut site = fabric_site();
    let src = site.path("large.bin");
    fs::File::create(&src).unwrap().set_len(3 << 30).unwrap();
    let root = site.server.root.clone();
    let client = cp_command(
        FABRIC
            .iter()
            .chain([&PLAIN])
            .map(OsStr::new)
            .chain([src.as_os_str(), &site.server.url("large.bin")])
            .collect::<Vec<_>>(),
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || !temp_files(&root).is_empty(),
    );
    signal(client.id() as i32, "STOP");
    site.server.kill();
    signal(client.id() as i32, "CONT");
    finish(client).assert_code(4);
    assert!(!root.join("large.bin").exists());
}

#[test]
fn fabric_is_refused_clearly_where_it_is_not_offered() {
    if !fabric_available() {
        return;
    }
    let tcp_only = Site::with_serve_flags(&[ALLOW]);
    fabric_cp([
        "--bytes",
        "1MiB",
        "/dev/zero",
        tcp_only.server.url("dev/null").to_str().unwrap(),
    ])
    // The server's greeting says it offers no fabric: a usage error, found before any
    // session is asked for.
    .assert_code(2)
    .assert_stderr_mentions(
        "does not offer the fabric transport (start it with --transport fabric)",
    );

    let site = fabric_site();
    // Without the opt-in: refused before connecting, naming the flag.
    cp([
        "--transport",
        "fabric",
        "--provider",
        "tcp",
        "--bytes",
        "1MiB",
        "/dev/zero",
        site.server.url("dev/null").to_str().unwrap(),
    ])
    .assert_code(2)
    .assert_stderr_mentions("--no-encryption");
    let run = cp([
        PLAIN,
        "--transport",
        "fabric",
        "--provider",
        "no-such-provider",
        "--bytes",
        "1MiB",
        "/dev/zero",
        site.server.url("dev/null").to_str().unwrap(),
    ]);
    run.assert_code(2)
        .assert_stderr_mentions("no-such-provider");
}

/// A server offering fabric starts libfabric as it starts (so its first session does not
/// wait for it) and says what it found, before any client asks; a provider that is not
/// there is a warning, and the server goes on serving TCP.
#[test]
fn a_fabric_server_reports_its_provider_as_it_starts() {
    if !fabric_available() {
        return;
    }
    let logged = |site: &Site, what: &str| {
        // The start-up runs on a thread of its own: wait for its line, within a bound.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            if site.server.log().contains(what) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    };
    let site = fabric_site();
    assert!(
        logged(&site, "fabric transport ready: provider tcp"),
        "{}",
        site.server.log()
    );

    let missing = Site::with_serve_flags(&[
        "--transport",
        "fabric",
        "--provider",
        "no-such-provider",
        ALLOW,
    ]);
    assert!(
        logged(&missing, "fabric transport no-such-provider unavailable"),
        "{}",
        missing.server.log()
    );
    let src = missing.path("small.bin");
    write_pattern(&src, 100_000, 3);
    cp([src.as_os_str(), &missing.server.url("small.bin")]).assert_ok();
    assert_eq!(
        fs::read(&src).unwrap(),
        fs::read(missing.root().join("small.bin")).unwrap()
    );
}

#[test]
fn more_slots_than_control_window_still_close_cleanly() {
    if !fabric_available() {
        return;
    }
    // 17 slots per channel against a control window of 9: the receiver's last grants
    // cross the sender's goodbye, which once deadlocked the close (both sides waiting).
    let site = fabric_site();
    for _ in 0..4 {
        fabric_cp([
            "--streams",
            "1",
            "--depth",
            "16",
            "--block-size",
            "256KiB",
            "--bytes",
            "128MiB",
            "/dev/zero",
            site.server.url("dev/null").to_str().unwrap(),
        ])
        .assert_ok();
    }
}

#[test]
fn bench_measures_ping_pong_latency_over_both_transports() {
    if !fabric_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("latency.json");
    let status = std::process::Command::new(wanxfer_bin())
        .args(["bench", "--latency", "--json"])
        .arg(&json)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let points: serde_json::Value = serde_json::from_slice(&fs::read(&json).unwrap()).unwrap();
    let points = points.as_array().unwrap();
    assert_eq!(points.len(), 11, "8 B to 4 MiB");
    for p in points {
        assert!(p["tcp_us"].as_f64().unwrap() > 0.0 && p["fabric_us"].as_f64().unwrap() > 0.0);
    }
}
