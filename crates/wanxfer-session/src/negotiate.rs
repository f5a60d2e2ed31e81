//! What a session's two sides agree on before the first block: the server clamps the
//! client's request to its own limits, and the client checks the answer against what it
//! asked, since a server (or anyone on the path) could answer with numbers the client
//! never agreed to, such as a 4 GiB block or a block of 0 bytes.
//!
//! Memory is counted here in one budget per session and side: every channel's queue plus
//! the block each channel, reader and writer has in hand, at the size a block takes in
//! this transport's buffers (a fabric slot is a block plus room for the largest header,
//! page-aligned). The server lowers depth, then streams, then the block size until the
//! session fits its budget, whatever the client asked for.

use wanxfer_proto::{
    session_flags, BlockHeader, Direction, OpenSession, Placement, SessionAccepted, TransportKind,
    MAX_BLOCK_PAYLOAD, MAX_SEGMENTS,
};

/// Smallest block a server agrees to: smaller blocks cost a header and a system call per
/// few kilobytes.
pub const MIN_BLOCK_SIZE: u32 = 64 << 10;

/// Blocks are a whole number of pages, so that chunks of large files can be written with
/// `O_DIRECT` at their offsets.
pub const BLOCK_ALIGN: u32 = 4096;

/// Room for the largest block header and segment table, padded to a page, at the start of
/// every fabric slot.
pub const FABRIC_HEADER_ROOM: u64 =
    (BlockHeader::encoded_len(MAX_SEGMENTS as usize) as u64).next_multiple_of(BLOCK_ALIGN as u64);

/// Bytes of registered memory one fabric slot takes for blocks of `block_size`.
pub fn fabric_slot_len(block_size: u32) -> u64 {
    (FABRIC_HEADER_ROOM + u64::from(block_size)).next_multiple_of(BLOCK_ALIGN as u64)
}

/// Bytes one block takes in this transport's buffers.
pub fn buffer_len(transport: TransportKind, block_size: u32) -> u64 {
    match transport {
        TransportKind::Fabric => fabric_slot_len(block_size),
        _ => u64::from(block_size),
    }
}

/// Buffers a side of a session holds: every channel's queue of `depth` plus the block in
/// each channel's hands, plus one per disk thread (readers or writers).
pub fn buffers(streams: u16, depth: u16, disk_threads: u32) -> u64 {
    u64::from(streams) * (u64::from(depth) + 1) + u64::from(disk_threads)
}

/// A side's own bounds on a session.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_streams: u16,
    pub max_block_size: u32,
    pub max_depth: u16,
    pub max_window: u32,
    /// Bytes of block buffers one session may hold on this side.
    pub max_memory: u64,
    /// Disk threads (readers when sending, writers when receiving) of one session.
    pub disk_threads: u32,
}

/// The memory a session with these numbers needs on a side with `disk_threads`.
pub fn memory(
    transport: TransportKind,
    streams: u16,
    depth: u16,
    block_size: u32,
    disk_threads: u32,
) -> u64 {
    buffers(streams, depth, disk_threads) * buffer_len(transport, block_size)
}

/// The server's answer to `req`: each number no larger than asked (the block size may
/// be raised to [`MIN_BLOCK_SIZE`]) nor than `limits`, and the whole within the memory
/// budget. Which buffers count depends on the server's role: a pushing client makes it
/// receive into the transport's buffers, a pulling one makes it read into blocks.
pub fn clamp(
    req: &OpenSession,
    limits: &Limits,
    session_id: [u8; 16],
    placement: Placement,
) -> SessionAccepted {
    let receiving = req.direction == Direction::Push;
    let transport = if receiving {
        req.transport
    } else {
        TransportKind::Tcp
    };
    let max_block = limits
        .max_block_size
        .clamp(MIN_BLOCK_SIZE, MAX_BLOCK_PAYLOAD);
    let (streams, depth, block_size) = fit(
        transport,
        req.streams.clamp(1, limits.max_streams.max(1)),
        req.depth.clamp(1, limits.max_depth.max(1)),
        align_block(req.block_size.clamp(MIN_BLOCK_SIZE, max_block)),
        limits.disk_threads,
        limits.max_memory,
    );
    // Channels may join later. Over TCP they share the session's pool; a fabric receiver
    // registers slots per channel, so only as many as the budget holds may join.
    let mut max_streams = limits.max_streams.max(streams);
    if receiving && req.transport == TransportKind::Fabric {
        max_streams = fabric_streams_within(
            max_streams,
            depth,
            block_size,
            limits.disk_threads,
            limits.max_memory,
        )
        .max(streams);
    }
    SessionAccepted {
        session_id,
        streams,
        block_size,
        depth,
        window: req.window.clamp(1, limits.max_window.max(1)),
        // Only a pulling client can say that it holds nothing.
        flags: if receiving {
            req.flags & !session_flags::FRESH
        } else {
            req.flags
        },
        max_streams,
        placement,
    }
}

