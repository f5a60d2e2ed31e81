//! Failures end to end: a peer that vanishes mid-transfer, a disk that fills up, and a
//! file the server may not create. What must hold each time: a clear error with the right
//! exit code, the old file (if any) untouched under its final name, no partial file under
//! a final name, a server that goes on serving, and (where the failure interrupted a
//! transfer) a run of the same command that resumes and leaves nothing behind.
//!
//! "Mid-transfer" is made exact without timing: the test waits for the receiver's
//! temporary file to appear, freezes the side that must not finish (SIGSTOP), kills the
//! other, and only then lets the frozen one run on.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const LARGE: u64 = 3 << 30;
const OLD: &[u8] = b"the previous version, which must survive a failed copy";

trait LargeSource {
    fn large_source(&self) -> PathBuf;
}

impl LargeSource for Site {
    /// A large sparse file: cheap to create, and slow enough to send that the test can
    /// catch the transfer in the middle.
    fn large_source(&self) -> PathBuf {
        let src = self.path("large.bin");
        fs::File::create(&src).unwrap().set_len(LARGE).unwrap();
        src
    }
}

/// The previous version is still there. The size is checked first: on a machine so loaded
/// that the 3 GiB copy finished before the test could interrupt it, this fails with a
/// message instead of reading gigabytes into memory (the OOM killer once ended the test).
fn assert_still_old(path: &Path) {
    let len = fs::metadata(path).unwrap().len();
    assert_eq!(len, OLD.len() as u64, "{} was replaced", path.display());
    assert!(fs::read(path).unwrap() == OLD, "{} changed", path.display());
}

fn any_temp_file(dir: &Path) -> bool {
    !temp_files(dir).is_empty()
}

/// A resumed run of the large file into `dir`: what was held plus what was sent is the
/// file (nothing twice, nothing missed), it is whole under its name, and nothing is left.
fn assert_resumed_whole(json: &serde_json::Value, dir: &Path) {
    let sent = json["bytes"].as_u64().unwrap();
    assert_eq!(
        sent + json["bytes_skipped"].as_u64().unwrap(),
        LARGE,
        "{json}"
    );
    assert_eq!(fs::metadata(dir.join("large.bin")).unwrap().len(), LARGE);
    assert!(temp_files(dir).is_empty());
}

#[test]
fn server_vanishing_mid_push_is_a_network_error_and_leaves_no_final_name() {
    let mut site = Site::new();
    let src = site.large_source();
    let dest = site.server.root.join("large.bin");
    fs::write(&dest, OLD).unwrap();
    let root = site.server.root.clone();

    let client = spawn_piped(cp_command([
        "--retries=0".as_ref(),
        src.as_os_str(),
        &site.server.url("large.bin"),
    ]));
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || any_temp_file(&root),
    );
    signal(client.id() as i32, "STOP");
    site.server.kill();
    signal(client.id() as i32, "CONT");
    let run = finish(client);

    run.assert_code(4);
    assert!(
        run.stderr.contains("connection") || run.stderr.contains("peer"),
        "the error says the peer went away: {run:#?}"
    );
    assert_still_old(&dest);
}

#[test]
fn server_vanishing_mid_pull_is_a_network_error_and_the_rerun_resumes() {
    let mut site = Site::new();
    fs::File::create(site.server.root.join("large.bin"))
        .unwrap()
        .set_len(LARGE)
        .unwrap();
    let dest_dir = site.path("dest");
    fs::create_dir(&dest_dir).unwrap();
    fs::write(dest_dir.join("large.bin"), OLD).unwrap();

    let args = [&site.server.url("large.bin"), dest_dir.as_os_str()];
    let client = spawn_piped(cp_command(
        [&["--retries=0".as_ref()][..], &args[..]].concat(),
    ));
    wait_for(
        "the client's temporary file",
        Duration::from_secs(60),
        || any_temp_file(&dest_dir),
    );
    signal(client.id() as i32, "STOP");
    site.server.kill();
    signal(client.id() as i32, "CONT");
    let run = finish(client);

    run.assert_code(4);
    assert_eq!(fs::read(dest_dir.join("large.bin")).unwrap(), OLD);
    // The partial file is kept for the next run, which resumes it once the server is
    // back, replaces the old version, and leaves nothing behind.
    assert_eq!(temp_files(&dest_dir).len(), 1, "the partial file is kept");
    site.server.restart();
    let json = cp([&["--json".as_ref()][..], &args[..]].concat())
        .assert_ok()
        .json();
    assert_resumed_whole(&json, &dest_dir);
}

