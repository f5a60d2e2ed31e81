//! One session of a transfer: a `SenderMachine` and a `ReceiverMachine`, each behind a
//! model of the engine's driver loop, over a modelled control link and data channels, on
//! simulated time.
//!
//! The machines are the real ones; everything around them is a model, kept as close to
//! `driver.rs` as a discrete-event simulation allows: the same calls in the same order
//! (walk, transmit, work, events, finish, transmit, done?, timer), the same reactions to
//! link events, and the same client-side channel replacement with back-off. The engine's
//! threads become events on one queue: a reader finishing a job, a pump putting a block on
//! the wire, a writer placing one, the committer's batched syncs. Each source of events
//! that the engine orders (one pump, one direction of the control connection, the
//! committer) is ordered here too; anything the engine leaves to the scheduler is left to
//! the seed.
//!
//! The receiver's front end is a model of `sink.rs` (quick check, resume from the journal,
//! comparison by checksum, coverage, committer, checkpoints), because what it reports
//! back (`applied`, `resolved`, `Accept`) is what the machine must cope with, and what it
//! leaves on disk is what the next session resumes from.
//!
//! What it checks as it goes, and returns as an error with the reason: every machine call
//! succeeds unless the model broke the session on purpose; every control message survives
//! the wire codec; no byte range reaches the receiver twice in a session; nothing lands
//! under a final name unless it is the source's current version, whole; no final name is
//! written twice in a session, nor one that was already up to date; the session ends
//! within a bound of steps and simulated time.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::Rng;
use wanxfer_proto::{
    decode_frame, encode_frame, Compare, Entry, EntryKind, FailureClass, HeldRange, Message,
    RelPath, Stats, MAX_HELD_RANGES, MAX_HELD_RANGES_PER_FILE,
};
use wanxfer_session::journal::{Journal, Record};
use wanxfer_session::{
    chunks, Applied, Coverage, Event, Failure, Outcome, Plan, ReceiverConfig, ReceiverMachine,
    ReceiverWork, SegRef, SenderConfig, SenderMachine, SenderWork, SessionError,
};

use super::content::{digest, Label, Runs};
use super::transfer::World;
use super::world::{Kind, Node, Temp};

/// Most events one session may take, and most simulated time: a session that goes past
/// either is stuck (a livelock, or two sides waiting for each other).
const MAX_STEPS: u64 = 2_000_000;
const MAX_TIME: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    Sender,
    Receiver,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::Sender => Side::Receiver,
            Side::Receiver => Side::Sender,
        }
    }
}

/// How one side's session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    Done,
    /// Ended by something the model did (a cut, the peer's crash), with what.
    Failed(String),
    Crashed,
}

/// What a finished session tells the transfer.
#[derive(Debug, Default)]
pub struct SessionReport {
    /// Both sides finished and every entry is in place or up to date.
    pub complete: bool,
    pub ended_done: bool,
    pub faulted: bool,
    pub steps: u64,
    pub elapsed: Duration,
    pub blocks_sent: u64,
    pub bytes_planned: u64,
    pub bytes_resent: u64,
    pub channels_opened: u64,
    pub channels_died: u64,
    /// Channels the sending client cut at the end (`SenderMachine::cut_stragglers`).
    pub channels_cut: u64,
    /// Channels the sending client held back near the end (`SenderMachine::held_back`).
    pub channels_held_back: u64,
    pub messages: u64,
    pub failures: u64,
    pub crashed: Option<Side>,
}

/// One segment of a block as the model carries it: what the machine sees, plus the
/// content it holds.
#[derive(Debug, Clone)]
struct Seg {
    id: u64,
    src: usize,
    offset: u64,
    len: u32,
    label: Label,
    digest: [u8; 16],
}

impl Seg {
    fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }

    fn seg_ref(&self) -> SegRef {
        SegRef {
            id: self.id,
            offset: self.offset,
            len: self.len,
        }
    }
}

#[derive(Debug, Clone)]
struct Block {
    serial: u64,
    segs: Vec<Seg>,
}

impl Block {
    fn refs(&self) -> Vec<SegRef> {
        self.segs.iter().map(Seg::seg_ref).collect()
    }
}

#[derive(Debug)]
enum Job {
    Read {
        plan: Plan,
        files: Vec<(u64, usize)>,
    },
    Verify {
        id: u64,
        src: usize,
        ranges: Vec<HeldRange>,
    },
}

#[derive(Debug)]
enum Ev {
    // Into the sender's loop.
    SMsg(Message),
    SCtlEnd,
    STaken {
        index: u16,
        payload: u64,
    },
    SSent {
        index: u16,
        segs: Vec<SegRef>,
    },
    SUnsent {
        index: u16,
        segs: Vec<SegRef>,
    },
    SLinkEnded {
        index: u16,
    },
    SLinkUp {
        index: u16,
    },
    SJoinFailed {
        index: u16,
    },
    SVerified {
        id: u64,
        matches: Vec<bool>,
    },
    SReadFailed {
        id: u64,
    },
    SPoll,
    STimer,
    SReopen,
    // The sender's threads.
    ReaderDone {
        job: Job,
    },
    PumpDone {
        index: u16,
    },
    PumpNotice {
        index: u16,
    },
    // Into the receiver's loop.
    RMsg(Message),
    RCtlEnd,
    RReceived {
        index: u16,
    },
    RLinkEnded {
        index: u16,
    },
    RLinkUp {
        index: u16,
    },
    RJoinFailed {
        index: u16,
    },
    RResolved {
        id: u64,
        ok: bool,
    },
    RPoll,
    RTimer,
    RReopen,
    // The receiver's threads.
    Arrive {
        index: u16,
        block: Block,
    },
    /// A writer takes a block; `since`: when it began waiting for an entry it overtook
    /// (a fresh pull).
    Place {
        block: Block,
        since: Option<Duration>,
    },
    Flush,
    FlushSynced {
        results: Vec<u64>,
    },
    // The world.
    ChanOpen {
        index: u16,
    },
    ChanDie {
        index: u16,
    },
    CtlCut,
    Crash(Side),
}

/// Event sources whose order the engine keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Stream {
    Control(Side),
    SenderPump(u16),
    ReceiverPump(u16),
    Committer,
    Data(u16),
}

#[derive(Debug, Default)]
struct Chan {
    alive: bool,
    /// The receiver's pump has ended and reported.
    rx_ended: bool,
    last_arrival: Duration,
    /// Blocks on the wire: serial and bytes per source file.
    in_flight: Vec<(u64, Vec<(usize, u64)>)>,
}

/// The driver's link bookkeeping for one side.
#[derive(Debug, Default)]
struct Links {
    client: bool,
    live: BTreeSet<u16>,
    next_index: u16,
    backoff: Duration,
}

const BACKOFF_START: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

struct Snd {
    m: SenderMachine,
    links: Links,
    next_entry: usize,
    walking: bool,
    specials: Vec<Vec<u8>>,
    /// Id to source entry, for files the driver would still read.
    contents: HashMap<u64, usize>,
    jobs: VecDeque<Job>,
    readers_busy: usize,
    send_queue: VecDeque<Block>,
    /// Open pumps and the block each is putting on the wire.
    pumps: BTreeMap<u16, Option<Block>>,
    /// Channels cut at the end: their pumps take no more blocks, and no other opens.
    cut: BTreeSet<u16>,
    /// Channels held back for now, and every one ever held back.
    held: BTreeSet<u16>,
    ever_held: BTreeSet<u16>,
    outcomes: HashMap<u64, Outcome>,
    timer: Option<Duration>,
    poll_pending: bool,
    blocked: bool,
}

#[derive(Debug)]
enum TempRef {
    None,
    /// A file that comes in one segment: written unnamed, linked whole.
    Unnamed(Runs),
    /// In `Disk::temps` under the destination.
    Named,
}

#[derive(Debug)]
struct Slot {
    src: usize,
    dest: String,
    size: u64,
    mtime: (i64, u32),
    coverage: Coverage,
    temp: TempRef,
    journaled: Option<u32>,
    unjournaled: Vec<(HeldRange, Label)>,
    unjournaled_bytes: u64,
    in_place: bool,
    /// Held ranges offered to the sender, to check its verdict against.
    offered: Vec<HeldRange>,
}

#[derive(Debug)]
enum CJob {
    Commit {
        id: u64,
        src: usize,
        dest: String,
        size: u64,
        mtime: (i64, u32),
        unnamed: Option<Runs>,
        journaled: Option<u32>,
    },
    Symlink {
        id: u64,
        src: usize,
        dest: String,
    },
    Checkpoint {
        file: u32,
        dest: String,
        ranges: Vec<(HeldRange, Label)>,
    },
}

struct Rcv {
    m: ReceiverMachine,
    links: Links,
    ids: HashMap<u64, usize>,
    slots: HashMap<u64, Slot>,
    failed: HashSet<u64>,
    journal: Journal,
    next_file: u32,
    committer: VecDeque<CJob>,
    flushing: bool,
    finish_sent: bool,
    outcomes: HashMap<u64, Outcome>,
    timer: Option<Duration>,
    poll_pending: bool,
    blocked: bool,
}

