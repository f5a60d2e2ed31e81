//! TLS 1.3 records on a data channel, sealed and opened by wanxfer itself once rustls has
//! made the handshake, so that no byte of a block is copied more than the cipher needs.
//!
//! Through rustls's buffered connection the receiver copied every byte three more times
//! (socket bytes into its deframer 4 KiB at a time, each record's plaintext into a fresh
//! `Vec`, that into the caller's buffer) and the sender once (sealed records out of its
//! queue): a third of the CPU of an encrypted transfer here. This layer takes over with
//! the keys, IVs and sequence numbers rustls negotiated (`dangerous_extract_secrets`,
//! as for kernel TLS) and seals with the same AEAD (aws-lc-rs). The sender seals a
//! block's payload where the reader put it, in its pool buffer, and writes the records'
//! headers, ciphertexts and tags with one `writev` per 16 records; the receiver reads the
//! socket 256 KiB at a time into a buffer of its own and opens each record straight into
//! the block's buffer. Each byte is then copied once by the kernel and passed over once
//! by the cipher on each side, which is what `examples/tls_floor.rs` measures as the
//! floor. (aws-lc-rs, not ring: ring can neither open into another buffer nor seal the
//! record's content-type byte apart from the content, and without those one side or
//! the other needs a copy.)
//!
//! The records are TLS 1.3's (RFC 8446 section 5): the peer may be this layer, rustls or
//! the kernel's TLS, and any of them reads what the others write. The receiver takes any
//! record boundaries; only records it opens whole into the caller's buffer avoid the
//! copy, which is every record of a block's payload but the last when the sender is
//! wanxfer (its records never straddle a block).
//!
//! What this layer does not do: key updates, and so neither does a sending side reach
//! the cipher's confidentiality limit (2^24 records for AES-GCM, 256 GiB at 16 KiB): it
//! stops there with an error, the session drops the channel and opens another with a
//! fresh handshake, as for any channel that dies; a `KeyUpdate` from the peer is refused
//! (rustls can compute the next secrets only for connections driven through its
//! unbuffered API). Session tickets: none are issued (`tls.rs`), so any post-handshake
//! handshake message is refused. The control connection stays with rustls: its frames
//! are small and it is read and written by different threads.

use std::io::{self, IoSlice, Write};
use std::net::TcpStream;

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::ConnectionTrafficSecrets;

use crate::tls::read_socket;

/// The most content a record carries (TLS's limit, 2^14).
pub const MAX_CONTENT: usize = 1 << 14;
/// The most a record's encrypted part may be: content, type, padding and tag.
const MAX_ENCRYPTED: usize = MAX_CONTENT + 256;
const HEADER: usize = 5;
const TAG: usize = 16;
const APPLICATION_DATA: u8 = 23;
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
/// Records sealed, then written with one `writev`: 256 KiB, still in L2 when the kernel
/// copies it.
const RECORDS_PER_WRITE: usize = 16;
/// Socket bytes read at a time on the receiving side.
const READ_BYTES: usize = 256 << 10;
/// Empty records in a row a peer may send before it is refused (rustls allows 32).
const MAX_EMPTY_RECORDS: u32 = 32;

/// One direction's key and where its sequence stands.
struct Keys {
    key: LessSafeKey,
    iv: [u8; 12],
    sequence: u64,
    /// Records this key may seal or open (the suite's confidentiality limit).
    limit: u64,
}

impl Keys {
    fn new(sequence: u64, secrets: &ConnectionTrafficSecrets, limit: u64) -> io::Result<Keys> {
        let (algorithm, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (&aead::CHACHA20_POLY1305, key, iv)
            }
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a TLS cipher suite wanxfer cannot seal records of",
                ))
            }
        };
        let key = UnboundKey::new(algorithm, key.as_ref())
            .map_err(|_| io::Error::other("a TLS key of the wrong length"))?;
        let iv = iv
            .as_ref()
            .try_into()
            .map_err(|_| io::Error::other("a TLS IV of the wrong length"))?;
        Ok(Keys {
            key: LessSafeKey::new(key),
            iv,
            sequence,
            limit,
        })
    }

    /// The next record's nonce: the IV XOR its sequence number (RFC 8446 section 5.3).
    fn next_nonce(&mut self) -> io::Result<Nonce> {
        if self.sequence >= self.limit {
            return Err(io::Error::other(format!(
                "this data channel's key has protected {} records, as many as its cipher \
                 allows without a key update; the channel ends and another replaces it",
                self.sequence
            )));
        }
        let mut nonce = self.iv;
        for (n, s) in nonce[4..].iter_mut().zip(self.sequence.to_be_bytes()) {
            *n ^= s;
        }
        self.sequence += 1;
        Ok(Nonce::assume_unique_for_key(nonce))
    }
}

