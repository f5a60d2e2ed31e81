//! Clean ends: Ctrl-C on the client, SIGTERM on the server, partial files of abandoned
//! transfers, and directories of a transfer that failed. Each interruption keeps what
//! arrived, says how to go on, and the next run resumes; what nobody comes back for is
//! removed after `--keep-partial`.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

/// Large and sparse: quick to make, slow enough to send that an interruption lands
/// mid-file.
const LARGE: u64 = 3 << 30;

fn large_source(at: &Path) -> PathBuf {
    fs::create_dir_all(at.parent().unwrap()).unwrap();
    fs::File::create(at).unwrap().set_len(LARGE).unwrap();
    at.to_path_buf()
}

fn wait_for_temp(dir: &Path) {
    wait_for("a temporary file", Duration::from_secs(60), || {
        !temp_files(dir).is_empty()
    });
}

/// Waits for `child` to exit (at most `limit`), then returns its output.
fn exit_within(child: std::process::Child, limit: Duration) -> Run {
    let pid = child.id() as i32;
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}/stat")).exists()
        && !fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
    {
        assert!(start.elapsed() < limit, "still running after {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    finish(child)
}

#[test]
fn ctrl_c_keeps_what_arrived_and_prints_the_command_that_resumes() {
    let site = Site::new();
    let src = large_source(&site.path("large.bin"));
    let client = cp_command([src.as_os_str(), &site.server.url("large.bin")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_temp(site.root());
    std::thread::sleep(Duration::from_millis(300));
    signal(client.id() as i32, "INT");
    let run = exit_within(client, Duration::from_secs(30));
    run.assert_code(130)
        .assert_stderr_mentions("Run the same command again to resume");
    let command = run
        .stderr
        .lines()
        .skip_while(|l| !l.contains("to resume"))
        .nth(1)
        .expect("the command follows")
        .trim()
        .to_string();
    assert!(
        command.contains(" cp ") && command.contains("large.bin"),
        "{command}"
    );
    // The command as printed (a shell line), run again, resumes.
    let again = std::process::Command::new("sh")
        .args(["-c", &format!("{command} --json")])
        .env("WANXFER_SECRET", SECRET)
        .env("WANXFER_STATE_DIR", state_dir())
        .output()
        .unwrap();
    assert!(again.status.success(), "{again:?}");
    let json: serde_json::Value = serde_json::from_slice(
        again
            .stdout
            .trim_ascii_end()
            .rsplit(|&b| b == b'\n')
            .next()
            .unwrap(),
    )
    .unwrap();
    assert!(json["bytes_skipped"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(
        json["bytes"].as_u64().unwrap() + json["bytes_skipped"].as_u64().unwrap(),
        LARGE,
        "{json}"
    );
    assert!(temp_files(site.root()).is_empty());
}

#[test]
fn sigterm_drains_the_server_and_the_retrying_client_resumes_after_a_restart() {
    let mut site = Site::new();
    let src = large_source(&site.path("large.bin"));
    let client = cp_command([
        "--json".as_ref(),
        src.as_os_str(),
        &site.server.url("large.bin"),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_temp(site.root());
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    signal(site.server.pid(), "TERM");
    wait_for(
        "the server to drain and exit",
        Duration::from_secs(30),
        || !site.server.is_running(),
    );
    eprintln!("drained in {:?}", start.elapsed());
    let log = site.server.log();
    assert!(log.contains("stopping: no new connections"), "{log}");
    assert!(log.contains("stopped: every session ended"), "{log}");
    assert_eq!(temp_files(site.root()).len(), 1, "the partial file is kept");
    site.server.restart();
    let run = exit_within(client, Duration::from_secs(300));
    let json = run.assert_ok().json();
    assert!(json["attempts"].as_u64().unwrap() >= 2, "{json}");
    assert!(
        json["bytes_skipped"].as_u64().unwrap() > 0,
        "resumed: {json}"
    );
    assert_eq!(
        fs::metadata(site.root().join("large.bin")).unwrap().len(),
        LARGE
    );
    assert!(temp_files(site.root()).is_empty());
}

#[test]
fn partial_files_nobody_comes_back_for_are_removed_after_keep_partial() {
    // Long enough that a loaded machine's session end and first restart (seconds,
    // beside the 3 GiB tests) still come within it: the journal's age counts from its
    // last write.
    let mut site = Site::with_serve_flags(&["--keep-partial", "15s"]);
    let src = large_source(&site.path("large.bin"));
    let mut client = cp_command([src.as_os_str(), &site.server.url("large.bin")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_temp(site.root());
    client.kill().unwrap();
    client.wait().unwrap();
    wait_for(
        "the server to end the session",
        Duration::from_secs(60),
        || site.server.log().contains("partial files kept"),
    );
    assert_eq!(temp_files(site.root()).len(), 1);
    // Within --keep-partial a restart keeps it; past it, the restart removes it.
    site.server.restart();
    assert_eq!(temp_files(site.root()).len(), 1, "kept while it may resume");
    std::thread::sleep(Duration::from_secs(16));
    site.server.restart();
    wait_for("the log to say what went", Duration::from_secs(30), || {
        site.server.log().contains("removed an abandoned transfer")
    });
    assert!(
        temp_files(site.root()).is_empty(),
        "the partial file is gone"
    );
}

#[test]
fn directories_get_their_modes_and_times_when_a_transfer_fails() {
    let site = Site::new();
    let tree = site.path("tree");
    fs::create_dir_all(tree.join("locked/inner")).unwrap();
    large_source(&tree.join("locked/inner/large.bin"));
    fs::write(tree.join("locked/note"), b"small").unwrap();
    set_mode(&tree.join("locked/inner"), 0o711);
    set_mode(&tree.join("locked"), 0o750);
    set_mtime(&tree.join("locked/inner"), 1_400_000_000, 0);
    let mut client = cp_command([tree.as_os_str(), &site.server.url("")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_temp(site.root());
    client.kill().unwrap();
    client.wait().unwrap();
    wait_for(
        "the server to end the session",
        Duration::from_secs(60),
        || site.server.log().contains("partial files kept"),
    );
    let copy = site.root().join("tree");
    for (dir, mode) in [("locked", 0o750), ("locked/inner", 0o711)] {
        let Node::Dir { mode: got, mtime } = node(&copy.join(dir)) else {
            panic!("{dir} is a directory");
        };
        assert_eq!(got, mode, "{dir} has its final mode");
        if dir == "locked/inner" {
            assert_eq!(mtime, (1_400_000_000, 0), "{dir} has its mtime");
        }
    }
}
