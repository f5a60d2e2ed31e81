//! Third-party copy: the requests a client makes of two servers so that data moves from
//! one to the other without passing through the client.
//!
//! Why a grant rather than handing the source server the destination's secret: the
//! client holds credentials for both servers, but the source should get only what this
//! one copy needs. So the client asks the destination (B) for a [`Grant`]: B makes up an
//! id and a secret, remembers them with the one path they may write and a deadline, and
//! answers with them ([`crate::ops::OpReply::Granted`]). The client passes them to the
//! source (A) in a [`PushTo`], together with B's address and the fingerprint of the
//! certificate the client saw and verified on B, so that A pins B exactly. A connects to
//! B as an ordinary client would, except that it proves the grant
//! ([`crate::Message::GrantProof`], see [`crate::handshake`]) instead of the shared
//! secret, and pushes; B confines that session to the granted path, as a push, for one
//! transfer. A tells the client how it goes ([`TransferProgress`]) and how it ended
//! ([`TransferSummary`]) over the client's own control connection.
//!
//! Both requests ride the remote operations' connection (frame kinds 40 and 41) and are
//! only sent to a server that offered [`crate::features::THIRD_PARTY`].
//!
//! `cp --preserve` between two servers: the client asks B for a grant that names the
//! `PRESERVE_*` session flags the push may carry, and tells A the same flags, so that a
//! grant made for a plain copy cannot be used to set owners or attributes. Those fields,
//! and the destination's notes in the summary, are written only when there is something
//! in them (so a plain copy's messages are what they were before), and asked of a server
//! only if it offered [`crate::features::THIRD_PARTY_PRESERVE`].
//!
//! What this module does not do: decide how long a grant lives or what it may name (the
//! server's grant table does); here every field is only checked to be well formed and
//! bounded.

use crate::codec::{Decoder, Encoder};
use crate::message::{
    decode_class, decode_path, decode_selection, encode_class, encode_selection, FailureClass,
    MAX_MESSAGE_BYTES,
};
use crate::{session_flags, Compare, DecodeError, RelPath, Selection};

/// Longest `HOST:PORT` a [`PushTo`] may name: a DNS name (253) in brackets, a colon and
/// five digits.
pub const MAX_SERVER_NAME_BYTES: usize = 262;
/// Most sources one [`PushTo`] names (as `cp SRC... DST` does).
pub const MAX_PUSH_SOURCES: usize = 1024;
/// Most failed files a [`TransferSummary`] lists; the count covers the rest.
pub const MAX_REPORTED_FAILURES: usize = 64;
/// Longest text a summary carries for the encryption in use.
pub const MAX_ENCRYPTION_NAME_BYTES: usize = 64;
/// Most notes (what the destination could not keep, once per kind) a summary carries:
/// as many as one session keeps.
pub const MAX_REPORTED_NOTES: usize = 32;
/// Longest life a client may ask for a grant: a grant is a credential, so it should not
/// outlive the start of the copy it was made for by much.
pub const MAX_GRANT_TTL_S: u32 = 600;

/// `PushTo` flags.
pub mod push_flags {
    /// Start over instead of resuming (the receiver keeps no journal).
    pub const NO_RESUME: u32 = 1 << 0;
    /// No segment digests (files renamed into place unverified).
    pub const NO_FILE_DIGEST: u32 = 1 << 1;
    /// With `NO_FILE_DIGEST`: no block CRC either.
    pub const NO_BLOCK_CHECKSUM: u32 = 1 << 2;
    pub const ALL: u32 = NO_RESUME | NO_FILE_DIGEST | NO_BLOCK_CHECKSUM;
}

/// Asks a destination for a grant: one push into `path`, starting within `ttl_s`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub path: RelPath,
    /// Seconds, 1 to [`MAX_GRANT_TTL_S`]; the server may shorten it.
    pub ttl_s: u32,
    /// The `PRESERVE_*` [`session_flags`] the push may ask (0: a plain copy).
    pub preserve: u32,
}

/// A grant as the destination made it.
#[derive(Clone, PartialEq, Eq)]
pub struct Granted {
    pub id: [u8; 16],
    pub secret: [u8; 32],
    /// Seconds it stays usable for starting a session.
    pub ttl_s: u32,
}

