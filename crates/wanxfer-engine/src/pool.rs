//! The block pool: the only memory the data path uses.
//!
//! A fixed number of block-sized buffers is allocated when a session starts; readers,
//! channels and writers pass them around and they come home on drop. A stage that finds
//! the pool empty waits, which is how back-pressure travels from a slow disk or a slow
//! network to the other end: memory stays at `count × block_size` whatever the dataset.
//! Waits poll a [`Cancel`] token so that an aborted session never leaves a thread stuck.
//!
//! Free buffers are handed out last in, first out. The buffer returned last is the one
//! whose lines are most likely still in cache, so the next `recv` or `pread` into it
//! writes to cache instead of fetching every line from memory first; a first-in,
//! first-out pool would cycle all `count × block_size` bytes (more than this machine's L3)
//! through the cache. Buffers the session never needs are never touched, so their pages
//! are never even faulted in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use wanxfer_proto::Segment;

use crate::Error;

/// How often a waiting thread looks at its [`Cancel`] token.
pub const CANCEL_POLL: Duration = Duration::from_millis(50);

/// Set once when a session must stop; every blocking wait in the engine checks it. A
/// token may be linked to others (a session's to its server's), and is then cancelled
/// as soon as any of them is.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>, Arc<[Cancel]>);

impl Cancel {
    /// A token cancelled by its own `cancel` or by any of `parents`'.
    pub fn linked(parents: &[&Cancel]) -> Cancel {
        Cancel(
            Arc::default(),
            parents.iter().map(|c| (*c).clone()).collect(),
        )
    }
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst) || self.1.iter().any(Cancel::is_cancelled)
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

/// Zeroed memory aligned to a page. Blocks are written to disk with `O_DIRECT`, which
/// needs buffer addresses aligned to the device's logical block, and RDMA registration
/// pins whole pages; a page boundary serves both.
///
/// An anonymous mapping, not the allocator: the kernel hands it out zeroed and faults its
/// pages in only where they are first touched. `std::alloc::alloc_zeroed` with a page
/// alignment writes every byte itself (it calls `calloc` only up to malloc's own
/// alignment), which faulted in the whole pool when a session started: 80 MiB and some
/// 40-75 ms per side before the first manifest entry of a small pull left the server.
struct PageAligned {
    base: std::ptr::NonNull<u8>,
    len: usize,
}

/// Alignment of every pool buffer and arena.
pub const BUFFER_ALIGN: usize = 4096;

impl PageAligned {
    fn zeroed(len: usize) -> PageAligned {
        let len = len.max(1);
        // SAFETY: a fresh private anonymous mapping, no address hint and no file: it
        // cannot alias anything else this process holds.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let base = if ptr == libc::MAP_FAILED {
            None
        } else {
            std::ptr::NonNull::new(ptr.cast::<u8>())
        };
        let Some(base) = base else {
            // As the allocator would: out of memory (or address space) is not recoverable.
            std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(len, BUFFER_ALIGN)
                    .expect("a block size below isize::MAX with a power-of-two alignment"),
            )
        };
        // Mappings start on a page, and pages are whole multiples of 4 KiB on Linux.
        debug_assert_eq!(base.as_ptr() as usize % BUFFER_ALIGN, 0);
        PageAligned { base, len }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `base` points to `len` bytes we own, mapped readable and zero-filled
        // by the kernel until written.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.len) }
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        // SAFETY: mapped in `zeroed` with this very length; nothing borrows it any more.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

// SAFETY: plain memory owned by this value; access follows Rust's borrowing through
// `bytes`/`bytes_mut`, or the slot discipline of `SlotArena`.
unsafe impl Send for PageAligned {}
// SAFETY: as above.
unsafe impl Sync for PageAligned {}

impl std::fmt::Debug for PageAligned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageAligned({} bytes)", self.len())
    }
}

/// Memory a transport writes whole blocks into (the slots an RDMA receiver registers and
/// grants), carved into equal slots. Blocks that point into it share it, so none can
/// outlive it, whatever happens to the connection that registered it.
pub struct SlotArena {
    memory: PageAligned,
    slot_len: usize,
}

impl SlotArena {
    pub fn new(slots: usize, slot_len: usize) -> Arc<SlotArena> {
        Arc::new(SlotArena {
            memory: PageAligned::zeroed(slots * slot_len),
            slot_len,
        })
    }

    /// The whole arena, for registering it (the transport then writes into granted slots).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.memory.base.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.memory.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    pub fn slots(&self) -> usize {
        self.len() / self.slot_len.max(1)
    }

    /// Where slot `slot` starts; slots are only handed out below `slots()`.
    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        self.as_mut_ptr()
            .wrapping_add(slot as usize * self.slot_len)
    }
}

impl std::fmt::Debug for SlotArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotArena")
            .field("len", &self.len())
            .field("slot_len", &self.slot_len)
            .finish()
    }
}

