//! What a person meets at the command line: output on success, errors for mistyped URLs
//! and addresses with the README's exit codes, the server's configuration file and log
//! format, and the progress bar on a real terminal (a pty through `script`).

mod common;

use std::ffi::OsStr;
use std::fs;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// `wanxfer ARGS` with the test secret and no RUST_LOG, to completion.
fn wanxfer<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = Command::new(wanxfer_bin())
        .args(args)
        .env("WANXFER_SECRET", SECRET)
        .env_remove("RUST_LOG")
        .output()
        .expect("run wanxfer");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn has_escape_codes(text: &str) -> bool {
    text.contains('\u{1b}')
}

#[test]
fn cp_quiet_prints_nothing_on_success() {
    let site = Site::new();
    let src = site.path("one");
    write_pattern(&src, 100_000, 1);
    // --no-file-digest prints a warning: without -q it is shown.
    let secret = site.path("secret");
    fs::write(&secret, SECRET).unwrap();
    set_mode(&secret, 0o600);
    let args = |dest: &str| {
        vec![
            OsStr::new("--no-file-digest").to_owned(),
            OsStr::new("--secret-file").to_owned(),
            secret.clone().into_os_string(),
            src.clone().into_os_string(),
            site.server.url(dest),
        ]
    };
    let loud = cp_with_notes(args("loud"));
    loud.assert_ok().assert_stderr_mentions("--no-file-digest");
    assert!(!loud.stdout.is_empty(), "{loud:#?}");

    let run = cp(args("one")); // `cp()` passes --quiet
    run.assert_ok();
    assert_eq!(
        (run.stdout.as_str(), run.stderr.as_str()),
        ("", ""),
        "{run:#?}"
    );
    assert_eq!(
        fs::read(site.root().join("one")).unwrap(),
        fs::read(&src).unwrap()
    );
}

#[test]
fn the_summary_counts_files_grammatically_in_binary_units_and_bit_rates() {
    let site = Site::new();
    let one = site.path("one");
    write_pattern(&one, 3 << 20, 1);
    let run = cp_with_notes([one.as_os_str(), &site.server.url("a")]);
    run.assert_ok();
    assert!(run.stdout.starts_with("3.00 MiB in 1 file in "), "{run:#?}");
    assert!(run.stdout.contains("bit/s\nverified;"), "{run:#?}");

    let two = site.path("two");
    fs::create_dir(&two).unwrap();
    fs::write(two.join("x"), b"x").unwrap();
    fs::write(two.join("y"), b"y").unwrap();
    let run = cp_with_notes([two.as_os_str(), &site.server.url("b")]);
    run.assert_ok();
    assert!(run.stdout.starts_with("2 B in 2 files in "), "{run:#?}");
    assert!(run.stdout.contains("files/s\nverified;"), "{run:#?}");
    assert!(
        !has_escape_codes(&run.stdout) && run.stderr.is_empty(),
        "{run:#?}"
    );
}

/// A URL without a port reaches 7800: through a real server when the port is free here,
/// else through the error, which names the address it tried.
#[test]
fn a_url_without_a_port_reaches_port_7800() {
    let src = tempfile::NamedTempFile::new().unwrap();
    fs::write(src.path(), b"to the default port").unwrap();
    let free = std::net::TcpListener::bind("127.0.0.1:7800").is_ok();
    if free {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let mut serve = Command::new(wanxfer_bin());
        serve.args(["serve", "--listen", "127.0.0.1:7800"]);
        let server = Server::start_with(serve, &root, &[]);
        assert_eq!(server.addr, "127.0.0.1:7800");
        cp([src.path().as_os_str(), OsStr::new("wanxfer://127.0.0.1/f")]).assert_ok();
        assert_eq!(fs::read(root.join("f")).unwrap(), b"to the default port");
    } else {
        let run = cp([src.path().as_os_str(), OsStr::new("wanxfer://127.0.0.1/f")]);
        assert_ne!(run.code, 2, "{run:#?}");
        run.assert_stderr_mentions("127.0.0.1:7800");
    }
}

