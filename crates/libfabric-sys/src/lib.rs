//! Raw bindings to the system libfabric.
//!
//! Why a hand-rolled sys crate: the published bindings target libfabric 2.x
//! headers, while the distributions our data transfer nodes run (Debian 12)
//! ship 1.17. Generating from the installed headers keeps the struct layouts
//! exactly those of the library we link. Most of libfabric's API is
//! `static inline` dispatch through provider ops tables; bindgen's
//! `wrap_static_fns` emits C shims for them, which build.rs compiles, so the
//! Rust names below (`fi_write`, `fi_cq_read`, ...) link to those shims.
//!
//! A few function-like macros (`FI_VERSION`, `fi_allocinfo`) have no
//! binding; equivalents are provided here.

#[allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    unused_imports,
    clippy::all,
    clippy::pedantic,
    rustdoc::all
)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}

pub use generated::*;

/// `FI_VERSION(major, minor)` from `fabric.h`.
pub const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// `FI_ADDR_UNSPEC` / `FI_ADDR_NOTAVAIL` (`((uint64_t) -1)`), which cexpr
/// cannot evaluate because of the cast.
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;

/// `FI_KEY_NOTAVAIL` (`((uint64_t) -1)`).
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;

/// `fi_allocinfo()` is a macro for `fi_dupinfo(NULL)`.
///
/// # Safety
/// The returned pointer (null on allocation failure) must be released with
/// [`fi_freeinfo`].
pub unsafe fn fi_allocinfo() -> *mut fi_info {
    // SAFETY: fi_dupinfo accepts NULL and then allocates a zeroed fi_info
    // with all attribute structs; the caller takes ownership per the contract.
    unsafe { fi_dupinfo(std::ptr::null()) }
}
