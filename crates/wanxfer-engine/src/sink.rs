//! The front end of the receiving side: where each entry lands, what is already there,
//! and when a file is done.
//!
//! Applying an entry decides what the sender must send of it. A file whose size and mtime
//! match the one already in place is skipped (the quick check); a file an interrupted run
//! of this transfer left half written is resumed from its named temporary, whose verified
//! ranges the journal lists, and which the sender checks against its source before they
//! count; with comparison by checksum, a file of the same size offers its own chunks'
//! digests. Everything else is received whole.
//!
//! Blocks arrive on any channel in any order, so a file is finished not when "its last
//! block" arrives but when its coverage is complete. Every segment was checked against its
//! digest by the channel as it arrived (`digest::PayloadVerifier`), before a byte of it is
//! written here, so a complete file is a verified one whatever order its chunks came in.
//! A complete file goes to the [`Committer`](crate::commit::Committer), which makes it
//! durable, gives it its final name, and only then reports it done. A segment that failed
//! its check fails its file alone, and so does any other failure that concerns one file (a
//! directory that cannot be created where the tree needs one, a name the file system
//! refuses): the rest of the tree lands. Everything the peer says is checked against the
//! manifest and local limits first: unknown ids, ranges past the announced size,
//! overlapping data, or more files in progress than we allow end the session with a
//! protocol or limit error, never a panic.
//!
//! This module does not read sockets; it is fed blocks by the transport and entries by the
//! session.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use wanxfer_proto::{Compare, Entry, EntryKind, EntryMeta, HeldRange, RelPath, Segment};
use wanxfer_session::journal::Record;
use wanxfer_session::{Applied, Coverage, Failure};

use crate::commit::{Committer, Complete, Report, Symlink};
use crate::fs::{self, DirCache, Kind, Root, TempFile, TempStrategy, WriteMode};
use crate::links::{Link, Links, Ready};
use crate::pool::Block;
use crate::preserve::{self, Notes, Preserve};
use crate::progress::IoUse;
use crate::session::state::JournalFile;
use crate::Error;

/// Where a transfer's top-level names land, decided once per transfer like `cp -r`.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Directory (beneath the root) that receives the top-level entries.
    pub base: RelPath,
    /// A single source copied onto a new name takes that name.
    pub rename_top: Option<Vec<u8>>,
    /// Pull: the only top-level names the client asked for.
    pub allowed_tops: Option<Vec<Vec<u8>>>,
}

/// The first component of every path the engine keeps for itself beneath a served root;
/// peers may neither write nor read it.
pub const RESERVED_NAME: &[u8] = b".wanxfer";

impl Placement {
    /// Where `source_count` sources land beneath `dest`, and how that was decided
    /// (`Into` or `Onto`) so that later runs of the transfer land in the same place:
    /// - `Resolve` (a first run): `cp -r`: into `dest` if it is a directory, onto it if
    ///   there is one source, an error otherwise;
    /// - `Into` (a trailing slash, or an earlier run's choice): into `dest`, which is
    ///   created if missing (its parent must exist);
    /// - `Onto`: the single source takes `dest`'s name.
    pub fn decide(
        root: &Root,
        dest: &RelPath,
        source_count: u32,
        asked: wanxfer_proto::Placement,
    ) -> Result<(Placement, wanxfer_proto::Placement), Error> {
        use wanxfer_proto::Placement as Wire;
        let into = |base: RelPath| Placement {
            base,
            rename_top: None,
            allowed_tops: None,
        };
        let is_dir = |rel: &RelPath| -> Result<Option<bool>, Error> {
            Ok(root.meta(rel)?.map(|m| m.kind == Kind::Dir))
        };
        let onto = |dest: &RelPath| -> Result<Placement, Error> {
            let (parent, name) = dest.split_last().ok_or_else(|| Error::Refused {
                path: root.show(dest),
                reason: "a single source cannot take the name of the root".into(),
            })?;
            match is_dir(&parent)? {
                Some(true) => Ok(Placement {
                    base: parent,
                    rename_top: Some(name.to_vec()),
                    allowed_tops: None,
                }),
                _ => Err(Error::Refused {
                    path: root.show(&parent),
                    reason: "the destination's parent directory does not exist".into(),
                }),
            }
        };
        match asked {
            Wire::Into => match is_dir(dest)? {
                Some(true) => Ok((into(dest.clone()), Wire::Into)),
                Some(false) => Err(Error::Refused {
                    path: root.show(dest),
                    reason: "the destination exists and is not a directory".into(),
                }),
                None => {
                    let (parent, name) = dest.split_last().expect("a missing path is not the root");
                    let dir = root.dir(&parent)?;
                    fs::ensure_dir(dir.as_fd(), name)
                        .map_err(|e| Error::local("create directory", root.show(dest), e))?;
                    let created = root.dir(dest)?;
                    fs::apply_meta(created.as_fd(), 0o755, now_sec(), 0)
                        .map_err(|e| Error::local("set directory metadata", root.show(dest), e))?;
                    Ok((into(dest.clone()), Wire::Into))
                }
            },
            Wire::Onto if source_count == 1 => Ok((onto(dest)?, Wire::Onto)),
            Wire::Onto => Err(Error::Usage("several sources cannot take one name".into())),
            _ => match is_dir(dest)? {
                Some(true) => Ok((into(dest.clone()), Wire::Into)),
                _ if source_count == 1 => Ok((onto(dest)?, Wire::Onto)),
                Some(false) => Err(Error::Refused {
                    path: root.show(dest),
                    reason: "copying several sources needs a directory as destination".into(),
                }),
                None => Err(Error::Refused {
                    path: root.show(dest),
                    reason: "the destination directory does not exist".into(),
                }),
            },
        }
    }

    /// Where manifest path `path` lands beneath the root.
    pub fn map(&self, path: &RelPath) -> Result<RelPath, String> {
        let (top, rest) = path
            .split_first()
            .ok_or_else(|| "an entry names the root itself".to_string())?;
        if let Some(allowed) = &self.allowed_tops {
            if !allowed.iter().any(|a| a == top) {
                return Err(format!("the peer sent {path}, which was not asked for"));
            }
        }
        let top = self.rename_top.as_deref().unwrap_or(top);
        let mapped = self
            .base
            .join(top)
            .and_then(|p| p.concat(&rest))
            .map_err(|e| format!("{path}: {e}"))?;
        if mapped
            .split_first()
            .is_some_and(|(first, _)| first == RESERVED_NAME)
        {
            return Err(format!(
                "{path}: {} is reserved",
                String::from_utf8_lossy(RESERVED_NAME)
            ));
        }
        Ok(mapped)
    }
}

fn now_sec() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[derive(Debug)]
struct Slot {
    dest: RelPath,
    size: u64,
    mode: u32,
    mtime_sec: i64,
    mtime_nsec: u32,
    /// What `cp --preserve` keeps of it.
    meta: Option<Box<EntryMeta>>,
    /// Sparse: its holes count as received, and its temporary is sized, not reserved.
    sparse: bool,
    state: Mutex<SlotState>,
}

/// The holes of a sparse entry (`--preserve sparse`): what its data ranges leave out.
fn holes(entry: &Entry) -> Option<Vec<(u64, u64)>> {
    let data = entry.meta.as_ref()?.data.as_ref()?;
    let mut out = Vec::with_capacity(data.len() + 1);
    let mut at = 0;
    for &(start, end) in data {
        if start > at {
            out.push((at, start));
        }
        at = end;
    }
    if at < entry.size {
        out.push((at, entry.size));
    }
    Some(out)
}

#[derive(Debug, Default)]
struct SlotState {
    temp: Option<Arc<TempFile>>,
    coverage: Coverage,
    /// The file failed while another writer still held its slot: that writer must not
    /// open a temporary for it (which would count against the open-file limit forever)
    /// nor record its data.
    abandoned: bool,
    /// The file's number in the journal, once its named temporary is journaled.
    journaled: Option<u32>,
    /// Verified ranges not yet in the journal, and their bytes.
    unjournaled: Vec<HeldRange>,
    unjournaled_bytes: u64,
    /// Compare by checksum: the held ranges are in the file in place, and are copied into
    /// the temporary once the sender confirms them.
    in_place: bool,
}

#[derive(Debug)]
struct DirMeta {
    dest: RelPath,
    mode: u32,
    mtime_sec: i64,
    mtime_nsec: u32,
    meta: Option<Box<EntryMeta>>,
}

