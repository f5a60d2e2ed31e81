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
/// Most held ranges in one [`Held`] frame (a file's ranges may span several frames).
pub const MAX_HELD_RANGES: usize = 16_384;
/// Most held ranges per file the receiver reports, and the sender accepts, in all: a
/// file's ranges beyond this are simply sent again.
pub const MAX_HELD_RANGES_PER_FILE: usize = 65_536;
/// Most paths in one [`Message::Skipped`] frame.
pub const MAX_SKIPPED_PATHS: usize = 256;
/// Longest software identification string in [`Hello`].
pub const MAX_SOFTWARE_BYTES: usize = 64;
/// Largest bearer token a client may present. WLCG tokens are a few kilobytes (the
/// profile asks issuers to stay well under 8 KiB so that tokens fit in HTTP headers).
pub const MAX_TOKEN_BYTES: usize = 16 << 10;
/// Most include/exclude rules a pull's [`Selection`] carries.
pub const MAX_SELECT_RULES: usize = 1024;
/// Longest include/exclude pattern.
pub const MAX_PATTERN_BYTES: usize = 1024;
/// Most paths a pull's `--files-from` list may name (the request's frame, at most
/// [`MAX_FRAME_BODY`], bounds them too).
pub const MAX_SELECTED_PATHS: usize = 16_384;
/// Most extended attributes one entry carries (ACLs included: they travel as their
/// `system.posix_acl_*` attributes).
pub const MAX_XATTRS_PER_ENTRY: usize = 128;
/// Most data ranges one sparse entry lists ([`EntryMeta::data`]); a file with more
/// travels dense.
pub const MAX_DATA_RANGES_PER_ENTRY: usize = 1024;
/// Most entries of one session a sender marks as link targets
/// ([`EntryMeta::linkable`], with [`crate::features::LINK_TARGETS`]): the bound of the
/// sender's table of files with several names, and of the receiver's of marked entries.
pub const MAX_LINK_TARGETS: usize = 1 << 20;
/// Longest extended attribute name: Linux's `XATTR_NAME_MAX`.
pub const MAX_XATTR_NAME_BYTES: usize = 255;
/// Largest extended attribute value: Linux's `XATTR_SIZE_MAX`.
pub const MAX_XATTR_VALUE_BYTES: usize = 64 << 10;
/// Most bytes of names and values together one entry's attributes take (ext4 keeps
/// them in one 4 KiB block; XFS and tmpfs allow more), so that a manifest frame of
/// entries with attributes stays far below [`MAX_FRAME_BODY`].
pub const MAX_XATTR_BYTES_PER_ENTRY: usize = 128 << 10;
/// Longest [`Message::Note`].
pub const MAX_NOTE_BYTES: usize = 1024;

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
    /// The reporting side could not reach a third party or lost it: sent only by a
    /// third-party copy's source about its destination, so that the client can tell a
    /// network failure (worth retrying) from a refusal.
    Network,
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
    /// Keep each entry's owner (numeric uid). Only with [`crate::features::PRESERVE`];
    /// a receiving server that cannot (it does not run as root) clears it in its answer.
    pub const PRESERVE_OWNER: u32 = 1 << 4;
    /// Keep each entry's group (numeric gid), as [`PRESERVE_OWNER`].
    pub const PRESERVE_GROUP: u32 = 1 << 5;
    /// Keep `user.*` extended attributes (never `trusted.*` or `security.*`: see
    /// [`crate::check_xattr_name`]).
    pub const PRESERVE_XATTRS: u32 = 1 << 8;
    /// Keep POSIX ACLs (their `system.posix_acl_access`/`_default` attributes).
    pub const PRESERVE_ACLS: u32 = 1 << 9;
    /// Keep holes: entries may list their data ranges ([`crate::EntryMeta::data`]), only
    /// those are sent, and the receiver leaves the rest unallocated.
    pub const PRESERVE_SPARSE: u32 = 1 << 10;
    /// Keep hard links within the transfer: the second and later names of one source
    /// inode are entries that link to the first ([`crate::EntryMeta::link`]), whose data
    /// alone is sent.
    pub const PRESERVE_HARDLINKS: u32 = 1 << 11;

    /// The preserve flags.
    pub const PRESERVE_ALL: u32 = PRESERVE_OWNER
        | PRESERVE_GROUP
        | PRESERVE_XATTRS
        | PRESERVE_ACLS
        | PRESERVE_SPARSE
        | PRESERVE_HARDLINKS;

    /// A pulling client holds nothing of this transfer (no journal, no destination yet)
    /// and compares nothing, so the server may send a file's blocks as soon as it has
    /// announced it; the client then waits for an entry that its data overtook. Only
    /// with [`crate::features::PULL_PIPELINE`]; a server that does not do so clears it in
    /// its answer.
    pub const FRESH: u32 = 1 << 12;

    pub const ALL: u32 =
        DISCARD | SYNTHETIC_SOURCE | NO_BLOCK_CHECKSUM | NO_FILE_DIGEST | PRESERVE_ALL | FRESH;
}

