//! A hostile or broken peer speaking the wire protocol by hand against a real server:
//! garbage, frames past their limits, paths that escape the root (crafted below the
//! client's own checks), forged channel proofs, corrupt blocks, and blocks that name
//! files or ranges never announced. Each must get a clear refusal, write nothing outside
//! the root (nor a bad file inside it), and leave the server serving.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use wanxfer_engine::stream::Stream;
use wanxfer_engine::tls::{ClientTls, Trust};
use wanxfer_proto::handshake::{Authenticated, ClientHandshake, Step};
use wanxfer_proto::{
    encode_frame, features, BlockHeader, ChannelJoin, Compare, ConnectionKind, Direction, Entry,
    EntryKind, ErrorMsg, FailureClass, FileFailed, FrameHeader, Hello, Manifest, ManifestEnd,
    Message, OpenSession, Placement, Preamble, RelPath, Segment, SessionAccepted, Stats,
    TransportKind,
};

/// One connection to the server, driven by hand.
struct RawPeer {
    stream: Stream,
    /// The server's greeting on this connection.
    greeting: Hello,
}

/// A client's TLS set-up for `addr`, pinning in the test process's state directory.
fn client_tls(addr: &str) -> ClientTls {
    ClientTls::new(
        addr,
        &Trust::Pinned {
            known_hosts: wanxfer_engine::tls::known_hosts_in(&state_dir()),
        },
    )
    .expect("TLS set-up")
}

impl RawPeer {
    /// Connects (TLS) and reads the server's greeting, which it sends in its first flight.
    fn open(server: &Server) -> RawPeer {
        RawPeer::open_from(server, None)
    }

    /// As [`RawPeer::open`], from loopback address `from` (127.0.0.1 if `None`): the
    /// server's limits per source address then see another client.
    fn open_from(server: &Server, from: Option<std::net::Ipv4Addr>) -> RawPeer {
        let tcp = match from {
            None => TcpStream::connect(&server.addr).expect("connect"),
            Some(ip) => {
                use socket2::{Domain, Socket, Type};
                let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
                let local = std::net::SocketAddr::new(ip.into(), 0);
                socket.bind(&local.into()).expect("bind a loopback address");
                let addr: std::net::SocketAddr = server.addr.parse().unwrap();
                socket.connect(&addr.into()).expect("connect");
                socket.into()
            }
        };
        let mut stream = wanxfer_engine::tls::connect_over(
            tcp,
            &server.addr,
            Some(&client_tls(&server.addr)),
            Duration::from_secs(30),
        )
        .expect("TLS");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut preamble = [0u8; Preamble::LEN];
        stream
            .read_exact(&mut preamble)
            .expect("the server greets first");
        assert_eq!(
            Preamble::decode(&preamble).unwrap().kind,
            ConnectionKind::Server
        );
        let mut peer = RawPeer {
            stream,
            greeting: hello_placeholder(),
        };
        match peer.recv() {
            Some(Message::Hello(h)) => peer.greeting = h,
            other => panic!("expected the server's Hello, got {other:?}"),
        }
        peer
    }

    fn connect(server: &Server, kind: ConnectionKind) -> RawPeer {
        let mut peer = RawPeer::open(server);
        peer.stream
            .write_all(&Preamble::new(kind).encode())
            .unwrap();
        peer
    }

    fn send(&mut self, msg: &Message) {
        let mut out = Vec::new();
        encode_frame(msg, &mut out);
        self.send_raw(&out);
    }

    /// Writes bytes; a server that already hung up is fine (that is a refusal too).
    fn send_raw(&mut self, bytes: &[u8]) {
        let _ = self.stream.write_all(bytes);
    }

    /// The next message that is not routine bookkeeping (a channel's count, a
    /// keepalive), or `None` once the peer closed the connection. A peer that says
    /// nothing for 30 s fails the test: silence is not a refusal.
    fn recv(&mut self) -> Option<Message> {
        loop {
            match self.recv_any()? {
                Message::ChannelStatus { .. } | Message::Keepalive => continue,
                msg => return Some(msg),
            }
        }
    }

    fn recv_any(&mut self) -> Option<Message> {
        let mut header = [0u8; FrameHeader::LEN];
        self.read_or_close(&mut header)?;
        let parsed = FrameHeader::decode(&header).expect("the server frames correctly");
        let mut frame = header.to_vec();
        frame.resize(FrameHeader::LEN + parsed.len as usize, 0);
        self.read_or_close(&mut frame[FrameHeader::LEN..])?;
        Some(wanxfer_proto::decode_frame(&frame).expect("the server's frames decode"))
    }

    fn read_or_close(&mut self, buf: &mut [u8]) -> Option<()> {
        match self.stream.read_exact(buf) {
            Ok(()) => Some(()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("the server neither answered nor closed within 30 s")
            }
            Err(_) => None,
        }
    }

