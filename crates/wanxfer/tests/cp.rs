//! End to end over loopback: a real server and real `wanxfer cp` runs, checked by
//! comparing whole trees byte for byte with their modes, mtimes and symlinks.

mod common;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use common::*;

#[test]
fn push_then_pull_keeps_names_contents_modes_mtimes_and_symlinks() {
    let site = Site::new();
    let src = site.path("src/tree");
    odd_tree(&src);

    cp([src.as_os_str(), &site.server.url("copy")]).assert_ok();
    assert_same_tree(&src, &site.root().join("copy"), true);

    let back = site.path("back");
    cp([&site.server.url("copy"), back.as_os_str()]).assert_ok();
    assert_same_tree(&src, &back, true);

    assert!(temp_files(site.root()).is_empty());
    assert!(temp_files(&back).is_empty());
}

/// Send modes that bypass user space only apply without encryption here (this kernel
/// has no TLS); under TLS they fall back to copying and say why.
#[test]
fn every_io_mode_and_stream_count_moves_the_same_bytes() {
    let site = Site::with_serve_flags(&["--allow-unencrypted"]);
    let src = site.path("src/tree");
    odd_tree(&src);
    for (i, (flags, io)) in [
        (&["--io", "copy", "--streams", "1"][..], "copy"),
        (
            &[
                "--io",
                "sendfile",
                "--streams",
                "4",
                "--block-size",
                "64KiB",
            ][..],
            "sendfile",
        ),
        // auto: a peer on this host with a checksum on gets plain sends; with nothing
        // to read for a checksum, sendfile.
        (&["--no-block-checksum", "--depth", "1"][..], "copy"),
        // Without digests, a payload CRC checks each block instead.
        (&["--no-file-digest", "--depth", "1"][..], "copy"),
        (
            &["--no-block-checksum", "--no-file-digest", "--depth", "1"][..],
            "sendfile",
        ),
        (
            &[
                "--io",
                "zerocopy",
                "--streams",
                "2",
                "--block-size",
                "64KiB",
            ][..],
            "zerocopy",
        ),
        (
            &["--io", "splice", "--block-size", "1MiB", "--streams", "1"][..],
            "sendfile",
        ),
        (&["--io", "auto", "--block-size", "64KiB"][..], "copy"),
    ]
    .into_iter()
    .enumerate()
    {
        let dest = format!("copy-{i}");
        let mut args: Vec<&OsStr> = ["--json", "--no-encryption"]
            .iter()
            .chain(flags)
            .map(OsStr::new)
            .collect();
        let url = site.server.url(&dest);
        args.extend([src.as_os_str(), &url]);
        let json = cp(args).assert_ok().json();
        assert_same_tree(&src, &site.root().join(&dest), true);
        assert_eq!(json["io"], io, "{json}");
        assert!(json.get("io_fallback").is_none(), "{json}");
    }
}

/// Direct writes (O_DIRECT from aligned pool buffers, buffered tails) and buffered writes
/// must land the same bytes, on the server (push) and on the client (pull). Files of
/// several blocks with unaligned tails exercise both halves of a direct write.
#[test]
fn direct_and_buffered_writes_land_the_same_bytes_both_ways() {
    for mode in ["direct", "buffered"] {
        let site =
            Site::with_serve_flags(&["--write", mode, "--io", "sendfile", "--allow-unencrypted"]);
        let src = site.path("src/tree");
        odd_tree(&src);
        write_pattern(&src.join("multi-block"), (5 << 20) + 1234, 7);
        write_pattern(&src.join("aligned"), 3 << 20, 8);
        let flags = [
            "--json",
            "--no-encryption",
            "--block-size",
            "1MiB",
            "--streams",
            "2",
            "--write",
            mode,
            "--io",
            "sendfile",
        ];
        let aligned_bytes = direct_writable_bytes(&src, 1 << 20);
        let mut push: Vec<&OsStr> = flags.iter().map(OsStr::new).collect();
        let url = site.server.url("copy");
        push.extend([src.as_os_str(), &url]);
        let json = cp(push).assert_ok().json();
        assert_same_tree(&src, &site.root().join("copy"), true);
        assert_eq!(json["io"], "sendfile", "{json}");
        assert_writes_reported(&json, "peer_", mode, aligned_bytes);

        let back = site.path("back");
        let mut pull: Vec<&OsStr> = flags.iter().map(OsStr::new).collect();
        pull.extend([url.as_os_str(), back.as_os_str()]);
        let json = cp(pull).assert_ok().json();
        assert_same_tree(&src, &back, true);
        assert_eq!(json["peer_io"], "sendfile", "{json}");
        assert_writes_reported(&json, "", mode, aligned_bytes);
        assert!(temp_files(site.root()).is_empty() && temp_files(&back).is_empty());
    }
}

