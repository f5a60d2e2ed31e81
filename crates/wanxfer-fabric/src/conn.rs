//! Connected endpoints: listen, accept, connect, post, and reap completions.
//!
//! Why it is built this way:
//! - One domain, completion queue and event queue per connection. A session's
//!   keys then die with the session's domain, one connection's completions
//!   never have to be routed to another, and dropping a connection is a
//!   complete teardown.
//! - Receives are posted before `fi_accept`/`fi_connect`: on RDMA hardware a
//!   message arriving before a receive is posted is dropped or stalls the
//!   connection (receiver-not-ready), so the window must be open first.
//! - Every context passed to libfabric points into memory owned by the
//!   connection that outlives the endpoint, large enough for FI_CONTEXT2, so
//!   providers that use the context as scratch space are served too; the
//!   memory an operation reads or writes is held alive by the operation until
//!   its completion is reaped or the endpoint is closed.
//! - Completions are never dropped: anything reaped while the layer waits for
//!   queue space is kept and handed out by the next `poll`.
//! - Waiting blocks in `fi_cq_sread` in short slices instead of spinning, and
//!   checks the event queue between slices, because providers such as tcp
//!   only make progress (and only notice a vanished peer) while the
//!   application reads its queues.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libfabric_sys as sys;

use crate::buf::{AlignedBuf, RegisterMem};
use crate::error::{check, check_int, strerror, Error, OpKind, Result};
use crate::info::{discover, FabricConfig, OwnedInfo, ProviderInfo, Role};
use crate::mr::{self, Access, MemoryRegion, MrCore, RegCache, RegistrationCount, RemoteSlot};

/// Longest single block inside a wait, so the event queue is looked at
/// regularly and deadlines are honoured.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// How an accepted connection names its (unknown) peer.
const ACCEPTED_PEER: &str = "the accepted peer";

/// Completions read per `fi_cq_read`.
const CQ_BATCH: usize = 16;

/// Room for an event queue entry plus connection data.
const EQ_ENTRY_WORDS: usize = 64;

/// Sizes of a connection's queues and internal buffers.
#[derive(Debug, Clone)]
pub struct ConnConfig {
    /// Receive buffers posted at all times.
    pub rx_count: usize,
    /// Bytes per receive buffer (largest message accepted).
    pub rx_size: usize,
    /// Send buffers (bounds sends in flight).
    pub tx_count: usize,
    /// Bytes per send buffer (largest message sent).
    pub tx_size: usize,
    /// RDMA writes in flight at most.
    pub max_writes: usize,
}

impl Default for ConnConfig {
    fn default() -> Self {
        ConnConfig {
            rx_count: 16,
            rx_size: 4096,
            tx_count: 16,
            tx_size: 4096,
            max_writes: 64,
        }
    }
}

impl ConnConfig {
    fn op_capacity(&self) -> usize {
        self.rx_count + self.tx_count + self.max_writes
    }
}

/// A finished operation or an event from the peer.
#[derive(Debug)]
#[non_exhaustive]
pub enum Completion {
    /// A send finished; its buffer is free again.
    Sent {
        /// The value given when posting.
        user: u64,
    },
    /// A local RDMA write finished; its source memory may be reused.
    Written {
        /// The value given when posting.
        user: u64,
    },
    /// A message arrived (its receive buffer is already reposted).
    Received {
        /// The message bytes.
        data: Vec<u8>,
        /// Remote CQ data, if the sender attached any.
        imm: Option<u64>,
    },
    /// The peer RDMA-wrote into our memory and attached remote CQ data.
    RemoteWrite {
        /// The remote CQ data.
        imm: u64,
        /// Bytes written, as reported by the provider (tcp in libfabric
        /// 1.17 reports 0; carry the length in `imm` where it matters).
        len: usize,
    },
    /// An operation failed (e.g. flushed because the connection broke).
    Failed {
        /// The value given when posting (0 for receives).
        user: u64,
        /// What went wrong.
        error: Error,
    },
}

/// Closes a libfabric object.
///
/// # Safety
/// `fid` is null or an open object closed nowhere else.
unsafe fn close(fid: *mut sys::fid) -> i32 {
    if fid.is_null() {
        return 0;
    }
    // SAFETY: per the contract.
    unsafe { sys::fi_close(fid) }
}

/// An open fabric, shared by a listener and the connections it accepted.
pub(crate) struct FabricRes(*mut sys::fid_fabric);

// SAFETY: fabric objects are thread-safe in libfabric (FI_THREAD_SAFE).
unsafe impl Send for FabricRes {}
// SAFETY: as above.
unsafe impl Sync for FabricRes {}

impl Drop for FabricRes {
    fn drop(&mut self) {
        // SAFETY: opened by fi_fabric; children hold an Arc, so none is open.
        unsafe { close(&mut (*self.0).fid) };
    }
}

fn open_fabric(info: &OwnedInfo) -> Result<Arc<FabricRes>> {
    let mut fabric = ptr::null_mut();
    // SAFETY: info is a valid fi_info from fi_getinfo.
    let ret = unsafe { sys::fi_fabric((*info.as_ptr()).fabric_attr, &mut fabric, ptr::null_mut()) };
    check_int(ret, "fi_fabric")?;
    Ok(Arc::new(FabricRes(fabric)))
}

/// Opens an event queue, with a file descriptor to wait on if possible.
fn open_eq(fabric: &FabricRes) -> Result<*mut sys::fid_eq> {
    let mut last = 0;
    for wait_obj in [sys::FI_WAIT_FD, sys::FI_WAIT_UNSPEC] {
        let mut attr = sys::fi_eq_attr {
            size: 64,
            wait_obj,
            ..Default::default()
        };
        let mut eq = ptr::null_mut();
        // SAFETY: fabric is open; attr and eq are valid for the call.
        last = unsafe { sys::fi_eq_open(fabric.0, &mut attr, &mut eq, ptr::null_mut()) };
        if last == 0 {
            return Ok(eq);
        }
    }
    check_int(last, "fi_eq_open").map(|()| ptr::null_mut())
}

