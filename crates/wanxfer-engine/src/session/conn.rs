//! Connections: preambles, the server's greeting, framed messages, and deadlines that
//! bound a whole exchange rather than each read.
//!
//! A per-read timeout lets a peer that trickles one byte every few seconds hold a
//! connection forever; every read here is given what is left of one deadline instead, so a
//! handshake ends when its deadline does, however the bytes arrive. Once a session runs,
//! its control connection is read by a thread of its own into the session's bounded event
//! queue, and written by another from a bounded queue, so the session's loop never blocks
//! on the network: two sides each waiting for the other to read cannot deadlock.
//!
//! Everything here reads and writes a [`Stream`], whatever protects it (TLS or MACs,
//! see [`crate::stream`]); the TLS handshake's own reads and writes on the bare socket go
//! through the same deadline-bounded calls.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use wanxfer_proto::{
    encode_frame, ConnectionKind, DecodeError, FrameHeader, Hello, Message, Preamble,
};

pub use crate::stream::Stream;
use crate::Error;

/// A connection whose reads and writes a deadline can bound: a bare socket (during a TLS
/// handshake) or a [`Stream`].
pub trait Timed: Read + Write {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()>;
}

impl Timed for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

impl Timed for Stream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        Stream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        Stream::set_write_timeout(self, t)
    }
}

/// The end of an exchange: every read and write before it gets only what is left.
#[derive(Debug, Clone, Copy)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    pub fn after(limit: Duration) -> Deadline {
        Deadline(Some(Instant::now() + limit))
    }

    pub fn never() -> Deadline {
        Deadline(None)
    }

    /// What is left, `Err` once nothing is.
    pub(crate) fn left(&self) -> Result<Option<Duration>, ()> {
        match self.0 {
            None => Ok(None),
            Some(end) => {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    Err(())
                } else {
                    Ok(Some(left))
                }
            }
        }
    }
}

fn timed_out(peer: &str, what: &str) -> Error {
    Error::network(
        "timed out waiting for",
        peer,
        std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no {what} in time")),
    )
}

/// Reads exactly `buf.len()` bytes before `deadline`. `Ok(false)` if the stream ended
/// before the first byte and `clean_end_ok`.
pub fn read_exact_by(
    stream: &mut impl Timed,
    buf: &mut [u8],
    deadline: Deadline,
    peer: &str,
    what: &str,
) -> Result<(), Error> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.left().map_err(|()| timed_out(peer, what))?;
        stream
            .set_read_timeout(left)
            .map_err(|e| Error::network("reading from", peer, e))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(Error::network(
                    "connection closed by",
                    peer,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("the peer went away before sending {what}"),
                    ),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timed_out(peer, what))
            }
            Err(e) => return Err(Error::network("receiving from", peer, e)),
        }
    }
    Ok(())
}

/// Reads whatever arrives first (at least a byte) before `deadline`: a TLS handshake's
/// input, whose length only rustls knows.
pub fn read_some_by(
    stream: &mut impl Timed,
    buf: &mut [u8],
    deadline: Deadline,
    peer: &str,
    what: &str,
) -> Result<usize, Error> {
    loop {
        let left = deadline.left().map_err(|()| timed_out(peer, what))?;
        stream
            .set_read_timeout(left)
            .map_err(|e| Error::network("reading from", peer, e))?;
        match stream.read(buf) {
            Ok(0) => {
                return Err(Error::network(
                    "connection closed by",
                    peer,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("the peer went away during the {what} handshake"),
                    ),
                ))
            }
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timed_out(peer, what))
            }
            Err(e) => return Err(Error::network("receiving from", peer, e)),
        }
    }
}

/// Writes all of `bytes` before `deadline`.
pub fn write_all_by(
    stream: &mut impl Timed,
    bytes: &[u8],
    deadline: Deadline,
    peer: &str,
) -> Result<(), Error> {
    let left = deadline
        .left()
        .map_err(|()| timed_out(peer, "room to send"))?;
    stream
        .set_write_timeout(left)
        .map_err(|e| Error::network("sending to", peer, e))?;
    stream
        .write_all(bytes)
        .map_err(|e| Error::network("sending to", peer, e))
}

