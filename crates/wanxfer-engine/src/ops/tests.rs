//! The executor against real directories, without sockets: every operation, and every
//! way a planted symlink or a reserved name could take it somewhere it must not go.

use std::fs as stdfs;
use std::os::unix::fs::{symlink, PermissionsExt};

use wanxfer_proto::ops::{ChecksumAlgorithm, ListPage, NodeKind, OpFailure, RemoveMode};
use wanxfer_proto::RelPath;

use super::*;

fn rel(s: &str) -> RelPath {
    RelPath::new(s.as_bytes()).unwrap()
}

/// A served root inside a temporary directory, with a sibling `outside` holding a file
/// that nothing may touch.
struct Tree {
    dir: tempfile::TempDir,
    root: Root,
}

impl Tree {
    fn new() -> Tree {
        let dir = tempfile::tempdir().unwrap();
        stdfs::create_dir(dir.path().join("root")).unwrap();
        stdfs::create_dir(dir.path().join("outside")).unwrap();
        stdfs::write(dir.path().join("outside/precious"), b"keep me").unwrap();
        let root = Root::open(&dir.path().join("root")).unwrap();
        Tree { dir, root }
    }

    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join("root").join(rel)
    }

    fn outside(&self) -> std::path::PathBuf {
        self.dir.path().join("outside")
    }

    fn write(&self, rel: &str, data: &[u8]) {
        let p = self.path(rel);
        stdfs::create_dir_all(p.parent().unwrap()).unwrap();
        stdfs::write(p, data).unwrap();
    }

    #[track_caller]
    fn assert_outside_intact(&self) {
        assert_eq!(
            stdfs::read(self.outside().join("precious")).unwrap(),
            b"keep me"
        );
    }
}

#[track_caller]
fn assert_failure<T: std::fmt::Debug>(result: Result<T, Error>, want: OpFailure) -> String {
    match result {
        Err(Error::Op { failure, message }) => {
            assert_eq!(failure, want, "{message}");
            message
        }
        other => panic!("expected {want:?}, got {other:?}"),
    }
}

fn no_progress() -> impl FnMut(u64) -> Result<(), Error> {
    |_| Ok(())
}

fn list_all(root: &Root, path: &str, recursive: bool, long: bool) -> Result<Vec<ListEntry>, Error> {
    let mut pages: Vec<ListPage> = Vec::new();
    list(root, &rel(path), recursive, long, &mut |p| {
        pages.push(p);
        Ok(())
    })?;
    let (last, rest) = pages.split_last().expect("at least one page");
    assert!(!last.more && rest.iter().all(|p| p.more));
    Ok(pages.into_iter().flat_map(|p| p.entries).collect())
}

fn names(entries: &[ListEntry]) -> Vec<String> {
    let mut names: Vec<String> = entries.iter().map(|e| e.path.to_string()).collect();
    names.sort();
    names
}

#[test]
fn stat_describes_files_directories_and_symlinks_without_following() {
    let t = Tree::new();
    t.write("d/f", b"hello");
    stdfs::set_permissions(t.path("d/f"), stdfs::Permissions::from_mode(0o640)).unwrap();
    symlink(t.outside().join("precious"), t.path("d/l")).unwrap();
    let f = stat(&t.root, &rel("d/f")).unwrap();
    assert_eq!((f.kind, f.size, f.mode), (NodeKind::File, 5, 0o640));
    assert_eq!(stat(&t.root, &rel("d")).unwrap().kind, NodeKind::Dir);
    assert_eq!(stat(&t.root, &RelPath::root()).unwrap().kind, NodeKind::Dir);
    let l = stat(&t.root, &rel("d/l")).unwrap();
    assert_eq!(l.kind, NodeKind::Symlink);
    assert_eq!(
        l.link_target,
        t.outside().join("precious").as_os_str().as_bytes()
    );
    assert_failure(stat(&t.root, &rel("d/missing")), OpFailure::NotFound);
    assert_failure(stat(&t.root, &rel("nope/missing")), OpFailure::NotFound);
}

