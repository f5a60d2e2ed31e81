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
//!
//! The shared library is not linked but loaded at the first call of one of
//! the five functions it exports ([`fi_getinfo`] and friends, defined here
//! with the C names, so the C wrappers use them too). Linking it made every
//! `wanxfer` process, even `wanxfer --version` or a TCP-only copy, pay for
//! libfabric's built-in providers' dependencies at start-up: Debian's
//! libpsm_infinipath runs a constructor that takes about 0.2 s. Loaded lazily,
//! a TCP transfer never touches libfabric, and a host without it installed
//! still runs everything but `--transport fabric`, which then says why.

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

/// The symbol versions of the exported functions, as the headers we were
/// generated from declare them (their `fi_info` layout is the one we use).
mod exported {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::sync::OnceLock;

    use super::{fi_fabric_attr, fi_info, fid_fabric};

    const SONAME: &CStr = c"libfabric.so.1";

    pub(super) struct Library {
        pub getinfo: unsafe extern "C" fn(
            u32,
            *const c_char,
            *const c_char,
            u64,
            *const fi_info,
            *mut *mut fi_info,
        ) -> c_int,
        pub freeinfo: unsafe extern "C" fn(*mut fi_info),
        pub dupinfo: unsafe extern "C" fn(*const fi_info) -> *mut fi_info,
        pub fabric:
            unsafe extern "C" fn(*mut fi_fabric_attr, *mut *mut fid_fabric, *mut c_void) -> c_int,
        pub strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    }

    static LIBRARY: OnceLock<Result<Library, String>> = OnceLock::new();

    pub(super) fn library() -> Result<&'static Library, &'static str> {
        LIBRARY.get_or_init(open).as_ref().map_err(String::as_str)
    }

    fn dl_error() -> String {
        // SAFETY: dlerror returns null or a NUL-terminated message.
        let text = unsafe { libc::dlerror() };
        if text.is_null() {
            "unknown error".into()
        } else {
            // SAFETY: non-null, NUL-terminated, valid until the next dl* call.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        }
    }

    /// Looks `name` up at `version`.
    ///
    /// # Safety
    /// `F` must be the function pointer type of that symbol.
    unsafe fn symbol<F: Copy>(
        handle: *mut c_void,
        name: &CStr,
        version: &CStr,
    ) -> Result<F, String> {
        // SAFETY: handle is a live dlopen handle; both strings are NUL-terminated.
        let found = unsafe { libc::dlvsym(handle, name.as_ptr(), version.as_ptr()) };
        if found.is_null() {
            return Err(format!(
                "{} has no {}@{}: {}",
                SONAME.to_string_lossy(),
                name.to_string_lossy(),
                version.to_string_lossy(),
                dl_error()
            ));
        }
        debug_assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
        // SAFETY: the caller names the symbol's true type; a function pointer
        // has the size of a data pointer on every platform libfabric runs on.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&found) })
    }

    fn open() -> Result<Library, String> {
        // SAFETY: a constant library name; RTLD_LOCAL keeps its symbols out of
        // the global scope. The handle is never closed: providers keep threads
        // and ops tables alive for the life of the process.
        let handle = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!(
                "cannot load libfabric ({}); install it (Debian: apt-get install libfabric1)",
                dl_error()
            ));
        }
        // SAFETY: each type matches the C prototype in the libfabric 1.x headers
        // the bindings were generated from, at the version named.
        unsafe {
            Ok(Library {
                getinfo: symbol(handle, c"fi_getinfo", c"FABRIC_1.3")?,
                freeinfo: symbol(handle, c"fi_freeinfo", c"FABRIC_1.3")?,
                dupinfo: symbol(handle, c"fi_dupinfo", c"FABRIC_1.3")?,
                fabric: symbol(handle, c"fi_fabric", c"FABRIC_1.1")?,
                strerror: symbol(handle, c"fi_strerror", c"FABRIC_1.0")?,
            })
        }
    }
}

/// Why libfabric cannot be used on this host, if it cannot: loads it if that
/// has not been tried yet. The `fi_*` functions below return `-FI_ENOSYS`
/// (or null) in that case.
pub fn library_unavailable() -> Option<&'static str> {
    exported::library().err()
}

/// `fi_getinfo`, from the library loaded at first use.
///
/// # Safety
/// As for the C function.
#[no_mangle]
pub unsafe extern "C" fn fi_getinfo(
    version: u32,
    node: *const std::ffi::c_char,
    service: *const std::ffi::c_char,
    flags: u64,
    hints: *const fi_info,
    info: *mut *mut fi_info,
) -> std::ffi::c_int {
    match exported::library() {
        // SAFETY: the caller upholds the C contract, which we pass on unchanged.
        Ok(lib) => unsafe { (lib.getinfo)(version, node, service, flags, hints, info) },
        Err(_) => -FI_ENOSYS,
    }
}

/// `fi_freeinfo`, from the library loaded at first use.
///
/// # Safety
/// As for the C function.
#[no_mangle]
pub unsafe extern "C" fn fi_freeinfo(info: *mut fi_info) {
    // Without the library no fi_info was ever handed out: nothing to free.
    if let Ok(lib) = exported::library() {
        // SAFETY: as for the C function.
        unsafe { (lib.freeinfo)(info) }
    }
}

/// `fi_dupinfo`, from the library loaded at first use; null without it.
///
/// # Safety
/// As for the C function.
#[no_mangle]
pub unsafe extern "C" fn fi_dupinfo(info: *const fi_info) -> *mut fi_info {
    match exported::library() {
        // SAFETY: as for the C function.
        Ok(lib) => unsafe { (lib.dupinfo)(info) },
        Err(_) => std::ptr::null_mut(),
    }
}

/// `fi_fabric`, from the library loaded at first use.
///
/// # Safety
/// As for the C function.
#[no_mangle]
pub unsafe extern "C" fn fi_fabric(
    attr: *mut fi_fabric_attr,
    fabric: *mut *mut fid_fabric,
    context: *mut std::ffi::c_void,
) -> std::ffi::c_int {
    match exported::library() {
        // SAFETY: as for the C function.
        Ok(lib) => unsafe { (lib.fabric)(attr, fabric, context) },
        Err(_) => -FI_ENOSYS,
    }
}

/// `fi_strerror`, from the library loaded at first use.
///
/// # Safety
/// As for the C function (the result is a static string).
#[no_mangle]
pub unsafe extern "C" fn fi_strerror(errnum: std::ffi::c_int) -> *const std::ffi::c_char {
    match exported::library() {
        // SAFETY: as for the C function.
        Ok(lib) => unsafe { (lib.strerror)(errnum) },
        Err(_) => c"libfabric is not available".as_ptr(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The library is found and its exported functions answer (the test hosts install
    /// libfabric; see scripts/install-deps.sh).
    #[test]
    fn the_library_loads_at_first_use() {
        assert_eq!(library_unavailable(), None);
        // SAFETY: fi_strerror returns a static NUL-terminated string.
        let text = unsafe { std::ffi::CStr::from_ptr(fi_strerror(FI_ENOSYS)) };
        assert!(!text.to_bytes().is_empty());
        // SAFETY: fi_allocinfo's result is freed with fi_freeinfo.
        unsafe {
            let info = fi_allocinfo();
            assert!(!info.is_null());
            fi_freeinfo(info);
        }
    }
}
