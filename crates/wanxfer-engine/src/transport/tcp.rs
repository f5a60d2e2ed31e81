//! Blocks over parallel TCP streams.
//!
//! A block on the wire is exactly its header, segment table and payload, sent with one
//! vectored write (or the header then `sendfile` from the page cache). Flow control is
//! TCP's own window: the receiver stops reading when its pool is empty, the kernel closes
//! the window, and the sender's write blocks — an explicit credit round trip would only
//! add latency on a long path. Credits exist for transports without that property
//! (RDMA, see [`super::fabric`]).
//!
//! Under TLS sealed in user space every byte must pass through the cipher in this
//! process, so `sendfile` and `MSG_ZEROCOPY` are not used; the session says so in `io` and
//! `io_fallback`. A link leaves rustls for wanxfer's record layer once joined
//! (`Stream::own_records`): the sender seals a block's payload in its pool buffer and
//! writes the records with `writev`, the receiver opens records straight into the block's
//! buffer (`records.rs`). Where the kernel offers TLS the sending link hands its records
//! to the kernel instead (`Stream::offload_to_kernel`) and `sendfile` stays zero-copy.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;

use crossbeam_channel::{Receiver, Sender};
use wanxfer_proto::{BlockHeader, Segment, TransportKind};

use super::zerocopy::{self, InFlight};
use super::{
    check_header, pump_in, pump_out, tcp_info, unsent_limit, BlockRx, BlockTx, Closer, Joined,
    Link, PumpCtx, Transport,
};
use crate::digest::{BlockKey, PayloadVerifier, IN_CACHE_PIECE_BYTES};
use crate::pool::{Block, Cancel, FileRange, Pool};
use crate::source::IoMode;
use crate::stream::Stream;
use crate::Error;

/// Parallel TCP streams: each joined data connection is a link, and receiving links share
/// one pool.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    pub peer: String,
    /// The agreed block size: the largest payload a link accepts.
    pub block_size: usize,
    pub session_tag: u64,
    /// How sending links send (`Zerocopy` turns on `MSG_ZEROCOPY`).
    pub io: IoMode,
    /// A session without encryption: the key the peer's blocks must be tagged with.
    pub receive_key: Option<BlockKey>,
    /// Sending links move their TLS records to the kernel (it offers TLS, and `io` wants
    /// `sendfile` or `MSG_ZEROCOPY`).
    pub kernel_tls: bool,
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn receive_pool(&self, buffers: usize, block_size: usize) -> Option<Pool> {
        Some(Pool::new(buffers, block_size))
    }

    fn connect(&self, joined: Joined) -> Result<Box<dyn Link>, Error> {
        self.link(joined.stream, joined.join.index)
    }

    fn accept(&self, joined: Joined) -> Result<Box<dyn Link>, Error> {
        self.link(joined.stream, joined.join.index)
    }
}

impl TcpTransport {
    fn link(&self, stream: Stream, index: u16) -> Result<Box<dyn Link>, Error> {
        let closer = Closer::new(stream.tcp());
        let mut channel =
            TcpChannel::new(stream, self.peer.clone(), self.block_size, self.session_tag);
        channel.receive_key = self.receive_key.clone();
        Ok(Box::new(TcpLink {
            channel,
            index,
            zerocopy: self.io == IoMode::Zerocopy,
            kernel_tls: self.kernel_tls,
            closer,
        }))
    }
}

struct TcpLink {
    channel: TcpChannel,
    index: u16,
    zerocopy: bool,
    kernel_tls: bool,
    closer: Closer,
}

impl Link for TcpLink {
    fn index(&self) -> u16 {
        self.index
    }

    fn closer(&self) -> Closer {
        self.closer.clone()
    }

