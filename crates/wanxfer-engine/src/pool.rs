//! The block pool: the only memory the data path uses.
//!
//! A fixed number of block-sized buffers is allocated when a session starts; readers,
//! channels and writers pass them around and they come home on drop. A stage that finds
//! the pool empty waits, which is how back-pressure travels from a slow disk or a slow
//! network to the other end: memory stays at `count × block_size` whatever the dataset.
//! Waits poll a [`Cancel`] token so that an aborted session never leaves a thread stuck.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use wanxfer_proto::Segment;

use crate::Error;

/// How often a waiting thread looks at its [`Cancel`] token.
pub const CANCEL_POLL: Duration = Duration::from_millis(50);

/// Set once when a session must stop; every blocking wait in the engine checks it.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Receives from `rx`, giving up when `cancel` is set. `Ok(None)` means the senders are
/// gone and the queue is drained.
pub fn recv_or_cancel<T>(rx: &Receiver<T>, cancel: &Cancel) -> Result<Option<T>, Error> {
    loop {
        match rx.recv_timeout(CANCEL_POLL) {
            Ok(v) => return Ok(Some(v)),
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
            Err(RecvTimeoutError::Timeout) if cancel.is_cancelled() => {
                return Err(Error::Cancelled)
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// Memory a transport writes whole blocks into (the slots an RDMA receiver registers and
/// grants), carved into equal slots. Blocks that point into it share it, so none can
/// outlive it, whatever happens to the connection that registered it.
pub struct SlotArena {
    base: std::ptr::NonNull<u8>,
    len: usize,
    slot_len: usize,
}

// SAFETY: the arena is plain memory; which slot a thread may touch is decided by who holds
// the one `BlockBuf` for it (see `Storage::Slot`).
unsafe impl Send for SlotArena {}
// SAFETY: as above; shared references never touch a slot another `BlockBuf` owns.
unsafe impl Sync for SlotArena {}

impl SlotArena {
    pub fn new(slots: usize, slot_len: usize) -> Arc<SlotArena> {
        let memory: Box<[u8]> = vec![0u8; slots * slot_len].into_boxed_slice();
        let len = memory.len();
        let base = std::ptr::NonNull::new(Box::into_raw(memory).cast::<u8>())
            .expect("a boxed slice is never null");
        Arc::new(SlotArena {
            base,
            len,
            slot_len,
        })
    }

    /// The whole arena, for registering it (the transport then writes into granted slots).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    pub fn slots(&self) -> usize {
        self.len / self.slot_len.max(1)
    }
}

impl Drop for SlotArena {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.base.as_ptr(), self.len);
        // SAFETY: `base`/`len` came from `Box::into_raw` of a boxed slice of this length.
        drop(unsafe { Box::from_raw(slice) });
    }
}

impl std::fmt::Debug for SlotArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotArena")
            .field("len", &self.len)
            .field("slot_len", &self.slot_len)
            .finish()
    }
}

/// Where a buffer's bytes live.
#[derive(Debug)]
enum Storage {
    Owned(Box<[u8]>),
    /// One slot of an arena. Exactly one `BlockBuf` exists per slot, and the transport
    /// writes into a slot only while it is granted, which is while its `BlockBuf` sits in
    /// the receiver's hands, untouched, between grant and arrival.
    Slot {
        arena: Arc<SlotArena>,
        slot: u32,
    },
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Owned(b) => b,
            // SAFETY: the slot lies within the arena, which this buffer keeps alive; see
            // the variant's invariant for why no one else writes it meanwhile.
            Storage::Slot { arena, slot } => unsafe {
                std::slice::from_raw_parts(
                    arena.base.as_ptr().add(*slot as usize * arena.slot_len),
                    arena.slot_len,
                )
            },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Owned(b) => b,
            // SAFETY: as in `bytes`; `&mut self` makes this the only access.
            Storage::Slot { arena, slot } => unsafe {
                std::slice::from_raw_parts_mut(
                    arena.base.as_ptr().add(*slot as usize * arena.slot_len),
                    arena.slot_len,
                )
            },
        }
    }
}

/// A block's storage: payload bytes plus the encoded header and the decoded segments,
/// kept with the buffer so that no stage allocates per block.
#[derive(Debug)]
pub struct BlockBuf {
    data: Storage,
    /// Where the payload starts in the storage (after the header for a block received in
    /// place into an RDMA slot; 0 otherwise).
    pub start: usize,
    /// Payload bytes in use.
    pub len: usize,
    /// The encoded header and segment table (sender side).
    pub header: Vec<u8>,
    pub segments: Vec<Segment>,
    /// Receiver side: the payload failed its checksum; its files must not be written.
    pub damaged: bool,
    /// Sender side, zero-copy: the payload is `len` bytes of this file at this offset, to
    /// be sent from the page cache; the buffer may hold a copy read only for checksums.
    pub file_range: Option<(std::sync::Arc<std::fs::File>, u64)>,
}

