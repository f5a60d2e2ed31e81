//! Blocks over libfabric (RDMA on InfiniBand, RoCE and iWARP through `verbs`; the `tcp`
//! provider everywhere else, which runs the same code path for real).
//!
//! Why credits instead of a stream: an RDMA write lands in the receiver's memory without
//! its CPU, so the sender may only write where the receiver said it may. Each data
//! channel's receiver registers a pool of slots and grants them (tian2011 §4.3); the
//! sender gathers a block's header and payload into one RDMA write to a granted slot,
//! announced by remote CQ data; the receiver decodes it, hands the payload to a writer
//! and grants the slot again. A slow writer therefore withholds credits and the sender
//! waits, never overruns. The credit and control-window bookkeeping (with its reserved
//! buffer, so neither side deadlocks) is `wanxfer-fabric`'s [`Channel`]; this module
//! fits it to the engine's pool queues.
//!
//! Why the TCP data connections stay: they are where a channel proves it belongs to the
//! session (the same proof TCP channels use), and the fabric connection then presents
//! that proof again as its first message (carried in its connection request where the
//! provider carries data, see `wanxfer_fabric::Channel::connect_opening`), so a slot key
//! is never granted to anyone but the authenticated client, and never outlives its
//! session (the registrations go with the channel).
//!
//! Neither end copies a block: the sender writes from its pool buffers (registered once,
//! cached), and the receiver's slots are pool buffers too, handed to the writers where
//! the block landed and granted again when the writers let go of them. That is also why a
//! chunk of a large file is written page-aligned into its slot ([`payload_offset`]): the
//! writer can only bypass the page cache from aligned memory.

use std::collections::{HashMap, VecDeque};
use std::io::IoSlice;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use subtle::ConstantTimeEq;
use wanxfer_fabric::{
    Access, AlignedBuf, Channel, ChannelConfig, Credit, Event, FabricConfig, Listener,
};
use wanxfer_proto::{
    decode_frame, encode_frame, BlockHeader, ChannelJoin, Message, Segment, TransportKind,
};
use wanxfer_session::negotiate::{fabric_slot_len, FABRIC_HEADER_ROOM};

use super::{
    check_header, seg_refs, tcp_info, unsent_limit, Closer, Joined, Link, LinkEvent, PumpCtx,
    Transport,
};
use crate::digest::{BlockKey, PayloadVerifier};
use crate::fs::DIRECT_ALIGN;
use crate::pool::{Block, Cancel, Pool, SlotArena, CANCEL_POLL};
use crate::progress::{PoolKind, Progress};
use crate::Error;

/// The control message that ends a channel's blocks (after the last write completed).
const END_OF_BLOCKS: &[u8] = b"wanxfer:end-of-blocks";

/// How long a graceful close may take before the channel is simply dropped.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(30);

/// While writes are in flight, how long the sender sleeps on the completion queue before
/// looking at its block queue again.
const BUSY_WAIT: Duration = Duration::from_millis(1);

/// How long a joined data connection waits for its fabric channel to arrive.
const PAIRING_TIMEOUT: Duration = Duration::from_secs(30);

/// What libfabric discovery chose, as reported to the user.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FabricNames {
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    /// Slots (credits) per channel: the blocks one channel has in flight.
    pub slots: u32,
    /// Control credits per channel, sized so a round trip's grants are never held back.
    pub control_credits: u32,
}

impl FabricNames {
    /// What discovery chose, before any channel sets the sizes.
    fn discovered(info: &wanxfer_fabric::ProviderInfo) -> FabricNames {
        FabricNames {
            provider: info.provider.clone(),
            fabric: info.fabric.clone(),
            domain: info.domain.clone(),
            ..FabricNames::default()
        }
    }
}

/// Sizes both sides derive from the agreed session parameters.
#[derive(Debug, Clone, Copy)]
pub struct SlotPlan {
    /// Slots (credits) per channel.
    pub slots: u32,
    /// Bytes per slot: room for the largest header and segment table, padded to a page,
    /// plus one block, rounded up to a page so that every slot starts on one (the session
    /// crate's `fabric_slot_len`, which the memory budget counts).
    pub slot_len: usize,
}

impl SlotPlan {
    pub fn new(block_size: u32, depth: u16) -> SlotPlan {
        SlotPlan {
            slots: u32::from(depth) + 1,
            slot_len: fabric_slot_len(block_size) as usize,
        }
    }

    fn channel_config(&self) -> ChannelConfig {
        ChannelConfig::for_grants(self.slots)
    }
}

/// Room for the largest header and segment table, padded as [`payload_offset`] pads.
const HEADER_ROOM: usize = FABRIC_HEADER_ROOM as usize;

/// Where a block's payload starts in the bytes written to a slot, given where its
/// segment table ends. A block lands in the slot as written, with no copy, and the writer
/// hands that memory to `O_DIRECT` writes only if it is page-aligned; so the payload of a
/// chunk of a multi-block file (one segment that is not a whole file: the only kind
/// written direct) starts on the next page boundary, and the gap is zeros on the wire,
/// less than a page per block. Blocks of whole files go unpadded. Both sides derive the
/// offset from the header, so the receiver accepts exactly this layout and nothing looser.
fn payload_offset(table_end: usize, segments: &[Segment]) -> usize {
    match segments {
        [only] if !(only.offset == 0 && only.is_last()) => table_end.next_multiple_of(DIRECT_ALIGN),
        _ => table_end,
    }
}

fn fabric_config(provider: &str) -> FabricConfig {
    FabricConfig::with_provider(provider)
}

