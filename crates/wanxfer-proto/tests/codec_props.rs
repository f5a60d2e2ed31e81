//! Property tests for the frame and block codecs: every message survives a round trip,
//! every truncated or extended frame is an error (never a panic), and arbitrary bytes never
//! panic the decoders.

use proptest::prelude::*;
use wanxfer_proto::ops::{
    ChecksumAlgorithm, ListEntry, ListPage, Meta, NodeKind, OpError, OpFailure, OpReply, OpRequest,
    RemoveMode,
};
use wanxfer_proto::*;

fn rel_path() -> impl Strategy<Value = RelPath> {
    prop::collection::vec("[a-zA-Z0-9 _.\\-\u{e9}\n]{1,12}", 0..4)
        .prop_filter_map("valid path", |parts| {
            RelPath::new(parts.join("/").as_bytes()).ok()
        })
}

fn class() -> impl Strategy<Value = FailureClass> {
    prop_oneof![
        Just(FailureClass::Auth),
        Just(FailureClass::Protocol),
        Just(FailureClass::Integrity),
        Just(FailureClass::Io),
        Just(FailureClass::Refused),
        Just(FailureClass::Limit),
        Just(FailureClass::Internal),
        Just(FailureClass::Network),
    ]
}

fn entry_meta() -> impl Strategy<Value = Option<Box<EntryMeta>>> {
    let xattrs = prop::collection::btree_map(
        "user\\.[a-z_.]{1,20}|system\\.posix_acl_(access|default)",
        prop::collection::vec(any::<u8>(), 0..40),
        0..5,
    );
    prop::option::of(
        (
            prop::option::of(any::<u32>()),
            prop::option::of(any::<u32>()),
            xattrs,
        )
            .prop_filter("not empty", |(u, g, x)| {
                u.is_some() || g.is_some() || !x.is_empty()
            })
            .prop_map(|(uid, gid, xattrs)| {
                Box::new(EntryMeta {
                    uid,
                    gid,
                    xattrs: xattrs
                        .into_iter()
                        .map(|(n, v)| (n.into_bytes(), v))
                        .collect(),
                    data: None,
                    link: None,
                    linkable: false,
                })
            }),
    )
}

fn entry() -> impl Strategy<Value = Entry> {
    (
        0u8..3,
        rel_path(),
        any::<u64>(),
        any::<u32>(),
        any::<i64>(),
        0u32..1_000_000_000,
        prop::collection::vec(1u8..=255, 0..20),
        entry_meta(),
    )
        .prop_map(|(k, path, size, mode, sec, nsec, target, meta)| {
            let kind = [EntryKind::File, EntryKind::Dir, EntryKind::Symlink][k as usize];
            Entry {
                kind,
                path,
                size,
                mode,
                mtime_sec: sec,
                mtime_nsec: nsec,
                link_target: if kind == EntryKind::Symlink {
                    target
                } else {
                    Vec::new()
                },
                meta,
            }
        })
}

const PLACEMENTS: [Placement; 3] = [Placement::Resolve, Placement::Into, Placement::Onto];
fn node_kind() -> impl Strategy<Value = NodeKind> {
    prop_oneof![
        Just(NodeKind::File),
        Just(NodeKind::Dir),
        Just(NodeKind::Symlink),
        Just(NodeKind::Other),
    ]
}

fn meta_of(kind: NodeKind) -> impl Strategy<Value = Meta> {
    (
        any::<u64>(),
        0u32..=0o7777,
        any::<i64>(),
        0u32..1_000_000_000,
        prop::collection::vec(1u8..=255, 0..20),
    )
        .prop_map(move |(size, mode, sec, nsec, target)| Meta {
            kind,
            size,
            mode,
            mtime_sec: sec,
            mtime_nsec: nsec,
            link_target: if kind == NodeKind::Symlink {
                target
            } else {
                Vec::new()
            },
        })
}

fn meta() -> impl Strategy<Value = Meta> {
    node_kind().prop_flat_map(meta_of)
}

fn list_entry() -> impl Strategy<Value = ListEntry> {
    (node_kind(), rel_path(), any::<bool>())
        .prop_flat_map(|(kind, path, long)| {
            (
                Just(kind),
                Just(path),
                prop::option::of(meta_of(kind)).prop_map(move |m| m.filter(|_| long)),
            )
        })
        .prop_map(|(kind, path, meta)| ListEntry { path, kind, meta })
}

fn algorithm() -> impl Strategy<Value = ChecksumAlgorithm> {
    prop::sample::select(ChecksumAlgorithm::ALL.to_vec())
}

