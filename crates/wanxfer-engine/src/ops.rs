//! Remote operations on the served tree: stat, list, mkdir, remove, rename, checksum.
//!
//! Why these are plain functions over a [`Root`]: every one of them is a file-system call
//! a peer causes, so they follow the rules of [`crate::fs`] (every path resolved beneath
//! the root's descriptor with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, the last name
//! handled with `*at` calls that never follow it), and they can be tested without a
//! socket. The connection that carries them is in [`server`]; the typed client is
//! [`Client`].
//!
//! Rules a peer cannot talk the server out of:
//! - nothing outside the root is ever read, listed, changed or removed: a symlink on the
//!   way is refused, a symlink at the end is described, renamed or removed itself, and
//!   `rm -r` opens each directory with `O_NOFOLLOW` from its parent's descriptor, so a
//!   symlink planted in the tree (even swapped in while the removal runs) is unlinked,
//!   never entered;
//! - names starting with `.wanxfer` (the engine's temporaries and state) cannot be named
//!   by a request and are left out of listings;
//! - paths in replies and messages are relative to the served root (the root itself is
//!   `.`): a client never learns where the root lives on the server.
//!
//! What this module does not do: follow symlinks on request, change ownership, set
//! set-id bits (mkdir modes are cut to `0777`, as [`fs::MODE_MASK`] cuts transfers'), or
//! hash part of a file.

mod client;
pub(crate) mod server;

use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use wanxfer_proto::ops::{
    ChecksumAlgorithm, ListEntry, ListPage, ListPager, Meta, NodeKind, OpFailure, RemoveMode,
};
use wanxfer_proto::{RelPath, DEFAULT_PORT};

pub use client::Client;

use crate::digest::{FileHasher, IN_CACHE_PIECE_BYTES};
use crate::fs::{self, Kind, Root};
use crate::Error;

/// Names the engine keeps for itself (temporaries, state): never a request's target,
/// never listed.
pub const RESERVED_PREFIX: &[u8] = b".wanxfer";

/// Deepest tree a recursive listing or removal descends: each level holds one directory
/// descriptor while its subdirectories are walked.
pub const MAX_TREE_DEPTH: usize = 512;

/// What the executor calls with work done so far (bytes hashed, entries removed), often;
/// the caller decides how often to tell the client. An error stops the operation.
pub type ProgressFn<'a> = &'a mut dyn FnMut(u64) -> Result<(), Error>;

/// A `wanxfer://HOST:PORT/PATH` location: the server and a path beneath its root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    /// `HOST:PORT`, as given (a bracketed IPv6 address stays bracketed).
    pub server: String,
    pub path: RelPath,
}

impl RemoteUrl {
    pub const SCHEME: &'static [u8] = b"wanxfer://";

    /// Parses an argument that may be a URL; `Ok(None)` when it is a local path.
    /// `wanxfer://HOST[:PORT]/PATH` is remote (port [`DEFAULT_PORT`] if none; the path is
    /// relative to the server's root, and `..`, empty components, NUL and a further
    /// leading `/` are refused as in every [`RelPath`]); anything else is local, except
    /// what is plainly a URL gone wrong (another scheme, `wanxfer:/x`, `wanxfer//x`,
    /// `wanxfr://x`): taken as a local path, that would copy into or out of a directory
    /// named after the typo, so it is refused. A local path that really looks like that
    /// can be written `./wanxfer:/x`.
    pub fn parse(url: &[u8]) -> Result<Option<RemoteUrl>, Error> {
        let shown = || String::from_utf8_lossy(url).into_owned();
        let scheme_len = url
            .iter()
            .position(|b| !(b.is_ascii_alphanumeric() || b"+.-".contains(b)))
            .unwrap_or(url.len());
        let (scheme, rest) = url.split_at(scheme_len);
        let expected = "a remote side is wanxfer://HOST[:PORT]/PATH; a local path that looks like a URL can be written ./PATH";
        if !scheme.first().is_some_and(u8::is_ascii_alphabetic) {
            return Ok(None);
        }
        let Some(rest) = rest.strip_prefix(b"://") else {
            let typo = edit_distance(&scheme.to_ascii_lowercase(), b"wanxfer") <= 2
                && (rest.starts_with(b":") || rest.starts_with(b"//"));
            if typo {
                return Err(Error::Usage(format!(
                    "{}: not a wanxfer URL: {expected}",
                    shown()
                )));
            }
            return Ok(None);
        };
        if !scheme.eq_ignore_ascii_case(b"wanxfer") {
            return Err(Error::Usage(format!(
                "{}: unknown scheme {}://: {expected}",
                shown(),
                String::from_utf8_lossy(scheme)
            )));
        }
        let split = rest.iter().position(|&b| b == b'/').unwrap_or(rest.len());
        let (authority, path) = rest.split_at(split);
        let server = std::str::from_utf8(authority)
            .map_err(|_| "the host is not UTF-8".to_string())
            .and_then(server_address)
            .map_err(|why| Error::Usage(format!("{}: {why}", shown())))?;
        let path = RelPath::new(path.strip_prefix(b"/").unwrap_or(path))
            .map_err(|e| Error::Usage(format!("{}: {e}", shown())))?;
        Ok(Some(RemoteUrl { server, path }))
    }
}

