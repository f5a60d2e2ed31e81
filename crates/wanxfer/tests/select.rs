//! Selection end to end over loopback (issue 20, item 3): `--exclude`/`--include`,
//! `--files-from` and `--dry-run`, each pushed (the client lists) and pulled (the server
//! lists, with the rules carried in the request), against a generated tree whose
//! expected file lists are written out by hand.

mod common;

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;

use common::*;

/// Every file in the tree, with the seed its contents were made from.
const TREE: &[&str] = &[
    "a.txt",
    "b.log",
    "keep.log",
    "raw/x.dat",
    "raw/y.dat",
    "raw/notes.txt",
    "raw/cache/c.dat",
    "cache/z.txt",
    "sub/deep/q.dat",
    "sub/deep/r.txt",
];

fn make_tree(at: &Path) {
    for (seed, rel) in TREE.iter().enumerate() {
        let path = at.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        write_pattern(&path, 1000 + seed as u64 * 777, seed as u64);
    }
}

/// The files (not directories) beneath `dir`, as relative paths.
fn files_under(dir: &Path) -> BTreeSet<String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let entry = entry.unwrap();
            let path = entry.path();
            if entry.file_type().unwrap().is_dir() {
                walk(base, &path, out);
            } else {
                let rel = path.strip_prefix(base).unwrap();
                out.insert(rel.to_string_lossy().into_owned());
            }
        }
    }
    let mut out = BTreeSet::new();
    if dir.exists() {
        walk(dir, dir, &mut out);
    }
    out
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// A site whose root holds the tree as `data/`, and a local copy of it as `src/data`.
fn site_with_tree() -> Site {
    let site = Site::new();
    make_tree(&site.root().join("data"));
    make_tree(&site.path("src/data"));
    site
}

/// Pushes and pulls `data` with `flags`; both copies must hold exactly `expected`, each
/// file byte for byte as the source has it.
#[track_caller]
fn both_ways(site: &Site, name: &str, flags: &[&str], expected: &[&str]) {
    let expected = set(expected);
    let src = site.path("src/data");
    let mut push: Vec<OsString> = flags.iter().map(OsString::from).collect();
    push.push(src.clone().into());
    push.push(site.server.url(&format!("push-{name}")));
    cp(&push).assert_ok();
    let pushed = site.root().join(format!("push-{name}"));
    assert_eq!(files_under(&pushed), expected, "push with {flags:?}");

    let pulled = site.path(&format!("pull-{name}"));
    let mut pull: Vec<OsString> = flags.iter().map(OsString::from).collect();
    pull.push(site.server.url("data"));
    pull.push(pulled.clone().into());
    cp(&pull).assert_ok();
    assert_eq!(files_under(&pulled), expected, "pull with {flags:?}");

    for rel in &expected {
        let original = fs::read(src.join(rel)).unwrap();
        assert_eq!(
            fs::read(pushed.join(rel)).unwrap(),
            original,
            "pushed {rel}"
        );
        assert_eq!(
            fs::read(pulled.join(rel)).unwrap(),
            original,
            "pulled {rel}"
        );
    }
}

#[test]
fn excludes_and_includes_decide_in_the_order_given() {
    let site = site_with_tree();
    // The include before the exclude keeps keep.log; a trailing slash takes only
    // directories, so `cache/` drops both cache directories and nothing else.
    both_ways(
        &site,
        "order",
        &[
            "--include",
            "keep.log",
            "--exclude",
            "*.log",
            "--exclude",
            "cache/",
        ],
        &[
            "a.txt",
            "keep.log",
            "raw/x.dat",
            "raw/y.dat",
            "raw/notes.txt",
            "sub/deep/q.dat",
            "sub/deep/r.txt",
        ],
    );
    // The other order: the exclude matches keep.log first.
    both_ways(
        &site,
        "reversed",
        &["--exclude", "*.log", "--include", "keep.log"],
        &[
            "a.txt",
            "raw/x.dat",
            "raw/y.dat",
            "raw/notes.txt",
            "raw/cache/c.dat",
            "cache/z.txt",
            "sub/deep/q.dat",
            "sub/deep/r.txt",
        ],
    );
}

