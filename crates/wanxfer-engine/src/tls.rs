//! TLS 1.3 on every TCP connection, and who the server is.
//!
//! Encryption is the default because a DTN's data crosses networks its operators do not
//! run; a session goes without it only when both sides say so (`cp --no-encryption`,
//! `serve --allow-unencrypted`), and even then every control frame and every block is
//! authenticated (see [`crate::stream`]). TLS is chosen by the connection's first bytes,
//! never by a negotiated bit, so nobody on the path can talk a client out of it.
//!
//! The cipher is the floor of a transfer on a host without a spare core, so the suite
//! order is chosen for speed: AES-128-GCM first (ring's AES-NI and carry-less-multiply
//! code; `examples/cipher_cost.rs` measures it against AES-256-GCM and ChaCha20-Poly1305
//! here), ChaCha20-Poly1305 first instead on a CPU without AES instructions, where it is
//! several times faster than table-based AES. Only TLS 1.3: one round trip, and no
//! renegotiation or CBC suites to reason about.
//!
//! Who the server is: a server without `--cert`/`--key` creates a key and a self-signed
//! certificate on its first start (beside its state, mode 0600) and prints the SHA-256
//! fingerprint. A client pins the fingerprint per `HOST:PORT` on first use, in
//! `known_hosts` in its state directory, as SSH does, and refuses a different one with a
//! message saying what changed and how to accept it. The pin is written only after the
//! server proved it knows the shared secret, so a stranger answering first cannot plant
//! its own certificate. With `--ca FILE` the client verifies a CA-issued chain and the
//! host name instead. This module does not authenticate clients: the shared secret's
//! proof, bound to the TLS connection, does (see `wanxfer_proto::handshake`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{ring as provider, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

pub use crate::session::conn::Deadline;
use crate::Error;

/// The cipher suites, fastest first on this CPU.
pub fn cipher_suites() -> Vec<rustls::SupportedCipherSuite> {
    use provider::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    if has_aes_instructions() {
        vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
        ]
    } else {
        vec![
            TLS13_CHACHA20_POLY1305_SHA256,
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
        ]
    }
}

fn has_aes_instructions() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// ring's provider with [`cipher_suites`] in that order.
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(CryptoProvider {
        cipher_suites: cipher_suites(),
        ..provider::default_provider()
    })
}

/// The SHA-256 of a certificate's DER bytes, as printed and pinned: `SHA256:` and hex.
pub fn fingerprint(cert: &[u8]) -> String {
    let digest = Sha256::digest(cert);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("SHA256:{hex}")
}

/// The server's certificate chain and key.
pub struct ServerIdentity {
    pub chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    /// The fingerprint of the first certificate of the chain.
    pub fingerprint: String,
    /// Where it came from, and whether it was created just now.
    pub origin: String,
    pub created: bool,
}

impl std::fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerIdentity")
            .field("fingerprint", &self.fingerprint)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl Clone for ServerIdentity {
    fn clone(&self) -> Self {
        ServerIdentity {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            fingerprint: self.fingerprint.clone(),
            origin: self.origin.clone(),
            created: self.created,
        }
    }
}

/// File names of a generated identity, in the server's state directory.
pub const KEY_FILE: &str = "server-key.pem";
pub const CERT_FILE: &str = "server-cert.pem";

