//! The digest every segment carries: XXH3-128 of the segment's bytes, sent little-endian
//! (for a file sent whole in one segment, the same value `xxhsum -H2` gives the file).
//!
//! It is the only check on a payload's bytes (see `wanxfer_proto::block`): the sender
//! hashes each piece right after reading it, the receiver right after receiving it, both
//! while the piece is still in the core's cache, and the receiver writes nothing that did
//! not match. Both ends hash every byte of every file once. `twox-hash` picks its AVX2
//! loop at run time where the CPU has it, so one portable binary gets it: 34-44 GB/s over
//! a block in cache on the benchmark machine, against 17-24 GB/s for the SSE2 loop that a
//! crate choosing at compile time gives every default x86-64 build (`cargo run --release
//! -p wanxfer-engine --example checksum_cost`). Over data coming from memory both run at
//! memory speed.

use subtle::ConstantTimeEq;
use twox_hash::XxHash3_128;
use wanxfer_proto::{BlockHeader, PayloadCheck, Segment};

use crate::pool::BlockBuf;

/// The key that authenticates one side's blocks in a session without encryption (see
/// `wanxfer_proto::block`): an XXH3 or a CRC can be recomputed by whoever alters the
/// bytes, so there every block also carries a tag only the two sides can compute.
///
/// The construction costs one keyed BLAKE3 pass over the payload, done where the other
/// checks run (as each piece is read, while it is in cache), and a short one over the
/// header and segment table with the payload's hash: the tag is the first 12 bytes of
/// `BLAKE3-keyed(tag key, header and table with tag and CRC zeroed, payload hash)`, the
/// payload hash `BLAKE3-keyed(payload key, payload)`, both keys derived from the session's
/// block key. BLAKE3 rather than HMAC-SHA-256 because it runs several times faster with
/// AVX2 (`examples/cipher_cost.rs`), and rather than a per-segment keyed hash in place of
/// XXH3 because the segment digests are also what the journal keeps and resumes compare,
/// which must stay the same from one session (and key) to the next.
#[derive(Clone)]
pub struct BlockKey {
    payload: [u8; 32],
    tag: [u8; 32],
}

impl std::fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockKey(..)")
    }
}

impl BlockKey {
    pub fn new(session_key: [u8; 32]) -> BlockKey {
        BlockKey {
            payload: blake3::derive_key("wanxfer 6 block payload hash", &session_key),
            tag: blake3::derive_key("wanxfer 6 block tag", &session_key),
        }
    }

    /// A hasher for a payload fed piece by piece.
    pub fn payload_hasher(&self) -> blake3::Hasher {
        blake3::Hasher::new_keyed(&self.payload)
    }

    pub fn payload_hash(&self, payload: &[u8]) -> [u8; 32] {
        *self.payload_hasher().update(payload).finalize().as_bytes()
    }

    /// The tag of a block whose encoded header and table are `encoded` and whose
    /// payload hashes to `payload_hash`.
    pub fn tag(&self, encoded: &[u8], payload_hash: &[u8; 32]) -> [u8; 12] {
        let mut h = blake3::Hasher::new_keyed(&self.tag);
        h.update(&BlockHeader::mac_input(encoded));
        h.update(&encoded[BlockHeader::LEN..]);
        h.update(payload_hash);
        let mut tag = [0u8; 12];
        tag.copy_from_slice(&h.finalize().as_bytes()[..12]);
        tag
    }

    /// Sets the tag of an encoded block header (with its table).
    pub fn seal(&self, encoded: &mut [u8], payload_hash: &[u8; 32]) {
        let tag = self.tag(encoded, payload_hash);
        BlockHeader::seal_mac(encoded, tag);
    }
}

/// How much data is read (from a socket or a file) before the digest runs over it: small
/// enough that the piece, and what the copy that brought it touched, are still in the
/// core's cache when the digest reads it; large enough that the extra system calls cost
/// little next to the copy. Hashing after a whole 4 MiB block reads it back from memory
/// once the blocks in flight outgrow the cache (`cargo run --release -p wanxfer-engine
/// --example checksum_cost -- 64`: copy then hash 0.147-0.153 CPU s/GB per 256 KiB against
/// 0.156-0.184 per block). 64 KiB against 256 KiB, 8 GiB memory to memory over loopback,
/// 10 alternating runs: median 22.5 against 18.7 Gbit/s and receiver 2.27 against 2.46 CPU
/// s, the smaller piece ahead in 9 of the 10 pairs (and in 3 of 3 with a 4 GiB file).
pub const IN_CACHE_PIECE_BYTES: usize = 64 << 10;

