//! Sequences of operations on a sender and a receiver machine, decoded from arbitrary
//! bytes: the session fuzz target (`fuzz/fuzz_targets/session.rs`, libFuzzer, nightly) and
//! a proptest (`tests/session_ops.rs`, stable, in CI) both run [`run`], so what the
//! fuzzer finds can be replayed as an ordinary test and vice versa.
//!
//! Unlike the simulation, nothing here is a faithful world. Each machine's inbox is its
//! peer's honest output, but the input also decides when anything is delivered, injects
//! messages of its own (structured ones with small numbers, which get past the first
//! checks, and raw decoded frames), and makes up the local events: blocks sent and
//! received on any channel, channels opening and failing, entries applied, files
//! resolved, time passing. What must hold whatever the order: no panic, and no call that
//! makes a machine produce output out of proportion to what it was given. The harness
//! keeps the calling contract the machines document (an entry is applied once, after its
//! `Apply`; a verdict answers a `Verify` with one match per range; `finish` only once
//! everything is resolved; a machine that returned an error is dropped, as the driver
//! does), because breaking it is the driver's bug, not the peer's.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use wanxfer_proto::{
    Confirm, Entry, EntryKind, ErrorMsg, FailureClass, FileFailed, Held, HeldRange, Manifest,
    ManifestEnd, Message, RelPath, Stats,
};
use wanxfer_session::{
    chunks, Applied, Event, Failure, Plan, ReceiverConfig, ReceiverMachine, ReceiverWork, SegRef,
    SenderConfig, SenderMachine, SenderWork,
};

/// Most operations one input runs.
const MAX_OPS: usize = 4096;
/// Most outputs (messages, work, events) one operation may cause, beyond those in
/// proportion to the input bytes it took: more is growth nobody asked for.
const OUTPUT_PER_OP: usize = 1024;
const BLOCK_SIZE: u64 = 64;

struct Input<'a> {
    data: &'a [u8],
    at: usize,
}

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    fn small(&mut self) -> u64 {
        u64::from(self.byte() % 32)
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let start = self.at.min(self.data.len());
        let end = (self.at + n).min(self.data.len());
        self.at += n;
        &self.data[start..end]
    }

    fn done(&self) -> bool {
        self.at >= self.data.len()
    }
}

struct Pair {
    base: Instant,
    elapsed: Duration,
    snd: Option<SenderMachine>,
    rcv: Option<ReceiverMachine>,
    to_snd: VecDeque<Message>,
    to_rcv: VecDeque<Message>,
    pushed: u64,
    /// Apply work not yet answered, and what kind of entry it is.
    applying: VecDeque<(u64, EntryKind)>,
    /// Files applied as waiting for data.
    waiting: Vec<u64>,
    /// Verify work not yet answered: id and how many ranges.
    verifying: VecDeque<(u64, usize)>,
    /// Blocks the sender's plans would make, not yet reported.
    blocks: VecDeque<Vec<SegRef>>,
    resolved: usize,
}

fn now(p: &Pair) -> Instant {
    p.base + p.elapsed
}

fn entry(n: u64, kind: u8, size: u64) -> Entry {
    let kind = match kind % 3 {
        0 => EntryKind::File,
        1 => EntryKind::Dir,
        _ => EntryKind::Symlink,
    };
    Entry {
        kind,
        path: RelPath::new(format!("e{n}").as_bytes()).expect("a plain name"),
        size: if kind == EntryKind::File { size } else { 0 },
        mode: 0o644,
        mtime_sec: 1,
        mtime_nsec: 0,
        link_target: if kind == EntryKind::Symlink {
            b"t".to_vec()
        } else {
            Vec::new()
        },
        meta: None,
    }
}

fn held_ranges(input: &mut Input, count: usize) -> Vec<HeldRange> {
    let mut at = 0;
    (0..count)
        .map(|_| {
            at += input.small() * BLOCK_SIZE / 2;
            let len = (input.small() as u32 + 1) * 8;
            let r = HeldRange {
                offset: at,
                len,
                digest: [input.byte(); 16],
            };
            at += u64::from(len);
            r
        })
        .collect()
}

