//! The front end of the sending side: what is sent, in which blocks, read by whom.
//!
//! The [`Walker`] lists a tree depth-first, one directory handle per level, so memory and
//! descriptors grow with depth, not with the number of files. What is read into which
//! block is the session's plan (`wanxfer_session::Planner`: chunks of large files, small
//! files packed many to a block); [`run_reader`] threads carry plans out, hashing each
//! piece as it is read, and hand finished blocks to the channels; they never wait on the
//! network except through the pool. A file is opened without blocking and only if it is
//! still the regular file of the size and modification time that was listed; one that
//! changes while it is read is not sent (its last block is held back until the file is
//! checked again), as rsync and tar warn that a file changed as they read it.
//!
//! Nothing here follows a symlink: entries are opened by name with `O_NOFOLLOW`, and
//! files are reopened for reading with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` from the
//! source's base directory, so a tree served for pulling cannot be used to read outside it.
//!
//! With `--preserve hardlinks` the walker remembers the first name it lists of each file
//! with several names (by device and inode): later names become entries that link to
//! it and are never read. Names outside the transfer are never looked for.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use wanxfer_proto::{BlockHeader, Entry, EntryKind, HeldRange, RelPath, Segment};

use crate::digest::{check_flags, digest_of, FileHasher, IN_CACHE_PIECE_BYTES};
use crate::fs::{self, Kind, Meta, Root};
use crate::pool::{recv_or_cancel, Block, Cancel, FileRange, Pool};
use crate::preserve::{self, Preserve};
use crate::select::Matcher;
use crate::Error;

/// One top-level item to send: `name` inside the directory `base`.
#[derive(Debug, Clone)]
pub struct SourceItem {
    base: Arc<OwnedFd>,
    name: Vec<u8>,
    shown: Arc<str>,
    /// The item's absolute path, which names it in a transfer's identity.
    absolute: Arc<[u8]>,
}

/// What a sender sends.
#[derive(Debug, Clone)]
pub enum Source {
    Items(Vec<SourceItem>),
    /// `bytes` of zeros from memory, for measuring the path without disks.
    Synthetic {
        bytes: u64,
    },
}

impl Source {
    /// Local paths named on the command line. Like `cp -r`, a symlink named directly is
    /// copied as a symlink.
    pub fn local(paths: &[PathBuf]) -> Result<Source, Error> {
        paths
            .iter()
            .map(|p| local_item(p))
            .collect::<Result<_, _>>()
            .map(Source::Items)
    }

    /// Paths beneath a served root, as a pulling client asked for them.
    pub fn beneath(root: &Root, paths: &[RelPath]) -> Result<Source, Error> {
        let mut items = Vec::with_capacity(paths.len());
        for rel in paths {
            let Some((parent, name)) = rel.split_last() else {
                return Err(Error::Refused {
                    path: root.show(rel),
                    reason: "name a file or directory beneath the root, not the root itself".into(),
                });
            };
            let base = root.dir(&parent)?;
            if fs::meta_at(base.as_fd(), name)
                .map_err(|e| Error::local("stat", root.show(rel), e))?
                .is_none()
            {
                return Err(Error::Refused {
                    path: root.show(rel),
                    reason: "no such file or directory".into(),
                });
            }
            items.push(SourceItem {
                base: Arc::new(base),
                name: name.to_vec(),
                // Named as the client named it: the served root is not its business.
                shown: rel.to_string().into(),
                absolute: rel.as_bytes().into(),
            });
        }
        Ok(Source::Items(items))
    }

    /// What names this source in a transfer's identity: the absolute paths of its items
    /// (the same command from another directory names other files), or its size.
    pub fn identity(&self) -> Vec<Vec<u8>> {
        match self {
            Source::Items(items) => items.iter().map(|i| i.absolute.to_vec()).collect(),
            Source::Synthetic { bytes } => vec![format!("synthetic {bytes}").into_bytes()],
        }
    }

    /// The top-level names, in order.
    pub fn top_names(&self) -> Vec<Vec<u8>> {
        match self {
            Source::Items(items) => items.iter().map(|i| i.name.clone()).collect(),
            Source::Synthetic { .. } => vec![SYNTHETIC_NAME.to_vec()],
        }
    }
}

/// The manifest name of the synthetic source's single stream.
pub const SYNTHETIC_NAME: &[u8] = b"synthetic";

fn local_item(path: &Path) -> Result<SourceItem, Error> {
    let shown = path.display().to_string();
    let path = if path.file_name().is_none() {
        // ".", "..", "dir/.": name the directory they mean.
        std::fs::canonicalize(path).map_err(|e| Error::local("resolve", &shown, e))?
    } else {
        path.to_path_buf()
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::Usage(format!("cannot copy {shown}: name a directory below /")))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let base = rustix::fs::open(
        parent,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::local("open directory", parent.display(), e.into()))?;
    match fs::meta_at(base.as_fd(), name.as_bytes()) {
        Ok(Some(_)) => {}
        Ok(None) => {
            return Err(Error::local(
                "read",
                &shown,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ))
        }
        Err(e) => return Err(Error::local("stat", &shown, e)),
    }
    let absolute = std::path::absolute(&path).unwrap_or_else(|_| path.clone());
    Ok(SourceItem {
        base: Arc::new(base),
        name: name.as_bytes().to_vec(),
        shown: shown.into(),
        absolute: absolute.as_os_str().as_bytes().into(),
    })
}

