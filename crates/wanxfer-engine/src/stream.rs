//! One wanxfer connection as a byte stream, whatever protects it: TLS in user space
//! (rustls), TLS in the kernel (after a rustls handshake), or plaintext whose frames carry
//! a MAC (a session run without encryption on request).
//!
//! A control connection is read by one thread and written by another at the same time,
//! and rustls is one state machine for both directions. So that neither can stall the
//! other, no thread ever waits on the socket while holding the rustls connection's lock:
//! the reader reads the socket into a buffer of its own, then locks only to hand the
//! bytes to rustls, decrypt and take the plaintext; a writer locks only to encrypt into a
//! buffer of its own, then writes the socket. Writers are serialized by a second lock
//! (held across the socket write), so records leave in the order they were sealed; the
//! reader never writes, so a blocked writer cannot stop the reader from draining the
//! socket, which is what keeps two peers that both write from deadlocking. A response
//! rustls owes the peer (an alert) leaves with the next write.
//!
//! Plaintext connections get the same split: the reader's and the writer's MAC states are
//! separate, each with its own key and sequence number.
//!
//! A data channel, once joined, leaves rustls for wanxfer's own record layer
//! ([`Stream::own_records`], `records.rs`), which seals a block where it lies and opens
//! records straight into the block's buffer. For that hand-over to lose nothing, rustls is
//! only ever given whole records (during the handshake too): what it has not opened is
//! then still in our buffer, and what it has opened is still in its plaintext buffer.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use wanxfer_proto::handshake::{Binding, BINDING_EXPORTER_LABEL, NO_BINDING};

use crate::records::{Opener, Sealer};
use crate::tls::{io_error, read_socket, take_tls, whole_record};

/// Bytes read from the socket at a time under TLS, and encrypted per lock under TLS:
/// large enough that a 4 MiB block costs a few dozen system calls, not a thousand.
const TLS_IO_BYTES: usize = 256 << 10;

/// How a connection is protected, as reports show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protection {
    /// The negotiated TLS suite (`TLS13_AES_128_GCM_SHA256`), or `none`.
    pub encryption: String,
    /// Where records are sealed: `rustls` (user space), `kernel`, or `none`.
    pub offload: &'static str,
}

/// A connection: clones share the socket and its protection.
#[derive(Debug)]
pub struct Stream {
    tcp: TcpStream,
    layer: Arc<Layer>,
}

#[derive(Debug)]
enum Layer {
    Plain(MacLayer),
    Tls(Box<TlsLayer>),
    /// The kernel seals and opens records (`TCP_ULP` `tls`); the socket carries plaintext
    /// as far as this process sees.
    Kernel {
        suite: String,
    },
    /// wanxfer seals and opens the records itself (a data channel, after the handshake).
    Records(Box<RecordLayer>),
}

struct RecordLayer {
    read: Mutex<Opener>,
    write: Mutex<Sealer>,
    suite: String,
    binding: Binding,
    peer_certificate: Option<Vec<u8>>,
}

impl std::fmt::Debug for RecordLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordLayer")
            .field("suite", &self.suite)
            .finish_non_exhaustive()
    }
}

struct TlsLayer {
    conn: Mutex<rustls::Connection>,
    /// The reader's socket bytes not yet handed to rustls, and the one-reader lock.
    read: Mutex<ReadBuf>,
    /// The one-writer lock, and the sealed bytes on their way to the socket.
    write: Mutex<Vec<u8>>,
    suite: String,
    binding: Binding,
}

impl std::fmt::Debug for TlsLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsLayer")
            .field("suite", &self.suite)
            .finish_non_exhaustive()
    }
}

struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Stream {
    /// A plaintext connection (until [`Stream::authenticate`] turns on its MACs).
    pub fn plain(tcp: TcpStream) -> Stream {
        Stream {
            tcp,
            layer: Arc::new(Layer::Plain(MacLayer::default())),
        }
    }

    /// A connection whose TLS handshake `conn` has completed; `unread` are socket bytes
    /// read after the last record rustls was given (whole records and perhaps the start
    /// of one more, see the module's doc).
    pub fn tls(
        tcp: TcpStream,
        conn: rustls::Connection,
        unread: &[u8],
    ) -> Result<Stream, rustls::Error> {
        let suite = conn
            .negotiated_cipher_suite()
            .map(|s| format!("{:?}", s.suite()))
            .unwrap_or_else(|| "unknown".into());
        let mut binding = NO_BINDING;
        conn.export_keying_material(&mut binding, BINDING_EXPORTER_LABEL, None)?;
        Ok(Stream {
            tcp,
            layer: Arc::new(Layer::Tls(Box::new(TlsLayer {
                conn: Mutex::new(conn),
                read: Mutex::new(ReadBuf {
                    buf: {
                        let mut buf = vec![0; TLS_IO_BYTES.max(unread.len())];
                        buf[..unread.len()].copy_from_slice(unread);
                        buf
                    },
                    start: 0,
                    end: unread.len(),
                }),
                write: Mutex::new(Vec::new()),
                suite,
                binding,
            }))),
        })
    }

    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(Stream {
            tcp: self.tcp.try_clone()?,
            layer: self.layer.clone(),
        })
    }

    /// The socket, for settings and for the sends that bypass user space (`sendfile`,
    /// `MSG_ZEROCOPY`, `MSG_WAITALL`), which only [`Stream::user_space_tls`] forbids.
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// Whether bytes are sealed in user space (by rustls or by wanxfer's record layer):
    /// then no send can bypass it.
    pub fn user_space_tls(&self) -> bool {
        matches!(*self.layer, Layer::Tls(_) | Layer::Records(_))
    }

    /// What ties proofs made on this connection to it: the TLS exporter's output, or
    /// nothing on plaintext.
    pub fn binding(&self) -> Binding {
        match &*self.layer {
            Layer::Tls(t) => t.binding,
            Layer::Records(r) => r.binding,
            _ => NO_BINDING,
        }
    }

    pub fn protection(&self) -> Protection {
        match &*self.layer {
            Layer::Plain(_) => Protection {
                encryption: "none".into(),
                offload: "none",
            },
            Layer::Tls(t) => Protection {
                encryption: t.suite.clone(),
                offload: "rustls",
            },
            Layer::Kernel { suite } => Protection {
                encryption: suite.clone(),
                offload: "kernel",
            },
            Layer::Records(r) => Protection {
                encryption: r.suite.clone(),
                offload: "wanxfer",
            },
        }
    }

    /// The end-entity certificate (DER) the peer presented and TLS verified, if any.
    pub fn peer_certificate(&self) -> Option<Vec<u8>> {
        match &*self.layer {
            Layer::Tls(t) => {
                let conn = t.conn.lock().unwrap_or_else(|e| e.into_inner());
                conn.peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(|c| c.to_vec())
            }
            Layer::Records(r) => r.peer_certificate.clone(),
            _ => None,
        }
    }

    pub fn is_encrypted(&self) -> bool {
        !matches!(*self.layer, Layer::Plain(_))
    }

    /// Plaintext only: from now on what this side writes carries a MAC under `send_key`,
    /// and what it reads must carry one under `receive_key` (either may be turned on
    /// first: each side starts writing MACs and expecting them at a fixed point of the
    /// handshake).
    pub fn authenticate_writes(&self, send_key: [u8; 32]) {
        if let Layer::Plain(mac) = &*self.layer {
            *lock(&mac.write) = Some(MacState::new(send_key));
        }
    }

    pub fn authenticate_reads(&self, receive_key: [u8; 32]) {
        if let Layer::Plain(mac) = &*self.layer {
            *lock(&mac.read) = Some(MacReader {
                state: MacState::new(receive_key),
                plain: Vec::new(),
                at: 0,
            });
        }
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_read_timeout(t)
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp.set_write_timeout(t)
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.peer_addr()
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// Tears the connection down at once (both ways), waking any thread blocked on it.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        self.tcp.shutdown(how)
    }

    /// Ends this side's writing cleanly: under TLS the peer must see `close_notify`, or
    /// it cannot tell the end from a connection cut short by someone on the path.
    pub fn finish_writes(&self) -> io::Result<()> {
        match &*self.layer {
            Layer::Tls(t) => {
                let mut out = lock(&t.write);
                out.clear();
                {
                    let mut conn = lock(&t.conn);
                    conn.send_close_notify();
                    take_tls(&mut conn, &mut out)?;
                }
                (&self.tcp).write_all(&out)?;
            }
            Layer::Kernel { .. } => crate::ktls::send_close_notify(&self.tcp)?,
            Layer::Records(r) => lock(&r.write).close_notify(&self.tcp)?,
            Layer::Plain(_) => {}
        }
        self.tcp.shutdown(Shutdown::Write)
    }

    /// Moves record sealing into the kernel where it offers TLS (`setsockopt(TCP_ULP,
    /// "tls")`), so that `sendfile` keeps sending from the page cache. Only for a stream
    /// no other clone uses and that has nothing buffered: the sending side of a data
    /// channel, once joined. Where the kernel has no TLS the stream comes back unchanged
    /// with the reason, and rustls goes on sealing.
    pub fn offload_to_kernel(self) -> (Stream, Option<String>) {
        let Layer::Tls(_) = &*self.layer else {
            return (self, None);
        };
        if let Err(e) = crate::ktls::attach_ulp(&self.tcp) {
            return (
                self,
                Some(format!(
                    "kernel TLS unavailable ({e}): wanxfer seals records"
                )),
            );
        }
        let Stream { tcp, layer } = self;
        let layer = match Arc::try_unwrap(layer) {
            Ok(Layer::Tls(t)) => *t,
            Ok(_) => unreachable!("checked above"),
            Err(layer) => {
                return (
                    Stream { tcp, layer },
                    Some("kernel TLS: the connection is shared: wanxfer seals records".into()),
                )
            }
        };
        let suite = layer.suite.clone();
        let pending = {
            let read = lock(&layer.read);
            read.end - read.start
        };
        let conn = layer.conn.into_inner().unwrap_or_else(|e| e.into_inner());
        if pending > 0 || conn.wants_write() {
            // Cannot happen on a freshly joined sender; fail loudly rather than lose bytes.
            let _ = tcp.shutdown(Shutdown::Both);
            return (
                Stream::plain(tcp),
                Some("kernel TLS: bytes were buffered in user space; channel closed".into()),
            );
        }
        match crate::ktls::enable(&tcp, conn) {
            Ok(()) => (
                Stream {
                    tcp,
                    layer: Arc::new(Layer::Kernel { suite }),
                },
                None,
            ),
            Err(e) => {
                let _ = tcp.shutdown(Shutdown::Both);
                (
                    Stream::plain(tcp),
                    Some(format!(
                        "kernel TLS failed after the handshake ({e}); channel closed"
                    )),
                )
            }
        }
    }

    /// Leaves rustls for wanxfer's own record layer (`records.rs`): rustls hands over its
    /// keys and sequence numbers, the plaintext it opened and nobody read yet, and the
    /// socket bytes it was not given. Only for a stream no other clone uses and that has
    /// nothing left to send (a joined data channel); anything else stays as it was.
    pub fn own_records(self) -> io::Result<Stream> {
        let Layer::Tls(_) = &*self.layer else {
            return Ok(self);
        };
        let Stream { tcp, layer } = self;
        let t = match Arc::try_unwrap(layer) {
            Ok(Layer::Tls(t)) => *t,
            Ok(_) => unreachable!("checked above"),
            Err(_) => return Err(io::Error::other("the TLS connection is shared")),
        };
        let TlsLayer {
            conn,
            read,
            suite,
            binding,
            ..
        } = t;
        let mut conn = conn.into_inner().unwrap_or_else(|e| e.into_inner());
        let rb = read.into_inner().unwrap_or_else(|e| e.into_inner());
        if conn.wants_write() {
            return Err(io::Error::other(
                "TLS records were still waiting to be sent",
            ));
        }
        let limit = match conn.negotiated_cipher_suite() {
            Some(rustls::SupportedCipherSuite::Tls13(s)) => s.common.confidentiality_limit,
            _ => return Err(io::Error::other("not a TLS 1.3 connection")),
        };
        let mut opened = Vec::new();
        let mut closed = false;
        let mut chunk = [0u8; 4096];
        loop {
            match conn.reader().read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => opened.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        let peer_certificate = conn
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|c| c.to_vec());
        let secrets = conn
            .dangerous_extract_secrets()
            .map_err(|e| io::Error::other(format!("extracting the TLS secrets: {e}")))?;
        let sealer = Sealer::new(secrets.tx.0, &secrets.tx.1, limit)?;
        // The limit binds the sender; what the peer seals is its own affair.
        let mut opener = Opener::new(
            secrets.rx.0,
            &secrets.rx.1,
            u64::MAX,
            opened,
            &rb.buf[rb.start..rb.end],
        )?;
        if closed {
            opener.close();
        }
        Ok(Stream {
            tcp,
            layer: Arc::new(Layer::Records(Box::new(RecordLayer {
                read: Mutex::new(opener),
                write: Mutex::new(sealer),
                suite,
                binding,
                peer_certificate,
            }))),
        })
    }

    /// Writes `prefix` then `payload` (a block's header and its bytes). Under wanxfer's
    /// record layer the payload is sealed where it lies and holds ciphertext afterwards;
    /// otherwise it is left as it was.
    pub fn write_block(&self, prefix: &[u8], payload: &mut [u8]) -> io::Result<()> {
        match &*self.layer {
            Layer::Records(r) => lock(&r.write).write_in_place(&self.tcp, prefix, payload),
            _ => {
                let mut out = self;
                out.write_all(prefix)?;
                out.write_all(payload)
            }
        }
    }

    fn read_tls(&self, t: &TlsLayer, buf: &mut [u8]) -> io::Result<usize> {
        let mut rb = lock(&t.read);
        {
            let mut conn = lock(&t.conn);
            feed(&mut conn, &mut rb)?;
            match conn.reader().read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                other => return other,
            }
        }
        if whole_record(&rb.buf[rb.start..rb.end]).is_some() {
            // rustls holds as much plaintext as it takes and none was asked for: cannot
            // happen with a non-empty `buf`; say so instead of spinning.
            return Err(io::Error::other("TLS: plaintext buffer full"));
        }
        // Only the start of a record is left: it moves to the front, more comes behind.
        let ReadBuf {
            buf: bytes,
            start,
            end,
        } = &mut *rb;
        bytes.copy_within(*start..*end, 0);
        *end -= *start;
        *start = 0;
        let filled = rb.end;
        let n = read_socket(&self.tcp, &mut rb.buf[filled..])?;
        let mut conn = lock(&t.conn);
        if n == 0 {
            // The end: rustls tells a clean close_notify (Ok(0)) from a cut (an error).
            let mut partial = &rb.buf[rb.start..rb.end];
            conn.read_tls(&mut partial)?;
            conn.read_tls(&mut io::empty())?;
            conn.process_new_packets().map_err(io_error)?;
            return conn.reader().read(buf);
        }
        rb.end += n;
        feed(&mut conn, &mut rb)?;
        match conn.reader().read(buf) {
            // Bytes came but not a whole record: the caller retries, with what is left of
            // its deadline (`Interrupted` is the retry signal every reader honours).
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                Err(io::ErrorKind::Interrupted.into())
            }
            other => other,
        }
    }

    fn write_tls(&self, t: &TlsLayer, mut data: &[u8]) -> io::Result<()> {
        let mut out = lock(&t.write);
        while !data.is_empty() {
            out.clear();
            {
                let mut conn = lock(&t.conn);
                let n = conn.writer().write(&data[..data.len().min(TLS_IO_BYTES)])?;
                data = &data[n..];
                take_tls(&mut conn, &mut out)?;
                if n == 0 && out.is_empty() {
                    return Err(io::ErrorKind::WriteZero.into());
                }
            }
            (&self.tcp).write_all(&out)?;
        }
        Ok(())
    }
}

