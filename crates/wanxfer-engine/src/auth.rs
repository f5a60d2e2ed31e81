//! Who a client is, and what it may do where: exports, identities and one decision.
//!
//! Why one function decides: sessions, remote operations and (later) third-party copies
//! all reach the disk, and each must ask the same question before touching it. So the
//! server resolves a client's path to an [`Export`] and a path inside it, then calls
//! [`authorize`] with the [`Identity`] the handshake established and the [`Access`] the
//! request needs; only on `Ok` does anything open, create or journal.
//!
//! Identities come from three places: the shared secret (the HMAC handshake), a bearer
//! token verified offline against the issuer's published keys ([`Issuers`], WLCG/SciTokens
//! profile), or the subject DN of an X.509 client certificate the TLS handshake verified
//! against `--client-ca`. An export lists, for reading and for writing, which identities
//! it admits; a token is further limited by its scopes (`storage.read:/path`,
//! `storage.create:/path`, `storage.modify:/path`), whose paths are taken relative to the
//! export and cover a path and everything beneath it. A list may instead name a token's
//! subject: the WLCG profile's identity-based authorization, for groups whose tokens
//! carry no storage scopes.
//!
//! What this does not do: fetch keys from the network (an issuer's JWKS is a file the
//! operator refreshes), revoke tokens (they are short-lived by design), or map identities
//! to Unix users (the server writes as itself).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use wanxfer_proto::RelPath;

use crate::fs::Root;
use crate::Error;

/// The audience every WLCG token may carry to mean "any server".
pub const ANY_AUDIENCE: &str = "https://wlcg.cern.ch/jwt/v1/any";

/// How far a token's `exp` and `nbf` may be off, for clocks that disagree a little.
pub const CLOCK_LEEWAY_SECS: u64 = 60;

/// Scopes a token may carry before it is refused (a token is at most 16 KiB anyway).
pub const MAX_SCOPES: usize = 256;

/// Who a client is, as the handshake established it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Identity {
    /// Proved knowledge of the server's shared secret.
    Secret,
    /// Presented a bearer token that verified.
    Token(Token),
    /// Presented an X.509 certificate verified against `--client-ca`; its subject DN.
    Certificate { subject: String },
}

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub issuer: String,
    pub subject: String,
    pub scopes: Vec<Scope>,
}

/// For logs (the transfer log records it): never the token itself.
impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Secret => f.write_str("shared secret"),
            Identity::Token(t) => write!(f, "token sub={} iss={}", t.subject, t.issuer),
            Identity::Certificate { subject } => write!(f, "certificate {subject}"),
        }
    }
}

/// What a request needs. Creating a name that does not exist is less than changing or
/// removing one that does, as the WLCG profile distinguishes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Stat, list, checksum, pull.
    Read,
    /// New files and directories only (a push to a new name, mkdir).
    Create,
    /// Replace, remove or rename what exists (a push over existing files, rm, mv).
    Modify,
}

impl Access {
    fn is_write(self) -> bool {
        !matches!(self, Access::Read)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Create => "create",
            Access::Modify => "modify",
        })
    }
}

/// One WLCG storage scope: an access and the path (relative to the export) it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub access: Access,
    /// Components without slashes; empty for the whole export.
    pub path: Vec<Vec<u8>>,
}

impl Scope {
    /// `storage.read:/a/b` and friends; `None` for scopes that are not storage scopes
    /// (a token may carry others, for other services) or whose path is not absolute.
    /// `storage.read` without a path means the whole export, as the profile says.
    pub fn parse(text: &str) -> Option<Scope> {
        let (name, path) = match text.split_once(':') {
            Some((name, path)) => (name, path),
            None => (text, "/"),
        };
        let access = match name {
            "storage.read" => Access::Read,
            "storage.create" => Access::Create,
            "storage.modify" => Access::Modify,
            _ => return None,
        };
        let rest = path.strip_prefix('/')?;
        let mut components = Vec::new();
        for c in rest.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if c == ".." {
                // A scope that climbs is malformed; it grants nothing.
                return None;
            }
            components.push(c.as_bytes().to_vec());
        }
        Some(Scope {
            access,
            path: components,
        })
    }

    /// Whether this scope grants `access` to `path` (relative to the export): its path is
    /// a prefix of `path` by whole components, and `modify` implies `create`.
    pub fn grants(&self, path: &RelPath, access: Access) -> bool {
        let kind = match (self.access, access) {
            (a, b) if a == b => true,
            (Access::Modify, Access::Create) => true,
            _ => false,
        };
        let mut components = path.components();
        kind && self
            .path
            .iter()
            .all(|want| components.next() == Some(want.as_slice()))
    }
}

