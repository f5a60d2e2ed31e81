//! Where the shared secret comes from: a file (created with a fresh random secret and mode
//! 0600 on the server if missing) or the WANXFER_SECRET environment variable.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use wanxfer_engine::secret::{from_env, read_file, SECRET_ENV as ENV};
use wanxfer_engine::Error;

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