#[test]
fn messages_name_paths_relative_to_the_root_only() {
    let t = Tree::new();
    symlink(t.outside(), t.path("escape")).unwrap();
    for message in [
        assert_failure(stat(&t.root, &rel("escape/precious")), OpFailure::Escapes),
        assert_failure(stat(&t.root, &rel("a/b")), OpFailure::NotFound),
        assert_failure(
            mkdir(&t.root, &rel("escape/x"), false, 0o755),
            OpFailure::Escapes,
        ),
    ] {
        let root_path = t.dir.path().to_string_lossy().into_owned();
        assert!(!message.contains(&root_path), "{message}");
    }
}

#[test]
fn a_symlinked_directory_on_the_way_is_refused_by_every_operation() {
    let t = Tree::new();
    symlink(t.outside(), t.path("escape")).unwrap();
    let p = rel("escape/precious");
    assert_failure(stat(&t.root, &p), OpFailure::Escapes);
    // The link itself lists as a link; what it points at is never listed.
    let named = list_all(&t.root, "escape", true, true).unwrap();
    assert_eq!(named.len(), 1);
    assert_eq!(named[0].kind, NodeKind::Symlink);
    assert_failure(
        list_all(&t.root, "escape/sub", false, false),
        OpFailure::Escapes,
    );
    assert_failure(
        mkdir(&t.root, &rel("escape/new"), false, 0o755),
        OpFailure::Escapes,
    );
    assert_failure(
        mkdir(&t.root, &rel("escape/new/deeper"), true, 0o755),
        OpFailure::Escapes,
    );
    assert_failure(
        remove(&t.root, &p, RemoveMode::NotDir, &mut no_progress()),
        OpFailure::Escapes,
    );
    assert_failure(rename(&t.root, &p, &rel("stolen")), OpFailure::Escapes);
    t.write("mine", b"x");
    assert_failure(
        rename(&t.root, &rel("mine"), &rel("escape/planted")),
        OpFailure::Escapes,
    );
    assert_failure(
        checksum(&t.root, &p, ChecksumAlgorithm::Md5, &mut no_progress()),
        OpFailure::Escapes,
    );
    assert!(!t.outside().join("new").exists());
    assert!(!t.outside().join("planted").exists());
    t.assert_outside_intact();
}

#[test]
fn reserved_names_are_refused_and_hidden() {
    let t = Tree::new();
    t.write("d/.wanxfer-0123-4567.part", b"partial");
    t.write("d/visible", b"v");
    t.write(".wanxfer-state/x", b"s");
    let entries = list_all(&t.root, "", true, false).unwrap();
    assert_eq!(names(&entries), ["d", "d/visible"]);
    for path in [
        "d/.wanxfer-0123-4567.part",
        ".wanxfer-state",
        ".wanxfer-state/x",
    ] {
        assert_failure(stat(&t.root, &rel(path)), OpFailure::Reserved);
        assert_failure(
            remove(
                &t.root,
                &rel(path),
                RemoveMode::Recursive,
                &mut no_progress(),
            ),
            OpFailure::Reserved,
        );
    }
    assert_failure(
        mkdir(&t.root, &rel(".wanxfer-x"), false, 0o755),
        OpFailure::Reserved,
    );
    assert_failure(
        rename(&t.root, &rel("d/visible"), &rel("d/.wanxfer-y")),
        OpFailure::Reserved,
    );
    assert!(t.path("d/.wanxfer-0123-4567.part").exists());
}

#[test]
fn list_is_flat_or_recursive_and_never_enters_symlinks() {
    let t = Tree::new();
    t.write("top/a", b"1");
    t.write("top/sub/b", b"22");
    stdfs::create_dir(t.path("top/empty")).unwrap();
    symlink(t.outside(), t.path("top/link-out")).unwrap();
    let flat = list_all(&t.root, "top", false, false).unwrap();
    assert_eq!(names(&flat), ["a", "empty", "link-out", "sub"]);
    let deep = list_all(&t.root, "top", true, true).unwrap();
    assert_eq!(names(&deep), ["a", "empty", "link-out", "sub", "sub/b"]);
    let b = deep.iter().find(|e| e.path == rel("sub/b")).unwrap();
    assert_eq!(b.meta.as_ref().map(|m| m.size), Some(2));
    let link = deep.iter().find(|e| e.path == rel("link-out")).unwrap();
    assert_eq!(link.kind, NodeKind::Symlink);
    assert_eq!(
        link.meta.as_ref().unwrap().link_target,
        t.outside().as_os_str().as_bytes()
    );
    assert!(
        flat.iter().all(|e| e.meta.is_none()),
        "short listings carry kinds only"
    );
    // A file lists as itself.
    let one = list_all(&t.root, "top/sub/b", true, true).unwrap();
    assert_eq!(names(&one), ["b"]);
    assert_failure(
        list_all(&t.root, "top/missing", false, false),
        OpFailure::NotFound,
    );
}