/// How a reader gets a file's bytes.
#[derive(Debug, Clone)]
pub enum Content {
    /// Reopened by path beneath `base`.
    File { base: Arc<OwnedFd>, rel: RelPath },
    /// Zeros straight from the pool.
    Zeros,
}

/// A file to send: its manifest id, size, and where its bytes come from.
#[derive(Debug, Clone)]
pub struct FileJob {
    pub id: u64,
    pub size: u64,
    pub content: Content,
    /// The modification time it was listed with: a file that no longer has it (or its
    /// size) changed since, and is not sent as listed.
    pub mtime: (i64, u32),
    /// How the source it belongs to was named; its own name is built only for an error
    /// message (formatting one per file was 3% of the sender's CPU on 4 KiB files).
    top: Arc<str>,
}

impl FileJob {
    /// The file as the user named it, for messages.
    pub fn shown(&self) -> String {
        match &self.content {
            Content::File { rel, .. } => show_beneath(&self.top, rel),
            Content::Zeros => self.top.to_string(),
        }
    }
}

/// `rel`, whose first component is the source named `top` on the command line, as the
/// user would write it.
fn show_beneath(top: &str, rel: &RelPath) -> String {
    match rel.split_first() {
        Some((_, rest)) if !rest.is_root() => format!("{top}/{rest}"),
        _ => top.to_string(),
    }
}

/// An entry of the manifest, and for regular files with data, the job that sends them.
#[derive(Debug)]
pub struct Walked {
    pub entry: Entry,
    pub job: Option<FileJob>,
    /// How many names its file has (1 for anything but a file with hard links).
    pub names: u64,
}

struct Frame {
    fd: OwnedFd,
    dir: rustix::fs::Dir,
    rel: RelPath,
    item: usize,
}

/// Lists sources depth first, assigning manifest ids in order.
pub struct Walker {
    items: Vec<SourceItem>,
    next_item: usize,
    stack: Vec<Frame>,
    next_id: u64,
    synthetic: Option<u64>,
    /// Entries skipped because they are neither file, directory nor symlink.
    pub skipped: Vec<String>,
    /// Which entries beneath the sources are listed at all.
    selection: Arc<Matcher>,
    /// What entries carry beyond mode and mtime (`cp --preserve`).
    preserve: Preserve,
    /// Entries whose attributes could not all be sent (for the report's notes).
    pub left_out: Vec<String>,
    /// `--preserve hardlinks`: the entry id of the first name listed of each file with
    /// more than one name, by device and inode.
    first_names: HashMap<(u64, u64), u64>,
    /// The session marks those first names as link targets (`features::LINK_TARGETS`).
    mark_targets: bool,
}

/// Most files with several names whose later names a walker links to the first; the
/// names of files past it travel as independent files (noted), so that the table stays
/// bounded (about 48 bytes an entry). The protocol's bound on marked link targets, so a
/// receiver that remembers that many always finds a link's target.
pub const MAX_LINKED_FILES: usize = wanxfer_proto::MAX_LINK_TARGETS;

/// What a file's name is to `--preserve hardlinks`.
enum Name {
    /// Its only name in the transfer so far, and no other is to be linked to it.
    Only,
    /// The first of several: later names link to it.
    First,
    /// Another name of the file first listed as this entry.
    Later(u64),
}

impl Walker {
    pub fn new(source: &Source) -> Walker {
        let (items, synthetic) = match source {
            Source::Items(items) => (items.clone(), None),
            Source::Synthetic { bytes } => (Vec::new(), Some(*bytes)),
        };
        Walker {
            items,
            next_item: 0,
            stack: Vec::new(),
            next_id: 0,
            synthetic,
            skipped: Vec::new(),
            selection: Arc::default(),
            preserve: Preserve::default(),
            left_out: Vec::new(),
            first_names: HashMap::new(),
            mark_targets: false,
        }
    }

    /// The first name of each file with several names is marked as a link target
    /// ([`wanxfer_proto::EntryMeta::linkable`]), for a receiver that remembers only those.
    pub fn marking_link_targets(mut self, mark: bool) -> Walker {
        self.mark_targets = mark;
        self
    }

    /// Entries carry what `preserve` asks (owner, group, attributes and ACLs).
    pub fn preserving(mut self, preserve: Preserve) -> Walker {
        self.preserve = preserve;
        self
    }

    /// Lists only what `selection` takes beneath each source (an excluded directory is
    /// not descended into); the sources themselves are always listed.
    pub fn selecting(mut self, selection: Arc<Matcher>) -> Walker {
        self.selection = selection;
        self
    }