    fn send(mut self: Box<Self>, queue: Receiver<Block>, ctx: &PumpCtx) -> Result<(), Error> {
        if self.kernel_tls && self.channel.stream.user_space_tls() {
            let placeholder = Stream::plain(
                self.channel
                    .stream
                    .tcp()
                    .try_clone()
                    .map_err(|e| self.channel.net("setting up the channel to", e))?,
            );
            let stream = std::mem::replace(&mut self.channel.stream, placeholder);
            let (stream, why) = stream.offload_to_kernel();
            self.channel.stream = stream;
            if let Some(why) = why {
                self.channel.note_fallback(Some(why));
                if !self.channel.stream.is_encrypted() {
                    return Err(Error::Internal(
                        "a data channel lost its TLS while moving it to the kernel".into(),
                    ));
                }
            }
        }
        self.channel.own_records()?;
        let limit = unsent_limit(self.channel.max_payload, super::TCP_UNSENT_BLOCKS);
        if let Err(e) = tcp_info::set_unsent_limit(self.channel.stream.tcp(), limit) {
            tracing::warn!(
                "data channel {} to {}: limiting its unsent bytes: {e}",
                self.index,
                self.channel.peer
            );
        }
        if self.zerocopy && !self.channel.stream.user_space_tls() {
            self.channel.enable_zerocopy()?;
        }
        pump_out(&mut self.channel, &queue, ctx)
    }

    fn receive(
        mut self: Box<Self>,
        pool: Option<Pool>,
        out: Sender<Block>,
        ctx: &PumpCtx,
    ) -> Result<(), Error> {
        let pool = pool
            .ok_or_else(|| Error::Internal("a TCP link receives into the session's pool".into()))?;
        self.channel.own_records()?;
        pump_in(&mut self.channel, &pool, &out, ctx)
    }
}

/// A TCP stream carrying blocks.
#[derive(Debug)]
pub struct TcpChannel {
    stream: Stream,
    peer: String,
    /// A session without encryption: blocks must carry a tag under this key.
    receive_key: Option<BlockKey>,
    /// Receive side: the largest payload we accept (the negotiated block size).
    max_payload: usize,
    session_tag: u64,
    table: Vec<u8>,
    /// `--io zerocopy`: blocks sent with `MSG_ZEROCOPY`, kept until the kernel releases them.
    zerocopy: Option<InFlight<Block>>,
    /// The first time this channel could not send the way `--io` asked, and why.
    io_fallback: Option<String>,
}

impl TcpChannel {
    pub fn new(stream: Stream, peer: String, max_payload: usize, session_tag: u64) -> Self {
        TcpChannel {
            stream,
            peer,
            receive_key: None,
            max_payload,
            session_tag,
            table: Vec::new(),
            zerocopy: None,
            io_fallback: None,
        }
    }

    /// Moves the channel's TLS records from rustls to wanxfer's record layer, if rustls
    /// still has them (see `Stream::own_records`).
    fn own_records(&mut self) -> Result<(), Error> {
        if !matches!(self.stream.protection().offload, "rustls") {
            return Ok(());
        }
        let tcp = self
            .stream
            .tcp()
            .try_clone()
            .map_err(|e| self.net("setting up the channel to", e))?;
        let stream = std::mem::replace(&mut self.stream, Stream::plain(tcp));
        match stream.own_records() {
            Ok(stream) => {
                self.stream = stream;
                Ok(())
            }
            Err(e) => {
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
                Err(Error::protocol(
                    &self.peer,
                    format!("TLS: taking the data channel's records over from rustls: {e}"),
                ))
            }
        }
    }

    /// Keeps the first reason this channel sent differently from what `--io` asked.
    fn note_fallback(&mut self, why: Option<String>) {
        if self.io_fallback.is_none() {
            self.io_fallback = why;
        }
    }

    /// Sends blocks from pool buffers with `MSG_ZEROCOPY` from now on (see
    /// [`super::zerocopy`]). Fails where the kernel does not offer it.
    pub fn enable_zerocopy(&mut self) -> Result<(), Error> {
        use std::os::fd::AsFd;
        zerocopy::enable(self.stream.tcp().as_fd()).map_err(|e| {
            Error::local(
                "enable MSG_ZEROCOPY (--io zerocopy) on the connection to",
                &self.peer,
                e,
            )
        })?;
        self.zerocopy = Some(InFlight::default());
        Ok(())
    }

