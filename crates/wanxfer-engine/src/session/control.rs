//! The control connection: framed messages over a TCP stream.
//!
//! Writes happen only from a session's main thread, so they need no lock; reads move to a
//! thread of their own once the handshake is over, feeding a queue the main loop selects
//! on together with its workers' events.

use std::io::{BufWriter, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use wanxfer_proto::{encode_frame, ConnectionKind, FrameHeader, Message, Preamble};

use crate::Error;

/// Control messages (or the error that ended the stream) as the reader thread delivers them.
pub type Incoming = Receiver<Result<Message, Error>>;

/// Sends messages on a control connection.
#[derive(Debug)]
pub struct Control {
    writer: BufWriter<TcpStream>,
    pub peer: String,
    scratch: Vec<u8>,
}

impl Control {
    pub fn new(stream: &TcpStream, peer: String) -> Result<Control, Error> {
        let clone = stream
            .try_clone()
            .map_err(|e| Error::network("setting up connection to", &peer, e))?;
        Ok(Control {
            writer: BufWriter::new(clone),
            peer,
            scratch: Vec::new(),
        })
    }

    pub fn send(&mut self, msg: &Message) -> Result<(), Error> {
        self.scratch.clear();
        encode_frame(msg, &mut self.scratch);
        self.writer
            .write_all(&self.scratch)
            .and_then(|()| self.writer.flush())
            .map_err(|e| Error::network("sending to", &self.peer, e))
    }
}

/// Reads one framed message, refusing oversized or corrupted frames before allocating.
pub fn read_message(stream: &mut impl Read, peer: &str) -> Result<Message, Error> {
    let mut header = [0u8; FrameHeader::LEN];
    read_exact(stream, &mut header, peer)?;
    let header = FrameHeader::decode(&header).map_err(|e| Error::decode(peer, e))?;
    let mut body = vec![0u8; header.len as usize];
    read_exact(stream, &mut body, peer)?;
    header
        .check_body(&body)
        .map_err(|e| Error::decode(peer, e))?;
    Message::decode(header.kind, &body).map_err(|e| Error::decode(peer, e))
}

fn read_exact(stream: &mut impl Read, buf: &mut [u8], peer: &str) -> Result<(), Error> {
    stream.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Error::network(
            "connection closed by",
            peer,
            std::io::Error::new(e.kind(), "the peer went away"),
        ),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::network(
            "timed out waiting for",
            peer,
            std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time"),
        ),
        _ => Error::network("receiving from", peer, e),
    })
}

/// Writes the preamble that opens every connection.
pub fn send_preamble(
    stream: &mut TcpStream,
    kind: ConnectionKind,
    peer: &str,
) -> Result<(), Error> {
    stream
        .write_all(&Preamble::new(kind).encode())
        .map_err(|e| Error::network("connecting to", peer, e))
}

/// Reads and checks the preamble of an incoming connection.
pub fn read_preamble(stream: &mut TcpStream, peer: &str) -> Result<ConnectionKind, Error> {
    let mut bytes = [0u8; Preamble::LEN];
    read_exact(stream, &mut bytes, peer)?;
    Preamble::decode(&bytes)
        .map(|p| p.kind)
        .map_err(|e| Error::decode(peer, e))
}

/// Starts the thread that reads control messages into a queue until the stream ends.
pub fn spawn_reader(
    stream: &TcpStream,
    peer: String,
) -> Result<(Incoming, std::thread::JoinHandle<()>), Error> {
    let mut reader = stream
        .try_clone()
        .map_err(|e| Error::network("setting up connection to", &peer, e))?;
    let (tx, rx): (Sender<_>, _) = crossbeam_channel::unbounded();
    let handle = std::thread::Builder::new()
        .name("wanxfer-control".into())
        .spawn(move || loop {
            let msg = read_message(&mut reader, &peer);
            let stop = msg.is_err();
            if tx.send(msg).is_err() || stop {
                return;
            }
        })
        .map_err(|e| Error::local("start thread", "control reader", e))?;
    Ok((rx, handle))
}

/// Whether the peer of `stream` runs on this host (a loopback address, or our own
/// address): its copies then share our memory, which changes what `--io auto` picks.
pub fn peer_on_this_host(stream: &TcpStream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
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

    #[test]
    fn a_loopback_peer_is_on_this_host() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert!(peer_on_this_host(&client) && peer_on_this_host(&server));
    }
}