/// Reads one framed message before `deadline`, refusing oversized or corrupted frames
/// before allocating.
pub fn read_message_by(
    stream: &mut impl Timed,
    deadline: Deadline,
    peer: &str,
) -> Result<Message, Error> {
    let mut header = [0u8; FrameHeader::LEN];
    read_exact_by(stream, &mut header, deadline, peer, "a message")?;
    let header = FrameHeader::decode(&header).map_err(|e| Error::decode(peer, e))?;
    let mut body = vec![0u8; header.len as usize];
    read_exact_by(stream, &mut body, deadline, peer, "a message")?;
    header
        .check_body(&body)
        .map_err(|e| Error::decode(peer, e))?;
    Message::decode(header.kind, &body).map_err(|e| Error::decode(peer, e))
}

/// Encodes messages into one buffer, to go out in one write.
pub fn frames(msgs: &[&Message]) -> Vec<u8> {
    let mut out = Vec::new();
    for msg in msgs {
        encode_frame(msg, &mut out);
    }
    out
}

/// The server's greeting: its preamble and its `Hello`, sent before it reads a byte.
pub fn greeting(hello: &Message) -> Vec<u8> {
    let mut out = Preamble::new(ConnectionKind::Server).encode().to_vec();
    encode_frame(hello, &mut out);
    out
}

/// The client's side of a greeting: the server's preamble and `Hello`. Anything else is
/// named for what it is, so that a user pointing at the wrong port learns it.
pub fn read_greeting(
    stream: &mut impl Timed,
    deadline: Deadline,
    peer: &str,
) -> Result<Hello, Error> {
    let mut bytes = [0u8; Preamble::LEN];
    read_exact_by(stream, &mut bytes, deadline, peer, "a wanxfer greeting").map_err(
        |e| match e {
            Error::Network { ref source, .. } if source.kind() == std::io::ErrorKind::TimedOut => {
                Error::network(
                    "no wanxfer greeting from",
                    peer,
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "it accepted the connection but said nothing: is it a wanxfer server of \
                         protocol version 5 or later?",
                    ),
                )
            }
            other => other,
        },
    )?;
    match Preamble::decode(&bytes) {
        Ok(p) if p.kind == ConnectionKind::Server => {}
        Ok(_) => return Err(Error::protocol(peer, "the peer greeted like a client")),
        Err(DecodeError::BadMagic) => {
            let shown: String = String::from_utf8_lossy(&bytes)
                .chars()
                .map(|c| if c.is_control() { '.' } else { c })
                .collect();
            return Err(Error::protocol(
                peer,
                format!("not a wanxfer server (it sent \"{shown}\")"),
            ));
        }
        Err(e) => return Err(Error::decode(peer, e)),
    }
    match read_message_by(stream, deadline, peer)? {
        Message::Hello(h) => Ok(h),
        Message::Error(e) => Err(Error::remote(peer, &e)),
        _ => Err(Error::protocol(
            peer,
            "the server's greeting is not a Hello",
        )),
    }
}

/// Reads and checks the client's preamble on an accepted connection.
pub fn read_preamble(
    stream: &mut impl Timed,
    deadline: Deadline,
    peer: &str,
) -> Result<ConnectionKind, Error> {
    let mut bytes = [0u8; Preamble::LEN];
    read_exact_by(stream, &mut bytes, deadline, peer, "a preamble")?;
    Preamble::decode(&bytes)
        .map(|p| p.kind)
        .map_err(|e| Error::decode(peer, e))
}

/// Connects to `server` within what is left of `deadline`, trying each address.
pub fn connect(server: &str, deadline: Deadline, stall: Duration) -> Result<TcpStream, Error> {
    connect_then(server, deadline, stall, || {})
}

