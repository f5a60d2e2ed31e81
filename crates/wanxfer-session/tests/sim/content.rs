//! File contents as labels, so that what lands can be compared with its source exactly
//! without moving a byte.
//!
//! A label stands for one version of one source file: two byte ranges hold the same bytes
//! exactly when they have the same label and the same offsets. A file the simulation writes
//! is a set of labelled runs; it equals its source when one run of the source's label
//! covers it whole. Label 0 is never given to a source: it stands for bytes nobody wrote
//! (a hole, or data of no known version), so its digests match nothing.

use std::collections::BTreeMap;

pub type Label = u32;

/// Bytes that match no source.
pub const UNKNOWN: Label = 0;

/// Which label each byte of a file has: disjoint runs `start -> (end, label)`, adjacent
/// runs of one label merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runs {
    map: BTreeMap<u64, (u64, Label)>,
}

impl Runs {
    pub fn whole(size: u64, label: Label) -> Runs {
        let mut runs = Runs::default();
        runs.write(0, size, label);
        runs
    }

    /// Writes `[start, end)` with `label`, over whatever was there.
    pub fn write(&mut self, start: u64, end: u64, label: Label) {
        if start >= end {
            return;
        }
        let overlapping: Vec<(u64, (u64, Label))> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(s, v)| (*s, *v))
            .collect();
        for (s, (e, l)) in overlapping {
            self.map.remove(&s);
            if s < start {
                self.map.insert(s, (start, l));
            }
            if e > end {
                self.map.insert(end, (e, l));
            }
        }
        let mut new_start = start;
        let mut new_end = end;
        if let Some((&s, &(e, l))) = self.map.range(..start).next_back() {
            if e == start && l == label {
                self.map.remove(&s);
                new_start = s;
            }
        }
        if let Some(&(e, l)) = self.map.get(&end) {
            if l == label {
                self.map.remove(&end);
                new_end = e;
            }
        }
        self.map.insert(new_start, (new_end, label));
    }

    /// Writes every run of `other` over this.
    pub fn overlay(&mut self, other: &Runs) {
        for (&s, &(e, l)) in &other.map {
            self.write(s, e, l);
        }
    }

    /// Whether every byte of `[0, size)` has `label`, and there is nothing past it.
    pub fn is_whole(&self, size: u64, label: Label) -> bool {
        if size == 0 {
            return self.map.is_empty();
        }
        self.map.len() == 1 && self.map.get(&0) == Some(&(size, label))
    }

    /// The label of `[start, end)` if one run covers it.
    pub fn label_over(&self, start: u64, end: u64) -> Option<Label> {
        self.map
            .range(..=start)
            .next_back()
            .filter(|(_, (e, _))| *e >= end)
            .map(|(_, (_, l))| *l)
    }

    /// The digest the receiver would compute of `[offset, offset + len)` of this file.
    pub fn digest(&self, offset: u64, len: u32) -> [u8; 16] {
        let label = self
            .label_over(offset, offset + u64::from(len))
            .unwrap_or(UNKNOWN);
        digest(label, offset, len)
    }

    /// The runs `(start, end, label)`, in order.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, Label)> + '_ {
        self.map.iter().map(|(&s, &(e, l))| (s, e, l))
    }

    pub fn describe(&self) -> String {
        self.map
            .iter()
            .map(|(s, (e, l))| format!("{s}..{e}:v{l}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The digest of `len` bytes of version `label` at `offset` (the XXH3-128 a segment would
/// carry): distinct for distinct contents, and for unknown bytes unlike any source's.
pub fn digest(label: Label, offset: u64, len: u32) -> [u8; 16] {
    let mut x = mix(u64::from(label) ^ 0x9e37_79b9_7f4a_7c15);
    x = mix(x ^ offset);
    x = mix(x ^ u64::from(len));
    let y = mix(x ^ 0xd1b5_4a32_d192_ed03);
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&x.to_le_bytes());
    out[8..].copy_from_slice(&y.to_le_bytes());
    if label == UNKNOWN {
        out[0] ^= 0xff; // no source label mixes to this
    }
    out
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