    /// The next entry, or `None` when every source has been listed.
    pub fn next_entry(&mut self) -> Option<Result<Walked, Error>> {
        if let Some(bytes) = self.synthetic.take() {
            return Some(Ok(self.synthetic_entry(bytes)));
        }
        loop {
            if let Some(frame) = self.stack.last_mut() {
                match frame.dir.read() {
                    None => {
                        self.stack.pop();
                        continue;
                    }
                    Some(Err(e)) => {
                        let (item, rel) = (frame.item, frame.rel.clone());
                        self.stack.pop();
                        let shown = self.show(item, &rel);
                        return Some(Err(Error::local("list directory", shown, e.into())));
                    }
                    Some(Ok(dirent)) => {
                        let name = dirent.file_name().to_bytes();
                        if name == b"." || name == b".." {
                            continue;
                        }
                        let name = name.to_vec();
                        let (item, parent) = (frame.item, frame.rel.clone());
                        let meta = fs::meta_at(frame.fd.as_fd(), &name);
                        let opened = self.visit(item, &parent, &name, meta);
                        match opened {
                            Some(r) => return Some(r),
                            None => continue,
                        }
                    }
                }
            }
            let item = self.next_item;
            let top = self.items.get(item)?.clone();
            self.next_item += 1;
            let meta = fs::meta_at(top.base.as_fd(), &top.name);
            if let Some(r) = self.visit_top(item, &top, meta) {
                return Some(r);
            }
        }
    }

    fn visit_top(
        &mut self,
        item: usize,
        top: &SourceItem,
        meta: std::io::Result<Option<Meta>>,
    ) -> Option<Result<Walked, Error>> {
        let rel = match RelPath::root().join(&top.name) {
            Ok(rel) => rel,
            Err(e) => return Some(Err(Error::Usage(format!("{}: {e}", top.shown)))),
        };
        self.visit_rel(item, rel, top.base.clone(), meta)
    }

    fn visit(
        &mut self,
        item: usize,
        parent: &RelPath,
        name: &[u8],
        meta: std::io::Result<Option<Meta>>,
    ) -> Option<Result<Walked, Error>> {
        let rel = match parent.join(name) {
            Ok(rel) => rel,
            Err(e) => {
                let shown = self.show(item, parent);
                return Some(Err(Error::local(
                    "list",
                    format!("{shown}/{}", String::from_utf8_lossy(name)),
                    std::io::Error::other(e),
                )));
            }
        };
        let base = self.items[item].base.clone();
        self.visit_rel(item, rel, base, meta)
    }

    fn visit_rel(
        &mut self,
        item: usize,
        rel: RelPath,
        base: Arc<OwnedFd>,
        meta: std::io::Result<Option<Meta>>,
    ) -> Option<Result<Walked, Error>> {
        let meta = match meta {
            Ok(Some(meta)) => meta,
            // Vanished between listing and stat: nothing to send.
            Ok(None) => return None,
            Err(e) => return Some(Err(Error::local("stat", self.show(item, &rel), e))),
        };
        if !self.selection.is_empty() {
            if let Some((_, beneath)) = rel.split_first().filter(|(_, b)| !b.is_root()) {
                if !self.selection.selects(&beneath, meta.kind == Kind::Dir) {
                    return None;
                }
            }
        }
        let id = self.next_id;
        let mut entry = Entry {
            kind: EntryKind::File,
            path: rel.clone(),
            size: 0,
            mode: meta.mode,
            mtime_sec: meta.mtime_sec,
            mtime_nsec: meta.mtime_nsec,
            link_target: Vec::new(),
            meta: None,
        };
        let mut job = None;
        let mut name = Name::Only;
        match meta.kind {
            Kind::File => {
                entry.size = meta.size;
                name = self.first_name(item, &rel, &meta, id);
                if meta.size > 0 && !matches!(name, Name::Later(_)) {
                    job = Some(FileJob {
                        id,
                        size: meta.size,
                        content: Content::File {
                            base: base.clone(),
                            rel,
                        },
                        mtime: (meta.mtime_sec, meta.mtime_nsec),
                        top: self.items[item].shown.clone(),
                    });
                }
            }
            Kind::Dir => {
                entry.kind = EntryKind::Dir;
                if let Err(e) = self.push_dir(item, &base, rel) {
                    return Some(Err(e));
                }
            }
            Kind::Symlink => {
                entry.kind = EntryKind::Symlink;
                let (parent_fd, name) = match self.parent_of(&base, &rel) {
                    Ok(v) => v,
                    Err(e) => return Some(Err(e)),
                };
                match fs::read_link_at(parent_fd.as_fd(), name) {
                    Ok(target) => entry.link_target = target,
                    Err(e) => {
                        let shown = self.show(item, &rel);
                        return Some(Err(Error::local("read link", shown, e)));
                    }
                }
            }
            Kind::Other => {
                self.skipped.push(self.show(item, &rel));
                return None;
            }
        }
        if !self.preserve.is_empty() {
            entry.meta = self.preserved(item, &base, &entry, &meta);
        }
        match name {
            Name::Only => {}
            Name::First if !self.mark_targets => {}
            Name::First => entry.meta.get_or_insert_with(Box::default).linkable = true,
            Name::Later(first) => {
                // Another name of a file listed already: it carries no data of its own.
                let meta = entry.meta.get_or_insert_with(Box::default);
                meta.data = None;
                meta.link = Some(first);
            }
        }
        self.next_id += 1;
        let names = if meta.kind == Kind::File {
            meta.nlink
        } else {
            1
        };
        Some(Ok(Walked { entry, job, names }))
    }