/// Local limits and settings of a receiving side; never taken from the peer.
#[derive(Debug, Clone)]
pub struct SinkLimits {
    pub max_open_files: usize,
    pub write: WriteMode,
    /// Which files already in place are skipped.
    pub compare: Compare,
    /// Files are durable before they are acknowledged (`--no-fsync` turns it off).
    pub durable: bool,
    /// Verified bytes of one partial file between journal checkpoints.
    pub checkpoint_bytes: u64,
    /// The session's block size: what the chunks of a file compared by checksum are.
    pub block_size: u64,
    /// What the session agreed to keep beyond mode and mtime.
    pub preserve: Preserve,
    /// The sender marks the files links may name (see [`Links`]).
    pub marked_links: bool,
    /// How long a block may wait for the entry it belongs to: in a fresh pull
    /// (`session_flags::FRESH`) the sender sends data right behind its announcement, on
    /// another connection, so data may overtake its entry; elsewhere (`None`) data
    /// ahead of its entry is the peer's error at once.
    pub entry_wait: Option<Duration>,
}

impl SinkLimits {
    /// As a fresh pull's receiver (`session_flags::FRESH`) needs them: its sender sends
    /// each file's data right behind the entry, unasked, on other connections, so a
    /// block may overtake its entry and waits up to `entry_wait` for it; and nothing in
    /// place is compared. The session is fresh because none of its names was there when
    /// it began; a file that appeared at one since is replaced, as it would be if it
    /// differed, since its data is on the way whatever this side answers (an "up to
    /// date" answer, which the sender cannot take back, would end the session).
    pub fn fresh(self, entry_wait: Duration) -> SinkLimits {
        SinkLimits {
            compare: Compare::Always,
            entry_wait: Some(entry_wait),
            ..self
        }
    }
}

impl Default for SinkLimits {
    fn default() -> Self {
        SinkLimits {
            max_open_files: 512,
            write: WriteMode::Auto,
            compare: Compare::QuickCheck,
            durable: true,
            checkpoint_bytes: 64 << 20,
            block_size: 4 << 20,
            preserve: Preserve::default(),
            marked_links: false,
            entry_wait: None,
        }
    }
}