#[test]
fn a_large_directory_streams_in_pages() {
    let t = Tree::new();
    stdfs::create_dir(t.path("many")).unwrap();
    for i in 0..10_000 {
        stdfs::File::create(t.path(&format!("many/file-{i:05}"))).unwrap();
    }
    let mut pages = Vec::new();
    list(&t.root, &rel("many"), false, true, &mut |p| {
        pages.push(p);
        Ok(())
    })
    .unwrap();
    assert!(pages.len() >= 3, "{} pages", pages.len());
    let total: usize = pages.iter().map(|p| p.entries.len()).sum();
    assert_eq!(total, 10_000);
    assert!(pages
        .iter()
        .all(|p| p.entries.len() <= wanxfer_proto::ops::MAX_LIST_ENTRIES));
}

#[test]
fn mkdir_creates_parents_and_refuses_what_is_in_the_way() {
    let t = Tree::new();
    mkdir(&t.root, &rel("a"), false, 0o750).unwrap();
    assert_eq!(
        stdfs::metadata(t.path("a")).unwrap().permissions().mode() & 0o777,
        0o750 & !process_umask()
    );
    assert_failure(mkdir(&t.root, &rel("a"), false, 0o755), OpFailure::Exists);
    assert_failure(
        mkdir(&t.root, &rel("x/y"), false, 0o755),
        OpFailure::NotFound,
    );
    mkdir(&t.root, &rel("x/y/z"), true, 0o755).unwrap();
    mkdir(&t.root, &rel("x/y/z"), true, 0o755).unwrap();
    assert!(t.path("x/y/z").is_dir());
    t.write("file", b"f");
    assert_failure(
        mkdir(&t.root, &rel("file/sub"), true, 0o755),
        OpFailure::NotDir,
    );
    // Set-id and sticky bits are not for a peer to set.
    mkdir(&t.root, &rel("s"), false, 0o7777).unwrap();
    assert_eq!(
        stdfs::metadata(t.path("s")).unwrap().permissions().mode() & 0o7000,
        0
    );
}

fn process_umask() -> u32 {
    let status = stdfs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .unwrap();
    u32::from_str_radix(line.trim(), 8).unwrap()
}

#[test]
fn remove_takes_what_its_mode_allows() {
    let t = Tree::new();
    t.write("d/f", b"f");
    stdfs::create_dir(t.path("empty")).unwrap();
    assert_failure(
        remove(&t.root, &rel("d"), RemoveMode::NotDir, &mut no_progress()),
        OpFailure::IsDir,
    );
    assert_failure(
        remove(&t.root, &rel("d"), RemoveMode::EmptyDir, &mut no_progress()),
        OpFailure::NotEmpty,
    );
    assert_failure(
        remove(
            &t.root,
            &rel("d/f"),
            RemoveMode::EmptyDir,
            &mut no_progress(),
        ),
        OpFailure::NotDir,
    );
    remove(
        &t.root,
        &rel("empty"),
        RemoveMode::EmptyDir,
        &mut no_progress(),
    )
    .unwrap();
    remove(&t.root, &rel("d/f"), RemoveMode::NotDir, &mut no_progress()).unwrap();
    assert!(!t.path("empty").exists() && !t.path("d/f").exists());
    assert_failure(
        remove(&t.root, &rel("d/f"), RemoveMode::NotDir, &mut no_progress()),
        OpFailure::NotFound,
    );
    assert_failure(
        remove(
            &t.root,
            &RelPath::root(),
            RemoveMode::Recursive,
            &mut no_progress(),
        ),
        OpFailure::Reserved,
    );
    assert!(t.root.path().is_dir());
}

