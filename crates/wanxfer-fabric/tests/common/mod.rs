//! Shared test plumbing: tcp-provider detection and loopback channel pairs.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::thread;

use wanxfer_fabric::{Channel, ChannelConfig, Error, FabricConfig, Listener};

/// Loopback, any free port.
pub fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().expect("literal address parses")
}

/// The tcp provider's config, or `None` (with the reason printed) when this
/// libfabric has no tcp provider.
pub fn tcp() -> Option<FabricConfig> {
    let cfg = FabricConfig::with_provider("tcp");
    match Listener::bind(&cfg, loopback()) {
        Ok(_) => Some(cfg),
        Err(Error::ProviderUnavailable { detail, .. }) => {
            eprintln!("SKIP: libfabric has no usable tcp provider here: {detail}");
            None
        }
        Err(e) => panic!("binding a tcp listener on loopback failed: {e}"),
    }
}

/// A connected (acceptor, connector) channel pair over loopback.
pub fn pair(fabric: &FabricConfig, cfg: &ChannelConfig) -> (Channel, Channel) {
    let mut listener = Listener::bind(fabric, loopback()).expect("bind");
    let addr = listener.local_addr();
    let acfg = cfg.clone();
    let acceptor = thread::spawn(move || Channel::accept(&mut listener, &acfg));
    let connector = Channel::connect(fabric, addr, cfg).expect("connect");
    let accepted = acceptor
        .join()
        .expect("accept thread panicked")
        .expect("accept");
    (accepted, connector)
}

use std::io::IoSlice;
use std::time::Duration;

use wanxfer_fabric::{Access, AlignedBuf, Event, MemoryRegion};

/// Bytes of the test block header: sequence number and payload length.
pub const HDR: usize = 16;

/// The payload byte at `i` of block `seq`: distinct per block and offset,
/// so a block landing in the wrong place or torn is detected.
pub fn pattern(seq: u64, i: usize) -> u8 {
    (seq.wrapping_mul(131) as usize ^ i.wrapping_mul(7)) as u8
}

/// Source buffers of a sender: one header and one payload segment per
/// peer slot, registered as write sources.
pub struct Source {
    pub header: MemoryRegion,
    pub payload: MemoryRegion,
    pub payload_len: usize,
    busy: Vec<bool>,
}

impl Source {
    pub fn new(ch: &mut Channel, peer_slots: usize, payload_len: usize) -> Source {
        let header = ch
            .register(AlignedBuf::new(peer_slots * HDR), Access::WRITE_SOURCE)
            .expect("register header");
        let payload = ch
            .register(vec![0u8; peer_slots * payload_len], Access::WRITE_SOURCE)
            .expect("register payload");
        Source {
            header,
            payload,
            payload_len,
            busy: vec![false; peer_slots],
        }
    }

    fn fill(&mut self, seg: usize, seq: u64) {
        // SAFETY: segment `seg` is not in flight (checked by the caller via
        // `busy`) and no other reference to it exists.
        let (h, p) = unsafe {
            (
                self.header.slice_mut(seg * HDR..(seg + 1) * HDR),
                self.payload
                    .slice_mut(seg * self.payload_len..(seg + 1) * self.payload_len),
            )
        };
        h[..8].copy_from_slice(&seq.to_le_bytes());
        h[8..].copy_from_slice(&(self.payload_len as u64).to_le_bytes());
        for (i, b) in p.iter_mut().enumerate() {
            *b = pattern(seq, i);
        }
    }
}

/// Sends `count` blocks, each into whatever slot the peer grants, gathering
/// header and payload; returns once every write completed locally.
pub fn send_blocks(ch: &mut Channel, src: &mut Source, count: u64) {
    let mut credits = std::collections::VecDeque::new();
    let mut seq = 0;
    let mut in_flight = 0usize;
    while seq < count || in_flight > 0 {
        let ready = credits
            .front()
            .is_some_and(|c: &wanxfer_fabric::Credit| !src.busy[c.slot as usize]);
        if seq < count && ready {
            let credit = credits.pop_front().expect("front was checked");
            let seg = credit.slot as usize;
            src.fill(seg, seq);
            let iov = [
                IoSlice::new(&src.header.as_slice()[seg * HDR..(seg + 1) * HDR]),
                IoSlice::new(
                    &src.payload.as_slice()[seg * src.payload_len..(seg + 1) * src.payload_len],
                ),
            ];
            ch.write_block(&iov, credit).expect("write_block");
            src.busy[seg] = true;
            in_flight += 1;
            seq += 1;
            continue;
        }
        match ch.wait(None).expect("sender wait") {
            Some(Event::Credit(c)) => credits.push_back(c),
            Some(Event::WriteComplete { slot }) => {
                src.busy[slot as usize] = false;
                in_flight -= 1;
            }
            other => panic!("sender got unexpected {other:?}"),
        }
    }
}

/// Receives `count` blocks into a pool of `slots` slots, regranting each
/// slot after checking its block (after `delay`, if given); returns the
/// sequence numbers in arrival order.
pub fn receive_blocks(
    ch: &mut Channel,
    slots: u32,
    slot_size: usize,
    count: u64,
    delay: Option<Duration>,
) -> Vec<u64> {
    let pool = ch
        .register(
            AlignedBuf::new(slots as usize * slot_size),
            Access::REMOTE_WRITE,
        )
        .expect("register pool");
    ch.set_slot_pool(pool, slot_size).expect("set pool");
    for s in 0..slots {
        ch.grant(s).expect("initial grant");
    }
    let mut granted = u64::from(slots);
    let mut seqs = Vec::new();
    while (seqs.len() as u64) < count {
        match ch.wait(None).expect("receiver wait") {
            Some(Event::BlockArrived { slot, len }) => {
                seqs.push(check_block(ch.slot(slot).expect("slot exists"), len));
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                if granted < count {
                    ch.grant(slot).expect("regrant");
                    granted += 1;
                }
            }
            other => panic!("receiver got unexpected {other:?}"),
        }
    }
    seqs
}

/// Checks a landed block (header + pattern payload); returns its sequence.
pub fn check_block(slot: &[u8], len: usize) -> u64 {
    let seq = u64::from_le_bytes(slot[..8].try_into().expect("8 bytes"));
    let payload_len = u64::from_le_bytes(slot[8..16].try_into().expect("8 bytes")) as usize;
    assert_eq!(len, HDR + payload_len, "announced length of block {seq}");
    for (i, b) in slot[HDR..HDR + payload_len].iter().enumerate() {
        assert_eq!(*b, pattern(seq, i), "byte {i} of block {seq}");
    }
    seq
}

/// Sends `count` blocks from a new thread's channel end to this one and
/// checks all arrived intact; `delay` slows the receiver down.
pub fn transfer(
    fabric: &FabricConfig,
    cfg: &ChannelConfig,
    slots: u32,
    payload_len: usize,
    count: u64,
    delay: Option<Duration>,
) {
    let (mut rx, mut tx) = pair(fabric, cfg);
    let sender = thread::spawn(move || {
        let mut src = Source::new(&mut tx, slots as usize, payload_len);
        send_blocks(&mut tx, &mut src, count);
        tx
    });
    let mut seqs = receive_blocks(&mut rx, slots, HDR + payload_len, count, delay);
    let tx = sender.join().expect("sender thread panicked");
    seqs.sort_unstable();
    assert_eq!(
        seqs,
        (0..count).collect::<Vec<_>>(),
        "every block exactly once"
    );
    drop((rx, tx));
}
