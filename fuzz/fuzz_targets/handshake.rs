//! A server handshake fed any sequence of decodable messages never panics and never
//! completes without the right proof: the shared secret's, or a known grant's.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanxfer_proto::handshake::{ServerHandshake, Step};
use wanxfer_proto::Message;

/// The one grant the fuzzed server knows.
const GRANT_ID: [u8; 16] = [9; 16];
const GRANT_SECRET: [u8; 32] = [5; 32];

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
        let step = match msg {
            Message::GrantProof { grant_id, mac } => {
                let known = (grant_id == GRANT_ID).then_some(&GRANT_SECRET);
                server.handle_grant(&grant_id, &mac, known)
            }
            msg => server.handle(msg),
        };
        match step {
            Ok(Step::SendAndDone(..)) | Ok(Step::Done(_)) => {
                panic!("authenticated without knowing the secret")
            }
            Ok(Step::Send(_)) | Ok(Step::Wait) => {}
            Err(_) => return,
        }
    }
});
