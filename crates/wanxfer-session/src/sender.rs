//! The sending role: announce the manifest within the window, plan what to read once the
//! receiver has taken an announcement in, check what the receiver says it already holds,
//! remember which blocks went out on which channel until the receiver confirms them, and
//! send again what a dead channel did not deliver.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use wanxfer_proto::{
    Confirm, Entry, EntryKind, ErrorMsg, FailureClass, FileFailed, HeldRange, Manifest,
    ManifestEnd, Message, Stats, MAX_FRAME_BODY, MAX_HELD_RANGES_PER_FILE, MAX_MANIFEST_ENTRIES,
};

use crate::coverage::Coverage;
use crate::plan::{Plan, Planner, SegRef};
use crate::tail::{self, Confirmations, TailChannel};
use crate::{name, protocol, Event, Failure, Link, Outcome, SessionError};

/// What a sending side agreed on.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    pub block_size: u64,
    /// Most manifest entries announced and not yet resolved.
    pub window: u32,
    pub stall_timeout: Duration,
    /// How long the peer may keep the session alive without moving anything (`None`:
    /// for ever).
    pub idle_timeout: Option<Duration>,
    /// The receiver may report files as up to date (comparison negotiated).
    pub peer_may_skip: bool,
    /// The receiver may report ranges it holds (resume or comparison by checksum).
    pub peer_may_hold: bool,
    /// The receiver may send notes on what it could not preserve.
    pub peer_may_note: bool,
    /// The receiver holds nothing of the transfer and compares nothing
    /// (`session_flags::FRESH`): a file is read as soon as it is announced, one round
    /// trip before its acknowledgement would come, which then only moves the window. The
    /// receiver may neither skip nor hold anything then.
    pub fresh: bool,
}

/// Work for the sender's threads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderWork {
    /// Read these bytes into blocks and queue them for the channels.
    Read(Plan),
    /// Hash these ranges of the source and report with [`SenderMachine::verified`] whether
    /// each matches the digest the receiver holds for it.
    Verify { id: u64, ranges: Vec<HeldRange> },
    /// The receiver has said what this channel delivered: tear down its local end.
    CloseChannel(u16),
}

#[derive(Debug)]
struct SendFile {
    kind: EntryKind,
    size: u64,
    /// A sparse file's data ranges: all that is sent of it (the rest are holes).
    data: Option<Vec<(u64, u64)>>,
    held: Vec<HeldRange>,
    held_complete: bool,
    verifying: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChannelState {
    Open,
    /// We told the receiver the channel is dead; waiting for its final count.
    Dropping,
    Closed,
}

/// What one data channel carried and the receiver has not yet confirmed.
#[derive(Debug)]
struct Ledger {
    state: ChannelState,
    /// Blocks reported sent on this channel.
    sent: u64,
    /// Blocks the receiver confirmed it took in.
    received: u64,
    /// Blocks sent and not yet confirmed: their index on the channel and their segments.
    pending: VecDeque<(u64, Vec<SegRef>)>,
    /// Their payload bytes, kept as they come and go: [`Ledger::held`] is asked per
    /// block taken.
    pending_bytes: u64,
    /// Payload bytes of blocks the channel took and has not yet reported sent or unsent
    /// (a TCP write waiting for room in its socket).
    in_hand: u64,
    /// Since when it has held blocks without a break (see [`Ledger::held`]).
    busy_since: Option<Instant>,
    /// Payload bytes of the blocks the receiver confirmed, and lately when.
    confirmed_bytes: u64,
    confirmations: Confirmations,
}

/// Most unconfirmed blocks one channel may hold in the ledger: a receiver that never
/// confirms would otherwise grow it without bound.
pub const MAX_UNCONFIRMED_BLOCKS: usize = 1 << 16;

impl Ledger {
    fn new() -> Ledger {
        Ledger {
            state: ChannelState::Open,
            sent: 0,
            received: 0,
            pending: VecDeque::new(),
            pending_bytes: 0,
            in_hand: 0,
            busy_since: None,
            confirmed_bytes: 0,
            confirmations: Confirmations::default(),
        }
    }

    fn trim(&mut self, now: Instant) {
        while self
            .pending
            .front()
            .is_some_and(|(index, _)| *index < self.received)
        {
            if let Some((_, segments)) = self.pending.pop_front() {
                let bytes = payload(&segments);
                self.pending_bytes -= bytes;
                self.confirmed_bytes += bytes;
            }
        }
        self.confirmations.confirmed(now, self.confirmed_bytes);
    }

    fn push_pending(&mut self, at: u64, segments: Vec<SegRef>) {
        self.pending_bytes += payload(&segments);
        self.pending.push_back((at, segments));
    }

    /// Every block sent and not confirmed, out of the ledger.
    fn take_pending(&mut self) -> Vec<SegRef> {
        self.pending_bytes = 0;
        self.pending.drain(..).flat_map(|(_, s)| s).collect()
    }