    /// Asserts the server refuses: an error frame naming `needle` (if given), or a close.
    #[track_caller]
    fn expect_refusal(&mut self, needle: Option<&str>) {
        match self.recv() {
            None => {}
            Some(Message::Error(e)) => {
                let text = String::from_utf8_lossy(&e.message).into_owned();
                if let Some(needle) = needle {
                    assert!(text.contains(needle), "{text:?} should mention {needle:?}");
                }
            }
            Some(other) => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn authenticate(server: &Server, secret: &str) -> (RawPeer, Authenticated) {
        RawPeer::authenticate_from(server, secret, None)
    }

    /// Authenticates as a client from before pipelined set-up (no `features::PIPELINE`):
    /// its joins are answered, and it announces only once its session is accepted.
    fn authenticate_from(
        server: &Server,
        secret: &str,
        from: Option<std::net::Ipv4Addr>,
    ) -> (RawPeer, Authenticated) {
        RawPeer::authenticate_as(server, secret, from, OLDER_CLIENT, &[])
    }

    /// Authenticates offering `offered`, with `behind` sent right behind the proof,
    /// before the server's answer is read.
    fn authenticate_as(
        server: &Server,
        secret: &str,
        from: Option<std::net::Ipv4Addr>,
        offered: u64,
        behind: &[Message],
    ) -> (RawPeer, Authenticated) {
        let mut peer = RawPeer::open_from(server, from);
        peer.stream
            .write_all(&Preamble::new(ConnectionKind::Control).encode())
            .unwrap();
        let mut handshake = ClientHandshake::new(secret.as_bytes(), [7; 32], offered)
            .with_binding(peer.stream.binding());
        peer.send(&handshake.hello());
        let Ok(Step::Send(proof)) = handshake.handle(Message::Hello(peer.greeting.clone())) else {
            panic!("the greeting asks for a proof")
        };
        let mut flight = Vec::new();
        for msg in std::iter::once(&proof).chain(behind) {
            encode_frame(msg, &mut flight);
        }
        peer.send_raw(&flight);
        let msg = peer.recv().expect("the server answers the handshake");
        match handshake.handle(msg).expect("handshake") {
            Step::Done(auth) => (peer, auth),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// What a client from before pipelined set-up offered.
const OLDER_CLIENT: u64 = features::SUPPORTED & !features::PIPELINE;

fn hello_placeholder() -> Hello {
    Hello {
        version: 0,
        features: 0,
        nonce: [0; 32],
        software: Vec::new(),
    }
}

/// A transfer id no other test uses.
fn fresh_transfer_id() -> [u8; 16] {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&n.to_le_bytes());
    id[8..].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    id
}

fn push_request(dest: &str) -> OpenSession {
    OpenSession {
        direction: Direction::Push,
        transport: TransportKind::Tcp,
        paths: vec![RelPath::new(dest.as_bytes()).unwrap()],
        source_count: 1,
        streams: 1,
        block_size: 1 << 20,
        depth: 2,
        window: 1024,
        flags: 0,
        synthetic_bytes: 0,
        transfer_id: fresh_transfer_id(),
        placement: Placement::Resolve,
        compare: Compare::Always,
        selection: Default::default(),
    }
}

/// Encodes `msg`, swaps the bytes `from` for `to` (same length) in its body, and fixes
/// the frame checksum: how a hostile peer gets past the encoder's own path checks.
fn forged_frame(msg: &Message, from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut frame = Vec::new();
    encode_frame(msg, &mut frame);
    let at = frame
        .windows(from.len())
        .position(|w| w == from)
        .expect("placeholder present");
    frame[at..at + to.len()].copy_from_slice(to);
    let crc = crc32c(&frame[FrameHeader::LEN..]);
    frame[8..12].copy_from_slice(&crc.to_le_bytes());
    frame
}

/// CRC-32C (Castagnoli), bitwise: small, and independent of the code under test.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Checks that only a hostile peer needs.
trait Unharmed {
    fn assert_unharmed(&mut self);
    fn accepted(&self, peer: &mut RawPeer) -> SessionAccepted;
}

impl Unharmed for Site {
    /// The server is alive, the directory around its root holds only what the test put
    /// there, and a normal client still gets through.
    #[track_caller]
    fn assert_unharmed(&mut self) {
        assert!(self.server.is_running(), "the server survived");
        let mut around: Vec<String> = fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("serve-"))
            .collect();
        around.sort();
        assert_eq!(around, ["root"], "nothing was written outside the root");
        assert!(
            temp_files(&self.server.root).is_empty(),
            "no partial file left in the root"
        );
        let probe = self.path("probe");
        fs::write(&probe, b"ok").unwrap();
        cp([probe.as_os_str(), &self.server.url("probe")]).assert_ok();
        fs::remove_file(&probe).unwrap();
    }

    fn accepted(&self, peer: &mut RawPeer) -> SessionAccepted {
        match peer.recv() {
            Some(Message::SessionAccepted(a)) => a,
            other => panic!("expected SessionAccepted, got {other:?}"),
        }
    }
}

#[test]
fn garbage_and_foreign_protocols_are_turned_away() {
    let mut site = Site::new();
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"SSH-2.0-OpenSSH_9.2\r\n",
        &[0xffu8; 64][..],
        b"",
    ] {
        let mut stream = TcpStream::connect(&site.server.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let _ = stream.write_all(junk);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
        assert!(reply.len() < 4096, "a short refusal at most");
    }
    site.assert_unharmed();
}

#[test]
fn frames_past_their_limits_or_corrupt_are_refused_before_and_after_auth() {
    let mut site = Site::new();
    let mut huge = Vec::new();
    encode_frame(&Message::Finish, &mut huge);
    huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());

    // Before authenticating: nothing but the handshake is accepted.
    let mut peer = RawPeer::connect(&site.server, ConnectionKind::Control);
    peer.send(&Message::OpenSession(push_request("before-auth")));
    peer.expect_refusal(None);
    let mut peer = RawPeer::connect(&site.server, ConnectionKind::Control);
    peer.send_raw(&huge);
    peer.expect_refusal(None);

    // After: an oversized length, a bad checksum, reserved bits, an unknown type.
    let mut corrupt = Vec::new();
    encode_frame(&Message::OpenSession(push_request("x")), &mut corrupt);
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0x40;
    let mut reserved = Vec::new();
    encode_frame(&Message::Finish, &mut reserved);
    reserved[2] = 1;
    let mut unknown = Vec::new();
    encode_frame(&Message::Finish, &mut unknown);
    unknown[0] = 200;
    for bad in [&huge, &corrupt, &reserved, &unknown] {
        let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
        peer.send_raw(bad);
        peer.expect_refusal(None);
    }
    assert!(snapshot(&site.server.root).is_empty());
    site.assert_unharmed();
}

#[test]
fn escaping_destinations_forged_past_the_encoder_are_refused() {
    let mut site = Site::new();
    for (placeholder, forged) in [
        (&b"xx/escape"[..], &b"../escape"[..]),
        (b"xescape", b"/escape"),
        (b"a/xx/xx/escape", b"a/../../escape"),
        (b"nul-xscape", b"nul-\0scape"),
    ] {
        let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
        let request = push_request(std::str::from_utf8(placeholder).unwrap());
        peer.send_raw(&forged_frame(
            &Message::OpenSession(request),
            placeholder,
            forged,
        ));
        peer.expect_refusal(None);
    }
    site.assert_unharmed();
}

/// An authenticated push session into the root.
fn open_push_session(site: &Site, flags: u32) -> (RawPeer, Authenticated, SessionAccepted) {
    let (mut peer, auth) = RawPeer::authenticate(&site.server, SECRET);
    peer.send(&Message::OpenSession(OpenSession {
        flags,
        ..push_request("")
    }));
    let accepted = site.accepted(&mut peer);
    (peer, auth, accepted)
}

/// A push session with its data channel joined and `entries` announced and
/// acknowledged: what an honest sender has before it sends any block.
fn session_ready_for_blocks(
    site: &Site,
    entries: Vec<Entry>,
) -> (RawPeer, RawPeer, SessionAccepted) {
    session_with_flags_ready_for_blocks(site, entries, 0)
}

/// As [`session_ready_for_blocks`], for a session asked for with `flags`.
fn session_with_flags_ready_for_blocks(
    site: &Site,
    entries: Vec<Entry>,
    flags: u32,
) -> (RawPeer, RawPeer, SessionAccepted) {
    let (mut control, auth, accepted) = open_push_session(site, flags);
    let data = join_channel(site, &auth, &accepted);
    announce(&mut control, entries);
    (control, data, accepted)
}

/// Sends the whole manifest, `entries`, and waits for its acknowledgement.
fn announce(control: &mut RawPeer, entries: Vec<Entry>) {
    let count = entries.len() as u64;
    let bytes = entries.iter().map(|e| e.size).sum();
    control.send(&Message::Manifest(Manifest {
        first_id: 0,
        entries,
    }));
    control.send(&Message::ManifestEnd(ManifestEnd {
        entries: count,
        bytes,
    }));
    await_manifest_ack(control, count);
}

/// Waits for the receiver to acknowledge the manifest through `count`, past the
/// `FileAck`s of entries it resolved on arrival (directories, empty files).
#[track_caller]
fn await_manifest_ack(control: &mut RawPeer, count: u64) {
    loop {
        match control.recv() {
            Some(Message::ManifestAck { through }) if through == count => return,
            Some(Message::FileAck { .. } | Message::UpToDate { .. }) => {}
            other => panic!("expected ManifestAck, got {other:?}"),
        }
    }
}

fn file_entry(path: &str, size: u64) -> Entry {
    Entry {
        kind: EntryKind::File,
        path: RelPath::new(path.as_bytes()).unwrap(),
        size,
        mode: 0o644,
        mtime_sec: 1_600_000_000,
        mtime_nsec: 0,
        link_target: Vec::new(),
        meta: None,
    }
}

#[test]
fn escaping_manifest_entries_are_refused_naming_the_entry() {
    let mut site = Site::new();
    for (placeholder, forged) in [
        (&b"xx/evil"[..], &b"../evil"[..]),
        (b"d/xx/xx/evil", b"d/../../evil"),
        (b"xevil", b"/evil"),
    ] {
        let (mut peer, auth, accepted) = open_push_session(&site, 0);
        let _data = join_channel(&site, &auth, &accepted);
        let manifest = Message::Manifest(Manifest {
            first_id: 0,
            entries: vec![file_entry(std::str::from_utf8(placeholder).unwrap(), 4)],
        });
        peer.send_raw(&forged_frame(&manifest, placeholder, forged));
        match peer.recv() {
            Some(Message::Error(e)) => {
                let text = String::from_utf8_lossy(&e.message).into_owned();
                assert!(text.contains("evil"), "the refusal names the entry: {text}");
            }
            other => panic!("expected an error frame, got {other:?}"),
        }
    }
    site.assert_unharmed();
}

#[test]
fn forged_channel_proofs_are_refused() {
    let mut site = Site::new();
    let (control, auth, accepted) = open_push_session(&site, 0);
    let mut other_session = accepted.session_id;
    other_session[15] ^= 1;
    let forge: [&dyn Fn(&RawPeer) -> ChannelJoin; 2] = [
        &|data| {
            let mut proof = auth.channel_proof(
                &accepted.session_id,
                0,
                &data.greeting.nonce,
                &data.stream.binding(),
            );
            proof[0] ^= 1;
            ChannelJoin {
                session_id: accepted.session_id,
                index: 0,
                proof,
            }
        },
        &|data| ChannelJoin {
            session_id: other_session,
            index: 0,
            proof: auth.channel_proof(
                &other_session,
                0,
                &data.greeting.nonce,
                &data.stream.binding(),
            ),
        },
    ];
    for join in forge {
        let mut data = RawPeer::connect(&site.server, ConnectionKind::Data);
        data.send(&Message::ChannelJoin(join(&data)));
        data.expect_refusal(None);
    }
    drop(control);
    site.assert_unharmed();
}

/// The regression of issue 16 item 9: a join captured on the wire and replayed, ahead of
/// the real one on another connection or after it, is refused, and the real client's
/// channel is unaffected either way.
#[test]
fn a_replayed_channel_join_is_refused_and_harms_nothing() {
    let mut site = Site::new();
    let (mut control, auth, accepted) = open_push_session(&site, 0);
    // The honest client's connection and the join it will send, captured.
    let mut real = RawPeer::connect(&site.server, ConnectionKind::Data);
    let captured = ChannelJoin {
        session_id: accepted.session_id,
        index: 0,
        proof: auth.channel_proof(
            &accepted.session_id,
            0,
            &real.greeting.nonce,
            &real.stream.binding(),
        ),
    };
    // Replayed ahead of the real one, on the attacker's own connection.
    let mut ahead = RawPeer::connect(&site.server, ConnectionKind::Data);
    ahead.send(&Message::ChannelJoin(captured));
    ahead.expect_refusal(Some("bad channel proof"));
    // The real join goes through.
    real.send(&Message::ChannelJoin(captured));
    match real.recv() {
        Some(Message::ChannelAccepted { index: 0 }) => {}
        other => panic!("the real join is accepted, got {other:?}"),
    }
    // Replayed after it.
    let mut after = RawPeer::connect(&site.server, ConnectionKind::Data);
    after.send(&Message::ChannelJoin(captured));
    after.expect_refusal(Some("bad channel proof"));
    // The session goes on over the real channel.
    let payload = b"still fine";
    announce(&mut control, vec![file_entry("f", payload.len() as u64)]);
    real.send_raw(&block(
        &accepted,
        whole_file_segment(payload.len() as u32, digest_of(payload)),
        payload,
        false,
    ));
    match control.recv() {
        Some(Message::FileAck { ids }) => assert_eq!(ids, [0]),
        other => panic!("expected the file acknowledged, got {other:?}"),
    }
    drop((control, real));
    assert_eq!(fs::read(site.server.root.join("f")).unwrap(), payload);
    site.assert_unharmed();
}

/// Issue 19 item 5 (`features::PIPELINE`): a client's first entries, sent behind its
/// request before the server has proved itself, are read only once the session is
/// accepted and are answered right behind the acceptance; the data channel's join is not
/// answered, and the block sent right behind it is taken.
#[test]
fn a_pipelined_push_is_answered_with_its_session_and_its_join_is_silent() {
    let mut site = Site::new();
    let payload = b"pipelined";
    let request = push_request("");
    let entries = vec![file_entry("p", payload.len() as u64)];
    let (mut control, auth) = RawPeer::authenticate_as(
        &site.server,
        SECRET,
        None,
        features::SUPPORTED,
        &[
            Message::OpenSession(request),
            Message::Manifest(Manifest {
                first_id: 0,
                entries,
            }),
        ],
    );
    let accepted = site.accepted(&mut control);
    await_manifest_ack(&mut control, 1);
    let mut data = RawPeer::connect(&site.server, ConnectionKind::Data);
    let proof = auth.channel_proof(
        &accepted.session_id,
        0,
        &data.greeting.nonce,
        &data.stream.binding(),
    );
    let mut flight = Vec::new();
    encode_frame(
        &Message::ChannelJoin(ChannelJoin {
            session_id: accepted.session_id,
            index: 0,
            proof,
        }),
        &mut flight,
    );
    flight.extend_from_slice(&block(
        &accepted,
        whole_file_segment(payload.len() as u32, digest_of(payload)),
        payload,
        false,
    ));
    data.send_raw(&flight);
    match control.recv() {
        Some(Message::FileAck { ids }) => assert_eq!(ids, [0]),
        other => panic!("expected the file acknowledged, got {other:?}"),
    }
    drop(control);
    // The session ends with its control connection; the data channel heard nothing.
    match data.recv() {
        None => {}
        Some(other) => panic!("a pipelined join is not answered, got {other:?}"),
    }
    assert_eq!(fs::read(site.server.root.join("p")).unwrap(), payload);
    site.assert_unharmed();
}

/// Issue 19 item 5: pipelining holds nothing for later. Entries behind a request whose
/// proof fails are never read; a join for a session that is not open is refused at once,
/// never kept until one opens; a join with a wrong proof is refused on a pipelined
/// session as on any other.
#[test]
fn pipelined_set_up_refuses_what_comes_before_or_without_authentication() {
    let mut site = Site::new();
    let behind = [
        Message::OpenSession(push_request("")),
        Message::Manifest(Manifest {
            first_id: 0,
            entries: vec![file_entry("never", 4)],
        }),
    ];
    let mut peer = RawPeer::open_from(&site.server, None);
    peer.stream
        .write_all(&Preamble::new(ConnectionKind::Control).encode())
        .unwrap();
    let mut handshake = ClientHandshake::new(b"not the secret", [7; 32], features::SUPPORTED)
        .with_binding(peer.stream.binding());
    peer.send(&handshake.hello());
    let Ok(Step::Send(proof)) = handshake.handle(Message::Hello(peer.greeting.clone())) else {
        panic!("the greeting asks for a proof")
    };
    let mut flight = Vec::new();
    for msg in std::iter::once(&proof).chain(&behind) {
        encode_frame(msg, &mut flight);
    }
    peer.send_raw(&flight);
    peer.expect_refusal(None);

    // A join naming a session nobody opened, on a server where one is open.
    let (control, auth) = RawPeer::authenticate_as(
        &site.server,
        SECRET,
        None,
        features::SUPPORTED,
        &behind[..1],
    );
    let mut control = control;
    let accepted = site.accepted(&mut control);
    let mut unopened = accepted.session_id;
    unopened[0] ^= 0x80;
    let mut data = RawPeer::connect(&site.server, ConnectionKind::Data);
    let proof = auth.channel_proof(&unopened, 0, &data.greeting.nonce, &data.stream.binding());
    data.send(&Message::ChannelJoin(ChannelJoin {
        session_id: unopened,
        index: 0,
        proof,
    }));
    data.expect_refusal(Some("unknown session"));

    // The open session's id with a proof that is not bound to this connection.
    let mut data = RawPeer::connect(&site.server, ConnectionKind::Data);
    let proof = auth.channel_proof(&accepted.session_id, 0, &[0; 32], &data.stream.binding());
    data.send(&Message::ChannelJoin(ChannelJoin {
        session_id: accepted.session_id,
        index: 0,
        proof,
    }));
    data.expect_refusal(Some("bad channel proof"));
    drop(control);
    assert!(
        snapshot(&site.server.root).is_empty(),
        "nothing was written"
    );
    site.assert_unharmed();
}

/// Issue 19 item 5: a pushing client pipelines only with a server that offers it. Seen
/// from a hand-driven server: offering `features::PIPELINE`, the first entries arrive
/// behind the request and blocks right behind the join; not offering it (an older
/// server), nothing comes before the session's answer or the join's.
#[test]
fn a_pushing_client_pipelines_only_with_a_server_that_offers_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("f");
    fs::write(&src, b"abcd").unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let push = || {
        cp([
            "--retries=0".to_string(),
            src.to_str().unwrap().to_string(),
            format!("wanxfer://{addr}/f"),
        ])
    };
    // First use: the client pins the certificate once the server has proved itself,
    // and sends nothing but its request to a certificate it does not know yet.
    let server = std::thread::spawn(move || {
        let (mut control, _, _) = rogue_control(&listener);
        assert_silent(&mut control, "nothing behind the request on first use");
        control.send(&Message::Error(ErrorMsg::new(
            FailureClass::Refused,
            "come back",
        )));
        let _ = control.recv();
    });
    assert_ne!(push().code, 0);
    server.join().unwrap();

    for offered in [
        features::SUPPORTED & !features::PIPELINE,
        features::SUPPORTED,
    ] {
        let listener = std::net::TcpListener::bind(addr).unwrap();
        let server = std::thread::spawn(move || {
            let pipelined = offered & features::PIPELINE != 0;
            let (mut control, auth, open) = rogue_control_offering(&listener, offered);
            if pipelined {
                match control.recv() {
                    Some(Message::Manifest(m)) => assert_eq!(m.entries.len(), 1),
                    other => panic!("expected the entries behind the request, got {other:?}"),
                }
            } else {
                assert_silent(&mut control, "nothing behind the request");
            }
            let accepted = SessionAccepted {
                placement: Placement::Onto,
                ..honest_answer(&open)
            };
            control.send(&Message::SessionAccepted(accepted.clone()));
            if pipelined {
                control.send(&Message::ManifestAck { through: 1 });
            }
            let (mut data, join) = rogue_join(&listener, [11; 32]);
            assert!(auth.verify_channel(
                &accepted.session_id,
                join.index,
                &[11; 32],
                &data.stream.binding(),
                &join.proof
            ));
            if pipelined {
                let mut magic = [0u8; 4];
                data.stream.read_exact(&mut magic).unwrap();
                assert_eq!(magic, wanxfer_proto::BLOCK_MAGIC.to_le_bytes());
            } else {
                assert_silent(&mut data, "nothing behind the join before its answer");
                data.send(&Message::ChannelAccepted { index: join.index });
                match control.recv() {
                    Some(Message::Manifest(m)) => assert_eq!(m.entries.len(), 1),
                    other => panic!("expected the entries after the answer, got {other:?}"),
                }
            }
        });
        assert_ne!(push().code, 0, "the hand-driven server never finishes");
        server.join().unwrap();
    }
}

/// Asserts `peer` sends nothing for a second (what it would send, it sends at once).
#[track_caller]
fn assert_silent(peer: &mut RawPeer, what: &str) {
    peer.stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut byte = [0u8; 1];
    match peer.stream.read(&mut byte) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
        other => panic!("{what}: got {other:?}"),
    }
    peer.stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
}