/// Where received data goes: files beneath a root, or nowhere (memory-to-memory).
pub struct Sink {
    target: Option<(Root, Placement)>,
    peer: String,
    transfer_tag: u64,
    /// The checks the session agreed on (`digest::check_flags`): a block without them is
    /// refused.
    required_checks: u8,
    limits: SinkLimits,
    /// Files of more than one block bypass the page cache (see [`WriteMode`]).
    direct: bool,
    slots: Mutex<HashMap<u64, Arc<Slot>>>,
    /// Signalled (under `slots`) when a file gets its slot or fails: what a block that
    /// overtook its entry waits for (see [`SinkLimits::entry_wait`]).
    settled: Condvar,
    failed: Mutex<HashSet<u64>>,
    dirs: Mutex<Vec<DirMeta>>,
    dirs_cache: DirCache,
    temps: TempStrategy,
    open_files: AtomicUsize,
    /// Bytes written with `O_DIRECT`, and the first reason files were not, for the report.
    direct_bytes: AtomicU64,
    io_fallback: OnceLock<String>,
    journal: Option<Arc<JournalFile>>,
    committer: Option<Committer>,
    report: Report,
    /// What could not be preserved here.
    notes: Arc<Notes>,
    /// `--preserve hardlinks`: the files other names may link to.
    links: Option<Arc<Links>>,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl Sink {
    /// `target` is `None` to discard data after checking it. `report` hears of every file
    /// that waited for data: in place (durable, named) or failed.
    pub fn new(
        target: Option<(Root, Placement)>,
        peer: String,
        transfer_tag: u64,
        required_checks: u8,
        limits: SinkLimits,
        journal: Option<Arc<JournalFile>>,
        report: Report,
    ) -> Result<Sink, Error> {
        let direct = target
            .as_ref()
            .is_some_and(|(root, _)| limits.write.is_direct_beneath(root.fd()));
        let notes = Arc::new(Notes::default());
        let links = match &target {
            Some((root, _)) if limits.preserve.hardlinks => Some(Arc::new(Links::new(
                root,
                transfer_tag,
                peer.clone(),
                limits.marked_links,
            )?)),
            _ => None,
        };
        let committer = match target {
            Some(_) => Some(Committer::start(
                limits.durable,
                journal.clone(),
                report.clone(),
                (limits.preserve, notes.clone()),
                links.clone(),
            )?),
            None => None,
        };
        Ok(Sink {
            target,
            peer,
            transfer_tag,
            required_checks,
            limits,
            direct,
            slots: Mutex::default(),
            settled: Condvar::new(),
            failed: Mutex::default(),
            dirs: Mutex::default(),
            dirs_cache: DirCache::default(),
            temps: TempStrategy::default(),
            open_files: AtomicUsize::new(0),
            direct_bytes: AtomicU64::new(0),
            io_fallback: OnceLock::new(),
            journal,
            committer,
            report,
            notes,
            links,
        })
    }

    /// Notes that this side will not keep something of kind `key` (once per kind).
    pub fn note(&self, key: String, text: String) {
        self.notes.add(key, || text);
    }

    /// What could not be preserved here since the last call, once per kind.
    pub fn take_notes(&self) -> Vec<String> {
        self.notes.take()
    }

    /// Gives a file already in place what the session preserves (it was not sent).
    fn preserve_in_place(&self, file: &std::fs::File, meta: Option<&EntryMeta>, dest: &RelPath) {
        if !self.limits.preserve.is_empty() {
            preserve::apply(
                file.as_fd(),
                meta,
                self.limits.preserve,
                &self.show(dest),
                &self.notes,
            );
        }
    }

    /// How this side wrote what it received, for the session's report.
    pub fn io_use(&self) -> IoUse {
        let mode = match (&self.target, self.direct) {
            (None, _) => "discard",
            (Some(_), true) => "direct",
            (Some(_), false) => "buffered",
        };
        IoUse {
            mode: mode.to_string(),
            direct_bytes: self.direct_bytes.load(Ordering::Relaxed),
            fallback: self.io_fallback.get().cloned(),
        }
    }

    /// Counts bytes written direct, and notes when a file meant to be written direct got
    /// a whole aligned stretch through the page cache because the block's memory was not
    /// page-aligned (fabric blocks land after their header in the slot).
    fn count_direct(&self, temp: &TempFile, data: &[u8], direct: usize) {
        self.direct_bytes
            .fetch_add(direct as u64, Ordering::Relaxed);
        if temp.is_direct() && direct == 0 && data.len() >= fs::DIRECT_ALIGN {
            self.note_fallback(
                "O_DIRECT: received blocks were not page-aligned (in memory or in the file), so \
                 they were written through the page cache",
            );
        }
    }

    fn note_fallback(&self, why: &str) {
        let _ = self.io_fallback.set(why.to_string());
    }

    fn show(&self, rel: &RelPath) -> String {
        match &self.target {
            Some((root, _)) => root.show(rel),
            None => format!("(discarded) {rel}"),
        }
    }

    /// Takes in one manifest entry and says what the sender must send of it.
    /// Directories, symlinks and files already in place need nothing; a file with data
    /// waits for it (and may hold part of it already); one that cannot be received here
    /// fails alone, with the error this side reports (the inner `Err`). The outer `Err`
    /// is for failures that end the session (a full disk, a peer breaking the protocol).
    pub fn place(&self, id: u64, entry: &Entry) -> Result<Result<Applied, Error>, Error> {
        let Some((root, placement)) = &self.target else {
            return Ok(Ok(self.discard_entry(id, entry)));
        };
        let dest = placement
            .map(&entry.path)
            .map_err(|reason| Error::protocol(&self.peer, reason))?;
        if let (Some(links), Some(target)) = (&self.links, link_of(entry)) {
            return self.place_link(links, id, target, dest, entry);
        }
        let links = self
            .links
            .as_ref()
            .filter(|_| entry.kind == EntryKind::File);
        if let Some(links) = links {
            // Before it is placed: an empty file is committed (and settled) at once.
            let linkable = entry.meta.as_ref().is_some_and(|m| m.linkable);
            links.file(id, &dest, linkable);
        }
        let placed = self.place_entry(root, id, &dest, entry);
        if let Some(links) = links {
            match &placed {
                Ok(Applied::UpToDate) => self.linkable(links, id, true)?,
                Err(_) => self.linkable(links, id, false)?,
                _ => {}
            }
        }
        match placed {
            Err(e) if is_fatal(&e) => Err(e),
            Err(e) => {
                // Data a fresh pull's sender sent behind the entry is dropped.
                self.mark_failed(id);
                Ok(Err(e))
            }
            placed => Ok(placed),
        }
    }

    /// Link entry `id` (`--preserve hardlinks`): another name at `dest` of entry
    /// `target`'s file, linked once that is in place.
    fn place_link(
        &self,
        links: &Links,
        id: u64,
        target: u64,
        dest: RelPath,
        entry: &Entry,
    ) -> Result<Result<Applied, Error>, Error> {
        let link = Link {
            id,
            target,
            dest,
            mode: entry.mode,
            mtime_sec: entry.mtime_sec,
            mtime_nsec: entry.mtime_nsec,
            meta: entry.meta.clone(),
        };
        match links.link(link)? {
            Ready::Later => Ok(Ok(Applied::Pending)),
            Ready::Failed(e) => Ok(Err(e)),
            Ready::Now(link, target) => {
                if self.limits.compare != Compare::Always && links.same_file(&link.dest, &target) {
                    return Ok(Ok(Applied::UpToDate));
                }
                self.committer
                    .as_ref()
                    .expect("a sink with a target commits")
                    .link(link, target)?;
                Ok(Ok(Applied::Pending))
            }
        }
    }

    /// File `id` is in place (`placed`) or failed here: the names waiting for it are
    /// linked, or fail with it, each alone.
    fn linkable(&self, links: &Links, id: u64, placed: bool) -> Result<(), Error> {
        let settled = links.settle(id, placed);
        for (id, error) in settled.fail {
            (self.report)(id, Err(error));
        }
        let committer = self
            .committer
            .as_ref()
            .expect("a sink with a target commits");
        for (link, target) in settled.link {
            committer.link(link, target)?;
        }
        Ok(())
    }

    /// [`Sink::place`], a file failing alone told as the peer hears it.
    pub fn apply_entry(&self, id: u64, entry: &Entry) -> Result<Applied, Error> {
        Ok(self
            .place(id, entry)?
            .unwrap_or_else(|e| Applied::Failed(failure(&e))))
    }

    fn discard_entry(&self, id: u64, entry: &Entry) -> Applied {
        if entry.kind != EntryKind::File || entry.size == 0 || link_of(entry).is_some() {
            return Applied::Done;
        }
        self.insert_slot(id, entry.path.clone(), entry, SlotState::default());
        Applied::Pending
    }

    fn place_entry(
        &self,
        root: &Root,
        id: u64,
        dest: &RelPath,
        entry: &Entry,
    ) -> Result<Applied, Error> {
        let (parent, name) = dest.split_last().ok_or_else(|| Error::Refused {
            path: root.show(dest),
            reason: "an entry names the destination root itself".into(),
        })?;
        let dir = self.dirs_cache.get(root, &parent).map_err(|e| match e {
            Error::Refused { path, reason } => Error::Refused {
                path,
                reason: format!("cannot place {} there: {reason}", root.show(dest)),
            },
            other => other,
        })?;
        let io = |op, e| Error::local(op, root.show(dest), e);
        let existing = fs::meta_at(dir.as_fd(), name).map_err(|e| io("stat", e))?;
        let compare = self.limits.compare != Compare::Always;
        let committer = self
            .committer
            .as_ref()
            .expect("a sink with a target commits");
        match entry.kind {
            EntryKind::Dir => {
                fs::ensure_dir(dir.as_fd(), name).map_err(|e| io("create directory", e))?;
                self.dirs
                    .lock()
                    .expect("no panics while held")
                    .push(DirMeta {
                        dest: dest.clone(),
                        mode: entry.mode,
                        mtime_sec: entry.mtime_sec,
                        mtime_nsec: entry.mtime_nsec,
                        meta: entry.meta.clone(),
                    });
                Ok(Applied::Done)
            }
            EntryKind::Symlink => {
                if compare
                    && existing.is_some_and(|m| m.kind == Kind::Symlink)
                    && fs::read_link_at(dir.as_fd(), name).is_ok_and(|t| t == entry.link_target)
                {
                    return Ok(Applied::UpToDate);
                }
                committer.symlink(
                    id,
                    Symlink {
                        dir,
                        name: name.to_vec(),
                        target: entry.link_target.clone(),
                        tag: self.transfer_tag,
                        mtime_sec: entry.mtime_sec,
                        mtime_nsec: entry.mtime_nsec,
                        shown: root.show(dest),
                        meta: entry.meta.clone(),
                    },
                )?;
                self.insert_slot(id, dest.clone(), entry, SlotState::default());
                Ok(Applied::Pending)
            }
            EntryKind::File => {
                let same = existing.is_some_and(|m| {
                    m.kind == Kind::File
                        && m.size == entry.size
                        && (m.mtime_sec, m.mtime_nsec) == (entry.mtime_sec, entry.mtime_nsec)
                });
                if compare && same {
                    self.forget_partial(&dir, dest)?;
                    // Opened (never through a symlink) only when there is a mode to fix:
                    // a re-run of a big tree is mostly this one stat per file.
                    if !self.limits.preserve.is_empty() {
                        let file =
                            fs::open_file_at(dir.as_fd(), name).map_err(|e| io("open", e))?;
                        self.preserve_in_place(&file, entry.meta.as_deref(), dest);
                        fs::apply_meta(file.as_fd(), entry.mode, entry.mtime_sec, entry.mtime_nsec)
                            .map_err(|e| io("set the mode of", e))?;
                    } else if existing
                        .is_some_and(|m| m.mode & fs::MODE_MASK != entry.mode & fs::MODE_MASK)
                    {
                        fs::fix_mode_at(dir.as_fd(), name, entry.mode)
                            .map_err(|e| io("set the mode of", e))?;
                    }
                    return Ok(Applied::UpToDate);
                }
                let sparse = entry.meta.as_ref().and_then(|m| m.data.as_ref());
                if entry.size == 0 || sparse.is_some_and(|data| data.is_empty()) {
                    // Empty, or all hole: nothing will arrive.
                    let temp = TempFile::create(
                        dir,
                        name,
                        self.transfer_tag,
                        entry.mode,
                        Some(&self.temps),
                    )
                    .map_err(|e| io("create", e))?;
                    if entry.size > 0 {
                        temp.file
                            .set_len(entry.size)
                            .map_err(|e| io("set the size of", e))?;
                    }
                    self.insert_slot(id, dest.clone(), entry, SlotState::default());
                    self.complete(
                        id,
                        temp,
                        entry.mode,
                        entry.mtime_sec,
                        entry.mtime_nsec,
                        entry.size,
                        dest,
                        None,
                        entry.meta.clone(),
                    )?;
                    return Ok(Applied::Pending);
                }
                if let Some((state, mut held)) = self.resume(&dir, name, dest, entry)? {
                    if let Some(data) = sparse {
                        // Only data was ever written; a range over a hole is from
                        // another layout of the source and is sent again.
                        held.retain(|r| {
                            let end = r.offset + u64::from(r.len);
                            data.iter().any(|&(s, e)| s <= r.offset && end <= e)
                        });
                    }
                    self.insert_slot(id, dest.clone(), entry, state);
                    return Ok(Applied::Held(held));
                }
                // A sparse file's holes are not compared: its data is sent.
                if self.limits.compare == Compare::Checksum
                    && sparse.is_none()
                    && existing.is_some_and(|m| m.kind == Kind::File && m.size == entry.size)
                {
                    let held = self
                        .digests_in_place(&dir, name, entry.size)
                        .map_err(|e| io("read", e))?;
                    let state = SlotState {
                        in_place: true,
                        ..SlotState::default()
                    };
                    self.insert_slot(id, dest.clone(), entry, state);
                    return Ok(Applied::Held(held));
                }
                self.insert_slot(id, dest.clone(), entry, SlotState::default());
                Ok(Applied::Pending)
            }
            _ => Err(Error::Refused {
                path: root.show(dest),
                reason: "unsupported kind of entry".into(),
            }),
        }
    }

    /// What an interrupted run of this transfer left of `dest`: its reopened temporary,
    /// ready to be written again, and the verified ranges the journal lists for it (not
    /// yet counted: the sender checks them first). A partial file of another version of
    /// the source is dropped.
    fn resume(
        &self,
        dir: &Arc<std::os::fd::OwnedFd>,
        name: &[u8],
        dest: &RelPath,
        entry: &Entry,
    ) -> Result<Option<(SlotState, Vec<HeldRange>)>, Error> {
        let Some(journal) = &self.journal else {
            return Ok(None);
        };
        let Some((file, partial)) = journal.replayed().find(dest.as_bytes()) else {
            return Ok(None);
        };
        let same_source = partial.size == entry.size
            && (partial.mtime_sec, partial.mtime_nsec) == (entry.mtime_sec, entry.mtime_nsec)
            && partial.temp_name == fs::temp_name(self.transfer_tag, name);
        let reopened = if same_source && !partial.ranges.is_empty() {
            TempFile::reopen(dir.clone(), name, self.transfer_tag)
                .map_err(|e| Error::local("reopen the partial file of", self.show(dest), e))?
        } else {
            None
        };
        let Some(mut temp) = reopened else {
            self.forget_partial(dir, dest)?;
            return Ok(None);
        };
        let sparse = entry.meta.as_ref().is_some_and(|m| m.data.is_some());
        self.open_temp(&mut temp, entry.size, sparse, dest)?;
        // The journal stops vouching for the held ranges until the sender has checked
        // them: a range it refuses is written again, and should a crash keep some of the
        // new bytes, a later run must not take them for the old ones. The file goes on
        // under a new number whose ranges are only those accepted or written since, and
        // that is durable before any byte of the temporary changes.
        let renewed = journal.next_file();
        let shown = self.show(dest);
        journal
            .append(&[
                Record::Closed { file },
                Record::Partial {
                    file: renewed,
                    dest: dest.as_bytes().to_vec(),
                    size: partial.size,
                    mtime_sec: partial.mtime_sec,
                    mtime_nsec: partial.mtime_nsec,
                    temp_name: partial.temp_name.clone(),
                },
            ])
            .and_then(|()| journal.sync())
            .map_err(|e| Error::Limit(format!("{shown}: cannot resume: {e}")))?;
        let state = SlotState {
            temp: Some(Arc::new(temp)),
            journaled: Some(renewed),
            ..SlotState::default()
        };
        Ok(Some((state, partial.ranges.clone())))
    }

    /// Drops what an interrupted run left of `dest` (the file is in place, or its source
    /// changed). Durably: a temporary of the same name may be written next, and a crash
    /// must not leave the journal vouching for its new bytes with the old digests.
    fn forget_partial(&self, dir: &std::os::fd::OwnedFd, dest: &RelPath) -> Result<(), Error> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        let Some((file, partial)) = journal.replayed().find(dest.as_bytes()) else {
            return Ok(());
        };
        journal
            .append(&[Record::Closed { file }])
            .and_then(|()| journal.sync())?;
        if fs::is_temp_name(&partial.temp_name) {
            let _ = rustix::fs::unlinkat(
                dir,
                std::ffi::OsStr::from_bytes(&partial.temp_name),
                rustix::fs::AtFlags::empty(),
            );
        }
        Ok(())
    }

