//! `wanxfer ls | stat | mkdir | rm | mv | sum` against a real `wanxfer serve` on
//! loopback: every operation end to end with its `--json` output parsed, checksums
//! against the reference tools (`xxhsum -H2`, Python's `zlib.adler32`, `md5sum`),
//! refusals outside the root and through symlinks planted in the served tree, and the
//! exit codes of the README's table.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::process::Command;

use common::*;
use serde_json::Value;

const REMOTE: i32 = 8;
const AUTH: i32 = 3;
const NETWORK: i32 = 4;
const USAGE: i32 = 2;

/// A site whose root holds a small tree and, beside the root, an `outside` directory
/// with a file that no operation may touch.
fn site() -> Site {
    let site = Site::new();
    let root = site.root();
    fs::create_dir_all(root.join("data/sub")).unwrap();
    write_pattern(&root.join("data/a.bin"), 200_000, 1);
    fs::write(root.join("data/sub/b.txt"), b"hello\n").unwrap();
    set_mode(&root.join("data/sub/b.txt"), 0o640);
    set_mtime(&root.join("data/sub/b.txt"), 1_600_000_000, 42);
    symlink("a.bin", root.join("data/link")).unwrap();
    fs::write(root.join("data/.wanxfer-0011-2233.part"), b"partial").unwrap();
    fs::create_dir(site.path("outside")).unwrap();
    fs::write(site.path("outside/precious"), b"keep me").unwrap();
    site
}

#[track_caller]
fn assert_outside_intact(site: &Site) {
    assert_eq!(fs::read(site.path("outside/precious")).unwrap(), b"keep me");
    assert_eq!(fs::read_dir(site.path("outside")).unwrap().count(), 1);
}

fn by_path(lines: Vec<Value>) -> BTreeMap<String, Value> {
    lines
        .into_iter()
        .map(|v| (v["path"].as_str().unwrap().to_string(), v))
        .collect()
}

#[test]
fn stat_describes_entries_and_never_follows_symlinks() {
    let site = site();
    let s = &site.server;
    let run = wanxfer("stat", [s.url("data/sub/b.txt"), "--json".into()]);
    let v = run.assert_ok().json();
    assert_eq!(v["kind"], "file");
    assert_eq!(v["size"], 6);
    assert_eq!(v["mode"], "0640");
    assert_eq!(
        (v["mtime_sec"].as_i64(), v["mtime_nsec"].as_u64()),
        (Some(1_600_000_000), Some(42))
    );
    assert_eq!(v["path"], "data/sub/b.txt");
    let link = wanxfer("stat", [s.url("data/link"), "--json".into()]);
    let v = link.assert_ok().json();
    assert_eq!(
        (v["kind"].as_str(), v["link_target"].as_str()),
        (Some("symlink"), Some("a.bin"))
    );
    let root = wanxfer("stat", [s.url(""), "--json".into()]);
    assert_eq!(root.assert_ok().json()["kind"], "dir");
    let text = wanxfer("stat", [s.url("data/sub/b.txt")]);
    assert!(
        text.assert_ok()
            .stdout
            .contains("mtime: 2020-09-13T12:26:40.000000042Z"),
        "{text:#?}"
    );
    let missing = wanxfer("stat", [s.url("data/nope"), "--json".into()]);
    missing
        .assert_code(REMOTE)
        .assert_stderr_mentions("no such file");
    assert_eq!(missing.json()["exit_code"], REMOTE);
}

#[test]
fn ls_lists_flat_long_and_recursive_and_hides_temporaries() {
    let site = site();
    let s = &site.server;
    let flat = wanxfer("ls", [s.url("data")]);
    let mut names: Vec<&str> = flat.assert_ok().stdout.lines().collect();
    names.sort_unstable();
    assert_eq!(names, ["a.bin", "link", "sub"]);
    let deep = wanxfer(
        "ls",
        [s.url("data"), "-R".into(), "-l".into(), "--json".into()],
    );
    let entries = by_path(deep.assert_ok().json_lines());
    assert_eq!(
        entries.keys().collect::<Vec<_>>(),
        ["a.bin", "link", "sub", "sub/b.txt"]
    );
    assert_eq!(entries["a.bin"]["size"], 200_000);
    assert_eq!(entries["sub"]["kind"], "dir");
    assert_eq!(entries["link"]["link_target"], "a.bin");
    let long = wanxfer("ls", [s.url("data/sub"), "-l".into()]);
    let line = long.assert_ok().stdout.trim().to_string();
    assert!(
        line.starts_with("-rw-r----- ") && line.ends_with(" 2020-09-13 12:26:40 b.txt"),
        "{line:?}"
    );
    // The temporary is there on disk, and nothing shows it.
    assert!(site.root().join("data/.wanxfer-0011-2233.part").exists());
    let reserved = wanxfer("stat", [s.url("data/.wanxfer-0011-2233.part")]);
    reserved
        .assert_code(REMOTE)
        .assert_stderr_mentions("server's own");
}