#[test]
fn client_vanishing_mid_push_leaves_the_server_serving_and_the_rerun_resumes() {
    let mut site = Site::new();
    let src = site.large_source();
    let root = site.server.root.clone();
    fs::write(root.join("large.bin"), OLD).unwrap();

    let mut client = cp_command([src.as_os_str(), &site.server.url("large.bin")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || any_temp_file(&root),
    );
    let server_pid = site.server.pid();
    signal(server_pid, "STOP");
    client.kill().unwrap();
    client.wait().unwrap();
    signal(server_pid, "CONT");

    wait_for(
        "the server to end the session",
        Duration::from_secs(60),
        || site.server.log().contains("partial files kept"),
    );
    assert_still_old(&root.join("large.bin"));
    assert!(site.server.is_running());
    let small = site.path("small");
    fs::write(&small, b"still serving").unwrap();
    cp([small.as_os_str(), &site.server.url("small")]).assert_ok();
    assert_eq!(fs::read(root.join("small")).unwrap(), b"still serving");
    // The same command again resumes what the server kept, and leaves nothing behind.
    assert_eq!(temp_files(&root).len(), 1, "the partial file is kept");
    let json = cp([
        "--json".as_ref(),
        src.as_os_str(),
        &site.server.url("large.bin"),
    ])
    .assert_ok()
    .json();
    assert_resumed_whole(&json, &root);
}

/// A client frozen mid-push leaves a session the server cannot tell from a live one by
/// its connections (nothing closes them): the same command run again must not wait
/// for it to time out. The server sees that the old session moves nothing, ends it,
/// and the rerun resumes.
#[test]
fn a_rerun_takes_over_from_a_session_that_moves_nothing() {
    let site = Site::new();
    let src = site.large_source();
    let root = site.server.root.clone();
    let args = [src.as_os_str(), &site.server.url("large.bin")];
    let mut frozen = cp_command(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || any_temp_file(&root),
    );
    signal(frozen.id() as i32, "STOP");
    let rerun = finish_within(
        spawn_piped(cp_command([&["--json".as_ref()][..], &args[..]].concat())),
        Duration::from_secs(300),
    );
    frozen.kill().unwrap();
    frozen.wait().unwrap();
    let json = rerun.assert_ok().json();
    // What the frozen client had already sent may still be landing as the rerun arrives
    // (a loaded machine commits it for seconds), so one refusal can come first; a server
    // that never took over would refuse every retry and the rerun would fail.
    assert!(
        json["attempts"].as_u64().unwrap() <= 2,
        "taken over, not refused for good: {json}"
    );
    assert_resumed_whole(&json, &root);
}

/// Two copies of one command at once (two cron jobs, say) are one transfer to the
/// server. Before, each new session ended the running one, whose client retried and
/// ended the other in turn: both resumed each other's work until their retries ran out.
/// Now the second is turned away while the first moves data, as a busy server turns
/// clients away; the first is never ended, and the second, retrying, finds the file
/// in place once the first has finished.
#[test]
fn a_second_copy_of_a_running_command_waits_instead_of_ending_it() {
    let site = Site::new();
    let src = site.path("data.bin");
    // About 10 s at the paced rate: the second starts well inside it.
    write_pattern(&src, 96 << 20, 7);
    let root = site.server.root.clone();
    let args = [
        "--json".as_ref(),
        "--rate".as_ref(),
        "80M".as_ref(),
        src.as_os_str(),
        &site.server.url("data.bin"),
    ];
    let spawn = || spawn_piped(cp_command(args));
    let first = spawn();
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || any_temp_file(&root),
    );
    let second = spawn();
    let (first, second) = (
        finish_within(first, Duration::from_secs(300)),
        finish_within(second, Duration::from_secs(300)),
    );
    let (a, b) = (first.assert_ok().json(), second.assert_ok().json());
    assert_eq!(a["attempts"], 1, "the first was never ended: {a}");
    assert!(
        b["attempts"].as_u64().unwrap() >= 2,
        "the second was turned away while the first moved data: {b}"
    );
    assert!(fs::read(root.join("data.bin")).unwrap() == fs::read(&src).unwrap());
    assert!(temp_files(&root).is_empty());
}

