//! Data channels: the back end that moves blocks, behind one small interface.
//!
//! A [`Transport`] turns a joined data connection into a [`Link`], and a link runs one
//! pump: sending blocks from the session's queue, or receiving blocks and handing them to
//! the writers. What is under a link (a TCP stream, or a libfabric endpoint writing into
//! slots the receiver granted) is the transport's business, and so are its receive memory
//! ([`Transport::receive_pool`]: one pool shared by TCP links, per-link slot arenas for
//! fabric, which then needs no pool), its I/O policy and its statistics. The session
//! driver sees only links and what their pumps report ([`LinkEvent`]): which segments a
//! sent block held, that a whole block arrived, and how a pump ended. That is all the
//! session needs to send again what a dead channel did not deliver, and it is the same
//! for every transport.
//!
//! Any link takes the next ready block, so a slow channel simply takes fewer, and the
//! number of channels can change during a session.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use wanxfer_proto::{BlockHeader, ChannelJoin, TransportKind};
use wanxfer_session::SegRef;

use crate::pool::{Block, Cancel, Pool, CANCEL_POLL};
use crate::progress::Progress;
use crate::Error;

pub mod fabric;
pub mod pace;
pub mod tcp;
pub mod tcp_info;
pub mod zerocopy;

pub use tcp::{TcpChannel, TcpTransport};

/// What a link's pump tells the session.
#[derive(Debug)]
pub enum LinkEvent {
    /// Link `index` took a block of `payload` bytes from the queue; `Sent` or `Unsent`
    /// follows.
    Taken { index: u16, payload: u64 },
    /// A block went out whole on link `index`.
    Sent { index: u16, segments: Vec<SegRef> },
    /// A block could not go out on link `index` (it failed first).
    Unsent { index: u16, segments: Vec<SegRef> },
    /// A whole block arrived on link `index` and went to the writers.
    Received { index: u16 },
    /// The pump of link `index` ended: cleanly, or with why. Nothing more comes from it.
    Ended {
        index: u16,
        result: Result<(), Error>,
    },
}

/// Where a pump reports; the session's event queue (bounded: a pump waits when the
/// session falls behind).
pub type Reporter = Arc<dyn Fn(LinkEvent) + Send + Sync>;

/// What every pump needs besides its link.
#[derive(Clone)]
pub struct PumpCtx {
    pub index: u16,
    pub report: Reporter,
    /// Set when the session ends, or when this link alone must stop.
    pub cancel: Cancel,
    /// Set when the session no longer wants this link (the tuner retired it): a sending
    /// pump ends its stream cleanly after the block in hand, so nothing is cut off.
    pub retire: Cancel,
    /// Set while the session wants this link to take no block (a sending link slower
    /// than the others near the end: `wanxfer_session::tail::held_back`); it goes on
    /// sending what it holds.
    pub held_back: Arc<AtomicBool>,
    /// A session-wide rate a pump keeps to by itself where the transport does not pace
    /// (receiving pumps, which pace the sender through the window they open).
    pub pacer: Option<Arc<pace::Pacer>>,
    pub progress: Arc<Progress>,
    pub peer: String,
}

/// Bytes a sending link's socket may keep queued and not yet sent: `blocks` blocks, at
/// least 1 MiB. A TCP link keeps two ([`TCP_UNSENT_BLOCKS`]), so that its writer, woken
/// when half have left, always finds the kernel a block ahead.
///
/// Why a limit: unbounded, the kernel grows a socket's send buffer with its window, and
/// each of (f)'s sockets (`bench/tuning.py`, 2 Gbit/s at 50 ms) held 40-65 MB it had not
/// sent, beside what was in flight (`ss -tin` through `wanxfer-emu`). Blocks written
/// there belong to that socket: a stream the tuner retires must still send them all, at
/// its share of the path, before it is gone (1-2 s, while the tuner measured the count
/// it had left), and a stream slowed by loss keeps blocks that a faster one could send.
/// Held back, they wait in the session's queue, where whichever channel has room takes
/// the next. Fabric channels over the tcp provider get a bound of one block on the
/// provider's socket (`fabric::bound_unsent`: their posted write is the other).
fn unsent_limit(block_size: usize, blocks: usize) -> u32 {
    u32::try_from(block_size.saturating_mul(blocks))
        .unwrap_or(u32::MAX)
        .max(1 << 20)
}

/// Blocks a TCP link's socket may keep unsent (see [`unsent_limit`]).
const TCP_UNSENT_BLOCKS: usize = 2;

/// One way of moving blocks: sets links up from joined data connections.
pub trait Transport: Send + Sync {
    fn kind(&self) -> TransportKind;

