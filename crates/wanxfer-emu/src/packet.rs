//! Just enough IPv4/TCP parsing to corrupt a payload byte the way a bad line card or
//! memory does on a long path: silently, with the TCP checksum fixed up so that TCP
//! accepts the segment and only an end-to-end check (wanxfer's block CRC) can catch it.

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