/// A destination file system that refuses O_DIRECT (ramfs) gets the files through the
/// page cache, intact, and the server says so in the client's report: in `--json` and as
/// a note on the terminal.
#[test]
fn a_refused_direct_write_falls_back_and_the_server_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let Some(ramfs) = Mount::new(dir.path().join("root"), "ramfs", "mode=755") else {
        return;
    };
    let server = Server::start(&ramfs.path, &["--write", "direct"]);
    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    write_pattern(&src.join("multi-block"), (3 << 20) + 5, 1);
    let args = |extra: &[&str], dest: &str| -> Vec<OsString> {
        let mut args: Vec<OsString> = ["--block-size", "1MiB"]
            .iter()
            .chain(extra)
            .map(OsString::from)
            .collect();
        args.extend([src.clone().into_os_string(), server.url(dest)]);
        args
    };
    let json = cp(args(&["--json"], "a")).assert_ok().json();
    assert_eq!(json["peer_io"], "direct", "{json}");
    assert_eq!(json["peer_direct_bytes"], 0, "{json}");
    let why = json["peer_io_fallback"].as_str().unwrap_or_default();
    assert!(
        why.starts_with("O_DIRECT: the destination's file system"),
        "{json}"
    );
    assert_same_tree(&src, &ramfs.path.join("a"), true);

    cp_with_notes(args(&[], "b"))
        .assert_ok()
        .assert_stderr_mentions("the server says: O_DIRECT");
    assert_same_tree(&src, &ramfs.path.join("b"), true);
    assert!(temp_files(&ramfs.path).is_empty());
}

/// libfabric is loaded only for `--transport fabric`: a TCP session must not pay for its
/// providers' start-up (Debian's pull in a library whose constructor takes ~0.2 s).
#[test]
fn a_tcp_session_never_loads_libfabric() {
    let site = Site::new();
    let src = site.path("f");
    fs::write(&src, b"tcp only").unwrap();
    cp([src.as_os_str(), &site.server.url("f")]).assert_ok();
    let maps = fs::read_to_string(format!("/proc/{}/maps", site.server.pid())).unwrap();
    assert!(!maps.contains("libfabric"), "the server mapped libfabric");
}

/// `--io zerocopy` sends every block with MSG_ZEROCOPY and says in `--json` how many
/// sends the kernel copied anyway (on loopback: all of them, which is why `auto` does not
/// use it); every block is released before the session ends, so pushes and pulls finish.
#[test]
fn zerocopy_sends_are_counted_and_released() {
    let site = Site::with_serve_flags(&["--allow-unencrypted"]);
    let src = site.path("src/tree");
    odd_tree(&src);
    write_pattern(&src.join("big"), (3 << 20) + 17, 3);
    let run = cp([
        OsStr::new("--json"),
        OsStr::new("--no-encryption"),
        OsStr::new("--io"),
        OsStr::new("zerocopy"),
        OsStr::new("--block-size"),
        OsStr::new("256KiB"),
        OsStr::new("--depth"),
        OsStr::new("1"),
        src.as_os_str(),
        &site.server.url("copy"),
    ]);
    let json = run.assert_ok().json();
    assert_eq!(json["io"], "zerocopy");
    let sends = json["zerocopy_sends"].as_u64().unwrap();
    let copied = json["zerocopy_copied"].as_u64().unwrap();
    assert!(sends >= 12 && copied <= sends, "{json}");
    assert_same_tree(&src, &site.root().join("copy"), true);

    let mem = cp([
        OsStr::new("--json"),
        OsStr::new("--io"),
        OsStr::new("zerocopy"),
        OsStr::new("--bytes"),
        OsStr::new("64MiB"),
        OsStr::new("/dev/zero"),
        &site.server.url("dev/null"),
    ]);
    let json = mem.assert_ok().json();
    assert_eq!(json["bytes"], 64u64 << 20);
    assert_eq!(json["peer_io"], "discard", "{json}");
}

