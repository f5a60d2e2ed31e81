//! The engine's one error type.
//!
//! Variants keep the peer's faults (protocol, a refusal it reported) apart from ours
//! (local I/O) and from the network's, because each class has its own exit code and its
//! own remedy: fix the path, check the disk, check the link, or report a bug. Messages name
//! the peer, the file and the offset where there is one.

use std::fmt::Display;
use std::io;

use wanxfer_proto::ops::OpFailure;
use wanxfer_proto::{handshake::HandshakeError, DecodeError, ErrorMsg, FailureClass};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("invalid request: {0}")]
    Usage(String),
    #[error("authentication with {peer} failed: {detail}")]
    Auth { peer: String, detail: String },
    #[error("network: {context} {peer}: {source}")]
    Network {
        peer: String,
        context: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("protocol error from {peer}: {detail}")]
    Protocol { peer: String, detail: String },
    #[error("integrity: {path} at offset {offset}: {detail}")]
    Integrity {
        path: String,
        offset: u64,
        detail: String,
    },
    #[error("{op} {path}: {source}")]
    LocalIo {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("refused {path}: {reason}")]
    Refused { path: String, reason: String },
    /// The client authenticated but may not do this here (its identity is not listed
    /// for the export, or its token's scopes do not cover the path); `path` as the client
    /// named it.
    #[error("not authorized for {path}: {reason}")]
    Denied { path: String, reason: String },
    #[error("limit exceeded: {0}")]
    Limit(String),
    #[error("{peer} reported: {message}")]
    Remote {
        peer: String,
        class: FailureClass,
        message: String,
    },
    /// A remote operation failed beneath the server's root, with the reason a client maps
    /// onto an errno (gfal2) or shows; the message names the path relative to the root.
    #[error("{message}")]
    Op { failure: OpFailure, message: String },
    #[error("{} failed; first: {first}", count_of(*count, "file"))]
    Files { count: u64, first: Box<Error> },
    #[error("transfer cancelled")]
    Cancelled,
    /// A bug: a worker thread panicked. The session ends instead of hanging.
    #[error("internal error (please report it): {0}")]
    Internal(String),
}

/// How an error should end the program; `wanxfer` maps each to an exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    Usage,
    Auth,
    Network,
    Protocol,
    Integrity,
    LocalIo,
    /// The peer refused or failed on its side (path outside its root, its disk full).
    Remote,
    /// A bug of ours.
    Internal,
}

impl Error {
    pub fn local(op: &'static str, path: impl Display, source: io::Error) -> Self {
        Error::LocalIo {
            op,
            path: path.to_string(),
            source,
        }
    }

    /// A connection that failed: a network error, unless a TLS record on it failed
    /// authentication. That is a connection altered on the path (corruption TCP's
    /// checksum missed, or tampering), which no retry over the same path fixes, reported
    /// as a protocol error as an altered data channel's is.
    pub fn network(context: &'static str, peer: impl Display, source: io::Error) -> Self {
        if altered_on_the_path(&source) {
            return Error::Protocol {
                peer: peer.to_string(),
                detail: format!(
                    "{context} it: a TLS record failed authentication, so the connection                      was altered on the path ({source})"
                ),
            };
        }
        Error::Network {
            peer: peer.to_string(),
            context,
            source: explain_lost_connection(source),
        }
    }

    pub fn protocol(peer: impl Display, detail: impl Display) -> Self {
        Error::Protocol {
            peer: peer.to_string(),
            detail: detail.to_string(),
        }
    }

    pub fn decode(peer: impl Display, e: DecodeError) -> Self {
        Error::protocol(peer, e)
    }

    pub fn handshake(peer: impl Display, e: HandshakeError) -> Self {
        match e {
            HandshakeError::BadProof | HandshakeError::Denied(_) => Error::Auth {
                peer: peer.to_string(),
                detail: e.to_string(),
            },
            other => Error::protocol(peer, other),
        }
    }

