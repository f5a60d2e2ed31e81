//! `cp --preserve` and `-a` end to end over loopback (issue 20, item 3): owners and
//! groups, `user.*` attributes and POSIX ACLs kept on the destination, pushed (the
//! server keeps them), pulled (the client does) and between two servers (the source
//! server reads them, the destination keeps them); nothing extra kept without the flag;
//! a destination that does not run as root lands the files and says, once, that owners
//! were not kept. Owners other than the test's own need root: as another user these
//! tests skip.

mod common;

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use rustix::fs::XattrFlags;

/// A POSIX ACL as the kernel stores it in `system.posix_acl_access`: version 2, then
/// (tag, permissions, id) sorted by tag: owner rw-, user 1234 r--, group r--, mask r--,
/// other ---. What `setfacl -m u:1234:r` would leave on a 0640 file.
fn acl_bytes() -> Vec<u8> {
    const UNDEFINED: u32 = u32::MAX;
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (0x01u16, 6u16, UNDEFINED),
        (0x02, 4, 1234),
        (0x04, 4, UNDEFINED),
        (0x10, 4, UNDEFINED),
        (0x20, 0, UNDEFINED),
    ] {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&id.to_le_bytes());
    }
    acl
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    rustix::fs::setxattr(path, name, value, XattrFlags::empty())
        .unwrap_or_else(|e| panic!("set {name} on {}: {e}", path.display()));
}

/// The attribute's value, `None` if the file has none of that name.
fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 65536];
    match rustix::fs::lgetxattr(path, name, &mut buf[..]) {
        Ok(len) => Some(buf[..len].to_vec()),
        Err(rustix::io::Errno::NODATA) => None,
        Err(e) => panic!("get {name} of {}: {e}", path.display()),
    }
}