/// A message a receiver could send, with numbers small enough to matter.
fn to_sender(input: &mut Input) -> Message {
    match input.byte() % 10 {
        0 => Message::ManifestAck {
            through: input.small(),
        },
        1 => Message::FileAck {
            ids: (0..input.small() % 4).map(|_| input.small()).collect(),
        },
        2 => Message::UpToDate {
            ids: (0..input.small() % 4).map(|_| input.small()).collect(),
        },
        3 => Message::FileFailed(FileFailed {
            id: input.small(),
            class: FailureClass::Io,
            offset: 0,
            message: b"x".to_vec(),
        }),
        4 => {
            let id = input.small();
            let n = input.small() as usize % 5;
            Message::Held(Held {
                id,
                ranges: held_ranges(input, n),
                last: input.byte() % 2 == 0,
            })
        }
        5 => Message::ChannelStatus {
            index: u16::from(input.byte() % 4),
            received: input.small(),
            closed: input.byte() % 2 == 0,
        },
        6 => Message::Stats(Stats::default()),
        7 => Message::Finish,
        8 => Message::Error(ErrorMsg::new(FailureClass::Internal, "gone")),
        _ => Message::Keepalive,
    }
}

/// A message a sender could send, with numbers small enough to matter.
fn to_receiver(input: &mut Input, pushed: u64) -> Message {
    match input.byte() % 9 {
        0 => {
            let first_id = if input.byte() % 4 == 0 {
                input.small()
            } else {
                pushed
            };
            let n = input.small() % 8;
            Message::Manifest(Manifest {
                first_id,
                entries: (0..n)
                    .map(|i| {
                        let kind = input.byte();
                        let size = input.small() * 20;
                        entry(first_id + i, kind, size)
                    })
                    .collect(),
            })
        }
        1 => Message::ManifestEnd(ManifestEnd {
            entries: input.small(),
            bytes: 0,
        }),
        2 => {
            let id = input.small();
            let verdicts: Vec<bool> = (0..input.small() % 6)
                .map(|_| input.byte() % 2 == 0)
                .collect();
            Message::Confirm(Confirm::new(id, &verdicts))
        }
        3 => Message::FileFailed(FileFailed {
            id: input.small(),
            class: FailureClass::Io,
            offset: 0,
            message: b"x".to_vec(),
        }),
        4 => Message::DropChannel {
            index: u16::from(input.byte() % 4),
        },
        5 => Message::Finish,
        6 => Message::Stats(Stats::default()),
        7 => Message::Skipped {
            paths: vec![b"fifo".to_vec()],
        },
        _ => Message::Keepalive,
    }
}

/// Any frame body at all, as the codec would hand it over.
fn raw(input: &mut Input) -> Option<Message> {
    let kind = input.byte();
    let len = usize::from(input.byte());
    Message::decode(kind, input.bytes(len)).ok()
}

fn segs(input: &mut Input) -> Vec<SegRef> {
    (0..input.small() % 3 + 1)
        .map(|_| SegRef {
            id: input.small(),
            offset: input.small() * BLOCK_SIZE,
            len: (input.small() as u32 + 1) * 4,
        })
        .collect()
}

impl Pair {
    fn sender(&mut self, msg: Message) {
        let t = now(self);
        if let Some(m) = self.snd.as_mut() {
            if m.handle_message(t, msg).is_err() {
                self.snd = None;
            }
        }
    }

    fn receiver(&mut self, msg: Message) {
        let t = now(self);
        if let Some(m) = self.rcv.as_mut() {
            if m.handle_message(t, msg).is_err() {
                self.rcv = None;
            }
        }
    }

    /// What the driver does after every batch of inputs: drain everything, keeping what
    /// the harness answers later.
    fn poll(&mut self) -> usize {
        let t = now(self);
        let mut produced = 0;
        if let Some(m) = self.snd.as_mut() {
            while let Some(msg) = m.poll_transmit(t) {
                produced += 1;
                self.to_rcv.push_back(msg);
            }
            while let Some(work) = m.poll_work() {
                produced += 1;
                match work {
                    SenderWork::Read(Plan::Chunks { id, ranges, .. }) => {
                        for (offset, len) in chunks(&ranges, BLOCK_SIZE) {
                            self.blocks.push_back(vec![SegRef { id, offset, len }]);
                        }
                    }
                    SenderWork::Read(Plan::Packed { files }) => self.blocks.push_back(
                        files
                            .iter()
                            .map(|&(id, size)| SegRef {
                                id,
                                offset: 0,
                                len: size as u32,
                            })
                            .collect(),
                    ),
                    SenderWork::Verify { id, ranges } => {
                        self.verifying.push_back((id, ranges.len()))
                    }
                    SenderWork::CloseChannel(_) => {}
                }
            }
            while let Some(event) = m.poll_event() {
                produced += 1;
                if event == Event::FinishRequested {
                    m.send_stats(Stats::default());
                }
            }
            let _ = m.poll_timeout();
        }
        if let Some(m) = self.rcv.as_mut() {
            while let Some(msg) = m.poll_transmit(t) {
                produced += 1;
                self.to_snd.push_back(msg);
            }
            while let Some(work) = m.poll_work() {
                produced += 1;
                if let ReceiverWork::Apply { id, entry } = work {
                    self.applying.push_back((id, entry.kind));
                }
            }
            while let Some(event) = m.poll_event() {
                produced += 1;
                match event {
                    Event::Resolved { id, .. } => {
                        self.resolved += 1;
                        self.waiting.retain(|w| *w != id);
                    }
                    Event::FinishRequested => m.send_stats(Stats::default()),
                    _ => {}
                }
            }
            let _ = m.poll_timeout();
        }
        // Both queues stay bounded: what is not delivered soon is dropped, as if the
        // connection had been cut.
        self.to_rcv.truncate(4096);
        self.to_snd.truncate(4096);
        self.blocks.truncate(4096);
        produced
    }