#[test]
fn a_rerun_with_no_resume_starts_over_and_leaves_nothing() {
    let site = Site::new();
    let src = site.large_source();
    let root = site.server.root.clone();
    let mut client = cp_command([src.as_os_str(), &site.server.url("large.bin")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(
        "the server's temporary file",
        Duration::from_secs(60),
        || any_temp_file(&root),
    );
    let server_pid = site.server.pid();
    signal(server_pid, "STOP");
    client.kill().unwrap();
    client.wait().unwrap();
    signal(server_pid, "CONT");
    wait_for(
        "the server to end the session",
        Duration::from_secs(60),
        || site.server.log().contains("partial files kept"),
    );
    let json = cp([
        "--json".as_ref(),
        "--no-resume".as_ref(),
        src.as_os_str(),
        &site.server.url("large.bin"),
    ])
    .assert_ok()
    .json();
    assert_eq!(
        json["bytes"].as_u64().unwrap(),
        LARGE,
        "all sent again: {json}"
    );
    assert_eq!(json["bytes_skipped"].as_u64().unwrap(), 0, "{json}");
    assert_eq!(fs::metadata(root.join("large.bin")).unwrap().len(), LARGE);
    assert!(
        temp_files(&root).is_empty(),
        "the old partial file was replaced"
    );
}

#[test]
fn a_full_disk_on_the_server_is_reported_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let Some(disk) = Mount::new(dir.path().join("root"), "tmpfs", "size=8m") else {
        return;
    };
    fs::write(disk.path.join("keep.bin"), OLD).unwrap();
    let mut server = Server::start(&disk.path, &[]);
    let src = dir.path().join("src");
    fs::create_dir(&src).unwrap();
    write_pattern(&src.join("keep.bin"), 20 << 20, 1);
    fs::write(src.join("tiny"), b"fits").unwrap();

    let run = cp([src.as_os_str(), &server.url("")]);
    run.assert_code(8).assert_stderr_mentions("space");
    assert_eq!(fs::read(disk.path.join("keep.bin")).unwrap(), OLD);
    assert!(
        temp_files(&disk.path).is_empty(),
        "partial files are removed"
    );
    assert!(server.is_running());
}

#[test]
fn a_full_disk_on_a_pulling_client_is_a_local_error_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    write_pattern(&root.join("big.bin"), 20 << 20, 2);
    let server = Server::start(&root, &[]);
    let Some(disk) = Mount::new(dir.path().join("dest"), "tmpfs", "size=8m") else {
        return;
    };
    fs::write(disk.path.join("big.bin"), OLD).unwrap();

    let run = cp([&server.url("big.bin"), disk.path.as_os_str()]);
    run.assert_code(7).assert_stderr_mentions("space");
    assert_eq!(fs::read(disk.path.join("big.bin")).unwrap(), OLD);
    assert!(temp_files(&disk.path).is_empty());
}

/// A directory made immutable (`chattr +i`), unlocked on drop so the test can clean up.
/// Immutable stops even root from creating files in it, which mode bits do not.
struct Locked(std::path::PathBuf);

