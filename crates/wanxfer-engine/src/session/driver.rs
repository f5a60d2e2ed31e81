//! The two roles of a session once its channels are open: sending and receiving.
//!
//! Each role is a main loop on the session's own thread that owns the control writer and
//! reacts to three queues: control messages from the peer, results from its workers
//! (readers, channel pumps, writers), and worker exits. Workers never write to the
//! control connection, so its frames need no lock and acknowledgements are batched for
//! free: the loop sends a `FileAck` whenever it runs out of events to handle.
//!
//! Any fatal error cancels the session: the peer is told (best effort), every socket is
//! shut down so blocked workers wake, and every worker is joined before returning.

use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{select, Receiver, Sender};
use wanxfer_proto::{
    EntryKind, ErrorMsg, FailureClass, FileFailed, Manifest, ManifestEnd, Message, MAX_ACK_IDS,
    MAX_MANIFEST_ENTRIES,
};

use super::control::{Control, Incoming};
use super::Params;
use crate::pool::{recv_or_cancel, Block, Cancel, Pool};
use crate::progress::{CpuMeter, IoUse, Progress};
use crate::sink::{Resolution, Sink};
use crate::source::{
    run_reader, Plan, Planner, ReadFailure, ReaderConfig, ReaderShared, Source, Walker,
};
use crate::transport::fabric::{self, RecvLimits, SlotPlan};
use crate::transport::{pump_in, pump_out, TcpChannel};
use crate::Error;

/// What a worker thread returns when it ends.
type WorkerExit = Result<(), Error>;

/// How a role ended when the session itself did not fail.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Files and symlinks in place (directories are not counted: operators read "files"
    /// as files, and a rate in files per second should not be padded by directories).
    pub files_ok: u64,
    pub failures: Vec<Error>,
    pub skipped: Vec<String>,
    /// How this side moved file bytes.
    pub io: IoUse,
}

