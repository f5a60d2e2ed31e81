//! A gfal2 plugin for `wanxfer://HOST:PORT/PATH` URLs, so that FTS3 and Rucio, which
//! reach storage only through gfal2, can drive wanxfer servers: namespace operations
//! (stat, mkdir, unlink, rmdir, rename, listing), checksums computed by the server, and
//! copies between a local file and a server through the engine's own client.
//!
//! Why a Rust `cdylib` rather than a C shim: every operation is the engine's
//! ([`wanxfer_engine::ops::Client`], [`wanxfer_engine::session::run_client`]), so the
//! plugin only translates, and the C interface is generated from the installed headers
//! (`build.rs`), whose layout checks fail the build if a field moves.
//!
//! The ABI, as gfal2 2.21 uses it: it `dlopen`s every file in its plugin directory whose
//! name contains `.so` and calls `gfal_plugin_init`, casting it to a function that
//! returns the `gfal_plugin_interface` *by value* (the header's `gfal_plugin_init_t`
//! says pointer; the loader in `gfal_plugin.c` and every bundled plugin use a value),
//! once per gfal2 context. `plugin_data` is ours for that context and is freed in
//! `plugin_delete`.
//!
//! What it does not do: partial checksums (`ENOSYS`, as the interface asks), file I/O through `open`/`read` (gfal2
//! then has no streaming fallback for `wanxfer://`; copies go through `copy_file`), or
//! cancelling a copy in flight (the engine offers no cancel hook yet: a silent path
//! still ends at the stall timeout).

pub mod config;
mod copy;
pub mod errors;
pub mod ffi;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use wanxfer_engine::ops::{hex, Client, RemoteUrl};
use wanxfer_engine::Error;
use wanxfer_proto::ops::{ChecksumAlgorithm, ListEntry, Meta, NodeKind, RemoveMode};

use config::{c_string, Context};
use errors::Failure;

/// The plugin's name, also the module name of the directory handles it creates (gfal2
/// finds a handle's plugin by comparing the two).
const NAME: &CStr = {
    match CStr::from_bytes_with_nul(concat!("wanxfer-", env!("CARGO_PKG_VERSION"), "\0").as_bytes())
    {
        Ok(name) => name,
        Err(_) => panic!("the plugin name has no NUL inside"),
    }
};

/// At most this many idle connections are kept per context (one per server).
const MAX_IDLE_CONNECTIONS: usize = 8;

/// What the plugin keeps per gfal2 context.
pub struct Plugin {
    context: ffi::gfal2_context_t,
    /// Authenticated connections between operations, by server: authentication costs
    /// two round trips, most of a `stat` on a long path.
    idle: Mutex<HashMap<String, Client>>,
}

// SAFETY: the context pointer is only passed back to gfal2's configuration getters,
// which gfal2 documents as usable from any thread of the context's owner; the rest is
// behind a Mutex.
unsafe impl Send for Plugin {}
// SAFETY: as above.
unsafe impl Sync for Plugin {}

impl Plugin {
    fn settings(&self) -> Context {
        Context(self.context)
    }

    /// A connection to `server`: an idle one that is still open, or a new one; says
    /// which.
    fn client(&self, server: &str) -> Result<(Client, bool), Failure> {
        let kept = self
            .idle
            .lock()
            .ok()
            .and_then(|mut idle| idle.remove(server));
        if let Some(client) = kept.filter(Client::is_usable) {
            return Ok((client, true));
        }
        let cfg = config::client_config(&self.settings(), server, None)?;
        Ok((Client::connect(&cfg)?, false))
    }

    /// Keeps `client` for the next operation on its server, if it can take one.
    fn keep(&self, client: Client) {
        if !client.is_usable() {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            if idle.len() < MAX_IDLE_CONNECTIONS || idle.contains_key(client.server()) {
                idle.insert(client.server().to_string(), client);
            }
        }
    }

