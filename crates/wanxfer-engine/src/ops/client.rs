//! The client's side of remote operations: one authenticated connection, typed methods.
//!
//! Why one connection for many requests: authentication costs two round trips, which on
//! a transatlantic path is most of a `stat`. A caller that makes many requests (the gfal2
//! plugin serving FTS, a script) keeps a [`Client`] and checks [`Client::is_usable`]
//! before reusing it, since the server closes a connection left idle.

use crate::stream::Stream;
use std::io::ErrorKind;
use std::time::Duration;

use wanxfer_proto::ops::{ChecksumAlgorithm, ListEntry, Meta, OpReply, OpRequest, RemoveMode};
use wanxfer_proto::tpc::{Grant, Granted, PushTo, TransferProgress, TransferSummary};
use wanxfer_proto::{features, FailureClass, Message, RelPath};

use crate::session::client::open_control;
use crate::session::conn::{read_message, Control};
use crate::session::ClientConfig;
use crate::Error;

/// An authenticated connection that carries remote operations, one at a time.
#[derive(Debug)]
pub struct Client {
    stream: Stream,
    control: Control,
    /// A request whose final reply has not been read: the connection cannot take another.
    pending: bool,
    /// The features both sides offered.
    features: u64,
    /// The certificate the server presented and proved (`None` without TLS).
    fingerprint: Option<String>,
}

impl Client {
    /// Connects to `cfg.server` and authenticates with `cfg.secret`. Replies are waited
    /// for at most `cfg.tuning.stall_timeout` each (a long operation sends progress
    /// frames, so only a silent server times out).
    pub fn connect(cfg: &ClientConfig) -> Result<Client, Error> {
        let (stream, control, auth, fingerprint) = open_control(cfg)?;
        let stall = cfg.tuning.stall_timeout.max(Duration::from_secs(1));
        stream
            .set_read_timeout(Some(stall))
            .map_err(|e| Error::network("setting up connection to", &cfg.server, e))?;
        Ok(Client {
            stream,
            control,
            pending: false,
            features: auth.negotiated(),
            fingerprint,
        })
    }

    /// The fingerprint (`SHA256:hex`) of the certificate this server presented, as this
    /// client verified it; `None` on a connection without TLS.
    pub fn fingerprint(&self) -> Option<&str> {
        self.fingerprint.as_deref()
    }

    /// Bytes this connection has sent (and had acknowledged) and received, as the
    /// kernel counted them: what a third-party copy's client proves it moved no data with.
    pub fn tcp_bytes(&self) -> Option<(u64, u64)> {
        crate::session::conn::tcp_bytes(self.stream.tcp())
    }

