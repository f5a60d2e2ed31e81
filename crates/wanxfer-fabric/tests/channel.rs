//! Channel-level behaviour over libfabric's tcp provider on 127.0.0.1.

mod common;

use std::io::IoSlice;
use std::thread;
use std::time::Duration;

use wanxfer_fabric::{Access, AlignedBuf, ChannelConfig, Error, Event};

#[test]
fn listen_connect_accept_reports_provider() {
    let Some(fabric) = common::tcp() else { return };
    let (a, b) = common::pair(&fabric, &ChannelConfig::default());
    for ch in [&a, &b] {
        let info = ch.provider();
        assert_eq!(info.provider, "tcp");
        assert!(
            !info.fabric.is_empty() && !info.domain.is_empty(),
            "{info:?}"
        );
    }
}

#[test]
fn control_messages_both_ways_beyond_the_window() {
    let Some(fabric) = common::tcp() else { return };
    // A window of 2 forces acknowledgements to flow many times over.
    let cfg = ChannelConfig {
        ctrl_credits: 2,
        ctrl_max_len: 300,
        ..Default::default()
    };
    let (mut a, mut b) = common::pair(&fabric, &cfg);
    const N: usize = 200;
    let msg =
        |from: u8, i: usize| -> Vec<u8> { (0..i % 300).map(|j| from ^ (i + j) as u8).collect() };
    let peer = thread::spawn(move || {
        for i in 0..N {
            b.send_control(&msg(0xb0, i)).expect("b sends");
        }
        let got: Vec<_> = (0..N).map(|_| b.wait(None).expect("b waits")).collect();
        (b, got)
    });
    for i in 0..N {
        a.send_control(&msg(0xa0, i)).expect("a sends");
    }
    let got_a: Vec<_> = (0..N).map(|_| a.wait(None).expect("a waits")).collect();
    let (b, got_b) = peer.join().expect("peer thread panicked");
    for i in 0..N {
        assert_eq!(
            got_a[i],
            Some(Event::Control(msg(0xb0, i))),
            "a's message {i}"
        );
        assert_eq!(
            got_b[i],
            Some(Event::Control(msg(0xa0, i))),
            "b's message {i}"
        );
    }
    drop((a, b));
}

