//! The credit-based block channel.
//!
//! Why credits: an RDMA write lands in the receiver's memory without the
//! receiver's CPU taking part, so the sender may only write where the
//! receiver said it may — a credit names one free slot of the receiver's
//! registered block pool. The receiver regains the slot when the block is
//! announced (remote CQ data carrying the slot index, or a message where
//! the provider lacks CQ data), hands it to its writer, and grants it again
//! only when the slot is free. A slow receiver therefore slows the sender
//! down by withholding credits instead of being overrun.
//!
//! Why a second kind of credit: control messages (credits themselves, and
//! the small messages of the layer above) are eager sends into receive
//! buffers posted in advance; sending into a peer with no posted buffer is
//! an error or a stall on RDMA hardware. Each side may have at most its
//! peer's window of such messages unacknowledged. One buffer of the window
//! is kept back from ordinary messages for the pure acknowledgement, so
//! acknowledgements can always be sent and neither side can deadlock with
//! both windows exhausted. Acknowledgements are cumulative counts, sent
//! piggy-backed on every message and on their own only once at least two
//! (or half a window of) messages are owed, so two idle peers do not keep
//! acknowledging each other's acknowledgements.
//!
//! Why extra receive buffers: where the provider consumes a receive buffer
//! for each write carrying CQ data (FI_RX_CQ_DATA, e.g. verbs), or where
//! blocks are announced by message, every outstanding grant may consume one
//! buffer; these are posted on top of the control window and never counted
//! against it.
//!
//! The channel knows slots, lengths and bytes only — nothing of files.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use crate::buf::RegisterMem;
use crate::conn::{Completion, ConnConfig, Connection, Listener};
use crate::error::{Error, Result};
use crate::info::{FabricConfig, ProviderInfo};
use crate::mr::{Access, MemoryRegion, RegistrationCount, RemoteSlot};

/// Bytes of the header on every control message.
const HEADER: usize = 16;
/// Bytes of a grant's body (address, key, length).
const GRANT_BODY: usize = 24;
/// Longest block inside a blocking call before deadlines are rechecked.
const PUMP_SLICE: Duration = Duration::from_millis(100);

/// Control message kinds on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Ack = 2,
    Grant = 3,
    Control = 4,
    Notify = 5,
    Bye = 6,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        [
            Kind::Hello,
            Kind::Ack,
            Kind::Grant,
            Kind::Control,
            Kind::Notify,
            Kind::Bye,
        ]
        .into_iter()
        .find(|k| *k as u8 == b)
    }

    /// How a message of this kind is paid for.
    fn cost(self) -> Cost {
        match self {
            Kind::Hello => Cost::Opening,
            Kind::Ack | Kind::Bye => Cost::Reserved,
            Kind::Grant | Kind::Control => Cost::Regular,
            Kind::Notify => Cost::Block,
        }
    }
}

/// Which receive buffers of the peer a message may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cost {
    /// Needs two free window buffers (one stays reserved for acks).
    Regular,
    /// May use the reserved buffer.
    Reserved,
    /// The first message; the peer posted its window before connecting.
    Opening,
    /// Uses the extra buffers covered by a block credit.
    Block,
}

/// Sizes of a channel. Both sides may use different values; each learns
/// the other's window and message limit when the channel opens.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// Ordinary control messages the peer may have outstanding towards us
    /// (at least 2); one more buffer is posted for acknowledgements.
    pub ctrl_credits: u32,
    /// Largest control message payload we accept.
    pub ctrl_max_len: usize,
    /// Slots we may have granted and not yet seen arrive.
    pub max_grants: u32,
    /// RDMA writes we may have in flight.
    pub max_writes: usize,
    /// How long a blocking control send waits for the peer's window
    /// (`None`: until the connection breaks).
    pub credit_timeout: Option<Duration>,
    /// How long connect/accept wait.
    pub connect_timeout: Option<Duration>,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        ChannelConfig {
            ctrl_credits: 8,
            ctrl_max_len: 1024,
            max_grants: 64,
            max_writes: 64,
            credit_timeout: None,
            connect_timeout: Some(Duration::from_secs(30)),
        }
    }
}

/// Most control credits [`ChannelConfig::for_grants`] sizes a window to: with the
/// grants' own buffers it stays within the 256 receives the `tcp` provider queues by
/// default (`FI_TCP_RX_SIZE`) for up to 127 slots.
pub const MAX_CTRL_CREDITS: u32 = 128;

impl ChannelConfig {
    /// A channel whose receiver grants up to `grants` slots and whose sender writes
    /// them all at once, with a control window that lets every grant of a round trip
    /// out (see [`ctrl_credits_for_grants`]).
    pub fn for_grants(grants: u32) -> ChannelConfig {
        ChannelConfig {
            ctrl_credits: ctrl_credits_for_grants(grants),
            max_grants: grants,
            max_writes: grants as usize,
            ..ChannelConfig::default()
        }
    }

    fn window(&self) -> u64 {
        u64::from(self.ctrl_credits) + 1
    }

    fn message_size(&self) -> usize {
        HEADER + self.ctrl_max_len.max(GRANT_BODY)
    }

