//! Which byte ranges of a file a receiver has, as merged intervals.
//!
//! Blocks arrive on any channel in any order, so a file is complete not when "its last
//! block" arrives but when its coverage is whole. The sender's planner uses the same type
//! the other way round: what is left to send of a file is the complement of what the
//! receiver confirmed it holds.

use std::collections::BTreeMap;

/// Most separate ranges one file may have: a sender interleaving tiny pieces would
/// otherwise grow this without bound.
pub const MAX_RANGES_PER_FILE: usize = 1 << 16;

/// A set of byte ranges `[start, end)`, merged where they touch.
/// A run of bytes, `(start, end)`.
type Range = (u64, u64);

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Coverage {
    ranges: BTreeMap<u64, u64>,
    bytes: u64,
}

/// Why a range could not be added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoverageError {
    #[error("bytes {start}..{end} were already received")]
    Overlap { start: u64, end: u64 },
    #[error("the file arrived in more than {MAX_RANGES_PER_FILE} separate pieces")]
    TooManyPieces,
}

impl Coverage {
    /// Refuses `[start, end)` if any of it is already there.
    pub fn check_free(&self, start: u64, end: u64) -> Result<(), CoverageError> {
        let (before, after) = self.neighbours(start);
        if before.is_some_and(|(_, e)| e > start) || after.is_some_and(|(s, _)| s < end) {
            return Err(CoverageError::Overlap { start, end });
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
    pub fn add(&mut self, start: u64, end: u64) -> Result<(), CoverageError> {
        if start >= end {
            return Ok(());
        }
        self.check_free(start, end)?;
        let (before, after) = self.neighbours(start);
        let mut new_start = start;
        let mut new_end = end;
        if let Some((s, _)) = before.filter(|&(_, e)| e == start) {
            self.ranges.remove(&s);
            new_start = s;
        }
        if let Some((s, e)) = after.filter(|&(s, _)| s == end) {
            self.ranges.remove(&s);
            new_end = e;
        }
        if self.ranges.len() >= MAX_RANGES_PER_FILE {
            return Err(CoverageError::TooManyPieces);
        }
        self.ranges.insert(new_start, new_end);
        self.bytes += end - start;
        Ok(())
    }

    /// Whether `[start, end)` is wholly inside what is there.
    pub fn contains(&self, start: u64, end: u64) -> bool {
        start >= end
            || self
                .ranges
                .range(..=start)
                .next_back()
                .is_some_and(|(_, &e)| e >= end)
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_complete(&self, size: u64) -> bool {
        self.bytes == size
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The merged ranges, in order.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(&s, &e)| (s, e))
    }

    /// What of `[0, size)` is not there, in order.
    pub fn gaps(&self, size: u64) -> Vec<(u64, u64)> {
        let mut gaps = Vec::new();
        let mut at = 0;
        for (s, e) in self.ranges() {
            if s >= size {
                break;
            }
            if s > at {
                gaps.push((at, s));
            }
            at = at.max(e);
        }
        if at < size {
            gaps.push((at, size));
        }
        gaps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn merges_and_refuses_overlap() {
        let mut c = Coverage::default();
        c.add(10, 20).unwrap();
        c.add(0, 10).unwrap();
        c.add(30, 40).unwrap();
        assert!(c.add(15, 25).is_err());
        assert!(c.add(35, 45).is_err());
        assert_eq!(c.gaps(50), vec![(20, 30), (40, 50)]);
        c.add(20, 30).unwrap();
        assert!(c.is_complete(40));
        assert_eq!(c.ranges().count(), 1);
        assert!(c.contains(5, 35) && !c.contains(35, 41));
    }

    proptest! {
        /// Whatever the arrival order, pieces that tile a file complete it exactly once,
        /// and the gaps are always the complement of what arrived.
        #[test]
        fn any_arrival_order_completes_and_gaps_complement(
            order in Just((0..24u64).collect::<Vec<_>>()).prop_shuffle(),
        ) {
            let size = 24 * 7 - 3;
            let mut c = Coverage::default();
            for (n, &i) in order.iter().enumerate() {
                prop_assert!(!c.is_complete(size));
                c.add(i * 7, ((i + 1) * 7).min(size)).unwrap();
                let missing: u64 = c.gaps(size).iter().map(|(s, e)| e - s).sum();
                prop_assert_eq!(missing + c.bytes(), size);
                prop_assert_eq!(c.gaps(size).is_empty(), n + 1 == order.len());
            }
            prop_assert!(c.is_complete(size));
        }
    }
}