/// Joins data channel 0 of `accepted`'s session.
fn join_channel(site: &Site, auth: &Authenticated, accepted: &SessionAccepted) -> RawPeer {
    let mut data = RawPeer::connect(&site.server, ConnectionKind::Data);
    let proof = auth.channel_proof(
        &accepted.session_id,
        0,
        &data.greeting.nonce,
        &data.stream.binding(),
    );
    data.send(&Message::ChannelJoin(ChannelJoin {
        session_id: accepted.session_id,
        index: 0,
        proof,
    }));
    match data.recv() {
        Some(Message::ChannelAccepted { index: 0 }) => data,
        other => panic!("expected ChannelAccepted, got {other:?}"),
    }
}

/// A block carrying `payload` as its one segment `seg` (whose digest the caller chooses),
/// as a digest-checked session sends it; `corrupt_in_transit` flips a payload bit after
/// the digest was computed.
fn block(
    accepted: &SessionAccepted,
    seg: Segment,
    payload: &[u8],
    corrupt_in_transit: bool,
) -> Vec<u8> {
    let checks = BlockHeader::FLAG_SEGMENT_DIGESTS;
    raw_block(accepted, checks, &[seg], payload, corrupt_in_transit)
}

/// A block of `segments` over `payload` with the header flags `checks` (its payload CRC
/// is always correct for `payload`), `corrupt_in_transit` as in [`block`].
fn raw_block(
    accepted: &SessionAccepted,
    checks: u8,
    segments: &[Segment],
    payload: &[u8],
    corrupt_in_transit: bool,
) -> Vec<u8> {
    let header = BlockHeader {
        mac: [0; 12],
        flags: checks,
        segment_count: segments.len() as u16,
        payload_len: payload.len() as u32,
        payload_crc: crc32c(payload),
        session_tag: u64::from_le_bytes(accepted.session_id[..8].try_into().unwrap()),
        sequence: 0,
    };
    let mut out = Vec::new();
    header.encode(segments, &mut out);
    let start = out.len();
    out.extend_from_slice(payload);
    if corrupt_in_transit {
        out[start] ^= 0x01;
    }
    out
}