/// The header of a record whose encrypted part is `encrypted` bytes long: it is also the
/// additional data the AEAD authenticates.
fn header(encrypted: usize) -> [u8; HEADER] {
    let [hi, lo] = (encrypted as u16).to_be_bytes();
    [APPLICATION_DATA, 3, 3, hi, lo]
}

/// The sending half: seals and writes records.
pub struct Sealer {
    keys: Keys,
    /// Records of bytes that are not sealed in place (`write`), laid out as they go out.
    scratch: Vec<u8>,
}

impl Sealer {
    /// From the secrets rustls handed over: the next sequence number and the keys.
    pub fn new(
        sequence: u64,
        secrets: &ConnectionTrafficSecrets,
        limit: u64,
    ) -> io::Result<Sealer> {
        Ok(Sealer {
            keys: Keys::new(sequence, secrets, limit)?,
            scratch: Vec::new(),
        })
    }

    /// Seals `content` of type `kind` as one record at the end of `scratch`.
    fn seal_into_scratch(&mut self, kind: u8, content: &[u8]) -> io::Result<()> {
        debug_assert!(content.len() <= MAX_CONTENT);
        let encrypted = content.len() + 1 + TAG;
        let at = self.scratch.len();
        self.scratch.extend_from_slice(&header(encrypted));
        self.scratch.extend_from_slice(content);
        self.scratch.push(kind);
        let nonce = self.keys.next_nonce()?;
        let (aad, body) = self.scratch[at..].split_at_mut(HEADER);
        let tag = self
            .keys
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(&aad[..]), body)
            .map_err(|_| io::Error::other("sealing a TLS record failed"))?;
        self.scratch.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Seals `data` (copying it into records of its own) and writes it.
    pub fn write(&mut self, tcp: &TcpStream, data: &[u8]) -> io::Result<()> {
        for group in data.chunks(MAX_CONTENT * RECORDS_PER_WRITE) {
            self.scratch.clear();
            for content in group.chunks(MAX_CONTENT) {
                self.seal_into_scratch(APPLICATION_DATA, content)?;
            }
            write_all_vectored(tcp, &mut [IoSlice::new(&self.scratch)])?;
        }
        Ok(())
    }

    /// Writes `prefix` (a block's header and segment table, copied into a record of its
    /// own) then `payload`, which is sealed where it lies: afterwards it holds ciphertext.
    /// Every byte of the payload is passed over once, by the cipher.
    pub fn write_in_place(
        &mut self,
        tcp: &TcpStream,
        prefix: &[u8],
        payload: &mut [u8],
    ) -> io::Result<()> {
        self.scratch.clear();
        for content in prefix.chunks(MAX_CONTENT) {
            self.seal_into_scratch(APPLICATION_DATA, content)?;
        }
        let mut first = true;
        for group in payload.chunks_mut(MAX_CONTENT * RECORDS_PER_WRITE) {
            let mut headers = [[0u8; HEADER]; RECORDS_PER_WRITE];
            let mut trailers = [[0u8; 1 + TAG]; RECORDS_PER_WRITE];
            let records = group.len().div_ceil(MAX_CONTENT);
            for ((content, head), trailer) in group
                .chunks_mut(MAX_CONTENT)
                .zip(&mut headers)
                .zip(&mut trailers)
            {
                *head = header(content.len() + 1 + TAG);
                let nonce = self.keys.next_nonce()?;
                // The content is sealed in place; its type byte, which TLS 1.3 encrypts
                // after it, is sealed into the trailer with the tag.
                self.keys
                    .key
                    .seal_in_place_scatter(
                        nonce,
                        Aad::from(&head[..]),
                        content,
                        &[APPLICATION_DATA],
                        &mut trailer[..],
                    )
                    .map_err(|_| io::Error::other("sealing a TLS record failed"))?;
            }
            let mut slices = [IoSlice::new(&[]); 1 + 3 * RECORDS_PER_WRITE];
            let mut used = 0;
            if first && !self.scratch.is_empty() {
                slices[0] = IoSlice::new(&self.scratch);
                used = 1;
            }
            first = false;
            for (i, content) in group.chunks(MAX_CONTENT).enumerate().take(records) {
                slices[used] = IoSlice::new(&headers[i]);
                slices[used + 1] = IoSlice::new(content);
                slices[used + 2] = IoSlice::new(&trailers[i]);
                used += 3;
            }
            write_all_vectored(tcp, &mut slices[..used])?;
        }
        if first && !self.scratch.is_empty() {
            write_all_vectored(tcp, &mut [IoSlice::new(&self.scratch)])?;
        }
        Ok(())
    }