fn user_xattrs(path: &Path) -> Vec<String> {
    let mut buf = vec![0u8; 65536];
    let len = rustix::fs::llistxattr(path, &mut buf[..]).unwrap();
    let mut names: Vec<String> = buf[..len]
        .split(|b| *b == 0)
        .filter(|n| n.starts_with(b"user."))
        .map(|n| String::from_utf8_lossy(n).into_owned())
        .collect();
    names.sort();
    names
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

/// Where the test's temporary directory takes `user.*` attributes and ACLs (ext4 and
/// tmpfs do); `false`, with a note, where it does not.
fn attributes_work(dir: &Path) -> bool {
    let probe = dir.join("probe");
    fs::write(&probe, b"").unwrap();
    let works = rustix::fs::setxattr(&probe, "user.probe", b"1", XattrFlags::empty()).is_ok()
        && rustix::fs::setxattr(
            &probe,
            "system.posix_acl_access",
            &acl_bytes(),
            XattrFlags::empty(),
        )
        .is_ok();
    fs::remove_file(&probe).unwrap();
    if !works {
        eprintln!(
            "skipped: {} takes no user.* attributes or ACLs",
            dir.display()
        );
    }
    works
}

/// A tree owned by others, with attributes and an ACL:
/// - `owned.txt` 1234:4321 with `user.origin`;
/// - `dir/` 2345:5432 with `user.dir`, and in it `dir/inner.bin` (two blocks' worth)
///   2346:6432 with two attributes;
/// - `acl.txt` with the ACL of [`acl_bytes`];
/// - `link`, a symlink owned by 3456:6543.
fn make_tree(at: &Path) {
    fs::create_dir_all(at.join("dir")).unwrap();
    let owned = at.join("owned.txt");
    write_pattern(&owned, 5000, 1);
    set_xattr(&owned, "user.origin", b"detector-7");
    chown(&owned, 1234, 4321);
    let inner = at.join("dir/inner.bin");
    write_pattern(&inner, 9 << 20, 2);
    set_xattr(&inner, "user.a", b"alpha");
    set_xattr(&inner, "user.b", &[0u8, 1, 2, 255]);
    chown(&inner, 2346, 6432);
    set_xattr(&at.join("dir"), "user.dir", b"d");
    chown(&at.join("dir"), 2345, 5432);
    let acl = at.join("acl.txt");
    write_pattern(&acl, 100, 3);
    set_mode(&acl, 0o640);
    set_xattr(&acl, "system.posix_acl_access", &acl_bytes());
    std::os::unix::fs::symlink("owned.txt", at.join("link")).unwrap();
    chown(&at.join("link"), 3456, 6543);
}

/// What [`make_tree`] made is all there at `copy`, kept.
#[track_caller]
fn assert_kept(copy: &Path) {
    let ids = |rel: &str| {
        let m = fs::symlink_metadata(copy.join(rel)).unwrap();
        (m.uid(), m.gid())
    };
    assert_eq!(ids("owned.txt"), (1234, 4321));
    assert_eq!(ids("dir"), (2345, 5432));
    assert_eq!(ids("dir/inner.bin"), (2346, 6432));
    assert_eq!(ids("link"), (3456, 6543));
    assert_eq!(
        xattr(&copy.join("owned.txt"), "user.origin").as_deref(),
        Some(&b"detector-7"[..])
    );
    assert_eq!(
        xattr(&copy.join("dir/inner.bin"), "user.b").as_deref(),
        Some(&[0u8, 1, 2, 255][..])
    );
    assert_eq!(
        user_xattrs(&copy.join("dir/inner.bin")),
        ["user.a", "user.b"]
    );
    assert_eq!(
        xattr(&copy.join("dir"), "user.dir").as_deref(),
        Some(&b"d"[..])
    );
    assert_eq!(
        xattr(&copy.join("acl.txt"), "system.posix_acl_access"),
        Some(acl_bytes())
    );
    let mode = fs::metadata(copy.join("acl.txt"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o640);
}

/// Nothing of what [`make_tree`] set beyond mode and mtime is at `copy`.
#[track_caller]
fn assert_not_kept(copy: &Path, uid: u32) {
    for rel in ["owned.txt", "dir", "dir/inner.bin", "acl.txt"] {
        let path = copy.join(rel);
        assert_eq!(fs::metadata(&path).unwrap().uid(), uid, "{rel}");
        assert!(user_xattrs(&path).is_empty(), "{rel}");
        assert_eq!(xattr(&path, "system.posix_acl_access"), None, "{rel}");
    }
}

/// A site with the tree at `src/data` beside the server's root, served with
/// `--accept-owners`; `None` (skipped) unless root, on a file system with attributes.
fn site() -> Option<Site> {
    site_with(&["--accept-owners"])
}

/// [`site`] with the server's flags `flags`.
fn site_with(flags: &[&str]) -> Option<Site> {
    if !is_root() {
        eprintln!("skipped: files owned by others need root");
        return None;
    }
    let site = Site::with_serve_flags(flags);
    if !attributes_work(site.dir.path()) {
        return None;
    }
    make_tree(&site.path("src/data"));
    Some(site)
}

fn args(flags: &[&str], from: impl Into<OsString>, to: impl Into<OsString>) -> Vec<OsString> {
    let mut args: Vec<OsString> = flags.iter().map(OsString::from).collect();
    args.push(from.into());
    args.push(to.into());
    args
}

#[test]
fn preserve_keeps_owners_attributes_and_acls_pushed_and_pulled() {
    let Some(site) = site() else { return };
    let src = site.path("src/data");
    let flags = ["--preserve", "owner,group", "--preserve=xattrs,acls"];
    cp(args(&flags, &src, site.server.url("pushed"))).assert_ok();
    let pushed = site.root().join("pushed");
    assert_same_tree(&src, &pushed, false);
    assert_kept(&pushed);

    // Pulled back with -a: the server reads what it keeps, the client applies it.
    let pulled = site.path("pulled");
    cp(args(&["-a"], site.server.url("pushed"), &pulled)).assert_ok();
    assert_same_tree(&src, &pulled, false);
    assert_kept(&pulled);

    // A re-run finds everything in place, and puts back what was changed since.
    chown(&pulled.join("owned.txt"), 0, 0);
    set_xattr(&pulled.join("owned.txt"), "user.extra", b"x");
    let again = cp(args(&["-a", "--json"], site.server.url("pushed"), &pulled));
    again.assert_ok();
    // Three files and the symlink (directories are not counted).
    assert_eq!(again.json()["files_up_to_date"], 4, "{again:#?}");
    assert_kept(&pulled);
    assert_eq!(user_xattrs(&pulled.join("owned.txt")), ["user.origin"]);
}

/// The note a root server without `--accept-owners` sends a client pushing owners.
const NOT_ACCEPTED: &str = "owner and group not kept: the server keeps pushed files owned by \
                            itself; start it with --accept-owners (accept_owners = true in \
                            its configuration) to keep the owners clients send";

#[test]
fn a_root_server_keeps_pushed_files_its_own_unless_told_to_accept_owners() {
    let Some(site) = site_with(&[]) else { return };
    let src = site.path("src/data");
    let run = cp_with_notes(args(&["-a"], &src, site.server.url("pushed")));
    run.assert_ok();
    assert_eq!(run.stderr.matches(NOT_ACCEPTED).count(), 1, "{run:#?}");
    let pushed = site.root().join("pushed");
    assert_same_tree(&src, &pushed, false);
    // The server's own, everything else kept.
    for rel in ["owned.txt", "dir", "dir/inner.bin", "acl.txt", "link"] {
        let m = fs::symlink_metadata(pushed.join(rel)).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0), "{rel}");
    }
    assert_eq!(
        user_xattrs(&pushed.join("dir/inner.bin")),
        ["user.a", "user.b"]
    );
    assert_eq!(
        xattr(&pushed.join("acl.txt"), "system.posix_acl_access"),
        Some(acl_bytes())
    );

    // Pulls are not the server's to refuse: the client, as root, keeps the owners.
    fs::create_dir_all(site.root().join("orig")).unwrap();
    make_tree(&site.root().join("orig/data"));
    let pulled = site.path("pulled");
    let run = cp_with_notes(args(&["-a"], site.server.url("orig/data"), &pulled));
    run.assert_ok();
    assert!(!run.stderr.contains("not kept"), "{run:#?}");
    assert_kept(&pulled);

    // accept_owners in the configuration file is --accept-owners.
    let config = site.path("wanxfer.toml");
    fs::write(&config, "accept_owners = true\n").unwrap();
    let accepting_root = site.path("accepting");
    fs::create_dir(&accepting_root).unwrap();
    let accepting = Server::start(&accepting_root, &["--config", config.to_str().unwrap()]);
    let run = cp_with_notes(args(&["-a"], &src, accepting.url("pushed")));
    run.assert_ok();
    assert!(!run.stderr.contains("not kept"), "{run:#?}");
    assert_kept(&accepting_root.join("pushed"));
}

