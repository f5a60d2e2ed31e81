//! One error type for the whole crate.
//!
//! Why: callers (the block engine) must tell "this node cannot do RDMA with
//! the provider you asked for" — a configuration problem, answered by picking
//! another transport or fixing the host — apart from failures of a running
//! session, which end that session only. Every libfabric failure keeps the
//! call that failed and `fi_strerror`'s text, because provider errors are
//! otherwise unreadable numbers in a log.

use std::ffi::CStr;
use std::time::Duration;

use libfabric_sys as sys;

/// Which kind of posted operation a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A posted receive buffer.
    Recv,
    /// An eager send.
    Send,
    /// An RDMA write.
    Write,
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            OpKind::Recv => "receive",
            OpKind::Send => "send",
            OpKind::Write => "RDMA write",
        };
        f.write_str(name)
    }
}

/// Errors of the fabric layer.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No provider matched: the named provider is missing, or it cannot do
    /// connected (FI_EP_MSG) endpoints with FI_MSG | FI_RMA.
    #[error("libfabric provider {} is not available for FI_EP_MSG with FI_MSG|FI_RMA: {detail}", requested.as_deref().unwrap_or("(any)"))]
    ProviderUnavailable {
        /// The provider name asked for, if any.
        requested: Option<String>,
        /// What libfabric said.
        detail: String,
    },
    /// A libfabric call returned an error.
    #[error("{call} failed: {text} (errno {code})")]
    Fabric {
        /// The libfabric function.
        call: &'static str,
        /// Positive libfabric error number.
        code: i32,
        /// `fi_strerror` text.
        text: String,
    },
    /// A posted operation completed with an error.
    #[error("{op} completed with error: {text} (errno {code}, provider errno {prov_errno})")]
    Completion {
        /// The kind of operation.
        op: OpKind,
        /// Positive libfabric error number.
        code: i32,
        /// Provider-specific error number.
        prov_errno: i32,
        /// `fi_strerror` text.
        text: String,
    },
    /// The connection could not be established (refused, rejected, ...).
    #[error("connection to {peer} failed: {detail}")]
    ConnectFailed {
        /// The address dialled or accepted from.
        peer: String,
        /// What libfabric said.
        detail: String,
    },
    /// The peer went away or the connection broke.
    #[error("connection closed: {detail}")]
    Disconnected {
        /// How the closure was noticed.
        detail: String,
    },
    /// A blocking call ran out of time.
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// How long we waited.
        waited: Duration,
        /// What we were waiting for.
        what: &'static str,
    },
    /// Local memory used in an operation is not inside a live registration
    /// with the needed access.
    #[error(
        "buffer {addr:#x}+{len} is not inside a live memory registration with {access} access"
    )]
    NotRegistered {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
        /// The access that was needed.
        access: &'static str,
    },
    /// The local queues are full; poll completions and retry.
    #[error("local queue full: {0}")]
    QueueFull(&'static str),
    /// The caller passed something this layer or the provider cannot do.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The peer broke the channel protocol.
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// `fi_strerror` for a positive error number.
pub(crate) fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string
    // for any input (unknown numbers map to a generic text).
    let text = unsafe { CStr::from_ptr(sys::fi_strerror(code)) };
    text.to_string_lossy().into_owned()
}

impl Error {
    pub(crate) fn fabric(call: &'static str, code: i32) -> Self {
        let code = code.abs();
        Error::Fabric {
            call,
            code,
            text: strerror(code),
        }
    }
}

/// Turns a libfabric return value (negative errno on failure) into a Result.
pub(crate) fn check(ret: isize, call: &'static str) -> Result<usize> {
    usize::try_from(ret).map_err(|_| Error::fabric(call, ret as i32))
}

/// [`check`] for calls returning `int`.
pub(crate) fn check_int(ret: i32, call: &'static str) -> Result<()> {
    check(ret as isize, call).map(drop)
}