/// `rm -r` of a tree full of symlinks to the outside (to a directory, to a file, and a
/// symlinked top-level name) removes the links and nothing they point at.
#[test]
fn recursive_remove_never_leaves_the_root_through_symlinks() {
    let t = Tree::new();
    t.write("tree/a/b/c/file", b"data");
    t.write("tree/x", b"x");
    symlink(t.outside(), t.path("tree/a/to-outside-dir")).unwrap();
    symlink(
        t.outside().join("precious"),
        t.path("tree/a/b/to-outside-file"),
    )
    .unwrap();
    symlink("../../..", t.path("tree/a/b/c/up")).unwrap();
    symlink(t.outside(), t.path("linked-top")).unwrap();
    let mut removed = 0;
    remove(&t.root, &rel("tree"), RemoveMode::Recursive, &mut |n| {
        removed = n;
        Ok(())
    })
    .unwrap();
    assert!(!t.path("tree").exists());
    assert_eq!(removed, 8, "5 entries and 3 directories below the top");
    // The symlink named directly is removed as a link.
    remove(
        &t.root,
        &rel("linked-top"),
        RemoveMode::Recursive,
        &mut no_progress(),
    )
    .unwrap();
    assert!(stdfs::symlink_metadata(t.path("linked-top")).is_err());
    t.assert_outside_intact();
    assert_eq!(stdfs::read_dir(t.outside()).unwrap().count(), 1);
    assert_eq!(stdfs::read_dir(t.root.path()).unwrap().count(), 0);
}

#[test]
fn a_progress_callback_can_stop_a_removal() {
    let t = Tree::new();
    for i in 0..10 {
        t.write(&format!("tree/f{i}"), b"x");
    }
    let result = remove(&t.root, &rel("tree"), RemoveMode::Recursive, &mut |n| {
        if n == 3 {
            Err(Error::Cancelled)
        } else {
            Ok(())
        }
    });
    assert!(matches!(result, Err(Error::Cancelled)), "{result:?}");
    assert_eq!(stdfs::read_dir(t.path("tree")).unwrap().count(), 7);
}

#[test]
fn rename_moves_across_directories_beneath_the_root() {
    let t = Tree::new();
    t.write("a/f", b"new");
    t.write("b/f", b"old");
    rename(&t.root, &rel("a/f"), &rel("b/f")).unwrap();
    assert_eq!(stdfs::read(t.path("b/f")).unwrap(), b"new");
    assert!(!t.path("a/f").exists());
    rename(&t.root, &rel("b"), &rel("a/b")).unwrap();
    assert!(t.path("a/b/f").exists());
    assert_failure(
        rename(&t.root, &rel("a"), &rel("a/b/inside")),
        OpFailure::Invalid,
    );
    assert_failure(
        rename(&t.root, &rel("missing"), &rel("x")),
        OpFailure::NotFound,
    );
    assert_failure(
        rename(&t.root, &RelPath::root(), &rel("x")),
        OpFailure::Reserved,
    );
    // A symlink at the destination is replaced, not followed.
    symlink(t.outside().join("precious"), t.path("dest-link")).unwrap();
    rename(&t.root, &rel("a/b/f"), &rel("dest-link")).unwrap();
    assert_eq!(stdfs::read(t.path("dest-link")).unwrap(), b"new");
    t.assert_outside_intact();
}

#[test]
fn checksums_match_known_values() {
    let t = Tree::new();
    t.write("wiki", b"Wikipedia");
    t.write("digits", b"123456789");
    t.write("empty", b"");
    let sum = |path: &str, algorithm| {
        hex(&checksum(&t.root, &rel(path), algorithm, &mut no_progress()).unwrap())
    };
    assert_eq!(sum("wiki", ChecksumAlgorithm::Adler32), "11e60398");
    assert_eq!(sum("empty", ChecksumAlgorithm::Adler32), "00000001");
    assert_eq!(sum("digits", ChecksumAlgorithm::Crc32c), "e3069283");
    assert_eq!(
        sum("empty", ChecksumAlgorithm::Md5),
        "d41d8cd98f00b204e9800998ecf8427e"
    );
    assert_eq!(
        sum("digits", ChecksumAlgorithm::Md5),
        "25f9e794323b453885f5181f1b624d0b"
    );
    for path in ["wiki", "empty"] {
        let data = stdfs::read(t.path(path)).unwrap();
        let want = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&data));
        assert_eq!(sum(path, ChecksumAlgorithm::Xxh3), want);
    }
}