/// Who an export admits, as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// `secret`: clients with the shared secret.
    Secret,
    /// `token:ISSUER`: tokens from this issuer, within their scopes.
    Token { issuer: String },
    /// `token:ISSUER#SUBJECT`: tokens of this issuer for this `sub` (an issuer URL has no
    /// fragment, so `#` cannot be part of it). Identity-based, as the WLCG profile allows:
    /// the list decides, and the token's storage scopes limit it only if it has any.
    TokenSubject { issuer: String, subject: String },
    /// `dn:SUBJECT`: a client certificate with exactly this subject DN.
    Subject { dn: String },
    /// `dn:*`: any client certificate `--client-ca` vouches for.
    AnyCertificate,
}

impl Grant {
    pub fn parse(text: &str) -> Result<Grant, String> {
        match text.split_once(':') {
            _ if text == "secret" => Ok(Grant::Secret),
            Some(("token", named)) => match named.split_once('#') {
                Some((issuer, subject)) if !issuer.is_empty() && !subject.is_empty() => {
                    Ok(Grant::TokenSubject {
                        issuer: issuer.to_string(),
                        subject: subject.to_string(),
                    })
                }
                None if !named.is_empty() => Ok(Grant::Token {
                    issuer: named.to_string(),
                }),
                _ => Err(format!(
                    "`{text}`: a token identity is `token:ISSUER` or `token:ISSUER#SUBJECT`"
                )),
            },
            Some(("dn", "*")) => Ok(Grant::AnyCertificate),
            Some(("dn", dn)) if !dn.is_empty() => Ok(Grant::Subject { dn: dn.to_string() }),
            _ => Err(format!(
                "`{text}`: an identity is `secret`, `token:ISSUER`, `token:ISSUER#SUBJECT`, \
                 `dn:SUBJECT DN` or `dn:*`"
            )),
        }
    }

    fn admits(&self, identity: &Identity) -> bool {
        match (self, identity) {
            (Grant::Secret, Identity::Secret) => true,
            (Grant::Token { issuer }, Identity::Token(t)) => *issuer == t.issuer,
            (Grant::TokenSubject { issuer, subject }, Identity::Token(t)) => {
                *issuer == t.issuer && *subject == t.subject
            }
            (Grant::Subject { dn }, Identity::Certificate { subject }) => dn == subject,
            (Grant::AnyCertificate, Identity::Certificate { .. }) => true,
            _ => false,
        }
    }
}

/// An export as configured, before its directory is opened.
#[derive(Debug, Clone)]
pub struct ExportConfig {
    /// The first component of URL paths (`wanxfer://host/NAME/...`).
    pub name: String,
    pub path: PathBuf,
    pub read: Vec<Grant>,
    pub write: Vec<Grant>,
}

/// A served directory and who may read and write in it.
#[derive(Debug)]
pub struct Export {
    /// Empty for the one unnamed export of `--root`.
    pub name: String,
    pub root: Root,
    pub read: Vec<Grant>,
    pub write: Vec<Grant>,
}

impl Export {
    /// A path inside this export as a client should see it: prefixed with the export's
    /// name, never the server's directory.
    pub fn show(&self, path: &RelPath) -> String {
        match (self.name.is_empty(), path.is_root()) {
            (true, _) => path.to_string(),
            (false, true) => self.name.clone(),
            (false, false) => format!("{}/{path}", self.name),
        }
    }
}

/// Every export of a server.
#[derive(Debug)]
pub struct Exports {
    list: Vec<Export>,
    /// URL paths start with an export's name (false: `--root` alone, paths as they are).
    named: bool,
}

