//! Remote operations on the served tree: stat, list, mkdir, remove, rename, checksum.
//!
//! Why a second kind of conversation on the control connection instead of a session:
//! these are small request/reply exchanges that catalogues and schedulers (Rucio, FTS
//! through gfal2) make by the thousand, and a session's data channels, manifest and
//! window would be pure overhead for them. After authentication a client sends either
//! `OpenSession` or an [`OpRequest`]; a connection that starts with an operation carries
//! only operations, one at a time, each answered before the next is read.
//!
//! Every request ends with exactly one final reply: [`OpReply::Meta`], a
//! [`OpReply::List`] page whose `more` flag is clear, [`OpReply::Checksum`],
//! [`OpReply::Done`] or [`OpReply::Error`]. [`OpReply::Progress`] may come before it
//! while a long operation (a checksum of a large file, the removal of a large tree)
//! runs, so that the client's silence timeout keeps meaning "the server is gone" rather
//! than "the file is big". A listing streams in pages of at most [`MAX_LIST_ENTRIES`]
//! entries, each page cut by the server to stay well under the frame limit
//! ([`LIST_PAGE_BYTES`]), so a directory of a million entries never has to fit in one
//! frame or in either side's memory.
//!
//! What this module does not do: decide what a path may name. The server checks every
//! path beneath its root (and refuses its own temporaries); here a path is only checked
//! to be a well-formed [`RelPath`].

use crate::codec::{Decoder, Encoder};
use crate::message::{
    decode_class, decode_path, encode_class, FailureClass, MAX_FRAME_BODY, MAX_MESSAGE_BYTES,
};
use crate::path::{RelPath, MAX_PATH_BYTES};
use crate::tpc::{self, Grant, Granted, PushTo, TransferProgress, TransferSummary};
use crate::DecodeError;

/// Most entries in one [`OpReply::List`] page.
pub const MAX_LIST_ENTRIES: usize = 4096;
/// The encoded size a server keeps a list page under (see [`ListPager`]): half a frame,
/// so that one more entry of the largest possible size never crosses the limit.
pub const LIST_PAGE_BYTES: usize = MAX_FRAME_BODY / 2;
/// Longest digest any algorithm produces (MD5's 16 bytes today; room for a 256-bit one).
pub const MAX_DIGEST_BYTES: usize = 32;
/// Permission bits a mkdir may ask for, and that [`Meta::mode`] can carry.
pub const MODE_BITS: u32 = 0o7777;

/// One operation a client asks for. Paths are relative to the server's root.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpRequest {
    /// Metadata of `path` itself (a symlink is described, never followed).
    Stat {
        path: RelPath,
    },
    /// The entries of directory `path` (or `path` itself when it is not a directory).
    List {
        path: RelPath,
        /// Descend into subdirectories (never through symlinks).
        recursive: bool,
        /// Each entry carries its metadata, not only its kind.
        long: bool,
    },
    Mkdir {
        path: RelPath,
        /// Create missing parents; an existing directory is then no error.
        parents: bool,
        /// Permission bits, before the server's umask.
        mode: u32,
    },
    Remove {
        path: RelPath,
        mode: RemoveMode,
    },
    /// `rename(2)` beneath the root: an existing file at `to` is replaced.
    Rename {
        from: RelPath,
        to: RelPath,
    },
    /// The digest of file `path`'s bytes, computed by the server next to the data.
    Checksum {
        path: RelPath,
        algorithm: ChecksumAlgorithm,
    },
    /// Third-party copy, at the destination: a grant for one push (see [`crate::tpc`]).
    Grant(Grant),
    /// Third-party copy, at the source: push to another server with a grant it made.
    PushTo(PushTo),
}

/// What a remove may remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RemoveMode {
    /// A file, symlink or other non-directory (`unlink`).
    NotDir,
    /// An empty directory (`rmdir`).
    EmptyDir,
    /// Anything, a directory with everything beneath it (`rm -r`).
    Recursive,
}

/// Checksum algorithms a server computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ChecksumAlgorithm {
    /// XXH3-128, the digest wanxfer itself verifies transfers with (`xxhsum -H2`).
    Xxh3,
    /// Adler-32, what Rucio and FTS catalogue.
    Adler32,
    Crc32c,
    Md5,
}

