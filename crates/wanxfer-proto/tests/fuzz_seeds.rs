//! Writes valid frames and block headers as seeds for the fuzz corpus in `fuzz/corpus`:
//! `WANXFER_WRITE_CORPUS=1 cargo test -p wanxfer-proto --test fuzz_seeds`. Without the
//! variable it only checks that every seed decodes, so the seeds stay valid as the
//! protocol evolves.

use wanxfer_proto::ops::{
    ChecksumAlgorithm, ListEntry, ListPage, Meta, NodeKind, OpError, OpFailure, OpReply, OpRequest,
    RemoveMode,
};
use wanxfer_proto::*;

fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let path = |s: &str| RelPath::new(s.as_bytes()).unwrap();
    let msgs = vec![
        (
            "hello",
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                features: features::SUPPORTED,
                nonce: [3; 32],
                software: b"wanxfer".to_vec(),
            }),
        ),
        (
            "open",
            Message::OpenSession(OpenSession {
                direction: Direction::Push,
                transport: TransportKind::Tcp,
                paths: vec![path("a/b")],
                source_count: 2,
                streams: 2,
                block_size: 4 << 20,
                depth: 4,
                window: 1024,
                flags: 0,
                synthetic_bytes: 0,
                transfer_id: [4; 16],
                placement: Placement::Resolve,
                compare: Compare::QuickCheck,
                selection: Default::default(),
            }),
        ),
        (
            "manifest",
            Message::Manifest(Manifest {
                first_id: 0,
                entries: vec![
                    Entry {
                        kind: EntryKind::Dir,
                        path: path("top"),
                        size: 0,
                        mode: 0o755,
                        mtime_sec: 1,
                        mtime_nsec: 2,
                        link_target: vec![],
                        meta: None,
                    },
                    Entry {
                        kind: EntryKind::File,
                        path: path("top/f"),
                        size: 10,
                        mode: 0o644,
                        mtime_sec: 1,
                        mtime_nsec: 2,
                        link_target: vec![],
                        meta: None,
                    },
                    Entry {
                        kind: EntryKind::Symlink,
                        path: path("top/l"),
                        size: 0,
                        mode: 0o777,
                        mtime_sec: 1,
                        mtime_nsec: 2,
                        link_target: b"../x".to_vec(),
                        meta: None,
                    },
                ],
            }),
        ),
        ("ack", Message::FileAck { ids: vec![1, 2, 3] }),
        (
            "held",
            Message::Held(Held {
                id: 3,
                last: true,
                ranges: vec![HeldRange {
                    offset: 4 << 20,
                    len: 4 << 20,
                    digest: [7; 16],
                }],
            }),
        ),
        (
            "confirm",
            Message::Confirm(Confirm::new(3, &[true, false, true])),
        ),
        (
            "channel-status",
            Message::ChannelStatus {
                index: 1,
                received: 99,
                closed: true,
            },
        ),
        (
            "failed",
            Message::FileFailed(FileFailed {
                id: 4,
                class: FailureClass::Integrity,
                offset: 4096,
                message: b"bad".to_vec(),
            }),
        ),
        (
            "op-list",
            Message::OpRequest(OpRequest::List {
                path: path("top"),
                recursive: true,
                long: true,
            }),
        ),
        (
            "op-remove",
            Message::OpRequest(OpRequest::Remove {
                path: path("top/old"),
                mode: RemoveMode::Recursive,
            }),
        ),
        (
            "op-rename",
            Message::OpRequest(OpRequest::Rename {
                from: path("a/f"),
                to: path("b/f"),
            }),
        ),
        (
            "op-checksum",
            Message::OpRequest(OpRequest::Checksum {
                path: path("top/f"),
                algorithm: ChecksumAlgorithm::Adler32,
            }),
        ),
        (
            "op-push-selected",
            Message::OpRequest(OpRequest::PushTo(wanxfer_proto::tpc::PushTo {
                sources: vec![path("run41")],
                server: b"dtn2:7800".to_vec(),
                fingerprint: [9; 32],
                dest: path("archive"),
                into: true,
                grant: wanxfer_proto::tpc::Granted {
                    id: [1; 16],
                    secret: [2; 32],
                    ttl_s: 600,
                },
                streams: 4,
                block_size: 4 << 20,
                depth: 4,
                compare: wanxfer_proto::Compare::QuickCheck,
                flags: 0,
                preserve: 0,
                selection: wanxfer_proto::Selection {
                    rules: vec![wanxfer_proto::SelectRule {
                        include: false,
                        pattern: b"*.tmp".to_vec(),
                    }],
                    files: Some(vec![path("raw")]),
                },
            })),
        ),
        (
            "op-page",
            Message::OpReply(OpReply::List(ListPage {
                entries: vec![
                    ListEntry {
                        path: path("f"),
                        kind: NodeKind::File,
                        meta: Some(Meta {
                            kind: NodeKind::File,
                            size: 10,
                            mode: 0o644,
                            mtime_sec: 1,
                            mtime_nsec: 2,
                            link_target: vec![],
                        }),
                    },
                    ListEntry {
                        path: path("sub/l"),
                        kind: NodeKind::Symlink,
                        meta: None,
                    },
                ],
                more: true,
            })),
        ),
        (
            "manifest-meta",
            Message::Manifest(Manifest {
                first_id: 0,
                entries: vec![Entry {
                    kind: EntryKind::File,
                    path: path("owned"),
                    size: 3,
                    mode: 0o640,
                    mtime_sec: 1,
                    mtime_nsec: 0,
                    link_target: vec![],
                    meta: Some(Box::new(EntryMeta {
                        uid: Some(1234),
                        gid: Some(4321),
                        xattrs: vec![
                            (b"user.origin".to_vec(), b"detector".to_vec()),
                            (b"system.posix_acl_access".to_vec(), vec![2, 0, 0, 0]),
                        ],
                        data: None,
                        link: None,
                        linkable: false,
                    })),
                }],
            }),
        ),
        (
            "manifest-sparse",
            Message::Manifest(Manifest {
                first_id: 0,
                entries: vec![Entry {
                    kind: EntryKind::File,
                    path: path("sparse.img"),
                    size: 1 << 20,
                    mode: 0o644,
                    mtime_sec: 1,
                    mtime_nsec: 0,
                    link_target: vec![],
                    meta: Some(Box::new(EntryMeta {
                        data: Some(vec![(4096, 8192), ((1 << 20) - 512, 1 << 20)]),
                        ..EntryMeta::default()
                    })),
                }],
            }),
        ),
        ("manifest-hardlinks", three_names_of_one_file(false)),
        ("manifest-link-targets", three_names_of_one_file(true)),
        (
            "note",
            Message::Note {
                text: b"owner and group not kept".to_vec(),
            },
        ),
        (
            "op-sum",
            Message::OpReply(OpReply::Checksum {
                algorithm: ChecksumAlgorithm::Md5,
                digest: vec![7; 16],
            }),
        ),
        (
            "op-error",
            Message::OpReply(OpReply::Error(OpError::new(
                FailureClass::Refused,
                OpFailure::Escapes,
                "goes through a symlink",
            ))),
        ),
    ];
    let mut out = Vec::new();
    for (name, msg) in msgs {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        out.push(("frame", name, buf.clone()));
        // The handshake target reads (kind, len, body) triples.
        let mut hs = vec![buf[0], (buf.len() - FrameHeader::LEN).min(255) as u8];
        hs.extend_from_slice(&buf[FrameHeader::LEN..]);
        out.push(("handshake", name, hs));
    }
    let segs = [Segment {
        file_id: 1,
        offset: 0,
        len: 10,
        flags: Segment::FLAG_LAST,
        digest: [1; 16],
    }];
    let h = BlockHeader {
        flags: BlockHeader::FLAG_PAYLOAD_CRC,
        segment_count: 1,
        payload_len: 10,
        payload_crc: 5,
        session_tag: 6,
        sequence: 7,
        mac: [0; 12],
    };
    let mut buf = Vec::new();
    h.encode(&segs, &mut buf);
    out.push(("block_header", "one_segment", buf));
    out
}

