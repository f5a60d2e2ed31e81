//! Memory registration.
//!
//! Why it looks like this:
//! - Providers differ in what a registration means (`mr_mode`): with
//!   FI_MR_VIRT_ADDR the peer addresses a region by its virtual address,
//!   without it (tcp reports mr_mode 0) by the offset into the region; with
//!   FI_MR_PROV_KEY the key is chosen by the provider; FI_MR_LOCAL needs the
//!   descriptor on local buffers; FI_MR_ENDPOINT ties the region to one
//!   endpoint. All of this is resolved here once, so the channel above just
//!   passes around [`RemoteSlot`]s that are correct for the provider in use.
//! - Registration is expensive (page pinning on real NICs), so regions are
//!   registered once per session and looked up again by address; operations
//!   take the descriptor from that lookup rather than the caller.
//! - Memory a peer may write must outlive every key handed out for it, and
//!   a key must not outlive the session. So a region owns (or, for the unsafe
//!   raw path, is promised) its memory, in-flight operations hold the region
//!   alive, and the region is closed when its last holder goes — at the
//!   latest when the session ends. A counter of live registrations makes that
//!   checkable.

use std::ops::BitOr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use libfabric_sys as sys;

use crate::buf::RegisterMem;
use crate::conn::DomainCore;
use crate::error::{check, check_int, Error, Result};

/// Access rights of a registration (`FI_SEND`, `FI_WRITE`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access(u64);

impl Access {
    /// Source of eager sends.
    pub const SEND: Access = Access(sys::FI_SEND);
    /// Target of posted receives.
    pub const RECV: Access = Access(sys::FI_RECV);
    /// Local source of RDMA writes.
    pub const WRITE_SOURCE: Access = Access(sys::FI_WRITE);
    /// Target of the peer's RDMA writes (a block pool).
    pub const REMOTE_WRITE: Access = Access(sys::FI_REMOTE_WRITE);

    /// The `FI_*` bits.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Whether every right in `other` is included.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    fn name(self) -> &'static str {
        match self {
            Access::SEND => "send",
            Access::RECV => "receive",
            Access::WRITE_SOURCE => "write-source",
            Access::REMOTE_WRITE => "remote-write",
            _ => "combined",
        }
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// What a peer needs to RDMA-write into part of a registered region:
/// the address in the form the provider expects, the key, and the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlot {
    /// Virtual address (FI_MR_VIRT_ADDR providers) or offset into the
    /// registered region (offset-based providers such as tcp).
    pub addr: u64,
    /// Remote protection key.
    pub key: u64,
    /// Bytes writable at `addr`.
    pub len: u64,
}

/// Counts the live registrations of one connection (internal buffers
/// included); stays readable after the connection is gone.
#[derive(Debug, Clone, Default)]
pub struct RegistrationCount(pub(crate) Arc<AtomicUsize>);

