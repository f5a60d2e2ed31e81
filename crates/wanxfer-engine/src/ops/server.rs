//! The server's side of a connection that carries remote operations.
//!
//! Why it is a loop of its own rather than part of the session code: a session needs
//! channels, a window and a driver, an operation needs one reply; keeping them apart
//! keeps the hook into the connection set-up to one match arm (`session::server`), which
//! can move wherever that set-up goes. One request is read, executed and answered at a
//! time, so a connection holds at most one operation's state; a client silent for
//! `idle` between requests, or gone, ends the connection quietly.

use crate::stream::Stream;
use std::time::{Duration, Instant};

use wanxfer_proto::ops::{OpError, OpFailure, OpReply, OpRequest, RemoveMode};
use wanxfer_proto::tpc::{Grant, Granted, PushTo, TransferSummary};
use wanxfer_proto::{features, ErrorMsg, FailureClass, Message, RelPath};

use crate::auth::{authorize, Access, Exports, Identity};
use crate::fs::Root;
use crate::session::conn::{read_message, Control};
use crate::Error;

/// How often a long operation tells the client it is still at work: far below any
/// client's silence timeout (two minutes by default), far above the cost of a frame.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);

/// The third-party copy requests, which need more of the server than its root: its
/// grant table (at the destination), its limits and state (at the source).
pub(crate) trait ThirdParty {
    /// A grant for `identity`, who must be allowed to write there itself.
    fn grant(&self, request: &Grant, identity: &Identity) -> Result<Granted, Error>;
    /// Runs the push of what `identity` may read, reporting progress on `control`; the
    /// summary is the final reply.
    fn push_to(
        &self,
        request: &PushTo,
        identity: &Identity,
        control: &mut Control,
    ) -> Result<TransferSummary, Error>;
}

/// What the operations of one connection run against.
pub(crate) struct Served<'a> {
    pub exports: &'a Exports,
    /// Who the client proved to be: every operation is authorized for it.
    pub identity: &'a Identity,
    pub third_party: &'a dyn ThirdParty,
    /// The features both sides offered on this connection.
    pub features: u64,
}

/// Runs operations on `stream` (authenticated, its first request `first` already read)
/// until the client closes it or stays silent for `idle`. Errors of an operation go to
/// the client and the connection goes on; only a connection that can no longer be used
/// ends with an error.
pub(crate) fn serve(
    served: &Served<'_>,
    mut stream: Stream,
    mut control: Control,
    first: OpRequest,
    idle: Duration,
) -> Result<(), Error> {
    let peer = control.peer.clone();
    let mut request = first;
    loop {
        execute(served, &request, &mut control)?;
        let _ = stream.set_read_timeout(Some(idle));
        request = match read_message(&mut stream, &peer) {
            Ok(Message::OpRequest(next)) => next,
            Ok(other) => {
                let e = Error::protocol(&peer, format!("expected an operation, got {other:?}"));
                let _ = control.send(&Message::Error(ErrorMsg::new(
                    FailureClass::Protocol,
                    &e.to_string(),
                )));
                return Err(e);
            }
            // Closed, or silent past `idle`: the client is done with this connection.
            Err(Error::Network { .. }) => return Ok(()),
            Err(e) => {
                let _ = control.send(&Message::Error(ErrorMsg::new(
                    e.wire_class(),
                    &e.to_string(),
                )));
                return Err(e);
            }
        };
    }
}

/// The export a request's path names, its path there, after checking `identity` may
/// have `access` to it: nothing is opened before this says yes.
fn permitted<'a>(
    exports: &'a Exports,
    identity: &Identity,
    path: &RelPath,
    access: Access,
) -> Result<(&'a Root, RelPath), Error> {
    let (export, inside) = exports.resolve(path)?;
    authorize(identity, export, &inside, access)?;
    Ok((&export.root, inside))
}

/// Executes one request and answers it; `Err` only when the client cannot be told.
fn execute(served: &Served<'_>, request: &OpRequest, control: &mut Control) -> Result<(), Error> {
    let exports = served.exports;
    let peer = control.peer.clone();
    let started = Instant::now();
    let result = run(served, request, control, &peer);
    tracing::debug!("{peer}: {request:?} in {:?}", started.elapsed());
    match result {
        Ok(Some(reply)) => control.send(&Message::OpReply(reply)),
        Ok(None) => Ok(()),
        // Telling the client failed: nothing more can go over this connection.
        Err(e @ Error::Network { .. }) => Err(e),
        Err(e) => {
            tracing::debug!("{peer}: {e}");
            let shown = relative(exports, &e);
            control.send(&Message::OpReply(OpReply::Error(op_error(&e, &shown))))
        }
    }
}

/// An error as the client may see it: beneath an export, paths relative to it and
/// prefixed with its name, never the server's directories.
pub(crate) fn relative(exports: &Exports, e: &Error) -> String {
    relative_text(exports, &e.to_string())
}