impl Exports {
    /// `--root` alone: one unnamed export that the shared secret reads and writes, as
    /// before exports existed.
    pub fn single(root: Root) -> Exports {
        Exports {
            list: vec![Export {
                name: String::new(),
                root,
                read: vec![Grant::Secret],
                write: vec![Grant::Secret],
            }],
            named: false,
        }
    }

    /// Opens every configured export's directory; names must be single, distinct path
    /// components.
    pub fn open(configs: &[ExportConfig]) -> Result<Exports, Error> {
        let mut seen = HashSet::new();
        let mut list = Vec::new();
        for c in configs {
            if wanxfer_proto::check_name(c.name.as_bytes()).is_err()
                || c.name.starts_with(".wanxfer")
                || !seen.insert(c.name.clone())
            {
                return Err(Error::Usage(format!(
                    "export `{}`: a name must be one path component, not reserved, and unique",
                    c.name
                )));
            }
            list.push(Export {
                name: c.name.clone(),
                root: Root::open(&c.path)?,
                read: c.read.clone(),
                write: c.write.clone(),
            });
        }
        if list.is_empty() {
            return Err(Error::Usage("no export configured".into()));
        }
        Ok(Exports { list, named: true })
    }

    pub fn named(&self) -> bool {
        self.named
    }

    pub fn iter(&self) -> impl Iterator<Item = &Export> {
        self.list.iter()
    }

    /// The export a client's path names, and the path inside it.
    pub fn resolve(&self, path: &RelPath) -> Result<(&Export, RelPath), Error> {
        if !self.named {
            return Ok((&self.list[0], path.clone()));
        }
        let names = || {
            self.list
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let Some((first, rest)) = path.split_first() else {
            return Err(Error::Refused {
                path: "/".into(),
                reason: format!("name an export first: {}", names()),
            });
        };
        self.list
            .iter()
            .find(|e| e.name.as_bytes() == first)
            .map(|e| (e, rest))
            .ok_or_else(|| Error::Refused {
                path: String::from_utf8_lossy(first).into_owned(),
                reason: format!("no such export (this server has: {})", names()),
            })
    }
}

/// The one decision: may `identity` have `access` to `path` (relative to `export`)?
/// The export must admit the identity for reading or writing; a token must also carry
/// a scope that covers the path. The error names the path as the client wrote it.
pub fn authorize(
    identity: &Identity,
    export: &Export,
    path: &RelPath,
    access: Access,
) -> Result<(), Error> {
    let grants = if access.is_write() {
        &export.write
    } else {
        &export.read
    };
    let denied = |reason: String| Error::Denied {
        path: export.show(path),
        reason,
    };
    let mut admitted = grants.iter().filter(|g| g.admits(identity)).peekable();
    if admitted.peek().is_none() {
        let what = if access.is_write() { "write" } else { "read" };
        return Err(denied(format!(
            "{identity} may not {what} here (not in the export's `{what}` list)"
        )));
    }
    let by_subject = admitted.any(|g| matches!(g, Grant::TokenSubject { .. }));
    if let Identity::Token(token) = identity {
        // A subject the list names needs no scope; one the token carries still binds.
        let scoped = !(by_subject && token.scopes.is_empty());
        if scoped && !token.scopes.iter().any(|s| s.grants(path, access)) {
            let shown = format!("/{path}");
            return Err(denied(format!(
                "the token has no scope storage.{access}:{} or above it",
                if path.is_root() { "/" } else { &shown }
            )));
        }
    }
    Ok(())
}

/// An issuer as configured: its `iss` and the file of its public keys (JWKS).
#[derive(Debug, Clone)]
pub struct IssuerConfig {
    pub issuer: String,
    pub jwks: PathBuf,
}

struct IssuerKeys {
    /// By key id; a key without one is tried for tokens without a `kid`.
    keys: Vec<(Option<String>, Algorithm, DecodingKey)>,
}

/// The issuers whose tokens a server verifies, offline.
pub struct Issuers {
    by_issuer: HashMap<String, IssuerKeys>,
    audiences: Vec<String>,
}

impl fmt::Debug for Issuers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issuers")
            .field("issuers", &self.by_issuer.keys().collect::<Vec<_>>())
            .field("audiences", &self.audiences)
            .finish()
    }
}