impl ServerIdentity {
    /// A certificate chain and key from PEM files (`serve --cert --key`).
    pub fn from_files(cert: &Path, key: &Path) -> Result<ServerIdentity, Error> {
        let chain = CertificateDer::pem_file_iter(cert)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| pem_error(cert, "certificates", e))?;
        if chain.is_empty() {
            return Err(Error::Usage(format!(
                "{}: no certificate in it (PEM \"BEGIN CERTIFICATE\" blocks)",
                cert.display()
            )));
        }
        let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| pem_error(key, "a key", e))?;
        let fingerprint = fingerprint(&chain[0]);
        Ok(ServerIdentity {
            chain,
            key: key_der,
            fingerprint,
            origin: cert.display().to_string(),
            created: false,
        })
    }

    /// The identity kept in `dir`, created there (key and certificate, mode 0600) if
    /// it has none yet.
    pub fn load_or_create(dir: &Path) -> Result<ServerIdentity, Error> {
        let (key, cert) = (dir.join(KEY_FILE), dir.join(CERT_FILE));
        if key.exists() || cert.exists() {
            return ServerIdentity::from_files(&cert, &key);
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::local("create", dir.display(), e))?;
        let made = ServerIdentity::generate()?;
        let key_pem = made.key_pem.clone();
        write_private(&key, key_pem.as_bytes())?;
        write_private(&cert, made.cert_pem.as_bytes())?;
        let mut identity = ServerIdentity::from_files(&cert, &key)?;
        identity.created = true;
        Ok(identity)
    }

    /// A fresh self-signed identity in memory (a server without a state directory).
    pub fn ephemeral() -> Result<ServerIdentity, Error> {
        let made = ServerIdentity::generate()?;
        let chain = vec![CertificateDer::from_pem_slice(made.cert_pem.as_bytes())
            .map_err(|e| Error::Internal(format!("a generated certificate: {e}")))?];
        let key = PrivateKeyDer::from_pem_slice(made.key_pem.as_bytes())
            .map_err(|e| Error::Internal(format!("a generated key: {e}")))?;
        Ok(ServerIdentity {
            fingerprint: fingerprint(&chain[0]),
            chain,
            key,
            origin: "generated for this run only".into(),
            created: true,
        })
    }

    fn generate() -> Result<Generated, Error> {
        let host = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        let mut names = vec!["wanxfer-server".to_string()];
        if !host.is_empty() {
            names.push(host);
        }
        let made = rcgen::generate_simple_self_signed(names)
            .map_err(|e| Error::Internal(format!("generating the server's certificate: {e}")))?;
        Ok(Generated {
            key_pem: made.signing_key.serialize_pem(),
            cert_pem: made.cert.pem(),
        })
    }

    /// A rustls configuration serving this identity.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, Error> {
        self.server_config_with(None)
    }

    /// A rustls configuration serving this identity that also asks clients for a
    /// certificate issued by `client_ca` (PEM). Asks, not requires: clients with the
    /// secret or a token present none, and a client that says it authenticates by its
    /// certificate without presenting one is refused after the handshake, by name.
    pub fn server_config_with(
        &self,
        client_ca: Option<&Path>,
    ) -> Result<Arc<rustls::ServerConfig>, Error> {
        let provider = crypto_provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Internal(format!("TLS configuration: {e}")))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(file) => {
                let mut roots = rustls::RootCertStore::empty();
                let certs = CertificateDer::pem_file_iter(file)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| pem_error(file, "client CA certificates", e))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(Error::Usage(format!(
                        "--client-ca {}: no usable CA certificate in it",
                        file.display()
                    )));
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| Error::Usage(format!("--client-ca {}: {e}", file.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| {
                Error::Usage(format!(
                    "the server's certificate and key ({}): {e}",
                    self.origin
                ))
            })?;
        // The server greets in its first flight (0.5-RTT data): the greeting carries only
        // a nonce and feature bits, and sending it early saves the client a round trip.
        config.send_half_rtt_data = true;
        // No resumption is used: tickets would only be post-handshake bytes that kernel
        // TLS would have to skip.
        config.send_tls13_tickets = 0;
        config.enable_secret_extraction = true;
        Ok(Arc::new(config))
    }
}

struct Generated {
    key_pem: String,
    cert_pem: String,
}

fn pem_error(path: &Path, what: &str, e: rustls::pki_types::pem::Error) -> Error {
    match e {
        rustls::pki_types::pem::Error::Io(io) => Error::local("read", path.display(), io),
        other => Error::Usage(format!(
            "{}: cannot read {what} from it as PEM: {other:?}",
            path.display()
        )),
    }
}