/// The file descriptor behind a queue's FI_WAIT_FD wait object.
fn wait_fd(queue: *mut sys::fid) -> Option<i32> {
    let mut fd: libc::c_int = -1;
    // SAFETY: queue is an open CQ or EQ; FI_GETWAIT writes one int.
    let ret = unsafe {
        sys::fi_control(
            queue,
            sys::FI_GETWAIT as i32,
            (&mut fd as *mut libc::c_int).cast(),
        )
    };
    (ret == 0 && fd >= 0).then_some(fd)
}

/// How a connection sleeps until its queues have something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// `fi_trywait`, then poll(2) on the CQ's and EQ's descriptors.
    Fd,
    /// `fi_cq_sread`.
    Sread,
    /// No wait object: short naps between polls.
    Nap,
}

/// Per-connection provider objects, kept open while anything (the
/// connection or a memory region) still needs them.
pub(crate) struct DomainCore {
    pub(crate) domain: *mut sys::fid_domain,
    cq: *mut sys::fid_cq,
    eq: *mut sys::fid_eq,
    pub(crate) mr_mode: u64,
    pub(crate) next_key: AtomicU64,
    pub(crate) registrations: Arc<AtomicUsize>,
    fabric: Arc<FabricRes>,
}

// SAFETY: the domain is opened FI_THREAD_SAFE; the pointers never change.
unsafe impl Send for DomainCore {}
// SAFETY: as above.
unsafe impl Sync for DomainCore {}

impl Drop for DomainCore {
    fn drop(&mut self) {
        // SAFETY: each object is open or null, closed once, children first
        // (the endpoint and every region are already closed: they hold us).
        unsafe {
            close(self.cq.cast());
            close(self.eq.cast());
            close(self.domain.cast());
        }
    }
}

impl DomainCore {
    fn open(fabric: Arc<FabricRes>, info: &OwnedInfo, cq_size: usize) -> Result<(Self, Waiting)> {
        let mut core = DomainCore {
            domain: ptr::null_mut(),
            cq: ptr::null_mut(),
            eq: ptr::null_mut(),
            mr_mode: info.describe().mr_mode,
            next_key: AtomicU64::new(1),
            registrations: Arc::default(),
            fabric,
        };
        // SAFETY: fabric is open and info valid; on error `core` drops and
        // closes whatever was opened.
        let ret = unsafe {
            sys::fi_domain(
                core.fabric.0,
                info.as_ptr(),
                &mut core.domain,
                ptr::null_mut(),
            )
        };
        check_int(ret, "fi_domain")?;
        let mut waiting = core.open_cq(cq_size)?;
        core.eq = open_eq(&core.fabric)?;
        if waiting == Waiting::Fd && core.wait_fds().is_none() {
            waiting = Waiting::Sread;
        }
        Ok((core, waiting))
    }

    /// Opens the CQ with the best wait object the provider has: a file
    /// descriptor (so CQ and EQ can be slept on together), else its own
    /// blocking read, else none (then waiting naps briefly between polls).
    fn open_cq(&mut self, size: usize) -> Result<Waiting> {
        let choices = [
            (sys::FI_WAIT_FD, Waiting::Fd),
            (sys::FI_WAIT_UNSPEC, Waiting::Sread),
            (sys::FI_WAIT_NONE, Waiting::Nap),
        ];
        let mut last = 0;
        for (wait_obj, waiting) in choices {
            let mut attr = sys::fi_cq_attr {
                size,
                format: sys::FI_CQ_FORMAT_DATA,
                wait_obj,
                ..Default::default()
            };
            // SAFETY: the domain is open; attr and cq are valid for the call.
            last =
                unsafe { sys::fi_cq_open(self.domain, &mut attr, &mut self.cq, ptr::null_mut()) };
            if last == 0 {
                return Ok(waiting);
            }
        }
        check_int(last, "fi_cq_open").map(|()| Waiting::Nap)
    }

    /// The wait descriptors of CQ and EQ, if both have one.
    fn wait_fds(&self) -> Option<[i32; 2]> {
        let fds = [wait_fd(self.cq.cast())?, wait_fd(self.eq.cast())?];
        Some(fds)
    }
}

/// Scratch memory handed to libfabric as an operation's context.
#[repr(C)]
struct OpCtx(UnsafeCell<sys::fi_context2>);

/// What the connection remembers about a posted operation.
struct OpState {
    kind: OpKind,
    user: u64,
    /// Internal buffer index (receive or send pool).
    buf: usize,
    /// Regions the operation reads or writes, kept registered until done.
    _hold: Vec<Arc<MrCore>>,
}

/// Equal-sized internal buffers in one registration.
struct BufPool {
    mr: Arc<MrCore>,
    size: usize,
}

impl BufPool {
    fn ptr(&self, index: usize) -> *mut u8 {
        // SAFETY: index < count by construction of every caller, so the
        // offset stays inside the registered allocation.
        unsafe { self.mr.base().add(index * self.size) }
    }
}

/// A connected endpoint.
pub struct Connection {
    ep: *mut sys::fid_ep,
    dom: Arc<DomainCore>,
    info: ProviderInfo,
    peer: String,
    waiting: Waiting,
    ctxs: Box<[OpCtx]>,
    ops: Vec<Option<OpState>>,
    free_ops: Vec<usize>,
    rx: Option<BufPool>,
    tx: Option<BufPool>,
    tx_free: Vec<usize>,
    writes_in_flight: usize,
    max_writes: usize,
    regs: RegCache,
    pending: VecDeque<Completion>,
    closed: Option<String>,
}

// SAFETY: all provider objects belong to a FI_THREAD_SAFE domain, and the
// connection is used through &mut from one thread at a time.
unsafe impl Send for Connection {}

