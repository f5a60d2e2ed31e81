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

/// Shortest secret accepted: anything shorter can be guessed offline from one captured
/// handshake. Generated secrets are 64 hex characters.
pub const MIN_SECRET_BYTES: usize = 16;

/// The environment variable that allows a secret file others can read, or a short
/// secret, for throwaway test setups only.
pub const WEAK_SECRET_ENV: &str = "WANXFER_ALLOW_WEAK_SECRET";

fn weak_allowed() -> bool {
    std::env::var_os(WEAK_SECRET_ENV).is_some_and(|v| v == "1")
}

fn check_strength(secret: Vec<u8>, source: &str) -> Result<Vec<u8>, Error> {
    if secret.len() < MIN_SECRET_BYTES && !weak_allowed() {
        return Err(Error::Usage(format!(
            "{source}: the secret is {} bytes, fewer than {MIN_SECRET_BYTES}: one captured \
             handshake would let it be guessed offline (a server creates a strong one in a \
             new --secret-file; {WEAK_SECRET_ENV}=1 allows weak ones for tests)",
            secret.len()
        )));
    }
    Ok(secret)
}

/// The secret in [`SECRET_ENV`], if set and not empty; a short one is refused.
pub fn from_env() -> Option<Result<Vec<u8>, Error>> {
    std::env::var_os(SECRET_ENV)
        .map(|v| std::os::unix::ffi::OsStrExt::as_bytes(v.as_os_str()).to_vec())
        .filter(|v| !v.is_empty())
        .map(|v| check_strength(v, SECRET_ENV))
}

/// The secret in file `path`, without trailing whitespace. An empty or short one is
/// refused, and so is a file others can read or write, as ssh refuses such a key.
pub fn read_file(path: &Path) -> Result<Vec<u8>, Error> {
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.permissions().mode() & 0o077 != 0 && !weak_allowed() {
            return Err(Error::Usage(format!(
                "{}: others can read or write the secret file; chmod 600 it \
                 ({WEAK_SECRET_ENV}=1 allows it for tests)",
                path.display()
            )));
        }
    }
    let bytes =
        std::fs::read(path).map_err(|e| Error::local("read secret file", path.display(), e))?;
    let secret = bytes.trim_ascii_end().to_vec();
    if secret.is_empty() {
        return Err(Error::Usage(format!(
            "{}: the secret file is empty",
            path.display()
        )));
    }
    check_strength(secret, &path.display().to_string())
}
