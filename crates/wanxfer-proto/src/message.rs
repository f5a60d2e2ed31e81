//! Control messages and the frames that carry them.
//!
//! Frames carry their own CRC-32C even though TCP has a checksum: TCP's 16-bit sum misses
//! real corruption on long paths (and our WAN emulator produces exactly that on purpose),
//! and a corrupted path or size in a manifest would put bytes under the wrong name
//! without any digest noticing. Type codes are never reused; a retired one stays listed
//! in [`Message::decode`] as a comment.

use crate::codec::{Decoder, Encoder};
use crate::ops::{self, OpReply, OpRequest};
use crate::path::{RelPath, MAX_PATH_BYTES};
use crate::DecodeError;

/// Largest frame body accepted. Manifests are split by the sender to fit.
pub const MAX_FRAME_BODY: usize = 1 << 20;
/// Longest human-readable message in an error frame.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// Most entries in one manifest frame.
pub const MAX_MANIFEST_ENTRIES: usize = 16_384;
/// Most paths a session may name in [`OpenSession`].
pub const MAX_SESSION_PATHS: usize = 4096;
/// Most ids in one [`Message::FileAck`].
pub const MAX_ACK_IDS: usize = 16_384;
/// Most slots granted in one [`Credit`].
pub const MAX_CREDIT_GRANTS: usize = 4096;
/// Longest software identification string in [`Hello`].
pub const MAX_SOFTWARE_BYTES: usize = 64;

/// What frames start with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: u8,
    pub len: u32,
    pub crc: u32,
}

impl FrameHeader {
    pub const LEN: usize = 12;

    /// Checks the length against [`MAX_FRAME_BODY`] so that the caller can allocate the
    /// body buffer safely.
    pub fn decode(bytes: &[u8; Self::LEN]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(bytes);
        let kind = d.u8()?;
        if d.array::<3>()? != [0; 3] {
            // Reserved for later use; refusing non-zero now keeps that use possible.
            return Err(DecodeError::Invalid(
                "reserved frame header bytes are not zero",
            ));
        }
        let len = d.u32()?;
        let crc = d.u32()?;
        if len as usize > MAX_FRAME_BODY {
            return Err(DecodeError::TooLong {
                what: "frame",
                len: len as usize,
                max: MAX_FRAME_BODY,
            });
        }
        Ok(FrameHeader { kind, len, crc })
    }

    /// Verifies the body against the header's checksum.
    pub fn check_body(&self, body: &[u8]) -> Result<(), DecodeError> {
        if crc32c::crc32c(body) == self.crc {
            Ok(())
        } else {
            Err(DecodeError::Checksum { what: "frame" })
        }
    }
}

/// Appends one framed message to `out`.
pub fn encode_frame(msg: &Message, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; FrameHeader::LEN]);
    msg.encode_body(&mut Encoder::new(out));
    let body_len = out.len() - start - FrameHeader::LEN;
    assert!(
        body_len <= MAX_FRAME_BODY,
        "message builders keep frames under the limit"
    );
    let crc = crc32c::crc32c(&out[start + FrameHeader::LEN..]);
    let header = &mut out[start..start + FrameHeader::LEN];
    header[0] = msg.kind();
    header[4..8].copy_from_slice(&(body_len as u32).to_le_bytes());
    header[8..12].copy_from_slice(&crc.to_le_bytes());
}

/// Decodes a complete frame (header and body) from `bytes`, requiring nothing to trail.
pub fn decode_frame(bytes: &[u8]) -> Result<Message, DecodeError> {
    let header_bytes: &[u8; FrameHeader::LEN] = bytes
        .get(..FrameHeader::LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(DecodeError::Truncated {
            needed: FrameHeader::LEN.saturating_sub(bytes.len()),
        })?;
    let header = FrameHeader::decode(header_bytes)?;
    let body = &bytes[FrameHeader::LEN..];
    let len = header.len as usize;
    if body.len() < len {
        return Err(DecodeError::Truncated {
            needed: len - body.len(),
        });
    }
    if body.len() > len {
        return Err(DecodeError::Trailing {
            len: body.len() - len,
        });
    }
    header.check_body(body)?;
    Message::decode(header.kind, body)
}

/// Which way file data flows in a session, seen from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Direction {
    /// The client sends, the server writes.
    Push,
    /// The server sends, the client writes.
    Pull,
}

/// How data channels move blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    Tcp,
    Fabric,
}

/// Classes of failure a peer reports; the receiving side maps them to exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureClass {
    Auth,
    Protocol,
    Integrity,
    /// The reporting side's own disk or file system failed.
    Io,
    /// The request was refused: a path outside the root, missing, or not allowed.
    Refused,
    /// A local limit of the reporting side was exceeded.
    Limit,
    Internal,
}

