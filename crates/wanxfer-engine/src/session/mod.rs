//! Sessions: one transfer between a client and a server.
//!
//! A session is a control connection (the server's greeting, mutual authentication, the
//! request, the manifest, acknowledgements, the closing statistics) plus data channels
//! that join with a proof bound to their own connection and carry blocks. The client
//! always connects, whichever way data flows, so that only the server needs an open port.
//! [`client`] and [`server`] set a session up; [`driver`] runs the sending or receiving
//! role as a thin loop around the state machines of `wanxfer-session`, which decide
//! everything the session does; [`conn`] is the framing and the deadlines.

pub mod client;
/// Framing, deadlines and the control connection's threads; remote operations and the
/// TLS layer use them too.
pub(crate) mod conn;
pub mod driver;
pub mod grants;
pub mod observe;
pub mod server;
pub mod state;
pub mod steer;
mod tpc;

pub use client::{
    run_client, ClientConfig, ClientCredential, ClientJob, PullDest, Report, RetryPolicy,
    ThirdPartyReport,
};
pub use server::{Server, ServerLimits};

use std::time::Duration;

use wanxfer_proto::Compare;

use crate::source::IoMode;

/// How data channels move blocks, as the client asks for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Transport {
    /// Parallel TCP streams.
    #[default]
    Tcp,
    /// libfabric endpoints of this provider (`tcp`, `verbs`, ...), RDMA writes into
    /// slots the receiver grants. Never falls back to TCP.
    Fabric { provider: String },
}

impl Transport {
    pub fn name(&self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Fabric { .. } => "fabric",
        }
    }
}

/// What a user may tune; the server clamps every negotiated value to its own limits.
/// The defaults here are the ones the command line shows: each is written once.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Parallel data channels (TCP streams).
    pub streams: u16,
    /// Bytes per block: the unit of reading, sending, checksumming and writing.
    pub block_size: u32,
    /// Blocks queued per channel beyond the one being sent.
    pub depth: u16,
    /// Reader threads on the sending side (local, never negotiated).
    pub readers: usize,
    /// Writer threads on the receiving side (local, never negotiated).
    pub writers: usize,
    /// Files announced ahead of acknowledgement: bounds both sides' per-file memory.
    pub window: u32,
    /// A payload CRC-32C for each block where no digests check them (see
    /// [`Params::block_crc`]); with digests on it changes nothing.
    pub block_crc: bool,
    /// Every segment carries the XXH3-128 of its bytes: the check on every byte, and
    /// what verifies files end to end.
    pub file_digest: bool,
    /// How this side sends file bytes (local, never negotiated).
    pub io: IoMode,
    /// How this side writes the files it receives (local, never negotiated).
    pub write: crate::fs::WriteMode,
    pub transport: Transport,
    /// How long a silent peer (cut link, crashed host) is waited for (local).
    pub stall_timeout: Duration,
    /// How long a peer that is alive but moves nothing is waited for (local; `None`:
    /// for ever).
    pub idle_timeout: Option<Duration>,
    /// Which files a receiver may skip because it has them already.
    pub compare: Compare,
    /// Whether a receiving side makes files durable before it acknowledges them (local).
    pub durable: bool,
    /// Whether an interrupted transfer is resumed: the receiver journals what it
    /// verified and keeps partial files, and says what it holds when the transfer is
    /// run again. Off, every run starts over (and costs no journal writes).
    pub resume: bool,
    /// Bytes of block buffers this side may hold for one session (local): the readers'
    /// and writers' counts and the pool are fitted into it.
    pub max_memory: u64,
    /// The client's tuner chooses the number of streams while the session runs,
    /// starting from `streams`, up to [`AUTO_MAX_STREAMS`] (or what the server allows),
    /// with pools sized for [`AUTO_POOL_STREAMS`] ([`AUTO_FABRIC_STREAMS`] over fabric);
    /// off, `streams` is the count (`cp --streams N`).
    pub auto_streams: bool,
    /// The session's rate (`--rate`), bits per second: paced over its channels.
    pub rate_bits_per_s: Option<u64>,
    /// The TCP congestion control of this side's data sockets (`--congestion`).
    pub congestion: Option<String>,
}