pub struct Session<'w> {
    w: &'w mut World,
    base: Instant,
    now: Duration,
    queue: BTreeMap<(Duration, u64), Ev>,
    seq: u64,
    steps: u64,
    snd: Option<Snd>,
    rcv: Option<Rcv>,
    snd_end: Option<End>,
    rcv_end: Option<End>,
    cut: bool,
    inflight: [usize; 2],
    last_order: HashMap<Stream, Duration>,
    chans: BTreeMap<u16, Chan>,
    /// What the model did that may end the session.
    fault: Option<String>,
    /// Per file id: the ranges that reached the receiver this session.
    arrived: HashMap<u64, Coverage>,
    /// Per source entry: ranges planned, bytes planned, bytes lost on the way.
    planned: HashMap<usize, (Coverage, u64)>,
    lost: HashMap<usize, u64>,
    /// Final names written this session, and those up to date when it began.
    written: HashSet<String>,
    up_to_date: HashSet<String>,
    next_serial: u64,
    calm: bool,
    /// A pull to a receiver holding nothing of the transfer (`session_flags::FRESH`):
    /// the sender reads each file as it announces it, and data may overtake its entry.
    fresh: bool,
    /// The journal as this session's sink opened it, and what each file may send.
    journal: Option<Journal>,
    bounds: HashMap<usize, u64>,
    /// Per side: calls into the machine, and what it produced, since its last poll.
    fed: [u64; 2],
    produced: [u64; 2],
    report: SessionReport,
}

fn bug(who: &str, e: SessionError) -> String {
    format!("the {who} machine failed the session: {e}")
}

impl<'w> Session<'w> {
    pub fn new(w: &'w mut World, calm: bool) -> Session<'w> {
        let up_to_date = w
            .src
            .iter()
            .filter(|e| w.in_place_and_current(e))
            .map(|e| e.path.clone())
            .collect();
        let fresh = !w.cfg.push
            && w.disk.names.is_empty()
            && w.disk.temps.is_empty()
            && w.disk.journal.is_empty();
        let journal = w.open_journal();
        let bounds = w.resend_bounds(&journal);
        Session {
            w,
            base: Instant::now(),
            now: Duration::ZERO,
            queue: BTreeMap::new(),
            seq: 0,
            steps: 0,
            snd: None,
            rcv: None,
            snd_end: None,
            rcv_end: None,
            cut: false,
            inflight: [0; 2],
            last_order: HashMap::new(),
            chans: BTreeMap::new(),
            fault: None,
            arrived: HashMap::new(),
            planned: HashMap::new(),
            lost: HashMap::new(),
            written: HashSet::new(),
            up_to_date,
            next_serial: 0,
            calm,
            fresh,
            journal: Some(journal),
            bounds,
            fed: [0; 2],
            produced: [0; 2],
            report: SessionReport::default(),
        }
    }

    fn inst(&self) -> Instant {
        self.base + self.now
    }

    fn at(&mut self, t: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.insert((t.max(self.now), self.seq), ev);
    }

    fn after(&mut self, delay: Duration, ev: Ev) {
        self.at(self.now + delay, ev);
    }

    /// Schedules `ev` no earlier than `delay` from now and after everything earlier from
    /// the same source.
    fn ordered(&mut self, stream: Stream, delay: Duration, ev: Ev) -> Duration {
        let last = self.last_order.get(&stream).copied().unwrap_or_default();
        let t = (self.now + delay).max(last);
        self.last_order.insert(stream, t);
        self.at(t, ev);
        t
    }

    fn between(&mut self, range: (Duration, Duration)) -> Duration {
        if range.1 <= range.0 {
            return range.0;
        }
        let nanos = self
            .w
            .rng
            .random_range(range.0.as_nanos() as u64..=range.1.as_nanos() as u64);
        Duration::from_nanos(nanos)
    }

    fn up_to(&mut self, max: Duration) -> Duration {
        self.between((Duration::ZERO, max))
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.w.rng.random_bool(p.min(1.0))
    }

    fn trace(&mut self, what: impl FnOnce() -> String) {
        if self.w.trace {
            let line = format!("{:>12.6} {}", self.now.as_secs_f64(), what());
            self.w.log(line);
        }
    }

    /// Runs the session to its end on both sides.
    pub fn run(mut self) -> Result<SessionReport, String> {
        self.start();
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            self.now = t;
            self.steps += 1;
            if self.steps > MAX_STEPS || t > MAX_TIME {
                return Err(format!(
                    "the session did not end within {MAX_STEPS} steps and {MAX_TIME:?} \
                     (step {}, {:?}): sender {:?}, receiver {:?}; the receiver waits for {}",
                    self.steps,
                    t,
                    self.snd_end,
                    self.rcv_end,
                    self.waiting_for()
                ));
            }
            self.handle(ev)?;
            if self.snd_end.is_some() && self.rcv_end.is_some() {
                break;
            }
        }
        let (Some(s), Some(r)) = (self.snd_end.clone(), self.rcv_end.clone()) else {
            return Err(format!(
                "nothing left to happen but the session has not ended: sender {:?}, receiver {:?}",
                self.snd_end, self.rcv_end
            ));
        };
        self.finish_report(&s, &r)?;
        Ok(self.report)
    }

    /// What the receiver's files still lack, for the report of a session that hangs.
    fn waiting_for(&self) -> String {
        let Some(r) = self.rcv.as_ref() else {
            return "nothing (it has ended)".into();
        };
        let mut files: Vec<String> = r
            .slots
            .iter()
            .map(|(id, slot)| {
                format!(
                    "{} (id {id}) {:?}",
                    slot.dest,
                    slot.coverage.gaps(slot.size)
                )
            })
            .collect();
        files.sort();
        files.truncate(8);
        files.join(", ")
    }

