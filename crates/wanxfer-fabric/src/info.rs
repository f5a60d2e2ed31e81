//! Provider discovery.
//!
//! Why this is strict: a data mover that silently falls back from `verbs` to
//! `tcp` moves data at a fraction of the expected rate and burns CPU, and the
//! operator only finds out from the throughput graph. So a named provider is
//! a requirement, and what was actually picked is reported so it can be
//! logged. The hints state every mode and mr_mode bit this crate copes with;
//! a provider demanding anything else does not match rather than being
//! driven incorrectly.

use std::ffi::{CStr, CString};
use std::net::SocketAddr;
use std::ptr;

use libfabric_sys as sys;

use crate::error::{Error, Result};

/// The libfabric API version this crate is written against.
pub(crate) const API_VERSION: u32 = sys::fi_version(1, 17);

/// The mr_mode bits this crate handles (see `mr.rs`).
const MR_MODES_HANDLED: u64 = sys::FI_MR_LOCAL
    | sys::FI_MR_VIRT_ADDR
    | sys::FI_MR_ALLOCATED
    | sys::FI_MR_PROV_KEY
    | sys::FI_MR_ENDPOINT;

/// Mode bits this crate honours: every operation context is a
/// `fi_context2`-sized scratch area owned by the endpoint, and block
/// notifications may consume receive buffers.
const MODES_HANDLED: u64 = sys::FI_CONTEXT | sys::FI_CONTEXT2 | sys::FI_RX_CQ_DATA;

/// What the caller wants from discovery.
#[derive(Debug, Clone, Default)]
pub struct FabricConfig {
    /// Provider name such as `"tcp"`, `"verbs"`, `"efa"`, `"cxi"`; `None`
    /// lets libfabric pick its preferred one.
    pub provider: Option<String>,
    /// Never ask for FI_REMOTE_CQ_DATA, so blocks are announced by message.
    /// Meant for testing that path; normally left `false`.
    pub disable_remote_cq_data: bool,
}

impl FabricConfig {
    /// A config requiring the named provider.
    pub fn with_provider(name: &str) -> Self {
        FabricConfig {
            provider: Some(name.to_owned()),
            ..Self::default()
        }
    }
}

/// What discovery chose, copied out of the `fi_info` for logging and for the
/// layers above.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderInfo {
    /// Provider name, e.g. `tcp` or `verbs;ofi_rxm`.
    pub provider: String,
    /// Fabric name (for tcp: the subnet).
    pub fabric: String,
    /// Domain name (for tcp: the interface; for verbs: the device).
    pub domain: String,
    /// The provider's `FI_MR_*` requirements.
    pub mr_mode: u64,
    /// Whether writes can carry remote CQ data (libfabric 1.x signals this
    /// by a non-zero `cq_data_size`, not by a capability bit).
    pub remote_cq_data: bool,
    /// Bytes of remote CQ data the provider delivers.
    pub cq_data_size: usize,
    /// Mode bits the provider requires of us.
    pub mode: u64,
    /// Ordering guarantees for transmitted messages (`FI_ORDER_*`).
    pub msg_order: u64,
    /// Largest gather list for one write or send.
    pub iov_limit: usize,
    /// Largest message.
    pub max_msg_size: usize,
}

impl ProviderInfo {
    /// Whether a write carrying remote CQ data consumes a posted receive.
    pub fn rx_cq_data(&self) -> bool {
        self.mode & sys::FI_RX_CQ_DATA != 0
    }

    /// Whether a send posted after a write is delivered after it.
    pub fn send_after_write_ordered(&self) -> bool {
        self.msg_order & sys::FI_ORDER_SAW != 0
    }
}

/// An owned `fi_info` list (freed with `fi_freeinfo`).
#[derive(Debug)]
pub(crate) struct OwnedInfo(*mut sys::fi_info);

// SAFETY: the list is plain heap data owned exclusively by this value; no
// libfabric object refers back to it.
unsafe impl Send for OwnedInfo {}
// SAFETY: shared access only reads the fields.
unsafe impl Sync for OwnedInfo {}

impl Drop for OwnedInfo {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: we own the list, and nothing else frees it.
            unsafe { sys::fi_freeinfo(self.0) };
        }
    }
}

