//! How the engine's failures reach gfal2: an `errno` in a `GError`, as every gfal2
//! plugin reports them, because that code is what gfal2's callers decide on (FTS3 retries
//! on some, Rucio treats `ENOENT` as "replica missing", gfal2's own copy helpers ignore
//! `EEXIST` from a recursive mkdir).

use wanxfer_engine::Error;
use wanxfer_proto::ops::OpFailure;
use wanxfer_proto::FailureClass;

/// A failure on its way to gfal2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub errno: i32,
    pub message: String,
    /// For copies: which side failed (`SOURCE`, `DESTINATION`, `TRANSFER`), and gfal2's
    /// note for the kind of failure (`EXISTS`, `CHECKSUM MISMATCH`, ...), which FTS3 reads.
    pub side: Option<&'static str>,
    pub note: Option<&'static str>,
}

impl Failure {
    pub fn new(errno: i32, message: impl Into<String>) -> Failure {
        Failure {
            errno,
            message: message.into(),
            side: None,
            note: None,
        }
    }

    pub fn with_errno(mut self, errno: i32) -> Failure {
        self.errno = errno;
        self
    }

    pub fn on(mut self, side: &'static str, note: Option<&'static str>) -> Failure {
        self.side = Some(side);
        self.note = note;
        self
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::new(errno_of(&e), e.to_string())
    }
}

/// The errno a gfal2 caller expects for `e`.
pub fn errno_of(e: &Error) -> i32 {
    match e {
        Error::Op { failure, .. } => match failure {
            OpFailure::NotFound => libc::ENOENT,
            OpFailure::Exists => libc::EEXIST,
            OpFailure::NotDir => libc::ENOTDIR,
            OpFailure::IsDir => libc::EISDIR,
            OpFailure::NotEmpty => libc::ENOTEMPTY,
            // A path through a symlink, out of the root, or naming the server's own
            // files: not this client's to reach, whatever its credentials.
            OpFailure::PermissionDenied | OpFailure::Escapes | OpFailure::Reserved => libc::EACCES,
            OpFailure::NoSpace => libc::ENOSPC,
            OpFailure::Invalid => libc::EINVAL,
            OpFailure::Limit => libc::E2BIG,
            _ => libc::EIO,
        },
        Error::Auth { .. } | Error::Denied { .. } => libc::EACCES,
        Error::Network { source, .. } => match source.raw_os_error() {
            Some(code) => code,
            None if source.kind() == std::io::ErrorKind::TimedOut => libc::ETIMEDOUT,
            None => libc::ECOMM,
        },
        Error::Protocol { .. } => libc::EPROTO,
        Error::Integrity { .. } => libc::EIO,
        Error::LocalIo { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        Error::Refused { .. } => libc::EACCES,
        Error::Usage(_) => libc::EINVAL,
        Error::Limit(_) => libc::EAGAIN,
        Error::Remote { class, .. } => match class {
            FailureClass::Refused | FailureClass::Auth => libc::EACCES,
            // The server is busy (too many sessions): worth a retry later.
            FailureClass::Limit => libc::EAGAIN,
            FailureClass::Protocol => libc::EPROTO,
            // A third-party source could not reach the destination: as a network error
            // of this side's own would be, retryable.
            FailureClass::Network => libc::ECOMM,
            _ => libc::EIO,
        },
        Error::Files { first, .. } => errno_of(first),
        Error::Cancelled => libc::ECANCELED,
        _ => libc::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_the_errnos_gfal2_callers_test() {
        let op = |failure| Error::Op {
            failure,
            message: String::new(),
        };
        assert_eq!(errno_of(&op(OpFailure::NotFound)), libc::ENOENT);
        assert_eq!(errno_of(&op(OpFailure::Exists)), libc::EEXIST);
        assert_eq!(errno_of(&op(OpFailure::NotEmpty)), libc::ENOTEMPTY);
        assert_eq!(errno_of(&op(OpFailure::Escapes)), libc::EACCES);
        let refused = std::io::Error::from_raw_os_error(libc::ECONNREFUSED);
        assert_eq!(
            errno_of(&Error::network("connecting to", "h:1", refused)),
            libc::ECONNREFUSED
        );
        let auth = Error::Auth {
            peer: "h:1".into(),
            detail: "secrets differ".into(),
        };
        assert_eq!(errno_of(&auth), libc::EACCES);
    }
}