/// Where a push's sources land beneath its destination path, `cp -r` style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Placement {
    /// Decide by what is there: into the destination if it is a directory, onto it if
    /// there is one source and it is not (the first run of a transfer).
    Resolve,
    /// Into the destination directory, which is created if it is missing (a destination
    /// written with a trailing slash, or pinned by an earlier run).
    Into,
    /// The single source becomes the destination's name.
    Onto,
}

/// How a receiver decides that a file it already has need not be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Compare {
    /// Send every file.
    Always,
    /// Skip a file whose size and modification time (to the nanosecond) match: rsync's
    /// quick check.
    QuickCheck,
    /// Skip the parts of a file of the same size whose digests match the source's.
    Checksum,
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
    /// The transfer this session continues: the same command run again names the same
    /// transfer, so the receiver finds what an interrupted run left.
    pub transfer_id: [u8; 16],
    /// Push: where the sources land (pinned to an earlier run's choice when there was one).
    pub placement: Placement,
    /// Which files the receiver may skip.
    pub compare: Compare,
    /// Pull: which entries beneath the sources the server lists (only with
    /// [`crate::features::SELECT`]; empty selects everything). A push's selection never
    /// travels: the client lists its own tree.
    pub selection: Selection,
}

/// One `--include` or `--exclude` rule: a glob, matched as rsync matches its filter
/// rules (see the engine's `select` module for the semantics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectRule {
    pub include: bool,
    /// Not empty, no NUL, at most [`MAX_PATTERN_BYTES`].
    pub pattern: Vec<u8>,
}

/// Which entries beneath the sources a transfer takes: the rules in order (the first
/// that matches decides; none matching includes), and, with `--files-from`, only the
/// listed paths, their parents and what lies beneath them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selection {
    pub rules: Vec<SelectRule>,
    pub files: Option<Vec<RelPath>>,
}

impl Selection {
    /// Selects everything: nothing to send, or to check.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.files.is_none()
    }
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
    /// Most data channels the session may have at once, counting those that join later.
    pub max_streams: u16,
    /// Push: where the sources land, as the server resolved it ([`Placement::Into`] or
    /// [`Placement::Onto`]); pull: [`Placement::Resolve`].
    pub placement: Placement,
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
    /// What the session preserves beyond mode and mtime (only with
    /// [`crate::features::PRESERVE`]); `None` when there is nothing of it.
    pub meta: Option<Box<EntryMeta>>,
}

/// An entry's metadata beyond mode and mtime, for `cp --preserve`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EntryMeta {
    /// Numeric owner, with [`session_flags::PRESERVE_OWNER`].
    pub uid: Option<u32>,
    /// Numeric group, with [`session_flags::PRESERVE_GROUP`].
    pub gid: Option<u32>,
    /// Extended attributes as `(name, value)`, names unique and checked by
    /// [`check_xattr_name`], at most [`MAX_XATTRS_PER_ENTRY`] and
    /// [`MAX_XATTR_BYTES_PER_ENTRY`] in all. POSIX ACLs are among them as
    /// `system.posix_acl_access` and `system.posix_acl_default`.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// A sparse file's data ranges `[start, end)`, with
    /// [`session_flags::PRESERVE_SPARSE`]: sorted, non-empty, apart (never touching),
    /// within the entry's size, at most [`MAX_DATA_RANGES_PER_ENTRY`]; everything else
    /// of the file is a hole. Empty: the file is all hole.
    pub data: Option<Vec<(u64, u64)>>,
    /// With [`session_flags::PRESERVE_HARDLINKS`]: this file is another name of the file
    /// of entry `link`, an earlier entry of the session that is a file and not itself a
    /// link. No data travels for it (it has no data ranges); the receiver links it to
    /// that entry's file once that one is in place.
    pub link: Option<u64>,
    /// With [`crate::features::LINK_TARGETS`]: this file has other names, which later
    /// entries may link to (`link`); only a file that is not itself a link is marked,
    /// and a link names only a marked entry. No payload: one bit of the fields byte.
    pub linkable: bool,
}