/// [`relative`] for any text this server sends.
pub(crate) fn relative_text(exports: &Exports, text: &str) -> String {
    let mut text = text.to_string();
    for export in exports.iter() {
        let root = export.root.path().display().to_string();
        let (inside, itself) = if export.name.is_empty() {
            (String::new(), ".".to_string())
        } else {
            (format!("{}/", export.name), export.name.clone())
        };
        text = text
            .replace(&format!("{root}/"), &inside)
            .replace(&root, &itself);
    }
    text
}

fn run(
    served: &Served<'_>,
    request: &OpRequest,
    control: &mut Control,
    peer: &str,
) -> Result<Option<OpReply>, Error> {
    let (exports, identity) = (served.exports, served.identity);
    let third_party = || {
        if served.features & features::THIRD_PARTY == 0 {
            return Err(Error::Op {
                failure: OpFailure::Invalid,
                message: "third-party copy was not negotiated on this connection".into(),
            });
        }
        Ok(served.third_party)
    };
    match request {
        OpRequest::Stat { path } => {
            let (root, path) = permitted(exports, identity, path, Access::Read)?;
            super::stat(root, &path).map(|m| Some(OpReply::Meta(m)))
        }
        OpRequest::List {
            path,
            recursive,
            long,
        } => {
            let (root, path) = permitted(exports, identity, path, Access::Read)?;
            super::list(root, &path, *recursive, *long, &mut |page| {
                control.send(&Message::OpReply(OpReply::List(page)))
            })
            .map(|()| None)
        }
        OpRequest::Mkdir {
            path,
            parents,
            mode,
        } => {
            let (root, path) = permitted(exports, identity, path, Access::Create)?;
            tracing::info!("{peer}: mkdir{} {path}", if *parents { " -p" } else { "" });
            super::mkdir(root, &path, *parents, *mode).map(|()| Some(OpReply::Done))
        }
        OpRequest::Remove { path, mode } => {
            let (root, path) = permitted(exports, identity, path, Access::Modify)?;
            let how = match mode {
                RemoveMode::Recursive => "rm -r",
                RemoveMode::EmptyDir => "rmdir",
                _ => "rm",
            };
            tracing::info!("{peer}: {how} {path}");
            let mut progress = ticker(control);
            super::remove(root, &path, *mode, &mut progress).map(|()| Some(OpReply::Done))
        }
        OpRequest::Rename { from, to } => {
            let (root, from_inside) = permitted(exports, identity, from, Access::Modify)?;
            let (to_root, to_inside) = permitted(exports, identity, to, Access::Modify)?;
            if !std::ptr::eq(root, to_root) {
                return Err(Error::Refused {
                    path: to.to_string(),
                    reason: "a rename stays within one export".into(),
                });
            }
            tracing::info!("{peer}: mv {from} {to}");
            super::rename(root, &from_inside, &to_inside).map(|()| Some(OpReply::Done))
        }
        OpRequest::Checksum { path, algorithm } => {
            let (root, path) = permitted(exports, identity, path, Access::Read)?;
            let mut progress = ticker(control);
            super::checksum(root, &path, *algorithm, &mut progress).map(|digest| {
                Some(OpReply::Checksum {
                    algorithm: *algorithm,
                    digest,
                })
            })
        }
        OpRequest::Grant(grant) => {
            tracing::info!(
                "{peer}: grant for a third-party push into {} ({} s)",
                grant.path,
                grant.ttl_s
            );
            third_party()
                .and_then(|t| t.grant(grant, identity))
                .map(|g| Some(OpReply::Granted(g)))
        }
        OpRequest::PushTo(push) => third_party()
            .and_then(|t| t.push_to(push, identity, control))
            .map(|summary| Some(OpReply::TransferDone(summary))),
        other => Err(Error::Op {
            failure: OpFailure::Invalid,
            message: format!("{other:?}: not an operation this server knows"),
        }),
    }
}

/// A progress callback that sends [`OpReply::Progress`] at most every
/// [`PROGRESS_INTERVAL`].
fn ticker(control: &mut Control) -> impl FnMut(u64) -> Result<(), Error> + '_ {
    let mut last = Instant::now();
    move |done| {
        if last.elapsed() < PROGRESS_INTERVAL {
            return Ok(());
        }
        last = Instant::now();
        control.send(&Message::OpReply(OpReply::Progress { done }))
    }
}

/// What the client is told about a failed operation (`shown`: its text for the client).
fn op_error(e: &Error, shown: &str) -> OpError {
    let failure = match e {
        Error::Op { failure, .. } => *failure,
        Error::LocalIo { source, .. } => super::failure_of(source),
        Error::Limit(_) => OpFailure::Limit,
        Error::Denied { .. } => OpFailure::PermissionDenied,
        _ => OpFailure::Other,
    };
    OpError::new(e.wire_class(), failure, shown)
}