impl std::fmt::Debug for Granted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Granted")
            .field("id", &self.id)
            .field("ttl_s", &self.ttl_s)
            .finish_non_exhaustive()
    }
}

/// Asks a source to push `sources` (beneath its root) to `dest` on server `server`.
#[derive(Clone, PartialEq, Eq)]
pub struct PushTo {
    pub sources: Vec<RelPath>,
    /// `HOST:PORT` of the destination, as the client reached it.
    pub server: Vec<u8>,
    /// SHA-256 of the destination's TLS certificate as the client verified it.
    pub fingerprint: [u8; 32],
    pub dest: RelPath,
    /// The destination was written with a trailing slash: the sources go into it.
    pub into: bool,
    pub grant: Granted,
    pub streams: u16,
    pub block_size: u32,
    pub depth: u16,
    pub compare: Compare,
    /// [`push_flags`].
    pub flags: u32,
    /// The `PRESERVE_*` [`session_flags`] to ask of the destination, as the grant allows.
    pub preserve: u32,
    /// What of the sources to send (`--exclude`, `--include`, `--files-from`), applied by
    /// the source as it walks; empty sends everything. Only to a server that offered
    /// [`crate::features::THIRD_PARTY_SELECT`].
    pub selection: Selection,
}

impl std::fmt::Debug for PushTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PushTo")
            .field("sources", &self.sources)
            .field("server", &String::from_utf8_lossy(&self.server))
            .field("dest", &self.dest)
            .field("into", &self.into)
            .field("grant", &self.grant)
            .field("selection", &self.selection)
            .finish_non_exhaustive()
    }
}

/// Where a third-party push stands (not final).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferProgress {
    pub bytes: u64,
    pub bytes_skipped: u64,
    pub files: u64,
    pub total_bytes: u64,
    pub total_files: u64,
    pub failed_files: u64,
}

/// How a third-party push ended (final): what a client's own report would say, with the
/// source's CPU as this side's and the destination's as the peer's.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TransferSummary {
    pub bytes: u64,
    pub bytes_skipped: u64,
    pub files: u64,
    pub files_up_to_date: u64,
    pub failed_files: u64,
    pub attempts: u32,
    pub channels_lost: u64,
    pub micros: u64,
    pub cpu_user_us: u64,
    pub cpu_sys_us: u64,
    pub peer_cpu_user_us: u64,
    pub peer_cpu_sys_us: u64,
    pub streams: u16,
    pub block_size: u32,
    pub depth: u16,
    pub encryption: Vec<u8>,
    /// The first failed files (at most [`MAX_REPORTED_FAILURES`]), each with its class.
    pub failures: Vec<(FailureClass, Vec<u8>)>,
    /// Why the transfer as a whole failed, if it did.
    pub error: Option<(FailureClass, Vec<u8>)>,
    /// What the destination could not keep of what `--preserve` asked, once per kind (at
    /// most [`MAX_REPORTED_NOTES`]).
    pub notes: Vec<Vec<u8>>,
}

pub(crate) fn encode_grant(g: &Grant, e: &mut Encoder) {
    e.bytes(g.path.as_bytes());
    e.u32(g.ttl_s);
    encode_preserve(g.preserve, e);
}

/// Preserve flags are written only when there are any: a plain copy's requests stay
/// what they were before the field existed, and have one encoding.
fn encode_preserve(preserve: u32, e: &mut Encoder) {
    if preserve != 0 {
        e.u32(preserve);
    }
}

fn decode_preserve(d: &mut Decoder) -> Result<u32, DecodeError> {
    if d.remaining() == 0 {
        return Ok(0);
    }
    match d.u32()? {
        0 => Err(DecodeError::Invalid(
            "preserve flags are left out, not written as 0",
        )),
        flags if flags & !session_flags::PRESERVE_ALL != 0 => Err(DecodeError::Unknown {
            what: "preserve flags",
            value: flags.into(),
        }),
        flags => Ok(flags),
    }
}

pub(crate) fn decode_grant(d: &mut Decoder) -> Result<Grant, DecodeError> {
    let path = decode_path(d)?;
    let ttl_s = d.u32()?;
    if ttl_s == 0 || ttl_s > MAX_GRANT_TTL_S {
        return Err(DecodeError::Invalid("a grant lives 1 to 600 seconds"));
    }
    let preserve = decode_preserve(d)?;
    Ok(Grant {
        path,
        ttl_s,
        preserve,
    })
}