    /// Runs `op` on a connection to `server`; a refusal by the server leaves the
    /// connection reusable, anything else drops it. A kept connection the server closed
    /// just as it was reused (it passed `is_usable`, then the request met a closed
    /// socket) is replaced by a new one once, for an `idempotent` operation only: a
    /// mkdir, remove or rename may have run before the connection broke.
    fn with_client<T>(
        &self,
        server: &str,
        idempotent: bool,
        mut op: impl FnMut(&mut Client) -> Result<T, Error>,
    ) -> Result<T, Failure> {
        let (mut client, reused) = self.client(server)?;
        let mut result = op(&mut client);
        if reused && idempotent && matches!(result, Err(Error::Network { .. })) {
            let cfg = config::client_config(&self.settings(), server, None)?;
            client = Client::connect(&cfg)?;
            result = op(&mut client);
        }
        if matches!(result, Ok(_) | Err(Error::Op { .. })) {
            self.keep(client);
        }
        Ok(result?)
    }
}

/// gfal2's entry point: the interface, by value (see the module documentation).
///
/// # Safety
/// Called by gfal2's loader with a live context.
#[no_mangle]
pub unsafe extern "C" fn gfal_plugin_init(
    context: ffi::gfal2_context_t,
    _err: *mut *mut ffi::GError,
) -> ffi::gfal_plugin_interface {
    let plugin = Box::new(Plugin {
        context,
        idle: Mutex::new(HashMap::new()),
    });
    ffi::gfal_plugin_interface {
        plugin_data: Box::into_raw(plugin).cast(),
        priority: 0, // GFAL_PLUGIN_PRIORITY_DATA: the plugin does I/O.
        getName: Some(get_name),
        plugin_delete: Some(plugin_delete),
        check_plugin_url: Some(check_url),
        statG: Some(stat),
        lstatG: Some(stat),
        mkdirpG: Some(mkdirp),
        rmdirG: Some(rmdir),
        unlinkG: Some(unlink),
        renameG: Some(rename),
        opendirG: Some(opendir),
        readdirG: Some(readdir),
        readdirppG: Some(readdirpp),
        closedirG: Some(closedir),
        checksum_calcG: Some(checksum),
        check_plugin_url_transfer: Some(copy::check_copy),
        copy_file: Some(copy::copy_file),
        ..Default::default()
    }
}

unsafe extern "C" fn get_name() -> *const c_char {
    NAME.as_ptr()
}

unsafe extern "C" fn plugin_delete(data: ffi::plugin_handle) {
    if !data.is_null() {
        // SAFETY: `data` is the Box leaked in gfal_plugin_init, and gfal2 calls this once,
        // last, for the context it belongs to.
        drop(unsafe { Box::from_raw(data.cast::<Plugin>()) });
    }
}

/// # Safety
/// `data` must be the `plugin_data` this plugin returned, still alive.
unsafe fn plugin<'a>(data: ffi::plugin_handle) -> &'a Plugin {
    // SAFETY: gfal2 passes back the pointer from gfal_plugin_init until plugin_delete.
    unsafe { &*data.cast::<Plugin>() }
}

/// # Safety
/// `s` must be NULL or a NUL-terminated string that outlives the returned slice.
unsafe fn bytes<'a>(s: *const c_char) -> &'a [u8] {
    if s.is_null() {
        return &[];
    }
    // SAFETY: per the contract above.
    unsafe { CStr::from_ptr(s) }.to_bytes()
}

fn is_ours(url: &[u8]) -> bool {
    url.starts_with(RemoteUrl::SCHEME)
}

/// The server and path of a URL gfal2 routed to us.
fn remote(url: &[u8]) -> Result<RemoteUrl, Failure> {
    RemoteUrl::parse(url)?.ok_or_else(|| {
        Failure::new(
            libc::EPROTONOSUPPORT,
            format!("{}: not a wanxfer:// URL", String::from_utf8_lossy(url)),
        )
    })
}

/// The error domain, in gfal2's pattern for plugins.
pub(crate) fn domain() -> ffi::GQuark {
    // SAFETY: the string is a NUL-terminated literal, static as the call requires.
    unsafe { ffi::g_quark_from_static_string(c"GFAL2::PLUGINS::WANXFER".as_ptr()) }
}

