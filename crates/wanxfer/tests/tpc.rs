//! Third-party copy (issue 20 item 2): `wanxfer cp wanxfer://A/x wanxfer://B/y` between
//! two servers on loopback, the data going from A to B and not through the client (the
//! kernel's byte counters on the client's own connections say so), and every refusal:
//! a missing or wrong credential for either side, a grant used again, expired, or for
//! another path, and a destination whose certificate is not the one the client saw.
//! The grant-level cases drive the servers through the engine's own client, as a
//! scheduler embedding wanxfer would.

mod common;

use std::fs;
use std::time::Duration;

use common::*;
use wanxfer_engine::ops::Client;
use wanxfer_engine::session::{ClientConfig, Tuning};
use wanxfer_proto::tpc::{PushTo, TransferSummary};
use wanxfer_proto::{session_flags, Compare, FailureClass, RelPath};

const USAGE: i32 = 2;
const AUTH: i32 = 3;

/// A tree of every shape a copy meets: nested directories, an empty directory, an
/// empty file, small files and one file of several blocks (at the 1 MiB blocks the
/// tests ask for).
fn mixed_tree(at: &std::path::Path) -> u64 {
    fs::create_dir_all(at.join("a/b/c")).unwrap();
    fs::create_dir_all(at.join("empty-dir")).unwrap();
    fs::write(at.join("empty"), b"").unwrap();
    fs::write(at.join("a/small.txt"), b"small\n").unwrap();
    write_pattern(&at.join("a/b/c/deep.bin"), 70_001, 3);
    write_pattern(&at.join("a/b/multi-block.bin"), 5 * (1 << 20) + 12_345, 7);
    set_mode(&at.join("a/small.txt"), 0o640);
    set_mtime(&at.join("a/small.txt"), 1_600_000_000, 7);
    6 + 70_001 + 5 * (1 << 20) + 12_345
}

fn two_sites() -> (Site, Site) {
    let a = Site::new();
    let b = Site::new();
    (a, b)
}

#[test]
fn a_mixed_tree_moves_between_servers_and_not_through_the_client() {
    let (a, b) = two_sites();
    let total = mixed_tree(&a.root().join("tree"));
    let run = cp([
        "--json".into(),
        "--block-size".into(),
        "1MiB".into(),
        a.server.url("tree"),
        b.server.url("copy"),
    ]);
    let v = run.assert_ok().json();
    assert_same_tree(&a.root().join("tree"), &b.root().join("copy"), false);
    assert_eq!(v["bytes"], total, "{v}");
    assert_eq!(v["files"], 4, "{v}");
    assert_eq!(v["failed_files"], 0);
    let t = &v["third_party"];
    assert_eq!(t["source"], a.server.addr.as_str());
    assert_eq!(t["destination"], b.server.addr.as_str());
    // The client's own connections carried requests, progress and the summary: a few
    // kilobytes, against more than 5 MiB of data that went from A to B.
    let sent = t["client_tcp_bytes_sent"].as_u64().unwrap();
    let received = t["client_tcp_bytes_received"].as_u64().unwrap();
    assert!(sent > 0 && received > 0, "the counters count: {t}");
    assert!(
        sent + received < 64 << 10,
        "the client moved {sent} + {received} bytes for a {total}-byte copy: {t}"
    );
    assert!(b.server.log().contains("third-party push into copy"));

    // Run again: the same transfer, nothing to send.
    let again = cp([
        "--json".into(),
        "--block-size".into(),
        "1MiB".into(),
        a.server.url("tree"),
        b.server.url("copy"),
    ]);
    let v = again.assert_ok().json();
    assert_eq!(v["bytes"], 0, "{v}");
    assert_eq!(v["files_up_to_date"], 4, "{v}");
}