impl RegistrationCount {
    /// Registrations not yet closed.
    pub fn live(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The provider-level registration; closed on drop.
pub(crate) struct MrCore {
    mr: *mut sys::fid_mr,
    desc: *mut libc::c_void,
    key: u64,
    base: *mut u8,
    len: usize,
    access: Access,
    /// Keeps the domain (and so the provider state behind `mr`) open.
    dom: Arc<DomainCore>,
    /// The registered memory, when this layer owns it; dropped after `mr`
    /// is closed because fields drop after `Drop::drop` runs.
    _owner: Option<Box<dyn RegisterMem>>,
}

// SAFETY: the domain is opened FI_THREAD_SAFE, the raw pointers are never
// mutated after construction, and the memory is either owned here or
// promised by the caller of `register_raw` to stay valid.
unsafe impl Send for MrCore {}
// SAFETY: as above; shared access only reads immutable fields.
unsafe impl Sync for MrCore {}

impl Drop for MrCore {
    fn drop(&mut self) {
        // SAFETY: `mr` came from fi_mr_reg and is closed exactly once, here;
        // the domain is kept open by `self.dom`.
        let ret = unsafe { sys::fi_close(&mut (*self.mr).fid) };
        debug_assert_eq!(ret, 0, "fi_close(mr) failed");
        self.dom.registrations.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MrCore {
    pub(crate) fn desc(&self) -> *mut libc::c_void {
        self.desc
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }

    pub(crate) fn belongs_to(&self, dom: &Arc<DomainCore>) -> bool {
        Arc::ptr_eq(&self.dom, dom)
    }

    fn covers(&self, addr: usize, len: usize, access: Access) -> bool {
        let start = self.base as usize;
        self.access.contains(access) && addr >= start && addr + len <= start + self.len
    }
}

/// Registers `len` bytes at `base`, binding to `ep` when the provider
/// demands FI_MR_ENDPOINT.
///
/// # Safety
/// `base..base+len` must stay valid until the returned core is dropped (it
/// is when `owner` holds that memory), and `ep` must be an open endpoint of
/// `dom`.
pub(crate) unsafe fn register(
    dom: &Arc<DomainCore>,
    ep: *mut sys::fid_ep,
    base: *mut u8,
    len: usize,
    access: Access,
    owner: Option<Box<dyn RegisterMem>>,
) -> Result<Arc<MrCore>> {
    let requested_key = dom.next_key.fetch_add(1, Ordering::Relaxed);
    let mut mr = std::ptr::null_mut();
    // SAFETY: the domain is open; base/len are valid per the contract.
    let ret = unsafe {
        sys::fi_mr_reg(
            dom.domain,
            base.cast(),
            len,
            access.bits(),
            0,
            requested_key,
            0,
            &mut mr,
            std::ptr::null_mut(),
        )
    };
    check(ret as isize, "fi_mr_reg")?;
    dom.registrations.fetch_add(1, Ordering::SeqCst);
    let mut core = MrCore {
        mr,
        desc: std::ptr::null_mut(),
        key: 0,
        base,
        len,
        access,
        dom: Arc::clone(dom),
        _owner: owner,
    };
    if dom.mr_mode & sys::FI_MR_ENDPOINT != 0 {
        // SAFETY: mr and ep are open objects of the same domain.
        unsafe { bind_to_endpoint(mr, ep)? };
    }
    // SAFETY: mr is a registered (and, if needed, enabled) region.
    unsafe {
        core.desc = sys::fi_mr_desc(mr);
        core.key = sys::fi_mr_key(mr);
    }
    Ok(Arc::new(core))
}

/// FI_MR_ENDPOINT: a region is usable only once bound to the endpoint and
/// enabled.
///
/// # Safety
/// `mr` and `ep` are open objects of the same domain.
unsafe fn bind_to_endpoint(mr: *mut sys::fid_mr, ep: *mut sys::fid_ep) -> Result<()> {
    // SAFETY: per the contract.
    unsafe {
        check_int(sys::fi_mr_bind(mr, &mut (*ep).fid, 0), "fi_mr_bind")?;
        check_int(sys::fi_mr_enable(mr), "fi_mr_enable")
    }
}

/// A registered memory region. Clones share one registration, which is
/// closed when the last clone (and every operation using it) is gone.
#[derive(Clone)]
pub struct MemoryRegion(pub(crate) Arc<MrCore>);

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("base", &self.0.base)
            .field("len", &self.0.len)
            .field("key", &self.0.key)
            .field("access", &self.0.access)
            .finish()
    }
}

impl MemoryRegion {
    /// Start of the registered memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.base
    }

    /// Length of the registered memory.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The provider key (what a peer must present).
    pub fn key(&self) -> u64 {
        self.0.key
    }

    /// The access rights registered.
    pub fn access(&self) -> Access {
        self.0.access
    }

    /// The registered bytes.
    ///
    /// Bytes a peer holds a credit for may change underneath this slice;
    /// read a slot only between its arrival and granting it again.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the memory is valid for the region's lifetime.
        unsafe { std::slice::from_raw_parts(self.0.base, self.0.len) }
    }

    /// Mutable view of `range` (e.g. to read file data into a block buffer).
    ///
    /// # Safety
    /// No other reference to these bytes may exist while the slice lives,
    /// no posted operation may be reading them, and no peer may hold a
    /// credit for them.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.start <= range.end && range.end <= self.0.len,
            "range outside region"
        );
        // SAFETY: in bounds (checked) and exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.base.add(range.start), range.len()) }
    }

    /// What a peer needs to write `len` bytes at `offset` of this region,
    /// in the addressing mode of the provider.
    pub fn remote_slot(&self, offset: usize, len: usize) -> Result<RemoteSlot> {
        if !self.0.access.contains(Access::REMOTE_WRITE) {
            return Err(Error::InvalidArgument(
                "region is not registered for remote write".into(),
            ));
        }
        if offset.checked_add(len).is_none_or(|end| end > self.0.len) {
            return Err(Error::InvalidArgument(format!(
                "slot {offset}+{len} outside region of {} bytes",
                self.0.len
            )));
        }
        let virt = self.0.dom.mr_mode & (sys::FI_MR_VIRT_ADDR | sys::FI_MR_BASIC as u64) != 0;
        let base = if virt { self.0.base as u64 } else { 0 };
        Ok(RemoteSlot {
            addr: base + offset as u64,
            key: self.0.key,
            len: len as u64,
        })
    }
}

/// Registrations of one connection, looked up by address.
#[derive(Default)]
pub(crate) struct RegCache {
    entries: Vec<Weak<MrCore>>,
    /// Registrations of caller-owned memory live until the session ends.
    pinned: Vec<Arc<MrCore>>,
}

impl RegCache {
    /// A live registration covering `addr..addr+len` with `access`.
    pub(crate) fn find(&self, addr: usize, len: usize, access: Access) -> Option<Arc<MrCore>> {
        self.entries
            .iter()
            .filter_map(Weak::upgrade)
            .find(|mr| mr.covers(addr, len, access))
    }

    /// Like [`RegCache::find`], but an error naming the missing access.
    pub(crate) fn resolve(&self, addr: usize, len: usize, access: Access) -> Result<Arc<MrCore>> {
        self.find(addr, len, access).ok_or(Error::NotRegistered {
            addr,
            len,
            access: access.name(),
        })
    }

    pub(crate) fn insert(&mut self, mr: &Arc<MrCore>) {
        self.entries.retain(|w| w.strong_count() > 0);
        self.entries.push(Arc::downgrade(mr));
    }

    /// Inserts and keeps the registration until the cache is dropped.
    pub(crate) fn insert_pinned(&mut self, mr: &Arc<MrCore>) {
        self.insert(mr);
        self.pinned.push(Arc::clone(mr));
    }
}
