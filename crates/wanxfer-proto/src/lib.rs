//! wanxfer's wire protocol, with no I/O.
//!
//! A session is one control connection plus any number of data channels. Every
//! connection starts with a [`Preamble`] from each side: the client's says what the
//! connection is for, the server's (sent as soon as it accepts, before it has read a byte)
//! is followed by its [`Hello`], whose nonce is fresh for that connection. The control
//! connection then carries [`Message`]s in checksummed frames ([`encode_frame`],
//! [`FrameHeader`]); a data channel carries one [`Message::ChannelJoin`] frame, whose proof
//! is bound to that connection's nonce, and then blocks: a fixed [`BlockHeader`], a table
//! of [`Segment`]s saying which file bytes the block holds, and the payload.
//!
//! Callers own the sockets: they read [`FrameHeader::LEN`] bytes, call
//! [`FrameHeader::decode`] (which refuses lengths past [`MAX_FRAME_BODY`] before anything
//! is allocated), read the body, and call [`Message::decode`]. The authentication
//! handshake is the state machines in [`handshake`]. Nothing here touches a socket, the
//! clock or a random number generator, which is what makes it fuzzable (`fuzz/`) and lets
//! the same session code drive TCP and libfabric.
//!
//! A control connection may instead carry remote operations ([`ops`]: stat, list, mkdir,
//! remove, rename, checksum) as [`Message::OpRequest`] / [`Message::OpReply`] frames.
//!
//! What this crate does not do: decide policy. Local limits (block size, window, how many
//! files may be open) are the engine's; this crate only enforces the protocol-wide
//! ceilings that keep decoding itself bounded.

mod block;
mod codec;
pub mod handshake;
mod message;
pub mod ops;
mod path;
pub mod tpc;

pub use block::{BlockHeader, PayloadCheck, Segment, BLOCK_MAGIC, MAX_BLOCK_PAYLOAD, MAX_SEGMENTS};
pub use codec::{Decoder, Encoder};
pub use message::*;
pub use path::{check_name, Escaped, PathError, RelPath, MAX_NAME_BYTES, MAX_PATH_BYTES};

/// The protocol version this build speaks. Bump it when a frame's meaning changes; new
/// optional behaviour is negotiated with [`features`] bits instead. Version 5 is session
/// protocol 2: the server greets first, channel joins are bound to their connection, and
/// transfers resume, compare and fail over. Version 6 runs every connection in TLS 1.3
/// (or, only on request, without encryption but with every control frame and block
/// authenticated), with proofs bound to the TLS connection's exporter.
pub const PROTOCOL_VERSION: u16 = 6;

/// The most manifest entries a client sends in its session request's flight
/// ([`features::PIPELINE`]); a server agrees on a window of at least as many (or as the
/// request's window, if smaller), so that they never overrun it.
pub const MAX_PIPELINED_ENTRIES: u32 = 16;

/// The port a server listens on unless told otherwise, and the one a `wanxfer://HOST/`
/// URL without a port reaches.
pub const DEFAULT_PORT: u16 = 7800;

/// Feature bits exchanged in [`Hello`]: each side says what it offers, and a session uses
/// only what both offer ([`features::negotiate`]). A bit once used is never reused for
/// something else: retired bits stay here as comments.
pub mod features {
    /// Blocks can carry a CRC-32C of their payload (since protocol 4, only in sessions
    /// without segment digests).
    pub const BLOCK_CRC32C: u64 = 1 << 0;
    /// Segments carry the 128-bit XXH3 digest of their bytes (whole files' digests before
    /// protocol version 4).
    pub const FILE_XXH3_128: u64 = 1 << 1;
    /// Reserved. TLS is not negotiated with a bit: a client that wants it starts the
    /// connection with a TLS ClientHello, and nobody on the path can turn that into
    /// plaintext without failing the handshake.
    pub const TLS: u64 = 1 << 2;
    /// Data channels may be libfabric endpoints (RDMA writes into slots the receiver
    /// grants on the fabric connection itself). A server offers it only when started with
    /// a provider.
    pub const FABRIC: u64 = 1 << 3;
    /// The receiver keeps a journal of verified ranges and reports what it holds
    /// ([`crate::Message::Held`]), so an interrupted transfer resumes.
    pub const RESUME: u64 = 1 << 4;
    /// The receiver skips files it already has ([`crate::Message::UpToDate`]).
    pub const COMPARE: u64 = 1 << 5;
    /// Third-party copy: the server makes grants ([`crate::ops::OpRequest::Grant`]),
    /// pushes to another server with one ([`crate::ops::OpRequest::PushTo`]) and accepts
    /// a grant's proof ([`crate::Message::GrantProof`]) in place of the secret's.
    pub const THIRD_PARTY: u64 = 1 << 6;

