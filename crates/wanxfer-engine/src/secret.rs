//! Reading the shared secret, for every client of the engine (the `wanxfer` command, the
//! gfal2 plugin) alike: a file whose trailing whitespace is not part of the secret (it
//! is usually written by an editor or `echo`), or the `WANXFER_SECRET` environment
//! variable.
//!
//! What this module does not do: create secret files or decide which source wins; each
//! front end documents its own order.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::Error;

/// The environment variable that holds the secret itself.
pub const SECRET_ENV: &str = "WANXFER_SECRET";

/// The secret in [`SECRET_ENV`], if set and not empty.
pub fn from_env() -> Option<Vec<u8>> {
    std::env::var_os(SECRET_ENV)
        .map(|v| std::os::unix::ffi::OsStrExt::as_bytes(v.as_os_str()).to_vec())
        .filter(|v| !v.is_empty())
}

/// The secret in file `path`, without trailing whitespace; an empty one is refused. A
/// file others can read is used, with a warning in the log.
pub fn read_file(path: &Path) -> Result<Vec<u8>, Error> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::local("read secret file", path.display(), e))?;
    let secret = bytes.trim_ascii_end().to_vec();
    if secret.is_empty() {
        return Err(Error::Usage(format!(
            "{}: the secret file is empty",
            path.display()
        )));
    }
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!("{}: readable by others; chmod 600 it", path.display());
        }
    }
    Ok(secret)
}