impl Drop for Connection {
    fn drop(&mut self) {
        if self.ep.is_null() {
            return;
        }
        // SAFETY: ep is open and closed exactly once, here. Closing it ends
        // every operation, so afterwards the contexts, buffers and regions
        // (dropped with the fields) are no longer used by the provider.
        unsafe {
            sys::fi_shutdown(self.ep, 0);
            close(self.ep.cast());
        }
    }
}

impl Connection {
    /// Dials `addr` and returns once the connection is established.
    pub fn connect(
        cfg: &FabricConfig,
        addr: SocketAddr,
        cc: &ConnConfig,
        timeout: Option<Duration>,
    ) -> Result<Connection> {
        Connection::connect_with(cfg, addr, cc, timeout, |_| Vec::new()).map(|(conn, _)| conn)
    }

    /// As [`Connection::connect`], with the connection request carrying `data(room)`,
    /// where `room` is the most the provider carries (0 where it carries nothing); also
    /// returns what the acceptor's answer carried. What travels there costs no round
    /// trip of its own.
    pub fn connect_with(
        cfg: &FabricConfig,
        addr: SocketAddr,
        cc: &ConnConfig,
        timeout: Option<Duration>,
        data: impl FnOnce(usize) -> Vec<u8>,
    ) -> Result<(Connection, Vec<u8>)> {
        let info = discover(cfg, Role::Connect(addr))?;
        let fabric = open_fabric(&info)?;
        let mut conn = Connection::open(fabric, &info, cc, addr.to_string())?;
        let data = conn.checked_cm_data(data)?;
        // SAFETY: ep is enabled; dest_addr/len come from the same fi_info; data outlives
        // the call, which copies it.
        let ret = unsafe {
            sys::fi_connect(
                conn.ep,
                (*info.as_ptr()).dest_addr,
                data.as_ptr().cast(),
                data.len(),
            )
        };
        check_int(ret, "fi_connect").map_err(|e| conn.connect_failed(e.to_string()))?;
        let answer = conn.await_connected(timeout)?;
        Ok((conn, answer))
    }