impl EntryMeta {
    /// Bytes this adds to a manifest frame, at most.
    pub fn encoded_len(&self) -> usize {
        1 + 8
            + 2
            + self
                .xattrs
                .iter()
                .map(|(n, v)| 8 + n.len() + v.len())
                .sum::<usize>()
            + self.data.as_ref().map_or(0, |d| 2 + 16 * d.len())
            + self.link.map_or(0, |_| 8)
    }

    fn is_empty(&self) -> bool {
        self.uid.is_none()
            && self.gid.is_none()
            && self.xattrs.is_empty()
            && self.data.is_none()
            && self.link.is_none()
            && !self.linkable
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub first_id: u64,
    pub entries: Vec<Entry>,
}

impl Manifest {
    /// With [`crate::features::LINK_TARGETS`] (which the decoder cannot know): each link
    /// to an entry of this frame names one marked [`EntryMeta::linkable`]. A link to an
    /// entry of an earlier frame is the receiver's to check, which remembers the marked.
    pub fn check_marked_links(&self) -> Result<(), DecodeError> {
        for (i, entry) in self.entries.iter().enumerate() {
            let Some(target) = entry.meta.as_ref().and_then(|m| m.link) else {
                continue;
            };
            let id = self.first_id.saturating_add(i as u64);
            let earlier = target
                .checked_sub(self.first_id)
                .and_then(|t| self.entries[..i].get(t as usize));
            if earlier.is_some_and(|t| !t.meta.as_ref().is_some_and(|m| m.linkable)) {
                return Err(DecodeError::Link {
                    id,
                    target,
                    reason: "not marked as a link target",
                });
            }
        }
        Ok(())
    }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelJoin {
    pub session_id: [u8; 16],
    pub index: u16,
    /// Proves knowledge of the session's key, bound to the nonce the server sent on this
    /// very connection, so a captured join is worthless on any other connection.
    pub proof: [u8; 32],
}

/// A stretch of a file the receiver already holds, verified, with the digest that
/// verified it (the XXH3-128 of its bytes, as the segment that carried it had).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldRange {
    pub offset: u64,
    pub len: u32,
    pub digest: [u8; 16],
}

/// What the receiver already holds of a file: from an interrupted run of the same transfer,
/// or (comparing by checksum) in the file it would replace. The sender checks each range
/// against its source and answers with a [`Confirm`]; it sends only what was not
/// confirmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub id: u64,
    pub ranges: Vec<HeldRange>,
    /// No more `Held` frames for this file follow.
    pub last: bool,
}

/// The sender's verdict on a file's held ranges, in the order they were held: bit `i` of
/// `accepted` is set if range `i` matched the source. Ranges not accepted will be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confirm {
    pub id: u64,
    pub count: u32,
    pub accepted: Vec<u8>,
}

impl Confirm {
    pub fn new(id: u64, verdicts: &[bool]) -> Confirm {
        let mut accepted = vec![0u8; verdicts.len().div_ceil(8)];
        for (i, _) in verdicts.iter().enumerate().filter(|(_, ok)| **ok) {
            accepted[i / 8] |= 1 << (i % 8);
        }
        Confirm {
            id,
            count: verdicts.len() as u32,
            accepted,
        }
    }

    pub fn is_accepted(&self, index: usize) -> bool {
        index < self.count as usize && self.accepted[index / 8] & (1 << (index % 8)) != 0
    }
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

/// The server's side of a running session, about once a second, to a client that offered
/// [`crate::features::SESSION_STATUS`]: what the client's live view (`cp
/// --progress-json`) cannot measure itself. Numbers so far in the session; every count of
/// buffers on loan is at most its pool's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionStatus {
    /// CPU of the server's threads of this session.
    pub cpu_user_us: u64,
    pub cpu_sys_us: u64,
    /// Its block pool: buffers on loan and in all.
    pub pool_in_use: u32,
    pub pool_capacity: u32,
    /// A fabric receiver's registered slots: on loan and in all; of them, granted to the
    /// sender and not yet written (its credits).
    pub slots_in_use: u32,
    pub slots_capacity: u32,
    pub fabric_credits: u32,
}