    pub fn remote(peer: impl Display, msg: &ErrorMsg) -> Self {
        let message = String::from_utf8_lossy(&msg.message).into_owned();
        match msg.class {
            FailureClass::Auth => Error::Auth {
                peer: peer.to_string(),
                detail: message,
            },
            class => Error::Remote {
                peer: peer.to_string(),
                class,
                message,
            },
        }
    }

    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Usage(_) => ErrorClass::Usage,
            Error::Auth { .. } | Error::Denied { .. } => ErrorClass::Auth,
            Error::Network { .. } | Error::Cancelled => ErrorClass::Network,
            Error::Protocol { .. } => ErrorClass::Protocol,
            Error::Integrity { .. } => ErrorClass::Integrity,
            Error::LocalIo { .. } | Error::Limit(_) => ErrorClass::LocalIo,
            Error::Refused { .. } | Error::Op { .. } => ErrorClass::Remote,
            Error::Remote { class, .. } => match class {
                FailureClass::Protocol => ErrorClass::Protocol,
                FailureClass::Integrity => ErrorClass::Integrity,
                FailureClass::Auth => ErrorClass::Auth,
                FailureClass::Network => ErrorClass::Network,
                _ => ErrorClass::Remote,
            },
            Error::Files { first, .. } => first.class(),
            Error::Internal(_) => ErrorClass::Internal,
        }
    }

    /// The class a peer is told when this error ends a file or a session on our side.
    pub fn wire_class(&self) -> FailureClass {
        match self {
            Error::Auth { .. } | Error::Denied { .. } => FailureClass::Auth,
            Error::Protocol { .. } => FailureClass::Protocol,
            Error::Integrity { .. } => FailureClass::Integrity,
            Error::LocalIo { .. } => FailureClass::Io,
            Error::Refused { .. } | Error::Usage(_) => FailureClass::Refused,
            Error::Limit(_) => FailureClass::Limit,
            Error::Op { failure, .. } => match failure {
                OpFailure::Io | OpFailure::NoSpace => FailureClass::Io,
                OpFailure::Limit => FailureClass::Limit,
                _ => FailureClass::Refused,
            },
            Error::Remote { class, .. } => *class,
            Error::Files { first, .. } => first.wire_class(),
            // Stopped on purpose (a server draining, a user's Ctrl-C): the peer may try
            // again later and resume, as it would with a busy server.
            Error::Cancelled => FailureClass::Limit,
            Error::Network { .. } | Error::Internal(_) => FailureClass::Internal,
        }
    }
}

/// "Broken pipe" and "Connection reset by peer" are what a vanished peer looks like from
/// whichever socket noticed first; say so in words an operator acts on.
/// Whether `e` is rustls refusing a record that failed authentication (it wraps its
/// error in `InvalidData`).
fn altered_on_the_path(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidData
        && e.get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .is_some_and(|tls| matches!(tls, rustls::Error::DecryptError))
}

fn explain_lost_connection(e: io::Error) -> io::Error {
    use io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    match e.kind() {
        kind @ (BrokenPipe | ConnectionReset | ConnectionAborted) => {
            io::Error::new(kind, format!("connection lost, the peer went away ({e})"))
        }
        _ => e,
    }
}

/// "1 file", "2 files": a count with its noun as a person writes it, never "file(s)".
pub(crate) fn count_of(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod plural_tests {
    use super::*;

    /// A TLS record that fails authentication on a connection (the corruption test in
    /// `tests/wan.rs` met it on the control connection) is the path altering it, not the
    /// network failing: a protocol error, which is not retried. Anything else stays a
    /// network error.
    #[test]
    fn a_record_failing_authentication_is_not_a_network_error() {
        let altered = io::Error::new(io::ErrorKind::InvalidData, rustls::Error::DecryptError);
        let e = Error::network("receiving from", "peer:1", altered);
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        assert_eq!(e.class(), ErrorClass::Protocol);
        assert!(e.to_string().contains("altered on the path"), "{e}");
        let other = io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::FailedToGetCurrentTime,
        );
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        for source in [other, reset] {
            let e = Error::network("receiving from", "peer:1", source);
            assert!(matches!(e, Error::Network { .. }), "{e}");
        }
    }

    /// Issue 21 item 6: "1 files" and "file(s)" in what users read.
    #[test]
    fn counts_read_as_words() {
        assert_eq!(count_of(0, "file"), "0 files");
        assert_eq!(count_of(1, "session"), "1 session");
        let one = Error::Files {
            count: 1,
            first: Box::new(Error::Usage("x".into())),
        };
        assert!(
            one.to_string().starts_with("1 file failed; first: "),
            "{one}"
        );
        let two = Error::Files {
            count: 2,
            first: Box::new(Error::Usage("x".into())),
        };
        assert!(
            two.to_string().starts_with("2 files failed; first: "),
            "{two}"
        );
    }
}