/// Flags in [`OpenSession::flags`].
pub mod session_flags {
    /// The receiver discards data instead of writing files (memory-to-memory runs).
    pub const DISCARD: u32 = 1 << 0;
    /// The sender generates `synthetic_bytes` of data instead of reading files.
    pub const SYNTHETIC_SOURCE: u32 = 1 << 1;
    /// Without segment digests, blocks carry no payload CRC either, so nothing is checked
    /// (measuring protocol cost alone). With digests, which check every block's bytes
    /// anyway, it changes nothing.
    pub const NO_BLOCK_CHECKSUM: u32 = 1 << 2;
    /// Segments carry no digest, so files are renamed into place unverified; blocks carry
    /// a payload CRC instead unless [`NO_BLOCK_CHECKSUM`] is set too. Never the default.
    pub const NO_FILE_DIGEST: u32 = 1 << 3;

    pub const ALL: u32 = DISCARD | SYNTHETIC_SOURCE | NO_BLOCK_CHECKSUM | NO_FILE_DIGEST;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub features: u64,
    pub nonce: [u8; 32],
    pub software: Vec<u8>,
}

/// The client's request, sent once authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenSession {
    pub direction: Direction,
    pub transport: TransportKind,
    /// Push: one path, the destination. Pull: the sources to send.
    pub paths: Vec<RelPath>,
    /// Push: how many top-level sources the client will send (decides `cp -r` placement).
    pub source_count: u32,
    pub streams: u16,
    pub block_size: u32,
    pub depth: u16,
    /// Most manifest entries the sender may have announced but not seen acknowledged.
    pub window: u32,
    pub flags: u32,
    /// With [`session_flags::SYNTHETIC_SOURCE`]: how many bytes to generate.
    pub synthetic_bytes: u64,
}

/// The server's answer: the parameters both sides now use, each no larger than what the
/// client asked for nor than the server's own limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionAccepted {
    pub session_id: [u8; 16],
    pub streams: u16,
    pub block_size: u32,
    pub depth: u16,
    pub window: u32,
    pub flags: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
}