/// A client's credential (see [`crate::features::CREDENTIAL`]).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Credential {
    /// A bearer token (a JWT, WLCG/SciTokens profile), at most [`MAX_TOKEN_BYTES`].
    Token(Vec<u8>),
    /// The X.509 certificate this client presented in the TLS handshake.
    Certificate,
}

/// A token is a password: it is never printed, even in a debug dump of a frame.
impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Token(t) => write!(f, "Token({} bytes)", t.len()),
            Credential::Certificate => f.write_str("Certificate"),
        }
    }
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
    ChannelJoin(ChannelJoin),
    /// The client has everything it needs; the server answers with its [`Stats`].
    Finish,
    Stats(Stats),
    /// The server accepted a data channel; blocks may flow.
    ChannelAccepted {
        index: u16,
    },
    FabricEndpoint(FabricEndpoint),
    /// These files were already in place and were not sent.
    UpToDate {
        ids: Vec<u64>,
    },
    Held(Held),
    Confirm(Confirm),
    /// The receiver has taken in `received` whole blocks from data channel `index` since
    /// it joined; `closed` once the channel is gone and the count is final, so that the
    /// sender sends again exactly what the channel did not deliver.
    ChannelStatus {
        index: u16,
        received: u64,
        closed: bool,
    },
    /// The sender considers data channel `index` dead (it stalled or failed): the
    /// receiver closes it and answers with its final [`Message::ChannelStatus`].
    DropChannel {
        index: u16,
    },
    /// Entries the sender did not send because they are neither file, directory nor
    /// symlink (devices, sockets, FIFOs), so that the receiving user learns of them.
    Skipped {
        paths: Vec<Vec<u8>>,
    },
    /// Nothing else to say, but still here: a session silent for its stall timeout is
    /// dead.
    Keepalive,
    /// How a client that set [`crate::features::CREDENTIAL`] authenticates, sent right
    /// after its proof and before its request; only ever inside TLS.
    Credential(Credential),
    /// Instead of [`OpenSession`]: a remote operation (see [`crate::ops`]).
    OpRequest(OpRequest),
    OpReply(OpReply),
    /// Instead of [`Message::AuthProof`]: the proof of a third-party copy's grant, whose
    /// id tells the server which grant's secret to check it with (see
    /// [`crate::handshake::ClientHandshake::for_grant`]).
    GrantProof {
        grant_id: [u8; 16],
        mac: [u8; 32],
    },
    /// The receiver could not keep something the session preserves (owner, attributes)
    /// and tells the sending side's user, once per kind of failure; not a failure.
    Note {
        text: Vec<u8>,
    },
    /// Server to client while a session runs (see [`SessionStatus`]).
    SessionStatus(SessionStatus),
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
            // 12: Credit (slot grants on the control connection), never used; retired.
            Message::ChannelJoin(_) => 13,
            Message::Finish => 14,
            Message::Stats(_) => 15,
            Message::ChannelAccepted { .. } => 16,
            Message::FabricEndpoint(_) => 17,
            Message::UpToDate { .. } => 18,
            Message::Held(_) => 19,
            Message::Confirm(_) => 20,
            Message::ChannelStatus { .. } => 21,
            Message::DropChannel { .. } => 22,
            Message::Skipped { .. } => 23,
            Message::Keepalive => 24,
            Message::SessionStatus(_) => 30,
            Message::Credential(_) => 25,
            Message::Note { .. } => 26,
            // 27-29 and 31-39: reserved for the session layer's messages.
            Message::OpRequest(_) => 40,
            Message::OpReply(_) => 41,
            Message::GrantProof { .. } => 42,
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
                e.u16(a.max_streams);
                e.u8(encode_placement(a.placement));
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
            Message::FileAck { ids } | Message::UpToDate { ids } => {
                e.u32(ids.len() as u32);
                ids.iter().for_each(|id| e.u64(*id));
            }
            Message::FileFailed(f) => {
                e.u64(f.id);
                e.u8(encode_class(f.class));
                e.u64(f.offset);
                e.bytes(&f.message);
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
            Message::Held(h) => {
                e.u64(h.id);
                e.u8(u8::from(h.last));
                e.u32(h.ranges.len() as u32);
                for r in &h.ranges {
                    e.u64(r.offset);
                    e.u32(r.len);
                    e.raw(&r.digest);
                }
            }
            Message::Confirm(c) => {
                e.u64(c.id);
                e.u32(c.count);
                e.raw(&c.accepted);
            }
            Message::ChannelStatus {
                index,
                received,
                closed,
            } => {
                e.u16(*index);
                e.u64(*received);
                e.u8(u8::from(*closed));
            }
            Message::DropChannel { index } => e.u16(*index),
            Message::Skipped { paths } => {
                e.u32(paths.len() as u32);
                paths.iter().for_each(|p| e.bytes(p));
            }
            Message::Keepalive => {}
            Message::SessionStatus(st) => {
                e.u64(st.cpu_user_us);
                e.u64(st.cpu_sys_us);
                e.u32(st.pool_in_use);
                e.u32(st.pool_capacity);
                e.u32(st.slots_in_use);
                e.u32(st.slots_capacity);
                e.u32(st.fabric_credits);
            }
            Message::Credential(c) => match c {
                Credential::Token(token) => {
                    e.u8(1);
                    e.bytes(token);
                }
                Credential::Certificate => e.u8(2),
            },
            Message::OpRequest(r) => ops::encode_request(r, e),
            Message::OpReply(r) => ops::encode_reply(r, e),
            Message::GrantProof { grant_id, mac } => {
                e.raw(grant_id);
                e.raw(mac);
            }
            Message::Note { text } => e.bytes(text),
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
                max_streams: d.u16()?,
                placement: decode_placement(d.u8()?)?,
            }),
            7 => {
                let first_id = d.u64()?;
                let n = d.count("manifest entries", MAX_MANIFEST_ENTRIES, ENTRY_MIN_LEN)?;
                let mut entries: Vec<Entry> = Vec::with_capacity(n);
                for _ in 0..n {
                    let entry = decode_entry(&mut d)?;
                    let id = first_id.saturating_add(entries.len() as u64);
                    if let Some(target) = entry.meta.as_ref().and_then(|m| m.link) {
                        check_link(id, target, first_id, &entries)?;
                    }
                    entries.push(entry);
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
            // 12: Credit, retired unused (see `Message::kind`).
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
            18 => {
                let n = d.count("up-to-date ids", MAX_ACK_IDS, 8)?;
                let ids = (0..n).map(|_| d.u64()).collect::<Result<_, _>>()?;
                Message::UpToDate { ids }
            }
            19 => {
                let id = d.u64()?;
                let last = decode_bool(d.u8()?)?;
                let n = d.count("held ranges", MAX_HELD_RANGES, 28)?;
                let ranges = (0..n)
                    .map(|_| {
                        let r = HeldRange {
                            offset: d.u64()?,
                            len: d.u32()?,
                            digest: d.array()?,
                        };
                        if r.len == 0 || r.offset.checked_add(r.len.into()).is_none() {
                            return Err(DecodeError::Invalid("held range empty or overflowing"));
                        }
                        Ok(r)
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Message::Held(Held { id, ranges, last })
            }
            20 => {
                let id = d.u64()?;
                let count = d.u32()?;
                if count as usize > MAX_HELD_RANGES_PER_FILE {
                    return Err(DecodeError::TooLong {
                        what: "confirmed ranges",
                        len: count as usize,
                        max: MAX_HELD_RANGES_PER_FILE,
                    });
                }
                let bytes = (count as usize).div_ceil(8);
                let accepted = d.take_bytes(bytes)?.to_vec();
                // Bits past `count` must be zero: one encoding per verdict.
                if count % 8 != 0 && accepted[bytes - 1] >> (count % 8) != 0 {
                    return Err(DecodeError::Invalid("confirm bits past the count"));
                }
                Message::Confirm(Confirm {
                    id,
                    count,
                    accepted,
                })
            }
            21 => Message::ChannelStatus {
                index: d.u16()?,
                received: d.u64()?,
                closed: decode_bool(d.u8()?)?,
            },
            22 => Message::DropChannel { index: d.u16()? },
            23 => {
                let n = d.count("skipped paths", MAX_SKIPPED_PATHS, 4)?;
                let paths = (0..n)
                    .map(|_| Ok(d.bytes("skipped path", MAX_PATH_BYTES)?.to_vec()))
                    .collect::<Result<_, DecodeError>>()?;
                Message::Skipped { paths }
            }
            24 => Message::Keepalive,
            30 => {
                let st = SessionStatus {
                    cpu_user_us: d.u64()?,
                    cpu_sys_us: d.u64()?,
                    pool_in_use: d.u32()?,
                    pool_capacity: d.u32()?,
                    slots_in_use: d.u32()?,
                    slots_capacity: d.u32()?,
                    fabric_credits: d.u32()?,
                };
                if st.pool_in_use > st.pool_capacity
                    || st.slots_in_use > st.slots_capacity
                    || st.fabric_credits > st.slots_capacity
                {
                    return Err(DecodeError::Invalid(
                        "session status: more buffers on loan than in the pool",
                    ));
                }
                Message::SessionStatus(st)
            }
            25 => Message::Credential(match d.u8()? {
                1 => {
                    let token = d.bytes("token", MAX_TOKEN_BYTES)?;
                    if token.is_empty() {
                        return Err(DecodeError::Invalid("an empty token"));
                    }
                    Credential::Token(token.to_vec())
                }
                2 => Credential::Certificate,
                other => {
                    return Err(DecodeError::Unknown {
                        what: "credential kind",
                        value: other.into(),
                    })
                }
            }),
            26 => Message::Note {
                text: d.bytes("note", MAX_NOTE_BYTES)?.to_vec(),
            },
            40 => Message::OpRequest(ops::decode_request(&mut d)?),
            41 => Message::OpReply(ops::decode_reply(&mut d)?),
            42 => Message::GrantProof {
                grant_id: d.array()?,
                mac: d.array()?,
            },
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
    e.raw(&o.transfer_id);
    e.u8(encode_placement(o.placement));
    e.u8(match o.compare {
        Compare::Always => 0,
        Compare::QuickCheck => 1,
        Compare::Checksum => 2,
    });
    // Only a selection that selects something less than everything is written, so
    // that every request has one encoding and a request without one is what it was
    // before selections existed.
    if !o.selection.is_empty() {
        encode_selection(&o.selection, e);
    }
}

pub(crate) fn encode_selection(s: &Selection, e: &mut Encoder) {
    e.u32(s.rules.len() as u32);
    for rule in &s.rules {
        e.u8(u8::from(rule.include));
        e.bytes(&rule.pattern);
    }
    match &s.files {
        None => e.u8(0),
        Some(files) => {
            e.u8(1);
            e.u32(files.len() as u32);
            files.iter().for_each(|p| e.bytes(p.as_bytes()));
        }
    }
}

pub(crate) fn decode_selection(d: &mut Decoder) -> Result<Selection, DecodeError> {
    let n = d.count("selection rules", MAX_SELECT_RULES, 5)?;
    let mut rules = Vec::with_capacity(n);
    for _ in 0..n {
        let include = decode_bool(d.u8()?)?;
        let pattern = d.bytes("pattern", MAX_PATTERN_BYTES)?.to_vec();
        if pattern.is_empty() || pattern.contains(&0) {
            return Err(DecodeError::Invalid("a pattern is empty or contains NUL"));
        }
        rules.push(SelectRule { include, pattern });
    }
    let files = match decode_bool(d.u8()?)? {
        false => None,
        true => {
            let n = d.count("selected paths", MAX_SELECTED_PATHS, 4)?;
            let files = (0..n)
                .map(|_| decode_path(d))
                .collect::<Result<Vec<_>, DecodeError>>()?;
            if files.iter().any(RelPath::is_root) {
                return Err(DecodeError::Invalid("a selected path is empty"));
            }
            Some(files)
        }
    };
    let selection = Selection { rules, files };
    if selection.is_empty() {
        return Err(DecodeError::Invalid(
            "an empty selection is written as none",
        ));
    }
    Ok(selection)
}

fn encode_placement(p: Placement) -> u8 {
    match p {
        Placement::Resolve => 0,
        Placement::Into => 1,
        Placement::Onto => 2,
    }
}

fn decode_placement(v: u8) -> Result<Placement, DecodeError> {
    Ok(match v {
        0 => Placement::Resolve,
        1 => Placement::Into,
        2 => Placement::Onto,
        other => {
            return Err(DecodeError::Unknown {
                what: "placement",
                value: other.into(),
            })
        }
    })
}

fn decode_bool(v: u8) -> Result<bool, DecodeError> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(DecodeError::Invalid("a flag byte is neither 0 nor 1")),
    }
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
    let mut open = OpenSession {
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
        transfer_id: d.array()?,
        placement: decode_placement(d.u8()?)?,
        compare: match d.u8()? {
            0 => Compare::Always,
            1 => Compare::QuickCheck,
            2 => Compare::Checksum,
            other => {
                return Err(DecodeError::Unknown {
                    what: "comparison",
                    value: other.into(),
                })
            }
        },
        selection: Selection::default(),
    };
    if d.remaining() > 0 {
        open.selection = decode_selection(d)?;
    }
    if open.flags & !session_flags::ALL != 0 {
        return Err(DecodeError::Unknown {
            what: "session flags",
            value: open.flags.into(),
        });
    }
    Ok(open)
}

/// Set in an entry's kind byte when [`EntryMeta`] follows the entry.
const ENTRY_HAS_META: u8 = 0x80;
const META_UID: u8 = 1 << 0;
const META_GID: u8 = 1 << 1;
const META_XATTRS: u8 = 1 << 2;
const META_DATA: u8 = 1 << 3;
const META_LINK: u8 = 1 << 4;
/// No payload: [`EntryMeta::linkable`].
const META_LINKABLE: u8 = 1 << 5;
const META_ALL: u8 = META_UID | META_GID | META_XATTRS | META_DATA | META_LINK | META_LINKABLE;

fn encode_entry(entry: &Entry, e: &mut Encoder) {
    let kind = match entry.kind {
        EntryKind::File => 0,
        EntryKind::Dir => 1,
        EntryKind::Symlink => 2,
    };
    // An empty meta is written as none: one encoding per entry.
    let meta = entry.meta.as_deref().filter(|m| !m.is_empty());
    e.u8(kind | if meta.is_some() { ENTRY_HAS_META } else { 0 });
    e.bytes(entry.path.as_bytes());
    e.u64(entry.size);
    e.u32(entry.mode);
    e.i64(entry.mtime_sec);
    e.u32(entry.mtime_nsec);
    e.bytes(&entry.link_target);
    if let Some(meta) = meta {
        encode_meta(meta, e);
    }
}

fn encode_meta(meta: &EntryMeta, e: &mut Encoder) {
    let mut present = 0;
    if meta.uid.is_some() {
        present |= META_UID;
    }
    if meta.gid.is_some() {
        present |= META_GID;
    }
    if !meta.xattrs.is_empty() {
        present |= META_XATTRS;
    }
    if meta.data.is_some() {
        present |= META_DATA;
    }
    if meta.link.is_some() {
        present |= META_LINK;
    }
    if meta.linkable {
        present |= META_LINKABLE;
    }
    e.u8(present);
    if let Some(uid) = meta.uid {
        e.u32(uid);
    }
    if let Some(gid) = meta.gid {
        e.u32(gid);
    }
    if !meta.xattrs.is_empty() {
        e.u16(meta.xattrs.len() as u16);
        for (name, value) in &meta.xattrs {
            e.bytes(name);
            e.bytes(value);
        }
    }
    if let Some(data) = &meta.data {
        e.u16(data.len() as u16);
        for &(start, end) in data {
            e.u64(start);
            e.u64(end);
        }
    }
    if let Some(link) = meta.link {
        e.u64(link);
    }
}

fn decode_meta(d: &mut Decoder) -> Result<EntryMeta, DecodeError> {
    let present = d.u8()?;
    if present & !META_ALL != 0 {
        return Err(DecodeError::Unknown {
            what: "entry metadata fields",
            value: present.into(),
        });
    }
    if present == 0 {
        return Err(DecodeError::Invalid(
            "empty entry metadata is written as none",
        ));
    }
    let mut meta = EntryMeta::default();
    if present & META_UID != 0 {
        meta.uid = Some(d.u32()?);
    }
    if present & META_GID != 0 {
        meta.gid = Some(d.u32()?);
    }
    if present & META_XATTRS != 0 {
        let n = usize::from(d.u16()?);
        if n == 0 {
            return Err(DecodeError::Invalid(
                "no extended attributes is written as none",
            ));
        }
        if n > MAX_XATTRS_PER_ENTRY {
            return Err(DecodeError::TooLong {
                what: "extended attributes of an entry",
                len: n,
                max: MAX_XATTRS_PER_ENTRY,
            });
        }
        let mut total = 0usize;
        for _ in 0..n {
            let name = d.bytes("extended attribute name", MAX_XATTR_NAME_BYTES)?;
            let value = d.bytes("extended attribute value", MAX_XATTR_VALUE_BYTES)?;
            check_xattr_name(name)?;
            total += name.len() + value.len();
            if total > MAX_XATTR_BYTES_PER_ENTRY {
                return Err(DecodeError::TooLong {
                    what: "extended attributes of an entry (bytes)",
                    len: total,
                    max: MAX_XATTR_BYTES_PER_ENTRY,
                });
            }
            if meta.xattrs.iter().any(|(n, _)| n == name) {
                return Err(DecodeError::Invalid("an extended attribute named twice"));
            }
            meta.xattrs.push((name.to_vec(), value.to_vec()));
        }
    }
    if present & META_DATA != 0 {
        let n = usize::from(d.u16()?);
        if n > MAX_DATA_RANGES_PER_ENTRY {
            return Err(DecodeError::TooLong {
                what: "data ranges of an entry",
                len: n,
                max: MAX_DATA_RANGES_PER_ENTRY,
            });
        }
        let mut data = Vec::with_capacity(n);
        let mut end_before = None;
        for _ in 0..n {
            let (start, end) = (d.u64()?, d.u64()?);
            if start >= end || end_before.is_some_and(|e| start <= e) {
                return Err(DecodeError::Invalid(
                    "data ranges empty, out of order, overlapping or touching",
                ));
            }
            end_before = Some(end);
            data.push((start, end));
        }
        meta.data = Some(data);
    }
    if present & META_LINK != 0 {
        meta.link = Some(d.u64()?);
    }
    meta.linkable = present & META_LINKABLE != 0;
    Ok(meta)
}

/// The ACLs' attributes: what `--preserve acls` carries.
pub const ACL_XATTRS: [&[u8]; 2] = [b"system.posix_acl_access", b"system.posix_acl_default"];

/// An attribute name a receiver may be asked to set: a `user.` attribute or one of the
/// two ACLs ([`ACL_XATTRS`]). `trusted.` and `security.` never travel: they would let a
/// peer grant file capabilities (`security.capability` is setuid by other means) or
/// choose security labels on the receiver, which this protocol refuses as it refuses
/// setuid bits.
pub fn check_xattr_name(name: &[u8]) -> Result<(), DecodeError> {
    let user = name.len() > b"user.".len() && name.starts_with(b"user.");
    if !(user || ACL_XATTRS.contains(&name)) || name.contains(&0) {
        return Err(DecodeError::Invalid(
            "an extended attribute other than user.* and the POSIX ACLs, or with NUL",
        ));
    }
    Ok(())
}

/// Entry `id` links to entry `target`: an earlier one, and where this frame holds it, a
/// file that is not itself a link. (An entry of an earlier frame is checked by the
/// receiver, which remembers them.)
fn check_link(id: u64, target: u64, first_id: u64, earlier: &[Entry]) -> Result<(), DecodeError> {
    let refuse = |reason| Err(DecodeError::Link { id, target, reason });
    if target >= id {
        return refuse("not an earlier entry");
    }
    if let Some(entry) = target
        .checked_sub(first_id)
        .and_then(|i| earlier.get(i as usize))
    {
        if entry.kind != EntryKind::File {
            return refuse("not a file");
        }
        if entry.meta.as_ref().is_some_and(|m| m.link.is_some()) {
            return refuse("itself a link");
        }
    }
    Ok(())
}

fn decode_entry(d: &mut Decoder) -> Result<Entry, DecodeError> {
    let kind_byte = d.u8()?;
    let has_meta = kind_byte & ENTRY_HAS_META != 0;
    let kind = match kind_byte & !ENTRY_HAS_META {
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
    let mut entry = Entry {
        kind,
        path,
        size: d.u64()?,
        mode: d.u32()?,
        mtime_sec: d.i64()?,
        mtime_nsec: d.u32()?,
        link_target: d.bytes("symlink target", MAX_PATH_BYTES)?.to_vec(),
        meta: None,
    };
    if has_meta {
        let meta = decode_meta(d)?;
        if let Some(data) = &meta.data {
            if entry.kind != EntryKind::File {
                return Err(DecodeError::Invalid("only files have data ranges"));
            }
            if data.last().is_some_and(|&(_, end)| end > entry.size) {
                return Err(DecodeError::Invalid("a data range past the file's size"));
            }
        }
        if meta.link.is_some() && (entry.kind != EntryKind::File || meta.data.is_some()) {
            return Err(DecodeError::Invalid(
                "a hard link that is not a file, or that lists data ranges",
            ));
        }
        if meta.linkable && (entry.kind != EntryKind::File || meta.link.is_some()) {
            return Err(DecodeError::Invalid(
                "a link target that is not a file, or that is itself a link",
            ));
        }
        entry.meta = Some(Box::new(meta));
    }
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
        FailureClass::Network => 8,
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
        8 => FailureClass::Network,
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