fn op_request() -> impl Strategy<Value = OpRequest> {
    prop_oneof![
        rel_path().prop_map(|path| OpRequest::Stat { path }),
        (rel_path(), any::<bool>(), any::<bool>()).prop_map(|(path, recursive, long)| {
            OpRequest::List {
                path,
                recursive,
                long,
            }
        }),
        (rel_path(), any::<bool>(), 0u32..=0o7777).prop_map(|(path, parents, mode)| {
            OpRequest::Mkdir {
                path,
                parents,
                mode,
            }
        }),
        (
            rel_path(),
            prop::sample::select(vec![
                RemoveMode::NotDir,
                RemoveMode::EmptyDir,
                RemoveMode::Recursive
            ])
        )
            .prop_map(|(path, mode)| OpRequest::Remove { path, mode }),
        (rel_path(), rel_path()).prop_map(|(from, to)| OpRequest::Rename { from, to }),
        (rel_path(), algorithm())
            .prop_map(|(path, algorithm)| OpRequest::Checksum { path, algorithm }),
        (
            rel_path(),
            1u32..=wanxfer_proto::tpc::MAX_GRANT_TTL_S,
            any::<u32>().prop_map(|f| f & wanxfer_proto::session_flags::PRESERVE_ALL)
        )
            .prop_map(|(path, ttl_s, preserve)| OpRequest::Grant(
                wanxfer_proto::tpc::Grant {
                    path,
                    ttl_s,
                    preserve
                }
            )),
    ]
}

fn op_failure() -> impl Strategy<Value = OpFailure> {
    prop::sample::select(vec![
        OpFailure::Other,
        OpFailure::NotFound,
        OpFailure::Exists,
        OpFailure::NotDir,
        OpFailure::IsDir,
        OpFailure::NotEmpty,
        OpFailure::PermissionDenied,
        OpFailure::Escapes,
        OpFailure::Reserved,
        OpFailure::NoSpace,
        OpFailure::Invalid,
        OpFailure::Limit,
        OpFailure::Io,
    ])
}

fn op_reply() -> impl Strategy<Value = OpReply> {
    prop_oneof![
        meta().prop_map(OpReply::Meta),
        (prop::collection::vec(list_entry(), 0..8), any::<bool>())
            .prop_map(|(entries, more)| OpReply::List(ListPage { entries, more })),
        algorithm().prop_flat_map(|algorithm| {
            prop::collection::vec(any::<u8>(), algorithm.digest_len())
                .prop_map(move |digest| OpReply::Checksum { algorithm, digest })
        }),
        Just(OpReply::Done),
        (class(), op_failure(), ".{0,40}")
            .prop_map(|(c, f, m)| OpReply::Error(OpError::new(c, f, &m))),
        any::<u64>().prop_map(|done| OpReply::Progress { done }),
    ]
}