/// Reports `failure` in `err` the way gfal2's plugins do (`gfal2_set_error`, or
/// `gfalt_set_error` with the side and note of a copy).
///
/// # Safety
/// `err` must be NULL or point to a `GError*` that is NULL.
pub(crate) unsafe fn report(err: *mut *mut ffi::GError, function: &CStr, failure: &Failure) {
    let message = c_string(&failure.message);
    match failure.side {
        // SAFETY: every pointer is a NUL-terminated string alive for the call, the
        // format takes exactly the one string given, and `err` is as the caller promised.
        None => unsafe {
            ffi::gfal2_set_error(
                err,
                domain(),
                failure.errno,
                function.as_ptr(),
                c"%s".as_ptr(),
                message.as_ptr(),
            )
        },
        Some(side) => {
            let side = c_string(side);
            let note = failure.note.map(c_string);
            // SAFETY: as above; a NULL note is what gfalt_set_error expects for none.
            unsafe {
                ffi::gfalt_set_error(
                    err,
                    domain(),
                    failure.errno,
                    function.as_ptr(),
                    side.as_ptr(),
                    note.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
                    c"%s".as_ptr(),
                    message.as_ptr(),
                )
            }
        }
    }
}

/// Runs `body`, turning an error or a panic (which must not cross into C) into a
/// `GError` and `failed`.
pub(crate) fn guard<T>(
    err: *mut *mut ffi::GError,
    function: &CStr,
    failed: T,
    body: impl FnOnce() -> Result<T, Failure>,
) -> T {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => return value,
        Ok(Err(failure)) => failure,
        Err(_) => Failure::new(libc::EIO, "internal error in the wanxfer plugin (a bug)"),
    };
    // SAFETY: gfal2 hands every callback an `err` that is NULL or points to a NULL
    // GError*, as `report` requires.
    unsafe { report(err, function, &failure) };
    failed
}

unsafe extern "C" fn check_url(
    _data: ffi::plugin_handle,
    url: *const c_char,
    mode: ffi::plugin_mode,
    _err: *mut *mut ffi::GError,
) -> ffi::gboolean {
    let supported = matches!(
        mode,
        ffi::GFAL_PLUGIN_STAT
            | ffi::GFAL_PLUGIN_LSTAT
            | ffi::GFAL_PLUGIN_MKDIR
            | ffi::GFAL_PLUGIN_MKDIR_REC
            | ffi::GFAL_PLUGIN_RMDIR
            | ffi::GFAL_PLUGIN_UNLINK
            | ffi::GFAL_PLUGIN_RENAME
            | ffi::GFAL_PLUGIN_OPENDIR
            | ffi::GFAL_PLUGIN_CHECKSUM
    );
    // SAFETY: gfal2 passes a NUL-terminated URL.
    ffi::gboolean::from(supported && is_ours(unsafe { bytes(url) }))
}

/// Fills `st` from `meta` as `lstat` would (owner unknown: 0).
fn fill_stat(meta: &Meta, st: &mut libc::stat) {
    let kind = match meta.kind {
        NodeKind::File => libc::S_IFREG,
        NodeKind::Dir => libc::S_IFDIR,
        NodeKind::Symlink => libc::S_IFLNK,
        _ => libc::S_IFIFO,
    };
    st.st_mode = kind | meta.mode;
    st.st_size = i64::try_from(meta.size).unwrap_or(i64::MAX);
    st.st_nlink = 1;
    st.st_mtime = meta.mtime_sec;
    st.st_mtime_nsec = i64::from(meta.mtime_nsec);
    st.st_ctime = meta.mtime_sec;
    st.st_ctime_nsec = i64::from(meta.mtime_nsec);
    st.st_atime = meta.mtime_sec;
    st.st_atime_nsec = i64::from(meta.mtime_nsec);
}