    fn op(&mut self, input: &mut Input) {
        let t = now(self);
        match input.byte() % 26 {
            0 => {
                let (kind, size) = (input.byte(), input.small() * 16);
                if let Some(m) = self.snd.as_mut().filter(|m| m.wants_entries()) {
                    m.push_entry(entry(self.pushed, kind, size));
                    self.pushed += 1;
                }
            }
            1 => {
                if let Some(m) = self.snd.as_mut() {
                    m.walk_done();
                }
            }
            2 => {
                if let Some(msg) = self.to_snd.pop_front() {
                    self.sender(msg);
                }
            }
            3 => {
                if let Some(msg) = self.to_rcv.pop_front() {
                    self.receiver(msg);
                }
            }
            4 => {
                let msg = to_sender(input);
                self.sender(msg);
            }
            5 => {
                let msg = to_receiver(input, self.pushed);
                self.receiver(msg);
            }
            6 => {
                if let Some(msg) = raw(input) {
                    self.sender(msg);
                }
            }
            7 => {
                if let Some(msg) = raw(input) {
                    self.receiver(msg);
                }
            }
            8 => {
                let choice = input.byte();
                let Some((id, kind)) = self.applying.pop_front() else {
                    return;
                };
                let applied = match choice % 6 {
                    // Only files hold data (the sink never says otherwise).
                    2 if kind != EntryKind::File => Applied::Pending,
                    0 => Applied::Done,
                    1 => Applied::UpToDate,
                    2 => {
                        let n = input.small() as usize % 4;
                        Applied::Held(held_ranges(input, n))
                    }
                    3 => Applied::Failed(Failure {
                        class: FailureClass::Refused,
                        offset: 0,
                        message: "no".into(),
                        remote: false,
                    }),
                    _ => Applied::Pending,
                };
                if matches!(applied, Applied::Pending | Applied::Held(_)) {
                    self.waiting.push(id);
                }
                if let Some(m) = self.rcv.as_mut() {
                    if m.applied(id, applied).is_err() {
                        self.rcv = None;
                    }
                }
            }
            9 => {
                let ok = input.byte() % 3 != 0;
                let pick = input.small() as usize;
                let id = match self.waiting.get(pick % self.waiting.len().max(1)) {
                    Some(&id) => id,
                    None => pick as u64,
                };
                let result = if ok {
                    Ok(())
                } else {
                    Err(Failure {
                        class: FailureClass::Io,
                        offset: 0,
                        message: "disk".into(),
                        remote: false,
                    })
                };
                if let Some(m) = self.rcv.as_mut() {
                    m.resolved(id, result);
                }
            }
            10 => {
                let bits = input.byte();
                if let (Some((id, n)), Some(m)) = (self.verifying.pop_front(), self.snd.as_mut()) {
                    let matches: Vec<bool> = (0..n).map(|i| bits >> (i % 8) & 1 == 1).collect();
                    m.verified(id, &matches);
                }
            }
            11 => {
                let id = input.small();
                if let Some(m) = self.snd.as_mut() {
                    m.read_failed(id, FailureClass::Io, "gone");
                }
            }
            12 => {
                let index = u16::from(input.byte() % 4);
                if let Some(m) = self.snd.as_mut() {
                    m.channel_opened(index);
                }
            }
            13 => {
                let index = u16::from(input.byte() % 4);
                let planned = input.byte() % 4 != 0;
                let segs = match self.blocks.pop_front() {
                    Some(segs) if planned => segs,
                    _ => segs(input),
                };
                if let Some(m) = self.snd.as_mut() {
                    if m.block_sent(index, segs).is_err() {
                        self.snd = None;
                    }
                }
            }
            14 => {
                let segs = match self.blocks.pop_front() {
                    Some(segs) => segs,
                    None => segs(input),
                };
                if let Some(m) = self.snd.as_mut() {
                    m.block_unsent(u16::from(input.byte() % 4), segs);
                }
            }
            15 => {
                let index = u16::from(input.byte() % 4);
                if let Some(m) = self.snd.as_mut() {
                    m.channel_failed(index);
                }
            }
            16 => {
                let index = u16::from(input.byte() % 4);
                if let Some(m) = self.rcv.as_mut() {
                    m.channel_opened(index);
                }
            }
            17 => {
                let (index, n) = (u16::from(input.byte() % 4), input.small());
                if let Some(m) = self.rcv.as_mut() {
                    for _ in 0..n {
                        m.block_received(t, index);
                    }
                }
            }
            18 => {
                let index = u16::from(input.byte() % 4);
                if let Some(m) = self.rcv.as_mut() {
                    m.channel_closed(index);
                }
            }
            19 => {
                self.elapsed += Duration::from_millis(u64::from(input.byte()) * 50);
                let t = now(self);
                if let Some(m) = self.snd.as_mut() {
                    if m.handle_timeout(t).is_err() {
                        self.snd = None;
                    }
                }
                if let Some(m) = self.rcv.as_mut() {
                    if m.handle_timeout(t).is_err() {
                        self.rcv = None;
                    }
                }
            }
            20 => {
                if let Some(m) = self.snd.as_mut().filter(|m| m.all_resolved()) {
                    m.finish();
                }
            }
            21 => {
                if let Some(m) = self.rcv.as_mut().filter(|m| m.all_resolved()) {
                    m.finish();
                }
            }
            22 => {
                // Deliver everything waiting, both ways, as a calm link would.
                for _ in 0..64 {
                    match (self.to_snd.pop_front(), self.to_rcv.pop_front()) {
                        (None, None) => break,
                        (a, b) => {
                            if let Some(msg) = a {
                                self.sender(msg);
                            }
                            if let Some(msg) = b {
                                self.receiver(msg);
                            }
                        }
                    }
                    self.poll();
                }
            }
            23 => {
                let (index, payload) = (u16::from(input.byte() % 4), input.small() * 16);
                if let Some(m) = self.snd.as_mut() {
                    m.block_taken(t, index, payload);
                }
            }
            24 => {
                let rtt = Duration::from_millis(u64::from(input.byte()));
                if let Some(m) = self.snd.as_mut() {
                    m.cut_stragglers(t, rtt);
                }
            }
            _ => {
                // Nothing but a poll: the driver's loop going round.
            }
        }
    }
}

