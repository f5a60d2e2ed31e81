//! Remote operations over a real connection to an in-process server: the hook in the
//! server's connection set-up, several requests on one connection, a listing in many
//! pages, refusals that leave the connection usable, and a connection the server closed
//! for idling, which the client notices before reusing it.

use std::fs;
use std::time::Duration;

use wanxfer_engine::ops::{hex, Client};
use wanxfer_engine::pool::Cancel;
use wanxfer_engine::session::{ClientConfig, Server, ServerLimits, Tuning};
use wanxfer_engine::Error;
use wanxfer_proto::ops::{ChecksumAlgorithm, NodeKind, OpFailure, RemoveMode};
use wanxfer_proto::RelPath;

const SECRET: &[u8] = b"ops-connection-test-secret";

fn rel(s: &str) -> RelPath {
    RelPath::new(s.as_bytes()).unwrap()
}

/// A server on loopback serving a fresh directory, left running for the test's life.
fn serve(limits: ServerLimits) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::bind("127.0.0.1:0", dir.path(), Some(SECRET.to_vec()), limits).unwrap();
    let addr = server.local_addr().unwrap().to_string();
    std::thread::spawn(move || server.serve(&Cancel::default()));
    (dir, addr)
}

fn config(addr: &str, secret: &[u8]) -> ClientConfig {
    let tuning = Tuning {
        stall_timeout: Duration::from_secs(20),
        ..Tuning::default()
    };
    let mut cfg = ClientConfig::new(addr.to_string(), secret.to_vec(), tuning);
    cfg.connect_timeout = Duration::from_secs(5);
    // Pins of the servers' certificates, apart from the user's own.
    cfg.state_dir =
        std::env::temp_dir().join(format!("wanxfer-ops-test-state-{}", std::process::id()));
    cfg
}

#[test]
fn one_connection_carries_many_operations_and_survives_refusals() {
    let (dir, addr) = serve(ServerLimits::default());
    fs::write(dir.path().join("f"), b"Wikipedia").unwrap();
    let mut c = Client::connect(&config(&addr, SECRET)).unwrap();
    assert_eq!(c.stat(&rel("f")).unwrap().size, 9);
    c.mkdir(&rel("a/b"), true, 0o755).unwrap();
    let refused = c.mkdir(&rel("a"), false, 0o755);
    assert!(
        matches!(
            refused,
            Err(Error::Op {
                failure: OpFailure::Exists,
                ..
            })
        ),
        "{refused:?}"
    );
    c.rename(&rel("f"), &rel("a/b/f")).unwrap();
    let sum = c
        .checksum(&rel("a/b/f"), ChecksumAlgorithm::Adler32)
        .unwrap();
    assert_eq!(hex(&sum), "11e60398");
    let mut seen = Vec::new();
    c.list(&RelPath::root(), true, true, |e| {
        seen.push((e.path.to_string(), e.kind));
        Ok(())
    })
    .unwrap();
    seen.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        seen,
        [
            ("a".to_string(), NodeKind::Dir),
            ("a/b".to_string(), NodeKind::Dir),
            ("a/b/f".to_string(), NodeKind::File)
        ]
    );
    let missing = c.stat(&rel("nope"));
    assert!(
        matches!(
            missing,
            Err(Error::Op {
                failure: OpFailure::NotFound,
                ..
            })
        ),
        "{missing:?}"
    );
    c.remove(&rel("a"), RemoveMode::Recursive).unwrap();
    assert!(c.is_usable());
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn a_large_listing_arrives_page_by_page() {
    let (dir, addr) = serve(ServerLimits::default());
    fs::create_dir(dir.path().join("many")).unwrap();
    for i in 0..9000 {
        fs::File::create(dir.path().join(format!("many/{i:04}"))).unwrap();
    }
    let mut c = Client::connect(&config(&addr, SECRET)).unwrap();
    c.start_list(&rel("many"), false, false).unwrap();
    let mut pages = 0;
    let mut entries = 0;
    while let Some(page) = c.next_page().unwrap() {
        pages += 1;
        entries += page.len();
    }
    assert_eq!(entries, 9000);
    assert!(pages >= 3, "{pages} pages");
    // The connection is back to taking requests.
    assert_eq!(c.stat(&rel("many")).unwrap().kind, NodeKind::Dir);
}