pub(crate) fn encode_granted(g: &Granted, e: &mut Encoder) {
    e.raw(&g.id);
    e.raw(&g.secret);
    e.u32(g.ttl_s);
}

pub(crate) fn decode_granted(d: &mut Decoder) -> Result<Granted, DecodeError> {
    let g = Granted {
        id: d.array()?,
        secret: d.array()?,
        ttl_s: d.u32()?,
    };
    if g.ttl_s == 0 || g.ttl_s > MAX_GRANT_TTL_S {
        return Err(DecodeError::Invalid("a grant lives 1 to 600 seconds"));
    }
    Ok(g)
}

fn encode_compare(c: Compare) -> u8 {
    match c {
        Compare::Always => 0,
        Compare::QuickCheck => 1,
        Compare::Checksum => 2,
    }
}

fn decode_compare(v: u8) -> Result<Compare, DecodeError> {
    Ok(match v {
        0 => Compare::Always,
        1 => Compare::QuickCheck,
        2 => Compare::Checksum,
        other => {
            return Err(DecodeError::Unknown {
                what: "compare mode",
                value: other.into(),
            })
        }
    })
}

pub(crate) fn encode_push(p: &PushTo, e: &mut Encoder) {
    e.u32(p.sources.len() as u32);
    p.sources.iter().for_each(|s| e.bytes(s.as_bytes()));
    e.bytes(&p.server);
    e.raw(&p.fingerprint);
    e.bytes(p.dest.as_bytes());
    e.u8(u8::from(p.into));
    encode_granted(&p.grant, e);
    e.u16(p.streams);
    e.u32(p.block_size);
    e.u16(p.depth);
    e.u8(encode_compare(p.compare));
    e.u32(p.flags);
    // A selection follows the preserve flags, which it then needs written even when
    // they are 0; without one, a request is what it was before selections travelled.
    if p.selection.is_empty() {
        encode_preserve(p.preserve, e);
    } else {
        e.u32(p.preserve);
        encode_selection(&p.selection, e);
    }
}

/// The preserve flags and the selection that end a [`PushTo`]: each written only when
/// there is something in it (the flags also when a selection follows them).
fn decode_push_tail(d: &mut Decoder) -> Result<(u32, Selection), DecodeError> {
    if d.remaining() == 0 {
        return Ok((0, Selection::default()));
    }
    let preserve = d.u32()?;
    if preserve & !session_flags::PRESERVE_ALL != 0 {
        return Err(DecodeError::Unknown {
            what: "preserve flags",
            value: preserve.into(),
        });
    }
    if d.remaining() == 0 {
        if preserve == 0 {
            return Err(DecodeError::Invalid(
                "preserve flags are left out, not written as 0",
            ));
        }
        return Ok((preserve, Selection::default()));
    }
    Ok((preserve, decode_selection(d)?))
}

pub(crate) fn decode_push(d: &mut Decoder) -> Result<PushTo, DecodeError> {
    let n = d.count("push sources", MAX_PUSH_SOURCES, 4)?;
    if n == 0 {
        return Err(DecodeError::Invalid("a push names at least one source"));
    }
    let sources = (0..n)
        .map(|_| decode_path(d))
        .collect::<Result<Vec<_>, _>>()?;
    let server = d.bytes("server name", MAX_SERVER_NAME_BYTES)?.to_vec();
    if server.is_empty() || !server.iter().all(|b| b.is_ascii_graphic()) {
        return Err(DecodeError::Invalid(
            "a server name is printable ASCII HOST:PORT",
        ));
    }
    let fingerprint = d.array()?;
    let dest = decode_path(d)?;
    let into = match d.u8()? {
        0 => false,
        1 => true,
        other => {
            return Err(DecodeError::Unknown {
                what: "push into flag",
                value: other.into(),
            })
        }
    };
    let push = PushTo {
        sources,
        server,
        fingerprint,
        dest,
        into,
        grant: decode_granted(d)?,
        streams: d.u16()?,
        block_size: d.u32()?,
        depth: d.u16()?,
        compare: decode_compare(d.u8()?)?,
        flags: d.u32()?,
        preserve: 0,
        selection: Selection::default(),
    };
    let (preserve, selection) = decode_push_tail(d)?;
    let push = PushTo {
        preserve,
        selection,
        ..push
    };
    if push.flags & !push_flags::ALL != 0 {
        return Err(DecodeError::Unknown {
            what: "push flags",
            value: push.flags.into(),
        });
    }
    Ok(push)
}

