//! Any bytes as a block header and segment table: never a panic, and an accepted header's
//! segments always add up to its payload length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanxfer_proto::BlockHeader;

fuzz_target!(|data: &[u8]| {
    let Some(fixed) = data.get(..BlockHeader::LEN) else {
        return;
    };
    let fixed: &[u8; BlockHeader::LEN] = fixed.try_into().expect("length checked");
    let Ok(header) = BlockHeader::decode_fixed(fixed) else {
        return;
    };
    let mut segments = Vec::new();
    if header
        .decode_segments(fixed, &data[BlockHeader::LEN..], &mut segments)
        .is_ok()
    {
        let total: u64 = segments.iter().map(|s| u64::from(s.len)).sum();
        assert_eq!(total, u64::from(header.payload_len));
        let mut again = Vec::new();
        header.encode(&segments, &mut again);
        assert_eq!(again, data);
    }
});