#[test]
fn without_preserve_only_modes_and_times_are_kept() {
    let Some(site) = site() else { return };
    let src = site.path("src/data");
    cp(args(&[], &src, site.server.url("plain"))).assert_ok();
    let pushed = site.root().join("plain");
    assert_same_tree(&src, &pushed, false);
    assert_not_kept(&pushed, 0);
    let pulled = site.path("plain-pulled");
    fs::create_dir_all(site.root().join("orig")).unwrap();
    make_tree(&site.root().join("orig/data"));
    cp(args(&[], site.server.url("orig/data"), &pulled)).assert_ok();
    assert_not_kept(&pulled, 0);
    // Asked for attributes only: owners stay the receiver's.
    let xattrs_only = site.path("xattrs-only");
    cp(args(
        &["--preserve", "xattrs"],
        site.server.url("orig/data"),
        &xattrs_only,
    ))
    .assert_ok();
    let inner = xattrs_only.join("dir/inner.bin");
    assert_eq!(fs::metadata(&inner).unwrap().uid(), 0);
    assert_eq!(user_xattrs(&inner), ["user.a", "user.b"]);
    assert_eq!(
        xattr(&xattrs_only.join("acl.txt"), "system.posix_acl_access"),
        None
    );
}

/// `setpriv` as `nobody`, with a home of its own for state and pinned certificates.
fn as_nobody(home: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(wanxfer_bin())
        .env("WANXFER_STATE_DIR", home.join("state"));
    cmd
}

fn nobody_dir(path: PathBuf) -> PathBuf {
    fs::create_dir_all(&path).unwrap();
    chown(&path, 65534, 65534);
    path
}