/// Maps the fabric layer's errors to the engine's classes: a provider that is not there
/// is the user's to fix (exit code "usage"), everything else is the network's.
fn fabric_error(peer: &str, context: &'static str, e: wanxfer_fabric::Error) -> Error {
    match e {
        wanxfer_fabric::Error::ProviderUnavailable { .. } => Error::Usage(format!(
            "{e}; `fi_info -l` lists the providers this machine has"
        )),
        other => Error::network(context, peer, std::io::Error::other(other.to_string())),
    }
}

/// Opens the server's per-session fabric listener on the address its clients reached.
pub fn listen(provider: &str, ip: IpAddr) -> Result<(Listener, FabricNames), Error> {
    let listener = Listener::bind(&fabric_config(provider), SocketAddr::new(ip, 0))
        .map_err(|e| fabric_error(&ip.to_string(), "opening a fabric listener on", e))?;
    let names = FabricNames::discovered(listener.provider());
    Ok((listener, names))
}

/// libfabric endpoints beside each joined data connection: RDMA writes into slots the
/// receiver grants. Each receiving link registers its own slot arena, so there is no
/// shared receive pool.
pub struct FabricTransport {
    names: Mutex<Option<FabricNames>>,
    peer: String,
    plan: SlotPlan,
    session_tag: u64,
    max_payload: usize,
    side: Side,
    /// The key the peer's blocks are tagged with: fabric sessions run only without
    /// encryption (see `session::server`), so every block carries a MAC.
    receive_key: Option<BlockKey>,
}

enum Side {
    /// Dials the server's per-session fabric listener for each link.
    Client(Dialer),
    /// Pairs fabric channels, accepted by a thread of their own, with joined data
    /// connections.
    Server { pairing: Arc<Pairing> },
}

impl FabricTransport {
    /// Starts loading libfabric and its providers on a thread of its own, so that the
    /// first session using them finds them ready (see [`wanxfer_fabric::prepare`]);
    /// `done` then gets the names discovery chose, or why `provider` is not there.
    pub fn prepare(provider: &str, done: impl FnOnce(Result<FabricNames, Error>) + Send + 'static) {
        let cfg = fabric_config(provider);
        let provider = provider.to_owned();
        // Nothing else waits for it: a session's own discovery takes libfabric's lock and
        // finds the providers ready, or waits for them as it would have anyway.
        let _ = std::thread::Builder::new()
            .name("wanxfer-fabric-init".into())
            .spawn(move || {
                let found = wanxfer_fabric::prepare(&cfg)
                    .map(|info| FabricNames::discovered(&info))
                    .map_err(|e| fabric_error(&provider, "starting the fabric provider", e));
                done(found);
            });
    }

    /// The client's side: `addr` is the server's fabric listener for this session.
    pub fn client(
        provider: &str,
        addr: SocketAddr,
        plan: SlotPlan,
        session_tag: u64,
        max_payload: usize,
    ) -> Self {
        FabricTransport {
            names: Mutex::new(None),
            peer: addr.to_string(),
            plan,
            session_tag,
            max_payload,
            side: Side::Client(Dialer {
                provider: provider.to_string(),
                addr,
                channel: plan.channel_config(),
                peer: addr.to_string(),
                ahead: Mutex::new(HashMap::new()),
            }),
            receive_key: None,
        }
    }

    /// Requires the peer's blocks to carry a MAC under `key`.
    pub fn with_receive_key(mut self, key: Option<BlockKey>) -> Self {
        self.receive_key = key;
        self
    }

    /// The server's side: accepts fabric channels on `listener` until `cancel`.
    pub fn server(
        mut listener: Listener,
        plan: SlotPlan,
        session_tag: u64,
        max_payload: usize,
        peer: String,
        cancel: Cancel,
    ) -> Result<Self, Error> {
        let pairing = Arc::new(Pairing::default());
        let (accepting, cfg, who) = (pairing.clone(), plan.channel_config(), peer.clone());
        std::thread::Builder::new()
            .name("wanxfer-faccept".into())
            .spawn(move || accept_loop(&mut listener, &cfg, &accepting, &cancel, &who))
            .map_err(|e| Error::local("start thread", "fabric acceptor", e))?;
        Ok(FabricTransport {
            names: Mutex::new(None),
            peer,
            plan,
            session_tag,
            max_payload,
            side: Side::Server { pairing },
            receive_key: None,
        })
    }

    fn link(&self, channel: Channel, stream: crate::stream::Stream, index: u16) -> Box<dyn Link> {
        self.names
            .lock()
            .expect("no panics while held")
            .get_or_insert_with(|| names(&channel));
        Box::new(FabricLink {
            channel,
            closer: Closer::new(stream.tcp()),
            _binding: stream,
            index,
            plan: self.plan,
            session_tag: self.session_tag,
            max_payload: self.max_payload,
            receive_key: self.receive_key.clone(),
            peer: self.peer.clone(),
        })
    }
}