    /// Payload bytes it holds: taken and not sent yet, or sent and not confirmed.
    fn held(&self) -> u64 {
        self.in_hand + self.pending_bytes
    }
}

fn payload(segments: &[SegRef]) -> u64 {
    segments.iter().map(|s| u64::from(s.len)).sum()
}

/// About what `entry` adds to a manifest frame, for batching.
fn entry_cost(entry: &Entry) -> usize {
    40 + entry.path.as_bytes().len()
        + entry.link_target.len()
        + entry.meta.as_ref().map_or(0, |m| m.encoded_len())
}

/// The sending side of a session.
#[derive(Debug)]
pub struct SenderMachine {
    cfg: SenderConfig,
    link: Link,
    next_id: u64,
    total_bytes: u64,
    end_sent: bool,
    batch: Vec<Entry>,
    batch_bytes: usize,
    /// Announced batches not yet acknowledged: where each ends and its files with data.
    awaiting_ack: VecDeque<(u64, Vec<u64>)>,
    acked_through: u64,
    files: HashMap<u64, SendFile>,
    planner: Planner,
    work: VecDeque<SenderWork>,
    channels: BTreeMap<u16, Ledger>,
    /// Notes passed on so far.
    notes: usize,
    /// Payload bytes of every read handed out, and of the blocks the channels took (see
    /// [`Self::cut_stragglers`]).
    planned_bytes: u64,
    taken_bytes: u64,
    /// Payload bytes of the reads in `work` (see [`Self::untaken`]).
    queued_read_bytes: u64,
}

impl SenderMachine {
    pub fn new(cfg: SenderConfig, now: Instant) -> SenderMachine {
        SenderMachine {
            link: Link::new(now, cfg.stall_timeout, cfg.idle_timeout),
            planner: Planner::new(cfg.block_size),
            cfg,
            next_id: 0,
            total_bytes: 0,
            end_sent: false,
            batch: Vec::new(),
            batch_bytes: 0,
            awaiting_ack: VecDeque::new(),
            acked_through: 0,
            files: HashMap::new(),
            work: VecDeque::new(),
            channels: BTreeMap::new(),
            notes: 0,
            planned_bytes: 0,
            taken_bytes: 0,
            queued_read_bytes: 0,
        }
    }

    /// Whether the window has room for another entry.
    pub fn wants_entries(&self) -> bool {
        !self.end_sent && self.files.len() < self.cfg.window as usize
    }

    /// Announces one walked entry; returns its id. Call only while [`Self::wants_entries`].
    pub fn push_entry(&mut self, entry: Entry) -> u64 {
        debug_assert!(self.wants_entries(), "the driver respects the window");
        let id = self.record(entry);
        if self.batch.len() >= MAX_MANIFEST_ENTRIES || self.batch_bytes >= MAX_FRAME_BODY / 2 {
            self.flush_batch();
        }
        id
    }

    /// Takes in the entries a client already sent behind its session request, before
    /// this machine existed (`features::PIPELINE`): ids from 0 in their order, one
    /// manifest batch awaiting its acknowledgement like any other. Call first, before
    /// any [`Self::push_entry`]; the agreed window holds them (the server sees to that).
    pub fn announced_early(&mut self, entries: Vec<Entry>) -> std::ops::Range<u64> {
        assert_eq!(self.next_id, 0, "early entries come first");
        for entry in entries {
            self.record(entry);
        }
        self.batch.clear();
        self.batch_bytes = 0;
        if self.next_id > 0 {
            self.awaiting_ack
                .push_back((self.next_id, self.with_data(0..self.next_id)));
        }
        0..self.next_id
    }

    /// Whether `entries` fit in one manifest frame as this machine batches them: what a
    /// client may send early (see [`Self::announced_early`]).
    pub fn fits_one_batch(entries: &[Entry]) -> bool {
        entries.len() <= MAX_MANIFEST_ENTRIES
            && entries.iter().map(entry_cost).sum::<usize>() < MAX_FRAME_BODY / 2
    }

    fn with_data(&self, ids: std::ops::Range<u64>) -> Vec<u64> {
        ids.filter(|id| {
            self.files
                .get(id)
                .is_some_and(|f| f.kind == EntryKind::File && f.size > 0)
        })
        .collect()
    }

    /// Books `entry` under the next id and adds it to the batch being filled.
    fn record(&mut self, entry: Entry) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        // Another name of a file announced already (`--preserve hardlinks`): none of its
        // data travels, as for a file that is all hole.
        let link = entry.meta.as_ref().is_some_and(|m| m.link.is_some());
        if !link {
            self.total_bytes += entry.size;
        }
        self.files.insert(
            id,
            SendFile {
                kind: entry.kind,
                size: entry.size,
                data: match &entry.meta {
                    Some(m) if m.link.is_some() => Some(Vec::new()),
                    meta => meta.as_ref().and_then(|m| m.data.clone()),
                },
                held: Vec::new(),
                held_complete: false,
                verifying: false,
            },
        );
        self.batch_bytes += entry_cost(&entry);
        self.batch.push(entry);
        id
    }

    /// Every entry has been announced.
    pub fn walk_done(&mut self) {
        if self.end_sent {
            return;
        }
        self.flush_batch();
        self.link.send(Message::ManifestEnd(ManifestEnd {
            entries: self.next_id,
            bytes: self.total_bytes,
        }));
        self.end_sent = true;
    }

    /// Entries this side did not send because they are neither file, directory nor
    /// symlink, so that the receiving user learns of them.
    pub fn skipped(&mut self, paths: Vec<Vec<u8>>) {
        for chunk in paths.chunks(wanxfer_proto::MAX_SKIPPED_PATHS) {
            self.link.send(Message::Skipped {
                paths: chunk.to_vec(),
            });
        }
    }