/// One file, directory or symlink of a transfer. Its id is its position in the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: EntryKind,
    pub path: RelPath,
    pub size: u64,
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    /// Symlinks only: the target, stored as-is and never followed.
    pub link_target: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub first_id: u64,
    pub entries: Vec<Entry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManifestEnd {
    pub entries: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileFailed {
    pub id: u64,
    pub class: FailureClass,
    pub offset: u64,
    pub message: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorMsg {
    pub class: FailureClass,
    pub message: Vec<u8>,
}

impl ErrorMsg {
    pub fn new(class: FailureClass, message: &str) -> Self {
        let mut message = message.as_bytes().to_vec();
        message.truncate(MAX_MESSAGE_BYTES);
        ErrorMsg { class, message }
    }
}

/// One registered receive slot the sender may write a block into (fabric transport).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotGrant {
    pub slot: u32,
    pub len: u32,
    pub addr: u64,
    pub key: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credit {
    pub channel: u16,
    pub grants: Vec<SlotGrant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelJoin {
    pub session_id: [u8; 16],
    pub index: u16,
    /// Proves knowledge of the shared secret and of this session's handshake.
    pub proof: [u8; 32],
}

/// Where a fabric (libfabric) session's data channels connect, and what the server's
/// libfabric discovery chose there; sent right after [`SessionAccepted`] when the client
/// asked for [`TransportKind::Fabric`]. The address is the control connection's, so only
/// the port travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricEndpoint {
    pub port: u16,
    pub provider: Vec<u8>,
    pub fabric: Vec<u8>,
    pub domain: Vec<u8>,
}

/// Longest provider, fabric or domain name in [`FabricEndpoint`].
pub const MAX_FABRIC_NAME_BYTES: usize = 256;

/// Longest I/O mode name or fallback reason in [`Stats`].
pub const MAX_IO_NOTE_BYTES: usize = 512;

/// A side's resource use for one session, and how it moved file bytes: an operator
/// reading the client's report should not have to log into the server to learn that it
/// wrote through the page cache, or fell back from what it was told to do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stats {
    pub cpu_user_us: u64,
    pub cpu_sys_us: u64,
    pub bytes: u64,
    pub files: u64,
    /// Sending: `sendfile`, `copy` or `zerocopy`; receiving: `direct`, `buffered` or
    /// `discard`.
    pub io_mode: Vec<u8>,
    /// Receiving: bytes written with `O_DIRECT`, bypassing the page cache.
    pub direct_bytes: u64,
    /// Why the side did less than its mode asked for; empty if it did not.
    pub io_fallback: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    Hello(Hello),
    AuthProof {
        mac: [u8; 32],
    },
    AuthOk {
        mac: [u8; 32],
    },
    Error(ErrorMsg),
    OpenSession(OpenSession),
    SessionAccepted(SessionAccepted),
    Manifest(Manifest),
    ManifestEnd(ManifestEnd),
    /// The receiver has taken in every entry with an id below `through`.
    ManifestAck {
        through: u64,
    },
    /// These files are verified and in place.
    FileAck {
        ids: Vec<u64>,
    },
    FileFailed(FileFailed),
    Credit(Credit),
    ChannelJoin(ChannelJoin),
    /// The client has everything it needs; the server answers with its [`Stats`].
    Finish,
    Stats(Stats),
    /// The server accepted a data channel; blocks may flow.
    ChannelAccepted {
        index: u16,
    },
    FabricEndpoint(FabricEndpoint),
    /// Instead of [`OpenSession`]: a remote operation (see [`crate::ops`]).
    OpRequest(OpRequest),
    OpReply(OpReply),
}

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Hello(_) => 1,
            Message::AuthProof { .. } => 2,
            Message::AuthOk { .. } => 3,
            Message::Error(_) => 4,
            Message::OpenSession(_) => 5,
            Message::SessionAccepted(_) => 6,
            Message::Manifest(_) => 7,
            Message::ManifestEnd(_) => 8,
            Message::ManifestAck { .. } => 9,
            Message::FileAck { .. } => 10,
            Message::FileFailed(_) => 11,
            Message::Credit(_) => 12,
            Message::ChannelJoin(_) => 13,
            Message::Finish => 14,
            Message::Stats(_) => 15,
            Message::ChannelAccepted { .. } => 16,
            Message::FabricEndpoint(_) => 17,
            // 18-39: reserved for the session layer's messages.
            Message::OpRequest(_) => 40,
            Message::OpReply(_) => 41,
        }
    }

    /// The frame body of this message (what [`encode_frame`] wraps).
    pub fn encode_body(&self, e: &mut Encoder) {
        match self {
            Message::Hello(h) => {
                e.u16(h.version);
                e.u64(h.features);
                e.raw(&h.nonce);
                e.bytes(&h.software);
            }
            Message::AuthProof { mac } | Message::AuthOk { mac } => e.raw(mac),
            Message::Error(m) => {
                e.u8(encode_class(m.class));
                e.bytes(&m.message);
            }
            Message::OpenSession(o) => encode_open(o, e),
            Message::SessionAccepted(a) => {
                e.raw(&a.session_id);
                e.u16(a.streams);
                e.u32(a.block_size);
                e.u16(a.depth);
                e.u32(a.window);
                e.u32(a.flags);
            }
            Message::Manifest(m) => {
                e.u64(m.first_id);
                e.u32(m.entries.len() as u32);
                for entry in &m.entries {
                    encode_entry(entry, e);
                }
            }
            Message::ManifestEnd(m) => {
                e.u64(m.entries);
                e.u64(m.bytes);
            }
            Message::ManifestAck { through } => e.u64(*through),
            Message::FileAck { ids } => {
                e.u32(ids.len() as u32);
                ids.iter().for_each(|id| e.u64(*id));
            }
            Message::FileFailed(f) => {
                e.u64(f.id);
                e.u8(encode_class(f.class));
                e.u64(f.offset);
                e.bytes(&f.message);
            }
            Message::Credit(c) => {
                e.u16(c.channel);
                e.u32(c.grants.len() as u32);
                for g in &c.grants {
                    e.u32(g.slot);
                    e.u32(g.len);
                    e.u64(g.addr);
                    e.u64(g.key);
                }
            }
            Message::ChannelJoin(j) => {
                e.raw(&j.session_id);
                e.u16(j.index);
                e.raw(&j.proof);
            }
            Message::Finish => {}
            Message::Stats(s) => {
                e.u64(s.cpu_user_us);
                e.u64(s.cpu_sys_us);
                e.u64(s.bytes);
                e.u64(s.files);
                e.bytes(&s.io_mode);
                e.u64(s.direct_bytes);
                e.bytes(&s.io_fallback);
            }
            Message::ChannelAccepted { index } => e.u16(*index),
            Message::FabricEndpoint(f) => {
                e.u16(f.port);
                e.bytes(&f.provider);
                e.bytes(&f.fabric);
                e.bytes(&f.domain);
            }
            Message::OpRequest(r) => ops::encode_request(r, e),
            Message::OpReply(r) => ops::encode_reply(r, e),
        }
    }

    /// Decodes a frame body of type `kind`, requiring that nothing trails.
    pub fn decode(kind: u8, body: &[u8]) -> Result<Message, DecodeError> {
        let mut d = Decoder::new(body);
        let msg = match kind {
            1 => Message::Hello(Hello {
                version: d.u16()?,
                features: d.u64()?,
                nonce: d.array()?,
                software: d.bytes("software name", MAX_SOFTWARE_BYTES)?.to_vec(),
            }),
            2 => Message::AuthProof { mac: d.array()? },
            3 => Message::AuthOk { mac: d.array()? },
            4 => Message::Error(ErrorMsg {
                class: decode_class(d.u8()?)?,
                message: d.bytes("error message", MAX_MESSAGE_BYTES)?.to_vec(),
            }),
            5 => Message::OpenSession(decode_open(&mut d)?),
            6 => Message::SessionAccepted(SessionAccepted {
                session_id: d.array()?,
                streams: d.u16()?,
                block_size: d.u32()?,
                depth: d.u16()?,
                window: d.u32()?,
                flags: d.u32()?,
            }),
            7 => {
                let first_id = d.u64()?;
                let n = d.count("manifest entries", MAX_MANIFEST_ENTRIES, ENTRY_MIN_LEN)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    entries.push(decode_entry(&mut d)?);
                }
                Message::Manifest(Manifest { first_id, entries })
            }
            8 => Message::ManifestEnd(ManifestEnd {
                entries: d.u64()?,
                bytes: d.u64()?,
            }),
            9 => Message::ManifestAck { through: d.u64()? },
            10 => {
                let n = d.count("acknowledged ids", MAX_ACK_IDS, 8)?;
                let ids = (0..n).map(|_| d.u64()).collect::<Result<_, _>>()?;
                Message::FileAck { ids }
            }
            11 => Message::FileFailed(FileFailed {
                id: d.u64()?,
                class: decode_class(d.u8()?)?,
                offset: d.u64()?,
                message: d.bytes("error message", MAX_MESSAGE_BYTES)?.to_vec(),
            }),
            12 => {
                let channel = d.u16()?;
                let n = d.count("credit grants", MAX_CREDIT_GRANTS, 24)?;
                let grants = (0..n)
                    .map(|_| {
                        Ok(SlotGrant {
                            slot: d.u32()?,
                            len: d.u32()?,
                            addr: d.u64()?,
                            key: d.u64()?,
                        })
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Message::Credit(Credit { channel, grants })
            }
            13 => Message::ChannelJoin(ChannelJoin {
                session_id: d.array()?,
                index: d.u16()?,
                proof: d.array()?,
            }),
            14 => Message::Finish,
            15 => Message::Stats(Stats {
                cpu_user_us: d.u64()?,
                cpu_sys_us: d.u64()?,
                bytes: d.u64()?,
                files: d.u64()?,
                io_mode: d.bytes("I/O mode", MAX_IO_NOTE_BYTES)?.to_vec(),
                direct_bytes: d.u64()?,
                io_fallback: d.bytes("I/O fallback", MAX_IO_NOTE_BYTES)?.to_vec(),
            }),
            16 => Message::ChannelAccepted { index: d.u16()? },
            17 => Message::FabricEndpoint(FabricEndpoint {
                port: d.u16()?,
                provider: d.bytes("provider", MAX_FABRIC_NAME_BYTES)?.to_vec(),
                fabric: d.bytes("fabric", MAX_FABRIC_NAME_BYTES)?.to_vec(),
                domain: d.bytes("domain", MAX_FABRIC_NAME_BYTES)?.to_vec(),
            }),
            40 => Message::OpRequest(ops::decode_request(&mut d)?),
            41 => Message::OpReply(ops::decode_reply(&mut d)?),
            other => {
                return Err(DecodeError::Unknown {
                    what: "message type",
                    value: other.into(),
                })
            }
        };
        d.finish()?;
        Ok(msg)
    }
}