fn whole_file_segment(len: u32, digest: [u8; 16]) -> Segment {
    Segment {
        file_id: 0,
        offset: 0,
        len,
        flags: Segment::FLAG_LAST,
        digest,
    }
}

#[test]
fn a_corrupt_block_is_caught_and_never_written() {
    let mut site = Site::new();
    let payload = b"good data!";
    let (mut control, mut data, accepted) =
        session_ready_for_blocks(&site, vec![file_entry("victim", payload.len() as u64)]);
    let digest = digest_of(payload);
    data.send_raw(&block(
        &accepted,
        whole_file_segment(payload.len() as u32, digest),
        payload,
        true,
    ));
    let failure = match control.recv() {
        Some(Message::FileFailed(f)) => f,
        other => panic!("expected FileFailed, got {other:?}"),
    };
    assert_eq!(failure.id, 0);
    assert_eq!(failure.class, FailureClass::Integrity);
    assert!(String::from_utf8_lossy(&failure.message).contains("victim"));
    drop((control, data));
    assert!(!site.server.root.join("victim").exists());
    site.assert_unharmed();
}

/// A sender that agreed on segment digests and sends a block with only a payload CRC
/// ends the session, and nothing of that block is written.
#[test]
fn a_block_without_the_agreed_digests_ends_the_session() {
    let mut site = Site::new();
    let (mut control, mut data, accepted) =
        session_ready_for_blocks(&site, vec![file_entry("f", 4)]);
    let seg = whole_file_segment(4, [0; 16]);
    data.send_raw(&raw_block(
        &accepted,
        BlockHeader::FLAG_PAYLOAD_CRC,
        &[seg],
        b"abcd",
        false,
    ));
    match control.recv() {
        None | Some(Message::Error(_)) => {}
        other => panic!("expected the session to end, got {other:?}"),
    }
    drop((control, data));
    assert!(!site.server.root.join("f").exists());
    site.assert_unharmed();
}

