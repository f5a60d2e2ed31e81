//! wanxfer's block engine: files in, blocks across, files out.
//!
//! One session moves a dataset between a sender and a receiver (client or server on
//! either side). The sender's front end ([`source`]) lists files and cuts or packs them
//! into blocks in pool buffers ([`pool`]); the back end ([`transport`]) moves blocks over
//! any number of channels; the receiver's front end ([`sink`]) places blocks at their
//! offsets in temporaries confined beneath a root ([`fs`]), verifies, and renames. The
//! [`session`] module drives both ends over a control connection using the sans-IO
//! protocol in `wanxfer-proto`.
//!
//! Besides sessions, a control connection can carry remote operations on the served tree
//! ([`ops`]: stat, list, mkdir, remove, rename, checksum), executed beneath the same root.
//!
//! What the engine does not do: print, parse command lines, or pick policy defaults for a
//! user; the `wanxfer` binary does that.

pub mod auth;
pub mod commit;
pub mod digest;
mod error;
pub mod fs;
mod ktls;
pub mod links;
pub mod ops;
pub mod pool;
pub mod preserve;
pub mod progress;
mod records;
pub mod secret;
pub mod select;
pub mod session;
pub mod sink;
pub mod source;
pub mod stream;
pub mod tls;
pub mod transport;

pub use error::{Error, ErrorClass};
