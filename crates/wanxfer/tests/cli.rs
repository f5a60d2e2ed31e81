//! What a person meets at the command line: errors for mistyped URLs and addresses, with
//! the README's exit codes, and the server's configuration file and log format.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

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
    let log = site.server.log();
    assert!(!log.is_empty(), "the server logs the session at info");
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