/// Where a buffer's bytes live.
#[derive(Debug)]
enum Storage {
    Owned(PageAligned),
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
            Storage::Owned(b) => b.bytes(),
            // SAFETY: the slot lies within the arena, which this buffer keeps alive; see
            // the variant's invariant for why no one else writes it meanwhile.
            Storage::Slot { arena, slot } => unsafe {
                std::slice::from_raw_parts(arena.slot_ptr(*slot), arena.slot_len)
            },
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Owned(b) => b.bytes_mut(),
            // SAFETY: as in `bytes`; `&mut self` makes this the only access.
            Storage::Slot { arena, slot } => unsafe {
                std::slice::from_raw_parts_mut(arena.slot_ptr(*slot), arena.slot_len)
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
    /// Receiver side, per segment: its bytes failed their check, so its file must not be
    /// written. Empty when nothing failed.
    pub damaged: Vec<bool>,
    /// Receiver side: the checks its bytes passed through (`digest::check_flags`).
    pub checks: u8,
    /// Sender side, zero-copy: the payload is `len` bytes of a file, to be sent from the
    /// page cache.
    pub file_range: Option<FileRange>,
    /// The buffer's bytes were overwritten where they lay after they were sent (sealed
    /// in place into TLS records): a source that counts on what a fresh buffer holds
    /// (the synthetic source, zeros) fills it again. Kept when the buffer goes home.
    pub scribbled: bool,
}

/// Where a block's payload lies in a file, for sending it from the page cache.
#[derive(Debug, Clone)]
pub struct FileRange {
    pub file: std::sync::Arc<std::fs::File>,
    pub offset: u64,
    /// Whether the buffer also holds the payload (read to be checksummed), so that a
    /// file system refusing `sendfile` costs no second read.
    pub in_buffer: bool,
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
    /// The segment table and the buffer from the payload's start, to fill and check the
    /// payload piece by piece against the table.
    pub fn segments_and_space(&mut self) -> (&[Segment], &mut [u8]) {
        let start = self.start;
        (&self.segments, &mut self.data.bytes_mut()[start..])
    }
    /// Whether segment `index` failed its check.
    pub fn is_damaged(&self, index: usize) -> bool {
        self.damaged.get(index).copied().unwrap_or(false)
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

type FreeBuffers = Vec<Box<BlockBuf>>;

/// The pool's free buffers, most recently returned last. Boxed, as on loan: a buffer
/// moves between the list, the queues and the stages as one pointer.
#[derive(Debug, Default)]
struct FreeList {
    buffers: Mutex<FreeBuffers>,
    returned: Condvar,
}

impl FreeList {
    /// The list, also after a thread panicked holding it: a `Vec` push or pop cannot leave
    /// it half-changed.
    fn lock(&self) -> MutexGuard<'_, FreeBuffers> {
        self.buffers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, buf: Box<BlockBuf>) {
        self.lock().push(buf);
        self.returned.notify_one();
    }
}

/// A buffer on loan from the pool; it goes back when dropped.
#[derive(Debug)]
pub struct Block {
    buf: Option<Box<BlockBuf>>,
    home: Arc<FreeList>,
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
            buf.damaged.clear();
            buf.checks = 0;
            buf.file_range = None;
            self.home.put(buf);
        }
    }
}

#[derive(Debug, Clone)]
pub struct Pool {
    free: Arc<FreeList>,
    block_size: usize,
    /// Buffers in all, on loan or free.
    capacity: usize,
}

/// A watcher's view of a pool's occupancy that does not keep the pool's memory alive:
/// the buffers go when the session's last `Pool` and `Block` do, whoever still watches.
#[derive(Debug, Clone)]
pub struct PoolGauge {
    free: std::sync::Weak<FreeList>,
    capacity: usize,
}

impl PoolGauge {
    /// Buffers on loan and in all, or `None` once the pool is gone. Takes the pool's lock
    /// for a moment: for a scrape now and then, not for the data path.
    pub fn occupancy(&self) -> Option<(usize, usize)> {
        let free = self.free.upgrade()?;
        let idle = free.lock().len();
        Some((self.capacity.saturating_sub(idle), self.capacity))
    }
}