unsafe extern "C" fn stat(
    data: ffi::plugin_handle,
    url: *const c_char,
    st: *mut libc::stat,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_stat", -1, || {
        // SAFETY: gfal2 passes our plugin data, a NUL-terminated URL and a stat buffer.
        let (plugin, url) = unsafe { (plugin(data), remote(bytes(url))?) };
        let meta = plugin.with_client(&url.server, true, |c| c.stat(&url.path))?;
        // SAFETY: `st` points to a struct stat gfal2 owns for the call.
        let st = unsafe { &mut *st };
        // SAFETY: struct stat is plain integers, for which all zeroes is a valid value.
        *st = unsafe { std::mem::zeroed() };
        fill_stat(&meta, st);
        Ok(0)
    })
}

unsafe extern "C" fn mkdirp(
    data: ffi::plugin_handle,
    url: *const c_char,
    mode: libc::mode_t,
    parents: ffi::gboolean,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_mkdir", -1, || {
        // SAFETY: as in `stat`.
        let (plugin, url) = unsafe { (plugin(data), remote(bytes(url))?) };
        plugin.with_client(&url.server, false, |c| {
            c.mkdir(&url.path, parents != 0, mode)
        })?;
        Ok(0)
    })
}

unsafe extern "C" fn rmdir(
    data: ffi::plugin_handle,
    url: *const c_char,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_rmdir", -1, || {
        // SAFETY: as in `stat`.
        let (plugin, url) = unsafe { (plugin(data), remote(bytes(url))?) };
        plugin.with_client(&url.server, false, |c| {
            c.remove(&url.path, RemoveMode::EmptyDir)
        })?;
        Ok(0)
    })
}

unsafe extern "C" fn unlink(
    data: ffi::plugin_handle,
    url: *const c_char,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_unlink", -1, || {
        // SAFETY: as in `stat`.
        let (plugin, url) = unsafe { (plugin(data), remote(bytes(url))?) };
        plugin.with_client(&url.server, false, |c| {
            c.remove(&url.path, RemoveMode::NotDir)
        })?;
        Ok(0)
    })
}

unsafe extern "C" fn rename(
    data: ffi::plugin_handle,
    old: *const c_char,
    new: *const c_char,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_rename", -1, || {
        // SAFETY: as in `stat`, for both URLs.
        let (plugin, from, to) =
            unsafe { (plugin(data), remote(bytes(old))?, remote(bytes(new))?) };
        if from.server != to.server {
            return Err(Failure::new(
                libc::EXDEV,
                "rename between two wanxfer servers: move the data with a copy",
            ));
        }
        plugin.with_client(&from.server, false, |c| c.rename(&from.path, &to.path))?;
        Ok(0)
    })
}

unsafe extern "C" fn checksum(
    data: ffi::plugin_handle,
    url: *const c_char,
    check_type: *const c_char,
    out: *mut c_char,
    out_len: usize,
    offset: libc::off_t,
    length: usize,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_checksum", -1, || {
        // SAFETY: as in `stat`; the type is a NUL-terminated string.
        let (plugin, url, name) = unsafe { (plugin(data), remote(bytes(url))?, bytes(check_type)) };
        if offset != 0 || length != 0 {
            return Err(Failure::new(
                libc::ENOSYS,
                "wanxfer computes checksums of whole files only",
            ));
        }
        let algorithm = algorithm(name)?;
        let digest = plugin.with_client(&url.server, true, |c| c.checksum(&url.path, algorithm))?;
        let text = hex(&digest);
        if text.len() >= out_len {
            return Err(Failure::new(
                libc::ENOBUFS,
                format!(
                    "a {} checksum needs {} bytes",
                    algorithm.name(),
                    text.len() + 1
                ),
            ));
        }
        // SAFETY: `out` has room for `out_len` bytes, checked above to hold the text and
        // its NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), text.len());
            *out.add(text.len()) = 0;
        }
        Ok(0)
    })
}