    /// The kernel TCP socket this connection runs over, where the provider runs over one
    /// (tcp): `None` elsewhere, or where it cannot be told apart.
    ///
    /// Why: the provider takes no socket options, and a socket left as the kernel sizes it
    /// holds every byte the provider has copied in and not sent, tens of megabytes on a
    /// long path; bytes that wait behind a slow connection instead of going out on a
    /// faster one. The provider hands out no handle to its socket, so it is found among
    /// this process's descriptors by the two addresses the provider reports for the
    /// connection, which name exactly one connected socket. Only for options that change
    /// how much the kernel holds or how it sends, never what the provider reads or
    /// writes.
    pub fn kernel_socket(&self) -> Option<BorrowedFd<'_>> {
        let (local, peer) = (self.address(false)?, self.address(true)?);
        let fds = std::fs::read_dir("/proc/self/fd").ok()?;
        let fd = fds
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
            .find(|&fd| {
                // SAFETY: the descriptor is only borrowed for two queries and never
                // closed (ManuallyDrop); if it is not a socket they fail.
                let socket =
                    std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
                socket.local_addr().ok() == Some(local) && socket.peer_addr().ok() == Some(peer)
            })?;
        // SAFETY: the socket is the provider's for this connection's endpoint, which lives
        // (and keeps it open) as long as `self` is borrowed.
        Some(unsafe { BorrowedFd::borrow_raw(fd) })
    }

    /// This connection's own address, or with `peer` its peer's, as the provider reports
    /// it (`fi_getname`, `fi_getpeer`); `None` if it does not, or not as IP.
    fn address(&self, peer: bool) -> Option<SocketAddr> {
        // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of_val(&storage);
        let out = (&mut storage as *mut libc::sockaddr_storage).cast();
        // SAFETY: the endpoint is open; storage has `len` bytes for the provider to fill.
        let ret = unsafe {
            if peer {
                sys::fi_getpeer(self.ep, out, &mut len)
            } else {
                sys::fi_getname(&mut (*self.ep).fid, out, &mut len)
            }
        };
        if ret != 0 {
            return None;
        }
        sockaddr_to_std(&storage)
    }

    /// The bytes a connection request or answer may carry on this endpoint: 0 where
    /// the provider does not say (it then carries none).
    fn cm_data_room(&self) -> usize {
        let mut room = 0usize;
        let mut len = std::mem::size_of::<usize>();
        // SAFETY: the endpoint is open; room and len are valid for writes of a size_t.
        let ret = unsafe {
            sys::fi_getopt(
                &mut (*self.ep).fid,
                sys::FI_OPT_ENDPOINT as i32,
                sys::FI_OPT_CM_DATA_SIZE as i32,
                (&mut room as *mut usize).cast(),
                &mut len,
            )
        };
        if ret == 0 {
            room
        } else {
            0
        }
    }

    /// What `data` makes of this endpoint's room, refused if it does not fit.
    fn checked_cm_data(&self, data: impl FnOnce(usize) -> Vec<u8>) -> Result<Vec<u8>> {
        let room = self.cm_data_room();
        let data = data(room);
        if data.len() > room {
            return Err(Error::InvalidArgument(format!(
                "{} bytes of connection data where the provider carries {room}",
                data.len()
            )));
        }
        Ok(data)
    }

    /// Opens domain, queues and endpoint for `info`, registers the internal
    /// buffers and posts every receive — all before connecting.
    fn open(
        fabric: Arc<FabricRes>,
        info: &OwnedInfo,
        cc: &ConnConfig,
        peer: String,
    ) -> Result<Self> {
        if cc.rx_count == 0 || cc.tx_count == 0 || cc.rx_size == 0 || cc.tx_size == 0 {
            return Err(Error::InvalidArgument(
                "buffer counts and sizes must be non-zero".into(),
            ));
        }
        let cq_size = cc.op_capacity() * 2;
        let (dom, waiting) = DomainCore::open(fabric, info, cq_size)?;
        let capacity = cc.op_capacity();
        let mut conn = Connection {
            ep: ptr::null_mut(),
            dom: Arc::new(dom),
            info: info.describe(),
            peer,
            waiting,
            ctxs: (0..capacity)
                .map(|_| OpCtx(UnsafeCell::new(Default::default())))
                .collect(),
            ops: (0..capacity).map(|_| None).collect(),
            free_ops: (0..capacity).rev().collect(),
            rx: None,
            tx: None,
            tx_free: (0..cc.tx_count).rev().collect(),
            writes_in_flight: 0,
            max_writes: cc.max_writes,
            regs: RegCache::default(),
            pending: VecDeque::new(),
            closed: None,
        };
        conn.open_endpoint(info)?;
        conn.rx = Some(conn.buffer_pool(cc.rx_count, cc.rx_size, Access::RECV)?);
        conn.tx = Some(conn.buffer_pool(cc.tx_count, cc.tx_size, Access::SEND)?);
        for i in 0..cc.rx_count {
            conn.post_recv(i)?;
        }
        Ok(conn)
    }

    fn open_endpoint(&mut self, info: &OwnedInfo) -> Result<()> {
        // SAFETY: the domain, EQ and CQ are open; info is valid. On error
        // Drop closes the half-built endpoint.
        unsafe {
            let ret = sys::fi_endpoint(
                self.dom.domain,
                info.as_ptr(),
                &mut self.ep,
                ptr::null_mut(),
            );
            check_int(ret, "fi_endpoint")?;
            check_int(
                sys::fi_ep_bind(self.ep, &mut (*self.dom.eq).fid, 0),
                "fi_ep_bind(eq)",
            )?;
            let flags = sys::FI_TRANSMIT | sys::FI_RECV;
            check_int(
                sys::fi_ep_bind(self.ep, &mut (*self.dom.cq).fid, flags),
                "fi_ep_bind(cq)",
            )?;
            check_int(sys::fi_enable(self.ep), "fi_enable")
        }
    }

    fn buffer_pool(&mut self, count: usize, size: usize, access: Access) -> Result<BufPool> {
        let mut buf = AlignedBuf::new(count * size);
        let (base, len) = buf.region();
        // SAFETY: the region owns `buf`, so the memory lives as long as it.
        let mr =
            unsafe { mr::register(&self.dom, self.ep, base, len, access, Some(Box::new(buf)))? };
        Ok(BufPool { mr, size })
    }

    /// Waits for FI_CONNECTED on this connection's event queue; returns the data it
    /// carried.
    fn await_connected(&mut self, timeout: Option<Duration>) -> Result<Vec<u8>> {
        match wait_cm_event(self.dom.eq, timeout, "connection establishment") {
            Ok(CmEvent::Connected(data)) => Ok(data),
            Ok(other) => Err(self.connect_failed(format!("unexpected event {other:?}"))),
            Err(Error::Fabric { text, .. }) => Err(self.connect_failed(text)),
            Err(e) => Err(e),
        }
    }

    fn connect_failed(&self, detail: String) -> Error {
        Error::ConnectFailed {
            peer: self.peer.clone(),
            detail,
        }
    }

    /// What discovery chose for this connection.
    pub fn provider(&self) -> &ProviderInfo {
        &self.info
    }

    /// A live count of this connection's registrations.
    pub fn registrations(&self) -> RegistrationCount {
        RegistrationCount(Arc::clone(&self.dom.registrations))
    }

    /// Why the connection is closed, once it is.
    pub fn closed(&self) -> Option<&str> {
        self.closed.as_deref()
    }

    /// Registers memory this layer then owns (and keeps in place) for as
    /// long as the region or an operation on it lives.
    pub fn register<B: RegisterMem>(&mut self, mut buf: B, access: Access) -> Result<MemoryRegion> {
        let (base, len) = buf.region();
        // SAFETY: the region owns `buf`, whose memory does not move.
        let mr =
            unsafe { mr::register(&self.dom, self.ep, base, len, access, Some(Box::new(buf)))? };
        self.regs.insert(&mr);
        Ok(MemoryRegion(mr))
    }

    /// Registers caller-owned memory, or returns the registration already
    /// covering it with at least `access`. The registration lives until the
    /// connection is dropped.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (and, for remote write access, not be
    /// referenced by Rust code while a peer may write it) until the
    /// connection and every returned region are dropped.
    pub unsafe fn register_raw(
        &mut self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        if let Some(mr) = self.regs.find(ptr as usize, len, access) {
            return Ok(MemoryRegion(mr));
        }
        // SAFETY: validity is the caller's promise.
        let mr = unsafe { mr::register(&self.dom, self.ep, ptr, len, access, None)? };
        self.regs.insert_pinned(&mr);
        Ok(MemoryRegion(mr))
    }

    /// Whether `region` was registered on this connection (keys of other
    /// connections mean nothing to this peer).
    pub fn owns(&self, region: &MemoryRegion) -> bool {
        region.0.belongs_to(&self.dom)
    }

    /// Whether this end accepted the connection (rather than dialled it).
    pub fn is_acceptor(&self) -> bool {
        self.peer == ACCEPTED_PEER
    }

    /// Sends posted and not yet completed.
    pub fn sends_in_flight(&self) -> usize {
        self.ops
            .iter()
            .flatten()
            .filter(|op| op.kind == OpKind::Send)
            .count()
    }

    /// RDMA writes posted and not yet completed.
    pub fn writes_in_flight(&self) -> usize {
        self.writes_in_flight
    }

    /// Whether a send buffer is free.
    pub fn can_send(&self) -> bool {
        !self.tx_free.is_empty() && !self.free_ops.is_empty()
    }

    /// Whether another RDMA write may be posted.
    pub fn can_write(&self) -> bool {
        self.writes_in_flight < self.max_writes && !self.free_ops.is_empty()
    }

    /// Copies `msg` into a send buffer and posts it.
    ///
    /// [`Error::QueueFull`] means: poll completions, then retry.
    pub fn send(&mut self, msg: &[u8], user: u64) -> Result<()> {
        let tx = self
            .tx
            .as_ref()
            .expect("tx pool exists once open() returned");
        if msg.len() > tx.size {
            return Err(Error::InvalidArgument(format!(
                "message of {} bytes exceeds send buffer of {}",
                msg.len(),
                tx.size
            )));
        }
        let Some(buf) = self.tx_free.pop() else {
            return Err(Error::QueueFull("no free send buffer"));
        };
        let dst = tx.ptr(buf);
        let desc = tx.mr.desc();
        // SAFETY: the buffer is free (popped from tx_free) and large enough.
        unsafe { ptr::copy_nonoverlapping(msg.as_ptr(), dst, msg.len()) };
        let ep = self.ep;
        let posted = self.post(OpKind::Send, user, buf, Vec::new(), |ctx| {
            // SAFETY: ep is open; the buffer and context stay valid until the
            // completion is reaped or the endpoint closed.
            unsafe { sys::fi_send(ep, dst.cast(), msg.len(), desc, sys::FI_ADDR_UNSPEC, ctx) }
        });
        if posted.is_err() {
            self.tx_free.push(buf);
        }
        posted
    }

    /// RDMA-writes the gather list `iov` to `remote`, attaching `imm` as
    /// remote CQ data when given. Every slice must lie in a region of this
    /// connection registered with [`Access::WRITE_SOURCE`]; the region is
    /// held until the write completes.
    ///
    /// [`Error::QueueFull`] means: poll completions, then retry.
    pub fn write(
        &mut self,
        iov: &[IoSlice<'_>],
        remote: RemoteSlot,
        imm: Option<u64>,
        user: u64,
    ) -> Result<()> {
        self.write_flags(iov, remote, imm, user, 0)
    }

    /// [`Connection::write`] with extra `fi_writemsg` flags (e.g.
    /// FI_DELIVERY_COMPLETE).
    pub(crate) fn write_flags(
        &mut self,
        iov: &[IoSlice<'_>],
        remote: RemoteSlot,
        imm: Option<u64>,
        user: u64,
        extra_flags: u64,
    ) -> Result<()> {
        let total: usize = iov.iter().map(|s| s.len()).sum();
        self.check_write(iov.len(), total, remote, imm)?;
        if !self.can_write() {
            return Err(Error::QueueFull("too many RDMA writes in flight"));
        }
        let hold = iov
            .iter()
            .map(|s| {
                self.regs
                    .resolve(s.as_ptr() as usize, s.len(), Access::WRITE_SOURCE)
            })
            .collect::<Result<Vec<_>>>()?;
        let vecs: Vec<libc::iovec> = iov
            .iter()
            .map(|s| libc::iovec {
                iov_base: s.as_ptr() as *mut libc::c_void,
                iov_len: s.len(),
            })
            .collect();
        let mut descs: Vec<*mut libc::c_void> = hold.iter().map(|m| m.desc()).collect();
        let rma = sys::fi_rma_iov {
            addr: remote.addr,
            len: total,
            key: remote.key,
        };
        let flags = sys::FI_COMPLETION | extra_flags | imm.map_or(0, |_| sys::FI_REMOTE_CQ_DATA);
        let ep = self.ep;
        let posted = self.post(OpKind::Write, user, 0, hold, |ctx| {
            let msg = sys::fi_msg_rma {
                msg_iov: vecs.as_ptr().cast(),
                desc: descs.as_mut_ptr(),
                iov_count: vecs.len(),
                addr: sys::FI_ADDR_UNSPEC,
                rma_iov: &rma,
                rma_iov_count: 1,
                context: ctx,
                data: imm.unwrap_or(0),
            };
            // SAFETY: ep is open; the iovec/desc arrays outlive the call
            // (providers copy them, as we do not claim FI_ASYNC_IOV); the
            // memory they describe is held registered by the operation.
            unsafe { sys::fi_writemsg(ep, &msg, flags) }
        });
        if posted.is_ok() {
            self.writes_in_flight += 1;
        }
        posted
    }

    fn check_write(
        &self,
        count: usize,
        total: usize,
        remote: RemoteSlot,
        imm: Option<u64>,
    ) -> Result<()> {
        let limit = self.info.iov_limit.max(1);
        if count == 0 || count > limit {
            return Err(Error::InvalidArgument(format!(
                "gather list of {count} entries (provider limit {limit})"
            )));
        }
        if total as u64 > remote.len {
            return Err(Error::InvalidArgument(format!(
                "{total} bytes do not fit the remote slot of {}",
                remote.len
            )));
        }
        if imm.is_some() && !self.info.remote_cq_data {
            return Err(Error::InvalidArgument(
                "provider lacks FI_REMOTE_CQ_DATA".into(),
            ));
        }
        Ok(())
    }

    /// Posts the receive for internal buffer `index`.
    fn post_recv(&mut self, index: usize) -> Result<()> {
        let rx = self
            .rx
            .as_ref()
            .expect("rx pool exists before receives are posted");
        let (dst, size, desc) = (rx.ptr(index), rx.size, rx.mr.desc());
        let ep = self.ep;
        self.post(OpKind::Recv, 0, index, Vec::new(), |ctx| {
            // SAFETY: ep is open; buffer and context outlive the operation.
            unsafe { sys::fi_recv(ep, dst.cast(), size, desc, sys::FI_ADDR_UNSPEC, ctx) }
        })
    }

    /// Allocates a context, runs the posting call, and records the
    /// operation; frees the context again if posting fails.
    fn post(
        &mut self,
        kind: OpKind,
        user: u64,
        buf: usize,
        hold: Vec<Arc<MrCore>>,
        call: impl FnOnce(*mut libc::c_void) -> isize,
    ) -> Result<()> {
        if let Some(detail) = &self.closed {
            return Err(Error::Disconnected {
                detail: detail.clone(),
            });
        }
        let Some(slot) = self.free_ops.pop() else {
            return Err(Error::QueueFull("no free operation context"));
        };
        let ctx = self.ctxs[slot].0.get().cast::<libc::c_void>();
        match call(ctx) {
            0 => {
                self.ops[slot] = Some(OpState {
                    kind,
                    user,
                    buf,
                    _hold: hold,
                });
                Ok(())
            }
            ret => {
                self.free_ops.push(slot);
                if ret == -(sys::FI_EAGAIN as isize) {
                    Err(Error::QueueFull("provider transmit queue full"))
                } else {
                    check(ret, post_call_name(kind)).map(drop)
                }
            }
        }
    }

    /// Maps a context pointer back to its operation, if it is one of ours.
    fn op_index(&self, ctx: *mut libc::c_void) -> Option<usize> {
        let base = self.ctxs.as_ptr() as usize;
        let offset = (ctx as usize).checked_sub(base)?;
        let index = offset / std::mem::size_of::<OpCtx>();
        (offset % std::mem::size_of::<OpCtx>() == 0 && index < self.ctxs.len()).then_some(index)
    }

    /// Ends the operation behind `ctx`, returning its state.
    fn finish(&mut self, ctx: *mut libc::c_void) -> Option<OpState> {
        let index = self.op_index(ctx)?;
        let state = self.ops[index].take()?;
        self.free_ops.push(index);
        match state.kind {
            OpKind::Send => self.tx_free.push(state.buf),
            OpKind::Write => self.writes_in_flight -= 1,
            OpKind::Recv => {}
        }
        Some(state)
    }

    /// Collects ready completions without blocking. Returns how many were
    /// appended; once the connection is closed and nothing is left,
    /// [`Error::Disconnected`].
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let before = out.len();
        out.extend(self.pending.drain(..));
        loop {
            let mut entries = [sys::fi_cq_data_entry::default(); CQ_BATCH];
            // SAFETY: the CQ is open and `entries` has room for CQ_BATCH
            // entries of the CQ's format.
            let ret =
                unsafe { sys::fi_cq_read(self.dom.cq, entries.as_mut_ptr().cast(), CQ_BATCH) };
            match self.reap(ret, &entries, out)? {
                0 => break,
                _ => continue,
            }
        }
        self.check_eq();
        let got = out.len() - before;
        match (&self.closed, got) {
            (Some(detail), 0) => Err(Error::Disconnected {
                detail: detail.clone(),
            }),
            _ => Ok(got),
        }
    }

    /// Like [`Connection::poll`], but blocks up to `timeout` (forever when
    /// `None`) for at least one completion. `Ok(0)` means the time ran out.
    pub fn wait(&mut self, timeout: Option<Duration>, out: &mut Vec<Completion>) -> Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let got = self.poll(out)?;
            if got > 0 {
                return Ok(got);
            }
            let slice = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(WAIT_SLICE),
                    _ => return Ok(0),
                },
                None => WAIT_SLICE,
            };
            self.block(slice, out)?;
        }
    }

    /// Sleeps until the queues may have something, for at most `slice`;
    /// whatever a blocking read returns goes to `out`.
    fn block(&mut self, slice: Duration, out: &mut Vec<Completion>) -> Result<()> {
        let ms = slice.as_millis().clamp(1, i32::MAX as u128) as i32;
        match self.waiting {
            Waiting::Fd => self.block_on_fds(ms),
            Waiting::Sread => self.block_in_sread(ms, out),
            Waiting::Nap => {
                std::thread::sleep(slice.min(Duration::from_micros(200)));
                Ok(())
            }
        }
    }

    /// The libfabric recipe for sleeping on wait descriptors: `fi_trywait`
    /// says whether it is safe (nothing pending, progress made), and only
    /// then poll(2) blocks on CQ and EQ together.
    fn block_on_fds(&mut self, ms: i32) -> Result<()> {
        let dom = &self.dom;
        let fds = dom
            .wait_fds()
            .expect("Waiting::Fd is chosen only when both descriptors exist");
        // SAFETY: CQ and EQ are open objects of this fabric.
        let mut fids = unsafe { [&mut (*dom.cq).fid as *mut sys::fid, &mut (*dom.eq).fid] };
        // SAFETY: fabric is open; fids holds two valid queue fids.
        let ret = unsafe { sys::fi_trywait(dom.fabric.0, fids.as_mut_ptr(), 2) };
        if ret == -sys::FI_EAGAIN {
            return Ok(());
        }
        check_int(ret, "fi_trywait")?;
        let mut pfds = fds.map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: pfds is a valid array of two pollfd structs.
        let ret = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if ret < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::fabric(
                "poll",
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            ));
        }
        Ok(())
    }

    fn block_in_sread(&mut self, ms: i32, out: &mut Vec<Completion>) -> Result<()> {
        let mut entries = [sys::fi_cq_data_entry::default(); CQ_BATCH];
        // SAFETY: the CQ is open with a wait object; `entries` has room.
        let ret = unsafe {
            sys::fi_cq_sread(
                self.dom.cq,
                entries.as_mut_ptr().cast(),
                CQ_BATCH,
                ptr::null(),
                ms,
            )
        };
        if ret == -(sys::FI_ETIMEDOUT as isize) {
            return Ok(());
        }
        self.reap(ret, &entries, out).map(drop)
    }

    /// Turns one `fi_cq_read`/`fi_cq_sread` result into completions.
    /// Returns how many CQ entries were consumed.
    fn reap(
        &mut self,
        ret: isize,
        entries: &[sys::fi_cq_data_entry],
        out: &mut Vec<Completion>,
    ) -> Result<usize> {
        if ret == -(sys::FI_EAGAIN as isize) {
            return Ok(0);
        }
        if ret == -(sys::FI_EAVAIL as isize) {
            let failed = self.read_cq_error()?;
            out.push(failed);
            return Ok(1);
        }
        let n = check(ret, "fi_cq_read")?;
        for entry in &entries[..n] {
            let completion = self.complete(entry)?;
            out.extend(completion);
        }
        Ok(n)
    }

    /// Converts one successful CQ entry; reposts consumed receive buffers.
    fn complete(&mut self, e: &sys::fi_cq_data_entry) -> Result<Option<Completion>> {
        let state = self.finish(e.op_context);
        let reposted = match &state {
            Some(s) if s.kind == OpKind::Recv => Some(s.buf),
            _ => None,
        };
        let completion = if e.flags & sys::FI_REMOTE_WRITE != 0 {
            Some(Completion::RemoteWrite {
                imm: e.data,
                len: e.len,
            })
        } else {
            state.map(|s| self.describe(s, e))
        };
        if let Some(index) = reposted {
            // Once the peer is gone, a failed repost is expected; the
            // closure itself is reported by poll.
            if let Err(e) = self.post_recv(index) {
                self.check_eq();
                if self.closed.is_none() {
                    return Err(e);
                }
            }
        }
        Ok(completion)
    }

    fn describe(&self, state: OpState, e: &sys::fi_cq_data_entry) -> Completion {
        match state.kind {
            OpKind::Send => Completion::Sent { user: state.user },
            OpKind::Write => Completion::Written { user: state.user },
            OpKind::Recv => {
                let rx = self
                    .rx
                    .as_ref()
                    .expect("a receive completed, so the pool exists");
                let len = e.len.min(rx.size);
                // SAFETY: the provider finished writing `len` bytes into this
                // buffer, which is not reposted until after this copy.
                let data = unsafe { std::slice::from_raw_parts(rx.ptr(state.buf), len) }.to_vec();
                let imm = (e.flags & sys::FI_REMOTE_CQ_DATA != 0).then_some(e.data);
                Completion::Received { data, imm }
            }
        }
    }

    /// Reads one error completion.
    fn read_cq_error(&mut self) -> Result<Completion> {
        let mut err = sys::fi_cq_err_entry::default();
        // SAFETY: the CQ is open; err is a valid, zeroed error entry (so the
        // provider supplies its own err_data buffer).
        let ret = unsafe { sys::fi_cq_readerr(self.dom.cq, &mut err, 0) };
        check(ret, "fi_cq_readerr")?;
        let state = self.finish(err.op_context);
        let op = state.as_ref().map_or(OpKind::Recv, |s| s.kind);
        self.check_eq();
        Ok(Completion::Failed {
            user: state.map_or(0, |s| s.user),
            error: Error::Completion {
                op,
                code: err.err,
                prov_errno: err.prov_errno,
                text: strerror(err.err),
            },
        })
    }

    /// Notices FI_SHUTDOWN (or an error) on the connection's event queue.
    fn check_eq(&mut self) {
        if self.closed.is_some() {
            return;
        }
        match read_cm_event(self.dom.eq, 0) {
            Ok(Some(CmEvent::Shutdown)) => {
                self.closed = Some("peer shut the connection down".into())
            }
            Ok(_) => {}
            Err(e) => self.closed = Some(e.to_string()),
        }
    }
}