#[test]
fn anchors_double_stars_and_include_only_selections() {
    let site = site_with_tree();
    // A leading slash anchors at the source's top: raw/cache stays.
    both_ways(
        &site,
        "anchored",
        &["--exclude", "/cache/", "--exclude", "/sub/**/*.txt"],
        &[
            "a.txt",
            "b.log",
            "keep.log",
            "raw/x.dat",
            "raw/y.dat",
            "raw/notes.txt",
            "raw/cache/c.dat",
            "sub/deep/q.dat",
        ],
    );
    // Only the .dat files: directories must be included to be descended into.
    both_ways(
        &site,
        "only-dat",
        &["--include", "*/", "--include", "*.dat", "--exclude", "*"],
        &[
            "raw/x.dat",
            "raw/y.dat",
            "raw/cache/c.dat",
            "sub/deep/q.dat",
        ],
    );
}

#[test]
fn files_from_takes_the_listed_paths_and_what_is_beneath_listed_directories() {
    let site = site_with_tree();
    let list = site.path("list");
    fs::write(&list, "# wanted\na.txt\n./raw/x.dat\n\nsub/\n").unwrap();
    let expected = ["a.txt", "raw/x.dat", "sub/deep/q.dat", "sub/deep/r.txt"];
    both_ways(
        &site,
        "list",
        &["--files-from", list.to_str().unwrap()],
        &expected,
    );
    // Rules still apply within the list.
    both_ways(
        &site,
        "list-ruled",
        &["--files-from", list.to_str().unwrap(), "--exclude", "*.txt"],
        &["raw/x.dat", "sub/deep/q.dat"],
    );

    // NUL-separated, from standard input, pulled.
    let pulled = site.path("pull-stdin");
    let mut child = cp_command([
        OsString::from("--files-from"),
        "-".into(),
        "--from0".into(),
        site.server.url("data"),
        pulled.clone().into(),
    ])
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"b.log\0raw/cache\0")
        .unwrap();
    finish(child).assert_ok();
    assert_eq!(files_under(&pulled), set(&["b.log", "raw/cache/c.dat"]));

    // A bad line is named before anything connects.
    fs::write(&list, "a.txt\nraw/../../etc/passwd\n").unwrap();
    cp([
        OsString::from("--files-from"),
        list.clone().into(),
        site.path("src/data").into(),
        site.server.url("bad"),
    ])
    .assert_code(2)
    .assert_stderr_mentions("line 2");
    assert!(!site.root().join("bad").exists());
}

#[test]
fn excluded_files_on_the_destination_are_neither_sent_nor_touched() {
    let site = site_with_tree();
    let dest = site.root().join("sync");
    // A first full copy, then the destination's excluded files changed behind its back.
    cp([site.path("src/data").into(), site.server.url("sync")]).assert_ok();
    fs::write(dest.join("b.log"), b"the destination's own").unwrap();
    fs::remove_file(dest.join("raw/x.dat")).unwrap();
    // The source's excluded file changes too: it must not be sent.
    write_pattern(&site.path("src/data/b.log"), 5000, 99);
    let run = cp([
        OsString::from("--json"),
        "--exclude".into(),
        "*.log".into(),
        "--exclude".into(),
        "x.dat".into(),
        site.path("src/data").into(),
        site.server.url("sync"),
    ]);
    run.assert_ok();
    assert_eq!(
        fs::read(dest.join("b.log")).unwrap(),
        b"the destination's own"
    );
    assert!(!dest.join("raw/x.dat").exists(), "excluded: not sent again");
    assert!(dest.join("keep.log").exists(), "excluded: not deleted");
    // Everything else was up to date: nothing at all was sent.
    assert_eq!(run.json()["bytes"], 0, "{run:#?}");
    assert_eq!(run.json()["files_up_to_date"], 7, "{run:#?}");
}