/// The client names both sides; which one is "remote" to whom does not matter: B can
/// be the source and A the destination, into a directory (trailing slash) as `cp`
/// places it, and a single file too.
#[test]
fn either_server_can_be_the_source() {
    let (a, b) = two_sites();
    mixed_tree(&b.root().join("data"));
    fs::create_dir(a.root().join("inbox")).unwrap();
    cp([b.server.url("data"), a.server.url("inbox/")]).assert_ok();
    assert_same_tree(&b.root().join("data"), &a.root().join("inbox/data"), false);
    cp([
        b.server.url("data/a/b/multi-block.bin"),
        a.server.url("one.bin"),
    ])
    .assert_ok();
    assert_eq!(
        fs::read(a.root().join("one.bin")).unwrap(),
        fs::read(b.root().join("data/a/b/multi-block.bin")).unwrap()
    );
    // Text output: the usual summary, naming both servers.
    let run = cp_with_notes([b.server.url("data/empty"), a.server.url("e")]);
    run.assert_ok();
    assert!(
        run.stdout
            .contains(&format!("{} -> {}", b.server.addr, a.server.addr)),
        "{run:#?}"
    );
}

/// The files (not directories) beneath `dir`, as relative paths, sorted.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    fn walk(base: &std::path::Path, dir: &std::path::Path, out: &mut Vec<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(base, &path, out);
            } else {
                out.push(
                    path.strip_prefix(base)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// `--exclude`, `--include` and `--files-from` between two servers: the source walks
/// with them as a pushing client would (each file that arrives is the source's, byte
/// for byte); `--parents` makes the directories above the destination on its server;
/// a selection the request could not carry and a bad pattern are usage errors before
/// anything connects; `--dry-run` lists the source's selected walk and moves nothing.
#[test]
fn a_selection_travels_to_the_source_and_parents_are_made_at_the_destination() {
    let (a, b) = two_sites();
    let tree = a.root().join("tree");
    for (seed, rel) in [
        "a.txt",
        "b.log",
        "keep.log",
        "raw/x.dat",
        "raw/cache/c.dat",
        "sub/q.dat",
    ]
    .iter()
    .enumerate()
    {
        fs::create_dir_all(tree.join(rel).parent().unwrap()).unwrap();
        write_pattern(&tree.join(rel), 10_000 + seed as u64 * 777, seed as u64);
    }
    let run = cp([
        "--json".into(),
        "--include".into(),
        "keep.log".into(),
        "--exclude".into(),
        "*.log".into(),
        "--exclude".into(),
        "cache/".into(),
        a.server.url("tree"),
        b.server.url("ruled"),
    ]);
    let v = run.assert_ok().json();
    let ruled = b.root().join("ruled");
    assert_eq!(
        files_under(&ruled),
        ["a.txt", "keep.log", "raw/x.dat", "sub/q.dat"],
        "{v}"
    );
    assert_eq!(v["files"], 4, "{v}");
    for rel in files_under(&ruled) {
        assert_eq!(
            fs::read(ruled.join(&rel)).unwrap(),
            fs::read(tree.join(&rel)).unwrap(),
            "{rel}"
        );
    }

    // A list, with --parents: deep/er does not exist on B yet.
    let list = a.path("list");
    fs::write(&list, "a.txt\nraw/\n").unwrap();
    let without = cp([
        "--files-from".into(),
        list.clone().into_os_string(),
        a.server.url("tree"),
        b.server.url("deep/er/listed"),
    ]);
    assert_ne!(
        without.code, 0,
        "no parents made without --parents: {without:#?}"
    );
    assert!(!b.root().join("deep").exists());
    cp([
        "--parents".into(),
        "--files-from".into(),
        list.clone().into_os_string(),
        a.server.url("tree"),
        b.server.url("deep/er/listed"),
    ])
    .assert_ok();
    assert_eq!(
        files_under(&b.root().join("deep/er/listed")),
        ["a.txt", "raw/cache/c.dat", "raw/x.dat"]
    );

    // Refused before anything connects: too many rules, a bad pattern, --dry-run.
    let mut many: Vec<std::ffi::OsString> = Vec::new();
    for i in 0..=wanxfer_proto::MAX_SELECT_RULES {
        many.push("--exclude".into());
        many.push(format!("n{i}").into());
    }
    many.push(a.server.url("tree"));
    many.push(b.server.url("many"));
    cp(&many)
        .assert_code(USAGE)
        .assert_stderr_mentions("a copy between two servers carries at most 1024");
    cp([
        "--exclude".into(),
        "a[".into(),
        a.server.url("tree"),
        b.server.url("glob"),
    ])
    .assert_code(USAGE);
    for name in ["many", "glob"] {
        assert!(!b.root().join(name).exists(), "{name}");
    }

    // A dry run lists what the source would walk, selected, and moves nothing.
    let dry = cp([
        "--dry-run".into(),
        "--json".into(),
        "--exclude".into(),
        "*.log".into(),
        "--exclude".into(),
        "raw/".into(),
        a.server.url("tree"),
        b.server.url("dry"),
    ]);
    let v = dry.assert_ok().json();
    let mut listed: Vec<String> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        ["tree", "tree/a.txt", "tree/sub", "tree/sub/q.dat"],
        "{v}"
    );
    assert_eq!(v["files"], 2, "{v}");
    assert!(!b.root().join("dry").exists());
}

#[test]
fn a_missing_credential_for_either_side_is_refused_before_anything_moves() {
    let (a, b) = two_sites();
    mixed_tree(&a.root().join("tree"));
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    fs::write(&secret_file, SECRET).unwrap();
    set_mode(&secret_file, 0o600);
    let without_env = |args: Vec<std::ffi::OsString>| {
        let mut cmd = cp_command(args);
        cmd.env_remove("WANXFER_SECRET");
        Run::from_cmd(cmd)
    };
    without_env(vec![
        "--dest-secret-file".into(),
        secret_file.clone().into(),
        a.server.url("tree"),
        b.server.url("copy"),
    ])
    .assert_code(USAGE)
    .assert_stderr_mentions(&format!(
        "no credential for the source server {}",
        a.server.addr
    ));
    without_env(vec![
        "--source-secret-file".into(),
        secret_file.clone().into(),
        a.server.url("tree"),
        b.server.url("copy"),
    ])
    .assert_code(USAGE)
    .assert_stderr_mentions(&format!(
        "no credential for the destination server {}",
        b.server.addr
    ));
    // Both given: it works without the environment.
    without_env(vec![
        "--source-secret-file".into(),
        secret_file.clone().into(),
        "--dest-secret-file".into(),
        secret_file.into(),
        a.server.url("tree/empty"),
        b.server.url("e"),
    ])
    .assert_ok();
    assert!(!b.root().join("copy").exists());
}

#[test]
fn a_wrong_credential_for_either_side_fails_authentication_naming_it() {
    let (a, b) = two_sites();
    mixed_tree(&a.root().join("tree"));
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong");
    fs::write(&wrong, "not-the-secret-0123456789abcdef").unwrap();
    set_mode(&wrong, 0o600);
    for (flag, server) in [
        ("--source-secret-file", &a.server),
        ("--dest-secret-file", &b.server),
    ] {
        cp([
            flag.into(),
            wrong.clone().into(),
            a.server.url("tree"),
            b.server.url("copy"),
        ])
        .assert_code(AUTH)
        .assert_stderr_mentions(&format!("authentication with {} failed", server.addr));
    }
    assert!(!b.root().join("copy").exists());
}

// The grant itself, through the engine's client.

fn config(addr: &str) -> ClientConfig {
    let mut cfg = ClientConfig::new(addr.to_string(), SECRET.into(), Tuning::default());
    cfg.connect_timeout = Duration::from_secs(10);
    cfg.state_dir = state_dir();
    cfg
}

fn fingerprint_of(client: &Client) -> [u8; 32] {
    let hex = client
        .fingerprint()
        .unwrap()
        .strip_prefix("SHA256:")
        .unwrap();
    let mut out = [0; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

fn rel(s: &str) -> RelPath {
    RelPath::new(s.as_bytes()).unwrap()
}

fn push(source: &str, dest_addr: &str, dest: &str, grant: wanxfer_proto::tpc::Granted) -> PushTo {
    PushTo {
        sources: vec![rel(source)],
        server: dest_addr.as_bytes().to_vec(),
        fingerprint: [0; 32],
        dest: rel(dest),
        into: false,
        grant,
        streams: 2,
        block_size: 1 << 20,
        depth: 2,
        compare: Compare::QuickCheck,
        flags: 0,
        preserve: 0,
        selection: wanxfer_proto::Selection::default(),
    }
}

#[track_caller]
fn assert_refused(summary: &TransferSummary, class: FailureClass, words: &str) {
    let (got, message) = summary.error.as_ref().expect("the push failed");
    let message = String::from_utf8_lossy(message);
    assert_eq!(*got, class, "{message}");
    assert!(message.contains(words), "{message:?} should say {words:?}");
}

#[test]
fn a_grant_allows_one_transfer_into_its_path_and_nothing_else() {
    let (a, b) = two_sites();
    mixed_tree(&a.root().join("tree"));
    let mut source = Client::connect(&config(&a.server.addr)).unwrap();
    let mut dest = Client::connect(&config(&b.server.addr)).unwrap();
    let pinned = fingerprint_of(&dest);
    let grant = dest.grant(&rel("copy"), 60, 0).unwrap();

    // Whoever holds a grant may push with it, nothing else: not run operations.
    let mut holder = config(&b.server.addr);
    holder.grant = Some((grant.id, grant.secret));
    let mut ops = Client::connect(&holder).expect("the grant's proof is accepted");
    let err = ops.stat(&rel("copy")).unwrap_err();
    assert!(
        err.to_string().contains("allows one push, nothing else"),
        "{err}"
    );

    // Another path than the grant's: refused, and the grant is not used up by it.
    let mut wrong_path = push("tree", &b.server.addr, "elsewhere", grant.clone());
    wrong_path.fingerprint = pinned;
    let summary = source.push_to(wrong_path, |_| Ok(())).unwrap();
    assert_refused(
        &summary,
        FailureClass::Refused,
        "the grant was made for this path",
    );
    assert!(!b.root().join("elsewhere").exists());

    // A destination presenting another certificate than the one the client verified.
    let summary = source
        .push_to(push("tree", &b.server.addr, "copy", grant.clone()), |_| {
            Ok(())
        })
        .unwrap();
    assert_refused(&summary, FailureClass::Auth, "not SHA256:0000");
    assert!(!b.root().join("copy").exists());

    // The real thing, with progress along the way for a file this size.
    let mut good = push("tree", &b.server.addr, "copy", grant.clone());
    good.fingerprint = pinned;
    let summary = source.push_to(good.clone(), |_| Ok(())).unwrap();
    assert_eq!(summary.error, None);
    assert_eq!(summary.files, 4);
    assert_same_tree(&a.root().join("tree"), &b.root().join("copy"), false);

    // The same grant again, even for the same transfer: spent.
    let summary = source.push_to(good, |_| Ok(())).unwrap();
    assert_refused(
        &summary,
        FailureClass::Auth,
        "unknown, expired or already used",
    );
}

/// A grant names what the push may keep (`cp --preserve` between two servers): the
/// source that holds a grant made for a plain copy cannot use it to set owners or
/// attributes on the destination, and the refusal leaves the grant usable for the copy
/// it was made for.
#[test]
fn a_grant_for_a_plain_copy_does_not_allow_preserving() {
    let (a, b) = two_sites();
    mixed_tree(&a.root().join("tree"));
    let mut source = Client::connect(&config(&a.server.addr)).unwrap();
    let mut dest = Client::connect(&config(&b.server.addr)).unwrap();
    let grant = dest.grant(&rel("copy"), 60, 0).unwrap();
    let mut keeping = push("tree", &b.server.addr, "copy", grant.clone());
    keeping.fingerprint = fingerprint_of(&dest);
    keeping.preserve = session_flags::PRESERVE_OWNER | session_flags::PRESERVE_XATTRS;
    let summary = source.push_to(keeping.clone(), |_| Ok(())).unwrap();
    assert_refused(
        &summary,
        FailureClass::Refused,
        "the grant was made for a copy that keeps nothing, not owner,xattrs",
    );
    assert!(!b.root().join("copy").exists());

    // A grant for attributes does not stretch to owners either.
    let grant = dest
        .grant(&rel("copy"), 60, session_flags::PRESERVE_XATTRS)
        .unwrap();
    keeping.grant = grant.clone();
    let summary = source.push_to(keeping.clone(), |_| Ok(())).unwrap();
    assert_refused(
        &summary,
        FailureClass::Refused,
        "keeps xattrs, not owner,xattrs",
    );
    keeping.preserve = session_flags::PRESERVE_XATTRS;
    let summary = source.push_to(keeping, |_| Ok(())).unwrap();
    assert_eq!(summary.error, None);
    assert_same_tree(&a.root().join("tree"), &b.root().join("copy"), false);
}

/// A source that cannot reach the destination says so as a network failure (the client
/// exits 4 and a scheduler retries), not as a refusal.
#[test]
fn a_destination_the_source_cannot_reach_is_a_network_failure() {
    let (a, b) = two_sites();
    mixed_tree(&a.root().join("tree"));
    let mut source = Client::connect(&config(&a.server.addr)).unwrap();
    let mut dest = Client::connect(&config(&b.server.addr)).unwrap();
    let grant = dest.grant(&rel("far"), 60, 0).unwrap();
    // A port nobody listens on any more.
    let gone = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut unreachable = push("tree", &gone, "far", grant);
    unreachable.fingerprint = fingerprint_of(&dest);
    let summary = source.push_to(unreachable, |_| Ok(())).unwrap();
    assert_refused(&summary, FailureClass::Network, &gone);
    let (class, message) = summary.error.unwrap();
    let error =
        wanxfer_engine::Error::remote(&a.server.addr, &wanxfer_proto::ErrorMsg { class, message });
    assert_eq!(
        error.class(),
        wanxfer_engine::ErrorClass::Network,
        "{error}"
    );
    assert!(!b.root().join("far").exists());
}

#[test]
fn an_expired_grant_is_refused() {
    let (a, b) = two_sites();
    mixed_tree(&a.root().join("tree"));
    let mut source = Client::connect(&config(&a.server.addr)).unwrap();
    let mut dest = Client::connect(&config(&b.server.addr)).unwrap();
    let grant = dest.grant(&rel("late"), 1, 0).unwrap();
    assert_eq!(grant.ttl_s, 1);
    // Past its life (not a timing assertion: any delay beyond a second will do).
    std::thread::sleep(Duration::from_millis(1500));
    let mut late = push("tree", &b.server.addr, "late", grant);
    late.fingerprint = fingerprint_of(&dest);
    let summary = source.push_to(late, |_| Ok(())).unwrap();
    assert_refused(
        &summary,
        FailureClass::Auth,
        "unknown, expired or already used",
    );
    assert!(!b.root().join("late").exists());
}

#[test]
fn a_grant_for_a_reserved_name_is_refused() {
    let b = Site::new();
    let mut dest = Client::connect(&config(&b.server.addr)).unwrap();
    let err = dest.grant(&rel(".wanxfer-state"), 60, 0).unwrap_err();
    assert!(err.to_string().contains("the server's own"), "{err}");
    // The connection stays usable after a refusal.
    dest.grant(&rel("ok"), 60, 0).unwrap();
}