impl BlockBuf {
    pub fn payload(&self) -> &[u8] {
        &self.data.bytes()[self.start..self.start + self.len]
    }
    pub fn capacity(&self) -> usize {
        self.data.bytes().len() - self.start
    }
    /// The whole buffer, for registering it with an RDMA transport or reading a block
    /// that landed in it.
    pub fn storage(&self) -> &[u8] {
        self.data.bytes()
    }
    /// The buffer from the payload's start, for filling; set `len` afterwards.
    pub fn space(&mut self) -> &mut [u8] {
        let start = self.start;
        &mut self.data.bytes_mut()[start..]
    }
    /// Bytes of one segment, by its position from the payload's start (also while the
    /// payload is being assembled, before `len` is set).
    pub fn slice(&self, start: usize, len: usize) -> &[u8] {
        let at = self.start + start;
        &self.data.bytes()[at..at + len]
    }
    /// The arena slot this buffer is, if it is one.
    pub fn slot(&self) -> Option<u32> {
        match &self.data {
            Storage::Slot { slot, .. } => Some(*slot),
            Storage::Owned(_) => None,
        }
    }
}

/// A buffer on loan from the pool; it goes back when dropped.
#[derive(Debug)]
pub struct Block {
    buf: Option<Box<BlockBuf>>,
    home: Sender<Box<BlockBuf>>,
}

impl std::ops::Deref for Block {
    type Target = BlockBuf;
    fn deref(&self) -> &BlockBuf {
        // `buf` is only taken in `drop`.
        self.buf.as_ref().expect("block buffer present until drop")
    }
}

impl std::ops::DerefMut for Block {
    fn deref_mut(&mut self) -> &mut BlockBuf {
        self.buf.as_mut().expect("block buffer present until drop")
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Some(mut buf) = self.buf.take() {
            buf.len = 0;
            buf.start = 0;
            buf.segments.clear();
            buf.damaged = false;
            buf.file_range = None;
            // The pool outlives every loan unless the session is being torn down, in
            // which case the buffer is simply freed.
            let _ = self.home.send(buf);
        }
    }
}

#[derive(Debug, Clone)]
pub struct Pool {
    free: Receiver<Box<BlockBuf>>,
    home: Sender<Box<BlockBuf>>,
    block_size: usize,
}

impl Pool {
    /// Allocates `count` zeroed buffers of `block_size` bytes. Zeroed matters: the
    /// synthetic source sends the pool's untouched bytes.
    pub fn new(count: usize, block_size: usize) -> Pool {
        Pool::with_storage(
            block_size,
            (0..count).map(|_| Storage::Owned(vec![0u8; block_size].into_boxed_slice())),
        )
    }

    /// A pool whose buffers are the slots of `arena` (an RDMA receiver's granted memory).
    pub fn of_slots(arena: &Arc<SlotArena>) -> Pool {
        let slots = (0..arena.slots() as u32).map(|slot| Storage::Slot {
            arena: arena.clone(),
            slot,
        });
        Pool::with_storage(arena.slot_len(), slots)
    }

    fn with_storage(block_size: usize, storage: impl ExactSizeIterator<Item = Storage>) -> Pool {
        let (home, free) = crossbeam_channel::bounded(storage.len());
        for data in storage {
            let buf = Box::new(BlockBuf {
                data,
                start: 0,
                len: 0,
                header: Vec::with_capacity(wanxfer_proto::BlockHeader::encoded_len(64)),
                segments: Vec::new(),
                damaged: false,
                file_range: None,
            });
            // The channel holds exactly as many buffers as were made.
            home.send(buf).expect("pool channel has room");
        }
        Pool {
            free,
            home,
            block_size,
        }
    }

    /// A free buffer if there is one now.
    pub fn try_take(&self) -> Option<Block> {
        self.free.try_recv().ok().map(|buf| Block {
            buf: Some(buf),
            home: self.home.clone(),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Waits for a free buffer.
    pub fn take(&self, cancel: &Cancel) -> Result<Block, Error> {
        let buf = recv_or_cancel(&self.free, cancel)?
            // We hold a sender ourselves, so the channel cannot disconnect.
            .expect("pool holds its own sender");
        Ok(Block {
            buf: Some(buf),
            home: self.home.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_home_on_drop() {
        let pool = Pool::new(2, 16);
        let cancel = Cancel::default();
        let a = pool.take(&cancel).unwrap();
        let b = pool.take(&cancel).unwrap();
        drop(a);
        let c = pool.take(&cancel).unwrap();
        assert_eq!(c.capacity(), 16);
        drop((b, c));
    }

    #[test]
    fn an_empty_pool_waits_until_cancelled() {
        let pool = Pool::new(1, 16);
        let cancel = Cancel::default();
        let _held = pool.take(&cancel).unwrap();
        cancel.cancel();
        assert!(matches!(pool.take(&cancel), Err(Error::Cancelled)));
    }
}