fn selection() -> impl Strategy<Value = Selection> {
    (
        prop::collection::vec((any::<bool>(), "[a-z*?/\\[\\]]{1,12}"), 0..4),
        prop::option::of(prop::collection::vec(
            rel_path().prop_filter("not the root", |p| !p.is_root()),
            0..4,
        )),
    )
        .prop_map(|(rules, files)| Selection {
            rules: rules
                .into_iter()
                .map(|(include, pattern)| SelectRule {
                    include,
                    pattern: pattern.into_bytes(),
                })
                .collect(),
            files,
        })
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        op_request().prop_map(Message::OpRequest),
        op_reply().prop_map(Message::OpReply),
        (
            any::<u16>(),
            any::<u64>(),
            any::<[u8; 32]>(),
            prop::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(
                |(version, features, nonce, software)| Message::Hello(Hello {
                    version,
                    features,
                    nonce,
                    software
                })
            ),
        any::<[u8; 32]>().prop_map(|mac| Message::AuthProof { mac }),
        (any::<[u8; 16]>(), any::<[u8; 32]>())
            .prop_map(|(grant_id, mac)| Message::GrantProof { grant_id, mac }),
        any::<[u8; 32]>().prop_map(|mac| Message::AuthOk { mac }),
        (class(), ".{0,40}").prop_map(|(c, m)| Message::Error(ErrorMsg::new(c, &m))),
        (
            any::<bool>(),
            prop::collection::vec(rel_path(), 0..5),
            any::<u32>(),
            any::<u16>(),
            any::<u32>(),
            any::<u16>(),
            any::<u32>(),
            0u32..16,
            any::<u64>(),
            (any::<[u8; 16]>(), 0u8..3, 0u8..3, selection()),
        )
            .prop_map(
                |(
                    push,
                    paths,
                    source_count,
                    streams,
                    block_size,
                    depth,
                    window,
                    flags,
                    synthetic_bytes,
                    (transfer_id, placement, compare, selection),
                )| {
                    Message::OpenSession(OpenSession {
                        direction: if push {
                            Direction::Push
                        } else {
                            Direction::Pull
                        },
                        transport: TransportKind::Tcp,
                        paths,
                        source_count,
                        streams,
                        block_size,
                        depth,
                        window,
                        flags,
                        synthetic_bytes,
                        transfer_id,
                        placement: PLACEMENTS[placement as usize],
                        compare: [Compare::Always, Compare::QuickCheck, Compare::Checksum]
                            [compare as usize],
                        selection,
                    })
                }
            ),
        (
            any::<[u8; 16]>(),
            any::<u16>(),
            any::<u32>(),
            any::<u16>(),
            any::<u32>(),
            any::<u32>(),
            (any::<u16>(), 0u8..3),
        )
            .prop_map(
                |(session_id, streams, block_size, depth, window, flags, (max, placement))| {
                    Message::SessionAccepted(SessionAccepted {
                        session_id,
                        streams,
                        block_size,
                        depth,
                        window,
                        flags,
                        max_streams: max,
                        placement: PLACEMENTS[placement as usize],
                    })
                }
            ),
        (any::<u64>(), prop::collection::vec(entry(), 0..8))
            .prop_map(|(first_id, entries)| Message::Manifest(Manifest { first_id, entries })),
        (any::<u64>(), any::<u64>())
            .prop_map(|(entries, bytes)| Message::ManifestEnd(ManifestEnd { entries, bytes })),
        any::<u64>().prop_map(|through| Message::ManifestAck { through }),
        prop::collection::vec(any::<u64>(), 0..50).prop_map(|ids| Message::FileAck { ids }),
        (
            any::<u64>(),
            class(),
            any::<u64>(),
            prop::collection::vec(any::<u8>(), 0..50)
        )
            .prop_map(
                |(id, class, offset, message)| Message::FileFailed(FileFailed {
                    id,
                    class,
                    offset,
                    message
                })
            ),
        prop::collection::vec(any::<u64>(), 0..50).prop_map(|ids| Message::UpToDate { ids }),
        (
            any::<u64>(),
            any::<bool>(),
            prop::collection::vec((0u64..u64::MAX / 2, 1u32.., any::<[u8; 16]>()), 0..10)
        )
            .prop_map(|(id, last, r)| Message::Held(Held {
                id,
                last,
                ranges: r
                    .into_iter()
                    .map(|(offset, len, digest)| HeldRange {
                        offset,
                        len,
                        digest
                    })
                    .collect()
            })),
        (any::<u64>(), prop::collection::vec(any::<bool>(), 0..40))
            .prop_map(|(id, verdicts)| Message::Confirm(Confirm::new(id, &verdicts))),
        (any::<u16>(), any::<u64>(), any::<bool>()).prop_map(|(index, received, closed)| {
            Message::ChannelStatus {
                index,
                received,
                closed,
            }
        }),
        any::<u16>().prop_map(|index| Message::DropChannel { index }),
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..30), 0..5)
            .prop_map(|paths| Message::Skipped { paths }),
        Just(Message::Keepalive),
        prop::collection::vec(any::<u8>(), 0..100).prop_map(|text| Message::Note { text }),
        (any::<(u64, u64)>(), any::<(u32, u32, u32)>()).prop_map(|((user, sys), (a, b, c))| {
            // Counts on loan within their pools, as a valid status has them.
            let (slots_capacity, pool_capacity) = (a.max(b), a.max(c));
            Message::SessionStatus(SessionStatus {
                cpu_user_us: user,
                cpu_sys_us: sys,
                pool_in_use: c.min(pool_capacity),
                pool_capacity,
                slots_in_use: b.min(slots_capacity),
                slots_capacity,
                fabric_credits: a.min(slots_capacity) / 2,
            })
        }),
        prop::collection::vec(any::<u8>(), 1..200)
            .prop_map(|t| Message::Credential(Credential::Token(t))),
        Just(Message::Credential(Credential::Certificate)),
        (any::<[u8; 16]>(), any::<u16>(), any::<[u8; 32]>()).prop_map(
            |(session_id, index, proof)| Message::ChannelJoin(ChannelJoin {
                session_id,
                index,
                proof
            })
        ),
        Just(Message::Finish),
        (
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
            ("[a-z]{0,10}", any::<u64>(), ".{0,40}")
        )
            .prop_map(|((a, b, c, d), (mode, direct, why))| {
                Message::Stats(Stats {
                    cpu_user_us: a,
                    cpu_sys_us: b,
                    bytes: c,
                    files: d,
                    io_mode: mode.into_bytes(),
                    direct_bytes: direct,
                    io_fallback: why.into_bytes(),
                })
            }),
        any::<u16>().prop_map(|index| Message::ChannelAccepted { index }),
        (
            any::<u16>(),
            "[a-z;_]{0,20}",
            "[a-z0-9./]{0,30}",
            "[a-z0-9_]{0,20}"
        )
            .prop_map(|(port, provider, fabric, domain)| {
                Message::FabricEndpoint(FabricEndpoint {
                    port,
                    provider: provider.into_bytes(),
                    fabric: fabric.into_bytes(),
                    domain: domain.into_bytes(),
                })
            }),
    ]
}