/// How far a sequence got, so that a seed of the corpus can be checked to reach what it
/// was written for.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reached {
    pub sender_done: bool,
    pub receiver_done: bool,
    /// A machine returned an error (and was dropped).
    pub failed: bool,
    /// Entries the receiver resolved.
    pub resolved: usize,
}

/// Runs the operations `data` encodes. Panics if a machine panics or grows its output
/// out of proportion to what it was given.
pub fn run(data: &[u8]) -> Reached {
    let mut input = Input { data, at: 0 };
    let window = u32::from(input.byte() % 16) + 1;
    let status_every = u64::from(input.byte() % 4) + 1;
    let stall_timeout = Duration::from_secs(10);
    let base = Instant::now();
    let mut pair = Pair {
        base,
        elapsed: Duration::ZERO,
        snd: Some(SenderMachine::new(
            SenderConfig {
                block_size: BLOCK_SIZE,
                window,
                stall_timeout,
                idle_timeout: None,
                peer_may_skip: true,
                peer_may_hold: true,
                peer_may_note: true,
                fresh: false,
            },
            base,
        )),
        rcv: Some(ReceiverMachine::new(
            ReceiverConfig {
                window,
                stall_timeout,
                idle_timeout: None,
                status_every,
                marked_links: false,
            },
            base,
        )),
        to_snd: VecDeque::new(),
        to_rcv: VecDeque::new(),
        pushed: 0,
        applying: VecDeque::new(),
        waiting: Vec::new(),
        verifying: VecDeque::new(),
        blocks: VecDeque::new(),
        resolved: 0,
    };
    for _ in 0..MAX_OPS {
        if input.done() {
            break;
        }
        let before = input.at;
        pair.op(&mut input);
        let produced = pair.poll();
        let taken = input.at - before;
        assert!(
            produced <= OUTPUT_PER_OP + 64 * taken,
            "one operation of {taken} input bytes made the machines produce {produced} outputs"
        );
    }
    Reached {
        sender_done: pair.snd.as_ref().is_some_and(SenderMachine::is_done),
        receiver_done: pair.rcv.as_ref().is_some_and(ReceiverMachine::is_done),
        failed: pair.snd.is_none() || pair.rcv.is_none(),
        resolved: pair.resolved,
    }
}