#[derive(serde::Deserialize)]
struct Claims {
    iss: String,
    #[serde(default)]
    sub: String,
    #[serde(default)]
    scope: String,
}

#[derive(serde::Deserialize)]
struct IssuerOnly {
    iss: String,
}

impl Issuers {
    /// Reads every issuer's JWKS file; `audiences` are this server's names in tokens
    /// (the WLCG "any" audience is always accepted besides them).
    pub fn load(configs: &[IssuerConfig], audiences: &[String]) -> Result<Issuers, Error> {
        let mut by_issuer = HashMap::new();
        for c in configs {
            let keys = read_jwks(&c.jwks)?;
            if by_issuer
                .insert(c.issuer.clone(), IssuerKeys { keys })
                .is_some()
            {
                return Err(Error::Usage(format!(
                    "issuer `{}` configured twice",
                    c.issuer
                )));
            }
        }
        Ok(Issuers {
            by_issuer,
            audiences: audiences.to_vec(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.by_issuer.is_empty()
    }

    /// Verifies a token offline: signature by a key of its issuer (RS256 or ES256),
    /// `exp` and `nbf` (with [`CLOCK_LEEWAY_SECS`]), `iss`, `aud`. The identity it
    /// carries, or why not, in words a user can act on (never the token itself).
    pub fn verify(&self, token: &[u8], peer: &str) -> Result<Identity, Error> {
        let refused = |detail: String| Error::Auth {
            peer: peer.to_string(),
            detail: format!("token refused: {detail}"),
        };
        let text = std::str::from_utf8(token).map_err(|_| refused("not a JWT".into()))?;
        let text = text.trim();
        let header =
            jsonwebtoken::decode_header(text).map_err(|e| refused(format!("not a JWT ({e})")))?;
        if !matches!(header.alg, Algorithm::RS256 | Algorithm::ES256) {
            return Err(refused(format!(
                "signed with {:?}; this server verifies RS256 and ES256",
                header.alg
            )));
        }
        // Which issuer's keys to try is read before the signature is checked; nothing
        // else of the unverified token is used.
        let mut peek = Validation::new(header.alg);
        peek.insecure_disable_signature_validation();
        peek.validate_exp = false;
        peek.validate_aud = false;
        peek.required_spec_claims.clear();
        let issuer =
            jsonwebtoken::decode::<IssuerOnly>(text, &DecodingKey::from_secret(&[]), &peek)
                .map_err(|e| refused(format!("no issuer in it ({e})")))?
                .claims
                .iss;
        let Some(keys) = self.by_issuer.get(&issuer) else {
            return Err(refused(format!(
                "issuer {issuer} is not one this server trusts"
            )));
        };
        let candidates: Vec<&(Option<String>, Algorithm, DecodingKey)> = keys
            .keys
            .iter()
            .filter(|(kid, alg, _)| {
                *alg == header.alg && (header.kid.is_none() || *kid == header.kid)
            })
            .collect();
        if candidates.is_empty() {
            return Err(refused(format!(
                "issuer {issuer} has no {:?} key{} in its key set",
                header.alg,
                header
                    .kid
                    .as_ref()
                    .map(|k| format!(" with kid {k}"))
                    .unwrap_or_default()
            )));
        }
        let mut validation = Validation::new(header.alg);
        validation.leeway = CLOCK_LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.set_issuer(&[&issuer]);
        let mut audiences = self.audiences.clone();
        audiences.push(ANY_AUDIENCE.to_string());
        validation.set_audience(&audiences);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        let mut last = None;
        for (_, _, key) in candidates {
            match jsonwebtoken::decode::<Claims>(text, key, &validation) {
                Ok(data) => {
                    let claims = data.claims;
                    let scopes: Vec<Scope> = claims
                        .scope
                        .split_ascii_whitespace()
                        .take(MAX_SCOPES + 1)
                        .filter_map(Scope::parse)
                        .collect();
                    if scopes.len() > MAX_SCOPES {
                        return Err(refused(format!("more than {MAX_SCOPES} scopes")));
                    }
                    return Ok(Identity::Token(Token {
                        issuer: claims.iss,
                        subject: claims.sub,
                        scopes,
                    }));
                }
                Err(e) => last = Some(e),
            }
        }
        use jsonwebtoken::errors::ErrorKind;
        let e = last.expect("at least one key was tried");
        Err(refused(match e.kind() {
            ErrorKind::ExpiredSignature => "it has expired (exp is past)".into(),
            ErrorKind::ImmatureSignature => "it is not valid yet (nbf is ahead)".into(),
            ErrorKind::InvalidAudience => format!(
                "its audience is not this server's ({})",
                audiences.join(" or ")
            ),
            ErrorKind::InvalidIssuer => "its issuer does not match".into(),
            ErrorKind::InvalidSignature => {
                format!("its signature does not verify with issuer {issuer}'s keys")
            }
            ErrorKind::MissingRequiredClaim(c) => format!("it has no `{c}` claim"),
            _ => format!("{e}"),
        }))
    }
}

/// The keys of a JWKS file that this server can use (RSA for RS256, P-256 for ES256).
fn read_jwks(path: &Path) -> Result<Vec<(Option<String>, Algorithm, DecodingKey)>, Error> {
    let bad = |why: String| Error::Usage(format!("issuer keys {}: {why}", path.display()));
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::local("reading", path.display(), e))?;
    let set: JwkSet = serde_json::from_str(&text).map_err(|e| bad(format!("not a JWKS ({e})")))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let alg = match (&jwk.common.key_algorithm, &jwk.algorithm) {
            (Some(KeyAlgorithm::RS256), AlgorithmParameters::RSA(_)) => Algorithm::RS256,
            (Some(KeyAlgorithm::ES256), AlgorithmParameters::EllipticCurve(ec))
                if ec.curve == EllipticCurve::P256 =>
            {
                Algorithm::ES256
            }
            (None, AlgorithmParameters::RSA(_)) => Algorithm::RS256,
            (None, AlgorithmParameters::EllipticCurve(ec)) if ec.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            // Other algorithms are skipped: a key set may serve other verifiers too.
            _ => continue,
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| bad(e.to_string()))?;
        keys.push((jwk.common.key_id.clone(), alg, key));
    }
    if keys.is_empty() {
        return Err(bad("no RS256 or ES256 key in it".into()));
    }
    Ok(keys)
}

/// The identity of a client certificate (DER) the TLS handshake already verified: its
/// subject DN, written as `CN=alice, O=Example` in the certificate's order.
pub fn certificate_identity(der: &[u8]) -> Result<Identity, Error> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| {
        Error::Internal(format!("a verified client certificate did not parse: {e}"))
    })?;
    Ok(Identity::Certificate {
        subject: cert.subject().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(p: &str) -> RelPath {
        RelPath::new(p.as_bytes()).unwrap()
    }

    fn export(read: &[&str], write: &[&str]) -> (tempfile::TempDir, Export) {
        let dir = tempfile::tempdir().unwrap();
        let parse = |l: &[&str]| l.iter().map(|g| Grant::parse(g).unwrap()).collect();
        let export = Export {
            name: "data".into(),
            root: Root::open(dir.path()).unwrap(),
            read: parse(read),
            write: parse(write),
        };
        (dir, export)
    }

    fn token(scopes: &str) -> Identity {
        Identity::Token(Token {
            issuer: "https://iss".into(),
            subject: "alice".into(),
            scopes: scopes.split(' ').filter_map(Scope::parse).collect(),
        })
    }

    #[test]
    fn scopes_cover_their_path_and_below_by_whole_components() {
        let s = Scope::parse("storage.read:/a/b").unwrap();
        assert!(s.grants(&rel("a/b"), Access::Read));
        assert!(s.grants(&rel("a/b/c"), Access::Read));
        assert!(!s.grants(&rel("a/bc"), Access::Read));
        assert!(!s.grants(&rel("a"), Access::Read));
        assert!(!s.grants(&rel("a/b"), Access::Create));
        let m = Scope::parse("storage.modify:/").unwrap();
        assert!(m.grants(&rel("x"), Access::Create));
        assert!(m.grants(&RelPath::root(), Access::Modify));
        assert!(!m.grants(&rel("x"), Access::Read));
        let c = Scope::parse("storage.create:/up").unwrap();
        assert!(c.grants(&rel("up/new"), Access::Create));
        assert!(!c.grants(&rel("up/new"), Access::Modify));
        assert_eq!(Scope::parse("storage.read:/a/../b"), None);
        assert_eq!(Scope::parse("storage.read:relative"), None);
        assert_eq!(Scope::parse("compute.read:/"), None);
        assert_eq!(Scope::parse("storage.read").unwrap().path.len(), 0);
    }

    #[test]
    fn an_export_admits_only_its_listed_identities() {
        let (_d, e) = export(&["secret", "dn:*"], &["dn:CN=writer"]);
        let writer = Identity::Certificate {
            subject: "CN=writer".into(),
        };
        let reader = Identity::Certificate {
            subject: "CN=reader".into(),
        };
        assert!(authorize(&Identity::Secret, &e, &rel("x"), Access::Read).is_ok());
        let refused = authorize(&Identity::Secret, &e, &rel("x"), Access::Create).unwrap_err();
        assert!(matches!(refused, Error::Denied { ref path, .. } if path == "data/x"));
        assert!(authorize(&reader, &e, &rel("x"), Access::Read).is_ok());
        assert!(authorize(&reader, &e, &rel("x"), Access::Modify).is_err());
        assert!(authorize(&writer, &e, &rel("x"), Access::Modify).is_ok());
    }

    #[test]
    fn a_token_needs_its_issuer_listed_and_a_scope_for_the_path() {
        let (_d, e) = export(&["token:https://iss"], &["token:https://iss"]);
        let t = token("storage.read:/pub storage.create:/in");
        assert!(authorize(&t, &e, &rel("pub/a"), Access::Read).is_ok());
        assert!(authorize(&t, &e, &rel("in/a"), Access::Read).is_err());
        assert!(authorize(&t, &e, &rel("in/a"), Access::Create).is_ok());
        let e2 = authorize(&t, &e, &rel("in/a"), Access::Modify).unwrap_err();
        assert!(e2.to_string().contains("storage.modify:/in/a"), "{e2}");
        let (_d2, other) = export(&["token:https://elsewhere"], &[]);
        assert!(authorize(&t, &other, &rel("pub/a"), Access::Read).is_err());
    }

    #[test]
    fn a_token_subject_named_in_a_list_needs_no_scope_but_keeps_any_it_has() {
        let (_d, e) = export(
            &["token:https://iss"],
            &["token:https://iss#alice", "token:https://iss#carol"],
        );
        let unscoped = token("");
        assert!(authorize(&unscoped, &e, &rel("in/a"), Access::Modify).is_ok());
        // Reading goes by the read list, which names the issuer only: scopes needed.
        assert!(authorize(&unscoped, &e, &rel("in/a"), Access::Read).is_err());
        let scoped = token("storage.create:/in");
        assert!(authorize(&scoped, &e, &rel("in/a"), Access::Create).is_ok());
        assert!(authorize(&scoped, &e, &rel("out/a"), Access::Create).is_err());
        let bob = Identity::Token(Token {
            issuer: "https://iss".into(),
            subject: "bob".into(),
            scopes: Vec::new(),
        });
        let refused = authorize(&bob, &e, &rel("in/a"), Access::Create).unwrap_err();
        assert!(refused.to_string().contains("sub=bob"), "{refused}");
        let (_d2, other) = export(&[], &["token:https://elsewhere#alice"]);
        assert!(authorize(&unscoped, &other, &rel("a"), Access::Create).is_err());
    }

    #[test]
    fn identities_are_written_as_configured() {
        assert_eq!(Grant::parse("secret").unwrap(), Grant::Secret);
        assert_eq!(
            Grant::parse("dn:CN=a, O=b").unwrap(),
            Grant::Subject {
                dn: "CN=a, O=b".into()
            }
        );
        assert!(Grant::parse("token:").is_err());
        assert_eq!(
            Grant::parse("token:https://iss/wlcg#a1b2").unwrap(),
            Grant::TokenSubject {
                issuer: "https://iss/wlcg".into(),
                subject: "a1b2".into()
            }
        );
        assert!(Grant::parse("token:https://iss#").is_err());
        assert!(Grant::parse("token:#alice").is_err());
        assert!(Grant::parse("user:bob").is_err());
    }
}