    /// With `--preserve hardlinks`, whether file `meta` (which becomes entry `id`) is
    /// the first of several names, or which entry listed its first.
    fn first_name(&mut self, item: usize, rel: &RelPath, meta: &Meta, id: u64) -> Name {
        if !self.preserve.hardlinks || meta.nlink < 2 {
            return Name::Only;
        }
        let full = self.first_names.len() >= MAX_LINKED_FILES;
        match self.first_names.entry((meta.dev, meta.ino)) {
            std::collections::hash_map::Entry::Occupied(first) => Name::Later(*first.get()),
            std::collections::hash_map::Entry::Vacant(_) if full => {
                if self.left_out.len() < wanxfer_session::MAX_NOTES {
                    let shown = self.show(item, rel);
                    self.left_out.push(format!(
                        "{shown}: more than {MAX_LINKED_FILES} files with several names, so its \
                         names travel as separate files"
                    ));
                }
                Name::Only
            }
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(id);
                Name::First
            }
        }
    }

    /// What `cp --preserve` keeps of `entry`: attributes are read through the
    /// directory just opened for listing, or the file opened without following a link
    /// (a symlink's own are not kept).
    fn preserved(
        &mut self,
        item: usize,
        base: &Arc<OwnedFd>,
        entry: &Entry,
        meta: &Meta,
    ) -> Option<Box<wanxfer_proto::EntryMeta>> {
        let mut left_out = None;
        let opened;
        let fd = match entry.kind {
            EntryKind::File if self.preserve.sparse || self.preserve.attributes() => {
                opened = self
                    .parent_of(base, &entry.path)
                    .ok()
                    .and_then(|(dir, name)| {
                        rustix::fs::openat(
                            &dir,
                            OsStr::from_bytes(name),
                            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .ok()
                    });
                opened.as_ref().map(|fd| fd.as_fd())
            }
            _ if !self.preserve.attributes() => None,
            EntryKind::Dir => self.stack.last().map(|frame| frame.fd.as_fd()),
            _ => None,
        };
        let read = preserve::read(fd, meta, self.preserve, &mut left_out);
        if let Some(why) = left_out {
            let shown = self.show(item, &entry.path);
            self.left_out.push(format!("{shown}: {why}"));
        }
        read
    }

    fn parent_of<'a>(
        &self,
        base: &Arc<OwnedFd>,
        rel: &'a RelPath,
    ) -> Result<(OwnedFd, &'a [u8]), Error> {
        // A symlink's parent is the directory on top of the stack, or the base for a
        // top-level item.
        let (_, name) = rel.split_last().expect("entries are never the root");
        let fd = match self.stack.last() {
            Some(frame) if Some(&frame.rel) == rel.split_last().map(|(p, _)| p).as_ref() => {
                frame.fd.try_clone()
            }
            _ => base.as_fd().try_clone_to_owned(),
        }
        .map_err(|e| Error::local("duplicate handle", rel, e))?;
        Ok((fd, name))
    }

    fn push_dir(&mut self, item: usize, base: &Arc<OwnedFd>, rel: RelPath) -> Result<(), Error> {
        let shown = self.show(item, &rel);
        let (parent, name) = self.parent_of(base, &rel)?;
        let fd = fs::open_subdir(parent.as_fd(), name)
            .map_err(|e| Error::local("open directory", &shown, e))?;
        let dir = rustix::fs::Dir::read_from(&fd)
            .map_err(|e| Error::local("list directory", &shown, e.into()))?;
        self.stack.push(Frame { fd, dir, rel, item });
        Ok(())
    }

    fn synthetic_entry(&mut self, bytes: u64) -> Walked {
        let id = self.next_id;
        self.next_id += 1;
        let path = RelPath::new(SYNTHETIC_NAME).expect("constant name is valid");
        Walked {
            entry: Entry {
                kind: EntryKind::File,
                path,
                size: bytes,
                mode: 0o644,
                mtime_sec: 0,
                mtime_nsec: 0,
                link_target: Vec::new(),
                meta: None,
            },
            job: (bytes > 0).then(|| FileJob {
                id,
                size: bytes,
                content: Content::Zeros,
                mtime: (0, 0),
                top: "synthetic source".into(),
            }),
            names: 1,
        }
    }

    fn show(&self, item: usize, rel: &RelPath) -> String {
        show_beneath(&self.items[item].shown, rel)
    }
}