impl ChecksumAlgorithm {
    pub const ALL: [ChecksumAlgorithm; 4] = [
        ChecksumAlgorithm::Xxh3,
        ChecksumAlgorithm::Adler32,
        ChecksumAlgorithm::Crc32c,
        ChecksumAlgorithm::Md5,
    ];

    /// The name users type and tools print (lowercase).
    pub fn name(self) -> &'static str {
        match self {
            ChecksumAlgorithm::Xxh3 => "xxh3",
            ChecksumAlgorithm::Adler32 => "adler32",
            ChecksumAlgorithm::Crc32c => "crc32c",
            ChecksumAlgorithm::Md5 => "md5",
        }
    }

    /// The algorithm called `name`, in any case (gfal2 says `ADLER32`, Rucio `adler32`).
    pub fn from_name(name: &str) -> Option<ChecksumAlgorithm> {
        Self::ALL
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(name))
    }

    /// Length of the digest in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            ChecksumAlgorithm::Xxh3 | ChecksumAlgorithm::Md5 => 16,
            ChecksumAlgorithm::Adler32 | ChecksumAlgorithm::Crc32c => 4,
        }
    }

    fn code(self) -> u8 {
        match self {
            ChecksumAlgorithm::Xxh3 => 1,
            ChecksumAlgorithm::Adler32 => 2,
            ChecksumAlgorithm::Crc32c => 3,
            ChecksumAlgorithm::Md5 => 4,
        }
    }

    fn from_code(code: u8) -> Result<ChecksumAlgorithm, DecodeError> {
        Self::ALL
            .into_iter()
            .find(|a| a.code() == code)
            .ok_or(DecodeError::Unknown {
                what: "checksum algorithm",
                value: code.into(),
            })
    }
}

/// What a name refers to, not following symlinks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeKind {
    File,
    Dir,
    Symlink,
    /// A FIFO, socket or device: listed, never opened.
    Other,
}

impl NodeKind {
    pub fn name(self) -> &'static str {
        match self {
            NodeKind::File => "file",
            NodeKind::Dir => "dir",
            NodeKind::Symlink => "symlink",
            NodeKind::Other => "other",
        }
    }

    fn code(self) -> u8 {
        match self {
            NodeKind::File => 0,
            NodeKind::Dir => 1,
            NodeKind::Symlink => 2,
            NodeKind::Other => 3,
        }
    }

    fn from_code(code: u8) -> Result<NodeKind, DecodeError> {
        Ok(match code {
            0 => NodeKind::File,
            1 => NodeKind::Dir,
            2 => NodeKind::Symlink,
            3 => NodeKind::Other,
            other => {
                return Err(DecodeError::Unknown {
                    what: "node kind",
                    value: other.into(),
                })
            }
        })
    }
}

/// Metadata of one name, as `lstat` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub kind: NodeKind,
    pub size: u64,
    /// Permission bits, set-id and sticky bits included (at most [`MODE_BITS`]).
    pub mode: u32,
    pub mtime_sec: i64,
    pub mtime_nsec: u32,
    /// Symlinks only: the target, as stored (never resolved by the server).
    pub link_target: Vec<u8>,
}

/// One entry of a listing: its path relative to the directory listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub path: RelPath,
    pub kind: NodeKind,
    /// Present in long listings.
    pub meta: Option<Meta>,
}