/// The entries of a `--dry-run --json` listing, by path.
fn dry_listing(run: &Run) -> BTreeSet<String> {
    let json = run.json();
    assert_eq!(json["dry_run"], true);
    json["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "file")
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_dry_run_lists_what_would_move_and_writes_nothing() {
    let site = site_with_tree();
    let flags = ["--exclude", "*.txt", "--exclude", "raw/cache/"];
    let expected: BTreeSet<String> = [
        "b.log",
        "keep.log",
        "raw/x.dat",
        "raw/y.dat",
        "sub/deep/q.dat",
    ]
    .iter()
    .map(|f| format!("data/{f}"))
    .collect();
    let before = snapshot(site.root());

    let mut push: Vec<OsString> = vec!["--dry-run".into(), "--json".into()];
    push.extend(flags.iter().map(OsString::from));
    push.push(site.path("src/data").into());
    push.push(site.server.url("dry"));
    let run = cp(&push);
    run.assert_ok();
    assert_eq!(dry_listing(&run), expected);
    let json = run.json();
    let sizes: u64 = expected
        .iter()
        .map(|f| fs::metadata(site.path("src").join(f)).unwrap().len())
        .sum();
    assert_eq!(json["bytes"], sizes);
    assert_eq!(json["files"], expected.len());

    let pulled = site.path("dry-pull");
    let mut pull: Vec<OsString> = vec!["--dry-run".into(), "--json".into()];
    pull.extend(flags.iter().map(OsString::from));
    pull.push(site.server.url("data"));
    pull.push(pulled.clone().into());
    let run = cp(&pull);
    run.assert_ok();
    assert_eq!(dry_listing(&run), expected);

    // Text: one line an entry, directories with a slash, and a summary.
    let mut text: Vec<OsString> = vec!["-n".into()];
    text.extend(flags.iter().map(OsString::from));
    text.push(site.server.url("data"));
    text.push(pulled.clone().into());
    let run = cp(&text);
    run.assert_ok();
    assert!(run.stdout.lines().any(|l| l == "data/raw/"), "{run:#?}");
    assert!(
        run.stdout.lines().any(|l| l == "data/raw/x.dat"),
        "{run:#?}"
    );
    assert!(!run.stdout.contains("c.dat"), "{run:#?}");
    assert!(
        run.stdout
            .lines()
            .last()
            .unwrap()
            .contains("would send 5 files"),
        "{run:#?}"
    );

    // Nothing written on either side.
    assert_eq!(snapshot(site.root()), before);
    assert!(!pulled.exists());
    assert!(temp_files(site.root()).is_empty());
}

#[test]
fn selections_a_request_cannot_carry_are_refused_before_connecting() {
    let site = site_with_tree();
    let mut args: Vec<OsString> = Vec::new();
    for i in 0..=wanxfer_proto::MAX_SELECT_RULES {
        args.push("--exclude".into());
        args.push(format!("n{i}").into());
    }
    args.push(site.server.url("data"));
    args.push(site.path("too-many").into());
    cp(&args)
        .assert_code(2)
        .assert_stderr_mentions("a pull carries at most 1024");
    cp([
        OsString::from("--exclude"),
        "a[".into(),
        site.server.url("data"),
        site.path("bad-glob").into(),
    ])
    .assert_code(2)
    .assert_stderr_mentions("pattern \"a[\"");
    assert!(!site.path("too-many").exists());
}

#[test]
fn parents_creates_the_missing_directories_above_the_destination() {
    let site = site_with_tree();
    let src = site.path("src/data");
    // Without --parents a missing parent is the user's to fix.
    let run = cp([src.clone().into(), site.server.url("new/deep/copy")]);
    assert_ne!(run.code, 0, "{run:#?}");
    assert!(!site.root().join("new").exists());

    cp([
        OsString::from("--parents"),
        src.clone().into(),
        site.server.url("new/deep/copy"),
    ])
    .assert_ok();
    assert_same_tree(&src, &site.root().join("new/deep/copy"), false);
    // Again, into a trailing-slash directory whose parents now exist: no error.
    cp([
        OsString::from("--parents"),
        src.join("a.txt").into(),
        site.server.url("new/deep/more/"),
    ])
    .assert_ok();
    assert!(site.root().join("new/deep/more/a.txt").is_file());

    let local = site.path("local/a/b/copy");
    cp([
        OsString::from("--parents"),
        site.server.url("data"),
        local.clone().into(),
    ])
    .assert_ok();
    assert_same_tree(&site.root().join("data"), &local, false);

    // A file where a parent should be is an error, not a replacement.
    fs::write(site.root().join("blocker"), b"x").unwrap();
    let run = cp([
        OsString::from("--parents"),
        src.into(),
        site.server.url("blocker/copy"),
    ]);
    assert_ne!(run.code, 0, "{run:#?}");
    assert_eq!(fs::read(site.root().join("blocker")).unwrap(), b"x");
}