/// [`connect`], running `dialing` as soon as the first connection attempt is on its way
/// (its SYN sent), before it completes: connections opened there reach the server after
/// this one, and their handshakes overlap its own.
pub fn connect_then(
    server: &str,
    deadline: Deadline,
    stall: Duration,
    dialing: impl FnOnce(),
) -> Result<TcpStream, Error> {
    let addrs: Vec<SocketAddr> = server
        .to_socket_addrs()
        .map_err(|e| Error::network("resolving", server, e))?
        .collect();
    let mut dialing = Some(dialing);
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for addr in addrs {
        let left = deadline
            .left()
            .map_err(|()| timed_out(server, "connection"))?
            .unwrap_or(Duration::from_secs(3600));
        match dial(addr, left, &mut dialing) {
            Ok(stream) => {
                tune_socket(&stream, stall);
                return Ok(stream);
            }
            Err(e) => last = e,
        }
    }
    Err(Error::network("connecting to", server, last))
}

/// One connection attempt to `addr` within `limit`; `dialing`, if still there, runs
/// once its SYN is out.
fn dial(
    addr: SocketAddr,
    limit: Duration,
    dialing: &mut Option<impl FnOnce()>,
) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_nonblocking(true)?;
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    if let Some(dialing) = dialing.take() {
        dialing();
    }
    let end = Instant::now() + limit;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connection timed out",
            ));
        }
        let mut poll = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&socket),
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `poll` is one valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut poll, 1, ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if ready > 0 {
            break;
        }
    }
    if let Some(e) = socket.take_error()? {
        return Err(e);
    }
    socket.set_nonblocking(false)?;
    // A refused connection can still look writable: ask whether it has a peer.
    socket.peer_addr()?;
    Ok(socket.into())
}

/// Connects to `server` and, unless the session runs without encryption (`tls` is
/// `None`), runs the TLS handshake, all within `deadline`. A certificate the client
/// refuses is explained in the client's words (what changed, how to accept it).
pub fn connect_secure(
    server: &str,
    tls: Option<&crate::tls::ClientTls>,
    deadline: Deadline,
    stall: Duration,
) -> Result<Stream, Error> {
    let tcp = connect(server, deadline, stall)?;
    secure(tcp, server, tls, deadline)
}

/// The client's side of TLS (unless `tls` is `None`) on `tcp`, connected to `server`,
/// within `deadline`.
pub fn secure(
    mut tcp: std::net::TcpStream,
    server: &str,
    tls: Option<&crate::tls::ClientTls>,
    deadline: Deadline,
) -> Result<Stream, Error> {
    let Some(tls) = tls else {
        return Ok(Stream::plain(tcp));
    };
    let client = rustls::ClientConnection::new(tls.config.clone(), tls.name.clone())
        .map_err(|e| crate::tls::tls_error(server, e))?;
    let mut conn = rustls::Connection::Client(client);
    let unread = match crate::tls::drive_handshake(&mut tcp, &mut conn, deadline, server) {
        Ok(unread) => unread,
        Err(e) => {
            let refusal = tls
                .seen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .refusal
                .take();
            return Err(match refusal {
                Some(detail) => Error::Auth {
                    peer: server.to_string(),
                    detail,
                },
                None => e,
            });
        }
    };
    Stream::tls(tcp, conn, &unread).map_err(|e| crate::tls::tls_error(server, e))
}

/// Reads one framed message with whatever read timeout the stream has (a connection
/// that waits for requests sets its own idle timeout).
pub fn read_message(stream: &mut Stream, peer: &str) -> Result<Message, Error> {
    let read = |stream: &mut Stream, buf: &mut [u8]| {
        stream.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::network(
                "connection closed by",
                peer,
                std::io::Error::new(e.kind(), "the peer went away"),
            ),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                timed_out(peer, "answer")
            }
            _ => Error::network("receiving from", peer, e),
        })
    };
    let mut header = [0u8; FrameHeader::LEN];
    read(stream, &mut header)?;
    let header = FrameHeader::decode(&header).map_err(|e| Error::decode(peer, e))?;
    let mut body = vec![0u8; header.len as usize];
    read(stream, &mut body)?;
    header
        .check_body(&body)
        .map_err(|e| Error::decode(peer, e))?;
    Message::decode(header.kind, &body).map_err(|e| Error::decode(peer, e))
}