    fn name(&self) -> &'static str {
        match self.kind() {
            TransportKind::Fabric => "fabric",
            _ => "tcp",
        }
    }

    /// The pool receiving links of this transport share, if they share one (sized for the
    /// session's agreed numbers); `None` where each link brings its own receive memory.
    fn receive_pool(&self, buffers: usize, block_size: usize) -> Option<Pool>;

    /// Client: starts what a link needs besides its data connection, once that
    /// connection's `join` has left, so that it overlaps the wait for the join's answer;
    /// the [`Transport::connect`] with that join takes it up. Nothing by default.
    fn begin_link(&self, _join: &ChannelJoin) {}

    /// Client: link `index` will not be connected (its data connection failed after its
    /// join left): what [`Transport::begin_link`] started for it goes. Nothing by default.
    fn forget_link(&self, _index: u16) {}

    /// Client: the round trips a link waits after its data connection's join has left
    /// before its first block may (`setup_round_trips` in `--json` counts them). None by
    /// default: a TCP link's blocks follow its join.
    fn link_round_trips(&self) -> u32 {
        0
    }

    /// Client: a link over a joined data connection.
    fn connect(&self, joined: Joined) -> Result<Box<dyn Link>, Error>;

    /// Server: a link over a joined data connection.
    fn accept(&self, joined: Joined) -> Result<Box<dyn Link>, Error>;

    /// What libfabric discovery chose, once a link is up (fabric only).
    fn fabric_names(&self) -> Option<fabric::FabricNames> {
        None
    }

    /// Payload bytes one link may have in flight, where the transport fixes it (fabric:
    /// the slots the receiver grants, each a block); `None` where the kernel's window
    /// decides (TCP).
    fn link_window(&self) -> Option<u64> {
        None
    }
}

/// A data connection that joined a session, with the join it presented (whose proof is
/// bound to that connection).
#[derive(Debug)]
pub struct Joined {
    pub stream: crate::stream::Stream,
    pub join: ChannelJoin,
}

/// One data channel, ready to pump in one direction.
pub trait Link: Send {
    fn index(&self) -> u16;

    /// Tears the link down from another thread: its pump wakes and ends.
    fn closer(&self) -> Closer;

    /// Memory registrations the link holds with an RDMA provider, to check they are all
    /// gone when it ends (fabric only).
    fn registrations(&self) -> Option<wanxfer_fabric::RegistrationCount> {
        None
    }

    /// Sends blocks from `queue` until it closes, then ends the stream cleanly.
    fn send(self: Box<Self>, queue: Receiver<Block>, ctx: &PumpCtx) -> Result<(), Error>;

    /// Receives blocks into the transport's receive memory (`pool`, if it has a shared
    /// one) and hands them to `out` until the sender ends the stream.
    fn receive(
        self: Box<Self>,
        pool: Option<Pool>,
        out: Sender<Block>,
        ctx: &PumpCtx,
    ) -> Result<(), Error>;
}

/// Wakes a link's pump from outside by shutting its connection down (the pump's own
/// [`PumpCtx::cancel`] token does the rest).
#[derive(Debug, Clone)]
pub struct Closer(Option<Arc<TcpStream>>);

impl Closer {
    /// Holds only the socket: the stream itself stays with its one user (a sending link
    /// may hand its records to the kernel, which needs it unshared).
    pub fn new(stream: &TcpStream) -> Closer {
        Closer(stream.try_clone().ok().map(Arc::new))
    }

    /// The socket, to read `TCP_INFO` of and set options on (TCP links only).
    pub fn socket(&self) -> Option<&TcpStream> {
        self.0.as_deref()
    }