/// The block header flags that name the checks a block's bytes carry; what a session
/// agreed on, the sender sets and the receiver requires.
pub fn check_flags(payload_crc: bool, segment_digests: bool) -> u8 {
    let mut flags = 0;
    if payload_crc {
        flags |= BlockHeader::FLAG_PAYLOAD_CRC;
    }
    if segment_digests {
        flags |= BlockHeader::FLAG_SEGMENT_DIGESTS;
    }
    flags
}

/// The digest of bytes that arrive in order, a piece at a time.
#[derive(Clone, Default)]
pub struct FileHasher(XxHash3_128);

impl FileHasher {
    pub fn new() -> FileHasher {
        FileHasher::default()
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.write(data);
    }

    /// The digest of everything passed to `update` so far, as it goes on the wire.
    pub fn digest(&self) -> [u8; 16] {
        self.0.finish_128().to_le_bytes()
    }
}

/// The digest of bytes that are all in `data` (a segment held whole in one piece).
pub fn digest_of(data: &[u8]) -> [u8; 16] {
    XxHash3_128::oneshot(data).to_le_bytes()
}

/// Checks a received payload as it arrives, a piece at a time and in order: each
/// segment's bytes against the digest it carries (when the header says segments carry
/// digests), and the whole payload against its CRC (when it carries one).
pub struct PayloadVerifier {
    crc: PayloadCheck,
    digests: bool,
    /// The checks the header names (`check_flags`).
    checks: u8,
    /// The segment being hashed, and how many of its bytes are still to come.
    segment: usize,
    left: usize,
    /// The running hash of a segment that spans pieces; made only when one does.
    hasher: Option<FileHasher>,
    /// Per segment, whether its bytes failed their digest; empty while none has.
    damaged: Vec<bool>,
    /// A session without encryption: the payload's keyed hash, and the tag it must give.
    mac: Option<MacCheck>,
}

struct MacCheck {
    key: BlockKey,
    payload: blake3::Hasher,
    /// Header and table as received.
    encoded: Vec<u8>,
    claimed: [u8; 12],
}

impl PayloadVerifier {
    pub fn new(header: &BlockHeader, segments: &[Segment]) -> PayloadVerifier {
        PayloadVerifier {
            crc: header.payload_check(),
            digests: header.has_segment_digests(),
            checks: check_flags(header.has_payload_crc(), header.has_segment_digests()),
            segment: 0,
            left: segments.first().map_or(0, |s| s.len as usize),
            hasher: None,
            damaged: Vec::new(),
            mac: None,
        }
    }

    /// Also checks the block's tag under `key`, over `fixed` and `table` as they arrived
    /// (the caller has required the header to carry one).
    pub fn with_mac(
        mut self,
        key: &BlockKey,
        header: &BlockHeader,
        fixed: &[u8],
        table: &[u8],
    ) -> Self {
        let mut encoded = Vec::with_capacity(fixed.len() + table.len());
        encoded.extend_from_slice(fixed);
        encoded.extend_from_slice(table);
        self.mac = Some(MacCheck {
            key: key.clone(),
            payload: key.payload_hasher(),
            encoded,
            claimed: header.mac,
        });
        self
    }

    /// Adds the next `piece` of the payload that `segments` describe.
    pub fn update(&mut self, segments: &[Segment], mut piece: &[u8]) {
        self.crc.update(piece);
        if let Some(mac) = &mut self.mac {
            mac.payload.update(piece);
        }
        if !self.digests {
            return;
        }
        while !piece.is_empty() && self.segment < segments.len() {
            let whole = segments[self.segment].len as usize == self.left;
            if whole && piece.len() >= self.left {
                // A small file wholly in this piece: one-shot hashing skips the streaming
                // state, which costs more than the hash for a 4 KiB file.
                let (data, rest) = piece.split_at(self.left);
                self.judge(segments, digest_of(data));
                piece = rest;
                continue;
            }
            let take = piece.len().min(self.left);
            let hasher = self.hasher.get_or_insert_with(FileHasher::new);
            hasher.update(&piece[..take]);
            piece = &piece[take..];
            self.left -= take;
            if self.left == 0 {
                self.end_segment(segments);
            }
        }
    }