/// The algorithm gfal2 names (`ADLER32`, `MD5`, `XXH3`, `CRC32C`, any case).
pub(crate) fn algorithm(name: &[u8]) -> Result<ChecksumAlgorithm, Failure> {
    std::str::from_utf8(name)
        .ok()
        .and_then(ChecksumAlgorithm::from_name)
        .ok_or_else(|| {
            Failure::new(
                libc::ENOSYS,
                format!(
                    "checksum type {} is not one wanxfer computes (adler32, md5, xxh3, crc32c)",
                    String::from_utf8_lossy(name)
                ),
            )
        })
}

/// An open listing: its own connection, pulled a page at a time as gfal2 reads.
struct Listing {
    client: Option<Client>,
    page: std::vec::IntoIter<ListEntry>,
    entry: libc::dirent,
    next_ino: u64,
}

unsafe extern "C" fn opendir(
    data: ffi::plugin_handle,
    url: *const c_char,
    err: *mut *mut ffi::GError,
) -> ffi::gfal_file_handle {
    guard(err, c"wanxfer_opendir", std::ptr::null_mut(), || {
        // SAFETY: as in `stat`.
        let (plugin, url) = unsafe { (plugin(data), remote(bytes(url))?) };
        let (mut client, _) = plugin.client(&url.server)?;
        let meta = client.stat(&url.path);
        let meta = match meta {
            Ok(meta) => meta,
            Err(e) => {
                if matches!(e, Error::Op { .. }) {
                    plugin.keep(client);
                }
                return Err(e.into());
            }
        };
        if meta.kind != NodeKind::Dir {
            plugin.keep(client);
            return Err(Failure::new(
                libc::ENOTDIR,
                format!("opendir {}: not a directory", url.path),
            ));
        }
        client.start_list(&url.path, false, true)?;
        let listing = Box::new(Mutex::new(Listing {
            client: Some(client),
            page: Vec::new().into_iter(),
            // SAFETY: struct dirent is integers and a char array: all zeroes is valid.
            entry: unsafe { std::mem::zeroed() },
            next_ino: 1,
        }));
        // SAFETY: the name is our NUL-terminated static name; the descriptor is the Box,
        // reclaimed in `closedir`.
        let handle =
            unsafe { ffi::gfal_file_handle_new(NAME.as_ptr(), Box::into_raw(listing).cast()) };
        Ok(handle)
    })
}

/// # Safety
/// `handle` must be a directory handle made by `opendir` and not yet closed.
unsafe fn listing<'a>(handle: ffi::gfal_file_handle) -> &'a Mutex<Listing> {
    // SAFETY: per the contract: the descriptor is the Box leaked in `opendir`.
    unsafe { &*ffi::gfal_file_handle_get_fdesc(handle).cast::<Mutex<Listing>>() }
}

/// The next entry of `handle`'s listing, written into its dirent (and `st`), or NULL at
/// the end.
fn next_entry(
    plugin: &Plugin,
    listing: &Mutex<Listing>,
    st: Option<&mut libc::stat>,
) -> Result<*mut libc::dirent, Failure> {
    let mut listing = listing
        .lock()
        .map_err(|_| Failure::new(libc::EIO, "a listing failed earlier"))?;
    let listing = &mut *listing;
    let entry = loop {
        if let Some(entry) = listing.page.next() {
            break entry;
        }
        let Some(client) = listing.client.as_mut() else {
            return Ok(std::ptr::null_mut());
        };
        match client.next_page() {
            Ok(Some(page)) => listing.page = page.into_iter(),
            Ok(None) => {
                // Complete: the connection can serve the next operation.
                if let Some(client) = listing.client.take() {
                    plugin.keep(client);
                }
                return Ok(std::ptr::null_mut());
            }
            Err(e) => {
                listing.client = None;
                return Err(e.into());
            }
        }
    };
    let name = entry.path.as_bytes();
    let d = &mut listing.entry;
    // Names are single components of at most 255 bytes (RelPath's rule): they fit.
    let len = name.len().min(d.d_name.len() - 1);
    for (slot, byte) in d.d_name.iter_mut().zip(name[..len].iter()) {
        *slot = *byte as c_char;
    }
    d.d_name[len] = 0;
    d.d_ino = listing.next_ino;
    listing.next_ino += 1;
    d.d_reclen = std::mem::size_of::<libc::dirent>() as u16;
    d.d_type = match entry.kind {
        NodeKind::File => libc::DT_REG,
        NodeKind::Dir => libc::DT_DIR,
        NodeKind::Symlink => libc::DT_LNK,
        _ => libc::DT_UNKNOWN,
    };
    if let (Some(st), Some(meta)) = (st, entry.meta.as_ref()) {
        // SAFETY: struct stat is plain integers: all zeroes is a valid value.
        *st = unsafe { std::mem::zeroed() };
        fill_stat(meta, st);
    }
    Ok(d)
}

