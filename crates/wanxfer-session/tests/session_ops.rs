//! The session fuzz target's operation sequences, run on stable Rust: random inputs as a
//! bounded proptest, and the committed fuzz corpus (seeds and anything the fuzzer found)
//! as regression cases, so that CI exercises the target where no nightly toolchain is.

mod ops;

use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// No sequence of peer messages and local events makes a machine panic or grow its
    /// output without bound.
    #[test]
    fn any_sequence_of_operations_is_survived(data in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = ops::run(&data);
    }
}

#[test]
fn the_fuzz_corpus_is_survived() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/session");
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    assert!(!entries.is_empty(), "the session corpus is committed");
    for path in entries {
        let data = std::fs::read(&path).expect("a corpus file");
        let reached = ops::run(&data);
        // The hand-written seeds must still reach what they were written for, or they
        // no longer lead the fuzzer anywhere interesting.
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let expected_done = [
            "seed-push-to-the-end",
            "seed-resume-one-range-refused",
            "seed-channel-dies-mid-file",
            "seed-files-fail-on-both-sides",
        ];
        if expected_done.contains(&name) {
            assert!(
                reached.sender_done && reached.receiver_done && !reached.failed,
                "{name} no longer ends both sides: {reached:?}"
            );
        }
        if name == "seed-hostile-and-silent" {
            assert!(reached.failed, "{name}: the hostile peer was let through");
        }
    }
}