/// Sends messages on a connection that carries one request and its replies at a time
/// (remote operations), from the thread that owns it.
#[derive(Debug)]
pub struct Control {
    stream: Stream,
    pub peer: String,
    scratch: Vec<u8>,
}

impl Control {
    pub fn new(stream: &Stream, peer: String) -> Result<Control, Error> {
        let stream = stream
            .try_clone()
            .map_err(|e| Error::network("setting up connection to", &peer, e))?;
        Ok(Control {
            stream,
            peer,
            scratch: Vec::new(),
        })
    }

    pub fn send(&mut self, msg: &Message) -> Result<(), Error> {
        self.scratch.clear();
        encode_frame(msg, &mut self.scratch);
        self.stream
            .write_all(&self.scratch)
            .map_err(|e| Error::network("sending to", &self.peer, e))
    }
}

/// The session's events, as the control reader delivers them.
pub type ControlEvent = Result<Message, Error>;

/// Starts the thread that reads control messages until the stream ends, handing each
/// to `deliver` (which blocks when the session's queue is full: the peer then waits).
pub fn spawn_reader(
    stream: &Stream,
    peer: String,
    deliver: impl Fn(ControlEvent) -> bool + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, Error> {
    let mut reader = stream
        .try_clone()
        .map_err(|e| Error::network("setting up connection to", &peer, e))?;
    let _ = reader.set_read_timeout(None);
    std::thread::Builder::new()
        .name("wanxfer-ctl-in".into())
        .spawn(move || loop {
            let msg = read_message_by(&mut reader, Deadline::never(), &peer);
            let stop = msg.is_err();
            if !deliver(msg) || stop {
                return;
            }
        })
        .map_err(|e| Error::local("start thread", "control reader", e))
}

/// Frames waiting to be written, at most this many buffers.
const WRITE_QUEUE: usize = 64;

/// Sends control messages from a thread of its own, so that the session never blocks
/// on a peer that is slow to read.
#[derive(Debug)]
pub struct ControlWriter {
    queue: Option<Sender<Vec<u8>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pending: Vec<u8>,
}

impl ControlWriter {
    /// Starts the writer; a write error is delivered as a control event, as the reader's.
    pub fn start(
        stream: &Stream,
        peer: String,
        failed: impl Fn(Error) + Send + 'static,
    ) -> Result<ControlWriter, Error> {
        let mut writer = stream
            .try_clone()
            .map_err(|e| Error::network("setting up connection to", &peer, e))?;
        let _ = writer.set_write_timeout(None);
        let (tx, rx): (Sender<Vec<u8>>, Receiver<Vec<u8>>) =
            crossbeam_channel::bounded(WRITE_QUEUE);
        let who = peer;
        let thread = std::thread::Builder::new()
            .name("wanxfer-ctl-out".into())
            .spawn(move || {
                for bytes in rx {
                    if let Err(e) = writer.write_all(&bytes) {
                        failed(Error::network("sending to", &who, e));
                        return;
                    }
                }
            })
            .map_err(|e| Error::local("start thread", "control writer", e))?;
        Ok(ControlWriter {
            queue: Some(tx),
            thread: Some(thread),
            pending: Vec::new(),
        })
    }

    /// Queues a message; it goes out with the next [`ControlWriter::flush`].
    pub fn push(&mut self, msg: &Message) {
        encode_frame(msg, &mut self.pending);
    }

    /// Whether there is room to hand over more (else keep messages in the machine).
    pub fn has_room(&self) -> bool {
        self.queue.as_ref().is_some_and(|q| !q.is_full())
    }

    /// Hands what was pushed to the writer thread; `false` if its queue is full (the
    /// bytes stay and go with a later flush).
    pub fn flush(&mut self) -> bool {
        if self.pending.is_empty() {
            return true;
        }
        let Some(queue) = &self.queue else {
            return false;
        };
        match queue.try_send(std::mem::take(&mut self.pending)) {
            Ok(()) => true,
            Err(TrySendError::Full(bytes)) => {
                self.pending = bytes;
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// Sends everything pushed and waits (at most `limit`) until it is written.
    pub fn close(&mut self, limit: Duration) {
        if let (Some(queue), false) = (&self.queue, self.pending.is_empty()) {
            let _ = queue.send_timeout(std::mem::take(&mut self.pending), limit);
        }
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let deadline = Instant::now() + limit;
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
}

/// Whether the peer of `stream` runs on this host (a loopback address, or our own
/// address): its copies then share our memory, which changes what `--io auto` picks.
pub fn peer_on_this_host(stream: &Stream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

/// Whether the peer has closed `stream` (its end read, or the connection reset), looked
/// at without reading: a connection nothing is expected on while it waits.
pub fn peer_closed(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    // MSG_DONTWAIT: the socket's own mode (blocking, with timeouts) stays as it is.
    // SAFETY: recv writes at most 1 byte into `byte`, which lives through the call.
    let n = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        0 => true,
        n if n > 0 => false,
        _ => !matches!(
            std::io::Error::last_os_error().kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ),
    }
}

/// What the kernel counted on a TCP connection: bytes this side sent that the peer
/// acknowledged, and bytes it received (`TCP_INFO`'s `tcpi_bytes_acked` and
/// `tcpi_bytes_received`, whatever TLS or framing carried). `None` where the kernel does
/// not say.
pub fn tcp_bytes(stream: &TcpStream) -> Option<(u64, u64)> {
    use std::os::fd::AsRawFd;
    // SAFETY: `info` is a plain C struct that zeroed bytes make valid; getsockopt writes
    // at most `len` bytes into it, and `len` is its size.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the borrow of `stream`; pointer and length
    // describe `info` exactly.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // Kernels older than 4.2 fill in less than the two counters' end.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_received) + 8;
    (rc == 0 && len as usize >= needed).then_some((info.tcpi_bytes_acked, info.tcpi_bytes_received))
}

/// Socket settings for every wanxfer connection: no Nagle delay on small control frames,
/// and a peer that vanishes without a FIN (a cut link, a crashed host) noticed within
/// `stall`: unacknowledged data times out (`TCP_USER_TIMEOUT`) and an idle connection is
/// probed (keepalive), so that no side waits forever on a dead path.
pub fn tune_socket(stream: &TcpStream, stall: Duration) {
    let _ = stream.set_nodelay(true);
    let sock = socket2::SockRef::from(stream);
    let stall = stall.max(Duration::from_secs(2));
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(stall / 2)
        .with_interval((stall / 8).max(Duration::from_secs(1)))
        .with_retries(3);
    let _ = sock.set_tcp_keepalive(&keepalive);
    let _ = sock.set_tcp_user_timeout(Some(stall));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    #[test]
    fn a_loopback_peer_is_on_this_host() {
        let (client, server) = pair();
        assert!(
            peer_on_this_host(&Stream::plain(client)) && peer_on_this_host(&Stream::plain(server))
        );
    }

    /// The regression of issue 16 item 3: a peer trickling bytes cannot stretch a
    /// deadline, which bounds the whole exchange and not each read.
    #[test]
    fn a_trickling_peer_runs_out_of_its_deadline() {
        let (mut client, mut server) = pair();
        let trickle = std::thread::spawn(move || {
            for _ in 0..20 {
                if client.write_all(b"W").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let mut buf = [0u8; 16];
        let started = Instant::now();
        let e = read_exact_by(
            &mut server,
            &mut buf,
            Deadline::after(Duration::from_millis(200)),
            "peer",
            "a preamble",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("no a preamble in time") || e.to_string().contains("in time"),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(server);
        let _ = trickle.join();
    }

    #[test]
    fn something_else_than_a_wanxfer_server_is_named() {
        let (mut client, mut server) = pair();
        server.write_all(b"SSH-2.0-OpenSSH_9.2p1\r\n").unwrap();
        let e = read_greeting(
            &mut client,
            Deadline::after(Duration::from_secs(5)),
            "host:22",
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a wanxfer server"), "{e}");
        let (mut client, _server) = pair();
        let e = read_greeting(
            &mut client,
            Deadline::after(Duration::from_millis(100)),
            "host:80",
        )
        .unwrap_err();
        assert!(e.to_string().contains("said nothing"), "{e}");
    }
}