unsafe extern "C" fn readdir(
    data: ffi::plugin_handle,
    handle: ffi::gfal_file_handle,
    err: *mut *mut ffi::GError,
) -> *mut libc::dirent {
    guard(err, c"wanxfer_readdir", std::ptr::null_mut(), || {
        // SAFETY: gfal2 passes our plugin data and a handle from our opendir.
        let (plugin, listing) = unsafe { (plugin(data), listing(handle)) };
        next_entry(plugin, listing, None)
    })
}

unsafe extern "C" fn readdirpp(
    data: ffi::plugin_handle,
    handle: ffi::gfal_file_handle,
    st: *mut libc::stat,
    err: *mut *mut ffi::GError,
) -> *mut libc::dirent {
    guard(err, c"wanxfer_readdirpp", std::ptr::null_mut(), || {
        // SAFETY: as in `readdir`; `st` is NULL or a struct stat gfal2 owns for the call.
        let (plugin, listing, st) = unsafe { (plugin(data), listing(handle), st.as_mut()) };
        next_entry(plugin, listing, st)
    })
}

unsafe extern "C" fn closedir(
    _data: ffi::plugin_handle,
    handle: ffi::gfal_file_handle,
    err: *mut *mut ffi::GError,
) -> c_int {
    guard(err, c"wanxfer_closedir", -1, || {
        // SAFETY: the handle comes from our opendir and is closed once: its descriptor is
        // the Box leaked there, reclaimed here, and the handle itself is deleted with the
        // call gfal2 provides for it.
        let listing = unsafe {
            let fdesc = ffi::gfal_file_handle_get_fdesc(handle).cast::<Mutex<Listing>>();
            let listing = Box::from_raw(fdesc);
            ffi::gfal_file_handle_delete(handle);
            listing
        };
        // A listing read to its end already gave its connection back; one closed early
        // has pages in flight, so its connection goes with it.
        drop(listing);
        Ok(0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_is_versioned_like_other_plugins() {
        assert_eq!(
            NAME.to_str().unwrap(),
            concat!("wanxfer-", env!("CARGO_PKG_VERSION"))
        );
    }

    #[test]
    fn gfal2_checksum_names_map_to_algorithms() {
        assert_eq!(algorithm(b"ADLER32").unwrap(), ChecksumAlgorithm::Adler32);
        assert_eq!(algorithm(b"md5").unwrap(), ChecksumAlgorithm::Md5);
        assert_eq!(algorithm(b"XXH3").unwrap(), ChecksumAlgorithm::Xxh3);
        assert_eq!(algorithm(b"SHA1").unwrap_err().errno, libc::ENOSYS);
    }

    #[test]
    fn stat_buffers_read_like_lstat() {
        let meta = Meta {
            kind: NodeKind::Symlink,
            size: 7,
            mode: 0o777,
            mtime_sec: 1_600_000_000,
            mtime_nsec: 5,
            link_target: b"target".to_vec(),
        };
        // SAFETY: all zeroes is a valid struct stat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        fill_stat(&meta, &mut st);
        assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFLNK);
        assert_eq!(
            (st.st_size, st.st_mtime, st.st_mtime_nsec),
            (7, 1_600_000_000, 5)
        );
    }
}
