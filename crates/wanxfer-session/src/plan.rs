//! What the sender reads into which block: balman2013's aggregation as pure bookkeeping.
//!
//! A file of at least one block is cut into block-sized chunks at multiples of the block
//! size from its start, so that the ranges a receiver journals and later reports as held
//! fall on the same boundaries in every run; smaller files are packed many to a block,
//! which is what lets 20,000 small files stream like one large one. The planner knows
//! ids, sizes and ranges only; the engine maps a plan to file handles and reads it.

use wanxfer_proto::MAX_SEGMENTS;

/// One segment of a sent block, as the sender's ledger remembers it until the receiver
/// confirms the block arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegRef {
    pub id: u64,
    pub offset: u64,
    pub len: u32,
}

/// Work for one reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Read these ranges of one file, one block per [`chunks`] piece, in order.
    Chunks {
        id: u64,
        size: u64,
        ranges: Vec<(u64, u64)>,
    },
    /// Read these whole small files, `(id, size)`, into one block.
    Packed { files: Vec<(u64, u64)> },
}

impl Plan {
    /// Payload bytes this plan sends.
    pub fn bytes(&self) -> u64 {
        match self {
            Plan::Chunks { ranges, .. } => ranges.iter().map(|(s, e)| e - s).sum(),
            Plan::Packed { files } => files.iter().map(|(_, size)| size).sum(),
        }
    }
}

/// The blocks `ranges` are read in: each range cut at multiples of `block_size` counted
/// from the file's start, as `(offset, len)`.
pub fn chunks(ranges: &[(u64, u64)], block_size: u64) -> impl Iterator<Item = (u64, u32)> + '_ {
    ranges.iter().flat_map(move |&(start, end)| {
        let mut at = start;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let boundary = (at / block_size + 1) * block_size;
            let next = boundary.min(end);
            let piece = (at, (next - at) as u32);
            at = next;
            Some(piece)
        })
    })
}

/// Groups files into plans.
#[derive(Debug)]
pub struct Planner {
    block_size: u64,
    pack: Vec<(u64, u64)>,
    pack_bytes: u64,
}

impl Planner {
    pub fn new(block_size: u64) -> Planner {
        Planner {
            block_size: block_size.max(1),
            pack: Vec::new(),
            pack_bytes: 0,
        }
    }

    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Whether a file of `size` bytes is sent packed with others.
    pub fn is_packed(&self, size: u64) -> bool {
        size < self.block_size
    }

    /// A whole file of `size > 0` bytes.
    pub fn add_whole(&mut self, id: u64, size: u64, out: &mut Vec<Plan>) {
        if !self.is_packed(size) {
            out.push(Plan::Chunks {
                id,
                size,
                ranges: vec![(0, size)],
            });
            return;
        }
        if self.pack_bytes + size > self.block_size || self.pack.len() >= MAX_SEGMENTS as usize {
            self.flush(out);
        }
        self.pack_bytes += size;
        self.pack.push((id, size));
    }

    /// Some ranges of a file (what is left after a resume, or what a lost channel held).
    pub fn add_ranges(&mut self, id: u64, size: u64, ranges: Vec<(u64, u64)>, out: &mut Vec<Plan>) {
        if ranges == [(0, size)] {
            return self.add_whole(id, size, out);
        }
        if !ranges.is_empty() {
            out.push(Plan::Chunks { id, size, ranges });
        }
    }

    /// Emits the partly filled pack, if any.
    pub fn flush(&mut self, out: &mut Vec<Plan>) {
        if !self.pack.is_empty() {
            out.push(Plan::Packed {
                files: std::mem::take(&mut self.pack),
            });
            self.pack_bytes = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_small_files_and_chunks_large_ones() {
        let mut p = Planner::new(100);
        let mut out = Vec::new();
        p.add_whole(0, 40, &mut out);
        p.add_whole(1, 40, &mut out);
        p.add_whole(2, 40, &mut out); // does not fit: the first pack is emitted
        p.add_whole(3, 100, &mut out); // a whole block: chunked on its own
        p.flush(&mut out);
        assert_eq!(
            out,
            vec![
                Plan::Packed {
                    files: vec![(0, 40), (1, 40)]
                },
                Plan::Chunks {
                    id: 3,
                    size: 100,
                    ranges: vec![(0, 100)]
                },
                Plan::Packed {
                    files: vec![(2, 40)]
                },
            ]
        );
    }

    #[test]
    fn chunks_fall_on_block_boundaries_from_the_file_start() {
        let pieces: Vec<_> = chunks(&[(0, 250), (350, 420)], 100).collect();
        assert_eq!(
            pieces,
            vec![(0, 100), (100, 100), (200, 50), (350, 50), (400, 20)]
        );
    }
}