#[test]
fn a_large_file_goes_both_ways_intact() {
    let site = Site::new();
    let src = site.path("big.bin");
    write_pattern(&src, 300 << 20, 1);

    let run = cp([
        OsStr::new("--json"),
        OsStr::new("--block-size"),
        OsStr::new("1MiB"),
        OsStr::new("--streams"),
        OsStr::new("3"),
        src.as_os_str(),
        &site.server.url("big.bin"),
    ]);
    let json = run.assert_ok().json();
    assert_eq!(json["bytes"], 300u64 << 20);
    assert_eq!(json["files"], 1);
    assert_eq!(json["streams"], 3);
    assert_eq!(json["transport"], "tcp");
    assert_eq!(node(&src), node(&site.root().join("big.bin")));

    let back = site.path("back.bin");
    let pulled = cp([
        OsStr::new("--json"),
        &site.server.url("big.bin"),
        back.as_os_str(),
    ]);
    pulled.assert_ok();
    assert_eq!(node(&src), node(&back));

    // Blocks stream through a bounded pool: the file never sits in memory whole.
    let peak_kib = peak_rss_kib(site.server.pid());
    eprintln!("server peak RSS: {peak_kib} KiB");
    assert!(peak_kib < 150 * 1024, "server peak RSS {peak_kib} KiB");
}

