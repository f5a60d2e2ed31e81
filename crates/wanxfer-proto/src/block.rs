//! The block: wanxfer's unit on the wire and in the pool (balman2013's tagged block).
//!
//! A block is self-describing so that it can arrive on any channel in any order: a fixed
//! 48-byte [`BlockHeader`], then `segment_count` [`Segment`]s of 40 bytes saying which
//! byte range of which file each part of the payload is, then the payload. One large
//! file's chunk is one segment; many small files packed together are many segments.
//!
//! The header and its segment table carry their own CRC-32C, so a receiver can trust the
//! lengths and placements before it reads a payload byte; that CRC cannot be switched off.
//! The payload is checked per segment: with [`BlockHeader::FLAG_SEGMENT_DIGESTS`] every
//! segment carries the XXH3-128 of its own bytes, which the receiver checks as the bytes
//! arrive, before it writes them. One pass over each byte then both catches damage in
//! transit and verifies each file's bytes from the sender's read to the receiver's write
//! (a file is whole when its verified segments cover it), whatever order its chunks arrive
//! in, so no stretch of a file is ever read back, and no per-file control message is needed
//! on the small-file fast path. A digest covers a segment's bytes; where they go (file and
//! offset) is covered by the header CRC. A session
//! without digests can carry a CRC-32C of the whole payload instead
//! ([`BlockHeader::FLAG_PAYLOAD_CRC`]).
//!
//! None of that resists someone who can change bytes on the path: a CRC or an XXH3 can be
//! recomputed over altered data. On a TLS channel the record layer's AEAD does that job. A
//! session that runs without encryption sets [`BlockHeader::FLAG_MAC`] instead, and the
//! header's last 12 bytes before its CRC carry a tag computed under a key only the two
//! sides hold, over the header and table (tag and CRC zeroed, see
//! [`BlockHeader::mac_input`]) and a keyed hash of the payload. This crate only carries the
//! tag; the keyed hash is the engine's.

use crate::codec::{Decoder, Encoder};
use crate::DecodeError;

pub const BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"WXBK");
/// Protocol ceiling on a block's payload; local settings are lower.
pub const MAX_BLOCK_PAYLOAD: u32 = 64 << 20;
/// Protocol ceiling on segments per block.
pub const MAX_SEGMENTS: u16 = 8192;

const HEADER_VERSION: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockHeader {
    pub flags: u8,
    pub segment_count: u16,
    pub payload_len: u32,
    /// CRC-32C of the payload, meaningful with [`BlockHeader::FLAG_PAYLOAD_CRC`].
    pub payload_crc: u32,
    /// Low 64 bits of the session id: a block written into a slot of another session (a
    /// bug, or a stale RDMA key) is recognised before it is placed.
    pub session_tag: u64,
    /// Sender-assigned block number, unique within a session.
    pub sequence: u64,
    /// With [`BlockHeader::FLAG_MAC`]: the block's authentication tag (zero without).
    pub mac: [u8; 12],
}

/// A byte range of one file within a block's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Segment {
    pub file_id: u64,
    pub offset: u64,
    pub len: u32,
    pub flags: u32,
    /// With [`BlockHeader::FLAG_SEGMENT_DIGESTS`]: the XXH3-128 of this segment's bytes
    /// (for a file that fits in one segment, the file's own XXH3-128).
    pub digest: [u8; 16],
}

impl Segment {
    pub const LEN: usize = 40;
    /// No later segment of this file follows from the sender.
    pub const FLAG_LAST: u32 = 1;

    pub fn is_last(&self) -> bool {
        self.flags & Self::FLAG_LAST != 0
    }

    fn encode(&self, e: &mut Encoder) {
        e.u64(self.file_id);
        e.u64(self.offset);
        e.u32(self.len);
        e.u32(self.flags);
        e.raw(&self.digest);
    }