    /// Sends `close_notify`: the peer can then tell the end from a cut.
    pub fn close_notify(&mut self, tcp: &TcpStream) -> io::Result<()> {
        self.scratch.clear();
        // Level warning, description close_notify.
        self.seal_into_scratch(ALERT, &[1, 0])?;
        write_all_vectored(tcp, &mut [IoSlice::new(&self.scratch)])
    }
}

/// The receiving half: reads the socket in large pieces and opens records, into the
/// caller's buffer where a record fits there whole.
pub struct Opener {
    keys: Keys,
    /// Socket bytes; records not yet opened are `buf[start..end]`.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Plaintext opened in place in `buf` and not yet taken (a record that did not fit
    /// the caller's buffer), or handed over from rustls.
    plain: Vec<u8>,
    plain_at: usize,
    in_place: std::ops::Range<usize>,
    /// `close_notify` arrived: the stream ended cleanly.
    closed: bool,
    empty_records: u32,
}

/// What one opened record was.
enum Opened {
    /// `n` bytes of application data.
    Data(usize),
    /// The peer's `close_notify`.
    Closed,
}

impl Opener {
    /// From the secrets rustls handed over, with what it had read but not handed out:
    /// `plaintext` it had opened, then `raw` socket bytes of records it had not seen.
    pub fn new(
        sequence: u64,
        secrets: &ConnectionTrafficSecrets,
        limit: u64,
        plaintext: Vec<u8>,
        raw: &[u8],
    ) -> io::Result<Opener> {
        let mut buf = vec![0u8; (READ_BYTES + HEADER + MAX_ENCRYPTED).max(raw.len())];
        buf[..raw.len()].copy_from_slice(raw);
        Ok(Opener {
            keys: Keys::new(sequence, secrets, limit)?,
            buf,
            start: 0,
            end: raw.len(),
            plain: plaintext,
            plain_at: 0,
            in_place: 0..0,
            closed: false,
            empty_records: 0,
        })
    }

    /// The peer's `close_notify` came before the hand-over: after what was handed over,
    /// the stream ends.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// Reads plaintext into `out` (not empty): `Ok(0)` only after `close_notify`; a
    /// connection that ends without one, or a record that fails its tag, is an error.
    /// `Interrupted` when socket bytes came but not a whole record (the caller retries).
    pub fn read(&mut self, tcp: &TcpStream, out: &mut [u8]) -> io::Result<usize> {
        for read_socket_first in [false, true] {
            if let Some(n) = self.take_opened(out) {
                return Ok(n);
            }
            if self.closed {
                return Ok(0);
            }
            if read_socket_first {
                self.fill(tcp)?;
            }
            let got = self.open_available(out)?;
            if got > 0 {
                return Ok(got);
            }
        }
        match self.take_opened(out) {
            Some(n) => Ok(n),
            None if self.closed => Ok(0),
            None => Err(io::ErrorKind::Interrupted.into()),
        }
    }