    /// Sends `block` with `MSG_ZEROCOPY` and keeps it until the kernel releases it;
    /// blocks it released meanwhile go back to the pool.
    fn send_zerocopy(&mut self, block: Block) -> io::Result<()> {
        use std::os::fd::AsFd;
        let flight = self.zerocopy.as_mut().expect("called in zerocopy mode");
        let socket = self.stream.tcp().as_fd();
        let mut slices = [IoSlice::new(&block.header), IoSlice::new(block.payload())];
        let mut left: &mut [IoSlice<'_>] = &mut slices;
        while !left.is_empty() {
            match send_flagged(socket, left, libc::MSG_ZEROCOPY) {
                Ok(n) => {
                    flight.sent();
                    IoSlice::advance_slices(&mut left, n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Too much memory pinned for this socket: wait for releases, then retry.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    drop(zerocopy::wait_until_held_at_most(socket, flight, 0)?);
                }
                Err(e) => return Err(e),
            }
        }
        flight.hold(block);
        // No cap of our own on blocks held: the pool is the bound, as the receiver's
        // grants are for fabric. A cap would limit a long path to cap × block per round
        // trip, since the kernel releases a block only once the peer acknowledged it.
        zerocopy::reap(socket, flight, std::time::Duration::ZERO)?;
        drop(flight.take_released().collect::<Vec<_>>());
        Ok(())
    }

    fn net(&self, context: &'static str, e: io::Error) -> Error {
        Error::network(context, &self.peer, e)
    }

    /// Reads at least one byte into `buf` (not empty) from a stream under TLS; an end is
    /// the peer vanishing mid-block.
    fn read_some(&mut self, buf: &mut [u8]) -> Result<usize, Error> {
        loop {
            match (&self.stream).read(buf) {
                Ok(0) => {
                    return Err(self.net(
                        "connection closed mid-block by",
                        io::ErrorKind::UnexpectedEof.into(),
                    ))
                }
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.net("receiving from", e)),
            }
        }
    }

    /// Reads exactly `buf.len()` bytes. `Ok(false)` if the stream ended before the first
    /// byte and `clean_end_ok` is set; an end anywhere else is the peer vanishing.
    fn read_full(&mut self, buf: &mut [u8], clean_end_ok: bool) -> Result<bool, Error> {
        let mut got = 0;
        let tls = self.stream.user_space_tls();
        while got < buf.len() {
            let read = if tls {
                (&self.stream).read(&mut buf[got..])
            } else {
                // MSG_WAITALL: one wakeup per block instead of one per arriving segment
                // burst.
                rustix::net::recv(
                    self.stream.tcp(),
                    &mut buf[got..],
                    rustix::net::RecvFlags::WAITALL,
                )
                .map(|(n, _)| n)
                .map_err(io::Error::from)
            };
            match read {
                Ok(0) if got == 0 && clean_end_ok => return Ok(false),
                Ok(0) => {
                    return Err(self.net(
                        "connection closed mid-block by",
                        io::ErrorKind::UnexpectedEof.into(),
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.net("receiving from", e)),
            }
        }
        Ok(true)
    }
}

impl BlockTx for TcpChannel {
    fn send(&mut self, mut block: Block) -> Result<(), Error> {
        if block.file_range.is_none() && self.zerocopy.is_some() {
            return self
                .send_zerocopy(block)
                .map_err(|e| self.net("sending to", e));
        }
        if self.stream.user_space_tls() {
            return self
                .send_through_tls(&mut block)
                .map_err(|e| self.net("sending to", e));
        }
        let sent = match &block.file_range {
            None => {
                let mut slices = [IoSlice::new(&block.header), IoSlice::new(block.payload())];
                write_all_vectored(self.stream.tcp(), &mut slices)
            }
            Some(range) => send_from_file(self.stream.tcp(), &block.header, range, block.payload())
                .map(|refused| self.note_fallback(refused)),
        };
        sent.map_err(|e| self.net("sending to", e))
    }

    fn finish(&mut self) -> Result<(), Error> {
        if let Some(flight) = &mut self.zerocopy {
            use std::os::fd::AsFd;
            zerocopy::wait_until_held_at_most(self.stream.tcp().as_fd(), flight, 0)
                .map_err(|e| Error::network("waiting for the kernel to send to", &self.peer, e))?;
        }
        self.stream
            .finish_writes()
            .map_err(|e| self.net("closing channel to", e))
    }

    fn holds_blocks(&self) -> bool {
        self.zerocopy.as_ref().is_some_and(|f| f.held() > 0)
    }

    fn reclaim(&mut self) -> Result<(), Error> {
        if let Some(flight) = &mut self.zerocopy {
            use std::os::fd::AsFd;
            zerocopy::reap(self.stream.tcp().as_fd(), flight, std::time::Duration::ZERO)
                .map_err(|e| Error::network("reading send completions from", &self.peer, e))?;
            drop(flight.take_released().collect::<Vec<_>>());
        }
        Ok(())
    }

    fn zerocopy_counts(&self) -> (u64, u64) {
        self.zerocopy
            .as_ref()
            .map_or((0, 0), |f| (f.sends, f.copied))
    }

    fn io_fallback(&self) -> Option<&str> {
        self.io_fallback.as_deref()
    }
}

impl TcpChannel {
    /// A block through user-space TLS: header and payload sealed into records, the
    /// payload in place in its buffer (it is not needed after it is sent) or, where the
    /// reader left it in the file for `sendfile`, read from the file.
    fn send_through_tls(&mut self, block: &mut Block) -> io::Result<()> {
        let mut out = &self.stream;
        match &block.file_range {
            Some(range) if !range.in_buffer => {
                out.write_all(&block.header)?;
                let mut buf = vec![0u8; IN_CACHE_PIECE_BYTES];
                let mut pos = range.offset;
                let end = range.offset + block.len as u64;
                use std::os::unix::fs::FileExt;
                while pos < end {
                    let n = (end - pos).min(buf.len() as u64) as usize;
                    range.file.read_exact_at(&mut buf[..n], pos)?;
                    out.write_all(&buf[..n])?;
                    pos += n as u64;
                }
                Ok(())
            }
            _ => {
                let len = block.len;
                let header = std::mem::take(&mut block.header);
                block.scribbled = true;
                let sent = self.stream.write_block(&header, &mut block.space()[..len]);
                block.header = header;
                sent
            }
        }
    }
}

/// One `sendmsg` of `slices` with `flags`; the byte count sent.
fn send_flagged(
    socket: std::os::fd::BorrowedFd<'_>,
    slices: &[IoSlice<'_>],
    flags: libc::c_int,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed msghdr is valid; it points at `slices`, whose layout matches
    // `iovec` (guaranteed by std), for the duration of the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = slices.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = slices.len() as _;
    // SAFETY: a valid socket and message; the kernel only reads the buffers.
    let rc = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, flags | libc::MSG_NOSIGNAL) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

impl BlockRx for TcpChannel {
    fn recv(&mut self, pool: &Pool, cancel: &Cancel) -> Result<Option<Block>, Error> {
        let mut fixed = [0u8; BlockHeader::LEN];
        if !self.read_full(&mut fixed, true)? {
            return Ok(None);
        }
        let header = BlockHeader::decode_fixed(&fixed).map_err(|e| Error::decode(&self.peer, e))?;
        check_header(
            &header,
            self.session_tag,
            self.max_payload,
            self.receive_key.is_some(),
            &self.peer,
        )?;
        let mut table = std::mem::take(&mut self.table);
        table.resize(header.segment_count as usize * Segment::LEN, 0);
        let read = self.read_full(&mut table, false);
        let mut block = pool.take(cancel)?;
        let decoded = read.and_then(|_| {
            header
                .decode_segments(&fixed, &table, &mut block.segments)
                .map_err(|e| Error::decode(&self.peer, e))
        });
        self.table = table;
        decoded?;
        let len = header.payload_len as usize;
        let mut check = PayloadVerifier::new(&header, &block.segments);
        if let Some(key) = &self.receive_key {
            check = check.with_mac(key, &header, &fixed, &self.table);
        }
        let (segments, space) = block.segments_and_space();
        if self.stream.user_space_tls() {
            // Records are opened straight into the buffer, as many as arrived at a time;
            // each read's bytes are checked while they are still in cache.
            let mut got = 0;
            while got < len {
                let n = self.read_some(&mut space[got..len])?;
                for piece in space[got..got + n].chunks(IN_CACHE_PIECE_BYTES) {
                    check.update(segments, piece);
                }
                got += n;
            }
        } else {
            for piece in space[..len].chunks_mut(IN_CACHE_PIECE_BYTES) {
                self.read_full(piece, false)?;
                check.update(segments, piece);
            }
        }
        block.len = len;
        check.settle(&mut block);
        Ok(Some(block))
    }
}

/// Sends `header` then the payload straight from the page cache. Where the source's file
/// system refuses `sendfile`, the rest goes by plain writes — from `payload` when the
/// reader already read the bytes into the buffer, else read again — and the refusal comes
/// back, so that `--json` can say the block was copied. `MSG_MORE` keeps the small header
/// from going out as a packet of its own.
fn send_from_file(
    stream: &TcpStream,
    header: &[u8],
    range: &FileRange,
    payload: &[u8],
) -> io::Result<Option<String>> {
    let mut sent = 0;
    while sent < header.len() {
        match rustix::net::send(stream, &header[sent..], rustix::net::SendFlags::MORE) {
            Ok(n) => sent += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut pos = range.offset;
    let end = range.offset + payload.len() as u64;
    while pos < end {
        let count = (end - pos) as usize;
        match rustix::fs::sendfile(stream, &*range.file, Some(&mut pos), count) {
            // The file shrank after the reader read these bytes into the buffer: they are
            // what its checks covered, so they go, and the channel lives on; the reader
            // fails the file for having changed.
            Ok(0) if range.in_buffer => {
                let done = (pos - range.offset) as usize;
                (&*stream).write_all(&payload[done..])?;
                return Ok(None);
            }
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the file shrank while being sent",
                ))
            }
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(
                e @ (rustix::io::Errno::INVAL
                | rustix::io::Errno::NOSYS
                | rustix::io::Errno::OPNOTSUPP),
            ) => {
                let done = (pos - range.offset) as usize;
                if range.in_buffer {
                    (&*stream).write_all(&payload[done..])?;
                } else {
                    copy_range(stream, &range.file, pos, end)?;
                }
                return Ok(Some(format!(
                    "sendfile: the source's file system refused it ({}), so file blocks were copied",
                    io::Error::from(e)
                )));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(None)
}

fn copy_range(
    mut stream: &TcpStream,
    file: &std::fs::File,
    mut pos: u64,
    end: u64,
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 256 << 10];
    while pos < end {
        let n = (end - pos).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], pos)?;
        stream.write_all(&buf[..n])?;
        pos += n as u64;
    }
    Ok(())
}

fn write_all_vectored(mut stream: &TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::sync::Arc;

    /// Sends one block's header and payload from `file` over loopback; what arrived and
    /// the refusal, if any.
    fn send_over_loopback(
        file: std::fs::File,
        payload: &[u8],
        in_buffer: bool,
    ) -> (io::Result<Option<String>>, Vec<u8>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let sender = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut receiver, _) = listener.accept().unwrap();
        let range = FileRange {
            file: Arc::new(file),
            offset: 0,
            in_buffer,
        };
        let result = send_from_file(&sender, b"HDR", &range, payload);
        drop(sender);
        let mut got = Vec::new();
        receiver.read_to_end(&mut got).unwrap();
        (result, got)
    }

    fn expected(payload: &[u8]) -> Vec<u8> {
        [b"HDR".as_slice(), payload].concat()
    }

    #[test]
    fn a_regular_file_goes_by_sendfile_without_a_fallback() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&payload).unwrap();
        let (result, got) = send_over_loopback(file, &payload, false);
        assert_eq!(result.unwrap(), None);
        assert_eq!(got, expected(&payload));
    }

