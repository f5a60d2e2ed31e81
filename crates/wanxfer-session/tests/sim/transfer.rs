//! A whole transfer: sessions of the same manifest run one after another, as a user (or a
//! retry loop) runs the same command again after a failure, until one completes or the
//! bound on sessions is reached.
//!
//! Between sessions the source may change, including the ways a quick check cannot see
//! (same size, same modification time) and a file put back to an earlier version; only
//! the sender's check of what the receiver holds stands between those and a corrupt file.
//! The only change the model never makes is one that makes the quick check lie about a
//! file already under its final name: skipping such a file is what the quick check is
//! for, not a fault.
//!
//! The checks across sessions: the transfer converges (a session in which nothing but
//! data channels fails completes it); at the end every entry is in place exactly as its
//! source is; and what a session sends of each file is at most what the receiver could not
//! keep from earlier sessions (the file size, less what it had checkpointed of the same
//! version, or, comparing by checksum, what already matched in place; nothing for a file
//! already up to date).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use wanxfer_proto::{Compare, HeldRange};
use wanxfer_session::chunks;
use wanxfer_session::journal::{self, Journal, Record};

use super::content::{digest, Label, Runs};
use super::session::Session;
use super::world::{Config, Disk, Kind, Mtime, Node, SrcEntry};

const ROOT: &[u8] = b"/srv/dest";

/// What a checkpoint made durable of one partial file, by the model's own account: the
/// journal (the code under test) must offer at least this on the next session.
#[derive(Debug, Clone)]
struct Checkpointed {
    file: u32,
    size: u64,
    mtime: Mtime,
    ranges: Runs,
}

/// A Verified record appended and not yet synced: journal file number, destination, and
/// the runs it vouches for with the versions they hold.
type Unsynced = (u32, String, Vec<(u64, u64, Label)>);

pub struct World {
    pub cfg: Config,
    pub rng: ChaCha8Rng,
    pub src: Vec<SrcEntry>,
    pub by_path: HashMap<String, usize>,
    pub disk: Disk,
    pub trace: bool,
    /// Model the engine's sink as it was before the simulation found two holes in it
    /// (`WANXFER_SIM_AS_ENGINE=1`), to show what the model catches. In two ways that
    /// journal could vouch for bytes that were not on disk, and the sender, finding the
    /// digests right, let a file be completed with them:
    /// - a file's temporary is named after its destination alone, and the journal's
    ///   `Closed` for an earlier temporary was not synced before the next one was created
    ///   under that name: after a crash that kept a rename but not its `Closed`, and
    ///   another once the new temporary exists, the old ranges were offered from the new
    ///   file (seed 63588). The model syncs the journal before creating a temporary; the
    ///   engine makes every `Closed` for a temporary whose name may be used again durable
    ///   first (`Sink::forget_partial`);
    /// - a resumed range the sender refuses (its source changed behind the same size and
    ///   mtime) was written again while the journal still named the old digest; a crash
    ///   that keeps some new bytes, and the source put back to the old version, and the
    ///   old range was accepted over the new bytes (seed 118779). Both the model
    ///   (`Session::rejournal`) and the engine (`Sink::resume`) stop vouching for resumed
    ///   ranges until the sender's verdict.
    pub as_engine: bool,
    trace_log: Vec<String>,
    /// An invariant broken where it cannot be returned at once.
    pub late_error: Option<String>,
    next_label: Label,
    transfer_id: [u8; 16],
    checkpointed: HashMap<String, Checkpointed>,
    /// Journal file numbers closed: a Verified record after its Closed counts for nothing.
    closed: HashSet<u32>,
    /// Verified records appended and not yet synced.
    unsynced: Vec<Unsynced>,
}

/// What a run of many sessions did, for the soak's report.
#[derive(Debug, Default, Clone)]
pub struct Summary {
    pub sessions: u64,
    pub entries: u64,
    pub crashes: u64,
    pub faulted: u64,
    pub channels_died: u64,
    pub channels_cut: u64,
    pub channels_held_back: u64,
    pub steps: u64,
    pub bytes_resent: u64,
}

