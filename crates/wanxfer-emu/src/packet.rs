//! Just enough IPv4/TCP handling for the forwarder: the virtio-net header the TUN devices
//! put in front of each packet, splitting a GSO batch (up to 64 KB of TCP sent as one
//! packet, thanks to TSO on the TUN) into the MSS-sized segments it stands for, with IP
//! and TCP headers fixed up, and corrupting a payload byte the way a bad line card or
//! memory does on a long path: silently, with the TCP checksum fixed up so that TCP
//! accepts the segment and only an end-to-end check (wanxfer's block CRC) can catch it.
//!
//! Not handled (passed through whole, never split): IPv6 and UDP batches; the namespaces
//! only carry IPv4 and the TUN devices only offer TSO for IPv4.

/// Bytes of the virtio-net header in front of every packet on the TUN devices.
pub const VNET_HDR_LEN: usize = 10;
/// The packet's checksum is partial: compute it from `csum_start`, store at `+csum_offset`.
const F_NEEDS_CSUM: u8 = 1;
/// A TCP over IPv4 batch to be cut into `gso_size` payloads.
const GSO_TCPV4: u8 = 1;
const GSO_ECN: u8 = 0x80;

/// `struct virtio_net_hdr` (little-endian, as the TUN device uses on this host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    /// Reads the header from the first [`VNET_HDR_LEN`] bytes of a frame.
    pub fn parse(frame: &[u8]) -> Option<VnetHdr> {
        let b = frame.get(..VNET_HDR_LEN)?;
        let le = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Some(VnetHdr {
            flags: b[0],
            gso_type: b[1],
            hdr_len: le(2),
            gso_size: le(4),
            csum_start: le(6),
            csum_offset: le(8),
        })
    }

    pub fn encode(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
        b
    }
}

/// The shape of a TCP/IPv4 GSO batch: what each of its segments carries on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// IP + TCP header bytes, repeated in every segment.
    pub headers: usize,
    /// Payload bytes per segment (the last may carry fewer).
    pub mss: usize,
    /// Payload bytes of the whole batch.
    pub payload: usize,
}

impl Batch {
    pub fn segments(&self) -> usize {
        self.payload.div_ceil(self.mss)
    }

    /// Wire bytes (IP packet length) of segment `i`.
    pub fn segment_len(&self, i: usize) -> usize {
        self.headers + self.mss.min(self.payload - i * self.mss)
    }

    /// Wire bytes of all segments together.
    pub fn wire_len(&self) -> usize {
        self.segments() * self.headers + self.payload
    }
}

/// The batch a packet stands for, if the TUN handed over a TCP/IPv4 GSO batch of more
/// than one segment; `None` for a packet that is already one segment on the wire.
pub fn gso_batch(hdr: &VnetHdr, packet: &[u8]) -> Option<Batch> {
    if hdr.gso_type & !GSO_ECN != GSO_TCPV4 || hdr.gso_size == 0 {
        return None;
    }
    let (_, payload_start) = tcp_payload(packet)?;
    let batch = Batch {
        headers: payload_start,
        mss: usize::from(hdr.gso_size),
        payload: packet.len() - payload_start,
    };
    (batch.segments() > 1).then_some(batch)
}

/// Cuts a batch into its segments, each a frame (a zero virtio-net header, then the
/// packet) with its own IP length, IP id, IP checksum, TCP sequence number, flags
/// (FIN and PSH only on the last, CWR only on the first) and complete TCP checksum, as
/// the sender's NIC would have put them on the wire.
pub fn split(packet: &[u8], batch: &Batch) -> Vec<Vec<u8>> {
    let ip_len = usize::from(packet[0] & 0x0f) * 4;
    let id = u16::from_be_bytes([packet[4], packet[5]]);
    let seq = u32::from_be_bytes(packet[ip_len + 4..ip_len + 8].try_into().expect("4 bytes"));
    let (headers, payload) = packet.split_at(batch.headers);
    let last = batch.segments() - 1;
    payload
        .chunks(batch.mss)
        .enumerate()
        .map(|(i, chunk)| {
            let mut frame = Vec::with_capacity(VNET_HDR_LEN + headers.len() + chunk.len());
            frame.extend_from_slice(&[0; VNET_HDR_LEN]);
            frame.extend_from_slice(headers);
            frame.extend_from_slice(chunk);
            let p = &mut frame[VNET_HDR_LEN..];
            let total = p.len() as u16;
            p[2..4].copy_from_slice(&total.to_be_bytes());
            p[4..6].copy_from_slice(&id.wrapping_add(i as u16).to_be_bytes());
            let seg_seq = seq.wrapping_add((i * batch.mss) as u32);
            p[ip_len + 4..ip_len + 8].copy_from_slice(&seg_seq.to_be_bytes());
            if i != last {
                p[ip_len + 13] &= !(0x01 | 0x08); // FIN, PSH
            }
            if i != 0 {
                p[ip_len + 13] &= !0x80; // CWR
            }
            ipv4_checksum(p);
            tcp_checksum(p, ip_len);
            frame
        })
        .collect()
}