proptest! {
    #[test]
    fn frames_round_trip(msg in message()) {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        prop_assert_eq!(decode_frame(&buf).unwrap(), msg);
    }

    #[test]
    fn every_truncated_frame_is_an_error(msg in message()) {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        for cut in 0..buf.len() {
            prop_assert!(decode_frame(&buf[..cut]).is_err(), "prefix of {} bytes accepted", cut);
        }
    }

    #[test]
    fn a_frame_with_trailing_bytes_is_an_error(msg in message(), extra in prop::collection::vec(any::<u8>(), 1..8)) {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        buf.extend_from_slice(&extra);
        prop_assert!(decode_frame(&buf).is_err());
    }

    #[test]
    fn a_body_with_trailing_bytes_is_an_error_even_with_a_good_crc(msg in message()) {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        let mut body = buf[FrameHeader::LEN..].to_vec();
        body.push(0);
        prop_assert!(Message::decode(buf[0], &body).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(kind in any::<u8>(), body in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = Message::decode(kind, &body);
        let _ = decode_frame(&body);
        if body.len() >= BlockHeader::LEN {
            let fixed: &[u8; BlockHeader::LEN] = body[..BlockHeader::LEN].try_into().unwrap();
            if let Ok(h) = BlockHeader::decode_fixed(fixed) {
                let mut segs = Vec::new();
                let _ = h.decode_segments(fixed, &body[BlockHeader::LEN..], &mut segs);
            }
        }
    }

    #[test]
    fn oversized_frame_lengths_are_refused_from_the_header(len in (MAX_FRAME_BODY as u32 + 1)..) {
        let mut h = [0u8; FrameHeader::LEN];
        h[0] = 7;
        h[4..8].copy_from_slice(&len.to_le_bytes());
        let refused = matches!(FrameHeader::decode(&h), Err(DecodeError::TooLong { .. }));
        prop_assert!(refused);
    }

    #[test]
    fn block_headers_round_trip(
        segs in prop::collection::vec((any::<u64>(), 0u64..u64::MAX / 2, 1u32..1 << 20, any::<bool>(), any::<[u8; 16]>()), 1..20),
        tag in any::<u64>(), seq in any::<u64>(), crc in any::<u32>(), flags in 0u8..4,
    ) {
        let segments: Vec<Segment> = segs.into_iter().map(|(file_id, offset, len, last, digest)| Segment {
            file_id, offset, len, flags: if last { Segment::FLAG_LAST } else { 0 }, digest,
        }).collect();
        let payload_len = segments.iter().map(|s| s.len).sum();
        prop_assume!(payload_len <= MAX_BLOCK_PAYLOAD);
        let h = BlockHeader { flags, segment_count: segments.len() as u16, payload_len, payload_crc: crc, session_tag: tag, sequence: seq, mac: [0; 12] };
        let mut buf = Vec::new();
        h.encode(&segments, &mut buf);
        let fixed: &[u8; BlockHeader::LEN] = buf[..BlockHeader::LEN].try_into().unwrap();
        let decoded = BlockHeader::decode_fixed(fixed).unwrap();
        let mut out = Vec::new();
        decoded.decode_segments(fixed, &buf[BlockHeader::LEN..], &mut out).unwrap();
        prop_assert_eq!(decoded, h);
        prop_assert_eq!(out, segments);
        // A truncated segment table is refused, not misread.
        prop_assert!(decoded.decode_segments(fixed, &buf[BlockHeader::LEN..buf.len() - 1], &mut Vec::new()).is_err());
    }

    /// A receiver that checks a payload piece by piece as it reads it reaches the same
    /// verdict as one that checks it whole, wherever the pieces are cut; one flipped bit
    /// anywhere is caught.
    #[test]
    fn a_payload_checked_in_pieces_is_judged_as_a_whole(
        payload in prop::collection::vec(any::<u8>(), 1..4096),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
        flip in any::<prop::sample::Index>(),
    ) {
        let h = BlockHeader { flags: BlockHeader::FLAG_PAYLOAD_CRC, segment_count: 1, payload_len: payload.len() as u32, payload_crc: crc32c::crc32c(&payload), session_tag: 1, sequence: 0, mac: [0; 12] };
        let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(payload.len())).collect();
        cuts.sort_unstable();
        let in_pieces = |data: &[u8]| {
            let mut check = h.payload_check();
            let mut at = 0;
            for &cut in cuts.iter().chain([data.len()].iter()) {
                check.update(&data[at..cut]);
                at = cut;
            }
            check.finish().is_ok()
        };
        prop_assert!(in_pieces(&payload));
        prop_assert!(h.check_payload(&payload).is_ok());
        let mut damaged = payload.clone();
        damaged[flip.index(payload.len())] ^= 0x10;
        prop_assert!(!in_pieces(&damaged));
        prop_assert!(h.check_payload(&damaged).is_err());
    }
}

proptest! {
    /// A verdict survives its bitmap, and the bits past the count are refused on decode so
    /// that one verdict has one encoding.
    #[test]
    fn confirm_bitmaps_hold_their_verdicts(id in any::<u64>(), verdicts in prop::collection::vec(any::<bool>(), 1..100)) {
        let c = Confirm::new(id, &verdicts);
        for (i, v) in verdicts.iter().enumerate() {
            prop_assert_eq!(c.is_accepted(i), *v);
        }
        prop_assert!(!c.is_accepted(verdicts.len()));
        if verdicts.len() % 8 != 0 {
            let mut bad = c.clone();
            *bad.accepted.last_mut().unwrap() |= 0x80;
            let mut buf = Vec::new();
            encode_frame(&Message::Confirm(bad), &mut buf);
            prop_assert!(decode_frame(&buf).is_err());
        }
    }
}

/// A token longer than the limit is refused from its length, before it is read; an empty
/// one is refused too (it could only be a client's mistake).
#[test]
fn tokens_are_bounded_and_never_empty() {
    let at_limit = Message::Credential(Credential::Token(vec![b'a'; MAX_TOKEN_BYTES]));
    let mut frame = Vec::new();
    encode_frame(&at_limit, &mut frame);
    assert_eq!(decode_frame(&frame).unwrap(), at_limit);
    let mut body = vec![1u8];
    body.extend_from_slice(&(MAX_TOKEN_BYTES as u32 + 1).to_le_bytes());
    assert!(matches!(
        Message::decode(25, &body),
        Err(DecodeError::TooLong { what: "token", .. })
    ));
    let mut empty = vec![1u8];
    empty.extend_from_slice(&0u32.to_le_bytes());
    assert!(Message::decode(25, &empty).is_err());
    assert!(matches!(
        Message::decode(25, &[3]),
        Err(DecodeError::Unknown {
            what: "credential kind",
            ..
        })
    ));
}

/// A pull whose selection is `selection`, framed.
fn pull_with(selection: Selection) -> Vec<u8> {
    let msg = Message::OpenSession(OpenSession {
        direction: Direction::Pull,
        transport: TransportKind::Tcp,
        paths: vec![RelPath::new(b"data").unwrap()],
        source_count: 1,
        streams: 1,
        block_size: 1 << 20,
        depth: 1,
        window: 16,
        flags: 0,
        synthetic_bytes: 0,
        transfer_id: [0; 16],
        placement: Placement::Resolve,
        compare: Compare::QuickCheck,
        selection,
    });
    let mut out = Vec::new();
    encode_frame(&msg, &mut out);
    out
}

fn rule(pattern: &[u8]) -> SelectRule {
    SelectRule {
        include: false,
        pattern: pattern.to_vec(),
    }
}

#[test]
fn a_selection_past_its_limits_is_refused() {
    let many = Selection {
        rules: vec![rule(b"*.tmp"); MAX_SELECT_RULES + 1],
        files: None,
    };
    assert!(matches!(
        decode_frame(&pull_with(many)),
        Err(DecodeError::TooLong {
            what: "selection rules",
            ..
        })
    ));
    let long = Selection {
        rules: vec![rule(&vec![b'a'; MAX_PATTERN_BYTES + 1])],
        files: None,
    };
    assert!(matches!(
        decode_frame(&pull_with(long)),
        Err(DecodeError::TooLong {
            what: "pattern",
            ..
        })
    ));
    for bad in [&b""[..], b"a\0b"] {
        let bad = Selection {
            rules: vec![rule(bad)],
            files: None,
        };
        assert!(matches!(
            decode_frame(&pull_with(bad)),
            Err(DecodeError::Invalid(_))
        ));
    }
    let ok = Selection {
        rules: vec![rule(b"*.tmp"); MAX_SELECT_RULES],
        files: Some(vec![RelPath::new(b"a/b").unwrap()]),
    };
    let Ok(Message::OpenSession(open)) = decode_frame(&pull_with(ok.clone())) else {
        panic!("a selection within the limits decodes");
    };
    assert_eq!(open.selection, ok);
}

#[test]
fn a_selection_with_too_many_paths_is_refused() {
    // Each path is one byte, so the count, not the frame, is what is over.
    let names: Vec<RelPath> = (0..=MAX_SELECTED_PATHS)
        .map(|i| RelPath::new(format!("{}", i % 10).as_bytes()).unwrap())
        .collect();
    let sel = Selection {
        rules: Vec::new(),
        files: Some(names),
    };
    assert!(matches!(
        decode_frame(&pull_with(sel)),
        Err(DecodeError::TooLong {
            what: "selected paths",
            ..
        })
    ));
}

fn manifest_of(entry: Entry) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_frame(
        &Message::Manifest(Manifest {
            first_id: 0,
            entries: vec![entry],
        }),
        &mut buf,
    );
    buf
}

