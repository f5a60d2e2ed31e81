//! Provider discovery and connection-level operations.

mod common;

use std::io::IoSlice;
use std::thread;

use wanxfer_fabric::{
    Access, AlignedBuf, Completion, ConnConfig, Connection, Error, FabricConfig, Listener,
};

#[test]
fn unknown_provider_is_reported_as_unavailable() {
    let cfg = FabricConfig::with_provider("no-such-provider");
    let err = Listener::bind(&cfg, common::loopback())
        .err()
        .expect("must fail");
    match &err {
        Error::ProviderUnavailable { requested, .. } => {
            assert_eq!(requested.as_deref(), Some("no-such-provider"));
        }
        other => panic!("expected ProviderUnavailable, got {other:?}"),
    }
    assert!(err.to_string().contains("no-such-provider"), "{err}");
    let dial = Connection::connect(
        &cfg,
        "127.0.0.1:9".parse().expect("addr"),
        &ConnConfig::default(),
        None,
    );
    assert!(matches!(dial, Err(Error::ProviderUnavailable { .. })));
}

#[test]
fn connecting_to_nobody_fails_cleanly() {
    let Some(fabric) = common::tcp() else { return };
    // Bind then drop a listener to get a port nobody listens on.
    let addr = Listener::bind(&fabric, common::loopback())
        .expect("bind")
        .local_addr();
    let result = Connection::connect(
        &fabric,
        addr,
        &ConnConfig::default(),
        Some(std::time::Duration::from_secs(20)),
    );
    assert!(
        matches!(
            result,
            Err(Error::ConnectFailed { .. } | Error::Fabric { .. })
        ),
        "got {:?}",
        result.err()
    );
}

fn conn_pair(fabric: &FabricConfig) -> (Connection, Connection) {
    let mut listener = Listener::bind(fabric, common::loopback()).expect("bind");
    assert!(
        listener.local_addr().port() != 0,
        "a real port was assigned"
    );
    let addr = listener.local_addr();
    let acceptor = thread::spawn(move || listener.accept(&ConnConfig::default(), None));
    let connector =
        Connection::connect(fabric, addr, &ConnConfig::default(), None).expect("connect");
    (
        acceptor.join().expect("accept thread").expect("accept"),
        connector,
    )
}

/// Waits until `n` completions arrived.
fn collect(conn: &mut Connection, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    while out.len() < n {
        conn.wait(None, &mut out).expect("wait");
    }
    out
}

#[test]
fn every_completion_kind_reaches_the_caller() {
    let Some(fabric) = common::tcp() else { return };
    let (mut a, mut b) = conn_pair(&fabric);
    b.send(b"ping", 11).expect("send");
    b.send(b"pong", 12).expect("send");
    let pool = a
        .register(AlignedBuf::new(4096), Access::REMOTE_WRITE)
        .expect("pool");
    let target = pool.remote_slot(1024, 1024).expect("slot");
    let src = b
        .register(vec![9u8; 300], Access::WRITE_SOURCE)
        .expect("src");
    let iov = [
        IoSlice::new(&src.as_slice()[..100]),
        IoSlice::new(&src.as_slice()[100..]),
    ];
    b.write(&iov, target, Some(0xfeed), 13).expect("write");

    let mut local: Vec<String> = collect(&mut b, 3)
        .iter()
        .map(|c| format!("{c:?}"))
        .collect();
    local.sort();
    assert_eq!(
        local,
        [
            "Sent { user: 11 }",
            "Sent { user: 12 }",
            "Written { user: 13 }"
        ]
    );

    let remote = collect(&mut a, 3);
    assert!(
        matches!(&remote[0], Completion::Received { data, .. } if data == b"ping"),
        "{remote:?}"
    );
    assert!(
        matches!(&remote[1], Completion::Received { data, .. } if data == b"pong"),
        "{remote:?}"
    );
    // The length is the provider's to report (tcp reports none), so only
    // the CQ data is checked here; the bytes are checked below.
    assert!(
        matches!(remote[2], Completion::RemoteWrite { imm: 0xfeed, .. }),
        "{remote:?}"
    );
    assert!(pool.as_slice()[1024..1324].iter().all(|&x| x == 9));
    assert!(pool.as_slice()[1324..].iter().all(|&x| x == 0));
}

#[test]
fn remote_slot_bounds_and_access_are_checked() {
    let Some(fabric) = common::tcp() else { return };
    let (mut a, _b) = conn_pair(&fabric);
    let local = a
        .register(vec![0u8; 100], Access::WRITE_SOURCE)
        .expect("reg");
    assert!(
        local.remote_slot(0, 10).is_err(),
        "no remote access granted"
    );
    let pool = a
        .register(vec![0u8; 100], Access::REMOTE_WRITE)
        .expect("reg");
    assert!(pool.remote_slot(90, 11).is_err());
    assert_eq!(pool.remote_slot(90, 10).expect("fits").len, 10);
}