    fn start(&mut self) {
        let cfg = self.w.cfg.clone();
        let base = self.base;
        let snd = Snd {
            m: SenderMachine::new(
                SenderConfig {
                    block_size: cfg.block_size,
                    window: cfg.window,
                    stall_timeout: cfg.stall_timeout,
                    idle_timeout: None,
                    peer_may_skip: !self.fresh,
                    peer_may_hold: !self.fresh,
                    peer_may_note: true,
                    fresh: self.fresh,
                },
                base,
            ),
            links: Links {
                client: cfg.push,
                backoff: BACKOFF_START,
                ..Links::default()
            },
            next_entry: 0,
            walking: true,
            specials: Vec::new(),
            contents: HashMap::new(),
            jobs: VecDeque::new(),
            readers_busy: 0,
            send_queue: VecDeque::new(),
            pumps: BTreeMap::new(),
            cut: BTreeSet::new(),
            held: BTreeSet::new(),
            ever_held: BTreeSet::new(),
            outcomes: HashMap::new(),
            timer: None,
            poll_pending: false,
            blocked: false,
        };
        let journal = self.journal.take().expect("opened in new");
        let next_file = journal.next_file;
        let rcv = Rcv {
            m: ReceiverMachine::new(
                ReceiverConfig {
                    window: cfg.window,
                    stall_timeout: cfg.stall_timeout,
                    idle_timeout: None,
                    status_every: cfg.status_every,
                    marked_links: false,
                },
                base,
            ),
            links: Links {
                client: !cfg.push,
                backoff: BACKOFF_START,
                ..Links::default()
            },
            ids: HashMap::new(),
            slots: HashMap::new(),
            failed: HashSet::new(),
            journal,
            next_file,
            committer: VecDeque::new(),
            flushing: false,
            finish_sent: false,
            outcomes: HashMap::new(),
            timer: None,
            poll_pending: false,
            blocked: false,
        };
        self.snd = Some(snd);
        self.rcv = Some(rcv);
        let client = if cfg.push {
            Side::Sender
        } else {
            Side::Receiver
        };
        for _ in 0..cfg.streams {
            self.open_link(client);
        }
        self.at(Duration::ZERO, Ev::SPoll);
        self.at(Duration::ZERO, Ev::RPoll);
        if !self.calm {
            let horizon = self.w.horizon();
            let weather = cfg.weather.clone();
            if self.chance(weather.cut_control) {
                let t = self.up_to(horizon);
                self.at(t, Ev::CtlCut);
            }
            if self.chance(weather.crash_sender) {
                let t = self.up_to(horizon);
                self.at(t, Ev::Crash(Side::Sender));
            }
            if self.chance(weather.crash_receiver) {
                let t = self.up_to(horizon);
                self.at(t, Ev::Crash(Side::Receiver));
            }
        }
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        if let Some(side) = fed(&ev) {
            self.fed[side as usize] += 1;
        }
        match ev {
            Ev::SMsg(msg) => self.deliver(Side::Sender, msg)?,
            Ev::RMsg(msg) => self.deliver(Side::Receiver, msg)?,
            Ev::SCtlEnd => self.control_ended(Side::Sender)?,
            Ev::RCtlEnd => self.control_ended(Side::Receiver)?,
            Ev::CtlCut => {
                if self.snd_end.is_none() || self.rcv_end.is_none() {
                    self.trace(|| "control connection cut".into());
                    self.fault
                        .get_or_insert_with(|| "the control link was cut".into());
                    self.cut = true;
                    let d = Duration::from_millis(50);
                    let (a, b) = (self.up_to(d), self.up_to(d));
                    self.after(a, Ev::SCtlEnd);
                    self.after(b, Ev::RCtlEnd);
                }
            }
            Ev::Crash(side) => {
                if self.ended(side).is_none() {
                    self.trace(|| format!("{side:?} crashes"));
                    self.fault
                        .get_or_insert_with(|| format!("the {side:?} crashed"));
                    self.report.crashed = Some(side);
                    self.end_side(side, End::Crashed);
                }
            }
            Ev::ChanOpen { index } => self.chan_open(index),
            Ev::ChanDie { index } => self.kill_chan(index, None),
            // Sender.
            Ev::SSent { index, segs } => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.block_sent(index, segs).map_err(|e| bug("sender", e))?;
                self.poll_soon(Side::Sender)?;
            }
            Ev::STaken { index, payload } => {
                let inst = self.inst();
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.block_taken(inst, index, payload);
                self.poll_soon(Side::Sender)?;
            }
            Ev::SUnsent { index, segs } => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.block_unsent(index, segs);
                self.poll_soon(Side::Sender)?;
            }
            Ev::SLinkEnded { index } => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                // A cut channel's end is no loss: nothing opens in its place.
                let running = !s.m.all_resolved() && !s.cut.contains(&index);
                s.m.channel_failed(index);
                self.link_lost(Side::Sender, index, running);
                self.poll_soon(Side::Sender)?;
            }
            Ev::SLinkUp { index } => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.channel_opened(index);
                s.pumps.insert(index, None);
                s.links.backoff = BACKOFF_START;
                if !self.chans.get(&index).is_some_and(|c| c.alive) {
                    let d = self.up_to(Duration::from_millis(100));
                    self.after(d, Ev::PumpNotice { index });
                }
                self.kick_pumps();
                self.poll_soon(Side::Sender)?;
            }
            Ev::SJoinFailed { index } => {
                let Some(s) = self.snd.as_ref() else {
                    return Ok(());
                };
                let running = !s.m.all_resolved();
                self.link_lost(Side::Sender, index, running);
            }
            Ev::SVerified { id, matches } => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.verified(id, &matches);
                self.poll_soon(Side::Sender)?;
            }
            Ev::SReadFailed { id } => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.read_failed(id, FailureClass::Io, "the source could not be read");
                self.poll_soon(Side::Sender)?;
            }
            Ev::SPoll => self.poll_sender()?,
            Ev::STimer => {
                let now = self.now;
                let inst = self.inst();
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                if s.timer == Some(now) {
                    s.timer = None;
                    s.m.handle_timeout(inst).map_err(|e| bug("sender", e))?;
                    self.poll_sender()?;
                }
            }
            Ev::SReopen => self.reopen(Side::Sender),
            Ev::ReaderDone { job } => self.reader_done(job),
            Ev::PumpDone { index } => self.pump_done(index),
            Ev::PumpNotice { index } => self.pump_notice(index),
            // Receiver.
            Ev::RReceived { index } => {
                let inst = self.inst();
                let Some(r) = self.rcv.as_mut() else {
                    return Ok(());
                };
                r.m.block_received(inst, index);
                self.poll_soon(Side::Receiver)?;
            }
            Ev::RLinkEnded { index } => {
                let Some(r) = self.rcv.as_mut() else {
                    return Ok(());
                };
                let running = !r.m.all_resolved();
                if running {
                    r.m.channel_closed(index);
                }
                if let Some(chan) = self.chans.get_mut(&index) {
                    chan.rx_ended = true;
                }
                self.link_lost(Side::Receiver, index, running);
                self.poll_soon(Side::Receiver)?;
            }
            Ev::RLinkUp { index } => {
                let Some(r) = self.rcv.as_mut() else {
                    return Ok(());
                };
                r.m.channel_opened(index);
                r.links.backoff = BACKOFF_START;
                if !self.chans.get(&index).is_some_and(|c| c.alive) {
                    self.receiver_pump_ends(index, Duration::ZERO);
                }
                self.poll_soon(Side::Receiver)?;
            }
            Ev::RJoinFailed { index } => {
                let Some(r) = self.rcv.as_ref() else {
                    return Ok(());
                };
                let running = !r.m.all_resolved();
                self.link_lost(Side::Receiver, index, running);
            }
            Ev::RResolved { id, ok } => {
                let Some(r) = self.rcv.as_mut() else {
                    return Ok(());
                };
                let result = if ok {
                    Ok(())
                } else {
                    Err(Failure {
                        class: FailureClass::Io,
                        offset: 0,
                        message: "the destination could not be written".into(),
                        remote: false,
                    })
                };
                r.m.resolved(id, result);
                self.poll_soon(Side::Receiver)?;
            }
            Ev::RPoll => self.poll_receiver()?,
            Ev::RTimer => {
                let now = self.now;
                let inst = self.inst();
                let Some(r) = self.rcv.as_mut() else {
                    return Ok(());
                };
                if r.timer == Some(now) {
                    r.timer = None;
                    r.m.handle_timeout(inst).map_err(|e| bug("receiver", e))?;
                    self.poll_receiver()?;
                }
            }
            Ev::RReopen => self.reopen(Side::Receiver),
            Ev::Arrive { index, block } => self.arrive(index, block)?,
            Ev::Place { block, since } => self.place(block, since)?,
            Ev::Flush => self.flush()?,
            Ev::FlushSynced { results } => self.flush_synced(results),
        }
        Ok(())
    }

    fn ended(&self, side: Side) -> &Option<End> {
        match side {
            Side::Sender => &self.snd_end,
            Side::Receiver => &self.rcv_end,
        }
    }

    /// Polls `side`'s machine now, or (as a loop that takes several queued events first
    /// does) a little later.
    fn poll_soon(&mut self, side: Side) -> Result<(), String> {
        let batch = self.w.cfg.batch;
        let defer = self.chance(batch);
        let pending = match side {
            Side::Sender => self.snd.as_mut().map(|s| &mut s.poll_pending),
            Side::Receiver => self.rcv.as_mut().map(|r| &mut r.poll_pending),
        };
        let Some(pending) = pending else {
            return Ok(());
        };
        if *pending {
            return Ok(());
        }
        if !defer {
            return self.poll(side);
        }
        *pending = true;
        let ev = match side {
            Side::Sender => Ev::SPoll,
            Side::Receiver => Ev::RPoll,
        };
        self.after(Duration::from_micros(500), ev);
        Ok(())
    }

    fn poll(&mut self, side: Side) -> Result<(), String> {
        match side {
            Side::Sender => self.poll_sender(),
            Side::Receiver => self.poll_receiver(),
        }
    }

    /// A machine's queues grow only with what it is given: between two polls, what it
    /// produced (messages, work, events) is bounded by the calls made into it, times the
    /// window (an acknowledgement releases a window of files at once).
    fn check_proportion(&mut self, side: Side) -> Result<(), String> {
        let i = side as usize;
        let (fed, produced) = (self.fed[i], self.produced[i]);
        self.fed[i] = 0;
        self.produced[i] = 0;
        let bound = 8 * fed + 4 * u64::from(self.w.cfg.window) + 64;
        if produced > bound {
            return Err(format!(
                "the {side:?} machine produced {produced} outputs for {fed} inputs"
            ));
        }
        Ok(())
    }

    // ---- The control connection.

    fn send_control(&mut self, from: Side, msg: Message) -> Result<(), String> {
        let mut frame = Vec::new();
        encode_frame(&msg, &mut frame);
        match decode_frame(&frame) {
            Ok(back) if back == msg => {}
            other => {
                return Err(format!(
                    "{from:?} produced a message the wire does not carry: {msg:?} came back as {other:?}"
                ))
            }
        }
        self.report.messages += 1;
        self.trace(|| format!("{from:?} -> {}", describe(&msg)));
        if self.cut {
            return Ok(());
        }
        self.inflight[from as usize] += 1;
        let latency = self.w.cfg.latency;
        let delay = self.between(latency);
        let ev = match from {
            Side::Sender => Ev::RMsg(msg),
            Side::Receiver => Ev::SMsg(msg),
        };
        self.ordered(Stream::Control(from), delay, ev);
        Ok(())
    }

    fn deliver(&mut self, to: Side, msg: Message) -> Result<(), String> {
        let from = to.other();
        self.inflight[from as usize] -= 1;
        let blocked = match from {
            Side::Sender => self.snd.as_mut().map(|s| std::mem::take(&mut s.blocked)),
            Side::Receiver => self.rcv.as_mut().map(|r| std::mem::take(&mut r.blocked)),
        };
        if blocked == Some(true) {
            self.poll_soon(from)?;
        }
        if self.cut {
            return Ok(());
        }
        let inst = self.inst();
        self.trace(|| format!("{to:?} <- {}", describe(&msg)));
        match to {
            Side::Sender => {
                let Some(s) = self.snd.as_mut() else {
                    return Ok(());
                };
                s.m.handle_message(inst, msg)
                    .map_err(|e| bug("sender", e))?;
            }
            Side::Receiver => {
                let Some(r) = self.rcv.as_mut() else {
                    return Ok(());
                };
                r.m.handle_message(inst, msg)
                    .map_err(|e| bug("receiver", e))?;
            }
        }
        self.poll_soon(to)?;
        Ok(())
    }

    /// The control connection is gone under `side` (the driver's reader fails).
    fn control_ended(&mut self, side: Side) -> Result<(), String> {
        if self.ended(side).is_some() {
            return Ok(());
        }
        // The driver checks whether its session is over before it takes the next event:
        // everything that came before the end of the connection counts.
        let pending = match side {
            Side::Sender => self.snd.as_ref().is_some_and(|s| s.poll_pending),
            Side::Receiver => self.rcv.as_ref().is_some_and(|r| r.poll_pending),
        };
        if pending {
            self.poll(side)?;
            if self.ended(side).is_some() {
                return Ok(());
            }
        }
        let Some(cause) = self.fault.clone() else {
            return Err(format!(
                "the {side:?} lost its control connection with no fault to explain it \
                 (the {:?} ended {:?} first)",
                side.other(),
                self.ended(side.other())
            ));
        };
        self.trace(|| format!("{side:?} fails: {cause}"));
        self.end_side(side, End::Failed(cause));
        Ok(())
    }

    /// Moves what `side`'s machine wants sent onto the wire while its writer has room.
    fn transmit(&mut self, side: Side) -> Result<(), String> {
        let capacity = self.w.cfg.writer_capacity;
        let inst = self.inst();
        loop {
            if self.inflight[side as usize] >= capacity && !self.cut {
                match side {
                    Side::Sender => {
                        if let Some(s) = self.snd.as_mut() {
                            s.blocked = true;
                        }
                    }
                    Side::Receiver => {
                        if let Some(r) = self.rcv.as_mut() {
                            r.blocked = true;
                        }
                    }
                }
                return Ok(());
            }
            let msg = match side {
                Side::Sender => self.snd.as_mut().and_then(|s| s.m.poll_transmit(inst)),
                Side::Receiver => self.rcv.as_mut().and_then(|r| r.m.poll_transmit(inst)),
            };
            let Some(msg) = msg else { return Ok(()) };
            self.produced[side as usize] += 1;
            self.send_control(side, msg)?;
        }
    }

    fn arm_timer(&mut self, side: Side) {
        let now = self.now;
        let base = self.base;
        let (timeout, timer) = match side {
            Side::Sender => match self.snd.as_mut() {
                Some(s) => (s.m.poll_timeout(), &mut s.timer),
                None => return,
            },
            Side::Receiver => match self.rcv.as_mut() {
                Some(r) => (r.m.poll_timeout(), &mut r.timer),
                None => return,
            },
        };
        let Some(at) = timeout else {
            *timer = None;
            return;
        };
        // A deadline already past (a keepalive due while the writer is full) is retried
        // a little later, as the driver does when it is busy.
        let at = at
            .saturating_duration_since(base)
            .max(now + Duration::from_millis(1));
        if *timer == Some(at) {
            return;
        }
        *timer = Some(at);
        let ev = match side {
            Side::Sender => Ev::STimer,
            Side::Receiver => Ev::RTimer,
        };
        self.at(at, ev);
    }

    // ---- Data channels and the client's replacements.

    fn links(&mut self, side: Side) -> Option<&mut Links> {
        match side {
            Side::Sender => self.snd.as_mut().map(|s| &mut s.links),
            Side::Receiver => self.rcv.as_mut().map(|r| &mut r.links),
        }
    }

    fn open_link(&mut self, client: Side) {
        let Some(links) = self.links(client) else {
            return;
        };
        let index = links.next_index;
        links.next_index = links.next_index.wrapping_add(1);
        links.live.insert(index);
        self.report.channels_opened += 1;
        let d = self.between((Duration::from_micros(100), Duration::from_millis(20)));
        self.after(d, Ev::ChanOpen { index });
    }

    fn chan_open(&mut self, index: u16) {
        let client = if self.w.cfg.push {
            Side::Sender
        } else {
            Side::Receiver
        };
        let server = client.other();
        if self.ended(client).is_some() {
            return;
        }
        let max = usize::from(self.w.cfg.max_streams);
        let refused = match self.links(server) {
            None => true,
            Some(links) => links.live.len() >= max || links.live.contains(&index),
        };
        let join_fail = if self.calm {
            0.0
        } else {
            self.w.cfg.weather.join_fail
        };
        if refused || self.chance(join_fail) {
            self.trace(|| format!("channel {index} could not join"));
            let d = self.up_to(Duration::from_millis(5));
            let ev = match client {
                Side::Sender => Ev::SJoinFailed { index },
                Side::Receiver => Ev::RJoinFailed { index },
            };
            self.after(d, ev);
            return;
        }
        if let Some(links) = self.links(server) {
            links.live.insert(index);
        }
        self.trace(|| format!("channel {index} up"));
        self.chans.insert(
            index,
            Chan {
                alive: true,
                ..Chan::default()
            },
        );
        self.after(Duration::ZERO, Ev::RLinkUp { index });
        let d = self.between((Duration::from_micros(1), Duration::from_millis(2)));
        self.after(d, Ev::SLinkUp { index });
        if let Some(mean) = self.w.cfg.weather.channel_life {
            let u: f64 = self.w.rng.random_range(1e-6..1.0);
            let life = mean.mul_f64(-u.ln());
            self.after(life, Ev::ChanDie { index });
        }
    }

    /// Channel `index` stops carrying anything: the network lost it, or one end closed
    /// it (`by`). Each side's pump learns it in its own time.
    fn kill_chan(&mut self, index: u16, by: Option<Side>) {
        let Some(chan) = self.chans.get_mut(&index) else {
            return;
        };
        if !chan.alive {
            return;
        }
        chan.alive = false;
        let lost: Vec<(u64, Vec<(usize, u64)>)> = std::mem::take(&mut chan.in_flight);
        for (_, files) in lost {
            for (src, bytes) in files {
                *self.lost.entry(src).or_default() += bytes;
            }
        }
        self.report.channels_died += 1;
        self.trace(|| format!("channel {index} dies (closed by {by:?})"));
        let slow = Duration::from_millis(300);
        if self
            .snd
            .as_ref()
            .is_some_and(|s| s.pumps.contains_key(&index))
        {
            let d = if by == Some(Side::Sender) {
                Duration::ZERO
            } else {
                self.up_to(slow)
            };
            self.after(d, Ev::PumpNotice { index });
        }
        let d = if by == Some(Side::Receiver) {
            Duration::ZERO
        } else {
            self.up_to(slow)
        };
        self.receiver_pump_ends(index, d);
    }

    /// The receiver's pump of `index` ends, after everything it already reported.
    fn receiver_pump_ends(&mut self, index: u16, delay: Duration) {
        let up = self
            .rcv
            .as_ref()
            .is_some_and(|r| r.links.live.contains(&index));
        if !up || self.chans.get(&index).is_none_or(|c| c.rx_ended) {
            return;
        }
        if let Some(chan) = self.chans.get_mut(&index) {
            chan.rx_ended = true;
        }
        self.ordered(Stream::ReceiverPump(index), delay, Ev::RLinkEnded { index });
    }

    /// A link is gone on `side`: the client opens another while data remains to move,
    /// after a pause that grows while opening keeps failing.
    fn link_lost(&mut self, side: Side, index: u16, running: bool) {
        let Some(links) = self.links(side) else {
            return;
        };
        links.live.remove(&index);
        if running && links.client {
            let backoff = links.backoff;
            links.backoff = (links.backoff * 2).min(BACKOFF_MAX);
            let ev = match side {
                Side::Sender => Ev::SReopen,
                Side::Receiver => Ev::RReopen,
            };
            self.after(backoff, ev);
        }
    }

    fn reopen(&mut self, side: Side) {
        let max = usize::from(self.w.cfg.max_streams);
        if self.links(side).is_some_and(|l| l.live.len() < max) {
            self.open_link(side);
        }
    }

    // ---- The sender's driver.

    fn poll_sender(&mut self) -> Result<(), String> {
        let Some(s) = self.snd.as_mut() else {
            return Ok(());
        };
        s.poll_pending = false;
        let mut walked = 0;
        while s.walking && s.m.wants_entries() && walked < 4096 {
            walked += 1;
            let Some(e) = self.w.src.get(s.next_entry) else {
                s.walking = false;
                s.m.skipped(std::mem::take(&mut s.specials));
                s.m.walk_done();
                break;
            };
            let src = s.next_entry;
            s.next_entry += 1;
            if e.kind == Kind::Special {
                s.specials.push(e.path.as_bytes().to_vec());
                continue;
            }
            let id = s.m.push_entry(entry_of(e));
            self.fed[Side::Sender as usize] += 1;
            if e.kind == Kind::File {
                s.contents.insert(id, src);
            }
        }
        self.transmit(Side::Sender)?;
        self.sender_work()?;
        self.start_readers();
        let inst = self.inst();
        let rtt = self.w.cfg.latency.0 * 2;
        let Some(s) = self.snd.as_mut() else {
            return Ok(());
        };
        // As the engine's driver does, on a sending client only: hold back (unless no
        // pump would be left to take blocks), then cut.
        let held: BTreeSet<u16> = if s.links.client {
            s.m.held_back(inst, rtt).into_iter().collect()
        } else {
            BTreeSet::new()
        };
        let takers = s
            .pumps
            .keys()
            .filter(|i| !s.cut.contains(i) && !held.contains(i))
            .count();
        s.held = if takers > 0 { held } else { BTreeSet::new() };
        for index in &s.held {
            if s.ever_held.insert(*index) {
                self.report.channels_held_back += 1;
            }
        }
        let cut = if s.links.client {
            s.m.cut_stragglers(inst, rtt)
        } else {
            Vec::new()
        };
        s.cut.extend(cut.iter().copied());
        for index in cut {
            self.report.channels_cut += 1;
            self.trace(|| format!("channel {index} cut at the end"));
        }
        let Some(s) = self.snd.as_mut() else {
            return Ok(());
        };
        while let Some(event) = s.m.poll_event() {
            self.produced[Side::Sender as usize] += 1;
            match event {
                Event::Resolved { id, outcome, .. } => {
                    s.contents.remove(&id);
                    if s.outcomes.insert(id, outcome).is_some() {
                        return Err(format!("the sender resolved file id {id} twice"));
                    }
                }
                Event::FinishRequested => s.m.send_stats(Stats::default()),
                Event::PeerStats(_) | Event::Skipped(_) | Event::Note(_) => {}
            }
        }
        if s.m.all_resolved() {
            s.jobs.clear();
            if s.links.client {
                s.m.finish();
            }
        }
        self.transmit(Side::Sender)?;
        self.check_proportion(Side::Sender)?;
        if self.snd.as_ref().is_some_and(|s| s.m.is_done()) {
            self.trace(|| "sender done".into());
            self.end_side(Side::Sender, End::Done);
            return Ok(());
        }
        self.arm_timer(Side::Sender);
        Ok(())
    }

    fn sender_work(&mut self) -> Result<(), String> {
        loop {
            let Some(s) = self.snd.as_mut() else {
                return Ok(());
            };
            let Some(work) = s.m.poll_work() else {
                return Ok(());
            };
            self.produced[Side::Sender as usize] += 1;
            match work {
                SenderWork::Read(plan) => {
                    let files: Vec<(u64, usize)> = match &plan {
                        Plan::Chunks { id, .. } => s
                            .contents
                            .get(id)
                            .map(|src| vec![(*id, *src)])
                            .unwrap_or_default(),
                        Plan::Packed { files } => files
                            .iter()
                            .filter_map(|(id, _)| s.contents.get(id).map(|src| (*id, *src)))
                            .collect(),
                    };
                    if files.is_empty() {
                        continue;
                    }
                    let plan = match plan {
                        Plan::Packed { files: all } => Plan::Packed {
                            files: all
                                .into_iter()
                                .filter(|(id, _)| files.iter().any(|(f, _)| f == id))
                                .collect(),
                        },
                        chunked => chunked,
                    };
                    self.note_plan(&plan, &files)?;
                    if let Some(s) = self.snd.as_mut() {
                        s.jobs.push_back(Job::Read { plan, files });
                    }
                }
                SenderWork::Verify { id, ranges } => {
                    if let Some(&src) = s.contents.get(&id) {
                        s.jobs.push_back(Job::Verify { id, src, ranges });
                    }
                }
                SenderWork::CloseChannel(index) => self.kill_chan(index, Some(Side::Sender)),
            }
        }
    }

    /// Counts what a plan sends, for the checks on what is sent again.
    fn note_plan(&mut self, plan: &Plan, files: &[(u64, usize)]) -> Result<(), String> {
        let bs = self.w.cfg.block_size;
        let pieces: Vec<(u64, u64, u64)> = match plan {
            Plan::Chunks { id, size, ranges } => {
                if ranges.iter().any(|&(s, e)| s >= e || e > *size) {
                    return Err(format!("the sender planned {ranges:?} of file id {id}"));
                }
                chunks(ranges, bs)
                    .map(|(o, l)| (*id, o, o + u64::from(l)))
                    .collect()
            }
            Plan::Packed { files } => files.iter().map(|&(id, size)| (id, 0, size)).collect(),
        };
        for (id, start, end) in pieces {
            let Some(&(_, src)) = files.iter().find(|(f, _)| *f == id) else {
                continue;
            };
            self.report.bytes_planned += end - start;
            let (coverage, total) = self.planned.entry(src).or_default();
            *total += end - start;
            for (s, e) in gaps_within(coverage, start, end) {
                let _ = coverage.add(s, e);
            }
        }
        Ok(())
    }

    fn start_readers(&mut self) {
        loop {
            let readers = self.w.cfg.readers;
            let Some(s) = self.snd.as_mut() else { return };
            if s.readers_busy >= readers {
                return;
            }
            let Some(job) = s.jobs.pop_front() else {
                return;
            };
            s.readers_busy += 1;
            let blocks = match &job {
                Job::Read { plan, .. } => plan.bytes() / self.w.cfg.block_size + 1,
                Job::Verify { ranges, .. } => ranges.len() as u64,
            };
            let d = self.up_to(Duration::from_micros(300)) * (blocks.min(64) as u32);
            self.after(d, Ev::ReaderDone { job });
        }
    }

    fn reader_done(&mut self, job: Job) {
        let Some(s) = self.snd.as_mut() else { return };
        s.readers_busy -= 1;
        let fail = if self.calm {
            0.0
        } else {
            self.w.cfg.weather.read_fail
        };
        match job {
            Job::Verify { id, src, ranges } => {
                if self.chance(fail) {
                    self.after(Duration::ZERO, Ev::SReadFailed { id });
                } else {
                    let label = self.w.src[src].label;
                    let matches = ranges
                        .iter()
                        .map(|r| r.digest == digest(label, r.offset, r.len))
                        .collect();
                    self.after(Duration::ZERO, Ev::SVerified { id, matches });
                }
            }
            Job::Read { plan, files } => {
                let failing = if self.chance(fail) {
                    let (id, _) = files[self.w.rng.random_range(0..files.len())];
                    self.after(Duration::ZERO, Ev::SReadFailed { id });
                    Some(id)
                } else {
                    None
                };
                let bs = self.w.cfg.block_size;
                let src_of = |id: u64| files.iter().find(|(f, _)| *f == id).map(|(_, s)| *s);
                let mut blocks = Vec::new();
                match &plan {
                    Plan::Chunks { id, ranges, .. } => {
                        if failing.is_none() {
                            let src = src_of(*id).expect("planned files are known");
                            let label = self.w.src[src].label;
                            for (offset, len) in chunks(ranges, bs) {
                                blocks.push(vec![Seg {
                                    id: *id,
                                    src,
                                    offset,
                                    len,
                                    label,
                                    digest: digest(label, offset, len),
                                }]);
                            }
                        }
                    }
                    Plan::Packed { files: packed } => {
                        let segs: Vec<Seg> = packed
                            .iter()
                            .filter(|(id, _)| Some(*id) != failing)
                            .map(|&(id, size)| {
                                let src = src_of(id).expect("planned files are known");
                                let label = self.w.src[src].label;
                                Seg {
                                    id,
                                    src,
                                    offset: 0,
                                    len: size as u32,
                                    label,
                                    digest: digest(label, 0, size as u32),
                                }
                            })
                            .collect();
                        if !segs.is_empty() {
                            blocks.push(segs);
                        }
                    }
                }
                for segs in blocks {
                    self.next_serial += 1;
                    let block = Block {
                        serial: self.next_serial,
                        segs,
                    };
                    if let Some(s) = self.snd.as_mut() {
                        s.send_queue.push_back(block);
                    }
                }
            }
        }
        self.kick_pumps();
        self.start_readers();
    }

    /// Idle pumps take the next block from the shared queue.
    fn kick_pumps(&mut self) {
        let Some(s) = self.snd.as_mut() else { return };
        let mut idle: Vec<u16> = s
            .pumps
            .iter()
            .filter(|(i, b)| b.is_none() && !s.cut.contains(i) && !s.held.contains(i))
            .map(|(i, _)| *i)
            .collect();
        idle.shuffle(&mut self.w.rng);
        for index in idle {
            let Some(s) = self.snd.as_mut() else { return };
            let Some(block) = s.send_queue.pop_front() else {
                return;
            };
            let payload = block.segs.iter().map(|g| u64::from(g.len)).sum();
            s.pumps.insert(index, Some(block));
            self.ordered(
                Stream::SenderPump(index),
                Duration::ZERO,
                Ev::STaken { index, payload },
            );
            let block_time = self.w.cfg.block_time;
            let mut d = self.between(block_time);
            if let Some((_, times)) = self.w.cfg.slow_channel.filter(|(slow, _)| *slow == index) {
                d *= times;
            }
            self.after(d, Ev::PumpDone { index });
        }
    }

    /// A pump has written its block: the sender hears it went out, and the block is on
    /// the wire if the channel still carries anything.
    fn pump_done(&mut self, index: u16) {
        let Some(s) = self.snd.as_mut() else { return };
        let Some(slot) = s.pumps.get_mut(&index) else {
            return;
        };
        let Some(block) = slot.take() else { return };
        self.report.blocks_sent += 1;
        let serial = block.serial;
        let refs = block.refs();
        let bytes: Vec<(usize, u64)> = block
            .segs
            .iter()
            .map(|g| (g.src, u64::from(g.len)))
            .collect();
        let alive = self.chans.get(&index).is_some_and(|c| c.alive);
        if alive {
            let latency = self.w.cfg.latency;
            let d = self.between(latency);
            let t = self.ordered(Stream::Data(index), d, Ev::Arrive { index, block });
            let chan = self.chans.get_mut(&index).expect("alive");
            chan.last_arrival = t;
            chan.in_flight.push((serial, bytes));
        } else {
            for (src, b) in bytes {
                *self.lost.entry(src).or_default() += b;
            }
        }
        let d = self.up_to(Duration::from_micros(200));
        self.ordered(
            Stream::SenderPump(index),
            d,
            Ev::SSent { index, segs: refs },
        );
        self.kick_pumps();
    }

    /// A pump learns its channel is dead: the block in its hands did not go out, and it
    /// ends with an error.
    fn pump_notice(&mut self, index: u16) {
        let Some(s) = self.snd.as_mut() else { return };
        let Some(holding) = s.pumps.remove(&index) else {
            return;
        };
        if let Some(block) = holding {
            for g in &block.segs {
                *self.lost.entry(g.src).or_default() += u64::from(g.len);
            }
            self.ordered(
                Stream::SenderPump(index),
                Duration::ZERO,
                Ev::SUnsent {
                    index,
                    segs: block.refs(),
                },
            );
        }
        let d = self.up_to(Duration::from_micros(200));
        self.ordered(Stream::SenderPump(index), d, Ev::SLinkEnded { index });
        self.kick_pumps();
    }

    // ---- The receiver's driver.

    fn poll_receiver(&mut self) -> Result<(), String> {
        let Some(r) = self.rcv.as_mut() else {
            return Ok(());
        };
        r.poll_pending = false;
        self.transmit(Side::Receiver)?;
        loop {
            let Some(r) = self.rcv.as_mut() else {
                return Ok(());
            };
            let Some(work) = r.m.poll_work() else { break };
            self.produced[Side::Receiver as usize] += 1;
            match work {
                ReceiverWork::Apply { id, entry } => {
                    self.fed[Side::Receiver as usize] += 1;
                    let applied = self.apply(id, &entry)?;
                    self.trace(|| format!("applied {id} {}: {applied:?}", entry.path));
                    if let Some(r) = self.rcv.as_mut() {
                        r.m.applied(id, applied).map_err(|e| bug("receiver", e))?;
                    }
                }
                ReceiverWork::Accept { id, ranges } => self.accept(id, ranges)?,
                ReceiverWork::Abandon { id } => self.abandon(id),
                ReceiverWork::CloseChannel(index) => self.kill_chan(index, Some(Side::Receiver)),
            }
        }
        let Some(r) = self.rcv.as_mut() else {
            return Ok(());
        };
        while let Some(event) = r.m.poll_event() {
            self.produced[Side::Receiver as usize] += 1;
            match event {
                Event::Resolved { id, outcome, .. } => {
                    if r.outcomes.insert(id, outcome).is_some() {
                        return Err(format!("the receiver resolved file id {id} twice"));
                    }
                }
                Event::FinishRequested => r.m.send_stats(Stats::default()),
                Event::PeerStats(_) | Event::Skipped(_) | Event::Note(_) => {}
            }
        }
        if r.m.all_resolved() && r.links.client && !r.finish_sent {
            r.finish_sent = true;
            r.m.finish();
        }
        self.transmit(Side::Receiver)?;
        self.check_proportion(Side::Receiver)?;
        if self.rcv.as_ref().is_some_and(|r| r.m.is_done()) {
            self.trace(|| "receiver done".into());
            self.end_side(Side::Receiver, End::Done);
            return Ok(());
        }
        self.arm_timer(Side::Receiver);
        Ok(())
    }

    /// The sink's `apply_entry`: what is there already decides what must be sent.
    fn apply(&mut self, id: u64, entry: &Entry) -> Result<Applied, String> {
        let path = String::from_utf8(entry.path.as_bytes().to_vec()).expect("ours");
        let Some(&src) = self.w.by_path.get(&path) else {
            return Err(format!(
                "the sender announced {path}, which is not in the source"
            ));
        };
        let e = self.w.src[src].clone();
        let expected = entry_of(&e);
        if *entry != expected {
            return Err(format!(
                "entry {id} arrived as {entry:?}, sent as {expected:?}"
            ));
        }
        if let Some(r) = self.rcv.as_mut() {
            if r.ids.insert(id, src).is_some() {
                return Err(format!("file id {id} applied twice"));
            }
        }
        let fail = if self.calm {
            0.0
        } else {
            self.w.cfg.weather.apply_fail
        };
        if self.chance(fail) {
            // As the engine's sink does: data a fresh pull's sender sent behind the entry
            // is dropped (seed 82348 found the model ending the session on it).
            if let Some(r) = self.rcv.as_mut() {
                r.failed.insert(id);
            }
            return Ok(Applied::Failed(Failure {
                class: FailureClass::Refused,
                offset: 0,
                message: "cannot be placed here".into(),
                remote: false,
            }));
        }
        let compare = self.w.cfg.compare;
        let existing = self.w.disk.names.get(&path).cloned();
        match e.kind {
            Kind::Dir => {
                self.w.disk.names.insert(path, Node::Dir);
                Ok(Applied::Done)
            }
            Kind::Symlink => {
                if compare != Compare::Always
                    && existing
                        == Some(Node::Symlink {
                            target: e.target.clone(),
                        })
                {
                    return Ok(Applied::UpToDate);
                }
                self.new_slot(id, src, &e, TempRef::None, None, false);
                self.commit_job(CJob::Symlink {
                    id,
                    src,
                    dest: path,
                });
                Ok(Applied::Pending)
            }
            Kind::File => {
                let same = matches!(&existing, Some(Node::File { size, mtime, .. })
                    if *size == e.size && *mtime == e.mtime);
                if compare != Compare::Always && same {
                    self.forget_partial(&path);
                    return Ok(Applied::UpToDate);
                }
                if e.size == 0 {
                    self.new_slot(id, src, &e, TempRef::None, None, false);
                    self.commit_job(CJob::Commit {
                        id,
                        src,
                        dest: path,
                        size: 0,
                        mtime: e.mtime,
                        unnamed: Some(Runs::default()),
                        journaled: None,
                    });
                    return Ok(Applied::Pending);
                }
                if let Some((file, ranges)) = self.resume(&path, &e) {
                    let file = if self.w.as_engine {
                        file
                    } else {
                        self.rejournal(file, &e)
                    };
                    let slot = self.new_slot(id, src, &e, TempRef::Named, Some(file), false);
                    slot.offered = ranges.clone();
                    return Ok(Applied::Held(ranges));
                }
                if compare == Compare::Checksum {
                    if let Some(Node::File { size, data, .. }) = &existing {
                        if *size == e.size {
                            let held: Vec<HeldRange> =
                                chunks(&[(0, e.size)], self.w.cfg.block_size)
                                    .take(MAX_HELD_RANGES_PER_FILE)
                                    .map(|(offset, len)| HeldRange {
                                        offset,
                                        len,
                                        digest: data.digest(offset, len),
                                    })
                                    .collect();
                            let slot = self.new_slot(id, src, &e, TempRef::None, None, true);
                            slot.offered = held.clone();
                            return Ok(Applied::Held(held));
                        }
                    }
                }
                self.new_slot(id, src, &e, TempRef::None, None, false);
                Ok(Applied::Pending)
            }
            Kind::Special => Err(format!("the sender announced {path}, which it should skip")),
        }
    }

    fn new_slot(
        &mut self,
        id: u64,
        src: usize,
        e: &super::world::SrcEntry,
        temp: TempRef,
        journaled: Option<u32>,
        in_place: bool,
    ) -> &mut Slot {
        let r = self.rcv.as_mut().expect("applying");
        r.slots.insert(
            id,
            Slot {
                src,
                dest: e.path.clone(),
                size: e.size,
                mtime: e.mtime,
                coverage: Coverage::default(),
                temp,
                journaled,
                unjournaled: Vec::new(),
                unjournaled_bytes: 0,
                in_place,
                offered: Vec::new(),
            },
        );
        r.slots.get_mut(&id).expect("just inserted")
    }

    /// The journal's partial file for `dest`, if it is of this version of the source and
    /// its temporary is still there.
    fn resume(&mut self, dest: &str, e: &super::world::SrcEntry) -> Option<(u32, Vec<HeldRange>)> {
        let r = self.rcv.as_ref()?;
        let (file, partial) = r.journal.find(dest.as_bytes())?;
        let same_source =
            partial.size == e.size && (partial.mtime_sec, partial.mtime_nsec) == e.mtime;
        if same_source && !partial.ranges.is_empty() && self.w.disk.temps.contains_key(dest) {
            return Some((file, partial.ranges.clone()));
        }
        self.forget_partial(dest);
        None
    }

    /// Stops vouching for a resumed file's ranges until the sender has checked them: a
    /// range it refuses is written again, possibly before its verdict arrives, and a
    /// crash can keep some of the new bytes, so a record still naming the old digest
    /// would match the source if it were put back to that version (seed 118779). The
    /// file goes on under a new number with no ranges, durably before anything can be
    /// written to it; the accepted ranges are journaled again on `Accept`, as the
    /// engine's `Sink::resume` does (see `World::as_engine` for the sink before it did).
    fn rejournal(&mut self, old: u32, e: &super::world::SrcEntry) -> u32 {
        self.w.append_closed(old, &e.path);
        let r = self.rcv.as_mut().expect("applying");
        let file = r.next_file;
        r.next_file += 1;
        self.w.disk.append(&[Record::Partial {
            file,
            dest: e.path.as_bytes().to_vec(),
            size: e.size,
            mtime_sec: e.mtime.0,
            mtime_nsec: e.mtime.1,
            temp_name: b".part".to_vec(),
        }]);
        self.w.disk.sync_journal();
        self.w.journal_synced();
        file
    }

    fn forget_partial(&mut self, dest: &str) {
        let Some(r) = self.rcv.as_ref() else { return };
        let Some((file, _)) = r.journal.find(dest.as_bytes()) else {
            return;
        };
        self.w.disk.temps.remove(dest);
        self.w.append_closed(file, dest);
    }

    /// The sink's `accept`: held ranges the sender confirmed count as received.
    fn accept(&mut self, id: u64, ranges: Vec<HeldRange>) -> Result<(), String> {
        let Some(src) = self.pending_slot(id)? else {
            return Ok(());
        };
        let label = self.w.src[src].label;
        let r = self.rcv.as_mut().expect("accepting");
        let slot = r.slots.get_mut(&id).expect("pending");
        // The verdict the sender sent must be the one its readers found.
        let expected: Vec<HeldRange> = slot
            .offered
            .iter()
            .filter(|h| h.digest == digest(label, h.offset, h.len))
            .copied()
            .collect();
        if ranges != expected {
            return Err(format!(
                "file id {id}: the sender confirmed {ranges:?} of {:?}, but the source matches {expected:?}",
                slot.offered
            ));
        }
        if slot.in_place && !ranges.is_empty() {
            let all: u64 = ranges.iter().map(|r| u64::from(r.len)).sum();
            if all == slot.size {
                let slot = r.slots.remove(&id).expect("pending");
                return self.keep_in_place(id, slot);
            }
            let dest = slot.dest.clone();
            let Some(Node::File { data, .. }) = self.w.disk.names.get(&dest).cloned() else {
                return Err(format!("{dest}: compared in place, but nothing is there"));
            };
            self.ensure_temp(id, false);
            let temp = self.w.disk.temps.entry(dest).or_default();
            for h in &ranges {
                for (s, e, l) in data.runs() {
                    let (s, e) = (s.max(h.offset), e.min(h.offset + u64::from(h.len)));
                    if s < e {
                        temp.write(s, e, l);
                    }
                }
            }
        }
        let r = self.rcv.as_mut().expect("accepting");
        let slot = r.slots.get_mut(&id).expect("pending");
        for h in &ranges {
            let end = h.offset + u64::from(h.len);
            if end > slot.size {
                return Err(format!("file id {id}: a held range past its size"));
            }
            slot.coverage
                .add(h.offset, end)
                .map_err(|e| format!("file id {id}: accepting {h:?}: {e}"))?;
        }
        if slot.in_place {
            slot.unjournaled.extend(ranges.iter().map(|h| (*h, label)));
        } else if let (Some(file), false) = (slot.journaled, self.w.as_engine || ranges.is_empty())
        {
            // Resumed: vouched for again now that the sender has checked them (their
            // bytes have been durable since an earlier session).
            let dest = slot.dest.clone();
            for piece in ranges.chunks(MAX_HELD_RANGES) {
                self.w.disk.append(&[Record::Verified {
                    file,
                    ranges: piece.to_vec(),
                }]);
            }
            let labelled: Vec<(HeldRange, Label)> = ranges.iter().map(|h| (*h, label)).collect();
            self.w.note_verified(file, &dest, &labelled);
        }
        self.maybe_complete(id)
    }

    fn keep_in_place(&mut self, id: u64, slot: Slot) -> Result<(), String> {
        let label = self.w.src[slot.src].label;
        match self.w.disk.names.get_mut(&slot.dest) {
            Some(Node::File { size, mtime, data }) => {
                if !data.is_whole(*size, label) || *size != slot.size {
                    return Err(format!(
                        "{}: kept in place as {}, but the source is v{label}",
                        slot.dest,
                        data.describe()
                    ));
                }
                *mtime = slot.mtime;
            }
            other => {
                return Err(format!(
                    "{}: kept in place, but there is {other:?}",
                    slot.dest
                ))
            }
        }
        self.ordered(
            Stream::Committer,
            Duration::ZERO,
            Ev::RResolved { id, ok: true },
        );
        Ok(())
    }

    fn abandon(&mut self, id: u64) {
        let Some(r) = self.rcv.as_mut() else { return };
        r.failed.insert(id);
        let Some(slot) = r.slots.remove(&id) else {
            return;
        };
        if let TempRef::Named = slot.temp {
            self.w.disk.temps.remove(&slot.dest);
        }
        if let Some(file) = slot.journaled {
            self.w.append_closed(file, &slot.dest);
        }
    }

    /// The slot data for `id` goes to; `None` for a file that failed; an error for any
    /// other id (the sink ends the session there).
    fn pending_slot(&mut self, id: u64) -> Result<Option<usize>, String> {
        let r = self.rcv.as_ref().expect("receiving");
        if let Some(slot) = r.slots.get(&id) {
            return Ok(Some(slot.src));
        }
        if r.failed.contains(&id) {
            return Ok(None);
        }
        Err(format!("data for file id {id}, which is not pending"))
    }

    fn arrive(&mut self, index: u16, block: Block) -> Result<(), String> {
        let Some(chan) = self.chans.get_mut(&index) else {
            return Ok(());
        };
        if !chan.alive || chan.rx_ended {
            return Ok(()); // lost with the channel (counted when it died)
        }
        chan.in_flight.retain(|(serial, _)| *serial != block.serial);
        if self.rcv.is_none() {
            return Ok(());
        }
        for g in &block.segs {
            self.arrived
                .entry(g.id)
                .or_default()
                .add(g.offset, g.end())
                .map_err(|e| {
                    format!(
                        "file id {} bytes {}..{} reached the receiver twice in one session ({e})",
                        g.id,
                        g.offset,
                        g.end()
                    )
                })?;
        }
        let place = self.w.cfg.place_delay;
        let d = self.up_to(place);
        self.after(d, Ev::Place { block, since: None });
        let d = self.up_to(Duration::from_micros(100));
        self.ordered(Stream::ReceiverPump(index), d, Ev::RReceived { index });
        Ok(())
    }

    /// A writer places a block, segment by segment (the sink's `place_segment`).
    fn place(&mut self, block: Block, since: Option<Duration>) -> Result<(), String> {
        if self.rcv.is_none() {
            return Ok(());
        }
        let fail = if self.calm {
            0.0
        } else {
            self.w.cfg.weather.write_fail
        };
        let mut segs = block.segs.into_iter();
        while let Some(g) = segs.next() {
            if self.rcv.is_none() {
                return Ok(());
            }
            let waited = since.map_or(Duration::ZERO, |t| self.now - t);
            match self.pending_slot(g.id) {
                Ok(Some(_)) => {}
                Ok(None) => continue,
                // The sink's writer waits for the entry, up to the stall timeout.
                Err(_) if self.fresh && waited < self.w.cfg.stall_timeout => {
                    let rest = Block {
                        serial: block.serial,
                        segs: std::iter::once(g).chain(segs).collect(),
                    };
                    let since = Some(since.unwrap_or(self.now));
                    self.after(Duration::from_millis(1), Ev::Place { block: rest, since });
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            let r = self.rcv.as_mut().expect("receiving");
            let slot = r.slots.get_mut(&g.id).expect("pending");
            if g.end() > slot.size {
                return Err(format!("file id {}: data past its size", g.id));
            }
            if slot.src != g.src {
                return Err(format!("file id {}: data of another file", g.id));
            }
            slot.coverage.check_free(g.offset, g.end()).map_err(|e| {
                format!("file id {}: {e} (the sink refuses overlapping data)", g.id)
            })?;
            if self.chance(fail) {
                self.abandon(g.id);
                self.ordered(
                    Stream::Committer,
                    Duration::ZERO,
                    Ev::RResolved {
                        id: g.id,
                        ok: false,
                    },
                );
                continue;
            }
            let whole = u64::from(g.len) == self.rcv.as_ref().expect("receiving").slots[&g.id].size;
            self.ensure_temp(g.id, whole);
            let r = self.rcv.as_mut().expect("receiving");
            let slot = r.slots.get_mut(&g.id).expect("pending");
            match &mut slot.temp {
                TempRef::Unnamed(runs) => runs.write(g.offset, g.end(), g.label),
                TempRef::Named => self
                    .w
                    .disk
                    .temps
                    .entry(slot.dest.clone())
                    .or_default()
                    .write(g.offset, g.end(), g.label),
                TempRef::None => unreachable!("ensured"),
            }
            slot.coverage
                .add(g.offset, g.end())
                .map_err(|e| format!("file id {}: {e}", g.id))?;
            if slot.journaled.is_some() {
                slot.unjournaled.push((
                    HeldRange {
                        offset: g.offset,
                        len: g.len,
                        digest: g.digest,
                    },
                    g.label,
                ));
                slot.unjournaled_bytes += u64::from(g.len);
            }
            self.maybe_complete(g.id)?;
        }
        Ok(())
    }

    /// The file's temporary, created on first use: unnamed for a file that comes whole in
    /// one segment, named and journaled otherwise.
    fn ensure_temp(&mut self, id: u64, whole: bool) {
        let r = self.rcv.as_mut().expect("receiving");
        let slot = r.slots.get_mut(&id).expect("pending");
        if !matches!(slot.temp, TempRef::None) {
            return;
        }
        if whole {
            slot.temp = TempRef::Unnamed(Runs::default());
            return;
        }
        slot.temp = TempRef::Named;
        self.w.disk.temps.insert(slot.dest.clone(), Temp::default());
        let file = r.next_file;
        r.next_file += 1;
        slot.journaled = Some(file);
        let record = Record::Partial {
            file,
            dest: slot.dest.as_bytes().to_vec(),
            size: slot.size,
            mtime_sec: slot.mtime.0,
            mtime_nsec: slot.mtime.1,
            temp_name: b".part".to_vec(),
        };
        self.w.disk.append(&[record]);
        if !self.w.as_engine {
            // The temporary's name is the destination's, in every session: a record of
            // an earlier temporary under that name (closed, but not durably) must not
            // outlive the crash that finds this one there. See `World::as_engine`.
            self.w.disk.sync_journal();
            self.w.journal_synced();
        }
    }

    /// A complete file goes to the committer; a partial one is checkpointed every
    /// `checkpoint_bytes`.
    fn maybe_complete(&mut self, id: u64) -> Result<(), String> {
        let checkpoint_bytes = self.w.cfg.checkpoint_bytes;
        let r = self.rcv.as_mut().expect("receiving");
        let slot = r.slots.get_mut(&id).expect("pending");
        if !slot.coverage.is_complete(slot.size) {
            if slot.unjournaled_bytes >= checkpoint_bytes {
                if let (Some(file), TempRef::Named) = (slot.journaled, &slot.temp) {
                    let ranges = std::mem::take(&mut slot.unjournaled);
                    slot.unjournaled_bytes = 0;
                    let dest = slot.dest.clone();
                    self.commit_job(CJob::Checkpoint { file, dest, ranges });
                }
            }
            return Ok(());
        }
        let slot = r.slots.remove(&id).expect("pending");
        let unnamed = match slot.temp {
            TempRef::Unnamed(runs) => Some(runs),
            TempRef::Named => None,
            TempRef::None => {
                return Err(format!("file id {id} is complete with nothing written"));
            }
        };
        self.commit_job(CJob::Commit {
            id,
            src: slot.src,
            dest: slot.dest,
            size: slot.size,
            mtime: slot.mtime,
            unnamed,
            journaled: slot.journaled,
        });
        Ok(())
    }

    // ---- The committer.

    fn commit_job(&mut self, job: CJob) {
        let r = self.rcv.as_mut().expect("receiving");
        r.committer.push_back(job);
        if !r.flushing {
            r.flushing = true;
            let d = self.up_to(Duration::from_millis(20));
            self.after(d, Ev::Flush);
        }
    }

    /// One batch: data durable, then names and journal records, then (at
    /// [`Ev::FlushSynced`]) those durable and the files acknowledged.
    fn flush(&mut self) -> Result<(), String> {
        let Some(r) = self.rcv.as_mut() else {
            return Ok(());
        };
        let batch: Vec<CJob> = r.committer.drain(..).collect();
        let results = self.apply_batch(batch)?;
        let d = self.up_to(Duration::from_millis(5));
        self.after(d, Ev::FlushSynced { results });
        Ok(())
    }

    fn apply_batch(&mut self, batch: Vec<CJob>) -> Result<Vec<u64>, String> {
        self.w.disk.sync_data();
        let mut results = Vec::new();
        for job in batch {
            match job {
                CJob::Checkpoint { file, dest, ranges } => {
                    for piece in ranges.chunks(MAX_HELD_RANGES) {
                        let record = Record::Verified {
                            file,
                            ranges: piece.iter().map(|(h, _)| *h).collect(),
                        };
                        self.w.disk.append(&[record]);
                    }
                    self.w.note_verified(file, &dest, &ranges);
                }
                CJob::Symlink { id, src, dest } => {
                    let target = self.w.src[src].target.clone();
                    self.write_name(&dest)?;
                    self.w.disk.rename(&dest, Node::Symlink { target });
                    results.push(id);
                }
                CJob::Commit {
                    id,
                    src,
                    dest,
                    size,
                    mtime,
                    unnamed,
                    journaled,
                } => {
                    let data = match unnamed {
                        Some(runs) => runs,
                        None => self
                            .w
                            .disk
                            .temps
                            .get(&dest)
                            .map(Temp::content)
                            .ok_or_else(|| format!("{dest}: its temporary is gone"))?,
                    };
                    let e = &self.w.src[src];
                    if e.path != dest || e.size != size || e.mtime != mtime {
                        return Err(format!("{dest}: committed as another entry"));
                    }
                    if !data.is_whole(size, e.label) {
                        return Err(format!(
                            "{dest} would be put in place holding {} but its source is v{} of {size} bytes",
                            data.describe(),
                            e.label
                        ));
                    }
                    self.write_name(&dest)?;
                    self.w.disk.rename(&dest, Node::File { size, mtime, data });
                    if let Some(file) = journaled {
                        self.w.append_closed(file, &dest);
                    }
                    results.push(id);
                }
            }
        }
        Ok(results)
    }

    fn write_name(&mut self, dest: &str) -> Result<(), String> {
        self.trace(|| format!("{dest} put in place"));
        if !self.written.insert(dest.to_string()) {
            return Err(format!("{dest} was put in place twice in one session"));
        }
        if self.up_to_date.contains(dest) && self.w.cfg.compare != Compare::Always {
            return Err(format!("{dest} was up to date, and was written again"));
        }
        Ok(())
    }

    fn flush_synced(&mut self, results: Vec<u64>) {
        if self.rcv.is_none() {
            return; // closed (and synced) or crashed (and not) meanwhile
        }
        self.w.disk.sync_names();
        self.w.disk.sync_journal();
        self.w.journal_synced();
        for id in results {
            self.ordered(
                Stream::Committer,
                Duration::ZERO,
                Ev::RResolved { id, ok: true },
            );
        }
        let Some(r) = self.rcv.as_mut() else { return };
        if r.committer.is_empty() {
            r.flushing = false;
        } else {
            let d = self.up_to(Duration::from_millis(20));
            self.after(d, Ev::Flush);
        }
    }

    // ---- The end of a side.

    fn end_side(&mut self, side: Side, end: End) {
        if end == End::Done {
            let entries = self
                .w
                .src
                .iter()
                .filter(|e| e.kind != Kind::Special)
                .count();
            let outcomes = match side {
                Side::Sender => self.snd.as_ref().map(|s| &s.outcomes),
                Side::Receiver => self.rcv.as_ref().map(|r| &r.outcomes),
            };
            let outcomes = outcomes.expect("a side that ends is there");
            if outcomes.len() != entries {
                self.w.late_error.get_or_insert(format!(
                    "the {side:?} finished with {} of {entries} entries resolved",
                    outcomes.len()
                ));
            }
            self.report.failures += outcomes
                .values()
                .filter(|o| matches!(o, Outcome::Failed(_)))
                .count() as u64;
        }
        match side {
            Side::Sender => {
                self.snd = None;
                self.snd_end = Some(end.clone());
            }
            Side::Receiver => {
                self.rcv_end = Some(end.clone());
                match end {
                    End::Crashed => {
                        self.rcv = None;
                        self.w.crash();
                    }
                    End::Done => self.close_receiver(true),
                    End::Failed(_) => self.close_receiver(false),
                }
            }
        }
        // Its connections close: data channels, and the control connection once what it
        // sent has arrived.
        for index in self.chans.keys().copied().collect::<Vec<_>>() {
            self.kill_chan(index, Some(side));
        }
        if self.ended(side.other()).is_none() {
            let ev = match side.other() {
                Side::Sender => Ev::SCtlEnd,
                Side::Receiver => Ev::RCtlEnd,
            };
            let d = self.up_to(Duration::from_millis(20));
            self.ordered(Stream::Control(side), d, ev);
        }
    }

    /// The sink's `close`: everything complete is committed; a failed session keeps its
    /// partial files for the next (their ranges durable and journaled); a completed one
    /// removes the journal.
    fn close_receiver(&mut self, completed: bool) {
        let Some(mut r) = self.rcv.take() else { return };
        let batch: Vec<CJob> = r.committer.drain(..).collect();
        if let Err(e) = self.apply_batch(batch) {
            self.w.late_error.get_or_insert(e);
        }
        self.w.disk.sync_names();
        if !completed {
            for slot in r.slots.into_values() {
                let (Some(file), TempRef::Named) = (slot.journaled, &slot.temp) else {
                    continue;
                };
                self.w.disk.sync_temp(&slot.dest);
                for piece in slot.unjournaled.chunks(MAX_HELD_RANGES) {
                    let record = Record::Verified {
                        file,
                        ranges: piece.iter().map(|(h, _)| *h).collect(),
                    };
                    self.w.disk.append(&[record]);
                }
                self.w.note_verified(file, &slot.dest, &slot.unjournaled);
            }
        }
        self.w.disk.sync_journal();
        self.w.journal_synced();
        if completed {
            self.w.remove_journal();
        }
    }

    fn finish_report(&mut self, s: &End, r: &End) -> Result<(), String> {
        if let Some(e) = self.w.late_error.take() {
            return Err(e);
        }
        self.report.steps = self.steps;
        self.report.elapsed = self.now;
        self.report.faulted = self.fault.is_some();
        self.report.ended_done = *s == End::Done && *r == End::Done;
        self.report.complete = self.report.ended_done && self.report.failures == 0;
        // Nothing a session sends of a file is what the receiver could show it held.
        for (src, (coverage, _)) in &self.planned {
            let bound = self.bounds.get(src).copied().unwrap_or_default();
            if coverage.bytes() > bound {
                let e = &self.w.src[*src];
                return Err(format!(
                    "{} (v{}, {} bytes): {} bytes were sent, but the receiver could keep all \
                     but {bound} from earlier sessions",
                    e.path,
                    e.label,
                    e.size,
                    coverage.bytes()
                ));
            }
        }
        // What was sent again within the session is at most what was lost on the way.
        for (src, (coverage, total)) in &self.planned {
            let again = total - coverage.bytes();
            self.report.bytes_resent += again;
            let lost = self.lost.get(src).copied().unwrap_or_default();
            if again > lost {
                return Err(format!(
                    "{}: {again} bytes were sent again in one session, but only {lost} were lost",
                    self.w.src[*src].path
                ));
            }
        }
        Ok(())
    }
}

/// Which side's machine an event calls into.
fn fed(ev: &Ev) -> Option<Side> {
    match ev {
        Ev::SMsg(_)
        | Ev::SCtlEnd
        | Ev::STaken { .. }
        | Ev::SSent { .. }
        | Ev::SUnsent { .. }
        | Ev::SLinkEnded { .. }
        | Ev::SLinkUp { .. }
        | Ev::SVerified { .. }
        | Ev::SReadFailed { .. }
        | Ev::STimer => Some(Side::Sender),
        Ev::RMsg(_)
        | Ev::RCtlEnd
        | Ev::RReceived { .. }
        | Ev::RLinkEnded { .. }
        | Ev::RLinkUp { .. }
        | Ev::RResolved { .. }
        | Ev::RTimer => Some(Side::Receiver),
        _ => None,
    }
}

/// The parts of `[start, end)` not yet in `coverage`.
fn gaps_within(coverage: &Coverage, start: u64, end: u64) -> Vec<(u64, u64)> {
    coverage
        .gaps(end)
        .into_iter()
        .filter_map(|(s, e)| {
            let (s, e) = (s.max(start), e.min(end));
            (s < e).then_some((s, e))
        })
        .collect()
}

/// The manifest entry the sender's walker makes of a source entry.
pub fn entry_of(e: &super::world::SrcEntry) -> Entry {
    Entry {
        kind: match e.kind {
            Kind::File => EntryKind::File,
            Kind::Dir => EntryKind::Dir,
            Kind::Symlink => EntryKind::Symlink,
            Kind::Special => unreachable!("never announced"),
        },
        path: RelPath::new(e.path.as_bytes()).expect("the model makes valid paths"),
        size: if e.kind == Kind::File { e.size } else { 0 },
        mode: if e.kind == Kind::Dir { 0o755 } else { 0o644 },
        mtime_sec: e.mtime.0,
        mtime_nsec: e.mtime.1,
        link_target: e.target.clone(),
        meta: None,
    }
}

fn describe(msg: &Message) -> String {
    match msg {
        Message::Manifest(m) => format!(
            "Manifest {}..{}",
            m.first_id,
            m.first_id + m.entries.len() as u64
        ),
        other => {
            let s = format!("{other:?}");
            if s.len() > 160 {
                format!("{}...", &s[..160])
            } else {
                s
            }
        }
    }
}