/// Writes a new file readable by its owner only.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::local("create", path.display(), e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::local("write", path.display(), e))
}

/// How a client decides the server is the one it means.
#[derive(Debug, Clone)]
pub enum Trust {
    /// Pin the certificate's fingerprint per `HOST:PORT` in this file on first use.
    Pinned { known_hosts: PathBuf },
    /// Verify the chain against these CA certificates (PEM), and the host name.
    Ca(PathBuf),
    /// Accept exactly the certificate with this fingerprint (`SHA256:hex`), and pin
    /// nothing: a third-party copy's source reaching the destination whose certificate
    /// the client verified.
    Exact(String),
}

/// Whether a client encrypts, and whom it trusts.
#[derive(Debug, Clone)]
pub enum ClientSecurity {
    /// TLS, the server verified against `ca` (`--ca FILE`) or, without one, pinned on
    /// first use in the state directory's `known_hosts`.
    Tls { ca: Option<PathBuf> },
    /// `--no-encryption`: plaintext, every frame and block authenticated.
    Unencrypted,
    /// TLS to a server that must present exactly the certificate with this fingerprint
    /// (`SHA256:hex`); see [`Trust::Exact`].
    Fingerprint(String),
}

impl Default for ClientSecurity {
    fn default() -> Self {
        ClientSecurity::Tls { ca: None }
    }
}

/// Whether the kernel offers TLS (`TCP_ULP` `tls`), probed once on a loopback
/// connection of our own; `Err` says why not.
pub fn kernel_offers_tls() -> Result<(), String> {
    static PROBED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    PROBED
        .get_or_init(|| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            let probe = TcpStream::connect(addr).map_err(|e| e.to_string())?;
            let _peer = listener.accept().map_err(|e| e.to_string())?;
            crate::ktls::attach_ulp(&probe)
                .map_err(|e| format!("setsockopt(TCP_ULP, \"tls\"): {e}"))
        })
        .clone()
}

/// Where a client pins server certificates, in its state directory.
pub fn known_hosts_in(state_dir: &Path) -> PathBuf {
    state_dir.join("known_hosts")
}

/// The pins a client keeps: one line per server, `HOST:PORT SHA256:hex`.
#[derive(Debug)]
pub struct KnownHosts {
    path: PathBuf,
}

/// What the store says of a server.
#[derive(Debug, PartialEq, Eq)]
pub enum Pin {
    Unknown,
    Same,
    /// Another fingerprint is pinned, on this line of the file.
    Changed {
        pinned: String,
        line: usize,
    },
}

impl KnownHosts {
    pub fn new(path: PathBuf) -> KnownHosts {
        KnownHosts { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What is pinned for `server` (`HOST:PORT`), against `seen`.
    pub fn check(&self, server: &str, seen: &str) -> Result<Pin, Error> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Pin::Unknown),
            Err(e) => return Err(Error::local("read", self.path.display(), e)),
        };
        for (at, line) in text.lines().enumerate() {
            let mut words = line.split_whitespace();
            let (Some(host), Some(pinned)) = (words.next(), words.next()) else {
                continue;
            };
            if host.starts_with('#') || host != server {
                continue;
            }
            return Ok(if pinned == seen {
                Pin::Same
            } else {
                Pin::Changed {
                    pinned: pinned.to_string(),
                    line: at + 1,
                }
            });
        }
        Ok(Pin::Unknown)
    }

    /// Pins `fingerprint` for `server` (appends a line; the file is created mode 0600).
    pub fn pin(&self, server: &str, fingerprint: &str) -> Result<(), Error> {
        use std::os::unix::fs::OpenOptionsExt;
        if server.chars().any(char::is_whitespace) {
            return Err(Error::Usage(format!("{server:?}: not a HOST:PORT")));
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::local("create", dir.display(), e))?;
        }
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)
            .map_err(|e| Error::local("open", self.path.display(), e))?;
        file.write_all(format!("{server} {fingerprint}\n").as_bytes())
            .map_err(|e| Error::local("write", self.path.display(), e))
    }
}

