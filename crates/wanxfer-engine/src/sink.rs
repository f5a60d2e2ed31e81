//! The front end of the receiving side: where each entry lands and when a file is done.
//!
//! Blocks arrive on any channel in any order, so a file is finished not when "its last
//! block" arrives but when its [`Coverage`] is complete. Every segment was checked against
//! its digest by the channel as it arrived (`digest::PayloadVerifier`), before a byte of it
//! is written here, so a complete file is a verified one whatever order its chunks came
//! in: the writer applies mode and mtime and renames it into place, and nothing is ever
//! read back. A segment that failed its check fails its file alone: the cause (a source
//! file that changed while it was read, a bad bit in one buffer) says nothing about the
//! other files, so they still land and only that file is reported. Everything the peer says is checked against the manifest and local limits
//! first: unknown ids, ranges past the announced size, overlapping data, or more files in
//! progress than we allow end the session with a protocol or limit error, never a panic.
//!
//! This module does not read sockets; it is fed blocks by the transport and entries by the
//! session.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use wanxfer_proto::{Entry, EntryKind, RelPath, Segment};

use crate::fs::{self, DirCache, Kind, Root, TempFile, TempStrategy, WriteMode};
use crate::pool::Block;
use crate::progress::IoUse;
use crate::Error;

/// Where a transfer's top-level names land, decided once per session like `cp -r`.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Directory (beneath the root) that receives the top-level entries.
    pub base: RelPath,
    /// A single source copied onto a new name takes that name.
    pub rename_top: Option<Vec<u8>>,
    /// Pull: the only top-level names the client asked for.
    pub allowed_tops: Option<Vec<Vec<u8>>>,
}

impl Placement {
    /// `cp -r` semantics for destination `dest` beneath `root` and `source_count` sources:
    /// into `dest` if it is a directory, onto `dest` if there is one source, an error
    /// otherwise.
    pub fn resolve(root: &Root, dest: &RelPath, source_count: u32) -> Result<Placement, Error> {
        let into = |base: RelPath| Placement {
            base,
            rename_top: None,
            allowed_tops: None,
        };
        match root.meta(dest)? {
            Some(m) if m.kind == Kind::Dir => Ok(into(dest.clone())),
            _ if source_count == 1 => {
                let (parent, name) = dest.split_last().expect("the root is a directory");
                match root.meta(&parent)? {
                    Some(m) if m.kind == Kind::Dir => Ok(Placement {
                        base: parent,
                        rename_top: Some(name.to_vec()),
                        allowed_tops: None,
                    }),
                    _ => Err(Error::Refused {
                        path: root.show(&parent),
                        reason: "the destination's parent directory does not exist".into(),
                    }),
                }
            }
            Some(_) => Err(Error::Refused {
                path: root.show(dest),
                reason: "copying several sources needs a directory as destination".into(),
            }),
            None => Err(Error::Refused {
                path: root.show(dest),
                reason: "the destination directory does not exist".into(),
            }),
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
        self.base
            .join(top)
            .and_then(|p| p.concat(&rest))
            .map_err(|e| format!("{path}: {e}"))
    }
}

/// Which byte ranges of a file have arrived, as merged intervals.
#[derive(Debug, Default)]
pub struct Coverage {
    ranges: BTreeMap<u64, u64>,
    bytes: u64,
}

/// A received run of bytes, `(start, end)`.
type Range = (u64, u64);

/// Most separate ranges one file may have in flight: a sender interleaving tiny pieces
/// would otherwise grow this without bound.
pub const MAX_RANGES_PER_FILE: usize = 1 << 16;

impl Coverage {
    /// Refuses `[start, end)` if any of it was already received.
    pub fn check_free(&self, start: u64, end: u64) -> Result<(), String> {
        let (before, after) = self.neighbours(start);
        if before.is_some_and(|(_, e)| e > start) || after.is_some_and(|(s, _)| s < end) {
            return Err(format!("bytes {start}..{end} were already received"));
        }
        Ok(())
    }

    /// The ranges starting at or before `pos` and at or after it.
    fn neighbours(&self, pos: u64) -> (Option<Range>, Option<Range>) {
        let before = self.ranges.range(..=pos).next_back().map(|(&s, &e)| (s, e));
        let after = self.ranges.range(pos..).next().map(|(&s, &e)| (s, e));
        (before, after)
    }