#[test]
fn a_destination_not_running_as_root_keeps_the_rest_and_notes_owners_once() {
    let Some(site) = site() else { return };
    // `nobody` must reach its directories through the test's private one.
    fs::set_permissions(site.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let home = nobody_dir(site.path("nobody"));
    let dest = nobody_dir(home.join("dest"));
    fs::create_dir_all(site.root().join("orig")).unwrap();
    make_tree(&site.root().join("orig/data"));
    let mut cmd = as_nobody(&home);
    cmd.args(["cp", "--json"])
        .arg("-a")
        .arg(site.server.url("orig/data"))
        .arg(&dest)
        .env("WANXFER_SECRET", SECRET);
    let run = Run::from_cmd(cmd);
    run.assert_ok();
    let notes = run.json()["notes"].clone();
    let notes: Vec<String> = serde_json::from_value(notes).unwrap();
    let about_owners: Vec<&String> = notes.iter().filter(|n| n.contains("owner")).collect();
    assert_eq!(about_owners.len(), 1, "{notes:?}");
    assert!(about_owners[0].contains("not run as root"), "{notes:?}");
    let copy = dest.join("data");
    assert_same_tree(&site.root().join("orig/data"), &copy, false);
    let inner = copy.join("dir/inner.bin");
    assert_eq!(fs::metadata(&inner).unwrap().uid(), 65534);
    assert_eq!(user_xattrs(&inner), ["user.a", "user.b"]);
    assert_eq!(
        xattr(&copy.join("acl.txt"), "system.posix_acl_access"),
        Some(acl_bytes())
    );

    // Pushing to a server that does not run as root: the client says so, once.
    let served = nobody_dir(site.path("nobody/served"));
    let mut serve = as_nobody(&home);
    serve.args(["serve", "--listen", "127.0.0.1:0"]);
    let (cert, key) = test_identity();
    let identity = nobody_dir(site.path("nobody/identity"));
    for (from, name) in [(cert, "cert.pem"), (key, "key.pem")] {
        fs::copy(&from, identity.join(name)).unwrap();
        chown(&identity.join(name), 65534, 65534);
    }
    let server_state = nobody_dir(home.join("server-state"));
    let server = Server::start_with(
        serve,
        &served,
        &[
            "--state-dir",
            server_state.to_str().unwrap(),
            "--cert",
            identity.join("cert.pem").to_str().unwrap(),
            "--key",
            identity.join("key.pem").to_str().unwrap(),
        ],
    );
    let run = cp_with_notes(args(&["-a"], site.path("src/data"), server.url("in")));
    run.assert_ok();
    assert_eq!(
        run.stderr.matches("owner and group not kept").count(),
        1,
        "{run:#?}"
    );
    assert!(run.stderr.contains("does not run as root"), "{run:#?}");
    let copy = served.join("in");
    assert_eq!(fs::metadata(copy.join("owned.txt")).unwrap().uid(), 65534);
    assert_eq!(
        user_xattrs(&copy.join("dir/inner.bin")),
        ["user.a", "user.b"]
    );
}

/// What a copy between two servers is given to keep, at `at`: [`make_sparse`]'s files in
/// `sparse/`, a file with `user.*` attributes and a second name for it, and as root
/// [`make_tree`] in `owned/`.
/// `false` (skipped, with a note) where the file system keeps no holes or attributes.
fn make_tpc_tree(at: &Path) -> bool {
    fs::create_dir_all(at).unwrap();
    if !make_sparse(&at.join("sparse")) || !attributes_work(at) {
        return false;
    }
    let tagged = at.join("tagged.bin");
    write_pattern(&tagged, 3 << 20, 5);
    set_xattr(&tagged, "user.run", b"2026-11-24");
    set_xattr(&tagged, "user.checksum.adler32", b"0a1b2c3d");
    fs::hard_link(&tagged, at.join("tagged-too.bin")).unwrap();
    if is_root() {
        make_tree(&at.join("owned"));
    }
    true
}

/// The client's own connections carried requests, progress and the summary: a few
/// kilobytes, while megabytes went from one server to the other.
#[track_caller]
fn assert_client_moved_no_data(run: &Run) {
    let v = run.json();
    let t = &v["third_party"];
    let (sent, received) = (
        t["client_tcp_bytes_sent"].as_u64().unwrap(),
        t["client_tcp_bytes_received"].as_u64().unwrap(),
    );
    assert!(sent > 0 && received > 0, "the counters count: {t}");
    assert!(sent + received < 64 << 10, "{run:#?}");
    assert!(v["bytes"].as_u64().unwrap() > 3 << 20, "{run:#?}");
}

/// `cp -a wanxfer://A/x wanxfer://B/y` (issue 20, items 2 and 3): the source server reads
/// the metadata and the data ranges, the destination keeps them as in a push, and the
/// client moves none of the data.
#[test]
fn preserve_between_two_servers_keeps_it_all_and_the_client_moves_no_data() {
    let dest = Site::with_serve_flags(&["--accept-owners"]);
    let source_root = dest.path("a");
    if !make_tpc_tree(&source_root.join("data")) {
        return;
    }
    let source = Server::start(&source_root, &[]);
    let run = cp(args(
        &["-a", "--json", "--block-size", "1MiB"],
        source.url("data"),
        dest.server.url("copy"),
    ));
    run.assert_ok();
    assert_client_moved_no_data(&run);
    let (src, copy) = (source_root.join("data"), dest.root().join("copy"));
    assert_same_tree(&src, &copy, false);
    assert_eq!(
        user_xattrs(&copy.join("tagged.bin")),
        ["user.checksum.adler32", "user.run"]
    );
    assert_eq!(
        xattr(&copy.join("tagged.bin"), "user.run").as_deref(),
        Some(&b"2026-11-24"[..])
    );
    assert!(
        allocated(&copy.join("sparse/sparse.img")) < 1 << 20,
        "{run:#?}"
    );
    assert_eq!(allocated(&copy.join("sparse/hole.img")), 0);
    let inode = |p: &Path| fs::metadata(p).unwrap().ino();
    assert_eq!(
        inode(&copy.join("tagged.bin")),
        inode(&copy.join("tagged-too.bin")),
        "one file under two names"
    );
    // Only the data ranges travelled: no 64 MiB of zeros.
    assert!(run.json()["bytes"].as_u64().unwrap() < 32 << 20, "{run:#?}");
    if is_root() {
        assert_kept(&copy.join("owned"));
    } else {
        eprintln!("owners not checked: files owned by others need root");
    }

    // Without --preserve the same servers keep none of it.
    let run = cp(args(
        &["--json", "--block-size", "1MiB"],
        source.url("data"),
        dest.server.url("plain"),
    ));
    run.assert_ok();
    assert_client_moved_no_data(&run);
    let plain = dest.root().join("plain");
    assert_same_tree(&src, &plain, false);
    assert!(user_xattrs(&plain.join("tagged.bin")).is_empty());
    assert_ne!(
        fs::metadata(plain.join("tagged.bin")).unwrap().ino(),
        fs::metadata(plain.join("tagged-too.bin")).unwrap().ino()
    );
    assert!(allocated(&plain.join("sparse/sparse.img")) >= SPARSE_SIZE);
    if is_root() {
        assert_not_kept(&plain.join("owned"), 0);
    }
}

/// A destination that keeps no owners (not root, or root without --accept-owners) lands
/// the rest and says so once, through the source to the client, as it does to a pushing
/// client.
#[test]
fn preserve_between_two_servers_notes_owners_the_destination_does_not_keep() {
    let dest = Site::new();
    let source_root = dest.path("a");
    if !make_tpc_tree(&source_root.join("data")) {
        return;
    }
    let source = Server::start(&source_root, &[]);
    let run = cp_with_notes(args(&["-a"], source.url("data"), dest.server.url("copy")));
    run.assert_ok();
    let expected = if is_root() {
        NOT_ACCEPTED
    } else {
        "owner and group not kept: the server does not run as root"
    };
    assert_eq!(run.stderr.matches(expected).count(), 1, "{run:#?}");
    assert_eq!(
        run.stderr.matches("owner and group not kept").count(),
        1,
        "{run:#?}"
    );
    let copy = dest.root().join("copy");
    assert_same_tree(&source_root.join("data"), &copy, false);
    assert_eq!(
        user_xattrs(&copy.join("tagged.bin")),
        ["user.checksum.adler32", "user.run"]
    );
    assert!(allocated(&copy.join("sparse/sparse.img")) < 1 << 20);
    if is_root() {
        let inner = fs::metadata(copy.join("owned/dir/inner.bin")).unwrap();
        assert_eq!((inner.uid(), inner.gid()), (0, 0));
    }
}

#[test]
fn a_destination_without_attributes_lands_the_files_and_the_server_notes_it_once() {
    let Some(site) = site() else { return };
    // ramfs keeps no extended attributes: every set is refused with ENOTSUP.
    let Some(ramfs) = Site::on_mount("ramfs", "mode=755", &["--accept-owners"]) else {
        return;
    };
    let src = site.path("src/data");
    let run = cp_with_notes(args(&["-a"], &src, ramfs.server.url("in")));
    run.assert_ok();
    let noted = "extended attributes and ACLs not kept: the destination's file system does \
                 not support them";
    assert_eq!(run.stderr.matches(noted).count(), 1, "{run:#?}");
    // The note names the file as the client knows it, not where the server keeps it.
    let served = ramfs.root().display().to_string();
    assert!(!run.stderr.contains(&served), "{run:#?}");
    let copy = ramfs.root().join("in");
    assert_same_tree(&src, &copy, false);
    // Owners are still kept: the server runs as root.
    assert_eq!(
        fs::metadata(copy.join("dir/inner.bin")).unwrap().uid(),
        2346
    );
}

/// A 64 MiB file with two small data extents, the second at the very end, and a file
/// that is all hole, in `at`; `false` (skipped, with a note) where the file system
/// does not report holes.
fn make_sparse(at: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    fs::create_dir_all(at).unwrap();
    let f = fs::File::create(at.join("sparse.img")).unwrap();
    f.set_len(SPARSE_SIZE).unwrap();
    f.write_all_at(&[7u8; 100_000], 5 << 20).unwrap();
    f.write_all_at(&[9u8; 3000], SPARSE_SIZE - 3000).unwrap();
    fs::File::create(at.join("hole.img"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    write_pattern(&at.join("dense.txt"), 5000, 4);
    let blocks = fs::metadata(at.join("sparse.img")).unwrap().blocks();
    if blocks * 512 > 1 << 20 {
        eprintln!("skipped: {} keeps no holes", at.display());
        return false;
    }
    true
}

const SPARSE_SIZE: u64 = 64 << 20;

/// `run` moved the data extents of [`make_sparse`]'s files, `data` bytes rounded out to
/// the file system's blocks, and no more.
#[track_caller]
fn assert_data_only(run: &Run, data: u64) {
    let bytes = run.json()["bytes"].as_u64().unwrap();
    assert!(data <= bytes && bytes < data + (64 << 10), "{run:#?}");
}

/// Bytes `path` has allocated.
fn allocated(path: &Path) -> u64 {
    fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn sparse_files_keep_their_holes_pushed_and_pulled_and_only_data_travels() {
    let site = Site::new();
    let src = site.path("src/data");
    if !make_sparse(&src) {
        return;
    }
    let data_bytes = 100_000 + 3000 + 5000;
    let run = cp(args(
        &["--preserve", "sparse", "--json"],
        &src,
        site.server.url("pushed"),
    ));
    run.assert_ok();
    let pushed = site.root().join("pushed");
    assert_same_tree(&src, &pushed, false);
    assert!(allocated(&pushed.join("sparse.img")) < 1 << 20, "{run:#?}");
    assert_eq!(allocated(&pushed.join("hole.img")), 0);
    assert_data_only(&run, data_bytes);

    let pulled = site.path("pulled");
    let run = cp(args(&["-a", "--json"], site.server.url("pushed"), &pulled));
    run.assert_ok();
    assert_same_tree(&src, &pulled, false);
    assert!(allocated(&pulled.join("sparse.img")) < 1 << 20, "{run:#?}");
    assert_eq!(allocated(&pulled.join("hole.img")), 0);
    assert_data_only(&run, data_bytes);

    // Without it, holes travel as zeros and land allocated.
    let dense = site.path("dense");
    let run = cp(args(&["--json"], site.server.url("pushed"), &dense));
    run.assert_ok();
    assert_same_tree(&src, &dense, false);
    assert_eq!(
        run.json()["bytes"],
        SPARSE_SIZE + (1 << 20) + 5000,
        "{run:#?}"
    );
    assert!(allocated(&dense.join("sparse.img")) >= SPARSE_SIZE);
}

/// Issue 20 (--preserve hardlinks): one file with three names in two directories
/// (`a/one`, `a/two`, `b/three`, written in that order) and an unrelated file
/// (`b/other`); the bytes a transfer moves if the linked file's data travels once.
fn make_linked(at: &Path) -> u64 {
    fs::create_dir_all(at.join("a")).unwrap();
    fs::create_dir_all(at.join("b")).unwrap();
    write_pattern(&at.join("a/one"), LINKED_SIZE, 11);
    fs::hard_link(at.join("a/one"), at.join("a/two")).unwrap();
    fs::hard_link(at.join("a/one"), at.join("b/three")).unwrap();
    write_pattern(&at.join("b/other"), 70_000, 12);
    LINKED_SIZE + 70_000
}

const LINKED_SIZE: u64 = 3 << 20;
const LINKED_NAMES: [&str; 3] = ["a/one", "a/two", "b/three"];

/// The inode and link count of each of the three names of [`make_linked`]'s file
/// under `at`.
fn inodes(at: &Path) -> Vec<(u64, u64)> {
    LINKED_NAMES
        .iter()
        .map(|name| {
            let meta = fs::metadata(at.join(name)).unwrap();
            (meta.ino(), meta.nlink())
        })
        .collect()
}

#[track_caller]
fn assert_linked(at: &Path, run: &Run) {
    let got = inodes(at);
    assert!(
        got.iter()
            .all(|&(ino, nlink)| ino == got[0].0 && nlink == 3),
        "{got:?} under {}: {run:#?}",
        at.display()
    );
    assert_eq!(fs::metadata(at.join("b/other")).unwrap().nlink(), 1);
}

#[track_caller]
fn assert_not_linked(at: &Path) {
    let got = inodes(at);
    assert!(got.iter().all(|&(_, nlink)| nlink == 1), "{got:?}");
}

#[test]
fn hard_links_land_as_links_pushed_and_pulled_and_their_data_travels_once() {
    let site = Site::new();
    let src = site.path("src/data");
    let once = make_linked(&src);
    // Within a KiB of one copy of the data: the two other names move nothing.
    let assert_once = |run: &Run| {
        let bytes = run.json()["bytes"].as_u64().unwrap();
        assert!(once <= bytes && bytes < once + 1024, "{bytes}: {run:#?}");
    };

    let run = cp(args(
        &["--preserve", "hardlinks", "--json"],
        &src,
        site.server.url("pushed"),
    ));
    run.assert_ok();
    let pushed = site.root().join("pushed");
    assert_same_tree(&src, &pushed, false);
    assert_linked(&pushed, &run);
    assert_once(&run);

    let pulled = site.path("pulled");
    let run = cp(args(&["-a", "--json"], site.server.url("pushed"), &pulled));
    run.assert_ok();
    assert_same_tree(&src, &pulled, false);
    assert_linked(&pulled, &run);
    assert_once(&run);

    // Again: everything is in place, links included.
    let run = cp(args(
        &["--preserve", "hardlinks", "--json"],
        &src,
        site.server.url("pushed"),
    ));
    run.assert_ok();
    assert_eq!(run.json()["bytes"], 0, "{run:#?}");
    assert_linked(&pushed, &run);

    // Without it, each name is a file of its own, and its data travels three times.
    let plain = site.root().join("plain");
    let run = cp(args(&["--json"], &src, site.server.url("plain")));
    run.assert_ok();
    assert_same_tree(&src, &plain, false);
    assert_not_linked(&plain);
    assert_eq!(run.json()["bytes"], once + 2 * LINKED_SIZE, "{run:#?}");
    // ... and asked for later, the independent copies in place become links (each
    // replaced in one step), with no data sent.
    let run = cp(args(
        &["--preserve", "hardlinks", "--json"],
        &src,
        site.server.url("plain"),
    ));
    run.assert_ok();
    assert_same_tree(&src, &plain, false);
    assert_linked(&plain, &run);
    assert_eq!(run.json()["bytes"], 0, "{run:#?}");
    assert!(
        temp_files(site.root()).is_empty(),
        "{:?}",
        temp_files(site.root())
    );
}

#[test]
fn a_dry_run_lists_the_other_names_of_a_file_as_links_to_its_first() {
    let site = Site::new();
    let src = site.path("src/data");
    let once = make_linked(&src);
    let run = cp(args(
        &["--dry-run", "--preserve", "hardlinks", "--json"],
        &src,
        site.server.url("x"),
    ));
    run.assert_ok();
    let listed = run.json();
    let links: Vec<&serde_json::Value> = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "hardlink")
        .collect();
    assert_eq!(links.len(), 2, "{listed:#}");
    let first = links[0]["link_to"].as_str().unwrap();
    assert!(links.iter().all(|l| l["link_to"] == first), "{listed:#}");
    let names: Vec<String> = LINKED_NAMES.iter().map(|n| format!("data/{n}")).collect();
    assert!(names.iter().any(|n| n == first), "{listed:#}");
    assert_eq!(listed["files"], 4);
    assert_eq!(listed["bytes"], once, "{listed:#}");
    // As text, rsync's way: `name => first name`.
    let run = cp(args(
        &["--dry-run", "--preserve", "hardlinks"],
        &src,
        site.server.url("x"),
    ));
    run.assert_ok();
    let arrows = run
        .stdout
        .lines()
        .filter(|l| l.ends_with(&format!(" => {first}")));
    assert_eq!(arrows.count(), 2, "{}", run.stdout);
    // Without it, they are files.
    let run = cp(args(&["--dry-run", "--json"], &src, site.server.url("x")));
    assert_eq!(run.assert_ok().json()["bytes"], once + 2 * LINKED_SIZE);
}

/// Many plain files and a few with several names (`features::LINK_TARGETS`): the few
/// land linked, pushed and pulled with `-a`, and the receiver remembers only the first
/// name of each linked file, not every file entry (its debug line says how many).
#[test]
fn among_many_plain_files_the_receiver_remembers_only_the_linked_ones() {
    const PLAIN: usize = 2000;
    let site = Site::new();
    let src = site.path("src/data");
    for d in 0..4 {
        fs::create_dir_all(src.join(format!("d{d}"))).unwrap();
    }
    for i in 0..PLAIN {
        fs::write(src.join(format!("d{}/f{i}", i % 4)), format!("plain {i}\n")).unwrap();
    }
    // Three files: two names, three names (in two directories), two names.
    let groups: [&[&str]; 3] = [
        &["d0/g0", "d1/g0-too"],
        &["d1/g1", "d2/g1-too", "d3/g1-also"],
        &["d3/g2", "d3/g2-too"],
    ];
    for (g, names) in groups.iter().enumerate() {
        write_pattern(&src.join(names[0]), 100_000 + g as u64, 20 + g as u64);
        for name in &names[1..] {
            fs::hard_link(src.join(names[0]), src.join(name)).unwrap();
        }
    }
    let assert_groups = |at: &Path, run: &Run| {
        for names in groups {
            let metas: Vec<_> = names
                .iter()
                .map(|n| fs::metadata(at.join(n)).unwrap())
                .collect();
            assert!(
                metas
                    .iter()
                    .all(|m| m.ino() == metas[0].ino() && m.nlink() == names.len() as u64),
                "{names:?} under {}: {run:#?}",
                at.display()
            );
        }
        assert_eq!(fs::metadata(at.join("d2/f2")).unwrap().nlink(), 1);
    };
    let files = PLAIN + groups.iter().map(|g| g.len()).sum::<usize>();

    let run = cp(args(&["-a", "--json"], &src, site.server.url("pushed")));
    run.assert_ok();
    let pushed = site.root().join("pushed");
    assert_same_tree(&src, &pushed, false);
    assert_groups(&pushed, &run);
    assert_eq!(run.json()["files"], files as u64, "{run:#?}");

    // Pulled, the receiver is this side, whose debug line the test can read.
    let pulled = site.path("pulled");
    let mut cmd = cp_command(args(&["-a", "--json"], site.server.url("pushed"), &pulled));
    cmd.env("RUST_LOG", "wanxfer_engine::links=debug");
    let run = Run::from_cmd(cmd);
    run.assert_ok();
    assert_same_tree(&src, &pulled, false);
    assert_groups(&pulled, &run);
    // Each linked file's first name; its other names link to it, and travel no data.
    let plain_files = PLAIN + groups.len();
    let line = format!(
        "hardlinks: remembered {} of {plain_files} file entries (those marked as link targets)",
        groups.len()
    );
    run.assert_stderr_mentions(&line);
}

/// Issue 20 (--preserve hardlinks): a push killed while the linked file's data is on its
/// way finishes on a re-run with the file's names linked.
#[test]
fn an_interrupted_push_of_hard_links_finishes_with_the_links_in_place() {
    let site = Site::new();
    let src = site.path("src/data");
    fs::create_dir_all(src.join("a")).unwrap();
    fs::create_dir_all(src.join("b")).unwrap();
    write_pattern(&src.join("a/one"), 24 << 20, 13);
    fs::hard_link(src.join("a/one"), src.join("a/two")).unwrap();
    fs::hard_link(src.join("a/one"), src.join("b/three")).unwrap();
    write_pattern(&src.join("b/other"), 70_000, 14);
    // Paced (40 Mbit/s: about 5 s) so that the kill lands while the data moves.
    let args = args(
        &[
            "--preserve",
            "hardlinks",
            "--json",
            "--rate",
            "40M",
            "--retries",
            "0",
        ],
        &src,
        site.server.url("pushed"),
    );
    let mut client = spawn_piped(cp_command(&args));
    let pushed = site.root().join("pushed");
    wait_for(
        "the file's data to start landing",
        Duration::from_secs(60),
        || !temp_files(site.root()).is_empty() || pushed.join("a/one").exists(),
    );
    client.kill().unwrap();
    let _ = client.wait();
    assert!(!pushed.join("b/three").exists(), "the transfer ended first");
    let run = cp(&args);
    run.assert_ok();
    assert_same_tree(&src, &pushed, false);
    assert_linked(&pushed, &run);
    assert!(temp_files(site.root()).is_empty());
}

/// A 256 MiB file holding eight 2 MiB data extents spread over it (the last at its very
/// end); `None` (skipped, with a note) where the file system does not keep holes.
fn make_big_sparse(path: &Path) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    const EXTENT: usize = 2 << 20;
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let f = fs::File::create(path).unwrap();
    f.set_len(BIG_SPARSE_SIZE).unwrap();
    let step = BIG_SPARSE_SIZE / 8;
    for i in 0..8u64 {
        let at = i * step + step - EXTENT as u64;
        f.write_all_at(&pattern_bytes(EXTENT, i as usize + 1), at)
            .unwrap();
    }
    let data = 8 * EXTENT as u64;
    if allocated(path) > 2 * data {
        eprintln!("skipped: {} keeps no holes", path.display());
        return None;
    }
    Some(data)
}

const BIG_SPARSE_SIZE: u64 = 256 << 20;

/// Issue 20 (--preserve sparse): an interrupted push of a sparse file resumes from what
/// the receiver kept, and lands identical and still sparse; the re-run sends only the
/// data that had not arrived, never the holes.
#[test]
fn an_interrupted_sparse_push_resumes_with_only_the_missing_data_and_stays_sparse() {
    let site = Site::new();
    let src = site.path("src/big.img");
    let Some(data) = make_big_sparse(&src) else {
        return;
    };
    let dest = site.root().join("big.img");
    // Paced (40 Mbit/s: the data takes about 3.4 s) so that the kill lands part way.
    let args = args(
        &[
            "--preserve",
            "sparse",
            "--json",
            "--rate",
            "40M",
            "--retries",
            "0",
        ],
        &src,
        site.server.url("big.img"),
    );
    let mut client = spawn_piped(cp_command(&args));
    // Killed once the server's temporary holds some of the data, but not all of it.
    let part_way = || {
        temp_files(site.root())
            .iter()
            .any(|t| fs::metadata(t).is_ok_and(|m| m.blocks() * 512 >= 4 << 20))
    };
    wait_for("part of the data to land", Duration::from_secs(60), || {
        part_way() || dest.exists()
    });
    client.kill().unwrap();
    let _ = client.wait();
    assert!(!dest.exists(), "the transfer ended before the kill");
    wait_for(
        "the server to keep the partial file",
        Duration::from_secs(60),
        || site.server.log().contains("partial files kept"),
    );
    let kept = temp_files(site.root());
    assert_eq!(kept.len(), 1, "{kept:?}");
    // Only data was written, and the holes stayed holes in the partial file too.
    assert!(allocated(Path::new(&kept[0])) < data, "{kept:?}");

    let run = cp(&args);
    let json = run.assert_ok().json();
    let (sent, held) = (
        json["bytes"].as_u64().unwrap(),
        json["bytes_skipped"].as_u64().unwrap(),
    );
    assert!(held > 0 && sent < data, "{json}");
    // What was held plus what was sent is the data, once: no hole travelled.
    assert_eq!(sent + held, data, "{json}");
    assert_eq!(node(&src), node(&dest), "content, size, mode and mtime");
    assert!(
        allocated(&dest) < 2 * data,
        "{} allocated",
        allocated(&dest)
    );
    assert!(temp_files(site.root()).is_empty());
}

/// Issue 20 (--preserve hardlinks): where the destination cannot link a name (here its
/// directory is another file system, so `link` fails with EXDEV), the name gets a copy
/// of the data and the transfer says so once. Needs root to mount; skips otherwise.
#[test]
fn a_name_the_destination_cannot_link_is_copied_with_a_note() {
    let site = Site::new();
    let src = site.path("src/data");
    make_linked(&src);
    let landed = site.root().join("pushed/data");
    fs::create_dir_all(landed.join("b")).unwrap();
    let Some(_other_fs) = Mount::new(landed.join("b"), "tmpfs", "size=16m") else {
        return;
    };
    let run = cp(args(
        &["--preserve", "hardlinks", "--json"],
        &src,
        site.server.url("pushed"),
    ));
    let json = run.assert_ok().json();
    assert_same_tree(&src, &landed, false);
    // Which name is first depends on the source directory's order: a/one and a/two
    // are linked when an a/ name is (b/three then a copy), copies both otherwise.
    let got = inodes(&landed);
    assert_eq!(got[2].1, 1, "b/three alone: {got:?}");
    assert!(
        got[0] == (got[1].0, 2) || (got[0].1 == 1 && got[1].1 == 1),
        "{got:?}"
    );
    let notes = json["notes"].to_string();
    assert!(notes.contains("hard links not kept"), "{json}");
    assert_eq!(
        json["notes"].as_array().map(Vec::len),
        Some(1),
        "once: {json}"
    );
    assert!(
        !notes.contains(&site.root().display().to_string()),
        "{notes}"
    );
}