/// A file under three names: the later two link to entry 7, which the sender `marks` as
/// a link target (`LINK_TARGETS`) or not.
fn three_names_of_one_file(marks: bool) -> Message {
    Message::Manifest(Manifest {
        first_id: 7,
        entries: ["a/data", "b/data", "c/data"]
            .into_iter()
            .enumerate()
            .map(|(i, name)| Entry {
                kind: EntryKind::File,
                path: RelPath::new(name.as_bytes()).unwrap(),
                size: 4096,
                mode: 0o644,
                mtime_sec: 1,
                mtime_nsec: 0,
                link_target: vec![],
                meta: (i > 0 || marks).then(|| {
                    Box::new(EntryMeta {
                        link: (i > 0).then_some(7),
                        linkable: marks && i == 0,
                        ..EntryMeta::default()
                    })
                }),
            })
            .collect(),
    })
}

#[test]
fn seeds_are_valid_and_written_on_request() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    for (target, name, bytes) in seeds() {
        match target {
            "frame" => assert!(decode_frame(&bytes).is_ok(), "{name}"),
            "block_header" => {
                let fixed: &[u8; BlockHeader::LEN] = bytes[..BlockHeader::LEN].try_into().unwrap();
                let h = BlockHeader::decode_fixed(fixed).unwrap();
                h.decode_segments(fixed, &bytes[BlockHeader::LEN..], &mut Vec::new())
                    .unwrap();
            }
            _ => {}
        }
        let path = dir.join(target).join(format!("seed-{name}"));
        if std::env::var_os("WANXFER_WRITE_CORPUS").is_some() {
            std::fs::create_dir_all(dir.join(target)).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        } else if let Ok(committed) = std::fs::read(&path) {
            // A seed that no longer matches what the code sends (a Hello with other
            // feature bits) starts the fuzzer from a frame no peer would send.
            assert!(
                committed == bytes,
                "{} is stale: WANXFER_WRITE_CORPUS=1 cargo test -p wanxfer-proto --test fuzz_seeds",
                path.display()
            );
        }
    }
}