    fn decode(d: &mut Decoder) -> Result<Self, DecodeError> {
        let seg = Segment {
            file_id: d.u64()?,
            offset: d.u64()?,
            len: d.u32()?,
            flags: d.u32()?,
            digest: d.array()?,
        };
        if seg.flags & !Self::FLAG_LAST != 0 {
            return Err(DecodeError::Unknown {
                what: "segment flags",
                value: seg.flags.into(),
            });
        }
        // Honest senders never send one (empty files are created from the manifest), and a
        // receiver would open a temporary for a file it then never writes.
        if seg.len == 0 {
            return Err(DecodeError::Invalid("empty segment"));
        }
        if seg.offset.checked_add(seg.len.into()).is_none() {
            return Err(DecodeError::Invalid("segment range overflows"));
        }
        Ok(seg)
    }
}

impl BlockHeader {
    pub const LEN: usize = 48;
    /// `payload_crc` holds the CRC-32C of the payload.
    pub const FLAG_PAYLOAD_CRC: u8 = 1;
    /// Every segment's `digest` is the XXH3-128 of that segment's bytes.
    pub const FLAG_SEGMENT_DIGESTS: u8 = 2;
    /// `mac` authenticates header, table and payload under a session key.
    pub const FLAG_MAC: u8 = 4;
    const KNOWN_FLAGS: u8 = Self::FLAG_PAYLOAD_CRC | Self::FLAG_SEGMENT_DIGESTS | Self::FLAG_MAC;
    /// Where the tag sits in the encoded header.
    const MAC_AT: std::ops::Range<usize> = 32..44;

    /// Bytes of the header plus its segment table.
    pub const fn encoded_len(segment_count: usize) -> usize {
        Self::LEN + segment_count * Segment::LEN
    }

    /// Writes the header and `segments` into `out` (cleared first), computing the header
    /// CRC. `self.segment_count` is taken from `segments`.
    pub fn encode(&self, segments: &[Segment], out: &mut Vec<u8>) {
        assert!(
            segments.len() <= MAX_SEGMENTS as usize,
            "packer bounds segments"
        );
        out.clear();
        let mut e = Encoder::new(out);
        e.u32(BLOCK_MAGIC);
        e.u8(HEADER_VERSION);
        e.u8(self.flags);
        e.u16(segments.len() as u16);
        e.u32(self.payload_len);
        e.u32(self.payload_crc);
        e.u64(self.session_tag);
        e.u64(self.sequence);
        e.raw(&self.mac);
        e.u32(0); // header CRC, filled below
        for s in segments {
            s.encode(&mut e);
        }
        let crc = header_crc(out);
        out[44..48].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes the fixed part. The result is not yet trusted: call [`Self::decode_segments`]
    /// with the segment table to verify the header CRC over both.
    pub fn decode_fixed(bytes: &[u8; Self::LEN]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(bytes);
        if d.u32()? != BLOCK_MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = d.u8()?;
        if version != HEADER_VERSION {
            return Err(DecodeError::Unknown {
                what: "block header version",
                value: version.into(),
            });
        }
        let flags = d.u8()?;
        if flags & !Self::KNOWN_FLAGS != 0 {
            return Err(DecodeError::Unknown {
                what: "block flags",
                value: flags.into(),
            });
        }
        let header = BlockHeader {
            flags,
            segment_count: d.u16()?,
            payload_len: d.u32()?,
            payload_crc: d.u32()?,
            session_tag: d.u64()?,
            sequence: d.u64()?,
            mac: d.array()?,
        };
        if flags & Self::FLAG_MAC == 0 && header.mac != [0; 12] {
            return Err(DecodeError::Invalid(
                "reserved block header bytes are not zero",
            ));
        }
        if header.segment_count == 0 || header.segment_count > MAX_SEGMENTS {
            return Err(DecodeError::Invalid("segment count out of range"));
        }
        if header.payload_len > MAX_BLOCK_PAYLOAD {
            return Err(DecodeError::TooLong {
                what: "block payload",
                len: header.payload_len as usize,
                max: MAX_BLOCK_PAYLOAD as usize,
            });
        }
        Ok(header)
    }

    /// Verifies the header CRC over `fixed` and `table` and decodes the segments into
    /// `out`, checking that they account for exactly the payload.
    pub fn decode_segments(
        &self,
        fixed: &[u8; Self::LEN],
        table: &[u8],
        out: &mut Vec<Segment>,
    ) -> Result<(), DecodeError> {
        if table.len() != self.segment_count as usize * Segment::LEN {
            return Err(DecodeError::Invalid("segment table length"));
        }
        let mut crc_input_fixed = *fixed;
        let claimed = u32::from_le_bytes([fixed[44], fixed[45], fixed[46], fixed[47]]);
        crc_input_fixed[44..48].fill(0);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&crc_input_fixed), table);
        if crc != claimed {
            return Err(DecodeError::Checksum {
                what: "block header",
            });
        }
        out.clear();
        let mut d = Decoder::new(table);
        let mut total: u64 = 0;
        for _ in 0..self.segment_count {
            let seg = Segment::decode(&mut d)?;
            total += u64::from(seg.len);
            out.push(seg);
        }
        d.finish()?;
        if total != u64::from(self.payload_len) {
            return Err(DecodeError::Invalid(
                "segments do not add up to the payload",
            ));
        }
        Ok(())
    }

    pub fn has_mac(&self) -> bool {
        self.flags & Self::FLAG_MAC != 0
    }

    /// The fixed part of an encoded header as a MAC covers it: tag and CRC zeroed (the
    /// segment table that follows is covered as it is).
    pub fn mac_input(fixed: &[u8]) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out.copy_from_slice(&fixed[..Self::LEN]);
        out[Self::MAC_AT].fill(0);
        out[44..48].fill(0);
        out
    }

    /// Writes `tag` into an encoded header (with its table) and its CRC again.
    pub fn seal_mac(encoded: &mut [u8], tag: [u8; 12]) {
        encoded[Self::MAC_AT].copy_from_slice(&tag);
        encoded[44..48].fill(0);
        let crc = header_crc(encoded);
        encoded[44..48].copy_from_slice(&crc.to_le_bytes());
    }

    pub fn has_payload_crc(&self) -> bool {
        self.flags & Self::FLAG_PAYLOAD_CRC != 0
    }

    pub fn has_segment_digests(&self) -> bool {
        self.flags & Self::FLAG_SEGMENT_DIGESTS != 0
    }

    /// Checks `payload` against the header's CRC (a no-op when the sender sent none).
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), DecodeError> {
        let mut check = self.payload_check();
        check.update(payload);
        check.finish()
    }

    /// A check fed the payload piece by piece, so that a receiver can checksum each piece
    /// right after reading it, while it is still in cache.
    pub fn payload_check(&self) -> PayloadCheck {
        PayloadCheck {
            expected: self.has_payload_crc().then_some(self.payload_crc),
            crc: 0,
        }
    }
}