impl ListEntry {
    /// Bytes this entry takes in a list page.
    pub fn encoded_len(&self) -> usize {
        let meta = self
            .meta
            .as_ref()
            .map_or(0, |m| META_MIN_LEN + m.link_target.len());
        4 + self.path.as_bytes().len() + 1 + 1 + meta
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListPage {
    pub entries: Vec<ListEntry>,
    /// More pages follow for the same request.
    pub more: bool,
}

/// Cuts a stream of entries into pages that each fit a frame: at most
/// [`MAX_LIST_ENTRIES`] entries and [`LIST_PAGE_BYTES`] of them (the largest possible
/// entry is far below what is left of a frame past that).
#[derive(Debug, Default)]
pub struct ListPager {
    entries: Vec<ListEntry>,
    bytes: usize,
}

impl ListPager {
    pub fn new() -> ListPager {
        ListPager::default()
    }

    /// Adds `entry`; when it does not fit the page being filled, that page is returned
    /// (to be sent with `more` set) and `entry` starts the next one.
    pub fn push(&mut self, entry: ListEntry) -> Option<ListPage> {
        let len = entry.encoded_len();
        let full = !self.entries.is_empty()
            && (self.entries.len() == MAX_LIST_ENTRIES || self.bytes + len > LIST_PAGE_BYTES);
        let page = full.then(|| ListPage {
            entries: std::mem::take(&mut self.entries),
            more: true,
        });
        if full {
            self.bytes = 0;
        }
        self.bytes += len;
        self.entries.push(entry);
        page
    }

    /// The last page of the listing.
    pub fn finish(self) -> ListPage {
        ListPage {
            entries: self.entries,
            more: false,
        }
    }
}

/// Why an operation failed, precisely enough for a client to map it onto an `errno`
/// (gfal2 callers test for `ENOENT`, `EEXIST`, ...) without parsing the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpFailure {
    /// Anything the codes below do not name; the message says what.
    Other,
    NotFound,
    Exists,
    NotDir,
    IsDir,
    NotEmpty,
    /// The server's file system refused (permissions).
    PermissionDenied,
    /// The path goes through a symlink or would leave the root.
    Escapes,
    /// The name is the server's own (its temporaries and state start with `.wanxfer`),
    /// or the root itself where an entry beneath it is needed.
    Reserved,
    NoSpace,
    /// A request that cannot be done as asked (moving a directory into itself, say).
    Invalid,
    /// A limit of the server (tree depth, busy).
    Limit,
    /// The server's disk failed.
    Io,
}

impl OpFailure {
    const ALL: [OpFailure; 13] = [
        OpFailure::Other,
        OpFailure::NotFound,
        OpFailure::Exists,
        OpFailure::NotDir,
        OpFailure::IsDir,
        OpFailure::NotEmpty,
        OpFailure::PermissionDenied,
        OpFailure::Escapes,
        OpFailure::Reserved,
        OpFailure::NoSpace,
        OpFailure::Invalid,
        OpFailure::Limit,
        OpFailure::Io,
    ];

    fn code(self) -> u8 {
        match self {
            OpFailure::Other => 0,
            OpFailure::NotFound => 1,
            OpFailure::Exists => 2,
            OpFailure::NotDir => 3,
            OpFailure::IsDir => 4,
            OpFailure::NotEmpty => 5,
            OpFailure::PermissionDenied => 6,
            OpFailure::Escapes => 7,
            OpFailure::Reserved => 8,
            OpFailure::NoSpace => 9,
            OpFailure::Invalid => 10,
            OpFailure::Limit => 11,
            OpFailure::Io => 12,
        }
    }

    fn from_code(code: u8) -> Result<OpFailure, DecodeError> {
        Self::ALL
            .into_iter()
            .find(|f| f.code() == code)
            .ok_or(DecodeError::Unknown {
                what: "operation failure",
                value: code.into(),
            })
    }
}

/// A failed operation. The connection stays usable for the next request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError {
    pub class: FailureClass,
    pub failure: OpFailure,
    pub message: Vec<u8>,
}

impl OpError {
    /// An error whose message is cut to [`MAX_MESSAGE_BYTES`].
    pub fn new(class: FailureClass, failure: OpFailure, message: &str) -> OpError {
        let mut message = message.as_bytes().to_vec();
        message.truncate(MAX_MESSAGE_BYTES);
        OpError {
            class,
            failure,
            message,
        }
    }
}

/// The server's answer to an [`OpRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpReply {
    Meta(Meta),
    List(ListPage),
    Checksum {
        algorithm: ChecksumAlgorithm,
        /// In the order the digest is printed (big-endian for the 32-bit sums).
        digest: Vec<u8>,
    },
    /// A mkdir, remove or rename succeeded.
    Done,
    Error(OpError),
    /// Not final: the operation is still running, `done` units in (bytes hashed,
    /// entries removed).
    Progress {
        done: u64,
    },
    /// The answer to [`OpRequest::Grant`].
    Granted(Granted),
    /// Not final: how far a [`OpRequest::PushTo`] is.
    TransferProgress(TransferProgress),
    /// How a [`OpRequest::PushTo`] ended, successful or not.
    TransferDone(TransferSummary),
}

impl OpReply {
    /// Whether this reply ends its request.
    pub fn is_final(&self) -> bool {
        match self {
            OpReply::List(page) => !page.more,
            OpReply::Progress { .. } | OpReply::TransferProgress(_) => false,
            _ => true,
        }
    }
}