/// Most streams the tuner tries (the server may allow fewer: its `max_streams`).
pub const AUTO_MAX_STREAMS: u16 = 16;

/// Fewest streams the tuner goes down to (unless the server allows fewer). One stream
/// saves almost nothing over two (the utility's discount is 2% a stream), and a probe
/// down to it halves the session's rate until the remaining stream's congestion control
/// has grown into the room: through the emulator at 50 ms after a drop to 500 Mbit/s,
/// a single BBR stream took 2 s to pass 0.25 Gbit/s, and probing back up paid a new
/// stream's slow start as well. Two also keep a transfer at a shared bottleneck from
/// being shed to one stream beside a competitor's seven.
pub const AUTO_MIN_STREAMS: u16 = 2;

/// Streams a tuned session's pools are sized for. TCP channels share one pool and what
/// they have in flight sits in the kernel's socket buffers, so more streams than this
/// share these buffers rather than each adding `depth + 1` (sized for all 16, the pools
/// of a 4 MiB-block session took 328 MiB on each side, and the memory was touched).
pub const AUTO_POOL_STREAMS: u16 = 4;

/// Streams a tuned fabric session starts with (and its pools are sized for). A fabric
/// channel has only its slots in flight, `depth` + 1 blocks whatever the path, and one
/// the tuner adds later starts its provider connection's slow start from nothing, so a
/// probe up is judged before its channels have grown. Through `wanxfer-emu` at 200 ms, 4
/// Gbit/s, a 2 GB push took 9.0-9.1 s from 4 streams (the tuner's 8 came at 5 s, still
/// growing, and lost to 4) against 7.5 s with 8 from the start, what TCP took.
pub const AUTO_FABRIC_STREAMS: u16 = 8;

/// A path silent for this long is declared dead.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(120);

/// A session whose peer sends only keepalives for this long is ended: long enough for a
/// disk that stalls for minutes, short enough that a stuck or hostile peer does not hold
/// a session slot and reserved space for hours.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// Most reader or writer threads a session runs, whatever is asked: beyond the cores and
/// the disks' queues they add nothing but memory.
pub const MAX_DISK_THREADS: usize = 64;

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            streams: 2,
            block_size: 4 << 20,
            depth: 4,
            readers: 2,
            writers: 2,
            window: 65_536,
            block_crc: true,
            file_digest: true,
            io: IoMode::Auto,
            write: crate::fs::WriteMode::Auto,
            transport: Transport::Tcp,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            idle_timeout: Some(DEFAULT_IDLE_TIMEOUT),
            compare: Compare::QuickCheck,
            durable: true,
            resume: true,
            max_memory: 1 << 30,
            auto_streams: false,
            rate_bits_per_s: None,
            congestion: None,
        }
    }
}