impl Summary {
    pub fn add(&mut self, other: &Summary) {
        self.sessions += other.sessions;
        self.entries += other.entries;
        self.crashes += other.crashes;
        self.faulted += other.faulted;
        self.channels_died += other.channels_died;
        self.channels_cut += other.channels_cut;
        self.channels_held_back += other.channels_held_back;
        self.steps += other.steps;
        self.bytes_resent += other.bytes_resent;
    }
}

/// Runs the transfer of seed `seed` to its end. `Err` says which invariant broke.
/// `as_engine` models the engine's sink as it was before its two journal fixes (see
/// [`World::as_engine`]).
pub fn run(seed: u64, trace: bool, as_engine: bool) -> Result<Summary, String> {
    let mut w = World::new(seed, trace);
    w.as_engine = as_engine;
    let result = w.run_sessions();
    if trace {
        for line in &w.trace_log {
            eprintln!("{line}");
        }
    }
    result.map_err(|e| format!("{e}\n  config: {:?}", w.cfg))
}

impl World {
    fn new(seed: u64, trace: bool) -> World {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let cfg = Config::generate(&mut rng);
        let mut transfer_id = [0u8; 16];
        transfer_id[..8].copy_from_slice(&seed.to_le_bytes());
        let mut w = World {
            cfg,
            rng,
            src: Vec::new(),
            by_path: HashMap::new(),
            disk: Disk::default(),
            trace,
            as_engine: false,
            trace_log: Vec::new(),
            late_error: None,
            next_label: 1,
            transfer_id,
            checkpointed: HashMap::new(),
            closed: HashSet::new(),
            unsynced: Vec::new(),
        };
        w.generate_source();
        w.generate_destination();
        w
    }

    fn run_sessions(&mut self) -> Result<Summary, String> {
        let mut summary = Summary {
            entries: self.src.len() as u64,
            ..Summary::default()
        };
        for n in 0..self.cfg.max_sessions {
            if n > 0 && self.rng.random_bool(self.cfg.change) {
                self.change_source();
            }
            let calm = n >= self.cfg.calm_after;
            self.log(format!(
                "=== session {n}{}",
                if calm { " (calm)" } else { "" }
            ));
            let report = Session::new(self, calm)
                .run()
                .map_err(|e| format!("session {n}: {e}"))?;
            summary.sessions += 1;
            summary.steps += report.steps;
            summary.channels_died += report.channels_died;
            summary.channels_cut += report.channels_cut;
            summary.channels_held_back += report.channels_held_back;
            summary.bytes_resent += report.bytes_resent;
            summary.crashes += u64::from(report.crashed.is_some());
            summary.faulted += u64::from(report.faulted);
            if report.complete {
                self.check_tree().map_err(|e| format!("session {n}: {e}"))?;
                return Ok(summary);
            }
            if calm {
                return Err(format!(
                    "session {n}: nothing failed but channels, yet the transfer did not complete \
                     ({report:?})"
                ));
            }
        }
        Err(format!(
            "the transfer did not complete in {} sessions",
            self.cfg.max_sessions
        ))
    }

    pub fn log(&mut self, line: String) {
        if self.trace {
            self.trace_log.push(line);
        }
    }

    fn label(&mut self) -> Label {
        let label = self.next_label;
        self.next_label += 1;
        label
    }

    // ---- The source and the destination as the first session finds them.