impl Pool {
    /// Allocates `count` zeroed, page-aligned buffers of `block_size` bytes. Zeroed
    /// matters: the synthetic source sends the pool's untouched bytes.
    pub fn new(count: usize, block_size: usize) -> Pool {
        Pool::with_storage(
            block_size,
            (0..count).map(|_| Storage::Owned(PageAligned::zeroed(block_size))),
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
        let free = Arc::new(FreeList::default());
        let capacity = storage.len();
        for data in storage {
            free.put(Box::new(BlockBuf {
                data,
                start: 0,
                len: 0,
                header: Vec::with_capacity(wanxfer_proto::BlockHeader::encoded_len(64)),
                segments: Vec::new(),
                damaged: Vec::new(),
                checks: 0,
                file_range: None,
                scribbled: false,
            }));
        }
        Pool {
            free,
            block_size,
            capacity,
        }
    }

    /// A view of how many buffers are on loan, for metrics.
    pub fn gauge(&self) -> PoolGauge {
        PoolGauge {
            free: Arc::downgrade(&self.free),
            capacity: self.capacity,
        }
    }

    fn lend(&self, buf: Box<BlockBuf>) -> Block {
        Block {
            buf: Some(buf),
            home: self.free.clone(),
        }
    }

    /// A free buffer if there is one now.
    pub fn try_take(&self) -> Option<Block> {
        let buf = self.free.lock().pop();
        buf.map(|buf| self.lend(buf))
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Waits for a free buffer: the one returned last.
    pub fn take(&self, cancel: &Cancel) -> Result<Block, Error> {
        let mut free = self.free.lock();
        loop {
            if let Some(buf) = free.pop() {
                drop(free);
                return Ok(self.lend(buf));
            }
            if cancel.is_cancelled() {
                return Err(Error::Cancelled);
            }
            free = self
                .free
                .returned
                .wait_timeout(free, CANCEL_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
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
        assert_eq!(c.payload().as_ptr() as usize % BUFFER_ALIGN, 0);
        assert!(c.storage().iter().all(|&b| b == 0));
        drop((b, c));
    }

    /// Pages of `bytes` resident in memory, by `mincore`.
    fn resident_pages(bytes: &[u8]) -> usize {
        let pages = bytes.len().div_ceil(BUFFER_ALIGN);
        let mut resident = vec![0u8; pages];
        // SAFETY: `bytes` starts on a page (checked by the caller) and spans `pages`
        // pages of one mapping; `resident` holds a byte per page.
        let rc = unsafe {
            libc::mincore(
                bytes.as_ptr() as *mut libc::c_void,
                bytes.len(),
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        resident.iter().filter(|&&page| page & 1 != 0).count()
    }

    /// Issue 19 item 5: a pool's buffers take no memory until they are used. Zeroing
    /// them at allocation faulted in every page of the pool (80 MiB per side for a
    /// default session) and kept a small pull's first manifest entry waiting for it.
    #[test]
    fn a_new_pool_faults_in_only_the_pages_it_touches() {
        const BLOCK: usize = 4 << 20;
        let pool = Pool::new(4, BLOCK);
        let cancel = Cancel::default();
        let mut block = pool.take(&cancel).unwrap();
        assert_eq!(block.storage().as_ptr() as usize % BUFFER_ALIGN, 0);
        assert_eq!(
            resident_pages(block.storage()),
            0,
            "untouched pages are not in memory"
        );
        block.space()[0] = 1;
        block.space()[BLOCK - 1] = 1;
        // At least those two pages (a kernel with transparent huge pages may fault in
        // 2 MiB around each).
        assert!(resident_pages(block.storage()) >= 2);
        let other = pool.take(&cancel).unwrap();
        assert_eq!(resident_pages(other.storage()), 0);
        assert!(other.storage().iter().step_by(4096).all(|&b| b == 0));
    }

    #[test]
    fn the_buffer_returned_last_is_lent_first() {
        let pool = Pool::new(3, 16);
        let cancel = Cancel::default();
        let a = pool.take(&cancel).unwrap();
        let b = pool.take(&cancel).unwrap();
        let (a_at, b_at) = (a.storage().as_ptr(), b.storage().as_ptr());
        drop(a);
        drop(b);
        assert_eq!(pool.take(&cancel).unwrap().storage().as_ptr(), b_at);
        let again = pool.try_take().unwrap();
        assert_eq!(again.storage().as_ptr(), b_at);
        let next = pool.try_take().unwrap();
        assert_eq!(next.storage().as_ptr(), a_at);
    }

    #[test]
    fn a_waiting_take_gets_a_buffer_returned_by_another_thread() {
        let pool = Pool::new(1, 16);
        let cancel = Cancel::default();
        let held = pool.take(&cancel).unwrap();
        let waiter = {
            let (pool, cancel) = (pool.clone(), cancel.clone());
            std::thread::spawn(move || pool.take(&cancel).map(|b| b.capacity()))
        };
        drop(held);
        assert_eq!(waiter.join().unwrap().unwrap(), 16);
    }

    #[test]
    fn an_empty_pool_waits_until_cancelled() {
        let pool = Pool::new(1, 16);
        let cancel = Cancel::default();
        let _held = pool.take(&cancel).unwrap();
        cancel.cancel();
        assert!(matches!(pool.take(&cancel), Err(Error::Cancelled)));
    }

    #[test]
    fn a_gauge_counts_loans_and_does_not_keep_the_pool() {
        let pool = Pool::new(3, 16);
        let gauge = pool.gauge();
        let cancel = Cancel::default();
        assert_eq!(gauge.occupancy(), Some((0, 3)));
        let held = pool.take(&cancel).unwrap();
        assert_eq!(gauge.occupancy(), Some((1, 3)));
        drop((held, pool));
        assert_eq!(gauge.occupancy(), None);
    }
}