    /// Plaintext opened earlier and not yet taken, if any, into `out`.
    fn take_opened(&mut self, out: &mut [u8]) -> Option<usize> {
        if self.plain_at < self.plain.len() {
            let n = out.len().min(self.plain.len() - self.plain_at);
            out[..n].copy_from_slice(&self.plain[self.plain_at..self.plain_at + n]);
            self.plain_at += n;
            return Some(n);
        }
        if !self.in_place.is_empty() {
            let n = out.len().min(self.in_place.len());
            let from = self.in_place.start;
            out[..n].copy_from_slice(&self.buf[from..from + n]);
            self.in_place.start += n;
            return Some(n);
        }
        None
    }

    /// Opens the whole records in the buffer, each straight into `out` while one fits
    /// there; stops at the first that does not (opening it in place if `out` has nothing
    /// yet), or at `close_notify`. Bytes put in `out`.
    fn open_available(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut got = 0;
        while let Some(encrypted) = self.next_record()? {
            let body = self.start + HEADER..self.start + HEADER + encrypted;
            let inner = encrypted - TAG;
            let opened = if out.len() - got >= inner {
                let nonce = self.keys.next_nonce()?;
                let (ct, tag) = self.buf[body.clone()].split_at(inner);
                let aad = &self.buf[self.start..self.start + HEADER];
                let dest = &mut out[got..got + inner];
                self.keys
                    .key
                    .open_separate_gather(nonce, Aad::from(aad), ct, tag, dest)
                    .map_err(|_| bad_record())?;
                self.start = body.end;
                let opened = settle_record(dest, &mut self.empty_records)?;
                if let Opened::Data(n) = opened {
                    got += n;
                }
                opened
            } else if got > 0 {
                break;
            } else {
                let nonce = self.keys.next_nonce()?;
                let (aad, rest) = self.buf[self.start..body.end].split_at_mut(HEADER);
                let plain = self
                    .keys
                    .key
                    .open_in_place(nonce, Aad::from(&aad[..]), rest)
                    .map_err(|_| bad_record())?;
                let opened = settle_record(plain, &mut self.empty_records)?;
                if let Opened::Data(n) = opened {
                    self.in_place = body.start..body.start + n;
                }
                self.start = body.end;
                opened
            };
            match opened {
                Opened::Closed => {
                    self.closed = true;
                    break;
                }
                Opened::Data(_) if !self.in_place.is_empty() => break,
                Opened::Data(_) => {}
            }
        }
        Ok(got)
    }

    /// The encrypted length of the next record if the buffer holds all of it.
    fn next_record(&self) -> io::Result<Option<usize>> {
        let have = &self.buf[self.start..self.end];
        if have.len() < HEADER {
            return Ok(None);
        }
        if have[0] != APPLICATION_DATA {
            return Err(protocol(format!(
                "a TLS record of type {} after the handshake (only encrypted records may \
                 follow it)",
                have[0]
            )));
        }
        let encrypted = u16::from_be_bytes([have[3], have[4]]) as usize;
        if !(TAG + 1..=MAX_ENCRYPTED).contains(&encrypted) {
            return Err(protocol(format!(
                "a TLS record of {encrypted} encrypted bytes (at most {MAX_ENCRYPTED})"
            )));
        }
        Ok((have.len() >= HEADER + encrypted).then_some(encrypted))
    }

    /// Reads more socket bytes, after moving a partial record to the front if the
    /// buffer has no room for a whole one behind it.
    fn fill(&mut self, tcp: &TcpStream) -> io::Result<()> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.start < HEADER + MAX_ENCRYPTED || self.end == self.buf.len()
        {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = read_socket(tcp, &mut self.buf[self.end..])?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the data channel without a TLS close_notify (cut short \
                 on the path?)",
            ));
        }
        self.end += n;
        Ok(())
    }
}

