//! What outlives a session: the receiver's journals of interrupted transfers, and the
//! client's record of where each transfer's sources landed.
//!
//! A transfer is named by an id the client derives from the command (the same command
//! names the same transfer), so a run after an interruption finds the journal the last one
//! left, resumes its partial files, and lands in the same place. The place matters: `cp -r
//! src dst` puts `src`'s contents at `dst` the first time and, once `dst` exists, at
//! `dst/src`; the record keeps the second run from nesting the tree under itself.
//!
//! Journals are locked while a session uses them, so that the garbage collector (which
//! removes the temporaries of transfers abandoned for longer than `--keep-partial`) never
//! pulls one from under a running session. The format is `wanxfer_session::journal`.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use wanxfer_proto::{Placement, RelPath};
use wanxfer_session::journal::{self, Journal, Record};

use crate::fs::{self, Root};
use crate::Error;

/// A directory of state, created owner-only on first use.
#[derive(Debug, Clone)]
pub struct StateDir {
    path: PathBuf,
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

impl StateDir {
    pub fn open(path: &Path) -> Result<StateDir, Error> {
        for sub in ["", "journals", "placements"] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path.join(sub))
                .map_err(|e| Error::local("create state directory", path.display(), e))?;
        }
        Ok(StateDir {
            path: path.to_path_buf(),
        })
    }

    /// A client's default: `$WANXFER_STATE_DIR`, else `$XDG_STATE_HOME/wanxfer`, else
    /// `~/.local/state/wanxfer`.
    pub fn client_default() -> PathBuf {
        if let Some(dir) = std::env::var_os("WANXFER_STATE_DIR").filter(|d| !d.is_empty()) {
            return PathBuf::from(dir);
        }
        if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
            return PathBuf::from(dir).join("wanxfer");
        }
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
        PathBuf::from(home).join(".local/state/wanxfer")
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn journal_path(&self, transfer_id: &[u8; 16]) -> PathBuf {
        self.path
            .join("journals")
            .join(format!("{}.journal", hex(transfer_id)))
    }

    /// Where an earlier run of `transfer_id` placed its sources, if one did.
    pub fn placement(&self, transfer_id: &[u8; 16]) -> Option<Placement> {
        let path = self.path.join("placements").join(hex(transfer_id));
        match std::fs::read(path).ok()?.as_slice() {
            b"into" => Some(Placement::Into),
            b"onto" => Some(Placement::Onto),
            _ => None,
        }
    }

    /// Remembers where `transfer_id` placed its sources.
    pub fn set_placement(&self, transfer_id: &[u8; 16], placement: Placement) -> Result<(), Error> {
        let word: &[u8] = match placement {
            Placement::Into => b"into",
            Placement::Onto => b"onto",
            _ => return Ok(()),
        };
        let path = self.path.join("placements").join(hex(transfer_id));
        let temp = path.with_extension("new");
        std::fs::write(&temp, word)
            .and_then(|()| std::fs::rename(&temp, &path))
            .map_err(|e| Error::local("record the placement in", path.display(), e))
    }

    /// Whether an earlier run of `transfer_id` left a journal: what it verified may be
    /// held, so the receiver is not fresh.
    pub fn has_journal(&self, transfer_id: &[u8; 16]) -> bool {
        self.journal_path(transfer_id).exists()
    }

    /// Opens (and locks) the journal of `transfer_id` for a receiver writing beneath
    /// `root`. What an earlier run left is replayed and rewritten compactly; nothing is
    /// created until the first partial file needs it.
    pub fn journal(&self, transfer_id: [u8; 16], root: &Path) -> Result<JournalFile, Error> {
        JournalFile::open(self.journal_path(&transfer_id), transfer_id, root)
    }

    /// Removes the temporaries and journals of transfers untouched for longer than
    /// `keep`; gives back the space reserved beyond what the others verified. Journals in
    /// use by a session are left alone. Returns what it did, for the log, and what it kept.
    pub fn collect_garbage(&self, keep: Duration) -> Sweep {
        let mut done = Sweep::default();
        let Ok(entries) = std::fs::read_dir(self.path.join("journals")) else {
            return done;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("journal") {
                continue;
            }
            let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) else {
                continue;
            };
            if rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                .is_err()
            {
                continue; // a session is using it
            }
            let age = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|m| SystemTime::now().duration_since(m).ok())
                .unwrap_or_default();
            let mut bytes = Vec::new();
            if (&file).read_to_end(&mut bytes).is_err() {
                continue;
            }
            let journal = journal::replay(&bytes);
            let expired = age >= keep;
            let root = Root::open(Path::new(std::ffi::OsStr::from_bytes(&journal.root))).ok();
            let mut removed = 0;
            for partial in journal.files.values() {
                let Some(root) = &root else { break };
                let Some((parent, _)) = RelPath::new(&partial.dest)
                    .ok()
                    .and_then(|d| d.split_last().map(|(p, n)| (p, n.to_vec())))
                else {
                    continue;
                };
                let Ok(dir) = root.dir(&parent) else { continue };
                let name = std::ffi::OsStr::from_bytes(&partial.temp_name);
                if !fs::is_temp_name(&partial.temp_name) {
                    continue; // not a name we would have made: never touch it
                }
                if expired {
                    if rustix::fs::unlinkat(&dir, name, rustix::fs::AtFlags::empty()).is_ok() {
                        removed += 1;
                    }
                } else if let Ok(fd) = rustix::fs::openat(
                    &dir,
                    name,
                    rustix::fs::OFlags::WRONLY
                        | rustix::fs::OFlags::NOFOLLOW
                        | rustix::fs::OFlags::NONBLOCK
                        | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                ) {
                    let file = File::from(fd);
                    let mut have = wanxfer_session::Coverage::default();
                    for r in &partial.ranges {
                        let _ = have.add(r.offset, r.offset + u64::from(r.len));
                    }
                    for (start, end) in have.gaps(partial.size) {
                        let _ = fs::release_space(&file, start, end);
                    }
                }
            }
            if expired {
                let _ = std::fs::remove_file(&path);
                done.lines.push(format!(
                    "removed an abandoned transfer ({}, {} deleted, idle {} h)",
                    crate::error::count_of(journal.files.len() as u64, "partial file"),
                    crate::error::count_of(removed, "temporary file"),
                    age.as_secs() / 3600
                ));
            } else {
                done.partial_files_kept += journal.files.len() as u64;
            }
        }
        done
    }
}