    fn flush_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let entries = std::mem::take(&mut self.batch);
        self.batch_bytes = 0;
        let first_id = self.next_id - entries.len() as u64;
        let with_data = self.with_data(first_id..self.next_id);
        self.link
            .send(Message::Manifest(Manifest { first_id, entries }));
        if self.cfg.fresh {
            // Nothing held, nothing to check: read now, behind the announcement.
            let mut plans = Vec::new();
            for id in with_data {
                self.plan(id, &mut plans);
            }
            self.planner.flush(&mut plans);
            self.queue_reads(plans);
            self.awaiting_ack.push_back((self.next_id, Vec::new()));
        } else {
            self.awaiting_ack.push_back((self.next_id, with_data));
        }
    }

    /// Plans reading all of file `id` (its data ranges, for a sparse one).
    fn plan(&mut self, id: u64, plans: &mut Vec<Plan>) {
        if let Some(file) = self.files.get(&id) {
            match &file.data {
                Some(data) => self.planner.add_ranges(id, file.size, data.clone(), plans),
                None => self.planner.add_whole(id, file.size, plans),
            }
        }
    }

    /// Ids announced so far (sent or about to be).
    fn announced(&self) -> u64 {
        self.next_id - self.batch.len() as u64
    }

    pub fn handle_message(&mut self, now: Instant, msg: Message) -> Result<(), SessionError> {
        self.link.heard_message(now, &msg);
        let resolved = self.all_resolved();
        let Some(msg) = self.link.common(msg, resolved)? else {
            return Ok(());
        };
        match msg {
            Message::ManifestAck { through } => self.acknowledged(through),
            Message::FileAck { ids } => self.resolve_ids(&ids, Outcome::Done),
            Message::UpToDate { ids } if self.cfg.peer_may_skip => {
                self.resolve_ids(&ids, Outcome::UpToDate)
            }
            Message::FileFailed(f) => {
                self.check_announced(f.id)?;
                let failure = Failure {
                    class: f.class,
                    offset: f.offset,
                    message: String::from_utf8_lossy(&f.message).into_owned(),
                    remote: true,
                };
                self.resolve(f.id, Outcome::Failed(failure));
                Ok(())
            }
            Message::Held(held) if self.cfg.peer_may_hold => self.held(held),
            Message::Note { text } if self.cfg.peer_may_note => {
                if self.notes < crate::MAX_NOTES {
                    self.notes += 1;
                    let text = String::from_utf8_lossy(&text).into_owned();
                    self.link.events.push_back(Event::Note(text));
                }
                Ok(())
            }
            Message::ChannelStatus {
                index,
                received,
                closed,
            } => self.channel_status(now, index, received, closed),
            other => Err(protocol(format!(
                "unexpected {} from the receiver",
                name(&other)
            ))),
        }
    }

    fn check_announced(&self, id: u64) -> Result<(), SessionError> {
        if id >= self.announced() {
            return Err(protocol(format!(
                "a verdict on file id {id}, never announced"
            )));
        }
        Ok(())
    }

    fn resolve_ids(&mut self, ids: &[u64], outcome: Outcome) -> Result<(), SessionError> {
        for &id in ids {
            self.check_announced(id)?;
            self.resolve(id, outcome.clone());
        }
        Ok(())
    }

    fn resolve(&mut self, id: u64, outcome: Outcome) {
        if let Some(file) = self.files.remove(&id) {
            self.link.events.push_back(Event::Resolved {
                id,
                kind: file.kind,
                outcome,
            });
        }
    }

    fn acknowledged(&mut self, through: u64) -> Result<(), SessionError> {
        if through > self.announced() || through < self.acked_through {
            return Err(protocol(format!(
                "manifest acknowledged through {through}, but {} entries were announced and {} already acknowledged",
                self.announced(),
                self.acked_through
            )));
        }
        self.acked_through = through;
        let mut plans = Vec::new();
        while self
            .awaiting_ack
            .front()
            .is_some_and(|(end, _)| *end <= through)
        {
            let (_, ids) = self.awaiting_ack.pop_front().expect("front exists");
            for id in ids {
                self.start(id, &mut plans)?;
            }
            self.planner.flush(&mut plans);
        }
        self.queue_reads(plans);
        Ok(())
    }

    /// A file the receiver has taken in: read it, or first check what it holds.
    fn start(&mut self, id: u64, plans: &mut Vec<Plan>) -> Result<(), SessionError> {
        let Some(file) = self.files.get_mut(&id) else {
            return Ok(()); // resolved already (up to date, or failed)
        };
        if file.held.is_empty() {
            self.plan(id, plans);
            return Ok(());
        }
        if !file.held_complete {
            return Err(protocol(format!(
                "file id {id} acknowledged before its held ranges were complete"
            )));
        }
        file.verifying = true;
        self.work.push_back(SenderWork::Verify {
            id,
            ranges: file.held.clone(),
        });
        Ok(())
    }

    fn held(&mut self, held: wanxfer_proto::Held) -> Result<(), SessionError> {
        let id = held.id;
        self.check_announced(id)?;
        if id < self.acked_through {
            return Err(protocol(format!(
                "held ranges for file id {id} after its acknowledgement"
            )));
        }
        let Some(file) = self.files.get_mut(&id) else {
            return Err(protocol(format!(
                "held ranges for file id {id}, which is resolved"
            )));
        };
        if file.kind != EntryKind::File || file.held_complete {
            return Err(protocol(format!("unexpected held ranges for file id {id}")));
        }
        if file.held.len() + held.ranges.len() > MAX_HELD_RANGES_PER_FILE {
            return Err(SessionError::Limit(format!(
                "more than {MAX_HELD_RANGES_PER_FILE} held ranges for file id {id}"
            )));
        }
        let mut end = file.held.last().map_or(0, |r| r.offset + u64::from(r.len));
        for r in &held.ranges {
            let r_end = r.offset + u64::from(r.len);
            if r.offset < end || r_end > file.size {
                return Err(protocol(format!(
                    "held ranges of file id {id} out of order, overlapping, or past its size"
                )));
            }
            end = r_end;
        }
        file.held.extend(held.ranges);
        file.held_complete = held.last;
        Ok(())
    }

    /// The readers checked the held ranges of `id` against the source: `matches[i]` for
    /// range `i`. Confirms them to the receiver and plans the rest. Returns the bytes the
    /// receiver keeps, which are not sent.
    pub fn verified(&mut self, id: u64, matches: &[bool]) -> u64 {
        let Some(file) = self.files.get_mut(&id) else {
            return 0; // failed meanwhile
        };
        if !file.verifying || matches.len() != file.held.len() {
            debug_assert!(false, "a verdict for every held range, once");
            return 0;
        }
        file.verifying = false;
        let mut have = Coverage::default();
        for (range, _) in file.held.iter().zip(matches).filter(|(_, ok)| **ok) {
            // Checked in order and apart when they arrived.
            let _ = have.add(range.offset, range.offset + u64::from(range.len));
        }
        file.held.clear();
        let size = file.size;
        let mut missing = have.gaps(size);
        if let Some(data) = &file.data {
            missing = intersect(&missing, data);
        }
        self.link.send(Message::Confirm(Confirm::new(id, matches)));
        let mut plans = Vec::new();
        self.planner.add_ranges(id, size, missing, &mut plans);
        self.planner.flush(&mut plans);
        self.queue_reads(plans);
        have.bytes()
    }

    /// This side could not read `id` (or check what the receiver holds of it): the file
    /// fails alone and the receiver is told to drop it.
    pub fn read_failed(&mut self, id: u64, class: FailureClass, message: &str) {
        if !self.files.contains_key(&id) {
            return;
        }
        self.link.send(Message::FileFailed(FileFailed {
            id,
            class,
            offset: 0,
            message: ErrorMsg::new(class, message).message,
        }));
        let failure = Failure {
            class,
            offset: 0,
            message: message.to_string(),
            remote: false,
        };
        self.resolve(id, Outcome::Failed(failure));
    }

    /// A data channel is up.
    pub fn channel_opened(&mut self, index: u16) {
        self.channels.entry(index).or_insert_with(Ledger::new);
    }

    /// Channel `index` took a block of `payload` bytes to send: [`Self::block_sent`] or
    /// [`Self::block_unsent`] follows.
    pub fn block_taken(&mut self, now: Instant, index: u16, payload: u64) {
        self.taken_bytes += payload;
        let ledger = self.channels.entry(index).or_insert_with(Ledger::new);
        if ledger.held() == 0 {
            ledger.busy_since = Some(now);
        }
        ledger.in_hand += payload;
    }

    /// A block holding `segments` went out whole on channel `index`.
    pub fn block_sent(&mut self, index: u16, segments: Vec<SegRef>) -> Result<(), SessionError> {
        let ledger = self.channels.entry(index).or_insert_with(Ledger::new);
        ledger.in_hand = ledger.in_hand.saturating_sub(payload(&segments));
        let at = ledger.sent;
        ledger.sent += 1;
        if at < ledger.received {
            return Ok(()); // confirmed before we heard it went out
        }
        if ledger.state == ChannelState::Closed {
            // The channel died with this block in it: the receiver's final count is
            // below it.
            self.requeue(segments);
            return Ok(());
        }
        if ledger.pending.len() >= MAX_UNCONFIRMED_BLOCKS {
            return Err(SessionError::Limit(format!(
                "the receiver confirmed none of the last {MAX_UNCONFIRMED_BLOCKS} blocks on channel {index}"
            )));
        }
        ledger.push_pending(at, segments);
        Ok(())
    }

    /// A block could not be sent at all on channel `index` (it failed first): send it
    /// again on another.
    pub fn block_unsent(&mut self, index: u16, segments: Vec<SegRef>) {
        if let Some(ledger) = self.channels.get_mut(&index) {
            ledger.in_hand = ledger.in_hand.saturating_sub(payload(&segments));
        }
        self.requeue(segments);
    }

    /// This side found channel `index` dead (an error, or a send stalled past the
    /// timeout). The receiver is asked for its final count before anything is sent again,
    /// since the channel may have delivered more than this side knows.
    pub fn channel_failed(&mut self, index: u16) {
        let resolved = self.all_resolved();
        let ledger = self.channels.entry(index).or_insert_with(Ledger::new);
        if ledger.state != ChannelState::Open {
            return;
        }
        if resolved {
            // Nothing will be sent again, so there is nothing to ask. The receiver has
            // most likely ended the session, which is why the channel closed, and a
            // message now would keep this side from being done (or fail on the closed
            // connection) before the receiver's closing numbers are read.
            ledger.state = ChannelState::Closed;
            ledger.take_pending();
            return;
        }
        ledger.state = ChannelState::Dropping;
        self.link.send(Message::DropChannel { index });
    }

    fn channel_status(
        &mut self,
        now: Instant,
        index: u16,
        received: u64,
        closed: bool,
    ) -> Result<(), SessionError> {
        let ledger = self.channels.entry(index).or_insert_with(Ledger::new);
        if ledger.state == ChannelState::Closed {
            return Ok(()); // late news of a channel already settled
        }
        if received < ledger.received {
            return Err(protocol(format!(
                "channel {index}: the receiver's count went back from {} to {received}",
                ledger.received
            )));
        }
        ledger.received = received;
        ledger.trim(now);
        if closed {
            ledger.state = ChannelState::Closed;
            let lost = ledger.take_pending();
            self.work.push_back(SenderWork::CloseChannel(index));
            self.requeue(lost);
        }
        Ok(())
    }

    /// Plans again the segments a channel did not deliver, for files still outstanding.
    fn requeue(&mut self, segments: Vec<SegRef>) {
        let mut ranges: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
        for seg in segments {
            if self.files.contains_key(&seg.id) {
                ranges
                    .entry(seg.id)
                    .or_default()
                    .push((seg.offset, seg.offset + u64::from(seg.len)));
            }
        }
        let mut plans = Vec::new();
        for (id, mut list) in ranges {
            let size = self.files[&id].size;
            list.sort_unstable();
            self.planner.add_ranges(id, size, list, &mut plans);
        }
        self.planner.flush(&mut plans);
        self.queue_reads(plans);
    }

    /// Reads to hand out, after what is already queued.
    fn queue_reads(&mut self, plans: Vec<Plan>) {
        self.queued_read_bytes += plans.iter().map(Plan::bytes).sum::<u64>();
        self.work.extend(plans.into_iter().map(SenderWork::Read));
    }

    /// Payload bytes no channel has taken yet, once every one is known: every entry
    /// announced and acknowledged (so planned), none being verified (which may plan more).
    fn untaken(&self) -> Option<u64> {
        let known = self.end_sent
            && self.batch.is_empty()
            && self.awaiting_ack.is_empty()
            && self.files.values().all(|f| !f.verifying);
        known.then(|| self.planned_bytes.saturating_sub(self.taken_bytes) + self.queued_read_bytes)
    }

    /// The open channels, as [`crate::tail`] judges them.
    fn tail_channels(&self, now: Instant) -> Vec<TailChannel<'_>> {
        self.channels
            .iter()
            .filter(|(_, l)| l.state == ChannelState::Open)
            .map(|(index, l)| TailChannel {
                index: *index,
                held: l.held(),
                busy_since: l.busy_since.unwrap_or(now),
                confirmations: &l.confirmations,
            })
            .collect()
    }

    /// Before the tail, the open channels that should take no block for now: slow ones
    /// whose next block would land after the others have sent the rest (see
    /// [`tail::held_back`]). The caller keeps them from the queue until asked again.
    pub fn held_back(&self, now: Instant, rtt: Duration) -> Vec<u16> {
        match self.untaken() {
            Some(untaken) if !self.in_tail() => tail::held_back(
                &self.tail_channels(now),
                untaken,
                self.cfg.block_size,
                rtt,
                now,
            ),
            _ => Vec::new(),
        }
    }

    /// Once every read has been handed out and the channels have taken all of it
    /// (reported with [`Self::block_taken`]), drops the channels still holding blocks
    /// that the idle ones would send again sooner than they would deliver them (see
    /// [`crate::tail`]). The receiver answers
    /// each drop with its count, as for a dead channel, and the rest is sent again. The
    /// caller stops the dropped channels taking blocks (without opening others).
    pub fn cut_stragglers(&mut self, now: Instant, rtt: Duration) -> Vec<u16> {
        if !self.in_tail() {
            return Vec::new();
        }
        let cut = tail::stragglers(&self.tail_channels(now), rtt, now);
        for index in &cut {
            if let Some(ledger) = self.channels.get_mut(index) {
                ledger.state = ChannelState::Dropping;
                self.link.send(Message::DropChannel { index: *index });
            }
        }
        cut
    }

    /// The tail of the session: every entry announced and acknowledged, every read
    /// handed out and taken by a channel (reported with [`Self::block_taken`]), no file
    /// being verified. What remains is the blocks the channels hold; until one is cut
    /// or lost, more channels would have nothing to carry.
    pub fn in_tail(&self) -> bool {
        self.end_sent
            && !self.files.is_empty()
            && self.batch.is_empty()
            && self.awaiting_ack.is_empty()
            && self.work.is_empty()
            && self.taken_bytes >= self.planned_bytes
            && self.files.values().all(|f| !f.verifying)
    }

    /// Whether channel `index` is still expected to carry blocks.
    pub fn channel_is_open(&self, index: u16) -> bool {
        self.channels
            .get(&index)
            .is_some_and(|l| l.state == ChannelState::Open)
    }

    /// Channels still carrying blocks.
    pub fn open_channels(&self) -> usize {
        self.channels
            .values()
            .filter(|l| l.state == ChannelState::Open)
            .count()
    }

    /// Whether `id` still waits for the receiver's verdict (plans for others can be
    /// skipped).
    pub fn is_outstanding(&self, id: u64) -> bool {
        self.files.contains_key(&id)
    }

    /// Every announced entry is resolved and the manifest is complete.
    pub fn all_resolved(&self) -> bool {
        self.end_sent && self.files.is_empty() && self.batch.is_empty()
    }

    /// Client: ends the session (call once [`Self::all_resolved`]).
    pub fn finish(&mut self) {
        debug_assert!(self.all_resolved());
        self.link.finish();
    }

    /// Server: answers the client's `Finish` with this side's numbers.
    pub fn send_stats(&mut self, stats: Stats) {
        self.link.send_stats(stats);
    }

    /// Whether the session is over (both sides agreed it ended).
    pub fn is_done(&self) -> bool {
        self.link.finish == crate::FinishState::Done && self.link.out.is_empty()
    }

    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), SessionError> {
        self.link.handle_timeout(now)
    }

    pub fn poll_transmit(&mut self, now: Instant) -> Option<Message> {
        if self.link.out.is_empty() {
            self.flush_batch();
        }
        self.link.poll_transmit(now)
    }

    pub fn poll_work(&mut self) -> Option<SenderWork> {
        let work = self.work.pop_front()?;
        if let SenderWork::Read(plan) = &work {
            self.planned_bytes += plan.bytes();
            self.queued_read_bytes -= plan.bytes();
        }
        Some(work)
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.link.events.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.link.poll_timeout()
    }
}