/// The payload CRC of one block, computed incrementally (see
/// [`BlockHeader::payload_check`]).
#[derive(Debug, Clone, Copy)]
pub struct PayloadCheck {
    /// `None` when the sender sent no CRC: every piece is accepted.
    expected: Option<u32>,
    crc: u32,
}

impl PayloadCheck {
    /// Adds the next piece of the payload, in order.
    pub fn update(&mut self, piece: &[u8]) {
        if self.expected.is_some() {
            self.crc = crc32c::crc32c_append(self.crc, piece);
        }
    }

    /// Whether the pieces added so far are the payload the header describes.
    pub fn finish(self) -> Result<(), DecodeError> {
        match self.expected {
            Some(expected) if expected != self.crc => Err(DecodeError::Checksum {
                what: "block payload",
            }),
            _ => Ok(()),
        }
    }
}

fn header_crc(encoded: &[u8]) -> u32 {
    crc32c::crc32c(encoded)
}

const _: () = assert!(BlockHeader::LEN == 4 + 1 + 1 + 2 + 4 + 4 + 8 + 8 + 12 + 4);

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (BlockHeader, Vec<Segment>) {
        let segs = vec![
            Segment {
                file_id: 3,
                offset: 0,
                len: 10,
                flags: Segment::FLAG_LAST,
                digest: [9; 16],
            },
            Segment {
                file_id: 4,
                offset: 4096,
                len: 6,
                flags: 0,
                digest: [0; 16],
            },
        ];
        let h = BlockHeader {
            flags: BlockHeader::FLAG_PAYLOAD_CRC,
            segment_count: 2,
            payload_len: 16,
            payload_crc: crc32c::crc32c(&[1; 16]),
            session_tag: 77,
            sequence: 5,
            mac: [0; 12],
        };
        (h, segs)
    }

    fn decode_all(bytes: &[u8]) -> Result<(BlockHeader, Vec<Segment>), DecodeError> {
        let fixed: &[u8; BlockHeader::LEN] = bytes[..BlockHeader::LEN].try_into().unwrap();
        let h = BlockHeader::decode_fixed(fixed)?;
        let mut segs = Vec::new();
        h.decode_segments(fixed, &bytes[BlockHeader::LEN..], &mut segs)?;
        Ok((h, segs))
    }

    #[test]
    fn round_trip() {
        let (h, segs) = sample();
        let mut buf = Vec::new();
        h.encode(&segs, &mut buf);
        assert_eq!(buf.len(), BlockHeader::encoded_len(2));
        assert_eq!(decode_all(&buf).unwrap(), (h, segs));
        h.check_payload(&[1; 16]).unwrap();
        assert!(h.check_payload(&[2; 16]).is_err());
        let mut pieces = h.payload_check();
        pieces.update(&[1; 5]);
        pieces.update(&[1; 11]);
        pieces.finish().unwrap();
    }

    /// The segment-digest flag survives the round trip; a flag this version does not know
    /// is refused rather than ignored.
    #[test]
    fn known_flags_round_trip_and_unknown_ones_are_refused() {
        let (mut h, segs) = sample();
        h.flags = BlockHeader::FLAG_SEGMENT_DIGESTS;
        let mut buf = Vec::new();
        h.encode(&segs, &mut buf);
        let (back, _) = decode_all(&buf).unwrap();
        assert!(back.has_segment_digests() && !back.has_payload_crc());
        h.flags = 8;
        h.encode(&segs, &mut buf);
        assert!(matches!(
            decode_all(&buf),
            Err(DecodeError::Unknown {
                what: "block flags",
                ..
            })
        ));
    }

    /// A tag rides only with `FLAG_MAC`, sealing it keeps the header CRC valid, and the
    /// MAC's input is the header with tag and CRC zeroed whatever they held.
    #[test]
    fn a_mac_tag_needs_its_flag_and_seals_with_a_valid_crc() {
        let (mut h, segs) = sample();
        h.mac = [1; 12];
        let mut buf = Vec::new();
        h.encode(&segs, &mut buf);
        assert!(decode_all(&buf).is_err(), "a tag without the flag");
        h.flags |= BlockHeader::FLAG_MAC;
        h.mac = [0; 12];
        h.encode(&segs, &mut buf);
        let before = BlockHeader::mac_input(&buf);
        BlockHeader::seal_mac(&mut buf, [7; 12]);
        let (back, _) = decode_all(&buf).unwrap();
        assert!(back.has_mac());
        assert_eq!(back.mac, [7; 12]);
        assert_eq!(BlockHeader::mac_input(&buf), before);
    }

    #[test]
    fn any_flipped_bit_in_header_or_table_is_caught() {
        let (h, segs) = sample();
        let mut buf = Vec::new();
        h.encode(&segs, &mut buf);
        for i in 0..buf.len() * 8 {
            let mut bad = buf.clone();
            bad[i / 8] ^= 1 << (i % 8);
            assert!(decode_all(&bad).is_err(), "bit {i} flipped went unnoticed");
        }
    }

    /// Found by the `frame`/`block_header` fuzz targets: bytes we ignore would make two
    /// encodings mean one header and spoil the reserved space for later versions.
    #[test]
    fn reserved_bytes_must_be_zero() {
        let (h, segs) = sample();
        let mut buf = Vec::new();
        h.encode(&segs, &mut buf);
        buf[40] = 1;
        let crc = crc32c::crc32c_append(
            crc32c::crc32c(&[&buf[..44], &[0u8; 4][..]].concat()),
            &buf[48..],
        );
        buf[44..48].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            decode_all(&buf),
            Err(DecodeError::Invalid(
                "reserved block header bytes are not zero"
            ))
        );
    }

    #[test]
    fn segments_must_add_up_to_payload() {
        let (mut h, segs) = sample();
        h.payload_len = 17;
        let mut buf = Vec::new();
        h.encode(&segs, &mut buf);
        assert_eq!(
            decode_all(&buf),
            Err(DecodeError::Invalid(
                "segments do not add up to the payload"
            ))
        );
    }
}