/// In a session without digests the payload CRC is the check: a damaged block fails
/// every file in it (the CRC cannot say which), as integrity failures.
#[test]
fn without_digests_the_payload_crc_catches_damage() {
    let mut site = Site::new();
    let flags = wanxfer_proto::session_flags::NO_FILE_DIGEST;
    let entries = vec![file_entry("a", 4), file_entry("b", 4)];
    let (mut control, mut data, accepted) =
        session_with_flags_ready_for_blocks(&site, entries, flags);
    let segments = [
        whole_file_segment(4, [0; 16]),
        Segment {
            file_id: 1,
            ..whole_file_segment(4, [0; 16])
        },
    ];
    let crc = BlockHeader::FLAG_PAYLOAD_CRC;
    data.send_raw(&raw_block(&accepted, crc, &segments, b"abcdefgh", true));
    let mut failed = Vec::new();
    while failed.len() < 2 {
        match control.recv() {
            Some(Message::FileFailed(f)) => {
                assert_eq!(f.class, FailureClass::Integrity, "{f:?}");
                failed.push(f.id);
            }
            other => panic!("expected FileFailed, got {other:?}"),
        }
    }
    failed.sort_unstable();
    assert_eq!(failed, [0, 1]);
    drop((control, data));
    assert!(!site.server.root.join("a").exists() && !site.server.root.join("b").exists());
    site.assert_unharmed();
}

/// What an honest sender puts in the segment carrying `bytes`.
fn digest_of(bytes: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128(bytes).to_le_bytes()
}

/// One session's files for the digest tests, under `wanted/` (which a pull of `wanted`
/// accepts and a push into the root places as is): `whole` comes in one segment with a
/// digest its bytes do not have, `pieces` in two of which the second has a wrong digest;
/// `after` is right.
struct DigestTrial;

impl DigestTrial {
    const WHOLE: &'static [u8] = b"one segment, wrong digest";
    const PIECES: &'static [u8] = b"two segments, wrong digest";
    const AFTER: &'static [u8] = b"sent after both, and right";
    /// The ids of `wanted/whole` and `wanted/pieces`.
    const FAILING: [u64; 2] = [1, 2];
    /// The id of `wanted/after`.
    const LANDING: [u64; 1] = [3];

    fn entries() -> Vec<Entry> {
        vec![
            Entry {
                kind: EntryKind::Dir,
                mode: 0o755,
                ..file_entry("wanted", 0)
            },
            file_entry("wanted/whole", Self::WHOLE.len() as u64),
            file_entry("wanted/pieces", Self::PIECES.len() as u64),
            file_entry("wanted/after", Self::AFTER.len() as u64),
        ]
    }

    /// Every block of the session, in the order an honest sender could send them.
    fn blocks(accepted: &SessionAccepted) -> Vec<Vec<u8>> {
        let wrong = [0x5a; 16];
        let half = Self::PIECES.len() / 2;
        [
            (1, 0, Self::WHOLE, true, wrong),
            (
                2,
                0,
                &Self::PIECES[..half],
                false,
                digest_of(&Self::PIECES[..half]),
            ),
            (2, half, &Self::PIECES[half..], true, wrong),
            (3, 0, Self::AFTER, true, digest_of(Self::AFTER)),
        ]
        .into_iter()
        .map(|(file_id, offset, payload, last, digest)| {
            let seg = Segment {
                file_id,
                offset: offset as u64,
                flags: if last { Segment::FLAG_LAST } else { 0 },
                ..whole_file_segment(payload.len() as u32, digest)
            };
            block(accepted, seg, payload, false)
        })
        .collect()
    }

    /// Sends every block on `data`, then ends the channel as an honest sender does.
    fn send_blocks(data: &mut RawPeer, accepted: &SessionAccepted) {
        for bytes in Self::blocks(accepted) {
            data.send_raw(&bytes);
        }
        data.stream.finish_writes().unwrap();
    }

    /// Reads the receiver's verdict on every file (the directory's came with the manifest
    /// acknowledgement) and checks that exactly the files with a wrong digest failed, as
    /// integrity failures naming them.
    #[track_caller]
    fn expect_verdicts(control: &mut RawPeer) {
        let (mut failed, mut landed) = (BTreeMap::<u64, FileFailed>::new(), Vec::new());
        while failed.len() + landed.len() < Self::FAILING.len() + Self::LANDING.len() {
            match control.recv() {
                Some(Message::FileFailed(f)) => {
                    failed.insert(f.id, f);
                }
                Some(Message::FileAck { ids }) => landed.extend(ids),
                other => panic!("expected a verdict on a file, got {other:?}"),
            }
        }
        landed.sort_unstable();
        assert_eq!(landed, Self::LANDING);
        assert_eq!(failed.keys().copied().collect::<Vec<_>>(), Self::FAILING);
        for (f, name) in failed.values().zip(["whole", "pieces"]) {
            assert_eq!(f.class, FailureClass::Integrity, "{f:?}");
            let message = String::from_utf8_lossy(&f.message);
            assert!(message.contains(name), "{message:?} names {name}");
        }
    }

    /// Only `after` reached a final name, with its bytes; no temporary is left.
    #[track_caller]
    fn assert_landed(base: &std::path::Path) {
        let wanted = base.join("wanted");
        assert_eq!(fs::read(wanted.join("after")).unwrap(), Self::AFTER);
        assert!(!wanted.join("whole").exists());
        assert!(!wanted.join("pieces").exists());
        assert_eq!(temp_files(base), Vec::<String>::new());
    }
}

/// A wrong digest fails that file alone, whether the file came whole in one segment or
/// in pieces: nothing under its name, no temporary, and the session goes on to land the
/// next file and finish. (Whole-file segments used to end the session.)
#[test]
fn a_wrong_file_digest_keeps_the_file_from_its_final_name() {
    let mut site = Site::new();
    let (mut control, mut data, accepted) = session_ready_for_blocks(&site, DigestTrial::entries());
    DigestTrial::send_blocks(&mut data, &accepted);
    DigestTrial::expect_verdicts(&mut control);
    control.send(&Message::Finish);
    match control.recv() {
        Some(Message::Stats(stats)) => assert_eq!(stats.files, 1, "{stats:?}"),
        other => panic!("expected Stats, got {other:?}"),
    }
    drop((control, data));
    DigestTrial::assert_landed(&site.server.root);
    site.assert_unharmed();
}