    /// The connection sizes this channel needs.
    pub fn conn_config(&self) -> ConnConfig {
        ConnConfig {
            rx_count: (self.window() + u64::from(self.max_grants)) as usize,
            rx_size: self.message_size(),
            tx_count: self.window() as usize + self.max_writes + 1,
            tx_size: self.message_size(),
            max_writes: self.max_writes,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.ctrl_credits < 2 || self.max_grants == 0 || self.max_writes == 0 {
            return Err(Error::InvalidArgument(
                "need ctrl_credits >= 2, max_grants >= 1 and max_writes >= 1".into(),
            ));
        }
        Ok(())
    }
}

/// Control credits a window needs so that a receiver granting `grants` slots is never
/// held back by it.
///
/// Why this is the long-RTT limit: grants are window-counted control messages, and the
/// sender acknowledges them only once half its window is owed, so the receiver may have
/// a round trip's grants on the wire plus up to half a window the sender holds back, all
/// unacknowledged. With the fixed default of 8 credits a receiver could hand out at most
/// 7 grants per round trip, whatever its slot count: 16 slots of 4 MiB at 95 ms moved at
/// 0.35 of their model. Covering `grants` on the wire plus the sender's half window needs
/// `2 × grants + 1`; one more leaves room for the layer above's own messages.
pub fn ctrl_credits_for_grants(grants: u32) -> u32 {
    grants
        .saturating_mul(2)
        .saturating_add(2)
        .clamp(ChannelConfig::default().ctrl_credits, MAX_CTRL_CREDITS)
}

/// Permission to write one slot of the peer's block pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    /// The slot's index in the peer's pool.
    pub slot: u32,
    /// Where and with which key to write it.
    pub remote: RemoteSlot,
}

/// Something the channel has to tell its user.
#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// The peer granted a slot: one `write_block` may target it.
    Credit(Credit),
    /// A block landed in our slot `slot`; read it with [`Channel::slot`],
    /// then grant the slot again once it is free.
    BlockArrived {
        /// The slot written.
        slot: u32,
        /// Bytes written into it.
        len: usize,
    },
    /// A control message from the peer.
    Control(Vec<u8>),
    /// Our write into the peer's slot `slot` completed locally: its source
    /// buffers may be reused.
    WriteComplete {
        /// The peer's slot the write went to.
        slot: u32,
    },
}

/// How blocks are announced to the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Announce {
    /// Remote CQ data carries the slot index.
    CqData,
    /// A message after the write; the provider orders sends after writes.
    OrderedMessage,
    /// A message once the write is known delivered.
    MessageAfterDelivery,
}

/// Our registered block pool, split into equal slots.
struct Pool {
    region: MemoryRegion,
    slot_size: usize,
    granted: Vec<bool>,
}

/// Control-window accounting, in cumulative message counts.
#[derive(Debug, Default)]
struct Window {
    /// The peer's window (posted buffers), once its hello arrived.
    peer: Option<u64>,
    /// Largest control payload the peer accepts.
    peer_max_len: usize,
    /// Window-counted messages we sent.
    sent: u64,
    /// Of those, how many the peer has acknowledged.
    acked_by_peer: u64,
    /// Window-counted messages of the peer we have consumed.
    consumed: u64,
    /// The `consumed` value we last told the peer.
    acked_to_peer: u64,
}

impl Window {
    fn free(&self) -> u64 {
        self.peer
            .map_or(0, |w| w.saturating_sub(self.sent - self.acked_by_peer))
    }

    fn allows(&self, cost: Cost) -> bool {
        match cost {
            Cost::Regular => self.free() >= 2,
            Cost::Reserved => self.free() >= 1,
            Cost::Opening | Cost::Block => true,
        }
    }

    fn owed(&self) -> u64 {
        self.consumed - self.acked_to_peer
    }
}

/// A connection carrying credit-controlled block writes and control
/// messages in both directions.
pub struct Channel {
    conn: Connection,
    cfg: ChannelConfig,
    announce: Announce,
    pool: Option<Pool>,
    grants_out: u32,
    window: Window,
    events: VecDeque<Event>,
    notifies: VecDeque<(u32, u64)>,
    scratch: Vec<Completion>,
    bye_sent: bool,
    bye_received: bool,
}

/// Marks a hello carried in the connection's set-up (see [`Opening`]).
const OPENING_TAG: &[u8; 4] = b"WXC1";
/// Bytes of a hello carried in the set-up: the tag, the window, the largest control
/// message.
const OPENING_HELLO: usize = OPENING_TAG.len() + 4 + 8;

/// A side's hello as it travels in the connection request or its answer, where the
/// provider carries data there, and after the connector's hello, its first control
/// message.
///
/// Why: a hello sent as the first message costs the peer half a round trip before it
/// may send anything counted against the window (grants, control messages), and the
/// layer above's first message (the engine's join) another; on a 100 ms path that was a
/// round trip of every channel's set-up. Carried in the set-up, the acceptor knows the
/// connector's window and first message when it accepts, and its grants follow its
/// answer. An acceptor answers in kind only to a request that carried a hello, and a
/// connector whose answer carried none sends both as messages, as a peer that carries
/// nothing does: either side may be older, or its provider carry no data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Opening {
    window: u32,
    max_len: u64,
    first: Vec<u8>,
}