    /// The client authenticates with a credential (a bearer token, or the X.509
    /// certificate it presented in TLS) instead of the shared secret; a server sets it
    /// when it accepts credentials. Not in [`SUPPORTED`]: a client offers it only to say
    /// how it authenticates, and the handshake's proofs (which cover both feature sets)
    /// are then keyed by the TLS connection's exporter alone, so it is refused on a
    /// connection without TLS. The credential itself follows the proof as
    /// [`crate::Message::Credential`].
    pub const CREDENTIAL: u64 = 1 << 7;

    /// A pulling client's request may carry a [`crate::Selection`] (include/exclude
    /// rules, a list of paths) that the server applies as it lists its tree.
    pub const SELECT: u64 = 1 << 8;

    /// Manifest entries may carry metadata beyond mode and mtime ([`crate::EntryMeta`]:
    /// owner, group, extended attributes and ACLs), as the request's `PRESERVE_*`
    /// [`crate::session_flags`] ask, and the receiver may send [`crate::Message::Note`]s
    /// about what it could not keep.
    pub const PRESERVE: u64 = 1 << 9;

    /// Pipelined set-up: a pushing client sends the first few manifest entries (at most
    /// [`crate::MAX_PIPELINED_ENTRIES`], one [`crate::Message::Manifest`] frame) right
    /// behind its [`crate::Message::OpenSession`], and the server, which reads them only
    /// once the session is accepted, agrees on a window that holds them and answers them
    /// right behind its acceptance; a receiving server does not answer a data channel's
    /// join ([`crate::Message::ChannelAccepted`]), so the client's blocks follow the join
    /// at once (a refused join is an [`crate::Message::Error`] and a close). Set-up then
    /// waits 3 round trips to a push's first data byte instead of 4.
    pub const PIPELINE: u64 = 1 << 10;

    /// The client wants the server's [`crate::SessionStatus`] while a session runs; a
    /// server that shares the bit sends it about once a second.
    pub const SESSION_STATUS: u64 = 1 << 11;

    /// A third-party copy may keep metadata: a [`crate::tpc::Grant`] and a
    /// [`crate::tpc::PushTo`] may carry `PRESERVE_*` session flags, and a
    /// [`crate::tpc::TransferSummary`] the destination's notes about what it could not
    /// keep. Apart from [`PRESERVE`] because a server with that bit but not this one
    /// reads those messages without the new fields and refuses them as trailing bytes.
    pub const THIRD_PARTY_PRESERVE: u64 = 1 << 12;

    // 13 and 14 are assigned elsewhere.

    /// With [`crate::session_flags::PRESERVE_HARDLINKS`], the sender marks the file
    /// entries that later entries may link to ([`crate::EntryMeta::linkable`]: files
    /// with several names, at most [`crate::MAX_LINK_TARGETS`] of them), and a link
    /// names only a marked entry; so the receiver remembers only those, not every file
    /// of the session. Without it a link may name any earlier file, as a receiver that
    /// does not know the mark refuses it as an unknown metadata field.
    pub const LINK_TARGETS: u64 = 1 << 15;

    /// A [`crate::tpc::PushTo`] may carry a [`crate::Selection`] (include/exclude rules,
    /// a list of paths) that the source applies as it walks its tree, as a pushing client
    /// applies its own. Apart from [`SELECT`] for the reason [`THIRD_PARTY_PRESERVE`] is
    /// apart from [`PRESERVE`]: a server without it refuses the new field as trailing
    /// bytes.
    pub const THIRD_PARTY_SELECT: u64 = 1 << 16;