    /// The digests of a file in place, chunk by chunk at the session's block boundaries,
    /// for comparison by checksum.
    fn digests_in_place(
        &self,
        dir: &std::os::fd::OwnedFd,
        name: &[u8],
        size: u64,
    ) -> std::io::Result<Vec<HeldRange>> {
        use std::os::unix::fs::FileExt;
        let file = fs::open_file_at(dir.as_fd(), name)?;
        let mut buf = vec![0u8; crate::digest::IN_CACHE_PIECE_BYTES];
        let mut held = Vec::new();
        for (offset, len) in wanxfer_session::chunks(&[(0, size)], self.limits.block_size) {
            let mut hasher = crate::digest::FileHasher::new();
            let mut at = 0u64;
            while at < u64::from(len) {
                let n = (u64::from(len) - at).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..n], offset + at)?;
                hasher.update(&buf[..n]);
                at += n as u64;
            }
            held.push(HeldRange {
                offset,
                len,
                digest: hasher.digest(),
            });
            if held.len() >= wanxfer_proto::MAX_HELD_RANGES_PER_FILE {
                break;
            }
        }
        Ok(held)
    }

    fn insert_slot(&self, id: u64, dest: RelPath, entry: &Entry, mut state: SlotState) {
        if state.temp.is_some() {
            self.open_files.fetch_add(1, Ordering::Relaxed);
        }
        let holes = holes(entry);
        for &(start, end) in holes.iter().flatten() {
            // At most MAX_DATA_RANGES_PER_ENTRY + 1 apart holes, before any data.
            let _ = state.coverage.add(start, end);
        }
        let slot = Arc::new(Slot {
            sparse: holes.is_some(),
            dest,
            size: entry.size,
            mode: entry.mode,
            mtime_sec: entry.mtime_sec,
            mtime_nsec: entry.mtime_nsec,
            meta: entry.meta.clone(),
            state: Mutex::new(state),
        });
        self.slots
            .lock()
            .expect("no panics while held")
            .insert(id, slot);
        self.settled.notify_all();
    }

    /// Marks file `id` failed here: its blocks, sent or still coming, are dropped.
    fn mark_failed(&self, id: u64) {
        self.failed.lock().expect("no panics while held").insert(id);
        // Under the lock a waiting block holds while it looks, so it cannot miss this.
        let _slots = self.slots.lock().expect("no panics while held");
        self.settled.notify_all();
    }

    /// Drops a pending file (the sender could not read it, or it failed here), removing
    /// its temporary. Later blocks for it are ignored.
    pub fn abandon(&self, id: u64) {
        if let Some(links) = &self.links {
            // Nothing is queued for the committer when a file fails.
            let _ = self.linkable(links, id, false);
        }
        self.mark_failed(id);
        if let Some(slot) = self.slots.lock().expect("no panics while held").remove(&id) {
            let mut state = slot.state.lock().expect("no panics while held");
            state.abandoned = true;
            if state.temp.take().is_some() {
                self.open_files.fetch_sub(1, Ordering::Relaxed);
            }
            if let (Some(file), Some(journal)) = (state.journaled, &self.journal) {
                // Durable before a later run may write a temporary of the same name.
                let _ = journal
                    .append(&[Record::Closed { file }])
                    .and_then(|()| journal.sync());
            }
        }
    }

    /// The sender confirmed these held ranges of `id`: they count as received.
    pub fn accept(&self, id: u64, ranges: &[HeldRange]) -> Result<(), Error> {
        let Some(slot) = self.pending_slot(id)? else {
            return Ok(());
        };
        let mut state = slot.state.lock().expect("no panics while held");
        if state.abandoned {
            return Ok(());
        }
        if state.in_place && !ranges.is_empty() {
            let all = ranges.iter().map(|r| u64::from(r.len)).sum::<u64>() == slot.size;
            if all {
                // The file in place is the source's, byte for byte: only its metadata
                // may differ.
                drop(state);
                return self.keep_in_place(id, &slot);
            }
            if let Err(e) = self.copy_in_place(&slot, &mut state, ranges) {
                drop(state);
                return self.fail_or_abort(id, e);
            }
        }
        for r in ranges {
            let end = r.offset + u64::from(r.len);
            if end > slot.size {
                return Err(Error::protocol(
                    &self.peer,
                    format!("{}: a held range past its size", self.show(&slot.dest)),
                ));
            }
            state.coverage.add(r.offset, end).map_err(|e| {
                Error::protocol(&self.peer, format!("{}: {e}", self.show(&slot.dest)))
            })?;
        }
        // Copied into the temporary, or held there from an earlier run (whose journal
        // entry was closed until now): journal them as any other verified range.
        state.unjournaled.extend_from_slice(ranges);
        self.maybe_complete(id, &slot, state)
    }

    fn keep_in_place(&self, id: u64, slot: &Slot) -> Result<(), Error> {
        let Some((root, _)) = &self.target else {
            return Ok(());
        };
        self.slots.lock().expect("no panics while held").remove(&id);
        let (parent, name) = slot.dest.split_last().expect("files are never the root");
        let result = self.dirs_cache.get(root, &parent).and_then(|dir| {
            let file = fs::open_file_at(dir.as_fd(), name)
                .map_err(|e| Error::local("open", self.show(&slot.dest), e))?;
            self.preserve_in_place(&file, slot.meta.as_deref(), &slot.dest);
            fs::apply_meta(file.as_fd(), slot.mode, slot.mtime_sec, slot.mtime_nsec)
                .map_err(|e| Error::local("set the metadata of", self.show(&slot.dest), e))
        });
        let placed = result.is_ok();
        (self.report)(id, result);
        match &self.links {
            Some(links) => self.linkable(links, id, placed),
            None => Ok(()),
        }
    }

    /// Copies confirmed ranges of the file in place into a new temporary.
    fn copy_in_place(
        &self,
        slot: &Slot,
        state: &mut SlotState,
        ranges: &[HeldRange],
    ) -> Result<(), Error> {
        let Some((root, _)) = &self.target else {
            return Ok(());
        };
        let (parent, name) = slot.dest.split_last().expect("files are never the root");
        let dir = self.dirs_cache.get(root, &parent)?;
        let local = |op, e| Error::local(op, self.show(&slot.dest), e);
        let source = fs::open_file_at(dir.as_fd(), name).map_err(|e| local("open", e))?;
        let temp = self
            .ensure_temp(slot, state, false)?
            .expect("a sink with a target has temporaries");
        for r in ranges {
            fs::copy_range(&source, &temp.file, r.offset, u64::from(r.len))
                .map_err(|e| local("copy", e))?;
        }
        Ok(())
    }

    /// Places every segment of a received block; a segment that failed its check on
    /// arrival fails its file. Per-file outcomes go to the report; `Err` ends the session.
    pub fn place_block(&self, block: Block) -> Result<(), Error> {
        if block.checks & self.required_checks != self.required_checks {
            return Err(Error::protocol(
                &self.peer,
                "a block without the checks this session agreed on",
            ));
        }
        let mut pos = 0usize;
        for (index, seg) in block.segments.iter().enumerate() {
            let data = block.slice(pos, seg.len as usize);
            pos += seg.len as usize;
            if block.is_damaged(index) {
                self.fail_damaged(seg)?;
                continue;
            }
            self.place_segment(seg, data)?;
        }
        Ok(())
    }

    fn fail_damaged(&self, seg: &Segment) -> Result<(), Error> {
        let Some(slot) = self.pending_slot(seg.file_id)? else {
            return Ok(());
        };
        self.abandon(seg.file_id);
        (self.report)(
            seg.file_id,
            Err(Error::Integrity {
                path: self.show(&slot.dest),
                offset: seg.offset,
                detail: format!(
                    "{} bytes from {} do not match the checksum sent with them",
                    seg.len, self.peer
                ),
            }),
        );
        Ok(())
    }

    #[cfg(test)]
    fn slot(&self, id: u64) -> Option<Arc<Slot>> {
        self.slots
            .lock()
            .expect("no panics while held")
            .get(&id)
            .cloned()
    }

    /// The slot data for `id` goes to; `None` for a file that already failed (its late
    /// blocks are dropped); an error for an id the peer never announced (or announced
    /// but has not yet seen acknowledged, which an honest sender never does).
    fn pending_slot(&self, id: u64) -> Result<Option<Arc<Slot>>, Error> {
        let deadline = self.limits.entry_wait.map(|wait| Instant::now() + wait);
        let mut slots = self.slots.lock().expect("no panics while held");
        loop {
            if let Some(slot) = slots.get(&id) {
                return Ok(Some(slot.clone()));
            }
            if self
                .failed
                .lock()
                .expect("no panics while held")
                .contains(&id)
            {
                return Ok(None);
            }
            let left = deadline.and_then(|d| d.checked_duration_since(Instant::now()));
            let Some(left) = left.filter(|left| !left.is_zero()) else {
                return Err(Error::protocol(
                    &self.peer,
                    format!("data for file id {id} which is not pending"),
                ));
            };
            slots = self
                .settled
                .wait_timeout(slots, left)
                .expect("no panics while held")
                .0;
        }
    }

    fn place_segment(&self, seg: &Segment, data: &[u8]) -> Result<(), Error> {
        let Some(slot) = self.pending_slot(seg.file_id)? else {
            return Ok(());
        };
        let end = seg.offset + u64::from(seg.len);
        if end > slot.size {
            return Err(Error::protocol(
                &self.peer,
                format!(
                    "{}: data up to offset {end} past the announced size {}",
                    self.show(&slot.dest),
                    slot.size
                ),
            ));
        }
        // A file that cannot be created here (permissions, a name the file system
        // refuses) fails alone; a full disk or a peer past its limits ends the session.
        let temp = match self.prepare(seg, &slot) {
            Ok(temp) => temp,
            Err(e) => return self.fail_or_abort(seg.file_id, e),
        };
        if let Some(temp) = &temp {
            match temp.write_at(data, seg.offset) {
                Ok(direct) => self.count_direct(temp, data, direct),
                Err(e) => {
                    let error = Error::local("write", self.show(&slot.dest), e);
                    return self.fail_or_abort(seg.file_id, error);
                }
            }
        }
        drop(temp);
        self.record(seg, &slot)
    }

    /// Opens the file's temporary on first use.
    fn prepare(&self, seg: &Segment, slot: &Slot) -> Result<Option<Arc<TempFile>>, Error> {
        if self.target.is_none() {
            return Ok(None);
        }
        let mut state = slot.state.lock().expect("no panics while held");
        if state.abandoned {
            return Ok(None);
        }
        // Refused before a byte of it is written (a race between two writers with
        // overlapping data is still caught when the range is recorded).
        let end = seg.offset + u64::from(seg.len);
        state
            .coverage
            .check_free(seg.offset, end)
            .map_err(|e| Error::protocol(&self.peer, format!("{}: {e}", self.show(&slot.dest))))?;
        let whole = u64::from(seg.len) == slot.size;
        self.ensure_temp(slot, &mut state, whole)
    }

    /// The file's temporary, created if it has none: a file that comes in one segment is
    /// written in one call, needs nothing reserved, and is worth nothing if the session
    /// dies, so it needs no name until it is complete. A larger file keeps a named
    /// temporary while it grows (journaled, so that a later run resumes it), has its size
    /// reserved, and is written direct where that pays.
    fn ensure_temp(
        &self,
        slot: &Slot,
        state: &mut SlotState,
        whole: bool,
    ) -> Result<Option<Arc<TempFile>>, Error> {
        let Some((root, _)) = &self.target else {
            return Ok(None);
        };
        if state.temp.is_none() {
            if self.open_files.load(Ordering::Relaxed) >= self.limits.max_open_files {
                return Err(Error::Limit(format!(
                    "{} sends more than {} files at once",
                    self.peer, self.limits.max_open_files
                )));
            }
            let (parent, name) = slot.dest.split_last().expect("files are never the root");
            let dir = self.dirs_cache.get(root, &parent)?;
            let unnamed = whole.then_some(&self.temps);
            let mut temp = TempFile::create(dir, name, self.transfer_tag, slot.mode, unnamed)
                .map_err(|e| Error::local("create", self.show(&slot.dest), e))?;
            if !whole {
                self.open_temp(&mut temp, slot.size, slot.sparse, &slot.dest)?;
                if let (Some(journal), Some(temp_name)) = (&self.journal, temp.name()) {
                    let file = journal.next_file();
                    journal.append(&[Record::Partial {
                        file,
                        dest: slot.dest.as_bytes().to_vec(),
                        size: slot.size,
                        mtime_sec: slot.mtime_sec,
                        mtime_nsec: slot.mtime_nsec,
                        temp_name: temp_name.to_vec(),
                    }])?;
                    state.journaled = Some(file);
                }
            }
            self.open_files.fetch_add(1, Ordering::Relaxed);
            state.temp = Some(Arc::new(temp));
        }
        Ok(state.temp.clone())
    }

    /// Reserves a multi-block temporary's size (a sparse one's is only set, leaving its
    /// holes unallocated) and opens its direct handle.
    fn open_temp(
        &self,
        temp: &mut TempFile,
        size: u64,
        sparse: bool,
        dest: &RelPath,
    ) -> Result<(), Error> {
        let local = |op, e| Error::local(op, self.show(dest), e);
        if sparse {
            temp.file
                .set_len(size)
                .map_err(|e| local("set the size of", e))?;
        } else {
            temp.reserve(size)
                .map_err(|e| local("reserve space for", e))?;
        }
        if self.direct {
            let direct = temp
                .write_direct()
                .map_err(|e| local("open for direct I/O", e))?;
            if !direct {
                self.note_fallback(
                    "O_DIRECT: the destination's file system refused it, so files \
                     were written through the page cache",
                );
            }
        }
        Ok(())
    }

    fn fail_or_abort(&self, id: u64, error: Error) -> Result<(), Error> {
        self.abandon(id);
        if is_fatal(&error) {
            Err(error)
        } else {
            (self.report)(id, Err(error));
            Ok(())
        }
    }

    /// Records the range and, if the file is now complete, hands it to the committer; a
    /// partial file's verified ranges are journaled every `checkpoint_bytes`.
    fn record(&self, seg: &Segment, slot: &Arc<Slot>) -> Result<(), Error> {
        let mut state = slot.state.lock().expect("no panics while held");
        if state.abandoned {
            return Ok(());
        }
        let end = seg.offset + u64::from(seg.len);
        state
            .coverage
            .add(seg.offset, end)
            .map_err(|e| Error::protocol(&self.peer, format!("{}: {e}", self.show(&slot.dest))))?;
        if state.journaled.is_some() {
            state.unjournaled.push(HeldRange {
                offset: seg.offset,
                len: seg.len,
                digest: seg.digest,
            });
            state.unjournaled_bytes += u64::from(seg.len);
        }
        self.maybe_complete(seg.file_id, slot, state)
    }

    fn maybe_complete(
        &self,
        id: u64,
        slot: &Arc<Slot>,
        mut state: std::sync::MutexGuard<'_, SlotState>,
    ) -> Result<(), Error> {
        if !state.coverage.is_complete(slot.size) {
            if state.unjournaled_bytes >= self.limits.checkpoint_bytes {
                if let (Some(file), Some(temp), Some(committer)) =
                    (state.journaled, &state.temp, &self.committer)
                {
                    let temp = temp.clone();
                    let ranges = std::mem::take(&mut state.unjournaled);
                    state.unjournaled_bytes = 0;
                    drop(state);
                    committer.checkpoint(file, temp, ranges)?;
                }
            }
            return Ok(());
        }
        let temp = state.temp.take();
        let journaled = state.journaled;
        drop(state);
        self.slots.lock().expect("no panics while held").remove(&id);
        let Some(temp) = temp else {
            // Discarding: complete is all there is to check.
            (self.report)(id, Ok(()));
            return Ok(());
        };
        self.open_files.fetch_sub(1, Ordering::Relaxed);
        // Every writer drops its clone before recording its range, and a checkpoint holds
        // one only until its batch is synced, so only a writer holding data that overlaps
        // the complete file (or a checkpoint in flight) can still hold one.
        let temp = match Arc::try_unwrap(temp) {
            Ok(temp) => temp,
            Err(shared) => match self.wait_alone(shared) {
                Some(temp) => temp,
                None => {
                    return Err(Error::protocol(
                        &self.peer,
                        format!("{}: overlapping data for one file", self.show(&slot.dest)),
                    ))
                }
            },
        };
        let dest = slot.dest.clone();
        self.complete(
            id,
            temp,
            slot.mode,
            slot.mtime_sec,
            slot.mtime_nsec,
            slot.size,
            &dest,
            journaled,
            slot.meta.clone(),
        )
    }

    /// Waits briefly for a checkpoint in flight to let go of a temporary.
    fn wait_alone(&self, mut shared: Arc<TempFile>) -> Option<TempFile> {
        for _ in 0..2000 {
            match Arc::try_unwrap(shared) {
                Ok(temp) => return Some(temp),
                Err(again) => shared = again,
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        None
    }

    #[allow(clippy::too_many_arguments)]
    fn complete(
        &self,
        id: u64,
        temp: TempFile,
        mode: u32,
        mtime_sec: i64,
        mtime_nsec: u32,
        bytes: u64,
        dest: &RelPath,
        journaled: Option<u32>,
        meta: Option<Box<EntryMeta>>,
    ) -> Result<(), Error> {
        if self.limits.durable {
            fs::start_writeback(&temp.file);
        }
        let committer = self
            .committer
            .as_ref()
            .expect("a sink with a target commits");
        committer.commit(Complete {
            id,
            temp,
            mode,
            mtime_sec,
            mtime_nsec,
            bytes,
            shown: self.show(dest),
            journaled,
            meta,
        })
    }

    /// Ends the sink: everything complete is committed, directories get their final
    /// modes (also when the transfer failed), and the journal goes if the transfer
    /// completed. Otherwise every partial file's verified ranges are made durable and
    /// journaled, the space reserved beyond them is given back, and its temporary is kept
    /// for the next run to resume.
    pub fn close(&self, completed: bool) -> Vec<Error> {
        if let Some(committer) = &self.committer {
            committer.finish();
        }
        let slots: Vec<Arc<Slot>> = self
            .slots
            .lock()
            .expect("no panics while held")
            .drain()
            .map(|(_, s)| s)
            .collect();
        let mut errors = Vec::new();
        if !completed {
            for slot in slots {
                if let Err(e) = self.keep_partial(&slot) {
                    errors.push(e);
                }
            }
        }
        if let Some(journal) = &self.journal {
            if let Err(e) = journal.sync() {
                errors.push(e);
            }
        }
        errors.extend(self.finish_dirs());
        errors
    }

    /// The journal, to remove once the session completed (see [`JournalFile::remove`]).
    pub fn journal(&self) -> Option<&Arc<JournalFile>> {
        self.journal.as_ref()
    }

    fn keep_partial(&self, slot: &Slot) -> Result<(), Error> {
        let mut state = slot.state.lock().expect("no panics while held");
        let (Some(file), Some(journal)) = (state.journaled, &self.journal) else {
            return Ok(()); // unnamed or unjournaled: goes with its descriptor
        };
        let Some(temp) = state.temp.take() else {
            return Ok(());
        };
        let Ok(mut temp) = Arc::try_unwrap(temp) else {
            return Ok(()); // still held by a writer: let it go
        };
        let local = |op, e| Error::local(op, self.show(&slot.dest), e);
        if self.limits.durable {
            fs::sync_data(&temp.file).map_err(|e| local("sync", e))?;
        }
        let ranges = std::mem::take(&mut state.unjournaled);
        for chunk in ranges.chunks(wanxfer_proto::MAX_HELD_RANGES) {
            journal.append(&[Record::Verified {
                file,
                ranges: chunk.to_vec(),
            }])?;
        }
        for (start, end) in state.coverage.gaps(slot.size) {
            let _ = fs::release_space(&temp.file, start, end);
        }
        temp.keep();
        Ok(())
    }

    /// Applies directory modes and mtimes, deepest first, once nothing more will be
    /// written into them: before the session's last word, so that the peer, once told
    /// the transfer is done, finds the tree finished. (Again at close, for a transfer
    /// that failed: its directories get their modes too.)
    pub fn finish_dirs(&self) -> Vec<Error> {
        let Some((root, _)) = &self.target else {
            return Vec::new();
        };
        let mut dirs = std::mem::take(&mut *self.dirs.lock().expect("no panics while held"));
        dirs.sort_by_key(|d| std::cmp::Reverse(d.dest.components().count()));
        dirs.iter()
            .filter_map(|d| {
                root.dir(&d.dest)
                    .and_then(|fd| {
                        if !self.limits.preserve.is_empty() {
                            preserve::apply(
                                fd.as_fd(),
                                d.meta.as_deref(),
                                self.limits.preserve,
                                &root.show(&d.dest),
                                &self.notes,
                            );
                        }
                        fs::apply_meta(fd.as_fd(), d.mode, d.mtime_sec, d.mtime_nsec).map_err(|e| {
                            Error::local("set directory metadata", root.show(&d.dest), e)
                        })
                    })
                    .err()
            })
            .collect()
    }
}

/// The earlier entry whose file `entry` is another name of (`--preserve hardlinks`).
fn link_of(entry: &Entry) -> Option<u64> {
    entry.meta.as_ref().and_then(|m| m.link)
}

/// The session's view of a per-file error.
pub fn failure(e: &Error) -> Failure {
    Failure {
        class: e.wire_class(),
        offset: match e {
            Error::Integrity { offset, .. } => *offset,
            _ => 0,
        },
        message: e.to_string(),
        remote: false,
    }
}

/// Errors that would repeat for every following file: no point going on.
pub fn is_fatal(e: &Error) -> bool {
    match e {
        Error::LocalIo { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EROFS) | Some(libc::EIO)
        ),
        Error::Limit(_) | Error::Protocol { .. } | Error::Cancelled => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{check_flags, digest_of, PayloadVerifier};
    use crate::session::state::StateDir;
    use proptest::prelude::*;

    /// What the sink reported, file by file, in order.
    type Verdicts = Arc<Mutex<Vec<(u64, Result<(), String>)>>>;

    struct Harness {
        sink: Sink,
        verdicts: Verdicts,
    }

    impl Harness {
        /// Ends the sink (committing what is complete) and returns the verdicts.
        fn close(self, completed: bool) -> Vec<(u64, Result<(), String>)> {
            let errors = self.sink.close(completed);
            assert!(errors.is_empty(), "{errors:?}");
            let verdicts = self.verdicts.lock().unwrap().clone();
            verdicts
        }
    }

    fn harness(
        dir: &std::path::Path,
        limits: SinkLimits,
        journal: Option<Arc<JournalFile>>,
    ) -> Harness {
        let root = Root::open(dir).unwrap();
        let (placement, _) = Placement::decide(
            &root,
            &RelPath::root(),
            1,
            wanxfer_proto::Placement::Resolve,
        )
        .unwrap();
        let verdicts: Verdicts = Arc::default();
        let seen = verdicts.clone();
        let report: Report = Arc::new(move |id, result: Result<(), Error>| {
            seen.lock()
                .unwrap()
                .push((id, result.map_err(|e| e.to_string())));
        });
        let checks = check_flags(false, true);
        let sink = Sink::new(
            Some((root, placement)),
            "test peer".into(),
            9,
            checks,
            limits,
            journal,
            report,
        )
        .unwrap();
        Harness { sink, verdicts }
    }

    fn sink_in(dir: &std::path::Path) -> Harness {
        harness(dir, SinkLimits::default(), None)
    }

    /// A file at `path` holding `bytes`, with the mtime [`entry`] announces.
    fn in_place(path: &std::path::Path, bytes: &[u8]) {
        std::fs::write(path, bytes).unwrap();
        let time = std::time::UNIX_EPOCH + std::time::Duration::new(1_000_000, 5);
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(time)
            .unwrap();
    }

    fn entry(path: &str, size: u64) -> Entry {
        Entry {
            kind: EntryKind::File,
            path: RelPath::new(path.as_bytes()).unwrap(),
            size,
            mode: 0o640,
            mtime_sec: 1_000_000,
            mtime_nsec: 5,
            link_target: Vec::new(),
            meta: None,
        }
    }

    /// One segment as a test sends it: file id, offset, flags, bytes, digest.
    type Sent<'a> = (u64, u64, u32, &'a [u8], [u8; 16]);

    /// A block of `segments` with the header flags `checks` (no payload CRC), checked as a
    /// channel checks what it receives.
    fn received_many(pool: &crate::pool::Pool, checks: u8, segments: &[Sent]) -> Block {
        let mut block = pool.take(&crate::pool::Cancel::default()).unwrap();
        for &(file_id, offset, flags, data, digest) in segments {
            let at = block.len;
            block.space()[at..at + data.len()].copy_from_slice(data);
            block.len += data.len();
            block.segments.push(Segment {
                file_id,
                offset,
                len: data.len() as u32,
                flags,
                digest,
            });
        }
        let header = wanxfer_proto::BlockHeader {
            flags: checks,
            segment_count: segments.len() as u16,
            payload_len: block.len as u32,
            ..Default::default()
        };
        let mut check = PayloadVerifier::new(&header, &block.segments);
        check.update(&block.segments, block.payload());
        check.settle(&mut block);
        block
    }

    fn received(
        pool: &crate::pool::Pool,
        id: u64,
        offset: u64,
        data: &[u8],
        digest: [u8; 16],
        last: bool,
    ) -> Block {
        let flags = if last { Segment::FLAG_LAST } else { 0 };
        received_many(
            pool,
            check_flags(false, true),
            &[(id, offset, flags, data, digest)],
        )
    }

    /// Feeds `data` as file 0 in chunks of `chunk` bytes, in `order`, each with its digest
    /// except chunk `wrong`.
    fn feed(sink: &Sink, data: &[u8], chunk: usize, order: &[usize], wrong: Option<usize>) {
        let pool = crate::pool::Pool::new(1, chunk);
        let chunks = data.len().div_ceil(chunk);
        for &i in order {
            let start = i * chunk;
            let bytes = &data[start..start + chunk.min(data.len() - start)];
            let digest = if wrong == Some(i) {
                [0xee; 16]
            } else {
                digest_of(bytes)
            };
            sink.place_block(received(
                &pool,
                0,
                start as u64,
                bytes,
                digest,
                i + 1 == chunks,
            ))
            .unwrap();
        }
    }

    fn names_in(dir: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Whatever the arrival order, a file whose chunks all check out lands intact.
        #[test]
        fn any_arrival_order_lands_intact(
            order in Just((0..12usize).collect::<Vec<_>>()).prop_shuffle(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let h = sink_in(dir.path());
            let data: Vec<u8> = (0..12 * 4096 - 100u32).map(|i| (i * 13 % 253) as u8).collect();
            prop_assert_eq!(h.sink.apply_entry(0, &entry("f", data.len() as u64)).unwrap(), Applied::Pending);
            feed(&h.sink, &data, 4096, &order, None);
            let verdicts = h.close(true);
            prop_assert_eq!(verdicts, vec![(0, Ok(()))]);
            prop_assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), data);
        }
    }

    /// A fresh pull (issue 19 item 5): a block that overtook its entry waits for it and
    /// lands; one for a file that then fails here is dropped; one for an entry that
    /// never comes is the peer's error once the wait is over, as it is at once without
    /// the wait.
    #[test]
    fn a_block_ahead_of_its_entry_waits_for_it_in_a_fresh_pull() {
        let dir = tempfile::tempdir().unwrap();
        let limits = SinkLimits::default().fresh(Duration::from_secs(30));
        let h = Arc::new(harness(dir.path(), limits, None));
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 5 % 249) as u8).collect();
        let early = {
            let (h, data) = (h.clone(), data.clone());
            std::thread::spawn(move || {
                let pool = crate::pool::Pool::new(1, 16 << 10);
                h.sink
                    .place_block(received(&pool, 0, 0, &data, digest_of(&data), true))
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!early.is_finished(), "the block waits for its entry");
        h.sink
            .apply_entry(0, &entry("f", data.len() as u64))
            .unwrap();
        early.join().unwrap().unwrap();
        // A file that fails here (a file is where its directory should be) drops what
        // was sent of it.
        std::fs::write(dir.path().join("blocker"), b"").unwrap();
        let dropped = {
            let h = h.clone();
            std::thread::spawn(move || {
                let pool = crate::pool::Pool::new(1, 4096);
                h.sink
                    .place_block(received(&pool, 1, 0, b"abc", digest_of(b"abc"), true))
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(
            h.sink.apply_entry(1, &entry("blocker/x", 3)).unwrap(),
            Applied::Failed(_)
        ));
        dropped.join().unwrap().unwrap();
        let h = Arc::into_inner(h).expect("the threads are done");
        assert_eq!(h.close(true), vec![(0, Ok(()))]);
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), data);

        let short = SinkLimits::default().fresh(Duration::from_millis(20));
        let pool = crate::pool::Pool::new(1, 4096);
        for limits in [short, SinkLimits::default()] {
            let dir = tempfile::tempdir().unwrap();
            let h = harness(dir.path(), limits, None);
            let e = h
                .sink
                .place_block(received(&pool, 7, 0, b"abc", digest_of(b"abc"), true))
                .unwrap_err();
            assert!(e.to_string().contains("not pending"), "{e}");
        }
    }

    #[test]
    fn out_of_order_blocks_land_with_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let h = sink_in(dir.path());
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        h.sink
            .apply_entry(0, &entry("f", data.len() as u64))
            .unwrap();
        feed(
            &h.sink,
            &data,
            4096,
            &[
                3, 1, 0, 2, 24, 5, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                22, 23,
            ],
            None,
        );
        assert_eq!(h.close(true), vec![(0, Ok(()))]);
        let path = dir.path().join("f");
        assert_eq!(std::fs::read(&path).unwrap(), data);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            0o640
        );
        assert_eq!(std::os::unix::fs::MetadataExt::mtime(&meta), 1_000_000);
        assert_eq!(std::os::unix::fs::MetadataExt::mtime_nsec(&meta), 5);
    }

    /// Small files packed in one block: a file whose bytes do not match its digest fails
    /// alone, and the files beside it land.
    #[test]
    fn a_packed_block_fails_only_its_damaged_files() {
        let dir = tempfile::tempdir().unwrap();
        let h = sink_in(dir.path());
        let files: [&[u8]; 3] = [b"first file", b"second, damaged", b"third file"];
        for (id, (name, data)) in ["a", "b", "c"].iter().zip(files).enumerate() {
            h.sink
                .apply_entry(id as u64, &entry(name, data.len() as u64))
                .unwrap();
        }
        let segments: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(id, &data)| {
                let digest = if id == 1 { [0xee; 16] } else { digest_of(data) };
                (id as u64, 0, Segment::FLAG_LAST, data, digest)
            })
            .collect();
        let pool = crate::pool::Pool::new(1, 4096);
        h.sink
            .place_block(received_many(&pool, check_flags(false, true), &segments))
            .unwrap();
        let mut verdicts = h.close(true);
        verdicts.sort_by_key(|(id, _)| *id);
        assert!(
            verdicts[0].1.is_ok() && verdicts[2].1.is_ok(),
            "{verdicts:?}"
        );
        assert!(
            verdicts[1].1.as_ref().unwrap_err().contains("do not match"),
            "{verdicts:?}"
        );
        assert_eq!(names_in(dir.path()), ["a", "c"]);
    }

    /// Data overlapping what a file already received ends the session before a byte of
    /// it is written.
    #[test]
    fn overlapping_data_is_refused_before_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let h = sink_in(dir.path());
        h.sink.apply_entry(0, &entry("f", 3 * 4096)).unwrap();
        let pool = crate::pool::Pool::new(1, 8192);
        let first = [1u8; 4096];
        h.sink
            .place_block(received(&pool, 0, 0, &first, digest_of(&first), false))
            .unwrap();
        let overlapping = [2u8; 8192];
        let refused = h.sink.place_block(received(
            &pool,
            0,
            2048,
            &overlapping,
            digest_of(&overlapping),
            false,
        ));
        assert!(
            matches!(refused, Err(Error::Protocol { .. })),
            "{refused:?}"
        );
    }

    /// A chunk that fails its digest after others were written fails the file: nothing
    /// under its name, no temporary.
    #[test]
    fn a_wrong_digest_never_reaches_the_final_name() {
        let dir = tempfile::tempdir().unwrap();
        let h = sink_in(dir.path());
        let data: Vec<u8> = (0..16_000u32).map(|i| (i % 249) as u8).collect();
        h.sink
            .apply_entry(0, &entry("f", data.len() as u64))
            .unwrap();
        feed(&h.sink, &data, 4096, &[2, 0, 1, 3], Some(1));
        let verdicts = h.close(true);
        assert!(matches!(verdicts.as_slice(), [(0, Err(_))]), "{verdicts:?}");
        assert!(
            names_in(dir.path()).is_empty(),
            "no final name, no temporary"
        );
    }

    /// A small file (one segment, written unnamed where the kernel allows) cannot be linked
    /// over an existing name: it must still replace it, and leave no temporary behind.
    #[test]
    fn a_whole_file_segment_replaces_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"old").unwrap();
        let h = sink_in(dir.path());
        let data = vec![3u8; 5000];
        h.sink
            .apply_entry(0, &entry("f", data.len() as u64))
            .unwrap();
        feed(&h.sink, &data, 8192, &[0], None);
        assert_eq!(h.close(true), vec![(0, Ok(()))]);
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), data);
        assert_eq!(names_in(dir.path()), ["f"]);
    }

    /// The quick check: a file in place with the announced size and mtime needs nothing
    /// (its mode is brought in line); one that differs in either is received again.
    #[test]
    fn a_file_in_place_with_the_same_size_and_mtime_is_up_to_date() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        in_place(&path, b"12345");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let h = sink_in(dir.path());
        assert_eq!(
            h.sink.apply_entry(0, &entry("f", 5)).unwrap(),
            Applied::UpToDate
        );
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o640
        );
        let newer = Entry {
            mtime_sec: 1_000_001,
            ..entry("f", 5)
        };
        assert_eq!(h.sink.apply_entry(1, &newer).unwrap(), Applied::Pending);
        assert_eq!(
            h.sink.apply_entry(2, &entry("f", 6)).unwrap(),
            Applied::Pending
        );
    }

    /// A fresh pull's sink compares nothing: a file that appeared at an entry's name
    /// since the session began, even one the quick check would pass, is received and
    /// replaced, never answered "up to date" (its data is on the way, and its sender
    /// could not take that answer).
    #[test]
    fn a_fresh_pull_replaces_a_file_that_appeared_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        in_place(&path, b"older");
        let limits = SinkLimits::default().fresh(Duration::from_secs(30));
        let h = harness(dir.path(), limits, None);
        assert_eq!(
            h.sink.apply_entry(0, &entry("f", 5)).unwrap(),
            Applied::Pending
        );
        let pool = crate::pool::Pool::new(1, 4096);
        h.sink
            .place_block(received(&pool, 0, 0, b"newer", digest_of(b"newer"), true))
            .unwrap();
        assert_eq!(h.close(true), vec![(0, Ok(()))]);
        assert_eq!(std::fs::read(&path).unwrap(), b"newer");
    }

    /// A file whose parent cannot be created (a regular file stands where the directory
    /// must go) fails alone at manifest time, naming why; the session goes on.
    #[test]
    fn an_entry_whose_directory_cannot_be_made_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("d"), b"a file, not a directory").unwrap();
        let h = sink_in(dir.path());
        let dir_entry = Entry {
            kind: EntryKind::Dir,
            mode: 0o755,
            ..entry("d", 0)
        };
        assert!(matches!(
            h.sink.apply_entry(0, &dir_entry).unwrap(),
            Applied::Failed(_)
        ));
        let Applied::Failed(f) = h.sink.apply_entry(1, &entry("d/inner", 10)).unwrap() else {
            panic!("the file below fails too")
        };
        assert!(
            f.message.contains("d/inner") && f.message.contains("not a directory"),
            "{}",
            f.message
        );
        assert_eq!(
            h.sink.apply_entry(2, &entry("other", 10)).unwrap(),
            Applied::Pending
        );
    }

    /// An interrupted transfer's partial file comes back with the ranges its journal
    /// verified; once the sender confirms them, only the rest is needed to complete it.
    #[test]
    fn a_partial_file_resumes_from_its_journal() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let state = StateDir::open(&dir.path().join("state")).unwrap();
        let data: Vec<u8> = (0..5 * 4096u32).map(|i| (i * 11 % 241) as u8).collect();
        let limits = SinkLimits {
            checkpoint_bytes: 4096,
            ..SinkLimits::default()
        };
        // The first run gets chunks 0, 1 and 3, then ends early.
        let first = harness(
            &root,
            limits.clone(),
            Some(Arc::new(state.journal([1; 16], &root).unwrap())),
        );
        first
            .sink
            .apply_entry(0, &entry("big", data.len() as u64))
            .unwrap();
        feed(&first.sink, &data, 4096, &[0, 1, 3], None);
        assert!(first.close(false).is_empty());
        assert!(
            names_in(&root)[0].starts_with(".wanxfer-"),
            "the partial file is kept"
        );
        // The next run of the same transfer holds them.
        let journal = Arc::new(state.journal([1; 16], &root).unwrap());
        let second = harness(&root, limits, Some(journal));
        let Applied::Held(held) = second
            .sink
            .apply_entry(0, &entry("big", data.len() as u64))
            .unwrap()
        else {
            panic!("the partial file is found")
        };
        let offsets: Vec<u64> = held.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, [0, 4096, 3 * 4096]);
        second.sink.accept(0, &held).unwrap();
        feed(&second.sink, &data, 4096, &[2, 4], None);
        assert_eq!(second.close(true), vec![(0, Ok(()))]);
        assert_eq!(std::fs::read(root.join("big")).unwrap(), data);
        assert_eq!(names_in(&root), ["big"]);
    }

    /// Guards the memory-to-memory path: a discarding sink completes a many-block stream
    /// on coverage.
    #[test]
    fn discarding_completes_on_coverage_alone() {
        let verdicts: Verdicts = Arc::default();
        let seen = verdicts.clone();
        let report: Report = Arc::new(move |id, result: Result<(), Error>| {
            seen.lock()
                .unwrap()
                .push((id, result.map_err(|e| e.to_string())));
        });
        let sink = Sink::new(
            None,
            "test peer".into(),
            9,
            check_flags(false, true),
            SinkLimits::default(),
            None,
            report,
        )
        .unwrap();
        let data = vec![0u8; 20_000];
        assert_eq!(
            sink.apply_entry(0, &entry("synthetic", data.len() as u64))
                .unwrap(),
            Applied::Pending
        );
        feed(&sink, &data, 4096, &[1, 0, 4, 2, 3], None);
        assert_eq!(*verdicts.lock().unwrap(), vec![(0, Ok(()))]);
    }

    #[test]
    fn a_file_abandoned_under_a_writer_gets_no_temporary_and_no_verdict() {
        let dir = tempfile::tempdir().unwrap();
        let h = sink_in(dir.path());
        h.sink.apply_entry(0, &entry("f", 3 * 8192)).unwrap();
        let slot = h.sink.slot(0).unwrap();
        h.sink.abandon(0);
        let seg = Segment {
            file_id: 0,
            offset: 8192,
            len: 8192,
            flags: 0,
            digest: [0; 16],
        };
        assert!(h.sink.prepare(&seg, &slot).unwrap().is_none());
        assert_eq!(h.sink.open_files.load(Ordering::Relaxed), 0);
        h.sink.record(&seg, &slot).unwrap();
        assert!(h.close(false).is_empty());
        assert!(names_in(dir.path()).is_empty());
    }

    #[test]
    fn placement_follows_cp_r_and_remembers_its_choice() {
        use wanxfer_proto::Placement as Wire;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("existing")).unwrap();
        let root = Root::open(dir.path()).unwrap();
        let rel = |s: &str| RelPath::new(s.as_bytes()).unwrap();
        let (into, how) = Placement::decide(&root, &rel("existing"), 1, Wire::Resolve).unwrap();
        assert_eq!(how, Wire::Into);
        assert_eq!(into.map(&rel("src/a")).unwrap(), rel("existing/src/a"));
        let (onto, how) = Placement::decide(&root, &rel("new"), 1, Wire::Resolve).unwrap();
        assert_eq!(how, Wire::Onto);
        assert_eq!(onto.map(&rel("src/a")).unwrap(), rel("new/a"));
        assert!(Placement::decide(&root, &rel("new"), 2, Wire::Resolve).is_err());
        assert!(Placement::decide(&root, &rel("missing/new"), 1, Wire::Resolve).is_err());
        // Pinned onto an existing directory (a re-run): no nesting.
        std::fs::create_dir(dir.path().join("new")).unwrap();
        let (again, _) = Placement::decide(&root, &rel("new"), 1, Wire::Onto).unwrap();
        assert_eq!(again.map(&rel("src/a")).unwrap(), rel("new/a"));
        // A trailing slash: into, created if missing.
        let (made, _) = Placement::decide(&root, &rel("made"), 1, Wire::Into).unwrap();
        assert_eq!(made.map(&rel("src")).unwrap(), rel("made/src"));
        assert!(dir.path().join("made").is_dir());
        // The engine's reserved name is not a place to land.
        let (top, _) = Placement::decide(&root, &RelPath::root(), 1, Wire::Resolve).unwrap();
        assert!(top.map(&rel(".wanxfer/x")).is_err());
    }
}
