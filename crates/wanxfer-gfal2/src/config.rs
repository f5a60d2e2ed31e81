//! Where the plugin finds its secret and settings: the gfal2 configuration (group
//! `WANXFER`, read at each operation, so that a caller's `set_opt_string` takes effect
//! at once), then the environment `wanxfer` itself reads.
//!
//! Order for the secret: `WANXFER:SECRET`, `WANXFER:SECRET_FILE`, `WANXFER_SECRET`,
//! `WANXFER_SECRET_FILE`. The configuration comes first because it is the most specific:
//! a site's `/etc/gfal2.d/wanxfer_plugin.conf`, or a value an application set on its own
//! context.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::time::Duration;

use wanxfer_engine::session::{ClientConfig, Tuning};

use crate::errors::Failure;
use crate::ffi;

/// The configuration group the plugin reads.
pub const GROUP: &CStr = c"WANXFER";

/// A source of settings by key: the gfal2 context in the plugin, a map in tests.
pub trait Settings {
    fn string(&self, key: &CStr) -> Option<String>;
    fn integer(&self, key: &CStr) -> Option<i64>;
}

/// The settings of a live gfal2 context.
pub struct Context(pub ffi::gfal2_context_t);

impl Settings for Context {
    fn string(&self, key: &CStr) -> Option<String> {
        // SAFETY: the context is the live one gfal2 passed us; group and key are
        // NUL-terminated; a NULL default makes gfal2 return NULL when the key is absent,
        // and any string it returns is ours to free with g_free, which happens below
        // after it is copied.
        unsafe {
            let raw = ffi::gfal2_get_opt_string_with_default(
                self.0,
                GROUP.as_ptr(),
                key.as_ptr(),
                std::ptr::null(),
            );
            if raw.is_null() {
                return None;
            }
            let value = CStr::from_ptr(raw).to_string_lossy().into_owned();
            ffi::g_free(raw.cast());
            Some(value).filter(|v| !v.is_empty())
        }
    }

    fn integer(&self, key: &CStr) -> Option<i64> {
        const ABSENT: i32 = i32::MIN;
        // SAFETY: as above; the integer getter allocates nothing.
        let value = unsafe {
            ffi::gfal2_get_opt_integer_with_default(self.0, GROUP.as_ptr(), key.as_ptr(), ABSENT)
        };
        (value != ABSENT).then_some(i64::from(value))
    }
}

/// The shared secret, from the first source that has one.
pub fn secret(settings: &dyn Settings) -> Result<Vec<u8>, Failure> {
    let read = |path: PathBuf| {
        wanxfer_engine::secret::read_file(&path)
            .map_err(|e| Failure::from(e).with_errno(libc::EACCES))
    };
    if let Some(secret) = settings.string(c"SECRET") {
        return Ok(secret.into_bytes());
    }
    if let Some(path) = settings.string(c"SECRET_FILE") {
        return read(PathBuf::from(path));
    }
    if let Some(secret) = wanxfer_engine::secret::from_env() {
        return secret.map_err(|e| Failure::from(e).with_errno(libc::EACCES));
    }
    if let Some(path) = std::env::var_os("WANXFER_SECRET_FILE").filter(|p| !p.is_empty()) {
        return read(PathBuf::from(path));
    }
    Err(Failure::new(
        libc::EACCES,
        "no wanxfer secret: set WANXFER:SECRET_FILE (or SECRET) in the gfal2 \
         configuration, or WANXFER_SECRET / WANXFER_SECRET_FILE in the environment",
    ))
}

/// Everything a connection to `server` needs. `streams` (from the transfer parameters)
/// overrides `WANXFER:STREAMS` when given.
pub fn client_config(
    settings: &dyn Settings,
    server: &str,
    streams: Option<u16>,
) -> Result<ClientConfig, Failure> {
    let seconds = |key: &CStr, default: u64| {
        settings
            .integer(key)
            .and_then(|v| u64::try_from(v).ok())
            .filter(|v| *v > 0)
            .unwrap_or(default)
    };
    let defaults = Tuning::default();
    let streams = streams
        .filter(|s| *s > 0)
        .or_else(|| {
            settings
                .integer(c"STREAMS")
                .and_then(|v| u16::try_from(v).ok())
        })
        .filter(|s| *s > 0)
        .unwrap_or(defaults.streams);
    let tuning = Tuning {
        streams,
        stall_timeout: Duration::from_secs(
            seconds(c"STALL_TIMEOUT", defaults.stall_timeout.as_secs()).max(2),
        ),
        ..defaults
    };
    let mut cfg = ClientConfig::new(server.to_string(), secret(settings)?, tuning);
    cfg.connect_timeout =
        Duration::from_secs(seconds(c"CONNECT_TIMEOUT", cfg.connect_timeout.as_secs()));
    if let Some(retries) = settings
        .integer(c"RETRIES")
        .and_then(|v| u32::try_from(v).ok())
    {
        cfg.retry.retries = retries;
    }
    if let Some(dir) = settings.string(c"STATE_DIR").filter(|d| !d.is_empty()) {
        cfg.state_dir = dir.into();
    }
    Ok(cfg)
}

/// A C string for gfal2, with any NUL in `text` (which C cannot carry) replaced.
pub fn c_string(text: &str) -> CString {
    CString::new(text.replace('\0', "\\0")).expect("NUL bytes were replaced")
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    struct Map(HashMap<&'static str, &'static str>);

    impl Settings for Map {
        fn string(&self, key: &CStr) -> Option<String> {
            self.0.get(key.to_str().unwrap()).map(|v| v.to_string())
        }
        fn integer(&self, key: &CStr) -> Option<i64> {
            self.string(key).and_then(|v| v.parse().ok())
        }
    }

    #[test]
    fn the_configured_secret_comes_before_the_secret_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("s");
        std::fs::write(&file, "from-file-0123456789\n").unwrap();
        std::os::unix::fs::PermissionsExt::set_mode(
            &mut std::fs::metadata(&file).unwrap().permissions(),
            0o600,
        );
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let path: &'static str = Box::leak(file.display().to_string().into_boxed_str());
        let both = Map(HashMap::from([("SECRET", "inline"), ("SECRET_FILE", path)]));
        assert_eq!(secret(&both).unwrap(), b"inline");
        let file_only = Map(HashMap::from([("SECRET_FILE", path)]));
        assert_eq!(secret(&file_only).unwrap(), b"from-file-0123456789");
        let missing = Map(HashMap::from([("SECRET_FILE", "/nonexistent/secret")]));
        assert_eq!(secret(&missing).unwrap_err().errno, libc::EACCES);
    }

    #[test]
    fn streams_come_from_the_transfer_then_the_configuration() {
        let settings = Map(HashMap::from([
            ("SECRET", "s"),
            ("STREAMS", "4"),
            ("STALL_TIMEOUT", "30"),
        ]));
        let cfg = client_config(&settings, "h:1", None).unwrap();
        assert_eq!(cfg.tuning.streams, 4);
        assert_eq!(cfg.tuning.stall_timeout, Duration::from_secs(30));
        let cfg = client_config(&settings, "h:1", Some(8)).unwrap();
        assert_eq!(cfg.tuning.streams, 8);
        assert_eq!(
            client_config(&settings, "h:1", Some(0))
                .unwrap()
                .tuning
                .streams,
            4
        );
    }
}