/// The parts of sorted, apart ranges `a` that are also in sorted, apart ranges `b`.
fn intersect(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let (start, end) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if start < end {
            out.push((start, end));
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_data_ranges_are_planned_again() {
        let gaps = [(0, 10), (20, 100)];
        let data = [(5, 25), (30, 40), (90, 200)];
        assert_eq!(
            intersect(&gaps, &data),
            vec![(5, 10), (20, 25), (30, 40), (90, 100)]
        );
        assert!(intersect(&gaps, &[]).is_empty());
    }
    use wanxfer_proto::RelPath;

    fn cfg() -> SenderConfig {
        SenderConfig {
            block_size: 100,
            window: 4,
            stall_timeout: Duration::from_secs(10),
            idle_timeout: None,
            peer_may_skip: true,
            peer_may_hold: true,
            peer_may_note: true,
            fresh: false,
        }
    }

    fn file(name: &str, size: u64) -> Entry {
        Entry {
            kind: EntryKind::File,
            path: RelPath::new(name.as_bytes()).unwrap(),
            size,
            mode: 0o644,
            mtime_sec: 1,
            mtime_nsec: 0,
            link_target: Vec::new(),
            meta: None,
        }
    }

    fn drain(m: &mut SenderMachine, now: Instant) -> Vec<Message> {
        std::iter::from_fn(|| m.poll_transmit(now)).collect()
    }

    fn works(m: &mut SenderMachine) -> Vec<SenderWork> {
        std::iter::from_fn(|| m.poll_work()).collect()
    }

    #[test]
    fn announces_within_the_window_and_reads_only_after_the_ack() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        let mut n = 0;
        while m.wants_entries() {
            m.push_entry(file(&format!("f{n}"), 30));
            n += 1;
        }
        assert_eq!(n, 4, "the window bounds what is announced");
        let sent = drain(&mut m, now);
        assert!(matches!(&sent[..], [Message::Manifest(m)] if m.entries.len() == 4));
        assert!(works(&mut m).is_empty(), "nothing is read before the ack");
        m.handle_message(now, Message::ManifestAck { through: 4 })
            .unwrap();
        assert_eq!(
            works(&mut m),
            vec![
                SenderWork::Read(Plan::Packed {
                    files: vec![(0, 30), (1, 30), (2, 30)]
                }),
                SenderWork::Read(Plan::Packed {
                    files: vec![(3, 30)]
                }),
            ]
        );
        m.handle_message(now, Message::FileAck { ids: vec![0, 1] })
            .unwrap();
        assert!(m.wants_entries());
    }

    /// Issue 19 item 5, a pull to a receiver holding nothing (`session_flags::FRESH`):
    /// files are read as they are announced, the acknowledgement only moves the window
    /// (nothing is read twice), and the receiver may neither skip nor hold anything.
    #[test]
    fn a_fresh_receiver_gets_data_behind_the_announcement() {
        let now = Instant::now();
        let fresh = SenderConfig {
            fresh: true,
            peer_may_skip: false,
            peer_may_hold: false,
            ..cfg()
        };
        let mut m = SenderMachine::new(fresh.clone(), now);
        m.push_entry(file("a", 30));
        m.push_entry(file("empty", 0));
        m.push_entry(file("b", 250));
        m.walk_done();
        assert!(matches!(
            &drain(&mut m, now)[..],
            [Message::Manifest(m), Message::ManifestEnd(_)] if m.entries.len() == 3
        ));
        let read = works(&mut m);
        assert!(
            matches!(&read[..], [SenderWork::Read(_), ..]),
            "read before the ack: {read:?}"
        );
        m.handle_message(now, Message::ManifestAck { through: 3 })
            .unwrap();
        assert!(works(&mut m).is_empty(), "the ack reads nothing again");
        for refused in [
            Message::UpToDate { ids: vec![0] },
            Message::Held(wanxfer_proto::Held {
                id: 0,
                ranges: Vec::new(),
                last: true,
            }),
        ] {
            let mut m = SenderMachine::new(fresh.clone(), now);
            m.push_entry(file("a", 30));
            m.walk_done();
            assert!(m.handle_message(now, refused).is_err());
        }
    }

    /// Issue 19 item 5: entries sent behind the session request are not announced
    /// again, are read once acknowledged, and the walk goes on after them.
    #[test]
    fn entries_sent_early_are_not_sent_again_and_read_after_their_ack() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        let early = vec![file("a", 30), file("b", 0)];
        assert!(SenderMachine::fits_one_batch(&early));
        assert_eq!(m.announced_early(early), 0..2);
        assert!(drain(&mut m, now).is_empty(), "already on the wire");
        assert!(works(&mut m).is_empty(), "nothing is read before the ack");
        assert_eq!(m.push_entry(file("c", 30)), 2);
        m.walk_done();
        assert!(matches!(
            &drain(&mut m, now)[..],
            [Message::Manifest(m), Message::ManifestEnd(_)] if m.first_id == 2 && m.entries.len() == 1
        ));
        m.handle_message(now, Message::ManifestAck { through: 2 })
            .unwrap();
        assert_eq!(
            works(&mut m),
            vec![SenderWork::Read(Plan::Packed {
                files: vec![(0, 30)]
            })]
        );
        assert!(m
            .handle_message(now, Message::ManifestAck { through: 4 })
            .is_err());
    }

    #[test]
    fn an_ack_beyond_the_announced_is_a_protocol_error() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        m.push_entry(file("a", 10));
        drain(&mut m, now);
        assert!(m
            .handle_message(now, Message::ManifestAck { through: 2 })
            .is_err());
        assert!(m
            .handle_message(now, Message::FileAck { ids: vec![7] })
            .is_err());
    }

    /// Held ranges are checked against the source before anything else is planned, and
    /// only the rest, and what did not match, is sent.
    #[test]
    fn held_ranges_are_verified_then_only_the_rest_is_sent() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        m.push_entry(file("big", 450));
        drain(&mut m, now);
        let range = |offset: u64| HeldRange {
            offset,
            len: 100,
            digest: [offset as u8; 16],
        };
        m.handle_message(
            now,
            Message::Held(wanxfer_proto::Held {
                id: 0,
                ranges: vec![range(0), range(100)],
                last: false,
            }),
        )
        .unwrap();
        m.handle_message(
            now,
            Message::Held(wanxfer_proto::Held {
                id: 0,
                ranges: vec![range(300)],
                last: true,
            }),
        )
        .unwrap();
        m.handle_message(now, Message::ManifestAck { through: 1 })
            .unwrap();
        let [SenderWork::Verify { id: 0, ranges }] = &works(&mut m)[..] else {
            panic!("verify first")
        };
        assert_eq!(ranges.len(), 3);
        assert_eq!(m.verified(0, &[true, false, true]), 200);
        assert!(
            matches!(&drain(&mut m, now)[..], [Message::Confirm(c)] if c.is_accepted(0) && !c.is_accepted(1) && c.is_accepted(2))
        );
        assert_eq!(
            works(&mut m),
            vec![SenderWork::Read(Plan::Chunks {
                id: 0,
                size: 450,
                ranges: vec![(100, 300), (400, 450)]
            })]
        );
    }

    /// What a dead channel did not deliver (by the receiver's final count) is planned
    /// again, and nothing it did deliver.
    #[test]
    fn a_dead_channel_sends_again_exactly_what_it_did_not_deliver() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        m.push_entry(file("big", 500));
        drain(&mut m, now);
        m.handle_message(now, Message::ManifestAck { through: 1 })
            .unwrap();
        works(&mut m);
        m.channel_opened(0);
        m.channel_opened(1);
        let seg = |offset| SegRef {
            id: 0,
            offset,
            len: 100,
        };
        m.block_sent(0, vec![seg(0)]).unwrap();
        m.block_sent(1, vec![seg(100)]).unwrap();
        m.block_sent(0, vec![seg(200)]).unwrap();
        m.block_sent(0, vec![seg(300)]).unwrap();
        m.channel_failed(0);
        assert_eq!(drain(&mut m, now), vec![Message::DropChannel { index: 0 }]);
        m.handle_message(
            now,
            Message::ChannelStatus {
                index: 0,
                received: 1,
                closed: true,
            },
        )
        .unwrap();
        // A block the pump reports late, after the channel closed, goes again too.
        m.block_sent(0, vec![seg(400)]).unwrap();
        assert_eq!(
            works(&mut m),
            vec![
                SenderWork::CloseChannel(0),
                SenderWork::Read(Plan::Chunks {
                    id: 0,
                    size: 500,
                    ranges: vec![(200, 300), (300, 400)]
                }),
                SenderWork::Read(Plan::Chunks {
                    id: 0,
                    size: 500,
                    ranges: vec![(400, 500)]
                }),
            ]
        );
        assert_eq!(m.open_channels(), 1);
    }

    /// At the end, once the channels have taken every block, a channel that holds blocks
    /// it delivers far slower than the idle ones could send them again is dropped, and
    /// only what the receiver says did not arrive is read again (issue 19, the tail).
    #[test]
    fn a_straggler_at_the_tail_is_dropped_and_only_its_undelivered_blocks_go_again() {
        let start = Instant::now();
        let mut m = SenderMachine::new(cfg(), start);
        m.push_entry(file("big", 1000));
        m.walk_done();
        drain(&mut m, start);
        m.handle_message(start, Message::ManifestAck { through: 1 })
            .unwrap();
        assert_eq!(works(&mut m).len(), 1);
        m.channel_opened(0);
        m.channel_opened(1);
        let seg = |offset| SegRef {
            id: 0,
            offset,
            len: 100,
        };
        for i in 0..6u64 {
            m.block_taken(start, 0, 100);
            m.block_sent(0, vec![seg(i * 100)]).unwrap();
        }
        for offset in [600, 700, 800] {
            m.block_taken(start, 1, 100);
            m.block_sent(1, vec![seg(offset)]).unwrap();
        }
        let status = |index, received, closed| Message::ChannelStatus {
            index,
            received,
            closed,
        };
        // Channel 0 delivers a block every 100 ms; channel 1 one block, then nothing.
        for i in 1..=6u64 {
            let at = start + Duration::from_millis(100 * i);
            m.handle_message(at, status(0, i, false)).unwrap();
        }
        m.handle_message(start + Duration::from_millis(500), status(1, 1, false))
            .unwrap();
        let rtt = Duration::from_millis(10);
        let now = start + Duration::from_secs(3);
        // Not while a block is still on its way to a channel.
        assert!(m.cut_stragglers(now, rtt).is_empty());
        // The last one is taken by channel 1, whose socket has no room for it yet.
        m.block_taken(now, 1, 100);
        assert_eq!(m.cut_stragglers(now, rtt), vec![1]);
        assert_eq!(drain(&mut m, now), vec![Message::DropChannel { index: 1 }]);
        // Once is enough.
        assert!(m.cut_stragglers(now, rtt).is_empty());
        m.handle_message(now, status(1, 2, true)).unwrap();
        // The block it had in hand never went out.
        m.block_unsent(1, vec![seg(900)]);
        assert_eq!(
            works(&mut m),
            vec![
                SenderWork::CloseChannel(1),
                SenderWork::Read(Plan::Chunks {
                    id: 0,
                    size: 1000,
                    ranges: vec![(800, 900)]
                }),
                SenderWork::Read(Plan::Chunks {
                    id: 0,
                    size: 1000,
                    ranges: vec![(900, 1000)]
                }),
            ]
        );
        // What is read again must be taken before the tail is reached again.
        assert!(m.cut_stragglers(now, rtt).is_empty());
        assert_eq!(m.open_channels(), 1);
    }

    /// A channel the tuner retires is never "failed": a sending side ends its stream
    /// cleanly, a receiving side closes its end, and either way the receiver's final
    /// count arrives on its own. Everything the count covers is done; anything it does
    /// not (blocks the receiving side cut off) is sent again, once (issue 19).
    #[test]
    fn a_retired_channel_loses_nothing_and_resends_only_what_was_cut_off() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        m.push_entry(file("big", 600));
        drain(&mut m, now);
        m.handle_message(now, Message::ManifestAck { through: 1 })
            .unwrap();
        works(&mut m);
        let seg = |offset| SegRef {
            id: 0,
            offset,
            len: 100,
        };
        for index in [0, 1] {
            m.channel_opened(index);
        }
        m.block_sent(0, vec![seg(0)]).unwrap();
        m.block_sent(0, vec![seg(100)]).unwrap();
        m.block_sent(1, vec![seg(200)]).unwrap();
        m.block_sent(1, vec![seg(300)]).unwrap();
        m.block_sent(1, vec![seg(400)]).unwrap();
        // Channel 0 ended cleanly: the receiver took in both of its blocks.
        m.handle_message(
            now,
            Message::ChannelStatus {
                index: 0,
                received: 2,
                closed: true,
            },
        )
        .unwrap();
        assert_eq!(works(&mut m), vec![SenderWork::CloseChannel(0)]);
        assert!(
            drain(&mut m, now).is_empty(),
            "nothing to ask: it was not lost"
        );
        // Channel 1 was closed by the receiving side after one block.
        m.handle_message(
            now,
            Message::ChannelStatus {
                index: 1,
                received: 1,
                closed: true,
            },
        )
        .unwrap();
        assert_eq!(
            works(&mut m),
            vec![
                SenderWork::CloseChannel(1),
                SenderWork::Read(Plan::Chunks {
                    id: 0,
                    size: 600,
                    ranges: vec![(300, 400), (400, 500)]
                }),
            ]
        );
        assert_eq!(m.open_channels(), 0);
        // A later status of a settled channel changes nothing.
        m.handle_message(
            now,
            Message::ChannelStatus {
                index: 1,
                received: 3,
                closed: true,
            },
        )
        .unwrap();
        assert!(works(&mut m).is_empty());
    }

    /// Found by the simulation (tests/sim.rs): the server finished and closed its data
    /// channels; the client's pumps failed before its `Stats` was read, and the
    /// `DropChannel`s they queued kept the client from being done when it was.
    #[test]
    fn a_channel_lost_once_everything_is_resolved_asks_for_nothing() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        m.push_entry(file("a", 30));
        m.walk_done();
        m.channel_opened(0);
        drain(&mut m, now);
        m.handle_message(now, Message::ManifestAck { through: 1 })
            .unwrap();
        works(&mut m);
        m.block_sent(
            0,
            vec![SegRef {
                id: 0,
                offset: 0,
                len: 30,
            }],
        )
        .unwrap();
        m.handle_message(now, Message::FileAck { ids: vec![0] })
            .unwrap();
        m.finish();
        assert_eq!(drain(&mut m, now), vec![Message::Finish]);
        m.channel_failed(0);
        assert!(drain(&mut m, now).is_empty());
        assert!(works(&mut m).is_empty());
        m.handle_message(now, Message::Stats(Stats::default()))
            .unwrap();
        assert!(m.is_done());
    }

    #[test]
    fn a_silent_peer_stalls_the_session_and_a_quiet_side_keeps_alive() {
        let now = Instant::now();
        let mut m = SenderMachine::new(cfg(), now);
        let keepalive = m.poll_timeout().unwrap();
        m.handle_timeout(keepalive).unwrap();
        assert_eq!(drain(&mut m, keepalive), vec![Message::Keepalive]);
        let later = now + Duration::from_secs(11);
        assert!(matches!(
            m.handle_timeout(later),
            Err(SessionError::Stalled(_))
        ));
    }
    /// A receiver that is alive but moves nothing (keepalives only) is ended after the
    /// idle timeout; anything else it sends counts as progress.
    #[test]
    fn a_peer_sending_only_keepalives_is_ended_when_idle() {
        let start = Instant::now();
        let idle = Duration::from_secs(30);
        let mut m = SenderMachine::new(
            SenderConfig {
                idle_timeout: Some(idle),
                ..cfg()
            },
            start,
        );
        let mut now = start;
        // Keepalives every 5 s keep the link alive, not the transfer.
        while now < start + Duration::from_secs(25) {
            now += Duration::from_secs(5);
            m.handle_message(now, Message::Keepalive).unwrap();
            m.handle_timeout(now).unwrap();
        }
        // Progress (a channel's count) moves the deadline on.
        m.channel_opened(0);
        m.handle_message(
            now,
            Message::ChannelStatus {
                index: 0,
                received: 0,
                closed: false,
            },
        )
        .unwrap();
        let progressed = now;
        assert!(m.poll_timeout().unwrap() <= progressed + idle);
        while now < progressed + idle - Duration::from_secs(5) {
            now += Duration::from_secs(5);
            m.handle_message(now, Message::Keepalive).unwrap();
            m.handle_timeout(now).unwrap();
        }
        now = progressed + idle;
        m.handle_message(now, Message::Keepalive).unwrap();
        assert_eq!(m.handle_timeout(now), Err(SessionError::Idle(idle)));
    }
}