#[test]
fn blocks_naming_unannounced_files_or_ranges_end_the_session() {
    let mut site = Site::new();
    for seg in [
        // A file id never announced.
        Segment {
            file_id: 77,
            ..whole_file_segment(4, digest_of(b"abcd"))
        },
        // Past the announced size.
        Segment {
            offset: 2,
            ..whole_file_segment(4, digest_of(b"abcd"))
        },
        // An offset near the end of the address space.
        Segment {
            offset: u64::MAX - 8,
            flags: 0,
            ..whole_file_segment(4, digest_of(b"abcd"))
        },
    ] {
        let (mut control, mut data, accepted) =
            session_ready_for_blocks(&site, vec![file_entry("f", 4)]);
        data.send_raw(&block(&accepted, seg, b"abcd", false));
        match control.recv() {
            None | Some(Message::Error(_)) | Some(Message::FileFailed(_)) => {}
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(!site.server.root.join("f").exists());
    }
    site.assert_unharmed();
}

#[test]
fn a_block_larger_than_agreed_is_refused_before_it_is_read() {
    let mut site = Site::new();
    let (mut control, mut data, accepted) =
        session_ready_for_blocks(&site, vec![file_entry("f", 4)]);
    let mut bytes = block(
        &accepted,
        whole_file_segment(4, digest_of(b"abcd")),
        b"abcd",
        false,
    );
    // Claim a 64 MiB payload (the protocol ceiling, past the agreed 1 MiB) and send no
    // more: the server must refuse from the header alone.
    bytes[8..12].copy_from_slice(&(64u32 << 20).to_le_bytes());
    data.send_raw(&bytes);
    match control.recv() {
        None | Some(Message::Error(_)) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    site.assert_unharmed();
}

/// Accepts a connection on `listener` and greets like a server (its preamble and a Hello
/// with `nonce`, in TLS's first flight), then checks the client's preamble; `None` for a
/// connection the client closed before it said what it is (it opens data connections
/// early and closes those its session does not take).
fn try_rogue_accept(
    listener: &std::net::TcpListener,
    kind: ConnectionKind,
    nonce: [u8; 32],
) -> Option<RawPeer> {
    try_rogue_accept_offering(listener, kind, nonce, features::SUPPORTED)
}

/// The next connection on `listener`; panics after `limit`, so that a client that gave
/// up before connecting fails the test at once instead of leaving it blocked in
/// `accept` for ever.
fn accept_within(listener: &std::net::TcpListener, limit: Duration) -> std::net::TcpStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + limit;
    loop {
        match listener.accept() {
            Ok((tcp, _)) => {
                listener.set_nonblocking(false).unwrap();
                tcp.set_nonblocking(false).unwrap();
                return tcp;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no connection within {limit:?}: the client gave up or never came"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// [`try_rogue_accept`] greeting with `offered` features.
fn try_rogue_accept_offering(
    listener: &std::net::TcpListener,
    kind: ConnectionKind,
    nonce: [u8; 32],
    offered: u64,
) -> Option<RawPeer> {
    let (cert, key) = test_identity();
    let tls = wanxfer_engine::tls::ServerIdentity::from_files(&cert, &key)
        .and_then(|identity| identity.server_config())
        .unwrap();
    let tcp = accept_within(listener, Duration::from_secs(60));
    let mut greeting = Preamble::new(ConnectionKind::Server).encode().to_vec();
    encode_frame(
        &wanxfer_proto::handshake::hello(nonce, offered),
        &mut greeting,
    );
    let stream = wanxfer_engine::tls::accept(
        tcp,
        &tls,
        &greeting,
        wanxfer_engine::tls::Deadline::after(Duration::from_secs(30)),
        "client",
    )
    .ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut peer = RawPeer {
        stream,
        greeting: hello_placeholder(),
    };
    let mut preamble = [0u8; Preamble::LEN];
    peer.stream.read_exact(&mut preamble).ok()?;
    assert_eq!(Preamble::decode(&preamble).unwrap().kind, kind);
    Some(peer)
}

/// The data connection the client joins with, passing over early ones it closed unused.
fn rogue_join(listener: &std::net::TcpListener, nonce: [u8; 32]) -> (RawPeer, ChannelJoin) {
    for _ in 0..16 {
        let Some(mut data) = try_rogue_accept(listener, ConnectionKind::Data, nonce) else {
            continue;
        };
        match data.recv() {
            Some(Message::ChannelJoin(join)) => return (data, join),
            None => continue,
            Some(other) => panic!("expected ChannelJoin, got {other:?}"),
        }
    }
    panic!("no data connection joined")
}

/// A rogue server's control connection: the client authenticated properly, and its
/// request.
fn rogue_control(listener: &std::net::TcpListener) -> (RawPeer, Authenticated, OpenSession) {
    rogue_control_offering(listener, BEFORE_PULL_PIPELINE)
}

/// A server from before pipelined pulls: its session ids are its own, so a client's
/// data connections join only once the session is agreed, as these tests expect.
const BEFORE_PULL_PIPELINE: u64 = features::SUPPORTED & !features::PULL_PIPELINE;

/// [`rogue_control`] for a server offering `offered` features.
fn rogue_control_offering(
    listener: &std::net::TcpListener,
    offered: u64,
) -> (RawPeer, Authenticated, OpenSession) {
    use wanxfer_proto::handshake::ServerHandshake;
    let mut control =
        try_rogue_accept_offering(listener, ConnectionKind::Control, [9; 32], offered)
            .expect("the client's connection");
    let mut handshake = ServerHandshake::new(SECRET.as_bytes(), [9; 32], offered);
    handshake.set_binding(control.stream.binding());
    let auth = loop {
        match handshake.handle(control.recv().unwrap()).unwrap() {
            Step::Wait => {}
            Step::Send(reply) => control.send(&reply),
            Step::SendAndDone(reply, auth) => {
                control.send(&reply);
                break auth;
            }
            Step::Done(auth) => break auth,
        }
    };
    let Some(Message::OpenSession(open)) = control.recv() else {
        panic!("expected OpenSession");
    };
    (control, auth, open)
}

/// What an honest server answers `open` with (one stream).
fn honest_answer(open: &OpenSession) -> SessionAccepted {
    SessionAccepted {
        session_id: [3u8; 16],
        streams: 1,
        block_size: open.block_size,
        depth: open.depth,
        window: open.window,
        flags: open.flags,
        max_streams: 1,
        placement: Placement::Resolve,
    }
}

/// A hand-driven server for one pull: it authenticates the client properly, accepts its
/// session and data channel, then hands both connections to `play`. Returns the address
/// to pull from and the server's thread, which carries `play`'s panics.
fn rogue_server(
    play: impl FnOnce(RawPeer, RawPeer, SessionAccepted) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    use std::net::TcpListener;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut control, auth, open) = rogue_control(&listener);
        let accepted = honest_answer(&open);
        control.send(&Message::SessionAccepted(accepted.clone()));
        let (mut data, join) = rogue_join(&listener, [11; 32]);
        assert!(auth.verify_channel(
            &accepted.session_id,
            join.index,
            &[11; 32],
            &data.stream.binding(),
            &join.proof
        ));
        data.send(&Message::ChannelAccepted { index: join.index });
        play(control, data, accepted);
    });
    (addr, server)
}

/// A rogue server that announces `entries` (as a frame forged by `forge`) and holds the
/// connections until the client hangs up.
fn announcing_server(entries: Vec<Entry>, forge: Option<(&'static [u8], &'static [u8])>) -> String {
    let (addr, _server) = rogue_server(move |mut control, data, _| {
        let manifest = Message::Manifest(Manifest {
            first_id: 0,
            entries,
        });
        match forge {
            Some((from, to)) => control.send_raw(&forged_frame(&manifest, from, to)),
            None => control.send(&manifest),
        }
        // Hold the connections until the client hangs up.
        let _ = control.recv();
        drop(data);
    });
    addr
}

#[test]
fn a_pulling_client_accepts_only_what_it_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("dest");
    fs::create_dir(&dest).unwrap();
    for (entries, forge, needle) in [
        (vec![file_entry("unasked", 4)], None, "unasked"),
        (
            vec![file_entry("wanted/xx/xx/evil", 4)],
            Some((&b"wanted/xx/xx/evil"[..], &b"wanted/../../evil"[..])),
            "evil",
        ),
        (
            vec![file_entry("xevil", 4)],
            Some((&b"xevil"[..], &b"/evil"[..])),
            "evil",
        ),
    ] {
        let addr = announcing_server(entries, forge);
        let run = cp([
            "--retries=0".to_string(),
            format!("wanxfer://{addr}/wanted"),
            dest.to_str().unwrap().to_string(),
        ]);
        assert_ne!(run.code, 0, "{run:#?}");
        run.assert_stderr_mentions(needle);
        assert!(snapshot(dir.path()).keys().all(|k| k == b"dest"));
    }
}

/// The pulling client's side of `a_wrong_file_digest_keeps_the_file_from_its_final_name`:
/// the same sink, so the same verdicts, and the exit status and JSON report the failed
/// files the way they report any failed file.
#[test]
fn a_pulling_client_fails_only_the_files_whose_digest_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("dest");
    fs::create_dir(&dest).unwrap();
    let (addr, server) = rogue_server(|mut control, mut data, accepted| {
        announce(&mut control, DigestTrial::entries());
        DigestTrial::send_blocks(&mut data, &accepted);
        DigestTrial::expect_verdicts(&mut control);
        match control.recv() {
            Some(Message::Finish) => {}
            other => panic!("expected Finish, got {other:?}"),
        }
        control.send(&Message::Stats(Stats::default()));
        // Hold the connections until the client hangs up.
        let _ = control.recv();
    });
    let run = cp([
        "--json".to_string(),
        "--retries=0".to_string(),
        format!("wanxfer://{addr}/wanted"),
        dest.to_str().unwrap().to_string(),
    ]);
    let server = server.join();
    assert!(
        server.is_ok(),
        "the rogue server saw what it expected: {run:#?}"
    );
    run.assert_code(6).assert_stderr_mentions("2 files failed");
    let json = run.json();
    assert_eq!(json["exit_code"], 6, "{json}");
    let error = json["error"].as_str().unwrap();
    assert!(error.contains("do not match the checksum"), "{json}");
    DigestTrial::assert_landed(&dest);
}