impl Outcome {
    fn count_done(&mut self, kind: EntryKind, progress: &Progress) {
        if kind != EntryKind::Dir {
            self.files_ok += 1;
            progress.files.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Manifest entries announced but not yet resolved, with their kinds.
#[derive(Default)]
struct Outstanding(HashMap<u64, EntryKind>);

impl Outstanding {
    fn insert(&mut self, id: u64, kind: EntryKind, progress: &Progress) {
        if kind != EntryKind::Dir {
            progress.total_files.fetch_add(1, Ordering::Relaxed);
        }
        self.0.insert(id, kind);
    }

    fn remove(&mut self, id: u64) -> Option<EntryKind> {
        self.0.remove(&id)
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Everything a role needs, set up by the client or the server.
pub struct Core {
    pub control: Control,
    pub incoming: Incoming,
    pub channels: Vec<TcpStream>,
    /// Fabric sessions: the libfabric channel beside each TCP data connection, which
    /// then only binds it to the session. Empty for TCP sessions.
    pub fabric: Vec<wanxfer_fabric::Channel>,
    pub params: Params,
    pub progress: Arc<Progress>,
    pub cancel: Cancel,
    pub meter: Arc<CpuMeter>,
    workers: Vec<JoinHandle<()>>,
    exits: (Sender<WorkerExit>, Receiver<WorkerExit>),
}

impl Core {
    pub fn new(
        control: Control,
        incoming: Incoming,
        channels: Vec<TcpStream>,
        params: Params,
        progress: Arc<Progress>,
        meter: Arc<CpuMeter>,
    ) -> Core {
        Core {
            control,
            incoming,
            channels,
            fabric: Vec::new(),
            params,
            progress,
            cancel: Cancel::default(),
            meter,
            workers: Vec::new(),
            exits: crossbeam_channel::unbounded(),
        }
    }

    fn peer(&self) -> &str {
        &self.control.peer
    }

    /// Runs `work` on a thread whose CPU counts toward this session and whose result
    /// arrives on the exits queue.
    fn spawn(&mut self, name: &str, work: impl FnOnce() -> Result<(), Error> + Send + 'static) {
        let exits = self.exits.0.clone();
        let meter = self.meter.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("wanxfer-{name}"))
            .spawn(move || {
                // A panicking worker must end the session, not leave it waiting forever.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
                    .unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a worker thread panicked".into());
                        Err(Error::Internal(what))
                    });
                meter.add_this_thread();
                let _ = exits.send(result);
            });
        match spawned {
            Ok(handle) => self.workers.push(handle),
            Err(e) => {
                let _ = self
                    .exits
                    .0
                    .send(Err(Error::local("start thread", name.to_string(), e)));
            }
        }
    }

    fn channel(&self, stream: &TcpStream) -> Result<TcpChannel, Error> {
        let stream = stream
            .try_clone()
            .map_err(|e| Error::network("setting up channel to", self.peer(), e))?;
        Ok(TcpChannel::new(
            stream,
            self.peer().to_string(),
            self.params.block_size as usize,
            self.params.session_tag,
        ))
    }

    /// One pump thread per channel sending queued blocks.
    fn spawn_senders(&mut self, queue: &Receiver<Block>) -> Result<(), Error> {
        if !self.fabric.is_empty() {
            let plan = SlotPlan::new(self.params.block_size, self.params.depth);
            for (i, channel) in std::mem::take(&mut self.fabric).into_iter().enumerate() {
                let (queue, cancel, progress) =
                    (queue.clone(), self.cancel.clone(), self.progress.clone());
                let peer = self.peer().to_string();
                self.spawn(&format!("fsend{i}"), move || {
                    fabric::send_blocks(channel, plan, &queue, &cancel, &progress, &peer)
                });
            }
            return Ok(());
        }
        for i in 0..self.channels.len() {
            let mut channel = self.channel(&self.channels[i])?;
            if self.params.io == crate::source::IoMode::Zerocopy {
                channel.enable_zerocopy()?;
            }
            let (queue, cancel, progress) =
                (queue.clone(), self.cancel.clone(), self.progress.clone());
            self.spawn(&format!("send{i}"), move || {
                pump_out(&mut channel, &queue, &cancel, &progress)
            });
        }
        Ok(())
    }

    /// One pump thread per channel receiving blocks into the writers' queue.
    fn spawn_receivers(&mut self, pool: &Pool, out: &Sender<Block>) -> Result<(), Error> {
        if !self.fabric.is_empty() {
            let plan = SlotPlan::new(self.params.block_size, self.params.depth);
            for (i, channel) in std::mem::take(&mut self.fabric).into_iter().enumerate() {
                let (out, cancel, progress) =
                    (out.clone(), self.cancel.clone(), self.progress.clone());
                let limits = RecvLimits {
                    plan,
                    session_tag: self.params.session_tag,
                    max_payload: self.params.block_size as usize,
                };
                let peer = self.peer().to_string();
                self.spawn(&format!("frecv{i}"), move || {
                    fabric::recv_blocks(channel, &limits, &out, &cancel, &progress, &peer)
                });
            }
            return Ok(());
        }
        for i in 0..self.channels.len() {
            let mut channel = self.channel(&self.channels[i])?;
            let (pool, out, cancel, progress) = (
                pool.clone(),
                out.clone(),
                self.cancel.clone(),
                self.progress.clone(),
            );
            self.spawn(&format!("recv{i}"), move || {
                pump_in(&mut channel, &pool, &out, &cancel, &progress)
            });
        }
        Ok(())
    }

    /// Joins every worker. Call after the queues they feed have closed or after cancel.
    pub fn join_workers(&mut self) {
        for handle in self.workers.drain(..) {
            if handle.join().is_err() {
                tracing::error!("a worker thread panicked");
            }
        }
    }

    /// Ends the session after a fatal error: tells the peer, wakes and joins everything.
    pub fn abort(&mut self, error: &Error) {
        self.cancel.cancel();
        let _ = self.control.send(&Message::Error(ErrorMsg::new(
            error.wire_class(),
            &error.to_string(),
        )));
        for stream in &self.channels {
            let _ = stream.shutdown(Shutdown::Both);
        }
        self.join_workers();
    }

    fn worker_exit(&self, exit: Result<(), Error>) -> Result<(), Error> {
        match exit {
            Ok(()) => Ok(()),
            Err(e @ Error::Network { .. }) => Err(self.peer_explanation().unwrap_or(e)),
            // A worker sees `Cancelled` only when the session is already failing.
            Err(e) => Err(e),
        }
    }

    /// A data channel broke: a peer that gives up (a full disk, a refused file) says why
    /// on the control connection just before it closes the channels, and that reason is
    /// the one the user can act on, not the "broken pipe" it causes here.
    fn peer_explanation(&self) -> Option<Error> {
        let deadline = std::time::Instant::now() + PEER_EXPLANATION_WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.incoming.recv_timeout(left) {
                Ok(Ok(Message::Error(e))) => return Some(Error::remote(self.peer(), &e)),
                Ok(Ok(_)) => {}
                _ => return None,
            }
        }
    }
}

/// How long a broken data channel waits for the peer's reason on the control connection.
const PEER_EXPLANATION_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn unexpected(peer: &str, msg: &Message) -> Error {
    Error::protocol(peer, format!("unexpected message {msg:?}"))
}

fn remote_file_error(peer: &str, f: &FileFailed) -> Error {
    let message = String::from_utf8_lossy(&f.message).into_owned();
    match f.class {
        FailureClass::Integrity => Error::Integrity {
            path: format!("file #{} at {peer}", f.id),
            offset: f.offset,
            detail: message,
        },
        class => Error::Remote {
            peer: peer.to_string(),
            class,
            message,
        },
    }
}

/// Sends `source`: lists it, announces it within the window, and feeds readers and
/// channels until the receiver has resolved every entry.
pub fn run_sender(core: &mut Core, source: &Source) -> Result<Outcome, Error> {
    let result = sender_loop(core, source);
    match &result {
        Ok(_) => core.join_workers(),
        Err(e) => core.abort(e),
    }
    result.map(|outcome| Outcome {
        io: IoUse {
            mode: core.params.io.name().to_string(),
            fallback: core.progress.io_fallback.get().cloned(),
            ..IoUse::default()
        },
        ..outcome
    })
}

struct SenderState {
    walker: Walker,
    planner: Planner,
    outstanding: Outstanding,
    next_id: u64,
    total_bytes: u64,
    walk_done: bool,
    end_sent: bool,
    batch: Vec<wanxfer_proto::Entry>,
    /// Encoded size of `batch`, kept as entries are added: summing the batch before each
    /// entry made announcing a batch quadratic in its length.
    batch_bytes: usize,
    batch_plans: Vec<Plan>,
    /// Plans of announced batches, released when the receiver acknowledges the batch.
    awaiting_ack: VecDeque<(u64, Vec<Plan>)>,
    plans: Option<Sender<Plan>>,
    outcome: Outcome,
}

fn sender_loop(core: &mut Core, source: &Source) -> Result<Outcome, Error> {
    let params = core.params.clone();
    let pool = Pool::new(params.pool_blocks(), params.block_size as usize);
    let (plans_tx, plans_rx) = crossbeam_channel::unbounded::<Plan>();
    let (blocks_tx, blocks_rx) = crossbeam_channel::bounded::<Block>(params.pool_blocks());
    let (fail_tx, mut fail_rx) = crossbeam_channel::unbounded::<ReadFailure>();
    let shared = Arc::new(ReaderShared::default());
    let cfg = ReaderConfig {
        session_tag: params.session_tag,
        block_crc: params.block_crc,
        file_digest: params.file_digest,
        io: params.io,
    };
    for i in 0..params.readers {
        let (plans, blocks, fails, pool, cfg, shared, cancel) = (
            plans_rx.clone(),
            blocks_tx.clone(),
            fail_tx.clone(),
            pool.clone(),
            cfg.clone(),
            shared.clone(),
            core.cancel.clone(),
        );
        core.spawn(&format!("reader{i}"), move || {
            run_reader(plans, blocks, fails, pool, cfg, shared, cancel)
        });
    }
    drop((plans_rx, blocks_tx, fail_tx));
    core.spawn_senders(&blocks_rx)?;
    drop(blocks_rx);

    let mut st = SenderState {
        walker: Walker::new(source),
        planner: Planner::new(params.block_size as usize),
        outstanding: Outstanding::default(),
        next_id: 0,
        total_bytes: 0,
        walk_done: false,
        end_sent: false,
        batch: Vec::new(),
        batch_bytes: 0,
        batch_plans: Vec::new(),
        awaiting_ack: VecDeque::new(),
        plans: Some(plans_tx),
        outcome: Outcome::default(),
    };
    let exits = core.exits.1.clone();
    let incoming = core.incoming.clone();
    loop {
        walk_some(core, &mut st)?;
        if st.end_sent && st.outstanding.is_empty() {
            break;
        }
        let can_walk = !st.walk_done && st.outstanding.len() < params.window as usize;
        select! {
            recv(incoming) -> msg => {
                let msg = msg.map_err(|_| Error::Cancelled)??;
                sender_message(core, &mut st, msg)?;
            }
            recv(fail_rx) -> failure => {
                let Ok(ReadFailure { id, error }) = failure else {
                    // The readers are done; the transfer is not (the receiver is still
                    // writing). A closed queue is always ready: stop selecting on it.
                    fail_rx = crossbeam_channel::never();
                    continue;
                };
                let msg = FileFailed {
                    id,
                    class: error.wire_class(),
                    offset: 0,
                    message: ErrorMsg::new(error.wire_class(), &error.to_string()).message,
                };
                core.control.send(&Message::FileFailed(msg))?;
                resolve(core, &mut st, id, Err(error));
            }
            recv(exits) -> exit => {
                if let Ok(exit) = exit {
                    core.worker_exit(exit)?;
                }
            }
            default(if can_walk { std::time::Duration::ZERO } else { crate::pool::CANCEL_POLL }) => {}
        }
    }
    st.outcome.skipped = std::mem::take(&mut st.walker.skipped);
    Ok(st.outcome)
}

fn resolve(core: &Core, st: &mut SenderState, id: u64, result: Result<(), Error>) {
    let Some(kind) = st.outstanding.remove(id) else {
        return;
    };
    match result {
        Ok(()) => st.outcome.count_done(kind, &core.progress),
        Err(e) => {
            core.progress.failed_files.fetch_add(1, Ordering::Relaxed);
            st.outcome.failures.push(e);
        }
    }
}

/// Lists entries while the window allows, announcing them a batch at a time.
fn walk_some(core: &mut Core, st: &mut SenderState) -> Result<(), Error> {
    let window = core.params.window as usize;
    while !st.walk_done
        && st.outstanding.len() < window
        && st.batch.len() < MAX_MANIFEST_ENTRIES
        && st.batch_bytes < wanxfer_proto::MAX_FRAME_BODY / 2
    {
        match st.walker.next_entry() {
            None => st.walk_done = true,
            Some(Err(e)) => {
                core.progress.failed_files.fetch_add(1, Ordering::Relaxed);
                st.outcome.failures.push(e);
            }
            Some(Ok(walked)) => {
                let id = st.next_id;
                st.next_id += 1;
                st.total_bytes += walked.entry.size;
                st.outstanding.insert(id, walked.entry.kind, &core.progress);
                core.progress
                    .total_bytes
                    .fetch_add(walked.entry.size, Ordering::Relaxed);
                st.batch_bytes += manifest_bytes(&walked.entry);
                st.batch.push(walked.entry);
                if let Some(job) = walked.job {
                    st.planner.add(job, &mut st.batch_plans);
                }
            }
        }
        // Keep the loop responsive: announce what we have at most every batch.
    }
    if !st.batch.is_empty() {
        st.planner.flush(&mut st.batch_plans);
        let first_id = st.next_id - st.batch.len() as u64;
        let entries = std::mem::take(&mut st.batch);
        st.batch_bytes = 0;
        core.control
            .send(&Message::Manifest(Manifest { first_id, entries }))?;
        st.awaiting_ack
            .push_back((st.next_id, std::mem::take(&mut st.batch_plans)));
    }
    if st.walk_done && !st.end_sent {
        core.control.send(&Message::ManifestEnd(ManifestEnd {
            entries: st.next_id,
            bytes: st.total_bytes,
        }))?;
        st.end_sent = true;
        release_plans(st, 0);
    }
    Ok(())
}

/// An upper bound on the bytes `entry` adds to a `Manifest` frame.
fn manifest_bytes(entry: &wanxfer_proto::Entry) -> usize {
    40 + entry.path.as_bytes().len() + entry.link_target.len()
}

/// Hands the readers every plan whose entries the receiver has taken in; closes the plan
/// queue once everything is handed out.
fn release_plans(st: &mut SenderState, through: u64) {
    while st
        .awaiting_ack
        .front()
        .is_some_and(|(end, _)| *end <= through)
    {
        let (_, plans) = st.awaiting_ack.pop_front().expect("front exists");
        if let Some(tx) = &st.plans {
            for plan in plans {
                let _ = tx.send(plan);
            }
        }
    }
    if st.end_sent && st.awaiting_ack.is_empty() {
        st.plans = None;
    }
}

fn sender_message(core: &mut Core, st: &mut SenderState, msg: Message) -> Result<(), Error> {
    match msg {
        Message::ManifestAck { through } => {
            if through > st.next_id {
                return Err(Error::protocol(
                    core.peer(),
                    "acknowledged entries never sent",
                ));
            }
            release_plans(st, through);
        }
        Message::FileAck { ids } => {
            for id in ids {
                resolve(core, st, id, Ok(()));
            }
        }
        Message::FileFailed(f) => {
            let error = remote_file_error(core.peer(), &f);
            resolve(core, st, f.id, Err(error));
        }
        Message::Error(e) => return Err(Error::remote(core.peer(), &e)),
        other => return Err(unexpected(core.peer(), &other)),
    }
    Ok(())
}

/// Receives into `sink` until the sender's manifest is complete and every entry in it is
/// resolved.
pub fn run_receiver(core: &mut Core, sink: Arc<Sink>) -> Result<Outcome, Error> {
    let result = receiver_loop(core, &sink);
    match &result {
        Ok(_) => core.join_workers(),
        Err(e) => core.abort(e),
    }
    for pending in sink.pending() {
        sink.abandon(pending);
    }
    result.map(|outcome| Outcome {
        io: sink.io_use(),
        ..outcome
    })
}

struct ReceiverState {
    next_id: u64,
    end: Option<u64>,
    outstanding: Outstanding,
    acks: Vec<u64>,
    outcome: Outcome,
}

fn receiver_loop(core: &mut Core, sink: &Arc<Sink>) -> Result<Outcome, Error> {
    let params = core.params.clone();
    let pool = Pool::new(params.pool_blocks(), params.block_size as usize);
    let (blocks_tx, blocks_rx) = crossbeam_channel::bounded::<Block>(params.pool_blocks());
    // A writer hands over a whole block's resolutions at once: one wake-up of this loop
    // and one `FileAck` per block of small files, not one per file.
    let (res_tx, mut res_rx) = crossbeam_channel::unbounded::<Vec<Resolution>>();
    core.spawn_receivers(&pool, &blocks_tx)?;
    drop(blocks_tx);
    for i in 0..params.writers {
        let (queue, sink, results, cancel) = (
            blocks_rx.clone(),
            sink.clone(),
            res_tx.clone(),
            core.cancel.clone(),
        );
        core.spawn(&format!("writer{i}"), move || {
            run_writer(&queue, &sink, &results, &cancel)
        });
    }
    drop((blocks_rx, res_tx));

    let mut st = ReceiverState {
        next_id: 0,
        end: None,
        outstanding: Outstanding::default(),
        acks: Vec::new(),
        outcome: Outcome::default(),
    };
    let exits = core.exits.1.clone();
    let incoming = core.incoming.clone();
    while !(st.end == Some(st.next_id) && st.outstanding.is_empty()) {
        select! {
            recv(incoming) -> msg => {
                let msg = msg.map_err(|_| Error::Cancelled)??;
                receiver_message(core, sink, &mut st, msg)?;
            }
            recv(res_rx) -> batch => {
                let Ok(batch) = batch else {
                    // Writers gone: a closed queue is always ready, so stop selecting on
                    // it rather than spin until the control connection says we are done.
                    res_rx = crossbeam_channel::never();
                    continue;
                };
                for res in batch {
                    receiver_resolution(core, &mut st, res)?;
                }
            }
            recv(exits) -> exit => {
                if let Ok(exit) = exit {
                    core.worker_exit(exit)?;
                }
            }
            default(crate::pool::CANCEL_POLL) => {}
        }
        if incoming.is_empty() && res_rx.is_empty() || st.acks.len() >= MAX_ACK_IDS {
            flush_acks(core, &mut st)?;
        }
    }
    for error in sink.finish_dirs() {
        st.outcome.failures.push(error);
    }
    flush_acks(core, &mut st)?;
    Ok(st.outcome)
}

fn flush_acks(core: &mut Core, st: &mut ReceiverState) -> Result<(), Error> {
    while !st.acks.is_empty() {
        let n = st.acks.len().min(MAX_ACK_IDS);
        let ids: Vec<u64> = st.acks.drain(..n).collect();
        core.control.send(&Message::FileAck { ids })?;
    }
    Ok(())
}

fn receiver_resolution(
    core: &mut Core,
    st: &mut ReceiverState,
    res: Resolution,
) -> Result<(), Error> {
    match res {
        Resolution::Done { id, .. } => {
            if let Some(kind) = st.outstanding.remove(id) {
                st.acks.push(id);
                st.outcome.count_done(kind, &core.progress);
            }
        }
        Resolution::Failed { id, error } => {
            st.outstanding.remove(id);
            let msg = FileFailed {
                id,
                class: error.wire_class(),
                offset: match &error {
                    Error::Integrity { offset, .. } => *offset,
                    _ => 0,
                },
                message: ErrorMsg::new(error.wire_class(), &error.to_string()).message,
            };
            core.control.send(&Message::FileFailed(msg))?;
            core.progress.failed_files.fetch_add(1, Ordering::Relaxed);
            st.outcome.failures.push(error);
        }
    }
    Ok(())
}

fn receiver_message(
    core: &mut Core,
    sink: &Sink,
    st: &mut ReceiverState,
    msg: Message,
) -> Result<(), Error> {
    match msg {
        Message::Manifest(m) => {
            if m.first_id != st.next_id || st.end.is_some() {
                return Err(Error::protocol(
                    core.peer(),
                    "manifest entries out of order",
                ));
            }
            for entry in &m.entries {
                let id = st.next_id;
                st.next_id += 1;
                core.progress
                    .total_bytes
                    .fetch_add(entry.size, Ordering::Relaxed);
                st.outstanding.insert(id, entry.kind, &core.progress);
                match sink.apply_entry(id, entry)? {
                    Some(res) => receiver_resolution(core, st, res)?,
                    None => {
                        if st.outstanding.len() > core.params.window as usize {
                            return Err(Error::protocol(
                                core.peer(),
                                "more files announced than the agreed window",
                            ));
                        }
                    }
                }
            }
            flush_acks(core, st)?;
            core.control.send(&Message::ManifestAck {
                through: st.next_id,
            })?;
        }
        Message::ManifestEnd(end) => {
            if end.entries != st.next_id {
                return Err(Error::protocol(
                    core.peer(),
                    format!(
                        "manifest ends at {} entries but {} were sent",
                        end.entries, st.next_id
                    ),
                ));
            }
            st.end = Some(end.entries);
        }
        Message::FileFailed(f) => {
            sink.abandon(f.id);
            if st.outstanding.remove(f.id).is_some() {
                core.progress.failed_files.fetch_add(1, Ordering::Relaxed);
                st.outcome.failures.push(remote_file_error(core.peer(), &f));
            }
        }
        Message::Error(e) => return Err(Error::remote(core.peer(), &e)),
        other => return Err(unexpected(core.peer(), &other)),
    }
    Ok(())
}

/// One writer thread: places received blocks until the channels are done.
fn run_writer(
    queue: &Receiver<Block>,
    sink: &Sink,
    results: &Sender<Vec<Resolution>>,
    cancel: &Cancel,
) -> Result<(), Error> {
    while let Some(block) = recv_or_cancel(queue, cancel)? {
        let mut resolved = Vec::new();
        sink.place_block(block, &mut resolved)?;
        if !resolved.is_empty() {
            let _ = results.send(resolved);
        }
    }
    Ok(())
}
