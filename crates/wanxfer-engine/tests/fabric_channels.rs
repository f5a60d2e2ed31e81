//! The fabric transport's pumps on their own, over libfabric's tcp provider on loopback:
//! blocks arrive intact and in full, a forged channel proof is refused, and when a
//! session's channels end every memory registration they made is gone.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use wanxfer_engine::pool::{Cancel, Pool};
use wanxfer_engine::progress::Progress;
use wanxfer_engine::transport::fabric::{self, RecvLimits, SlotPlan};
use wanxfer_proto::handshake::{Authenticated, ClientHandshake, ServerHandshake, Step};
use wanxfer_proto::{features, BlockHeader, Segment};

const BLOCK: u32 = 256 << 10;
const TAG: u64 = 0x5eed;

fn tcp_provider_present() -> bool {
    let ok = std::process::Command::new("fi_info")
        .args(["-p", "tcp", "-t", "FI_EP_MSG"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: libfabric's tcp provider is not available");
    }
    ok
}

/// Both ends of a completed handshake, run in memory (the handshake is sans-IO).
fn authenticated_pair(secret: &[u8]) -> (Authenticated, Authenticated) {
    let mut client = ClientHandshake::new(secret, [1; 32], features::SUPPORTED);
    let mut server = ServerHandshake::new(secret, [2; 32], features::SUPPORTED);
    let Ok(Step::Send(server_hello)) = server.handle(client.hello()) else {
        panic!("server hello")
    };
    let Ok(Step::Send(proof)) = client.handle(server_hello) else {
        panic!("client proof")
    };
    let Ok(Step::SendAndDone(ok, server_auth)) = server.handle(proof) else {
        panic!("server accepts")
    };
    let Ok(Step::Done(client_auth)) = client.handle(ok) else {
        panic!("client done")
    };
    (client_auth, server_auth)
}

fn block_bytes(pool: &Pool, seq: u64) -> wanxfer_engine::pool::Block {
    let mut block = pool.take(&Cancel::default()).unwrap();
    let len = BLOCK as usize;
    for (i, b) in block.space()[..len].iter_mut().enumerate() {
        *b = (i as u64 ^ seq) as u8;
    }
    block.len = len;
    let segment = Segment {
        file_id: seq,
        offset: 0,
        len: BLOCK,
        flags: Segment::FLAG_LAST,
        digest: wanxfer_engine::digest::digest_of(block.payload()),
    };
    let header = BlockHeader {
        flags: BlockHeader::FLAG_SEGMENT_DIGESTS,
        segment_count: 1,
        payload_len: BLOCK,
        payload_crc: 0,
        session_tag: TAG,
        sequence: seq,
    };
    let mut encoded = Vec::new();
    header.encode(&[segment], &mut encoded);
    block.header = encoded;
    block
}

#[test]
fn blocks_cross_intact_and_teardown_revokes_every_registration() {
    if !tcp_provider_present() {
        return;
    }
    let (client_auth, server_auth) = authenticated_pair(b"secret");
    let session_id = [9u8; 16];
    let plan = SlotPlan::new(BLOCK, 2);
    let (mut listener, names) = fabric::listen("tcp", IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    assert_eq!(names.provider, "tcp");
    let addr = listener.local_addr();

    let receiver = std::thread::spawn(move || {
        let channels =
            fabric::accept_channels(&mut listener, plan, &server_auth, &session_id, 1, "test")
                .unwrap();
        let registrations: Vec<_> = channels.iter().map(|c| c.registrations()).collect();
        let (out, blocks) = crossbeam_channel::unbounded();
        let limits = RecvLimits {
            plan,
            session_tag: TAG,
            max_payload: BLOCK as usize,
        };
        let collector = std::thread::spawn(move || {
            blocks
                .iter()
                .map(|b: wanxfer_engine::pool::Block| {
                    assert!(b.damaged.is_empty());
                    assert_eq!(b.checks, BlockHeader::FLAG_SEGMENT_DIGESTS);
                    let seq = b.segments[0].file_id;
                    let expect: Vec<u8> = (0..BLOCK as u64).map(|i| (i ^ seq) as u8).collect();
                    assert!(b.payload() == expect.as_slice(), "block {seq} intact");
                    seq
                })
                .collect::<Vec<_>>()
        });
        for channel in channels {
            fabric::recv_blocks(
                channel,
                &limits,
                &out,
                &Cancel::default(),
                &Progress::default(),
                "client",
            )
            .unwrap();
        }
        drop(out);
        let mut seqs = collector.join().unwrap();
        seqs.sort_unstable();
        (seqs, registrations)
    });

    let mut channels =
        fabric::connect_channels("tcp", addr, plan, &client_auth, &session_id, 1).unwrap();
    let channel = channels.pop().unwrap();
    let sender_regs = channel.registrations();
    let pool = Pool::new(8, BLOCK as usize);
    let (queue, rx) = crossbeam_channel::bounded(2);
    let feeder = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for seq in 0..40 {
                queue.send(block_bytes(&pool, seq)).unwrap();
            }
        })
    };
    let progress = Arc::new(Progress::default());
    fabric::send_blocks(channel, plan, &rx, &Cancel::default(), &progress, "server").unwrap();
    feeder.join().unwrap();

    let (seqs, receiver_regs) = receiver.join().unwrap();
    assert_eq!(seqs, (0..40).collect::<Vec<_>>());
    assert_eq!(
        progress.bytes.load(std::sync::atomic::Ordering::Relaxed),
        40 * u64::from(BLOCK)
    );
    assert_eq!(sender_regs.live(), 0, "sender registrations revoked");
    assert!(
        receiver_regs.iter().all(|r| r.live() == 0),
        "receiver registrations revoked"
    );
}

#[test]
fn a_forged_fabric_channel_proof_is_refused() {
    if !tcp_provider_present() {
        return;
    }
    let (_, server_auth) = authenticated_pair(b"secret");
    let (impostor, _) = authenticated_pair(b"another secret");
    let session_id = [7u8; 16];
    let plan = SlotPlan::new(BLOCK, 1);
    let (mut listener, _) = fabric::listen("tcp", IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        fabric::accept_channels(
            &mut listener,
            plan,
            &server_auth,
            &session_id,
            1,
            "impostor",
        )
    });
    let _channels = fabric::connect_channels("tcp", addr, plan, &impostor, &session_id, 1);
    let refused = server.join().unwrap();
    match refused {
        Err(wanxfer_engine::Error::Auth { .. }) => {}
        Err(other) => panic!("expected an authentication refusal, got {other}"),
        Ok(_) => panic!("a forged proof was accepted"),
    }
}