/// Smallest encoding of an [`Entry`]: kind, empty path, size, mode, mtime, empty target.
const ENTRY_MIN_LEN: usize = 1 + 4 + 8 + 4 + 8 + 4 + 4;

fn encode_open(o: &OpenSession, e: &mut Encoder) {
    e.u8(match o.direction {
        Direction::Push => 0,
        Direction::Pull => 1,
    });
    e.u8(match o.transport {
        TransportKind::Tcp => 0,
        TransportKind::Fabric => 1,
    });
    e.u32(o.paths.len() as u32);
    o.paths.iter().for_each(|p| e.bytes(p.as_bytes()));
    e.u32(o.source_count);
    e.u16(o.streams);
    e.u32(o.block_size);
    e.u16(o.depth);
    e.u32(o.window);
    e.u32(o.flags);
    e.u64(o.synthetic_bytes);
}

fn decode_open(d: &mut Decoder) -> Result<OpenSession, DecodeError> {
    let direction = match d.u8()? {
        0 => Direction::Push,
        1 => Direction::Pull,
        v => {
            return Err(DecodeError::Unknown {
                what: "direction",
                value: v.into(),
            })
        }
    };
    let transport = match d.u8()? {
        0 => TransportKind::Tcp,
        1 => TransportKind::Fabric,
        v => {
            return Err(DecodeError::Unknown {
                what: "transport",
                value: v.into(),
            })
        }
    };
    let n = d.count("session paths", MAX_SESSION_PATHS, 4)?;
    let paths = (0..n)
        .map(|_| decode_path(d))
        .collect::<Result<_, DecodeError>>()?;
    let open = OpenSession {
        direction,
        transport,
        paths,
        source_count: d.u32()?,
        streams: d.u16()?,
        block_size: d.u32()?,
        depth: d.u16()?,
        window: d.u32()?,
        flags: d.u32()?,
        synthetic_bytes: d.u64()?,
    };
    if open.flags & !session_flags::ALL != 0 {
        return Err(DecodeError::Unknown {
            what: "session flags",
            value: open.flags.into(),
        });
    }
    Ok(open)
}