/// Smallest encoding of a [`Meta`]: kind, size, mode, mtime, empty target.
const META_MIN_LEN: usize = 1 + 8 + 4 + 8 + 4 + 4;
/// Smallest encoding of a [`ListEntry`]: empty path, kind, no metadata.
const LIST_ENTRY_MIN_LEN: usize = 4 + 1 + 1;

const LIST_RECURSIVE: u8 = 1 << 0;
const LIST_LONG: u8 = 1 << 1;
const MKDIR_PARENTS: u8 = 1 << 0;

pub(crate) fn encode_request(r: &OpRequest, e: &mut Encoder) {
    match r {
        OpRequest::Stat { path } => {
            e.u8(1);
            e.bytes(path.as_bytes());
        }
        OpRequest::List {
            path,
            recursive,
            long,
        } => {
            e.u8(2);
            e.bytes(path.as_bytes());
            let mut flags = 0;
            if *recursive {
                flags |= LIST_RECURSIVE;
            }
            if *long {
                flags |= LIST_LONG;
            }
            e.u8(flags);
        }
        OpRequest::Mkdir {
            path,
            parents,
            mode,
        } => {
            e.u8(3);
            e.bytes(path.as_bytes());
            e.u8(if *parents { MKDIR_PARENTS } else { 0 });
            e.u32(*mode);
        }
        OpRequest::Remove { path, mode } => {
            e.u8(4);
            e.bytes(path.as_bytes());
            e.u8(match mode {
                RemoveMode::NotDir => 0,
                RemoveMode::EmptyDir => 1,
                RemoveMode::Recursive => 2,
            });
        }
        OpRequest::Rename { from, to } => {
            e.u8(5);
            e.bytes(from.as_bytes());
            e.bytes(to.as_bytes());
        }
        OpRequest::Checksum { path, algorithm } => {
            e.u8(6);
            e.bytes(path.as_bytes());
            e.u8(algorithm.code());
        }
        OpRequest::Grant(g) => {
            e.u8(7);
            tpc::encode_grant(g, e);
        }
        OpRequest::PushTo(p) => {
            e.u8(8);
            tpc::encode_push(p, e);
        }
    }
}

pub(crate) fn decode_request(d: &mut Decoder) -> Result<OpRequest, DecodeError> {
    Ok(match d.u8()? {
        1 => OpRequest::Stat {
            path: decode_path(d)?,
        },
        2 => {
            let path = decode_path(d)?;
            let flags = d.u8()?;
            if flags & !(LIST_RECURSIVE | LIST_LONG) != 0 {
                return Err(DecodeError::Unknown {
                    what: "list flags",
                    value: flags.into(),
                });
            }
            OpRequest::List {
                path,
                recursive: flags & LIST_RECURSIVE != 0,
                long: flags & LIST_LONG != 0,
            }
        }
        3 => {
            let path = decode_path(d)?;
            let flags = d.u8()?;
            if flags & !MKDIR_PARENTS != 0 {
                return Err(DecodeError::Unknown {
                    what: "mkdir flags",
                    value: flags.into(),
                });
            }
            let mode = d.u32()?;
            if mode & !MODE_BITS != 0 {
                return Err(DecodeError::Invalid("mkdir mode has bits beyond 07777"));
            }
            OpRequest::Mkdir {
                path,
                parents: flags & MKDIR_PARENTS != 0,
                mode,
            }
        }
        4 => {
            let path = decode_path(d)?;
            let mode = match d.u8()? {
                0 => RemoveMode::NotDir,
                1 => RemoveMode::EmptyDir,
                2 => RemoveMode::Recursive,
                other => {
                    return Err(DecodeError::Unknown {
                        what: "remove mode",
                        value: other.into(),
                    })
                }
            };
            OpRequest::Remove { path, mode }
        }
        5 => OpRequest::Rename {
            from: decode_path(d)?,
            to: decode_path(d)?,
        },
        6 => OpRequest::Checksum {
            path: decode_path(d)?,
            algorithm: ChecksumAlgorithm::from_code(d.u8()?)?,
        },
        7 => OpRequest::Grant(tpc::decode_grant(d)?),
        8 => OpRequest::PushTo(tpc::decode_push(d)?),
        other => {
            return Err(DecodeError::Unknown {
                what: "operation",
                value: other.into(),
            })
        }
    })
}