fn entry_with(meta: EntryMeta) -> Entry {
    Entry {
        kind: EntryKind::File,
        path: RelPath::new(b"f").unwrap(),
        size: 1,
        mode: 0o644,
        mtime_sec: 1,
        mtime_nsec: 0,
        link_target: Vec::new(),
        meta: Some(Box::new(meta)),
    }
}

fn xattrs(count: usize, name_len: usize, value_len: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let mut name = format!("user.{i:06}").into_bytes();
            name.resize(name_len.max(name.len()), b'x');
            (name, vec![7u8; value_len])
        })
        .collect()
}

#[test]
fn entry_metadata_limits_hold_at_the_edge_and_fail_past_it() {
    let decodes = |meta: EntryMeta| decode_frame(&manifest_of(entry_with(meta)));
    let at = |x| EntryMeta {
        xattrs: x,
        ..EntryMeta::default()
    };
    // Each limit exactly reached decodes...
    assert!(decodes(at(xattrs(MAX_XATTRS_PER_ENTRY, 12, 0))).is_ok());
    assert!(decodes(at(xattrs(1, MAX_XATTR_NAME_BYTES, MAX_XATTR_VALUE_BYTES))).is_ok());
    let per = MAX_XATTR_BYTES_PER_ENTRY / 2;
    assert!(decodes(at(xattrs(2, 12, per - 12))).is_ok());
    // ...and one past it does not.
    assert!(decodes(at(xattrs(MAX_XATTRS_PER_ENTRY + 1, 12, 0))).is_err());
    assert!(decodes(at(xattrs(1, MAX_XATTR_NAME_BYTES + 1, 0))).is_err());
    assert!(decodes(at(xattrs(1, 12, MAX_XATTR_VALUE_BYTES + 1))).is_err());
    assert!(decodes(at(xattrs(2, 12, per - 11))).is_err());
}

