//! The receiver's journal: which stretches of which partly received files are on disk and
//! verified, with the digests that verified them, so that an interrupted transfer resumes
//! instead of starting over, whichever side died and however.
//!
//! Only files written under a named temporary (those of more than one block) are
//! journaled. A file that comes whole in one block is written and put in place in one
//! go; after a crash it is either under its final name, whole (the rename waits for its
//! data to be durable), or nowhere, and a re-run's comparison finds it either way.
//!
//! The journal is an append-only log of checksummed records. The engine appends a
//! [`Record::Verified`] only after the ranges it names are durable in the temporary
//! (`fdatasync` first), and syncs the journal after appending, so a range in the journal
//! is a range on disk. A crash mid-append leaves a torn last record, which replay drops:
//! [`replay`] stops at the first record that does not check out. This module is the
//! format and the replay, with no I/O.

use std::collections::BTreeMap;

use wanxfer_proto::{
    Decoder, Encoder, HeldRange, MAX_HELD_RANGES, MAX_HELD_RANGES_PER_FILE, MAX_PATH_BYTES,
};

use crate::coverage::Coverage;

const MAGIC: &[u8; 16] = b"wanxfer journal1";
/// Longest record body accepted on replay.
pub const MAX_RECORD: usize = 1 << 20;
/// Most partial files one journal tracks; more are simply not resumable.
pub const MAX_FILES: usize = 1 << 20;

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// First in every journal: which transfer it belongs to, and the directory its
    /// destinations are relative to (so that abandoned temporaries can be found and
    /// removed without the session that made them).
    Header {
        transfer_id: [u8; 16],
        root: Vec<u8>,
    },
    /// A file began under a named temporary. `file` numbers it within this journal.
    Partial {
        file: u32,
        dest: Vec<u8>,
        size: u64,
        mtime_sec: i64,
        mtime_nsec: u32,
        temp_name: Vec<u8>,
    },
    /// These ranges of `file` are durable in its temporary and matched their digests.
    Verified { file: u32, ranges: Vec<HeldRange> },
    /// `file` is no longer resumable: it was put in place, or it failed.
    Closed { file: u32 },
}

impl Record {
    /// Appends the record, framed and checksummed, to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; 8]);
        let mut e = Encoder::new(out);
        match self {
            Record::Header { transfer_id, root } => {
                e.u8(1);
                e.raw(MAGIC);
                e.raw(transfer_id);
                e.bytes(root);
            }
            Record::Partial {
                file,
                dest,
                size,
                mtime_sec,
                mtime_nsec,
                temp_name,
            } => {
                e.u8(2);
                e.u32(*file);
                e.bytes(dest);
                e.u64(*size);
                e.i64(*mtime_sec);
                e.u32(*mtime_nsec);
                e.bytes(temp_name);
            }
            Record::Verified { file, ranges } => {
                assert!(ranges.len() <= MAX_HELD_RANGES, "callers split long lists");
                e.u8(3);
                e.u32(*file);
                e.u32(ranges.len() as u32);
                for r in ranges {
                    e.u64(r.offset);
                    e.u32(r.len);
                    e.raw(&r.digest);
                }
            }
            Record::Closed { file } => {
                e.u8(4);
                e.u32(*file);
            }
        }
        let body_len = (out.len() - start - 8) as u32;
        let crc = crc32c::crc32c(&out[start + 8..]);
        out[start..start + 4].copy_from_slice(&body_len.to_le_bytes());
        out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    }

    fn decode(body: &[u8]) -> Option<Record> {
        let mut d = Decoder::new(body);
        let record = match d.u8().ok()? {
            1 => {
                if &d.array::<16>().ok()? != MAGIC {
                    return None;
                }
                Record::Header {
                    transfer_id: d.array().ok()?,
                    root: d.bytes("root", MAX_PATH_BYTES).ok()?.to_vec(),
                }
            }
            2 => Record::Partial {
                file: d.u32().ok()?,
                dest: d.bytes("path", MAX_PATH_BYTES).ok()?.to_vec(),
                size: d.u64().ok()?,
                mtime_sec: d.i64().ok()?,
                mtime_nsec: d.u32().ok()?,
                temp_name: d.bytes("temporary name", 255).ok()?.to_vec(),
            },
            3 => {
                let file = d.u32().ok()?;
                let n = d.count("ranges", MAX_HELD_RANGES, 28).ok()?;
                let ranges = (0..n)
                    .map(|_| {
                        Some(HeldRange {
                            offset: d.u64().ok()?,
                            len: d.u32().ok()?,
                            digest: d.array().ok()?,
                        })
                    })
                    .collect::<Option<_>>()?;
                Record::Verified { file, ranges }
            }
            4 => Record::Closed {
                file: d.u32().ok()?,
            },
            _ => return None,
        };
        d.finish().ok()?;
        Some(record)
    }
}

