//! Any bytes as a control frame: decoding never panics, and whatever decodes re-encodes to
//! exactly the same bytes (so no two encodings mean one message).
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanxfer_proto::{decode_frame, encode_frame, Message};

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = decode_frame(data) {
        let mut again = Vec::new();
        encode_frame(&msg, &mut again);
        assert_eq!(again, data, "decode then encode must reproduce the input");
    }
    if let Some((&kind, body)) = data.split_first() {
        let _ = Message::decode(kind, body);
    }
});