fn post_call_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Recv => "fi_recv",
        OpKind::Send => "fi_send",
        OpKind::Write => "fi_writemsg",
    }
}

/// A connection-management event.
#[derive(Debug)]
enum CmEvent {
    /// A connection request, with the data it carried.
    ConnReq(OwnedInfo, Vec<u8>),
    /// Established, with the data the acceptor's answer carried (the connecting side).
    Connected(Vec<u8>),
    Shutdown,
    Other,
}

/// Reads one CM event, blocking up to `timeout_ms` (0: don't block).
/// `Ok(None)` when nothing arrived; an error entry becomes `Err`.
fn read_cm_event(eq: *mut sys::fid_eq, timeout_ms: i32) -> Result<Option<CmEvent>> {
    let mut buf = [0u64; EQ_ENTRY_WORDS];
    let mut event = 0u32;
    let size = std::mem::size_of_val(&buf);
    // SAFETY: the EQ is open; buf is large and aligned enough for an
    // fi_eq_cm_entry plus connection data.
    let ret = unsafe {
        if timeout_ms == 0 {
            sys::fi_eq_read(eq, &mut event, buf.as_mut_ptr().cast(), size, 0)
        } else {
            sys::fi_eq_sread(eq, &mut event, buf.as_mut_ptr().cast(), size, timeout_ms, 0)
        }
    };
    if ret == -(sys::FI_EAGAIN as isize) || ret == -(sys::FI_ETIMEDOUT as isize) {
        return Ok(None);
    }
    if ret == -(sys::FI_EAVAIL as isize) {
        return Err(read_eq_error(eq));
    }
    let read = check(ret, "fi_eq_read")? as usize;
    // What a connection event carries follows its fi_eq_cm_entry, up to the bytes read.
    let data = || {
        // SAFETY: buf is `size` initialised bytes, of which the provider wrote `read`.
        let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), size) };
        bytes
            .get(std::mem::size_of::<sys::fi_eq_cm_entry>()..read.min(size))
            .map_or_else(Vec::new, <[u8]>::to_vec)
    };
    Ok(Some(match event {
        sys::FI_CONNREQ => {
            // SAFETY: a FI_CONNREQ entry is an fi_eq_cm_entry whose info we
            // now own and must free.
            let info = unsafe { (*buf.as_ptr().cast::<sys::fi_eq_cm_entry>()).info };
            // SAFETY: as above.
            CmEvent::ConnReq(unsafe { OwnedInfo::from_raw(info) }, data())
        }
        sys::FI_CONNECTED => CmEvent::Connected(data()),
        sys::FI_SHUTDOWN => CmEvent::Shutdown,
        _ => CmEvent::Other,
    }))
}