#[test]
fn mistyped_urls_are_usage_errors_not_local_paths() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f");
    fs::write(&src, b"x").unwrap();
    for typo in [
        "wanxfr://127.0.0.1:1/x",
        "wanxfer:/x",
        "wanxfer//127.0.0.1:1/x",
        "http://127.0.0.1:1/x",
    ] {
        let run = wanxfer([
            OsStr::new("cp"),
            OsStr::new("-q"),
            src.as_os_str(),
            OsStr::new(typo),
        ]);
        run.assert_code(2)
            .assert_stderr_mentions(typo)
            .assert_stderr_mentions("wanxfer://HOST[:PORT]/PATH");
        // Pulling "from" the typo into a local directory is refused the same way.
        let run = wanxfer([OsStr::new("cp"), OsStr::new(typo), dir.path().as_os_str()]);
        run.assert_code(2).assert_stderr_mentions(typo);
    }
    let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "nothing was created beside the source");
    // What is not a near miss of wanxfer:// stays a local path.
    let run = wanxfer([
        OsStr::new("cp"),
        OsStr::new("-q"),
        OsStr::new("data:/x"),
        OsStr::new("wanxfer://127.0.0.1:1/x"),
    ]);
    assert_ne!(run.code, 2, "{run:#?}");
}

#[test]
fn serve_listen_without_a_host_exits_2_with_the_address_to_write() {
    let dir = tempfile::tempdir().unwrap();
    for listen in ["7803", ":7803"] {
        let run = wanxfer([
            OsStr::new("serve"),
            OsStr::new("--root"),
            dir.path().as_os_str(),
            OsStr::new("--listen"),
            OsStr::new(listen),
        ]);
        run.assert_code(2).assert_stderr_mentions("0.0.0.0:7803");
    }
    let run = wanxfer(["serve", "--listen", "127.0.0.1:0"]);
    run.assert_code(2).assert_stderr_mentions("--root");
}

/// The regression of issue 16 item 10: a secret file others can read, or a secret too
/// short to resist guessing, is refused (not merely warned about), naming the remedy.
#[test]
fn a_weak_secret_is_refused() {
    let site = Site::new();
    let src = site.path("f");
    write_pattern(&src, 1000, 1);
    let secret = site.path("secret");
    fs::write(&secret, SECRET).unwrap();
    set_mode(&secret, 0o644);
    let args = [
        OsStr::new("--secret-file"),
        secret.as_os_str(),
        src.as_os_str(),
        &site.server.url("f"),
    ];
    cp(args).assert_code(2).assert_stderr_mentions("chmod 600");
    cp_with_secret("1", [src.as_os_str(), &site.server.url("f")])
        .assert_code(2)
        .assert_stderr_mentions("fewer than 16");
    assert!(!site.root().join("f").exists());
}

#[test]
fn a_missing_secret_file_is_a_usage_error() {
    let run = wanxfer([
        "cp",
        "--secret-file",
        "/nonexistent/wanxfer.secret",
        "/etc/hostname",
        "wanxfer://127.0.0.1:1/x",
    ]);
    run.assert_code(2)
        .assert_stderr_mentions("/nonexistent/wanxfer.secret");
    let run = wanxfer([
        "bench",
        "--server",
        "127.0.0.1:1",
        "--secret-file",
        "/nonexistent/wanxfer.secret",
    ]);
    run.assert_code(2);
}

#[test]
fn bench_takes_a_wanxfer_url_for_its_server() {
    let site = Site::new();
    let run = wanxfer([
        "bench",
        "--server",
        &format!("wanxfer://{}/", site.server.addr),
        "--bytes",
        "8MiB",
        "--block-sizes",
        "256KiB",
        "--depths",
        "1",
        "--streams",
        "1",
    ]);
    run.assert_ok();
    assert_eq!(
        run.stdout.lines().count(),
        2,
        "a header and one point: {run:#?}"
    );
    wanxfer(["bench", "--server", "wanxfer://127.0.0.1:1/data"])
        .assert_code(2)
        .assert_stderr_mentions("not a path");
}

#[test]
fn check_config_accepts_a_good_file_and_names_every_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    fs::write(
        &good,
        "root = \"/srv\"\nmax-sessions = 4\nmax_session_memory = \"1GiB\"\nio = \"copy\"\n",
    )
    .unwrap();
    let run = wanxfer([
        OsStr::new("serve"),
        OsStr::new("--check-config"),
        good.as_os_str(),
    ]);
    run.assert_ok();
    assert!(run.stdout.contains("valid (4 settings)"), "{run:#?}");

    let bad = dir.path().join("bad.toml");
    fs::write(
        &bad,
        "root = \"/srv\"\nmax_sessions = \"lots\"\nmax-streems = 4\nio = 3\n",
    )
    .unwrap();
    let run = wanxfer([
        OsStr::new("serve"),
        OsStr::new("--check-config"),
        bad.as_os_str(),
    ]);
    run.assert_code(2)
        .assert_stderr_mentions("key `max_sessions`: \"lots\"")
        .assert_stderr_mentions("unknown key `max-streems`: did you mean `max-streams`?")
        .assert_stderr_mentions("key `io`: expected a string");
    assert_eq!(
        run.stderr.lines().count(),
        3,
        "one line per bad key: {run:#?}"
    );

    // `serve --config` refuses to start on the same file, with the same words.
    let run = wanxfer([OsStr::new("serve"), OsStr::new("--config"), bad.as_os_str()]);
    run.assert_code(2).assert_stderr_mentions("max-streems");
}