    /// Pipelined pull: a session's id is [`crate::handshake::Authenticated::session_id`],
    /// which the client knows once it has sent its proof, so its data connections may
    /// join before the session's answer arrives (the server holds such a join until the
    /// session it names is open, within its handshake timeout); and a pulling client may
    /// say with [`crate::session_flags::FRESH`] that it holds nothing of the transfer, so
    /// that the server sends each file's blocks as it announces it instead of after the
    /// acknowledgement. Set-up then waits 3 round trips to a pull's first data byte
    /// instead of 4.
    pub const PULL_PIPELINE: u64 = 1 << 17;

    /// What this build implements.
    pub const SUPPORTED: u64 = BLOCK_CRC32C
        | FILE_XXH3_128
        | FABRIC
        | RESUME
        | COMPARE
        | THIRD_PARTY
        | SELECT
        | PRESERVE
        | PIPELINE
        | SESSION_STATUS
        | THIRD_PARTY_PRESERVE
        | LINK_TARGETS
        | THIRD_PARTY_SELECT
        | PULL_PIPELINE;

    /// The features a session between these two sides uses.
    pub const fn negotiate(ours: u64, theirs: u64) -> u64 {
        ours & theirs & SUPPORTED
    }
}

/// A decoding failure: always the peer's fault (or the network's), never ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("input ended {needed} bytes early")]
    Truncated { needed: usize },
    #[error("{what} is {len} long, more than the limit of {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{len} unexpected bytes after the end of a message")]
    Trailing { len: usize },
    #[error("not a wanxfer connection (bad magic)")]
    BadMagic,
    #[error("peer speaks protocol version {theirs}, this build speaks {PROTOCOL_VERSION}")]
    Version { theirs: u16 },
    #[error("unknown {what} {value}")]
    Unknown { what: &'static str, value: u64 },
    #[error("{what} checksum mismatch: corrupted in transit")]
    Checksum { what: &'static str },
    #[error("invalid path: {0}")]
    Path(#[from] PathError),
    #[error("invalid path \"{path}\": {reason}")]
    BadPath { path: String, reason: PathError },
    #[error("invalid value: {0}")]
    Invalid(&'static str),
    /// A manifest entry is a hard link to an entry it may not link to.
    #[error("entry {id} is a hard link to entry {target}, which is {reason}")]
    Link {
        id: u64,
        target: u64,
        reason: &'static str,
    },
}

/// First bytes on every connection, so that a port scanner, an HTTP client or an old
/// version gets a clear refusal instead of a confusing decode error later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    pub version: u16,
    pub kind: ConnectionKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionKind {
    Control,
    Data,
    /// The server's side of any connection: its greeting.
    Server,
}

impl Preamble {
    pub const LEN: usize = 16;
    pub const MAGIC: [u8; 8] = *b"WANXFER\0";

    pub fn new(kind: ConnectionKind) -> Self {
        Preamble {
            version: PROTOCOL_VERSION,
            kind,
        }
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&Self::MAGIC);
        out[8..10].copy_from_slice(&self.version.to_le_bytes());
        let kind: u16 = match self.kind {
            ConnectionKind::Control => 0,
            ConnectionKind::Data => 1,
            ConnectionKind::Server => 2,
        };
        out[10..12].copy_from_slice(&kind.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8; Self::LEN]) -> Result<Self, DecodeError> {
        if bytes[..8] != Self::MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::Version { theirs: version });
        }
        let kind = match u16::from_le_bytes([bytes[10], bytes[11]]) {
            0 => ConnectionKind::Control,
            1 => ConnectionKind::Data,
            2 => ConnectionKind::Server,
            other => {
                return Err(DecodeError::Unknown {
                    what: "connection kind",
                    value: other.into(),
                })
            }
        };
        Ok(Preamble { version, kind })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preamble_round_trips_and_rejects_http() {
        let p = Preamble::new(ConnectionKind::Data);
        assert_eq!(Preamble::decode(&p.encode()), Ok(p));
        assert_eq!(
            Preamble::decode(b"GET / HTTP/1.1\r\n"),
            Err(DecodeError::BadMagic)
        );
    }

    #[test]
    fn preamble_names_a_version_mismatch() {
        let mut bytes = Preamble::new(ConnectionKind::Control).encode();
        bytes[8] = 9;
        assert_eq!(
            Preamble::decode(&bytes),
            Err(DecodeError::Version { theirs: 9 })
        );
    }
}