#[test]
fn oversized_control_message_is_refused() {
    let Some(fabric) = common::tcp() else { return };
    let cfg = ChannelConfig {
        ctrl_max_len: 64,
        ..Default::default()
    };
    let (_a, mut b) = common::pair(&fabric, &cfg);
    assert!(matches!(
        b.send_control(&[0; 65]),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn gather_write_lands_intact_in_the_granted_slot() {
    let Some(fabric) = common::tcp() else { return };
    let (mut rx, mut tx) = common::pair(&fabric, &ChannelConfig::default());
    const SLOT: usize = 8192;
    let pool = rx
        .register(AlignedBuf::new(4 * SLOT), Access::REMOTE_WRITE)
        .expect("pool");
    rx.set_slot_pool(pool, SLOT).expect("set pool");
    rx.grant(2).expect("grant");

    let header = tx
        .register(b"HEADER:block-0042".to_vec(), Access::WRITE_SOURCE)
        .expect("header");
    let payload_bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    let payload = tx
        .register(payload_bytes.clone(), Access::WRITE_SOURCE)
        .expect("payload");
    let credit = match tx.wait(None).expect("credit") {
        Some(Event::Credit(c)) => c,
        other => panic!("expected a credit, got {other:?}"),
    };
    assert_eq!(credit.slot, 2);
    assert_eq!(credit.remote.len, SLOT as u64);
    if tx.provider().mr_mode & u64::from(libfabric_sys_mr_virt_addr()) == 0 {
        assert_eq!(credit.remote.addr, 2 * SLOT as u64, "offset addressing");
    }
    let iov = [
        IoSlice::new(header.as_slice()),
        IoSlice::new(payload.as_slice()),
    ];
    tx.write_block(&iov, credit).expect("write_block");
    assert_eq!(
        tx.wait(None).expect("completion"),
        Some(Event::WriteComplete { slot: 2 })
    );

    let total = header.len() + payload.len();
    assert_eq!(
        rx.wait(None).expect("arrival"),
        Some(Event::BlockArrived {
            slot: 2,
            len: total
        })
    );
    let slot = rx.slot(2).expect("slot 2");
    assert_eq!(&slot[..header.len()], header.as_slice());
    assert_eq!(&slot[header.len()..total], &payload_bytes[..]);
    assert!(
        slot[total..].iter().all(|&b| b == 0),
        "nothing written past the block"
    );
    for other in [0, 1, 3] {
        assert!(
            rx.slot(other).expect("slot").iter().all(|&b| b == 0),
            "slot {other} untouched"
        );
    }
}

/// FI_MR_VIRT_ADDR as the channel's users see it (kept here so the test
/// does not depend on the sys crate directly).
fn libfabric_sys_mr_virt_addr() -> u32 {
    1 << 4
}

#[test]
fn ten_thousand_small_writes_cycle_four_slots() {
    let Some(fabric) = common::tcp() else { return };
    let cfg = ChannelConfig {
        ctrl_credits: 4,
        max_grants: 4,
        max_writes: 4,
        ..Default::default()
    };
    common::transfer(&fabric, &cfg, 4, 100, 10_000, None);
}

#[test]
fn slow_receiver_withholding_credits_makes_the_sender_wait() {
    let Some(fabric) = common::tcp() else { return };
    let cfg = ChannelConfig {
        ctrl_credits: 2,
        max_grants: 2,
        ..Default::default()
    };
    common::transfer(
        &fabric,
        &cfg,
        2,
        32 * 1024,
        60,
        Some(Duration::from_millis(20)),
    );
}

#[test]
fn blocks_announced_by_message_when_cq_data_is_off() {
    let Some(mut fabric) = common::tcp() else {
        return;
    };
    fabric.disable_remote_cq_data = true;
    let cfg = ChannelConfig {
        ctrl_credits: 3,
        max_grants: 3,
        ..Default::default()
    };
    let (rx, _tx) = common::pair(&fabric, &cfg);
    assert!(
        !rx.uses_cq_data(),
        "the message path is what this test is for"
    );
    drop(rx);
    common::transfer(&fabric, &cfg, 3, 4000, 2_000, None);
}

#[test]
fn peer_disconnect_is_a_clear_error() {
    let Some(fabric) = common::tcp() else { return };
    let (mut a, b) = common::pair(&fabric, &ChannelConfig::default());
    drop(b);
    let err = a.wait(None).expect_err("the peer is gone");
    assert!(matches!(err, Error::Disconnected { .. }), "got {err:?}");
    assert!(
        a.send_control(b"anyone?").is_err(),
        "sending on a dead channel fails"
    );
}

#[test]
fn sender_waiting_for_credit_sees_receiver_vanish() {
    let Some(fabric) = common::tcp() else { return };
    let (rx, mut tx) = common::pair(&fabric, &ChannelConfig::default());
    let waiter = thread::spawn(move || tx.wait(None));
    thread::sleep(Duration::from_millis(50));
    drop(rx);
    let result = waiter.join().expect("waiter thread panicked");
    assert!(
        matches!(result, Err(Error::Disconnected { .. })),
        "got {result:?}"
    );
}

#[test]
fn teardown_closes_every_registration() {
    let Some(fabric) = common::tcp() else { return };
    let (mut rx, mut tx) = common::pair(&fabric, &ChannelConfig::default());
    let (rx_regs, tx_regs) = (rx.registrations(), tx.registrations());
    let internal = rx_regs.live();
    assert!(internal > 0, "internal buffers are registered and counted");

    let pool = rx
        .register(AlignedBuf::new(2 * 4096), Access::REMOTE_WRITE)
        .expect("pool");
    rx.set_slot_pool(pool.clone(), 4096).expect("set pool");
    let mut raw = vec![7u8; 4096];
    // SAFETY: `raw` outlives `tx` (dropped below, before `raw`) and is not
    // written while registered.
    let first =
        unsafe { tx.register_raw(raw.as_mut_ptr(), raw.len(), Access::WRITE_SOURCE) }.expect("raw");
    // SAFETY: as above; a sub-range of the same buffer.
    let again = unsafe { tx.register_raw(raw.as_mut_ptr().add(100), 200, Access::WRITE_SOURCE) }
        .expect("raw");
    assert_eq!(
        first.key(),
        again.key(),
        "the cache reuses the registration"
    );
    assert_eq!(
        tx_regs.live(),
        internal + 1,
        "one registration for both calls"
    );

    rx.grant(0).expect("grant");
    let credit = match tx.wait(None).expect("credit") {
        Some(Event::Credit(c)) => c,
        other => panic!("expected a credit, got {other:?}"),
    };
    tx.write_block(&[IoSlice::new(&raw[..])], credit)
        .expect("write");
    assert_eq!(
        tx.wait(None).expect("done"),
        Some(Event::WriteComplete { slot: 0 })
    );
    assert_eq!(
        rx.wait(None).expect("arrival"),
        Some(Event::BlockArrived { slot: 0, len: 4096 })
    );
    assert!(rx.slot(0).expect("slot").iter().all(|&b| b == 7));

    drop((first, again, tx));
    assert_eq!(tx_regs.live(), 0, "sender side closed everything");
    drop(rx);
    assert_eq!(
        rx_regs.live(),
        1,
        "the pool handle we still hold stays registered"
    );
    drop(pool);
    assert_eq!(rx_regs.live(), 0, "receiver side closed everything");
    drop(raw);
}

#[test]
fn unregistered_source_memory_is_refused() {
    let Some(fabric) = common::tcp() else { return };
    let (mut rx, mut tx) = common::pair(&fabric, &ChannelConfig::default());
    let pool = rx
        .register(AlignedBuf::new(4096), Access::REMOTE_WRITE)
        .expect("pool");
    rx.set_slot_pool(pool, 4096).expect("set pool");
    rx.grant(0).expect("grant");
    let credit = match tx.wait(None).expect("credit") {
        Some(Event::Credit(c)) => c,
        other => panic!("expected a credit, got {other:?}"),
    };
    let loose = vec![1u8; 64];
    let err = tx
        .write_block(&[IoSlice::new(&loose)], credit)
        .expect_err("unregistered");
    assert!(matches!(err, Error::NotRegistered { .. }), "got {err:?}");
}

/// Over the tcp provider each end of a connection finds its own kernel socket: the
/// connector's leads to the listener's address, the acceptor's comes from the connector's,
/// and the two are different descriptors (this process holds both ends).
#[test]
fn each_end_finds_its_own_kernel_socket() {
    use std::mem::ManuallyDrop;
    use std::net::TcpStream;
    use std::os::fd::{AsRawFd, FromRawFd};

    let Some(fabric) = common::tcp() else { return };
    let mut listener = wanxfer_fabric::Listener::bind(&fabric, common::loopback()).unwrap();
    let addr = listener.local_addr();
    let cfg = ChannelConfig::default();
    let acfg = cfg.clone();
    let acceptor = thread::spawn(move || wanxfer_fabric::Channel::accept(&mut listener, &acfg));
    let connector = wanxfer_fabric::Channel::connect(&fabric, addr, &cfg).unwrap();
    let accepted = acceptor.join().unwrap().unwrap();
    let socket = |ch: &wanxfer_fabric::Channel| {
        let fd = ch
            .connection()
            .kernel_socket()
            .expect("a tcp socket")
            .as_raw_fd();
        // SAFETY: borrowed for two queries, never closed.
        let s = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
        (fd, s.local_addr().unwrap(), s.peer_addr().unwrap())
    };
    let (cfd, clocal, cpeer) = socket(&connector);
    let (afd, alocal, apeer) = socket(&accepted);
    assert_ne!(cfd, afd);
    assert_eq!(cpeer.port(), addr.port());
    assert_eq!((alocal, apeer), (cpeer, clocal));
}