/// A server from a configuration file: the file's settings apply, and a flag given on
/// the command line wins (the file's address is one no interface here has, so the
/// server would not start had the file won).
#[test]
fn a_server_runs_from_its_configuration_file_with_flags_winning() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("served");
    fs::create_dir(&root).unwrap();
    let config = dir.path().join("wanxfer.toml");
    fs::write(
        &config,
        format!(
            "root = {:?}\nlisten = \"192.0.2.1:7800\"\nmax_sessions = 1\nlog-format = \"json\"\n",
            root.to_str().unwrap()
        ),
    )
    .unwrap();
    let mut child = Command::new(wanxfer_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .env("WANXFER_SECRET", SECRET)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(" on ").next().unwrap().to_string();
    assert!(
        line.starts_with(&format!("wanxfer serving {} on 127.0.0.1:", root.display())),
        "{line:?}"
    );
    let src = dir.path().join("f");
    write_pattern(&src, 1 << 20, 3);
    cp([src.as_os_str(), OsStr::new(&format!("wanxfer://{addr}/f"))]).assert_ok();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert_eq!(fs::read(root.join("f")).unwrap(), fs::read(&src).unwrap());
    // log-format came from the file: every log line is a JSON object.
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!log.trim().is_empty(), "the session was logged");
    for l in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{l}");
    }
}

/// The server's start line is printed once, on stdout, and not logged again; its log,
/// written to a file, has no colour codes; and `--log-format json` logs JSON.
#[test]
fn the_server_says_where_it_serves_once_and_logs_without_colour() {
    let site = Site::new();
    let src = site.path("f");
    write_pattern(&src, 1 << 20, 2);
    cp([src.as_os_str(), &site.server.url("f")]).assert_ok();
    // The server logs a session once it has wound it down, just after the client is done.
    wait_for(
        "the server to log the session",
        Duration::from_secs(10),
        || site.server.log().contains("session with"),
    );
    let log = site.server.log();
    assert!(!has_escape_codes(&log), "{log:?}");
    assert!(
        !log.contains("serving"),
        "the start line is not logged: {log}"
    );
    assert!(!log.trim_start().starts_with('{'), "text by default: {log}");

    let json = Site::with_serve_flags(&["--log-format", "json"]);
    cp([src.as_os_str(), &json.server.url("f")]).assert_ok();
    let log = json.server.log();
    for l in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
        assert!(v["timestamp"].is_string(), "{l}");
    }
}

/// Strips CSI escape sequences (cursor moves, line erases, colours).
fn strip_escapes(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        if chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) {
                    break;
                }
            }
        } else {
            chars.next();
        }
    }
    out
}