/// Settings every reader shares.
#[derive(Debug, Clone)]
pub struct ReaderConfig {
    pub session_tag: u64,
    /// A CRC-32C over each payload; only where segments carry no digest.
    pub block_crc: bool,
    /// Every segment carries the digest of its bytes.
    pub file_digest: bool,
    pub io: IoMode,
    /// A session without encryption: every block is tagged under this key.
    pub block_key: Option<crate::digest::BlockKey>,
}

/// How the sending side moves file bytes into the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// Settled per session by [`IoMode::resolve`] once the peer is known.
    Auto,
    /// `pread` into a pool buffer, then a vectored `write`: two copies, works everywhere.
    Copy,
    /// Blocks of large files go from the page cache with `sendfile`: the socket copy is
    /// saved, and with checksums off the read too. Small packed files are still copied
    /// (one `sendfile` per tiny file would cost more than the copy).
    Sendfile,
    /// Every block is read into a pool buffer and sent with `MSG_ZEROCOPY`: the kernel
    /// sends from the buffer instead of copying it, where the device allows (see
    /// `transport::zerocopy`); `--json` counts the sends it copied anyway.
    Zerocopy,
}

impl IoMode {
    /// The mode `Auto` stands for on one connection; explicit modes stay as asked.
    ///
    /// `sendfile` saves the sender's copy into the socket, which pays wherever a device
    /// reads the page cache itself. When the peer is on this host and a checksum makes the
    /// reader read every byte anyway, it does not: the receiving process then copies
    /// straight from the page cache, a second trip through memory, whereas the bytes a
    /// plain send copied are still in cache (4 GiB tmpfs file over loopback, 5 alternating
    /// runs: copy 12.6 Gbit/s against sendfile 10.7, and less CPU on both sides). With
    /// nothing to checksum nothing is read, and `sendfile` wins there too (17.7 against
    /// 15.0 Gbit/s, sender 1.2 against 2.0 CPU seconds).
    pub fn resolve(self, peer_on_this_host: bool, reads_every_byte: bool) -> IoMode {
        match self {
            IoMode::Auto if peer_on_this_host && reads_every_byte => IoMode::Copy,
            IoMode::Auto => IoMode::Sendfile,
            explicit => explicit,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            IoMode::Auto => "auto",
            IoMode::Copy => "copy",
            IoMode::Sendfile => "sendfile",
            IoMode::Zerocopy => "zerocopy",
        }
    }
}

/// Work for one reader, as the session planned it, with the files it names.
#[derive(Debug)]
pub enum ReadJob {
    /// These ranges of one file, a block per piece at the session's block boundaries.
    Chunks {
        job: FileJob,
        ranges: Vec<(u64, u64)>,
    },
    /// These whole small files, into one block.
    Packed(Vec<FileJob>),
    /// Hash these ranges and say whether each matches the digest the receiver holds.
    Verify {
        job: FileJob,
        ranges: Vec<HeldRange>,
    },
}

/// What a reader tells the session.
#[derive(Debug)]
pub enum ReaderEvent {
    /// The file cannot be sent (unreadable, or it changed while it was read).
    Failed { id: u64, error: Error },
    /// Whether each held range matches the source.
    Verified { id: u64, matches: Vec<bool> },
}

/// Where readers report; the session's event queue.
pub type ReaderReport = Arc<dyn Fn(ReaderEvent) + Send + Sync>;

/// Shared counters and caches of the readers of one session.
#[derive(Debug, Default)]
pub struct ReaderShared {
    sequence: AtomicU64,
    zero_checks: std::sync::Mutex<Vec<(usize, Checks)>>,
    /// The keyed hashes of blocks of zeros, per length (sessions without encryption).
    zero_hashes: std::sync::Mutex<Vec<(usize, [u8; 32])>>,
}

/// One reader thread: executes jobs until the job queue closes.
pub fn run_reader(
    jobs: crossbeam_channel::Receiver<ReadJob>,
    blocks: Sender<Block>,
    report: ReaderReport,
    pool: Pool,
    cfg: ReaderConfig,
    shared: Arc<ReaderShared>,
    cancel: Cancel,
) -> Result<(), Error> {
    let reader = Reader {
        dir: std::cell::RefCell::default(),
        pool,
        cfg,
        shared,
        cancel,
        blocks,
        report,
    };
    while let Some(job) = recv_or_cancel(&jobs, &reader.cancel)? {
        match job {
            ReadJob::Chunks { job, ranges } => reader.send_chunks(job, &ranges)?,
            ReadJob::Packed(jobs) => reader.send_packed(jobs)?,
            ReadJob::Verify { job, ranges } => reader.verify(job, &ranges),
        }
    }
    Ok(())
}

struct Reader {
    dir: std::cell::RefCell<ReaderDir>,
    pool: Pool,
    cfg: ReaderConfig,
    shared: Arc<ReaderShared>,
    cancel: Cancel,
    blocks: Sender<Block>,
    report: ReaderReport,
}