fn read_eq_error(eq: *mut sys::fid_eq) -> Error {
    let mut err = sys::fi_eq_err_entry::default();
    // SAFETY: the EQ is open; err is a zeroed error entry.
    let ret = unsafe { sys::fi_eq_readerr(eq, &mut err, 0) };
    match check(ret, "fi_eq_readerr") {
        Ok(_) => Error::fabric("connection management", err.err),
        Err(e) => e,
    }
}

/// Blocks until a CM event arrives or `timeout` passes.
fn wait_cm_event(
    eq: *mut sys::fid_eq,
    timeout: Option<Duration>,
    what: &'static str,
) -> Result<CmEvent> {
    let start = Instant::now();
    loop {
        let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
        if left.is_some_and(|l| l.is_zero()) {
            return Err(Error::Timeout {
                waited: start.elapsed(),
                what,
            });
        }
        let slice = left.map_or(WAIT_SLICE, |l| l.min(WAIT_SLICE));
        let ms = slice.as_millis().max(1) as i32;
        if let Some(event) = read_cm_event(eq, ms)? {
            return Ok(event);
        }
    }
}

/// A passive endpoint accepting connections.
pub struct Listener {
    pep: *mut sys::fid_pep,
    eq: *mut sys::fid_eq,
    fabric: Arc<FabricRes>,
    info: ProviderInfo,
    local: SocketAddr,
    cfg: FabricConfig,
}

