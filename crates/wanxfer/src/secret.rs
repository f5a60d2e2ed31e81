//! Where the shared secret comes from: a file (created with a fresh random secret and mode
//! 0600 on the server if missing) or the WANXFER_SECRET environment variable; and, for a
//! client, the credential it presents instead (a bearer token or its certificate).
//!
//! The order a client follows: `--token`, then `--cert` (mutual TLS), then the shared
//! secret, and only when there is no secret either, the WLCG bearer-token discovery
//! (BEARER_TOKEN, BEARER_TOKEN_FILE, $XDG_RUNTIME_DIR/bt_u<UID>): a token lying around in
//! the environment never displaces a secret the user configured.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

pub use wanxfer_engine::secret::from_env;
use wanxfer_engine::secret::{read_file, SECRET_ENV as ENV};
use wanxfer_engine::session::ClientCredential;
use wanxfer_engine::Error;
use wanxfer_proto::MAX_TOKEN_BYTES;

use crate::args::SecurityArgs;

/// A fresh random secret: 32 bytes from the OS, as hex text (easy to paste and to put in
/// an environment variable).
pub fn generate() -> Result<String, Error> {
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| {
        Error::local(
            "read",
            "the system random source",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(raw.iter().map(|b| format!("{b:02x}")).collect())
}

fn create_file(path: &Path) -> Result<Vec<u8>, Error> {
    let secret = generate()?;
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::local("create secret file", path.display(), e))?;
    writeln!(file, "{secret}").map_err(|e| Error::local("write secret file", path.display(), e))?;
    // Logged rather than printed, so that a server logging JSON reports it as JSON.
    tracing::warn!(
        "created secret file {} (mode 0600); give clients the same secret",
        path.display()
    );
    Ok(secret.into_bytes())
}

/// The server's secret: the file (created if missing), else the environment.
pub fn for_server(file: Option<&Path>) -> Result<Vec<u8>, Error> {
    match file {
        Some(path) if path.exists() => read_file(path),
        Some(path) => create_file(path),
        None => from_env().unwrap_or_else(|| {
            Err(Error::Usage(format!(
                "give --secret-file FILE or set {ENV} to the shared secret"
            )))
        }),
    }
}

/// The client's secret: the file, else the environment. A file that does not exist is a
/// usage error, not a local I/O one: the client never creates it, and the remedy is to
/// give the right path.
pub fn for_client(file: Option<&Path>) -> Result<Vec<u8>, Error> {
    match file {
        Some(path) if std::fs::metadata(path).is_err_and(|e| e.kind() == ErrorKind::NotFound) => {
            Err(Error::Usage(format!(
                "--secret-file {}: no such file; copy the server's secret file there, or set {ENV}",
                path.display()
            )))
        }
        Some(path) => read_file(path),
        None => from_env().unwrap_or_else(|| {
            Err(Error::Usage(format!(
                "give --secret-file FILE or set {ENV} to the server's secret"
            )))
        }),
    }
}

/// The client's secret (empty when it authenticates otherwise) and its credential.
pub fn for_client_with(
    file: Option<&Path>,
    security: &SecurityArgs,
) -> Result<(Vec<u8>, Option<ClientCredential>), Error> {
    if let Some(path) = &security.token {
        let token = read_token(path)?;
        return Ok((Vec::new(), Some(ClientCredential::Token(token))));
    }
    if security.identity.pair()?.is_some() {
        return Ok((Vec::new(), Some(ClientCredential::Certificate)));
    }
    match for_client(file) {
        Ok(secret) => Ok((secret, None)),
        Err(no_secret) if file.is_none() => match discover_token()? {
            Some(token) => Ok((Vec::new(), Some(ClientCredential::Token(token)))),
            None => Err(Error::Usage(format!(
                "{no_secret}; or authenticate with --token FILE (or BEARER_TOKEN, \
                 BEARER_TOKEN_FILE), or --cert FILE --key FILE"
            ))),
        },
        Err(e) => Err(e),
    }
}

/// A token file's contents, trimmed; bounded as the protocol bounds it.
pub fn read_token(path: &Path) -> Result<Vec<u8>, Error> {
    let too_long = || {
        Error::Usage(format!(
            "{}: longer than a token may be ({MAX_TOKEN_BYTES} bytes)",
            path.display()
        ))
    };
    let meta = std::fs::metadata(path).map_err(|e| Error::local("reading", path.display(), e))?;
    if meta.len() > 2 * MAX_TOKEN_BYTES as u64 {
        return Err(too_long());
    }
    let bytes = std::fs::read(path).map_err(|e| Error::local("reading", path.display(), e))?;
    let token = trim(&bytes);
    if token.is_empty() {
        return Err(Error::Usage(format!(
            "{}: the token file is empty",
            path.display()
        )));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(too_long());
    }
    Ok(token.to_vec())
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &bytes[start..end]
}

/// WLCG bearer-token discovery: the BEARER_TOKEN variable, the file BEARER_TOKEN_FILE
/// names, or $XDG_RUNTIME_DIR/bt_u<UID>, whichever comes first.
fn discover_token() -> Result<Option<Vec<u8>>, Error> {
    if let Some(token) = std::env::var_os("BEARER_TOKEN") {
        use std::os::unix::ffi::OsStrExt;
        let token = trim(token.as_bytes());
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Error::Usage(format!(
                "BEARER_TOKEN: longer than a token may be ({MAX_TOKEN_BYTES} bytes)"
            )));
        }
        if !token.is_empty() {
            return Ok(Some(token.to_vec()));
        }
    }
    if let Some(file) = std::env::var_os("BEARER_TOKEN_FILE") {
        return read_token(Path::new(&file)).map(Some);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR") {
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let file = Path::new(&dir).join(format!("bt_u{uid}"));
        if file.exists() {
            return read_token(&file).map(Some);
        }
    }
    Ok(None)
}