/// A few hundred MiB pushed under a real terminal of 80 columns: the bar is drawn, and
/// every line on the screen, bar or summary, fits; both show sizes in binary units and
/// rates in bit/s. The same run with stderr redirected to a file writes no escape codes.
#[test]
fn the_progress_bar_fits_80_columns_and_stays_off_redirected_output() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` (util-linux) to give wanxfer a terminal");
        return;
    }
    let site = Site::new();
    let src = site.path("big");
    write_pattern(&src, 384 << 20, 9);
    let typescript = site.path("typescript");
    // Small blocks on one stream keep the transfer on screen for a few redraws.
    let inner = format!(
        "stty cols 80 rows 24; exec '{}' cp --streams 1 --block-size 64KiB --depth 1 '{}' '{}'",
        wanxfer_bin().display(),
        src.display(),
        site.server.url("big").to_str().unwrap()
    );
    let out = Command::new("script")
        .args(["-qec", &inner])
        .arg(&typescript)
        .env("WANXFER_SECRET", SECRET)
        .env_remove("RUST_LOG")
        .env("TERM", "xterm")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(fs::read(site.root().join("big")).unwrap().len(), 384 << 20);

    let lines: Vec<String> = screen
        .split(['\r', '\n'])
        .map(strip_escapes)
        .filter(|l| !l.trim().is_empty())
        .collect();
    for l in &lines {
        assert!(
            l.chars().count() <= 80,
            "{} columns: {l:?}",
            l.chars().count()
        );
    }
    let bars: Vec<&String> = lines.iter().filter(|l| l.starts_with("[")).collect();
    assert!(!bars.is_empty(), "no bar drawn: {screen:?}");
    assert!(
        bars.iter()
            .all(|b| b.contains("% ") && b.contains("B / ") && b.contains("bit/s  ")),
        "{bars:#?}"
    );
    // One file: its size, the rate and the streams carrying it (issue 19).
    assert!(
        bars.iter().any(|b| b.contains("MiB / 384.00 MiB  ")
            && b.contains(" stream")
            && b.contains("  ETA ")
            && !b.contains("-- bit/s")),
        "a bar with the file's size, a rate and the streams: {bars:#?}"
    );
    let summary = lines
        .iter()
        .find(|l| l.starts_with("384.00 MiB in 1 file in "))
        .unwrap_or_else(|| panic!("no summary: {lines:#?}"));
    assert!(summary.contains("bit/s"), "{summary}");
    assert!(
        lines.iter().any(|l| l.starts_with("verified; CPU")),
        "{lines:#?}"
    );
    for other_unit in ["MB", "GB", "MiB/s", "GiB/s", "1 files"] {
        assert!(
            !lines.iter().any(|l| l.contains(other_unit)),
            "{other_unit} shown: {lines:#?}"
        );
    }

    let stderr_file = site.path("stderr");
    let status = Command::new(wanxfer_bin())
        .args(["cp", "--no-file-digest"])
        .arg(&src)
        .arg(site.server.url("again"))
        .env("WANXFER_SECRET", SECRET)
        .env("TERM", "xterm")
        .stdout(Stdio::null())
        .stderr(fs::File::create(&stderr_file).unwrap())
        .status()
        .unwrap();
    assert!(status.success());
    let redirected = fs::read_to_string(&stderr_file).unwrap();
    assert!(
        redirected.contains("WARNING"),
        "the warning still goes there: {redirected:?}"
    );
    assert!(!has_escape_codes(&redirected), "{redirected:?}");
}

/// A listener on loopback that treats every connection as `answer` says, on its own
/// thread, holding each connection open until the test ends.
fn impostor(answer: fn(&mut std::net::TcpStream)) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut conn in listener.incoming().flatten() {
            answer(&mut conn);
            held.push(conn);
        }
    });
    addr
}

/// Issue 21 item 6: `--connect-timeout` bounds the whole handshake, TLS included. A port
/// that accepts and never speaks took 31 s with `--connect-timeout 3`; the bound here is
/// loose (a loaded machine), far below that.
#[test]
fn connect_timeout_bounds_the_handshake_with_a_silent_port() {
    let addr = impostor(|_| {});
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f");
    fs::write(&src, b"x").unwrap();
    let url = format!("wanxfer://{addr}/f");
    for extra in [&[][..], &["--no-encryption"][..]] {
        let started = std::time::Instant::now();
        let mut cmd = cp_command(["--retries=0", "--connect-timeout=2"]);
        cmd.args(extra).arg(&src).arg(&url);
        let run = Run::from_cmd(cmd);
        let took = started.elapsed();
        run.assert_code(4);
        assert!(
            took < Duration::from_secs(15),
            "{extra:?}: gave up after {took:?}"
        );
        assert!(
            run.stderr.contains("in time") || run.stderr.contains("said nothing"),
            "{run:#?}"
        );
        // A remote operation as well.
        let started = std::time::Instant::now();
        let ls = Command::new(wanxfer_bin())
            .args(["ls", "--connect-timeout=2"])
            .args(extra)
            .arg(&url)
            .env("WANXFER_SECRET", SECRET)
            .env("WANXFER_STATE_DIR", state_dir())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        assert_eq!(ls.status.code(), Some(4), "{ls:?}");
        assert!(started.elapsed() < Duration::from_secs(15));
    }
}

/// Issue 21 item 6: something that is not a wanxfer server (a web server, an SSH
/// server) is named as such, not as "reserved frame header bytes are not zero".
#[test]
fn a_port_that_is_not_a_wanxfer_server_is_named_as_such() {
    use std::io::{Read, Write};
    let web = impostor(|conn| {
        let mut request = [0u8; 1024];
        let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = conn.read(&mut request);
        let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    });
    let ssh = impostor(|conn| {
        let _ = conn.write_all(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n");
    });
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f");
    fs::write(&src, b"x").unwrap();
    for addr in [web, ssh] {
        for extra in [&[][..], &["--no-encryption"][..]] {
            let mut cmd = cp_command(["--retries=0", "--connect-timeout=5"]);
            cmd.args(extra).arg(&src).arg(format!("wanxfer://{addr}/f"));
            let run = Run::from_cmd(cmd);
            run.assert_code(5)
                .assert_stderr_mentions("not a wanxfer server");
            assert!(!run.stderr.contains("reserved"), "{run:#?}");
        }
    }
}