// SAFETY: the passive endpoint and its EQ are only used through &self from
// one accept at a time (accept takes &mut self), and libfabric objects are
// thread-safe.
unsafe impl Send for Listener {}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: both are open or null and closed once, endpoint first.
        unsafe {
            close(self.pep.cast());
            close(self.eq.cast());
        }
    }
}

impl Listener {
    /// Listens on `addr` (port 0 picks a free port; see
    /// [`Listener::local_addr`]).
    pub fn bind(cfg: &FabricConfig, addr: SocketAddr) -> Result<Listener> {
        let info = discover(cfg, Role::Listen(addr))?;
        let fabric = open_fabric(&info)?;
        let mut listener = Listener {
            pep: ptr::null_mut(),
            eq: ptr::null_mut(),
            fabric,
            info: info.describe(),
            local: addr,
            cfg: cfg.clone(),
        };
        listener.eq = open_eq(&listener.fabric)?;
        // SAFETY: fabric and EQ are open, info valid; Drop closes on error.
        unsafe {
            let ret = sys::fi_passive_ep(
                listener.fabric.0,
                info.as_ptr(),
                &mut listener.pep,
                ptr::null_mut(),
            );
            check_int(ret, "fi_passive_ep")?;
            check_int(
                sys::fi_pep_bind(listener.pep, &mut (*listener.eq).fid, 0),
                "fi_pep_bind",
            )?;
            check_int(sys::fi_listen(listener.pep), "fi_listen")?;
        }
        listener.local = listener.bound_addr()?;
        Ok(listener)
    }