#[test]
fn entry_metadata_is_refused_when_ambiguous_or_unknown() {
    let decodes = |meta: EntryMeta| decode_frame(&manifest_of(entry_with(meta)));
    let named = |names: &[&[u8]]| EntryMeta {
        xattrs: names.iter().map(|n| (n.to_vec(), Vec::new())).collect(),
        ..EntryMeta::default()
    };
    assert!(
        decodes(named(&[b"user.a", b"user.a"])).is_err(),
        "a name twice"
    );
    assert!(decodes(named(&[b"user."])).is_err(), "a namespace alone");
    assert!(
        decodes(named(&[b"other.a"])).is_err(),
        "an unknown namespace"
    );
    assert!(
        decodes(named(&[b"security.capability"])).is_err(),
        "capabilities"
    );
    assert!(
        decodes(named(&[b"trusted.a"])).is_err(),
        "trusted attributes"
    );
    assert!(
        decodes(named(&[b"system.other"])).is_err(),
        "system attributes"
    );
    assert!(decodes(named(&[b"user.a\0b"])).is_err(), "NUL in a name");
    assert!(decodes(named(&[b"system.posix_acl_access"])).is_ok());
    // Empty metadata is written as none, so a frame that carries it is refused.
    let mut frame = manifest_of(entry_with(EntryMeta {
        uid: Some(5),
        ..EntryMeta::default()
    }));
    let Ok(Message::Manifest(m)) = decode_frame(&frame) else {
        panic!("a uid decodes");
    };
    assert_eq!(m.entries[0].meta.as_ref().unwrap().uid, Some(5));
    let body = FrameHeader::LEN;
    let present = frame.len() - 5; // the fields byte, then the uid
    frame[present] = 0;
    frame.truncate(frame.len() - 4);
    let len = (frame.len() - body) as u32;
    frame[4..8].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c(&frame[body..]);
    frame[8..12].copy_from_slice(&crc.to_le_bytes());
    assert!(decode_frame(&frame).is_err());
    // A note longer than its limit is refused.
    let mut long = Vec::new();
    encode_frame(
        &Message::Note {
            text: vec![b'n'; MAX_NOTE_BYTES + 1],
        },
        &mut long,
    );
    assert!(decode_frame(&long).is_err());
}
/// Sorted, apart data ranges within `size`, from cut points: distinct sorted cuts
/// paired up never touch.
fn data_ranges(size: u64, cuts: &std::collections::BTreeSet<u64>) -> Vec<(u64, u64)> {
    let cuts: std::collections::BTreeSet<u64> = cuts.iter().map(|c| c % (size + 1)).collect();
    let cuts: Vec<u64> = cuts.into_iter().collect();
    cuts.chunks_exact(2).map(|p| (p[0], p[1])).collect()
}

proptest! {
    #[test]
    fn sparse_entries_round_trip(
        size in 1u64..1 << 40,
        cuts in prop::collection::btree_set(any::<u64>(), 0..64),
        uid in prop::option::of(any::<u32>()),
    ) {
        let data = data_ranges(size, &cuts);
        let mut entry = entry_with(EntryMeta { uid, data: Some(data), ..EntryMeta::default() });
        entry.size = size;
        let frame = manifest_of(entry.clone());
        let Ok(Message::Manifest(m)) = decode_frame(&frame) else {
            panic!("a sparse entry decodes");
        };
        prop_assert_eq!(&m.entries[0], &entry);
        for cut in 1..frame.len() - FrameHeader::LEN {
            prop_assert!(decode_frame(&frame[..frame.len() - cut]).is_err());
        }
    }
}