/// The most fabric channels, up to `most`, whose receiving slots (`depth + 1` each, of
/// blocks of `block_size`) fit `max_memory` beside `disk_threads` blocks; at least 1.
/// Each receiving fabric channel registers slots of its own, so this bounds how many
/// may join a session, on whichever side receives.
pub fn fabric_streams_within(
    most: u16,
    depth: u16,
    block_size: u32,
    disk_threads: u32,
    max_memory: u64,
) -> u16 {
    let slot = fabric_slot_len(block_size);
    let per_stream = (u64::from(depth) + 1) * slot;
    let room = max_memory.saturating_sub(u64::from(disk_threads) * slot);
    u16::try_from(room / per_stream.max(1))
        .unwrap_or(u16::MAX)
        .clamp(1, most.max(1))
}

/// Lowers depth, then streams, then the block size (halving it, never below
/// [`MIN_BLOCK_SIZE`]) until a side with `disk_threads` holds at most `max_memory` of
/// buffers, or there is nothing left to lower. The server fits its answer with this, and
/// a client its request, each within its own budget.
pub fn fit(
    transport: TransportKind,
    mut streams: u16,
    mut depth: u16,
    mut block_size: u32,
    disk_threads: u32,
    max_memory: u64,
) -> (u16, u16, u32) {
    let fits = |s, d, b| memory(transport, s, d, b, disk_threads) <= max_memory;
    while !fits(streams, depth, block_size) {
        if depth > 1 {
            depth -= 1;
        } else if streams > 1 {
            streams -= 1;
        } else if block_size > MIN_BLOCK_SIZE {
            block_size = align_block((block_size / 2).max(MIN_BLOCK_SIZE));
        } else {
            break; // the smallest session there is
        }
    }
    (streams, depth, block_size)
}

fn align_block(size: u32) -> u32 {
    (size / BLOCK_ALIGN).max(1) * BLOCK_ALIGN
}