    pub fn close(&self) {
        if let Some(stream) = &self.0 {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// The segments a block holds, as the session's ledger remembers them.
pub fn seg_refs(block: &Block) -> Vec<SegRef> {
    block
        .segments
        .iter()
        .map(|s| SegRef {
            id: s.file_id,
            offset: s.offset,
            len: s.len,
        })
        .collect()
}

/// The sending half of a byte-stream channel.
pub trait BlockTx: Send {
    /// Sends `block`; the channel may keep it (its buffer) until the kernel is done with it.
    fn send(&mut self, block: Block) -> Result<(), Error>;
    /// No more blocks: the receiver sees a clean end of stream.
    fn finish(&mut self) -> Result<(), Error>;
    /// Whether the channel keeps sent blocks that [`BlockTx::reclaim`] may give back.
    fn holds_blocks(&self) -> bool {
        false
    }
    /// Returns to the pool the blocks the kernel has released (zero-copy sends).
    fn reclaim(&mut self) -> Result<(), Error> {
        Ok(())
    }
    /// Zero-copy sends made and how many of them the kernel copied after all.
    fn zerocopy_counts(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Why the channel sent some blocks differently from what `--io` asked, if it did.
    fn io_fallback(&self) -> Option<&str> {
        None
    }
}

/// How often a channel holding zero-copy blocks looks for their release while no new
/// block is queued: the pool may be empty until it does.
const RECLAIM_POLL: Duration = Duration::from_millis(1);

/// The receiving half of a byte-stream channel.
pub trait BlockRx: Send {
    /// The next block, `Ok(None)` at a clean end of stream.
    fn recv(&mut self, pool: &Pool, cancel: &Cancel) -> Result<Option<Block>, Error>;
}

/// The next queued block, waiting at most `wait`. The time a channel waits for a block
/// is counted (`channel_wait_us`): it tells the tuner the readers, not the network, are
/// what limits the session. A link held back waits out `wait` and takes none (nor is its
/// wait counted: the blocks are there, kept for faster links).
pub(crate) fn next_block(
    queue: &Receiver<Block>,
    wait: Duration,
    ctx: &PumpCtx,
) -> Result<Block, RecvTimeoutError> {
    if ctx.held_back.load(Ordering::Relaxed) {
        std::thread::sleep(wait);
        return Err(RecvTimeoutError::Timeout);
    }
    let asked = std::time::Instant::now();
    let next = queue.recv_timeout(wait);
    ctx.progress
        .channel_wait_us
        .fetch_add(asked.elapsed().as_micros() as u64, Ordering::Relaxed);
    if let Ok(block) = &next {
        let payload = block.segments.iter().map(|s| u64::from(s.len)).sum();
        (ctx.report)(LinkEvent::Taken {
            index: ctx.index,
            payload,
        });
    }
    next
}

/// Sends queued blocks until the queue closes, reporting each.
pub fn pump_out(tx: &mut dyn BlockTx, queue: &Receiver<Block>, ctx: &PumpCtx) -> Result<(), Error> {
    let result = (|| loop {
        if ctx.retire.is_cancelled() {
            return tx.finish();
        }
        let poll = if tx.holds_blocks() {
            RECLAIM_POLL
        } else {
            CANCEL_POLL
        };
        match next_block(queue, poll, ctx) {
            Ok(block) => {
                if let Some(pacer) = &ctx.pacer {
                    pacer.take(block.len as u64, &ctx.cancel);
                }
                let segments = seg_refs(&block);
                let len = block.len as u64;
                if let Err(e) = tx.send(block) {
                    (ctx.report)(LinkEvent::Unsent {
                        index: ctx.index,
                        segments,
                    });
                    return Err(e);
                }
                ctx.progress.moved(ctx.index, len);
                (ctx.report)(LinkEvent::Sent {
                    index: ctx.index,
                    segments,
                });
            }
            Err(RecvTimeoutError::Timeout) if ctx.cancel.is_cancelled() => {
                return Err(Error::Cancelled)
            }
            Err(RecvTimeoutError::Timeout) => tx.reclaim()?,
            Err(RecvTimeoutError::Disconnected) => return tx.finish(),
        }
    })();
    let (sends, copied) = tx.zerocopy_counts();
    ctx.progress
        .zerocopy_sends
        .fetch_add(sends, Ordering::Relaxed);
    ctx.progress
        .zerocopy_copied
        .fetch_add(copied, Ordering::Relaxed);
    if let Some(why) = tx.io_fallback() {
        // The first channel's reason stands for all: they read the same files.
        let _ = ctx.progress.io_fallback.set(why.to_string());
    }
    result
}

/// Receives blocks into pool buffers and queues them for the writers until the sender
/// ends the stream, reporting each.
pub fn pump_in(
    rx: &mut dyn BlockRx,
    pool: &Pool,
    out: &Sender<Block>,
    ctx: &PumpCtx,
) -> Result<(), Error> {
    while let Some(block) = rx.recv(pool, &ctx.cancel)? {
        if let Some(pacer) = &ctx.pacer {
            // Reading no faster than the rate closes the window the sender sees.
            pacer.take(block.len as u64, &ctx.cancel);
        }
        ctx.progress.moved(ctx.index, block.len as u64);
        out.send(block).map_err(|_| Error::Cancelled)?;
        (ctx.report)(LinkEvent::Received { index: ctx.index });
    }
    Ok(())
}

/// Checks a decoded block header against what this session agreed, before anything
/// beyond the fixed header is read or allocated.
pub(crate) fn check_header(
    header: &BlockHeader,
    session_tag: u64,
    max_payload: usize,
    mac_required: bool,
    peer: &str,
) -> Result<(), Error> {
    if header.session_tag != session_tag {
        return Err(Error::protocol(peer, "block from another session"));
    }
    if mac_required && !header.has_mac() {
        return Err(Error::protocol(
            peer,
            "a block without its MAC in a session without encryption (stripped on the path?)",
        ));
    }
    if header.payload_len as usize > max_payload {
        return Err(Error::protocol(
            peer,
            format!(
                "block of {} bytes exceeds the negotiated block size {max_payload}",
                header.payload_len
            ),
        ));
    }
    Ok(())
}