impl Opening {
    fn hello(cfg: &ChannelConfig) -> Opening {
        Opening {
            window: cfg.window() as u32,
            max_len: cfg.ctrl_max_len as u64,
            first: Vec::new(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(OPENING_HELLO + self.first.len());
        out.extend_from_slice(OPENING_TAG);
        out.extend_from_slice(&self.window.to_le_bytes());
        out.extend_from_slice(&self.max_len.to_le_bytes());
        out.extend_from_slice(&self.first);
        out
    }

    /// The opening in `data`, if it holds one (anything else is a peer that carries
    /// nothing, or something not ours: ignored, and the messages awaited).
    fn decode(data: &[u8]) -> Option<Opening> {
        let rest = data.strip_prefix(OPENING_TAG)?;
        let window = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?);
        let max_len = u64::from_le_bytes(rest.get(4..12)?.try_into().ok()?);
        Some(Opening {
            window,
            max_len,
            first: rest[12..].to_vec(),
        })
    }
}

impl Channel {
    /// Dials a listening peer and opens a channel.
    pub fn connect(
        fabric: &FabricConfig,
        addr: SocketAddr,
        cfg: &ChannelConfig,
    ) -> Result<Channel> {
        Channel::connect_opening(fabric, addr, cfg, &[])
    }

    /// As [`Channel::connect`], with `first` the channel's first control message: the
    /// peer's first [`Event::Control`] is `first`, which travels in the connection
    /// request where the provider has room (see [`Opening`]), else as a message.
    pub fn connect_opening(
        fabric: &FabricConfig,
        addr: SocketAddr,
        cfg: &ChannelConfig,
        first: &[u8],
    ) -> Result<Channel> {
        cfg.validate()?;
        if first.len() > cfg.ctrl_max_len {
            return Err(Error::InvalidArgument(format!(
                "first control message of {} bytes (limit {})",
                first.len(),
                cfg.ctrl_max_len
            )));
        }
        let hello = Opening::hello(cfg);
        let mut carried = false;
        let (conn, answer) = Connection::connect_with(
            fabric,
            addr,
            &cfg.conn_config(),
            cfg.connect_timeout,
            |room| {
                if room < OPENING_HELLO {
                    return Vec::new();
                }
                carried = room >= OPENING_HELLO + first.len();
                let opening = Opening {
                    first: if carried { first.to_vec() } else { Vec::new() },
                    ..hello
                };
                opening.encode()
            },
        )?;
        // An answer in kind says the acceptor took what the request carried.
        let answered = Opening::decode(&answer);
        let took_first = carried && answered.is_some();
        let mut channel = Channel::open(conn, cfg, answered)?;
        if !first.is_empty() && !took_first {
            channel.send_control(first)?;
        }
        Ok(channel)
    }

    /// Accepts the next connection on `listener` and opens a channel.
    pub fn accept(listener: &mut Listener, cfg: &ChannelConfig) -> Result<Channel> {
        Channel::accept_within(listener, cfg, cfg.connect_timeout)
    }

    /// As [`Channel::accept`], waiting at most `request_wait` for a connection request
    /// ([`Error::Timeout`] if none came, the listener unchanged).
    pub fn accept_within(
        listener: &mut Listener,
        cfg: &ChannelConfig,
        request_wait: Option<Duration>,
    ) -> Result<Channel> {
        cfg.validate()?;
        let mut in_kind = false;
        let (conn, request) = listener.accept_with(
            &cfg.conn_config(),
            request_wait,
            cfg.connect_timeout,
            |request, room| {
                in_kind = room >= OPENING_HELLO && Opening::decode(request).is_some();
                if in_kind {
                    Opening::hello(cfg).encode()
                } else {
                    Vec::new()
                }
            },
        )?;
        // What the request carried is taken only where answered in kind: otherwise the
        // connector sends it all again as messages.
        let opening = Opening::decode(&request).filter(|_| in_kind);
        let first = opening.as_ref().map(|o| o.first.clone());
        let mut channel = Channel::open(conn, cfg, opening)?;
        if let Some(first) = first.filter(|f| !f.is_empty()) {
            if first.len() > cfg.ctrl_max_len {
                return Err(Error::Protocol(format!(
                    "first control message of {} bytes (limit {})",
                    first.len(),
                    cfg.ctrl_max_len
                )));
            }
            channel.events.push_back(Event::Control(first));
        }
        Ok(channel)
    }

