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

/// A block's storage: payload bytes plus the encoded header and the decoded segments,
/// kept with the buffer so that no stage allocates per block.
#[derive(Debug)]
pub struct BlockBuf {
    data: Box<[u8]>,
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
        &self.data[..self.len]
    }
    pub fn capacity(&self) -> usize {
        self.data.len()
    }
    /// The whole buffer, for registering it with an RDMA transport.
    pub fn storage(&self) -> &[u8] {
        &self.data
    }
    /// The whole buffer, for filling; set `len` afterwards.
    pub fn space(&mut self) -> &mut [u8] {
        &mut self.data
    }
    /// Payload bytes of one segment, by its position in the payload.
    pub fn slice(&self, start: usize, len: usize) -> &[u8] {
        &self.data[start..start + len]
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
        let (home, free) = crossbeam_channel::bounded(count);
        for _ in 0..count {
            let buf = Box::new(BlockBuf {
                data: vec![0u8; block_size].into_boxed_slice(),
                len: 0,
                header: Vec::with_capacity(wanxfer_proto::BlockHeader::encoded_len(64)),
                segments: Vec::new(),
                damaged: false,
                file_range: None,
            });
            // The channel holds exactly `count` buffers.
            home.send(buf).expect("pool channel has room");
        }
        Pool {
            free,
            home,
            block_size,
        }
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
