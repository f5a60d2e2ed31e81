//! Any sequence of peer messages and local events on a sender and a receiver machine:
//! never a panic, never output out of proportion to the input. The decoding of bytes into
//! operations lives with the crate's tests (`tests/ops/mod.rs`), where a proptest runs the
//! same sequences, and this corpus, on stable Rust.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/wanxfer-session/tests/ops/mod.rs"]
mod ops;

fuzz_target!(|data: &[u8]| {
    ops::run(data);
});