    /// Judges the current segment by what was hashed of it, and moves to the next.
    fn end_segment(&mut self, segments: &[Segment]) {
        let digest = self.hasher.take().unwrap_or_default().digest();
        self.judge(segments, digest);
    }

    fn judge(&mut self, segments: &[Segment], digest: [u8; 16]) {
        if digest != segments[self.segment].digest {
            self.damaged.resize(segments.len(), false);
            self.damaged[self.segment] = true;
        }
        self.segment += 1;
        self.left = segments.get(self.segment).map_or(0, |s| s.len as usize);
    }

    /// Per segment, whether its bytes are damaged (all of them when the payload CRC
    /// failed); empty when every byte checked out. Call once the whole payload went
    /// through [`PayloadVerifier::update`].
    pub fn finish(mut self, segments: &[Segment]) -> Vec<bool> {
        while self.digests && self.segment < segments.len() {
            self.end_segment(segments);
        }
        if self.crc.finish().is_err() {
            return vec![true; segments.len()];
        }
        if let Some(mac) = self.mac.take() {
            let hash = *mac.payload.finalize().as_bytes();
            let expected = mac.key.tag(&mac.encoded, &hash);
            if !bool::from(expected.ct_eq(&mac.claimed)) {
                // Altered on the path: nothing in the block can be trusted, not even
                // where its segments say they go (the header CRC can be recomputed too).
                return vec![true; segments.len()];
            }
        }
        self.damaged
    }

    /// Records on `block`, once its whole payload went through [`PayloadVerifier::update`],
    /// which of its segments are damaged and which checks its bytes passed through.
    pub fn settle(self, block: &mut BlockBuf) {
        block.checks = self.checks;
        block.damaged = self.finish(&block.segments);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The digest is XXH3-128 as every other implementation computes it (peers built
        /// with another crate, or a user's `xxhsum -H2`), however the bytes are split.
        #[test]
        fn matches_the_reference_xxh3_128_for_any_split(
            data in proptest::collection::vec(any::<u8>(), 0..20_000),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let reference = xxhash_rust::xxh3::xxh3_128(&data).to_le_bytes();
            prop_assert_eq!(digest_of(&data), reference);
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(data.len() + 1)).collect();
            at.sort_unstable();
            let mut hasher = FileHasher::new();
            let mut from = 0;
            for to in at.into_iter().chain([data.len()]) {
                hasher.update(&data[from..to]);
                from = to;
            }
            prop_assert_eq!(hasher.digest(), reference);
        }
    }