pub(crate) fn encode_progress(p: &TransferProgress, e: &mut Encoder) {
    for v in [
        p.bytes,
        p.bytes_skipped,
        p.files,
        p.total_bytes,
        p.total_files,
        p.failed_files,
    ] {
        e.u64(v);
    }
}

pub(crate) fn decode_progress(d: &mut Decoder) -> Result<TransferProgress, DecodeError> {
    Ok(TransferProgress {
        bytes: d.u64()?,
        bytes_skipped: d.u64()?,
        files: d.u64()?,
        total_bytes: d.u64()?,
        total_files: d.u64()?,
        failed_files: d.u64()?,
    })
}

pub(crate) fn encode_summary(s: &TransferSummary, e: &mut Encoder) {
    for v in [
        s.bytes,
        s.bytes_skipped,
        s.files,
        s.files_up_to_date,
        s.failed_files,
    ] {
        e.u64(v);
    }
    e.u32(s.attempts);
    for v in [
        s.channels_lost,
        s.micros,
        s.cpu_user_us,
        s.cpu_sys_us,
        s.peer_cpu_user_us,
        s.peer_cpu_sys_us,
    ] {
        e.u64(v);
    }
    e.u16(s.streams);
    e.u32(s.block_size);
    e.u16(s.depth);
    e.bytes(&s.encryption);
    e.u32(s.failures.len() as u32);
    for (class, message) in &s.failures {
        e.u8(encode_class(*class));
        e.bytes(message);
    }
    match &s.error {
        None => e.u8(0),
        Some((class, message)) => {
            e.u8(1);
            e.u8(encode_class(*class));
            e.bytes(message);
        }
    }
    // As the preserve flags: only when there are any.
    if !s.notes.is_empty() {
        e.u32(s.notes.len() as u32);
        s.notes.iter().for_each(|n| e.bytes(n));
    }
}

