//! A server handshake fed any sequence of decodable messages never panics and never
//! completes without the right proof.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanxfer_proto::handshake::{ServerHandshake, Step};
use wanxfer_proto::Message;

fuzz_target!(|data: &[u8]| {
    let mut server = ServerHandshake::new(b"fuzz-secret", [7; 32], 0);
    let mut rest = data;
    while let [kind, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let (body, next) = tail.split_at(len);
        rest = next;
        let Ok(msg) = Message::decode(*kind, body) else {
            continue;
        };
        match server.handle(msg) {
            Ok(Step::SendAndDone(..)) | Ok(Step::Done(_)) => {
                panic!("authenticated without knowing the secret")
            }
            Ok(Step::Send(_)) | Ok(Step::Wait) => {}
            Err(_) => return,
        }
    }
});