impl Transport for FabricTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Fabric
    }

    fn receive_pool(&self, _buffers: usize, _block_size: usize) -> Option<Pool> {
        None
    }

    fn begin_link(&self, join: &ChannelJoin) {
        if let Side::Client(dialer) = &self.side {
            dialer.begin(join);
        }
    }

    /// The channel dialled for it closes as its dial ends (the server gives its pairing
    /// up when the session ends, or past `MAX_UNPAIRED`).
    fn forget_link(&self, index: u16) {
        if let Side::Client(dialer) = &self.side {
            dialer
                .ahead
                .lock()
                .expect("no panics while held")
                .remove(&index);
        }
    }

    /// The channel dialled as the join left: the tcp provider's TCP handshake, then its
    /// connection exchange, which carries the join and brings the first grants back
    /// behind it. (A provider whose request has no room for the join takes a round trip
    /// more, not counted: verbs, whose connection manager has more steps of its own.)
    fn link_round_trips(&self) -> u32 {
        2
    }

    fn connect(&self, joined: Joined) -> Result<Box<dyn Link>, Error> {
        let Side::Client(dialer) = &self.side else {
            return Err(Error::Internal(
                "a server does not dial fabric channels".into(),
            ));
        };
        let Joined { stream, join } = joined;
        let channel = dialer.joined(&join)?;
        Ok(self.link(channel, stream, join.index))
    }

    /// The fabric channel presents the join its data connection presented: that proof is
    /// bound to the data connection's server nonce, so it pairs the two and nothing else.
    fn fabric_names(&self) -> Option<FabricNames> {
        self.names.lock().expect("no panics while held").clone()
    }

    fn link_window(&self) -> Option<u64> {
        Some(u64::from(self.plan.slots) * self.max_payload as u64)
    }

    fn accept(&self, joined: Joined) -> Result<Box<dyn Link>, Error> {
        let Side::Server { pairing } = &self.side else {
            return Err(Error::Internal(
                "a client does not accept fabric channels".into(),
            ));
        };
        let Joined { stream, join } = joined;
        let channel = pairing.wait(join.index, &join.proof, &self.peer)?;
        Ok(self.link(channel, stream, join.index))
    }
}

/// The client's fabric channels to one session's listener, each dialled as soon as its
/// data connection's join has left.
///
/// Why then: a fabric channel presents that join, and carries it in its connection
/// request (`Channel::connect_opening`), so the server pairs the channel as it accepts
/// it and grants slots right behind its answer. The channel's connect (a TCP handshake
/// and the provider's own exchange with the tcp provider) then overlaps the wait for the
/// join's answer, and the first grants arrive with the connection: through the emulator
/// at 100 ms the first write left a round trip earlier than when the channel was dialled
/// ahead and joined by a message once connected.
struct Dialer {
    provider: String,
    addr: SocketAddr,
    channel: ChannelConfig,
    peer: String,
    /// Channels being dialled, by the index of the join they carry.
    ahead: Mutex<HashMap<u16, Receiver<Result<Channel, Error>>>>,
}

impl Dialer {
    fn dial(
        provider: &str,
        addr: SocketAddr,
        channel: &ChannelConfig,
        peer: &str,
        join: &ChannelJoin,
    ) -> Result<Channel, Error> {
        let mut frame = Vec::new();
        encode_frame(&Message::ChannelJoin(*join), &mut frame);
        Channel::connect_opening(&fabric_config(provider), addr, channel, &frame)
            .map_err(|e| fabric_error(peer, "connecting a fabric channel to", e))
    }

    /// Starts dialling the channel that presents `join`, on a thread of its own.
    fn begin(&self, join: &ChannelJoin) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let (provider, addr, channel, peer, join) = (
            self.provider.clone(),
            self.addr,
            self.channel.clone(),
            self.peer.clone(),
            *join,
        );
        let spawned = std::thread::Builder::new()
            .name("wanxfer-fdial".into())
            .spawn(move || {
                let _ = tx.send(Self::dial(&provider, addr, &channel, &peer, &join));
            });
        if spawned.is_ok() {
            self.ahead
                .lock()
                .expect("no panics while held")
                .insert(join.index, rx);
        }
    }

    /// The channel that presented `join`: the one dialled for it, if that connected,
    /// else one dialled now (no thread to dial it, or its dial failed: a retry costs
    /// only the set-up).
    fn joined(&self, join: &ChannelJoin) -> Result<Channel, Error> {
        let ahead = self
            .ahead
            .lock()
            .expect("no panics while held")
            .remove(&join.index);
        match ahead.and_then(|rx| rx.recv().ok()) {
            Some(Ok(channel)) => Ok(channel),
            Some(Err(e)) => {
                tracing::debug!("{}: dialling a fabric channel again: {e}", self.peer);
                Self::dial(&self.provider, self.addr, &self.channel, &self.peer, join)
            }
            None => Self::dial(&self.provider, self.addr, &self.channel, &self.peer, join),
        }
    }
}

/// Fabric channels that arrived, waiting for their data connection, and the other way
/// round: the two may come in either order.
#[derive(Default)]
struct Pairing {
    arrived: Mutex<HashMap<u16, (Channel, [u8; 32])>>,
    changed: Condvar,
}

/// Most fabric channels waiting for their data connection: beyond it, newcomers are
/// turned away (an honest client never has more in flight than its streams).
const MAX_UNPAIRED: usize = 64;