fn encode_entry(entry: &Entry, e: &mut Encoder) {
    e.u8(match entry.kind {
        EntryKind::File => 0,
        EntryKind::Dir => 1,
        EntryKind::Symlink => 2,
    });
    e.bytes(entry.path.as_bytes());
    e.u64(entry.size);
    e.u32(entry.mode);
    e.i64(entry.mtime_sec);
    e.u32(entry.mtime_nsec);
    e.bytes(&entry.link_target);
}

fn decode_entry(d: &mut Decoder) -> Result<Entry, DecodeError> {
    let kind = match d.u8()? {
        0 => EntryKind::File,
        1 => EntryKind::Dir,
        2 => EntryKind::Symlink,
        v => {
            return Err(DecodeError::Unknown {
                what: "entry kind",
                value: v.into(),
            })
        }
    };
    let path = decode_path(d)?;
    let entry = Entry {
        kind,
        path,
        size: d.u64()?,
        mode: d.u32()?,
        mtime_sec: d.i64()?,
        mtime_nsec: d.u32()?,
        link_target: d.bytes("symlink target", MAX_PATH_BYTES)?.to_vec(),
    };
    if entry.mtime_nsec >= 1_000_000_000 {
        return Err(DecodeError::Invalid("mtime nanoseconds out of range"));
    }
    if entry.kind != EntryKind::Symlink && !entry.link_target.is_empty() {
        return Err(DecodeError::Invalid("only symlinks have a target"));
    }
    if entry.kind == EntryKind::Symlink && entry.link_target.contains(&0) {
        return Err(DecodeError::Invalid("symlink target contains NUL"));
    }
    Ok(entry)
}

pub(crate) fn encode_class(class: FailureClass) -> u8 {
    match class {
        FailureClass::Auth => 1,
        FailureClass::Protocol => 2,
        FailureClass::Integrity => 3,
        FailureClass::Io => 4,
        FailureClass::Refused => 5,
        FailureClass::Limit => 6,
        FailureClass::Internal => 7,
    }
}

pub(crate) fn decode_class(v: u8) -> Result<FailureClass, DecodeError> {
    Ok(match v {
        1 => FailureClass::Auth,
        2 => FailureClass::Protocol,
        3 => FailureClass::Integrity,
        4 => FailureClass::Io,
        5 => FailureClass::Refused,
        6 => FailureClass::Limit,
        7 => FailureClass::Internal,
        other => {
            return Err(DecodeError::Unknown {
                what: "failure class",
                value: other.into(),
            })
        }
    })
}

/// A path from the peer, refused with the offending bytes shown so that the error names
/// the entry (escaped, since the bytes are hostile by assumption).
pub(crate) fn decode_path(d: &mut Decoder) -> Result<RelPath, DecodeError> {
    let bytes = d.bytes("path", MAX_PATH_BYTES)?;
    RelPath::new(bytes).map_err(|reason| DecodeError::BadPath {
        path: bytes.escape_ascii().to_string(),
        reason,
    })
}