    /// Adds `[start, end)`; refuses overlap with what is already there.
    pub fn add(&mut self, start: u64, end: u64) -> Result<(), String> {
        if start == end {
            return Ok(());
        }
        self.check_free(start, end)?;
        let (before, after) = self.neighbours(start);
        let mut new_start = start;
        let mut new_end = end;
        if let Some((s, e)) = before.filter(|&(_, e)| e == start) {
            self.ranges.remove(&s);
            new_start = s;
            debug_assert_eq!(e, start);
        }
        if let Some((s, e)) = after.filter(|&(s, _)| s == end) {
            self.ranges.remove(&s);
            new_end = e;
        }
        if self.ranges.len() >= MAX_RANGES_PER_FILE {
            return Err("the file arrived in too many separate pieces".into());
        }
        self.ranges.insert(new_start, new_end);
        self.bytes += end - start;
        Ok(())
    }

    pub fn is_complete(&self, size: u64) -> bool {
        self.bytes == size
    }
}

/// A file the receiver has finished with, either way.
#[derive(Debug)]
pub enum Resolution {
    Done { id: u64, bytes: u64 },
    Failed { id: u64, error: Error },
}

#[derive(Debug)]
struct Slot {
    dest: RelPath,
    size: u64,
    mode: u32,
    mtime_sec: i64,
    mtime_nsec: u32,
    state: Mutex<SlotState>,
}

#[derive(Debug, Default)]
struct SlotState {
    temp: Option<Arc<TempFile>>,
    coverage: Coverage,
    /// The file failed while another writer still held its slot: that writer must not
    /// open a temporary for it (which would count against the open-file limit forever)
    /// nor record its data.
    abandoned: bool,
}

#[derive(Debug)]
struct DirMeta {
    dest: RelPath,
    mode: u32,
    mtime_sec: i64,
    mtime_nsec: u32,
}

/// Local limits and settings of a receiving side; never taken from the peer.
#[derive(Debug, Clone)]
pub struct SinkLimits {
    pub max_open_files: usize,
    pub write: WriteMode,
}

impl Default for SinkLimits {
    fn default() -> Self {
        SinkLimits {
            max_open_files: 512,
            write: WriteMode::Auto,
        }
    }
}

/// Where received data goes: files beneath a root, or nowhere (memory-to-memory).
#[derive(Debug)]
pub struct Sink {
    target: Option<(Root, Placement)>,
    peer: String,
    session_tag: u64,
    /// The checks the session agreed on (`digest::check_flags`): a block without them is
    /// refused.
    required_checks: u8,
    limits: SinkLimits,
    /// Files of more than one block bypass the page cache (see [`WriteMode`]).
    direct: bool,
    slots: Mutex<HashMap<u64, Arc<Slot>>>,
    failed: Mutex<HashSet<u64>>,
    dirs: Mutex<Vec<DirMeta>>,
    dirs_cache: DirCache,
    temps: TempStrategy,
    open_files: AtomicUsize,
    /// Bytes written with `O_DIRECT`, and the first reason files were not, for the report.
    direct_bytes: AtomicU64,
    io_fallback: OnceLock<String>,
}

impl Sink {
    /// `target` is `None` to discard data after checking it.
    pub fn new(
        target: Option<(Root, Placement)>,
        peer: String,
        session_tag: u64,
        required_checks: u8,
        limits: SinkLimits,
    ) -> Sink {
        let direct = target
            .as_ref()
            .is_some_and(|(root, _)| limits.write.is_direct_beneath(root.fd()));
        Sink {
            target,
            peer,
            session_tag,
            required_checks,
            limits,
            direct,
            slots: Mutex::default(),
            failed: Mutex::default(),
            dirs: Mutex::default(),
            dirs_cache: DirCache::default(),
            temps: TempStrategy::default(),
            open_files: AtomicUsize::new(0),
            direct_bytes: AtomicU64::new(0),
            io_fallback: OnceLock::new(),
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

    /// Takes in one manifest entry. Directories, symlinks and empty files are done at
    /// once; a file with data becomes pending (`Ok(None)`) until its blocks arrive.
    /// `Err` is for failures that must end the session (a full disk, say).
    pub fn apply_entry(&self, id: u64, entry: &Entry) -> Result<Option<Resolution>, Error> {
        let Some((root, placement)) = &self.target else {
            return Ok(self.discard_entry(id, entry));
        };
        let dest = match placement.map(&entry.path) {
            Ok(dest) => dest,
            Err(reason) => return Err(Error::protocol(&self.peer, reason)),
        };
        match self.place_entry(root, id, &dest, entry) {
            Ok(done) => Ok(done),
            Err(e) if is_fatal(&e) => Err(e),
            Err(error) => Ok(Some(Resolution::Failed { id, error })),
        }
    }

    fn discard_entry(&self, id: u64, entry: &Entry) -> Option<Resolution> {
        if entry.kind != EntryKind::File || entry.size == 0 {
            return Some(Resolution::Done { id, bytes: 0 });
        }
        self.insert_slot(id, entry.path.clone(), entry);
        None
    }

    fn place_entry(
        &self,
        root: &Root,
        id: u64,
        dest: &RelPath,
        entry: &Entry,
    ) -> Result<Option<Resolution>, Error> {
        let (parent, name) = dest.split_last().ok_or_else(|| Error::Refused {
            path: root.show(dest),
            reason: "an entry names the destination root itself".into(),
        })?;
        let dir = self.dirs_cache.get(root, &parent)?;
        let io = |op, e| Error::local(op, root.show(dest), e);
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
                    });
            }
            EntryKind::Symlink => fs::place_symlink(
                dir.as_fd(),
                name,
                &entry.link_target,
                self.session_tag,
                entry.mtime_sec,
                entry.mtime_nsec,
            )
            .map_err(|e| io("create symlink", e))?,
            EntryKind::File if entry.size == 0 => {
                let temp =
                    TempFile::create(dir, name, self.session_tag, entry.mode, Some(&self.temps))
                        .map_err(|e| io("create", e))?;
                temp.commit(entry.mode, entry.mtime_sec, entry.mtime_nsec)
                    .map_err(|e| io("rename into place", e))?;
            }
            EntryKind::File => {
                self.insert_slot(id, dest.clone(), entry);
                return Ok(None);
            }
            _ => {
                return Err(Error::Refused {
                    path: root.show(dest),
                    reason: "unsupported kind of entry".into(),
                })
            }
        }
        Ok(Some(Resolution::Done { id, bytes: 0 }))
    }

    fn insert_slot(&self, id: u64, dest: RelPath, entry: &Entry) {
        let slot = Arc::new(Slot {
            dest,
            size: entry.size,
            mode: entry.mode,
            mtime_sec: entry.mtime_sec,
            mtime_nsec: entry.mtime_nsec,
            state: Mutex::default(),
        });
        self.slots
            .lock()
            .expect("no panics while held")
            .insert(id, slot);
    }

    /// Drops a pending file (the sender could not read it, or it failed here), removing
    /// its temporary. Later blocks for it are ignored.
    pub fn abandon(&self, id: u64) {
        self.failed.lock().expect("no panics while held").insert(id);
        if let Some(slot) = self.slots.lock().expect("no panics while held").remove(&id) {
            let mut state = slot.state.lock().expect("no panics while held");
            state.abandoned = true;
            if state.temp.take().is_some() {
                self.open_files.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Places every segment of a received block; a segment that failed its check on
    /// arrival fails its file. Per-file failures come back as resolutions; `Err` ends the
    /// session.
    pub fn place_block(&self, block: Block, out: &mut Vec<Resolution>) -> Result<(), Error> {
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
                self.fail_damaged(seg, out)?;
                continue;
            }
            if let Some(done) = self.place_segment(seg, data)? {
                out.push(done);
            }
        }
        Ok(())
    }

    fn fail_damaged(&self, seg: &Segment, out: &mut Vec<Resolution>) -> Result<(), Error> {
        let Some(slot) = self.pending_slot(seg.file_id)? else {
            return Ok(());
        };
        self.abandon(seg.file_id);
        out.push(Resolution::Failed {
            id: seg.file_id,
            error: Error::Integrity {
                path: self.show(&slot.dest),
                offset: seg.offset,
                detail: format!(
                    "{} bytes from {} do not match the checksum sent with them",
                    seg.len, self.peer
                ),
            },
        });
        Ok(())
    }

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
        if let Some(slot) = self.slot(id) {
            return Ok(Some(slot));
        }
        if self
            .failed
            .lock()
            .expect("no panics while held")
            .contains(&id)
        {
            return Ok(None);
        }
        Err(Error::protocol(
            &self.peer,
            format!("data for file id {id} which is not pending"),
        ))
    }

    fn place_segment(&self, seg: &Segment, data: &[u8]) -> Result<Option<Resolution>, Error> {
        let Some(slot) = self.pending_slot(seg.file_id)? else {
            return Ok(None);
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
        let Some((root, _)) = &self.target else {
            return Ok(None);
        };
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
        if state.temp.is_none() {
            if self.open_files.load(Ordering::Relaxed) >= self.limits.max_open_files {
                return Err(Error::Limit(format!(
                    "{} sends more than {} files at once",
                    self.peer, self.limits.max_open_files
                )));
            }
            let (parent, name) = slot.dest.split_last().expect("files are never the root");
            let dir = self.dirs_cache.get(root, &parent)?;
            // A file that comes in one segment is written in one call: nothing to reserve,
            // and nothing worth keeping if the session dies, so it needs no name until it
            // is complete. A larger file keeps a named temporary while it grows, has its
            // size reserved, and is written direct where that pays.
            let whole = u64::from(seg.len) == slot.size;
            let unnamed = whole.then_some(&self.temps);
            let mut temp = TempFile::create(dir, name, self.session_tag, slot.mode, unnamed)
                .map_err(|e| Error::local("create", self.show(&slot.dest), e))?;
            if !whole {
                let local = |op, e| Error::local(op, self.show(&slot.dest), e);
                temp.reserve(slot.size)
                    .map_err(|e| local("reserve space for", e))?;
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
            }
            self.open_files.fetch_add(1, Ordering::Relaxed);
            state.temp = Some(Arc::new(temp));
        }
        Ok(state.temp.clone())
    }

    fn fail_or_abort(&self, id: u64, error: Error) -> Result<Option<Resolution>, Error> {
        self.abandon(id);
        if is_fatal(&error) {
            Err(error)
        } else {
            Ok(Some(Resolution::Failed { id, error }))
        }
    }

    /// Records the range and, if the file is now complete, commits it.
    fn record(&self, seg: &Segment, slot: &Arc<Slot>) -> Result<Option<Resolution>, Error> {
        let id = seg.file_id;
        let temp = {
            let mut state = slot.state.lock().expect("no panics while held");
            if state.abandoned {
                return Ok(None);
            }
            let end = seg.offset + u64::from(seg.len);
            state.coverage.add(seg.offset, end).map_err(|e| {
                Error::protocol(&self.peer, format!("{}: {e}", self.show(&slot.dest)))
            })?;
            if !state.coverage.is_complete(slot.size) {
                return Ok(None);
            }
            state.temp.take()
        };
        self.slots.lock().expect("no panics while held").remove(&id);
        let Some(temp) = temp else {
            // Discarding: complete is all there is to check.
            return Ok(Some(Resolution::Done {
                id,
                bytes: slot.size,
            }));
        };
        self.open_files.fetch_sub(1, Ordering::Relaxed);
        // Every writer drops its clone before recording its range, so only a writer
        // holding data that overlaps the complete file can still hold one.
        let Ok(temp) = Arc::try_unwrap(temp) else {
            return Err(Error::protocol(
                &self.peer,
                format!("{}: overlapping data for one file", self.show(&slot.dest)),
            ));
        };
        let committed = temp
            .commit(slot.mode, slot.mtime_sec, slot.mtime_nsec)
            .map_err(|e| Error::local("rename into place", self.show(&slot.dest), e));
        match committed {
            Ok(()) => Ok(Some(Resolution::Done {
                id,
                bytes: slot.size,
            })),
            Err(e) => self.fail_or_abort(id, e),
        }
    }

    /// Ids still waiting for data.
    pub fn pending(&self) -> Vec<u64> {
        self.slots
            .lock()
            .expect("no panics while held")
            .keys()
            .copied()
            .collect()
    }

    /// Applies directory modes and mtimes, deepest first, once nothing more will be
    /// written into them.
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
                        fs::apply_meta(fd.as_fd(), d.mode, d.mtime_sec, d.mtime_nsec).map_err(|e| {
                            Error::local("set directory metadata", root.show(&d.dest), e)
                        })
                    })
                    .err()
            })
            .collect()
    }
}