/// What a record's inner plaintext (content, type, zero padding) holds.
fn settle_record(inner: &[u8], empty_records: &mut u32) -> io::Result<Opened> {
    let Some(type_at) = inner.iter().rposition(|&b| b != 0) else {
        return Err(protocol("a TLS record without a content type".into()));
    };
    let content = &inner[..type_at];
    if content.len() > MAX_CONTENT {
        return Err(protocol("a TLS record with too much content".into()));
    }
    match inner[type_at] {
        APPLICATION_DATA => {
            if content.is_empty() {
                *empty_records += 1;
                if *empty_records > MAX_EMPTY_RECORDS {
                    return Err(protocol("too many empty TLS records in a row".into()));
                }
            } else {
                *empty_records = 0;
            }
            Ok(Opened::Data(content.len()))
        }
        ALERT => match content {
            [_, 0] => Ok(Opened::Closed),
            [_, description] => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!("the peer sent TLS alert {description} on a data channel"),
            )),
            _ => Err(protocol("a malformed TLS alert".into())),
        },
        HANDSHAKE if content.first() == Some(&24) => Err(protocol(
            "the peer updated its TLS keys on a data channel, which wanxfer does not do \
             (a channel ends before its key wears out)"
                .into(),
        )),
        HANDSHAKE => Err(protocol(
            "a TLS handshake message after the handshake on a data channel".into(),
        )),
        other => Err(protocol(format!("a TLS record of inner type {other}"))),
    }
}

fn bad_record() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "a TLS record failed authentication (bad_record_mac): the data channel was altered \
         on the path",
    )
}

fn protocol(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {what}"))
}