/// What one sweep of the state directory did.
#[derive(Debug, Default)]
pub struct Sweep {
    /// What was removed, a line for the log each.
    pub lines: Vec<String>,
    /// Partial files of interrupted transfers kept for them to resume (not counting
    /// those of transfers running now).
    pub partial_files_kept: u64,
}

/// A journal a session appends to; locked for the session's life.
#[derive(Debug)]
pub struct JournalFile {
    path: PathBuf,
    transfer_id: [u8; 16],
    root: Vec<u8>,
    file: Mutex<Option<File>>,
    /// Set (under `file`'s lock) once the transfer completed: later appends are dropped
    /// rather than creating the journal again.
    removed: std::sync::atomic::AtomicBool,
    replayed: Journal,
    next_file: std::sync::atomic::AtomicU32,
}

impl JournalFile {
    fn open(path: PathBuf, transfer_id: [u8; 16], root: &Path) -> Result<JournalFile, Error> {
        let io = |op, e| Error::local(op, path.display(), e);
        let mut journal = JournalFile {
            transfer_id,
            root: root.as_os_str().as_bytes().to_vec(),
            file: Mutex::new(None),
            removed: Default::default(),
            replayed: Journal::default(),
            next_file: Default::default(),
            path: path.clone(),
        };
        let existing = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(journal),
            Err(e) => return Err(io("open journal", e)),
        };
        lock(&existing, &path)?;
        let mut bytes = Vec::new();
        (&existing)
            .read_to_end(&mut bytes)
            .map_err(|e| io("read journal", e))?;
        let replayed = journal::replay(&bytes);
        if replayed.transfer_id != Some(transfer_id) || replayed.root != journal.root {
            // Another transfer's, or another root's (a moved export): not ours to resume.
            journal.replayed = Journal::default();
        } else {
            journal.replayed = replayed;
        }
        journal.next_file.store(
            journal.replayed.next_file,
            std::sync::atomic::Ordering::Relaxed,
        );
        // Rewrite it compactly (merged ranges, closed files gone, torn tail dropped).
        let compact = journal.create_file(&journal.replayed.records())?;
        drop(existing);
        *journal.file.lock().expect("no panics while held") = Some(compact);
        Ok(journal)
    }

    fn create_file(&self, records: &[Record]) -> Result<File, Error> {
        let io = |op, e| Error::local(op, self.path.display(), e);
        let temp = self.path.with_extension("new");
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temp)
            .map_err(|e| io("create journal", e))?;
        lock(&file, &temp)?;
        let mut bytes = Vec::new();
        if records.is_empty() {
            Record::Header {
                transfer_id: self.transfer_id,
                root: self.root.clone(),
            }
            .encode(&mut bytes);
        }
        for r in records {
            r.encode(&mut bytes);
        }
        file.write_all(&bytes)
            .and_then(|()| fs::sync_data(&file))
            .and_then(|()| std::fs::rename(&temp, &self.path))
            .map_err(|e| io("write journal", e))?;
        Ok(file)
    }

    /// What an earlier run left (empty for a new transfer).
    pub fn replayed(&self) -> &Journal {
        &self.replayed
    }

    /// A number for a new partial file.
    pub fn next_file(&self) -> u32 {
        self.next_file
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Appends records (not yet durable: see [`JournalFile::sync`]).
    pub fn append(&self, records: &[Record]) -> Result<(), Error> {
        let mut bytes = Vec::new();
        records.iter().for_each(|r| r.encode(&mut bytes));
        let mut file = self.file.lock().expect("no panics while held");
        if self.removed.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        if file.is_none() {
            *file = Some(self.create_file(&[])?);
        }
        file.as_mut()
            .expect("created above")
            .write_all(&bytes)
            .map_err(|e| Error::local("append to journal", self.path.display(), e))
    }

    /// Makes what was appended durable.
    pub fn sync(&self) -> Result<(), Error> {
        match &*self.file.lock().expect("no panics while held") {
            Some(file) => fs::sync_data(file)
                .map_err(|e| Error::local("sync journal", self.path.display(), e)),
            None => Ok(()),
        }
    }

    /// The transfer completed: nothing is left to resume.
    pub fn remove(&self) {
        let mut file = self.file.lock().expect("no panics while held");
        self.removed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if file.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// The file system the journal lives on, for syncing it with others.
    pub fn sync_fd(&self) -> Option<std::os::fd::OwnedFd> {
        self.file
            .lock()
            .expect("no panics while held")
            .as_ref()
            .and_then(|f| f.as_fd().try_clone_to_owned().ok())
    }
}

fn lock(file: &File, path: &Path) -> Result<(), Error> {
    rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(|_| {
        Error::Limit(format!(
            "{}: another session of this transfer is running; wait for it to end",
            path.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use wanxfer_proto::HeldRange;

    #[test]
    fn placements_are_remembered_per_transfer() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        assert_eq!(state.placement(&[1; 16]), None);
        state.set_placement(&[1; 16], Placement::Onto).unwrap();
        assert_eq!(state.placement(&[1; 16]), Some(Placement::Onto));
        assert_eq!(state.placement(&[2; 16]), None);
    }

    /// A journal survives its session, comes back compacted for the next, is locked while
    /// in use, and goes once the transfer completes.
    #[test]
    fn a_journal_round_trips_locks_and_goes() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(&dir.path().join("state")).unwrap();
        let root = dir.path();
        let j = state.journal([3; 16], root).unwrap();
        let n = j.next_file();
        j.append(&[
            Record::Partial {
                file: n,
                dest: b"big".to_vec(),
                size: 10 << 20,
                mtime_sec: 1,
                mtime_nsec: 2,
                temp_name: fs::temp_name(9, b"big"),
            },
            Record::Verified {
                file: n,
                ranges: vec![HeldRange {
                    offset: 0,
                    len: 4 << 20,
                    digest: [5; 16],
                }],
            },
        ])
        .unwrap();
        j.sync().unwrap();
        assert!(
            matches!(state.journal([3; 16], root), Err(Error::Limit(_))),
            "locked"
        );
        drop(j);
        let again = state.journal([3; 16], root).unwrap();
        let (_, partial) = again.replayed().find(b"big").unwrap();
        assert_eq!(partial.held_bytes(), 4 << 20);
        assert!(again.next_file() > n);
        // Removed while others still hold it (the sink, the committer), and not brought
        // back by a late append.
        let shared = std::sync::Arc::new(again);
        let held = shared.clone();
        shared.remove();
        held.append(&[Record::Closed { file: n }]).unwrap();
        assert!(
            !state.journal_path(&[3; 16]).exists(),
            "the journal is gone"
        );
        assert!(state
            .journal([3; 16], root)
            .unwrap()
            .replayed()
            .files
            .is_empty());
    }
}