#[test]
fn data_ranges_are_bounded_and_checked() {
    let sparse = |size: u64, data: Vec<(u64, u64)>| {
        let mut e = entry_with(EntryMeta {
            data: Some(data),
            ..EntryMeta::default()
        });
        e.size = size;
        decode_frame(&manifest_of(e))
    };
    let many = |n: u64| (0..n).map(|i| (i * 10, i * 10 + 5)).collect::<Vec<_>>();
    let max = MAX_DATA_RANGES_PER_ENTRY as u64;
    assert!(sparse(max * 10, many(max)).is_ok(), "at the limit");
    assert!(
        matches!(
            sparse(max * 10 + 10, many(max + 1)),
            Err(DecodeError::TooLong {
                max: MAX_DATA_RANGES_PER_ENTRY,
                ..
            })
        ),
        "one past it"
    );
    assert!(sparse(100, Vec::new()).is_ok(), "all hole");
    assert!(sparse(100, vec![(0, 100)]).is_ok());
    assert!(sparse(100, vec![(0, 101)]).is_err(), "past the size");
    assert!(sparse(100, vec![(5, 5)]).is_err(), "empty");
    assert!(sparse(100, vec![(10, 20), (20, 30)]).is_err(), "touching");
    assert!(
        sparse(100, vec![(10, 20), (15, 30)]).is_err(),
        "overlapping"
    );
    assert!(
        sparse(100, vec![(30, 40), (10, 20)]).is_err(),
        "out of order"
    );
    let mut dir = entry_with(EntryMeta {
        data: Some(vec![(0, 1)]),
        ..EntryMeta::default()
    });
    dir.kind = EntryKind::Dir;
    assert!(decode_frame(&manifest_of(dir)).is_err(), "a directory");
}

/// Issue 19: a server's status claiming more buffers on loan than its pool holds is
/// refused, not shown.
#[test]
fn a_session_status_beyond_its_pools_is_refused() {
    let good = SessionStatus {
        cpu_user_us: 1,
        cpu_sys_us: 2,
        pool_in_use: 4,
        pool_capacity: 4,
        slots_in_use: 3,
        slots_capacity: 5,
        fabric_credits: 5,
    };
    let frame = |st: SessionStatus| {
        let mut buf = Vec::new();
        encode_frame(&Message::SessionStatus(st), &mut buf);
        buf
    };
    assert_eq!(
        decode_frame(&frame(good)).unwrap(),
        Message::SessionStatus(good)
    );
    for bad in [
        SessionStatus {
            pool_in_use: 5,
            ..good
        },
        SessionStatus {
            slots_in_use: 6,
            ..good
        },
        SessionStatus {
            fabric_credits: 6,
            ..good
        },
    ] {
        assert!(decode_frame(&frame(bad)).is_err(), "{bad:?}");
    }
}

/// Entries `0..n` of a manifest starting at `first_id`, entry `i` linking to `links[i]`.
fn linked_manifest(first_id: u64, links: &[Option<u64>]) -> Vec<u8> {
    marked_manifest(first_id, links, &[])
}

/// [`linked_manifest`], the entries at `marked` marked as link targets.
fn marked_manifest(first_id: u64, links: &[Option<u64>], marked: &[usize]) -> Vec<u8> {
    let entries = links
        .iter()
        .enumerate()
        .map(|(i, link)| {
            let linkable = marked.contains(&i);
            let mut e = entry_with(EntryMeta {
                link: *link,
                linkable,
                ..EntryMeta::default()
            });
            e.path = RelPath::new(format!("f{i}").as_bytes()).unwrap();
            e.meta = (link.is_some() || linkable).then(|| e.meta.take().unwrap());
            e
        })
        .collect();
    let mut buf = Vec::new();
    encode_frame(&Message::Manifest(Manifest { first_id, entries }), &mut buf);
    buf
}

proptest! {
    /// Issue 20 (--preserve hardlinks): a group of names links to the group's first,
    /// in this frame or an earlier one, and round-trips; every truncation is an error.
    #[test]
    fn hard_link_entries_round_trip(
        first_id in 0u64..1 << 50,
        back in 0u64..1000,
        groups in prop::collection::vec(0usize..4, 1..20),
    ) {
        let mut links = Vec::new();
        if back > 0 {
            // Another name of a file of an earlier frame.
            links.push(first_id.checked_sub(back));
        }
        for extra in groups {
            let first = first_id + links.len() as u64;
            links.push(None);
            links.extend(std::iter::repeat_n(Some(first), extra));
        }
        let frame = linked_manifest(first_id, &links);
        let Ok(Message::Manifest(m)) = decode_frame(&frame) else {
            panic!("links to earlier files decode");
        };
        let got: Vec<Option<u64>> = m.entries.iter().map(|e| e.meta.as_ref().and_then(|m| m.link)).collect();
        prop_assert_eq!(got, links);
        for cut in 1..frame.len() - FrameHeader::LEN {
            prop_assert!(decode_frame(&frame[..frame.len() - cut]).is_err());
        }
    }
}