/// What the certificate check on one connection found, for the caller to act on once
/// the handshake is over (pin it, or explain a refusal).
#[derive(Debug, Default)]
pub struct Seen {
    /// The fingerprint the server presented.
    pub fingerprint: Option<String>,
    /// Not pinned yet: the caller pins it once the server proved it knows the secret.
    pub first_use: bool,
    /// Why the certificate was refused, in words for the user.
    pub refusal: Option<String>,
}

/// A certificate verifier that pins fingerprints per `HOST:PORT`. The handshake's
/// signature is still checked against the certificate's key, so a copied certificate
/// without its key gets nobody in.
#[derive(Debug)]
struct PinVerifier {
    server: String,
    store: KnownHosts,
    /// Instead of the store: the one fingerprint accepted.
    exact: Option<String>,
    seen: Arc<Mutex<Seen>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let seen_fp = fingerprint(end_entity);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.fingerprint = Some(seen_fp.clone());
        if let Some(exact) = &self.exact {
            if *exact == seen_fp {
                return Ok(ServerCertVerified::assertion());
            }
            seen.refusal = Some(format!(
                "{} presents the certificate {seen_fp}, not {exact}, the one the client \
                 verified there: refusing to send it anything",
                self.server
            ));
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ));
        }
        let pin = self
            .store
            .check(&self.server, &seen_fp)
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        match pin {
            Pin::Same => Ok(ServerCertVerified::assertion()),
            Pin::Unknown => {
                seen.first_use = true;
                Ok(ServerCertVerified::assertion())
            }
            Pin::Changed { pinned, line } => {
                seen.refusal = Some(format!(
                    "the server's certificate changed: {} line {line} pins {pinned} for {}, \
                     but the server now presents {seen_fp}. Someone may be intercepting the \
                     connection, or the server's key was replaced. If its operator confirms \
                     the new fingerprint (`wanxfer serve` prints it when it starts), delete \
                     that line to accept it",
                    self.store.path.display(),
                    self.server,
                ));
                Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::ApplicationVerificationFailure,
                ))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Only TLS 1.3 is offered; a TLS 1.2 signature means something is wrong.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls13RequiredForQuic,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// rustls's own chain verification against `--ca`, which also records the certificate it
/// accepted: a third-party copy tells its source to expect exactly that one.
#[derive(Debug)]
struct CaVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    seen: Arc<Mutex<Seen>>,
}

impl ServerCertVerifier for CaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fingerprint = Some(fingerprint(end_entity));
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client's TLS set-up for one server: its rustls configuration and the record of what
/// the certificate check saw.
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
    pub name: ServerName<'static>,
    pub seen: Arc<Mutex<Seen>>,
    known_hosts: Option<KnownHosts>,
}

impl ClientTls {
    /// The configuration for connections to `server` (`HOST:PORT`).
    pub fn new(server: &str, trust: &Trust) -> Result<ClientTls, Error> {
        ClientTls::with_client_cert(server, trust, None)
    }