    /// Segments of the given lengths over `payload`, each carrying its digest.
    fn segments_over(payload: &[u8], lens: &[usize]) -> Vec<Segment> {
        let mut at = 0;
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                let seg = Segment {
                    file_id: i as u64,
                    offset: 0,
                    len: len as u32,
                    flags: Segment::FLAG_LAST,
                    digest: digest_of(&payload[at..at + len]),
                };
                at += len;
                seg
            })
            .collect()
    }

    /// Runs `payload` through a verifier in pieces cut at `cuts`.
    fn verify(
        header: &BlockHeader,
        segments: &[Segment],
        payload: &[u8],
        cuts: &[usize],
    ) -> Vec<bool> {
        let mut check = PayloadVerifier::new(header, segments);
        let mut from = 0;
        for to in cuts.iter().copied().chain([payload.len()]) {
            check.update(segments, &payload[from..to]);
            from = to;
        }
        check.finish(segments)
    }

    proptest! {
        /// However the payload is cut into pieces, intact segments pass and a flipped bit
        /// damages exactly the segment it is in.
        #[test]
        fn a_flipped_bit_damages_exactly_its_segment(
            lens in proptest::collection::vec(prop_oneof![1 => Just(0usize), 3 => 1usize..3000], 1..12),
            cut_at in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
            flip in any::<prop::sample::Index>(),
        ) {
            let total: usize = lens.iter().sum();
            let payload: Vec<u8> = (0..total).map(|i| (i * 31 % 255) as u8).collect();
            let segments = segments_over(&payload, &lens);
            let header = BlockHeader {
                flags: BlockHeader::FLAG_SEGMENT_DIGESTS,
                segment_count: segments.len() as u16,
                payload_len: total as u32,
                ..Default::default()
            };
            let mut cuts: Vec<usize> = cut_at.iter().map(|c| c.index(total + 1)).collect();
            cuts.sort_unstable();
            prop_assert!(verify(&header, &segments, &payload, &cuts).is_empty());
            if total > 0 {
                let at = flip.index(total);
                let mut damaged = payload.clone();
                damaged[at] ^= 0x04;
                let hit = lens.iter().scan(0, |end, &len| { *end += len; Some(*end) })
                    .position(|end| at < end).unwrap();
                let verdict = verify(&header, &segments, &damaged, &cuts);
                let expected: Vec<bool> = (0..lens.len()).map(|i| i == hit).collect();
                prop_assert_eq!(verdict, expected);
            }
        }
    }

    /// A sealed block passes; a flipped payload bit, a changed segment table (with its
    /// digest and CRC recomputed, as someone on the path can) or another session's key
    /// damages every segment.
    #[test]
    fn a_block_tag_catches_what_digests_and_crcs_cannot() {
        let payload: Vec<u8> = (0..150_000u32).map(|i| (i % 253) as u8).collect();
        let segments = segments_over(&payload, &[100_000, 50_000]);
        let key = BlockKey::new([7; 32]);
        let seal = |segments: &[Segment], payload: &[u8], key: &BlockKey| {
            let header = BlockHeader {
                flags: BlockHeader::FLAG_SEGMENT_DIGESTS | BlockHeader::FLAG_MAC,
                payload_len: payload.len() as u32,
                ..Default::default()
            };
            let mut encoded = Vec::new();
            header.encode(segments, &mut encoded);
            key.seal(&mut encoded, &key.payload_hash(payload));
            encoded
        };
        let check = |encoded: &[u8], payload: &[u8], key: &BlockKey| {
            let fixed: [u8; BlockHeader::LEN] = encoded[..BlockHeader::LEN].try_into().unwrap();
            let header = BlockHeader::decode_fixed(&fixed).unwrap();
            let mut segs = Vec::new();
            header
                .decode_segments(&fixed, &encoded[BlockHeader::LEN..], &mut segs)
                .unwrap();
            let mut v = PayloadVerifier::new(&header, &segs).with_mac(
                key,
                &header,
                &fixed,
                &encoded[BlockHeader::LEN..],
            );
            for piece in payload.chunks(IN_CACHE_PIECE_BYTES) {
                v.update(&segs, piece);
            }
            v.finish(&segs)
        };
        let sealed = seal(&segments, &payload, &key);
        assert!(check(&sealed, &payload, &key).is_empty());

        // Data and digest changed together: the digests pass, the tag does not.
        let mut altered = payload.clone();
        altered[10] ^= 1;
        let forged_segments = segments_over(&altered, &[100_000, 50_000]);
        let mut forged = Vec::new();
        BlockHeader {
            flags: BlockHeader::FLAG_SEGMENT_DIGESTS | BlockHeader::FLAG_MAC,
            payload_len: altered.len() as u32,
            ..Default::default()
        }
        .encode(&forged_segments, &mut forged);
        BlockHeader::seal_mac(&mut forged, sealed[32..44].try_into().unwrap());
        assert_eq!(check(&forged, &altered, &key), [true, true]);
        assert_eq!(check(&sealed, &altered, &key), [true, true]);
        assert_eq!(
            check(&sealed, &payload, &BlockKey::new([8; 32])),
            [true, true],
            "another session's key"
        );
    }

    /// A session without digests checks the payload CRC, and a mismatch damages every
    /// segment (it says nothing about where the damage is); without either, nothing is
    /// checked.
    #[test]
    fn a_payload_crc_mismatch_damages_every_segment() {
        let payload = vec![9u8; 5000];
        let mut segments = segments_over(&payload, &[1000, 4000]);
        for seg in &mut segments {
            seg.digest = [0; 16];
        }
        let mut header = BlockHeader {
            flags: BlockHeader::FLAG_PAYLOAD_CRC,
            segment_count: 2,
            payload_len: 5000,
            payload_crc: crc32c::crc32c(&payload),
            ..Default::default()
        };
        assert!(verify(&header, &segments, &payload, &[2500]).is_empty());
        header.payload_crc ^= 1;
        assert_eq!(verify(&header, &segments, &payload, &[2500]), [true, true]);
        header.flags = 0;
        assert!(verify(&header, &segments, &payload, &[2500]).is_empty());
    }
}