/// Names with a newline and bytes that are not UTF-8 come out escaped: one line per
/// entry, and JSON that parses.
#[test]
fn odd_names_are_listed_escaped() {
    let site = site();
    let dir = site.root().join("odd");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join(OsStr::from_bytes(b"new\nline")), b"1").unwrap();
    fs::write(dir.join(OsStr::from_bytes(b"bytes-\xff\xfe")), b"2").unwrap();
    let run = wanxfer("ls", [site.server.url("odd"), "--json".into()]);
    let entries = by_path(run.assert_ok().json_lines());
    assert_eq!(
        entries.keys().collect::<Vec<_>>(),
        ["bytes-\\xff\\xfe", "new\\nline"]
    );
    let text = wanxfer("ls", [site.server.url("odd")]);
    assert_eq!(text.assert_ok().stdout.lines().count(), 2);
    let sum = wanxfer(
        "sum",
        [
            site.server.url_bytes(b"odd/bytes-\xff\xfe"),
            "-a".into(),
            "md5".into(),
        ],
    );
    sum.assert_ok();
}

#[test]
fn mkdir_rm_and_mv_change_the_tree() {
    let site = site();
    let s = &site.server;
    let root = site.root().to_path_buf();
    wanxfer(
        "mkdir",
        ["-p".into(), s.url("new/deep/er"), "--json".into()],
    )
    .assert_ok();
    assert!(root.join("new/deep/er").is_dir());
    wanxfer("mkdir", ["-p".into(), s.url("new/deep/er")]).assert_ok();
    wanxfer("mkdir", [s.url("new")])
        .assert_code(REMOTE)
        .assert_stderr_mentions("File exists");
    wanxfer("mkdir", [s.url("absent/child")]).assert_code(REMOTE);
    wanxfer("mkdir", ["--mode".into(), "700".into(), s.url("private")]).assert_ok();
    assert!(matches!(
        node(&root.join("private")),
        Node::Dir { mode: 0o700, .. }
    ));

    // mv across directories, then into an existing directory (as mv(1)).
    let mv = wanxfer(
        "mv",
        [
            s.url("data/sub/b.txt"),
            s.url("new/deep/moved.txt"),
            "--json".into(),
        ],
    );
    let v = mv.assert_ok().json();
    assert_eq!(
        (v["from"].as_str(), v["to"].as_str()),
        (Some("data/sub/b.txt"), Some("new/deep/moved.txt"))
    );
    assert_eq!(
        fs::read(root.join("new/deep/moved.txt")).unwrap(),
        b"hello\n"
    );
    wanxfer("mv", [s.url("data/a.bin"), s.url("new")]).assert_ok();
    assert!(root.join("new/a.bin").is_file() && !root.join("data/a.bin").exists());
    wanxfer("mv", [s.url("data/missing"), s.url("x")]).assert_code(REMOTE);

    // rm: files; directories only with -d (empty) or -r.
    wanxfer("rm", [s.url("new/deep/moved.txt")]).assert_ok();
    assert!(!root.join("new/deep/moved.txt").exists());
    wanxfer("rm", [s.url("new/deep")])
        .assert_code(REMOTE)
        .assert_stderr_mentions("is a directory");
    wanxfer("rm", ["-d".into(), s.url("new")])
        .assert_code(REMOTE)
        .assert_stderr_mentions("not empty");
    wanxfer("rm", ["-d".into(), s.url("new/deep/er")]).assert_ok();
    let rm = wanxfer("rm", ["-r".into(), s.url("new"), "--json".into()]);
    assert_eq!(rm.assert_ok().json()["ok"], true);
    assert!(!root.join("new").exists());
    wanxfer("rm", ["-r".into(), s.url("")])
        .assert_code(REMOTE)
        .assert_stderr_mentions("root itself");
    assert!(root.is_dir());
}

#[test]
fn sum_agrees_with_the_reference_tools() {
    let site = site();
    let s = &site.server;
    let file = site.root().join("data/a.bin");
    let ours = |algorithm: &str| {
        let run = wanxfer(
            "sum",
            [
                "-a".into(),
                algorithm.into(),
                s.url("data/a.bin"),
                "--json".into(),
            ],
        );
        let v = run.assert_ok().json();
        assert_eq!(v["algorithm"], algorithm);
        v["checksum"].as_str().unwrap().to_string()
    };
    // Adler-32 as Rucio catalogues it: 8 lowercase hex digits, zero-padded.
    let zlib = Command::new("python3")
        .args([
            "-c",
            "import sys, zlib; print('%08x' % zlib.adler32(open(sys.argv[1], 'rb').read()))",
        ])
        .arg(&file)
        .output()
        .expect("python3 runs");
    assert!(zlib.status.success());
    assert_eq!(
        ours("adler32"),
        String::from_utf8(zlib.stdout).unwrap().trim()
    );
    let md5 = Command::new("md5sum")
        .arg(&file)
        .output()
        .expect("md5sum runs");
    assert_eq!(
        ours("md5"),
        String::from_utf8_lossy(&md5.stdout)
            .split_whitespace()
            .next()
            .unwrap()
    );
    let data = fs::read(&file).unwrap();
    assert_eq!(ours("crc32c"), format!("{:08x}", crc32c::crc32c(&data)));
    let xxh3 = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&data));
    assert_eq!(ours("xxh3"), xxh3);
    // The default is XXH3-128, printed as `xxhsum -H2` prints it.
    let text = wanxfer("sum", [s.url("data/a.bin")]);
    let line = text.assert_ok().stdout.trim().to_string();
    assert_eq!(
        line,
        format!("{xxh3}  {}", s.url("data/a.bin").to_string_lossy())
    );
    match Command::new("xxhsum").arg("-H2").arg(&file).output() {
        Ok(out) if out.status.success() => {
            let theirs = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                theirs.split_whitespace().next(),
                Some(xxh3.as_str()),
                "{theirs}"
            );
        }
        _ => eprintln!("note: xxhsum is not installed; XXH3 checked against xxhash-rust only"),
    }
    wanxfer("sum", [s.url("data/sub")])
        .assert_code(REMOTE)
        .assert_stderr_mentions("is a directory");
    wanxfer("sum", [s.url("data/link")])
        .assert_code(REMOTE)
        .assert_stderr_mentions("symlink");
}