#[test]
fn hard_links_only_go_back_to_a_file_that_is_not_a_link() {
    let link_error = |frame: &[u8]| match decode_frame(frame) {
        Err(DecodeError::Link { id, target, reason }) => (id, target, reason),
        other => panic!("{other:?}"),
    };
    assert!(decode_frame(&linked_manifest(10, &[None, Some(10), Some(10)])).is_ok());
    assert!(
        decode_frame(&linked_manifest(10, &[Some(3), Some(9)])).is_ok(),
        "earlier frames"
    );
    assert_eq!(
        link_error(&linked_manifest(10, &[Some(10)])),
        (10, 10, "not an earlier entry"),
        "itself"
    );
    assert_eq!(
        link_error(&linked_manifest(10, &[None, Some(12), None])),
        (11, 12, "not an earlier entry"),
        "a later entry"
    );
    assert_eq!(
        link_error(&linked_manifest(0, &[Some(u64::MAX)])),
        (0, u64::MAX, "not an earlier entry")
    );
    assert_eq!(
        link_error(&linked_manifest(5, &[None, Some(5), Some(6)])),
        (7, 6, "itself a link"),
        "a link to a link"
    );
    let mut buf = Vec::new();
    let mut dir = entry_with(EntryMeta::default());
    dir.kind = EntryKind::Dir;
    dir.meta = None;
    dir.size = 0;
    let link = entry_with(EntryMeta {
        link: Some(0),
        ..EntryMeta::default()
    });
    encode_frame(
        &Message::Manifest(Manifest {
            first_id: 0,
            entries: vec![dir, link.clone()],
        }),
        &mut buf,
    );
    assert_eq!(
        link_error(&buf),
        (1, 0, "not a file"),
        "a link to a directory"
    );
    // Only a file links, and a link has no data of its own to list.
    let mut symlink = link.clone();
    symlink.kind = EntryKind::Symlink;
    symlink.link_target = b"x".to_vec();
    let mut sparse = link;
    sparse.meta.as_mut().unwrap().data = Some(Vec::new());
    for bad in [symlink, sparse] {
        let frame = {
            let mut buf = Vec::new();
            encode_frame(
                &Message::Manifest(Manifest {
                    first_id: 5,
                    entries: vec![bad],
                }),
                &mut buf,
            );
            buf
        };
        assert!(
            matches!(decode_frame(&frame), Err(DecodeError::Invalid(_))),
            "{:?}",
            decode_frame(&frame)
        );
    }
}

proptest! {
    /// With features::LINK_TARGETS: the first name of each group is marked, the mark
    /// round-trips, its frame passes the receiver's check, and every truncation fails.
    #[test]
    fn marked_link_targets_round_trip(
        first_id in 0u64..1 << 50,
        groups in prop::collection::vec(0usize..4, 1..20),
    ) {
        let (mut links, mut marked) = (Vec::new(), Vec::new());
        for extra in groups {
            let first = first_id + links.len() as u64;
            if extra > 0 {
                marked.push(links.len());
            }
            links.push(None);
            links.extend(std::iter::repeat_n(Some(first), extra));
        }
        let frame = marked_manifest(first_id, &links, &marked);
        let Ok(Message::Manifest(m)) = decode_frame(&frame) else {
            panic!("links to marked files decode");
        };
        let got: Vec<usize> = (0..m.entries.len())
            .filter(|&i| m.entries[i].meta.as_ref().is_some_and(|m| m.linkable))
            .collect();
        prop_assert_eq!(got, marked);
        prop_assert!(m.check_marked_links().is_ok());
        for cut in 1..frame.len() - FrameHeader::LEN {
            prop_assert!(decode_frame(&frame[..frame.len() - cut]).is_err());
        }
    }
}

#[test]
fn a_marked_session_links_only_to_marked_entries() {
    let manifest = |links: &[Option<u64>], marked: &[usize]| match decode_frame(&marked_manifest(
        10, links, marked,
    )) {
        Ok(Message::Manifest(m)) => m,
        other => panic!("{other:?}"),
    };
    // Unmarked targets decode (a session without the feature links to any file)...
    let unmarked = manifest(&[None, Some(10), None, Some(12)], &[0]);
    // ...but are refused where the session marks them.
    assert_eq!(
        unmarked.check_marked_links(),
        Err(DecodeError::Link {
            id: 13,
            target: 12,
            reason: "not marked as a link target"
        })
    );
    assert!(manifest(&[None, Some(10), None, Some(12)], &[0, 2])
        .check_marked_links()
        .is_ok());
    // A target in an earlier frame is the receiver's to check.
    assert!(manifest(&[Some(3), None], &[1])
        .check_marked_links()
        .is_ok());

    // Only a file that is not itself a link is marked.
    let marked_link = marked_manifest(10, &[None, Some(10)], &[0, 1]);
    assert!(
        matches!(decode_frame(&marked_link), Err(DecodeError::Invalid(_))),
        "a marked link"
    );
    let mut dir = entry_with(EntryMeta {
        linkable: true,
        ..EntryMeta::default()
    });
    dir.kind = EntryKind::Dir;
    dir.size = 0;
    let mut buf = Vec::new();
    encode_frame(
        &Message::Manifest(Manifest {
            first_id: 0,
            entries: vec![dir],
        }),
        &mut buf,
    );
    assert!(
        matches!(decode_frame(&buf), Err(DecodeError::Invalid(_))),
        "a marked directory"
    );
}
