//! Data channels: the back end that moves blocks, behind one small interface.
//!
//! The session sees a channel as two halves, [`BlockTx`] and [`BlockRx`]; what is under
//! them (a TCP stream today, a libfabric endpoint writing into granted slots next) is the
//! transport's business. The pumps here connect a channel to the pool queues, so that any
//! channel takes the next ready block: a slow stream simply takes fewer blocks, and the
//! number of channels can differ from the number of readers and writers.
//!
//! Two transports live below: [`tcp`] (parallel TCP streams, the default) and [`fabric`]
//! (libfabric endpoints: RDMA writes into slots the receiver granted). Both carry the
//! same self-describing blocks, so everything above them is shared.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use wanxfer_proto::BlockHeader;

use crate::pool::{Block, Cancel, Pool, CANCEL_POLL};
use crate::progress::Progress;
use crate::Error;

pub mod fabric;
pub mod tcp;
pub mod zerocopy;

pub use tcp::TcpChannel;

/// The sending half of a channel.
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

/// The receiving half of a channel.
pub trait BlockRx: Send {
    /// The next block, `Ok(None)` at a clean end of stream.
    fn recv(&mut self, pool: &Pool, cancel: &Cancel) -> Result<Option<Block>, Error>;
}

/// Sends queued blocks until the queue closes.
pub fn pump_out(
    tx: &mut dyn BlockTx,
    queue: &Receiver<Block>,
    cancel: &Cancel,
    progress: &Progress,
) -> Result<(), Error> {
    loop {
        let poll = if tx.holds_blocks() {
            RECLAIM_POLL
        } else {
            CANCEL_POLL
        };
        match queue.recv_timeout(poll) {
            Ok(block) => {
                let len = block.len as u64;
                tx.send(block)?;
                progress.bytes.fetch_add(len, Ordering::Relaxed);
            }
            Err(RecvTimeoutError::Timeout) if cancel.is_cancelled() => {
                return Err(Error::Cancelled)
            }
            Err(RecvTimeoutError::Timeout) => tx.reclaim()?,
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let finished = tx.finish();
    let (sends, copied) = tx.zerocopy_counts();
    progress.zerocopy_sends.fetch_add(sends, Ordering::Relaxed);
    progress
        .zerocopy_copied
        .fetch_add(copied, Ordering::Relaxed);
    if let Some(why) = tx.io_fallback() {
        // The first channel's reason stands for all: they read the same files.
        let _ = progress.io_fallback.set(why.to_string());
    }
    finished
}

/// Receives blocks into pool buffers and queues them for the writers until the sender
/// ends the stream.
pub fn pump_in(
    rx: &mut dyn BlockRx,
    pool: &Pool,
    out: &Sender<Block>,
    cancel: &Cancel,
    progress: &Progress,
) -> Result<(), Error> {
    while let Some(block) = rx.recv(pool, cancel)? {
        progress
            .bytes
            .fetch_add(block.len as u64, Ordering::Relaxed);
        out.send(block).map_err(|_| Error::Cancelled)?;
    }
    Ok(())
}

/// Checks a decoded block header against what this session agreed, before anything
/// beyond the fixed header is read or allocated.
pub(crate) fn check_header(
    header: &BlockHeader,
    session_tag: u64,
    max_payload: usize,
    peer: &str,
) -> Result<(), Error> {
    if header.session_tag != session_tag {
        return Err(Error::protocol(peer, "block from another session"));
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