pub(crate) fn encode_reply(r: &OpReply, e: &mut Encoder) {
    match r {
        OpReply::Meta(meta) => {
            e.u8(1);
            encode_meta(meta, e);
        }
        OpReply::List(page) => {
            e.u8(2);
            e.u8(u8::from(page.more));
            e.u32(page.entries.len() as u32);
            for entry in &page.entries {
                e.bytes(entry.path.as_bytes());
                e.u8(entry.kind.code());
                match &entry.meta {
                    None => e.u8(0),
                    Some(meta) => {
                        e.u8(1);
                        encode_meta(meta, e);
                    }
                }
            }
        }
        OpReply::Checksum { algorithm, digest } => {
            e.u8(3);
            e.u8(algorithm.code());
            e.bytes(digest);
        }
        OpReply::Done => e.u8(4),
        OpReply::Error(err) => {
            e.u8(5);
            e.u8(encode_class(err.class));
            e.u8(err.failure.code());
            e.bytes(&err.message);
        }
        OpReply::Progress { done } => {
            e.u8(6);
            e.u64(*done);
        }
        OpReply::Granted(g) => {
            e.u8(7);
            tpc::encode_granted(g, e);
        }
        OpReply::TransferProgress(p) => {
            e.u8(8);
            tpc::encode_progress(p, e);
        }
        OpReply::TransferDone(s) => {
            e.u8(9);
            tpc::encode_summary(s, e);
        }
    }
}

pub(crate) fn decode_reply(d: &mut Decoder) -> Result<OpReply, DecodeError> {
    Ok(match d.u8()? {
        1 => OpReply::Meta(decode_meta(d)?),
        2 => {
            let more = decode_bool(d, "list continuation flag")?;
            let n = d.count("list entries", MAX_LIST_ENTRIES, LIST_ENTRY_MIN_LEN)?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                let path = decode_path(d)?;
                let kind = NodeKind::from_code(d.u8()?)?;
                let meta = if decode_bool(d, "list entry metadata flag")? {
                    let meta = decode_meta(d)?;
                    if meta.kind != kind {
                        return Err(DecodeError::Invalid(
                            "a list entry's metadata names another kind",
                        ));
                    }
                    Some(meta)
                } else {
                    None
                };
                entries.push(ListEntry { path, kind, meta });
            }
            OpReply::List(ListPage { entries, more })
        }
        3 => {
            let algorithm = ChecksumAlgorithm::from_code(d.u8()?)?;
            let digest = d.bytes("digest", MAX_DIGEST_BYTES)?.to_vec();
            if digest.len() != algorithm.digest_len() {
                return Err(DecodeError::Invalid(
                    "digest length does not match its algorithm",
                ));
            }
            OpReply::Checksum { algorithm, digest }
        }
        4 => OpReply::Done,
        5 => OpReply::Error(OpError {
            class: decode_class(d.u8()?)?,
            failure: OpFailure::from_code(d.u8()?)?,
            message: d.bytes("error message", MAX_MESSAGE_BYTES)?.to_vec(),
        }),
        6 => OpReply::Progress { done: d.u64()? },
        7 => OpReply::Granted(tpc::decode_granted(d)?),
        8 => OpReply::TransferProgress(tpc::decode_progress(d)?),
        9 => OpReply::TransferDone(tpc::decode_summary(d)?),
        other => {
            return Err(DecodeError::Unknown {
                what: "operation reply",
                value: other.into(),
            })
        }
    })
}

fn encode_meta(m: &Meta, e: &mut Encoder) {
    e.u8(m.kind.code());
    e.u64(m.size);
    e.u32(m.mode);
    e.i64(m.mtime_sec);
    e.u32(m.mtime_nsec);
    e.bytes(&m.link_target);
}

fn decode_meta(d: &mut Decoder) -> Result<Meta, DecodeError> {
    let meta = Meta {
        kind: NodeKind::from_code(d.u8()?)?,
        size: d.u64()?,
        mode: d.u32()?,
        mtime_sec: d.i64()?,
        mtime_nsec: d.u32()?,
        link_target: d.bytes("symlink target", MAX_PATH_BYTES)?.to_vec(),
    };
    if meta.mode & !MODE_BITS != 0 {
        return Err(DecodeError::Invalid("mode has bits beyond 07777"));
    }
    if meta.mtime_nsec >= 1_000_000_000 {
        return Err(DecodeError::Invalid("mtime nanoseconds out of range"));
    }
    if meta.kind != NodeKind::Symlink && !meta.link_target.is_empty() {
        return Err(DecodeError::Invalid("only symlinks have a target"));
    }
    if meta.link_target.contains(&0) {
        return Err(DecodeError::Invalid("symlink target contains NUL"));
    }
    Ok(meta)
}

