//! wanxfer's RDMA transport: safe libfabric endpoints, memory registration
//! and a credit-based block channel.
//!
//! Why this crate exists: on science networks the data transfer nodes often
//! have RDMA-capable NICs (InfiniBand, RoCE, iWARP, Slingshot), and moving
//! blocks with RDMA writes straight into the receiver's block pool saves the
//! copies and most of the CPU that a TCP stream costs at 100 Gb/s. libfabric
//! gives one API over those NICs — and a `tcp` provider, so the very same
//! code path is tested on any Linux box without RDMA hardware.
//!
//! The layers, bottom up:
//! - [`Listener`] / [`Connection`]: connected (FI_EP_MSG) endpoints with
//!   their own domain and queues, posted receives, sends, gather writes with
//!   remote CQ data, and completions that are all handed to the caller.
//! - [`MemoryRegion`]: registrations resolving the provider's `mr_mode`, so
//!   the [`RemoteSlot`] a receiver hands out is right for its provider.
//! - [`Channel`]: the credit scheme the block engine runs on; see its
//!   module for why it is built the way it is.
//!
//! Everything is single-threaded per connection and driven by the caller:
//! libfabric providers such as `tcp` only make progress while their queues
//! are read, so a side that stops calling `poll`/`wait` stalls its peer.

mod buf;
mod channel;
mod conn;
mod error;
mod info;
mod mr;
pub mod pingpong;

pub use buf::{AlignedBuf, RegisterMem, PAGE};
pub use channel::{
    ctrl_credits_for_grants, Channel, ChannelConfig, Credit, Event, MAX_CTRL_CREDITS,
};
pub use conn::{Completion, ConnConfig, Connection, Listener};
pub use error::{Error, OpKind, Result};
pub use info::{prepare, FabricConfig, ProviderInfo};
pub use mr::{Access, MemoryRegion, RegistrationCount, RemoteSlot};