impl Tuning {
    /// This side's request fitted into its own memory budget ([`Tuning::max_memory`]), as
    /// a server fits a session into its own: the disk threads of the role (readers
    /// sending, writers receiving) clamped to [`MAX_DISK_THREADS`] and, while the session
    /// would not fit, fewer of them (down to two), then depth, streams and block size
    /// lowered in the server's order (`negotiate::fit`). A server may lower each number
    /// further and never raise one (the client checks), so this side's buffers stay
    /// within its budget whatever it asked and whatever the server answers.
    pub fn fitted(&self, receiving: bool) -> Tuning {
        use wanxfer_proto::TransportKind;
        use wanxfer_session::negotiate::{self, MIN_BLOCK_SIZE};
        let transport = match (&self.transport, receiving) {
            (Transport::Fabric { .. }, true) => TransportKind::Fabric,
            _ => TransportKind::Tcp,
        };
        let (streams, depth) = (self.streams.max(1), self.depth.max(1));
        // A server raises a smaller block to its minimum: count what it may answer.
        let block = self.block_size.max(MIN_BLOCK_SIZE);
        let asked = if receiving {
            self.writers
        } else {
            self.readers
        };
        let mut threads = asked.clamp(1, MAX_DISK_THREADS);
        let floor = threads.min(2);
        let need =
            |threads: usize| negotiate::memory(transport, streams, depth, block, threads as u32);
        while threads > floor && need(threads) > self.max_memory {
            threads -= 1;
        }
        let (streams, depth, fitted_block) = negotiate::fit(
            transport,
            streams,
            depth,
            block,
            threads as u32,
            self.max_memory,
        );
        let mut t = Tuning {
            streams,
            depth,
            block_size: if fitted_block < block {
                fitted_block
            } else {
                self.block_size
            },
            readers: self.readers.clamp(1, MAX_DISK_THREADS),
            writers: self.writers.clamp(1, MAX_DISK_THREADS),
            ..self.clone()
        };
        if receiving {
            t.writers = threads;
        } else {
            t.readers = threads;
        }
        t
    }
}

/// The parameters a running session uses, agreed at its start.
#[derive(Debug, Clone)]
pub struct Params {
    pub session_tag: u64,
    /// Names this transfer's temporaries: the same in every run of the same transfer, so
    /// an interrupted one's partial files are found again.
    pub transfer_tag: u64,
    pub streams: u16,
    pub max_streams: u16,
    pub block_size: u32,
    pub depth: u16,
    pub window: u32,
    pub readers: usize,
    pub writers: usize,
    /// Blocks carry a payload CRC-32C: only in a session without segment digests, which
    /// check every byte anyway.
    pub block_crc: bool,
    /// Every segment carries the digest of its bytes, checked on arrival.
    pub file_digest: bool,
    /// The receiver throws data away.
    pub discard: bool,
    pub io: IoMode,
    pub compare: Compare,
    pub durable: bool,
    pub stall_timeout: Duration,
    pub idle_timeout: Option<Duration>,
    /// The features both sides offered (`wanxfer_proto::features`).
    pub features: u64,
    /// A session without encryption: the key this side tags the blocks it sends with.
    pub send_key: Option<crate::digest::BlockKey>,
    /// The client tunes the count: it opens `streams` first and the tuner takes it from
    /// there, between [`AUTO_MIN_STREAMS`] and [`AUTO_MAX_STREAMS`] or `max_streams`.
    pub auto_streams: bool,
    pub rate_bits_per_s: Option<u64>,
    pub congestion: Option<String>,
    /// What entries carry, and the receiver keeps, beyond mode and mtime (the answer's
    /// `PRESERVE_*` flags, with [`wanxfer_proto::features::PRESERVE`]).
    pub preserve: crate::preserve::Preserve,
    /// A pull whose receiver holds nothing of the transfer (`session_flags::FRESH`, with
    /// `features::PULL_PIPELINE`): the sender reads each file as it announces it, and
    /// the receiver's writers wait for an entry that a block overtook.
    pub fresh: bool,
}