/// The client's check of the server's answer: nothing larger than asked, nothing zero,
/// no check turned off that the client left on, and a placement that fits the request.
pub fn check_accepted(req: &OpenSession, acc: &SessionAccepted) -> Result<(), String> {
    let within = |what: &str, got: u64, min: u64, max: u64| {
        if (min..=max).contains(&got) {
            Ok(())
        } else {
            Err(format!(
                "the server answered with {what} {got}, outside {min}..={max}"
            ))
        }
    };
    within("streams", acc.streams.into(), 1, req.streams.max(1).into())?;
    within(
        "a block size of",
        acc.block_size.into(),
        MIN_BLOCK_SIZE.min(req.block_size).into(),
        req.block_size.max(MIN_BLOCK_SIZE).into(),
    )?;
    if acc.block_size % BLOCK_ALIGN != 0 {
        return Err(format!(
            "the server answered with a block size of {}, not a whole number of pages",
            acc.block_size
        ));
    }
    within("a depth of", acc.depth.into(), 1, req.depth.max(1).into())?;
    within(
        "a window of",
        acc.window.into(),
        1,
        req.window.max(1).into(),
    )?;
    within(
        "at most",
        acc.max_streams.into(),
        acc.streams.into(),
        u16::MAX.into(),
    )?;
    let checks_off = session_flags::NO_FILE_DIGEST | session_flags::NO_BLOCK_CHECKSUM;
    if acc.flags & checks_off & !req.flags != 0 {
        return Err("the server's answer turns off checks this client asked for".into());
    }
    if acc.flags & session_flags::PRESERVE_ALL & !req.flags != 0 {
        return Err("the server's answer preserves what this client did not ask for".into());
    }
    if acc.flags & session_flags::FRESH & !req.flags != 0 {
        return Err("the server's answer says this client holds nothing, which it did not".into());
    }
    let kept = session_flags::DISCARD | session_flags::SYNTHETIC_SOURCE;
    if acc.flags & !session_flags::ALL != 0 || acc.flags & kept != req.flags & kept {
        return Err("the server's answer changes what the session moves".into());
    }
    match (req.direction, req.placement, acc.placement) {
        (Direction::Pull, _, Placement::Resolve) => Ok(()),
        (Direction::Push, Placement::Resolve, Placement::Into | Placement::Onto) => Ok(()),
        (Direction::Push, asked, answered)
            if asked == answered && answered != Placement::Resolve =>
        {
            Ok(())
        }
        _ => Err("the server answered with a placement the client did not ask for".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use wanxfer_proto::Compare;

    fn request(streams: u16, block_size: u32, depth: u16) -> OpenSession {
        OpenSession {
            direction: Direction::Push,
            transport: TransportKind::Tcp,
            paths: Vec::new(),
            source_count: 1,
            streams,
            block_size,
            depth,
            window: 1000,
            flags: 0,
            synthetic_bytes: 0,
            transfer_id: [0; 16],
            placement: Placement::Resolve,
            compare: Compare::QuickCheck,
            selection: Default::default(),
        }
    }

    fn limits() -> Limits {
        Limits {
            max_streams: 32,
            max_block_size: 16 << 20,
            max_depth: 32,
            max_window: 65_536,
            max_memory: 512 << 20,
            disk_threads: 2,
        }
    }

    /// The regression of issue 16 item 8: 32 streams of 16 MiB blocks fit a 512 MiB
    /// budget, however deep the client asks.
    #[test]
    fn a_greedy_request_fits_the_budget() {
        let acc = clamp(
            &request(32, 16 << 20, 32),
            &limits(),
            [0; 16],
            Placement::Into,
        );
        let mem = memory(
            TransportKind::Tcp,
            acc.streams,
            acc.depth,
            acc.block_size,
            2,
        );
        assert!(mem <= 512 << 20, "{acc:?} needs {mem}");
        check_accepted(&request(32, 16 << 20, 32), &acc).unwrap();
    }

    #[test]
    fn fabric_slots_count_against_the_budget_and_bound_later_joins() {
        let mut req = request(4, 4 << 20, 8);
        req.transport = TransportKind::Fabric;
        let mut l = limits();
        l.max_memory = 64 << 20;
        let acc = clamp(&req, &l, [0; 16], Placement::Into);
        let slot = fabric_slot_len(acc.block_size);
        assert!(slot > u64::from(acc.block_size));
        assert!(
            buffers(acc.max_streams, acc.depth, 2) * slot <= 64 << 20,
            "{acc:?}"
        );
    }

    /// Issue 19, path (d): each receiving fabric channel brings `depth + 1` slots, so the
    /// channels a budget holds are what it holds beside the disk threads' blocks, never
    /// fewer than one, never more than asked.
    #[test]
    fn fabric_channels_are_bounded_by_the_slots_a_budget_holds() {
        let slot = fabric_slot_len(4 << 20);
        // 512 MiB, 4 MiB blocks, depth 4, 2 writers: (118 slots - 2) / 5 = 23 channels.
        let n = fabric_streams_within(u16::MAX, 4, 4 << 20, 2, 512 << 20);
        assert_eq!(n, 23);
        assert!(buffers(n, 4, 2) * slot <= 512 << 20);
        assert!(buffers(n + 1, 4, 2) * slot > 512 << 20);
        assert_eq!(fabric_streams_within(16, 4, 4 << 20, 2, 512 << 20), 16);
        assert_eq!(fabric_streams_within(16, 4, 4 << 20, 2, 0), 1);
        assert_eq!(fabric_streams_within(0, 4, 4 << 20, 2, 512 << 20), 1);
        assert_eq!(
            fabric_streams_within(16, u16::MAX, u32::MAX, 2, u64::MAX),
            16
        );
    }

    /// The regression of issue 16 item 7: a client refuses a block size of 0 or 4 GiB,
    /// and anything else it did not ask for.
    #[test]
    fn the_client_refuses_numbers_it_did_not_ask_for() {
        let req = request(2, 4 << 20, 4);
        let good = clamp(&req, &limits(), [0; 16], Placement::Onto);
        check_accepted(&req, &good).unwrap();
        for bad in [
            SessionAccepted {
                block_size: 0,
                ..good.clone()
            },
            SessionAccepted {
                block_size: u32::MAX,
                ..good.clone()
            },
            SessionAccepted {
                block_size: (1 << 20) + 1,
                ..good.clone()
            },
            SessionAccepted {
                streams: 0,
                ..good.clone()
            },
            SessionAccepted {
                streams: 3,
                ..good.clone()
            },
            SessionAccepted {
                depth: 0,
                ..good.clone()
            },
            SessionAccepted {
                window: 5000,
                ..good.clone()
            },
            SessionAccepted {
                max_streams: 1,
                ..good.clone()
            },
            SessionAccepted {
                flags: session_flags::NO_FILE_DIGEST,
                ..good.clone()
            },
            SessionAccepted {
                flags: session_flags::DISCARD,
                ..good.clone()
            },
            SessionAccepted {
                placement: Placement::Resolve,
                ..good.clone()
            },
        ] {
            assert!(check_accepted(&req, &bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Whatever the client asks and the server allows, the server's answer passes the
        /// client's check and fits the server's budget (or is the smallest session).
        #[test]
        fn every_clamped_answer_is_acceptable_and_fits(
            streams in any::<u16>(), block in any::<u32>(), depth in any::<u16>(),
            max_memory in 0u64..(2 << 30), fabric in any::<bool>(),
        ) {
            let mut req = request(streams, block, depth);
            if fabric {
                req.transport = TransportKind::Fabric;
            }
            let mut l = limits();
            l.max_memory = max_memory;
            let acc = clamp(&req, &l, [0; 16], Placement::Into);
            prop_assert!(check_accepted(&req, &acc).is_ok(), "{:?}", acc);
            let mem = memory(req.transport, acc.streams, acc.depth, acc.block_size, 2);
            let smallest = acc.streams == 1 && acc.depth == 1 && acc.block_size == MIN_BLOCK_SIZE;
            prop_assert!(mem <= max_memory || smallest);
        }
    }
}