/// A partly received file, as the journal knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialFile {
    pub dest: Vec<u8>,
    pub size: u64,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    pub temp_name: Vec<u8>,
    /// Verified ranges, sorted and apart.
    pub ranges: Vec<HeldRange>,
}

impl PartialFile {
    /// Bytes verified.
    pub fn held_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| u64::from(r.len)).sum()
    }
}

/// What a journal says, replayed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    pub transfer_id: Option<[u8; 16]>,
    pub root: Vec<u8>,
    /// Open partial files by their number.
    pub files: BTreeMap<u32, PartialFile>,
    /// Bytes of the log that replayed cleanly; anything after is a torn tail.
    pub valid_len: usize,
    /// The next unused file number.
    pub next_file: u32,
}

impl Journal {
    /// The open partial file written for `dest`, with its number.
    pub fn find(&self, dest: &[u8]) -> Option<(u32, &PartialFile)> {
        self.files
            .iter()
            .find(|(_, f)| f.dest == dest)
            .map(|(n, f)| (*n, f))
    }

    /// The records that rebuild this state, for rewriting a journal compactly.
    pub fn records(&self) -> Vec<Record> {
        let mut out = Vec::new();
        if let Some(transfer_id) = self.transfer_id {
            out.push(Record::Header {
                transfer_id,
                root: self.root.clone(),
            });
        }
        for (&file, f) in &self.files {
            out.push(Record::Partial {
                file,
                dest: f.dest.clone(),
                size: f.size,
                mtime_sec: f.mtime_sec,
                mtime_nsec: f.mtime_nsec,
                temp_name: f.temp_name.clone(),
            });
            for ranges in f.ranges.chunks(MAX_HELD_RANGES) {
                out.push(Record::Verified {
                    file,
                    ranges: ranges.to_vec(),
                });
            }
        }
        out
    }

    fn apply(&mut self, record: Record) -> bool {
        match record {
            Record::Header { transfer_id, root } => {
                if self.transfer_id.is_some() {
                    return false;
                }
                self.transfer_id = Some(transfer_id);
                self.root = root;
            }
            _ if self.transfer_id.is_none() => return false,
            Record::Partial {
                file,
                dest,
                size,
                mtime_sec,
                mtime_nsec,
                temp_name,
            } => {
                if self.files.len() >= MAX_FILES {
                    return false;
                }
                self.next_file = self.next_file.max(file.saturating_add(1));
                self.files.insert(
                    file,
                    PartialFile {
                        dest,
                        size,
                        mtime_sec,
                        mtime_nsec,
                        temp_name,
                        ranges: Vec::new(),
                    },
                );
            }
            Record::Verified { file, ranges } => {
                if let Some(f) = self.files.get_mut(&file) {
                    merge(f, ranges);
                }
            }
            Record::Closed { file } => {
                self.files.remove(&file);
            }
        }
        true
    }
}

/// Adds one record's `ranges` to what `f` holds, keeping its list sorted and apart.
///
/// A range that overlaps ranges of earlier records replaces them: those bytes were written
/// again (a resumed range the sender refused, because its source changed behind the same
/// size and modification time), and a record is only appended once a sync has made its
/// bytes durable, so the later record is the one that describes the disk. Keeping the
/// earlier one would have the journal vouch, with the old digest, for bytes that are no
/// longer the old version's; a source put back to that version would then match it.
/// Within one record, a range past the file's size or overlapping another is ignored (a
/// journal never records one; a damaged one is not trusted with it).
fn merge(f: &mut PartialFile, ranges: Vec<HeldRange>) {
    let mut fresh = Coverage::default();
    let mut taken = Vec::new();
    for r in ranges {
        let end = r.offset.saturating_add(u64::from(r.len));
        if r.len == 0 || end > f.size {
            continue;
        }
        if fresh.add(r.offset, end).is_ok() {
            taken.push(r);
        }
    }
    f.ranges.retain(|old| {
        fresh
            .check_free(old.offset, old.offset + u64::from(old.len))
            .is_ok()
    });
    for r in taken {
        if f.ranges.len() >= MAX_HELD_RANGES_PER_FILE {
            break;
        }
        f.ranges.push(r);
    }
    f.ranges.sort_by_key(|r| r.offset);
}

