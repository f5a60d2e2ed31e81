//! Sessions: one transfer between a client and a server.
//!
//! A session is a control connection (hello, mutual authentication, the request, the
//! manifest, acknowledgements, the closing statistics) plus `streams` data channels that
//! present a proof bound to the session before carrying blocks. The client always
//! connects, whichever way data flows, so that only the server needs an open port.
//! [`client`] and [`server`] set a session up; [`driver`] runs the sending or receiving
//! role, which is the same code on either side.

pub mod client;
pub(crate) mod control;
pub mod driver;
pub mod server;

pub use client::{run_client, ClientConfig, ClientJob, PullDest, Report};
pub use server::{Server, ServerLimits};

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

/// What a user may tune; the server clamps every value to its own limits.
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
    pub stall_timeout: std::time::Duration,
}

/// A path silent for this long is declared dead.
pub const DEFAULT_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

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
        }
    }
}

/// The parameters a running session uses, agreed at its start.
#[derive(Debug, Clone)]
pub struct Params {
    pub session_tag: u64,
    pub streams: u16,
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
}

impl Params {
    /// The parameters both sides derive from the server's answer, plus this side's own
    /// thread counts and I/O mode.
    pub fn from_accepted(
        a: &wanxfer_proto::SessionAccepted,
        readers: usize,
        writers: usize,
        io: IoMode,
    ) -> Params {
        use wanxfer_proto::session_flags::{DISCARD, NO_BLOCK_CHECKSUM, NO_FILE_DIGEST};
        Params {
            session_tag: session_tag(&a.session_id),
            streams: a.streams,
            block_size: a.block_size,
            depth: a.depth,
            window: a.window,
            readers: readers.max(1),
            writers: writers.max(1),
            block_crc: a.flags & (NO_BLOCK_CHECKSUM | NO_FILE_DIGEST) == NO_FILE_DIGEST,
            file_digest: a.flags & NO_FILE_DIGEST == 0,
            discard: a.flags & DISCARD != 0,
            io,
        }
    }

    /// Settles `--io auto` for this session's peer (see [`IoMode::resolve`]): the readers
    /// read every byte when a checksum or a digest needs them.
    pub fn resolve_io(&mut self, peer_on_this_host: bool) {
        let reads_every_byte = self.block_crc || self.file_digest;
        self.io = self.io.resolve(peer_on_this_host, reads_every_byte);
    }

    /// The checks every block of this session carries (`digest::check_flags`).
    pub fn check_flags(&self) -> u8 {
        crate::digest::check_flags(self.block_crc, self.file_digest)
    }

    /// Buffers in this side's pool: every channel's queue plus one in the hands of each
    /// channel, reader and writer.
    pub fn pool_blocks(&self) -> usize {
        let streams = usize::from(self.streams);
        (streams * (usize::from(self.depth) + 1) + self.readers + self.writers).max(4)
    }
}

fn session_tag(id: &[u8; 16]) -> u64 {
    u64::from_le_bytes(id[..8].try_into().expect("8 of 16 bytes"))
}

/// Fills `buf` from the operating system's random source.
fn random<const N: usize>() -> Result<[u8; N], crate::Error> {
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
        };
        Params::from_accepted(&accepted, 1, 1, IoMode::Auto)
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
}