/// A file opened for reading, with what it looked like when opened.
struct Opened {
    file: Option<Arc<File>>,
    meta: Option<Meta>,
}

impl Reader {
    fn fail(&self, id: u64, error: Error) {
        (self.report)(ReaderEvent::Failed { id, error });
    }

    /// Opens `job`'s file and checks it is still what was listed: a regular file of the
    /// listed size and modification time.
    fn open(&self, job: &FileJob) -> Result<Opened, Error> {
        let Some(file) = self.dir.borrow_mut().open(job)? else {
            return Ok(Opened {
                file: None,
                meta: None,
            });
        };
        let meta = fs::fd_meta(file.as_fd()).map_err(|e| Error::local("stat", job.shown(), e))?;
        if meta.size != job.size || (meta.mtime_sec, meta.mtime_nsec) != job.mtime {
            return Err(changed(job, "changed since it was listed"));
        }
        Ok(Opened {
            file: Some(Arc::new(file)),
            meta: Some(meta),
        })
    }

    /// Fails unless the file is as it was when opened: a write while it was read (even
    /// one that put the modification time back) moves its change time.
    fn unchanged(&self, job: &FileJob, opened: &Opened) -> Result<(), Error> {
        let (Some(file), Some(before)) = (&opened.file, &opened.meta) else {
            return Ok(());
        };
        let now = fs::fd_meta(file.as_fd()).map_err(|e| Error::local("stat", job.shown(), e))?;
        if now != *before {
            return Err(changed(job, "changed while it was being sent"));
        }
        Ok(())
    }

    fn send_chunks(&self, job: FileJob, ranges: &[(u64, u64)]) -> Result<(), Error> {
        let opened = match self.open(&job) {
            Ok(opened) => opened,
            Err(e) => {
                self.fail(job.id, e);
                return Ok(());
            }
        };
        let zero_copy = self.cfg.io == IoMode::Sendfile && opened.file.is_some();
        let zeros = matches!(job.content, Content::Zeros);
        // With nothing to check, a zero-copy block never passes through user space.
        let must_read = !zeros
            && (!zero_copy
                || self.cfg.block_crc
                || self.cfg.file_digest
                || self.cfg.block_key.is_some());
        let block_size = self.pool.block_size() as u64;
        let mut pieces = wanxfer_session::chunks(ranges, block_size).peekable();
        while let Some((offset, len)) = pieces.next() {
            let len = len as usize;
            let mut block = self.pool.take(&self.cancel)?;
            let checks = if zeros {
                if block.scribbled {
                    // Its zeros were sealed into ciphertext when it was last sent.
                    block.space()[..].fill(0);
                    block.scribbled = false;
                }
                self.zero_checks(&job, len)?
            } else if must_read {
                let buf = &mut block.space()[..len];
                let crc = self.cfg.block_crc.then_some(0);
                match read_checked(
                    opened.file.as_deref(),
                    &job,
                    offset,
                    buf,
                    self.cfg.file_digest,
                    crc,
                ) {
                    Ok(checks) => checks,
                    Err(e) => {
                        self.fail(job.id, e);
                        return Ok(());
                    }
                }
            } else {
                Checks::default()
            };
            if pieces.peek().is_none() {
                // The plan's last block goes only if the file did not change meanwhile:
                // without it the receiver never completes the file.
                if let Err(e) = self.unchanged(&job, &opened) {
                    self.fail(job.id, e);
                    return Ok(());
                }
            }
            block.len = len;
            if zero_copy {
                block.file_range = opened.file.clone().map(|file| FileRange {
                    file,
                    offset,
                    in_buffer: must_read,
                });
            }
            let last = offset + len as u64 == job.size;
            block.segments.push(Segment {
                file_id: job.id,
                offset,
                len: len as u32,
                flags: if last { Segment::FLAG_LAST } else { 0 },
                digest: checks.digest,
            });
            self.finish_and_send(block, checks.crc, zeros)?;
        }
        Ok(())
    }

    /// Packs whole small files into one block, each read and checked as a chunk is. A
    /// file that cannot be read, or changes while read, leaves no bytes, and no share of
    /// the block's CRC.
    fn send_packed(&self, jobs: Vec<FileJob>) -> Result<(), Error> {
        let mut block = self.pool.take(&self.cancel)?;
        let mut crc = self.cfg.block_crc.then_some(0u32);
        let mut pos = 0usize;
        for job in jobs {
            let size = job.size as usize;
            let buf = &mut block.space()[pos..pos + size];
            let read = self.open(&job).and_then(|opened| {
                let checks = read_checked(
                    opened.file.as_deref(),
                    &job,
                    0,
                    buf,
                    self.cfg.file_digest,
                    crc,
                )?;
                self.unchanged(&job, &opened)?;
                Ok(checks)
            });
            let checks = match read {
                Ok(checks) => checks,
                Err(e) => {
                    self.fail(job.id, e);
                    continue;
                }
            };
            crc = checks.crc;
            block.segments.push(Segment {
                file_id: job.id,
                offset: 0,
                len: size as u32,
                flags: Segment::FLAG_LAST,
                digest: checks.digest,
            });
            pos += size;
        }
        block.len = pos;
        if block.segments.is_empty() {
            return Ok(());
        }
        self.finish_and_send(block, crc, false)
    }

