//! "Verified" means on disk. A receiver acknowledges a file only once its data and its
//! name are durable, so an image of the receiving file system taken the moment the
//! client exits 0 (what a power cut at that moment would leave, once its journal is
//! replayed) holds every file the client reported, whole.
//!
//! The image is a loop-mounted ext4 file: copying the backing file reads what the file
//! system has written to its device, not what sits dirty in its page cache.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;

use common::*;

/// One 300 MiB file and 500 small ones, as in the trial.
fn tree(at: &Path) {
    fs::create_dir_all(at.join("small")).unwrap();
    write_pattern(&at.join("large.bin"), 300 << 20, 1);
    for i in 0..500 {
        fs::write(
            at.join(format!("small/{i:03}")),
            pattern_bytes(1 + i * 37 % 9000, i),
        )
        .unwrap();
    }
}

/// Copies `image` as it is on its device right now, mounts the copy (replaying its
/// journal) and returns the files of `rel` in it that are not whole, with the copy's
/// mount (for the caller to drop).
fn crash_image(image: &Path, scratch: &Path, src: &Path, rel: &str) -> Vec<String> {
    let copy = scratch.join("crash.img");
    let status = Command::new("cp")
        .args(["--sparse=always"])
        .arg(image)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(status.success());
    let Some(mounted) = Mount::loop_image(&copy, scratch.join("crash")) else {
        panic!("the copy of a mountable image mounts");
    };
    let mut broken = Vec::new();
    for (name, node) in snapshot(src) {
        let name = String::from_utf8(name).unwrap();
        let there = mounted.path.join(rel).join(&name);
        let whole = fs::symlink_metadata(&there).is_ok() && node == common::node(&there);
        if !whole && !matches!(node, Node::Dir { .. }) {
            broken.push(name);
        }
    }
    drop(mounted);
    let _ = fs::remove_file(&copy);
    broken
}

#[test]
fn a_pushed_tree_is_whole_in_a_crash_image_taken_at_exit() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("server.img");
    let Some(disk) = Mount::ext4_image(&image, 1 << 30, dir.path().join("root")) else {
        return;
    };
    let src = dir.path().join("src");
    tree(&src);
    // Scratch first (a server that does not sync), to show what the check catches;
    // then the default.
    for (flags, dest) in [(&["--no-fsync"][..], "scratch"), (&[][..], "synced")] {
        let server = Server::start(&disk.path, flags);
        cp([src.as_os_str(), &server.url(dest)]).assert_ok();
        let broken = crash_image(&image, dir.path(), &src, dest);
        eprintln!(
            "push {dest}: {} of 501 files not whole in the crash image",
            broken.len()
        );
        if dest == "synced" {
            assert!(broken.is_empty(), "not durable at exit: {broken:?}");
        }
    }
}

#[test]
fn a_pulled_tree_is_whole_in_a_crash_image_taken_at_exit() {
    let site = Site::new();
    let src = site.root().join("src");
    tree(&src);
    let image = site.path("client.img");
    let Some(disk) = Mount::ext4_image(&image, 1 << 30, site.path("disk")) else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    for (flags, dest) in [(&["--no-fsync"][..], "scratch"), (&[][..], "synced")] {
        let mut args: Vec<std::ffi::OsString> = flags.iter().map(Into::into).collect();
        args.extend([site.server.url("src"), disk.path.join(dest).into()]);
        cp(&args).assert_ok();
        let broken = crash_image(&image, scratch.path(), &src, dest);
        eprintln!(
            "pull {dest}: {} of 501 files not whole in the crash image",
            broken.len()
        );
        if dest == "synced" {
            assert!(broken.is_empty(), "not durable at exit: {broken:?}");
        }
    }
}