    /// The same, presenting the certificate chain and key `client_cert` (PEM files) to a
    /// server that asks for one (mutual TLS).
    pub fn with_client_cert(
        server: &str,
        trust: &Trust,
        client_cert: Option<&(PathBuf, PathBuf)>,
    ) -> Result<ClientTls, Error> {
        let host = host_of(server);
        let name = ServerName::try_from(host.to_string())
            .map_err(|_| Error::Usage(format!("{server}: not a host name or address for TLS")))?;
        let provider = crypto_provider();
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Internal(format!("TLS configuration: {e}")))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (builder, known_hosts) = match trust {
            Trust::Pinned { known_hosts } => (
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(PinVerifier {
                        server: server.to_string(),
                        store: KnownHosts::new(known_hosts.clone()),
                        exact: None,
                        seen: seen.clone(),
                        provider,
                    })),
                Some(KnownHosts::new(known_hosts.clone())),
            ),
            Trust::Exact(fingerprint) => (
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(PinVerifier {
                        server: server.to_string(),
                        store: KnownHosts::new(PathBuf::new()),
                        exact: Some(fingerprint.clone()),
                        seen: seen.clone(),
                        provider,
                    })),
                None,
            ),
            Trust::Ca(file) => {
                let mut roots = rustls::RootCertStore::empty();
                let certs = CertificateDer::pem_file_iter(file)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| pem_error(file, "CA certificates", e))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(Error::Usage(format!(
                        "--ca {}: no usable CA certificate in it",
                        file.display()
                    )));
                }
                let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| Error::Usage(format!("--ca {}: {e}", file.display())))?;
                let verifier = CaVerifier {
                    inner,
                    seen: seen.clone(),
                };
                (
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(verifier)),
                    None,
                )
            }
        };
        let mut config = match client_cert {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let own = ServerIdentity::from_files(cert, key)?;
                builder
                    .with_client_auth_cert(own.chain.clone(), own.key.clone_key())
                    .map_err(|e| {
                        Error::Usage(format!(
                            "the client certificate and key ({}, {}): {e}",
                            cert.display(),
                            key.display()
                        ))
                    })?
            }
        };
        config.enable_secret_extraction = true;
        config.resumption = rustls::client::Resumption::disabled();
        Ok(ClientTls {
            config: Arc::new(config),
            name,
            seen,
            known_hosts,
        })
    }

    /// Pins the certificate seen on first use; called once the server has proved it
    /// knows the shared secret. Logged at info level: a warning would land in the middle
    /// of the progress bar on every first contact.
    pub fn pin_if_new(&self, server: &str) -> Result<(), Error> {
        let (Some(store), seen) = (
            &self.known_hosts,
            self.seen.lock().unwrap_or_else(|e| e.into_inner()),
        ) else {
            return Ok(());
        };
        if let (true, Some(fp)) = (seen.first_use, &seen.fingerprint) {
            if store.check(server, fp)? == Pin::Unknown {
                store.pin(server, fp)?;
                tracing::info!(
                    "pinned {server}'s certificate {fp} on first use (in {})",
                    store.path().display()
                );
            }
        }
        Ok(())
    }
}

/// The host part of `HOST:PORT` (`[v6]:PORT` too).
fn host_of(server: &str) -> &str {
    let host = match server.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => server,
    };
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The first byte of a TLS handshake record: how a server tells a TLS client from a
/// plaintext one (whose preamble starts with `W`).
pub const HANDSHAKE_RECORD: u8 = 0x16;

/// Runs a TLS handshake on `tcp` to completion within `deadline`, sending what rustls
/// queues and feeding it what arrives; an alert it owes the peer goes out before the
/// error is returned.
pub(crate) fn drive_handshake(
    tcp: &mut TcpStream,
    conn: &mut rustls::Connection,
    deadline: Deadline,
    peer: &str,
) -> Result<Vec<u8>, Error> {
    // Room for the largest record rustls accepts, so that a whole one always fits.
    let mut buf = vec![0u8; 2 * MAX_WIRE_RECORD];
    let mut have = 0;
    loop {
        while conn.wants_write() {
            let mut out = Vec::new();
            conn.write_tls(&mut out)
                .map_err(|e| Error::network("sending to", peer, e))?;
            crate::session::conn::write_all_by(tcp, &out, deadline, peer)?;
        }
        if !conn.is_handshaking() {
            // What follows the handshake is the stream's: rustls gets it record by record.
            buf.truncate(have);
            return Ok(buf);
        }
        let n = crate::session::conn::read_some_by(tcp, &mut buf[have..], deadline, peer, "TLS")?;
        have += n;
        let mut fed = 0;
        while conn.is_handshaking() {
            let Some(len) = whole_record(&buf[fed..have]) else {
                break;
            };
            if let Err(e) = give_record(conn, &buf[fed..fed + len]) {
                // The alert that says why, for the peer's log.
                let mut out = Vec::new();
                let _ = conn.write_tls(&mut out);
                let _ = tcp.write_all(&out);
                let refused = e.get_ref().is_some_and(|i| i.is::<rustls::Error>());
                return Err(match e.into_inner() {
                    Some(inner) if refused => match inner.downcast::<rustls::Error>() {
                        Ok(tls) => tls_error(peer, *tls),
                        Err(other) => Error::network("receiving from", peer, other_io(other)),
                    },
                    Some(inner) => Error::network("receiving from", peer, other_io(inner)),
                    None => Error::protocol(peer, "TLS: the handshake failed"),
                });
            }
            fed += len;
        }
        buf.copy_within(fed..have, 0);
        have -= fed;
    }
}