impl OwnedInfo {
    /// Takes ownership of an `fi_info` handed out by libfabric.
    ///
    /// # Safety
    /// `info` must be a valid `fi_info` list nobody else frees.
    pub(crate) unsafe fn from_raw(info: *mut sys::fi_info) -> Self {
        OwnedInfo(info)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::fi_info {
        self.0
    }

    /// Applies the caller's restrictions to a chosen (or connection
    /// request) entry before endpoints are opened from it.
    pub(crate) fn apply(&mut self, cfg: &FabricConfig) {
        if cfg.disable_remote_cq_data {
            // SAFETY: a non-null fi_info has a valid domain_attr.
            unsafe { (*(*self.0).domain_attr).cq_data_size = 0 };
        }
    }

    /// The chosen entry's attributes, copied out.
    pub(crate) fn describe(&self) -> ProviderInfo {
        // SAFETY: a non-null fi_info from fi_getinfo/fi_dupinfo has all the
        // attribute pointers set and its strings NUL-terminated.
        unsafe {
            let info = &*self.0;
            let fabric = &*info.fabric_attr;
            let domain = &*info.domain_attr;
            let tx = &*info.tx_attr;
            let ep = &*info.ep_attr;
            ProviderInfo {
                provider: c_string(fabric.prov_name),
                fabric: c_string(fabric.name),
                domain: c_string(domain.name),
                mr_mode: domain.mr_mode as u64,
                remote_cq_data: domain.cq_data_size > 0,
                cq_data_size: domain.cq_data_size,
                mode: info.mode,
                msg_order: tx.msg_order,
                iov_limit: tx.iov_limit,
                max_msg_size: ep.max_msg_size,
            }
        }
    }
}

/// Copies a possibly-null C string.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string.
unsafe fn c_string(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated per the contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Where the endpoint sits: a local address to listen on, or a peer to dial; or
/// nowhere yet, asking for whatever the providers offer (only to start them).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Role {
    Listen(SocketAddr),
    Connect(SocketAddr),
    Any,
}

/// Runs `fi_getinfo` for a connected RMA endpoint at `role`'s address.
pub(crate) fn discover(cfg: &FabricConfig, role: Role) -> Result<OwnedInfo> {
    if let Some(why) = sys::library_unavailable() {
        return Err(Error::ProviderUnavailable {
            requested: cfg.provider.clone(),
            detail: why.to_string(),
        });
    }
    let mut info = getinfo(cfg, role).map_err(|code| Error::ProviderUnavailable {
        requested: cfg.provider.clone(),
        detail: format!(
            "fi_getinfo: {} (errno {code}); `fi_info -l` lists the providers present",
            crate::error::strerror(code)
        ),
    })?;
    info.apply(cfg);
    Ok(info)
}

/// Loads libfabric and has it initialise its providers; returns what discovery would
/// pick for `cfg`, or why nothing matches.
///
/// Why: the first `fi_getinfo` of a process loads the library with its providers'
/// dependencies and runs every provider's start-up (device scans, netlink queries): 0.46
/// s for `fi_info` on Debian 12 with no RDMA hardware. A client calls this once its
/// control connection is up, so that the time overlaps the handshake's round trips
/// instead of following the session's agreement; a server calls it as it starts, so that
/// its first fabric session does not pay it (and the operator learns at once whether the
/// provider is there). Safe to call from any thread, and again.
///
/// Loading the library runs its dependencies' constructors under the dynamic loader's
/// lock, for 0.2 s here (libpsm_infinipath's polls a device in a sleeping loop), and every
/// thread takes that lock as it starts, as does a first `dlsym`: what must not wait
/// should be started before this is.
pub fn prepare(cfg: &FabricConfig) -> Result<ProviderInfo> {
    discover(cfg, Role::Any).map(|info| info.describe())
}

/// One `fi_getinfo` attempt; the error is libfabric's positive errno.
fn getinfo(cfg: &FabricConfig, role: Role) -> std::result::Result<OwnedInfo, i32> {
    let hints = build_hints(cfg)?;
    let (addr, flags) = match role {
        Role::Listen(a) => (Some(a), sys::FI_SOURCE),
        Role::Connect(a) => (Some(a), 0),
        Role::Any => (None, 0),
    };
    let text = |s: String| CString::new(s).expect("address text has no NUL");
    let node = addr.map(|a| text(a.ip().to_string()));
    let service = addr.map(|a| text(a.port().to_string()));
    let c_ptr = |c: &Option<CString>| c.as_ref().map_or(ptr::null(), |c| c.as_ptr());
    let mut out = ptr::null_mut();
    // SAFETY: hints is a valid fi_info, node/service are null or NUL-terminated and
    // outlive the call, and `out` receives a list we then own.
    let ret = unsafe {
        sys::fi_getinfo(
            API_VERSION,
            c_ptr(&node),
            c_ptr(&service),
            flags,
            hints.as_ptr(),
            &mut out,
        )
    };
    if ret != 0 {
        return Err(-ret);
    }
    // SAFETY: fi_getinfo succeeded, so `out` is a list we now own.
    let info = unsafe { OwnedInfo::from_raw(out) };
    if out.is_null() {
        return Err(sys::FI_ENODATA);
    }
    Ok(info)
}

/// Builds the hints: connected endpoint, messages + RMA, thread-safe domain,
/// and every mode/mr_mode bit we handle.
fn build_hints(cfg: &FabricConfig) -> std::result::Result<OwnedInfo, i32> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with attribute structs,
    // or null, which we check before use; OwnedInfo frees it.
    let hints = unsafe { OwnedInfo::from_raw(sys::fi_allocinfo()) };
    if hints.as_ptr().is_null() {
        return Err(libc::ENOMEM);
    }
    // SAFETY: the attribute pointers of an fi_allocinfo result are valid;
    // the provider name is strdup'ed because fi_freeinfo frees it.
    unsafe {
        let h = &mut *hints.as_ptr();
        h.caps = sys::FI_MSG | sys::FI_RMA;
        h.mode = MODES_HANDLED;
        (*h.ep_attr).type_ = sys::FI_EP_MSG;
        let dom = &mut *h.domain_attr;
        dom.mr_mode = MR_MODES_HANDLED as i32;
        dom.threading = sys::FI_THREAD_SAFE;
        if let Some(name) = &cfg.provider {
            let name = CString::new(name.as_str()).map_err(|_| libc::EINVAL)?;
            (*h.fabric_attr).prov_name = libc::strdup(name.as_ptr());
        }
    }
    Ok(hints)
}