    /// Third-party copy, at the destination: a grant for one push into `path` that may
    /// keep what `preserve` (`PRESERVE_*` session flags, 0 for none) names, usable to
    /// start it for `ttl_s` seconds (the server may shorten it).
    pub fn grant(&mut self, path: &RelPath, ttl_s: u32, preserve: u32) -> Result<Granted, Error> {
        self.third_party(preserve, false)?;
        self.send(OpRequest::Grant(Grant {
            path: path.clone(),
            ttl_s,
            preserve,
        }))?;
        match self.final_reply()? {
            OpReply::Granted(g) => Ok(g),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Third-party copy, at the source: pushes as `request` says, passing each progress
    /// report to `each` (an error from it stops waiting and leaves this connection
    /// unusable), and returns the source's summary, failed or not.
    pub fn push_to(
        &mut self,
        request: PushTo,
        mut each: impl FnMut(&TransferProgress) -> Result<(), Error>,
    ) -> Result<TransferSummary, Error> {
        self.third_party(request.preserve, !request.selection.is_empty())?;
        self.send(OpRequest::PushTo(request))?;
        loop {
            match self.reply()? {
                OpReply::TransferProgress(p) => each(&p)?,
                OpReply::TransferDone(summary) => return Ok(summary),
                other => return Err(self.unexpected(&other)),
            }
        }
    }

    /// Whether the server takes a third-party request, keeping `preserve` and applying a
    /// selection if the request `selects` (an older server would refuse either as bytes
    /// it does not expect).
    fn third_party(&self, preserve: u32, selects: bool) -> Result<(), Error> {
        if self.features & features::THIRD_PARTY == 0 {
            return Err(Error::Usage(format!(
                "{} does not take third-party copies (an older wanxfer)",
                self.control.peer
            )));
        }
        if preserve != 0 && self.features & features::THIRD_PARTY_PRESERVE == 0 {
            return Err(Error::Usage(format!(
                "{} cannot preserve owners, groups or attributes in a copy between two \
                 servers (--preserve, -a): it runs an older wanxfer",
                self.control.peer
            )));
        }
        if selects && self.features & features::THIRD_PARTY_SELECT == 0 {
            return Err(Error::Usage(format!(
                "{} cannot select what it sends in a copy between two servers (--exclude, \
                 --include, --files-from): it runs an older wanxfer",
                self.control.peer
            )));
        }
        Ok(())
    }

    /// `HOST:PORT` of the server.
    pub fn server(&self) -> &str {
        &self.control.peer
    }

    /// Whether the connection can take a request: nothing left unread, and the server has
    /// not closed it (as it does with a connection idle past its stall timeout).
    pub fn is_usable(&self) -> bool {
        // The socket, not the stream: TLS or not, any byte the server sent unasked (or
        // its close) means the connection is not to be reused.
        let tcp = self.stream.tcp();
        if self.pending || tcp.set_nonblocking(true).is_err() {
            return false;
        }
        let mut byte = [0u8; 1];
        let open = match tcp.peek(&mut byte) {
            // Closed (0), or a frame nobody asked for: either way not to be reused.
            Ok(_) => false,
            Err(e) => e.kind() == ErrorKind::WouldBlock,
        };
        tcp.set_nonblocking(false).is_ok() && open
    }

    pub fn stat(&mut self, path: &RelPath) -> Result<Meta, Error> {
        self.send(OpRequest::Stat { path: path.clone() })?;
        match self.final_reply()? {
            OpReply::Meta(meta) => Ok(meta),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Every entry of directory `path` (or `path` itself when it is not one), passed to
    /// `each` as the pages arrive, in the server's directory order. An error from `each`
    /// stops the listing and leaves this connection unusable.
    pub fn list(
        &mut self,
        path: &RelPath,
        recursive: bool,
        long: bool,
        mut each: impl FnMut(ListEntry) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.start_list(path, recursive, long)?;
        while let Some(page) = self.next_page()? {
            for entry in page {
                each(entry)?;
            }
        }
        Ok(())
    }

    /// Starts a listing whose pages [`Client::next_page`] then pulls, for a caller that
    /// consumes entries at its own pace (gfal2's `readdir`).
    pub fn start_list(&mut self, path: &RelPath, recursive: bool, long: bool) -> Result<(), Error> {
        self.send(OpRequest::List {
            path: path.clone(),
            recursive,
            long,
        })
    }

    /// The next page of the listing started last; `None` once it is complete.
    pub fn next_page(&mut self) -> Result<Option<Vec<ListEntry>>, Error> {
        if !self.pending {
            return Ok(None);
        }
        match self.reply()? {
            OpReply::List(page) => {
                self.pending = page.more;
                Ok(Some(page.entries))
            }
            other => Err(self.unexpected(&other)),
        }
    }

    /// Creates directory `path` (with `parents`, missing parents too and no error if it
    /// exists) with permission bits `mode` before the server's umask.
    pub fn mkdir(&mut self, path: &RelPath, parents: bool, mode: u32) -> Result<(), Error> {
        self.send(OpRequest::Mkdir {
            path: path.clone(),
            parents,
            mode: mode & wanxfer_proto::ops::MODE_BITS,
        })?;
        self.done()
    }

    pub fn remove(&mut self, path: &RelPath, mode: RemoveMode) -> Result<(), Error> {
        self.send(OpRequest::Remove {
            path: path.clone(),
            mode,
        })?;
        self.done()
    }

    /// `rename(2)` beneath the server's root.
    pub fn rename(&mut self, from: &RelPath, to: &RelPath) -> Result<(), Error> {
        self.send(OpRequest::Rename {
            from: from.clone(),
            to: to.clone(),
        })?;
        self.done()
    }

    /// The digest of file `path`, computed by the server, in printing order (see
    /// [`super::hex`]).
    pub fn checksum(
        &mut self,
        path: &RelPath,
        algorithm: ChecksumAlgorithm,
    ) -> Result<Vec<u8>, Error> {
        self.send(OpRequest::Checksum {
            path: path.clone(),
            algorithm,
        })?;
        match self.final_reply()? {
            OpReply::Checksum {
                algorithm: got,
                digest,
            } if got == algorithm => Ok(digest),
            other => Err(self.unexpected(&other)),
        }
    }

    fn send(&mut self, request: OpRequest) -> Result<(), Error> {
        if self.pending {
            return Err(Error::Internal(
                "a remote operation was started before the last one was answered".into(),
            ));
        }
        self.pending = true;
        self.control.send(&Message::OpRequest(request))
    }

    fn done(&mut self) -> Result<(), Error> {
        match self.final_reply()? {
            OpReply::Done => Ok(()),
            other => Err(self.unexpected(&other)),
        }
    }

    /// The reply that ends the request, whatever progress frames come first.
    fn final_reply(&mut self) -> Result<OpReply, Error> {
        let reply = self.reply()?;
        if !reply.is_final() {
            return Err(self.unexpected(&reply));
        }
        Ok(reply)
    }

    /// The next reply that is not a progress frame; an error reply is returned as the
    /// error it reports, and ends the request.
    fn reply(&mut self) -> Result<OpReply, Error> {
        let peer = self.control.peer.clone();
        loop {
            let msg = read_message(&mut self.stream, &peer)?;
            let reply = match msg {
                Message::OpReply(OpReply::Progress { .. }) => continue,
                Message::OpReply(reply) => reply,
                // Refused before any operation ran (server busy, say).
                Message::Error(e) => return Err(Error::remote(&peer, &e)),
                other => {
                    return Err(Error::protocol(
                        &peer,
                        format!("expected an operation's reply, got {other:?}"),
                    ))
                }
            };
            if reply.is_final() {
                self.pending = false;
            }
            return match reply {
                OpReply::Error(e) => {
                    let message = format!("{peer}: {}", String::from_utf8_lossy(&e.message));
                    Err(match e.class {
                        FailureClass::Auth => Error::Auth {
                            peer,
                            detail: message,
                        },
                        FailureClass::Protocol => Error::protocol(peer, message),
                        _ => Error::Op {
                            failure: e.failure,
                            message,
                        },
                    })
                }
                reply => Ok(reply),
            };
        }
    }

    fn unexpected(&mut self, reply: &OpReply) -> Error {
        // Whatever the server meant, this connection no longer follows the protocol.
        self.pending = true;
        Error::protocol(&self.control.peer, format!("unexpected reply {reply:?}"))
    }
}
