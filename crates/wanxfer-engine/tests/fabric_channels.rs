//! The fabric transport on its own, over libfabric's tcp provider on loopback: a link
//! pairs a fabric channel with the data connection that joined, blocks arrive intact and
//! in full, a fabric channel presenting another connection's proof is refused, and when a
//! link ends every memory registration it made is gone.

use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::sync::Arc;

use wanxfer_engine::pool::{Cancel, Pool};
use wanxfer_engine::progress::Progress;
use wanxfer_engine::transport::fabric::{self, FabricTransport, SlotPlan};
use wanxfer_engine::transport::{Joined, LinkEvent, PumpCtx, Transport};
use wanxfer_proto::{BlockHeader, ChannelJoin, Segment};

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

/// Both ends of a data connection that joined as channel 0 with `proof`.
fn joined_pair(proof: [u8; 32]) -> (Joined, Joined) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    let join = ChannelJoin {
        session_id: [9; 16],
        index: 0,
        proof,
    };
    (
        Joined {
            stream: wanxfer_engine::stream::Stream::plain(client),
            join,
        },
        Joined {
            stream: wanxfer_engine::stream::Stream::plain(server),
            join,
        },
    )
}

fn ctx(progress: Arc<Progress>) -> PumpCtx {
    PumpCtx {
        index: 0,
        report: Arc::new(|_: LinkEvent| {}),
        cancel: Cancel::default(),
        retire: Cancel::default(),
        held_back: Default::default(),
        pacer: None,
        progress,
        peer: "test".into(),
    }
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
        mac: [0; 12],
    };
    let mut encoded = Vec::new();
    header.encode(&[segment], &mut encoded);
    block.header = encoded;
    block
}

/// A server transport accepting on its own listener, and a client transport dialling it.
fn transports(cancel: &Cancel) -> (FabricTransport, FabricTransport) {
    let plan = SlotPlan::new(BLOCK, 2);
    let (listener, names) = fabric::listen("tcp", IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    assert_eq!(names.provider, "tcp");
    let addr = listener.local_addr();
    let server = FabricTransport::server(
        listener,
        plan,
        TAG,
        BLOCK as usize,
        "client".into(),
        cancel.clone(),
    )
    .unwrap();
    let client = FabricTransport::client("tcp", addr, plan, TAG, BLOCK as usize);
    (server, client)
}

#[test]
fn blocks_cross_intact_and_teardown_revokes_every_registration() {
    if !tcp_provider_present() {
        return;
    }
    let cancel = Cancel::default();
    let (server, client) = transports(&cancel);
    let (client_end, server_end) = joined_pair([4; 32]);
    let receiver = std::thread::spawn(move || {
        let link = server.accept(server_end).unwrap();
        let registrations = link.registrations().unwrap();
        let (out, blocks) = crossbeam_channel::unbounded();
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
        link.receive(None, out, &ctx(Arc::default())).unwrap();
        let mut seqs = collector.join().unwrap();
        seqs.sort_unstable();
        (seqs, registrations)
    });

    let link = client.connect(client_end).unwrap();
    let sender_regs = link.registrations().unwrap();
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
    link.send(rx, &ctx(progress.clone())).unwrap();
    feeder.join().unwrap();

    let (seqs, receiver_regs) = receiver.join().unwrap();
    cancel.cancel();
    assert_eq!(seqs, (0..40).collect::<Vec<_>>());
    assert_eq!(
        progress.bytes.load(std::sync::atomic::Ordering::Relaxed),
        40 * u64::from(BLOCK)
    );
    assert_eq!(sender_regs.live(), 0, "sender registrations revoked");
    assert_eq!(receiver_regs.live(), 0, "receiver registrations revoked");
}

/// A fabric channel must present the proof its data connection joined with: one bound to
/// another connection (an impostor's, or a replay) is refused.
#[test]
fn a_fabric_channel_with_another_connections_proof_is_refused() {
    if !tcp_provider_present() {
        return;
    }
    let cancel = Cancel::default();
    let (server, client) = transports(&cancel);
    let (_, server_end) = joined_pair([4; 32]);
    let (impostor_end, _) = joined_pair([5; 32]);
    let accepted = std::thread::spawn(move || server.accept(server_end).map(drop));
    let _impostor = client.connect(impostor_end);
    let refused = accepted.join().unwrap();
    cancel.cancel();
    match refused {
        Err(wanxfer_engine::Error::Auth { .. }) => {}
        Err(other) => panic!("expected an authentication refusal, got {other}"),
        Ok(()) => panic!("a forged proof was accepted"),
    }
}