fn other_io(e: Box<dyn std::error::Error + Send + Sync>) -> std::io::Error {
    std::io::Error::other(e)
}

/// The largest record rustls reads: header, 2^14 bytes and 2 KiB of expansion.
const MAX_WIRE_RECORD: usize = 5 + (1 << 14) + 2048;

/// The length of the record `bytes` start with, if they hold all of it. A header that
/// claims more than any record may hold counts as whole, so that rustls refuses it.
pub(crate) fn whole_record(bytes: &[u8]) -> Option<usize> {
    // Not a record at all (a web or SSH server answering): whole as it is, so that rustls
    // refuses it now instead of after waiting for a length read out of text.
    if bytes.first().is_some_and(|kind| !(20..=24).contains(kind)) {
        return Some(bytes.len());
    }
    let header = bytes.get(..5)?;
    let len = 5 + u16::from_be_bytes([header[3], header[4]]) as usize;
    if len > MAX_WIRE_RECORD {
        return Some(bytes.len());
    }
    (bytes.len() >= len).then_some(len)
}

/// Gives rustls one whole record and processes it, so that rustls never holds the start
/// of a record: then everything it has not opened is still in the caller's buffer (see
/// `Stream::own_records`). `ErrorKind::Other` before anything was taken: its plaintext
/// buffer is full.
pub(crate) fn give_record(conn: &mut rustls::Connection, record: &[u8]) -> std::io::Result<()> {
    let mut rest = record;
    conn.read_tls(&mut rest)?;
    while !rest.is_empty() {
        // Plaintext grows only in `process_new_packets`, so rustls cannot fill up here.
        conn.read_tls(&mut rest)?;
    }
    conn.process_new_packets().map_err(io_error)?;
    Ok(())
}

/// Connects to `server` as a client does (TLS unless `tls` is `None`), within
/// `timeout`, which also bounds how long a silent peer is waited for afterwards: for
/// tools and tests that speak the protocol by hand.
pub fn connect(
    server: &str,
    tls: Option<&ClientTls>,
    timeout: std::time::Duration,
) -> Result<crate::stream::Stream, Error> {
    crate::session::conn::connect_secure(server, tls, Deadline::after(timeout), timeout)
}

/// As [`connect`], on a TCP connection the caller made (from an address of its
/// choosing, say).
pub fn connect_over(
    tcp: TcpStream,
    server: &str,
    tls: Option<&ClientTls>,
    timeout: std::time::Duration,
) -> Result<crate::stream::Stream, Error> {
    crate::session::conn::secure(tcp, server, tls, Deadline::after(timeout))
}

/// The server's side of a TLS connection accepted on `tcp`: `greeting` goes out in the
/// server's first flight, and the handshake completes within `deadline`.
pub fn accept(
    mut tcp: TcpStream,
    config: &Arc<rustls::ServerConfig>,
    greeting: &[u8],
    deadline: Deadline,
    peer: &str,
) -> Result<crate::stream::Stream, Error> {
    let server = rustls::ServerConnection::new(config.clone()).map_err(|e| tls_error(peer, e))?;
    let mut conn = rustls::Connection::Server(server);
    // Queued before the handshake: rustls sends it right after its Finished (0.5-RTT).
    conn.writer()
        .write_all(greeting)
        .map_err(|e| Error::network("sending to", peer, e))?;
    let unread = drive_handshake(&mut tcp, &mut conn, deadline, peer)?;
    crate::stream::Stream::tls(tcp, conn, &unread).map_err(|e| tls_error(peer, e))
}