impl Params {
    /// The parameters both sides derive from the server's answer, plus this side's own
    /// thread counts and I/O mode.
    pub fn from_accepted(
        a: &wanxfer_proto::SessionAccepted,
        transfer_id: &[u8; 16],
        tuning: &Tuning,
        features: u64,
    ) -> Params {
        use wanxfer_proto::session_flags::{DISCARD, NO_BLOCK_CHECKSUM, NO_FILE_DIGEST};
        Params {
            session_tag: tag(&a.session_id),
            transfer_tag: tag(transfer_id),
            streams: a.streams,
            max_streams: a.max_streams,
            block_size: a.block_size,
            depth: a.depth,
            window: a.window,
            readers: tuning.readers.clamp(1, MAX_DISK_THREADS),
            writers: tuning.writers.clamp(1, MAX_DISK_THREADS),
            block_crc: a.flags & (NO_BLOCK_CHECKSUM | NO_FILE_DIGEST) == NO_FILE_DIGEST,
            file_digest: a.flags & NO_FILE_DIGEST == 0,
            discard: a.flags & DISCARD != 0,
            io: tuning.io,
            compare: tuning.compare,
            durable: tuning.durable,
            stall_timeout: tuning.stall_timeout,
            idle_timeout: tuning.idle_timeout,
            features,
            send_key: None,
            auto_streams: false,
            rate_bits_per_s: tuning.rate_bits_per_s,
            congestion: tuning.congestion.clone(),
            preserve: if features & wanxfer_proto::features::PRESERVE != 0 {
                crate::preserve::Preserve::from_flags(a.flags)
            } else {
                crate::preserve::Preserve::default()
            },
            fresh: a.flags & wanxfer_proto::session_flags::FRESH != 0
                && features & wanxfer_proto::features::PULL_PIPELINE != 0,
        }
    }

    /// `--preserve hardlinks` with a peer that marks link targets (or wants them
    /// marked): the receiver remembers only the marked files.
    pub fn marks_link_targets(&self) -> bool {
        self.preserve.hardlinks && self.features & wanxfer_proto::features::LINK_TARGETS != 0
    }

    /// Settles `--io auto` for this session's peer (see [`IoMode::resolve`]): the readers
    /// read every byte when a checksum or a digest needs them.
    pub fn resolve_io(&mut self, peer_on_this_host: bool) {
        let reads_every_byte = self.block_crc || self.file_digest;
        self.io = self.io.resolve(peer_on_this_host, reads_every_byte);
    }

    /// Whether the receiver journals and resumes (both sides offered it).
    pub fn resumes(&self) -> bool {
        self.features & wanxfer_proto::features::RESUME != 0
    }

    /// Settles how blocks are sent under TLS on `control`: `sendfile` and `MSG_ZEROCOPY`
    /// bypass user space, so with records sealed by rustls every block is copied through
    /// it; where the kernel offers TLS, sending links move their records there instead
    /// and keep the mode. Returns whether links should do that, and what `--json` says
    /// when the mode had to change.
    pub fn settle_for_tls(&mut self, control: &crate::stream::Stream) -> (bool, Option<String>) {
        if !control.user_space_tls() || self.io == IoMode::Copy {
            return (false, None);
        }
        match crate::tls::kernel_offers_tls() {
            Ok(()) => (true, None),
            Err(why) => {
                let asked = self.io.name();
                self.io = IoMode::Copy;
                (
                    false,
                    Some(format!(
                        "{asked}: TLS records are sealed in user space, so blocks are copied \
                         through it (the kernel offers no TLS: {why})"
                    )),
                )
            }
        }
    }

    /// The checks every block of this session carries (`digest::check_flags`).
    pub fn check_flags(&self) -> u8 {
        crate::digest::check_flags(self.block_crc, self.file_digest)
    }

    /// Buffers in a sending side's pool: every channel's queue plus one in the hands of
    /// each channel and reader (the negotiated budget counted these).
    pub fn send_buffers(&self) -> usize {
        wanxfer_session::negotiate::buffers(self.streams, self.depth, self.readers as u32) as usize
    }

    /// Buffers in a receiving side's shared pool (TCP): likewise with its writers.
    pub fn receive_buffers(&self) -> usize {
        wanxfer_session::negotiate::buffers(self.streams, self.depth, self.writers as u32) as usize
    }
}

/// The first 8 bytes of a 16-byte id, as a number for names and block headers.
pub fn tag(id: &[u8; 16]) -> u64 {
    u64::from_le_bytes(id[..8].try_into().expect("8 of 16 bytes"))
}