/// Symlinks planted in the served tree, to a directory and a file outside it: no
/// operation reads, lists, creates, moves or removes anything through them.
#[test]
fn nothing_outside_the_root_is_reached_through_planted_symlinks() {
    let site = site();
    let s = &site.server;
    let root = site.root().to_path_buf();
    symlink(site.path("outside"), root.join("escape")).unwrap();
    symlink(
        site.path("outside/precious"),
        root.join("data/sub/to-precious"),
    )
    .unwrap();
    for (sub, args) in [
        ("stat", vec![s.url("escape/precious")]),
        ("ls", vec![s.url("escape/precious")]),
        ("ls", vec!["-R".into(), s.url("escape/x")]),
        ("sum", vec![s.url("escape/precious")]),
        ("sum", vec![s.url("data/sub/to-precious")]),
        ("mkdir", vec!["-p".into(), s.url("escape/planted/deeper")]),
        ("mkdir", vec![s.url("escape/planted")]),
        ("rm", vec![s.url("escape/precious")]),
        ("rm", vec!["-r".into(), s.url("escape/precious")]),
        ("mv", vec![s.url("data/a.bin"), s.url("escape/stolen")]),
        ("mv", vec![s.url("escape/precious"), s.url("data/got-it")]),
    ] {
        let mut argv = args.clone();
        argv.push("--json".into());
        let run = wanxfer(sub, &argv);
        run.assert_code(REMOTE);
        let error = run.json()["error"].as_str().unwrap().to_string();
        assert!(error.contains("symlink"), "{sub} {args:?}: {error}");
        let root_text = site.dir.path().to_string_lossy().into_owned();
        assert!(
            !error.contains(&root_text),
            "the server's path leaked: {error}"
        );
    }
    // ls of the link itself shows the link, not what it points at.
    let link = wanxfer("ls", ["-l".into(), s.url("escape")]);
    assert!(link.assert_ok().stdout.trim().starts_with('l'), "{link:#?}");
    // rm -r of a tree holding links removes the links only.
    wanxfer("rm", ["-r".into(), s.url("data")]).assert_ok();
    wanxfer("rm", [s.url("escape")]).assert_ok();
    assert_outside_intact(&site);
    assert_eq!(
        fs::read_dir(&root).unwrap().count(),
        0,
        "{:?}",
        snapshot(&root).keys()
    );
    // `..` never gets past the client's own parser.
    let dots = wanxfer("stat", [s.url("data/../../outside")]);
    dots.assert_code(USAGE).assert_stderr_mentions("'..'");
}

#[test]
fn exit_codes_follow_the_readme() {
    let site = site();
    let s = &site.server;
    let wrong = wanxfer_with_secret("not-the-secret-of-this-server", "ls", [s.url("")]);
    wrong
        .assert_code(AUTH)
        .assert_stderr_mentions("authentication");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = listener.local_addr().unwrap();
    drop(listener);
    let gone = wanxfer(
        "stat",
        [
            format!("wanxfer://{closed}/x"),
            "--connect-timeout".into(),
            "2".into(),
        ],
    );
    gone.assert_code(NETWORK);
    wanxfer("stat", ["wanxfr://host/x"]).assert_code(USAGE);
    wanxfer("stat", ["/local/path"])
        .assert_code(USAGE)
        .assert_stderr_mentions("not a remote location");
    wanxfer(
        "mv",
        [s.url("data/a.bin"), "wanxfer://127.0.0.1:1/x".into()],
    )
    .assert_code(USAGE);
    let no_secret = Command::new(wanxfer_bin())
        .args(["stat", "--json"])
        .arg(s.url(""))
        .env_remove("WANXFER_SECRET")
        .output()
        .unwrap();
    assert_eq!(no_secret.status.code(), Some(USAGE));
    // After all that, the server still serves.
    wanxfer("stat", [s.url("")]).assert_ok();
}