/// A rustls error as the engine's: a certificate problem is an authentication failure,
/// the rest the peer's or the network's.
pub(crate) fn tls_error(peer: &str, e: rustls::Error) -> Error {
    match e {
        rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType) => {
            Error::protocol(
                peer,
                "it does not answer in TLS: a wanxfer server older than protocol 6, or \
                 not a wanxfer server",
            )
        }
        rustls::Error::InvalidCertificate(cert) => Error::Auth {
            peer: peer.to_string(),
            detail: format!("TLS: the server's certificate: {cert}"),
        },
        rustls::Error::AlertReceived(alert) => Error::Auth {
            peer: peer.to_string(),
            detail: format!("TLS: the peer refused the handshake ({alert:?})"),
        },
        other => Error::protocol(peer, format!("TLS: {other}")),
    }
}

/// An I/O error carrying a rustls error (for `Read`/`Write` implementations).
pub(crate) fn io_error(e: rustls::Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// Drains bytes rustls queued into `out`.
pub(crate) fn take_tls(conn: &mut rustls::Connection, out: &mut Vec<u8>) -> std::io::Result<()> {
    while conn.wants_write() {
        conn.write_tls(out)?;
    }
    Ok(())
}

/// Reads at most `buf.len()` bytes (used by `Stream`); `Ok(0)` is the end.
pub(crate) fn read_socket(tcp: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match (&*tcp).read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_ports_split_for_server_names() {
        assert_eq!(host_of("dtn1.example.org:7800"), "dtn1.example.org");
        assert_eq!(host_of("127.0.0.1:7800"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7800"), "::1");
        assert_eq!(host_of("dtn1"), "dtn1");
    }

    /// The store answers unknown, same or changed per `HOST:PORT`, names the line a
    /// changed pin is on, and keeps its file private.
    #[test]
    fn known_hosts_pin_and_detect_a_change() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let store = KnownHosts::new(dir.path().join("state/known_hosts"));
        assert_eq!(store.check("a:1", "SHA256:aa").unwrap(), Pin::Unknown);
        store.pin("a:1", "SHA256:aa").unwrap();
        store.pin("b:2", "SHA256:bb").unwrap();
        assert_eq!(store.check("a:1", "SHA256:aa").unwrap(), Pin::Same);
        assert_eq!(store.check("a:2", "SHA256:aa").unwrap(), Pin::Unknown);
        assert_eq!(
            store.check("b:2", "SHA256:cc").unwrap(),
            Pin::Changed {
                pinned: "SHA256:bb".into(),
                line: 2
            }
        );
        let mode = std::fs::metadata(store.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(store.pin("a b:1", "SHA256:aa").is_err());
    }

    /// A created identity is kept private, reloaded unchanged on the next start, and its
    /// fingerprint is that of the certificate file.
    #[test]
    fn a_server_identity_is_created_once_and_kept_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let first = ServerIdentity::load_or_create(dir.path()).unwrap();
        assert!(first.created);
        for file in [KEY_FILE, CERT_FILE] {
            let mode = std::fs::metadata(dir.path().join(file))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{file}");
        }
        let again = ServerIdentity::load_or_create(dir.path()).unwrap();
        assert!(!again.created);
        assert_eq!(first.fingerprint, again.fingerprint);
        assert!(first.fingerprint.starts_with("SHA256:") && first.fingerprint.len() == 71);
        first.server_config().unwrap();
    }

    #[test]
    fn unreadable_identity_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.pem"), "not pem").unwrap();
        let e = ServerIdentity::from_files(&dir.path().join("c.pem"), &dir.path().join("k.pem"))
            .unwrap_err();
        assert!(e.to_string().contains("c.pem"), "{e}");
    }
}