/// Files longer than one 64 KiB piece, cut anywhere: the streamed digest is the one-shot.
#[test]
fn checksums_of_files_spanning_many_pieces_match_one_shot_digests() {
    let t = Tree::new();
    let data: Vec<u8> = (0..(3 * IN_CACHE_PIECE_BYTES + 12345))
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    t.write("big", &data);
    let mut reported = 0;
    let digest = checksum(&t.root, &rel("big"), ChecksumAlgorithm::Xxh3, &mut |n| {
        reported = n;
        Ok(())
    })
    .unwrap();
    assert_eq!(reported, data.len() as u64);
    assert_eq!(
        hex(&digest),
        format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&data))
    );
    let crc = checksum(
        &t.root,
        &rel("big"),
        ChecksumAlgorithm::Crc32c,
        &mut no_progress(),
    )
    .unwrap();
    assert_eq!(crc, crc32c::crc32c(&data).to_be_bytes());
    let adler = checksum(
        &t.root,
        &rel("big"),
        ChecksumAlgorithm::Adler32,
        &mut no_progress(),
    )
    .unwrap();
    assert_eq!(adler, reference_adler32(&data).to_be_bytes());
}

/// Adler-32 as RFC 1950 defines it, one byte at a time.
fn reference_adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in data {
        a = (a + u32::from(byte)) % 65521;
        b = (b + a) % 65521;
    }
    (b << 16) | a
}

#[test]
fn every_algorithm_the_protocol_defines_is_computed() {
    for algorithm in ChecksumAlgorithm::ALL {
        let digest = Checksummer::new(algorithm).finish();
        assert_eq!(digest.len(), algorithm.digest_len(), "{algorithm:?}");
    }
}

#[test]
fn checksum_refuses_what_is_not_a_regular_file_without_blocking() {
    let t = Tree::new();
    stdfs::create_dir(t.path("dir")).unwrap();
    t.write("f", b"x");
    symlink("f", t.path("link")).unwrap();
    let fifo = t.path("fifo");
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c_path` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let sum = |p: &str| {
        checksum(
            &t.root,
            &rel(p),
            ChecksumAlgorithm::Adler32,
            &mut no_progress(),
        )
    };
    assert_failure(sum("dir"), OpFailure::IsDir);
    assert_failure(sum("fifo"), OpFailure::Invalid);
    assert_failure(sum("link"), OpFailure::Escapes);
    assert_failure(sum("missing"), OpFailure::NotFound);
    assert_failure(sum(""), OpFailure::IsDir);
}

#[test]
fn remote_urls_parse_relative_to_the_root() {
    let url = |s: &str| RemoteUrl::parse(s.as_bytes());
    let u = url("wanxfer://127.0.0.1:7800/data/run1").unwrap().unwrap();
    assert_eq!(
        (u.server.as_str(), u.path),
        ("127.0.0.1:7800", rel("data/run1"))
    );
    let u = url("wanxfer://[::1]:7800/data/").unwrap().unwrap();
    assert_eq!((u.server.as_str(), u.path), ("[::1]:7800", rel("data")));
    assert!(url("wanxfer://h:1").unwrap().unwrap().path.is_root());
    assert_eq!(url("/local/file").unwrap(), None);
    // No port: the default one.
    assert_eq!(
        url("wanxfer://host/x").unwrap().unwrap().server,
        "host:7800"
    );
    for bad in [
        "wanxfr://host/x",
        "wanxfer://:1/x",
        "wanxfer://h:1/../etc",
        "wanxfer://h:1/a//b",
        "wanxfer://h:1//etc",
    ] {
        assert!(matches!(url(bad), Err(Error::Usage(_))), "{bad}");
    }
}

#[test]
fn a_path_that_is_a_file_in_the_middle_is_not_a_directory() {
    let t = Tree::new();
    t.write("f", b"x");
    assert_failure(stat(&t.root, &rel("f/g")), OpFailure::NotDir);
}