    fn generate_source(&mut self) {
        let n = match self.rng.random_range(0..100) {
            0..=69 => self.rng.random_range(1..=12),
            70..=94 => self.rng.random_range(13..=60),
            _ => self.rng.random_range(61..=300),
        };
        let bs = self.cfg.block_size;
        let mut dirs: Vec<String> = Vec::new();
        let mut entries = Vec::new();
        for i in 0..n {
            let parent = if dirs.is_empty() || self.rng.random_bool(0.3) {
                String::new()
            } else {
                format!("{}/", dirs[self.rng.random_range(0..dirs.len())])
            };
            let mtime = (
                1_700_000_000 + self.rng.random_range(0..1_000_000),
                self.rng.random_range(0..1_000_000_000),
            );
            let (kind, path, size, target) = match self.rng.random_range(0..100) {
                0..=11 => {
                    let path = format!("{parent}d{i}");
                    dirs.push(path.clone());
                    (Kind::Dir, path, 0, Vec::new())
                }
                12..=17 => (
                    Kind::Symlink,
                    format!("{parent}l{i}"),
                    0,
                    format!("t{}", self.rng.random_range(0..5)).into_bytes(),
                ),
                18..=19 => (Kind::Special, format!("{parent}p{i}"), 0, Vec::new()),
                _ => {
                    let size = self.file_size(bs);
                    (Kind::File, format!("{parent}f{i}"), size, Vec::new())
                }
            };
            let label = self.label();
            entries.push(SrcEntry {
                path,
                kind,
                size,
                mtime,
                label,
                target,
                history: Vec::new(),
            });
        }
        // The walk lists a directory before what is in it.
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        self.by_path = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.path.clone(), i))
            .collect();
        self.src = entries;
    }

    fn file_size(&mut self, bs: u64) -> u64 {
        match self.rng.random_range(0..100) {
            0..=9 => 0,
            10..=44 => self.rng.random_range(1..bs),
            45..=49 => bs,
            _ => bs * self.rng.random_range(1..=6) + self.rng.random_range(0..bs),
        }
    }

    fn generate_destination(&mut self) {
        for i in 0..self.src.len() {
            let e = self.src[i].clone();
            let node = match e.kind {
                Kind::Dir => self.rng.random_bool(0.5).then_some(Node::Dir),
                Kind::Symlink => match self.rng.random_range(0..4) {
                    0 => Some(Node::Symlink { target: e.target }),
                    1 => Some(Node::Symlink {
                        target: b"elsewhere".to_vec(),
                    }),
                    _ => None,
                },
                Kind::Special => None,
                Kind::File => match self.rng.random_range(0..100) {
                    // Up to date from an earlier transfer.
                    0..=24 => Some(Node::File {
                        size: e.size,
                        mtime: e.mtime,
                        data: Runs::whole(e.size, e.label),
                    }),
                    // The same bytes, touched.
                    25..=34 => Some(Node::File {
                        size: e.size,
                        mtime: (e.mtime.0 - 7, e.mtime.1),
                        data: Runs::whole(e.size, e.label),
                    }),
                    // An older version, of the same size or not.
                    35..=59 => {
                        let old = self.label();
                        let size = if self.rng.random_bool(0.5) {
                            e.size
                        } else {
                            self.file_size(self.cfg.block_size)
                        };
                        let mtime = (e.mtime.0 - 1000, e.mtime.1);
                        self.src[i].history.push((size, mtime, old));
                        // Partly the current version: comparing by checksum keeps some.
                        let mut data = Runs::whole(size, old);
                        if size == e.size && self.rng.random_bool(0.5) {
                            let cut = self.rng.random_range(0..=size);
                            data.write(0, cut.min(size), e.label);
                        }
                        Some(Node::File { size, mtime, data })
                    }
                    _ => None,
                },
            };
            if let Some(node) = node {
                self.disk.names.insert(e.path, node);
            }
        }
    }

    /// Whether the quick check would take `path` as being of this size and mtime while it
    /// holds other bytes.
    fn quick_check_would_lie(&self, path: &str, size: u64, mtime: Mtime, label: Label) -> bool {
        matches!(self.disk.names.get(path), Some(Node::File { size: s, mtime: m, data })
            if *s == size && *m == mtime && !data.is_whole(size, label))
    }

    fn change_source(&mut self) {
        let candidates: Vec<usize> = (0..self.src.len())
            .filter(|&i| matches!(self.src[i].kind, Kind::File | Kind::Symlink))
            .collect();
        if candidates.is_empty() {
            return;
        }
        for _ in 0..self.rng.random_range(1..=3) {
            let i = candidates[self.rng.random_range(0..candidates.len())];
            let e = self.src[i].clone();
            if e.kind == Kind::Symlink {
                self.src[i].target = format!("t{}", self.rng.random_range(0..9)).into_bytes();
                continue;
            }
            let (size, mtime, label) = match self.rng.random_range(0..3) {
                // An ordinary edit.
                0 => {
                    let size = if self.rng.random_bool(0.5) {
                        e.size
                    } else {
                        self.file_size(self.cfg.block_size)
                    };
                    let label = self.label();
                    (
                        size,
                        (e.mtime.0 + self.rng.random_range(1..100), e.mtime.1),
                        label,
                    )
                }
                // New bytes behind the same size and mtime.
                1 => (e.size, e.mtime, self.label()),
                // Put back as it was.
                _ => match e.history.last() {
                    Some(&old) => old,
                    None => continue,
                },
            };
            if self.quick_check_would_lie(&e.path, size, mtime, label) {
                continue;
            }
            self.log(format!(
                "source {} changes from v{} ({} bytes, {:?}) to v{label} ({size} bytes, {mtime:?})",
                e.path, e.label, e.size, e.mtime
            ));
            let f = &mut self.src[i];
            f.history.push((f.size, f.mtime, f.label));
            f.size = size;
            f.mtime = mtime;
            f.label = label;
        }
    }

    // ---- What the sessions rely on.

    /// Whether `e` is already in place as its source is.
    pub fn in_place_and_current(&self, e: &SrcEntry) -> bool {
        match (e.kind, self.disk.names.get(&e.path)) {
            (Kind::File, Some(Node::File { size, mtime, data })) => {
                *size == e.size && *mtime == e.mtime && data.is_whole(e.size, e.label)
            }
            (Kind::Symlink, Some(Node::Symlink { target })) => *target == e.target,
            _ => false,
        }
    }

    /// A guess at how long a calm session takes, to spread faults over.
    pub fn horizon(&self) -> Duration {
        let bs = self.cfg.block_size;
        let blocks: u64 = self.src.iter().map(|e| e.size.div_ceil(bs)).sum();
        let per_block = (self.cfg.block_time.0 + self.cfg.block_time.1) / 2;
        let rtt = self.cfg.latency.0 + self.cfg.latency.1;
        let rounds = self.src.len() as u32 / self.cfg.window.max(1) + 3;
        per_block * (blocks as u32 / u32::from(self.cfg.streams) + 1)
            + rtt * rounds * 2
            + Duration::from_millis(30)
    }

    /// The engine's `JournalFile::open`: replay, keep only this transfer's, and rewrite
    /// it compactly.
    pub fn open_journal(&mut self) -> Journal {
        let replayed = journal::replay(&self.disk.journal);
        let ours = replayed.transfer_id == Some(self.transfer_id) && replayed.root == ROOT;
        let replayed = if ours { replayed } else { Journal::default() };
        let mut records = replayed.records();
        if records.is_empty() {
            records.push(Record::Header {
                transfer_id: self.transfer_id,
                root: ROOT.to_vec(),
            });
        }
        self.disk.journal.clear();
        self.disk.append(&records);
        self.disk.sync_journal();
        replayed
    }

    pub fn note_verified(&mut self, file: u32, dest: &str, ranges: &[(HeldRange, Label)]) {
        let runs = ranges
            .iter()
            .map(|(h, l)| (h.offset, h.offset + u64::from(h.len), *l))
            .collect();
        self.unsynced.push((file, dest.to_string(), runs));
    }

    pub fn append_closed(&mut self, file: u32, dest: &str) {
        self.disk.append(&[Record::Closed { file }]);
        self.closed.insert(file);
        if self.checkpointed.get(dest).is_some_and(|c| c.file == file) {
            self.checkpointed.remove(dest);
        }
        self.unsynced.retain(|(f, d, _)| !(*f == file && d == dest));
    }

    /// The journal was synced: what its Verified records name is durable.
    pub fn journal_synced(&mut self) {
        for (file, dest, runs) in std::mem::take(&mut self.unsynced) {
            let Some(&i) = self.by_path.get(&dest) else {
                continue;
            };
            if self.closed.contains(&file) {
                continue;
            }
            let (size, mtime) = (self.src[i].size, self.src[i].mtime);
            let entry = self
                .checkpointed
                .entry(dest)
                .or_insert_with(|| Checkpointed {
                    file,
                    size,
                    mtime,
                    ranges: Runs::default(),
                });
            if entry.file != file {
                *entry = Checkpointed {
                    file,
                    size,
                    mtime,
                    ranges: Runs::default(),
                };
            }
            for (s, e, l) in runs {
                entry.ranges.write(s, e, l);
            }
        }
    }

    pub fn crash(&mut self) {
        self.unsynced.clear();
        let mut rng = std::mem::replace(&mut self.rng, ChaCha8Rng::seed_from_u64(0));
        self.disk.crash(&mut rng);
        self.rng = rng;
    }

    pub fn remove_journal(&mut self) {
        self.disk.journal.clear();
        self.disk.journal_synced = 0;
        self.checkpointed.clear();
        self.closed.clear();
        self.unsynced.clear();
    }

    /// The most each file may have planned in a session that starts now: its size, less
    /// what the receiver can show it already holds of this version.
    pub fn resend_bounds(&self, journal: &Journal) -> HashMap<usize, u64> {
        let bs = self.cfg.block_size;
        let compare = self.cfg.compare;
        let mut bounds = HashMap::new();
        for (i, e) in self.src.iter().enumerate() {
            if e.kind != Kind::File || e.size == 0 {
                continue;
            }
            let in_place = self.disk.names.get(&e.path);
            let quick = matches!(in_place, Some(Node::File { size, mtime, .. })
                if *size == e.size && *mtime == e.mtime);
            let resumable = journal.find(e.path.as_bytes()).is_some_and(|(_, p)| {
                p.size == e.size
                    && (p.mtime_sec, p.mtime_nsec) == e.mtime
                    && !p.ranges.is_empty()
                    && self.disk.temps.contains_key(&e.path)
            });
            let kept = if compare != Compare::Always && quick {
                e.size
            } else if let Some(c) = self
                .checkpointed
                .get(&e.path)
                .filter(|c| c.size == e.size && c.mtime == e.mtime)
            {
                c.ranges
                    .runs()
                    .filter(|(_, _, l)| *l == e.label)
                    .map(|(s, end, _)| end - s)
                    .sum()
            } else if let (Compare::Checksum, Some(Node::File { size, data, .. }), false) =
                (compare, in_place, resumable)
            {
                if *size == e.size {
                    chunks(&[(0, e.size)], bs)
                        .filter(|(o, l)| data.digest(*o, *l) == digest(e.label, *o, *l))
                        .map(|(_, l)| u64::from(l))
                        .sum()
                } else {
                    0
                }
            } else {
                0
            };
            bounds.insert(i, e.size - kept.min(e.size));
        }
        bounds
    }

    /// After a completed session: every entry in place exactly as its source is.
    fn check_tree(&self) -> Result<(), String> {
        for e in &self.src {
            let there = self.disk.names.get(&e.path);
            let ok = match (e.kind, there) {
                (Kind::Dir, Some(Node::Dir)) => true,
                (Kind::Special, None) => true,
                (Kind::File | Kind::Symlink, _) => self.in_place_and_current(e),
                _ => false,
            };
            if !ok {
                return Err(format!(
                    "the transfer completed, but {} ({:?}, v{}, {} bytes) is {:?}",
                    e.path, e.kind, e.label, e.size, there
                ));
            }
        }
        if !self.disk.journal.is_empty() {
            return Err("the transfer completed, but its journal is still there".into());
        }
        Ok(())
    }
}