impl Pairing {
    fn wait(&self, index: u16, proof: &[u8; 32], peer: &str) -> Result<Channel, Error> {
        let deadline = Instant::now() + PAIRING_TIMEOUT;
        let mut arrived = self.arrived.lock().expect("no panics while held");
        loop {
            if let Some((channel, presented)) = arrived.remove(&index) {
                if bool::from(presented.ct_eq(proof)) {
                    return Ok(channel);
                }
                return Err(Error::Auth {
                    peer: peer.to_string(),
                    detail: format!("fabric channel {index} presented another connection's proof"),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::network(
                    "waiting for a fabric channel to join from",
                    peer,
                    std::io::ErrorKind::TimedOut.into(),
                ));
            }
            arrived = self
                .changed
                .wait_timeout(arrived, left.min(CANCEL_POLL))
                .expect("no panics while held")
                .0;
        }
    }

    fn arrive(&self, join: ChannelJoin, channel: Channel) -> bool {
        let mut arrived = self.arrived.lock().expect("no panics while held");
        if arrived.len() >= MAX_UNPAIRED || arrived.contains_key(&join.index) {
            return false;
        }
        arrived.insert(join.index, (channel, join.proof));
        self.changed.notify_all();
        true
    }
}

/// Fabric channels whose joins are awaited at once, each on a thread of its own; past
/// this, the acceptor waits for a join itself before it accepts the next channel. A join
/// carried in the connection request is there when the channel is accepted; these
/// threads are for joins sent as messages (a provider with no room in its request, an
/// older client).
///
/// Why not one at a time: a join sent as a message arrives a round trip after its
/// connect, so waiting for each before accepting the next opened a session's channels one
/// round trip apart (through the emulator at 100 ms, the fourth of four started writing
/// 0.3 s after the first; at 200 ms it would be 0.6 s, and every channel the tuner adds
/// queues behind the others' joins).
const MAX_JOINING: usize = 16;

/// Accepts fabric channels until the session ends; each must join first.
fn accept_loop(
    listener: &mut Listener,
    cfg: &ChannelConfig,
    pairing: &Arc<Pairing>,
    cancel: &Cancel,
    peer: &str,
) {
    let joining = Arc::new(AtomicUsize::new(0));
    while !cancel.is_cancelled() {
        let channel = match Channel::accept_within(listener, cfg, Some(CANCEL_POLL)) {
            Ok(channel) => channel,
            Err(wanxfer_fabric::Error::Timeout { .. }) => continue,
            Err(e) => {
                tracing::warn!("fabric channel from {peer}: {e}");
                continue;
            }
        };
        if joining.load(Ordering::Acquire) >= MAX_JOINING {
            pair(channel, pairing, cancel, peer);
            continue;
        }
        joining.fetch_add(1, Ordering::AcqRel);
        let (pairing, cancel, who, done) = (
            pairing.clone(),
            cancel.clone(),
            peer.to_string(),
            joining.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("wanxfer-fjoin".into())
            .spawn(move || {
                pair(channel, &pairing, &cancel, &who);
                done.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            // The channel went with the closure, and is closed.
            joining.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("fabric channel from {peer}: no thread to await its join: {e}");
        }
    }
}

/// Waits for `channel`'s join and hands it to the pairing.
fn pair(mut channel: Channel, pairing: &Pairing, cancel: &Cancel, peer: &str) {
    match await_join(&mut channel, cancel, peer) {
        Ok(join) if pairing.arrive(join, channel) => {}
        Ok(join) => tracing::warn!(
            "fabric channel {} from {peer} refused: a duplicate, or too many waiting",
            join.index
        ),
        Err(e) => tracing::warn!("fabric channel from {peer}: {e}"),
    }
}

fn await_join(channel: &mut Channel, cancel: &Cancel, peer: &str) -> Result<ChannelJoin, Error> {
    let deadline = Instant::now() + PAIRING_TIMEOUT;
    while Instant::now() < deadline && !cancel.is_cancelled() {
        match channel
            .wait(Some(CANCEL_POLL))
            .map_err(|e| fabric_error(peer, "joining a fabric channel from", e))?
        {
            Some(Event::Control(bytes)) => {
                return match decode_frame(&bytes) {
                    Ok(Message::ChannelJoin(join)) => Ok(join),
                    Ok(_) => Err(Error::protocol(
                        peer,
                        "a fabric channel must start by joining",
                    )),
                    Err(e) => Err(Error::decode(peer, e)),
                };
            }
            Some(_) => {
                return Err(Error::protocol(
                    peer,
                    "a fabric channel must start by joining",
                ))
            }
            None => {}
        }
    }
    Err(Error::network(
        "waiting for a fabric channel to join from",
        peer,
        std::io::ErrorKind::TimedOut.into(),
    ))
}

/// Names of what a channel's discovery chose, and the sizes it runs with.
pub fn names(channel: &Channel) -> FabricNames {
    FabricNames {
        slots: channel.config().max_grants,
        control_credits: channel.config().ctrl_credits,
        ..FabricNames::discovered(channel.provider())
    }
}

/// One fabric channel with the data connection that bound it to the session (kept open:
/// closing it is how either side ends the link).
struct FabricLink {
    channel: Channel,
    closer: Closer,
    _binding: crate::stream::Stream,
    index: u16,
    plan: SlotPlan,
    session_tag: u64,
    max_payload: usize,
    receive_key: Option<BlockKey>,
    peer: String,
}

impl Link for FabricLink {
    fn index(&self) -> u16 {
        self.index
    }

    fn closer(&self) -> Closer {
        self.closer.clone()
    }

    fn registrations(&self) -> Option<wanxfer_fabric::RegistrationCount> {
        Some(self.channel.registrations())
    }

    fn send(self: Box<Self>, queue: Receiver<Block>, ctx: &PumpCtx) -> Result<(), Error> {
        let FabricLink {
            channel,
            plan,
            peer,
            max_payload,
            index,
            ..
        } = *self;
        bound_unsent(&channel, max_payload, index, &peer);
        send_blocks(channel, plan, &queue, ctx, &peer)
    }

    fn receive(
        self: Box<Self>,
        _pool: Option<Pool>,
        out: Sender<Block>,
        ctx: &PumpCtx,
    ) -> Result<(), Error> {
        let limits = RecvLimits {
            plan: self.plan,
            session_tag: self.session_tag,
            max_payload: self.max_payload,
            receive_key: self.receive_key.clone(),
        };
        let FabricLink { channel, peer, .. } = *self;
        recv_blocks(channel, &limits, &out, ctx, &peer)
    }
}

/// Bounds what the kernel socket under a sending channel keeps unsent, where the provider
/// runs over one (tcp), as a TCP link's is bounded ([`unsent_limit`]); see
/// [`posted_cap`] for why. Through the emulator on path (b), 12 runs each with the bound
/// set for the whole namespace and without: the slowest 3.76 s against 3.96 s (two of
/// twelve).
///
/// One block (at least 1 MiB), where a TCP link's socket keeps two: a fabric channel
/// has one more block in hand, its posted write, which completes only once all of it is
/// in the socket, so the socket already holds the next while the one after is posted.
/// Every block there is committed to that connection, and a connection slow from its
/// start-up delivered the last of them after the others had emptied the queue. On (b),
/// 10 alternating pairs of fabric pushes: one block 3.46-3.70 s (median 3.57), two
/// 3.50-3.96 s (median 3.62), 8 of 10 pairs no slower; (d) 7.41-7.50 s against
/// 7.43-7.47 s, (e) 1.36-1.47 s against 1.39-1.47 s (bench/runs/hold-2026-11-29.md).
fn bound_unsent(channel: &Channel, max_payload: usize, index: u16, peer: &str) {
    let Some(socket) = channel.connection().kernel_socket() else {
        return;
    };
    if let Err(e) = tcp_info::set_unsent_limit(&socket, unsent_limit(max_payload, 1)) {
        tracing::warn!("fabric channel {index} to {peer}: limiting its unsent bytes: {e}");
    }
}

/// A sent block whose write has not completed: its buffer must not be reused yet.
struct InFlight {
    _block: Block,
    header_slot: usize,
    len: u64,
}

/// The sending end: writes queued blocks into slots the receiver granted, until the queue
/// closes; then says so and closes the channel gracefully.
fn send_blocks(
    channel: Channel,
    plan: SlotPlan,
    queue: &Receiver<Block>,
    ctx: &PumpCtx,
    peer: &str,
) -> Result<(), Error> {
    let mut sender = FabricSender::new(channel, plan, peer)?;
    let mut queue_open = true;
    while queue_open || !sender.in_flight.is_empty() {
        if ctx.cancel.is_cancelled() {
            return Err(Error::Cancelled);
        }
        sender.take_events(ctx)?;
        if ctx.retire.is_cancelled() {
            // Retired by the tuner: what is in flight completes, nothing new is taken.
            queue_open = false;
        }
        if !(queue_open && sender.can_write()) {
            // Nothing to do until a credit or a completion arrives: sleep on the CQ.
            let starved = queue_open && sender.credits.is_empty();
            let asked = std::time::Instant::now();
            sender.wait_event(ctx)?;
            if starved {
                // Every slot is out: on the path (a window smaller than the path's
                // bandwidth-delay product waits here each round trip) or held by the
                // receiver's writers. Either way not a wait for data: more streams,
                // each with its own slots, may help.
                ctx.progress
                    .fabric_credit_wait_us
                    .fetch_add(asked.elapsed().as_micros() as u64, Ordering::Relaxed);
            }
            continue;
        }
        let wait = if sender.in_flight.is_empty() {
            CANCEL_POLL
        } else {
            BUSY_WAIT
        };
        // A credit in hand and no block to write into it: the readers, not the network,
        // kept this channel idle (the tuner adds no stream for that, as over TCP).
        match super::next_block(queue, wait, ctx) {
            Ok(block) => {
                let segments = seg_refs(&block);
                if let Some(pacer) = &ctx.pacer {
                    // A token bucket: RDMA writes have no kernel pacing to lean on.
                    pacer.take(block.len as u64, &ctx.cancel);
                }
                if let Err(e) = sender.write(block) {
                    (ctx.report)(LinkEvent::Unsent {
                        index: ctx.index,
                        segments,
                    });
                    return Err(e);
                }
                // Writes on one connection land in order: the receiver's count of arrived
                // blocks says which of these made it if the channel dies.
                (ctx.report)(LinkEvent::Sent {
                    index: ctx.index,
                    segments,
                });
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => queue_open = false,
        }
    }
    sender.finish()
}

struct FabricSender<'p> {
    // Dropped first: nothing may still be registered when the buffers below go.
    channel: Channel,
    peer: &'p str,
    credits: VecDeque<Credit>,
    in_flight: HashMap<u32, InFlight>,
    headers: AlignedBuf,
    header_len: usize,
    free_headers: Vec<usize>,
    /// Most writes posted and not complete (see [`posted_cap`]).
    posted_cap: usize,
}

/// Writes a sending channel keeps posted at once where its provider completes a write as
/// soon as the bytes are in a kernel socket (the tcp provider, unless asked for delivery
/// completion, which block announcement by CQ data does not need).
const SOCKET_POSTED: usize = 1;

/// Writes a sending channel over `provider` may have posted at once, with `slots` granted.
///
/// Why fewer than its credits over the tcp provider: there a write completes once the
/// provider has copied it into the connection's socket, so the socket, whose buffer the
/// kernel grows with the connection's window, holds what is on the path; writes posted
/// beyond it wait in the provider's queue, committed to that one connection. A session's
/// connections do not leave their start-up alike: on path (b) (100 ms, 1 Gbit/s, 0.01%
/// loss) one of eight sometimes carried 60-100 Mbit/s for seconds, and the blocks it held
/// (every slot: 20 MiB at 4 MiB blocks) arrived a second after the others had emptied
/// the queue. One posted is enough: its write completes once its last byte is in the
/// socket, which then still holds up to a block unsent ([`bound_unsent`]), time enough
/// to post the next; a slow connection holds only that one and its socket's. A second
/// posted write, waiting behind the first, was one more block committed to a connection
/// that might be the slow one: alternating the two builds on (b), 24 runs each, the
/// fabric push took over 3.78 s (0.9 of TCP's 3.4 s) in 1 run with one posted against 6
/// with two (medians 3.51 s and 3.56 s), and (d) ran at 7.39 s with either
/// (bench/runs/tail-2026-11-28.md). On RDMA hardware a write completes when the peer has
/// it, so every slot may be on the wire.
fn posted_cap(provider: &str, slots: u32) -> usize {
    let slots = slots as usize;
    if provider == "tcp" {
        slots.min(SOCKET_POSTED)
    } else {
        slots
    }
}

impl<'p> FabricSender<'p> {
    fn new(mut channel: Channel, plan: SlotPlan, peer: &'p str) -> Result<Self, Error> {
        // Headers are staged in registered memory of our own (a pool buffer's header
        // vector may be reallocated); payloads are written straight from pool buffers.
        let header_len = HEADER_ROOM;
        let count = plan.slots as usize;
        let mut headers = AlignedBuf::new(header_len * count);
        // SAFETY: `headers` lives in this struct, dropped after `channel` (field order).
        unsafe { channel.register_raw(headers.as_mut_ptr(), headers.len(), Access::WRITE_SOURCE) }
            .map_err(|e| fabric_error(peer, "registering send buffers for", e))?;
        Ok(FabricSender {
            posted_cap: posted_cap(&channel.provider().provider, plan.slots),
            channel,
            peer,
            credits: VecDeque::new(),
            in_flight: HashMap::new(),
            headers,
            header_len,
            free_headers: (0..count).collect(),
        })
    }

    fn can_write(&self) -> bool {
        !self.credits.is_empty()
            && !self.free_headers.is_empty()
            && self.in_flight.len() < self.posted_cap
    }

    fn take_events(&mut self, ctx: &PumpCtx) -> Result<(), Error> {
        while let Some(event) = self
            .channel
            .poll()
            .map_err(|e| fabric_error(self.peer, "polling the fabric channel to", e))?
        {
            self.handle(event, ctx)?;
        }
        Ok(())
    }

    fn wait_event(&mut self, ctx: &PumpCtx) -> Result<(), Error> {
        let event = self
            .channel
            .wait(Some(CANCEL_POLL))
            .map_err(|e| fabric_error(self.peer, "waiting for credits from", e))?;
        match event {
            Some(event) => self.handle(event, ctx),
            None => Ok(()),
        }
    }

    fn handle(&mut self, event: Event, ctx: &PumpCtx) -> Result<(), Error> {
        match event {
            Event::Credit(credit) => self.credits.push_back(credit),
            Event::WriteComplete { slot } => {
                let done = self.in_flight.remove(&slot).ok_or_else(|| {
                    Error::protocol(self.peer, format!("completion for idle slot {slot}"))
                })?;
                self.free_headers.push(done.header_slot);
                ctx.progress.moved(ctx.index, done.len);
            }
            other => {
                return Err(Error::protocol(
                    self.peer,
                    format!("unexpected {other:?} on a sending fabric channel"),
                ))
            }
        }
        Ok(())
    }

    fn write(&mut self, block: Block) -> Result<(), Error> {
        let credit = self
            .credits
            .pop_front()
            .expect("can_write checked a credit");
        let header_slot = self.free_headers.pop().expect("can_write checked a header");
        let start = header_slot * self.header_len;
        let table_end = block.header.len();
        let end = start + payload_offset(table_end, &block.segments);
        let staged = &mut self.headers.as_mut_slice()[start..end];
        staged[..table_end].copy_from_slice(&block.header);
        staged[table_end..].fill(0);
        let storage = block.storage();
        // SAFETY: pool buffers are boxed slices that stay put for the pool's life; the
        // provider reads one only while a write we posted from it is in flight, and we
        // hold that block (so nobody refills it) until the write completes.
        unsafe {
            self.channel.register_raw(
                storage.as_ptr() as *mut u8,
                storage.len(),
                Access::WRITE_SOURCE,
            )
        }
        .map_err(|e| fabric_error(self.peer, "registering a block buffer for", e))?;
        let iov = [
            IoSlice::new(&self.headers.as_slice()[start..end]),
            IoSlice::new(block.payload()),
        ];
        self.channel
            .write_block(&iov, credit)
            .map_err(|e| fabric_error(self.peer, "writing a block to", e))?;
        let len = block.len as u64;
        self.in_flight.insert(
            credit.slot,
            InFlight {
                _block: block,
                header_slot,
                len,
            },
        );
        Ok(())
    }

    fn finish(mut self) -> Result<(), Error> {
        self.channel
            .send_control(END_OF_BLOCKS)
            .map_err(|e| fabric_error(self.peer, "ending the blocks to", e))?;
        let FabricSender {
            channel,
            peer,
            headers,
            ..
        } = self;
        let closed = channel
            .close(Some(CLOSE_TIMEOUT))
            .map_err(|e| fabric_error(peer, "closing the fabric channel to", e));
        drop(headers); // only now that the registration is gone
        closed.map(drop)
    }
}

/// The receiving end's slots, and what it checks blocks against.
struct RecvLimits {
    plan: SlotPlan,
    session_tag: u64,
    max_payload: usize,
    receive_key: Option<BlockKey>,
}

/// While some slots are held by writers, how often freed ones are looked for (the
/// completion queue cannot wake us for them).
const REGRANT_POLL: Duration = Duration::from_micros(250);

/// The receiving end: registers this channel's slots and grants them; each block that
/// lands goes to the writers in its slot, without a copy, and the slot is granted again
/// when the writers drop the block. A slow writer therefore withholds credits.
fn recv_blocks(
    channel: Channel,
    limits: &RecvLimits,
    out: &Sender<Block>,
    ctx: &PumpCtx,
    peer: &str,
) -> Result<(), Error> {
    let cancel = &ctx.cancel;
    let err = |context: &'static str| move |e| fabric_error(peer, context, e);
    let plan = limits.plan;
    let arena = SlotArena::new(plan.slots as usize, plan.slot_len);
    let slots = Pool::of_slots(&arena);
    // Declared after the arena, so dropped (and deregistered) before it.
    let mut channel = channel;
    // SAFETY: the arena outlives the channel (drop order above, and every block in it
    // holds it too); the provider writes only into slots we granted, whose buffers we
    // hold untouched in `granted` until their block is announced.
    let region =
        unsafe { channel.register_raw(arena.as_mut_ptr(), arena.len(), Access::REMOTE_WRITE) }
            .map_err(err("registering receive slots for"))?;
    channel
        .set_slot_pool(region, plan.slot_len)
        .map_err(err("setting up receive slots for"))?;
    ctx.progress.watch_pool(PoolKind::FabricSlots, &slots);
    let mut granted = Granted {
        slots: HashMap::new(),
        progress: &ctx.progress,
    };
    loop {
        while let Some(block) = slots.try_take() {
            let slot = block.slot().expect("slot pools hold slots");
            channel.grant(slot).map_err(err("granting a slot to"))?;
            granted.insert(slot, block);
        }
        if cancel.is_cancelled() {
            return Err(Error::Cancelled);
        }
        let wait = if granted.len() < plan.slots as usize {
            REGRANT_POLL
        } else {
            CANCEL_POLL
        };
        let Some(event) = channel
            .wait(Some(wait))
            .map_err(err("receiving blocks from"))?
        else {
            continue;
        };
        match event {
            Event::BlockArrived { slot, len } => {
                let mut block = granted.remove(&slot).ok_or_else(|| {
                    Error::protocol(
                        peer,
                        format!("a block in slot {slot}, which was not granted"),
                    )
                })?;
                take_block_in_place(&mut block, len, limits, peer)?;
                ctx.progress.moved(ctx.index, block.len as u64);
                out.send(block).map_err(|_| Error::Cancelled)?;
                (ctx.report)(LinkEvent::Received { index: ctx.index });
            }
            Event::Control(msg) if msg == END_OF_BLOCKS => break,
            other => {
                return Err(Error::protocol(
                    peer,
                    format!("unexpected {other:?} on a receiving fabric channel"),
                ))
            }
        }
    }
    drop(granted);
    channel
        .close(Some(CLOSE_TIMEOUT))
        .map_err(err("closing the fabric channel from"))?;
    Ok(())
}

/// The slots granted to the sender and not yet written: its credits, also counted in the
/// session's progress so that a watcher sees how many the sender holds.
struct Granted<'a> {
    slots: HashMap<u32, Block>,
    progress: &'a Progress,
}

impl Granted<'_> {
    fn insert(&mut self, slot: u32, block: Block) {
        if self.slots.insert(slot, block).is_none() {
            self.progress.fabric_credits.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn remove(&mut self, slot: &u32) -> Option<Block> {
        let block = self.slots.remove(slot)?;
        self.progress.fabric_credits.fetch_sub(1, Ordering::Relaxed);
        Some(block)
    }

    fn len(&self) -> usize {
        self.slots.len()
    }
}

impl Drop for Granted<'_> {
    fn drop(&mut self) {
        self.progress
            .fabric_credits
            .fetch_sub(self.slots.len() as u64, Ordering::Relaxed);
    }
}

/// Decodes and checks the `len` bytes that landed in `block`'s slot; the payload stays
/// where it is, after the header and segment table.
fn take_block_in_place(
    block: &mut Block,
    len: usize,
    limits: &RecvLimits,
    peer: &str,
) -> Result<(), Error> {
    // Reuse the buffer's segment vector (taken out so the slot can be read meanwhile).
    let mut segments = std::mem::take(&mut block.segments);
    segments.clear();
    let bytes = block
        .storage()
        .get(..len)
        .ok_or_else(|| Error::protocol(peer, "block larger than its slot"))?;
    let fixed: [u8; BlockHeader::LEN] = bytes
        .get(..BlockHeader::LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| Error::protocol(peer, "block shorter than its header"))?;
    let header = BlockHeader::decode_fixed(&fixed).map_err(|e| Error::decode(peer, e))?;
    check_header(
        &header,
        limits.session_tag,
        limits.max_payload,
        limits.receive_key.is_some(),
        peer,
    )?;
    let table_end = BlockHeader::encoded_len(header.segment_count as usize);
    let table = bytes
        .get(BlockHeader::LEN..table_end)
        .ok_or_else(|| Error::protocol(peer, "block shorter than its segment table"))?;
    header
        .decode_segments(&fixed, table, &mut segments)
        .map_err(|e| Error::decode(peer, e))?;
    let mac_table = limits.receive_key.as_ref().map(|_| table.to_vec());
    let payload_len = header.payload_len as usize;
    let payload_start = payload_offset(table_end, &segments);
    if len != payload_start + payload_len {
        return Err(Error::protocol(
            peer,
            format!(
                "block of {len} bytes does not match its header ({payload_start} + {payload_len})"
            ),
        ));
    }
    block.segments = segments;
    block.start = payload_start;
    block.len = payload_len;
    let mut check = PayloadVerifier::new(&header, &block.segments);
    if let (Some(key), Some(table)) = (&limits.receive_key, &mac_table) {
        check = check.with_mac(key, &header, &fixed, table);
    }
    check.update(&block.segments, block.payload());
    check.settle(block);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TAG: u64 = 42;

    fn limits() -> RecvLimits {
        RecvLimits {
            receive_key: None,
            plan: SlotPlan::new(1 << 20, 1),
            session_tag: TAG,
            max_payload: 1 << 20,
        }
    }

    /// Writes a block of `payload` for `seg` into a fresh slot-sized buffer with its payload
    /// at `payload_at`; the buffer and the byte count a write would announce.
    /// The segment carries the digest of `payload`.
    fn landed(mut seg: Segment, payload: &[u8], payload_at: Option<usize>) -> (Block, usize) {
        seg.digest = crate::digest::digest_of(payload);
        let header = BlockHeader {
            flags: BlockHeader::FLAG_SEGMENT_DIGESTS,
            segment_count: 1,
            payload_len: payload.len() as u32,
            payload_crc: 0,
            session_tag: TAG,
            sequence: 0,
            mac: [0; 12],
        };
        let mut encoded = Vec::new();
        header.encode(&[seg], &mut encoded);
        let at = payload_at.unwrap_or_else(|| payload_offset(encoded.len(), &[seg]));
        let pool = Pool::new(1, limits().plan.slot_len);
        let mut block = pool.take(&Cancel::default()).unwrap();
        let space = block.space();
        space[..encoded.len()].copy_from_slice(&encoded);
        space[at..at + payload.len()].copy_from_slice(payload);
        (block, at + payload.len())
    }

    fn chunk(offset: u64, len: usize) -> Segment {
        Segment {
            file_id: 1,
            offset,
            len: len as u32,
            flags: 0,
            digest: [0; 16],
        }
    }

    /// A chunk of a large file lands page-aligned in its slot, intact.
    #[test]
    fn a_chunk_of_a_large_file_lands_page_aligned() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 249) as u8).collect();
        let (mut block, len) = landed(chunk(1 << 20, payload.len()), &payload, None);
        take_block_in_place(&mut block, len, &limits(), "peer").unwrap();
        assert_eq!(block.start % DIRECT_ALIGN, 0);
        assert_eq!(block.payload(), &payload[..]);
        assert!(block.damaged.is_empty());
        assert_eq!(block.checks, BlockHeader::FLAG_SEGMENT_DIGESTS);
    }

    /// A byte changed in the slot (a bad write, a stale key) is caught where it lies, and
    /// the segment is marked damaged for the writers.
    #[test]
    fn a_damaged_chunk_is_marked_where_it_lies() {
        let payload = vec![5u8; 10_000];
        let (mut block, len) = landed(chunk(1 << 20, payload.len()), &payload, None);
        let at = len - 1;
        block.space()[at] ^= 0x20;
        take_block_in_place(&mut block, len, &limits(), "peer").unwrap();
        assert_eq!(block.damaged, [true]);
    }

    /// Over the tcp provider a channel posts one write at a time, whatever its slots; over
    /// a provider whose writes complete at the peer, every slot may be posted.
    #[test]
    fn only_the_tcp_provider_keeps_writes_back_from_its_slots() {
        assert_eq!(posted_cap("tcp", 5), 1);
        assert_eq!(posted_cap("tcp", 1), 1);
        assert_eq!(posted_cap("verbs", 5), 5);
        assert_eq!(posted_cap("verbs;ofi_rxm", 17), 17);
    }

    /// A whole file in one block goes unpadded: it is never written direct.
    #[test]
    fn a_whole_file_block_is_not_padded() {
        let mut seg = chunk(0, 5000);
        seg.flags = Segment::FLAG_LAST;
        let payload = vec![3u8; 5000];
        let (mut block, len) = landed(seg, &payload, None);
        take_block_in_place(&mut block, len, &limits(), "peer").unwrap();
        assert_eq!(block.start, BlockHeader::encoded_len(1));
        assert_eq!(block.payload(), &payload[..]);
    }

    /// The layout is exact: a chunk written without its padding is refused, not read
    /// from the wrong place.
    #[test]
    fn a_chunk_without_its_padding_is_refused() {
        let payload = vec![9u8; 8192];
        let unpadded = Some(BlockHeader::encoded_len(1));
        let (mut block, len) = landed(chunk(1 << 20, payload.len()), &payload, unpadded);
        let e = take_block_in_place(&mut block, len, &limits(), "peer").unwrap_err();
        assert!(e.to_string().contains("does not match its header"), "{e}");
    }

    /// A channel that connects and never joins (a slow client, or a stranger who found
    /// the port) must not hold up the channels behind it: each join is awaited on its
    /// own. Waited on one at a time, the second join would be read only once the first
    /// wait ran out (`PAIRING_TIMEOUT`), as long as the pairing below waits.
    #[test]
    fn a_channel_that_never_joins_does_not_hold_up_the_next() {
        let (mut listener, _) = match listen("tcp", "127.0.0.1".parse().unwrap()) {
            Ok(listening) => listening,
            Err(e) => {
                eprintln!("skipped: no libfabric tcp provider here: {e}");
                return;
            }
        };
        let addr = listener.local_addr();
        let plan = SlotPlan::new(1 << 20, 1);
        let cfg = plan.channel_config();
        let pairing = Arc::new(Pairing::default());
        let cancel = Cancel::default();
        let acceptor = {
            let (pairing, cancel, cfg) = (pairing.clone(), cancel.clone(), cfg.clone());
            std::thread::spawn(move || accept_loop(&mut listener, &cfg, &pairing, &cancel, "test"))
        };
        let dial = || Channel::connect(&fabric_config("tcp"), addr, &cfg).unwrap();
        let _silent = dial();
        let mut joining = dial();
        let join = ChannelJoin {
            session_id: [1; 16],
            index: 1,
            proof: [7; 32],
        };
        let mut frame = Vec::new();
        encode_frame(&Message::ChannelJoin(join), &mut frame);
        joining.send_control(&frame).unwrap();
        let paired = pairing.wait(1, &[7; 32], "test");
        cancel.cancel();
        acceptor.join().unwrap();
        assert!(paired.is_ok(), "{:?}", paired.err());
    }
}