    fn bound_addr(&self) -> Result<SocketAddr> {
        let mut storage: libc::sockaddr_storage =
            // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
            unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of_val(&storage);
        // SAFETY: the passive endpoint is open; storage has `len` bytes.
        let ret = unsafe {
            sys::fi_getname(
                &mut (*self.pep).fid,
                (&mut storage as *mut libc::sockaddr_storage).cast(),
                &mut len,
            )
        };
        check_int(ret, "fi_getname")?;
        sockaddr_to_std(&storage)
            .ok_or_else(|| Error::InvalidArgument("listener address is not IPv4/IPv6".into()))
    }

    /// The address peers should dial.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// What discovery chose.
    pub fn provider(&self) -> &ProviderInfo {
        &self.info
    }

    /// Waits for a connection request, sets the endpoint up (receives
    /// posted) and accepts it.
    pub fn accept(&mut self, cc: &ConnConfig, timeout: Option<Duration>) -> Result<Connection> {
        self.accept_within(cc, timeout, timeout)
    }

    /// As [`Listener::accept`], waiting at most `request_wait` for a request (an
    /// [`Error::Timeout`] then leaves the listener as it was, so a caller can poll
    /// for cancellation) and `timeout` for the connection to complete.
    pub fn accept_within(
        &mut self,
        cc: &ConnConfig,
        request_wait: Option<Duration>,
        timeout: Option<Duration>,
    ) -> Result<Connection> {
        self.accept_with(cc, request_wait, timeout, |_, _| Vec::new())
            .map(|(conn, _)| conn)
    }

    /// As [`Listener::accept_within`], answering with `reply(request, room)`: `request`
    /// is what the connection request carried, `room` the most the answer may carry.
    /// Also returns `request`.
    pub fn accept_with(
        &mut self,
        cc: &ConnConfig,
        request_wait: Option<Duration>,
        timeout: Option<Duration>,
        reply: impl FnOnce(&[u8], usize) -> Vec<u8>,
    ) -> Result<(Connection, Vec<u8>)> {
        let (info, request) = loop {
            match wait_cm_event(self.eq, request_wait, "a connection request")? {
                CmEvent::ConnReq(mut info, request) => {
                    info.apply(&self.cfg);
                    break (info, request);
                }
                _ => continue,
            }
        };
        let opened = Connection::open(Arc::clone(&self.fabric), &info, cc, ACCEPTED_PEER.into())
            .and_then(|conn| {
                let answer = conn.checked_cm_data(|room| reply(&request, room))?;
                Ok((conn, answer))
            });
        let (mut conn, answer) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                // SAFETY: the pep is open and handle is the request's.
                unsafe { sys::fi_reject(self.pep, (*info.as_ptr()).handle, ptr::null(), 0) };
                return Err(e);
            }
        };
        // SAFETY: the endpoint is enabled with receives posted; answer outlives the
        // call, which copies it.
        let ret = unsafe { sys::fi_accept(conn.ep, answer.as_ptr().cast(), answer.len()) };
        check_int(ret, "fi_accept").map_err(|e| conn.connect_failed(e.to_string()))?;
        conn.await_connected(timeout)?;
        Ok((conn, request))
    }
}

/// Converts a socket address written by the provider.
fn sockaddr_to_std(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    let ptr: *const libc::sockaddr_storage = storage;
    match storage.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { &*ptr.cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { &*ptr.cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::from((ip, u16::from_be(sin6.sin6_port))))
        }
        _ => None,
    }
}