/// Replays a journal's bytes. Stops at the first record that is torn, fails its
/// checksum or makes no sense: what comes after a crash's torn write is not trusted.
pub fn replay(bytes: &[u8]) -> Journal {
    let mut journal = Journal::default();
    let mut at = 0;
    while let Some(head) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes(head[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
        if len > MAX_RECORD {
            break;
        }
        let Some(body) = bytes.get(at + 8..at + 8 + len) else {
            break;
        };
        if crc32c::crc32c(body) != crc {
            break;
        }
        let Some(record) = Record::decode(body) else {
            break;
        };
        if !journal.apply(record) {
            break;
        }
        at += 8 + len;
        journal.valid_len = at;
    }
    journal
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn range(offset: u64, len: u32) -> HeldRange {
        HeldRange {
            offset,
            len,
            digest: [offset as u8; 16],
        }
    }

    fn sample() -> Vec<u8> {
        let mut log = Vec::new();
        for r in [
            Record::Header {
                transfer_id: [7; 16],
                root: b"/srv".to_vec(),
            },
            Record::Partial {
                file: 0,
                dest: b"a/big".to_vec(),
                size: 1000,
                mtime_sec: 5,
                mtime_nsec: 6,
                temp_name: b".wanxfer-x.part".to_vec(),
            },
            Record::Verified {
                file: 0,
                ranges: vec![range(100, 100), range(0, 100)],
            },
            Record::Partial {
                file: 1,
                dest: b"a/done".to_vec(),
                size: 10,
                mtime_sec: 0,
                mtime_nsec: 0,
                temp_name: b".wanxfer-y.part".to_vec(),
            },
            Record::Closed { file: 1 },
            Record::Verified {
                file: 0,
                ranges: vec![range(900, 100)],
            },
        ] {
            r.encode(&mut log);
        }
        log
    }

    #[test]
    fn replay_rebuilds_open_files_with_sorted_ranges() {
        let log = sample();
        let j = replay(&log);
        assert_eq!(j.transfer_id, Some([7; 16]));
        assert_eq!(j.valid_len, log.len());
        assert_eq!(j.next_file, 2);
        let (n, f) = j.find(b"a/big").unwrap();
        assert_eq!(n, 0);
        assert_eq!(
            f.ranges,
            vec![range(0, 100), range(100, 100), range(900, 100)]
        );
        assert_eq!(f.held_bytes(), 300);
        assert!(j.find(b"a/done").is_none(), "closed files are gone");
        // Compaction rebuilds the same state.
        let mut compact = Vec::new();
        j.records().iter().for_each(|r| r.encode(&mut compact));
        let again = replay(&compact);
        assert_eq!(again.files, j.files);
    }

    proptest! {
        /// A crash can tear the log anywhere: replay keeps exactly the whole records before
        /// the tear, and a flipped byte stops it at the damaged record, never later.
        #[test]
        fn a_torn_or_damaged_log_replays_its_good_prefix(cut in 0usize..400, flip in any::<prop::sample::Index>()) {
            let log = sample();
            let cut = cut.min(log.len());
            let j = replay(&log[..cut]);
            prop_assert!(j.valid_len <= cut);
            let whole = replay(&log[..j.valid_len]);
            prop_assert_eq!(&whole, &j);
            let mut damaged = log.clone();
            let at = flip.index(damaged.len());
            damaged[at] ^= 0x40;
            let d = replay(&damaged);
            prop_assert!(d.valid_len <= at);
        }
    }

    /// Found by the simulation (tests/sim.rs): a resumed range refused because the source
    /// changed behind the same size and mtime is written again and checkpointed; the
    /// journal must then vouch for the new bytes, not the old digest.
    #[test]
    fn a_range_written_again_replaces_what_an_earlier_record_said() {
        let mut log = Vec::new();
        for r in [
            Record::Header {
                transfer_id: [1; 16],
                root: Vec::new(),
            },
            Record::Partial {
                file: 0,
                dest: b"f".to_vec(),
                size: 300,
                mtime_sec: 0,
                mtime_nsec: 0,
                temp_name: b"t".to_vec(),
            },
            Record::Verified {
                file: 0,
                ranges: vec![range(0, 100), range(100, 100)],
            },
            Record::Verified {
                file: 0,
                ranges: vec![HeldRange {
                    offset: 100,
                    len: 100,
                    digest: [9; 16],
                }],
            },
        ] {
            r.encode(&mut log);
        }
        let j = replay(&log);
        assert_eq!(
            j.files[&0].ranges,
            vec![
                range(0, 100),
                HeldRange {
                    offset: 100,
                    len: 100,
                    digest: [9; 16]
                }
            ]
        );
    }

    /// Ranges past the file, or overlapping each other within one record, are not
    /// trusted.
    #[test]
    fn impossible_ranges_are_ignored() {
        let mut log = Vec::new();
        Record::Header {
            transfer_id: [1; 16],
            root: Vec::new(),
        }
        .encode(&mut log);
        Record::Partial {
            file: 3,
            dest: b"f".to_vec(),
            size: 150,
            mtime_sec: 0,
            mtime_nsec: 0,
            temp_name: b"t".to_vec(),
        }
        .encode(&mut log);
        Record::Verified {
            file: 3,
            ranges: vec![
                range(0, 100),
                range(50, 100),
                range(100, 100),
                range(100, 50),
            ],
        }
        .encode(&mut log);
        let j = replay(&log);
        assert_eq!(j.files[&3].ranges, vec![range(0, 100), range(100, 50)]);
    }
}