pub(crate) fn decode_summary(d: &mut Decoder) -> Result<TransferSummary, DecodeError> {
    let mut s = TransferSummary {
        bytes: d.u64()?,
        bytes_skipped: d.u64()?,
        files: d.u64()?,
        files_up_to_date: d.u64()?,
        failed_files: d.u64()?,
        attempts: d.u32()?,
        channels_lost: d.u64()?,
        micros: d.u64()?,
        cpu_user_us: d.u64()?,
        cpu_sys_us: d.u64()?,
        peer_cpu_user_us: d.u64()?,
        peer_cpu_sys_us: d.u64()?,
        streams: d.u16()?,
        block_size: d.u32()?,
        depth: d.u16()?,
        encryption: d
            .bytes("encryption name", MAX_ENCRYPTION_NAME_BYTES)?
            .to_vec(),
        failures: Vec::new(),
        error: None,
        notes: Vec::new(),
    };
    let n = d.count("reported failures", MAX_REPORTED_FAILURES, 5)?;
    for _ in 0..n {
        let class = decode_class(d.u8()?)?;
        let message = d.bytes("failure message", MAX_MESSAGE_BYTES)?.to_vec();
        s.failures.push((class, message));
    }
    if s.failures.len() as u64 > s.failed_files {
        return Err(DecodeError::Invalid(
            "a summary lists more failed files than it counts",
        ));
    }
    s.error = match d.u8()? {
        0 => None,
        1 => Some((
            decode_class(d.u8()?)?,
            d.bytes("error message", MAX_MESSAGE_BYTES)?.to_vec(),
        )),
        other => {
            return Err(DecodeError::Unknown {
                what: "summary error flag",
                value: other.into(),
            })
        }
    };
    if d.remaining() > 0 {
        let n = d.count("notes", MAX_REPORTED_NOTES, 4)?;
        if n == 0 {
            return Err(DecodeError::Invalid(
                "notes are left out, not written as none",
            ));
        }
        for _ in 0..n {
            s.notes.push(d.bytes("note", MAX_MESSAGE_BYTES)?.to_vec());
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{OpReply, OpRequest};
    use crate::{decode_frame, encode_frame, Message};

    fn rel(s: &str) -> RelPath {
        RelPath::new(s.as_bytes()).unwrap()
    }

    fn push() -> PushTo {
        PushTo {
            sources: vec![rel("a/b"), rel("c")],
            server: b"[::1]:7800".to_vec(),
            fingerprint: [7; 32],
            dest: rel("d"),
            into: true,
            grant: Granted {
                id: [1; 16],
                secret: [2; 32],
                ttl_s: 60,
            },
            streams: 4,
            block_size: 4 << 20,
            depth: 4,
            compare: Compare::Checksum,
            flags: push_flags::NO_RESUME,
            preserve: 0,
            selection: Selection::default(),
        }
    }

    fn round_trip(msg: Message) {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        assert_eq!(decode_frame(&buf).unwrap(), msg);
    }

    fn refused(msg: Message) -> DecodeError {
        let mut buf = Vec::new();
        encode_frame(&msg, &mut buf);
        decode_frame(&buf).unwrap_err()
    }

    #[test]
    fn requests_and_replies_round_trip() {
        round_trip(Message::OpRequest(OpRequest::Grant(Grant {
            path: rel("x/y"),
            ttl_s: 600,
            preserve: 0,
        })));
        round_trip(Message::OpRequest(OpRequest::PushTo(push())));
        round_trip(Message::OpReply(OpReply::Granted(push().grant)));
        round_trip(Message::OpReply(OpReply::TransferProgress(
            TransferProgress {
                bytes: 1,
                total_bytes: 2,
                ..TransferProgress::default()
            },
        )));
        round_trip(Message::OpReply(OpReply::TransferDone(TransferSummary {
            bytes: 5,
            failed_files: 2,
            failures: vec![(FailureClass::Io, b"disk".to_vec())],
            error: Some((FailureClass::Auth, b"grant refused".to_vec())),
            encryption: b"TLS13_AES_128_GCM_SHA256".to_vec(),
            ..TransferSummary::default()
        })));
    }

    #[test]
    fn progress_is_not_final_and_the_summary_is() {
        assert!(!OpReply::TransferProgress(TransferProgress::default()).is_final());
        assert!(OpReply::TransferDone(TransferSummary::default()).is_final());
    }

    #[test]
    fn out_of_range_fields_are_refused() {
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::Grant(Grant {
                path: rel("x"),
                ttl_s: MAX_GRANT_TTL_S + 1,
                preserve: 0,
            }))),
            DecodeError::Invalid(_)
        ));
        let mut p = push();
        p.sources.clear();
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::PushTo(p))),
            DecodeError::Invalid(_)
        ));
        let mut p = push();
        p.server = b"host name:1".to_vec();
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::PushTo(p))),
            DecodeError::Invalid(_)
        ));
        let mut p = push();
        p.flags = 1 << 9;
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::PushTo(p))),
            DecodeError::Unknown { .. }
        ));
        let lying = TransferSummary {
            failed_files: 0,
            failures: vec![(FailureClass::Io, b"x".to_vec())],
            ..TransferSummary::default()
        };
        assert!(matches!(
            refused(Message::OpReply(OpReply::TransferDone(lying))),
            DecodeError::Invalid(_)
        ));
    }

    fn encoded(msg: &Message) -> Vec<u8> {
        let mut buf = Vec::new();
        encode_frame(msg, &mut buf);
        buf
    }

    /// `cp --preserve` between two servers: the flags travel in the grant and the push,
    /// the destination's notes in the summary; without them the frames are byte for
    /// byte what a server without [`crate::features::THIRD_PARTY_PRESERVE`] reads.
    #[test]
    fn preserve_flags_and_notes_round_trip_and_are_absent_from_plain_copies() {
        let keep = session_flags::PRESERVE_OWNER | session_flags::PRESERVE_SPARSE;
        let grant = |preserve| Grant {
            path: rel("x"),
            ttl_s: 60,
            preserve,
        };
        round_trip(Message::OpRequest(OpRequest::Grant(grant(keep))));
        let plain = encoded(&Message::OpRequest(OpRequest::Grant(grant(0))));
        let keeping = encoded(&Message::OpRequest(OpRequest::Grant(grant(keep))));
        assert_eq!(keeping.len(), plain.len() + 4);
        let mut p = push();
        p.preserve = session_flags::PRESERVE_ALL;
        round_trip(Message::OpRequest(OpRequest::PushTo(p.clone())));
        let plain = encoded(&Message::OpRequest(OpRequest::PushTo(push())));
        let keeping = encoded(&Message::OpRequest(OpRequest::PushTo(p)));
        assert_eq!(keeping.len(), plain.len() + 4);
        let noted = TransferSummary {
            notes: vec![b"owner and group not kept".to_vec(), b"x".to_vec()],
            ..TransferSummary::default()
        };
        round_trip(Message::OpReply(OpReply::TransferDone(noted)));
    }

    #[test]
    fn preserve_flags_out_of_range_are_refused() {
        let mut p = push();
        p.preserve = session_flags::DISCARD;
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::PushTo(p))),
            DecodeError::Unknown { .. }
        ));
        let grant = Grant {
            path: rel("x"),
            ttl_s: 60,
            preserve: session_flags::PRESERVE_XATTRS | 1 << 31,
        };
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::Grant(grant))),
            DecodeError::Unknown { .. }
        ));
        // A zero written out (a request has one encoding), and too many notes.
        let frame = encoded(&Message::OpRequest(OpRequest::PushTo(push())));
        let mut body = frame[crate::FrameHeader::LEN..].to_vec();
        body.extend_from_slice(&[0; 4]);
        assert!(matches!(
            Message::decode(frame[0], &body),
            Err(DecodeError::Invalid(_))
        ));
        let many = TransferSummary {
            notes: vec![b"n".to_vec(); MAX_REPORTED_NOTES + 1],
            ..TransferSummary::default()
        };
        assert!(matches!(
            refused(Message::OpReply(OpReply::TransferDone(many))),
            DecodeError::TooLong { .. }
        ));
    }

    fn selection() -> Selection {
        Selection {
            rules: vec![crate::SelectRule {
                include: false,
                pattern: b"*.tmp".to_vec(),
            }],
            files: Some(vec![rel("a/b/keep")]),
        }
    }

    /// `cp --exclude/--include/--files-from` between two servers: the selection follows
    /// the preserve flags, written as 0 when there are none; a push without one is byte
    /// for byte what a server without [`crate::features::THIRD_PARTY_SELECT`] reads.
    #[test]
    fn a_selection_rides_behind_the_preserve_flags() {
        for preserve in [0, session_flags::PRESERVE_OWNER] {
            let mut p = push();
            p.preserve = preserve;
            p.selection = selection();
            round_trip(Message::OpRequest(OpRequest::PushTo(p.clone())));
            p.selection = Selection::default();
            let without = encoded(&Message::OpRequest(OpRequest::PushTo(p.clone())));
            p.selection = selection();
            let with = encoded(&Message::OpRequest(OpRequest::PushTo(p)));
            let flags = if preserve == 0 { 4 } else { 0 };
            assert!(with.len() > without.len() + flags, "{preserve}");
        }
        // An empty selection written out after the flags is refused: one encoding.
        let frame = encoded(&Message::OpRequest(OpRequest::PushTo(push())));
        let mut body = frame[crate::FrameHeader::LEN..].to_vec();
        body.extend_from_slice(&[0; 4]);
        body.extend_from_slice(&[0, 0, 0, 0, 0]);
        assert!(matches!(
            Message::decode(frame[0], &body),
            Err(DecodeError::Invalid(_))
        ));
        // A pattern past its limit, and a truncated list, are refused too.
        let mut p = push();
        p.selection.rules = vec![crate::SelectRule {
            include: true,
            pattern: vec![b'x'; crate::MAX_PATTERN_BYTES + 1],
        }];
        assert!(matches!(
            refused(Message::OpRequest(OpRequest::PushTo(p))),
            DecodeError::TooLong { .. }
        ));
        let mut p = push();
        p.selection = selection();
        let frame = encoded(&Message::OpRequest(OpRequest::PushTo(p)));
        let body = &frame[crate::FrameHeader::LEN..frame.len() - 2];
        assert!(matches!(
            Message::decode(frame[0], body),
            Err(DecodeError::Truncated { .. })
        ));
    }

    /// Debug output never shows a grant's secret (requests are logged at debug level).
    #[test]
    fn secrets_stay_out_of_debug_output() {
        let shown = format!("{:?}", push());
        assert!(!shown.contains("2, 2, 2"), "{shown}");
    }
}