/// A flag byte that must be 0 or 1, so that every message has exactly one encoding.
fn decode_bool(d: &mut Decoder, what: &'static str) -> Result<bool, DecodeError> {
    match d.u8()? {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(DecodeError::Unknown {
            what,
            value: other.into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode_frame, encode_frame, Message};

    fn rel(s: &str) -> RelPath {
        RelPath::new(s.as_bytes()).unwrap()
    }

    fn round_trip(msg: Message) {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        assert_eq!(decode_frame(&buf).unwrap(), msg);
    }

    #[test]
    fn algorithms_are_named_in_any_case() {
        assert_eq!(
            ChecksumAlgorithm::from_name("ADLER32"),
            Some(ChecksumAlgorithm::Adler32)
        );
        assert_eq!(
            ChecksumAlgorithm::from_name("xxh3"),
            Some(ChecksumAlgorithm::Xxh3)
        );
        assert_eq!(ChecksumAlgorithm::from_name("sha1"), None);
    }

    /// The largest entry the protocol allows (longest path, longest target) still leaves
    /// a page that fits a frame, whatever was in the page before it.
    #[test]
    fn a_full_page_of_the_largest_entries_fits_a_frame() {
        let long_name = |c: u8| {
            let parts: Vec<Vec<u8>> = (0..16).map(|_| vec![c; 255]).collect();
            RelPath::new(&parts.join(&b'/')).unwrap()
        };
        let biggest = ListEntry {
            path: long_name(b'p'),
            kind: NodeKind::Symlink,
            meta: Some(Meta {
                kind: NodeKind::Symlink,
                size: u64::MAX,
                mode: 0o7777,
                mtime_sec: i64::MIN,
                mtime_nsec: 999_999_999,
                link_target: vec![b't'; MAX_PATH_BYTES],
            }),
        };
        let mut pager = ListPager::new();
        let page = loop {
            if let Some(page) = pager.push(biggest.clone()) {
                break page;
            }
        };
        assert!(page.entries.len() > 1 && page.more);
        let mut buf = Vec::new();
        let msg = Message::OpReply(OpReply::List(page));
        encode_frame(&msg, &mut buf);
        assert!(buf.len() - crate::FrameHeader::LEN <= MAX_FRAME_BODY);
        assert_eq!(decode_frame(&buf).unwrap(), msg);
    }

    #[test]
    fn a_page_stops_at_the_entry_limit() {
        let small = ListEntry {
            path: rel("f"),
            kind: NodeKind::File,
            meta: None,
        };
        let mut pager = ListPager::new();
        let page = loop {
            if let Some(page) = pager.push(small.clone()) {
                break page;
            }
        };
        assert_eq!(page.entries.len(), MAX_LIST_ENTRIES);
        assert_eq!(
            pager.finish().entries.len(),
            1,
            "the entry that did not fit"
        );
        round_trip(Message::OpReply(OpReply::List(page)));
    }

    #[test]
    fn a_digest_of_the_wrong_length_is_refused() {
        let msg = Message::OpReply(OpReply::Checksum {
            algorithm: ChecksumAlgorithm::Adler32,
            digest: vec![1, 2, 3, 4, 5],
        });
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        assert_eq!(
            decode_frame(&buf),
            Err(DecodeError::Invalid(
                "digest length does not match its algorithm"
            ))
        );
    }

    #[test]
    fn a_mkdir_mode_beyond_the_permission_bits_is_refused() {
        let msg = Message::OpRequest(OpRequest::Mkdir {
            path: rel("d"),
            parents: false,
            mode: 0o10755,
        });
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        assert!(decode_frame(&buf).is_err());
    }

    #[test]
    fn flag_bytes_have_one_encoding() {
        let msg = Message::OpRequest(OpRequest::List {
            path: rel("d"),
            recursive: true,
            long: false,
        });
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        let body = &mut buf[crate::FrameHeader::LEN..];
        let last = body.len() - 1;
        body[last] |= 0x80;
        assert!(Message::decode(40, body).is_err());
    }
}