    /// Checks what the receiver holds of a file against the source: each held range is
    /// read and hashed, and matches only if its digest is the one the receiver kept.
    fn verify(&self, job: FileJob, ranges: &[HeldRange]) {
        let result = self.open(&job).and_then(|opened| {
            let mut buf = vec![0u8; IN_CACHE_PIECE_BYTES];
            let mut matches = Vec::with_capacity(ranges.len());
            for r in ranges {
                if self.cancel.is_cancelled() {
                    return Err(Error::Cancelled);
                }
                let mut hasher = FileHasher::new();
                let mut at = 0u64;
                while at < u64::from(r.len) {
                    let n = (u64::from(r.len) - at).min(buf.len() as u64) as usize;
                    fill(opened.file.as_deref(), &job, r.offset + at, &mut buf[..n])?;
                    hasher.update(&buf[..n]);
                    at += n as u64;
                }
                matches.push(hasher.digest() == r.digest);
            }
            self.unchanged(&job, &opened)?;
            Ok(matches)
        });
        match result {
            Ok(matches) => (self.report)(ReaderEvent::Verified {
                id: job.id,
                matches,
            }),
            Err(Error::Cancelled) => {}
            Err(e) => self.fail(job.id, e),
        }
    }

    /// Encodes the header (with `payload_crc`, if the block carries one) and queues the
    /// block for a channel.
    fn finish_and_send(
        &self,
        mut block: Block,
        payload_crc: Option<u32>,
        zeros: bool,
    ) -> Result<(), Error> {
        let mut flags = check_flags(payload_crc.is_some(), self.cfg.file_digest);
        if self.cfg.block_key.is_some() {
            flags |= BlockHeader::FLAG_MAC;
        }
        let header = BlockHeader {
            flags,
            segment_count: block.segments.len() as u16,
            payload_len: block.len as u32,
            payload_crc: payload_crc.unwrap_or(0),
            session_tag: self.cfg.session_tag,
            sequence: self.shared.sequence.fetch_add(1, Ordering::Relaxed),
            mac: [0; 12],
        };
        let buf: &mut crate::pool::BlockBuf = &mut block;
        header.encode(&buf.segments, &mut buf.header);
        if let Some(key) = &self.cfg.block_key {
            // One more pass over the payload, in this reader's thread; the synthetic
            // source's zeros hash the same every time.
            let hash = if zeros {
                self.zero_payload_hash(key, buf.len)
            } else {
                key.payload_hash(buf.payload())
            };
            key.seal(&mut buf.header, &hash);
        }
        self.blocks.send(block).map_err(|_| Error::Cancelled)
    }

    /// The keyed hash of `len` zero bytes, computed once per length.
    fn zero_payload_hash(&self, key: &crate::digest::BlockKey, len: usize) -> [u8; 32] {
        let mut cache = self
            .shared
            .zero_hashes
            .lock()
            .expect("no panics while held");
        if let Some(&(_, hash)) = cache.iter().find(|(l, _)| *l == len) {
            return hash;
        }
        let hash = key.payload_hash(&vec![0u8; len]);
        cache.push((len, hash));
        hash
    }

    /// The checks of `len` zero bytes, computed once per length: the synthetic source must
    /// cost the sender nothing but the send itself.
    fn zero_checks(&self, job: &FileJob, len: usize) -> Result<Checks, Error> {
        let mut cache = self
            .shared
            .zero_checks
            .lock()
            .expect("no panics while held");
        if let Some(&(_, checks)) = cache.iter().find(|(l, _)| *l == len) {
            return Ok(checks);
        }
        let crc = self.cfg.block_crc.then_some(0);
        let mut zeros = vec![0u8; len];
        let checks = read_checked(None, job, 0, &mut zeros, self.cfg.file_digest, crc)?;
        cache.push((len, checks));
        Ok(checks)
    }
}

fn changed(job: &FileJob, how: &str) -> Error {
    Error::local(
        "read",
        job.shown(),
        std::io::Error::other(format!("the file {how}; it was not sent")),
    )
}

/// What the sender computed over one chunk's bytes: the payload CRC (in a session without
/// digests) and the segment's digest (zero in a session without them).
#[derive(Debug, Clone, Copy, Default)]
struct Checks {
    crc: Option<u32>,
    digest: [u8; 16],
}

/// The directory a reader opened last, so that files of one directory (which arrive
/// together) cost one `openat`, not a full path walk, each.
#[derive(Default)]
struct ReaderDir {
    last: Option<(*const OwnedFd, RelPath, OwnedFd)>,
}