/// `HOST[:PORT]` (an IPv6 address in brackets) as `HOST:PORT`, with [`DEFAULT_PORT`] when
/// none is given.
pub fn server_address(authority: &str) -> Result<String, String> {
    let (host, port) = match authority.rsplit_once(':') {
        // The colon of an IPv6 address is not a port separator unless a `]` precedes it.
        Some((host, port)) if !host.starts_with('[') || host.ends_with(']') => (host, Some(port)),
        _ => (authority, None),
    };
    if host.is_empty() || host == "[]" {
        return Err("no host: expected wanxfer://HOST[:PORT]/PATH".into());
    }
    if host.starts_with('[') != host.ends_with(']')
        || (!host.starts_with('[') && host.contains(':'))
    {
        return Err(format!(
            "{host:?} is not a host: an IPv6 address goes in brackets, [::1]:{DEFAULT_PORT}"
        ));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("{p:?} is not a port (1-65535)"))?,
    };
    Ok(format!("{host}:{port}"))
}

/// Levenshtein distance, for spotting typos of a scheme or a configuration key.
pub fn edit_distance(a: &[u8], b: &[u8]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Metadata of `path` itself; a symlink is described with its target, never followed.
pub fn stat(root: &Root, path: &RelPath) -> Result<Meta, Error> {
    check_target(path)?;
    let Some((parent, name)) = path.split_last() else {
        let meta = fs::fd_meta(root.fd()).map_err(|e| failed("stat", path, e))?;
        return Ok(to_meta(meta, Vec::new()));
    };
    let dir = open_dir(root, &parent, "stat", path)?;
    describe(dir.as_fd(), name, path, "stat")
}

/// Lists directory `path` (or, when it is not a directory, `path` itself) in pages,
/// depth first when `recursive`, in the order the file system gives. `page` gets every
/// page, the last one with `more` clear; an error after some pages ends the listing
/// there.
pub fn list(
    root: &Root,
    path: &RelPath,
    recursive: bool,
    long: bool,
    page: &mut dyn FnMut(ListPage) -> Result<(), Error>,
) -> Result<(), Error> {
    check_target(path)?;
    let top = match path.split_last() {
        None => root
            .fd()
            .try_clone_to_owned()
            .map_err(|e| failed("list", path, e))?,
        Some((parent, name)) => {
            let dir = open_dir(root, &parent, "list", path)?;
            let meta = describe(dir.as_fd(), name, path, "list")?;
            if meta.kind != NodeKind::Dir {
                let entry = ListEntry {
                    path: RelPath::new(name).map_err(|e| invalid("list", path, e))?,
                    kind: meta.kind,
                    meta: long.then_some(meta),
                };
                let mut pager = ListPager::new();
                let none = pager.push(entry);
                debug_assert!(none.is_none(), "one entry always fits");
                return page(pager.finish());
            }
            open_subdir(dir.as_fd(), name, "list", path)?
        }
    };
    let mut pager = ListPager::new();
    let mut stack = vec![Level::open(top, RelPath::root(), path, "list")?];
    while let Some(level) = stack.last_mut() {
        let Some(dirent) = level.dir.read() else {
            stack.pop();
            continue;
        };
        let dirent = dirent.map_err(|e| failed("list", &level.shown(path), e.into()))?;
        let name = dirent.file_name().to_bytes();
        if name == b"." || name == b".." || name.starts_with(RESERVED_PREFIX) {
            continue;
        }
        let rel = level.rel.join(name).map_err(|e| invalid("list", path, e))?;
        let mut kind = kind_of(dirent.file_type());
        let meta = if long || kind.is_none() {
            let meta = describe(
                level.fd.as_fd(),
                name,
                &path.concat(&rel).unwrap_or_default(),
                "list",
            );
            match meta {
                Ok(meta) => Some(meta),
                // Removed between the listing and the stat: it is no longer there to list.
                Err(Error::Op {
                    failure: OpFailure::NotFound,
                    ..
                }) => continue,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        if let Some(meta) = &meta {
            kind = Some(meta.kind);
        }
        let kind = kind.unwrap_or(NodeKind::Other);
        let descend = recursive && kind == NodeKind::Dir;
        let sub = if descend {
            if stack.len() >= MAX_TREE_DEPTH {
                return Err(too_deep("list", path));
            }
            let level = stack.last().expect("the level being read");
            let shown = path.concat(&rel).unwrap_or_default();
            Some(open_subdir(level.fd.as_fd(), name, "list", &shown)?)
        } else {
            None
        };
        let entry = ListEntry {
            path: rel.clone(),
            kind,
            meta: if long { meta } else { None },
        };
        if let Some(full) = pager.push(entry) {
            page(full)?;
        }
        if let Some(fd) = sub {
            stack.push(Level::open(fd, rel, path, "list")?);
        }
    }
    page(pager.finish())
}

/// Creates directory `path` with permission bits `mode` (cut to `0777`, then the
/// server's umask applies); with `parents`, missing parents too, and an existing
/// directory is no error.
pub fn mkdir(root: &Root, path: &RelPath, parents: bool, mode: u32) -> Result<(), Error> {
    check_target(path)?;
    let mode = Mode::from_raw_mode(mode & fs::MODE_MASK);
    if path.is_root() {
        return if parents {
            Ok(())
        } else {
            Err(op(OpFailure::Exists, format!("mkdir {path}: exists")))
        };
    }
    if !parents {
        let (parent, name) = path.split_last().expect("not the root");
        let dir = open_dir(root, &parent, "mkdir", path)?;
        return rustix::fs::mkdirat(dir.as_fd(), OsStr::from_bytes(name), mode)
            .map_err(|e| failed("mkdir", path, e.into()));
    }
    let mut dir = root
        .fd()
        .try_clone_to_owned()
        .map_err(|e| failed("mkdir", path, e))?;
    let mut done = RelPath::root();
    for name in path.components() {
        done = done.join(name).map_err(|e| invalid("mkdir", path, e))?;
        match rustix::fs::mkdirat(dir.as_fd(), OsStr::from_bytes(name), mode) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(failed("mkdir", &done, e.into())),
        }
        // A symlink or a file in the way is refused here (`O_NOFOLLOW | O_DIRECTORY`).
        dir = open_subdir(dir.as_fd(), name, "mkdir", &done)?;
    }
    Ok(())
}

/// Removes `path` as `mode` allows; a recursive removal reports each entry removed to
/// `progress`.
pub fn remove(
    root: &Root,
    path: &RelPath,
    mode: RemoveMode,
    progress: ProgressFn<'_>,
) -> Result<(), Error> {
    check_target(path)?;
    let Some((parent, name)) = path.split_last() else {
        return Err(op(
            OpFailure::Reserved,
            "rm .: the served root itself cannot be removed".into(),
        ));
    };
    let dir = open_dir(root, &parent, "rm", path)?;
    let kind = match fs::meta_at(dir.as_fd(), name).map_err(|e| failed("rm", path, e))? {
        None => return Err(not_found("rm", path)),
        Some(meta) => meta.kind,
    };
    let unlink = |flags| {
        rustix::fs::unlinkat(dir.as_fd(), OsStr::from_bytes(name), flags)
            .map_err(|e| failed("rm", path, e.into()))
    };
    match (mode, kind) {
        (RemoveMode::NotDir, Kind::Dir) => Err(op(
            OpFailure::IsDir,
            format!("rm {path}: is a directory (remove it recursively, or as an empty directory)"),
        )),
        (RemoveMode::EmptyDir, Kind::Dir) => unlink(AtFlags::REMOVEDIR),
        (RemoveMode::EmptyDir, _) => Err(op(
            OpFailure::NotDir,
            format!("rmdir {path}: not a directory"),
        )),
        (RemoveMode::Recursive, Kind::Dir) => {
            remove_tree(dir.as_fd(), name, path, progress)?;
            unlink(AtFlags::REMOVEDIR)
        }
        _ => unlink(AtFlags::empty()),
    }
}

/// Empties directory `name` of `parent` (which stays, empty), depth first. Each
/// directory is opened from its parent's descriptor with `O_NOFOLLOW | O_DIRECTORY`, so
/// only what is really beneath it is removed.
fn remove_tree(
    parent: BorrowedFd<'_>,
    name: &[u8],
    path: &RelPath,
    progress: ProgressFn<'_>,
) -> Result<(), Error> {
    let top = open_subdir(parent, name, "rm", path)?;
    let mut stack = vec![Level::open(top, RelPath::root(), path, "rm")?];
    let mut removed = 0u64;
    while let Some(level) = stack.last_mut() {
        let Some(dirent) = level.dir.read() else {
            // Everything beneath this level is gone: remove it from its parent.
            let done = stack.pop().expect("the level just read");
            if let Some(up) = stack.last() {
                let (_, sub) = done.rel.split_last().expect("below the top");
                rustix::fs::unlinkat(up.fd.as_fd(), OsStr::from_bytes(sub), AtFlags::REMOVEDIR)
                    .map_err(|e| failed("rm", &done.shown(path), e.into()))?;
                removed += 1;
                progress(removed)?;
            }
            continue;
        };
        let dirent = dirent.map_err(|e| failed("rm", &level.shown(path), e.into()))?;
        let entry = dirent.file_name().to_bytes();
        if entry == b"." || entry == b".." {
            continue;
        }
        let rel = level.rel.join(entry).map_err(|e| invalid("rm", path, e))?;
        let shown = || path.concat(&rel).unwrap_or_default();
        let is_dir = match fs::meta_at(level.fd.as_fd(), entry) {
            Ok(Some(meta)) => meta.kind == Kind::Dir,
            Ok(None) => continue,
            Err(e) => return Err(failed("rm", &shown(), e)),
        };
        if is_dir {
            let fd = open_subdir(level.fd.as_fd(), entry, "rm", &shown())?;
            if stack.len() >= MAX_TREE_DEPTH {
                return Err(too_deep("rm", path));
            }
            stack.push(Level::open(fd, rel, path, "rm")?);
        } else {
            rustix::fs::unlinkat(level.fd.as_fd(), OsStr::from_bytes(entry), AtFlags::empty())
                .map_err(|e| failed("rm", &shown(), e.into()))?;
            removed += 1;
            progress(removed)?;
        }
    }
    Ok(())
}

/// Renames `from` to `to`, both beneath the root, as `rename(2)`: an existing file (or
/// symlink, or empty directory for a directory) at `to` is replaced in one step.
pub fn rename(root: &Root, from: &RelPath, to: &RelPath) -> Result<(), Error> {
    check_target(from)?;
    check_target(to)?;
    let (Some((from_parent, from_name)), Some((to_parent, to_name))) =
        (from.split_last(), to.split_last())
    else {
        return Err(op(
            OpFailure::Reserved,
            format!("mv {from} {to}: the served root itself cannot be moved or replaced"),
        ));
    };
    let from_dir = open_dir(root, &from_parent, "mv", from)?;
    let to_dir = open_dir(root, &to_parent, "mv", to)?;
    rustix::fs::renameat(
        from_dir.as_fd(),
        OsStr::from_bytes(from_name),
        to_dir.as_fd(),
        OsStr::from_bytes(to_name),
    )
    .map_err(|e| {
        let shown = format!("{from} {to}");
        failed_shown("mv", &shown, e.into())
    })
}

/// The `algorithm` digest of regular file `path`, read in 64 KiB pieces; bytes hashed so
/// far go to `progress`.
pub fn checksum(
    root: &Root,
    path: &RelPath,
    algorithm: ChecksumAlgorithm,
    progress: ProgressFn<'_>,
) -> Result<Vec<u8>, Error> {
    check_target(path)?;
    if path.is_root() {
        return Err(op(OpFailure::IsDir, "checksum .: is a directory".into()));
    }
    // O_NONBLOCK: a FIFO planted in the tree must not hold this thread until a writer
    // comes; it is refused below, as is everything but a regular file.
    let fd = root
        .open_beneath(
            path,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        )
        .map_err(|e| failed("checksum", path, e.into()))?;
    match fs::fd_meta(fd.as_fd())
        .map_err(|e| failed("checksum", path, e))?
        .kind
    {
        Kind::File => {}
        Kind::Dir => {
            return Err(op(
                OpFailure::IsDir,
                format!("checksum {path}: is a directory"),
            ))
        }
        _ => {
            return Err(op(
                OpFailure::Invalid,
                format!("checksum {path}: not a regular file"),
            ))
        }
    }
    checksum_reader(std::fs::File::from(fd), algorithm, progress).map_err(|e| match e {
        ReadError::Io(e) => failed("checksum", path, e),
        ReadError::Stopped(e) => e,
    })
}

/// Why [`checksum_reader`] stopped.
#[derive(Debug)]
pub enum ReadError {
    Io(io::Error),
    /// The progress callback said stop.
    Stopped(Error),
}

/// The `algorithm` digest of everything `reader` yields, read in 64 KiB pieces (so each
/// piece is hashed while it is still in cache); bytes read so far go to `progress`.
pub fn checksum_reader(
    mut reader: impl Read,
    algorithm: ChecksumAlgorithm,
    progress: ProgressFn<'_>,
) -> Result<Vec<u8>, ReadError> {
    let mut sum = Checksummer::new(algorithm);
    let mut buf = vec![0u8; IN_CACHE_PIECE_BYTES];
    let mut done = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(sum.finish()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        };
        sum.update(&buf[..n]);
        done += n as u64;
        progress(done).map_err(ReadError::Stopped)?;
    }
}

/// A running checksum of one of the algorithms a server computes.
pub struct Checksummer(Sum);

enum Sum {
    Xxh3(Box<FileHasher>),
    Adler32(adler2::Adler32),
    Crc32c(u32),
    Md5(md5::Md5),
}

impl Checksummer {
    pub fn new(algorithm: ChecksumAlgorithm) -> Checksummer {
        use md5::Digest;
        Checksummer(match algorithm {
            ChecksumAlgorithm::Xxh3 => Sum::Xxh3(Box::default()),
            ChecksumAlgorithm::Adler32 => Sum::Adler32(adler2::Adler32::new()),
            ChecksumAlgorithm::Crc32c => Sum::Crc32c(0),
            ChecksumAlgorithm::Md5 => Sum::Md5(md5::Md5::new()),
            // The protocol's enum is non-exhaustive only for other crates: it is built with
            // this one, its decoder yields only the four above (`ChecksumAlgorithm::ALL`,
            // which a test here constructs one by one), so no peer can reach this arm.
            _ => unreachable!("every algorithm the protocol defines is computed here"),
        })
    }

    pub fn update(&mut self, data: &[u8]) {
        use md5::Digest;
        match &mut self.0 {
            Sum::Xxh3(h) => h.update(data),
            Sum::Adler32(a) => a.write_slice(data),
            Sum::Crc32c(c) => *c = crc32c::crc32c_append(*c, data),
            Sum::Md5(m) => m.update(data),
        }
    }

    /// The digest in the order it is printed: XXH3-128 as `xxhsum -H2` shows it (high
    /// half first), the 32-bit sums big-endian (the 8 hex digits Rucio catalogues).
    pub fn finish(self) -> Vec<u8> {
        use md5::Digest;
        match self.0 {
            Sum::Xxh3(h) => {
                // The wire digest is the 128-bit value little-endian; printed, it reads
                // most significant byte first.
                let mut bytes = h.digest();
                bytes.reverse();
                bytes.to_vec()
            }
            Sum::Adler32(a) => a.checksum().to_be_bytes().to_vec(),
            Sum::Crc32c(c) => c.to_be_bytes().to_vec(),
            Sum::Md5(m) => m.finalize().to_vec(),
        }
    }
}

/// Lowercase hex, as checksums are printed and catalogued.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One directory being walked: its descriptor, its entries, its path below the top.
struct Level {
    fd: OwnedFd,
    dir: rustix::fs::Dir,
    rel: RelPath,
}

impl Level {
    fn open(fd: OwnedFd, rel: RelPath, top: &RelPath, op_name: &str) -> Result<Level, Error> {
        let dir = rustix::fs::Dir::read_from(&fd)
            .map_err(|e| failed(op_name, &top.concat(&rel).unwrap_or_default(), e.into()))?;
        Ok(Level { fd, dir, rel })
    }

    /// This level's path relative to the root, for messages.
    fn shown(&self, top: &RelPath) -> RelPath {
        top.concat(&self.rel).unwrap_or_default()
    }
}

/// Refuses names the engine keeps for itself anywhere in `path`.
fn check_target(path: &RelPath) -> Result<(), Error> {
    if path.components().any(|c| c.starts_with(RESERVED_PREFIX)) {
        return Err(op(
            OpFailure::Reserved,
            format!(
                "{path}: names starting with {} are the server's own",
                String::from_utf8_lossy(RESERVED_PREFIX)
            ),
        ));
    }
    Ok(())
}

/// Directory `dir` beneath the root, for an operation on `path`.
fn open_dir(root: &Root, dir: &RelPath, op_name: &str, path: &RelPath) -> Result<OwnedFd, Error> {
    if dir.is_root() {
        return root
            .fd()
            .try_clone_to_owned()
            .map_err(|e| failed(op_name, path, e));
    }
    root.open_beneath(dir, OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC)
        .map_err(|e| failed(op_name, path, e.into()))
}

/// Subdirectory `name` of `dir`, never through a symlink: one swapped in since it was
/// looked at is refused (`O_NOFOLLOW | O_DIRECTORY` answers `ENOTDIR` or `ELOOP`) and
/// reported as the symlink it is.
fn open_subdir(
    dir: BorrowedFd<'_>,
    name: &[u8],
    op_name: &str,
    path: &RelPath,
) -> Result<OwnedFd, Error> {
    fs::open_subdir(dir, name).map_err(|e| {
        let symlink = matches!(fs::meta_at(dir, name), Ok(Some(m)) if m.kind == Kind::Symlink);
        if symlink {
            op(
                OpFailure::Escapes,
                format!("{op_name} {path}: the path goes through a symlink"),
            )
        } else {
            failed(op_name, path, e)
        }
    })
}

/// Metadata of `name` in `dir`, with a symlink's target.
fn describe(
    dir: BorrowedFd<'_>,
    name: &[u8],
    path: &RelPath,
    op_name: &str,
) -> Result<Meta, Error> {
    let meta = fs::meta_at(dir, name)
        .map_err(|e| failed(op_name, path, e))?
        .ok_or_else(|| not_found(op_name, path))?;
    let target = if meta.kind == Kind::Symlink {
        fs::read_link_at(dir, name).map_err(|e| failed(op_name, path, e))?
    } else {
        Vec::new()
    };
    Ok(to_meta(meta, target))
}

fn to_meta(meta: fs::Meta, link_target: Vec<u8>) -> Meta {
    Meta {
        kind: match meta.kind {
            Kind::File => NodeKind::File,
            Kind::Dir => NodeKind::Dir,
            Kind::Symlink => NodeKind::Symlink,
            Kind::Other => NodeKind::Other,
        },
        size: meta.size,
        mode: meta.mode & wanxfer_proto::ops::MODE_BITS,
        mtime_sec: meta.mtime_sec,
        mtime_nsec: meta.mtime_nsec,
        link_target,
    }
}

/// The kind a directory entry says it is; `None` where the file system does not say.
fn kind_of(t: FileType) -> Option<NodeKind> {
    match t {
        FileType::RegularFile => Some(NodeKind::File),
        FileType::Directory => Some(NodeKind::Dir),
        FileType::Symlink => Some(NodeKind::Symlink),
        FileType::Unknown => None,
        _ => Some(NodeKind::Other),
    }
}

fn op(failure: OpFailure, message: String) -> Error {
    Error::Op { failure, message }
}

fn not_found(op_name: &str, path: &RelPath) -> Error {
    op(
        OpFailure::NotFound,
        format!("{op_name} {path}: no such file or directory"),
    )
}

fn too_deep(op_name: &str, path: &RelPath) -> Error {
    op(
        OpFailure::Limit,
        format!("{op_name} {path}: the tree is deeper than {MAX_TREE_DEPTH} levels"),
    )
}

fn invalid(op_name: &str, path: &RelPath, e: wanxfer_proto::PathError) -> Error {
    op(OpFailure::Limit, format!("{op_name} {path}: {e}"))
}

fn failed(op_name: &str, path: &RelPath, e: io::Error) -> Error {
    failed_shown(op_name, &path.to_string(), e)
}

/// An operation's system error, told in terms of the request: ELOOP and EXDEV are what
/// `RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH` and `O_NOFOLLOW` answer for a symlink or a way
/// out.
fn failed_shown(op_name: &str, shown: &str, e: io::Error) -> Error {
    let failure = failure_of(&e);
    let why = match failure {
        OpFailure::Escapes => "the path goes through a symlink or leaves the root".to_string(),
        OpFailure::NotFound => "no such file or directory".to_string(),
        _ => strip_os_code(&e),
    };
    op(failure, format!("{op_name} {shown}: {why}"))
}

/// The errno-like reason of a system error.
pub fn failure_of(e: &io::Error) -> OpFailure {
    let Some(code) = e.raw_os_error() else {
        return match e.kind() {
            io::ErrorKind::NotFound => OpFailure::NotFound,
            io::ErrorKind::AlreadyExists => OpFailure::Exists,
            io::ErrorKind::PermissionDenied => OpFailure::PermissionDenied,
            _ => OpFailure::Other,
        };
    };
    match code {
        libc::ENOENT => OpFailure::NotFound,
        libc::EEXIST => OpFailure::Exists,
        libc::ENOTDIR => OpFailure::NotDir,
        libc::EISDIR => OpFailure::IsDir,
        libc::ENOTEMPTY => OpFailure::NotEmpty,
        libc::EACCES | libc::EPERM | libc::EROFS => OpFailure::PermissionDenied,
        libc::ELOOP | libc::EXDEV => OpFailure::Escapes,
        libc::ENOSPC | libc::EDQUOT => OpFailure::NoSpace,
        libc::EINVAL | libc::ENAMETOOLONG | libc::EBUSY => OpFailure::Invalid,
        libc::EMFILE | libc::ENFILE | libc::ENOMEM => OpFailure::Limit,
        libc::EIO => OpFailure::Io,
        _ => OpFailure::Other,
    }
}

/// "Permission denied", not "Permission denied (os error 13)".
fn strip_os_code(e: &io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

#[cfg(test)]
mod tests;