#[test]
fn twenty_thousand_small_files_push_and_pull() {
    let site = Site::new();
    let src = site.path("small");
    for d in 0..100 {
        let dir = src.join(format!("dir-{d:03}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..200 {
            let len = 1 + (d * 200 + f) % 3000;
            fs::write(dir.join(format!("f{f}")), pattern_bytes(len, d * 1000 + f)).unwrap();
        }
    }

    let run = cp([
        OsStr::new("--json"),
        src.as_os_str(),
        &site.server.url("small"),
    ]);
    let json = run.assert_ok().json();
    assert_eq!(json["files"], 20_000, "{json}");
    assert_eq!(json["failed_files"], 0);
    assert_same_tree(&src, &site.root().join("small"), false);

    let back = site.path("back");
    cp([&site.server.url("small"), back.as_os_str()]).assert_ok();
    assert_same_tree(&src, &back, false);

    // The server's memory is its block pool plus bookkeeping, whatever the file count:
    // the default pool is a few dozen 4 MiB blocks.
    let peak_kib = peak_rss_kib(site.server.pid());
    eprintln!("server peak RSS: {peak_kib} KiB");
    assert!(
        peak_kib < 256 * 1024,
        "server peak RSS {peak_kib} KiB after 20,000 files each way"
    );
}

#[test]
fn sources_land_where_cp_r_would_put_them() {
    let site = Site::new();
    let a = site.path("a");
    let b = site.path("b.txt");
    fs::create_dir_all(a.join("inner")).unwrap();
    fs::write(a.join("inner/x"), b"x").unwrap();
    fs::write(&b, b"bee").unwrap();

    // One source onto a name that does not exist: becomes that name.
    cp([a.as_os_str(), &site.server.url("renamed")]).assert_ok();
    assert_eq!(fs::read(site.root().join("renamed/inner/x")).unwrap(), b"x");
    cp([b.as_os_str(), &site.server.url("b-renamed")]).assert_ok();
    assert_eq!(fs::read(site.root().join("b-renamed")).unwrap(), b"bee");

    // One source onto an existing directory: goes inside it.
    fs::create_dir(site.root().join("existing")).unwrap();
    cp([a.as_os_str(), &site.server.url("existing")]).assert_ok();
    assert_eq!(
        fs::read(site.root().join("existing/a/inner/x")).unwrap(),
        b"x"
    );

    // Several sources: each goes inside the destination, which must be a directory
    // (as with cp, a missing one is refused rather than guessed at).
    cp([a.as_os_str(), b.as_os_str(), &site.server.url("multi")])
        .assert_code(8)
        .assert_stderr_mentions("multi");
    fs::create_dir(site.root().join("multi")).unwrap();
    cp([a.as_os_str(), b.as_os_str(), &site.server.url("multi")]).assert_ok();
    assert_eq!(fs::read(site.root().join("multi/a/inner/x")).unwrap(), b"x");
    assert_eq!(fs::read(site.root().join("multi/b.txt")).unwrap(), b"bee");

    // Pulling several sources into an existing local directory.
    let local = site.path("local");
    fs::create_dir(&local).unwrap();
    cp([
        &site.server.url("renamed"),
        &site.server.url("b-renamed"),
        local.as_os_str(),
    ])
    .assert_ok();
    assert_eq!(fs::read(local.join("renamed/inner/x")).unwrap(), b"x");
    assert_eq!(fs::read(local.join("b-renamed")).unwrap(), b"bee");

    // The server root itself as destination.
    cp([b.as_os_str(), &site.server.url("")]).assert_ok();
    assert_eq!(fs::read(site.root().join("b.txt")).unwrap(), b"bee");
}

#[test]
fn an_existing_file_is_replaced_by_the_verified_new_one() {
    let site = Site::new();
    let dest = site.root().join("data.bin");
    fs::write(&dest, b"old contents that are longer than the new ones").unwrap();
    let src = site.path("data.bin");
    fs::write(&src, b"new").unwrap();
    cp([src.as_os_str(), &site.server.url("data.bin")]).assert_ok();
    assert_eq!(fs::read(&dest).unwrap(), b"new");

    // And on the pulling side.
    let local = site.path("pulled.bin");
    fs::write(&local, b"stale local copy").unwrap();
    cp([&site.server.url("data.bin"), local.as_os_str()]).assert_ok();
    assert_eq!(fs::read(&local).unwrap(), b"new");
}

#[test]
fn memory_to_memory_moves_real_bytes_and_writes_nothing() {
    let site = Site::new();
    let json = cp([
        "--json",
        "--bytes",
        "96MiB",
        "/dev/zero",
        site.server.url("dev/null").to_str().unwrap(),
    ])
    .assert_ok()
    .json();
    assert_eq!(json["bytes"], 96u64 << 20);
    for key in [
        "seconds",
        "gbit_per_s",
        "files_per_s",
        "cpu_user_s",
        "cpu_sys_s",
        "peer_cpu_user_s",
        "peer_cpu_sys_s",
        "streams",
        "block_size",
        "transport",
    ] {
        assert!(json.get(key).is_some(), "JSON lacks {key}: {json}");
    }
    assert!(json["gbit_per_s"].as_f64().unwrap() > 0.0);
    // The server's CPU for the session is reported, and it did work.
    let peer_cpu =
        json["peer_cpu_user_s"].as_f64().unwrap() + json["peer_cpu_sys_s"].as_f64().unwrap();
    assert!(peer_cpu > 0.0, "{json}");

    let pulled = cp([
        "--json",
        "--bytes",
        "1GB",
        site.server.url("dev/zero").to_str().unwrap(),
        "/dev/null",
    ]);
    assert_eq!(pulled.assert_ok().json()["bytes"], 1_000_000_000u64);
    assert!(
        snapshot(site.root()).is_empty(),
        "/dev/null on the server is never a file"
    );
}

#[test]
fn a_wrong_secret_is_refused_before_the_server_touches_its_disk() {
    let mut site = Site::new();
    let src = site.path("f");
    fs::write(&src, b"data").unwrap();
    let run = cp_with_secret(
        "not-the-secret-of-this-server",
        [src.as_os_str(), &site.server.url("new-dir/f")],
    );
    run.assert_code(3).assert_stderr_mentions("secret");
    assert!(snapshot(site.root()).is_empty());
    assert!(site.server.is_running());
    // And the server still serves the right secret.
    cp([src.as_os_str(), &site.server.url("f")]).assert_ok();
}

#[test]
fn escaping_paths_are_refused_by_the_client() {
    let site = Site::new();
    let src = site.path("f");
    fs::write(&src, b"data").unwrap();
    for bad in ["../escape", "a/../../escape", "/etc/escape"] {
        cp([src.as_os_str(), &site.server.url(bad)])
            .assert_code(2)
            .assert_stderr_mentions("escape");
        cp([&site.server.url(bad), site.path("out").as_os_str()]).assert_code(2);
    }
    assert!(snapshot(site.root()).is_empty());
    assert!(!site.path("out").exists());
    assert!(!site.path("escape").exists());
}

/// A directory beside the server root that nothing may ever touch.
fn outside(site: &Site) -> PathBuf {
    let out = site.path("outside");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("precious"), b"do not touch").unwrap();
    out
}