/// Errors that would repeat for every following file: no point going on.
fn is_fatal(e: &Error) -> bool {
    match e {
        Error::LocalIo { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EROFS) | Some(libc::EIO)
        ),
        Error::Limit(_) | Error::Protocol { .. } => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{check_flags, digest_of, PayloadVerifier};
    use proptest::prelude::*;

    #[test]
    fn coverage_merges_and_refuses_overlap() {
        let mut c = Coverage::default();
        c.add(10, 20).unwrap();
        c.add(0, 10).unwrap();
        c.add(30, 40).unwrap();
        assert!(c.add(15, 25).is_err());
        assert!(c.add(35, 45).is_err());
        c.add(20, 30).unwrap();
        assert!(c.is_complete(40));
        assert_eq!(c.ranges.len(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Whatever the arrival order, a file whose chunks all check out lands intact.
        #[test]
        fn any_arrival_order_lands_intact(
            order in Just((0..12usize).collect::<Vec<_>>()).prop_shuffle(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let sink = sink_in(dir.path());
            let data: Vec<u8> = (0..12 * 4096 - 100u32).map(|i| (i * 13 % 253) as u8).collect();
            sink.apply_entry(0, &entry("f", data.len() as u64)).unwrap();
            let out = feed(&sink, &data, 4096, &order, None);
            prop_assert!(matches!(out.as_slice(), [Resolution::Done { id: 0, .. }]), "{:?}", out);
            prop_assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), data);
        }

        #[test]
        fn coverage_completes_for_any_arrival_order(
            chunks in 1usize..40,
            seed in any::<u64>(),
        ) {
            let mut order: Vec<usize> = (0..chunks).collect();
            let mut s = seed;
            for i in (1..order.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (s >> 33) as usize % (i + 1));
            }
            let mut c = Coverage::default();
            for (n, &i) in order.iter().enumerate() {
                prop_assert!(!c.is_complete(chunks as u64 * 7) || n == chunks);
                c.add(i as u64 * 7, i as u64 * 7 + 7).unwrap();
            }
            prop_assert!(c.is_complete(chunks as u64 * 7));
            prop_assert_eq!(c.ranges.len(), 1);
        }
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
        }
    }

    /// Feeds `data` to `sink` as file 0 in chunks of `chunk` bytes, in `order`, each
    /// with its digest except chunk `wrong`, whose digest does not match.
    fn feed(
        sink: &Sink,
        data: &[u8],
        chunk: usize,
        order: &[usize],
        wrong: Option<usize>,
    ) -> Vec<Resolution> {
        let pool = crate::pool::Pool::new(1, chunk);
        let mut out = Vec::new();
        let chunks = data.len().div_ceil(chunk);
        for &i in order {
            let start = i * chunk;
            let bytes = &data[start..start + chunk.min(data.len() - start)];
            let digest = if wrong == Some(i) {
                [0xee; 16]
            } else {
                digest_of(bytes)
            };
            let block = received(&pool, 0, start as u64, bytes, digest, i + 1 == chunks);
            sink.place_block(block, &mut out).unwrap();
        }
        out
    }

    /// A block holding `data` as one segment of file `id` at `offset` carrying `digest`,
    /// checked as a channel checks what it receives.
    fn received(
        pool: &crate::pool::Pool,
        id: u64,
        offset: u64,
        data: &[u8],
        digest: [u8; 16],
        last: bool,
    ) -> Block {
        let flags = if last { Segment::FLAG_LAST } else { 0 };
        let seg = (id, offset, flags, data, digest);
        received_many(pool, check_flags(false, true), &[seg])
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

    /// Small files packed in one block: a file whose bytes do not match its digest fails
    /// alone, and the files beside it land.
    #[test]
    fn a_packed_block_fails_only_its_damaged_files() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        let files: [&[u8]; 3] = [b"first file", b"second, damaged", b"third file"];
        for (id, (name, data)) in ["a", "b", "c"].iter().zip(files).enumerate() {
            sink.apply_entry(id as u64, &entry(name, data.len() as u64))
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
        let block = received_many(&pool, check_flags(false, true), &segments);
        let mut out = Vec::new();
        sink.place_block(block, &mut out).unwrap();
        assert!(
            matches!(
                out.as_slice(),
                [
                    Resolution::Done { id: 0, .. },
                    Resolution::Failed {
                        id: 1,
                        error: Error::Integrity { .. }
                    },
                    Resolution::Done { id: 2, .. }
                ]
            ),
            "{out:?}"
        );
        assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), files[0]);
        assert_eq!(std::fs::read(dir.path().join("c")).unwrap(), files[2]);
        assert!(!dir.path().join("b").exists());
    }

    /// Data overlapping what a file already received ends the session before a byte of
    /// it is written.
    #[test]
    fn overlapping_data_is_refused_before_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        sink.apply_entry(0, &entry("f", 3 * 4096)).unwrap();
        let pool = crate::pool::Pool::new(1, 8192);
        let mut out = Vec::new();
        let first = [1u8; 4096];
        let block = received(&pool, 0, 0, &first, digest_of(&first), false);
        sink.place_block(block, &mut out).unwrap();
        // The failed file's temporary is removed: keep it open to look inside.
        let mut temp = std::fs::File::open(&temp_files_in(dir.path())[0]).unwrap();
        let overlapping = [2u8; 8192];
        let digest = digest_of(&overlapping);
        let block = received(&pool, 0, 2048, &overlapping, digest, false);
        let refused = sink.place_block(block, &mut out);
        assert!(
            matches!(refused, Err(Error::Protocol { .. })),
            "{refused:?}"
        );
        let mut written = Vec::new();
        std::io::Read::read_to_end(&mut temp, &mut written).unwrap();
        assert!(written[..4096].iter().all(|&b| b == 1), "first bytes kept");
        assert!(
            written[4096..].iter().all(|&b| b == 0),
            "nothing of the overlap"
        );
    }

    fn sink_in(dir: &std::path::Path) -> Sink {
        let root = Root::open(dir).unwrap();
        let placement = Placement::resolve(&root, &RelPath::root(), 1).unwrap();
        let limits = SinkLimits::default();
        let checks = check_flags(false, true);
        Sink::new(
            Some((root, placement)),
            "test peer".into(),
            9,
            checks,
            limits,
        )
    }

    #[test]
    fn out_of_order_blocks_land_with_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        assert!(sink
            .apply_entry(0, &entry("f", data.len() as u64))
            .unwrap()
            .is_none());
        let out = feed(
            &sink,
            &data,
            4096,
            &[
                3, 1, 0, 2, 24, 5, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                22, 23,
            ],
            None,
        );
        assert!(
            matches!(out.as_slice(), [Resolution::Done { id: 0, .. }]),
            "{out:?}"
        );
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

    /// Guards the memory-to-memory path: a discarding sink completes a many-block stream
    /// on coverage.
    #[test]
    fn discarding_completes_on_coverage_alone() {
        let checks = check_flags(false, true);
        let sink = Sink::new(None, "test peer".into(), 9, checks, SinkLimits::default());
        let data = vec![0u8; 20_000];
        assert!(sink
            .apply_entry(0, &entry("synthetic", data.len() as u64))
            .unwrap()
            .is_none());
        let out = feed(&sink, &data, 4096, &[1, 0, 4, 2, 3], None);
        assert!(
            matches!(
                out.as_slice(),
                [Resolution::Done {
                    id: 0,
                    bytes: 20_000
                }]
            ),
            "{out:?}"
        );
    }

    /// A small file (one segment, written unnamed where the kernel allows) cannot be linked
    /// over an existing name: it must still replace it, and leave no temporary behind.
    #[test]
    fn a_whole_file_segment_replaces_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"old").unwrap();
        let sink = sink_in(dir.path());
        let data = vec![3u8; 5000];
        sink.apply_entry(0, &entry("f", data.len() as u64)).unwrap();
        let out = feed(&sink, &data, 8192, &[0], None);
        assert!(
            matches!(out.as_slice(), [Resolution::Done { id: 0, .. }]),
            "{out:?}"
        );
        assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), data);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// A chunk that fails its digest after others were written fails the file: its
    /// temporary goes, and the chunks after it are dropped.
    #[test]
    fn a_wrong_digest_never_reaches_the_final_name() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        let data: Vec<u8> = (0..16_000u32).map(|i| (i % 249) as u8).collect();
        sink.apply_entry(0, &entry("f", data.len() as u64)).unwrap();
        let out = feed(&sink, &data, 4096, &[2, 0, 1, 3], Some(1));
        assert!(
            matches!(
                out.as_slice(),
                [Resolution::Failed {
                    id: 0,
                    error: Error::Integrity { .. }
                }]
            ),
            "{out:?}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "no final name, no temporary"
        );
    }

    /// A peer that agreed on segment digests and sends a block without them ends the
    /// session, and nothing of that block is written.
    #[test]
    fn a_block_without_the_agreed_digests_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        sink.apply_entry(0, &entry("f", 4096)).unwrap();
        let pool = crate::pool::Pool::new(1, 4096);
        let mut block = received(&pool, 0, 0, &[1; 4096], [0; 16], true);
        block.checks = 0;
        block.damaged.clear();
        let refused = sink.place_block(block, &mut Vec::new());
        assert!(
            matches!(refused, Err(Error::Protocol { .. })),
            "{refused:?}"
        );
        assert!(temp_files_in(dir.path()).is_empty());
    }

    fn temp_files_in(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }

    #[test]
    fn a_file_abandoned_under_a_writer_gets_no_temporary_and_no_verdict() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        sink.apply_entry(0, &entry("f", 3 * 8192)).unwrap();
        // A writer took the slot, then another writer failed the file.
        let slot = sink.slot(0).unwrap();
        sink.abandon(0);
        let seg = Segment {
            file_id: 0,
            offset: 8192,
            len: 8192,
            flags: 0,
            digest: [0; 16],
        };
        assert!(sink.prepare(&seg, &slot).unwrap().is_none());
        assert_eq!(sink.open_files.load(Ordering::Relaxed), 0);
        let recorded = sink.record(&seg, &slot).unwrap();
        assert!(recorded.is_none());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// A file that came whole in one segment fails on a wrong digest the way a file that
    /// came in pieces does: alone, with nothing left on disk, while the next file lands.
    #[test]
    fn a_wrong_digest_on_a_whole_file_fails_only_that_file() {
        let dir = tempfile::tempdir().unwrap();
        let sink = sink_in(dir.path());
        let (bad, good) = (vec![1u8; 3000], vec![2u8; 4000]);
        sink.apply_entry(0, &entry("bad", 3000)).unwrap();
        sink.apply_entry(1, &entry("good", 4000)).unwrap();
        let pool = crate::pool::Pool::new(2, 8192);
        let mut out = Vec::new();
        for (id, data, digest) in [
            (0, &bad, [0xee; 16]),
            (1, &good, digest_of(&good)),
            // Late data for the failed file is dropped, not refused.
            (0, &bad, digest_of(&bad)),
        ] {
            let block = received(&pool, id, 0, data, digest, true);
            sink.place_block(block, &mut out).unwrap();
        }
        assert!(
            matches!(
                out.as_slice(),
                [
                    Resolution::Failed {
                        id: 0,
                        error: Error::Integrity { .. }
                    },
                    Resolution::Done { id: 1, .. }
                ]
            ),
            "{out:?}"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            ["good"],
            "no final name, no temporary for the bad file"
        );
        assert_eq!(std::fs::read(dir.path().join("good")).unwrap(), good);
    }

    #[test]
    fn placement_follows_cp_r() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("existing")).unwrap();
        let root = Root::open(dir.path()).unwrap();
        let rel = |s: &str| RelPath::new(s.as_bytes()).unwrap();
        let into = Placement::resolve(&root, &rel("existing"), 1).unwrap();
        assert_eq!(into.map(&rel("src/a")).unwrap(), rel("existing/src/a"));
        let onto = Placement::resolve(&root, &rel("new"), 1).unwrap();
        assert_eq!(onto.map(&rel("src/a")).unwrap(), rel("new/a"));
        assert!(Placement::resolve(&root, &rel("new"), 2).is_err());
        assert!(Placement::resolve(&root, &rel("missing/new"), 1).is_err());
    }
}