    /// Opens a channel on an established connection; `peer` is the peer's hello where
    /// it travelled in the set-up, and then this side's went there too and is not sent.
    fn open(conn: Connection, cfg: &ChannelConfig, peer: Option<Opening>) -> Result<Channel> {
        let info = conn.provider();
        let announce = if info.remote_cq_data {
            Announce::CqData
        } else if info.send_after_write_ordered() {
            Announce::OrderedMessage
        } else {
            Announce::MessageAfterDelivery
        };
        let mut channel = Channel {
            conn,
            cfg: cfg.clone(),
            announce,
            pool: None,
            grants_out: 0,
            window: Window::default(),
            events: VecDeque::new(),
            notifies: VecDeque::new(),
            scratch: Vec::new(),
            bye_sent: false,
            bye_received: false,
        };
        match peer {
            Some(hello) => {
                channel.window.peer = Some(u64::from(hello.window));
                channel.window.peer_max_len = hello.max_len as usize;
            }
            None => {
                let hello = (cfg.ctrl_max_len as u64).to_le_bytes();
                let window = cfg.window() as u32;
                channel.send_message(Kind::Hello, window, &hello)?;
            }
        }
        Ok(channel)
    }

    /// The sizes this side opened the channel with.
    pub fn config(&self) -> &ChannelConfig {
        &self.cfg
    }

    /// What discovery chose.
    pub fn provider(&self) -> &ProviderInfo {
        self.conn.provider()
    }

    /// The underlying connection (for inspection).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// A live count of this channel's registrations.
    pub fn registrations(&self) -> RegistrationCount {
        self.conn.registrations()
    }

    /// Whether blocks are announced by remote CQ data (else by message).
    pub fn uses_cq_data(&self) -> bool {
        self.announce == Announce::CqData
    }

    /// Registers memory owned by the channel's layer from now on; see
    /// [`Connection::register`].
    pub fn register<B: RegisterMem>(&mut self, buf: B, access: Access) -> Result<MemoryRegion> {
        self.conn.register(buf, access)
    }

    /// Registers caller-owned memory (cached); see
    /// [`Connection::register_raw`].
    ///
    /// # Safety
    /// As for [`Connection::register_raw`].
    pub unsafe fn register_raw(
        &mut self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded contract.
        unsafe { self.conn.register_raw(ptr, len, access) }
    }