/// A connection carrying remote operations, driven by hand: paths forged past the
/// encoder (`..`, absolute) are refused by the decoder, an operation's failure leaves the
/// connection usable, and anything but an operation after one ends the connection. The
/// server serves on, and nothing outside its root is touched.
#[test]
fn forged_operations_are_refused_and_the_server_serves_on() {
    use wanxfer_proto::ops::{OpReply, OpRequest, RemoveMode};
    let mut site = Site::new();
    fs::write(site.root().join("kept"), b"k").unwrap();
    let forge = |placeholder: &[u8], evil: &[u8]| {
        let msg = Message::OpRequest(OpRequest::Remove {
            path: RelPath::new(placeholder).unwrap(),
            mode: RemoveMode::Recursive,
        });
        forged_frame(&msg, placeholder, evil)
    };
    for (placeholder, evil) in [(&b"xx/kept"[..], &b"../kept"[..]), (b"xxxxx", b"/root")] {
        let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
        peer.send_raw(&forge(placeholder, evil));
        peer.expect_refusal(Some("path"));
    }
    // Refused operations answer and the connection goes on; a session request on it
    // does not.
    let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
    peer.send(&Message::OpRequest(OpRequest::Stat {
        path: RelPath::new(b"missing").unwrap(),
    }));
    match peer.recv() {
        Some(Message::OpReply(OpReply::Error(e))) => {
            assert!(String::from_utf8_lossy(&e.message).contains("no such file"))
        }
        other => panic!("expected an operation error, got {other:?}"),
    }
    peer.send(&Message::OpRequest(OpRequest::Stat {
        path: RelPath::new(b"kept").unwrap(),
    }));
    assert!(matches!(
        peer.recv(),
        Some(Message::OpReply(OpReply::Meta(_)))
    ));
    peer.send(&Message::OpenSession(push_request("x")));
    peer.expect_refusal(Some("expected an operation"));
    assert_eq!(fs::read(site.root().join("kept")).unwrap(), b"k");
    site.assert_unharmed();
}

/// Issue 16 items 3 and 10: failed authentications are rate limited per address. After
/// ten wrong secrets from one address, the next attempt from it (even with the right
/// secret) is turned away, and told why rather than that the secrets differ; another
/// address gets in meanwhile, and the server logs the refusal.
#[test]
fn repeated_wrong_secrets_are_turned_away_while_other_addresses_get_in() {
    let site = Site::new();
    let src = site.path("f");
    fs::write(&src, b"data").unwrap();
    for _ in 0..10 {
        cp_with_secret(
            "a-wrong-secret-of-decent-length-0123456789",
            [
                "--retries=0".as_ref(),
                src.as_os_str(),
                &site.server.url("f"),
            ],
        )
        .assert_code(3)
        .assert_stderr_mentions("secret");
    }
    cp([
        "--retries=0".as_ref(),
        src.as_os_str(),
        &site.server.url("f"),
    ])
    .assert_code(3)
    .assert_stderr_mentions("too many failed authentications");
    let (_peer, _) = RawPeer::authenticate_from(
        &site.server,
        SECRET,
        Some(std::net::Ipv4Addr::new(127, 0, 0, 2)),
    );
    assert!(!site.root().join("f").exists());
    let log = site.server.log();
    assert!(log.contains("turned away"), "{log}");
}

/// Issue 16 item 6: a client that authenticates, opens a push session, announces a large
/// file and sends one block of it (so the server reserves the file's whole size), then
/// goes silent, is ended by the server within its stall timeout (a few seconds more at
/// most), which frees its session slot (one session allowed) and gives back the space it
/// reserved beyond what it verified: a file nearly the size of the file system then lands.
#[test]
fn an_idle_authenticated_session_is_ended_and_gives_back_its_slot_and_space() {
    let flags = ["--stall-timeout", "2", "--max-sessions", "1"];
    ended_session_gives_back_its_slot_and_space(&flags, false, "stall-timeout");
}

/// Issue 16 item 6, the live variant: the same client keeps its control connection alive
/// with keepalives (as a stuck client would) but moves nothing; the progress timeout
/// (`--idle-timeout`), not the stall timeout, ends it and gives everything back.
#[test]
fn a_session_kept_alive_without_progress_is_ended_by_the_idle_timeout() {
    let flags = [
        "--stall-timeout",
        "60",
        "--idle-timeout",
        "3s",
        "--max-sessions",
        "1",
    ];
    ended_session_gives_back_its_slot_and_space(&flags, true, "idle-timeout");
}

