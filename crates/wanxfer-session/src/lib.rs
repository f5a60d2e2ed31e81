//! wanxfer's session protocol 2, as state machines with no I/O.
//!
//! A session moves one manifest of files from a sender to a receiver (the client is either,
//! the server the other). Everything a session decides lives here: what the two sides
//! agree on at the start ([`negotiate`]), how far the sender may announce files ahead of
//! the receiver (the manifest window), which files the receiver already has
//! ([`Applied::UpToDate`]) or partly has from an interrupted run ([`Applied::Held`], checked
//! by the sender against its source before it is trusted), which blocks each data channel
//! delivered and what to send again when one dies, and how the session ends.
//!
//! The shape is `quinn-proto`'s: the caller owns sockets, threads, files and the clock.
//! It feeds what happened into a machine ([`SenderMachine`], [`ReceiverMachine`]) through
//! `handle_*` methods and methods named after the event, each taking the current time, and
//! then drains what the machine wants done: control messages to send
//! (`poll_transmit`), work for its threads (`poll_work`), things to report (`poll_event`),
//! and when to call `handle_timeout` next (`poll_timeout`). Call them in that order after
//! every batch of inputs. Nothing here blocks, allocates without a bound set by a local
//! limit, or panics on anything the peer sends, which is what lets the same machines be
//! unit-tested, fuzzed with sequences of messages, and driven through thousands of seeded
//! crashes, channel deaths and restarts in a simulation (`tests/sim.rs`).
//!
//! What this crate does not do: read files, write files, or move blocks. Blocks go over
//! data channels that the engine runs; the machines only learn that a block was sent on a
//! channel ([`SenderMachine::block_sent`]) or received on one
//! ([`ReceiverMachine::block_received`]), and which file ranges it held. The journal's
//! format is here ([`journal`]); writing it durably is the engine's job.

pub mod coverage;
pub mod journal;
pub mod negotiate;
pub mod plan;
mod receiver;
mod sender;
pub mod tail;
pub mod tune;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

pub use coverage::Coverage;
pub use plan::{chunks, Plan, Planner, SegRef};
pub use receiver::{Applied, ReceiverConfig, ReceiverMachine, ReceiverWork};
pub use sender::{SenderConfig, SenderMachine, SenderWork};
use wanxfer_proto::{EntryKind, FailureClass, Message, Stats};

/// Why a session cannot go on. Per-file failures are not errors: they are
/// [`Outcome::Failed`] and the rest of the tree goes on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The peer broke the protocol: a message out of place, a number past what was
    /// agreed, an id it never announced.
    #[error("{0}")]
    Protocol(String),
    /// The peer ended the session and said why.
    #[error("{message}")]
    Remote {
        class: FailureClass,
        message: String,
    },
    /// Nothing arrived from the peer for this long.
    #[error("no sign of life from the peer for {0:?}")]
    Stalled(Duration),
    /// The peer is alive (keepalives arrive) but nothing of the transfer moved for this
    /// long: no block, no manifest entry, no acknowledgement.
    #[error("no progress for {0:?}, only keepalives")]
    Idle(Duration),
    /// The peer made this side exceed one of its own limits.
    #[error("{0}")]
    Limit(String),
}

fn protocol(detail: impl Into<String>) -> SessionError {
    SessionError::Protocol(detail.into())
}

/// Why one file failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub class: FailureClass,
    /// Where in the file, when that is known (an integrity failure names its segment).
    pub offset: u64,
    pub message: String,
    /// The peer reported it (as opposed to this side finding it).
    pub remote: bool,
}

/// How a file of the manifest ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Verified and in place (directories and symlinks: created).
    Done,
    /// Already in place: nothing was sent.
    UpToDate,
    Failed(Failure),
}

/// What a machine reports to its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A manifest entry is resolved, one way or the other.
    Resolved {
        id: u64,
        kind: EntryKind,
        outcome: Outcome,
    },
    /// The sender did not send these (neither file, directory nor symlink).
    Skipped(Vec<Vec<u8>>),
    /// Server: the client asked to end the session; answer with
    /// `send_stats` once this side's numbers are final.
    FinishRequested,
    /// Client: the server's closing numbers. The session is over.
    PeerStats(Stats),
    /// Sender: the receiver could not keep something the session preserves (at most
    /// [`MAX_NOTES`] per session).
    Note(String),
}

/// Most notes a sender passes on from one session's receiver; more are dropped.
pub const MAX_NOTES: usize = 32;

/// Timers and the outgoing queue shared by both machines.
#[derive(Debug)]
struct Link {
    out: VecDeque<Message>,
    events: VecDeque<Event>,
    last_heard: Instant,
    last_sent: Instant,
    /// The last time the transfer moved: a block, or a message other than a keepalive.
    last_progress: Instant,
    stall_timeout: Duration,
    /// How long a live peer may hold the session without moving anything (`None`: for
    /// ever). A peer that only sends keepalives holds a session slot, reserved disk space
    /// and partial files; this is what gives them back.
    idle_timeout: Option<Duration>,
    keepalive: Duration,
    finish: FinishState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FinishState {
    Running,
    /// Client: `Finish` sent, waiting for `Stats`.
    FinishSent,
    /// Server: `Finish` received, waiting for the driver's numbers.
    FinishRequested,
    Done,
}

impl Link {
    fn new(now: Instant, stall_timeout: Duration, idle_timeout: Option<Duration>) -> Link {
        Link {
            out: VecDeque::new(),
            events: VecDeque::new(),
            last_heard: now,
            last_sent: now,
            last_progress: now,
            stall_timeout,
            idle_timeout,
            // Often enough that a peer waiting for us never mistakes a busy disk for a
            // dead path.
            keepalive: (stall_timeout / 4).max(Duration::from_millis(100)),
            finish: FinishState::Running,
        }
    }

    fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    /// The peer sent `msg`: a sign of life, and of progress unless it is a keepalive.
    fn heard_message(&mut self, now: Instant, msg: &Message) {
        self.heard(now);
        if !matches!(msg, Message::Keepalive) {
            self.progressed(now);
        }
    }

    /// The transfer moved.
    fn progressed(&mut self, now: Instant) {
        self.last_progress = self.last_progress.max(now);
    }

    fn send(&mut self, msg: Message) {
        // Once the session is over nothing more goes to the peer, and nothing waits to.
        if self.finish != FinishState::Done {
            self.out.push_back(msg);
        }
    }

    fn poll_transmit(&mut self, now: Instant) -> Option<Message> {
        let msg = self.out.pop_front()?;
        self.last_sent = self.last_sent.max(now);
        Some(msg)
    }

    fn poll_timeout(&self) -> Option<Instant> {
        if self.finish == FinishState::Done {
            return None;
        }
        let live = (self.last_heard + self.stall_timeout).min(self.last_sent + self.keepalive);
        Some(match self.idle_timeout {
            Some(idle) => live.min(self.last_progress + idle),
            None => live,
        })
    }

    fn handle_timeout(&mut self, now: Instant) -> Result<(), SessionError> {
        if self.finish == FinishState::Done {
            return Ok(());
        }
        if now >= self.last_heard + self.stall_timeout {
            return Err(SessionError::Stalled(now - self.last_heard));
        }
        if let Some(idle) = self.idle_timeout {
            if now >= self.last_progress + idle {
                return Err(SessionError::Idle(now - self.last_progress));
            }
        }
        if now >= self.last_sent + self.keepalive && self.out.is_empty() {
            self.send(Message::Keepalive);
        }
        Ok(())
    }

    /// Messages either role handles the same way; `Ok(None)` if handled.
    fn common(&mut self, msg: Message, resolved: bool) -> Result<Option<Message>, SessionError> {
        match msg {
            Message::Keepalive => Ok(None),
            Message::Error(e) => Err(SessionError::Remote {
                class: e.class,
                message: String::from_utf8_lossy(&e.message).into_owned(),
            }),
            Message::Skipped { paths } => {
                self.events.push_back(Event::Skipped(paths));
                Ok(None)
            }
            Message::Finish if self.finish == FinishState::Running => {
                if !resolved {
                    return Err(protocol(
                        "the client ended the session before every file was resolved",
                    ));
                }
                self.finish = FinishState::FinishRequested;
                self.events.push_back(Event::FinishRequested);
                Ok(None)
            }
            Message::Stats(stats) if self.finish == FinishState::FinishSent => {
                self.finish = FinishState::Done;
                // The server has ended the session: what this side still had queued for
                // it (a keepalive, a question about a channel its end closed) must not
                // keep the session from being over.
                self.out.clear();
                self.events.push_back(Event::PeerStats(stats));
                Ok(None)
            }
            other => Ok(Some(other)),
        }
    }

    /// Client: ends the session once everything is resolved.
    fn finish(&mut self) {
        if self.finish == FinishState::Running {
            self.send(Message::Finish);
            self.finish = FinishState::FinishSent;
        }
    }

    /// Server: answers the client's `Finish`.
    fn send_stats(&mut self, stats: Stats) {
        if self.finish == FinishState::FinishRequested {
            self.send(Message::Stats(stats));
            self.finish = FinishState::Done;
        }
    }
}

/// Names a message for errors without dumping its contents (which can be large, and
/// are the peer's).
fn name(msg: &Message) -> &'static str {
    match msg {
        Message::Hello(_) => "Hello",
        Message::AuthProof { .. } => "AuthProof",
        Message::AuthOk { .. } => "AuthOk",
        Message::Error(_) => "Error",
        Message::OpenSession(_) => "OpenSession",
        Message::SessionAccepted(_) => "SessionAccepted",
        Message::Manifest(_) => "Manifest",
        Message::ManifestEnd(_) => "ManifestEnd",
        Message::ManifestAck { .. } => "ManifestAck",
        Message::FileAck { .. } => "FileAck",
        Message::FileFailed(_) => "FileFailed",
        Message::ChannelJoin(_) => "ChannelJoin",
        Message::Finish => "Finish",
        Message::Stats(_) => "Stats",
        Message::ChannelAccepted { .. } => "ChannelAccepted",
        Message::FabricEndpoint(_) => "FabricEndpoint",
        Message::UpToDate { .. } => "UpToDate",
        Message::Held(_) => "Held",
        Message::Confirm(_) => "Confirm",
        Message::ChannelStatus { .. } => "ChannelStatus",
        Message::DropChannel { .. } => "DropChannel",
        Message::Skipped { .. } => "Skipped",
        Message::Keepalive => "Keepalive",
        Message::SessionStatus(_) => "SessionStatus",
        _ => "a message of another version",
    }
}