    /// Makes `region` (registered on this channel with remote-write access)
    /// the block pool, split into slots of `slot_size` bytes.
    pub fn set_slot_pool(&mut self, region: MemoryRegion, slot_size: usize) -> Result<()> {
        if self.grants_out > 0 {
            return Err(Error::InvalidArgument(
                "slots of the old pool are still granted".into(),
            ));
        }
        if !self.conn.owns(&region) || !region.access().contains(Access::REMOTE_WRITE) {
            return Err(Error::InvalidArgument(
                "pool must be registered on this channel with remote-write access".into(),
            ));
        }
        let count = region.len().checked_div(slot_size).unwrap_or(0);
        if count == 0 || count > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "slot size {slot_size} does not split a pool of {} bytes",
                region.len()
            )));
        }
        self.pool = Some(Pool {
            region,
            slot_size,
            granted: vec![false; count],
        });
        Ok(())
    }

    /// Number of slots in the pool.
    pub fn slot_count(&self) -> u32 {
        self.pool.as_ref().map_or(0, |p| p.granted.len() as u32)
    }

    /// The whole of slot `slot` (its first `len` bytes are those announced
    /// by [`Event::BlockArrived`]).
    pub fn slot(&self, slot: u32) -> Option<&[u8]> {
        let pool = self.pool.as_ref()?;
        let start = slot as usize * pool.slot_size;
        pool.region.as_slice().get(start..start + pool.slot_size)
    }

    /// Grants the peer one write into `slot`. Blocks while the peer's
    /// control window is full.
    pub fn grant(&mut self, slot: u32) -> Result<()> {
        let remote = self.reserve_slot(slot)?;
        let mut body = [0u8; GRANT_BODY];
        body[..8].copy_from_slice(&remote.addr.to_le_bytes());
        body[8..16].copy_from_slice(&remote.key.to_le_bytes());
        body[16..].copy_from_slice(&remote.len.to_le_bytes());
        let sent = self.send_message(Kind::Grant, slot, &body);
        if sent.is_err() {
            self.release_slot(slot);
        }
        sent
    }

    fn reserve_slot(&mut self, slot: u32) -> Result<RemoteSlot> {
        if self.grants_out >= self.cfg.max_grants {
            return Err(Error::InvalidArgument(format!(
                "already {} grants outstanding (max_grants)",
                self.grants_out
            )));
        }
        let pool = self
            .pool
            .as_mut()
            .ok_or_else(|| Error::InvalidArgument("no slot pool set".into()))?;
        match pool.granted.get_mut(slot as usize) {
            Some(g @ false) => *g = true,
            Some(true) => {
                return Err(Error::InvalidArgument(format!(
                    "slot {slot} is already granted"
                )))
            }
            None => return Err(Error::InvalidArgument(format!("no slot {slot}"))),
        }
        self.grants_out += 1;
        pool.region
            .remote_slot(slot as usize * pool.slot_size, pool.slot_size)
    }

    fn release_slot(&mut self, slot: u32) {
        if let Some(g) = self
            .pool
            .as_mut()
            .and_then(|p| p.granted.get_mut(slot as usize))
        {
            *g = false;
            self.grants_out -= 1;
        }
    }

    /// RDMA-writes the gather list into the peer's slot named by `credit`
    /// and announces it; returns once posted. Every slice must lie in
    /// memory registered on this channel with [`Access::WRITE_SOURCE`]; it
    /// must not change until [`Event::WriteComplete`] for this slot.
    pub fn write_block(&mut self, iov: &[IoSlice<'_>], credit: Credit) -> Result<()> {
        let len: u64 = iov.iter().map(|s| s.len() as u64).sum();
        let (imm, flags) = match self.announce {
            Announce::CqData => (Some(self.encode_imm(credit.slot, len)?), 0),
            Announce::OrderedMessage => (None, 0),
            Announce::MessageAfterDelivery => (None, sys::FI_DELIVERY_COMPLETE),
        };
        let deadline = self.deadline();
        self.retry(deadline, |c| {
            c.conn.write_flags(
                iov,
                credit.remote,
                imm,
                Self::write_tag(credit.slot, len),
                flags,
            )
        })?;
        if self.announce == Announce::OrderedMessage {
            self.notifies.push_back((credit.slot, len));
            self.flush_notifies()?;
        }
        Ok(())
    }

    /// The remote CQ data announcing a block. Providers with 8 bytes of CQ
    /// data get the length in the high half, because some (tcp) report no
    /// length for remote writes; with 4 bytes (verbs) it is the slot alone
    /// and the length comes from the completion.
    fn encode_imm(&self, slot: u32, len: u64) -> Result<u64> {
        if self.conn.provider().cq_data_size < 8 {
            return Ok(u64::from(slot));
        }
        let len = u32::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("block of {len} bytes exceeds 4 GiB")))?;
        Ok(u64::from(len) << 32 | u64::from(slot))
    }

    /// Inverse of [`Channel::encode_imm`].
    fn decode_imm(&self, imm: u64, reported_len: usize) -> (u32, u64) {
        if self.conn.provider().cq_data_size < 8 {
            (imm as u32, reported_len as u64)
        } else {
            (imm as u32, imm >> 32)
        }
    }

    /// A write's user value: the slot, and the length for late notifies.
    fn write_tag(slot: u32, len: u64) -> u64 {
        (len << 32) | u64::from(slot)
    }

    /// Ends the channel gracefully, so that neither side tears down the
    /// connection while data is still on its way to the other: providers
    /// may report a send complete while its bytes still sit in a local
    /// buffer (tcp does), and closing an endpoint discards those.
    ///
    /// Both sides must call it. Our writes and their announcements finish
    /// first. Then the dialling side says goodbye and waits for the
    /// accepting side's goodbye, which is sent only once the dialler's was
    /// read — so everything in both directions has been delivered when the
    /// dialler closes. The accepting side then waits for that close.
    /// Events that arrive meanwhile are returned, not dropped.
    pub fn close(mut self, timeout: Option<Duration>) -> Result<Vec<Event>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let start = Instant::now();
        while self.conn.writes_in_flight() > 0 || !self.notifies.is_empty() {
            self.pump_until(deadline, start, "our writes to complete")?;
        }
        if self.conn.is_acceptor() {
            self.await_bye(deadline, start)?;
            self.say_bye()?;
            self.await_peer_close(deadline, start)?;
        } else {
            self.say_bye()?;
            self.await_bye(deadline, start)?;
        }
        Ok(self.events.drain(..).collect())
    }

    fn say_bye(&mut self) -> Result<()> {
        self.send_message(Kind::Bye, 0, &[])?;
        self.bye_sent = true;
        Ok(())
    }

    fn await_bye(&mut self, deadline: Option<Instant>, start: Instant) -> Result<()> {
        while !self.bye_received {
            self.pump_until(deadline, start, "the peer's goodbye")?;
        }
        Ok(())
    }

    /// Keeps the connection progressing (so our goodbye gets out) until
    /// the peer, having read it, closes.
    fn await_peer_close(&mut self, deadline: Option<Instant>, start: Instant) -> Result<()> {
        loop {
            match self.pump_until(deadline, start, "the peer to close") {
                Ok(()) => {}
                Err(Error::Disconnected { .. } | Error::Completion { .. }) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends a control message to the peer; blocks while its window is full.
    pub fn send_control(&mut self, msg: &[u8]) -> Result<()> {
        let limit = self.cfg.ctrl_max_len;
        if msg.len() > limit {
            return Err(Error::InvalidArgument(format!(
                "control message of {} bytes (limit {limit})",
                msg.len()
            )));
        }
        self.send_message(Kind::Control, 0, msg)
    }

    /// RDMA writes of ours not yet complete.
    pub fn writes_in_flight(&self) -> usize {
        self.conn.writes_in_flight()
    }

    /// The next event, without blocking.
    pub fn poll(&mut self) -> Result<Option<Event>> {
        if self.events.is_empty() {
            self.pump(Duration::ZERO)?;
        }
        Ok(self.events.pop_front())
    }

    /// The next event, blocking up to `timeout` (`None`: until one arrives
    /// or the connection breaks). `Ok(None)` when the time ran out.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Option<Event>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(event) = self.events.pop_front() {
                return Ok(Some(event));
            }
            match remaining(deadline) {
                Some(left) if left.is_zero() => return Ok(None),
                left => self.pump(left.unwrap_or(PUMP_SLICE).min(PUMP_SLICE))?,
            }
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.cfg.credit_timeout.map(|t| Instant::now() + t)
    }

    /// Runs `op` until it stops reporting a full queue, making progress in
    /// between (completions reaped meanwhile become events).
    fn retry(
        &mut self,
        deadline: Option<Instant>,
        mut op: impl FnMut(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            match op(self) {
                Err(Error::QueueFull(what)) => self.pump_until(deadline, start, what)?,
                other => return other,
            }
        }
    }

    /// One blocking round of progress, or a timeout error past `deadline`.
    fn pump_until(
        &mut self,
        deadline: Option<Instant>,
        start: Instant,
        what: &'static str,
    ) -> Result<()> {
        match remaining(deadline) {
            Some(left) if left.is_zero() => Err(Error::Timeout {
                waited: start.elapsed(),
                what,
            }),
            left => self.pump(left.unwrap_or(PUMP_SLICE).min(PUMP_SLICE)),
        }
    }

    /// Sends one control message once the peer's window allows it.
    fn send_message(&mut self, kind: Kind, aux: u32, body: &[u8]) -> Result<()> {
        if self.bye_sent {
            return Err(Error::InvalidArgument("the channel is closing".into()));
        }
        let deadline = self.deadline();
        let bytes = self.encode(kind, aux, body);
        self.retry(deadline, |c| {
            if !c.window.allows(kind.cost()) {
                return Err(Error::QueueFull("the peer's control window"));
            }
            if kind == Kind::Control && body.len() > c.window.peer_max_len {
                return Err(Error::InvalidArgument(format!(
                    "control message of {} bytes exceeds the peer's limit of {}",
                    body.len(),
                    c.window.peer_max_len
                )));
            }
            c.post_message(kind, &bytes)
        })
    }

    fn encode(&self, kind: Kind, aux: u32, body: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(HEADER + body.len());
        bytes.push(kind as u8);
        bytes.extend_from_slice(&[0; 3]);
        bytes.extend_from_slice(&aux.to_le_bytes());
        bytes.extend_from_slice(&[0; 8]); // acknowledgement, set when posted
        bytes.extend_from_slice(body);
        bytes
    }

    /// Posts an encoded message now (or reports a full queue), stamping the
    /// current acknowledgement into it.
    fn post_message(&mut self, kind: Kind, bytes: &[u8]) -> Result<()> {
        let mut bytes = bytes.to_vec();
        bytes[8..HEADER].copy_from_slice(&self.window.consumed.to_le_bytes());
        self.conn.send(&bytes, 0)?;
        self.window.acked_to_peer = self.window.consumed;
        if kind.cost() != Cost::Block {
            self.window.sent += 1;
        }
        Ok(())
    }

    /// Waits up to `slice` for completions and turns them into events;
    /// then sends whatever became sendable (notifies, acknowledgements).
    fn pump(&mut self, slice: Duration) -> Result<()> {
        self.flush_notifies()?;
        self.maybe_ack()?;
        let mut batch = std::mem::take(&mut self.scratch);
        let waited = if slice.is_zero() {
            self.conn.poll(&mut batch)
        } else {
            self.conn.wait(Some(slice), &mut batch)
        };
        let absorbed = batch.drain(..).try_for_each(|c| self.absorb(c));
        self.scratch = batch;
        waited?;
        absorbed?;
        self.flush_notifies()?;
        self.maybe_ack()
    }

    fn absorb(&mut self, completion: Completion) -> Result<()> {
        match completion {
            Completion::Received { data, .. } => self.on_message(&data),
            Completion::RemoteWrite { imm, len } => {
                let (slot, len) = self.decode_imm(imm, len);
                self.on_arrival(slot, len)
            }
            Completion::Written { user } => self.on_written(user),
            Completion::Sent { .. } => Ok(()),
            Completion::Failed { error, .. } => Err(match self.conn.closed() {
                Some(detail) => Error::Disconnected {
                    detail: detail.to_owned(),
                },
                None => error,
            }),
        }
    }

    fn on_written(&mut self, user: u64) -> Result<()> {
        let slot = user as u32;
        if self.announce == Announce::MessageAfterDelivery {
            self.notifies.push_back((slot, user >> 32));
        }
        self.events.push_back(Event::WriteComplete { slot });
        Ok(())
    }

    fn on_message(&mut self, data: &[u8]) -> Result<()> {
        if data.len() < HEADER {
            return Err(Error::Protocol(format!(
                "control message of {} bytes",
                data.len()
            )));
        }
        let kind = Kind::from_byte(data[0])
            .ok_or_else(|| Error::Protocol(format!("message kind {}", data[0])))?;
        let aux = u32::from_le_bytes(data[4..8].try_into().expect("4-byte range"));
        let ack = u64::from_le_bytes(data[8..HEADER].try_into().expect("8-byte range"));
        if ack > self.window.sent {
            return Err(Error::Protocol(format!(
                "peer acknowledged {ack} of {} messages",
                self.window.sent
            )));
        }
        self.window.acked_by_peer = self.window.acked_by_peer.max(ack);
        if kind.cost() != Cost::Block {
            self.window.consumed += 1;
        }
        self.dispatch(kind, aux, &data[HEADER..])
    }

    fn dispatch(&mut self, kind: Kind, aux: u32, body: &[u8]) -> Result<()> {
        match kind {
            Kind::Hello => {
                self.window.peer = Some(u64::from(aux));
                self.window.peer_max_len = read_u64(body, 0)? as usize;
            }
            Kind::Ack => {}
            Kind::Bye => self.bye_received = true,
            Kind::Grant => {
                let remote = RemoteSlot {
                    addr: read_u64(body, 0)?,
                    key: read_u64(body, 8)?,
                    len: read_u64(body, 16)?,
                };
                self.events
                    .push_back(Event::Credit(Credit { slot: aux, remote }));
            }
            Kind::Control => self.events.push_back(Event::Control(body.to_vec())),
            Kind::Notify => return self.on_arrival(aux, read_u64(body, 0)?),
        }
        Ok(())
    }

    /// A block landed in our slot: it must be one we granted.
    fn on_arrival(&mut self, slot: u32, len: u64) -> Result<()> {
        let pool = self
            .pool
            .as_mut()
            .ok_or_else(|| Error::Protocol("block arrived without a pool".into()))?;
        match pool.granted.get_mut(slot as usize) {
            Some(g @ true) if len <= pool.slot_size as u64 => *g = false,
            _ => {
                return Err(Error::Protocol(format!(
                    "write of {len} bytes into slot {slot}, which was not granted"
                )))
            }
        }
        self.grants_out -= 1;
        self.events.push_back(Event::BlockArrived {
            slot,
            len: len as usize,
        });
        Ok(())
    }

    /// Sends pending block notifications as far as send buffers allow.
    fn flush_notifies(&mut self) -> Result<()> {
        while let Some(&(slot, len)) = self.notifies.front() {
            let bytes = self.encode(Kind::Notify, slot, &len.to_le_bytes());
            match self.post_message(Kind::Notify, &bytes) {
                Ok(()) => {
                    self.notifies.pop_front();
                }
                Err(Error::QueueFull(_)) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Acknowledges the peer's messages on their own once enough are owed.
    ///
    /// Saying goodbye does not end acknowledging: the dialler says it first and the
    /// acceptor may still be sending (granting slots for its last blocks, say) until it
    /// reads that goodbye; without acknowledgements its window would fill and both sides
    /// would wait for each other. Only once both goodbyes have crossed is nothing owed.
    fn maybe_ack(&mut self) -> Result<()> {
        let threshold = (self.cfg.window() / 2).max(2);
        let closed = self.bye_sent && self.bye_received;
        if closed || self.window.owed() < threshold || !self.window.allows(Cost::Reserved) {
            return Ok(());
        }
        let bytes = self.encode(Kind::Ack, 0, &[]);
        match self.post_message(Kind::Ack, &bytes) {
            Err(Error::QueueFull(_)) => Ok(()),
            other => other,
        }
    }
}

fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

fn read_u64(body: &[u8], at: usize) -> Result<u64> {
    body.get(at..at + 8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8-byte range")))
        .ok_or_else(|| {
            Error::Protocol(format!("message body of {} bytes is too short", body.len()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worst moment of a steady transfer: the receiver is about to send the last
    /// grant of a round trip while all the others are on the wire and the sender still
    /// holds back one short of its acknowledgement threshold. The window must let that
    /// grant out, for every slot count it is sized for (issue 19, item 4).
    #[test]
    fn a_round_trip_of_grants_fits_the_window() {
        for grants in 1..=(MAX_CTRL_CREDITS - 2) / 2 {
            let cfg = ChannelConfig::for_grants(grants);
            let window = cfg.window();
            let threshold = (window / 2).max(2);
            let outstanding = u64::from(grants - 1) + (threshold - 1);
            let state = Window {
                peer: Some(window),
                sent: outstanding,
                ..Window::default()
            };
            assert!(
                state.allows(Cost::Regular),
                "{grants} grants, window {window}"
            );
        }
    }

    /// The old fixed window (8 credits) could not: 16 grants stalled after 7.
    #[test]
    fn the_default_window_holds_back_sixteen_grants() {
        let window = ChannelConfig::default().window();
        let state = Window {
            peer: Some(window),
            sent: 8,
            ..Window::default()
        };
        assert!(!state.allows(Cost::Regular));
    }

    #[test]
    fn an_opening_decodes_as_encoded_and_nothing_else_does() {
        let opening = Opening {
            window: 35,
            max_len: 1024,
            first: b"join".to_vec(),
        };
        assert_eq!(Opening::decode(&opening.encode()), Some(opening.clone()));
        let hello = Opening::hello(&ChannelConfig::for_grants(16));
        assert_eq!(hello.encode().len(), OPENING_HELLO);
        assert_eq!(Opening::decode(&hello.encode()), Some(hello));
        let encoded = opening.encode();
        for cut in 0..OPENING_HELLO {
            assert_eq!(Opening::decode(&encoded[..cut]), None, "cut at {cut}");
        }
        let mut other = encoded;
        other[0] ^= 1;
        assert_eq!(Opening::decode(&other), None);
    }

    /// A listener on loopback over the tcp provider, or `None` where there is none.
    fn tcp_listener() -> Option<(FabricConfig, Listener)> {
        let fabric = FabricConfig::with_provider("tcp");
        match Listener::bind(&fabric, "127.0.0.1:0".parse().expect("literal")) {
            Ok(listener) => Some((fabric, listener)),
            Err(Error::ProviderUnavailable { detail, .. }) => {
                eprintln!("SKIP: libfabric has no usable tcp provider here: {detail}");
                None
            }
            Err(e) => panic!("binding a tcp listener on loopback failed: {e}"),
        }
    }

    /// Opens a channel the way a build that carried nothing in the set-up did.
    fn without_opening(conn: Connection, cfg: &ChannelConfig) -> Channel {
        Channel::open(conn, cfg, None).expect("open")
    }

    /// The point of carrying the opening: once accepted, the acceptor holds the
    /// connector's first message and may send grants at once, and the connector may
    /// send as soon as it is connected; no hello crossed as a message either way.
    #[test]
    fn the_opening_travels_in_the_set_up() {
        let Some((fabric, mut listener)) = tcp_listener() else {
            return;
        };
        let addr = listener.local_addr();
        let cfg = ChannelConfig::for_grants(4);
        let acfg = cfg.clone();
        let acceptor = std::thread::spawn(move || Channel::accept(&mut listener, &acfg));
        let connector = Channel::connect_opening(&fabric, addr, &cfg, b"join").expect("connect");
        let mut accepted = acceptor.join().expect("no panic").expect("accept");
        for (side, ch) in [("acceptor", &accepted), ("connector", &connector)] {
            assert_eq!(ch.window.peer, Some(cfg.window()), "{side}");
            assert_eq!(ch.window.peer_max_len, cfg.ctrl_max_len, "{side}");
            assert_eq!(ch.window.sent, 0, "{side} sent a hello");
            assert!(ch.window.allows(Cost::Regular), "{side}");
        }
        assert_eq!(
            accepted.events.front(),
            Some(&Event::Control(b"join".to_vec()))
        );
        assert_eq!(
            accepted.poll().expect("poll"),
            Some(Event::Control(b"join".to_vec()))
        );
    }

    /// Either side may be a build that carries nothing: the other then sends its hello
    /// and first message as messages, and the first message still arrives once, first.
    #[test]
    fn a_side_that_carries_nothing_still_gets_the_first_message() {
        let Some((fabric, mut listener)) = tcp_listener() else {
            return;
        };
        let addr = listener.local_addr();
        let cfg = ChannelConfig::for_grants(4);
        // An older connector: nothing in its request, its first message sent after.
        let acfg = cfg.clone();
        let acceptor = std::thread::spawn(move || {
            let ch = Channel::accept(&mut listener, &acfg);
            (listener, ch)
        });
        let conn = Connection::connect(&fabric, addr, &cfg.conn_config(), cfg.connect_timeout)
            .expect("connect");
        let mut older = without_opening(conn, &cfg);
        older.send_control(b"join").expect("join");
        older.send_control(b"next").expect("next");
        let (mut listener, accepted) = acceptor.join().expect("no panic");
        let mut accepted = accepted.expect("accept");
        assert_eq!(
            accepted.wait(None).expect("wait"),
            Some(Event::Control(b"join".to_vec()))
        );
        assert_eq!(
            accepted.wait(None).expect("wait"),
            Some(Event::Control(b"next".to_vec()))
        );

        // An older acceptor: it answers with nothing, and takes nothing from the request.
        let acfg = cfg.clone();
        let acceptor = std::thread::spawn(move || {
            let conn = listener
                .accept_within(&acfg.conn_config(), None, acfg.connect_timeout)
                .expect("accept");
            let mut older = without_opening(conn, &acfg);
            let first = older.wait(None).expect("wait");
            let second = older.wait(None).expect("wait");
            (first, second)
        });
        let mut connector =
            Channel::connect_opening(&fabric, addr, &cfg, b"join").expect("connect");
        connector.send_control(b"next").expect("next");
        let (first, second) = acceptor.join().expect("no panic");
        assert_eq!(first, Some(Event::Control(b"join".to_vec())));
        assert_eq!(second, Some(Event::Control(b"next".to_vec())));
    }

    /// Few slots keep the default window; many are capped where the tcp provider's
    /// receive queue still holds the window and the grants' buffers.
    #[test]
    fn credits_are_bounded_both_ways() {
        assert_eq!(ctrl_credits_for_grants(1), 8);
        assert_eq!(ctrl_credits_for_grants(16), 34);
        assert_eq!(ctrl_credits_for_grants(u32::MAX), MAX_CTRL_CREDITS);
        let cfg = ChannelConfig::for_grants(127).conn_config();
        assert!(cfg.rx_count <= 256, "{}", cfg.rx_count);
    }
}