impl Locked {
    fn new(dir: std::path::PathBuf) -> Option<Locked> {
        let locked = Command::new("chattr")
            .arg("+i")
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !locked {
            eprintln!("skipped: chattr +i is not available here");
            return None;
        }
        Some(Locked(dir))
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

/// A file the server cannot create (its directory refuses) fails alone, with the
/// reason; the session goes on and the other files land.
#[test]
fn a_file_the_server_cannot_create_fails_alone() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir_all(root.join("copy/locked")).unwrap();
    let server = Server::start(&root, &[]);
    let src = dir.path().join("copy");
    fs::create_dir_all(src.join("locked")).unwrap();
    fs::create_dir_all(src.join("free")).unwrap();
    write_pattern(&src.join("locked/refused"), 5000, 1);
    write_pattern(&src.join("free/lands"), 3 << 20, 2);
    write_pattern(&src.join("free/small"), 700, 3);
    let Some(_locked) = Locked::new(root.join("copy/locked")) else {
        return;
    };

    let run = cp([src.as_os_str(), &server.url("")]);
    // 8: the server failed on its side; "1 file failed" names the first.
    run.assert_code(8)
        .assert_stderr_mentions("1 file failed")
        .assert_stderr_mentions("locked/refused")
        .assert_stderr_mentions("Operation not permitted");
    // What the server says names the file relative to what it serves, never where that is.
    let served = root.display().to_string();
    assert!(!run.stderr.contains(&served), "{}", run.stderr);
    for name in ["free/lands", "free/small"] {
        assert_eq!(
            fs::read(root.join("copy").join(name)).unwrap(),
            fs::read(src.join(name)).unwrap()
        );
    }
    assert!(!root.join("copy/locked/refused").exists());
    assert!(temp_files(&root).is_empty());
}

/// 3,000 files in 30 directories at `src`; `d07` under `dest` is a regular file.
fn tree_with_a_blocked_directory(src: &Path, dest: &Path) {
    for d in 0..30 {
        let dir = src.join(format!("d{d:02}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..100 {
            fs::write(dir.join(format!("f{f:03}")), format!("{d}/{f}")).unwrap();
        }
    }
    fs::create_dir_all(dest).unwrap();
    fs::write(dest.join("d07"), b"a file where the tree has a directory").unwrap();
}

/// Every file but the hundred under the blocked directory landed, whole.
fn assert_rest_landed(src: &Path, dest: &Path) {
    for d in (0..30).filter(|&d| d != 7) {
        for f in 0..100 {
            let rel = format!("d{d:02}/f{f:03}");
            assert_eq!(
                fs::read(dest.join(&rel)).unwrap(),
                fs::read(src.join(&rel)).unwrap(),
                "{rel}"
            );
        }
    }
    assert_eq!(
        fs::read(dest.join("d07")).unwrap(),
        b"a file where the tree has a directory",
        "what stood in the way is untouched"
    );
    assert!(temp_files(dest).is_empty());
}

#[test]
fn a_file_where_a_directory_must_go_fails_its_files_alone_both_ways() {
    let site = Site::new();
    // Push: the server cannot make d07; exit 8 (the server failed on its side).
    let src = site.path("tree");
    let dest = site.root().join("tree");
    tree_with_a_blocked_directory(&src, &dest);
    let run = cp(["--json".as_ref(), src.as_os_str(), &site.server.url("")]);
    run.assert_code(8);
    let json = run.json();
    // The directory and the hundred files under it.
    assert_eq!(json["failed_files"], 101, "{json}");
    assert!(json["failed"].to_string().contains("d07"), "{json}");
    let served = site.root().display().to_string();
    assert!(!json.to_string().contains(&served), "{json}");
    assert_rest_landed(&src, &dest);
    // Pull: this side cannot make d07; exit 7 (local I/O).
    let served = site.root().join("served");
    let here = site.path("here");
    tree_with_a_blocked_directory(&served, &here.join("served"));
    let run = cp([
        "--json".as_ref(),
        site.server.url("served").as_os_str(),
        here.as_os_str(),
    ]);
    run.assert_code(7);
    let json = run.json();
    assert_eq!(json["failed_files"], 101, "{json}");
    assert_rest_landed(&served, &here.join("served"));
}