impl ReaderDir {
    /// Opens `job`'s file for reading: the parent is resolved beneath the source's base
    /// with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, the name opened with `O_NOFOLLOW`.
    fn open(&mut self, job: &FileJob) -> Result<Option<File>, Error> {
        let (base, rel) = match &job.content {
            Content::Zeros => return Ok(None),
            Content::File { base, rel } => (base, rel),
        };
        let (parent, name) = rel.split_last().expect("files are never the root");
        let key = Arc::as_ptr(base);
        let cached = matches!(&self.last, Some((k, p, _)) if *k == key && *p == parent);
        if !cached {
            let dir = rustix::fs::openat2(
                base.as_fd(),
                dir_path(&parent),
                OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
            .map_err(|e| Error::local("open directory of", job.shown(), e.into()))?;
            self.last = Some((key, parent, dir));
        }
        let (_, _, dir) = self.last.as_ref().expect("set above");
        fs::open_file_at(dir.as_fd(), name)
            .map(Some)
            .map_err(|e| Error::local("open", job.shown(), e))
    }
}

/// `rel` as a path for `openat2`, which refuses an empty one: the base itself is ".".
fn dir_path(rel: &RelPath) -> &OsStr {
    if rel.is_root() {
        OsStr::new(".")
    } else {
        OsStr::from_bytes(rel.as_bytes())
    }
}

/// Reads `buf.len()` bytes of `job` at `offset` a cache-sized piece at a time, and runs
/// the checks over each piece while it is still in the core's cache
/// ([`IN_CACHE_PIECE_BYTES`]; over a whole 4 MiB block read first, they would read it back
/// from memory): the digest if `digest`, and the payload CRC continued from `crc` if there
/// is one (a packed block's CRC runs on over its files).
fn read_checked(
    file: Option<&File>,
    job: &FileJob,
    mut offset: u64,
    buf: &mut [u8],
    digest: bool,
    mut crc: Option<u32>,
) -> Result<Checks, Error> {
    // Within one piece (most small files) one-shot hashing afterwards skips the streaming
    // state, which costs more than the hash for a 4 KiB file.
    let mut hasher = (digest && buf.len() > IN_CACHE_PIECE_BYTES).then(FileHasher::new);
    for piece in buf.chunks_mut(IN_CACHE_PIECE_BYTES) {
        fill(file, job, offset, piece)?;
        if let Some(hasher) = hasher.as_mut() {
            hasher.update(piece);
        }
        if let Some(crc) = crc.as_mut() {
            *crc = crc32c::crc32c_append(*crc, piece);
        }
        offset += piece.len() as u64;
    }
    let digest = match hasher {
        Some(hasher) => hasher.digest(),
        None if digest => digest_of(buf),
        None => [0; 16],
    };
    Ok(Checks { crc, digest })
}

/// Reads exactly `buf.len()` bytes at `offset`; a file that shrank since it was listed
/// is an error naming it (sending fewer bytes than announced would fail verification
/// later with a less useful message).
fn fill(file: Option<&File>, job: &FileJob, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
    let Some(file) = file else {
        return Ok(());
    };
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::local(
                "read",
                job.shown(),
                std::io::Error::other(format!(
                    "file shrank while being sent (expected {} bytes)",
                    job.size
                )),
            )
        } else {
            Error::local("read", job.shown(), e)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_copies_only_to_a_peer_on_this_host_that_reads_every_byte_anyway() {
        assert_eq!(IoMode::Auto.resolve(true, true), IoMode::Copy);
        assert_eq!(IoMode::Auto.resolve(true, false), IoMode::Sendfile);
        assert_eq!(IoMode::Auto.resolve(false, true), IoMode::Sendfile);
        assert_eq!(IoMode::Auto.resolve(false, false), IoMode::Sendfile);
        for explicit in [IoMode::Copy, IoMode::Sendfile, IoMode::Zerocopy] {
            assert_eq!(explicit.resolve(true, true), explicit);
            assert_eq!(explicit.resolve(false, false), explicit);
        }
    }

    #[test]
    fn walker_lists_a_tree_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join("top");
        std::fs::create_dir_all(top.join("sub/empty")).unwrap();
        std::fs::write(top.join("sub/a"), b"hello").unwrap();
        std::fs::write(top.join("z"), b"").unwrap();
        std::os::unix::fs::symlink("/etc", top.join("link")).unwrap();
        let source = Source::local(&[top]).unwrap();
        let mut w = Walker::new(&source);
        let mut seen = Vec::new();
        while let Some(item) = w.next_entry() {
            let item = item.unwrap();
            seen.push((
                item.entry.path.to_string(),
                item.entry.kind,
                item.job.is_some(),
            ));
        }
        seen.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            seen,
            vec![
                ("top".into(), EntryKind::Dir, false),
                ("top/link".into(), EntryKind::Symlink, false),
                ("top/sub".into(), EntryKind::Dir, false),
                ("top/sub/a".into(), EntryKind::File, true),
                ("top/sub/empty".into(), EntryKind::Dir, false),
                ("top/z".into(), EntryKind::File, false),
            ]
        );
    }
}