/// Completes a partial checksum the sender's stack left for the NIC (the field holds the
/// pseudo-header sum; the sum from `csum_start` to the end, folded and inverted, is the
/// checksum) and clears the flag, so that the packet can be changed and re-checksummed.
pub fn finish_checksum(hdr: &mut VnetHdr, packet: &mut [u8]) {
    if hdr.flags & F_NEEDS_CSUM == 0 {
        return;
    }
    let start = usize::from(hdr.csum_start);
    let at = start + usize::from(hdr.csum_offset);
    if at + 2 > packet.len() {
        return;
    }
    let sum = !fold(sum16(&packet[start..]));
    packet[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    hdr.flags &= !F_NEEDS_CSUM;
}

fn ipv4_checksum(p: &mut [u8]) {
    let ip_len = usize::from(p[0] & 0x0f) * 4;
    p[10..12].fill(0);
    let sum = !fold(sum16(&p[..ip_len]));
    p[10..12].copy_from_slice(&sum.to_be_bytes());
}

fn tcp_checksum(p: &mut [u8], ip_len: usize) {
    p[ip_len + 16..ip_len + 18].fill(0);
    let tcp_len = (p.len() - ip_len) as u64;
    let sum = sum16(&p[12..20]) + 6 + tcp_len + sum16(&p[ip_len..]);
    let sum = !fold(sum);
    p[ip_len + 16..ip_len + 18].copy_from_slice(&sum.to_be_bytes());
}

/// Big-endian 16-bit words summed without folding (odd tail padded with zero).
fn sum16(bytes: &[u8]) -> u64 {
    let mut chunks = bytes.chunks_exact(2);
    let mut sum: u64 = chunks
        .by_ref()
        .map(|w| u64::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    if let [tail] = chunks.remainder() {
        sum += u64::from(*tail) << 8;
    }
    sum
}

fn fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// Flips one payload byte of an IPv4 TCP segment (chosen by `pick`) and updates the TCP
/// checksum incrementally (RFC 1624). Returns false, leaving the packet alone, for
/// anything else (not IPv4, not TCP, fragments, no payload).
pub fn corrupt_tcp_payload(packet: &mut [u8], pick: u64) -> bool {
    let Some((tcp_start, payload_start)) = tcp_payload(packet) else {
        return false;
    };
    let payload_len = packet.len() - payload_start;
    let at = payload_start + (pick % payload_len as u64) as usize;
    let flip = 1u8 << ((pick >> 32) % 8);
    // The 16-bit word of the segment holding the byte, before and after.
    let word_at = tcp_start + ((at - tcp_start) & !1);
    let old = word(packet, word_at);
    packet[at] ^= flip;
    let new = word(packet, word_at);
    let csum_at = tcp_start + 16;
    let sum = word(packet, csum_at);
    let updated = !ones_add(ones_add(!sum, !old), new);
    packet[csum_at..csum_at + 2].copy_from_slice(&updated.to_be_bytes());
    true
}

/// A TCP connection as seen on the wire: the lower (address, port) end first, so that
/// both directions of one connection give the same key.
pub type FlowKey = ((u32, u16), (u32, u16));

/// The connection an IPv4 TCP packet belongs to, and whether it opens one (SYN without
/// ACK). None for anything else, and for fragments after the first.
pub fn tcp_flow(packet: &[u8]) -> Option<(FlowKey, bool)> {
    let first = *packet.first()?;
    if first >> 4 != 4 || packet.len() < 20 || packet[9] != 6 {
        return None;
    }
    if u16::from_be_bytes([packet[6], packet[7]]) & 0x1fff != 0 {
        return None; // not the first fragment: no TCP header here
    }
    let ip_len = usize::from(first & 0x0f) * 4;
    let tcp = packet.get(ip_len..ip_len + 14)?;
    let addr = |at: usize| u32::from_be_bytes(packet[at..at + 4].try_into().expect("4 bytes"));
    let port = |at: usize| u16::from_be_bytes([tcp[at], tcp[at + 1]]);
    let (src, dst) = ((addr(12), port(0)), (addr(16), port(2)));
    let flags = tcp[13];
    let opening = flags & 0x02 != 0 && flags & 0x10 == 0;
    Some(((src.min(dst), src.max(dst)), opening))
}

/// Offsets of the TCP header and its payload in an unfragmented IPv4 packet.
fn tcp_payload(packet: &[u8]) -> Option<(usize, usize)> {
    let first = *packet.first()?;
    if first >> 4 != 4 || packet.len() < 20 || packet[9] != 6 {
        return None;
    }
    let flags_fragment = u16::from_be_bytes([packet[6], packet[7]]);
    if flags_fragment & 0x3fff != 0 {
        return None; // a fragment: its payload is not a whole TCP segment
    }
    let ip_len = usize::from(first & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    if total != packet.len() || ip_len < 20 || packet.len() < ip_len + 20 {
        return None;
    }
    let tcp_len = usize::from(packet[ip_len + 12] >> 4) * 4;
    let payload = ip_len + tcp_len;
    (tcp_len >= 20 && payload < packet.len()).then_some((ip_len, payload))
}

fn word(packet: &[u8], at: usize) -> u16 {
    let hi = packet[at];
    let lo = packet.get(at + 1).copied().unwrap_or(0);
    u16::from_be_bytes([hi, lo])
}

fn ones_add(a: u16, b: u16) -> u16 {
    let (sum, carry) = a.overflowing_add(b);
    sum + u16::from(carry)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The TCP checksum computed from scratch (pseudo-header included).
    fn tcp_checksum_ok(packet: &[u8]) -> bool {
        let ip_len = usize::from(packet[0] & 0x0f) * 4;
        let seg = &packet[ip_len..];
        let mut sum: u32 = 0;
        let mut add = |bytes: &[u8]| {
            for chunk in bytes.chunks(2) {
                let w = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
                sum += u32::from(w);
            }
        };
        add(&packet[12..20]); // source and destination addresses
        add(&[0, 6]);
        add(&(seg.len() as u16).to_be_bytes());
        add(seg);
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum == 0xffff
    }

    /// An IPv4 TCP packet with a valid checksum and `payload`.
    fn segment(payload: &[u8]) -> Vec<u8> {
        let total = 40 + payload.len();
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[8] = 64;
        p[9] = 6;
        p[12..16].copy_from_slice(&[10, 77, 0, 1]);
        p[16..20].copy_from_slice(&[10, 77, 0, 2]);
        p[20..22].copy_from_slice(&4000u16.to_be_bytes());
        p[22..24].copy_from_slice(&5000u16.to_be_bytes());
        p[32] = 5 << 4;
        p[40..].copy_from_slice(payload);
        // Fill the checksum so that the whole sums to 0xffff.
        for guess in 0..=u16::MAX {
            p[36..38].copy_from_slice(&guess.to_be_bytes());
            if tcp_checksum_ok(&p) {
                return p;
            }
        }
        unreachable!("some checksum value always works")
    }

    #[test]
    fn both_directions_of_a_connection_share_one_flow_key() {
        let mut syn = segment(b"");
        syn[20 + 13] = 0x02;
        let (key, opening) = tcp_flow(&syn).unwrap();
        assert!(opening);
        // The reply: addresses and ports swapped, SYN+ACK.
        let mut reply = syn.clone();
        reply.copy_within(12..16, 16);
        reply[12..16].copy_from_slice(&syn[16..20]);
        reply[20..22].copy_from_slice(&syn[22..24]);
        reply[22..24].copy_from_slice(&syn[20..22]);
        reply[20 + 13] = 0x12;
        let (back, opening) = tcp_flow(&reply).unwrap();
        assert_eq!(back, key);
        assert!(!opening, "a SYN+ACK answers, it does not open");
        let mut later_fragment = syn.clone();
        later_fragment[7] = 1;
        assert_eq!(tcp_flow(&later_fragment), None);
        let mut udp = syn;
        udp[9] = 17;
        assert_eq!(tcp_flow(&udp), None);
    }

    #[test]
    fn corruption_changes_one_payload_byte_and_keeps_the_checksum_valid() {
        for len in [1usize, 2, 3, 100, 1448] {
            for pick in [0u64, 1, 7 << 32 | 5, u64::MAX] {
                let original = segment(&vec![0xa5; len]);
                let mut p = original.clone();
                assert!(corrupt_tcp_payload(&mut p, pick));
                let changed: Vec<_> = (40..p.len()).filter(|&i| p[i] != original[i]).collect();
                assert_eq!(changed.len(), 1, "one payload byte flipped");
                assert_eq!(p[..36], original[..36], "headers untouched");
                assert!(tcp_checksum_ok(&p), "len {len} pick {pick}: checksum fixed");
            }
        }
    }

    /// A GSO batch as the sender's stack hands it over: headers once, a partial checksum.
    fn batch_packet(payload_len: usize, flags: u8) -> Vec<u8> {
        let payload: Vec<u8> = (0..payload_len).map(|i| (i * 7) as u8).collect();
        let mut p = segment(&payload);
        p[4..6].copy_from_slice(&100u16.to_be_bytes());
        p[6] = 0x40; // DF
        p[24..28].copy_from_slice(&0xffff_fff0u32.to_be_bytes()); // wraps inside
        p[33] = flags;
        p[36..38].copy_from_slice(&[0x12, 0x34]); // garbage: split recomputes
        p
    }

    fn ip_checksum_ok(p: &[u8]) -> bool {
        fold(sum16(&p[..20])) == 0xffff
    }

    #[test]
    fn a_batch_splits_into_valid_segments_with_headers_fixed_up() {
        let hdr = VnetHdr {
            gso_type: GSO_TCPV4,
            gso_size: 1448,
            ..VnetHdr::default()
        };
        let packet = batch_packet(3 * 1448 + 100, 0x18 | 0x80 | 0x01); // PSH ACK CWR FIN
        let batch = gso_batch(&hdr, &packet).expect("a batch");
        assert_eq!(batch.segments(), 4);
        assert_eq!(batch.wire_len(), 4 * 40 + 3 * 1448 + 100);
        let segs = split(&packet, &batch);
        assert_eq!(segs.len(), 4);
        let mut rebuilt = Vec::new();
        for (i, frame) in segs.iter().enumerate() {
            assert_eq!(frame[..VNET_HDR_LEN], [0; VNET_HDR_LEN]);
            let p = &frame[VNET_HDR_LEN..];
            assert_eq!(p.len(), batch.segment_len(i));
            assert_eq!(usize::from(u16::from_be_bytes([p[2], p[3]])), p.len());
            assert_eq!(u16::from_be_bytes([p[4], p[5]]), 100 + i as u16);
            let seq = u32::from_be_bytes(p[24..28].try_into().unwrap());
            assert_eq!(seq, 0xffff_fff0u32.wrapping_add(1448 * i as u32));
            let flags = p[33];
            assert_eq!(flags & 0x10, 0x10, "ACK everywhere");
            assert_eq!(flags & 0x80 != 0, i == 0, "CWR on the first only");
            assert_eq!(flags & 0x09 != 0, i == 3, "FIN, PSH on the last only");
            assert!(ip_checksum_ok(p), "segment {i}: IP checksum");
            assert!(tcp_checksum_ok(p), "segment {i}: TCP checksum");
            rebuilt.extend_from_slice(&p[40..]);
        }
        assert_eq!(rebuilt, packet[40..], "payload preserved in order");
    }

    #[test]
    fn one_segment_packets_and_other_kinds_are_not_batches() {
        let mut hdr = VnetHdr {
            gso_type: GSO_TCPV4,
            gso_size: 1448,
            ..VnetHdr::default()
        };
        assert_eq!(gso_batch(&hdr, &batch_packet(1448, 0x10)), None);
        assert!(gso_batch(&hdr, &batch_packet(1449, 0x10)).is_some());
        hdr.gso_type = 4; // TCPv6
        assert_eq!(gso_batch(&hdr, &batch_packet(5000, 0x10)), None);
    }

    #[test]
    fn a_partial_checksum_is_completed() {
        let full = segment(&[9u8; 301]);
        // What the stack leaves for the NIC: the pseudo-header sum, not inverted.
        let mut partial = full.clone();
        let pseudo = fold(sum16(&full[12..20]) + 6 + (full.len() - 20) as u64);
        partial[36..38].copy_from_slice(&pseudo.to_be_bytes());
        let mut hdr = VnetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: 20,
            csum_offset: 16,
            ..VnetHdr::default()
        };
        finish_checksum(&mut hdr, &mut partial);
        assert_eq!(hdr.flags, 0);
        assert!(tcp_checksum_ok(&partial));
        assert_eq!(partial, full);
        let parsed = VnetHdr::parse(&hdr.encode()).unwrap();
        assert_eq!(parsed, hdr);
    }

    #[test]
    fn non_tcp_and_empty_segments_are_left_alone() {
        let mut ack = segment(&[]);
        assert!(!corrupt_tcp_payload(&mut ack, 3));
        let mut udp = segment(&[1, 2, 3]);
        udp[9] = 17;
        assert!(!corrupt_tcp_payload(&mut udp, 3));
        assert!(
            !corrupt_tcp_payload(&mut [0x60; 60], 3),
            "IPv6 is not touched"
        );
    }
}