#[test]
fn symlinks_planted_in_the_server_root_are_never_followed() {
    let mut site = Site::new();
    let out = outside(&site);
    let before = snapshot(&out);
    symlink(&out, site.root().join("escape-dir")).unwrap();
    symlink(out.join("precious"), site.root().join("escape-file")).unwrap();
    fs::create_dir(site.root().join("tree")).unwrap();
    symlink(&out, site.root().join("tree/sub")).unwrap();

    let file = site.path("precious");
    fs::write(&file, b"attacker data").unwrap();
    let tree = site.path("tree");
    fs::create_dir_all(tree.join("sub")).unwrap();
    fs::write(tree.join("sub/precious"), b"attacker data").unwrap();

    // Through a symlinked directory: refused, naming the path.
    cp([file.as_os_str(), &site.server.url("escape-dir/precious")])
        .assert_code(8)
        .assert_stderr_mentions("escape-dir");
    // Into a tree whose subdirectory is a planted symlink: never written through it.
    let run = cp([tree.as_os_str(), &site.server.url("")]);
    assert_ne!(run.code, 0, "{run:#?}");
    assert!(
        run.stderr.contains("sub"),
        "the error names the entry: {run:#?}"
    );
    // Reading through a symlink is refused too.
    cp([
        &site.server.url("escape-dir/precious"),
        site.path("stolen").as_os_str(),
    ])
    .assert_code(8);
    assert!(!site.path("stolen").exists());
    // Onto a symlink as the final name: the link itself may be replaced, its target not.
    let run = cp([file.as_os_str(), &site.server.url("escape-file")]);
    if run.code == 0 {
        assert!(fs::symlink_metadata(site.root().join("escape-file"))
            .unwrap()
            .is_file());
    }
    assert_eq!(snapshot(&out), before, "nothing outside the root changed");
    assert!(site.server.is_running());
}

#[test]
fn symlinks_planted_in_a_pull_destination_are_never_followed() {
    let site = Site::new();
    let out = outside(&site);
    let before = snapshot(&out);
    fs::create_dir_all(site.root().join("tree/sub")).unwrap();
    fs::write(site.root().join("tree/sub/precious"), b"server data").unwrap();

    let dest = site.path("dest");
    fs::create_dir(&dest).unwrap();
    symlink(&out, dest.join("tree")).unwrap();
    let run = cp([&site.server.url("tree"), dest.as_os_str()]);
    assert_ne!(run.code, 0, "{run:#?}");
    assert_eq!(
        snapshot(&out),
        before,
        "nothing outside the destination changed"
    );

    let dest2 = site.path("dest2");
    fs::create_dir_all(dest2.join("tree")).unwrap();
    symlink(&out, dest2.join("tree/sub")).unwrap();
    let run = cp([&site.server.url("tree"), dest2.as_os_str()]);
    assert_ne!(run.code, 0, "{run:#?}");
    assert_eq!(
        snapshot(&out),
        before,
        "nothing outside the destination changed"
    );
}

#[test]
fn a_symlink_in_the_server_root_is_pulled_as_a_symlink() {
    let site = Site::new();
    symlink("/etc", site.root().join("etc-link")).unwrap();
    let dest = site.path("got");
    cp([&site.server.url("etc-link"), dest.as_os_str()]).assert_ok();
    assert_eq!(fs::read_link(&dest).unwrap(), Path::new("/etc"));
}