fn write_all_vectored(mut tcp: &TcpStream, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match tcp.write_vectored(slices) {
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
    use std::time::Duration;

    use rustls::crypto::cipher::{AeadKey, Iv};

    use crate::stream::Stream;
    use crate::tls::{ClientTls, Deadline, ServerIdentity, Trust};

    /// A client and a server that made a real rustls handshake over loopback; the server
    /// queued `greeting` in its first flight, as wanxfer's does.
    fn tls_pair(greeting: &[u8]) -> (Stream, Stream) {
        let identity = ServerIdentity::ephemeral().unwrap();
        let config = identity.server_config().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let greeting = greeting.to_vec();
        let server = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            let deadline = Deadline::after(Duration::from_secs(10));
            crate::tls::accept(tcp, &config, &greeting, deadline, "test").unwrap()
        });
        let tls = ClientTls::new(&addr, &Trust::Exact(identity.fingerprint.clone())).unwrap();
        let tcp = TcpStream::connect(&addr).unwrap();
        let client =
            crate::tls::connect_over(tcp, &addr, Some(&tls), Duration::from_secs(10)).unwrap();
        (client, server.join().unwrap())
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8)
            .collect()
    }

    /// Reads until the clean end, with reads of `piece` bytes at most.
    fn read_to_end(stream: &Stream, piece: usize) -> io::Result<Vec<u8>> {
        let mut got = Vec::new();
        let mut buf = vec![0u8; piece];
        loop {
            match (&*stream).read(&mut buf) {
                Ok(0) => return Ok(got),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Records sealed here are TLS 1.3's: rustls on the other end reads them, and this
    /// layer reads what rustls seals, whatever the sizes of writes and reads; the
    /// plaintext rustls had opened before the hand-over (the server's greeting, which
    /// rides in its first flight) is not lost; each side's close_notify is the other's
    /// clean end; the exporter binding survives the hand-over.
    #[test]
    fn records_interoperate_with_rustls_both_ways() {
        for (piece, block) in [(1, 100), (16 << 10, 16 << 10), (64 << 10, (1 << 20) + 7)] {
            let (client, server) = tls_pair(b"greeting");
            let binding = client.binding();
            let client = client.own_records().unwrap();
            assert_eq!(client.protection().offload, "wanxfer");
            assert_eq!(client.binding(), binding);
            let mut greeting = [0u8; 8];
            (&client).read_exact(&mut greeting).unwrap();
            assert_eq!(&greeting, b"greeting");

            let header = pattern(88, 1);
            let payload = pattern(block, 2);
            let small = pattern(block / 3 + 1, 3);
            let writer = std::thread::spawn(move || {
                let mut sealed = payload.clone();
                client.write_block(&header, &mut sealed).unwrap();
                assert_ne!(sealed, payload, "the payload was sealed in place");
                (&client).write_all(&small).unwrap();
                client.finish_writes().unwrap();
                client
            });
            let got = read_to_end(&server, piece).unwrap();
            let client = writer.join().unwrap();
            let expected = [pattern(88, 1), pattern(block, 2), pattern(block / 3 + 1, 3)].concat();
            assert!(got == expected, "rustls read what was sealed here");

            let back = pattern(block * 2 + 5, 4);
            let writer = std::thread::spawn(move || {
                (&server).write_all(&back).unwrap();
                server.finish_writes().unwrap();
            });
            assert!(read_to_end(&client, piece).unwrap() == pattern(block * 2 + 5, 4));
            writer.join().unwrap();
        }
    }

    fn keys() -> ConnectionTrafficSecrets {
        ConnectionTrafficSecrets::Aes256Gcm {
            key: AeadKey::from([7u8; 32]),
            iv: Iv::from([9u8; 12]),
        }
    }

    fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    /// What `sealer` wrote on the wire, and an opener of it with the bytes changed by
    /// `alter` arriving on a socket that then ends.
    fn opened_after(
        alter: impl FnOnce(&mut Vec<u8>),
        write: impl FnOnce(&mut Sealer, &TcpStream),
    ) -> io::Result<Vec<u8>> {
        let (a, mut b) = socket_pair();
        let mut sealer = Sealer::new(0, &keys(), u64::MAX).unwrap();
        write(&mut sealer, &a);
        drop(a);
        let mut wire = Vec::new();
        b.read_to_end(&mut wire).unwrap();
        alter(&mut wire);
        let (mut c, d) = socket_pair();
        c.write_all(&wire).unwrap();
        drop(c);
        let mut opener = Opener::new(0, &keys(), u64::MAX, Vec::new(), &[]).unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; 100_000];
        loop {
            match opener.read(&d, &mut buf) {
                Ok(0) => return Ok(got),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// One flipped bit anywhere (header, ciphertext, the type byte, the tag) fails the
    /// record; records dropped, repeated or swapped fail on their sequence number; an
    /// end without close_notify is a cut, not an end; a key update is refused by name.
    #[test]
    fn tampering_truncation_and_key_updates_are_refused() {
        let payload = pattern(40_000, 5);
        let send = |s: &mut Sealer, tcp: &TcpStream| {
            s.write_in_place(tcp, b"head", &mut payload.clone())
                .unwrap();
            s.close_notify(tcp).unwrap();
        };
        let intact = opened_after(|_| {}, send).unwrap();
        assert!(intact == [b"head".as_slice(), &payload].concat());

        let record = HEADER + 4 + 1 + TAG;
        for at in [
            2,
            record + 3,
            record + 100,
            record + HEADER + MAX_CONTENT,
            record + HEADER + MAX_CONTENT + 1,
        ] {
            let e = opened_after(|w| w[at] ^= 1, send).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "byte {at}: {e}");
        }
        // The first payload record dropped: the next one opens under the wrong number.
        let e = opened_after(
            |w| drop(w.drain(record..record + HEADER + MAX_CONTENT + 1 + TAG)),
            send,
        )
        .unwrap_err();
        assert!(e.to_string().contains("bad_record_mac"), "{e}");
        // Cut short: no close_notify.
        let e = opened_after(|w| w.truncate(w.len() - (HEADER + 3 + TAG)), send).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        assert!(e.to_string().contains("close_notify"), "{e}");

        let update = |s: &mut Sealer, tcp: &TcpStream| {
            s.scratch.clear();
            s.seal_into_scratch(HANDSHAKE, &[24, 0, 0, 1, 0]).unwrap();
            (&*tcp).write_all(&s.scratch).unwrap();
        };
        let e = opened_after(|_| {}, update).unwrap_err();
        assert!(e.to_string().contains("updated its TLS keys"), "{e}");
    }

    /// A sender stops at its key's limit instead of sealing past it.
    #[test]
    fn a_sender_stops_at_the_confidentiality_limit() {
        let (a, _b) = socket_pair();
        let mut sealer = Sealer::new(0, &keys(), 3).unwrap();
        sealer.write(&a, &[1u8; 3 * MAX_CONTENT]).unwrap();
        let e = sealer.write(&a, b"one more").unwrap_err();
        assert!(e.to_string().contains("key update"), "{e}");
    }
}