/// Fills `buf` from the operating system's random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N], crate::Error> {
    let mut buf = [0u8; N];
    getrandom::fill(&mut buf).map_err(|e| {
        crate::Error::local(
            "read",
            "the system random source",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(buf)
}

/// The destination name that means "discard": memory-to-memory runs, never a file.
pub const DISCARD_PATH: &[u8] = b"dev/null";
/// The source name that means "generate": memory-to-memory runs, never a file.
pub const SYNTHETIC_PATH: &[u8] = b"dev/zero";

#[cfg(test)]
mod tests {
    use super::*;
    use wanxfer_proto::session_flags::{NO_BLOCK_CHECKSUM, NO_FILE_DIGEST};

    fn agreed(flags: u32) -> Params {
        let accepted = wanxfer_proto::SessionAccepted {
            session_id: [1; 16],
            streams: 1,
            block_size: 1 << 20,
            depth: 2,
            window: 16,
            flags,
            max_streams: 4,
            placement: wanxfer_proto::Placement::Resolve,
        };
        Params::from_accepted(&accepted, &[2; 16], &Tuning::default(), 0)
    }

    /// Digests check every block, so a payload CRC is sent only in a session without
    /// them, and only if it was not turned off too.
    #[test]
    fn the_payload_crc_only_stands_in_for_missing_digests() {
        let checks = |flags| {
            let p = agreed(flags);
            (p.file_digest, p.block_crc)
        };
        assert_eq!(checks(0), (true, false));
        assert_eq!(checks(NO_BLOCK_CHECKSUM), (true, false));
        assert_eq!(checks(NO_FILE_DIGEST), (false, true));
        assert_eq!(checks(NO_FILE_DIGEST | NO_BLOCK_CHECKSUM), (false, false));
    }

    /// The regression of issue 16 item 8 on the client: whatever is asked, the buffers
    /// of either role fit the budget, threads giving way first.
    #[test]
    fn a_greedy_request_is_fitted_into_the_client_budget() {
        use wanxfer_proto::TransportKind;
        use wanxfer_session::negotiate::memory;
        let greedy = Tuning {
            readers: 100_000,
            writers: 100_000,
            streams: 64,
            block_size: 64 << 20,
            ..Tuning::default()
        };
        for receiving in [false, true] {
            let t = greedy.fitted(receiving);
            let threads = if receiving { t.writers } else { t.readers };
            let mem = memory(
                TransportKind::Tcp,
                t.streams,
                t.depth,
                t.block_size,
                threads as u32,
            );
            assert!(mem <= greedy.max_memory, "{t:?} needs {mem}");
            assert!(threads <= MAX_DISK_THREADS && t.streams >= 1, "{t:?}");
        }
        // What fits is left alone.
        let modest = Tuning::default().fitted(false);
        let d = Tuning::default();
        assert_eq!(
            (
                modest.streams,
                modest.depth,
                modest.block_size,
                modest.readers
            ),
            (d.streams, d.depth, d.block_size, d.readers)
        );
        // Many threads with small blocks fit as they are, but no more than the most.
        let threads = Tuning {
            readers: 100_000,
            ..Tuning::default()
        };
        assert_eq!(threads.fitted(false).readers, MAX_DISK_THREADS);
    }

    /// The regression of issue 16 item 8: a thread count asked for is clamped.
    #[test]
    fn thread_counts_are_clamped() {
        let tuning = Tuning {
            readers: 100_000,
            writers: 0,
            ..Tuning::default()
        };
        let accepted = wanxfer_proto::SessionAccepted {
            session_id: [1; 16],
            streams: 1,
            block_size: 1 << 20,
            depth: 2,
            window: 16,
            flags: 0,
            max_streams: 4,
            placement: wanxfer_proto::Placement::Resolve,
        };
        let p = Params::from_accepted(&accepted, &[2; 16], &tuning, 0);
        assert_eq!((p.readers, p.writers), (MAX_DISK_THREADS, 1));
    }
}