/// Opens a push session that reserves most of a small file system, sends one block, then
/// moves nothing (sending `keepalives` or not); the server must end it, free its one
/// session slot and give back the reserved space, saying why (`log_mentions`) in its log.
fn ended_session_gives_back_its_slot_and_space(
    flags: &[&str],
    keepalives: bool,
    log_mentions: &str,
) {
    let Some(site) = Site::on_mount("tmpfs", "size=64m", flags) else {
        return;
    };
    let root = site.root().to_path_buf();
    let before = free_bytes(&root);
    let (mut control, mut data, accepted) =
        session_ready_for_blocks(&site, vec![file_entry("hog", 48 << 20)]);
    let payload = pattern_bytes(1 << 20, 1);
    let first = Segment {
        file_id: 0,
        offset: 0,
        len: payload.len() as u32,
        flags: 0,
        digest: digest_of(&payload),
    };
    data.send_raw(&block(&accepted, first, &payload, false));
    wait_for(
        "the server to reserve the file's size",
        Duration::from_secs(30),
        || free_bytes(&root) + (40 << 20) < before,
    );
    // Meanwhile the one slot is taken.
    let probe = site.path("probe");
    fs::write(&probe, b"p").unwrap();
    cp([
        "--retries=0".as_ref(),
        probe.as_os_str(),
        &site.server.url("probe"),
    ])
    .assert_code(8)
    .assert_stderr_mentions("busy");

    let silent = std::time::Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let keeper = keepalives.then(|| {
        let mut alive = control.stream.try_clone().unwrap();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut frame = Vec::new();
            encode_frame(&Message::Keepalive, &mut frame);
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && alive.write_all(&frame).is_ok()
            {
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    });
    while let Some(msg) = control.recv() {
        // The server's status every second (this client offers SESSION_STATUS) moves
        // nothing, so it must not keep the session alive either.
        assert!(
            matches!(msg, Message::Error(_) | Message::SessionStatus(_)),
            "unexpected {msg:?}"
        );
    }
    let waited = silent.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(keeper) = keeper {
        keeper.join().unwrap();
    }
    assert!(waited < Duration::from_secs(20), "ended after {waited:?}");
    wait_for(
        "the reservation to be given back",
        Duration::from_secs(20),
        || free_bytes(&root) + (4 << 20) > before,
    );
    let big = site.path("big");
    write_pattern(&big, 40 << 20, 3);
    // (Retries cover the moment between the session's end and its slot being free.)
    cp([
        "--retries=3".as_ref(),
        big.as_os_str(),
        &site.server.url("big"),
    ])
    .assert_ok();
    assert_eq!(node(&big), node(&root.join("big")));
    let log = site.server.log();
    assert!(log.contains(log_mentions), "{log}");
    drop((control, data));
}

/// A rogue server that answers a session request with what `answer` makes of an honest
/// answer, then waits for the client to hang up (it must neither join a data channel nor
/// wait).
fn answering_server(
    answer: impl FnOnce(SessionAccepted) -> SessionAccepted + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut control, _, open) = rogue_control(&listener);
        control.send(&Message::SessionAccepted(answer(honest_answer(&open))));
        while let Some(msg) = control.recv() {
            assert!(matches!(msg, Message::Error(_)), "unexpected {msg:?}");
        }
    });
    (addr, server)
}

/// Issue 16 item 7: the client checks every number the server answers against what it
/// asked: a block of 0 bytes or of 4 GiB, no streams or 65,535 of them, absurd depths and
/// windows, checks turned off. Each is a protocol error (exit 5) naming the number, at once,
/// without a hang or a large allocation.
#[test]
fn a_client_refuses_numbers_it_did_not_ask_for() {
    let dir = tempfile::tempdir().unwrap();
    type Bend = fn(SessionAccepted) -> SessionAccepted;
    let cases: [(&str, Bend); 11] = [
        ("block size", |a| SessionAccepted { block_size: 0, ..a }),
        ("block size", |a| SessionAccepted {
            block_size: 0xffff_f000, // 4 GiB less a page: aligned, and absurd
            ..a
        }),
        ("block size", |a| SessionAccepted {
            block_size: (1 << 20) + 1,
            ..a
        }),
        ("streams", |a| SessionAccepted { streams: 0, ..a }),
        ("streams", |a| SessionAccepted {
            streams: u16::MAX,
            max_streams: u16::MAX,
            ..a
        }),
        ("depth", |a| SessionAccepted { depth: 0, ..a }),
        ("depth", |a| SessionAccepted {
            depth: u16::MAX,
            ..a
        }),
        ("window", |a| SessionAccepted { window: 0, ..a }),
        ("window", |a| SessionAccepted {
            window: u32::MAX,
            ..a
        }),
        ("at most", |a| SessionAccepted {
            max_streams: 0,
            ..a
        }),
        ("checks", |a| SessionAccepted {
            flags: a.flags | wanxfer_proto::session_flags::NO_FILE_DIGEST,
            ..a
        }),
    ];
    for (needle, bend) in cases {
        let (addr, server) = answering_server(bend);
        let dest = dir.path().join("dest");
        let cmd = cp_command([
            "--retries=0".to_string(),
            format!("wanxfer://{addr}/wanted"),
            dest.to_str().unwrap().to_string(),
        ]);
        let (run, peak_kib) = run_measured(cmd, Duration::from_secs(60));
        assert!(
            server.join().is_ok(),
            "the rogue server saw a hang-up: {run:#?}"
        );
        run.assert_code(5)
            .assert_stderr_mentions("the server")
            .assert_stderr_mentions(needle);
        assert!(peak_kib < 64 << 10, "{needle}: peak RSS {peak_kib} KiB");
        assert!(!dest.exists());
    }
}

/// Issue 20: a pull's selection comes from the peer, so the server bounds and checks it
/// before it lists anything: too many rules, a pattern that is no glob, and a selection
/// on a push (where the client lists) are each refused, and the server serves on.
#[test]
fn a_peer_sending_a_selection_it_may_not_is_refused() {
    let site = Site::new();
    fs::create_dir_all(site.root().join("data")).unwrap();
    fs::write(site.root().join("data/f"), b"x").unwrap();
    let pull = |selection: wanxfer_proto::Selection| OpenSession {
        direction: Direction::Pull,
        paths: vec![RelPath::new(b"data").unwrap()],
        selection,
        ..push_request("")
    };
    let rule = |pattern: &[u8]| wanxfer_proto::SelectRule {
        include: false,
        pattern: pattern.to_vec(),
    };
    // More rules than the limit: the encoder does not stop a hostile peer.
    let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
    peer.send(&Message::OpenSession(pull(wanxfer_proto::Selection {
        rules: vec![rule(b"*.tmp"); wanxfer_proto::MAX_SELECT_RULES + 1],
        files: None,
    })));
    peer.expect_refusal(None);

    let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
    peer.send(&Message::OpenSession(pull(wanxfer_proto::Selection {
        rules: vec![rule(b"a[")],
        files: None,
    })));
    peer.expect_refusal(Some("pattern \"a[\""));

    let (mut peer, _) = RawPeer::authenticate(&site.server, SECRET);
    peer.send(&Message::OpenSession(OpenSession {
        selection: wanxfer_proto::Selection {
            rules: vec![rule(b"*")],
            files: None,
        },
        ..push_request("pushed")
    }));
    peer.expect_refusal(Some("selection"));
    assert!(!site.root().join("pushed").exists());

    // Still serving, and a pull with a good selection works.
    let back = site.path("back");
    cp([
        std::ffi::OsString::from("--exclude"),
        "g".into(),
        site.server.url("data"),
        back.clone().into(),
    ])
    .assert_ok();
    assert_eq!(fs::read(back.join("f")).unwrap(), b"x");
}