/// Hands the reader's buffered whole records to rustls and decrypts them, as far as
/// rustls takes them; the start of a record stays in the buffer.
fn feed(conn: &mut rustls::Connection, rb: &mut ReadBuf) -> io::Result<()> {
    while let Some(len) = whole_record(&rb.buf[rb.start..rb.end]) {
        match crate::tls::give_record(conn, &rb.buf[rb.start..rb.start + len]) {
            Ok(()) => rb.start += len,
            // Its plaintext buffer is full: the caller takes plaintext first.
            Err(e) if e.kind() == io::ErrorKind::Other => break,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere leaves the state as consistent as any I/O error would.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match &*self.layer {
            Layer::Tls(t) => self.read_tls(t, buf),
            Layer::Plain(mac) => mac.read(&self.tcp, buf),
            Layer::Kernel { .. } => (&self.tcp).read(buf),
            Layer::Records(r) => lock(&r.read).read(&self.tcp, buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf).map(|()| buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match &*self.layer {
            Layer::Tls(t) => self.write_tls(t, buf),
            Layer::Plain(mac) => mac.write(&self.tcp, buf),
            Layer::Kernel { .. } => (&self.tcp).write_all(buf),
            Layer::Records(r) => lock(&r.write).write(&self.tcp, buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        (&*self).write_all(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The MACs of a plaintext connection: off during the handshake, on (per direction)
/// from the point each side's proof makes the keys known.
#[derive(Debug, Default)]
struct MacLayer {
    read: Mutex<Option<MacReader>>,
    write: Mutex<Option<MacState>>,
}

/// The largest record: a control frame (at most 1 MiB of body) and its header fit.
const MAX_RECORD: usize = (1 << 20) + 64;
/// The tag: the first 16 bytes of a keyed BLAKE3 over sequence number, length and bytes.
const TAG_BYTES: usize = 16;

#[derive(Debug)]
struct MacState {
    key: [u8; 32],
    sequence: u64,
}

impl MacState {
    fn new(key: [u8; 32]) -> MacState {
        MacState { key, sequence: 0 }
    }

    /// The tag of the next record; every record's number is covered, so none can be
    /// dropped, repeated or reordered unnoticed.
    fn tag(&mut self, bytes: &[u8]) -> [u8; TAG_BYTES] {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(&self.sequence.to_le_bytes());
        h.update(&(bytes.len() as u32).to_le_bytes());
        h.update(bytes);
        self.sequence += 1;
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&h.finalize().as_bytes()[..TAG_BYTES]);
        tag
    }
}

#[derive(Debug)]
struct MacReader {
    state: MacState,
    /// The last verified record, and how much of it was read.
    plain: Vec<u8>,
    at: usize,
}

impl MacLayer {
    fn read(&self, tcp: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
        let mut guard = lock(&self.read);
        let Some(r) = guard.as_mut() else {
            drop(guard);
            return read_socket(tcp, buf);
        };
        if r.at == r.plain.len() {
            let mut len = [0u8; 4];
            if !read_full(tcp, &mut len, true)? {
                return Ok(0);
            }
            let len = u32::from_le_bytes(len) as usize;
            if len == 0 || len > MAX_RECORD {
                return Err(tampered("a record of an impossible length"));
            }
            r.plain.resize(len + TAG_BYTES, 0);
            read_full(tcp, &mut r.plain, false)?;
            let (bytes, tag) = r.plain.split_at(len);
            let expected = r.state.tag(bytes);
            if !bool::from(subtle::ConstantTimeEq::ct_eq(&expected[..], tag)) {
                return Err(tampered("a record that fails its MAC"));
            }
            r.plain.truncate(len);
            r.at = 0;
        }
        let n = buf.len().min(r.plain.len() - r.at);
        buf[..n].copy_from_slice(&r.plain[r.at..r.at + n]);
        r.at += n;
        Ok(n)
    }

    fn write(&self, tcp: &TcpStream, data: &[u8]) -> io::Result<()> {
        let mut guard = lock(&self.write);
        let Some(w) = guard.as_mut() else {
            return (&*tcp).write_all(data);
        };
        for chunk in data.chunks(MAX_RECORD) {
            let tag = w.tag(chunk);
            let len = (chunk.len() as u32).to_le_bytes();
            let mut slices = [
                io::IoSlice::new(&len),
                io::IoSlice::new(chunk),
                io::IoSlice::new(&tag),
            ];
            write_all_vectored(tcp, &mut slices)?;
        }
        Ok(())
    }
}

fn tampered(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{what}: the connection was altered on the path"),
    )
}

/// Fills `buf`; `Ok(false)` at a clean end before its first byte (if `end_ok`).
fn read_full(tcp: &TcpStream, buf: &mut [u8], end_ok: bool) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match read_socket(tcp, &mut buf[got..])? {
            0 if got == 0 && end_ok => return Ok(false),
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(true)
}

fn write_all_vectored(mut tcp: &TcpStream, mut slices: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match tcp.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Stream, Stream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (Stream::plain(client), Stream::plain(server))
    }

    /// MAC'd records arrive intact, in order, whatever the read sizes; one flipped bit,
    /// or a key that differs, is refused.
    #[test]
    fn authenticated_plaintext_round_trips_and_catches_tampering() {
        let (a, b) = pair();
        a.authenticate_writes([1; 32]);
        b.authenticate_reads([1; 32]);
        let msg: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        (&a).write_all(&msg).unwrap();
        (&a).write_all(b"second").unwrap();
        let mut got = vec![0u8; msg.len() + 6];
        (&b).read_exact(&mut got).unwrap();
        assert_eq!(&got[..msg.len()], &msg[..]);
        assert_eq!(&got[msg.len()..], b"second");

        // A record whose bytes were changed on the path.
        let (a, b) = pair();
        b.authenticate_reads([1; 32]);
        let mut forged = MacState::new([1; 32]);
        let tag = forged.tag(b"hello");
        let mut record = 5u32.to_le_bytes().to_vec();
        record.extend_from_slice(b"jello");
        record.extend_from_slice(&tag);
        a.tcp().write_all(&record).unwrap();
        let e = (&b).read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");

        // The same record replayed: its sequence number is the wrong one.
        let (a, b) = pair();
        b.authenticate_reads([1; 32]);
        let mut sender = MacState::new([1; 32]);
        let tag = sender.tag(b"hello");
        let mut record = 5u32.to_le_bytes().to_vec();
        record.extend_from_slice(b"hello");
        record.extend_from_slice(&tag);
        a.tcp().write_all(&record).unwrap();
        a.tcp().write_all(&record).unwrap();
        let mut got = [0u8; 5];
        (&b).read_exact(&mut got).unwrap();
        assert!((&b).read(&mut got).is_err(), "a replayed record is refused");
    }
}