#[test]
fn a_wrong_secret_is_an_authentication_error() {
    let (_dir, addr) = serve(ServerLimits::default());
    let err = Client::connect(&config(&addr, b"not the secret")).unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err:?}");
}

#[test]
fn a_connection_closed_for_idling_is_not_reused() {
    let limits = ServerLimits {
        stall_timeout: Duration::from_millis(300),
        ..ServerLimits::default()
    };
    let (_dir, addr) = serve(limits);
    let mut c = Client::connect(&config(&addr, SECRET)).unwrap();
    c.stat(&RelPath::root()).unwrap();
    assert!(c.is_usable());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.is_usable() {
        assert!(
            std::time::Instant::now() < deadline,
            "the server never closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server that authenticates, reads one operation and answers it with `replies`, as a
/// slow or broken server would: the client's side of the protocol, without the
/// executor's timing.
fn scripted_server(replies: Vec<wanxfer_proto::ops::OpReply>) -> String {
    use std::io::{Read, Write};
    use wanxfer_proto::handshake::{ServerHandshake, Step};
    use wanxfer_proto::{encode_frame, features, ConnectionKind, FrameHeader, Message, Preamble};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        use wanxfer_engine::stream::Stream;
        let read = |s: &mut Stream| {
            let mut header = [0u8; FrameHeader::LEN];
            s.read_exact(&mut header).unwrap();
            let h = FrameHeader::decode(&header).unwrap();
            let mut body = vec![0u8; h.len as usize];
            s.read_exact(&mut body).unwrap();
            Message::decode(h.kind, &body).unwrap()
        };
        let send = |s: &mut Stream, m: &Message| {
            let mut out = Vec::new();
            encode_frame(m, &mut out);
            s.write_all(&out).unwrap();
        };
        // The server greets first, in TLS's first flight: its preamble and Hello.
        let mut hs = ServerHandshake::new(SECRET, [9; 32], features::SUPPORTED);
        let mut greeting = Preamble::new(ConnectionKind::Server).encode().to_vec();
        encode_frame(&hs.hello(), &mut greeting);
        let tls = wanxfer_engine::tls::ServerIdentity::ephemeral()
            .and_then(|identity| identity.server_config())
            .unwrap();
        let (tcp, _) = listener.accept().unwrap();
        let mut s = wanxfer_engine::tls::accept(
            tcp,
            &tls,
            &greeting,
            wanxfer_engine::tls::Deadline::after(Duration::from_secs(30)),
            "client",
        )
        .unwrap();
        hs.set_binding(s.binding());
        let mut preamble = [0u8; Preamble::LEN];
        s.read_exact(&mut preamble).unwrap();
        loop {
            match hs.handle(read(&mut s)).unwrap() {
                Step::Wait => {}
                Step::Send(m) => send(&mut s, &m),
                Step::SendAndDone(m, _) => {
                    send(&mut s, &m);
                    break;
                }
                Step::Done(_) => break,
            }
        }
        assert!(matches!(read(&mut s), Message::OpRequest(_)));
        for reply in replies {
            send(&mut s, &Message::OpReply(reply));
        }
        // Hold the connection until the client is done with it.
        let _ = s.read(&mut [0u8; 1]);
    });
    addr
}

#[test]
fn progress_frames_are_waited_through_and_a_mismatched_reply_is_refused() {
    use wanxfer_proto::ops::OpReply;
    let digest = vec![0, 0, 0, 1];
    let addr = scripted_server(vec![
        OpReply::Progress { done: 1 << 20 },
        OpReply::Progress { done: 2 << 20 },
        OpReply::Checksum {
            algorithm: ChecksumAlgorithm::Adler32,
            digest: digest.clone(),
        },
    ]);
    let mut c = Client::connect(&config(&addr, SECRET)).unwrap();
    assert_eq!(
        c.checksum(&rel("f"), ChecksumAlgorithm::Adler32).unwrap(),
        digest
    );

    // A checksum of another algorithm than asked is a protocol error, and the connection
    // is not offered for reuse.
    let addr = scripted_server(vec![OpReply::Checksum {
        algorithm: ChecksumAlgorithm::Crc32c,
        digest: vec![0; 4],
    }]);
    let mut c = Client::connect(&config(&addr, SECRET)).unwrap();
    let err = c
        .checksum(&rel("f"), ChecksumAlgorithm::Adler32)
        .unwrap_err();
    assert!(matches!(err, Error::Protocol { .. }), "{err:?}");
    assert!(!c.is_usable());
}