    /// A directory is a real descriptor the kernel refuses to `sendfile` from (EINVAL), as
    /// a file system without splice support would: the payload the reader already holds
    /// goes by plain writes and the refusal is reported.
    #[test]
    fn a_refused_sendfile_sends_the_buffer_and_says_so() {
        let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
        let payload = vec![7u8; 100_000];
        let (result, got) = send_over_loopback(dir, &payload, true);
        let why = result.unwrap().expect("the refusal is reported");
        assert!(why.starts_with("sendfile: "), "{why}");
        assert_eq!(got, expected(&payload));
    }

    /// A file cut short after the reader read a block (issue 16 item 5): the bytes the
    /// reader read and checked go from the buffer and the channel survives; without them
    /// in the buffer there is nothing right to send, and the send fails.
    #[test]
    fn a_file_that_shrank_after_it_was_read_sends_what_was_read() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&payload[..100_000]).unwrap();
        let (result, got) = send_over_loopback(file.try_clone().unwrap(), &payload, true);
        assert_eq!(result.unwrap(), None);
        assert_eq!(got, expected(&payload));
        let (result, got) = send_over_loopback(file, &payload, false);
        assert!(result.is_err());
        assert_eq!(got, expected(&payload[..100_000]));
    }

    /// Without the bytes in the buffer the fallback reads the file again; a descriptor
    /// that cannot be read fails the send instead of sending whatever the buffer held.
    #[test]
    fn a_refused_sendfile_without_the_bytes_reads_them_or_fails() {
        let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
        let (result, got) = send_over_loopback(dir, &[0u8; 4096], false);
        assert!(result.is_err());
        assert_eq!(got, b"HDR");
    }
}