#[test]
fn missing_sources_are_reported() {
    let site = Site::new();
    cp([&site.server.url("nope"), site.path("x").as_os_str()])
        .assert_code(8)
        .assert_stderr_mentions("nope");
    cp([site.path("nope").as_os_str(), &site.server.url("x")])
        .assert_code(7)
        .assert_stderr_mentions("nope");
    assert!(snapshot(site.root()).is_empty());
}

#[test]
fn a_missing_secret_file_is_created_private_and_named() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    let secret = dir.path().join("new.secret");
    let mut child = Command::new(wanxfer_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--root"])
        .arg(&root)
        .arg("--secret-file")
        .arg(&secret)
        .env_remove("WANXFER_SECRET")
        .env("WANXFER_STATE_DIR", state_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let addr = line.trim().rsplit(" on ").next().unwrap().to_string();
    let meta = fs::metadata(&secret).expect("the secret file was created");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert!(meta.len() >= 32, "a real secret, not an empty file");

    let src = dir.path().join("f");
    fs::write(&src, b"authenticated by file").unwrap();
    let run = Command::new(wanxfer_bin())
        .args(["cp", "--quiet", "--secret-file"])
        .arg(&secret)
        .arg(&src)
        .arg(format!("wanxfer://{addr}/f"))
        .env_remove("WANXFER_SECRET")
        .env("WANXFER_STATE_DIR", state_dir())
        .output()
        .unwrap();
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(run.status.success(), "{run:?}");
    assert_eq!(fs::read(root.join("f")).unwrap(), b"authenticated by file");
    assert!(
        stderr.contains(secret.to_str().unwrap()),
        "the server names the file it created: {stderr}"
    );
}

#[test]
fn help_documents_the_exit_codes() {
    for args in [&["--help"][..], &["cp", "--help"], &["serve", "--help"]] {
        let out = std::process::Command::new(wanxfer_bin())
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for needle in [
            "Exit codes",
            "3  authentication",
            "6  integrity",
            "7  local I/O",
        ] {
            assert!(text.contains(needle), "{args:?} --help lacks {needle:?}");
        }
    }
}

#[test]
fn usage_errors_exit_2() {
    cp(["only-one-path"]).assert_code(2);
    cp([
        "--bytes",
        "1GiB",
        "/etc/hostname",
        "wanxfer://127.0.0.1:1/dev/null",
    ])
    .assert_code(2);
    cp(["--block-size", "1K", "a", "wanxfer://127.0.0.1:1/x"]).assert_code(2);
    cp(["a", "b"])
        .assert_code(2)
        .assert_stderr_mentions("wanxfer://");
}

#[test]
fn an_unreachable_server_is_a_network_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let src = tempfile::NamedTempFile::new().unwrap();
    cp([
        src.path().as_os_str(),
        OsStr::new(&format!("wanxfer://{addr}/x")),
    ])
    .assert_code(4);
}

/// `wanxfer bench` starts its own server, sweeps send mode × depth memory to memory, and
/// writes one JSON point per measurement and an SVG plot with a line per mode.
#[test]
fn bench_sweeps_send_modes_and_writes_json_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    let (json, svg) = (dir.path().join("b.json"), dir.path().join("b.svg"));
    let out = std::process::Command::new(wanxfer_bin())
        .args(["bench", "--bytes", "32MiB", "--block-sizes", "256KiB"])
        .args(["--depths", "1,4", "--streams", "1", "--io", "copy,zerocopy"])
        // Zero-copy sends bypass user space: measured without encryption.
        .arg("--no-encryption")
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let points: Vec<serde_json::Value> = serde_json::from_slice(&fs::read(&json).unwrap()).unwrap();
    let grid: Vec<(&str, u64)> = points
        .iter()
        .map(|p| (p["io"].as_str().unwrap(), p["depth"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        grid,
        [("copy", 1), ("copy", 4), ("zerocopy", 1), ("zerocopy", 4)]
    );
    for p in &points {
        assert!(p["gbit_per_s"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["receiver_cpu_s_per_gb"].is_f64(), "{p}");
    }
    let plot = fs::read_to_string(&svg).unwrap();
    assert!(
        plot.contains("<svg") && plot.contains("zerocopy"),
        "the plot has a line per mode"
    );
}
